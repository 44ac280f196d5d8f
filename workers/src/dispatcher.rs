//! The dispatcher: claims admitted jobs (one short `FOR UPDATE SKIP LOCKED` statement,
//! committed before any provider call), calls the provider with the key the gate chose,
//! and writes the outcome back under the (state, attempt, lease owner) guard — through a
//! completer that writes many outcomes, attempt records and settlements per transaction.
//! Failures are retried with backoff while attempts and the deadline allow; a provider's
//! 429 also pauses its target for every process. A heartbeat extends the leases of what is
//! in flight; on shutdown it stops claiming, lets in-flight calls finish up to a soft
//! timeout, writes what finished, and releases the leases of the rest. Streaming jobs are
//! run here too, for the API process whose client is connected ([`Dispatcher::stream`]).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sqlx::PgPool;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::buckets;
use tollgate::config::Config;
use tollgate::gate::Handoff;
use tollgate::model::{Job, JobId, Usage};
use tollgate::notify::Notifications;
use tollgate::retry::{Failure, FailureClass, RetryPolicy};
use tollgate::routing::{self, Target};
use tollgate::store::{
    self, AttemptRecord, Finish, Holder, Observation, Outcome, Pause, Served, Settlement, StoreError,
};
use tracing::Instrument;

use crate::providers::{CallOutcome, Providers};

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
    /// Identity written as `lease_owner`; unique per process start.
    owner: String,
    /// One permit per provider call this process may have in flight.
    slots: Arc<Semaphore>,
    /// While `run` runs: the completer, which writes outcomes in batches.
    completer: std::sync::Mutex<Option<mpsc::Sender<Pending>>>,
    /// Jobs whose attempt runs in this process now: the heartbeat extends only their
    /// leases, so a job whose outcome could not be written is rescued, not held forever.
    in_flight: std::sync::Mutex<std::collections::HashSet<JobId>>,
    /// Pauses this process wrote itself, by scope (a rejected key, a rate-limited target),
    /// until when: jobs admitted or handed over before the gate saw them go back to the
    /// queue instead of meeting the same 401 or 429 (claims skip paused targets already).
    paused_here: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
    /// Jobs the gate of this process started for this dispatcher ([`Dispatcher::handoff`]),
    /// until `run` takes the receiver.
    handed: std::sync::Mutex<Option<mpsc::UnboundedReceiver<Handed>>>,
    handed_tx: mpsc::UnboundedSender<Handed>,
    /// Room for handed-over jobs, resized to the rate of calls served ([`HANDOFF_HORIZON`]).
    room: Arc<Semaphore>,
    /// Calls the providers served (a success), for the room's size.
    served: std::sync::atomic::AtomicU64,
}

/// A job the gate admitted straight to running here, with the room it holds.
type Handed = (Job, tokio::sync::OwnedSemaphorePermit);

/// Room for handed-over jobs (running or waiting for a slot) is what this process's
/// providers serve in this long, at the rate they have been serving its calls, on top of
/// one per slot: the gate runs ahead of the provider calls by about that much, so a job
/// waits here about that long at most, and one process does not hoard work other processes
/// could send. Calls served, not calls made: a storm of 429s does not widen the room (a
/// provider whose limit is not known yet meets no more calls than before it). Every
/// job the gate admits beyond the room costs a claim (one more write of its row): at
/// 100,000 jobs a fixed 8 per slot left a fifth of them to claims, a room sized to the
/// rate 1–8 %, for 3–24 % more jobs/s (BENCHMARKS.md, session 7).
const HANDOFF_HORIZON: Duration = Duration::from_millis(200);
/// Bounds of the room, per slot; a dispatcher starts at 8.
const MIN_ROOM_PER_SLOT: usize = 2;
const START_ROOM_PER_SLOT: usize = 8;
const MAX_ROOM_PER_SLOT: usize = 32;
/// How often the room is resized to the rate of calls served.
const ROOM_REVIEW: Duration = Duration::from_millis(250);

/// The room for `slots` call slots whose providers serve `served_per_sec` calls a second.
fn room_for(slots: usize, served_per_sec: f64) -> usize {
    let ahead = (served_per_sec.max(0.0) * HANDOFF_HORIZON.as_secs_f64()).ceil() as usize;
    (slots + ahead).clamp(slots * MIN_ROOM_PER_SLOT, slots * MAX_ROOM_PER_SLOT)
}

/// A handed-over job waiting for a slot; the greatest runs first.
struct Waiting {
    job: Job,
    room: tokio::sync::OwnedSemaphorePermit,
    order: u64,
}

impl Waiting {
    fn rank(&self) -> impl Ord {
        // Best class first, then highest priority, then first handed over.
        std::cmp::Reverse((self.job.class, std::cmp::Reverse(self.job.priority), self.order))
    }
}

impl PartialEq for Waiting {
    fn eq(&self, other: &Self) -> bool {
        self.order == other.order
    }
}
impl Eq for Waiting {}
impl PartialOrd for Waiting {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiting {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.rank().cmp(&other.rank())
    }
}

/// An outcome waiting for the completer, with where to report whether it was written.
type Pending = (Outcome, oneshot::Sender<Result<bool, StoreError>>);

tokio::task_local! {
    /// The slot (`dispatch.concurrency`) of the call this task makes. Given back when the
    /// call's outcome is handed to the completer: the slot bounds calls in flight to
    /// providers, and holding it through the completer's commit as well made every slot
    /// wait on a disk flush (throughput = slots ÷ commit latency).
    /// (With a job the gate handed over, also its room: see [`Handoff`].)
    static SLOT: std::cell::RefCell<Vec<tokio::sync::OwnedSemaphorePermit>>;
}

/// How long a 429 without a Retry-After pauses its target.
const DEFAULT_PAUSE: Duration = Duration::from_secs(1);

/// Most outcomes the completer writes in one transaction.
const COMPLETION_BATCH: usize = 256;
/// Completer tasks writing batches of outcomes side by side.
const COMPLETERS: usize = 2;
/// How long a completer waits for more outcomes after the first before writing: at a
/// moderate rate each batch is then a few jobs larger (every batch is a transaction of
/// half a dozen statements), and a result appears that much later.
const COMPLETION_GATHER: Duration = Duration::from_millis(2);
/// How long provider observations gather before they are written: they are advice for
/// the gate, and a statement per outcome batch was one in twenty under a steady load.
const OBSERVATION_GATHER: Duration = Duration::from_millis(100);

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
        let owner = format!(
            "dispatch-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7().simple()
        );
        let (handed_tx, handed) = mpsc::unbounded_channel();
        Self {
            inner: Arc::new(Inner {
                slots: Arc::new(Semaphore::new(config.dispatch.concurrency)),
                room: Arc::new(Semaphore::new(config.dispatch.concurrency * START_ROOM_PER_SLOT)),
                served: std::sync::atomic::AtomicU64::new(0),
                policy: RetryPolicy::from(&config.retry),
                pool,
                config,
                providers,
                notifications,
                owner,
                completer: std::sync::Mutex::new(None),
                paused_here: std::sync::Mutex::new(std::collections::HashMap::new()),
                in_flight: std::sync::Mutex::new(std::collections::HashSet::new()),
                handed: std::sync::Mutex::new(Some(handed)),
                handed_tx,
            }),
        }
    }

    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// The way for this process's gate to start admitted jobs here ([`Handoff`]). Jobs
    /// handed over are run by [`Dispatcher::run`]; without it running, none are handed.
    pub fn handoff(&self) -> Handoff {
        Handoff {
            owner: self.inner.owner.clone(),
            lease: self.inner.config.dispatch.lease(),
            room: self.inner.room.clone(),
            jobs: self.inner.handed_tx.clone(),
        }
    }

    /// Writes an attempt's outcome: through the completer while the loop runs (many
    /// outcomes per transaction), directly otherwise.
    async fn finish(
        &self,
        holder: Holder<'_>,
        served: Option<Served<'_>>,
        finish: Finish<'_>,
        settlement: Settlement,
        record: Option<&AttemptRecord>,
        now: chrono::DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        self.write(
            Outcome::new(holder, served, finish, settlement, record.cloned()),
            now,
        )
        .await
    }

    /// Marks `id` in flight here until the returned guard drops.
    fn track(&self, id: JobId) -> Tracked {
        lock(&self.inner.in_flight).insert(id);
        Tracked {
            inner: self.inner.clone(),
            id,
        }
    }

    async fn write(&self, outcome: Outcome, now: chrono::DateTime<Utc>) -> Result<bool, StoreError> {
        let completer = match self.inner.completer.lock() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let outcome = match completer {
            Some(completer) => {
                let (reply, written) = oneshot::channel();
                let sent = completer.send((outcome, reply)).await;
                // The call is over: its slot may take the next one while this outcome waits
                // for its commit (the task still tracks the job, so its lease is kept).
                let _ = SLOT.try_with(|slot| slot.borrow_mut().clear());
                match sent {
                    // The completer answers every outcome it takes; no answer means it
                    // stopped mid-batch, and the lease's expiry will retry the job.
                    Ok(()) => {
                        return written.await.unwrap_or_else(|_| {
                            Err(StoreError::Database(sqlx::Error::Protocol(
                                "the completer stopped before writing the outcome".into(),
                            )))
                        });
                    }
                    // The completer has stopped (shutdown): write it here.
                    Err(mpsc::error::SendError((outcome, _))) => outcome,
                }
            }
            None => outcome,
        };
        let observed: Vec<&Observation> = outcome.observation.iter().collect();
        let written = store::finish_attempts(&self.inner.pool, std::slice::from_ref(&outcome), now)
            .await?
            .first()
            .copied()
            .unwrap_or(false);
        if !observed.is_empty() {
            store::record_observations(&self.inner.pool, &observed).await?;
        }
        Ok(written)
    }

    /// The completer: takes the outcomes that arrive within [`COMPLETION_GATHER`] of the
    /// first (up to [`COMPLETION_BATCH`]) and writes them in one transaction, until every
    /// sender is gone.
    ///
    /// [`COMPLETERS`] of them share the queue: while one waits for its commit to reach
    /// the disk, the next gathers and writes the following batch. Their batches hold
    /// disjoint jobs (each outcome is taken once), so they never wait on each other's rows.
    async fn complete(
        self,
        outcomes: Arc<tokio::sync::Mutex<mpsc::Receiver<Pending>>>,
        observer: mpsc::Sender<Observation>,
    ) {
        loop {
            let batch = {
                let mut outcomes = outcomes.lock().await;
                let Some(first) = outcomes.recv().await else {
                    return;
                };
                let mut batch = vec![first];
                let gathered = tokio::time::sleep(COMPLETION_GATHER);
                tokio::pin!(gathered);
                while batch.len() < COMPLETION_BATCH {
                    tokio::select! {
                        biased;
                        p = outcomes.recv() => match p {
                            Some(p) => batch.push(p),
                            None => break,
                        },
                        _ = &mut gathered => break,
                    }
                }
                batch
            };
            let (items, replies): (Vec<Outcome>, Vec<_>) = batch.into_iter().unzip();
            let pool = &self.inner.pool;
            // A lost race (deadlock victim, serialization failure) succeeds when tried again;
            // so does a write while the database restarts. Retried with backoff while the
            // leases (kept by the heartbeat) could still hold: after that the rescuer owns
            // the jobs and the guarded write would be refused anyway.
            let give_up = tokio::time::Instant::now() + self.inner.config.dispatch.lease();
            let mut backoff = Duration::from_millis(50);
            let written = loop {
                match store::finish_attempts(pool, &items, Utc::now()).await {
                    Err(e) if tokio::time::Instant::now() + backoff < give_up => {
                        tracing::warn!(error = %e, batch = items.len(), "writing outcomes failed; retrying");
                        tokio::time::sleep(with_jitter(backoff)).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    written => break written,
                }
            };
            match written {
                Ok(written) => {
                    for (reply, w) in replies.into_iter().zip(written) {
                        let _ = reply.send(Ok(w));
                    }
                    // Off the completer's path: what providers said is advice, not an
                    // outcome; dropped when the observer is behind.
                    for o in items.into_iter().filter_map(|o| o.observation) {
                        let _ = observer.try_send(o);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, batch = items.len(), "could not write a batch of outcomes");
                    for reply in replies {
                        let _ = reply.send(Err(StoreError::Database(sqlx::Error::Protocol(
                            "the outcome batch failed; see the log".into(),
                        ))));
                    }
                }
            }
        }
    }

    /// Records what providers said about their limits, every [`OBSERVATION_GATHER`] while
    /// they come, many per statement, until the completers (its only senders) are gone.
    async fn observe(self, mut observations: mpsc::Receiver<Observation>) {
        while let Some(first) = observations.recv().await {
            let mut batch = vec![first];
            // Gathered without holding up anything (the completers only try to send), and
            // all taken at once: they are written one row per scope and limit.
            tokio::time::sleep(OBSERVATION_GATHER).await;
            while let Ok(o) = observations.try_recv() {
                batch.push(o);
            }
            let refs: Vec<&Observation> = batch.iter().collect();
            if let Err(e) = store::record_observations(&self.inner.pool, &refs).await {
                tracing::warn!(error = %e, "could not record what providers said about their limits");
            }
        }
    }

    /// Claims what fits in the free slots and runs those calls to completion. Tests drive
    /// the dispatcher with this instead of the loop.
    pub async fn run_once(&self) -> Result<Step, StoreError> {
        let free = self.inner.slots.available_permits();
        let jobs = self.claim(free).await?;
        let claimed = jobs.len();
        futures::future::join_all(jobs.into_iter().map(|job| self.execute(job))).await;
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
            Utc::now(),
            self.inner.config.dispatch.lease(),
        )
        .await
    }

    /// The loop: claim into free slots, run each call as its own task, wake on NOTIFY or
    /// the fallback poll. Returns after the shutdown sequence when `cancel` fires.
    pub async fn run(self, cancel: CancellationToken) {
        let in_flight = TaskTracker::new();
        let heartbeat = self.spawn_heartbeat();
        let (completions, pending) = mpsc::channel(COMPLETION_BATCH * 4);
        let completer = TaskTracker::new();
        let (observer, observations) = mpsc::channel(COMPLETION_BATCH * 4);
        completer.spawn(self.clone().observe(observations));
        let pending = Arc::new(tokio::sync::Mutex::new(pending));
        for _ in 0..COMPLETERS {
            completer.spawn(self.clone().complete(pending.clone(), observer.clone()));
        }
        drop(observer);
        completer.close();
        match self.inner.completer.lock() {
            Ok(mut c) => *c = Some(completions),
            Err(poisoned) => *poisoned.into_inner() = Some(completions),
        }
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
                self.spawn_execute(&in_flight, job, vec![permit]);
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

    /// Runs `job` (claimed or handed over) as its own task, holding `permits` (its slot,
    /// and its room if handed over) until its outcome goes to the completer.
    fn spawn_execute(
        &self,
        in_flight: &TaskTracker,
        job: Job,
        permits: Vec<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let this = self.clone();
        in_flight.spawn(SLOT.scope(std::cell::RefCell::new(permits), async move {
            this.execute(job).await;
        }));
    }

    /// Takes the jobs this process's gate starts here until `cancel`, and runs them as
    /// slots free: interactive before standard before background before batch, then by
    /// priority, then in the order handed over. Sizes their room meanwhile.
    fn spawn_handed(&self, in_flight: &TaskTracker, cancel: CancellationToken) -> TaskTracker {
        let tracker = TaskTracker::new();
        let handed = lock(&self.inner.handed).take();
        if let Some(mut handed) = handed {
            tracker.spawn(self.clone().size_room(cancel.clone()));
            let (this, in_flight) = (self.clone(), in_flight.clone());
            tracker.spawn(async move {
                let mut waiting = std::collections::BinaryHeap::new();
                let mut order = 0u64;
                loop {
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => break,
                        job = handed.recv() => match job {
                            Some((job, room)) => {
                                // Its lease is kept from now on, while it waits for a slot.
                                lock(&this.inner.in_flight).insert(job.id);
                                order += 1;
                                waiting.push(Waiting { job, room, order });
                            }
                            None => break,
                        },
                        slot = this.inner.slots.clone().acquire_owned(), if !waiting.is_empty() => {
                            let (Ok(slot), Some(next)) = (slot, waiting.pop()) else { break };
                            this.spawn_execute(&in_flight, next.job, vec![slot, next.room]);
                        }
                    }
                }
                // Dropping the receiver closes it: the gate hands nothing more (it checks
                // before taking room); what still waits here keeps its lease until the
                // shutdown releases it.
            });
        }
        tracker.close();
        tracker
    }

    /// Resizes the room for handed-over jobs every [`ROOM_REVIEW`] to the rate of calls
    /// served since the last review ([`room_for`]), until `stop`. Room held by jobs is never
    /// taken back: a smaller size is reached as they finish.
    async fn size_room(self, stop: CancellationToken) {
        use std::sync::atomic::Ordering::Relaxed;
        let slots = self.inner.config.dispatch.concurrency;
        let mut size = slots * START_ROOM_PER_SLOT;
        let mut last = (tokio::time::Instant::now(), self.inner.served.load(Relaxed));
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(ROOM_REVIEW) => {}
            }
            let now = (tokio::time::Instant::now(), self.inner.served.load(Relaxed));
            let rate = (now.1 - last.1) as f64 / (now.0 - last.0).as_secs_f64().max(1e-3);
            last = now;
            let target = room_for(slots, rate);
            if target > size {
                self.inner.room.add_permits(target - size);
                size = target;
            } else {
                size -= self.inner.room.forget_permits(size - target);
            }
        }
    }

    /// Extends this process's leases every `heartbeat_secs` until the returned token is
    /// cancelled — after the drain, so leases stay valid while in-flight calls finish.
    fn spawn_heartbeat(&self) -> (CancellationToken, TaskTracker) {
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        tracker.spawn(self.clone().keep_leases(stop.clone()));
        tracker.close();
        (stop, tracker)
    }

    /// The heartbeat loop: extends the leases this process holds every `heartbeat_secs`
    /// until `stop`. `run` starts it; a process that streams without dispatching starts it
    /// itself.
    pub async fn keep_leases(self, stop: CancellationToken) {
        let every = Duration::from_secs(self.inner.config.dispatch.heartbeat_secs);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let ids: Vec<JobId> = lock(&self.inner.in_flight).iter().copied().collect();
            let extended = store::extend_leases(
                &self.inner.pool,
                &self.inner.owner,
                &ids,
                Utc::now(),
                self.inner.config.dispatch.lease(),
            )
            .await;
            if let Err(e) = extended {
                tracing::warn!(error = %e, "lease heartbeat failed");
            }
        }
    }

    /// Claims an admitted streaming job for this process (its client is connected here).
    pub async fn claim_stream(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        store::claim_stream_job(
            &self.inner.pool,
            id,
            &self.inner.owner,
            Utc::now(),
            self.inner.config.dispatch.lease(),
        )
        .await
    }

    /// Runs a claimed streaming job: opens the provider's stream and relays it, as the
    /// `data:` payloads of OpenAI-style SSE (ending with `[DONE]`), into the returned
    /// receiver. When the stream ends — or the receiver is dropped because the client went
    /// away, which cancels the upstream call — the attempt is recorded and the job
    /// finished with the usage produced so far, settling its reservation. No retries: the
    /// client is waiting; a refusal before the stream starts comes back as the failure.
    pub async fn stream(&self, job: Job, relays: &TaskTracker) -> Result<mpsc::Receiver<String>, Failure> {
        let target = self.target(&job).ok_or_else(|| Failure {
            class: tollgate::retry::FailureClass::Request,
            code: "unknown_model",
            message: format!("model {:?} is no longer configured", job.model),
            status: None,
            retry_after: None,
        })?;
        let tracked = self.track(job.id);
        let started_at = Utc::now();
        let mut upstream = match self.inner.providers.call_stream(&target, &job.request).await {
            Ok(s) => s,
            Err(outcome) => {
                let failure = match &outcome.result {
                    Err(f) => f.clone(),
                    Ok(_) => Failure::network("the provider refused the stream"),
                };
                let served = Served {
                    provider: &target.provider,
                    model: &target.model,
                };
                let record = Self::attempt_record(&job, served, &outcome, started_at, Utc::now());
                let settlement = if outcome.status.is_some() {
                    self.settlement(&job, &target, None)
                } else {
                    Settlement::UNSENT
                };
                let holder = self.holder(&job);
                let finish = Finish::Failed {
                    code: failure.code,
                    message: &failure.message,
                };
                log_write(
                    self.finish(
                        holder,
                        Some(served),
                        finish,
                        settlement,
                        Some(&record),
                        Utc::now(),
                    )
                    .await,
                );
                return Err(failure);
            }
        };
        let (tx, rx) = mpsc::channel::<String>(32);
        let this = self.clone();
        let wants_usage = crate::providers::streaming::ChatStream::client_wants_usage(&job.request);
        relays.spawn(async move {
            let _tracked = tracked;
            let mut assembled = Assembled::default();
            let mut ended: Result<(), Failure> = Ok(());
            let mut client_gone = false;
            while let Some(next) = upstream.next_chunk().await {
                match next {
                    Ok(chunk) => {
                        assembled.add(&chunk);
                        if upstream.last_was_usage() && !wants_usage {
                            continue;
                        }
                        if tx.send(chunk).await.is_err() {
                            client_gone = true;
                            break;
                        }
                    }
                    Err(failure) => {
                        let error = serde_json::json!({"error": {"message": failure.message, "type": "server_error", "param": null, "code": failure.code}});
                        let _ = tx.send(error.to_string()).await;
                        ended = Err(failure);
                        break;
                    }
                }
            }
            if !client_gone && ended.is_ok() {
                let _ = tx.send("[DONE]".to_owned()).await;
            }
            let usage = upstream.usage();
            let outcome = CallOutcome {
                key_name: upstream.key_name.clone(),
                status: Some(upstream.status),
                request_id: upstream.request_id.clone(),
                rate_limit: upstream.rate_limit.clone(),
                signals: tollgate::ratelimit::Signals::default(),
                result: match &ended {
                    Ok(()) => Ok(crate::providers::Success {
                        body: assembled.completion(usage),
                        usage,
                    }),
                    Err(f) => Err(f.clone()),
                },
            };
            drop(upstream); // closes the upstream connection if it is still open
            this.finish_stream(job, target, outcome, client_gone, started_at).await;
        });
        Ok(rx)
    }

    async fn finish_stream(
        &self,
        job: Job,
        target: Target,
        outcome: CallOutcome,
        client_gone: bool,
        started_at: chrono::DateTime<Utc>,
    ) {
        let served = Served {
            provider: &target.provider,
            model: &target.model,
        };
        let record = Self::attempt_record(&job, served, &outcome, started_at, Utc::now());
        crate::observe::provider_call(&job, &target, &outcome);
        let holder = self.holder(&job);
        let usage = match &outcome.result {
            Ok(s) => s.usage,
            Err(_) => Usage::default(),
        };
        let settlement = self.settlement(&job, &target, Some(usage));
        let finish = match (&outcome.result, client_gone) {
            (Ok(success), false) => Finish::Succeeded {
                result: &success.body,
                usage,
                provider_request_id: outcome.request_id.as_deref(),
            },
            (_, true) => Finish::Failed {
                code: "client_disconnected",
                message: "the client closed the stream; the upstream call was cancelled",
            },
            (Err(failure), false) => Finish::Failed {
                code: failure.code,
                message: &failure.message,
            },
        };
        let written = self
            .finish(
                holder,
                Some(served),
                finish,
                settlement,
                Some(&record),
                Utc::now(),
            )
            .await;
        log_write(written);
    }

    /// Stop claiming (done by the caller), drain in-flight calls up to the soft timeout,
    /// release the leases of whatever did not finish.
    async fn shutdown(
        &self,
        in_flight: TaskTracker,
        heartbeat: (CancellationToken, TaskTracker),
        completer: TaskTracker,
    ) {
        in_flight.close();
        let drain = Duration::from_secs(self.inner.config.dispatch.drain_timeout_secs);
        let in_flight_tasks = in_flight.len();
        let drained = tokio::time::timeout(drain, in_flight.wait()).await.is_ok();
        // Outcomes already handed over are written before leases are released.
        match self.inner.completer.lock() {
            Ok(mut c) => *c = None,
            Err(poisoned) => *poisoned.into_inner() = None,
        }
        completer.wait().await;
        heartbeat.0.cancel();
        heartbeat.1.wait().await;
        match store::release_leases(&self.inner.pool, &self.inner.owner, Utc::now()).await {
            Ok(released) => tracing::info!(
                in_flight = in_flight_tasks,
                drained,
                released,
                "dispatcher stopped"
            ),
            Err(e) => tracing::warn!(error = %e, "could not release leases; the rescuer will"),
        }
    }

    /// One attempt of one job, from target choice to the guarded write of its outcome.
    async fn execute(&self, job: Job) {
        let _tracked = self.track(job.id);
        let span = tracing::info_span!(
            "attempt",
            job_id = %job.id,
            tenant = %job.tenant,
            route = %job.model,
            attempt = job.attempt
        );
        self.execute_in_span(job).instrument(span).await;
    }

    /// This process as the holder of `job`'s current attempt: the guard of its writes.
    fn holder<'a>(&'a self, job: &Job) -> Holder<'a> {
        Holder {
            id: job.id,
            attempt: job.attempt,
            owner: &self.inner.owner,
        }
    }

    /// The target the gate admitted the job for (its reservation is for that target).
    fn target(&self, job: &Job) -> Option<Target> {
        let (provider, model) = (job.provider.as_deref()?, job.provider_model.as_deref()?);
        let kind = self.inner.config.provider(provider)?.kind;
        Some(Target {
            provider: provider.to_owned(),
            kind,
            model: model.to_owned(),
            key: job.provider_key.clone(),
        })
    }

    /// What the reservation is settled with: actual usage and its price.
    fn settlement(&self, job: &Job, target: &Target, usage: Option<Usage>) -> Settlement {
        let provider = self.inner.config.provider(&target.provider);
        let price = provider.and_then(|p| p.price_for(&target.model));
        // What the provider counted against its token limit when the request started.
        let charged_output = provider
            .filter(|p| p.charges_max_tokens)
            .and_then(|_| {
                let r = &job.request;
                r.get("max_tokens").or_else(|| r.get("max_completion_tokens"))
            })
            .and_then(serde_json::Value::as_f64);
        Settlement {
            charged_output,
            usage,
            actual_spend: usage.map_or(0.0, |u| {
                buckets::spend_micro_usd(
                    price,
                    u.input_tokens as f64,
                    u.cached_tokens as f64,
                    u.output_tokens as f64,
                )
            }),
            sent: true,
        }
    }

    async fn execute_in_span(&self, job: Job) {
        let inner = &self.inner;
        let holder = self.holder(&job);
        let target = self
            .target(&job)
            .or_else(|| routing::resolve(&inner.config, &job.model).and_then(|t| t.into_iter().next()));
        let Some(target) = target else {
            let message = format!("model {:?} is no longer configured", job.model);
            let finish = Finish::Failed {
                code: "unknown_model",
                message: &message,
            };
            log_write(
                self.finish(holder, None, finish, Settlement::UNSENT, None, Utc::now())
                    .await,
            );
            return;
        };
        let served = Served {
            provider: &target.provider,
            model: &target.model,
        };
        if let Some(key) = target.key.as_deref().filter(|k| {
            self.paused_here(&buckets::key_scope(&target.provider, k))
                .is_some()
        }) {
            let message = format!("key {key} was rejected by the provider; another key will be used");
            let finish = Finish::Retry {
                not_before: Utc::now(),
                code: "upstream_key_rotated",
                message: &message,
            };
            log_write(
                self.finish(holder, Some(served), finish, Settlement::UNSENT, None, Utc::now())
                    .await,
            );
            return;
        }
        if let Some(wait) = self.paused_here(&buckets::target_scope(&target.provider, &target.model)) {
            let finish = Finish::Retry {
                not_before: Utc::now() + wait,
                code: "target_paused",
                message: "the provider answered 429 for this model: back to the queue until the pause ends",
            };
            log_write(
                self.finish(holder, Some(served), finish, Settlement::UNSENT, None, Utc::now())
                    .await,
            );
            return;
        }
        let started_at = Utc::now();
        // The claim checked the deadline, but a busy process may reach the call later.
        if started_at >= job.deadline {
            tollgate::metrics::job_finished(
                &job.tenant,
                job.class,
                "failed",
                "deadline_exceeded",
                job.attempt,
            );
            let finish = Finish::Failed {
                code: "deadline_exceeded",
                message: "the deadline passed before the call could be sent",
            };
            log_write(
                self.finish(holder, Some(served), finish, Settlement::UNSENT, None, started_at)
                    .await,
            );
            return;
        }
        let outcome = inner.providers.call(&target, &job.request).await;
        if outcome.result.is_ok() {
            inner.served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let finished_at = Utc::now();
        let record = Self::attempt_record(&job, served, &outcome, started_at, finished_at);
        crate::observe::provider_call(&job, &target, &outcome);
        let observation = self.observation(&target, &outcome, finished_at);
        let written = match &outcome.result {
            Ok(success) => {
                let finish = Finish::Succeeded {
                    result: &success.body,
                    usage: success.usage,
                    provider_request_id: outcome.request_id.as_deref(),
                };
                let settlement = self.settlement(&job, &target, Some(success.usage));
                let outcome = Outcome::new(holder, Some(served), finish, settlement, Some(record));
                self.write(
                    Outcome {
                        observation,
                        ..outcome
                    },
                    Utc::now(),
                )
                .await
            }
            Err(failure) => {
                // A provider that answered with an overload (5xx, 529) did not serve the
                // request: its limits did not count it, so neither do ours (else an outage
                // would leave the buckets empty of capacity nobody used).
                let counted = outcome.status.is_some() && failure.class != FailureClass::Overload;
                let settlement = if counted {
                    self.settlement(&job, &target, None)
                } else {
                    Settlement::UNSENT
                };
                let failed = Attempted {
                    served,
                    key: Some(outcome.key_name.as_str()).filter(|k| !k.is_empty()),
                    failure,
                    settlement,
                    record: &record,
                    observation,
                };
                self.after_failure(&job, holder, failed).await
            }
        };
        match written {
            Ok(true) => {}
            Ok(false) => tracing::info!("outcome discarded: the job was cancelled or rescued meanwhile"),
            Err(e) => {
                tracing::warn!(error = %e, "could not write the outcome; the lease will expire and the job will be retried")
            }
        }
    }

    /// How long the pause of `scope` this process wrote still holds (`None`: none holds).
    fn paused_here(&self, scope: &str) -> Option<Duration> {
        lock(&self.inner.paused_here)
            .get(scope)
            .and_then(|until| until.checked_duration_since(std::time::Instant::now()))
    }

    fn pause_here(&self, scope: &str, wait: Duration) {
        lock(&self.inner.paused_here).insert(scope.to_owned(), std::time::Instant::now() + wait);
    }

    /// What a response said about its provider's limits, for the gate to learn from:
    /// readings of headers or 429 bodies, or a bare 429. `None` when the request was not
    /// answered or the provider's limits are not learned.
    fn observation(
        &self,
        target: &Target,
        outcome: &CallOutcome,
        at: chrono::DateTime<Utc>,
    ) -> Option<Observation> {
        outcome.status?;
        let learns = self.inner.config.provider(&target.provider)?.learn_limits;
        let throttled = matches!(&outcome.result, Err(f) if f.class == FailureClass::Capacity);
        learns.then(|| Observation {
            scope: buckets::target_scope(&target.provider, &target.model),
            readings: outcome.signals.readings.clone(),
            throttled: throttled && !outcome.signals.has_limits(),
            at,
        })
    }

    /// Retry with backoff while attempts and the deadline allow; otherwise fail with the
    /// failure's reason code (or `deadline_exceeded` when the next try would land late).
    /// A rejected key is paused for every process and the job goes back at once for
    /// another key.
    async fn after_failure(
        &self,
        job: &Job,
        holder: Holder<'_>,
        failed: Attempted<'_>,
    ) -> Result<bool, StoreError> {
        let Attempted {
            served,
            key,
            failure,
            settlement,
            record,
            observation,
        } = failed;
        let inner = &self.inner;
        let now = Utc::now();
        // Fallback: an error another target of the route may not have sends the job to one
        // it has not failed on, at once, with a retry budget of its own.
        let here = format!("{}/{}", served.provider, served.model);
        let failed_before = job.failed_targets.as_deref().unwrap_or_default();
        let fall_back = matches!(
            failure.class,
            FailureClass::Overload | FailureClass::Network | FailureClass::Timeout
        ) && routing::resolve(&inner.config, &job.model)
            .unwrap_or_default()
            .iter()
            .any(|t| t.label() != here && !failed_before.contains(&t.label()));
        let budget = job.max_attempts * (1 + failed_before.len() as i32 + i32::from(fall_back));
        let attempts_left = job.attempt < budget;
        let rotate = failure.class == FailureClass::KeyUnusable && key.is_some();
        let delay = if rotate || fall_back {
            Duration::ZERO
        } else {
            inner.policy.delay(job.attempt as u32, failure.retry_after)
        };
        let not_before = now + delay;
        let failed: Option<(&str, String)> = if !failure.class.is_retryable() && !rotate {
            Some((failure.code, failure.message.clone()))
        } else if !attempts_left {
            let message = format!(
                "{} attempts made; last error {}: {}",
                job.attempt, failure.code, failure.message
            );
            Some(("attempts_exhausted", message))
        } else if not_before >= job.deadline {
            let message = format!(
                "the next attempt (in {:.1} s) would start after the deadline; last error {}: {}",
                delay.as_secs_f64(),
                failure.code,
                failure.message
            );
            Some(("deadline_exceeded", message))
        } else {
            None
        };
        // A rate limit holds for everyone: pause the target for every process until the
        // provider said to come back, so queued jobs wait instead of meeting 429s too.
        let pause = match (failure.class, key) {
            (FailureClass::Capacity, _) => Some((
                buckets::target_scope(served.provider, served.model),
                with_jitter(failure.retry_after.unwrap_or(DEFAULT_PAUSE)),
                "rate_limited",
            )),
            (FailureClass::KeyUnusable, Some(key)) => {
                tracing::warn!(
                    key,
                    code = failure.code,
                    "provider rejected a key; rotating it out"
                );
                Some((
                    buckets::key_scope(served.provider, key),
                    Duration::from_secs(inner.config.dispatch.dead_key_secs),
                    "key_unusable",
                ))
            }
            _ => None,
        };
        let pause = pause.map(|(scope, wait, reason)| {
            self.pause_here(&scope, wait);
            Pause {
                scope,
                until: now + wait,
                reason,
            }
        });
        let outcome = match failed {
            Some((code, message)) => {
                tollgate::metrics::job_finished(&job.tenant, job.class, "failed", code, job.attempt);
                let finish = Finish::Failed {
                    code,
                    message: &message,
                };
                Outcome::new(holder, Some(served), finish, settlement, Some(record.clone()))
            }
            None => {
                tollgate::metrics::retry(&job.tenant, served.provider, served.model, failure.code);
                tracing::info!(
                    code = failure.code,
                    delay_ms = delay.as_millis() as u64,
                    "retrying later"
                );
                let finish = Finish::Retry {
                    not_before,
                    code: failure.code,
                    message: &failure.message,
                };
                Outcome::new(holder, Some(served), finish, settlement, Some(record.clone()))
            }
        };
        if fall_back {
            tracing::info!(target = %here, code = failure.code, "falling back to the route's next target");
        }
        self.write(
            Outcome {
                pause,
                observation,
                failed_target: fall_back.then_some(here),
                ..outcome
            },
            now,
        )
        .await
    }

    /// The record of one provider call, written with the attempt's outcome.
    fn attempt_record(
        job: &Job,
        served: Served<'_>,
        outcome: &CallOutcome,
        started_at: chrono::DateTime<Utc>,
        finished_at: chrono::DateTime<Utc>,
    ) -> AttemptRecord {
        let (outcome_label, error_code, usage) = match &outcome.result {
            Ok(s) => ("succeeded", None, Some(s.usage)),
            Err(f) => ("failed", Some(f.code), None),
        };
        AttemptRecord {
            job_id: job.id,
            attempt: job.attempt,
            tenant: job.tenant.clone(),
            provider: served.provider.to_owned(),
            provider_model: served.model.to_owned(),
            key_name: outcome.key_name.clone(),
            status: outcome.status.map(i32::from),
            outcome: outcome_label,
            error_code,
            provider_request_id: outcome.request_id.clone(),
            usage,
            estimated_input_tokens: job.estimated_input_tokens,
            estimated_output_tokens: job.estimated_output_tokens,
            rate_limit: outcome.rate_limit.clone(),
            started_at,
            finished_at,
        }
    }
}

/// A job in flight in this process, until dropped.
struct Tracked {
    inner: Arc<Inner>,
    id: JobId,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        lock(&self.inner.in_flight).remove(&self.id);
    }
}

/// A pause plus up to a tenth of it (at most 250 ms) at random, so the instances and
/// jobs a 429 stopped do not all come back in the same instant.
fn with_jitter(pause: Duration) -> Duration {
    use rand::Rng;
    let most = (pause / 10).min(Duration::from_millis(250));
    pause + most.mul_f64(rand::rng().random::<f64>())
}

/// Locks a mutex whose data stays valid even if a holder panicked.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// A failed provider call, with what its outcome is written with.
struct Attempted<'a> {
    served: Served<'a>,
    /// The key the call used.
    key: Option<&'a str>,
    failure: &'a Failure,
    settlement: Settlement,
    record: &'a AttemptRecord,
    observation: Option<Observation>,
}

/// A streamed answer put back together, to store as the job's result.
#[derive(Default)]
struct Assembled {
    id: Option<serde_json::Value>,
    model: Option<serde_json::Value>,
    content: String,
    finish_reason: Option<serde_json::Value>,
}

impl Assembled {
    fn add(&mut self, chunk: &str) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(chunk) else {
            return;
        };
        if self.id.is_none() {
            self.id = v.get("id").cloned();
            self.model = v.get("model").cloned();
        }
        let choice = &v["choices"][0];
        if let Some(text) = choice["delta"]["content"].as_str() {
            self.content.push_str(text);
        }
        if !choice["finish_reason"].is_null() {
            self.finish_reason = Some(choice["finish_reason"].clone());
        }
    }

    fn completion(&self, usage: Usage) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "object": "chat.completion",
            "created": Utc::now().timestamp(),
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": self.content},
                "finish_reason": self.finish_reason,
            }],
            "usage": {
                "prompt_tokens": usage.input_tokens,
                "completion_tokens": usage.output_tokens,
                "total_tokens": usage.input_tokens + usage.output_tokens,
            },
        })
    }
}

fn log_write(r: Result<bool, StoreError>) {
    if let Err(e) = r {
        tracing::warn!(error = %e, "could not write the job's state");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_room_covers_the_horizon_at_the_rate_of_calls_served_within_bounds() {
        // Idle or slow: two per slot, so a handed job waits for at most one call ahead of it.
        assert_eq!(room_for(64, 0.0), 128);
        assert_eq!(room_for(64, 100.0), 128);
        // 2,000 served a second: 200 ms of them ahead, on top of one per slot.
        assert_eq!(room_for(64, 2_000.0), 64 + 400);
        // Very fast: capped, so one process never holds more than 32 per slot.
        assert_eq!(room_for(64, 1e9), 64 * 32);
        assert_eq!(room_for(64, f64::NAN), 128);
    }
}
