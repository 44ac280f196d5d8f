//! tollgate core: what every role shares.
//!
//! - [`config`]: the TOML configuration, its defaults and validation.
//! - [`model`]: jobs, their ids, states and classes.
//! - [`store`]: all SQL — insert, claim, complete, rescue — as small functions.
//! - [`db`]: connecting (URL or [`embedded`] PostgreSQL) and migrating ([`MIGRATOR`]).
//! - [`notify`]: one LISTEN connection per process, fanned out to waiters.
//! - [`tenants`]: API key → tenant.
//! - [`routing`]: requested model (route alias or `provider/model`) → provider targets.
//! - [`estimate`]: token demand of a request, made at submit time.
//! - [`buckets`]: limits as buckets, a job's path through them, their arithmetic.
//! - [`scheduler`]: admission policy, pure — class precedence, weighted fair queuing over
//!   tenants, bucket fit, failure verdicts and wait notes (its [`scheduler::plan`] makes a
//!   queued job into what it decides on).
//! - [`gate`]: the hand-over from the gate role to its own process's dispatcher.
//! - [`provider_batches`]: provider batch APIs as a scheduling choice for `batch` jobs.
//! - [`retry`]: failure classification and the retry policy.
//! - [`batches`]: files and batches (OpenAI's Files and Batch APIs): ids, statuses, rows,
//!   and the JSONL input's line splitter and envelope check.
//! - [`webhook_signing`]: Standard Webhooks secrets and signatures.
//! - [`ratelimit`]: what providers say about their limits (headers, 429 bodies), parsed.
//! - [`learning`]: learned limits — readings and 429s turned into bucket capacities.
//! - [`metrics`]: metric names, and the one-line helpers the gate and dispatchers call.
//! - `fuzz_bodies`: the fuzz targets' bodies (`fuzz/`), also replayed by `cargo test`.
//!
//! Data flow: the API (`tollgate-api`) authenticates through `tenants`, resolves through
//! `routing`, estimates, and inserts through `store` (state `queued`); the gate role
//! (`tollgate-workers`) reads queued jobs through `store`, lets the `scheduler` admit those
//! whose `buckets` can hold them, and writes them `admitted` (reservations held);
//! dispatchers (`tollgate-workers`) claim admitted jobs through `store`, call providers,
//! classify failures through `retry`, and write results back through `store`, settling
//! the reservations; NOTIFYs reach waiters through `notify`.

pub mod batches;
pub mod buckets;
pub mod config;
pub mod db;
pub mod embedded;
pub mod estimate;
#[doc(hidden)]
pub mod fuzz_bodies;
pub mod gate;
pub mod learning;
pub mod metrics;
pub mod model;
pub mod notify;
pub mod provider_batches;
pub mod ratelimit;
pub mod retry;
pub mod routing;
pub mod scheduler;
pub mod store;
pub mod tenants;
pub mod webhook_signing;

/// The schema's migrations; every crate's database code and tests use this one.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");
