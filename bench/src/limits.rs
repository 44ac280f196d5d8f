//! `tollgate bench --case limits`: limits tollgate was never told. The same mixed workload
//! (prompts of 5–125 words, `max_tokens` 16–215) runs against a mock provider with an RPM
//! and a TPM limit, and no limits in tollgate's config:
//!
//! - `headers`: the provider sends rate-limit headers;
//! - `no headers`: it sends nothing (DeepSeek-like), so only its 429s teach;
//! - `no headers, unpaced` (`no-headers-unpaced`, not run by default): the same with
//!   the pace of a provider that says nothing out of the way (`gate.pace_start_rps` far
//!   above any rate), as tollgate ran before it had one — the pace's baseline;
//! - `halved`: headers, and the provider halves both limits once a third is done; the rate
//!   is measured from 10 s after the change;
//! - `outage`: headers, a 503 outage for the first 20 s and 5 % 529s throughout;
//! - baseline `8 SDK clients`: the workload split over 8 independent clients sending
//!   straight to the provider and retrying as the official OpenAI SDK does (2 retries,
//!   0.5–8 s backoff with its jitter, Retry-After honoured up to 120 s).
//!
//! With `--processes N` the tollgate runs have N broker processes on the one database,
//! each learning from its own calls and sharing what it learns through the database.
//!
//! Efficiency is ideal time ÷ actual time, where the ideal starts with the provider's
//! buckets full and then runs exactly at the binding limit.

use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::Rng;
use serde_json::{Value, json};
use tollgate::config::Config;
use tollgate_mock::{FaultConfig, MockConfig, ProjectLimits};

use super::{BenchArgs, submit_jobs, wait_finished};
use crate::local::LocalStack;
use tollgate_api::broker::Roles;

/// Independent clients of the baseline, and requests each has in flight.
const SDK_CLIENTS: usize = 8;
const SDK_CONCURRENCY: usize = 8;
/// The baseline's row.
const SDK_ROW: &str = "baseline: 8 SDK clients, direct";

/// Job `i` of the workload: its chat request and its `max_tokens`.
fn request(i: usize) -> (Value, u64) {
    let words = 5 + (i * 37) % 120;
    let max_tokens = 16 + (i * 13) % 200;
    let body = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "lorem ipsum ".repeat(words)}],
        "max_tokens": max_tokens
    });
    (body, max_tokens as u64)
}

fn mock_config(args: &BenchArgs, headers: bool, faults: Vec<FaultConfig>) -> anyhow::Result<MockConfig> {
    let mut mock = MockConfig::from_toml_str(&format!(
        r#"
output_tokens = 24
send_rate_limit_headers = {headers}
[[projects]]
name = "limited"
kind = "openai"
keys = ["sk-bench"]
rpm = {}
tpm = {}
"#,
        args.rpm, args.tpm
    ))?;
    mock.faults = faults;
    Ok(mock)
}

/// No limits configured: everything tollgate knows of the provider it learns. Unpaced,
/// a provider that says nothing is sent to as fast as the dispatchers go until it answers
/// 429.
fn broker_config(mock: std::net::SocketAddr, paced: bool) -> anyhow::Result<Config> {
    let pace_start_rps = if paced { 10.0 } else { 1e12 };
    let text = format!(
        r#"
[database]
max_connections = 16
[dispatch]
concurrency = 64
[gate]
# Batch work only: nothing to keep for interactive jobs.
interactive_reserve = 0.0
pace_start_rps = {pace_start_rps:?}
[retry]
max_attempts = 10
base_delay_ms = 500
max_delay_ms = 8000
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://{mock}/v1"
keys = [{{ name = "k", value = "sk-bench" }}]
models = ["gpt-4o-mini"]
[[tenants]]
name = "bench"
api_key = "tk-bench"
"#
    );
    Ok(Config::parse(&text, "bench limits config")?)
}

/// What one drain came to.
struct Drain {
    name: &'static str,
    secs: f64,
    /// Requests the provider counted against its limits, and their tokens (input + max).
    admitted: u64,
    tokens: f64,
    calls: u64,
    rate_limited: u64,
    failed: u64,
    note: String,
}

impl Drain {
    /// The ideal drain: buckets full at the start, then exactly the binding limit.
    fn ideal_secs(&self, rpm: u64, tpm: u64) -> f64 {
        let by_requests = (self.admitted as f64 - rpm as f64).max(0.0) / rpm as f64;
        let by_tokens = (self.tokens - tpm as f64).max(0.0) / tpm as f64;
        60.0 * by_requests.max(by_tokens)
    }
}

#[allow(clippy::print_stdout)]
pub(crate) async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let wants = |scenario: &str| args.scenarios.is_empty() || args.scenarios.iter().any(|s| s == scenario);
    let mut rows = Vec::new();
    let scenario = |name, headers| Scenario {
        name,
        headers,
        faults: Vec::new(),
        halve: false,
        paced: true,
    };
    if wants("headers") {
        rows.push(through_tollgate(args, scenario("tollgate, headers", true)).await?);
    }
    if wants("no-headers") {
        rows.push(through_tollgate(args, scenario("tollgate, no headers", false)).await?);
    }
    // Only when asked for: the pace's baseline.
    if args.scenarios.iter().any(|s| s == "no-headers-unpaced") {
        let unpaced = Scenario {
            paced: false,
            ..scenario("tollgate, no headers, unpaced", false)
        };
        rows.push(through_tollgate(args, unpaced).await?);
    }
    if wants("halved") {
        let halved = Scenario {
            halve: true,
            ..scenario("tollgate, limits halved", true)
        };
        rows.push(through_tollgate(args, halved).await?);
    }
    let faults = vec![
        FaultConfig {
            project: None,
            start_ms: 0,
            duration_ms: 20_000,
            status: 503,
            probability: 1.0,
        },
        FaultConfig {
            project: None,
            start_ms: 0,
            duration_ms: 0,
            status: 529,
            probability: 0.05,
        },
    ];
    if wants("outage") {
        let outage = Scenario {
            faults,
            ..scenario("tollgate, 20 s outage + 5% 529", true)
        };
        rows.push(through_tollgate(args, outage).await?);
    }
    if wants("sdk") {
        rows.push(sdk_clients(args).await?);
    }

    println!(
        "\n### limits: {} mixed jobs, provider limits rpm {} / tpm {}, none configured; {} broker process(es)\n",
        args.limit_jobs,
        args.rpm,
        args.tpm,
        args.processes.max(1)
    );
    println!("| run | drain s | ideal s | efficiency | provider calls | 429s | 429 share | failed | note |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in &rows {
        let ideal = r.ideal_secs(args.rpm, args.tpm);
        println!(
            "| {} | {:.1} | {:.1} | {:.0}% | {} | {} | {:.1}% | {} | {} |",
            r.name,
            r.secs,
            ideal,
            100.0 * ideal / r.secs.max(1e-9),
            r.calls,
            r.rate_limited,
            100.0 * r.rate_limited as f64 / r.calls.max(1) as f64,
            r.failed,
            r.note
        );
    }
    let ours = rows.iter().find(|r| r.name == "tollgate, headers");
    let sdk = rows.iter().find(|r| r.name == SDK_ROW);
    if let (Some(ours), Some(sdk)) = (ours, sdk) {
        println!(
            "\nratio drain time, 8 SDK clients / tollgate (headers): {:.2}; 429s {} vs {}",
            sdk.secs / ours.secs.max(1e-9),
            sdk.rate_limited,
            ours.rate_limited
        );
    }
    Ok(())
}

/// One run through tollgate.
struct Scenario {
    name: &'static str,
    /// Whether the provider sends rate-limit headers.
    headers: bool,
    faults: Vec<FaultConfig>,
    /// Halve the provider's limits a third of the way ([`halve_and_measure`]).
    halve: bool,
    /// Pace a provider that says nothing, as tollgate does by default.
    paced: bool,
}

async fn through_tollgate(args: &BenchArgs, run: Scenario) -> anyhow::Result<Drain> {
    let Scenario {
        name,
        headers,
        faults,
        halve,
        paced,
    } = run;
    let stack = LocalStack::start(
        "bench_limits",
        args.data_dir.clone(),
        mock_config(args, headers, faults)?,
        Roles::ALL,
        |mock| broker_config(mock, paced),
    )
    .await?;
    let mut peers = Vec::new();
    for _ in 1..args.processes.max(1) {
        peers.push(stack.start_peer(Roles::ALL).await?);
    }
    let begin = Instant::now();
    submit_jobs(&stack.api, args.limit_jobs, |i| {
        let mut body = request(i).0;
        body["model"] = json!("oai/gpt-4o-mini");
        json!({"request": body, "class": "batch"})
    })
    .await?;
    let expected = args.limit_jobs as i64;
    let mut note = String::new();
    if halve {
        note = halve_and_measure(args, &stack, expected).await?;
    }
    let (_, failed) = wait_finished(&stack.pool, expected).await?;
    let secs = begin.elapsed().as_secs_f64();
    let (tokens, max_attempt, late): (Option<f64>, Option<i32>, i64) = sqlx::query_as(
        "SELECT sum((usage->>'input_tokens')::float8 + (request->>'max_tokens')::float8),
                max(attempt), count(*) FILTER (WHERE finished_at > deadline)
         FROM jobs WHERE state = 'succeeded'",
    )
    .fetch_one(&stack.pool)
    .await?;
    // When the 429s came: before the first one taught anything, the calls in flight meet
    // the provider's limit together.
    let (first_10s, after_60s): (i64, i64) = sqlx::query_as(
        "WITH start AS (SELECT min(started_at) AS at FROM job_attempts)
         SELECT count(*) FILTER (WHERE a.started_at < s.at + interval '10 seconds'),
                count(*) FILTER (WHERE a.started_at >= s.at + interval '60 seconds')
         FROM job_attempts a, start s WHERE a.status = 429",
    )
    .fetch_one(&stack.pool)
    .await?;
    let stats = stack.mock.stats();
    let admitted = stats.projects.values().map(|p| p.requests_admitted).sum();
    if note.is_empty() {
        note = format!(
            "most attempts of a job {}; finished late {late}; 429s in the first 10 s {first_10s}, after 60 s {after_60s}",
            max_attempt.unwrap_or(0)
        );
    }
    for peer in peers {
        peer.shutdown().await;
    }
    stack.stop().await?;
    Ok(Drain {
        name,
        secs,
        admitted,
        tokens: tokens.unwrap_or(0.0),
        calls: stats.requests,
        rate_limited: stats.rate_limited_429,
        failed: failed as u64,
        note,
    })
}

/// Halves the provider's limits once a third of the jobs succeeded; returns how the
/// rest ran: the binding limit's use from 10 s after the change, and 429s after that.
async fn halve_and_measure(args: &BenchArgs, stack: &LocalStack, expected: i64) -> anyhow::Result<String> {
    loop {
        let (done,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs WHERE state = 'succeeded'")
            .fetch_one(&stack.pool)
            .await?;
        if done * 3 >= expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (rpm, tpm) = (args.rpm / 2, args.tpm / 2);
    stack.mock.set_limits(
        "limited",
        ProjectLimits {
            rpm,
            tpm,
            ..ProjectLimits::default()
        },
    );
    let changed = chrono::Utc::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let settled = stack.mock.stats().rate_limited_429;
    let from = chrono::Utc::now();
    wait_finished(&stack.pool, expected).await?;
    let until = chrono::Utc::now();
    let late_429s = stack.mock.stats().rate_limited_429 - settled;
    let (n, tokens): (i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*), sum((usage->>'input_tokens')::float8 + (request->>'max_tokens')::float8)
         FROM jobs WHERE state = 'succeeded' AND finished_at >= $1 AND finished_at <= $2",
    )
    .bind(from)
    .bind(until)
    .fetch_one(&stack.pool)
    .await?;
    let window = (until - from).num_milliseconds().max(1) as f64 / 60_000.0;
    let used = (n as f64 / (rpm as f64 * window)).max(tokens.unwrap_or(0.0) / (tpm as f64 * window));
    let first_429s = stack.mock.stats().rate_limited_429 - late_429s;
    Ok(format!(
        "halved at {}; from 10 s after: {:.0}% of the new binding limit, {late_429s} 429s ({first_429s} before)",
        changed.format("%H:%M:%S"),
        100.0 * used
    ))
}

/// The baseline: 8 clients, each with its share of the workload, sending straight to the
/// provider and retrying as the OpenAI SDK does.
async fn sdk_clients(args: &BenchArgs) -> anyhow::Result<Drain> {
    let stack = LocalStack::start(
        "bench_limits_sdk",
        args.data_dir.clone(),
        mock_config(args, true, Vec::new())?,
        Roles::API_ONLY,
        |mock| broker_config(mock, true),
    )
    .await?;
    let url = format!("http://{}/v1/chat/completions", stack.mock_addr);
    let begin = Instant::now();
    let clients = (0..SDK_CLIENTS).map(|c| {
        let url = url.clone();
        let http = reqwest::Client::new();
        let mine: Vec<usize> = (c..args.limit_jobs).step_by(SDK_CLIENTS).collect();
        async move {
            futures::stream::iter(mine)
                .map(|i| sdk_call(&http, &url, request(i)))
                .buffer_unordered(SDK_CONCURRENCY)
                .collect::<Vec<(bool, f64)>>()
                .await
        }
    });
    let results: Vec<(bool, f64)> = futures::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
        .collect();
    let secs = begin.elapsed().as_secs_f64();
    let stats = stack.mock.stats();
    let lost = results.iter().filter(|r| !r.0).count() as u64;
    let tokens = results.iter().filter(|r| r.0).map(|r| r.1).sum();
    stack.stop().await?;
    Ok(Drain {
        name: SDK_ROW,
        secs,
        admitted: stats.projects.values().map(|p| p.requests_admitted).sum(),
        tokens,
        calls: stats.requests,
        rate_limited: stats.rate_limited_429,
        failed: lost,
        note: format!("{lost} requests lost after the SDK's 2 retries"),
    })
}

/// One request as the OpenAI SDK sends it: up to 2 retries on 408/409/429/5xx and
/// connection errors; delay = the server's hint when 0 < hint ≤ 120 s, else
/// min(0.5·2ⁿ, 8) s × (1 − 0.25·U). Returns success and the tokens it was charged.
async fn sdk_call(http: &reqwest::Client, url: &str, (body, max_tokens): (Value, u64)) -> (bool, f64) {
    for retry in 0..=2u32 {
        let hint = match http.post(url).bearer_auth("sk-bench").json(&body).send().await {
            Ok(r) if r.status().is_success() => {
                let usage: Option<Value> = r.json().await.ok();
                let input = usage
                    .and_then(|u| u["usage"]["prompt_tokens"].as_f64())
                    .unwrap_or(0.0);
                return (true, input + max_tokens as f64);
            }
            Ok(r) => {
                let status = r.status().as_u16();
                if !matches!(status, 408 | 409 | 429 | 500..) {
                    return (false, 0.0);
                }
                tollgate::ratelimit::retry_after(r.headers(), chrono::Utc::now())
            }
            Err(_) => None,
        };
        if retry == 2 {
            break;
        }
        let delay = match hint {
            Some(h) if h > Duration::ZERO && h <= Duration::from_secs(120) => h,
            _ => {
                let base = (0.5 * 2f64.powi(retry as i32)).min(8.0);
                Duration::from_secs_f64(base * (1.0 - 0.25 * rand::rng().random::<f64>()))
            }
        };
        tokio::time::sleep(delay).await;
    }
    (false, 0.0)
}
