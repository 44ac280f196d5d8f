//! Metric names and the one-line helpers the gate and the dispatchers call when something
//! happens (an admission decision, a provider response, a retry). They record through the
//! `metrics` facade; whichever recorder the process installed (the API's Prometheus
//! exporter, or none) receives them. Levels that live in the database — queue depth,
//! oldest age, bucket use and limits, headroom, tenant shares — are not kept here: the
//! `/metrics` handler reads them at scrape time, so every process reports the same truth.
//!
//! Names follow Prometheus conventions: `_total` counters, `_seconds` histograms, labels
//! bounded by configuration (tenants, routes, providers, models, buckets, reason codes).

use chrono::{DateTime, Utc};

use crate::model::{JobClass, Lane};
use crate::routing::Target;
use crate::store::Candidate;
use crate::vocab::Endpoint;

/// Admission decisions: `tenant`, `route`, `bucket` (the one that held the job, or empty),
/// `decision` (`admitted` | `waiting` | `failed`), `reason`. `waiting` is counted when a
/// job's reason to wait changes, not once per round.
pub const ADMISSION_DECISIONS: &str = "tollgate_admission_decisions_total";
/// Time from submission to admission, by `tenant` and `class` (histogram).
pub const QUEUE_WAIT: &str = "tollgate_queue_wait_seconds";
/// Jobs admitted on a route target other than the first, by `tenant`, `route`, `target`.
pub const FALLBACKS: &str = "tollgate_fallbacks_total";
/// Provider responses by `provider`, `model`, `status` (HTTP code, or `none` when no answer
/// came) and `class` (`ok` or the failure class: `capacity`, `overload`, …).
pub const PROVIDER_RESPONSES: &str = "tollgate_provider_responses_total";
/// Throttling answers (429, 503, 529) by `provider`, `model`, `status`.
pub const PROVIDER_THROTTLES: &str = "tollgate_provider_throttles_total";
/// Retry-After values the providers sent, by `provider`, `model` (histogram, seconds).
pub const RETRY_AFTER: &str = "tollgate_provider_retry_after_seconds";
/// Estimated tokens of successful attempts, by `provider`, `model`, `endpoint`,
/// `direction`.
pub const TOKENS_ESTIMATED: &str = "tollgate_tokens_estimated_total";
/// Tokens the provider reported for the same attempts.
pub const TOKENS_ACTUAL: &str = "tollgate_tokens_actual_total";
/// Capacity reserved but not used (estimate above actual), by `provider`, `model`,
/// `endpoint`, `direction`: what over-reservation wasted until settlement gave it back.
pub const OVER_RESERVED: &str = "tollgate_over_reserved_tokens_total";
/// What each answered call cost at the configured prices, in micro-USD, by `tenant`,
/// `provider`, `model`, `endpoint` and `lane` (`online`, `provider_batch`: at the batch
/// price) (histogram: its `_sum` is the spend).
pub const CALL_SPEND: &str = "tollgate_call_spend_micro_usd";
/// Retries scheduled, by `tenant`, `provider`, `model` and the failure `code`.
pub const RETRIES: &str = "tollgate_retries_total";
/// Provider calls per finished job, by `tenant` and final `state` (histogram).
pub const ATTEMPTS_PER_JOB: &str = "tollgate_attempts_per_job";
/// Jobs finished by the dispatchers, by `tenant`, `class`, `state` and reason `code`.
pub const JOBS_FINISHED: &str = "tollgate_jobs_finished_total";
/// Successful provider answers without usage, by `provider` and `model`: their usage
/// was estimated from the request (the result's `usage.tollgate_estimated` is true).
pub const USAGE_MISSING: &str = "tollgate_provider_usage_missing_total";

/// Histogram buckets for [`QUEUE_WAIT`] and [`RETRY_AFTER`] (seconds).
pub const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];
/// Histogram buckets for [`CALL_SPEND`] (micro-USD: a tenth of a micro-dollar to a dollar).
pub const SPEND_BUCKETS: &[f64] = &[0.1, 1.0, 10.0, 100.0, 1_000.0, 10_000.0, 100_000.0, 1_000_000.0];
/// Histogram buckets for [`ATTEMPTS_PER_JOB`].
pub const ATTEMPT_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0];

pub fn class_label(class: JobClass) -> &'static str {
    match class {
        JobClass::Interactive => "interactive",
        JobClass::Standard => "standard",
        JobClass::Background => "background",
        JobClass::Batch => "batch",
    }
}

/// The gate admitted `job` on `target` at `now`: counts the decision, its queue wait, and
/// a fallback when `target` is not the route's `preferred` one (the first it could use) or
/// a target already failed the job.
pub fn admitted(job: &Candidate, target: &Target, preferred: &Target, now: DateTime<Utc>) {
    decision(job, "", "admitted", "admitted");
    let waited = (now - job.created_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6;
    metrics::histogram!(QUEUE_WAIT, "tenant" => job.tenant.clone(), "class" => class_label(job.class))
        .record(waited);
    let to = target.label();
    let failed_over = job
        .failed_targets
        .as_ref()
        .is_some_and(|f| !f.is_empty() && !f.contains(&to));
    if failed_over || (&target.provider, &target.model) != (&preferred.provider, &preferred.model) {
        metrics::counter!(FALLBACKS, "tenant" => job.tenant.clone(), "route" => job.model.clone(), "target" => to)
            .increment(1);
    }
}

/// The gate failed `job` (it can never fit, or not before its deadline) for `reason`,
/// because of `bucket`.
pub fn failed(job: &Candidate, bucket: &str, reason: &str) {
    decision(job, bucket, "failed", reason);
}

/// The gate's note on a job that waits, as a decision: its reason and bucket (or scope).
/// Counted when the note changes (a job starts waiting, or for another reason or time),
/// not on every round it keeps waiting.
pub fn waiting(job: &Candidate, note: &serde_json::Value) {
    let reason = note["reason"].as_str().unwrap_or("waiting");
    let bucket = note["bucket"].as_str().or(note["scope"].as_str()).unwrap_or("");
    decision(job, bucket, "waiting", reason);
}

fn decision(job: &Candidate, bucket: &str, decision: &'static str, reason: &str) {
    let labels = [
        ("tenant", job.tenant.clone()),
        ("route", job.model.clone()),
        ("bucket", bucket.to_owned()),
        ("decision", decision.to_owned()),
        ("reason", reason.to_owned()),
    ];
    metrics::counter!(ADMISSION_DECISIONS, &labels).increment(1);
}

/// A dispatcher scheduled a retry after a failed attempt.
pub fn retry(tenant: &str, provider: &str, model: &str, code: &str) {
    metrics::counter!(RETRIES, "tenant" => tenant.to_owned(), "provider" => provider.to_owned(), "model" => model.to_owned(), "code" => code.to_owned())
        .increment(1);
}

/// A job reached a terminal state after `attempts` provider calls.
pub fn job_finished(tenant: &str, class: JobClass, state: &str, code: &str, attempts: i32) {
    metrics::counter!(JOBS_FINISHED, "tenant" => tenant.to_owned(), "class" => class_label(class), "state" => state.to_owned(), "code" => code.to_owned())
        .increment(1);
    metrics::histogram!(ATTEMPTS_PER_JOB, "tenant" => tenant.to_owned(), "state" => state.to_owned())
        .record(f64::from(attempts.max(0)));
}

/// A provider answered (or did not: `status = None`). `failure_class` is `None` on
/// success; `retry_after` is the provider's hint, when it sent one.
pub fn provider_response(
    provider: &str,
    model: &str,
    status: Option<u16>,
    failure_class: Option<&str>,
    retry_after: Option<std::time::Duration>,
) {
    let status_label = status.map_or_else(|| "none".to_owned(), |s| s.to_string());
    metrics::counter!(PROVIDER_RESPONSES, "provider" => provider.to_owned(), "model" => model.to_owned(), "status" => status_label.clone(), "class" => failure_class.unwrap_or("ok").to_owned())
        .increment(1);
    if matches!(status, Some(429 | 503 | 529)) {
        metrics::counter!(PROVIDER_THROTTLES, "provider" => provider.to_owned(), "model" => model.to_owned(), "status" => status_label)
            .increment(1);
    }
    if let Some(after) = retry_after {
        metrics::histogram!(RETRY_AFTER, "provider" => provider.to_owned(), "model" => model.to_owned())
            .record(after.as_secs_f64());
    }
}

/// A provider answered 2xx without usage; the estimate stood in for it.
pub fn usage_missing(provider: &str, model: &str) {
    metrics::counter!(USAGE_MISSING, "provider" => provider.to_owned(), "model" => model.to_owned())
        .increment(1);
}

/// Estimated against reported tokens of a successful attempt of `endpoint`, and the
/// over-reservation.
pub fn tokens(provider: &str, model: &str, endpoint: Endpoint, estimated: (i64, i64), actual: (i64, i64)) {
    for (direction, est, act) in [
        ("input", estimated.0, actual.0),
        ("output", estimated.1, actual.1),
    ] {
        let labels = [
            ("provider", provider.to_owned()),
            ("model", model.to_owned()),
            ("endpoint", endpoint.as_str().to_owned()),
            ("direction", direction.to_owned()),
        ];
        metrics::counter!(TOKENS_ESTIMATED, &labels).increment(est.max(0) as u64);
        metrics::counter!(TOKENS_ACTUAL, &labels).increment(act.max(0) as u64);
        metrics::counter!(OVER_RESERVED, &labels).increment((est - act).max(0) as u64);
    }
}

/// What one answered call of `tenant` to `provider`/`model` cost, in micro-USD, by the
/// `lane` that carried it.
pub fn call_spend(tenant: &str, provider: &str, model: &str, endpoint: Endpoint, lane: Lane, micro_usd: f64) {
    metrics::histogram!(CALL_SPEND,
        "tenant" => tenant.to_owned(),
        "provider" => provider.to_owned(),
        "model" => model.to_owned(),
        "endpoint" => endpoint.as_str(),
        "lane" => lane.as_str())
    .record(micro_usd);
}
