//! Failure classification and retry policy: every provider failure is classified once,
//! here, into a [`FailureClass`] with a stable reason code; the dispatcher only matches on
//! the class. Retries are the broker's decision alone (adapters never retry).

use std::time::Duration;

use chrono::{DateTime, Utc};
use http::HeaderMap;
use rand::Rng;

use crate::config::RetryConfig;

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
/// by `error.code` / `error.type` and the message (PROVIDERS.md §1.2, §2.2).
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
    let message = if message.is_empty() {
        String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned()
    } else {
        message
    };
    let retry_after = retry_after(headers).or_else(|| try_again_in(&message));
    let (class, code) = match status {
        429 if spend_cap => (FailureClass::SpendCap, "spend_limit_reached"),
        429 if err_code == "insufficient_quota" || err_type == "insufficient_quota" => {
            (FailureClass::KeyUnusable, "insufficient_quota")
        }
        429 if message.starts_with("Request too large") => (FailureClass::Request, "request_too_large"),
        429 => (FailureClass::Capacity, "rate_limited"),
        401 | 403 => (FailureClass::KeyUnusable, "upstream_auth_failed"),
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

/// `retry-after-ms` (float ms), then `retry-after` as seconds or as an HTTP date.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = text("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = text("retry-after")?;
    if let Ok(secs) = value.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let date = DateTime::parse_from_rfc2822(value).ok()?;
    (date.with_timezone(&Utc) - Utc::now()).to_std().ok()
}

/// The "Please try again in 644ms." hint in OpenAI-style messages.
pub fn try_again_in(message: &str) -> Option<Duration> {
    let rest = message.split("try again in ").nth(1)?;
    let token = rest.split_whitespace().next()?.trim_end_matches('.');
    parse_go_duration(token)
}

/// Go-style durations as OpenAI and Groq send them: `1s`, `6m0s`, `2m59.56s`, `12ms`, `1h2m3s`.
pub fn parse_go_duration(text: &str) -> Option<Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0f64;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if number_len == 0 {
            return None;
        }
        let value: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            "us" | "µs" => 0.000_001,
            "ns" => 0.000_000_001,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    total.is_finite().then(|| Duration::from_secs_f64(total))
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
    fn go_durations() {
        let ms = |t: &str| parse_go_duration(t).map(|d| d.as_millis());
        assert_eq!(ms("1s"), Some(1000));
        assert_eq!(ms("6m0s"), Some(360_000));
        assert_eq!(ms("12ms"), Some(12));
        assert_eq!(ms("2m59.56s"), Some(179_560));
        assert_eq!(ms("0.5s"), Some(500));
        assert_eq!(ms("1h2m3s"), Some(3_723_000));
        assert_eq!(ms(""), None);
        assert_eq!(ms("5x"), None);
        assert_eq!(ms("s"), None);
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(
            retry_after(&headers(&[("retry-after", "20")])),
            Some(Duration::from_secs(20))
        );
        assert_eq!(
            retry_after(&headers(&[("retry-after-ms", "1500"), ("retry-after", "9")])),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(retry_after(&headers(&[("retry-after", "-3")])), None);
        assert_eq!(retry_after(&headers(&[("retry-after", "soon")])), None);
        let date = (Utc::now() + chrono::Duration::seconds(60)).to_rfc2822();
        let d = retry_after(&headers(&[("retry-after", &date)])).unwrap();
        assert!(
            d <= Duration::from_secs(60) && d >= Duration::from_secs(55),
            "{d:?}"
        );
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
