//! `GET /v1/models` and `GET /v1/models/{model}`: the names a tenant may put in `model`,
//! in OpenAI's list shape, so that an SDK's `models.list()` (and the tools that pick a
//! model from it) see what tollgate routes: every route alias, every `provider/model`, and
//! every model a provider lists under its bare name. Each says which endpoints it serves
//! and the targets it goes to, in order.

use axum::Json;
use axum::extract::{Path, State};
use serde::Serialize;
use tollgate::config::Config;
use tollgate::routing::{self, Target};
use tollgate::vocab::Endpoint;
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::AuthTenant;
use crate::error::ApiError;
use crate::openapi as doc;

/// One name, as OpenAI's model object, with what tollgate adds.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Model)]
pub(crate) struct ModelObject {
    /// What to put in `model`.
    id: String,
    /// Always `model`.
    object: &'static str,
    /// Unknown to tollgate: 0.
    created: i64,
    /// `tollgate` for a route alias, else the provider of its first target.
    owned_by: String,
    /// The endpoints a request naming it may call.
    endpoints: Vec<Endpoint>,
    /// Where its requests go, in order of preference (`provider/model`).
    targets: Vec<String>,
}

/// A list of models, as OpenAI's `GET /v1/models` answers.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = ModelList)]
pub(crate) struct ModelList {
    /// Always `list`.
    object: &'static str,
    data: Vec<ModelObject>,
}

/// The model object of `name`, when it names any target.
fn model(config: &Config, name: &str) -> Option<ModelObject> {
    let mut endpoints = Vec::new();
    let mut targets: Vec<Target> = Vec::new();
    for &endpoint in Endpoint::all() {
        if let Ok(serving) = routing::resolve(config, name, endpoint) {
            endpoints.push(endpoint);
            for t in serving {
                if !targets.contains(&t) {
                    targets.push(t);
                }
            }
        }
    }
    let owned_by = match config.routes.iter().any(|r| r.alias == name) {
        true => "tollgate".to_owned(),
        false => targets.first()?.provider.clone(),
    };
    Some(ModelObject {
        id: name.to_owned(),
        object: "model",
        created: 0,
        owned_by,
        endpoints,
        targets: targets.iter().map(Target::label).collect(),
    })
}

/// The names a tenant may put in `model` (OpenAI's list shape).
#[utoipa::path(
    get,
    path = "/v1/models",
    operation_id = "list_models",
    tag = "openai",
    responses((status = 200, description = "Route aliases, `provider/model` names and the models providers list", body = ModelList)),
    security(("bearer" = []))
)]
pub(crate) async fn list(State(state): State<AppState>, AuthTenant(_): AuthTenant) -> Json<ModelList> {
    let config = state.tenants.config();
    let data = routing::names(&config)
        .iter()
        .filter_map(|name| model(&config, name))
        .collect();
    Json(ModelList { object: "list", data })
}

/// One name: a route alias, a `provider/model` (its `/` sent as is or as `%2F`), or a model
/// a provider lists.
#[utoipa::path(
    get,
    path = "/v1/models/{model}",
    operation_id = "retrieve_model",
    tag = "openai",
    params(("model" = String, Path, description = "A name `GET /v1/models` lists")),
    responses(
        (status = 200, description = "The model", body = ModelObject),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn get(
    State(state): State<AppState>,
    AuthTenant(_): AuthTenant,
    Path(name): Path<String>,
) -> Result<Json<ModelObject>, ApiError> {
    model(&state.tenants.config(), &name)
        .map(Json)
        .ok_or_else(|| ApiError::not_found("model"))
}

/// A `provider/model` name whose `/` was sent unencoded.
#[utoipa::path(
    get,
    path = "/v1/models/{provider}/{model}",
    operation_id = "retrieve_provider_model",
    tag = "openai",
    params(
        ("provider" = String, Path, description = "A configured provider"),
        ("model" = String, Path, description = "One of its models"),
    ),
    responses(
        (status = 200, description = "The model", body = ModelObject),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn get_qualified(
    State(state): State<AppState>,
    AuthTenant(_): AuthTenant,
    Path((provider, name)): Path<(String, String)>,
) -> Result<Json<ModelObject>, ApiError> {
    model(&state.tenants.config(), &format!("{provider}/{name}"))
        .map(Json)
        .ok_or_else(|| ApiError::not_found("model"))
}
