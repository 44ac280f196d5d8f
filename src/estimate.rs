//! Demand estimates made at submit time: input tokens from the messages, output tokens
//! from `max_tokens`. The gate reserves these; reconciliation replaces them with the
//! provider's reported usage.
//!
//! Input tokens use the character rule providers use for rate-limit accounting (about four
//! characters a token, plus a per-message overhead): cheap, and on the safe side for
//! English text. Output tokens default to [`DEFAULT_OUTPUT_TOKENS`] when the request sets
//! no cap.

use serde_json::Value;

/// Output reserved for a request that sets neither `max_tokens` nor `max_completion_tokens`.
pub const DEFAULT_OUTPUT_TOKENS: i32 = 1024;

/// Tokens a chat request's prompt will count as: 3 for reply priming, and per message 4 plus
/// one per started group of four characters of its text (string or text parts).
pub fn input_tokens(request: &Value) -> i32 {
    let Some(messages) = request.get("messages").and_then(Value::as_array) else {
        return 0;
    };
    let per_message: i64 = messages
        .iter()
        .map(|m| 4 + text_chars(m.get("content")).div_ceil(4) as i64)
        .sum();
    clamp_i32(3 + per_message)
}

/// The output cap the request asks for, or the default.
pub fn output_tokens(request: &Value) -> i32 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| request.get(*k).and_then(Value::as_i64))
        .map(clamp_i32)
        .unwrap_or(DEFAULT_OUTPUT_TOKENS)
}

fn text_chars(content: Option<&Value>) -> u64 {
    match content {
        Some(Value::String(s)) => s.chars().count() as u64,
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| t.chars().count() as u64)
            .sum(),
        _ => 0,
    }
}

fn clamp_i32(v: i64) -> i32 {
    v.clamp(0, i32::MAX as i64) as i32
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn counts_messages_and_parts() {
        let r = json!({"messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "abcde"}]}
        ]});
        // 3 + (4 + 1) + (4 + 2)
        assert_eq!(input_tokens(&r), 14);
        assert_eq!(input_tokens(&json!({})), 0);
    }

    #[test]
    fn output_cap() {
        assert_eq!(output_tokens(&json!({"max_tokens": 50})), 50);
        assert_eq!(
            output_tokens(&json!({"max_completion_tokens": 70, "max_tokens": 50})),
            70
        );
        assert_eq!(output_tokens(&json!({})), DEFAULT_OUTPUT_TOKENS);
    }
}
