//! Interactive jobs admitted as they arrive ([`Gate::admit_arrivals`]), on a thread and
//! runtime of their own: on the API's runtime each of an arrival's statements waited behind
//! the hundreds of requests and provider calls ready to run there. The thread lives as long
//! as any handle to it.
//!
//! One admitter takes every arrival waiting and admits them together, in one transaction
//! ([`tollgate::gather::waiting`]): their buckets are locked once, and the
//! arrivals do not queue on each other's bucket rows one commit at a time. It uses up to
//! [`ARRIVAL_CONNECTIONS`] connections at once, never holding one while it waits for
//! another, on a pool of exactly those ([`CONNECTIONS`]). An arrival finding
//! [`WAITING`] others ahead of it, or whose admission failed, is queued as usual for the
//! gate's next round.

use std::sync::Arc;

use anyhow::Context;
use sqlx::PgPool;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_util::sync::{CancellationToken, DropGuard};
use tollgate::gather;
use tollgate::model::{Job, NewJob};
use tollgate_workers::gate::{ARRIVAL_CONNECTIONS, Gate};

/// The arrivals' pool: the admitter's connections, no more, no fewer.
pub const CONNECTIONS: u32 = ARRIVAL_CONNECTIONS;
/// Most arrivals waiting for the admitter; one more is queued for the round instead.
const WAITING: usize = 256;
/// Most arrivals admitted in one transaction.
const BATCH: usize = 64;

/// An arrival for the admitter, and where it answers (`None`: queue it).
type Arriving = (Arc<NewJob>, oneshot::Sender<Option<Job>>);

#[derive(Clone)]
pub struct Arrivals {
    queue: mpsc::Sender<Arriving>,
    _alive: Arc<DropGuard>,
}

impl Arrivals {
    pub fn start(gate: Arc<Gate>, pool: PgPool) -> anyhow::Result<Self> {
        let alive = CancellationToken::new();
        let (started, runtime) = std::sync::mpsc::channel();
        let stop = alive.clone();
        std::thread::Builder::new()
            .name("tollgate-arrivals".to_owned())
            .spawn(
                move || match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => {
                        let _ = started.send(Ok(runtime.handle().clone()));
                        runtime.block_on(stop.cancelled());
                    }
                    Err(e) => {
                        let _ = started.send(Err(e));
                    }
                },
            )
            .context("starting the arrivals thread")?;
        let runtime = runtime
            .recv()
            .context("the arrivals thread ended before its runtime started")?
            .context("building the arrivals runtime")?;
        let (queue, arriving) = mpsc::channel(WAITING);
        runtime.spawn(admit_all(gate, pool, arriving));
        Ok(Self {
            queue,
            _alive: Arc::new(alive.drop_guard()),
        })
    }

    /// Admits `job` on arrival, with whatever other arrivals are waiting; `None` (queue it
    /// as usual) when it does not start now.
    pub async fn admit(&self, job: &Arc<NewJob>) -> Option<Job> {
        let (reply, answer) = oneshot::channel();
        self.queue.try_send((job.clone(), reply)).ok()?;
        answer.await.ok().flatten()
    }
}

/// The admitter: admits the arrivals waiting, together, until every sender is gone.
async fn admit_all(gate: Arc<Gate>, pool: PgPool, arriving: mpsc::Receiver<Arriving>) {
    let arriving = Mutex::new(arriving);
    while let Some(batch) = gather::waiting(&arriving, BATCH).await {
        let (jobs, replies): (Vec<Arc<NewJob>>, Vec<_>) = batch.into_iter().unzip();
        let arriving: Vec<&NewJob> = jobs.iter().map(|j| &**j).collect();
        let started = match gate.admit_arrivals(&pool, &arriving).await {
            Ok(started) => started,
            Err(e) => {
                tracing::warn!(error = %e, arrivals = jobs.len(), "could not admit arrivals; they are queued");
                vec![None; jobs.len()]
            }
        };
        for (reply, job) in replies.into_iter().zip(started) {
            let _ = reply.send(job);
        }
    }
}
