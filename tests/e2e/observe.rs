//! Seeing the broker: `/openapi.json` describes every route the server answers, and
//! describes the job as the server renders it; `/metrics` follows a workload.

use std::collections::HashMap;

use serde_json::Value;
use tollgate_mock::FaultConfig;

use crate::harness::{ACME, TestApp, TestOptions, eventually, job};

#[tokio::test]
async fn openapi_document_matches_what_the_server_serves() {
    let app = TestApp::spawn_with(TestOptions {
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 600\n".into(),
        ..TestOptions::default()
    })
    .await;
    let r = app.http.get(app.url("/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 8, "{:?}", paths.keys());
    // Every described operation is served: unauthenticated, each answers something other
    // than the fallback's `no_such_endpoint` or 405.
    for (path, item) in paths {
        let concrete = path.replace("{id}", "0190b7a0-0000-7000-8000-000000000000");
        for method in item.as_object().unwrap().keys() {
            let m: reqwest::Method = method.to_uppercase().parse().unwrap();
            let r = app
                .http
                .request(m.clone(), app.url(&concrete))
                .header("content-type", "application/json")
                .body("{}")
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            assert!(
                status != 405 && body["error"]["code"] != "no_such_endpoint",
                "{m} {path} is described but not served: {status} {body}"
            );
        }
    }
    // The job as described is the job as served: by `GET /v1/jobs/{id}`, and less its
    // `request` wherever else a job is shown.
    let (status, submitted) = app.submit(ACME, &job("fast", "describe me")).await;
    assert_eq!(status, 202);
    let (_, read) = app
        .get(ACME, &format!("/v1/jobs/{}", submitted["id"].as_str().unwrap()))
        .await;
    let described = doc["components"]["schemas"]["Job"]["properties"]
        .as_object()
        .unwrap();
    let mut described_keys: Vec<&str> = described.keys().map(String::as_str).collect();
    described_keys.sort();
    assert_eq!(
        sorted_keys(&read),
        described_keys,
        "the Job schema drifted from jobs::job_view"
    );
    described_keys.retain(|k| *k != "request");
    assert_eq!(
        sorted_keys(&submitted),
        described_keys,
        "a submitted job shows no request"
    );
    // So is a limit.
    let (status, limits) = app.get(ACME, "/v1/limits").await;
    assert_eq!(status, 200);
    let mut served_keys: Vec<&String> = limits["data"][0].as_object().unwrap().keys().collect();
    let described = doc["components"]["schemas"]["Limit"]["properties"]
        .as_object()
        .unwrap();
    let mut described_keys: Vec<&String> = described.keys().collect();
    served_keys.sort();
    described_keys.sort();
    assert_eq!(
        served_keys, described_keys,
        "the Limit schema drifted from limits::view"
    );
    app.shutdown().await;
}

/// The value of the series `name` whose labels include all of `labels`, summed; 0 when
/// there is none.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let have: Vec<(&str, &str)> = rest
                .split("\",")
                .filter_map(|kv| kv.split_once("=\""))
                .map(|(k, v)| (k, v.trim_end_matches('"')))
                .collect();
            labels
                .iter()
                .all(|want| have.contains(want))
                .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

pub const ADMIN: &str = "tk-admin";

/// Two tenants of a test's own (so counters recorded by other tests running in this
/// process do not mix in; their keys are `tk-<name>`): `watcher`, unlimited, and
/// `waiter`, 2 requests a day (its jobs past the second wait for the next UTC day, when
/// [`waiting_job`] gives them a deadline after it). The Anthropic project of the mock answers every call
/// 529 (overloaded).
pub fn watched_options(watcher: &str, waiter: &str) -> TestOptions {
    let mut mock = crate::harness::mock_config();
    mock.faults = vec![FaultConfig {
        project: Some("ant-test".into()),
        start_ms: 0,
        duration_ms: 0,
        status: 529,
        probability: 1.0,
    }];
    TestOptions {
        mock,
        server_config: format!("admin_key = \"{ADMIN}\""),
        extra_config: format!(
            "[[tenants]]\nname = \"{watcher}\"\napi_key = \"tk-{watcher}\"\ndaily_spend_usd = 5\n\
             [[tenants]]\nname = \"{waiter}\"\napi_key = \"tk-{waiter}\"\nrpd = 2\n"
        ),
        ..TestOptions::default()
    }
}

const WATCHER: &str = "tk-watcher";
const WAITER: &str = "tk-waiter";

/// A job for `waiter` whose deadline is after the next UTC midnight, so it waits there.
pub fn waiting_job(i: usize) -> Value {
    let mut body = job("fast", &format!("wait {i}"));
    body["deadline"] = (chrono::Utc::now() + chrono::Duration::days(2))
        .to_rfc3339()
        .into();
    body
}

/// An object's keys, sorted.
fn sorted_keys(object: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = object.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort();
    keys
}

/// `/metrics` as the admin scrapes it.
pub async fn scrape(app: &TestApp) -> String {
    let r = app
        .http
        .get(app.url("/metrics"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

#[tokio::test]
async fn metrics_follow_a_workload() {
    let mut options = watched_options("watcher", "waiter");
    // switcher's route prefers the overloaded Anthropic model and falls back to OpenAI.
    options.extra_config.push_str(
        "[[tenants]]\nname = \"switcher\"\napi_key = \"tk-switcher\"\n\
         [[routes]]\nalias = \"either\"\ntargets = [\"ant/claude-3-5-haiku-latest\", \"oai/gpt-4o-mini\"]\n",
    );
    let app = TestApp::spawn_with(options).await;
    // Who may scrape: the admin key only, once one is configured.
    let r = app.http.get(app.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = app
        .http
        .get(app.url("/metrics"))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let before = scrape(&app).await;
    assert_eq!(
        metric(
            &before,
            "tollgate_admission_decisions_total",
            &[("tenant", "watcher")]
        ),
        0.0
    );

    // watcher: 10 jobs that succeed, 2 that meet an overloaded provider until they run
    // out of attempts (4 each).
    let mut ids = Vec::new();
    for i in 0..10 {
        let (status, j) = app.submit(WATCHER, &job("fast", &format!("watch {i}"))).await;
        assert_eq!(status, 202, "{j}");
        ids.push(j["id"].as_str().unwrap().to_owned());
    }
    for i in 0..2 {
        let (status, j) = app
            .submit(
                WATCHER,
                &job("ant/claude-3-5-haiku-latest", &format!("overloaded {i}")),
            )
            .await;
        assert_eq!(status, 202, "{j}");
        ids.push(j["id"].as_str().unwrap().to_owned());
    }
    let (status, switched) = app.submit("tk-switcher", &job("either", "fall back")).await;
    assert_eq!(status, 202, "{switched}");
    // waiter: 5 jobs; its limit of 2 a day admits 2, the rest wait for tomorrow.
    for i in 0..5 {
        let (status, _) = app.submit(WAITER, &waiting_job(i)).await;
        assert_eq!(status, 202);
    }
    let mut states = HashMap::new();
    for id in &ids {
        let j = app.wait_job(WATCHER, id, 60).await;
        *states.entry(j["state"].as_str().unwrap().to_owned()).or_insert(0) += 1;
    }
    assert_eq!(states.get("succeeded"), Some(&10), "{states:?}");
    assert_eq!(states.get("failed"), Some(&2), "{states:?}");
    let switched = app
        .wait_job("tk-switcher", switched["id"].as_str().unwrap(), 60)
        .await;
    assert_eq!(switched["state"], "succeeded", "{switched}");

    // The dispatcher counts a finished job after writing it: poll until it has.
    let text = eventually(30, "the finished jobs to be counted", || async {
        let text = scrape(&app).await;
        let finished = metric(&text, "tollgate_jobs_finished_total", &[("tenant", "watcher")]);
        let queued = metric(
            &text,
            "tollgate_queue_depth",
            &[("tenant", "waiter"), ("state", "queued")],
        );
        (finished == 12.0 && queued == 3.0).then_some(text)
    })
    .await;
    let m = |name: &str, labels: &[(&str, &str)]| metric(&text, name, labels);
    // Admission: every watcher job admitted once per attempt (10 + 2 × 4); waiter's
    // jobs wait on its own rpd bucket.
    assert_eq!(
        m(
            "tollgate_admission_decisions_total",
            &[("tenant", "watcher"), ("decision", "admitted")]
        ),
        18.0
    );
    assert_eq!(
        m(
            "tollgate_admission_decisions_total",
            &[("tenant", "waiter"), ("decision", "admitted")]
        ),
        2.0
    );
    // Each of the 3 waits (behind the first, which the bucket holds back).
    assert!(
        m(
            "tollgate_admission_decisions_total",
            &[("tenant", "waiter"), ("decision", "waiting")]
        ) >= 3.0,
        "{text}"
    );
    assert!(
        m(
            "tollgate_admission_decisions_total",
            &[
                ("tenant", "waiter"),
                ("decision", "waiting"),
                ("bucket", "tenant:waiter:rpd"),
                ("reason", "waiting_for_capacity")
            ]
        ) >= 1.0,
        "{text}"
    );
    assert_eq!(
        m(
            "tollgate_queue_wait_seconds_count",
            &[("tenant", "watcher"), ("class", "standard")]
        ),
        18.0
    );
    // The fall back: one 529 on the preferred target, then the other.
    assert_eq!(
        m(
            "tollgate_fallbacks_total",
            &[
                ("tenant", "switcher"),
                ("route", "either"),
                ("target", "oai/gpt-4o-mini")
            ]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(m("tollgate_retries_total", &[("tenant", "switcher")]), 1.0);
    assert_eq!(m("tollgate_fallbacks_total", &[("tenant", "watcher")]), 0.0);
    // Outcomes, retries and attempts per job.
    assert_eq!(
        m(
            "tollgate_jobs_finished_total",
            &[("tenant", "watcher"), ("state", "succeeded")]
        ),
        10.0
    );
    assert_eq!(
        m(
            "tollgate_jobs_finished_total",
            &[
                ("tenant", "watcher"),
                ("state", "failed"),
                ("code", "attempts_exhausted")
            ]
        ),
        2.0
    );
    assert_eq!(
        m(
            "tollgate_retries_total",
            &[("tenant", "watcher"), ("code", "provider_overloaded")]
        ),
        6.0
    );
    assert_eq!(
        m(
            "tollgate_attempts_per_job_count",
            &[("tenant", "watcher"), ("state", "failed")]
        ),
        2.0
    );
    assert_eq!(
        m(
            "tollgate_attempts_per_job_sum",
            &[("tenant", "watcher"), ("state", "failed")]
        ),
        8.0
    );
    assert_eq!(
        m(
            "tollgate_attempts_per_job_sum",
            &[("tenant", "watcher"), ("state", "succeeded")]
        ),
        10.0
    );
    // Provider responses (other tests in this process call the mock too: at least).
    assert!(
        m(
            "tollgate_provider_responses_total",
            &[("provider", "ant"), ("status", "529"), ("class", "overload")]
        ) >= 8.0
    );
    assert!(
        m(
            "tollgate_provider_throttles_total",
            &[("provider", "ant"), ("status", "529")]
        ) >= 8.0
    );
    assert!(
        m(
            "tollgate_provider_responses_total",
            &[("provider", "oai"), ("status", "200"), ("class", "ok")]
        ) >= 12.0
    );
    // Tokens: the mock writes 12 output tokens of the 32 reserved.
    let actual_out = m(
        "tollgate_tokens_actual_total",
        &[
            ("provider", "oai"),
            ("endpoint", "/v1/chat/completions"),
            ("direction", "output"),
        ],
    );
    let estimated_out = m(
        "tollgate_tokens_estimated_total",
        &[("provider", "oai"), ("direction", "output")],
    );
    let wasted_out = m(
        "tollgate_over_reserved_tokens_total",
        &[("provider", "oai"), ("direction", "output")],
    );
    assert!(actual_out >= 12.0 * 12.0, "{actual_out}");
    assert!(estimated_out > actual_out);
    assert!(wasted_out >= 12.0 * 20.0, "{wasted_out}");
    // Levels read from the database at scrape time.
    assert_eq!(
        m(
            "tollgate_queue_depth",
            &[("tenant", "waiter"), ("class", "standard"), ("state", "queued")]
        ),
        3.0
    );
    assert!(
        m(
            "tollgate_queue_oldest_age_seconds",
            &[("tenant", "waiter"), ("class", "standard")]
        ) > 0.0
    );
    assert_eq!(m("tollgate_queue_depth", &[("tenant", "watcher")]), 0.0);
    assert_eq!(
        m(
            "tollgate_bucket_limit",
            &[("bucket", "tenant:waiter:rpd"), ("source", "configured")]
        ),
        2.0
    );
    assert!(m("tollgate_bucket_level", &[("bucket", "tenant:waiter:rpd")]) < 1.0);
    assert_eq!(
        m("tollgate_daily_headroom", &[("bucket", "tenant:waiter:rpd")]),
        0.0
    );
    assert!(
        text.contains("tollgate_daily_headroom{bucket=\"tenant:waiter:rpd\""),
        "{text}"
    );
    assert!(m("tollgate_bucket_utilization", &[("bucket", "tenant:waiter:rpd")]) > 0.5);
    assert!(
        text.contains("tollgate_tenant_share{tenant=\"watcher\"}"),
        "{text}"
    );
    assert_eq!(m("tollgate_tenant_weight", &[("tenant", "acme")]), 3.0);
    // /v1/status: a tenant sees its own queues, failures and buckets; the admin all.
    let (status, own) = app.get(WAITER, "/v1/status").await;
    assert_eq!(status, 200);
    assert_eq!(own["scope"], "waiter");
    let queues = own["queues"].as_array().unwrap();
    assert!(
        queues.iter().any(|q| q["queued"] == 3) && queues.iter().all(|q| q["tenant"] == "waiter"),
        "{own}"
    );
    assert_eq!(
        own["recent_failures"].as_array().map(Vec::len),
        Some(0),
        "watcher's failures leaked"
    );
    assert!(own["buckets"].to_string().contains("tenant:waiter:rpd"));
    let (_, other) = app.get(WATCHER, "/v1/status").await;
    assert!(!other.to_string().contains("waiter"), "{other}");
    assert_eq!(other["recent_failures"].as_array().map(Vec::len), Some(2));
    let (_, all) = app.get(ADMIN, "/v1/status").await;
    assert_eq!(all["scope"], "all");
    assert!(all.to_string().contains("tenant:waiter:rpd") && all.to_string().contains("\"watcher\""));
    // The sampler runs every 2 s (or less often when sampling is slow): wait for a sample
    // taken while waiter's jobs wait.
    let history = eventually(30, "a sample of waiter's queue", || async {
        let (_, h) = app.get(WAITER, "/v1/status/history").await;
        h.to_string().contains("waiter/standard").then_some(h)
    })
    .await;
    assert!(!history.to_string().contains("watcher"), "{history}");
    // Each sample says how long its traffic was counted for (rates divide by it).
    assert!(
        history["samples"].as_array().is_some_and(|s| s
            .iter()
            .all(|s| s["interval_secs"].as_f64().is_some_and(|i| i > 0.0))),
        "{history}"
    );
    eventually(30, "watcher's traffic in the admin's history", || async {
        let (_, h) = app.get(ADMIN, "/v1/status/history").await;
        h.to_string().contains("\"watcher\"").then_some(())
    })
    .await;
    // The admin key sees every tenant's jobs, each with its tenant.
    let (status, jobs) = app.get(ADMIN, "/v1/jobs?limit=100").await;
    assert_eq!(status, 200, "{jobs}");
    let tenants: std::collections::BTreeSet<&str> = jobs["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|j| j["tenant"].as_str())
        .collect();
    assert!(
        tenants.contains("watcher") && tenants.contains("waiter"),
        "{tenants:?}"
    );
    // The Grafana dashboard charts series that exist: each name it queries is served (or,
    // for events this workload has none of, is one tollgate records).
    let grafana = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/tollgate.json"
    ))
    .unwrap();
    let recorded_elsewhere = [tollgate::metrics::FALLBACKS, tollgate::metrics::RETRY_AFTER];
    let mut charted = 0;
    for word in grafana.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if !word.starts_with("tollgate_") {
            continue;
        }
        let name = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| word.strip_suffix(s))
            .filter(|base| recorded_elsewhere.contains(base) || text.contains(&format!("{base}_count")))
            .unwrap_or(word);
        charted += 1;
        assert!(
            recorded_elsewhere.contains(&name)
                || text.contains(&format!("\n{name}{{"))
                || text.contains(&format!("# TYPE {name} ")),
            "the Grafana dashboard queries {word}, which /metrics does not serve"
        );
    }
    assert!(charted >= 19, "{charted}");
    app.shutdown().await;
}

#[tokio::test]
async fn traffic_by_tenant_counts_each_tenants_attempts() {
    let db = crate::harness::fresh_db_with(0).await;
    // (tenant, status): two calls of acme's (one a 429), one of globex's.
    let records = [("acme", 200), ("acme", 429), ("globex", 200)];
    for (tenant, status) in records {
        sqlx::query(
            "INSERT INTO job_attempts (job_id, attempt, provider, provider_model, key_name, status, outcome,
                                       input_tokens, output_tokens, estimated_input_tokens,
                                       estimated_output_tokens, started_at, finished_at, tenant)
             VALUES ($1, 1, 'oai', 'gpt-4o-mini', 'k1', $2, CASE WHEN $2 = 200 THEN 'succeeded' ELSE 'failed' END,
                     10, 5, 10, 5, now(), now(), $3)",
        )
        .bind(uuid::Uuid::now_v7())
        .bind(status)
        .bind(tenant)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let now = chrono::Utc::now();
    let since = now - chrono::Duration::minutes(1);
    let all = tollgate::store::traffic(&db.pool, since, now, None)
        .await
        .unwrap();
    let by_tenant: HashMap<&str, &tollgate::store::Traffic> =
        all.iter().map(|t| (t.tenant.as_str(), t)).collect();
    assert_eq!(by_tenant.len(), 2, "{all:?}");
    let acme = by_tenant["acme"];
    assert_eq!(
        (acme.succeeded, acme.failed, acme.status_429, acme.tokens),
        (1, 1, 1, 30)
    );
    assert_eq!(
        (by_tenant["globex"].succeeded, by_tenant["globex"].tokens),
        (1, 15)
    );
    let globex = tollgate::store::traffic(&db.pool, since, now, Some("globex"))
        .await
        .unwrap();
    assert_eq!(globex.len(), 1);
    assert_eq!(globex[0].tenant, "globex");
}

/// Rows of `jobs` and `job_attempts` the transaction has read so far (index entries and
/// heap tuples, by any scan).
async fn rows_read(tx: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT sum(pg_stat_get_xact_tuples_returned(rel))::bigint FROM (
             SELECT unnest(ARRAY['jobs'::regclass, 'job_attempts'::regclass])::oid AS rel
             UNION ALL
             SELECT indexrelid FROM pg_index WHERE indrelid IN ('jobs'::regclass, 'job_attempts'::regclass)
         ) r",
    )
    .fetch_one(tx)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_tenant_s_status_reads_its_own_rows_not_everyone_s() {
    let db = crate::harness::fresh_db_with(0).await;
    // globex: 5,000 queued jobs, 2,000 failed ones with an attempt each in the last minute;
    // acme: one of each.
    for (tenant, n) in [("globex", 5_000), ("acme", 1)] {
        sqlx::query(
            "INSERT INTO jobs (id, tenant, class, state, request, model, deadline, not_before, attempt,
                               max_attempts, estimated_input_tokens, estimated_output_tokens,
                               error_code, created_at, started_at, finished_at)
             SELECT gen_random_uuid(), $1, 'standard', s.state, '{}', 'fast', now() + interval '1 day',
                    now(), 1, 1, 10, 10, CASE WHEN s.state = 'failed' THEN 'x' END, now(), now(),
                    CASE WHEN s.state = 'failed' THEN now() END
             FROM generate_series(1, $2) i,
                  LATERAL (SELECT CASE WHEN i % 5 < 2 THEN 'failed' ELSE 'queued' END::job_state AS state) s",
        )
        .bind(tenant)
        .bind(n.max(2))
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO job_attempts (job_id, attempt, tenant, provider, provider_model, key_name, status,
                                       outcome, estimated_input_tokens, estimated_output_tokens,
                                       started_at, finished_at)
             SELECT id, 1, tenant, 'oai', 'm', 'k', 400, 'failed', 10, 10, now(), now()
             FROM jobs WHERE tenant = $1 AND state = 'failed'",
        )
        .bind(tenant)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    sqlx::query("ANALYZE jobs, job_attempts")
        .execute(&db.pool)
        .await
        .unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let before = rows_read(&mut tx).await;
    let now = chrono::Utc::now();
    let queues = tollgate::store::queue_depths(&mut *tx, Some("acme"))
        .await
        .unwrap();
    let traffic = tollgate::store::traffic(&mut *tx, now - chrono::Duration::seconds(60), now, Some("acme"))
        .await
        .unwrap();
    let failures = tollgate::store::recent_failures(&mut *tx, Some("acme"), 10)
        .await
        .unwrap();
    let read = rows_read(&mut tx).await - before;
    assert_eq!(queues.iter().map(|q| q.queued).sum::<i64>(), 1, "{queues:?}");
    assert_eq!(traffic.iter().map(|t| t.failed).sum::<i64>(), 1, "{traffic:?}");
    assert_eq!(failures.len(), 1, "{failures:?}");
    // Its own three rows and an index entry or two at each scan's edge: nothing of globex's
    // 7,000.
    assert!(read <= 20, "acme's status read {read} rows");
    tx.rollback().await.unwrap();

    // The operator's view still sees everyone.
    let all = tollgate::store::queue_depths(&db.pool, None).await.unwrap();
    assert_eq!(all.iter().map(|q| q.queued).sum::<i64>(), 3_001, "{all:?}");
}
