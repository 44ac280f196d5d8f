//! What every request passes before its handler: the size of its headers (431
//! `headers_too_large`, `server.max_header_bytes`), then a rate (429 `api_rate_limited`
//! with Retry-After), so that one client's loop, a key-guessing run or oversized headers
//! cost the handlers and the database nothing:
//!
//! - a request with a tenant's key counts against that tenant (`server.api_rate_per_sec`
//!   / `api_burst`), and a bulk counts once per job it holds ([`TenantRate::charge_jobs`],
//!   once its items are counted): a tenant whose submissions ran its bucket into debt is
//!   refused before its next body is read, so a flood of large bulks runs at the rate's
//!   jobs a second, not at the rate the process can skim bodies;
//! - any other request — no key, a wrong key, an anonymous endpoint — counts against its
//!   source address (`server.anonymous_rate_per_sec` / `anonymous_burst`; an IPv6 source
//!   is its /64), so guessing keys runs at that rate, not at line rate;
//! - the admin key and the probes (`/healthz`, `/readyz`, which cost no database work per
//!   request) are not counted.
//!
//! A refused request is answered after a hold, not at once: after [`REFUSAL_HOLD`] when
//! refused for its source, after its wait (at most `REFUSAL_HOLD`) when refused for its
//! tenant. A loop that waits for its answers then makes a request a second per connection
//! instead of spinning on refusals, and the connections a source may hold are capped
//! (`server.max_connections_per_source`), so key guessing or a refused flood costs the
//! process a few hundred cheap answers a second per source instead of tens of thousands.
//!
//! Each rate is a token bucket in each process's memory: it protects the process, not a
//! global quota (that is what the tenant's `rpm`/`tpm` buckets are). The buckets by source
//! are bounded ([`MAX_SOURCES`]): full ones are forgotten first, and a flood from more
//! sources than that is refused until some refill.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tollgate::vocab::ApiErrorCode;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tollgate::config::ApiRate;
use tollgate::control::Directory;
use tollgate::tenants::Tenant;

use crate::AppState;
use crate::error::ApiError;
use crate::observed::RequestTenant;

/// How long the answer to a request refused for its source is held; the longest a
/// refusal for a tenant is held.
pub const REFUSAL_HOLD: Duration = Duration::from_secs(1);

/// Sources whose buckets are kept at once (about 100 bytes each).
pub const MAX_SOURCES: usize = 65_536;

/// Requests per second per key (a tenant, a source), refilled continuously, up to a burst.
#[derive(Debug)]
pub struct ApiRateLimiter<K = String> {
    /// The rate of keys given none of their own.
    default: ApiRate,
    /// Keys kept at most; a new key beyond them waits until a bucket is full again.
    max_keys: usize,
    /// Key → (tokens, when counted).
    levels: Mutex<HashMap<K, (f64, Instant)>>,
}

impl<K: Hash + Eq + Clone> ApiRateLimiter<K> {
    pub fn new(default: ApiRate, max_keys: usize) -> Self {
        Self {
            default,
            max_keys,
            levels: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request from `key`'s bucket at `now`; `Err(wait)` when it is empty,
    /// with the time until one request fits.
    pub fn take(&self, key: &K, now: Instant) -> Result<(), Duration> {
        self.take_at(key, self.default, now)
    }

    /// [`take`](Self::take) for a key with a rate of its own.
    pub fn take_at(&self, key: &K, rate: ApiRate, now: Instant) -> Result<(), Duration> {
        let mut levels = self.levels();
        if levels.len() >= self.max_keys && !levels.contains_key(key) {
            // A full bucket holds nothing a fresh one would not: forget those.
            let ApiRate { per_sec, burst } = self.default;
            levels.retain(|_, (tokens, at)| {
                *tokens + now.saturating_duration_since(*at).as_secs_f64() * per_sec < burst
            });
            if levels.len() >= self.max_keys {
                return Err(Duration::from_secs_f64(1.0 / per_sec));
            }
        }
        let (tokens, at) = levels.entry(key.clone()).or_insert((rate.burst, now));
        let elapsed = now.saturating_duration_since(*at).as_secs_f64();
        *tokens = (*tokens + elapsed * rate.per_sec).min(rate.burst);
        *at = now.max(*at);
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / rate.per_sec))
        }
    }

    /// Takes `n` more from `key`'s bucket at `now`, whatever it holds: a bucket run into
    /// debt (at most one burst's worth) refuses `key` until it has refilled past it.
    pub fn charge(&self, key: &K, n: f64, rate: ApiRate, now: Instant) {
        let mut levels = self.levels();
        let Some((tokens, at)) = levels.get_mut(key) else {
            return; // only a request [`take`](Self::take) let in is charged for more
        };
        let elapsed = now.saturating_duration_since(*at).as_secs_f64();
        *tokens = ((*tokens + elapsed * rate.per_sec).min(rate.burst) - n).max(-rate.burst);
        *at = now.max(*at);
    }

    fn levels(&self) -> std::sync::MutexGuard<'_, HashMap<K, (f64, Instant)>> {
        self.levels
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Each tenant's API rate in this process (its own or `server.api_rate_per_sec` /
/// `api_burst`), shared by the guard and the handlers that charge a request for more
/// than one.
#[derive(Debug, Clone)]
pub struct TenantRate(Arc<ApiRateLimiter>);

impl TenantRate {
    pub fn new(server: &tollgate::config::ServerConfig) -> Self {
        // Tenants are few and configured: no bound needed.
        Self(Arc::new(ApiRateLimiter::new(server.api_rate(), usize::MAX)))
    }

    fn take(&self, tenant: &Tenant, now: Instant) -> Result<(), Duration> {
        self.0.take_at(&tenant.name, tenant.api_rate, now)
    }

    /// Charges `tenant` for the jobs of a request the guard counted as one.
    pub fn charge_jobs(&self, tenant: &Tenant, jobs: usize) {
        let more = jobs.saturating_sub(1) as f64;
        if more > 0.0 {
            self.0.charge(&tenant.name, more, tenant.api_rate, Instant::now());
        }
    }
}

/// The middleware's state: built once per router.
#[derive(Clone)]
pub struct Guard {
    limiter: TenantRate,
    anonymous: Arc<ApiRateLimiter<IpAddr>>,
    tenants: Directory,
    clock: tollgate::clock::Clock,
    max_header_bytes: usize,
}

impl Guard {
    pub fn new(state: &AppState) -> Self {
        let server = &state.config.server;
        Self {
            limiter: state.tenant_rate.clone(),
            anonymous: Arc::new(ApiRateLimiter::new(
                ApiRate {
                    per_sec: server.anonymous_rate_per_sec,
                    burst: server.anonymous_burst,
                },
                MAX_SOURCES,
            )),
            tenants: state.tenants.clone(),
            clock: state.clock.clone(),
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
    let key = crate::auth::bearer(request.headers()).ok();
    let now = Instant::now();
    let found = key.and_then(|key| guard.tenants.authenticate(key, guard.clock.now()));
    let admin = found.is_none() && key.is_some_and(|key| guard.tenants.current().is_admin(key));
    let throttled = match &found {
        Some(found) => guard.limiter.take(&found.tenant, now).err().map(|wait| {
            (
                wait,
                "too many API requests (a bulk counts each of its jobs) from this tenant (server.api_rate_per_sec); retry after the delay given",
                wait.min(REFUSAL_HOLD),
            )
        }),
        None if admin => None,
        None if matches!(request.uri().path(), "/healthz" | "/readyz") => None,
        None => {
            // Without a socket (a router driven in-process) every request is one source.
            let source = request
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map_or(IpAddr::from([0, 0, 0, 0]), |ConnectInfo(peer)| crate::serve::source_of(*peer));
            guard.anonymous.take(&source, now).err().map(|wait| {
                (
                    wait,
                    "too many requests without a valid API key from this address (server.anonymous_rate_per_sec); retry after the delay given",
                    REFUSAL_HOLD,
                )
            })
        }
    };
    let mut response = match throttled {
        Some((wait, message, hold)) => {
            tokio::time::sleep(hold).await;
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                ApiErrorCode::ApiRateLimited,
                message,
            )
            .with_retry_after(wait.saturating_sub(hold))
            .into_response()
        }
        None => next.run(request).await,
    };
    // Whose request it was, for the request log.
    let who = match found {
        Some(found) => Some(RequestTenant::Tenant(found.tenant)),
        None => admin.then_some(RequestTenant::Admin),
    };
    if let Some(who) = who {
        response.extensions_mut().insert(who);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_sec: f64, burst: f64) -> ApiRate {
        ApiRate { per_sec, burst }
    }

    #[test]
    fn a_tenant_gets_its_burst_then_the_rate_and_others_are_unaffected() {
        let limiter = ApiRateLimiter::new(rate(10.0, 3.0), usize::MAX);
        let (acme, globex) = ("acme".to_owned(), "globex".to_owned());
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(limiter.take(&acme, t0).is_ok());
        }
        let wait = limiter.take(&acme, t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-9, "{wait:?}");
        assert!(limiter.take(&globex, t0).is_ok(), "buckets are per tenant");
        // A tenth of a second refills one request, no more.
        let t1 = t0 + Duration::from_millis(100);
        assert!(limiter.take(&acme, t1).is_ok());
        assert!(limiter.take(&acme, t1).is_err());
        // A long idle refills to the burst, never beyond it.
        let t2 = t1 + Duration::from_secs(3600);
        for _ in 0..3 {
            assert!(limiter.take(&acme, t2).is_ok());
        }
        assert!(limiter.take(&acme, t2).is_err());
    }

    #[test]
    fn a_charge_runs_the_bucket_into_debt_of_at_most_one_burst() {
        let limiter = ApiRateLimiter::new(rate(10.0, 5.0), usize::MAX);
        let acme = "acme".to_owned();
        let t0 = Instant::now();
        assert!(limiter.take(&acme, t0).is_ok());
        limiter.charge(&acme, 100.0, rate(10.0, 5.0), t0);
        // Debt is bounded at one burst: 5 below zero, so 0.6 s until one request fits.
        let wait = limiter.take(&acme, t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.6).abs() < 1e-9, "{wait:?}");
        assert!(limiter.take(&acme, t0 + Duration::from_millis(600)).is_ok());
        // A key never let in is not charged (nor given a bucket).
        limiter.charge(&"globex".to_owned(), 100.0, rate(10.0, 5.0), t0);
        assert!(limiter.take(&"globex".to_owned(), t0).is_ok());
    }

    #[test]
    fn sources_are_bounded_and_full_buckets_are_forgotten_first() {
        let limiter = ApiRateLimiter::new(rate(1.0, 2.0), 2);
        let t0 = Instant::now();
        assert!(limiter.take(&1, t0).is_ok());
        assert!(limiter.take(&2, t0).is_ok());
        // Both buckets are in use: a third source waits rather than growing the map.
        assert!(limiter.take(&3, t0).is_err());
        // Once they have refilled, they are forgotten and the newcomer gets a bucket.
        let later = t0 + Duration::from_secs(5);
        assert!(limiter.take(&3, later).is_ok());
        assert_eq!(limiter.levels.lock().unwrap().len(), 1);
    }
}
