//! What each endpoint's request must hold before it becomes a job: its shape checked enough
//! that a provider will not reject it for that, every field it is charged for reservable
//! (`estimate::check`), its model resolved to targets that serve the endpoint, every field
//! expressible to each of them (`providers::unexpressed`: what an adapter cannot translate
//! is refused, never dropped), and its tokens estimated. One place for every way in (`POST
//! /v1/jobs`, a bulk's items, a batch's lines, the synchronous endpoints), so all of them
//! refuse the same requests with the same reason codes.

use serde_json::{Map, Value};
use tollgate::config::Config;
use tollgate::estimate;
use tollgate::routing::{self, Unresolved};
use tollgate::vocab::{ApiErrorCode, Endpoint};
use tollgate_workers::providers::as_chat::AsChat;
use tollgate_workers::providers::unexpressed;

use crate::error::ApiError;

/// Most inputs one embeddings request may hold (OpenAI's documented maximum).
const MAX_EMBEDDING_INPUTS: usize = 2048;

/// A request checked for its endpoint: the model asked for, and what the gate reserves
/// (for the largest of the targets that may serve it).
#[derive(Debug)]
pub(crate) struct Checked {
    pub model: String,
    pub estimated_input_tokens: i32,
    pub estimated_output_tokens: i32,
}

/// Checks `request` as a body of `endpoint` and resolves its model. `param_prefix` is
/// where the request sits in what the client sent (`request.`, `body.`, or nothing), so
/// that `param` points at the field.
pub(crate) fn check(
    config: &Config,
    endpoint: Endpoint,
    request: &Value,
    param_prefix: &str,
) -> Result<Checked, ApiError> {
    let model = match endpoint {
        Endpoint::ChatCompletions => validate_chat_request(request, param_prefix)?,
        Endpoint::Embeddings => validate_embeddings_request(request, param_prefix)?,
        Endpoint::Responses => validate_responses_request(request, param_prefix)?,
        Endpoint::Moderations => validate_moderations_request(request, param_prefix)?,
        Endpoint::Messages => validate_messages_request(request, param_prefix)?,
        Endpoint::Completions => validate_completions_request(request, param_prefix)?,
    };
    let targets = routing::resolve(config, &model, endpoint).map_err(|why| {
        let (code, message) = match why {
            Unresolved::UnknownModel => (
                ApiErrorCode::UnknownModel,
                format!(
                    "model {model:?} is neither a route alias, a configured provider/model, nor a model a provider lists"
                ),
            ),
            Unresolved::EndpointNotServed => (
                ApiErrorCode::EndpointNotServed,
                format!("no target of model {model:?} is a provider that serves {endpoint}"),
            ),
        };
        ApiError::bad_request(code, message).with_param(format!("{param_prefix}model"))
    })?;
    // What a target's adapter cannot translate is refused here, never dropped on the way:
    // chat to any kind, and Messages and Responses to targets that do not speak them
    // (first to chat, then as that chat request to the target). The other endpoints go as
    // they are.
    let translation = targets.iter().find_map(|t| AsChat::of(t.kind, endpoint));
    let as_chat = translation.map(|t| t.chat_request(request));
    for target in &targets {
        let provider = config.provider(&target.provider);
        let refused = match (&as_chat, AsChat::of(target.kind, endpoint)) {
            _ if endpoint == Endpoint::ChatCompletions => {
                provider.and_then(|p| unexpressed(p, &target.model, request))
            }
            (Some(chat), Some(translation)) => translation
                .unexpressed(request)
                .or_else(|| provider.and_then(|p| unexpressed(p, &target.model, chat))),
            _ => None,
        };
        if let Some(refused) = refused {
            return Err(ApiError::bad_request(
                ApiErrorCode::UnsupportedField,
                format!(
                    "{} (model {model:?} may be served by {})",
                    refused.message,
                    target.label()
                ),
            )
            .with_param(format!("{param_prefix}{}", refused.param)));
        }
    }
    let models = targets.iter().map(|t| t.model.as_str());
    let mut estimated_input_tokens = estimate::endpoint_input_tokens(endpoint, request, models.clone());
    if let Some(chat) = &as_chat {
        // A chat target counts the translation by its own tokenizer: the larger count is
        // reserved.
        let chat_estimate = estimate::endpoint_input_tokens(Endpoint::ChatCompletions, chat, models);
        estimated_input_tokens = estimated_input_tokens.max(chat_estimate);
    }
    Ok(Checked {
        estimated_input_tokens,
        estimated_output_tokens: estimate::endpoint_output_tokens(endpoint, request),
        model,
    })
}

/// The request as an object, and its `model`.
fn object_and_model<'a>(
    request: &'a Value,
    param_prefix: &str,
    what: &str,
) -> Result<(&'a Map<String, Value>, String), ApiError> {
    let obj = request.as_object().ok_or_else(|| {
        ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            format!("the {what} request must be a JSON object"),
        )
        .with_param(param_prefix.trim_end_matches('.'))
    })?;
    let p = |name: &str| format!("{param_prefix}{name}");
    match obj.get("model") {
        Some(Value::String(m)) if !m.is_empty() => Ok((obj, m.clone())),
        Some(_) => Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "`model` must be a non-empty string",
        )
        .with_param(p("model"))),
        None => Err(
            ApiError::bad_request(ApiErrorCode::MissingField, "`model` is required").with_param(p("model")),
        ),
    }
}

/// The array at `key` of `v`, or none.
fn array<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// `400 invalid_request` when `field` is set to anything but a positive integer.
fn positive_if_set(obj: &Map<String, Value>, field: &str, param_prefix: &str) -> Result<(), ApiError> {
    match obj.get(field) {
        Some(v) if v.as_i64().is_none_or(|n| n < 1) => Err(invalid(
            format!("{param_prefix}{field}"),
            &format!("`{field}` must be a positive integer"),
        )),
        _ => Ok(()),
    }
}

/// `400 invalid_request` at `at`.
fn invalid(at: String, message: &str) -> ApiError {
    ApiError::bad_request(ApiErrorCode::InvalidRequest, message).with_param(at)
}

/// `400 unsupported_field` at `at`: a field whose cost tollgate cannot reserve.
fn unsupported(at: String, message: String) -> ApiError {
    ApiError::bad_request(ApiErrorCode::UnsupportedField, message).with_param(at)
}

/// Checks an OpenAI Chat Completions body enough that a provider will not reject its
/// shape, and that every field it is charged for can be reserved (`estimate::check`);
/// returns the requested model.
pub(crate) fn validate_chat_request(request: &Value, param_prefix: &str) -> Result<String, ApiError> {
    let p = |name: &str| format!("{param_prefix}{name}");
    let (obj, model) = object_and_model(request, param_prefix, "chat")?;
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(
                ApiError::bad_request(ApiErrorCode::InvalidRequest, "`messages` must not be empty")
                    .with_param(p("messages")),
            );
        }
        Some(_) => {
            return Err(
                ApiError::bad_request(ApiErrorCode::InvalidRequest, "`messages` must be an array")
                    .with_param(p("messages")),
            );
        }
        None => {
            return Err(
                ApiError::bad_request(ApiErrorCode::MissingField, "`messages` is required")
                    .with_param(p("messages")),
            );
        }
    };
    for (i, m) in messages.iter().enumerate() {
        let at = p(&format!("messages[{i}]"));
        let role = m.get("role").and_then(Value::as_str);
        if !matches!(role, Some("system" | "developer" | "user" | "assistant" | "tool")) {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidRequest,
                "each message needs `role`: system, developer, user, assistant or tool",
            )
            .with_param(format!("{at}.role")));
        }
        match m.get("content") {
            Some(Value::String(_) | Value::Array(_) | Value::Null) | None => {}
            Some(_) => {
                return Err(ApiError::bad_request(
                    ApiErrorCode::InvalidRequest,
                    "message `content` must be a string or an array of parts",
                )
                .with_param(format!("{at}.content")));
            }
        }
    }
    for cap in ["max_tokens", "max_completion_tokens"] {
        positive_if_set(obj, cap, param_prefix)?;
    }
    estimate::check(request).map_err(|r| ApiError::bad_request(r.code, r.message).with_param(p(&r.param)))?;
    Ok(model)
}

/// Checks an OpenAI Embeddings body as the API defines it: `input` a non-empty string, an
/// array of 1 to 2048 non-empty strings, an array of token ids, or an array of non-empty
/// arrays of token ids; `encoding_format` `float` or `base64`; `dimensions` a positive
/// integer. Returns the requested model.
/// A legacy completions request: `prompt` a string, strings, token ids or arrays of token
/// ids; `max_tokens` ≥ 0; `n` 1 to 128; `best_of` from `n` to 20 and not streamed (OpenAI
/// does not stream it); `logprobs` 0 to 5.
pub(crate) fn validate_completions_request(request: &Value, param_prefix: &str) -> Result<String, ApiError> {
    let p = |name: &str| format!("{param_prefix}{name}");
    let (obj, model) = object_and_model(request, param_prefix, "completions")?;
    let is_token = |v: &Value| v.as_u64().is_some_and(|t| t <= u64::from(u32::MAX));
    let prompt_ok = match obj.get("prompt") {
        None => {
            return Err(
                ApiError::bad_request(ApiErrorCode::MissingField, "`prompt` is required")
                    .with_param(p("prompt")),
            );
        }
        Some(Value::String(_)) => true,
        Some(Value::Array(items)) if !items.is_empty() => {
            items.iter().all(is_token)
                || items.iter().all(Value::is_string)
                || items.iter().all(|i| {
                    i.as_array()
                        .is_some_and(|ids| !ids.is_empty() && ids.iter().all(is_token))
                })
        }
        Some(_) => false,
    };
    if !prompt_ok {
        return Err(invalid(
            p("prompt"),
            "`prompt` must be a string, an array of strings, an array of token ids, or an array of arrays of token ids",
        ));
    }
    let int = |field: &str| obj.get(field).filter(|v| !v.is_null());
    let within = |field: &str, low: i64, high: i64, message: &str| match int(field) {
        Some(v) if v.as_i64().is_none_or(|n| n < low || n > high) => Err(invalid(p(field), message)),
        _ => Ok(()),
    };
    within(
        "max_tokens",
        0,
        i64::from(i32::MAX),
        "`max_tokens` must be a non-negative integer",
    )?;
    within("n", 1, 128, "`n` must be 1 to 128")?;
    within("logprobs", 0, 5, "`logprobs` must be 0 to 5")?;
    let n = int("n").and_then(Value::as_i64).unwrap_or(1);
    within("best_of", n, 20, "`best_of` must be at least `n` and at most 20")?;
    if int("best_of").is_some() && obj.get("stream") == Some(&Value::Bool(true)) {
        return Err(invalid(p("best_of"), "`best_of` cannot be streamed"));
    }
    Ok(model)
}

pub(crate) fn validate_embeddings_request(request: &Value, param_prefix: &str) -> Result<String, ApiError> {
    let p = |name: &str| format!("{param_prefix}{name}");
    let (obj, model) = object_and_model(request, param_prefix, "embeddings")?;
    let is_token = |v: &Value| v.as_u64().is_some_and(|t| t <= u64::from(u32::MAX));
    match obj.get("input") {
        None => {
            return Err(
                ApiError::bad_request(ApiErrorCode::MissingField, "`input` is required")
                    .with_param(p("input")),
            );
        }
        Some(Value::String(s)) if s.is_empty() => {
            return Err(invalid(p("input"), "`input` must not be an empty string"));
        }
        Some(Value::String(_)) => {}
        Some(Value::Array(items)) => {
            if items.is_empty() || items.len() > MAX_EMBEDDING_INPUTS {
                return Err(invalid(
                    p("input"),
                    "`input` must hold 1 to 2048 inputs (or be one string)",
                ));
            }
            let token_ids = items.iter().all(Value::is_number);
            for (i, item) in items.iter().enumerate() {
                let ok = match item {
                    _ if token_ids => is_token(item),
                    Value::String(s) => !s.is_empty(),
                    Value::Array(ids) => !ids.is_empty() && ids.iter().all(is_token),
                    _ => false,
                };
                if !ok {
                    return Err(invalid(
                        p(&format!("input[{i}]")),
                        "each input must be a non-empty string, a token id, or a non-empty array of token ids, all of one kind",
                    ));
                }
            }
            if !token_ids && items.iter().any(Value::is_string) && items.iter().any(Value::is_array) {
                return Err(invalid(
                    p("input"),
                    "`input` must be all strings or all arrays of token ids",
                ));
            }
        }
        Some(_) => {
            return Err(invalid(
                p("input"),
                "`input` must be a string, an array of strings, or token ids",
            ));
        }
    }
    if let Some(format) = obj.get("encoding_format")
        && !matches!(format.as_str(), Some("float" | "base64"))
    {
        return Err(invalid(
            p("encoding_format"),
            "`encoding_format` must be \"float\" or \"base64\"",
        ));
    }
    positive_if_set(obj, "dimensions", param_prefix)?;
    Ok(model)
}

/// Checks an OpenAI Moderations body: `model` (optional at OpenAI, required here: tollgate
/// routes by it), `input` a non-empty string, or a non-empty array of strings or of
/// `text` and `image_url` parts. Returns the requested model.
pub(crate) fn validate_moderations_request(request: &Value, param_prefix: &str) -> Result<String, ApiError> {
    let p = |name: &str| format!("{param_prefix}{name}");
    let (obj, model) = object_and_model(request, param_prefix, "moderations")?;
    let part = |v: &Value| match v {
        Value::String(s) => !s.is_empty(),
        Value::Object(_) => matches!(v.get("type").and_then(Value::as_str), Some("text" | "image_url")),
        _ => false,
    };
    match obj.get("input") {
        None => Err(
            ApiError::bad_request(ApiErrorCode::MissingField, "`input` is required").with_param(p("input")),
        ),
        Some(Value::String(s)) if !s.is_empty() => Ok(model),
        Some(Value::Array(items)) if !items.is_empty() => match items.iter().position(|i| !part(i)) {
            Some(i) => Err(invalid(
                p(&format!("input[{i}]")),
                "each input must be a non-empty string, or a `text` or `image_url` part",
            )),
            None => Ok(model),
        },
        Some(_) => Err(invalid(p("input"), "`input` must be a non-empty string or array")),
    }
}

/// Fields of a Responses request that bring input tollgate cannot see (state kept at the
/// provider: an earlier response, a conversation, a stored prompt) or run it in the
/// background, so that its reservation could not cover it.
const RESPONSES_SERVER_STATE: [&str; 4] = ["previous_response_id", "conversation", "prompt", "background"];

/// Checks an OpenAI Responses body: `input` a non-empty string or a non-empty array of
/// items, `max_output_tokens` a positive integer. Refused as `unsupported_field`, since
/// their cost cannot be reserved: state kept at the provider (`previous_response_id`,
/// `conversation`, `prompt`, `background`), built-in tools (any tool but `function`), item
/// references and file inputs. Returns the requested model.
pub(crate) fn validate_responses_request(request: &Value, param_prefix: &str) -> Result<String, ApiError> {
    let p = |name: &str| format!("{param_prefix}{name}");
    let (obj, model) = object_and_model(request, param_prefix, "responses")?;
    match obj.get("input") {
        None => {
            return Err(
                ApiError::bad_request(ApiErrorCode::MissingField, "`input` is required")
                    .with_param(p("input")),
            );
        }
        Some(Value::String(s)) if !s.is_empty() => {}
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                let at = p(&format!("input[{i}]"));
                if !item.is_object() {
                    return Err(invalid(at, "each input item must be an object"));
                }
                if item.get("type").and_then(Value::as_str) == Some("item_reference") {
                    return Err(unsupported(
                        format!("{at}.type"),
                        "item references bring input kept at the provider, which tollgate cannot reserve for"
                            .to_owned(),
                    ));
                }
                let parts = array(item, "content");
                for (j, part) in parts.iter().enumerate() {
                    if part.get("type").and_then(Value::as_str) == Some("input_file") {
                        return Err(unsupported(
                            format!("{at}.content[{j}].type"),
                            "file inputs are not ones tollgate can reserve for".to_owned(),
                        ));
                    }
                }
            }
        }
        Some(_) => {
            return Err(invalid(
                p("input"),
                "`input` must be a non-empty string or array of items",
            ));
        }
    }
    positive_if_set(obj, "max_output_tokens", param_prefix)?;
    for field in RESPONSES_SERVER_STATE {
        if obj
            .get(field)
            .is_some_and(|v| !v.is_null() && *v != Value::Bool(false))
        {
            return Err(unsupported(
                p(field),
                format!(
                    "`{field}` brings input or work kept at the provider, which tollgate cannot reserve for"
                ),
            ));
        }
    }
    let tools = array(request, "tools");
    for (i, tool) in tools.iter().enumerate() {
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or_default();
        if kind != "function" {
            return Err(unsupported(
                p(&format!("tools[{i}].type")),
                format!(
                    "built-in tools ({kind:?}) are billed beyond tokens; tollgate cannot reserve for them"
                ),
            ));
        }
    }
    Ok(model)
}

/// Content block types of Anthropic Messages that tollgate can reserve for.
const MESSAGE_BLOCKS: [&str; 6] = [
    "text",
    "image",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
];

/// Checks an Anthropic Messages body as its API defines it: `max_tokens` a positive
/// integer, `messages` non-empty with roles `user` or `assistant` and content a string or
/// blocks, `system` a string or text blocks. Refused as `unsupported_field`, since their
/// cost cannot be reserved: document and other block types, server tools (a tool with a
/// `type` other than `custom`), `mcp_servers`, `container`. Returns the requested model.
pub(crate) fn validate_messages_request(request: &Value, param_prefix: &str) -> Result<String, ApiError> {
    let p = |name: &str| format!("{param_prefix}{name}");
    let (obj, model) = object_and_model(request, param_prefix, "messages")?;
    if obj.get("max_tokens").is_none() {
        return Err(
            ApiError::bad_request(ApiErrorCode::MissingField, "`max_tokens` is required")
                .with_param(p("max_tokens")),
        );
    }
    positive_if_set(obj, "max_tokens", param_prefix)?;
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(_) => return Err(invalid(p("messages"), "`messages` must be a non-empty array")),
        None => {
            return Err(
                ApiError::bad_request(ApiErrorCode::MissingField, "`messages` is required")
                    .with_param(p("messages")),
            );
        }
    };
    let blocks = |content: &Value, at: &str| -> Result<(), ApiError> {
        match content {
            Value::String(_) => Ok(()),
            Value::Array(blocks) => {
                for (j, b) in blocks.iter().enumerate() {
                    let kind = b.get("type").and_then(Value::as_str);
                    match kind {
                        Some(k) if MESSAGE_BLOCKS.contains(&k) => {}
                        Some(k) => {
                            return Err(unsupported(
                                format!("{at}[{j}].type"),
                                format!("content blocks of type {k:?} are not ones tollgate can reserve for"),
                            ));
                        }
                        None => {
                            return Err(invalid(
                                format!("{at}[{j}].type"),
                                "each content block needs a `type`",
                            ));
                        }
                    }
                }
                Ok(())
            }
            _ => Err(invalid(
                at.to_owned(),
                "`content` must be a string or an array of blocks",
            )),
        }
    };
    for (i, m) in messages.iter().enumerate() {
        let at = p(&format!("messages[{i}]"));
        if !matches!(m.get("role").and_then(Value::as_str), Some("user" | "assistant")) {
            return Err(invalid(
                format!("{at}.role"),
                "each message needs `role`: user or assistant",
            ));
        }
        blocks(m.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?;
    }
    if let Some(system) = obj.get("system") {
        blocks(system, &p("system"))?;
    }
    let tools = array(request, "tools");
    for (i, tool) in tools.iter().enumerate() {
        if let Some(kind) = tool
            .get("type")
            .and_then(Value::as_str)
            .filter(|k| *k != "custom")
        {
            return Err(unsupported(
                p(&format!("tools[{i}].type")),
                format!("server tools ({kind:?}) are billed beyond tokens; tollgate cannot reserve for them"),
            ));
        }
    }
    for field in ["mcp_servers", "container"] {
        if obj.get(field).is_some_and(|v| !v.is_null()) {
            return Err(unsupported(
                p(field),
                format!("`{field}` is not one tollgate can reserve for"),
            ));
        }
    }
    if obj
        .get("output_config")
        .is_some_and(|c| !c.is_null() && !c.is_object())
    {
        return Err(invalid(p("output_config"), "`output_config` must be an object"));
    }
    if let Some(format) = tollgate::estimate::messages_output_format(request)
        && (format.get("type").and_then(Value::as_str) != Some("json_schema")
            || !format.get("schema").is_some_and(Value::is_object))
    {
        let at = if request
            .pointer("/output_config/format")
            .is_some_and(|f| !f.is_null())
        {
            "output_config.format"
        } else {
            "output_format"
        };
        return Err(invalid(
            p(at),
            "an output format is `{\"type\": \"json_schema\", \"schema\": {…}}`",
        ));
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn refused(request: Value) -> (ApiErrorCode, Option<String>) {
        let e = validate_embeddings_request(&request, "body.").unwrap_err();
        (e.code, e.param)
    }

    #[test]
    fn moderations_requests_are_checked_field_by_field() {
        for ok in [
            json!({"model": "m", "input": "x"}),
            json!({"model": "m", "input": ["a", "b"]}),
            json!({"model": "m", "input": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]}),
        ] {
            assert_eq!(validate_moderations_request(&ok, "").unwrap(), "m", "{ok}");
        }
        let refused = |r: Value| {
            let e = validate_moderations_request(&r, "").unwrap_err();
            (e.code, e.param.unwrap_or_default())
        };
        assert_eq!(
            refused(json!({"input": "x"})),
            (ApiErrorCode::MissingField, "model".to_owned())
        );
        assert_eq!(
            refused(json!({"model": "m"})),
            (ApiErrorCode::MissingField, "input".to_owned())
        );
        assert_eq!(
            refused(json!({"model": "m", "input": []})),
            (ApiErrorCode::InvalidRequest, "input".to_owned())
        );
        assert_eq!(
            refused(json!({"model": "m", "input": ["a", 3]})),
            (ApiErrorCode::InvalidRequest, "input[1]".to_owned())
        );
    }

    #[test]
    fn responses_requests_are_checked_field_by_field() {
        for ok in [
            json!({"model": "m", "input": "hi"}),
            json!({"model": "m", "instructions": "be brief", "max_output_tokens": 9, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                    {"type": "input_image", "image_url": "https://example.com/a.png"}]},
                {"type": "function_call_output", "call_id": "c", "output": "42"}],
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
        ] {
            assert_eq!(validate_responses_request(&ok, "").unwrap(), "m", "{ok}");
        }
        let refused = |r: Value| {
            let e = validate_responses_request(&r, "").unwrap_err();
            (e.code, e.param.unwrap_or_default())
        };
        use ApiErrorCode::{InvalidRequest, MissingField, UnsupportedField};
        assert_eq!(refused(json!({"model": "m"})), (MissingField, "input".to_owned()));
        assert_eq!(
            refused(json!({"model": "m", "input": ""})),
            (InvalidRequest, "input".to_owned())
        );
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "max_output_tokens": 0})),
            (InvalidRequest, "max_output_tokens".to_owned())
        );
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "previous_response_id": "resp_1"})),
            (UnsupportedField, "previous_response_id".to_owned())
        );
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]})),
            (UnsupportedField, "tools[0].type".to_owned())
        );
        assert_eq!(
            refused(json!({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]})),
            (UnsupportedField, "input[0].type".to_owned())
        );
        assert_eq!(
            validate_responses_request(&json!({"model": "m", "input": "x", "background": false}), "")
                .unwrap(),
            "m"
        );
    }

    #[test]
    fn messages_requests_are_checked_field_by_field() {
        let ok = json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]});
        assert_eq!(validate_messages_request(&ok, "").unwrap(), "m");
        let refused = |change: Value| {
            let mut r = ok.clone();
            for (k, v) in change.as_object().unwrap() {
                r[k] = v.clone();
            }
            let e = validate_messages_request(&r, "").unwrap_err();
            (e.code, e.param.unwrap_or_default())
        };
        use ApiErrorCode::{InvalidRequest, UnsupportedField};
        assert_eq!(
            refused(json!({"max_tokens": 0})),
            (InvalidRequest, "max_tokens".to_owned())
        );
        assert_eq!(
            refused(json!({"messages": []})),
            (InvalidRequest, "messages".to_owned())
        );
        assert_eq!(
            refused(json!({"messages": [{"role": "system", "content": "x"}]})),
            (InvalidRequest, "messages[0].role".to_owned())
        );
        assert_eq!(
            refused(json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]})),
            (UnsupportedField, "messages[0].content[0].type".to_owned())
        );
        assert_eq!(
            refused(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]})),
            (UnsupportedField, "tools[0].type".to_owned())
        );
        assert_eq!(
            refused(json!({"mcp_servers": []})),
            (UnsupportedField, "mcp_servers".to_owned())
        );
        for (change, param) in [
            (json!({"output_config": "json"}), "output_config"),
            (
                json!({"output_config": {"format": {"type": "json_object"}}}),
                "output_config.format",
            ),
            (
                json!({"output_format": {"type": "json_schema", "schema": "x"}}),
                "output_format",
            ),
        ] {
            assert_eq!(refused(change), (InvalidRequest, param.to_owned()));
        }
        let schema = json!({"type": "json_schema", "schema": {"type": "object"}});
        let mut structured = ok.clone();
        structured["output_config"] = json!({"format": schema});
        assert_eq!(validate_messages_request(&structured, "").unwrap(), "m");
        let mut no_cap = ok.clone();
        no_cap.as_object_mut().unwrap().remove("max_tokens");
        let e = validate_messages_request(&no_cap, "").unwrap_err();
        assert_eq!(e.code, ApiErrorCode::MissingField);
    }

    #[test]
    fn embeddings_requests_are_checked_field_by_field() {
        for ok in [
            json!({"model": "m", "input": "hello"}),
            json!({"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 8}),
            json!({"model": "m", "input": [1, 2, 3]}),
            json!({"model": "m", "input": [[1, 2], [3]]}),
        ] {
            assert_eq!(validate_embeddings_request(&ok, "").unwrap(), "m", "{ok}");
        }
        let at = |p: &str| Some(format!("body.{p}"));
        assert_eq!(
            refused(json!({"input": "x"})),
            (ApiErrorCode::MissingField, at("model"))
        );
        assert_eq!(
            refused(json!({"model": "m"})),
            (ApiErrorCode::MissingField, at("input"))
        );
        let invalid = ApiErrorCode::InvalidRequest;
        assert_eq!(
            refused(json!({"model": "m", "input": ""})),
            (invalid, at("input"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": []})),
            (invalid, at("input"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": ["a", ""]})),
            (invalid, at("input[1]"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": ["a", 3]})),
            (invalid, at("input[1]"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": [[1], []]})),
            (invalid, at("input[1]"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": [-1]})),
            (invalid, at("input[0]"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": ["a", [1]]})),
            (invalid, at("input"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": {"a": 1}})),
            (invalid, at("input"))
        );
        let many: Vec<&str> = vec!["x"; MAX_EMBEDDING_INPUTS + 1];
        assert_eq!(
            refused(json!({"model": "m", "input": many})),
            (invalid, at("input"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "encoding_format": "int8"})),
            (invalid, at("encoding_format"))
        );
        assert_eq!(
            refused(json!({"model": "m", "input": "x", "dimensions": 0})),
            (invalid, at("dimensions"))
        );
    }
}
