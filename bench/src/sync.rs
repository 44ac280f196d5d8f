//! `tollgate bench --case sync`: the synchronous drop-in path, `POST
//! /v1/chat/completions` through the queue, beside the same requests sent straight to the
//! mock provider, in one run and by one external load generator (`hey`, installed with
//! `apt-get` when missing): one caller alone, then fixed rates and saturation, with where
//! each row's calls spent their time (from the rows written for them). Each request is
//! admitted, committed, dispatched, settled and answered by tollgate; the direct run is the
//! floor of the machine, the client and the mock. Then the same request streamed, timed to
//! its first byte, and the other synchronous endpoints — embeddings, responses and
//! Anthropic's messages — at 1,000 requests a second.

use std::process::Command;

use anyhow::{Context, bail};
use serde_json::json;
use tollgate_api::broker::Roles;

use crate::{BenchArgs, request, stack_for};

/// One load shape: workers, and each worker's requests a second (None: as fast as answered).
#[derive(Clone, Copy)]
struct Load {
    clients: usize,
    per_client: Option<u32>,
}

impl Load {
    fn label(&self) -> String {
        let clients = match self.clients {
            1 => "1 client".to_owned(),
            n => format!("{n} clients"),
        };
        match self.per_client {
            Some(q) => format!("{clients} × {q} req/s"),
            None => format!("{clients}, as fast as answered"),
        }
    }
}

/// Half the rate the latency goals name: 480 requests a second.
const HALF_GOAL_RATE: Load = Load {
    clients: 16,
    per_client: Some(30),
};
/// The rate the latency goals name: 1,000 requests a second.
const GOAL_RATE: Load = Load {
    clients: 20,
    per_client: Some(50),
};

const LOADS: [Load; 7] = [
    // One caller at a time: what a call costs with nothing beside it.
    Load {
        clients: 1,
        per_client: None,
    },
    HALF_GOAL_RATE,
    GOAL_RATE,
    Load {
        clients: 16,
        per_client: None,
    },
    Load {
        clients: 128,
        per_client: None,
    },
    // The saturation goal's clients at its rate (5,120 a second), then flat out.
    Load {
        clients: 256,
        per_client: Some(20),
    },
    Load {
        clients: 256,
        per_client: None,
    },
];

/// Streams at the rate the goal names (1,000 a second), and at half of it.
const STREAM_LOADS: [Load; 2] = [HALF_GOAL_RATE, GOAL_RATE];

/// A synchronous endpoint: its path, its request (the model as the mock and as tollgate
/// name it), and whether callers send Anthropic's headers rather than a bearer key.
struct Endpoint {
    path: &'static str,
    direct_model: &'static str,
    broker_model: &'static str,
    body: fn(model: &str) -> serde_json::Value,
    anthropic: bool,
}

const CHAT: Endpoint = Endpoint {
    path: "/v1/chat/completions",
    direct_model: "gpt-4o-mini",
    broker_model: "oai/gpt-4o-mini",
    body: |model| {
        let mut body = request(0);
        body["model"] = json!(model);
        body
    },
    anthropic: false,
};

/// The synchronous endpoints beside chat, each at the goal's 1,000 requests a second.
const OTHER_ENDPOINTS: [Endpoint; 3] = [
    Endpoint {
        path: "/v1/embeddings",
        direct_model: "text-embedding-3-small",
        broker_model: "emb/text-embedding-3-small",
        body: |model| json!({"model": model, "input": "benchmark request 0"}),
        anthropic: false,
    },
    Endpoint {
        path: "/v1/responses",
        direct_model: "gpt-4o-mini",
        broker_model: "oai/gpt-4o-mini",
        body: |model| json!({"model": model, "input": "benchmark request 0", "max_output_tokens": 16}),
        anthropic: false,
    },
    Endpoint {
        path: "/v1/messages",
        direct_model: "claude-3-5-haiku-latest",
        broker_model: "ant/claude-3-5-haiku-latest",
        body: |model| {
            json!({"model": model, "max_tokens": 8,
                   "messages": [{"role": "user", "content": "benchmark request 0"}]})
        },
        anthropic: true,
    },
];

/// A row's two runs, with the same request: to the mock directly, then through tollgate.
struct Pair {
    direct_url: String,
    direct_headers: Vec<String>,
    direct_body: String,
    broker_url: String,
    broker_headers: Vec<String>,
    broker_body: String,
}

impl Pair {
    fn new(stack: &crate::local::LocalStack, endpoint: &Endpoint, stream: bool) -> anyhow::Result<Self> {
        let body = |model: &str| {
            let mut body = (endpoint.body)(model);
            if stream {
                body["stream"] = json!(true);
            }
            serde_json::to_string(&body)
        };
        let headers = |key: &str| {
            if endpoint.anthropic {
                vec![
                    format!("x-api-key: {key}"),
                    "anthropic-version: 2023-06-01".to_owned(),
                ]
            } else {
                vec![format!("Authorization: Bearer {key}")]
            }
        };
        let direct_key = if endpoint.anthropic {
            "sk-ant-bench"
        } else {
            "sk-bench"
        };
        Ok(Self {
            direct_url: format!("http://{}{}", stack.mock_addr, endpoint.path),
            direct_headers: headers(direct_key),
            direct_body: body(endpoint.direct_model)?,
            broker_url: format!("{}{}", stack.api, endpoint.path),
            broker_headers: headers("tk-bench"),
            broker_body: body(endpoint.broker_model)?,
        })
    }

    /// Runs `load` for `seconds` directly, then through tollgate.
    async fn run(&self, hey: &str, load: Load, seconds: u64) -> anyhow::Result<(Measured, Measured)> {
        let hey = hey.to_owned();
        let direct = (
            self.direct_url.clone(),
            self.direct_headers.clone(),
            self.direct_body.clone(),
        );
        let broker = (
            self.broker_url.clone(),
            self.broker_headers.clone(),
            self.broker_body.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let floor = run_hey(&hey, &direct.0, &direct.1, &direct.2, &load, seconds)?;
            let measured = run_hey(&hey, &broker.0, &broker.1, &broker.2, &load, seconds)?;
            anyhow::Ok((floor, measured))
        })
        .await?
    }
}

/// A latency quantile of a run, in ms.
type Quantile = fn(&Measured, f64) -> f64;

/// Prints a row's two lines: each run's throughput, the three `shown` quantiles and its
/// failures, and what tollgate added to the `added` latency at p50 and p99.
#[allow(clippy::print_stdout)] // the report is the command's output
fn print_rows(
    label: &str,
    floor: &Measured,
    measured: &Measured,
    shown: [(Quantile, f64); 3],
    added: Quantile,
) {
    for (path, m) in [("direct to the mock", floor), ("tollgate", measured)] {
        let (added_p50, added_p99) = if std::ptr::eq(m, measured) {
            (
                format!("{:.1}", added(m, 0.5) - added(floor, 0.5)),
                format!("{:.1}", added(m, 0.99) - added(floor, 0.99)),
            )
        } else {
            (String::new(), String::new())
        };
        let [a, b, c] = shown.map(|(q, p)| q(m, p));
        println!(
            "| {path} | {label} | {:.0}/s | {a:.1} | {b:.1} | {c:.1} | {} | {added_p50} | {added_p99} |",
            m.throughput, m.failed,
        );
    }
}

/// What one `hey` run measured.
struct Measured {
    throughput: f64,
    /// Latencies of the successful requests, in seconds, sorted.
    latencies: Vec<f64>,
    /// Their times to the first byte of the response (its headers: for a stream, sent
    /// when the stream starts), in seconds, sorted.
    first_bytes: Vec<f64>,
    failed: usize,
}

/// The `p` quantile of sorted `seconds`, in milliseconds.
fn ms_at(seconds: &[f64], p: f64) -> f64 {
    let i = ((seconds.len() as f64 - 1.0) * p).round() as usize;
    seconds.get(i).map_or(f64::NAN, |s| s * 1e3)
}

impl Measured {
    fn ms_at(&self, p: f64) -> f64 {
        ms_at(&self.latencies, p)
    }

    fn first_byte_ms_at(&self, p: f64) -> f64 {
        ms_at(&self.first_bytes, p)
    }
}

/// The load generator's path: `hey` from PATH, installed from the distribution when
/// missing and this process may.
fn hey() -> anyhow::Result<String> {
    let found = |name: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    if let Some(path) = found("hey") {
        return Ok(path);
    }
    eprintln!("bench: installing the load generator (apt-get install -y hey)");
    let installed = Command::new("apt-get")
        .args(["install", "-y", "-q", "hey"])
        .status();
    match (installed, found("hey")) {
        (Ok(status), Some(path)) if status.success() => Ok(path),
        _ => bail!(
            "the sync case needs `hey` (Debian: apt-get install hey; or go install github.com/rakyll/hey)"
        ),
    }
}

/// Runs `hey` for `seconds` with `load` against `url`, reading each request's latency from
/// its CSV output.
fn run_hey(
    hey: &str,
    url: &str,
    headers: &[String],
    body: &str,
    load: &Load,
    seconds: u64,
) -> anyhow::Result<Measured> {
    let mut cmd = Command::new(hey);
    cmd.args(["-z", &format!("{seconds}s"), "-c", &load.clients.to_string()])
        .args(["-m", "POST", "-T", "application/json"])
        .args(headers.iter().flat_map(|h| ["-H", h.as_str()]))
        .args(["-d", body])
        .args(["-o", "csv"]);
    if let Some(q) = load.per_client {
        cmd.args(["-q", &q.to_string()]);
    }
    let out = cmd.arg(url).output().context("running hey")?;
    if !out.status.success() {
        bail!("hey failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset
    let (mut latencies, mut first_bytes) = (Vec::new(), Vec::new());
    let (mut failed, mut last_offset) = (0, 0.0f64);
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let (Some(time), Some(delay), Some(status), Some(offset)) =
            (fields.first(), fields.get(4), fields.get(6), fields.get(7))
        else {
            continue;
        };
        let (Ok(time), Ok(delay), Ok(offset)) =
            (time.parse::<f64>(), delay.parse::<f64>(), offset.parse::<f64>())
        else {
            continue;
        };
        last_offset = last_offset.max(offset + time);
        if *status == "200" {
            latencies.push(time);
            first_bytes.push(delay);
        } else {
            failed += 1;
        }
    }
    // Requests cut off at the end of the run are not in the CSV; those answered are.
    latencies.sort_by(f64::total_cmp);
    first_bytes.sort_by(f64::total_cmp);
    let elapsed = last_offset.max(seconds as f64);
    Ok(Measured {
        throughput: (latencies.len() + failed) as f64 / elapsed,
        latencies,
        first_bytes,
        failed,
    })
}

#[allow(clippy::print_stdout)] // the report is the command's output
pub(crate) async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let hey = hey()?;
    // Every caller of the largest row may have its call in flight, as through a proxy: a
    // broker with fewer call slots than callers queues them by its configuration.
    let most_clients = LOADS.iter().map(|l| l.clients).max().unwrap_or(1);
    let args = &BenchArgs {
        concurrency: args.concurrency.max(most_clients),
        ..args.clone()
    };
    let stack = stack_for(args, Roles::ALL).await?;
    let pair = Pair::new(&stack, &CHAT, false)?;
    let seconds = args.seconds;

    println!(
        "\n### sync: `POST /v1/chat/completions` through tollgate beside the mock directly ({seconds} s per row, `hey`, `dispatch.concurrency` {})\n",
        args.concurrency
    );
    println!(
        "| path | load | throughput | p50 ms | p90 ms | p99 ms | failed | added p50 ms | added p99 ms |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut stages = Vec::new();
    for load in &LOADS {
        let row_started = chrono::Utc::now();
        let (floor, measured) = pair.run(&hey, *load, seconds).await?;
        let latency = Measured::ms_at as Quantile;
        print_rows(
            &load.label(),
            &floor,
            &measured,
            [(latency, 0.5), (latency, 0.9), (latency, 0.99)],
            latency,
        );
        stages.push((load.label(), Stages::read(&stack.pool, row_started).await?));
    }
    println!(
        "\nWhere each tollgate row's time went, from the job rows it wrote (ms, p50 / p90): \
         submitted → admitted (to the admitter and its reads, or a wait for the gate's round), \
         admitted → sent (the admission's commit and the hand-over to the call), \
         the provider call, and its end → the outcome's write (after the caller has its answer).\n"
    );
    println!("| load | jobs | → admitted | → sent | call | → recorded |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (label, s) in stages {
        println!(
            "| {label} | {} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} |",
            s.jobs,
            s.admitted[0],
            s.admitted[1],
            s.sent[0],
            s.sent[1],
            s.call[0],
            s.call[1],
            s.recorded[0],
            s.recorded[1]
        );
    }
    streams(&hey, &stack, seconds).await?;
    other_endpoints(&hey, &stack, seconds).await?;
    stack.stop().await?;
    Ok(())
}

/// The same request streamed (`"stream": true`) at [`STREAM_LOADS`], through tollgate
/// beside the mock directly: the time to the first byte of the response, and to its end.
#[allow(clippy::print_stdout)] // the report is the command's output
async fn streams(hey: &str, stack: &crate::local::LocalStack, seconds: u64) -> anyhow::Result<()> {
    let pair = Pair::new(stack, &CHAT, true)?;
    println!(
        "\nStreamed (`\"stream\": true`): time to the first byte (the response's headers, sent when \
         the stream starts) and to the stream's end, ms.\n"
    );
    println!(
        "| path | load | throughput | first byte p50 | first byte p99 | end p50 | failed | added first byte p50 | added first byte p99 |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for load in STREAM_LOADS {
        let (floor, measured) = pair.run(hey, load, seconds).await?;
        let first_byte = Measured::first_byte_ms_at as Quantile;
        let rows = [
            (first_byte, 0.5),
            (first_byte, 0.99),
            (Measured::ms_at as Quantile, 0.5),
        ];
        print_rows(&load.label(), &floor, &measured, rows, first_byte);
    }
    Ok(())
}

/// The synchronous endpoints beside chat ([`OTHER_ENDPOINTS`]) at 1,000 requests a second,
/// through tollgate beside the mock directly.
#[allow(clippy::print_stdout)] // the report is the command's output
async fn other_endpoints(hey: &str, stack: &crate::local::LocalStack, seconds: u64) -> anyhow::Result<()> {
    let load = GOAL_RATE;
    println!("\nThe other synchronous endpoints, {}:\n", load.label());
    println!(
        "| path | endpoint | throughput | p50 ms | p90 ms | p99 ms | failed | added p50 ms | added p99 ms |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for endpoint in &OTHER_ENDPOINTS {
        let (floor, measured) = Pair::new(stack, endpoint, false)?.run(hey, load, seconds).await?;
        let latency = Measured::ms_at as Quantile;
        print_rows(
            &format!("`{}`", endpoint.path),
            &floor,
            &measured,
            [(latency, 0.5), (latency, 0.9), (latency, 0.99)],
            latency,
        );
    }
    Ok(())
}

/// Where a row's synchronous calls spent their time, from the rows written for them: the
/// job's and its first attempt's (ms, p50 and p90).
struct Stages {
    jobs: i64,
    /// Submitted → admitted: the handler's hand-off, the admission's reads, or a wait in
    /// the queue for the gate's round.
    admitted: [f64; 2],
    /// Admitted → sent: the admission's write and commit, the hand-over to the dispatcher
    /// (or its claim), until the request leaves for the provider.
    sent: [f64; 2],
    /// The provider call, sent → answered.
    call: [f64; 2],
    /// Answered → the outcome's write: the completer's queue (the caller has its answer).
    recorded: [f64; 2],
}

impl Stages {
    async fn read(pool: &sqlx::PgPool, since: chrono::DateTime<chrono::Utc>) -> anyhow::Result<Self> {
        let row: (i64, Vec<f64>) = sqlx::query_as(
            "WITH j AS (
                 SELECT extract(epoch FROM j.admitted_at - j.created_at) * 1e3 AS admitted,
                        extract(epoch FROM a.started_at - j.admitted_at) * 1e3 AS sent,
                        extract(epoch FROM a.finished_at - a.started_at) * 1e3 AS call,
                        extract(epoch FROM j.finished_at - a.finished_at) * 1e3 AS recorded
                 FROM jobs j JOIN job_attempts a ON a.job_id = j.id AND a.attempt = 1
                 WHERE j.created_at >= $1 AND j.state = 'succeeded')
             SELECT count(*),
                    ARRAY[coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY admitted), 0),
                          coalesce(percentile_cont(0.9) WITHIN GROUP (ORDER BY admitted), 0),
                          coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY sent), 0),
                          coalesce(percentile_cont(0.9) WITHIN GROUP (ORDER BY sent), 0),
                          coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY call), 0),
                          coalesce(percentile_cont(0.9) WITHIN GROUP (ORDER BY call), 0),
                          coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY recorded), 0),
                          coalesce(percentile_cont(0.9) WITHIN GROUP (ORDER BY recorded), 0)]::float8[]
             FROM j",
        )
        .bind(since)
        .fetch_one(pool)
        .await
        .context("reading the row's job stages")?;
        let pair = |at: usize| {
            [
                row.1.get(at).copied().unwrap_or(0.0),
                row.1.get(at + 1).copied().unwrap_or(0.0),
            ]
        };
        Ok(Self {
            jobs: row.0,
            admitted: pair(0),
            sent: pair(2),
            call: pair(4),
            recorded: pair(6),
        })
    }
}
