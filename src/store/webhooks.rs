//! Webhook endpoints and the delivery outbox. Events are written in the transaction of
//! the state change they announce (jobs: the `jobs_webhook_ended` trigger; batches:
//! finalization calls [`enqueue_event`]) for every endpoint neither disabled nor retired.
//!
//! The sender claims deliveries one lease per attempt ([`claim_deliveries`]): the claim
//! locks the endpoints it takes from, so in-flight counts per endpoint and per tenant
//! (rows whose `leased_until` is ahead) hold across processes, and hands out an endpoint's
//! and a tenant's turns round-robin. Each attempt's outcome is written as it ends, guarded
//! by its attempt number ([`record_attempt`]), and keeps the endpoint's failure streak,
//! which disables an endpoint that fails for long enough. Endpoints are only ever added,
//! updated, retired or disabled by the sync from a config ([`sync_endpoints`]); a batch's
//! own endpoint goes with its batch.
//!
//! Lock order: an endpoint's row before its deliveries' rows, everywhere (the claim, the
//! record, disabling), so no two of them wait on each other.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, PgPool, Postgres};

use super::Result;
use crate::webhook_secrets::{SEALED_PREFIX, StoredSecret};

/// A tenant's endpoint as the config names it, its secret sealed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    pub tenant: String,
    pub url: String,
    pub secret: StoredSecret,
    pub events: Vec<String>,
    /// Queue nothing more for it; what is pending is still delivered.
    pub retired: bool,
    /// Clear a disabled mark.
    pub reenable: bool,
}

/// What a sync changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Synced {
    /// Endpoints written (added or updated).
    pub upserted: u64,
    /// Endpoints enabled again (`reenable`).
    pub reenabled: u64,
}

/// Adds the config's tenant endpoints or updates them (secret, events, retired or not),
/// and enables again those marked `reenable`. Endpoints the config does not name are left
/// alone, with their deliveries: another process may run a config that names them.
pub async fn sync_endpoints(
    conn: &mut PgConnection,
    specs: &[EndpointSpec],
    now: DateTime<Utc>,
) -> Result<Synced> {
    let tenants: Vec<&str> = specs.iter().map(|s| s.tenant.as_str()).collect();
    let urls: Vec<&str> = specs.iter().map(|s| s.url.as_str()).collect();
    let upserted = sqlx::query(
        "INSERT INTO webhook_endpoints (tenant, url, secret, events, created_at, retired_at)
         SELECT t.tenant, t.url, t.secret, string_to_array(t.events, ','), $6,
                CASE WHEN t.retired THEN $6::timestamptz END
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bool[])
              AS t(tenant, url, secret, events, retired)
         ON CONFLICT (tenant, url) WHERE batch_id IS NULL
         DO UPDATE SET secret = excluded.secret, events = excluded.events,
                       retired_at = CASE WHEN excluded.retired_at IS NULL THEN NULL
                                         ELSE coalesce(webhook_endpoints.retired_at, excluded.retired_at) END",
    )
    .bind(&tenants)
    .bind(&urls)
    .bind(specs.iter().map(|s| s.secret.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.events.join(",")).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.retired).collect::<Vec<_>>())
    .bind(now)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let reenabled = sqlx::query(
        "UPDATE webhook_endpoints e
         SET disabled_at = NULL, disabled_reason = NULL, failing_since = NULL, consecutive_failures = 0
         FROM unnest($1::text[], $2::text[], $3::bool[]) AS t(tenant, url, reenable)
         WHERE t.reenable AND e.batch_id IS NULL AND e.tenant = t.tenant AND e.url = t.url
           AND e.disabled_at IS NOT NULL",
    )
    .bind(&tenants)
    .bind(&urls)
    .bind(specs.iter().map(|s| s.reenable).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(Synced { upserted, reenabled })
}

/// Registers a batch's own endpoint (in the transaction that creates the batch).
pub async fn add_batch_endpoint(
    ex: impl PgExecutor<'_>,
    tenant: &str,
    batch_id: &str,
    url: &str,
    secret: &StoredSecret,
    events: &[String],
    now: DateTime<Utc>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO webhook_endpoints (tenant, batch_id, url, secret, events, created_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(tenant)
    .bind(batch_id)
    .bind(url)
    .bind(secret.as_str())
    .bind(events)
    .bind(now)
    .execute(ex)
    .await?;
    Ok(())
}

/// An endpoint whose secret is stored as it is (a row from before secrets were sealed).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct UnsealedSecret {
    pub id: i64,
    pub tenant: String,
    #[sqlx(try_from = "String")]
    pub secret: StoredSecret,
}

/// Endpoints whose secret is not sealed.
pub async fn unsealed_secrets(ex: impl PgExecutor<'_>) -> Result<Vec<UnsealedSecret>> {
    Ok(sqlx::query_as::<Postgres, UnsealedSecret>(
        "SELECT id, tenant, secret FROM webhook_endpoints WHERE NOT starts_with(secret, $1)",
    )
    .bind(SEALED_PREFIX)
    .fetch_all(ex)
    .await?)
}

/// Replaces an endpoint's secret by its sealed form, if it is still `old`.
pub async fn seal_secret(
    ex: impl PgExecutor<'_>,
    id: i64,
    old: &StoredSecret,
    sealed: &StoredSecret,
) -> Result<bool> {
    Ok(
        sqlx::query("UPDATE webhook_endpoints SET secret = $3 WHERE id = $1 AND secret = $2")
            .bind(id)
            .bind(old.as_str())
            .bind(sealed.as_str())
            .execute(ex)
            .await?
            .rows_affected()
            > 0,
    )
}

/// How many endpoint secrets each key sealed, by key id (`sealed:v1:<key id>:…`).
pub async fn sealing_key_ids(ex: impl PgExecutor<'_>) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT split_part(secret, ':', 3), count(*) FROM webhook_endpoints
         WHERE starts_with(secret, $1) GROUP BY 1 ORDER BY 1",
    )
    .bind(SEALED_PREFIX)
    .fetch_all(ex)
    .await?)
}

/// A disabled endpoint, for the operator.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DisabledEndpoint {
    pub id: i64,
    pub tenant: String,
    pub batch_id: Option<String>,
    pub url: String,
    pub disabled_at: DateTime<Utc>,
    pub disabled_reason: Option<String>,
}

/// The disabled tenant endpoints (batch endpoints excluded when `tenant_only`).
pub async fn disabled_endpoints(ex: impl PgExecutor<'_>, tenant_only: bool) -> Result<Vec<DisabledEndpoint>> {
    Ok(sqlx::query_as::<Postgres, DisabledEndpoint>(
        "SELECT id, tenant, batch_id, url, disabled_at, disabled_reason FROM webhook_endpoints
         WHERE disabled_at IS NOT NULL AND (batch_id IS NULL OR NOT $1) ORDER BY id",
    )
    .bind(tenant_only)
    .fetch_all(ex)
    .await?)
}

/// Queues `body` for every live endpoint of the tenant (and of the batch) subscribed to
/// `event_type`. Call in the transaction of the state change it announces.
pub async fn enqueue_event(
    ex: impl PgExecutor<'_>,
    tenant: &str,
    batch_id: Option<&str>,
    event_type: &str,
    body: &str,
    now: DateTime<Utc>,
) -> Result<u64> {
    Ok(sqlx::query(
        "INSERT INTO webhook_deliveries (id, endpoint_id, event_type, body, next_attempt_at, created_at)
         SELECT 'msg_' || replace(gen_random_uuid()::text, '-', ''), e.id, $3, $4, $5, $5
         FROM webhook_endpoints e
         WHERE e.tenant = $1 AND (e.batch_id IS NULL OR e.batch_id = $2)
           AND e.disabled_at IS NULL AND e.retired_at IS NULL AND $3 = ANY (e.events)",
    )
    .bind(tenant)
    .bind(batch_id)
    .bind(event_type)
    .bind(body)
    .bind(now)
    .execute(ex)
    .await?
    .rows_affected())
}

/// A delivery claimed for one attempt.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Delivery {
    pub id: String,
    pub endpoint_id: i64,
    pub tenant: String,
    pub url: String,
    #[sqlx(try_from = "String")]
    pub secret: StoredSecret,
    pub event_type: String,
    pub body: String,
    /// This attempt's number (1 = the first).
    pub attempts: i32,
    /// Set when the endpoint was disabled after this delivery was queued: it is failed,
    /// not sent.
    pub disabled_reason: Option<String>,
}

/// How many deliveries a claim may put in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimLimits {
    /// Free slots of the claiming sender.
    pub slots: i64,
    /// In flight to one endpoint, over every process.
    pub per_endpoint: i64,
    /// In flight to one tenant's endpoints, over every process.
    pub per_tenant: i64,
}

/// First key of the advisory locks a claim takes on its tenants (the second is the hash of
/// the tenant's name): "tgwh".
const TENANT_CLAIM_LOCKS: i32 = 0x7467_7768;

/// Claims deliveries due at `now` for one attempt each: bumps the attempt and leases the
/// delivery for `lease` from the database's `now()` (`leased_until`, and `next_attempt_at`,
/// so a sender that dies has it claimed again once the lease is over). Leases in flight are
/// counted by the database's `now()` too: no sender's clock decides another's are over.
///
/// At most `per_endpoint` deliveries of an endpoint and `per_tenant` of a tenant are in
/// flight, counting every process's leases; the turns go round-robin — every endpoint's
/// first before any endpoint's second within a tenant, and the least busy tenant first —
/// so a slow receiver keeps its own slots busy, not another tenant's. Endpoints another
/// sender is claiming from at the moment are skipped (endpoint rows and tenants are
/// locked first and the counts read after, so two senders never both fill one share).
pub async fn claim_deliveries(
    pool: &PgPool,
    now: DateTime<Utc>,
    limits: ClaimLimits,
    lease: std::time::Duration,
) -> Result<Vec<Delivery>> {
    if limits.slots <= 0 {
        return Ok(Vec::new());
    }
    let mut tx = pool.begin().await?;
    // The endpoints with a due delivery: a skip scan over the endpoints that have pending
    // deliveries (one index probe each), however long one endpoint's backlog is. Each is
    // locked, and its tenant (an advisory lock for the transaction), or skipped when
    // another sender holds either.
    let endpoints: Vec<i64> = sqlx::query_scalar(
        "WITH RECURSIVE pending(endpoint_id) AS (
             (SELECT endpoint_id FROM webhook_deliveries WHERE state = 'pending'
              ORDER BY endpoint_id LIMIT 1)
             UNION ALL
             SELECT (SELECT d.endpoint_id FROM webhook_deliveries d
                     WHERE d.state = 'pending' AND d.endpoint_id > p.endpoint_id
                     ORDER BY d.endpoint_id LIMIT 1)
             FROM pending p WHERE p.endpoint_id IS NOT NULL)
         , due AS (
             SELECT e.id, e.tenant FROM webhook_endpoints e
             WHERE e.id IN (SELECT endpoint_id FROM pending WHERE endpoint_id IS NOT NULL)
               AND EXISTS (SELECT 1 FROM webhook_deliveries d
                           WHERE d.endpoint_id = e.id AND d.state = 'pending' AND d.next_attempt_at <= $1)
             FOR NO KEY UPDATE OF e SKIP LOCKED)
         SELECT id FROM due WHERE pg_try_advisory_xact_lock($2, hashtext(tenant))",
    )
    .bind(now)
    .bind(TENANT_CLAIM_LOCKS)
    .fetch_all(&mut *tx)
    .await?;
    if endpoints.is_empty() {
        return Ok(Vec::new());
    }
    let claimed = sqlx::query_as::<Postgres, Delivery>(
        "WITH ep AS (
             SELECT e.id, e.tenant,
                    $3 - (SELECT count(*) FROM webhook_deliveries d
                          WHERE d.endpoint_id = e.id AND d.leased_until IS NOT NULL
                            AND d.leased_until > now() AND d.state = 'pending') AS free
             FROM webhook_endpoints e WHERE e.id = ANY ($2)),
         busy AS (
             SELECT e.tenant, count(*) AS n
             FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
             WHERE d.leased_until IS NOT NULL AND d.leased_until > now() AND d.state = 'pending'
             GROUP BY e.tenant),
         candidates AS (
             SELECT c.id, ep.tenant, c.next_attempt_at,
                    row_number() OVER (PARTITION BY ep.id ORDER BY c.next_attempt_at, c.id) AS turn
             FROM ep CROSS JOIN LATERAL (
                 SELECT d.id, d.next_attempt_at FROM webhook_deliveries d
                 WHERE d.endpoint_id = ep.id AND d.state = 'pending' AND d.next_attempt_at <= $1
                 ORDER BY d.next_attempt_at, d.id LIMIT greatest(ep.free, 0)) c),
         ranked AS (
             SELECT c.id, c.next_attempt_at,
                    coalesce(b.n, 0)
                      + row_number() OVER (PARTITION BY c.tenant ORDER BY c.turn, c.next_attempt_at, c.id) AS load
             FROM candidates c LEFT JOIN busy b ON b.tenant = c.tenant),
         picked AS (
             SELECT id FROM ranked WHERE load <= $4
             ORDER BY load, next_attempt_at, id LIMIT $5)
         UPDATE webhook_deliveries d
         SET attempts = d.attempts + 1, next_attempt_at = now() + make_interval(secs => $6),
             leased_until = now() + make_interval(secs => $6)
         FROM picked, webhook_endpoints e
         WHERE d.id = picked.id AND d.state = 'pending' AND e.id = d.endpoint_id
         RETURNING d.id, d.endpoint_id, e.tenant, e.url, e.secret, d.event_type, d.body, d.attempts,
                   e.disabled_reason",
    )
    .bind(now)
    .bind(&endpoints)
    .bind(limits.per_endpoint)
    .bind(limits.per_tenant)
    .bind(limits.slots)
    .bind(lease.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(claimed)
}

/// Gives a claimed delivery back untried (its sender is stopping): due at `now`, its
/// attempt not counted.
pub async fn release_delivery(ex: impl PgExecutor<'_>, d: &Delivery, now: DateTime<Utc>) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE webhook_deliveries SET attempts = attempts - 1, next_attempt_at = $3, leased_until = NULL
         WHERE id = $1 AND attempts = $2 AND state = 'pending'",
    )
    .bind(&d.id)
    .bind(d.attempts)
    .bind(now)
    .execute(ex)
    .await?
    .rows_affected()
        > 0)
}

/// How one attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempted {
    Delivered {
        status: i32,
    },
    /// Try again at `at`.
    Retry {
        at: DateTime<Utc>,
        status: Option<i32>,
        error: String,
        /// Whether the receiver failed it (its answer, or no answer): such failures make
        /// the endpoint's failure streak; a failure on this side (say, a secret this
        /// process cannot open) does not.
        receiver: bool,
    },
    /// Out of attempts (or refused for good).
    Failed {
        status: Option<i32>,
        error: String,
        receiver: bool,
    },
    /// The receiver answered 410 Gone: disable the endpoint and fail what waits for it.
    Gone,
}

/// When failing disables an endpoint: `failures` consecutive failed attempts (0: never),
/// the first of them at least `after` ago.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisableRule {
    pub failures: u32,
    pub after: chrono::Duration,
}

/// What writing an attempt did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Whether the outcome was written (the delivery was still at that attempt).
    pub written: bool,
    /// Why the endpoint was disabled, when this attempt disabled it.
    pub disabled: Option<String>,
}

/// Writes an attempt's outcome if the delivery is still at that attempt (a sender whose
/// lease ran out does not overwrite the next one), and the endpoint's failure streak: a
/// success ends it, a receiver's failure extends it, and a streak that meets `rule` — or
/// a 410 — disables the endpoint.
pub async fn record_attempt(
    conn: &mut PgConnection,
    d: &Delivery,
    outcome: &Attempted,
    rule: DisableRule,
    now: DateTime<Utc>,
) -> Result<Recorded> {
    let (state, next, status, error): (&str, Option<DateTime<Utc>>, Option<i32>, Option<&str>) = match outcome
    {
        Attempted::Delivered { status } => ("delivered", None, Some(*status), None),
        Attempted::Retry {
            at, status, error, ..
        } => ("pending", Some(*at), *status, Some(error)),
        Attempted::Failed { status, error, .. } => ("failed", None, *status, Some(error)),
        Attempted::Gone => ("failed", None, Some(410), Some(GONE)),
    };
    sqlx::query("SELECT 1 FROM webhook_endpoints WHERE id = $1 FOR NO KEY UPDATE")
        .bind(d.endpoint_id)
        .execute(&mut *conn)
        .await?;
    let written = sqlx::query(
        "UPDATE webhook_deliveries SET state = $3, next_attempt_at = COALESCE($4, next_attempt_at),
                leased_until = NULL, last_status = $5, last_error = $6,
                delivered_at = CASE WHEN $3 = 'delivered' THEN $7 END
         WHERE id = $1 AND attempts = $2 AND state = 'pending'",
    )
    .bind(&d.id)
    .bind(d.attempts)
    .bind(state)
    .bind(next)
    .bind(status)
    .bind(error)
    .bind(now)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        > 0;
    if !written {
        return Ok(Recorded::default());
    }
    let disable = match outcome {
        Attempted::Delivered { .. } => {
            sqlx::query(
                "UPDATE webhook_endpoints SET consecutive_failures = 0, failing_since = NULL
                 WHERE id = $1 AND (consecutive_failures > 0 OR failing_since IS NOT NULL)",
            )
            .bind(d.endpoint_id)
            .execute(&mut *conn)
            .await?;
            None
        }
        Attempted::Gone => Some(GONE.to_owned()),
        Attempted::Retry {
            receiver: true,
            error,
            ..
        }
        | Attempted::Failed {
            receiver: true,
            error,
            ..
        } => {
            let streak: Option<(i32, DateTime<Utc>)> = sqlx::query_as(
                "UPDATE webhook_endpoints
                 SET consecutive_failures = consecutive_failures + 1, failing_since = coalesce(failing_since, $2)
                 WHERE id = $1 AND disabled_at IS NULL
                 RETURNING consecutive_failures, failing_since",
            )
            .bind(d.endpoint_id)
            .bind(now)
            .fetch_optional(&mut *conn)
            .await?;
            streak.and_then(|(failures, since)| {
                let long_enough = rule.failures > 0
                    && i64::from(failures) >= i64::from(rule.failures)
                    && now - since >= rule.after;
                long_enough.then(|| {
                    format!(
                        "failing since {}: {failures} attempts in a row failed, the last: {error}",
                        since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    )
                })
            })
        }
        Attempted::Retry { .. } | Attempted::Failed { .. } => None,
    };
    let disabled = match disable {
        Some(reason) => disable_endpoint(conn, d.endpoint_id, &reason, now)
            .await?
            .then_some(reason),
        None => None,
    };
    Ok(Recorded { written, disabled })
}

const GONE: &str = "the receiver answered 410 Gone";

/// Disables an endpoint (unless it is already) with `reason`, and fails every delivery
/// pending for it, saying why. Returns whether it disabled it.
async fn disable_endpoint(
    conn: &mut PgConnection,
    id: i64,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<bool> {
    let disabled = sqlx::query(
        "UPDATE webhook_endpoints SET disabled_at = $2, disabled_reason = $3
         WHERE id = $1 AND disabled_at IS NULL",
    )
    .bind(id)
    .bind(now)
    .bind(reason)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        > 0;
    if disabled {
        sqlx::query(
            "UPDATE webhook_deliveries SET state = 'failed', leased_until = NULL,
                    last_error = 'the endpoint was disabled: ' || $2
             WHERE endpoint_id = $1 AND state = 'pending'",
        )
        .bind(id)
        .bind(reason)
        .execute(&mut *conn)
        .await?;
    }
    Ok(disabled)
}

/// Deletes up to `limit` delivered or failed deliveries created before `before`.
pub async fn prune_deliveries(ex: impl PgExecutor<'_>, before: DateTime<Utc>, limit: i64) -> Result<u64> {
    Ok(sqlx::query(
        "DELETE FROM webhook_deliveries WHERE id IN (
             SELECT id FROM webhook_deliveries WHERE state <> 'pending' AND created_at < $1 LIMIT $2)",
    )
    .bind(before)
    .bind(limit)
    .execute(ex)
    .await?
    .rows_affected())
}

/// When the next pending delivery is due (for the sender's sleep), if any.
pub async fn next_delivery_due(ex: impl PgExecutor<'_>) -> Result<Option<DateTime<Utc>>> {
    Ok(
        sqlx::query_scalar("SELECT min(next_attempt_at) FROM webhook_deliveries WHERE state = 'pending'")
            .fetch_one(ex)
            .await?,
    )
}
