//! Leases: the jobs whose attempt runs in this process (or waits here for a slot) are
//! tracked while they do, and the heartbeat extends exactly their leases every
//! `dispatch.heartbeat_secs`, beside the process's own beat (its callers' queued calls
//! stay theirs while it beats: `store::beat`). A job that stops being tracked — its
//! outcome written, or lost — keeps its lease no longer, so the rescuer can take it
//! back. A job the heartbeat finds no longer held here — rescued (perhaps claimed again
//! since), or cancelled — has its call stopped: its [`InFlight::stop`] token fires, and
//! the attempt ends without writing anything of it ([`Dispatcher::abandon`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::model::{Job, JobId, JobState};
use tollgate::store;

use super::{Dispatcher, Inner, lock};

/// An attempt in flight here: which one, and the token that stops its call.
pub(super) struct InFlight {
    attempt: i32,
    stop: CancellationToken,
}

/// The attempts of `tracked` that `held` (what the heartbeat found still leased here)
/// says are no longer this process's to run: missing (rescued), held with another attempt
/// (claimed again after a rescue), or cancelled.
fn lost(tracked: &[(JobId, i32)], held: &[store::Held]) -> Vec<(JobId, i32)> {
    let held: HashMap<JobId, &store::Held> = held.iter().map(|h| (h.id, h)).collect();
    tracked
        .iter()
        .filter(|(id, attempt)| {
            held.get(id)
                .is_none_or(|h| h.attempt != *attempt || h.state != JobState::Running)
        })
        .copied()
        .collect()
}

impl Dispatcher {
    /// Marks `job`'s attempt in flight here until the returned guard drops (kept if it
    /// already is: a job handed over is tracked from its hand-over).
    pub(super) fn track(&self, job: &Job) -> Tracked {
        let stop = self.track_from_now(job);
        Tracked {
            inner: self.inner.clone(),
            id: job.id,
            attempt: job.attempt,
            stop,
        }
    }

    /// Marks `job`'s attempt in flight here (its lease kept) with no guard: for a job
    /// handed over, from the moment it waits for a slot. Returns its stop token.
    pub(super) fn track_from_now(&self, job: &Job) -> CancellationToken {
        let mut in_flight = lock(&self.inner.in_flight);
        let entry = in_flight.entry(job.id).or_insert_with(|| InFlight {
            attempt: job.attempt,
            stop: CancellationToken::new(),
        });
        if entry.attempt != job.attempt {
            *entry = InFlight {
                attempt: job.attempt,
                stop: CancellationToken::new(),
            };
        }
        entry.stop.clone()
    }

    /// Extends this process's leases every `heartbeat_secs` until the returned token is
    /// cancelled — after the drain, so leases stay valid while in-flight calls finish.
    pub(super) fn spawn_heartbeat(&self) -> (CancellationToken, TaskTracker) {
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        tracker.spawn(self.clone().keep_leases(stop.clone()));
        tracker.close();
        (stop, tracker)
    }

    /// Stops the calls of the tracked attempts `held` says are no longer this process's.
    fn stop_lost(&self, tracked: &[(JobId, i32)], held: &[store::Held]) {
        let lost = lost(tracked, held);
        if lost.is_empty() {
            return;
        }
        let in_flight = lock(&self.inner.in_flight);
        for (id, attempt) in lost {
            if let Some(f) = in_flight.get(&id).filter(|f| f.attempt == attempt) {
                tracing::info!(job_id = %id, attempt = f.attempt, "lease lost or job cancelled: stopping its call");
                f.stop.cancel();
            }
        }
    }

    /// The heartbeat loop: says the process is alive (`store::beat`: the synchronous calls
    /// its callers wait for stay theirs) and extends the leases it holds, every
    /// `heartbeat_secs` until `stop`. `run` starts it; a process that streams without
    /// dispatching starts it itself.
    pub async fn keep_leases(self, stop: CancellationToken) {
        let every = Duration::from_secs(self.inner.config.dispatch.heartbeat_secs);
        let lease = self.inner.config.dispatch.lease();
        loop {
            if let Err(e) = store::beat(&self.inner.pool, &self.inner.owner, lease).await {
                tracing::warn!(error = %e, "process heartbeat failed");
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let tracked: Vec<(JobId, i32)> = lock(&self.inner.in_flight)
                .iter()
                .map(|(id, f)| (*id, f.attempt))
                .collect();
            let ids: Vec<JobId> = tracked.iter().map(|t| t.0).collect();
            let held = store::extend_leases(&self.inner.pool, &self.inner.owner, &ids, lease).await;
            match held {
                Ok(held) => self.stop_lost(&tracked, &held),
                Err(e) => tracing::warn!(error = %e, "lease heartbeat failed"),
            }
        }
    }
}

/// A job in flight in this process, until dropped.
pub(super) struct Tracked {
    inner: Arc<Inner>,
    id: JobId,
    attempt: i32,
    /// Fires when the heartbeat finds the job no longer this process's.
    pub(super) stop: CancellationToken,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut in_flight = lock(&self.inner.in_flight);
        if in_flight.get(&self.id).is_some_and(|f| f.attempt == self.attempt) {
            in_flight.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: JobId, attempt: i32, state: JobState) -> store::Held {
        store::Held { id, attempt, state }
    }

    #[test]
    fn a_job_rescued_claimed_again_or_cancelled_is_lost_and_a_running_one_is_not() {
        let ids: Vec<JobId> = (0..5).map(|_| JobId(uuid::Uuid::now_v7())).collect();
        let tracked: Vec<(JobId, i32)> = ids.iter().map(|id| (*id, 1)).collect();
        let found = [
            held(ids[0], 1, JobState::Running),
            // ids[1] is missing: rescued.
            held(ids[2], 2, JobState::Running),
            held(ids[3], 1, JobState::Cancelled),
            // Skipped by the heartbeat's lock but still ours: the read reports it.
            held(ids[4], 1, JobState::Running),
        ];
        assert_eq!(
            lost(&tracked, &found),
            vec![(ids[1], 1), (ids[2], 1), (ids[3], 1)]
        );
    }
}
