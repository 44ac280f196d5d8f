//! One LISTEN connection per process, fanned out to whoever waits: long-polls wait for a
//! job to finish, idle dispatchers wait for admitted work, the gate waits for queued work
//! or freed capacity. Notifications are hints; every
//! waiter re-reads the database after waking, so a lost notification (the listener
//! reconnecting) costs latency, never correctness — and after a reconnect everyone is
//! woken to re-check.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, broadcast};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::model::JobId;
use crate::store::{CHANNEL_GATE, CHANNEL_JOB_DONE, CHANNEL_JOBS_READY};

/// Most one NOTIFY per this period announces local inserts to the gate.
const ANNOUNCE_EVERY: Duration = Duration::from_millis(2);

/// A wake-up for job waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobDone {
    /// This job reached a terminal state.
    Job(JobId),
    /// Notifications may have been missed: every waiter re-checks.
    All,
}

/// The process's notification hub. Cheap to clone.
#[derive(Clone)]
pub struct Notifications {
    job_done: broadcast::Sender<JobDone>,
    /// Admitted work for dispatchers.
    jobs_ready: Arc<Notify>,
    /// Queued work or freed capacity for the gate.
    gate: Arc<Notify>,
    /// Local inserts not yet announced to other processes.
    gate_notify_pending: Arc<Notify>,
    /// An interactive job was queued here since the gate last looked: its next round
    /// starts at once instead of after the short pause that lets arrivals gather.
    interactive_pending: Arc<std::sync::atomic::AtomicBool>,
}

impl Default for Notifications {
    fn default() -> Self {
        Self {
            job_done: broadcast::channel(8192).0,
            jobs_ready: Arc::new(Notify::new()),
            gate: Arc::new(Notify::new()),
            gate_notify_pending: Arc::new(Notify::new()),
            interactive_pending: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }
}

impl Notifications {
    /// Subscribe before reading the job's state, so no completion falls in between.
    pub fn subscribe_job_done(&self) -> broadcast::Receiver<JobDone> {
        self.job_done.subscribe()
    }

    /// Resolves when new work may be claimable (or at once if a wake-up is pending).
    /// `enable()` it before looking for work so a wake-up in between is not lost.
    pub fn jobs_ready(&self) -> tokio::sync::futures::Notified<'_> {
        self.jobs_ready.notified()
    }

    /// Wakes local dispatchers directly.
    pub fn wake_dispatchers(&self) {
        self.jobs_ready.notify_waiters();
        self.jobs_ready.notify_one();
    }

    /// Resolves when queued work or capacity may have appeared; `enable()` it first.
    pub fn gate_ready(&self) -> tokio::sync::futures::Notified<'_> {
        self.gate.notified()
    }

    /// Wakes the local gate directly.
    pub fn wake_gate(&self) {
        self.gate.notify_waiters();
        self.gate.notify_one();
    }

    /// New work was queued here: wake the local gate now, and the active gate (wherever
    /// it runs) through one NOTIFY per few milliseconds however many jobs arrive.
    pub fn work_queued(&self) {
        self.wake_gate();
        self.gate_notify_pending.notify_one();
    }

    /// [`Notifications::work_queued`] for an interactive job: the local gate does not
    /// wait for more arrivals before its round.
    pub fn interactive_queued(&self) {
        self.interactive_pending
            .store(true, std::sync::atomic::Ordering::Release);
        self.work_queued();
    }

    /// Whether an interactive job was queued here since the last call (and forgets it).
    pub fn take_interactive(&self) -> bool {
        self.interactive_pending
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    fn wake_all(&self) {
        let _ = self.job_done.send(JobDone::All);
        self.wake_dispatchers();
        self.wake_gate();
    }

    /// Starts the announcer: sends the gate's NOTIFY for local inserts, debounced.
    fn spawn_announcer(&self, pool: PgPool, tracker: &TaskTracker, cancel: CancellationToken) {
        let pending = self.gate_notify_pending.clone();
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = pending.notified() => {}
                }
                if let Err(e) = crate::store::notify_gate(&pool).await {
                    tracing::warn!(error = %e, "could not notify the gate; it will poll");
                }
                tokio::time::sleep(ANNOUNCE_EVERY).await;
            }
        });
    }

    /// Starts the listener task (it reconnects with backoff until `cancel`) and the
    /// announcer of local inserts.
    pub fn spawn_listener(&self, pool: PgPool, tracker: &TaskTracker, cancel: CancellationToken) {
        self.spawn_announcer(pool.clone(), tracker, cancel.clone());
        let hub = self.clone();
        tracker.spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                let connected = tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = connect(&pool) => r,
                };
                let mut listener = match connected {
                    Ok(l) => {
                        backoff = Duration::from_millis(100);
                        // Anything sent while we were not listening is lost: re-check all.
                        hub.wake_all();
                        l
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN connection failed; retrying");
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                };
                loop {
                    let next = tokio::select! {
                        _ = cancel.cancelled() => return,
                        n = listener.try_recv() => n,
                    };
                    match next {
                        Ok(Some(n)) if n.channel() == CHANNEL_JOB_DONE => {
                            for id in n.payload().split(',').filter_map(|id| id.parse::<JobId>().ok()) {
                                let _ = hub.job_done.send(JobDone::Job(id));
                            }
                            // A finished job may have freed capacity.
                            hub.wake_gate();
                        }
                        Ok(Some(n)) if n.channel() == CHANNEL_GATE => hub.wake_gate(),
                        Ok(Some(_)) => hub.wake_dispatchers(),
                        Ok(None) => {
                            // Connection lost; try_recv reconnects on the next call.
                            hub.wake_all();
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "LISTEN connection broke; reconnecting");
                            break;
                        }
                    }
                }
            }
        });
    }
}

async fn connect(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener
        .listen_all([CHANNEL_JOB_DONE, CHANNEL_JOBS_READY, CHANNEL_GATE])
        .await?;
    Ok(listener)
}
