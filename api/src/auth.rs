//! Authentication: `Authorization: Bearer <tenant key>` → the tenant. Missing or unknown
//! keys answer 401 with `missing_api_key` / `invalid_api_key`.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use tollgate::tenants::Tenant;

use crate::AppState;
use crate::error::ApiError;

/// The authenticated tenant of a request.
pub struct AuthTenant(pub Tenant);

impl FromRequestParts<AppState> for AuthTenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let value = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "missing_api_key",
                    "send your tenant API key as `Authorization: Bearer <key>`",
                )
            })?;
        let key = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "missing_api_key",
                    "the Authorization header must be `Bearer <key>`",
                )
            })?;
        state
            .tenants
            .authenticate(key)
            .cloned()
            .map(AuthTenant)
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "invalid_api_key",
                    "the API key is not valid",
                )
            })
    }
}
