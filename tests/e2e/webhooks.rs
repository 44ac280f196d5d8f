//! Webhooks: a receiver that is down for a while gets every event once it is up, each
//! signed so that an independent Standard Webhooks implementation (the `standardwebhooks`
//! Python package) verifies it; a receiver answering 410 Gone has its endpoint disabled.

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

/// What the receiver got: (path, webhook headers, body).
type Received = Arc<Mutex<Vec<(String, HashMap<String, String>, String)>>>;

/// A webhook receiver on `port`: `/hook` and `/batch-hook` answer 204, `/gone` 410.
async fn start_receiver(port: u16, received: Received, tracker: &TaskTracker, stop: CancellationToken) {
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
    tracker.spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
            .unwrap();
    });
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
    let (tracker, stop) = (TaskTracker::new(), CancellationToken::new());
    start_receiver(port, received.clone(), &tracker, stop.clone()).await;
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
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    app.shutdown().await;
}
