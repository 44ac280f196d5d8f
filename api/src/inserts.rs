//! Single submissions written together: each `POST /v1/jobs` or synchronous request not
//! started on arrival is inserted by a few writer tasks that put every job waiting into one
//! `INSERT … FROM unnest(…)` ([`store::insert_jobs`], the bulk path's statement) and one
//! commit ([`Writers::next_batch`]: a lone job is written at once). One statement per job
//! was a commit and a round of index updates per job, each waiting on the others' locks:
//! the first limit on the synchronous path under load.
//!
//! A job is answered when its batch has committed, as if it had been inserted alone. Written
//! the one-job way instead ([`store::insert_job`]): a job whose idempotency key its tenant
//! already used (that insert reads the job under the key), the jobs of a batch that failed
//! (each then meets its own error, or none), and any job once the writers have stopped. A
//! queue with a per-tenant cap is not written here: its count and insert share a
//! transaction (`jobs::reserve_queue_room`).

use std::sync::Arc;
use std::time::Duration;

use serde_json::value::RawValue;
use sqlx::PgPool;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::gather::Writers;
use tollgate::model::{Job, NewJob};
use tollgate::store::{self, BulkInserted, Inserted, StoreError};

/// Writer tasks side by side: while one waits for its commit, the next takes what arrived.
const WRITERS: usize = 2;
/// Most jobs in one statement.
const BATCH: usize = 512;
/// How long a writer waits for more jobs while the other's batch is still being written.
const GATHER: Duration = Duration::from_millis(1);

/// A job for the writers, and where they answer: `None` when its batch failed.
type Pending = (NewJob<Box<RawValue>>, oneshot::Sender<Option<BulkInserted>>);

/// The way to the writers. Cheap to clone.
#[derive(Clone)]
pub struct Inserts {
    pool: PgPool,
    queue: mpsc::Sender<Pending>,
}

impl Inserts {
    /// Starts the writers on `tracker`; they stop when `cancel` is cancelled, after the
    /// batch they are writing.
    pub fn start(pool: PgPool, tracker: &TaskTracker, cancel: &CancellationToken) -> Self {
        let (queue, pending) = mpsc::channel(BATCH * 4);
        let pending = Arc::new(Mutex::new(pending));
        let writers = Arc::new(Writers::default());
        for _ in 0..WRITERS {
            let (pool, pending, writers, cancel) =
                (pool.clone(), pending.clone(), writers.clone(), cancel.clone());
            tracker.spawn(async move {
                loop {
                    let batch = tokio::select! {
                        _ = cancel.cancelled() => return,
                        batch = writers.next_batch(&pending, BATCH, GATHER) => batch,
                    };
                    let Some(batch) = batch else { return };
                    let _writing = writers.writing();
                    write(&pool, batch).await;
                }
            });
        }
        Self { pool, queue }
    }

    /// Inserts `job` (queued), with whatever other jobs are waiting; committed when this
    /// returns.
    pub async fn insert(&self, job: &NewJob) -> Result<Inserted, StoreError> {
        let raw = serde_json::value::to_raw_value(&job.request)?;
        let (reply, answer) = oneshot::channel();
        let written = match self.queue.send((job.clone().map_request(|_| raw), reply)).await {
            // No answer: the writers stopped before taking it, so it is not written.
            Ok(()) => answer.await.ok().flatten(),
            Err(_) => None,
        };
        match written {
            Some(BulkInserted::New(_)) => Ok(Inserted::New(Job::queued(job))),
            Some(BulkInserted::Existing(_) | BulkInserted::Conflict) | None => {
                let mut conn = self.pool.acquire().await?;
                store::insert_job(&mut conn, job).await
            }
        }
    }
}

/// Writes one batch in one statement and answers each job's sender.
async fn write(pool: &PgPool, batch: Vec<Pending>) {
    let (jobs, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
    let written = async {
        let mut conn = pool.acquire().await?;
        store::insert_jobs(&mut conn, &jobs).await
    }
    .await;
    match written {
        Ok(written) => {
            for (reply, w) in replies.into_iter().zip(written) {
                let _ = reply.send(Some(w));
            }
        }
        Err(e) => {
            // One statement: none of them was written. Each is tried alone.
            tracing::warn!(error = %e, batch = jobs.len(), "could not insert a batch of jobs; inserting each alone");
            for reply in replies {
                let _ = reply.send(None);
            }
        }
    }
}
