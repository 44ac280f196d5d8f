//! All SQL. Small functions over `impl PgExecutor` (or a connection inside a transaction
//! where several statements must commit together), so each runs on a pool or inside a
//! transaction. Time is a parameter (`now`) so tests pin the clock instead of sleeping —
//! but for leases: a lease is written as the database's `now()` plus its length and is
//! expired when the database's `now()` passes it, so no process's clock decides whether
//! another's job is still alive (a test moves a lease by writing it).
//!
//! - [`jobs`]: the job rows, from insert to terminal state.
//! - [`buckets`]: bucket rows and the reservations jobs hold against them.
//! - [`control`]: the control plane: tenants, their API keys, the version of both.
//! - [`learned`]: learned limits — what responses said, what the gate applied.
//! - [`gate`]: what the gate reads (queued work per tenant and class) and writes
//!   (admissions, explanations).
//! - [`files`]: uploaded and produced files, their bytes in chunks.
//! - [`batches`]: batch rows, the bulk insert of their jobs, finalization, retention.
//! - [`webhooks`]: webhook endpoints and the delivery outbox.
//! - [`provider_batches`]: dispatch decisions and packs sent through providers' batch APIs.
//! - [`observe`]: what the dashboard, `/v1/status` and `/metrics` read.
//! - [`operate`]: what operators act on and look back at: pauses, retries, a job's calls,
//!   the dashboard's history.
//! - [`statistics`]: the planner's statistics of `jobs`, analyzed when stale.
//!
//! Every write to a running job is guarded by ownership — `state = 'running' AND attempt
//! = $n AND lease_owner = $owner` — so a dispatcher whose lease was rescued, or whose job
//! was cancelled, writes nothing: zero rows is an answer, not an error. A reservation is
//! released exactly once, by whoever clears the job's `reserved_buckets`.
//!
//! Statements that write jobs by id (`j.id = t.id` over an `unnest` of ids) compare the
//! state as text: `j.state::text = 'running'`. States churn thousands of times a second,
//! so the planner's statistics of `state` are always stale; with a plain `j.state =
//! 'running'` it took the running rows for a handful and read a whole partial index of
//! that state (or rescanned the id list once per row) instead of looking each id up —
//! 45 ms instead of 10 for 256 finished jobs. Written as text, the guard matches no
//! partial index and the ids lead. For the same reason the id list is not repeated as
//! `j.id = ANY($1)`.
//!
//! Every statement (but those of [`webhooks`], still runtime SQL) is checked against the
//! schema when it compiles: `sqlx::query!`, `query_as!` and `query_scalar!`, whose text
//! must be literal (pieces joined with `+`). So a statement two functions share, or the
//! column list of a row, is a `macro_rules!` that hands its text on to them (`query_jobs!`
//! below, `query_batches!`, `save_buckets_query!`, ...); no statement reads a table with
//! `SELECT *`. What the checks learned from the database is kept in `.sqlx/` at the
//! workspace root, and builds read it there (`SQLX_OFFLINE=true`, `.cargo/config.toml`),
//! so none needs a database. After changing a statement or a migration, run `cargo sqlx
//! prepare --workspace` with `DATABASE_URL` pointing at a database migrated with
//! `migrations/`, and commit `.sqlx/`; CI fails when it is stale (`.ci/sqlx-check`).

/// `sqlx::query_as!` of [`Job`](crate::model::Job) rows: the statement is `$head`, the
/// job row's columns, then `$tail`; the statement calls the table `j`. The one list of the
/// row's columns: it names each, in the struct's order, with the types PostgreSQL cannot
/// tell (`_`: the field's).
macro_rules! query_jobs {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $crate::model::Job,
            $head
                + " j.id AS \"id: _\", j.tenant, j.class AS \"class: _\", j.priority, j.state AS \"state: _\",
                    j.endpoint AS \"endpoint: _\", j.request, j.model, j.idempotency_key, j.metadata, j.deadline, j.not_before, j.attempt,
                    j.max_attempts, j.lease_owner, j.lease_expires_at, j.provider, j.provider_model,
                    j.provider_request_id, j.estimated_input_tokens, j.estimated_output_tokens, j.usage,
                    j.result, j.error_code, j.error_message, j.created_at, j.started_at, j.finished_at,
                    j.admitted_at, j.reserved_buckets, j.reserved_amounts, j.admission, j.admission_log, j.stream,
                    j.provider_key, j.failed_targets, j.dispatch_via, j.dispatch_reason, j.provider_batch_id,
                    j.spend_micro_usd, j.saved_micro_usd, j.api_key, j.reserved_micro_usd, j.price_source AS \"price_source: _\", j.traceparent, j.held, j.batch_id, j.eta_p50, j.eta_p90 "
                + $tail
            $(, $arg)*
        )
    };
}

/// `sqlx::query_scalar!` of the job ids a statement returns, as [`query_jobs!`] is of the
/// rows: `$head`, the id, `$tail`.
macro_rules! query_job_ids {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_scalar!($head + r#" j.id AS "id: crate::model::JobId" "# + $tail $(, $arg)*)
    };
}

pub mod batches;
pub mod buckets;
pub mod control;
pub mod files;
pub mod forecast;
pub mod gate;
pub mod jobs;
pub mod learned;
pub mod observe;
pub mod operate;
pub mod provider_batches;
pub mod statistics;
pub mod usage;
pub mod webhooks;

pub use batches::*;
pub use buckets::*;
pub use control::*;
pub use files::*;
pub use forecast::*;
pub use gate::*;
pub use jobs::*;
pub use learned::*;
pub use observe::*;
pub use operate::*;
pub use provider_batches::*;
pub use statistics::*;
pub use usage::*;
pub use webhooks::*;

/// Channel on which a job's id is announced when it reaches a terminal state.
pub const CHANNEL_JOB_DONE: &str = "tollgate_job_done";
/// Channel on which newly admitted work is announced to dispatchers (payload empty).
pub const CHANNEL_JOBS_READY: &str = "tollgate_jobs_ready";
/// Channel on which the gate is told that queued work or capacity appeared.
pub const CHANNEL_GATE: &str = "tollgate_gate";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("stored value could not be encoded: {0}")]
    Encode(#[from] serde_json::Error),
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// The database server's time at this moment (`clock_timestamp()`, not the transaction's
/// start): the one time every process agrees on, for a process's clock to sample.
pub async fn database_time(ex: impl sqlx::PgExecutor<'_>) -> Result<chrono::DateTime<chrono::Utc>> {
    Ok(sqlx::query_scalar!(r#"SELECT clock_timestamp() AS "now!""#)
        .fetch_one(ex)
        .await?)
}
