//! tollgate workers: everything that runs in the background.
//!
//! - [`dispatcher`]: claims runnable jobs, calls providers, writes outcomes back.
//! - [`providers`]: provider adapters (OpenAI, OpenAI-compatible, Anthropic).
//! - [`maintenance`]: rescues expired leases, expires deadlines.
//! - [`mock_provider`]: an HTTP server that behaves like OpenAI and Anthropic, limits
//!   and errors included, for tests, the demo and benchmarks.
//!
//! Data flow: `dispatcher` claims through `tollgate::store`, sends through `providers`,
//! classifies failures with `tollgate::retry`, and writes back through `tollgate::store`;
//! `maintenance` returns stranded work to the queue for any dispatcher to claim.

pub mod dispatcher;
pub mod maintenance;
pub mod mock_provider;
pub mod providers;
