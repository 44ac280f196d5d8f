//! `eta`: how the forecasts given at submission come out on a mixed workload. Two tenants
//! (weights 3:1) send jobs at `rate` a second for `seconds` (then `tail` seconds more, not
//! scored: the stream goes on while the last scored jobs wait) — three sizes of output cap,
//! `standard` and `background`, one in `due_every` (a third by default) with a deadline of
//! their own two minutes out (checked: refused `deadline_unmeetable` when out of reach),
//! evenly spaced or as a seeded random (Poisson) stream ([`Arrivals`]) — to a provider
//! limited to `rpm` and `tpm` that answers in 2 s (a chat call's time), more than it can
//! serve once its first minute's allowance is spent, so a queue builds. With every job due
//! (`due_every` 1) the deadline check refuses what the provider cannot serve in time and
//! the queue is steady; with jobs due only by their class's default (an hour or more) it
//! grows for as long as the stream lasts. Every job accepted carries its `eta`; once all
//! have finished, each forecast p50 is set against when the job really finished, beside
//! the estimate a client could make without it: the work in the system when it was
//! submitted, drained at the rate jobs finished in the minute before (`/v1/status`'s
//! queue `eta_secs`).

use std::time::Duration;

use serde_json::{Value, json};
use tollgate::config::Config;
use tollgate_api::broker::Roles;
use tollgate_mock::MockConfig;

use crate::local::LocalStack;
use crate::{BenchArgs, limited_provider};

/// The deadline one job in `due_every` sets, from its submission.
const DEADLINE_SECS: i64 = 120;
/// Output caps: a short, a medium and a long answer.
const SIZES: [u32; 3] = [16, 128, 512];

fn mock_config(args: &BenchArgs) -> anyhow::Result<MockConfig> {
    Ok(MockConfig::from_toml_str(&format!(
        r#"
output_tokens = 12
latency_ms = 2000
[[projects]]
name = "bench"
kind = "openai"
keys = ["sk-bench"]
rpm = {}
tpm = {}
"#,
        args.rpm, args.tpm
    ))?)
}

fn broker_config(mock: std::net::SocketAddr, args: &BenchArgs) -> anyhow::Result<Config> {
    let text = format!(
        r#"
[server]
api_rate_per_sec = 1000000000.0
api_burst = 1000000000.0
[database]
max_connections = 16
[dispatch]
concurrency = 64
[gate]
interactive_reserve = 0.0
[[tenants]]
name = "bench"
api_key = "tk-bench"
weight = 3
[[tenants]]
name = "other"
api_key = "tk-other"
weight = 1
{}"#,
        limited_provider(mock, args.rpm, args.tpm)
    );
    Ok(Config::parse(&text, "bench eta config")?)
}

/// How the case's submissions arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Arrivals {
    /// Evenly spaced, tenants alternating, output caps in turn, every fifth job of a
    /// tenant background, every `due_every`th with its own deadline: a periodic workload.
    Even,
    /// The same rate and mix drawn at random (seeded, so runs repeat): gaps exponentially
    /// distributed, each job's tenant, cap, class and deadline drawn independently.
    Poisson,
}

/// The seed of the `poisson` stream.
const SEED: u64 = 23;

/// One submission of the case: when, by whom, and what.
struct Submission {
    /// Seconds after the first.
    at: f64,
    tenant_key: &'static str,
    max_tokens: u32,
    background: bool,
    own_deadline: bool,
}

/// The case's `total` submissions at `rate` a second, arriving as `arrivals` says.
fn submissions(arrivals: Arrivals, total: usize, rate: f64, due_every: u64) -> Vec<Submission> {
    use rand::{Rng, SeedableRng};
    let tenant_key = |first: bool| if first { "tk-bench" } else { "tk-other" };
    match arrivals {
        Arrivals::Even => (0..total)
            .map(|i| Submission {
                at: i as f64 / rate,
                tenant_key: tenant_key(i.is_multiple_of(2)),
                max_tokens: SIZES[i % SIZES.len()],
                background: i % 5 == 4,
                own_deadline: (i as u64).is_multiple_of(due_every),
            })
            .collect(),
        Arrivals::Poisson => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
            let mut at = 0.0;
            (0..total)
                .map(|_| {
                    let submission = Submission {
                        at,
                        tenant_key: tenant_key(rng.random_bool(0.5)),
                        max_tokens: SIZES[rng.random_range(0..SIZES.len())],
                        background: rng.random_bool(0.2),
                        own_deadline: rng.random_bool(1.0 / due_every as f64),
                    };
                    at += -(1.0 - rng.random::<f64>()).ln() / rate;
                    submission
                })
                .collect()
        }
    }
}

fn body(i: usize, s: &Submission) -> Value {
    let mut body = json!({
        "request": {"model": "oai/gpt-4o-mini", "max_tokens": s.max_tokens,
                    "messages": [{"role": "user", "content": format!("summarise ticket {i} of the support queue")}]},
        "class": if s.background { "background" } else { "standard" },
    });
    if s.own_deadline {
        body["deadline"] = json!(chrono::Utc::now() + chrono::Duration::seconds(DEADLINE_SECS));
    }
    body
}

/// One of the forecasts that missed most: class, tenant, output cap, whether it set its own
/// deadline, then seconds — submitted after the first job, its eta p50, admitted, finished
/// (from its submission) — and its relative error.
type Miss = (
    String,
    String,
    i32,
    bool,
    f64,
    Option<f64>,
    Option<f64>,
    Option<f64>,
    Option<f64>,
);

/// An accepted job that missed its deadline: class, tenant, output cap, then seconds —
/// submitted after the first job, its eta p50 and p90, its deadline (from its submission)
/// — and the error it failed with.
type Missed = (
    String,
    String,
    i32,
    f64,
    Option<f64>,
    Option<f64>,
    f64,
    Option<String>,
);

/// One forecast's record: jobs, p50 and p90 relative error, jobs after their p90, accepted
/// jobs that missed their deadline.
struct Record {
    jobs: i64,
    p50_error: Option<f64>,
    p90_error: Option<f64>,
    after_p90: Option<i64>,
    missed: Option<i64>,
}

/// One (class, tenant) queue's forecasts: class, tenant, jobs, p50 and p90 relative
/// error, jobs after their p90.
type QueueRecord = (String, String, i64, Option<f64>, Option<f64>, i64);

/// The naive estimate's record: each job's work in the system at its submission over the
/// rate jobs finished in the minute before (jobs submitted before any finished have none).
async fn drain_estimate(pool: &sqlx::PgPool) -> anyhow::Result<Record> {
    let (jobs, p50, p90): (i64, Option<f64>, Option<f64>) = sqlx::query_as(
        "WITH f AS (
             SELECT extract(epoch FROM j.finished_at - j.created_at)::float8 AS actual,
                    (SELECT count(*) FROM jobs o WHERE o.created_at < j.created_at
                         AND (o.finished_at IS NULL OR o.finished_at > j.created_at))::float8 AS ahead,
                    (SELECT count(*) FROM jobs o WHERE o.finished_at <= j.created_at
                         AND o.finished_at > j.created_at - interval '60 seconds')::float8 / 60.0 AS rate
             FROM jobs j WHERE j.eta_p50 IS NOT NULL AND j.finished_at IS NOT NULL),
         e AS (SELECT actual, greatest((ahead + 1) / rate, 1.0) AS forecast FROM f WHERE rate > 0)
         SELECT count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY abs(actual - forecast) / forecast),
                percentile_cont(0.9) WITHIN GROUP (ORDER BY abs(actual - forecast) / forecast)
         FROM e",
    )
    .fetch_one(pool)
    .await?;
    Ok(Record {
        jobs,
        p50_error: p50,
        p90_error: p90,
        after_p90: None,
        missed: None,
    })
}

#[allow(clippy::print_stdout)] // the report is the command's output
pub(crate) async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let stack = LocalStack::start(
        "bench_eta",
        args.data_dir.clone(),
        mock_config(args)?,
        Roles::ALL,
        |addr| broker_config(addr, args),
    )
    .await?;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/jobs", stack.api);
    let total = (args.rate * (args.seconds + args.tail)) as usize;
    let plan = submissions(
        args.arrivals,
        total,
        args.rate.max(1) as f64,
        args.due_every.max(1),
    );
    let mut sent = tokio::task::JoinSet::new();
    let begin = tokio::time::Instant::now();
    for (i, submission) in plan.iter().enumerate() {
        tokio::time::sleep_until(begin + Duration::from_secs_f64(submission.at)).await;
        let (http, url) = (http.clone(), url.clone());
        let (key, body) = (submission.tenant_key, body(i, submission));
        sent.spawn(async move {
            let r = http.post(url).bearer_auth(key).json(&body).send().await?;
            let status = r.status().as_u16();
            let answer: Value = r.json().await.unwrap_or(Value::Null);
            anyhow::Ok((status, answer))
        });
    }
    let (mut accepted, mut refused) = (0, 0);
    while let Some(answered) = sent.join_next().await {
        let (status, answer) = answered??;
        match status {
            202 => accepted += 1,
            422 if answer["error"]["code"] == "deadline_unmeetable" => refused += 1,
            other => anyhow::bail!("a submission answered {other}: {answer}"),
        }
    }
    let sending = begin.elapsed().as_secs_f64();
    crate::wait_finished(&stack.pool, accepted).await?;
    let drained = begin.elapsed().as_secs_f64();
    // The tail's jobs kept the stream steady; they are not scored.
    let tail = sqlx::query(
        "UPDATE jobs SET eta_p50 = NULL, eta_p90 = NULL
         WHERE created_at >= (SELECT min(created_at) FROM jobs) + make_interval(secs => $1)",
    )
    .bind(args.seconds as f64)
    .execute(&stack.pool)
    .await?
    .rows_affected();
    let r = tollgate::store::forecast_record(&stack.pool, None, chrono::DateTime::UNIX_EPOCH).await?;
    let tollgate = Record {
        jobs: r.jobs,
        p50_error: r.p50_error,
        p90_error: r.p90_error,
        after_p90: Some(r.late),
        missed: Some(r.missed_deadline),
    };
    let naive = drain_estimate(&stack.pool).await?;
    let by_queue: Vec<QueueRecord> = sqlx::query_as(
        "WITH f AS (
             SELECT class::text AS class, tenant, finished_at > eta_p90 AS late,
                    abs(extract(epoch FROM finished_at - eta_p50))::float8
                        / greatest(extract(epoch FROM eta_p50 - created_at)::float8, 1.0) AS error
             FROM jobs WHERE eta_p50 IS NOT NULL AND finished_at IS NOT NULL)
         SELECT class, tenant, count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY error),
                percentile_cont(0.9) WITHIN GROUP (ORDER BY error),
                count(*) FILTER (WHERE late)
         FROM f GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(&stack.pool)
    .await?;
    let misses: Vec<Miss> = sqlx::query_as(
        "SELECT class::text, tenant, estimated_output_tokens, deadline < created_at + interval '1 hour',
                extract(epoch FROM created_at - min(created_at) OVER ())::float8,
                extract(epoch FROM eta_p50 - created_at)::float8,
                extract(epoch FROM admitted_at - created_at)::float8,
                extract(epoch FROM finished_at - created_at)::float8,
                abs(extract(epoch FROM finished_at - eta_p50))::float8
                    / greatest(extract(epoch FROM eta_p50 - created_at)::float8, 1.0) AS error
         FROM jobs WHERE eta_p50 IS NOT NULL AND finished_at IS NOT NULL
         ORDER BY error DESC LIMIT 12",
    )
    .fetch_all(&stack.pool)
    .await?;
    let missed: Vec<Missed> = sqlx::query_as(
        "SELECT class::text, tenant, estimated_output_tokens,
                extract(epoch FROM created_at - (SELECT min(created_at) FROM jobs))::float8,
                extract(epoch FROM eta_p50 - created_at)::float8,
                extract(epoch FROM eta_p90 - created_at)::float8,
                extract(epoch FROM deadline - created_at)::float8,
                error_code
         FROM jobs WHERE eta_p50 IS NOT NULL AND error_code IN ('deadline_exceeded', 'deadline_unmeetable')
         ORDER BY created_at",
    )
    .fetch_all(&stack.pool)
    .await?;
    stack.stop().await?;
    println!(
        "\n### eta: {total} jobs at {}/s for {}s, arriving {:?} (2 tenants 3:1, output caps {SIZES:?}, one in {} due in {DEADLINE_SECS}s), provider rpm {} tpm {}, 2 s a call\n",
        args.rate,
        args.seconds,
        args.arrivals,
        args.due_every.max(1),
        args.rpm,
        args.tpm
    );
    println!(
        "accepted {accepted}, refused deadline_unmeetable {refused}; sent in {sending:.1}s, all finished after {drained:.1}s; {tail} jobs of the last {}s not scored\n",
        args.tail
    );
    println!(
        "| forecast at submission | jobs | p50 error | p90 error | finished after its p90 | accepted, missed its deadline |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    let pct = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{:.1} %", 100.0 * v));
    let count = |v: Option<i64>| v.map_or("-".to_owned(), |v| v.to_string());
    for (name, rec) in [
        ("tollgate `eta` p50 (p90 for the last two)", &tollgate),
        ("work in the system ÷ last minute's finishing rate", &naive),
    ] {
        println!(
            "| {name} | {} | {} | {} | {} | {} |",
            rec.jobs,
            pct(rec.p50_error),
            pct(rec.p90_error),
            count(rec.after_p90),
            count(rec.missed)
        );
    }
    println!("\n| class | tenant (weight) | jobs | p50 error | p90 error | after its p90 |");
    println!("|---|---|---:|---:|---:|---:|");
    for (class, tenant, jobs, p50, p90, late) in &by_queue {
        let weight = if tenant == "bench" { 3 } else { 1 };
        println!(
            "| {class} | {tenant} ({weight}) | {jobs} | {} | {} | {late} |",
            pct(*p50),
            pct(*p90)
        );
    }
    println!("\nThe forecasts that missed most (seconds from submission):\n");
    println!(
        "| class | tenant | output cap | own deadline | submitted at | eta p50 | admitted | finished | error |"
    );
    println!("|---|---|---:|---|---:|---:|---:|---:|---:|");
    let secs = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
    for (class, tenant, cap, own_deadline, at, eta, admitted, finished, error) in &misses {
        println!(
            "| {class} | {tenant} | {cap} | {own_deadline} | {at:.1} | {} | {} | {} | {} |",
            secs(*eta),
            secs(*admitted),
            secs(*finished),
            pct(*error)
        );
    }
    if !missed.is_empty() {
        println!("\nThe accepted jobs that missed their deadline (seconds from submission):\n");
        println!("| class | tenant | output cap | submitted at | eta p50 | eta p90 | deadline | error |");
        println!("|---|---|---:|---:|---:|---:|---:|---|");
        for (class, tenant, cap, at, p50, p90, deadline, error) in &missed {
            println!(
                "| {class} | {tenant} | {cap} | {at:.1} | {} | {} | {deadline:.1} | {} |",
                secs(*p50),
                secs(*p90),
                error.as_deref().unwrap_or("-")
            );
        }
    }
    if let (Some(ours), Some(theirs)) = (tollgate.p90_error, naive.p90_error) {
        println!(
            "\np90 error ratio, tollgate ÷ drain estimate: {:.2}",
            ours / theirs.max(1e-9)
        );
    }
    Ok(())
}
