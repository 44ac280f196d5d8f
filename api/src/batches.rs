//! The Batch API, as OpenAI's: `POST /v1/batches`, `GET /v1/batches/{id}`,
//! `GET /v1/batches?after=&limit=`, `POST /v1/batches/{id}/cancel`; plus tollgate's
//! optional extras on create: a shorter `completion_window` (`"15m"`, `"2h"`: the jobs'
//! deadline), a `class`, and a `webhook` (`{url, secret, events}`).
//!
//! Creating a batch ingests its input file in the request: the file's chunks are read in
//! order and split into lines; each line is validated on its own (bad JSON, missing or
//! duplicate `custom_id`, wrong `method` or `url`, an invalid body, an unknown model, a
//! line over `batches.max_line_bytes`) and a bad line is recorded with its code for the
//! error file while the rest run. Valid lines become ordinary jobs, inserted
//! `batches.insert_chunk` at a time with one statement per chunk, in the transaction
//! that creates the batch: the batch exists with all its jobs, or not at all. From then
//! on the jobs go through the gate and dispatchers like any other; maintenance
//! (`tollgate_workers::batches`) ends the batch and writes its files.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tollgate::vocab::ApiErrorCode;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use chrono::{DateTime, SubsecRound, Utc};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgConnection;
use tollgate::batches::{
    BATCH_PREFIX, BatchRow, Line, LineEnvelope, LineSplitter, PURPOSE_BATCH, RequestCounts, ResultsCursor,
    new_batch_id, parse_line, parse_window,
};
use tollgate::config::{BatchesConfig, Config};
use tollgate::model::{JobClass, JobId, NewJob};
use tollgate::store::{self, BatchChange, BatchControl, BatchJobs, LineError};
use tollgate::tenants::KeyScopes;
use tollgate::vocab::Endpoint;
use tollgate::webhook_signing::{EVENT_TYPES, Secret};

use crate::AppState;
use crate::auth::{AuthTenant, Viewer};
use crate::error::ApiError;
use crate::files::{EXPIRES_AFTER_RANGE, db, unix};
use crate::forecasts::{Check, Inputs, Of, OnDeadlineRisk};
use crate::jobs::json_body;
use crate::openapi as doc;
use crate::paging;
use crate::requests;

/// Metadata limits, as OpenAI's: 16 pairs, keys up to 64 characters, values up to 512.
const MAX_METADATA_PAIRS: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

#[derive(Debug, Deserialize)]
struct ExpiresAfter {
    anchor: String,
    seconds: i64,
}

#[derive(Debug, Deserialize)]
pub(crate) struct WebhookSpec {
    url: String,
    pub(crate) secret: SecretString,
    #[serde(default)]
    events: Vec<String>,
}

/// What a client may send to `POST /v1/batches` (unknown fields are ignored, as newer
/// SDKs may send some).
#[derive(Debug, Deserialize)]
pub(crate) struct CreateBatch {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    pub(crate) metadata: Option<HashMap<String, String>>,
    output_expires_after: Option<ExpiresAfter>,
    class: Option<JobClass>,
    pub(crate) webhook: Option<WebhookSpec>,
    /// What its lines may cost together, in USD.
    max_cost_usd: Option<f64>,
    /// The share of its finished lines that may fail before it is stopped.
    max_error_rate: Option<f64>,
    /// When its forecast says it cannot finish within its window: refuse it (default), or
    /// accept.
    #[serde(default)]
    pub(crate) on_deadline_risk: OnDeadlineRisk,
}

/// `POST /v1/batches`.
#[utoipa::path(
    post,
    path = "/v1/batches",
    operation_id = "create_batch",
    tag = "batches",
    request_body(content = Object, description = "`input_file_id`, `endpoint`, `completion_window`, `metadata`; tollgate's `class`, `webhook`, `max_cost_usd`, `max_error_rate`, `on_deadline_risk` (`refuse` or `accept`)"),
    responses(
        (status = 200, description = "OpenAI's batch object, with tollgate's `eta` (`{p50, p90}`, RFC 3339)", body = Object),
        (status = 400, description = "`invalid_request`, `unsupported_endpoint`, `invalid_completion_window`, `invalid_file_purpose`, `invalid_webhook_secret`, `webhook_url_not_allowed`", body = doc::ErrorBody),
        (status = 404, description = "`not_found`: no such input file", body = doc::ErrorBody),
        (status = 422, description = "`deadline_unmeetable`: the batch's forecast p90 is after its window's end; `earliest_feasible_at` says when it would end", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn create(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let Checked {
        req,
        endpoint,
        window,
        output_expires_secs,
        class,
    } = check_create(json_body(body)?, &state.config.batches)?;
    if let Some(hook) = &req.webhook {
        tollgate_workers::webhooks::check_url(&hook.url, state.config.webhooks.allow_private_addresses)
            .await
            .map_err(|refused| {
                ApiError::bad_request(ApiErrorCode::WebhookUrlNotAllowed, refused.to_string())
                    .with_param("webhook")
            })?;
    }
    let limits = &state.config.batches;
    let file = store::get_file(&state.pool, Some(&tenant.name), &req.input_file_id)
        .await?
        .ok_or_else(|| ApiError::not_found("file").with_param("input_file_id"))?;
    if file.purpose != PURPOSE_BATCH {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidFilePurpose,
            "the input file must have been uploaded with purpose \"batch\"",
        )
        .with_param("input_file_id"));
    }
    if file.lines as u64 > limits.max_lines {
        return Err(ApiError::bad_request(
            ApiErrorCode::TooManyLines,
            format!(
                "the input file has {} lines; at most {} are accepted",
                file.lines, limits.max_lines
            ),
        )
        .with_param("input_file_id"));
    }
    if file.lines == 0 {
        return Err(
            ApiError::bad_request(ApiErrorCode::EmptyFile, "the input file has no lines")
                .with_param("input_file_id"),
        );
    }
    let now = state.clock.now().trunc_subsecs(6);
    let mut batch = BatchRow {
        input_file_id: Some(file.id.clone()),
        metadata: req.metadata.map(|m| json!(m)),
        output_expires_secs,
        api_key: tenant.key,
        max_cost_usd: req.max_cost_usd,
        max_error_rate: req.max_error_rate,
        ..BatchRow::in_progress(
            new_batch_id(),
            &tenant.name,
            endpoint,
            class,
            req.completion_window,
            window,
            now,
        )
    };
    let lines = u64::try_from(file.lines).unwrap_or(0);
    start(
        &state,
        &mut batch,
        lines,
        req.webhook.as_ref(),
        Input::File(file.id),
        &tenant.scopes,
        req.on_deadline_risk,
    )
    .await?;
    let counts = RequestCounts {
        total: i64::from(batch.total),
        completed: 0,
        failed: i64::from(batch.rejected),
    };
    Ok(Json(batch_view(&batch, counts)))
}

/// Where a batch's lines come from.
pub(crate) enum Input {
    /// Its input file, line by line.
    File(String),
    /// Requests given inline, as a Message Batch's: `(custom_id, request)` in order, the
    /// custom_ids unique.
    Inline(Vec<(String, Value)>),
}

/// Creates `batch` with its jobs, all in one transaction: room in the tenant's queue for
/// its `lines`, the row, its webhook, a job per valid line (each bad one recorded for the
/// error file), its forecast and the totals, which it sets on `batch` too. A batch whose
/// forecast p90 is after its window's end is refused `deadline_unmeetable` (nothing of it
/// is written) unless `risk` accepts it.
pub(crate) async fn start(
    state: &AppState,
    batch: &mut BatchRow,
    lines: u64,
    webhook: Option<&WebhookSpec>,
    input: Input,
    scopes: &Arc<KeyScopes>,
    risk: OnDeadlineRisk,
) -> Result<(), ApiError> {
    // What the key may submit: the batch's endpoint and class here, each line's model as
    // it is read.
    if let Some((field, reason)) = scopes.refuses(None, batch.endpoint, batch.class, 0) {
        return Err(crate::jobs::scope_refusal(field, reason));
    }
    // Read before the transaction takes its connection (`Forecaster::inputs`).
    let inputs = state.forecasts.inputs(&state.pool, batch.created_at).await?;
    let mut tx = state.pool.begin().await.map_err(db)?;
    // Every line may become a job: the tenant's queue of the class must hold them all.
    // Checked under the queue's lock, held until the lines are in, as every submission
    // to a capped queue is (`jobs::reserve_queue_room`).
    crate::jobs::reserve_queue_room(state, &mut tx, &batch.tenant, batch.class, lines).await?;
    store::insert_batch(&mut *tx, batch).await?;
    if let Some(usd) = batch.max_cost_usd {
        let cap = tollgate::buckets::batch_cap_spec(&batch.id, usd);
        store::sync_buckets(&mut *tx, &[cap], batch.created_at).await?;
    }
    if let Some(hook) = webhook {
        let events = if hook.events.is_empty() {
            EVENT_TYPES.iter().map(|e| (*e).to_owned()).collect()
        } else {
            hook.events.clone()
        };
        let key = state.config.webhooks.sealing_key().map_err(ApiError::internal)?;
        let secret = key.seal(&batch.tenant, hook.secret.expose_secret());
        store::add_batch_endpoint(
            &mut *tx,
            &batch.tenant,
            &batch.id,
            &hook.url,
            &secret,
            &events,
            batch.created_at,
        )
        .await?;
    }
    let started = std::time::Instant::now();
    let ingested = match input {
        Input::File(file) => ingest(state, &mut tx, batch, &file, scopes.clone()).await?,
        Input::Inline(requests) => ingest_inline(state, &mut tx, batch, requests, scopes.clone()).await?,
    };
    store::set_batch_totals(&mut *tx, &batch.id, ingested.total, ingested.rejected).await?;
    let check = match risk {
        OnDeadlineRisk::Refuse => Check::FinishBy(batch.expires_at),
        OnDeadlineRisk::Accept => Check::None,
    };
    if let Some(eta) = forecast(state, &inputs, &mut tx, batch, check).await? {
        store::set_batch_eta(&mut *tx, &batch.id, eta.p50, eta.p90).await?;
        batch.eta_p50 = Some(eta.p50);
        batch.eta_p90 = Some(eta.p90);
    }
    tx.commit().await.map_err(db)?;
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(
        batch = %batch.id,
        lines = ingested.total,
        rejected = ingested.rejected,
        lines_per_sec = (f64::from(ingested.total) / secs.max(1e-9)).round(),
        "batch ingested"
    );
    state.notifications.work_queued();
    batch.total = ingested.total;
    batch.rejected = ingested.rejected;
    Ok(())
}

/// The forecast of `batch`'s queued lines (each model's lines together; the latest of
/// them), judged by `check`, in the transaction that inserted them.
async fn forecast(
    state: &AppState,
    inputs: &Inputs,
    conn: &mut PgConnection,
    batch: &BatchRow,
    check: Check,
) -> Result<Option<tollgate::forecast::Eta>, ApiError> {
    let models = store::batch_lines_by_model(&mut *conn, &batch.id).await?;
    let per_line = |tokens: f64, q: &store::Queued| (tokens / q.jobs.max(1.0)).round() as i32;
    let ones: Vec<NewJob> = models
        .iter()
        .map(|q| NewJob {
            id: JobId::new(),
            tenant: batch.tenant.clone(),
            class: batch.class,
            priority: batch.priority,
            endpoint: batch.endpoint,
            request: Value::Null,
            model: q.model.clone(),
            idempotency_key: None,
            metadata: None,
            deadline: batch.expires_at,
            max_attempts: 1,
            estimated_input_tokens: per_line(q.input_tokens, q),
            estimated_output_tokens: per_line(q.output_tokens, q),
            created_at: batch.created_at,
            stream: false,
            api_key: batch.api_key,
            traceparent: None,
            eta_p50: None,
            eta_p90: None,
            caller_process: None,
        })
        .collect();
    let work: Vec<Of<'_>> = ones
        .iter()
        .zip(&models)
        .map(|(one, q)| Of {
            one,
            jobs: q.jobs,
            input_tokens: q.input_tokens,
            output_tokens: q.output_tokens,
            batch_id: Some(&batch.id),
        })
        .collect();
    let control = state.tenants.snapshot();
    state
        .forecasts
        .forecast(inputs, conn, &control, &work, check, batch.created_at)
        .await
}

/// A `POST /v1/batches` body, checked as far as it can be without the database and the
/// DNS (the input file and the webhook URL are the handler's).
pub(crate) struct Checked {
    pub(crate) req: CreateBatch,
    /// What the batch's lines call.
    pub(crate) endpoint: Endpoint,
    /// The `completion_window`, within `batches.max_completion_window_secs`.
    pub(crate) window: std::time::Duration,
    pub(crate) output_expires_secs: i64,
    pub(crate) class: JobClass,
}

/// Checks a `POST /v1/batches` body (parsed): endpoint, window, metadata, output expiry,
/// the webhook's secret and events, class.
pub(crate) fn check_create(value: Value, limits: &BatchesConfig) -> Result<Checked, ApiError> {
    let req: CreateBatch = serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(ApiErrorCode::InvalidRequest, format!("invalid batch: {e}")))?;
    let endpoint = Endpoint::parse(&req.endpoint).ok_or_else(|| {
        let supported: Vec<&str> = Endpoint::all().iter().map(|e| e.as_str()).collect();
        ApiError::bad_request(
            ApiErrorCode::UnsupportedEndpoint,
            format!(
                "{:?} is not an endpoint tollgate runs batches for: {}",
                req.endpoint,
                supported.join(", ")
            ),
        )
        .with_param("endpoint")
    })?;
    let window = parse_window(&req.completion_window)
        .filter(|w| w.as_secs() <= limits.max_completion_window_secs)
        .ok_or_else(|| {
            ApiError::bad_request(
                ApiErrorCode::InvalidCompletionWindow,
                format!(
                    "`completion_window` must be like \"24h\" or \"15m\", at most {}s",
                    limits.max_completion_window_secs
                ),
            )
            .with_param("completion_window")
        })?;
    if let Some(meta) = &req.metadata
        && (meta.len() > MAX_METADATA_PAIRS
            || meta
                .iter()
                .any(|(k, v)| k.chars().count() > MAX_METADATA_KEY || v.chars().count() > MAX_METADATA_VALUE))
    {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "`metadata` takes at most 16 pairs, keys up to 64 and values up to 512 characters",
        )
        .with_param("metadata"));
    }
    let output_expires_secs = match &req.output_expires_after {
        Some(e) if e.anchor == "created_at" && EXPIRES_AFTER_RANGE.contains(&e.seconds) => e.seconds,
        Some(_) => {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidRequest,
                "`output_expires_after` must be {anchor: \"created_at\", seconds: 3600..2592000}",
            )
            .with_param("output_expires_after"));
        }
        None => limits.output_expires_secs.min(i64::MAX as u64) as i64,
    };
    if let Some(hook) = &req.webhook {
        check_webhook(hook)?;
    }
    if req
        .max_cost_usd
        .is_some_and(|usd| !(usd.is_finite() && usd > 0.0 && usd < 1e9))
    {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "`max_cost_usd` must be a number of USD above 0",
        )
        .with_param("max_cost_usd"));
    }
    if req
        .max_error_rate
        .is_some_and(|rate| !(0.0..=1.0).contains(&rate))
    {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "`max_error_rate` must be from 0 to 1 (a share of the finished lines)",
        )
        .with_param("max_error_rate"));
    }
    let class = req.class.unwrap_or(JobClass::Batch);
    check_class(class)?;
    Ok(Checked {
        req,
        endpoint,
        window,
        output_expires_secs,
        class,
    })
}

/// Refuses `interactive` for a batch: interactive precedence (and its reserve) is for
/// callers waiting on an answer.
fn check_class(class: JobClass) -> Result<(), ApiError> {
    if class == JobClass::Interactive {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "a batch runs as `standard`, `background` or `batch`; `interactive` is for synchronous calls",
        )
        .with_param("class"));
    }
    Ok(())
}

/// A webhook's secret and events (its URL is checked by resolving it, in the handler).
fn check_webhook(hook: &WebhookSpec) -> Result<(), ApiError> {
    let bad =
        |code: ApiErrorCode, message: String| ApiError::bad_request(code, message).with_param("webhook");
    Secret::parse(hook.secret.expose_secret())
        .map_err(|e| bad(ApiErrorCode::InvalidWebhookSecret, e.to_string()))?;
    match hook.events.iter().find(|e| !EVENT_TYPES.contains(&e.as_str())) {
        Some(unknown) => Err(bad(
            ApiErrorCode::InvalidRequest,
            format!(
                "unknown webhook event {unknown:?} (known: {})",
                EVENT_TYPES.join(", ")
            ),
        )),
        None => Ok(()),
    }
}

/// Lines read from an input file.
struct Ingested {
    total: i32,
    rejected: i32,
}

/// Reads the batch's input file and inserts its jobs and rejected lines.
///
/// Pipelined over the file's stored chunks: while one chunk's valid lines are inserted
/// (on `conn`), the next chunk's lines are split, checked and estimated on a blocking
/// thread — the CPU work and the database's work overlap instead of taking turns.
async fn ingest(
    state: &AppState,
    conn: &mut PgConnection,
    batch: &BatchRow,
    file: &str,
    scopes: Arc<KeyScopes>,
) -> Result<Ingested, ApiError> {
    let insert = Inserter::new(state);
    let mut reader = LineReader {
        lines: LineSplitter::new(state.config.batches.max_line_bytes),
        check: LineChecker {
            config: state.tenants.config(),
            endpoint: batch.endpoint,
            seen: HashSet::new(),
            at: "body.",
            scopes,
        },
    };
    let mut jobs: Vec<LineJob> = Vec::new();
    let mut rejected: Vec<LineError> = Vec::new();
    let mut total = 0i32;
    let mut seq = 0;
    let mut data = store::file_chunk(&mut *conn, file, seq).await?;
    loop {
        let last = data.is_none();
        let block = data.take().unwrap_or_default();
        let read = tokio::task::spawn_blocking(move || {
            let read = reader.read(&block, last);
            (reader, read)
        });
        // Meanwhile: insert what the previous block gave, and fetch the next block.
        if !last {
            insert.full_chunks(conn, batch, &mut jobs).await?;
            seq += 1;
            data = store::file_chunk(&mut *conn, file, seq).await?;
        }
        let (back, read) = read
            .await
            .map_err(|e| ApiError::internal(format!("reading the batch's lines: {e}")))?;
        reader = back;
        total += read.total;
        jobs.extend(read.jobs);
        rejected.extend(read.rejected);
        if last {
            break;
        }
    }
    insert.rest(conn, batch, jobs, &rejected).await?;
    Ok(Ingested {
        total,
        rejected: rejected.len() as i32,
    })
}

/// Checks a Message Batch's requests (on a blocking thread: they may be many) and
/// inserts their jobs and rejections.
async fn ingest_inline(
    state: &AppState,
    conn: &mut PgConnection,
    batch: &BatchRow,
    requests: Vec<(String, Value)>,
    scopes: Arc<KeyScopes>,
) -> Result<Ingested, ApiError> {
    let check = LineChecker {
        config: state.tenants.config(),
        endpoint: batch.endpoint,
        seen: HashSet::new(),
        at: "params.",
        scopes,
    };
    let total = requests.len() as i32;
    let (jobs, rejected) = tokio::task::spawn_blocking(move || {
        let mut jobs = Vec::with_capacity(requests.len());
        let mut rejected = Vec::new();
        for (number, (custom_id, request)) in (1..).zip(requests) {
            match check.job(number, custom_id, request) {
                Ok(job) => jobs.push(job),
                Err(e) => rejected.push(e),
            }
        }
        (jobs, rejected)
    })
    .await
    .map_err(|e| ApiError::internal(format!("checking the batch's requests: {e}")))?;
    Inserter::new(state).rest(conn, batch, jobs, &rejected).await?;
    Ok(Ingested {
        total,
        rejected: rejected.len() as i32,
    })
}

/// Inserts a batch's jobs `batches.insert_chunk` at a time.
struct Inserter {
    chunk: usize,
    max_attempts: i32,
}

impl Inserter {
    fn new(state: &AppState) -> Self {
        Self {
            chunk: state.config.batches.insert_chunk.max(1),
            max_attempts: state.config.retry.max_attempts.min(i32::MAX as u32) as i32,
        }
    }

    /// Inserts whole chunks of `jobs`, leaving the rest in it.
    async fn full_chunks(
        &self,
        conn: &mut PgConnection,
        batch: &BatchRow,
        jobs: &mut Vec<LineJob>,
    ) -> Result<(), ApiError> {
        while jobs.len() >= self.chunk {
            let part = columns(jobs.drain(..self.chunk));
            store::insert_batch_jobs(&mut *conn, batch, &part, self.max_attempts).await?;
        }
        Ok(())
    }

    /// Inserts all of `jobs` and the `rejected` lines.
    async fn rest(
        &self,
        conn: &mut PgConnection,
        batch: &BatchRow,
        mut jobs: Vec<LineJob>,
        rejected: &[LineError],
    ) -> Result<(), ApiError> {
        self.full_chunks(conn, batch, &mut jobs).await?;
        if !jobs.is_empty() {
            store::insert_batch_jobs(&mut *conn, batch, &columns(jobs), self.max_attempts).await?;
        }
        for part in rejected.chunks(self.chunk) {
            store::insert_line_errors(&mut *conn, &batch.id, part).await?;
        }
        Ok(())
    }
}

/// Splits a file's blocks into lines and checks them, remembering what it saw.
struct LineReader {
    lines: LineSplitter,
    check: LineChecker,
}

/// What one block of the file held.
struct Read {
    total: i32,
    jobs: Vec<LineJob>,
    rejected: Vec<LineError>,
}

impl LineReader {
    fn read(&mut self, block: &[u8], last: bool) -> Read {
        let mut read = Read {
            total: 0,
            jobs: Vec::new(),
            rejected: Vec::new(),
        };
        for (number, line) in self.lines.feed(block, last) {
            read.total += 1;
            match self.check.line(number, line) {
                Ok(job) => read.jobs.push(job),
                Err(e) => read.rejected.push(e),
            }
        }
        read
    }
}

/// A valid line, ready to become a job.
struct LineJob {
    custom_id: String,
    line: i32,
    model: String,
    request: Value,
    estimated_input_tokens: i32,
    estimated_output_tokens: i32,
}

/// Valid lines as the columns of their insert.
fn columns(lines: impl IntoIterator<Item = LineJob>) -> BatchJobs {
    let mut jobs = BatchJobs::default();
    for l in lines {
        jobs.ids.push(JobId::new().0);
        jobs.requests.push(l.request);
        jobs.models.push(l.model);
        jobs.custom_ids.push(l.custom_id);
        jobs.lines.push(l.line);
        jobs.estimated_input_tokens.push(l.estimated_input_tokens);
        jobs.estimated_output_tokens.push(l.estimated_output_tokens);
    }
    jobs
}

/// Validates lines one by one, remembering the custom_ids seen.
struct LineChecker {
    config: Arc<Config>,
    /// The batch's endpoint: every line's `url`, and what its body is checked as.
    endpoint: Endpoint,
    seen: HashSet<String>,
    /// Where a line's request is, as an error's `param` names it (`body.`, `params.`).
    at: &'static str,
    /// What the batch's key may submit (each line's model).
    scopes: Arc<KeyScopes>,
}

impl LineChecker {
    fn line(&mut self, number: i32, line: Line<'_>) -> Result<LineJob, LineError> {
        let reject = |custom_id: Option<&str>, code: &str, message: String| LineError {
            line: number,
            custom_id: custom_id.map(str::to_owned),
            code: code.to_owned(),
            message,
        };
        let text = match line {
            Line::Text(t) => t,
            Line::TooLarge => {
                return Err(reject(
                    None,
                    "line_too_large",
                    format!(
                        "the line is longer than {} bytes (batches.max_line_bytes)",
                        self.config.batches.max_line_bytes
                    ),
                ));
            }
        };
        let LineEnvelope { custom_id, request } = parse_line(text, self.endpoint, &mut self.seen)
            .map_err(|r| reject(r.custom_id.as_deref(), r.code, r.message))?;
        self.job(number, custom_id, request)
    }

    /// A line's request, checked as its endpoint's requests are.
    fn job(&self, number: i32, custom_id: String, request: Value) -> Result<LineJob, LineError> {
        let reject = |code: &str, message: String| LineError {
            line: number,
            custom_id: Some(custom_id.clone()),
            code: code.to_owned(),
            message,
        };
        if request.get("stream").and_then(Value::as_bool) == Some(true) {
            return Err(reject(
                "stream_not_supported",
                "batch requests cannot stream".to_owned(),
            ));
        }
        let checked = requests::check(&self.config, self.endpoint, &request, self.at)
            .map_err(|e| reject(e.code.as_str(), e.message))?;
        if let Some(reason) = self.scopes.refuses_model(&checked.model) {
            return Err(reject(ApiErrorCode::KeyNotPermitted.as_str(), reason));
        }
        Ok(LineJob {
            estimated_input_tokens: checked.estimated_input_tokens,
            estimated_output_tokens: checked.estimated_output_tokens,
            custom_id,
            line: number,
            model: checked.model,
            request,
        })
    }
}

/// The batch as clients see it (OpenAI's batch object, plus tollgate's `class`).
pub(crate) fn batch_view(b: &BatchRow, counts: RequestCounts) -> Value {
    let t = |v: Option<DateTime<Utc>>| v.map(unix);
    json!({
        "id": b.id,
        "object": "batch",
        "tenant": b.tenant,
        "endpoint": b.endpoint,
        "model": null,
        "errors": b.errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": unix(b.created_at),
        "in_progress_at": t(b.in_progress_at),
        "expires_at": unix(b.expires_at),
        "finalizing_at": t(b.finalizing_at),
        "completed_at": t(b.completed_at),
        "failed_at": t(b.failed_at),
        "expired_at": t(b.expired_at),
        "cancelling_at": t(b.cancelling_at),
        "cancelled_at": t(b.cancelled_at),
        "request_counts": counts,
        "metadata": b.metadata,
        "usage": b.usage,
        "class": b.class,
        "priority": b.priority,
        "max_cost_usd": b.max_cost_usd,
        "max_error_rate": b.max_error_rate,
        // Since when its queued lines are held (`POST /v1/batches/{id}/pause`); null: running.
        "paused_at": t(b.paused_at),
        // When its last line was forecast at creation to finish, p50 and p90 (RFC 3339).
        "eta": crate::forecasts::eta_view(b.eta_p50, b.eta_p90),
    })
}

/// `request_counts` of each batch: frozen for finished ones, from their jobs otherwise.
async fn counts_of(state: &AppState, batches: &[BatchRow]) -> Result<Vec<RequestCounts>, ApiError> {
    let open: Vec<&str> = batches
        .iter()
        .filter(|b| b.completed.is_none())
        .map(|b| b.id.as_str())
        .collect();
    let live = store::job_counts(&state.pool, &open).await?;
    Ok(batches
        .iter()
        .map(|b| {
            let (completed, failed) = match (b.completed, b.failed) {
                (Some(c), Some(f)) => (i64::from(c), i64::from(f)),
                _ => {
                    let (ok, failed) = live.get(&b.id).copied().unwrap_or_default();
                    (ok, failed + i64::from(b.rejected))
                }
            };
            RequestCounts {
                total: i64::from(b.total),
                completed,
                failed,
            }
        })
        .collect())
}

async fn one_view(state: &AppState, batch: BatchRow) -> Result<Json<Value>, ApiError> {
    let counts = counts_of(state, std::slice::from_ref(&batch)).await?;
    let mut view = batch_view(&batch, counts.first().copied().unwrap_or_default());
    // What its lines were charged so far and hold; lines sent through providers' batch
    // APIs, and what the batch price saved over online.
    let costs = store::batch_costs(&state.pool, &batch.id).await?;
    view["cost"] = json!({"charged_usd": costs.charged / 1e6, "reserved_usd": costs.reserved / 1e6});
    view["provider_batch"] = json!({
        "lines": costs.provider_batch_lines,
        "estimated_savings_usd": costs.saved / 1e6,
    });
    Ok(Json(view))
}

/// `GET /v1/batches/{id}`.
#[utoipa::path(
    get,
    path = "/v1/batches/{id}",
    operation_id = "get_batch",
    tag = "batches",
    params(("id" = String, Path, description = "Batch id")),
    responses(
        (status = 200, description = "OpenAI's batch object", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn get(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let batch = store::get_batch(&state.pool, viewer.tenant(), &id)
        .await?
        .ok_or_else(|| ApiError::not_found("batch"))?;
    one_view(&state, batch).await
}

/// `POST /v1/batches/{id}/cancel`: `cancelling` now (its unfinished jobs cancelled),
/// `cancelled` once maintenance has written its files.
#[utoipa::path(
    post,
    path = "/v1/batches/{id}/cancel",
    operation_id = "cancel_batch",
    tag = "batches",
    params(("id" = String, Path, description = "Batch id")),
    responses(
        (status = 200, description = "The batch, `cancelling`", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`batch_already_finished`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn cancel(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let mut tx = state.pool.begin().await.map_err(db)?;
    let outcome = store::cancel_batch(&mut tx, viewer.tenant(), &id, state.clock.now()).await?;
    tx.commit().await.map_err(db)?;
    controlled(&state, outcome).await
}

/// Answers a batch control: the batch, or why it was not changed.
async fn controlled(state: &AppState, outcome: BatchControl) -> Result<Json<Value>, ApiError> {
    match outcome {
        BatchControl::Changed(batch) => one_view(state, batch).await,
        BatchControl::Finished(batch) => Err(ApiError::new(
            StatusCode::CONFLICT,
            ApiErrorCode::BatchAlreadyFinished,
            format!("the batch already finished as {}", batch.status),
        )),
        BatchControl::NotFound => Err(ApiError::not_found("batch")),
    }
}

/// Runs `change` on batch `id` of `viewer` (any tenant's for the admin key) in one
/// transaction.
async fn control(
    state: &AppState,
    viewer: &Viewer,
    id: &str,
    change: BatchChange,
) -> Result<Json<Value>, ApiError> {
    let mut tx = state.pool.begin().await.map_err(db)?;
    if let Some(class) = change.class {
        // Its queued lines join `class`'s queue: they must fit its cap like new jobs.
        let Some(batch) = store::get_batch(&mut *tx, viewer.tenant(), id).await? else {
            return Err(ApiError::not_found("batch"));
        };
        let queued = store::queued_batch_lines(&mut *tx, id).await?;
        crate::jobs::reserve_queue_room(
            state,
            &mut tx,
            &batch.tenant,
            class,
            u64::try_from(queued).unwrap_or(0),
        )
        .await?;
    }
    let outcome = store::control_batch(&mut tx, viewer.tenant(), id, &change, state.clock.now()).await?;
    tx.commit().await.map_err(db)?;
    controlled(state, outcome).await
}

/// Pauses a batch: its queued lines are not admitted until it resumes; lines already
/// admitted or running go on. Pausing a paused batch changes nothing.
#[utoipa::path(
    post,
    path = "/v1/batches/{id}/pause",
    operation_id = "pause_batch",
    tag = "batches",
    params(("id" = String, Path, description = "Batch id")),
    responses(
        (status = 200, description = "The batch, `paused_at` set", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`batch_already_finished`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn pause(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let change = BatchChange {
        paused: Some(true),
        ..BatchChange::default()
    };
    control(&state, &viewer, &id, change).await
}

/// Resumes a paused batch: its queued lines are admitted again.
#[utoipa::path(
    post,
    path = "/v1/batches/{id}/resume",
    operation_id = "resume_batch",
    tag = "batches",
    params(("id" = String, Path, description = "Batch id")),
    responses(
        (status = 200, description = "The batch, `paused_at` null", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`batch_already_finished`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn resume(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let change = BatchChange {
        paused: Some(false),
        ..BatchChange::default()
    };
    control(&state, &viewer, &id, change).await
}

/// `PATCH /v1/batches/{id}`: each field given becomes the batch's and its queued lines'.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BatchPatch {
    /// -1000 to 1000, as a job's.
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    class: Option<JobClass>,
    /// RFC 3339, in the future: its lines' deadline and the batch's `expires_at`.
    #[serde(default)]
    deadline: Option<DateTime<Utc>>,
}

/// Changes a running batch's priority, class or deadline: its queued lines take them
/// (lines admitted or running keep theirs); a class's queue cap holds as for new jobs.
#[utoipa::path(
    patch,
    path = "/v1/batches/{id}",
    operation_id = "update_batch",
    tag = "batches",
    params(("id" = String, Path, description = "Batch id")),
    request_body = BatchPatch,
    responses(
        (status = 200, description = "The batch as changed", body = Object),
        (status = 400, description = "`invalid_request` or `invalid_deadline`, `param` naming the field", body = doc::ErrorBody),
        (status = 403, description = "`key_not_permitted`: the key may not use that class or priority", body = doc::ErrorBody),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`batch_already_finished`", body = doc::ErrorBody),
        (status = 429, description = "`queue_full`: the class's queue cannot take its queued lines", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn update(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let Some(batch) = store::get_batch(&state.pool, viewer.tenant(), &id).await? else {
        return Err(ApiError::not_found("batch"));
    };
    let patch: BatchPatch = serde_json::from_value(json_body(body)?)
        .map_err(|e| ApiError::bad_request(ApiErrorCode::InvalidRequest, e.to_string()))?;
    if patch
        .priority
        .is_some_and(|p| !crate::jobs::PRIORITY_RANGE.contains(&p))
    {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            "`priority` must be between -1000 and 1000",
        )
        .with_param("priority"));
    }
    if let Some(class) = patch.class {
        check_class(class)?;
    }
    if patch.deadline.is_some_and(|d| d <= state.clock.now()) {
        return Err(
            ApiError::bad_request(ApiErrorCode::InvalidDeadline, "`deadline` must be in the future")
                .with_param("deadline"),
        );
    }
    let (class, priority) = (
        patch.class.unwrap_or(batch.class),
        patch.priority.unwrap_or(batch.priority),
    );
    // A tenant's key is held to its scopes; the admin key to none.
    if let Viewer::Tenant(tenant) = &viewer
        && let Some((field, reason)) = tenant.scopes.refuses(None, batch.endpoint, class, priority)
    {
        return Err(crate::jobs::scope_refusal(field, reason));
    }
    let change = BatchChange {
        paused: None,
        priority: patch.priority,
        class: patch.class,
        deadline: patch.deadline.map(|d| d.trunc_subsecs(6)),
    };
    control(&state, &viewer, &id, change).await
}

/// `GET /v1/batches/{id}/results`: where to start.
#[derive(Debug, Deserialize)]
pub(crate) struct ResultsParams {
    /// The `x-next-cursor` of the previous read; from the start without it.
    after: Option<String>,
    /// Lines at most (default and most 1,000).
    limit: Option<i64>,
}

/// Most lines one read of a batch's results returns.
const MAX_RESULT_LINES: i64 = 1000;

/// A batch's finished lines while it runs, in the order they finished, as JSONL in the
/// output file's shape (a failed line in the error file's); the cursor for the next read
/// is in `x-next-cursor`. Reading from each cursor in turn gives every line once; a line
/// appears as soon as every transaction already running when it ended has ended too.
#[utoipa::path(
    get,
    path = "/v1/batches/{id}/results",
    operation_id = "batch_results",
    tag = "batches",
    params(
        ("id" = String, Path, description = "Batch id"),
        ("after" = Option<String>, Query, description = "The previous read's `x-next-cursor`"),
        ("limit" = Option<i64>, Query, description = "Lines at most, 1 to 1000 (default 1000)"),
    ),
    responses(
        (status = 200, description = "JSONL: one line per finished request; header `x-next-cursor`", body = String, content_type = "application/jsonl"),
        (status = 400, description = "`invalid_request`: a cursor or limit that is not one", body = doc::ErrorBody),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn results(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
    Query(params): Query<ResultsParams>,
) -> Result<axum::response::Response, ApiError> {
    let bad = |param: &str, message: &str| {
        ApiError::bad_request(ApiErrorCode::InvalidRequest, message.to_owned()).with_param(param.to_owned())
    };
    let after = match params.after.as_deref() {
        None => ResultsCursor::START,
        Some(cursor) => cursor
            .parse()
            .map_err(|()| bad("after", "`after` must be a cursor from `x-next-cursor`"))?,
    };
    let limit = params.limit.unwrap_or(MAX_RESULT_LINES);
    if !(1..=MAX_RESULT_LINES).contains(&limit) {
        return Err(bad("limit", "`limit` must be from 1 to 1000"));
    }
    let Some(batch) = store::get_batch(&state.pool, viewer.tenant(), &id).await? else {
        return Err(ApiError::not_found("batch"));
    };
    let status = batch.status();
    let lines = store::batch_results_after(&state.pool, &id, after, limit, status.is_terminal()).await?;
    let next = lines
        .last()
        .and_then(|l| {
            Some(ResultsCursor {
                xid: l.result_xid?,
                id: l.id,
            })
        })
        .unwrap_or(after);
    let mut body = String::new();
    for line in &lines {
        let (_, value) = tollgate_workers::batches::job_line(line, status);
        body.push_str(&value.to_string());
        body.push('\n');
    }
    Ok((
        [
            (axum::http::header::CONTENT_TYPE, "application/jsonl".to_owned()),
            (
                axum::http::HeaderName::from_static("x-next-cursor"),
                next.to_string(),
            ),
        ],
        body,
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListParams {
    after: Option<String>,
    limit: Option<i64>,
}

/// `GET /v1/batches?after=&limit=`: newest first.
#[utoipa::path(
    get,
    path = "/v1/batches",
    operation_id = "list_batches",
    tag = "batches",
    params(
        ("limit" = Option<i64>, Query, description = "1 to 100 (default 20)"),
        ("after" = Option<String>, Query, description = "The previous page's `last_id`"),
    ),
    responses(
        (status = 200, description = "`{object: \"list\", data, first_id, last_id, has_more}`", body = Object),
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
    let cursor = params
        .after
        .as_deref()
        .map_or(store::Cursor::Newest, store::Cursor::After);
    let batches = store::list_batches(&state.pool, viewer.tenant(), BATCH_PREFIX, cursor, limit + 1).await?;
    let counts = counts_of(&state, &batches).await?;
    let rows: Vec<(BatchRow, RequestCounts)> = batches.into_iter().zip(counts).collect();
    Ok(Json(paging::page(
        rows,
        limit,
        |(b, _)| b.id.clone(),
        |(b, c)| batch_view(b, *c),
    )))
}
