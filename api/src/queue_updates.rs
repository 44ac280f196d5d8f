//! Queue updates for streaming callers who ask for them with the request header
//! `X-Tollgate-Queue-Updates: true`: the answer starts at once (`200`,
//! `text/event-stream`) and, while the job waits to be admitted, carries an SSE comment
//! about once a second ([`EVERY`]) saying where it stands:
//!
//! ```text
//! : tollgate {"state":"queued","ahead":3,"eta":{"p50":"…","p90":"…"},"waiting_for":{…}}
//! ```
//!
//! `ahead` is the queued jobs on its routes, of its class or one served first, submitted
//! before it; `eta` its forecast with the queue as it is now ([`Forecaster::waiting`]);
//! `waiting_for` the gate's note on the limit that holds it (bucket, limit, remaining,
//! `expected_at`), once the gate has looked at it. Every SSE client skips comments (the
//! OpenAI and Anthropic SDKs among them), so an SDK streaming as usual reads the same
//! events as without the header. The provider's events follow once the job is admitted.
//!
//! The header is the caller's consent to one difference: a refusal after the answer has
//! started (out of time, or the gate failed the job) can no longer be a status, so it
//! comes as the stream's error event in the endpoint's shape — OpenAI's `{"error": …}`
//! chunk, Anthropic's and Responses' `error` event — with the same code and message the
//! status answer carries. A caller who hangs up while it waits has its job cancelled, as
//! without the header.
//!
//! [`Forecaster::waiting`]: crate::forecasts::Forecaster::waiting

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::response::Response;
use axum::response::sse::Event;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tollgate::model::{Job, NewJob};
use tollgate::store;
use tollgate::vocab::Endpoint;

use crate::AppState;
use crate::chat::{claimed_stream, event_stream, relayed_event};
use crate::error::ApiError;
use crate::forecasts::eta_view;
use crate::messages::anthropic_error_type;

/// The request header that asks for queue updates.
pub const HEADER: &str = "x-tollgate-queue-updates";
/// How often a waiting caller is told where its job stands.
pub const EVERY: Duration = Duration::from_secs(1);

/// Whether the caller asked for queue updates (`true`, `1` or `yes`).
pub struct QueueUpdates(pub bool);

impl<S: Send + Sync> FromRequestParts<S> for QueueUpdates {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Infallible> {
        let asked = parts
            .headers
            .get(HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes"));
        Ok(Self(asked))
    }
}

/// Tells a waiting caller where its job stands, at most every [`EVERY`].
pub(crate) struct Reporter {
    job: Arc<NewJob>,
    to: mpsc::Sender<Event>,
    last: Option<Instant>,
}

impl Reporter {
    /// A report, unless the last one is younger than [`EVERY`]; `current` is the job's row.
    pub(crate) async fn report(&mut self, state: &AppState, current: &Job) {
        if self.last.is_some_and(|at| at.elapsed() < EVERY) {
            return;
        }
        self.last = Some(Instant::now());
        let mut status = json!({"state": current.state, "waiting_for": current.admission});
        match where_it_stands(state, &self.job).await {
            Ok(Some((eta, ahead))) => {
                status["ahead"] = json!(ahead);
                status["eta"] = eta_view(Some(eta.p50), Some(eta.p90));
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(job = %self.job.id, error = %e, "no queue update this time"),
        }
        // A caller gone is noticed by the task that relays to it.
        let _ = self
            .to
            .send(Event::default().comment(format!("tollgate {status}")))
            .await;
    }
}

/// The job's forecast with the queue as it is, and how many jobs are ahead of it.
async fn where_it_stands(
    state: &AppState,
    job: &NewJob,
) -> Result<Option<(tollgate::forecast::Eta, i64)>, store::StoreError> {
    let now = state.clock.now();
    let inputs = state.forecasts.inputs(&state.pool, now).await?;
    let mut conn = state.pool.acquire().await?;
    let control = state.tenants.snapshot();
    state
        .forecasts
        .waiting(&inputs, &mut conn, &control, job, now)
        .await
}

/// The answer to a streaming caller who asked for queue updates, its job (`queued`, the
/// row of `new`) inserted: the event stream, started at once, that a task of the relays
/// fills — reports while it waits, then the provider's events, or the refusal.
pub(crate) fn respond(
    state: AppState,
    tenant: String,
    job: Job,
    new: Arc<NewJob>,
    endpoint: Endpoint,
    timeout: Duration,
) -> Response {
    let (to, from) = mpsc::channel::<Event>(16);
    let id = job.id;
    let relays = state.relays.clone();
    relays.spawn(async move {
        let give_up = tokio::time::Instant::now() + timeout;
        let mut reporter = Reporter {
            job: new,
            to: to.clone(),
            last: None,
        };
        let claimed = tokio::select! {
            claimed = claimed_stream(&state, &tenant, id, give_up, Some(&mut reporter)) => claimed,
            () = to.closed() => {
                if let Err(e) = store::cancel_job(&state.pool, Some(&tenant), id, state.clock.now()).await {
                    tracing::warn!(job = %id, error = %e, "could not cancel an abandoned streaming job");
                }
                return;
            }
        };
        drop(reporter);
        let chunks = match claimed {
            Ok(job) => state
                .dispatcher
                .stream(job, &state.relays)
                .await
                .map_err(|f| crate::chat::failure_response(f.code.as_str(), f.message, None)),
            Err(e) => Err(e),
        };
        let mut chunks = match chunks {
            Ok(chunks) => chunks,
            Err(e) => {
                let _ = to.send(error_event(endpoint, &e)).await;
                return;
            }
        };
        // Dropping the chunks when the caller leaves cancels the upstream call.
        loop {
            tokio::select! {
                data = chunks.recv() => match data {
                    Some(data) => {
                        if to.send(relayed_event(endpoint, data)).await.is_err() {
                            break;
                        }
                    }
                    None => break,
                },
                () = to.closed() => break,
            }
        }
    });
    let events = futures::stream::unfold(from, |mut from| async move {
        let event = from.recv().await?;
        Some((event, from))
    });
    event_stream(id, events)
}

/// The event that ends a started stream with `error`, in `endpoint`'s shape.
fn error_event(endpoint: Endpoint, error: &ApiError) -> Event {
    let (name, data): (Option<&str>, Value) = match endpoint {
        Endpoint::Messages => (
            Some("error"),
            json!({"type": "error", "error": {"type": anthropic_error_type(error.status),
                "message": error.message, "code": error.code, "param": error.param}}),
        ),
        Endpoint::Responses => (
            Some("error"),
            json!({"type": "error", "code": error.code, "message": error.message, "param": error.param}),
        ),
        _ => (None, error.body()),
    };
    let event = match name {
        Some(name) => Event::default().event(name),
        None => Event::default(),
    };
    event.data(data.to_string())
}
