//! Webhook delivery: the sender loop that drains the outbox (`webhook_deliveries`).
//!
//! At-least-once: a delivery is claimed with a lease (its `next_attempt_at` pushed ahead),
//! sent, and its outcome written guarded by its attempt number; a sender that dies
//! mid-attempt has the delivery sent again after the lease. Every attempt is signed per
//! Standard Webhooks (`webhook-id` constant across retries, `webhook-timestamp` of this
//! attempt, `webhook-signature: v1,<base64 HMAC-SHA256>`). Any 2xx is success; 410 Gone
//! disables the endpoint; everything else (redirects included — they are never followed)
//! is retried on the configured schedule with jitter, never before the receiver's
//! `Retry-After`, and fails after the last retry. URLs that resolve to private,
//! loopback, link-local or metadata addresses are refused (at connect time, so DNS
//! rebinding cannot sneak past) unless `webhooks.allow_private_addresses` is set.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use rand::Rng;
use secrecy::ExposeSecret;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tollgate::config::{Config, WebhooksConfig};
use tollgate::store::{self, Attempted, Delivery, EndpointSpec, StoreError};
use tollgate::webhook_signing::{HEADER_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP, Secret};

/// Longest `Retry-After` honoured: a receiver cannot park a delivery for longer.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Writes the config's tenant endpoints to the database (at start).
pub async fn sync_config_endpoints(pool: &PgPool, config: &Config) -> Result<(), StoreError> {
    let mut specs = Vec::new();
    for e in &config.webhooks.endpoints {
        // Validated at load; an unreadable secret here means the environment changed.
        let Ok(secret) = e.resolve_secret() else { continue };
        specs.push(EndpointSpec {
            tenant: e.tenant.clone(),
            url: e.url.clone(),
            secret: secret.expose_secret().to_owned(),
            events: e.event_types(),
        });
    }
    let mut tx = pool.begin().await?;
    store::sync_endpoints(&mut tx, &specs, Utc::now()).await?;
    tx.commit().await?;
    Ok(())
}

/// Whether an address is one a tenant's webhook must not reach: loopback, private,
/// link-local (cloud metadata services live there), shared, unspecified, multicast,
/// reserved, or an IPv6 form of one of those.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => internal_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return internal_v4(v4);
            }
            let s = v6.segments();
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local (fd00:ec2::254 is a metadata address)
                || (s[0] & 0xffc0) == 0xfe80 // link-local
                || (s[0] & 0xffc0) == 0xfec0 // site-local (deprecated)
                || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
                || (s[0] == 0x64 && s[1] == 0xff9b && internal_v4(embedded_v4(v6))) // NAT64
                || (s[..6] == [0; 6] && internal_v4(embedded_v4(v6))) // IPv4-compatible
        }
    }
}

fn embedded_v4(v6: Ipv6Addr) -> Ipv4Addr {
    let o = v6.octets();
    Ipv4Addr::new(o[12], o[13], o[14], o[15])
}

fn internal_v4(v4: Ipv4Addr) -> bool {
    let o = v4.octets();
    v4.is_private()
        || v4.is_loopback()
        || v4.is_link_local()
        || v4.is_unspecified()
        || v4.is_broadcast()
        || v4.is_multicast()
        || v4.is_documentation()
        || o[0] == 0
        || (o[0] == 100 && (o[1] & 0xc0) == 64) // shared address space (carrier NAT, some metadata)
        || (o[0] == 192 && o[1] == 0 && o[2] == 0) // IETF protocol assignments
        || (o[0] == 198 && (o[1] & 0xfe) == 18) // benchmarking
        || o[0] >= 240 // reserved
}

/// Why a webhook URL is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UrlRefused {
    #[error("the webhook URL is not a valid http(s) URL")]
    Invalid,
    #[error("the webhook URL's host does not resolve")]
    Unresolvable,
    #[error("the webhook URL resolves to a private, loopback or link-local address")]
    Internal,
}

/// Checks a webhook URL before it is accepted: http(s), resolvable, and — unless
/// `allow_internal` — not resolving to any internal address.
pub async fn check_url(url: &str, allow_internal: bool) -> Result<(), UrlRefused> {
    let parsed = reqwest::Url::parse(url).map_err(|_| UrlRefused::Invalid)?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(UrlRefused::Invalid);
    }
    let host = parsed.host_str().ok_or(UrlRefused::Invalid)?;
    let port = parsed.port_or_known_default().unwrap_or(443);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|_| UrlRefused::Unresolvable)?
        .collect();
    if addrs.is_empty() {
        return Err(UrlRefused::Unresolvable);
    }
    if !allow_internal && addrs.iter().any(|a| is_internal(a.ip())) {
        return Err(UrlRefused::Internal);
    }
    Ok(())
}

/// DNS for webhook requests: only public addresses come back, so a URL's host cannot
/// be pointed inside the network between the check and the connection.
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0))
                .await?
                .filter(|a| !is_internal(a.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(Box::new(std::io::Error::other(UrlRefused::Internal))
                    as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SendPass {
    pub delivered: u64,
    pub retried: u64,
    pub failed: u64,
    /// Endpoints disabled after a 410.
    pub disabled: u64,
}

#[derive(Clone)]
pub struct WebhookSender {
    pool: PgPool,
    config: Arc<WebhooksConfig>,
    http: reqwest::Client,
}

impl WebhookSender {
    pub fn new(pool: PgPool, config: &WebhooksConfig) -> Result<Self, reqwest::Error> {
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.timeout_secs))
            .connect_timeout(Duration::from_secs(config.timeout_secs.min(10)))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent("tollgate-webhooks");
        if !config.allow_private_addresses {
            builder = builder.dns_resolver(Arc::new(PublicOnly));
        }
        Ok(Self {
            pool,
            config: Arc::new(config.clone()),
            http: builder.build()?,
        })
    }

    /// Lease of a claimed delivery: the attempt's timeout plus a margin.
    fn lease(&self) -> Duration {
        Duration::from_secs(self.config.timeout_secs + 30)
    }

    /// Sends every delivery due at `now` (up to a few rounds of `concurrency`).
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<SendPass, StoreError> {
        let limit = (self.config.concurrency * 4) as i64;
        let claimed = store::claim_deliveries(&self.pool, now, limit, self.lease()).await?;
        let outcomes: Vec<(Delivery, Attempted)> = futures::stream::iter(claimed)
            .map(|d| async move {
                let outcome = self.attempt(&d).await;
                (d, outcome)
            })
            .buffer_unordered(self.config.concurrency)
            .collect()
            .await;
        let mut pass = SendPass::default();
        for (d, outcome) in outcomes {
            let mut tx = self.pool.begin().await?;
            let written = store::record_attempt(&mut tx, &d, &outcome, Utc::now()).await?;
            tx.commit().await?;
            if !written {
                continue;
            }
            match &outcome {
                Attempted::Delivered { .. } => pass.delivered += 1,
                Attempted::Retry { error, .. } => {
                    tracing::info!(delivery = %d.id, attempt = d.attempts, error = %error, "webhook attempt failed; will retry");
                    pass.retried += 1;
                }
                Attempted::Failed { error, .. } => {
                    tracing::warn!(delivery = %d.id, attempts = d.attempts, error = %error, "webhook delivery failed");
                    pass.failed += 1;
                }
                Attempted::Gone => {
                    tracing::warn!(
                        endpoint = d.endpoint_id,
                        "webhook endpoint answered 410; disabled"
                    );
                    pass.disabled += 1;
                }
            }
        }
        Ok(pass)
    }

    /// One signed POST and what it means for the delivery.
    async fn attempt(&self, d: &Delivery) -> Attempted {
        let secret = match Secret::parse(&d.secret) {
            Ok(s) => s,
            Err(e) => {
                return Attempted::Failed {
                    status: None,
                    error: format!("the endpoint's secret is unusable: {e}"),
                };
            }
        };
        if let Err(refused) = self.check_literal_host(&d.url) {
            return self.retry_or_fail(d, None, refused.to_string(), None);
        }
        let ts = Utc::now().timestamp();
        let sent = self
            .http
            .post(&d.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(HEADER_ID, &d.id)
            .header(HEADER_TIMESTAMP, ts.to_string())
            .header(HEADER_SIGNATURE, secret.sign(&d.id, ts, d.body.as_bytes()))
            .body(d.body.clone())
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_success() => Attempted::Delivered {
                status: i32::from(r.status().as_u16()),
            },
            Ok(r) if r.status() == reqwest::StatusCode::GONE => Attempted::Gone,
            Ok(r) => {
                let status = r.status().as_u16();
                let after = tollgate::ratelimit::retry_after(r.headers(), chrono::Utc::now())
                    .map(|a| a.min(MAX_RETRY_AFTER));
                self.retry_or_fail(
                    d,
                    Some(i32::from(status)),
                    format!("the receiver answered {status}"),
                    after,
                )
            }
            Err(e) => self.retry_or_fail(d, None, format!("the request failed: {e}"), None),
        }
    }

    /// Hosts written as IP literals skip DNS, so the resolver's guard does not see them.
    fn check_literal_host(&self, url: &str) -> Result<(), UrlRefused> {
        let parsed = reqwest::Url::parse(url).map_err(|_| UrlRefused::Invalid)?;
        let ip = match parsed.host() {
            Some(url::Host::Ipv4(v4)) => IpAddr::V4(v4),
            Some(url::Host::Ipv6(v6)) => IpAddr::V6(v6),
            Some(url::Host::Domain(_)) => return Ok(()),
            None => return Err(UrlRefused::Invalid),
        };
        if !self.config.allow_private_addresses && is_internal(ip) {
            return Err(UrlRefused::Internal);
        }
        Ok(())
    }

    fn retry_or_fail(
        &self,
        d: &Delivery,
        status: Option<i32>,
        error: String,
        retry_after: Option<Duration>,
    ) -> Attempted {
        match next_delay(&self.config, d.attempts, retry_after) {
            Some(delay) => Attempted::Retry {
                at: Utc::now() + delay,
                status,
                error,
            },
            None => Attempted::Failed { status, error },
        }
    }

    pub async fn run(self, cancel: CancellationToken) {
        let idle = Duration::from_millis(self.config.poll_interval_ms);
        loop {
            let busy = match self.run_once(Utc::now()).await {
                Ok(p) => p.delivered + p.retried + p.failed + p.disabled > 0,
                Err(e) => {
                    tracing::warn!(error = %e, "webhook pass failed");
                    false
                }
            };
            if busy {
                if cancel.is_cancelled() {
                    return;
                }
                continue;
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(idle) => {}
            }
        }
    }
}

/// The delay before the retry that follows attempt `attempts_done`, or `None` when the
/// schedule is exhausted. Jitter adds up to `jitter` of the delay; a `Retry-After`
/// is a lower bound.
pub fn next_delay(
    config: &WebhooksConfig,
    attempts_done: i32,
    retry_after: Option<Duration>,
) -> Option<chrono::Duration> {
    let index = usize::try_from(attempts_done).ok()?.checked_sub(1)?;
    let base = Duration::from_secs(*config.retry_schedule_secs.get(index)?);
    let jitter = base.mul_f64(rand::rng().random_range(0.0..=config.jitter));
    let delay = (base + jitter).max(retry_after.unwrap_or_default());
    chrono::Duration::from_std(delay).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_addresses() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.100.100.200",
            "0.0.0.0",
            "::1",
            "fd00:ec2::254",
            "fe80::1",
            "::ffff:127.0.0.1",
            "64:ff9b::a00:1",
        ] {
            assert!(is_internal(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"] {
            assert!(!is_internal(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn schedule_then_give_up() {
        let config = WebhooksConfig {
            jitter: 0.0,
            ..WebhooksConfig::default()
        };
        let secs = |n, after| next_delay(&config, n, after).map(|d| d.num_seconds());
        assert_eq!(secs(1, None), Some(5));
        assert_eq!(secs(2, None), Some(300));
        assert_eq!(secs(7, None), Some(36_000));
        assert_eq!(secs(8, None), None, "after the last retry the delivery fails");
        assert_eq!(
            secs(1, Some(Duration::from_secs(60))),
            Some(60),
            "Retry-After is a floor"
        );
        assert_eq!(secs(2, Some(Duration::from_secs(60))), Some(300));
        let jittery = WebhooksConfig::default();
        let d = next_delay(&jittery, 2, None).unwrap().num_milliseconds();
        assert!((300_000..=330_000).contains(&d), "{d}");
    }

    #[tokio::test]
    async fn urls_are_checked() {
        assert_eq!(
            check_url("ftp://example.com/x", true).await,
            Err(UrlRefused::Invalid)
        );
        assert_eq!(check_url("not a url", true).await, Err(UrlRefused::Invalid));
        assert_eq!(
            check_url("http://127.0.0.1:9/hook", false).await,
            Err(UrlRefused::Internal)
        );
        assert_eq!(
            check_url("http://[::1]:9/hook", false).await,
            Err(UrlRefused::Internal)
        );
        assert_eq!(
            check_url("http://169.254.169.254/latest", false).await,
            Err(UrlRefused::Internal)
        );
        assert_eq!(
            check_url("http://localhost:9/hook", false).await,
            Err(UrlRefused::Internal)
        );
        assert_eq!(check_url("http://127.0.0.1:9/hook", true).await, Ok(()));
    }

    #[test]
    fn ipv6_forms_of_internal_addresses_are_internal() {
        for ip in [
            "::",                     // unspecified
            "::ffff:169.254.169.254", // mapped metadata address
            "::ffff:10.0.0.1",        // mapped private
            "::169.254.169.254",      // IPv4-compatible metadata address
            "fc00::1",                // unique local
            "fdff:ffff::1",           // unique local, top of the range
            "fe80::a9fe:a9fe",        // link-local
            "ff02::1",                // multicast
            "64:ff9b::a9fe:a9fe",     // NAT64 of 169.254.169.254
            "100.64.0.1",             // shared address space
            "255.255.255.255",        // broadcast
        ] {
            assert!(is_internal(ip.parse().unwrap()), "{ip}");
        }
        assert!(
            !is_internal("64:ff9b::808:808".parse().unwrap()),
            "NAT64 of a public address"
        );
    }

    #[tokio::test]
    async fn metadata_and_ipv6_internal_urls_are_refused_unless_allowed() {
        for url in [
            "http://169.254.169.254/latest/meta-data/",
            "http://[fd00:ec2::254]/latest",
            "http://[::ffff:127.0.0.1]:9/hook",
            "http://[::ffff:a9fe:a9fe]/latest",
            "http://10.0.0.1/hook",
            "http://0.0.0.0:9/hook",
        ] {
            assert_eq!(check_url(url, false).await, Err(UrlRefused::Internal), "{url}");
            assert_eq!(
                check_url(url, true).await,
                Ok(()),
                "{url} with allow_private_addresses"
            );
        }
    }

    #[tokio::test]
    async fn redirects_are_not_followed_and_names_resolving_inside_are_refused() {
        use futures::FutureExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let allowing = WebhooksConfig {
            allow_private_addresses: true,
            ..WebhooksConfig::default()
        };
        let sender = WebhookSender::new(pool.clone(), &allowing).unwrap();
        let first = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let second = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let elsewhere = second.local_addr().unwrap();
        let receiver = async {
            let (mut conn, _) = first.accept().await.unwrap();
            let mut buf = vec![0u8; 8192];
            let _ = conn.read(&mut buf).await.unwrap();
            let reply = format!(
                "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://{elsewhere}/stolen\r\n\
                 content-length: 0\r\nconnection: close\r\n\r\n"
            );
            conn.write_all(reply.as_bytes()).await.unwrap();
        };
        let url = format!("http://{}/hook", first.local_addr().unwrap());
        let (_, answered) = tokio::join!(receiver, sender.http.post(&url).body("{}").send());
        assert_eq!(
            answered.unwrap().status().as_u16(),
            307,
            "the redirect is the answer"
        );
        assert!(
            second.accept().now_or_never().is_none(),
            "the redirect was followed"
        );

        // Guarded (the default): a name resolving to loopback never gets a connection.
        let guarded = WebhookSender::new(pool, &WebhooksConfig::default()).unwrap();
        let refused = guarded
            .http
            .post(format!("http://localhost:{}/hook", elsewhere.port()))
            .body("{}")
            .send()
            .await;
        assert!(refused.is_err(), "{refused:?}");
        assert!(
            second.accept().now_or_never().is_none(),
            "the guard let a connection through"
        );
    }
}
