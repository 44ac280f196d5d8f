//! Provider batches: the dispatch decision on jobs, packing admitted provider-batch jobs
//! into a `provider_batches` row (the jobs `running`, leased to the pack), its progress,
//! and what it saved.

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, PgPool};

use super::Result;
use crate::model::{Decision, Job, JobId, Lane, LaneReason};
use crate::vocab::Endpoint;

/// Records dispatch decisions on jobs still queued and undecided.
pub async fn set_dispatch(ex: impl PgExecutor<'_>, decisions: &[(JobId, Decision)]) -> Result<usize> {
    let ids: Vec<uuid::Uuid> = decisions.iter().map(|d| d.0.0).collect();
    let lanes: Vec<Lane> = decisions.iter().map(|d| d.1.via).collect();
    let reasons: Vec<LaneReason> = decisions.iter().map(|d| d.1.reason).collect();
    let done = sqlx::query!(
        "UPDATE jobs j SET dispatch_via = t.via, dispatch_reason = t.reason
         FROM unnest($1::uuid[], $2::text[], $3::text[]) AS t(id, via, reason)
         WHERE j.id = t.id AND j.state::text = 'queued' AND j.dispatch_via IS NULL",
        &ids,
        &lanes as &[Lane],
        &reasons as &[LaneReason],
    )
    .execute(ex)
    .await?;
    Ok(done.rows_affected() as usize)
}

/// Admitted provider-batch jobs waiting to be packed, per (provider, model, key,
/// endpoint): a provider batch carries one endpoint.
#[derive(Debug, Clone)]
pub struct PackGroup {
    pub provider: String,
    pub model: String,
    pub key: Option<String>,
    pub endpoint: Endpoint,
    pub waiting: i64,
    pub oldest: DateTime<Utc>,
}

pub async fn pack_groups(ex: impl PgExecutor<'_>) -> Result<Vec<PackGroup>> {
    // An admitted job has its provider, model and admission time (the gate wrote them).
    Ok(sqlx::query_as!(
        PackGroup,
        r#"SELECT provider AS "provider!", provider_model AS "model!", provider_key AS key,
                  endpoint AS "endpoint: Endpoint", count(*) AS "waiting!", min(admitted_at) AS "oldest!"
           FROM jobs WHERE state = 'admitted' AND dispatch_via = 'provider_batch'
           GROUP BY provider, provider_model, provider_key, endpoint"#,
    )
    .fetch_all(ex)
    .await?)
}

/// The lease owner of a pack's jobs.
pub fn pack_owner(pack_id: &str) -> String {
    format!("provider_batch:{pack_id}")
}

/// A pack about to be opened.
#[derive(Debug, Clone)]
pub struct NewPack<'a> {
    pub id: &'a str,
    pub group: &'a PackGroup,
    pub max_lines: i64,
    pub max_bytes: i64,
    /// Most embedding inputs across the pack's lines (each line of another endpoint is
    /// one).
    pub max_inputs: i64,
    /// Lease of the pack's jobs: the provider's window and a margin; whoever polls the
    /// pack holds them, not a process.
    pub lease_until: DateTime<Utc>,
    /// Until when the submitter holds the pack `submitting` unless it renews the hold
    /// ([`extend_submission`]); after that the pack is anyone's to resolve
    /// ([`take_stale_packs`]).
    pub submit_until: DateTime<Utc>,
}

/// Opens a pack: in one transaction, claims up to `max_lines` admitted jobs of the group
/// (their request bodies within `max_bytes`) as `running` under the pack's lease and
/// records the pack as `submitting`, held by its submitter until `submit_until`. Nothing
/// is sent yet; a pack found still `submitting` after its hold may or may not have reached
/// the provider (see [`take_stale_packs`]).
pub async fn open_pack(pool: &PgPool, pack: &NewPack<'_>, now: DateTime<Utc>) -> Result<Vec<Job>> {
    let mut tx = pool.begin().await?;
    let jobs = query_jobs!(
        "WITH ordered AS (
             SELECT id, sum(octet_length(request::text) + 256) OVER (ORDER BY admitted_at, id) AS upto,
                    sum(CASE WHEN endpoint = '/v1/embeddings' AND jsonb_typeof(request->'input') = 'array'
                                  AND jsonb_typeof(request->'input'->0) IN ('string', 'array')
                             THEN jsonb_array_length(request->'input') ELSE 1 END)
                        OVER (ORDER BY admitted_at, id) AS inputs_upto
             FROM jobs
             WHERE state = 'admitted' AND dispatch_via = 'provider_batch' AND provider = $1
               AND provider_model = $2 AND provider_key IS NOT DISTINCT FROM $3 AND deadline > $6
               AND endpoint = $10
             ORDER BY admitted_at, id LIMIT $4),
         picked AS (
             SELECT j.id FROM jobs j JOIN ordered o ON o.id = j.id
             WHERE ((o.upto <= $5 AND o.inputs_upto <= $11) OR o.id = (SELECT id FROM ordered ORDER BY upto LIMIT 1))
               AND j.state = 'admitted'
             FOR UPDATE OF j SKIP LOCKED)
         UPDATE jobs j SET state = 'running', attempt = j.attempt + 1, lease_owner = $7, lease_expires_at = $8,
                           started_at = COALESCE(j.started_at, $6), provider_batch_id = $9
         FROM picked WHERE j.id = picked.id
         RETURNING",
        "",
        &pack.group.provider,
        &pack.group.model,
        pack.group.key.as_deref(),
        pack.max_lines,
        pack.max_bytes,
        now,
        pack_owner(pack.id),
        pack.lease_until,
        pack.id,
        pack.group.endpoint as Endpoint,
        pack.max_inputs,
    )
    .fetch_all(&mut *tx)
    .await?;
    if jobs.is_empty() {
        tx.rollback().await?;
        return Ok(jobs);
    }
    let bytes: i64 = jobs.iter().map(|j| j.request.to_string().len() as i64).sum();
    sqlx::query!(
        "INSERT INTO provider_batches (id, provider, model, key_name, status, lines, bytes, created_at, next_poll_at,
                                       endpoint)
         VALUES ($1, $2, $3, $4, 'submitting', $5, $6, $7, $8, $9)",
        pack.id,
        &pack.group.provider,
        &pack.group.model,
        pack.group.key.as_deref(),
        jobs.len() as i32,
        bytes,
        now,
        pack.submit_until,
        pack.group.endpoint as Endpoint,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(jobs)
}

/// `sqlx::query_as!` of [`ProviderBatch`] rows: the statement is `$head`, the row's columns,
/// then `$tail`; the statement calls the table `p`.
macro_rules! query_provider_batches {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            ProviderBatch,
            $head
                + r#" p.id, p.provider, p.model, p.key_name, p.endpoint AS "endpoint: Endpoint", p.status,
                    p.provider_batch_id, p.input_file_id,
                    p.provider_status, p.lines, p.bytes, p.succeeded, p.failed, p.requeued,
                    p.online_cost_micro_usd, p.batch_cost_micro_usd, p.error, p.created_at, p.submitted_at,
                    p.next_poll_at, p.ended_at "#
                + $tail
            $(, $arg)*
        )
    };
}

/// A row of `provider_batches`.
#[derive(Debug, Clone)]
pub struct ProviderBatch {
    pub id: String,
    pub provider: String,
    pub model: String,
    pub key_name: Option<String>,
    /// The endpoint of every line.
    pub endpoint: Endpoint,
    pub status: String,
    pub provider_batch_id: Option<String>,
    pub input_file_id: Option<String>,
    pub provider_status: Option<String>,
    pub lines: i32,
    pub bytes: i64,
    pub succeeded: Option<i32>,
    pub failed: Option<i32>,
    pub requeued: Option<i32>,
    pub online_cost_micro_usd: Option<f64>,
    pub batch_cost_micro_usd: Option<f64>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub submitted_at: Option<DateTime<Utc>>,
    pub next_poll_at: Option<DateTime<Utc>>,
    pub ended_at: Option<DateTime<Utc>>,
}

/// The provider accepted the pack: from now on it is polled.
pub async fn pack_submitted(
    ex: impl PgExecutor<'_>,
    id: &str,
    provider_batch_id: &str,
    input_file_id: Option<&str>,
    key_name: &str,
    now: DateTime<Utc>,
) -> Result<bool> {
    let done = sqlx::query!(
        "UPDATE provider_batches SET status = 'in_progress', provider_batch_id = $2, input_file_id = $3,
                                     submitted_at = $4, next_poll_at = $4, key_name = $5
         WHERE id = $1 AND status = 'submitting'",
        id,
        provider_batch_id,
        input_file_id,
        now,
        key_name,
    )
    .execute(ex)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Packs whose poll is due, taken for `hold` (so two pollers do not poll one pack).
pub async fn due_packs(
    ex: impl PgExecutor<'_>,
    now: DateTime<Utc>,
    hold: std::time::Duration,
    limit: i64,
) -> Result<Vec<ProviderBatch>> {
    Ok(query_provider_batches!(
        "UPDATE provider_batches p SET next_poll_at = $2
         FROM (SELECT id FROM provider_batches
               WHERE status = 'in_progress' AND next_poll_at <= $1
               ORDER BY next_poll_at LIMIT $3 FOR UPDATE SKIP LOCKED) due
         WHERE p.id = due.id
         RETURNING",
        "",
        now,
        now + hold,
        limit,
    )
    .fetch_all(ex)
    .await?)
}

/// When a pack still running at the provider is polled next.
pub async fn poll_later(ex: impl PgExecutor<'_>, id: &str, status: &str, at: DateTime<Utc>) -> Result<()> {
    sqlx::query!(
        "UPDATE provider_batches SET next_poll_at = $2, provider_status = $3 WHERE id = $1",
        id,
        at,
        status,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// The submitter still works on the pack (a large upload): it holds it `submitting`
/// until `until`. False when the pack is no longer its own to submit.
pub async fn extend_submission(ex: impl PgExecutor<'_>, id: &str, until: DateTime<Utc>) -> Result<bool> {
    let done = sqlx::query!(
        "UPDATE provider_batches SET next_poll_at = $2 WHERE id = $1 AND status = 'submitting'",
        id,
        until,
    )
    .execute(ex)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Packs still `submitting` whose submitter's hold ended (it died, or lost the database
/// before recording the provider's answer), taken for `hold` by the caller, who finds out
/// whether the provider has the batch ([`pack_submitted`]) or not ([`abandon_pack`]).
pub async fn take_stale_packs(
    ex: impl PgExecutor<'_>,
    now: DateTime<Utc>,
    hold: std::time::Duration,
) -> Result<Vec<ProviderBatch>> {
    Ok(query_provider_batches!(
        "UPDATE provider_batches p SET next_poll_at = $2
         FROM (SELECT id FROM provider_batches
               WHERE status = 'submitting' AND next_poll_at < $1
               FOR UPDATE SKIP LOCKED) stale
         WHERE p.id = stale.id
         RETURNING",
        "",
        now,
        now + hold,
    )
    .fetch_all(ex)
    .await?)
}

/// Marks a pack that never reached the provider `abandoned`; its jobs go back to the
/// queue. False when it was resolved meanwhile (its submitter recorded it after all).
pub async fn abandon_pack(ex: impl PgExecutor<'_>, id: &str, now: DateTime<Utc>) -> Result<bool> {
    let done = sqlx::query!(
        "UPDATE provider_batches SET status = 'abandoned', ended_at = $2,
                                     error = COALESCE(error, 'not submitted in time')
         WHERE id = $1 AND status = 'submitting'",
        id,
        now,
    )
    .execute(ex)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Marks a pack the provider refused as `abandoned`, with the reason.
pub async fn pack_refused(ex: impl PgExecutor<'_>, id: &str, error: &str, now: DateTime<Utc>) -> Result<()> {
    sqlx::query!(
        "UPDATE provider_batches SET status = 'abandoned', error = $2, ended_at = $3
         WHERE id = $1 AND status = 'submitting'",
        id,
        error,
        now,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// The pack's jobs it still holds: running, or cancelled meanwhile with their reservation
/// still to settle (their outcome is discarded and the reservation settled with it).
pub async fn pack_jobs(ex: impl PgExecutor<'_>, id: &str) -> Result<Vec<Job>> {
    Ok(query_jobs!(
        "SELECT",
        "FROM jobs j WHERE j.provider_batch_id = $1 AND j.lease_owner = $2
           AND (j.state = 'running' OR (j.state = 'cancelled' AND j.reserved_buckets IS NOT NULL))",
        id,
        pack_owner(id),
    )
    .fetch_all(ex)
    .await?)
}

/// A job of the flex lane the flex tier refused goes online (with why), while `owner`
/// still runs it.
pub async fn leave_flex(ex: impl PgExecutor<'_>, id: JobId, owner: &str) -> Result<bool> {
    Ok(sqlx::query!(
        "UPDATE jobs SET dispatch_via = 'online', dispatch_reason = $3
         WHERE id = $1 AND state = 'running' AND lease_owner = $2 AND dispatch_via = 'flex'",
        id.0,
        owner,
        LaneReason::FlexUnavailableRetryOnline.as_str(),
    )
    .execute(ex)
    .await?
    .rows_affected()
        == 1)
}

/// How long each provider model's batches took, submission to end, by (provider, model):
/// the p90 over the last day's ([`batch_turnarounds`]).
pub type Turnarounds = std::collections::HashMap<(String, String), chrono::Duration>;

/// How long each provider model's batches took from submission to their end: the p90 of
/// those that ended whole (every line back from the provider, none pulled back or sent
/// online) in the day before `now`, for the models that ended at least `min_packs`.
pub async fn batch_turnarounds(
    ex: impl PgExecutor<'_>,
    now: DateTime<Utc>,
    min_packs: i64,
) -> Result<Turnarounds> {
    let rows = sqlx::query!(
        r#"SELECT provider, model,
                  percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM ended_at - submitted_at))::float8 AS "p90!"
           FROM provider_batches
           WHERE status = 'ended' AND submitted_at IS NOT NULL
             AND provider_status IN ('completed', 'ended', 'BATCH_STATE_SUCCEEDED')
             AND COALESCE(requeued, 0) = 0 AND COALESCE(failed, 0) = 0
             AND ended_at > $1::timestamptz - interval '1 day'
           GROUP BY provider, model HAVING count(*) >= $2"#,
        now,
        min_packs,
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            (
                (r.provider, r.model),
                chrono::Duration::milliseconds((r.p90 * 1000.0) as i64),
            )
        })
        .collect())
}

/// What a provider model's flex tier did lately ([`flex_observations`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlexObserved {
    /// Jobs it served (finished while still on the flex lane).
    pub served: i64,
    /// Jobs it refused for capacity (then sent online).
    pub refused: i64,
    /// The p90 of the served jobs' time from start to finish, where it served any.
    pub p90_latency: Option<chrono::Duration>,
}

impl FlexObserved {
    /// The share of its recent calls the tier refused.
    pub fn refused_share(&self) -> f64 {
        self.refused as f64 / (self.served + self.refused).max(1) as f64
    }
}

/// What each provider model's flex tier did lately, by (provider, model).
pub type FlexObservations = std::collections::HashMap<(String, String), FlexObserved>;

/// What each provider model's flex tier did with the jobs started there since `since`: those
/// it served (state `succeeded` on the flex lane) and the p90 of their time from start to
/// finish, and those it refused ([`LaneReason::FlexUnavailableRetryOnline`]), for the
/// models with at least `min_jobs` of either. Read by index `jobs_flex_started`.
pub async fn flex_observations(
    ex: impl PgExecutor<'_>,
    since: DateTime<Utc>,
    min_jobs: i64,
) -> Result<FlexObservations> {
    let rows = sqlx::query!(
        r#"SELECT provider AS "provider!", provider_model AS "model!",
                  count(*) FILTER (WHERE dispatch_via = 'flex' AND state = 'succeeded') AS "served!",
                  count(*) FILTER (WHERE dispatch_reason = 'flex_unavailable_retry_online') AS "refused!",
                  percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at))
                      FILTER (WHERE dispatch_via = 'flex' AND state = 'succeeded')::float8 AS p90
           FROM jobs
           WHERE (dispatch_via = 'flex' OR dispatch_reason = 'flex_unavailable_retry_online')
             AND started_at > $1 AND provider IS NOT NULL AND provider_model IS NOT NULL
           GROUP BY provider, provider_model"#,
        since,
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .filter(|r| r.served + r.refused >= min_jobs)
        .map(|r| {
            let observed = FlexObserved {
                served: r.served,
                refused: r.refused,
                p90_latency: r.p90.map(|s| chrono::Duration::milliseconds((s * 1000.0) as i64)),
            };
            ((r.provider, r.model), observed)
        })
        .collect())
}

/// The earliest deadline of the lines pack `id` still runs (none when it runs none).
pub async fn pack_deadline(ex: impl PgExecutor<'_>, id: &str) -> Result<Option<DateTime<Utc>>> {
    Ok(sqlx::query_scalar!(
        "SELECT min(deadline) FROM jobs
         WHERE provider_batch_id = $1 AND lease_owner = $2 AND state = 'running'",
        id,
        pack_owner(id),
    )
    .fetch_one(ex)
    .await?)
}

/// Lines sent back from a pack to another lane (online, or the flex tier): the decision
/// changes (with why) before their outcome is written, while the pack still holds them.
pub async fn dispatch_again(
    ex: impl PgExecutor<'_>,
    pack_id: &str,
    ids: &[JobId],
    decision: Decision,
) -> Result<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    let ids: Vec<uuid::Uuid> = ids.iter().map(|i| i.0).collect();
    Ok(sqlx::query!(
        "UPDATE jobs SET dispatch_via = $3, dispatch_reason = $4
         WHERE id = ANY($1) AND state::text = 'running' AND lease_owner = $2",
        &ids,
        pack_owner(pack_id),
        decision.via.as_str(),
        decision.reason.as_str(),
    )
    .execute(ex)
    .await?
    .rows_affected())
}

/// How a pack ended.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PackEnd {
    pub provider_status: String,
    pub succeeded: i32,
    pub failed: i32,
    pub requeued: i32,
    pub online_cost_micro_usd: f64,
    pub batch_cost_micro_usd: f64,
}

pub async fn pack_ended(ex: impl PgExecutor<'_>, id: &str, end: &PackEnd, now: DateTime<Utc>) -> Result<()> {
    sqlx::query!(
        "UPDATE provider_batches SET status = 'ended', provider_status = $2, succeeded = $3, failed = $4,
                                     requeued = $5, online_cost_micro_usd = $6, batch_cost_micro_usd = $7,
                                     ended_at = $8, next_poll_at = NULL
         WHERE id = $1 AND status = 'in_progress'",
        id,
        &end.provider_status,
        end.succeeded,
        end.failed,
        end.requeued,
        end.online_cost_micro_usd,
        end.batch_cost_micro_usd,
        now,
    )
    .execute(ex)
    .await?;
    Ok(())
}

pub async fn get_provider_batch(ex: impl PgExecutor<'_>, id: &str) -> Result<Option<ProviderBatch>> {
    Ok(
        query_provider_batches!("SELECT", "FROM provider_batches p WHERE p.id = $1", id)
            .fetch_optional(ex)
            .await?,
    )
}

/// What a tollgate batch's lines cost so far, in micro-USD.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchCosts {
    /// Charged for the calls made (online and through provider batches).
    pub charged: f64,
    /// Held by lines admitted or running, not yet charged.
    pub reserved: f64,
    /// Saved by the lines that went through provider batch APIs, against online.
    pub saved: f64,
    /// How many lines went that way.
    pub provider_batch_lines: i64,
}

/// What batch `batch_id`'s lines cost so far (its spend) and saved.
pub async fn batch_costs(ex: impl PgExecutor<'_>, batch_id: &str) -> Result<BatchCosts> {
    let c = sqlx::query!(
        r#"SELECT COALESCE(sum(spend_micro_usd), 0)::float8 AS "charged!",
                  COALESCE(sum(reserved_micro_usd) FILTER (WHERE state IN ('admitted', 'running')), 0)::float8 AS "reserved!",
                  COALESCE(sum(saved_micro_usd), 0)::float8 AS "saved!",
                  count(*) FILTER (WHERE provider_batch_id IS NOT NULL) AS "jobs!"
           FROM jobs WHERE batch_id = $1"#,
        batch_id,
    )
    .fetch_one(ex)
    .await?;
    Ok(BatchCosts {
        charged: c.charged,
        reserved: c.reserved,
        saved: c.saved,
        provider_batch_lines: c.jobs,
    })
}
