//! The HTTP server under the router: accepting connections, and what a connection may
//! cost before any handler runs.
//!
//! `axum::serve` installs no timer, so hyper's header-read timeout never fires and a
//! client that sends half a request line (slowloris) or keeps an idle keep-alive
//! connection holds a task and a descriptor for ever. This loop serves HTTP/1.1 with:
//!
//! - a timer and `server.header_timeout_secs`: the time a client has to send a request's
//!   headers, counted from the connection's start and from the end of each response, so
//!   it bounds idle keep-alive connections too;
//! - `server.body_idle_timeout_secs`: the longest pause while a request body arrives
//!   (the handler sees a body error, answered 408 `request_timeout`);
//! - `server.max_connections`: connections served at once; one more is answered
//!   `503` with `Retry-After` and closed, so the process's descriptors and memory stay
//!   bounded whoever connects;
//! - `server.max_connections_per_source`: connections one source (an IPv4 address, an
//!   IPv6 /64: [`source_of`]) may hold at once, answered the same way past it — after a
//!   second, so a reconnecting loop is refused a few times a second, not at line rate —
//!   so one host cannot take every connection from the others;
//! - the peer's address on every request ([`axum::extract::ConnectInfo`]), for the guard's
//!   per-source throttle.
//!
//! Shutdown: stop accepting, let each connection finish its request in flight (idle ones
//! close at once), then return.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// What one connection may cost; from `server.*`.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_timeout: Duration,
    pub body_idle_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_source: usize,
}

impl ConnectionLimits {
    pub fn from_config(server: &tollgate::config::ServerConfig) -> Self {
        Self {
            header_timeout: Duration::from_secs(server.header_timeout_secs),
            body_idle_timeout: Duration::from_secs(server.body_idle_timeout_secs),
            max_connections: server.max_connections,
            max_connections_per_source: server.max_connections_per_source,
        }
    }
}

/// How long a connection refused for its source waits for its answer.
const SOURCE_REFUSAL_HOLD: Duration = Duration::from_secs(1);
/// Refusals held at once; past it a refusal is answered at once, so holding them cannot
/// take the process's descriptors.
const MAX_HELD_REFUSALS: usize = 1024;

/// The body of the answer to a connection beyond `max_connections`.
const BUSY_BODY: &str = r#"{"error":{"message":"the server holds as many connections as it serves (server.max_connections); retry shortly","type":"server_error","param":null,"code":"server_busy"}}"#;

/// The whole answer to a connection beyond `max_connections`, written before closing it.
fn busy_response() -> String {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{BUSY_BODY}",
        BUSY_BODY.len()
    )
}

/// Serves `app` on `listener` until `stop` is cancelled, then drains.
pub async fn serve(listener: TcpListener, app: Router, limits: ConnectionLimits, stop: CancellationToken) {
    let app = app.layer(RequestBodyTimeoutLayer::new(limits.body_idle_timeout));
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let sources = SourceSlots::new(limits.max_connections_per_source);
    let held_refusals = Arc::new(Semaphore::new(MAX_HELD_REFUSALS));
    let graceful = GracefulShutdown::new();
    let connections = TaskTracker::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and the like: the listener stays good; give the process a moment.
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            connections.spawn(refuse_busy(stream));
            continue;
        };
        let Some(source_slot) = sources.take(source_of(peer)) else {
            // Held a second before the answer, so a source that reconnects in a loop is
            // refused a few times a second per connection, not at line rate.
            let hold = held_refusals.clone().try_acquire_owned().ok();
            let stop = stop.clone();
            connections.spawn(async move {
                if hold.is_some() {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = tokio::time::sleep(SOURCE_REFUSAL_HOLD) => {}
                    }
                }
                refuse_busy(stream).await;
            });
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = app
            .clone()
            .map_request(move |mut request: axum::http::Request<Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                request
            });
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let connection = graceful.watch(connection);
        connections.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop((slot, source_slot));
        });
    }
    drop(listener);
    connections.close();
    graceful.shutdown().await;
    connections.wait().await;
}

async fn refuse_busy(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(busy_response().as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// The connections each source holds, up to a limit per source.
#[derive(Clone)]
struct SourceSlots {
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
    per_source: usize,
}

/// One connection's place in its source's count, given back when dropped.
struct SourceSlot {
    slots: SourceSlots,
    source: IpAddr,
}

impl SourceSlots {
    fn new(per_source: usize) -> Self {
        Self {
            held: Arc::default(),
            per_source,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A slot for one more connection from `source`, or None when it holds its limit.
    fn take(&self, source: IpAddr) -> Option<SourceSlot> {
        let mut held = self.held();
        let count = held.entry(source).or_insert(0);
        if *count >= self.per_source {
            return None;
        }
        *count += 1;
        Some(SourceSlot {
            slots: self.clone(),
            source,
        })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut held = self.slots.held();
        if let Some(count) = held.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.source);
            }
        }
    }
}

/// The source a request came from, as the guard throttles it: the peer's IPv4 address,
/// or the /64 network of an IPv6 one (one host usually holds a whole /64).
pub fn source_of(peer: SocketAddr) -> std::net::IpAddr {
    match peer.ip() {
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.into(),
            None => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                std::net::Ipv6Addr::from(bits).into()
            }
        },
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_answer_is_well_formed() {
        let text = busy_response();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(length, body.len());
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "server_busy");
    }

    #[test]
    fn a_source_holds_its_limit_of_connections_and_gets_them_back() {
        let slots = SourceSlots::new(2);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let first = slots.take(a).unwrap();
        let _second = slots.take(a).unwrap();
        assert!(slots.take(a).is_none(), "a third connection from one source");
        assert!(
            slots.take(b).is_some(),
            "another source is not limited by the first"
        );
        drop(first);
        assert!(slots.take(a).is_some(), "a closed connection gives its slot back");
    }

    #[test]
    fn an_ipv6_host_is_one_source_per_64() {
        let a: SocketAddr = "[2001:db8:1:2:aaaa::1]:1".parse().unwrap();
        let b: SocketAddr = "[2001:db8:1:2:bbbb::9]:2".parse().unwrap();
        let c: SocketAddr = "[2001:db8:1:3::1]:3".parse().unwrap();
        assert_eq!(source_of(a), source_of(b));
        assert_ne!(source_of(a), source_of(c));
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:4".parse().unwrap();
        assert_eq!(source_of(mapped), "10.0.0.1".parse::<std::net::IpAddr>().unwrap());
    }
}
