//! `tollgate bench --case scale`: the gate admitting while a million jobs wait.
//!
//! `--jobs` admissions are timed twice on one database, with `--tenants` configured
//! tenants (each with its own rpm and tpm bucket, so every job goes through four buckets):
//! first from a queue holding only those jobs, then from a queue holding `--backlog` jobs
//! spread over every tenant. Reported: admissions per second, the gate's round time (what
//! a newly queued job waits for at most once it is first in line), this process's
//! resident memory (the broker keeps nothing per queued job) and the size of the hot
//! indexes.

use std::time::{Duration, Instant};

use tollgate::config::Config;
use tollgate::notify::Notifications;
use tollgate_workers::gate::Gate;

use super::{BenchArgs, insert_queued, mock_config, rate, unbound_provider};
use crate::local::LocalStack;
use tollgate_api::broker::Roles;

fn config(mock: std::net::SocketAddr, tenants: usize) -> anyhow::Result<Config> {
    let mut text = format!(
        "[database]\nmax_connections = 16\n[gate]\ninteractive_reserve = 0.0\n{}",
        unbound_provider(mock)
    );
    for t in 0..tenants {
        text.push_str(&format!(
            "[[tenants]]\nname = \"t{t}\"\napi_key = \"tk-t{t}\"\nrpm = 100000000\ntpm = 100000000000\n"
        ));
    }
    Ok(Config::parse(&text, "bench scale config")?)
}

struct Admitted {
    wall: Duration,
    rounds: Vec<Duration>,
}

/// Runs gate rounds until `n` jobs are admitted.
async fn admit(gate: &Gate, n: usize) -> anyhow::Result<Admitted> {
    let begin = Instant::now();
    let (mut total, mut rounds) = (0, Vec::new());
    while total < n {
        let at = Instant::now();
        let round = gate.run_once(chrono::Utc::now()).await?;
        rounds.push(at.elapsed());
        anyhow::ensure!(
            round.admitted > 0,
            "a round admitted nothing after {total} admissions"
        );
        total += round.admitted;
    }
    Ok(Admitted {
        wall: begin.elapsed(),
        rounds,
    })
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// This process's resident memory, in MiB (Linux).
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

async fn index_sizes(pool: &sqlx::PgPool) -> anyhow::Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)
         FROM pg_index WHERE indrelid = 'jobs'::regclass ORDER BY 1",
    )
    .fetch_all(pool)
    .await?)
}

#[allow(clippy::print_stdout)]
pub(crate) async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let (measured, tenants) = (args.jobs, args.tenants.max(1));
    let stack = LocalStack::start(
        "bench_scale",
        args.data_dir.clone(),
        mock_config(),
        Roles::API_ONLY,
        |addr| config(addr, tenants),
    )
    .await?;
    let pool = stack.pool.clone();
    let config = std::sync::Arc::new(config(stack.mock_addr, tenants)?);

    let names: Vec<String> = (0..tenants).map(|t| format!("t{t}")).collect();
    insert_queued(&pool, measured, &names).await?;
    let rss_empty_before = rss_mib();
    let gate = Gate::new(pool.clone(), config.clone(), Notifications::default());
    let mut empty = admit(&gate, measured).await?;
    let rss_empty_after = rss_mib();
    sqlx::query("DELETE FROM jobs").execute(&pool).await?;
    sqlx::query("DELETE FROM job_attempts").execute(&pool).await?;

    let begin = Instant::now();
    insert_queued(&pool, args.backlog, &names).await?;
    let insert_secs = begin.elapsed().as_secs_f64();
    let sizes = index_sizes(&pool).await?;
    let rss_loaded_before = rss_mib();
    let gate = Gate::new(pool.clone(), config, Notifications::default());
    let mut loaded = admit(&gate, measured).await?;
    let rss_loaded_after = rss_mib();
    stack.stop().await?;

    // Which round was the slowest (1 = the first of a new gate, which loads its state).
    let slowest_at = |a: &Admitted| {
        a.rounds
            .iter()
            .enumerate()
            .max_by_key(|(_, d)| **d)
            .map_or(0, |(i, _)| i + 1)
    };
    let slowest = (slowest_at(&empty), slowest_at(&loaded));
    empty.rounds.sort();
    loaded.rounds.sort();
    println!(
        "\n### scale: {measured} admissions, queue of {measured} vs. {} jobs over {tenants} tenants\n",
        args.backlog
    );
    // With a few dozen rounds a p99 is the slowest round: p90 says more of the tail.
    println!(
        "| queue | admissions/s | rounds | round p50 ms | round p90 ms | slowest round ms | RSS before → after MiB |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|");
    for (name, a, rss) in [
        (
            format!("{measured} queued"),
            &empty,
            (rss_empty_before, rss_empty_after),
        ),
        (
            format!("{} queued", args.backlog),
            &loaded,
            (rss_loaded_before, rss_loaded_after),
        ),
    ] {
        println!(
            "| {name} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.0} → {:.0} |",
            rate(measured, a.wall),
            a.rounds.len(),
            percentile(&a.rounds, 0.5),
            percentile(&a.rounds, 0.9),
            percentile(&a.rounds, 1.0),
            rss.0,
            rss.1
        );
    }
    println!(
        "\nratio admissions/s loaded ÷ empty: {:.2}; round p50, p90, slowest loaded ÷ empty: {:.2}, {:.2}, {:.2}",
        empty.wall.as_secs_f64() / loaded.wall.as_secs_f64(),
        percentile(&loaded.rounds, 0.5) / percentile(&empty.rounds, 0.5).max(1e-9),
        percentile(&loaded.rounds, 0.9) / percentile(&empty.rounds, 0.9).max(1e-9),
        percentile(&loaded.rounds, 1.0) / percentile(&empty.rounds, 1.0).max(1e-9)
    );
    println!(
        "slowest round: number {} of {} (empty), number {} of {} (loaded)",
        slowest.0,
        empty.rounds.len(),
        slowest.1,
        loaded.rounds.len()
    );
    println!("backlog inserted in {insert_secs:.1} s; index sizes with the backlog queued:\n");
    println!("| index | MiB |");
    println!("|---|---:|");
    for (name, bytes) in sizes {
        println!("| {name} | {:.1} |", bytes as f64 / 1048576.0);
    }
    Ok(())
}
