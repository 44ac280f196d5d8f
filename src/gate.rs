//! The hand-over between the gate role (`tollgate_workers::gate`) and the dispatcher of
//! its own process: the one thing both roles name. The dispatcher makes it
//! (`Dispatcher::handoff`); the gate uses it to start what it admits there.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::model::Job;

/// The gate's way to this process's dispatcher. A job the gate admits while that
/// dispatcher has room is written as running, leased to it, in the admission's own write,
/// and handed over: one write of the job row instead of two (admit, then claim), and no
/// wake-up in between. The dispatcher runs what it was handed in order of class and
/// priority as its call slots free. The rest are admitted for any dispatcher to claim.
pub struct Handoff {
    /// The dispatcher's `lease_owner`.
    pub owner: String,
    pub lease: Duration,
    /// Room for jobs handed over and not yet finished (a permit each, given back when the
    /// job's outcome goes to the completer): bounds what one process holds.
    pub room: Arc<Semaphore>,
    pub jobs: mpsc::UnboundedSender<(Job, OwnedSemaphorePermit)>,
}

impl Handoff {
    /// Room for up to `wanted` jobs, taken now (none while the dispatcher is not running).
    pub fn permits(&self, wanted: usize) -> Vec<OwnedSemaphorePermit> {
        if self.jobs.is_closed() {
            return Vec::new();
        }
        std::iter::from_fn(|| self.room.clone().try_acquire_owned().ok())
            .take(wanted)
            .collect()
    }

    /// Hands committed, started jobs over with their room. A job the dispatcher can no
    /// longer take (it stopped meanwhile) keeps its lease until the dispatcher's shutdown
    /// releases it or, after a crash, the lease expires.
    pub fn hand(&self, jobs: Vec<Job>, permits: Vec<OwnedSemaphorePermit>) {
        for (job, permit) in jobs.into_iter().zip(permits) {
            if self.jobs.send((job, permit)).is_err() {
                tracing::warn!("the dispatcher stopped before taking a job the gate started for it");
            }
        }
    }
}
