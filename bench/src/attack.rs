//! `tollgate bench --case attack`: a well-behaved tenant's API latency while a second
//! tenant and an anonymous client attack the same process, beside the same load alone.
//!
//! The well-behaved tenant (`good`, from 127.0.0.1) sends [`GOOD_RATE`] requests a second
//! on a fixed schedule (each at its slot, whatever the latency of the others), a quarter
//! each: `POST /v1/jobs`, `GET /v1/jobs/{id}` of its latest job, `POST
//! /v1/chat/completions` (a synchronous call through the queue and the mock provider) and
//! `GET /v1/status`. Its latencies are measured at the client, connection included.
//!
//! The attack, from other loopback addresses (the per-source throttle sees them as other
//! hosts, as it would on a network):
//!
//! - stalled uploads: [`STALLED_UPLOADS`] connections of the `evil` tenant, each sending a
//!   `POST /v1/files` head and the first lines of a large multipart body, then nothing;
//!   reopened as soon as the server cuts one off (`server.body_idle_timeout_secs`);
//! - slow headers (slowloris): [`SLOW_HEADER_CONNECTIONS`] anonymous connections sending
//!   one header line a second, never finishing; reopened when cut off
//!   (`server.header_timeout_secs`);
//! - key guessing: [`GUESSERS`] anonymous loops sending requests with random keys as fast
//!   as they are answered;
//! - bulk floods: the `evil` tenant sending `POST /v1/jobs/bulk` of [`BULK_FLOOD_JOBS`]
//!   jobs, [`BULK_FLOODS_IN_FLIGHT`] at once, for the whole run. Its queue is capped
//!   (`max_queued_per_tenant`) and its API rate is its own ([`EVIL_API_RATE`], a bulk
//!   counting each of its jobs), as an operator sharing a broker sets them; its admissions
//!   are limited by its own rpm ([`EVIL_RPM`]). The flood is refused `api_rate_limited`
//!   before its bodies are read, and `queue_full` once its queue is full. The stalled
//!   uploads are the same tenant's, so while the flood has its rate in debt they are
//!   refused too.
//!
//! Each run starts on a fresh database; the attackers start [`WARM_UP`] before the
//! well-behaved load so that it meets them in place.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;
use tollgate::config::Config;
use tollgate_api::broker::Roles;

use crate::local::LocalStack;
use crate::{BenchArgs, mock_config, request, unbound_provider};

/// Requests a second from the well-behaved tenant, all kinds together.
const GOOD_RATE: u64 = 100;
const STALLED_UPLOADS: usize = 64;
const SLOW_HEADER_CONNECTIONS: usize = 1_000;
const GUESSERS: usize = 16;
const BULK_FLOOD_JOBS: usize = 2_000;
const BULK_FLOODS_IN_FLIGHT: usize = 4;
/// The `evil` tenant's API rate (requests a second, a bulk counting each job), its burst
/// one bulk of [`BULK_FLOOD_JOBS`].
const EVIL_API_RATE: u64 = 200;
/// The `evil` tenant's requests a minute to providers: 10 jobs a second, a neighbour's
/// ordinary share; the flood is what it sends beyond that.
const EVIL_RPM: u64 = 600;
/// The `evil` tenant's standard-class queue cap.
const EVIL_QUEUE_CAP: u64 = 4_000;
/// How long the attackers run before the measured load starts.
const WARM_UP: Duration = Duration::from_secs(3);

const GOOD_KEY: &str = "tk-good-tenant";
const EVIL_KEY: &str = "tk-evil-tenant";

/// Where each party's connections come from.
const GOOD_SOURCE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const EVIL_SOURCE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const SLOWLORIS_SOURCE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
const GUESSER_SOURCE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 4);

fn config(mock: SocketAddr, concurrency: usize) -> anyhow::Result<Config> {
    let text = format!(
        r#"
[database]
max_connections = 32
[dispatch]
concurrency = {concurrency}
[classes.standard]
default_deadline_secs = 3600
max_queued_per_tenant = {EVIL_QUEUE_CAP}
{}
[[tenants]]
name = "good"
api_key = "{GOOD_KEY}"
rpm = 100000000
tpm = 100000000000
[[tenants]]
name = "evil"
api_key = "{EVIL_KEY}"
api_rate_per_sec = {EVIL_API_RATE}
api_burst = {BULK_FLOOD_JOBS}
rpm = {EVIL_RPM}
tpm = 100000000000
"#,
        unbound_provider(mock)
    );
    Ok(Config::parse(&text, "attack bench config")?)
}

/// One kind of attack (`--attackers`, all by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Attacker {
    StalledUploads,
    SlowHeaders,
    KeyGuessing,
    BulkFloods,
}

impl Attacker {
    pub const ALL: [Attacker; 4] = [
        Attacker::StalledUploads,
        Attacker::SlowHeaders,
        Attacker::KeyGuessing,
        Attacker::BulkFloods,
    ];
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Submit,
    Poll,
    SyncChat,
    Status,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Submit, Kind::Poll, Kind::SyncChat, Kind::Status];

    fn label(self) -> &'static str {
        match self {
            Kind::Submit => "`POST /v1/jobs`",
            Kind::Poll => "`GET /v1/jobs/{id}`",
            Kind::SyncChat => "`POST /v1/chat/completions` (sync, through the queue)",
            Kind::Status => "`GET /v1/status`",
        }
    }
}

/// One well-behaved request: what it was, how long it took, whether it succeeded.
struct Sample {
    kind: Kind,
    /// The second of the run it was sent in.
    second: usize,
    latency: Duration,
    /// The answer's status; None when no answer came (connection refused, reset, timed out).
    status: Option<u16>,
    ok: bool,
}

/// What the attackers did and what they got.
#[derive(Default)]
struct AttackCounts {
    upload_connections: AtomicU64,
    uploads_cut_off: AtomicU64,
    slow_connections: AtomicU64,
    slow_cut_off: AtomicU64,
    guesses: AtomicU64,
    guesses_unauthorized: AtomicU64,
    guesses_throttled: AtomicU64,
    bulk_requests: AtomicU64,
    bulk_accepted_jobs: AtomicU64,
    bulk_queue_full: AtomicU64,
    bulk_rate_limited: AtomicU64,
    /// Answered otherwise, or not answered (a connection closed before its body was read).
    bulk_other: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn read(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

struct RunResult {
    samples: Vec<Sample>,
    attack: Option<Arc<AttackCounts>>,
    /// The good tenant's jobs: enqueue → provider request, p50 / p99 ms.
    dispatch: (f64, f64),
    /// CPU the attacking clients used (their thread's user + system time).
    attackers_cpu: Option<Duration>,
}

#[allow(clippy::print_stdout)] // the report is the command's output
pub(crate) async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let quiet = one_run(args, &[]).await?;
    let attacked = one_run(args, &args.attackers).await?;
    println!(
        "\n### attack: a well-behaved tenant's API latency, alone and under attack ({GOOD_RATE} requests/s for {} s each)\n",
        args.seconds
    );
    println!("| request | run | requests | p50 ms | p99 ms | max ms | failed | p99 ÷ alone |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for kind in Kind::ALL {
        let alone = latencies(&quiet.samples, kind);
        let under = latencies(&attacked.samples, kind);
        for (run, (sorted, failed)) in [("alone", &alone), ("under attack", &under)] {
            println!(
                "| {} | {run} | {} | {:.1} | {:.1} | {:.1} | {failed} | {:.2} |",
                kind.label(),
                sorted.len(),
                ms_at(sorted, 0.5),
                ms_at(sorted, 0.99),
                ms_at(sorted, 1.0),
                ms_at(sorted, 0.99) / ms_at(&alone.0, 0.99).max(1e-9),
            );
        }
    }
    println!(
        "\nThe good tenant's jobs, enqueue → provider request p50 / p99 ms: alone {:.1} / {:.1}, under attack {:.1} / {:.1}",
        quiet.dispatch.0, quiet.dispatch.1, attacked.dispatch.0, attacked.dispatch.1
    );
    for (run, result) in [("alone", &quiet), ("under attack", &attacked)] {
        println!(
            "\nThe slowest request of each second, {run} (ms): {}",
            slowest_each_second(&result.samples)
        );
    }
    if let Some(cpu) = attacked.attackers_cpu {
        println!(
            "\nThe attacking clients used {:.1} s of CPU over the {:.0} s they ran ({}), on this machine's {} cores.",
            cpu.as_secs_f64(),
            (WARM_UP + Duration::from_secs(args.seconds)).as_secs_f64(),
            args.attacker_nice
                .map_or_else(|| "at normal priority".to_owned(), |n| format!("at niceness {n}")),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
        );
    }
    if let Some(a) = &attacked.attack {
        println!("\n| attacker | did | got |");
        println!("|---|---|---|");
        println!(
            "| stalled uploads (`evil`, {STALLED_UPLOADS} at once) | {} connections | {} cut off by the server |",
            read(&a.upload_connections),
            read(&a.uploads_cut_off)
        );
        println!(
            "| slow headers (anonymous, {SLOW_HEADER_CONNECTIONS} at once) | {} connections | {} cut off by the server |",
            read(&a.slow_connections),
            read(&a.slow_cut_off)
        );
        println!(
            "| key guessing (anonymous, {GUESSERS} loops) | {} guesses | {} answered 401, {} throttled 429 |",
            read(&a.guesses),
            read(&a.guesses_unauthorized),
            read(&a.guesses_throttled)
        );
        println!(
            "| bulk floods (`evil`, {BULK_FLOODS_IN_FLIGHT} × {BULK_FLOOD_JOBS} jobs in flight) | {} requests | {} jobs accepted; refused: {} `queue_full`, {} `api_rate_limited`, {} otherwise or unanswered |",
            read(&a.bulk_requests),
            read(&a.bulk_accepted_jobs),
            read(&a.bulk_queue_full),
            read(&a.bulk_rate_limited),
            read(&a.bulk_other)
        );
    }
    Ok(())
}

/// The longest latency of the requests sent in each second, in order: where in the run
/// the tail comes from.
fn slowest_each_second(samples: &[Sample]) -> String {
    let seconds = samples.iter().map(|s| s.second + 1).max().unwrap_or(0);
    let mut slowest = vec![Duration::ZERO; seconds];
    for s in samples {
        slowest[s.second] = slowest[s.second].max(s.latency);
    }
    slowest
        .iter()
        .map(|d| format!("{:.0}", d.as_secs_f64() * 1e3))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The latencies of `kind`'s successful requests, sorted, and its failures by status
/// (`none`: no answer), e.g. `3 (503 ×2, none ×1)`.
fn latencies(samples: &[Sample], kind: Kind) -> (Vec<Duration>, String) {
    let mut sorted: Vec<Duration> = samples
        .iter()
        .filter(|s| s.kind == kind && s.ok)
        .map(|s| s.latency)
        .collect();
    sorted.sort();
    let mut failures = std::collections::BTreeMap::<String, usize>::new();
    for s in samples.iter().filter(|s| s.kind == kind && !s.ok) {
        *failures
            .entry(s.status.map_or_else(|| "none".to_owned(), |c| c.to_string()))
            .or_default() += 1;
    }
    let total: usize = failures.values().sum();
    let failed = if total == 0 {
        "0".to_owned()
    } else {
        let by_status: Vec<String> = failures.iter().map(|(c, n)| format!("{c} ×{n}")).collect();
        format!("{total} ({})", by_status.join(", "))
    };
    (sorted, failed)
}

fn ms_at(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

async fn one_run(args: &BenchArgs, attackers: &[Attacker]) -> anyhow::Result<RunResult> {
    let (attack, attackers) = (!attackers.is_empty(), attackers.to_vec());
    let concurrency = args.concurrency;
    let stack = LocalStack::start(
        "attack",
        args.data_dir.clone(),
        mock_config(),
        Roles::ALL,
        |mock| config(mock, concurrency),
    )
    .await?;
    let target: SocketAddr = stack.api.trim_start_matches("http://").parse()?;
    let stop = CancellationToken::new();
    let counts = Arc::new(AttackCounts::default());
    let (seconds, nice) = (args.seconds, args.attacker_nice);
    // The attackers and the well-behaved tenant each run on a thread and runtime of their
    // own: they share the machine with the broker, as clients on the same host would, but
    // not its task queue, and the tenant's latencies are not the attackers' queueing.
    let attack_run = (!attackers.is_empty()).then(|| {
        let (api, stop, counts) = (stack.api.clone(), stop.clone(), counts.clone());
        tollgate_api::broker::run_on_own_thread("bench-attackers", move || async move {
            if let Some(nice) = nice {
                renice_this_thread(nice)?;
            }
            let tasks = start_attackers(&attackers, &api, target, stop.clone(), counts)?;
            tasks.close();
            tasks.wait().await;
            // This thread is every attacker: its CPU is what attacking cost the machine.
            anyhow::Ok(crate::process_ticks("thread-self", false).map(crate::ticks))
        })
    });
    let api = stack.api.clone();
    let load = tollgate_api::broker::run_on_own_thread("bench-good-tenant", move || async move {
        tokio::time::sleep(WARM_UP).await;
        good_tenant(&api, seconds).await
    })?;
    let samples = load.await?;
    stop.cancel();
    let attackers_cpu = match attack_run {
        Some(attack_run) => attack_run?.await??,
        None => None,
    };
    let samples = samples?;
    let dispatch: (f64, f64) = sqlx::query_as(
        "SELECT coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY d), 0)::float8,
                coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY d), 0)::float8
         FROM (SELECT (extract(epoch FROM a.started_at - j.created_at) * 1000)::float8 AS d
               FROM jobs j JOIN job_attempts a ON a.job_id = j.id AND a.attempt = 1
               WHERE j.tenant = 'good') t",
    )
    .fetch_one(&stack.pool)
    .await?;
    stack.stop().await?;
    Ok(RunResult {
        samples,
        attack: attack.then_some(counts),
        attackers_cpu,
        dispatch,
    })
}

fn client_from(source: Ipv4Addr, connections: usize) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .local_address(IpAddr::V4(source))
        .pool_max_idle_per_host(connections)
        .timeout(Duration::from_secs(60))
        .build()?)
}

/// The well-behaved tenant's load: one request every `1 / GOOD_RATE` s, cycling through
/// the kinds, for `seconds`.
async fn good_tenant(api: &str, seconds: u64) -> anyhow::Result<Vec<Sample>> {
    let http = client_from(GOOD_SOURCE, 64)?;
    // A job to poll from the first request on.
    let first = http
        .post(format!("{api}/v1/jobs"))
        .bearer_auth(GOOD_KEY)
        .json(&json!({"request": request(0)}))
        .send()
        .await?
        .json::<Value>()
        .await?;
    let latest = Arc::new(std::sync::Mutex::new(
        first["id"].as_str().unwrap_or_default().to_owned(),
    ));
    let interval = Duration::from_secs_f64(1.0 / GOOD_RATE as f64);
    let total = (GOOD_RATE * seconds) as usize;
    let start = tokio::time::Instant::now();
    let samples = futures::stream::iter(0..total)
        .map(|i| {
            let (http, api, latest) = (http.clone(), api.to_owned(), latest.clone());
            let at = start + interval * i as u32;
            async move {
                tokio::time::sleep_until(at).await;
                let kind = Kind::ALL[i % Kind::ALL.len()];
                let begin = Instant::now();
                let sent = match kind {
                    Kind::Submit => http
                        .post(format!("{api}/v1/jobs"))
                        .bearer_auth(GOOD_KEY)
                        .json(&json!({"request": request(i)})),
                    Kind::Poll => {
                        let id = latest.lock().map(|id| id.clone()).unwrap_or_default();
                        http.get(format!("{api}/v1/jobs/{id}")).bearer_auth(GOOD_KEY)
                    }
                    Kind::SyncChat => http
                        .post(format!("{api}/v1/chat/completions"))
                        .bearer_auth(GOOD_KEY)
                        .json(&request(i)),
                    Kind::Status => http.get(format!("{api}/v1/status")).bearer_auth(GOOD_KEY),
                }
                .send()
                .await;
                let status = sent.as_ref().ok().map(|r| r.status().as_u16());
                let ok = match sent {
                    Ok(response) if response.status().is_success() => match response.json::<Value>().await {
                        Ok(body) => {
                            if kind == Kind::Submit
                                && let (Some(id), Ok(mut latest)) = (body["id"].as_str(), latest.lock())
                            {
                                *latest = id.to_owned();
                            }
                            true
                        }
                        Err(_) => false,
                    },
                    _ => false,
                };
                Sample {
                    kind,
                    second: i / GOOD_RATE as usize,
                    latency: begin.elapsed(),
                    status,
                    ok,
                }
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    Ok(samples)
}

/// Starts every attacker; they run until `stop`.
fn start_attackers(
    attackers: &[Attacker],
    api: &str,
    target: SocketAddr,
    stop: CancellationToken,
    counts: Arc<AttackCounts>,
) -> anyhow::Result<tokio_util::task::TaskTracker> {
    let tasks = tokio_util::task::TaskTracker::new();
    for attacker in attackers {
        match attacker {
            Attacker::StalledUploads => {
                for _ in 0..STALLED_UPLOADS {
                    tasks.spawn(stalled_upload(target, stop.clone(), counts.clone()));
                }
            }
            Attacker::SlowHeaders => {
                for _ in 0..SLOW_HEADER_CONNECTIONS {
                    tasks.spawn(slow_headers(target, stop.clone(), counts.clone()));
                }
            }
            Attacker::KeyGuessing => {
                let guessing = client_from(GUESSER_SOURCE, GUESSERS)?;
                for _ in 0..GUESSERS {
                    tasks.spawn(guess_keys(
                        guessing.clone(),
                        api.to_owned(),
                        stop.clone(),
                        counts.clone(),
                    ));
                }
            }
            Attacker::BulkFloods => {
                let flooding = client_from(EVIL_SOURCE, BULK_FLOODS_IN_FLIGHT)?;
                for _ in 0..BULK_FLOODS_IN_FLIGHT {
                    tasks.spawn(bulk_flood(
                        flooding.clone(),
                        api.to_owned(),
                        stop.clone(),
                        counts.clone(),
                    ));
                }
            }
        }
    }
    Ok(tasks)
}

/// Lowers this thread's scheduling priority (`renice`, which takes a thread id on Linux),
/// so that the attacking clients take only CPU the broker leaves: as if they ran on
/// another host, while what they cost the broker stays measured.
fn renice_this_thread(nice: i32) -> anyhow::Result<()> {
    let link = std::fs::read_link("/proc/thread-self")?;
    let tid = link
        .file_name()
        .and_then(|t| t.to_str())
        .ok_or_else(|| anyhow::anyhow!("no thread id in {}", link.display()))?
        .to_owned();
    let status = std::process::Command::new("renice")
        .args(["-n", &nice.to_string(), "-p", &tid])
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "renice -n {nice} -p {tid} failed");
    Ok(())
}

async fn connect_from(source: Ipv4Addr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(IpAddr::V4(source), 0))?;
    socket.connect(target).await
}

/// Waits until the server closes `stream` (true) or `stop` (false), discarding what it sends.
async fn until_closed(stream: &mut (impl AsyncRead + Unpin), stop: &CancellationToken) -> bool {
    let mut sink = [0u8; 4096];
    loop {
        tokio::select! {
            () = stop.cancelled() => return false,
            read = stream.read(&mut sink) => match read {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            },
        }
    }
}

/// Pauses after a refused connection, so a full server is not spun against.
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);

async fn stalled_upload(target: SocketAddr, stop: CancellationToken, counts: Arc<AttackCounts>) {
    let boundary = "attack-boundary-7d1e";
    let opening = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"stalled.jsonl\"\r\n\
         Content-Type: application/jsonl\r\n\r\n{}",
        r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"oai/gpt-4o-mini","messages":[{"role":"user","content":"stalled"}]}}"#.to_owned() + "\n"
    );
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nHost: tollgate\r\nAuthorization: Bearer {EVIL_KEY}\r\n\
         Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\n\r\n",
        100 * 1024 * 1024
    );
    while !stop.is_cancelled() {
        let Ok(mut stream) = connect_from(EVIL_SOURCE, target).await else {
            tokio::time::sleep(RECONNECT_PAUSE).await;
            continue;
        };
        bump(&counts.upload_connections);
        if stream.write_all(head.as_bytes()).await.is_err()
            || stream.write_all(opening.as_bytes()).await.is_err()
        {
            continue;
        }
        if until_closed(&mut stream, &stop).await {
            bump(&counts.uploads_cut_off);
        }
    }
}

async fn slow_headers(target: SocketAddr, stop: CancellationToken, counts: Arc<AttackCounts>) {
    while !stop.is_cancelled() {
        let Ok(mut stream) = connect_from(SLOWLORIS_SOURCE, target).await else {
            tokio::time::sleep(RECONNECT_PAUSE).await;
            continue;
        };
        bump(&counts.slow_connections);
        if stream
            .write_all(b"POST /v1/jobs HTTP/1.1\r\nHost: tollgate\r\n")
            .await
            .is_err()
        {
            continue;
        }
        let (mut from_server, mut to_server) = stream.split();
        let mut beat = tokio::time::interval(Duration::from_secs(1));
        let cut_off = loop {
            tokio::select! {
                () = stop.cancelled() => break false,
                _ = beat.tick() => {
                    if to_server.write_all(b"X-Slow: a\r\n").await.is_err() {
                        break true;
                    }
                }
                closed = until_closed(&mut from_server, &stop) => break closed,
            }
        };
        if cut_off {
            bump(&counts.slow_cut_off);
        }
    }
}

async fn guess_keys(http: reqwest::Client, api: String, stop: CancellationToken, counts: Arc<AttackCounts>) {
    while !stop.is_cancelled() {
        let guess = format!("tk-{}", uuid::Uuid::now_v7().simple());
        let sent = tokio::select! {
            () = stop.cancelled() => break,
            sent = http.get(format!("{api}/v1/jobs")).bearer_auth(guess).send() => sent,
        };
        bump(&counts.guesses);
        match sent.map(|r| r.status().as_u16()) {
            Ok(401) => bump(&counts.guesses_unauthorized),
            Ok(429) => bump(&counts.guesses_throttled),
            _ => {}
        }
    }
}

async fn bulk_flood(http: reqwest::Client, api: String, stop: CancellationToken, counts: Arc<AttackCounts>) {
    let jobs: Vec<Value> = (0..BULK_FLOOD_JOBS)
        .map(|i| json!({"request": request(i)}))
        .collect();
    let body = serde_json::to_vec(&json!({ "jobs": jobs })).unwrap_or_default();
    while !stop.is_cancelled() {
        let sent = tokio::select! {
            () = stop.cancelled() => break,
            sent = http
                .post(format!("{api}/v1/jobs/bulk"))
                .bearer_auth(EVIL_KEY)
                .header("content-type", "application/json")
                .body(body.clone())
                .send() => sent,
        };
        bump(&counts.bulk_requests);
        let Ok(answer) = sent else {
            bump(&counts.bulk_other);
            tokio::time::sleep(RECONNECT_PAUSE).await;
            continue;
        };
        if answer.status().as_u16() == 202 {
            counts
                .bulk_accepted_jobs
                .fetch_add(BULK_FLOOD_JOBS as u64, Ordering::Relaxed);
            continue;
        }
        let code = answer
            .json::<Value>()
            .await
            .ok()
            .and_then(|body| body["error"]["code"].as_str().map(str::to_owned));
        bump(match code.as_deref() {
            Some("queue_full") => &counts.bulk_queue_full,
            Some("api_rate_limited") => &counts.bulk_rate_limited,
            _ => &counts.bulk_other,
        });
    }
}
