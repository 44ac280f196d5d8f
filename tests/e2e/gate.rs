//! The gate: limits hold across processes, capacity is shared by weight, reservations are
//! all or nothing and always come back, windows reset on time, budgets stop a tenant
//! with a clear reason.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Duration as ChronoDuration, TimeZone, Utc};
use futures::StreamExt;
use serde_json::{Value, json};
use tollgate::buckets::Bucket;
use tollgate::notify::Notifications;
use tollgate::store;
use tollgate_api::broker::Roles;
use tollgate_workers::gate::Gate;

use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, eventually, job, mock_config};

/// Submits `n` jobs built by `body(i)` with `clients` requests in flight, spread over `apis`.
pub(crate) async fn flood(
    app: &TestApp,
    apis: &[String],
    key: &str,
    n: usize,
    body: impl Fn(usize) -> Value,
) -> usize {
    let bodies: Vec<(String, Value)> = (0..n).map(|i| (apis[i % apis.len()].clone(), body(i))).collect();
    futures::stream::iter(bodies)
        .map(|(api, b)| {
            let http = app.http.clone();
            async move {
                let r = http
                    .post(format!("{api}/v1/jobs"))
                    .bearer_auth(key)
                    .json(&b)
                    .send()
                    .await
                    .unwrap();
                r.status().as_u16() == 202
            }
        })
        .buffer_unordered(32)
        .filter(|ok| futures::future::ready(*ok))
        .count()
        .await
}

/// (tenant, admitted_at, estimated input tokens, estimated output tokens)
type Admitted = (String, DateTime<Utc>, i32, i32);

pub(crate) async fn wait_all_finished(app: &TestApp, expected: i64, secs: u64) {
    let pool = app.db.pool.clone();
    eventually(secs, "every job to finish", || {
        let pool = pool.clone();
        async move {
            let done: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM jobs WHERE state IN ('succeeded', 'failed', 'cancelled')",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            (done >= expected).then_some(())
        }
    })
    .await;
}

async fn bucket(app: &TestApp, key: &str) -> Bucket {
    store::all_buckets(&app.db.pool)
        .await
        .unwrap()
        .into_iter()
        .find(|b| b.key == key)
        .unwrap_or_else(|| panic!("no bucket {key}"))
}

/// Waits until the bucket's level is `level` (settlements reach buckets in the gate's
/// next round).
async fn bucket_settles_at(app: &TestApp, key: &str, level: f64) {
    eventually(10, &format!("{key} to settle at {level}"), || async {
        (bucket(app, key).await.level == level).then_some(())
    })
    .await;
}

async fn reservations_held(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM jobs WHERE reserved_buckets IS NOT NULL")
        .fetch_one(&app.db.pool)
        .await
        .unwrap()
}

/// The mock answered all `jobs` with success, never a 429, never over a limit or over
/// `concurrency` calls at once.
pub(crate) async fn assert_the_provider_saw_every_job_within_its_limits(
    app: &TestApp,
    jobs: usize,
    concurrency: u64,
) {
    let stats = app.mock.stats();
    if stats.rate_limited_429 > 0 {
        // What the calls that did not succeed met, and when, to tell why.
        let failed: Vec<String> = sqlx::query_scalar(
            "SELECT format('%s attempt %s: %s %s, %s to %s', job_id, attempt, status, error_code,
                           started_at, finished_at)
             FROM job_attempts WHERE outcome <> 'succeeded' ORDER BY started_at LIMIT 50",
        )
        .fetch_all(&app.db.pool)
        .await
        .unwrap_or_default();
        // When the first admission and the first call were, and how long calls took: a
        // provider bucket sits full (losing its refill) until the first request reaches it.
        let timeline: Option<String> = sqlx::query_scalar(
            "SELECT format('first admitted %s, first call %s, calls took %s to %s',
                           (SELECT min(admitted_at) FROM jobs), min(started_at),
                           min(finished_at - started_at), max(finished_at - started_at))
             FROM job_attempts",
        )
        .fetch_one(&app.db.pool)
        .await
        .unwrap_or_default();
        panic!(
            "the broker caused provider 429s: {stats:?}; attempts that did not succeed: {failed:?}; {timeline:?}"
        );
    }
    assert_eq!(stats.limit_violations, 0, "{stats:?}");
    assert_eq!(stats.succeeded, jobs as u64);
    assert!(
        stats.max_in_flight <= concurrency,
        "concurrency limit broken: {}",
        stats.max_in_flight
    );
}

#[tokio::test]
async fn three_processes_never_exceed_the_providers_limit() {
    const RPM: u64 = 1200;
    const JOBS: usize = 1300;
    let mut mock = mock_config();
    mock.projects[0].rpm = RPM;
    mock.projects[0].tpm = 0;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: format!("[providers.limits.\"gpt-4o-mini\"]\nrpm = {RPM}\nconcurrency = 48\n"),
        // Only standard work here: nothing is held back for interactive jobs.
        gate_config: "interactive_reserve = 0.0".into(),
        roles: Roles::API_ONLY,
        // What the mock's headers teach must agree with the configured limit.
        learn_limits: true,
        peers: 3,
        ..TestOptions::default()
    })
    .await;
    // Queue everything first, so the drain measures the limit, not the submission.
    let apis = vec![app.api.clone()];
    let accepted = flood(&app, &apis, ACME, JOBS, |i| {
        job("oai/gpt-4o-mini", &format!("job {i}"))
    })
    .await;
    assert_eq!(accepted, JOBS);
    // Then three processes with every role (gate candidate, dispatcher, maintenance).
    let peer_a = app.spawn_peer(Roles::ALL).await;
    let peer_b = app.spawn_peer(Roles::ALL).await;
    let peer_c = app.spawn_peer(Roles::ALL).await;
    wait_all_finished(&app, JOBS as i64, 120).await;
    assert_the_provider_saw_every_job_within_its_limits(&app, JOBS, 48).await;
    // Throughput: the provider allows its burst plus the refill over the drain.
    let (first, last): (DateTime<Utc>, DateTime<Utc>) =
        sqlx::query_as("SELECT min(started_at), max(started_at) FROM jobs")
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    let secs = (last - first).num_milliseconds() as f64 / 1000.0;
    let allowed = RPM as f64 + RPM as f64 / 60.0 * secs;
    let efficiency = JOBS as f64 / allowed;
    eprintln!(
        "three processes: {JOBS} jobs in {secs:.2} s, {:.1}% of what rpm {RPM} allows, 0 429s",
        efficiency * 100.0
    );
    // How close to the limit the drain runs is a measurement (BENCHMARKS.md: 98–99 % on a
    // quiet machine), not a property: on a loaded CI machine it dips. What is asserted is
    // that the processes do not stall each other — half the limit at least.
    assert!(
        efficiency >= 0.5,
        "drained at {:.1}% of what the limit allows ({secs:.1} s)",
        efficiency * 100.0
    );
    assert_eq!(reservations_held(&app).await, 0);
    bucket_settles_at(&app, "provider:oai:gpt-4o-mini:concurrency", 48.0).await;
    peer_a.shutdown().await;
    peer_b.shutdown().await;
    peer_c.shutdown().await;
    app.shutdown().await;
}

#[tokio::test]
async fn interactive_jobs_admitted_as_they_arrive_at_three_processes_keep_the_limits() {
    // An interactive job is admitted by the process that receives it, in its insert's
    // transaction, without waiting for a gate round; what its buckets cannot hold queues
    // for the gate. Three processes taking arrivals at once never exceed the provider's
    // limits.
    const RPM: u64 = 600;
    const CONCURRENCY: u64 = 8;
    const JOBS: usize = 640;
    let mut mock = mock_config();
    mock.latency_ms = 20;
    mock.projects[0].rpm = RPM;
    mock.projects[0].tpm = 0;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: format!(
            "[providers.limits.\"gpt-4o-mini\"]\nrpm = {RPM}\nconcurrency = {CONCURRENCY}\n"
        ),
        roles: Roles::API_ONLY,
        learn_limits: true,
        peers: 3,
        ..TestOptions::default()
    })
    .await;
    let peers = [
        app.spawn_peer(Roles::ALL).await,
        app.spawn_peer(Roles::ALL).await,
        app.spawn_peer(Roles::ALL).await,
    ];
    let apis: Vec<String> = peers
        .iter()
        .map(|p| format!("http://{}", p.addr.expect("peer API")))
        .collect();
    let urgent = |i: usize| {
        let mut body = job("oai/gpt-4o-mini", &format!("urgent {i}"));
        body["class"] = json!("interactive");
        body
    };
    // Alone, it is running by the time the 202 answers.
    let first = app
        .http
        .post(format!("{}/v1/jobs", apis[0]))
        .bearer_auth(ACME)
        .json(&urgent(0))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status().as_u16(), 202);
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["state"], "running", "{first}");
    assert!(first["admitted_at"].is_string(), "{first}");
    // A crowd: more than the concurrency limit holds at once, more than a minute's requests.
    let states: Vec<String> = futures::stream::iter(1..JOBS)
        .map(|i| {
            let (http, url) = (app.http.clone(), format!("{}/v1/jobs", apis[i % apis.len()]));
            async move {
                let r = http
                    .post(url)
                    .bearer_auth(ACME)
                    .json(&urgent(i))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), 202);
                let body: Value = r.json().await.unwrap();
                body["state"].as_str().unwrap_or_default().to_owned()
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let on_arrival = states.iter().filter(|s| *s == "running").count();
    let queued = states.iter().filter(|s| *s == "queued").count();
    assert_eq!(on_arrival + queued, JOBS - 1, "{states:?}");
    assert!(
        on_arrival > 0 && queued > 0,
        "{on_arrival} started on arrival, {queued} queued"
    );
    wait_all_finished(&app, JOBS as i64, 120).await;
    assert_the_provider_saw_every_job_within_its_limits(&app, JOBS, CONCURRENCY).await;
    assert_eq!(reservations_held(&app).await, 0);
    bucket_settles_at(&app, "provider:oai:gpt-4o-mini:concurrency", CONCURRENCY as f64).await;
    for p in peers {
        p.shutdown().await;
    }
    app.shutdown().await;
}

/// What the provider was sent for acme (weight 3) and for globex (weight 1), in the tokens
/// its TPM counts (input and `max_tokens`), when three processes with every role drain more
/// of their jobs than its TPM lets through: acme's jobs ask for `acme_max` output tokens,
/// globex's for `globex_max`. With `late`, globex (known from a few early jobs, then idle)
/// comes back once acme has been served alone past the provider's full minute, and the
/// count starts when globex's burst credit is spent. acme's over globex's must be 3 ± 5 %.
async fn assert_shared_by_weight(acme_max: u64, globex_max: u64, late: bool) {
    const TPM: u64 = 60_000;
    // The provider's full minute, then about 20 s of its refill (after a late tenant's
    // credit, 30 s of it).
    const MEASURED: f64 = 80_000.0;
    const MEASURED_LATE: f64 = 30_000.0;
    let mut mock = mock_config();
    mock.projects[0].tpm = TPM;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: format!("[providers.limits.\"gpt-4o-mini\"]\ntpm = {TPM}\n"),
        gate_config: "interactive_reserve = 0.0".into(),
        roles: Roles::API_ONLY,
        peers: 3,
        ..TestOptions::default()
    })
    .await;
    let body = |max_tokens: u64| {
        move |i: usize| {
            let mut b = job("oai/gpt-4o-mini", &format!("job {i}"));
            b["request"]["max_tokens"] = json!(max_tokens);
            b
        }
    };
    // Twice what either is served while the count runs: both still wait at its end.
    let jobs = |share: f64, max_tokens: u64| (2.0 * share * MEASURED / (max_tokens + 10) as f64) as usize + 1;
    let apis = vec![app.api.clone()];
    let (acme_jobs, globex_jobs) = (jobs(1.5, acme_max), jobs(0.5, globex_max));
    assert_eq!(
        flood(&app, &apis, ACME, acme_jobs, body(acme_max)).await,
        acme_jobs
    );
    // Joining late, globex is known first (a few jobs beside acme's first), then idle.
    let (early, early_jobs) = if late { (3, 3.0) } else { (globex_jobs, 0.0) };
    assert_eq!(flood(&app, &apis, GLOBEX, early, body(globex_max)).await, early);
    let peers = [
        app.spawn_peer(Roles::ALL).await,
        app.spawn_peer(Roles::ALL).await,
        app.spawn_peer(Roles::ALL).await,
    ];
    let started = |tenant: &'static str| {
        let pool = app.db.pool.clone();
        async move {
            let tokens: Option<f64> = sqlx::query_scalar(
                "SELECT sum(estimated_input_tokens + estimated_output_tokens)::float8 FROM jobs
                 WHERE started_at IS NOT NULL AND tenant = $1",
            )
            .bind(tenant)
            .fetch_one(&pool)
            .await
            .unwrap();
            tokens.unwrap_or(0.0)
        }
    };
    let credit = app.config.gate.burst_credit_tokens as f64;
    let mut measured = MEASURED;
    if late {
        // Served alone past the provider's full minute, so what follows is its refill.
        eventually(60, "acme to be served alone", || async {
            (started("acme").await >= TPM as f64 + 5_000.0).then_some(())
        })
        .await;
        assert_eq!(
            flood(&app, &apis, GLOBEX, globex_jobs, body(globex_max)).await,
            globex_jobs
        );
        measured = credit + MEASURED_LATE;
    }
    let before = started("acme").await;
    eventually(120, "the provider's limit to be used", || async {
        (started("acme").await + started("globex").await >= before + measured).then_some(())
    })
    .await;
    let queued: i64 = sqlx::query_scalar("SELECT count(DISTINCT tenant) FROM jobs WHERE state = 'queued'")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(
        queued, 2,
        "both tenants still have work waiting: contended throughout"
    );
    // The count starts at globex's first job, or once its jobs after the early ones were
    // sent its burst credit.
    let credit = if late {
        credit + early_jobs * (globex_max + 10) as f64
    } else {
        0.0
    };
    let (tokens, globex_turns) = counted(&app.db.pool, "started_at", credit).await;
    // The same counted as the gate admitted them: a load that delays some starts past the
    // count's end shows as a gap between the two.
    let (admitted, _) = counted(&app.db.pool, "admitted_at", credit).await;
    assert!(globex_turns >= 10, "only {globex_turns} of globex's jobs counted");
    app.assert_no_provider_429s().await;
    // The leading gate tells the forecasts where each queue stands in its fair queuing.
    let lags = store::fairness_lags(&app.db.pool).await.unwrap();
    for tenant in ["acme", "globex"] {
        let lag = lags.get(&(tollgate::model::JobClass::Standard, tenant.to_owned()));
        assert!(lag.is_some_and(|l| l.is_finite()), "{lags:?}");
    }
    for p in peers {
        p.shutdown().await;
    }
    app.shutdown().await;
    let ratio = tokens["acme"] / tokens["globex"];
    let admitted_ratio = admitted["acme"] / admitted["globex"];
    eprintln!(
        "three processes, weights 3:1, max_tokens {acme_max}:{globex_max}{}: acme:globex tokens {ratio:.3} ({tokens:?}); as admitted {admitted_ratio:.3}",
        if late { ", globex late" } else { "" }
    );
    assert!(
        (2.85..=3.15).contains(&ratio),
        "acme:globex {ratio:.3}, want 3 ± 5 %: {tokens:?} (as admitted: {admitted_ratio:.3}, {admitted:?})"
    );
}

/// The tokens each tenant's jobs asked for, counted by `at` (`started_at` or
/// `admitted_at`) from globex's first job past `credit` tokens until its last, and how many
/// of globex's jobs that is. The count ends as globex's last job came: whole turns of
/// globex's, each a job of up to 600 tokens (3 % of its share), so where the count stops
/// does not tip the ratio by one job; acme's are counted up to then.
async fn counted(pool: &sqlx::PgPool, at: &str, credit: f64) -> (HashMap<String, f64>, usize) {
    let rows: Vec<(String, DateTime<Utc>, f64)> = sqlx::query_as(&format!(
        "SELECT tenant, {at}, (estimated_input_tokens + estimated_output_tokens)::float8 FROM jobs
         WHERE {at} IS NOT NULL ORDER BY {at}"
    ))
    .fetch_all(pool)
    .await
    .unwrap();
    let mut globex_so_far = 0.0;
    let from = rows
        .iter()
        .find(|(tenant, _, tokens)| {
            if tenant == "globex" {
                globex_so_far += tokens;
            }
            tenant == "globex" && globex_so_far > credit
        })
        .map(|r| r.1)
        .unwrap();
    let until = rows
        .iter()
        .rev()
        .find(|(tenant, _, _)| tenant == "globex")
        .map(|r| r.1)
        .unwrap();
    let mut tokens: HashMap<String, f64> = HashMap::new();
    let mut globex_turns = 0;
    for (tenant, at, t) in &rows {
        if *at >= from && *at < until {
            *tokens.entry(tenant.clone()).or_default() += t;
            globex_turns += usize::from(tenant == "globex");
        }
    }
    (tokens, globex_turns)
}

#[tokio::test]
async fn three_processes_share_a_contended_limit_by_weight() {
    assert_shared_by_weight(400, 400, false).await;
}

#[tokio::test]
async fn three_processes_share_by_weight_in_tokens_with_jobs_of_different_sizes() {
    assert_shared_by_weight(100, 600, false).await;
}

#[tokio::test]
async fn a_tenant_that_joins_late_has_its_burst_then_its_weight_s_share() {
    assert_shared_by_weight(100, 100, true).await;
}

#[tokio::test]
async fn contended_capacity_is_shared_by_weight_in_tokens() {
    // acme (weight 3) sends small jobs, globex (weight 1) large ones; the provider's TPM binds.
    let mut mock = mock_config();
    mock.projects[0].tpm = 20_000;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\ntpm = 20000\n".into(),
        ..TestOptions::default()
    })
    .await;
    let small = |i: usize| job("oai/gpt-4o-mini", &format!("small {i}"));
    let large = |i: usize| {
        job(
            "oai/gpt-4o-mini",
            &format!("large {i} {}", "lorem ipsum ".repeat(60)),
        )
    };
    let apis = vec![app.api.clone()];
    assert_eq!(flood(&app, &apis, ACME, 600, small).await, 600);
    assert_eq!(flood(&app, &apis, GLOBEX, 300, large).await, 300);
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default());
    // Drive the gate with a pinned clock: a round now, then one per simulated second.
    let t0 = Utc::now();
    for s in 0..10 {
        gate.run_once(t0 + ChronoDuration::seconds(s)).await.unwrap();
    }
    // Count the rounds after which both tenants still had work waiting: contention.
    let rows: Vec<Admitted> = sqlx::query_as(
        "SELECT tenant, admitted_at, estimated_input_tokens, estimated_output_tokens FROM jobs
         WHERE admitted_at IS NOT NULL ORDER BY admitted_at, id",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    let total = |t: &str| if t == "acme" { 600 } else { 300 };
    let mut admitted: HashMap<&str, usize> = HashMap::new();
    let mut tokens: HashMap<&str, f64> = HashMap::new();
    let mut rounds = 0;
    let mut groups: Vec<Vec<&Admitted>> = Vec::new();
    for r in &rows {
        match groups.last_mut() {
            Some(g) if g[0].1 == r.1 => g.push(r),
            _ => groups.push(vec![r]),
        }
    }
    for group in groups {
        let mut after = admitted.clone();
        for r in &group {
            *after.entry(r.0.as_str()).or_default() += 1;
        }
        if ["acme", "globex"]
            .iter()
            .any(|t| after.get(t).copied().unwrap_or(0) >= total(t))
        {
            break;
        }
        for r in &group {
            *tokens.entry(r.0.as_str()).or_default() += f64::from(r.2 + r.3);
        }
        admitted = after;
        rounds += 1;
    }
    assert!(rounds >= 5, "contention lasted only {rounds} rounds");
    let ratio = tokens["acme"] / tokens["globex"];
    eprintln!("weighted shares over {rounds} contended rounds: acme:globex tokens {ratio:.3} ({tokens:?})");
    assert!(
        (2.7..=3.3).contains(&ratio),
        "acme:globex token share {ratio:.2}, want 3 ± 10%: {tokens:?}"
    );
    // Requests are not what is shared: acme got far more than 3x the requests.
    let requests = |t: &str| admitted.get(t).copied().unwrap_or(0) as f64;
    assert!(requests("acme") / requests("globex") > 6.0);
    app.shutdown().await;
}

#[tokio::test]
async fn interactive_work_goes_first_and_keeps_its_reserve() {
    let mut mock = mock_config();
    mock.projects[0].rpm = 100;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 100\n".into(),
        ..TestOptions::default()
    })
    .await;
    let apis = vec![app.api.clone()];
    let mut background = job("oai/gpt-4o-mini", "bulk");
    background["class"] = json!("background");
    assert_eq!(flood(&app, &apis, ACME, 150, |_| background.clone()).await, 150);
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default());
    let t0 = Utc::now();
    let first = gate.run_once(t0).await.unwrap();
    // Background may use all but the interactive reserve (5% of 100) and the transit headroom.
    assert!(
        first.admitted >= 90 && first.admitted <= 95,
        "admitted {}",
        first.admitted
    );
    let mut urgent = job("oai/gpt-4o-mini", "now please");
    urgent["class"] = json!("interactive");
    let (_, accepted) = app.submit(GLOBEX, &urgent).await;
    let second = gate.run_once(Utc::now()).await.unwrap();
    assert_eq!(
        second.admitted, 1,
        "the interactive job is admitted at once, ahead of the backlog"
    );
    let (_, j) = app
        .get(GLOBEX, &format!("/v1/jobs/{}", accepted["id"].as_str().unwrap()))
        .await;
    assert_eq!(j["state"], "admitted");
    // A backlog job explains why it waits.
    let waiting: Value = sqlx::query_scalar(
        "SELECT admission FROM jobs WHERE state = 'queued' AND admission->>'reason' = 'waiting_for_capacity' LIMIT 1",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(waiting["reason"], "waiting_for_capacity");
    assert_eq!(waiting["bucket"], "provider:oai:gpt-4o-mini:rpm");
    assert_eq!(waiting["limit"], 100.0);
    assert!(waiting["expected_at"].as_str().is_some());
    app.shutdown().await;
}

#[tokio::test]
async fn a_budget_fails_a_job_only_for_what_is_spent_not_for_what_is_held() {
    // At 1000 USD per million tokens, a job reserves its input and 20 output tokens (about
    // 0.028 USD) and spends what the mock writes (fewer). A budget of 0.05 USD holds one
    // reservation at a time, but more than one job's spend: the jobs after the first wait
    // for its settlement rather than fail, and only a job the spent budget cannot hold
    // fails. The jobs are all queued before a gate starts, so one round meets them all: the
    // first one's reservation is this round's, not yet written, and still counts as held.
    let mut mock = mock_config();
    mock.projects[0].rpm = 1000;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config:
            "[providers.prices.\"gpt-4o-mini\"]\ninput_per_mtok = 1000.0\noutput_per_mtok = 1000.0\n\
                       [[tenants]]\nname = \"frugal\"\napi_key = \"tk-frugal\"\ndaily_spend_usd = 0.05\n"
                .into(),
        roles: Roles::API_ONLY,
        peers: 1,
        ..TestOptions::default()
    })
    .await;
    // Due before the budget's reset at midnight UTC, so waiting for the reset cannot help.
    let now = Utc::now();
    let midnight = (now + ChronoDuration::days(1))
        .date_naive()
        .and_hms_opt(0, 0, 0)
        .unwrap()
        .and_utc();
    let deadline = (now + ChronoDuration::minutes(10)).min(midnight - ChronoDuration::seconds(1));
    let mut ids = Vec::new();
    for i in 0..6 {
        let mut body = job("oai/gpt-4o-mini", &format!("q{i}"));
        body["request"]["max_tokens"] = json!(20);
        body["deadline"] = json!(deadline);
        // More than the budget holds, all accepted: the gate is what fails them.
        body["on_deadline_risk"] = json!("accept");
        let (status, j) = app.submit("tk-frugal", &body).await;
        assert_eq!(status, 202, "{j}");
        ids.push(j["id"].as_str().unwrap().to_owned());
    }
    let worker = app.spawn_peer(Roles::ALL).await;
    let mut done = Vec::new();
    for id in &ids {
        done.push(app.wait_job("tk-frugal", id, 60).await);
    }
    let succeeded: Vec<&Value> = done.iter().filter(|j| j["state"] == "succeeded").collect();
    let failed: Vec<&Value> = done.iter().filter(|j| j["state"] == "failed").collect();
    assert_eq!(succeeded.len() + failed.len(), 6, "{done:?}");
    assert!(
        succeeded.len() >= 2,
        "the jobs behind the first waited for its settlement: {done:?}"
    );
    let spent: f64 = succeeded
        .iter()
        .map(|j| j["cost"]["charged_usd"].as_f64().unwrap())
        .sum();
    assert!(spent <= 0.05 + 1e-9, "the budget held: {spent}");
    let reserve = (succeeded[0]["estimate"]["input_tokens"].as_f64().unwrap() + 20.0) * 1000.0 / 1e6;
    for f in &failed {
        assert_eq!(f["error"]["code"], "deadline_unmeetable", "{f}");
        assert!(
            0.05 - spent < reserve,
            "a job failed only when what was spent left no room for it: {spent} spent, {reserve} needed"
        );
    }
    // A job the whole budget could never hold fails at once, its message in dollars.
    let mut body = job("oai/gpt-4o-mini", "too big");
    body["request"]["max_tokens"] = json!(100);
    let (status, submitted) = app.submit("tk-frugal", &body).await;
    assert_eq!(status, 202, "{submitted}");
    let done = app
        .wait_job("tk-frugal", submitted["id"].as_str().unwrap(), 30)
        .await;
    assert_eq!(done["error"]["code"], "exceeds_limit", "{done}");
    let message = done["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("tenant:frugal:daily_spend") && message.ends_with("its whole capacity is $0.050000"),
        "{message}"
    );
    worker.shutdown().await;
    app.shutdown().await;
}

#[tokio::test]
async fn a_budget_blocks_a_tenant_without_touching_provider_buckets_and_resets_daily() {
    let mut mock = mock_config();
    mock.projects[0].rpm = 1000;
    // 28 tokens per job (8 in, 20 out) at 1000 USD per million tokens: 0.028 USD a job;
    // a budget of 0.07 USD holds two.
    let app = TestApp::spawn_with(TestOptions {
        mock,
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 1000\n\
                       [providers.prices.\"gpt-4o-mini\"]\ninput_per_mtok = 1000.0\noutput_per_mtok = 1000.0\n\
                       [[tenants]]\nname = \"frugal\"\napi_key = \"tk-frugal\"\ndaily_spend_usd = 0.07\n"
            .into(),
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let mut body = job("oai/gpt-4o-mini", &format!("q{i}"));
        body["request"]["max_tokens"] = json!(20);
        body["class"] = json!("batch");
        let (status, j) = app.submit("tk-frugal", &body).await;
        assert_eq!(status, 202, "{j}");
        ids.push(j["id"].as_str().unwrap().to_owned());
    }
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default());
    // Pin the clock to late evening UTC so the daily reset is an hour away.
    let evening = Utc.with_ymd_and_hms(2031, 3, 4, 23, 0, 0).unwrap();
    sqlx::query("UPDATE jobs SET created_at = $1, not_before = $1, deadline = $1 + interval '3 hours'")
        .bind(evening)
        .execute(&app.db.pool)
        .await
        .unwrap();
    let round = gate.run_once(evening).await.unwrap();
    assert_eq!(round.admitted, 2);
    let rpm = bucket(&app, "provider:oai:gpt-4o-mini:rpm").await;
    assert!(
        (rpm.level - 998.0).abs() < 1.0,
        "only the two admitted jobs took from the provider: {}",
        rpm.level
    );
    let (_, blocked) = app.get("tk-frugal", &format!("/v1/jobs/{}", ids[2])).await;
    assert_eq!(blocked["state"], "queued");
    assert_eq!(blocked["admission"]["bucket"], "tenant:frugal:daily_spend");
    assert_eq!(blocked["admission"]["expected_at"], "2031-03-05T00:00:00Z");
    // Another tenant is not held back by frugal's budget.
    let (_, other) = app.submit(ACME, &job("oai/gpt-4o-mini", "unaffected")).await;
    sqlx::query("UPDATE jobs SET created_at = $1, not_before = $1, deadline = $1 + interval '3 hours' WHERE id = $2::uuid")
        .bind(evening)
        .bind(other["id"].as_str().unwrap())
        .execute(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(
        gate.run_once(evening + ChronoDuration::minutes(1))
            .await
            .unwrap()
            .admitted,
        1
    );
    // After midnight UTC the budget is back and the job goes.
    let round = gate
        .run_once(evening + ChronoDuration::minutes(61))
        .await
        .unwrap();
    assert_eq!(round.admitted, 1);
    let spend = bucket(&app, "tenant:frugal:daily_spend").await;
    assert!(spend.level < spend.capacity && spend.level > 0.0);
    assert_eq!(
        spend.resets_at,
        Some(Utc.with_ymd_and_hms(2031, 3, 6, 0, 0, 0).unwrap())
    );

    // A job whose deadline falls before the next reset fails now, with the reason.
    let mut body = job("oai/gpt-4o-mini", "too late anyway");
    body["request"]["max_tokens"] = json!(20);
    let mut blocked_ids = Vec::new();
    for _ in 0..3 {
        let (_, j) = app.submit("tk-frugal", &body).await;
        blocked_ids.push(j["id"].as_str().unwrap().to_owned());
    }
    let noon = Utc.with_ymd_and_hms(2031, 3, 5, 12, 0, 0).unwrap();
    sqlx::query("UPDATE jobs SET created_at = $1, not_before = $1, deadline = $1 + interval '1 hour' WHERE state = 'queued'")
        .bind(noon)
        .execute(&app.db.pool)
        .await
        .unwrap();
    // While the admitted jobs hold their reservations, what they do not spend may come
    // back: the job waits for their settlement.
    let round = gate.run_once(noon).await.unwrap();
    assert_eq!(round.failed, 0, "{round:?}");
    let (_, waiting) = app
        .get("tk-frugal", &format!("/v1/jobs/{}", blocked_ids[2]))
        .await;
    assert_eq!(
        (waiting["state"].as_str(), waiting["admission"]["reason"].as_str()),
        (Some("queued"), Some("waiting_for_settlement")),
        "{waiting}"
    );
    // They settle having spent all they held: the budget is spent for the day.
    sqlx::query(
        "UPDATE jobs SET state = 'succeeded', finished_at = $1, reserved_buckets = NULL, reserved_amounts = NULL
         WHERE state = 'admitted'",
    )
    .bind(noon)
    .execute(&app.db.pool)
    .await
    .unwrap();
    let round = gate.run_once(noon + ChronoDuration::seconds(1)).await.unwrap();
    assert!(round.failed >= 1, "{round:?}");
    let (_, failed) = app
        .get("tk-frugal", &format!("/v1/jobs/{}", blocked_ids[2]))
        .await;
    assert_eq!(failed["state"], "failed");
    assert_eq!(failed["error"]["code"], "deadline_unmeetable");
    assert!(
        failed["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tenant:frugal:daily_spend")
    );
    app.shutdown().await;
}

#[tokio::test]
async fn a_job_larger_than_a_limit_fails_at_once() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\ntpm = 1000\n".into(),
        ..TestOptions::default()
    })
    .await;
    let mut body = job("oai/gpt-4o-mini", "hi");
    body["request"]["max_tokens"] = json!(5000);
    let (_, j) = app.submit(ACME, &body).await;
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default());
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().failed, 1);
    let (_, j) = app
        .get(ACME, &format!("/v1/jobs/{}", j["id"].as_str().unwrap()))
        .await;
    assert_eq!(j["error"]["code"], "exceeds_limit");
    assert_eq!(bucket(&app, "provider:oai:gpt-4o-mini:tpm").await.level, 1000.0);
    app.shutdown().await;
}

#[tokio::test]
async fn reservations_come_back_after_a_drain() {
    let app = TestApp::spawn_with(TestOptions {
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 3\ntpm = 1000000\n\
                       [[tenants]]\nname = \"capped\"\napi_key = \"tk-capped\"\nconcurrency = 2\ntpm = 500000\n"
            .into(),
        ..TestOptions::default()
    })
    .await;
    let apis = vec![app.api.clone()];
    assert_eq!(
        flood(&app, &apis, "tk-capped", 40, |i| job("fast", &format!("c{i}"))).await,
        40
    );
    wait_all_finished(&app, 40, 60).await;
    assert_eq!(app.mock.stats().succeeded, 40);
    assert!(
        app.mock.stats().max_in_flight <= 2,
        "the tenant's concurrency of 2 was exceeded"
    );
    assert_eq!(reservations_held(&app).await, 0);
    bucket_settles_at(&app, "provider:oai:gpt-4o-mini:concurrency", 3.0).await;
    bucket_settles_at(&app, "tenant:capped:concurrency", 2.0).await;
    // Token buckets hold the actual use, not the estimate: after the refill time they are full.
    let mut tpm = bucket(&app, "tenant:capped:tpm").await;
    let used = tpm.capacity - tpm.level;
    let actual: i64 = sqlx::query_scalar(
        "SELECT sum(input_tokens + output_tokens)::bigint FROM job_attempts WHERE outcome = 'succeeded'",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert!(
        used <= actual as f64 + 1.0,
        "estimates were not replaced by actuals: used {used}, actual {actual}"
    );
    tpm.refill(Utc::now() + ChronoDuration::seconds(61));
    assert_eq!(tpm.level, tpm.capacity);

    app.shutdown().await;
}

#[tokio::test]
async fn a_dead_holders_reservation_comes_back_when_its_lease_expires() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 3\n\
                       [[tenants]]\nname = \"capped\"\napi_key = \"tk-capped\"\nconcurrency = 2\n"
            .into(),
        ..TestOptions::default()
    })
    .await;
    let pool = &app.db.pool;
    for i in 0..3 {
        app.submit("tk-capped", &job("fast", &format!("ghost {i}"))).await;
    }
    let gate = Gate::new(pool.clone(), app.config.clone(), Notifications::default());
    let round = gate.run_once(Utc::now()).await.unwrap();
    assert_eq!(round.admitted, 2, "the tenant's concurrency of 2 admits two");
    assert_eq!(bucket(&app, "tenant:capped:concurrency").await.level, 0.0);
    assert_eq!(
        bucket(&app, "provider:oai:gpt-4o-mini:concurrency").await.level,
        1.0
    );
    // A dispatcher claims them and dies without a word.
    let claimed = store::claim_jobs(pool, "ghost", 10, Utc::now(), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2);
    let maintenance = tollgate_workers::maintenance::Maintenance::new(pool.clone(), Duration::from_secs(1));
    assert_eq!(
        maintenance.run_once(Utc::now()).await.unwrap().rescued.requeued,
        0
    );
    // The leases run out, by the database's time.
    sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE lease_owner = 'ghost'")
        .execute(pool)
        .await
        .unwrap();
    let pass = maintenance.run_once(Utc::now()).await.unwrap();
    assert_eq!(pass.rescued.requeued, 2);
    // The gate applies the settlements at the start of its next round: without them the
    // tenant's concurrency would be 0 and nothing could be admitted.
    let round = gate.run_once(Utc::now()).await.unwrap();
    assert_eq!(round.admitted, 2);
    assert_eq!(bucket(&app, "tenant:capped:concurrency").await.level, 0.0);
    assert_eq!(
        bucket(&app, "provider:oai:gpt-4o-mini:concurrency").await.level,
        1.0
    );
    // Jobs cancelled while admitted (or queued) give everything back.
    let waiting: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM jobs WHERE state IN ('queued', 'admitted')")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(waiting.len(), 3);
    for id in &waiting {
        let (status, _) = app
            .post("tk-capped", &format!("/v1/jobs/{id}/cancel"), &json!({}))
            .await;
        assert_eq!(status, 200);
    }
    gate.run_once(Utc::now()).await.unwrap();
    assert_eq!(bucket(&app, "tenant:capped:concurrency").await.level, 2.0);
    assert_eq!(
        bucket(&app, "provider:oai:gpt-4o-mini:concurrency").await.level,
        3.0
    );
    assert_eq!(reservations_held(&app).await, 0);
    app.shutdown().await;
}

/// Submits a job of acme's for `oai/gpt-4o-mini` with each text; their ids, in order.
async fn submit_all(app: &TestApp, texts: &[&str]) -> Vec<String> {
    let mut ids = Vec::new();
    for text in texts {
        let (status, accepted) = app.submit(ACME, &job("oai/gpt-4o-mini", text)).await;
        assert_eq!(status, 202, "{accepted}");
        ids.push(accepted["id"].as_str().unwrap().to_owned());
    }
    ids
}

/// Sets what each job's `SET` clause says: how a job a test claimed by hand was sent.
async fn mark(pool: &sqlx::PgPool, jobs: &[(&String, &str)]) {
    for (id, set) in jobs {
        sqlx::query(&format!("UPDATE jobs SET {set} WHERE id = $1::uuid"))
            .bind(id.as_str())
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Jobs whose clients waited for them on a connection to a holder that died are not sent
/// again: a stream (it runs only in the process holding its client's connection — queued,
/// it would be admitted and hold capacity until its deadline with no one to claim it) and
/// a synchronous call its caller's own process held. They fail `client_disconnected` and
/// give their reservations back. Beside them, the dead holder's plain job and the
/// synchronous call of a caller connected elsewhere are queued again as usual.
#[tokio::test]
async fn jobs_whose_clients_waited_on_a_holder_that_died_fail_and_give_their_capacity_back() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 4\n".into(),
        ..TestOptions::default()
    })
    .await;
    let pool = &app.db.pool;
    let ids = submit_all(
        &app,
        &["streamed", "called here", "called elsewhere", "fetched later"],
    )
    .await;
    let gate = Gate::new(pool.clone(), app.config.clone(), Notifications::default());
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 4);
    // A process claims all four — a stream it relays, a synchronous call of its own client,
    // one of a client connected to another process, a job fetched later — and dies.
    let claimed = store::claim_jobs(pool, "ghost", 10, Utc::now(), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 4);
    mark(
        pool,
        &[
            (&ids[0], "stream = true"),
            (&ids[1], "caller_process = 'ghost'"),
            (&ids[2], "caller_process = 'alive'"),
        ],
    )
    .await;
    assert_eq!(
        bucket(&app, "provider:oai:gpt-4o-mini:concurrency").await.level,
        0.0
    );
    sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE lease_owner = 'ghost'")
        .execute(pool)
        .await
        .unwrap();
    let maintenance = tollgate_workers::maintenance::Maintenance::new(pool.clone(), Duration::from_secs(1));
    let rescued = maintenance.run_once(Utc::now()).await.unwrap().rescued;
    assert_eq!((rescued.failed, rescued.requeued), (2, 2));
    for id in &ids[..2] {
        let failed = app.wait_job(ACME, id, 10).await;
        assert_eq!(
            (&failed["state"], &failed["error"]["code"]),
            (&json!("failed"), &json!("client_disconnected")),
            "{failed}"
        );
    }
    for id in &ids[2..] {
        let (_, queued) = app.get(ACME, &format!("/v1/jobs/{id}")).await;
        assert_eq!(queued["state"], "queued", "{queued}");
    }
    // The next round applies the four settlements and admits the two queued again: two
    // of the four call slots held, the failed jobs' given back.
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 2);
    assert_eq!(
        bucket(&app, "provider:oai:gpt-4o-mini:concurrency").await.level,
        2.0
    );
    // A process stopping releases what it still holds after its drain: its stream fails,
    // but its own caller's call goes back to the queue — that caller may still be
    // connected while the process stops, and another process's run can answer it.
    let leaving = submit_all(&app, &["streamed while stopping", "called while stopping"]).await;
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 2);
    let claimed = store::claim_jobs(pool, "leaving", 10, Utc::now(), Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 4);
    mark(
        pool,
        &[
            (&leaving[0], "stream = true"),
            (&leaving[1], "caller_process = 'leaving'"),
        ],
    )
    .await;
    let requeued = store::release_leases(pool, "leaving", Utc::now()).await.unwrap();
    assert_eq!(requeued, 3);
    let stream = app.wait_job(ACME, &leaving[0], 10).await;
    assert_eq!(stream["error"]["code"], "client_disconnected", "{stream}");
    let (_, call) = app.get(ACME, &format!("/v1/jobs/{}", leaving[1])).await;
    assert_eq!(call["state"], "queued", "{call}");
    app.shutdown().await;
}

/// The ids of the jobs in `state`, in id order.
async fn ids_in(pool: &sqlx::PgPool, state: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT id::text FROM jobs WHERE state::text = $1 ORDER BY id")
        .bind(state)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Synchronous calls still waiting — queued, or admitted and not yet claimed — when the
/// process their callers are connected to dies are not run later for nobody: once that
/// process's beat has expired, the rescue fails them `client_disconnected`, an admitted
/// one's reservation given back. Calls whose callers wait on a live process, or on one
/// that never beat, wait on.
#[tokio::test]
async fn calls_waiting_for_callers_of_a_process_that_died_fail_and_give_their_capacity_back() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 2\n".into(),
        ..TestOptions::default()
    })
    .await;
    let pool = &app.db.pool;
    eventually(10, "the broker's own beat", || async {
        let alive: i64 = sqlx::query_scalar("SELECT count(*) FROM processes WHERE expires_at > now()")
            .fetch_one(pool)
            .await
            .unwrap();
        (alive == 1).then_some(())
    })
    .await;
    submit_all(&app, &["one", "two", "three", "four"]).await;
    let gate = Gate::new(pool.clone(), app.config.clone(), Notifications::default());
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 2);
    let (admitted, queued) = (ids_in(pool, "admitted").await, ids_in(pool, "queued").await);
    assert_eq!((admitted.len(), queued.len()), (2, 2));
    sqlx::query(
        "INSERT INTO processes (owner, expires_at)
         VALUES ('ghost', now() - interval '1 second'), ('alive', now() + interval '30 seconds')",
    )
    .execute(pool)
    .await
    .unwrap();
    mark(
        pool,
        &[
            (&admitted[0], "caller_process = 'ghost'"),
            (&admitted[1], "caller_process = 'alive'"),
            (&queued[0], "caller_process = 'ghost'"),
            (&queued[1], "caller_process = 'never beat'"),
        ],
    )
    .await;
    let maintenance = tollgate_workers::maintenance::Maintenance::new(pool.clone(), Duration::from_secs(1));
    let rescued = maintenance.run_once(Utc::now()).await.unwrap().rescued;
    assert_eq!(rescued.callers_gone, 2, "{rescued:?}");
    for id in [&admitted[0], &queued[0]] {
        let failed = app.wait_job(ACME, id, 10).await;
        assert_eq!(
            (&failed["state"], &failed["error"]["code"]),
            (&json!("failed"), &json!("client_disconnected")),
            "{failed}"
        );
    }
    for (id, state) in [(&admitted[1], "admitted"), (&queued[1], "queued")] {
        let (_, waiting) = app.get(ACME, &format!("/v1/jobs/{id}")).await;
        assert_eq!(waiting["state"], state, "{waiting}");
    }
    // The failed admitted call's slot comes back: the next round admits the one queued,
    // and both slots are held again (the live caller's call, and that one).
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 1);
    assert_eq!(
        bucket(&app, "provider:oai:gpt-4o-mini:concurrency").await.level,
        0.0
    );
    app.shutdown().await;
}

/// Submits `n` interactive jobs from globex, one every 50 ms, and returns their queue
/// waits (enqueue → admitted) in milliseconds, sorted.
async fn interactive_waits(app: &TestApp, n: usize) -> Vec<f64> {
    let mut ids = Vec::new();
    for i in 0..n {
        let mut body = job("oai/gpt-4o-mini", &format!("urgent {i}"));
        body["class"] = json!("interactive");
        let (status, j) = app.submit(GLOBEX, &body).await;
        assert_eq!(status, 202);
        ids.push(j["id"].as_str().unwrap().to_owned());
        tokio::time::sleep(Duration::from_millis(50)).await; // pacing the probe, not synchronising
    }
    let mut waits = Vec::new();
    for id in &ids {
        let j = app.wait_job(GLOBEX, id, 30).await;
        assert_eq!(j["state"], "succeeded", "{j}");
        let created: DateTime<Utc> = j["created_at"].as_str().unwrap().parse().unwrap();
        let admitted: DateTime<Utc> = j["admitted_at"].as_str().unwrap().parse().unwrap();
        waits.push((admitted - created).num_microseconds().unwrap() as f64 / 1000.0);
    }
    waits.sort_by(f64::total_cmp);
    waits
}

#[tokio::test]
async fn an_interactive_tenant_barely_notices_a_flood() {
    let mut mock = mock_config();
    mock.projects[0].rpm = 600;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 600\n".into(),
        ..TestOptions::default()
    })
    .await;
    let alone = interactive_waits(&app, 20).await;
    // The flood: more standard work than the provider allows in the next minutes.
    sqlx::query(
        "INSERT INTO jobs (id, tenant, class, priority, state, request, model, deadline, not_before, max_attempts,
                           estimated_input_tokens, estimated_output_tokens, created_at)
         SELECT gen_random_uuid(), 'acme', 'standard', 0, 'queued',
                jsonb_build_object('model', 'oai/gpt-4o-mini', 'max_tokens', 8, 'messages',
                    jsonb_build_array(jsonb_build_object('role', 'user', 'content', 'flood ' || i))),
                'oai/gpt-4o-mini', now() + interval '1 hour', now(), 4, 12, 8, now()
         FROM generate_series(1, 3000) AS i",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();
    sqlx::query("SELECT pg_notify('tollgate_gate', '')")
        .execute(&app.db.pool)
        .await
        .unwrap();
    // Wait until the flood has the provider's bucket to itself and jobs wait for capacity.
    eventually(30, "the flood to saturate the provider", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE state = 'queued' AND admission->>'reason' = 'waiting_for_capacity'",
        )
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        (waiting > 0).then_some(())
    })
    .await;
    let flooded = interactive_waits(&app, 20).await;
    let still_queued: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'queued' AND tenant = 'acme'")
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert!(
        still_queued > 1000,
        "the flood must still be waiting: {still_queued}"
    );
    eprintln!("interactive waits ms: alone {alone:.1?}, during the flood {flooded:.1?}");
    // The property, independent of how busy the machine is: how many flood jobs got in
    // ahead of a probe while it waited. A FIFO queue would put each probe behind the 1,000+
    // flood jobs queued before it; the gate admits it in the next round, so only what the
    // provider's refill (10 requests/s) let through in that time gets ahead — a handful on
    // a quiet machine; 100 would take ten seconds of waiting.
    let ahead: i64 = sqlx::query_scalar(
        "SELECT COALESCE(max(n), 0) FROM (
             SELECT (SELECT count(*) FROM jobs f
                     WHERE f.tenant = 'acme' AND f.admitted_at > p.created_at AND f.admitted_at < p.admitted_at) AS n
             FROM jobs p WHERE p.tenant = 'globex' AND p.class = 'interactive'
               AND p.created_at > (SELECT min(created_at) FROM jobs WHERE tenant = 'acme')) t",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert!(
        ahead <= 100,
        "{ahead} flood jobs were admitted ahead of an interactive probe (waits {flooded:.1?} ms)"
    );
    app.assert_no_provider_429s().await;
    app.shutdown().await;
}

#[tokio::test]
async fn keys_with_their_own_limits_are_chosen_at_admission_and_held_to_them() {
    let mut mock = mock_config();
    mock.projects[0].keys.push("sk-test-2".into());
    let app = TestApp::spawn_with(TestOptions {
        mock,
        roles: Roles::API_ONLY,
        extra_config: r#"
[[providers]]
name = "multi"
kind = "openai"
base_url = "http://MOCK_ADDR/v1"
models = ["gpt-4o-mini"]
learn_limits = false
keys = [{ name = "a", value = "sk-test-1", limits = { rpm = 30 } },
        { name = "b", value = "sk-test-2", limits = { rpm = 30 } }]
"#
        .into(),
        ..TestOptions::default()
    })
    .await;
    let config = app.config.clone();
    for i in 0..100 {
        let (status, j) = app
            .submit(ACME, &job("multi/gpt-4o-mini", &format!("k{i}")))
            .await;
        assert_eq!(status, 202, "{j}");
    }
    let gate = Gate::new(app.db.pool.clone(), config.clone(), Notifications::default());
    let round = gate.run_once(Utc::now()).await.unwrap();
    // Each key holds 30 a minute, less the interactive reserve and transit headroom.
    assert!((50..=60).contains(&round.admitted), "admitted {}", round.admitted);
    let per_key: HashMap<String, i64> = sqlx::query_as::<_, (String, i64)>(
        "SELECT provider_key, count(*) FROM jobs WHERE state = 'admitted' GROUP BY provider_key",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(per_key.len(), 2, "{per_key:?}");
    assert!(per_key.values().all(|n| *n <= 30 && *n >= 20), "{per_key:?}");
    for key in ["key:multi:a:rpm", "key:multi:b:rpm"] {
        let b = bucket(&app, key).await;
        assert!(b.level >= 0.0 && b.level < 3.0, "{key}: {}", b.level);
    }
    // Dispatch sends each job with the key it was admitted for.
    let providers = tollgate_workers::providers::Providers::from_config(&config).unwrap();
    let dispatcher = tollgate_workers::dispatcher::Dispatcher::new(
        app.db.pool.clone(),
        config.clone(),
        providers,
        Notifications::default(),
    );
    let step = dispatcher.run_once().await.unwrap();
    assert!(step.claimed > 0);
    let mismatched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM job_attempts a JOIN jobs j ON j.id = a.job_id WHERE a.key_name <> j.provider_key",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(mismatched, 0);
    app.shutdown().await;
}

#[tokio::test]
async fn a_ramp_limit_lets_the_rate_grow_only_step_by_step() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nramp_rpm = 10\n".into(),
        gate_config: "interactive_reserve = 0.0".into(),
        ..TestOptions::default()
    })
    .await;
    for i in 0..60 {
        app.submit(ACME, &job("oai/gpt-4o-mini", &format!("r{i}"))).await;
    }
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default());
    let t0 = Utc::now();
    let rounds: Vec<usize> = {
        let mut admitted = Vec::new();
        for minute in 0..3 {
            admitted.push(
                gate.run_once(t0 + ChronoDuration::seconds(61 * minute))
                    .await
                    .unwrap()
                    .admitted,
            );
        }
        admitted
    };
    // 10 in the first minute, then what the last minute used plus 10.
    assert_eq!(rounds, vec![10, 20, 30], "admitted per minute");
    app.shutdown().await;
}

#[tokio::test]
async fn estimates_are_calibrated_from_reconciled_usage_within_bounds() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        // This provider does not charge max_tokens up front: reserve what the model produces.
        extra_config: "charges_max_tokens = false\n[providers.limits.\"gpt-4o-mini\"]\ntpm = 1000000\n"
            .into(),
        ..TestOptions::default()
    })
    .await;
    let pool = &app.db.pool;
    for i in 0..25 {
        app.submit(ACME, &job("oai/gpt-4o-mini", &format!("sample {i}")))
            .await;
    }
    let gate = Gate::new(pool.clone(), app.config.clone(), Notifications::default());
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 25);
    let providers = tollgate_workers::providers::Providers::from_config(&app.config).unwrap();
    let dispatcher = tollgate_workers::dispatcher::Dispatcher::new(
        pool.clone(),
        app.config.clone(),
        providers,
        Notifications::default(),
    );
    while dispatcher.run_once().await.unwrap().claimed > 0 {}
    // Pretend the provider counted twice the estimated input.
    sqlx::query("UPDATE job_attempts SET input_tokens = estimated_input_tokens * 2")
        .execute(pool)
        .await
        .unwrap();
    let maintenance = tollgate_workers::maintenance::Maintenance::new(pool.clone(), Duration::from_secs(1));
    assert_eq!(maintenance.run_once(Utc::now()).await.unwrap().calibrated, 1);
    let learned = store::calibrations(pool).await.unwrap();
    assert_eq!(learned.len(), 1);
    // One pass moves the ratio by at most 0.1, however far off the batch was.
    assert!((learned[0].input_ratio - 1.1).abs() < 1e-9, "{learned:?}");
    assert_eq!(learned[0].output_p90, Some(12.0));
    assert_eq!(learned[0].samples, 25);
    // A new job reserves the calibrated input and the learned output, not its max_tokens.
    let (_, j) = app.submit(ACME, &job("oai/gpt-4o-mini", "calibrated")).await;
    let fresh_gate = Gate::new(pool.clone(), app.config.clone(), Notifications::default());
    assert_eq!(fresh_gate.run_once(Utc::now()).await.unwrap().admitted, 1);
    let (input, amounts): (i32, Vec<f64>) =
        sqlx::query_as("SELECT estimated_input_tokens, reserved_amounts FROM jobs WHERE id = $1::uuid")
            .bind(j["id"].as_str().unwrap())
            .fetch_one(pool)
            .await
            .unwrap();
    let expected = (f64::from(input) * 1.1).ceil() + (12.0 * 1.25_f64).ceil();
    assert_eq!(
        amounts,
        vec![expected],
        "tpm reservation: input {input} x 1.1 + learned output 15"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn a_route_has_a_share_of_its_own() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[routes.limits]\nrpm = 5\n".into(),
        ..TestOptions::default()
    })
    .await;
    for i in 0..10 {
        app.submit(ACME, &job("fast", &format!("via the route {i}")))
            .await;
        app.submit(ACME, &job("oai/gpt-4o-mini", &format!("direct {i}")))
            .await;
    }
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default());
    gate.run_once(Utc::now()).await.unwrap();
    let admitted: HashMap<String, i64> = sqlx::query_as::<_, (String, i64)>(
        "SELECT model, count(*) FROM jobs WHERE state = 'admitted' GROUP BY model",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    // The route's 5 a minute hold its jobs; the same model asked for directly is not held.
    assert_eq!(admitted.get("fast"), Some(&5));
    assert_eq!(admitted.get("oai/gpt-4o-mini"), Some(&10));
    app.shutdown().await;
}

#[tokio::test]
async fn classes_have_their_contracts() {
    let mut mock = mock_config();
    mock.projects[0].rpm = 3;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 3\n\
                       [classes.background]\ndefault_deadline_secs = 3600\nmax_queued_per_tenant = 3\nstarve_after_secs = 60\n"
            .into(),
        gate_config: "interactive_reserve = 0.0".into(),
        ..TestOptions::default()
    })
    .await;
    let with_class = |class: &str, text: &str| {
        let mut b = job("oai/gpt-4o-mini", text);
        b["class"] = json!(class);
        b
    };
    // A full class queue is refused at submit, with Retry-After and the reason.
    for i in 0..3 {
        assert_eq!(
            app.submit(ACME, &with_class("background", &format!("bg {i}")))
                .await
                .0,
            202
        );
    }
    let r = app
        .http
        .post(app.url("/v1/jobs"))
        .bearer_auth(ACME)
        .json(&with_class("background", "one too many"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert!(r.headers().get("retry-after").is_some());
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "queue_full");
    // Other tenants and classes are not affected by acme's full background queue.
    assert_eq!(
        app.submit(GLOBEX, &with_class("background", "globex bg")).await.0,
        202
    );
    // Higher classes go first: with room for two (three a minute, less the headroom for
    // requests in transit), the standard jobs submitted last win...
    let (_, s1) = app.submit(ACME, &with_class("standard", "std 1")).await;
    let (_, s2) = app.submit(ACME, &with_class("standard", "std 2")).await;
    // ...unless a lower-class job has waited past its class's starvation guard.
    let oldest_bg: String = sqlx::query_scalar(
        "UPDATE jobs SET created_at = now() - interval '2 minutes'
         WHERE id = (SELECT id FROM jobs WHERE tenant = 'globex' AND class = 'background' LIMIT 1) RETURNING id::text",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default());
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 2);
    let admitted: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM jobs WHERE state = 'admitted' ORDER BY id")
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
    assert!(
        admitted.contains(&oldest_bg),
        "the starved background job is admitted: {admitted:?}"
    );
    let standard: Vec<&str> = [&s1, &s2].iter().map(|j| j["id"].as_str().unwrap()).collect();
    assert_eq!(
        admitted.iter().filter(|a| standard.contains(&a.as_str())).count(),
        1
    );
    app.shutdown().await;
}

/// A job past its class's starvation guard competes as interactive wherever it stands in
/// its tenant's queue — also behind more of its tenant's jobs due sooner than a round reads
/// of the queue's head (after a round that admitted two, 64 jobs): a round reads each
/// queue's jobs past their guard beside its head.
#[tokio::test]
async fn a_job_past_its_guard_goes_first_however_many_due_sooner_stand_ahead_of_it() {
    let mut mock = mock_config();
    mock.projects[0].rpm = 3;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 3\n".into(),
        gate_config: "interactive_reserve = 0.0".into(),
        ..TestOptions::default()
    })
    .await;
    // A job without a deadline of its own (due in an hour), then 100 of its tenant's jobs
    // due in 50 minutes, ahead of it in the tenant's order.
    let (status, old) = app.submit(ACME, &job("oai/gpt-4o-mini", "old")).await;
    assert_eq!(status, 202, "{old}");
    let old = old["id"].as_str().unwrap().to_owned();
    let due = Utc::now() + ChronoDuration::minutes(50);
    let sooner: Vec<Value> = (0..100)
        .map(|i| {
            let mut j = job("oai/gpt-4o-mini", &format!("due sooner {i}"));
            j["deadline"] = json!(due);
            j
        })
        .collect();
    let r = app
        .http
        .post(app.url("/v1/jobs/bulk"))
        .bearer_auth(ACME)
        .json(&json!({ "jobs": sooner }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let admitted = || async {
        sqlx::query_scalar::<_, String>("SELECT id::text FROM jobs WHERE state = 'admitted'")
            .fetch_all(&app.db.pool)
            .await
            .unwrap()
    };
    // Now the jobs due sooner go first, as many as the bucket holds.
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default());
    let now = Utc::now();
    assert_eq!(gate.run_once(now).await.unwrap().admitted, 2);
    assert!(!admitted().await.contains(&old));
    // The first job has waited two minutes by the next round, 40 s on (past the standard
    // class's 60 s guard; the others are not): it goes first, however many stand ahead of
    // it in its tenant's order.
    sqlx::query("UPDATE jobs SET created_at = created_at - interval '2 minutes' WHERE id = $1::uuid")
        .bind(&old)
        .execute(&app.db.pool)
        .await
        .unwrap();
    assert!(
        gate.run_once(now + ChronoDuration::seconds(40))
            .await
            .unwrap()
            .admitted
            >= 1
    );
    assert!(
        admitted().await.contains(&old),
        "the job past its guard is admitted"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn limits_are_visible_to_tenants_but_not_each_others_budgets() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 600\n\
                       [[tenants]]\nname = \"frugal\"\napi_key = \"tk-frugal\"\ndaily_spend_usd = 5.0\n"
            .into(),
        ..TestOptions::default()
    })
    .await;
    let names = |body: &Value| -> Vec<String> {
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["bucket"].as_str().unwrap().to_owned())
            .collect()
    };
    let (status, frugal) = app.get("tk-frugal", "/v1/limits").await;
    assert_eq!(status, 200);
    let frugal = names(&frugal);
    assert!(
        frugal.contains(&"provider:oai:gpt-4o-mini:rpm".to_owned()),
        "{frugal:?}"
    );
    assert!(
        frugal.contains(&"tenant:frugal:daily_spend".to_owned()),
        "{frugal:?}"
    );
    let (_, acme) = app.get(ACME, "/v1/limits").await;
    let rpm = acme["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["bucket"] == "provider:oai:gpt-4o-mini:rpm")
        .unwrap();
    assert_eq!(
        (rpm["capacity"].as_f64(), rpm["remaining"].as_f64()),
        (Some(600.0), Some(600.0))
    );
    assert!(
        !names(&acme).iter().any(|n| n.starts_with("tenant:frugal")),
        "another tenant's budget leaked"
    );
    let (status, _) = app.get("tk-nobody", "/v1/limits").await;
    assert_eq!(status, 401);
    app.shutdown().await;
}

/// Work queued, retried or rescued by a process that is not the gate is announced on
/// `tollgate_gate`; the gate's process must hear it, not wait for its fallback poll.
#[tokio::test]
async fn a_notify_on_the_gate_channel_wakes_the_gate_of_another_process() {
    use std::time::Duration;
    let db = crate::harness::fresh_db_with(2).await;
    let hub = tollgate::notify::Notifications::default();
    let (tracker, cancel) = (
        tokio_util::task::TaskTracker::new(),
        tokio_util::sync::CancellationToken::new(),
    );
    hub.spawn_listener(db.pool.clone(), &tracker, cancel.clone());
    // Once connected, the listener wakes everyone to re-check: take that wake-up, and the
    // permit it may leave, first.
    tokio::time::timeout(Duration::from_secs(30), hub.gate_ready())
        .await
        .expect("the listener connects and wakes the gate once");
    let _ = tokio::time::timeout(Duration::ZERO, hub.gate_ready()).await;
    tollgate::store::notify_gate(&db.pool).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), hub.gate_ready())
        .await
        .expect("a NOTIFY on tollgate_gate woke the gate");
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
}

/// A gate that starts arrivals on a dispatcher of its own (not running: what it is handed
/// waits), for tests calling `admit_arrivals` directly. Keep the dispatcher alive.
fn arrivals_gate(app: &TestApp) -> (Gate, tollgate_workers::dispatcher::Dispatcher) {
    let providers = tollgate_workers::providers::Providers::from_config(&app.config).unwrap();
    let dispatcher = tollgate_workers::dispatcher::Dispatcher::new(
        app.db.pool.clone(),
        app.config.clone(),
        providers,
        Notifications::default(),
    );
    let gate = Gate::new(app.db.pool.clone(), app.config.clone(), Notifications::default())
        .with_handoff(dispatcher.handoff());
    (gate, dispatcher)
}

/// An interactive job for `oai/gpt-4o-mini` as it arrives, not yet inserted.
fn interactive_arrival(tenant: &str, content: &str, now: DateTime<Utc>) -> tollgate::model::NewJob {
    tollgate::model::NewJob {
        id: tollgate::model::JobId::new(),
        tenant: tenant.to_owned(),
        class: tollgate::vocab::JobClass::Interactive,
        priority: 0,
        endpoint: tollgate::vocab::Endpoint::ChatCompletions,
        request: json!({"model": "oai/gpt-4o-mini", "messages": [{"role": "user", "content": content}], "max_tokens": 5}),
        model: "oai/gpt-4o-mini".to_owned(),
        idempotency_key: None,
        metadata: None,
        deadline: now + ChronoDuration::seconds(60),
        max_attempts: 3,
        estimated_input_tokens: 10,
        estimated_output_tokens: 5,
        created_at: now,
        stream: false,
        api_key: None,
        traceparent: None,
        eta_p50: None,
        eta_p90: None,
        caller_process: None,
    }
}

/// An arrival's reads give their connections back before its transaction takes one, so
/// it is admitted on a pool of a single connection; when its transaction began beside its
/// reads, it held that connection and waited for the pool until the acquire timeout.
#[tokio::test]
async fn an_arrival_never_holds_a_connection_while_waiting_for_another() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let (gate, _dispatcher) = arrivals_gate(&app);
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with((*app.db.pool.connect_options()).clone())
        .await
        .unwrap();
    let now = Utc::now();
    let arriving = interactive_arrival("acme", "hi", now);
    let started = gate
        .admit_arrival(&one, &arriving)
        .await
        .expect("admitted without waiting for the pool");
    let started = started.expect("the buckets hold it and nothing else waits");
    assert_eq!(started.id, arriving.id);
    assert_eq!(started.state, tollgate::vocab::JobState::Running);
    app.shutdown().await;
}

/// Arrivals waiting together are admitted in one transaction, in the order given, each
/// only if the buckets still hold it after those before it: a tenant allowed three
/// requests a minute gets three of five started, the first three, and nothing is written
/// for the other two (they are queued as usual by their callers).
#[tokio::test]
async fn arrivals_admitted_together_start_only_what_the_buckets_hold() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[[tenants]]\nname = \"tiny\"\napi_key = \"tk-tiny\"\nrpm = 3\n".to_owned(),
        ..TestOptions::default()
    })
    .await;
    let (gate, _dispatcher) = arrivals_gate(&app);
    let now = Utc::now();
    let arriving: Vec<tollgate::model::NewJob> = (0..5)
        .map(|i| interactive_arrival("tiny", &format!("hi {i}"), now))
        .collect();
    let arriving: Vec<&tollgate::model::NewJob> = arriving.iter().collect();
    let started = gate.admit_arrivals(&app.db.pool, &arriving).await.unwrap();
    let ids: Vec<Option<tollgate::model::JobId>> = started.iter().map(|s| s.as_ref().map(|j| j.id)).collect();
    let expected: Vec<Option<tollgate::model::JobId>> = arriving
        .iter()
        .enumerate()
        .map(|(i, j)| (i < 3).then_some(j.id))
        .collect();
    assert_eq!(ids, expected);
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = 'tiny' AND state = 'running'")
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = 'tiny'")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!((running, all), (3, 3));
    // The rows written are the ones handed back (one statement wrote all three), and the
    // buckets were written with them: the tenant's three requests are taken.
    type Row = (uuid::Uuid, Option<Vec<i64>>, Option<Vec<f64>>, Option<String>);
    let stored: Vec<Row> = sqlx::query_as(
        "SELECT id, reserved_buckets, reserved_amounts, provider FROM jobs WHERE tenant = 'tiny' ORDER BY id",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    let handed: Vec<Row> = started
        .iter()
        .flatten()
        .map(|j| {
            let held = (j.reserved_buckets.clone(), j.reserved_amounts.clone());
            (j.id.0, held.0, held.1, j.provider.clone())
        })
        .collect();
    assert_eq!(stored, handed);
    let level: f64 = sqlx::query_scalar("SELECT level FROM buckets WHERE key = 'tenant:tiny:rpm'")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert!(level < 1.0, "three of three requests taken: {level}");
    app.shutdown().await;
}
