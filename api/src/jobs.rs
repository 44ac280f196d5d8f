//! The jobs API: submit (`POST /v1/jobs`), read with optional long-poll
//! (`GET /v1/jobs/{id}?wait=`), list with cursor paging (`GET /v1/jobs`), cancel
//! (`POST /v1/jobs/{id}/cancel`). Also the pieces the synchronous endpoints share:
//! preparing a submission, enqueueing it, waiting for a job to finish.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tollgate::vocab::ApiErrorCode;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SubsecRound, Utc};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgConnection;
use tollgate::config::Config;
use tollgate::forecast::Eta;
use tollgate::model::{Endpoint, Job, JobClass, JobId, JobState, NewJob};
use tollgate::store::{self, Cancelled, Inserted};
use tollgate::tenants::{Caller, Tenant};

use crate::AppState;
use crate::auth::{AuthTenant, Viewer};
use crate::error::ApiError;
use crate::forecasts::{Check, Of, OnDeadlineRisk};
use crate::openapi as doc;
use crate::paging;
use crate::requests;

/// Longest idempotency key accepted.
const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;
/// Largest `metadata` object accepted, serialized.
const MAX_METADATA_BYTES: usize = 16 * 1024;
/// Priorities outside this range are rejected (higher runs first within a class).
pub(crate) const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -1000..=1000;

/// Reads a JSON body, mapping every failure to a clear 4xx.
pub(crate) fn json_body(body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ApiErrorCode::BodyTooLarge,
                "the request body is larger than the server accepts (server.max_body_bytes)",
            )
        } else {
            ApiError::bad_request(ApiErrorCode::UnreadableBody, rejection.body_text())
        }
    })?;
    let value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(
            ApiErrorCode::InvalidJson,
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    refuse_nul(&value, &bytes)?;
    Ok(value)
}

/// Whether JSON text `raw` may hold U+0000: JSON can only spell it as the escape
/// `\u0000`, so text without one holds none.
pub(crate) fn may_hold_nul(raw: &[u8]) -> bool {
    raw.windows(6).any(|w| w.eq_ignore_ascii_case(b"\\u0000"))
}

/// 400 `nul_character` when a string of `value` (parsed from `raw`) holds U+0000.
pub(crate) fn refuse_nul(value: &Value, raw: &[u8]) -> Result<(), ApiError> {
    if !may_hold_nul(raw) {
        return Ok(());
    }
    match tollgate::sanitize::first_nul(value) {
        None => Ok(()),
        Some(at) => Err(ApiError::bad_request(
            ApiErrorCode::NulCharacter,
            format!("the string at {at} holds U+0000 (NUL), which tollgate cannot store: remove it"),
        )
        .with_param(at)),
    }
}

/// What a client may send to `POST /v1/jobs` (and each item of `POST /v1/jobs/bulk`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SubmitJob {
    /// What kind of work `request` is; chat completions unless set.
    #[serde(default)]
    endpoint: Endpoint,
    request: Value,
    class: Option<JobClass>,
    deadline: Option<DateTime<Utc>>,
    priority: Option<i32>,
    idempotency_key: Option<String>,
    metadata: Option<Value>,
    /// When the forecast says its `deadline` cannot be met: refuse it (default), or accept.
    #[serde(default)]
    on_deadline_risk: OnDeadlineRisk,
}

impl SubmitJob {
    /// Checks what does not need the config (stream, priority, idempotency key, metadata);
    /// `header_key` is the `Idempotency-Key` header, used when the body names none.
    pub(crate) fn into_submission(self, header_key: Option<String>) -> Result<Submission, ApiError> {
        if self.request.get("stream").and_then(Value::as_bool) == Some(true) {
            return Err(ApiError::bad_request(
                ApiErrorCode::StreamNotSupported,
                "queued jobs cannot stream; use POST /v1/chat/completions for streaming",
            )
            .with_param("request.stream"));
        }
        let priority = self.priority.unwrap_or(0);
        if !PRIORITY_RANGE.contains(&priority) {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidRequest,
                "`priority` must be between -1000 and 1000",
            )
            .with_param("priority"));
        }
        let idempotency_key = self.idempotency_key.or(header_key);
        if idempotency_key
            .as_ref()
            .is_some_and(|k| k.is_empty() || k.len() > MAX_IDEMPOTENCY_KEY_LEN)
        {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidRequest,
                "`idempotency_key` must be 1 to 255 bytes",
            )
            .with_param("idempotency_key"));
        }
        if let Some(meta) = &self.metadata {
            if !meta.is_object() {
                return Err(ApiError::bad_request(
                    ApiErrorCode::InvalidRequest,
                    "`metadata` must be an object",
                )
                .with_param("metadata"));
            }
            if meta.to_string().len() > MAX_METADATA_BYTES {
                return Err(ApiError::bad_request(
                    ApiErrorCode::MetadataTooLarge,
                    "`metadata` must be at most 16 KiB serialized",
                )
                .with_param("metadata"));
            }
        }
        Ok(Submission {
            stream: false,
            endpoint: self.endpoint,
            request: self.request,
            class: self.class.unwrap_or(JobClass::Standard),
            deadline: self.deadline,
            priority,
            idempotency_key,
            metadata: self.metadata,
            check: Check::of(self.deadline, self.on_deadline_risk),
            caller_process: None,
        })
    }
}

/// A validated submission, ready to insert.
pub(crate) struct Submission {
    pub endpoint: Endpoint,
    pub request: Value,
    /// Streamed to the caller by this process (chat completions with `stream: true`).
    pub stream: bool,
    pub class: JobClass,
    pub deadline: Option<DateTime<Utc>>,
    pub priority: i32,
    pub idempotency_key: Option<String>,
    pub metadata: Option<Value>,
    /// Whether its forecast is checked against its deadline ([`crate::forecasts`]).
    pub check: Check,
    /// A synchronous call's: this process, whose connection its client waits on
    /// ([`NewJob::caller_process`]).
    pub caller_process: Option<String>,
}

/// The row a submission becomes: its request checked against the routes, its deadline
/// defaulted by class, its tokens estimated. `now` is the acceptance time.
pub(crate) fn new_job(
    config: &Config,
    tenant: &Caller,
    s: Submission,
    now: DateTime<Utc>,
) -> Result<NewJob, ApiError> {
    let checked = requests::check(config, s.endpoint, &s.request, "request.")?;
    if let Some((field, reason)) =
        tenant
            .scopes
            .refuses(Some(&checked.model), s.endpoint, s.class, s.priority)
    {
        return Err(scope_refusal(field, reason));
    }
    let default_deadline = config.classes.get(s.class).default_deadline_secs;
    let deadline = s
        .deadline
        .unwrap_or(now + chrono::Duration::seconds(default_deadline.min(i64::MAX as u64) as i64));
    if deadline <= now {
        return Err(
            ApiError::bad_request(ApiErrorCode::InvalidDeadline, "`deadline` must be in the future")
                .with_param("deadline"),
        );
    }
    let mut job = NewJob {
        id: JobId::new(),
        tenant: tenant.name.clone(),
        class: s.class,
        priority: s.priority,
        endpoint: s.endpoint,
        estimated_input_tokens: checked.estimated_input_tokens,
        estimated_output_tokens: checked.estimated_output_tokens,
        request: s.request,
        model: checked.model,
        idempotency_key: s.idempotency_key,
        metadata: s.metadata,
        deadline,
        max_attempts: config.retry.max_attempts.min(i32::MAX as u32) as i32,
        created_at: now,
        stream: s.stream,
        api_key: tenant.key,
        traceparent: None,
        eta_p50: None,
        eta_p90: None,
        caller_process: s.caller_process,
    };
    crate::observed::ClientTrace::start(&mut job);
    Ok(job)
}

/// `403 key_not_permitted`: the caller's key may not submit this (`param`: the field).
pub(crate) fn scope_refusal(field: &str, reason: String) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, ApiErrorCode::KeyNotPermitted, reason).with_param(field)
}

/// Makes room for `adding` more jobs of `class` in the tenant's queue, or refuses them
/// with `429 queue_full` when it would pass `classes.*.max_queued_per_tenant`. Run it in
/// the transaction that then inserts them: it holds the queue's lock until that commits
/// (`store::lock_queue_and_count`), so concurrent submitters, in this process or
/// another, are counted one after the other and the cap holds exactly. Without a cap it
/// does nothing and takes no lock.
pub(crate) async fn reserve_queue_room(
    state: &AppState,
    conn: &mut PgConnection,
    tenant: &str,
    class: JobClass,
    adding: u64,
) -> Result<(), ApiError> {
    count_queue_room(state, Some(conn), tenant, class, adding).await
}

/// [`reserve_queue_room`]'s answer without its lock, for refusing a submission to a queue
/// that is already full before the work of reading it (a bulk's items). A yes here is
/// not a promise: the insert's transaction asks again under the lock.
pub(crate) async fn queue_has_room(
    state: &AppState,
    tenant: &str,
    class: JobClass,
    adding: u64,
) -> Result<(), ApiError> {
    count_queue_room(state, None, tenant, class, adding).await
}

/// Counts under the queue's lock in `locked` (the insert's transaction), or on the pool
/// without it when None.
async fn count_queue_room(
    state: &AppState,
    locked: Option<&mut PgConnection>,
    tenant: &str,
    class: JobClass,
    adding: u64,
) -> Result<(), ApiError> {
    let Some(cap) = state.config.classes.get(class).max_queued_per_tenant else {
        return Ok(());
    };
    state
        .queue_room
        .refuse_if_known_full(tenant, class, cap, adding)?;
    let up_to = count_up_to(cap, adding);
    let waiting = match locked {
        Some(conn) => store::lock_queue_and_count(conn, tenant, class, up_to).await?,
        None => store::count_waiting(&state.pool, tenant, class, up_to).await?,
    };
    state.queue_room.judge(tenant, class, cap, waiting, adding)
}

/// Counting past `cap - adding` changes nothing: the answer is no either way.
fn count_up_to(cap: u64, adding: u64) -> i64 {
    i64::try_from(cap.saturating_sub(adding).saturating_add(1)).unwrap_or(i64::MAX)
}

/// How long the room counted in a queue found too full is believed.
const QUEUE_ROOM_MEMORY: Duration = Duration::from_secs(1);

/// The room last counted in capped queues that were found too full, by (tenant, class),
/// believed for [`QUEUE_ROOM_MEMORY`]: a flood of submissions to a full queue costs one
/// count a second, not one each (a count of a full queue reads up to its cap's rows,
/// under its lock). It only ever refuses what would not have fit a second ago; what it
/// lets through is counted. Keys are configured tenants × four classes.
#[derive(Clone, Default)]
pub struct QueueRoom(Arc<Mutex<RoomCounted>>);

/// By (tenant, class): when its queue was counted too full, and the room it had.
type RoomCounted = HashMap<(String, JobClass), (Instant, u64)>;

impl QueueRoom {
    fn counted(&self) -> std::sync::MutexGuard<'_, RoomCounted> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `429 queue_full` when the queue was counted too full for `adding` within the memory.
    fn refuse_if_known_full(
        &self,
        tenant: &str,
        class: JobClass,
        cap: u64,
        adding: u64,
    ) -> Result<(), ApiError> {
        let known = self.counted().get(&(tenant.to_owned(), class)).copied();
        match known {
            Some((at, room)) if at.elapsed() < QUEUE_ROOM_MEMORY && adding > room => {
                Err(queue_full(class, cap, adding))
            }
            _ => Ok(()),
        }
    }

    /// Whether `adding` fits beside `waiting`; a queue too full is remembered with its room.
    fn judge(
        &self,
        tenant: &str,
        class: JobClass,
        cap: u64,
        waiting: i64,
        adding: u64,
    ) -> Result<(), ApiError> {
        let waiting = u64::try_from(waiting).unwrap_or(0);
        if waiting.saturating_add(adding) <= cap {
            return Ok(());
        }
        self.counted().insert(
            (tenant.to_owned(), class),
            (Instant::now(), cap.saturating_sub(waiting)),
        );
        Err(queue_full(class, cap, adding))
    }
}

fn queue_full(class: JobClass, cap: u64, adding: u64) -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        ApiErrorCode::QueueFull,
        format!(
            "the tenant's queue of class {} is full: at most {cap} jobs may wait in it (classes.{}.max_queued_per_tenant), and {adding} more do not fit now; retry later",
            class.as_str(),
            class.as_str(),
        ),
    )
    .with_retry_after(Duration::from_secs(5))
}

/// The error for an idempotency key already used for another request.
pub(crate) fn idempotency_key_reused() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        ApiErrorCode::IdempotencyKeyReused,
        "this idempotency key was used for a different request",
    )
    .with_param("idempotency_key")
}

/// Validates, forecasts and inserts; the row is committed when this returns. A job whose
/// deadline is checked is forecast and inserted in one transaction, under the forecast
/// locks ([`crate::forecasts`]).
pub(crate) async fn enqueue(state: &AppState, tenant: &Caller, s: Submission) -> Result<Inserted, ApiError> {
    let check = s.check;
    let job = prepare(state, tenant, s)?;
    if let Some(existing) = already_submitted(state, &job).await? {
        return Ok(existing);
    }
    match check {
        Check::None => {
            let job = forecast_unchecked(state, job).await;
            insert(state, tenant, job).await
        }
        Check::StartBy(_) | Check::FinishBy(_) => insert_checked(state, tenant, job, check).await,
    }
}

/// The job this one's idempotency key already made (checked before its forecast: the
/// first job must not stand in the queue ahead of its own retry).
async fn already_submitted(state: &AppState, job: &NewJob) -> Result<Option<Inserted>, ApiError> {
    let Some(key) = job.idempotency_key.as_deref() else {
        return Ok(None);
    };
    match store::job_by_idempotency_key(&state.pool, &job.tenant, key).await? {
        Some(existing) if existing.request != job.request => Err(idempotency_key_reused()),
        Some(existing) => Ok(Some(Inserted::Existing(existing))),
        None => Ok(None),
    }
}

/// `job` with its forecast, read without locks; as it was when there is none to read.
async fn forecast_unchecked(state: &AppState, job: Arc<NewJob>) -> Arc<NewJob> {
    let forecast = async {
        let inputs = state.forecasts.inputs(&state.pool, job.created_at).await?;
        let mut conn = state.pool.acquire().await.map_err(store::StoreError::from)?;
        let control = state.tenants.snapshot();
        state
            .forecasts
            .forecast(
                &inputs,
                &mut conn,
                &control,
                &[Of::job(&job)],
                Check::None,
                job.created_at,
            )
            .await
    };
    match forecast.await {
        Ok(eta) => with_eta(job, eta),
        Err(e) => {
            tracing::warn!(code = %e.code.as_str(), "could not forecast a job; it is accepted without an eta");
            job
        }
    }
}

fn with_eta(job: Arc<NewJob>, eta: Option<Eta>) -> Arc<NewJob> {
    let Some(eta) = eta else { return job };
    let mut job = Arc::unwrap_or_clone(job);
    job.eta_p50 = Some(eta.p50);
    job.eta_p90 = Some(eta.p90);
    Arc::new(job)
}

/// Forecasts `job` under the forecast locks, refuses it by `check`, and inserts it in the
/// same transaction.
async fn insert_checked(
    state: &AppState,
    tenant: &Tenant,
    job: Arc<NewJob>,
    check: Check,
) -> Result<Inserted, ApiError> {
    let _turn = state.forecasts.turn(&job.model).await;
    let inputs = state.forecasts.inputs(&state.pool, job.created_at).await?;
    let mut tx = state.pool.begin().await.map_err(store::StoreError::from)?;
    reserve_queue_room(state, &mut tx, &tenant.name, job.class, 1).await?;
    let control = state.tenants.snapshot();
    let eta = state
        .forecasts
        .forecast(
            &inputs,
            &mut tx,
            &control,
            &[Of::job(&job)],
            check,
            job.created_at,
        )
        .await?;
    let job = with_eta(job, eta);
    let inserted = store::insert_job(&mut tx, &job).await?;
    tx.commit().await.map_err(store::StoreError::from)?;
    queued(state, &job, &inserted)?;
    Ok(inserted)
}

/// The job a submission makes, validated, not yet inserted ([`insert`]).
pub(crate) fn prepare(state: &AppState, tenant: &Caller, s: Submission) -> Result<Arc<NewJob>, ApiError> {
    // PostgreSQL keeps microseconds: so does the 202, to match every later read.
    Ok(Arc::new(new_job(
        &state.tenants.config(),
        tenant,
        s,
        state.clock.now().trunc_subsecs(6),
    )?))
}

/// Inserts a [`prepare`]d job (or starts it on arrival); committed when this returns.
pub(crate) async fn insert(
    state: &AppState,
    tenant: &Tenant,
    job: Arc<NewJob>,
) -> Result<Inserted, ApiError> {
    // A job started on arrival does not wait: it takes no room in the queue.
    let started = match &state.arrivals {
        Some(arrivals) if job.class == JobClass::Interactive => arrivals.admit(&job).await,
        _ => None,
    };
    if let Some(started) = started {
        return Ok(Inserted::New(started));
    }
    let inserted = if state
        .config
        .classes
        .get(job.class)
        .max_queued_per_tenant
        .is_some()
    {
        let mut tx = state.pool.begin().await.map_err(store::StoreError::from)?;
        reserve_queue_room(state, &mut tx, &tenant.name, job.class, 1).await?;
        let inserted = store::insert_job(&mut tx, &job).await?;
        tx.commit().await.map_err(store::StoreError::from)?;
        inserted
    } else {
        state.inserts.insert(&job).await?
    };
    queued(state, &job, &inserted)?;
    Ok(inserted)
}

/// After `job`'s insert: the gate is told of a new job; a job its idempotency key had
/// already made for another request is refused.
fn queued(state: &AppState, job: &NewJob, inserted: &Inserted) -> Result<(), ApiError> {
    match inserted {
        Inserted::New(_) if job.class == JobClass::Interactive => state.notifications.interactive_queued(),
        Inserted::New(_) => state.notifications.work_queued(),
        Inserted::Existing(existing) if existing.request != job.request => {
            return Err(idempotency_key_reused());
        }
        Inserted::Existing(_) => {}
    }
    Ok(())
}

/// A `POST /v1/jobs` body (parsed) with its `Idempotency-Key` header, checked as far as
/// it can be without the config.
pub(crate) fn submission(
    value: Value,
    idempotency_key: Option<&HeaderValue>,
) -> Result<Submission, ApiError> {
    if !value.is_object() {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "the body must be a JSON object",
        ));
    }
    let submit: SubmitJob = serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(ApiErrorCode::InvalidRequest, format!("invalid job: {e}")))?;
    let header_key = idempotency_key
        .map(|v| {
            v.to_str().map(str::to_owned).map_err(|_| {
                ApiError::bad_request(
                    ApiErrorCode::InvalidRequest,
                    "the Idempotency-Key header must be visible ASCII; put other text in the body's `idempotency_key`",
                )
                .with_param("idempotency_key")
            })
        })
        .transpose()?;
    submit.into_submission(header_key)
}

/// Enqueue a job: `202` once its row is committed; the same idempotency key again → `200`
/// with the same job.
#[utoipa::path(
    post,
    path = "/v1/jobs",
    operation_id = "submit_job",
    tag = "jobs",
    request_body = doc::SubmitJobSchema,
    params(("Idempotency-Key" = Option<String>, Header, description = "Per tenant; same as the body's `idempotency_key`")),
    responses(
        (status = 202, description = "Queued", body = doc::JobSchema),
        (status = 200, description = "This idempotency key's existing job", body = doc::JobSchema),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`, `invalid_deadline`, `stream_not_supported`, `metadata_too_large`", body = doc::ErrorBody),
        (status = 409, description = "`idempotency_key_reused`", body = doc::ErrorBody),
        (status = 413, description = "`body_too_large`", body = doc::ErrorBody),
        (status = 422, description = "`deadline_unmeetable`: the job's forecast p90 is after the deadline it set; `earliest_feasible_at` says the earliest it would be accepted with", body = doc::ErrorBody),
        (status = 429, description = "`queue_full`, `api_rate_limited` (+ `Retry-After`)", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn submit(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let submission = submission(json_body(body)?, headers.get("idempotency-key"))?;
    let inserted = enqueue(&state, &tenant, submission).await?;
    Ok(match inserted {
        Inserted::New(job) => (StatusCode::ACCEPTED, Json(job_view(&job))).into_response(),
        Inserted::Existing(job) => (StatusCode::OK, Json(job_view(&job))).into_response(),
    })
}

#[derive(Debug, Deserialize)]
pub(crate) struct GetParams {
    /// Seconds to wait for the job to finish (long-poll); clamped to server.max_wait_secs.
    wait: Option<f64>,
}

pub(crate) fn parse_id(id: &str) -> Result<JobId, ApiError> {
    id.parse().map_err(|_| ApiError::not_found("job"))
}

/// The job (any tenant's, with the admin key); with `wait`, long-polls until it is
/// finished or the wait ends.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    operation_id = "get_job",
    tag = "jobs",
    params(
        ("id" = String, Path, description = "Job id"),
        ("wait" = Option<f64>, Query, description = "Seconds to wait for the job to finish (at most `server.max_wait_secs`)"),
    ),
    responses(
        (status = 200, description = "The job", body = doc::JobSchema),
        (status = 400, description = "`invalid_request` (bad `wait`)", body = doc::ErrorBody),
        (status = 404, description = "`not_found`: no such job for this tenant", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn get(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
    Query(params): Query<GetParams>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    let wait = params.wait.unwrap_or(0.0);
    if !wait.is_finite() || wait < 0.0 {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "`wait` must be a non-negative number of seconds",
        )
        .with_param("wait"));
    }
    let wait = Duration::from_secs_f64(wait.min(state.config.server.max_wait_secs as f64));
    let job = wait_terminal(&state, viewer.tenant(), id, wait)
        .await?
        .ok_or_else(|| ApiError::not_found("job"))?;
    // One job shows what was asked of it too; lists do not carry requests.
    let mut view = job_view(&job);
    view["request"] = job.request;
    Ok(Json(view))
}

/// Reads the job, waiting up to `wait` for it to reach a terminal state. `None` if the
/// tenant (any, when `None`) has no such job.
pub(crate) async fn wait_terminal(
    state: &AppState,
    tenant: Option<&str>,
    id: JobId,
    wait: Duration,
) -> Result<Option<Job>, ApiError> {
    // Watch before the first read so a completion in between is not missed.
    let watch = state.notifications.watch_job(id);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let job = store::get_job(&state.pool, tenant, id).await?;
        match &job {
            Some(j) if !j.state.is_terminal() && tokio::time::Instant::now() < deadline => {}
            _ => return Ok(job),
        }
        if tokio::time::timeout_at(deadline, watch.changed()).await.is_err() {
            return Ok(store::get_job(&state.pool, tenant, id).await?);
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListParams {
    state: Option<JobState>,
    tenant: Option<String>,
    class: Option<JobClass>,
    model: Option<String>,
    endpoint: Option<Endpoint>,
    lane: Option<tollgate::vocab::Lane>,
    batch: Option<String>,
    reason: Option<String>,
    created_after: Option<DateTime<Utc>>,
    created_before: Option<DateTime<Utc>>,
    q: Option<String>,
    limit: Option<i64>,
    after: Option<String>,
}

/// The tenant's jobs (every tenant's, with the admin key), newest first, a page at a time,
/// filtered by any of the parameters given.
#[utoipa::path(
    get,
    path = "/v1/jobs",
    operation_id = "list_jobs",
    tag = "jobs",
    params(
        ("state" = Option<String>, Query, description = "Only jobs in this state"),
        ("tenant" = Option<String>, Query, description = "Only this tenant's (the admin key; a tenant key sees its own only)"),
        ("class" = Option<String>, Query, description = "`interactive`, `standard`, `background` or `batch`"),
        ("model" = Option<String>, Query, description = "As requested: a route alias or `provider/model`"),
        ("endpoint" = Option<String>, Query, description = "The API path, e.g. `/v1/chat/completions`"),
        ("lane" = Option<String>, Query, description = "`online` or `provider_batch`"),
        ("batch" = Option<String>, Query, description = "Lines of this batch"),
        ("reason" = Option<String>, Query, description = "Failed with this reason code, or queued waiting for this reason"),
        ("created_after" = Option<String>, Query, description = "RFC 3339: submitted at or after"),
        ("created_before" = Option<String>, Query, description = "RFC 3339: submitted before"),
        ("q" = Option<String>, Query, description = "A job id, an idempotency key, or `key=value` of its metadata"),
        ("limit" = Option<i64>, Query, description = "1 to 100 (default 20)"),
        ("after" = Option<String>, Query, description = "The previous page's `last_id`"),
    ),
    responses(
        (status = 200, description = "A page of jobs", body = doc::JobListSchema),
        (status = 400, description = "`invalid_request`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    viewer: Viewer,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let params = paging::params(params)?;
    let limit = paging::limit(params.limit, 20, 100)?;
    let after = params
        .after
        .as_deref()
        .map(|a| {
            a.parse::<JobId>().map_err(|_| {
                ApiError::bad_request(ApiErrorCode::InvalidRequest, "`after` must be a job id")
                    .with_param("after")
            })
        })
        .transpose()?;
    let search = params
        .q
        .filter(|q| !q.is_empty())
        .map(|q| match q.parse::<JobId>() {
            Ok(id) => store::JobSearch::Id(id),
            Err(_) => store::JobSearch::Text(q),
        });
    let filter = store::JobFilter {
        state: params.state,
        class: params.class,
        model: params.model,
        endpoint: params.endpoint,
        lane: params.lane,
        batch: params.batch,
        reason: params.reason,
        created_after: params.created_after,
        created_before: params.created_before,
        search,
    };
    // A tenant key lists its own jobs whatever `tenant` says: another's is an empty list.
    let tenant = match (viewer.tenant(), params.tenant.as_deref()) {
        (Some(own), Some(asked)) if own != asked => {
            return Ok(Json(paging::page(Vec::<Job>::new(), limit, |j| j.id, job_view)));
        }
        (Some(own), _) => Some(own),
        (None, asked) => asked,
    };
    let jobs = store::list_jobs(&state.pool, tenant, &filter, after, limit + 1).await?;
    Ok(Json(paging::page(jobs, limit, |j| j.id, job_view)))
}

/// Cancel a queued, admitted or running job (a running call's result is discarded); the
/// admin key cancels any tenant's.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/cancel",
    operation_id = "cancel_job",
    tag = "jobs",
    params(("id" = String, Path, description = "Job id")),
    responses(
        (status = 200, description = "The cancelled job", body = doc::JobSchema),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`job_already_finished`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn cancel(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    match store::cancel_job(&state.pool, viewer.tenant(), id, state.clock.now()).await? {
        Cancelled::Now(job) => Ok(Json(job_view(&job))),
        Cancelled::AlreadyFinished(job) => Err(ApiError::new(
            StatusCode::CONFLICT,
            ApiErrorCode::JobAlreadyFinished,
            format!("the job already finished as {}", job.state.as_str()),
        )),
        Cancelled::NotFound => Err(ApiError::not_found("job")),
    }
}

/// The job as clients see it.
pub(crate) fn job_view(job: &Job) -> Value {
    let error = job
        .error_code
        .as_ref()
        .map(|code| json!({"code": code, "message": job.error_message}));
    json!({
        "id": job.id,
        "object": "job",
        "tenant": job.tenant,
        "state": job.state,
        "class": job.class,
        "priority": job.priority,
        "endpoint": job.endpoint,
        "model": job.model,
        "provider": job.provider,
        "provider_model": job.provider_model,
        "failed_targets": job.failed_targets,
        "provider_request_id": job.provider_request_id,
        "attempts": job.attempt,
        "max_attempts": job.max_attempts,
        "deadline": job.deadline,
        // When it was forecast at submission to finish, p50 and p90 (`null`: not forecast).
        "eta": crate::forecasts::eta_view(job.eta_p50, job.eta_p90),
        "not_before": (job.state == JobState::Queued).then_some(job.not_before),
        "created_at": job.created_at,
        "admitted_at": job.admitted_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "estimate": {
            "input_tokens": job.estimated_input_tokens,
            "output_tokens": job.estimated_output_tokens,
        },
        "usage": job.usage,
        "result": job.result,
        // While queued for a retry, `error` is the last attempt's error.
        "error": error,
        // While queued: why it waits (the bucket that stops it, its limit and what remains;
        // `batch_paused` while its batch is paused).
        "admission": match (job.state, job.held) {
            (JobState::Queued, true) => Some(json!({"reason": "batch_paused"})),
            (JobState::Queued, false) => job.admission.clone(),
            _ => None,
        },
        // The batch it is a line of.
        "batch_id": job.batch_id,
        // Each change of why it waited, with `at`: the admission explanation over time.
        "admission_history": job.admission_log.clone().unwrap_or_else(|| json!([])),
        "idempotency_key": job.idempotency_key,
        "metadata": job.metadata,
        // The id of the API key it was submitted with.
        "api_key": job.api_key,
        // The id of its OpenTelemetry trace (`null` when jobs are not traced).
        "trace_id": job.traceparent.as_deref().and_then(tollgate::job_trace::trace_id),
        // Online, at the flex tier or through the provider's batch API, and why (`null`
        // reason: no lane but online was considered).
        "dispatch": {
            "via": job.dispatch_via.as_deref().unwrap_or(tollgate::vocab::Lane::Online.as_str()),
            "reason": job.dispatch_reason,
            "provider_batch_id": job.provider_batch_id,
        },
        // What it reserved when admitted, what its attempts were charged and what a cheaper
        // lane saved against the online price, at the configured prices (`null` until
        // admitted, until charged, and when nothing was saved).
        "cost": {
            "reserved_usd": job.reserved_micro_usd.map(|m| m / 1e6),
            "charged_usd": job.spend_micro_usd.map(|m| m / 1e6),
            "saved_usd": job.saved_micro_usd.map(|m| m / 1e6),
            "price_source": job.price_source,
            "lane": job.dispatch_via.as_deref().unwrap_or(tollgate::vocab::Lane::Online.as_str()),
        },
    })
}
