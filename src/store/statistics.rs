//! Planner statistics of the queue table, kept fresh between autovacuum's visits.
//!
//! The claim and the gate's reads are fast only when the planner knows how many rows
//! each state holds: with the statistics of an empty table, a claim over 20,000 admitted
//! jobs sorted all of them (200 ms) instead of reading eight from its index (0.3 ms).
//! Autovacuum analyzes at most once per `autovacuum_naptime` (a minute by default), and a
//! bulk submission changes the picture in a second; so maintenance analyzes `jobs` itself
//! when enough of it changed since the last analyze.

use sqlx::PgPool;

use super::Result;

/// Advisory lock key of a running analyze ("tg-stats" in ASCII): one process at a time.
const ANALYZE_LOCK: i64 = 0x7467_2d73_7461_7473;

/// Rows changed since the last analyze before another is worth it: this many, plus
/// [`STALE_SHARE`] of the table.
const STALE_ROWS: f64 = 1_000.0;
const STALE_SHARE: f64 = 0.2;
/// Seconds between two analyzes at least, however fast the table changes.
const MIN_GAP_SECS: f64 = 5.0;

/// Analyzes `jobs` if its statistics are stale; true when it did. Another process's
/// running analyze counts as done. An analyze of some columns does not reset PostgreSQL's
/// count of changes since the last analyze, so the caller keeps that count as it was at
/// its own last analyze in `analyzed_at` and only the changes since then count.
pub async fn refresh_job_statistics(
    pool: &PgPool,
    analyzed_at: &std::sync::atomic::AtomicI64,
) -> Result<bool> {
    use std::sync::atomic::Ordering;
    let (changed, rows) = sqlx::query!(
        r#"SELECT COALESCE(s.n_mod_since_analyze, 0) AS "changed!", c.reltuples FROM pg_class c
           LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
           WHERE c.oid = 'jobs'::regclass
             AND COALESCE(greatest(s.last_analyze, s.last_autoanalyze) < now() - $1 * interval '1 second', true)"#,
        MIN_GAP_SECS,
    )
    .fetch_optional(pool)
    .await?
    .map_or((0, 0.0), |r| (r.changed, r.reltuples));
    let before = analyzed_at.load(Ordering::Relaxed);
    // Below the mark: a full analyze (autovacuum's) reset the count since.
    let since = if changed >= before {
        changed - before
    } else {
        changed
    };
    if (since as f64) < STALE_ROWS + STALE_SHARE * f64::from(rows.max(0.0)) {
        return Ok(false);
    }
    let mut tx = pool.begin().await?;
    let locked = sqlx::query_scalar!(
        r#"SELECT pg_try_advisory_xact_lock($1) AS "locked!""#,
        ANALYZE_LOCK
    )
    .fetch_one(&mut *tx)
    .await?;
    if locked {
        // Only the columns the queue's statements filter and sort on: the request and
        // result bodies (large JSON) are never in a predicate, and sampling them made each
        // analyze ten times slower.
        sqlx::query!(
            "ANALYZE jobs (state, class, tenant, priority, deadline, not_before, admitted_at, lease_expires_at,
                           finished_at, provider, provider_model, stream, batch_id, dispatch_via, idempotency_key)"
        )
        .execute(&mut *tx)
        .await?;
        analyzed_at.store(changed, Ordering::Relaxed);
    }
    tx.commit().await?;
    Ok(locked)
}
