//! The flex lane end to end: jobs that are not interactive and have the time reach the
//! mock at the flex tier (`service_tier: "flex"`) and are charged its price; a call the
//! tier refuses for capacity goes online at once — charged online, counted against no
//! limit and pausing nothing; interactive jobs and jobs without the time stay online. Once
//! the tier has been observed, what it did decides: a fast tier takes closer deadlines, one
//! refusing most calls gets none.

use chrono::Utc;
use serde_json::{Value, json};
use tollgate_mock::MockConfig;

use crate::harness::{ACME, TestApp, TestOptions, mock_config};

/// USD per million tokens of `gpt-4o-mini` here: micro-USD per token.
const INPUT_PRICE: f64 = 0.15;
const OUTPUT_PRICE: f64 = 0.6;

fn job(class: &str, deadline_secs: i64, i: usize) -> Value {
    json!({
        "request": {"model": "oai/gpt-4o-mini", "messages": [{"role": "user", "content": format!("item {i}")}], "max_tokens": 8},
        "class": class,
        "deadline": (Utc::now() + chrono::Duration::seconds(deadline_secs)).to_rfc3339(),
    })
}

#[tokio::test]
async fn flex_serves_jobs_with_time_and_goes_online_when_refused() {
    let app = TestApp::spawn_with(TestOptions {
        mock: MockConfig {
            flex_unavailable_every_nth: 3,
            ..mock_config()
        },
        extra_config: format!(
            "[providers.flex]\nenabled = true\nmin_deadline_secs = 600\n\
             [providers.prices.\"gpt-4o-mini\"]\ninput_per_mtok = {INPUT_PRICE}\noutput_per_mtok = {OUTPUT_PRICE}\n"
        ),
        ..TestOptions::default()
    })
    .await;
    let mut flexible = Vec::new();
    for i in 0..6 {
        // One at a time, so the mock refuses exactly the third and the sixth flex call.
        let done = app.run_job(ACME, &job("background", 3600, i), 30).await;
        assert_eq!(done["state"], "succeeded", "{done}");
        flexible.push(done);
    }
    let interactive = app.run_job(ACME, &job("interactive", 3600, 7), 30).await;
    let hurried = app.run_job(ACME, &job("standard", 300, 8), 30).await;

    let lane = |j: &Value| {
        (
            j["dispatch"]["via"].as_str().unwrap_or_default().to_owned(),
            j["dispatch"]["reason"].as_str().unwrap_or_default().to_owned(),
        )
    };
    let lanes: Vec<(String, String)> = flexible.iter().map(lane).collect();
    let flex = ("flex".to_owned(), "deadline_allows_flex".to_owned());
    let refused = ("online".to_owned(), "flex_unavailable_retry_online".to_owned());
    assert_eq!(
        lanes,
        [&flex, &flex, &refused, &flex, &flex, &refused].map(Clone::clone),
        "the third and sixth flex calls were refused"
    );
    assert_eq!(lane(&interactive).0, "online", "{interactive}");
    assert_eq!(lane(&hurried).0, "online", "{hurried}");

    let stats = app.mock.stats();
    assert_eq!(stats.flex_unavailable, 2, "{stats:?}");
    assert_eq!(stats.rate_limited_429, 0, "{stats:?}");
    assert_eq!(stats.succeeded, 8, "every job served once: {stats:?}");
    // The refusals paused nothing.
    let (pauses,): (i64,) = sqlx::query_as("SELECT count(*) FROM pauses")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(pauses, 0);
    // Charged the flex price (half) at the flex tier, the online price online.
    for done in flexible.iter().chain([&interactive, &hurried]) {
        let usage = &done["usage"];
        let online = usage["input_tokens"].as_f64().unwrap() * INPUT_PRICE
            + usage["output_tokens"].as_f64().unwrap() * OUTPUT_PRICE;
        let id = done["id"].as_str().unwrap();
        let (spend,): (f64,) = sqlx::query_as("SELECT spend_micro_usd::float8 FROM jobs WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
        let share = if lane(done).0 == "flex" { 0.5 } else { 1.0 };
        assert!(
            (spend - share * online).abs() < 1e-6,
            "{id}: {spend} vs {share} of {online}"
        );
        // The job says what its lane saved.
        let saved = done["cost"]["saved_usd"].as_f64().unwrap_or(0.0) * 1e6;
        assert!(
            (saved - (1.0 - share) * online).abs() < 1e-6,
            "{id}: saved {saved} of {online}"
        );
    }
    app.shutdown().await;
}

/// A broker whose `oai` flex tier is enabled with `flex` settings, on a mock refusing every
/// `refuse_every_nth` flex call (0: none).
async fn flex_app(flex: &str, refuse_every_nth: u64) -> TestApp {
    TestApp::spawn_with(TestOptions {
        mock: MockConfig {
            flex_unavailable_every_nth: refuse_every_nth,
            ..mock_config()
        },
        extra_config: format!("[providers.flex]\nenabled = true\n{flex}"),
        ..TestOptions::default()
    })
    .await
}

/// Runs `n` jobs one after the other, each with `deadline_secs` to go; their lanes.
async fn run_jobs(app: &TestApp, n: usize, deadline_secs: i64) -> Vec<(String, String)> {
    let mut lanes = Vec::new();
    for i in 0..n {
        let done = app.run_job(ACME, &job("background", deadline_secs, i), 30).await;
        assert_eq!(done["state"], "succeeded", "{done}");
        lanes.push((
            done["dispatch"]["via"].as_str().unwrap_or("online").to_owned(),
            done["dispatch"]["reason"].as_str().unwrap_or_default().to_owned(),
        ));
    }
    lanes
}

/// A tier that has served twenty jobs quickly takes deadlines closer than
/// `min_deadline_secs` (its p90 latency plus `fallback_secs` fits), which went online
/// before it was observed.
#[tokio::test]
async fn a_flex_tier_seen_answering_fast_takes_closer_deadlines() {
    let app = flex_app("min_deadline_secs = 3600\nfallback_secs = 60\n", 0).await;
    assert_eq!(
        run_jobs(&app, 1, 600).await,
        [("online".to_owned(), String::new())],
        "not observed yet: ten minutes is under min_deadline_secs"
    );
    let served = run_jobs(&app, 20, 7200).await;
    assert!(served.iter().all(|(via, _)| via == "flex"), "{served:?}");
    // The gate re-reads what the tiers did every few seconds.
    let lane = crate::harness::eventually(60, "a closer deadline sent flex", || async {
        let lane = run_jobs(&app, 1, 600).await.remove(0);
        (lane.0 == "flex").then_some(lane)
    })
    .await;
    assert_eq!(lane.1, "observed_latency_allows_flex");
    assert_eq!(app.mock.stats().flex_unavailable, 0);
    app.shutdown().await;
}

/// A tier that refused every one of twenty jobs is sent no more: the next jobs go online
/// saying why, and the tier sees no further calls.
#[tokio::test]
async fn a_flex_tier_seen_refusing_most_calls_is_sent_none() {
    let app = flex_app("min_deadline_secs = 600\n", 1).await;
    let refused = run_jobs(&app, 20, 3600).await;
    assert!(
        refused.iter().all(|l| l.1 == "flex_unavailable_retry_online"),
        "{refused:?}"
    );
    let lane = crate::harness::eventually(60, "the tier set aside", || async {
        let lane = run_jobs(&app, 1, 3600).await.remove(0);
        (lane.1 == "flex_mostly_unavailable").then_some(lane)
    })
    .await;
    assert_eq!(lane.0, "online");
    let before = app.mock.stats().flex_unavailable;
    let next = run_jobs(&app, 3, 3600).await;
    assert!(next.iter().all(|l| l.1 == "flex_mostly_unavailable"), "{next:?}");
    assert_eq!(
        app.mock.stats().flex_unavailable,
        before,
        "no call reached the tier"
    );
    app.shutdown().await;
}
