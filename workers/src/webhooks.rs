//! Webhook delivery: the sender that drains the outbox (`webhook_deliveries`), and the sync
//! of the config's tenant endpoints at start.
//!
//! At least once, one lease per attempt: the sender claims only as many deliveries as it
//! has free slots (`webhooks.concurrency`), each leased for its own timeout plus a margin,
//! starts each at once, cuts it at its timeout and writes its outcome as soon as it ends,
//! guarded by its attempt number; a sender that dies mid-attempt has the delivery sent
//! again after the lease. The claim keeps at most `webhooks.endpoint_concurrency`
//! deliveries in flight per endpoint and `webhooks.tenant_concurrency` per tenant, over
//! every process, and hands out turns round-robin, so a slow or dead receiver holds its
//! own few slots and every other tenant's deliveries go on (see
//! [`store::claim_deliveries`]).
//!
//! Every attempt is signed per Standard Webhooks (`webhook-id` constant across retries,
//! `webhook-timestamp` of this attempt, `webhook-signature: v1,<base64 HMAC-SHA256>`) with
//! the endpoint's secret, opened from its sealed form with the server's webhook key
//! ([`tollgate::webhook_secrets`]). Any 2xx is success; 410 Gone disables the endpoint;
//! everything else (redirects included — they are never followed) is retried on the
//! configured schedule with jitter, never before the receiver's `Retry-After`, and fails
//! after the last retry. An endpoint whose attempts fail for `webhooks.disable_after_secs`
//! and `disable_after_failures` in a row is disabled, the reason recorded.
//!
//! URLs that resolve to internal addresses ([`is_internal`]) are refused — at connect time
//! by the client's resolver, so DNS rebinding cannot sneak past, and no proxy from the
//! environment is used, since a proxy would resolve the host itself — unless
//! `webhooks.allow_private_addresses` is set.

mod addresses;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use rand::Rng;
use secrecy::ExposeSecret;
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::clock::Clock;
use tollgate::config::{Config, WebhooksConfig};
use tollgate::store::{
    self, Attempted, ClaimLimits, Delivery, DisableRule, EndpointSpec, Recorded, StoreError,
};
use tollgate::webhook_secrets::{KeyError, OpenError, SealingKey};
use tollgate::webhook_signing::{HEADER_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP, Secret};

pub use addresses::is_internal;

/// Longest `Retry-After` honoured: a receiver cannot park a delivery for longer.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// What a delivery's lease adds to its attempt's timeout: time to write the outcome.
const LEASE_MARGIN: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum WebhooksError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the webhook HTTP client: {0}")]
    Http(#[from] reqwest::Error),
}

impl From<sqlx::Error> for WebhooksError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

/// Writes the config's tenant endpoints to the database (at start), their secrets sealed;
/// seals secrets stored before sealing existed; and says — in the log — which endpoints
/// are disabled and whether the database holds secrets sealed with another key.
///
/// Additive: an endpoint this config does not name is left as it is, with its pending
/// deliveries (another process may run a config that names it); one it marks `retired`
/// gets nothing more queued, and what is pending for it is still delivered.
pub async fn sync_config_endpoints(pool: &PgPool, config: &Config) -> Result<(), WebhooksError> {
    let key = config.webhooks.sealing_key()?;
    let mut specs = Vec::new();
    for e in &config.webhooks.endpoints {
        // Validated at load; an unreadable secret here means the environment changed.
        let Ok(secret) = e.resolve_secret() else {
            tracing::warn!(tenant = %e.tenant, url = %e.url, "webhook endpoint's secret is unreadable; not synced");
            continue;
        };
        specs.push(EndpointSpec {
            tenant: e.tenant.clone(),
            url: e.url.clone(),
            secret: key.seal(&e.tenant, secret.expose_secret()),
            events: e.event_types(),
            retired: e.retired,
            reenable: e.reenable,
        });
    }
    let mut tx = pool.begin().await?;
    let synced = store::sync_endpoints(&mut tx, &specs, Utc::now()).await?;
    tx.commit().await?;
    if synced.reenabled > 0 {
        tracing::info!(
            endpoints = synced.reenabled,
            "disabled webhook endpoints enabled again (`reenable`)"
        );
    }
    let mut sealed = 0;
    for row in store::unsealed_secrets(pool).await? {
        let sealed_now = key.seal(&row.tenant, row.secret.as_str());
        sealed += u64::from(store::seal_secret(pool, row.id, &row.secret, &sealed_now).await?);
    }
    if sealed > 0 {
        tracing::info!(
            endpoints = sealed,
            key = key.id(),
            "sealed webhook secrets stored as they were"
        );
    }
    let others: Vec<String> = store::sealing_key_ids(pool)
        .await?
        .into_iter()
        .filter(|(id, _)| id != key.id())
        .map(|(id, n)| format!("{n} with key {id}"))
        .collect();
    if !others.is_empty() {
        tracing::error!(
            key = key.id(),
            others = others.join(", "),
            "webhook secrets in the database are sealed with another key than this process's: \
             its deliveries to those endpoints fail; give every process the same \
             `webhooks.secret_key_file` contents or `secret_key_env`"
        );
    }
    for e in store::disabled_endpoints(pool, true).await? {
        tracing::warn!(
            endpoint = e.id,
            tenant = %e.tenant,
            url = %e.url,
            since = %e.disabled_at,
            reason = e.disabled_reason.as_deref().unwrap_or("not recorded"),
            "webhook endpoint disabled: nothing is sent to it; `reenable = true` on its \
             [[webhooks.endpoints]] entry enables it again at the next start"
        );
    }
    Ok(())
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

#[derive(Clone)]
pub struct WebhookSender {
    pool: PgPool,
    /// The time delivery leases and retries are reckoned in (a broker's: the database's).
    clock: Clock,
    config: Arc<WebhooksConfig>,
    key: SealingKey,
    http: reqwest::Client,
}

impl WebhookSender {
    pub fn new(pool: PgPool, config: &WebhooksConfig) -> Result<Self, WebhooksError> {
        let timeout = Duration::from_secs(config.timeout_secs);
        let mut builder = reqwest::Client::builder()
            // A proxy from the environment would resolve the URL's host itself, past the
            // resolver below.
            .no_proxy()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent("tollgate-webhooks");
        if !config.allow_private_addresses {
            builder = builder.dns_resolver(Arc::new(PublicOnly));
        }
        Ok(Self {
            pool,
            clock: Clock::system(),
            key: config.sealing_key()?.clone(),
            config: Arc::new(config.clone()),
            http: builder.build()?,
        })
    }

    /// Reckons time by `clock` (a broker's: the database's).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    fn attempt_timeout(&self) -> Duration {
        Duration::from_secs(self.config.timeout_secs)
    }

    /// A claimed delivery's lease: its attempt's timeout and the time to write the outcome.
    /// An attempt starts as soon as it is claimed (a claim takes no more deliveries than
    /// there are free slots) and is cut at its timeout, so it cannot outlive its lease.
    fn lease(&self) -> Duration {
        self.attempt_timeout() + LEASE_MARGIN
    }

    fn limits(&self, slots: usize) -> ClaimLimits {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        ClaimLimits {
            slots: count(slots),
            per_endpoint: count(self.config.endpoint_concurrency),
            per_tenant: count(self.config.tenant_concurrency),
        }
    }

    fn disable_rule(&self) -> DisableRule {
        DisableRule {
            failures: self.config.disable_after_failures,
            after: chrono::Duration::seconds(
                i64::try_from(self.config.disable_after_secs).unwrap_or(i64::MAX),
            ),
        }
    }

    /// Claims due deliveries into the free slots whenever one frees (or every
    /// `poll_interval_ms`), each sent and recorded on its own. On cancel, attempts in
    /// flight are given back untried and the sender returns.
    pub async fn run(self, cancel: CancellationToken) {
        let slots = Arc::new(Semaphore::new(self.config.concurrency));
        let finished = Arc::new(Notify::new());
        let deliveries = TaskTracker::new();
        let idle = Duration::from_millis(self.config.poll_interval_ms);
        while !cancel.is_cancelled() {
            let free = slots.available_permits();
            if free > 0
                && let Ok(mut held) = slots
                    .clone()
                    .try_acquire_many_owned(free.try_into().unwrap_or(u32::MAX))
            {
                match store::claim_deliveries(&self.pool, self.clock.now(), self.limits(free), self.lease())
                    .await
                {
                    Ok(claimed) => {
                        for d in claimed {
                            let Some(slot) = held.split(1) else {
                                // Never: the claim took no more than the slots held.
                                let _ = store::release_delivery(&self.pool, &d, self.clock.now()).await;
                                continue;
                            };
                            let (sender, finished, cancel) = (self.clone(), finished.clone(), cancel.clone());
                            deliveries.spawn(async move {
                                sender.deliver(d, &cancel).await;
                                drop(slot);
                                finished.notify_one();
                            });
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "claiming webhook deliveries failed"),
                }
            }
            tokio::select! {
                () = cancel.cancelled() => break,
                () = finished.notified() => {}
                () = tokio::time::sleep(idle) => {}
            }
        }
        deliveries.close();
        deliveries.wait().await;
    }

    /// One delivery's attempt, its outcome written as soon as it is known.
    async fn deliver(&self, d: Delivery, cancel: &CancellationToken) {
        let outcome = tokio::select! {
            outcome = self.attempt(&d) => outcome,
            () = cancel.cancelled() => {
                if let Err(e) = store::release_delivery(&self.pool, &d, self.clock.now()).await {
                    tracing::info!(delivery = %d.id, error = %e, "webhook delivery not given back; it is sent again after its lease");
                }
                return;
            }
        };
        let recorded = async {
            let mut tx = self.pool.begin().await?;
            let recorded =
                store::record_attempt(&mut tx, &d, &outcome, self.disable_rule(), self.clock.now()).await?;
            tx.commit().await?;
            Ok::<_, StoreError>(recorded)
        }
        .await;
        match recorded {
            Ok(recorded) => log_outcome(&d, &outcome, &recorded),
            Err(e) => tracing::warn!(
                delivery = %d.id,
                error = %e,
                "writing a webhook attempt failed; the delivery is sent again after its lease"
            ),
        }
    }

    /// One signed POST and what it means for the delivery.
    async fn attempt(&self, d: &Delivery) -> Attempted {
        if let Some(reason) = &d.disabled_reason {
            return Attempted::Failed {
                status: None,
                error: format!("the endpoint was disabled: {reason}"),
                receiver: false,
            };
        }
        let secret = match self.key.open(&d.tenant, &d.secret) {
            Ok(secret) => secret,
            // Another process, holding the key that sealed it, may still deliver it.
            Err(e @ OpenError::OtherKey { .. }) => {
                return self.retry_or_fail(d, None, e.to_string(), None, false);
            }
            Err(e) => {
                return Attempted::Failed {
                    status: None,
                    error: e.to_string(),
                    receiver: false,
                };
            }
        };
        if let Err(refused) = self.check_literal_host(&d.url) {
            return self.retry_or_fail(d, None, refused.to_string(), None, true);
        }
        match tokio::time::timeout(self.attempt_timeout(), self.post(d, &secret)).await {
            Ok(outcome) => outcome,
            Err(_) => self.retry_or_fail(d, None, "the attempt timed out".to_owned(), None, true),
        }
    }

    async fn post(&self, d: &Delivery, secret: &Secret) -> Attempted {
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
                    true,
                )
            }
            Err(e) => self.retry_or_fail(d, None, format!("the request failed: {e}"), None, true),
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
        receiver: bool,
    ) -> Attempted {
        match next_delay(&self.config, d.attempts, retry_after) {
            Some(delay) => Attempted::Retry {
                at: self.clock.now() + delay,
                status,
                error,
                receiver,
            },
            None => Attempted::Failed {
                status,
                error,
                receiver,
            },
        }
    }
}

fn log_outcome(d: &Delivery, outcome: &Attempted, recorded: &Recorded) {
    if !recorded.written {
        return;
    }
    match outcome {
        Attempted::Delivered { .. } => {}
        Attempted::Retry { error, .. } => {
            tracing::info!(delivery = %d.id, attempt = d.attempts, error = %error, "webhook attempt failed; will retry");
        }
        Attempted::Failed { error, .. } => {
            tracing::warn!(delivery = %d.id, attempts = d.attempts, error = %error, "webhook delivery failed");
        }
        Attempted::Gone => {}
    }
    if let Some(reason) = &recorded.disabled {
        tracing::warn!(
            endpoint = d.endpoint_id,
            tenant = %d.tenant,
            reason = %reason,
            "webhook endpoint disabled: its pending deliveries failed and nothing more is queued for it"
        );
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
        let mut config = WebhooksConfig::default();
        config.jitter = 0.0;
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

    /// A config whose sealing key lives in a temporary directory.
    fn keyed_config(dir: &tempfile::TempDir) -> WebhooksConfig {
        let mut config = WebhooksConfig::default();
        config.secret_key_file = dir.path().join("webhook-secret.key");
        config
    }

    fn no_database() -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap()
    }

    #[tokio::test]
    async fn redirects_are_not_followed_and_names_resolving_inside_are_refused() {
        use futures::FutureExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let dir = tempfile::tempdir().unwrap();
        let pool = no_database();
        let mut allowing = keyed_config(&dir);
        allowing.allow_private_addresses = true;
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
        let guarded = WebhookSender::new(pool, &keyed_config(&dir)).unwrap();
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

    /// Set in the child of [`a_proxy_in_the_environment_is_not_used`]: the address of the
    /// proxy its environment names.
    const PROXY_PROBE: &str = "TOLLGATE_TEST_WEBHOOK_PROXY_PROBE";

    /// The sender ignores `HTTP_PROXY`, `HTTPS_PROXY` and `ALL_PROXY`: a proxy would resolve
    /// the host itself, past the resolver that refuses internal addresses. The environment
    /// is set for a child (this test binary, running only this test), as a process's own
    /// environment cannot be changed safely while other tests run: the child sends to its
    /// receiver and must get the receiver's answer, and the proxy must see no connection.
    #[tokio::test]
    async fn a_proxy_in_the_environment_is_not_used() {
        use futures::FutureExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        if std::env::var(PROXY_PROBE).is_ok() {
            let receiver = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/hook", receiver.local_addr().unwrap());
            let serve = async {
                let (mut conn, _) = receiver.accept().await.unwrap();
                let mut buf = vec![0u8; 8192];
                let _ = conn.read(&mut buf).await.unwrap();
                conn.write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
                    .await
                    .unwrap();
            };
            let dir = tempfile::tempdir().unwrap();
            let mut config = keyed_config(&dir);
            config.allow_private_addresses = true;
            config.timeout_secs = 5;
            let sender = WebhookSender::new(no_database(), &config).unwrap();
            let answered = tokio::select! {
                answered = sender.http.post(&url).body("{}").send() => answered,
                () = async { serve.await; std::future::pending().await } => unreachable!(),
            };
            assert_eq!(
                answered.unwrap().status().as_u16(),
                204,
                "the receiver answered, not a proxy"
            );
            return;
        }
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap());
        child
            .args([
                "--exact",
                "webhooks::tests::a_proxy_in_the_environment_is_not_used",
            ])
            .env(PROXY_PROBE, &proxy_url)
            .env_remove("NO_PROXY")
            .env_remove("no_proxy");
        for var in [
            "HTTP_PROXY",
            "http_proxy",
            "HTTPS_PROXY",
            "https_proxy",
            "ALL_PROXY",
            "all_proxy",
        ] {
            child.env(var, &proxy_url);
        }
        let out = child.output().await.unwrap();
        let printed = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && printed.contains("1 passed"),
            "the child: {printed}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            proxy.accept().now_or_never().is_none(),
            "the request went through the proxy"
        );
    }
}
