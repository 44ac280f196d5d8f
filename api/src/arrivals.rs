//! Interactive jobs admitted as they arrive ([`Gate::admit_arrival`]), on a thread and
//! runtime of their own: on the API's runtime each of an arrival's statements waited behind
//! the hundreds of requests and provider calls ready to run there. The thread lives as long
//! as any handle to it.
//!
//! An arrival uses up to [`ARRIVAL_CONNECTIONS`] connections at once (never holding one
//! while it waits for another), and at most [`AT_ONCE`] run together, on a pool of exactly
//! their connections ([`CONNECTIONS`]): an arrival never waits for the pool, and one
//! finding no slot free is queued as usual, for the gate's next round — which is as soon,
//! when arrivals come faster than two at a time.

use std::sync::Arc;

use anyhow::Context;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio_util::sync::{CancellationToken, DropGuard};
use tollgate::model::{Job, NewJob};
use tollgate::store::StoreError;
use tollgate_workers::gate::{ARRIVAL_CONNECTIONS, Gate};

/// Arrivals admitted side by side.
pub const AT_ONCE: u32 = 2;
/// The arrivals' pool: every running arrival's connections, no more, no fewer.
pub const CONNECTIONS: u32 = AT_ONCE * ARRIVAL_CONNECTIONS;

#[derive(Clone)]
pub struct Arrivals {
    gate: Arc<Gate>,
    /// Connections of the arrivals' own (opened lazily, on their thread): [`CONNECTIONS`].
    pool: PgPool,
    /// [`AT_ONCE`] slots.
    slots: Arc<Semaphore>,
    runtime: tokio::runtime::Handle,
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
        Ok(Self {
            gate,
            pool,
            slots: Arc::new(Semaphore::new(AT_ONCE as usize)),
            runtime,
            _alive: Arc::new(alive.drop_guard()),
        })
    }

    /// [`Gate::admit_arrival`] on the arrivals thread; `None` (queue it as usual) when
    /// [`AT_ONCE`] arrivals are running already.
    pub async fn admit(&self, job: Arc<NewJob>) -> Result<Option<Job>, StoreError> {
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            return Ok(None);
        };
        let (gate, pool) = (self.gate.clone(), self.pool.clone());
        self.runtime
            .spawn(async move {
                let admitted = gate.admit_arrival(&pool, &job).await;
                drop(slot);
                admitted
            })
            .await
            .map_err(|e| {
                StoreError::Database(sqlx::Error::Protocol(format!("the arrival task failed: {e}")))
            })?
    }
}
