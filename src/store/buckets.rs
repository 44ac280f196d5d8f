//! Bucket rows and reservations. Buckets are always locked in `id` order, so two
//! transactions that need overlapping buckets never deadlock; a transaction that holds
//! them is the only one that can spend their level, so no two processes ever spend the
//! same capacity.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, Postgres};

use super::Result;
pub use crate::buckets::Settlement;
use crate::buckets::{Bucket, BucketSpec, refund};
use crate::model::JobId;
use crate::vocab::{Dimension, Rule};

/// What a job holds: the buckets and the amount taken from each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reservation {
    pub bucket_ids: Vec<i64>,
    pub amounts: Vec<f64>,
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
    ramp_step: Option<f64>,
    configured_capacity: Option<f64>,
    learned_at: Option<DateTime<Utc>>,
}

/// The columns a [`BucketRow`] reads.
const BUCKET_COLUMNS: &str = "id, key, dimension, rule, capacity, window_secs, level, updated_at, resets_at, \
                              ramp_step, configured_capacity, learned_at";

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
            ramp_step: self.ramp_step,
            configured_capacity: self.configured_capacity,
            learned_at: self.learned_at,
        })
    }
}

/// Creates or updates the configured buckets. A new bucket starts full; a bucket whose
/// capacity shrank keeps no more than the new capacity; a learned capacity stays learned
/// (the gate caps it by the configured one when it next applies a reading).
pub async fn sync_buckets(ex: impl PgExecutor<'_>, specs: &[BucketSpec], now: DateTime<Utc>) -> Result<()> {
    if specs.is_empty() {
        return Ok(());
    }
    let col = |f: fn(&BucketSpec) -> String| specs.iter().map(f).collect::<Vec<_>>();
    sqlx::query(
        "INSERT INTO buckets (key, scope, dimension, rule, capacity, window_secs, level, updated_at, ramp_step,
                              configured_capacity)
         SELECT k, s, d, r, c, w, c, $7, NULLIF(rs, 'NaN'), c
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::float8[], $6::bigint[], $8::float8[])
              AS t(k, s, d, r, c, w, rs)
         ON CONFLICT ON CONSTRAINT buckets_key DO UPDATE SET
             scope = excluded.scope, dimension = excluded.dimension, rule = excluded.rule,
             window_secs = excluded.window_secs, ramp_step = excluded.ramp_step,
             configured_capacity = excluded.configured_capacity,
             -- A ramp's capacity is its current allowance, and learned limits stay learned.
             level = CASE WHEN buckets.rule = 'ramp' OR buckets.source <> 'configured' THEN buckets.level
                          ELSE buckets.level + (excluded.capacity - buckets.capacity) END,
             capacity = CASE WHEN buckets.rule = 'ramp' OR buckets.source <> 'configured' THEN buckets.capacity
                             ELSE excluded.capacity END",
    )
    .bind(col(|s| s.key.clone()))
    .bind(col(|s| s.scope.clone()))
    .bind(col(|s| s.dimension.as_str().to_owned()))
    .bind(col(|s| s.rule.as_str().to_owned()))
    .bind(specs.iter().map(|s| s.capacity).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.window_secs).collect::<Vec<_>>())
    .bind(now)
    .bind(specs.iter().map(|s| s.ramp_step.unwrap_or(f64::NAN)).collect::<Vec<_>>())
    .execute(ex)
    .await?;
    Ok(())
}

/// Every bucket, for status pages and tests.
pub async fn all_buckets(ex: impl PgExecutor<'_>) -> Result<Vec<Bucket>> {
    let rows =
        sqlx::query_as::<Postgres, BucketRow>(&format!("SELECT {BUCKET_COLUMNS} FROM buckets ORDER BY key"))
            .fetch_all(ex)
            .await?;
    Ok(rows.into_iter().filter_map(BucketRow::into_bucket).collect())
}

/// Writes levels and capacities computed while the buckets were locked (ramps grow,
/// learned limits change capacities).
pub async fn save_buckets(conn: &mut PgConnection, buckets: &[Bucket]) -> Result<()> {
    if buckets.is_empty() {
        return Ok(());
    }
    sqlx::query_as::<Postgres, (i64,)>(&format!("{} RETURNING b.id", save_statement(1)))
        .bind_buckets(buckets)
        .fetch_all(conn)
        .await?;
    Ok(())
}

/// The `UPDATE` that writes buckets' new state, its six arrays bound from `$first` on by
/// [`BindBuckets::bind_buckets`].
pub(crate) fn save_statement(first: usize) -> String {
    let p: Vec<String> = (first..first + 6).map(|i| format!("${i}")).collect();
    format!(
        "UPDATE buckets b SET level = t.level, updated_at = t.updated_at, resets_at = t.resets_at,
                              capacity = t.capacity, learned_at = t.learned_at,
                              source = CASE WHEN t.learned_at IS NULL THEN b.source ELSE 'learned' END
         FROM unnest({}::bigint[], {}::float8[], {}::timestamptz[], {}::timestamptz[], {}::float8[],
                     {}::timestamptz[])
              AS t(id, level, updated_at, resets_at, capacity, learned_at)
         WHERE b.id = t.id",
        p[0], p[1], p[2], p[3], p[4], p[5]
    )
}

/// Binds the arrays of [`save_statement`].
pub(crate) trait BindBuckets {
    fn bind_buckets(self, buckets: &[Bucket]) -> Self;
}

impl<'q, O> BindBuckets for sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments> {
    fn bind_buckets(self, buckets: &[Bucket]) -> Self {
        self.bind(buckets.iter().map(|b| b.id).collect::<Vec<_>>())
            .bind(buckets.iter().map(|b| b.level).collect::<Vec<_>>())
            .bind(buckets.iter().map(|b| b.updated_at).collect::<Vec<_>>())
            .bind(buckets.iter().map(|b| b.resets_at).collect::<Vec<_>>())
            .bind(buckets.iter().map(|b| b.capacity).collect::<Vec<_>>())
            .bind(buckets.iter().map(|b| b.learned_at).collect::<Vec<_>>())
    }
}

/// Records what the ended reservations give back (or take, when a job used more than
/// estimated), summed per bucket. Call inside the transaction that cleared the
/// reservations from their jobs, so each is settled exactly once; the gate applies pending
/// refunds to the buckets ([`take_pending_refunds`]). Reads bucket dimensions without
/// locking them.
pub async fn settle(conn: &mut PgConnection, ended: &[(JobId, Reservation, Settlement)]) -> Result<()> {
    let ids: Vec<i64> = {
        let mut ids: Vec<i64> = ended
            .iter()
            .flat_map(|(_, r, _)| r.bucket_ids.iter().copied())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    };
    if ids.is_empty() {
        return Ok(());
    }
    let dims: Vec<(i64, String, bool)> =
        sqlx::query_as("SELECT id, dimension, rule = 'gauge' FROM buckets WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(&mut *conn)
            .await?;
    // A gauge is acquire/release: whatever it held goes back whole when the holder ends
    // (a concurrency slot; a provider's enqueued-token pool).
    let gauges: std::collections::BTreeSet<i64> = dims.iter().filter(|d| d.2).map(|d| d.0).collect();
    let dims: BTreeMap<i64, Dimension> = dims
        .into_iter()
        .filter_map(|(id, d, _)| Some((id, Dimension::parse(&d)?)))
        .collect();
    let mut sums: BTreeMap<i64, f64> = BTreeMap::new();
    for (_, reservation, s) in ended {
        for (id, amount) in reservation.bucket_ids.iter().zip(&reservation.amounts) {
            let Some(dim) = dims.get(id) else { continue };
            *sums.entry(*id).or_default() += if gauges.contains(id) {
                *amount
            } else {
                refund(
                    *dim,
                    *amount,
                    s.usage.as_ref(),
                    s.actual_spend,
                    s.sent,
                    s.charged_output,
                )
            };
        }
    }
    sums.retain(|_, r| *r != 0.0);
    if sums.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO pending_refunds (bucket, amount) SELECT * FROM unnest($1::bigint[], $2::float8[])",
    )
    .bind(sums.keys().copied().collect::<Vec<_>>())
    .bind(sums.values().copied().collect::<Vec<_>>())
    .execute(conn)
    .await?;
    Ok(())
}

/// Takes up to `limit` pending refunds (skipping rows other transactions hold) and
/// returns them summed per bucket id. Run in the gate's transaction, which applies them to
/// the buckets it has locked: the delete and the new levels commit together.
pub async fn take_pending_refunds(conn: &mut PgConnection, limit: i64) -> Result<BTreeMap<i64, f64>> {
    let rows: Vec<(i64, f64)> = sqlx::query_as(
        "DELETE FROM pending_refunds WHERE id IN (
             SELECT id FROM pending_refunds ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
         RETURNING bucket, amount",
    )
    .bind(limit)
    .fetch_all(conn)
    .await?;
    let mut sums = BTreeMap::new();
    for (bucket, amount) in rows {
        *sums.entry(bucket).or_default() += amount;
    }
    Ok(sums)
}

/// Locks buckets by key or id (in id order) for the rest of the transaction.
pub async fn lock_buckets_by(conn: &mut PgConnection, keys: &[String], ids: &[i64]) -> Result<Vec<Bucket>> {
    let rows = sqlx::query_as::<Postgres, BucketRow>(&format!(
        "SELECT {BUCKET_COLUMNS} FROM buckets WHERE key = ANY($1) OR id = ANY($2) ORDER BY id FOR UPDATE"
    ))
    .bind(keys)
    .bind(ids)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().filter_map(BucketRow::into_bucket).collect())
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

/// What was learned about a model's real token use.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Calibration {
    pub model: String,
    pub input_ratio: f64,
    pub output_p90: Option<f64>,
    pub samples: i64,
}

/// Learns from the successful attempts of the last `window`: per model, moves the input
/// ratio (actual / estimated) toward what was measured by at most `step`, within [0.5, 2],
/// and takes the output p90. Models with fewer than `min_samples` attempts are left alone,
/// so a few odd requests cannot skew a model.
pub async fn calibrate(
    ex: impl PgExecutor<'_>,
    now: DateTime<Utc>,
    window: std::time::Duration,
    step: f64,
    min_samples: i64,
) -> Result<u64> {
    let done = sqlx::query(
        "WITH recent AS (
             SELECT provider_model AS model,
                    sum(input_tokens)::float8 / NULLIF(sum(estimated_input_tokens), 0)::float8 AS measured,
                    percentile_cont(0.9) WITHIN GROUP (ORDER BY output_tokens)::float8 AS output_p90,
                    count(*) AS n
             FROM job_attempts
             WHERE outcome = 'succeeded' AND input_tokens IS NOT NULL
               AND finished_at > $1 - make_interval(secs => $2) AND finished_at <= $1
             GROUP BY provider_model
             HAVING count(*) >= $4 AND sum(estimated_input_tokens) > 0)
         INSERT INTO estimate_calibration AS c (model, input_ratio, output_p90, samples, updated_at)
         SELECT model, LEAST(2.0, GREATEST(0.5, 1.0 + LEAST($3, GREATEST(-$3, measured - 1.0)))), output_p90, n, $1
         FROM recent
         ON CONFLICT ON CONSTRAINT estimate_calibration_pkey DO UPDATE SET
             input_ratio = LEAST(2.0, GREATEST(0.5,
                 c.input_ratio + LEAST($3, GREATEST(-$3, (SELECT measured FROM recent r WHERE r.model = c.model) - c.input_ratio)))),
             output_p90 = excluded.output_p90,
             samples = c.samples + excluded.samples,
             updated_at = $1",
    )
    .bind(now)
    .bind(window.as_secs_f64())
    .bind(step)
    .bind(min_samples)
    .execute(ex)
    .await?;
    Ok(done.rows_affected())
}

pub async fn calibrations(ex: impl PgExecutor<'_>) -> Result<Vec<Calibration>> {
    Ok(sqlx::query_as::<Postgres, Calibration>(
        "SELECT model, input_ratio, output_p90, samples FROM estimate_calibration",
    )
    .fetch_all(ex)
    .await?)
}
