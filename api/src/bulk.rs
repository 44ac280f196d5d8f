//! `POST /v1/jobs/bulk`: many jobs in one request, inserted by one statement in one
//! transaction — all of them or none. Each item is what `POST /v1/jobs` takes and is
//! checked the same way; the first bad item fails the whole request with its index in
//! `param` (`jobs[17].request.model`), so nothing is ever half-written.
//!
//! A bulk body may be `server.max_bulk_body_bytes` (64 MiB), so it is never parsed into
//! one tree of values (10-16 times its size on the heap): the envelope is read with each
//! item left as its JSON text, borrowed from the body ([`BulkBody`]); each item must fit
//! in what one job's body may be (`server.max_body_bytes`, else `413 item_too_large`);
//! items are then parsed one at a time, checked and estimated, and keep only their
//! request's text, which PostgreSQL parses into `jsonb` at the insert. That work —
//! parsing, and the BPE counts of the estimates — runs on a blocking thread
//! ([`prepare`]), so a large bulk does not stall the requests sharing the runtime.
//!
//! Each job gets its `eta` ([`forecast`]); one whose `deadline` is checked (not
//! `"on_deadline_risk": "accept"`) and forecast to miss it refuses the whole bulk
//! `422 deadline_unmeetable`, its index in `param`, decided under the forecast locks as a
//! single job's is.

use std::collections::{BTreeMap, HashSet};
use tollgate::vocab::ApiErrorCode;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SubsecRound, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use sqlx::PgConnection;
use tollgate::config::Config;
use tollgate::forecast::Eta;
use tollgate::model::NewJob;
use tollgate::store::{self, BulkInserted};
use tollgate::tenants::Caller;
use tollgate::vocab::JobClass;

use crate::AppState;
use crate::auth::AuthTenant;
use crate::error::ApiError;
use crate::forecasts::{Check, Inputs, Of, eta_view};
use crate::jobs::{
    SubmitJob, idempotency_key_reused, may_hold_nul, new_job, queue_has_room, refuse_nul, reserve_queue_room,
};
use crate::openapi as doc;

/// One submitted job's fate, in the order sent.
#[derive(Debug, Serialize)]
struct Accepted {
    id: String,
    /// The idempotency key was used before, for the same request: this is that job.
    existing: bool,
    /// When the job is forecast to finish (`null` without a forecast, and for a replay:
    /// `GET /v1/jobs/{id}` has the first submission's).
    eta: Value,
}

/// The body as parsed first: each item is a slice of the body's text, not yet read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody<'a> {
    #[serde(borrow)]
    jobs: Vec<&'a RawValue>,
}

/// The part of an item kept as sent: its request's JSON text.
#[derive(Debug, Deserialize)]
struct RequestText<'a> {
    #[serde(borrow)]
    request: &'a RawValue,
}

/// An item as read for [`classes_asked`]: its class alone, the rest skipped.
#[derive(Debug, Deserialize)]
struct ItemClass {
    class: Option<JobClass>,
}

/// The jobs a bulk body asks for, by class, read without reading the requests (a lexer's
/// pass over the body): for refusing a bulk to a full queue before the work of
/// [`prepare`]. None when the body or an item does not parse; `prepare` says why.
fn classes_asked(body: &[u8]) -> Option<BTreeMap<JobClass, u64>> {
    let parsed: BulkBody = serde_json::from_slice(body).ok()?;
    let mut asked = BTreeMap::new();
    for item in parsed.jobs {
        let item: ItemClass = serde_json::from_str(item.get()).ok()?;
        *asked
            .entry(item.class.unwrap_or(JobClass::Standard))
            .or_insert(0u64) += 1;
    }
    Some(asked)
}

/// A checked item, ready to insert: its request is the client's JSON text.
pub type BulkJob = NewJob<Box<RawValue>>;

/// A bulk's items, checked, in the order sent.
pub struct Prepared {
    pub jobs: Vec<BulkJob>,
    /// Each job's deadline check (its own `deadline` and `on_deadline_risk`).
    pub checks: Vec<Check>,
}

/// Puts the item's index in front of an error's `param`.
fn at_item(i: usize, mut e: ApiError) -> ApiError {
    e.param = Some(match e.param {
        Some(p) => format!("jobs[{i}].{p}"),
        None => format!("jobs[{i}]"),
    });
    e
}

/// Reads a bulk body into the jobs it asks for, each checked as `POST /v1/jobs` checks
/// one, or the first item's error (its index in `param`). CPU work, proportional to the
/// body: call it off the async runtime. What it holds at its peak is the body, the
/// requests' text and one item's parsed values, never the body as values.
pub fn prepare(
    config: &Config,
    tenant: &Caller,
    body: &[u8],
    now: DateTime<Utc>,
) -> Result<Prepared, ApiError> {
    let parsed: BulkBody = serde_json::from_slice(body).map_err(|e| {
        if e.is_data() {
            ApiError::bad_request(
                ApiErrorCode::InvalidRequest,
                format!("the body must be an object with one field, `jobs`: an array of jobs as POST /v1/jobs takes them ({e})"),
            )
        } else {
            ApiError::bad_request(
                ApiErrorCode::InvalidJson,
                format!("the body is not valid JSON: {e}"),
            )
        }
    })?;
    let items = parsed.jobs;
    let max = config.server.max_bulk_jobs;
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
    // Every item within one job's limit before any is read.
    let item_limit = config.server.max_body_bytes;
    if let Some(i) = items.iter().position(|item| item.get().len() > item_limit) {
        return Err(at_item(
            i,
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ApiErrorCode::ItemTooLarge,
                format!(
                    "the item is {} bytes; one job may be at most {item_limit} (server.max_body_bytes)",
                    items[i].get().len()
                ),
            ),
        ));
    }
    let mut keys = HashSet::new();
    let mut jobs: Vec<BulkJob> = Vec::with_capacity(items.len());
    let mut checks = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let text = item.get();
        let submit: SubmitJob = serde_json::from_str(text).map_err(|e| {
            at_item(
                i,
                ApiError::bad_request(ApiErrorCode::InvalidRequest, format!("invalid job: {e}")),
            )
        })?;
        if may_hold_nul(text.as_bytes()) {
            let value: Value = serde_json::from_str(text).map_err(ApiError::internal)?;
            refuse_nul(&value, text.as_bytes()).map_err(|mut e| {
                e.param = e.param.map(|p| format!("/jobs/{i}{p}"));
                e
            })?;
        }
        let raw: RequestText = serde_json::from_str(text).map_err(ApiError::internal)?;
        let job = submit
            .into_submission(None)
            .and_then(|s| {
                checks.push(s.check);
                new_job(config, tenant, s, now)
            })
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
        // The parsed request is dropped here; its text is what is kept and inserted.
        jobs.push(job.map_request(|_| raw.request.to_owned()));
    }
    Ok(Prepared { jobs, checks })
}

/// The forecast of each job of a bulk, in order. The jobs of one model, class and priority
/// drain in the order sent: the first and the whole run are forecast, and each job's
/// times lie between theirs in proportion to the tokens sent up to it.
async fn forecast(
    state: &AppState,
    inputs: &Inputs,
    conn: &mut PgConnection,
    jobs: &[BulkJob],
    locked: bool,
) -> Result<Vec<Option<Eta>>, ApiError> {
    let tokens = |j: &BulkJob| f64::from(j.estimated_input_tokens.max(0) + j.estimated_output_tokens.max(0));
    let mut runs: BTreeMap<(&str, JobClass, i32), Vec<usize>> = BTreeMap::new();
    for (i, j) in jobs.iter().enumerate() {
        runs.entry((j.model.as_str(), j.class, j.priority))
            .or_default()
            .push(i);
    }
    let firsts: Vec<NewJob> = runs
        .values()
        .map(|run| jobs[run[0]].clone().map_request(|_| Value::Null))
        .collect();
    let mut work = Vec::with_capacity(2 * runs.len());
    for (one, run) in firsts.iter().zip(runs.values()) {
        work.push(Of::job(one));
        work.push(Of {
            jobs: run.len() as f64,
            input_tokens: run
                .iter()
                .map(|&i| f64::from(jobs[i].estimated_input_tokens.max(0)))
                .sum(),
            output_tokens: run
                .iter()
                .map(|&i| f64::from(jobs[i].estimated_output_tokens.max(0)))
                .sum(),
            ..Of::job(one)
        });
    }
    let control = state.tenants.snapshot();
    let now = jobs.first().map_or_else(Utc::now, |j| j.created_at);
    let etas = state
        .forecasts
        .forecast_each(inputs, conn, &control, &work, locked, now)
        .await?;
    let mut out = vec![None; jobs.len()];
    for (run, ends) in runs.values().zip(etas.chunks(2)) {
        let [Some(first), Some(last)] = ends else { continue };
        let total: f64 = run.iter().map(|&i| tokens(&jobs[i])).sum();
        let mut sent = 0.0;
        for &i in run {
            sent += tokens(&jobs[i]);
            let share = (sent - tokens(&jobs[run[0]])) / (total - tokens(&jobs[run[0]]));
            out[i] = Some(first.towards(last, share));
        }
    }
    Ok(out)
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
        (status = 413, description = "`body_too_large` (`server.max_bulk_body_bytes`); `item_too_large`: an item larger than one job may be (`server.max_body_bytes`), `param` names it", body = doc::ErrorBody),
        (status = 422, description = "`deadline_unmeetable`: a job's forecast p90 start is after the deadline it set — `param` names the item, `earliest_feasible_at` says the earliest deadline it would be accepted with", body = doc::ErrorBody),
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
    // Each job counts against the tenant's API rate, as soon as they are counted. A tenant
    // at its queue's cap is refused before its items are read: a flood of bulks to a full
    // queue costs a count each, not a parse and an estimate of every item.
    let asked = if state.config.classes.any_capped() {
        let body = bytes.clone();
        tokio::task::spawn_blocking(move || classes_asked(&body))
            .await
            .map_err(ApiError::internal)?
    } else {
        None
    };
    if let Some(asked) = &asked {
        state
            .tenant_rate
            .charge_jobs(&tenant, asked.values().sum::<u64>() as usize);
        for (class, n) in asked {
            queue_has_room(&state, &tenant.name, *class, *n).await?;
        }
    }
    let now = state.clock.now().trunc_subsecs(6);
    let (config, owner) = (state.tenants.config(), tenant.clone());
    let trace = crate::observed::ClientTrace::current();
    let Prepared { mut jobs, checks } = tokio::task::spawn_blocking(move || {
        crate::observed::ClientTrace::within(trace, || prepare(&config, &owner, &bytes, now))
    })
    .await
    .map_err(ApiError::internal)??;
    if asked.is_none() {
        state.tenant_rate.charge_jobs(&tenant, jobs.len());
    }
    let mut per_class = BTreeMap::new();
    for j in &jobs {
        *per_class.entry(j.class).or_insert(0u64) += 1;
    }

    // Jobs whose deadlines are checked are forecast under the forecast locks, in the
    // transaction that inserts them, each model's turn taken in one order; the others are
    // forecast before it, from readings up to a second old.
    let locked = checks.iter().any(|c| c.locks());
    let mut turns = Vec::new();
    if locked {
        let models: std::collections::BTreeSet<&str> = jobs.iter().map(|j| j.model.as_str()).collect();
        for model in models {
            turns.push(state.forecasts.turn(model).await);
        }
    }
    let inputs = state.forecasts.inputs(&state.pool, now).await?;
    if !locked {
        let mut conn = state.pool.acquire().await.map_err(store::StoreError::from)?;
        match forecast(&state, &inputs, &mut conn, &jobs, false).await {
            Ok(etas) => with_etas(&mut jobs, etas),
            Err(e) => {
                tracing::warn!(code = %e.code.as_str(), "could not forecast a bulk; its jobs are accepted without an eta");
            }
        }
    }
    let mut tx = state.pool.begin().await.map_err(store::StoreError::from)?;
    // Classes in one order, so bulks of several classes take their queues' locks in it.
    for (class, n) in per_class {
        reserve_queue_room(&state, &mut tx, &tenant.name, class, n).await?;
    }
    if locked {
        let etas = forecast(&state, &inputs, &mut tx, &jobs, true).await?;
        for (i, (check, eta)) in checks.iter().zip(&etas).enumerate() {
            check.judge(*eta).map_err(|e| at_item(i, e))?;
        }
        with_etas(&mut jobs, etas);
    }
    let outcome = store::insert_jobs(&mut tx, &jobs).await?;
    if let Some(i) = outcome.iter().position(|o| *o == BulkInserted::Conflict) {
        // Dropping the transaction rolls every insert back.
        return Err(at_item(i, idempotency_key_reused()));
    }
    tx.commit().await.map_err(store::StoreError::from)?;
    drop(turns);

    let created = outcome
        .iter()
        .filter(|o| matches!(o, BulkInserted::New(_)))
        .count();
    if created > 0 {
        state.notifications.work_queued();
    }
    let data: Vec<Accepted> = outcome
        .into_iter()
        .zip(&jobs)
        .filter_map(|(o, job)| match o {
            BulkInserted::New(id) => Some(Accepted {
                id: id.to_string(),
                existing: false,
                eta: eta_view(job.eta_p50, job.eta_p90),
            }),
            BulkInserted::Existing(id) => Some(Accepted {
                id: id.to_string(),
                existing: true,
                eta: Value::Null,
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

/// Sets each job's forecast.
fn with_etas(jobs: &mut [BulkJob], etas: Vec<Option<Eta>>) {
    for (job, eta) in jobs.iter_mut().zip(etas) {
        if let Some(eta) = eta {
            job.eta_p50 = Some(eta.p50);
            job.eta_p90 = Some(eta.p90);
        }
    }
}
