//! Authentication: `Authorization: Bearer <tenant key>` (or `x-api-key: <tenant key>`, as
//! Anthropic's SDKs send it) → the tenant ([`AuthTenant`]), or
//! the admin key (`server.admin_key`) → every tenant ([`Viewer`], for what operators
//! watch; [`Admin`], for what only they may do). Keys are looked up in the process's
//! directory of the control plane (`tollgate::control`), current within a second of any
//! change. Missing, unknown, revoked or expired keys answer 401 with `missing_api_key` /
//! `invalid_api_key`; a tenant's key where the admin key is needed, 403 `admin_only`.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use tollgate::tenants::Caller;
use tollgate::vocab::ApiErrorCode;

use crate::AppState;
use crate::error::ApiError;

/// The authenticated tenant of a request, and the key it came with.
pub struct AuthTenant(pub Caller);

impl FromRequestParts<AppState> for AuthTenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let key = bearer(&parts.headers)?;
        // The guard, which every request passes first, noted the key's use.
        state
            .tenants
            .current()
            .authenticate(key, state.clock.now())
            .map(AuthTenant)
            .ok_or_else(invalid_key)
    }
}

/// A request made with the admin key.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        match Viewer::from_request_parts(parts, state).await? {
            Viewer::Admin => Ok(Admin),
            Viewer::Tenant(_) => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                ApiErrorCode::AdminOnly,
                "this endpoint needs the admin key (server.admin_key)",
            )),
        }
    }
}

/// Who is looking: the operators (admin key) see every tenant, a tenant (with the key it
/// came with) its own.
pub enum Viewer {
    Admin,
    Tenant(Caller),
}

impl Viewer {
    /// The tenant whose data this viewer may see; `None` = every tenant.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Viewer::Admin => None,
            Viewer::Tenant(c) => Some(&c.tenant.name),
        }
    }

    pub fn may_see(&self, tenant: &str) -> bool {
        self.tenant().is_none_or(|t| t == tenant)
    }
}

impl FromRequestParts<AppState> for Viewer {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let key = bearer(&parts.headers)?;
        let directory = state.tenants.current();
        if directory.is_admin(key) {
            return Ok(Viewer::Admin);
        }
        directory
            .authenticate(key, state.clock.now())
            .map(Viewer::Tenant)
            .ok_or_else(invalid_key)
    }
}

fn invalid_key() -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        ApiErrorCode::InvalidApiKey,
        "the API key is not valid",
    )
}

/// The key of `Authorization: Bearer <key>`, or else of `x-api-key: <key>`.
pub(crate) fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let missing =
        |message: &'static str| ApiError::new(StatusCode::UNAUTHORIZED, ApiErrorCode::MissingApiKey, message);
    let key = match headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        Some(value) => value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .ok_or_else(|| missing("the Authorization header must be `Bearer <key>`"))?,
        None => headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default(),
    };
    Some(key.trim()).filter(|k| !k.is_empty()).ok_or_else(|| {
        missing("send your tenant API key as `Authorization: Bearer <key>` or `x-api-key: <key>`")
    })
}
