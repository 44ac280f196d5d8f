//! `GET /metrics`: Prometheus text. Two parts: what happened (counters and histograms the
//! gate and dispatchers record through `tollgate::metrics`, held by this process's
//! recorder) and where things stand (read from the database at scrape time: queue depth
//! and oldest age by tenant and class, every bucket's limit, level and use with its
//! source, daily headroom, each tenant's share of the capacity in use, how the `eta`
//! forecasts came out). Scraping needs
//! `server.admin_key` (`Authorization: Bearer`); without one configured, nobody scrapes.

use std::fmt::Write as _;
use std::sync::OnceLock;
use tollgate::vocab::ApiErrorCode;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tollgate::metrics::{self as names, class_label};
use tollgate::store;

use crate::AppState;
use crate::auth::Viewer;
use crate::error::ApiError;
use crate::openapi as doc;
use crate::status::bucket_uses;

/// This process's recorder, installed as the global one on first use. A process that
/// already has another recorder keeps it (then only the database part is reported).
pub fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(names::QUEUE_WAIT.into()), names::SECONDS_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(names::RETRY_AFTER.into()), names::SECONDS_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(names::ATTEMPTS_PER_JOB.into()),
                    names::ATTEMPT_BUCKETS,
                )
            })
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(names::CALL_SPEND.into()), names::SPEND_BUCKETS)
            });
        let recorder = match builder {
            Ok(b) => b.build_recorder(),
            Err(e) => {
                tracing::warn!(error = %e, "metric buckets rejected; histograms render as summaries");
                PrometheusBuilder::new().build_recorder()
            }
        };
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("a metrics recorder was already installed; /metrics reports database levels only");
        }
        handle
    })
}

/// Prometheus text format.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "get_metrics",
    tag = "operations",
    responses(
        (status = 200, description = "Prometheus text exposition format", content_type = "text/plain", body = String),
        (status = 401, description = "`missing_api_key`, `invalid_api_key`", body = doc::ErrorBody),
        (status = 403, description = "`admin_only`: a tenant key, or no `server.admin_key` configured", body = doc::ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub(crate) async fn scrape(
    State(state): State<AppState>,
    parts: axum::http::request::Parts,
) -> Result<Response, ApiError> {
    // Every tenant's names, depths and spend are in here: the operators' key only, and
    // with none configured, nobody.
    if !state.tenants.current().has_admin() {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ApiErrorCode::AdminOnly,
            "/metrics shows every tenant and needs the admin key: set server.admin_key (or admin_key_env) and scrape with it",
        ));
    }
    let mut parts = parts;
    let viewer =
        <Viewer as axum::extract::FromRequestParts<AppState>>::from_request_parts(&mut parts, &state).await?;
    if !matches!(viewer, Viewer::Admin) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ApiErrorCode::AdminOnly,
            "/metrics needs the admin key (server.admin_key)",
        ));
    }
    let mut text = recorder().render();
    levels(&state, &mut text).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// A label value, escaped for the text format.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
}

/// The database part: levels at scrape time, for every tenant.
async fn levels(state: &AppState, out: &mut String) -> Result<(), ApiError> {
    let now = Utc::now();
    let queues = store::queue_depths(&state.pool, None).await?;
    family(
        out,
        "tollgate_queue_depth",
        "Unfinished jobs by tenant, class and state.",
    );
    for q in &queues {
        for (st, n) in [
            ("queued", q.queued),
            ("admitted", q.admitted),
            ("running", q.running),
        ] {
            let _ = writeln!(
                out,
                "tollgate_queue_depth{{tenant=\"{}\",class=\"{}\",state=\"{st}\"}} {n}",
                esc(&q.tenant),
                class_label(q.class)
            );
        }
    }
    family(
        out,
        "tollgate_queue_oldest_age_seconds",
        "Age of the oldest queued job by tenant and class.",
    );
    for q in &queues {
        let age = q
            .oldest_queued
            .map_or(0.0, |t| (now - t).num_milliseconds().max(0) as f64 / 1000.0);
        let _ = writeln!(
            out,
            "tollgate_queue_oldest_age_seconds{{tenant=\"{}\",class=\"{}\"}} {age}",
            esc(&q.tenant),
            class_label(q.class)
        );
    }
    let forecasts = crate::status::forecasts(&state.pool, None, now).await?;
    family(
        out,
        "tollgate_forecast_error",
        "Relative error of the eta p50 forecast at submission, of the jobs that finished in the last hour, at a quantile.",
    );
    for (q, error) in [("0.5", forecasts.p50_error), ("0.9", forecasts.p90_error)] {
        if let Some(error) = error {
            let _ = writeln!(out, "tollgate_forecast_error{{quantile=\"{q}\"}} {error}");
        }
    }
    let buckets = bucket_uses(&state.pool, &Viewer::Admin, now).await?;
    family(
        out,
        "tollgate_bucket_limit",
        "Each bucket's capacity in force, with its source (configured, learned, probe, pace).",
    );
    for b in &buckets {
        let _ = writeln!(
            out,
            "tollgate_bucket_limit{{bucket=\"{}\",dimension=\"{}\",rule=\"{}\",source=\"{}\"}} {}",
            esc(&b.bucket),
            b.dimension,
            b.rule,
            esc(&b.source),
            b.capacity
        );
    }
    family(
        out,
        "tollgate_bucket_configured_limit",
        "What the config says a bucket's capacity is, beside the one in force (tollgate_bucket_limit).",
    );
    for b in &buckets {
        if let Some(configured) = b.configured_capacity {
            let _ = writeln!(
                out,
                "tollgate_bucket_configured_limit{{bucket=\"{}\"}} {configured}",
                esc(&b.bucket)
            );
        }
    }
    family(
        out,
        "tollgate_bucket_level",
        "What each bucket holds now (capacity not reserved).",
    );
    for b in &buckets {
        let _ = writeln!(
            out,
            "tollgate_bucket_level{{bucket=\"{}\"}} {}",
            esc(&b.bucket),
            b.remaining
        );
    }
    family(
        out,
        "tollgate_bucket_utilization",
        "Share of each bucket in use, 0 to 1 (concurrency buckets: saturation).",
    );
    for b in &buckets {
        let u = if b.capacity > 0.0 {
            b.used / b.capacity
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "tollgate_bucket_utilization{{bucket=\"{}\",dimension=\"{}\"}} {u}",
            esc(&b.bucket),
            b.dimension
        );
    }
    family(
        out,
        "tollgate_daily_headroom",
        "What remains of each daily quota and budget (requests per day, spend in micro-USD) until its reset.",
    );
    for b in buckets.iter().filter(|b| b.rule == "fixed") {
        let _ = writeln!(
            out,
            "tollgate_daily_headroom{{bucket=\"{}\",dimension=\"{}\"}} {}",
            esc(&b.bucket),
            b.dimension,
            b.remaining
        );
    }
    let holdings = store::tenant_holdings(&state.pool).await?;
    let total: i64 = holdings.iter().map(|(_, n)| n).sum();
    family(
        out,
        "tollgate_tenant_share",
        "Each tenant's share of the estimated tokens held by admitted and running jobs, 0 to 1.",
    );
    let directory = state.tenants.current();
    for t in directory.tenants() {
        let held = holdings.iter().find(|(n, _)| n == &t.name).map_or(0, |(_, h)| *h);
        let share = if total > 0 {
            held as f64 / total as f64
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "tollgate_tenant_share{{tenant=\"{}\"}} {share}",
            esc(&t.name)
        );
    }
    family(out, "tollgate_tenant_weight", "Each tenant's weight.");
    for t in directory.tenants() {
        let _ = writeln!(
            out,
            "tollgate_tenant_weight{{tenant=\"{}\"}} {}",
            esc(&t.name),
            t.weight
        );
    }
    Ok(())
}
