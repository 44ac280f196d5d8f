//! OpenAI Chat Completions (and OpenAI-compatible servers: Groq, Mistral, Together,
//! DeepSeek, vLLM, Ollama): `POST {base_url}/chat/completions`, bearer auth.

use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;
use tollgate::model::Usage;

use super::{Success, int};

pub(super) fn build(
    http: &reqwest::Client,
    base_url: &str,
    key: &SecretString,
    model: &str,
    request: &Value,
) -> reqwest::RequestBuilder {
    http.post(format!("{base_url}/chat/completions"))
        .bearer_auth(key.expose_secret())
        .json(&body(model, request))
}

/// The client's request with the target's model, streaming fields removed.
pub(super) fn body(model: &str, request: &Value) -> Value {
    let mut body = request.clone();
    if let Some(obj) = body.as_object_mut() {
        obj.insert("model".to_owned(), Value::String(model.to_owned()));
        obj.remove("stream");
        obj.remove("stream_options");
    }
    body
}

/// The body is already in the format clients expect; only usage is read out.
pub(super) fn parse_success(body: &[u8]) -> Result<Success, String> {
    let body: Value = serde_json::from_slice(body)
        .map_err(|e| format!("provider answered 2xx with a body that is not JSON: {e}"))?;
    if body.get("choices").is_none() {
        return Err("provider answered 2xx without `choices`".to_owned());
    }
    let usage = body.get("usage").cloned().unwrap_or(Value::Null);
    let usage = Usage {
        input_tokens: int(&usage, &["prompt_tokens"]),
        output_tokens: int(&usage, &["completion_tokens"]),
        cached_tokens: int(&usage, &["prompt_tokens_details", "cached_tokens"]),
    };
    Ok(Success { body, usage })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_usage_and_rejects_non_chat_bodies() {
        let ok = br#"{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        let s = parse_success(ok).unwrap();
        assert_eq!(
            s.usage,
            Usage {
                input_tokens: 10,
                output_tokens: 5,
                cached_tokens: 4
            }
        );
        assert!(parse_success(b"not json").is_err());
        assert!(parse_success(b"{}").is_err());
    }
}
