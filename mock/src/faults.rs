//! Random faults ([`super::FaultMix`]): one seeded draw per model request decides whether
//! it meets a fault and which. The 5xx kinds are answered by each API in its own error
//! shape (as fault windows are); the others are the same on every API and live here:
//! [`before`] answers instead of admission (reset, hang, HTML page), [`after`] spoils an
//! admitted 200 (truncated body, no `usage`).

use std::sync::Mutex;
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::config::FaultMix;
use super::stats::bump;
use super::{Inner, MAX_BODY_BYTES};

/// One kind of injected fault; the order is [`FaultMix::shares`]'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Injected {
    Http500,
    Http503,
    Http529,
    Reset,
    Hang,
    Truncated,
    NonJson,
    NoUsage,
}

const KINDS: [Injected; 8] = [
    Injected::Http500,
    Injected::Http503,
    Injected::Http529,
    Injected::Reset,
    Injected::Hang,
    Injected::Truncated,
    Injected::NonJson,
    Injected::NoUsage,
];

impl Injected {
    /// The status of a 5xx kind, answered in the API's own error shape.
    pub(crate) fn status(self) -> Option<StatusCode> {
        match self {
            Self::Http500 => Some(StatusCode::INTERNAL_SERVER_ERROR),
            Self::Http503 => Some(StatusCode::SERVICE_UNAVAILABLE),
            Self::Http529 => StatusCode::from_u16(529).ok(),
            _ => None,
        }
    }
}

/// How many faults of each kind were injected (in `GET /mock/stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct InjectedFaults {
    pub http_500: u64,
    pub http_503: u64,
    pub http_529: u64,
    pub reset: u64,
    pub hang: u64,
    pub truncated: u64,
    pub non_json: u64,
    pub no_usage: u64,
}

impl InjectedFaults {
    /// All kinds together.
    pub fn total(&self) -> u64 {
        self.http_500
            + self.http_503
            + self.http_529
            + self.reset
            + self.hang
            + self.truncated
            + self.non_json
            + self.no_usage
    }

    /// Counts in [`Injected`] order.
    pub(crate) fn from_array(a: [u64; 8]) -> Self {
        Self {
            http_500: a[Injected::Http500 as usize],
            http_503: a[Injected::Http503 as usize],
            http_529: a[Injected::Http529 as usize],
            reset: a[Injected::Reset as usize],
            hang: a[Injected::Hang as usize],
            truncated: a[Injected::Truncated as usize],
            non_json: a[Injected::NonJson as usize],
            no_usage: a[Injected::NoUsage as usize],
        }
    }
}

/// The runtime side of a [`FaultMix`].
pub(crate) struct Mix {
    /// Cumulative shares, in [`KINDS`] order.
    bounds: [f64; 8],
    hang: Duration,
    /// Held for one draw, never across an await.
    rng: Mutex<StdRng>,
}

impl Mix {
    /// `None` when every share is 0: requests then skip the draw.
    pub(crate) fn new(config: &FaultMix) -> Option<Self> {
        let shares = config.shares();
        if shares.iter().all(|s| *s <= 0.0) {
            return None;
        }
        let mut bounds = [0.0; 8];
        let mut sum = 0.0;
        for (b, s) in bounds.iter_mut().zip(shares) {
            sum += s.max(0.0);
            *b = sum;
        }
        let hang_ms = if config.hang_ms == 0 {
            60_000
        } else {
            config.hang_ms
        };
        Some(Self {
            bounds,
            hang: Duration::from_millis(hang_ms),
            rng: Mutex::new(StdRng::seed_from_u64(config.seed)),
        })
    }

    /// The fault this request meets, if any.
    fn draw(&self) -> Option<Injected> {
        let x: f64 = match self.rng.lock() {
            Ok(mut rng) => rng.random(),
            Err(poisoned) => poisoned.into_inner().random(),
        };
        self.bounds.iter().position(|b| x < *b).map(|i| KINDS[i])
    }
}

/// What a request meets: a fault window's or the mix's 5xx status (answered in the API's
/// error shape), and the mix's fault, if any.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Drawn {
    pub status: Option<StatusCode>,
    pub fault: Option<Injected>,
}

impl Inner {
    /// A fault window first (as before the mix existed), else one draw from the mix,
    /// counted.
    pub(super) fn fault_or_inject(&self, project: usize) -> Drawn {
        if let Some(status) = self.fault(project) {
            return Drawn {
                status: Some(status),
                fault: None,
            };
        }
        let Some(fault) = self.mix.as_ref().and_then(Mix::draw) else {
            return Drawn::default();
        };
        bump(&self.totals.injected[fault as usize]);
        Drawn {
            status: fault.status(),
            fault: Some(fault),
        }
    }
}

/// Answers a request that met a reset, a hang or an HTML page instead of admitting it;
/// `None` lets it through.
pub(super) async fn before(inner: &Inner, fault: Option<Injected>) -> Option<Response> {
    match fault? {
        Injected::Reset => Some(reset()),
        Injected::Hang => {
            let hang = inner.mix.as_ref().map_or(Duration::ZERO, |m| m.hang);
            tokio::time::sleep(hang).await;
            Some(super::reply::base(
                StatusCode::GATEWAY_TIMEOUT,
                Body::empty(),
                "text/plain",
            ))
        }
        Injected::NonJson => Some(super::reply::base(
            StatusCode::OK,
            Body::from(HTML_PAGE),
            "text/html; charset=utf-8",
        )),
        _ => None,
    }
}

/// Spoils an admitted JSON 200 for the truncated and no-usage kinds; anything else
/// (errors, streams) passes unchanged.
pub(super) async fn after(fault: Option<Injected>, resp: Response) -> Response {
    let Some(fault @ (Injected::Truncated | Injected::NoUsage)) = fault else {
        return resp;
    };
    let is_json = resp.headers().get("content-type") == Some(&HeaderValue::from_static("application/json"));
    if resp.status() != StatusCode::OK || !is_json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        return Response::from_parts(parts, Body::empty());
    };
    let spoiled = match fault {
        Injected::Truncated => bytes.slice(..bytes.len() / 2).to_vec(),
        _ => without_usage(&bytes),
    };
    parts.headers.remove("content-length");
    Response::from_parts(parts, Body::from(spoiled))
}

/// The body with its top-level `usage` removed.
fn without_usage(bytes: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(mut v) => {
            if let Some(obj) = v.as_object_mut() {
                obj.remove("usage");
                obj.remove("usageMetadata");
            }
            serde_json::to_vec(&v).unwrap_or_else(|_| bytes.to_vec())
        }
        Err(_) => bytes.to_vec(),
    }
}

/// A response whose body fails before its first byte: hyper then closes the connection
/// without finishing the reply, which the client sees as a connection closed mid-message.
fn reset() -> Response {
    let failing = futures::stream::once(async {
        Err::<axum::body::Bytes, _>(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "mock fault: connection reset",
        ))
    });
    super::reply::base(StatusCode::OK, Body::from_stream(failing), "application/json")
}

const HTML_PAGE: &str = "<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n<body><center><h1>502 Bad Gateway</h1></center><hr><center>nginx</center></body></html>\n";
