//! Hostile input and tenant isolation, end to end.
//!
//! - The auth matrix: every operation of the running app's own `/openapi.json` (so a new
//!   endpoint is covered without touching this file), with no key, a wrong key, another
//!   tenant's key on tenant A's job, file and batch, and a tenant key on the admin-only
//!   endpoint → 401 / 401 / 404 / 403, never A's data, and A's resources untouched.
//! - Limits on what a client controls: body, headers, metadata, idempotency key,
//!   long-poll, and the per-tenant API request rate.
//! - Provider keys never leak: a `tollgate serve` child at `RUST_LOG=debug` runs a
//!   workload with a distinctive provider key (one of them revoked, so the provider's 401
//!   path runs); its logs, every endpoint's answers and every table's rows are searched.

use std::sync::Arc;
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tollgate::config::Config;
use tollgate_api::broker::{Broker, Roles};
use tollgate_mock::{LocalMock, MockConfig, MockProvider};

use crate::batches::{batch_body, create_batch, line, upload};
use crate::durability::{Serve, free_port};
use crate::harness::{
    ACME, GLOBEX, TestApp, TestOptions, config_text, fresh_db_with, job, mock_config, serve_connections,
    wait_finished_at,
};

const ADMIN: &str = "tk-admin-7d2e";

async fn send(app: &TestApp, method: &Method, path: &str, key: Option<&str>) -> (u16, Value, String) {
    let mut req = app.http.request(method.clone(), app.url(path));
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    if *method == Method::POST {
        req = req.json(&json!({}));
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null), text)
}

fn assert_no_secret(text: &str, secrets: &[&str], what: &str) {
    for s in secrets {
        assert!(!text.contains(s), "{what} leaked {s:?}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_endpoint_answers_401_403_404_as_documented_and_never_another_tenant_s_data() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        server_config: format!("admin_key = \"{ADMIN}\""),
        ..TestOptions::default()
    })
    .await;
    // Tenant A (acme) owns a job, a file and a batch, with a canary in their contents.
    const CANARY: &str = "acme-private-canary-5e81";
    let (status, j) = app.submit(ACME, &job("fast", CANARY)).await;
    assert_eq!(status, 202, "{j}");
    let (status, f) = upload(&app.http, &app.api, ACME, line("c1", "fast", CANARY).as_bytes()).await;
    assert_eq!(status, 200, "{f}");
    let file_id = f["id"].as_str().unwrap().to_owned();
    let (status, b) = create_batch(&app.http, &app.api, ACME, &batch_body(&file_id)).await;
    assert_eq!(status, 200, "{b}");
    let message_request = json!({"model": "claude-3-5-haiku-latest", "max_tokens": 8,
                                 "messages": [{"role": "user", "content": CANARY}]});
    let (status, m) = app
        .post(
            ACME,
            "/v1/messages/batches",
            &json!({"requests": [{"custom_id": "c1", "params": message_request}]}),
        )
        .await;
    assert_eq!(status, 200, "{m}");
    let (job_id, batch_id, message_batch_id) = (
        j["id"].as_str().unwrap().to_owned(),
        b["id"].as_str().unwrap().to_owned(),
        m["id"].as_str().unwrap().to_owned(),
    );
    let secrets = [
        CANARY,
        job_id.as_str(),
        file_id.as_str(),
        batch_id.as_str(),
        message_batch_id.as_str(),
    ];

    // An admin-API key of acme's to revoke (not the one the test goes on using).
    let (status, spare) = app
        .post(ADMIN, "/v1/admin/tenants/acme/keys", &json!({"name": "spare"}))
        .await;
    assert_eq!(status, 201, "{spare}");
    let spare_key_id = spare["id"].as_str().unwrap().to_owned();
    // A pause to resume: of a tenant of its own, so nothing of the test's waits on it.
    let (status, idle) = app
        .post(ADMIN, "/v1/admin/tenants", &json!({"name": "idle"}))
        .await;
    assert_eq!(status, 201, "{idle}");
    let (status, _) = app
        .post(ADMIN, "/v1/admin/pauses", &json!({"tenant": "idle"}))
        .await;
    assert_eq!(status, 201);

    let (_, doc) = app.get(ACME, "/openapi.json").await;
    let paths = doc["paths"].as_object().expect("paths in /openapi.json");
    let mut checked = 0;
    for (path, item) in paths {
        for (method, op) in item.as_object().unwrap() {
            let Ok(method) = method.to_uppercase().parse::<Method>() else {
                continue;
            };
            if !matches!(
                method,
                Method::GET | Method::POST | Method::DELETE | Method::PUT | Method::PATCH
            ) {
                continue;
            }
            let requirements = op["security"].as_array().cloned().unwrap_or_default();
            let key_optional = requirements.is_empty() || requirements.iter().any(|r| r == &json!({}));
            let concrete = if path.contains("{id}") {
                let id = if path.starts_with("/v1/jobs/") {
                    &job_id
                } else if path.starts_with("/v1/files/") {
                    &file_id
                } else if path.starts_with("/v1/batches/") {
                    &batch_id
                } else if path.starts_with("/v1/messages/batches/") {
                    &message_batch_id
                } else if path.starts_with("/v1/admin/tenants/{tenant}/keys/") {
                    &spare_key_id
                } else {
                    panic!("{method} {path}: a new resource; name tenant A's resource for it here");
                };
                path.replace("{id}", id)
            } else {
                path.clone()
            }
            .replace("{tenant}", "acme")
            .replace("{alias}", "fast")
            .replace("{provider}", "oai")
            .replace("{name}", "k1")
            .replace("{scope}", "tenant%3Aidle");
            let at = format!("{method} {concrete}");
            let admin_only = path == "/metrics" || path.starts_with("/v1/admin/");
            if key_optional && !admin_only {
                // Public: answers without a key, and holds nobody's data.
                let (status, _, text) = send(&app, &method, &concrete, None).await;
                assert!(status < 500, "{at} without a key: {status} {text}");
                assert_no_secret(&text, &secrets, &at);
                checked += 1;
                continue;
            }
            let (status, body, text) = send(&app, &method, &concrete, None).await;
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (401, Some("missing_api_key")),
                "{at} no key: {text}"
            );
            assert_no_secret(&text, &secrets, &at);
            let (status, body, text) = send(&app, &method, &concrete, Some("tk-not-a-key")).await;
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (401, Some("invalid_api_key")),
                "{at} wrong key: {text}"
            );
            assert_no_secret(&text, &secrets, &at);
            let (status, body, text) = send(&app, &method, &concrete, Some(GLOBEX)).await;
            if admin_only {
                assert_eq!(
                    (status, body["error"]["code"].as_str()),
                    (403, Some("admin_only")),
                    "{at} tenant key: {text}"
                );
                let (status, _, text) = send(&app, &method, &concrete, Some(ADMIN)).await;
                if path == "/metrics" {
                    assert_eq!(status, 200, "{at} with the admin key");
                } else {
                    // Bodies of `{}` or none: refused as bad input or a conflict at worst.
                    assert!(
                        (200..300).contains(&status) || matches!(status, 400 | 409),
                        "{at} with the admin key: {status} {text}"
                    );
                }
            } else if path.contains("{id}") {
                assert_eq!(status, 404, "{at} with another tenant's key: {text}");
            } else {
                assert!(status < 500, "{at} with another tenant's key: {status} {text}");
            }
            assert_no_secret(&text, &secrets, &at);
            checked += 1;
        }
    }
    assert!(checked >= 20, "only {checked} operations in /openapi.json");
    // Another tenant's cancels and deletes touched nothing of A's.
    let (_, j) = app.get(ACME, &format!("/v1/jobs/{job_id}")).await;
    assert_eq!(j["state"], "queued", "{j}");
    let (status, _) = app.get(ACME, &format!("/v1/files/{file_id}")).await;
    assert_eq!(status, 200, "acme's file survives globex's DELETE");
    let (_, b) = app.get(ACME, &format!("/v1/batches/{batch_id}")).await;
    assert_eq!(b["status"], "in_progress", "{b}");
    let (_, m) = app
        .get(ACME, &format!("/v1/messages/batches/{message_batch_id}"))
        .await;
    assert_eq!(m["processing_status"], "in_progress", "{m}");
    // The admin key reads and cancels any tenant's job, the tenant shown; it submits none.
    let (status, seen) = app.get(ADMIN, &format!("/v1/jobs/{job_id}")).await;
    assert_eq!((status, seen["tenant"].as_str()), (200, Some("acme")), "{seen}");
    let (status, listed) = app.get(ADMIN, "/v1/jobs?limit=100").await;
    assert_eq!(status, 200, "{listed}");
    assert!(
        listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j["id"] == job_id.as_str()),
        "{listed}"
    );
    let (status, _) = app.submit(ADMIN, &job("fast", "as whom?")).await;
    assert_eq!(status, 401, "the admin key is no tenant's: it cannot submit");
    // And any tenant's files and batches: read, listed, cancelled, the tenant shown.
    for (path, list) in [
        (format!("/v1/files/{file_id}"), "/v1/files"),
        (format!("/v1/batches/{batch_id}"), "/v1/batches"),
    ] {
        let (status, seen) = app.get(ADMIN, &path).await;
        assert_eq!(
            (status, seen["tenant"].as_str()),
            (200, Some("acme")),
            "{path}: {seen}"
        );
        let (status, listed) = app.get(ADMIN, list).await;
        assert_eq!(status, 200, "{listed}");
        assert!(
            listed["data"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x["tenant"] == "acme"),
            "{list}: {listed}"
        );
    }
    let r = app
        .http
        .get(app.url(&format!("/v1/files/{file_id}/content")))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(
        r.text().await.unwrap().contains(CANARY),
        "the admin reads acme's file"
    );
    let (status, cancelling) = app
        .post(ADMIN, &format!("/v1/batches/{batch_id}/cancel"), &json!({}))
        .await;
    assert_eq!(
        (status, cancelling["status"].as_str()),
        (200, Some("cancelling")),
        "{cancelling}"
    );
    let (status, cancelled) = app
        .post(ADMIN, &format!("/v1/jobs/{job_id}/cancel"), &json!({}))
        .await;
    assert_eq!(
        (status, cancelled["state"].as_str()),
        (200, Some("cancelled")),
        "{cancelled}"
    );
    app.shutdown().await;
}

/// The broker in this process with the harness's config text changed by `edit` (for
/// fields the harness already sets).
async fn spawn_edited(edit: impl Fn(String) -> String) -> (Broker, String, LocalMock) {
    let mock = MockProvider::new(mock_config()).start_local().await.unwrap();
    let config = Config::parse(&edit(config_text(mock.addr, "")), "security test").unwrap();
    let db = fresh_db_with(tollgate_api::broker::role_connections(&config)).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let broker = Broker::start(Arc::new(config), db.pool.clone(), Some(listener), Roles::API_ONLY)
        .await
        .unwrap();
    let api = format!("http://{}", broker.addr.unwrap());
    (broker, api, mock)
}

#[tokio::test(flavor = "multi_thread")]
async fn what_a_client_controls_is_limited() {
    let (broker, api, mock) =
        spawn_edited(|c| c.replace("max_wait_secs = 30", "max_wait_secs = 1\nmax_header_bytes = 4096")).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let submit = |body: Value, extra: Option<(&'static str, String)>| {
        let mut req = http.post(format!("{api}/v1/jobs")).bearer_auth(ACME).json(&body);
        if let Some((name, value)) = extra {
            req = req.header(name, value);
        }
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let code = |v: &Value| v["error"]["code"].as_str().map(str::to_owned);
    // Body over server.max_body_bytes (64 KiB in the harness).
    let (status, body) = submit(job("fast", &"x".repeat(70_000)), None).await;
    assert_eq!(
        (status, code(&body).as_deref()),
        (413, Some("body_too_large")),
        "{body}"
    );
    // Metadata over 16 KiB serialized, in a body the server accepts.
    let mut big_meta = job("fast", "m");
    big_meta["metadata"] = json!({"k": "v".repeat(17 * 1024)});
    let (status, body) = submit(big_meta, None).await;
    assert_eq!(
        (status, code(&body).as_deref()),
        (400, Some("metadata_too_large")),
        "{body}"
    );
    // Idempotency keys: at most 255 bytes, header or body.
    let (status, body) = submit(job("fast", "i"), Some(("idempotency-key", "k".repeat(256)))).await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("idempotency_key")),
        "{body}"
    );
    // Headers over server.max_header_bytes: one big header, or a huge Authorization.
    let (status, body) = submit(job("fast", "h"), Some(("x-padding", "p".repeat(5000)))).await;
    assert_eq!(
        (status, code(&body).as_deref()),
        (431, Some("headers_too_large")),
        "{body}"
    );
    let r = http
        .get(format!("{api}/v1/jobs"))
        .bearer_auth("k".repeat(8000))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 431);
    // A long-poll asking for an hour is clamped to server.max_wait_secs: the job stays
    // queued (nothing dispatches here) and the answer comes well within the client's timeout.
    let (status, accepted) = submit(job("fast", "wait"), None).await;
    assert_eq!(status, 202);
    let r = http
        .get(format!(
            "{api}/v1/jobs/{}?wait=3600",
            accepted["id"].as_str().unwrap()
        ))
        .bearer_auth(ACME)
        .send()
        .await
        .expect("the clamped long-poll answers before the client's 20 s timeout");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "queued");
    // Still serving after all of it.
    let r = http
        .get(format!("{api}/v1/jobs"))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    broker.shutdown().await;
    mock.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_over_its_api_rate_gets_429_and_others_do_not() {
    let (broker, api, mock) = spawn_edited(|c| {
        c.replacen(
            "[server]\n",
            "[server]\napi_rate_per_sec = 0.001\napi_burst = 5\n",
            1,
        )
    })
    .await;
    let http = reqwest::Client::new();
    let get = |key: &str| http.get(format!("{api}/v1/jobs")).bearer_auth(key).send();
    for i in 0..5 {
        assert_eq!(
            get(ACME).await.unwrap().status().as_u16(),
            200,
            "request {i} is in the burst"
        );
    }
    let limited = get(ACME).await.unwrap();
    assert_eq!(limited.status().as_u16(), 429);
    let retry_after: u64 = limited.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after >= 1);
    let body: Value = limited.json().await.unwrap();
    assert_eq!(body["error"]["code"], "api_rate_limited");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    // Another tenant has its own bucket; a request without a key is a 401, not a 429.
    assert_eq!(get(GLOBEX).await.unwrap().status().as_u16(), 200);
    let r = http.get(format!("{api}/v1/jobs")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    broker.shutdown().await;
    mock.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bulk_counts_each_of_its_jobs_against_the_api_rate() {
    let (broker, api, mock) = spawn_edited(|c| {
        c.replacen(
            "[server]\n",
            "[server]\napi_rate_per_sec = 0.001\napi_burst = 5\n",
            1,
        )
        .replacen(
            &format!("api_key = \"{GLOBEX}\"\n"),
            &format!("api_key = \"{GLOBEX}\"\napi_burst = 100\n"),
            1,
        )
    })
    .await;
    let http = reqwest::Client::new();
    let bulk = |key: &'static str| {
        let items: Vec<Value> = (0..20).map(|i| job("fast", &format!("bulk {i}"))).collect();
        http.post(format!("{api}/v1/jobs/bulk"))
            .bearer_auth(key)
            .json(&json!({ "jobs": items }))
            .send()
    };
    // A bulk the bucket can start is taken whole, and its 20 jobs put the tenant in debt:
    // its next request is refused, and so is the next bulk, before its body is read.
    assert_eq!(bulk(ACME).await.unwrap().status().as_u16(), 202);
    let get = |key: &str| http.get(format!("{api}/v1/jobs")).bearer_auth(key).send();
    let limited = get(ACME).await.unwrap();
    assert_eq!(limited.status().as_u16(), 429);
    let body: Value = limited.json().await.unwrap();
    assert_eq!(body["error"]["code"], "api_rate_limited", "{body}");
    let again = http
        .post(format!("{api}/v1/jobs/bulk"))
        .bearer_auth(ACME)
        .json(&json!({ "jobs": [job("fast", "after")] }))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status().as_u16(), 429);
    // A tenant with a burst of its own spends 20 of its 100.
    assert_eq!(bulk(GLOBEX).await.unwrap().status().as_u16(), 202);
    assert_eq!(
        get(GLOBEX).await.unwrap().status().as_u16(),
        200,
        "another tenant's bucket is its own"
    );
    broker.shutdown().await;
    mock.shutdown().await;
}

const LIVE_KEY: &str = "sk-LEAKCANARY-live-8c1e2f90";
const DEAD_KEY: &str = "sk-LEAKCANARY-dead-41b7d9aa";
const CANARY_PART: &str = "LEAKCANARY";

#[tokio::test(flavor = "multi_thread")]
async fn provider_keys_appear_in_no_log_metric_error_record_or_page() {
    let db = fresh_db_with(serve_connections()).await;
    let mut mock_cfg: MockConfig = mock_config();
    mock_cfg.projects[0].keys = vec![LIVE_KEY.to_owned()];
    mock_cfg.projects[0].revoked_keys = vec![DEAD_KEY.to_owned()];
    let local_mock = MockProvider::new(mock_cfg).start_local().await.unwrap();
    let (mock, mock_addr) = (local_mock.provider.clone(), local_mock.addr);
    let extra = format!(
        "[[providers]]\nname = \"bad\"\nkind = \"openai\"\nbase_url = \"http://MOCK_ADDR/v1\"\n\
         keys = [{{ name = \"only\", value = \"{DEAD_KEY}\" }}]\nmodels = [\"gpt-4o-mini\"]\n"
    );
    let text = config_text(mock_addr, &extra)
        .replace(
            "keys = [{ name = \"k1\", value = \"sk-test-1\" }]",
            &format!("keys = [{{ name = \"k1\", value = \"{LIVE_KEY}\" }}, {{ name = \"k2\", value = \"{DEAD_KEY}\" }}]"),
        )
        .replacen("[server]\n", &format!("[server]\nadmin_key = \"{ADMIN}\"\n"), 1);
    assert!(text.contains(DEAD_KEY) && text.contains(LIVE_KEY));
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("tollgate.toml");
    std::fs::write(&config_path, text).unwrap();
    let (stdout_path, stderr_path) = (dir.path().join("stdout.log"), dir.path().join("stderr.log"));
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--config"])
        .arg(&config_path)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "debug")
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let mut serve = Serve { child };
    serve.wait_ready(&api).await;
    let http = reqwest::Client::new();

    // The workload: jobs that meet the revoked key and move to the live one, a job whose
    // only key is revoked, a synchronous call that fails on it, a malformed request.
    let mut ids = Vec::new();
    for (model, n) in [("oai/gpt-4o-mini", 8), ("bad/gpt-4o-mini", 1)] {
        for i in 0..n {
            let r = http
                .post(format!("{api}/v1/jobs"))
                .bearer_auth(ACME)
                .json(&job(model, &format!("leak test {i}")))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 202);
            ids.push(
                r.json::<Value>().await.unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
    }
    let mut seen = String::new();
    let sync = http
        .post(format!("{api}/v1/chat/completions"))
        .bearer_auth(ACME)
        .json(&json!({"model": "bad/gpt-4o-mini", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert!(!sync.status().is_success(), "the revoked key cannot succeed");
    seen.push_str(&sync.text().await.unwrap());
    for id in &ids {
        let done = wait_finished_at(&http, &api, ACME, id, 60).await;
        seen.push_str(&done.to_string());
    }
    assert!(mock.stats().unauthorized >= 1, "the provider's 401 path ran");
    assert!(mock.stats().succeeded >= 8, "the live key carried the work");
    assert!(
        seen.contains("\"failed\"") && seen.contains("upstream_credentials_exhausted"),
        "the job on the revoked key failed as the provider's 401 says: {seen}"
    );
    for (path, key) in [
        ("/v1/jobs?limit=100", ACME),
        ("/v1/limits", ACME),
        ("/v1/status", ADMIN),
        ("/v1/status/history", ADMIN),
        ("/metrics", ADMIN),
        ("/dashboard", ADMIN),
        ("/dashboard/app.js", ADMIN),
        ("/openapi.json", ADMIN),
        ("/v1/jobs/not-a-uuid", ACME),
    ] {
        let r = http
            .get(format!("{api}{path}"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert!(r.status().as_u16() < 500, "{path}");
        seen.push_str(&r.text().await.unwrap());
    }
    assert!(!seen.contains(CANARY_PART), "an API answer holds a provider key");
    // The provider's 401 quotes the key masked (`sk-****…d9aa`): even that is cut.
    assert!(
        !seen.contains("sk-*"),
        "an API answer holds a provider's masked key: {seen}"
    );

    // Every row of every table, as text.
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE schemaname = 'public'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert!(tables.len() >= 5, "{tables:?}");
    let mut rows = 0usize;
    for table in &tables {
        let texts: Vec<String> = sqlx::query_scalar(&format!("SELECT t::text FROM \"{table}\" t"))
            .fetch_all(&db.pool)
            .await
            .unwrap();
        rows += texts.len();
        for t in texts {
            assert!(
                !t.contains(CANARY_PART),
                "table {table} holds a provider key: {t}"
            );
        }
    }
    assert!(rows >= ids.len(), "the jobs are in the database ({rows} rows)");

    // The logs, at debug level, after a graceful stop (so everything is flushed).
    serve.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(serve.child.wait().unwrap().success(), "graceful stop");
    let logs =
        std::fs::read_to_string(&stdout_path).unwrap() + &std::fs::read_to_string(&stderr_path).unwrap();
    assert!(logs.contains("DEBUG"), "the logs were captured at debug level");
    for (n, line) in logs.lines().enumerate() {
        assert!(
            !line.contains(CANARY_PART),
            "log line {n} holds a provider key: {line}"
        );
    }
    local_mock.shutdown().await;
}
