//! `POST /v1beta/models/{model}:generateContent` in Google's shape (`docs/PROVIDERS.md` §3):
//! `x-goog-api-key` (or `?key=`) auth, `google.rpc.Status` error bodies
//! (`{"error":{code,message,status,details}}`), **no rate-limit headers**, and 429
//! `RESOURCE_EXHAUSTED` bodies that carry a `QuotaFailure` (the violated quota's id and
//! value = the project's limit) and a `RetryInfo.retryDelay`. Success bodies report
//! `usageMetadata`.
//!
//! Auth errors as Google sends them: no key → 403 `PERMISSION_DENIED`; an unknown key →
//! 400 `INVALID_ARGUMENT` with `ErrorInfo.reason = API_KEY_INVALID`; a revoked key → 403
//! `PERMISSION_DENIED` (`CONSUMER_SUSPENDED`). Token rule: `contents` count as messages and
//! `systemInstruction` as one more (`request`). `streamGenerateContent?alt=sse` streams the
//! answer as server-sent events, each a partial `GenerateContentResponse`, the last with
//! the `finishReason` and the whole `usageMetadata` (`stream`). Function
//! calling as Gemini checks it: declared functions are called (see [`function_call`]), a
//! turn of function responses must follow the turn of calls it answers, one per call.

use std::collections::HashMap;

use axum::body::{Body, to_bytes};
use axum::extract::{Path as UrlPath, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Value, json};

use super::buckets::{Admission, Charge, Denial, LimitKind, LimitsView};
use super::reply::Respond;
use super::request::{MessagesTokens, TextChars, input_tokens, message_tokens};
use super::stream::{self, Shape, StreamGuard};
use super::{Inner, KeyLookup, MAX_BODY_BYTES, MockProvider, ProviderKind, ceil_secs, hex_id};

/// The `GenerateContentRequest` fields the mock reads; others are ignored.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GenerateContentRequest {
    #[serde(default)]
    contents: Option<Vec<Content>>,
    #[serde(default, alias = "system_instruction")]
    system_instruction: Option<Content>,
    #[serde(default, alias = "generation_config")]
    generation_config: Option<GenerationConfig>,
}

/// A `Content`, reduced to the characters of its parts' `text`.
#[derive(Debug, Deserialize)]
struct Content {
    #[serde(default)]
    parts: TextChars,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GenerationConfig {
    #[serde(default, alias = "max_output_tokens")]
    max_output_tokens: Option<u64>,
}

struct Reply<'a> {
    inner: &'a Inner,
}

pub(super) async fn generate_content(
    State(p): State<MockProvider>,
    UrlPath(model_action): UrlPath<String>,
    Query(query): Query<HashMap<String, String>>,
    req: Request,
) -> Response {
    let inner = &*p.inner;
    let in_flight = inner.totals.begin();
    let (parts, body) = req.into_parts();
    let project = match authenticate(inner, &parts.headers, &query) {
        Ok(project) => project,
        Err(refused) => return *refused,
    };
    if let Some(model) = model_action.strip_suffix(":batchGenerateContent") {
        return super::gemini_batch::create(inner, project, model, body).await;
    }
    answer(&p, in_flight, project, &model_action, &query, body).await
}

/// The project of the caller's API key (`x-goog-api-key`, or `?key=`), or the error
/// Google answers (boxed: a response is large).
pub(super) fn authenticate(
    inner: &Inner,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
) -> Result<usize, Box<Response>> {
    let reply = Reply { inner };
    let key = headers
        .get("x-goog-api-key")
        .and_then(|v| v.to_str().ok())
        .or(query.get("key").map(String::as_str))
        .map(str::trim)
        .filter(|k| !k.is_empty());
    let Some(key) = key else {
        return Err(Box::new(reply.unauthorized(
            StatusCode::FORBIDDEN,
            "PERMISSION_DENIED",
            "Method doesn't allow unregistered callers (callers without established identity). Please use API Key or other form of API consumer identity to call this API.",
            None,
        )));
    };
    match inner.lookup(ProviderKind::Gemini, key) {
        KeyLookup::Valid(idx) => Ok(idx),
        KeyLookup::Revoked => Err(Box::new(reply.unauthorized(
            StatusCode::FORBIDDEN,
            "PERMISSION_DENIED",
            "Permission denied: Consumer 'api_key' has been suspended.",
            Some("CONSUMER_SUSPENDED"),
        ))),
        KeyLookup::Unknown => Err(Box::new(reply.unauthorized(
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "API key not valid. Please pass a valid API key.",
            Some("API_KEY_INVALID"),
        ))),
    }
}

/// A `google.rpc.Status` error answer (Vertex AI's too).
pub(super) fn error(inner: &Inner, status: StatusCode, name: &str, message: &str) -> Response {
    Reply { inner }.error(status, name, message, Vec::new())
}

/// What follows the caller's authentication — the method, the body, the model, faults,
/// the limits, the answer — for `project`: the Gemini API's and Vertex AI's Gemini models'.
pub(super) async fn answer(
    p: &MockProvider,
    in_flight: super::stats::InFlight<'_>,
    project: usize,
    model_action: &str,
    query: &HashMap<String, String>,
    body: Body,
) -> Response {
    let inner = &*p.inner;
    let reply = Reply { inner };
    let (model, action) = model_action.split_once(':').unwrap_or((model_action, ""));
    let streamed = match action {
        "generateContent" => false,
        "streamGenerateContent" => true,
        _ => {
            super::stats::bump(&inner.totals.not_found);
            let msg = format!("The mock serves :generateContent and :streamGenerateContent, not {action:?}.");
            return reply.error(StatusCode::NOT_FOUND, "NOT_FOUND", &msg, Vec::new());
        }
    };
    if streamed && query.get("alt").map(String::as_str) != Some("sse") {
        return reply.bad_request("The mock streams with `alt=sse` only (server-sent events).");
    }
    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        return reply.bad_request("The request body could not be read.");
    };
    let Checked { input, max_out, call } = match serde_json::from_slice(&bytes)
        .map_err(|e| format!("Invalid JSON payload received. {e}"))
        .and_then(|raw| check(&raw))
    {
        Ok(checked) => checked,
        Err(message) => return reply.bad_request(&message),
    };
    if !inner.model_allowed(project, model) {
        super::stats::bump(&inner.totals.not_found);
        let msg = format!(
            "models/{model} is not found for API version v1beta, or is not supported for generateContent. Call ListModels to see the list of available models and their supported methods."
        );
        return reply.error(StatusCode::NOT_FOUND, "NOT_FOUND", &msg, Vec::new());
    }
    if let Some(status) = inner.fault(project) {
        let (name, msg) = match status.as_u16() {
            500 => (
                "INTERNAL",
                "An internal error has occurred. Please retry or report in https://developers.generativeai.google/guide/troubleshooting",
            ),
            _ => ("UNAVAILABLE", "The model is overloaded. Please try again later."),
        };
        return reply.error(status, name, msg, Vec::new());
    }

    let reserved = max_out.unwrap_or(inner.output_tokens);
    let output = inner.completion_tokens(max_out);
    let charge = Charge {
        tokens: input.saturating_add(reserved),
        input,
        output: reserved,
    };
    let view = match inner.admit(project, charge, input, output) {
        Admission::Admitted(view) => view,
        Admission::Denied(denial, _) => return reply.rate_limited(model, &denial),
    };
    let finish_reason = finish_reason(inner, output);
    if streamed {
        super::stats::bump(&inner.totals.succeeded);
        in_flight.hand_over();
        let otpm_reserved = if view.otpm.is_some() { reserved } else { 0 };
        let guard = StreamGuard::new(p.clone(), project, output, otpm_reserved);
        let shape = Shape::Gemini {
            id: hex_id(22),
            model: model.to_owned(),
            finish_reason,
            input,
            call,
        };
        return reply.stream(stream::body(guard, shape), &view);
    }
    let refund = inner.generate(project, &view, reserved, output).await;
    let body = response(inner, model, input, output, call);
    super::stats::bump(&inner.totals.succeeded);
    let response = reply.json(StatusCode::OK, &body, None);
    drop(refund);
    response
}

/// What the mock reads of a valid `GenerateContentRequest`.
struct Checked {
    input: u64,
    max_out: Option<u64>,
    call: Option<Value>,
}

/// A `GenerateContentRequest` checked as Google checks it: its input tokens, output cap
/// and the function call the answer makes; else the message of its 400.
fn check(raw: &Value) -> Result<Checked, String> {
    let req = GenerateContentRequest::deserialize(raw)
        .map_err(|e| format!("Invalid JSON payload received. {e}"))?;
    let call = function_call(raw)?;
    let contents = req.contents.unwrap_or_default();
    if contents.is_empty() {
        return Err("* GenerateContentRequest.contents: contents is not specified\n".to_owned());
    }
    let max_out = req.generation_config.and_then(|c| c.max_output_tokens);
    if max_out == Some(0) {
        return Err(
            "* GenerateContentRequest.generation_config.max_output_tokens: must be positive\n".to_owned(),
        );
    }
    let messages = MessagesTokens {
        count: contents.len() as u64,
        tokens: contents.iter().map(|c| message_tokens(c.parts.0)).sum(),
        ..MessagesTokens::default()
    };
    let input = input_tokens(&messages, req.system_instruction.as_ref().map(|s| &s.parts));
    Ok(Checked { input, max_out, call })
}

fn finish_reason(inner: &Inner, output: u64) -> &'static str {
    if output < inner.output_tokens {
        "MAX_TOKENS"
    } else {
        "STOP"
    }
}

/// A `GenerateContentResponse` of `output` tokens (or the function call) to `input`.
fn response(inner: &Inner, model: &str, input: u64, output: u64, call: Option<Value>) -> Value {
    let part = match call {
        Some(call) => json!({"functionCall": call}),
        None => json!({"text": inner.text.words(output)}),
    };
    json!({
        "candidates": [{
            "content": {"parts": [part], "role": "model"},
            "finishReason": finish_reason(inner, output),
            "index": 0,
        }],
        "usageMetadata": {
            "promptTokenCount": input,
            "candidatesTokenCount": output,
            "totalTokenCount": input + output,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": input}],
        },
        "modelVersion": model,
        "responseId": hex_id(22),
    })
}

/// The answer a batch line (`request` for `model`) gets: the online answer, without the
/// online limits (Batch Mode has its own); else the message of its 400.
pub(super) fn batch_answer(inner: &Inner, model: &str, request: &Value) -> Result<Value, String> {
    let checked = check(request)?;
    let output = inner.completion_tokens(checked.max_out);
    Ok(response(inner, model, checked.input, output, checked.call))
}

/// The parts of a content holding `key` (`functionCall`, `functionResponse`).
fn parts_with(content: &Value, key: &str) -> usize {
    content
        .get("parts")
        .and_then(Value::as_array)
        .map_or(0, |parts| parts.iter().filter(|p| p.get(key).is_some()).count())
}

/// Checks the request's function turns as Gemini does — a turn of function responses
/// right after the model's turn of calls, one response per call — and decides whether the
/// mock calls a function instead of answering in text: when the request declares
/// functions, its `toolConfig` does not say `NONE`, and its last turn answers no call. It
/// calls the one `allowedFunctionNames` names (or the first declared) with `"mock"` for
/// each property of its parameters.
fn function_call(body: &Value) -> Result<Option<Value>, String> {
    let contents = body
        .get("contents")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for (i, content) in contents.iter().enumerate() {
        let answers = parts_with(content, "functionResponse");
        if answers == 0 {
            continue;
        }
        let calls = i
            .checked_sub(1)
            .map_or(0, |before| parts_with(&contents[before], "functionCall"));
        if calls == 0 {
            return Err(
                "Please ensure that function response turn comes immediately after a function call turn."
                    .to_owned(),
            );
        }
        if calls != answers {
            return Err("Please ensure that the number of function response parts is equal to the number of function call parts of the function call turn.".to_owned());
        }
    }
    let declarations: Vec<&Value> = body
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t.get("functionDeclarations").and_then(Value::as_array))
        .flatten()
        .collect();
    let config = body.pointer("/toolConfig/functionCallingConfig");
    let answered = contents
        .last()
        .is_some_and(|c| parts_with(c, "functionResponse") > 0);
    if declarations.is_empty() || answered || config.and_then(|c| c.get("mode")) == Some(&json!("NONE")) {
        return Ok(None);
    }
    let allowed = config
        .and_then(|c| c.pointer("/allowedFunctionNames/0"))
        .and_then(Value::as_str);
    let chosen = declarations
        .iter()
        .find(|d| allowed.is_none_or(|name| d.get("name").and_then(Value::as_str) == Some(name)))
        .ok_or_else(|| format!("allowedFunctionNames names no declared function: {allowed:?}"))?;
    let schema = ["parametersJsonSchema", "parameters"]
        .iter()
        .find_map(|k| chosen.get(*k));
    let args = super::request::mock_object(schema);
    Ok(Some(json!({"name": chosen.get("name"), "args": args})))
}

impl Respond for Reply<'_> {
    /// Google sends no rate-limit or request-id headers; `view` is ignored.
    fn respond(
        &self,
        status: StatusCode,
        body: Body,
        content_type: &'static str,
        _view: Option<&LimitsView>,
    ) -> Response {
        let mut resp = super::reply::base(status, body, content_type);
        let h = resp.headers_mut();
        h.insert("server", HeaderValue::from_static("scaffolding on HTTPServer2"));
        resp
    }
}

impl Reply<'_> {
    /// A `google.rpc.Status` error body.
    fn error(&self, status: StatusCode, name: &str, message: &str, details: Vec<Value>) -> Response {
        let mut error = json!({"code": status.as_u16(), "message": message, "status": name});
        if !details.is_empty() {
            error["details"] = Value::Array(details);
        }
        self.json(status, &json!({"error": error}), None)
    }

    fn unauthorized(&self, status: StatusCode, name: &str, message: &str, reason: Option<&str>) -> Response {
        super::stats::bump(&self.inner.totals.unauthorized);
        let details = reason
            .map(|r| {
                vec![json!({
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": r,
                    "domain": "googleapis.com",
                    "metadata": {"service": "generativelanguage.googleapis.com"},
                })]
            })
            .unwrap_or_default();
        self.error(status, name, message, details)
    }

    fn bad_request(&self, message: &str) -> Response {
        super::stats::bump(&self.inner.totals.bad_request);
        self.error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", message, Vec::new())
    }

    fn rate_limited(&self, model: &str, d: &Denial) -> Response {
        let (metric, quota_id) = quota(d.kind);
        let metric = format!("generativelanguage.googleapis.com/{metric}");
        let wait = d.wait_ns as f64 / 1e9;
        let mut message = format!(
            "You exceeded your current quota, please check your plan and billing details. For more information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.\n* Quota exceeded for metric: {metric}, limit: {}, model: {model}",
            d.limit
        );
        let mut details = vec![
            json!({
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [{
                    "quotaMetric": metric,
                    "quotaId": quota_id,
                    "quotaDimensions": {"location": "global", "model": model},
                    "quotaValue": d.limit.to_string(),
                }],
            }),
            json!({
                "@type": "type.googleapis.com/google.rpc.Help",
                "links": [{"description": "Learn more about Gemini API quotas", "url": "https://ai.google.dev/gemini-api/docs/rate-limits"}],
            }),
        ];
        if !d.too_large {
            message.push_str(&format!("\nPlease retry in {wait}s."));
            details.push(json!({
                "@type": "type.googleapis.com/google.rpc.RetryInfo",
                "retryDelay": format!("{}s", ceil_secs(d.wait_ns)),
            }));
        }
        self.error(
            StatusCode::TOO_MANY_REQUESTS,
            "RESOURCE_EXHAUSTED",
            &message,
            details,
        )
    }
}

/// The quota metric and id Google names for a limit. Gemini's token quotas count input
/// tokens; the mock's TPM and ITPM both stand for that one.
fn quota(kind: LimitKind) -> (&'static str, &'static str) {
    match kind {
        LimitKind::Rpm => (
            "generate_requests_per_model",
            "GenerateRequestsPerMinutePerProjectPerModel",
        ),
        LimitKind::Rpd => (
            "generate_requests_per_model_per_day",
            "GenerateRequestsPerDayPerProjectPerModel",
        ),
        LimitKind::Tpm | LimitKind::Itpm => (
            "generate_content_input_token_count",
            "GenerateContentInputTokensPerModelPerMinute",
        ),
        LimitKind::Otpm => (
            "generate_content_output_token_count",
            "GenerateContentOutputTokensPerModelPerMinute",
        ),
    }
}
