//! `POST /v1/messages` in Anthropic's shape (`docs/PROVIDERS.md` §2.1, §2.2, §2.4): `x-api-key`
//! and a required `anthropic-version`, `anthropic-ratelimit-*` headers whose resets are
//! absolute RFC 3339 stamps, `{"type":"error","error":{type,message},"request_id"}`
//! bodies, `rate_limit_error` 429s with `retry-after`, and `overloaded_error` 529s.
//!
//! Header families: `requests` = RPM (or RPD when there is no RPM), `input-tokens` =
//! ITPM, `output-tokens` = OTPM, `tokens` = TPM, or when there is no TPM the sum of
//! ITPM and OTPM (reset = the later of the two). Absent limits send no headers.
//! A request larger than a token limit's capacity gets a 429 without `retry-after`
//! (retrying cannot help).

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use chrono::{DateTime, SecondsFormat};
use serde::Serialize;

use super::buckets::{Admission, BucketView, Charge, Denial, LimitKind, LimitsView};
use super::reply::Respond;
use super::request::{MessagesRequest, input_tokens};
use super::stream::{self, Shape, StreamGuard};
use super::{Inner, KeyLookup, MAX_BODY_BYTES, MockProvider, ProviderKind, ceil_secs, hex_id};

#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: ErrorDetail<'a>,
    request_id: &'a str,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: &'a str,
}

#[derive(Serialize)]
pub(super) struct Message<'a> {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: [TextBlock<'a>; 1],
    stop_reason: &'static str,
    stop_sequence: Option<()>,
    usage: Usage,
}

#[derive(Serialize)]
struct TextBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

#[derive(Serialize)]
struct Usage {
    input_tokens: u64,
    output_tokens: u64,
}

struct Reply<'a> {
    inner: &'a Inner,
    request_id: String,
    project: Option<usize>,
    /// The model, when the call came through Vertex AI: its quota front answers 429s in
    /// Google's shape, and no Anthropic rate-limit headers come back.
    vertex_model: Option<&'a str>,
}

pub(super) async fn messages(State(p): State<MockProvider>, req: Request) -> Response {
    let inner = &*p.inner;
    let in_flight = inner.totals.begin();
    let mut reply = Reply {
        inner,
        request_id: format!("req_011C{}", hex_id(20)),
        project: None,
        vertex_model: None,
    };
    let (parts, body) = req.into_parts();

    let key = parts
        .headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty());
    let Some(key) = key else {
        return reply.unauthorized("x-api-key header is required");
    };
    let project = match inner.lookup(ProviderKind::Anthropic, key) {
        KeyLookup::Valid(idx) => idx,
        KeyLookup::Revoked | KeyLookup::Unknown => return reply.unauthorized("invalid x-api-key"),
    };
    reply.project = Some(project);
    if !parts.headers.contains_key("anthropic-version") {
        return reply.bad_request("anthropic-version: header is required");
    }

    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        return reply.bad_request("The request body could not be read.");
    };
    answer(&p, in_flight, reply, project, &bytes, None).await
}

/// Claude on Vertex AI (`rawPredict`, `streamRawPredict`), for a caller Vertex
/// authenticated: Anthropic's body without `model` (it is in the URL) and with
/// `anthropic_version: "vertex-2023-10-16"` instead of the header.
pub(super) async fn vertex(
    p: &MockProvider,
    in_flight: super::stats::InFlight<'_>,
    project: usize,
    model: &str,
    body: Body,
) -> Response {
    let inner = &*p.inner;
    let reply = Reply {
        inner,
        request_id: format!("req_vrtx_011C{}", hex_id(20)),
        project: Some(project),
        vertex_model: Some(model),
    };
    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        return reply.bad_request("The request body could not be read.");
    };
    let raw: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    if raw.get("anthropic_version").and_then(serde_json::Value::as_str) != Some("vertex-2023-10-16") {
        return reply.bad_request("anthropic_version: Input should be 'vertex-2023-10-16'");
    }
    if raw.get("model").is_some() {
        return reply.bad_request("model: Extra inputs are not permitted");
    }
    answer(p, in_flight, reply, project, &bytes, Some(model)).await
}

/// What follows the caller's authentication: the body, the model (the body's, or the
/// URL's on Vertex), faults, the limits, the answer.
async fn answer(
    p: &MockProvider,
    in_flight: super::stats::InFlight<'_>,
    reply: Reply<'_>,
    project: usize,
    bytes: &[u8],
    model_in_url: Option<&str>,
) -> Response {
    let inner = &*p.inner;
    let req: MessagesRequest = match serde_json::from_slice(bytes) {
        Ok(r) => r,
        Err(e) if e.is_syntax() || e.is_eof() => {
            return reply.bad_request("There was an error parsing the body of your request: invalid JSON.");
        }
        Err(e) => return reply.bad_request(&format!("Invalid request body: {e}")),
    };
    let Some(model) = model_in_url.or(req.model.as_deref()).filter(|m| !m.is_empty()) else {
        return reply.bad_request("model: Field required");
    };
    let Some(messages) = req.messages else {
        return reply.bad_request("messages: Field required");
    };
    if messages.count == 0 {
        return reply.bad_request("messages: at least one message is required");
    }
    let Some(max_tokens) = req.max_tokens else {
        return reply.bad_request("max_tokens: Field required");
    };
    let tool_call = match serde_json::from_slice(bytes)
        .map_err(|e| e.to_string())
        .and_then(|b| tool_turn(&b))
    {
        Ok(call) => call,
        Err(message) => return reply.bad_request(&message),
    };
    if max_tokens == 0 {
        return reply.bad_request("max_tokens: Input should be greater than or equal to 1");
    }
    if !inner.model_allowed(project, model) {
        let msg = format!("model: {model}");
        let view = inner.view(project);
        super::stats::bump(&inner.totals.not_found);
        return reply.error(StatusCode::NOT_FOUND, "not_found_error", &msg, Some(&view));
    }
    let injected = inner.fault_or_inject(project);
    if let Some(status) = injected.status {
        let (kind, msg) = match status.as_u16() {
            529 => ("overloaded_error", "Overloaded"),
            500 => ("api_error", "Internal server error"),
            _ => ("api_error", "Service unavailable"),
        };
        let view = inner.view(project);
        return reply.error(status, kind, msg, Some(&view));
    }
    if let Some(resp) = super::faults::before(inner, injected.fault).await {
        return resp;
    }

    let input = input_tokens(&messages, req.system.as_ref());
    let output = inner.completion_tokens(Some(max_tokens));
    let charge = Charge {
        tokens: input.saturating_add(max_tokens),
        input,
        output: max_tokens,
    };
    let view = match inner.admit(project, charge, input, output) {
        Admission::Admitted(view) => view,
        Admission::Denied(denial, view) => return reply.rate_limited(&denial, &view),
    };
    let stop_reason = if output < inner.output_tokens {
        "max_tokens"
    } else {
        "end_turn"
    };
    let id = format!("msg_01{}", super::uuid_v7(inner).simple());
    if let Some(call) = tool_call {
        let output = call.tokens().min(max_tokens);
        let refund = inner.generate(project, &view, max_tokens, output).await;
        super::stats::bump(&inner.totals.succeeded);
        let resp = if req.stream == Some(true) {
            reply.stream(Body::from(call.events(&id, model, input, output)), &view)
        } else {
            reply.json(
                StatusCode::OK,
                &call.message(&id, model, input, output),
                Some(&view),
            )
        };
        drop(refund);
        return super::faults::after(injected.fault, resp).await;
    }
    if req.stream == Some(true) {
        super::stats::bump(&inner.totals.succeeded);
        in_flight.hand_over();
        let otpm_reserved = if view.otpm.is_some() { max_tokens } else { 0 };
        let guard = StreamGuard::new(p.clone(), project, output, otpm_reserved);
        let shape = Shape::Anthropic {
            id,
            model: model.to_owned(),
            stop_reason,
            input,
        };
        // The headers show OTPM as reserved at admission; it is corrected when the
        // stream ends, as the real API does.
        return reply.stream(stream::body(guard, shape), &view);
    }
    let refund = inner.generate(project, &view, max_tokens, output).await;

    let message = message(inner, id, model, input, output, stop_reason);
    super::stats::bump(&inner.totals.succeeded);
    // Correct OTPM before reporting it, as the real API does at the end of a response.
    drop(refund);
    let view = if view.otpm.is_some() {
        inner.view(project)
    } else {
        view
    };
    let resp = reply.json(StatusCode::OK, &message, Some(&view));
    super::faults::after(injected.fault, resp).await
}

/// A tool the mock calls instead of answering in text: its `tool_use` block.
pub(super) struct ToolCall {
    id: String,
    name: String,
    input: serde_json::Value,
}

/// Checks the request's tool turns as the Messages API does — every `tool_use` of an
/// assistant turn answered by a `tool_result` in the next turn, every `tool_result`
/// answering a `tool_use` of the turn before — and decides whether the mock calls a tool:
/// when the request has `tools`, its `tool_choice` is not `none`, and its last turn holds
/// no `tool_result`. It calls the chosen tool (or the first) with `"mock"` for each of the
/// schema's properties.
fn tool_turn(body: &serde_json::Value) -> Result<Option<ToolCall>, String> {
    use serde_json::Value;
    let blocks = |m: &Value, kind: &str, id_field: &str| -> Vec<String> {
        m.get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some(kind))
            .filter_map(|b| b.get(id_field).and_then(Value::as_str).map(str::to_owned))
            .collect()
    };
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut asked: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let answered = blocks(m, "tool_result", "tool_use_id");
        if let Some(id) = answered.iter().find(|id| !asked.contains(id)) {
            return Err(format!(
                "messages.{i}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
            ));
        }
        if let Some(id) = asked.iter().find(|id| !answered.contains(id)) {
            return Err(format!(
                "messages.{}: `tool_use` ids were found without `tool_result` blocks immediately after: {id}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                i.saturating_sub(1)
            ));
        }
        asked = blocks(m, "tool_use", "id");
    }
    if let Some(id) = asked.first() {
        return Err(format!(
            "messages.{}: `tool_use` ids were found without `tool_result` blocks immediately after: {id}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
            messages.len() - 1
        ));
    }
    let tools = body
        .get("tools")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let choice = body.get("tool_choice");
    let answered_last = messages
        .last()
        .is_some_and(|m| !blocks(m, "tool_result", "tool_use_id").is_empty());
    if tools.is_empty() || answered_last || choice.and_then(|c| c.get("type")) == Some(&Value::from("none")) {
        return Ok(None);
    }
    let chosen = choice.and_then(|c| c.get("name")).and_then(Value::as_str);
    let tool = tools
        .iter()
        .find(|t| chosen.is_none_or(|name| t.get("name").and_then(Value::as_str) == Some(name)))
        .ok_or_else(|| format!("tool_choice.name: tool {chosen:?} is not in `tools`"))?;
    let input = super::request::mock_object(tool.get("input_schema"));
    Ok(Some(ToolCall {
        id: format!("toolu_01{}", hex_id(22)),
        name: tool
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        input,
    }))
}

impl ToolCall {
    /// Output tokens of the call: a token per started four characters of its input's JSON.
    fn tokens(&self) -> u64 {
        (self.input.to_string().chars().count() as u64).div_ceil(4).max(1)
    }

    fn block(&self) -> serde_json::Value {
        serde_json::json!({"type": "tool_use", "id": self.id, "name": self.name, "input": self.input})
    }

    fn message(&self, id: &str, model: &str, input: u64, output: u64) -> serde_json::Value {
        serde_json::json!({"id": id, "type": "message", "role": "assistant", "model": model,
            "content": [self.block()], "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": input, "output_tokens": output}})
    }

    /// The call as the Messages stream sends it: the block started with an empty input,
    /// its JSON in two `input_json_delta`s, then the message's end.
    fn events(&self, id: &str, model: &str, input: u64, output: u64) -> String {
        let json = self.input.to_string();
        let half = json
            .char_indices()
            .nth(json.chars().count() / 2)
            .map_or(json.len(), |(i, _)| i);
        let mut start = self.block();
        start["input"] = serde_json::json!({});
        let events = [
            (
                "message_start",
                serde_json::json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": input, "output_tokens": 1}}}),
            ),
            (
                "content_block_start",
                serde_json::json!({"type": "content_block_start", "index": 0, "content_block": start}),
            ),
            (
                "content_block_delta",
                serde_json::json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": &json[..half]}}),
            ),
            (
                "content_block_delta",
                serde_json::json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": &json[half..]}}),
            ),
            (
                "content_block_stop",
                serde_json::json!({"type": "content_block_stop", "index": 0}),
            ),
            (
                "message_delta",
                serde_json::json!({"type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": output}}),
            ),
            ("message_stop", serde_json::json!({"type": "message_stop"})),
        ];
        events
            .iter()
            .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
            .collect()
    }
}

/// The Messages reply to an admitted request: `output` canned words (also a batch line's).
pub(super) fn message<'a>(
    inner: &'a Inner,
    id: String,
    model: &'a str,
    input: u64,
    output: u64,
    stop_reason: &'static str,
) -> Message<'a> {
    Message {
        id,
        kind: "message",
        role: "assistant",
        model,
        content: [TextBlock {
            kind: "text",
            text: inner.text.words(output),
        }],
        stop_reason,
        stop_sequence: None,
        usage: Usage {
            input_tokens: input,
            output_tokens: output,
        },
    }
}

impl Respond for Reply<'_> {
    fn respond(
        &self,
        status: StatusCode,
        body: Body,
        content_type: &'static str,
        view: Option<&LimitsView>,
    ) -> Response {
        let mut resp = super::reply::base(status, body, content_type);
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&self.request_id) {
            h.insert("request-id", v);
        }
        if let Some(org) = self.project.and_then(|p| self.inner.projects[p].org.clone()) {
            h.insert("anthropic-organization-id", org);
        }
        if let Some(view) = view.filter(|_| self.inner.send_rate_limit_headers && self.vertex_model.is_none())
        {
            rate_limit_headers(h, view);
        }
        resp
    }
}

impl Reply<'_> {
    fn error(&self, status: StatusCode, kind: &str, message: &str, view: Option<&LimitsView>) -> Response {
        let body = ErrorBody {
            kind: "error",
            error: ErrorDetail { kind, message },
            request_id: &self.request_id,
        };
        self.json(status, &body, view)
    }

    fn unauthorized(&self, message: &str) -> Response {
        super::stats::bump(&self.inner.totals.unauthorized);
        self.error(StatusCode::UNAUTHORIZED, "authentication_error", message, None)
    }

    fn bad_request(&self, message: &str) -> Response {
        super::stats::bump(&self.inner.totals.bad_request);
        let view = self.project.map(|p| self.inner.view(p));
        self.error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            message,
            view.as_ref(),
        )
    }

    fn rate_limited(&self, d: &Denial, view: &LimitsView) -> Response {
        if let Some(model) = self.vertex_model {
            return vertex_quota_exceeded(self.inner, model, d.kind);
        }
        let org = self.project.map_or("", |p| self.inner.projects[p].name.as_str());
        let what = match d.kind {
            LimitKind::Rpm => "requests per minute",
            LimitKind::Rpd => "requests per day",
            LimitKind::Tpm => "tokens per minute",
            LimitKind::Itpm => "input tokens per minute",
            LimitKind::Otpm => "output tokens per minute",
        };
        let message = if d.too_large {
            format!(
                "This request would exceed the rate limit for your organization (org-{org}) of {} {what} on its own: it needs {}. Please reduce the prompt length or the maximum tokens requested; retrying will not help.",
                thousands(d.limit),
                thousands(d.requested)
            )
        } else {
            format!(
                "This request would exceed the rate limit for your organization (org-{org}) of {} {what}. For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for current usage. Please reduce the prompt length or the maximum tokens requested, or try again later. You may also contact sales at https://www.anthropic.com/contact-sales to discuss your options for a rate limit increase.",
                thousands(d.limit)
            )
        };
        let mut resp = self.error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            &message,
            Some(view),
        );
        if self.inner.send_rate_limit_headers && !d.too_large {
            resp.headers_mut()
                .insert("retry-after", HeaderValue::from(ceil_secs(d.wait_ns)));
        }
        resp
    }
}

/// Vertex AI's 429 for a Claude model over its project's quota: a `google.rpc.Status`
/// naming the quota metric and the base model (dialect `gemini` reads it).
fn vertex_quota_exceeded(inner: &Inner, model: &str, kind: LimitKind) -> Response {
    let metric = match kind {
        LimitKind::Rpm | LimitKind::Rpd => "online_prediction_requests_per_base_model",
        LimitKind::Tpm | LimitKind::Itpm => "online_prediction_input_tokens_per_minute_per_base_model",
        LimitKind::Otpm => "online_prediction_output_tokens_per_minute_per_base_model",
    };
    let base = model.split('@').next().unwrap_or(model);
    let message = format!(
        "Quota exceeded for aiplatform.googleapis.com/{metric} with base model: anthropic-{base}. Please submit a quota increase request. https://cloud.google.com/vertex-ai/docs/generative-ai/quotas-genai."
    );
    super::gemini::error(
        inner,
        StatusCode::TOO_MANY_REQUESTS,
        "RESOURCE_EXHAUSTED",
        &message,
    )
}

fn rate_limit_headers(h: &mut HeaderMap, view: &LimitsView) {
    let stamp = |b: &BucketView| rfc3339_after(view.unix_ns, b.reset_ns);
    let mut put = |names: [&'static str; 3], limit: u64, remaining: u64, reset: Option<String>| {
        h.insert(HeaderName::from_static(names[0]), HeaderValue::from(limit));
        h.insert(HeaderName::from_static(names[1]), HeaderValue::from(remaining));
        if let Some(v) = reset.and_then(|r| HeaderValue::from_str(&r).ok()) {
            h.insert(HeaderName::from_static(names[2]), v);
        }
    };
    if let Some(b) = view.rpm.as_ref().or(view.rpd.as_ref()) {
        put(
            [
                "anthropic-ratelimit-requests-limit",
                "anthropic-ratelimit-requests-remaining",
                "anthropic-ratelimit-requests-reset",
            ],
            b.limit,
            b.remaining,
            stamp(b),
        );
    }
    if let Some(b) = &view.itpm {
        put(
            [
                "anthropic-ratelimit-input-tokens-limit",
                "anthropic-ratelimit-input-tokens-remaining",
                "anthropic-ratelimit-input-tokens-reset",
            ],
            b.limit,
            b.remaining,
            stamp(b),
        );
    }
    if let Some(b) = &view.otpm {
        put(
            [
                "anthropic-ratelimit-output-tokens-limit",
                "anthropic-ratelimit-output-tokens-remaining",
                "anthropic-ratelimit-output-tokens-reset",
            ],
            b.limit,
            b.remaining,
            stamp(b),
        );
    }
    let combined = match (&view.tpm, &view.itpm, &view.otpm) {
        (Some(t), _, _) => Some(*t),
        (None, None, None) => None,
        (None, i, o) => {
            let parts = [i, o];
            let mut sum = BucketView {
                limit: 0,
                remaining: 0,
                reset_ns: 0,
            };
            for b in parts.into_iter().flatten() {
                sum.limit += b.limit;
                sum.remaining += b.remaining;
                sum.reset_ns = sum.reset_ns.max(b.reset_ns);
            }
            Some(sum)
        }
    };
    if let Some(b) = combined {
        put(
            [
                "anthropic-ratelimit-tokens-limit",
                "anthropic-ratelimit-tokens-remaining",
                "anthropic-ratelimit-tokens-reset",
            ],
            b.limit,
            b.remaining,
            stamp(&b),
        );
    }
}

/// `unix_ns + after_ns`, rounded up to the second, as `2026-02-25T20:02:32Z`.
fn rfc3339_after(unix_ns: i128, after_ns: u64) -> Option<String> {
    let at = unix_ns + i128::from(after_ns);
    let secs = at.div_euclid(1_000_000_000) + i128::from(at.rem_euclid(1_000_000_000) > 0);
    let t = DateTime::from_timestamp(i64::try_from(secs).ok()?, 0)?;
    Some(t.to_rfc3339_opts(SecondsFormat::Secs, true))
}

/// `20000` → `20,000`, as in Anthropic's 429 messages.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    let mut until_comma = match digits.len() % 3 {
        0 => 3,
        n => n,
    };
    for c in digits.chars() {
        if until_comma == 0 {
            out.push(',');
            until_comma = 3;
        }
        out.push(c);
        until_comma -= 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(20_000), "20,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        let t0 = 1_772_049_752_i128 * 1_000_000_000; // 2026-02-25T20:02:32Z
        assert_eq!(rfc3339_after(t0, 0).as_deref(), Some("2026-02-25T20:02:32Z"));
        assert_eq!(rfc3339_after(t0, 1).as_deref(), Some("2026-02-25T20:02:33Z"));
    }
}
