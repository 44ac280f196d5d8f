//! Demand estimates made at submit time: input tokens from the messages, output tokens
//! from `max_tokens`. The gate reserves these; reconciliation replaces them with the
//! provider's reported usage.
//!
//! Input tokens: the larger of two counts. The character rule (about four characters a
//! token, plus a per-message overhead) is what OpenAI-style providers charge against TPM
//! at request time, so a reservation must never be below it. Where the model's encoding
//! is known (OpenAI's o200k and cl100k families) the exact BPE count is taken too, which
//! is larger for text the character rule underestimates (code, numbers, CJK). Output
//! tokens default to [`DEFAULT_OUTPUT_TOKENS`] when the request sets no cap.

use bpe_openai::Tokenizer;
use serde_json::Value;

/// Output reserved for a request that sets neither `max_tokens` nor `max_completion_tokens`.
pub const DEFAULT_OUTPUT_TOKENS: i32 = 1024;

/// Tokens to reserve for a chat request's prompt sent to `model`: the character rule, or
/// the model's BPE count when that is larger.
pub fn input_tokens(request: &Value, model: Option<&str>) -> i32 {
    let by_chars = char_rule(request);
    match model.and_then(tokenizer_for) {
        Some(tokenizer) => by_chars.max(bpe_count(request, tokenizer)),
        None => by_chars,
    }
}

/// The character rule: 3 for reply priming, and per message 4 plus one per started group
/// of four characters of its text (string or text parts).
pub fn char_rule(request: &Value) -> i32 {
    let per_message: i64 = messages(request)
        .map(|m| 4 + text_chars(m.get("content")).div_ceil(4) as i64)
        .sum();
    if per_message == 0 {
        return 0;
    }
    clamp_i32(3 + per_message)
}

/// OpenAI's counting of chat prompts: 3 for reply priming; per message 3, its role and its
/// content in the model's encoding.
fn bpe_count(request: &Value, tokenizer: &Tokenizer) -> i32 {
    let per_message: usize = messages(request)
        .map(|m| {
            let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
            3 + tokenizer.count(role) + tokenizer.count(text(m.get("content")).as_str())
        })
        .sum();
    clamp_i32(3 + per_message as i64)
}

/// Builds the encoders (a fraction of a second each) so no request pays for it.
pub fn warm_up() {
    bpe_openai::o200k_base().count("warm up");
    bpe_openai::cl100k_base().count("warm up");
}

/// The encoding of an OpenAI model family, where it is public (tiktoken's model map).
pub fn tokenizer_for(model: &str) -> Option<&'static Tokenizer> {
    let m = model.rsplit('/').next().unwrap_or(model);
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

fn messages(request: &Value) -> impl Iterator<Item = &Value> {
    request
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

fn text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
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
        assert_eq!(input_tokens(&r, None), 14);
        assert_eq!(input_tokens(&r, Some("claude-3-5-haiku-latest")), 14);
        assert_eq!(input_tokens(&json!({}), None), 0);
    }

    #[test]
    fn bpe_counts_win_where_the_character_rule_underestimates() {
        let english =
            json!({"messages": [{"role": "user", "content": "Summarise this ticket in one line."}]});
        assert_eq!(input_tokens(&english, Some("gpt-4o-mini")), char_rule(&english));
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
