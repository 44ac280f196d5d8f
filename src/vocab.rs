//! The vocabulary every part of tollgate speaks: job states and classes, bucket dimensions
//! and rules, provider limit names and the dialects of their signals, how a limit was
//! learned and who has the last word on it, lanes, batch statuses, the API's error codes
//! and the reason codes of failed jobs.
//!
//! Each is an enum. Its string form exists only at the wire (serde) and in SQL (`as_str`,
//! `parse`, one name for both, derived by `strum`), and the OpenAPI schemas of the codes are
//! derived from these enums. Job states and classes are PostgreSQL enums; the others that
//! the store keeps are `text` columns, and bind and decode as their name ([`text_in_sql`]),
//! so a query's Rust types say which vocabulary a column holds. A leaf module: it imports nothing of the core, so any module
//! may use it without an import cycle.

use serde::{Deserialize, Serialize};
use strum::{EnumString, IntoStaticStr, VariantArray};
use utoipa::ToSchema;

/// `as_str` and `parse` for vocabulary enums: the names serde and SQL use.
macro_rules! wire_names {
    ($($ty:ty),* $(,)?) => {$(
        impl $ty {
            pub fn as_str(self) -> &'static str {
                self.into()
            }

            pub fn parse(s: &str) -> Option<Self> {
                s.parse().ok()
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    )*};
}

/// `sqlx` encoding for vocabulary kept in `text` columns: the value is its name, and a name
/// the enum does not know is a decode error.
macro_rules! text_in_sql {
    ($($ty:ty),* $(,)?) => {$(
        impl sqlx::Type<sqlx::Postgres> for $ty {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::Type<sqlx::Postgres>>::type_info()
            }

            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        impl sqlx::postgres::PgHasArrayType for $ty {
            fn array_type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::postgres::PgHasArrayType>::array_type_info()
            }
        }

        impl sqlx::Encode<'_, sqlx::Postgres> for $ty {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $ty {
            fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
                let name = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
                Self::parse(name).ok_or_else(|| format!("not a {}: {name:?}", stringify!($ty)).into())
            }
        }
    )*};
}

text_in_sql!(
    Endpoint,
    Dimension,
    Rule,
    LimitName,
    LearnedFrom,
    Lane,
    LaneReason,
    PriceSource,
    BatchStatus,
    ReasonCode
);

wire_names!(
    Endpoint,
    JobState,
    JobClass,
    Dimension,
    Rule,
    LimitName,
    Dialect,
    Authority,
    LearnedFrom,
    Lane,
    LaneReason,
    PriceSource,
    BatchStatus,
    ApiErrorCode,
    ReasonCode,
);

#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    sqlx::Type,
    IntoStaticStr,
    EnumString,
    VariantArray,
    ToSchema,
)]
#[sqlx(type_name = "job_state", rename_all = "lowercase")]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum JobState {
    /// Waiting for the gate (possibly not before `not_before`).
    Queued,
    /// Admitted by the gate: every bucket on its path holds its reservation; waiting for a
    /// dispatcher.
    Admitted,
    /// Claimed by a dispatcher holding a lease; a provider call may be in flight.
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

/// Workload class; declaration order is precedence (PostgreSQL enums sort the same way).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    sqlx::Type,
    IntoStaticStr,
    EnumString,
    VariantArray,
    ToSchema,
)]
#[sqlx(type_name = "job_class", rename_all = "lowercase")]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum JobClass {
    Interactive,
    Standard,
    Background,
    Batch,
}

/// The kind of work a job is: the API path its request is for (`jobs.endpoint`, a batch's
/// `endpoint`, a batch line's `url`). The request is kept in that endpoint's shape
/// (OpenAI's, or Anthropic's for Messages); adapters translate it for providers of other
/// shapes.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    IntoStaticStr,
    EnumString,
    VariantArray,
    ToSchema,
)]
pub enum Endpoint {
    /// Chat Completions: `messages` in, a completion out; input and output tokens.
    #[default]
    #[serde(rename = "/v1/chat/completions")]
    #[strum(serialize = "/v1/chat/completions")]
    ChatCompletions,
    /// Embeddings: `input` in, vectors out; input tokens only.
    #[serde(rename = "/v1/embeddings")]
    #[strum(serialize = "/v1/embeddings")]
    Embeddings,
    /// OpenAI Moderations: `input` in, a verdict per input out; requests only, no tokens.
    #[serde(rename = "/v1/moderations")]
    #[strum(serialize = "/v1/moderations")]
    Moderations,
    /// OpenAI Responses: `input` (text or items) in, a response of output items out.
    #[serde(rename = "/v1/responses")]
    #[strum(serialize = "/v1/responses")]
    Responses,
    /// Anthropic Messages, kept in Anthropic's shape (the one endpoint that is not
    /// OpenAI's): `messages` and `max_tokens` in, a message out.
    #[serde(rename = "/v1/messages")]
    #[strum(serialize = "/v1/messages")]
    Messages,
    /// OpenAI's legacy Completions: a `prompt` (or several) in, text out.
    #[serde(rename = "/v1/completions")]
    #[strum(serialize = "/v1/completions")]
    Completions,
}

impl Endpoint {
    /// Every endpoint tollgate runs.
    pub fn all() -> &'static [Endpoint] {
        Self::VARIANTS
    }

    /// Whether a request of it may ask to be streamed (embeddings and moderations answer
    /// whole).
    pub fn streams(self) -> bool {
        !matches!(self, Self::Embeddings | Self::Moderations)
    }
}

/// What a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, IntoStaticStr, EnumString, VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum Dimension {
    Requests,
    InputTokens,
    OutputTokens,
    TotalTokens,
    Concurrency,
    SpendMicroUsd,
}

impl Dimension {
    /// An amount of this dimension as people read it: spend in dollars (`$0.028000`),
    /// everything else a whole count.
    pub fn show(self, amount: f64) -> String {
        match self {
            Self::SpendMicroUsd => format!("${:.6}", amount / 1e6),
            _ => format!("{amount:.0}"),
        }
    }
}

/// How a bucket refills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, IntoStaticStr, EnumString, VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum Rule {
    /// Continuous refill: `capacity` per `window_secs`, never above `capacity`.
    Rolling,
    /// All of `capacity` again at each window boundary (UTC midnight for daily windows).
    Fixed,
    /// Acquire and release (concurrency).
    Gauge,
    /// A cap on how fast the admitted rate may grow (providers with acceleration limits):
    /// each window allows what the previous one used plus `ramp_step`; `capacity` is the
    /// current window's allowance.
    Ramp,
}

/// A provider limit, named as tollgate's provider buckets are (`provider:oai:gpt-4o:rpm`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, IntoStaticStr, EnumString, VariantArray,
)]
#[strum(serialize_all = "lowercase")]
pub enum LimitName {
    Rpm,
    Rpd,
    Tpm,
    Itpm,
    Otpm,
}

impl LimitName {
    pub const ALL: &[LimitName] = Self::VARIANTS;

    pub fn dimension(self) -> Dimension {
        match self {
            Self::Rpm | Self::Rpd => Dimension::Requests,
            Self::Tpm => Dimension::TotalTokens,
            Self::Itpm => Dimension::InputTokens,
            Self::Otpm => Dimension::OutputTokens,
        }
    }

    pub fn rule(self) -> Rule {
        if self == Self::Rpd {
            Rule::Fixed
        } else {
            Rule::Rolling
        }
    }

    pub fn window_secs(self) -> i64 {
        if self == Self::Rpd { 86_400 } else { 60 }
    }
}

/// Which rate-limit signals a provider sends, and what they mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, IntoStaticStr, EnumString)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Dialect {
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`: RPM and TPM.
    Openai,
    /// As OpenAI, but the request limit is per day (RPD).
    Groq,
    /// `anthropic-ratelimit-{requests,input-tokens,output-tokens,tokens}-*`.
    Anthropic,
    /// `x-ratelimit-{limit,remaining}-{req,tokens}-minute`.
    Mistral,
    /// `x-ratelimit-{limit,remaining,reset}` and `x-tokenlimit-*`, per second.
    Together,
    /// OpenAI's header names; a limit of 0 or -1 means "not reported".
    Azure,
    /// No headers; 429 bodies carry `QuotaFailure` and `RetryInfo`.
    Gemini,
    /// Sends nothing (DeepSeek): limits are learned from 429s alone.
    None,
}

/// Who decides a limit when both the config and the provider say something.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, IntoStaticStr, EnumString)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Authority {
    /// The configured limit is an upper bound: capacity = min(configured, reported).
    #[default]
    Config,
    /// The provider's reported limit replaces the configured one.
    Provider,
}

/// How a learned limit was learned (`learned_limits.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, IntoStaticStr, EnumString)]
#[strum(serialize_all = "lowercase")]
pub enum LearnedFrom {
    /// The provider reported it.
    Headers,
    /// Its 429s taught it.
    Throttling,
}

/// How a job is sent to its provider (`jobs.dispatch_via`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, IntoStaticStr, EnumString)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Lane {
    /// One call per job, as it is admitted.
    Online,
    /// Through the provider's own batch API, at the batch price.
    ProviderBatch,
    /// One call per job at the provider's flex tier: cheaper and slower, and refused when
    /// the tier has no capacity (then online).
    Flex,
}

/// Why a job goes the lane it goes (`jobs.dispatch_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, IntoStaticStr, EnumString)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum LaneReason {
    /// Its deadline leaves the provider's batch window: the batch API carries it.
    DeadlineAllowsBatchApi,
    /// Its deadline is closer than the provider's batch window, but the provider's batches
    /// have been ending sooner (their observed turnaround plus `pull_back_secs` fits).
    ObservedTurnaroundAllowsBatchApi,
    /// Its deadline is closer than the provider's batch window (and than its batches'
    /// observed turnaround and `pull_back_secs`).
    DeadlineTooCloseForBatchApi,
    /// Its route's first target has no batch API enabled.
    RouteHasNoBatchApi,
    /// Its route's first target's batch API does not take its endpoint.
    EndpointNotBatched,
    /// A line the provider failed or expired, sent back online.
    ProviderBatchFailedRetryOnline,
    /// A line of a provider batch that would not finish before its deadline: the batch
    /// was cancelled and the line sent online.
    PulledBackFromProviderBatch,
    /// The same, sent to the provider's flex tier instead: it may serve the line in time.
    PulledBackToFlex,
    /// Its deadline leaves the flex tier's time (`flex.min_deadline_secs`, and, once the
    /// tier has been observed, its p90 latency plus `flex.fallback_secs`): sent at the
    /// flex price.
    DeadlineAllowsFlex,
    /// Its deadline is closer than `flex.min_deadline_secs`, but the tier has lately
    /// answered sooner (its observed p90 latency plus `flex.fallback_secs` fits).
    ObservedLatencyAllowsFlex,
    /// The tier has lately answered too slowly for its deadline (observed p90 latency plus
    /// `flex.fallback_secs`): sent online.
    FlexTooSlowForDeadline,
    /// The tier has lately refused most calls for capacity: sent online.
    FlexMostlyUnavailable,
    /// The flex tier had no capacity for it: sent online.
    FlexUnavailableRetryOnline,
}

/// Where the price a job's cost is reckoned at comes from (`jobs.price_source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, IntoStaticStr, EnumString)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum PriceSource {
    /// The provider's price for the model (`providers[].prices.<model>`).
    Model,
    /// The provider's price for every model (`providers[].prices."*"`).
    Provider,
    /// No price is configured: the job costs nothing against budgets.
    Unpriced,
}

/// A batch's status, as OpenAI's Batch API names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, IntoStaticStr, EnumString)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum BatchStatus {
    Validating,
    Failed,
    InProgress,
    Finalizing,
    Completed,
    Expired,
    Cancelling,
    Cancelled,
}

impl BatchStatus {
    /// Finished: its output and error files exist and nothing about it changes any more.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Failed | Self::Completed | Self::Expired | Self::Cancelled
        )
    }

    /// The webhook event announcing this terminal status.
    pub fn event_type(self) -> Option<&'static str> {
        match self {
            Self::Completed => Some("batch.completed"),
            Self::Failed => Some("batch.failed"),
            Self::Expired => Some("batch.expired"),
            Self::Cancelled => Some("batch.cancelled"),
            _ => None,
        }
    }
}

/// The stable codes of API errors: branch on these, not on messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, IntoStaticStr, EnumString, ToSchema)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
#[schema(as = ErrorCode)]
pub enum ApiErrorCode {
    /// 400: the body is not JSON.
    InvalidJson,
    /// 400: the body could not be read.
    UnreadableBody,
    /// 400: the body is not what the endpoint takes.
    InvalidRequest,
    /// 400: a string in the body holds U+0000, which tollgate cannot store (`param`
    /// points at it).
    NulCharacter,
    /// 400: a required field is absent.
    MissingField,
    /// 400: a request field whose cost tollgate cannot reserve (audio, file parts, web
    /// search, a `service_tier` billed above standard rates): `param` names it.
    UnsupportedField,
    /// 400: the model is neither a route alias, a configured `provider/model`, nor a model
    /// a provider lists.
    UnknownModel,
    /// 400: no target of the model's route serves the request's endpoint (Anthropic has no
    /// embeddings API); `param` is the model.
    EndpointNotServed,
    /// 400: the deadline is in the past.
    InvalidDeadline,
    /// 400: `stream: true` on a queued job (use `/v1/chat/completions`).
    StreamNotSupported,
    /// 400: `POST /v1/jobs/bulk` with no jobs or more than `server.max_bulk_jobs`.
    TooManyJobs,
    /// 400: two jobs of one bulk request share an idempotency key.
    DuplicateIdempotencyKey,
    /// 401: no `Authorization: Bearer` key.
    MissingApiKey,
    /// 401: the key is not a tenant's (or not the admin key).
    InvalidApiKey,
    /// 403: the endpoint needs the admin key.
    AdminOnly,
    /// 403: the API key's scopes do not allow this model, endpoint, class or priority
    /// (`param` names which).
    KeyNotPermitted,
    /// 404: no such job (or another tenant's).
    NotFound,
    /// 404: unknown path.
    NoSuchEndpoint,
    /// 409: the idempotency key was used for a different request.
    IdempotencyKeyReused,
    /// 409: cancelling a finished job.
    JobAlreadyFinished,
    /// 409: retrying a job that did not fail and was not cancelled, a batch's line, or a
    /// cancelled job whose call is still in flight.
    JobNotRetryable,
    /// 409: creating what exists already (a tenant of that name).
    AlreadyExists,
    /// 409: deleting a tenant that other tenants name as their parent, or that has jobs not
    /// finished.
    TenantInUse,
    /// 413: the body is larger than `server.max_body_bytes`.
    BodyTooLarge,
    /// 429 (+ `Retry-After`): the tenant's queue of that class is full.
    QueueFull,
    /// 429 (+ `Retry-After`): a synchronous call could not be served in time.
    QueueTimeout,
    /// 429: the synchronous job's deadline passed.
    DeadlineExceeded,
    /// Capacity is not expected before the deadline: 422 at submission (the work's
    /// forecast, with `earliest_feasible_at`), 429 for a synchronous call the gate found so.
    DeadlineUnmeetable,
    /// 400: `metadata` is over 16 KiB serialized.
    MetadataTooLarge,
    /// 400: an upload that is not `multipart/form-data` with a `file` part.
    InvalidMultipart,
    /// 400: a file `purpose` tollgate does not accept.
    InvalidPurpose,
    /// 400: a batch's input file is not a `batch` file.
    InvalidFilePurpose,
    /// 400: an empty file.
    EmptyFile,
    /// 400: a file with more than `batches.max_lines` lines.
    TooManyLines,
    /// 400: a batch `endpoint` tollgate does not run.
    UnsupportedEndpoint,
    /// 400: a `completion_window` that is malformed or out of range.
    InvalidCompletionWindow,
    /// 400: a webhook secret that is not `whsec_` + base64.
    InvalidWebhookSecret,
    /// 400: a webhook URL that resolves to an internal address.
    WebhookUrlNotAllowed,
    /// 409: cancelling a finished batch.
    BatchAlreadyFinished,
    /// 409: the results of, or deleting, a batch that has not finished.
    BatchNotFinished,
    /// 413: an upload larger than `batches.max_file_bytes`.
    FileTooLarge,
    /// 413: an item of `POST /v1/jobs/bulk` larger than one job's body may be
    /// (`server.max_body_bytes`); `param` names the item.
    ItemTooLarge,
    /// 429: an upload would take the tenant past one of its storage quotas; `param` names
    /// the quota (`max_files`, `max_stored_file_bytes`).
    QuotaExceeded,
    /// 429 (+ `Retry-After`): the tenant's requests to the API are over
    /// `server.api_rate_per_sec`.
    ApiRateLimited,
    /// 431: the request's headers are larger than `server.max_header_bytes`.
    HeadersTooLarge,
    /// 400/409/429/502 from `POST /v1/chat/completions`: the failed job's reason
    /// (`JobErrorCode`), mapped to the status an OpenAI client expects.
    UpstreamFailed,
    UpstreamAuthFailed,
    InsufficientQuota,
    SpendLimitReached,
    RequestTooLarge,
    ProviderRejectedRequest,
    Cancelled,
    StreamingUnsupported,
    RateLimited,
    ExceedsLimit,
    /// 500: an internal failure; retry.
    InternalError,
    /// 503 (+ `Retry-After`): the database is unreachable.
    DatabaseUnavailable,
    /// 503 (+ `Retry-After`): the process serves `server.max_connections` connections
    /// already; this one is closed after the answer.
    ServerBusy,
}

/// Reason codes of failed jobs (`error.code` on the job) and of synchronous failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, IntoStaticStr, EnumString, ToSchema)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
#[schema(as = JobErrorCode)]
pub enum ReasonCode {
    /// The job is larger than a bucket's whole capacity.
    ExceedsLimit,
    /// Capacity is not expected before the deadline (e.g. a daily budget).
    DeadlineUnmeetable,
    RateLimited,
    ProviderOverloaded,
    ProviderError,
    NetworkError,
    ProviderTimeout,
    ProviderBadResponse,
    AttemptsExhausted,
    DeadlineExceeded,
    LeaseExpired,
    UpstreamAuthFailed,
    InsufficientQuota,
    SpendLimitReached,
    RequestTooLarge,
    ProviderRejectedRequest,
    UnknownModel,
    Cancelled,
    /// Every key that could serve the job was rejected by its provider (401/403).
    UpstreamCredentialsExhausted,
    ClientDisconnected,
    /// Back to the queue before the call: its key was just rejected.
    UpstreamKeyRotated,
    /// Back to the queue before the call: its model just answered 429 to this process.
    TargetPaused,
    /// A line of a provider batch the provider expired, errored, did not return, refused
    /// or that was never submitted, past its deadline (else it went back online).
    ProviderBatchExpired,
    ProviderBatchErrored,
    ProviderBatchMissingResult,
    ProviderBatchRefused,
    ProviderBatchNotSubmitted,
    /// A line of a provider batch the provider canceled, past its deadline.
    ProviderBatchCanceled,
    /// The job's route names a provider this process does not know.
    UnknownProvider,
    /// A streamed call to a target whose adapter does not stream.
    StreamingUnsupported,
    /// The provider's flex tier had no capacity for the call (OpenAI's 429 "Resource
    /// Unavailable", Groq's 498 `capacity_exceeded`): the job goes online.
    FlexUnavailable,
    /// A line of a batch that was cancelled before it finished.
    BatchCancelled,
    /// A line of a batch whose completion window ended before it finished.
    BatchExpired,
    /// A line of a batch whose spend reached its `max_cost_usd`: it no longer fits.
    BatchCostCapReached,
    /// A line of a batch stopped because too many of its lines failed (`max_error_rate`).
    BatchErrorRateExceeded,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_and_wire_names_are_the_same() {
        assert_eq!(JobState::Admitted.as_str(), "admitted");
        assert_eq!(
            serde_json::to_value(JobState::Admitted).unwrap(),
            serde_json::json!("admitted")
        );
        assert_eq!(Dimension::SpendMicroUsd.as_str(), "spend_micro_usd");
        assert_eq!(Dimension::SpendMicroUsd.show(28_000.0), "$0.028000");
        assert_eq!(Dimension::InputTokens.show(1234.4), "1234");
        assert_eq!(Dimension::parse("input_tokens"), Some(Dimension::InputTokens));
        assert_eq!(Dimension::parse("tokens"), None);
        assert_eq!(LimitName::ALL.len(), 5);
        assert_eq!(LimitName::parse("otpm"), Some(LimitName::Otpm));
        assert_eq!(BatchStatus::InProgress.as_str(), "in_progress");
        assert_eq!(
            serde_json::to_value(BatchStatus::InProgress).unwrap(),
            serde_json::json!("in_progress")
        );
        assert_eq!(ApiErrorCode::InvalidJson.as_str(), "invalid_json");
        assert_eq!(
            serde_json::to_value(ApiErrorCode::WebhookUrlNotAllowed).unwrap(),
            serde_json::json!("webhook_url_not_allowed")
        );
        assert_eq!(
            ReasonCode::UpstreamCredentialsExhausted.to_string(),
            "upstream_credentials_exhausted"
        );
        assert_eq!(
            LaneReason::DeadlineAllowsBatchApi.as_str(),
            "deadline_allows_batch_api"
        );
        assert_eq!(Lane::ProviderBatch.as_str(), "provider_batch");
    }
}
