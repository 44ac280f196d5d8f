//! The admin API (`/v1/admin/…`, the admin key only): tenants and their API keys, changed
//! at runtime and in force on every process within a second (`tollgate::control`).
//!
//! - `tenants`: create, list, get, update (`PATCH`: the fields given replace theirs),
//!   delete — weight, limits (`rpm`, `tpm`, `rpd`, `concurrency`), budgets (USD per day,
//!   week or month), a `parent` whose limits and budgets also cover the tenant, its
//!   `applications`' own limits and budgets (shared by the keys labelled with each), and
//!   its own quotas and API rate (`settings`).
//! - `provider-keys`: provider keys added at runtime (sealed with the server's secret
//!   key, never returned), rotated, disabled and enabled — the config file's too (only
//!   disabled or enabled: the file holds them).
//! - `routes`: route aliases added at runtime and their targets (the config file's routes
//!   are listed, and change in the file).
//! - `tenants/{tenant}/keys`: many keys per tenant. Creating one returns its secret this
//!   once; only its SHA-256 is stored. A key may have limits and budgets of its own, on
//!   top of its tenant's. Listing shows each key's prefix, expiry, revocation and
//!   `last_used_at`; deleting revokes.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use tollgate::config::{Config, ModelLimits};
use tollgate::control::{self, ControlError, KeyRequest};
use tollgate::store::{self, KeyRecord, TenantRecord};

use tollgate::tenants::{Allowance, Budget, KeyScopes, Source, TenantLimits, TenantSettings, TenantSpec};
use tollgate::vocab::ApiErrorCode;
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Admin;
use crate::error::ApiError;
use crate::openapi as doc;

/// `POST /v1/admin/tenants`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewTenant {
    /// 1 to 64 of A-Z a-z 0-9 - _ .
    name: String,
    /// Share of contended capacity relative to other tenants (default 1).
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    limits: TenantLimits,
    #[serde(default)]
    budgets: Vec<Budget>,
    /// A tenant whose limits and budgets also cover this one.
    #[serde(default)]
    parent: Option<String>,
    /// `{"<application>": {"limits", "budgets"}}`: each application's own limits and
    /// budgets, shared by the tenant's keys labelled with it.
    #[serde(default)]
    applications: BTreeMap<String, Allowance>,
    #[serde(default)]
    settings: TenantSettings,
}

/// `PATCH /v1/admin/tenants/{tenant}`: each field given replaces the tenant's (`parent:
/// null` removes the parent); fields left out stay.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct TenantChange {
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    limits: Option<TenantLimits>,
    #[serde(default)]
    budgets: Option<Vec<Budget>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    parent: Option<Option<String>>,
    #[serde(default)]
    applications: Option<BTreeMap<String, Allowance>>,
    #[serde(default)]
    settings: Option<TenantSettings>,
}

/// A field that is present (its value may be `null`): `Some(value)`.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// A tenant as the admin API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TenantObject {
    /// `tenant`.
    object: &'static str,
    name: String,
    weight: u32,
    parent: Option<String>,
    limits: TenantLimits,
    budgets: Vec<Budget>,
    applications: BTreeMap<String, Allowance>,
    settings: TenantSettings,
    /// Who wrote it last: `file` (the config file) or `api`.
    source: Source,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl From<TenantRecord> for TenantObject {
    fn from(r: TenantRecord) -> Self {
        TenantObject {
            object: "tenant",
            name: r.spec.name,
            weight: r.spec.weight,
            parent: r.spec.parent,
            limits: r.spec.limits,
            budgets: r.spec.budgets,
            applications: r.spec.applications,
            settings: r.spec.settings,
            source: r.source,
            created_at: r.created_at,
            updated_at: r.updated_at,
        }
    }
}

/// `POST /v1/admin/tenants/{tenant}/keys`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewKey {
    /// What the key is for (default `default`); 1 to 64 of A-Z a-z 0-9 - _ .
    #[serde(default)]
    name: Option<String>,
    /// The tenant's application that uses it.
    #[serde(default)]
    application: Option<String>,
    /// When it stops working (RFC 3339).
    #[serde(default)]
    expires_at: Option<DateTime<Utc>>,
    /// Its own limits, on top of its tenant's.
    #[serde(default)]
    limits: TenantLimits,
    /// Its own budgets, on top of its tenant's.
    #[serde(default)]
    budgets: Vec<Budget>,
    /// What it may submit: `models`, `endpoints`, `classes`, `max_priority` (each left
    /// out: anything).
    #[serde(default)]
    scopes: KeyScopes,
}

/// An API key as the admin API shows it: never its secret, but when it is created.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct KeyObject {
    /// `api_key`.
    object: &'static str,
    id: uuid::Uuid,
    tenant: String,
    name: String,
    application: Option<String>,
    /// The secret's first characters.
    prefix: String,
    /// The secret: only in the answer that creates the key.
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<String>,
    source: Source,
    limits: TenantLimits,
    budgets: Vec<Budget>,
    scopes: KeyScopes,
    expires_at: Option<DateTime<Utc>>,
    revoked_at: Option<DateTime<Utc>>,
    last_used_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
}

impl KeyObject {
    fn of(r: KeyRecord, secret: Option<String>) -> Self {
        KeyObject {
            object: "api_key",
            id: r.id,
            tenant: r.tenant,
            name: r.name,
            application: r.application,
            prefix: r.prefix,
            key: secret,
            source: r.source,
            limits: r.limits,
            budgets: r.budgets,
            scopes: r.scopes,
            expires_at: r.expires_at,
            revoked_at: r.revoked_at,
            last_used_at: r.last_used_at,
            created_at: r.created_at,
        }
    }
}

/// `{"object": "list", "data": [...]}`.
#[derive(Debug, Serialize)]
struct List<T> {
    object: &'static str,
    data: Vec<T>,
}

fn list<T: Serialize>(data: Vec<T>) -> Json<List<T>> {
    Json(List { object: "list", data })
}

/// A body of type `T`, or a 400 naming what is wrong with it.
pub(crate) fn body<T: for<'de> Deserialize<'de>>(
    bytes: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let value = crate::jobs::json_body(bytes)?;
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(ApiErrorCode::InvalidRequest, e.to_string()))
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        let message = e.to_string();
        match e {
            ControlError::Invalid(invalid) => {
                ApiError::bad_request(ApiErrorCode::InvalidRequest, message).with_param(invalid.field)
            }
            ControlError::NoSuchParent(_) | ControlError::ParentLoop { .. } => {
                ApiError::bad_request(ApiErrorCode::InvalidRequest, message).with_param("parent")
            }
            ControlError::TenantExists(_) => {
                ApiError::new(StatusCode::CONFLICT, ApiErrorCode::AlreadyExists, message).with_param("name")
            }
            ControlError::HasChildren(_) | ControlError::HasWork(_) => {
                ApiError::new(StatusCode::CONFLICT, ApiErrorCode::TenantInUse, message)
            }
            ControlError::NoSuchTenant(_) => ApiError::not_found("tenant"),
            ControlError::NoSuchKey(_) => ApiError::not_found("key"),
            ControlError::KeyTaken(_) | ControlError::ProviderKeyExists(..) => {
                ApiError::new(StatusCode::CONFLICT, ApiErrorCode::AlreadyExists, message).with_param("name")
            }
            ControlError::NoSuchProviderKey(..) => ApiError::not_found("provider key"),
            ControlError::RouteExists(_) => {
                ApiError::new(StatusCode::CONFLICT, ApiErrorCode::AlreadyExists, message).with_param("alias")
            }
            ControlError::NoSuchRoute(_) => ApiError::not_found("route"),
            ControlError::Sealing(cause) => ApiError::internal(cause),
            ControlError::Store(e) => e.into(),
        }
    }
}

#[utoipa::path(
    post,
    path = "/v1/admin/tenants",
    operation_id = "create_tenant",
    tag = "admin",
    request_body = NewTenant,
    responses(
        (status = 201, description = "The tenant", body = TenantObject),
        (status = 400, description = "`invalid_request`: `param` names the field", body = doc::ErrorBody),
        (status = 403, description = "`admin_only`", body = doc::ErrorBody),
        (status = 409, description = "`already_exists`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn create_tenant(
    State(state): State<AppState>,
    _: Admin,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let new: NewTenant = body(bytes)?;
    let spec = TenantSpec {
        name: new.name,
        weight: new.weight.unwrap_or(1),
        parent: new.parent,
        limits: new.limits,
        budgets: new.budgets,
        applications: new.applications,
        settings: new.settings,
    };
    let record = control::create_tenant(&state.pool, &spec, state.clock.now()).await?;
    Ok((StatusCode::CREATED, Json(TenantObject::from(record))).into_response())
}

#[utoipa::path(
    get,
    path = "/v1/admin/tenants",
    operation_id = "list_tenants",
    tag = "admin",
    responses(
        (status = 200, description = "`{object: \"list\", data: [tenant]}`", body = Object),
        (status = 403, description = "`admin_only`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn list_tenants(State(state): State<AppState>, _: Admin) -> Result<Response, ApiError> {
    let tenants = store::list_tenants(&state.pool).await?;
    Ok(list(tenants.into_iter().map(TenantObject::from).collect()).into_response())
}

async fn tenant_record(state: &AppState, name: &str) -> Result<TenantRecord, ApiError> {
    store::get_tenant(&state.pool, name)
        .await?
        .ok_or_else(|| ApiError::not_found("tenant"))
}

#[utoipa::path(
    get,
    path = "/v1/admin/tenants/{tenant}",
    operation_id = "get_tenant",
    tag = "admin",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses(
        (status = 200, description = "The tenant", body = TenantObject),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn get_tenant(
    State(state): State<AppState>,
    _: Admin,
    Path(name): Path<String>,
) -> Result<Json<TenantObject>, ApiError> {
    Ok(Json(tenant_record(&state, &name).await?.into()))
}

#[utoipa::path(
    patch,
    path = "/v1/admin/tenants/{tenant}",
    operation_id = "update_tenant",
    tag = "admin",
    params(("tenant" = String, Path, description = "The tenant's name")),
    request_body = TenantChange,
    responses(
        (status = 200, description = "The tenant as changed", body = TenantObject),
        (status = 400, description = "`invalid_request`: `param` names the field", body = doc::ErrorBody),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn update_tenant(
    State(state): State<AppState>,
    _: Admin,
    Path(name): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Json<TenantObject>, ApiError> {
    let change: TenantChange = body(bytes)?;
    let mut spec = tenant_record(&state, &name).await?.spec;
    if let Some(weight) = change.weight {
        spec.weight = weight;
    }
    if let Some(limits) = change.limits {
        spec.limits = limits;
    }
    if let Some(budgets) = change.budgets {
        spec.budgets = budgets;
    }
    if let Some(parent) = change.parent {
        spec.parent = parent;
    }
    if let Some(applications) = change.applications {
        spec.applications = applications;
    }
    if let Some(settings) = change.settings {
        spec.settings = settings;
    }
    let record = control::update_tenant(&state.pool, &spec, state.clock.now()).await?;
    Ok(Json(record.into()))
}

#[utoipa::path(
    delete,
    path = "/v1/admin/tenants/{tenant}",
    operation_id = "delete_tenant",
    tag = "admin",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses(
        (status = 200, description = "`{name, object: \"tenant\", deleted: true}`", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
        (status = 409, description = "`tenant_in_use`: tenants name it as their parent, or it has jobs not finished", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn delete_tenant(
    State(state): State<AppState>,
    _: Admin,
    Path(name): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    control::delete_tenant(&state.pool, &name).await?;
    Ok(Json(
        serde_json::json!({"name": name, "object": "tenant", "deleted": true}),
    ))
}

#[utoipa::path(
    post,
    path = "/v1/admin/tenants/{tenant}/keys",
    operation_id = "create_key",
    tag = "admin",
    params(("tenant" = String, Path, description = "The tenant's name")),
    request_body = NewKey,
    responses(
        (status = 201, description = "The key, with its secret in `key` (shown this once)", body = KeyObject),
        (status = 400, description = "`invalid_request`", body = doc::ErrorBody),
        (status = 404, description = "`not_found`: no such tenant", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn create_key(
    State(state): State<AppState>,
    _: Admin,
    Path(tenant): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let new: NewKey = if bytes.as_ref().is_ok_and(|b| b.is_empty()) {
        NewKey::default()
    } else {
        body(bytes)?
    };
    let request = KeyRequest {
        name: new.name.unwrap_or_else(|| "default".to_owned()),
        application: new.application,
        expires_at: new.expires_at,
        limits: new.limits,
        budgets: new.budgets,
        scopes: new.scopes,
    };
    let (record, secret) = control::create_key(&state.pool, &tenant, &request, state.clock.now()).await?;
    Ok((StatusCode::CREATED, Json(KeyObject::of(record, Some(secret)))).into_response())
}

#[utoipa::path(
    get,
    path = "/v1/admin/tenants/{tenant}/keys",
    operation_id = "list_keys",
    tag = "admin",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses(
        (status = 200, description = "`{object: \"list\", data: [api_key]}`, newest first, revoked keys too", body = Object),
        (status = 404, description = "`not_found`: no such tenant", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn list_keys(
    State(state): State<AppState>,
    _: Admin,
    Path(tenant): Path<String>,
) -> Result<Response, ApiError> {
    tenant_record(&state, &tenant).await?;
    let keys = store::list_keys(&state.pool, &tenant).await?;
    Ok(list(keys.into_iter().map(|k| KeyObject::of(k, None)).collect()).into_response())
}

#[utoipa::path(
    delete,
    path = "/v1/admin/tenants/{tenant}/keys/{id}",
    operation_id = "revoke_key",
    tag = "admin",
    params(
        ("tenant" = String, Path, description = "The tenant's name"),
        ("id" = String, Path, description = "The key's id"),
    ),
    responses(
        (status = 200, description = "The key, revoked: refused by every process within a second", body = KeyObject),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn revoke_key(
    State(state): State<AppState>,
    _: Admin,
    Path((tenant, id)): Path<(String, String)>,
) -> Result<Json<KeyObject>, ApiError> {
    let id: uuid::Uuid = id.parse().map_err(|_| ApiError::not_found("key"))?;
    let record = control::revoke_key(&state.pool, &tenant, id, state.clock.now()).await?;
    Ok(Json(KeyObject::of(record, None)))
}

/// `POST /v1/admin/provider-keys`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewProviderKey {
    /// A configured provider's name.
    provider: String,
    /// 1 to 64 of A-Z a-z 0-9 - _ . ; not a key name of the config file.
    name: String,
    /// The provider's key. Stored sealed, never returned.
    #[schema(value_type = String)]
    value: secrecy::SecretString,
    /// Its share of the provider's requests (default 1).
    #[serde(default)]
    weight: Option<u32>,
    /// The models it may serve (default: all of its provider's).
    #[serde(default)]
    models: Vec<String>,
    /// Its own limits (`rpm`, `tpm`, `itpm`, `otpm`, `rpd`, `concurrency`), across models.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    limits: Option<ModelLimits>,
    /// The provider account (quota pool) its calls count against, where the provider's
    /// responses do not name it (a Gemini key's Google Cloud project): keys of different
    /// accounts have their limits learned apart. 1 to 64 of A-Z a-z 0-9 - _ . ; it stands
    /// over the account responses name.
    #[serde(default)]
    account: Option<String>,
}

/// `PATCH /v1/admin/provider-keys/{provider}/{name}`: each field given replaces; a key of
/// the config file takes only `disabled`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProviderKeyPatch {
    /// A new secret: the key rotated.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    value: Option<secrecy::SecretString>,
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    models: Option<Vec<String>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Object>)]
    limits: Option<Option<ModelLimits>>,
    /// The account it is declared in; `null`: none.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    account: Option<Option<String>>,
    #[serde(default)]
    disabled: Option<bool>,
}

/// A provider key as the admin API shows it: never its secret.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ProviderKeyObject {
    /// `provider_key`.
    object: &'static str,
    provider: String,
    name: String,
    /// `file` (the config file's; only disabled or enabled here) or `api`.
    source: Source,
    weight: u32,
    /// The models it may serve; empty: all of its provider's.
    models: Vec<String>,
    #[schema(value_type = Option<Object>)]
    limits: Option<ModelLimits>,
    /// The account (quota pool) it is declared in; `null`: none (its responses may name one:
    /// `GET /v1/limits` shows the pools).
    account: Option<String>,
    disabled: bool,
    updated_at: Option<DateTime<Utc>>,
}

/// Every provider key: the config file's (with what the control plane says of them) and
/// those added at runtime.
fn provider_key_objects(config: &Config, rows: Vec<store::ProviderKeyRecord>) -> Vec<ProviderKeyObject> {
    let mut out = Vec::new();
    for p in &config.providers {
        for k in &p.keys {
            let row = rows.iter().find(|r| r.provider == p.name && r.name == k.name);
            out.push(ProviderKeyObject {
                object: "provider_key",
                provider: p.name.clone(),
                name: k.name.clone(),
                source: Source::File,
                weight: k.weight.max(1),
                models: k.models.clone(),
                limits: k.limits.clone(),
                account: k.account.clone(),
                disabled: row.is_some_and(|r| r.disabled_at.is_some()),
                updated_at: row.map(|r| r.updated_at),
            });
        }
    }
    out.extend(
        rows.into_iter()
            .filter(|r| r.sealed_value.is_some())
            .map(provider_key_object),
    );
    out
}

fn provider_key_object(r: store::ProviderKeyRecord) -> ProviderKeyObject {
    ProviderKeyObject {
        object: "provider_key",
        source: if r.sealed_value.is_some() {
            Source::Api
        } else {
            Source::File
        },
        provider: r.provider,
        name: r.name,
        weight: r.weight,
        models: r.models,
        limits: r.limits,
        account: r.account,
        disabled: r.disabled_at.is_some(),
        updated_at: Some(r.updated_at),
    }
}

#[utoipa::path(
    post,
    path = "/v1/admin/provider-keys",
    operation_id = "add_provider_key",
    tag = "admin",
    request_body = NewProviderKey,
    responses(
        (status = 201, description = "The key (never its value)", body = ProviderKeyObject),
        (status = 400, description = "`invalid_request`: `param` names the field", body = doc::ErrorBody),
        (status = 409, description = "`already_exists`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn add_provider_key(
    State(state): State<AppState>,
    _: Admin,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let new: NewProviderKey = body(bytes)?;
    let key = control::NewProviderKey {
        provider: new.provider,
        name: new.name,
        value: new.value,
        weight: new.weight.unwrap_or(1),
        models: new.models,
        limits: new.limits,
        account: new.account,
    };
    let record = control::add_provider_key(&state.pool, &state.config, &key, state.clock.now()).await?;
    Ok((StatusCode::CREATED, Json(provider_key_object(record))).into_response())
}

#[utoipa::path(
    get,
    path = "/v1/admin/provider-keys",
    operation_id = "list_provider_keys",
    tag = "admin",
    responses(
        (status = 200, description = "`{object: \"list\", data: [provider_key]}`: the config file's keys and those added at runtime", body = Object),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn list_provider_keys(
    State(state): State<AppState>,
    _: Admin,
) -> Result<Response, ApiError> {
    let rows = store::list_provider_keys(&state.pool).await?;
    Ok(list(provider_key_objects(&state.config, rows)).into_response())
}

#[utoipa::path(
    patch,
    path = "/v1/admin/provider-keys/{provider}/{name}",
    operation_id = "change_provider_key",
    tag = "admin",
    params(
        ("provider" = String, Path, description = "The provider's name"),
        ("name" = String, Path, description = "The key's name"),
    ),
    request_body = ProviderKeyPatch,
    responses(
        (status = 200, description = "The key as changed: in force on every process within a second", body = ProviderKeyObject),
        (status = 400, description = "`invalid_request`: `param` names the field", body = doc::ErrorBody),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn change_provider_key(
    State(state): State<AppState>,
    _: Admin,
    Path((provider, name)): Path<(String, String)>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Json<ProviderKeyObject>, ApiError> {
    let patch: ProviderKeyPatch = body(bytes)?;
    let change = control::ProviderKeyChange {
        value: patch.value,
        weight: patch.weight,
        models: patch.models,
        limits: patch.limits,
        account: patch.account,
        disabled: patch.disabled,
    };
    let record = control::change_provider_key(
        &state.pool,
        &state.config,
        &provider,
        &name,
        &change,
        state.clock.now(),
    )
    .await?;
    // A key of the file shows as the file has it; one added at runtime as stored.
    let shown = provider_key_objects(&state.config, vec![record.clone()])
        .into_iter()
        .find(|k| k.provider == provider && k.name == name)
        .unwrap_or_else(|| provider_key_object(record));
    Ok(Json(shown))
}

#[utoipa::path(
    delete,
    path = "/v1/admin/provider-keys/{provider}/{name}",
    operation_id = "remove_provider_key",
    tag = "admin",
    params(
        ("provider" = String, Path, description = "The provider's name"),
        ("name" = String, Path, description = "The key's name"),
    ),
    responses(
        (status = 200, description = "`{provider, name, object: \"provider_key\", deleted: true}`", body = Object),
        (status = 400, description = "`invalid_request`: a key of the config file (disable it instead)", body = doc::ErrorBody),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn remove_provider_key(
    State(state): State<AppState>,
    _: Admin,
    Path((provider, name)): Path<(String, String)>,
) -> Result<Json<serde_json::Value>, ApiError> {
    control::remove_provider_key(&state.pool, &state.config, &provider, &name).await?;
    Ok(Json(
        serde_json::json!({"provider": provider, "name": name, "object": "provider_key", "deleted": true}),
    ))
}

/// `POST /v1/admin/routes`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewRoute {
    /// What clients put in `model`; not an alias of the config file.
    alias: String,
    /// `provider/model` targets in order of preference.
    targets: Vec<String>,
    /// The route's own share (`rpm`, `tpm`, …) on all jobs sent through it.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    limits: Option<ModelLimits>,
}

/// `PATCH /v1/admin/routes/{alias}`: each field given replaces the route's.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RouteChange {
    #[serde(default)]
    targets: Option<Vec<String>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Object>)]
    limits: Option<Option<ModelLimits>>,
}

/// A route as the admin API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RouteObject {
    /// `route`.
    object: &'static str,
    alias: String,
    targets: Vec<String>,
    #[schema(value_type = Option<Object>)]
    limits: Option<ModelLimits>,
    /// `file` (the config file's; it changes there) or `api`.
    source: Source,
}

impl From<store::RouteRecord> for RouteObject {
    fn from(r: store::RouteRecord) -> Self {
        RouteObject {
            object: "route",
            alias: r.alias,
            targets: r.targets,
            limits: r.limits,
            source: Source::Api,
        }
    }
}

#[utoipa::path(
    post,
    path = "/v1/admin/routes",
    operation_id = "add_route",
    tag = "admin",
    request_body = NewRoute,
    responses(
        (status = 201, description = "The route: in force on every process within a second", body = RouteObject),
        (status = 400, description = "`invalid_request`: `param` names the field", body = doc::ErrorBody),
        (status = 409, description = "`already_exists`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn add_route(
    State(state): State<AppState>,
    _: Admin,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let new: NewRoute = body(bytes)?;
    let record = control::put_route(
        &state.pool,
        &state.config,
        &new.alias,
        &new.targets,
        new.limits.as_ref(),
        false,
        state.clock.now(),
    )
    .await?;
    Ok((StatusCode::CREATED, Json(RouteObject::from(record))).into_response())
}

#[utoipa::path(
    get,
    path = "/v1/admin/routes",
    operation_id = "list_routes",
    tag = "admin",
    responses(
        (status = 200, description = "`{object: \"list\", data: [route]}`: the config file's and those added at runtime", body = Object),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn list_routes(State(state): State<AppState>, _: Admin) -> Result<Response, ApiError> {
    let mut routes: Vec<RouteObject> = state
        .config
        .routes
        .iter()
        .map(|r| RouteObject {
            object: "route",
            alias: r.alias.clone(),
            targets: r.targets.clone(),
            limits: r.limits.clone(),
            source: Source::File,
        })
        .collect();
    routes.extend(
        store::list_routes(&state.pool)
            .await?
            .into_iter()
            .map(RouteObject::from),
    );
    Ok(list(routes).into_response())
}

#[utoipa::path(
    patch,
    path = "/v1/admin/routes/{alias}",
    operation_id = "change_route",
    tag = "admin",
    params(("alias" = String, Path, description = "The route's alias")),
    request_body = RouteChange,
    responses(
        (status = 200, description = "The route as changed", body = RouteObject),
        (status = 400, description = "`invalid_request`: `param` names the field (a route of the config file changes there)", body = doc::ErrorBody),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn change_route(
    State(state): State<AppState>,
    _: Admin,
    Path(alias): Path<String>,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Json<RouteObject>, ApiError> {
    let change: RouteChange = body(bytes)?;
    let current = store::list_routes(&state.pool)
        .await?
        .into_iter()
        .find(|r| r.alias == alias);
    let (targets, limits) = match (&current, change.targets, change.limits) {
        (Some(r), targets, limits) => (
            targets.unwrap_or_else(|| r.targets.clone()),
            limits.unwrap_or_else(|| r.limits.clone()),
        ),
        // A file's route, or none: the control plane names which.
        (None, targets, limits) => (targets.unwrap_or_default(), limits.flatten()),
    };
    let record = control::put_route(
        &state.pool,
        &state.config,
        &alias,
        &targets,
        limits.as_ref(),
        true,
        state.clock.now(),
    )
    .await?;
    Ok(Json(record.into()))
}

#[utoipa::path(
    delete,
    path = "/v1/admin/routes/{alias}",
    operation_id = "remove_route",
    tag = "admin",
    params(("alias" = String, Path, description = "The route's alias")),
    responses(
        (status = 200, description = "`{alias, object: \"route\", deleted: true}`: jobs still queued for it fail `unknown_model`", body = Object),
        (status = 400, description = "`invalid_request`: a route of the config file", body = doc::ErrorBody),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn remove_route(
    State(state): State<AppState>,
    _: Admin,
    Path(alias): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    control::remove_route(&state.pool, &state.config, &alias).await?;
    Ok(Json(
        serde_json::json!({"alias": alias, "object": "route", "deleted": true}),
    ))
}
