//! The gate's rounds run forward job by job: when one job, queued behind what stands before
//! it and beside what arrives meanwhile, is admitted.
//!
//! The fluid of [`super::fair_wait`] serves each tenant its share of the refill as it comes.
//! The gate admits whole jobs: the queue whose turn it is (class, then the smallest virtual
//! time) takes its next job when every bucket can hold the job beyond what it keeps back,
//! and until then the buckets it waits for are closed to everyone behind it. So a tenant
//! whose jobs keep arriving a little slower than the refill, and whose turn comes first,
//! leaves another tenant's larger job waiting for a surplus that builds only while the
//! first has nothing queued — which the fluid hands out at once. Here each queue is a list
//! of jobs of its queue's average size, each arriving stream adds jobs at its rate (the
//! work's own tenant's before the work while they overtake it: [`super::Overtaking`]), and
//! the rounds run from event to event (a job fits, a job arrives, a job's wait passes its
//! class's guard) until the work is admitted. A job past its guard competes as interactive
//! on its own, ahead of the rest of its queue — its own tenant's jobs that the gate serves
//! after the work among them. Each queue starts where the leading gate's lags have it, in
//! its own class and in the interactive class: a tenant the gate has left behind there
//! (its burst credit) is served first once its jobs pass their guard.
//!
//! It runs only where it is exact enough and cheap: one job, a path of rolling buckets
//! that all refill (no fixed windows, gauges or quota pools), and at most [`MOST_JOBS`]
//! queued before it; elsewhere the fluid answers alone.

use std::collections::{HashMap, VecDeque};

use crate::buckets::{self, Bucket};
use crate::model::JobClass;
use crate::scheduler::VirtualTimes;
use crate::vocab::Rule;

use super::{Outlook, Work, seconds, units};
use crate::store::Queued;

/// Most jobs queued on the route that are run through one by one: deeper queues drain as
/// the fluid has it (the gaps whole jobs leave average out), and a forecast stays cheap.
pub const MOST_JOBS: f64 = 1_000.0;
/// Most events a forecast runs through before it gives up for the fluid's answer.
const MOST_STEPS: usize = 5_000;

/// One bucket of the route's path, as the rounds see it.
pub struct Lane<'a> {
    pub bucket: &'a Bucket,
    /// What one unit of the bucket's measure (a job, a token) takes from it.
    pub per_unit: f64,
}

/// A size of job: its amounts at each bucket of the path, and its cost in the fair queuing
/// (estimated tokens).
#[derive(Debug)]
struct Size {
    amounts: Vec<f64>,
    cost: f64,
}

/// A job in the rounds: when it was submitted (seconds from now), and its size (an index
/// into the rounds' sizes).
#[derive(Debug, Clone, Copy)]
struct Job {
    submitted: f64,
    size: usize,
    is_work: bool,
}

/// A tenant's queue of one class: its jobs in the order the gate takes them, and the
/// streams of its jobs arriving.
struct Queue<'a> {
    tenant: &'a str,
    class: JobClass,
    weight: f64,
    jobs: VecDeque<Job>,
    arriving: Vec<Stream>,
    /// No job of it was submitted sooner (a bound: served jobs may have been the oldest).
    oldest: f64,
}

impl Queue<'_> {
    /// Adds `job` at `at` in its order.
    fn insert(&mut self, at: usize, job: Job) {
        self.oldest = self.oldest.min(job.submitted);
        self.jobs.insert(at, job);
    }

    /// Adds `job` last.
    fn push(&mut self, job: Job) {
        self.insert(self.jobs.len(), job);
    }

    /// The place of its first job, in the gate's order, that has waited past `guard` by
    /// `t` (the gate serves it as interactive).
    fn starving(&mut self, guard: f64, t: f64) -> Option<usize> {
        if t < self.oldest + guard {
            return None;
        }
        let found = self.jobs.iter().position(|j| j.submitted + guard <= t);
        if found.is_none() {
            self.oldest = self
                .jobs
                .iter()
                .map(|j| j.submitted)
                .fold(f64::INFINITY, f64::min);
        }
        found
    }
}

/// Jobs of one size arriving evenly: the next (seconds from now) and the time between two;
/// in the work's own queue, until when they go before it (after, they go behind it and
/// are left out: the stream ends).
#[derive(Debug, Clone, Copy)]
struct Stream {
    next: f64,
    every: f64,
    size: usize,
    until: f64,
}

/// Seconds until the gate admits `work` (one job, or none: a job queued already, the last
/// of its tenant's queue ahead) on a path of `lanes`, or `None` when the rounds do not
/// apply (see the module's doc) and the fluid answers.
pub fn admitted_in(lanes: &[Lane<'_>], work: &Work<'_>, outlook: &Outlook<'_>) -> Option<f64> {
    let eligible = work.jobs <= 1.0
        && lanes.iter().all(|l| {
            l.bucket.rule == Rule::Rolling
                && l.bucket.rate() > 0.0
                && buckets::pool_bucket_siblings(&l.bucket.key).is_none()
        })
        && outlook
            .ahead
            .iter()
            .chain(outlook.behind)
            .map(|q| q.jobs)
            .sum::<f64>()
            <= MOST_JOBS;
    if !eligible {
        return None;
    }
    let (mut queues, sizes) = queues(lanes, work, outlook);
    let mut levels: Vec<f64> = lanes.iter().map(|l| l.bucket.level).collect();
    // Each queue starts where the gate's lags have it, in its class and in the interactive
    // class, where its jobs past their guard compete.
    let mut times = VirtualTimes::behind(queues.iter().flat_map(|q| {
        [q.class, JobClass::Interactive]
            .into_iter()
            .filter_map(|class| Some((class, q.tenant, (outlook.lag_of)(class, q.tenant)?)))
    }));
    let mut t = 0.0_f64;
    for _ in 0..MOST_STEPS {
        for q in &mut queues {
            let mut arriving = std::mem::take(&mut q.arriving);
            for stream in &mut arriving {
                while stream.next <= t && stream.next < stream.until {
                    let job = Job {
                        submitted: stream.next,
                        size: stream.size,
                        is_work: false,
                    };
                    // Before the work, when it is in this queue.
                    let at = q.jobs.iter().rposition(|j| j.is_work).unwrap_or(q.jobs.len());
                    q.insert(at, job);
                    stream.next += stream.every;
                }
            }
            arriving.retain(|s| s.next < s.until);
            q.arriving = arriving;
        }
        // Whose turn: the best class, then the smallest virtual time. A queue with a job
        // past its guard serves that job, as interactive; else its first.
        let turn = queues
            .iter_mut()
            .enumerate()
            .filter_map(|(i, q)| {
                if q.jobs.is_empty() {
                    return None;
                }
                let starving = (outlook.starve_after)(q.class).and_then(|guard| q.starving(guard, t));
                let (class, at) = starving.map_or((q.class, 0), |at| (JobClass::Interactive, at));
                let vtime = times.turn_starts(class, q.tenant, q.weight, outlook.burst_credit);
                Some((class, vtime, i, at))
            })
            .min_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)))?;
        let (class, vtime, i, at) = turn;
        let head = &sizes[queues[i].jobs.get(at)?.size];
        // When every bucket holds the head job beyond what it keeps back from its class.
        let fits_in = lanes
            .iter()
            .zip(&levels)
            .zip(&head.amounts)
            .map(|((lane, level), amount)| {
                let b = lane.bucket;
                let needed = amount + b.kept(*amount, (outlook.kept)(b, class));
                ((needed - level) / b.rate()).max(0.0)
            })
            .fold(0.0_f64, f64::max);
        // What could change whose turn it is before then: an arrival, or the first job of
        // a queue whose wait passes its guard.
        let changes_at = queues
            .iter()
            .flat_map(|q| {
                let arrivals = q.arriving.iter().map(|s| s.next);
                let starving = (outlook.starve_after)(q.class)
                    .map(|guard| q.oldest + guard)
                    .filter(|at| *at > t);
                arrivals.chain(starving)
            })
            .fold(f64::INFINITY, f64::min);
        let changes_first = changes_at <= t + fits_in;
        let next = if changes_first { changes_at } else { t + fits_in };
        for (lane, level) in lanes.iter().zip(&mut levels) {
            *level = (*level + (next - t) * lane.bucket.rate()).min(lane.bucket.capacity);
        }
        t = next;
        if changes_first {
            // Whose turn it is may have changed: the rounds look again.
            continue;
        }
        let Some(job) = queues[i].jobs.remove(at) else {
            continue;
        };
        if job.is_work {
            return Some(t);
        }
        let size = &sizes[job.size];
        for (level, amount) in levels.iter_mut().zip(&size.amounts) {
            *level -= amount;
        }
        let q = &queues[i];
        times.served(class, q.tenant, vtime, size.cost / q.weight);
    }
    None
}

/// The queues the rounds serve, and the sizes of their jobs: every (class, tenant) queued
/// ahead or arriving on the route, their jobs of their average size (their submissions
/// spread evenly from the first to the last), the work after its own tenant's jobs ahead
/// of it and before those served after it (they pass it only once they starve).
fn queues<'a>(lanes: &[Lane<'_>], work: &Work<'a>, outlook: &Outlook<'a>) -> (Vec<Queue<'a>>, Vec<Size>) {
    let mut sizes: Vec<Size> = Vec::new();
    // The size of one of `jobs` with `input` and `output` tokens together.
    let mut size_of = |tenant: &str, jobs: f64, input: f64, output: f64| {
        let per_job = |v: f64| if jobs > 0.0 { v / jobs } else { 0.0 };
        let amounts = lanes
            .iter()
            .map(|l| {
                if buckets::is_tenant_held(&l.bucket.key) && tenant != work.tenant {
                    return 0.0;
                }
                let amount = l.per_unit * units(l.bucket.dimension, 1.0, per_job(input), per_job(output));
                amount.min(l.bucket.capacity)
            })
            .collect();
        sizes.push(Size {
            amounts,
            cost: (per_job(input) + per_job(output)).max(1.0),
        });
        sizes.len() - 1
    };
    let mut queues: Vec<Queue<'a>> = Vec::new();
    let queue_of = |queues: &mut Vec<Queue<'a>>, class: JobClass, tenant: &'a str| -> usize {
        if let Some(i) = queues.iter().position(|q| q.class == class && q.tenant == tenant) {
            return i;
        }
        let weight = if tenant == work.tenant {
            work.weight
        } else {
            (outlook.weight_of)(tenant)
        };
        queues.push(Queue {
            tenant,
            class,
            weight: weight.max(1e-9),
            jobs: VecDeque::new(),
            arriving: Vec::new(),
            oldest: f64::INFINITY,
        });
        queues.len() - 1
    };
    // The jobs of `q`, of its average size, submitted evenly from its first to its last.
    let now = outlook.now;
    let spread = |q: &Queued, size: usize| {
        let n = q.jobs.round().max(0.0) as usize;
        let (first, last) = (seconds(q.oldest - now), seconds(q.newest - now));
        (0..n).map(move |k| Job {
            submitted: first + (last - first) * if n > 1 { k as f64 / (n - 1) as f64 } else { 0.0 },
            size,
            is_work: false,
        })
    };
    for q in outlook.ahead {
        let i = queue_of(&mut queues, q.class, q.tenant.as_str());
        let size = size_of(&q.tenant, q.jobs, q.input_tokens, q.output_tokens);
        queues[i].jobs.extend(spread(q, size));
    }
    for q in &mut queues {
        q.jobs
            .make_contiguous()
            .sort_by(|a, b| a.submitted.total_cmp(&b.submitted));
        q.oldest = q.jobs.front().map_or(f64::INFINITY, |j| j.submitted);
    }
    if work.jobs > 0.0 {
        let i = queue_of(&mut queues, work.class, work.tenant);
        let size = size_of(work.tenant, 1.0, work.input_tokens, work.output_tokens);
        queues[i].push(Job {
            submitted: 0.0,
            size,
            is_work: true,
        });
    } else if let Some(last) = queues
        .iter_mut()
        .find(|q| q.class == work.class && q.tenant == work.tenant)
        .and_then(|q| q.jobs.back_mut())
    {
        // A job queued already: the last of its tenant's queue ahead.
        last.is_work = true;
    }
    // Its own tenant's jobs served after it, in the order they came.
    let mut behind: Vec<Job> = Vec::new();
    for q in outlook.behind {
        let size = size_of(&q.tenant, q.jobs, q.input_tokens, q.output_tokens);
        behind.extend(spread(q, size));
    }
    if !behind.is_empty() {
        behind.sort_by(|a, b| a.submitted.total_cmp(&b.submitted));
        let i = queue_of(&mut queues, work.class, work.tenant);
        for job in behind {
            queues[i].push(job);
        }
    }
    // What arrives, per second, by class and tenant (of any model the route serves).
    let mut arriving: HashMap<(JobClass, &'a str), (f64, f64, f64)> = HashMap::new();
    for a in outlook.arriving {
        if a.tenant != work.tenant || a.class != work.class {
            let rate = arriving.entry((a.class, a.tenant.as_str())).or_default();
            *rate = (rate.0 + a.jobs, rate.1 + a.input_tokens, rate.2 + a.output_tokens);
        }
    }
    let own = outlook.overtaking.iter().map(|o| {
        (
            (work.class, work.tenant),
            (o.jobs, o.input_tokens, o.output_tokens),
            o.until,
        )
    });
    let others = arriving
        .into_iter()
        .map(|(queue, rates)| (queue, rates, f64::INFINITY));
    for ((class, tenant), (jobs, input, output), until) in others.chain(own) {
        if jobs > 0.0 {
            let i = queue_of(&mut queues, class, tenant);
            // Evenly spaced, the first half a gap from now.
            let every = 1.0 / jobs;
            queues[i].arriving.push(Stream {
                next: every / 2.0,
                every,
                size: size_of(tenant, jobs, input, output),
                until,
            });
        }
    }
    (queues, sizes)
}
