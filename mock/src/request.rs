//! Request bodies of both APIs as far as the mock needs them, the token-count rule, and
//! the canned completion text.
//!
//! Token count (both kinds; also what `usage` reports as input/prompt tokens):
//! `input_tokens = 3 + Σ over messages (4 + ceil(chars(text)/4))`, where `chars` counts
//! Unicode scalar values of the message's text: `content` as a string, or the sum of the
//! `text` fields of its parts when it is an array (`[{"type":"text","text":…}, …]`; other
//! parts count 0). For Anthropic, a top-level `system` (string or text blocks) counts as
//! one more message. Messages are summed while parsing, so no message is kept in memory.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The Chat Completions fields the mock reads; others are ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Option<MessagesTokens>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Choices to generate, each up to the output cap; the prompt is counted once.
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    /// `flex` asks for the flex tier.
    #[serde(default)]
    pub service_tier: Option<String>,
}

/// An answer the mock gives instead of canned words.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Fixed {
    /// A call of the function `name` with `arguments` (JSON text).
    Call { name: String, arguments: String },
    /// The JSON text a `response_format` asked for, as the message's content.
    Json(String),
}

impl Fixed {
    /// The answer's text: a call's arguments, or the JSON.
    pub(crate) fn text(&self) -> &str {
        match self {
            Fixed::Call { arguments, .. } => arguments,
            Fixed::Json(text) => text,
        }
    }
}

/// An object with `"mock"` for each property `schema` (a JSON Schema) declares: the
/// arguments of every function the mock calls and the JSON it answers a schema with.
pub(crate) fn mock_object(schema: Option<&serde_json::Value>) -> serde_json::Value {
    let properties = schema
        .and_then(|s| s.get("properties"))
        .and_then(|p| p.as_object());
    serde_json::Value::Object(
        properties
            .into_iter()
            .flatten()
            .map(|(k, _)| (k.clone(), serde_json::Value::from("mock")))
            .collect(),
    )
}

/// Most choices a Chat Completions request may ask for.
pub(crate) const MAX_CHOICES: u64 = 128;

impl ChatRequest {
    /// The function the mock calls instead of answering in text, as `(name, arguments)`:
    /// when the request has function tools, `tool_choice` is not `"none"` and no `tool`
    /// message answers a call yet — the chosen function (or the first) with `"mock"` for
    /// each property of its parameters.
    fn tool_call(&self) -> Option<(String, String)> {
        let messages = self.messages.as_ref()?;
        if messages.tool_results > 0 || self.tool_choice.as_ref().and_then(|c| c.as_str()) == Some("none") {
            return None;
        }
        let chosen = self
            .tool_choice
            .as_ref()
            .and_then(|c| c.pointer("/function/name"))
            .and_then(|n| n.as_str());
        let function = self
            .tools
            .iter()
            .flatten()
            .filter_map(|t| t.get("function"))
            .find(|f| chosen.is_none_or(|name| f.get("name").and_then(|n| n.as_str()) == Some(name)))?;
        let arguments = mock_object(function.get("parameters"));
        let name = function.get("name").and_then(|n| n.as_str()).unwrap_or_default();
        Some((name.to_owned(), arguments.to_string()))
    }

    /// What the mock answers instead of canned words: the [`Self::tool_call`], else, for a
    /// `response_format` of `json_schema`, an object of its schema's properties (`"mock"`
    /// each), or for `json_object` an object of one.
    pub(crate) fn fixed_answer(&self) -> Option<Fixed> {
        if let Some((name, arguments)) = self.tool_call() {
            return Some(Fixed::Call { name, arguments });
        }
        let format = self.response_format.as_ref()?;
        match format.get("type").and_then(|t| t.as_str()) {
            Some("json_schema") => Some(Fixed::Json(
                mock_object(format.pointer("/json_schema/schema")).to_string(),
            )),
            Some("json_object") => Some(Fixed::Json(serde_json::json!({"answer": "mock"}).to_string())),
            _ => None,
        }
    }

    /// The output cap per choice (`max_completion_tokens` wins over `max_tokens`).
    pub(crate) fn max_out(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// Choices asked for (`n`, default 1); `Err` with OpenAI's message when out of range.
    pub(crate) fn choices(&self) -> Result<u64, String> {
        match self.n.unwrap_or(1) {
            0 => Err(
                "Invalid 'n': integer below minimum value. Expected a value >= 1, but got 0 instead."
                    .to_owned(),
            ),
            n if n > MAX_CHOICES => Err(format!(
                "Invalid 'n': integer above maximum value. Expected a value <= {MAX_CHOICES}, but got {n} instead."
            )),
            n => Ok(n),
        }
    }
}

/// `stream_options` of a Chat Completions request.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    /// Adds a last chunk with `"choices": []` and the `usage` before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The Messages API fields the mock reads; others are ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Option<MessagesTokens>,
    #[serde(default)]
    pub system: Option<TextChars>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
}

/// Per-message overhead in the token rule.
const PER_MESSAGE: u64 = 4;
/// Reply priming in the token rule.
const PRIMING: u64 = 3;

/// Tokens of one message of `chars` characters.
pub(crate) fn message_tokens(chars: u64) -> u64 {
    PER_MESSAGE + chars.div_ceil(4)
}

/// `input_tokens` of a request: priming plus its messages (and Anthropic's `system`).
pub(crate) fn input_tokens(messages: &MessagesTokens, system: Option<&TextChars>) -> u64 {
    PRIMING + messages.tokens + system.map_or(0, |s| message_tokens(s.0))
}

/// A `messages` array, reduced while parsing to its count, summed message tokens, and
/// the checks of its tool turns as OpenAI makes them: an assistant turn's `tool_calls`
/// each answered by a `tool` message right after it, and no `tool` message without a
/// call it answers (the first violation, in OpenAI's words).
#[derive(Debug, Default, Clone)]
pub(crate) struct MessagesTokens {
    pub count: u64,
    pub tokens: u64,
    /// `tool` messages.
    pub tool_results: u64,
    pub tool_turn_error: Option<String>,
}

impl MessagesTokens {
    /// Ends the run of `tool` messages after an assistant's calls: unanswered ones are an
    /// error.
    fn close_calls(&mut self, open: &mut Vec<String>) {
        if !open.is_empty() && self.tool_turn_error.is_none() {
            self.tool_turn_error = Some(format!(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
                open.join(", ")
            ));
        }
        open.clear();
    }
}

impl<'de> Deserialize<'de> for MessagesTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessagesTokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = MessagesTokens::default();
                // Calls of the last assistant turn not answered yet.
                let mut open: Vec<String> = Vec::new();
                while let Some(m) = seq.next_element::<Message>()? {
                    out.count += 1;
                    out.tokens += message_tokens(m.content.0);
                    if m.role.as_deref() == Some("tool") {
                        out.tool_results += 1;
                        let answered = m
                            .tool_call_id
                            .as_ref()
                            .and_then(|id| open.iter().position(|o| o == id));
                        match answered {
                            Some(i) => {
                                open.remove(i);
                            }
                            None if out.tool_turn_error.is_none() => {
                                out.tool_turn_error = Some(
                                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.".to_owned(),
                                );
                            }
                            None => {}
                        }
                        continue;
                    }
                    out.close_calls(&mut open);
                    open = m.tool_calls.into_iter().flatten().map(|c| c.id).collect();
                }
                out.close_calls(&mut open);
                Ok(out)
            }
        }
        d.deserialize_seq(V)
    }
}

#[derive(Debug, Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: TextChars,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<CallId>>,
}

/// A tool call of an assistant turn, as far as its answer must name it.
#[derive(Debug, Deserialize)]
struct CallId {
    id: String,
}

/// Character count of a text content: a string, null, or an array of parts whose
/// `text` fields are summed.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct TextChars(pub u64);

fn count_chars(s: &str) -> u64 {
    s.chars().count() as u64
}

impl<'de> Deserialize<'de> for TextChars {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextChars;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, null or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(TextChars(count_chars(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(TextChars(0))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(TextChars(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut n = 0;
                while let Some(p) = seq.next_element::<PartChars>()? {
                    n += p.0;
                }
                Ok(TextChars(n))
            }
        }
        d.deserialize_any(V)
    }
}

/// One content part: the characters of its `text` string field, other fields ignored.
struct PartChars(u64);

impl<'de> Deserialize<'de> for PartChars {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PartChars;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a content part object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut n = 0;
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Text => n += map.next_value::<StrChars>()?.0,
                        Key::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(PartChars(n))
            }
        }
        d.deserialize_map(V)
    }
}

enum Key {
    Text,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(if v == "text" { Key::Text } else { Key::Other })
            }
        }
        d.deserialize_identifier(V)
    }
}

/// Characters of a string value (null counts 0).
struct StrChars(u64);

impl<'de> Deserialize<'de> for StrChars {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = StrChars;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(StrChars(count_chars(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(StrChars(0))
            }
        }
        d.deserialize_any(V)
    }
}

/// The completion text, built once: `words(n)` is a prefix of `n` words (one word ≈ one
/// token), so responses borrow it instead of generating text per request.
#[derive(Debug)]
pub(crate) struct CannedText {
    text: String,
    /// `ends[n]` = byte length of the first `n` words.
    ends: Vec<usize>,
}

const WORDS: [&str; 16] = [
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "consectetur",
    "adipiscing",
    "elit",
    "sed",
    "do",
    "eiusmod",
    "tempor",
    "incididunt",
    "ut",
    "labore",
    "et",
];

/// More words than this are not pre-built: a longer completion returns this many words
/// while `usage` still reports the full count.
const MAX_CANNED_WORDS: u64 = 1 << 16;

impl CannedText {
    pub(crate) fn new(max_words: u64) -> Self {
        let max_words = max_words.min(MAX_CANNED_WORDS);
        let mut text = String::new();
        let mut ends = vec![0];
        for i in 0..max_words {
            if i > 0 {
                text.push(' ');
            }
            text.push_str(WORDS[(i % WORDS.len() as u64) as usize]);
            ends.push(text.len());
        }
        Self { text, ends }
    }

    /// Token `i` (0-based) of a streamed completion: the word with the space before it,
    /// so the streamed tokens concatenate to exactly [`CannedText::words`]. Not capped:
    /// past the pre-built words it keeps cycling.
    pub(crate) fn token(i: u64) -> &'static str {
        const SPACED: [&str; 16] = [
            " lorem",
            " ipsum",
            " dolor",
            " sit",
            " amet",
            " consectetur",
            " adipiscing",
            " elit",
            " sed",
            " do",
            " eiusmod",
            " tempor",
            " incididunt",
            " ut",
            " labore",
            " et",
        ];
        let word = SPACED[(i % SPACED.len() as u64) as usize];
        if i == 0 { &word[1..] } else { word }
    }

    /// The first `n` words (capped at what was pre-built).
    pub(crate) fn words(&self, n: u64) -> &str {
        let i = usize::try_from(n).unwrap_or(usize::MAX).min(self.ends.len() - 1);
        &self.text[..self.ends[i]]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_rule_for_strings_and_parts() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"model":"m","messages":[
                {"role":"system","content":"12345678"},
                {"role":"user","content":[{"type":"text","text":"héllo"},{"type":"image_url","image_url":{"url":"x"}}]},
                {"role":"assistant","content":null}
            ],"max_tokens":5}"#,
        )
        .unwrap();
        let m = r.messages.unwrap();
        assert_eq!(m.count, 3);
        // 3 + (4+2) + (4+ceil(5/4)=2) + (4+0)
        assert_eq!(input_tokens(&m, None), 3 + 6 + 6 + 4);
    }

    #[test]
    fn anthropic_system_counts_as_a_message() {
        let r: MessagesRequest = serde_json::from_str(
            r#"{"model":"c","max_tokens":9,"system":[{"type":"text","text":"abcd"}],
                "messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        let m = r.messages.unwrap();
        assert_eq!(input_tokens(&m, r.system.as_ref()), 3 + 5 + 5);
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(serde_json::from_str::<ChatRequest>(r#"{"messages":{}}"#).is_err());
        assert!(serde_json::from_str::<ChatRequest>(r#"{"messages":[{"content":5}]}"#).is_err());
        assert!(serde_json::from_str::<ChatRequest>(r#"{"max_tokens":"x"}"#).is_err());
    }

    #[test]
    fn canned_text_prefixes() {
        let t = CannedText::new(3);
        assert_eq!(t.words(0), "");
        assert_eq!(t.words(2), "lorem ipsum");
        assert_eq!(t.words(9), "lorem ipsum dolor");
        let streamed: String = (0..3).map(CannedText::token).collect();
        assert_eq!(streamed, t.words(3));
        let t = CannedText::new(40);
        let streamed: String = (0..40).map(CannedText::token).collect();
        assert_eq!(streamed, t.words(40));
    }
}
