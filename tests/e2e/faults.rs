//! Provider faults: the mock's fault mix (500, 503, 529, resets, hangs, truncated and
//! non-JSON bodies, successes without usage) on a few hundred jobs. Every job ends
//! `succeeded` or `failed` with a reason, within its attempts and never dispatched after
//! its deadline, and every bucket comes back to full capacity. The checks are shared with
//! [`crate::chaos`].

use chrono::{Duration as ChronoDuration, Utc};
use futures::StreamExt;
use serde_json::Value;
use sqlx::PgPool;
use tollgate::store;
use tollgate::vocab::Rule;
use tollgate_mock::FaultMix;

use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, eventually, job, mock_config};

/// Submits `n` jobs through `api`, 32 at a time, each body (and tenant key) built by
/// `body` as it is sent; returns the accepted job ids in order.
pub async fn submit_all(
    http: &reqwest::Client,
    api: &str,
    n: usize,
    body: impl Fn(usize) -> (&'static str, Value),
) -> Vec<String> {
    let body = &body;
    futures::stream::iter(0..n)
        .map(|i| {
            let http = http.clone();
            let url = format!("{api}/v1/jobs");
            async move {
                let (key, body) = body(i);
                let r = http.post(url).bearer_auth(key).json(&body).send().await.unwrap();
                assert_eq!(r.status().as_u16(), 202, "submit");
                r.json::<Value>().await.unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            }
        })
        .buffered(32)
        .collect()
        .await
}

/// Waits until no job is left outside a terminal state.
pub async fn wait_all_terminal(pool: &PgPool, secs: u64) {
    eventually(secs, "every job to reach a terminal state", || async {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE state NOT IN ('succeeded', 'failed', 'cancelled')",
        )
        .fetch_one(pool)
        .await
        .ok()?;
        (open == 0).then_some(())
    })
    .await;
}

/// What the terminal jobs look like, checked: each `succeeded` with a result or `failed`
/// with a reason code, attempts within `max_attempts`, no reservation left, and no attempt
/// (nor the last dispatch) started after the job's deadline. Returns the number of jobs
/// per (state, reason code).
pub async fn check_terminal_jobs(pool: &PgPool, expected: usize) -> Vec<(String, Option<String>, i64)> {
    let bad: Vec<(uuid::Uuid, String, Option<String>, String)> = sqlx::query_as(
        "SELECT id, state::text, error_code,
                format('attempt %s of %s, result %s, reserved %s', attempt, max_attempts,
                       result IS NOT NULL, reserved_buckets IS NOT NULL)
         FROM jobs
         WHERE NOT ((state = 'succeeded' AND result IS NOT NULL)
                    OR (state = 'failed' AND error_code IS NOT NULL AND result IS NULL))
            OR attempt > max_attempts
            OR reserved_buckets IS NOT NULL",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(bad.is_empty(), "jobs in a bad final shape: {bad:?}");
    let late: Vec<(uuid::Uuid, i32)> = sqlx::query_as(
        "SELECT j.id, a.attempt FROM job_attempts a JOIN jobs j ON j.id = a.job_id
         WHERE a.started_at > j.deadline
         UNION ALL
         SELECT id, attempt FROM jobs WHERE started_at > deadline",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(late.is_empty(), "dispatched after the deadline: {late:?}");
    // One record per attempt number: an outcome is written once.
    let doubled: Vec<(uuid::Uuid, i32, i64)> = sqlx::query_as(
        "SELECT job_id, attempt, count(*) FROM job_attempts GROUP BY 1, 2 HAVING count(*) > 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(doubled.is_empty(), "an attempt recorded twice: {doubled:?}");
    let counts: Vec<(String, Option<String>, i64)> =
        sqlx::query_as("SELECT state::text, error_code, count(*) FROM jobs GROUP BY 1, 2 ORDER BY 1, 2")
            .fetch_all(pool)
            .await
            .unwrap();
    let total: i64 = counts.iter().map(|c| c.2).sum();
    assert_eq!(total, expected as i64, "{counts:?}");
    counts
}

/// Waits until every bucket is back to full capacity: gauges (concurrency) at once,
/// rolling buckets once a window's refill has passed (a stranded reservation would keep
/// a gauge below capacity for good). Settlements reach the buckets in the gate's next
/// round, hence the wait.
pub async fn wait_buckets_full(pool: &PgPool) -> usize {
    eventually(30, "every bucket back to full capacity", || async {
        let buckets = store::all_buckets(pool).await.ok()?;
        let mut checked = 0;
        for mut b in buckets {
            match b.rule {
                Rule::Gauge => {}
                Rule::Rolling => b.refill(Utc::now() + ChronoDuration::seconds(b.window_secs + 1)),
                // Daily windows and ramps are not full again within a test.
                Rule::Fixed | Rule::Ramp => continue,
            }
            if (b.level - b.capacity).abs() > 1e-6 {
                return None;
            }
            checked += 1;
        }
        Some(checked)
    })
    .await
}

#[tokio::test]
async fn every_provider_fault_is_classified_and_no_job_is_stuck() {
    const JOBS: usize = 300;
    let mut mock = mock_config();
    // Every kind at 3 %: about a quarter of all calls meet some fault.
    mock.fault_mix = FaultMix {
        hang_ms: 3_000,
        ..FaultMix::uniform(7, 0.03)
    };
    let app = TestApp::spawn_with(TestOptions {
        mock,
        // A hang is cut by the client timeout; maintenance expires deadlines promptly.
        dispatch_config: "request_timeout_secs = 1\nmaintenance_interval_ms = 200".into(),
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 12\nrpm = 100000\ntpm = 100000000\n\
                       [[tenants]]\nname = \"capped\"\napi_key = \"tk-capped\"\nconcurrency = 6\ntpm = 10000000\n"
            .into(),
        ..TestOptions::default()
    })
    .await;
    let ids = submit_all(&app.http, &app.api, JOBS, |i| {
        let model = if i % 3 == 0 {
            "ant/claude-3-5-haiku-latest"
        } else {
            "fast"
        };
        let mut body = job(model, &format!("fault job {i}"));
        // A quarter must finish within seconds: retries may not push them past it.
        if i % 4 == 0 {
            body["deadline"] = Value::String((Utc::now() + ChronoDuration::seconds(3)).to_rfc3339());
            body["on_deadline_risk"] = Value::from("accept");
        }
        ([ACME, GLOBEX, "tk-capped"][i % 3], body)
    })
    .await;
    assert_eq!(ids.len(), JOBS);
    wait_all_terminal(&app.db.pool, 120).await;
    let counts = check_terminal_jobs(&app.db.pool, JOBS).await;

    // Every kind of fault was met, and a failure's reason is one a client can act on.
    let stats = app.mock.stats();
    let f = stats.faults_injected;
    for (kind, n) in [
        ("500", f.http_500),
        ("503", f.http_503),
        ("529", f.http_529),
        ("reset", f.reset),
        ("hang", f.hang),
        ("truncated", f.truncated),
        ("non-JSON", f.non_json),
        ("no usage", f.no_usage),
    ] {
        assert!(n > 0, "no {kind} fault was injected: {f:?}");
    }
    for (state, code, _) in &counts {
        if state == "failed" {
            let code = code.as_deref().unwrap_or_default();
            assert!(
                matches!(code, "attempts_exhausted" | "deadline_exceeded"),
                "unexpected reason {code}: {counts:?}"
            );
        }
    }
    let succeeded: i64 = counts.iter().filter(|c| c.0 == "succeeded").map(|c| c.2).sum();
    assert!(succeeded as usize > JOBS / 2, "{counts:?}");
    // The failed attempts carry the classification of what went wrong.
    let codes: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT error_code FROM job_attempts WHERE error_code IS NOT NULL ORDER BY 1",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    for code in [
        "network_error",
        "provider_bad_response",
        "provider_error",
        "provider_overloaded",
        "provider_timeout",
    ] {
        assert!(
            codes.iter().any(|c| c == code),
            "no attempt failed with {code}: {codes:?}"
        );
    }
    // A success without usage is settled with the estimate, and says so.
    let estimated: Vec<(i32, i32, i32)> = sqlx::query_as(
        "SELECT (result->'usage'->>'completion_tokens')::int, estimated_output_tokens, attempt
         FROM jobs WHERE (result->'usage'->>'tollgate_estimated')::boolean",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert!(!estimated.is_empty(), "no success without usage reached a job");
    assert!(estimated.iter().all(|(out, est, _)| out == est), "{estimated:?}");

    let checked = wait_buckets_full(&app.db.pool).await;
    assert!(checked >= 4, "only {checked} buckets checked");
    eprintln!(
        "faults: {JOBS} jobs, {} provider requests, {} faults injected {f:?}, {counts:?}, \
         {} usage estimated, {checked} buckets full",
        stats.requests,
        f.total(),
        estimated.len()
    );
    assert_eq!(stats.limit_violations, 0);
    app.shutdown().await;
}

#[tokio::test]
async fn a_call_that_times_out_keeps_the_tokens_the_provider_counted() {
    // The mock answers after 3 s, the broker gives up after 1: the provider took each
    // request and counted its tokens, though no answer came back. Given back, those tokens
    // would be sent again at once, past the provider's limit.
    let mut mock = mock_config();
    mock.latency_ms = 3_000;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        dispatch_config: "request_timeout_secs = 1".into(),
        retry_config: "max_attempts = 1".into(),
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\ntpm = 6000\n".into(),
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..4 {
        let mut body = job("fast", &format!("slow {i}"));
        body["request"]["max_tokens"] = 1000.into();
        let (status, created) = app.submit(ACME, &body).await;
        assert_eq!(status, 202, "{created}");
        ids.push(created["id"].as_str().unwrap().to_owned());
    }
    for id in &ids {
        let job = app.wait_job(ACME, id, 30).await;
        assert_eq!(job["state"], "failed", "{job}");
    }
    let codes: Vec<String> = sqlx::query_scalar("SELECT error_code FROM job_attempts")
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(codes, vec!["provider_timeout"; 4]);
    // Settlements reach the buckets in a gate round after the jobs end.
    eventually(10, "the timed-out calls settled", || async {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM pending_refunds")
            .fetch_one(&app.db.pool)
            .await
            .ok()?;
        (pending == 0).then_some(())
    })
    .await;
    let (_, limits) = app.get(ACME, "/v1/limits").await;
    let tpm = limits["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["bucket"] == "provider:oai:gpt-4o-mini:tpm")
        .cloned()
        .unwrap();
    // About 4 × 1,010 tokens taken, and some seconds of refill at 100 a second since.
    let remaining = tpm["remaining"].as_f64().unwrap();
    assert!(
        remaining < 3_000.0,
        "the timed-out calls' tokens were given back: {tpm}"
    );
    assert_eq!(app.mock.stats().requests, 4);
    app.shutdown().await;
}
