//! The gate role: admission's reading, writing and loop around the pure
//! [`tollgate::scheduler`]. A round reads the active queues and their best candidates (each
//! queue's head in its tenant's order, and its oldest jobs past their class's starvation
//! guard: behind more jobs due sooner than the head read, they would never be seen), plans
//! them ([`Planner`]), locks the buckets on their paths (in id order) in one transaction,
//! applies settlements and learned limits, lets the [`Scheduler`] decide, and commits
//! the reservations of the whole round — all or nothing per job — then writes failures
//! and explanations and records the decisions in the metrics. Correctness rests on the
//! bucket row locks; one gate is active at a time (a PostgreSQL advisory lock elects it)
//! only so that one process keeps the fairness bookkeeping. The active gate's rounds run
//! their transaction on the session holding that lock: a round commits only while its
//! gate leads, and a gate whose lock connection died admits nothing more — its next round
//! fails at once and it stands for election again.
//!
//! Every way a job reaches `running`, and why each exists:
//! - **A dispatcher's claim** (`store::claim_jobs`): admitted online jobs, claimed by any
//!   process's dispatcher as its call slots free. Admission and running are separate so
//!   that what one gate admits any process can run, and so that a job admitted while no
//!   dispatcher has room keeps its reservation until one does.
//! - **The admission's own write** (`store::admit` with a `Starter`): what this process's
//!   dispatcher has room for goes straight to `running`, leased to it, and is handed over
//!   ([`Handoff`]): one write of the job row instead of two, and no wake-up in between.
//! - **Admission on arrival** ([`Gate::admit_arrivals`], `store::insert_started_jobs`): in
//!   the API process, interactive jobs with no other interactive job queued are inserted
//!   admitted and running when their buckets hold them — all the arrivals waiting in one
//!   transaction and one statement — without waiting for a round: the round would
//!   decide the same, later.
//! - **The stream claim** (`store::claim_stream_job`, by `Dispatcher::claim_stream`): a
//!   streaming job runs in the process holding its client's connection, which claims it
//!   by id once admitted; the round never starts one (`Admission::startable`). Admitted on
//!   arrival — in that same process — it is inserted running for it, and its caller relays
//!   it at once.
//! - **A provider-batch pack** (`store::open_pack`, by the provider-batch worker): jobs
//!   going through a provider's batch API are claimed together, as one pack, under the
//!   pack's lease (the provider's window), not a process's.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tollgate::buckets::{self, Bucket, BucketSpec};
use tollgate::clock::Clock;
use tollgate::config::Config;
use tollgate::control::{Directory, Snapshot};
use tollgate::learning::{self, Learned};
use tollgate::learning::{is_pace, pace_key};
use tollgate::metrics;
use tollgate::model::{Job, JobClass, JobId, NewJob};
use tollgate::notify::Notifications;
use tollgate::provider_batches;
use tollgate::reread::Reread;
use tollgate::scheduler::plan::{is_probe, probe_key};
use tollgate::scheduler::{self, Decision, Failed, Known, Planner, Policy, Scheduler};
use tollgate::store::{self, Admission, Calibration, Candidate, FlexObservations, StoreError};
use tollgate::tenants::TenantDirectory;
use tollgate::vocab::{Dimension, LearnedFrom, Rule};

use crate::dispatcher::Handoff;

/// Advisory lock key of the active gate ("tollgate" in ASCII, as a number).
pub const GATE_LOCK: i64 = 0x746f_6c6c_6761_7465;
/// Shortest pause between two rounds that did not fill a batch: arrivals and releases in
/// that time are handled by one round instead of one round each.
const MIN_PAUSE: Duration = Duration::from_millis(2);
/// With nothing queued, how often at most a round runs for capacity freed by finished
/// jobs: only an arrival needs their refunds then, and one that finds its buckets short is
/// queued and wakes the gate at once. (A round per finished job had the gate run hundreds
/// of rounds a second beside a busy synchronous path, each several statements.)
const SETTLE_IDLE_EVERY: Duration = Duration::from_millis(25);
/// How often the gate re-reads what changes slowly: the learned estimates, what the flex
/// tiers did.
const REREAD_EVERY: Duration = Duration::from_secs(10);

/// Connections [`Gate::admit_arrivals`] uses at once: its reads, side by side (its
/// transaction comes after them).
pub const ARRIVAL_CONNECTIONS: u32 = 4;

/// Fewest jobs a round reads (across all queues), however few the last round admitted.
const MIN_READ: usize = 32;

/// The first round reads as if the previous one had filled a batch.
fn batch_hint() -> usize {
    usize::MAX / 4
}

/// Most finished jobs whose settlements one round applies.
const REFUNDS_PER_ROUND: i64 = 50_000;
/// How often the active gate writes its fairness lags for the forecasts.
const PUBLISH_LAGS_EVERY: Duration = Duration::from_secs(1);
/// How often the active gate checks that it still holds its lock.
const LEADER_CHECK: Duration = Duration::from_secs(1);

/// What one round did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Round {
    pub admitted: usize,
    /// Jobs considered this round that had to wait for capacity.
    pub blocked: usize,
    pub failed: usize,
    /// When the earliest blocked job should fit (if time alone will make it fit).
    pub next_ready: Option<DateTime<Utc>>,
    /// The round stopped at the batch limit: more may be admissible right away.
    pub full: bool,
    /// The queues held work when the round read them.
    pub queued: bool,
}

pub struct Gate {
    pool: PgPool,
    config: Arc<Config>,
    notifications: Notifications,
    /// The policy and its fairness state, shared by rounds and arrivals.
    scheduler: Mutex<Scheduler>,
    /// The fit rules, for arrivals (they need no fairness state to decide).
    policy: Policy,
    /// Admissions of the previous round: sizes the next round's read, so a saturated
    /// bucket does not make every round read hundreds of jobs it cannot admit.
    last_admitted: AtomicUsize,
    /// Rotates the first key tried when keys have their own limits.
    key_turn: AtomicUsize,
    /// Learned estimates per model.
    calibration: Reread<HashMap<String, Calibration>>,
    /// What the flex tiers did lately (`provider_batches::flex_observations`).
    flex_observed: Reread<FlexObservations>,
    /// This process's dispatcher, when it has one: jobs it has room for start in the
    /// admission's own write.
    handoff: Option<Handoff>,
    /// The time rounds are run at (a broker's: the database's).
    clock: Clock,
    /// The tenants: weights, and the limits and budgets on their jobs' paths.
    tenants: Directory,
}

/// Whether the gate's lock connection still answers (its session, and so its lock, lives).
async fn leads(leader: &mut PgConnection) -> bool {
    leader.ping().await.is_ok()
}

/// A mutex's value, also after a panic while it was held (what it guards stays usable).
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The queues (class, tenant) read to `per_queue`, the limit: they may hold more, unread.
fn queues_read_in_part(candidates: &[Candidate], per_queue: usize) -> HashSet<(JobClass, String)> {
    let mut read: HashMap<(JobClass, &str), usize> = HashMap::new();
    for c in candidates {
        *read.entry((c.class, c.tenant.as_str())).or_default() += 1;
    }
    read.into_iter()
        .filter(|(_, n)| *n >= per_queue)
        .map(|((class, tenant), _)| (class, tenant.to_owned()))
        .collect()
}

/// A failure as the store writes it: id, reason code, message, the gate's note.
fn failure(f: Failed) -> store::QueuedFailure {
    store::QueuedFailure {
        id: f.job.id,
        code: f.verdict.code().as_str(),
        message: f.message,
        note: f.note,
    }
}

/// Counts a round's decisions in the metrics.
fn record(decision: &Decision, now: DateTime<Utc>) {
    for a in &decision.admitted {
        metrics::admitted(&a.plan.job, a.target(), a.preferred(), now);
    }
    for f in decision.failed.iter().filter(|f| f.verdict.by_bucket()) {
        metrics::failed(&f.job, &f.bucket, f.verdict.code().as_str());
    }
    for w in &decision.waiting {
        metrics::waiting(&w.job, &w.note);
    }
}

impl Gate {
    pub fn new(pool: PgPool, config: Arc<Config>, notifications: Notifications) -> Self {
        Self {
            scheduler: Mutex::new(Scheduler::new(Policy::new(config.gate.clone()))),
            policy: Policy::new(config.gate.clone()),
            pool,
            notifications,
            last_admitted: AtomicUsize::new(batch_hint()),
            key_turn: AtomicUsize::new(0),
            calibration: Reread::new(REREAD_EVERY),
            flex_observed: Reread::new(REREAD_EVERY),
            handoff: None,
            clock: Clock::system(),
            tenants: Directory::fixed(
                TenantDirectory::from_config(&config).unwrap_or_default(),
                config.clone(),
            ),
            config,
        }
    }

    /// Plans with the tenants of `directory`, kept current with the control plane (else
    /// the config's tenants).
    pub fn with_tenants(mut self, directory: Directory) -> Self {
        self.tenants = directory;
        self
    }

    /// Reckons time by `clock` (a broker's: the database's).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Starts admitted jobs on this process's dispatcher when it has room ([`Handoff`]).
    pub fn with_handoff(mut self, handoff: Handoff) -> Self {
        self.handoff = Some(handoff);
        self
    }

    fn planner<'a>(
        &'a self,
        calibration: &'a HashMap<String, Calibration>,
        known: &'a Known,
        control: &'a Snapshot,
    ) -> Planner<'a> {
        Planner {
            config: &control.config,
            tenants: &control.tenants,
            keyring: &control.keyring,
            calibration,
            known,
            key_turn: &self.key_turn,
        }
    }

    /// Admits an interactive job as it arrives, without waiting for a round
    /// ([`Gate::admit_arrivals`] for one job).
    pub async fn admit_arrival(&self, pool: &PgPool, job: &NewJob) -> Result<Option<Job>, StoreError> {
        Ok(self.admit_arrivals(pool, &[job]).await?.pop().flatten())
    }

    /// Admits interactive jobs as they arrive, without waiting for a round: in one
    /// transaction the buckets on their paths are locked (in id order, as a round locks
    /// them) and each job, in the order given, that they hold is inserted admitted and
    /// running for this process's dispatcher, which is handed it — or, for a stream, whose
    /// caller relays it (its client is connected to this process; a stream takes no call
    /// slot). A round would decide the same: interactive work goes first, and with no
    /// interactive job queued these are next in line. When another interactive job is
    /// queued, a limit was just learned and not yet applied, this dispatcher has no room,
    /// or the buckets cannot hold a job now, nothing is written for it (`None`) and the
    /// caller queues it as usual. A job with an idempotency key is left to the usual insert
    /// too (it may name an existing job). Returns each job's started row, in the order
    /// given.
    /// `pool` is the caller's (the gate's own connections belong to its thread); the
    /// arrivals use up to [`ARRIVAL_CONNECTIONS`] of them at once, and never hold one while
    /// waiting for another.
    pub async fn admit_arrivals(
        &self,
        pool: &PgPool,
        jobs: &[&NewJob],
    ) -> Result<Vec<Option<Job>>, StoreError> {
        let mut started: Vec<Option<Job>> = vec![None; jobs.len()];
        let Some(handoff) = &self.handoff else {
            return Ok(started);
        };
        let arriving: Vec<usize> = (0..jobs.len())
            .filter(|&i| {
                let job = jobs[i];
                job.class == JobClass::Interactive && job.idempotency_key.is_none()
            })
            .collect();
        let calls = arriving.iter().filter(|&&i| !jobs[i].stream).count();
        let mut permits = handoff.permits(calls);
        // Streams need no room; other jobs beyond the room there is are not started.
        let mut room = permits.len();
        let arriving: Vec<usize> = arriving
            .into_iter()
            .filter(|&i| {
                if jobs[i].stream {
                    return true;
                }
                let fits = room > 0;
                room = room.saturating_sub(1);
                fits
            })
            .collect();
        if arriving.is_empty() {
            return Ok(started);
        }
        let now = self.clock.now();
        // The reads side by side, each on a connection it gives back when done; the
        // transaction after them. Nothing holds a connection while waiting for another,
        // so arrivals side by side cannot starve each other of the pool.
        let (queued, learned, paused, calibration) = tokio::try_join!(
            store::interactive_queued(pool),
            store::learned_limits(pool),
            store::active_pauses(pool, now),
            self.calibration(pool),
        )?;
        if queued || learned.iter().any(Learned::pending) {
            return Ok(started);
        }
        let paused: scheduler::Pauses = paused.into_iter().collect();
        let known = Known::new(&learned);
        let control = self.tenants.snapshot();
        let planner = self.planner(&calibration, &known, &control);
        // What a round would fail is the round's to fail, with its reason.
        let plans: Vec<(usize, scheduler::Plan)> = arriving
            .into_iter()
            .filter_map(|i| Some((i, planner.plan(Candidate::arriving(jobs[i]), now).ok()?)))
            .collect();
        let mut keys: Vec<String> = plans.iter().flat_map(|(_, p)| p.bucket_keys().cloned()).collect();
        keys.sort();
        keys.dedup();
        if plans.is_empty() {
            return Ok(started);
        }

        let mut tx = pool.begin().await?;

        let now = self.clock.now();
        let mut buckets: HashMap<String, Bucket> = store::lock_buckets_by(&mut tx, &keys, &[])
            .await?
            .into_iter()
            .map(|mut b| {
                b.refill(now);
                (b.key.clone(), b)
            })
            .collect();
        let starter = store::Starter {
            owner: &handoff.owner,
            lease: handoff.lease,
        };
        let (mut served, mut admitted, mut took) = (Vec::new(), Vec::new(), HashSet::new());
        for (i, plan) in &plans {
            // A bucket not created yet (a probe, a limit just learned) is the round's to create.
            if !plan.bucket_keys().all(|k| buckets.contains_key(k)) {
                continue;
            }
            // Held by an operator's pause: the round explains why it waits.
            if tollgate::holds::holding(&paused, &plan.job.tenant, &plan.job.model).is_some() {
                continue;
            }
            let Some(route) =
                self.policy
                    .first_fitting(&plan.routes, plan.class, &buckets, &paused, &HashSet::new())
            else {
                continue;
            };
            let admission = scheduler::take(plan, route, &mut buckets);
            took.extend(admission.bucket_ids.iter().copied());
            metrics::admitted(&plan.job, &plan.routes[route].target, &plan.routes[0].target, now);
            admitted.push(admission);
            served.push((*i, plan));
        }
        if served.is_empty() {
            tx.rollback().await?;
            return Ok(started);
        }
        let taken: Vec<Bucket> = buckets.into_values().filter(|b| took.contains(&b.id)).collect();
        let arrived: Vec<&NewJob> = served.iter().map(|(i, _)| jobs[*i]).collect();
        let rows = store::insert_started_jobs(&mut tx, &arrived, &admitted, starter, &taken, now).await?;
        tx.commit().await?;
        for ((i, _), job) in served.iter().zip(rows) {
            started[*i] = Some(job);
        }
        {
            let mut scheduler = locked(&self.scheduler);
            for (_, plan) in served {
                scheduler.served_on_arrival(plan);
            }
        }
        let handed: Vec<Job> = started.iter().flatten().filter(|j| !j.stream).cloned().collect();
        permits.truncate(handed.len());
        handoff.hand(handed, permits);
        Ok(started)
    }

    /// The learned estimates (calibration) by model.
    async fn calibration(&self, pool: &PgPool) -> Result<HashMap<String, Calibration>, StoreError> {
        self.calibration
            .get(async {
                let rows = store::calibrations(pool).await?;
                Ok(rows.into_iter().map(|c| (c.model.clone(), c)).collect())
            })
            .await
    }

    /// Brings learned limits into the locked `buckets`: creates the buckets that only
    /// learning, the cold-start probe or the pace knows (`needed` keys not found), drops the
    /// paces of scopes that learn their first limit, applies what is new in each row.
    /// Returns the rows it changed.
    async fn learn(
        &self,
        tx: &mut PgConnection,
        rows: &mut [Learned],
        needed: &HashSet<String>,
        buckets: &mut HashMap<String, Bucket>,
        now: DateTime<Utc>,
    ) -> Result<HashSet<usize>, StoreError> {
        let mut changed = HashSet::new();
        let mut specs: Vec<(BucketSpec, f64, &str)> = Vec::new();
        for key in needed.iter().filter(|k| !buckets.contains_key(*k) && is_pace(k)) {
            let scope = key.trim_end_matches(":pace");
            let spec = learning::pace_spec(scope, self.config.gate.pace_start_rps);
            let level = spec.capacity;
            specs.push((spec, level, "pace"));
        }
        for key in needed.iter().filter(|k| !buckets.contains_key(*k) && is_probe(k)) {
            let capacity = self.config.gate.probe_concurrency.max(1) as f64;
            let scope = key.trim_end_matches(":probe").to_owned();
            specs.push((
                BucketSpec {
                    key: key.clone(),
                    scope,
                    dimension: Dimension::Concurrency,
                    rule: Rule::Gauge,
                    capacity,
                    window_secs: 0,
                    ramp_step: None,
                },
                capacity,
                "probe",
            ));
        }
        // The paces of scopes whose first limit is learned now: that limit governs instead.
        let mut retired = Vec::new();
        for (i, row) in rows.iter_mut().enumerate() {
            if !row.governs() || !row.pending() || buckets.contains_key(&row.bucket_key()) {
                continue;
            }
            let (capacity, level) = match (row.reported, row.source) {
                (Some(reported), _) => (reported, reported),
                (None, LearnedFrom::Throttling) => {
                    let (provider, model) = buckets::scope_target(&row.scope);
                    let window = chrono::Duration::seconds(row.name.window_secs());
                    let (requests, tokens) =
                        store::sent_since(&mut *tx, provider, model, now - window).await?;
                    let sent = match row.name.dimension() {
                        Dimension::Requests => requests,
                        _ => tokens,
                    };
                    let (capacity, ceiling) = learning::first_capacity(sent);
                    // What was admitted while the limit was unknown meets it too.
                    let requeued = store::requeue_admitted(&mut *tx, provider, model).await?;
                    tracing::info!(scope = %row.scope, limit = %row.name.as_str(), capacity, requeued, "a 429 taught a limit");
                    row.ceiling = Some(ceiling);
                    row.decreases = 1;
                    row.changed_at = Some(now);
                    row.applied_at = Some(row.latest());
                    changed.insert(i);
                    (capacity, 0.0)
                }
                (None, LearnedFrom::Headers) => continue,
            };
            retired.push(pace_key(&row.scope));
            specs.push((
                BucketSpec {
                    key: row.bucket_key(),
                    scope: row.scope.clone(),
                    dimension: row.name.dimension(),
                    rule: row.name.rule(),
                    capacity,
                    window_secs: row.name.window_secs(),
                    ramp_step: None,
                },
                level,
                "learned",
            ));
        }
        for mut b in store::create_buckets(&mut *tx, &specs, now).await? {
            b.refill(now);
            if is_pace(&b.key) {
                // When it last changed: the first doubling is a second away.
                b.learned_at = Some(now);
            }
            buckets.insert(b.key.clone(), b);
        }
        retired.sort();
        retired.dedup();
        store::drop_buckets(&mut *tx, &retired).await?;
        for key in &retired {
            buckets.remove(key);
        }
        // A 429 that said nothing cuts the limits that held the traffic back, not those
        // with room to spare.
        let spared = learning::spared(rows, buckets);
        for (i, row) in rows.iter_mut().enumerate() {
            if !row.pending() {
                continue;
            }
            if spared.contains(&row.bucket_key()) {
                row.applied_at = Some(row.latest());
                changed.insert(i);
                continue;
            }
            let authority = self
                .config
                .provider(buckets::scope_target(&row.scope).0)
                .map(|p| p.limit_authority)
                .unwrap_or_default();
            match buckets.get_mut(&row.bucket_key()) {
                Some(bucket) => learning::apply(row, bucket, authority, now),
                // Nothing to govern (a bare sighting): just note it was seen.
                None if !row.governs() => row.applied_at = Some(row.latest()),
                None => continue,
            }
            changed.insert(i);
        }
        Ok(changed)
    }

    /// One round at time `now`: read candidates, admit what fits, explain what waits.
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<Round, StoreError> {
        self.round(None, now).await
    }

    /// A round whose transaction runs on `leader` — the session holding the gate's lock —
    /// when given, so that it commits only while that session (and its lock) lives; on a
    /// pooled connection otherwise (tests driving rounds by hand).
    async fn round(
        &self,
        leader: Option<&mut PgConnection>,
        now: DateTime<Utc>,
    ) -> Result<Round, StoreError> {
        let batch = self.config.gate.batch;
        let queues = store::active_queues(&self.pool).await?;
        let per_queue = if queues.is_empty() {
            0
        } else {
            let last = self.last_admitted.load(Ordering::Relaxed);
            let wanted = (2 * last.max(MIN_READ)).min(2 * batch);
            (wanted / queues.len()).clamp(4, batch)
        };
        // Each queue's jobs past their class's starvation guard are read beside its head.
        let guards_from = self.tenants.snapshot();
        let starving_before: Vec<DateTime<Utc>> = queues
            .iter()
            .map(|(class, _)| scheduler::plan::starving_before(&guards_from.config, *class, now))
            .collect();
        let read_candidates = async {
            if queues.is_empty() {
                return Ok(Vec::new());
            }
            store::candidates(&self.pool, &queues, &starving_before, per_queue as i64, now).await
        };
        // The reads side by side, each on a connection of its own: a round's wait is one
        // read's, not three in a row.
        let lanes = self.tenants.snapshot();
        let (mut candidates, calibration, mut learned, flex_observed) = tokio::try_join!(
            read_candidates,
            self.calibration(&self.pool),
            store::learned_limits(&self.pool),
            self.flex_observed.get(provider_batches::flex_observations(
                &self.pool,
                &lanes.config,
                now
            )),
        )?;
        // Taken after the candidates are read, so they are planned with this process's
        // newest view of the control plane (routes added as they were accepted).
        let control = self.tenants.snapshot();
        let read_in_part = queues_read_in_part(&candidates, per_queue);
        provider_batches::decide_candidates(
            &self.pool,
            &control.config,
            &flex_observed,
            &mut candidates,
            now,
        )
        .await?;
        let known = Known::new(&learned);
        let planner = self.planner(&calibration, &known, &control);
        let mut failures: Vec<store::QueuedFailure> = Vec::new();
        let mut plans = Vec::new();
        let mut unknown = Vec::new();
        for c in candidates {
            match planner.plan(c, now) {
                Ok(p) => plans.push(p),
                Err(f) if f.verdict == scheduler::Verdict::UnknownModel => unknown.push(f.job),
                Err(f) => failures.push(failure(*f)),
            }
        }
        // A job another process accepted with a route this one has not read yet: the
        // control plane is read again before its model is called unknown.
        if !unknown.is_empty() {
            if let Err(e) = self.tenants.refresh(&self.pool).await {
                tracing::warn!(error = %e, "could not reread the control plane");
            }
            let control = self.tenants.snapshot();
            let planner = self.planner(&calibration, &known, &control);
            for c in unknown {
                match planner.plan(c, now) {
                    Ok(p) => plans.push(p),
                    Err(f) => failures.push(failure(*f)),
                }
            }
        }
        for p in &mut plans {
            p.unread_behind = read_in_part.contains(&(p.job.class, p.job.tenant.clone()));
        }
        // Every bucket a candidate needs, and those with learned news to apply.
        let needed: HashSet<String> = plans
            .iter()
            .flat_map(|p| p.bucket_keys().cloned())
            .chain(
                learned
                    .iter()
                    .filter(|r| r.pending() || r.source == LearnedFrom::Throttling)
                    .map(Learned::bucket_key),
            )
            .collect();
        let keys: Vec<String> = needed.iter().cloned().collect();
        let news = learned.iter().any(Learned::pending);
        let (mut permits, limit) = self.room(plans.len()).await?;

        let mut tx = match leader {
            Some(conn) => conn.begin().await?,
            None => self.pool.begin().await?,
        };
        // Settlements of finished jobs first: what they did not use is available again.
        let refunds = store::take_pending_refunds(&mut tx, REFUNDS_PER_ROUND).await?;
        // Read after the refunds: a 429's pause commits with its refund, so a slot given
        // back here is never used before its pause is seen.
        let paused: scheduler::Pauses = store::active_pauses(&mut *tx, now).await?.into_iter().collect();
        if plans.is_empty() && refunds.is_empty() && !news {
            tx.commit().await?;
            let failed = store::fail_queued(&self.pool, &failures, now).await? as usize;
            return Ok(Round {
                failed,
                queued: !queues.is_empty(),
                ..Round::default()
            });
        }
        let refund_ids: Vec<i64> = refunds.keys().copied().collect();
        let mut buckets: HashMap<String, Bucket> = store::lock_buckets_by(&mut tx, &keys, &refund_ids)
            .await?
            .into_iter()
            .map(|mut b| {
                b.refill(now);
                if let Some(r) = refunds.get(&b.id) {
                    b.give_back(*r);
                }
                (b.key.clone(), b)
            })
            .collect();
        // Scopes whose first response is applied now: their probe is over.
        let first_seen: Vec<String> = {
            let scopes: HashSet<&str> = learned
                .iter()
                .filter(|r| r.applied_at.is_none())
                .map(|r| r.scope.as_str())
                .collect();
            scopes.into_iter().map(probe_key).collect()
        };
        let mut learned_changed = self
            .learn(&mut tx, &mut learned, &needed, &mut buckets, now)
            .await?;
        let refilled = buckets.clone();

        let guessed = learning::guessed(&learned);
        let mut decision =
            locked(&self.scheduler).schedule(plans, &mut buckets, &guessed, &paused, limit, now);
        let failed = std::mem::take(&mut decision.failed);
        let waiting = std::mem::take(&mut decision.waiting);
        // What this round admits holds its buckets too, though it is not written yet.
        let taken: HashSet<i64> = decision
            .admitted
            .iter()
            .flat_map(|a| a.admission.bucket_ids.iter().copied())
            .collect();
        (decision.failed, decision.waiting) = self
            .not_for_good(&mut tx, failed, &refilled, &taken, waiting)
            .await?;
        record(&decision, now);
        let Decision {
            admitted,
            waiting,
            failed,
            blocked,
            next_ready,
            full,
            closed,
        } = decision;
        failures.extend(failed.into_iter().map(failure));
        // Probing upward where 429s taught the limit and the limit is what holds jobs back;
        // where nothing was learned yet, a pace that holds jobs back doubles.
        for (i, row) in learned.iter_mut().enumerate() {
            let key = row.bucket_key();
            if let Some(b) = buckets.get_mut(&key)
                && learning::increase(row, b, closed.contains(&key), now)
            {
                learned_changed.insert(i);
            }
        }
        for (key, b) in buckets.iter_mut().filter(|(k, _)| is_pace(k)) {
            learning::pace_up(b, closed.contains(key), now);
        }

        // What this process's dispatcher has room for starts now, in the admission's write.
        let mut admissions: Vec<Admission> = admitted.into_iter().map(|a| a.admission).collect();
        admissions.sort_by_key(|a| !a.startable); // stable: startable first, in round order
        permits.truncate(admissions.iter().filter(|a| a.startable).count());
        let starter = self.handoff.as_ref().map(|h| {
            let starter = store::Starter {
                owner: &h.owner,
                lease: h.lease,
            };
            (starter, permits.len())
        });
        let written = store::admit(&mut tx, &admissions, starter, now).await?;
        let admitted: HashSet<JobId> = written.ids().collect();
        if admitted.len() != admissions.len() {
            // Some were cancelled after we read them: charge only what was admitted.
            buckets = refilled;
            for a in admissions.iter().filter(|a| admitted.contains(&a.id)) {
                for (id, amount) in a.bucket_ids.iter().zip(&a.amounts) {
                    if let Some(b) = buckets.values_mut().find(|b| b.id == *id) {
                        b.take(*amount);
                    }
                }
            }
        }
        let changed: Vec<Bucket> = buckets.into_values().collect();
        store::save_buckets(&mut tx, &changed).await?;
        store::drop_buckets(&mut *tx, &first_seen).await?;
        tx.commit().await?;
        if let Some(handoff) = &self.handoff {
            handoff.hand(written.started, permits);
        }
        let rows: Vec<Learned> = learned_changed.iter().map(|&i| learned[i].clone()).collect();
        let notes: Vec<(JobId, serde_json::Value)> =
            waiting.into_iter().map(|w| (w.job.id, w.note)).collect();
        // The round's last writes touch different rows: side by side, on connections of
        // their own, so the next round waits for one of them, not three in a row.
        let ((), failed, ()) = tokio::try_join!(
            store::save_learned(&self.pool, &rows),
            store::fail_queued(&self.pool, &failures, now),
            store::explain(&self.pool, &notes, now),
        )?;
        let round = Round {
            admitted: admitted.len(),
            blocked,
            failed: failed as usize,
            next_ready,
            full,
            queued: !queues.is_empty(),
        };
        self.last_admitted
            .store(if round.full { batch } else { round.admitted }, Ordering::Relaxed);
        locked(&self.scheduler).admitted(admitted);
        Ok(round)
    }

    /// Of the jobs the round would fail because a window bucket (a daily budget or quota)
    /// cannot hold them before their deadline, those whose bucket is short only of what
    /// unsettled jobs hold (those of earlier rounds, or `taken` by this round's admissions)
    /// or refunds not yet applied: they wait instead (with `waiting`), for a job fails only
    /// for what is spent and cannot come back.
    async fn not_for_good(
        &self,
        tx: &mut PgConnection,
        failed: Vec<Failed>,
        buckets: &HashMap<String, Bucket>,
        taken: &HashSet<i64>,
        mut waiting: Vec<scheduler::Waiting>,
    ) -> Result<(Vec<Failed>, Vec<scheduler::Waiting>), StoreError> {
        let window = |f: &Failed| {
            buckets.get(&f.bucket).filter(|b| {
                matches!(
                    f.verdict,
                    scheduler::Verdict::DeadlineUnmeetable | scheduler::Verdict::BatchCostCapReached
                ) && matches!(b.rule, Rule::Fixed | Rule::Ramp)
            })
        };
        let ids: Vec<i64> = failed.iter().filter_map(|f| window(f).map(|b| b.id)).collect();
        if ids.is_empty() {
            return Ok((failed, waiting));
        }
        let held = store::held(tx, &ids).await?;
        let (later, now): (Vec<_>, Vec<_>) = failed
            .into_iter()
            .partition(|f| window(f).is_some_and(|b| held.contains(&b.id) || taken.contains(&b.id)));
        waiting.extend(later.into_iter().map(|f| scheduler::Waiting {
            note: serde_json::json!({"reason": "waiting_for_settlement", "bucket": f.bucket,
                "message": "what running jobs hold of this bucket may come back when they settle"}),
            job: f.job,
        }));
        Ok((now, waiting))
    }

    /// How many jobs this round may admit, and the room taken for those it starts itself.
    /// With a dispatcher here: its free room, plus at most one batch admitted and not yet
    /// claimed beyond it — admitting further ahead would only hold reservations for work no
    /// dispatcher is ready to send (and this process's own dispatcher would claim it, one
    /// more write per job, instead of being handed it). Read before the round's transaction,
    /// and only when the round's candidates exceed the room.
    async fn room(
        &self,
        candidates: usize,
    ) -> Result<(Vec<tokio::sync::OwnedSemaphorePermit>, usize), StoreError> {
        let batch = self.config.gate.batch;
        let Some(handoff) = &self.handoff else {
            return Ok((Vec::new(), batch));
        };
        let permits = handoff.permits(candidates.min(batch));
        if candidates <= permits.len() {
            return Ok((permits, batch));
        }
        let backlog = store::admitted_backlog(&self.pool, batch as i64).await? as usize;
        let limit = (permits.len() + batch.saturating_sub(backlog)).min(batch);
        Ok((permits, limit))
    }

    /// Holds the gate's advisory lock on a dedicated connection while it is the active gate.
    async fn lead(&self, cancel: &CancellationToken) -> Option<PgConnection> {
        loop {
            // Detached from the pool: the lock lives exactly as long as this connection.
            if let Ok(mut conn) = self.pool.acquire().await.map(|c| c.detach()) {
                let got: Result<bool, _> = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(GATE_LOCK)
                    .fetch_one(&mut conn)
                    .await;
                if let Ok(true) = got {
                    tracing::info!("this process is the active gate");
                    return Some(conn);
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Writes how far each queue is behind its class's clock ([`Scheduler::lags`]) for the
    /// forecasts at submission, which any process makes. A failure is logged: the
    /// forecasts then read the last lags written.
    async fn publish_lags(&self) {
        let control = self.tenants.snapshot();
        let lags = locked(&self.scheduler).lags(|t| control.tenants.weight(t));
        if let Err(e) = store::save_fairness_lags(&self.pool, &lags, self.clock.now()).await {
            tracing::warn!(error = %e, "could not write the fairness lags");
        }
    }

    /// The loop: become the active gate, then run rounds whenever work or capacity may
    /// have appeared (NOTIFY), when a blocked job should fit, or at the fallback poll.
    pub async fn run(&self, cancel: CancellationToken) {
        let poll = Duration::from_millis(self.config.gate.poll_interval_ms);
        'lead: while let Some(mut leader) = self.lead(&cancel).await {
            let mut checked = tokio::time::Instant::now();
            let mut published = checked - PUBLISH_LAGS_EVERY;
            loop {
                if cancel.is_cancelled() {
                    break 'lead;
                }
                let wake = self.notifications.gate_ready();
                let freed = self.notifications.capacity_ready();
                tokio::pin!(wake, freed);
                wake.as_mut().enable();
                freed.as_mut().enable();
                let round = match self.round(Some(&mut leader), self.clock.now()).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "gate round failed");
                        // A round that failed on a lost lock connection must not be retried on it.
                        if !leads(&mut leader).await {
                            tracing::warn!("lost the gate's lock connection; electing again");
                            continue 'lead;
                        }
                        Round::default()
                    }
                };
                if published.elapsed() >= PUBLISH_LAGS_EVERY {
                    published = tokio::time::Instant::now();
                    self.publish_lags().await;
                }
                if round.full {
                    continue;
                }
                let until_ready = round
                    .next_ready
                    .and_then(|at| (at - self.clock.now()).to_std().ok())
                    .unwrap_or(poll)
                    .clamp(MIN_PAUSE, poll);
                tokio::select! {
                    _ = cancel.cancelled() => break 'lead,
                    // Arrivals of the next moments gather into one round, but an
                    // interactive job does not wait for them.
                    _ = &mut wake => if !self.notifications.take_interactive() {
                        tokio::time::sleep(MIN_PAUSE).await
                    },
                    _ = &mut freed => {
                        let pause = if round.queued { MIN_PAUSE } else { SETTLE_IDLE_EVERY };
                        tokio::select! {
                            _ = cancel.cancelled() => break 'lead,
                            _ = &mut wake => {}
                            _ = tokio::time::sleep(pause) => {}
                        }
                    }
                    _ = tokio::time::sleep(until_ready) => {}
                }
                // Still the leader? A broken lock connection means another gate may run.
                if checked.elapsed() >= LEADER_CHECK {
                    checked = tokio::time::Instant::now();
                    if !leads(&mut leader).await {
                        tracing::warn!("lost the gate's lock connection; electing again");
                        continue 'lead;
                    }
                }
            }
        }
    }
}
