//! apalis-postgres 1.0 throughput baseline for tollgate's end-to-end benchmark (issue #8).
//!
//! Measures, on one PostgreSQL, what apalis-postgres does with no-op jobs:
//! bulk enqueue, drain of an already-filled queue, and enqueue-while-draining.
//! Prints one JSON object per case on stdout; progress and errors go to stderr.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use apalis::prelude::*;
use apalis_postgres::{Config, PgConnectOptions, PgPool, PostgresStorage};
use clap::{Parser, ValueEnum};
use serde::Serialize;
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Push N no-op jobs with `push_bulk`.
    Enqueue,
    /// Process N already-queued jobs with W workers fetching B at a time.
    Drain,
    /// Enqueue N jobs in bulk chunks while W workers drain them.
    Mixed,
    /// Fresh database: enqueue, drain, mixed, then the default-batch drain; dropped at the end.
    All,
}

#[derive(Parser, Debug)]
#[command(
    name = "apalis-baseline",
    about = "apalis-postgres 1.0 throughput baseline (no-op jobs), one JSON line per case"
)]
struct Args {
    /// PostgreSQL URL. In `all` mode a fresh database is created on this server and dropped.
    #[arg(long)]
    database_url: String,
    /// Number of jobs.
    #[arg(long, default_value_t = 100_000)]
    jobs: usize,
    /// Workers (each one apalis worker with its own fetch loop).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// apalis-postgres `Config::batch_size`: jobs fetched per poll (apalis default: 10).
    #[arg(long, default_value_t = 5000)]
    batch: usize,
    /// Jobs per `push_bulk` call (one INSERT each). 0 = all N in one call.
    #[arg(long, default_value_t = 0)]
    chunk: usize,
    /// Chunk size for the enqueue side of `mixed`.
    #[arg(long, default_value_t = 5000)]
    mixed_chunk: usize,
    /// Jobs for the default-batch (10) drain in `all` mode.
    #[arg(long, default_value_t = 5000)]
    default_batch_jobs: usize,
    /// apalis queue (job_type) for the single modes.
    #[arg(long, default_value = "apalis-baseline")]
    queue: String,
    #[arg(long, value_enum, default_value_t = Mode::All)]
    mode: Mode,
}

#[derive(Serialize)]
struct Report {
    case: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    workers: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chunk: Option<usize>,
    jobs: usize,
    seconds: f64,
    jobs_per_sec: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    failed: Option<i64>,
}

fn emit(report: &Report) -> Result<()> {
    use std::io::Write;
    let line = serde_json::to_string(report)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

fn rate(jobs: usize, elapsed: Duration) -> (f64, f64) {
    let secs = elapsed.as_secs_f64();
    let per_sec = if secs > 0.0 { jobs as f64 / secs } else { 0.0 };
    ((secs * 1000.0).round() / 1000.0, per_sec.round())
}

/// apalis refuses to register a worker whose name is still alive in `apalis.workers`,
/// so every worker of every case gets a fresh name.
static WORKER_SEQ: AtomicUsize = AtomicUsize::new(0);

/// The no-op job: the argument is the job's index, the handler does nothing.
async fn noop(_n: u64) -> Result<(), BoxDynError> {
    Ok(())
}

async fn connect(options: PgConnectOptions) -> Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await
        .context("connecting to PostgreSQL")
}

fn storage(pool: &PgPool, queue: &str, batch: usize) -> Result<PostgresStorage<u64>> {
    if batch == 0 {
        bail!("--batch must be at least 1");
    }
    // Only the fetch batch is tuned; locking and result persistence stay on (apalis defaults),
    // so every job is acknowledged as Done in the table, as its users run it.
    let config = Config::default().queue(queue).batch_size(batch);
    Ok(PostgresStorage::new(pool).with_config(config))
}

/// Pushes `jobs` no-op jobs with `push_bulk`, `chunk` per call (0 = one call).
async fn push(pool: &PgPool, queue: &str, jobs: usize, chunk: usize) -> Result<()> {
    let mut backend = storage(pool, queue, 10)?;
    let chunk = if chunk == 0 { jobs.max(1) } else { chunk };
    let mut start = 0usize;
    while start < jobs {
        let end = (start + chunk).min(jobs);
        let args: Vec<u64> = (start as u64..end as u64).collect();
        backend
            .push_bulk(args)
            .await
            .map_err(|e| anyhow::anyhow!("push_bulk: {e}"))?;
        start = end;
    }
    Ok(())
}

struct Counts {
    done: i64,
    failed: i64,
}

async fn counts(pool: &PgPool, queue: &str) -> Result<Counts> {
    let row: (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'Done'), \
                count(*) FILTER (WHERE status IN ('Failed', 'Killed') AND done_at IS NOT NULL) \
         FROM apalis.jobs WHERE job_type = $1",
    )
    .bind(queue)
    .fetch_one(pool)
    .await
    .context("counting job statuses")?;
    Ok(Counts {
        done: row.0,
        failed: row.1,
    })
}

/// Starts `workers` apalis workers on `queue`; they stop when `stop` turns true.
fn spawn_workers(
    pool: &PgPool,
    queue: &str,
    workers: usize,
    batch: usize,
    stop: &watch::Receiver<bool>,
) -> Result<Vec<JoinHandle<Result<()>>>> {
    let mut handles = Vec::with_capacity(workers);
    for _ in 0..workers {
        // LISTEN/NOTIFY wakes a worker as soon as jobs are inserted (what `mixed` needs);
        // the interval is the fallback poll once a fetch came back empty.
        let backend = storage(pool, queue, batch)?
            .with_pubsub()
            .poll_with_strategy(Strategy::new().interval(Duration::from_millis(100)));
        let seq = WORKER_SEQ.fetch_add(1, Ordering::Relaxed);
        let worker = WorkerBuilder::new(format!("{queue}-{}-w{seq}", std::process::id()))
            .backend(backend)
            .build(noop);
        let mut stop = stop.clone();
        handles.push(tokio::spawn(async move {
            let signal = async move {
                while !*stop.borrow_and_update() {
                    if stop.changed().await.is_err() {
                        break;
                    }
                }
                Ok::<(), std::io::Error>(())
            };
            worker
                .run_until(signal)
                .await
                .map_err(|e| anyhow::anyhow!("worker: {e}"))
        }));
    }
    Ok(handles)
}

/// Waits until `target` more jobs than `baseline` are committed Done (or failed);
/// fails if every worker has ended before that.
async fn wait_done(
    pool: &PgPool,
    queue: &str,
    baseline: &Counts,
    target: usize,
    handles: &mut Vec<JoinHandle<Result<()>>>,
) -> Result<i64> {
    let deadline = Instant::now() + Duration::from_secs(3600);
    let mut last_finished = 0i64;
    let mut last_poll = Instant::now();
    loop {
        if !handles.is_empty() && handles.iter().all(|h| h.is_finished()) {
            for h in handles.drain(..) {
                h.await.context("worker task panicked")??;
            }
            bail!("all workers stopped before {target} jobs were done");
        }
        let c = counts(pool, queue).await?;
        let finished = (c.done - baseline.done) + (c.failed - baseline.failed);
        if finished >= target as i64 {
            return Ok(c.failed - baseline.failed);
        }
        if Instant::now() > deadline {
            bail!("timed out: {finished} of {target} jobs finished");
        }
        // Each poll is a scan of the jobs table, which competes with apalis for PostgreSQL's
        // CPU: poll every 100 ms, and sooner only when the jobs left should finish before that.
        let now = Instant::now();
        let progressed = finished - last_finished;
        let since = now.duration_since(last_poll).as_secs_f64();
        let remaining = (target as i64 - finished) as f64;
        let wait = if progressed > 0 && since > 0.0 {
            remaining / (progressed as f64 / since)
        } else {
            0.1
        };
        last_finished = finished;
        last_poll = now;
        tokio::time::sleep(Duration::from_secs_f64(wait.clamp(0.005, 0.1))).await;
    }
}

async fn stop_workers(stop: watch::Sender<bool>, handles: Vec<JoinHandle<Result<()>>>) -> Result<()> {
    stop.send_replace(true);
    for h in handles {
        match tokio::time::timeout(Duration::from_secs(30), h).await {
            Ok(joined) => joined.context("worker task panicked")??,
            Err(_) => eprintln!("apalis-baseline: a worker did not stop within 30 s"),
        }
    }
    Ok(())
}

async fn run_enqueue(pool: &PgPool, queue: &str, jobs: usize, chunk: usize) -> Result<()> {
    let t0 = Instant::now();
    push(pool, queue, jobs, chunk).await?;
    let (seconds, jobs_per_sec) = rate(jobs, t0.elapsed());
    emit(&Report {
        case: "enqueue",
        workers: None,
        batch: None,
        chunk: Some(if chunk == 0 { jobs } else { chunk }),
        jobs,
        seconds,
        jobs_per_sec,
        failed: None,
    })
}

async fn run_drain(
    pool: &PgPool,
    case: &'static str,
    queue: &str,
    jobs: usize,
    workers: usize,
    batch: usize,
) -> Result<()> {
    let baseline = counts(pool, queue).await?;
    let (tx, rx) = watch::channel(false);
    let t0 = Instant::now();
    let mut handles = spawn_workers(pool, queue, workers, batch, &rx)?;
    let failed = wait_done(pool, queue, &baseline, jobs, &mut handles).await?;
    let elapsed = t0.elapsed();
    stop_workers(tx, handles).await?;
    let (seconds, jobs_per_sec) = rate(jobs, elapsed);
    emit(&Report {
        case,
        workers: Some(workers),
        batch: Some(batch),
        chunk: None,
        jobs,
        seconds,
        jobs_per_sec,
        failed: Some(failed),
    })
}

async fn run_mixed(
    pool: &PgPool,
    queue: &str,
    jobs: usize,
    workers: usize,
    batch: usize,
    chunk: usize,
) -> Result<()> {
    let baseline = counts(pool, queue).await?;
    let (tx, rx) = watch::channel(false);
    let t0 = Instant::now();
    let mut handles = spawn_workers(pool, queue, workers, batch, &rx)?;
    let producer = {
        let pool = pool.clone();
        let queue = queue.to_owned();
        tokio::spawn(async move { push(&pool, &queue, jobs, chunk).await })
    };
    producer.await.context("producer task panicked")??;
    let enqueued = t0.elapsed();
    let failed = wait_done(pool, queue, &baseline, jobs, &mut handles).await?;
    let elapsed = t0.elapsed();
    stop_workers(tx, handles).await?;
    let (seconds, jobs_per_sec) = rate(jobs, elapsed);
    eprintln!(
        "apalis-baseline: mixed: all {jobs} enqueued after {:.3} s",
        enqueued.as_secs_f64()
    );
    emit(&Report {
        case: "mixed",
        workers: Some(workers),
        batch: Some(batch),
        chunk: Some(chunk),
        jobs,
        seconds,
        jobs_per_sec,
        failed: Some(failed),
    })
}

async fn reset(pool: &PgPool) -> Result<()> {
    // A stopped worker can leave its connection idle in a transaction (seen once: the
    // TRUNCATE then waited for its lock forever). Nothing of the previous case still runs.
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND state = 'idle in transaction' AND pid <> pg_backend_pid()",
    )
    .execute(pool)
    .await
    .context("ending idle transactions of the previous case")?;
    sqlx::query("TRUNCATE apalis.jobs")
        .execute(pool)
        .await
        .context("truncating apalis.jobs")?;
    sqlx::query("VACUUM ANALYZE apalis.jobs")
        .execute(pool)
        .await
        .context("vacuuming apalis.jobs")?;
    Ok(())
}

async fn run_all(args: &Args, server: PgConnectOptions) -> Result<()> {
    let admin = connect(server.clone()).await?;
    let db = format!("apalis_bench_{}", std::process::id());
    // `db` is `apalis_bench_` and digits: nothing to inject.
    sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&admin)
        .await
        .with_context(|| format!("creating database {db}"))?;
    eprintln!("apalis-baseline: created database {db}");
    let result = async {
        let pool = connect(server.clone().database(&db)).await?;
        PostgresStorage::setup(&pool)
            .await
            .context("apalis-postgres migrations")?;
        let q = "apalis-baseline";
        let n = args.jobs;

        reset(&pool).await?;
        run_enqueue(&pool, q, n, args.chunk).await?;
        run_drain(&pool, "drain", q, n, args.workers, args.batch).await?;

        // The single-worker figure (1 x 1000-2000), for context.
        reset(&pool).await?;
        push(&pool, q, n, args.chunk).await?;
        run_drain(&pool, "drain", q, n, 1, 2000).await?;

        reset(&pool).await?;
        run_mixed(&pool, q, n, args.workers, args.batch, args.mixed_chunk).await?;

        // apalis-postgres at its default batch size (10), one worker, on a smaller N.
        reset(&pool).await?;
        push(&pool, q, args.default_batch_jobs, 0).await?;
        run_drain(
            &pool,
            "drain_default_batch",
            q,
            args.default_batch_jobs,
            1,
            Config::default().batch_size,
        )
        .await?;
        pool.close().await;
        Ok::<(), anyhow::Error>(())
    }
    .await;
    let dropped = sqlx::query(AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .with_context(|| format!("dropping database {db}"));
    admin.close().await;
    result?;
    dropped?;
    eprintln!("apalis-baseline: dropped database {db}");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let options = PgConnectOptions::from_str(&args.database_url).context("parsing --database-url")?;
    if args.mode == Mode::All {
        return run_all(&args, options).await;
    }
    let pool = connect(options).await?;
    PostgresStorage::setup(&pool)
        .await
        .context("apalis-postgres migrations")?;
    match args.mode {
        Mode::Enqueue => run_enqueue(&pool, &args.queue, args.jobs, args.chunk).await?,
        Mode::Drain => run_drain(&pool, "drain", &args.queue, args.jobs, args.workers, args.batch).await?,
        Mode::Mixed => {
            run_mixed(
                &pool,
                &args.queue,
                args.jobs,
                args.workers,
                args.batch,
                args.mixed_chunk,
            )
            .await?
        }
        Mode::All => {}
    }
    pool.close().await;
    Ok(())
}
