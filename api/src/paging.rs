//! Cursor paging as OpenAI's lists do it: `limit`, `after` = the previous page's
//! `last_id`, and `{object: "list", data, first_id, last_id, has_more}`. Handlers fetch
//! `limit + 1` rows; the extra one only says whether there is more.

use axum::extract::Query;
use axum::extract::rejection::QueryRejection;
use serde_json::{Value, json};
use tollgate::vocab::ApiErrorCode;

use crate::error::ApiError;

/// The query parameters, or a 400 naming what is wrong with them.
pub(crate) fn params<T>(query: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    query
        .map(|Query(p)| p)
        .map_err(|e| ApiError::bad_request(ApiErrorCode::InvalidRequest, e.body_text()))
}

/// The page size asked for (or `default`), checked against `1..=max`.
pub(crate) fn limit(asked: Option<i64>, default: i64, max: i64) -> Result<i64, ApiError> {
    let limit = asked.unwrap_or(default);
    if !(1..=max).contains(&limit) {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidRequest,
            format!("`limit` must be 1 to {max}"),
        )
        .with_param("limit"));
    }
    Ok(limit)
}

/// The list body for `rows` (fetched with `limit + 1`), each shown by `view`.
pub(crate) fn page<T, Id: serde::Serialize>(
    mut rows: Vec<T>,
    limit: i64,
    id: impl Fn(&T) -> Id,
    view: impl Fn(&T) -> Value,
) -> Value {
    let has_more = rows.len() as i64 > limit;
    rows.truncate(limit.max(0) as usize);
    json!({
        "object": "list",
        "data": rows.iter().map(view).collect::<Vec<_>>(),
        "first_id": rows.first().map(&id),
        "last_id": rows.last().map(&id),
        "has_more": has_more,
    })
}
