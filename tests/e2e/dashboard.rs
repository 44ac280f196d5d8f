//! The dashboard in a real browser: tollgate runs a small workload, headless Chromium
//! (Debian's `chromium`; `.ci/run` installs it) loads `/dashboard`, and what it rendered
//! is checked against the API. A screenshot is left in `target/dashboard.png`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::harness::{ACME, TestApp, eventually, job};
use crate::observe::{ADMIN, waiting_job, watched_options};

/// This test's tenants (see [`watched_options`]).
const WATCHER: &str = "tk-viewer";
const WAITER: &str = "tk-queuer";

const CHROMIUM: &str = "/usr/bin/chromium";

/// Loads `url` in headless Chromium and returns the DOM once the page's scripts have run
/// (virtual time lets its polling happen without waiting in real time); `screenshot`
/// also saves a picture of it.
async fn chromium(url: &str, profile: &Path, screenshot: Option<&Path>) -> String {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
    );
    let mut cmd = tokio::process::Command::new(CHROMIUM);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1600",
        "--virtual-time-budget=5000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    cmd.arg("--dump-dom");
    if let Some(path) = screenshot {
        cmd.arg(format!("--screenshot={}", path.display()));
    }
    let out = cmd
        .arg(url)
        .kill_on_drop(true)
        .output()
        .await
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The attribute `attr` of the first element carrying `marker` (e.g. `data-bucket="k"`).
fn attr(dom: &str, marker: &str, attr: &str) -> Option<String> {
    let at = dom.find(marker)?;
    let tag_start = dom[..at].rfind('<')?;
    let tag = &dom[tag_start..at + dom[at..].find('>')?];
    let key = format!("{attr}=\"");
    let from = tag.find(&key)? + key.len();
    Some(tag[from..from + tag[from..].find('"')?].to_owned())
}

/// The latest value a chart's legend shows for `series` (its row `data-series="…"`).
fn legend_value(dom: &str, series: &str) -> Option<f64> {
    let row = &dom[dom.find(&format!("data-series=\"{series}\""))?..];
    let row = &row[..row.find("</tr>")?];
    let cell = &row[row.find("u-value")?..];
    let text = &cell[cell.find('>')? + 1..cell.find("</td>")?];
    text.replace(',', "").trim().parse().ok()
}

#[tokio::test]
async fn dashboard_renders_what_the_api_reports() {
    let app = TestApp::spawn_with(watched_options("viewer", "queuer")).await;
    // A small workload: viewer's jobs succeed, one fails (the Anthropic mock answers
    // 529 until attempts run out), queuer's wait on its own 2-a-day limit, acme has a
    // job too.
    for i in 0..6 {
        let (status, _) = app.submit(WATCHER, &job("fast", &format!("dash {i}"))).await;
        assert_eq!(status, 202);
    }
    let (status, failing) = app
        .submit(WATCHER, &job("ant/claude-3-5-haiku-latest", "overloaded"))
        .await;
    assert_eq!(status, 202, "{failing}");
    for i in 0..5 {
        let (status, _) = app.submit(WAITER, &waiting_job(i)).await;
        assert_eq!(status, 202);
    }
    let (status, _) = app.submit(ACME, &job("fast", "acme's")).await;
    assert_eq!(status, 202);
    let failed_id = failing["id"].as_str().unwrap().to_owned();
    let api: Value = eventually(30, "the workload to settle", || async {
        let (_, s) = app.get(ADMIN, "/v1/status").await;
        let waiting = s["queues"]
            .as_array()?
            .iter()
            .any(|q| q["tenant"] == "queuer" && q["queued"] == 3);
        let failed = s["recent_failures"]
            .as_array()?
            .iter()
            .any(|f| f["id"] == failed_id.as_str());
        (waiting && failed).then_some(s)
    })
    .await;
    // The broker's forecast for the queue that waits: its 3 unfinished jobs at the rate
    // it finished 2 in the last minute.
    let waiting = api["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["tenant"] == "queuer")
        .unwrap();
    assert_eq!(waiting["finished_last_minute"], 2, "{waiting}");
    assert_eq!(waiting["eta_secs"].as_f64(), Some(90.0), "{waiting}");
    // The charts draw from the sampled history: wait for samples that saw queuer's queue
    // and the failed job's four 5xx answers.
    eventually(
        30,
        "history samples of queuer's queue and the 5xx answers",
        || async {
            let (_, h) = app.get(ADMIN, "/v1/status/history").await;
            let samples = h["samples"].as_array()?;
            let queue = samples
                .iter()
                .any(|s| s["queued"]["queuer/standard"].as_i64().is_some());
            let errors: i64 = samples
                .iter()
                .filter_map(|s| s["traffic"].as_object())
                .flat_map(|t| t.values())
                .filter_map(|t| t["status_5xx"].as_i64())
                .sum();
            (queue && errors == 4).then_some(())
        },
    )
    .await;

    // The admin's view, with a picture of it for people (a CI artifact).
    let target = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target");
    std::fs::create_dir_all(&target).unwrap();
    let png = target.join("dashboard.png");
    let _ = std::fs::remove_file(&png);
    let profile = tempfile::tempdir().unwrap();
    let dom = chromium(
        &app.url(&format!("/dashboard#key={ADMIN}")),
        profile.path(),
        Some(&png),
    )
    .await;
    assert_eq!(
        attr(&dom, "id=\"status\"", "data-ready").as_deref(),
        Some("1"),
        "{dom}"
    );
    assert_eq!(attr(&dom, "id=\"scope\"", "data-scope").as_deref(), Some("all"));
    assert!(
        std::fs::metadata(&png).map(|m| m.len() > 10_000).unwrap_or(false),
        "no screenshot"
    );
    // Every bucket, with the limit the API reports.
    for b in api["buckets"].as_array().unwrap() {
        let key = b["bucket"].as_str().unwrap();
        let capacity = attr(&dom, &format!("data-bucket=\"{key}\""), "data-capacity")
            .unwrap_or_else(|| panic!("bucket {key} not rendered"));
        assert_eq!(
            capacity.parse::<f64>().unwrap(),
            b["capacity"].as_f64().unwrap(),
            "{key}"
        );
        assert_eq!(
            attr(&dom, &format!("data-bucket=\"{key}\""), "data-source").as_deref(),
            b["source"].as_str()
        );
    }
    // A budget reads in dollars, not the micro-USD it is kept in.
    let budget = dom
        .split("<tr")
        .find(|row| row.contains("data-bucket=\"tenant:viewer:daily_spend\""))
        .unwrap_or_else(|| panic!("the viewer's budget not rendered: {dom}"));
    assert!(
        budget.contains("spend (USD)") && budget.contains("$5.00") && !budget.contains("5,000,000"),
        "{budget}"
    );
    // The queue that waits, as the API counts it.
    assert_eq!(
        attr(&dom, "data-queue=\"queuer/standard\"", "data-queued").as_deref(),
        Some("3"),
        "{dom}"
    );
    assert!(
        attr(&dom, "data-class=\"standard\"", "data-age").is_some(),
        "oldest age per class"
    );
    // The failure with its reason code.
    let code = api["recent_failures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == failed_id.as_str())
        .map(|f| f["code"].as_str().unwrap().to_owned());
    assert_eq!(code.as_deref(), Some("attempts_exhausted"));
    assert_eq!(
        attr(&dom, &format!("data-job=\"{failed_id}\""), "data-code"),
        code
    );
    // Charts drawn from the history: one line per tenant/class queue.
    assert!(dom.contains("data-series=\"queuer/standard\""), "{dom}");
    // Rates are drawn over the trailing minute: the failed job's four 529s read as 4 a
    // minute on the chart, as in the header's last-minute figure (not one 2 s sample's
    // count times 30).
    let header: f64 = attr(&dom, "id=\"provider-5xxs\"", "data-value")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(header, 4.0, "{dom}");
    assert_eq!(legend_value(&dom, "5xx/min"), Some(header), "{dom}");
    assert!(dom.contains("no batches in progress"));

    // A tenant key sees its own jobs and no other tenant's.
    let profile = tempfile::tempdir().unwrap();
    let dom = chromium(
        &app.url(&format!("/dashboard#key={WAITER}")),
        profile.path(),
        None,
    )
    .await;
    assert_eq!(
        attr(&dom, "id=\"scope\"", "data-scope").as_deref(),
        Some("queuer")
    );
    assert_eq!(
        attr(&dom, "data-queue=\"queuer/standard\"", "data-queued").as_deref(),
        Some("3")
    );
    assert!(
        !dom.contains("viewer") && !dom.contains("acme"),
        "another tenant leaked into the page"
    );

    app.shutdown().await;
}
