//! What finished jobs used and cost, per period (hour or day of `finished_at`), tenant,
//! provider, served model, endpoint, lane, API key and its application: the rows
//! `GET /v1/usage` groups further.

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
    /// The API key they were submitted with, and its application.
    pub api_key: Option<uuid::Uuid>,
    pub application: Option<String>,
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
        r#"SELECT date_trunc($4, j.finished_at, 'UTC') AS "period!", j.tenant, j.provider,
                  j.provider_model AS model, j.endpoint AS "endpoint: Endpoint",
                  COALESCE(j.dispatch_via, 'online') AS "lane!", j.api_key, k.application,
                  count(*) FILTER (WHERE j.usage IS NOT NULL) AS "requests!",
                  COALESCE(sum((j.usage->>'input_tokens')::bigint), 0)::bigint AS "input_tokens!",
                  COALESCE(sum((j.usage->>'output_tokens')::bigint), 0)::bigint AS "output_tokens!",
                  COALESCE(sum(j.spend_micro_usd), 0)::float8 AS "spend_micro_usd!"
           FROM jobs j LEFT JOIN api_keys k ON k.id = j.api_key
           WHERE j.finished_at >= $2 AND j.finished_at < $3 AND ($1::text IS NULL OR j.tenant = $1)
             AND j.state IN ('succeeded', 'failed')
           GROUP BY 1, 2, 3, 4, 5, 6, 7, 8
           ORDER BY 1, 2, 3, 4, 5, 6, 7, 8"#,
        tenant,
        from,
        to,
        unit,
    )
    .fetch_all(ex)
    .await?)
}
