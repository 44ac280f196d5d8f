//! `tollgate demo`: the whole system on this machine in one command. It starts PostgreSQL
//! (embedded unless `DATABASE_URL` is set) with a fresh database, the mock provider with
//! limits for one OpenAI-style and one Anthropic-style account (tight enough that the
//! workload hits them: the broker must hold jobs back rather than meet 429s), and a broker;
//! submits jobs from three tenants across both providers over HTTP; shows progress; and
//! ends with a summary. It succeeds only if every job finished.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tollgate::config::Config;
use tollgate::model::JobState;
use tollgate::store;
use tollgate_mock::MockConfig;

use crate::local::LocalStack;
use tollgate_api::broker::Roles;

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Jobs to submit in all (split 50/30/20 between the three tenants).
    #[arg(long, default_value_t = 2000)]
    pub jobs: usize,
    /// Mock provider latency per request, in milliseconds.
    #[arg(long, default_value_t = 40)]
    pub latency_ms: u64,
    /// Where the embedded PostgreSQL keeps its data (ignored with DATABASE_URL).
    #[arg(long, default_value = ".tollgate/pg")]
    pub data_dir: std::path::PathBuf,
}

/// The mock's accounts: an OpenAI-style project with two keys and an Anthropic-style one.
pub fn default_mock_config() -> MockConfig {
    let text = r#"
latency_ms = 40
output_tokens = 24
[[projects]]
name = "oai-demo"
kind = "openai"
keys = ["sk-demo-1", "sk-demo-2"]
rpm = 1200
tpm = 200000
[[projects]]
name = "ant-demo"
kind = "anthropic"
keys = ["sk-ant-demo"]
rpm = 600
itpm = 100000
otpm = 40000
"#;
    MockConfig::from_toml_str(text).unwrap_or_default()
}

/// The broker's view of the same accounts, three tenants, and a route across both.
fn demo_config(mock_addr: std::net::SocketAddr) -> anyhow::Result<Config> {
    let text = format!(
        r#"
[dispatch]
concurrency = 64
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://{mock_addr}/v1"
keys = [{{ name = "k1", value = "sk-demo-1" }}, {{ name = "k2", value = "sk-demo-2" }}]
models = ["gpt-4o-mini"]
[providers.limits."gpt-4o-mini"]
rpm = 1200
tpm = 200000
[[providers]]
name = "ant"
kind = "anthropic"
base_url = "http://{mock_addr}"
keys = [{{ name = "k1", value = "sk-ant-demo" }}]
models = ["claude-3-5-haiku-latest"]
[providers.limits."claude-3-5-haiku-latest"]
rpm = 600
itpm = 100000
otpm = 40000
[[routes]]
alias = "fast"
targets = ["oai/gpt-4o-mini", "ant/claude-3-5-haiku-latest"]
[[tenants]]
name = "acme"
api_key = "tk-acme"
weight = 3
[[tenants]]
name = "globex"
api_key = "tk-globex"
weight = 2
[[tenants]]
name = "initech"
api_key = "tk-initech"
weight = 1
"#
    );
    Ok(Config::parse(&text, "demo config")?)
}

/// Each tenant's key, model and share of the workload.
const WORKLOAD: [(&str, &str, &str, usize); 3] = [
    ("acme", "tk-acme", "oai/gpt-4o-mini", 50),
    ("globex", "tk-globex", "ant/claude-3-5-haiku-latest", 30),
    ("initech", "tk-initech", "fast", 20),
];

/// Runs the demo; `Ok(true)` when every job succeeded.
pub async fn run(args: DemoArgs) -> anyhow::Result<bool> {
    let started = Instant::now();
    eprintln!("tollgate demo: starting PostgreSQL, the mock provider and the broker…");
    let mut mock_config = default_mock_config();
    mock_config.latency_ms = args.latency_ms;
    let mut stack = LocalStack::start(
        "demo",
        args.data_dir.clone(),
        mock_config,
        Roles::ALL,
        demo_config,
    )
    .await?;
    let outcome = drive(&args, &stack.api, &stack.pool).await;
    stack.stop_services().await;
    let summary = match outcome {
        Ok(report) => summarize(&stack.pool, &report).await.map(|s| (s, report)),
        Err(e) => Err(e),
    };
    let stats = stack.mock.stats();
    stack.stop().await?;
    let (summary, report) = summary?;
    let ok = summary.failed == 0 && summary.succeeded as usize == report.submitted;
    print_summary(
        &summary,
        &report,
        stats.rate_limited_429,
        stats.requests,
        started.elapsed(),
    );
    Ok(ok)
}

struct Report {
    submitted: usize,
    rejected: usize,
    wall: Duration,
}

/// Submits the workload over HTTP and waits, with a progress bar, until every job is done.
async fn drive(args: &DemoArgs, api: &str, pool: &sqlx::PgPool) -> anyhow::Result<Report> {
    let http = reqwest::Client::new();
    let total = args.jobs;
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} finished  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let begin = Instant::now();
    let mut requests = Vec::with_capacity(total);
    for (tenant, key, model, share) in WORKLOAD {
        let n = total * share / 100;
        for i in 0..n {
            requests.push((tenant, key, model, i));
        }
    }
    while requests.len() < total {
        requests.push(("acme", "tk-acme", "oai/gpt-4o-mini", requests.len()));
    }
    let submitted = requests.len();
    let rejected = futures::stream::iter(requests)
        .map(|(tenant, key, model, i)| {
            let http = http.clone();
            async move {
                let body = json!({
                    "request": {
                        "model": model,
                        "messages": [
                            {"role": "system", "content": "You are a concise assistant."},
                            {"role": "user", "content": format!("Summarise ticket {i} of {tenant} in one line.")}
                        ],
                        "max_tokens": 64
                    },
                    "class": "standard",
                    "idempotency_key": format!("demo-{tenant}-{i}"),
                });
                let r = http.post(format!("{api}/v1/jobs")).bearer_auth(key).json(&body).send().await;
                !matches!(r, Ok(resp) if resp.status().is_success())
            }
        })
        .buffer_unordered(32)
        .filter(|failed| futures::future::ready(*failed))
        .count()
        .await;
    loop {
        let counts: BTreeMap<JobState, i64> = store::count_by_state(pool).await?.into_iter().collect();
        let finished: i64 = counts
            .iter()
            .filter(|(s, _)| s.is_terminal())
            .map(|(_, n)| *n)
            .sum();
        let queued = counts.get(&JobState::Queued).copied().unwrap_or(0);
        let running = counts.get(&JobState::Running).copied().unwrap_or(0);
        bar.set_position(finished as u64);
        bar.set_message(format!("queued {queued}, running {running}"));
        if finished as usize >= submitted - rejected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bar.finish();
    Ok(Report {
        submitted,
        rejected,
        wall: begin.elapsed(),
    })
}

struct Summary {
    succeeded: i64,
    failed: i64,
    per_tenant: Vec<(String, i64, i64)>,
    wait_p50_ms: f64,
    wait_p99_ms: f64,
    failures: Vec<(String, i64)>,
}

async fn summarize(pool: &sqlx::PgPool, _report: &Report) -> anyhow::Result<Summary> {
    let per_tenant: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT tenant, count(*) FILTER (WHERE state = 'succeeded'), count(*) FILTER (WHERE state <> 'succeeded')
         FROM jobs GROUP BY tenant ORDER BY tenant",
    )
    .fetch_all(pool)
    .await?;
    let (wait_p50_ms, wait_p99_ms): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY w), percentile_cont(0.99) WITHIN GROUP (ORDER BY w)
         FROM (SELECT extract(epoch FROM started_at - created_at) * 1000 AS w FROM jobs WHERE started_at IS NOT NULL) t",
    )
    .fetch_one(pool)
    .await?;
    let failures: Vec<(String, i64)> = sqlx::query_as(
        "SELECT coalesce(error_code, state::text), count(*) FROM jobs WHERE state <> 'succeeded' GROUP BY 1 ORDER BY 2 DESC",
    )
    .fetch_all(pool)
    .await?;
    Ok(Summary {
        succeeded: per_tenant.iter().map(|t| t.1).sum(),
        failed: per_tenant.iter().map(|t| t.2).sum(),
        per_tenant,
        wait_p50_ms: wait_p50_ms.unwrap_or(0.0),
        wait_p99_ms: wait_p99_ms.unwrap_or(0.0),
        failures,
    })
}

#[allow(clippy::print_stdout)] // the demo's summary is its user-facing output
fn print_summary(s: &Summary, r: &Report, provider_429s: u64, provider_requests: u64, total: Duration) {
    println!();
    println!("tollgate demo summary");
    println!("  jobs submitted      {}", r.submitted);
    println!("  rejected at submit  {}", r.rejected);
    println!("  succeeded           {}", s.succeeded);
    println!("  failed              {}", s.failed);
    for (code, n) in &s.failures {
        println!("    {code:<20} {n}");
    }
    println!(
        "  drain wall time     {:.2} s ({:.0} jobs/s); {:.2} s in all",
        r.wall.as_secs_f64(),
        r.submitted as f64 / r.wall.as_secs_f64().max(0.001),
        total.as_secs_f64()
    );
    println!("  provider requests   {provider_requests}");
    println!("  provider 429s       {provider_429s}");
    println!(
        "  queue wait p50/p99  {:.0} ms / {:.0} ms",
        s.wait_p50_ms, s.wait_p99_ms
    );
    println!("  per tenant          succeeded  failed");
    for (tenant, ok, failed) in &s.per_tenant {
        println!("    {tenant:<18} {ok:>9} {failed:>7}");
    }
    let verdict = if s.failed == 0 {
        "every job finished"
    } else {
        "SOME JOBS FAILED"
    };
    println!("  result              {verdict}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_configs_are_valid() {
        let addr = "127.0.0.1:1".parse().unwrap();
        let c = demo_config(addr).unwrap();
        assert_eq!(c.tenants.len(), 3);
        assert_eq!(default_mock_config().projects.len(), 2);
    }
}
