//! End-to-end tests: real PostgreSQL (the embedded bootstrap, or the server named by
//! `DATABASE_URL`; a fresh database per test), the real broker on port 0, and the
//! project's mock provider over real HTTP.
//!
//! - [`harness`]: fresh databases, the app with its mock provider, HTTP helpers.
//! - [`lifecycle`]: submit, long-poll, results from both provider kinds, idempotency,
//!   cancel, listing, tenant isolation, the synchronous endpoint, retries.
//! - [`bad_input`]: every kind of bad request gets a 4xx with a stable code.
//! - [`durability`]: rescued leases, and SIGKILL of the real binary mid-job.
//! - [`batches`]: files and batches (OpenAI's APIs) — also driven by the official `openai`
//!   Python package — 10k lines with malformed ones, across a SIGKILL.
//! - [`webhooks`]: signed deliveries to a receiver that is down for a while, 410.
//! - [`python`]: the venv (under `target/`) the Python checks run in.
//! - [`cli`]: the client commands of the real binary (`submit`, `jobs`, `status`, `batches`,
//!   `files`), a refused key, `--version` and a bare `tollgate`.
//! - [`dashboard`]: the dashboard in headless Chromium, checked against the API.
//! - [`console`]: pauses, retries and job search through the API, and the console driven
//!   in Chromium over WebDriver, the API agreeing with every click.
//! - [`observe`]: OpenAPI, metrics, status, the CLI and the dashboard.
//! - [`faults`]: the mock's fault mix on a few hundred jobs: every fault classified,
//!   nothing stuck, deadlines kept, buckets full again.
//! - [`chaos`]: ten SIGKILLs of `tollgate serve` mid-run, and a PostgreSQL restart under
//!   it: every job finished once, every webhook event delivered.
//! - [`endpoints`]: embeddings (synchronous, queued, refused where no target serves them,
//!   under TPM on three processes), the model list, bare provider model names.
//! - [`edge`]: the HTTP edge against unfair clients: slow headers, idle and surplus
//!   connections, key guessing, `/metrics` without an admin key, U+0000 in and out.
//! - [`security`]: hostile input limits, the auth matrix over every endpoint, provider
//!   keys never leaking, API rate limits.
//! - [`schemathesis`]: generated requests against `/openapi.json`: no 5xx, schema-true.
//! - [`migrations`]: each migration applied to a database holding rows of the one before;
//!   no migration adds a required column without a default.
//! - [`adapters`]: Gemini and Azure OpenAI targets: results in OpenAI format, usage,
//!   streaming, and a Gemini 429 body teaching a limit.
//! - [`reservations`]: what a job reserves covers what its provider charges (`n` choices,
//!   the output cap sent when the request sets none).
//! - [`clock`]: processes whose clocks are off rescue no live job; a lost lease stops its
//!   call (plain or streamed); a handed-over job cancelled while waiting is not sent; a gate
//!   whose lock connection died admits nothing.
//! - [`forecasts`]: each job's and batch's `eta`; a deadline out of reach refused with the
//!   earliest feasible time, nothing written; three processes' submitters not over-booking
//!   one limited route.
//! - [`quotas`]: a tenant's queue caps and file quotas hold exactly under racing clients
//!   on two processes.
//! - [`control`]: tenants and keys made, used and revoked through different processes
//!   within a second; the admin API's refusals; a parent's budget over two processes;
//!   `SIGHUP` reloading the file's tenants.
//! - [`usage`]: each job's cost at the configured prices, and `GET /v1/usage` summing them
//!   per tenant, as grouped, in JSON and CSV.
//! - [`telemetry`]: each job's trace over OTLP, one tree under its client's `traceparent`;
//!   the log as JSON lines, the request log among them.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed test should stop right there

mod adapters;
mod bad_input;
mod batches;
mod bulk;
mod chaos;
mod cli;
mod clock;
mod clouds;
mod console;
mod control;
mod dashboard;
mod durability;
mod edge;
mod endpoints;
mod faults;
mod forecasts;
mod gate;
mod harness;
mod lanes;
mod learning;
mod lifecycle;
mod migrations;
mod observe;
mod provider_batches;
mod python;
mod quotas;
mod reservations;
mod schemathesis;
mod security;
mod streaming;
mod telemetry;
mod usage;
mod webhooks;
