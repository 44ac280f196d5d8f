//! `lanes`: one workload of mixed deadlines — minutes (`standard`, 5 min), an hour
//! (`background`, 1 h) and a day (`batch`, 25 h), a third each — through tollgate with
//! every lane on (online, the provider's flex tier, its batch API), beside the same
//! workload with online alone. The mock refuses every tenth flex call for capacity and
//! runs batches at `lines_per_sec`; prices are gpt-4o-mini's. Reported per run and lane:
//! jobs, what they cost, what the same usage costs online, the saving, and jobs that
//! finished past their deadline.

use std::time::Instant;

use serde_json::json;
use tollgate::config::Config;
use tollgate_mock::MockConfig;

use crate::local::LocalStack;
use crate::{BenchArgs, submit_jobs, wait_finished};
use tollgate_api::broker::Roles;

/// USD per million tokens (gpt-4o-mini's): micro-USD per token.
const INPUT_PRICE: f64 = 0.15;
const OUTPUT_PRICE: f64 = 0.6;

/// The workload's thirds: what their deadline is called, their class, seconds to it.
const GROUPS: [(&str, &str, i64); 3] = [
    ("minutes", "standard", 300),
    ("an hour", "background", 3600),
    ("a day", "batch", 90_000),
];

fn mock_config() -> anyhow::Result<MockConfig> {
    Ok(MockConfig::from_toml_str(
        r#"
output_tokens = 64
flex_unavailable_every_nth = 10
[batch]
lines_per_sec = 2000.0
[[projects]]
name = "bench"
kind = "openai"
keys = ["sk-bench"]
"#,
    )?)
}

/// The provider with its prices, and with `lanes` its flex tier and batch API on.
fn broker_config(mock: std::net::SocketAddr, lanes: bool) -> anyhow::Result<Config> {
    let lanes = if lanes {
        "[providers.flex]\nenabled = true\n\
         [providers.batch_api]\nenabled = true\npoll_interval_ms = 200\npack_wait_ms = 500\n"
    } else {
        ""
    };
    let text = format!(
        r#"
[database]
max_connections = 16
[dispatch]
concurrency = 64
[gate]
interactive_reserve = 0.0
[server]
api_rate_per_sec = 1000000000.0
api_burst = 1000000000.0
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://{mock}/v1"
keys = [{{ name = "k", value = "sk-bench" }}]
models = ["gpt-4o-mini"]
{lanes}
[providers.prices."gpt-4o-mini"]
input_per_mtok = {INPUT_PRICE}
output_per_mtok = {OUTPUT_PRICE}
[[tenants]]
name = "bench"
api_key = "tk-bench"
"#
    );
    Ok(Config::parse(&text, "bench lanes config")?)
}

/// A lane's figures as read: class, lane, jobs, spend, online price (micro-USD), late or
/// failed, p50 seconds from submission to the end.
type LaneFigures = (String, String, i64, Option<f64>, Option<f64>, i64, Option<f64>);

/// One lane of one run.
struct Row {
    run: &'static str,
    deadline: &'static str,
    lane: String,
    jobs: i64,
    spend_usd: f64,
    online_usd: f64,
    late: i64,
    p50_secs: f64,
}

async fn through_tollgate(
    args: &BenchArgs,
    run: &'static str,
    lanes: bool,
) -> anyhow::Result<(Vec<Row>, f64)> {
    let stack = LocalStack::start(
        "bench_lanes",
        args.data_dir.clone(),
        mock_config()?,
        Roles::ALL,
        |addr| broker_config(addr, lanes),
    )
    .await?;
    let begin = Instant::now();
    let now = chrono::Utc::now();
    submit_jobs(&stack.api, args.limit_jobs, |i| {
        let (_, class, secs) = GROUPS[i % GROUPS.len()];
        json!({
            "request": {"model": "oai/gpt-4o-mini", "max_tokens": 64,
                        "messages": [{"role": "user", "content": format!("summarise document {i} of the archive")}]},
            "class": class,
            "deadline": (now + chrono::Duration::seconds(secs)).to_rfc3339(),
        })
    })
    .await?;
    wait_finished(&stack.pool, args.limit_jobs as i64).await?;
    let secs = begin.elapsed().as_secs_f64();
    let lanes: Vec<LaneFigures> = sqlx::query_as(
        "SELECT class::text, coalesce(dispatch_via, 'online'), count(*), sum(spend_micro_usd),
                sum((usage->>'input_tokens')::float8 * $1 + (usage->>'output_tokens')::float8 * $2),
                count(*) FILTER (WHERE finished_at > deadline OR state <> 'succeeded'),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - created_at))
         FROM jobs GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .bind(INPUT_PRICE)
    .bind(OUTPUT_PRICE)
    .fetch_all(&stack.pool)
    .await?;
    stack.stop().await?;
    let group = |class: &str| GROUPS.iter().position(|g| g.1 == class).unwrap_or(GROUPS.len());
    let mut lanes = lanes;
    lanes.sort_by_key(|l| (group(&l.0), l.1.clone()));
    let rows = lanes
        .into_iter()
        .map(|(class, lane, jobs, spend, online, late, p50)| Row {
            run,
            deadline: GROUPS.iter().find(|g| g.1 == class).map_or("?", |g| g.0),
            lane,
            jobs,
            spend_usd: spend.unwrap_or(0.0) / 1e6,
            online_usd: online.unwrap_or(0.0) / 1e6,
            late,
            p50_secs: p50.unwrap_or(0.0),
        })
        .collect();
    Ok((rows, secs))
}

#[allow(clippy::print_stdout)] // the report is the command's output
pub(crate) async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let (online, online_secs) = through_tollgate(args, "online only", false).await?;
    let (lanes, lanes_secs) = through_tollgate(args, "every lane", true).await?;
    println!(
        "\n### lanes: {} jobs, deadlines minutes / an hour / a day (a third each), every tenth flex call refused\n",
        args.limit_jobs
    );
    println!(
        "| run | deadline | lane | jobs | cost USD | online price USD | saved | late or failed | p50 done s |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|");
    for r in online.iter().chain(&lanes) {
        println!(
            "| {} | {} | {} | {} | {:.4} | {:.4} | {:.0}% | {} | {:.2} |",
            r.run,
            r.deadline,
            r.lane,
            r.jobs,
            r.spend_usd,
            r.online_usd,
            100.0 * (1.0 - r.spend_usd / r.online_usd.max(1e-12)),
            r.late,
            r.p50_secs
        );
    }
    let total = |rows: &[Row]| rows.iter().map(|r| r.spend_usd).sum::<f64>();
    let late = |rows: &[Row]| rows.iter().map(|r| r.late).sum::<i64>();
    println!(
        "\ntotal cost: online only {:.4} USD in {online_secs:.1} s, every lane {:.4} USD in {lanes_secs:.1} s: ratio {:.2}; late or failed {} vs {}",
        total(&online),
        total(&lanes),
        total(&lanes) / total(&online).max(1e-12),
        late(&online),
        late(&lanes)
    );
    Ok(())
}
