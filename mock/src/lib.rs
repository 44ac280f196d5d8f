//! The mock LLM provider: a real HTTP server that speaks enough of the OpenAI Chat
//! Completions, Anthropic Messages, Gemini `generateContent`, Azure OpenAI, AWS Bedrock
//! Converse and Google Vertex AI APIs —
//! headers, error bodies and rate-limit semantics as in `docs/PROVIDERS.md` §1–4 — for tests,
//! the demo and benchmarks.
//!
//! Modules, in request order:
//! - `config`: TOML schema ([`MockConfig`]) with documented defaults, and validation.
//! - `openai` / `anthropic` / `gemini` / `azure` / `bedrock` / `vertex`: the route handlers;
//!   auth (Bedrock's SigV4 verified, Vertex's OAuth2 tokens issued), body checks, the
//!   provider's header set and error shapes.
//! - `request`: the body fields the mock reads and the token-count rule
//!   (`3 + Σ (4 + ceil(chars/4))`, Anthropic `system` counted as one more message).
//! - `buckets`: per-project limiter — continuous-refill per-minute buckets (RPM, TPM,
//!   ITPM, OTPM) and a UTC-day RPD window, admitting all-or-nothing.
//! - `audit`: an independent check that what was admitted never exceeds the limits.
//! - `faults`: the random fault mix — seeded draws, resets, hangs, spoiled bodies.
//! - `batch_state` / `openai_batch` / `anthropic_batch` / `gemini_batch`: the batch APIs
//!   (OpenAI Files + Batch, also Azure's Global Batch; Anthropic Message Batches; Gemini
//!   Batch Mode and its resumable uploads), in memory, processing lines at
//!   [`BatchMockConfig::lines_per_sec`] with deterministic failures and expiries.
//! - `stream`: the SSE bodies of `"stream": true` requests and their accounting.
//! - `stats`: atomic counters and the [`MockStats`] snapshot.
//! - `clock`: time since start (tests pin it).
//!
//! A model request flows: key → project (401) → body (400) → model (404) → fault window
//! (5xx, nothing charged) → fault mix (5xx, reset, hang, HTML page) → limiter under the project's mutex (429, nothing charged) →
//! latency sleep with no lock held → OTPM correction → 200 (which the fault mix may
//! truncate or strip of `usage`). A `"stream": true` request
//! is admitted the same way (errors stay plain JSON responses), then answered 200 with
//! an SSE body that spends the latency between its events and settles OTPM when it ends
//! or the client drops it (`stream`). Control routes:
//! `GET /mock/stats`, `POST /mock/limits/{project}`, `POST /mock/reset`.

mod anthropic;
mod anthropic_batch;
mod audit;
mod azure;
mod batch_state;
mod bedrock;
mod buckets;
mod clock;
mod config;
mod faults;
mod gemini;
mod gemini_batch;
mod openai;
mod openai_batch;
mod openai_completions;
mod openai_responses;
mod reply;
mod request;
mod stats;
mod stream;
mod vertex;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio_util::sync::CancellationToken;

pub use config::{
    BatchMockConfig, FaultConfig, FaultMix, MockConfig, MockConfigError, ProjectConfig, ProjectLimits,
    ProviderKind,
};
pub use faults::InjectedFaults;
pub use stats::{MockStats, ProjectStats};

use buckets::{Admission, Charge, Limiter, LimitsView};
use clock::Clock;
use request::CannedText;
use stats::{ProjectCounters, Totals};

/// Largest request body read, in bytes.
const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// The mock provider; cheap to clone (shared state behind an `Arc`).
#[derive(Clone)]
pub struct MockProvider {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MockProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockProvider")
            .field("projects", &self.inner.projects.len())
            .finish_non_exhaustive()
    }
}

/// One project at run time.
struct Project {
    name: String,
    /// `org-<name>`, sent as the organization header.
    org: Option<axum::http::HeaderValue>,
    /// Accepted models; empty = any.
    models: HashSet<String>,
    /// A `vertex` project: the public key its service accounts' JWTs are verified with.
    public_key: Option<String>,
    /// Held only for bucket arithmetic, never across an await.
    limiter: Mutex<Limiter>,
    counters: ProjectCounters,
}

/// A fault window resolved against the project list.
struct Fault {
    /// Project index; `None` = all projects.
    project: Option<usize>,
    start_ns: u64,
    /// Exclusive end; `None` = forever.
    end_ns: Option<u64>,
    status: StatusCode,
    probability: f64,
}

#[derive(Clone, Copy)]
struct KeyEntry {
    project: usize,
    revoked: bool,
}

/// Outcome of looking up an API key on one API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyLookup {
    Valid(usize),
    Revoked,
    Unknown,
}

struct Inner {
    latency: Duration,
    latency_per_output_token: Duration,
    output_tokens: u64,
    send_rate_limit_headers: bool,
    projects: Vec<Project>,
    by_name: HashMap<String, usize>,
    /// Keys per API: a key works only on its project's API.
    keys: HashMap<ProviderKind, HashMap<String, KeyEntry>>,
    faults: Vec<Fault>,
    /// The random fault mix; `None` when every share is 0.
    mix: Option<faults::Mix>,
    clock: Clock,
    totals: Totals,
    text: CannedText,
    /// Files and batches of the batch APIs (`batch_state`).
    batches: Mutex<batch_state::BatchState>,
    batch_config: BatchMockConfig,
    /// Vertex AI access tokens issued: their project and expiry (Unix seconds).
    vertex_tokens: Mutex<HashMap<String, (usize, i64)>>,
    flex_unavailable_every_nth: u64,
}

impl MockProvider {
    /// Builds the provider; time (fault windows, buckets) starts now. An invalid config
    /// does not panic: the first project of a name and the first use of a key win, and
    /// faults naming unknown projects are dropped (see [`MockConfig::validate`]).
    pub fn new(config: MockConfig) -> Self {
        Self::with_clock(config, Clock::system())
    }

    fn with_clock(config: MockConfig, clock: Clock) -> Self {
        let mut projects = Vec::with_capacity(config.projects.len());
        let mut by_name = HashMap::new();
        let mut all_keys: HashMap<ProviderKind, HashMap<String, KeyEntry>> = HashMap::new();
        for p in &config.projects {
            if by_name.contains_key(&p.name) {
                tracing::warn!(project = %p.name, "mock config repeats a project name; ignored");
                continue;
            }
            let idx = projects.len();
            by_name.insert(p.name.clone(), idx);
            let keys = all_keys.entry(p.kind).or_default();
            let valid = p.keys.iter().map(|k| (k, false));
            let revoked = p.revoked_keys.iter().map(|k| (k, true));
            for (key, revoked) in valid.chain(revoked) {
                keys.entry(key.clone()).or_insert(KeyEntry {
                    project: idx,
                    revoked,
                });
            }
            projects.push(Project {
                name: p.name.clone(),
                org: axum::http::HeaderValue::from_str(&format!("org-{}", p.name)).ok(),
                models: p.models.iter().cloned().collect(),
                public_key: p.public_key.clone(),
                limiter: Mutex::new(Limiter::new(p.limits(), &clock)),
                counters: ProjectCounters::default(),
            });
        }
        let faults = config
            .faults
            .iter()
            .filter_map(|f| {
                let project = match &f.project {
                    None => None,
                    Some(name) => Some(*by_name.get(name)?),
                };
                let start_ns = f.start_ms.saturating_mul(1_000_000);
                Some(Fault {
                    project,
                    start_ns,
                    end_ns: (f.duration_ms > 0)
                        .then(|| start_ns.saturating_add(f.duration_ms.saturating_mul(1_000_000))),
                    status: StatusCode::from_u16(f.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                    probability: f.probability,
                })
            })
            .collect();
        let inner = Inner {
            latency: Duration::from_millis(config.latency_ms),
            latency_per_output_token: Duration::from_micros(config.latency_per_output_token_us),
            output_tokens: config.output_tokens,
            send_rate_limit_headers: config.send_rate_limit_headers,
            projects,
            by_name,
            keys: all_keys,
            faults,
            mix: faults::Mix::new(&config.fault_mix),
            clock,
            totals: Totals::default(),
            text: CannedText::new(config.output_tokens),
            batches: Mutex::new(batch_state::BatchState::default()),
            batch_config: config.batch,
            vertex_tokens: Mutex::default(),
            flex_unavailable_every_nth: config.flex_unavailable_every_nth,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// All routes: `POST /v1/chat/completions`, `POST /v1/messages`, the batch APIs
    /// (`/v1/files`, `/v1/batches`, `/v1/messages/batches`: see `openai_batch`,
    /// `anthropic_batch`),
    /// `POST /v1beta/models/{model}:generateContent` and `:batchGenerateContent`, Gemini's
    /// batches and files (`gemini_batch`),
    /// `POST /openai/deployments/{deployment}/chat/completions`, Bedrock's
    /// `POST /model/{model}/converse(-stream)` (`bedrock`), Vertex AI's `POST /token` and
    /// model routes (`vertex`), `GET /mock/stats`,
    /// `POST /mock/limits/{project}` (body: [`ProjectLimits`]), `POST /mock/reset`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(openai::chat_completions))
            .route("/v1/embeddings", post(openai::embeddings))
            .route("/v1/responses", post(openai_responses::responses))
            .route("/v1/moderations", post(openai::moderations))
            .route("/v1/completions", post(openai_completions::completions))
            .route("/v1/messages", post(anthropic::messages))
            .route("/v1beta/models/{model_action}", post(gemini::generate_content))
            .route("/v1beta/batches", get(gemini_batch::list_batches))
            .route(
                "/v1beta/batches/{id}",
                get(gemini_batch::get_batch).post(gemini_batch::cancel_batch),
            )
            .route("/upload/v1beta/files", post(gemini_batch::upload))
            .route("/download/v1beta/files/{id_action}", get(gemini_batch::download))
            .route(
                "/openai/deployments/{deployment}/chat/completions",
                post(azure::chat_completions),
            )
            .route("/model/{model}/{operation}", post(bedrock::converse))
            .route("/token", post(vertex::token))
            .route(
                "/v1/projects/{project}/locations/{location}/publishers/{publisher}/models/{model_action}",
                post(vertex::predict),
            )
            .route(
                "/v1/files",
                post(openai_batch::upload_file::<openai_batch::OpenAi>),
            )
            .route(
                "/v1/files/{id}/content",
                get(openai_batch::file_content::<openai_batch::OpenAi>),
            )
            .route(
                "/v1/batches",
                post(openai_batch::create_batch::<openai_batch::OpenAi>)
                    .get(openai_batch::list_batches::<openai_batch::OpenAi>),
            )
            .route(
                "/openai/files",
                post(openai_batch::upload_file::<openai_batch::Azure>),
            )
            .route(
                "/openai/files/{id}/content",
                get(openai_batch::file_content::<openai_batch::Azure>),
            )
            .route(
                "/openai/batches",
                post(openai_batch::create_batch::<openai_batch::Azure>)
                    .get(openai_batch::list_batches::<openai_batch::Azure>),
            )
            .route(
                "/openai/batches/{id}",
                get(batch_state::get_batch::<openai_batch::Azure>),
            )
            .route(
                "/openai/batches/{id}/cancel",
                post(batch_state::cancel_batch::<openai_batch::Azure>),
            )
            .route(
                "/v1/batches/{id}",
                get(batch_state::get_batch::<openai_batch::OpenAi>),
            )
            .route(
                "/v1/batches/{id}/cancel",
                post(batch_state::cancel_batch::<openai_batch::OpenAi>),
            )
            .route("/v1/messages/batches", post(anthropic_batch::create_batch))
            .route(
                "/v1/messages/batches/{id}",
                get(batch_state::get_batch::<anthropic_batch::Anthropic>),
            )
            .route("/v1/messages/batches/{id}/results", get(anthropic_batch::results))
            .route(
                "/v1/messages/batches/{id}/cancel",
                post(batch_state::cancel_batch::<anthropic_batch::Anthropic>),
            )
            .route("/mock/stats", get(stats_route))
            .route("/mock/limits/{project}", post(limits_route))
            .route("/mock/reset", post(reset_route))
            .with_state(self.clone())
    }

    /// Snapshot of the counters.
    pub fn stats(&self) -> MockStats {
        let inner = &self.inner;
        let mut s = MockStats::default();
        inner.totals.fill(&mut s);
        for (idx, p) in inner.projects.iter().enumerate() {
            let (limits, violations) = {
                let l = inner.lock(idx);
                (l.limits(), l.violations())
            };
            s.limit_violations += violations;
            s.projects
                .insert(p.name.clone(), p.counters.snapshot(limits, violations));
        }
        s
    }

    /// Replaces a project's limits at run time (0 = unlimited). Buckets keep their
    /// current level clamped to the new capacity, so halving a full bucket leaves it
    /// full at the new size. Returns false for an unknown project.
    pub fn set_limits(&self, project: &str, limits: ProjectLimits) -> bool {
        let Some(&idx) = self.inner.by_name.get(project) else {
            return false;
        };
        self.inner.lock(idx).set_limits(limits, &self.inner.clock);
        tracing::info!(project, ?limits, "mock provider limits changed");
        true
    }

    /// Zeroes all counters and the audit (limits and bucket levels are kept).
    fn reset_stats(&self) {
        let inner = &self.inner;
        inner.totals.reset();
        for (idx, p) in inner.projects.iter().enumerate() {
            p.counters.reset();
            inner.lock(idx).reset_audit();
        }
    }

    /// Serves [`MockProvider::router`] on `listener` until `cancel` fires, then drains
    /// open connections.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        cancel: CancellationToken,
    ) -> std::io::Result<()> {
        let router = self.router();
        axum::serve(listener, router)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await
    }

    /// Serves on a free port of 127.0.0.1 in the background (tests, demo, bench).
    pub async fn start_local(self) -> std::io::Result<LocalMock> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let tasks = tokio_util::task::TaskTracker::new();
        tasks.spawn(self.clone().serve(listener, stop.clone()));
        tasks.close();
        Ok(LocalMock {
            provider: self,
            addr,
            stop,
            tasks,
        })
    }
}

/// A mock provider serving in the background; [`LocalMock::shutdown`] stops it.
pub struct LocalMock {
    pub provider: MockProvider,
    pub addr: std::net::SocketAddr,
    stop: CancellationToken,
    tasks: tokio_util::task::TaskTracker,
}

impl LocalMock {
    pub async fn shutdown(self) {
        self.stop.cancel();
        self.tasks.wait().await;
    }
}

async fn stats_route(State(p): State<MockProvider>) -> Json<MockStats> {
    Json(p.stats())
}

async fn limits_route(
    State(p): State<MockProvider>,
    UrlPath(project): UrlPath<String>,
    Json(limits): Json<ProjectLimits>,
) -> Response {
    if p.set_limits(&project, limits) {
        Json(limits).into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({ "error": format!("unknown project {project:?}") })),
        )
            .into_response()
    }
}

async fn reset_route(State(p): State<MockProvider>) -> StatusCode {
    p.reset_stats();
    StatusCode::NO_CONTENT
}

/// Returns OTPM tokens reserved but not generated when dropped — after the response is
/// built, or when the client disconnects mid-latency.
struct OutputRefund<'a> {
    inner: &'a Inner,
    project: usize,
    tokens: u64,
}

impl Drop for OutputRefund<'_> {
    fn drop(&mut self) {
        if self.tokens > 0 {
            self.inner
                .lock(self.project)
                .refund_output(self.tokens, &self.inner.clock);
        }
    }
}

impl Inner {
    /// Vertex AI's tokens; held for a lookup or an insert, never across an await.
    fn vertex_tokens(&self) -> MutexGuard<'_, HashMap<String, (usize, i64)>> {
        self.vertex_tokens.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The batch APIs' files and batches; held for plain bookkeeping, never across an await.
    fn batch_state(&self) -> MutexGuard<'_, batch_state::BatchState> {
        self.batches.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock(&self, project: usize) -> MutexGuard<'_, Limiter> {
        // The limiter does plain arithmetic; a poisoned lock still holds consistent state.
        self.projects[project]
            .limiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn lookup(&self, kind: ProviderKind, key: &str) -> KeyLookup {
        match self.keys.get(&kind).and_then(|keys| keys.get(key)) {
            Some(e) if e.revoked => KeyLookup::Revoked,
            Some(e) => KeyLookup::Valid(e.project),
            None => KeyLookup::Unknown,
        }
    }

    fn model_allowed(&self, project: usize, model: &str) -> bool {
        let models = &self.projects[project].models;
        models.is_empty() || models.contains(model)
    }

    /// Current limits without charging anything.
    fn view(&self, project: usize) -> LimitsView {
        self.lock(project).view(&self.clock)
    }

    /// The status of the fault window that hits this request, if any.
    fn fault(&self, project: usize) -> Option<StatusCode> {
        if self.faults.is_empty() {
            return None;
        }
        let now = self.clock.now_ns();
        let hit = self.faults.iter().find(|f| {
            f.project.is_none_or(|p| p == project)
                && now >= f.start_ns
                && f.end_ns.is_none_or(|end| now < end)
                && (f.probability >= 1.0 || rand::random::<f64>() < f.probability)
        })?;
        stats::bump(&self.totals.faults_5xx);
        stats::bump(&self.projects[project].counters.faults_5xx);
        Some(hit.status)
    }

    /// Completion tokens of a request: `min(max, output_tokens)`.
    fn completion_tokens(&self, max: Option<u64>) -> u64 {
        max.map_or(self.output_tokens, |m| m.min(self.output_tokens))
    }

    /// Runs the limiter and counts the outcome.
    fn admit(&self, project: usize, charge: Charge, input: u64, output: u64) -> Admission {
        let admission = self.lock(project).try_admit(charge, &self.clock);
        let counters = &self.projects[project].counters;
        match admission {
            Admission::Admitted(_) => counters.admitted(input, output),
            Admission::Denied(..) => {
                stats::bump(&self.totals.rate_limited_429);
                stats::bump(&counters.rate_limited_429);
            }
        }
        admission
    }

    /// Simulated generation time of an admitted request; holds no lock. The returned
    /// guard gives unused OTPM reservation back when dropped.
    async fn generate(
        &self,
        project: usize,
        view: &LimitsView,
        reserved_output: u64,
        output: u64,
    ) -> OutputRefund<'_> {
        let refund = OutputRefund {
            inner: self,
            project,
            tokens: if view.otpm.is_some() {
                reserved_output.saturating_sub(output)
            } else {
                0
            },
        };
        let per_token = self
            .latency_per_output_token
            .saturating_mul(u32::try_from(output).unwrap_or(u32::MAX));
        let latency = self.latency.saturating_add(per_token);
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        refund
    }

    /// Whether this call at the flex tier is refused (`flex_unavailable_every_nth`).
    fn flex_refuses(&self) -> bool {
        let nth = self.flex_unavailable_every_nth;
        let call = self
            .totals
            .flex_calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        nth > 0 && call.is_multiple_of(nth)
    }

    /// Unix seconds now, by the mock's clock.
    fn unix_secs(&self) -> i64 {
        let ns = self.clock.unix_ns_at(self.clock.now_ns());
        i64::try_from(ns.div_euclid(1_000_000_000)).unwrap_or(0)
    }
}

/// Random lowercase hex of `n` digits (n ≤ 32), for request and message ids.
fn hex_id(n: usize) -> String {
    let mut s = format!("{:032x}", rand::random::<u128>());
    s.truncate(n);
    s
}

/// Ceil of `ns` in whole seconds, at least 1 (a `retry-after` of 0 means "no hint").
fn ceil_secs(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000).max(1)
}

/// A UUIDv7 from the mock's clock and thread-local randomness (no syscall per id).
fn uuid_v7(inner: &Inner) -> uuid::Uuid {
    let ms = inner.clock.unix_ns_at(inner.clock.now_ns()).div_euclid(1_000_000);
    let random: [u8; 10] = rand::random();
    uuid::Builder::from_unix_timestamp_millis(u64::try_from(ms).unwrap_or(0), &random).into_uuid()
}
