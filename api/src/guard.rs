//! What every request passes before its handler: the size of its headers (431
//! `headers_too_large`, `server.max_header_bytes`) and its tenant's rate on the API itself
//! (429 `api_rate_limited` with Retry-After, `server.api_rate_per_sec` / `api_burst`), so
//! that one client's loop or oversized headers cost the handlers and the database nothing.
//!
//! The rate is a token bucket per tenant in each process's memory: it protects the
//! process, not a global quota (that is what the tenant's `rpm`/`tpm` buckets are).
//! Requests without a valid key are not counted here; they are answered 401 by the
//! handler's key check, which costs a hash and no database work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tollgate::vocab::ApiErrorCode;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tollgate::tenants::TenantDirectory;

use crate::AppState;
use crate::error::ApiError;

/// Requests per second per tenant, refilled continuously, up to `burst`.
#[derive(Debug)]
pub struct ApiRateLimiter {
    rate: f64,
    burst: f64,
    /// Tenant name → (tokens, when counted). Bounded: only configured tenants get one.
    levels: Mutex<HashMap<String, (f64, Instant)>>,
}

impl ApiRateLimiter {
    pub fn new(rate_per_sec: f64, burst: f64) -> Self {
        Self {
            rate: rate_per_sec,
            burst,
            levels: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request from `tenant`'s bucket at `now`; `Err(wait)` when it is empty,
    /// with the time until one request fits.
    pub fn take(&self, tenant: &str, now: Instant) -> Result<(), Duration> {
        let mut levels = self
            .levels
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (tokens, at) = levels.entry(tenant.to_owned()).or_insert((self.burst, now));
        let elapsed = now.saturating_duration_since(*at).as_secs_f64();
        *tokens = (*tokens + elapsed * self.rate).min(self.burst);
        *at = now.max(*at);
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / self.rate))
        }
    }
}

/// The middleware's state: built once per router.
#[derive(Clone)]
pub struct Guard {
    limiter: Arc<ApiRateLimiter>,
    tenants: Arc<TenantDirectory>,
    max_header_bytes: usize,
}

impl Guard {
    pub fn new(state: &AppState) -> Self {
        let server = &state.config.server;
        Self {
            limiter: Arc::new(ApiRateLimiter::new(server.api_rate_per_sec, server.api_burst)),
            tenants: state.tenants.clone(),
            max_header_bytes: server.max_header_bytes,
        }
    }
}

/// Header size, then the tenant's API rate; then the handler.
pub async fn check(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let header_bytes: usize = request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if header_bytes > guard.max_header_bytes {
        return ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiErrorCode::HeadersTooLarge,
            format!(
                "the request's headers are larger than {} bytes (server.max_header_bytes)",
                guard.max_header_bytes
            ),
        )
        .into_response();
    }
    let tenant = crate::auth::bearer(request.headers())
        .ok()
        .and_then(|key| guard.tenants.authenticate(key));
    if let Some(tenant) = tenant
        && let Err(wait) = guard.limiter.take(&tenant.name, Instant::now())
    {
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            ApiErrorCode::ApiRateLimited,
            "too many API requests from this tenant (server.api_rate_per_sec); retry after the delay given",
        )
        .with_retry_after(wait)
        .into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_gets_its_burst_then_the_rate_and_others_are_unaffected() {
        let limiter = ApiRateLimiter::new(10.0, 3.0);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(limiter.take("acme", t0).is_ok());
        }
        let wait = limiter.take("acme", t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-9, "{wait:?}");
        assert!(limiter.take("globex", t0).is_ok(), "buckets are per tenant");
        // A tenth of a second refills one request, no more.
        let t1 = t0 + Duration::from_millis(100);
        assert!(limiter.take("acme", t1).is_ok());
        assert!(limiter.take("acme", t1).is_err());
        // A long idle refills to the burst, never beyond it.
        let t2 = t1 + Duration::from_secs(3600);
        for _ in 0..3 {
            assert!(limiter.take("acme", t2).is_ok());
        }
        assert!(limiter.take("acme", t2).is_err());
    }
}
