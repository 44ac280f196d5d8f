//! What an operator acts with beyond submit, read and cancel — the console's actions and
//! the `tollgate` CLI's:
//! - `POST /v1/jobs/{id}/retry`: a failed or cancelled job queued again (a tenant retries
//!   its own; the admin key any);
//! - `GET /v1/jobs/{id}/attempts`: a job's provider calls, each with what the provider
//!   said of its limits (what the call taught the buckets);
//! - `/v1/admin/pauses`: pause a tenant's queue, a route or a provider model until resumed
//!   (`tollgate::holds`), and list every pause in force, the providers' too.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tollgate::buckets;
use tollgate::holds::{self, Held};
use tollgate::store::{self, AttemptRecord, PauseRecord, Retried};
use tollgate::vocab::ApiErrorCode;
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::{Admin, Viewer};
use crate::error::ApiError;
use crate::jobs::{job_view, parse_id};
use crate::openapi as doc;

/// Queue a failed or cancelled job again: as many attempts as it had before; a deadline
/// that passed moves as far from now as it was from the job's submission. A batch's lines
/// are not retried one by one.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/retry",
    operation_id = "retry_job",
    tag = "jobs",
    params(("id" = String, Path, description = "Job id")),
    responses(
        (status = 200, description = "The job, queued again", body = doc::JobSchema),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`job_not_retryable`: not failed or cancelled, a batch's line, or its cancelled call still in flight", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn retry(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    let not_retryable =
        |message: String| ApiError::new(StatusCode::CONFLICT, ApiErrorCode::JobNotRetryable, message);
    match store::retry_job(&state.pool, viewer.tenant(), id, state.clock.now()).await? {
        Retried::Queued => {}
        Retried::NotFailedOrCancelled(s) => {
            return Err(not_retryable(format!(
                "the job is {}: only a failed or cancelled job is retried",
                s.as_str()
            )));
        }
        Retried::InBatch => {
            return Err(not_retryable(
                "the job is a line of a batch: the batch accounts for its lines".to_owned(),
            ));
        }
        Retried::CallInFlight => {
            return Err(not_retryable(
                "the job was cancelled while its provider call was in flight: retry once it ends".to_owned(),
            ));
        }
        Retried::NotFound => return Err(ApiError::not_found("job")),
    }
    let job = store::get_job(&state.pool, viewer.tenant(), id)
        .await?
        .ok_or_else(|| ApiError::not_found("job"))?;
    Ok(Json(job_view(&job)))
}

/// One provider call of a job.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct AttemptObject {
    object: &'static str,
    attempt: i32,
    provider: String,
    provider_model: String,
    /// The provider key's name.
    key: String,
    /// The provider's HTTP status (`null`: no answer, e.g. a network error).
    status: Option<i32>,
    /// `succeeded` or `failed`.
    outcome: String,
    error_code: Option<String>,
    provider_request_id: Option<String>,
    /// What the provider counted (`null` when it did not say).
    usage: Option<Value>,
    /// What admission reserved for it.
    estimate: Value,
    /// What the provider's headers said of its limits: what the call taught the buckets.
    rate_limit: Option<Value>,
    started_at: DateTime<Utc>,
    finished_at: DateTime<Utc>,
}

impl From<AttemptRecord> for AttemptObject {
    fn from(a: AttemptRecord) -> Self {
        let usage = (a.input_tokens.is_some() || a.output_tokens.is_some()).then(|| {
            json!({
                "input_tokens": a.input_tokens,
                "output_tokens": a.output_tokens,
                "cached_tokens": a.cached_tokens,
            })
        });
        AttemptObject {
            object: "job.attempt",
            attempt: a.attempt,
            provider: a.provider,
            provider_model: a.provider_model,
            key: a.key_name,
            status: a.status,
            outcome: a.outcome,
            error_code: a.error_code,
            provider_request_id: a.provider_request_id,
            usage,
            estimate: json!({
                "input_tokens": a.estimated_input_tokens,
                "output_tokens": a.estimated_output_tokens,
            }),
            rate_limit: a.rate_limit,
            started_at: a.started_at,
            finished_at: a.finished_at,
        }
    }
}

/// The job's provider calls, first first.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/attempts",
    operation_id = "list_job_attempts",
    tag = "jobs",
    params(("id" = String, Path, description = "Job id")),
    responses(
        (status = 200, description = "`{object: \"list\", data: [job.attempt]}`", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn attempts(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    if store::get_job(&state.pool, viewer.tenant(), id).await?.is_none() {
        return Err(ApiError::not_found("job"));
    }
    let data: Vec<AttemptObject> = store::job_attempts(&state.pool, viewer.tenant(), id)
        .await?
        .into_iter()
        .map(AttemptObject::from)
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

/// `POST /v1/admin/pauses`: exactly one of `tenant`, `route`, or `provider` with `model`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewPause {
    tenant: Option<String>,
    route: Option<String>,
    provider: Option<String>,
    model: Option<String>,
}

/// A pause in force.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PauseObject {
    object: &'static str,
    /// `tenant:<name>`, `route:<alias>`, `provider:<provider>:<model>`,
    /// `pool:<provider>:<account>:<model>` (a quota pool's keys for the model),
    /// `key:<provider>:<key>`.
    scope: String,
    /// `tenant`, `route`, `model`, `pool` or `key`.
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tenant: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    route: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    provider: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    /// `operator` (until resumed) or `provider` (a 429's Retry-After, a rejected key).
    by: &'static str,
    /// `operator`, `rate_limited` or `key_unusable`.
    reason: String,
    /// When a provider's pause ends (`null`: an operator's, until resumed).
    until: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
}

impl From<PauseRecord> for PauseObject {
    fn from(p: PauseRecord) -> Self {
        let held = Held::from_scope(&p.scope);
        let pool = p.scope.starts_with("pool:");
        let (tenant, route, provider, model) = match &held {
            Some(Held::Tenant(t)) => (Some(t.clone()), None, None, None),
            Some(Held::Route(r)) => (None, Some(r.clone()), None, None),
            Some(Held::Model { provider, model }) => {
                (None, None, Some(provider.clone()), Some(model.clone()))
            }
            None if pool => {
                let (provider, model) = buckets::scope_target(&p.scope);
                (None, None, Some(provider.to_owned()), Some(model.to_owned()))
            }
            None => (None, None, None, None),
        };
        let operator = p.reason == holds::OPERATOR;
        PauseObject {
            object: "pause",
            kind: held
                .as_ref()
                .map_or(if pool { "pool" } else { "key" }, Held::kind),
            scope: p.scope,
            tenant,
            route,
            provider,
            model,
            by: if operator { "operator" } else { "provider" },
            reason: p.reason,
            until: (!operator).then_some(p.until),
            created_at: p.created_at,
        }
    }
}

/// What a [`NewPause`] pauses, checked against the tenants and routes the database holds
/// (one just created is known at once) and the models configured.
async fn to_hold(state: &AppState, new: NewPause) -> Result<Held, ApiError> {
    let invalid = |param: &str, message: String| {
        ApiError::bad_request(ApiErrorCode::InvalidRequest, message).with_param(param)
    };
    let config = state.tenants.config();
    match new {
        NewPause {
            tenant: Some(t),
            route: None,
            provider: None,
            model: None,
        } => {
            if store::get_tenant(&state.pool, &t).await?.is_none() {
                return Err(invalid("tenant", format!("no tenant {t}")));
            }
            Ok(Held::Tenant(t))
        }
        NewPause {
            tenant: None,
            route: Some(alias),
            provider: None,
            model: None,
        } => {
            let runtime = store::list_routes(&state.pool).await?;
            if !config.routes.iter().any(|r| r.alias == alias) && !runtime.iter().any(|r| r.alias == alias) {
                return Err(invalid("route", format!("no route {alias}")));
            }
            Ok(Held::Route(alias))
        }
        NewPause {
            tenant: None,
            route: None,
            provider: Some(provider),
            model: Some(model),
        } => {
            let served = config
                .providers
                .iter()
                .any(|p| p.name == provider && p.models.contains(&model));
            if !served {
                return Err(invalid(
                    "model",
                    format!("provider {provider} serves no model {model}"),
                ));
            }
            Ok(Held::Model { provider, model })
        }
        _ => Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "give one of `tenant`, `route`, or `provider` with `model`",
        )),
    }
}

/// Pause a tenant's queue, a route or a provider model until resumed: on every process
/// within a gate round. Nothing queued is admitted (jobs held wait, whatever their
/// deadline; a paused model's jobs fail over to their route's next target); what was
/// admitted goes on (a paused model's waits too).
#[utoipa::path(
    post,
    path = "/v1/admin/pauses",
    operation_id = "pause",
    tag = "admin",
    request_body = NewPause,
    responses(
        (status = 201, description = "The pause", body = PauseObject),
        (status = 400, description = "`invalid_request`: `param` names what is unknown", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn pause(
    State(state): State<AppState>,
    _: Admin,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let new: NewPause = crate::admin::body(bytes)?;
    let held = to_hold(&state, new).await?;
    let record = store::hold(&state.pool, &held.scope(), state.clock.now()).await?;
    store::notify_gate(&state.pool).await?;
    Ok((StatusCode::CREATED, Json(PauseObject::from(record))).into_response())
}

/// Every pause in force: the operators', and those providers caused (a 429's
/// Retry-After, a rejected key).
#[utoipa::path(
    get,
    path = "/v1/admin/pauses",
    operation_id = "list_pauses",
    tag = "admin",
    responses((status = 200, description = "`{object: \"list\", data: [pause]}`, newest first", body = Object)),
    security(("bearer" = []))
)]
pub(crate) async fn list_pauses(State(state): State<AppState>, _: Admin) -> Result<Json<Value>, ApiError> {
    let data: Vec<PauseObject> = store::list_pauses(&state.pool, state.clock.now())
        .await?
        .into_iter()
        .map(PauseObject::from)
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

/// Resume what an operator paused: `scope` as the pause names it (`tenant:acme`,
/// URL-encoded).
#[utoipa::path(
    delete,
    path = "/v1/admin/pauses/{scope}",
    operation_id = "resume",
    tag = "admin",
    params(("scope" = String, Path, description = "The pause's scope, e.g. `tenant:acme`")),
    responses(
        (status = 200, description = "`{scope, object: \"pause\", deleted: true}`", body = Object),
        (status = 404, description = "`not_found`: no operator's pause of that scope", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn resume(
    State(state): State<AppState>,
    _: Admin,
    Path(scope): Path<String>,
) -> Result<Json<Value>, ApiError> {
    store::release(&state.pool, &scope)
        .await?
        .ok_or_else(|| ApiError::not_found("pause"))?;
    store::notify_gate(&state.pool).await?;
    Ok(Json(json!({"scope": scope, "object": "pause", "deleted": true})))
}
