//! Batch finalization: a maintenance step that ends batches — completed when their last
//! job finished, `expired` when their window ended (unfinished jobs are cancelled as
//! `batch_expired`), `cancelled` after a cancel — and writes their output and error
//! files from the database. Every input line appears exactly once in one of the two
//! files: rejected lines and failed jobs in the error file, succeeded jobs in the output
//! file, joined on `custom_id`. Files, counts, status and the batch's webhook event are
//! written in one transaction with the batch row locked, so a crash at any point leaves
//! the batch open and the next pass (in any process) writes it whole.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};
use tollgate::batches::{BatchRow, FileRow, PURPOSE_BATCH_OUTPUT, new_file_id};
use tollgate::model::JobState;
use tollgate::store::{self, BatchEnd, BatchJobResult, LineError, StoreError};
use tollgate::vocab::{BatchStatus, ReasonCode};

/// Bytes per stored chunk of a file.
pub const FILE_CHUNK_BYTES: usize = 1024 * 1024;
/// Jobs read per query while writing the files.
const PAGE: i64 = 2000;
/// Batches looked at per pass.
const BATCHES_PER_PASS: i64 = 16;
/// Rejected lines listed in a failed batch's `errors` (all are in its error file).
const MAX_LISTED_ERRORS: usize = 100;

#[derive(Clone)]
pub struct BatchFinalizer {
    pool: PgPool,
}

impl BatchFinalizer {
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Finalizes every batch that is due at `now`; returns how many ended.
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let mut ended = 0;
        for id in store::batches_to_finalize(&self.pool, now, BATCHES_PER_PASS).await? {
            if self.finalize(&id, now).await?.is_some() {
                ended += 1;
            }
        }
        Ok(ended)
    }

    /// Ends one batch if it is due; `None` if it is not (or another process has it).
    pub async fn finalize(&self, id: &str, now: DateTime<Utc>) -> Result<Option<BatchRow>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let Some(batch) = store::lock_open_batch(&mut tx, id).await? else {
            return Ok(None);
        };
        let open = store::batch_has_open_jobs(&mut *tx, id).await?;
        let status = if batch.status() == BatchStatus::Cancelling {
            let code = ReasonCode::BatchCancelled.as_str();
            store::cancel_batch_jobs(&mut tx, id, code, "the batch was cancelled", now).await?;
            BatchStatus::Cancelled
        } else if !open && batch.total == batch.rejected {
            BatchStatus::Failed
        } else if !open {
            // Every job ended in time, even if this pass comes after the window closed.
            BatchStatus::Completed
        } else if batch.expires_at <= now {
            store::cancel_batch_jobs(
                &mut tx,
                id,
                ReasonCode::BatchExpired.as_str(),
                "the batch's completion window ended before this request finished",
                now,
            )
            .await?;
            BatchStatus::Expired
        } else {
            return Ok(None);
        };
        let mut end = write_files(&mut tx, &batch, status, now).await?;
        if status == BatchStatus::Failed {
            end.errors = Some(listed_errors(&store::line_errors(&mut *tx, id).await?));
        }
        let row = store::finish_batch(&mut tx, id, &end, now).await?;
        if let Some(event) = status.event_type() {
            let body = event_body(event, &row, now);
            store::enqueue_event(&mut *tx, &row.tenant, Some(&row.id), event, &body, now).await?;
        }
        tx.commit().await?;
        tracing::info!(
            batch = id,
            status = status.as_str(),
            completed = end.completed,
            failed = end.failed,
            "batch finished"
        );
        Ok(Some(row))
    }
}

/// A batch's `errors` object when no line was valid: the first rejected lines.
fn listed_errors(errors: &[LineError]) -> Value {
    let data: Vec<Value> = errors
        .iter()
        .take(MAX_LISTED_ERRORS)
        .map(|e| json!({"code": e.code, "line": e.line, "message": e.message, "param": null}))
        .collect();
    json!({"object": "list", "data": data})
}

/// The webhook body announcing a batch's end (Standard Webhooks' `{type, timestamp, data}`).
pub fn event_body(event: &str, b: &BatchRow, now: DateTime<Utc>) -> String {
    json!({
        "type": event,
        "timestamp": now.to_rfc3339_opts(SecondsFormat::Micros, true),
        "data": {
            "id": b.id,
            "object": "batch",
            "status": b.status,
            "output_file_id": b.output_file_id,
            "error_file_id": b.error_file_id,
            "request_counts": {
                "total": b.total,
                "completed": b.completed,
                "failed": b.failed,
            },
        },
    })
    .to_string()
}

/// One output/error line for a job, and whether it goes to the output file.
pub fn job_line(job: &BatchJobResult, status: BatchStatus) -> (bool, Value) {
    let id = format!("batch_req_{}", job.id.0.simple());
    if job.state == JobState::Succeeded {
        let line = json!({
            "id": id,
            "custom_id": job.custom_id,
            "response": {
                "status_code": 200,
                "request_id": job.provider_request_id,
                "body": job.result,
            },
            "error": null,
        });
        return (true, line);
    }
    let code = line_code(job, status);
    let message = job
        .error_message
        .clone()
        .unwrap_or_else(|| format!("the request ended {}", job.state.as_str()));
    let line = json!({
        "id": id,
        "custom_id": job.custom_id,
        "response": null,
        "error": {"code": code, "message": message},
    });
    (false, line)
}

/// The error code of an unsuccessful job's line: `batch_expired` and `batch_cancelled` for
/// lines the batch's end stopped, else the job's own.
fn line_code(job: &BatchJobResult, status: BatchStatus) -> &str {
    match job.error_code.as_deref().and_then(ReasonCode::parse) {
        Some(ReasonCode::DeadlineExceeded | ReasonCode::BatchExpired) => ReasonCode::BatchExpired.as_str(),
        Some(ReasonCode::BatchCancelled) => ReasonCode::BatchCancelled.as_str(),
        Some(ReasonCode::Cancelled) if status == BatchStatus::Cancelled => {
            ReasonCode::BatchCancelled.as_str()
        }
        _ => job.error_code.as_deref().unwrap_or("failed"),
    }
}

/// A rejected input line in the error file.
fn rejected_line(batch_id: &str, e: &LineError) -> Value {
    json!({
        "id": format!("batch_req_{}_line{}", batch_id.trim_start_matches("batch_"), e.line),
        "custom_id": e.custom_id,
        "response": null,
        "error": {"code": e.code, "message": format!("line {}: {}", e.line, e.message)},
    })
}

/// Writes the output and error files of `batch` and returns how it ended.
async fn write_files(
    conn: &mut PgConnection,
    batch: &BatchRow,
    status: BatchStatus,
    now: DateTime<Utc>,
) -> Result<BatchEnd, StoreError> {
    let expires_at = now + chrono::Duration::seconds(batch.output_expires_secs);
    let mut output = FileWriter::new(batch, "output", now, expires_at);
    let mut errors = FileWriter::new(batch, "error", now, expires_at);
    for e in store::line_errors(&mut *conn, &batch.id).await? {
        errors.push(conn, &rejected_line(&batch.id, &e)).await?;
    }
    let (mut input, mut output_tokens, mut cached) = (0i64, 0i64, 0i64);
    let (mut cancelled, mut expired) = (0, 0);
    let mut after = 0;
    loop {
        let page = store::batch_results_page(&mut *conn, &batch.id, after, PAGE).await?;
        let Some(last) = page.last() else { break };
        after = last.batch_line;
        for job in &page {
            if let Some(u) = &job.usage {
                let get = |k: &str| u.get(k).and_then(Value::as_i64).unwrap_or(0);
                input += get("input_tokens");
                output_tokens += get("output_tokens");
                cached += get("cached_tokens");
            }
            let (ok, line) = job_line(job, status);
            if !ok {
                match ReasonCode::parse(line_code(job, status)) {
                    Some(ReasonCode::BatchCancelled) => cancelled += 1,
                    Some(ReasonCode::BatchExpired) => expired += 1,
                    _ => {}
                }
            }
            if ok {
                output.push(conn, &line).await?;
            } else {
                errors.push(conn, &line).await?;
            }
        }
    }
    let completed = output.lines;
    let failed = errors.lines;
    Ok(BatchEnd {
        status,
        output_file_id: output.finish(conn).await?,
        error_file_id: errors.finish(conn).await?,
        completed: completed as i32,
        failed: failed as i32,
        cancelled,
        expired,
        usage: json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input + output_tokens,
        }),
        errors: None,
    })
}

/// Writes a JSONL file chunk by chunk; the file exists only if a line was pushed.
struct FileWriter {
    row: FileRow,
    created: bool,
    buf: Vec<u8>,
    seq: i32,
    lines: i64,
}

impl FileWriter {
    fn new(batch: &BatchRow, kind: &str, now: DateTime<Utc>, expires_at: DateTime<Utc>) -> Self {
        Self {
            row: FileRow {
                id: new_file_id(),
                tenant: batch.tenant.clone(),
                purpose: PURPOSE_BATCH_OUTPUT.to_owned(),
                filename: format!("{}_{kind}.jsonl", batch.id),
                bytes: 0,
                lines: 0,
                created_at: now,
                expires_at: Some(expires_at),
            },
            created: false,
            buf: Vec::with_capacity(FILE_CHUNK_BYTES + 4096),
            seq: 0,
            lines: 0,
        }
    }

    async fn push(&mut self, conn: &mut PgConnection, line: &Value) -> Result<(), StoreError> {
        serde_json::to_writer(&mut self.buf, line)?;
        self.buf.push(b'\n');
        self.lines += 1;
        if self.buf.len() >= FILE_CHUNK_BYTES {
            self.flush(conn).await?;
        }
        Ok(())
    }

    async fn flush(&mut self, conn: &mut PgConnection) -> Result<(), StoreError> {
        if !self.created {
            store::insert_file(&mut *conn, &self.row).await?;
            self.created = true;
        }
        if !self.buf.is_empty() {
            store::insert_chunk(&mut *conn, &self.row.id, self.seq, &self.buf).await?;
            self.row.bytes += self.buf.len() as i64;
            self.seq += 1;
            self.buf.clear();
        }
        Ok(())
    }

    /// The file's id, or `None` if it has no line.
    async fn finish(mut self, conn: &mut PgConnection) -> Result<Option<String>, StoreError> {
        if self.lines == 0 {
            return Ok(None);
        }
        self.flush(conn).await?;
        self.row.lines = self.lines;
        store::set_file_size(&mut *conn, &self.row).await?;
        Ok(Some(self.row.id))
    }
}
