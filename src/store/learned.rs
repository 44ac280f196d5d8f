//! Learned limits (`learned_limits`): completers record what responses said; the gate
//! reads every row each round, applies what is new to the buckets it holds locked, and
//! writes back what it applied.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use super::Result;
use crate::buckets::{Bucket, BucketSpec};
use crate::learning::Learned;
pub use crate::learning::Observation;
use crate::model::JobId;
use crate::ratelimit::Reading;
use crate::vocab::{LearnedFrom, LimitName};

/// Records observations (the newest per scope and limit wins). A response that says
/// nothing still marks its scope as seen, which ends the scope's cold-start probe.
///
/// Each statement commits on its own and touches rows in (scope, name) order: these rows
/// are hot (every completer of every process writes them), so they are never locked
/// inside a longer transaction, where lock cycles with the gate would follow.
pub async fn record_observations(pool: &sqlx::PgPool, observations: &[&Observation]) -> Result<()> {
    // One row per (scope, name) per statement: keep the newest of the batch.
    let mut readings: BTreeMap<(&str, LimitName), (&Reading, DateTime<Utc>)> = BTreeMap::new();
    let mut throttles: BTreeMap<&str, DateTime<Utc>> = BTreeMap::new();
    let mut seen: BTreeMap<&str, DateTime<Utc>> = BTreeMap::new();
    for o in observations {
        for r in &o.readings {
            let e = readings.entry((o.scope.as_str(), r.name)).or_insert((r, o.at));
            if o.at >= e.1 {
                *e = (r, o.at);
            }
        }
        if o.throttled {
            let t = throttles.entry(o.scope.as_str()).or_insert(o.at);
            *t = (*t).max(o.at);
        }
        if o.readings.is_empty() && !o.throttled {
            seen.entry(o.scope.as_str()).or_insert(o.at);
        }
    }
    if !readings.is_empty() {
        let (keys, values): (Vec<_>, Vec<_>) = readings.into_iter().unzip();
        sqlx::query(
            "INSERT INTO learned_limits AS l (scope, name, reported, remaining, observed_at, source)
             SELECT s, n, r, rem, at, 'headers'
             FROM unnest($1::text[], $2::text[], $3::float8[], $4::float8[], $5::timestamptz[])
                  AS t(s, n, r, rem, at)
             ON CONFLICT ON CONSTRAINT learned_limits_pkey DO UPDATE SET
                 reported = COALESCE(excluded.reported, l.reported),
                 remaining = excluded.remaining,
                 observed_at = excluded.observed_at,
                 source = 'headers'
             WHERE excluded.observed_at >= l.observed_at",
        )
        .bind(keys.iter().map(|k| k.0).collect::<Vec<_>>())
        .bind(keys.iter().map(|k| k.1.as_str()).collect::<Vec<_>>())
        .bind(values.iter().map(|v| v.0.limit).collect::<Vec<_>>())
        .bind(values.iter().map(|v| v.0.remaining).collect::<Vec<_>>())
        .bind(values.iter().map(|v| v.1).collect::<Vec<_>>())
        .execute(pool)
        .await?;
    }
    if !throttles.is_empty() {
        let (scopes, at): (Vec<&str>, Vec<DateTime<Utc>>) = throttles.into_iter().unzip();
        sqlx::query(
            "INSERT INTO learned_limits AS l (scope, name, observed_at, throttled_at, source)
             SELECT s, 'rpm', at, at, 'throttling' FROM unnest($1::text[], $2::timestamptz[]) AS t(s, at)
             ON CONFLICT ON CONSTRAINT learned_limits_pkey DO UPDATE SET
                 throttled_at = GREATEST(l.throttled_at, excluded.throttled_at),
                 -- A limit never reported is learned from the 429s.
                 source = CASE WHEN l.reported IS NULL THEN 'throttling' ELSE l.source END",
        )
        .bind(scopes)
        .bind(at)
        .execute(pool)
        .await?;
    }
    if seen.is_empty() {
        return Ok(());
    }
    // Scopes seen for the first time (no row yet): a bare row ends their probe.
    let (scopes, at): (Vec<&str>, Vec<DateTime<Utc>>) = seen.into_iter().unzip();
    sqlx::query(
        "INSERT INTO learned_limits (scope, name, observed_at, source)
         SELECT s, 'rpm', at, 'headers' FROM unnest($1::text[], $2::timestamptz[]) AS t(s, at)
         WHERE NOT EXISTS (SELECT 1 FROM learned_limits l WHERE l.scope = t.s)
         ON CONFLICT ON CONSTRAINT learned_limits_pkey DO NOTHING",
    )
    .bind(scopes)
    .bind(at)
    .execute(pool)
    .await?;
    Ok(())
}

#[derive(sqlx::FromRow)]
struct LearnedRow {
    scope: String,
    name: String,
    reported: Option<f64>,
    remaining: Option<f64>,
    observed_at: DateTime<Utc>,
    throttled_at: Option<DateTime<Utc>>,
    source: String,
    ceiling: Option<f64>,
    decreases: i32,
    changed_at: Option<DateTime<Utc>>,
    applied_at: Option<DateTime<Utc>>,
}

/// Every learned limit.
pub async fn learned_limits(ex: impl PgExecutor<'_>) -> Result<Vec<Learned>> {
    let rows: Vec<LearnedRow> = sqlx::query_as(
        "SELECT scope, name, reported, remaining, observed_at, throttled_at, source, ceiling, decreases,
                changed_at, applied_at
         FROM learned_limits ORDER BY scope, name",
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            Some(Learned {
                name: LimitName::parse(&r.name)?,
                source: LearnedFrom::parse(&r.source)?,
                scope: r.scope,
                reported: r.reported,
                remaining: r.remaining,
                observed_at: r.observed_at,
                throttled_at: r.throttled_at,
                ceiling: r.ceiling,
                decreases: r.decreases,
                changed_at: r.changed_at,
                applied_at: r.applied_at,
            })
        })
        .collect())
}

/// Writes back what the gate applied and the learning state it changed (after the gate's
/// transaction commits, in one statement: see [`record_observations`]).
pub async fn save_learned(ex: impl PgExecutor<'_>, rows: &[Learned]) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "UPDATE learned_limits l SET applied_at = t.applied_at, ceiling = t.ceiling,
                                     decreases = t.decreases, changed_at = t.changed_at
         FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::float8[], $5::int4[], $6::timestamptz[])
              AS t(scope, name, applied_at, ceiling, decreases, changed_at)
         WHERE l.scope = t.scope AND l.name = t.name",
    )
    .bind(rows.iter().map(|r| r.scope.as_str()).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.name.as_str()).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.applied_at).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.ceiling).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.decreases).collect::<Vec<_>>())
    .bind(rows.iter().map(|r| r.changed_at).collect::<Vec<_>>())
    .execute(ex)
    .await?;
    Ok(())
}

/// Creates buckets that only learning (or the cold-start probe) knows of, at `level`, and
/// returns them locked (a row this transaction inserted is its own until commit). Buckets
/// that already exist are left alone and not returned.
pub async fn create_buckets(
    conn: &mut PgConnection,
    specs: &[(BucketSpec, f64, &str)],
    now: DateTime<Utc>,
) -> Result<Vec<Bucket>> {
    if specs.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO buckets (key, scope, dimension, rule, capacity, window_secs, level, updated_at, source, learned_at)
         SELECT k, s, d, r, c, w, l, $7, src, CASE WHEN src = 'learned' THEN $7 END
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::float8[], $6::bigint[], $8::float8[], $9::text[])
              AS t(k, s, d, r, c, w, l, src)
         ON CONFLICT ON CONSTRAINT buckets_key DO NOTHING
         RETURNING id",
    )
    .bind(specs.iter().map(|s| s.0.key.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.0.scope.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.0.dimension.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.0.rule.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.0.capacity).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.0.window_secs).collect::<Vec<_>>())
    .bind(now)
    .bind(specs.iter().map(|s| s.1).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.2).collect::<Vec<_>>())
    .fetch_all(&mut *conn)
    .await?;
    super::lock_buckets_by(conn, &[], &ids).await
}

/// Removes buckets (cold-start probes whose scope is now known). Reservations that still
/// name them settle against nothing.
pub async fn drop_buckets(ex: impl PgExecutor<'_>, keys: &[String]) -> Result<()> {
    if !keys.is_empty() {
        sqlx::query("DELETE FROM buckets WHERE key = ANY($1)")
            .bind(keys)
            .execute(ex)
            .await?;
    }
    Ok(())
}

/// Puts the admitted jobs of a provider model that no dispatcher has claimed yet back in
/// the queue, giving back what they hold: a limit learned after their admission must
/// govern them too. Returns how many went back.
pub async fn requeue_admitted(conn: &mut PgConnection, provider: &str, model: &str) -> Result<u64> {
    type Held = (uuid::Uuid, Option<Vec<i64>>, Option<Vec<f64>>);
    let rows: Vec<Held> = sqlx::query_as(
        "WITH picked AS (
             SELECT id, reserved_buckets, reserved_amounts FROM jobs
             WHERE state = 'admitted' AND provider = $1 AND provider_model = $2 AND NOT stream
             FOR UPDATE SKIP LOCKED)
         UPDATE jobs j SET state = 'queued', admitted_at = NULL, reserved_buckets = NULL, reserved_amounts = NULL
         FROM picked WHERE j.id = picked.id
         RETURNING picked.id, picked.reserved_buckets, picked.reserved_amounts",
    )
    .bind(provider)
    .bind(model)
    .fetch_all(&mut *conn)
    .await?;
    let n = rows.len() as u64;
    let ended: Vec<(JobId, super::Reservation, super::Settlement)> = rows
        .into_iter()
        .filter_map(|(id, buckets, amounts)| {
            Some((
                JobId(id),
                super::reservation(buckets, amounts)?,
                super::Settlement::UNSENT,
            ))
        })
        .collect();
    super::settle(conn, &ended).await?;
    Ok(n)
}

/// Requests sent to a provider model since `since` (what a first 429 says was too much).
pub async fn requests_since(
    ex: impl PgExecutor<'_>,
    provider: &str,
    model: &str,
    since: DateTime<Utc>,
) -> Result<f64> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM job_attempts
         WHERE provider = $1 AND provider_model = $2 AND started_at >= $3 AND status IS NOT NULL",
    )
    .bind(provider)
    .bind(model)
    .bind(since)
    .fetch_one(ex)
    .await?;
    Ok(n as f64)
}
