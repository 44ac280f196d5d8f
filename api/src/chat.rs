//! The synchronous endpoints: OpenAI's `POST /v1/chat/completions`, `POST /v1/embeddings`,
//! `POST /v1/moderations`, `POST /v1/responses` and the legacy `POST /v1/completions`
//! (and, through [`synchronous`],
//! Anthropic's Messages). The request is queued as an `interactive` job like any other — so it waits its turn instead
//! of meeting a provider 429 — and the handler waits for the result. An existing OpenAI SDK
//! app points its `base_url` at tollgate and changes nothing else.
//!
//! If the job cannot finish within `server.sync_timeout_secs` (or its deadline), the
//! answer is 429 with `Retry-After` and a reason code, and the job is cancelled so it does
//! not spend capacity for a caller who has gone.
//!
//! With `"stream": true` the job is queued and admitted the same way (its reservation
//! holds the full `max_tokens` of output), then run by this process, which relays the
//! provider's SSE as it arrives in OpenAI chunk format (Anthropic's events translated).
//! The job is settled from the final usage; if the client disconnects, the upstream call
//! is cancelled and the job settled with what was produced.
//!
//! A caller who hangs up before its answer (plain or before its stream starts) has its job
//! cancelled: it is not sent if it has not been, and its reservation is given back.

use std::convert::Infallible;
use std::time::Duration;
use tollgate::tenants::Caller;
use tollgate::vocab::{ApiErrorCode, Endpoint};

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use futures::{Stream, StreamExt};
use serde_json::Value;
use tollgate::attempt::End;
use tollgate::model::{Job, JobClass, JobId, JobState};
use tollgate::notify::JobWatch;
use tollgate::store::{self, Inserted};

use crate::AppState;
use crate::auth::AuthTenant;
use crate::error::ApiError;
use crate::jobs::{Submission, insert, json_body, prepare};
use crate::openapi as doc;
use crate::queue_updates::{self, QueueUpdates, Reporter};

/// OpenAI-compatible, synchronous: queued as an `interactive` job and awaited. With
/// `"stream": true`, the provider's SSE is relayed in OpenAI chunk format.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    operation_id = "create_chat_completion",
    tag = "openai",
    request_body(content = Object, description = "An OpenAI Chat Completions request"),
    responses(
        (status = 200, description = "An OpenAI chat completion (JSON), or its chunks (`text/event-stream`) when streaming; header `x-tollgate-job-id`", body = Object),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`; or the job's reason code (`provider_rejected_request`, `request_too_large`, `exceeds_limit`)", body = doc::ErrorBody),
        (status = 409, description = "`cancelled`", body = doc::ErrorBody),
        (status = 413, description = "`body_too_large`", body = doc::ErrorBody),
        (status = 429, description = "`queue_timeout`, `deadline_exceeded`, `deadline_unmeetable`, `rate_limited`, `spend_limit_reached`, `queue_full` (+ `Retry-After`)", body = doc::ErrorBody),
        (status = 502, description = "`upstream_failed`, `upstream_auth_failed`, `insufficient_quota`", body = doc::ErrorBody),
    ),
    params(("x-tollgate-queue-updates" = Option<bool>, Header, description = "With `stream: true`: start the event stream at once and, while the job waits, send an SSE comment each second with its place, eta and the limit holding it (a refusal then comes as the stream's error event)")),
    security(("bearer" = []))
)]
pub(crate) async fn completions(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    QueueUpdates(updates): QueueUpdates,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    synchronous(
        state,
        tenant,
        Endpoint::ChatCompletions,
        json_body(body)?,
        updates,
    )
    .await
}

/// OpenAI-compatible, synchronous: queued as an `interactive` job that reserves its input
/// tokens (and no output), and awaited.
#[utoipa::path(
    post,
    path = "/v1/embeddings",
    operation_id = "create_embedding",
    tag = "openai",
    request_body(content = Object, description = "An OpenAI Embeddings request"),
    responses(
        (status = 200, description = "An OpenAI embeddings list; header `x-tollgate-job-id`", body = Object),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`, `endpoint_not_served`; or the job's reason code (`provider_rejected_request`, `request_too_large`, `exceeds_limit`)", body = doc::ErrorBody),
        (status = 409, description = "`cancelled`", body = doc::ErrorBody),
        (status = 413, description = "`body_too_large`", body = doc::ErrorBody),
        (status = 429, description = "`queue_timeout`, `deadline_exceeded`, `deadline_unmeetable`, `rate_limited`, `spend_limit_reached`, `queue_full` (+ `Retry-After`)", body = doc::ErrorBody),
        (status = 502, description = "`upstream_failed`, `upstream_auth_failed`, `insufficient_quota`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn embeddings(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    synchronous(state, tenant, Endpoint::Embeddings, json_body(body)?, false).await
}

/// OpenAI-compatible, synchronous: queued as an `interactive` job that reserves its input
/// and `max_output_tokens`, and awaited; with `"stream": true`, the provider's Responses
/// events relayed as they arrive.
#[utoipa::path(
    post,
    path = "/v1/responses",
    operation_id = "create_response",
    tag = "openai",
    request_body(content = Object, description = "An OpenAI Responses request"),
    responses(
        (status = 200, description = "An OpenAI response (JSON), or its events (`text/event-stream`) when streaming; header `x-tollgate-job-id`", body = Object),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`, `endpoint_not_served`, `unsupported_field`; or the job's reason code (`provider_rejected_request`, `request_too_large`, `exceeds_limit`)", body = doc::ErrorBody),
        (status = 409, description = "`cancelled`", body = doc::ErrorBody),
        (status = 413, description = "`body_too_large`", body = doc::ErrorBody),
        (status = 429, description = "`queue_timeout`, `deadline_exceeded`, `deadline_unmeetable`, `rate_limited`, `spend_limit_reached`, `queue_full` (+ `Retry-After`)", body = doc::ErrorBody),
        (status = 502, description = "`upstream_failed`, `upstream_auth_failed`, `insufficient_quota`", body = doc::ErrorBody),
    ),
    params(("x-tollgate-queue-updates" = Option<bool>, Header, description = "With `stream: true`: start the event stream at once and, while the job waits, send an SSE comment each second with its place, eta and the limit holding it (a refusal then comes as the stream's error event)")),
    security(("bearer" = []))
)]
pub(crate) async fn responses(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    QueueUpdates(updates): QueueUpdates,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    synchronous(state, tenant, Endpoint::Responses, json_body(body)?, updates).await
}

/// OpenAI's legacy Completions, synchronous: queued as an `interactive` job that reserves
/// its prompts and `max_tokens` (default 16) for each candidate of each prompt, and
/// awaited; with `"stream": true`, the provider's chunks relayed as they arrive.
#[utoipa::path(
    post,
    path = "/v1/completions",
    operation_id = "create_completion",
    tag = "openai",
    request_body(content = Object, description = "An OpenAI (legacy) Completions request"),
    responses(
        (status = 200, description = "An OpenAI text completion (JSON), or its chunks (`text/event-stream`) when streaming; header `x-tollgate-job-id`", body = Object),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`, `endpoint_not_served`; or the job's reason code (`provider_rejected_request`, `request_too_large`, `exceeds_limit`)", body = doc::ErrorBody),
        (status = 409, description = "`cancelled`", body = doc::ErrorBody),
        (status = 413, description = "`body_too_large`", body = doc::ErrorBody),
        (status = 429, description = "`queue_timeout`, `deadline_exceeded`, `deadline_unmeetable`, `rate_limited`, `spend_limit_reached`, `queue_full` (+ `Retry-After`)", body = doc::ErrorBody),
        (status = 502, description = "`upstream_failed`, `upstream_auth_failed`, `insufficient_quota`", body = doc::ErrorBody),
    ),
    params(("x-tollgate-queue-updates" = Option<bool>, Header, description = "With `stream: true`: start the event stream at once and, while the job waits, send an SSE comment each second with its place, eta and the limit holding it (a refusal then comes as the stream's error event)")),
    security(("bearer" = []))
)]
pub(crate) async fn text_completions(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    QueueUpdates(updates): QueueUpdates,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    synchronous(state, tenant, Endpoint::Completions, json_body(body)?, updates).await
}

/// OpenAI-compatible, synchronous: queued as an `interactive` job that reserves a request
/// and no tokens, and awaited.
#[utoipa::path(
    post,
    path = "/v1/moderations",
    operation_id = "create_moderation",
    tag = "openai",
    request_body(content = Object, description = "An OpenAI Moderations request (`model` required: tollgate routes by it)"),
    responses(
        (status = 200, description = "An OpenAI moderation; header `x-tollgate-job-id`", body = Object),
        (status = 400, description = "`invalid_json`, `invalid_request`, `missing_field`, `unknown_model`, `endpoint_not_served`; or the job's reason code (`provider_rejected_request`, `exceeds_limit`)", body = doc::ErrorBody),
        (status = 429, description = "`queue_timeout`, `deadline_exceeded`, `deadline_unmeetable`, `rate_limited`, `queue_full` (+ `Retry-After`)", body = doc::ErrorBody),
        (status = 502, description = "`upstream_failed`, `upstream_auth_failed`, `insufficient_quota`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn moderations(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    synchronous(state, tenant, Endpoint::Moderations, json_body(body)?, false).await
}

/// One synchronous call of `endpoint`: the job queued, admitted and run like any other,
/// the caller answered with its result (or relayed its stream, for a request of an
/// endpoint that streams which asks for one — with [`queue_updates`] while it waits when
/// the caller asked for them).
pub(crate) async fn synchronous(
    state: AppState,
    tenant: Caller,
    endpoint: Endpoint,
    request: Value,
    updates: bool,
) -> Result<Response, ApiError> {
    let stream = endpoint.streams() && request.get("stream").and_then(Value::as_bool) == Some(true);
    let timeout = Duration::from_secs(state.config.server.sync_timeout_secs);
    let trim_param = |e: ApiError| ApiError {
        param: e.param.map(|p| p.trim_start_matches("request.").to_owned()),
        ..e
    };
    let job = prepare(
        &state,
        &tenant,
        Submission {
            stream,
            endpoint,
            request,
            class: JobClass::Interactive,
            deadline: Some(state.clock.now() + timeout),
            priority: 0,
            idempotency_key: None,
            metadata: None,
            check: crate::forecasts::Check::None,
            caller_process: Some(state.dispatcher.owner().to_owned()),
        },
    )
    .map_err(trim_param)?;
    // Watched from before its insert, so its result is read once, when it has one.
    let watch = state.notifications.watch_job(job.id);
    let reported = (stream && updates).then(|| job.clone());
    let inserted = insert(&state, &tenant, job).await.map_err(trim_param)?;
    let (Inserted::New(job) | Inserted::Existing(job)) = inserted;
    if let Some(new) = reported
        && job.state != JobState::Running
    {
        return Ok(queue_updates::respond(
            state,
            tenant.name.clone(),
            job,
            new,
            endpoint,
            timeout,
        ));
    }
    let mut abandoned = CancelIfAbandoned::new(&state, &tenant.name, job.id);
    if stream {
        drop(watch);
        let answer = stream_response(&state, &tenant.name, job, endpoint, timeout).await;
        // From here the relay owns the job: a client leaving mid-stream cancels its call.
        abandoned.disarm();
        return answer;
    }
    let give_up = tokio::time::Instant::now() + timeout + Duration::from_secs(1);
    let finished = finish(&state, &tenant.name, job.id, &watch, give_up).await;
    abandoned.disarm();
    let response = match finished? {
        Finish::Succeeded(body) => Ok((StatusCode::OK, axum::Json(body)).into_response()),
        Finish::Unfinished { admission } => {
            // Out of time: give the slot back and tell the caller when to try again.
            if let Err(e) =
                store::cancel_job(&state.pool, Some(&tenant.name), job.id, state.clock.now()).await
            {
                tracing::warn!(error = %e, "could not cancel a timed-out synchronous job");
            }
            Err(queue_timeout(admission.as_ref()))
        }
        Finish::Failed {
            code,
            message,
            admission,
        } => Err(failure_response(&code, message, admission.as_ref())),
    };
    let mut response = response.unwrap_or_else(IntoResponse::into_response);
    if let Ok(v) = HeaderValue::from_str(&job.id.to_string()) {
        response.headers_mut().insert("x-tollgate-job-id", v);
    }
    Ok(response)
}

/// One relayed payload as the SSE event `endpoint`'s clients expect: Anthropic's and
/// Responses' events are named (`event: message_start`, `event: response.created`, ...)
/// by their data's `type`; chat and completion chunks are not.
pub(crate) fn relayed_event(endpoint: Endpoint, data: String) -> Event {
    let mut event = Event::default();
    if matches!(endpoint, Endpoint::Messages | Endpoint::Responses)
        && let Some(name) = event_type(&data)
    {
        event = event.event(name);
    }
    event.data(data)
}

/// The `type` of an event's JSON data.
fn event_type(data: &str) -> Option<String> {
    let v: Value = serde_json::from_str(data).ok()?;
    v.get("type")?.as_str().map(str::to_owned)
}

/// What a synchronous caller is answered with.
enum Finish {
    Succeeded(Value),
    /// `admission`: the gate's last note on it, when the row was read.
    Failed {
        code: String,
        message: String,
        admission: Option<Value>,
    },
    /// Not finished in time; the gate's note on why, if it was waiting.
    Unfinished {
        admission: Option<Value>,
    },
}

impl Finish {
    fn of_job(job: Job) -> Self {
        match job.state {
            JobState::Succeeded => Self::Succeeded(job.result.unwrap_or(Value::Null)),
            JobState::Queued | JobState::Admitted | JobState::Running => Self::Unfinished {
                admission: job.admission,
            },
            JobState::Failed | JobState::Cancelled => Self::Failed {
                code: job.error_code.unwrap_or_else(|| "failed".to_owned()),
                message: job.error_message.unwrap_or_default(),
                admission: job.admission,
            },
        }
    }

    /// An end this process's completer committed: only final ones are handed over.
    fn of_end(end: &End) -> Option<Self> {
        match end {
            End::Succeeded { result, .. } => Some(Self::Succeeded(result.clone())),
            End::Failed { code, message } => Some(Self::Failed {
                code: code.as_str().to_owned(),
                message: message.clone(),
                admission: None,
            }),
            End::Retry { .. } => None,
        }
    }
}

/// Waits for the job, watched since before its insert, to finish or for `give_up`: its
/// end as this process's completer hands it over, else its row, read when woken.
async fn finish(
    state: &AppState,
    tenant: &str,
    id: JobId,
    watch: &JobWatch,
    give_up: tokio::time::Instant,
) -> Result<Finish, ApiError> {
    loop {
        let woken = tokio::time::timeout_at(give_up, watch.changed()).await.is_ok();
        if let Some(finished) = watch.ended().as_deref().and_then(Finish::of_end) {
            return Ok(finished);
        }
        let job = store::get_job(&state.pool, Some(tenant), id)
            .await?
            .ok_or_else(|| ApiError::internal("a job vanished while its caller waited"))?;
        if job.state.is_terminal() || !woken {
            return Ok(Finish::of_job(job));
        }
    }
}

/// Cancels the caller's job if the handler is dropped before it answers — the client hung
/// up (the server drops the request's future when its connection closes). A queued or
/// admitted job is then never sent and gives its reservation back at once, instead of
/// being sent, billed and held for a caller who is gone until its deadline.
struct CancelIfAbandoned {
    armed: Option<(AppState, String, JobId)>,
}

impl CancelIfAbandoned {
    fn new(state: &AppState, tenant: &str, id: JobId) -> Self {
        Self {
            armed: Some((state.clone(), tenant.to_owned(), id)),
        }
    }

    fn disarm(&mut self) {
        self.armed = None;
    }
}

impl Drop for CancelIfAbandoned {
    fn drop(&mut self) {
        if let Some((state, tenant, id)) = self.armed.take() {
            let relays = state.relays.clone();
            relays.spawn(async move {
                match store::cancel_job(&state.pool, Some(&tenant), id, state.clock.now()).await {
                    Ok(_) => tracing::debug!(job = %id, "the caller hung up; its job is cancelled"),
                    Err(e) => {
                        tracing::warn!(job = %id, error = %e, "could not cancel an abandoned synchronous job")
                    }
                }
            });
        }
    }
}

/// When the gate's note on a job (`admission`) expected the limit holding it to allow it.
fn expected_at(admission: Option<&Value>) -> Option<chrono::DateTime<Utc>> {
    admission
        .and_then(|a| a.get("expected_at"))
        .and_then(Value::as_str)
        .and_then(|t| t.parse::<chrono::DateTime<Utc>>().ok())
}

/// How long a refused caller should wait: until the limit that held its job was expected
/// to allow it (the gate's note), else [`RETRY_AFTER_UNKNOWN`]; at least a second.
fn retry_after(admission: Option<&Value>) -> Duration {
    expected_at(admission)
        .and_then(|at| (at - Utc::now()).to_std().ok())
        .unwrap_or(RETRY_AFTER_UNKNOWN)
        .max(Duration::from_secs(1))
}

/// The Retry-After of a refusal whose job carries no expectation from the gate.
const RETRY_AFTER_UNKNOWN: Duration = Duration::from_secs(2);

/// 429 for a job that could not be served in time: says which limit held it (its limit,
/// what remained, when it was expected to fit — the gate's note, the tenant's own job)
/// and sets Retry-After from that time.
fn queue_timeout(admission: Option<&Value>) -> ApiError {
    let expected = expected_at(admission);
    let retry_after = retry_after(admission);
    let message = match admission.and_then(|a| a.get("bucket")).and_then(Value::as_str) {
        Some(bucket) => format!(
            "the request could not be served in time: limit {bucket} (capacity {}, remaining {}) was expected to allow it at {}; retry later",
            admission.and_then(|a| a.get("limit")).unwrap_or(&Value::Null),
            admission.and_then(|a| a.get("remaining")).unwrap_or(&Value::Null),
            expected.map_or("an unknown time".to_owned(), |e| e.to_rfc3339()),
        ),
        None => "the request could not be served in time; retry later".to_owned(),
    };
    ApiError::new(StatusCode::TOO_MANY_REQUESTS, ApiErrorCode::QueueTimeout, message)
        .with_retry_after(retry_after)
}

/// Maps a job's reason code to the HTTP answer an OpenAI client expects; a 429's
/// Retry-After is when the gate's note on the job (`admission`) expected it to fit.
pub(crate) fn failure_response(code: &str, message: String, admission: Option<&Value>) -> ApiError {
    let (status, code): (StatusCode, ApiErrorCode) = match code {
        "deadline_exceeded" => (StatusCode::TOO_MANY_REQUESTS, ApiErrorCode::DeadlineExceeded),
        "provider_rejected_request" => (StatusCode::BAD_REQUEST, ApiErrorCode::ProviderRejectedRequest),
        "request_too_large" => (StatusCode::BAD_REQUEST, ApiErrorCode::RequestTooLarge),
        "cancelled" => (StatusCode::CONFLICT, ApiErrorCode::Cancelled),
        "upstream_auth_failed" => (StatusCode::BAD_GATEWAY, ApiErrorCode::UpstreamAuthFailed),
        "insufficient_quota" => (StatusCode::BAD_GATEWAY, ApiErrorCode::InsufficientQuota),
        "spend_limit_reached" => (StatusCode::TOO_MANY_REQUESTS, ApiErrorCode::SpendLimitReached),
        "unknown_model" => (StatusCode::BAD_REQUEST, ApiErrorCode::UnknownModel),
        "streaming_unsupported" => (StatusCode::BAD_REQUEST, ApiErrorCode::StreamingUnsupported),
        "rate_limited" => (StatusCode::TOO_MANY_REQUESTS, ApiErrorCode::RateLimited),
        "exceeds_limit" => (StatusCode::BAD_REQUEST, ApiErrorCode::ExceedsLimit),
        "deadline_unmeetable" => (StatusCode::TOO_MANY_REQUESTS, ApiErrorCode::DeadlineUnmeetable),
        _ => (StatusCode::BAD_GATEWAY, ApiErrorCode::UpstreamFailed),
    };
    let err = ApiError::new(status, code, message);
    if status == StatusCode::TOO_MANY_REQUESTS {
        err.with_retry_after(retry_after(admission))
    } else {
        err
    }
}

/// Waits for the gate to admit the streaming job, claims it, and answers with the relayed
/// event stream.
async fn stream_response(
    state: &AppState,
    tenant: &str,
    job: Job,
    endpoint: Endpoint,
    timeout: Duration,
) -> Result<Response, ApiError> {
    let id = job.id;
    let give_up = tokio::time::Instant::now() + timeout;
    // Started on arrival, it is running for this process already: nothing to claim.
    let job = if job.state == JobState::Running {
        job
    } else {
        claimed_stream(state, tenant, id, give_up, None).await?
    };
    let chunks = match state.dispatcher.stream(job, &state.relays).await {
        Ok(rx) => rx,
        Err(failure) => return Err(failure_response(failure.code.as_str(), failure.message, None)),
    };
    let events = futures::stream::unfold(chunks, move |mut rx| async move {
        let data = rx.recv().await?;
        Some((relayed_event(endpoint, data), rx))
    });
    Ok(event_stream(id, events))
}

/// The SSE answer of job `id`: `events`, with the job's id in `x-tollgate-job-id`.
pub(crate) fn event_stream(id: JobId, events: impl Stream<Item = Event> + Send + 'static) -> Response {
    let events = events.map(Ok::<_, Infallible>);
    let mut response = Sse::new(events).into_response();
    if let Ok(v) = HeaderValue::from_str(&id.to_string()) {
        response.headers_mut().insert("x-tollgate-job-id", v);
    }
    response
}

/// Claims the streaming job `id` for this process once the gate admits it, or answers why
/// it cannot run: it failed, or `give_up` came first (then it is cancelled). A `reporter`
/// is told of the job each time it is found still waiting.
pub(crate) async fn claimed_stream(
    state: &AppState,
    tenant: &str,
    id: JobId,
    give_up: tokio::time::Instant,
    mut reporter: Option<&mut Reporter>,
) -> Result<Job, ApiError> {
    loop {
        let admitted = state.notifications.jobs_ready();
        tokio::pin!(admitted);
        admitted.as_mut().enable();
        if let Some(job) = state.dispatcher.claim_stream(id).await? {
            return Ok(job);
        }
        let current = store::get_job(&state.pool, Some(tenant), id)
            .await?
            .ok_or_else(|| ApiError::internal("a streaming job vanished while its caller waited"))?;
        if current.state.is_terminal() {
            let code = current.error_code.unwrap_or_else(|| "failed".to_owned());
            return Err(failure_response(
                &code,
                current.error_message.unwrap_or_default(),
                current.admission.as_ref(),
            ));
        }
        if let Some(reporter) = reporter.as_deref_mut() {
            reporter.report(state, &current).await;
        }
        tokio::select! {
            _ = &mut admitted => {}
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = tokio::time::sleep_until(give_up) => {
                if let Err(e) = store::cancel_job(&state.pool, Some(tenant), id, state.clock.now()).await {
                    tracing::warn!(error = %e, "could not cancel a timed-out streaming job");
                }
                let admission = store::get_job(&state.pool, Some(tenant), id).await?.and_then(|j| j.admission);
                return Err(queue_timeout(admission.as_ref()));
            }
        }
    }
}
