//! The completer: outcomes written in batches. While the loop runs, every attempt's
//! outcome goes to a few completer tasks that write many per transaction (the job rows,
//! the call records, the settlements, the pauses) and answer each sender whether its
//! outcome was written; without the loop, an outcome is written on its own. What
//! providers said about their limits is written apart, gathered, after the outcomes
//! commit: it is advice for the gate, not part of the outcome.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;
use tollgate::attempt::Outcome;
use tollgate::gather;
use tollgate::learning::Observation;
use tollgate::store::{self, StoreError};

use super::execute::SLOT;
use super::{Dispatcher, lock, with_jitter};

/// An outcome waiting for the completer, with where to report whether it was written.
pub(super) type Pending = (Outcome, oneshot::Sender<Result<bool, StoreError>>);

/// Most outcomes the completer writes in one transaction.
const COMPLETION_BATCH: usize = 256;
/// Completer tasks writing batches of outcomes side by side.
const COMPLETERS: usize = 2;
/// How long provider observations gather before they are written: they are advice for
/// the gate, written apart from the outcomes so the completers never wait on them.
const OBSERVATION_GATHER: Duration = Duration::from_millis(100);

impl Dispatcher {
    /// Starts the completers and the observer, and sends outcomes to them from now on.
    /// The returned tracker ends when the shutdown takes the sender back
    /// ([`Dispatcher::stop_completer`]) and the last outcome is written.
    pub(super) fn spawn_completer(&self) -> TaskTracker {
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
        *lock(&self.inner.completer) = Some(completions);
        completer
    }

    /// Outcomes are written directly from now on; the completers end once they have
    /// written what they were sent.
    pub(super) fn stop_completer(&self) {
        *lock(&self.inner.completer) = None;
    }

    /// Writes an attempt's outcome: through the completer while the loop runs (many
    /// outcomes per transaction), directly otherwise. `Ok(false)`: the job was cancelled
    /// or rescued meanwhile, and the outcome discarded.
    pub(super) async fn write(
        &self,
        outcome: Outcome,
        now: chrono::DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let completer = lock(&self.inner.completer).clone();
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
        let written = store::finish_attempt(&self.inner.pool, &outcome, now).await?;
        if let Some(observation) = &outcome.observation {
            store::record_observations(&self.inner.pool, &[observation]).await?;
        }
        Ok(written)
    }

    /// A completer: takes the outcomes waiting ([`gather::waiting`], up to
    /// [`COMPLETION_BATCH`]) and writes them in one transaction, until every sender is gone.
    ///
    /// [`COMPLETERS`] of them share the queue: while one waits for its commit to reach
    /// the disk, the next gathers and writes the following batch. Their batches hold
    /// disjoint jobs (each outcome is taken once), so they never wait on each other's rows.
    async fn complete(
        self,
        outcomes: Arc<tokio::sync::Mutex<mpsc::Receiver<Pending>>>,
        observer: mpsc::Sender<Observation>,
    ) {
        // What waits, at once: a completer that waited for more while the other wrote
        // held a synchronous caller's answer that long at every moderate rate; under load
        // both are writing and the queue fills batches by itself.
        while let Some(batch) = gather::waiting(&outcomes, COMPLETION_BATCH).await {
            let (items, replies): (Vec<Outcome>, Vec<_>) = batch.into_iter().unzip();
            // Their callers here are woken by the ends handed to them below, not by the
            // notices this write commits.
            let writing = self
                .inner
                .notifications
                .writing_outcomes(items.iter().map(|o| o.holder.id));
            let pool = &self.inner.pool;
            // A lost race (deadlock victim, serialization failure) succeeds when tried again;
            // so does a write while the database restarts. Retried with backoff while the
            // leases (kept by the heartbeat) could still hold: after that the rescuer owns
            // the jobs and the guarded write would be refused anyway.
            let give_up = tokio::time::Instant::now() + self.inner.config.dispatch.lease();
            let mut backoff = Duration::from_millis(50);
            let written = loop {
                match store::finish_attempts(pool, &items, self.inner.clock.now()).await {
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
                    // Committed: callers waiting here for these jobs answer from their ends.
                    self.inner.notifications.jobs_ended_here(
                        items
                            .iter()
                            .zip(&written)
                            .filter(|(o, w)| **w && o.end.state().is_terminal())
                            .map(|(o, _)| (o.holder.id, &o.end)),
                    );
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
            drop(writing);
        }
    }

    /// Records what providers said about their limits (and the accounts keys serve under),
    /// every [`OBSERVATION_GATHER`] while
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
            let accounts: Vec<_> = batch.iter().filter_map(|o| o.account.clone()).collect();
            if let Err(e) = store::record_key_accounts(&self.inner.pool, &accounts).await {
                tracing::warn!(error = %e, "could not record the accounts provider keys serve under");
            }
        }
    }
}
