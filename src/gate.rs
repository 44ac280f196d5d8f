//! The gate: decides which queued jobs may go out now. A job is admitted only when every
//! bucket on its path — its tenant's limits and budgets, its target's provider limits —
//! can hold its estimate; the reservations of a whole round commit in one transaction
//! holding those buckets' row locks (taken in id order), all or nothing per job.
//!
//! Order: classes by precedence (interactive, standard, background, batch; a job waiting
//! longer than its class's `starve_after_secs` competes as interactive), then weighted
//! fair queuing across tenants within a class: each (class, tenant) queue has a virtual
//! time that advances by a job's token cost divided by the tenant's weight, and the queue
//! with the smallest virtual time goes next — deficit round robin in its continuous form,
//! with the deficit counted in tokens. A tenant that becomes active starts at most
//! `burst_credit_tokens / weight` behind the others (its burst credit). Inside a tenant's
//! queue: priority, then earliest deadline.
//!
//! When the job whose turn it is does not fit, the buckets that stopped it are closed for
//! the rest of the round, so smaller jobs behind it cannot starve it; the tenant's next
//! jobs are still considered (they may need other buckets — another route or provider),
//! and the job records why (`admission`: the bucket, its limit, what remains, when it should
//! fit). A job that can never fit, or not before its deadline, fails now
//! (`exceeds_limit`, `deadline_unmeetable`) instead of being dispatched late.
//!
//! One gate is active at a time (a PostgreSQL advisory lock elects it); correctness does
//! not depend on that — the bucket row locks do — only fairness bookkeeping does.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::buckets::{self, Bucket, BucketSpec, Demand, Dimension, Rule};
use crate::config::Config;
use crate::learning::{self, Learned, Source};
use crate::model::{Job, JobClass, JobId, NewJob};
use crate::notify::Notifications;
use crate::provider_batches;
use crate::routing::{self, Target};
use crate::store::{self, Admission, Candidate, StoreError};

/// Advisory lock key of the active gate ("tollgate" in ASCII, as a number).
const GATE_LOCK: i64 = 0x746f_6c6c_6761_7465;
/// Shortest pause between two rounds that did not fill a batch: arrivals and releases in
/// that time are handled by one round instead of one round each.
const MIN_PAUSE: Duration = Duration::from_millis(2);
/// How often the gate re-reads the learned estimates.
const CALIBRATION_REFRESH: Duration = Duration::from_secs(10);
/// Fewest samples before a learned output estimate replaces `max_tokens`.
const MIN_OUTPUT_SAMPLES: i64 = 20;
/// Margin on a learned output estimate.
const OUTPUT_MARGIN: f64 = 1.25;

/// Fewest jobs a round reads (across all queues), however few the last round admitted.
const MIN_READ: usize = 32;

/// The first round reads as if the previous one had filled a batch.
fn batch_hint() -> usize {
    usize::MAX / 4
}

/// Most finished jobs whose settlements one round applies.
const REFUNDS_PER_ROUND: i64 = 50_000;
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
}

pub struct Gate {
    pool: PgPool,
    config: Arc<Config>,
    notifications: Notifications,
    fairness: Mutex<Fairness>,
    /// Admissions of the previous round: sizes the next round's read, so a saturated
    /// bucket does not make every round read hundreds of jobs it cannot admit.
    last_admitted: std::sync::atomic::AtomicUsize,
    /// Rotates the first key tried when keys have their own limits.
    key_turn: std::sync::atomic::AtomicUsize,
    /// Learned estimates per model, re-read every [`CALIBRATION_REFRESH`].
    calibration: Mutex<(Option<tokio::time::Instant>, HashMap<String, store::Calibration>)>,
    /// This process's dispatcher, when it has one: jobs it has room for start in the
    /// admission's own write.
    handoff: Option<Handoff>,
}

/// The gate's way to this process's dispatcher. A job the gate admits while that
/// dispatcher has room is written as running, leased to it, in the admission's own write,
/// and handed over: one write of the job row instead of two (admit, then claim), and no
/// wake-up in between. The dispatcher runs what it was handed in order of class and
/// priority as its call slots free. The rest are admitted for any dispatcher to claim.
pub struct Handoff {
    /// The dispatcher's `lease_owner`.
    pub owner: String,
    pub lease: Duration,
    /// Room for jobs handed over and not yet finished (a permit each, given back when the
    /// job's outcome goes to the completer): bounds what one process holds.
    pub room: Arc<tokio::sync::Semaphore>,
    pub jobs: tokio::sync::mpsc::UnboundedSender<(crate::model::Job, tokio::sync::OwnedSemaphorePermit)>,
}

impl Handoff {
    /// Room for up to `wanted` jobs, taken now (none while the dispatcher is not running).
    fn permits(&self, wanted: usize) -> Vec<tokio::sync::OwnedSemaphorePermit> {
        if self.jobs.is_closed() {
            return Vec::new();
        }
        std::iter::from_fn(|| self.room.clone().try_acquire_owned().ok())
            .take(wanted)
            .collect()
    }

    /// Hands committed, started jobs over with their room. A job the dispatcher can no
    /// longer take (it stopped meanwhile) keeps its lease until the dispatcher's shutdown
    /// releases it or, after a crash, the lease expires.
    fn hand(&self, jobs: Vec<crate::model::Job>, permits: Vec<tokio::sync::OwnedSemaphorePermit>) {
        for (job, permit) in jobs.into_iter().zip(permits) {
            if self.jobs.send((job, permit)).is_err() {
                tracing::warn!("the dispatcher stopped before taking a job the gate started for it");
            }
        }
    }
}

/// Virtual times of the weighted fair queuing, per class.
#[derive(Default)]
struct Fairness {
    /// (class, tenant) → virtual time.
    vtime: HashMap<(JobClass, String), f64>,
    /// Per class: the virtual time of the latest admission (the class's clock).
    clock: HashMap<JobClass, f64>,
    /// Last explanation written per job, so unchanged ones are not rewritten.
    explained: HashMap<JobId, String>,
}

impl Fairness {
    /// A (class, tenant) queue's virtual time as its turn comes: a quiet tenant starts at
    /// most its burst credit behind the class's clock.
    fn turn_starts(&mut self, class: JobClass, tenant: &str, weight: f64, burst: f64) -> f64 {
        let clock = self.clock.get(&class).copied().unwrap_or(0.0);
        let vt = self.vtime.entry((class, tenant.to_owned())).or_insert(clock);
        *vt = vt.max(clock - burst / weight);
        *vt
    }

    /// Records an admission from the queue whose turn came at `vtime`: its virtual time
    /// advances by `step` (cost over weight), the class's clock to `vtime`. Returns the
    /// queue's new virtual time.
    fn served(&mut self, class: JobClass, tenant: &str, vtime: f64, step: f64) -> f64 {
        let vt = vtime + step;
        self.vtime.insert((class, tenant.to_owned()), vt);
        let clock = self.clock.entry(class).or_insert(0.0);
        *clock = clock.max(vtime);
        vt
    }
}

/// A candidate with everything admission needs, computed before taking any lock.
struct Plan {
    job: Candidate,
    class: JobClass,
    weight: f64,
    cost: f64,
    /// Targets in order of preference, each with its path: (bucket key, amount).
    routes: Vec<(Target, Vec<(String, f64)>)>,
}

/// The decisions of one round, before they are written.
struct Scheduled {
    admissions: Vec<Admission>,
    notes: Vec<(JobId, serde_json::Value)>,
    round: Round,
    failures: Vec<(JobId, &'static str, String)>,
    /// Buckets that stopped a job this round.
    saturated: HashSet<String>,
}

/// What the gate knows of provider limits beyond the config, from `learned_limits`.
#[derive(Default)]
struct Known {
    /// Provider model scope → the learned buckets that govern it.
    buckets: HashMap<String, Vec<(String, Dimension)>>,
    /// Scopes a response was seen from (their cold-start probe is over).
    seen: HashSet<String>,
}

impl Known {
    fn new(rows: &[Learned]) -> Self {
        let mut known = Known::default();
        for r in rows {
            known.seen.insert(r.scope.clone());
            if r.governs() {
                known
                    .buckets
                    .entry(r.scope.clone())
                    .or_default()
                    .push((r.bucket_key(), r.name.dimension()));
            }
        }
        known
    }
}

/// A mutex's value, also after a panic while it was held (what it guards stays usable).
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The keys of the buckets on any of `plan`'s routes.
fn path_keys(plan: &Plan) -> impl Iterator<Item = &String> {
    plan.routes.iter().flat_map(|r| r.1.iter().map(|k| &k.0))
}

/// Until when a provider's 429 paused `target`'s model, if it did.
fn paused_until(paused: &HashMap<String, DateTime<Utc>>, target: &Target) -> Option<DateTime<Utc>> {
    paused
        .get(&buckets::target_scope(&target.provider, &target.model))
        .copied()
}

/// Whether the provider rejected `target`'s key (it is paused under its own scope).
fn key_rejected(paused: &HashMap<String, DateTime<Utc>>, target: &Target) -> bool {
    target
        .key
        .as_ref()
        .is_some_and(|k| paused.contains_key(&buckets::key_scope(&target.provider, k)))
}

/// Admits `plan`'s job on its route `r`: takes its amounts from the route's buckets.
fn take(plan: &Plan, r: usize, buckets: &mut HashMap<String, Bucket>, now: DateTime<Utc>) -> Admission {
    let (target, path) = &plan.routes[r];
    let mut bucket_ids = Vec::with_capacity(path.len());
    let mut amounts = Vec::with_capacity(path.len());
    for (key, amount) in path {
        if let Some(b) = buckets.get_mut(key) {
            b.take(*amount);
            bucket_ids.push(b.id);
            amounts.push(*amount);
        }
    }
    crate::metrics::admitted(&plan.job, target, &plan.routes[0].0, now);
    Admission {
        id: plan.job.id,
        provider: target.provider.clone(),
        model: target.model.clone(),
        key: target.key.clone(),
        bucket_ids,
        amounts,
        startable: !plan.job.stream
            && plan.job.dispatch_via.as_deref() != Some(provider_batches::VIA_PROVIDER_BATCH),
    }
}

/// The cold-start probe bucket of a scope.
fn probe_key(scope: &str) -> String {
    format!("{scope}:probe")
}

/// A (class, tenant) queue's place in the round's priority queue.
struct Turn {
    class: JobClass,
    vtime: f64,
    queue: usize,
}

impl PartialEq for Turn {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Turn {}
impl PartialOrd for Turn {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Turn {
    /// Reversed: `BinaryHeap` pops the greatest, we want the best class, then the smallest
    /// virtual time, then the lowest queue index (stable).
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .class
            .cmp(&self.class)
            .then(other.vtime.total_cmp(&self.vtime))
            .then(other.queue.cmp(&self.queue))
    }
}

impl Gate {
    pub fn new(pool: PgPool, config: Arc<Config>, notifications: Notifications) -> Self {
        Self {
            pool,
            config,
            notifications,
            fairness: Mutex::new(Fairness::default()),
            last_admitted: std::sync::atomic::AtomicUsize::new(batch_hint()),
            key_turn: std::sync::atomic::AtomicUsize::new(0),
            calibration: Mutex::new((None, HashMap::new())),
            handoff: None,
        }
    }

    /// Starts admitted jobs on this process's dispatcher when it has room ([`Handoff`]).
    pub fn with_handoff(mut self, handoff: Handoff) -> Self {
        self.handoff = Some(handoff);
        self
    }

    /// Admits an interactive job as it arrives, without waiting for a round: in one
    /// transaction the buckets on its path are locked (in id order, as a round locks them)
    /// and, when they hold it, it is inserted admitted and running for this process's
    /// dispatcher, which is handed it. A round would decide the same: interactive work goes
    /// first, and with no interactive job queued this one is next in line. When another
    /// interactive job is queued, a limit was just learned and not yet applied, this
    /// dispatcher has no room, or the buckets cannot hold it now, nothing is written
    /// (`None`) and the caller queues it as usual. Returns the started job.
    /// `pool` is the caller's (the gate's own connections belong to its thread).
    pub async fn admit_arrival(&self, pool: &PgPool, job: &NewJob) -> Result<Option<Job>, StoreError> {
        let Some(handoff) = &self.handoff else {
            return Ok(None);
        };
        if job.class != JobClass::Interactive || job.stream {
            return Ok(None);
        }
        let permits = handoff.permits(1);
        if permits.is_empty() {
            return Ok(None);
        }
        let now = Utc::now();
        // The transaction begins while the reads run, on its own connection.
        let (mut tx, queued, learned, paused, calibration) = tokio::try_join!(
            async { Ok::<_, StoreError>(pool.begin().await?) },
            store::interactive_queued(pool),
            store::learned_limits(pool),
            store::active_pauses(pool, now),
            self.calibration(pool),
        )?;
        if queued || learned.iter().any(Learned::pending) {
            tx.rollback().await?;
            return Ok(None);
        }
        let paused: HashMap<String, DateTime<Utc>> = paused.into_iter().collect();
        let Ok(plan) = self.plan(Candidate::arriving(job), now, &calibration, &Known::new(&learned)) else {
            // A round fails it with its reason.
            tx.rollback().await?;
            return Ok(None);
        };
        let mut keys: Vec<String> = path_keys(&plan).cloned().collect();
        keys.sort();
        keys.dedup();

        let now = Utc::now();
        let mut buckets: HashMap<String, Bucket> = store::lock_buckets_by(&mut tx, &keys, &[])
            .await?
            .into_iter()
            .map(|mut b| {
                b.refill(now);
                (b.key.clone(), b)
            })
            .collect();
        // A bucket not created yet (a probe, a limit just learned) is the round's to create.
        let route = if keys.iter().all(|k| buckets.contains_key(k)) {
            self.first_fitting(&plan.routes, plan.class, &buckets, &paused, &HashSet::new())
        } else {
            None
        };
        let Some(route) = route else {
            tx.rollback().await?;
            return Ok(None);
        };
        let admission = take(&plan, route, &mut buckets, now);
        let starter = store::Starter {
            owner: &handoff.owner,
            lease_until: now + handoff.lease,
        };
        let taken: Vec<Bucket> = buckets
            .into_values()
            .filter(|b| admission.bucket_ids.contains(&b.id))
            .collect();
        let Some(started) = store::insert_started_job(&mut tx, job, &admission, starter, &taken, now).await?
        else {
            // Its idempotency key is taken: the usual insert answers with that job.
            tx.rollback().await?;
            return Ok(None);
        };
        tx.commit().await?;
        {
            let mut fairness = locked(&self.fairness);
            let burst = self.config.gate.burst_credit_tokens as f64;
            let vtime = fairness.turn_starts(plan.class, &job.tenant, plan.weight, burst);
            fairness.served(plan.class, &job.tenant, vtime, plan.cost / plan.weight);
        }
        handoff.hand(vec![started.clone()], permits);
        Ok(Some(started))
    }

    /// The demand to reserve on `target`: input scaled up by the model's learned ratio
    /// (never down: a provider that counts fewer tokens than estimated costs nothing
    /// extra), output from the model's learned p90 where the provider does not charge
    /// `max_tokens` up front.
    fn calibrated(
        &self,
        target: &Target,
        estimate: Demand,
        learned: &HashMap<String, store::Calibration>,
    ) -> Demand {
        let Some(c) = learned.get(&target.model) else {
            return estimate;
        };
        let charges_max = self
            .config
            .provider(&target.provider)
            .is_none_or(|p| p.charges_max_tokens);
        let output = match c.output_p90 {
            Some(p90) if !charges_max && c.samples >= MIN_OUTPUT_SAMPLES => {
                estimate.output_tokens.min((p90 * OUTPUT_MARGIN).ceil())
            }
            _ => estimate.output_tokens,
        };
        Demand {
            input_tokens: (estimate.input_tokens * c.input_ratio.max(1.0)).ceil(),
            output_tokens: output,
        }
    }

    /// The learned estimates (calibration), re-read when older than [`CALIBRATION_REFRESH`].
    async fn calibration(&self, pool: &PgPool) -> Result<HashMap<String, store::Calibration>, StoreError> {
        {
            let cached = locked(&self.calibration);
            if cached.0.is_some_and(|at| at.elapsed() < CALIBRATION_REFRESH) {
                return Ok(cached.1.clone());
            }
        }
        let fresh: HashMap<String, store::Calibration> = store::calibrations(pool)
            .await?
            .into_iter()
            .map(|c| (c.model.clone(), c))
            .collect();
        let mut cached = locked(&self.calibration);
        *cached = (Some(tokio::time::Instant::now()), fresh.clone());
        Ok(fresh)
    }

    fn plan(
        &self,
        job: Candidate,
        now: DateTime<Utc>,
        calibration: &HashMap<String, store::Calibration>,
        known: &Known,
    ) -> Result<Plan, (JobId, &'static str, String)> {
        let config = &self.config;
        let Some(targets) = routing::resolve(config, &job.model) else {
            let message = format!("model {:?} is no longer configured", job.model);
            return Err((job.id, "unknown_model", message));
        };
        // Fallback: targets that failed the job are left out while the route has others.
        let failed = job.failed_targets.as_deref().unwrap_or_default();
        let fresh: Vec<Target> = targets
            .iter()
            .filter(|t| !failed.contains(&t.label()))
            .cloned()
            .collect();
        let targets = if fresh.is_empty() { targets } else { fresh };
        let weight = config
            .tenants
            .iter()
            .find(|t| t.name == job.tenant)
            .map_or(1.0, |t| f64::from(t.weight.max(1)));
        let estimate = Demand {
            input_tokens: f64::from(job.estimated_input_tokens.max(0)),
            output_tokens: f64::from(job.estimated_output_tokens.max(0)),
        };
        // Provider batch API: only targets whose batch API carries it, against its tenant's
        // buckets and the provider's enqueued-token pool instead of the online limits.
        let batch_api = job.dispatch_via.as_deref() == Some(provider_batches::VIA_PROVIDER_BATCH);
        let routes = targets
            .into_iter()
            .filter(|t| !batch_api || provider_batches::batch_api(config, t).is_some())
            .flat_map(|target| self.per_key(target))
            .map(|target| {
                let demand = self.calibrated(&target, estimate, calibration);
                let price = config
                    .provider(&target.provider)
                    .and_then(|p| p.price_for(&target.model));
                let spend = buckets::spend_micro_usd(price, demand.input_tokens, 0.0, demand.output_tokens);
                let path = if batch_api {
                    provider_batches::path(config, &job.tenant, &job.model, &target)
                } else {
                    self.full_path(&job.tenant, &job.model, &target, known)
                };
                let path = path
                    .into_iter()
                    .map(|(key, dim)| (key, buckets::amount(dim, demand, spend)))
                    .collect();
                (target, path)
            })
            .collect();
        let starve_after = config.classes.get(job.class).starve_after_secs;
        let waited = (now - job.created_at).num_seconds().max(0) as u64;
        let class = if waited > starve_after {
            JobClass::Interactive
        } else {
            job.class
        };
        Ok(Plan {
            cost: estimate.total_tokens().max(1.0),
            class,
            weight,
            routes,
            job,
        })
    }

    /// The buckets a job sent to `target` must fit: its configured path, the target's
    /// learned buckets, and — while nothing is known of the target's limits — its
    /// cold-start probe.
    fn full_path(
        &self,
        tenant: &str,
        requested: &str,
        target: &Target,
        known: &Known,
    ) -> Vec<(String, Dimension)> {
        let mut path = buckets::path(&self.config, tenant, requested, target);
        let scope = buckets::target_scope(&target.provider, &target.model);
        for (key, dim) in known.buckets.get(&scope).into_iter().flatten() {
            if !path.iter().any(|(k, _)| k == key) {
                path.push((key.clone(), *dim));
            }
        }
        let unknown = self
            .config
            .provider(&target.provider)
            .is_some_and(|p| p.learn_limits && !p.configures_rates(&target.model));
        if unknown && !known.seen.contains(&scope) {
            path.push((probe_key(&scope), Dimension::Concurrency));
        }
        path
    }

    /// A target as the options admission may choose from: one per key that serves the
    /// model, starting from a key chosen by weighted rotation so load spreads as the keys'
    /// weights say (the gate picks the key, so a rejected key can be left out).
    fn per_key(&self, target: Target) -> Vec<Target> {
        let Some(p) = self.config.provider(&target.provider) else {
            return vec![target];
        };
        let keys: Vec<(&str, u32)> = p
            .keys
            .iter()
            .filter(|k| k.serves(&target.model))
            .map(|k| (k.name.as_str(), k.weight.max(1)))
            .collect();
        let total: u32 = keys.iter().map(|k| k.1).sum();
        if total == 0 {
            return vec![target];
        }
        let turn = (self.key_turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % total as usize) as u32;
        let mut start = 0;
        let mut acc = 0;
        for (i, (_, w)) in keys.iter().enumerate() {
            acc += w;
            if turn < acc {
                start = i;
                break;
            }
        }
        (0..keys.len())
            .map(|i| Target {
                key: Some(keys[(start + i) % keys.len()].0.to_owned()),
                ..target.clone()
            })
            .collect()
    }

    /// Brings learned limits into the locked `buckets`: creates the buckets that only
    /// learning or the cold-start probe knows (`needed` keys not found), applies what is
    /// new in each row. Returns the rows it changed.
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
        for key in needed
            .iter()
            .filter(|k| !buckets.contains_key(*k) && k.ends_with(":probe"))
        {
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
        for (i, row) in rows.iter_mut().enumerate() {
            if !row.governs() || !row.pending() || buckets.contains_key(&row.bucket_key()) {
                continue;
            }
            let (capacity, level) = match (row.reported, row.source) {
                (Some(reported), _) => (reported, reported),
                (None, Source::Throttling) => {
                    let (provider, model) = buckets::scope_target(&row.scope);
                    let window = chrono::Duration::seconds(row.name.window_secs());
                    let sent = store::requests_since(&mut *tx, provider, model, now - window).await?;
                    let (capacity, ceiling) = learning::first_capacity(sent);
                    // What was admitted while the limit was unknown meets it too.
                    let requeued = store::requeue_admitted(&mut *tx, provider, model).await?;
                    tracing::info!(scope = %row.scope, capacity, requeued, "a 429 taught a request limit");
                    row.ceiling = Some(ceiling);
                    row.decreases = 1;
                    row.changed_at = Some(now);
                    row.applied_at = Some(row.latest());
                    changed.insert(i);
                    (capacity, 0.0)
                }
                (None, Source::Headers) => continue,
            };
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
            buckets.insert(b.key.clone(), b);
        }
        for (i, row) in rows.iter_mut().enumerate() {
            if !row.pending() {
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
        let batch = self.config.gate.batch;
        let queues = store::active_queues(&self.pool).await?;
        let mut candidates = if queues.is_empty() {
            Vec::new()
        } else {
            let last = self.last_admitted.load(std::sync::atomic::Ordering::Relaxed);
            let wanted = (2 * last.max(MIN_READ)).min(2 * batch);
            let per_queue = (wanted / queues.len()).clamp(4, batch) as i64;
            store::candidates(&self.pool, &queues, per_queue, now).await?
        };
        provider_batches::decide_candidates(&self.pool, &self.config, &mut candidates, now).await?;
        let calibration = self.calibration(&self.pool).await?;
        let mut learned = store::learned_limits(&self.pool).await?;
        let known = Known::new(&learned);
        let mut failures: Vec<(JobId, &'static str, String)> = Vec::new();
        let mut plans = Vec::new();
        for c in candidates {
            match self.plan(c, now, &calibration, &known) {
                Ok(p) => plans.push(p),
                Err(failure) => failures.push(failure),
            }
        }
        // Every bucket a candidate needs, and those with learned news to apply.
        let needed: HashSet<String> = plans
            .iter()
            .flat_map(|p| path_keys(p).cloned())
            .chain(
                learned
                    .iter()
                    .filter(|r| r.pending() || r.source == Source::Throttling)
                    .map(Learned::bucket_key),
            )
            .collect();
        let keys: Vec<String> = needed.iter().cloned().collect();
        let news = learned.iter().any(Learned::pending);
        let (mut permits, limit) = self.room(plans.len()).await?;

        let mut tx = self.pool.begin().await?;
        // Settlements of finished jobs first: what they did not use is available again.
        let refunds = store::take_pending_refunds(&mut tx, REFUNDS_PER_ROUND).await?;
        // Read after the refunds: a 429's pause commits with its refund, so a slot given
        // back here is never used before its pause is seen.
        let paused: HashMap<String, DateTime<Utc>> =
            store::active_pauses(&mut *tx, now).await?.into_iter().collect();
        if plans.is_empty() && refunds.is_empty() && !news {
            tx.commit().await?;
            let failed = store::fail_queued(&self.pool, &failures, now).await? as usize;
            return Ok(Round {
                failed,
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

        let Scheduled {
            admissions,
            notes,
            mut round,
            failures: more_failures,
            saturated,
        } = self.schedule(plans, &mut buckets, &paused, limit, now);
        failures.extend(more_failures);
        // Probing upward where 429s taught the limit and the limit is what holds jobs back.
        for (i, row) in learned.iter_mut().enumerate() {
            let key = row.bucket_key();
            if let Some(b) = buckets.get_mut(&key)
                && learning::increase(row, b, saturated.contains(&key), now)
            {
                learned_changed.insert(i);
            }
        }

        // What this process's dispatcher has room for starts now, in the admission's write.
        let mut admissions = admissions;
        admissions.sort_by_key(|a| !a.startable); // stable: startable first, in round order
        permits.truncate(admissions.iter().filter(|a| a.startable).count());
        let starter = self.handoff.as_ref().map(|h| {
            let starter = store::Starter {
                owner: &h.owner,
                lease_until: now + h.lease,
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
        store::save_learned(&self.pool, &rows).await?;
        round.admitted = admitted.len();
        self.last_admitted.store(
            if round.full {
                self.config.gate.batch
            } else {
                round.admitted
            },
            std::sync::atomic::Ordering::Relaxed,
        );
        round.failed = store::fail_queued(&self.pool, &failures, now).await? as usize;
        store::explain(&self.pool, &notes).await?;
        {
            let mut fairness = locked(&self.fairness);
            for id in &admitted {
                fairness.explained.remove(id);
            }
            if fairness.explained.len() > 100_000 {
                fairness.explained.clear();
            }
        }
        Ok(round)
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

    /// What a provider bucket keeps back from a job of `class`: refill in hand for
    /// requests still on their way, and a share only interactive work may use, so a flood
    /// of lower classes cannot make it wait. Other buckets keep nothing back.
    fn headroom(&self, b: &Bucket, class: JobClass) -> f64 {
        if !buckets::is_provider_side(&b.key) {
            return 0.0;
        }
        let transit = if b.rule == Rule::Rolling {
            b.headroom(self.config.gate.headroom_secs)
        } else {
            0.0
        };
        let kept = if class == JobClass::Interactive || b.rule == Rule::Gauge {
            0.0
        } else {
            self.config.gate.interactive_reserve * b.capacity
        };
        transit + kept
    }

    /// The first of `routes` a job of `class` can take now: its target not paused, its key
    /// not rejected, every bucket on its path open this round and able to hold its amount
    /// (a key with no bucket limits nothing).
    fn first_fitting(
        &self,
        routes: &[(Target, Vec<(String, f64)>)],
        class: JobClass,
        buckets: &HashMap<String, Bucket>,
        paused: &HashMap<String, DateTime<Utc>>,
        closed: &HashSet<String>,
    ) -> Option<usize> {
        routes.iter().position(|(target, path)| {
            paused_until(paused, target).is_none()
                && !key_rejected(paused, target)
                && path.iter().all(|(key, amount)| {
                    !closed.contains(key)
                        && buckets
                            .get(key)
                            .is_none_or(|b| b.fits(*amount, self.headroom(b, class)))
                })
        })
    }

    /// Decides the round: who is admitted where, who waits and why, who fails. Takes what
    /// it admits from `buckets` (locked by the caller).
    /// Admits at most `limit` jobs; the round is `full` when that is the configured batch.
    fn schedule(
        &self,
        plans: Vec<Plan>,
        buckets: &mut HashMap<String, Bucket>,
        paused: &HashMap<String, DateTime<Utc>>,
        limit: usize,
        now: DateTime<Utc>,
    ) -> Scheduled {
        let mut failures: Vec<(JobId, &'static str, String)> = Vec::new();
        // Queues of this round, in tenant order of service.
        let mut queue_of: HashMap<(JobClass, String), usize> = HashMap::new();
        let mut queues: Vec<std::collections::VecDeque<Plan>> = Vec::new();
        for p in plans {
            let key = (p.class, p.job.tenant.clone());
            let i = *queue_of.entry(key).or_insert_with(|| {
                queues.push(Default::default());
                queues.len() - 1
            });
            queues[i].push_back(p);
        }
        let mut round = Round::default();
        let mut admissions: Vec<Admission> = Vec::new();
        let mut notes: Vec<(JobId, serde_json::Value)> = Vec::new();
        let mut fairness = locked(&self.fairness);
        let burst = self.config.gate.burst_credit_tokens as f64;
        let mut heap = BinaryHeap::new();
        for (key, &i) in &queue_of {
            let weight = queues[i].front().map_or(1.0, |p| p.weight);
            heap.push(Turn {
                class: key.0,
                vtime: fairness.turn_starts(key.0, &key.1, weight, burst),
                queue: i,
            });
        }
        let mut closed: HashSet<String> = HashSet::new();
        while let Some(turn) = heap.pop() {
            if admissions.len() >= limit {
                // Stopped by the batch: more may be admissible at once. Stopped by the
                // dispatchers' room: the next completion wakes the gate.
                round.full = limit >= self.config.gate.batch;
                break;
            }
            let Some(plan) = queues[turn.queue].front() else {
                continue;
            };
            let class = plan.class;
            let headroom = |b: &Bucket| self.headroom(b, class);
            if let Some(r) = self.first_fitting(&plan.routes, class, buckets, paused, &closed) {
                admissions.push(take(plan, r, buckets, now));
                let vt = fairness.served(turn.class, &plan.job.tenant, turn.vtime, plan.cost / plan.weight);
                queues[turn.queue].pop_front();
                if !queues[turn.queue].is_empty() {
                    heap.push(Turn { vtime: vt, ..turn });
                }
                continue;
            }
            // It does not fit. Ever? Before its deadline? Otherwise it waits, and what
            // stopped it is closed to everyone else this round.
            let never = plan.routes.iter().all(|(_, path)| {
                path.iter()
                    .any(|(key, amount)| buckets.get(key).is_some_and(|b| !b.can_ever_fit(*amount)))
            });
            if !plan.routes.is_empty() && plan.routes.iter().all(|(t, _)| key_rejected(paused, t)) {
                failures.push((
                    plan.job.id,
                    "upstream_credentials_exhausted",
                    "every provider key that could serve the job was rejected by its provider".to_owned(),
                ));
                queues[turn.queue].pop_front();
                if !queues[turn.queue].is_empty() {
                    heap.push(turn);
                }
                continue;
            }
            if never || plan.routes.is_empty() {
                let (key, amount) = plan
                    .routes
                    .first()
                    .and_then(|(_, path)| {
                        path.iter()
                            .find(|(k, a)| buckets.get(k).is_some_and(|b| !b.can_ever_fit(*a)))
                    })
                    .cloned()
                    .unwrap_or_default();
                let capacity = buckets.get(&key).map_or(0.0, |b| b.capacity);
                crate::metrics::failed(&plan.job, &key, "exceeds_limit");
                failures.push((
                    plan.job.id,
                    "exceeds_limit",
                    format!("the job needs {amount:.0} of {key} but its whole capacity is {capacity:.0}"),
                ));
                queues[turn.queue].pop_front();
                if !queues[turn.queue].is_empty() {
                    heap.push(turn);
                }
                continue;
            }
            let (first, path) = &plan.routes[0];
            let mut blocking: Option<(&Bucket, f64)> = None;
            // A provider's 429 paused this target: nothing goes before its Retry-After.
            let pause = paused_until(paused, first);
            let mut ready: Option<DateTime<Utc>> = Some(pause.unwrap_or(now));
            for (key, amount) in path {
                let Some(b) = buckets.get(key) else { continue };
                let open = !closed.contains(key);
                if open && b.fits(*amount, headroom(b)) {
                    continue;
                }
                let at = if open {
                    b.ready_at(*amount, headroom(b), now)
                } else {
                    Some(now)
                };
                ready = match (ready, at) {
                    (Some(r), Some(a)) => Some(r.max(a)),
                    _ => None,
                };
                if open && blocking.is_none() {
                    blocking = Some((b, *amount));
                }
            }
            round.blocked += 1;
            let job = &plan.job;
            if let Some(at) = ready.filter(|at| *at > job.deadline) {
                crate::metrics::failed(job, blocking.map_or("", |(b, _)| &b.key), "deadline_unmeetable");
                failures.push((
                    job.id,
                    "deadline_unmeetable",
                    format!(
                        "capacity for the job ({}) is not expected before {at}, after its deadline {}",
                        blocking.map_or("its turn".to_owned(), |(b, _)| b.key.clone()),
                        job.deadline
                    ),
                ));
                queues[turn.queue].pop_front();
                if !queues[turn.queue].is_empty() {
                    heap.push(turn);
                }
                continue;
            }
            if let Some(at) = ready.filter(|at| *at > now) {
                round.next_ready = Some(round.next_ready.map_or(at, |n| n.min(at)));
            }
            let note = match blocking {
                Some((b, amount)) => json!({
                    "reason": "waiting_for_capacity",
                    "bucket": b.key,
                    "limit": b.capacity,
                    "remaining": b.level.max(0.0).floor(),
                    "needs": amount,
                    "expected_at": ready,
                }),
                None => match pause {
                    Some(until) => json!({
                        "reason": "provider_rate_limited",
                        "scope": buckets::target_scope(&first.provider, &first.model),
                        "expected_at": until,
                    }),
                    // Behind another job that holds the bucket it needs: no time to promise.
                    None => json!({"reason": "waiting_for_turn"}),
                },
            };
            // Rewrite a note only when what it says changes (the expected time to the
            // second), not on every round.
            let stamp = format!(
                "{}|{}|{}",
                note["reason"],
                note["bucket"],
                ready
                    .filter(|_| blocking.is_some() || pause.is_some())
                    .map_or(0, |t| t.timestamp())
            );
            if fairness.explained.get(&job.id) != Some(&stamp) {
                crate::metrics::waiting(job, &note);
                fairness.explained.insert(job.id, stamp);
                notes.push((job.id, note));
            }
            for (key, amount) in path {
                if buckets.get(key).is_some_and(|b| !b.fits(*amount, headroom(b))) {
                    closed.insert(key.clone());
                }
            }
            // The tenant's next job may need none of the closed buckets (another route or
            // provider): it gets its turn; one that needs them meets them closed.
            queues[turn.queue].pop_front();
            if !queues[turn.queue].is_empty() {
                heap.push(turn);
            }
        }
        Scheduled {
            admissions,
            notes,
            round,
            failures,
            saturated: closed,
        }
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

    /// The loop: become the active gate, then run rounds whenever work or capacity may
    /// have appeared (NOTIFY), when a blocked job should fit, or at the fallback poll.
    pub async fn run(&self, cancel: CancellationToken) {
        let poll = Duration::from_millis(self.config.gate.poll_interval_ms);
        'lead: while let Some(mut leader) = self.lead(&cancel).await {
            let mut checked = tokio::time::Instant::now();
            loop {
                if cancel.is_cancelled() {
                    break 'lead;
                }
                let wake = self.notifications.gate_ready();
                tokio::pin!(wake);
                wake.as_mut().enable();
                let round = match self.run_once(Utc::now()).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "gate round failed");
                        Round::default()
                    }
                };
                if round.full {
                    continue;
                }
                let until_ready = round
                    .next_ready
                    .and_then(|at| (at - Utc::now()).to_std().ok())
                    .unwrap_or(poll)
                    .clamp(MIN_PAUSE, poll);
                tokio::select! {
                    _ = cancel.cancelled() => break 'lead,
                    // Arrivals of the next moments gather into one round, but an
                    // interactive job does not wait for them.
                    _ = &mut wake => if !self.notifications.take_interactive() {
                        tokio::time::sleep(MIN_PAUSE).await
                    },
                    _ = tokio::time::sleep(until_ready) => {}
                }
                // Still the leader? A broken lock connection means another gate may run.
                if checked.elapsed() >= LEADER_CHECK {
                    checked = tokio::time::Instant::now();
                    if sqlx::query("SELECT 1").execute(&mut leader).await.is_err() {
                        tracing::warn!("lost the gate's lock connection; electing again");
                        continue 'lead;
                    }
                }
            }
        }
    }
}
