//! `tollgate bench --case ingest`: a batch input file of `--jobs` lines becoming queued
//! jobs (`POST /v1/batches` over an uploaded file: read, split, validate, estimate, insert),
//! beside its floor — PostgreSQL inserting the same rows with nothing else to do, in the
//! same chunks and one transaction — and beside `POST /v1/jobs/bulk` for the same jobs.
//! Then the whole OpenAI flow end to end (upload the file, create the batch, poll until it
//! is `completed`), timed from the upload's first byte, beside the same jobs submitted in
//! bulk and run until all finished, each on a fresh broker that also dispatches.

use std::time::Instant;

use anyhow::Context;
use serde_json::{Value, json};

use super::{BenchArgs, rate, request, stack_for, submit_in_bulks, wait_finished};
use tollgate_api::broker::Roles;

#[allow(clippy::print_stdout)]
pub(crate) async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let lines: Vec<Value> = (0..args.jobs)
        .map(|i| json!({"custom_id": format!("r{i}"), "method": "POST", "url": "/v1/chat/completions", "body": request(i)}))
        .collect();
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let http = reqwest::Client::new();

    // tollgate: upload, then time the batch's creation (the ingest happens in the request).
    let stack = stack_for(args, Roles::API_ONLY).await?;
    let file_id = upload(&http, &stack.api, text.as_bytes()).await?;
    let begin = Instant::now();
    let created = http
        .post(format!("{}/v1/batches", stack.api))
        .bearer_auth("tk-bench")
        .json(&json!({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await?;
    let ingest = begin.elapsed();
    anyhow::ensure!(
        created.status().is_success(),
        "creating the batch: {}",
        created.text().await?
    );
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE batch_id IS NOT NULL")
        .fetch_one(&stack.pool)
        .await?;
    anyhow::ensure!(
        queued == args.jobs as i64,
        "{queued} of {} lines became jobs",
        args.jobs
    );

    // Floor: the same rows inserted by PostgreSQL alone, chunk by chunk, one transaction.
    let chunk = tollgate::config::BatchesConfig::default().insert_chunk.max(1);
    let begin = Instant::now();
    let mut tx = stack.pool.begin().await?;
    for part in lines.chunks(chunk) {
        let ids: Vec<uuid::Uuid> = part.iter().map(|_| uuid::Uuid::now_v7()).collect();
        let bodies: Vec<&Value> = part.iter().map(|l| &l["body"]).collect();
        sqlx::query(
            "INSERT INTO jobs (id, tenant, class, priority, request, model, deadline, not_before, max_attempts,
                               estimated_input_tokens, estimated_output_tokens, created_at)
             SELECT id, 'bench', 'batch', 0, body, 'oai/gpt-4o-mini', now() + interval '1 day', now(), 6, 12, 8, now()
             FROM unnest($1::uuid[], $2::jsonb[]) AS t(id, body)",
        )
        .bind(ids)
        .bind(bodies)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    let floor = begin.elapsed();

    // The same jobs through `POST /v1/jobs/bulk`, 4 requests in flight.
    let begin = Instant::now();
    let failed = submit_in_bulks(&http, &stack.api, args.jobs).await;
    let bulk = begin.elapsed();
    anyhow::ensure!(failed == 0, "{failed} bulk submissions failed");
    stack.stop().await?;

    println!(
        "\n### ingest: a batch file of {} lines ({:.1} MB) into the queue\n",
        args.jobs,
        text.len() as f64 / 1e6
    );
    println!("| case | s | lines/s | ratio to the floor |");
    println!("|---|---:|---:|---:|");
    let floor_rate = rate(args.jobs, floor);
    for (name, d) in [
        ("floor: PostgreSQL inserting the same rows, nothing else", floor),
        ("tollgate: `POST /v1/batches` over the uploaded file", ingest),
        (
            "tollgate: `POST /v1/jobs/bulk`, 2,000 per request, 4 in flight",
            bulk,
        ),
    ] {
        println!(
            "| {name} | {:.2} | {:.0} | {:.2} |",
            d.as_secs_f64(),
            rate(args.jobs, d),
            rate(args.jobs, d) / floor_rate
        );
    }
    flow(args, &text).await
}

/// The Files + Batches flow end to end beside the bulk path's, each on a fresh broker.
#[allow(clippy::print_stdout)]
async fn flow(args: &BenchArgs, text: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let stack = stack_for(args, Roles::ALL).await?;
    let begin = Instant::now();
    let failed = submit_in_bulks(&http, &stack.api, args.jobs).await;
    anyhow::ensure!(failed == 0, "{failed} bulk submissions failed");
    let (succeeded, _) = wait_finished(&stack.pool, args.jobs as i64).await?;
    let bulk = begin.elapsed();
    anyhow::ensure!(
        succeeded == args.jobs as i64,
        "bulk: {succeeded} of {} succeeded",
        args.jobs
    );
    let bulk_stages = Stages::read(&stack.pool, None).await?;
    stack.stop().await?;

    let stack = stack_for(args, Roles::ALL).await?;
    let begin = Instant::now();
    let file_id = upload(&http, &stack.api, text.as_bytes()).await?;
    let uploaded = begin.elapsed();
    let created: Value = http
        .post(format!("{}/v1/batches", stack.api))
        .bearer_auth("tk-bench")
        .json(&json!({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}))
        .send()
        .await?
        .json()
        .await?;
    let batch_id = created["id"]
        .as_str()
        .with_context(|| format!("creating the batch: {created}"))?
        .to_owned();
    let created_after = begin.elapsed();
    let status_url = format!("{}/v1/batches/{batch_id}", stack.api);
    let batch = loop {
        let batch: Value = http
            .get(&status_url)
            .bearer_auth("tk-bench")
            .send()
            .await?
            .json()
            .await?;
        match batch["status"].as_str() {
            Some("completed") => break batch,
            Some("failed" | "expired" | "cancelled") => anyhow::bail!("the batch ended {batch}"),
            _ => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    };
    let completed = begin.elapsed();
    let flow_stages = Stages::read(&stack.pool, Some(&batch_id)).await?;
    stack.stop().await?;
    anyhow::ensure!(
        batch["request_counts"]["completed"] == json!(args.jobs),
        "not every line completed: {batch}"
    );

    println!(
        "\n### the Files + Batches flow end to end: {} lines, upload to `completed`\n",
        args.jobs
    );
    println!("| case | s | lines/s | ratio to the bulk path |");
    println!("|---|---:|---:|---:|");
    let bulk_rate = rate(args.jobs, bulk);
    for (name, d) in [
        ("bulk path: `POST /v1/jobs/bulk` until every job finished", bulk),
        ("flow: upload (`POST /v1/files`)", uploaded),
        ("flow: … + create (`POST /v1/batches`, the ingest)", created_after),
        ("flow: … + run until `completed` (polled every 20 ms)", completed),
    ] {
        println!(
            "| {name} | {:.2} | {:.0} | {:.2} |",
            d.as_secs_f64(),
            rate(args.jobs, d),
            rate(args.jobs, d) / bulk_rate
        );
    }
    println!(
        "\nWhere the time went, from the job rows (s after the first job's row was written): \
         the last admitted, started and finished, and the batch's `completed`.\n"
    );
    println!("| path | last admitted | last started | last finished | completed |");
    println!("|---|---:|---:|---:|---:|");
    for (name, st) in [("bulk path", bulk_stages), ("flow", flow_stages)] {
        let completed = st.completed.map_or("–".to_owned(), |c| format!("{c:.2}"));
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {completed} |",
            st.admitted, st.started, st.finished
        );
    }
    Ok(())
}

/// When a run's last job was admitted, started and finished, and its batch completed, in
/// seconds after its first job's row was written.
struct Stages {
    admitted: f64,
    started: f64,
    finished: f64,
    completed: Option<f64>,
}

impl Stages {
    async fn read(pool: &sqlx::PgPool, batch: Option<&str>) -> anyhow::Result<Self> {
        let (admitted, started, finished, completed): (f64, f64, f64, Option<f64>) = sqlx::query_as(
            "SELECT extract(epoch FROM max(admitted_at) - min(created_at))::float8,
                    extract(epoch FROM max(started_at) - min(created_at))::float8,
                    extract(epoch FROM max(finished_at) - min(created_at))::float8,
                    extract(epoch FROM (SELECT completed_at FROM batches WHERE id = $1) - min(created_at))::float8
             FROM jobs",
        )
        .bind(batch)
        .fetch_one(pool)
        .await?;
        Ok(Self {
            admitted,
            started,
            finished,
            completed,
        })
    }
}

/// Uploads `content` as a batch input file; its id.
async fn upload(http: &reqwest::Client, api: &str, content: &[u8]) -> anyhow::Result<String> {
    let boundary = "tollgate-bench-boundary";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"input.jsonl\"\r\n\
         Content-Type: application/jsonl\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(content);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let r = http
        .post(format!("{api}/v1/files"))
        .bearer_auth("tk-bench")
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(body)
        .send()
        .await?;
    let status = r.status();
    let file: Value = r.json().await?;
    anyhow::ensure!(status.is_success(), "uploading the file: {file}");
    file["id"]
        .as_str()
        .map(str::to_owned)
        .context("the uploaded file has no id")
}
