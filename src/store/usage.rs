//! What finished jobs used and cost, per period (hour or day of `finished_at`), tenant,
//! provider, served model, endpoint and lane: the rows `GET /v1/usage` groups further.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::Result;
use crate::vocab::Endpoint;

/// The finished jobs of one (period, tenant, provider, model, endpoint, lane).
#[derive(Debug, Clone, PartialEq)]
pub struct UsageGroup {
    /// The start of the hour or day their jobs finished in.
    pub period: DateTime<Utc>,
    pub tenant: String,
    /// The provider and model that served them (`None`: none did).
    pub provider: Option<String>,
    pub model: Option<String>,
    pub endpoint: Endpoint,
    /// `online` or `provider_batch`.
    pub lane: String,
    /// Jobs a provider answered.
    pub requests: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    /// What they cost at the configured prices, in micro-USD.
    pub spend_micro_usd: f64,
}

/// The jobs of `tenant` (every tenant's when `None`) that finished in `[from, to)`,
/// grouped per `hour` (else per day, UTC).
pub async fn usage(
    ex: impl PgExecutor<'_>,
    tenant: Option<&str>,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    hour: bool,
) -> Result<Vec<UsageGroup>> {
    let unit = if hour { "hour" } else { "day" };
    Ok(sqlx::query_as!(
        UsageGroup,
        r#"SELECT date_trunc($4, finished_at, 'UTC') AS "period!", tenant, provider, provider_model AS model,
                  endpoint AS "endpoint: Endpoint", COALESCE(dispatch_via, 'online') AS "lane!",
                  count(*) FILTER (WHERE usage IS NOT NULL) AS "requests!",
                  COALESCE(sum((usage->>'input_tokens')::bigint), 0)::bigint AS "input_tokens!",
                  COALESCE(sum((usage->>'output_tokens')::bigint), 0)::bigint AS "output_tokens!",
                  COALESCE(sum(spend_micro_usd), 0)::float8 AS "spend_micro_usd!"
           FROM jobs
           WHERE finished_at >= $2 AND finished_at < $3 AND ($1::text IS NULL OR tenant = $1)
             AND state IN ('succeeded', 'failed')
           GROUP BY 1, 2, 3, 4, 5, 6
           ORDER BY 1, 2, 3, 4, 5, 6"#,
        tenant,
        from,
        to,
        unit,
    )
    .fetch_all(ex)
    .await?)
}
