//! Job traces (OpenTelemetry): one trace per job, from its submission through each of its
//! admissions and attempts to its end, whichever processes did each part.
//!
//! A job's spans are made after the fact, with the real times its row records, so no
//! process holds a span open across the job's life: `job.submit` as the API accepts it
//! (the child of the client's `traceparent` when it sent one, else a new trace's root),
//! then for each attempt `job.queued` (from when it could be admitted to when it was) and
//! `job.attempt` (the provider call and how it ended), both children of `job.submit`,
//! found by the job's `traceparent` column (W3C trace context, written at submit).
//!
//! The binary installs an exporter (`OTEL_EXPORTER_OTLP_*`) and calls [`enable`]; until
//! then every function here returns at once and jobs carry no trace context.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use chrono::{DateTime, Utc};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue, global};
use opentelemetry_sdk::propagation::TraceContextPropagator;

use crate::attempt::{End, Outcome};
use crate::model::{Job, NewJob};

/// The tracer's name (its instrumentation scope).
pub const TRACER: &str = "tollgate";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Jobs are traced from now on: a tracer provider is installed.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The context a W3C `traceparent` (and `tracestate`) names; an empty one when it names
/// none or is malformed.
fn context_of(traceparent: &str, tracestate: Option<&str>) -> Context {
    let mut carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    if let Some(state) = tracestate {
        carrier.insert("tracestate".to_owned(), state.to_owned());
    }
    TraceContextPropagator::new().extract(&carrier)
}

/// The W3C `traceparent` of `cx`'s span.
fn traceparent_of(cx: &Context) -> Option<String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(cx, &mut carrier);
    carrier.remove("traceparent")
}

/// The trace id a job's `traceparent` names (what a tracing backend finds it by).
pub fn trace_id(traceparent: &str) -> Option<String> {
    let cx = context_of(traceparent, None);
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

fn time(at: DateTime<Utc>) -> SystemTime {
    at.into()
}

/// Starts `job`'s trace as it is accepted: a `job.submit` span from `received` to now,
/// under the client's trace context when it sent one; the job keeps the span's context
/// for its later spans.
pub fn submitted(job: &mut NewJob<impl Sized>, client: Option<(&str, Option<&str>)>, received: SystemTime) {
    if !enabled() {
        return;
    }
    let parent = client.map_or_else(Context::new, |(parent, state)| context_of(parent, state));
    let tracer = global::tracer(TRACER);
    let span = tracer
        .span_builder("job.submit")
        .with_kind(SpanKind::Server)
        .with_start_time(received)
        .with_attributes([
            KeyValue::new("tollgate.job.id", job.id.to_string()),
            KeyValue::new("tollgate.tenant", job.tenant.clone()),
            KeyValue::new("tollgate.class", job.class.as_str()),
            KeyValue::new("tollgate.endpoint", job.endpoint.as_str()),
            KeyValue::new("tollgate.model", job.model.clone()),
        ])
        .start_with_context(&tracer, &parent);
    let cx = parent.with_span(span);
    job.traceparent = traceparent_of(&cx);
    cx.span().end();
}

/// Adds `job`'s attempt, ended as `outcome` says, to its trace: `job.queued` (from when it
/// could be admitted to its admission) and `job.attempt` (from `started_at` to
/// `finished_at`).
pub fn attempted(job: &Job, outcome: &Outcome, started_at: DateTime<Utc>, finished_at: DateTime<Utc>) {
    if !enabled() {
        return;
    }
    let Some(parent) = job.traceparent.as_deref().map(|t| context_of(t, None)) else {
        return;
    };
    if !parent.span().span_context().is_valid() {
        return;
    }
    let tracer = global::tracer(TRACER);
    let attempt = KeyValue::new("tollgate.attempt", i64::from(job.attempt));
    if let Some(admitted_at) = job.admitted_at {
        let mut queued = tracer
            .span_builder("job.queued")
            .with_start_time(time(job.not_before.min(admitted_at)))
            .with_attributes([
                attempt.clone(),
                KeyValue::new("tollgate.provider", job.provider.clone().unwrap_or_default()),
                KeyValue::new(
                    "tollgate.provider_model",
                    job.provider_model.clone().unwrap_or_default(),
                ),
                KeyValue::new(
                    "tollgate.reserved_usd",
                    job.reserved_micro_usd.unwrap_or(0.0) / 1e6,
                ),
            ])
            .start_with_context(&tracer, &parent);
        queued.end_with_timestamp(time(admitted_at));
    }
    let mut attributes = vec![
        attempt,
        KeyValue::new("tollgate.job.state", outcome.end.state().as_str()),
    ];
    if let Some(served) = &outcome.served {
        attributes.push(KeyValue::new("tollgate.provider", served.provider.clone()));
        attributes.push(KeyValue::new("tollgate.provider_model", served.model.clone()));
    }
    if let Some(call) = &outcome.call {
        if let Some(status) = call.status {
            attributes.push(KeyValue::new("http.response.status_code", i64::from(status)));
        }
        if let Some(usage) = call.usage {
            attributes.push(KeyValue::new("tollgate.input_tokens", usage.input_tokens));
            attributes.push(KeyValue::new("tollgate.output_tokens", usage.output_tokens));
        }
    }
    attributes.push(KeyValue::new(
        "tollgate.charged_usd",
        outcome.settlement.actual_spend / 1e6,
    ));
    let mut span = tracer
        .span_builder("job.attempt")
        .with_kind(SpanKind::Client)
        .with_start_time(time(started_at))
        .with_attributes(attributes)
        .start_with_context(&tracer, &parent);
    match &outcome.end {
        End::Succeeded { .. } => span.set_status(Status::Ok),
        End::Failed { code, message } | End::Retry { code, message, .. } => {
            span.set_attribute(KeyValue::new("tollgate.reason", code.as_str()));
            span.set_status(Status::error(message.clone()));
        }
    }
    span.end_with_timestamp(time(finished_at));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_id_is_read_from_a_traceparent_and_nothing_from_a_malformed_one() {
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            trace_id(parent).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "not a traceparent",
        ] {
            assert_eq!(trace_id(bad), None, "{bad:?}");
        }
    }
}
