//! `tollgate bench`: end-to-end throughput against the mock provider at zero latency and
//! without limits, side by side with its baseline in the same run: the same requests sent
//! straight to the mock by a plain HTTP client with the same concurrency (what an app does
//! without a broker). The ratio is what the broker's durability costs.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use tollgate::config::Config;
use tollgate_workers::mock_provider::MockConfig;

use crate::local::LocalStack;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Jobs per case.
    #[arg(long, default_value_t = 20_000)]
    pub jobs: usize,
    /// Concurrent client requests (submissions, and the baseline's calls).
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Provider calls in flight in the broker (`dispatch.concurrency`).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Where the embedded PostgreSQL keeps its data (ignored with DATABASE_URL).
    #[arg(long, default_value = ".tollgate/pg")]
    pub data_dir: std::path::PathBuf,
}

fn mock_config() -> MockConfig {
    MockConfig::from_toml_str(
        r#"
output_tokens = 8
[[projects]]
name = "bench"
kind = "openai"
keys = ["sk-bench"]
"#,
    )
    .unwrap_or_default()
}

fn broker_config(mock: std::net::SocketAddr, concurrency: usize) -> anyhow::Result<Config> {
    let text = format!(
        r#"
[server]
max_wait_secs = 60
[database]
max_connections = 32
[dispatch]
concurrency = {concurrency}
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
    Ok(Config::parse(&text, "bench config")?)
}

fn request(i: usize) -> Value {
    json!({
        "model": "oai/gpt-4o-mini",
        "messages": [{"role": "user", "content": format!("benchmark request {i}")}],
        "max_tokens": 8
    })
}

/// Runs both cases and prints absolute figures and the ratio.
#[allow(clippy::print_stdout)] // the report is the command's output
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let concurrency = args.concurrency;
    let stack = LocalStack::start("bench", args.data_dir.clone(), mock_config(), |addr| {
        broker_config(addr, concurrency)
    })
    .await?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.clients)
        .build()?;

    // Baseline: straight to the mock.
    let direct_url = format!("http://{}/v1/chat/completions", stack.mock_addr);
    let begin = Instant::now();
    let direct_failures = futures::stream::iter(0..args.jobs)
        .map(|i| {
            let http = http.clone();
            let url = direct_url.clone();
            async move {
                let body =
                    json!({"model": "gpt-4o-mini", "messages": request(i)["messages"], "max_tokens": 8});
                let r = http.post(url).bearer_auth("sk-bench").json(&body).send().await;
                match r {
                    Ok(resp) => !resp.status().is_success() || resp.bytes().await.is_err(),
                    Err(_) => true,
                }
            }
        })
        .buffer_unordered(args.clients)
        .filter(|failed| futures::future::ready(*failed))
        .count()
        .await;
    let direct = begin.elapsed();

    // tollgate: submit every job over HTTP, then wait for the last one to finish.
    let jobs_url = format!("{}/v1/jobs", stack.api);
    let begin = Instant::now();
    let submit_failures = futures::stream::iter(0..args.jobs)
        .map(|i| {
            let http = http.clone();
            let url = jobs_url.clone();
            async move {
                let r = http
                    .post(url)
                    .bearer_auth("tk-bench")
                    .json(&json!({"request": request(i)}))
                    .send()
                    .await;
                !matches!(r, Ok(resp) if resp.status().as_u16() == 202)
            }
        })
        .buffer_unordered(args.clients)
        .filter(|failed| futures::future::ready(*failed))
        .count()
        .await;
    let submitted = begin.elapsed();
    let expected = (args.jobs - submit_failures) as i64;
    let (succeeded, failed) = loop {
        let (done, failed): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state = 'succeeded'), count(*) FILTER (WHERE state IN ('failed', 'cancelled')) FROM jobs",
        )
        .fetch_one(&stack.pool)
        .await?;
        if done + failed >= expected {
            break (done, failed);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let through = begin.elapsed();
    stack.stop().await?;

    let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let direct_rate = rate(args.jobs, direct);
    let e2e_rate = rate(args.jobs, through);
    println!(
        "tollgate bench: {} jobs, {} clients, dispatch.concurrency {}",
        args.jobs, args.clients, concurrency
    );
    println!("| case | wall s | jobs/s | failures |");
    println!("|---|---:|---:|---:|");
    println!(
        "| baseline: direct to mock | {:.2} | {:.0} | {} |",
        direct.as_secs_f64(),
        direct_rate,
        direct_failures
    );
    println!(
        "| tollgate: submit only | {:.2} | {:.0} | {} |",
        submitted.as_secs_f64(),
        rate(args.jobs, submitted),
        submit_failures
    );
    println!(
        "| tollgate: end to end | {:.2} | {:.0} | {} |",
        through.as_secs_f64(),
        e2e_rate,
        failed
    );
    println!("ratio end-to-end / baseline: {:.2}", e2e_rate / direct_rate);
    anyhow::ensure!(
        succeeded == expected,
        "only {succeeded} of {expected} jobs succeeded"
    );
    Ok(())
}
