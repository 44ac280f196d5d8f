//! One attempt of a job, as it ends: the [`Outcome`] a dispatcher builds from a provider
//! call (or the provider-batch poller from a line of a pack's results), which the store
//! writes in one transaction — the job's row, the record of the call, the settlement of
//! the job's reservation and any pause — guarded by the [`Holder`]'s lease. One type from
//! the call to the row, so what a loop decided is exactly what is written.

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::buckets::Settlement;
use crate::learning::Observation;
use crate::model::{JobId, JobState, Usage};
use crate::vocab::ReasonCode;

/// The most tokens one call may be reported to have used in each of input, output and
/// cache: ten times the largest context window sold.
pub const MAX_USAGE_TOKENS: i64 = 20_000_000;

/// An attempt's outcome, ready to be written (alone or in a batch).
#[derive(Debug, Clone)]
pub struct Outcome {
    pub holder: Holder,
    /// The provider and model the attempt went to, stored on the job; `None` when it went
    /// nowhere (the job keeps what it had).
    pub served: Option<Served>,
    pub end: End,
    /// What the job's reservation is settled with.
    pub settlement: Settlement,
    /// The record of the provider call, when one was made. Written only with `served`
    /// (a call always has a target).
    pub call: Option<Call>,
    /// Pause this scope for every process until then (a provider's 429: its model; a
    /// rejected key: the key).
    pub pause: Option<Pause>,
    /// A route target (`provider/model`) the job leaves for the route's others (fallback).
    pub failed_target: Option<String>,
    /// What the provider's response said about its limits, for the gate to learn; written
    /// after the outcome commits, never inside its transaction.
    pub observation: Option<Observation>,
}

impl Outcome {
    /// An outcome with no call record, pause, fallback or observation. Text the provider
    /// wrote is stored as it came, except U+0000, which no row can hold (one answer with
    /// it must not fail the write it shares with other outcomes), and key-like tokens in
    /// a failure's message, which the tenant reads (`sanitize`).
    pub fn new(holder: Holder, served: Option<Served>, end: End, settlement: Settlement) -> Self {
        Self {
            holder,
            served,
            end: end.without_nul(),
            settlement,
            call: None,
            pause: None,
            failed_target: None,
            observation: None,
        }
    }
}

/// Who holds a running job: the guard of every write to it. A write by a holder whose
/// lease was rescued, or whose job was cancelled, changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub id: JobId,
    pub attempt: i32,
    pub owner: String,
}

/// The provider and model an attempt went to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    pub provider: String,
    pub model: String,
}

impl Served {
    pub fn new(provider: &str, model: &str) -> Self {
        Self {
            provider: provider.to_owned(),
            model: model.to_owned(),
        }
    }
}

/// How the job's attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum End {
    Succeeded {
        result: Value,
        usage: Usage,
        provider_request_id: Option<String>,
    },
    /// Failed for good, with a reason code (README, "Reason codes on failed jobs").
    Failed { code: ReasonCode, message: String },
    /// Back to the queue, not to be admitted again before `not_before`; the reason code
    /// says why it came back.
    Retry {
        not_before: DateTime<Utc>,
        code: ReasonCode,
        message: String,
    },
}

impl End {
    pub fn failed(code: ReasonCode, message: impl Into<String>) -> Self {
        Self::Failed {
            code,
            message: message.into(),
        }
    }

    pub fn retry(not_before: DateTime<Utc>, code: ReasonCode, message: impl Into<String>) -> Self {
        Self::Retry {
            not_before,
            code,
            message: message.into(),
        }
    }

    /// The same end with U+0000 replaced in its result, message and request id, secrets
    /// cut from its message, and its usage within [`MAX_USAGE_TOKENS`].
    fn without_nul(mut self) -> Self {
        match &mut self {
            Self::Succeeded {
                result,
                provider_request_id,
                usage,
            } => {
                // Usage beyond any context window is nonsense, and settling a bucket
                // with it would leave the bucket empty for centuries.
                for tokens in [
                    &mut usage.input_tokens,
                    &mut usage.output_tokens,
                    &mut usage.cached_tokens,
                ] {
                    *tokens = (*tokens).clamp(0, MAX_USAGE_TOKENS);
                }
                crate::sanitize::replace_nul(result);
                if let Some(id) = provider_request_id {
                    crate::sanitize::replace_nul_in(id);
                }
            }
            Self::Failed { message, .. } | Self::Retry { message, .. } => {
                *message = crate::sanitize::redact_secrets(message);
                crate::sanitize::replace_nul_in(message);
            }
        }
        self
    }

    /// The state the job is left in.
    pub fn state(&self) -> JobState {
        match self {
            Self::Succeeded { .. } => JobState::Succeeded,
            Self::Failed { .. } => JobState::Failed,
            Self::Retry { .. } => JobState::Queued,
        }
    }
}

/// The record of one provider call (a `job_attempts` row): estimate against actual usage,
/// status, rate-limit headers. Its job, attempt, provider and model are the outcome's.
#[derive(Debug, Clone)]
pub struct Call {
    /// The job's tenant (for traffic by tenant without reading the job).
    pub tenant: String,
    pub key_name: String,
    pub status: Option<i32>,
    /// The call's own reason code when it failed (`None`: it succeeded), whatever then
    /// became of the job (`attempts_exhausted`, a retry, …).
    pub error_code: Option<ReasonCode>,
    pub provider_request_id: Option<String>,
    pub usage: Option<Usage>,
    pub estimated_input_tokens: i32,
    pub estimated_output_tokens: i32,
    pub rate_limit: Option<Value>,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
}

/// A scope (`provider:oai:gpt-4o`, `key:oai:main`) the gate must not admit to before
/// `until`.
#[derive(Debug, Clone, PartialEq)]
pub struct Pause {
    pub scope: String,
    pub until: DateTime<Utc>,
    /// `rate_limited` or `key_unusable`.
    pub reason: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn what_a_provider_wrote_is_made_storable_and_safe_to_show() {
        let holder = Holder {
            id: JobId(uuid::Uuid::now_v7()),
            attempt: 1,
            owner: "o".into(),
        };
        let absurd = Usage {
            input_tokens: 9_000_000_000_000_000_000,
            output_tokens: -5,
            cached_tokens: 0,
        };
        let succeeded = End::Succeeded {
            result: json!({"content": "a\u{0}b"}),
            usage: absurd,
            provider_request_id: Some("id\u{0}".into()),
        };
        let outcome = Outcome::new(holder.clone(), None, succeeded, Settlement::UNSENT);
        let End::Succeeded {
            result,
            usage,
            provider_request_id,
        } = outcome.end
        else {
            panic!("still a success");
        };
        assert_eq!((usage.input_tokens, usage.output_tokens), (MAX_USAGE_TOKENS, 0));
        assert_eq!(result, json!({"content": "a\u{FFFD}b"}));
        assert_eq!(provider_request_id.as_deref(), Some("id\u{FFFD}"));

        let failed = End::failed(
            ReasonCode::UpstreamAuthFailed,
            "Incorrect API key provided: sk-proj-****abcd\u{0}",
        );
        let outcome = Outcome::new(holder, None, failed, Settlement::UNSENT);
        assert_eq!(
            outcome.end,
            End::failed(
                ReasonCode::UpstreamAuthFailed,
                "Incorrect API key provided: sk-…\u{FFFD}"
            )
        );
    }
}
