//! The job model: ids, states, classes, the job row and what a provider call reports.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use crate::vocab::{Endpoint, JobClass, JobState, Lane, LaneReason};

/// A job's id: a UUIDv7, so ids sort by creation time (cursor paging relies on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type)]
#[serde(transparent)]
#[sqlx(transparent)]
pub struct JobId(pub Uuid);

impl JobId {
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }
}

impl Default for JobId {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for JobId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(Self)
    }
}

/// Token usage as the provider reported it, in OpenAI's terms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: i64,
    pub output_tokens: i64,
    #[serde(default)]
    pub cached_tokens: i64,
}

/// A row of `jobs`, as `store`'s `query_jobs!` reads it: every column but a batch line's
/// `custom_id` and `batch_line`.
#[derive(Debug, Clone)]
pub struct Job {
    /// A UUIDv7: time-ordered, so ids sort as jobs arrived and pages by id are stable.
    pub id: JobId,
    /// Whose job: every read and write is scoped by it (isolation), and fair sharing is
    /// per tenant.
    pub tenant: String,
    /// Precedence at admission (interactive before standard before background before
    /// batch) and the default deadline.
    pub class: JobClass,
    /// Order within a tenant's class (higher first), from -1000 to 1000.
    pub priority: i32,
    pub state: JobState,
    /// What kind of work the request is.
    pub endpoint: Endpoint,
    /// The body as the client sent it, in its endpoint's shape; adapters translate it per
    /// provider.
    pub request: serde_json::Value,
    /// What the client asked for: a route alias or `provider/model`.
    pub model: String,
    /// Per tenant: a replay of the same submission returns this job instead of a second.
    pub idempotency_key: Option<String>,
    /// The client's own labels, returned as given (at most 16 KiB).
    pub metadata: Option<serde_json::Value>,
    /// After it the job is not started: a queued one expires, a retry that would start
    /// later fails `deadline_exceeded`.
    pub deadline: DateTime<Utc>,
    /// Not admitted before: the backoff of a retry, or a pause of its target.
    pub not_before: DateTime<Utc>,
    /// Attempts started so far; with the lease owner it guards every write of an attempt.
    pub attempt: i32,
    /// Attempts allowed before the job fails `attempts_exhausted`.
    pub max_attempts: i32,
    /// The dispatcher holding the running attempt; `None` unless running.
    pub lease_owner: Option<String>,
    /// When the holder's lease ends unless renewed; past it, maintenance rescues the job.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The provider and model the gate chose (a route target), kept after the job ends.
    pub provider: Option<String>,
    pub provider_model: Option<String>,
    /// The provider's id for the call that succeeded, for support tickets with it.
    pub provider_request_id: Option<String>,
    /// What the gate reserves for the job: input from the request, output from its cap
    /// times its choices.
    pub estimated_input_tokens: i32,
    pub estimated_output_tokens: i32,
    /// What the provider reported using (or the estimate, marked, when it reported none).
    pub usage: Option<serde_json::Value>,
    /// The provider's answer in OpenAI's shape, once succeeded.
    pub result: Option<serde_json::Value>,
    /// Why the job failed (a [`crate::vocab::ReasonCode`]) and in words.
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub created_at: DateTime<Utc>,
    /// When its current attempt was claimed.
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// When the gate last admitted it (queue wait ends here).
    pub admitted_at: Option<DateTime<Utc>>,
    /// The buckets the gate reserved in and how much in each (same order): what is settled
    /// or given back when the attempt ends, or by maintenance if its holder died.
    pub reserved_buckets: Option<Vec<i64>>,
    pub reserved_amounts: Option<Vec<f64>>,
    /// The gate's explanation of why a queued job still waits.
    pub admission: Option<serde_json::Value>,
    /// Each change of why it waited (reason, bucket or scope), with when: the latest
    /// (the store keeps 20).
    pub admission_log: Option<serde_json::Value>,
    /// Run by the API process streaming it to its client, not by dispatchers.
    pub stream: bool,
    /// The provider key the gate chose.
    pub provider_key: Option<String>,
    /// Route targets (`provider/model`) that failed this job with an error another target
    /// may not have; the gate prefers the route's other targets.
    pub failed_targets: Option<Vec<String>>,
    /// `online` or `provider_batch` (a [`Lane`]); `None`: undecided.
    pub dispatch_via: Option<String>,
    /// Why the job goes the way it goes (`deadline_allows_batch_api`, ...).
    pub dispatch_reason: Option<String>,
    /// The provider batch carrying (or that carried) the job.
    pub provider_batch_id: Option<String>,
    /// What the job's attempts cost at the configured prices, in micro-USD (a
    /// provider-batch line at the batch price); `None` until one is charged.
    pub spend_micro_usd: Option<f64>,
    /// What its calls at a cheaper lane (a provider batch, the flex tier) saved against the
    /// online price, in micro-USD; `None` when it saved nothing.
    pub saved_micro_usd: Option<f64>,
    /// The API key it was submitted with (`None` before keys were recorded).
    pub api_key: Option<uuid::Uuid>,
    /// What its estimate cost at its price when it was last admitted, in micro-USD: what
    /// its budgets held for it. `None` until admitted.
    pub reserved_micro_usd: Option<f64>,
    /// Where the price of its cost comes from; `None` until admitted.
    pub price_source: Option<crate::vocab::PriceSource>,
    /// Its trace's W3C context ([`NewJob::traceparent`]).
    pub traceparent: Option<String>,
    /// Queued but held out of admission: its batch is paused.
    pub held: bool,
    /// The batch it is a line of.
    pub batch_id: Option<String>,
    /// When it was forecast to finish at submission, p50 and p90 (the `forecast` module);
    /// `None` for jobs forecast with their batch, or not at all.
    pub eta_p50: Option<DateTime<Utc>>,
    pub eta_p90: Option<DateTime<Utc>>,
}

impl Job {
    /// The row a [`NewJob`] becomes when inserted, as the table's defaults fill it.
    pub fn queued(new: &NewJob) -> Self {
        Job {
            id: new.id,
            tenant: new.tenant.clone(),
            class: new.class,
            priority: new.priority,
            state: JobState::Queued,
            endpoint: new.endpoint,
            request: new.request.clone(),
            model: new.model.clone(),
            idempotency_key: new.idempotency_key.clone(),
            metadata: new.metadata.clone(),
            deadline: new.deadline,
            not_before: new.created_at,
            attempt: 0,
            max_attempts: new.max_attempts,
            lease_owner: None,
            lease_expires_at: None,
            provider: None,
            provider_model: None,
            provider_request_id: None,
            estimated_input_tokens: new.estimated_input_tokens,
            estimated_output_tokens: new.estimated_output_tokens,
            usage: None,
            result: None,
            error_code: None,
            error_message: None,
            created_at: new.created_at,
            started_at: None,
            finished_at: None,
            admitted_at: None,
            reserved_buckets: None,
            reserved_amounts: None,
            admission: None,
            admission_log: None,
            stream: new.stream,
            provider_key: None,
            failed_targets: None,
            dispatch_via: None,
            dispatch_reason: None,
            provider_batch_id: None,
            spend_micro_usd: None,
            saved_micro_usd: None,
            api_key: new.api_key,
            reserved_micro_usd: None,
            price_source: None,
            traceparent: new.traceparent.clone(),
            held: false,
            batch_id: None,
            eta_p50: new.eta_p50,
            eta_p90: new.eta_p90,
        }
    }
}

/// What the API inserts. `R` is how the request body is held: parsed (`Value`), or, for
/// a bulk insert, the client's JSON text (`Box<RawValue>`), so a large bulk is not held
/// as a tree of values (10-16 times its size) while it is written.
#[derive(Debug, Clone)]
pub struct NewJob<R = serde_json::Value> {
    /// A UUIDv7: time-ordered, so ids sort as jobs arrived and pages by id are stable.
    pub id: JobId,
    /// Whose job: every read and write is scoped by it (isolation), and fair sharing is
    /// per tenant.
    pub tenant: String,
    /// Precedence at admission (interactive before standard before background before
    /// batch) and the default deadline.
    pub class: JobClass,
    /// Order within a tenant's class (higher first), from -1000 to 1000.
    pub priority: i32,
    pub endpoint: Endpoint,
    pub request: R,
    pub model: String,
    pub idempotency_key: Option<String>,
    pub metadata: Option<serde_json::Value>,
    pub deadline: DateTime<Utc>,
    pub max_attempts: i32,
    pub estimated_input_tokens: i32,
    pub estimated_output_tokens: i32,
    pub created_at: DateTime<Utc>,
    /// A streaming chat completion (see [`Job::stream`]).
    pub stream: bool,
    /// The API key it is submitted with: its limits and budgets are on the job's path.
    pub api_key: Option<uuid::Uuid>,
    /// Its trace's W3C context (`job_trace`): its `job.submit` span, the parent of its
    /// later spans; `None` when jobs are not traced.
    pub traceparent: Option<String>,
    /// When it is forecast to finish, p50 and p90 ([`Job::eta_p50`]).
    pub eta_p50: Option<DateTime<Utc>>,
    pub eta_p90: Option<DateTime<Utc>>,
    /// A synchronous call's: the process (its dispatcher's lease owner) holding the
    /// connection its client waits on for the answer; `None` for a job whose result is
    /// fetched later. Should that process die holding the call, nobody is left to answer.
    pub caller_process: Option<String>,
}

impl<R> NewJob<R> {
    /// The same job with its request held as `f` makes it.
    pub fn map_request<S>(self, f: impl FnOnce(R) -> S) -> NewJob<S> {
        NewJob {
            id: self.id,
            tenant: self.tenant,
            class: self.class,
            priority: self.priority,
            endpoint: self.endpoint,
            request: f(self.request),
            model: self.model,
            idempotency_key: self.idempotency_key,
            metadata: self.metadata,
            deadline: self.deadline,
            max_attempts: self.max_attempts,
            estimated_input_tokens: self.estimated_input_tokens,
            estimated_output_tokens: self.estimated_output_tokens,
            created_at: self.created_at,
            stream: self.stream,
            api_key: self.api_key,
            traceparent: self.traceparent,
            eta_p50: self.eta_p50,
            eta_p90: self.eta_p90,
            caller_process: self.caller_process,
        }
    }
}

/// How a job is sent, and why (`jobs.dispatch_via`, `jobs.dispatch_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decision {
    pub via: Lane,
    pub reason: LaneReason,
}
