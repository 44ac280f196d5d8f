//! Failure classification and retry policy: every provider failure is classified once,
//! here, into a [`FailureClass`] with a stable reason code; the dispatcher only matches on
//! the class. Retries are the broker's decision alone (adapters never retry).

use std::time::Duration;

use chrono::Utc;
use http::HeaderMap;
use rand::Rng;

use crate::config::RetryConfig;
use crate::ratelimit::{self, Dialect};

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
    pub code: &'static str,
    pub message: String,
    pub status: Option<u16>,
    /// The provider's own hint of when to come back.
    pub retry_after: Option<Duration>,
}

impl Failure {
    pub fn network(message: impl Into<String>) -> Self {
        Self {
            class: FailureClass::Network,
            code: "network_error",
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
            code: "provider_bad_response",
            message: message.into(),
            status: Some(status),
            retry_after: None,
        }
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self {
            class: FailureClass::Timeout,
            code: "provider_timeout",
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
    let message = if message.is_empty() {
        String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned()
    } else {
        message
    };
    // Retry-After headers, Gemini's `RetryInfo`, OpenAI's "try again in".
    let retry_after = ratelimit::read(Dialect::None, headers, body, Utc::now()).retry_after;
    let (class, code) = match status {
        429 if spend_cap => (FailureClass::SpendCap, "spend_limit_reached"),
        429 if err_code == "insufficient_quota" || err_type == "insufficient_quota" => {
            (FailureClass::KeyUnusable, "insufficient_quota")
        }
        429 if message.starts_with("Request too large") => (FailureClass::Request, "request_too_large"),
        429 => (FailureClass::Capacity, "rate_limited"),
        401 | 403 => (FailureClass::KeyUnusable, "upstream_auth_failed"),
        400 if key_invalid => (FailureClass::KeyUnusable, "upstream_auth_failed"),
        402 => (FailureClass::KeyUnusable, "insufficient_quota"),
        408 => (FailureClass::Timeout, "provider_timeout"),
        413 => (FailureClass::Request, "request_too_large"),
        400 | 404 | 409 | 422 => (FailureClass::Request, "provider_rejected_request"),
        529 | 503 => (FailureClass::Overload, "provider_overloaded"),
        s if s >= 500 => (FailureClass::Overload, "provider_error"),
        _ => (FailureClass::Request, "provider_rejected_request"),
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
    pub max_attempts: u32,
    pub base: Duration,
    pub max: Duration,
}

impl From<&RetryConfig> for RetryPolicy {
    fn from(c: &RetryConfig) -> Self {
        Self {
            max_attempts: c.max_attempts,
            base: Duration::from_millis(c.base_delay_ms),
            max: Duration::from_millis(c.max_delay_ms),
        }
    }
}

impl RetryPolicy {
    /// Delay before the next attempt after `attempts_done` attempts: base·2^(n-1), capped,
    /// times a jitter factor in [0.75, 1]; never less than `retry_after`.
    pub fn delay(&self, attempts_done: u32, retry_after: Option<Duration>) -> Duration {
        let exp = attempts_done.saturating_sub(1).min(20);
        let backoff = self.base.saturating_mul(1u32 << exp).min(self.max);
        let jitter = rand::rng().random_range(0.75..=1.0);
        let backoff = backoff.mul_f64(jitter);
        match retry_after {
            Some(hint) => hint.max(backoff),
            None => backoff,
        }
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
        assert_eq!((f.class, f.code), (FailureClass::Capacity, "rate_limited"));
        assert_eq!(f.retry_after, Some(Duration::from_secs(20)));
        let too_large = br#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 31538.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
        assert_eq!(classify_response(429, &h, too_large).class, FailureClass::Request);
        let quota = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
        assert_eq!(classify_response(429, &h, quota).class, FailureClass::KeyUnusable);
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
        assert_eq!(classify_response(502, &h, b"<html>").code, "provider_error");
    }

    #[test]
    fn classifies_gemini_and_azure() {
        let h = HeaderMap::new();
        let per_day = br#"{"error":{"code":429,"message":"You exceeded your current quota. Please retry in 36.4s.","status":"RESOURCE_EXHAUSTED","details":[
            {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier","quotaValue":"20"}]},
            {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"36s"}]}}"#;
        let f = classify_response(429, &h, per_day);
        assert_eq!((f.class, f.code), (FailureClass::Capacity, "rate_limited"));
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
        assert_eq!((f.class, f.code), (FailureClass::Capacity, "rate_limited"));
        assert_eq!(f.retry_after, Some(Duration::from_millis(5500)));
    }

    #[test]
    fn backoff_grows_is_capped_and_respects_retry_after() {
        let p = RetryPolicy {
            max_attempts: 5,
            base: Duration::from_millis(500),
            max: Duration::from_secs(8),
        };
        let first = p.delay(1, None);
        assert!(first >= Duration::from_millis(375) && first <= Duration::from_millis(500));
        let late = p.delay(10, None);
        assert!(late >= Duration::from_secs(6) && late <= Duration::from_secs(8));
        let hinted = p.delay(1, Some(Duration::from_secs(20)));
        assert!(hinted >= Duration::from_secs(20));
    }
}
