//! Demand estimates made at submit time, and the request fields they cover. The gate
//! reserves these; reconciliation replaces them with the provider's reported usage. A
//! request is forwarded as the client wrote it (plus the output cap below), so every field
//! a provider charges for is either reserved for here or refused by [`check`] before the
//! job exists: nothing a tenant sends can make a call cost more than its reservation.
//!
//! Input tokens ([`input_tokens`]): the text the provider reads, counted the larger of two
//! ways, plus the images. The text is each message's content, its other fields (name, tool
//! calls, tool call id) as JSON, and the request's definitions — `tools`, `functions`,
//! `tool_choice`, `response_format` with its JSON schema — as JSON. The character rule
//! (about four characters a token, plus a per-message overhead) is what OpenAI-style
//! providers charge against TPM at request time, so a reservation must never be below it;
//! where the model's encoding is known (OpenAI's o200k and cl100k families) the exact BPE
//! count is taken too, which is larger for text the character rule underestimates (code,
//! numbers, JSON, CJK). Images are billed as OpenAI's vision guide says for the model's
//! family ([`image_tokens`]): from the image's size where a data URL shows it, else the
//! largest bill its detail level can come to.
//!
//! Output tokens ([`output_tokens`]): the cap per choice ([`output_cap`]: the request's
//! `max_completion_tokens` or `max_tokens`, else [`DEFAULT_OUTPUT_TOKENS`]) times the
//! choices generated ([`choices`]: `n`, or `best_of` where larger), plus a predicted
//! output's tokens per choice (OpenAI bills rejected prediction tokens as completion
//! tokens). The adapters send [`output_cap`] to every provider when the request has no
//! cap, so a provider can never generate more than was reserved.
//!
//! Refused ([`check`], `unsupported_field`): audio in or out, file parts, web search, and a
//! `service_tier` priced above the standard rates the configured prices describe; a bad
//! `n`/`best_of` is `invalid_request`.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bpe_openai::Tokenizer;
use serde_json::Value;

use crate::vocab::{ApiErrorCode, Endpoint};

/// The output cap per choice of a request that sets neither `max_tokens` nor
/// `max_completion_tokens`: reserved by the gate and sent to the provider, so the two agree.
pub const DEFAULT_OUTPUT_TOKENS: i32 = 1024;

/// Most choices a request may ask for (`n`, `best_of`): OpenAI's documented maximum.
pub const MAX_CHOICES: i64 = 128;

/// `service_tier` values billed at the standard rates (or below: `flex`). `auto` runs at the
/// tier the provider project is configured for, which the operator's prices describe.
const STANDARD_TIERS: [&str; 3] = ["auto", "default", "flex"];

/// A request the estimate cannot reserve for, refused before it becomes a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: ApiErrorCode,
    /// The field, relative to the request (`n`, `messages[0].content[1].type`).
    pub param: String,
    pub message: String,
}

impl Refusal {
    fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: ApiErrorCode::UnsupportedField,
            param: param.into(),
            message: message.into(),
        }
    }

    fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: ApiErrorCode::InvalidRequest,
            param: param.into(),
            message: message.into(),
        }
    }
}

/// Refuses the fields whose cost cannot be reserved: audio input parts, `audio` output
/// (or `modalities` with audio), file parts, content parts of other types, web search,
/// `service_tier` values priced above standard, and `n`/`best_of` outside 1..=128.
pub fn check(request: &Value) -> Result<(), Refusal> {
    for key in ["n", "best_of"] {
        if field(request, key).is_some_and(|v| !v.as_i64().is_some_and(|n| (1..=MAX_CHOICES).contains(&n))) {
            return Err(Refusal::invalid(
                key,
                format!("`{key}` must be an integer from 1 to {MAX_CHOICES}"),
            ));
        }
    }
    match field(request, "service_tier") {
        None => {}
        Some(Value::String(tier)) if STANDARD_TIERS.contains(&tier.as_str()) => {}
        Some(Value::String(tier)) => {
            return Err(Refusal::unsupported(
                "service_tier",
                format!(
                    "`service_tier` {tier:?} is billed above the standard rates tollgate reserves spend by; send auto, default or flex"
                ),
            ));
        }
        Some(_) => {
            return Err(Refusal::invalid(
                "service_tier",
                "`service_tier` must be a string",
            ));
        }
    }
    let audio_out = field(request, "modalities")
        .and_then(Value::as_array)
        .is_some_and(|m| m.iter().any(|v| v == "audio"));
    if audio_out || field(request, "audio").is_some() {
        let param = if audio_out { "modalities" } else { "audio" };
        return Err(Refusal::unsupported(
            param,
            "audio output is billed per audio token at its own rate, which tollgate cannot reserve; ask for text",
        ));
    }
    if field(request, "web_search_options").is_some() {
        return Err(Refusal::unsupported(
            "web_search_options",
            "web search is billed per search call, which tollgate cannot reserve",
        ));
    }
    for (i, m) in messages(request).enumerate() {
        if field(m, "audio").is_some() {
            return Err(Refusal::unsupported(
                format!("messages[{i}].audio"),
                "audio in messages is billed per audio token, which tollgate cannot reserve",
            ));
        }
        let Some(parts) = m.get("content").and_then(Value::as_array) else {
            continue;
        };
        for (j, part) in parts.iter().enumerate() {
            let at = format!("messages[{i}].content[{j}].type");
            match part.get("type").and_then(Value::as_str) {
                Some("text" | "refusal" | "image_url") => {}
                Some("input_audio") => {
                    return Err(Refusal::unsupported(
                        at,
                        "audio input is billed by its length, which tollgate cannot reserve without decoding it",
                    ));
                }
                Some("file") => {
                    return Err(Refusal::unsupported(
                        at,
                        "file inputs are billed by their extracted text and page images, which tollgate cannot reserve",
                    ));
                }
                Some(other) => {
                    return Err(Refusal::unsupported(
                        at,
                        format!(
                            "content parts of type {other:?} are not ones tollgate can reserve for; use text or image_url"
                        ),
                    ));
                }
                None => {
                    return Err(Refusal::invalid(at, "each content part needs a `type`"));
                }
            }
        }
    }
    Ok(())
}

/// Tokens to reserve for a chat request's prompt sent to `model`: the character rule, or
/// the model's BPE count when that is larger, plus its images.
pub fn input_tokens(request: &Value, model: Option<&str>) -> i32 {
    Prompt::of(request).tokens(model)
}

/// [`input_tokens`] for a job that may be served by any of `models` (a route's targets):
/// the largest, since the gate reserves one estimate whichever target takes it.
pub fn route_input_tokens<'a>(request: &Value, models: impl IntoIterator<Item = &'a str>) -> i32 {
    let prompt = Prompt::of(request);
    models
        .into_iter()
        .map(|m| prompt.tokens(Some(m)))
        .max()
        .unwrap_or_else(|| prompt.tokens(None))
}

/// Input tokens to reserve for a job of `endpoint` that any of `models` may serve, the
/// largest over the models: a chat prompt ([`route_input_tokens`]), embeddings' inputs
/// ([`embedding_input_tokens`]), a Responses request as the chat request that bills the
/// same ([`responses_as_chat`]), an Anthropic Messages request ([`messages_input_tokens`]);
/// none for a moderation.
pub fn endpoint_input_tokens<'a>(
    endpoint: Endpoint,
    request: &Value,
    models: impl IntoIterator<Item = &'a str>,
) -> i32 {
    match endpoint {
        Endpoint::ChatCompletions => route_input_tokens(request, models),
        Endpoint::Embeddings => models
            .into_iter()
            .map(|m| embedding_input_tokens(request, Some(m)))
            .max()
            .unwrap_or_else(|| embedding_input_tokens(request, None)),
        Endpoint::Responses => route_input_tokens(&responses_as_chat(request), models),
        // Free, and counted against requests only.
        Endpoint::Moderations => 0,
        Endpoint::Messages => messages_input_tokens(request),
        Endpoint::Completions => models
            .into_iter()
            .map(|m| completions_input_tokens(request, Some(m)))
            .max()
            .unwrap_or_else(|| completions_input_tokens(request, None)),
    }
}

/// A Responses request as the chat request that bills the same input, for its estimate:
/// `instructions` as a system message, `input` text as a user message, its items as
/// messages (text and image parts as chat's, a function call's arguments as an assistant
/// message, its output as a tool message, any other item as its JSON), `tools` as they are.
pub fn responses_as_chat(request: &Value) -> Value {
    let part = |p: &Value| match p.get("type").and_then(Value::as_str) {
        Some("input_image") => serde_json::json!({"type": "image_url",
            "image_url": {"url": p.get("image_url").cloned().unwrap_or(Value::Null), "detail": p.get("detail")}}),
        _ => {
            serde_json::json!({"type": "text", "text": p.get("text").map(as_text).unwrap_or_else(|| p.to_string())})
        }
    };
    let item = |i: &Value| match i.get("type").and_then(Value::as_str) {
        None | Some("message") => {
            let content = match i.get("content") {
                Some(Value::Array(parts)) => Value::Array(parts.iter().map(part).collect()),
                Some(other) => Value::String(as_text(other)),
                None => Value::String(String::new()),
            };
            serde_json::json!({"role": "user", "content": content})
        }
        Some("function_call") => serde_json::json!({"role": "assistant",
            "content": format!("{}{}", as_text(i.get("name").unwrap_or(&Value::Null)), as_text(i.get("arguments").unwrap_or(&Value::Null)))}),
        Some("function_call_output") => serde_json::json!({"role": "tool",
            "content": as_text(i.get("output").unwrap_or(&Value::Null))}),
        Some(_) => serde_json::json!({"role": "user", "content": i.to_string()}),
    };
    let mut messages = Vec::new();
    if let Some(instructions) = field(request, "instructions") {
        messages.push(serde_json::json!({"role": "system", "content": as_text(instructions)}));
    }
    match field(request, "input") {
        Some(Value::Array(items)) => messages.extend(items.iter().map(item)),
        Some(text) => messages.push(serde_json::json!({"role": "user", "content": as_text(text)})),
        None => {}
    }
    let mut chat = serde_json::json!({"messages": messages});
    if let Some(tools) = field(request, "tools") {
        chat["tools"] = tools.clone();
    }
    chat
}

/// Most tokens Anthropic bills for one image: larger ones are scaled down to about 1.15
/// megapixels, which bill about 1,600.
pub const ANTHROPIC_IMAGE_TOKENS: i64 = 1600;

/// The output format an Anthropic Messages request asks for: `output_config.format`, or
/// the structured-outputs beta's `output_format` (`{"type": "json_schema", "schema": …}`).
pub fn messages_output_format(request: &Value) -> Option<&Value> {
    request
        .pointer("/output_config/format")
        .or_else(|| request.get("output_format"))
        .filter(|f| !f.is_null())
}

/// An Anthropic Messages request's input, by the character rule: 3 for priming, per
/// message 4 plus one per started group of four characters of its text (text blocks,
/// thinking, tool inputs and results as their JSON), the `system` prompt as one more
/// message, the tool definitions and the output format's schema as JSON (both become
/// instructions the model reads), and [`ANTHROPIC_IMAGE_TOKENS`] per image.
pub fn messages_input_tokens(request: &Value) -> i32 {
    let mut images = 0i64;
    let mut content_text = |c: Option<&Value>| -> String {
        let Some(Value::Array(blocks)) = c else {
            return c.map(as_text).unwrap_or_default();
        };
        blocks
            .iter()
            .map(|b| match b.get("type").and_then(Value::as_str) {
                Some("text") => as_text(b.get("text").unwrap_or(&Value::Null)),
                Some("thinking") => as_text(b.get("thinking").unwrap_or(&Value::Null)),
                Some("image") => {
                    images += 1;
                    String::new()
                }
                _ => b.to_string(),
            })
            .collect()
    };
    let mut total = 3;
    for m in messages(request) {
        total += 4 + quarters(&content_text(m.get("content")));
    }
    if let Some(system) = field(request, "system") {
        total += 4 + quarters(&content_text(Some(system)));
    }
    if let Some(tools) = field(request, "tools") {
        total += quarters(&tools.to_string());
    }
    if let Some(format) = messages_output_format(request) {
        total += quarters(&format.to_string());
    }
    clamp_i32(total.saturating_add(images.saturating_mul(ANTHROPIC_IMAGE_TOKENS)))
}

/// Output tokens to reserve for a job of `endpoint`: [`output_tokens`] for chat, none for
/// embeddings, the output cap of a Responses request, `max_tokens` for Anthropic Messages
/// (required; thinking counts in it).
pub fn endpoint_output_tokens(endpoint: Endpoint, request: &Value) -> i32 {
    match endpoint {
        Endpoint::ChatCompletions => output_tokens(request),
        Endpoint::Embeddings | Endpoint::Moderations => 0,
        Endpoint::Responses => clamp_i32(responses_output_cap(request)),
        Endpoint::Messages => clamp_i32(request.get("max_tokens").and_then(Value::as_i64).unwrap_or(0)),
        Endpoint::Completions => completions_output_tokens(request),
    }
}

/// An embeddings request's `input` in tokens, as OpenAI counts them against TPM: a string
/// by the character rule (one per started group of four characters) or the model's BPE
/// count where larger; an array of token ids is its length; an array of inputs, their sum.
/// At least 1.
pub fn embedding_input_tokens(request: &Value, model: Option<&str>) -> i32 {
    clamp_i32(texts_tokens(request.get("input"), model).max(1))
}

/// Tokens of an embeddings `input` or a completions `prompt`: a string by the character
/// rule or the model's BPE count where larger, an array of token ids its length, an array
/// of either their sum.
fn texts_tokens(texts: Option<&Value>, model: Option<&str>) -> i64 {
    let tokenizer = model.and_then(tokenizer_for);
    let text = |s: &str| quarters(s).max(tokenizer.map_or(0, |t| t.count(s) as i64));
    let one = |v: &Value| match v {
        Value::String(s) => text(s),
        Value::Array(ids) => ids.len() as i64,
        _ => 0,
    };
    match texts {
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => items.len() as i64,
        Some(Value::Array(items)) => items.iter().map(one).sum(),
        Some(single) => one(single),
        None => 0,
    }
}

/// OpenAI's default `max_tokens` of a legacy completion.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: i64 = 16;

/// A legacy completion's input: its prompts ([`texts_tokens`]) and `suffix`; at least 1.
pub fn completions_input_tokens(request: &Value, model: Option<&str>) -> i32 {
    let suffix = request.get("suffix").and_then(Value::as_str).map_or(0, quarters);
    clamp_i32((texts_tokens(request.get("prompt"), model) + suffix).max(1))
}

/// A legacy completion's output cap: `max_tokens` (default 16) for each of the `best_of`
/// (or `n`) candidates of each prompt — OpenAI generates, and bills, every candidate.
pub fn completions_output_tokens(request: &Value) -> i32 {
    let count = |k: &str| request.get(k).and_then(Value::as_i64).unwrap_or(1).max(1);
    let prompts = match request.get("prompt") {
        Some(Value::Array(items)) if !items.iter().all(Value::is_number) => items.len().max(1) as i64,
        _ => 1,
    };
    let cap = request
        .get("max_tokens")
        .and_then(Value::as_i64)
        .unwrap_or(COMPLETIONS_DEFAULT_MAX_TOKENS)
        .max(0);
    clamp_i32(
        cap.saturating_mul(count("n").max(count("best_of")))
            .saturating_mul(prompts),
    )
}

/// The character rule: 3 for reply priming, per message 4 plus one per started group of
/// four characters of its text, and one per started group of four characters of each
/// definition (tools, functions, tool choice, response format). Images not included.
pub fn char_rule(request: &Value) -> i32 {
    clamp_i32(Prompt::of(request).by_chars())
}

/// Builds the encoders (a fraction of a second each) so no request pays for it.
pub fn warm_up() {
    bpe_openai::o200k_base().count("warm up");
    bpe_openai::cl100k_base().count("warm up");
}

/// The encoding of an OpenAI model family, where it is public (tiktoken's model map).
pub fn tokenizer_for(model: &str) -> Option<&'static Tokenizer> {
    let m = base_model(model);
    let o200k = [
        "gpt-4o",
        "gpt-4.1",
        "gpt-4.5",
        "gpt-5",
        "o1",
        "o3",
        "o4",
        "chatgpt-4o",
        "gpt-oss",
    ];
    let cl100k = [
        "gpt-4",
        "gpt-3.5",
        "gpt-35",
        "text-embedding-3",
        "text-embedding-ada-002",
    ];
    if o200k.iter().any(|p| m.starts_with(p)) {
        Some(bpe_openai::o200k_base())
    } else if cl100k.iter().any(|p| m.starts_with(p)) {
        Some(bpe_openai::cl100k_base())
    } else {
        None
    }
}

/// The output cap a Responses request is sent with: its `max_output_tokens`, else
/// [`DEFAULT_OUTPUT_TOKENS`] (which the adapter then sends).
pub fn responses_output_cap(request: &Value) -> i64 {
    request
        .get("max_output_tokens")
        .and_then(Value::as_i64)
        .unwrap_or(i64::from(DEFAULT_OUTPUT_TOKENS))
}

/// The output cap per choice the request is sent with: its `max_completion_tokens` or
/// `max_tokens` (the larger, when it sets both), else [`DEFAULT_OUTPUT_TOKENS`]. The one
/// source of the cap: the adapters send this, the estimate reserves it.
pub fn output_cap(request: &Value) -> i64 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .filter_map(|k| request.get(*k).and_then(Value::as_i64))
        .max()
        .unwrap_or(i64::from(DEFAULT_OUTPUT_TOKENS))
}

/// Choices the provider generates: `n`, or `best_of` where larger (it generates `best_of`
/// and returns `n`); 1 when neither is set.
pub fn choices(request: &Value) -> i64 {
    ["n", "best_of"]
        .iter()
        .filter_map(|k| request.get(*k).and_then(Value::as_i64))
        .max()
        .unwrap_or(1)
        .clamp(1, MAX_CHOICES)
}

/// Output tokens to reserve: per choice the cap and a predicted output's tokens, times the
/// choices.
pub fn output_tokens(request: &Value) -> i32 {
    let per_choice = output_cap(request).saturating_add(prediction_tokens(request));
    clamp_i32(per_choice.saturating_mul(choices(request)))
}

/// Tokens of `prediction.content` (Predicted Outputs, an OpenAI feature of o200k models):
/// the character rule or the o200k count, whichever is larger.
fn prediction_tokens(request: &Value) -> i64 {
    let Some(content) = request.pointer("/prediction/content") else {
        return 0;
    };
    let text = content_text(Some(content));
    quarters(&text).max(bpe_openai::o200k_base().count(&text) as i64)
}

/// What a request is charged for as input, read once whatever the models it is priced for.
struct Prompt {
    /// Per message: its role, and its text (content, then its other fields as JSON).
    messages: Vec<(String, String)>,
    /// The request's definitions as JSON: tools, functions, tool choice, response format.
    definitions: Vec<String>,
    /// The `image_url` parts.
    images: Vec<Image>,
}

/// An `image_url` part as far as its bill depends on it.
struct Image {
    /// `detail: low`; `high`, `auto` and none bill the same (auto may choose high).
    low: bool,
    /// Width and height, where a data URL's header tells them.
    size: Option<(u32, u32)>,
}

impl Prompt {
    fn of(request: &Value) -> Self {
        let texts = messages(request)
            .map(|m| {
                let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
                let mut text = content_text(m.get("content"));
                for (k, v) in m.as_object().into_iter().flatten() {
                    if k != "role" && k != "content" {
                        text.push_str(&as_text(v));
                    }
                }
                (role.to_owned(), text)
            })
            .collect();
        let definitions = ["tools", "functions", "tool_choice", "response_format"]
            .iter()
            .filter_map(|k| field(request, k))
            .map(as_text)
            .collect();
        let images = messages(request)
            .filter_map(|m| m.get("content").and_then(Value::as_array))
            .flatten()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("image_url"))
            .map(|p| {
                let image = p.get("image_url");
                let url = image
                    .and_then(|i| i.get("url").or(Some(i)))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                Image {
                    low: image.and_then(|i| i.get("detail")).and_then(Value::as_str) == Some("low"),
                    size: data_url_size(url),
                }
            })
            .collect();
        Self {
            messages: texts,
            definitions,
            images,
        }
    }

    /// Input tokens on `model`: the text by the character rule, or by the model's BPE
    /// count when that is larger, plus the images as the model's family bills them.
    fn tokens(&self, model: Option<&str>) -> i32 {
        let text = match model.and_then(tokenizer_for) {
            Some(tokenizer) => self.by_chars().max(self.by_bpe(tokenizer)),
            None => self.by_chars(),
        };
        clamp_i32(text.saturating_add(self.image_tokens(model)))
    }

    /// The images' tokens on `model`.
    fn image_tokens(&self, model: Option<&str>) -> i64 {
        let bill = image_bill(model);
        self.images
            .iter()
            .map(|i| image_bill_tokens(bill, i.low, i.size))
            .fold(0, i64::saturating_add)
    }

    /// The character rule ([`char_rule`]).
    fn by_chars(&self) -> i64 {
        let messages: i64 = self.messages.iter().map(|(_, text)| 4 + quarters(text)).sum();
        let definitions: i64 = self.definitions.iter().map(|d| quarters(d)).sum();
        if messages + definitions == 0 {
            return 0;
        }
        3 + messages + definitions
    }

    /// OpenAI's counting of chat prompts: 3 for reply priming; per message 3, its role and
    /// its text in the model's encoding; the definitions' JSON in the same encoding.
    fn by_bpe(&self, tokenizer: &Tokenizer) -> i64 {
        let messages: usize = self
            .messages
            .iter()
            .map(|(role, text)| 3 + tokenizer.count(role) + tokenizer.count(text))
            .sum();
        let definitions: usize = self.definitions.iter().map(|d| tokenizer.count(d)).sum();
        3 + messages as i64 + definitions as i64
    }
}

/// How a model family bills an image (OpenAI's vision guide, "Calculating costs").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ImageBill {
    /// `base` at low detail; at high (and auto) detail `base` plus `tile` per 512 px tile
    /// of the image scaled to fit 2048 × 2048 and then to a shortest side of 768.
    Tiles { base: i64, tile: i64 },
    /// One token per 32 px patch, at most [`MAX_PATCHES`], times `per_mille` / 1000.
    Patches { per_mille: i64 },
    /// A fixed bill per image, whatever its size or detail.
    Flat(i64),
}

/// Patches an image is scaled down to at most (patch-billed models).
const MAX_PATCHES: i64 = 1536;
/// Tiles of the largest high-detail image: scaled to fit 2048 × 2048, then to a shortest
/// side of 768, it is at most 768 × 2048, which is 2 × 4 tiles of 512.
const MAX_TILES: i64 = 8;
/// An image sent to a model outside OpenAI's published families. No bound holds for every
/// server; this is the largest per-image bill among those documented for the providers
/// tollgate speaks to (Together's vision models: 2 × 2 tiles of 1,601; Anthropic's images
/// come to about 1,600 at most, Gemini's to 258 a tile). Calibration raises input
/// reservations for a model whose reported usage runs above its estimates.
const UNKNOWN_MODEL_IMAGE_TOKENS: i64 = 6404;

/// The bill of an image sent to `model`.
fn image_bill(model: Option<&str>) -> ImageBill {
    let m = model.map(base_model).unwrap_or_default();
    // Most specific first: `gpt-4o-mini` before `gpt-4o`, `gpt-5-mini` before `gpt-5`.
    let families: [(&str, ImageBill); 16] = [
        (
            "gpt-4o-mini",
            ImageBill::Tiles {
                base: 2833,
                tile: 5667,
            },
        ),
        ("gpt-4.1-mini", ImageBill::Patches { per_mille: 1620 }),
        ("gpt-4.1-nano", ImageBill::Patches { per_mille: 2460 }),
        ("gpt-5-mini", ImageBill::Patches { per_mille: 1620 }),
        ("gpt-5-nano", ImageBill::Patches { per_mille: 2460 }),
        ("o4-mini", ImageBill::Patches { per_mille: 1720 }),
        ("computer-use-preview", ImageBill::Tiles { base: 65, tile: 129 }),
        ("gpt-5", ImageBill::Tiles { base: 70, tile: 140 }),
        ("o1", ImageBill::Tiles { base: 75, tile: 150 }),
        ("o3", ImageBill::Tiles { base: 75, tile: 150 }),
        ("gpt-4o", ImageBill::Tiles { base: 85, tile: 170 }),
        ("chatgpt-4o", ImageBill::Tiles { base: 85, tile: 170 }),
        ("gpt-4.1", ImageBill::Tiles { base: 85, tile: 170 }),
        ("gpt-4.5", ImageBill::Tiles { base: 85, tile: 170 }),
        ("gpt-4-turbo", ImageBill::Tiles { base: 85, tile: 170 }),
        ("gpt-4-vision", ImageBill::Tiles { base: 85, tile: 170 }),
    ];
    families
        .iter()
        .find(|(prefix, _)| m.starts_with(prefix))
        .map_or(ImageBill::Flat(UNKNOWN_MODEL_IMAGE_TOKENS), |(_, bill)| *bill)
}

/// Tokens of the request's `image_url` parts sent to `model`.
pub fn image_tokens(request: &Value, model: Option<&str>) -> i64 {
    Prompt::of(request).image_tokens(model)
}

/// One image's tokens: from its size where known, else the most its detail can cost.
fn image_bill_tokens(bill: ImageBill, low: bool, size: Option<(u32, u32)>) -> i64 {
    match bill {
        ImageBill::Flat(tokens) => tokens,
        ImageBill::Tiles { base, .. } if low => base,
        ImageBill::Tiles { base, tile } => base + tile * size.map_or(MAX_TILES, |(w, h)| tiles(w, h)),
        ImageBill::Patches { per_mille } => {
            let patches = size.map_or(MAX_PATCHES, |(w, h)| {
                let raw = i64::from(w.div_ceil(32)) * i64::from(h.div_ceil(32));
                raw.min(MAX_PATCHES)
            });
            (patches * per_mille + 999) / 1000
        }
    }
}

/// 512 px tiles of a `w` × `h` image at high detail: scaled to fit 2048 × 2048, then down
/// to a shortest side of 768.
fn tiles(w: u32, h: u32) -> i64 {
    let (mut w, mut h) = (f64::from(w.max(1)), f64::from(h.max(1)));
    let fit = (2048.0 / w.max(h)).min(1.0);
    (w, h) = (w * fit, h * fit);
    let short = (768.0 / w.min(h)).min(1.0);
    (w, h) = (w * short, h * short);
    ((w / 512.0).ceil() * (h / 512.0).ceil()) as i64
}

/// Width and height of a base64 data URL's PNG, GIF, WebP or JPEG image, read from its
/// header; `None` for other URLs (the provider fetches those) and unreadable images.
fn data_url_size(url: &str) -> Option<(u32, u32)> {
    let (meta, data) = url.strip_prefix("data:")?.split_once(',')?;
    if !meta.ends_with(";base64") {
        return None;
    }
    let bytes = STANDARD.decode(data.trim()).ok()?;
    image_size(&bytes)
}

/// Width and height from an image file's header.
fn image_size(b: &[u8]) -> Option<(u32, u32)> {
    let be16 = |i: usize| Some(u32::from(u16::from_be_bytes([*b.get(i)?, *b.get(i + 1)?])));
    let le16 = |i: usize| Some(u32::from(u16::from_le_bytes([*b.get(i)?, *b.get(i + 1)?])));
    let le24 = |i: usize| {
        Some(u32::from_le_bytes([
            *b.get(i)?,
            *b.get(i + 1)?,
            *b.get(i + 2)?,
            0,
        ]))
    };
    let be32 = |i: usize| Some(u32::from_be_bytes(b.get(i..i + 4)?.try_into().ok()?));
    if b.starts_with(b"\x89PNG\r\n\x1a\n") && b.get(12..16) == Some(b"IHDR") {
        return Some((be32(16)?, be32(20)?));
    }
    if b.starts_with(b"GIF87a") || b.starts_with(b"GIF89a") {
        return Some((le16(6)?, le16(8)?));
    }
    if b.starts_with(b"RIFF") && b.get(8..12) == Some(b"WEBP") {
        return match b.get(12..16)? {
            b"VP8 " => Some((le16(26)? & 0x3fff, le16(28)? & 0x3fff)),
            b"VP8L" => {
                let bits = u32::from_le_bytes(b.get(21..25)?.try_into().ok()?);
                Some(((bits & 0x3fff) + 1, ((bits >> 14) & 0x3fff) + 1))
            }
            b"VP8X" => Some((le24(24)? + 1, le24(27)? + 1)),
            _ => None,
        };
    }
    if b.starts_with(&[0xff, 0xd8]) {
        // Segments until a start-of-frame (SOF0..SOF15 but DHT, JPG and DAC).
        let mut i = 2;
        while *b.get(i)? == 0xff {
            let marker = *b.get(i + 1)?;
            if (0xc0..=0xcf).contains(&marker) && !matches!(marker, 0xc4 | 0xc8 | 0xcc) {
                return Some((be16(i + 7)?, be16(i + 5)?));
            }
            i += 2 + usize::try_from(be16(i + 2)?).ok()?;
        }
    }
    None
}

/// The model name without a provider prefix (`oai/gpt-4o` → `gpt-4o`).
fn base_model(model: &str) -> &str {
    model.rsplit('/').next().unwrap_or(model)
}

fn messages(request: &Value) -> impl Iterator<Item = &Value> {
    request
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// A field that is present and not null.
fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|v| !v.is_null())
}

/// A string as itself, null as nothing, anything else as its JSON.
fn as_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// The text of a `content`: a string, or its parts' `text` (and assistants' `refusal`).
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").or_else(|| p.get("refusal")).and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// The character rule's unit: one token per started group of four characters.
fn quarters(s: &str) -> i64 {
    s.chars().count().div_ceil(4) as i64
}

fn clamp_i32(v: i64) -> i32 {
    v.clamp(0, i64::from(i32::MAX)) as i32
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn responses_reserve_as_the_chat_request_that_bills_the_same() {
        let request = json!({"model": "m", "instructions": "be brief", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "abcdefgh"},
                {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "rain"}]});
        let chat = responses_as_chat(&request);
        assert_eq!(
            chat["messages"][0],
            json!({"role": "system", "content": "be brief"})
        );
        assert_eq!(chat["messages"][1]["content"][1]["type"], "image_url");
        assert_eq!(
            chat["messages"][2],
            json!({"role": "assistant", "content": "f{}"})
        );
        assert_eq!(chat["messages"][3], json!({"role": "tool", "content": "rain"}));
        let tokens = endpoint_input_tokens(Endpoint::Responses, &request, ["gpt-4o-mini"]);
        assert_eq!(tokens, route_input_tokens(&chat, ["gpt-4o-mini"]));
        assert!(
            tokens > 2833,
            "the low-detail image of gpt-4o-mini is billed: {tokens}"
        );
        assert_eq!(
            endpoint_output_tokens(Endpoint::Responses, &request),
            DEFAULT_OUTPUT_TOKENS
        );
        let capped = json!({"model": "m", "input": "x", "max_output_tokens": 64});
        assert_eq!(endpoint_output_tokens(Endpoint::Responses, &capped), 64);
        let messages = json!({"model": "m", "max_tokens": 9, "system": "abcd",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}, {"type": "image", "source": {}}]}]});
        assert_eq!(
            messages_input_tokens(&messages),
            3 + (4 + 2) + (4 + 1) + ANTHROPIC_IMAGE_TOKENS as i32
        );
        assert_eq!(endpoint_output_tokens(Endpoint::Messages, &messages), 9);
    }

    #[test]
    fn embeddings_reserve_their_inputs_and_no_output() {
        let one = json!({"model": "m", "input": "abcdefgh"});
        assert_eq!(embedding_input_tokens(&one, None), 2);
        let many = json!({"model": "m", "input": ["abcd", "abcdefghi"]});
        assert_eq!(embedding_input_tokens(&many, None), 1 + 3);
        let ids = json!({"model": "m", "input": [1, 2, 3, 4, 5]});
        assert_eq!(embedding_input_tokens(&ids, None), 5);
        let id_lists = json!({"model": "m", "input": [[1, 2], [3, 4, 5]]});
        assert_eq!(embedding_input_tokens(&id_lists, None), 5);
        // Digits are about one token per three characters in cl100k: the BPE count wins.
        let digits = json!({"model": "m", "input": "1234567890".repeat(40)});
        assert!(embedding_input_tokens(&digits, Some("text-embedding-3-small")) > 100);
        assert_eq!(endpoint_output_tokens(Endpoint::Embeddings, &one), 0);
        assert_eq!(
            endpoint_output_tokens(Endpoint::ChatCompletions, &json!({"max_tokens": 7})),
            7
        );
    }

    fn user(content: Value) -> Value {
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": content}], "max_tokens": 100})
    }

    /// `request` with `field` set to `value`.
    fn with(request: &Value, field: &str, value: Value) -> Value {
        let mut r = request.clone();
        r[field] = value;
        r
    }

    #[test]
    fn counts_messages_and_parts() {
        let r = json!({"messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "abcde"}]}
        ]});
        // 3 + (4 + 1) + (4 + 2)
        assert_eq!(input_tokens(&r, None), 14);
        assert_eq!(char_rule(&r), 14);
        assert_eq!(input_tokens(&json!({}), None), 0);
    }

    #[test]
    fn bpe_counts_win_where_the_character_rule_underestimates() {
        let english =
            json!({"messages": [{"role": "user", "content": "Summarise this ticket in one line."}]});
        assert_eq!(input_tokens(&english, Some("gpt-4o")), char_rule(&english));
        // Digits and CJK take more tokens than characters / 4.
        let dense = json!({"messages": [{"role": "user", "content": "7391 0482 5563 1209 8874 3321 9065 ".repeat(20) + &"東京都の天気予報".repeat(20)}]});
        let bpe = input_tokens(&dense, Some("oai/gpt-4o-mini"));
        assert!(
            bpe > char_rule(&dense),
            "bpe {bpe} vs chars {}",
            char_rule(&dense)
        );
        assert!(tokenizer_for("gpt-4-turbo").is_some() && tokenizer_for("claude-3-opus").is_none());
    }

    /// Each field a provider charges as input raises the estimate, for a known encoding
    /// and for none.
    #[test]
    fn every_charged_input_field_raises_the_estimate() {
        let base = user(json!("Classify this ticket."));
        let schema = json!({"type": "json_schema", "json_schema": {"name": "verdict", "schema": {
            "type": "object", "properties": {"label": {"type": "string", "enum": ["bug", "feature", "question"]},
            "confidence": {"type": "number"}}, "required": ["label", "confidence"]}}});
        let tool = json!([{"type": "function", "function": {"name": "lookup_order",
            "description": "Looks an order up by its id", "parameters": {"type": "object",
            "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]);
        let image = json!([{"type": "text", "text": "Classify this ticket."},
                           {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]);
        let cases = [
            ("tools", with(&base, "tools", tool.clone())),
            (
                "functions",
                with(&base, "functions", json!([tool[0]["function"]])),
            ),
            (
                "tool_choice",
                with(
                    &base,
                    "tool_choice",
                    json!({"type": "function", "function": {"name": "lookup_order"}}),
                ),
            ),
            ("response_format", with(&base, "response_format", schema)),
            ("image part", user(image)),
            (
                "tool calls",
                with(
                    &base,
                    "messages",
                    json!([
                {"role": "user", "content": "Classify this ticket."},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                  "function": {"name": "lookup_order", "arguments": "{\"order_id\":\"A-1\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "shipped"}]),
                ),
            ),
            (
                "name",
                with(
                    &base,
                    "messages",
                    json!([{"role": "user", "name": "a_rather_long_name", "content": "Classify this ticket."}]),
                ),
            ),
        ];
        for model in [Some("gpt-4o"), Some("claude-3-5-haiku-latest"), None] {
            let plain = input_tokens(&base, model);
            for (name, request) in &cases {
                let more = input_tokens(request, model);
                assert!(more > plain, "{name} on {model:?}: {more} <= {plain}");
            }
        }
        // The JSON of a definition counts in the model's encoding too.
        let with_tools = with(&base, "tools", tool);
        assert!(input_tokens(&with_tools, Some("gpt-4o")) >= char_rule(&with_tools));
    }

    #[test]
    fn output_is_the_cap_times_the_choices() {
        let r = user(json!("hi"));
        assert_eq!(output_tokens(&r), 100);
        assert_eq!(output_tokens(&with(&r, "n", json!(4))), 400);
        assert_eq!(output_tokens(&with(&r, "best_of", json!(3))), 300);
        assert_eq!(
            output_tokens(&with(&with(&r, "n", json!(2)), "best_of", json!(5))),
            500
        );
        let no_cap = json!({"messages": [], "n": 3});
        assert_eq!(output_tokens(&no_cap), 3 * DEFAULT_OUTPUT_TOKENS);
        assert_eq!(
            output_tokens(&json!({"max_tokens": i64::MAX, "n": 128})),
            i32::MAX
        );
        // A predicted output is billed as completion tokens when rejected.
        let predicted = with(
            &r,
            "prediction",
            json!({"type": "content", "content": "fn main() {}\n".repeat(10)}),
        );
        assert!(output_tokens(&predicted) > 100);
    }

    #[test]
    fn output_cap() {
        assert_eq!(super::output_cap(&json!({"max_tokens": 50})), 50);
        assert_eq!(
            super::output_cap(&json!({"max_completion_tokens": 70, "max_tokens": 50})),
            70
        );
        assert_eq!(
            super::output_cap(&json!({"max_completion_tokens": 30, "max_tokens": 50})),
            50
        );
        assert_eq!(super::output_cap(&json!({})), i64::from(DEFAULT_OUTPUT_TOKENS));
        assert_eq!(output_tokens(&json!({})), DEFAULT_OUTPUT_TOKENS);
    }

    #[test]
    fn images_are_billed_by_family_detail_and_size() {
        let image = |detail: &str, url: &str| {
            user(json!([{"type": "image_url", "image_url": {"url": url, "detail": detail}}]))
        };
        let url = "https://example.com/a.jpg";
        // Unknown size: the most the detail level can cost.
        assert_eq!(image_tokens(&image("low", url), Some("gpt-4o")), 85);
        assert_eq!(image_tokens(&image("high", url), Some("gpt-4o")), 85 + 8 * 170);
        assert_eq!(
            image_tokens(&image("auto", url), Some("oai/gpt-4o")),
            85 + 8 * 170
        );
        assert_eq!(image_tokens(&image("low", url), Some("gpt-4o-mini")), 2833);
        assert_eq!(
            image_tokens(&image("high", url), Some("gpt-4o-mini")),
            2833 + 8 * 5667
        );
        assert_eq!(image_tokens(&image("low", url), Some("gpt-4.1-mini")), 2489);
        assert_eq!(image_tokens(&image("high", url), Some("o3")), 75 + 8 * 150);
        assert_eq!(
            image_tokens(&image("high", url), Some("claude-3-5-haiku-latest")),
            6404
        );
        assert_eq!(image_tokens(&image("high", url), None), 6404);
        // Known size (OpenAI's worked examples): 1024² is 4 tiles, 2048 × 4096 is 6.
        assert_eq!(
            image_bill_tokens(image_bill(Some("gpt-4o")), false, Some((1024, 1024))),
            765
        );
        assert_eq!(
            image_bill_tokens(image_bill(Some("gpt-4o")), false, Some((2048, 4096))),
            1105
        );
        assert_eq!(
            image_bill_tokens(image_bill(Some("gpt-4o")), false, Some((100, 100))),
            255
        );
        // Patches: 1024² is 1024 patches; a large image is capped at 1536.
        let mini = image_bill(Some("gpt-4.1-mini"));
        assert_eq!(image_bill_tokens(mini, false, Some((1024, 1024))), 1659);
        assert_eq!(image_bill_tokens(mini, false, Some((4000, 4000))), 2489);
        // Two images, two bills.
        let two = user(json!([
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]));
        assert_eq!(image_tokens(&two, Some("gpt-4o")), 170);
    }

    #[test]
    fn image_sizes_are_read_from_data_urls() {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
        png.extend_from_slice(&1024u32.to_be_bytes());
        png.extend_from_slice(&768u32.to_be_bytes());
        let mut gif = b"GIF89a".to_vec();
        gif.extend_from_slice(&[0x00, 0x02, 0x00, 0x01]);
        let mut jpeg = vec![0xff, 0xd8, 0xff, 0xe0, 0x00, 0x04, 0x00, 0x00];
        jpeg.extend_from_slice(&[0xff, 0xc0, 0x00, 0x11, 0x08, 0x01, 0xe0, 0x02, 0x80]);
        let mut webp = b"RIFF\0\0\0\0WEBPVP8X\0\0\0\0\0\0\0\0".to_vec();
        webp.extend_from_slice(&[0xff, 0x03, 0x00, 0xff, 0x01, 0x00]);
        for (bytes, size) in [
            (png, (1024, 768)),
            (gif, (512, 256)),
            (jpeg, (640, 480)),
            (webp, (1024, 512)),
        ] {
            let url = format!("data:image/x;base64,{}", STANDARD.encode(&bytes));
            assert_eq!(data_url_size(&url), Some(size));
        }
        assert_eq!(data_url_size("https://example.com/a.png"), None);
        assert_eq!(data_url_size("data:image/png;base64,!!!"), None);
        assert_eq!(data_url_size("data:image/png;base64,AAAA"), None);
        // A 1024 × 768 PNG to gpt-4o: its shortest side is 768 already, 2 × 2 tiles.
        let r = user(
            json!([{"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}",
            STANDARD.encode(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\x04\0\0\0\x03\0"))}}]),
        );
        assert_eq!(image_tokens(&r, Some("gpt-4o")), 85 + 4 * 170);
    }

    #[test]
    fn the_route_estimate_is_its_largest_target() {
        let r = user(
            json!([{"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}]),
        );
        let route = route_input_tokens(&r, ["gpt-4o", "gpt-4o-mini"]);
        assert_eq!(route, input_tokens(&r, Some("gpt-4o-mini")));
        assert!(route > input_tokens(&r, Some("gpt-4o")));
        assert_eq!(route_input_tokens(&r, []), input_tokens(&r, None));
    }

    #[test]
    fn fields_that_cannot_be_reserved_are_refused() {
        let r = user(json!("hi"));
        let refused = |request: &Value| check(request).err().map(|e| (e.code, e.param));
        let unsupported = |p: &str| Some((ApiErrorCode::UnsupportedField, p.to_owned()));
        let invalid = |p: &str| Some((ApiErrorCode::InvalidRequest, p.to_owned()));
        assert_eq!(refused(&r), None);
        for ok in ["auto", "default", "flex"] {
            assert_eq!(refused(&with(&r, "service_tier", json!(ok))), None, "{ok}");
        }
        assert_eq!(refused(&with(&r, "service_tier", json!(null))), None);
        assert_eq!(refused(&with(&r, "n", json!(128))), None);
        let cases = [
            (
                with(&r, "service_tier", json!("priority")),
                unsupported("service_tier"),
            ),
            (
                with(&r, "service_tier", json!("scale")),
                unsupported("service_tier"),
            ),
            (with(&r, "service_tier", json!(1)), invalid("service_tier")),
            (with(&r, "n", json!(0)), invalid("n")),
            (with(&r, "n", json!(129)), invalid("n")),
            (with(&r, "n", json!("4")), invalid("n")),
            (with(&r, "best_of", json!(1.5)), invalid("best_of")),
            (
                with(&r, "modalities", json!(["text", "audio"])),
                unsupported("modalities"),
            ),
            (
                with(&r, "audio", json!({"voice": "alloy", "format": "wav"})),
                unsupported("audio"),
            ),
            (
                with(&r, "web_search_options", json!({})),
                unsupported("web_search_options"),
            ),
            (
                user(json!([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])),
                unsupported("messages[0].content[0].type"),
            ),
            (
                user(json!([{"type": "text", "text": "x"}, {"type": "file", "file": {"file_id": "file-1"}}])),
                unsupported("messages[0].content[1].type"),
            ),
            (
                user(json!([{"type": "video_url"}])),
                unsupported("messages[0].content[0].type"),
            ),
            (
                user(json!([{"text": "untyped"}])),
                invalid("messages[0].content[0].type"),
            ),
            (
                with(
                    &r,
                    "messages",
                    json!([{"role": "assistant", "audio": {"id": "audio_1"}}]),
                ),
                unsupported("messages[0].audio"),
            ),
        ];
        for (request, expected) in cases {
            assert_eq!(refused(&request), expected, "{request}");
        }
    }

    #[test]
    fn a_legacy_completion_reserves_every_candidate_of_every_prompt() {
        let out = |r: Value| completions_output_tokens(&r);
        assert_eq!(out(json!({"prompt": "x"})), 16, "OpenAI's default cap");
        assert_eq!(out(json!({"prompt": ["a", "b"], "n": 2, "max_tokens": 5})), 20);
        assert_eq!(
            out(json!({"prompt": "x", "n": 2, "best_of": 3, "max_tokens": 5})),
            15
        );
        assert_eq!(
            out(json!({"prompt": [1, 2, 3], "max_tokens": 5})),
            5,
            "token ids are one prompt"
        );
        assert_eq!(out(json!({"prompt": [[1, 2], [3]], "max_tokens": 5})), 10);
        let input = |r: Value| completions_input_tokens(&r, None);
        assert_eq!(
            input(json!({"prompt": ["abcd", "abcde"], "suffix": "xy"})),
            1 + 2 + 1
        );
        assert_eq!(input(json!({"prompt": [[1, 2], [3]]})), 3);
    }
}
