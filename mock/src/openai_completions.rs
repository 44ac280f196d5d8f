//! `POST /v1/completions`, OpenAI's legacy Completions: a `prompt` (a string, strings,
//! token ids or arrays of them) in, `n` choices of text per prompt out, `max_tokens`
//! defaulting to 16. TPM is charged at the start with the input plus `max_tokens` for each
//! of the `best_of` (default `n`) candidates of each prompt, as OpenAI counts them; `usage`
//! reports every candidate generated. With `stream: true`, `text_completion` chunks (each
//! choice's text, then its finish), the usage chunk when `stream_options.include_usage`
//! is set, and `[DONE]`.
//!
//! Input counted per prompt: a token per started four characters of a string, one per
//! token id.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Value, json};

use super::MockProvider;
use super::buckets::{Admission, Charge};
use super::openai::Reply;
use super::reply::Respond;

/// OpenAI's default `max_tokens` of a completion.
const DEFAULT_MAX_TOKENS: u64 = 16;

/// The prompts of a request, each as its input tokens; `None` when `prompt` is malformed.
fn prompts(prompt: &Value) -> Option<Vec<u64>> {
    let text = |s: &str| (s.chars().count() as u64).div_ceil(4);
    match prompt {
        Value::String(s) => Some(vec![text(s)]),
        Value::Array(items) if items.is_empty() => None,
        Value::Array(items) if items.iter().all(Value::is_u64) => Some(vec![items.len() as u64]),
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => Some(text(s)),
                Value::Array(ids) if !ids.is_empty() && ids.iter().all(Value::is_u64) => {
                    Some(ids.len() as u64)
                }
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// A Completions request as OpenAI reads it.
pub(super) struct Completion<'a> {
    pub model: &'a str,
    /// The input tokens of each prompt.
    prompts: Vec<u64>,
    max_tokens: u64,
    n: u64,
    best_of: u64,
    stream: bool,
}

impl<'a> Completion<'a> {
    /// The request checked; the message of OpenAI's 400 when it is malformed.
    pub(super) fn check(body: &'a Value) -> Result<Self, String> {
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .ok_or("you must provide a model parameter")?;
        let prompt = body
            .get("prompt")
            .ok_or("Missing required parameter: 'prompt'.")?;
        let prompts = prompts(prompt).ok_or(
            "Invalid value for 'prompt': expected a string, an array of strings, an array of tokens, or an array of token arrays.",
        )?;
        let count = |k: &str| body.get(k).and_then(Value::as_u64);
        let n = count("n").unwrap_or(1).max(1);
        let stream = body.get("stream") == Some(&Value::Bool(true));
        if stream && body.get("best_of").is_some_and(|b| !b.is_null()) {
            return Err("best_of cannot be used with stream.".to_owned());
        }
        Ok(Self {
            model,
            prompts,
            max_tokens: count("max_tokens").unwrap_or(DEFAULT_MAX_TOKENS),
            n,
            best_of: count("best_of").unwrap_or(n).max(n),
            stream,
        })
    }

    pub(super) fn input(&self) -> u64 {
        self.prompts.iter().sum()
    }

    /// Candidates generated: `best_of` per prompt.
    fn candidates(&self) -> u64 {
        self.best_of.saturating_mul(self.prompts.len() as u64)
    }

    /// The output tokens charged at the start: `max_tokens` per candidate.
    pub(super) fn reserved(&self) -> u64 {
        self.max_tokens.saturating_mul(self.candidates())
    }

    /// Choices answered: `n` per prompt.
    fn choices(&self) -> u64 {
        (self.prompts.len() as u64).saturating_mul(self.n)
    }

    /// Tokens generated per candidate, and what all candidates generated.
    pub(super) fn output(&self, inner: &super::Inner) -> (u64, u64) {
        let per_choice = inner.completion_tokens(Some(self.max_tokens));
        (per_choice, per_choice.saturating_mul(self.candidates()))
    }

    /// The whole answer, with the usage.
    pub(super) fn whole(&self, inner: &super::Inner) -> Value {
        let (per_choice, output) = self.output(inner);
        let finish = if per_choice < inner.output_tokens {
            "length"
        } else {
            "stop"
        };
        let text = inner.text.words(per_choice);
        let input = self.input();
        let choices: Vec<Value> = (0..self.choices())
            .map(|index| json!({"text": text, "index": index, "logprobs": null, "finish_reason": finish}))
            .collect();
        json!({"id": format!("cmpl-{}", super::hex_id(29)), "object": "text_completion",
               "created": inner.unix_secs(), "model": self.model, "choices": choices,
               "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output}})
    }
}

/// The chunks of a `whole` answer: each choice's text, then each choice's finish, then
/// the usage when `include_usage`.
fn chunks(whole: &Value, include_usage: bool) -> Vec<Value> {
    let chunk = |choice: Value| {
        let mut c = whole.clone();
        c["choices"] = json!([choice]);
        c.as_object_mut().map(|o| o.remove("usage"));
        c
    };
    let choices = whole["choices"].as_array().cloned().unwrap_or_default();
    let mut events: Vec<Value> = choices
        .iter()
        .map(|c| {
            let mut text = c.clone();
            text["finish_reason"] = Value::Null;
            chunk(text)
        })
        .collect();
    events.extend(choices.iter().map(|c| {
        let mut end = c.clone();
        end["text"] = json!("");
        chunk(end)
    }));
    if include_usage {
        let mut last = whole.clone();
        last["choices"] = json!([]);
        events.push(last);
    }
    events
}

pub(super) async fn completions(State(p): State<MockProvider>, req: Request) -> Response {
    let inner = &*p.inner;
    let _in_flight = inner.totals.begin();
    let mut reply = Reply::new(inner);
    let (project, body): (usize, Value) = match reply.open(req).await {
        Ok(opened) => opened,
        Err(refused) => return *refused,
    };
    let completion = match Completion::check(&body) {
        Ok(c) => c,
        Err(message) => return reply.bad_request(&message),
    };
    let model = completion.model;
    let fault = match reply.before_admission(project, model).await {
        Ok(fault) => fault,
        Err(answer) => return *answer,
    };
    let input = completion.input();
    let reserved = completion.reserved();
    let (_, output) = completion.output(inner);
    let charge = Charge {
        tokens: input.saturating_add(reserved),
        input,
        output: reserved,
    };
    let view = match inner.admit(project, charge, input, output) {
        Admission::Admitted(view) => view,
        Admission::Denied(denial, view) => return reply.rate_limited(model, &denial, &view),
    };
    let refund = inner.generate(project, &view, reserved, output).await;
    let include_usage = body.pointer("/stream_options/include_usage") == Some(&Value::Bool(true));
    super::stats::bump(&inner.totals.succeeded);
    let whole = completion.whole(inner);
    let resp = if completion.stream {
        let mut sse: String = chunks(&whole, include_usage)
            .iter()
            .map(|e| format!("data: {e}\n\n"))
            .collect();
        sse.push_str("data: [DONE]\n\n");
        reply.stream(Body::from(sse), &view)
    } else {
        reply.json(StatusCode::OK, &whole, Some(&view))
    };
    drop(refund);
    super::faults::after(fault, resp).await
}
