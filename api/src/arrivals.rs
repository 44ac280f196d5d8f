//! Interactive jobs admitted as they arrive ([`Gate::admit_arrival`]), on a thread and
//! runtime of their own: on the API's runtime each of an arrival's statements waited behind
//! the hundreds of requests and provider calls ready to run there. The thread lives as long
//! as any handle to it.

use std::sync::Arc;

use anyhow::Context;
use sqlx::PgPool;
use tokio_util::sync::{CancellationToken, DropGuard};
use tollgate::model::{Job, NewJob};
use tollgate::store::StoreError;
use tollgate_workers::gate::Gate;

#[derive(Clone)]
pub struct Arrivals {
    gate: Arc<Gate>,
    /// Connections of the arrivals' own (opened lazily, on their thread).
    pool: PgPool,
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
            runtime,
            _alive: Arc::new(alive.drop_guard()),
        })
    }

    /// [`Gate::admit_arrival`] on the arrivals thread.
    pub async fn admit(&self, job: Arc<NewJob>) -> Result<Option<Job>, StoreError> {
        let (gate, pool) = (self.gate.clone(), self.pool.clone());
        self.runtime
            .spawn(async move { gate.admit_arrival(&pool, &job).await })
            .await
            .map_err(|e| {
                StoreError::Database(sqlx::Error::Protocol(format!("the arrival task failed: {e}")))
            })?
    }
}
