//! Bucket rows and reservations. Buckets are always locked in `id` order, so two
//! transactions that need overlapping buckets never deadlock; a transaction that holds
//! them is the only one that can spend their level, so no two processes ever spend the
//! same capacity.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, Postgres};

use super::Result;
use crate::buckets::{Bucket, BucketSpec, Dimension, Rule, refund};
use crate::model::Usage;

/// What a job holds: the buckets and the amount taken from each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reservation {
    pub bucket_ids: Vec<i64>,
    pub amounts: Vec<f64>,
}

/// How a reservation ends: what the job really used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settlement {
    /// Usage the provider reported, if it reported any.
    pub usage: Option<Usage>,
    /// Actual spend in micro-USD (0 without usage or prices).
    pub actual_spend: f64,
    /// Whether the request reached the provider (its limits count it even if it failed).
    pub sent: bool,
}

impl Settlement {
    /// The job never left: everything goes back.
    pub const UNSENT: Settlement = Settlement {
        usage: None,
        actual_spend: 0.0,
        sent: false,
    };
    /// Sent, outcome unknown (holder died, call failed): keep what rate limits count, give
    /// back the concurrency slot.
    pub const SENT_UNKNOWN: Settlement = Settlement {
        usage: None,
        actual_spend: 0.0,
        sent: true,
    };
}

#[derive(sqlx::FromRow)]
struct BucketRow {
    id: i64,
    key: String,
    dimension: String,
    rule: String,
    capacity: f64,
    window_secs: i64,
    level: f64,
    updated_at: DateTime<Utc>,
    resets_at: Option<DateTime<Utc>>,
}

impl BucketRow {
    fn into_bucket(self) -> Option<Bucket> {
        Some(Bucket {
            id: self.id,
            key: self.key,
            dimension: Dimension::parse(&self.dimension)?,
            rule: Rule::parse(&self.rule)?,
            capacity: self.capacity,
            window_secs: self.window_secs,
            level: self.level,
            updated_at: self.updated_at,
            resets_at: self.resets_at,
        })
    }
}

/// Creates or updates the configured buckets. A new bucket starts full; a bucket whose
/// capacity shrank keeps no more than the new capacity.
pub async fn sync_buckets(ex: impl PgExecutor<'_>, specs: &[BucketSpec], now: DateTime<Utc>) -> Result<()> {
    if specs.is_empty() {
        return Ok(());
    }
    let col = |f: fn(&BucketSpec) -> String| specs.iter().map(f).collect::<Vec<_>>();
    sqlx::query(
        "INSERT INTO buckets (key, scope, dimension, rule, capacity, window_secs, level, updated_at)
         SELECT k, s, d, r, c, w, c, $7
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::float8[], $6::bigint[]) AS t(k, s, d, r, c, w)
         ON CONFLICT ON CONSTRAINT buckets_key DO UPDATE SET
             scope = excluded.scope, dimension = excluded.dimension, rule = excluded.rule,
             window_secs = excluded.window_secs,
             level = buckets.level + (excluded.capacity - buckets.capacity),
             capacity = excluded.capacity
         WHERE buckets.source = 'configured' AND buckets.capacity <> excluded.capacity",
    )
    .bind(col(|s| s.key.clone()))
    .bind(col(|s| s.scope.clone()))
    .bind(col(|s| s.dimension.as_str().to_owned()))
    .bind(col(|s| s.rule.as_str().to_owned()))
    .bind(specs.iter().map(|s| s.capacity).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.window_secs).collect::<Vec<_>>())
    .bind(now)
    .execute(ex)
    .await?;
    Ok(())
}

/// Locks the named buckets (in id order) for the rest of the transaction.
pub async fn lock_buckets(conn: &mut PgConnection, keys: &[String]) -> Result<Vec<Bucket>> {
    let rows = sqlx::query_as::<Postgres, BucketRow>(
        "SELECT id, key, dimension, rule, capacity, window_secs, level, updated_at, resets_at
         FROM buckets WHERE key = ANY($1) ORDER BY id FOR UPDATE",
    )
    .bind(keys)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().filter_map(BucketRow::into_bucket).collect())
}

/// Every bucket, for status pages and tests.
pub async fn all_buckets(ex: impl PgExecutor<'_>) -> Result<Vec<Bucket>> {
    let rows = sqlx::query_as::<Postgres, BucketRow>(
        "SELECT id, key, dimension, rule, capacity, window_secs, level, updated_at, resets_at
         FROM buckets ORDER BY key",
    )
    .fetch_all(ex)
    .await?;
    Ok(rows.into_iter().filter_map(BucketRow::into_bucket).collect())
}

/// Writes levels computed while the buckets were locked.
pub async fn save_buckets(conn: &mut PgConnection, buckets: &[Bucket]) -> Result<()> {
    if buckets.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "UPDATE buckets b SET level = t.level, updated_at = t.updated_at, resets_at = t.resets_at
         FROM unnest($1::bigint[], $2::float8[], $3::timestamptz[], $4::timestamptz[]) AS t(id, level, updated_at, resets_at)
         WHERE b.id = t.id",
    )
    .bind(buckets.iter().map(|b| b.id).collect::<Vec<_>>())
    .bind(buckets.iter().map(|b| b.level).collect::<Vec<_>>())
    .bind(buckets.iter().map(|b| b.updated_at).collect::<Vec<_>>())
    .bind(buckets.iter().map(|b| b.resets_at).collect::<Vec<_>>())
    .execute(conn)
    .await?;
    Ok(())
}

/// Gives back what ended reservations did not use (or takes the excess when they used
/// more than estimated), in one ordered update. Call inside the transaction that cleared
/// the reservations from their jobs, so each is settled exactly once.
pub async fn settle(conn: &mut PgConnection, ended: &[(Reservation, Settlement)]) -> Result<()> {
    let ids: Vec<i64> = {
        let mut ids: Vec<i64> = ended
            .iter()
            .flat_map(|(r, _)| r.bucket_ids.iter().copied())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    };
    if ids.is_empty() {
        return Ok(());
    }
    let dims: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, dimension FROM buckets WHERE id = ANY($1) ORDER BY id FOR UPDATE")
            .bind(&ids)
            .fetch_all(&mut *conn)
            .await?;
    let dims: BTreeMap<i64, Dimension> = dims
        .into_iter()
        .filter_map(|(id, d)| Some((id, Dimension::parse(&d)?)))
        .collect();
    let mut refunds: BTreeMap<i64, f64> = BTreeMap::new();
    for (reservation, s) in ended {
        for (id, amount) in reservation.bucket_ids.iter().zip(&reservation.amounts) {
            if let Some(dim) = dims.get(id) {
                *refunds.entry(*id).or_default() +=
                    refund(*dim, *amount, s.usage.as_ref(), s.actual_spend, s.sent);
            }
        }
    }
    refunds.retain(|_, r| *r != 0.0);
    if refunds.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "UPDATE buckets b SET level = LEAST(b.capacity, b.level + t.refund)
         FROM unnest($1::bigint[], $2::float8[]) AS t(id, refund) WHERE b.id = t.id",
    )
    .bind(refunds.keys().copied().collect::<Vec<_>>())
    .bind(refunds.values().copied().collect::<Vec<_>>())
    .execute(conn)
    .await?;
    Ok(())
}

/// Reads a reservation out of the arrays a `RETURNING` produced.
pub(crate) fn reservation(ids: Option<Vec<i64>>, amounts: Option<Vec<f64>>) -> Option<Reservation> {
    match (ids, amounts) {
        (Some(bucket_ids), Some(amounts)) if !bucket_ids.is_empty() => {
            Some(Reservation { bucket_ids, amounts })
        }
        _ => None,
    }
}
