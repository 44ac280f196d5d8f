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
use crate::vocab::{Dimension, LearnedFrom, LimitName, Rule};

/// Records observations (the newest per scope and limit wins). A response that says
/// nothing still marks its scope as seen, which ends the scope's cold-start probe.
///
/// Each statement commits on its own and touches rows in (scope, name) order: these rows
/// are hot (every completer of every process writes them), so they are never locked
/// inside a longer transaction, where lock cycles with the gate would follow.
pub async fn record_observations(pool: &sqlx::PgPool, observations: &[&Observation]) -> Result<()> {
    // One row per (scope, name) per statement: keep the newest of the batch.
    let mut readings: BTreeMap<(&str, LimitName), (&Reading, DateTime<Utc>)> = BTreeMap::new();
    let mut throttles: BTreeMap<(&str, LimitName), DateTime<Utc>> = BTreeMap::new();
    let mut seen: BTreeMap<&str, DateTime<Utc>> = BTreeMap::new();
    for o in observations {
        for r in &o.readings {
            let e = readings.entry((o.scope.as_str(), r.name)).or_insert((r, o.at));
            if o.at >= e.1 {
                *e = (r, o.at);
            }
        }
        if o.throttled {
            let names = match o.bound {
                Some(name) => vec![name],
                None => vec![LimitName::Rpm, LimitName::Tpm],
            };
            for name in names {
                let t = throttles.entry((o.scope.as_str(), name)).or_insert(o.at);
                *t = (*t).max(o.at);
            }
        }
        if o.readings.is_empty() && !o.throttled {
            seen.entry(o.scope.as_str()).or_insert(o.at);
        }
    }
    if !readings.is_empty() {
        let (keys, values): (Vec<_>, Vec<_>) = readings.into_iter().unzip();
        let scopes: Vec<&str> = keys.iter().map(|k| k.0).collect();
        let names: Vec<LimitName> = keys.iter().map(|k| k.1).collect();
        let limits: Vec<Option<f64>> = values.iter().map(|v| v.0.limit).collect();
        let remaining: Vec<Option<f64>> = values.iter().map(|v| v.0.remaining).collect();
        let at: Vec<DateTime<Utc>> = values.iter().map(|v| v.1).collect();
        sqlx::query!(
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
            &scopes as &[&str],
            &names as &[LimitName],
            &limits as &[Option<f64>],
            &remaining as &[Option<f64>],
            &at,
        )
        .execute(pool)
        .await?;
    }
    if !throttles.is_empty() {
        let (keys, at): (Vec<(&str, LimitName)>, Vec<DateTime<Utc>>) = throttles.into_iter().unzip();
        let (scopes, names): (Vec<&str>, Vec<LimitName>) = keys.into_iter().unzip();
        sqlx::query!(
            "INSERT INTO learned_limits AS l (scope, name, observed_at, throttled_at, source)
             SELECT s, n, at, at, 'throttling'
             FROM unnest($1::text[], $2::text[], $3::timestamptz[]) AS t(s, n, at)
             ON CONFLICT ON CONSTRAINT learned_limits_pkey DO UPDATE SET
                 throttled_at = GREATEST(l.throttled_at, excluded.throttled_at),
                 -- A limit never reported is learned from the 429s.
                 source = CASE WHEN l.reported IS NULL THEN 'throttling' ELSE l.source END",
            &scopes as &[&str],
            &names as &[LimitName],
            &at,
        )
        .execute(pool)
        .await?;
    }
    if seen.is_empty() {
        return Ok(());
    }
    // Scopes seen for the first time (no row yet): a bare row ends their probe.
    let (scopes, at): (Vec<&str>, Vec<DateTime<Utc>>) = seen.into_iter().unzip();
    sqlx::query!(
        "INSERT INTO learned_limits (scope, name, observed_at, source)
         SELECT s, 'rpm', at, 'headers' FROM unnest($1::text[], $2::timestamptz[]) AS t(s, at)
         WHERE NOT EXISTS (SELECT 1 FROM learned_limits l WHERE l.scope = t.s)
         ON CONFLICT ON CONSTRAINT learned_limits_pkey DO NOTHING",
        &scopes as &[&str],
        &at,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Every learned limit.
pub async fn learned_limits(ex: impl PgExecutor<'_>) -> Result<Vec<Learned>> {
    // `source` decodes as a `LearnedFrom`: its CHECK constraint allows only the names that
    // has. `name` has no constraint, so a row of a name this version does not know is
    // skipped rather than failing the read.
    let rows = sqlx::query!(
        r#"SELECT scope, name, reported, remaining, observed_at, throttled_at, source AS "source: LearnedFrom",
                  ceiling, decreases, changed_at, applied_at
           FROM learned_limits ORDER BY scope, name"#,
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            Some(Learned {
                name: LimitName::parse(&r.name)?,
                source: r.source,
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
    let scopes: Vec<&str> = rows.iter().map(|r| r.scope.as_str()).collect();
    let names: Vec<LimitName> = rows.iter().map(|r| r.name).collect();
    let applied: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.applied_at).collect();
    let ceilings: Vec<Option<f64>> = rows.iter().map(|r| r.ceiling).collect();
    let decreases: Vec<i32> = rows.iter().map(|r| r.decreases).collect();
    let changed: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.changed_at).collect();
    sqlx::query!(
        "UPDATE learned_limits l SET applied_at = t.applied_at, ceiling = t.ceiling,
                                     decreases = t.decreases, changed_at = t.changed_at
         FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::float8[], $5::int4[], $6::timestamptz[])
              AS t(scope, name, applied_at, ceiling, decreases, changed_at)
         WHERE l.scope = t.scope AND l.name = t.name",
        &scopes as &[&str],
        &names as &[LimitName],
        &applied as &[Option<DateTime<Utc>>],
        &ceilings as &[Option<f64>],
        &decreases,
        &changed as &[Option<DateTime<Utc>>],
    )
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
    let columns = super::buckets::SpecArrays::of(specs.iter().map(|s| &s.0));
    let levels: Vec<f64> = specs.iter().map(|s| s.1).collect();
    let sources: Vec<&str> = specs.iter().map(|s| s.2).collect();
    let ids = sqlx::query_scalar!(
        "INSERT INTO buckets (key, scope, dimension, rule, capacity, window_secs, level, updated_at, source, learned_at)
         SELECT k, s, d, r, c, w, l, $7::timestamptz, src, CASE WHEN src = 'learned' THEN $7::timestamptz END
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::float8[], $6::bigint[], $8::float8[], $9::text[])
              AS t(k, s, d, r, c, w, l, src)
         ON CONFLICT ON CONSTRAINT buckets_key DO NOTHING
         RETURNING id",
        &columns.keys as &[&str],
        &columns.scopes as &[&str],
        &columns.dimensions as &[Dimension],
        &columns.rules as &[Rule],
        &columns.capacities,
        &columns.windows,
        now,
        &levels,
        &sources as &[&str],
    )
    .fetch_all(&mut *conn)
    .await?;
    super::lock_buckets_by(conn, &[], &ids).await
}

/// Removes buckets (cold-start probes whose scope is now known). Reservations that still
/// name them settle against nothing.
pub async fn drop_buckets(ex: impl PgExecutor<'_>, keys: &[String]) -> Result<()> {
    if !keys.is_empty() {
        sqlx::query!("DELETE FROM buckets WHERE key = ANY($1)", keys)
            .execute(ex)
            .await?;
    }
    Ok(())
}

/// Puts the admitted jobs of a provider model that no dispatcher has claimed yet back in
/// the queue, giving back what they hold: a limit learned after their admission must
/// govern them too. Returns how many went back.
pub async fn requeue_admitted(conn: &mut PgConnection, provider: &str, model: &str) -> Result<u64> {
    let rows = sqlx::query!(
        r#"WITH picked AS (
             SELECT id, reserved_buckets, reserved_amounts FROM jobs
             WHERE state = 'admitted' AND provider = $1 AND provider_model = $2 AND NOT stream
             FOR UPDATE SKIP LOCKED)
         UPDATE jobs j SET state = 'queued', admitted_at = NULL, reserved_buckets = NULL, reserved_amounts = NULL
         FROM picked WHERE j.id = picked.id
         RETURNING picked.id AS "id!: JobId", picked.reserved_buckets, picked.reserved_amounts"#,
        provider,
        model,
    )
    .fetch_all(&mut *conn)
    .await?;
    let n = rows.len() as u64;
    let ended: Vec<(JobId, super::Reservation, super::Settlement)> = rows
        .into_iter()
        .filter_map(|r| {
            Some((
                r.id,
                super::reservation(r.reserved_buckets, r.reserved_amounts)?,
                super::Settlement::UNSENT,
            ))
        })
        .collect();
    super::settle(conn, &ended).await?;
    Ok(n)
}

/// What was sent to `provider`'s `model` since `since`: the requests its provider
/// answered, and the tokens admission reserved for them (estimated input and output), as
/// a request bucket and a token bucket count them.
pub async fn sent_since(
    ex: impl PgExecutor<'_>,
    provider: &str,
    model: &str,
    since: DateTime<Utc>,
) -> Result<(f64, f64)> {
    let sent = sqlx::query!(
        r#"SELECT count(*) AS "requests!",
                  COALESCE(sum(estimated_input_tokens::bigint + estimated_output_tokens), 0)::float8 AS "tokens!"
           FROM job_attempts
           WHERE provider = $1 AND provider_model = $2 AND started_at >= $3 AND status IS NOT NULL"#,
        provider,
        model,
        since,
    )
    .fetch_one(ex)
    .await?;
    Ok((sent.requests as f64, sent.tokens))
}
