//! Anthropic Messages requests to targets that speak OpenAI chat (every kind but
//! Anthropic): the request translated to chat ([`chat_request`]), sent through the target's
//! chat adapter like any chat job, and its answer translated back — a chat completion to
//! a message ([`message`]), a chat stream to Anthropic's events ([`MessageEvents`]) — so an
//! Anthropic SDK pointed at tollgate reaches an OpenAI model unchanged.
//!
//! Translated: `system`; text, image (base64 and URL) and tool blocks; `tool_result`
//! blocks as `tool` messages right after the assistant turn that called them; `tools`
//! (`input_schema` as `parameters`), `tool_choice` (`auto`, `any` as `required`, `tool`,
//! `none`, `disable_parallel_tool_use` as `parallel_tool_calls: false`); `max_tokens`,
//! `stop_sequences` (up to 4), `temperature`, `top_p`, `metadata.user_id` as `user`, a
//! JSON schema output format (`output_config.format`, or the beta's `output_format`) as
//! a strict `json_schema` `response_format` — its JSON comes back as the text block, as
//! Anthropic answers it. What chat cannot say is refused before the job is queued
//! ([`unexpressed`]): any other field set (thinking, `top_k`, `context_management`, other
//! output options, …), `cache_control`, images inside tool results, `is_error` tool
//! results, more than four stop sequences.

use serde_json::{Map, Value, json};

use super::Unexpressed;
use super::as_chat::{ChunkEvents, copy_fields, insert_tools, untranslated_field};

/// Most stop sequences OpenAI chat takes.
const MAX_STOPS: usize = 4;

/// Request fields the translation carries (`service_tier` only chooses among Anthropic's
/// own capacity, which a chat target does not have).
const TRANSLATED_FIELDS: [&str; 14] = [
    "model",
    "messages",
    "max_tokens",
    "system",
    "metadata",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "output_config",
    "output_format",
    "service_tier",
];

/// What of `request` (an Anthropic Messages request, validated) chat cannot express.
pub fn unexpressed(request: &Value) -> Option<Unexpressed> {
    let say = |param: String, what: &str| {
        Unexpressed::at(
            param,
            format!(
                "{what} cannot be expressed to an OpenAI-chat target (no Anthropic target serves this model)"
            ),
        )
    };
    if let Some(field) = untranslated_field(request, &TRANSLATED_FIELDS, &[]) {
        return say(field.to_owned(), &format!("`{field}`"));
    }
    if let Some(option) = request
        .get("output_config")
        .and_then(Value::as_object)
        .and_then(|o| o.iter().find(|(k, v)| *k != "format" && !v.is_null()))
        .map(|(k, _)| k)
    {
        return say(
            format!("output_config.{option}"),
            &format!("`output_config.{option}`"),
        );
    }
    if super::array(request, "stop_sequences").len() > MAX_STOPS {
        return say("stop_sequences".to_owned(), "more than four stop sequences");
    }
    let blocks = |content: &Value, at: &str| -> Option<Unexpressed> {
        for (j, b) in content.as_array().into_iter().flatten().enumerate() {
            let at = format!("{at}[{j}]");
            if b.get("cache_control").is_some_and(|v| !v.is_null()) {
                return say(format!("{at}.cache_control"), "`cache_control`");
            }
            match b.get("type").and_then(Value::as_str) {
                Some("thinking" | "redacted_thinking") => {
                    return say(format!("{at}.type"), "a thinking block");
                }
                Some("image") if image_url(b).is_none() => {
                    return say(
                        format!("{at}.source"),
                        "an image that is neither base64 nor a URL",
                    );
                }
                Some("tool_result") => {
                    if b.get("is_error") == Some(&Value::Bool(true)) {
                        return say(format!("{at}.is_error"), "a tool result marked `is_error`");
                    }
                    let parts = b.get("content").and_then(Value::as_array).into_iter().flatten();
                    for (k, part) in parts.enumerate() {
                        if part.get("type").and_then(Value::as_str) != Some("text") {
                            return say(format!("{at}.content[{k}]"), "a tool result that is not text");
                        }
                    }
                }
                _ => {}
            }
        }
        None
    };
    if let Some(refused) = blocks(request.get("system").unwrap_or(&Value::Null), "system") {
        return Some(refused);
    }
    for (i, m) in super::array(request, "messages").iter().enumerate() {
        if let Some(refused) = blocks(
            m.get("content").unwrap_or(&Value::Null),
            &format!("messages[{i}].content"),
        ) {
            return Some(refused);
        }
    }
    for (i, tool) in super::array(request, "tools").iter().enumerate() {
        if tool.get("cache_control").is_some_and(|v| !v.is_null()) {
            return say(format!("tools[{i}].cache_control"), "`cache_control`");
        }
    }
    None
}

/// An image block's URL for chat: its URL, or its base64 data as a `data:` URL.
fn image_url(block: &Value) -> Option<String> {
    let source = block.get("source")?;
    match source.get("type").and_then(Value::as_str)? {
        "url" => source.get("url").and_then(Value::as_str).map(str::to_owned),
        "base64" => {
            let media = source.get("media_type").and_then(Value::as_str)?;
            let data = source.get("data").and_then(Value::as_str)?;
            Some(format!("data:{media};base64,{data}"))
        }
        _ => None,
    }
}

/// The text of a string or of an array's text blocks, joined by newlines.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The chat request that asks what `request` (Anthropic Messages) asks.
pub fn chat_request(request: &Value) -> Value {
    let mut messages = Vec::new();
    if let Some(system) = request.get("system") {
        messages.push(json!({"role": "system", "content": text_of(system)}));
    }
    for m in super::array(request, "messages") {
        let content = m.get("content").unwrap_or(&Value::Null);
        if m.get("role").and_then(Value::as_str) == Some("assistant") {
            messages.push(assistant_turn(content));
        } else {
            user_turn(content, &mut messages);
        }
    }
    let mut chat = Map::new();
    chat.insert(
        "model".into(),
        request.get("model").cloned().unwrap_or(Value::Null),
    );
    chat.insert("messages".into(), Value::Array(messages));
    copy_fields(
        &mut chat,
        request,
        &[
            ("max_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("stop_sequences", "stop"),
            ("stream", "stream"),
        ],
    );
    if let Some(user) = request.pointer("/metadata/user_id").filter(|v| v.is_string()) {
        chat.insert("user".into(), user.clone());
    }
    insert_tools(&mut chat, request, "input_schema");
    if let Some(format) = tollgate::estimate::messages_output_format(request) {
        chat.insert(
            "response_format".into(),
            json!({"type": "json_schema",
                   "json_schema": {"name": "output", "strict": true, "schema": format.get("schema")}}),
        );
    }
    if let Some(choice) = request.get("tool_choice").filter(|v| !v.is_null()) {
        let mapped = match choice.get("type").and_then(Value::as_str) {
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": choice.get("name")}}),
            _ => json!("auto"),
        };
        chat.insert("tool_choice".into(), mapped);
        if choice.get("disable_parallel_tool_use") == Some(&Value::Bool(true)) && chat.contains_key("tools") {
            chat.insert("parallel_tool_calls".into(), Value::Bool(false));
        }
    }
    Value::Object(chat)
}

/// The `tool_use` blocks of `blocks` as chat tool calls (their input as JSON text).
pub(super) fn tool_calls(blocks: &[Value]) -> Vec<Value> {
    blocks
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
        .map(|b| {
            let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
            json!({"id": b.get("id"), "type": "function",
                   "function": {"name": b.get("name"), "arguments": input.to_string()}})
        })
        .collect()
}

/// An assistant turn: its text, and its `tool_use` blocks as tool calls.
fn assistant_turn(content: &Value) -> Value {
    let calls = tool_calls(content.as_array().map(Vec::as_slice).unwrap_or_default());
    let text = text_of(content);
    let mut turn = json!({"role": "assistant", "content": if text.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(text) }});
    if !calls.is_empty() {
        turn["tool_calls"] = Value::Array(calls);
    }
    turn
}

/// A user turn: its tool results as `tool` messages (chat wants them right after the
/// calls), then the rest as one user message of text and image parts.
fn user_turn(content: &Value, messages: &mut Vec<Value>) {
    let Some(blocks) = content.as_array() else {
        messages.push(json!({"role": "user", "content": text_of(content)}));
        return;
    };
    let mut parts = Vec::new();
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("tool_result") => messages.push(json!({
                "role": "tool",
                "tool_call_id": b.get("tool_use_id"),
                "content": text_of(b.get("content").unwrap_or(&Value::Null)),
            })),
            Some("text") => parts.push(json!({"type": "text", "text": b.get("text")})),
            Some("image") => {
                if let Some(url) = image_url(b) {
                    parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
                }
            }
            _ => {}
        }
    }
    if !parts.is_empty() {
        messages.push(json!({"role": "user", "content": parts}));
    }
}

/// Anthropic's `stop_reason` for a chat `finish_reason`.
fn stop_reason(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls" | "function_call") => "tool_use",
        Some("content_filter") => "refusal",
        _ => "end_turn",
    }
}

/// A message id from a chat completion's.
fn message_id(chat_id: Option<&str>) -> String {
    let id = chat_id.unwrap_or_default();
    if id.starts_with("msg_") {
        id.to_owned()
    } else {
        format!("msg_{}", id.trim_start_matches("chatcmpl-"))
    }
}

/// A tool call's arguments as the `input` object (`{}` when they are not JSON).
fn tool_input(arguments: Option<&str>) -> Value {
    arguments
        .and_then(|a| serde_json::from_str::<Value>(a).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}))
}

/// The Anthropic message a chat completion (OpenAI's shape) answers.
pub fn message(chat: &Value) -> Value {
    let choice = chat.pointer("/choices/0").unwrap_or(&Value::Null);
    let reply = choice.get("message").unwrap_or(&Value::Null);
    let mut content = Vec::new();
    if let Some(text) = reply
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in super::array(reply, "tool_calls") {
        let function = call.get("function").unwrap_or(&Value::Null);
        content.push(
            json!({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                            "input": tool_input(function.get("arguments").and_then(Value::as_str))}),
        );
    }
    let count = |key: &str| {
        chat.pointer(&format!("/usage/{key}"))
            .and_then(Value::as_i64)
            .unwrap_or(0)
    };
    json!({
        "id": message_id(chat.get("id").and_then(Value::as_str)),
        "type": "message",
        "role": "assistant",
        "model": chat.get("model"),
        "content": content,
        "stop_reason": stop_reason(choice.get("finish_reason").and_then(Value::as_str)),
        "stop_sequence": null,
        "usage": {"input_tokens": count("prompt_tokens"), "output_tokens": count("completion_tokens")},
    })
}

/// The block open in a translated stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Text(usize),
    /// A tool call's block: the call's index in the chat stream, the block's index.
    Tool(u64, usize),
}

/// Turns a chat stream's chunks (OpenAI's shape) into Anthropic's events: `message_start`,
/// a `content_block_start`/`_delta`/`_stop` run per text or tool call (argument fragments
/// as `input_json_delta`), then `message_delta` (stop reason, usage) and `message_stop`.
#[derive(Debug)]
pub struct MessageEvents {
    started: bool,
    open: Open,
    blocks: usize,
    stop_reason: &'static str,
    usage: (i64, i64),
}

impl Default for MessageEvents {
    fn default() -> Self {
        Self {
            started: false,
            open: Open::None,
            blocks: 0,
            stop_reason: "end_turn",
            usage: (0, 0),
        }
    }
}

impl ChunkEvents for MessageEvents {
    fn chunk(&mut self, chunk: &Value) -> Vec<Value> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            out.push(json!({"type": "message_start", "message": {
                "id": message_id(chunk.get("id").and_then(Value::as_str)), "type": "message",
                "role": "assistant", "model": chunk.get("model"), "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0}}}));
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            let count = |key: &str| usage.get(key).and_then(Value::as_i64).unwrap_or(0);
            self.usage = (count("prompt_tokens"), count("completion_tokens"));
        }
        let Some(choice) = chunk.pointer("/choices/0") else {
            return out;
        };
        let delta = choice.get("delta").unwrap_or(&Value::Null);
        if let Some(text) = delta
            .get("content")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        {
            let index = match self.open {
                Open::Text(index) => index,
                _ => self.start(&mut out, json!({"type": "text", "text": ""}), Open::Text),
            };
            out.push(json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "text_delta", "text": text}}));
        }
        for call in super::array(delta, "tool_calls") {
            let at = call.get("index").and_then(Value::as_u64).unwrap_or(0);
            let function = call.get("function").unwrap_or(&Value::Null);
            let index = match self.open {
                Open::Tool(open, index) if open == at => index,
                _ => {
                    let block = json!({"type": "tool_use", "id": call.get("id"),
                                       "name": function.get("name"), "input": {}});
                    self.start(&mut out, block, |i| Open::Tool(at, i))
                }
            };
            if let Some(fragment) = function
                .get("arguments")
                .and_then(Value::as_str)
                .filter(|a| !a.is_empty())
            {
                out.push(json!({"type": "content_block_delta", "index": index,
                                "delta": {"type": "input_json_delta", "partial_json": fragment}}));
            }
        }
        if let Some(finish) = choice.get("finish_reason").and_then(Value::as_str) {
            self.stop_reason = stop_reason(Some(finish));
        }
        out
    }

    fn end(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        self.close(&mut out);
        let (input, output) = self.usage;
        out.push(json!({"type": "message_delta",
                        "delta": {"stop_reason": self.stop_reason, "stop_sequence": null},
                        "usage": {"input_tokens": input, "output_tokens": output}}));
        out.push(json!({"type": "message_stop"}));
        out
    }
}

impl MessageEvents {
    /// Closes the open block and opens `block`; its index.
    fn start(&mut self, out: &mut Vec<Value>, block: Value, open: impl Fn(usize) -> Open) -> usize {
        self.close(out);
        let index = self.blocks;
        self.blocks += 1;
        self.open = open(index);
        out.push(json!({"type": "content_block_start", "index": index, "content_block": block}));
        index
    }

    fn close(&mut self, out: &mut Vec<Value>) {
        if let Open::Text(index) | Open::Tool(_, index) = self.open {
            out.push(json!({"type": "content_block_stop", "index": index}));
        }
        self.open = Open::None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::as_chat::tests::{translated, types};

    #[test]
    fn a_tool_conversation_becomes_chat_with_its_calls_and_results_in_order() {
        let request = json!({
            "model": "fast", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Oslo?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "And now?"}]}
            ]
        });
        assert_eq!(unexpressed(&request), None);
        let chat = chat_request(&request);
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Oslo?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                {"role": "user", "content": [{"type": "text", "text": "And now?"}]}
            ])
        );
        assert_eq!(
            chat["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(
            (
                &chat["tool_choice"],
                &chat["parallel_tool_calls"],
                &chat["stop"],
                &chat["user"]
            ),
            (&json!("required"), &json!(false), &json!(["END"]), &json!("u1"))
        );
    }

    #[test]
    fn what_chat_cannot_say_is_refused_by_its_field() {
        let base = |extra: Value| {
            let mut r =
                json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().unwrap() {
                r[k] = v.clone();
            }
            r
        };
        let param = |r: Value| unexpressed(&r).map(|u| u.param);
        assert_eq!(
            param(base(json!({"thinking": {"type": "enabled"}}))),
            Some("thinking".into())
        );
        assert_eq!(
            param(base(json!({"stop_sequences": ["a", "b", "c", "d", "e"]}))),
            Some("stop_sequences".into())
        );
        let cached = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]});
        assert_eq!(
            param(base(cached)),
            Some("messages[0].content[0].cache_control".into())
        );
        let failed_tool = json!({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": true}]}]});
        assert_eq!(
            param(base(failed_tool)),
            Some("messages[0].content[0].is_error".into())
        );
        for (extra, field) in [
            (json!({"top_k": 5}), "top_k"),
            (
                json!({"context_management": {"edits": [{}]}}),
                "context_management",
            ),
            (json!({"inference_geo": "us"}), "inference_geo"),
            (
                json!({"output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {}}}}),
                "output_config.effort",
            ),
        ] {
            assert_eq!(param(base(extra)), Some(field.into()));
        }
        // Fields left at what they are when absent, and those translated, pass.
        let passes = json!({"service_tier": "auto", "thinking": null, "stream": false,
            "output_config": {"effort": null, "format": {"type": "json_schema", "schema": {"type": "object"}}}});
        assert_eq!(param(base(passes)), None);
    }

    #[test]
    fn an_output_schema_becomes_a_strict_json_schema_response_format() {
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"], "additionalProperties": false});
        let expected = json!({"type": "json_schema",
            "json_schema": {"name": "output", "strict": true, "schema": schema}});
        for request in [
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                "output_format": {"type": "json_schema", "schema": schema}}),
        ] {
            assert_eq!(unexpressed(&request), None);
            assert_eq!(chat_request(&request)["response_format"], expected);
        }
    }

    #[test]
    fn a_completion_with_a_tool_call_becomes_a_message() {
        let chat = json!({"id": "chatcmpl-abc", "model": "gpt-4o-mini", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 20, "completion_tokens": 7}});
        let m = message(&chat);
        assert_eq!(m["id"], "msg_abc");
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(
            m["content"],
            json!([{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}])
        );
        assert_eq!(m["usage"], json!({"input_tokens": 20, "output_tokens": 7}));
    }

    #[test]
    fn a_chat_stream_becomes_anthropic_events() {
        let all = translated(Box::<MessageEvents>::default());
        assert_eq!(
            types(&all),
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(all[3]["delta"]["text"], " there");
        assert_eq!(all[5]["content_block"]["name"], "f");
        assert_eq!(all[7]["delta"]["partial_json"], "1}");
        assert_eq!(all[9]["delta"]["stop_reason"], "tool_use");
        assert_eq!(all[9]["usage"], json!({"input_tokens": 9, "output_tokens": 4}));
    }
}
