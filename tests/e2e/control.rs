//! The control plane at runtime: tenants and keys created, used and revoked through
//! different processes within a second; the admin API's refusals; a parent's budget held
//! across two processes; secrets never stored; `SIGHUP` reloading the file.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::Digest;
use tollgate_api::broker::Roles;

use crate::harness::{ACME, TestApp, TestOptions, eventually, job};

const ADMIN: &str = "tk-admin-control";

fn admin_options() -> TestOptions {
    TestOptions {
        server_config: format!("admin_key = \"{ADMIN}\""),
        ..TestOptions::default()
    }
}

async fn call(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    key: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut request = http.request(method, url).bearer_auth(key);
    if let Some(body) = body {
        request = request.json(body);
    }
    let r = request.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Polls `check` every 10 ms until it holds; returns how long that took, failing past
/// one second (the control plane's promise).
async fn within_a_second<F, Fut>(what: &str, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{what} took longer than a second"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `secret` gets `status` from `GET /v1/jobs` on every one of `apis`, each
/// within a second.
async fn everywhere_within_a_second(
    http: &reqwest::Client,
    apis: &[&str],
    secret: &str,
    status: u16,
    what: &str,
) {
    for api in apis {
        within_a_second(what, || async {
            call(
                http,
                reqwest::Method::GET,
                &format!("{api}/v1/jobs"),
                secret,
                None,
            )
            .await
            .0 == status
        })
        .await;
    }
}

#[tokio::test]
async fn a_tenant_and_key_made_on_one_process_work_on_another_and_a_revoked_key_is_refused_everywhere() {
    let app = TestApp::spawn_with(TestOptions {
        peers: 2,
        ..admin_options()
    })
    .await;
    let b = app.spawn_peer(Roles::ALL).await;
    let c = app.spawn_peer(Roles::API_ONLY).await;
    let (api_a, api_b, api_c) = (
        app.api.clone(),
        format!("http://{}", b.addr.unwrap()),
        format!("http://{}", c.addr.unwrap()),
    );
    let http = &app.http;
    use reqwest::Method;

    let tenant = json!({
        "name": "newco",
        "weight": 2,
        "limits": {"rpm": 600, "concurrency": 4},
        "budgets": [{"window": "month", "usd": 5}],
    });
    let (status, created) = call(
        http,
        Method::POST,
        &format!("{api_a}/v1/admin/tenants"),
        ADMIN,
        Some(&tenant),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(
        (&created["name"], &created["weight"], &created["source"]),
        (&json!("newco"), &json!(2), &json!("api"))
    );
    let (status, key) = call(
        http,
        Method::POST,
        &format!("{api_a}/v1/admin/tenants/newco/keys"),
        ADMIN,
        Some(&json!({"name": "ci", "application": "nightly"})),
    )
    .await;
    assert_eq!(status, 201, "{key}");
    let secret = key["key"].as_str().unwrap().to_owned();
    let key_id = key["id"].as_str().unwrap().to_owned();

    // The key works on the other processes within a second of its creation.
    everywhere_within_a_second(http, &[&api_b, &api_c], &secret, 200, "the new key accepted").await;
    let (status, accepted) = call(
        http,
        Method::POST,
        &format!("{api_b}/v1/jobs"),
        &secret,
        Some(&job("fast", "hello")),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let done =
        crate::harness::wait_finished_at(http, &api_b, &secret, accepted["id"].as_str().unwrap(), 30).await;
    assert_eq!(
        (&done["state"], &done["tenant"]),
        (&json!("succeeded"), &json!("newco")),
        "{done}"
    );
    // The tenant's limits are buckets on its jobs' path, and it sees them.
    let (_, limits) = call(http, Method::GET, &format!("{api_c}/v1/limits"), &secret, None).await;
    let keys: Vec<&str> = limits["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["bucket"].as_str())
        .collect();
    for bucket in [
        "tenant:newco:rpm",
        "tenant:newco:concurrency",
        "tenant:newco:monthly_spend",
    ] {
        assert!(keys.contains(&bucket), "{bucket} in {keys:?}");
    }
    assert!(!keys.iter().any(|k| k.starts_with("tenant:acme:")), "{keys:?}");

    // Its use is recorded, without a write per request.
    let keys_url = format!("{api_a}/v1/admin/tenants/newco/keys");
    let listed = eventually(15, "the key's last use recorded", || async {
        let (_, list) = call(http, Method::GET, &keys_url, ADMIN, None).await;
        list["data"]
            .as_array()?
            .first()
            .filter(|k| !k["last_used_at"].is_null())
            .cloned()
    })
    .await;
    assert_eq!(
        (&listed["id"], &listed["application"]),
        (&json!(key_id), &json!("nightly"))
    );
    assert!(
        listed.get("key").is_none(),
        "a listing never shows the secret: {listed}"
    );

    // The database holds the key's digest, never the key.
    let rows: Vec<String> = sqlx::query_scalar("SELECT row_to_json(k)::text FROM api_keys k")
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
    assert!(
        rows.iter().all(|r| !r.contains(&secret[3..])),
        "a stored key in clear: {rows:?}"
    );
    let digest: Vec<u8> = sqlx::query_scalar("SELECT key_sha256 FROM api_keys WHERE id = $1::uuid")
        .bind(&key_id)
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(digest, sha2::Sha256::digest(secret.as_bytes()).to_vec());

    // Revoked through the third process: refused by every process within a second.
    let (status, revoked) = call(
        http,
        Method::DELETE,
        &format!("{api_c}/v1/admin/tenants/newco/keys/{key_id}"),
        ADMIN,
        None,
    )
    .await;
    assert_eq!(status, 200, "{revoked}");
    assert!(!revoked["revoked_at"].is_null(), "{revoked}");
    everywhere_within_a_second(
        http,
        &[&api_a, &api_b, &api_c],
        &secret,
        401,
        "the revoked key refused",
    )
    .await;
    // A tenant's weight changed on one process is the gate's on another.
    let (status, changed) = call(
        http,
        Method::PATCH,
        &format!("{api_b}/v1/admin/tenants/newco"),
        ADMIN,
        Some(&json!({"weight": 5, "limits": {"rpm": 60}})),
    )
    .await;
    assert_eq!(status, 200, "{changed}");
    assert_eq!(
        (
            &changed["weight"],
            &changed["limits"],
            &changed["budgets"][0]["window"]
        ),
        (&json!(5), &json!({"rpm": 60}), &json!("month"))
    );
    let rpm: f64 = eventually(5, "the new rpm synced to its bucket", || async {
        let capacity: Option<f64> =
            sqlx::query_scalar("SELECT capacity FROM buckets WHERE key = 'tenant:newco:rpm'")
                .fetch_optional(&app.db.pool)
                .await
                .unwrap();
        capacity.filter(|c| *c == 60.0)
    })
    .await;
    assert_eq!(rpm, 60.0);
    c.shutdown().await;
    b.shutdown().await;
    app.shutdown().await;
}

#[tokio::test]
async fn the_admin_api_names_what_it_refuses() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..admin_options()
    })
    .await;
    let http = &app.http;
    use reqwest::Method;
    let url = |path: &str| app.url(path);
    let post = |path: &str, body: Value| {
        let url = url(path);
        async move { call(http, Method::POST, &url, ADMIN, Some(&body)).await }
    };

    let (status, e) = call(http, Method::GET, &url("/v1/admin/tenants"), ACME, None).await;
    assert_eq!((status, &e["error"]["code"]), (403, &json!("admin_only")));
    let (status, _) = call(http, Method::GET, &url("/v1/admin/tenants"), "tk-nobody", None).await;
    assert_eq!(status, 401);
    let (status, list) = call(http, Method::GET, &url("/v1/admin/tenants"), ADMIN, None).await;
    assert_eq!(status, 200);
    let names: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["acme", "globex"], "the file's tenants are seeded");
    assert_eq!(list["data"][0]["source"], "file");

    for (body, param) in [
        (json!({"name": "a:b"}), "name"),
        (json!({"name": "ok", "weight": 0}), "weight"),
        (json!({"name": "ok", "limits": {"rpm": 0}}), "limits.rpm"),
        (
            json!({"name": "ok", "budgets": [{"window": "day", "usd": -1}]}),
            "budgets[0].usd",
        ),
        (json!({"name": "ok", "parent": "nobody"}), "parent"),
    ] {
        let (status, e) = post("/v1/admin/tenants", body.clone()).await;
        assert_eq!(
            (status, &e["error"]["param"]),
            (400, &json!(param)),
            "{body}: {e}"
        );
    }
    let (status, e) = post(
        "/v1/admin/tenants",
        json!({"name": "ok", "budgets": [{"window": "year", "usd": 1}]}),
    )
    .await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (400, &json!("invalid_request")),
        "{e}"
    );
    let (status, e) = post("/v1/admin/tenants", json!({"name": "acme"})).await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (409, &json!("already_exists")),
        "{e}"
    );

    // Parents: a loop is refused; a parent with children cannot go.
    assert_eq!(post("/v1/admin/tenants", json!({"name": "unit"})).await.0, 201);
    assert_eq!(
        post("/v1/admin/tenants", json!({"name": "team", "parent": "unit"}))
            .await
            .0,
        201
    );
    let (status, e) = call(
        http,
        Method::PATCH,
        &url("/v1/admin/tenants/unit"),
        ADMIN,
        Some(&json!({"parent": "team"})),
    )
    .await;
    assert_eq!((status, &e["error"]["param"]), (400, &json!("parent")), "{e}");
    let (status, e) = call(http, Method::DELETE, &url("/v1/admin/tenants/unit"), ADMIN, None).await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (409, &json!("tenant_in_use")),
        "{e}"
    );

    // A tenant with work not finished cannot go; one without can, and its keys with it.
    let (_, key) = post("/v1/admin/tenants/team/keys", json!({})).await;
    let secret = key["key"].as_str().unwrap().to_owned();
    let (status, queued) = eventually(5, "the key accepted", || async {
        let (status, body) = app.submit(&secret, &job("fast", "waits")).await;
        (status == 202).then_some((status, body))
    })
    .await;
    assert_eq!(status, 202);
    let (status, e) = call(http, Method::DELETE, &url("/v1/admin/tenants/team"), ADMIN, None).await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (409, &json!("tenant_in_use")),
        "{e}"
    );
    let (status, cancelled) = app
        .post(
            &secret,
            &format!("/v1/jobs/{}/cancel", queued["id"].as_str().unwrap()),
            &json!({}),
        )
        .await;
    assert_eq!(status, 200, "{cancelled}");
    let (status, e) = call(http, Method::DELETE, &url("/v1/admin/tenants/team"), ADMIN, None).await;
    assert_eq!(status, 200, "{e}");
    eventually(5, "the deleted tenant's key refused", || async {
        (app.get(&secret, "/v1/jobs").await.0 == 401).then_some(())
    })
    .await;
    let (status, _) = call(http, Method::GET, &url("/v1/admin/tenants/team"), ADMIN, None).await;
    assert_eq!(status, 404);
    let (status, _) = call(
        http,
        Method::DELETE,
        &url("/v1/admin/tenants/acme/keys/not-a-uuid"),
        ADMIN,
        None,
    )
    .await;
    assert_eq!(status, 404);
    let (status, e) = post("/v1/admin/tenants/unit/keys", json!({"expires_at": "yesterday"})).await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (400, &json!("invalid_request")),
        "{e}"
    );

    // An expired key is refused.
    let past = (chrono::Utc::now() - chrono::Duration::seconds(1)).to_rfc3339();
    let (_, expired) = post("/v1/admin/tenants/unit/keys", json!({"expires_at": past})).await;
    let (_, live) = post("/v1/admin/tenants/unit/keys", json!({})).await;
    eventually(5, "the live key accepted", || async {
        (app.get(live["key"].as_str().unwrap(), "/v1/jobs").await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(app.get(expired["key"].as_str().unwrap(), "/v1/jobs").await.0, 401);
    app.shutdown().await;
}

/// USD per million tokens (input and output) of gpt-4o-mini in the budget test: a token
/// costs a thousandth of a dollar.
const PRICE_PER_MTOK: f64 = 1000.0;

/// Two processes sharing a database, gpt-4o-mini at [`PRICE_PER_MTOK`], and their API
/// addresses.
async fn two_priced_processes() -> (TestApp, tollgate_api::broker::Broker, [String; 2]) {
    let app = TestApp::spawn_with(TestOptions {
        peers: 1,
        extra_config: format!(
            "[providers.prices.\"gpt-4o-mini\"]\ninput_per_mtok = {PRICE_PER_MTOK}\noutput_per_mtok = {PRICE_PER_MTOK}\n"
        ),
        ..admin_options()
    })
    .await;
    let b = app.spawn_peer(Roles::ALL).await;
    let apis = [app.api.clone(), format!("http://{}", b.addr.unwrap())];
    (app, b, apis)
}

#[tokio::test]
async fn a_key_s_budget_and_its_tenant_s_parent_s_hold_across_processes() {
    let (app, b, apis) = two_priced_processes().await;
    let http = &app.http;
    use reqwest::Method;
    let (parent_usd, key_usd) = (0.5, 0.2);
    let admin = |path: &str, body: Value| {
        let url = app.url(path);
        async move { call(http, Method::POST, &url, ADMIN, Some(&body)).await }
    };
    let (status, e) = admin(
        "/v1/admin/tenants",
        json!({"name": "unit", "budgets": [{"window": "month", "usd": parent_usd}]}),
    )
    .await;
    assert_eq!(status, 201, "{e}");
    for team in ["team-a", "team-b"] {
        assert_eq!(
            admin("/v1/admin/tenants", json!({"name": team, "parent": "unit"}))
                .await
                .0,
            201
        );
    }
    // team-a's key has a monthly budget of its own; team-b's has none.
    let (status, capped) = admin(
        "/v1/admin/tenants/team-a/keys",
        json!({"name": "capped", "budgets": [{"window": "month", "usd": key_usd}]}),
    )
    .await;
    assert_eq!(status, 201, "{capped}");
    assert_eq!(capped["budgets"], json!([{"window": "month", "usd": key_usd}]));
    let (_, open) = admin("/v1/admin/tenants/team-b/keys", json!({})).await;
    let secrets = [
        capped["key"].as_str().unwrap().to_owned(),
        open["key"].as_str().unwrap().to_owned(),
    ];
    for secret in &secrets {
        everywhere_within_a_second(http, &[&apis[0], &apis[1]], secret, 200, "the key accepted").await;
    }
    let (_, limits) = call(
        http,
        Method::GET,
        &format!("{}/v1/limits", apis[1]),
        &secrets[0],
        None,
    )
    .await;
    let buckets: Vec<&str> = limits["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["bucket"].as_str())
        .collect();
    let key_bucket = format!("apikey:{}:monthly_spend", capped["id"].as_str().unwrap());
    assert!(buckets.contains(&key_bucket.as_str()), "{buckets:?}");
    assert!(
        buckets.contains(&"tenant:unit:monthly_spend"),
        "a parent's budget applies: {buckets:?}"
    );

    // Each job reserves about 42 tokens ($0.042): each key asks for $0.84 through both
    // processes, against the capped key's $0.20 and the parent's $0.50.
    let deadline = (chrono::Utc::now() + chrono::Duration::seconds(20)).to_rfc3339();
    let mut ids = Vec::new();
    for i in 0..20 {
        for (k, secret) in secrets.iter().enumerate() {
            let mut body = job("oai/gpt-4o-mini", &format!("job {i}"));
            body["deadline"] = json!(deadline);
            // More than the budgets hold, all accepted: the gate is what holds them.
            body["on_deadline_risk"] = json!("accept");
            let api = &apis[(i + k) % 2];
            let (status, accepted) =
                call(http, Method::POST, &format!("{api}/v1/jobs"), secret, Some(&body)).await;
            assert_eq!(status, 202, "{accepted}");
            ids.push((k, secret.clone(), accepted["id"].as_str().unwrap().to_owned()));
        }
    }
    let mut charged = [Vec::new(), Vec::new()];
    for (k, secret, id) in &ids {
        let done = crate::harness::wait_finished_at(http, &apis[0], secret, id, 60).await;
        match done["state"].as_str() {
            Some("succeeded") => charged[*k].push(done["cost"]["charged_usd"].as_f64().unwrap()),
            _ => assert_eq!(done["error"]["code"], "deadline_unmeetable", "{done}"),
        }
        assert_eq!(
            done["api_key"],
            json!(if *k == 0 { &capped["id"] } else { &open["id"] })
        );
    }
    let spent = |c: &[f64]| c.iter().sum::<f64>();
    let largest = charged.iter().flatten().copied().fold(0.0, f64::max);
    let (by_capped, total) = (spent(&charged[0]), spent(&charged[0]) + spent(&charged[1]));
    assert!(
        by_capped <= key_usd + largest + 1e-9,
        "the capped key spent ${by_capped} against its ${key_usd} (largest job ${largest})"
    );
    assert!(
        total <= parent_usd + largest + 1e-9,
        "the children spent ${total} against their parent's ${parent_usd} (largest job ${largest})"
    );
    assert!(
        by_capped > key_usd / 2.0,
        "the key's budget was used (${by_capped})"
    );
    assert!(
        total > parent_usd / 2.0,
        "the parent's budget was used (${total})"
    );
    assert!(
        charged[0].len() < 20 && charged[0].len() + charged[1].len() < 40,
        "budgets stopped jobs"
    );

    // Usage by key and application sums the jobs' costs.
    let (status, usage) = call(
        http,
        Method::GET,
        &app.url("/v1/usage?group_by=tenant,key"),
        ADMIN,
        None,
    )
    .await;
    assert_eq!(status, 200, "{usage}");
    let row = |key: &Value| {
        usage["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["key"] == *key)
            .cloned()
            .unwrap_or(Value::Null)
    };
    let capped_row = row(&capped["id"]);
    assert_eq!(capped_row["tenant"], "team-a", "{usage}");
    assert!(
        (capped_row["usd"].as_f64().unwrap() - by_capped).abs() < 1e-9,
        "{capped_row} vs {by_capped}"
    );
    b.shutdown().await;
    app.shutdown().await;
}

/// `text` with one more tenant, `name`, whose key is `key`.
fn with_tenant(text: &str, name: &str, key: &str) -> String {
    text.replacen(
        "[[tenants]]",
        &format!("[[tenants]]\nname = \"{name}\"\napi_key = \"{key}\"\n\n[[tenants]]"),
        1,
    )
}

/// Replaces the file at `path` at once (a reader sees the old text or the new).
fn write_atomically(path: &std::path::Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

#[tokio::test]
async fn sighup_applies_the_file_s_tenants_without_stopping_calls_in_flight() {
    use nix::sys::signal::Signal;
    use tollgate_mock::MockProvider;

    use crate::durability::{Serve, free_port};
    use crate::harness::{config_text, fresh_db_with, mock_config, serve_connections};

    let db = fresh_db_with(serve_connections()).await;
    let mut mock = mock_config();
    mock.latency_ms = 1500;
    let local_mock = MockProvider::new(mock).start_local().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let text = config_text(local_mock.addr, "");
    write_atomically(&path, &text);
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let jobs_answer = |key: &'static str| {
        let (http, url) = (http.clone(), format!("{api}/v1/jobs"));
        async move { call(&http, reqwest::Method::GET, &url, key, None).await.0 }
    };
    let mut serve = Serve::start(&path, &db.url, port);
    serve.wait_ready(&api).await;

    let (status, accepted) = call(
        &http,
        reqwest::Method::POST,
        &format!("{api}/v1/jobs"),
        ACME,
        Some(&job("fast", "slow")),
    )
    .await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["id"].as_str().unwrap().to_owned();
    eventually(10, "the call in flight", || async {
        let (_, j) = call(
            &http,
            reqwest::Method::GET,
            &format!("{api}/v1/jobs/{id}"),
            ACME,
            None,
        )
        .await;
        (j["state"] == "running").then_some(())
    })
    .await;
    // A tenant added to the file takes effect on SIGHUP.
    write_atomically(&path, &with_tenant(&text, "late", "tk-late-tenant"));
    assert_eq!(jobs_answer("tk-late-tenant").await, 401);
    serve.signal(Signal::SIGHUP);
    eventually(10, "the file's new tenant accepted", || async {
        (jobs_answer("tk-late-tenant").await == 200).then_some(())
    })
    .await;
    let done = crate::harness::wait_finished_at(&http, &api, ACME, &id, 30).await;
    assert_eq!(done["state"], "succeeded", "the call in flight went on: {done}");
    assert!(
        serve.child.try_wait().unwrap().is_none(),
        "SIGHUP does not stop the server"
    );

    // A file that does not load changes nothing, and the server goes on: the next good
    // file (signals are handled in order) is applied after it.
    write_atomically(&path, "not toml [");
    serve.signal(Signal::SIGHUP);
    write_atomically(&path, &with_tenant(&text, "later", "tk-later-tenant"));
    serve.signal(Signal::SIGHUP);
    eventually(10, "the next good file applied", || async {
        (jobs_answer("tk-later-tenant").await == 200).then_some(())
    })
    .await;
    assert!(
        serve.child.try_wait().unwrap().is_none(),
        "a bad file does not stop the server"
    );
    assert_eq!(
        jobs_answer("tk-late-tenant").await,
        200,
        "a tenant the file no longer names stays"
    );
    serve.signal(Signal::SIGTERM);
    assert!(serve.child.wait().unwrap().success());
    local_mock.shutdown().await;
}

#[tokio::test]
async fn the_cli_creates_tenants_and_keys_and_revokes_them() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..admin_options()
    })
    .await;
    let tollgate = |args: &'static [&'static str]| crate::cli::tollgate(&app, ADMIN, args);
    let (code, out, err) = tollgate(&[
        "tenants",
        "create",
        "newco",
        "--weight",
        "2",
        "--rpm",
        "60",
        "--monthly-usd",
        "25",
    ])
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("rpm 60") && out.contains("$25.00/month"), "{out}");
    let (code, out, err) = tollgate(&["tenants", "update", "newco", "--daily-usd", "1.5"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("$25.00/month") && out.contains("$1.50/day"),
        "budgets not named stay: {out}"
    );
    // An application's limits and budgets: set, then removed; the tenant's stay.
    let (code, out, err) = tollgate(&[
        "tenants",
        "update",
        "newco",
        "--application",
        "chatbot",
        "--rpm",
        "30",
        "--daily-usd",
        "2",
    ])
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("chatbot: rpm 30, $2.00/day") && out.contains("rpm 60"),
        "{out}"
    );
    let (code, out, err) = tollgate(&["tenants", "update", "newco", "--remove-application", "chatbot"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains("chatbot") && out.contains("$1.50/day"), "{out}");
    let (code, out, _) = tollgate(&["tenants", "list"]).await;
    assert_eq!(code, 0);
    for name in ["acme", "globex", "newco"] {
        assert!(out.lines().any(|l| l.starts_with(name)), "{name} in\n{out}");
    }
    let (code, out, err) = tollgate(&[
        "keys",
        "create",
        "newco",
        "--name",
        "ci",
        "--monthly-usd",
        "5",
        "--json",
    ])
    .await;
    assert_eq!(code, 0, "{out}{err}");
    let key: Value = serde_json::from_str(&out).unwrap();
    let (secret, id) = (
        key["key"].as_str().unwrap().to_owned(),
        key["id"].as_str().unwrap().to_owned(),
    );
    assert_eq!(key["budgets"], json!([{"window": "month", "usd": 5.0}]));
    eventually(5, "the new key accepted", || async {
        (app.get(&secret, "/v1/jobs").await.0 == 200).then_some(())
    })
    .await;
    let (code, out, _) = crate::cli::tollgate(&app, ADMIN, &["keys", "list", "newco"]).await;
    assert_eq!(code, 0);
    assert!(out.contains(&id) && !out.contains(&secret), "{out}");
    let (code, out, err) = crate::cli::tollgate(&app, ADMIN, &["keys", "revoke", "newco", &id]).await;
    assert_eq!(code, 0, "{out}{err}");
    eventually(5, "the revoked key refused", || async {
        (app.get(&secret, "/v1/jobs").await.0 == 401).then_some(())
    })
    .await;
    // Provider keys: the file's disabled and enabled again, listed.
    let (code, out, err) =
        crate::cli::tollgate(&app, ADMIN, &["provider-keys", "disable", "oai", "k1"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("oai/k1 disabled"), "{out}");
    let (_, out, _) = crate::cli::tollgate(&app, ADMIN, &["provider-keys", "list"]).await;
    let k1 = out
        .lines()
        .find(|l| l.starts_with("oai") && l.contains("k1"))
        .unwrap_or_default();
    assert!(k1.contains("file") && k1.contains("yes"), "{out}");
    let (code, out, _) = crate::cli::tollgate(&app, ADMIN, &["provider-keys", "enable", "oai", "k1"]).await;
    assert_eq!(code, 0, "{out}");
    // A tenant key is not the admin's: one message, exit 1.
    let (code, _, err) = crate::cli::tollgate(&app, ACME, &["tenants", "list"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("admin_only"), "{err}");
    app.shutdown().await;
}

/// Runs `n` jobs of acme through `apis` in turn, each to its end; their ids.
async fn run_jobs(http: &reqwest::Client, apis: &[&str], n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let api = apis[i % apis.len()];
        let (status, accepted) = call(
            http,
            reqwest::Method::POST,
            &format!("{api}/v1/jobs"),
            ACME,
            Some(&job("fast", "hi")),
        )
        .await;
        assert_eq!(status, 202, "{accepted}");
        let id = accepted["id"].as_str().unwrap().to_owned();
        let done = crate::harness::wait_finished_at(http, api, ACME, &id, 30).await;
        assert_eq!(done["state"], "succeeded", "{done}");
        ids.push(id);
    }
    ids
}

/// The provider key each of `ids` was sent with.
async fn keys_used(pool: &sqlx::PgPool, ids: &[String]) -> Vec<String> {
    let mut used: Vec<String> = sqlx::query_scalar(
        "SELECT provider_key FROM jobs WHERE id = ANY($1::uuid[]) AND state = 'succeeded'",
    )
    .bind(ids)
    .fetch_all(pool)
    .await
    .unwrap();
    used.sort();
    used.dedup();
    used
}

#[tokio::test]
async fn a_provider_key_added_at_runtime_serves_and_a_disabled_one_stops() {
    let mut mock = crate::harness::mock_config();
    mock.projects[0].keys.push("sk-runtime-2".into());
    let app = TestApp::spawn_with(TestOptions {
        peers: 1,
        mock,
        ..admin_options()
    })
    .await;
    let b = app.spawn_peer(Roles::ALL).await;
    let api_b = format!("http://{}", b.addr.unwrap());
    let http = &app.http;
    use reqwest::Method;
    let url = |path: &str| app.url(path);

    // Refusals name the field.
    for (body, param) in [
        (
            json!({"provider": "nope", "name": "k2", "value": "sk-x"}),
            "provider",
        ),
        (json!({"provider": "oai", "name": "k1", "value": "sk-x"}), "name"),
        (json!({"provider": "oai", "name": "k2", "value": "sk x"}), "value"),
        (
            json!({"provider": "oai", "name": "k2", "value": "sk-x", "models": ["gpt-5"]}),
            "models",
        ),
        (
            json!({"provider": "oai", "name": "k2", "value": "sk-x", "account": ""}),
            "account",
        ),
    ] {
        let (status, e) = call(
            http,
            Method::POST,
            &url("/v1/admin/provider-keys"),
            ADMIN,
            Some(&body),
        )
        .await;
        assert_eq!(
            (status / 100, &e["error"]["param"]),
            (4, &json!(param)),
            "{body}: {e}"
        );
    }
    let (status, e) = call(
        http,
        Method::PATCH,
        &url("/v1/admin/provider-keys/oai/k1"),
        ADMIN,
        Some(&json!({"value": "sk-y"})),
    )
    .await;
    assert_eq!(status, 400, "a key of the file changes in the file: {e}");
    let (status, _) = call(
        http,
        Method::DELETE,
        &url("/v1/admin/provider-keys/oai/k1"),
        ADMIN,
        None,
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = call(
        http,
        Method::PATCH,
        &url("/v1/admin/provider-keys/oai/nope"),
        ADMIN,
        Some(&json!({"disabled": true})),
    )
    .await;
    assert_eq!(status, 404);

    // Added through one process, the file's key disabled through the other: every job is
    // sent with the new key.
    let (status, added) = call(
        http,
        Method::POST,
        &url("/v1/admin/provider-keys"),
        ADMIN,
        Some(&json!({"provider": "oai", "name": "k2", "value": "sk-runtime-2", "models": ["gpt-4o-mini"]})),
    )
    .await;
    assert_eq!(status, 201, "{added}");
    assert!(
        added.get("value").is_none() && !added.to_string().contains("sk-runtime-2"),
        "{added}"
    );
    let (status, disabled) = call(
        http,
        Method::PATCH,
        &format!("{api_b}/v1/admin/provider-keys/oai/k1"),
        ADMIN,
        Some(&json!({"disabled": true})),
    )
    .await;
    assert_eq!(
        (status, &disabled["disabled"], &disabled["source"]),
        (200, &json!(true), &json!("file")),
        "{disabled}"
    );
    let apis = [app.api.as_str(), api_b.as_str()];
    let served = eventually(5, "jobs sent with the new key only", || async {
        let ids = run_jobs(http, &apis, 6).await;
        let used = keys_used(&app.db.pool, &ids).await;
        (used == ["k2"]).then_some(used)
    })
    .await;
    assert_eq!(served, ["k2"]);

    // The file's key enabled and the new one disabled: back to the file's.
    call(
        http,
        Method::PATCH,
        &url("/v1/admin/provider-keys/oai/k1"),
        ADMIN,
        Some(&json!({"disabled": false})),
    )
    .await;
    let (status, _) = call(
        http,
        Method::PATCH,
        &url("/v1/admin/provider-keys/oai/k2"),
        ADMIN,
        Some(&json!({"disabled": true})),
    )
    .await;
    assert_eq!(status, 200);
    eventually(5, "jobs sent with the file's key only", || async {
        let ids = run_jobs(http, &apis, 6).await;
        (keys_used(&app.db.pool, &ids).await == ["k1"]).then_some(())
    })
    .await;

    // Listed with the file's keys, never with a value; stored sealed.
    let (_, list) = call(http, Method::GET, &url("/v1/admin/provider-keys"), ADMIN, None).await;
    let listed: Vec<(String, String, bool)> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["provider"] == "oai")
        .map(|k| {
            (
                k["name"].as_str().unwrap().to_owned(),
                k["source"].as_str().unwrap().to_owned(),
                k["disabled"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("k1".to_owned(), "file".to_owned(), false),
            ("k2".to_owned(), "api".to_owned(), true)
        ]
    );
    assert!(!list.to_string().contains("sk-runtime-2") && !list.to_string().contains("sk-test-1"));
    let rows: Vec<String> = sqlx::query_scalar("SELECT row_to_json(p)::text FROM provider_keys p")
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
    assert!(
        rows.iter().all(|r| !r.contains("sk-runtime-2")),
        "a provider key in clear: {rows:?}"
    );
    assert!(rows.iter().any(|r| r.contains("sealed:v1:")), "{rows:?}");
    let (status, _) = call(
        http,
        Method::DELETE,
        &url("/v1/admin/provider-keys/oai/k2"),
        ADMIN,
        None,
    )
    .await;
    assert_eq!(status, 200);
    b.shutdown().await;
    app.shutdown().await;
}

#[tokio::test]
async fn a_budget_reaching_80_percent_is_announced_once_to_its_tenant_s_webhooks() {
    let app = TestApp::spawn_with(TestOptions {
        extra_config: format!(
            "[providers.prices.\"gpt-4o-mini\"]\ninput_per_mtok = {PRICE_PER_MTOK}\noutput_per_mtok = {PRICE_PER_MTOK}\n\
             [webhooks]\nallow_private_addresses = true\n\
             [[webhooks.endpoints]]\ntenant = \"acme\"\nurl = \"http://127.0.0.1:9/hook\"\n\
             secret = \"{}\"\n",
            tollgate::webhook_signing::Secret::generate()
        ),
        ..admin_options()
    })
    .await;
    let http = &app.http;
    // A job costs about $0.022 and reserves about $0.042: four reach 80 % of $0.10.
    let (status, e) = call(
        http,
        reqwest::Method::PATCH,
        &app.url("/v1/admin/tenants/acme"),
        ADMIN,
        Some(&json!({"budgets": [{"window": "day", "usd": 0.1}]})),
    )
    .await;
    assert_eq!(status, 200, "{e}");
    // The budget is in force once this process's snapshot is as new as a later change: a
    // key made after it is accepted.
    let (_, later) = app.post(ADMIN, "/v1/admin/tenants/acme/keys", &json!({})).await;
    let later = later["key"].as_str().unwrap().to_owned();
    eventually(5, "the budget in force", || async {
        (app.get(&later, "/v1/jobs").await.0 == 200).then_some(())
    })
    .await;
    let events = || async {
        let bodies: Vec<String> = sqlx::query_scalar(
            "SELECT body FROM webhook_deliveries WHERE event_type = 'budget.threshold' ORDER BY created_at",
        )
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
        bodies
            .iter()
            .map(|b| serde_json::from_str::<Value>(b).unwrap())
            .collect::<Vec<_>>()
    };
    // Jobs asking for 12 output tokens reserve about what they cost (~$0.022): each
    // maintenance pass after one announces nothing until 80 % of $0.10 is spent, then
    // exactly once, however many passes follow. No job is sent past 80 %: the next one
    // would wait for the day's window to end (or, if that is after its deadline, fail).
    let maintenance =
        tollgate_workers::maintenance::Maintenance::new(app.db.pool.clone(), Duration::from_secs(1));
    let mut spent = 0.0;
    for i in 0..5 {
        let mut body = job("oai/gpt-4o-mini", &format!("job {i}"));
        body["request"]["max_tokens"] = json!(12);
        let (status, accepted) = app.submit(ACME, &body).await;
        assert_eq!(status, 202, "{accepted}");
        let done = app.wait_job(ACME, accepted["id"].as_str().unwrap(), 30).await;
        assert_eq!(done["state"], "succeeded", "{done}");
        spent += done["cost"]["charged_usd"].as_f64().unwrap();
        maintenance.run_once(chrono::Utc::now()).await.unwrap();
        if spent < 0.08 - 1e-9 {
            let announced = events().await;
            assert!(announced.is_empty(), "announced at ${spent}: {announced:?}");
            continue;
        }
        // This pass, or the broker's own maintenance racing it, announced it once.
        eventually(5, "the 80 % announcement", || async {
            (!events().await.is_empty()).then_some(())
        })
        .await;
        maintenance.run_once(chrono::Utc::now()).await.unwrap();
        let announced = events().await;
        assert_eq!(announced.len(), 1, "at ${spent}: {announced:?}");
        break;
    }
    assert!(spent >= 0.08, "the jobs reached 80 % (${spent})");
    let announced = events().await;
    let data = &announced[0]["data"];
    assert_eq!(
        (
            &data["tenant"],
            &data["holder"],
            &data["window"],
            &data["threshold"],
            &data["budget_usd"]
        ),
        (
            &json!("acme"),
            &json!("tenant"),
            &json!("day"),
            &json!(0.8),
            &json!(0.1)
        ),
        "{data}"
    );
    assert!(data["spent_usd"].as_f64().unwrap() >= 0.08, "{data}");
    assert!(
        announced.iter().all(|e| e["data"]["threshold"] != json!(1.0)) || spent >= 0.1 - 1e-9,
        "100 % only when all of it is spent: {announced:?}"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn apply_prints_the_file_s_difference_and_applies_it_unless_dry() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..admin_options()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let text = with_tenant(
        &crate::harness::config_text(app.mock_addr, ""),
        "gitops",
        "tk-gitops-tenant",
    )
    .replacen("weight = 3", "weight = 2", 1);
    std::fs::write(&path, &text).unwrap();
    let file = path.to_str().unwrap();
    let env = [("DATABASE_URL", app.db.url.as_str())];

    let (code, out, err) = crate::cli::run(&env, &["apply", file, "--dry-run"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("+ tenant gitops: weight 1"), "{out}");
    assert!(out.contains("~ tenant acme: weight 3 → 2"), "{out}");
    assert!(out.contains("dry run: 1 created, 1 updated"), "{out}");
    let (status, _) = app.get(ADMIN, "/v1/admin/tenants/gitops").await;
    assert_eq!(status, 404, "a dry run changes nothing");

    let (code, out, err) = crate::cli::run(&env, &["apply", file]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("applied: 1 created, 1 updated, 1 key(s) set"),
        "{out}"
    );
    within_a_second("the applied tenant's key accepted", || async {
        app.get("tk-gitops-tenant", "/v1/jobs").await.0 == 200
    })
    .await;
    let (_, acme) = app.get(ADMIN, "/v1/admin/tenants/acme").await;
    assert_eq!(acme["weight"], 2);
    let (code, out, _) = crate::cli::run(&env, &["apply", file]).await;
    assert_eq!(code, 0);
    assert!(out.contains("nothing to change"), "{out}");
    app.shutdown().await;
}

#[tokio::test]
async fn a_key_s_scopes_hold_its_jobs_to_its_models_endpoints_classes_and_priority() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..admin_options()
    })
    .await;
    let scopes = json!({"models": ["fast"], "endpoints": ["/v1/chat/completions"],
                        "classes": ["interactive", "standard"], "max_priority": 10});
    let (status, key) = app
        .post(
            ADMIN,
            "/v1/admin/tenants/acme/keys",
            &json!({"name": "narrow", "scopes": scopes}),
        )
        .await;
    assert_eq!((status, &key["scopes"]), (201, &scopes), "{key}");
    let secret = key["key"].as_str().unwrap().to_owned();
    eventually(5, "the key accepted", || async {
        (app.get(&secret, "/v1/jobs").await.0 == 200).then_some(())
    })
    .await;
    let (status, ok) = app.submit(&secret, &job("fast", "allowed")).await;
    assert_eq!(status, 202, "{ok}");
    let refused = |body: Value, param: &'static str| {
        let secret = secret.clone();
        let app = &app;
        async move {
            let (status, e) = app.submit(&secret, &body).await;
            assert_eq!(
                (status, e["error"]["code"].as_str(), e["error"]["param"].as_str()),
                (403, Some("key_not_permitted"), Some(param)),
                "{body}: {e}"
            );
        }
    };
    refused(job("oai/gpt-4o-mini", "another model"), "model").await;
    let mut background = job("fast", "another class");
    background["class"] = json!("background");
    refused(background, "class").await;
    let mut urgent = job("fast", "too urgent");
    urgent["priority"] = json!(50);
    refused(urgent, "priority").await;
    let mut embeddings = json!({"endpoint": "/v1/embeddings", "request": {"model": "fast", "input": "x"}});
    embeddings["class"] = json!("standard");
    refused(embeddings, "endpoint").await;
    // The synchronous endpoints and batches keep to them too.
    let (status, e) = app
        .post(&secret, "/v1/embeddings", &json!({"model": "fast", "input": "x"}))
        .await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (403, Some("endpoint")),
        "{e}"
    );
    let line = json!({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "fast", "messages": [{"role": "user", "content": "hi"}]}});
    let (status, file) =
        crate::batches::upload(&app.http, &app.api, &secret, format!("{line}\n").as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    let (status, e) = crate::batches::create_batch(
        &app.http,
        &app.api,
        &secret,
        &crate::batches::batch_body(file["id"].as_str().unwrap()),
    )
    .await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (403, Some("class")),
        "a batch is class batch: {e}"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn a_route_added_on_one_process_resolves_on_another_and_follows_its_changes() {
    let app = TestApp::spawn_with(TestOptions {
        peers: 1,
        ..admin_options()
    })
    .await;
    let b = app.spawn_peer(Roles::ALL).await;
    let api_b = format!("http://{}", b.addr.unwrap());
    let http = &app.http;
    use reqwest::Method;
    let url = |path: &str| app.url(path);
    let submit_b = |model: &'static str| {
        let url = format!("{api_b}/v1/jobs");
        async move { call(http, Method::POST, &url, ACME, Some(&job(model, "hi"))).await }
    };
    assert_eq!(submit_b("smart").await.0, 400, "no such model yet");

    // The file's routes are listed and stay the file's.
    let (status, e) = call(
        http,
        Method::POST,
        &url("/v1/admin/routes"),
        ADMIN,
        Some(&json!({"alias": "fast", "targets": ["oai/gpt-4o-mini"]})),
    )
    .await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (409, &json!("already_exists")),
        "{e}"
    );
    let (status, e) = call(
        http,
        Method::PATCH,
        &url("/v1/admin/routes/fast"),
        ADMIN,
        Some(&json!({"targets": ["oai/gpt-4o-mini"]})),
    )
    .await;
    assert_eq!(status, 400, "{e}");
    let (status, e) = call(
        http,
        Method::POST,
        &url("/v1/admin/routes"),
        ADMIN,
        Some(&json!({"alias": "smart", "targets": ["oai/gpt-5"]})),
    )
    .await;
    assert_eq!((status, &e["error"]["param"]), (400, &json!("targets[0]")), "{e}");

    let (status, route) = call(
        http,
        Method::POST,
        &url("/v1/admin/routes"),
        ADMIN,
        Some(&json!({"alias": "smart", "targets": ["oai/gpt-4o-mini"], "limits": {"rpm": 600}})),
    )
    .await;
    assert_eq!((status, &route["source"]), (201, &json!("api")), "{route}");
    within_a_second("the new route resolved on the other process", || async {
        submit_b("smart").await.0 == 202
    })
    .await;
    let (_, accepted) = submit_b("smart").await;
    let done =
        crate::harness::wait_finished_at(http, &api_b, ACME, accepted["id"].as_str().unwrap(), 30).await;
    assert_eq!(
        (&done["state"], &done["provider"]),
        (&json!("succeeded"), &json!("oai")),
        "{done}"
    );
    let (_, models) = call(http, Method::GET, &format!("{api_b}/v1/models"), ACME, None).await;
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == "smart"),
        "{models}"
    );

    // Its targets changed: its next jobs go there.
    let (status, changed) = call(
        http,
        Method::PATCH,
        &url("/v1/admin/routes/smart"),
        ADMIN,
        Some(&json!({"targets": ["ant/claude-3-5-haiku-latest"]})),
    )
    .await;
    assert_eq!(
        (status, &changed["limits"]),
        (200, &json!({"rpm": 600})),
        "limits not given stay: {changed}"
    );
    eventually(5, "the route's new target serving", || async {
        let (_, accepted) = submit_b("smart").await;
        let done = crate::harness::wait_finished_at(http, &api_b, ACME, accepted["id"].as_str()?, 30).await;
        (done["provider"] == "ant").then_some(())
    })
    .await;
    let (_, list) = call(http, Method::GET, &url("/v1/admin/routes"), ADMIN, None).await;
    let aliases: Vec<(&str, &str)> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["alias"].as_str().unwrap(), r["source"].as_str().unwrap()))
        .collect();
    assert_eq!(aliases, [("fast", "file"), ("smart", "api")]);

    // Removed: refused again everywhere.
    let (status, _) = call(http, Method::DELETE, &url("/v1/admin/routes/smart"), ADMIN, None).await;
    assert_eq!(status, 200);
    within_a_second("the removed route refused", || async {
        submit_b("smart").await.0 == 400
    })
    .await;
    let (status, _) = call(http, Method::DELETE, &url("/v1/admin/routes/smart"), ADMIN, None).await;
    assert_eq!(status, 404);
    b.shutdown().await;
    app.shutdown().await;
}

#[tokio::test]
async fn an_application_s_budget_holds_across_its_keys_and_jobs_show_what_they_reserved() {
    let (app, b, apis) = two_priced_processes().await;
    let http = &app.http;
    use reqwest::Method;
    let app_usd = 0.2;
    let admin = |method: Method, path: &str, body: Value| {
        let url = app.url(path);
        async move { call(http, method, &url, ADMIN, Some(&body)).await }
    };
    // An application's name is checked as a tenant's, and named by its field.
    let (status, e) = admin(
        Method::POST,
        "/v1/admin/tenants",
        json!({"name": "shop", "applications": {"chat:bot": {}}}),
    )
    .await;
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("applications.chat:bot")),
        "{e}"
    );
    let (status, shop) = admin(
        Method::POST,
        "/v1/admin/tenants",
        json!({"name": "shop", "applications": {"chatbot": {"budgets": [{"window": "day", "usd": app_usd}]}}}),
    )
    .await;
    assert_eq!(status, 201, "{shop}");
    assert_eq!(
        shop["applications"]["chatbot"]["budgets"],
        json!([{"window": "day", "usd": app_usd}])
    );
    // Two keys of the chatbot share its budget; a key of no application is not held to it.
    let mut secrets = Vec::new();
    for (name, application) in [
        ("web", Some("chatbot")),
        ("mobile", Some("chatbot")),
        ("etl", None),
    ] {
        let (status, key) = admin(
            Method::POST,
            "/v1/admin/tenants/shop/keys",
            json!({"name": name, "application": application}),
        )
        .await;
        assert_eq!(status, 201, "{key}");
        let secret = key["key"].as_str().unwrap().to_owned();
        everywhere_within_a_second(http, &[&apis[0], &apis[1]], &secret, 200, "the key accepted").await;
        secrets.push(secret);
    }
    let bucket = "app:shop:chatbot:daily_spend";
    let sees = |secret: &str| {
        let url = format!("{}/v1/limits", apis[1]);
        let secret = secret.to_owned();
        async move {
            let (_, limits) = call(http, Method::GET, &url, &secret, None).await;
            limits["data"]
                .as_array()
                .unwrap()
                .iter()
                .any(|b| b["bucket"] == bucket)
        }
    };
    assert!(
        sees(&secrets[0]).await,
        "a key of the application sees its budget"
    );
    assert!(!sees(ACME).await, "another tenant does not");
    for (key, shown) in [(secrets[0].as_str(), true), (ACME, false)] {
        let (status, page) = call(http, Method::GET, &app.url("/v1/status"), key, None).await;
        assert_eq!(status, 200);
        assert_eq!(
            page.to_string().contains(bucket),
            shown,
            "the status shows the application's budget to its tenant only: {page}"
        );
    }

    // Each job reserves about 42 tokens ($0.042): the application's keys ask for $0.84
    // through both processes against its $0.20; the other key's five all run.
    let deadline = (chrono::Utc::now() + chrono::Duration::seconds(20)).to_rfc3339();
    let mut ids = Vec::new();
    for i in 0..10 {
        for (k, secret) in secrets.iter().enumerate() {
            if k == 2 && i >= 5 {
                continue;
            }
            let mut body = job("oai/gpt-4o-mini", &format!("job {i}"));
            body["deadline"] = json!(deadline);
            // More than the budgets hold, all accepted: the gate is what holds them.
            body["on_deadline_risk"] = json!("accept");
            let api = &apis[(i + k) % 2];
            let (status, accepted) =
                call(http, Method::POST, &format!("{api}/v1/jobs"), secret, Some(&body)).await;
            assert_eq!(status, 202, "{accepted}");
            ids.push((k, secret.clone(), accepted["id"].as_str().unwrap().to_owned()));
        }
    }
    let (mut by_app, mut by_other, mut largest) = (0.0, 0, 0.0f64);
    for (k, secret, id) in &ids {
        let done = crate::harness::wait_finished_at(http, &apis[0], secret, id, 60).await;
        if done["state"] != "succeeded" {
            assert_eq!(done["error"]["code"], "deadline_unmeetable", "{done}");
            assert_ne!(
                *k, 2,
                "the key of no application is not held to its budget: {done}"
            );
            continue;
        }
        let cost = &done["cost"];
        let (reserved, charged) = (
            cost["reserved_usd"].as_f64().unwrap(),
            cost["charged_usd"].as_f64().unwrap(),
        );
        assert_eq!(cost["price_source"], "model", "{done}");
        assert!(
            charged > 0.0 && charged <= reserved + 1e-9,
            "a job is charged no more than it reserved: {cost}"
        );
        largest = largest.max(charged);
        match k {
            2 => by_other += 1,
            _ => by_app += charged,
        }
    }
    assert_eq!(by_other, 5, "every job of the key of no application ran");
    assert!(
        by_app <= app_usd + largest + 1e-9,
        "the application's keys spent ${by_app} against its ${app_usd} (largest job ${largest})"
    );
    assert!(
        by_app > app_usd / 2.0,
        "the application's budget was used (${by_app})"
    );

    // Usage by application sums its keys' jobs.
    let (status, usage) = call(
        http,
        Method::GET,
        &app.url("/v1/usage?group_by=application"),
        &secrets[2],
        None,
    )
    .await;
    assert_eq!(status, 200, "{usage}");
    let chatbot = usage["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["application"] == "chatbot")
        .cloned()
        .unwrap_or(Value::Null);
    assert!(
        (chatbot["usd"].as_f64().unwrap_or(-1.0) - by_app).abs() < 1e-9,
        "{chatbot} vs {by_app}"
    );

    // Without the application's budget its keys run again: once a key made after the
    // change is accepted on both processes, both hold the change.
    let (status, e) = admin(
        Method::PATCH,
        "/v1/admin/tenants/shop",
        json!({"applications": {}}),
    )
    .await;
    assert_eq!(status, 200, "{e}");
    let (_, newer) = admin(
        Method::POST,
        "/v1/admin/tenants/shop/keys",
        json!({"name": "newer", "application": "chatbot"}),
    )
    .await;
    let newer = newer["key"].as_str().unwrap();
    everywhere_within_a_second(http, &[&apis[0], &apis[1]], newer, 200, "the key accepted").await;
    let mut body = job("oai/gpt-4o-mini", "after");
    body["deadline"] = json!((chrono::Utc::now() + chrono::Duration::seconds(20)).to_rfc3339());
    let (_, accepted) = call(http, Method::POST, &app.url("/v1/jobs"), &secrets[0], Some(&body)).await;
    let done =
        crate::harness::wait_finished_at(http, &apis[0], &secrets[0], accepted["id"].as_str().unwrap(), 60)
            .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    b.shutdown().await;
    app.shutdown().await;
}
