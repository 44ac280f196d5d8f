//! Anthropic Messages: `POST {base_url}/v1/messages` with `x-api-key` and
//! `anthropic-version`. Requests arrive in OpenAI chat format and are translated; the
//! response is translated back, so clients see one format whatever served them.

use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value, json};
use tollgate::model::Usage;

use super::{Success, int};

/// `max_tokens` is mandatory for Anthropic; used when the OpenAI request sets none.
pub const DEFAULT_MAX_TOKENS: i64 = 4096;

pub(super) fn build(
    http: &reqwest::Client,
    base_url: &str,
    key: &SecretString,
    version: &str,
    model: &str,
    request: &Value,
) -> reqwest::RequestBuilder {
    http.post(format!("{base_url}/v1/messages"))
        .header("x-api-key", key.expose_secret())
        .header("anthropic-version", version)
        .json(&translate_request(model, request))
}

/// OpenAI chat request → Anthropic Messages request.
pub fn translate_request(model: &str, request: &Value) -> Value {
    let mut system = Vec::new();
    let mut messages = Vec::new();
    for m in request
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let text = content_text(m.get("content"));
        match role {
            "system" | "developer" => system.push(text),
            "assistant" => messages.push(json!({"role": "assistant", "content": text})),
            _ => messages.push(json!({"role": "user", "content": text})),
        }
    }
    let max_tokens = max_output(request).unwrap_or(DEFAULT_MAX_TOKENS);
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
    Value::Object(out)
}

/// The output cap of an OpenAI request (`max_completion_tokens`, else `max_tokens`).
pub(super) fn max_output(request: &Value) -> Option<i64> {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| request.get(*k).and_then(Value::as_i64))
}

/// OpenAI `stop` (a string or a list) as a list of stop sequences.
pub(super) fn stop_sequences(request: &Value) -> Option<Value> {
    match request.get("stop") {
        Some(Value::String(s)) => Some(json!([s])),
        Some(Value::Array(a)) => Some(Value::Array(a.clone())),
        _ => None,
    }
}

pub(super) fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// Anthropic Messages response → OpenAI chat completion.
pub(super) fn parse_success(body: &[u8]) -> Result<Success, String> {
    let msg: Value = serde_json::from_slice(body)
        .map_err(|e| format!("provider answered 2xx with a body that is not JSON: {e}"))?;
    let Some(content) = msg.get("content").and_then(Value::as_array) else {
        return Err("provider answered 2xx without `content`".to_owned());
    };
    let text: String = content
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    let finish_reason = match msg.get("stop_reason").and_then(Value::as_str) {
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    };
    let reported = msg.get("usage").is_some_and(Value::is_object);
    let u = msg.get("usage").cloned().unwrap_or(Value::Null);
    let cache_read = int(&u, &["cache_read_input_tokens"]);
    let input = int(&u, &["input_tokens"]) + int(&u, &["cache_creation_input_tokens"]) + cache_read;
    let output = int(&u, &["output_tokens"]);
    let mut body = json!({
        "id": msg.get("id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion",
        "created": chrono::Utc::now().timestamp(),
        "model": msg.get("model").cloned().unwrap_or(Value::Null),
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }],
        "usage": {
            "prompt_tokens": input,
            "completion_tokens": output,
            "total_tokens": input + output,
            "prompt_tokens_details": {"cached_tokens": cache_read},
        },
    });
    if !reported {
        // No usage invented: the caller sees it is missing and estimates it.
        super::drop_usage(&mut body);
    }
    Ok(Success {
        body,
        usage: Usage {
            input_tokens: input,
            output_tokens: output,
            cached_tokens: cache_read,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let no_cap = translate_request("c", &json!({"messages": []}));
        assert_eq!(no_cap["max_tokens"], DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn translates_the_response() {
        let body = br#"{"id":"msg_1","type":"message","role":"assistant","model":"c","content":[{"type":"text","text":"hello"}],"stop_reason":"max_tokens","stop_sequence":null,"usage":{"input_tokens":10,"output_tokens":3,"cache_read_input_tokens":5}}"#;
        let s = parse_success(body).unwrap();
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
        // No usage is not invented as zeros: the caller sees it missing and estimates it.
        let bare = br#"{"id":"msg_2","type":"message","content":[{"type":"text","text":"hi"}]}"#;
        assert!(parse_success(bare).unwrap().body.get("usage").is_none());
        // A truncated body is an error, not a panic.
        assert!(parse_success(&body[..body.len() / 2]).is_err());
    }
}
