//! One LISTEN connection per process, fanned out to whoever waits: long-polls wait for a
//! job to finish, idle dispatchers wait for admitted work, the gate waits for queued work
//! or freed capacity. A finished job wakes only the long-polls of that job ([`JobWatch`],
//! kept by job id), so a burst of completions — a 50,000-line batch cancelled at once —
//! costs a lookup per job, not a re-read by every poller. Notifications are hints; every
//! waiter re-reads the database after waking, so a lost notification (the listener
//! reconnecting) costs latency, never correctness — and after a reconnect everyone is
//! woken to re-check. A job that ends in this process's completer also hands its end to
//! the watches of it here ([`Notifications::jobs_ended_here`]): a synchronous caller
//! answers from it without reading the row back. While the completer writes an outcome,
//! the notification that write commits is held back from the job's watches until the
//! completer has handed them the end ([`Notifications::writing_outcomes`]): otherwise it
//! often came first and sent the caller to read the row it was about to be given.
//! A call that ends the job hands its end to the job's watches here as soon as it returns,
//! before its outcome is written ([`Notifications::answer_early`]): a synchronous caller
//! does not wait for the record of its answer. Until that record commits, every other
//! API request to this process waits for it first ([`Notifications::answers_recorded`]), so a
//! caller who reads (or cancels) what it was just answered finds it written.
//! A finished job wakes the gate only through [`Notifications::capacity_ready`], which the
//! gate heeds at once only while work is queued.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::attempt::End;
use crate::model::JobId;
use crate::store::{CHANNEL_CONTROL, CHANNEL_GATE, CHANNEL_JOB_DONE, CHANNEL_JOBS_READY};

/// Most one NOTIFY per this period announces local inserts to the gate.
const ANNOUNCE_EVERY: Duration = Duration::from_millis(2);

/// Each job's watches: (the watch's token, its wake-up).
type ByJob = HashMap<JobId, Vec<(u64, Arc<Watched>)>>;

/// One watch's wake-up, and the job's end when this process wrote it.
#[derive(Default)]
struct Watched {
    notify: Notify,
    ended: OnceLock<Arc<End>>,
    /// This process's completer is writing the job's outcome: wake-ups wait for its end.
    /// Read and written under [`JobWaiters::lock`].
    writing: AtomicBool,
    /// A wake-up came while the outcome was being written.
    held_back: AtomicBool,
}

impl Watched {
    /// Wakes the watch, or — while its outcome is being written here — marks the wake-up
    /// for the write's end. Call under [`JobWaiters::lock`].
    fn wake(&self) {
        if self.writing.load(Ordering::Relaxed) {
            self.held_back.store(true, Ordering::Relaxed);
        } else {
            self.notify.notify_one();
        }
    }
}

/// The long-polls of this process, by the job each waits for.
#[derive(Default)]
struct JobWaiters {
    next: std::sync::atomic::AtomicU64,
    by_job: Mutex<ByJob>,
}

impl JobWaiters {
    fn lock(&self) -> MutexGuard<'_, ByJob> {
        // A panic elsewhere cannot leave the map half-changed: every change is one call.
        self.by_job
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wake(&self, id: &JobId) {
        if let Some(waiters) = self.lock().get(id) {
            for (_, watched) in waiters {
                watched.wake();
            }
        }
    }

    fn wake_all(&self) {
        for (_, watched) in self.lock().values().flatten() {
            watched.wake();
        }
    }
}

/// Outcomes this process's completer is writing, from [`Notifications::writing_outcomes`]
/// until dropped: their watches' wake-ups are held back meanwhile, and given when dropped.
pub struct OutcomesWriting {
    waiters: Arc<JobWaiters>,
    /// The jobs among them that had watches.
    watched: Vec<JobId>,
}

impl Drop for OutcomesWriting {
    fn drop(&mut self) {
        let by_job = self.waiters.lock();
        for (_, watched) in self.watched.iter().filter_map(|id| by_job.get(id)).flatten() {
            watched.writing.store(false, Ordering::Relaxed);
            if watched.held_back.swap(false, Ordering::Relaxed) {
                watched.notify.notify_one();
            }
        }
    }
}

/// Ends handed to callers here before their outcomes were written, numbered in the order
/// they were handed.
#[derive(Default)]
struct Unrecorded {
    pending: Mutex<Pending>,
    recorded: Notify,
}

/// The next answer's number, and the numbers of those whose outcomes are being written.
#[derive(Default)]
struct Pending {
    next: u64,
    unwritten: BTreeSet<u64>,
}

impl Unrecorded {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// An end handed to a caller before its outcome was written ([`Notifications::answer_early`]),
/// until dropped: drop it once the write is over, whatever came of it.
pub struct AnsweredEarly {
    unrecorded: Arc<Unrecorded>,
    order: u64,
}

impl Drop for AnsweredEarly {
    fn drop(&mut self) {
        self.unrecorded.pending().unwritten.remove(&self.order);
        self.unrecorded.recorded.notify_waiters();
    }
}

/// One long-poll's interest in one job, until dropped: [`JobWatch::changed`] resolves
/// when the job may have finished (its notification, or a listener reconnect after which
/// anything may have been missed). A wake-up between registering and waiting is kept.
pub struct JobWatch {
    waiters: Arc<JobWaiters>,
    id: JobId,
    token: u64,
    watched: Arc<Watched>,
}

impl JobWatch {
    pub async fn changed(&self) {
        self.watched.notify.notified().await;
    }

    /// How the job ended, when it ended in this process's completer (committed): what its
    /// row now says, without reading it.
    pub fn ended(&self) -> Option<Arc<End>> {
        self.watched.ended.get().cloned()
    }
}

impl Drop for JobWatch {
    fn drop(&mut self) {
        let mut by_job = self.waiters.lock();
        if let Some(waiters) = by_job.get_mut(&self.id) {
            waiters.retain(|(token, _)| *token != self.token);
            if waiters.is_empty() {
                by_job.remove(&self.id);
            }
        }
    }
}

/// Gives `end` to the watches of `id` and wakes them.
fn hand_end(waiters: &ByJob, id: JobId, end: &End) {
    if let Some(watches) = waiters.get(&id) {
        let end = Arc::new(end.clone());
        for (_, watched) in watches {
            let _ = watched.ended.set(end.clone());
            watched.notify.notify_one();
        }
    }
}

/// The process's notification hub. Cheap to clone.
#[derive(Clone)]
pub struct Notifications {
    job_waiters: Arc<JobWaiters>,
    /// Answers given here whose outcomes are still being written.
    unrecorded: Arc<Unrecorded>,
    /// Admitted work for dispatchers.
    jobs_ready: Arc<Notify>,
    /// Queued work for the gate.
    gate: Arc<Notify>,
    /// Capacity a finished job may have freed, for the gate.
    freed: Arc<Notify>,
    /// The control plane changed (tenants, keys).
    control: Arc<Notify>,
    /// Local inserts not yet announced to other processes.
    gate_notify_pending: Arc<Notify>,
    /// An interactive job was queued here since the gate last looked: its next round
    /// starts at once instead of after the short pause that lets arrivals gather.
    interactive_pending: Arc<std::sync::atomic::AtomicBool>,
}

impl Default for Notifications {
    fn default() -> Self {
        Self {
            job_waiters: Arc::default(),
            unrecorded: Arc::default(),
            jobs_ready: Arc::new(Notify::new()),
            gate: Arc::new(Notify::new()),
            freed: Arc::new(Notify::new()),
            control: Arc::new(Notify::new()),
            gate_notify_pending: Arc::new(Notify::new()),
            interactive_pending: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }
}

impl Notifications {
    /// Watch `id` before reading the job's state, so no completion falls in between.
    pub fn watch_job(&self, id: JobId) -> JobWatch {
        let token = self
            .job_waiters
            .next
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let watched = Arc::new(Watched::default());
        self.job_waiters
            .lock()
            .entry(id)
            .or_default()
            .push((token, watched.clone()));
        JobWatch {
            waiters: self.job_waiters.clone(),
            id,
            token,
            watched,
        }
    }

    /// Jobs whose final outcome this process has just committed: each watch of one of them
    /// gets its end ([`JobWatch::ended`]) and wakes. Unwatched jobs cost a lookup.
    pub fn jobs_ended_here<'a>(&self, ended: impl IntoIterator<Item = (JobId, &'a End)>) {
        let waiters = self.job_waiters.lock();
        if waiters.is_empty() {
            return;
        }
        for (id, end) in ended {
            hand_end(&waiters, id, end);
        }
    }

    /// A job whose call this process has just ended it with `end`, before the outcome is
    /// written: its watches here get the end now. `None` when it has none; else hold the
    /// guard until the write is over — meanwhile other requests here wait for it
    /// ([`Notifications::answers_recorded`]).
    pub fn answer_early(&self, id: JobId, end: &End) -> Option<AnsweredEarly> {
        let waiters = self.job_waiters.lock();
        if !waiters.contains_key(&id) {
            return None;
        }
        // Numbered before the end is handed, so a request its caller sends next waits for it.
        let order = {
            let mut pending = self.unrecorded.pending();
            let order = pending.next;
            pending.next += 1;
            pending.unwritten.insert(order);
            order
        };
        hand_end(&waiters, id, end);
        Some(AnsweredEarly {
            unrecorded: self.unrecorded.clone(),
            order,
        })
    }

    /// Waits until the outcomes of every answer given here so far ([`Notifications::answer_early`])
    /// are written — or for `at_most`, after which the caller goes on without them.
    pub async fn answers_recorded(&self, at_most: Duration) {
        let upto = self.unrecorded.pending().next;
        let wait = async {
            loop {
                let recorded = self.unrecorded.recorded.notified();
                tokio::pin!(recorded);
                recorded.as_mut().enable();
                let written = self
                    .unrecorded
                    .pending()
                    .unwritten
                    .first()
                    .is_none_or(|&first| first >= upto);
                if written {
                    return;
                }
                recorded.await;
            }
        };
        let _ = tokio::time::timeout(at_most, wait).await;
    }

    /// Outcomes of `ids` this process's completer is about to write: until the guard is
    /// dropped — after the write, and after [`Notifications::jobs_ended_here`] for those it
    /// ended — their watches' wake-ups are held back, then given. The notice of a job's end,
    /// committed by that very write, would otherwise often wake its caller before the
    /// completer hands it the end, and send it to read the row. Unwatched jobs cost a lookup.
    pub fn writing_outcomes(&self, ids: impl IntoIterator<Item = JobId>) -> OutcomesWriting {
        let by_job = self.job_waiters.lock();
        let watched: Vec<JobId> = if by_job.is_empty() {
            Vec::new()
        } else {
            ids.into_iter().filter(|id| by_job.contains_key(id)).collect()
        };
        for (_, w) in watched.iter().filter_map(|id| by_job.get(id)).flatten() {
            w.writing.store(true, Ordering::Relaxed);
        }
        drop(by_job);
        OutcomesWriting {
            waiters: self.job_waiters.clone(),
            watched,
        }
    }

    /// A `tollgate_job_done` payload (job ids, comma-separated): wakes the watches of
    /// those jobs, and tells the gate capacity may be free.
    fn jobs_done(&self, payload: &str) {
        for id in payload.split(',').filter_map(|id| id.parse::<JobId>().ok()) {
            self.job_waiters.wake(&id);
        }
        self.capacity_freed();
    }

    /// A finished job may have freed capacity (its reservation's refund, waiting for the
    /// gate to apply it).
    fn capacity_freed(&self) {
        self.freed.notify_waiters();
        self.freed.notify_one();
    }

    /// Resolves when a finished job may have freed capacity; `enable()` it first.
    pub fn capacity_ready(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
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

    /// Resolves when work may have been queued; `enable()` it first.
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

    /// Resolves when the control plane may have changed (`control::Directory` re-reads).
    pub fn control_changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.control.notified()
    }

    fn wake_control(&self) {
        self.control.notify_waiters();
        self.control.notify_one();
    }

    fn wake_all(&self) {
        self.wake_control();
        self.job_waiters.wake_all();
        self.wake_dispatchers();
        self.wake_gate();
        self.capacity_freed();
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
                        Ok(Some(n)) if n.channel() == CHANNEL_JOB_DONE => hub.jobs_done(n.payload()),
                        Ok(Some(n)) if n.channel() == CHANNEL_GATE => hub.wake_gate(),
                        Ok(Some(n)) if n.channel() == CHANNEL_CONTROL => hub.wake_control(),
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
        .listen_all([
            CHANNEL_JOB_DONE,
            CHANNEL_JOBS_READY,
            CHANNEL_GATE,
            CHANNEL_CONTROL,
        ])
        .await?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    fn job(n: u128) -> JobId {
        JobId(uuid::Uuid::from_u128(n))
    }

    fn payload(ids: impl Iterator<Item = u128>) -> String {
        ids.map(|n| job(n).0.to_string()).collect::<Vec<_>>().join(",")
    }

    #[tokio::test]
    async fn a_burst_of_completions_wakes_only_the_watches_of_those_jobs() {
        let hub = Notifications::default();
        let watches: Vec<JobWatch> = (1..=100).map(|n| hub.watch_job(job(n))).collect();
        let twice = hub.watch_job(job(7));
        // A cancelled 50,000-line batch: none of them is watched.
        for chunk in (1_000..51_000).collect::<Vec<u128>>().chunks(200) {
            hub.jobs_done(&payload(chunk.iter().copied()));
        }
        assert!(watches.iter().all(|w| w.changed().now_or_never().is_none()));
        // One of them finishes: its two watches wake (even though they wait only now).
        hub.jobs_done(&payload([7].into_iter()));
        assert!(watches[6].changed().now_or_never().is_some());
        assert!(twice.changed().now_or_never().is_some());
        assert!(watches[5].changed().now_or_never().is_none());
        // After a reconnect anything may have been missed: everyone re-checks.
        hub.wake_all();
        assert!(watches.iter().all(|w| w.changed().now_or_never().is_some()));
    }

    #[test]
    fn a_job_ended_here_hands_its_end_to_its_watches_only() {
        let hub = Notifications::default();
        let (watched, other) = (hub.watch_job(job(1)), hub.watch_job(job(2)));
        let end = End::failed(
            crate::vocab::ReasonCode::ProviderError,
            "the provider answered 500",
        );
        hub.jobs_ended_here([(job(1), &end), (job(3), &end)]);
        assert_eq!(watched.ended().as_deref(), Some(&end));
        assert!(watched.changed().now_or_never().is_some());
        assert_eq!(other.ended(), None);
        assert!(other.changed().now_or_never().is_none());
    }

    #[test]
    fn the_notice_of_an_outcome_written_here_waits_for_its_end() {
        let hub = Notifications::default();
        let (ended, retried, other) = (
            hub.watch_job(job(1)),
            hub.watch_job(job(2)),
            hub.watch_job(job(3)),
        );
        let writing = hub.writing_outcomes([job(1), job(2), job(4)]);
        // The write commits; its notice comes before the completer hands over the end.
        hub.jobs_done(&payload([1, 2, 3].into_iter()));
        assert!(ended.changed().now_or_never().is_none());
        assert!(retried.changed().now_or_never().is_none());
        assert!(
            other.changed().now_or_never().is_some(),
            "a job not written here wakes at once"
        );
        let end = End::failed(
            crate::vocab::ReasonCode::ProviderError,
            "the provider answered 500",
        );
        hub.jobs_ended_here([(job(1), &end)]);
        assert_eq!(ended.ended().as_deref(), Some(&end));
        assert!(ended.changed().now_or_never().is_some());
        // A job the write did not end (cancelled meanwhile, say) still gets its notice.
        assert!(retried.changed().now_or_never().is_none());
        drop(writing);
        assert!(retried.changed().now_or_never().is_some());
        assert_eq!(retried.ended(), None);
        // Once written, notices wake at once again.
        hub.jobs_done(&payload([2].into_iter()));
        assert!(retried.changed().now_or_never().is_some());
    }

    #[tokio::test]
    async fn a_request_after_an_early_answer_waits_for_its_record() {
        let hub = Notifications::default();
        let end = End::failed(
            crate::vocab::ReasonCode::ProviderError,
            "the provider answered 500",
        );
        assert!(
            hub.answer_early(job(1), &end).is_none(),
            "nobody here waits for it"
        );
        let watch = hub.watch_job(job(1));
        let answered = hub.answer_early(job(1), &end).expect("its caller waits here");
        assert_eq!(watch.ended().as_deref(), Some(&end));
        assert!(watch.changed().now_or_never().is_some());
        let mut read = Box::pin(hub.answers_recorded(Duration::from_secs(60)));
        assert!(
            read.as_mut().now_or_never().is_none(),
            "the outcome is still being written"
        );
        // Answers given after the read began are not its to wait for.
        let later = hub.watch_job(job(2));
        let answered_later = hub.answer_early(job(2), &end);
        assert!(answered_later.is_some() && later.ended().is_some());
        drop(answered);
        assert!(read.now_or_never().is_some());
        assert!(
            hub.answers_recorded(Duration::from_secs(60))
                .now_or_never()
                .is_none(),
            "a request begun now waits for the later one"
        );
    }

    #[test]
    fn a_write_without_notices_leaves_its_watches_asleep() {
        let hub = Notifications::default();
        let watch = hub.watch_job(job(1));
        drop(hub.writing_outcomes([job(1)]));
        assert!(watch.changed().now_or_never().is_none());
    }

    #[test]
    fn a_dropped_watch_is_forgotten() {
        let hub = Notifications::default();
        let a = hub.watch_job(job(1));
        let b = hub.watch_job(job(1));
        drop(a);
        assert_eq!(hub.job_waiters.lock()[&job(1)].len(), 1);
        drop(b);
        assert!(hub.job_waiters.lock().is_empty());
    }
}
