//! Jobs this process's gate started here ([`Handoff`]): admitted straight to running with
//! this dispatcher's lease, sent in memory instead of through a claim. They wait for a
//! call slot — interactive before standard before background before batch, then by
//! priority, then in the order handed over — holding a place in the room, which bounds
//! how much this process takes on: what its providers serve in [`HANDOFF_HORIZON`].

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::model::Job;

use super::{Dispatcher, Via, lock};

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

/// A job the gate admitted straight to running here, with the room it holds.
pub(super) type Handed = (Job, OwnedSemaphorePermit);

/// Room for handed-over jobs (running or waiting for a slot) is what this process's
/// providers serve in this long, at the rate they have been serving its calls, on top of
/// one per slot: the gate runs ahead of the provider calls by about that much, so a job
/// waits here about that long at most, and one process does not hoard work other processes
/// could send. Calls served, not calls made: a storm of 429s does not widen the room (a
/// provider whose limit is not known yet meets no more calls than before it). Every job
/// the gate admits beyond the room costs a claim (one more write of its row).
const HANDOFF_HORIZON: Duration = Duration::from_millis(200);
/// Bounds of the room, per slot; a dispatcher starts at 8.
const MIN_ROOM_PER_SLOT: usize = 2;
const START_ROOM_PER_SLOT: usize = 8;
const MAX_ROOM_PER_SLOT: usize = 32;
/// How often the room is resized to the rate of calls served.
const ROOM_REVIEW: Duration = Duration::from_millis(250);

/// The room a dispatcher with `slots` call slots starts with.
pub(super) fn start_room(slots: usize) -> usize {
    slots * START_ROOM_PER_SLOT
}

/// The room for `slots` call slots whose providers serve `served_per_sec` calls a second.
fn room_for(slots: usize, served_per_sec: f64) -> usize {
    let ahead = (served_per_sec.max(0.0) * HANDOFF_HORIZON.as_secs_f64()).ceil() as usize;
    (slots + ahead).clamp(slots * MIN_ROOM_PER_SLOT, slots * MAX_ROOM_PER_SLOT)
}

/// A handed-over job that waited for its slot, with the slot and its room, to be checked.
type ToCheck = (Job, Vec<OwnedSemaphorePermit>);
/// Most jobs that waited for a slot checked in one statement.
const MOST_CHECKED_AT_ONCE: usize = 512;

/// A handed-over job waiting for a slot; the greatest runs first.
struct Waiting {
    job: Job,
    room: OwnedSemaphorePermit,
    order: u64,
    /// No call slot was free for it when it was handed over.
    waited: bool,
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

impl Dispatcher {
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

    /// Takes the jobs this process's gate starts here until `cancel`, and runs them as
    /// slots free, best first ([`Waiting`]); those that waited for their slot are checked
    /// first ([`Dispatcher::check_waited`]). Sizes their room meanwhile.
    pub(super) fn spawn_handed(&self, in_flight: &TaskTracker, cancel: CancellationToken) -> TaskTracker {
        let tracker = TaskTracker::new();
        let handed = lock(&self.inner.handed).take();
        if let Some(mut handed) = handed {
            tracker.spawn(self.clone().size_room(cancel.clone()));
            let (to_check, waited) = mpsc::unbounded_channel();
            tracker.spawn(self.clone().check_waited(in_flight.clone(), waited));
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
                                this.track_from_now(&job);
                                order += 1;
                                let waited = this.inner.slots.available_permits() <= waiting.len();
                                waiting.push(Waiting { job, room, order, waited });
                            }
                            None => break,
                        },
                        slot = this.inner.slots.clone().acquire_owned(), if !waiting.is_empty() => {
                            let (Ok(slot), Some(next)) = (slot, waiting.pop()) else { break };
                            let permits = vec![slot, next.room];
                            // The checker outlives this loop (it ends once this sender
                            // drops); were it gone, the job is run unchecked, not dropped.
                            let unchecked = if next.waited {
                                to_check.send((next.job, permits)).err().map(|e| e.0)
                            } else {
                                Some((next.job, permits))
                            };
                            if let Some((job, permits)) = unchecked {
                                this.spawn_execute(&in_flight, job, Via::Handover { held: true }, permits);
                            }
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

    /// Runs the handed-over jobs that waited for their slot (and may have been cancelled
    /// meanwhile) once it is known whether this process still holds them: those that came
    /// while one check was read are checked together, in one statement, so under load one
    /// round trip answers for many and alone one answers at once. A job no longer held is
    /// not sent. Ends when `waited` closes and is drained.
    async fn check_waited(self, in_flight: TaskTracker, mut waited: mpsc::UnboundedReceiver<ToCheck>) {
        let mut batch: Vec<ToCheck> = Vec::new();
        while waited.recv_many(&mut batch, MOST_CHECKED_AT_ONCE).await > 0 {
            let attempts: Vec<_> = batch.iter().map(|(job, _)| (job.id, job.attempt)).collect();
            let held = tollgate::store::running_held(&self.inner.pool, &attempts, &self.inner.owner).await;
            let held: Option<std::collections::HashSet<_>> = match held {
                Ok(held) => Some(held.into_iter().collect()),
                Err(e) => {
                    tracing::warn!(error = %e, "could not check jobs that waited for a slot; calling");
                    None
                }
            };
            for (job, permits) in batch.drain(..) {
                let via = Via::Handover {
                    held: held.as_ref().is_none_or(|h| h.contains(&job.id)),
                };
                self.spawn_execute(&in_flight, job, via, permits);
            }
        }
    }

    /// Resizes the room for handed-over jobs every [`ROOM_REVIEW`] to the rate of calls
    /// served since the last review ([`room_for`]), until `stop`. Room held by jobs is never
    /// taken back: a smaller size is reached as they finish.
    async fn size_room(self, stop: CancellationToken) {
        use std::sync::atomic::Ordering::Relaxed;
        let slots = self.inner.config.dispatch.concurrency;
        let mut size = start_room(slots);
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
