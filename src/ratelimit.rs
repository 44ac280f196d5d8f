//! What providers say about their limits: one parser for every rate-limit signal.
//!
//! - Headers, per [`Dialect`]: OpenAI and Groq `x-ratelimit-*` (Go-style relative resets;
//!   Groq's request limit is per day), Anthropic `anthropic-ratelimit-*` (RFC 3339 absolute
//!   resets; input and output tokens apart), Mistral `x-ratelimit-*-req-minute` /
//!   `-tokens-minute`, Together (`x-ratelimit-*` and `x-tokenlimit-*`, per second), Azure
//!   OpenAI (remaining values, limits when sent).
//! - Bodies of 429s: Gemini's `QuotaFailure` (the quota's value, per minute or per day) and
//!   `RetryInfo.retryDelay`; OpenAI-style messages that name the limit
//!   (`... (TPM): Limit 30000, Used ...`) and say when to come back (`try again in 644ms`).
//! - Which limit a 429 met, where its body says so though it says nothing else: OpenAI's
//!   `error.type` (`requests`, `tokens`).
//! - When to come back: `retry-after-ms`, `retry-after` as seconds or an HTTP date.
//! - Which account (quota pool) served the call: `openai-organization`,
//!   `anthropic-organization-id`.
//!
//! The result, [`Signals`], names limits as tollgate's buckets do ([`LimitName`]); the gate
//! turns readings into learned bucket capacities and levels (`store::learned`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use http::HeaderMap;

use crate::vocab::{Dialect, Dimension, LimitName};

/// The smallest token limit per window a reading may report: below every tier any
/// provider sells (the lowest are tens of thousands a minute). A smaller one is a bogus
/// header, and taking it would fail every job to that model `exceeds_limit`.
pub const MIN_TOKEN_LIMIT: f64 = 1_000.0;
/// The largest limit or remaining count a reading may report (requests or tokens per
/// window); beyond it, a value is nonsense and arithmetic on it would overflow.
pub const MAX_LIMIT: f64 = 1e12;

/// Whether `limit` is a capacity some provider could really have for `name`.
pub fn plausible(name: LimitName, limit: f64) -> bool {
    let least = if name.dimension() == Dimension::Requests {
        1.0
    } else {
        MIN_TOKEN_LIMIT
    };
    limit.is_finite() && (least..=MAX_LIMIT).contains(&limit)
}

/// One limit as a response reported it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    pub name: LimitName,
    /// The limit's capacity per window.
    pub limit: Option<f64>,
    /// What is left of it now.
    pub remaining: Option<f64>,
    /// Until it is full again.
    pub reset: Option<Duration>,
}

/// Everything one response said about limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Signals {
    pub readings: Vec<Reading>,
    /// When to come back (429s, some 503s).
    pub retry_after: Option<Duration>,
    /// The limit a 429's body says was met (OpenAI's `error.type`: `requests` is the
    /// request limit, `tokens` the token limit), even when it names no value.
    pub bound: Option<LimitName>,
    /// The provider account the response was served under (OpenAI's
    /// `openai-organization`, Anthropic's `anthropic-organization-id`): keys of one
    /// account share its limits, a quota pool.
    pub account: Option<String>,
}

impl Signals {
    /// Whether the response said anything about capacities.
    pub fn has_limits(&self) -> bool {
        self.readings.iter().any(|r| r.limit.is_some())
    }
}

/// A reading with what is implausible in it dropped: a limit outside [`plausible`] takes
/// its `remaining` with it (one bogus header says nothing reliable); a `remaining` is kept
/// within 0 and [`MAX_LIMIT`] (and never above the limit). `None` if nothing is left.
fn sane(reading: Reading) -> Option<Reading> {
    let Reading {
        name,
        limit,
        remaining,
        reset,
    } = reading;
    // Azure sends `-1` for a limit it does not state: no limit, not a bogus one.
    let limit = limit.filter(|l| *l > 0.0);
    if let Some(limit) = limit
        && !plausible(name, limit)
    {
        tracing::warn!(limit = %name.as_str(), value = limit, "ignored an implausible rate-limit reading");
        return None;
    }
    let remaining = remaining
        .filter(|r| r.is_finite())
        .map(|r| r.clamp(0.0, limit.unwrap_or(MAX_LIMIT)));
    (limit.is_some() || remaining.is_some()).then_some(Reading {
        name,
        limit,
        remaining,
        reset,
    })
}

/// Reads every signal of one response.
pub fn read(dialect: Dialect, headers: &HeaderMap, body: &[u8], now: DateTime<Utc>) -> Signals {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    let number = |name: &str| {
        text(name)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
    };
    let mut readings = Vec::new();
    let mut add = |name, limit: Option<f64>, remaining: Option<f64>, reset: Option<Duration>| {
        if let Some(r) = sane(Reading {
            name,
            limit,
            remaining,
            reset,
        }) {
            readings.push(r);
        }
    };
    let go = |name: &str| text(name).and_then(parse_go_duration);
    match dialect {
        Dialect::Openai | Dialect::Groq | Dialect::Azure => {
            let requests = if dialect == Dialect::Groq {
                LimitName::Rpd
            } else {
                LimitName::Rpm
            };
            for (name, suffix) in [(requests, "requests"), (LimitName::Tpm, "tokens")] {
                add(
                    name,
                    number(&format!("x-ratelimit-limit-{suffix}")),
                    number(&format!("x-ratelimit-remaining-{suffix}")),
                    go(&format!("x-ratelimit-reset-{suffix}")),
                );
            }
        }
        Dialect::Anthropic => {
            let at = |name: &str| {
                let reset = DateTime::parse_from_rfc3339(text(name)?).ok()?;
                bounded((reset.with_timezone(&Utc) - now).to_std().unwrap_or_default())
            };
            for (name, part) in [
                (LimitName::Rpm, "requests"),
                (LimitName::Itpm, "input-tokens"),
                (LimitName::Otpm, "output-tokens"),
                (LimitName::Tpm, "tokens"),
            ] {
                add(
                    name,
                    number(&format!("anthropic-ratelimit-{part}-limit")),
                    number(&format!("anthropic-ratelimit-{part}-remaining")),
                    at(&format!("anthropic-ratelimit-{part}-reset")),
                );
            }
        }
        Dialect::Mistral => {
            for (name, part) in [(LimitName::Rpm, "req"), (LimitName::Tpm, "tokens")] {
                add(
                    name,
                    number(&format!("x-ratelimit-limit-{part}-minute")),
                    number(&format!("x-ratelimit-remaining-{part}-minute")),
                    None,
                );
            }
        }
        Dialect::Together => {
            let per_minute = |v: Option<f64>| v.map(|v| v * 60.0);
            let reset = number("x-ratelimit-reset").and_then(|s| seconds(s.max(0.0)));
            add(
                LimitName::Rpm,
                per_minute(number("x-ratelimit-limit")),
                per_minute(number("x-ratelimit-remaining")),
                reset,
            );
            add(
                LimitName::Tpm,
                per_minute(number("x-tokenlimit-limit")),
                per_minute(number("x-tokenlimit-remaining")),
                None,
            );
        }
        Dialect::Gemini | Dialect::None => {}
    }
    let parsed: Option<serde_json::Value> = if body.is_empty() {
        None
    } else {
        serde_json::from_slice(body).ok()
    };
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    if let Some(error) = error {
        readings.extend(quota_failures(error).into_iter().filter_map(sane));
        let message = error.get("message").and_then(|m| m.as_str()).unwrap_or_default();
        if let Some(r) = limit_in_message(message).and_then(sane)
            && !readings.iter().any(|x| x.name == r.name && x.limit.is_some())
        {
            readings.push(r);
        }
    }
    let retry_after = retry_after(headers, now)
        .or_else(|| error.and_then(retry_delay))
        .or_else(|| {
            let message = error?.get("message")?.as_str()?;
            try_again_in(message)
        });
    Signals {
        readings,
        retry_after,
        bound: error.and_then(bound_limit),
        account: account(headers),
    }
}

/// The limit an OpenAI-style error body says was met: its `type` is `requests` or `tokens`
/// on a 429 (`rate_limit_exceeded`), whatever else its message says.
fn bound_limit(error: &serde_json::Value) -> Option<LimitName> {
    match error.get("type")?.as_str()? {
        "requests" => Some(LimitName::Rpm),
        "tokens" => Some(LimitName::Tpm),
        _ => None,
    }
}

/// The longest account id kept: real ones are tens of characters.
const MAX_ACCOUNT_LEN: usize = 128;

/// The account a response names, if it names one plausibly (printable, not too long).
fn account(headers: &HeaderMap) -> Option<String> {
    ["openai-organization", "anthropic-organization-id"]
        .iter()
        .filter_map(|name| headers.get(*name)?.to_str().ok())
        .map(str::trim)
        .find(|v| !v.is_empty() && v.len() <= MAX_ACCOUNT_LEN && v.chars().all(|c| c.is_ascii_graphic()))
        .map(str::to_owned)
}

/// `retry-after-ms` (float ms), then `retry-after` as seconds or as an HTTP date.
pub fn retry_after(headers: &HeaderMap, now: DateTime<Utc>) -> Option<Duration> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = text("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && let Some(after) = seconds(ms / 1000.0)
    {
        return Some(after);
    }
    let value = text("retry-after")?;
    if let Ok(secs) = value.parse::<f64>() {
        return seconds(secs);
    }
    let date = DateTime::parse_from_rfc2822(value).ok()?;
    bounded((date.with_timezone(&Utc) - now).to_std().ok()?)
}

/// The "Please try again in 644ms." hint in OpenAI-style messages.
pub fn try_again_in(message: &str) -> Option<Duration> {
    let rest = message.split("try again in ").nth(1)?;
    let token = rest.split_whitespace().next()?.trim_end_matches('.');
    parse_go_duration(token)
}

/// The limit an OpenAI-style 429 message names: `... on tokens per min (TPM): Limit 30000,
/// Used 29937, Requested 385.` (also Groq's, which adds `RPD`).
fn limit_in_message(message: &str) -> Option<Reading> {
    let (before, after) = message.split_once("): Limit ")?;
    let abbr = before.rsplit('(').next()?;
    let name = match abbr {
        "RPM" => LimitName::Rpm,
        "RPD" => LimitName::Rpd,
        "TPM" => LimitName::Tpm,
        _ => return None,
    };
    let digits: String = after
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == ',')
        .filter(char::is_ascii_digit)
        .collect();
    let limit: f64 = digits.parse().ok()?;
    (limit > 0.0).then_some(Reading {
        name,
        limit: Some(limit),
        remaining: Some(0.0),
        reset: None,
    })
}

/// Gemini's `google.rpc.QuotaFailure` violations: the quota's value, per minute or per day,
/// of requests or tokens. A violated quota has nothing left.
fn quota_failures(error: &serde_json::Value) -> Vec<Reading> {
    let Some(details) = error.get("details").and_then(|d| d.as_array()) else {
        return Vec::new();
    };
    details
        .iter()
        .filter(|d| {
            d.get("@type")
                .and_then(|t| t.as_str())
                .is_some_and(|t| t.ends_with("QuotaFailure"))
        })
        .flat_map(|d| {
            d.get("violations")
                .and_then(|v| v.as_array())
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|v| {
            let id = v.get("quotaId").and_then(|i| i.as_str()).unwrap_or_default();
            let metric = v.get("quotaMetric").and_then(|m| m.as_str()).unwrap_or_default();
            let value = match v.get("quotaValue")? {
                serde_json::Value::String(s) => s.parse::<f64>().ok()?,
                other => other.as_f64()?,
            };
            let tokens = metric.contains("token") || id.contains("Token");
            let name = match (id.contains("PerDay"), tokens) {
                (false, false) => LimitName::Rpm,
                (true, false) => LimitName::Rpd,
                (false, true) => LimitName::Tpm,
                // No daily token bucket: nothing to learn.
                (true, true) => return None,
            };
            (value.is_finite() && value > 0.0).then_some(Reading {
                name,
                limit: Some(value),
                remaining: Some(0.0),
                reset: None,
            })
        })
        .collect()
}

/// Gemini's `google.rpc.RetryInfo.retryDelay` (a protobuf Duration: `"36s"`, `"0.5s"`).
fn retry_delay(error: &serde_json::Value) -> Option<Duration> {
    error.get("details")?.as_array()?.iter().find_map(|d| {
        let delay = d.get("retryDelay")?.as_str()?;
        seconds(delay.strip_suffix('s')?.parse().ok()?)
    })
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
    seconds(total)
}

/// Longest wait or reset a provider may announce (about 31 years); anything longer is
/// not a duration but garbage, and would overflow `Duration::from_secs_f64` or a
/// timestamp addition downstream.
const MAX_SECS: f64 = 1e9;

/// A duration from seconds a provider sent, if it is one (finite, not negative, not absurd).
fn seconds(secs: f64) -> Option<Duration> {
    (secs.is_finite() && (0.0..MAX_SECS).contains(&secs)).then(|| Duration::from_secs_f64(secs))
}

/// A duration computed from a date a provider sent, if it is not absurd.
fn bounded(d: Duration) -> Option<Duration> {
    (d.as_secs_f64() < MAX_SECS).then_some(d)
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

    fn reading(s: &Signals, name: LimitName) -> Reading {
        *s.readings.iter().find(|r| r.name == name).unwrap()
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
        assert_eq!(ms("99999999999h"), None);
    }

    #[test]
    fn retry_after_forms() {
        let now = Utc::now();
        let ra = |pairs: &[(&'static str, &str)]| retry_after(&headers(pairs), now);
        assert_eq!(ra(&[("retry-after", "20")]), Some(Duration::from_secs(20)));
        assert_eq!(
            ra(&[("retry-after-ms", "1500"), ("retry-after", "9")]),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(ra(&[("retry-after", "-3")]), None);
        assert_eq!(ra(&[("retry-after", "soon")]), None);
        assert_eq!(ra(&[("retry-after", "inf")]), None);
        let date = (now + chrono::Duration::seconds(60)).to_rfc2822();
        let d = ra(&[("retry-after", &date)]).unwrap();
        assert!(
            d <= Duration::from_secs(60) && d >= Duration::from_secs(59),
            "{d:?}"
        );
    }

    #[test]
    fn implausible_readings_are_ignored_and_remaining_is_bounded() {
        // A bogus token limit (and the remaining that came with it) teaches nothing.
        let bogus = headers(&[
            ("x-ratelimit-limit-tokens", "10"),
            ("x-ratelimit-remaining-tokens", "3"),
            ("x-ratelimit-limit-requests", "1e18"),
            ("x-ratelimit-remaining-requests", "5"),
        ]);
        let s = read(Dialect::Openai, &bogus, b"", Utc::now());
        assert!(s.readings.is_empty(), "{:?}", s.readings);
        // A remaining beyond its limit, or absurd on its own, is bounded.
        let high = headers(&[
            ("x-ratelimit-limit-tokens", "30000"),
            ("x-ratelimit-remaining-tokens", "9000000000000000000"),
            ("x-ratelimit-remaining-requests", "9000000000000000000"),
        ]);
        let s = read(Dialect::Openai, &high, b"", Utc::now());
        assert_eq!(reading(&s, LimitName::Tpm).remaining, Some(30_000.0));
        assert_eq!(reading(&s, LimitName::Rpm).remaining, Some(MAX_LIMIT));
        // A 429 body naming a tiny limit is as bogus as the header.
        let body = br#"{"error":{"message":"Rate limit reached for m in organization org-x on tokens per min (TPM): Limit 10, Used 9, Requested 5.","type":"tokens","code":"rate_limit_exceeded"}}"#;
        let s = read(Dialect::Openai, &HeaderMap::new(), body, Utc::now());
        assert!(s.readings.is_empty(), "{:?}", s.readings);
        assert!(plausible(LimitName::Rpm, 3.0) && plausible(LimitName::Tpm, 1_000.0));
    }

    #[test]
    fn openai_and_groq_headers() {
        let h = headers(&[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-tokens", "6m0s"),
            ("x-ratelimit-limit-tokens_usage_based", "1"),
        ]);
        let s = read(Dialect::Openai, &h, b"", Utc::now());
        assert_eq!(s.readings.len(), 2);
        let rpm = reading(&s, LimitName::Rpm);
        assert_eq!((rpm.limit, rpm.remaining), (Some(60.0), Some(59.0)));
        assert_eq!(rpm.reset, Some(Duration::from_secs(1)));
        let tpm = reading(&s, LimitName::Tpm);
        assert_eq!(
            (tpm.limit, tpm.reset),
            (Some(150_000.0), Some(Duration::from_secs(360)))
        );
        let groq = read(Dialect::Groq, &h, b"", Utc::now());
        assert_eq!(reading(&groq, LimitName::Rpd).limit, Some(60.0));
        assert!(groq.readings.iter().all(|r| r.name != LimitName::Rpm));
    }

    #[test]
    fn anthropic_headers_with_absolute_resets() {
        let now = Utc::now();
        let reset = (now + chrono::Duration::seconds(30)).to_rfc3339();
        let h = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", &reset),
            ("anthropic-ratelimit-input-tokens-limit", "30000"),
            ("anthropic-ratelimit-input-tokens-remaining", "28000"),
            ("anthropic-ratelimit-output-tokens-limit", "8000"),
            ("anthropic-ratelimit-output-tokens-remaining", "8000"),
        ]);
        let s = read(Dialect::Anthropic, &h, b"", now);
        let rpm = reading(&s, LimitName::Rpm);
        assert_eq!(rpm.limit, Some(50.0));
        let r = rpm.reset.unwrap();
        assert!(
            r <= Duration::from_secs(30) && r >= Duration::from_secs(29),
            "{r:?}"
        );
        assert_eq!(reading(&s, LimitName::Itpm).remaining, Some(28_000.0));
        assert_eq!(reading(&s, LimitName::Otpm).limit, Some(8000.0));
        // Headers of another dialect are not read.
        assert!(read(Dialect::Openai, &h, b"", now).readings.is_empty());
    }

    #[test]
    fn mistral_together_and_azure() {
        let m = headers(&[
            ("x-ratelimit-limit-req-minute", "120"),
            ("x-ratelimit-remaining-req-minute", "100"),
            ("x-ratelimit-limit-tokens-minute", "500000"),
            ("x-ratelimit-remaining-tokens-minute", "499000"),
        ]);
        let s = read(Dialect::Mistral, &m, b"", Utc::now());
        assert_eq!(reading(&s, LimitName::Rpm).limit, Some(120.0));
        assert_eq!(reading(&s, LimitName::Tpm).remaining, Some(499_000.0));
        let t = headers(&[
            ("x-ratelimit-limit", "10"),
            ("x-ratelimit-remaining", "4"),
            ("x-ratelimit-reset", "2"),
        ]);
        let s = read(Dialect::Together, &t, b"", Utc::now());
        let rpm = reading(&s, LimitName::Rpm);
        assert_eq!((rpm.limit, rpm.remaining), (Some(600.0), Some(240.0)));
        let a = headers(&[
            ("x-ratelimit-limit-requests", "-1"),
            ("x-ratelimit-remaining-requests", "99"),
            ("x-ratelimit-remaining-tokens", "1000"),
        ]);
        let s = read(Dialect::Azure, &a, b"", Utc::now());
        let rpm = reading(&s, LimitName::Rpm);
        assert_eq!((rpm.limit, rpm.remaining), (None, Some(99.0)));
        assert!(!s.has_limits());
    }

    #[test]
    fn gemini_quota_failure_and_retry_info() {
        let body = br#"{"error":{"code":429,"message":"You exceeded your current quota. Please retry in 36.4s.","status":"RESOURCE_EXHAUSTED","details":[
            {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[
              {"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier","quotaValue":"20"},
              {"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_input_token_count","quotaId":"GenerateContentInputTokensPerModelPerMinute-FreeTier","quotaValue":"250000"}]},
            {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"36s"}]}}"#;
        let s = read(Dialect::Gemini, &HeaderMap::new(), body, Utc::now());
        assert_eq!(s.retry_after, Some(Duration::from_secs(36)));
        let rpd = reading(&s, LimitName::Rpd);
        assert_eq!((rpd.limit, rpd.remaining), (Some(20.0), Some(0.0)));
        assert_eq!(reading(&s, LimitName::Tpm).limit, Some(250_000.0));
    }

    #[test]
    fn openai_429_message_names_the_limit() {
        let body = br#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30,000, Used 29937, Requested 385. Please try again in 644ms. Visit https://platform.openai.com/account/rate-limits to learn more.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
        let s = read(Dialect::None, &HeaderMap::new(), body, Utc::now());
        assert_eq!(reading(&s, LimitName::Tpm).limit, Some(30_000.0));
        assert_eq!(s.retry_after, Some(Duration::from_millis(644)));
        assert_eq!(s.bound, Some(LimitName::Tpm));
        let plain =
            br#"{"error":{"message":"Rate limit reached. Please retry later.","type":"rate_limit_error"}}"#;
        let s = read(Dialect::None, &HeaderMap::new(), plain, Utc::now());
        assert_eq!(s, Signals::default());
        // A 429 that says nothing else still says which limit it met.
        for (kind, bound) in [("tokens", LimitName::Tpm), ("requests", LimitName::Rpm)] {
            let body = format!(
                r#"{{"error":{{"message":"Rate limit reached. Please retry later.","type":"{kind}","param":null,"code":"rate_limit_exceeded"}}}}"#
            );
            let s = read(Dialect::None, &HeaderMap::new(), body.as_bytes(), Utc::now());
            assert_eq!(s.bound, Some(bound), "{kind}");
            assert!(s.readings.is_empty() && !s.has_limits(), "{s:?}");
        }
        // Garbage never panics and says nothing.
        let s = read(Dialect::Openai, &HeaderMap::new(), b"\xff\x00{", Utc::now());
        assert_eq!(s, Signals::default());
    }

    /// Found by the `ratelimit_headers` fuzzer: a `retry-after-ms` of 8.9e21 panicked in
    /// `Duration::from_secs_f64`. Absurd values of every kind are ignored, not trusted.
    #[test]
    fn absurd_values_are_ignored_and_never_panic() {
        let now = Utc::now();
        let headers = |pairs: &[(&'static str, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, v.parse().unwrap());
            }
            h
        };
        assert_eq!(
            retry_after(&headers(&[("retry-after-ms", "8888888888888888888888889")]), now),
            None
        );
        assert_eq!(retry_after(&headers(&[("retry-after", "1e300")]), now), None);
        assert_eq!(
            retry_after(&headers(&[("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT")]), now),
            None
        );
        let together = headers(&[("x-ratelimit-reset", "1e30"), ("x-tokenlimit-limit", "1e308")]);
        let s = read(Dialect::Together, &together, b"", now);
        assert!(
            s.readings
                .iter()
                .all(|r| r.reset.is_none() && r.limit.is_none_or(f64::is_finite)),
            "{s:?}"
        );
        let anthropic = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-reset", "9999-12-31T23:59:59Z"),
        ]);
        let s = read(Dialect::Anthropic, &anthropic, b"", now);
        assert_eq!((s.readings[0].limit, s.readings[0].reset), (Some(50.0), None));
        let gemini = br#"{"error":{"details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaId":"PerMinute","quotaValue":"inf"}]}]}}"#;
        assert!(
            read(Dialect::Gemini, &HeaderMap::new(), gemini, now)
                .readings
                .is_empty()
        );
    }

    #[test]
    fn a_response_names_the_account_its_key_serves_under() {
        let now = Utc::now();
        let openai = headers(&[("openai-organization", "org-abc")]);
        assert_eq!(
            read(Dialect::Openai, &openai, b"", now).account.as_deref(),
            Some("org-abc")
        );
        let anthropic = headers(&[("anthropic-organization-id", " 7d3c-11ee ")]);
        assert_eq!(
            read(Dialect::Anthropic, &anthropic, b"", now).account.as_deref(),
            Some("7d3c-11ee")
        );
        let long = "o".repeat(MAX_ACCOUNT_LEN + 1);
        for bogus in ["", "org a", long.as_str()] {
            let h = headers(&[("openai-organization", bogus)]);
            assert_eq!(read(Dialect::Openai, &h, b"", now).account, None, "{bogus:?}");
        }
    }
}
