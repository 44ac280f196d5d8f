//! Leases: the jobs whose attempt runs in this process (or waits here for a slot) are
//! tracked while they do, and the heartbeat extends exactly their leases every
//! `dispatch.heartbeat_secs`. A job that stops being tracked — its outcome written, or
//! lost — keeps its lease no longer, so the rescuer can take it back.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::model::JobId;
use tollgate::store;

use super::{Dispatcher, Inner, lock};

impl Dispatcher {
    /// Marks `id` in flight here until the returned guard drops.
    pub(super) fn track(&self, id: JobId) -> Tracked {
        lock(&self.inner.in_flight).insert(id);
        Tracked {
            inner: self.inner.clone(),
            id,
        }
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
}

/// A job in flight in this process, until dropped.
pub(super) struct Tracked {
    inner: Arc<Inner>,
    id: JobId,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        lock(&self.inner.in_flight).remove(&self.id);
    }
}
