//! Authentication: `Authorization: Bearer <tenant key>` (or `x-api-key: <tenant key>`, as
//! Anthropic's SDKs send it) → the tenant ([`AuthTenant`]), or
//! the admin key (`server.admin_key`) → every tenant ([`Viewer`], for what operators
//! watch). Missing or unknown keys answer 401 with `missing_api_key` / `invalid_api_key`.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use tollgate::tenants::Tenant;
use tollgate::vocab::ApiErrorCode;

use crate::AppState;
use crate::error::ApiError;

/// The authenticated tenant of a request.
pub struct AuthTenant(pub Tenant);

impl FromRequestParts<AppState> for AuthTenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let key = bearer(&parts.headers)?;
        state
            .tenants
            .authenticate(key)
            .cloned()
            .map(AuthTenant)
            .ok_or_else(invalid_key)
    }
}

/// Who is looking: the operators (admin key) see every tenant, a tenant its own.
pub enum Viewer {
    Admin,
    Tenant(Tenant),
}

impl Viewer {
    /// The tenant whose data this viewer may see; `None` = every tenant.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Viewer::Admin => None,
            Viewer::Tenant(t) => Some(&t.name),
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
        if state.tenants.is_admin(key) {
            return Ok(Viewer::Admin);
        }
        state
            .tenants
            .authenticate(key)
            .cloned()
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
