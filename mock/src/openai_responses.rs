//! `POST /v1/responses` in OpenAI's shape: `input` as text or items, `instructions`,
//! `max_output_tokens` (at least 16, as OpenAI requires), function tools; TPM charged
//! `input + max_output_tokens` at the start as for chat; answered with a response object
//! (`output` items, `usage` with `input_tokens` / `output_tokens`), or with `stream: true`
//! as its events (`response.created` … `response.completed`, each named by its `type` and
//! numbered by `sequence_number`).
//!
//! Input counted as chat's rule: 3, and per item (the text, and `instructions`, one each)
//! 4 plus a token per started four characters. When the request has function tools and its
//! input holds no `function_call_output`, the mock calls the first tool with `"mock"` for
//! each of its parameters' properties instead of answering in text.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Value, json};

use super::buckets::{Admission, Charge};
use super::openai::Reply;
use super::reply::Respond;
use super::request::message_tokens;
use super::{MockProvider, hex_id};

/// Lowest `max_output_tokens` OpenAI accepts.
const MIN_OUTPUT_TOKENS: u64 = 16;

/// What the response holds: text, or a call of a function tool.
enum Output {
    Text(String),
    Call { name: String, arguments: String },
}

/// A Responses request as OpenAI reads it.
pub(super) struct Responses<'a> {
    pub model: &'a str,
    pub input_tokens: u64,
    pub max_out: Option<u64>,
    /// The function tool called instead of answering in text: `(name, arguments)`.
    call: Option<(String, String)>,
    pub stream: bool,
}

impl<'a> Responses<'a> {
    /// The request checked; the message of OpenAI's 400 when it is malformed.
    pub(super) fn check(body: &'a Value) -> Result<Self, String> {
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .ok_or("Missing required parameter: 'model'.")?;
        let input = match body.get("input") {
            Some(Value::String(s)) if !s.is_empty() => vec![Value::String(s.clone())],
            Some(Value::Array(items)) if !items.is_empty() => items.clone(),
            Some(_) => {
                return Err("Invalid value for 'input': expected a string or an array of items.".to_owned());
            }
            None => return Err("Missing required parameter: 'input'.".to_owned()),
        };
        let max_out = body.get("max_output_tokens").and_then(Value::as_u64);
        if let Some(m) = max_out.filter(|m| *m < MIN_OUTPUT_TOKENS) {
            return Err(format!(
                "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= {MIN_OUTPUT_TOKENS}, but got {m} instead."
            ));
        }
        let text_of = |v: &Value| match v {
            Value::String(s) => s.chars().count() as u64,
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(|t| t.chars().count() as u64)
                .sum(),
            _ => 0,
        };
        let item_chars = |item: &Value| match item {
            Value::String(s) => s.chars().count() as u64,
            _ => ["content", "output", "arguments"]
                .iter()
                .filter_map(|k| item.get(*k))
                .map(text_of)
                .sum(),
        };
        let instructions = body.get("instructions").map(text_of);
        let input_tokens = 3
            + input.iter().map(|i| message_tokens(item_chars(i))).sum::<u64>()
            + instructions.map_or(0, message_tokens);
        let answered = input
            .iter()
            .any(|i| i.get("type").and_then(Value::as_str) == Some("function_call_output"));
        let call = body
            .get("tools")
            .and_then(Value::as_array)
            .and_then(|t| {
                t.iter()
                    .find(|t| t.get("type").and_then(Value::as_str) == Some("function"))
            })
            .filter(|_| !answered)
            .map(|tool| {
                let arguments = super::request::mock_object(tool.get("parameters"));
                let name = tool.get("name").and_then(Value::as_str).unwrap_or_default();
                (name.to_owned(), arguments.to_string())
            });
        Ok(Self {
            model,
            input_tokens,
            max_out,
            call,
            stream: body.get("stream") == Some(&Value::Bool(true)),
        })
    }

    /// What the response holds, `output` tokens of text or the call.
    fn content(&self, inner: &super::Inner, output: u64) -> Output {
        match &self.call {
            Some((name, arguments)) => Output::Call {
                name: name.clone(),
                arguments: arguments.clone(),
            },
            None => Output::Text(inner.text.words(output).to_owned()),
        }
    }

    /// The completed response of `output` tokens, and what it holds.
    fn answer(&self, inner: &super::Inner, output: u64) -> (Value, Output) {
        let content = self.content(inner, output);
        let id = format!("resp_{}", hex_id(32));
        let response = response_object(
            &id,
            self.model,
            inner.unix_secs(),
            &content,
            self.input_tokens,
            output,
        );
        (response, content)
    }

    /// The completed response (a batch line's).
    pub(super) fn whole(&self, inner: &super::Inner) -> Value {
        self.answer(inner, inner.completion_tokens(self.max_out)).0
    }
}

pub(super) async fn responses(State(p): State<MockProvider>, req: Request) -> Response {
    let inner = &*p.inner;
    let _in_flight = inner.totals.begin();
    let mut reply = Reply::new(inner);
    let (project, body): (usize, Value) = match reply.open(req).await {
        Ok(opened) => opened,
        Err(refused) => return *refused,
    };
    let request = match Responses::check(&body) {
        Ok(r) => r,
        Err(message) => return reply.bad_request(&message),
    };
    let model = request.model;
    let fault = match reply.before_admission(project, model).await {
        Ok(fault) => fault,
        Err(answer) => return *answer,
    };
    let input_tokens = request.input_tokens;
    let reserved = request.max_out.unwrap_or(inner.output_tokens);
    let output = inner.completion_tokens(request.max_out);
    let charge = Charge {
        tokens: input_tokens.saturating_add(reserved),
        input: input_tokens,
        output: reserved,
    };
    let view = match inner.admit(project, charge, input_tokens, output) {
        Admission::Admitted(view) => view,
        Admission::Denied(denial, view) => return reply.rate_limited(model, &denial, &view),
    };
    let refund = inner.generate(project, &view, reserved, output).await;
    let (response, content) = request.answer(inner, output);
    super::stats::bump(&inner.totals.succeeded);
    let resp = if request.stream {
        reply.stream(Body::from(events(&response, &content)), &view)
    } else {
        reply.json(StatusCode::OK, &response, Some(&view))
    };
    drop(refund);
    super::faults::after(fault, resp).await
}

/// The output item of `content`, as it is when done.
fn output_item(content: &Output) -> Value {
    match content {
        Output::Text(text) => {
            json!({"type": "message", "id": format!("msg_{}", hex_id(32)), "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]})
        }
        Output::Call { name, arguments } => {
            json!({"type": "function_call", "id": format!("fc_{}", hex_id(32)),
            "call_id": format!("call_{}", hex_id(24)), "name": name, "arguments": arguments, "status": "completed"})
        }
    }
}

/// The response object, completed.
fn response_object(id: &str, model: &str, created: i64, content: &Output, input: u64, output: u64) -> Value {
    json!({
        "id": id, "object": "response", "created_at": created, "status": "completed", "model": model,
        "output": [output_item(content)], "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
        "text": {"format": {"type": "text"}}, "error": null, "incomplete_details": null,
        "usage": {"input_tokens": input, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": input + output},
    })
}

/// The stream of a completed `response`: created, the item added, its text (or its
/// call's arguments) in two deltas and done, then completed with the whole response.
fn events(response: &Value, content: &Output) -> String {
    let item = &response["output"][0];
    let item_id = item["id"].clone();
    let mut started = response.clone();
    started["status"] = json!("in_progress");
    started["output"] = json!([]);
    started["usage"] = Value::Null;
    let mut added = item.clone();
    added["status"] = json!("in_progress");
    let halves = |s: &str| {
        let mid = s
            .char_indices()
            .nth(s.chars().count() / 2)
            .map_or(s.len(), |(i, _)| i);
        [s[..mid].to_owned(), s[mid..].to_owned()]
    };
    let mut events = vec![
        json!({"type": "response.created", "response": started}),
        json!({"type": "response.in_progress", "response": started}),
    ];
    match content {
        Output::Text(text) => {
            added["content"] = json!([]);
            events.push(json!({"type": "response.output_item.added", "output_index": 0, "item": added}));
            events.push(
                json!({"type": "response.content_part.added", "item_id": item_id, "output_index": 0,
                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
            );
            for delta in halves(text) {
                events.push(
                    json!({"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
                    "content_index": 0, "delta": delta, "logprobs": []}),
                );
            }
            events.push(
                json!({"type": "response.output_text.done", "item_id": item_id, "output_index": 0,
                "content_index": 0, "text": text, "logprobs": []}),
            );
            events.push(
                json!({"type": "response.content_part.done", "item_id": item_id, "output_index": 0,
                "content_index": 0, "part": item["content"][0]}),
            );
        }
        Output::Call { arguments, .. } => {
            added["arguments"] = json!("");
            events.push(json!({"type": "response.output_item.added", "output_index": 0, "item": added}));
            for delta in halves(arguments) {
                events.push(
                    json!({"type": "response.function_call_arguments.delta", "item_id": item_id,
                    "output_index": 0, "delta": delta}),
                );
            }
            events.push(
                json!({"type": "response.function_call_arguments.done", "item_id": item_id,
                "output_index": 0, "arguments": arguments}),
            );
        }
    }
    events.push(json!({"type": "response.output_item.done", "output_index": 0, "item": item}));
    events.push(json!({"type": "response.completed", "response": response}));
    events
        .into_iter()
        .enumerate()
        .map(|(n, mut e)| {
            e["sequence_number"] = json!(n);
            format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap_or_default())
        })
        .collect()
}
