//! The test harness: one PostgreSQL server per test process (embedded unless
//! `DATABASE_URL` is set), a fresh database per test, and [`TestApp`]: the broker on port
//! 0 in front of the mock provider.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::{OnceCell, Semaphore, SemaphorePermit};
use tollgate::config::Config;
use tollgate::db;
use tollgate::embedded::{EmbeddedOptions, EmbeddedPostgres};
use tollgate_api::broker::{Broker, Roles};
use tollgate_mock::{LocalMock, MockConfig, MockProvider, ProjectConfig, ProviderKind};

pub const ACME: &str = "tk-acme";
pub const GLOBEX: &str = "tk-globex";

/// The server's admin URL; the embedded server lives as long as the test process.
async fn admin_url() -> String {
    static SERVER: OnceCell<(String, Option<EmbeddedPostgres>, Option<tempfile::TempDir>)> =
        OnceCell::const_new();
    let (url, _, _) = SERVER
        .get_or_init(|| async {
            if let Some(url) = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
                drop_stale_test_databases(&url).await;
                return (url, None, None);
            }
            let dir = tempfile::tempdir().expect("tempdir for the embedded PostgreSQL");
            let mut opts = EmbeddedOptions::new(dir.path().join("pg"));
            opts.durable = false;
            let pg = EmbeddedPostgres::start(opts)
                .await
                .expect("embedded PostgreSQL starts");
            (pg.url("postgres"), Some(pg), Some(dir))
        })
        .await;
    url.clone()
}

/// On a shared server, each test leaves its database behind (for a look after a failure);
/// a later test process drops those older than an hour. Their names carry a UUIDv7, whose
/// first 48 bits are the creation time in milliseconds.
async fn drop_stale_test_databases(admin: &str) {
    let Ok(pool) = db::connect(admin, 1).await else {
        return;
    };
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'tollgate\\_test\\_%'")
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
    let hour_ago = chrono::Utc::now().timestamp_millis() - 3_600_000;
    for name in names {
        let created = name
            .strip_prefix("tollgate_test_")
            .and_then(|hex| i64::from_str_radix(hex.get(..12)?, 16).ok());
        if created.is_some_and(|ms| ms < hour_ago) {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                .execute(&pool)
                .await;
        }
    }
    pool.close().await;
}

/// Connections of a test's own pool ([`fresh_db_with`]), and of a peer's API pool.
const POOL_SIZE: u32 = 10;
const PEER_POOL_SIZE: u32 = 5;
/// Connections of the server kept out of the budget: admin connections, database creation.
const UNBUDGETED: u32 = 10;

/// The server's connections, shared out among the tests running side by side, so they
/// never open more than it accepts (a refused connection surfaced ten seconds later as
/// `PoolTimedOut`, in whichever test was unlucky). Each test takes all it will use at once
/// ([`fresh_db_with`], [`TestApp::spawn_with`] with its brokers and [`TestOptions::peers`]):
/// none holds a share while waiting for another, so none waits forever.
async fn connection_budget() -> &'static (Semaphore, u32) {
    static BUDGET: OnceCell<(Semaphore, u32)> = OnceCell::const_new();
    BUDGET
        .get_or_init(|| async {
            let pool = db::connect(&admin_url().await, 1).await.expect("connect to the server");
            let usable: i64 = sqlx::query_scalar(
                "SELECT current_setting('max_connections')::bigint - current_setting('superuser_reserved_connections')::bigint",
            )
            .fetch_one(&pool)
            .await
            .expect("read max_connections");
            pool.close().await;
            let size = u32::try_from(usable).unwrap_or(0).saturating_sub(UNBUDGETED).max(POOL_SIZE);
            (Semaphore::new(size as usize), size)
        })
        .await
}

/// `connections` from the budget, waited for; a test that needs more than all of it
/// waits for all of it, and runs alone.
async fn connection_share(connections: u32) -> SemaphorePermit<'static> {
    let (budget, size) = connection_budget().await;
    budget
        .acquire_many(connections.min(*size))
        .await
        .expect("the connection budget is never closed")
}

/// A test's database.
pub struct TestDb {
    pub url: String,
    pub pool: PgPool,
    /// The test's share of the server's connections ([`connection_budget`]).
    _share: SemaphorePermit<'static>,
}

/// A fresh, migrated database, for a test that opens `extra` connections beside its pool
/// (a broker's role pools, a `tollgate serve` child's pools): all taken from the budget
/// up front.
pub async fn fresh_db_with(extra: u32) -> TestDb {
    fresh_db_holding(connection_share(POOL_SIZE + extra).await).await
}

/// Connections a `tollgate serve` child on the harness's config opens.
pub fn serve_connections() -> u32 {
    let config = Config::parse(&config_text(([127, 0, 0, 1], 9).into(), ""), "test config")
        .expect("valid test config");
    config.database.max_connections + tollgate_api::broker::role_connections(&config)
}

/// [`fresh_db_with`] for a test that took its share of connections already.
async fn fresh_db_holding(share: SemaphorePermit<'static>) -> TestDb {
    let db = empty_db_holding(share).await;
    tollgate::MIGRATOR
        .run(&db.pool)
        .await
        .expect("migrate test database");
    db
}

/// A fresh database with no schema at all, for the migration tests.
pub async fn empty_db() -> TestDb {
    empty_db_holding(connection_share(POOL_SIZE).await).await
}

async fn empty_db_holding(share: SemaphorePermit<'static>) -> TestDb {
    let admin = admin_url().await;
    let name = format!("tollgate_test_{}", uuid::Uuid::now_v7().simple());
    db::create_database_if_missing(&admin, &name)
        .await
        .expect("create test database");
    let url = db::with_database(&admin, &name);
    let pool = db::connect(&url, POOL_SIZE)
        .await
        .expect("connect to test database");
    TestDb {
        url,
        pool,
        _share: share,
    }
}

/// The mock's accounts in tests: generous limits unless a test sets its own.
pub fn mock_config() -> MockConfig {
    MockConfig::from_toml_str(
        r#"
output_tokens = 12
[[projects]]
name = "oai-test"
kind = "openai"
keys = ["sk-test-1"]
revoked_keys = ["sk-revoked"]
rpm = 100000
tpm = 100000000
[[projects]]
name = "ant-test"
kind = "anthropic"
keys = ["sk-ant-test"]
rpm = 100000
itpm = 100000000
otpm = 100000000
"#,
    )
    .expect("mock config")
}

/// A mock project of `kind` with `keys`, serving `models` at `rpm` requests a minute and no
/// other limit.
pub fn mock_project(
    name: &str,
    kind: ProviderKind,
    keys: &[&str],
    models: &[&str],
    rpm: u64,
) -> ProjectConfig {
    ProjectConfig {
        name: name.to_owned(),
        kind,
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        revoked_keys: Vec::new(),
        public_key: None,
        models: models.iter().map(|m| (*m).to_owned()).collect(),
        rpm,
        tpm: 0,
        rpd: 0,
        itpm: 0,
        otpm: 0,
    }
}

/// The broker's config pointing at the mock on `mock_addr`. `extra` is appended: the `oai`
/// provider comes last, so `[providers.limits."gpt-4o-mini"]` or
/// `[providers.prices."gpt-4o-mini"]` tables in it apply to `oai`; `[[tenants]]` in it add
/// tenants.
/// `MOCK_ADDR` in `extra` stands for the mock's address.
pub fn config_text(mock_addr: std::net::SocketAddr, extra: &str) -> String {
    format!(
        r#"
[server]
max_body_bytes = 65536
max_wait_secs = 30
[dispatch]
concurrency = 16
poll_interval_ms = 200
lease_secs = 30
heartbeat_secs = 5
drain_timeout_secs = 5
[retry]
max_attempts = 4
base_delay_ms = 50
max_delay_ms = 1000
[gate]
poll_interval_ms = 200
[[tenants]]
name = "acme"
api_key = "{ACME}"
weight = 3
[[tenants]]
name = "globex"
api_key = "{GLOBEX}"
[[routes]]
alias = "fast"
targets = ["oai/gpt-4o-mini"]
[[providers]]
name = "ant"
kind = "anthropic"
base_url = "http://{mock_addr}"
keys = [{{ name = "a1", value = "sk-ant-test" }}]
models = ["claude-3-5-haiku-latest"]
learn_limits = false # harness
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://{mock_addr}/v1"
keys = [{{ name = "k1", value = "sk-test-1" }}]
models = ["gpt-4o-mini"]
learn_limits = false # harness
{extra}
"#
    )
    .replace("MOCK_ADDR", &mock_addr.to_string())
}

/// `config` with `lines` (`key = value`, one a line) set in the table whose header is
/// `header`: a key the harness sets there already takes the new value, others are added.
fn set_in_table(config: &str, header: &str, lines: &str) -> String {
    let Some(start) = config.find(header).map(|i| i + header.len()) else {
        return config.to_owned();
    };
    let end = config[start..]
        .find("\n[")
        .map_or(config.len(), |i| start + i + 1);
    let mut table: Vec<String> = config[start..end].lines().map(str::to_owned).collect();
    for line in lines.lines().filter(|l| !l.trim().is_empty()) {
        let key = line.split('=').next().unwrap_or_default().trim();
        let set = table
            .iter_mut()
            .find(|l| l.split('=').next().unwrap_or_default().trim() == key);
        match set {
            Some(old) => *old = line.to_owned(),
            None => table.insert(0, line.to_owned()),
        }
    }
    format!("{}{}\n{}", &config[..start], table.join("\n"), &config[end..])
}

const RETRY_TABLE: &str = "[retry]\nmax_attempts = 4\nbase_delay_ms = 50\nmax_delay_ms = 1000\n";

fn retry_table(config: String, lines: &str) -> String {
    if lines.is_empty() {
        config
    } else {
        config.replacen(RETRY_TABLE, &format!("[retry]\n{lines}\n"), 1)
    }
}

pub struct TestOptions {
    pub roles: Roles,
    pub mock: MockConfig,
    pub extra_config: String,
    /// Lines added to the `[gate]` table.
    pub gate_config: String,
    /// Lines added to the `[server]` table.
    pub server_config: String,
    /// Lines added to the `[dispatch]` table.
    pub dispatch_config: String,
    /// The `[retry]` table's lines, replacing the harness's when not empty.
    pub retry_config: String,
    /// Whether the harness's providers (`oai`, `ant`) learn limits from responses. Off by
    /// default, so tests of other features meet the mock's limits as configured;
    /// providers added in `extra_config` learn unless they say otherwise.
    pub learn_limits: bool,
    /// Peers the test starts ([`TestApp::spawn_peer`]): their connections are taken from
    /// the budget with the test's own, up front ([`connection_budget`]).
    pub peers: usize,
}

impl Default for TestOptions {
    fn default() -> Self {
        Self {
            roles: Roles::ALL,
            mock: mock_config(),
            extra_config: String::new(),
            gate_config: String::new(),
            server_config: String::new(),
            dispatch_config: String::new(),
            retry_config: String::new(),
            learn_limits: false,
            peers: 0,
        }
    }
}

/// The broker in this process, its database and its mock provider.
pub struct TestApp {
    pub api: String,
    pub db: TestDb,
    pub config: Arc<Config>,
    pub mock: MockProvider,
    pub mock_addr: std::net::SocketAddr,
    pub http: reqwest::Client,
    pub broker: Option<Broker>,
    local_mock: LocalMock,
    /// Peers the test declared ([`TestOptions::peers`]), and started so far.
    peers: (usize, std::sync::atomic::AtomicUsize),
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::spawn_with(TestOptions::default()).await
    }

    pub async fn spawn_with(opts: TestOptions) -> Self {
        let local_mock = MockProvider::new(opts.mock)
            .start_local()
            .await
            .expect("mock provider");
        let (mock, mock_addr) = (local_mock.provider.clone(), local_mock.addr);
        let text = set_in_table(
            &config_text(mock_addr, &opts.extra_config),
            "[dispatch]\n",
            &opts.dispatch_config,
        );
        let config = Arc::new(
            Config::parse(
                &retry_table(text, &opts.retry_config)
                    .replace(
                        "learn_limits = false # harness",
                        if opts.learn_limits {
                            "learn_limits = true"
                        } else {
                            "learn_limits = false"
                        },
                    )
                    .replacen("[server]\n", &format!("[server]\n{}\n", opts.server_config), 1)
                    .replacen("[gate]\n", &format!("[gate]\n{}\n", opts.gate_config), 1),
                "test config",
            )
            .expect("valid test config"),
        );
        // This broker's pools, and each peer's.
        let roles = tollgate_api::broker::role_connections(&config);
        let connections = POOL_SIZE + roles + opts.peers as u32 * (PEER_POOL_SIZE + roles);
        let db = fresh_db_holding(connection_share(connections).await).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind api");
        let broker = Broker::start(config.clone(), db.pool.clone(), Some(listener), opts.roles)
            .await
            .expect("broker starts");
        let api = format!("http://{}", broker.addr.expect("api address"));
        Self {
            api,
            db,
            config,
            mock,
            mock_addr,
            http: reqwest::Client::new(),
            broker: Some(broker),
            local_mock,
            peers: (opts.peers, std::sync::atomic::AtomicUsize::new(0)),
        }
    }

    /// Another broker process on the same database (own pool, own notifications, own
    /// gate candidate, own dispatcher): what a second `tollgate serve` would be.
    pub async fn spawn_peer(&self, roles: Roles) -> Broker {
        self.spawn_peer_on_clock(roles, chrono::Duration::zero()).await
    }

    /// [`TestApp::spawn_peer`] whose clock reads `offset` off the database's time: a
    /// process on a host whose clock is wrong.
    pub async fn spawn_peer_on_clock(&self, roles: Roles, offset: chrono::Duration) -> Broker {
        let started = self.peers.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(
            started < self.peers.0,
            "peer {} of a test that declared {} (TestOptions::peers: their connections are taken up front)",
            started + 1,
            self.peers.0
        );
        let pool = db::connect(&self.db.url, PEER_POOL_SIZE)
            .await
            .expect("peer pool");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind peer api");
        let clock = tollgate::clock::Clock::database(&pool)
            .await
            .expect("the database's time")
            .offset_by(offset);
        Broker::start_with_clock(self.config.clone(), pool, Some(listener), roles, clock)
            .await
            .expect("peer broker starts")
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.api)
    }

    /// POSTs a job; returns status and body.
    pub async fn submit(&self, key: &str, body: &Value) -> (u16, Value) {
        submit_to(&self.http, &self.api, key, body).await
    }

    /// GET with the tenant key; returns status and body.
    pub async fn get(&self, key: &str, path: &str) -> (u16, Value) {
        let r = self
            .http
            .get(self.url(path))
            .bearer_auth(key)
            .send()
            .await
            .expect("GET");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// DELETE with the tenant key; returns status and body.
    pub async fn delete(&self, key: &str, path: &str) -> (u16, Value) {
        let r = self
            .http
            .delete(self.url(path))
            .bearer_auth(key)
            .send()
            .await
            .expect("DELETE");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    pub async fn patch(&self, key: &str, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .http
            .patch(self.url(path))
            .bearer_auth(key)
            .json(body)
            .send()
            .await
            .expect("PATCH");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    pub async fn post(&self, key: &str, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.url(path))
            .bearer_auth(key)
            .json(body)
            .send()
            .await
            .expect("POST");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// Long-polls the job until it is terminal (the server waits up to `secs`).
    pub async fn wait_job(&self, key: &str, id: &str, secs: u64) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            let (status, job) = self.get(key, &format!("/v1/jobs/{id}?wait=10")).await;
            assert_eq!(status, 200, "GET job: {job}");
            let state = job["state"].as_str().unwrap_or_default().to_owned();
            if matches!(state.as_str(), "succeeded" | "failed" | "cancelled")
                || tokio::time::Instant::now() >= deadline
            {
                return job;
            }
        }
    }

    /// Submits a job as `key` and waits up to `secs` for it to succeed; returns the job.
    pub async fn run_job(&self, key: &str, body: &Value, secs: u64) -> Value {
        let (status, accepted) = self.submit(key, body).await;
        assert_eq!(status, 202, "{accepted}");
        let done = self
            .wait_job(key, accepted["id"].as_str().expect("job id"), secs)
            .await;
        assert_eq!(done["state"], "succeeded", "{done}");
        done
    }

    /// Asserts the mock answered no call 429. When it did, the message names each call that
    /// met one — its job's estimate, when the gate admitted it, when it was sent, and the
    /// rate-limit headers it got — and what the mock counted per project.
    pub async fn assert_no_provider_429s(&self) {
        let stats = self.mock.stats();
        if stats.rate_limited_429 == 0 {
            return;
        }
        let met: Vec<String> = sqlx::query_scalar(
            "SELECT format('job %s attempt %s key %s (%s + %s tokens) admitted %s sent %s: %s',
                           a.job_id, a.attempt, a.key_name, a.estimated_input_tokens,
                           a.estimated_output_tokens, coalesce(j.admitted_at::text, 'never'),
                           a.started_at, coalesce(a.rate_limit::text, 'no headers'))
             FROM job_attempts a JOIN jobs j ON j.id = a.job_id
             WHERE a.status = 429 ORDER BY a.started_at",
        )
        .fetch_all(&self.db.pool)
        .await
        .expect("reading the calls that met a 429");
        panic!(
            "the mock answered {} calls 429:\n{}\nper project: {:?}",
            stats.rate_limited_429,
            met.join("\n"),
            stats.projects
        );
    }

    pub async fn shutdown(mut self) {
        if let Some(b) = self.broker.take() {
            b.shutdown().await;
        }
        self.local_mock.shutdown().await;
    }
}

/// POSTs a job to the API at `api` (this broker's or a peer's); returns status and body.
pub async fn submit_to(http: &reqwest::Client, api: &str, key: &str, body: &Value) -> (u16, Value) {
    let r = http
        .post(format!("{api}/v1/jobs"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .expect("POST /v1/jobs");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Long-polls job `id` on the broker at `api` (a child process, say) until it is
/// succeeded or failed, for up to `secs`.
pub async fn wait_finished_at(http: &reqwest::Client, api: &str, key: &str, id: &str, secs: u64) -> Value {
    eventually(secs, "the job to finish", || async {
        let j = get_json(http, &format!("{api}/v1/jobs/{id}?wait=5"), key).await?;
        matches!(j["state"].as_str(), Some("succeeded" | "failed")).then_some(j)
    })
    .await
}

/// `GET url` as `key`, its JSON body; `None` when the request or the body fails (for
/// polls that simply try again).
pub async fn get_json(http: &reqwest::Client, url: &str, key: &str) -> Option<Value> {
    http.get(url)
        .bearer_auth(key)
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

/// A minimal valid job body.
pub fn job(model: &str, text: &str) -> Value {
    json!({
        "request": {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 32
        }
    })
}

/// Polls `check` until it returns `Some`, failing after `secs`.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
