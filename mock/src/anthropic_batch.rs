//! Anthropic's Message Batches API (`docs/PROVIDERS.md` §2.5): `POST /v1/messages/batches`
//! (inline `requests`), `GET /v1/messages/batches/{id}`, `GET .../results` (JSONL, once
//! ended), `POST .../cancel`. `x-api-key` and `anthropic-version` as on the online
//! endpoint; a project sees only its own batches.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat};
use serde_json::{Value, json};

use super::batch_state::{BatchApi, Fate, Line, MockBatch};
use super::config::ProviderKind;
use super::{Inner, KeyLookup, MockProvider, uuid_v7};

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        Json(json!({"type": "error", "error": {"type": kind, "message": message}})),
    )
        .into_response()
}

/// The request's project, or the error to answer (boxed: a response is large).
fn project(inner: &Inner, headers: &HeaderMap) -> Result<usize, Box<Response>> {
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty());
    let Some(key) = key else {
        return Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "x-api-key header is required",
        )));
    };
    let KeyLookup::Valid(p) = inner.lookup(ProviderKind::Anthropic, key) else {
        return Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid x-api-key",
        )));
    };
    if !headers.contains_key("anthropic-version") {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "anthropic-version: header is required",
        )));
    }
    Ok(p)
}

pub(super) async fn create_batch(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let inner = &*p.inner;
    let project = match project(inner, &headers) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let Some(requests) = body
        .get("requests")
        .and_then(Value::as_array)
        .filter(|r| !r.is_empty())
    else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "requests: Field required",
        );
    };
    let mut lines = Vec::with_capacity(requests.len());
    let mut seen = std::collections::HashSet::new();
    for (i, r) in requests.iter().enumerate() {
        let custom_id = r.get("custom_id").and_then(Value::as_str).unwrap_or_default();
        let params = r.get("params").filter(|p| {
            p.get("model").and_then(Value::as_str).is_some()
                && p.get("max_tokens")
                    .and_then(Value::as_u64)
                    .is_some_and(|m| m >= 1)
        });
        let Some(params) = params.filter(|_| !custom_id.is_empty() && seen.insert(custom_id.to_owned()))
        else {
            let msg = format!(
                "requests.{i}: custom_id (unique) and params with model and max_tokens >= 1 required"
            );
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", &msg);
        };
        lines.push(Line {
            custom_id: custom_id.to_owned(),
            body: params.clone(),
        });
    }
    let id = format!("msgbatch_01{}", uuid_v7(inner).simple());
    let mut state = inner.batch_state();
    state.batches.insert(
        id.clone(),
        MockBatch {
            kind: ProviderKind::Anthropic,
            project,
            input_file_id: None,
            endpoint: "/v1/messages".to_owned(),
            metadata: Value::Null,
            lines,
            created_ns: inner.clock.now_ns(),
            cancel_ns: None,
            ended: None,
        },
    );
    state.advance(inner, &id);
    Json(batch_object(inner, &id, &state.batches[&id])).into_response()
}

/// This API's batch routes (`batch_state::get_batch`, `batch_state::cancel_batch`).
pub(super) struct Anthropic;

impl BatchApi for Anthropic {
    const KIND: ProviderKind = ProviderKind::Anthropic;

    fn project(inner: &Inner, headers: &HeaderMap) -> Result<usize, Box<Response>> {
        project(inner, headers)
    }

    fn not_found(id: &str) -> Response {
        error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            &format!("batch {id} not found"),
        )
    }

    fn object(inner: &Inner, id: &str, b: &MockBatch) -> Value {
        batch_object(inner, id, b)
    }
}

/// The results as JSONL, in no particular order (here: reversed, so clients join on
/// `custom_id`); 400 until the batch has ended.
pub(super) async fn results(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let inner = &*p.inner;
    let project = match project(inner, &headers) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let mut state = inner.batch_state();
    let Some(b) = state.touch(inner, &id, project, ProviderKind::Anthropic, false) else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            &format!("batch {id} not found"),
        );
    };
    let Some(ended) = &b.ended else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the batch is still processing; results are available once it has ended",
        );
    };
    let mut out = Vec::new();
    for (line, fate) in b.lines.iter().zip(&ended.fates).rev() {
        let result = match fate {
            Fate::Succeeded(message) => json!({"type": "succeeded", "message": message}),
            Fate::Errored => json!({"type": "errored", "error": {"type": "error",
                "error": {"type": "api_error", "message": "Internal server error"}}}),
            Fate::Invalid(message) => json!({"type": "errored", "error": {"type": "error",
                "error": {"type": "invalid_request_error", "message": message}}}),
            Fate::Expired => json!({"type": "expired"}),
            Fate::Canceled => json!({"type": "canceled"}),
        };
        out.extend_from_slice(
            json!({"custom_id": line.custom_id, "result": result})
                .to_string()
                .as_bytes(),
        );
        out.push(b'\n');
    }
    ([("content-type", "application/binary")], out).into_response()
}

fn batch_object(inner: &Inner, id: &str, b: &MockBatch) -> Value {
    let stamp = |ns: u64| {
        let secs = i64::try_from(inner.clock.unix_ns_at(ns).div_euclid(1_000_000_000)).unwrap_or(0);
        DateTime::from_timestamp(secs, 0).map(|t| t.to_rfc3339_opts(SecondsFormat::Secs, true))
    };
    let (succeeded, errored, expired, canceled) = b.counts();
    let processing = if b.ended.is_some() { 0 } else { b.lines.len() };
    let status = match (&b.ended, b.cancel_ns) {
        (Some(_), _) => "ended",
        (None, Some(_)) => "canceling",
        (None, None) => "in_progress",
    };
    let created = stamp(b.created_ns);
    let expires = stamp(b.created_ns.saturating_add(86_400_000_000_000));
    json!({
        "id": id, "type": "message_batch", "processing_status": status,
        "request_counts": {"processing": processing, "succeeded": succeeded, "errored": errored,
                           "canceled": canceled, "expired": expired},
        "created_at": created, "expires_at": expires,
        "ended_at": b.ended.as_ref().and_then(|e| stamp(e.at_ns)),
        "cancel_initiated_at": b.cancel_ns.and_then(stamp), "archived_at": null,
        "results_url": b.ended.as_ref().map(|_| format!("/v1/messages/batches/{id}/results")),
    })
}
