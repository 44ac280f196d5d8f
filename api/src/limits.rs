//! `GET /v1/limits`: the buckets that apply to the caller — every provider-side bucket
//! (provider models, keys, routes), the caller's own tenant buckets, those of the tenants
//! above it (its parent's) and those of the API key it calls with, never another tenant's
//! or key's — with their capacity, what is left now, and where the capacity comes from:
//! `configured`, `learned` (a provider's reading or its 429s set it; `learned_at` says
//! when, `configured_capacity` what the config says), `probe` (a cold-start limit on
//! calls in flight while nothing is known of a model's limits) or `pace` (requests a
//! second to a model whose responses say nothing of its limits, until a 429 teaches one).
//!
//! Beside them, `pools`: for each provider model, the keys that share one quota (keys of
//! one provider account, as their responses named it) and the scope of its learned buckets.

use axum::Json;
use axum::extract::State;
use chrono::Utc;
use serde_json::{Value, json};
use tollgate::buckets::{self, Bucket};
use tollgate::config::Config;
use tollgate::keyring::Keyring;
use tollgate::learning::is_pace;
use tollgate::scheduler::plan::is_probe;
use tollgate::store;

use crate::AppState;
use crate::auth::AuthTenant;
use crate::error::ApiError;
use crate::openapi as doc;

/// Where a bucket's capacity comes from: `configured`, `learned`, `probe` or `pace`.
pub(crate) fn source(b: &Bucket) -> &'static str {
    if is_probe(&b.key) {
        "probe"
    } else if is_pace(&b.key) {
        "pace"
    } else if b.learned_at.is_some() {
        "learned"
    } else {
        "configured"
    }
}

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
        "source": source(&b),
        "configured_capacity": b.configured_capacity,
        "learned_at": b.learned_at,
    })
}

/// The buckets that apply to the caller: provider models, keys, routes, and its own —
/// its tenant's, its parents', its applications', its key's — never another tenant's.
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
    let directory = state.tenants.current();
    let mut own: Vec<String> = directory
        .lineage(&tenant.name)
        .iter()
        .map(|t| format!("{}:", buckets::tenant_scope(&t.name)))
        .collect();
    own.extend(buckets::tenant_prefixes(&tenant.name));
    own.extend(tenant.key.map(|id| format!("{}:", buckets::api_key_scope(id))));
    let all = store::all_buckets(&state.pool).await?;
    let pools = pools(&state.tenants.config(), &state.tenants.keyring());
    let data: Vec<Value> = all
        .into_iter()
        .filter(|b| own.iter().any(|o| b.key.starts_with(o)) || !buckets::is_tenant_held(&b.key))
        .map(view)
        .collect();
    Ok(Json(json!({"object": "list", "data": data, "pools": pools})))
}

/// The quota pools of every provider model: which keys share limits (one account, or all
/// of a model's keys while their accounts are not known apart) and the scope their learned
/// buckets have. A provider's models are those its config or its keys name.
fn pools(config: &Config, keyring: &Keyring) -> Vec<Value> {
    let mut out = Vec::new();
    for p in &config.providers {
        let mut models: Vec<&str> = p
            .models
            .iter()
            .chain(p.keys.iter().flat_map(|k| &k.models))
            .map(String::as_str)
            .collect();
        models.sort_unstable();
        models.dedup();
        for model in models {
            for pool in keyring.pools(p, model) {
                let scope = buckets::learned_scope(&p.name, model, pool.account.filter(|_| pool.apart));
                out.push(json!({
                    "provider": p.name,
                    "model": model,
                    "account": pool.account,
                    "keys": pool.keys,
                    "scope": scope,
                }));
            }
        }
    }
    out
}
