//! Failure classification and the retry decision: every provider failure is classified
//! once, here, into a [`FailureClass`] with a stable reason code; what follows a failed
//! call — retry after a backoff, fall back to another route target, rotate the key, pause
//! a scope, or fail with a reason — is decided once, here, by [`decide`], a pure function
//! of the failure, the job's attempts and deadline, its route, the policy, `now` and a
//! jitter source. The dispatcher only writes what the [`Decision`] says. Retries are the
//! broker's decision alone (adapters never retry).

use std::time::Duration;

use chrono::{DateTime, Utc};
use http::HeaderMap;

use crate::attempt::Pause;
use crate::buckets;
use crate::config::Config;
use crate::ratelimit;
use crate::routing::Target;
use crate::vocab::Dialect;
use crate::vocab::ReasonCode;

/// What kind of failure a provider call ended in, and so what to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// A rate limit (429 with a retryable cause): wait at least Retry-After, then retry.
    Capacity,
    /// The provider is overloaded or erring (500, 502, 503, 504, 529): back off, retry.
    Overload,
    /// The key is rejected or out of credit (401, 402, 403, `insufficient_quota`).
    KeyUnusable,
    /// A spend cap that lifts only at its reset (Anthropic `enforced_spend_limit_reached`).
    SpendCap,
    /// The request itself is wrong (400, 404, 413, 422, "Request too large"): never retry.
    Request,
    /// Connection refused or reset, broken or unreadable response: back off, retry.
    Network,
    /// The call took longer than the configured timeout: back off, retry.
    Timeout,
}

impl FailureClass {
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::Capacity | Self::Overload | Self::Network | Self::Timeout
        )
    }
}

/// A classified failure.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub class: FailureClass,
    /// Stable reason code stored on the job (`rate_limited`, `provider_overloaded`, …).
    pub code: ReasonCode,
    pub message: String,
    pub status: Option<u16>,
    /// The provider's own hint of when to come back.
    pub retry_after: Option<Duration>,
}

impl Failure {
    pub fn network(message: impl Into<String>) -> Self {
        Self {
            class: FailureClass::Network,
            code: ReasonCode::NetworkError,
            message: message.into(),
            status: None,
            retry_after: None,
        }
    }

    /// A 2xx the adapter could not read (truncated, not JSON, no `choices`): the call
    /// may have been served, but its answer is lost; retried like a broken connection.
    pub fn bad_response(message: impl Into<String>, status: u16) -> Self {
        Self {
            class: FailureClass::Network,
            code: ReasonCode::ProviderBadResponse,
            message: message.into(),
            status: Some(status),
            retry_after: None,
        }
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self {
            class: FailureClass::Timeout,
            code: ReasonCode::ProviderTimeout,
            message: message.into(),
            status: None,
            retry_after: None,
        }
    }
}

/// Classifies a non-2xx provider response from its status, headers and body.
///
/// The body matters: OpenAI sends retryable and non-retryable 429s alike, told apart only
/// by `error.code` / `error.type` and the message (PROVIDERS.md §1.2, §2.2). Gemini's
/// `RESOURCE_EXHAUSTED` is capacity even for a per-day quota: its `RetryInfo` delay is the
/// wait (§3); Azure's 429 carries the string code `"429"` and `retry-after(-ms)` (§4).
pub fn classify_response(status: u16, headers: &HeaderMap, body: &[u8]) -> Failure {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    let field = |name: &str| {
        error
            .and_then(|e| e.get(name))
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let (err_type, err_code, message) = (field("type"), field("code"), field("message"));
    let spend_cap = error
        .and_then(|e| e.get("details"))
        .and_then(|d| d.get("error_code"))
        .and_then(|c| c.as_str())
        == Some("enforced_spend_limit_reached");
    // Google answers a wrong API key with 400 INVALID_ARGUMENT and this `ErrorInfo` reason.
    let key_invalid = error
        .and_then(|e| e.get("details"))
        .and_then(|d| d.as_array())
        .is_some_and(|d| {
            d.iter()
                .any(|x| x.get("reason").and_then(|r| r.as_str()) == Some("API_KEY_INVALID"))
        });
    let message = if !message.is_empty() {
        message
    } else if body.iter().all(u8::is_ascii_whitespace) {
        format!("the provider answered HTTP {status} with no error message")
    } else {
        String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned()
    };
    // Retry-After headers, Gemini's `RetryInfo`, OpenAI's "try again in".
    let retry_after = ratelimit::read(Dialect::None, headers, body, Utc::now()).retry_after;
    let (class, code) = match status {
        429 if spend_cap => (FailureClass::SpendCap, ReasonCode::SpendLimitReached),
        429 if err_code == "insufficient_quota" || err_type == "insufficient_quota" => {
            (FailureClass::KeyUnusable, ReasonCode::InsufficientQuota)
        }
        429 if message.starts_with("Request too large") => {
            (FailureClass::Request, ReasonCode::RequestTooLarge)
        }
        // The flex tier's own: OpenAI's 429 "Resource Unavailable", Groq's 498
        // `capacity_exceeded`. Not a rate limit: nothing to learn, nothing to pause.
        429 if err_code == "resource_unavailable"
            || message.to_ascii_lowercase().starts_with("resource unavailable") =>
        {
            (FailureClass::Overload, ReasonCode::FlexUnavailable)
        }
        498 => (FailureClass::Overload, ReasonCode::FlexUnavailable),
        429 => (FailureClass::Capacity, ReasonCode::RateLimited),
        401 | 403 => (FailureClass::KeyUnusable, ReasonCode::UpstreamAuthFailed),
        400 if key_invalid => (FailureClass::KeyUnusable, ReasonCode::UpstreamAuthFailed),
        402 => (FailureClass::KeyUnusable, ReasonCode::InsufficientQuota),
        408 => (FailureClass::Timeout, ReasonCode::ProviderTimeout),
        413 => (FailureClass::Request, ReasonCode::RequestTooLarge),
        400 | 404 | 409 | 422 => (FailureClass::Request, ReasonCode::ProviderRejectedRequest),
        529 | 503 => (FailureClass::Overload, ReasonCode::ProviderOverloaded),
        s if s >= 500 => (FailureClass::Overload, ReasonCode::ProviderError),
        _ => (FailureClass::Request, ReasonCode::ProviderRejectedRequest),
    };
    Failure {
        class,
        code,
        message,
        status: Some(status),
        retry_after,
    }
}

/// The broker's retry policy: capped exponential backoff with jitter; a provider's
/// Retry-After is a lower bound, never shortened.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub base: Duration,
    pub max: Duration,
    /// How long a 429 without a Retry-After pauses its target.
    pub rate_limit_pause: Duration,
    /// How long a key the provider rejected is paused (`dispatch.dead_key_secs`).
    pub rejected_key_pause: Duration,
}

impl From<&Config> for RetryPolicy {
    fn from(c: &Config) -> Self {
        Self {
            base: Duration::from_millis(c.retry.base_delay_ms),
            max: Duration::from_millis(c.retry.max_delay_ms),
            rate_limit_pause: Duration::from_secs(1),
            rejected_key_pause: Duration::from_secs(c.dispatch.dead_key_secs),
        }
    }
}

impl RetryPolicy {
    /// Delay before the next attempt after `attempts_done` attempts: base·2^(n-1), capped,
    /// times a jitter factor in [0.75, 1] (`unit` in [0, 1] picks it); never less than
    /// `retry_after`.
    pub fn delay(&self, attempts_done: u32, retry_after: Option<Duration>, unit: f64) -> Duration {
        let exp = attempts_done.saturating_sub(1).min(20);
        let backoff = self.base.saturating_mul(1u32 << exp).min(self.max);
        let backoff = backoff.mul_f64(0.75 + 0.25 * unit.clamp(0.0, 1.0));
        match retry_after {
            Some(hint) => hint.max(backoff),
            None => backoff,
        }
    }
}

/// A pause plus up to a tenth of it (at most 250 ms), `unit` in [0, 1] of that, so the
/// instances and jobs a 429 stopped do not all come back in the same instant.
pub fn spread(pause: Duration, unit: f64) -> Duration {
    let most = (pause / 10).min(Duration::from_millis(250));
    pause + most.mul_f64(unit.clamp(0.0, 1.0))
}

/// A failed provider call of a job, with what [`decide`] needs to know about the job.
#[derive(Debug, Clone, Copy)]
pub struct FailedCall<'a> {
    pub failure: &'a Failure,
    /// The provider and model the call went to.
    pub provider: &'a str,
    pub model: &'a str,
    /// The key the call used, if it got as far as choosing one.
    pub key: Option<&'a str>,
    /// The scope the call's provider limits are learned under: its key's pool's, or its
    /// model's (`buckets::learned_scope`). A 429 pauses it.
    pub scope: &'a str,
    /// The attempt that failed (the first is 1).
    pub attempt: i32,
    /// Attempts the job may make on each target of its route.
    pub max_attempts: i32,
    pub deadline: DateTime<Utc>,
    /// Route targets (`provider/model`) the job already left after failing on them.
    pub failed_targets: &'a [String],
    /// The targets of the job's route, in order.
    pub route: &'a [Target],
}

/// What follows a failed call.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub next: Next,
    /// A scope to pause for every process until then: the target, or its key's quota pool,
    /// after a 429 (a rate limit holds for everyone, so queued jobs wait instead of meeting
    /// 429s too), the key after the provider rejected it. Written whatever becomes of the
    /// job.
    pub pause: Option<Pause>,
    /// The target (`provider/model`) the job leaves for the route's others (fallback),
    /// recorded on the job even when it fails now.
    pub leave_target: Option<String>,
}

/// What becomes of the job.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Finish it failed with this reason code.
    Fail { code: ReasonCode, message: String },
    /// Back to the queue for the same target, not to be admitted again before `at`
    /// (`delay` after the failure).
    Retry { at: DateTime<Utc>, delay: Duration },
    /// Back to the queue at once, for a route target it has not failed on, with a retry
    /// budget of its own.
    FallBack,
    /// Back to the queue at once, for another of the provider's keys (this one is paused).
    RotateKey,
}

/// The retry decision: retry with backoff while attempts and the deadline allow; otherwise
/// fail with the failure's reason code, `attempts_exhausted`, or `deadline_exceeded` when
/// the next try would land late. An error another target of the route may not have
/// (overload, network, timeout) sends the job to a target it has not failed on, at once;
/// a rejected key sends it back at once for another key. `jitter` yields numbers in
/// [0, 1]: the backoff's factor and the spread of a 429's pause.
pub fn decide(
    failed: &FailedCall<'_>,
    policy: &RetryPolicy,
    now: DateTime<Utc>,
    mut jitter: impl FnMut() -> f64,
) -> Decision {
    let failure = failed.failure;
    let here = format!("{}/{}", failed.provider, failed.model);
    let failed_before = failed.failed_targets;
    let fall_back = matches!(
        failure.class,
        FailureClass::Overload | FailureClass::Network | FailureClass::Timeout
    ) && failed
        .route
        .iter()
        .any(|t| t.label() != here && !failed_before.contains(&t.label()));
    // Each target the job reaches brings its own `max_attempts`.
    let budget = failed.max_attempts * (1 + failed_before.len() as i32 + i32::from(fall_back));
    let attempts_left = failed.attempt < budget;
    let rotate = failure.class == FailureClass::KeyUnusable && failed.key.is_some();
    // A 429 on one of the model's pools pauses that pool only: the job may go at once to
    // another pool with room (the gate keeps it off the paused one).
    let other_pools = failure.class == FailureClass::Capacity
        && failed.scope != buckets::target_scope(failed.provider, failed.model);
    let delay = if rotate || fall_back || other_pools {
        Duration::ZERO
    } else {
        policy.delay(failed.attempt as u32, failure.retry_after, jitter())
    };
    let not_before = now + delay;
    let next = if !failure.class.is_retryable() && !rotate {
        Next::Fail {
            code: failure.code,
            message: failure.message.clone(),
        }
    } else if !attempts_left {
        Next::Fail {
            code: ReasonCode::AttemptsExhausted,
            message: format!(
                "{} attempts made; last error {}: {}",
                failed.attempt, failure.code, failure.message
            ),
        }
    } else if not_before >= failed.deadline {
        Next::Fail {
            code: ReasonCode::DeadlineExceeded,
            message: format!(
                "the next attempt (in {:.1} s) would start after the deadline; last error {}: {}",
                delay.as_secs_f64(),
                failure.code,
                failure.message
            ),
        }
    } else if rotate {
        Next::RotateKey
    } else if fall_back {
        Next::FallBack
    } else {
        Next::Retry {
            at: not_before,
            delay,
        }
    };
    let pause = match (failure.class, failed.key) {
        (FailureClass::Capacity, _) => Some(Pause {
            scope: failed.scope.to_owned(),
            until: now + spread(failure.retry_after.unwrap_or(policy.rate_limit_pause), jitter()),
            reason: "rate_limited",
        }),
        (FailureClass::KeyUnusable, Some(key)) => Some(Pause {
            scope: buckets::key_scope(failed.provider, key),
            until: now + policy.rejected_key_pause,
            reason: "key_unusable",
        }),
        _ => None,
    };
    Decision {
        next,
        pause,
        leave_target: fall_back.then_some(here),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn classifies_openai_429_variants_by_body() {
        let h = HeaderMap::new();
        let rpm = br#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on requests per min (RPM): Limit 3, Used 3, Requested 1. Please try again in 20s. Visit https://platform.openai.com/account/rate-limits to learn more.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
        let f = classify_response(429, &h, rpm);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Capacity, ReasonCode::RateLimited)
        );
        assert_eq!(f.retry_after, Some(Duration::from_secs(20)));
        let too_large = br#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 31538.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
        assert_eq!(classify_response(429, &h, too_large).class, FailureClass::Request);
        let quota = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
        assert_eq!(classify_response(429, &h, quota).class, FailureClass::KeyUnusable);
        // The flex tier without capacity is its own, not a rate limit.
        let flex = br#"{"error":{"message":"Resource Unavailable: flex processing has no capacity","type":"resource_unavailable","param":null,"code":"resource_unavailable"}}"#;
        let groq = br#"{"error":{"message":"Flex tier capacity exceeded. This is a known issue","type":"capacity_exceeded","code":"capacity_exceeded"}}"#;
        for (status, body) in [(429, &flex[..]), (498, &groq[..])] {
            let f = classify_response(status, &h, body);
            assert_eq!(
                (f.class, f.code),
                (FailureClass::Overload, ReasonCode::FlexUnavailable)
            );
        }
    }

    #[test]
    fn classifies_anthropic_and_statuses() {
        let h = headers(&[("retry-after", "7")]);
        let spend = br#"{"type":"error","error":{"type":"rate_limit_error","message":"spend","details":{"error_code":"enforced_spend_limit_reached"}}}"#;
        assert_eq!(classify_response(429, &h, spend).class, FailureClass::SpendCap);
        let limited = br#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of requests has exceeded your rate limit."}}"#;
        let f = classify_response(429, &h, limited);
        assert_eq!(f.class, FailureClass::Capacity);
        assert_eq!(f.retry_after, Some(Duration::from_secs(7)));
        let overloaded = br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        assert_eq!(
            classify_response(529, &h, overloaded).class,
            FailureClass::Overload
        );
        assert_eq!(
            classify_response(401, &h, b"nope").class,
            FailureClass::KeyUnusable
        );
        assert_eq!(classify_response(400, &h, b"{}").class, FailureClass::Request);
        assert_eq!(
            classify_response(502, &h, b"<html>").code,
            ReasonCode::ProviderError
        );
    }

    /// Found by the `provider_responses` fuzz target: an error answer without a body (or
    /// with blanks only) left the failure, and so the job's error, without a message.
    #[test]
    fn an_error_without_a_body_still_says_what_happened() {
        let h = HeaderMap::new();
        for body in [&b""[..], b" \r\n"] {
            let f = classify_response(400, &h, body);
            assert!(f.message.contains("HTTP 400"), "{body:?}: {:?}", f.message);
        }
        assert_eq!(classify_response(502, &h, b"<html>").message, "<html>");
    }

    #[test]
    fn classifies_gemini_and_azure() {
        let h = HeaderMap::new();
        let per_day = br#"{"error":{"code":429,"message":"You exceeded your current quota. Please retry in 36.4s.","status":"RESOURCE_EXHAUSTED","details":[
            {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier","quotaValue":"20"}]},
            {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"36s"}]}}"#;
        let f = classify_response(429, &h, per_day);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Capacity, ReasonCode::RateLimited)
        );
        assert_eq!(f.retry_after, Some(Duration::from_secs(36)));
        let invalid = br#"{"error":{"code":400,"message":"* GenerateContentRequest.contents: contents is not specified","status":"INVALID_ARGUMENT"}}"#;
        assert_eq!(classify_response(400, &h, invalid).class, FailureClass::Request);
        let bad_key = br#"{"error":{"code":400,"message":"API key not valid. Please pass a valid API key.","status":"INVALID_ARGUMENT","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID","domain":"googleapis.com"}]}}"#;
        assert_eq!(
            classify_response(400, &h, bad_key).class,
            FailureClass::KeyUnusable
        );
        let denied = br#"{"error":{"code":403,"message":"Method doesn't allow unregistered callers","status":"PERMISSION_DENIED"}}"#;
        assert_eq!(
            classify_response(403, &h, denied).class,
            FailureClass::KeyUnusable
        );
        let unavailable = br#"{"error":{"code":503,"message":"The model is overloaded. Please try again later.","status":"UNAVAILABLE"}}"#;
        assert_eq!(
            classify_response(503, &h, unavailable).class,
            FailureClass::Overload
        );
        let azure = br#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 have exceeded token rate limit of your current OpenAI S0 pricing tier. Please retry after 6 seconds."}}"#;
        let h = headers(&[("retry-after", "6"), ("retry-after-ms", "5500")]);
        let f = classify_response(429, &h, azure);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Capacity, ReasonCode::RateLimited)
        );
        assert_eq!(f.retry_after, Some(Duration::from_millis(5500)));
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            base: Duration::from_millis(500),
            max: Duration::from_secs(8),
            rate_limit_pause: Duration::from_secs(1),
            rejected_key_pause: Duration::from_secs(600),
        }
    }

    #[test]
    fn backoff_grows_is_capped_and_respects_retry_after() {
        let p = policy();
        let ms = Duration::from_millis;
        assert_eq!((p.delay(1, None, 0.0), p.delay(1, None, 1.0)), (ms(375), ms(500)));
        assert_eq!(
            (p.delay(10, None, 0.0), p.delay(10, None, 1.0)),
            (ms(6000), ms(8000))
        );
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(20)), 1.0),
            Duration::from_secs(20)
        );
        // A hint shorter than the backoff does not shorten it.
        assert_eq!(p.delay(3, Some(ms(100)), 1.0), ms(2000));
        assert_eq!(spread(Duration::from_secs(1), 1.0), ms(1100));
        assert_eq!(spread(Duration::from_secs(20), 1.0), ms(20_250));
        assert_eq!(spread(Duration::from_secs(20), 0.0), Duration::from_secs(20));
    }

    fn target(label: &str) -> Target {
        let (provider, model) = label.split_once('/').unwrap();
        Target {
            provider: provider.to_owned(),
            kind: crate::config::ProviderKind::Openai,
            model: model.to_owned(),
            key: None,
        }
    }

    /// How far the deadline is from the failure.
    #[derive(Debug, Clone, Copy)]
    enum Deadline {
        /// An hour away: any backoff fits.
        Far,
        /// 100 ms away: a backoff lands late, "at once" still fits.
        Near,
        /// Already passed.
        Passed,
    }

    /// What the table expects: the job's next step, the pause written (reason, scope,
    /// length in ms) and whether the target is left.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Expect {
        Fail(ReasonCode),
        /// Retry after this many ms.
        Retry(u64),
        FallBack,
        RotateKey,
    }

    struct Row {
        class: FailureClass,
        key: bool,
        /// The attempt that failed (of 3 per target).
        attempt: i32,
        failed_before: &'static [&'static str],
        deadline: Deadline,
        /// The job's route: `oai/a` (where the call went) and maybe others.
        route: &'static [&'static str],
        retry_after_ms: Option<u64>,
        next: Expect,
        pause: Option<(&'static str, &'static str, u64)>,
        leaves: bool,
    }

    const ALONE: &[&str] = &["oai/a"];
    const TWO: &[&str] = &["oai/a", "ant/b"];
    const THREE: &[&str] = &["oai/a", "ant/b", "gem/c"];
    const TARGET: &str = "provider:oai:a";
    const KEY: &str = "key:oai:k1";

    fn code(class: FailureClass) -> ReasonCode {
        match class {
            FailureClass::Capacity => ReasonCode::RateLimited,
            FailureClass::Overload => ReasonCode::ProviderOverloaded,
            FailureClass::KeyUnusable => ReasonCode::UpstreamAuthFailed,
            FailureClass::SpendCap => ReasonCode::SpendLimitReached,
            FailureClass::Request => ReasonCode::ProviderRejectedRequest,
            FailureClass::Network => ReasonCode::NetworkError,
            FailureClass::Timeout => ReasonCode::ProviderTimeout,
        }
    }

    #[test]
    fn every_row_of_the_retry_decision() {
        use Deadline::*;
        use Expect::*;
        use FailureClass::*;
        #[rustfmt::skip]
        let rows = [
            // A 429 retries on the same target after the backoff or Retry-After, whatever
            // the route, and always pauses the target (Retry-After or 1 s, spread).
            Row { class: Capacity, key: true, attempt: 1, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: None, next: Retry(500), pause: Some(("rate_limited", TARGET, 1100)), leaves: false },
            Row { class: Capacity, key: true, attempt: 1, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: Some(20_000), next: Retry(20_000), pause: Some(("rate_limited", TARGET, 20_250)), leaves: false },
            Row { class: Capacity, key: false, attempt: 2, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: None, next: Retry(1000), pause: Some(("rate_limited", TARGET, 1100)), leaves: false },
            Row { class: Capacity, key: true, attempt: 2, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: Some(200), next: Retry(1000), pause: Some(("rate_limited", TARGET, 220)), leaves: false },
            Row { class: Capacity, key: true, attempt: 1, failed_before: &[], deadline: Near, route: ALONE, retry_after_ms: None, next: Fail(ReasonCode::DeadlineExceeded), pause: Some(("rate_limited", TARGET, 1100)), leaves: false },
            Row { class: Capacity, key: true, attempt: 1, failed_before: &[], deadline: Near, route: TWO, retry_after_ms: Some(20_000), next: Fail(ReasonCode::DeadlineExceeded), pause: Some(("rate_limited", TARGET, 20_250)), leaves: false },
            Row { class: Capacity, key: true, attempt: 3, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: None, next: Fail(ReasonCode::AttemptsExhausted), pause: Some(("rate_limited", TARGET, 1100)), leaves: false },
            Row { class: Capacity, key: true, attempt: 3, failed_before: &[], deadline: Near, route: TWO, retry_after_ms: Some(20_000), next: Fail(ReasonCode::AttemptsExhausted), pause: Some(("rate_limited", TARGET, 20_250)), leaves: false },
            // Overload, network errors and timeouts fall back at once while the route has a
            // target the job has not failed on, each target with its own 3 attempts…
            Row { class: Overload, key: true, attempt: 1, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: None, next: FallBack, pause: None, leaves: true },
            Row { class: Overload, key: true, attempt: 1, failed_before: &[], deadline: Near, route: TWO, retry_after_ms: Some(20_000), next: FallBack, pause: None, leaves: true },
            Row { class: Overload, key: true, attempt: 3, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: None, next: FallBack, pause: None, leaves: true },
            Row { class: Overload, key: true, attempt: 6, failed_before: &["ant/b"], deadline: Far, route: THREE, retry_after_ms: None, next: FallBack, pause: None, leaves: true },
            Row { class: Overload, key: true, attempt: 9, failed_before: &["ant/b"], deadline: Far, route: THREE, retry_after_ms: None, next: Fail(ReasonCode::AttemptsExhausted), pause: None, leaves: true },
            Row { class: Overload, key: true, attempt: 1, failed_before: &[], deadline: Passed, route: TWO, retry_after_ms: None, next: Fail(ReasonCode::DeadlineExceeded), pause: None, leaves: true },
            // …otherwise they back off on the same target (Retry-After a lower bound).
            Row { class: Overload, key: true, attempt: 1, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: None, next: Retry(500), pause: None, leaves: false },
            Row { class: Overload, key: true, attempt: 1, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: Some(5000), next: Retry(5000), pause: None, leaves: false },
            Row { class: Overload, key: true, attempt: 4, failed_before: &["ant/b"], deadline: Far, route: TWO, retry_after_ms: None, next: Retry(4000), pause: None, leaves: false },
            Row { class: Overload, key: true, attempt: 6, failed_before: &["ant/b"], deadline: Far, route: TWO, retry_after_ms: None, next: Fail(ReasonCode::AttemptsExhausted), pause: None, leaves: false },
            Row { class: Overload, key: true, attempt: 1, failed_before: &[], deadline: Near, route: ALONE, retry_after_ms: None, next: Fail(ReasonCode::DeadlineExceeded), pause: None, leaves: false },
            Row { class: Overload, key: true, attempt: 3, failed_before: &[], deadline: Near, route: ALONE, retry_after_ms: Some(5000), next: Fail(ReasonCode::AttemptsExhausted), pause: None, leaves: false },
            Row { class: Network, key: false, attempt: 1, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: None, next: FallBack, pause: None, leaves: true },
            Row { class: Network, key: false, attempt: 1, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: None, next: Retry(500), pause: None, leaves: false },
            Row { class: Network, key: false, attempt: 1, failed_before: &[], deadline: Near, route: ALONE, retry_after_ms: None, next: Fail(ReasonCode::DeadlineExceeded), pause: None, leaves: false },
            Row { class: Network, key: false, attempt: 3, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: Some(5000), next: Fail(ReasonCode::AttemptsExhausted), pause: None, leaves: false },
            Row { class: Timeout, key: true, attempt: 2, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: Some(5000), next: FallBack, pause: None, leaves: true },
            Row { class: Timeout, key: true, attempt: 2, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: None, next: Retry(1000), pause: None, leaves: false },
            Row { class: Timeout, key: true, attempt: 1, failed_before: &[], deadline: Near, route: ALONE, retry_after_ms: None, next: Fail(ReasonCode::DeadlineExceeded), pause: None, leaves: false },
            Row { class: Timeout, key: true, attempt: 3, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: None, next: Fail(ReasonCode::AttemptsExhausted), pause: None, leaves: false },
            // A rejected key goes back at once for another key, never to another target,
            // and the key is paused for everyone (rejected_key_pause) whatever follows.
            Row { class: KeyUnusable, key: true, attempt: 1, failed_before: &[], deadline: Far, route: ALONE, retry_after_ms: None, next: RotateKey, pause: Some(("key_unusable", KEY, 600_000)), leaves: false },
            Row { class: KeyUnusable, key: true, attempt: 1, failed_before: &[], deadline: Near, route: TWO, retry_after_ms: Some(20_000), next: RotateKey, pause: Some(("key_unusable", KEY, 600_000)), leaves: false },
            Row { class: KeyUnusable, key: true, attempt: 1, failed_before: &[], deadline: Passed, route: ALONE, retry_after_ms: None, next: Fail(ReasonCode::DeadlineExceeded), pause: Some(("key_unusable", KEY, 600_000)), leaves: false },
            Row { class: KeyUnusable, key: true, attempt: 3, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: None, next: Fail(ReasonCode::AttemptsExhausted), pause: Some(("key_unusable", KEY, 600_000)), leaves: false },
            // Without a key to rotate it is final, like every class that is not retried.
            Row { class: KeyUnusable, key: false, attempt: 1, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: None, next: Fail(ReasonCode::UpstreamAuthFailed), pause: None, leaves: false },
            Row { class: SpendCap, key: true, attempt: 1, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: Some(20_000), next: Fail(ReasonCode::SpendLimitReached), pause: None, leaves: false },
            Row { class: SpendCap, key: true, attempt: 3, failed_before: &[], deadline: Near, route: ALONE, retry_after_ms: None, next: Fail(ReasonCode::SpendLimitReached), pause: None, leaves: false },
            Row { class: Request, key: true, attempt: 1, failed_before: &[], deadline: Far, route: TWO, retry_after_ms: None, next: Fail(ReasonCode::ProviderRejectedRequest), pause: None, leaves: false },
            Row { class: Request, key: false, attempt: 3, failed_before: &[], deadline: Passed, route: ALONE, retry_after_ms: Some(5000), next: Fail(ReasonCode::ProviderRejectedRequest), pause: None, leaves: false },
        ];
        let now = DateTime::parse_from_rfc3339("2025-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        for (i, row) in rows.iter().enumerate() {
            let failure = Failure {
                class: row.class,
                code: code(row.class),
                message: "boom".to_owned(),
                status: None,
                retry_after: row.retry_after_ms.map(Duration::from_millis),
            };
            let failed_targets: Vec<String> = row.failed_before.iter().map(|t| (*t).to_owned()).collect();
            let route: Vec<Target> = row.route.iter().map(|t| target(t)).collect();
            let deadline = match row.deadline {
                Far => now + chrono::Duration::hours(1),
                Near => now + chrono::Duration::milliseconds(100),
                Passed => now - chrono::Duration::milliseconds(1),
            };
            let failed = FailedCall {
                failure: &failure,
                provider: "oai",
                model: "a",
                key: row.key.then_some("k1"),
                scope: "provider:oai:a",
                attempt: row.attempt,
                max_attempts: 3,
                deadline,
                failed_targets: &failed_targets,
                route: &route,
            };
            let decision = decide(&failed, &policy(), now, || 1.0);
            let next = match &decision.next {
                Next::Fail { code, .. } => Fail(*code),
                Next::Retry { at, delay } => {
                    assert_eq!(*at, now + *delay, "row {i}");
                    Retry(delay.as_millis() as u64)
                }
                Next::FallBack => FallBack,
                Next::RotateKey => RotateKey,
            };
            assert_eq!(next, row.next, "row {i}: {:?}", decision.next);
            let pause = decision.pause.as_ref().map(|p| {
                let ms = (p.until - now).num_milliseconds() as u64;
                (p.reason, p.scope.as_str(), ms)
            });
            assert_eq!(pause, row.pause, "row {i}");
            let left = decision.leave_target.as_deref();
            assert_eq!(left, row.leaves.then_some("oai/a"), "row {i}");
        }
    }

    #[test]
    fn failed_jobs_keep_the_last_error_in_their_message() {
        let now = Utc::now();
        let failure = Failure {
            class: FailureClass::Overload,
            code: ReasonCode::ProviderOverloaded,
            message: "Overloaded".to_owned(),
            status: Some(529),
            retry_after: None,
        };
        let route = [target("oai/a")];
        let mut failed = FailedCall {
            failure: &failure,
            provider: "oai",
            model: "a",
            key: None,
            scope: "provider:oai:a",
            attempt: 3,
            max_attempts: 3,
            deadline: now + chrono::Duration::hours(1),
            failed_targets: &[],
            route: &route,
        };
        let message = |f: &FailedCall<'_>| match decide(f, &policy(), now, || 1.0).next {
            Next::Fail { message, .. } => message,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            message(&failed),
            "3 attempts made; last error provider_overloaded: Overloaded"
        );
        failed.attempt = 2;
        failed.deadline = now + chrono::Duration::milliseconds(10);
        assert_eq!(
            message(&failed),
            "the next attempt (in 1.0 s) would start after the deadline; last error provider_overloaded: Overloaded"
        );
    }

    /// A provider's 429, with its Retry-After.
    fn rate_limited(retry_after: Option<Duration>) -> Failure {
        Failure {
            class: FailureClass::Capacity,
            code: ReasonCode::RateLimited,
            message: String::new(),
            status: Some(429),
            retry_after,
        }
    }

    #[test]
    fn a_429_on_a_key_s_pool_pauses_the_pool_and_requeues_the_job_at_once() {
        let now = Utc::now();
        let failure = rate_limited(Some(Duration::from_secs(60)));
        let route = [target("oai/a")];
        let mut failed = FailedCall {
            failure: &failure,
            provider: "oai",
            model: "a",
            key: Some("k1"),
            scope: "pool:oai:org-1:a",
            attempt: 1,
            max_attempts: 3,
            deadline: now + chrono::Duration::hours(1),
            failed_targets: &[],
            route: &route,
        };
        let decision = decide(&failed, &policy(), now, || 0.5);
        assert_eq!(
            decision.pause.map(|p| p.scope),
            Some("pool:oai:org-1:a".to_owned())
        );
        assert_eq!(
            decision.next,
            Next::Retry {
                at: now,
                delay: Duration::ZERO
            }
        );
        // One pool for the model: the pause is the model's, and the job waits it out.
        failed.scope = "provider:oai:a";
        let decision = decide(&failed, &policy(), now, || 0.5);
        assert_eq!(decision.pause.map(|p| p.scope), Some("provider:oai:a".to_owned()));
        assert!(matches!(decision.next, Next::Retry { delay, .. } if delay >= Duration::from_secs(60)));
    }

    #[test]
    fn the_jitter_source_sets_backoff_and_pause_spread() {
        let now = Utc::now();
        let failure = rate_limited(None);
        let route = [target("oai/a")];
        let failed = FailedCall {
            failure: &failure,
            provider: "oai",
            model: "a",
            key: Some("k1"),
            scope: "provider:oai:a",
            attempt: 1,
            max_attempts: 3,
            deadline: now + chrono::Duration::hours(1),
            failed_targets: &[],
            route: &route,
        };
        // The backoff draws first, then the pause.
        let mut draws = [0.0, 0.5].into_iter();
        let d = decide(&failed, &policy(), now, || draws.next().unwrap());
        assert_eq!(
            d.next,
            Next::Retry {
                at: now + Duration::from_millis(375),
                delay: Duration::from_millis(375)
            }
        );
        assert_eq!(d.pause.unwrap().until, now + Duration::from_millis(1050));
    }
}
