//! Webhooks: a receiver that is down for a while gets every event once it is up, each
//! signed so that an independent Standard Webhooks implementation (the `standardwebhooks`
//! Python package) verifies it; a receiver answering 410 Gone has its endpoint disabled,
//! and so has one failing for long enough, until a config enables it again. A hanging
//! receiver holds only its endpoint's and its tenant's share of the senders, over two
//! processes, while another tenant's events are delivered; secrets are sealed at rest;
//! a sync from an older config removes nothing, and retiring an endpoint loses nothing
//! pending.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::webhook_signing::Secret;

use crate::batches::{batch_body, create_batch, line, upload, wait_batch};
use crate::durability::free_port;
use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, eventually, job};
use tollgate_api::broker::Roles;

/// What the receiver got: (path, webhook headers, body).
type Received = Arc<Mutex<Vec<(String, HashMap<String, String>, String)>>>;

/// The test's receivers: served until [`Receivers::stop`].
#[derive(Default)]
struct Receivers {
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl Receivers {
    fn serve(&self, listener: tokio::net::TcpListener, app: Router) {
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
                .unwrap();
        });
    }

    /// A listener on a free port, and the port.
    async fn listen() -> (tokio::net::TcpListener, u16) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        (listener, port)
    }

    async fn stop(self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// A webhook receiver on `port`: `/hook` and `/batch-hook` answer 204, `/gone` 410.
async fn start_receiver(port: u16, received: Received, receivers: &Receivers) {
    let record = |path: &'static str, status: StatusCode| {
        let received = received.clone();
        post(move |headers: HeaderMap, body: String| async move {
            let hooks = headers
                .iter()
                .filter(|(k, _)| k.as_str().starts_with("webhook-"))
                .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap().to_owned()))
                .collect();
            received.lock().unwrap().push((path.to_owned(), hooks, body));
            status
        })
    };
    let app = Router::new()
        .route("/hook", record("/hook", StatusCode::NO_CONTENT))
        .route("/batch-hook", record("/batch-hook", StatusCode::NO_CONTENT))
        .route("/gone", record("/gone", StatusCode::GONE));
    let listener = eventually(30, "the receiver's port to be free", || async {
        tokio::net::TcpListener::bind(("127.0.0.1", port)).await.ok()
    })
    .await;
    receivers.serve(listener, app);
}

async fn deliveries(app: &TestApp) -> Vec<(String, String, String, String, i32)> {
    sqlx::query_as(
        "SELECT d.id, e.url, d.event_type, d.state, d.attempts FROM webhook_deliveries d
         JOIN webhook_endpoints e ON e.id = d.endpoint_id ORDER BY d.created_at, d.id",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_receiver_that_was_down_gets_every_event_signed() {
    let port = free_port(); // nothing listens there yet: the receiver is down
    let (tenant_secret, batch_secret) = (Secret::generate(), Secret::generate());
    let app = TestApp::spawn_with(TestOptions {
        extra_config: format!(
            r#"
[[providers]]
name = "down"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
keys = [{{ name = "d", value = "sk-none" }}]
models = ["gpt-4o-mini"]
[webhooks]
allow_private_addresses = true
retry_schedule_secs = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
jitter = 0.0
poll_interval_ms = 100
[[webhooks.endpoints]]
tenant = "acme"
url = "http://127.0.0.1:{port}/hook"
secret = "{tenant_secret}"
[[webhooks.endpoints]]
tenant = "globex"
url = "http://127.0.0.1:{port}/gone"
secret = "{tenant_secret}"
events = ["job.completed"]
"#
        ),
        ..TestOptions::default()
    })
    .await;
    let http = &app.http;
    // Three lines that succeed, one whose provider is unreachable (job.failed).
    let text = [
        line("a", "fast", "one"),
        line("b", "fast", "two"),
        line("c", "oai/gpt-4o-mini", "three"),
        line("d", "down/gpt-4o-mini", "four"),
    ]
    .join("\n");
    let (_, file) = upload(http, &app.api, ACME, text.as_bytes()).await;
    let mut body = batch_body(file["id"].as_str().unwrap());
    body["webhook"] = json!({
        "url": format!("http://127.0.0.1:{port}/batch-hook"),
        "secret": batch_secret,
        "events": ["batch.completed"],
    });
    let (status, batch) = create_batch(http, &app.api, ACME, &body).await;
    assert_eq!(status, 200, "{batch}");
    let done = wait_batch(http, &app.api, ACME, batch["id"].as_str().unwrap(), 120).await;
    assert_eq!(
        done["request_counts"],
        json!({"total": 4, "completed": 3, "failed": 1}),
        "{done}"
    );
    let (_, single) = app.submit(GLOBEX, &job("fast", "to a gone receiver")).await;
    app.wait_job(GLOBEX, single["id"].as_str().unwrap(), 30).await;

    // The receiver is down: deliveries are retried, not lost.
    eventually(60, "deliveries to be retried", || async {
        let d = deliveries(&app).await;
        (d.len() == 7 && d.iter().all(|d| d.3 == "pending" && d.4 >= 2)).then_some(())
    })
    .await;

    let received: Received = Arc::default();
    let receivers = Receivers::default();
    start_receiver(port, received.clone(), &receivers).await;
    let settled = eventually(60, "every delivery to settle", || async {
        let d = deliveries(&app).await;
        d.iter().all(|d| d.3 != "pending").then_some(d)
    })
    .await;

    // Every event arrived: 3 job.completed, 1 job.failed and batch.completed to the
    // tenant's endpoint, batch.completed to the batch's own.
    let mut events: Vec<(&str, &str)> = settled
        .iter()
        .filter(|d| !d.1.ends_with("/gone"))
        .map(|d| (d.1.rsplit('/').next().unwrap(), d.2.as_str()))
        .collect();
    events.sort();
    assert_eq!(
        events,
        vec![
            ("batch-hook", "batch.completed"),
            ("hook", "batch.completed"),
            ("hook", "job.completed"),
            ("hook", "job.completed"),
            ("hook", "job.completed"),
            ("hook", "job.failed"),
        ]
    );
    assert!(
        settled
            .iter()
            .filter(|d| !d.1.ends_with("/gone"))
            .all(|d| d.3 == "delivered"),
        "{settled:?}"
    );
    let got = received.lock().unwrap().clone();
    let got_ids: HashSet<&str> = got
        .iter()
        .filter(|r| r.0 != "/gone")
        .map(|r| r.1["webhook-id"].as_str())
        .collect();
    let sent_ids: HashSet<&str> = settled
        .iter()
        .filter(|d| !d.1.ends_with("/gone"))
        .map(|d| d.0.as_str())
        .collect();
    assert_eq!(got_ids, sent_ids);
    let failed: Vec<Value> = got
        .iter()
        .map(|r| serde_json::from_str::<Value>(&r.2).unwrap())
        .filter(|b| b["type"] == "job.failed")
        .collect();
    assert_eq!(failed[0]["data"]["custom_id"], "d");
    assert!(failed[0]["data"]["error"]["code"].is_string(), "{}", failed[0]);

    // 410 Gone disabled the globex endpoint: its delivery failed, nothing more is queued.
    let gone: Vec<_> = settled.iter().filter(|d| d.1.ends_with("/gone")).collect();
    assert_eq!((gone.len(), gone[0].3.as_str()), (1, "failed"));
    let disabled: bool =
        sqlx::query_scalar("SELECT disabled_at IS NOT NULL FROM webhook_endpoints WHERE url LIKE '%/gone'")
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert!(disabled);
    let (_, second) = app.submit(GLOBEX, &job("fast", "after 410")).await;
    app.wait_job(GLOBEX, second["id"].as_str().unwrap(), 30).await;
    assert_eq!(deliveries(&app).await.len(), 7);

    // An independent implementation verifies every signature.
    let to_verify: Vec<Value> = got
        .iter()
        .map(|(path, headers, body)| {
            let secret = if path == "/batch-hook" {
                &batch_secret
            } else {
                &tenant_secret
            };
            json!({"secret": secret, "headers": headers, "body": body})
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("received.json");
    std::fs::write(&path, serde_json::to_vec(&to_verify).unwrap()).unwrap();
    let out = crate::python::run_script("verify_webhooks.py", &[path.to_str().unwrap()], &[]).await;
    let verified: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(verified["verified"], to_verify.len());
    receivers.stop().await;
    app.shutdown().await;
}

/// A receiver whose requests all wait until `release` is cancelled, counting per path the
/// requests in flight and the most there were at once (`"*"`: over every path).
#[derive(Clone, Default)]
struct Holding {
    counts: Arc<Mutex<HashMap<String, (usize, usize)>>>,
    release: CancellationToken,
}

impl Holding {
    fn count(&self, path: &str, delta: isize) {
        let mut counts = self.counts.lock().unwrap();
        for key in [path, "*"] {
            let (now, most) = counts.entry(key.to_owned()).or_default();
            *now = now.checked_add_signed(delta).unwrap();
            *most = (*most).max(*now);
        }
    }

    /// (in flight now, most at once) at `path`.
    fn at(&self, path: &str) -> (usize, usize) {
        self.counts.lock().unwrap().get(path).copied().unwrap_or_default()
    }
}

/// Starts a [`Holding`] receiver on a free port (any path); returns the port.
async fn start_holding_receiver(holding: Holding, receivers: &Receivers) -> u16 {
    let (listener, port) = Receivers::listen().await;
    let app = Router::new().fallback(move |uri: axum::http::Uri| {
        let holding = holding.clone();
        async move {
            holding.count(uri.path(), 1);
            holding.release.cancelled().await;
            holding.count(uri.path(), -1);
            StatusCode::NO_CONTENT
        }
    });
    receivers.serve(listener, app);
    port
}

/// A `[webhooks]` table: internal addresses allowed, a quick poll, retries every second,
/// `lines`, and an endpoint per `(tenant, "port/path")` on 127.0.0.1 signing with `secret`.
fn webhooks_table(lines: &str, secret: &str, endpoints: &[(&str, String)]) -> String {
    let mut table = format!(
        "[webhooks]\nallow_private_addresses = true\npoll_interval_ms = 100\n\
         retry_schedule_secs = [{}]\njitter = 0.0\n{lines}\n",
        ["1"; 30].join(", ")
    );
    for (tenant, at) in endpoints {
        table.push_str(&format!(
            "[[webhooks.endpoints]]\ntenant = \"{tenant}\"\nurl = \"http://127.0.0.1:{at}\"\nsecret = \"{secret}\"\n"
        ));
    }
    table
}

/// The app with [`webhooks_table`]'s `lines` and acme's endpoint at `port`.
async fn acme_app(lines: &str, port: u16) -> TestApp {
    TestApp::spawn_with(TestOptions {
        extra_config: webhooks_table(lines, &Secret::generate(), &[("acme", format!("{port}/hook"))]),
        ..TestOptions::default()
    })
    .await
}

/// Deliveries of `tenant`'s endpoints: (id, state, in flight).
async fn tenant_deliveries(app: &TestApp, tenant: &str) -> Vec<(String, String, bool)> {
    sqlx::query_as(
        "SELECT d.id, d.state, d.leased_until > now() IS TRUE FROM webhook_deliveries d
         JOIN webhook_endpoints e ON e.id = d.endpoint_id WHERE e.tenant = $1 ORDER BY d.id",
    )
    .bind(tenant)
    .fetch_all(&app.db.pool)
    .await
    .unwrap()
}

/// Runs `n` jobs of `key`'s tenant to the end.
async fn run_jobs(app: &TestApp, key: &str, n: usize) {
    for i in 0..n {
        let (status, created) = app.submit(key, &job("fast", &format!("event {i}"))).await;
        assert_eq!(status, 202, "{created}");
        let done = app.wait_job(key, created["id"].as_str().unwrap(), 30).await;
        assert_eq!(done["state"], "succeeded", "{done}");
    }
}

/// A tenant whose receivers hang holds at most `endpoint_concurrency` deliveries per
/// endpoint and `tenant_concurrency` in all, over both processes, each leased for its
/// own timeout; another tenant's deliveries are sent and recorded meanwhile, one by one.
#[tokio::test]
async fn a_hanging_receiver_delays_no_other_tenant() {
    let receivers = Receivers::default();
    let holding = Holding::default();
    let slow = start_holding_receiver(holding.clone(), &receivers).await;
    let fast = free_port();
    let received: Received = Arc::default();
    start_receiver(fast, received.clone(), &receivers).await;
    let secret = Secret::generate();
    let app = TestApp::spawn_with(TestOptions {
        extra_config: webhooks_table(
            "timeout_secs = 300\nconcurrency = 8\nendpoint_concurrency = 2\ntenant_concurrency = 3",
            &secret,
            &[
                ("acme", format!("{slow}/one")),
                ("acme", format!("{slow}/two")),
                ("globex", format!("{fast}/hook")),
            ],
        ),
        peers: 1,
        ..TestOptions::default()
    })
    .await;
    let peer = app.spawn_peer(Roles::ALL).await;

    // Four acme jobs: eight deliveries to receivers that do not answer.
    run_jobs(&app, ACME, 4).await;
    eventually(60, "acme's tenant share to be in flight", || async {
        (holding.at("*").0 == 3).then_some(())
    })
    .await;

    // globex's events are delivered — and recorded — while acme's still hang.
    run_jobs(&app, GLOBEX, 3).await;
    let globex = eventually(60, "globex's deliveries to be recorded", || async {
        let d = tenant_deliveries(&app, "globex").await;
        (d.len() == 3 && d.iter().all(|d| d.1 == "delivered")).then_some(d)
    })
    .await;
    assert_eq!(received.lock().unwrap().len(), 3, "{globex:?}");
    let acme = tenant_deliveries(&app, "acme").await;
    assert_eq!(acme.len(), 8, "{acme:?}");
    assert_eq!(
        acme.iter().filter(|d| d.1 == "pending" && d.2).count(),
        3,
        "{acme:?}"
    );
    assert_eq!(
        acme.iter().filter(|d| d.1 == "pending" && !d.2).count(),
        5,
        "{acme:?}"
    );
    let (one, two, all) = (holding.at("/one"), holding.at("/two"), holding.at("*"));
    assert!(one.1 <= 2 && two.1 <= 2, "per endpoint: {one:?} {two:?}");
    assert_eq!(all, (3, 3), "per tenant, over both processes");
    // Each in-flight delivery is leased for its own attempt: the timeout and a margin.
    let leased_long: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries WHERE leased_until > now() + interval '240 seconds'",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(leased_long, 3);

    // Released, acme's receivers get every delivery, still within the limits.
    holding.release.cancel();
    eventually(60, "acme's deliveries to be delivered", || async {
        let d = tenant_deliveries(&app, "acme").await;
        d.iter().all(|d| d.1 == "delivered").then_some(())
    })
    .await;
    let (one, two, all) = (holding.at("/one"), holding.at("/two"), holding.at("*"));
    assert!(one.1 <= 2 && two.1 <= 2 && all.1 <= 3, "{one:?} {two:?} {all:?}");

    peer.shutdown().await;
    app.shutdown().await;
    receivers.stop().await;
}

/// Starts a receiver on a free port answering every request with `status`, counting them.
async fn start_answering(status: StatusCode, receivers: &Receivers) -> (u16, Arc<Mutex<usize>>) {
    let (listener, port) = Receivers::listen().await;
    let count: Arc<Mutex<usize>> = Arc::default();
    let counted = count.clone();
    let app = Router::new().fallback(move || {
        let counted = counted.clone();
        async move {
            *counted.lock().unwrap() += 1;
            status
        }
    });
    receivers.serve(listener, app);
    (port, count)
}

/// (disabled, reason, consecutive failures) of acme's endpoint.
async fn acme_endpoint(app: &TestApp) -> (bool, Option<String>, i32) {
    sqlx::query_as(
        "SELECT disabled_at IS NOT NULL, disabled_reason, consecutive_failures FROM webhook_endpoints
         WHERE tenant = 'acme'",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap()
}

/// An endpoint failing long enough is disabled with its reason, its pending deliveries
/// fail saying why and nothing more is queued; `reenable` in a config enables it again.
#[tokio::test]
async fn an_endpoint_failing_long_enough_is_disabled_until_a_config_reenables_it() {
    let receivers = Receivers::default();
    let (port, answered) = start_answering(StatusCode::INTERNAL_SERVER_ERROR, &receivers).await;
    let app = acme_app("disable_after_failures = 3\ndisable_after_secs = 0", port).await;
    run_jobs(&app, ACME, 1).await;
    let (_, reason, failures) = eventually(60, "the endpoint to be disabled", || async {
        let e = acme_endpoint(&app).await;
        e.0.then_some(e)
    })
    .await;
    let reason = reason.unwrap();
    assert!(
        reason.contains("3 attempts in a row") && reason.contains("500"),
        "{reason}"
    );
    assert_eq!(failures, 3);
    assert_eq!(*answered.lock().unwrap(), 3);
    let (state, error): (String, String) = sqlx::query_as("SELECT state, last_error FROM webhook_deliveries")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(state, "failed");
    assert!(
        error.starts_with("the endpoint was disabled: failing since"),
        "{error}"
    );
    run_jobs(&app, ACME, 1).await;
    assert_eq!(
        deliveries(&app).await.len(),
        1,
        "nothing is queued for a disabled endpoint"
    );

    // What a process starting with `reenable = true` does.
    let mut reenabling = (*app.config).clone();
    reenabling.webhooks.endpoints[0].reenable = true;
    tollgate_workers::webhooks::sync_config_endpoints(&app.db.pool, &reenabling)
        .await
        .unwrap();
    assert_eq!(acme_endpoint(&app).await, (false, None, 0));
    run_jobs(&app, ACME, 1).await;
    assert_eq!(deliveries(&app).await.len(), 2, "queued again");

    app.shutdown().await;
    receivers.stop().await;
}

/// Secrets are sealed in the database (a dump shows neither the tenant's nor a batch's),
/// and a row stored as it was before sealing is sealed by the sync at start and still
/// signs its deliveries with the same secret.
#[tokio::test]
async fn webhook_secrets_are_sealed_at_rest_and_old_rows_are_sealed_at_start() {
    let port = free_port();
    let received: Received = Arc::default();
    let receivers = Receivers::default();
    start_receiver(port, received.clone(), &receivers).await;
    let (tenant_secret, batch_secret, old_secret) =
        (Secret::generate(), Secret::generate(), Secret::generate());
    let app = TestApp::spawn_with(TestOptions {
        extra_config: webhooks_table("", &tenant_secret, &[("globex", format!("{port}/hook"))]),
        ..TestOptions::default()
    })
    .await;
    let (_, file) = upload(&app.http, &app.api, ACME, line("a", "fast", "one").as_bytes()).await;
    let mut body = batch_body(file["id"].as_str().unwrap());
    body["webhook"] = json!({
        "url": format!("http://127.0.0.1:{port}/batch-hook"),
        "secret": batch_secret,
        "events": ["batch.completed"],
    });
    let (status, batch) = create_batch(&app.http, &app.api, ACME, &body).await;
    assert_eq!(status, 200, "{batch}");
    wait_batch(&app.http, &app.api, ACME, batch["id"].as_str().unwrap(), 60).await;

    // A row as an earlier tollgate wrote it, with a delivery waiting.
    sqlx::query(
        "INSERT INTO webhook_endpoints (tenant, batch_id, url, secret, events, created_at)
         VALUES ('globex', 'batch_old', $1, $2, '{job.completed}', now())",
    )
    .bind(format!("http://127.0.0.1:{port}/hook"))
    .bind(&old_secret)
    .execute(&app.db.pool)
    .await
    .unwrap();
    tollgate_workers::webhooks::sync_config_endpoints(&app.db.pool, &app.config)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO webhook_deliveries (id, endpoint_id, event_type, body, next_attempt_at, created_at)
         SELECT 'msg_old', id, 'job.completed', '{\"type\": \"job.completed\"}', now(), now()
         FROM webhook_endpoints WHERE batch_id = 'batch_old'",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();

    let dump: Vec<String> = sqlx::query_scalar("SELECT t::text FROM webhook_endpoints t")
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(dump.len(), 3, "{dump:?}");
    for secret in [&tenant_secret, &batch_secret, &old_secret] {
        let key_part = secret.trim_start_matches("whsec_");
        assert!(
            dump.iter().all(|row| !row.contains(key_part)),
            "{secret} in {dump:?}"
        );
    }
    let sealed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM webhook_endpoints WHERE secret LIKE 'sealed:v1:%'")
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(sealed, 3);

    // Each delivery is signed with its endpoint's own secret.
    let got = eventually(60, "the batch's and the old row's deliveries", || async {
        let got = received.lock().unwrap().clone();
        let batch = got.iter().any(|r| r.0 == "/batch-hook");
        let old = got.iter().any(|r| r.1["webhook-id"] == "msg_old");
        (batch && old).then_some(got)
    })
    .await;
    for (path, headers, body) in &got {
        let secret = match (path.as_str(), headers["webhook-id"].as_str()) {
            ("/batch-hook", _) => &batch_secret,
            (_, "msg_old") => &old_secret,
            _ => &tenant_secret,
        };
        let ts: i64 = headers["webhook-timestamp"].parse().unwrap();
        let expected = Secret::parse(secret)
            .unwrap()
            .sign(&headers["webhook-id"], ts, body.as_bytes());
        assert_eq!(headers["webhook-signature"], expected, "{path}");
    }
    app.shutdown().await;
    receivers.stop().await;
}

/// A process starting with an older config (without the endpoint) removes nothing; a
/// config retiring the endpoint stops new events but its pending delivery is still
/// delivered; a config naming it again takes it back.
#[tokio::test]
async fn a_sync_removes_no_endpoint_and_a_retired_one_still_delivers_what_is_pending() {
    let port = free_port(); // the receiver is down at first
    let app = acme_app("disable_after_failures = 0", port).await;
    run_jobs(&app, ACME, 1).await;
    eventually(60, "the delivery to be retried", || async {
        let d = deliveries(&app).await;
        (d.len() == 1 && d[0].4 >= 2).then_some(())
    })
    .await;
    let sync = |config: tollgate::config::Config| {
        let pool = app.db.pool.clone();
        async move {
            tollgate_workers::webhooks::sync_config_endpoints(&pool, &config)
                .await
                .unwrap()
        }
    };

    // Another process, on a config that has no endpoint.
    let mut older = (*app.config).clone();
    older.webhooks.endpoints.clear();
    sync(older).await;
    let d = deliveries(&app).await;
    assert_eq!((d.len(), d[0].3.as_str()), (1, "pending"), "{d:?}");

    // Retired: nothing new is queued, what is pending is delivered.
    let mut retiring = (*app.config).clone();
    retiring.webhooks.endpoints[0].retired = true;
    sync(retiring).await;
    run_jobs(&app, ACME, 1).await;
    assert_eq!(
        deliveries(&app).await.len(),
        1,
        "nothing queued for a retired endpoint"
    );
    let received: Received = Arc::default();
    let receivers = Receivers::default();
    start_receiver(port, received.clone(), &receivers).await;
    eventually(60, "the pending delivery to be delivered", || async {
        let d = deliveries(&app).await;
        (d[0].3 == "delivered").then_some(())
    })
    .await;

    // Named again (not retired), it gets events again.
    sync((*app.config).clone()).await;
    run_jobs(&app, ACME, 1).await;
    eventually(60, "the new event to be delivered", || async {
        let d = deliveries(&app).await;
        (d.len() == 2 && d.iter().all(|d| d.3 == "delivered")).then_some(())
    })
    .await;
    assert_eq!(received.lock().unwrap().len(), 2);
    app.shutdown().await;
    receivers.stop().await;
}
