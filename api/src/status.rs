//! What is happening now: `GET /v1/status` (queues by tenant and class, buckets with use
//! and limit, recent traffic and failures, batches in progress) and
//! `GET /v1/status/history` (queue depth and throughput over the last hour). The
//! dashboard polls both; `tollgate status` prints the first. The admin key sees every
//! tenant; a tenant key sees its own jobs and the buckets that apply to it.
//!
//! History is kept in the database (`status_samples`): one sample every [`SAMPLE_EVERY`]
//! (less often when sampling is slow), [`HISTORY`] long, taken by whichever process's
//! sampler ([`sample`], a loop the broker runs) comes first, so every process shows the same
//! numbers and charts survive restarts.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use chrono::{DateTime, DurationRound, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tollgate::buckets;
use tollgate::metrics::class_label;
use tollgate::model::JobClass;
use tollgate::store::{self, StoreError};
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Viewer;
use crate::error::ApiError;

/// How often the history takes a sample.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How much history is kept.
pub const HISTORY: Duration = Duration::from_secs(3600);
/// The sampler takes at most one part in this of the time (and of a database connection).
const SAMPLER_SHARE: u32 = 20;
/// The window of the "now" rates in `/v1/status`.
const RATE_WINDOW_SECS: i64 = 60;
/// Failures listed.
const RECENT_FAILURES: i64 = 20;

/// One (tenant, class) queue.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Queue {
    pub tenant: String,
    /// `interactive`, `standard`, `background`, `batch`.
    pub class: String,
    pub queued: i64,
    pub admitted: i64,
    pub running: i64,
    /// Age of the oldest queued job, seconds (0 when none is queued).
    pub oldest_queued_secs: f64,
    /// Jobs of the queue that finished (however) in the last minute.
    pub finished_last_minute: i64,
    /// The broker's forecast of when the queue's unfinished jobs (queued, admitted,
    /// running) will have finished, in seconds from now, at the rate it finished them over
    /// the last minute; `null` before any finished.
    pub eta_secs: Option<f64>,
}

/// A bucket: its limit, what is used and what remains now.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BucketUse {
    pub bucket: String,
    pub dimension: String,
    pub rule: String,
    pub capacity: f64,
    pub remaining: f64,
    /// `capacity − remaining`, at least 0.
    pub used: f64,
    /// `configured`, `learned` (from a provider's headers or its 429s) or `probe` (a
    /// cold-start limit while nothing is known).
    pub source: String,
    /// What the config says, when a learned limit replaced it.
    pub configured_capacity: Option<f64>,
    pub learned_at: Option<DateTime<Utc>>,
    pub window_secs: i64,
    pub resets_at: Option<DateTime<Utc>>,
}

/// Provider traffic over the last minute.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct Rates {
    pub window_secs: i64,
    /// Successful provider calls (jobs done) per second.
    pub jobs_per_sec: f64,
    /// Reported input + output tokens per second.
    pub tokens_per_sec: f64,
    pub failed_attempts: i64,
    pub provider_429s: i64,
    pub provider_5xxs: i64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Failure {
    pub id: String,
    pub tenant: String,
    pub model: String,
    /// The reason code (`JobErrorCode`).
    pub code: Option<String>,
    pub message: Option<String>,
    pub attempts: i32,
    pub finished_at: Option<DateTime<Utc>>,
}

/// A batch and its progress. Filled by the batch API; empty until it exists.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BatchProgress {
    pub id: String,
    pub tenant: String,
    pub state: String,
    pub total: i64,
    pub completed: i64,
    pub failed: i64,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Status {
    /// `all` (admin key) or the tenant's name.
    pub scope: String,
    pub generated_at: DateTime<Utc>,
    pub queues: Vec<Queue>,
    pub buckets: Vec<BucketUse>,
    pub rates: Rates,
    pub recent_failures: Vec<Failure>,
    pub batches: Vec<BatchProgress>,
    /// How the `eta` forecasts of the jobs that finished in the last hour came out.
    pub forecasts: Forecasts,
}

/// Forecasts against what happened: the jobs that finished in the window and carried an
/// `eta` from their submission.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct Forecasts {
    pub window_secs: i64,
    pub jobs: i64,
    /// The p50 and p90 of each job's relative error: |finished − eta p50| over the eta
    /// p50's time from submission (at least a second); `null` before any finished.
    pub p50_error: Option<f64>,
    pub p90_error: Option<f64>,
    /// Jobs that finished after their eta p90.
    pub after_p90: i64,
    /// Jobs that failed for their deadline (`deadline_exceeded`, `deadline_unmeetable`)
    /// after a forecast that accepted them.
    pub missed_deadline: i64,
}

/// The open batches `viewer` may see (the 20 newest), with their progress.
pub async fn batches_in_progress(state: &AppState, viewer: &Viewer) -> Result<Vec<BatchProgress>, ApiError> {
    let open = store::open_batches(&state.pool, viewer.tenant(), 20).await?;
    let ids: Vec<&str> = open.iter().map(|b| b.id.as_str()).collect();
    let counts = store::job_counts(&state.pool, &ids).await?;
    Ok(open
        .iter()
        .map(|b| {
            let (completed, failed) = counts.get(&b.id).copied().unwrap_or_default();
            BatchProgress {
                id: b.id.clone(),
                tenant: b.tenant.clone(),
                state: b.status.clone(),
                total: i64::from(b.total),
                completed,
                // Lines refused at ingest are failures of the batch too.
                failed: failed + i64::from(b.rejected),
                created_at: b.created_at,
            }
        })
        .collect())
}

/// Seconds until `unfinished` jobs have finished at the rate of `finished_last_minute`
/// (`None` without a rate).
fn drain_secs(unfinished: i64, finished_last_minute: i64) -> Option<f64> {
    (finished_last_minute > 0)
        .then(|| unfinished as f64 * RATE_WINDOW_SECS as f64 / finished_last_minute as f64)
}

/// The status as `viewer` may see it.
pub async fn status(state: &AppState, viewer: &Viewer) -> Result<Status, ApiError> {
    let now = Utc::now();
    let tenant = viewer.tenant();
    let minute_ago = now - chrono::Duration::seconds(RATE_WINDOW_SECS);
    let (depths, finished) = tokio::try_join!(
        store::queue_depths(&state.pool, tenant),
        store::finished_by_queue(&state.pool, minute_ago, tenant),
    )?;
    let finished: std::collections::HashMap<(String, JobClass), i64> = finished
        .into_iter()
        .map(|(t, class, n)| ((t, class), n))
        .collect();
    let queues = depths
        .into_iter()
        .map(|q| {
            let finished = finished.get(&(q.tenant.clone(), q.class)).copied().unwrap_or(0);
            Queue {
                oldest_queued_secs: q
                    .oldest_queued
                    .map_or(0.0, |t| (now - t).num_milliseconds().max(0) as f64 / 1000.0),
                finished_last_minute: finished,
                eta_secs: drain_secs(q.queued + q.admitted + q.running, finished),
                tenant: q.tenant,
                class: class_label(q.class).to_owned(),
                queued: q.queued,
                admitted: q.admitted,
                running: q.running,
            }
        })
        .collect();
    let buckets = bucket_uses(&state.pool, viewer, now).await?;
    let traffic = store::traffic(
        &state.pool,
        now - chrono::Duration::seconds(RATE_WINDOW_SECS),
        now,
        tenant,
    )
    .await?;
    let window = RATE_WINDOW_SECS as f64;
    let rates = Rates {
        window_secs: RATE_WINDOW_SECS,
        jobs_per_sec: traffic.iter().map(|t| t.succeeded).sum::<i64>() as f64 / window,
        tokens_per_sec: traffic.iter().map(|t| t.tokens).sum::<i64>() as f64 / window,
        failed_attempts: traffic.iter().map(|t| t.failed).sum(),
        provider_429s: traffic.iter().map(|t| t.status_429).sum(),
        provider_5xxs: traffic.iter().map(|t| t.status_5xx).sum(),
    };
    let recent_failures = store::recent_failures(&state.pool, tenant, RECENT_FAILURES)
        .await?
        .into_iter()
        .map(|f| Failure {
            id: f.id.to_string(),
            tenant: f.tenant,
            model: f.model,
            code: f.error_code,
            message: f.error_message,
            attempts: f.attempts,
            finished_at: f.finished_at,
        })
        .collect();
    Ok(Status {
        scope: tenant.unwrap_or("all").to_owned(),
        generated_at: now,
        queues,
        buckets,
        rates,
        recent_failures,
        batches: batches_in_progress(state, viewer).await?,
        forecasts: forecasts(&state.pool, tenant, now).await?,
    })
}

/// How the forecasts of jobs that finished in the last [`HISTORY`] came out (of `tenant`'s,
/// or every tenant's).
pub async fn forecasts(
    pool: &PgPool,
    tenant: Option<&str>,
    now: DateTime<Utc>,
) -> Result<Forecasts, StoreError> {
    let window = chrono::Duration::from_std(HISTORY).unwrap_or(chrono::Duration::hours(1));
    let r = store::forecast_record(pool, tenant, now - window).await?;
    Ok(Forecasts {
        window_secs: window.num_seconds(),
        jobs: r.jobs,
        p50_error: r.p50_error,
        p90_error: r.p90_error,
        after_p90: r.late,
        missed_deadline: r.missed_deadline,
    })
}

/// Every bucket `viewer` may see (provider-side ones, and its own tenant's and its
/// applications' — never another tenant's or a key's), refilled to `now`.
pub async fn bucket_uses(
    pool: &PgPool,
    viewer: &Viewer,
    now: DateTime<Utc>,
) -> Result<Vec<BucketUse>, StoreError> {
    let own = viewer.tenant().map(buckets::tenant_prefixes);
    Ok(store::all_buckets(pool)
        .await?
        .into_iter()
        .filter(|b| match &own {
            None => true,
            Some(own) => own.iter().any(|o| b.key.starts_with(o)) || !buckets::is_tenant_held(&b.key),
        })
        .map(|mut b| {
            b.refill(now);
            let remaining = b.level.max(0.0).floor();
            BucketUse {
                source: crate::limits::source(&b).to_owned(),
                configured_capacity: b.configured_capacity,
                learned_at: b.learned_at,
                dimension: b.dimension.as_str().to_owned(),
                rule: b.rule.as_str().to_owned(),
                capacity: b.capacity,
                used: (b.capacity - remaining).max(0.0),
                remaining,
                window_secs: b.window_secs,
                resets_at: b.resets_at,
                bucket: b.key,
            }
        })
        .collect())
}

/// Queues, buckets, rates, recent failures and batches: everything the caller may see.
#[utoipa::path(
    get,
    path = "/v1/status",
    operation_id = "get_status",
    tag = "limits",
    responses((status = 200, description = "The admin key sees every tenant; a tenant key its own", body = Status)),
    security(("bearer" = []))
)]
pub(crate) async fn get(State(state): State<AppState>, viewer: Viewer) -> Result<Json<Status>, ApiError> {
    Ok(Json(status(&state, &viewer).await?))
}

/// One sample of the history.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Sample {
    pub at: DateTime<Utc>,
    /// Seconds since the previous sample, which `traffic` covers (longer than
    /// [`SAMPLE_EVERY`] when sampling was slow).
    pub interval_secs: f64,
    /// Queued jobs per `tenant/class`.
    pub queued: BTreeMap<String, i64>,
    /// Per tenant, over the interval since the previous sample.
    pub traffic: BTreeMap<String, SampleTraffic>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct SampleTraffic {
    pub succeeded: i64,
    pub failed: i64,
    pub tokens: i64,
    pub status_429: i64,
    pub status_5xx: i64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct History {
    /// The usual time between samples ([`SAMPLE_EVERY`]); each sample has its own.
    pub interval_secs: f64,
    pub samples: Vec<Sample>,
}

/// Takes the sample of the slot `now` falls in, unless a process took it; forgets samples
/// older than [`HISTORY`]. Every process samples; the first to reach a slot of
/// [`SAMPLE_EVERY`] takes it and the others skip it, so the history in the database is one
/// series whichever processes run, and survives their restarts.
pub async fn sample_once(pool: &PgPool, now: DateTime<Utc>) -> Result<(), StoreError> {
    let every = chrono::Duration::from_std(SAMPLE_EVERY).unwrap_or_default();
    // Calls end a moment before they are written: a slot is sampled once that moment
    // has passed, so no call of it is missed.
    let settled = now - chrono::Duration::seconds(1);
    let slot = settled.duration_trunc(every).unwrap_or(settled);
    let previous = store::last_status_sample(pool).await?;
    if previous.is_some_and(|p| p >= slot) {
        return Ok(());
    }
    let since = previous
        .filter(|p| slot - *p <= chrono::Duration::from_std(HISTORY).unwrap_or_default())
        .unwrap_or(slot - every);
    let queued: BTreeMap<String, i64> = store::queue_depths(pool, None)
        .await?
        .into_iter()
        .map(|q| (format!("{}/{}", q.tenant, class_label(q.class)), q.queued))
        .collect();
    let traffic: BTreeMap<String, SampleTraffic> = store::traffic(pool, since, slot, None)
        .await?
        .into_iter()
        .map(|t| {
            (
                t.tenant,
                SampleTraffic {
                    succeeded: t.succeeded,
                    failed: t.failed,
                    tokens: t.tokens,
                    status_429: t.status_429,
                    status_5xx: t.status_5xx,
                },
            )
        })
        .collect();
    let sample = store::StatusSample {
        at: slot,
        interval_secs: (slot - since).num_milliseconds() as f64 / 1000.0,
        queued: serde_json::to_value(queued).unwrap_or_default(),
        traffic: serde_json::to_value(traffic).unwrap_or_default(),
    };
    let oldest = now - chrono::Duration::from_std(HISTORY).unwrap_or_default();
    store::put_status_sample(pool, &sample, oldest).await?;
    Ok(())
}

/// The sampling loop, until `cancel`: a sample every [`SAMPLE_EVERY`], or less often when
/// sampling is slow (counting a queue of a million takes most of a second), so that it
/// takes at most 1 / [`SAMPLER_SHARE`] of the time.
pub async fn sample(pool: PgPool, cancel: CancellationToken) {
    loop {
        let began = std::time::Instant::now();
        if let Err(e) = sample_once(&pool, Utc::now()).await {
            tracing::warn!(error = %e, "could not sample the queues for the dashboard");
        }
        let took = began.elapsed();
        let pause = SAMPLE_EVERY.saturating_sub(took).max(took * (SAMPLER_SHARE - 1));
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// The history after `after` (the last hour when `None`) as `viewer` may see it.
async fn history_for(
    pool: &PgPool,
    viewer: &Viewer,
    after: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Result<History, StoreError> {
    let hour_ago = now - chrono::Duration::from_std(HISTORY).unwrap_or_default();
    let after = after.map_or(hour_ago, |a| a.max(hour_ago));
    let samples = store::status_samples(pool, after)
        .await?
        .into_iter()
        .map(|s| {
            let queued: BTreeMap<String, i64> = serde_json::from_value(s.queued).unwrap_or_default();
            let traffic: BTreeMap<String, SampleTraffic> =
                serde_json::from_value(s.traffic).unwrap_or_default();
            Sample {
                at: s.at,
                interval_secs: s.interval_secs,
                queued: queued
                    .into_iter()
                    .filter(|(k, _)| k.split_once('/').is_some_and(|(t, _)| viewer.may_see(t)))
                    .collect(),
                traffic: traffic.into_iter().filter(|(t, _)| viewer.may_see(t)).collect(),
            }
        })
        .collect();
    Ok(History {
        interval_secs: SAMPLE_EVERY.as_secs_f64(),
        samples,
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HistoryParams {
    after: Option<DateTime<Utc>>,
}

/// Queue depth and traffic over the last hour, one sample every 2 s, kept in the database
/// (the same from every process, across restarts); `after` returns only newer samples.
#[utoipa::path(
    get,
    path = "/v1/status/history",
    operation_id = "get_status_history",
    tag = "limits",
    params(("after" = Option<String>, Query, description = "RFC 3339: only samples taken after it")),
    responses(
        (status = 200, description = "Samples, oldest first", body = History),
        (status = 400, description = "`invalid_request` (bad `after`)", body = crate::openapi::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn history(
    State(state): State<AppState>,
    viewer: Viewer,
    params: Result<Query<HistoryParams>, QueryRejection>,
) -> Result<Json<History>, ApiError> {
    let params = crate::paging::params(params)?;
    Ok(Json(
        history_for(&state.pool, &viewer, params.after, state.clock.now()).await?,
    ))
}
