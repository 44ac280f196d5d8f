//! OpenAI Responses requests to targets without a Responses API (every kind but the
//! OpenAI family): the request translated to chat ([`chat_request`]), sent through the
//! target's chat adapter like any chat job — to Anthropic, Gemini or Azure — and its answer
//! translated back: a chat completion to a response ([`response`]), a chat stream to the
//! Responses events ([`ResponseEvents`]), so the `openai` SDK's `responses` calls (and the
//! Agents SDK built on them) reach any model unchanged.
//!
//! Translated: `instructions`; message items (`user`, `assistant`, `system`, `developer`)
//! with `input_text`, `output_text` and `input_image` parts; `function_call` items as the
//! assistant's tool calls and `function_call_output` items as `tool` messages; function
//! `tools`, `tool_choice`, `parallel_tool_calls`; `max_output_tokens`, `temperature`,
//! `top_p`, `text.format` (`json_object`, `json_schema`) as `response_format`, `user` and
//! `safety_identifier`. `store` and `metadata` concern what the provider keeps, which a
//! translated call leaves nothing of. Any other field set is refused before the job is
//! queued ([`unexpressed`]), as are reasoning items and image parts given by file id.

use serde_json::{Map, Value, json};

use super::Unexpressed;
use super::as_chat::{ChunkEvents, copy_fields, insert_tools, untranslated_field, with_set};

/// Request fields the translation carries (or, for `store` and `metadata`, may leave).
const TRANSLATED_FIELDS: [&str; 15] = [
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "user",
    "safety_identifier",
    "stream",
    "store",
    "metadata",
];

/// What of `request` (a Responses request, validated) chat cannot express.
pub fn unexpressed(request: &Value) -> Option<Unexpressed> {
    let say = |param: String, what: &str| {
        Unexpressed::at(
            param,
            format!("{what} cannot be expressed to a chat target (no OpenAI target serves this model)"),
        )
    };
    // A field set to what it is when left out says nothing chat cannot say.
    let defaults = [
        ("service_tier", "auto"),
        ("service_tier", "default"),
        ("truncation", "disabled"),
    ];
    if let Some(field) = untranslated_field(request, &TRANSLATED_FIELDS, &defaults) {
        return say(field.to_owned(), &format!("`{field}`"));
    }
    if let Some(format) = request.pointer("/text/format/type").and_then(Value::as_str)
        && !matches!(format, "text" | "json_object" | "json_schema")
    {
        return say(
            "text.format.type".to_owned(),
            &format!("a {format:?} text format"),
        );
    }
    if request
        .get("text")
        .and_then(Value::as_object)
        .is_some_and(|t| t.keys().any(|k| k != "format"))
    {
        return say("text".to_owned(), "a text option other than `format`");
    }
    for (i, item) in super::array(request, "input").iter().enumerate() {
        let at = format!("input[{i}]");
        match item.get("type").and_then(Value::as_str) {
            None | Some("message" | "function_call" | "function_call_output") => {}
            Some(other) => return say(format!("{at}.type"), &format!("a {other:?} item")),
        }
        for (j, part) in super::array(item, "content").iter().enumerate() {
            let kind = part.get("type").and_then(Value::as_str);
            if kind == Some("input_image") && part.get("image_url").and_then(Value::as_str).is_none() {
                return say(
                    format!("{at}.content[{j}].image_url"),
                    "an image given by file id",
                );
            }
            if !matches!(
                kind,
                Some("input_text" | "output_text" | "input_image" | "refusal")
            ) {
                return say(format!("{at}.content[{j}].type"), "a content part of this type");
            }
        }
    }
    None
}

/// The text of a string, or of an array's text parts joined by newlines.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").or_else(|| p.get("refusal")).and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A message item's content for chat: a string as it is; parts as text and image parts
/// (an assistant's as its text).
fn message_content(role: &str, content: &Value) -> Value {
    let Some(parts) = content.as_array() else {
        return Value::String(text_of(content));
    };
    if role == "assistant" || role == "system" {
        return Value::String(text_of(content));
    }
    let parts: Vec<Value> = parts
        .iter()
        .map(|p| match p.get("type").and_then(Value::as_str) {
            Some("input_image") => {
                let image = with_set(json!({"url": p.get("image_url")}), p, &["detail"]);
                json!({"type": "image_url", "image_url": image})
            }
            _ => json!({"type": "text", "text": text_of(&Value::Array(vec![p.clone()]))}),
        })
        .collect();
    Value::Array(parts)
}

/// The chat messages `request`'s `instructions` and `input` make. Consecutive
/// `function_call` items become one assistant turn's tool calls (joined to the assistant
/// message right before them); each `function_call_output` a `tool` message.
fn messages(request: &Value) -> Vec<Value> {
    let mut messages = Vec::new();
    if let Some(instructions) = request.get("instructions").filter(|v| !v.is_null()) {
        messages.push(json!({"role": "system", "content": text_of(instructions)}));
    }
    let items = match request.get("input") {
        Some(Value::Array(items)) => items.as_slice(),
        Some(text) => {
            messages.push(json!({"role": "user", "content": text_of(text)}));
            &[]
        }
        None => &[],
    };
    for item in items {
        match item.get("type").and_then(Value::as_str) {
            Some("function_call") => {
                let call = json!({"id": item.get("call_id"), "type": "function",
                                  "function": {"name": item.get("name"), "arguments": item.get("arguments")}});
                let open = messages
                    .last_mut()
                    .filter(|m: &&mut Value| m.get("role").and_then(Value::as_str) == Some("assistant"));
                match open {
                    Some(turn) => match turn.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => turn["tool_calls"] = json!([call]),
                    },
                    None => {
                        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}))
                    }
                }
            }
            Some("function_call_output") => messages.push(json!({
                "role": "tool",
                "tool_call_id": item.get("call_id"),
                "content": text_of(item.get("output").unwrap_or(&Value::Null)),
            })),
            _ => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer" | "system") => "system",
                    Some("assistant") => "assistant",
                    _ => "user",
                };
                let content = message_content(role, item.get("content").unwrap_or(&Value::Null));
                messages.push(json!({"role": role, "content": content}));
            }
        }
    }
    messages
}

/// The chat request that asks what `request` (OpenAI Responses) asks. Its output cap is
/// the one the gate reserved for the response.
pub fn chat_request(request: &Value) -> Value {
    let mut chat = Map::new();
    chat.insert(
        "model".into(),
        request.get("model").cloned().unwrap_or(Value::Null),
    );
    chat.insert("messages".into(), Value::Array(messages(request)));
    chat.insert(
        "max_tokens".into(),
        json!(tollgate::estimate::responses_output_cap(request)),
    );
    copy_fields(
        &mut chat,
        request,
        &[
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("parallel_tool_calls", "parallel_tool_calls"),
            ("safety_identifier", "user"),
            ("user", "user"),
            ("stream", "stream"),
        ],
    );
    insert_tools(&mut chat, request, "parameters");
    if let Some(choice) = request.get("tool_choice").filter(|v| !v.is_null()) {
        let mapped = match choice.get("type").and_then(Value::as_str) {
            Some("function") => json!({"type": "function", "function": {"name": choice.get("name")}}),
            _ => choice.clone(),
        };
        chat.insert("tool_choice".into(), mapped);
    }
    match request.pointer("/text/format") {
        Some(f) if f.get("type").and_then(Value::as_str) == Some("json_schema") => {
            let schema = with_set(
                json!({"name": f.get("name"), "schema": f.get("schema")}),
                f,
                &["description", "strict"],
            );
            chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": schema}),
            );
        }
        Some(f) if f.get("type").and_then(Value::as_str) == Some("json_object") => {
            chat.insert("response_format".into(), json!({"type": "json_object"}));
        }
        _ => {}
    }
    Value::Object(chat)
}

/// A response id from a chat completion's.
fn response_id(chat_id: Option<&str>) -> String {
    let id = chat_id.unwrap_or_default();
    format!(
        "resp_{}",
        id.trim_start_matches("chatcmpl-").trim_start_matches("msg_")
    )
}

/// An assistant message item holding `text`, of id `msg_<id>`.
fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": format!("msg_{id}"), "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

/// The item id of the function call `call_id`.
fn call_item_id(call_id: &Value) -> String {
    format!(
        "fc_{}",
        call_id.as_str().unwrap_or_default().trim_start_matches("call_")
    )
}

/// A function call item.
fn call_item(call_id: &Value, name: &Value, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": call_item_id(call_id), "call_id": call_id,
           "name": name, "arguments": arguments, "status": status})
}

/// The response object: `output` items, status from the chat finish reason, usage.
fn response_object(
    id: &str,
    model: &Value,
    created: &Value,
    output: Vec<Value>,
    finish: Option<&str>,
    usage: (i64, i64, i64),
) -> Value {
    let (input, cached, out) = usage;
    let (status, incomplete) = match finish {
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some("content_filter") => ("incomplete", json!({"reason": "content_filter"})),
        _ => ("completed", Value::Null),
    };
    json!({
        "id": id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
        "text": {"format": {"type": "text"}}, "error": null, "incomplete_details": incomplete,
        "usage": {"input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
                  "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": input + out},
    })
}

/// (input, cached, output) tokens of a chat `usage`.
fn chat_usage(usage: &Value) -> (i64, i64, i64) {
    let count = |p: &str| usage.pointer(p).and_then(Value::as_i64).unwrap_or(0);
    (
        count("/prompt_tokens"),
        count("/prompt_tokens_details/cached_tokens"),
        count("/completion_tokens"),
    )
}

/// The Responses response a chat completion (OpenAI's shape) answers.
pub fn response(chat: &Value) -> Value {
    let choice = chat.pointer("/choices/0").unwrap_or(&Value::Null);
    let reply = choice.get("message").unwrap_or(&Value::Null);
    let id = response_id(chat.get("id").and_then(Value::as_str));
    let mut output = Vec::new();
    if let Some(text) = reply
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        output.push(message_item(id.trim_start_matches("resp_"), text, "completed"));
    }
    for call in super::array(reply, "tool_calls") {
        let function = call.get("function").unwrap_or(&Value::Null);
        let arguments = function.get("arguments").and_then(Value::as_str).unwrap_or("{}");
        output.push(call_item(
            call.get("id").unwrap_or(&Value::Null),
            function.get("name").unwrap_or(&Value::Null),
            arguments,
            "completed",
        ));
    }
    response_object(
        &id,
        chat.get("model").unwrap_or(&Value::Null),
        chat.get("created").unwrap_or(&Value::Null),
        output,
        choice.get("finish_reason").and_then(Value::as_str),
        chat_usage(chat.get("usage").unwrap_or(&Value::Null)),
    )
}

/// The output item open in a translated stream.
#[derive(Debug)]
enum Open {
    None,
    Text(String),
    /// A function call: its index in the chat stream, id, name and arguments so far.
    Call {
        index: u64,
        call_id: Value,
        name: Value,
        arguments: String,
    },
}

/// Turns a chat stream's chunks (OpenAI's shape) into the Responses events:
/// `response.created` and `response.in_progress`; per text run `output_item.added`,
/// `content_part.added`, `output_text.delta`s, `output_text.done`, `content_part.done`,
/// `output_item.done`; per tool call `output_item.added`,
/// `function_call_arguments.delta`s and `.done`, `output_item.done`; then
/// `response.completed` (or `response.incomplete`) with the whole response and its usage.
/// Every event carries its `sequence_number`.
#[derive(Debug)]
pub struct ResponseEvents {
    started: bool,
    id: String,
    model: Value,
    created: Value,
    open: Open,
    done: Vec<Value>,
    finish: Option<String>,
    usage: (i64, i64, i64),
    sequence: u64,
}

impl Default for ResponseEvents {
    fn default() -> Self {
        Self {
            started: false,
            id: String::new(),
            model: Value::Null,
            created: Value::Null,
            open: Open::None,
            done: Vec::new(),
            finish: None,
            usage: (0, 0, 0),
            sequence: 0,
        }
    }
}

impl ChunkEvents for ResponseEvents {
    fn chunk(&mut self, chunk: &Value) -> Vec<Value> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            self.id = response_id(chunk.get("id").and_then(Value::as_str));
            self.model = chunk.get("model").cloned().unwrap_or(Value::Null);
            self.created = chunk.get("created").cloned().unwrap_or(Value::Null);
            let mut started = self.response(Vec::new());
            started["status"] = json!("in_progress");
            started["usage"] = Value::Null;
            self.emit(&mut out, json!({"type": "response.created", "response": started}));
            self.emit(
                &mut out,
                json!({"type": "response.in_progress", "response": started}),
            );
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = chat_usage(usage);
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
            if !matches!(self.open, Open::Text(_)) {
                self.close(&mut out);
                self.open = Open::Text(String::new());
                let item = self.text_item("", "in_progress");
                let (output_index, item_id) = (self.done.len(), item["id"].clone());
                let mut added = item.clone();
                added["content"] = json!([]);
                self.emit(&mut out, json!({"type": "response.output_item.added", "output_index": output_index, "item": added}));
                self.emit(
                    &mut out,
                    json!({"type": "response.content_part.added", "item_id": item_id,
                    "output_index": output_index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}}),
                );
            }
            if let Open::Text(so_far) = &mut self.open {
                so_far.push_str(text);
            }
            let item_id = format!("msg_{}", self.text_id());
            let output_index = self.done.len();
            self.emit(
                &mut out,
                json!({"type": "response.output_text.delta", "item_id": item_id,
                "output_index": output_index, "content_index": 0, "delta": text, "logprobs": []}),
            );
        }
        for call in super::array(delta, "tool_calls") {
            let index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
            let function = call.get("function").unwrap_or(&Value::Null);
            if !matches!(&self.open, Open::Call { index: open, .. } if *open == index) {
                self.close(&mut out);
                let call_id = call.get("id").cloned().unwrap_or(Value::Null);
                let name = function.get("name").cloned().unwrap_or(Value::Null);
                let added = call_item(&call_id, &name, "", "in_progress");
                let output_index = self.done.len();
                self.emit(&mut out, json!({"type": "response.output_item.added", "output_index": output_index, "item": added}));
                self.open = Open::Call {
                    index,
                    call_id,
                    name,
                    arguments: String::new(),
                };
            }
            if let Some(fragment) = function
                .get("arguments")
                .and_then(Value::as_str)
                .filter(|a| !a.is_empty())
            {
                let output_index = self.done.len();
                let mut item_id = None;
                if let Open::Call {
                    call_id, arguments, ..
                } = &mut self.open
                {
                    arguments.push_str(fragment);
                    item_id = Some(call_item_id(call_id));
                }
                self.emit(
                    &mut out,
                    json!({"type": "response.function_call_arguments.delta",
                    "item_id": item_id, "output_index": output_index, "delta": fragment}),
                );
            }
        }
        if let Some(finish) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(finish.to_owned());
        }
        out
    }

    fn end(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        self.close(&mut out);
        let output = std::mem::take(&mut self.done);
        let response = self.response(output);
        let kind = if response["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(&mut out, json!({"type": kind, "response": response}));
        out
    }
}

impl ResponseEvents {
    /// Numbers `event` and adds it to `out`.
    fn emit(&mut self, out: &mut Vec<Value>, mut event: Value) {
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        out.push(event);
    }

    /// The id (after `msg_`) of the message item of this stream's text at this point.
    fn text_id(&self) -> String {
        format!("{}_{}", self.id.trim_start_matches("resp_"), self.done.len())
    }

    /// The message item of this stream's text.
    fn text_item(&self, text: &str, status: &str) -> Value {
        message_item(&self.text_id(), text, status)
    }

    fn response(&self, output: Vec<Value>) -> Value {
        response_object(
            &self.id,
            &self.model,
            &self.created,
            output,
            self.finish.as_deref(),
            self.usage,
        )
    }

    /// Ends the open item: its `done` events, and the item kept for the response.
    fn close(&mut self, out: &mut Vec<Value>) {
        let output_index = self.done.len();
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => {}
            Open::Text(text) => {
                let item = self.text_item(&text, "completed");
                let item_id = item["id"].clone();
                self.emit(
                    out,
                    json!({"type": "response.output_text.done", "item_id": item_id,
                    "output_index": output_index, "content_index": 0, "text": text, "logprobs": []}),
                );
                self.emit(
                    out,
                    json!({"type": "response.content_part.done", "item_id": item_id,
                    "output_index": output_index, "content_index": 0, "part": item["content"][0]}),
                );
                self.emit(
                    out,
                    json!({"type": "response.output_item.done", "output_index": output_index, "item": item}),
                );
                self.done.push(item);
            }
            Open::Call {
                call_id,
                name,
                arguments,
                ..
            } => {
                let item = call_item(&call_id, &name, &arguments, "completed");
                self.emit(
                    out,
                    json!({"type": "response.function_call_arguments.done", "item_id": item["id"],
                    "output_index": output_index, "arguments": arguments}),
                );
                self.emit(
                    out,
                    json!({"type": "response.output_item.done", "output_index": output_index, "item": item}),
                );
                self.done.push(item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::as_chat::tests::{translated, types};

    #[test]
    fn a_function_call_conversation_becomes_chat_with_its_calls_and_outputs_in_order() {
        let request = json!({
            "model": "fast", "instructions": "Be brief.", "max_output_tokens": 64, "temperature": 0.2,
            "tools": [{"type": "function", "name": "get_weather", "description": "Weather",
                       "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": false,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "store": true, "metadata": {"k": "v"}, "safety_identifier": "u1",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Oslo?"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"Bergen\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_2", "output": "rain"}
            ]
        });
        assert_eq!(unexpressed(&request), None);
        let chat = chat_request(&request);
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": [{"type": "text", "text": "Oslo?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}]},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Bergen\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "rain"}
            ])
        );
        assert_eq!(
            chat["tools"],
            json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                    "parameters": {"type": "object"}, "strict": true}}])
        );
        assert_eq!(
            chat["tool_choice"],
            json!({"type": "function", "function": {"name": "get_weather"}})
        );
        assert_eq!(
            chat["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}})
        );
        assert_eq!(
            (
                &chat["max_tokens"],
                &chat["user"],
                &chat["parallel_tool_calls"],
                &chat["temperature"]
            ),
            (&json!(64), &json!("u1"), &json!(false), &json!(0.2))
        );
        // A bare string is one user message; the cap defaults as the gate reserved it.
        let plain = chat_request(&json!({"model": "m", "input": "hi"}));
        assert_eq!(plain["messages"], json!([{"role": "user", "content": "hi"}]));
        assert_eq!(
            plain["max_tokens"],
            json!(tollgate::estimate::responses_output_cap(&json!({})))
        );
    }

    #[test]
    fn what_chat_cannot_say_is_refused_by_its_field() {
        let param = |extra: Value| {
            let mut r = json!({"model": "m", "input": "hi"});
            for (k, v) in extra.as_object().unwrap() {
                r[k] = v.clone();
            }
            unexpressed(&r).map(|u| u.param)
        };
        assert_eq!(
            param(json!({"reasoning": {"effort": "high"}})),
            Some("reasoning".into())
        );
        assert_eq!(param(json!({"top_logprobs": 2})), Some("top_logprobs".into()));
        assert_eq!(
            param(json!({"include": ["reasoning.encrypted_content"]})),
            Some("include".into())
        );
        assert_eq!(
            param(
                json!({"include": [], "service_tier": "auto", "truncation": "disabled", "background": false})
            ),
            None,
            "defaults said out loud"
        );
        assert_eq!(param(json!({"truncation": "auto"})), Some("truncation".into()));
        assert_eq!(
            param(json!({"service_tier": "flex"})),
            Some("service_tier".into())
        );
        assert_eq!(param(json!({"text": {"verbosity": "low"}})), Some("text".into()));
        assert_eq!(
            param(json!({"input": [{"type": "reasoning", "summary": []}]})),
            Some("input[0].type".into())
        );
        assert_eq!(
            param(
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]})
            ),
            Some("input[0].content[0].image_url".into())
        );
    }

    #[test]
    fn a_completion_becomes_a_response() {
        let chat = json!({"id": "chatcmpl-abc", "created": 7, "model": "claude-x", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 20, "completion_tokens": 7}});
        let r = response(&chat);
        assert_eq!(
            (&r["id"], &r["object"], &r["status"]),
            (&json!("resp_abc"), &json!("response"), &json!("completed"))
        );
        assert_eq!(r["output"][0]["content"][0]["text"], "Let me check.");
        assert_eq!(
            (
                &r["output"][1]["type"],
                &r["output"][1]["call_id"],
                &r["output"][1]["arguments"]
            ),
            (
                &json!("function_call"),
                &json!("call_1"),
                &json!("{\"city\":\"Oslo\"}")
            )
        );
        assert_eq!(
            (
                &r["usage"]["input_tokens"],
                &r["usage"]["output_tokens"],
                &r["usage"]["total_tokens"]
            ),
            (&json!(20), &json!(7), &json!(27))
        );
        let cut = json!({"id": "x", "choices": [{"message": {"content": "abc"}, "finish_reason": "length"}]});
        let r = response(&cut);
        assert_eq!(
            (&r["status"], &r["incomplete_details"]["reason"]),
            (&json!("incomplete"), &json!("max_output_tokens"))
        );
    }

    #[test]
    fn a_chat_stream_becomes_responses_events() {
        let all = translated(Box::<ResponseEvents>::default());
        assert_eq!(
            types(&all),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let numbers: Vec<u64> = all
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(numbers, (0..all.len() as u64).collect::<Vec<_>>());
        assert_eq!(all[6]["text"], "Hi there");
        assert_eq!(all[4]["item_id"], all[8]["item"]["id"], "deltas name their item");
        assert_eq!(all[12]["arguments"], "{\"a\":1}");
        let done = &all[14]["response"];
        assert_eq!(done["output"].as_array().map(Vec::len), Some(2));
        assert_eq!(done["output"][1]["name"], "f");
        assert_eq!(
            (&done["usage"]["input_tokens"], &done["usage"]["output_tokens"]),
            (&json!(9), &json!(4))
        );
    }
}
