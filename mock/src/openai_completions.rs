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

pub(super) async fn completions(State(p): State<MockProvider>, req: Request) -> Response {
    let inner = &*p.inner;
    let _in_flight = inner.totals.begin();
    let mut reply = Reply::new(inner);
    let (project, body): (usize, Value) = match reply.open(req).await {
        Ok(opened) => opened,
        Err(refused) => return *refused,
    };
    let Some(model) = body
        .get("model")
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty())
    else {
        return reply.bad_request("you must provide a model parameter");
    };
    let Some(prompt) = body.get("prompt") else {
        return reply.bad_request("Missing required parameter: 'prompt'.");
    };
    let Some(prompts) = prompts(prompt) else {
        return reply.bad_request(
            "Invalid value for 'prompt': expected a string, an array of strings, an array of tokens, or an array of token arrays.",
        );
    };
    let count = |k: &str| body.get(k).and_then(Value::as_u64);
    let max_tokens = count("max_tokens").unwrap_or(DEFAULT_MAX_TOKENS);
    let n = count("n").unwrap_or(1).max(1);
    let best_of = count("best_of").unwrap_or(n).max(n);
    let stream = body.get("stream") == Some(&Value::Bool(true));
    if stream && body.get("best_of").is_some_and(|b| !b.is_null()) {
        return reply.bad_request("best_of cannot be used with stream.");
    }
    let fault = match reply.before_admission(project, model).await {
        Ok(fault) => fault,
        Err(answer) => return *answer,
    };
    let input: u64 = prompts.iter().sum();
    let candidates = best_of.saturating_mul(prompts.len() as u64);
    let reserved = max_tokens.saturating_mul(candidates);
    let per_choice = inner.completion_tokens(Some(max_tokens));
    let output = per_choice.saturating_mul(candidates);
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
    let finish = if per_choice < inner.output_tokens {
        "length"
    } else {
        "stop"
    };
    let text = inner.text.words(per_choice);
    let id = format!("cmpl-{}", super::hex_id(29));
    let created = inner.unix_secs();
    let usage = json!({"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output});
    let choices = (prompts.len() as u64).saturating_mul(n);
    let object = |choices: Vec<Value>| json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices});
    let choice = |index: u64, text: &str, finish: Option<&str>| json!({"text": text, "index": index, "logprobs": null, "finish_reason": finish});
    super::stats::bump(&inner.totals.succeeded);
    let resp = if stream {
        let mut events: Vec<Value> = (0..choices)
            .map(|i| object(vec![choice(i, text, None)]))
            .collect();
        events.extend((0..choices).map(|i| object(vec![choice(i, "", Some(finish))])));
        if body.pointer("/stream_options/include_usage") == Some(&Value::Bool(true)) {
            let mut last = object(Vec::new());
            last["usage"] = usage;
            events.push(last);
        }
        let mut sse: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        sse.push_str("data: [DONE]\n\n");
        reply.stream(Body::from(sse), &view)
    } else {
        let mut whole = object((0..choices).map(|i| choice(i, text, Some(finish))).collect());
        whole["usage"] = usage;
        reply.json(StatusCode::OK, &whole, Some(&view))
    };
    drop(refund);
    super::faults::after(fault, resp).await
}
