//! Bucket rows and reservations. Buckets are always locked in `id` order, so two
//! transactions that need overlapping buckets never deadlock; a transaction that holds
//! them is the only one that can spend their level, so no two processes ever spend the
//! same capacity.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use super::Result;
pub use crate::buckets::Settlement;
use crate::buckets::{Bucket, BucketSpec};
use crate::model::JobId;
use crate::vocab::{Dimension, Rule};

/// What a job holds: the buckets and the amount taken from each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reservation {
    pub bucket_ids: Vec<i64>,
    pub amounts: Vec<f64>,
}

/// `sqlx::query_as!` of [`Bucket`] rows: the statement is `$head`, the bucket's columns,
/// then `$tail`.
macro_rules! query_buckets {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            Bucket,
            $head
                + " id, key, dimension AS \"dimension: Dimension\", rule AS \"rule: Rule\", capacity, window_secs,
                    level, updated_at, resets_at, ramp_step, configured_capacity, learned_at "
                + $tail
            $(, $arg)*
        )
    };
}

/// Creates or updates the configured buckets. A new bucket starts full; a bucket whose
/// capacity shrank keeps no more than the new capacity; a learned capacity stays learned
/// (the gate caps it by the configured one when it next applies a reading).
pub async fn sync_buckets(ex: impl PgExecutor<'_>, specs: &[BucketSpec], now: DateTime<Utc>) -> Result<()> {
    if specs.is_empty() {
        return Ok(());
    }
    let columns = SpecArrays::of(specs.iter());
    let ramp_steps: Vec<f64> = specs.iter().map(|s| s.ramp_step.unwrap_or(f64::NAN)).collect();
    sqlx::query!(
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
        &columns.keys as &[&str],
        &columns.scopes as &[&str],
        &columns.dimensions as &[Dimension],
        &columns.rules as &[Rule],
        &columns.capacities,
        &columns.windows,
        now,
        &ramp_steps,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// Bucket specs, column by column, for an `INSERT … SELECT FROM unnest(…)`.
pub(crate) struct SpecArrays<'a> {
    pub(crate) keys: Vec<&'a str>,
    pub(crate) scopes: Vec<&'a str>,
    pub(crate) dimensions: Vec<Dimension>,
    pub(crate) rules: Vec<Rule>,
    pub(crate) capacities: Vec<f64>,
    pub(crate) windows: Vec<i64>,
}

impl<'a> SpecArrays<'a> {
    pub(crate) fn of(specs: impl Iterator<Item = &'a BucketSpec> + Clone) -> Self {
        Self {
            keys: specs.clone().map(|s| s.key.as_str()).collect(),
            scopes: specs.clone().map(|s| s.scope.as_str()).collect(),
            dimensions: specs.clone().map(|s| s.dimension).collect(),
            rules: specs.clone().map(|s| s.rule).collect(),
            capacities: specs.clone().map(|s| s.capacity).collect(),
            windows: specs.map(|s| s.window_secs).collect(),
        }
    }
}

/// Every bucket, for status pages and tests.
pub async fn all_buckets(ex: impl PgExecutor<'_>) -> Result<Vec<Bucket>> {
    Ok(query_buckets!("SELECT", "FROM buckets ORDER BY key")
        .fetch_all(ex)
        .await?)
}

/// Writes levels and capacities computed while the buckets were locked (ramps grow,
/// learned limits change capacities).
pub async fn save_buckets(conn: &mut PgConnection, buckets: &[Bucket]) -> Result<()> {
    if buckets.is_empty() {
        return Ok(());
    }
    let saved = BucketArrays::of(buckets);
    save_buckets_query!(sqlx::query!("", "", ["$1", "$2", "$3", "$4", "$5", "$6"]; &saved))
        .execute(conn)
        .await?;
    Ok(())
}

/// Buckets' new state, column by column, as [`save_buckets_query!`] binds it.
pub(crate) struct BucketArrays {
    pub(crate) ids: Vec<i64>,
    pub(crate) levels: Vec<f64>,
    pub(crate) updated_at: Vec<DateTime<Utc>>,
    pub(crate) resets_at: Vec<Option<DateTime<Utc>>>,
    pub(crate) capacities: Vec<f64>,
    pub(crate) learned_at: Vec<Option<DateTime<Utc>>>,
}

impl BucketArrays {
    pub(crate) fn of(buckets: &[Bucket]) -> Self {
        Self {
            ids: buckets.iter().map(|b| b.id).collect(),
            levels: buckets.iter().map(|b| b.level).collect(),
            updated_at: buckets.iter().map(|b| b.updated_at).collect(),
            resets_at: buckets.iter().map(|b| b.resets_at).collect(),
            capacities: buckets.iter().map(|b| b.capacity).collect(),
            learned_at: buckets.iter().map(|b| b.learned_at).collect(),
        }
    }
}

/// The `UPDATE` that writes buckets' new state, run by `$query!` (a `sqlx` query macro or
/// one that ends in one) inside its text between `$before` and `$after`, after its own
/// `$arg`s. The six arrays of `$buckets` ([`BucketArrays`]) bind last, at the placeholders
/// `[$p…]`: what the statement's own parameters leave.
macro_rules! save_buckets_query {
    ($($query:ident)::+!(
        $before:expr,
        $after:expr,
        [$p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal, $p6:literal]
        $(, $arg:expr)*;
        $buckets:expr
    )) => {{
        let buckets: &$crate::store::buckets::BucketArrays = $buckets;
        $($query)::+!(
            $before
                + "UPDATE buckets b SET level = t.level, updated_at = t.updated_at, resets_at = t.resets_at,
                                      capacity = t.capacity, learned_at = t.learned_at,
                                      source = CASE WHEN t.learned_at IS NULL THEN b.source ELSE 'learned' END
                   FROM unnest("
                + $p1
                + "::bigint[], "
                + $p2
                + "::float8[], "
                + $p3
                + "::timestamptz[], "
                + $p4
                + "::timestamptz[], "
                + $p5
                + "::float8[], "
                + $p6
                + "::timestamptz[]) AS t(id, level, updated_at, resets_at, capacity, learned_at)
                   WHERE b.id = t.id"
                + $after
            $(, $arg)*,
            &buckets.ids,
            &buckets.levels,
            &buckets.updated_at,
            &buckets.resets_at as &[Option<DateTime<Utc>>],
            &buckets.capacities,
            &buckets.learned_at as &[Option<DateTime<Utc>>],
        )
    }};
}
pub(crate) use save_buckets_query;

/// A statement that ends in recording refunds: `$before`, then an `INSERT` into
/// `pending_refunds` of what the rows of `$held` (a source of `(bucket, amount, used)`: a
/// bucket a job held, the amount it took, and its [`Settlement::used_by_dimension`]) give
/// back, summed per bucket, then `$after`. A gauge's holding goes back whole; any other
/// bucket gets back what was taken less what the job used of its dimension (what it took,
/// where its settlement says nothing of it), as [`crate::buckets::refund`] says. A bucket
/// gone meanwhile (a probe replaced) is skipped. Reads buckets without locking them.
macro_rules! settle_query {
    ($query:ident, $before:expr, $held:expr, $after:expr $(, $arg:expr)* $(,)?) => {
        sqlx::$query!(
            $before
                + "INSERT INTO pending_refunds (bucket, amount)
                   SELECT bucket, amount FROM (
                       SELECT h.bucket, sum(CASE WHEN b.rule = 'gauge' THEN h.amount
                                                 ELSE h.amount - COALESCE((h.used ->> b.dimension)::float8, h.amount)
                                            END) AS amount
                       FROM "
                + $held
                + " AS h(bucket, amount, used) JOIN buckets b ON b.id = h.bucket
                       GROUP BY h.bucket) s
                   WHERE amount <> 0"
                + $after
            $(, $arg)*
        )
    };
}
pub(crate) use settle_query;

/// Records what the ended reservations give back (or take, when a job used more than
/// estimated), summed per bucket, in one statement ([`settle_query!`]). Call inside the
/// transaction that cleared the reservations from their jobs, so each is settled exactly
/// once; the gate applies pending refunds to the buckets ([`take_pending_refunds`]).
pub async fn settle(ex: impl PgExecutor<'_>, ended: &[(JobId, Reservation, Settlement)]) -> Result<()> {
    let (mut buckets, mut amounts, mut used) = (Vec::new(), Vec::new(), Vec::new());
    for (_, reservation, settlement) in ended {
        let by_dimension = settlement.used_by_dimension();
        for (bucket, amount) in reservation.bucket_ids.iter().zip(&reservation.amounts) {
            buckets.push(*bucket);
            amounts.push(*amount);
            used.push(by_dimension.clone());
        }
    }
    if buckets.is_empty() {
        return Ok(());
    }
    settle_query!(
        query,
        "",
        "unnest($1::bigint[], $2::float8[], $3::jsonb[])",
        "",
        &buckets,
        &amounts,
        &used,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// Those of `buckets` that something will still give back to: a reservation held by a job
/// not settled yet, or a refund not applied yet. A window bucket (a daily budget) short
/// only by these is not short for good.
pub async fn held(conn: &mut PgConnection, buckets: &[i64]) -> Result<std::collections::BTreeSet<i64>> {
    if buckets.is_empty() {
        return Ok(Default::default());
    }
    let rows = sqlx::query_scalar!(
        r#"SELECT b AS "bucket!" FROM jobs j, unnest(j.reserved_buckets) AS b
           WHERE j.reserved_buckets && $1::bigint[] AND b = ANY($1)
           UNION
           SELECT bucket FROM pending_refunds WHERE bucket = ANY($1)"#,
        buckets,
    )
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Takes up to `limit` pending refunds (skipping rows other transactions hold) and
/// returns them summed per bucket id. Run in the gate's transaction, which applies them to
/// the buckets it has locked: the delete and the new levels commit together.
pub async fn take_pending_refunds(conn: &mut PgConnection, limit: i64) -> Result<BTreeMap<i64, f64>> {
    let rows = sqlx::query!(
        "DELETE FROM pending_refunds WHERE id IN (
             SELECT id FROM pending_refunds ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
         RETURNING bucket, amount",
        limit,
    )
    .fetch_all(conn)
    .await?;
    let mut sums = BTreeMap::new();
    for row in rows {
        *sums.entry(row.bucket).or_default() += row.amount;
    }
    Ok(sums)
}

/// Locks buckets by key or id (in id order) for the rest of the transaction.
pub async fn lock_buckets_by(conn: &mut PgConnection, keys: &[String], ids: &[i64]) -> Result<Vec<Bucket>> {
    Ok(query_buckets!(
        "SELECT",
        "FROM buckets WHERE key = ANY($1) OR id = ANY($2) ORDER BY id FOR UPDATE",
        keys,
        ids,
    )
    .fetch_all(conn)
    .await?)
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
#[derive(Debug, Clone, PartialEq)]
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
    let done = sqlx::query!(
        "WITH recent AS (
             SELECT provider_model AS model,
                    sum(input_tokens)::float8 / NULLIF(sum(estimated_input_tokens), 0)::float8 AS measured,
                    percentile_cont(0.9) WITHIN GROUP (ORDER BY output_tokens)::float8 AS output_p90,
                    count(*) AS n
             FROM job_attempts
             WHERE outcome = 'succeeded' AND input_tokens IS NOT NULL
               AND finished_at > $1::timestamptz - make_interval(secs => $2) AND finished_at <= $1
             GROUP BY provider_model
             HAVING count(*) >= $4 AND sum(estimated_input_tokens) > 0)
         INSERT INTO estimate_calibration AS c (model, input_ratio, output_p90, samples, updated_at)
         SELECT model, LEAST(2.0, GREATEST(0.5, 1.0 + LEAST($3, GREATEST(-$3::float8, measured - 1.0)))), output_p90, n, $1
         FROM recent
         ON CONFLICT ON CONSTRAINT estimate_calibration_pkey DO UPDATE SET
             input_ratio = LEAST(2.0, GREATEST(0.5,
                 c.input_ratio + LEAST($3, GREATEST(-$3::float8, (SELECT measured FROM recent r WHERE r.model = c.model) - c.input_ratio)))),
             output_p90 = excluded.output_p90,
             samples = c.samples + excluded.samples,
             updated_at = $1",
        now,
        window.as_secs_f64(),
        step,
        min_samples,
    )
    .execute(ex)
    .await?;
    Ok(done.rows_affected())
}

pub async fn calibrations(ex: impl PgExecutor<'_>) -> Result<Vec<Calibration>> {
    Ok(sqlx::query_as!(
        Calibration,
        "SELECT model, input_ratio, output_p90, samples FROM estimate_calibration",
    )
    .fetch_all(ex)
    .await?)
}

/// A budget that has just reached one of its thresholds in its current window.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetCrossing {
    /// `tenant:<name>:<window>_spend`, `app:<tenant>:<application>:<window>_spend` or
    /// `apikey:<id>:<window>_spend`.
    pub bucket: String,
    /// The tenant whose endpoints hear of it (an application's or an API key's: its tenant).
    pub tenant: String,
    pub threshold: f64,
    /// The budget and what is spent of it, in micro-USD (reservations of jobs in flight
    /// are not spent: they settle at what the jobs cost).
    pub capacity: f64,
    pub spent: f64,
    pub resets_at: DateTime<Utc>,
}

/// Forgets the budget alerts of windows that ended before `before` (their budgets have
/// reset since: nothing can be announced twice for them). Returns how many.
pub async fn prune_budget_alerts(ex: impl PgExecutor<'_>, before: DateTime<Utc>) -> Result<u64> {
    Ok(
        sqlx::query!("DELETE FROM budget_alerts WHERE resets_at < $1", before)
            .execute(ex)
            .await?
            .rows_affected(),
    )
}

/// The spend budgets whose spending reached one of `thresholds` (fractions of the budget)
/// in their current window and were not announced yet for it: each is recorded as
/// announced (`budget_alerts`) and returned, once. Run in the transaction that queues the
/// announcements.
pub async fn budget_crossings(
    conn: &mut PgConnection,
    thresholds: &[f64],
    now: DateTime<Utc>,
) -> Result<Vec<BudgetCrossing>> {
    Ok(sqlx::query_as!(
        BudgetCrossing,
        r#"WITH committed AS (
               -- What is spent or held: below the budget by the level, less the refunds the
           -- gate has not applied yet.
           SELECT b.id, b.key, b.capacity, b.resets_at,
                  b.capacity - b.level - coalesce((SELECT sum(p.amount) FROM pending_refunds p WHERE p.bucket = b.id), 0)
                      AS used
               FROM buckets b
               WHERE b.dimension = 'spend_micro_usd' AND b.rule = 'fixed' AND b.resets_at > $2 AND b.capacity > 0
                 AND (starts_with(b.key, 'tenant:') OR starts_with(b.key, 'app:') OR starts_with(b.key, 'apikey:'))
           ), spent AS (
               SELECT c.*, c.used - coalesce((
                          SELECT sum(j.reserved_amounts[array_position(j.reserved_buckets, c.id)])
                          FROM jobs j
                          WHERE j.reserved_buckets @> ARRAY[c.id] AND j.state IN ('admitted', 'running')
                      ), 0) AS spent,
                      CASE WHEN starts_with(c.key, 'tenant:') OR starts_with(c.key, 'app:') THEN split_part(c.key, ':', 2)
                           ELSE (SELECT k.tenant FROM api_keys k WHERE k.id::text = split_part(c.key, ':', 2))
                      END AS tenant
               FROM committed c
               WHERE c.used >= c.capacity * (SELECT min(t) FROM unnest($1::float8[]) AS t) - 1e-6
           ), crossed AS (
               SELECT s.key, s.tenant, t.threshold, s.capacity, s.spent, s.resets_at
               FROM spent s CROSS JOIN unnest($1::float8[]) AS t(threshold)
               WHERE s.tenant IS NOT NULL AND s.spent >= s.capacity * t.threshold - 1e-6
           ), announced AS (
               INSERT INTO budget_alerts (bucket_key, resets_at, threshold, created_at)
               SELECT key, resets_at, threshold, $2 FROM crossed
               ON CONFLICT DO NOTHING
               RETURNING bucket_key, threshold
           )
           SELECT c.key AS "bucket!", c.tenant AS "tenant!", c.threshold AS "threshold!", c.capacity AS "capacity!",
                  c.spent AS "spent!", c.resets_at AS "resets_at!"
           FROM crossed c JOIN announced a ON a.bucket_key = c.key AND a.threshold = c.threshold
           ORDER BY c.key, c.threshold"#,
        thresholds,
        now,
    )
    .fetch_all(&mut *conn)
    .await?)
}
