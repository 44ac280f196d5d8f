//! `POST /v1/jobs/bulk`: many jobs in one request, inserted by one statement in one
//! transaction — all of them or none. Each item is what `POST /v1/jobs` takes and is
//! checked the same way; the first bad item fails the whole request with its index in
//! `param` (`jobs[17].request.model`), so nothing is ever half-written.

use std::collections::HashSet;
use tollgate::vocab::ApiErrorCode;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{SubsecRound, Utc};
use serde::Serialize;
use serde_json::Value;
use tollgate::model::NewJob;
use tollgate::store::{self, BulkInserted};

use crate::AppState;
use crate::auth::AuthTenant;
use crate::error::ApiError;
use crate::jobs::{SubmitJob, check_queue_room, idempotency_key_reused, new_job};
use crate::openapi as doc;

/// One submitted job's fate, in the order sent.
#[derive(Debug, Serialize)]
struct Accepted {
    id: String,
    /// The idempotency key was used before, for the same request: this is that job.
    existing: bool,
}

/// Puts the item's index in front of an error's `param`.
fn at_item(i: usize, mut e: ApiError) -> ApiError {
    e.param = Some(match e.param {
        Some(p) => format!("jobs[{i}].{p}"),
        None => format!("jobs[{i}]"),
    });
    e
}

/// Enqueue many jobs at once: `202` once all are committed (`200` when every one was an
/// idempotent replay). Any invalid item rejects the whole request and writes nothing.
#[utoipa::path(
    post,
    path = "/v1/jobs/bulk",
    operation_id = "submit_jobs_bulk",
    tag = "jobs",
    request_body = doc::BulkSubmitSchema,
    responses(
        (status = 202, description = "All queued (or replays of earlier submissions)", body = doc::BulkAcceptedSchema),
        (status = 200, description = "Every item was an idempotent replay", body = doc::BulkAcceptedSchema),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`, `invalid_deadline`, `stream_not_supported`, `too_many_jobs`, `duplicate_idempotency_key` — `param` names the item", body = doc::ErrorBody),
        (status = 409, description = "`idempotency_key_reused` — `param` names the item", body = doc::ErrorBody),
        (status = 413, description = "`body_too_large` (`server.max_bulk_body_bytes`)", body = doc::ErrorBody),
        (status = 429, description = "`queue_full` (+ `Retry-After`)", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn submit(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    body: Body,
) -> Result<Response, ApiError> {
    let limit = state.config.server.max_bulk_body_bytes;
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ApiErrorCode::BodyTooLarge,
            format!("the body is larger than {limit} bytes (server.max_bulk_body_bytes), or was cut off"),
        )
    })?;
    let parsed: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(
            ApiErrorCode::InvalidJson,
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    crate::jobs::refuse_nul(&parsed, &bytes)?;
    let items = match parsed {
        Value::Object(mut o) if o.len() == 1 && o.contains_key("jobs") => match o.remove("jobs") {
            Some(Value::Array(items)) => items,
            _ => {
                return Err(
                    ApiError::bad_request(ApiErrorCode::InvalidRequest, "`jobs` must be an array")
                        .with_param("jobs"),
                );
            }
        },
        _ => {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidRequest,
                "the body must be an object with one field, `jobs`: an array of jobs as POST /v1/jobs takes them",
            ));
        }
    };
    let max = state.config.server.max_bulk_jobs;
    if items.is_empty() || items.len() > max {
        return Err(ApiError::bad_request(
            ApiErrorCode::TooManyJobs,
            format!(
                "`jobs` must hold 1 to {max} jobs (server.max_bulk_jobs); it holds {}",
                items.len()
            ),
        )
        .with_param("jobs"));
    }
    let now = Utc::now().trunc_subsecs(6);
    let mut keys = HashSet::new();
    let mut jobs: Vec<NewJob> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let submit: SubmitJob = serde_json::from_value(item).map_err(|e| {
            at_item(
                i,
                ApiError::bad_request(ApiErrorCode::InvalidRequest, format!("invalid job: {e}")),
            )
        })?;
        let job = submit
            .into_submission(None)
            .and_then(|s| new_job(&state, &tenant, s, now))
            .map_err(|e| at_item(i, e))?;
        if let Some(key) = &job.idempotency_key
            && !keys.insert(key.clone())
        {
            return Err(at_item(
                i,
                ApiError::bad_request(
                    ApiErrorCode::DuplicateIdempotencyKey,
                    "two jobs in this request share an idempotency key",
                )
                .with_param("idempotency_key"),
            ));
        }
        jobs.push(job);
    }
    let mut per_class = std::collections::BTreeMap::new();
    for j in &jobs {
        *per_class.entry(j.class).or_insert(0u64) += 1;
    }
    for (class, n) in per_class {
        check_queue_room(&state, &tenant, class, n).await?;
    }

    let mut tx = state.pool.begin().await.map_err(store::StoreError::from)?;
    let outcome = store::insert_jobs(&mut tx, &jobs).await?;
    if let Some(i) = outcome.iter().position(|o| *o == BulkInserted::Conflict) {
        // Dropping the transaction rolls every insert back.
        return Err(at_item(i, idempotency_key_reused()));
    }
    tx.commit().await.map_err(store::StoreError::from)?;

    let created = outcome
        .iter()
        .filter(|o| matches!(o, BulkInserted::New(_)))
        .count();
    if created > 0 {
        state.notifications.work_queued();
    }
    let data: Vec<Accepted> = outcome
        .into_iter()
        .filter_map(|o| match o {
            BulkInserted::New(id) => Some(Accepted {
                id: id.to_string(),
                existing: false,
            }),
            BulkInserted::Existing(id) => Some(Accepted {
                id: id.to_string(),
                existing: true,
            }),
            BulkInserted::Conflict => None, // refused above
        })
        .collect();
    let status = if created > 0 {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    let existing = data.len() - created;
    Ok((
        status,
        Json(serde_json::json!({"object": "list", "data": data, "created": created, "existing": existing})),
    )
        .into_response())
}
