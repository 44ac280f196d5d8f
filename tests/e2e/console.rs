//! The operator's actions, through the API and through the console in a real browser:
//! pausing a tenant, a route and a provider model; cancelling and retrying a job; finding
//! jobs by filters and search; a job's provider calls; the dashboard's history kept in
//! the database. The browser test drives Debian's `chromium` through `chromedriver`
//! (WebDriver, `fantoccini`; `.ci/run` installs both) and checks the API agrees with
//! every click; screenshots are left in `target/console-*.png`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};

use crate::batches::{batch_body, create_batch, line, upload};
use crate::harness::{TestApp, eventually, job};
use crate::observe::{ADMIN, waiting_job, watched_options};

/// A tenant that runs freely, one whose 2 requests a day are spent after two jobs (see
/// [`watched_options`]), and a route that prefers the Anthropic model (which the mock
/// answers 529) and falls back to OpenAI.
fn options(free: &str, spent: &str) -> crate::harness::TestOptions {
    let mut options = watched_options(free, spent);
    options.extra_config.push_str(
        "[[routes]]\nalias = \"either\"\ntargets = [\"ant/claude-3-5-haiku-latest\", \"oai/gpt-4o-mini\"]\n",
    );
    options
}

/// Waits until job `id` is queued with the admission reason `reason`.
async fn waits_for(app: &TestApp, id: &str, reason: &str) -> Value {
    eventually(30, &format!("job {id} to wait for {reason}"), || async {
        let (_, j) = app.get(ADMIN, &format!("/v1/jobs/{id}")).await;
        (j["state"] == "queued" && j["admission"]["reason"] == reason).then_some(j)
    })
    .await
}

#[tokio::test]
async fn operators_pause_cancel_retry_and_find_jobs() {
    let app = TestApp::spawn_with(options("opfree", "opspent")).await;
    let free = "tk-opfree";

    // A tenant paused: its jobs wait, whatever their deadline, and say why; another
    // tenant's run.
    let (status, pause) = app
        .post(ADMIN, "/v1/admin/pauses", &json!({"tenant": "opfree"}))
        .await;
    assert_eq!(status, 201, "{pause}");
    assert_eq!(
        (pause["scope"].as_str(), pause["by"].as_str()),
        (Some("tenant:opfree"), Some("operator"))
    );
    assert!(
        pause["until"].is_null(),
        "an operator's pause has no end: {pause}"
    );
    let mut held = job("fast", "held");
    held["deadline"] = (chrono::Utc::now() + chrono::Duration::seconds(20))
        .to_rfc3339()
        .into();
    // Accepted whatever its forecast: the pause is what holds it.
    held["on_deadline_risk"] = "accept".into();
    held["idempotency_key"] = "console-held".into();
    held["metadata"] = json!({"ticket": "T-42"});
    let (status, held) = app.submit(free, &held).await;
    assert_eq!(status, 202, "{held}");
    let held_id = held["id"].as_str().unwrap().to_owned();
    let j = waits_for(&app, &held_id, "paused_by_operator").await;
    assert_eq!(j["admission"]["scope"], "tenant:opfree");
    let history = j["admission_history"].as_array().unwrap();
    assert_eq!(history.len(), 1, "one change of why it waits: {history:?}");
    assert_eq!(history[0]["reason"], "paused_by_operator");
    assert!(history[0]["at"].is_string());
    let other = app
        .run_job(crate::harness::ACME, &job("fast", "not held"), 30)
        .await;
    assert_eq!(other["state"], "succeeded", "{other}");
    let (_, pauses) = app.get(ADMIN, "/v1/admin/pauses").await;
    assert!(
        pauses["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["scope"] == "tenant:opfree"),
        "{pauses}"
    );

    // Found by filters and by search: its idempotency key, its metadata, its id, the
    // reason it waits; a tenant key asking for another tenant's jobs gets none.
    for query in [
        "tenant=opfree&state=queued",
        "q=console-held",
        "q=ticket%3DT-42",
        &format!("q={held_id}"),
        "reason=paused_by_operator&tenant=opfree",
        "model=fast&class=standard&tenant=opfree",
    ] {
        let (status, list) = app.get(ADMIN, &format!("/v1/jobs?{query}")).await;
        assert_eq!(status, 200, "{query}: {list}");
        let ids: Vec<&str> = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, [held_id.as_str()], "{query}");
    }
    let (_, theirs) = app.get(free, "/v1/jobs?tenant=acme").await;
    assert_eq!(theirs["data"], json!([]), "another tenant's jobs: {theirs}");
    let (status, bad) = app.get(ADMIN, "/v1/jobs?lane=sideways").await;
    assert_eq!(
        (status, bad["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );

    // Cancelled while held, retried, resumed: it runs once.
    let (status, cancelled) = app
        .post(free, &format!("/v1/jobs/{held_id}/cancel"), &json!({}))
        .await;
    assert_eq!((status, cancelled["state"].as_str()), (200, Some("cancelled")));
    let (status, retried) = app
        .post(free, &format!("/v1/jobs/{held_id}/retry"), &json!({}))
        .await;
    assert_eq!(
        (status, retried["state"].as_str()),
        (200, Some("queued")),
        "{retried}"
    );
    let (status, again) = app
        .post(free, &format!("/v1/jobs/{held_id}/retry"), &json!({}))
        .await;
    assert_eq!(
        (status, again["error"]["code"].as_str()),
        (409, Some("job_not_retryable"))
    );
    let (status, _) = app.delete(free, "/v1/admin/pauses/tenant%3Aopfree").await;
    assert_eq!(status, 403, "a tenant key resumes nothing");
    let (status, _) = app.delete(ADMIN, "/v1/admin/pauses/tenant%3Aopfree").await;
    assert_eq!(status, 200);
    let (status, _) = app.delete(ADMIN, "/v1/admin/pauses/tenant%3Aopfree").await;
    assert_eq!(status, 404, "resumed already");
    let done = app.wait_job(free, &held_id, 30).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let (status, attempts) = app.get(free, &format!("/v1/jobs/{held_id}/attempts")).await;
    assert_eq!(status, 200, "{attempts}");
    let attempts = attempts["data"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "one call, after the retry: {attempts:?}");
    assert_eq!(
        (attempts[0]["status"].as_i64(), attempts[0]["outcome"].as_str()),
        (Some(200), Some("succeeded"))
    );
    assert!(attempts[0]["usage"]["input_tokens"].as_i64().unwrap() > 0);
    let (status, _) = app
        .get(crate::harness::ACME, &format!("/v1/jobs/{held_id}/attempts"))
        .await;
    assert_eq!(status, 404, "another tenant's job's calls");

    // A provider model paused: the route's next target serves, in one call.
    let (status, _) = app
        .post(
            ADMIN,
            "/v1/admin/pauses",
            &json!({"provider": "ant", "model": "claude-3-5-haiku-latest"}),
        )
        .await;
    assert_eq!(status, 201);
    let served = app
        .run_job(free, &job("either", "around the paused model"), 30)
        .await;
    assert_eq!(
        (served["state"].as_str(), served["provider"].as_str()),
        (Some("succeeded"), Some("oai")),
        "{served}"
    );
    assert_eq!(
        served["attempts"], 1,
        "nothing sent to the paused model: {served}"
    );

    // A route paused: its jobs wait; others do not.
    let (status, _) = app
        .post(ADMIN, "/v1/admin/pauses", &json!({"route": "either"}))
        .await;
    assert_eq!(status, 201);
    let (_, on_route) = app.submit(free, &job("either", "held by its route")).await;
    let on_route = on_route["id"].as_str().unwrap().to_owned();
    let j = waits_for(&app, &on_route, "paused_by_operator").await;
    assert_eq!(j["admission"]["scope"], "route:either");
    let (status, _) = app.delete(ADMIN, "/v1/admin/pauses/route%3Aeither").await;
    assert_eq!(status, 200);
    assert_eq!(app.wait_job(free, &on_route, 30).await["state"], "succeeded");

    // Unknown things are refused, naming the field.
    for (body, param) in [
        (json!({"tenant": "nobody"}), "tenant"),
        (json!({"route": "nowhere"}), "route"),
        (json!({"provider": "oai", "model": "gpt-9"}), "model"),
    ] {
        let (status, e) = app.post(ADMIN, "/v1/admin/pauses", &body).await;
        assert_eq!((status, e["error"]["param"].as_str()), (400, Some(param)), "{e}");
    }
    let (status, _) = app
        .post(
            ADMIN,
            "/v1/admin/pauses",
            &json!({"tenant": "opfree", "route": "fast"}),
        )
        .await;
    assert_eq!(status, 400);

    // The dashboard's history is in the database: what it serves is what the table holds,
    // and `after` returns only newer samples.
    let history = eventually(30, "samples of the workload", || async {
        let (_, h) = app.get(ADMIN, "/v1/status/history").await;
        let succeeded: i64 = h["samples"]
            .as_array()?
            .iter()
            .filter_map(|s| s["traffic"]["opfree"]["succeeded"].as_i64())
            .sum();
        (succeeded >= 3).then_some(h)
    })
    .await;
    let samples = history["samples"].as_array().unwrap();
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM status_samples")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert!(stored as usize >= samples.len() && !samples.is_empty());
    let last = samples.last().unwrap()["at"].as_str().unwrap();
    let (_, newer) = app
        .get(
            ADMIN,
            &format!("/v1/status/history?after={}", last.replace('+', "%2B")),
        )
        .await;
    assert!(
        newer["samples"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["at"].as_str().unwrap() > last),
        "{newer}"
    );
    let (_, theirs) = app.get("tk-opspent", "/v1/status/history").await;
    assert!(
        !theirs.to_string().contains("opfree"),
        "another tenant's history leaked"
    );

    app.shutdown().await;
}

const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// `chromedriver` on a free port, ready for sessions.
async fn chromedriver() -> (tokio::process::Child, String) {
    assert!(
        Path::new(CHROMEDRIVER).exists(),
        "{CHROMEDRIVER} is missing: apt-get install -y chromium-driver (.ci/run does)"
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = tokio::process::Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start chromedriver");
    let url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    eventually(30, "chromedriver to answer", || async {
        let r = http.get(format!("{url}/status")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await;
    (child, url)
}

/// A headless Chromium session.
async fn browser(driver: &str) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".to_owned(),
        json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1200", "--no-first-run", "--disable-background-networking"],
        }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(driver)
        .await
        .expect("a WebDriver session")
}

/// Waits for the element `css`, up to 30 s; failing, shows the page's main part.
async fn find(c: &Client, css: &str) -> fantoccini::elements::Element {
    match c
        .wait()
        .at_most(Duration::from_secs(30))
        .for_element(Locator::Css(css))
        .await
    {
        Ok(element) => element,
        Err(e) => {
            let page = match c.find(Locator::Css("main")).await {
                Ok(main) => main.html(false).await.unwrap_or_default(),
                Err(_) => c.source().await.unwrap_or_default(),
            };
            let error = match c.find(Locator::Css("#error")).await {
                Ok(error) => error.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            panic!("{css} did not appear ({e}); error: {error:?}; page: {page}")
        }
    }
}

/// Clicks `css` and confirms in the console's dialog.
async fn click_and_confirm(c: &Client, css: &str) {
    find(c, css)
        .await
        .click()
        .await
        .unwrap_or_else(|e| panic!("click {css}: {e}"));
    find(c, "#confirm[open] button[value=\"yes\"]")
        .await
        .click()
        .await
        .unwrap();
}

async fn screenshot(c: &Client, name: &str) {
    let target = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target");
    std::fs::create_dir_all(&target).unwrap();
    let png = c.screenshot().await.unwrap();
    assert!(png.len() > 10_000, "an empty screenshot of {name}");
    std::fs::write(target.join(format!("console-{name}.png")), png).unwrap();
}

#[tokio::test]
async fn the_console_acts_and_the_api_agrees() {
    let app = TestApp::spawn_with(options("cfree", "cspent")).await;
    let spent = "tk-cspent";
    // cspent's first two jobs spend its day; the rest wait.
    let mut waiting = Vec::new();
    for i in 0..4 {
        let (status, j) = app.submit(spent, &waiting_job(i)).await;
        assert_eq!(status, 202);
        waiting.push(j["id"].as_str().unwrap().to_owned());
    }
    let target = waiting[3].clone();
    eventually(30, "the spent tenant's jobs to wait", || async {
        let (_, j) = app.get(ADMIN, &format!("/v1/jobs/{target}")).await;
        (j["state"] == "queued" && j["admission"]["reason"].is_string()).then_some(())
    })
    .await;
    // A batch of the spent tenant, accepted though its budget is not expected back in its
    // window: it stays in progress.
    let content: String = (0..3)
        .map(|i| line(&format!("c{i}"), "fast", "batched") + "\n")
        .collect();
    let (_, file) = upload(&app.http, &app.api, spent, content.as_bytes()).await;
    let mut body = batch_body(file["id"].as_str().unwrap());
    body["on_deadline_risk"] = json!("accept");
    let (status, batch) = create_batch(&app.http, &app.api, spent, &body).await;
    assert_eq!(status, 200, "{batch}");
    let batch_id = batch["id"].as_str().unwrap().to_owned();

    let (_driver, driver_url) = chromedriver().await;
    let c = browser(&driver_url).await;
    c.goto(&app.url(&format!("/dashboard#key={ADMIN}")))
        .await
        .unwrap();
    find(&c, "#status[data-ready=\"1\"]").await;
    find(&c, "tr[data-queue=\"cspent/standard\"]").await;
    screenshot(&c, "overview").await;

    // Jobs: filter → the job's page → cancel, then retry.
    find(&c, "a[data-nav=\"jobs\"]").await.click().await.unwrap();
    let filters = find(&c, "#job-filters").await;
    filters
        .find(Locator::Css("[name=\"tenant\"]"))
        .await
        .unwrap()
        .send_keys("cspent")
        .await
        .unwrap();
    filters
        .find(Locator::Css("select[name=\"state\"]"))
        .await
        .unwrap()
        .select_by_value("queued")
        .await
        .unwrap();
    filters
        .find(Locator::Css("button[type=\"submit\"]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    find(
        &c,
        &format!("#jobs tr[data-job=\"{target}\"][data-state=\"queued\"]"),
    )
    .await;
    let rows = c.find_all(Locator::Css("#jobs tr[data-job]")).await.unwrap();
    for row in rows {
        assert_eq!(
            row.attr("data-state").await.unwrap().as_deref(),
            Some("queued"),
            "the filter held"
        );
    }
    find(&c, &format!("#jobs a[href=\"#/jobs/{target}\"]"))
        .await
        .click()
        .await
        .unwrap();
    find(&c, &format!("#job[data-job=\"{target}\"][data-ready=\"1\"]")).await;
    screenshot(&c, "job").await;
    click_and_confirm(&c, "#job button[data-action=\"cancel\"]").await;
    find(&c, "#job[data-state=\"cancelled\"]").await;
    let (_, j) = app.get(ADMIN, &format!("/v1/jobs/{target}")).await;
    assert_eq!(j["state"], "cancelled", "the API agrees");
    click_and_confirm(&c, "#job button[data-action=\"retry\"]").await;
    find(&c, "#job[data-state=\"queued\"]").await;
    let (_, j) = app.get(ADMIN, &format!("/v1/jobs/{target}")).await;
    assert_eq!(j["state"], "queued", "the API agrees");

    // Tenants: pause, then resume.
    find(&c, "a[data-nav=\"tenants\"]").await.click().await.unwrap();
    click_and_confirm(&c, "tr[data-tenant=\"cfree\"] button[data-action=\"pause\"]").await;
    find(&c, "tr[data-tenant=\"cfree\"][data-paused=\"true\"]").await;
    let (_, pauses) = app.get(ADMIN, "/v1/admin/pauses").await;
    assert!(
        pauses["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["scope"] == "tenant:cfree"),
        "{pauses}"
    );
    let (_, held) = app.submit("tk-cfree", &job("fast", "held by the console")).await;
    let held = held["id"].as_str().unwrap().to_owned();
    waits_for(&app, &held, "paused_by_operator").await;
    screenshot(&c, "tenants").await;
    click_and_confirm(&c, "tr[data-tenant=\"cfree\"] button[data-action=\"resume\"]").await;
    find(&c, "tr[data-tenant=\"cfree\"][data-paused=\"false\"]").await;
    assert_eq!(app.wait_job("tk-cfree", &held, 30).await["state"], "succeeded");

    // The batch's page: pause and resume.
    c.goto(&app.url(&format!("/dashboard#/batches/{batch_id}")))
        .await
        .unwrap();
    find(
        &c,
        &format!("#batch[data-batch=\"{batch_id}\"][data-ready=\"1\"]"),
    )
    .await;
    click_and_confirm(&c, "#batch button[data-action=\"pause\"]").await;
    eventually(30, "the batch paused", || async {
        let (_, b) = app.get(ADMIN, &format!("/v1/batches/{batch_id}")).await;
        (!b["paused_at"].is_null()).then_some(())
    })
    .await;
    screenshot(&c, "batch").await;
    click_and_confirm(&c, "#batch button[data-action=\"resume\"]").await;
    eventually(30, "the batch resumed", || async {
        let (_, b) = app.get(ADMIN, &format!("/v1/batches/{batch_id}")).await;
        b["paused_at"].is_null().then_some(())
    })
    .await;

    // Keys: a new key for a tenant, shown once, and it works.
    find(&c, "a[data-nav=\"keys\"]").await.click().await.unwrap();
    let form = find(&c, "#new-key").await;
    form.find(Locator::Css("select[name=\"tenant\"]"))
        .await
        .unwrap()
        .select_by_value("cfree")
        .await
        .unwrap();
    form.find(Locator::Css("[name=\"name\"]"))
        .await
        .unwrap()
        .send_keys("console-made")
        .await
        .unwrap();
    form.find(Locator::Css("button[type=\"submit\"]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let secret = eventually(30, "the new key's secret", || async {
        let text = find(&c, "#new-key-secret").await.text().await.ok()?;
        (!text.trim().is_empty()).then_some(text.trim().to_owned())
    })
    .await;
    let (_, keys) = app.get(ADMIN, "/v1/admin/tenants/cfree/keys").await;
    assert!(
        keys["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["name"] == "console-made"),
        "{keys}"
    );
    // Every process's directory takes a new key within a second (the control plane's
    // promise); this one's too.
    eventually(2, "the key the console made to work", || async {
        (app.get(&secret, "/v1/jobs").await.0 == 200).then_some(())
    })
    .await;
    screenshot(&c, "keys").await;
    c.close().await.unwrap();

    // A tenant's key: its own jobs, no admin pages.
    let c = browser(&driver_url).await;
    c.goto(&app.url(&format!("/dashboard#key={spent}")))
        .await
        .unwrap();
    find(&c, "#status[data-ready=\"1\"]").await;
    find(&c, "a[data-nav=\"jobs\"]").await.click().await.unwrap();
    find(&c, &format!("#jobs tr[data-job=\"{}\"]", waiting[0])).await;
    let html = c.source().await.unwrap();
    assert!(
        !html.contains("cfree") && !html.contains("acme"),
        "another tenant leaked"
    );
    assert!(
        c.find(Locator::Css("a[data-nav=\"tenants\"]:not([hidden])"))
            .await
            .is_err()
    );
    c.close().await.unwrap();
    app.shutdown().await;
}
