//! Anthropic's Messages API, so that the official `anthropic` SDKs (and every tool built on
//! them) point `base_url` at tollgate and change nothing else: `POST /v1/messages`, queued
//! as an `interactive` job of endpoint `/v1/messages` — admitted against every bucket on
//! its path like any job, reserving its input and `max_tokens` — and awaited; the message
//! comes back as Anthropic sent it. `POST /v1/messages/count_tokens` answers the input
//! tokens tollgate reserves for a request. Keys may come as `x-api-key`, as those SDKs
//! send them, and errors in Anthropic's shape (`{"type": "error", "error": {type,
//! message}}`, with tollgate's `code` and `param` beside them).
//!
//! A Messages request is sent as it is to Anthropic targets, and translated to chat for
//! the others (`tollgate_workers::providers::messages_chat`), their answers translated
//! back. With `stream: true` the job is admitted like any other, then Anthropic's events
//! (or the chat stream's, translated) are relayed as they arrive, named as Anthropic names
//! them.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tollgate::vocab::Endpoint;

use crate::AppState;
use crate::auth::AuthTenant;
use crate::chat::synchronous;
use crate::error::ApiError;
use crate::jobs::json_body;
use crate::openapi as doc;
use crate::queue_updates::QueueUpdates;
use crate::requests;

/// Largest error body rewritten into Anthropic's shape; ours are far smaller.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Anthropic-compatible, synchronous: queued as an `interactive` job and awaited; with
/// `stream: true`, Anthropic's events relayed as they arrive.
#[utoipa::path(
    post,
    path = "/v1/messages",
    operation_id = "create_message",
    tag = "anthropic",
    request_body(content = Object, description = "An Anthropic Messages request"),
    responses(
        (status = 200, description = "The Anthropic message (JSON), or its events (`text/event-stream`) when streaming; header `x-tollgate-job-id`", body = Object),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`, `endpoint_not_served`, `unsupported_field`; or the job's reason code (`provider_rejected_request`, `request_too_large`, `exceeds_limit`)", body = doc::ErrorBody),
        (status = 429, description = "`queue_timeout`, `deadline_exceeded`, `deadline_unmeetable`, `rate_limited`, `spend_limit_reached`, `queue_full` (+ `Retry-After`)", body = doc::ErrorBody),
        (status = 502, description = "`upstream_failed`, `upstream_auth_failed`, `insufficient_quota`", body = doc::ErrorBody),
    ),
    params(("x-tollgate-queue-updates" = Option<bool>, Header, description = "With `stream: true`: start the event stream at once and, while the job waits, send an SSE comment each second with its place, eta and the limit holding it (a refusal then comes as the stream's error event)")),
    security(("bearer" = []))
)]
pub(crate) async fn create(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    QueueUpdates(updates): QueueUpdates,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    synchronous(state, tenant, Endpoint::Messages, json_body(body)?, updates).await
}

/// The input tokens tollgate reserves for a Messages request (`max_tokens` may be left
/// out): an upper bound of what Anthropic counts, by the character rule.
#[utoipa::path(
    post,
    path = "/v1/messages/count_tokens",
    operation_id = "count_message_tokens",
    tag = "anthropic",
    request_body(content = Object, description = "An Anthropic Messages request"),
    responses(
        (status = 200, description = "`{\"input_tokens\": N}`", body = Object),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`, `endpoint_not_served`, `unsupported_field`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn count_tokens(
    State(state): State<AppState>,
    AuthTenant(_): AuthTenant,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut request = json_body(body)?;
    if let Some(obj) = request.as_object_mut() {
        obj.entry("max_tokens").or_insert(json!(1));
    }
    let checked = requests::check(&state.tenants.config(), Endpoint::Messages, &request, "")?;
    Ok(axum::Json(json!({"input_tokens": checked.estimated_input_tokens})).into_response())
}

/// An error's `type` as Anthropic names it for `status`.
pub(crate) fn anthropic_error_type(status: StatusCode) -> &'static str {
    match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_client_error() => "invalid_request_error",
        _ => "api_error",
    }
}

/// Rewrites an error answer of these routes into Anthropic's shape: its `type` by status
/// as Anthropic names them, the message, and tollgate's `code` and `param`.
pub(crate) async fn anthropic_errors(response: Response) -> Response {
    let status = response.status();
    if !status.is_client_error() && !status.is_server_error() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_ERROR_BODY).await else {
        return Response::from_parts(parts, Body::empty());
    };
    let Some(error) = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.get("error").cloned())
    else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    let body = json!({"type": "error", "error": {"type": anthropic_error_type(status), "message": error["message"],
        "code": error["code"], "param": error["param"]}});
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body.to_string()))
}
