//! Forecasts at submission ([`tollgate::forecast`]): every job and batch accepted carries
//! its `eta` (p50, p90), and one whose deadline the client set is refused
//! `deadline_unmeetable` (with `earliest_feasible_at`, the forecast p90) when its p90
//! falls after that deadline — unless it asked `"on_deadline_risk": "accept"`.
//!
//! A deadline check and the insert it allows are one step across processes: the check
//! runs in the insert's transaction, after taking the forecast lock of every provider
//! model the work may go to ([`store::lock_forecasts`]), so a check on the same model in
//! any process waits for it and then reads the queue with its jobs in it. Concurrent
//! submitters cannot all be told yes for the same capacity. A forecast without a check
//! (no deadline set) takes no lock, and reuses its model and class's reading of the queue
//! for a second ([`QUEUE_REREAD`]): it decides nothing, so it need not scan a deep queue
//! for every job submitted; the work forecast with a reading since it was read counts as
//! ahead of the next ([`Reading::count`]), so a second's jobs do not all see the same
//! room. Locks are taken after the queue's (`jobs`'s queue cap
//! lock), as every submission takes them, so two never wait on each other. Within a
//! process, checks of one model take turns before they take a connection
//! ([`Forecaster::turn`]): a burst of them waits in memory, not on the pool.
//!
//! What changes slowly is read at most every [`REREAD_EVERY`] per process: the learned
//! estimates and limits the plan needs, how long calls took lately, provider batches'
//! turnarounds, how past forecasts came out, and what arrived in the last minute (the rate
//! at which more work will compete); the leading gate's fairness lags (who it serves
//! first) every second.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use sqlx::{PgConnection, PgPool};
use tollgate::buckets::{self, Bucket};
use tollgate::config::Config;
use tollgate::control::Snapshot;
use tollgate::forecast::{self, Eta, Latency, Outlook, Overtaking, Work};
use tollgate::learning::Learned;
use tollgate::model::{JobClass, NewJob};
use tollgate::provider_batches;
use tollgate::reread::Reread;
use tollgate::routing::{self, Target};
use tollgate::scheduler::{Known, Plan, Planner, Policy};
use tollgate::store::{
    self, Arrived, Behind, Calibration, CallLatency, Candidate, ForecastRecord, Queued, StoreError,
    Turnarounds,
};
use tollgate::vocab::{ApiErrorCode, Lane};

use crate::error::ApiError;

/// How often each slow-changing input is read again.
const REREAD_EVERY: Duration = Duration::from_secs(10);
/// How far back calls' latencies and forecasts' record are read.
const LOOK_BACK: chrono::Duration = chrono::Duration::minutes(15);
/// How far back what arrives is counted (its rate per second forecasts what comes next).
const ARRIVALS_WINDOW: chrono::Duration = chrono::Duration::minutes(1);
/// The shortest span what arrived is spread over, in seconds.
const ARRIVALS_SPAN_FLOOR: f64 = 10.0;
/// Fewest calls to a model before their latency replaces [`forecast::UNSEEN_LATENCY`].
const MIN_CALLS: i64 = 5;

/// What a client asks for when its deadline is at risk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnDeadlineRisk {
    /// Refuse the work `deadline_unmeetable` when its forecast p90 is after its deadline.
    #[default]
    Refuse,
    /// Accept it anyway (the gate still fails what cannot start in time).
    Accept,
}

/// Whether a submission's deadline is checked against its forecast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// A job's: refused when its forecast p90 start is after `deadline` (one still queued
    /// at its deadline fails).
    StartBy(DateTime<Utc>),
    /// A batch's: refused when its last line's forecast p90 finish is after the end of
    /// its window.
    FinishBy(DateTime<Utc>),
    /// Forecast only.
    None,
}

impl Check {
    /// A job's check: its deadline when it set one and does not accept the risk.
    pub fn of(deadline: Option<DateTime<Utc>>, risk: OnDeadlineRisk) -> Self {
        match (deadline, risk) {
            (Some(d), OnDeadlineRisk::Refuse) => Check::StartBy(d),
            _ => Check::None,
        }
    }

    /// `422 deadline_unmeetable` when `eta` misses the deadline checked; its
    /// `earliest_feasible_at` is the earliest deadline the check would pass.
    pub fn judge(self, eta: Option<Eta>) -> Result<(), ApiError> {
        let (deadline, earliest, what, eta) = match (self, eta) {
            (Check::StartBy(d), Some(eta)) if eta.start_p90 > d => (d, eta.start_p90, "start", eta),
            (Check::FinishBy(d), Some(eta)) if eta.p90 > d => (d, eta.p90, "finish", eta),
            _ => return Ok(()),
        };
        Err(ApiError::new(
            axum::http::StatusCode::UNPROCESSABLE_ENTITY,
            ApiErrorCode::DeadlineUnmeetable,
            format!(
                "the work is forecast to {what} by {} (p90; finish p50 {}, p90 {}), after its deadline {}: \
                 what is queued ahead of it and the limits on its path leave no earlier time. Set a \
                 deadline at or after `earliest_feasible_at`, or \"on_deadline_risk\": \"accept\"",
                earliest.to_rfc3339(),
                eta.p50.to_rfc3339(),
                eta.p90.to_rfc3339(),
                deadline.to_rfc3339()
            ),
        )
        .with_param("deadline")
        .with_earliest_feasible_at(earliest))
    }

    pub fn locks(self) -> bool {
        !matches!(self, Check::None)
    }
}

/// The `eta` object of a job or batch (`null` without a forecast).
pub fn eta_view(p50: Option<DateTime<Utc>>, p90: Option<DateTime<Utc>>) -> serde_json::Value {
    match p50.zip(p90) {
        Some((p50, p90)) => serde_json::json!({"p50": p50, "p90": p90}),
        None => serde_json::Value::Null,
    }
}

/// The forecasts' slow inputs, per process; and the turns of its deadline checks.
pub struct Forecaster {
    /// By requested model: one deadline check at a time in this process. The others wait
    /// here, holding no connection, rather than each on the forecast locks with a
    /// connection of the pool (a burst of them would empty it).
    turns: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    calibration: Reread<HashMap<String, Calibration>>,
    learned: Reread<Vec<Learned>>,
    latencies: Reread<HashMap<(String, String), CallLatency>>,
    turnarounds: Reread<Turnarounds>,
    record: Reread<ForecastRecord>,
    arriving: Reread<Vec<Arrived>>,
    lags: Reread<HashMap<(JobClass, String), f64>>,
    /// The queue and buckets last read for unchecked forecasts, by requested model and
    /// class, reused for [`QUEUE_REREAD`]: a forecast that decides nothing does not scan a
    /// deep queue for every job submitted.
    unchecked: std::sync::Mutex<RecentReadings>,
    key_turn: AtomicUsize,
}

/// By requested model and class: when the last unchecked reading was made, and it.
type RecentReadings = HashMap<(String, JobClass), (std::time::Instant, Arc<Reading>)>;

/// How long a queue read for unchecked forecasts is reused.
const QUEUE_REREAD: Duration = Duration::from_secs(1);

/// What a forecast reads on its connection: the buckets on the plan's paths, and the
/// queued work on its routes.
pub struct Reading {
    /// What each route is asked for as ([`route_names`]).
    names: Vec<Vec<String>>,
    found: HashMap<String, Bucket>,
    ahead: Vec<Queued>,
    /// Its own tenant's jobs of its class served after it ([`store::queued_around`]);
    /// none in a reading that counts them all ahead.
    behind: Vec<Queued>,
    /// The work forecast with it since it was read, by tenant (a reading shared by the
    /// next second's unchecked forecasts): submitted since, it stands ahead of what comes
    /// next — queued, or admitted and taken from buckets whose levels the reading predates.
    since: std::sync::Mutex<Vec<Queued>>,
}

impl Reading {
    /// Counts `of`, forecast with this reading at `now`, as submitted since it was read.
    fn count(&self, of: &Of<'_>, now: DateTime<Utc>) {
        let mut since = self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let job = of.one;
        let at = match since.iter().position(|q| q.tenant == job.tenant) {
            Some(at) => at,
            None => {
                since.push(Queued {
                    class: job.class,
                    tenant: job.tenant.clone(),
                    model: job.model.clone(),
                    jobs: 0.0,
                    input_tokens: 0.0,
                    output_tokens: 0.0,
                    due_jobs: 0.0,
                    due_input_tokens: 0.0,
                    due_output_tokens: 0.0,
                    oldest: now,
                    newest: now,
                });
                since.len() - 1
            }
        };
        let row = &mut since[at];
        row.jobs += of.jobs;
        row.input_tokens += of.input_tokens;
        row.output_tokens += of.output_tokens;
        (row.due_jobs, row.due_input_tokens, row.due_output_tokens) =
            (row.jobs, row.input_tokens, row.output_tokens);
        row.newest = now;
    }

    /// The queued work ahead: as read, and what was forecast with it since.
    fn ahead_and_since(&self) -> Vec<Queued> {
        let since = self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.ahead.iter().chain(since.iter()).cloned().collect()
    }
}

impl Default for Forecaster {
    fn default() -> Self {
        Self {
            turns: std::sync::Mutex::default(),
            calibration: Reread::new(REREAD_EVERY),
            learned: Reread::new(REREAD_EVERY),
            latencies: Reread::new(REREAD_EVERY),
            turnarounds: Reread::new(REREAD_EVERY),
            record: Reread::new(REREAD_EVERY),
            arriving: Reread::new(REREAD_EVERY),
            lags: Reread::new(QUEUE_REREAD),
            unchecked: std::sync::Mutex::default(),
            key_turn: AtomicUsize::new(0),
        }
    }
}

/// The work a forecast is of: `one` of its jobs (what its route and path are planned from),
/// and how many jobs and tokens it is in all.
pub struct Of<'a> {
    pub one: &'a NewJob,
    pub jobs: f64,
    pub input_tokens: f64,
    pub output_tokens: f64,
    /// The batch the jobs are lines of (they are not queued ahead of themselves).
    pub batch_id: Option<&'a str>,
}

impl<'a> Of<'a> {
    pub fn job(job: &'a NewJob) -> Self {
        Self {
            one: job,
            jobs: 1.0,
            input_tokens: f64::from(job.estimated_input_tokens.max(0)),
            output_tokens: f64::from(job.estimated_output_tokens.max(0)),
            batch_id: None,
        }
    }
}

impl Forecaster {
    /// This process's turn to check a deadline of work asking for `model`: take it before
    /// the transaction that checks and inserts, hold it until that ends.
    pub async fn turn(&self, model: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let turn = self
            .turns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(model.to_owned())
            .or_default()
            .clone();
        turn.lock_owned().await
    }

    /// The forecast of `work` (one job, or a batch's lines grouped by model: the latest of
    /// their forecasts) with `inputs`, the queue and buckets read on `conn` — under the
    /// forecast locks of every provider model it may go to when `check` is a deadline (run
    /// it in the transaction that then inserts the work) — and judged by `check`. `None`:
    /// no forecast (no model resolves any more, or a bucket can never hold the work: the
    /// gate fails it with the reason).
    pub async fn forecast(
        &self,
        inputs: &Inputs,
        conn: &mut PgConnection,
        control: &Snapshot,
        work: &[Of<'_>],
        check: Check,
        now: DateTime<Utc>,
    ) -> Result<Option<Eta>, ApiError> {
        let etas = self
            .forecast_each(inputs, conn, control, work, check.locks(), now)
            .await?;
        let latest = etas.into_iter().flatten().reduce(|l, eta| Eta {
            p50: l.p50.max(eta.p50),
            p90: l.p90.max(eta.p90),
            start_p90: l.start_p90.max(eta.start_p90),
        });
        check.judge(latest)?;
        Ok(latest)
    }

    /// The forecast of each of `work`, as [`Self::forecast`] makes them: `locked`, under
    /// the forecast locks of every provider model they may go to, each with the queue
    /// read afresh; else with readings up to [`QUEUE_REREAD`] old.
    pub async fn forecast_each(
        &self,
        inputs: &Inputs,
        conn: &mut PgConnection,
        control: &Snapshot,
        work: &[Of<'_>],
        locked: bool,
        now: DateTime<Utc>,
    ) -> Result<Vec<Option<Eta>>, ApiError> {
        let plans: Vec<Option<Plan>> = work
            .iter()
            .map(|of| self.plan(inputs, control, of.one, now))
            .collect();
        if locked {
            let scopes: Vec<String> = plans
                .iter()
                .flatten()
                .flat_map(|p| &p.routes)
                .map(|r| buckets::target_scope(&r.target.provider, &r.target.model))
                .collect();
            store::lock_forecasts(conn, &scopes).await?;
        }
        let mut etas = Vec::with_capacity(work.len());
        for (of, plan) in work.iter().zip(&plans) {
            let Some(plan) = plan else {
                etas.push(None);
                continue;
            };
            if locked {
                let reading = read(conn, control, of, plan, behind(of)).await?;
                etas.push(inputs.eta(control, of, plan, &reading, now));
            } else {
                let reading = self.unchecked_reading(conn, control, of, plan).await?;
                etas.push(inputs.eta(control, of, plan, &reading, now));
                reading.count(of, now);
            }
        }
        Ok(etas)
    }

    /// Where `job`, queued already, stands now: its forecast with the queue as it is (the
    /// job counted once, where it waits), and the queued jobs on its routes of its class
    /// or one served first that were submitted before it. `None`: no forecast (see
    /// [`Self::forecast`]).
    pub async fn waiting(
        &self,
        inputs: &Inputs,
        conn: &mut PgConnection,
        control: &Snapshot,
        job: &NewJob,
        now: DateTime<Utc>,
    ) -> Result<Option<(Eta, i64)>, StoreError> {
        let Some(plan) = self.plan(inputs, control, job, now) else {
            return Ok(None);
        };
        let queued = Of {
            jobs: 0.0,
            input_tokens: 0.0,
            output_tokens: 0.0,
            ..Of::job(job)
        };
        let reading = read(conn, control, &queued, &plan, behind(&queued)).await?;
        let models: Vec<String> = reading.names.iter().flatten().cloned().collect();
        let before = store::queued_before(&mut *conn, &models, job.class, job.id).await?;
        Ok(inputs
            .eta(control, &queued, &plan, &reading, now)
            .map(|eta| (eta, before)))
    }

    /// `job`'s plan with what `inputs` know (`None` if no route takes it).
    fn plan(&self, inputs: &Inputs, control: &Snapshot, job: &NewJob, now: DateTime<Utc>) -> Option<Plan> {
        let known = Known::new(&inputs.learned);
        let planner = Planner {
            config: &control.config,
            tenants: &control.tenants,
            keyring: &control.keyring,
            calibration: &inputs.calibration,
            known: &known,
            key_turn: &self.key_turn,
        };
        planner.plan(Candidate::arriving(job), now).ok()
    }

    /// The reading of an unchecked forecast: the last one of its model and class when
    /// younger than [`QUEUE_REREAD`], else a fresh one that counts every queued job of its
    /// tenant's as ahead of it (it is shared by the next second's jobs, of any tenant).
    async fn unchecked_reading(
        &self,
        conn: &mut PgConnection,
        control: &Snapshot,
        of: &Of<'_>,
        plan: &Plan,
    ) -> Result<Arc<Reading>, StoreError> {
        let key = (of.one.model.clone(), of.one.class);
        let recent = |m: &std::sync::Mutex<RecentReadings>| {
            m.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(&key)
                .filter(|(at, _)| at.elapsed() < QUEUE_REREAD)
                .map(|(_, r)| r.clone())
        };
        if let Some(reading) = recent(&self.unchecked) {
            return Ok(reading);
        }
        let everyone = Behind {
            tenant: "",
            ..behind(of)
        };
        let reading = Arc::new(read(conn, control, of, plan, everyone).await?);
        self.unchecked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key, (std::time::Instant::now(), reading.clone()));
        Ok(reading)
    }

    /// What a forecast reads seldom, as last read (each at most every [`REREAD_EVERY`],
    /// one after the other). Read it before taking the connection the forecast reads the
    /// queue on: a connection held while waiting for another empties the pool in a burst.
    pub async fn inputs(&self, pool: &PgPool, now: DateTime<Utc>) -> Result<Inputs, StoreError> {
        Ok(Inputs {
            calibration: self
                .calibration
                .get(async {
                    let rows = store::calibrations(pool).await?;
                    Ok(rows.into_iter().map(|c| (c.model.clone(), c)).collect())
                })
                .await?,
            learned: self.learned.get(store::learned_limits(pool)).await?,
            latencies: self
                .latencies
                .get(store::call_latencies(pool, now - LOOK_BACK))
                .await?,
            turnarounds: self
                .turnarounds
                .get(store::batch_turnarounds(
                    pool,
                    now,
                    provider_batches::MIN_TURNAROUND_PACKS,
                ))
                .await?,
            record: self
                .record
                .get(store::forecast_record(pool, None, now - LOOK_BACK))
                .await?,
            arriving: self
                .arriving
                .get(async {
                    let window = ARRIVALS_WINDOW.num_seconds() as f64;
                    let mut rows = store::arrived_since(pool, now - ARRIVALS_WINDOW).await?;
                    for Arrived { queued: r, .. } in &mut rows {
                        // Since the first of them came, when that is within the window: a
                        // stream that began lately comes at its pace since, not diluted by
                        // the quiet before it. At least ARRIVALS_SPAN_FLOOR: a few jobs
                        // come together are not a stream.
                        let since_first = (now - r.oldest).num_milliseconds() as f64 / 1e3;
                        let span = since_first.clamp(ARRIVALS_SPAN_FLOOR, window);
                        for v in [&mut r.jobs, &mut r.input_tokens, &mut r.output_tokens] {
                            *v /= span;
                        }
                    }
                    Ok(rows)
                })
                .await?,
            lags: self.lags.get(store::fairness_lags(pool)).await?,
        })
    }
}

/// A forecast's slow inputs, as last read ([`Forecaster::inputs`]).
pub struct Inputs {
    calibration: HashMap<String, Calibration>,
    learned: Vec<Learned>,
    latencies: HashMap<(String, String), CallLatency>,
    turnarounds: Turnarounds,
    record: ForecastRecord,
    /// What arrives per second, by class, tenant, requested model, priority and how far
    /// ahead its deadlines stand.
    arriving: Vec<Arrived>,
    /// The leading gate's lags of each queue behind its class's clock, by class and tenant
    /// (read every [`QUEUE_REREAD`]: they move with every round).
    lags: HashMap<(JobClass, String), f64>,
}

impl Inputs {
    /// The forecast of `of` planned as `plan`, with the queue and buckets of `reading`.
    fn eta(
        &self,
        control: &Snapshot,
        of: &Of<'_>,
        plan: &Plan,
        reading: &Reading,
        now: DateTime<Utc>,
    ) -> Option<Eta> {
        let config = &control.config;
        let job = of.one;
        let (names, found, read_ahead) = (&reading.names, &reading.found, reading.ahead_and_since());
        let weight_of = |tenant: &str| control.tenants.weight(tenant);
        let lag_of = |class: JobClass, tenant: &str| self.lags.get(&(class, tenant.to_owned())).copied();
        let work = |jobs, input_tokens, output_tokens| Work {
            tenant: &job.tenant,
            class: job.class,
            weight: plan.weight,
            jobs,
            input_tokens,
            output_tokens,
        };
        let one = work(
            1.0,
            f64::from(job.estimated_input_tokens.max(0)),
            f64::from(job.estimated_output_tokens.max(0)),
        );
        let all = work(of.jobs, of.input_tokens, of.output_tokens);
        let overrun = forecast::overrun(self.record.jobs, self.record.p90_overrun);
        let policy = Policy::new(config.gate.clone());
        let kept = |b: &Bucket, class: JobClass| policy.headroom(b, class);
        let starve_after = |class: JobClass| {
            (class != JobClass::Interactive).then(|| config.classes.get(class).starve_after_secs as f64)
        };
        let etas = plan.routes.iter().zip(names).filter_map(|(route, names)| {
            let on_route = |rows: &[Queued]| -> Vec<Queued> {
                rows.iter()
                    .filter(|q| names.contains(&q.model))
                    .cloned()
                    .collect()
            };
            let (ahead, behind) = (on_route(&read_ahead), on_route(&reading.behind));
            let arrived: Vec<&Arrived> = self
                .arriving
                .iter()
                .filter(|a| names.contains(&a.queued.model))
                .collect();
            let arriving: Vec<Queued> = arrived.iter().map(|a| a.queued.clone()).collect();
            let overtaking = Overtaking::of(
                arrived.iter().copied(),
                &job.tenant,
                job.class,
                job.priority,
                job.deadline,
                now,
            );
            let outlook = Outlook {
                buckets: found,
                kept: &kept,
                ahead: &ahead,
                behind: &behind,
                arriving: &arriving,
                overtaking: &overtaking,
                weight_of: &weight_of,
                lag_of: &lag_of,
                latency: latency(
                    config,
                    &self.latencies,
                    &self.turnarounds,
                    &route.target,
                    job,
                    now,
                ),
                overrun,
                starve_after: &starve_after,
                burst_credit: config.gate.burst_credit_tokens as f64,
                now,
            };
            forecast::on_route(route, &one, &all, &outlook)
        });
        forecast::earliest(etas)
    }
}

/// What each route of `plan` is asked for as: the names whose queued jobs compete there.
fn route_names(config: &Config, plan: &Plan, job: &NewJob) -> Vec<Vec<String>> {
    plan.routes
        .iter()
        .map(|r| requested_as(config, &r.target, job))
        .collect()
}

/// Whose queued work stands behind `of`'s job: its own tenant's served after it, and its
/// batch's lines.
fn behind<'a>(of: &'a Of<'_>) -> Behind<'a> {
    Behind {
        tenant: &of.one.tenant,
        class: of.one.class,
        priority: of.one.priority,
        deadline: of.one.deadline,
        batch_id: of.batch_id,
    }
}

/// Reads on `conn` the buckets on `plan`'s paths and the queued work on its routes but
/// what is `behind` the job.
async fn read(
    conn: &mut PgConnection,
    control: &Snapshot,
    of: &Of<'_>,
    plan: &Plan,
    behind: Behind<'_>,
) -> Result<Reading, StoreError> {
    let names = route_names(&control.config, plan, of.one);
    let all_names: Vec<String> = names
        .iter()
        .flatten()
        .cloned()
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let keys: Vec<String> = plan.bucket_keys().cloned().collect();
    let found = store::buckets_by_key(&mut *conn, &keys)
        .await?
        .into_iter()
        .map(|b| (b.key.clone(), b))
        .collect();
    let (ahead, behind) = store::queued_around(&mut *conn, &all_names, behind).await?;
    Ok(Reading {
        names,
        found,
        ahead,
        behind,
        since: std::sync::Mutex::default(),
    })
}

/// The names a job may ask for that reach `target` (route aliases, `provider/model`, a
/// listed model): their queued jobs compete with it there.
fn requested_as(config: &Config, target: &Target, job: &NewJob) -> Vec<String> {
    let mut names: Vec<String> = routing::names(config)
        .into_iter()
        .filter(|name| {
            routing::resolve(config, name, job.endpoint).is_ok_and(|targets| {
                targets
                    .iter()
                    .any(|t| t.provider == target.provider && t.model == target.model)
            })
        })
        .collect();
    if !names.contains(&job.model) {
        names.push(job.model.clone());
    }
    names
}

/// How long the work takes once it starts on `target`: a provider batch's observed
/// turnaround (or its window) when it goes through one, else the calls' observed latency.
fn latency(
    config: &Config,
    latencies: &HashMap<(String, String), CallLatency>,
    turnarounds: &Turnarounds,
    target: &Target,
    job: &NewJob,
    now: DateTime<Utc>,
) -> Latency {
    let key = (target.provider.clone(), target.model.clone());
    if job.class == JobClass::Batch {
        let lane = provider_batches::decide(config, turnarounds, job.endpoint, &job.model, job.deadline, now);
        if lane.via == Lane::ProviderBatch {
            let window = config
                .provider(&target.provider)
                .map_or(86_400.0, |p| p.batch_api.min_deadline_secs as f64);
            let secs = turnarounds
                .get(&key)
                .map_or(window, |t| t.num_milliseconds() as f64 / 1e3);
            return Latency { p50: secs, p90: secs };
        }
    }
    match latencies.get(&key) {
        Some(seen) if seen.calls >= MIN_CALLS => Latency {
            p50: seen.p50,
            p90: seen.p90.max(seen.p50),
        },
        _ => forecast::UNSEEN_LATENCY,
    }
}
