//! The shutdown sequence, in order: stop claiming (the loop has returned), let in-flight
//! calls finish up to `dispatch.drain_timeout_secs`, write the outcomes already handed to
//! the completer, stop the heartbeat, and release the leases of whatever did not finish
//! so another process can run it at once instead of after the lease expires.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::store;

use super::Dispatcher;

impl Dispatcher {
    /// Runs the sequence once the loop has stopped claiming.
    pub(super) async fn shutdown(
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
        self.stop_completer();
        completer.wait().await;
        heartbeat.0.cancel();
        heartbeat.1.wait().await;
        match store::release_leases(&self.inner.pool, &self.inner.owner, self.inner.clock.now()).await {
            Ok(released) => tracing::info!(
                in_flight = in_flight_tasks,
                drained,
                released,
                "dispatcher stopped"
            ),
            Err(e) => tracing::warn!(error = %e, "could not release leases; the rescuer will"),
        }
    }
}
