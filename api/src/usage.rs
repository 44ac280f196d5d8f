//! `GET /v1/usage`: what finished jobs used and cost, in USD and tokens, per hour or day
//! and by any of tenant, provider, model (the one that served), endpoint, lane, API key and
//! the key's application — as
//! JSON or, with `format=csv`, as CSV. A tenant sees its own jobs; the admin key every
//! tenant's. Costs are the jobs' charges at the configured prices (`providers[].prices`;
//! a provider-batch line at the batch price), so the rows sum to what the jobs show.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Duration, Utc};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tollgate::store::{self, UsageGroup};
use tollgate::vocab::ApiErrorCode;

use crate::AppState;
use crate::auth::Viewer;
use crate::error::ApiError;
use crate::openapi as doc;

/// What rows may be grouped by, besides the period.
const GROUPS: [&str; 7] = [
    "tenant",
    "provider",
    "model",
    "endpoint",
    "lane",
    "key",
    "application",
];
/// The longest period one request may cover.
const MAX_SPAN_DAYS: i64 = 366;

#[derive(Debug, Deserialize)]
pub(crate) struct UsageParams {
    group_by: Option<String>,
    from: Option<DateTime<Utc>>,
    to: Option<DateTime<Utc>>,
    format: Option<String>,
}

/// What the rows are grouped by: the period (`hour` or `day`, else none) and the fields.
struct Grouping {
    hour: Option<bool>,
    fields: Vec<&'static str>,
}

fn grouping(group_by: Option<&str>) -> Result<Grouping, ApiError> {
    let mut g = Grouping {
        hour: None,
        fields: Vec::new(),
    };
    for word in group_by
        .unwrap_or("day")
        .split(',')
        .map(str::trim)
        .filter(|w| !w.is_empty())
    {
        match word {
            "hour" | "day" if g.hour.is_none() => g.hour = Some(word == "hour"),
            _ => match GROUPS.iter().find(|f| **f == word) {
                Some(field) if !g.fields.contains(field) => g.fields.push(field),
                _ => {
                    return Err(ApiError::bad_request(
                        ApiErrorCode::InvalidRequest,
                        format!(
                            "`group_by` takes one of `hour` and `day` and any of {}, each once; not {word:?}",
                            GROUPS.map(|f| format!("`{f}`")).join(", ")
                        ),
                    )
                    .with_param("group_by"));
                }
            },
        }
    }
    Ok(g)
}

/// A group's value of `field`.
fn field(group: &UsageGroup, field: &str) -> Value {
    match field {
        "tenant" => json!(group.tenant),
        "provider" => json!(group.provider),
        "model" => json!(group.model),
        "endpoint" => json!(group.endpoint),
        "key" => json!(group.api_key),
        "application" => json!(group.application),
        _ => json!(group.lane),
    }
}

/// What the groups of one row add up to.
#[derive(Default)]
struct Totals {
    requests: i64,
    input_tokens: i64,
    output_tokens: i64,
    spend_micro_usd: f64,
}

/// The groups summed into rows of `grouping`, in order.
fn rows(groups: &[UsageGroup], grouping: &Grouping) -> Vec<Map<String, Value>> {
    let mut rows: BTreeMap<String, (Map<String, Value>, Totals)> = BTreeMap::new();
    for g in groups {
        let mut keys = Map::new();
        match grouping.hour {
            Some(true) => {
                keys.insert("hour".into(), json!(g.period.to_rfc3339()));
            }
            Some(false) => {
                keys.insert("day".into(), json!(g.period.format("%Y-%m-%d").to_string()));
            }
            None => {}
        }
        for f in &grouping.fields {
            keys.insert((*f).into(), field(g, f));
        }
        let (_, totals) = rows
            .entry(Value::Object(keys.clone()).to_string())
            .or_insert_with(|| (keys, Totals::default()));
        totals.requests += g.requests;
        totals.input_tokens += g.input_tokens;
        totals.output_tokens += g.output_tokens;
        totals.spend_micro_usd += g.spend_micro_usd;
    }
    rows.into_values()
        .map(|(mut row, t)| {
            row.insert("usd".into(), json!(t.spend_micro_usd / 1e6));
            row.insert("input_tokens".into(), json!(t.input_tokens));
            row.insert("output_tokens".into(), json!(t.output_tokens));
            row.insert("requests".into(), json!(t.requests));
            row
        })
        .collect()
}

/// The rows as CSV: the group fields, then `usd`, `input_tokens`, `output_tokens`,
/// `requests`.
fn csv(rows: &[Map<String, Value>], grouping: &Grouping) -> String {
    let mut columns: Vec<&str> = match grouping.hour {
        Some(true) => vec!["hour"],
        Some(false) => vec!["day"],
        None => Vec::new(),
    };
    columns.extend(&grouping.fields);
    columns.extend(["usd", "input_tokens", "output_tokens", "requests"]);
    let cell = |v: Option<&Value>| match v {
        Some(Value::String(s)) if s.contains([',', '"', '\n']) => format!("\"{}\"", s.replace('"', "\"\"")),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    };
    let mut out = columns.join(",") + "\n";
    for row in rows {
        let cells: Vec<String> = columns.iter().map(|c| cell(row.get(*c))).collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

/// What finished jobs used and cost, grouped.
#[utoipa::path(
    get,
    path = "/v1/usage",
    operation_id = "get_usage",
    tag = "limits",
    params(
        ("group_by" = Option<String>, Query, description = "Comma-separated (default `day`): at most one of `hour` and `day`, and any of `tenant`, `provider`, `model`, `endpoint`, `lane`, `key` (the API key's id), `application` (the key's)"),
        ("from" = Option<String>, Query, description = "RFC 3339; default 30 days before `to`"),
        ("to" = Option<String>, Query, description = "RFC 3339, exclusive; default now"),
        ("format" = Option<String>, Query, description = "`json` (default) or `csv`"),
    ),
    responses(
        (status = 200, description = "`{\"object\": \"list\", \"data\": [{…the group fields, \"usd\", \"input_tokens\", \"output_tokens\", \"requests\"}]}`, or CSV", body = Object),
        (status = 400, description = "`invalid_request`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn get(
    State(state): State<AppState>,
    viewer: Viewer,
    params: Result<Query<UsageParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let params = crate::paging::params(params)?;
    let grouping = grouping(params.group_by.as_deref())?;
    let csv_wanted = match params.format.as_deref() {
        None | Some("json") => false,
        Some("csv") => true,
        Some(other) => {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidRequest,
                format!("`format` is `json` or `csv`, not {other:?}"),
            )
            .with_param("format"));
        }
    };
    let to = params.to.unwrap_or_else(|| state.clock.now());
    let from = params.from.unwrap_or(to - Duration::days(30));
    if from >= to || to - from > Duration::days(MAX_SPAN_DAYS) {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            format!("`from` must be before `to`, at most {MAX_SPAN_DAYS} days before it"),
        )
        .with_param("from"));
    }
    let groups = store::usage(
        &state.pool,
        viewer.tenant(),
        from,
        to,
        grouping.hour == Some(true),
    )
    .await?;
    let rows = rows(&groups, &grouping);
    if csv_wanted {
        return Ok((
            [("content-type", "text/csv; charset=utf-8")],
            csv(&rows, &grouping),
        )
            .into_response());
    }
    Ok(Json(json!({"object": "list", "data": rows})).into_response())
}
