//! Counters behind `GET /mock/stats`: lock-free atomics on the hot path, and the
//! serialisable [`MockStats`] snapshot built from them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

use super::config::ProjectLimits;

/// Snapshot of what the mock has seen since start (or the last `/mock/reset`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MockStats {
    /// Model requests received (both APIs, any outcome).
    pub requests: u64,
    /// 200 responses; a stream counts when its 200 goes out, before its first event.
    pub succeeded: u64,
    /// 429 responses (including non-retryable "request too large").
    pub rate_limited_429: u64,
    /// Injected 5xx faults.
    pub faults_5xx: u64,
    /// 401 responses (missing, unknown or revoked key).
    pub unauthorized: u64,
    /// 400 responses (bad JSON, missing fields, missing `anthropic-version`).
    pub bad_request: u64,
    /// 404 responses (model not in the project's list).
    pub not_found: u64,
    /// Model requests being handled right now.
    pub in_flight: u64,
    /// Highest `in_flight` observed.
    pub max_in_flight: u64,
    /// Streaming responses begun (`stream: true` requests admitted; each is also counted
    /// in `succeeded`, since its 200 is sent before the first event).
    #[serde(default)]
    pub streams_started: u64,
    /// Streams that sent their last event (`data: [DONE]` / `message_stop`).
    #[serde(default)]
    pub streams_completed: u64,
    /// Calls at the flex tier (`service_tier: "flex"`) refused for capacity (429
    /// "Resource Unavailable"); not counted in `rate_limited_429`.
    #[serde(default)]
    pub flex_unavailable: u64,
    /// Streams whose body was dropped before the last event: the client went away.
    /// Their unproduced tokens were returned to OTPM and taken out of
    /// `output_tokens_admitted`.
    #[serde(default)]
    pub streams_cancelled: u64,
    /// Faults injected by the fault mix, by kind.
    #[serde(default)]
    pub faults_injected: super::faults::InjectedFaults,
    /// Sum of the projects' `limit_violations`; anything but 0 is a bug in the mock.
    pub limit_violations: u64,
    /// Per project, by name.
    pub projects: BTreeMap<String, ProjectStats>,
}

/// One project's share of [`MockStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectStats {
    /// Requests admitted by the limiter (and so answered 200).
    pub requests_admitted: u64,
    /// Input tokens of admitted requests (the token rule of this module).
    pub input_tokens_admitted: u64,
    /// Completion tokens generated for admitted requests.
    pub output_tokens_admitted: u64,
    /// 429 responses.
    pub rate_limited_429: u64,
    /// Injected 5xx faults.
    pub faults_5xx: u64,
    /// Admissions that broke a limit according to the independent audit; must be 0.
    pub limit_violations: u64,
    /// Limits in force now.
    pub limits: ProjectLimits,
}

/// Server-wide counters.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    pub requests: AtomicU64,
    pub succeeded: AtomicU64,
    pub rate_limited_429: AtomicU64,
    pub faults_5xx: AtomicU64,
    pub unauthorized: AtomicU64,
    pub bad_request: AtomicU64,
    pub not_found: AtomicU64,
    pub in_flight: AtomicU64,
    pub max_in_flight: AtomicU64,
    pub streams_started: AtomicU64,
    pub streams_completed: AtomicU64,
    pub streams_cancelled: AtomicU64,
    pub flex_unavailable: AtomicU64,
    /// Calls at the flex tier received, for `flex_unavailable_every_nth`.
    pub flex_calls: AtomicU64,
    /// Faults of the fault mix, in `faults::Injected` order.
    pub injected: [AtomicU64; 8],
}

/// Per-project counters.
#[derive(Debug, Default)]
pub(crate) struct ProjectCounters {
    pub requests_admitted: AtomicU64,
    pub input_tokens_admitted: AtomicU64,
    pub output_tokens_admitted: AtomicU64,
    pub rate_limited_429: AtomicU64,
    pub faults_5xx: AtomicU64,
}

/// Adds one to a counter.
pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

impl Totals {
    /// Marks a request as in flight until the guard drops (also when the client goes away).
    pub(crate) fn begin(&self) -> InFlight<'_> {
        bump(&self.requests);
        let now = self.in_flight.fetch_add(1, Relaxed) + 1;
        self.max_in_flight.fetch_max(now, Relaxed);
        InFlight(self)
    }

    pub(crate) fn fill(&self, s: &mut MockStats) {
        s.requests = self.requests.load(Relaxed);
        s.succeeded = self.succeeded.load(Relaxed);
        s.rate_limited_429 = self.rate_limited_429.load(Relaxed);
        s.faults_5xx = self.faults_5xx.load(Relaxed);
        s.unauthorized = self.unauthorized.load(Relaxed);
        s.bad_request = self.bad_request.load(Relaxed);
        s.not_found = self.not_found.load(Relaxed);
        s.in_flight = self.in_flight.load(Relaxed);
        s.max_in_flight = self.max_in_flight.load(Relaxed);
        s.streams_started = self.streams_started.load(Relaxed);
        s.streams_completed = self.streams_completed.load(Relaxed);
        s.streams_cancelled = self.streams_cancelled.load(Relaxed);
        s.flex_unavailable = self.flex_unavailable.load(Relaxed);
        s.faults_injected = super::faults::InjectedFaults::from_array(std::array::from_fn(|i| {
            self.injected[i].load(Relaxed)
        }));
    }

    /// Zeroes the counters; `in_flight` is a gauge and stays, `max_in_flight` restarts from it.
    pub(crate) fn reset(&self) {
        for c in [
            &self.requests,
            &self.succeeded,
            &self.rate_limited_429,
            &self.faults_5xx,
            &self.unauthorized,
            &self.bad_request,
            &self.not_found,
            &self.streams_started,
            &self.streams_completed,
            &self.streams_cancelled,
            &self.flex_unavailable,
            &self.flex_calls,
        ]
        .into_iter()
        .chain(&self.injected)
        {
            c.store(0, Relaxed);
        }
        self.max_in_flight.store(self.in_flight.load(Relaxed), Relaxed);
    }
}

/// Decrements `in_flight` on drop.
pub(crate) struct InFlight<'a>(&'a Totals);

impl InFlight<'_> {
    /// Gives up the guard without decrementing: whoever calls this takes over the
    /// decrement with [`Totals::end`] (a streaming body outlives its handler).
    pub(crate) fn hand_over(self) {
        std::mem::forget(self);
    }
}

impl Totals {
    /// Ends a request whose [`InFlight`] guard was handed over.
    pub(crate) fn end(&self) {
        self.in_flight.fetch_sub(1, Relaxed);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

impl ProjectCounters {
    pub(crate) fn admitted(&self, input: u64, output: u64) {
        bump(&self.requests_admitted);
        self.input_tokens_admitted.fetch_add(input, Relaxed);
        self.output_tokens_admitted.fetch_add(output, Relaxed);
    }

    /// Takes back `n` output tokens counted at admission but never generated (a stream
    /// the client dropped midway).
    pub(crate) fn not_generated(&self, n: u64) {
        self.output_tokens_admitted.fetch_sub(n, Relaxed);
    }

    pub(crate) fn snapshot(&self, limits: ProjectLimits, limit_violations: u64) -> ProjectStats {
        ProjectStats {
            requests_admitted: self.requests_admitted.load(Relaxed),
            input_tokens_admitted: self.input_tokens_admitted.load(Relaxed),
            output_tokens_admitted: self.output_tokens_admitted.load(Relaxed),
            rate_limited_429: self.rate_limited_429.load(Relaxed),
            faults_5xx: self.faults_5xx.load(Relaxed),
            limit_violations,
            limits,
        }
    }

    pub(crate) fn reset(&self) {
        for c in [
            &self.requests_admitted,
            &self.input_tokens_admitted,
            &self.output_tokens_admitted,
            &self.rate_limited_429,
            &self.faults_5xx,
        ] {
            c.store(0, Relaxed);
        }
    }
}
