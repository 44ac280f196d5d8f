//! Crashes and restarts lose nothing: `tollgate serve` SIGKILLed ten times at random
//! moments of a run (seeded), and PostgreSQL restarted under a running broker. Each ends
//! with every job finished exactly once from the client's view, every bucket full again
//! and, for the kills, every webhook event delivered.
//!
//! `TOLLGATE_CHAOS_JOBS` sets the kill run's job count (default 2,000; RELIABILITY.md has
//! the figures of a 10,000-job run) and `TOLLGATE_CHAOS_SEED` its seed.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::db;
use tollgate::embedded::{EmbeddedOptions, EmbeddedPostgres};
use tollgate_mock::{FaultMix, MockProvider};

use crate::durability::{Serve, free_port, short_lease_config};
use crate::faults::{check_terminal_jobs, submit_all, wait_all_terminal, wait_buckets_full};
use crate::harness::{ACME, GLOBEX, eventually, fresh_db_with, job, mock_config, serve_connections};

const KILLS: usize = 10;
/// The child's dispatch concurrency (the harness config's): at most this many calls are
/// in flight at a kill.
const CONCURRENCY: u64 = 16;
/// Answered calls whose outcomes wait for the completer's commit (a slot takes its next
/// call as soon as its outcome is handed over) die with the process too: up to one
/// completer batch (`COMPLETION_BATCH` in the dispatcher's completer) per kill.
const AWAITING_COMMIT: u64 = 256;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The short-lease config of [`short_lease_config`] with a gauge and rolling buckets on
/// the route, and `extra` appended.
fn chaos_config(dir: &Path, mock_addr: std::net::SocketAddr, extra: &str) -> std::path::PathBuf {
    let path = short_lease_config(dir, mock_addr);
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 16\nrpm = 1000000\ntpm = 1000000000\n");
    text.push_str(extra);
    std::fs::write(&path, text).unwrap();
    path
}

/// Webhook events received, deduplicated by `webhook-id`: event id → job id.
type Events = Arc<Mutex<HashMap<String, String>>>;

async fn start_receiver(port: u16, events: Events, tracker: &TaskTracker, stop: CancellationToken) {
    let app = Router::new().route(
        "/hook",
        post(move |headers: HeaderMap, body: String| async move {
            let id = headers
                .get("webhook-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let body: Value = serde_json::from_str(&body).unwrap_or_default();
            let job = body["data"]["id"].as_str().unwrap_or_default().to_owned();
            events.lock().unwrap().insert(id, job);
            StatusCode::NO_CONTENT
        }),
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    tracker.spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
            .unwrap();
    });
}

/// Submits `n` jobs with idempotency keys, each retried until the server (which may be
/// down between a kill and its restart) accepts it.
async fn submit_through_kills(http: &reqwest::Client, api: &str, n: usize) -> Vec<String> {
    use futures::StreamExt;
    futures::stream::iter(0..n)
        .map(|i| {
            let http = http.clone();
            let url = format!("{api}/v1/jobs");
            async move {
                let key = if i % 2 == 0 { ACME } else { GLOBEX };
                let model = if i % 5 == 0 {
                    "ant/claude-3-5-haiku-latest"
                } else {
                    "fast"
                };
                let mut body = job(model, &format!("chaos job {i}"));
                body["idempotency_key"] = Value::String(format!("chaos-{i}"));
                loop {
                    let sent = http.post(&url).bearer_auth(key).json(&body).send().await;
                    if let Ok(r) = sent
                        && matches!(r.status().as_u16(), 200 | 202)
                        && let Ok(v) = r.json::<Value>().await
                    {
                        return v["id"].as_str().unwrap().to_owned();
                    }
                    // The server is down (killed, not yet restarted): try again shortly.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        })
        .buffered(32)
        .collect()
        .await
}

#[tokio::test]
async fn ten_sigkills_lose_nothing_and_finish_every_job_once() {
    let jobs = env_or("TOLLGATE_CHAOS_JOBS", 2_000) as usize;
    let seed = env_or("TOLLGATE_CHAOS_SEED", 11);
    let db = fresh_db_with(serve_connections()).await;
    // Calls take a while, so some are in flight at every kill; a few provider faults too.
    let mut mock_cfg = mock_config();
    mock_cfg.latency_ms = 40;
    mock_cfg.fault_mix = FaultMix {
        http_503: 0.01,
        reset: 0.01,
        ..FaultMix::uniform(seed, 0.0)
    };
    let local_mock = MockProvider::new(mock_cfg).start_local().await.unwrap();
    let mock = local_mock.provider.clone();

    let hook_port = free_port();
    let events: Events = Arc::default();
    let (receiver, stop_receiver) = (TaskTracker::new(), CancellationToken::new());
    start_receiver(hook_port, events.clone(), &receiver, stop_receiver.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = chaos_config(
        dir.path(),
        local_mock.addr,
        &format!(
            "[webhooks]\nallow_private_addresses = true\nretry_schedule_secs = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n\
             poll_interval_ms = 100\n[[webhooks.endpoints]]\ntenant = \"acme\"\n\
             url = \"http://127.0.0.1:{hook_port}/hook\"\nsecret = \"{}\"\n",
            tollgate::webhook_signing::Secret::generate()
        ),
    );
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let mut serve = Serve::start(&config, &db.url, port);
    serve.wait_ready(&api).await;

    // Kill at random moments while jobs are submitted and run; restart at once each time.
    let mut rng = StdRng::seed_from_u64(seed);
    let pauses: Vec<u64> = (0..KILLS).map(|_| rng.random_range(200..2_500)).collect();
    let kills = async {
        for pause in pauses {
            tokio::time::sleep(Duration::from_millis(pause)).await;
            serve.signal(Signal::SIGKILL);
            let _ = serve.child.wait();
            serve = Serve::start(&config, &db.url, port);
            serve.wait_ready(&api).await;
        }
    };
    let (ids, ()) = tokio::join!(submit_through_kills(&http, &api, jobs), kills);
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), jobs, "an idempotent resubmission made a second job");

    wait_all_terminal(&db.pool, 600).await;
    let counts = check_terminal_jobs(&db.pool, jobs).await;
    for (state, code, n) in &counts {
        if state == "failed" {
            let code = code.as_deref().unwrap_or_default();
            assert!(
                matches!(code, "attempts_exhausted" | "lease_expired"),
                "{n} jobs failed with {code}: {counts:?}"
            );
        }
    }
    let succeeded: i64 = counts.iter().filter(|c| c.0 == "succeeded").map(|c| c.2).sum();
    // Every call the mock answered 200 either finished a job or was lost with a killed
    // process (sent again after the rescue): at most the calls in flight at each kill and
    // the answered ones still waiting for their commit.
    let stats = mock.stats();
    let duplicates = stats.succeeded as i64 - succeeded;
    assert!(
        (0..=(KILLS as i64) * (CONCURRENCY + AWAITING_COMMIT) as i64).contains(&duplicates),
        "{duplicates} successful calls more than successful jobs"
    );
    let checked = wait_buckets_full(&db.pool).await;

    // One event per finished job of the tenant with an endpoint, each delivered.
    let acme: HashSet<String> = sqlx::query_scalar(
        "SELECT id::text FROM jobs WHERE tenant = 'acme' AND state IN ('succeeded', 'failed')",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(acme.len(), jobs.div_ceil(2));
    let delivered = eventually(120, "every webhook event to be delivered", || async {
        let got = events.lock().unwrap().clone();
        let jobs: HashSet<String> = got.values().cloned().collect();
        (jobs == acme).then_some(got)
    })
    .await;
    assert_eq!(delivered.len(), acme.len(), "a job produced more than one event");

    eprintln!(
        "chaos: {jobs} jobs, {KILLS} kills survived, {succeeded} succeeded, {counts:?}, \
         {duplicates} calls sent twice, {} faults injected, {} provider requests, \
         {} webhook events, {checked} buckets full",
        stats.faults_injected.total(),
        stats.requests,
        delivered.len()
    );
    serve.signal(Signal::SIGTERM);
    assert!(serve.child.wait().unwrap().success());
    stop_receiver.cancel();
    receiver.close();
    receiver.wait().await;
    local_mock.shutdown().await;
}

async fn readyz(http: &reqwest::Client, api: &str) -> Option<(u16, Value)> {
    let r = http.get(format!("{api}/readyz")).send().await.ok()?;
    let status = r.status().as_u16();
    let body = r.json::<Value>().await.unwrap_or(Value::Null);
    Some((status, body))
}

#[tokio::test]
async fn postgres_restart_mid_run_is_survived() {
    const JOBS: usize = 400;
    // A private cluster this test may stop and start.
    let dir = tempfile::tempdir().unwrap();
    let mut opts = EmbeddedOptions::new(dir.path().join("pg"));
    opts.durable = false;
    let pg = EmbeddedPostgres::start(opts.clone()).await.unwrap();
    opts.port = Some(pg.port());
    let url = db::with_database(&pg.url("postgres"), "tollgate");
    db::create_database_if_missing(&pg.url("postgres"), "tollgate")
        .await
        .unwrap();

    let mut mock_cfg = mock_config();
    mock_cfg.latency_ms = 30;
    let local_mock = MockProvider::new(mock_cfg).start_local().await.unwrap();
    let mock = local_mock.provider.clone();
    let config = chaos_config(dir.path(), local_mock.addr, "");
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let mut serve = Serve::start(&config, &url, port);
    serve.wait_ready(&api).await;

    let ids = submit_all(&http, &api, JOBS, |i| {
        (ACME, job("fast", &format!("pg restart {i}")))
    })
    .await;
    assert_eq!(ids.len(), JOBS);
    let pool = db::connect(&url, 2).await.unwrap();
    eventually(60, "some jobs to finish before the restart", || async {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'")
            .fetch_one(&pool)
            .await
            .ok()?;
        (done >= 20).then_some(())
    })
    .await;
    pool.close().await;

    pg.stop().await.unwrap();
    let (status, body) = eventually(30, "/readyz to report the database down", || async {
        readyz(&http, &api).await.filter(|(s, _)| *s != 200)
    })
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "database_unavailable", "{body}");
    // Submissions are refused cleanly meanwhile, not accepted and lost.
    let refused = http
        .post(format!("{api}/v1/jobs"))
        .bearer_auth(ACME)
        .json(&job("fast", "while down"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 503);
    assert!(
        serve.child.try_wait().unwrap().is_none(),
        "the broker died with its database"
    );

    let pg = EmbeddedPostgres::start(opts).await.unwrap();
    eventually(60, "/readyz to report ready again", || async {
        readyz(&http, &api).await.filter(|(s, _)| *s == 200)
    })
    .await;
    let pool = db::connect(&url, 2).await.unwrap();
    wait_all_terminal(&pool, 120).await;
    let counts = check_terminal_jobs(&pool, JOBS).await;
    assert!(counts.iter().all(|c| c.0 == "succeeded"), "{counts:?}");
    // Calls whose outcome could not be written before the leases ran out are made again.
    let resent = mock.stats().succeeded as i64 - JOBS as i64;
    assert!(
        (0..=CONCURRENCY as i64).contains(&resent),
        "{resent} calls sent twice"
    );
    wait_buckets_full(&pool).await;
    assert!(serve.child.try_wait().unwrap().is_none());
    eprintln!("postgres restart: {JOBS} jobs succeeded, {resent} calls sent twice");

    serve.signal(Signal::SIGTERM);
    assert!(serve.child.wait().unwrap().success());
    pool.close().await;
    pg.stop().await.unwrap();
    local_mock.shutdown().await;
}
