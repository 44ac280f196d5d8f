//! Anthropic, all of it: Messages at `POST {base_url}/v1/messages` with `x-api-key` and
//! `anthropic-version`; requests arrive in OpenAI chat format and are translated, and the
//! answer (whole or as stream events) is translated back, so clients see one format
//! whatever served them. Also Anthropic's stream error types, its rate-limit headers
//! (`anthropic-ratelimit-*`) and Message Batches (`{base_url}/v1/messages/batches`, lines
//! inline, results as JSONL).

use std::collections::HashMap;

use reqwest::RequestBuilder;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value, json};
use tollgate::config::ProviderConfig;
use tollgate::model::Usage;
use tollgate::retry::Failure;
use tollgate::vocab::{Endpoint, ReasonCode};

use super::batch_api::{BatchApi, LineResult, Status, Upload, by_custom_id, failed};
use super::openai::{content_text, stop_sequences};
use super::sse::SseEvent;
use super::streaming::{self, ChunkHead, StreamEvents, StreamOut};
use super::{Mode, ProviderApi, Success, Unexpressed, arguments_object, array, data_url, int};

/// An Anthropic provider.
pub struct Anthropic {
    base_url: String,
    /// The `anthropic-version` header.
    version: String,
}

impl Anthropic {
    pub fn from_config(p: &ProviderConfig) -> Self {
        Self {
            base_url: super::base_url(p),
            version: p.anthropic_version.clone(),
        }
    }
}

impl ProviderApi for Anthropic {
    fn url(&self, _model: &str, _endpoint: Endpoint, _mode: Mode) -> String {
        format!("{}/v1/messages", self.base_url)
    }

    fn authorize(&self, request: RequestBuilder, key: &SecretString) -> RequestBuilder {
        request
            .header("x-api-key", key.expose_secret())
            .header("anthropic-version", &self.version)
    }

    /// A chat request translated; a Messages request as it is, with the target's model.
    fn body(&self, model: &str, endpoint: Endpoint, request: &Value, mode: Mode) -> Value {
        let mut body = match endpoint {
            Endpoint::Messages => {
                let mut body = request.clone();
                if let Some(obj) = body.as_object_mut() {
                    obj.insert("model".to_owned(), Value::String(model.to_owned()));
                    obj.remove("stream");
                }
                body
            }
            _ => translate_request(model, request),
        };
        if mode == Mode::Stream
            && let Some(obj) = body.as_object_mut()
        {
            obj.insert("stream".to_owned(), Value::Bool(true));
        }
        body
    }

    fn parse_success(&self, body: &[u8], endpoint: Endpoint, _model: &str) -> Result<Success, String> {
        read_message(body, endpoint)
    }

    fn stream_events(&self, endpoint: Endpoint, _model: &str) -> Option<Box<dyn StreamEvents>> {
        match endpoint {
            Endpoint::Messages => Some(Box::new(PassThrough)),
            _ => Some(Box::new(Events::default())),
        }
    }

    fn keeps_header(&self, name: &str) -> bool {
        name.starts_with("anthropic-ratelimit-") || super::rate_limit_header(name)
    }

    fn batch(&self) -> Option<&dyn BatchApi> {
        Some(self)
    }

    fn unexpressed(&self, _model: &str, request: &Value) -> Option<Unexpressed> {
        unexpressed(request)
    }
}

/// A message answering a request of `endpoint`: kept as it is for Messages, translated to
/// a chat completion for chat.
fn read_message(body: &[u8], endpoint: Endpoint) -> Result<Success, String> {
    match endpoint {
        Endpoint::Messages => parse_message(body),
        _ => parse_success(body),
    }
}

/// Chat fields Anthropic's Messages API has no counterpart for.
const UNEXPRESSED_FIELDS: [&str; 7] = [
    "n",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "seed",
];

/// Image types Anthropic reads from base64 data.
const IMAGE_TYPES: [&str; 4] = ["image/jpeg", "image/png", "image/gif", "image/webp"];

/// What of an OpenAI chat request the translation below cannot carry: the fields above,
/// tools that are not functions, tool call arguments that are not a JSON object (Anthropic
/// takes `input` as an object; empty arguments are `{}`), base64 images of other types.
pub(super) fn unexpressed(request: &Value) -> Option<Unexpressed> {
    if let Some(refused) = super::first_set(request, &UNEXPRESSED_FIELDS, "Anthropic") {
        return Some(refused);
    }
    if let Some(format) = request.get("response_format").filter(|f| !f.is_null()) {
        match format.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object" | "json_schema") if !array(request, "tools").is_empty() => {
                return Unexpressed::at(
                    "response_format".to_owned(),
                    "Anthropic answers in JSON by a forced tool call, which other tools cannot join",
                );
            }
            Some("json_object") => {}
            Some("json_schema") => {
                let schema = format.pointer("/json_schema/schema");
                if schema.and_then(|s| s.get("type")).and_then(Value::as_str) != Some("object") {
                    return Unexpressed::at(
                        "response_format.json_schema.schema".to_owned(),
                        "Anthropic takes JSON schemas of objects only (`\"type\": \"object\"` at the root)",
                    );
                }
            }
            _ => {
                return Unexpressed::at(
                    "response_format.type".to_owned(),
                    "Anthropic takes `text`, `json_object` or `json_schema`",
                );
            }
        }
    }
    if let Some(refused) = super::functions_only(request, "Anthropic") {
        return Some(refused);
    }
    for (i, m) in array(request, "messages").iter().enumerate() {
        for (j, part) in array(m, "content").iter().enumerate() {
            let url = part
                .pointer("/image_url/url")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if data_url(url).is_some_and(|(media_type, _)| !IMAGE_TYPES.contains(&media_type)) {
                return Unexpressed::at(
                    format!("messages[{i}].content[{j}].image_url"),
                    "Anthropic reads JPEG, PNG, GIF and WebP images only",
                );
            }
        }
    }
    None
}

/// OpenAI content (a string, or parts) → Anthropic content blocks: text parts as text
/// blocks, `image_url` parts as image blocks (a `data:` URL as base64, any other as a URL
/// source). Empty text is left out (Anthropic refuses empty text blocks).
fn content_blocks(content: Option<&Value>) -> Vec<Value> {
    let text = |t: &str| (!t.is_empty()).then(|| json!({"type": "text", "text": t}));
    match content {
        Some(Value::String(t)) => text(t).into_iter().collect(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| match p.get("type").and_then(Value::as_str) {
                Some("image_url") => {
                    let url = p
                        .pointer("/image_url/url")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    Some(match data_url(url) {
                        Some((media_type, data)) => json!({"type": "image",
                            "source": {"type": "base64", "media_type": media_type, "data": data}}),
                        None => json!({"type": "image", "source": {"type": "url", "url": url}}),
                    })
                }
                _ => p
                    .get("text")
                    .or_else(|| p.get("refusal"))
                    .and_then(Value::as_str)
                    .and_then(text),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// OpenAI chat request → Anthropic Messages request. System and developer messages become
/// `system`; an assistant's tool calls become `tool_use` blocks and tool messages
/// `tool_result` blocks of a user turn; turns of one role in a row are one turn; `tools`,
/// `tool_choice` (`required` → `any`) and `parallel_tool_calls: false`
/// (`disable_parallel_tool_use`) carry over; a JSON `response_format` becomes a forced call
/// of [`JSON_TOOL`]. `max_tokens`, which Anthropic requires, is
/// the cap the gate reserved (`tollgate::estimate::output_cap`). Fields with no
/// counterpart were refused at submit ([`Anthropic::unexpressed`]).
pub(super) fn translate_request(model: &str, request: &Value) -> Value {
    let mut system = Vec::new();
    let mut turns: Vec<(&str, Vec<Value>)> = Vec::new();
    for m in array(request, "messages") {
        let (role, blocks) = match m.get("role").and_then(Value::as_str).unwrap_or("user") {
            "system" | "developer" => {
                system.push(content_text(m.get("content")));
                continue;
            }
            "assistant" => {
                let mut blocks = content_blocks(m.get("content"));
                for call in array(m, "tool_calls") {
                    let input = arguments_object(call).unwrap_or_else(|| json!({}));
                    blocks.push(json!({"type": "tool_use", "id": call.get("id"),
                        "name": call.pointer("/function/name"), "input": input}));
                }
                ("assistant", blocks)
            }
            "tool" => (
                "user",
                vec![
                    json!({"type": "tool_result", "tool_use_id": m.get("tool_call_id"),
                    "content": content_text(m.get("content"))}),
                ],
            ),
            _ => ("user", content_blocks(m.get("content"))),
        };
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    // A turn of text alone is sent as its text.
    let messages: Vec<Value> = turns
        .into_iter()
        .map(|(role, content)| match content.iter().all(|b| b["type"] == "text") {
            true => json!({"role": role, "content": content.iter().filter_map(|b| b["text"].as_str()).collect::<String>()}),
            false => json!({"role": role, "content": content}),
        })
        .collect();
    let max_tokens = tollgate::estimate::output_cap(request);
    let mut out = Map::new();
    out.insert("model".into(), Value::String(model.to_owned()));
    out.insert("max_tokens".into(), json!(max_tokens));
    out.insert("messages".into(), Value::Array(messages));
    if !system.is_empty() {
        out.insert("system".into(), Value::String(system.join("\n\n")));
    }
    for (from, to) in [("temperature", "temperature"), ("top_p", "top_p")] {
        if let Some(v) = request.get(from) {
            out.insert(to.into(), v.clone());
        }
    }
    if let Some(stop) = stop_sequences(request) {
        out.insert("stop_sequences".into(), stop);
    }
    if let Some(user) = request.get("user").and_then(Value::as_str) {
        out.insert("metadata".into(), json!({"user_id": user}));
    }
    let tools: Vec<Value> = array(request, "tools")
        .iter()
        .filter_map(|t| t.get("function"))
        .map(|f| {
            let mut tool = json!({"name": f.get("name"),
                "input_schema": f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}))});
            if let Some(d) = f.get("description") {
                tool["description"] = d.clone();
            }
            tool
        })
        .collect();
    if !tools.is_empty() {
        out.insert("tools".into(), Value::Array(tools));
    }
    let mut choice = match request.get("tool_choice") {
        Some(Value::String(c)) if c == "required" => Some(json!({"type": "any"})),
        Some(Value::String(c)) if c == "none" || c == "auto" => Some(json!({"type": c})),
        Some(Value::Object(c)) => c
            .get("function")
            .and_then(|f| f.get("name"))
            .map(|name| json!({"type": "tool", "name": name})),
        _ => None,
    };
    if request.get("parallel_tool_calls") == Some(&Value::Bool(false)) && out.contains_key("tools") {
        let c = choice.get_or_insert_with(|| json!({"type": "auto"}));
        if c["type"] != "none" {
            c["disable_parallel_tool_use"] = Value::Bool(true);
        }
    }
    if let Some(choice) = choice {
        out.insert("tool_choice".into(), choice);
    }
    if let Some(schema) = json_schema(request) {
        // JSON out: a tool whose input is the answer, and the model made to call it.
        out.insert(
            "tools".into(),
            json!([{"name": JSON_TOOL, "description": "Answer with the JSON object this schema describes.",
                    "input_schema": schema}]),
        );
        out.insert("tool_choice".into(), json!({"type": "tool", "name": JSON_TOOL}));
    }
    Value::Object(out)
}

/// The tool a JSON answer (`response_format` `json_object` or `json_schema`) is asked
/// through: its input is the answer, returned as the message's text.
const JSON_TOOL: &str = "tollgate_json_answer";

/// The schema a request's answer must follow, if it asks for JSON (`{"type": "object"}`
/// for `json_object`).
fn json_schema(request: &Value) -> Option<Value> {
    let format = request.get("response_format")?;
    match format.get("type").and_then(Value::as_str)? {
        "json_object" => Some(json!({"type": "object"})),
        "json_schema" => format.pointer("/json_schema/schema").cloned(),
        _ => None,
    }
}

/// Whether a content block is the call of [`JSON_TOOL`].
fn is_json_answer(block: &Value) -> bool {
    block.get("type").and_then(Value::as_str) == Some("tool_use")
        && block.get("name").and_then(Value::as_str) == Some(JSON_TOOL)
}

/// `stop_reason` → OpenAI `finish_reason`.
fn finish_reason(stop_reason: Option<&str>) -> &'static str {
    match stop_reason {
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    }
}

/// Input usage as Anthropic reports it, counted the OpenAI way: uncached input, cache
/// writes and cache reads together; cache reads are also the cached tokens.
fn input_usage(u: &Value) -> (i64, i64) {
    let cache_read = int(u, &["cache_read_input_tokens"]);
    let input = int(u, &["input_tokens"]) + int(u, &["cache_creation_input_tokens"]) + cache_read;
    (input, cache_read)
}

/// An Anthropic Messages response kept as it is (for a Messages request), its usage read
/// (input counted the OpenAI way, [`input_usage`]).
fn parse_message(body: &[u8]) -> Result<Success, String> {
    let msg: Value = serde_json::from_slice(body)
        .map_err(|e| format!("provider answered 2xx with a body that is not JSON: {e}"))?;
    if !msg.get("content").is_some_and(Value::is_array) {
        return Err("provider answered 2xx without `content`".to_owned());
    }
    let u = msg.get("usage").cloned().unwrap_or(Value::Null);
    let (input, cache_read) = input_usage(&u);
    let usage = Usage {
        input_tokens: input,
        output_tokens: int(&u, &["output_tokens"]),
        cached_tokens: cache_read,
    };
    Ok(Success { body: msg, usage })
}

/// Anthropic Messages response → OpenAI chat completion.
pub(super) fn parse_success(body: &[u8]) -> Result<Success, String> {
    let Success { body: msg, usage } = parse_message(body)?;
    let content = array(&msg, "content");
    let (answers, content): (Vec<Value>, Vec<Value>) = content.iter().cloned().partition(is_json_answer);
    let mut text: String = content
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    let tool_calls = super::messages_chat::tool_calls(&content);
    let mut finish = finish_reason(msg.get("stop_reason").and_then(Value::as_str));
    if let Some(answer) = answers.first() {
        // A JSON answer is the text of the completion, whatever the model said before it.
        text = answer
            .get("input")
            .cloned()
            .unwrap_or_else(|| json!({}))
            .to_string();
        if finish == "tool_calls" && tool_calls.is_empty() {
            finish = "stop";
        }
    }
    let reported = msg.get("usage").filter(|u| u.is_object()).map(|_| {
        json!({
            "prompt_tokens": usage.input_tokens,
            "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        })
    });
    let field = |k: &str| msg.get(k).cloned().unwrap_or(Value::Null);
    Ok(Success {
        body: super::completion(field("id"), field("model"), text, tool_calls, finish, reported),
        usage,
    })
}

/// The HTTP status an Anthropic error type stands for, as its API documents them.
pub(super) fn error_type_status(error_type: &str) -> Option<u16> {
    Some(match error_type {
        "invalid_request_error" => 400,
        "authentication_error" => 401,
        "billing_error" => 402,
        "permission_error" => 403,
        "not_found_error" => 404,
        "request_too_large" => 413,
        "rate_limit_error" => 429,
        "api_error" => 500,
        "timeout_error" => 504,
        "overloaded_error" => 529,
        _ => return None,
    })
}

/// Translates Anthropic's stream events into OpenAI chunks: `message_start` → the role
/// chunk, text of `content_block_start`/`content_block_delta` → content chunks, a
/// `tool_use` block's start → a tool call's first delta (id, name) and its
/// `input_json_delta`s → that call's argument deltas, `message_delta` → the finish chunk,
/// `message_stop` → the usage chunk and the end. Thinking deltas have no counterpart.
#[derive(Default)]
pub(super) struct Events {
    /// What every chunk of the message repeats, from `message_start`.
    head: ChunkHead,
    /// Tool calls started so far: the next one's OpenAI `index`.
    tool_calls: usize,
    /// The block open is the JSON answer ([`JSON_TOOL`]): its input is relayed as text.
    in_json_answer: bool,
    /// A JSON answer was given: its `tool_use` stop is a normal stop.
    answered_json: bool,
}

impl StreamEvents for Events {
    fn on_event(&mut self, event: SseEvent, out: &mut StreamOut) -> Result<(), Failure> {
        let v = read_event(&event, out)?;
        match v.get("type").and_then(Value::as_str).unwrap_or_default() {
            "message_start" => {
                let m = v.get("message").cloned().unwrap_or(Value::Null);
                let field = |k: &str| m.get(k).cloned().unwrap_or(Value::Null);
                self.head = ChunkHead::new(field("id"), field("model"));
                if let Some(u) = m.get("usage") {
                    let (input, cached) = input_usage(u);
                    out.input(input, cached);
                }
                out.chunk(self.head.chunk(json!({"role": "assistant", "content": ""}), None));
            }
            "content_block_start" => {
                let block = v.get("content_block").unwrap_or(&Value::Null);
                self.in_json_answer = is_json_answer(block);
                self.answered_json |= self.in_json_answer;
                match block.get("type").and_then(Value::as_str) {
                    _ if self.in_json_answer => {}
                    Some("text") => {
                        self.content(block.get("text").and_then(Value::as_str).unwrap_or_default(), out)
                    }
                    Some("tool_use") => {
                        let index = self.tool_calls;
                        self.tool_calls += 1;
                        let call = json!({"index": index, "id": block.get("id"), "type": "function",
                            "function": {"name": block.get("name"), "arguments": ""}});
                        out.chunk(self.head.chunk(json!({"tool_calls": [call]}), None));
                    }
                    _ => {}
                }
            }
            "content_block_delta" => {
                let delta = v.get("delta").unwrap_or(&Value::Null);
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        self.content(delta.get("text").and_then(Value::as_str).unwrap_or_default(), out)
                    }
                    Some("input_json_delta") => {
                        let partial = delta
                            .get("partial_json")
                            .and_then(Value::as_str)
                            .unwrap_or_default();
                        if self.in_json_answer {
                            self.content(partial, out);
                        } else if !partial.is_empty() && self.tool_calls > 0 {
                            out.content(partial);
                            let call =
                                json!({"index": self.tool_calls - 1, "function": {"arguments": partial}});
                            out.chunk(self.head.chunk(json!({"tool_calls": [call]}), None));
                        }
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                message_delta_usage(&v, out);
                let reason = v.pointer("/delta/stop_reason").and_then(Value::as_str);
                let finish = match finish_reason(reason) {
                    "tool_calls" if self.answered_json && self.tool_calls == 0 => "stop",
                    finish => finish,
                };
                out.chunk(self.head.chunk(json!({}), Some(finish)));
            }
            "message_stop" => self.head.finish_with_usage(out),
            // ping, content_block_stop, and event types with no OpenAI counterpart
            // (thinking).
            _ => {}
        }
        Ok(())
    }
}

/// Anthropic's stream events as they are, for a Messages request: each event's data is
/// relayed (the relay names it by its `type`), its usage and text counted on the way.
pub(super) struct PassThrough;

impl StreamEvents for PassThrough {
    fn on_event(&mut self, event: SseEvent, out: &mut StreamOut) -> Result<(), Failure> {
        let v = read_event(&event, out)?;
        match v.get("type").and_then(Value::as_str).unwrap_or_default() {
            "message_start" => {
                if let Some(u) = v.pointer("/message/usage") {
                    let (input, cached) = input_usage(u);
                    out.input(input, cached);
                }
            }
            "content_block_delta" => {
                let delta = v.get("delta").unwrap_or(&Value::Null);
                for field in ["text", "partial_json", "thinking"] {
                    if let Some(text) = delta.get(field).and_then(Value::as_str) {
                        out.content(text);
                    }
                }
            }
            "message_delta" => message_delta_usage(&v, out),
            "message_stop" => out.finish(),
            _ => {}
        }
        out.chunk(event.data.to_string());
        Ok(())
    }
}

/// An event's data, or the failure it stands for: an `error` event by its Anthropic error
/// type, data that is not JSON as a bad response.
fn read_event(event: &SseEvent, out: &mut StreamOut) -> Result<Value, Failure> {
    let v = out.json(&event.data)?;
    if streaming::is_error_event(event, &v) {
        let error_type = v
            .pointer("/error/type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let status = error_type_status(error_type).unwrap_or(500);
        return Err(out.error_event(status, &event.data));
    }
    Ok(v)
}

/// The usage a `message_delta` reports: output so far, and input where it repeats it.
fn message_delta_usage(v: &Value, out: &mut StreamOut) {
    let Some(u) = v.get("usage") else { return };
    if u.get("input_tokens").is_some() {
        let (input, cached) = input_usage(u);
        out.input(input, cached);
    }
    if u.get("output_tokens").is_some_and(Value::is_number) {
        out.output(int(u, &["output_tokens"]));
    }
}

impl Events {
    fn content(&self, text: &str, out: &mut StreamOut) {
        if text.is_empty() {
            return;
        }
        out.content(text);
        out.chunk(self.head.chunk(json!({"content": text}), None));
    }
}

impl BatchApi for Anthropic {
    /// Message Batches take their lines inline.
    fn upload(
        &self,
        _model: &str,
        _endpoint: Endpoint,
        _lines: &[(String, &Value)],
        _tag: &str,
    ) -> Option<Upload> {
        None
    }

    /// Each line's `params` is its online body: a Messages request as it is, a chat
    /// request translated.
    fn create(
        &self,
        model: &str,
        endpoint: Endpoint,
        lines: &[(String, &Value)],
        _tag: &str,
        _file_id: Option<&str>,
    ) -> (String, Value) {
        let requests: Vec<Value> = lines
            .iter()
            .map(|(id, r)| json!({"custom_id": id, "params": self.body(model, endpoint, r, Mode::Whole)}))
            .collect();
        (
            format!("{}/v1/messages/batches", self.base_url),
            json!({"requests": requests}),
        )
    }

    fn status_url(&self, batch_id: &str) -> String {
        format!("{}/v1/messages/batches/{batch_id}", self.base_url)
    }

    fn parse_status(&self, batch: &Value) -> Status {
        let status = batch
            .get("processing_status")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let count = |k: &str| {
            batch
                .pointer(&format!("/request_counts/{k}"))
                .and_then(Value::as_u64)
        };
        let finished: Option<u64> = ["succeeded", "errored", "canceled", "expired"]
            .iter()
            .map(|k| count(k))
            .sum();
        Status {
            ended: status == "ended",
            status,
            result_files: Vec::new(),
            progress: finished
                .zip(count("processing"))
                .map(|(done, left)| (done, done + left)),
        }
    }

    fn cancel_url(&self, batch_id: &str) -> String {
        format!("{}/v1/messages/batches/{batch_id}/cancel", self.base_url)
    }

    fn result_urls(&self, batch_id: &str, _status: &Status) -> Vec<String> {
        vec![format!(
            "{}/v1/messages/batches/{batch_id}/results",
            self.base_url
        )]
    }

    fn parse_results(&self, endpoint: Endpoint, body: &[u8], out: &mut HashMap<String, LineResult>) {
        by_custom_id(body, out, |line| line_result(&line["result"], endpoint));
    }
}

/// One line's `result`: `succeeded` (with the message, read as the online answer of
/// `endpoint`), `errored`, `canceled`, `expired`.
fn line_result(result: &Value, endpoint: Endpoint) -> LineResult {
    let kind = result.get("type").and_then(Value::as_str).unwrap_or("errored");
    match (kind, result.get("message")) {
        ("succeeded", Some(m)) => match read_message(m.to_string().as_bytes(), endpoint) {
            Ok(success) => LineResult::Succeeded {
                success,
                request_id: None,
            },
            Err(message) => failed(ReasonCode::ProviderBadResponse, message),
        },
        ("errored", _) => {
            let e = &result["error"]["error"];
            let message = e.get("message").and_then(Value::as_str).unwrap_or("errored");
            failed(ReasonCode::ProviderBatchErrored, message.to_owned())
        }
        (other, _) => {
            let code = match other {
                "expired" => ReasonCode::ProviderBatchExpired,
                "canceled" => ReasonCode::ProviderBatchCanceled,
                _ => ReasonCode::ProviderBatchErrored,
            };
            failed(code, format!("the line was {other}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use tollgate::retry::FailureClass;

    use super::*;
    use crate::providers::batch_api::{failure_of, jsonl_of};
    use crate::providers::streaming::ChatStream;

    fn adapter() -> Anthropic {
        Anthropic {
            base_url: "https://api.anthropic.com".to_owned(),
            version: "2023-06-01".to_owned(),
        }
    }

    #[test]
    fn builds_plain_and_streamed_requests() {
        let r = json!({"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9});
        for mode in [Mode::Whole, Mode::Stream] {
            let req = adapter()
                .request(
                    &reqwest::Client::new(),
                    &SecretString::from("ak-test"),
                    "claude-x",
                    Endpoint::ChatCompletions,
                    &r,
                    mode,
                )
                .build()
                .unwrap();
            assert_eq!(req.url().as_str(), "https://api.anthropic.com/v1/messages");
            assert_eq!(req.headers()["x-api-key"], "ak-test");
            assert_eq!(req.headers()["anthropic-version"], "2023-06-01");
            assert!(req.headers().get("authorization").is_none());
            let body: Value = serde_json::from_slice(req.body().unwrap().as_bytes().unwrap()).unwrap();
            assert_eq!(body["model"], "claude-x");
            assert_eq!(body["max_tokens"], 9);
            assert_eq!(
                body.get("stream"),
                (mode == Mode::Stream).then_some(&Value::Bool(true))
            );
        }
    }

    #[test]
    fn translates_system_messages_parts_and_caps() {
        let r = json!({
            "model": "fast",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "yes?"}
            ],
            "max_tokens": 77, "temperature": 0.2, "stop": "END"
        });
        let a = translate_request("claude-x", &r);
        assert_eq!(a["model"], "claude-x");
        assert_eq!(a["system"], "be brief");
        assert_eq!(a["max_tokens"], 77);
        assert_eq!(a["messages"][0], json!({"role": "user", "content": "hi there"}));
        assert_eq!(a["messages"][1]["role"], "assistant");
        assert_eq!(a["stop_sequences"], json!(["END"]));
        // No cap of its own: the one the gate reserved, for each choice the estimate counts.
        let no_cap = json!({"messages": [], "n": 2});
        let a = translate_request("c", &no_cap);
        assert_eq!(a["max_tokens"], tollgate::estimate::DEFAULT_OUTPUT_TOKENS);
        assert_eq!(
            2 * a["max_tokens"].as_i64().unwrap(),
            i64::from(tollgate::estimate::output_tokens(&no_cap))
        );
    }

    #[test]
    fn translates_the_response() {
        let body = br#"{"id":"msg_1","type":"message","role":"assistant","model":"c","content":[{"type":"text","text":"hello"}],"stop_reason":"max_tokens","stop_sequence":null,"usage":{"input_tokens":10,"output_tokens":3,"cache_read_input_tokens":5}}"#;
        let s = parse_success(body).unwrap();
        assert_eq!(s.body["object"], "chat.completion");
        assert_eq!(s.body["id"], "msg_1");
        assert_eq!(s.body["choices"][0]["message"]["content"], "hello");
        assert_eq!(s.body["choices"][0]["finish_reason"], "length");
        assert_eq!(
            s.usage,
            Usage {
                input_tokens: 15,
                output_tokens: 3,
                cached_tokens: 5
            }
        );
        assert_eq!(s.body["usage"]["total_tokens"], 18);
        assert_eq!(s.body["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
        // No usage is not invented as zeros: the caller sees it missing and estimates it.
        let bare = br#"{"id":"msg_2","type":"message","content":[{"type":"text","text":"hi"}]}"#;
        assert!(parse_success(bare).unwrap().body.get("usage").is_none());
        // A truncated body is an error, not a panic.
        assert!(parse_success(&body[..body.len() / 2]).is_err());
    }

    #[test]
    fn classifies_error_answers() {
        let a = adapter();
        let headers = reqwest::header::HeaderMap::new();
        let overloaded = br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        let f = a.classify_error(529, &headers, overloaded);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Overload, ReasonCode::ProviderOverloaded)
        );
        let limited = br#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"}}"#;
        let f = a.classify_error(429, &headers, limited);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Capacity, ReasonCode::RateLimited)
        );
        let spend = br#"{"type":"error","error":{"type":"rate_limit_error","message":"spend limit","details":{"error_code":"enforced_spend_limit_reached"}}}"#;
        let f = a.classify_error(429, &headers, spend);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::SpendCap, ReasonCode::SpendLimitReached)
        );
        let f = a.classify_error(
            401,
            &headers,
            br#"{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"}}"#,
        );
        assert_eq!(f.class, FailureClass::KeyUnusable);
        assert!(a.keeps_header("anthropic-ratelimit-tokens-remaining"));
        assert!(a.keeps_header("retry-after"));
        assert!(!a.keeps_header("request-id"));
    }

    #[test]
    fn translates_tools_calls_results_and_images_both_ways() {
        let request = json!({"model": "fast", "max_tokens": 50, "parallel_tool_calls": false,
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
                      {"type": "function", "function": {"name": "bare"}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [
                {"role": "developer", "content": "use tools"},
                {"role": "user", "content": [{"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg", "detail": "low"}}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}},
                    {"id": "toolu_2", "type": "function", "function": {"name": "bare", "arguments": ""}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
                {"role": "tool", "tool_call_id": "toolu_2", "content": [{"type": "text", "text": "ok"}]},
                {"role": "user", "content": "and tomorrow?"}]});
        assert_eq!(unexpressed(&request), None);
        let body = translate_request("claude-x", &request);
        assert_eq!(body["system"], "use tools");
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "bare", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "ok"},
                    {"type": "text", "text": "and tomorrow?"}]},
            ]),
            "tool results and the next user text are one user turn"
        );
        assert_eq!(
            body["tools"],
            json!([{"name": "get_weather", "description": "d",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
                   {"name": "bare", "input_schema": {"type": "object"}}])
        );
        assert_eq!(
            body["tool_choice"],
            json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true})
        );
        for (choice, sent) in [
            ("required", json!({"type": "any"})),
            ("none", json!({"type": "none"})),
        ] {
            let mut r = request.clone();
            r["tool_choice"] = json!(choice);
            r["parallel_tool_calls"] = json!(true);
            assert_eq!(translate_request("m", &r)["tool_choice"], sent);
        }

        let answer = br#"{"id":"msg_1","model":"claude-x","stop_reason":"tool_use","content":[
            {"type":"text","text":"checking"},
            {"type":"tool_use","id":"toolu_9","name":"get_weather","input":{"city":"Oslo"}}],
            "usage":{"input_tokens":5,"output_tokens":3}}"#;
        let s = parse_success(answer).unwrap();
        let choice = &s.body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], "checking");
        assert_eq!(
            choice["message"]["tool_calls"],
            json!([{"id": "toolu_9", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}])
        );
        let only_call = br#"{"id":"m","model":"c","stop_reason":"tool_use","content":[
            {"type":"tool_use","id":"t","name":"f","input":{}}],"usage":{"input_tokens":1,"output_tokens":1}}"#;
        assert_eq!(
            parse_success(only_call).unwrap().body["choices"][0]["message"]["content"],
            Value::Null
        );
    }

    #[test]
    fn what_anthropic_cannot_express_is_named() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let refused = |extra: Value| {
            let mut r = json!({"model": "m", "messages": user});
            for (k, v) in extra.as_object().unwrap() {
                r[k] = v.clone();
            }
            unexpressed(&r).map(|u| u.param)
        };
        assert_eq!(refused(json!({"n": 2})).as_deref(), Some("n"));
        assert_eq!(
            refused(json!({"n": 1, "seed": null, "logprobs": false, "presence_penalty": 0})),
            None
        );
        assert_eq!(refused(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(refused(json!({"response_format": {"type": "json_object"}})), None);
        let schema = |s: Value| json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}});
        assert_eq!(refused(schema(json!({"type": "object"}))), None);
        assert_eq!(
            refused(schema(json!({"type": "array"}))).as_deref(),
            Some("response_format.json_schema.schema")
        );
        let mut with_tools = schema(json!({"type": "object"}));
        with_tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
        assert_eq!(refused(with_tools).as_deref(), Some("response_format"));
        assert_eq!(refused(json!({"seed": 3})).as_deref(), Some("seed"));
        assert_eq!(
            refused(json!({"tools": [{"type": "custom", "custom": {"name": "x"}}]})).as_deref(),
            Some("tools[0].type")
        );
        let bad_arguments = json!([{"role": "assistant", "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]);
        assert_eq!(
            refused(json!({"messages": bad_arguments})).as_deref(),
            Some("messages[0].tool_calls[0].function.arguments")
        );
        let tiff = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/tiff;base64,AA"}}]}]);
        assert_eq!(
            refused(json!({"messages": tiff})).as_deref(),
            Some("messages[0].content[0].image_url")
        );
    }

    #[tokio::test]
    async fn streams_tool_calls_as_argument_deltas() {
        let events = [
            r#"{"type":"message_start","message":{"id":"msg_1","model":"claude-x","content":[],"usage":{"input_tokens":7,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"let me see"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"f","input":{}}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a\":"}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"1}"}}"#,
            r#"{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_2","name":"g","input":{}}}"#,
            r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{}"}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":9}}"#,
            r#"{"type":"message_stop"}"#,
        ];
        let body: String = events
            .iter()
            .map(|e| format!("event: x\ndata: {e}\n\n"))
            .collect();
        let mut s = ChatStream::canned(Box::new(Events::default()), &[&body]);
        let (chunks, _) = s.flagged().await;
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(*deltas[1], json!({"content": "let me see"}));
        assert_eq!(
            *deltas[2],
            json!({"tool_calls": [{"index": 0, "id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": ""}}]})
        );
        assert_eq!(
            *deltas[3],
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]})
        );
        assert_eq!(
            *deltas[4],
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
        );
        assert_eq!(deltas[5]["tool_calls"][0]["index"], 1);
        assert_eq!(
            *deltas[6],
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]})
        );
        assert_eq!(chunks[7]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(s.usage().output_tokens, 9);
    }

    #[tokio::test]
    async fn translates_stream_events_to_openai_chunks() {
        let events = [
            r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-x","content":[],"usage":{"input_tokens":7,"cache_read_input_tokens":3,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hello"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" world"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":2}}"#,
            r#"{"type":"message_stop"}"#,
        ];
        let body: String = events
            .iter()
            .map(|e| {
                let name = serde_json::from_str::<Value>(e).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                format!("event: {name}\ndata: {e}\n\n")
            })
            .collect();
        let mut s = ChatStream::canned(Box::new(Events::default()), &[&body]);
        let (chunks, usage_flags) = s.flagged().await;
        assert!(s.finished());
        // role, two content chunks, finish, usage
        assert_eq!(usage_flags, [false, false, false, false, true]);
        assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
        assert!(
            chunks
                .iter()
                .all(|c| c["id"] == "msg_1" && c["model"] == "claude-x")
        );
        assert_eq!(
            chunks[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(chunks[1]["choices"][0]["delta"], json!({"content": "hello"}));
        assert_eq!(chunks[2]["choices"][0]["delta"], json!({"content": " world"}));
        assert_eq!(chunks[3]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[4]["choices"], json!([]));
        assert_eq!(
            chunks[4]["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                   "prompt_tokens_details": {"cached_tokens": 3}})
        );
        assert_eq!(
            s.usage(),
            Usage {
                input_tokens: 10,
                output_tokens: 2,
                cached_tokens: 3
            }
        );
    }

    #[tokio::test]
    async fn error_events_are_classified() {
        let overloaded = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"c\",\"usage\":{\"input_tokens\":7,\"output_tokens\":1}}}\n\n\
            event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        let mut s = ChatStream::canned(Box::new(Events::default()), &[overloaded]);
        let (chunks, failure) = s.drain().await;
        assert_eq!(chunks.len(), 1, "the role chunk came before the error");
        let f = failure.unwrap();
        assert_eq!(
            (f.class, f.code, f.status),
            (FailureClass::Overload, ReasonCode::ProviderOverloaded, None)
        );
        assert_eq!(s.usage().input_tokens, 7);
        for (error_type, class) in [
            ("rate_limit_error", FailureClass::Capacity),
            ("invalid_request_error", FailureClass::Request),
            ("api_error", FailureClass::Overload),
            ("something_new", FailureClass::Overload),
        ] {
            let event = format!(
                "event: error\ndata: {{\"type\":\"error\",\"error\":{{\"type\":\"{error_type}\",\"message\":\"m\"}}}}\n\n"
            );
            let mut s = ChatStream::canned(Box::new(Events::default()), &[&event]);
            assert_eq!(s.drain().await.1.unwrap().class, class, "{error_type}");
        }
    }

    #[test]
    fn a_json_schema_answer_is_asked_as_a_forced_tool_and_returned_as_text() {
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let r = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}});
        let body = translate_request("m", &r);
        assert_eq!(body["tools"][0]["input_schema"], schema);
        assert_eq!(body["tool_choice"], json!({"type": "tool", "name": JSON_TOOL}));
        let answer = json!({"id": "msg_1", "model": "m", "stop_reason": "tool_use",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": JSON_TOOL, "input": {"city": "Oslo"}}],
            "usage": {"input_tokens": 5, "output_tokens": 3}});
        let chat = parse_success(answer.to_string().as_bytes()).unwrap().body;
        let choice = &chat["choices"][0];
        assert_eq!(choice["message"]["content"], "{\"city\":\"Oslo\"}");
        assert_eq!(choice["finish_reason"], "stop");
        assert!(
            choice["message"].get("tool_calls").is_none_or(Value::is_null),
            "{chat}"
        );
    }

    #[test]
    fn batch_requests_status_and_results() {
        let a = adapter();
        let r = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5});
        let lines = [("job-1".to_owned(), &r)];
        let chat = Endpoint::ChatCompletions;
        assert!(a.upload("claude-x", chat, &lines, "pack-1").is_none());
        let (url, body) = a.create("claude-x", chat, &lines, "pack-1", None);
        assert_eq!(url, "https://api.anthropic.com/v1/messages/batches");
        assert_eq!(
            body,
            json!({"requests": [{"custom_id": "job-1", "params": {
                "model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}}]})
        );
        // A Messages request goes as it is, with the target's model.
        let m = json!({"model": "fast", "system": [{"type": "text", "text": "be brief"}],
                       "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "top_k": 3});
        let (_, body) = a.create(
            "claude-x",
            Endpoint::Messages,
            &[("job-2".to_owned(), &m)],
            "pack-2",
            None,
        );
        let mut sent = m.clone();
        sent["model"] = json!("claude-x");
        assert_eq!(body["requests"][0]["params"], sent);
        assert_eq!(
            a.status_url("mb_1"),
            "https://api.anthropic.com/v1/messages/batches/mb_1"
        );
        assert_eq!(
            a.cancel_url("mb_1"),
            "https://api.anthropic.com/v1/messages/batches/mb_1/cancel"
        );
        let running = a.parse_status(
            &json!({"id": "mb_1", "type": "message_batch", "processing_status": "in_progress"}),
        );
        assert!(!running.ended);
        let ended = a.parse_status(&json!({"id": "mb_1", "processing_status": "ended"}));
        assert!(ended.ended);
        assert_eq!(
            a.result_urls("mb_1", &ended),
            ["https://api.anthropic.com/v1/messages/batches/mb_1/results"]
        );

        let lines = [
            json!({"custom_id": "ok", "result": {"type": "succeeded", "message": {"id": "msg_1", "type": "message",
                   "model": "claude-x", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                   "usage": {"input_tokens": 4, "output_tokens": 1}}}}),
            json!({"custom_id": "bad", "result": {"type": "errored", "error": {"type": "error",
                   "error": {"type": "invalid_request_error", "message": "max_tokens too large"}}}}),
            json!({"custom_id": "late", "result": {"type": "expired"}}),
            json!({"custom_id": "gone", "result": {"type": "canceled"}}),
        ];
        let mut out = HashMap::new();
        a.parse_results(chat, &jsonl_of(&lines), &mut out);
        let Some(LineResult::Succeeded { success, .. }) = out.get("ok") else {
            panic!("{out:?}");
        };
        assert_eq!(success.body["choices"][0]["message"]["content"], "hi");
        assert_eq!(success.usage.input_tokens, 4);
        // A batch of Messages requests: the message kept as Anthropic sent it.
        let mut messages = HashMap::new();
        a.parse_results(Endpoint::Messages, &jsonl_of(&lines), &mut messages);
        let Some(LineResult::Succeeded { success, .. }) = messages.get("ok") else {
            panic!("{messages:?}");
        };
        assert_eq!(success.body, lines[0]["result"]["message"]);
        assert_eq!(success.usage.output_tokens, 1);
        let code = |id: &str| failure_of(&out, id);
        assert_eq!(
            code("bad"),
            (
                "provider_batch_errored".to_owned(),
                "max_tokens too large".to_owned()
            )
        );
        assert_eq!(code("late").0, "provider_batch_expired");
        assert_eq!(code("gone").0, "provider_batch_canceled");
    }
}
