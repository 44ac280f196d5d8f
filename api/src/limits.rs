//! `GET /v1/limits`: the buckets that apply to the caller — every provider-side bucket
//! (provider models, keys, routes) and the caller's own tenant buckets, never another
//! tenant's — with their capacity and what is left now.

use axum::Json;
use axum::extract::State;
use chrono::Utc;
use serde_json::{Value, json};
use tollgate::buckets::{self, Bucket};
use tollgate::store;

use crate::AppState;
use crate::auth::AuthTenant;
use crate::error::ApiError;
use crate::openapi as doc;

fn view(mut b: Bucket) -> Value {
    b.refill(Utc::now());
    json!({
        "bucket": b.key,
        "dimension": b.dimension.as_str(),
        "rule": b.rule.as_str(),
        "capacity": b.capacity,
        "remaining": b.level.max(0.0).floor(),
        "window_secs": b.window_secs,
        "resets_at": b.resets_at,
    })
}

/// The buckets that apply to the caller: provider models, keys, routes, and its own
/// tenant buckets — never another tenant's.
#[utoipa::path(
    get,
    path = "/v1/limits",
    operation_id = "list_limits",
    tag = "limits",
    responses((status = 200, description = "The caller's buckets", body = doc::LimitListSchema)),
    security(("bearer" = []))
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
) -> Result<Json<Value>, ApiError> {
    let own = format!("{}:", buckets::tenant_scope(&tenant.name));
    let data: Vec<Value> = store::all_buckets(&state.pool)
        .await?
        .into_iter()
        .filter(|b| b.key.starts_with(&own) || !b.key.starts_with("tenant:"))
        .map(view)
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}
