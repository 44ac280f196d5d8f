//! Forecasts: when work accepted now is expected to finish — its `eta`, a p50 and a p90 —
//! so that a job or batch whose deadline cannot be met is refused at submission with the
//! earliest time that can, instead of failing later.
//!
//! The model is the gate's own, run forward as a fluid: for each bucket on a route's path
//! (its level now, its refill — configured or learned), the work the gate serves before
//! the job is what is queued ahead of it on that route —
//! - every queued job of a class that goes first (precedence),
//! - its own tenant's jobs of its class that go first (priority, then earliest deadline),
//! - of each other tenant of its class, what weighted fair queuing serves while the job's
//!   tenant is served its own: `min(their queue, own × their weight / own weight)`
//!   (generalised processor sharing; a tenant with little queued takes only that), more
//!   by as much as the gate's virtual time has them behind the job's tenant, less by as
//!   much as it has them ahead (the leading gate's lags, `store::fairness_lags`);
//!
//! and the job starts when the slowest bucket has refilled that much beyond what it keeps
//! back from the job's class (the gate's headroom: refill in hand, the interactive
//! reserve) — a rolling bucket at its rate, a fixed window at its resets, a concurrency
//! gauge as calls of the observed latency end. It finishes a call's latency later: the p50 from the route's observed
//! p50 latency; the p90 from the observed p90 latency, and no sooner than the p50's time
//! from now stretched by how far past their p50 recent jobs finished (the record of past
//! forecasts, [`crate::store::ForecastRecord::p90_overrun`]) — and no sooner than the
//! buckets have served every other tenant's work due by its deadline besides its own
//! (work accepted after it may be due sooner, and fair sharing then serves it first: a
//! p90 within the deadline means the whole of what is due by then fits). A job that goes through a
//! provider's batch API takes that API's observed turnaround (or its window) instead of a
//! call's latency. A route the job could take that would finish it sooner is taken.
//!
//! For one job on a path of rolling buckets with a short queue, the gate's rounds are run
//! forward job by job instead ([`rounds`]): the gate admits whole jobs, and a tenant served
//! first whose jobs keep coming leaves another's larger job a surplus only while it has
//! none queued — which a fluid hands out at once.
//!
//! Work arriving meanwhile counts too, at the rate it arrived in the last minute (since its
//! first job, when that came within it): classes that go first take what arrives of
//! theirs, other tenants of its class their weighted share, and its own tenant's jobs of
//! its class that the gate will serve before it ([`Overtaking`]: a higher priority, or a
//! deadline sooner than its own — a job with no deadline of its own waits behind every
//! one arriving with a deadline) its own turns. Past its class's starvation guard (`starve_after_secs`) a job competes as
//! interactive, so it waits no longer than the guard, or than everything queued before it,
//! the interactive work arriving meanwhile and the jobs of its own tenant that go first
//! arriving meanwhile, each once past the guard too (a tenant's work past its guard goes
//! by deadline).
//!
//! Buckets that only the job's own tenant uses (its tenant's, its key's, its
//! application's) count only that tenant's queue. Work admitted already holds its
//! reservation: it is in the bucket's level, not in the queue. A silent provider's pace
//! (`crate::learning::pace_up`) is not counted: it doubles while work waits behind it.

use std::collections::HashMap;

use chrono::{DateTime, Duration, Utc};

use crate::buckets::{self, Bucket};
use crate::learning::is_pace;
use crate::model::JobClass;
use crate::scheduler::Route;
use crate::store::Queued;
use crate::vocab::{Dimension, Rule};

mod rounds;

/// When work is expected to finish, and to have started (what a job's deadline is about:
/// one still queued at its deadline fails).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eta {
    pub p50: DateTime<Utc>,
    pub p90: DateTime<Utc>,
    pub start_p90: DateTime<Utc>,
}

impl Eta {
    /// The forecast of a job `share` (0 to 1) of the way from the first of a run of work
    /// submitted together (`self`) to its last (`last`): the run drains in order, at the
    /// pace its limits allow, so each of its times moves along in proportion.
    pub fn towards(&self, last: &Eta, share: f64) -> Eta {
        let share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let along = |from: DateTime<Utc>, to: DateTime<Utc>| {
            let span = (to - from).num_milliseconds().max(0) as f64;
            from + chrono::Duration::milliseconds((span * share).round() as i64)
        };
        Eta {
            p50: along(self.p50, last.p50),
            p90: along(self.p90, last.p90),
            start_p90: along(self.start_p90, last.start_p90),
        }
    }
}

/// How long a call takes once started, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
}

/// Until calls to a model have been seen: a chat completion's typical time.
pub const UNSEEN_LATENCY: Latency = Latency { p50: 2.0, p90: 10.0 };

/// Until forecasts have a record ([`MIN_RECORD`] jobs): a job finishes within this many
/// times its p50's time from submission, one time in ten.
pub const UNRECORDED_OVERRUN: f64 = 1.5;
/// Finished jobs with a forecast before their record sets the p90's stretch.
pub const MIN_RECORD: i64 = 20;
/// The stretch of the p90 over the p50, whatever the record says.
pub const OVERRUN_RANGE: (f64, f64) = (1.1, 4.0);

/// The work forecast: one job, or a batch's lines together.
#[derive(Debug, Clone, Copy)]
pub struct Work<'a> {
    pub tenant: &'a str,
    pub class: JobClass,
    /// Its tenant's weight (at least 1).
    pub weight: f64,
    /// How many jobs, and their estimated tokens together.
    pub jobs: f64,
    pub input_tokens: f64,
    pub output_tokens: f64,
}

/// A stream of the work's own tenant and class that the gate serves before the work (the
/// queue's order: priority, then earliest deadline): what arrives of it per second, and
/// until when (seconds from now) what arrives still goes first — a job due `lead` seconds
/// after its submission comes before the work while it arrives more than `lead` before the
/// work's deadline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overtaking {
    pub jobs: f64,
    pub input_tokens: f64,
    pub output_tokens: f64,
    pub until: f64,
}

impl Overtaking {
    /// The streams of `arriving` (per second) that overtake work of `tenant` and `class`
    /// with `priority` and `deadline`.
    pub fn of<'a>(
        arriving: impl IntoIterator<Item = &'a crate::store::Arrived>,
        tenant: &str,
        class: JobClass,
        priority: i32,
        deadline: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Vec<Overtaking> {
        let due_in = seconds(deadline - now);
        arriving
            .into_iter()
            .filter(|a| a.queued.tenant == tenant && a.queued.class == class && a.priority >= priority)
            .filter_map(|a| {
                let until = if a.priority > priority {
                    f64::INFINITY
                } else {
                    due_in - a.lead
                };
                (until > 0.0).then_some(Overtaking {
                    jobs: a.queued.jobs,
                    input_tokens: a.queued.input_tokens,
                    output_tokens: a.queued.output_tokens,
                    until,
                })
            })
            .collect()
    }
}

/// What one route's forecast needs besides the work.
pub struct Outlook<'a> {
    /// The buckets on the route's path, by key, as they are now.
    pub buckets: &'a HashMap<String, Bucket>,
    /// What each bucket keeps back from a job of a class (the gate's headroom:
    /// `scheduler::Policy::headroom`): the job starts only when that much is left beside it.
    pub kept: &'a dyn Fn(&Bucket, JobClass) -> f64,
    /// The queued work ahead on the route (see [`crate::store::queued_around`]).
    pub ahead: &'a [Queued],
    /// Its own tenant's queued jobs of its class that the gate serves after it
    /// (see [`crate::store::queued_around`]): each goes first once it has waited past its
    /// class's guard.
    pub behind: &'a [Queued],
    /// The work arriving on the route, per second, by class and tenant (as lately seen:
    /// [`crate::store::arrived_since`] over its window).
    pub arriving: &'a [Queued],
    /// What arrives of the work's own tenant and class that goes before it.
    pub overtaking: &'a [Overtaking],
    /// Each tenant's weight.
    pub weight_of: &'a dyn Fn(&str) -> f64,
    /// How far each tenant's queue of a class is behind the class's clock in the gate's
    /// fair queuing (estimated tokens per unit of weight; negative: ahead): a queue behind
    /// is served before the others until it catches up — in the work's class, and in the
    /// interactive class where work past its guard competes. `None`: the gate has not
    /// served that queue; it starts at the class's clock when it comes.
    pub lag_of: &'a dyn Fn(JobClass, &str) -> Option<f64>,
    pub latency: Latency,
    /// How far past their p50's time recent jobs finished, one time in ten.
    pub overrun: f64,
    /// How long work of a class waits before it competes as interactive (the starvation
    /// guard, `classes.*.starve_after_secs`); `None` for interactive work.
    pub starve_after: &'a dyn Fn(JobClass) -> Option<f64>,
    /// How far behind its class's clock a tenant's queue may start when it comes back
    /// (`gate.burst_credit_tokens`, estimated tokens; per unit of weight once divided).
    pub burst_credit: f64,
    pub now: DateTime<Utc>,
}

/// The p90 stretch a forecast record sets: its `p90_overrun` once it counts [`MIN_RECORD`]
/// jobs, within [`OVERRUN_RANGE`].
pub fn overrun(jobs: i64, p90_overrun: Option<f64>) -> f64 {
    match p90_overrun {
        Some(o) if jobs >= MIN_RECORD && o.is_finite() => o.clamp(OVERRUN_RANGE.0, OVERRUN_RANGE.1),
        _ => UNRECORDED_OVERRUN,
    }
}

/// When `work`, planned on `route` (its path's amounts are one job's, `one` its raw
/// estimate), finishes; `None` when a bucket on the path can never hold it.
pub fn on_route(route: &Route, one: &Work<'_>, work: &Work<'_>, outlook: &Outlook<'_>) -> Option<Eta> {
    let (mut wait, mut wait_due) = (0.0_f64, 0.0_f64);
    // Waits for fixed windows to reset: set by the calendar, not stretched by the record.
    let (mut calendar, mut calendar_due) = (0.0_f64, 0.0_f64);
    // The buckets refilled to now, and what a unit of the work takes from each.
    let mut refilled: Vec<(Bucket, f64)> = Vec::with_capacity(route.path.len());
    for (key, amount) in &route.path {
        let Some(bucket) = outlook.buckets.get(key) else {
            continue;
        };
        // A pace doubles each second it holds work back: its rate now says little of how
        // fast a queue behind it drains, and taken as it is it would refuse deadlines that
        // its first seconds of growth meet.
        if buckets::is_batch_cap(key) || is_pace(key) {
            continue;
        }
        let mut bucket = bucket.clone();
        bucket.refill(outlook.now);
        if !bucket.can_ever_fit(*amount) {
            return None;
        }
        // What one unit of this bucket's measure (a job, a token) of the work takes from it,
        // for its share of the work when it is one of the model's quota pools.
        let per_unit = match measure(bucket.dimension, one) {
            m if m > 0.0 => amount / m,
            _ => 1.0,
        } * pool_share(key, &bucket, outlook.buckets);
        refilled.push((bucket.clone(), per_unit));
        // What it keeps back is never there for the work (as the gate's fit has it).
        bucket.level -= bucket.kept(*amount, (outlook.kept)(&bucket, work.class));
        let ahead = ahead_of(bucket.dimension, key, work, outlook);
        let (fair, due) = (
            fair_wait(&bucket, per_unit, &ahead, work, outlook)?,
            refilled_in(&bucket, per_unit * ahead.due, outlook)?,
        );
        let (w, d) = match bucket.rule {
            Rule::Fixed | Rule::Ramp => (&mut calendar, &mut calendar_due),
            Rule::Rolling | Rule::Gauge => (&mut wait, &mut wait_due),
        };
        (*w, *d) = (w.max(fair), d.max(due));
    }
    // One job on rolling buckets: the rounds, job by job, say when it starts.
    let lanes: Vec<rounds::Lane<'_>> = refilled
        .iter()
        .map(|(bucket, per_unit)| rounds::Lane {
            bucket,
            per_unit: *per_unit,
        })
        .collect();
    if let Some(admitted) = rounds::admitted_in(&lanes, work, outlook) {
        wait = admitted;
    }
    let latency = outlook.latency;
    let p50 = wait.max(calendar) + latency.p50;
    // No sooner than the buckets have served everything due by its deadline (other
    // tenants' work due as soon may be accepted after it, and fair sharing then serves it
    // beside this), the flowing buckets' wait stretched by the record.
    let start_p90 = (wait.max(wait_due) * outlook.overrun).max(calendar.max(calendar_due));
    let p90 = (start_p90 + latency.p90)
        .max((wait + latency.p50) * outlook.overrun)
        .max(calendar + latency.p50 * outlook.overrun);
    Some(Eta {
        p50: outlook.now + secs(p50),
        p90: outlook.now + secs(p90),
        start_p90: outlook.now + secs(start_p90),
    })
}

/// The share of its model's work a quota pool's bucket `key` serves: the gate admits each
/// job to whichever of the model's pools has room, so the work spreads over them by their
/// capacities (the pools' buckets of the same limit among `buckets`, which hold every
/// route's). 1 for any other bucket. The work itself goes to one pool whole; for a lone
/// job the wait is its refill, near nothing either way.
fn pool_share(key: &str, bucket: &Bucket, buckets: &HashMap<String, Bucket>) -> f64 {
    let Some(of) = buckets::pool_bucket_siblings(key) else {
        return 1.0;
    };
    let all: f64 = buckets
        .values()
        .filter(|b| buckets::pool_bucket_siblings(&b.key) == Some(of))
        .map(|b| b.capacity)
        .sum();
    if all > 0.0 { bucket.capacity / all } else { 1.0 }
}

/// What stands before `work` at one bucket, in units of its dimension.
#[derive(Debug, Default)]
struct Ahead {
    /// The work itself and its own tenant's queue ahead of it.
    own: f64,
    /// What arrives of its own tenant's that goes before it: per second, until when.
    overtaking: Vec<(f64, f64)>,
    /// Queued work of classes that go first, and how fast more arrives (per second).
    first: f64,
    first_arriving: f64,
    /// Each other tenant of its class.
    others: Vec<Other>,
    /// The work's tenant's lag, in the same units.
    lag: f64,
    /// `own`, `first` and every other tenant's work due by the deadline.
    due: f64,
    /// Everything queued, of every class (it was all submitted before the work: once all
    /// of it waits past its class's guard, it goes first), and the work.
    everything: f64,
    /// How fast interactive work arrives (it goes before starving work too).
    interactive_arriving: f64,
    /// Queued work of classes that go after it, and its own tenant's served after it, which
    /// goes first once it has waited past its class's guard: its amount, and in how many
    /// seconds the first and the last of it get there.
    starving: Vec<(f64, (f64, f64))>,
}

/// Another tenant of the work's class, at one bucket.
#[derive(Debug, Default)]
struct Other {
    queued: f64,
    /// How fast more of its work arrives (per second).
    arriving: f64,
    weight: f64,
    /// How far it is behind the class's clock, in units of the bucket per unit of weight.
    lag: f64,
    /// In how many seconds the first and the last of its queued work has waited past the
    /// class's guard (it then goes first, as interactive work); `None`: interactive.
    starving: Option<(f64, f64)>,
}

/// Of `amount` that waits past its guard from `first` to `last` seconds from now, spread
/// evenly over when it came, what has by `t`.
fn starved(amount: f64, (first, last): (f64, f64), t: f64) -> f64 {
    match last - first {
        span if span > 0.0 => amount * ((t - first) / span).clamp(0.0, 1.0),
        _ if t >= first => amount,
        _ => 0.0,
    }
}

/// What the bucket `key` must serve until `work` is through: the work itself, its own
/// tenant's queue ahead, classes that go first, each other tenant of its class (its fair
/// share beside it, and in [`Ahead::due`] all it has due by the deadline) — and how fast
/// more of theirs arrives. A bucket only the work's tenant uses counts only its own.
fn ahead_of(dimension: Dimension, key: &str, work: &Work<'_>, outlook: &Outlook<'_>) -> Ahead {
    let own_only = buckets::is_tenant_held(key);
    let mut ahead = Ahead {
        own: measure(dimension, work),
        ..Ahead::default()
    };
    let mut others: HashMap<&str, Other> = HashMap::new();
    let mut others_due = 0.0;
    // In how many seconds the first and the last of a queue wait past their class's guard.
    let starving = |q: &Queued| {
        let guard = (outlook.starve_after)(q.class)?;
        let starving_in = |at: DateTime<Utc>| seconds(at - outlook.now) + guard;
        Some((starving_in(q.oldest), starving_in(q.newest)))
    };
    let queued = outlook.ahead.iter().map(|q| (q, false));
    for (q, arriving) in queued.chain(outlook.arriving.iter().map(|q| (q, true))) {
        let amount = units(dimension, q.jobs, q.input_tokens, q.output_tokens);
        if q.tenant == work.tenant || !own_only {
            match (arriving, q.class) {
                (false, _) => ahead.everything += amount,
                (true, JobClass::Interactive) => ahead.interactive_arriving += amount,
                (true, _) => {}
            }
            if let (false, Some(window)) = (arriving, starving(q))
                && q.class > work.class
            {
                ahead.starving.push((amount, window));
            }
        }
        match (q.tenant == work.tenant, q.class.cmp(&work.class)) {
            (true, std::cmp::Ordering::Equal) if !arriving => ahead.own += amount,
            (true, std::cmp::Ordering::Less) | (false, std::cmp::Ordering::Less)
                if q.tenant == work.tenant || !own_only =>
            {
                match arriving {
                    true => ahead.first_arriving += amount,
                    false => ahead.first += amount,
                }
            }
            (false, std::cmp::Ordering::Equal) if !own_only => {
                let other = others.entry(q.tenant.as_str()).or_default();
                match arriving {
                    true => other.arriving += amount,
                    false => {
                        other.queued += amount;
                        others_due += units(dimension, q.due_jobs, q.due_input_tokens, q.due_output_tokens);
                        if let Some((first, last)) = starving(q) {
                            other.starving = Some(match other.starving {
                                Some((f, l)) => (f.min(first), l.max(last)),
                                None => (first, last),
                            });
                        }
                    }
                }
            }
            _ => {}
        }
    }
    for q in outlook.behind {
        let amount = units(dimension, q.jobs, q.input_tokens, q.output_tokens);
        ahead.everything += amount;
        if let Some(window) = starving(q) {
            ahead.starving.push((amount, window));
        }
    }
    ahead.overtaking = outlook
        .overtaking
        .iter()
        .map(|o| (units(dimension, o.jobs, o.input_tokens, o.output_tokens), o.until))
        .collect();
    ahead.due = ahead.own + ahead.first + others_due;
    ahead.everything += measure(dimension, work);
    // The gate's virtual time counts estimated tokens: a lag in the bucket's units.
    let per_cost = measure(dimension, work) / (work.input_tokens + work.output_tokens).max(1.0);
    let lag_of = |tenant: &str| (outlook.lag_of)(work.class, tenant).unwrap_or(0.0);
    ahead.lag = lag_of(work.tenant) * per_cost;
    ahead.others = others
        .into_iter()
        .map(|(tenant, other)| Other {
            weight: (outlook.weight_of)(tenant),
            lag: lag_of(tenant) * per_cost,
            ..other
        })
        .collect();
    ahead
}

/// Seconds until `bucket` has served the work's fair turn (`ahead`, in units the work's
/// `per_unit` scales to the bucket's): a rolling bucket or a gauge serves at its rate
/// while classes that go first take what arrives of theirs, and each other tenant of its
/// class takes up to its weight's share of what the work is served (generalised processor
/// sharing, with what arrives meanwhile); a fixed window serves the queue as it is.
/// `None` when time alone never serves it.
fn fair_wait(
    bucket: &Bucket,
    per_unit: f64,
    ahead: &Ahead,
    work: &Work<'_>,
    outlook: &Outlook<'_>,
) -> Option<f64> {
    let weight = work.weight;
    let rate = match bucket.rule {
        Rule::Rolling => bucket.rate(),
        Rule::Gauge if bucket.capacity > 0.0 => bucket.capacity / outlook.latency.p50.max(1e-3),
        _ => 0.0,
    };
    // The work's own tenant serves by `t` its queue ahead, the work, and what arrives
    // meanwhile that goes before it.
    let own = |t: f64| -> f64 {
        ahead.own
            + ahead
                .overtaking
                .iter()
                .map(|(per_sec, until)| per_sec * t.min(*until))
                .sum::<f64>()
    };
    // Another tenant is served until its virtual time passes the work's: its weight's
    // share of the work, plus what it is behind the work's tenant (less what it is ahead)
    // — and all of its work that waited past the class's guard by then goes first.
    let share = |t: f64| -> f64 {
        ahead
            .others
            .iter()
            .map(|o| {
                let turn = (own(t) / weight.max(1.0) + o.lag - ahead.lag) * o.weight;
                let past_guard = o.starving.map_or(0.0, |w| starved(o.queued, w, t));
                (o.queued + o.arriving * t).min(turn.max(past_guard))
            })
            .sum()
    };
    if rate <= 0.0 {
        return refilled_in(bucket, per_unit * (own(0.0) + ahead.first + share(0.0)), outlook);
    }
    // What the work is left after the classes going first take what arrives of theirs:
    // never less than a twentieth (their jobs cannot hold all of it for long: a job
    // waiting past its class's `starve_after_secs` competes as interactive).
    let left = (rate - per_unit * ahead.first_arriving).max(rate / 20.0);
    // T = (needed by T − level) / what the work is left: `share` grows with T, so T is
    // found by iterating from the queue as it is (each step only lengthens it).
    // Lower classes' work waiting past its guard by `t`, spread evenly over when it came.
    let starving = |t: f64| -> f64 {
        ahead
            .starving
            .iter()
            .map(|(amount, window)| starved(*amount, *window, t))
            .sum()
    };
    let mut t = 0.0_f64;
    for _ in 0..32 {
        let needed = per_unit * (own(t) + ahead.first + share(t) + starving(t));
        let next = ((needed - bucket.level) / left).max(0.0);
        let settled = (next - t).abs() < 1e-3;
        t = next;
        if settled {
            break;
        }
    }
    // Past its class's guard it competes as interactive: then no later than everything
    // queued now (all submitted before it), what arrives of interactive work, and what
    // arrives of its own tenant's that the gate serves before it once that has passed the
    // guard too (a tenant's work past its guard goes by deadline).
    let Some(starve_after) = (outlook.starve_after)(work.class).filter(|s| t > *s) else {
        return Some(t);
    };
    let left = (rate - per_unit * ahead.interactive_arriving).max(rate / 20.0);
    let passing = |t: f64| -> f64 {
        ahead
            .overtaking
            .iter()
            .map(|(per_sec, until)| per_sec * (t - starve_after).clamp(0.0, *until))
            .sum()
    };
    let mut in_turn = 0.0_f64;
    for _ in 0..32 {
        let next = ((per_unit * (ahead.everything + passing(in_turn)) - bucket.level) / left).max(0.0);
        let settled = (next - in_turn).abs() < 1e-3;
        in_turn = next;
        if settled {
            break;
        }
    }
    Some(t.min(starve_after.max(in_turn)))
}

/// Seconds until `bucket` (refilled to now) has served `needed`; `None` when time alone
/// never does (a rolling bucket with no refill).
fn refilled_in(bucket: &Bucket, needed: f64, outlook: &Outlook<'_>) -> Option<f64> {
    let missing = needed - bucket.level;
    if missing <= 0.0 {
        return Some(0.0);
    }
    match bucket.rule {
        Rule::Rolling => (bucket.rate() > 0.0).then(|| missing / bucket.rate()),
        Rule::Fixed | Rule::Ramp => {
            if bucket.capacity <= 0.0 {
                return None;
            }
            let resets = bucket.resets_at.unwrap_or(outlook.now);
            let first = (resets - outlook.now).num_milliseconds().max(0) as f64 / 1e3;
            let windows = (missing / bucket.capacity).ceil() - 1.0;
            Some(first + windows.max(0.0) * bucket.window_secs.max(1) as f64)
        }
        // Calls of the observed latency end, `capacity` at a time.
        Rule::Gauge => (bucket.capacity > 0.0).then(|| missing * outlook.latency.p50 / bucket.capacity),
    }
}

/// The work's size in a bucket's measure: jobs for requests and concurrency, tokens for
/// token buckets and spend (scaled to spend by the job's own amount).
fn measure(dimension: Dimension, work: &Work<'_>) -> f64 {
    units(dimension, work.jobs, work.input_tokens, work.output_tokens)
}

fn units(dimension: Dimension, jobs: f64, input: f64, output: f64) -> f64 {
    match dimension {
        Dimension::Requests | Dimension::Concurrency => jobs,
        Dimension::InputTokens => input,
        Dimension::OutputTokens => output,
        Dimension::TotalTokens | Dimension::SpendMicroUsd => input + output,
    }
}

fn seconds(d: Duration) -> f64 {
    d.num_milliseconds() as f64 / 1e3
}

fn secs(s: f64) -> Duration {
    Duration::milliseconds((s * 1e3).ceil().min(1e15) as i64)
}

/// The earliest of the routes' forecasts (by p50).
pub fn earliest(etas: impl IntoIterator<Item = Eta>) -> Option<Eta> {
    etas.into_iter().min_by_key(|e| e.p50)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_s_share_of_a_run_places_it_between_the_run_s_first_and_last() {
        let t = |s: i64| DateTime::<Utc>::from_timestamp(1_800_000_000 + s, 0).unwrap();
        let first = Eta {
            p50: t(2),
            p90: t(4),
            start_p90: t(3),
        };
        let last = Eta {
            p50: t(102),
            p90: t(204),
            start_p90: t(203),
        };
        assert_eq!(first.towards(&last, 0.0), first);
        assert_eq!(first.towards(&last, 1.0), last);
        let half = first.towards(&last, 0.5);
        assert_eq!((half.p50, half.p90, half.start_p90), (t(52), t(104), t(103)));
        assert_eq!(first.towards(&last, f64::NAN), last, "a run of one job");
        assert_eq!(first.towards(&last, 7.0), last);
    }
    use crate::config::ProviderKind;
    use crate::routing::Target;

    fn now() -> DateTime<Utc> {
        "2026-12-04T12:00:00Z".parse().unwrap()
    }

    fn bucket(
        key: &str,
        dimension: Dimension,
        rule: Rule,
        capacity: f64,
        window_secs: i64,
        level: f64,
    ) -> Bucket {
        Bucket {
            id: 1,
            key: key.to_owned(),
            dimension,
            rule,
            capacity,
            window_secs,
            level,
            updated_at: now(),
            resets_at: None,
            ramp_step: None,
            configured_capacity: Some(capacity),
            learned_at: None,
        }
    }

    fn route(path: &[(&str, f64)]) -> Route {
        Route {
            target: Target {
                provider: "oai".to_owned(),
                kind: ProviderKind::Openai,
                model: "m".to_owned(),
                key: None,
            },
            scope: buckets::target_scope("oai", "m"),
            path: path.iter().map(|(k, a)| ((*k).to_owned(), *a)).collect(),
            cost: buckets::EstimatedCost::default(),
        }
    }

    fn work(tenant: &str, jobs: f64) -> Work<'_> {
        Work {
            tenant,
            class: JobClass::Standard,
            weight: 1.0,
            jobs,
            input_tokens: 100.0 * jobs,
            output_tokens: 100.0 * jobs,
        }
    }

    fn queued(tenant: &str, class: JobClass, jobs: f64) -> Queued {
        Queued {
            class,
            tenant: tenant.to_owned(),
            model: "m".to_owned(),
            jobs,
            input_tokens: 100.0 * jobs,
            output_tokens: 100.0 * jobs,
            due_jobs: jobs,
            due_input_tokens: 100.0 * jobs,
            due_output_tokens: 100.0 * jobs,
            oldest: now(),
            newest: now(),
        }
    }

    const LATENCY: Latency = Latency { p50: 1.0, p90: 3.0 };

    fn forecast(buckets: &[Bucket], ahead: &[Queued], weights: &[(&str, f64)], of: Work<'_>) -> Option<Eta> {
        forecast_arriving(buckets, ahead, &[], weights, of)
    }

    fn forecast_arriving(
        buckets: &[Bucket],
        ahead: &[Queued],
        arriving: &[Queued],
        weights: &[(&str, f64)],
        of: Work<'_>,
    ) -> Option<Eta> {
        forecast_lagging(buckets, ahead, arriving, weights, &[], of)
    }

    /// With the gate's `lags`: (class, tenant, lag).
    fn forecast_lagging(
        buckets: &[Bucket],
        ahead: &[Queued],
        arriving: &[Queued],
        weights: &[(&str, f64)],
        lags: &[(JobClass, &str, f64)],
        of: Work<'_>,
    ) -> Option<Eta> {
        let buckets: HashMap<String, Bucket> = buckets.iter().map(|b| (b.key.clone(), b.clone())).collect();
        let weights: HashMap<String, f64> = weights.iter().map(|(t, w)| ((*t).to_owned(), *w)).collect();
        let weight_of = |t: &str| weights.get(t).copied().unwrap_or(1.0);
        let lags: HashMap<(JobClass, String), f64> =
            lags.iter().map(|(c, t, l)| ((*c, (*t).to_owned()), *l)).collect();
        let lag_of = |class: JobClass, t: &str| lags.get(&(class, t.to_owned())).copied();
        let path: Vec<(&str, f64)> = buckets
            .values()
            .map(|b| (b.key.as_str(), units(b.dimension, 1.0, 100.0, 100.0)))
            .collect();
        let outlook = Outlook {
            buckets: &buckets,
            kept: &|_, _| 0.0,
            burst_credit: 8192.0,
            ahead,
            behind: &[],
            arriving,
            overtaking: &[],
            weight_of: &weight_of,
            lag_of: &lag_of,
            latency: LATENCY,
            overrun: 1.5,
            starve_after: &|class| (class != JobClass::Interactive).then_some(60.0),
            now: now(),
        };
        on_route(&route(&path), &work(of.tenant, 1.0), &of, &outlook)
    }

    /// An outlook with nothing arriving, every tenant of weight 1 and level with the
    /// clock, no starvation guard, and `kept` back from each bucket.
    fn plain_outlook<'a>(
        buckets: &'a HashMap<String, Bucket>,
        ahead: &'a [Queued],
        kept: &'a dyn Fn(&Bucket, JobClass) -> f64,
    ) -> Outlook<'a> {
        fn weight(_: &str) -> f64 {
            1.0
        }
        fn lag(_: JobClass, _: &str) -> Option<f64> {
            None
        }
        fn guard(_: JobClass) -> Option<f64> {
            None
        }
        Outlook {
            buckets,
            kept,
            ahead,
            behind: &[],
            arriving: &[],
            overtaking: &[],
            weight_of: &weight,
            lag_of: &lag,
            latency: LATENCY,
            overrun: 1.5,
            starve_after: &guard,
            burst_credit: 8192.0,
            now: now(),
        }
    }

    fn secs_from_now(at: DateTime<Utc>) -> f64 {
        (at - now()).num_milliseconds() as f64 / 1e3
    }

    #[test]
    fn work_that_fits_now_finishes_a_call_later() {
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 60.0);
        let eta = forecast(&[rpm], &[], &[], work("a", 1.0)).unwrap();
        assert_eq!(secs_from_now(eta.p50), 1.0);
        assert_eq!(secs_from_now(eta.p90), 3.0);
        assert_eq!(eta.start_p90, now());
    }

    #[test]
    fn what_a_bucket_keeps_back_is_waited_for_too() {
        // 1 request/s, 3 left, 5 kept back: 3 s of refill until 1 is there beside the 5,
        // then its 1 s call.
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 3.0);
        let buckets: HashMap<String, Bucket> = HashMap::from([(rpm.key.clone(), rpm)]);
        let outlook = plain_outlook(&buckets, &[], &|_, _| 5.0);
        let eta = on_route(
            &route(&[("oai:m:rpm", 1.0)]),
            &work("a", 1.0),
            &work("a", 1.0),
            &outlook,
        )
        .unwrap();
        assert_eq!(secs_from_now(eta.p50), 4.0);
    }

    #[test]
    fn a_pace_is_not_taken_for_the_rate_a_queue_drains_at() {
        // 10 a second now, empty, 100 queued ahead: the pace doubles while they wait.
        let pace = bucket(
            "provider:oai:m:pace",
            Dimension::Requests,
            Rule::Rolling,
            10.0,
            1,
            0.0,
        );
        let ahead = [queued("a", JobClass::Standard, 100.0)];
        let eta = forecast(&[pace], &ahead, &[], work("a", 1.0)).unwrap();
        assert_eq!(secs_from_now(eta.p50), 1.0);
    }

    #[test]
    fn the_queue_ahead_waits_for_the_bucket_to_refill() {
        // 1 request/s, empty; 9 queued ahead of the tenant's own plus this one: 10 s.
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        let ahead = [queued("a", JobClass::Standard, 9.0)];
        let eta = forecast(&[rpm], &ahead, &[], work("a", 1.0)).unwrap();
        assert_eq!(secs_from_now(eta.p50), 11.0);
        // The p90: the p50's 11 s stretched by the overrun (16.5 s), above 10 × 1.5 + 3 s.
        assert_eq!(secs_from_now(eta.p90), 18.0);
        assert_eq!(secs_from_now(eta.start_p90), 15.0);
    }

    #[test]
    fn a_model_s_quota_pools_share_the_queue_ahead_by_their_capacities() {
        // Two pools of 1 request/s each, empty; 9 queued ahead plus this one, on the route
        // through pool A: the gate sends half of them to B, so 5 s, not 10.
        let a = bucket(
            "pool:oai:org-a:m:rpm",
            Dimension::Requests,
            Rule::Rolling,
            60.0,
            60,
            0.0,
        );
        let b = bucket(
            "pool:oai:org-b:m:rpm",
            Dimension::Requests,
            Rule::Rolling,
            60.0,
            60,
            0.0,
        );
        let buckets: HashMap<String, Bucket> = [a, b].into_iter().map(|b| (b.key.clone(), b)).collect();
        let ahead = [queued("a", JobClass::Standard, 9.0)];
        let outlook = plain_outlook(&buckets, &ahead, &|_, _| 0.0);
        let through_a = route(&[("pool:oai:org-a:m:rpm", 1.0)]);
        let eta = on_route(&through_a, &work("a", 1.0), &work("a", 1.0), &outlook).unwrap();
        assert_eq!(secs_from_now(eta.p50), 6.0);
        assert_eq!(
            pool_share("oai:m:rpm", &buckets["pool:oai:org-a:m:rpm"], &buckets),
            1.0
        );
    }

    #[test]
    fn other_tenants_take_their_weighted_share_and_first_classes_all() {
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        let ahead = [
            // Weight 3 beside weight 1: 3 of theirs per one of ours; they have 100.
            queued("b", JobClass::Standard, 100.0),
            // A tenant with 1 queued takes only that.
            queued("c", JobClass::Standard, 1.0),
            queued("d", JobClass::Interactive, 5.0),
            queued("e", JobClass::Background, 50.0),
        ];
        let eta = forecast(&[rpm], &ahead, &[("b", 3.0)], work("a", 2.0)).unwrap();
        // own 2 + b's 6 + c's 1 + d's 5 = 14 requests at 1/s, then a second's call.
        assert_eq!(secs_from_now(eta.p50), 15.0);
        // Its start, one time in ten: once all that is due by its deadline is served (all
        // of b's 100 is due here: 108 s), stretched by the record.
        assert_eq!(secs_from_now(eta.start_p90), 162.0);
    }

    #[test]
    fn a_tenant_behind_the_fair_queuing_clock_is_served_first_until_it_catches_up() {
        // 1 request/s, empty; b has 100 queued. The work is 2 jobs of 400 estimated tokens
        // together (2 requests), so 1,000 tokens of lag are 5 requests.
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        let ahead = [queued("b", JobClass::Standard, 100.0)];
        let eta = |lags: &[(&str, f64)]| {
            let lags: Vec<_> = lags.iter().map(|(t, l)| (JobClass::Standard, *t, *l)).collect();
            let eta = forecast_lagging(
                std::slice::from_ref(&rpm),
                &ahead,
                &[],
                &[],
                &lags,
                work("a", 2.0),
            )
            .unwrap();
            secs_from_now(eta.p50)
        };
        // Level: b takes its share beside a's 2; then the call.
        assert_eq!(eta(&[]), 5.0);
        // b behind by 5 requests' worth: it catches up first.
        assert_eq!(eta(&[("b", 1000.0)]), 10.0);
        // a behind by as much: b waits for a.
        assert_eq!(eta(&[("a", 1000.0)]), 3.0);
    }

    #[test]
    fn work_arriving_meanwhile_takes_its_turn_and_first_classes_theirs() {
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        // Tenant b queues nothing but sends a job a second, and is a job's cost (200
        // tokens) behind the clock; interactive work arrives every other second. The
        // rounds: c's at 1 s, b's at 2 s (it came at 0.5 s and goes first, once), c's at
        // 3 s, ours at 4 s (b, level now, waits behind it), then a second's call.
        let arriving = [
            queued("b", JobClass::Standard, 1.0),
            queued("c", JobClass::Interactive, 0.5),
            // Lower classes and our own later jobs do not stand before it.
            queued("d", JobClass::Background, 10.0),
            queued("a", JobClass::Standard, 10.0),
        ];
        let eta = forecast_lagging(
            &[rpm],
            &[],
            &arriving,
            &[],
            &[(JobClass::Standard, "b", 200.0)],
            work("a", 1.0),
        )
        .unwrap();
        assert_eq!(secs_from_now(eta.p50), 5.0);
    }

    /// One job of `a` on 1 request/s, empty, with a guard of 60 s, as its own tenant's
    /// jobs arriving a second `overtaking` it, in the rounds and in the fluid (`jobs` 2:
    /// a batch of two).
    fn overtaken(jobs: f64, overtaking: &[Overtaking]) -> f64 {
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        let buckets = HashMap::from([(rpm.key.clone(), rpm)]);
        let outlook = Outlook {
            overtaking,
            starve_after: &|class| (class != JobClass::Interactive).then_some(60.0),
            ..plain_outlook(&buckets, &[], &|_, _| 0.0)
        };
        let of = work("a", jobs);
        let eta = on_route(&route(&[("oai:m:rpm", 1.0)]), &work("a", 1.0), &of, &outlook).unwrap();
        secs_from_now(eta.p50)
    }

    #[test]
    fn its_own_tenant_s_jobs_due_sooner_go_first_while_they_arrive_before_its_deadline_less_their_lead() {
        let a_second = |until| Overtaking {
            jobs: 1.0,
            input_tokens: 200.0,
            output_tokens: 200.0,
            until,
        };
        // Nothing overtakes: the first request refills in 1 s, then the second's call.
        assert_eq!(overtaken(1.0, &[]), 2.0);
        // Those arriving in the next 10 s go first (at 0.5 s, 1.5 s, ...: admitted at 1 s,
        // 2 s, ..., 10 s), then it at 11 s.
        assert_eq!(overtaken(1.0, &[a_second(10.0)]), 12.0);
        // Arriving as fast as the bucket refills, for good: it waits for its guard, then
        // competes as interactive on its own, ahead of those queued after it.
        assert_eq!(overtaken(1.0, &[a_second(f64::INFINITY)]), 61.0);
        // The fluid (two jobs) counts them too.
        let fluid = overtaken(2.0, &[a_second(10.0)]);
        assert!((12.0..=13.0).contains(&fluid), "fluid p50 {fluid} s");
    }

    #[test]
    fn what_overtakes_is_its_own_tenant_s_class_of_a_higher_priority_or_due_sooner() {
        let arrived = |tenant: &str, priority, lead| crate::store::Arrived {
            queued: queued(tenant, JobClass::Standard, 1.0),
            priority,
            lead,
        };
        let rows = [
            arrived("a", 0, 120.0),
            arrived("a", 1, 3_600.0),
            arrived("a", -1, 10.0),
            arrived("b", 1, 10.0),
            arrived("a", 0, 3_600.0),
        ];
        let until = |due_in: i64| -> Vec<f64> {
            let deadline = now() + Duration::seconds(due_in);
            Overtaking::of(&rows, "a", JobClass::Standard, 0, deadline, now())
                .iter()
                .map(|o| o.until)
                .collect()
        };
        // Due in an hour (no deadline of its own): the jobs due two minutes after they
        // come go first while they come in the next 58 minutes; the higher priority always.
        assert_eq!(until(3_600), [3_480.0, f64::INFINITY]);
        // Due in two minutes: what arrives is due later than it, but the higher priority.
        assert_eq!(until(120), [f64::INFINITY]);
    }

    #[test]
    fn a_tenant_served_first_that_keeps_coming_holds_a_larger_job_back_until_it_catches_up() {
        // 500 tokens/s, empty. b (weight 3, 2,000 tokens per unit of weight behind the
        // clock) sends a 300-token job every 0.625 s, 480 tokens/s. The gate admits whole
        // jobs, b's first while it is behind: each of b's takes the level back to about
        // nothing, and the 12.5 tokens each gap leaves build to our 530 only after 29 of
        // them — but after 20, b has caught up and ours goes first: ~12.2 s, then ~0.9 s
        // for its 530 tokens, then the second's call. (The fluid, which hands out the
        // refill as it comes, gives b its whole turn first: 16.2 s before the call.)
        let tpm = bucket(
            "oai:m:tpm",
            Dimension::TotalTokens,
            Rule::Rolling,
            30_000.0,
            60,
            0.0,
        );
        let buckets = HashMap::from([(tpm.key.clone(), tpm)]);
        let mut b = queued("b", JobClass::Standard, 1.6);
        (b.input_tokens, b.output_tokens) = (1.6 * 150.0, 1.6 * 150.0);
        let weight = |t: &str| if t == "b" { 3.0 } else { 1.0 };
        let lag = |_: JobClass, t: &str| (t == "b").then_some(2000.0);
        let outlook = Outlook {
            arriving: std::slice::from_ref(&b),
            overtaking: &[],
            weight_of: &weight,
            lag_of: &lag,
            ..plain_outlook(&buckets, &[], &|_, _| 0.0)
        };
        let mut of = work("a", 1.0);
        (of.input_tokens, of.output_tokens) = (265.0, 265.0);
        let eta = on_route(&route(&[("oai:m:tpm", 530.0)]), &of, &of, &outlook).unwrap();
        let p50 = secs_from_now(eta.p50);
        assert!((13.5..15.0).contains(&p50), "p50 {p50} s");
    }

    #[test]
    fn arrivals_take_a_share_of_what_a_batch_of_jobs_waits_for() {
        // Several jobs together drain as a fluid: beside our 2 (equal weights) b's
        // arrivals take 2; interactive work arriving at half a request a second leaves
        // ours the other half: 4 requests at 0.5/s, then the call.
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        let arriving = [
            queued("b", JobClass::Standard, 1.0),
            queued("c", JobClass::Interactive, 0.5),
        ];
        let eta = forecast_arriving(&[rpm], &[], &arriving, &[], work("a", 2.0)).unwrap();
        assert_eq!(secs_from_now(eta.p50), 9.0);
    }

    #[test]
    fn past_its_guard_work_still_waits_for_its_own_tenant_s_jobs_due_sooner_past_theirs() {
        // A request a second; 100 of its own tenant's jobs queued ahead, and its jobs due
        // sooner arriving one every two seconds. Two jobs: the fluid answers.
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        let buckets: HashMap<String, Bucket> = HashMap::from([(rpm.key.clone(), rpm)]);
        let ahead = [queued("acme", JobClass::Standard, 100.0)];
        let overtaking = [Overtaking {
            jobs: 0.5,
            input_tokens: 50.0,
            output_tokens: 50.0,
            until: f64::INFINITY,
        }];
        let guard = |class: JobClass| (class != JobClass::Interactive).then_some(60.0);
        let outlook = Outlook {
            overtaking: &overtaking,
            starve_after: &guard,
            ..plain_outlook(&buckets, &ahead, &|_, _| 0.0)
        };
        let eta = on_route(
            &route(&[("oai:m:rpm", 1.0)]),
            &work("acme", 1.0),
            &work("acme", 2.0),
            &outlook,
        )
        .unwrap();
        // Past its guard at 60 s it waits for the 102 jobs queued and for those of its own
        // arriving from then on, each past its guard in turn: T = 102 + 0.5 (T − 60).
        let start = secs_from_now(eta.p50) - LATENCY.p50;
        assert!((start - 144.0).abs() < 0.5, "{start}");
    }

    #[test]
    fn work_starved_by_classes_going_first_waits_for_its_guard() {
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        // Standard work arrives twice as fast as the bucket serves: background work would
        // wait for ever, but after its 60 s it competes as interactive, behind the 10 jobs
        // queued before it (all served by then).
        let ahead = [queued("b", JobClass::Standard, 10.0)];
        let arriving = [queued("b", JobClass::Standard, 2.0)];
        let mut of = work("a", 1.0);
        of.class = JobClass::Background;
        let eta = forecast_arriving(&[rpm], &ahead, &arriving, &[], of).unwrap();
        assert_eq!(secs_from_now(eta.p50), 61.0);
    }

    #[test]
    fn older_work_of_later_classes_goes_first_once_it_starves() {
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        // 100 background jobs came over the last 100 s: from now on one a second waits
        // past its 60 s guard and goes first (40 have already). 49 standard jobs are
        // queued ahead of ours; served at one a second, the starving work keeps pace with
        // the bucket, so ours waits for all of it: 49 + 1 + 100 requests.
        let mut old = queued("b", JobClass::Background, 100.0);
        old.oldest = now() - Duration::seconds(100);
        let ahead = [queued("a", JobClass::Standard, 49.0), old];
        let eta = forecast(std::slice::from_ref(&rpm), &ahead, &[], work("a", 1.0)).unwrap();
        assert_eq!(secs_from_now(eta.p50), 151.0);
        // With nothing that old, the standard work is served first.
        let young = queued("b", JobClass::Background, 100.0);
        let eta = forecast(
            &[rpm],
            &[queued("a", JobClass::Standard, 49.0), young],
            &[],
            work("a", 1.0),
        );
        assert_eq!(secs_from_now(eta.unwrap().p50), 51.0);
    }

    #[test]
    fn another_tenant_s_work_past_its_guard_goes_first_whatever_the_weights() {
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        let weights = [("a", 3.0), ("b", 1.0)];
        let mut of = work("a", 1.0);
        of.weight = 3.0;
        // b's 100 standard jobs came over the last 100 s: 40 have waited past the 60 s
        // guard and one more does each second, as fast as the bucket serves — so a's job,
        // though a weighs three times b, waits until it too has waited past its guard
        // and competes as interactive, where it starts level with the class's clock and
        // so before b, whose every turn there moved it past the clock: 60 s, then the call.
        let mut old = queued("b", JobClass::Standard, 100.0);
        old.oldest = now() - Duration::seconds(100);
        let eta = forecast_lagging(std::slice::from_ref(&rpm), &[old], &[], &weights, &[], of);
        assert_eq!(secs_from_now(eta.unwrap().p50), 61.0);
        // Just come, level with a on the clock, they take one job's turn before it (the
        // tie goes to the queue ahead), not all 100.
        let young = queued("b", JobClass::Standard, 100.0);
        let eta = forecast_lagging(&[rpm], &[young], &[], &weights, &[], of);
        assert_eq!(secs_from_now(eta.unwrap().p50), 3.0);
    }

    #[test]
    fn work_past_its_guard_competes_from_where_the_gate_has_its_tenant_in_the_interactive_class() {
        let rpm = bucket("oai:m:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        // b's 100 standard jobs came over the last 100 s: 40 have waited past their guard
        // and compete as interactive, beside a's interactive job.
        let mut old = queued("b", JobClass::Standard, 100.0);
        old.oldest = now() - Duration::seconds(100);
        let mut of = work("a", 1.0);
        of.class = JobClass::Interactive;
        let eta = |lags: &[(JobClass, &str, f64)]| {
            let eta = forecast_lagging(
                std::slice::from_ref(&rpm),
                std::slice::from_ref(&old),
                &[],
                &[],
                lags,
                of,
            );
            secs_from_now(eta.unwrap().p50)
        };
        // Level on the interactive clock: one of b's (the tie goes to the queue ahead),
        // then a's, then the call.
        assert_eq!(eta(&[]), 3.0);
        // b behind the interactive clock by ten of its jobs (200 estimated tokens each) in
        // the gate: it catches up first, though its standard queue stands level.
        assert_eq!(eta(&[(JobClass::Interactive, "b", 2000.0)]), 13.0);
        assert_eq!(eta(&[(JobClass::Standard, "b", 2000.0)]), 3.0);
    }

    #[test]
    fn a_tenant_bucket_counts_only_its_tenant() {
        let own = bucket("tenant:a:rpm", Dimension::Requests, Rule::Rolling, 60.0, 60, 0.0);
        let ahead = [queued("b", JobClass::Standard, 100.0)];
        let eta = forecast(&[own], &ahead, &[], work("a", 1.0)).unwrap();
        assert_eq!(secs_from_now(eta.p50), 2.0);
    }

    #[test]
    fn a_spent_daily_window_waits_for_its_reset() {
        let mut daily = bucket(
            "tenant:a:budget:daily",
            Dimension::Requests,
            Rule::Fixed,
            10.0,
            86_400,
            0.0,
        );
        daily.resets_at = Some(now() + Duration::hours(12));
        // 25 requests need the next window and two more.
        let eta = forecast(
            &[daily],
            &[queued("a", JobClass::Standard, 24.0)],
            &[],
            work("a", 1.0),
        )
        .unwrap();
        assert_eq!(secs_from_now(eta.p50), 12.0 * 3600.0 + 2.0 * 86_400.0 + 1.0);
        // The resets are the calendar's: the record does not stretch them (only the call).
        assert_eq!(
            secs_from_now(eta.p90),
            12.0 * 3600.0 + 2.0 * 86_400.0 + LATENCY.p90
        );
    }

    #[test]
    fn a_concurrency_gauge_serves_as_calls_end() {
        let gauge = bucket(
            "oai:m:concurrency",
            Dimension::Concurrency,
            Rule::Gauge,
            2.0,
            0,
            0.0,
        );
        // 4 ahead + this one, 2 at a time, 1 s each: 2.5 s before it starts.
        let eta = forecast(
            &[gauge],
            &[queued("a", JobClass::Standard, 4.0)],
            &[],
            work("a", 1.0),
        )
        .unwrap();
        assert_eq!(secs_from_now(eta.p50), 3.5);
    }

    #[test]
    fn work_larger_than_a_bucket_never_finishes() {
        let tpm = bucket(
            "oai:m:tpm",
            Dimension::TotalTokens,
            Rule::Rolling,
            100.0,
            60,
            100.0,
        );
        assert_eq!(forecast(&[tpm], &[], &[], work("a", 1.0)), None);
    }

    #[test]
    fn the_record_sets_the_stretch_within_its_range() {
        assert_eq!(overrun(5, Some(3.0)), UNRECORDED_OVERRUN);
        assert_eq!(overrun(100, Some(1.3)), 1.3);
        assert_eq!(overrun(100, Some(0.5)), OVERRUN_RANGE.0);
        assert_eq!(overrun(100, Some(40.0)), OVERRUN_RANGE.1);
    }
}
