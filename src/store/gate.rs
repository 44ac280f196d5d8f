//! What the gate reads and writes: the active (class, tenant) queues, the best queued
//! jobs of each, admissions, explanations and early failures.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use super::{CHANNEL_JOBS_READY, Result};
use crate::model::{Endpoint, JobClass, JobId};
use crate::vocab::{PriceSource, ReasonCode};

/// The (class, tenant) pairs with queued work: a loose index scan over `jobs_gate`, one
/// probe per pair, however many jobs are queued.
pub async fn active_queues(ex: impl PgExecutor<'_>) -> Result<Vec<(JobClass, String)>> {
    let pairs = sqlx::query!(
        r#"WITH RECURSIVE pairs AS (
               (SELECT class, tenant FROM jobs WHERE state = 'queued' AND NOT held ORDER BY class, tenant LIMIT 1)
               UNION ALL
               SELECT n.class, n.tenant FROM pairs p, LATERAL (
                   SELECT class, tenant FROM jobs
                   WHERE state = 'queued' AND NOT held AND (class, tenant) > (p.class, p.tenant)
                   ORDER BY class, tenant LIMIT 1) n)
           SELECT class AS "class!: JobClass", tenant AS "tenant!" FROM pairs"#,
    )
    .fetch_all(ex)
    .await?;
    Ok(pairs.into_iter().map(|p| (p.class, p.tenant)).collect())
}

/// A queued job as the gate sees it: no request body, just what admission needs.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub id: JobId,
    pub tenant: String,
    pub class: JobClass,
    pub priority: i32,
    pub endpoint: Endpoint,
    pub model: String,
    pub deadline: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub estimated_input_tokens: i32,
    pub estimated_output_tokens: i32,
    pub admission: Option<serde_json::Value>,
    /// Route targets that failed this job (fallback: try the others first).
    pub failed_targets: Option<Vec<String>>,
    /// `provider_batch` when the job goes through its provider's batch API.
    pub dispatch_via: Option<String>,
    /// Its client waits on an open stream, in the process that will claim it.
    pub stream: bool,
    /// The API key it was submitted with (its limits and budgets are on its path).
    pub api_key: Option<uuid::Uuid>,
    /// The batch it is a line of (its cost cap, if it has one, is on its path).
    pub batch_id: Option<String>,
}

impl Candidate {
    /// A job arriving now, as the gate would read it once queued.
    pub fn arriving(job: &crate::model::NewJob) -> Self {
        Self {
            id: job.id,
            tenant: job.tenant.clone(),
            class: job.class,
            priority: job.priority,
            endpoint: job.endpoint,
            model: job.model.clone(),
            deadline: job.deadline,
            created_at: job.created_at,
            estimated_input_tokens: job.estimated_input_tokens,
            estimated_output_tokens: job.estimated_output_tokens,
            admission: None,
            failed_targets: None,
            dispatch_via: None,
            api_key: job.api_key,
            stream: job.stream,
            batch_id: None,
        }
    }
}

/// Whether any interactive job is queued (one probe of `jobs_gate`).
pub async fn interactive_queued(ex: impl PgExecutor<'_>) -> Result<bool> {
    Ok(sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM jobs WHERE state = 'queued' AND NOT held AND class = 'interactive') AS "queued!""#,
    )
    .fetch_one(ex)
    .await?)
}

/// The first `per_queue` runnable jobs of each queue, in the order the tenant wants them
/// served: priority, then earliest deadline — and, in that order among them, up to
/// `per_queue` more of its oldest submitted before the queue's `starving_before` (past its
/// class's starvation guard: they compete as interactive wherever they stand, and may
/// stand behind more jobs due sooner than the head read).
pub async fn candidates(
    ex: impl PgExecutor<'_>,
    queues: &[(JobClass, String)],
    starving_before: &[DateTime<Utc>],
    per_queue: i64,
    now: DateTime<Utc>,
) -> Result<Vec<Candidate>> {
    let classes: Vec<JobClass> = queues.iter().map(|q| q.0).collect();
    let tenants: Vec<&str> = queues.iter().map(|q| q.1.as_str()).collect();
    // The lateral subquery hides the columns' table from PostgreSQL's description, so
    // those that cannot be NULL say so (`!`). The starving read names what its index
    // (`jobs_gate_oldest`) leaves out, interactive jobs (they have no guard): the head's
    // read, which does not, can only be planned on `jobs_gate`, in its order.
    Ok(sqlx::query_as!(
        Candidate,
        r#"SELECT j.id AS "id!: JobId", j.tenant AS "tenant!", j.class AS "class!: JobClass",
                  j.priority AS "priority!", j.endpoint AS "endpoint!: Endpoint", j.model AS "model!", j.deadline AS "deadline!",
                  j.created_at AS "created_at!", j.estimated_input_tokens AS "estimated_input_tokens!",
                  j.estimated_output_tokens AS "estimated_output_tokens!", j.admission, j.failed_targets,
                  j.dispatch_via, j.stream AS "stream!", j.api_key, j.batch_id
           FROM unnest($1::job_class[], $2::text[], $5::timestamptz[]) AS q(class, tenant, starving_before),
           LATERAL (
               SELECT * FROM (
                   (SELECT id, tenant, class, priority, endpoint, model, deadline, created_at,
                           estimated_input_tokens, estimated_output_tokens, admission, failed_targets,
                           dispatch_via, stream, api_key, batch_id
                    FROM jobs
                    WHERE state = 'queued' AND NOT held AND class = q.class AND tenant = q.tenant
                      AND not_before <= $4 AND deadline > $4
                    ORDER BY priority DESC, deadline, id
                    LIMIT $3)
                   UNION
                   (SELECT id, tenant, class, priority, endpoint, model, deadline, created_at,
                           estimated_input_tokens, estimated_output_tokens, admission, failed_targets,
                           dispatch_via, stream, api_key, batch_id
                    FROM jobs
                    WHERE state = 'queued' AND NOT held AND class = q.class AND tenant = q.tenant
                      AND not_before <= $4 AND deadline > $4 AND created_at < q.starving_before
                      AND class <> 'interactive'
                    ORDER BY created_at
                    LIMIT $3)
               ) read
               ORDER BY priority DESC, deadline, id) j"#,
        &classes as &[JobClass],
        &tenants as &[&str],
        per_queue,
        now,
        starving_before,
    )
    .fetch_all(ex)
    .await?)
}

/// One admission: the target chosen and what it holds.
#[derive(Debug, Clone)]
pub struct Admission {
    pub id: JobId,
    pub provider: String,
    pub model: String,
    /// The provider key chosen, when keys have limits of their own.
    pub key: Option<String>,
    pub bucket_ids: Vec<i64>,
    pub amounts: Vec<f64>,
    /// What its estimate costs on the target chosen (shown on the job as `cost.reserved_usd`).
    pub cost: crate::buckets::EstimatedCost,
    /// Any dispatcher may run it (not a stream, which runs where its client is connected,
    /// nor a provider-batch line): the gate may start it in its own process.
    pub startable: bool,
}

impl Admission {
    /// Its reservation, in bucket id order.
    pub fn held(&self) -> (Vec<i64>, Vec<f64>) {
        let mut held: Vec<(i64, f64)> = self
            .bucket_ids
            .iter()
            .copied()
            .zip(self.amounts.iter().copied())
            .collect();
        held.sort_by_key(|h| h.0);
        held.into_iter().unzip()
    }
}

/// Who runs the jobs a round starts itself: the gate's own process's dispatcher.
#[derive(Debug, Clone, Copy)]
pub struct Starter<'a> {
    /// The dispatcher's `lease_owner`.
    pub owner: &'a str,
    /// How long its lease runs from the database's `now()`.
    pub lease: std::time::Duration,
}

/// What [`admit`] wrote.
#[derive(Debug, Default)]
pub struct Admitted {
    /// Admitted for any dispatcher to claim.
    pub waiting: Vec<JobId>,
    /// Admitted and claimed in the same write for the [`Starter`]: running, first attempt
    /// counted, leased to it. Their rows, as a claim returns them.
    pub started: Vec<crate::model::Job>,
}

impl Admitted {
    pub fn ids(&self) -> impl Iterator<Item = JobId> + '_ {
        self.waiting
            .iter()
            .copied()
            .chain(self.started.iter().map(|j| j.id))
    }
}

/// The admission `UPDATE`, setting `$state` (the new state's columns) as well, run by
/// `$query!` — [`query_jobs!`] for the rows, [`query_job_ids!`] for their ids — with
/// $1–$9 bound from `$admissions` ([`AdmissionArrays`]) and `now`, then `$arg`s from $10.
macro_rules! admit_query {
    ($query:ident!, $state:expr, $admissions:expr, $now:expr $(, $arg:expr)* $(,)?) => {{
        let admissions: &AdmissionArrays = $admissions;
        $query!(
            "UPDATE jobs j SET "
                + $state
                + ", admitted_at = $4, provider = t.provider, provider_model = t.model,
                     provider_key = t.key, reserved_buckets = t.buckets::bigint[],
                     reserved_amounts = t.amounts::float8[], admission = NULL,
                     reserved_micro_usd = t.reserved_usd, price_source = t.price_source
                   FROM unnest($1::uuid[], $2::text[], $3::text[], $5::text[], $6::text[], $7::text[],
                               $8::float8[], $9::text[])
                       AS t(id, provider, model, key, buckets, amounts, reserved_usd, price_source)
                   WHERE j.id = t.id AND j.state::text = 'queued' AND NOT j.held
                   RETURNING",
            "",
            &admissions.ids,
            &admissions.providers as &[&str],
            &admissions.models as &[&str],
            $now,
            &admissions.keys as &[Option<&str>],
            &admissions.buckets as &[Option<String>],
            &admissions.amounts as &[Option<String>],
            &admissions.reserved_usd,
            &admissions.price_sources as &[PriceSource]
            $(, $arg)*
        )
    }};
}

/// Admissions column by column, as [`admit_query!`] (and `insert_started_jobs`) binds them.
pub(super) struct AdmissionArrays<'a> {
    pub(super) ids: Vec<uuid::Uuid>,
    pub(super) providers: Vec<&'a str>,
    pub(super) models: Vec<&'a str>,
    pub(super) keys: Vec<Option<&'a str>>,
    pub(super) buckets: Vec<Option<String>>,
    pub(super) amounts: Vec<Option<String>>,
    pub(super) reserved_usd: Vec<f64>,
    pub(super) price_sources: Vec<PriceSource>,
}

impl<'a> AdmissionArrays<'a> {
    pub(super) fn of(admissions: &'a [Admission]) -> Self {
        // Arrays of arrays must be rectangular in PostgreSQL: each job's reservation goes
        // as array literals (`{3,7}`, `{1,850}`) cast per row. (An earlier form regrouped a
        // flattened list in SQL; behind a large queue the planner re-ran that grouping for
        // every admitted row: 280 ms per round at 300,000 queued.)
        let mut buckets = Vec::with_capacity(admissions.len());
        let mut amounts = Vec::with_capacity(admissions.len());
        for a in admissions {
            let (ids, held) = a.held();
            let literal =
                |items: Vec<String>| (!items.is_empty()).then(|| format!("{{{}}}", items.join(",")));
            buckets.push(literal(ids.iter().map(i64::to_string).collect()));
            amounts.push(literal(held.iter().map(|v| float_literal(*v)).collect()));
        }
        Self {
            ids: admissions.iter().map(|a| a.id.0).collect(),
            providers: admissions.iter().map(|a| a.provider.as_str()).collect(),
            models: admissions.iter().map(|a| a.model.as_str()).collect(),
            keys: admissions.iter().map(|a| a.key.as_deref()).collect(),
            buckets,
            amounts,
            reserved_usd: admissions.iter().map(|a| a.cost.micro_usd).collect(),
            price_sources: admissions.iter().map(|a| a.cost.price_source).collect(),
        }
    }
}

/// Marks jobs admitted with their reservations; the first `start` of them (in the order
/// given) go straight to running for `starter`, as if its dispatcher had claimed them — one
/// write per job instead of two. Jobs cancelled since they were read are skipped. Run in
/// the transaction holding the buckets.
pub async fn admit(
    conn: &mut PgConnection,
    admissions: &[Admission],
    start: Option<(Starter<'_>, usize)>,
    now: DateTime<Utc>,
) -> Result<Admitted> {
    let (started, waiting) = match start {
        Some((starter, n)) if n > 0 => {
            let n = n.min(admissions.len());
            (Some((starter, &admissions[..n])), &admissions[n..])
        }
        _ => (None, admissions),
    };
    let mut admitted = Admitted::default();
    if let Some((starter, started)) = started {
        let started = AdmissionArrays::of(started);
        admitted.started = admit_query!(
            query_jobs!,
            "state = 'running', attempt = j.attempt + 1, lease_owner = $10,
             lease_expires_at = now() + make_interval(secs => $11), started_at = COALESCE(j.started_at, $4)",
            &started,
            now,
            starter.owner,
            starter.lease.as_secs_f64(),
        )
        .fetch_all(&mut *conn)
        .await?;
    }
    if !waiting.is_empty() {
        let waiting = AdmissionArrays::of(waiting);
        admitted.waiting = admit_query!(query_job_ids!, "state = 'admitted'", &waiting, now)
            .fetch_all(&mut *conn)
            .await?;
        if !admitted.waiting.is_empty() {
            sqlx::query!("SELECT pg_notify($1, '')", CHANNEL_JOBS_READY)
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(admitted)
}

/// An `f64` as PostgreSQL reads it in an array literal (Rust writes `inf`, it wants `Infinity`).
fn float_literal(v: f64) -> String {
    match v {
        f64::INFINITY => "Infinity".to_owned(),
        f64::NEG_INFINITY => "-Infinity".to_owned(),
        v if v.is_nan() => "NaN".to_owned(),
        v => v.to_string(),
    }
}

/// Admitted online jobs no dispatcher has claimed yet, counted up to `cap`.
pub async fn admitted_backlog(ex: impl PgExecutor<'_>, cap: i64) -> Result<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "backlog!" FROM (
               SELECT 1 FROM jobs
               WHERE state = 'admitted' AND NOT stream AND dispatch_via IS DISTINCT FROM 'provider_batch'
               LIMIT $1) t"#,
        cap,
    )
    .fetch_one(ex)
    .await?)
}

/// How many changes of why a job waits its `admission_log` keeps (the latest).
pub const ADMISSION_LOG_LEN: i32 = 20;

/// Records why queued jobs still wait (shown on the job), and in each job's
/// `admission_log` the note with `at` when what it waits for changed (its reason, bucket
/// or scope, not merely the expected time).
pub async fn explain(
    ex: impl PgExecutor<'_>,
    notes: &[(JobId, serde_json::Value)],
    now: DateTime<Utc>,
) -> Result<()> {
    if notes.is_empty() {
        return Ok(());
    }
    let ids: Vec<uuid::Uuid> = notes.iter().map(|n| n.0.0).collect();
    let texts: Vec<serde_json::Value> = notes.iter().map(|n| n.1.clone()).collect();
    sqlx::query!(
        "UPDATE jobs j SET admission = t.note,
             admission_log = CASE
                 WHEN (j.admission->>'reason', j.admission->>'bucket', j.admission->>'scope')
                      IS NOT DISTINCT FROM (t.note->>'reason', t.note->>'bucket', t.note->>'scope')
                      AND j.admission_log IS NOT NULL
                 THEN j.admission_log
                 ELSE (SELECT coalesce(jsonb_agg(e ORDER BY n), '[]'::jsonb)
                       FROM jsonb_array_elements(coalesce(j.admission_log, '[]'::jsonb)
                                                 || jsonb_build_array(t.note || jsonb_build_object('at', $3::timestamptz)))
                            WITH ORDINALITY AS l(e, n)
                       WHERE n > jsonb_array_length(coalesce(j.admission_log, '[]'::jsonb)) + 1 - $4)
             END
         FROM unnest($1::uuid[], $2::jsonb[]) AS t(id, note) WHERE j.id = t.id AND j.state::text = 'queued'",
        &ids,
        &texts,
        now,
        ADMISSION_LOG_LEN,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// A queued job the gate fails: its reason code and message, and the gate's note on it
/// (kept as its `admission` when there is one).
#[derive(Debug)]
pub struct QueuedFailure {
    pub id: JobId,
    pub code: &'static str,
    pub message: String,
    pub note: Option<serde_json::Value>,
}

/// Fails queued jobs the gate can never admit in time, with a reason code each.
pub async fn fail_queued(pool: &sqlx::PgPool, failures: &[QueuedFailure], now: DateTime<Utc>) -> Result<u64> {
    if failures.is_empty() {
        return Ok(0);
    }
    let mut tx = pool.begin().await?;
    let ids: Vec<uuid::Uuid> = failures.iter().map(|f| f.id.0).collect();
    let codes: Vec<&str> = failures.iter().map(|f| f.code).collect();
    let messages: Vec<&str> = failures.iter().map(|f| f.message.as_str()).collect();
    let notes: Vec<Option<serde_json::Value>> = failures.iter().map(|f| f.note.clone()).collect();
    let ids: Vec<JobId> = query_job_ids!(
        "UPDATE jobs j SET state = 'failed', error_code = t.code, error_message = t.message, finished_at = $4,
                           admission = COALESCE(t.note, j.admission)
         FROM unnest($1::uuid[], $2::text[], $3::text[], $5::jsonb[]) AS t(id, code, message, note)
         WHERE j.id = t.id AND j.state::text = 'queued'
         RETURNING",
        "",
        &ids,
        &codes as &[&str],
        &messages as &[&str],
        now,
        &notes as &[Option<serde_json::Value>],
    )
    .fetch_all(&mut *tx)
    .await?;
    // A line that met its batch's cost cap stops the batch: the lines still queued end with
    // it, held or not (cheaper ones would still fit, but the cap is what the batch may cost).
    let capped: Vec<uuid::Uuid> = failures
        .iter()
        .filter(|f| f.code == ReasonCode::BatchCostCapReached.as_str())
        .map(|f| f.id.0)
        .collect();
    let mut ended = if capped.is_empty() {
        Vec::new()
    } else {
        query_job_ids!(
            "UPDATE jobs j SET state = 'failed', error_code = $2, finished_at = $3, error_message = $4
             WHERE j.state = 'queued'
               AND j.batch_id IN (SELECT c.batch_id FROM jobs c WHERE c.id = ANY($1) AND c.batch_id IS NOT NULL)
             RETURNING",
            "",
            &capped,
            ReasonCode::BatchCostCapReached.as_str(),
            now,
            "the batch's spend reached its max_cost_usd: the batch stopped before this line",
        )
        .fetch_all(&mut *tx)
        .await?
    };
    ended.extend(ids);
    super::jobs::notify_done(&mut tx, &ended).await?;
    tx.commit().await?;
    Ok(ended.len() as u64)
}
