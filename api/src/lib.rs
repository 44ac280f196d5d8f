//! tollgate API and process wiring.
//!
//! - [`router`]: the axum routes (jobs, OpenAI-compatible chat, health), callable without
//!   a socket.
//! - [`jobs`]: submit, read/long-poll, list, cancel; shared validation and enqueueing.
//! - [`chat`]: `POST /v1/chat/completions`, queued as an interactive job and awaited.
//! - [`limits`]: the buckets that apply to the caller, and what is left in them.
//! - [`files`]: OpenAI's Files API (JSONL uploads, output and error files).
//! - [`batches`]: OpenAI's Batch API: ingest of a JSONL file into jobs, status, cancel.
//! - [`auth`]: bearer tenant key → tenant.
//! - [`error`]: `ApiError`, status + stable code + safe message.
//! - `paging`: OpenAI-style cursor lists (`limit`, `after`, `has_more`).
//! - [`broker`]: starts the roles of one process (API, dispatcher, maintenance,
//!   notifications) and runs the shutdown sequence; `serve`, `demo` and tests use it.
//! - [`local`]: a whole stack on this machine (database, mock provider, broker).
//! - [`demo`]: `tollgate demo`, the whole system on one machine with a sample workload.
//! - [`bench`]: `tollgate bench`, end-to-end throughput beside a direct-to-provider baseline.
//!
//! The `tollgate` binary (`src/main.rs`) lives in this crate because it wires the API and
//! the workers together.

pub mod auth;
pub mod batches;
pub mod bench;
pub mod broker;
pub mod chat;
pub mod demo;
pub mod error;
pub mod files;
pub mod jobs;
pub mod limits;
pub mod local;
pub(crate) mod paging;

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use sqlx::PgPool;
use tokio_util::task::TaskTracker;
use tollgate::config::Config;
use tollgate::notify::Notifications;
use tollgate::tenants::TenantDirectory;
use tollgate_workers::dispatcher::Dispatcher;

use crate::error::ApiError;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<Config>,
    pub tenants: Arc<TenantDirectory>,
    pub notifications: Notifications,
    /// Runs streaming chat completions for clients connected to this process.
    pub dispatcher: Dispatcher,
    /// The relay tasks of those streams (waited for at shutdown).
    pub relays: TaskTracker,
}

pub fn router(state: AppState) -> Router {
    let max_body = state.config.server.max_body_bytes;
    Router::new()
        .route("/v1/jobs", post(jobs::submit).get(jobs::list))
        .route("/v1/jobs/{id}", get(jobs::get))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel))
        .route("/v1/chat/completions", post(chat::completions))
        .route("/v1/limits", get(limits::list))
        .route(
            "/v1/files",
            // Uploads stream and enforce `batches.max_file_bytes` themselves.
            post(files::upload)
                .layer(DefaultBodyLimit::disable())
                .get(files::list),
        )
        .route("/v1/files/{id}", get(files::get).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/batches", post(batches::create).get(batches::list))
        .route("/v1/batches/{id}", get(batches::get))
        .route("/v1/batches/{id}/cancel", post(batches::cancel))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no_such_endpoint", "no such endpoint") })
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// Ready when the database answers.
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    match sqlx::query("SELECT 1").execute(&state.pool).await {
        Ok(_) => (StatusCode::OK, "ready").into_response(),
        Err(e) => ApiError::unavailable(e).into_response(),
    }
}
