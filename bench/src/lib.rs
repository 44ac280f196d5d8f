//! tollgate's benchmarks and the stack they and the demo run on.
//!
//! - [`local`]: a whole stack on this machine: database (embedded or `DATABASE_URL`), the
//!   mock provider, and the broker.
//! - [`demo`]: `tollgate demo`, the whole system on one machine with a sample workload.
//! - the crate root: `tollgate bench`, its cases and their baselines (below).
//!
//! The apalis-postgres baseline (`bench/apalis-baseline/`) is a workspace of its own;
//! `tollgate bench --apalis BIN` runs it beside tollgate.
//!
//! `tollgate bench`: measured speed, each case beside its baseline in the same run, on a
//! fresh database and the mock provider (zero latency, no limits unless a case sets them).
//!
//! - `throughput`: N jobs submitted over HTTP and run end to end (admitted through the
//!   gate with buckets, dispatched over HTTP to the mock, result and usage written);
//!   baseline: the same N requests sent straight to the mock by a plain HTTP client with
//!   the same concurrency (what an app does without a broker).
//! - `gate`: N queued jobs admitted by the gate (every job through four buckets);
//!   baseline: the same rows moved from queued to admitted by a plain `SKIP LOCKED`
//!   batch update of the same size (a queue without admission).
//! - `steady`: jobs submitted at a steady rate while everything runs; enqueue → admitted
//!   and enqueue → dispatched latency percentiles.
//! - `scale` ([`scale`]): the gate admitting from a million queued jobs across a thousand
//!   tenants, beside the same admissions from a queue holding only them.
//! - `limits` ([`limits`]): limits tollgate was never told — learned from headers, from
//!   429s, halved mid-run, through an outage — beside 8 clients retrying as the OpenAI SDK
//!   does.
//! - `attack` ([`attack`]): a well-behaved tenant's API latency while another tenant and
//!   an anonymous client attack the process, beside the same load alone.
//! - `lanes` ([`lanes`]): a workload of mixed deadlines with every lane on (online, flex,
//!   the provider's batch API), beside the same workload online only: spend per lane.
//! - `eta` ([`eta`]): the `eta` forecast at submission against when each job finished on
//!   a steady mixed workload, beside a queue-drain estimate.

mod attack;
pub mod demo;
mod eta;
mod ingest;
mod lanes;
mod limits;
pub mod local;
mod scale;
mod sync;

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use serde_json::{Value, json};
use tollgate::config::Config;
use tollgate::notify::Notifications;
use tollgate_mock::MockConfig;
use tollgate_workers::gate::Gate;

use crate::local::LocalStack;
use tollgate_api::broker::Roles;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Case {
    All,
    Throughput,
    Gate,
    Steady,
    Limits,
    Scale,
    /// A batch input file into the queue (not in `all`).
    Ingest,
    /// A well-behaved tenant's latency under attack, beside it alone (not in `all`).
    Attack,
    /// The synchronous `/v1/chat/completions` beside the mock directly, by `hey` (not in
    /// `all`).
    Sync,
    /// Mixed deadlines across every lane, beside online only: spend per lane (not in `all`).
    Lanes,
    /// The `eta` forecasts against what happened, beside a queue-drain estimate (not in
    /// `all`).
    Eta,
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Which case to run.
    #[arg(long, value_enum, default_value_t = Case::All)]
    pub case: Case,
    /// Jobs per case (throughput and gate).
    #[arg(long, default_value_t = 20_000)]
    pub jobs: usize,
    /// Concurrent client requests (submissions, and the baseline's calls).
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Provider calls in flight in the broker (`dispatch.concurrency`).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Steady and eta cases: jobs per second.
    #[arg(long, default_value_t = 1000)]
    pub rate: u64,
    /// Steady, attack and eta cases: seconds of load.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Eta case: seconds the stream runs on after `seconds`, its jobs not scored — so that
    /// every scored job waits in a steady stream, not one that stops while it waits.
    #[arg(long, default_value_t = 0)]
    pub tail: u64,
    /// Eta case: how submissions arrive — `even` (evenly spaced, tenants alternating, every
    /// fifth of a tenant's jobs background) or `poisson` (a seeded random stream of the
    /// same rate and mix).
    #[arg(long, value_enum, default_value_t = eta::Arrivals::Even)]
    pub arrivals: eta::Arrivals,
    /// Eta case: one job in this many sets a deadline of its own, two minutes out (1: every
    /// job, so that what is accepted is what the provider can serve in time — a steady
    /// queue; the rest are due by their class's default, an hour or more).
    #[arg(long, default_value_t = 3)]
    pub due_every: u64,
    /// Limits case: jobs per scenario; lanes case: jobs per run.
    #[arg(long, default_value_t = 1800)]
    pub limit_jobs: usize,
    /// Limits and eta cases: the mock provider's requests per minute.
    #[arg(long, default_value_t = 1200)]
    pub rpm: u64,
    /// Limits and eta cases: the mock provider's tokens per minute.
    #[arg(long, default_value_t = 400_000)]
    pub tpm: u64,
    /// Limits case: only these scenarios, comma-separated (`headers`, `no-headers`,
    /// `halved`, `outage`, `sdk`); every one by default. `no-headers-unpaced` (the
    /// no-headers run with the pace out of the way) runs only when named.
    #[arg(long, value_delimiter = ',')]
    pub scenarios: Vec<String>,
    /// Limits case: broker processes on the one database (each its own connections, gate
    /// and dispatchers), sharing what they learn through it.
    #[arg(long, default_value_t = 1)]
    pub processes: usize,
    /// Scale case: jobs queued behind the measured ones.
    #[arg(long, default_value_t = 1_000_000)]
    pub backlog: usize,
    /// Scale case: tenants the backlog is spread over.
    #[arg(long, default_value_t = 1_000)]
    pub tenants: usize,
    /// Throughput case: skip the run that submits jobs one request each.
    #[arg(long)]
    pub skip_single: bool,
    /// The apalis-postgres baseline's binary (`bench/apalis-baseline`), run beside the
    /// throughput case on the same PostgreSQL when given.
    #[arg(long)]
    pub apalis: Option<std::path::PathBuf>,
    /// Attack case: which attackers run beside the well-behaved tenant (all by default).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = attack::Attacker::ALL)]
    pub attackers: Vec<attack::Attacker>,
    /// Attack case: the attacking clients' niceness (19: their CPU yields to the broker's,
    /// as if they ran on another host); unset, they run at the broker's priority.
    #[arg(long, allow_negative_numbers = true)]
    pub attacker_nice: Option<i32>,
    /// Where the embedded PostgreSQL keeps its data (ignored with DATABASE_URL).
    #[arg(long, default_value = ".tollgate/pg")]
    pub data_dir: std::path::PathBuf,
}

pub(crate) fn mock_config() -> MockConfig {
    MockConfig::from_toml_str(
        r#"
output_tokens = 8
[[projects]]
name = "bench"
kind = "openai"
keys = ["sk-bench"]
[[projects]]
name = "bench-anthropic"
kind = "anthropic"
keys = ["sk-ant-bench"]
"#,
    )
    .unwrap_or_default()
}

/// The mock's OpenAI account as a provider with limits far above what the machine can
/// reach, so every job goes through real provider buckets without any of them binding.
pub(crate) fn unbound_provider(mock: std::net::SocketAddr) -> String {
    limited_provider(mock, 100_000_000, 100_000_000_000)
}

/// The mock's OpenAI account as a provider whose `gpt-4o-mini` tollgate limits to `rpm`
/// and `tpm`.
pub(crate) fn limited_provider(mock: std::net::SocketAddr, rpm: u64, tpm: u64) -> String {
    format!(
        r#"
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://{mock}/v1"
keys = [{{ name = "k", value = "sk-bench" }}]
models = ["gpt-4o-mini"]
[providers.limits."gpt-4o-mini"]
rpm = {rpm}
tpm = {tpm}
"#
    )
}

/// The mock's OpenAI account serving embeddings (`emb/text-embedding-3-small`) and its
/// Anthropic account (`ant/claude-3-5-haiku-latest`), limited far above what the machine
/// can reach, as [`unbound_provider`].
fn unbound_other_endpoints(mock: std::net::SocketAddr) -> String {
    format!(
        r#"
[[providers]]
name = "emb"
kind = "openai"
base_url = "http://{mock}/v1"
keys = [{{ name = "e", value = "sk-bench" }}]
models = ["text-embedding-3-small"]
[providers.limits."text-embedding-3-small"]
rpm = 100000000
tpm = 100000000000
[[providers]]
name = "ant"
kind = "anthropic"
base_url = "http://{mock}"
keys = [{{ name = "a", value = "sk-ant-bench" }}]
models = ["claude-3-5-haiku-latest"]
[providers.limits."claude-3-5-haiku-latest"]
rpm = 100000000
itpm = 100000000000
otpm = 100000000000
"#
    )
}

/// The broker: [`unbound_provider`], [`unbound_other_endpoints`] and one tenant with
/// unbound rpm and tpm buckets.
fn broker_config(mock: std::net::SocketAddr, concurrency: usize) -> anyhow::Result<Config> {
    let text = format!(
        r#"
[server]
max_wait_secs = 60
# The engine's speed is measured, not a tenant's API rate (a bulk counts each of its jobs).
api_rate_per_sec = 1000000000.0
api_burst = 1000000000.0
[database]
max_connections = 32
[dispatch]
concurrency = {concurrency}
[gate]
interactive_reserve = 0.0
{}
[[tenants]]
name = "bench"
api_key = "tk-bench"
rpm = 100000000
tpm = 100000000000
{}"#,
        unbound_provider(mock),
        unbound_other_endpoints(mock)
    );
    Ok(Config::parse(&text, "bench config")?)
}

fn request(i: usize) -> Value {
    json!({
        "model": "oai/gpt-4o-mini",
        "messages": [{"role": "user", "content": format!("benchmark request {i}")}],
        "max_tokens": 8
    })
}

/// Runs the chosen cases and prints Markdown tables for BENCHMARKS.md.
#[allow(clippy::print_stdout)] // the report is the command's output
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if let Some(bin) = &args.apalis {
        anyhow::ensure!(
            bin.is_file(),
            "--apalis {}: no such binary (build it: cd bench/apalis-baseline && cargo build --release)",
            bin.display()
        );
    }
    println!(
        "tollgate bench: jobs {}, clients {}, dispatch.concurrency {}",
        args.jobs, args.clients, args.concurrency
    );
    if matches!(args.case, Case::All | Case::Throughput) {
        throughput(&args).await?;
    }
    if matches!(args.case, Case::All | Case::Gate) {
        gate(&args).await?;
    }
    if matches!(args.case, Case::All | Case::Steady) {
        steady(&args).await?;
    }
    if matches!(args.case, Case::All | Case::Limits) {
        limits::run(&args).await?;
    }
    if matches!(args.case, Case::Scale) {
        scale::run(&args).await?;
    }
    if matches!(args.case, Case::Ingest) {
        ingest::run(&args).await?;
    }
    if matches!(args.case, Case::Attack) {
        attack::run(&args).await?;
    }
    if matches!(args.case, Case::Sync) {
        sync::run(&args).await?;
    }
    if matches!(args.case, Case::Lanes) {
        lanes::run(&args).await?;
    }
    if matches!(args.case, Case::Eta) {
        eta::run(&args).await?;
    }
    Ok(())
}

async fn stack_for(args: &BenchArgs, roles: Roles) -> anyhow::Result<LocalStack> {
    let concurrency = args.concurrency;
    LocalStack::start("bench", args.data_dir.clone(), mock_config(), roles, |addr| {
        broker_config(addr, concurrency)
    })
    .await
}

pub(crate) fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

/// Submits job `i` to the broker; true when accepted (202).
async fn submit(http: &reqwest::Client, url: &str, i: usize) -> bool {
    let r = http
        .post(url)
        .bearer_auth("tk-bench")
        .json(&json!({"request": request(i)}))
        .send()
        .await;
    matches!(r, Ok(resp) if resp.status().as_u16() == 202)
}

/// Submits jobs `range` in one `POST /v1/jobs/bulk`; true when all were accepted.
async fn submit_bulk(http: &reqwest::Client, url: &str, range: std::ops::Range<usize>) -> bool {
    let jobs: Vec<Value> = range.map(|i| json!({"request": request(i)})).collect();
    let r = http
        .post(url)
        .bearer_auth("tk-bench")
        .json(&json!({ "jobs": jobs }))
        .send()
        .await;
    matches!(r, Ok(resp) if resp.status().as_u16() == 202)
}

/// Submits jobs `0..jobs` in `POST /v1/jobs/bulk` requests of [`BULK_CHUNK`], 4 in flight;
/// how many requests failed.
async fn submit_in_bulks(http: &reqwest::Client, api: &str, jobs: usize) -> usize {
    let url = format!("{api}/v1/jobs/bulk");
    let chunks: Vec<std::ops::Range<usize>> = (0..jobs)
        .step_by(BULK_CHUNK)
        .map(|from| from..(from + BULK_CHUNK).min(jobs))
        .collect();
    send_all(chunks.len(), 4, |c| {
        let (http, url, range) = (http.clone(), url.clone(), chunks[c].clone());
        async move { submit_bulk(&http, &url, range).await }
    })
    .await
}

/// Jobs per `POST /v1/jobs/bulk` in the benchmarks.
const BULK_CHUNK: usize = 2_000;

/// CPU time used so far, read from `/proc` (`None` where there is none): the whole
/// machine's busy time (all cores: user, system, interrupts), PostgreSQL's (its server
/// processes, when it runs on this machine) and this process's (the broker, the in-process
/// mock provider and the load generator). Per job, it is steadier across runs than wall
/// time on a VM whose speed moves, and the split says which side bounds a figure.
#[derive(Debug, Clone, Copy)]
struct CpuUse {
    machine: Option<Duration>,
    database: Option<Duration>,
    this_process: Option<Duration>,
}

/// CPU milliseconds per job over a case, by whom ([`CpuUse`]).
#[derive(Debug, Clone, Copy, Default)]
struct CpuPerJob {
    machine: Option<f64>,
    database: Option<f64>,
    this_process: Option<f64>,
}

/// `/proc`'s CPU times, in USER_HZ ticks (100 a second on every Linux this runs on).
pub(crate) fn ticks(n: u64) -> Duration {
    Duration::from_millis(n * 10)
}

impl CpuUse {
    /// `postmaster`: the PostgreSQL server's process id ([`postmaster_pid`]), if local.
    fn now(postmaster: Option<u32>) -> Self {
        let machine = std::fs::read_to_string("/proc/stat").ok().and_then(|stat| {
            let fields: Vec<u64> = stat
                .lines()
                .next()?
                .split_whitespace()
                .skip(1)
                .filter_map(|f| f.parse().ok())
                .collect();
            // user nice system idle iowait irq softirq steal: busy = all but idle, iowait, steal.
            Some(ticks([0, 1, 2, 5, 6].iter().filter_map(|&i| fields.get(i)).sum()))
        });
        let this_process = process_ticks("self", false).map(ticks);
        Self {
            machine,
            database: postmaster.and_then(server_ticks).map(ticks),
            this_process,
        }
    }

    fn per_job_since(begin: Self, postmaster: Option<u32>, jobs: usize) -> CpuPerJob {
        let end = Self::now(postmaster);
        let per_job = |from: Option<Duration>, to: Option<Duration>| {
            Some(to?.saturating_sub(from?).as_secs_f64() * 1000.0 / jobs.max(1) as f64)
        };
        CpuPerJob {
            machine: per_job(begin.machine, end.machine),
            database: per_job(begin.database, end.database),
            this_process: per_job(begin.this_process, end.this_process),
        }
    }
}

/// A process's user + system CPU ticks from `/proc/<pid>/stat`, with its reaped children's
/// when `with_children`.
pub(crate) fn process_ticks(pid: &str, with_children: bool) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    let own = field(11)? + field(12)?;
    Some(if with_children {
        own + field(13)? + field(14)?
    } else {
        own
    })
}

/// The PostgreSQL server's CPU ticks: the postmaster's, with its ended children's (ended
/// backends are reaped by it), plus those of its children running now.
fn server_ticks(postmaster: u32) -> Option<u64> {
    let children: u64 = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let parent: u32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
            (parent == postmaster)
                .then(|| process_ticks(&pid, false))
                .flatten()
        })
        .sum();
    Some(process_ticks(&postmaster.to_string(), true)? + children)
}

/// The process id of the PostgreSQL server behind `pool`, when it runs on this machine
/// (the parent of this connection's backend).
async fn postmaster_pid(pool: &sqlx::PgPool) -> Option<u32> {
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{backend}/stat")).ok()?;
    // A backend of another machine's server may share its pid with an unrelated process
    // here: only a `postgres` process counts.
    let (name, rest) = stat.split_once(" (")?.1.rsplit_once(')')?;
    (name == "postgres").then_some(())?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Sends `n` requests with `clients` in flight; returns how many failed.
async fn send_all<F, Fut>(n: usize, clients: usize, send: F) -> usize
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    futures::stream::iter(0..n)
        .map(send)
        .buffer_unordered(clients)
        .filter(|ok| futures::future::ready(!*ok))
        .count()
        .await
}

/// Submits `n` jobs to the broker at `api`, `body(i)` each (`POST /v1/jobs` as tenant
/// `bench`), 32 at a time; an error when any was refused.
pub(crate) async fn submit_jobs(api: &str, n: usize, body: impl Fn(usize) -> Value) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let url = format!("{api}/v1/jobs");
    let rejected = send_all(n, 32, |i| {
        let (http, url, body) = (http.clone(), url.clone(), body(i));
        async move {
            let r = http.post(url).bearer_auth("tk-bench").json(&body).send().await;
            matches!(r, Ok(resp) if resp.status().as_u16() == 202)
        }
    })
    .await;
    anyhow::ensure!(rejected == 0, "{rejected} submissions were refused");
    Ok(())
}

/// Waits until `expected` jobs have ended; returns (succeeded, failed or cancelled).
///
/// Woken by the broker's `job_done` notifications, not by polling: the unfinished count
/// is re-read only once as many jobs were announced as were unfinished, or after a second
/// without any announcement. (Counting every 20 ms took an eighth of the database's time
/// away from the broker being measured; every second, a twentieth at 100,000 jobs.)
async fn wait_finished(pool: &sqlx::PgPool, expected: i64) -> anyhow::Result<(i64, i64)> {
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen(tollgate::store::CHANNEL_JOB_DONE).await?;
    loop {
        // After LISTEN: whatever ends after this count is announced.
        let unfinished: i64 =
            sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state IN ('queued', 'admitted', 'running')")
                .fetch_one(pool)
                .await?;
        if unfinished == 0 {
            let (done, failed): (i64, i64) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE state = 'succeeded'),
                        count(*) FILTER (WHERE state IN ('failed', 'cancelled')) FROM jobs",
            )
            .fetch_one(pool)
            .await?;
            if done + failed >= expected {
                return Ok((done, failed));
            }
        }
        let mut announced = 0;
        while announced < unfinished.max(1) {
            match tokio::time::timeout(Duration::from_secs(1), listener.recv()).await {
                Ok(note) => announced += note?.payload().split(',').count() as i64,
                Err(_) => break,
            }
        }
    }
}

#[allow(clippy::print_stdout)]
async fn throughput(args: &BenchArgs) -> anyhow::Result<()> {
    let stack = stack_for(args, Roles::ALL).await?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.clients)
        .build()?;
    let direct_url = format!("http://{}/v1/chat/completions", stack.mock_addr);
    let postmaster = postmaster_pid(&stack.pool).await;
    let (begin, cpu_begin) = (Instant::now(), CpuUse::now(postmaster));
    let direct_failures = send_all(args.jobs, args.clients, |i| {
        let (http, url) = (http.clone(), direct_url.clone());
        async move {
            let body = json!({"model": "gpt-4o-mini", "messages": request(i)["messages"], "max_tokens": 8});
            match http.post(url).bearer_auth("sk-bench").json(&body).send().await {
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                Err(_) => false,
            }
        }
    })
    .await;
    let direct = begin.elapsed();
    let direct_cpu = CpuUse::per_job_since(cpu_begin, postmaster, args.jobs);

    let (per_job, per_job_submit, per_job_failures) = if args.skip_single {
        (None, None, 0)
    } else {
        let jobs_url = format!("{}/v1/jobs", stack.api);
        let begin = Instant::now();
        let submit_failures = send_all(args.jobs, args.clients, |i| {
            let (http, url) = (http.clone(), jobs_url.clone());
            async move { submit(&http, &url, i).await }
        })
        .await;
        let submitted = begin.elapsed();
        let expected = (args.jobs - submit_failures) as i64;
        let (succeeded, failed) = wait_finished(&stack.pool, expected).await?;
        anyhow::ensure!(
            succeeded == expected,
            "only {succeeded} of {expected} jobs succeeded ({failed} failed)"
        );
        (Some(begin.elapsed()), Some(submitted), failed)
    };
    stack.stop().await?;

    // Bulk: the same jobs in `POST /v1/jobs/bulk` requests of BULK_CHUNK, 4 in flight, on a
    // fresh database.
    let stack = stack_for(args, Roles::ALL).await?;
    let postmaster = postmaster_pid(&stack.pool).await;
    let (begin, cpu_begin) = (Instant::now(), CpuUse::now(postmaster));
    let bulk_failures = submit_in_bulks(&http, &stack.api, args.jobs).await;
    anyhow::ensure!(bulk_failures == 0, "{bulk_failures} bulk submissions failed");
    let bulk_submitted = begin.elapsed();
    let (succeeded, failed) = wait_finished(&stack.pool, args.jobs as i64).await?;
    let bulk_through = begin.elapsed();
    let bulk_cpu = CpuUse::per_job_since(cpu_begin, postmaster, args.jobs);
    let mut stack = stack;
    stack.stop_services().await;
    let apalis = match &args.apalis {
        Some(bin) => apalis_baseline(bin, stack.admin_url(), args.jobs).await?,
        None => Vec::new(),
    };
    stack.stop().await?;
    anyhow::ensure!(
        succeeded == args.jobs as i64,
        "bulk: only {succeeded} of {} jobs succeeded ({failed} failed)",
        args.jobs
    );

    let direct_rate = rate(args.jobs, direct);
    println!(
        "\n### throughput: {} jobs end to end vs. direct to the mock\n",
        args.jobs
    );
    println!(
        "| case | wall s | jobs/s | ratio to baseline | CPU ms per job: machine | PostgreSQL | tollgate process | failures |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let row_with_cpu = |name: &str, d: Duration, cpu: CpuPerJob, failures: usize| {
        let ms = |v: Option<f64>| v.map_or_else(|| "–".to_owned(), |ms| format!("{ms:.3}"));
        println!(
            "| {name} | {:.2} | {:.0} | {:.2} | {} | {} | {} | {failures} |",
            d.as_secs_f64(),
            rate(args.jobs, d),
            rate(args.jobs, d) / direct_rate,
            ms(cpu.machine),
            ms(cpu.database),
            ms(cpu.this_process),
        );
    };
    let row =
        |name: &str, d: Duration, failures: usize| row_with_cpu(name, d, CpuPerJob::default(), failures);
    row_with_cpu("baseline: direct to mock", direct, direct_cpu, direct_failures);
    if let (Some(through), Some(submitted)) = (per_job, per_job_submit) {
        row(
            "tollgate: submit only (`POST /v1/jobs`, one request per job)",
            submitted,
            0,
        );
        row(
            "tollgate: end to end, jobs submitted one by one",
            through,
            per_job_failures as usize,
        );
    }
    row(
        "tollgate: submit only (`POST /v1/jobs/bulk`, 2,000 per request)",
        bulk_submitted,
        0,
    );
    row_with_cpu(
        "tollgate: end to end, jobs submitted in bulk",
        bulk_through,
        bulk_cpu,
        failed as usize,
    );
    println!(
        "\nThe tollgate process holds the broker, the mock provider and the load generator: \
         its CPU in the first row is the mock's and the clients' alone."
    );
    if !apalis.is_empty() {
        let bulk_rate = rate(args.jobs, bulk_through);
        println!("\napalis-postgres on the same PostgreSQL (no-op jobs, no HTTP call, no admission):\n");
        println!("| apalis case | settings | jobs | jobs/s | tollgate bulk end to end ÷ this |");
        println!("|---|---|---:|---:|---:|");
        for c in &apalis {
            let settings = match (c.get("workers"), c.get("batch"), c.get("chunk")) {
                (Some(w), Some(b), _) => format!("{w} workers × batch {b}"),
                (_, _, Some(chunk)) => format!("push_bulk of {chunk}"),
                _ => String::new(),
            };
            println!(
                "| {} | {settings} | {} | {:.0} | {:.2} |",
                c["case"].as_str().unwrap_or("?"),
                c["jobs"],
                c["jobs_per_sec"].as_f64().unwrap_or(0.0),
                bulk_rate / c["jobs_per_sec"].as_f64().unwrap_or(f64::NAN)
            );
        }
    }
    Ok(())
}

/// Runs the apalis-postgres baseline (`bench/apalis-baseline`) against the same server;
/// returns its JSON lines, one per case.
async fn apalis_baseline(bin: &std::path::Path, admin_url: &str, jobs: usize) -> anyhow::Result<Vec<Value>> {
    let out = tokio::process::Command::new(bin)
        .args(["--database-url", admin_url, "--jobs", &jobs.to_string()])
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "the apalis baseline failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Inserts `n` queued jobs spread round-robin over `tenants`, a slice of 100,000 per
/// statement so that one statement's memory stays bounded however many are asked for.
pub(crate) async fn insert_queued(pool: &sqlx::PgPool, n: usize, tenants: &[String]) -> anyhow::Result<()> {
    let slice = 100_000;
    for from in (0..n).step_by(slice) {
        let to = (from + slice).min(n);
        sqlx::query(
            "INSERT INTO jobs (id, tenant, class, priority, state, request, model, deadline, not_before, max_attempts,
                               estimated_input_tokens, estimated_output_tokens, created_at)
             SELECT gen_random_uuid(), ($3::text[])[1 + i % cardinality($3::text[])], 'standard', 0, 'queued',
                    jsonb_build_object('model', 'oai/gpt-4o-mini', 'messages', jsonb_build_array(
                        jsonb_build_object('role', 'user', 'content', 'benchmark request ' || i)), 'max_tokens', 8),
                    'oai/gpt-4o-mini', now() + interval '1 day', now(), 6, 12, 8, now()
             FROM generate_series($1, $2 - 1) AS i",
        )
        .bind(from as i64)
        .bind(to as i64)
        .bind(tenants)
        .execute(pool)
        .await?;
    }
    sqlx::query("ANALYZE jobs").execute(pool).await?;
    Ok(())
}

#[allow(clippy::print_stdout)]
async fn gate(args: &BenchArgs) -> anyhow::Result<()> {
    let stack = stack_for(args, Roles::API_ONLY).await?;
    let pool = stack.pool.clone();

    // Baseline: the same rows, moved by a plain SKIP LOCKED batch update (no admission).
    insert_queued(&pool, args.jobs, &["bench".to_owned()]).await?;
    let begin = Instant::now();
    loop {
        let moved = sqlx::query(
            "WITH picked AS (SELECT id FROM jobs WHERE state = 'queued'
                             ORDER BY class, tenant, priority DESC, deadline, id LIMIT 512 FOR UPDATE SKIP LOCKED)
             UPDATE jobs j SET state = 'admitted', admitted_at = now() FROM picked WHERE j.id = picked.id",
        )
        .execute(&pool)
        .await?
        .rows_affected();
        if moved == 0 {
            break;
        }
    }
    let baseline = begin.elapsed();
    sqlx::query("DELETE FROM jobs").execute(&pool).await?;
    sqlx::query("DELETE FROM job_attempts").execute(&pool).await?;

    insert_queued(&pool, args.jobs, &["bench".to_owned()]).await?;
    let config = std::sync::Arc::new(broker_config(stack.mock_addr, args.concurrency)?);
    let gate = Gate::new(pool.clone(), config, Notifications::default());
    let begin = Instant::now();
    let mut rounds = 0;
    loop {
        let round = gate.run_once(chrono::Utc::now()).await?;
        rounds += 1;
        if round.admitted == 0 {
            break;
        }
    }
    let gated = begin.elapsed();
    let admitted: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'admitted'")
        .fetch_one(&pool)
        .await?;
    stack.stop().await?;
    println!("\n### gate: {} queued jobs admitted (batch 512)\n", args.jobs);
    println!("| case | wall s | admissions/s |");
    println!("|---|---:|---:|");
    println!(
        "| baseline: SKIP LOCKED batch update, no admission | {:.2} | {:.0} |",
        baseline.as_secs_f64(),
        rate(args.jobs, baseline)
    );
    println!(
        "| tollgate gate: 4 buckets per job, weighted fair queuing ({rounds} rounds) | {:.2} | {:.0} |",
        gated.as_secs_f64(),
        rate(args.jobs, gated)
    );
    println!(
        "\nratio gate / baseline: {:.2}",
        baseline.as_secs_f64() / gated.as_secs_f64()
    );
    anyhow::ensure!(
        admitted as usize == args.jobs,
        "only {admitted} of {} admitted",
        args.jobs
    );
    Ok(())
}

/// Interactive probes per second in the steady case, beside the background load.
const PROBES_PER_SEC: u64 = 20;

/// The steady case's load: `total` standard jobs at `rate` per second, each sent at its
/// slot whatever the latency, and [`PROBES_PER_SEC`] interactive probes between them.
/// Returns the failed submissions (background, probes).
async fn offer_steady_load(
    jobs_url: &str,
    rate: u64,
    total: usize,
    probes: usize,
    clients: usize,
) -> anyhow::Result<(usize, usize)> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(clients)
        .build()?;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let probe_interval = Duration::from_secs_f64(1.0 / PROBES_PER_SEC as f64);
    let start = tokio::time::Instant::now();
    let background = futures::stream::iter(0..total)
        .map(|i| {
            let (http, url) = (http.clone(), jobs_url.to_owned());
            let at = start + interval * i as u32;
            async move {
                tokio::time::sleep_until(at).await;
                submit(&http, &url, i).await
            }
        })
        .buffer_unordered(clients)
        .filter(|ok| futures::future::ready(!*ok))
        .count();
    let interactive = futures::stream::iter(0..probes)
        .map(|i| {
            let (http, url) = (http.clone(), jobs_url.to_owned());
            let at = start + probe_interval * i as u32 + probe_interval / 2;
            async move {
                tokio::time::sleep_until(at).await;
                let r = http
                    .post(url)
                    .bearer_auth("tk-bench")
                    .json(&json!({"request": request(i), "class": "interactive"}))
                    .send()
                    .await;
                matches!(r, Ok(resp) if resp.status().as_u16() == 202)
            }
        })
        .buffer_unordered(8)
        .filter(|ok| futures::future::ready(!*ok))
        .count();
    Ok(futures::join!(background, interactive))
}

#[allow(clippy::print_stdout)]
async fn steady(args: &BenchArgs) -> anyhow::Result<()> {
    let stack = stack_for(args, Roles::ALL).await?;
    let jobs_url = format!("{}/v1/jobs", stack.api);
    let total = (args.rate * args.seconds) as usize;
    let probes = (PROBES_PER_SEC * args.seconds) as usize;
    let begin = Instant::now();
    // The load generator runs on a thread and runtime of its own: it shares the machine
    // with the broker, as clients on the same host would, but not the broker's task queue.
    let (per_sec, clients) = (args.rate, args.clients);
    let load = tollgate_api::broker::run_on_own_thread("bench-load", move || async move {
        offer_steady_load(&jobs_url, per_sec, total, probes, clients).await
    })?;
    let (sends, probe_failures) = load.await??;
    let offered = begin.elapsed();
    let expected = (total + probes - sends - probe_failures) as i64;
    wait_finished(&stack.pool, expected).await?;
    let rows: Vec<(String, i64, f64, f64, f64, f64)> = sqlx::query_as(
        "SELECT class::text, count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY a), percentile_cont(0.99) WITHIN GROUP (ORDER BY a),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY d), percentile_cont(0.99) WITHIN GROUP (ORDER BY d)
         FROM (SELECT j.class, (extract(epoch FROM j.admitted_at - j.created_at) * 1000)::float8 AS a,
                      (extract(epoch FROM a.started_at - j.created_at) * 1000)::float8 AS d
               -- The first attempt's record: when its provider request was made.
               FROM jobs j JOIN job_attempts a ON a.job_id = j.id AND a.attempt = 1
               -- Steady state: not the first second, while connections open and caches fill.
               WHERE j.created_at >= (SELECT min(created_at) FROM jobs) + interval '1 second') t
         GROUP BY class ORDER BY class",
    )
    .fetch_all(&stack.pool)
    .await?;
    let admissions: f64 = sqlx::query_scalar(
        "SELECT (count(*) / greatest(extract(epoch FROM max(admitted_at) - min(admitted_at)), 0.001))::float8
         FROM jobs WHERE admitted_at IS NOT NULL",
    )
    .fetch_one(&stack.pool)
    .await?;
    stack.stop().await?;
    println!(
        "\n### steady: {} jobs/s offered for {} s ({} jobs, achieved {:.0}/s) + {PROBES_PER_SEC} interactive probes/s (latencies after the first second)\n",
        args.rate,
        args.seconds,
        total,
        rate(total, offered)
    );
    println!(
        "| class | jobs | enqueue → admitted p50 / p99 ms | enqueue → dispatched (provider request) p50 / p99 ms |"
    );
    println!("|---|---:|---:|---:|");
    for (class, n, a50, a99, d50, d99) in rows {
        println!("| {class} | {n} | {a50:.1} / {a99:.1} | {d50:.1} / {d99:.1} |");
    }
    println!(
        "\nadmissions/s while steady: {admissions:.0}; submit failures: {sends} background, {probe_failures} probes"
    );
    Ok(())
}
