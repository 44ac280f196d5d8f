//! Job rows: insert, read, list, cancel, claim, finish, rescue, expire.

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;
use sqlx::{PgConnection, PgExecutor, PgPool};

use super::buckets::{
    BucketArrays, Reservation, Settlement, reservation, save_buckets_query, settle, settle_query,
};
use super::{CHANNEL_GATE, CHANNEL_JOB_DONE, Result};
use crate::attempt::{Call, End, Outcome, Pause, Served};
use crate::model::{Job, JobClass, JobId, JobState, NewJob, Usage};
use crate::vocab::{Endpoint, Lane, ReasonCode};

/// The outcome of an insert with an idempotency key.
#[derive(Debug)]
pub enum Inserted {
    /// A new row was committed.
    New(Job),
    /// The tenant already used that key: the job it created.
    Existing(Job),
}

/// Inserts the job, queued, or finds the one its idempotency key already made. On a
/// connection, so that it can run in the transaction holding its queue's lock
/// ([`lock_queue_and_count`]).
pub async fn insert_job(conn: &mut PgConnection, job: &NewJob) -> Result<Inserted> {
    if insert_new_job(&mut *conn, job).await? {
        return Ok(Inserted::New(Job::queued(job)));
    }
    let existing = job_by_idempotency_key(
        conn,
        &job.tenant,
        job.idempotency_key.as_deref().unwrap_or_default(),
    )
    .await?
    .ok_or(sqlx::Error::RowNotFound)?;
    Ok(Inserted::Existing(existing))
}

/// The job `tenant` submitted with idempotency key `key`, if any.
pub async fn job_by_idempotency_key(ex: impl PgExecutor<'_>, tenant: &str, key: &str) -> Result<Option<Job>> {
    Ok(query_jobs!(
        "SELECT",
        "FROM jobs j WHERE j.tenant = $1 AND j.idempotency_key = $2",
        tenant,
        key,
    )
    .fetch_optional(ex)
    .await?)
}

/// Inserts the job, queued, unless its tenant already used its idempotency key (`false`).
/// Only the id comes back: the new row is exactly what was sent, so it is not read (and its
/// request body not decoded) again.
async fn insert_new_job(ex: impl PgExecutor<'_>, job: &NewJob) -> Result<bool> {
    Ok(sqlx::query_scalar!(
        "INSERT INTO jobs (id, tenant, class, priority, request, model, idempotency_key, metadata,
                                     deadline, not_before, max_attempts, estimated_input_tokens,
                                     estimated_output_tokens, created_at, stream, endpoint, api_key, traceparent,
                                     eta_p50, eta_p90, caller_process"
            + ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $10, $14, $15, $16, $17, $18, $19, $20"
            + ") ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                   RETURNING id AS \"id: JobId\"",
        job.id.0,
        &job.tenant,
        job.class as JobClass,
        job.priority,
        &job.request,
        &job.model,
        job.idempotency_key.as_deref(),
        job.metadata.as_ref(),
        job.deadline,
        job.created_at,
        job.max_attempts,
        job.estimated_input_tokens,
        job.estimated_output_tokens,
        job.stream,
        job.endpoint as Endpoint,
        job.api_key,
        job.traceparent.as_deref(),
        job.eta_p50,
        job.eta_p90,
        job.caller_process.as_deref(),
    )
    .fetch_optional(ex)
    .await?
    .is_some())
}

/// New jobs column by column, as the `INSERT … FROM unnest(…)` statements bind them (the
/// request and the idempotency key, which each statement sends its own way, apart).
struct JobColumns<'a> {
    ids: Vec<uuid::Uuid>,
    tenants: Vec<&'a str>,
    classes: Vec<JobClass>,
    priorities: Vec<i32>,
    models: Vec<&'a str>,
    metadata: Vec<Option<&'a serde_json::Value>>,
    deadlines: Vec<DateTime<Utc>>,
    created: Vec<DateTime<Utc>>,
    attempts: Vec<i32>,
    input_tokens: Vec<i32>,
    output_tokens: Vec<i32>,
    streams: Vec<bool>,
    endpoints: Vec<Endpoint>,
    api_keys: Vec<Option<uuid::Uuid>>,
    traceparents: Vec<Option<&'a str>>,
    eta_p50: Vec<Option<DateTime<Utc>>>,
    eta_p90: Vec<Option<DateTime<Utc>>>,
    caller_processes: Vec<Option<&'a str>>,
}

impl<'a> JobColumns<'a> {
    fn of<R: 'a>(jobs: impl Iterator<Item = &'a NewJob<R>>) -> Self {
        let mut c = Self {
            ids: Vec::new(),
            tenants: Vec::new(),
            classes: Vec::new(),
            priorities: Vec::new(),
            models: Vec::new(),
            metadata: Vec::new(),
            deadlines: Vec::new(),
            created: Vec::new(),
            attempts: Vec::new(),
            input_tokens: Vec::new(),
            output_tokens: Vec::new(),
            streams: Vec::new(),
            endpoints: Vec::new(),
            api_keys: Vec::new(),
            traceparents: Vec::new(),
            eta_p50: Vec::new(),
            eta_p90: Vec::new(),
            caller_processes: Vec::new(),
        };
        for j in jobs {
            c.ids.push(j.id.0);
            c.tenants.push(&j.tenant);
            c.classes.push(j.class);
            c.priorities.push(j.priority);
            c.models.push(&j.model);
            c.metadata.push(j.metadata.as_ref());
            c.deadlines.push(j.deadline);
            c.created.push(j.created_at);
            c.attempts.push(j.max_attempts);
            c.input_tokens.push(j.estimated_input_tokens);
            c.output_tokens.push(j.estimated_output_tokens);
            c.streams.push(j.stream);
            c.endpoints.push(j.endpoint);
            c.api_keys.push(j.api_key);
            c.traceparents.push(j.traceparent.as_deref());
            c.eta_p50.push(j.eta_p50);
            c.eta_p90.push(j.eta_p90);
            c.caller_processes.push(j.caller_process.as_deref());
        }
        c
    }
}

/// Inserts `jobs` already admitted, each with its admission (the same position in
/// `admissions`), and running for `starter` —
/// as if queued, admitted and claimed in one write (see [`super::admit`]) — and writes the
/// `buckets` they took from, all in one statement. The jobs carry no idempotency key (one
/// could name a job already there): every one is written. Run in the transaction holding
/// the buckets. Returns their rows, in the order given.
pub async fn insert_started_jobs(
    conn: &mut PgConnection,
    jobs: &[&NewJob],
    admissions: &[super::Admission],
    starter: super::Starter<'_>,
    buckets: &[crate::buckets::Bucket],
    now: DateTime<Utc>,
) -> Result<Vec<Job>> {
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    debug_assert_eq!(jobs.len(), admissions.len());
    debug_assert!(jobs.iter().all(|job| job.idempotency_key.is_none()));
    let held = super::gate::AdmissionArrays::of(admissions);
    let c = JobColumns::of(jobs.iter().copied());
    let requests: Vec<&serde_json::Value> = jobs.iter().map(|j| &j.request).collect();
    let saved = BucketArrays::of(buckets);
    let written = save_buckets_query!(sqlx::query!(
        "WITH saved AS (",
        r#") INSERT INTO jobs (id, tenant, class, priority, request, model, metadata, deadline, not_before,
                              max_attempts, estimated_input_tokens, estimated_output_tokens, created_at,
                              stream, endpoint, state, attempt, lease_owner, lease_expires_at, started_at,
                              admitted_at, provider, provider_model, provider_key, reserved_buckets,
                              reserved_amounts, api_key, reserved_micro_usd, price_source, traceparent,
                              eta_p50, eta_p90, caller_process)
             SELECT id, tenant, class, priority, request, model, metadata, deadline, created_at, attempts,
                    ein, eout, created_at, stream, endpoint, 'running', 1, $21,
                    now() + make_interval(secs => $22), $23, $23, provider, provider_model, key,
                    held_buckets::bigint[], held_amounts::float8[], api_key, reserved_usd, price_source,
                    traceparent, eta_p50, eta_p90, caller_process
             FROM unnest($1::uuid[], $2::text[], $3::job_class[], $4::int[], $5::jsonb[], $6::text[],
                         $7::jsonb[], $8::timestamptz[], $9::timestamptz[], $10::int[], $11::int[],
                         $12::int[], $13::bool[], $14::text[], $15::text[], $16::text[], $17::text[],
                         $18::text[], $19::text[], $20::uuid[], $24::float8[], $25::text[], $26::text[],
                         $27::timestamptz[], $28::timestamptz[], $29::text[])
                 AS t(id, tenant, class, priority, request, model, metadata, deadline, created_at, attempts,
                      ein, eout, stream, endpoint, provider, provider_model, key, held_buckets, held_amounts,
                      api_key, reserved_usd, price_source, traceparent, eta_p50, eta_p90, caller_process)"#,
        ["$30", "$31", "$32", "$33", "$34", "$35"],
        &c.ids,
        &c.tenants as &[&str],
        &c.classes as &[JobClass],
        &c.priorities,
        &requests as &[&serde_json::Value],
        &c.models as &[&str],
        &c.metadata as &[Option<&serde_json::Value>],
        &c.deadlines,
        &c.created,
        &c.attempts,
        &c.input_tokens,
        &c.output_tokens,
        &c.streams,
        &c.endpoints as &[Endpoint],
        &held.providers as &[&str],
        &held.models as &[&str],
        &held.keys as &[Option<&str>],
        &held.buckets as &[Option<String>],
        &held.amounts as &[Option<String>],
        &c.api_keys as &[Option<uuid::Uuid>],
        starter.owner,
        starter.lease.as_secs_f64(),
        now,
        &held.reserved_usd,
        &held.price_sources as &[crate::vocab::PriceSource],
        &c.traceparents as &[Option<&str>],
        &c.eta_p50 as &[Option<DateTime<Utc>>],
        &c.eta_p90 as &[Option<DateTime<Utc>>],
        &c.caller_processes as &[Option<&str>];
        &saved
    ))
    .execute(&mut *conn)
    .await?;
    debug_assert_eq!(written.rows_affected(), admissions.len() as u64);
    Ok(jobs
        .iter()
        .zip(admissions)
        .map(|(job, admission)| {
            let (bucket_ids, amounts) = admission.held();
            // No reservation is NULL, as the admission's UPDATE writes it.
            let (reserved_buckets, reserved_amounts) = match bucket_ids.is_empty() {
                true => (None, None),
                false => (Some(bucket_ids), Some(amounts)),
            };
            Job {
                state: JobState::Running,
                attempt: 1,
                lease_owner: Some(starter.owner.to_owned()),
                // Written as the database's `now()` plus the lease; this is the caller's reckoning.
                lease_expires_at: chrono::Duration::from_std(starter.lease).ok().map(|l| now + l),
                started_at: Some(now),
                admitted_at: Some(now),
                provider: Some(admission.provider.clone()),
                provider_model: Some(admission.model.clone()),
                provider_key: admission.key.clone(),
                reserved_buckets,
                reserved_amounts,
                reserved_micro_usd: Some(admission.cost.micro_usd),
                price_source: Some(admission.cost.price_source),
                ..Job::queued(job)
            }
        })
        .collect())
}

/// What [`insert_jobs`] did with each job, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BulkInserted {
    New(JobId),
    /// The tenant already used this job's idempotency key, for the same request.
    Existing(JobId),
    /// The tenant already used this job's idempotency key for a different request.
    Conflict,
}

/// Inserts many jobs in one statement (`INSERT … SELECT FROM unnest(…)`), never one per
/// job, in idempotency-key order: two bulks sharing keys then take their key locks in the
/// same order and wait for each other instead of deadlocking. A job whose idempotency key its tenant already used is not inserted: it comes back
/// as [`BulkInserted::Existing`] (same request) or [`BulkInserted::Conflict`]. Run it in a
/// transaction so that a caller refusing a conflict can roll the whole lot back.
///
/// Requests are sent as the clients' JSON text, which PostgreSQL parses into `jsonb`: a
/// bulk is never held as a tree of values.
pub async fn insert_jobs(
    conn: &mut PgConnection,
    jobs: &[NewJob<Box<RawValue>>],
) -> Result<Vec<BulkInserted>> {
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    let c = JobColumns::of(jobs.iter());
    let requests: Vec<&str> = jobs.iter().map(|j| j.request.get()).collect();
    let keys: Vec<Option<&str>> = jobs.iter().map(|j| j.idempotency_key.as_deref()).collect();
    let inserted = sqlx::query_scalar!(
        r#"INSERT INTO jobs (id, tenant, class, priority, request, model, idempotency_key, metadata,
                           deadline, not_before, max_attempts, estimated_input_tokens,
                           estimated_output_tokens, created_at, stream, endpoint, api_key, traceparent,
                           eta_p50, eta_p90, caller_process)
         SELECT id, tenant, class, priority, request::jsonb, model, key, metadata, deadline, created_at, attempts,
                ein, eout, created_at, stream, endpoint, api_key, traceparent, eta_p50, eta_p90, caller_process
         FROM unnest($1::uuid[], $2::text[], $3::job_class[], $4::int[], $5::text[], $6::text[], $7::text[],
                     $8::jsonb[], $9::timestamptz[], $10::timestamptz[], $11::int[], $12::int[], $13::int[],
                     $14::bool[], $15::text[], $16::uuid[], $17::text[], $18::timestamptz[], $19::timestamptz[],
                     $20::text[])
             AS t(id, tenant, class, priority, request, model, key, metadata, deadline, created_at, attempts, ein,
                  eout, stream, endpoint, api_key, traceparent, eta_p50, eta_p90, caller_process)
         ORDER BY tenant, key
         ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
         RETURNING id AS "id: JobId""#,
        &c.ids,
        &c.tenants as &[&str],
        &c.classes as &[JobClass],
        &c.priorities,
        &requests as &[&str],
        &c.models as &[&str],
        &keys as &[Option<&str>],
        &c.metadata as &[Option<&serde_json::Value>],
        &c.deadlines,
        &c.created,
        &c.attempts,
        &c.input_tokens,
        &c.output_tokens,
        &c.streams,
        &c.endpoints as &[Endpoint],
        &c.api_keys as &[Option<uuid::Uuid>],
        &c.traceparents as &[Option<&str>],
        &c.eta_p50 as &[Option<DateTime<Utc>>],
        &c.eta_p90 as &[Option<DateTime<Utc>>],
        &c.caller_processes as &[Option<&str>],
    )
    .fetch_all(&mut *conn)
    .await?;
    let new: std::collections::HashSet<JobId> = inserted.into_iter().collect();
    // Keys already taken: compare with what the tenant sent under them before.
    let taken: Vec<(&str, &str)> = jobs
        .iter()
        .filter(|j| !new.contains(&j.id))
        .filter_map(|j| Some((j.tenant.as_str(), j.idempotency_key.as_deref()?)))
        .collect();
    let mut existing = std::collections::HashMap::new();
    if !taken.is_empty() {
        let tenants: Vec<&str> = taken.iter().map(|t| t.0).collect();
        let keys: Vec<&str> = taken.iter().map(|t| t.1).collect();
        let rows = sqlx::query!(
            r#"SELECT j.tenant, j.idempotency_key AS "idempotency_key!", j.id AS "id: JobId", j.request
               FROM unnest($1::text[], $2::text[]) AS t(tenant, key)
               JOIN jobs j ON j.tenant = t.tenant AND j.idempotency_key = t.key"#,
            &tenants as &[&str],
            &keys as &[&str],
        )
        .fetch_all(&mut *conn)
        .await?;
        existing = rows
            .into_iter()
            .map(|r| ((r.tenant, r.idempotency_key), (r.id, r.request)))
            .collect();
    }
    Ok(jobs
        .iter()
        .map(|j| {
            if new.contains(&j.id) {
                return BulkInserted::New(j.id);
            }
            let found = j
                .idempotency_key
                .as_ref()
                .and_then(|k| existing.get(&(j.tenant.clone(), k.clone())));
            // Read as values, as the stored one is: the same request in other spacing or
            // key order is the same request.
            let same = |stored: &serde_json::Value| {
                serde_json::from_str::<serde_json::Value>(j.request.get()).is_ok_and(|sent| sent == *stored)
            };
            match found {
                Some((id, request)) if same(request) => BulkInserted::Existing(*id),
                _ => BulkInserted::Conflict,
            }
        })
        .collect())
}

/// First key of the advisory locks that make a tenant's queue cap exact: "tgqc". The
/// second is the hash of the tenant and the class.
const QUEUE_CAP_LOCKS: i32 = 0x7467_7163;

/// Takes the lock of `tenant`'s queue of `class` for the rest of the transaction on
/// `conn`, then counts the jobs waiting in it (queued or admitted), stopping at `up_to`:
/// past the room a caller asks about, the exact number changes nothing, and a long queue
/// is not read to the end on every submission.
///
/// The queue cap is exact across submitters and processes because each takes this lock
/// before it counts and holds it until its insert commits: the count, a statement of its
/// own after the lock is held, sees every job inserted under the lock before it. Two
/// submitters can never both take the last room.
pub async fn lock_queue_and_count(
    conn: &mut PgConnection,
    tenant: &str,
    class: JobClass,
    up_to: i64,
) -> Result<i64> {
    sqlx::query!(
        "SELECT pg_advisory_xact_lock($1, hashtext($2 || '/' || $3::job_class::text))",
        QUEUE_CAP_LOCKS,
        tenant,
        class as JobClass,
    )
    .execute(&mut *conn)
    .await?;
    count_waiting(&mut *conn, tenant, class, up_to).await
}

/// The tenant's jobs waiting in `class` (queued or admitted), counted up to `up_to`.
pub async fn count_waiting(
    ex: impl PgExecutor<'_>,
    tenant: &str,
    class: JobClass,
    up_to: i64,
) -> Result<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "count!" FROM (
               SELECT 1 FROM jobs WHERE tenant = $1 AND class = $2 AND state IN ('queued', 'admitted') LIMIT $3
           ) waiting"#,
        tenant,
        class as JobClass,
        up_to,
    )
    .fetch_one(ex)
    .await?)
}

/// Tells the gate that work is waiting. Cheap; call after the insert commits.
pub async fn notify_gate(ex: impl PgExecutor<'_>) -> Result<()> {
    sqlx::query!("SELECT pg_notify($1, '')", CHANNEL_GATE)
        .execute(ex)
        .await?;
    Ok(())
}

/// A tenant's job, or `None` (also when it belongs to another tenant); any tenant's when
/// `tenant` is `None` (for workers and operators, never for tenant-facing paths).
pub async fn get_job(ex: impl PgExecutor<'_>, tenant: Option<&str>, id: JobId) -> Result<Option<Job>> {
    Ok(query_jobs!(
        "SELECT",
        "FROM jobs j WHERE j.id = $1 AND ($2::text IS NULL OR j.tenant = $2)",
        id.0,
        tenant
    )
    .fetch_optional(ex)
    .await?)
}

/// Which jobs a list shows: every field given must match (`None`: any).
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    pub state: Option<JobState>,
    pub class: Option<JobClass>,
    /// As requested: a route alias or `provider/model`.
    pub model: Option<String>,
    pub endpoint: Option<Endpoint>,
    pub lane: Option<Lane>,
    pub batch: Option<String>,
    /// Why it failed (`error_code`) or why it waits (its admission note's reason).
    pub reason: Option<String>,
    pub created_after: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    pub search: Option<JobSearch>,
}

/// A search for jobs: its id, its idempotency key, or a `key=value` pair of its metadata.
#[derive(Debug, Clone)]
pub enum JobSearch {
    Id(JobId),
    /// Either an idempotency key or, when it holds `=`, a metadata pair.
    Text(String),
}

impl JobSearch {
    /// What the search can match: (id, idempotency key, metadata containing).
    fn terms(&self) -> (Option<uuid::Uuid>, Option<&str>, Option<serde_json::Value>) {
        match self {
            JobSearch::Id(id) => (Some(id.0), None, None),
            JobSearch::Text(text) => (
                None,
                Some(text),
                text.split_once('=')
                    .map(|(k, v)| serde_json::json!({ k.trim(): v.trim() })),
            ),
        }
    }
}

/// [`query_jobs!`] of a page of jobs matching a [`JobFilter`], newest first: `$tenant` is
/// how `$1` (the tenant) restricts them, the filter's fields are `$2`…`$13`, then the
/// previous page's last id and the page size.
macro_rules! query_job_list {
    ($tenant:expr $(, $arg:expr)* $(,)?) => {
        query_jobs!(
            "SELECT",
            "FROM jobs j WHERE "
                + $tenant
                + " AND ($2::job_state IS NULL OR j.state = $2) AND ($3::job_class IS NULL OR j.class = $3)
                   AND ($4::text IS NULL OR j.model = $4) AND ($5::text IS NULL OR j.endpoint = $5)
                   AND ($6::text IS NULL OR coalesce(j.dispatch_via, 'online') = $6) AND ($7::text IS NULL OR j.batch_id = $7)
                   AND ($8::text IS NULL OR j.error_code = $8 OR (j.state = 'queued' AND j.admission->>'reason' = $8))
                   AND ($9::timestamptz IS NULL OR j.created_at >= $9) AND ($10::timestamptz IS NULL OR j.created_at < $10)
                   AND (($11::uuid IS NULL AND $12::text IS NULL)
                        OR j.id = $11 OR j.idempotency_key = $12 OR j.metadata @> $13::jsonb)
                   AND ($14::uuid IS NULL OR j.id < $14)
                 ORDER BY j.id DESC LIMIT $15"
            $(, $arg)*
        )
    };
}

/// A tenant's jobs (every tenant's when `None`: the operators') that match `filter`,
/// newest first; `after` is the last id of the previous page.
pub async fn list_jobs(
    ex: impl PgExecutor<'_>,
    tenant: Option<&str>,
    filter: &JobFilter,
    after: Option<JobId>,
    limit: i64,
) -> Result<Vec<Job>> {
    let after = after.map(|a| a.0);
    let (id, key, metadata) = filter.search.as_ref().map(JobSearch::terms).unwrap_or_default();
    // Two statements, so that a tenant's list is always planned on its own index.
    macro_rules! list {
        ($tenant:expr) => {
            query_job_list!(
                $tenant,
                tenant,
                filter.state as Option<JobState>,
                filter.class as Option<JobClass>,
                filter.model.as_deref(),
                filter.endpoint as Option<Endpoint>,
                filter.lane as Option<Lane>,
                filter.batch.as_deref(),
                filter.reason.as_deref(),
                filter.created_after,
                filter.created_before,
                id,
                key,
                metadata,
                after,
                limit,
            )
            .fetch_all(ex)
            .await?
        };
    }
    Ok(match tenant {
        Some(_) => list!("j.tenant = $1"),
        None => list!("$1::text IS NULL"),
    })
}

#[derive(Debug)]
pub enum Cancelled {
    /// The job is now cancelled. A running attempt's result will be discarded; its
    /// reservation is settled by its holder (or by maintenance if the holder died).
    Now(Job),
    /// It had already finished; its terminal row.
    AlreadyFinished(Job),
    NotFound,
}

/// Old values of a row a guarded update changed.
struct Previous {
    id: JobId,
    old_state: JobState,
    old_buckets: Option<Vec<i64>>,
    old_amounts: Option<Vec<f64>>,
}

/// Cancels a job of `tenant` (any tenant's when `None`: the operators').
pub async fn cancel_job(
    pool: &PgPool,
    tenant: Option<&str>,
    id: JobId,
    now: DateTime<Utc>,
) -> Result<Cancelled> {
    let mut tx = pool.begin().await?;
    // A running job keeps its lease fields and reservation: the call is still in flight.
    let prev = sqlx::query_as!(
        Previous,
        r#"UPDATE jobs j SET state = 'cancelled', finished_at = $3, error_code = 'cancelled',
                             error_message = 'cancelled by the client',
                             reserved_buckets = CASE WHEN old.state = 'running' THEN j.reserved_buckets END,
                             reserved_amounts = CASE WHEN old.state = 'running' THEN j.reserved_amounts END
           FROM (SELECT id, state, reserved_buckets, reserved_amounts FROM jobs
                 WHERE id = $1 AND ($2::text IS NULL OR tenant = $2) FOR UPDATE) old
           WHERE j.id = old.id AND old.state IN ('queued', 'admitted', 'running')
           RETURNING j.id AS "id: JobId", old.state AS "old_state: JobState", old.reserved_buckets AS old_buckets,
                     old.reserved_amounts AS old_amounts"#,
        id.0,
        tenant,
        now,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(prev) = prev else {
        tx.rollback().await?;
        return Ok(match get_job(pool, tenant, id).await? {
            Some(job) => Cancelled::AlreadyFinished(job),
            None => Cancelled::NotFound,
        });
    };
    if prev.old_state == JobState::Admitted
        && let Some(r) = reservation(prev.old_buckets, prev.old_amounts)
    {
        settle(&mut *tx, &[(prev.id, r, Settlement::UNSENT)]).await?;
    }
    notify_done(&mut tx, &[prev.id]).await?;
    tx.commit().await?;
    let job = get_job(pool, tenant, id).await?;
    Ok(job.map_or(Cancelled::NotFound, Cancelled::Now))
}

/// Announces finished jobs: their ids, comma-separated, up to [`IDS_PER_NOTIFY`] per
/// NOTIFY (a payload must stay under 8000 bytes), so a batch of completions costs a few
/// notifications, not one per job.
pub(crate) async fn notify_done(conn: &mut PgConnection, ids: &[JobId]) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let ids: Vec<uuid::Uuid> = ids.iter().map(|i| i.0).collect();
    sqlx::query!(
        "SELECT pg_notify($1, string_agg(id::text, ',')) FROM (
             SELECT id, (ordinality - 1) / $3 AS chunk FROM unnest($2::uuid[]) WITH ORDINALITY AS t(id, ordinality)) c
         GROUP BY chunk",
        CHANNEL_JOB_DONE,
        &ids,
        IDS_PER_NOTIFY,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Job ids per `tollgate_job_done` notification (37 bytes each with the comma).
pub const IDS_PER_NOTIFY: i64 = 200;

/// Claims up to `limit` admitted jobs for `owner` in one short statement and commits:
/// the provider is called only after this returns, with no lock held. The lease runs
/// from the database's `now()`, whatever `now` (deadlines, pauses, `started_at`) says.
pub async fn claim_jobs(
    ex: impl PgExecutor<'_>,
    owner: &str,
    limit: i64,
    now: DateTime<Utc>,
    lease: std::time::Duration,
) -> Result<Vec<Job>> {
    Ok(query_jobs!(
        "WITH picked AS (
             SELECT id FROM jobs
             -- The deadline as a difference, so that no plan reads it by its index
             -- (`jobs_waiting_deadline`, which holds every queued job too): with statistics
             -- that missed a burst of queued jobs, PostgreSQL took that index and read them
             -- all for each claim, instead of the admitted ones in order (`jobs_admitted`).
             WHERE state = 'admitted' AND deadline - $3::timestamptz > interval '0' AND NOT stream
               AND dispatch_via IS DISTINCT FROM 'provider_batch'
               -- A provider's 429 paused the target: what was admitted before waits too.
               AND NOT EXISTS (SELECT 1 FROM pauses p
                               WHERE p.scope = 'provider:' || jobs.provider || ':' || jobs.provider_model
                                 AND p.until > $3)
             ORDER BY class, priority DESC, admitted_at, id
             LIMIT $2
             FOR UPDATE SKIP LOCKED)
         UPDATE jobs j
         SET state = 'running', attempt = j.attempt + 1, lease_owner = $1,
             lease_expires_at = now() + make_interval(secs => $4), started_at = COALESCE(j.started_at, $3)
         FROM picked WHERE j.id = picked.id
         RETURNING",
        "",
        owner,
        limit,
        now,
        lease.as_secs_f64(),
    )
    .fetch_all(ex)
    .await?)
}

/// Claims one admitted streaming job for the process holding its client's connection.
pub async fn claim_stream_job(
    ex: impl PgExecutor<'_>,
    id: JobId,
    owner: &str,
    now: DateTime<Utc>,
    lease: std::time::Duration,
) -> Result<Option<Job>> {
    Ok(query_jobs!(
        "UPDATE jobs j SET state = 'running', attempt = attempt + 1, lease_owner = $2,
                           lease_expires_at = now() + make_interval(secs => $4),
                           started_at = COALESCE(started_at, $3)
         WHERE id = $1 AND state = 'admitted' AND stream
         RETURNING",
        "",
        id.0,
        owner,
        now,
        lease.as_secs_f64(),
    )
    .fetch_optional(ex)
    .await?)
}

/// Writes an attempt's outcome and settles its reservation, in one transaction (with the
/// record of its call, if it made one), if its holder still holds the job. `false` means
/// the job was cancelled or rescued meanwhile: the outcome is discarded (and a cancelled
/// job's reservation is settled).
pub async fn finish_attempt(pool: &PgPool, outcome: &Outcome, now: DateTime<Utc>) -> Result<bool> {
    Ok(finish_attempts(pool, std::slice::from_ref(outcome), now)
        .await?
        .first()
        .copied()
        .unwrap_or(false))
}

/// [`finish_attempt`] for many outcomes at once, whatever their number: one statement,
/// its own transaction, writes the pauses, the calls' records and the job rows, settles
/// their reservations ([`settle_query!`]), announces the finished and wakes the gate for
/// the requeued. Outcomes no longer ours (a job cancelled or rescued meanwhile) are
/// discarded; a cancelled job's reservation is settled after, in a transaction of its own
/// (only when there are some). Returns, per outcome, whether it was written.
pub async fn finish_attempts(pool: &PgPool, outcomes: &[Outcome], now: DateTime<Utc>) -> Result<Vec<bool>> {
    if outcomes.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<Row<'_>> = outcomes.iter().map(Row::of).collect();
    let usage: Vec<Option<serde_json::Value>> = rows
        .iter()
        .map(|r| r.usage.map(serde_json::to_value).transpose())
        .collect::<std::result::Result<_, _>>()?;
    let calls: Vec<(&Outcome, &Served, &Call)> = outcomes
        .iter()
        .filter_map(|o| Some((o, o.served.as_ref()?, o.call.as_ref()?)))
        .collect();
    let calls = CallColumns::of(&calls);
    let pauses: Vec<&Pause> = outcomes.iter().filter_map(|o| o.pause.as_ref()).collect();
    let pause_scopes: Vec<&str> = pauses.iter().map(|p| p.scope.as_str()).collect();
    let pause_until: Vec<DateTime<Utc>> = pauses.iter().map(|p| p.until).collect();
    let pause_reasons: Vec<&str> = pauses.iter().map(|p| p.reason).collect();
    let used: Vec<serde_json::Value> = outcomes
        .iter()
        .map(|o| o.settlement.used_by_dimension())
        .collect();
    let ids: Vec<uuid::Uuid> = outcomes.iter().map(|o| o.holder.id.0).collect();
    let attempts: Vec<i32> = outcomes.iter().map(|o| o.holder.attempt).collect();
    let owners: Vec<&str> = outcomes.iter().map(|o| o.holder.owner.as_str()).collect();
    let states: Vec<JobState> = outcomes.iter().map(|o| o.end.state()).collect();
    let results: Vec<Option<serde_json::Value>> = rows.iter().map(|r| r.result.cloned()).collect();
    let request_ids: Vec<Option<&str>> = rows.iter().map(|r| r.provider_request_id).collect();
    let codes: Vec<Option<&str>> = rows.iter().map(|r| r.code).collect();
    let messages: Vec<Option<&str>> = rows.iter().map(|r| r.message).collect();
    let not_before: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.not_before).collect();
    let providers: Vec<Option<&str>> = outcomes
        .iter()
        .map(|o| o.served.as_ref().map(|s| s.provider.as_str()))
        .collect();
    let models: Vec<Option<&str>> = outcomes
        .iter()
        .map(|o| o.served.as_ref().map(|s| s.model.as_str()))
        .collect();
    let failed: Vec<Option<&str>> = outcomes.iter().map(|o| o.failed_target.as_deref()).collect();
    // What a call the provider answered cost; an attempt that was not sent costs nothing.
    let spend: Vec<Option<f64>> = outcomes
        .iter()
        .map(|o| o.call.as_ref().map(|_| o.settlement.actual_spend))
        .collect();
    // What a call at a cheaper lane saved against the online price.
    let saved: Vec<Option<f64>> = outcomes
        .iter()
        .map(|o| o.call.as_ref().map(|_| o.settlement.saved).filter(|s| *s != 0.0))
        .collect();
    // One statement: the pauses, the calls' records, the job rows, their settlement, the
    // notice of those finished (up to IDS_PER_NOTIFY ids per notification, as
    // `notify_done`) and the gate's wake-up for those requeued.
    let written: Vec<JobId> = settle_query!(
        query_scalar,
        r#"WITH t AS (
             SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[], $4::job_state[], $5::jsonb[], $6::jsonb[],
                                  $7::text[], $8::text[], $9::text[], $10::timestamptz[], $11::text[], $12::text[],
                                  $14::text[], $15::float8[], $16::float8[], $37::jsonb[])
                 AS t(id, attempt, owner, state, result, usage, request_id, code, message, not_before, provider, model,
                      failed, spend, saved, used)),
         paused AS (
             INSERT INTO pauses (scope, until, reason, created_at)
             SELECT scope, max(until), min(reason), $13
             FROM unnest($38::text[], $39::timestamptz[], $40::text[]) AS p(scope, until, reason)
             GROUP BY scope
             ON CONFLICT ON CONSTRAINT pauses_pkey DO UPDATE SET until = GREATEST(pauses.until, excluded.until),
                                                                 reason = CASE WHEN pauses.reason = 'operator'
                                                                               THEN pauses.reason ELSE excluded.reason END),
         calls AS (
             INSERT INTO job_attempts (job_id, attempt, provider, provider_model, key_name, status, outcome,
                                       error_code, provider_request_id, input_tokens, output_tokens,
                                       cached_tokens, estimated_input_tokens, estimated_output_tokens,
                                       rate_limit, started_at, finished_at, tenant)
             SELECT * FROM unnest($17::uuid[], $18::int[], $19::text[], $20::text[], $21::text[], $22::int[],
                                  $23::text[], $24::text[], $25::text[], $26::int[], $27::int[], $28::int[],
                                  $29::int[], $30::int[], $31::jsonb[], $32::timestamptz[], $33::timestamptz[],
                                  $34::text[])
             ON CONFLICT ON CONSTRAINT job_attempts_pkey DO NOTHING),
         upd AS (
         -- `old` is the row as this statement's snapshot saw it, read without a lock (a lock
         -- per row is a WAL record per row): a running job's reservation changes only by its
         -- holder, and a concurrent cancel or rescue changes its state, which fails the guard
         -- on `j` (re-checked on the latest version) so that row is not written. Rows are
         -- found by `t.id` alone, the state compared as text (see `store`): with
         -- `old.id = ANY($1)` as well, each index probe sorted the whole array again.
         UPDATE jobs j SET state = t.state, result = COALESCE(t.result, j.result), usage = COALESCE(t.usage, j.usage),
                           provider_request_id = COALESCE(t.request_id, j.provider_request_id),
                           error_code = t.code, error_message = t.message,
                           not_before = COALESCE(t.not_before, j.not_before),
                           finished_at = CASE WHEN t.state = 'queued'::job_state THEN NULL ELSE $13::timestamptz END,
                           -- A line back in the queue while its batch is paused waits with it.
                           held = t.state = 'queued'::job_state AND j.batch_id IS NOT NULL
                                  AND EXISTS (SELECT 1 FROM batches b WHERE b.id = j.batch_id AND b.paused_at IS NOT NULL),
                           provider = COALESCE(t.provider, j.provider), provider_model = COALESCE(t.model, j.provider_model),
                           lease_owner = NULL, lease_expires_at = NULL,
                           reserved_buckets = NULL, reserved_amounts = NULL, admission = NULL,
                           failed_targets = CASE WHEN t.failed IS NULL THEN j.failed_targets
                                                 ELSE array_append(COALESCE(j.failed_targets, '{}'), t.failed) END,
                           spend_micro_usd = CASE WHEN t.spend IS NULL THEN j.spend_micro_usd
                                                  ELSE COALESCE(j.spend_micro_usd, 0) + t.spend END,
                           saved_micro_usd = CASE WHEN t.saved IS NULL THEN j.saved_micro_usd
                                                  ELSE COALESCE(j.saved_micro_usd, 0) + t.saved END
         FROM t, jobs old
         WHERE j.id = t.id AND old.id = t.id AND j.state::text = 'running'
           AND j.attempt = t.attempt AND j.lease_owner = t.owner
         RETURNING j.id, t.state AS new_state, old.reserved_buckets, old.reserved_amounts, t.used),
         announced AS (
             SELECT pg_notify($35, string_agg(id::text, ',')) FROM (
                 SELECT id, (row_number() OVER () - 1) / $36 AS chunk FROM upd WHERE new_state::text <> 'queued') c
             GROUP BY chunk),
         woken AS (
             SELECT pg_notify($41, '') FROM upd WHERE new_state::text = 'queued' LIMIT 1),
         settled AS ("#,
        "(SELECT h.bucket, h.amount, upd.used FROM upd, unnest(upd.reserved_buckets, upd.reserved_amounts) AS h(bucket, amount))",
        r#")
         SELECT upd.id AS "id!: JobId"
         FROM upd, (SELECT count(*) FROM announced) a, (SELECT count(*) FROM woken) w"#,
        &ids,
        &attempts,
        &owners as &[&str],
        &states as &[JobState],
        &results as &[Option<serde_json::Value>],
        &usage as &[Option<serde_json::Value>],
        &request_ids as &[Option<&str>],
        &codes as &[Option<&str>],
        &messages as &[Option<&str>],
        &not_before as &[Option<DateTime<Utc>>],
        &providers as &[Option<&str>],
        &models as &[Option<&str>],
        now,
        &failed as &[Option<&str>],
        &spend as &[Option<f64>],
        &saved as &[Option<f64>],
        &calls.ids,
        &calls.attempts,
        &calls.providers as &[&str],
        &calls.models as &[&str],
        &calls.keys as &[&str],
        &calls.statuses as &[Option<i32>],
        &calls.outcomes as &[&str],
        &calls.codes as &[Option<ReasonCode>],
        &calls.request_ids as &[Option<&str>],
        &calls.input_tokens as &[Option<i32>],
        &calls.output_tokens as &[Option<i32>],
        &calls.cached_tokens as &[Option<i32>],
        &calls.estimated_input,
        &calls.estimated_output,
        &calls.rate_limits as &[Option<&serde_json::Value>],
        &calls.started,
        &calls.finished,
        &calls.tenants as &[&str],
        CHANNEL_JOB_DONE,
        IDS_PER_NOTIFY,
        &used,
        &pause_scopes as &[&str],
        &pause_until,
        &pause_reasons as &[&str],
        CHANNEL_GATE,
    )
    .fetch_all(pool)
    .await?;
    let written: std::collections::HashSet<JobId> = written.into_iter().collect();
    let discarded: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| !written.contains(&o.holder.id))
        .collect();
    if !discarded.is_empty() {
        settle_cancelled(pool, &discarded).await?;
    }
    Ok(outcomes.iter().map(|o| written.contains(&o.holder.id)).collect())
}

/// Settles the reservations of the `discarded` outcomes' jobs that were cancelled while
/// their holder ran (a rescued job's rescuer settled it), and wakes the gate.
async fn settle_cancelled(pool: &PgPool, discarded: &[&Outcome]) -> Result<()> {
    let ids: Vec<uuid::Uuid> = discarded.iter().map(|o| o.holder.id.0).collect();
    let attempts: Vec<i32> = discarded.iter().map(|o| o.holder.attempt).collect();
    let owners: Vec<&str> = discarded.iter().map(|o| o.holder.owner.as_str()).collect();
    let mut tx = pool.begin().await?;
    let cancelled = sqlx::query_as!(
        Previous,
        r#"WITH t AS (SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[]) AS t(id, attempt, owner)),
         old AS (
             SELECT j.id, j.state, j.reserved_buckets, j.reserved_amounts FROM jobs j
             WHERE j.id = ANY($1) ORDER BY j.id FOR UPDATE)
         UPDATE jobs j SET reserved_buckets = NULL, reserved_amounts = NULL,
                           lease_owner = NULL, lease_expires_at = NULL
         FROM t, old
         WHERE j.id = t.id AND old.id = t.id AND j.state::text = 'cancelled' AND j.attempt = t.attempt
           AND j.lease_owner = t.owner
         RETURNING j.id AS "id: JobId", old.state AS "old_state: JobState", old.reserved_buckets AS old_buckets,
                   old.reserved_amounts AS old_amounts"#,
        &ids,
        &attempts,
        &owners as &[&str],
    )
    .fetch_all(&mut *tx)
    .await?;
    let by_id: std::collections::HashMap<JobId, &Outcome> =
        discarded.iter().map(|o| (o.holder.id, *o)).collect();
    let ended: Vec<(JobId, Reservation, Settlement)> = cancelled
        .into_iter()
        .filter_map(|p| {
            let settlement = by_id.get(&p.id)?.settlement;
            reservation(p.old_buckets, p.old_amounts).map(|r| (p.id, r, settlement))
        })
        .collect();
    settle(&mut *tx, &ended).await?;
    notify_gate(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// The columns of the job's row an outcome writes (`None`: left as it was, or cleared).
struct Row<'a> {
    result: Option<&'a serde_json::Value>,
    usage: Option<Usage>,
    provider_request_id: Option<&'a str>,
    code: Option<&'a str>,
    message: Option<&'a str>,
    not_before: Option<DateTime<Utc>>,
}

impl<'a> Row<'a> {
    fn of(o: &'a Outcome) -> Self {
        let none = Row {
            result: None,
            usage: None,
            provider_request_id: None,
            code: None,
            message: None,
            not_before: None,
        };
        match &o.end {
            End::Succeeded {
                result,
                usage,
                provider_request_id,
            } => Row {
                result: Some(result),
                usage: Some(*usage),
                provider_request_id: provider_request_id.as_deref(),
                ..none
            },
            End::Failed { code, message } => Row {
                code: Some(code.as_str()),
                message: Some(message),
                ..none
            },
            End::Retry {
                not_before,
                code,
                message,
            } => Row {
                code: Some(code.as_str()),
                message: Some(message),
                not_before: Some(*not_before),
                ..none
            },
        }
    }
}

/// The records of the provider calls, one `job_attempts` row each, as the columns
/// [`finish_attempts`] writes them with.
struct CallColumns<'a> {
    ids: Vec<uuid::Uuid>,
    attempts: Vec<i32>,
    providers: Vec<&'a str>,
    models: Vec<&'a str>,
    keys: Vec<&'a str>,
    statuses: Vec<Option<i32>>,
    outcomes: Vec<&'static str>,
    codes: Vec<Option<ReasonCode>>,
    request_ids: Vec<Option<&'a str>>,
    input_tokens: Vec<Option<i32>>,
    output_tokens: Vec<Option<i32>>,
    cached_tokens: Vec<Option<i32>>,
    estimated_input: Vec<i32>,
    estimated_output: Vec<i32>,
    rate_limits: Vec<Option<&'a serde_json::Value>>,
    started: Vec<DateTime<Utc>>,
    finished: Vec<DateTime<Utc>>,
    tenants: Vec<&'a str>,
}

impl<'a> CallColumns<'a> {
    fn of(calls: &[(&'a Outcome, &'a Served, &'a Call)]) -> Self {
        let records: Vec<&Call> = calls.iter().map(|c| c.2).collect();
        let usage = |f: fn(&Usage) -> i64| {
            records
                .iter()
                .map(|r| r.usage.as_ref().map(|u| clamp_i32(f(u))))
                .collect::<Vec<_>>()
        };
        Self {
            ids: calls.iter().map(|c| c.0.holder.id.0).collect(),
            attempts: calls.iter().map(|c| c.0.holder.attempt).collect(),
            providers: calls.iter().map(|c| c.1.provider.as_str()).collect(),
            models: calls.iter().map(|c| c.1.model.as_str()).collect(),
            keys: records.iter().map(|r| r.key_name.as_str()).collect(),
            statuses: records.iter().map(|r| r.status).collect(),
            outcomes: records
                .iter()
                .map(|r| {
                    if r.error_code.is_some() {
                        "failed"
                    } else {
                        "succeeded"
                    }
                })
                .collect(),
            codes: records.iter().map(|r| r.error_code).collect(),
            request_ids: records.iter().map(|r| r.provider_request_id.as_deref()).collect(),
            input_tokens: usage(|u| u.input_tokens),
            output_tokens: usage(|u| u.output_tokens),
            cached_tokens: usage(|u| u.cached_tokens),
            estimated_input: records.iter().map(|r| r.estimated_input_tokens).collect(),
            estimated_output: records.iter().map(|r| r.estimated_output_tokens).collect(),
            rate_limits: records.iter().map(|r| r.rate_limit.as_ref()).collect(),
            started: records.iter().map(|r| r.started_at).collect(),
            finished: records.iter().map(|r| r.finished_at).collect(),
            tenants: records.iter().map(|r| r.tenant.as_str()).collect(),
        }
    }
}

fn clamp_i32(v: i64) -> i32 {
    v.clamp(0, i64::from(i32::MAX)) as i32
}

/// One of a holder's jobs as its heartbeat found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub id: JobId,
    pub attempt: i32,
    pub state: JobState,
}

/// The heartbeat: extends, to the database's `now()` plus `lease`, the leases of the jobs
/// of `ids` that `owner` still runs, and returns those of `ids` still leased to `owner`
/// with their attempt and state. A job missing from the answer, or back with another
/// attempt, was taken from `owner` (rescued, then perhaps claimed again); a `cancelled` one
/// runs for nobody. Either way its call is not worth finishing.
pub async fn extend_leases(
    ex: impl PgExecutor<'_>,
    owner: &str,
    ids: &[JobId],
    lease: std::time::Duration,
) -> Result<Vec<Held>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = ids.iter().map(|id| id.0).collect();
    Ok(sqlx::query_as!(
        Held,
        // A row another transaction holds is skipped, not waited for: that is the completer
        // finishing it (its lease is no longer needed), a cancel or the rescuer, and the next
        // beat, well within the lease, extends it if it still runs. Waiting could deadlock with
        // the completer, which locks the same owner's rows in whatever order its plan meets them.
        // The final read sees the rows as the statement began, locked or not.
        r#"WITH mine AS (
             SELECT id FROM jobs
             WHERE lease_owner = $1 AND id = ANY($3)
               AND (state::text = 'running' OR (state::text = 'cancelled' AND reserved_buckets IS NOT NULL))
             FOR NO KEY UPDATE SKIP LOCKED),
         extended AS (
             UPDATE jobs j SET lease_expires_at = now() + make_interval(secs => $2)
             FROM mine WHERE j.id = mine.id)
         SELECT id AS "id: JobId", attempt, state AS "state: JobState" FROM jobs
         WHERE id = ANY($3) AND lease_owner = $1"#,
        owner,
        lease.as_secs_f64(),
        &ids,
    )
    .fetch_all(ex)
    .await?)
}

/// Which of `attempts` (a job and its attempt) `owner` still holds, running: checked just
/// before calls that waited (a job handed over waits for a slot, and may be cancelled
/// meanwhile).
pub async fn running_held(
    ex: impl PgExecutor<'_>,
    attempts: &[(JobId, i32)],
    owner: &str,
) -> Result<Vec<JobId>> {
    let (ids, numbers): (Vec<uuid::Uuid>, Vec<i32>) = attempts.iter().map(|(id, n)| (id.0, *n)).unzip();
    Ok(sqlx::query_scalar!(
        r#"SELECT j.id AS "id!: JobId" FROM unnest($1::uuid[], $2::int[]) AS t(id, attempt)
           JOIN jobs j ON j.id = t.id
           WHERE j.state::text = 'running' AND j.attempt = t.attempt AND j.lease_owner = $3"#,
        &ids,
        &numbers,
        owner,
    )
    .fetch_all(ex)
    .await?)
}

/// Counts of what one maintenance pass changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rescued {
    /// Expired leases put back in the queue.
    pub requeued: u64,
    /// Expired leases whose job had no attempts left (failed with `lease_expired`), or
    /// whose client waited on a connection to the holder (failed with `client_disconnected`).
    pub failed: u64,
    /// Reservations of finished jobs whose holder died before settling them.
    pub orphans_settled: u64,
    /// Queued and admitted jobs whose synchronous caller waited on a process that died
    /// (failed with `client_disconnected`).
    pub callers_gone: u64,
}

/// Takes back what `owner`'s jobs hold (shutdown after the drain timeout) or what holders
/// whose lease expired held (they died or lost the database): the jobs return to the
/// queue — or fail with `lease_expired` when no attempts are left — and their reservations
/// are settled as sent with an unknown outcome. A job whose client waited for it on a
/// connection to the holder itself fails with `client_disconnected` instead — a stream
/// (it runs only in that process), or a synchronous call its caller's process held
/// (`caller_process`): the connection went with the process, so no one is left to answer,
/// and sent again the call would be paid for twice (the caller may even have had the
/// first answer). Queued, a stream would also hold capacity until its deadline, with no
/// process to claim it. At shutdown (`owner`) only streams fail so: a synchronous caller
/// may still be connected while the process stops, and answered by another's run. A
/// lease has expired when the database's
/// `now()` says so: a rescuer whose own clock runs ahead never takes a live job. `now` is
/// the time written as `finished_at`.
async fn release_running(pool: &PgPool, owner: Option<&str>, now: DateTime<Utc>) -> Result<Rescued> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query!(
        r#"WITH gone AS (
             SELECT id, reserved_buckets, reserved_amounts,
                    stream OR ($2::text IS NULL AND coalesce(caller_process = lease_owner, false)) AS callers_gone
             FROM jobs
             WHERE state = 'running' AND (lease_owner = $2 OR ($2 IS NULL AND lease_expires_at < now()))
             FOR UPDATE SKIP LOCKED)
         UPDATE jobs j SET
             state = CASE WHEN gone.callers_gone OR j.attempt >= j.max_attempts THEN 'failed'::job_state
                          ELSE 'queued' END,
             error_code = CASE WHEN gone.callers_gone THEN 'client_disconnected'
                               WHEN j.attempt >= j.max_attempts THEN 'lease_expired'
                               ELSE j.error_code END,
             error_message = CASE
                 WHEN gone.callers_gone
                     THEN 'the process holding the call stopped, and its client''s connection with it; not sent again'
                 WHEN j.attempt >= j.max_attempts THEN 'the dispatcher holding the job stopped and no attempts are left'
                 ELSE j.error_message END,
             finished_at = CASE WHEN gone.callers_gone OR j.attempt >= j.max_attempts THEN $1::timestamptz END,
             lease_owner = NULL, lease_expires_at = NULL,
             reserved_buckets = NULL, reserved_amounts = NULL
         FROM gone WHERE j.id = gone.id
         RETURNING j.id AS "id: JobId", j.state = 'failed' AS "failed!", gone.reserved_buckets AS old_buckets,
                   gone.reserved_amounts AS old_amounts"#,
        now,
        owner,
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut rescued = Rescued::default();
    let mut ended = Vec::new();
    let mut done = Vec::new();
    for row in rows {
        if row.failed {
            rescued.failed += 1;
            done.push(row.id);
        } else {
            rescued.requeued += 1;
        }
        if let Some(r) = reservation(row.old_buckets, row.old_amounts) {
            ended.push((row.id, r, Settlement::SENT_UNKNOWN));
        }
    }
    // Finished jobs (cancelled while running) whose holder died before settling.
    if owner.is_none() {
        let orphans = sqlx::query!(
            r#"WITH gone AS (
                 SELECT id, reserved_buckets, reserved_amounts FROM jobs
                 WHERE reserved_buckets IS NOT NULL AND state IN ('succeeded', 'failed', 'cancelled')
                   AND lease_expires_at < now()
                 FOR UPDATE SKIP LOCKED)
             UPDATE jobs j SET reserved_buckets = NULL, reserved_amounts = NULL,
                               lease_owner = NULL, lease_expires_at = NULL
             FROM gone WHERE j.id = gone.id
             RETURNING j.id AS "id: JobId", gone.reserved_buckets, gone.reserved_amounts"#,
        )
        .fetch_all(&mut *tx)
        .await?;
        for orphan in orphans {
            if let Some(r) = reservation(orphan.reserved_buckets, orphan.reserved_amounts) {
                rescued.orphans_settled += 1;
                ended.push((orphan.id, r, Settlement::SENT_UNKNOWN));
            }
        }
    }
    settle(&mut *tx, &ended).await?;
    notify_done(&mut tx, &done).await?;
    if rescued.requeued > 0 {
        notify_gate(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(rescued)
}

/// On shutdown: what `owner` did not finish goes back to the queue at once.
pub async fn release_leases(pool: &PgPool, owner: &str, now: DateTime<Utc>) -> Result<u64> {
    Ok(release_running(pool, Some(owner), now).await?.requeued)
}

/// Re-queues jobs whose holder stopped heartbeating (see [`release_running`]) and fails
/// those whose caller's process did ([`fail_callers_gone`]).
pub async fn rescue_expired_leases(pool: &PgPool, now: DateTime<Utc>) -> Result<Rescued> {
    let mut rescued = release_running(pool, None, now).await?;
    rescued.callers_gone = fail_callers_gone(pool, now).await?;
    Ok(rescued)
}

/// Writes that the process whose dispatcher is `owner` is alive for `lease` more: the
/// synchronous calls its callers wait for are its own to answer until then.
pub async fn beat(ex: impl PgExecutor<'_>, owner: &str, lease: std::time::Duration) -> Result<()> {
    sqlx::query!(
        "INSERT INTO processes (owner, expires_at) VALUES ($1, now() + make_interval(secs => $2))
         ON CONFLICT (owner) DO UPDATE SET expires_at = EXCLUDED.expires_at",
        owner,
        lease.as_secs_f64(),
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// Fails the queued and admitted jobs whose synchronous caller waited on a process whose
/// beat ([`beat`]) has expired: it died or lost the database, and its callers' connections
/// with it, so no one would read the answer. An admitted job's reservation goes back whole
/// (it was never sent). A process that never beat is not judged. Rows of processes gone a
/// day are deleted. Returns how many jobs failed.
async fn fail_callers_gone(pool: &PgPool, now: DateTime<Utc>) -> Result<u64> {
    let mut tx = pool.begin().await?;
    // `caller_process IS NOT NULL`, implied by the join, is said so the planner may read
    // the partial index `jobs_waiting_callers`.
    let rows = sqlx::query_as!(
        Previous,
        r#"WITH gone AS (
             SELECT j.id, j.state, j.reserved_buckets, j.reserved_amounts
             FROM processes p JOIN jobs j ON j.caller_process = p.owner
             WHERE p.expires_at < now() AND j.caller_process IS NOT NULL
               AND j.state IN ('queued', 'admitted')
             FOR UPDATE OF j SKIP LOCKED)
         UPDATE jobs j SET state = 'failed', finished_at = $1,
             error_code = 'client_disconnected',
             error_message = 'the process its caller waited on stopped, and its client''s connection with it; not sent',
             reserved_buckets = NULL, reserved_amounts = NULL
         FROM gone WHERE j.id = gone.id
         RETURNING j.id AS "id: JobId", gone.state AS "old_state: JobState", gone.reserved_buckets AS old_buckets,
                   gone.reserved_amounts AS old_amounts"#,
        now,
    )
    .fetch_all(&mut *tx)
    .await?;
    sqlx::query!("DELETE FROM processes WHERE expires_at < now() - interval '1 day'")
        .execute(&mut *tx)
        .await?;
    let failed = failed_unsent(&mut tx, rows).await?;
    tx.commit().await?;
    Ok(failed)
}

/// Fails queued and admitted jobs whose deadline has passed: they must never be
/// dispatched late. An admitted job's reservation goes back whole (it was never sent).
pub async fn expire_deadlines(pool: &PgPool, now: DateTime<Utc>) -> Result<u64> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query_as!(
        Previous,
        r#"WITH late AS (
             SELECT id, state, reserved_buckets, reserved_amounts FROM jobs
             WHERE state IN ('queued', 'admitted') AND deadline <= $1
             FOR UPDATE SKIP LOCKED)
         UPDATE jobs j SET state = 'failed', finished_at = $1,
             error_code = 'deadline_exceeded',
             error_message = CASE WHEN j.error_code IS NULL
                 THEN 'the deadline passed before the job could be sent'
                 ELSE 'the deadline passed before the job could be sent; last error: ' || j.error_code END,
             reserved_buckets = NULL, reserved_amounts = NULL
         FROM late WHERE j.id = late.id
         RETURNING j.id AS "id: JobId", late.state AS "old_state: JobState", late.reserved_buckets AS old_buckets,
                   late.reserved_amounts AS old_amounts"#,
        now,
    )
    .fetch_all(&mut *tx)
    .await?;
    let failed = failed_unsent(&mut tx, rows).await?;
    tx.commit().await?;
    Ok(failed)
}

/// For jobs just failed before they were sent (`rows`, as they were): gives their
/// reservations back whole and tells whoever waits for them. Returns how many.
async fn failed_unsent(conn: &mut PgConnection, rows: Vec<Previous>) -> Result<u64> {
    let ids: Vec<JobId> = rows.iter().map(|r| r.id).collect();
    let ended: Vec<(JobId, Reservation, Settlement)> = rows
        .into_iter()
        .filter_map(|r| reservation(r.old_buckets, r.old_amounts).map(|res| (r.id, res, Settlement::UNSENT)))
        .collect();
    settle(&mut *conn, &ended).await?;
    notify_done(conn, &ids).await?;
    Ok(ids.len() as u64)
}

/// Scopes a provider has paused (after a 429) until a time still to come.
pub async fn active_pauses(
    ex: impl PgExecutor<'_>,
    now: DateTime<Utc>,
) -> Result<Vec<(String, DateTime<Utc>)>> {
    let pauses = sqlx::query!("SELECT scope, until FROM pauses WHERE until > $1", now)
        .fetch_all(ex)
        .await?;
    Ok(pauses.into_iter().map(|p| (p.scope, p.until)).collect())
}

/// Forgets pauses that ended long ago.
pub async fn prune_pauses(ex: impl PgExecutor<'_>, now: DateTime<Utc>) -> Result<u64> {
    Ok(sqlx::query!(
        "DELETE FROM pauses WHERE until < $1::timestamptz - interval '1 hour'",
        now
    )
    .execute(ex)
    .await?
    .rows_affected())
}

/// Queue depth by state, for summaries and status.
pub async fn count_by_state(ex: impl PgExecutor<'_>) -> Result<Vec<(JobState, i64)>> {
    let counts = sqlx::query!(
        r#"SELECT state AS "state: JobState", count(*) AS "count!" FROM jobs GROUP BY state ORDER BY state"#
    )
    .fetch_all(ex)
    .await?;
    Ok(counts.into_iter().map(|c| (c.state, c.count)).collect())
}
