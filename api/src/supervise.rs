//! Keeping a process's roles running: a role whose loop ends before the process stops —
//! by a panic (a bug, an overflow on a value nobody thought of) or by returning — is
//! started again, after a pause, instead of leaving the process up without it (a process
//! whose gate thread died admitted nothing, ever, while answering every probe).
//!
//! A role that keeps dying is restarted at most once per [`MAX_PAUSE`]; a run that lasted
//! longer than that resets the pause. Each end is logged at `error` with the role's name.
//! What a dead run held in the database (a leader lock, leases) is its connections' and
//! its rows': the lock goes with its session, leases are rescued when they expire.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The pause before the first restart; it doubles with each quick end, up to [`MAX_PAUSE`].
pub const FIRST_PAUSE: Duration = Duration::from_millis(100);
pub const MAX_PAUSE: Duration = Duration::from_secs(30);

/// Runs `start()`'s future until `cancel`, starting it again each time it ends before.
/// A panic in a run ends the run (caught at its edge), not the supervisor.
pub async fn supervise<F, Fut>(role: &'static str, cancel: CancellationToken, mut start: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let mut pause = FIRST_PAUSE;
    loop {
        let began = Instant::now();
        let ended = AssertUnwindSafe(start()).catch_unwind().await;
        if cancel.is_cancelled() {
            return;
        }
        let why = match ended {
            Ok(Ok(())) => "it returned".to_owned(),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => "it panicked".to_owned(),
        };
        if began.elapsed() > MAX_PAUSE {
            pause = FIRST_PAUSE;
        }
        tracing::error!(
            role,
            why,
            restart_in_ms = pause.as_millis() as u64,
            "a role ended before the process: restarting it"
        );
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// Spawns on `tracker`, under [`supervise`], the role `run(value.clone(), cancel)`: a loop
/// that returns when `cancel` fires.
pub fn spawn_supervised<R, Fut>(
    tracker: &TaskTracker,
    role: &'static str,
    cancel: &CancellationToken,
    value: R,
    run: impl Fn(R, CancellationToken) -> Fut + Send + 'static,
) where
    R: Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let stop = cancel.clone();
    tracker.spawn(supervise(role, cancel.clone(), move || {
        let run = run(value.clone(), stop.clone());
        async move {
            run.await;
            Ok(())
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn a_role_that_panics_is_started_again_and_stops_with_the_process() {
        let starts = Arc::new(AtomicUsize::new(0));
        let (running, mut third_run) = tokio::sync::mpsc::unbounded_channel::<()>();
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let supervisor = tasks.spawn(supervise("test-role", cancel.clone(), {
            let (starts, cancel) = (starts.clone(), cancel.clone());
            move || {
                let (n, running, cancel) = (
                    starts.fetch_add(1, Ordering::SeqCst),
                    running.clone(),
                    cancel.clone(),
                );
                async move {
                    match n {
                        0 => panic!("a bug in the role"),
                        1 => anyhow::bail!("the role gave up"),
                        _ => {
                            let _ = running.send(());
                            cancel.cancelled().await;
                            Ok(())
                        }
                    }
                }
            }
        }));
        tokio::time::timeout(Duration::from_secs(10), third_run.recv())
            .await
            .expect("the role was not started again after it panicked and after it failed");
        cancel.cancel();
        tokio::time::timeout(Duration::from_secs(10), supervisor)
            .await
            .expect("the supervisor did not stop with the process")
            .unwrap();
        assert_eq!(
            starts.load(Ordering::SeqCst),
            3,
            "a role that ends on cancel is not restarted"
        );
    }
}
