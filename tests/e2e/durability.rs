//! Nothing accepted is lost: a dispatcher that dies loses its jobs to the rescuer, and a
//! job accepted by a process that is then SIGKILLed completes after a restart, once.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use tollgate::attempt::{End, Holder, Outcome, Served};
use tollgate::model::JobState;
use tollgate::notify::Notifications;
use tollgate::store::{self, Settlement};
use tollgate_api::broker::Roles;
use tollgate_mock::MockProvider;
use tollgate_workers::dispatcher::Dispatcher;
use tollgate_workers::gate::Gate;
use tollgate_workers::maintenance::Maintenance;
use tollgate_workers::providers::Providers;

use crate::harness::{
    ACME, TestApp, TestOptions, config_text, eventually, fresh_db_with, job, mock_config, serve_connections,
    wait_finished_at,
};

#[tokio::test]
async fn expired_lease_is_rescued_and_the_old_holder_cannot_write() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let (_, accepted) = app.submit(ACME, &job("fast", "rescue me")).await;
    let pool = &app.db.pool;
    let gate = Gate::new(pool.clone(), app.config.clone(), Notifications::default());
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 1);
    // A dispatcher claims the job, then dies without a word.
    let lease = Duration::from_secs(30);
    let claimed = store::claim_jobs(pool, "ghost", 10, Utc::now(), lease)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let ghost = Holder {
        id: claimed[0].id,
        attempt: claimed[0].attempt,
        owner: "ghost".to_owned(),
    };
    let maintenance = Maintenance::new(pool.clone(), Duration::from_secs(1));
    // Before the lease expires nothing happens.
    let pass = maintenance.run_once(Utc::now()).await.unwrap();
    assert_eq!(pass.rescued.requeued, 0);
    // After it (by the database's time), the job goes back to the queue.
    let expire = || async {
        sqlx::query(
            "UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE lease_owner = 'ghost'",
        )
        .execute(pool)
        .await
        .unwrap()
    };
    expire().await;
    let pass = maintenance.run_once(Utc::now()).await.unwrap();
    assert_eq!(pass.rescued.requeued, 1);
    let row = store::get_job(pool, None, ghost.id).await.unwrap().unwrap();
    assert_eq!((row.state, row.lease_owner.as_deref()), (JobState::Queued, None));
    // The ghost's late result is refused: zero rows, not an error.
    let served = Served::new("oai", "gpt-4o-mini");
    let end = End::Succeeded {
        result: serde_json::json!({}),
        usage: Default::default(),
        provider_request_id: None,
    };
    let late = Outcome::new(ghost, Some(served), end, Settlement::SENT_UNKNOWN);
    let wrote = store::finish_attempt(pool, &late, Utc::now()).await.unwrap();
    assert!(!wrote);
    // A live dispatcher picks it up (after the gate admits it again) and finishes it as attempt 2.
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 1);
    let providers = Providers::from_config(&app.config).unwrap();
    let dispatcher = Dispatcher::new(
        pool.clone(),
        app.config.clone(),
        providers,
        Notifications::default(),
    );
    let step = dispatcher.run_once().await.unwrap();
    assert_eq!(step.claimed, 1);
    let done = app.wait_job(ACME, accepted["id"].as_str().unwrap(), 10).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["attempts"], 2);
    // Out of attempts, an expired lease fails the job with a reason instead.
    let (_, second) = app.submit(ACME, &job("fast", "no attempts left")).await;
    sqlx::query("UPDATE jobs SET max_attempts = 1 WHERE id = $1::uuid")
        .bind(second["id"].as_str().unwrap())
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, 1);
    store::claim_jobs(pool, "ghost", 10, Utc::now(), lease)
        .await
        .unwrap();
    expire().await;
    let pass = maintenance.run_once(Utc::now()).await.unwrap();
    assert_eq!(pass.rescued.failed, 1);
    let (_, failed) = app
        .get(ACME, &format!("/v1/jobs/{}", second["id"].as_str().unwrap()))
        .await;
    assert_eq!(failed["state"], "failed");
    assert_eq!(failed["error"]["code"], "lease_expired");
    app.shutdown().await;
}

#[tokio::test]
async fn queued_job_past_its_deadline_fails_and_is_never_dispatched() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let mut body = job("fast", "too late");
    body["deadline"] = Value::String((Utc::now() + chrono::Duration::seconds(2)).to_rfc3339());
    let (_, accepted) = app.submit(ACME, &body).await;
    let after_deadline = Utc::now() + chrono::Duration::seconds(3);
    let claimed = store::claim_jobs(&app.db.pool, "d", 10, after_deadline, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(claimed.is_empty(), "a job past its deadline must not be claimed");
    let pass = Maintenance::new(app.db.pool.clone(), Duration::from_secs(1))
        .run_once(after_deadline)
        .await
        .unwrap();
    assert_eq!(pass.deadlines_expired, 1);
    let (_, j) = app
        .get(ACME, &format!("/v1/jobs/{}", accepted["id"].as_str().unwrap()))
        .await;
    assert_eq!(
        (j["state"].as_str(), j["error"]["code"].as_str()),
        (Some("failed"), Some("deadline_exceeded"))
    );
    app.shutdown().await;
}

/// The real `tollgate serve` binary, as a child process.
pub struct Serve {
    pub child: Child,
}

impl Serve {
    pub fn start(config: &std::path::Path, db_url: &str, port: u16) -> Self {
        Self::start_with(config, db_url, port, |_| {})
    }

    /// [`Serve::start`] with its command changed by `configure` first (more arguments,
    /// variables, where its output goes).
    pub fn start_with(
        config: &std::path::Path,
        db_url: &str,
        port: u16,
        configure: impl FnOnce(&mut Command),
    ) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command
            .args(["serve", "--config"])
            .arg(config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("DATABASE_URL", db_url)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null());
        configure(&mut command);
        let child = command.spawn().expect("spawn tollgate serve");
        Self { child }
    }

    /// Polls `/readyz` until it answers; fails at once if the process exited.
    pub async fn wait_ready(&mut self, api: &str) {
        let http = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().expect("poll tollgate serve") {
                panic!("tollgate serve exited before it was ready: {status}");
            }
            let ready = http.get(format!("{api}/readyz")).send().await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "tollgate serve was not ready in time"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn signal(&mut self, signal: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), signal).expect("signal tollgate");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes (under `dir`) the config of a `serve` child that will be killed: short leases
/// and frequent maintenance, so a dead holder's jobs come back within seconds.
pub fn short_lease_config(dir: &std::path::Path, mock_addr: std::net::SocketAddr) -> std::path::PathBuf {
    let path = dir.join("tollgate.toml");
    let text = config_text(mock_addr, "")
        .replace("lease_secs = 30", "lease_secs = 3")
        .replace("heartbeat_secs = 5", "heartbeat_secs = 1")
        .replacen("[dispatch]\n", "[dispatch]\nmaintenance_interval_ms = 200\n", 1);
    std::fs::write(&path, text).unwrap();
    path
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn accepted_job_survives_sigkill_of_the_server_and_completes_once() {
    let db = fresh_db_with(serve_connections()).await;
    // A slow provider, so the job is certainly in flight when the server dies.
    let mut mock_cfg = mock_config();
    mock_cfg.latency_ms = 1500;
    let local_mock = MockProvider::new(mock_cfg).start_local().await.unwrap();
    let (mock, mock_addr) = (local_mock.provider.clone(), local_mock.addr);

    let dir = tempfile::tempdir().unwrap();
    let config_path = short_lease_config(dir.path(), mock_addr);
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();

    let mut first = Serve::start(&config_path, &db.url, port);
    first.wait_ready(&api).await;
    let resp = http
        .post(format!("{api}/v1/jobs"))
        .bearer_auth(ACME)
        .json(&job("oai/gpt-4o-mini", "survive"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 202);
    let id: String = resp.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let pool = Arc::new(db.pool.clone());
    let job_id: tollgate::model::JobId = id.parse().unwrap();
    eventually(30, "the job to be in flight", || {
        let pool = pool.clone();
        async move {
            let j = store::get_job(&*pool, None, job_id).await.unwrap().unwrap();
            (j.state == JobState::Running).then_some(())
        }
    })
    .await;
    first.signal(Signal::SIGKILL);
    let _ = first.child.wait();
    assert_eq!(
        mock.stats().succeeded,
        0,
        "the first call must not have finished before the kill"
    );

    let mut second = Serve::start(&config_path, &db.url, port);
    second.wait_ready(&api).await;
    let done = wait_finished_at(&http, &api, ACME, &id, 60).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(
        done["attempts"], 2,
        "the killed attempt counts; the second one finished it"
    );
    // Written once: one successful attempt on record, and its request id is the job's.
    let attempts: Vec<(i32, String, Option<String>)> =
        sqlx::query_as("SELECT attempt, outcome, provider_request_id FROM job_attempts WHERE job_id = $1")
            .bind(job_id)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!((attempts[0].0, attempts[0].1.as_str()), (2, "succeeded"));
    assert_eq!(done["provider_request_id"].as_str(), attempts[0].2.as_deref());

    // SIGTERM drains and exits cleanly.
    second.signal(Signal::SIGTERM);
    let status = second.child.wait().unwrap();
    assert!(status.success(), "graceful shutdown exit status: {status}");
    local_mock.shutdown().await;
}

#[tokio::test]
async fn one_process_per_role_runs_jobs_and_the_api_less_ones_answer_probes_only() {
    let db = fresh_db_with(2 * serve_connections()).await;
    let local_mock = MockProvider::new(mock_config()).start_local().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config_path = short_lease_config(dir.path(), local_mock.addr);
    let (api_port, worker_port) = (free_port(), free_port());
    let (api, worker) = (
        format!("http://127.0.0.1:{api_port}"),
        format!("http://127.0.0.1:{worker_port}"),
    );
    let mut front = Serve::start_with(&config_path, &db.url, api_port, |c| {
        c.args(["--roles", "api"]);
    });
    let mut back = Serve::start_with(&config_path, &db.url, worker_port, |c| {
        c.args(["--roles", "gate,dispatch,maintenance"]);
    });
    front.wait_ready(&api).await;
    back.wait_ready(&worker).await;
    let http = reqwest::Client::new();
    let healthy = http.get(format!("{worker}/healthz")).send().await.unwrap();
    assert_eq!(healthy.status().as_u16(), 200);
    let absent = http
        .get(format!("{worker}/v1/jobs"))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(absent.status().as_u16(), 404, "no API where the role is not run");
    // Accepted by the API process, admitted and sent by the other.
    let accepted: Value = http
        .post(format!("{api}/v1/jobs"))
        .bearer_auth(ACME)
        .json(&job("oai/gpt-4o-mini", "split"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let done =
        crate::harness::wait_finished_at(&http, &api, ACME, accepted["id"].as_str().unwrap(), 30).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    for serve in [&mut front, &mut back] {
        serve.signal(Signal::SIGTERM);
    }
}
