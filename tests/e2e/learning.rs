//! Learned limits and key rotation against the mock provider: limits taught by headers
//! where the config has none, by 429s where the provider sends nothing (paced until its
//! first 429), followed when the
//! provider halves them, kept across a restart; keys of one provider account sharing its
//! limits and two accounts' limits learned apart (named by responses, or declared where a
//! provider names none); a revoked key rotated out after its first
//! 401; provider outages ridden out within the retry budget.

use serde_json::{Value, json};
use tollgate_api::broker::Roles;
use tollgate_mock::{MockConfig, ProjectLimits};

use crate::harness::{ACME, TestApp, TestOptions, eventually};
use crate::observe::ADMIN;

/// A job of mixed size: prompt and output vary with `i`.
fn mixed_job(i: usize) -> Value {
    let words = 5 + (i * 37) % 120;
    json!({
        "request": {
            "model": "oai/gpt-4o-mini",
            "messages": [{"role": "user", "content": "lorem ipsum ".repeat(words)}],
            "max_tokens": 16 + (i * 13) % 200
        },
        "class": "batch"
    })
}

fn mock(rpm: u64, headers: bool) -> MockConfig {
    MockConfig::from_toml_str(&format!(
        r#"
output_tokens = 12
send_rate_limit_headers = {headers}
[[projects]]
name = "oai-test"
kind = "openai"
keys = ["sk-test-1", "sk-test-2"]
revoked_keys = ["sk-revoked"]
rpm = {rpm}
tpm = 100000000
[[projects]]
name = "ant-test"
kind = "anthropic"
keys = ["sk-ant-test"]
"#
    ))
    .expect("mock config")
}

/// A broker that learns limits and only queues: the work starts when the test spawns its
/// `peers`, so the provider meets the whole backlog at once.
async fn queue_first(mock: MockConfig, peers: usize) -> TestApp {
    TestApp::spawn_with(TestOptions {
        mock,
        learn_limits: true,
        roles: Roles::API_ONLY,
        peers,
        ..TestOptions::default()
    })
    .await
}

async fn submit_all(app: &TestApp, range: std::ops::Range<usize>) -> Vec<String> {
    let mut ids = Vec::new();
    for i in range {
        let (status, body) = app.submit(ACME, &mixed_job(i)).await;
        assert_eq!(status, 202, "{body}");
        ids.push(body["id"].as_str().expect("job id").to_owned());
    }
    ids
}

/// Waits until every job is terminal; returns how many succeeded.
async fn drain(app: &TestApp, n: usize, secs: u64) -> i64 {
    eventually(secs, "the jobs to finish", || async {
        let (done, ok): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state IN ('succeeded', 'failed', 'cancelled')),
                    count(*) FILTER (WHERE state = 'succeeded') FROM jobs",
        )
        .fetch_one(&app.db.pool)
        .await
        .ok()?;
        (done as usize == n).then_some(ok)
    })
    .await
}

/// The caller's view of one bucket in `GET /v1/limits`.
async fn bucket(app: &TestApp, key: &str) -> Option<Value> {
    let (status, body) = app.get(ACME, "/v1/limits").await;
    assert_eq!(status, 200, "{body}");
    body["data"]
        .as_array()?
        .iter()
        .find(|b| b["bucket"] == key)
        .cloned()
}

#[tokio::test]
async fn headers_teach_three_processes_the_limits_the_config_lacks_and_they_survive_a_restart() {
    const RPM: u64 = 600;
    const JOBS: usize = 700;
    // Three side by side, then one more after a restart.
    let mut app = queue_first(mock(RPM, true), 4).await;
    let ids = submit_all(&app, 0..JOBS).await;
    let peers = [
        app.spawn_peer(Roles::ALL).await,
        app.spawn_peer(Roles::ALL).await,
        app.spawn_peer(Roles::ALL).await,
    ];
    assert_eq!(drain(&app, ids.len(), 120).await, JOBS as i64);
    for peer in peers {
        peer.shutdown().await;
    }
    let stats = app.mock.stats();
    // Nothing configured: the first calls probe, the headers teach the rest.
    assert!(
        stats.rate_limited_429 * 50 <= stats.requests,
        "more than 2% of provider calls were 429s: {stats:?}"
    );
    assert_eq!(stats.limit_violations, 0, "{stats:?}");
    let rpm = bucket(&app, "provider:oai:gpt-4o-mini:rpm")
        .await
        .expect("a learned rpm bucket");
    assert_eq!(rpm["source"], "learned", "{rpm}");
    assert_eq!(rpm["capacity"], RPM as f64, "{rpm}");
    assert!(rpm["learned_at"].is_string(), "{rpm}");
    assert!(bucket(&app, "provider:oai:gpt-4o-mini:probe").await.is_none());

    // A restarted broker knows the limit before its first call: no probe, no re-learning.
    app.broker.take().expect("broker").shutdown().await;
    let restarted = app.spawn_peer(Roles::ALL).await;
    app.api = format!("http://{}", restarted.addr.expect("api address"));
    let rpm = bucket(&app, "provider:oai:gpt-4o-mini:rpm").await;
    assert_eq!(
        rpm.as_ref().map(|b| b["capacity"].clone()),
        Some(json!(RPM as f64))
    );
    let (learned,): (i64,) = sqlx::query_as("SELECT count(*) FROM learned_limits WHERE reported = $1")
        .bind(RPM as f64)
        .fetch_one(&app.db.pool)
        .await
        .expect("learned rows");
    assert_eq!(learned, 1);
    restarted.shutdown().await;
    app.shutdown().await;
}

#[tokio::test]
async fn a_halved_limit_is_followed_within_seconds() {
    const RPM: u64 = 1200;
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(RPM, true),
        learn_limits: true,
        ..TestOptions::default()
    })
    .await;
    let first = submit_all(&app, 0..200).await;
    assert_eq!(drain(&app, first.len(), 60).await, 200);
    assert!(app.mock.set_limits(
        "oai-test",
        ProjectLimits {
            rpm: RPM / 2,
            tpm: 100_000_000,
            ..ProjectLimits::default()
        }
    ));
    let before = app.mock.stats();
    let second = submit_all(&app, 200..900).await;
    assert_eq!(drain(&app, first.len() + second.len(), 120).await, 900);
    let after = app.mock.stats();
    let rejected = after.rate_limited_429 - before.rate_limited_429;
    // At most what was in flight when the limit changed meets the new limit.
    assert!(
        rejected <= 16,
        "{rejected} 429s after the provider halved its limit: {after:?}"
    );
    let rpm = bucket(&app, "provider:oai:gpt-4o-mini:rpm")
        .await
        .expect("learned rpm");
    assert_eq!(rpm["capacity"], (RPM / 2) as f64, "{rpm}");
    app.shutdown().await;
}

#[tokio::test]
async fn without_headers_429s_teach_a_limit_and_stay_rare() {
    const RPM: u64 = 1200;
    const JOBS: usize = 1800;
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(RPM, false),
        learn_limits: true,
        retry_config: "max_attempts = 12\nbase_delay_ms = 50\nmax_delay_ms = 1000".into(),
        roles: Roles::API_ONLY,
        peers: 1,
        ..TestOptions::default()
    })
    .await;
    // Queue everything, then start the work: the provider meets the whole backlog at once.
    let ids = submit_all(&app, 0..JOBS).await;
    let worker = app.spawn_peer(Roles::ALL).await;
    drain(&app, ids.len(), 180).await;
    worker.shutdown().await;
    let end = app.mock.stats();
    // The backlog exceeds the provider's burst: it answers 429s with nothing to learn from
    // but the 429s themselves. The first burst of them teaches a limit; probing upward
    // costs a few more — a small share of the calls, not one per queued job. Jobs already
    // handed to the dispatcher when a 429 pauses the target go back to the queue instead
    // of meeting one too (0.6-0.8 % of calls; 4-6 % when they did not).
    assert!(
        end.rate_limited_429 > 0,
        "the provider never pushed back: {end:?}"
    );
    assert!(
        end.rate_limited_429 * 100 <= end.requests * 3,
        "{} 429s in {} calls: the 429s did not stop: {end:?}",
        end.rate_limited_429,
        end.requests
    );
    assert_eq!(end.limit_violations, 0, "{end:?}");
    let rpm = bucket(&app, "provider:oai:gpt-4o-mini:rpm")
        .await
        .expect("an rpm bucket learned from 429s");
    let capacity = rpm["capacity"].as_f64().unwrap_or_default();
    assert!(
        (0.4 * RPM as f64..=1.3 * RPM as f64).contains(&capacity),
        "learned {capacity} for a limit of {RPM}: {rpm}"
    );
    let (source,): (String,) = sqlx::query_as("SELECT source FROM learned_limits WHERE name = 'rpm'")
        .fetch_one(&app.db.pool)
        .await
        .expect("learned row");
    assert_eq!(source, "throttling");
    // Each 429 said it met the request limit (`error.type`), so no token limit was taught
    // by them: one guessed from what was sent would hold the traffic back for nothing.
    let tpm: i64 = sqlx::query_scalar("SELECT count(*) FROM learned_limits WHERE name = 'tpm'")
        .fetch_one(&app.db.pool)
        .await
        .expect("learned rows");
    assert_eq!(
        tpm, 0,
        "a token limit learned from 429s that named the request limit"
    );
    assert!(bucket(&app, "provider:oai:gpt-4o-mini:tpm").await.is_none());
    // The limit learned retired the pace that held the calls until the first 429.
    assert!(
        bucket(&app, "provider:oai:gpt-4o-mini:pace").await.is_none(),
        "the pace outlived the first limit learned"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn a_provider_that_says_nothing_is_paced_until_it_pushes_back() {
    const JOBS: usize = 400;
    // A call's time, so the cold-start probe before the pace sends a few calls, not dozens.
    let mut silent = mock(1_000_000, false);
    silent.latency_ms = 50;
    let app = queue_first(silent, 1).await;
    let ids = submit_all(&app, 0..JOBS).await;
    let worker = app.spawn_peer(Roles::ALL).await;
    let pace_key = "provider:oai:gpt-4o-mini:pace";
    // The calls made while the pace stood at `capacity` (read after them: it only grows):
    // a second's worth at once, then at most one second at each earlier capacity (half,
    // a quarter, …) and this one, besides the probe's few — without the pace, the whole
    // backlog in well under a second.
    let (sent, capacity) = eventually(60, "the pace to appear", || async {
        let sent = app.mock.stats().requests;
        let pace = bucket(&app, pace_key).await?;
        assert_eq!(pace["source"], "pace", "{pace}");
        Some((sent, pace["capacity"].as_f64()?))
    })
    .await;
    assert!(
        (sent as f64) <= 3.0 * capacity + 40.0,
        "{sent} calls sent while the pace allowed {capacity} a second"
    );
    drain(&app, ids.len(), 120).await;
    worker.shutdown().await;
    let end = app.mock.stats();
    assert_eq!(end.rate_limited_429, 0, "{end:?}");
    // It held the backlog back, so it grew (×2 each second of it); nothing taught a limit.
    let pace = bucket(&app, pace_key).await.expect("the pace");
    assert!(
        pace["capacity"].as_f64().unwrap_or_default() >= 40.0,
        "the pace never grew: {pace}"
    );
    assert!(bucket(&app, "provider:oai:gpt-4o-mini:rpm").await.is_none());
    app.shutdown().await;
}

#[tokio::test]
async fn a_revoked_key_is_rotated_out_after_its_first_401() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(100_000, true),
        extra_config: r#"
[[providers]]
name = "rot"
kind = "openai"
base_url = "http://MOCK_ADDR/v1"
models = ["gpt-4o-mini"]
keys = [{ name = "good", value = "sk-test-2" }, { name = "bad", value = "sk-revoked" }]
[[providers]]
name = "dead"
kind = "openai"
base_url = "http://MOCK_ADDR/v1"
models = ["gpt-4o-mini"]
keys = [{ name = "only", value = "sk-revoked" }]
"#
        .to_owned(),
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..60 {
        let (status, body) = app
            .submit(ACME, &crate::harness::job("rot/gpt-4o-mini", &format!("r{i}")))
            .await;
        assert_eq!(status, 202, "{body}");
        ids.push(body["id"].as_str().expect("id").to_owned());
    }
    let (status, dead) = app
        .submit(ACME, &crate::harness::job("dead/gpt-4o-mini", "nobody"))
        .await;
    assert_eq!(status, 202, "{dead}");
    assert_eq!(drain(&app, 61, 60).await, 60);
    let per_key: Vec<(String, i64)> = sqlx::query_as(
        "SELECT key_name, count(*) FROM job_attempts WHERE provider = 'rot' GROUP BY key_name ORDER BY 1",
    )
    .fetch_all(&app.db.pool)
    .await
    .expect("attempts");
    // The revoked key met only the calls sent before its first 401 came back (the cold
    // start sends at most `probe_concurrency` = 2); the good key carried everything else.
    assert_eq!(per_key.len(), 2, "{per_key:?}");
    assert!((1..=2).contains(&per_key[0].1), "{per_key:?}");
    assert_eq!(per_key[1], ("good".to_owned(), 60));
    let dead = app.wait_job(ACME, dead["id"].as_str().expect("id"), 10).await;
    assert_eq!(dead["state"], "failed", "{dead}");
    assert_eq!(dead["error"]["code"], "upstream_credentials_exhausted", "{dead}");
    app.shutdown().await;
}

#[tokio::test]
async fn outages_and_overload_are_ridden_out_within_the_retry_budget() {
    let mut mock = mock(100_000, true);
    mock.faults = vec![
        tollgate_mock::FaultConfig {
            project: Some("oai-test".into()),
            start_ms: 0,
            duration_ms: 3000,
            status: 503,
            probability: 1.0,
        },
        tollgate_mock::FaultConfig {
            project: Some("oai-test".into()),
            start_ms: 0,
            duration_ms: 0,
            status: 529,
            probability: 0.05,
        },
    ];
    let app = TestApp::spawn_with(TestOptions {
        mock,
        learn_limits: true,
        // Enough backoff to outlast the 3 s outage: 0.2 + 0.4 + 0.8 + 1.6 + 2 + … s.
        retry_config: "max_attempts = 8\nbase_delay_ms = 200\nmax_delay_ms = 2000".into(),
        ..TestOptions::default()
    })
    .await;
    let ids = submit_all(&app, 0..300).await;
    assert_eq!(drain(&app, ids.len(), 120).await, 300);
    let (over_budget, late): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE attempt > max_attempts), count(*) FILTER (WHERE finished_at > deadline)
         FROM jobs",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("jobs");
    assert_eq!((over_budget, late), (0, 0));
    assert!(app.mock.stats().faults_5xx > 0, "the faults were injected");
    app.shutdown().await;
}

#[tokio::test]
async fn a_failing_target_falls_back_to_the_routes_next_with_its_own_budget() {
    let mut mock = mock(100_000, true);
    // The OpenAI project is down for the whole test; Anthropic is fine.
    mock.faults = vec![tollgate_mock::FaultConfig {
        project: Some("oai-test".into()),
        start_ms: 0,
        duration_ms: 0,
        status: 503,
        probability: 1.0,
    }];
    mock.projects[1].rpm = 100_000;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: r#"
[[routes]]
alias = "resilient"
targets = ["oai/gpt-4o-mini", "ant/claude-3-5-haiku-latest"]
"#
        .to_owned(),
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..20 {
        let (status, body) = app
            .submit(ACME, &crate::harness::job("resilient", &format!("f{i}")))
            .await;
        assert_eq!(status, 202, "{body}");
        ids.push(body["id"].as_str().expect("id").to_owned());
    }
    assert_eq!(drain(&app, ids.len(), 60).await, 20);
    let served: Vec<(String, Option<Vec<String>>, i32)> =
        sqlx::query_as("SELECT provider, failed_targets, attempt FROM jobs ORDER BY id")
            .fetch_all(&app.db.pool)
            .await
            .expect("jobs");
    for (provider, failed, attempt) in &served {
        assert_eq!(provider, "ant", "served by the fallback");
        assert!(
            *attempt <= 2,
            "one failed try on the first target at most, then the fallback: {attempt}"
        );
        if *attempt == 2 {
            assert_eq!(failed.as_deref(), Some(&["oai/gpt-4o-mini".to_owned()][..]));
        }
    }
    assert!(
        served.iter().any(|s| s.2 == 2),
        "the first target was tried: {served:?}"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn a_learned_limit_that_nothing_renews_is_probed_instead_of_refusing_forever() {
    // The provider reports 3,000 TPM, then raises it without notice; no job larger than
    // 3,000 tokens is sent, so no header would ever say so.
    let app = TestApp::spawn_with(TestOptions {
        mock: MockConfig::from_toml_str(
            r#"
output_tokens = 12
send_rate_limit_headers = true
[[projects]]
name = "oai-test"
kind = "openai"
keys = ["sk-test-1"]
rpm = 1000
tpm = 3000
"#,
        )
        .expect("mock config"),
        learn_limits: true,
        ..TestOptions::default()
    })
    .await;
    let tpm = "provider:oai:gpt-4o-mini:tpm";
    let small = json!({"request": {"model": "oai/gpt-4o-mini",
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}});
    app.run_job(ACME, &small, 30).await;
    eventually(30, "the limit to be learned", || async {
        (bucket(&app, tpm).await?["capacity"] == 3000.0).then_some(())
    })
    .await;
    assert!(app.mock.set_limits(
        "oai-test",
        ProjectLimits {
            rpm: 1000,
            tpm: 100_000,
            ..ProjectLimits::default()
        }
    ));
    let mut large = small.clone();
    large["request"]["max_tokens"] = json!(5000);

    // While the reading is fresh it is trusted: the job can never fit.
    let (status, first) = app.submit(ACME, &large).await;
    assert_eq!(status, 202, "{first}");
    let first = app.wait_job(ACME, first["id"].as_str().expect("id"), 30).await;
    assert_eq!(first["error"]["code"], "exceeds_limit", "{first}");

    // The reading ages past its trust without renewal: the next one goes alone, as a
    // probe, and its answer teaches the new limit.
    sqlx::query("UPDATE buckets SET learned_at = learned_at - $1::interval WHERE key = $2")
        .bind(format!("{} seconds", tollgate::learning::TRUSTED_FOR.as_secs()))
        .bind(tpm)
        .execute(&app.db.pool)
        .await
        .expect("age the reading");
    let probe = app.run_job(ACME, &large, 30).await;
    assert_eq!(probe["state"], "succeeded", "{probe}");
    eventually(30, "the raised limit to be learned", || async {
        let b = bucket(&app, tpm).await?;
        (b["capacity"] == 100_000.0).then_some(())
    })
    .await;
    // The mock refills a raised limit at its new rate from the level it had: a probe sent
    // within a second or two of the raise may meet one 429 (and is retried). The
    // provider's limit is never exceeded.
    let stats = app.mock.stats();
    assert!(stats.rate_limited_429 <= 1, "{stats:?}");
    assert_eq!(stats.limit_violations, 0, "{stats:?}");
    app.shutdown().await;
}

#[tokio::test]
async fn a_429_pauses_only_the_pool_of_the_key_that_met_it() {
    // Calls take 200 ms, so that the calls sent to pa together are on their way at once.
    let mut mock = two_accounts(600);
    mock.latency_ms = 200;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: POOLED.into(),
        server_config: format!("admin_key = \"{ADMIN}\""),
        ..TestOptions::default()
    })
    .await;
    // Once every key has answered, the model's keys are known to be in two pools.
    submit_pooled(&app, 0..12).await;
    assert_eq!(drain(&app, 12, 60).await, 12);
    eventually(30, "the model's keys to be in two pools", || async {
        let (_, limits) = app.get(ACME, "/v1/limits").await;
        let pools = limits["pools"]
            .as_array()?
            .iter()
            .filter(|p| p["provider"] == "pooled")
            .count();
        (pools == 2).then_some(())
    })
    .await;
    // Account pa's limit falls to one request a minute without notice: its next call meets
    // a 429, whose pause holds pa's keys and not pb's.
    assert!(app.mock.set_limits(
        "pa",
        ProjectLimits {
            rpm: 1,
            ..ProjectLimits::default()
        }
    ));
    // All at once: the calls the gate sends to pa's keys before its first answer (200 ms)
    // can teach the new limit are on their way together, and all but one meet the 429.
    let jobs: Vec<Value> = (12..60).map(pooled_job).collect();
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({ "jobs": jobs })).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(drain(&app, 60, 60).await, 60);
    let pauses: Vec<(String, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT scope, until FROM pauses WHERE reason = 'rate_limited' ORDER BY scope")
            .fetch_all(&app.db.pool)
            .await
            .expect("pauses");
    let scopes: Vec<&str> = pauses.iter().map(|(scope, _)| scope.as_str()).collect();
    assert_eq!(scopes, ["pool:pooled:org-pa:gpt-4o-mini"], "{pauses:?}");
    // pb served on while pa was paused, the job that met the 429 too: the last job ended
    // before pa's pause did.
    let (last_finished,): (chrono::DateTime<chrono::Utc>,) =
        sqlx::query_as("SELECT max(finished_at) FROM jobs")
            .fetch_one(&app.db.pool)
            .await
            .expect("last finished");
    let (_, listed) = app.get(ADMIN, "/v1/admin/pauses").await;
    let pool = listed["data"]
        .as_array()
        .and_then(|d| d.iter().find(|p| p["scope"] == scopes[0]))
        .unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(
        (&pool["kind"], &pool["provider"], &pool["model"], &pool["by"]),
        (
            &json!("pool"),
            &json!("pooled"),
            &json!("gpt-4o-mini"),
            &json!("provider")
        ),
        "{pool}"
    );
    let stats = app.mock.stats();
    assert!(
        stats.projects.get("pa").is_some_and(|p| p.rate_limited_429 >= 1),
        "{stats:?}"
    );
    assert_eq!(stats.limit_violations, 0, "{stats:?}");
    assert!(
        last_finished < pauses[0].1,
        "{last_finished} after the pause {pauses:?}"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn keys_declared_in_two_accounts_are_two_pools_from_their_first_call() {
    // Gemini names no account in its responses: the keys' projects are declared. Project
    // ga allows one request a minute, gb plenty.
    let mut mock = crate::harness::mock_config();
    for (name, key, rpm) in [("ga", "g-ga-1", 1), ("gb", "g-gb-1", 600)] {
        mock.projects.push(crate::harness::mock_project(
            name,
            tollgate_mock::ProviderKind::Gemini,
            &[key],
            &["gemini-2.0-flash"],
            rpm,
        ));
    }
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: r#"
[[providers]]
name = "gem"
kind = "gemini"
base_url = "http://MOCK_ADDR"
keys = [
  { name = "g1", value = "g-ga-1", account = "proj-a" },
  { name = "g2", value = "g-gb-1", account = "proj-b" },
]
models = ["gemini-2.0-flash"]
"#
        .into(),
        server_config: format!("admin_key = \"{ADMIN}\""),
        ..TestOptions::default()
    })
    .await;
    let listed = |limits: &Value| -> Vec<(Value, Value)> {
        limits["pools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["provider"] == "gem")
            .map(|p| (p["account"].clone(), p["keys"].clone()))
            .collect()
    };
    // Before any call, two pools.
    let (_, limits) = app.get(ACME, "/v1/limits").await;
    assert_eq!(
        listed(&limits),
        [(json!("proj-a"), json!(["g1"])), (json!("proj-b"), json!(["g2"]))],
        "{limits}"
    );
    // A key added at runtime in proj-b joins its pool; an account that cannot be part of a
    // scope is refused, naming the field.
    let keys = "/v1/admin/provider-keys";
    let (status, refused) = app
        .post(
            ADMIN,
            keys,
            &json!({"provider": "gem", "name": "g3", "value": "g-gb-1", "account": "proj:b"}),
        )
        .await;
    assert_eq!(
        (status, &refused["error"]["param"]),
        (400, &json!("account")),
        "{refused}"
    );
    let (status, added) = app
        .post(
            ADMIN,
            keys,
            &json!({"provider": "gem", "name": "g3", "value": "g-gb-1", "account": "proj-b"}),
        )
        .await;
    assert_eq!((status, &added["account"]), (201, &json!("proj-b")), "{added}");
    eventually(10, "the added key in proj-b's pool", || async {
        let (_, limits) = app.get(ACME, "/v1/limits").await;
        (listed(&limits)
            == [
                (json!("proj-a"), json!(["g1"])),
                (json!("proj-b"), json!(["g2", "g3"])),
            ])
        .then_some(())
    })
    .await;

    // ga's first 429 pauses proj-a's pool alone; proj-b serves every job.
    for _ in 0..30 {
        let (status, body) = app
            .submit(
                ACME,
                &json!({"request": crate::adapters::chat("gem/gemini-2.0-flash")}),
            )
            .await;
        assert_eq!(status, 202, "{body}");
    }
    assert_eq!(drain(&app, 30, 60).await, 30);
    let scopes: Vec<(String,)> =
        sqlx::query_as("SELECT scope FROM pauses WHERE reason = 'rate_limited' ORDER BY scope")
            .fetch_all(&app.db.pool)
            .await
            .expect("pauses");
    assert_eq!(
        scopes,
        [("pool:gem:proj-a:gemini-2.0-flash".to_owned(),)],
        "only proj-a's pool paused"
    );
    let stats = app.mock.stats();
    let project = |p: &str| stats.projects.get(p).cloned().unwrap_or_default();
    assert!(project("ga").rate_limited_429 >= 1, "{stats:?}");
    assert!(
        project("gb").requests_admitted >= 28,
        "proj-b served on while proj-a was paused: {stats:?}"
    );
    assert_eq!(stats.limit_violations, 0, "{stats:?}");
    app.shutdown().await;
}

/// A provider whose keys are in two of the mock's accounts ([`two_accounts`]).
const POOLED: &str = r#"
[[providers]]
name = "pooled"
kind = "openai"
base_url = "http://MOCK_ADDR/v1"
keys = [
  { name = "p1", value = "sk-pa-1" },
  { name = "p2", value = "sk-pa-2" },
  { name = "p3", value = "sk-pb-1" },
]
models = ["gpt-4o-mini"]
"#;

/// Submits jobs `range` to the [`POOLED`] provider.
async fn submit_pooled(app: &TestApp, range: std::ops::Range<usize>) {
    for i in range {
        let (status, body) = app.submit(ACME, &pooled_job(i)).await;
        assert_eq!(status, 202, "{body}");
    }
}

/// Job `i` of [`mixed_job`]'s mix, to the [`POOLED`] provider.
fn pooled_job(i: usize) -> Value {
    let mut job = mixed_job(i);
    job["request"]["model"] = json!("pooled/gpt-4o-mini");
    job
}

/// Keys of two provider accounts: `pa` (keys p1 and p2) and `pb` (key p3), each allowed
/// `rpm` requests a minute; the harness's own projects beside them.
fn two_accounts(rpm: u64) -> MockConfig {
    let mut mock = crate::harness::mock_config();
    for (name, keys) in [("pa", &["sk-pa-1", "sk-pa-2"][..]), ("pb", &["sk-pb-1"][..])] {
        mock.projects.push(crate::harness::mock_project(
            name,
            tollgate_mock::ProviderKind::Openai,
            keys,
            &[],
            rpm,
        ));
    }
    mock
}

#[tokio::test]
async fn keys_of_one_account_share_its_limits_and_two_accounts_are_learned_apart() {
    const RPM: u64 = 240;
    const JOBS: usize = 3 * RPM as usize;
    let app = TestApp::spawn_with(TestOptions {
        mock: two_accounts(RPM),
        extra_config: POOLED.into(),
        ..TestOptions::default()
    })
    .await;
    submit_pooled(&app, 0..JOBS).await;
    assert_eq!(drain(&app, JOBS, 180).await, JOBS as i64);

    // p1 and p2 share account pa's limit: had they been taken for two pools, twice its
    // limit would have been sent there and answered 429.
    let stats = app.mock.stats();
    assert_eq!(stats.limit_violations, 0, "{stats:?}");
    assert!(
        stats.rate_limited_429 * 50 <= stats.requests,
        "more than 2% of provider calls were 429s: {stats:?}"
    );
    let (status, limits) = app.get(ACME, "/v1/limits").await;
    assert_eq!(status, 200, "{limits}");
    let pools: Vec<(Value, Value, Value)> = limits["pools"]
        .as_array()
        .expect("pools")
        .iter()
        .filter(|p| p["provider"] == "pooled")
        .map(|p| (p["account"].clone(), p["keys"].clone(), p["scope"].clone()))
        .collect();
    assert_eq!(
        pools,
        [
            (
                json!("org-pa"),
                json!(["p1", "p2"]),
                json!("pool:pooled:org-pa:gpt-4o-mini")
            ),
            (
                json!("org-pb"),
                json!(["p3"]),
                json!("pool:pooled:org-pb:gpt-4o-mini")
            ),
        ],
        "{limits}"
    );
    for account in ["org-pa", "org-pb"] {
        let key = format!("pool:pooled:{account}:gpt-4o-mini:rpm");
        let rpm = bucket(&app, &key)
            .await
            .unwrap_or_else(|| panic!("{key} in {limits}"));
        assert_eq!(rpm["capacity"], RPM as f64, "{rpm}");
        assert_eq!(rpm["source"], "learned", "{rpm}");
    }

    // Both accounts' limits were used at once: the jobs started within the first minute
    // outnumber what one account's limit allows in it (its full bucket, then a minute's
    // refill: 2 × RPM), which is all one pool for the three keys would have let through.
    let (first_minute,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM jobs WHERE started_at < (SELECT min(started_at) FROM jobs) + interval '60 seconds'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("count");
    assert!(
        first_minute > 2 * RPM as i64,
        "{first_minute} calls in the first minute: no more than one account's limit"
    );
    let served = |p: &str| stats.projects.get(p).map_or(0, |s| s.requests_admitted);
    assert!(served("pa") > 0 && served("pb") > 0, "{stats:?}");
    app.shutdown().await;
}
