//! The dispatcher: runs the provider calls of the jobs the gate admitted, one attempt at a
//! time, and writes each attempt's [`Outcome`] back under the (state, attempt, lease
//! owner) guard. Each concern has its module:
//!
//! - [`execute`]: one attempt — claim (or hand-over) → call → outcome; what follows a
//!   failure is [`tollgate::retry::decide`]'s decision, written as it says.
//! - [`handover`]: jobs this process's gate started here, and the room they may take.
//! - [`completer`]: outcomes written in batches, many per transaction.
//! - [`heartbeat`]: the leases of what runs here, kept while it runs.
//! - [`stream`]: streaming jobs, run for the API process whose client is connected.
//! - [`shutdown`]: stop claiming → drain → write what finished → release the rest.
//!
//! Claims are one short `FOR UPDATE SKIP LOCKED` statement, committed before any provider
//! call; the loop ([`Dispatcher::run`]) claims only into free call slots and wakes on
//! NOTIFY, with a slow poll as the fallback.

mod completer;
mod execute;
mod handover;
mod heartbeat;
mod shutdown;
mod stream;

pub use handover::Handoff;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::clock::Clock;
use tollgate::config::Config;
use tollgate::model::{Job, JobId};
use tollgate::notify::Notifications;
use tollgate::retry::RetryPolicy;
use tollgate::store::{self, StoreError};

use crate::providers::Providers;

/// One process's dispatcher. Cheap to clone; clones share the slots and the identity.
#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    config: Arc<Config>,
    providers: Providers,
    notifications: Notifications,
    policy: RetryPolicy,
    /// The time outcomes, retries and deadline checks are reckoned in (leases are the
    /// database's `now()`).
    clock: Clock,
    /// Identity written as `lease_owner`; unique per process start.
    owner: String,
    /// One permit per provider call this process may have in flight.
    slots: Arc<Semaphore>,
    /// While `run` runs: the completer, which writes outcomes in batches.
    completer: std::sync::Mutex<Option<mpsc::Sender<completer::Pending>>>,
    /// Jobs whose attempt runs in this process now: the heartbeat extends only their
    /// leases, so a job whose outcome could not be written is rescued, not held forever,
    /// and stops the call of one it no longer holds ([`heartbeat`]).
    in_flight: std::sync::Mutex<std::collections::HashMap<JobId, heartbeat::InFlight>>,
    /// Pauses this process wrote itself, by scope (a rejected key, a rate-limited target),
    /// until when: jobs admitted or handed over before the gate saw them go back to the
    /// queue instead of meeting the same 401 or 429 (claims skip paused targets already).
    paused_here: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
    /// Jobs the gate of this process started for this dispatcher ([`Dispatcher::handoff`]),
    /// until `run` takes the receiver.
    handed: std::sync::Mutex<Option<mpsc::UnboundedReceiver<handover::Handed>>>,
    handed_tx: mpsc::UnboundedSender<handover::Handed>,
    /// Room for handed-over jobs, resized to the rate of calls served (see [`handover`]).
    room: Arc<Semaphore>,
    /// Calls the providers served (a success), for the room's size.
    served: std::sync::atomic::AtomicU64,
}

/// What a step of the dispatcher did, for tests and logs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub claimed: usize,
}

impl Dispatcher {
    pub fn new(
        pool: PgPool,
        config: Arc<Config>,
        providers: Providers,
        notifications: Notifications,
    ) -> Self {
        Self::with_clock(pool, config, providers, notifications, Clock::system())
    }

    /// [`Dispatcher::new`] reckoning time by `clock` (a broker's: the database's).
    pub fn with_clock(
        pool: PgPool,
        config: Arc<Config>,
        providers: Providers,
        notifications: Notifications,
        clock: Clock,
    ) -> Self {
        let owner = format!(
            "dispatch-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7().simple()
        );
        let (handed_tx, handed) = mpsc::unbounded_channel();
        Self {
            inner: Arc::new(Inner {
                slots: Arc::new(Semaphore::new(config.dispatch.concurrency)),
                room: Arc::new(Semaphore::new(handover::start_room(config.dispatch.concurrency))),
                served: std::sync::atomic::AtomicU64::new(0),
                policy: RetryPolicy::from(config.as_ref()),
                clock,
                pool,
                config,
                providers,
                notifications,
                owner,
                completer: std::sync::Mutex::new(None),
                paused_here: std::sync::Mutex::new(std::collections::HashMap::new()),
                in_flight: std::sync::Mutex::new(std::collections::HashMap::new()),
                handed: std::sync::Mutex::new(Some(handed)),
                handed_tx,
            }),
        }
    }

    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// Claims what fits in the free slots and runs those calls to completion. Tests drive
    /// the dispatcher with this instead of the loop.
    pub async fn run_once(&self) -> Result<Step, StoreError> {
        let free = self.inner.slots.available_permits();
        let jobs = self.claim(free).await?;
        let claimed = jobs.len();
        futures::future::join_all(jobs.into_iter().map(|job| self.execute(job, Via::Claim))).await;
        Ok(Step { claimed })
    }

    async fn claim(&self, n: usize) -> Result<Vec<Job>, StoreError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        store::claim_jobs(
            &self.inner.pool,
            &self.inner.owner,
            n as i64,
            self.inner.clock.now(),
            self.inner.config.dispatch.lease(),
        )
        .await
    }

    /// The loop: claim into free slots, run each call as its own task, wake on NOTIFY or
    /// the fallback poll. Returns after the shutdown sequence when `cancel` fires.
    pub async fn run(self, cancel: CancellationToken) {
        let in_flight = TaskTracker::new();
        let heartbeat = self.spawn_heartbeat();
        let completer = self.spawn_completer();
        let handed = self.spawn_handed(&in_flight, cancel.clone());
        let poll = Duration::from_millis(self.inner.config.dispatch.poll_interval_ms);
        let mut db_backoff = Duration::from_millis(100);
        while !cancel.is_cancelled() {
            // Wait for a free slot before claiming, so claims never outrun capacity.
            let permit = tokio::select! {
                _ = cancel.cancelled() => break,
                p = self.inner.slots.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            // Every slot a claim may fill is taken before it: the gate may take free slots
            // for the jobs it starts here at any moment.
            let mut permits = vec![permit];
            permits.extend(std::iter::from_fn(|| {
                self.inner.slots.clone().try_acquire_owned().ok()
            }));
            let free = permits.len();
            // Register interest before claiming so a NOTIFY during the claim is not lost.
            let ready = self.inner.notifications.jobs_ready();
            tokio::pin!(ready);
            ready.as_mut().enable();
            let jobs = match self.claim(free).await {
                Ok(jobs) => {
                    db_backoff = Duration::from_millis(100);
                    jobs
                }
                Err(e) => {
                    drop(permits);
                    tracing::warn!(error = %e, "claim failed; backing off");
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(with_jitter(db_backoff)) => {}
                    }
                    db_backoff = (db_backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            let full = jobs.len() == free;
            // Slots left over go back when `permits` drops.
            for (job, permit) in jobs.into_iter().zip(permits.drain(..)) {
                self.spawn_execute(&in_flight, job, Via::Claim, vec![permit]);
            }
            drop(permits);
            if full {
                continue; // more may be waiting: claim again as soon as a slot frees
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = &mut ready => {}
                _ = tokio::time::sleep(poll) => {}
            }
        }
        // Nothing handed over after this is run: the shutdown releases its lease.
        handed.wait().await;
        self.shutdown(in_flight, heartbeat, completer).await;
    }
}

/// How a job came to run here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    /// Claimed just before its call.
    Claim,
    /// Started by this process's gate and handed over; `held`: still this process's when
    /// its slot came (one that waited for a slot may have been cancelled meanwhile, and is
    /// checked: [`handover`]).
    Handover { held: bool },
}

/// A backoff plus a little at random, so processes that met the same error do not all
/// try again in the same instant.
fn with_jitter(backoff: Duration) -> Duration {
    tollgate::retry::spread(backoff, rand::random())
}

/// Locks a mutex whose data stays valid even if a holder panicked.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Logs a write of a job's state that failed (the lease's expiry retries the job).
fn log_write(r: Result<bool, StoreError>) {
    if let Err(e) = r {
        tracing::warn!(error = %e, "could not write the job's state");
    }
}
