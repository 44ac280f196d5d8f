//! Anthropic's Message Batches API, so that the official `anthropic` SDKs batch through
//! tollgate unchanged: `POST /v1/messages/batches`, `GET /v1/messages/batches/{id}`,
//! `GET /v1/messages/batches?after_id=&before_id=&limit=`, `POST …/{id}/cancel`,
//! `DELETE …/{id}` and `GET …/{id}/results`, in Anthropic's shapes (errors too, by
//! [`crate::messages::anthropic_errors`]).
//!
//! A Message Batch is a tollgate batch of endpoint `/v1/messages` whose requests came
//! inline (`input_file_id` is null) and whose id begins `msgbatch_`: created like any batch
//! ([`crate::batches::start`]) — every request's `params` checked as `/v1/messages` checks
//! a request, a bad one kept as an errored result while the rest run (Anthropic validates
//! `params` after creation too), all jobs in the transaction that creates the batch — then
//! admitted, dispatched and ended like any batch of class `batch`. Its results are its
//! output and error files' lines, read back in Anthropic's result shape.

use std::collections::HashSet;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, SubsecRound, Utc};
use serde::Deserialize;
use serde_json::{Value, json};
use tollgate::batches::{BatchRow, Line, LineSplitter, MESSAGE_BATCH_PREFIX, new_message_batch_id};
use tollgate::model::JobClass;
use tollgate::store::{self, BatchControl, Cursor};
use tollgate::vocab::{ApiErrorCode, BatchStatus, Endpoint, ReasonCode};

use crate::AppState;
use crate::auth::AuthTenant;
use crate::batches::{Input, start};
use crate::error::ApiError;
use crate::files::db;
use crate::jobs::json_body;
use crate::openapi as doc;
use crate::paging;

/// How long a Message Batch may run, as Anthropic's: 24 hours.
const WINDOW: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
/// Longest `custom_id`, as Anthropic's.
const MAX_CUSTOM_ID: usize = 64;

/// `POST /v1/messages/batches`: `{"requests": [{"custom_id", "params"}]}`.
#[utoipa::path(
    post,
    path = "/v1/messages/batches",
    operation_id = "create_message_batch",
    tag = "anthropic",
    request_body(content = Object, description = "`requests`: `[{custom_id, params}]`, `params` an Anthropic Messages request"),
    responses(
        (status = 200, description = "Anthropic's message batch object", body = Object),
        (status = 400, description = "`invalid_json`, `invalid_request` (`param` names the request), `too_many_lines`", body = doc::ErrorBody),
        (status = 413, description = "`body_too_large`: over `batches.max_file_bytes`", body = doc::ErrorBody),
        (status = 429, description = "`queue_full`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn create(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let limit = usize::try_from(state.config.batches.max_file_bytes).unwrap_or(usize::MAX);
    let bytes: Bytes = axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ApiErrorCode::BodyTooLarge,
            format!("the body is larger than {limit} bytes (batches.max_file_bytes), or was cut off"),
        )
    })?;
    let requests = check_requests(json_body(Ok(bytes))?, state.config.batches.max_lines)?;
    let now = state.clock.now().trunc_subsecs(6);
    let window = WINDOW.min(std::time::Duration::from_secs(
        state.config.batches.max_completion_window_secs,
    ));
    let mut batch = BatchRow {
        output_expires_secs: state.config.batches.output_expires_secs.min(i64::MAX as u64) as i64,
        api_key: tenant.key,
        ..BatchRow::in_progress(
            new_message_batch_id(),
            &tenant.name,
            Endpoint::Messages,
            JobClass::Batch,
            format!("{}s", window.as_secs()),
            window,
            now,
        )
    };
    let lines = requests.len() as u64;
    start(
        &state,
        &mut batch,
        lines,
        None,
        Input::Inline(requests),
        &tenant.scopes,
        crate::forecasts::OnDeadlineRisk::Refuse,
    )
    .await?;
    Ok(Json(view(&batch, &headers)))
}

/// A create body's requests as `(custom_id, params)`: at least one and at most
/// `max`, each `custom_id` unique and as Anthropic allows them, each `params` an object.
fn check_requests(body: Value, max: u64) -> Result<Vec<(String, Value)>, ApiError> {
    let bad = |message: String, param: String| {
        ApiError::bad_request(ApiErrorCode::InvalidRequest, message).with_param(param)
    };
    let Value::Object(mut body) = body else {
        return Err(bad(
            "the body must be an object with `requests`".into(),
            "requests".into(),
        ));
    };
    let Some(Value::Array(items)) = body.remove("requests") else {
        return Err(bad(
            "`requests` must be an array of {custom_id, params}".into(),
            "requests".into(),
        ));
    };
    if items.is_empty() {
        return Err(bad(
            "`requests` must hold at least one request".into(),
            "requests".into(),
        ));
    }
    if items.len() as u64 > max {
        return Err(ApiError::bad_request(
            ApiErrorCode::TooManyLines,
            format!(
                "a batch holds at most {max} requests; this one has {}",
                items.len()
            ),
        )
        .with_param("requests"));
    }
    let mut seen = HashSet::with_capacity(items.len());
    let mut requests = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let Value::Object(mut item) = item else {
            return Err(bad(
                "each request is {custom_id, params}".into(),
                format!("requests.{i}"),
            ));
        };
        let custom_id = match item.remove("custom_id") {
            Some(Value::String(id))
                if (1..=MAX_CUSTOM_ID).contains(&id.len())
                    && id
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
            {
                id
            }
            _ => {
                return Err(bad(
                    format!("`custom_id` must be 1 to {MAX_CUSTOM_ID} letters, digits, `_` or `-`"),
                    format!("requests.{i}.custom_id"),
                ));
            }
        };
        if !seen.insert(custom_id.clone()) {
            return Err(bad(
                format!("custom_id {custom_id:?} is used by more than one request"),
                format!("requests.{i}.custom_id"),
            ));
        }
        let params = match item.remove("params") {
            Some(params @ Value::Object(_)) => params,
            _ => {
                return Err(bad(
                    "`params` must be a Messages request object".into(),
                    format!("requests.{i}.params"),
                ));
            }
        };
        requests.push((custom_id, params));
    }
    Ok(requests)
}

/// A tenant's Message Batch (another tenant's, or a batch of another endpoint, is not one).
async fn message_batch(state: &AppState, tenant: &str, id: &str) -> Result<BatchRow, ApiError> {
    store::get_batch(&state.pool, Some(tenant), id)
        .await?
        .filter(|b| b.endpoint == Endpoint::Messages)
        .ok_or_else(|| ApiError::not_found("message batch"))
}

/// `GET /v1/messages/batches/{id}`.
#[utoipa::path(
    get,
    path = "/v1/messages/batches/{id}",
    operation_id = "get_message_batch",
    tag = "anthropic",
    params(("id" = String, Path, description = "Message Batch id")),
    responses(
        (status = 200, description = "Anthropic's message batch object", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn get(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let batch = message_batch(&state, &tenant.name, &id).await?;
    Ok(Json(view(&batch, &headers)))
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListParams {
    after_id: Option<String>,
    before_id: Option<String>,
    limit: Option<i64>,
}

/// `GET /v1/messages/batches?after_id=&before_id=&limit=`: newest first.
#[utoipa::path(
    get,
    path = "/v1/messages/batches",
    operation_id = "list_message_batches",
    tag = "anthropic",
    params(
        ("limit" = Option<i64>, Query, description = "1 to 1000 (default 20)"),
        ("after_id" = Option<String>, Query, description = "The previous page's `last_id`"),
        ("before_id" = Option<String>, Query, description = "The next page's `first_id`"),
    ),
    responses(
        (status = 200, description = "`{data, first_id, last_id, has_more}`", body = Object),
        (status = 400, description = "`invalid_request`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    headers: HeaderMap,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let params = paging::params(params)?;
    let limit = paging::limit(params.limit, 20, 1000)?;
    let cursor = match (params.after_id.as_deref(), params.before_id.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidRequest,
                "give `after_id` or `before_id`, not both",
            ));
        }
        (Some(after), None) => Cursor::After(after),
        (None, Some(before)) => Cursor::Before(before),
        (None, None) => Cursor::Newest,
    };
    let mut rows = store::list_batches(
        &state.pool,
        Some(&tenant.name),
        MESSAGE_BATCH_PREFIX,
        cursor,
        limit + 1,
    )
    .await?;
    let has_more = rows.len() as i64 > limit;
    if has_more {
        // The extra row is beyond the page: the oldest going forward, the newest going back.
        if matches!(cursor, Cursor::Before(_)) {
            rows.remove(0);
        } else {
            rows.pop();
        }
    }
    Ok(Json(json!({
        "data": rows.iter().map(|b| view(b, &headers)).collect::<Vec<_>>(),
        "first_id": rows.first().map(|b| &b.id),
        "last_id": rows.last().map(|b| &b.id),
        "has_more": has_more,
    })))
}

/// `POST /v1/messages/batches/{id}/cancel`: `canceling` now, `ended` once maintenance has
/// written its results (requests not yet done are `canceled`).
#[utoipa::path(
    post,
    path = "/v1/messages/batches/{id}/cancel",
    operation_id = "cancel_message_batch",
    tag = "anthropic",
    params(("id" = String, Path, description = "Message Batch id")),
    responses(
        (status = 200, description = "The message batch, `canceling`", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`batch_already_finished`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn cancel(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    message_batch(&state, &tenant.name, &id).await?;
    let mut tx = state.pool.begin().await.map_err(db)?;
    let outcome = store::cancel_batch(&mut tx, Some(&tenant.name), &id, state.clock.now()).await?;
    tx.commit().await.map_err(db)?;
    match outcome {
        BatchControl::Changed(batch) => Ok(Json(view(&batch, &headers))),
        BatchControl::Finished(_) => Err(ApiError::new(
            StatusCode::CONFLICT,
            ApiErrorCode::BatchAlreadyFinished,
            "the message batch has already ended",
        )),
        BatchControl::NotFound => Err(ApiError::not_found("message batch")),
    }
}

/// `DELETE /v1/messages/batches/{id}`: an ended batch and its results.
#[utoipa::path(
    delete,
    path = "/v1/messages/batches/{id}",
    operation_id = "delete_message_batch",
    tag = "anthropic",
    params(("id" = String, Path, description = "Message Batch id")),
    responses(
        (status = 200, description = "`{id, type: \"message_batch_deleted\"}`", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`batch_not_finished`: cancel it first", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn delete(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let batch = message_batch(&state, &tenant.name, &id).await?;
    if !batch.status().is_terminal() {
        return Err(not_finished("deleted"));
    }
    if !store::delete_finished_batch(&state.pool, &tenant.name, &id).await? {
        // Deleted by another request meanwhile.
        return Err(ApiError::not_found("message batch"));
    }
    Ok(Json(json!({"id": id, "type": "message_batch_deleted"})))
}

fn not_finished(what: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        ApiErrorCode::BatchNotFinished,
        format!("the message batch has not ended, so it cannot be {what}; cancel it to end it sooner"),
    )
}

/// `GET /v1/messages/batches/{id}/results`: one JSON line per request,
/// `{custom_id, result: {type: succeeded|errored|canceled|expired, …}}`.
#[utoipa::path(
    get,
    path = "/v1/messages/batches/{id}/results",
    operation_id = "get_message_batch_results",
    tag = "anthropic",
    params(("id" = String, Path, description = "Message Batch id")),
    responses(
        (status = 200, description = "JSONL of the results", content_type = "application/binary", body = String),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`batch_not_finished`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn results(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let batch = message_batch(&state, &tenant.name, &id).await?;
    if !batch.status().is_terminal() {
        return Err(not_finished("read"));
    }
    let files: Vec<String> = [batch.output_file_id, batch.error_file_id]
        .into_iter()
        .flatten()
        .collect();
    let pool = state.pool.clone();
    // (file index, chunk seq, the lines split so far).
    let start = (0usize, 0i32, LineSplitter::new(usize::MAX));
    let lines = futures::stream::unfold(Some(start), move |at| {
        let (pool, files) = (pool.clone(), files.clone());
        async move {
            let (file, seq, mut splitter) = at?;
            let id = files.get(file)?;
            match store::file_chunk(&pool, id, seq).await {
                Ok(data) => {
                    let last = data.is_none();
                    let mut out = Vec::new();
                    for (_, line) in splitter.feed(data.as_deref().unwrap_or_default(), last) {
                        if let Line::Text(text) = line {
                            out.extend_from_slice(result_line(text).as_bytes());
                            out.push(b'\n');
                        }
                    }
                    let next = if last {
                        (file + 1, 0, LineSplitter::new(usize::MAX))
                    } else {
                        (file, seq + 1, splitter)
                    };
                    Some((Ok::<_, std::io::Error>(out), Some(next)))
                }
                Err(e) => {
                    tracing::error!(error = %e, file = %id, "reading a result file failed");
                    Some((Err(std::io::Error::other("reading the results failed")), None))
                }
            }
        }
    });
    let mut response = Body::from_stream(lines).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/binary"),
    );
    Ok(response)
}

/// A line of a batch's output or error file as Anthropic's result line.
fn result_line(text: &[u8]) -> String {
    let line: Value = serde_json::from_slice(text).unwrap_or(Value::Null);
    let result = if line["response"]["status_code"] == 200 {
        json!({"type": "succeeded", "message": line["response"]["body"]})
    } else {
        let code = line["error"]["code"].as_str().unwrap_or("failed");
        match ReasonCode::parse(code) {
            Some(ReasonCode::BatchCancelled) => json!({"type": "canceled"}),
            Some(ReasonCode::BatchExpired) => json!({"type": "expired"}),
            reason => {
                // A line refused at creation has a request code; a job that failed, a
                // reason code: some of those are about the request too.
                let kind = match reason {
                    None
                    | Some(
                        ReasonCode::ProviderRejectedRequest
                        | ReasonCode::RequestTooLarge
                        | ReasonCode::ExceedsLimit
                        | ReasonCode::UnknownModel,
                    ) => "invalid_request_error",
                    Some(_) => "api_error",
                };
                json!({"type": "errored", "error": {"type": "error", "error": {
                    "type": kind, "message": line["error"]["message"], "code": code}}})
            }
        }
    };
    json!({"custom_id": line["custom_id"], "result": result}).to_string()
}

/// The batch as Anthropic shows a Message Batch. Counts are all `processing` until it
/// ends, as Anthropic's are; `results_url` is on the host the client called.
fn view(b: &BatchRow, headers: &HeaderMap) -> Value {
    let time = |t: Option<DateTime<Utc>>| t.map(|t| t.to_rfc3339_opts(SecondsFormat::Micros, true));
    let status = b.status();
    let ended = status.is_terminal();
    let processing_status = match status {
        _ if ended => "ended",
        BatchStatus::Cancelling => "canceling",
        _ => "in_progress",
    };
    let counts = if ended {
        let (canceled, expired) = (b.cancelled.unwrap_or(0), b.expired.unwrap_or(0));
        let failed = b.failed.unwrap_or(b.total - b.completed.unwrap_or(0));
        json!({"processing": 0, "succeeded": b.completed.unwrap_or(0),
               "errored": (failed - canceled - expired).max(0), "canceled": canceled, "expired": expired})
    } else {
        json!({"processing": b.total, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0})
    };
    let ended_at = [b.completed_at, b.failed_at, b.expired_at, b.cancelled_at]
        .into_iter()
        .flatten()
        .next();
    json!({
        "id": b.id,
        "type": "message_batch",
        "processing_status": processing_status,
        "request_counts": counts,
        "created_at": time(Some(b.created_at)),
        "expires_at": time(Some(b.expires_at)),
        "ended_at": time(ended_at),
        "cancel_initiated_at": time(b.cancelling_at),
        "archived_at": null,
        "results_url": ended.then(|| results_url(&b.id, headers)),
    })
}

/// Where a batch's results are read: on the host and scheme the client called (its
/// `Host`, and `X-Forwarded-Proto` from a proxy that ends TLS), else a path.
fn results_url(id: &str, headers: &HeaderMap) -> String {
    let path = format!("/v1/messages/batches/{id}/results");
    let text = |name| headers.get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    match text(header::HOST.as_str()) {
        Some(host) => {
            let scheme = match text("x-forwarded-proto") {
                Some("https") => "https",
                _ => "http",
            };
            format!("{scheme}://{host}{path}")
        }
        None => path,
    }
}
