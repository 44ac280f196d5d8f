//! What every request leaves behind: a line of the request log — method, route, status,
//! tenant and latency, at `info` on the target `tollgate::request` (`RUST_LOG` chooses) —
//! and, while jobs are traced (`tollgate::job_trace`), the client's W3C trace context for
//! the jobs the request submits, so each job's trace continues the caller's.
//!
//! The log line is written when the response's head is ready: a streamed answer's latency
//! is its time to first byte. The tenant is the one the guard found the key to be
//! ([`RequestTenant`]), `admin` for the admin key, `-` for none.

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use tollgate::model::NewJob;
use tollgate::tenants::Tenant;

/// The log target of the request log.
pub const REQUEST_LOG: &str = "tollgate::request";

/// Who the guard found a request to be from, put on its response for the request log.
#[derive(Debug, Clone)]
pub enum RequestTenant {
    Tenant(Arc<Tenant>),
    Admin,
}

tokio::task_local! {
    static CLIENT_TRACE: ClientTrace;
}

/// A request's W3C trace context (`traceparent`, `tracestate`; either may be absent) and
/// when it arrived: what its jobs' traces start from.
#[derive(Debug, Clone)]
pub struct ClientTrace {
    traceparent: Option<String>,
    tracestate: Option<String>,
    received: SystemTime,
}

impl ClientTrace {
    /// The trace context in `headers`, received now.
    fn of(headers: &axum::http::HeaderMap) -> Self {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Self {
            traceparent: header("traceparent"),
            tracestate: header("tracestate"),
            received: SystemTime::now(),
        }
    }

    /// The trace context of the request this task is handling, while jobs are traced.
    pub fn current() -> Option<Self> {
        CLIENT_TRACE.try_with(Clone::clone).ok()
    }

    /// Runs `f` (off the request's task, e.g. on a blocking thread) with `trace` as the
    /// request's trace context.
    pub fn within<R>(trace: Option<Self>, f: impl FnOnce() -> R) -> R {
        match trace {
            Some(trace) => CLIENT_TRACE.sync_scope(trace, f),
            None => f(),
        }
    }

    /// Starts `job`'s trace under the request's context, when jobs are traced.
    pub fn start<R>(job: &mut NewJob<R>) {
        if let Some(trace) = Self::current() {
            let client = trace
                .traceparent
                .as_deref()
                .map(|parent| (parent, trace.tracestate.as_deref()));
            tollgate::job_trace::submitted(job, client, trace.received);
        }
    }
}

/// The middleware: the request's trace context kept for its handler, its log line written.
pub async fn observe(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request.extensions().get::<MatchedPath>().cloned();
    let response = if tollgate::job_trace::enabled() {
        let trace = ClientTrace::of(request.headers());
        CLIENT_TRACE.scope(trace, next.run(request)).await
    } else {
        next.run(request).await
    };
    if tracing::enabled!(target: REQUEST_LOG, tracing::Level::INFO) {
        let tenant = match response.extensions().get::<RequestTenant>() {
            Some(RequestTenant::Tenant(t)) => t.name.as_str(),
            Some(RequestTenant::Admin) => "admin",
            None => "-",
        };
        tracing::info!(
            target: REQUEST_LOG,
            method = %method,
            route = route.as_ref().map_or("-", MatchedPath::as_str),
            status = response.status().as_u16(),
            tenant,
            latency_ms = started.elapsed().as_secs_f64() * 1000.0,
            "request"
        );
    }
    response
}
