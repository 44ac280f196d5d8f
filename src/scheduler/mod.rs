//! The scheduler: admission policy as a pure function. Given a round's [`Plan`]s, the
//! buckets on their paths (refilled, locked by the caller), the active pauses, how many
//! jobs the round may admit and `now`, [`Scheduler::schedule`] decides who is admitted on
//! which target, who waits and why, and who fails — and takes what it admits from the
//! buckets. It reads no database, records no metrics and does no I/O: it returns what
//! happened ([`Decision`]) and the gate role (`tollgate_workers::gate`) writes it and
//! records it. Between rounds it carries only the fairness state (virtual times, and the
//! last explanation given to each job).
//!
//! Order: classes by precedence (interactive, standard, background, batch; a job waiting
//! longer than its class's `starve_after_secs` competes as interactive, see
//! [`plan::competing_class`]), then weighted fair queuing across tenants within a class:
//! each (class, tenant) queue has a virtual time that advances by a job's token cost
//! divided by the tenant's weight, and the queue with the smallest virtual time goes next
//! — deficit round robin in its continuous form, with the deficit counted in tokens. A
//! tenant that becomes active starts at most `burst_credit_tokens / weight` behind the
//! others (its burst credit). Inside a tenant's queue: priority, then the earliest
//! deadline — so a tenant's work past its guard, from whichever class, goes by deadline
//! among its interactive work.
//!
//! Fit: a job goes on the first of its route targets whose model is not paused by a
//! provider's 429, whose key was not rejected, and whose every bucket is open this round
//! and can hold the job's amount beyond what it keeps back ([`Policy::headroom`]:
//! refill for requests in transit, and the interactive reserve on provider buckets).
//!
//! When the job whose turn it is does not fit, the buckets that stopped it are closed for
//! the rest of the round, so smaller jobs behind it cannot starve it; the tenant's next
//! jobs are still considered (they may need other buckets — another route or provider),
//! and the job is told why (its note: the bucket, its limit, what remains, when it should
//! fit). A job that can never fit, or not before its deadline, fails now
//! (`exceeds_limit`, `deadline_unmeetable`) instead of being dispatched late — unless
//! what refuses it is a learned capacity gone stale or only guessed from 429s, which it
//! then probes ([`learning::demand`]); one whose
//! every key was rejected fails `upstream_credentials_exhausted`.
//!
//! An admission leaves the job `admitted`, or — when [`Admission::startable`] and its
//! process's dispatcher has room — `running`. Every way a job reaches `running` (the
//! gate role's module documents why each exists): a dispatcher's claim of admitted jobs;
//! the gate's admission write, started for its own dispatcher; admission on arrival in
//! the API process (interactive jobs); the stream claim, by the process holding the
//! client's connection; a provider-batch pack opened by the provider-batch worker.

pub mod plan;
#[cfg(test)]
mod tests;

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};

use chrono::{DateTime, Utc};
use serde_json::json;

pub use plan::{Known, Plan, Planner, Route};

use crate::buckets::{self, Bucket};
use crate::config::GateConfig;
use crate::holds;
use crate::learning;
use crate::model::{JobClass, JobId};
use crate::provider_batches;
use crate::routing::Target;
use crate::store::{Admission, Candidate};
use crate::vocab::Rule;
use crate::vocab::{Dimension, ReasonCode};

/// Active pauses: scope (a provider model's, or a key's) → until when.
pub type Pauses = HashMap<String, DateTime<Utc>>;

/// Why the scheduler failed a job instead of letting it wait. The codes are the reason
/// codes of the README's contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Its model is no longer configured.
    UnknownModel,
    /// It is larger than a bucket's whole capacity on every route.
    ExceedsLimit,
    /// The capacity it waits for is not expected before its deadline.
    DeadlineUnmeetable,
    /// Every provider key that could serve it was rejected by its provider.
    UpstreamCredentialsExhausted,
    /// Its batch's spend reached the batch's `max_cost_usd`: it no longer fits.
    BatchCostCapReached,
}

impl Verdict {
    pub fn code(self) -> ReasonCode {
        match self {
            Verdict::UnknownModel => ReasonCode::UnknownModel,
            Verdict::ExceedsLimit => ReasonCode::ExceedsLimit,
            Verdict::DeadlineUnmeetable => ReasonCode::DeadlineUnmeetable,
            Verdict::UpstreamCredentialsExhausted => ReasonCode::UpstreamCredentialsExhausted,
            Verdict::BatchCostCapReached => ReasonCode::BatchCostCapReached,
        }
    }

    /// Whether a bucket made this decision (the admission metrics count those).
    pub fn by_bucket(self) -> bool {
        matches!(
            self,
            Verdict::ExceedsLimit | Verdict::DeadlineUnmeetable | Verdict::BatchCostCapReached
        )
    }
}

/// A job admitted this round.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub admission: Admission,
    pub plan: Plan,
    /// Index of the route it was admitted on, in `plan.routes`.
    pub route: usize,
}

impl Admitted {
    /// The target it goes to.
    pub fn target(&self) -> &Target {
        &self.plan.routes[self.route].target
    }

    /// Its route's first choice (a fallback when it differs from [`Admitted::target`]).
    pub fn preferred(&self) -> &Target {
        &self.plan.routes[0].target
    }
}

/// A job that waits, with a note that differs from the last one it was given.
#[derive(Debug, Clone)]
pub struct Waiting {
    pub job: Candidate,
    /// `reason` (`waiting_for_capacity`, `provider_rate_limited`, `waiting_for_turn`) and
    /// what it waits for.
    pub note: serde_json::Value,
}

/// A job that fails now.
#[derive(Debug, Clone)]
pub struct Failed {
    pub job: Candidate,
    pub verdict: Verdict,
    /// The bucket that decided it (empty when none did).
    pub bucket: String,
    pub message: String,
    /// The gate's note on it, kept on the job: for a deadline out of reach, the limit
    /// that held it and when it was expected to fit (a refused caller's Retry-After).
    pub note: Option<serde_json::Value>,
}

/// What one round decided.
#[derive(Debug, Default)]
pub struct Decision {
    /// In the order they were admitted.
    pub admitted: Vec<Admitted>,
    /// Notes to write (only those that changed since the job's last one).
    pub waiting: Vec<Waiting>,
    pub failed: Vec<Failed>,
    /// Jobs whose turn came and that had to wait for capacity (or missed their deadline).
    pub blocked: usize,
    /// When the earliest waiting job should fit (if time alone will make it fit).
    pub next_ready: Option<DateTime<Utc>>,
    /// Stopped at the configured batch, or at a tenant whose next jobs were not read
    /// ([`Plan::unread_behind`]): more may be admissible right away.
    pub full: bool,
    /// Buckets that stopped a job this round.
    pub closed: HashSet<String>,
}

/// The weighted fair queuing's virtual times: each (class, tenant) queue's, and each
/// class's clock (the virtual time of its latest admission). The gate keeps them by tenant
/// name from round to round; a forecast runs its own from the gate's lags
/// ([`VirtualTimes::behind`]), so both serve queues by the same rule.
#[derive(Debug)]
pub struct VirtualTimes<T> {
    vtime: HashMap<(JobClass, T), f64>,
    clock: HashMap<JobClass, f64>,
}

impl<T> Default for VirtualTimes<T> {
    fn default() -> Self {
        Self {
            vtime: HashMap::new(),
            clock: HashMap::new(),
        }
    }
}

impl<T: Eq + std::hash::Hash> VirtualTimes<T> {
    /// Queues — (class, tenant) — standing `lag` behind their class's clock (negative:
    /// ahead), every clock at 0: where the leading gate's lags ([`Scheduler::lags`]) say
    /// they stand.
    pub fn behind(lags: impl IntoIterator<Item = (JobClass, T, f64)>) -> Self {
        Self {
            vtime: lags
                .into_iter()
                .map(|(class, tenant, lag)| ((class, tenant), -lag))
                .collect(),
            clock: HashMap::new(),
        }
    }

    /// A (class, tenant) queue's virtual time as its turn comes: a quiet tenant starts at
    /// most its burst credit behind the class's clock.
    pub fn turn_starts(&mut self, class: JobClass, tenant: T, weight: f64, burst: f64) -> f64 {
        let clock = self.clock.get(&class).copied().unwrap_or(0.0);
        let vt = self.vtime.entry((class, tenant)).or_insert(clock);
        *vt = vt.max(clock - burst / weight);
        *vt
    }

    /// Records an admission from the queue whose turn came at `vtime`: its virtual time
    /// advances by `step` (cost over weight), the class's clock to `vtime`. Returns the
    /// queue's new virtual time.
    pub fn served(&mut self, class: JobClass, tenant: T, vtime: f64, step: f64) -> f64 {
        let vt = vtime + step;
        self.vtime.insert((class, tenant), vt);
        let clock = self.clock.entry(class).or_insert(0.0);
        *clock = clock.max(vtime);
        vt
    }
}

/// The fairness state the gate carries between rounds: virtual times by tenant, and the
/// explanations given.
#[derive(Debug, Default)]
struct Fairness {
    times: VirtualTimes<String>,
    /// Last explanation given per job, so unchanged ones are not given again.
    explained: HashMap<JobId, String>,
}

/// Most explanations remembered; beyond, all are forgotten (and given again once).
const EXPLAINED_KEPT: usize = 100_000;

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

/// Why the job whose turn came does not fit.
enum Unfit {
    Fails(Failed),
    /// It waits: its note, the note's stamp (what it says, to the second) and when it
    /// should fit (`None`: unknown, e.g. a gauge waiting for a release).
    Waits {
        plan: Plan,
        note: serde_json::Value,
        stamp: String,
        ready: Option<DateTime<Utc>>,
    },
}

/// The pause on `route`'s provider model, if any, and until when: a 429's or an
/// operator's on the whole model, or a 429's on its key's pool (the model's other pools
/// go on).
fn paused_until<'a>(paused: &Pauses, route: &'a Route) -> Option<(std::borrow::Cow<'a, str>, DateTime<Utc>)> {
    let model = buckets::target_scope(&route.target.provider, &route.target.model);
    if let Some(until) = paused.get(&model) {
        return Some((model.into(), *until));
    }
    paused
        .get(&route.scope)
        .map(|until| (route.scope.as_str().into(), *until))
}

/// Whether the provider rejected `target`'s key (it is paused under its own scope).
fn key_rejected(paused: &Pauses, target: &Target) -> bool {
    target
        .key
        .as_ref()
        .is_some_and(|k| paused.contains_key(&buckets::key_scope(&target.provider, k)))
}

/// Admits `plan`'s job on its route `r`: takes its amounts from the route's buckets (a
/// key with no bucket takes nothing).
pub fn take(plan: &Plan, r: usize, buckets: &mut HashMap<String, Bucket>) -> Admission {
    let Route {
        target, path, cost, ..
    } = &plan.routes[r];
    let mut bucket_ids = Vec::with_capacity(path.len());
    let mut amounts = Vec::with_capacity(path.len());
    for (key, amount) in path {
        if let Some(b) = buckets.get_mut(key) {
            b.take(*amount);
            bucket_ids.push(b.id);
            amounts.push(*amount);
        }
    }
    Admission {
        id: plan.job.id,
        provider: target.provider.clone(),
        model: target.model.clone(),
        key: target.key.clone(),
        bucket_ids,
        amounts,
        cost: *cost,
        startable: !plan.job.stream
            && plan.job.dispatch_via.as_deref() != Some(provider_batches::VIA_PROVIDER_BATCH),
    }
}

/// The fit rules: what buckets keep back, and which route a job can take now. The
/// configuration's `[gate]` section (`headroom_secs`, `interactive_reserve`; `batch` and
/// `burst_credit_tokens` for the rounds).
#[derive(Debug, Clone)]
pub struct Policy {
    gate: GateConfig,
}

impl Policy {
    pub fn new(gate: GateConfig) -> Self {
        Self { gate }
    }

    /// What a provider bucket keeps back from a job of `class`: refill in hand for
    /// requests still on their way, and a share only interactive work may use, so a flood
    /// of lower classes cannot make it wait. Other buckets keep nothing back, nor does a
    /// pace (tollgate's own, not a provider's limit).
    pub fn headroom(&self, b: &Bucket, class: JobClass) -> f64 {
        if !buckets::is_provider_side(&b.key) || learning::is_pace(&b.key) {
            return 0.0;
        }
        let transit = if b.rule == Rule::Rolling {
            b.headroom(self.gate.headroom_secs)
        } else {
            0.0
        };
        let kept = if class == JobClass::Interactive || b.rule == Rule::Gauge {
            0.0
        } else {
            self.gate.interactive_reserve * b.capacity
        };
        transit + kept
    }

    /// The first of `routes` a job of `class` can take now: its target not paused, its key
    /// not rejected, every bucket on its path open this round and able to hold its amount
    /// (a key with no bucket limits nothing).
    pub fn first_fitting(
        &self,
        routes: &[Route],
        class: JobClass,
        buckets: &HashMap<String, Bucket>,
        paused: &Pauses,
        closed: &HashSet<String>,
    ) -> Option<usize> {
        routes.iter().position(|route| {
            let Route { target, path, .. } = route;
            paused_until(paused, route).is_none()
                && !key_rejected(paused, target)
                && path.iter().all(|(key, amount)| {
                    !closed.contains(key)
                        && buckets
                            .get(key)
                            .is_none_or(|b| b.fits(*amount, self.headroom(b, class)))
                })
        })
    }
}

/// The note on a job that bucket `b` holds back (`reason`): its limit, what remains, what
/// the job needs and when it was expected to fit.
fn capacity_note(
    reason: &str,
    b: &Bucket,
    amount: f64,
    expected_at: Option<DateTime<Utc>>,
) -> serde_json::Value {
    json!({
        "reason": reason,
        "bucket": b.key,
        "limit": b.capacity,
        "remaining": b.level.max(0.0).floor(),
        "needs": amount,
        "expected_at": expected_at,
    })
}

/// The order of a tenant's queue: higher priority first, then the earliest deadline (the
/// store's order, `store::candidates`).
fn in_queue_order(a: &Candidate, b: &Candidate) -> Ordering {
    b.priority
        .cmp(&a.priority)
        .then(a.deadline.cmp(&b.deadline))
        .then(a.id.cmp(&b.id))
}

/// Admission policy with the fairness state it carries from round to round.
#[derive(Debug)]
pub struct Scheduler {
    policy: Policy,
    fairness: Fairness,
}

impl Scheduler {
    /// A scheduler with no history: every tenant starts at the same virtual time.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            fairness: Fairness::default(),
        }
    }

    /// Decides the round: who is admitted where, who waits and why, who fails. Takes what
    /// it admits from `buckets`; `guessed` are those whose capacity only 429s taught
    /// ([`learning::guessed`]). Admits at most `limit` jobs; the round is `full` when that
    /// is the configured batch.
    pub fn schedule(
        &mut self,
        plans: Vec<Plan>,
        buckets: &mut HashMap<String, Bucket>,
        guessed: &HashSet<String>,
        paused: &Pauses,
        limit: usize,
        now: DateTime<Utc>,
    ) -> Decision {
        // Queues of this round, in tenant order of service.
        let mut queue_of: HashMap<(JobClass, String), usize> = HashMap::new();
        let mut queues: Vec<VecDeque<Plan>> = Vec::new();
        for mut p in plans {
            // A job larger than a learned capacity nothing renewed lately, or than one only
            // guessed from 429s, asks for the whole bucket: it goes alone when it is full.
            for route in &mut p.routes {
                for (key, amount) in &mut route.path {
                    if let Some(b) = buckets.get(key.as_str()) {
                        *amount = learning::demand(b, *amount, guessed.contains(key), now);
                    }
                }
            }
            let key = (p.class, p.job.tenant.clone());
            let i = *queue_of.entry(key).or_insert_with(|| {
                queues.push(VecDeque::new());
                queues.len() - 1
            });
            queues[i].push_back(p);
        }
        // The store reads each (class, tenant) queue in order; a tenant's work past its
        // guard, read from several classes, merges here into its interactive queue.
        for queue in &mut queues {
            queue
                .make_contiguous()
                .sort_by(|a, b| in_queue_order(&a.job, &b.job));
        }
        let unread_behind: Vec<bool> = queues.iter().map(|q| q.iter().any(|p| p.unread_behind)).collect();
        let mut decision = Decision::default();
        let burst = self.policy.gate.burst_credit_tokens as f64;
        let mut heap = BinaryHeap::new();
        for (key, &i) in &queue_of {
            let weight = queues[i].front().map_or(1.0, |p| p.weight);
            heap.push(Turn {
                class: key.0,
                vtime: self
                    .fairness
                    .times
                    .turn_starts(key.0, key.1.clone(), weight, burst),
                queue: i,
            });
        }
        while let Some(turn) = heap.pop() {
            if decision.admitted.len() >= limit {
                // Stopped by the batch: more may be admissible at once. Stopped by the
                // dispatchers' room: the next completion wakes the gate.
                decision.full = limit >= self.policy.gate.batch;
                break;
            }
            let Some(plan) = queues[turn.queue].pop_front() else {
                continue;
            };
            let mut vtime = turn.vtime;
            let held = holds::holding(paused, &plan.job.tenant, &plan.job.model).is_some();
            let fitting = (!held)
                .then(|| {
                    self.policy
                        .first_fitting(&plan.routes, plan.class, buckets, paused, &decision.closed)
                })
                .flatten();
            let admitted = fitting.is_some();
            if let Some(r) = fitting {
                let admission = take(&plan, r, buckets);
                vtime = self.fairness.times.served(
                    turn.class,
                    plan.job.tenant.clone(),
                    turn.vtime,
                    plan.cost / plan.weight,
                );
                decision.admitted.push(Admitted {
                    admission,
                    plan,
                    route: r,
                });
            } else {
                self.does_not_fit(plan, buckets, paused, now, &mut decision);
            }
            // The tenant's next job may need none of the closed buckets (another route or
            // provider): it gets its turn; one that needs them meets them closed.
            if !queues[turn.queue].is_empty() {
                heap.push(Turn { vtime, ..turn });
            } else if admitted && unread_behind[turn.queue] {
                // Its next job was not read: serving the others past its turn would give
                // them its share. The round ends here, and the next, at once, reads more.
                decision.full = true;
                break;
            }
        }
        decision
    }

    /// The job whose turn came does not fit: it fails, or it waits and what stopped it is
    /// closed to everyone else this round.
    fn does_not_fit(
        &mut self,
        plan: Plan,
        buckets: &HashMap<String, Bucket>,
        paused: &Pauses,
        now: DateTime<Utc>,
        decision: &mut Decision,
    ) {
        match self.unfit(plan, buckets, paused, &decision.closed, now) {
            Unfit::Fails(failed) => {
                if matches!(
                    failed.verdict,
                    Verdict::DeadlineUnmeetable | Verdict::BatchCostCapReached
                ) {
                    decision.blocked += 1;
                }
                decision.failed.push(failed);
            }
            Unfit::Waits {
                plan,
                note,
                stamp,
                ready,
            } => {
                decision.blocked += 1;
                if let Some(at) = ready.filter(|at| *at > now) {
                    decision.next_ready = Some(decision.next_ready.map_or(at, |n| n.min(at)));
                }
                for (key, amount) in &plan.routes[0].path {
                    if buckets
                        .get(key)
                        .is_some_and(|b| !b.fits(*amount, self.policy.headroom(b, plan.class)))
                    {
                        decision.closed.insert(key.clone());
                    }
                }
                // Give a note again only when what it says changes (the expected time to
                // the second), not on every round.
                if self.fairness.explained.get(&plan.job.id) != Some(&stamp) {
                    self.fairness.explained.insert(plan.job.id, stamp);
                    decision.waiting.push(Waiting { job: plan.job, note });
                }
            }
        }
    }

    /// Why `plan` does not fit: can it never fit, not before its deadline, or what does it
    /// wait for?
    fn unfit(
        &self,
        plan: Plan,
        buckets: &HashMap<String, Bucket>,
        paused: &Pauses,
        closed: &HashSet<String>,
        now: DateTime<Utc>,
    ) -> Unfit {
        let fails = |job, verdict, bucket: &str, message| Failed {
            job,
            verdict,
            bucket: bucket.to_owned(),
            message,
            note: None,
        };
        if let Some(scope) = holds::holding(paused, &plan.job.tenant, &plan.job.model) {
            return Unfit::Waits {
                plan,
                note: json!({"reason": holds::PAUSED_BY_OPERATOR, "scope": scope}),
                stamp: format!("{}|{scope}", holds::PAUSED_BY_OPERATOR),
                ready: None,
            };
        }
        if !plan.routes.is_empty() && plan.routes.iter().all(|r| key_rejected(paused, &r.target)) {
            let message = "every provider key that could serve the job was rejected by its provider";
            return Unfit::Fails(fails(
                plan.job,
                Verdict::UpstreamCredentialsExhausted,
                "",
                message.to_owned(),
            ));
        }
        let never = plan.routes.iter().all(|r| {
            r.path
                .iter()
                .any(|(key, amount)| buckets.get(key).is_some_and(|b| !b.can_ever_fit(*amount)))
        });
        if never || plan.routes.is_empty() {
            let (key, amount) = plan
                .routes
                .first()
                .and_then(|r| {
                    r.path
                        .iter()
                        .find(|(k, a)| buckets.get(k).is_some_and(|b| !b.can_ever_fit(*a)))
                })
                .cloned()
                .unwrap_or_default();
            let (capacity, dimension) = buckets
                .get(&key)
                .map_or((0.0, Dimension::Requests), |b| (b.capacity, b.dimension));
            let message = format!(
                "the job needs {} of {key} but its whole capacity is {}",
                dimension.show(amount),
                dimension.show(capacity)
            );
            return Unfit::Fails(fails(plan.job, Verdict::ExceedsLimit, &key, message));
        }
        let headroom = |b: &Bucket| self.policy.headroom(b, plan.class);
        let Route { path, .. } = &plan.routes[0];
        let mut blocking: Option<(&Bucket, f64)> = None;
        // A provider's 429 paused this target: nothing goes before its Retry-After. An
        // operator's pause has no end to promise (and fails nothing as unmeetable).
        let paused_as = paused_until(paused, &plan.routes[0]);
        let pause = paused_as.as_ref().map(|(_, until)| *until);
        let operator_held = pause.is_some_and(holds::is_operator);
        let mut ready: Option<DateTime<Utc>> = (!operator_held).then(|| pause.unwrap_or(now));
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
        let deadline = plan.job.deadline;
        if let Some(at) = ready.filter(|at| *at > deadline) {
            let bucket = blocking.map_or("", |(b, _)| &b.key);
            if buckets::is_batch_cap(bucket) {
                let message =
                    "its batch's spend reached the batch's max_cost_usd: the line no longer fits".to_owned();
                return Unfit::Fails(fails(plan.job, Verdict::BatchCostCapReached, bucket, message));
            }
            let message = format!(
                "capacity for the job ({}) is not expected before {at}, after its deadline {deadline}",
                blocking.map_or("its turn", |(b, _)| &b.key),
            );
            return Unfit::Fails(Failed {
                note: blocking.map(|(b, amount)| capacity_note("deadline_unmeetable", b, amount, Some(at))),
                ..fails(plan.job, Verdict::DeadlineUnmeetable, bucket, message)
            });
        }
        let note = match blocking {
            Some((b, amount)) => capacity_note("waiting_for_capacity", b, amount, ready),
            None => match paused_as {
                Some((scope, _)) if operator_held => json!({
                    "reason": holds::PAUSED_BY_OPERATOR,
                    "scope": scope,
                }),
                Some((scope, until)) => json!({
                    "reason": "provider_rate_limited",
                    "scope": scope,
                    "expected_at": until,
                }),
                // Behind another job that holds the bucket it needs: no time to promise.
                None => json!({"reason": "waiting_for_turn"}),
            },
        };
        let stamp = format!(
            "{}|{}|{}",
            note["reason"],
            note["bucket"],
            ready
                .filter(|_| blocking.is_some() || pause.is_some())
                .map_or(0, |t| t.timestamp())
        );
        Unfit::Waits {
            plan,
            note,
            stamp,
            ready,
        }
    }

    /// How far each (class, tenant) queue is behind its class's clock, in estimated tokens
    /// per unit of weight (negative: ahead), as its next turn would start: a queue behind
    /// is served before the others until it catches up, at most its burst credit behind.
    /// `weight_of` gives a tenant's weight.
    pub fn lags(&self, weight_of: impl Fn(&str) -> f64) -> Vec<(JobClass, String, f64)> {
        let burst = self.policy.gate.burst_credit_tokens as f64;
        let times = &self.fairness.times;
        times
            .vtime
            .iter()
            .map(|((class, tenant), vt)| {
                let clock = times.clock.get(class).copied().unwrap_or(0.0);
                let lag = (clock - vt).min(burst / weight_of(tenant).max(1.0));
                (*class, tenant.clone(), lag)
            })
            .collect()
    }

    /// Records a job admitted outside a round (on arrival): its tenant's virtual time
    /// advances as if a round had admitted it.
    pub fn served_on_arrival(&mut self, plan: &Plan) {
        let burst = self.policy.gate.burst_credit_tokens as f64;
        let times = &mut self.fairness.times;
        let vtime = times.turn_starts(plan.class, plan.job.tenant.clone(), plan.weight, burst);
        times.served(
            plan.class,
            plan.job.tenant.clone(),
            vtime,
            plan.cost / plan.weight,
        );
    }

    /// Forgets the explanations of jobs that were admitted (they wait no more).
    pub fn admitted(&mut self, ids: impl IntoIterator<Item = JobId>) {
        let explained = &mut self.fairness.explained;
        for id in ids {
            explained.remove(&id);
        }
        if explained.len() > EXPLAINED_KEPT {
            explained.clear();
        }
    }
}
