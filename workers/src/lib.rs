//! tollgate workers: everything that runs in the background.
//!
//! - [`gate`]: the gate role — elected by an advisory lock, it runs admission rounds
//!   around the pure `tollgate::scheduler`, admits interactive arrivals at once, and starts
//!   what its own process's dispatcher has room for.
//! - [`dispatcher`]: claims admitted jobs (or takes those the gate hands over), calls
//!   providers, writes outcomes back in batches; runs streaming jobs for the API. One
//!   module per concern inside (execute, handover, completer, heartbeat, stream, shutdown).
//! - [`providers`]: provider adapters (OpenAI, OpenAI-compatible, Anthropic), streaming
//!   included.
//! - [`maintenance`]: rescues expired leases, expires deadlines, recalibrates estimates,
//!   finalizes batches ([`batches`]) and prunes old rows ([`retention`]).
//! - [`batches`]: ends batches and writes their output and error files.
//! - [`provider_batches`]: packs provider-batch jobs, submits them to providers' batch
//!   APIs, polls, and writes results back at the batch price.
//! - [`retention`]: deletes finished jobs, batches, files and deliveries past retention.
//! - [`webhooks`]: the webhook sender (signed, retried, SSRF-guarded) draining the outbox.
//! - [`observe`]: what each provider call reports to the metrics.
//! - [`fuzz_bodies`]: the fuzz targets' bodies for what providers answer (responses,
//!   streams, batch results).
//!
//! Data flow: `gate` reads queued jobs and locks buckets through `tollgate::store`, decides
//! with `tollgate::scheduler`, and writes admissions back (handing started jobs to the
//! local `dispatcher`); `dispatcher` claims through `tollgate::store`, sends through
//! `providers`, asks `tollgate::retry` what follows a failure, and writes the attempt's
//! `tollgate::attempt::Outcome` back through `tollgate::store`;
//! `maintenance` returns stranded work to the queue for any dispatcher to claim.

pub mod batches;
pub mod dispatcher;
pub mod fuzz_bodies;
pub mod gate;
pub mod maintenance;
pub mod observe;
pub mod provider_batches;
pub mod providers;
pub mod retention;
pub mod webhooks;
