//! tollgate API and process wiring.
//!
//! - [`router`]: the axum routes (jobs, OpenAI-compatible chat, health), callable without
//!   a socket; [`routes`] declares each endpoint once, with its OpenAPI description.
//! - [`openapi`]: `GET /openapi.json`, the document's frame and hand-built bodies' schemas.
//! - [`jobs`]: submit, read/long-poll, list, cancel; shared validation and enqueueing.
//! - [`forecasts`]: every job's and batch's `eta` at submission, and the deadline check
//!   that refuses what cannot finish in time (`deadline_unmeetable`), one step with the
//!   insert across processes.
//! - [`bulk`]: `POST /v1/jobs/bulk`, read item by item off the runtime, inserted at once.
//! - [`chat`]: `POST /v1/chat/completions` and `POST /v1/embeddings`, queued as
//!   interactive jobs and awaited.
//! - `requests`: what each endpoint's request must hold; its model resolved, its tokens
//!   estimated (every way in checks through it).
//! - [`models`]: `GET /v1/models`, the names a tenant may put in `model`.
//! - [`messages`]: Anthropic's `POST /v1/messages` and `count_tokens`, queued and awaited.
//! - [`message_batches`]: Anthropic's Message Batches, as batches of `/v1/messages` jobs.
//! - [`limits`]: the buckets that apply to the caller, and what is left in them.
//! - [`files`]: OpenAI's Files API (JSONL uploads, output and error files).
//! - [`batches`]: OpenAI's Batch API: ingest of a JSONL file into jobs, status, cancel.
//! - [`auth`]: bearer tenant key → tenant; the admin key → every tenant.
//! - [`admin`]: the admin API: tenants, their keys, provider keys and routes, changed at
//!   runtime.
//! - [`operate`]: retry a job, a job's provider calls, pause and resume a tenant, a route
//!   or a provider model.
//! - [`status`]: `/v1/status` and its history: queues, buckets, traffic, failures.
//! - [`metrics`]: `GET /metrics`, Prometheus text (events and database levels).
//! - [`error`]: `ApiError`, status + stable code + safe message.
//! - [`guard`]: before every handler: header size, the tenant's API request rate.
//! - [`observed`]: around every request: the request log, and the client's trace context
//!   for the jobs it submits.
//! - `paging`: OpenAI-style cursor lists (`limit`, `after`, `has_more`).
//! - [`serve`]: the HTTP server: header, idle and body timeouts, the connection cap.
//! - [`broker`]: starts the roles of one process (API, dispatcher, maintenance,
//!   notifications) and runs the shutdown sequence; `serve`, `demo` and tests use it.
//! - [`cli`]: the client commands (`status`, `jobs`, `submit`, `batches`, `files`) against
//!   a running server.
//! - [`dashboard`]: `GET /dashboard`, the console (assets embedded from `api/assets/`).
//! - [`fuzz_bodies`]: the fuzz targets' bodies for client input (JSON bodies, uploads).
//!
//! The `tollgate` binary is the `tollgate-cli` crate (`cli/`): it wires this crate, the
//! workers, the mock provider and the benchmarks together, so none of them depends on
//! another it should not.

pub mod admin;
pub mod arrivals;
pub mod auth;
pub mod batches;
pub mod broker;
pub mod bulk;
pub mod chat;
pub mod cli;
pub mod dashboard;
pub mod error;
pub mod files;
pub mod forecasts;
pub mod fuzz_bodies;
pub mod guard;
pub mod inserts;
pub mod jobs;
pub mod limits;
pub mod message_batches;
pub mod messages;
pub mod metrics;
pub mod models;
pub mod observed;
pub mod openapi;
pub mod operate;
pub(crate) mod paging;
pub(crate) mod queue_updates;
pub(crate) mod requests;
pub mod serve;
pub mod status;
pub mod supervise;
pub mod usage;

use std::sync::Arc;
use tollgate::vocab::ApiErrorCode;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
pub use sqlx::PgPool;
use tokio_util::task::TaskTracker;
use tollgate::config::Config;
use tollgate::notify::Notifications;
use tollgate_workers::dispatcher::Dispatcher;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::ApiError;

/// What every handler shares, behind one reference count: the router clones it for every
/// request.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The parts of [`AppState`].
pub struct Shared {
    pub pool: PgPool,
    pub config: Arc<Config>,
    /// The tenants and keys, kept current with the control plane.
    pub tenants: tollgate::control::Directory,
    pub notifications: Notifications,
    /// Runs streaming chat completions for clients connected to this process.
    pub dispatcher: Dispatcher,
    /// The relay tasks of those streams (waited for at shutdown).
    pub relays: TaskTracker,
    /// Admission on arrival for interactive jobs, when this process runs the gate and
    /// dispatches too.
    pub arrivals: Option<arrivals::Arrivals>,
    /// Single jobs inserted together.
    pub inserts: inserts::Inserts,
    /// `/readyz`'s last probe, shared by the probes of the next second.
    pub readiness: Readiness,
    /// Capped queues recently counted full, so that a flood to one is refused uncounted.
    pub queue_room: jobs::QueueRoom,
    /// The time jobs' creation and deadlines are reckoned in: the database's.
    pub clock: tollgate::clock::Clock,
    /// Each tenant's API rate, counted by the guard and charged by bulks per job.
    pub tenant_rate: guard::TenantRate,
    /// Forecasts at submission: their slow inputs, read at most every few seconds.
    pub forecasts: Arc<forecasts::Forecaster>,
}

/// The last database probe `/readyz` made and when: however many probes arrive, the
/// database sees at most one a second (and one at a time).
#[derive(Clone, Default)]
pub struct Readiness(Arc<tokio::sync::Mutex<Option<Probe>>>);

/// When a probe ran, and what it found (why the database is unavailable).
type Probe = (std::time::Instant, Result<(), String>);

/// Every endpoint, each with its OpenAPI description (`#[utoipa::path]` on the handler):
/// the router and `/openapi.json` are both built from this, so neither can miss a route.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(jobs::submit, jobs::list))
        .routes({
            // Bulk bodies have their own limit (`server.max_bulk_body_bytes`), read by the handler.
            let (schemas, paths, method) = routes!(bulk::submit);
            (schemas, paths, method.layer(DefaultBodyLimit::disable()))
        })
        .routes(routes!(jobs::get))
        .routes(routes!(jobs::cancel))
        .routes(routes!(operate::retry))
        .routes(routes!(operate::attempts))
        .routes(routes!(chat::completions))
        .routes(routes!(chat::embeddings))
        .routes(routes!(chat::responses))
        .routes(routes!(chat::moderations))
        .routes(routes!(chat::text_completions))
        .routes({
            // Anthropic's SDKs read errors in Anthropic's shape.
            let (schemas, paths, method) = routes!(messages::create);
            let errors = axum::middleware::map_response(messages::anthropic_errors);
            (schemas, paths, method.layer(errors))
        })
        .routes({
            let (schemas, paths, method) = routes!(messages::count_tokens);
            let errors = axum::middleware::map_response(messages::anthropic_errors);
            (schemas, paths, method.layer(errors))
        })
        .routes({
            // A Message Batch's requests come inline: up to `batches.max_file_bytes`, read
            // by the handler.
            let (schemas, paths, method) = routes!(message_batches::create, message_batches::list);
            let errors = axum::middleware::map_response(messages::anthropic_errors);
            let method = method.layer(DefaultBodyLimit::disable());
            (schemas, paths, method.layer(errors))
        })
        .routes({
            let (schemas, paths, method) = routes!(message_batches::get, message_batches::delete);
            let errors = axum::middleware::map_response(messages::anthropic_errors);
            (schemas, paths, method.layer(errors))
        })
        .routes({
            let (schemas, paths, method) = routes!(message_batches::cancel);
            let errors = axum::middleware::map_response(messages::anthropic_errors);
            (schemas, paths, method.layer(errors))
        })
        .routes({
            let (schemas, paths, method) = routes!(message_batches::results);
            let errors = axum::middleware::map_response(messages::anthropic_errors);
            (schemas, paths, method.layer(errors))
        })
        .routes(routes!(models::list))
        .routes(routes!(models::get))
        .routes(routes!(models::get_qualified))
        .routes(routes!(limits::list))
        .routes(routes!(usage::get))
        .routes({
            // Uploads stream and enforce `batches.max_file_bytes` themselves.
            let (schemas, paths, method) = routes!(files::upload, files::list);
            (schemas, paths, method.layer(DefaultBodyLimit::disable()))
        })
        .routes(routes!(files::get, files::delete))
        .routes(routes!(files::content))
        .routes(routes!(batches::create, batches::list))
        .routes(routes!(batches::get, batches::update))
        .routes(routes!(batches::cancel))
        .routes(routes!(batches::pause))
        .routes(routes!(batches::resume))
        .routes(routes!(batches::results))
        .routes(routes!(admin::create_tenant, admin::list_tenants))
        .routes(routes!(
            admin::get_tenant,
            admin::update_tenant,
            admin::delete_tenant
        ))
        .routes(routes!(admin::create_key, admin::list_keys))
        .routes(routes!(admin::revoke_key))
        .routes(routes!(admin::add_provider_key, admin::list_provider_keys))
        .routes(routes!(admin::change_provider_key, admin::remove_provider_key))
        .routes(routes!(operate::pause, operate::list_pauses))
        .routes(routes!(operate::resume))
        .routes(routes!(admin::add_route, admin::list_routes))
        .routes(routes!(admin::change_route, admin::remove_route))
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(openapi::openapi_json))
        .routes(routes!(status::get))
        .routes(routes!(status::history))
        .routes(routes!(metrics::scrape))
        .routes(routes!(dashboard::page))
        .routes(routes!(dashboard::script))
        .routes(routes!(dashboard::style))
        .routes(routes!(dashboard::chart_script))
        .routes(routes!(dashboard::chart_style))
}

pub fn router(state: AppState) -> Router {
    let max_body = state.config.server.max_body_bytes;
    metrics::recorder();
    let guard = guard::Guard::new(&state);
    let (routes, _) = routes().split_for_parts();
    routes
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                ApiErrorCode::NoSuchEndpoint,
                "no such endpoint",
            )
        })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            after_answers_recorded,
        ))
        .layer(axum::middleware::from_fn_with_state(guard, guard::check))
        .layer(axum::middleware::from_fn(observed::observe))
        .layer(axum::middleware::map_response(protective_headers))
        .with_state(state)
}

/// Longest a request waits for the records of the answers this process has given.
const ANSWERS_RECORDED_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// A synchronous call is answered before its outcome is written
/// ([`Notifications::answer_early`]); every other API request here first waits for the
/// records of the answers already given, so a caller who reads, lists or cancels what it
/// was just answered finds it written. Synchronous calls themselves do not wait, nor do the
/// probes and the metrics (outside `/v1/`): a liveness probe must not hang on a database
/// that is slow to take the outcomes.
async fn after_answers_recorded(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let path = request.uri().path();
    let synchronous_call =
        request.method() == axum::http::Method::POST && path.parse::<tollgate::vocab::Endpoint>().is_ok();
    if path.starts_with("/v1/") && !synchronous_call {
        state
            .notifications
            .answers_recorded(ANSWERS_RECORDED_WITHIN)
            .await;
    }
    next.run(request).await
}

/// The probes alone (`/healthz`, `/readyz`): what a process without the API role serves.
pub fn probes(state: AppState) -> Router {
    Router::new()
        .route("/healthz", axum::routing::get(healthz))
        .route("/readyz", axum::routing::get(readyz))
        .with_state(state)
}

/// On every answer: no content sniffing, no framing by other sites, no referrer to
/// them. The dashboard page adds its own `Content-Security-Policy` (`dashboard`).
async fn protective_headers(mut response: axum::response::Response) -> axum::response::Response {
    use axum::http::{HeaderValue, header};
    let headers = response.headers_mut();
    for (name, value) in [
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
    ] {
        headers.entry(name).or_insert(HeaderValue::from_static(value));
    }
    response
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, description = "`ok`", body = String)))]
async fn healthz() -> &'static str {
    "ok"
}

/// Ready when the database answers.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "`ready`", body = String),
        (status = 503, description = "`database_unavailable`", body = openapi::ErrorBody),
    )
)]
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let mut last = state.readiness.0.lock().await;
    let fresh = last
        .as_ref()
        .filter(|(at, _)| at.elapsed() < READY_PROBE_REUSE)
        .map(|(_, outcome)| outcome.clone());
    let outcome = match fresh {
        Some(outcome) => outcome,
        None => {
            // Bounded well below the pool's acquire timeout: while the database restarts a
            // probe must say "not ready" promptly, not hang.
            let probe = sqlx::query("SELECT 1").execute(&state.pool);
            let outcome = match tokio::time::timeout(READY_PROBE_TIMEOUT, probe).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no database connection within the probe timeout".to_owned()),
            };
            *last = Some((std::time::Instant::now(), outcome.clone()));
            outcome
        }
    };
    drop(last);
    match outcome {
        Ok(()) => (StatusCode::OK, "ready").into_response(),
        Err(reason) => ApiError::unavailable(reason).into_response(),
    }
}

/// How long one `/readyz` probe's outcome answers the probes after it.
const READY_PROBE_REUSE: std::time::Duration = std::time::Duration::from_secs(1);
/// How long `/readyz` waits for the database before answering 503.
const READY_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
