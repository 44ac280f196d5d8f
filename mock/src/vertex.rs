//! Google Vertex AI: its OAuth2 token endpoint and its model routes.
//!
//! - `POST /token` takes the JWT-bearer grant (RFC 7523) as Google's does: a JWT of a
//!   service account (`iss` a key of a `vertex` project), audience this endpoint's URL,
//!   scope `cloud-platform`, signed RS256 — verified with the project's `public_key` — and
//!   answers an access token for an hour. A bad grant is 400 `invalid_grant`.
//! - `POST /v1/projects/{project}/locations/{location}/publishers/{publisher}/models/{model}:{method}`
//!   takes `Authorization: Bearer` with such a token (else 401 `UNAUTHENTICATED`), for
//!   the token's own project (else 403 `PERMISSION_DENIED`); Gemini models
//!   (`publishers/google`) answer as the Gemini API does (`gemini`), Claude models
//!   (`publishers/anthropic`, `rawPredict` and `streamRawPredict`) as Anthropic's
//!   Messages API does with Vertex's body (`anthropic`), but for their quota: a 429 in
//!   Google's shape (`RESOURCE_EXHAUSTED`) and no Anthropic rate-limit headers.

use std::collections::HashMap;

use axum::extract::{Path as UrlPath, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Form, Json};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use serde_json::json;

use super::{MockProvider, ProviderKind, hex_id};

/// How long a token lives, in seconds.
const TOKEN_SECS: u64 = 3600;

/// The JWT claims a token request is checked for.
#[derive(Deserialize)]
struct Claims {
    iss: String,
    scope: String,
}

fn invalid_grant(description: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": "invalid_grant", "error_description": description})),
    )
        .into_response()
}

pub(super) async fn token(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    let inner = &*p.inner;
    if form.get("grant_type").map(String::as_str) != Some("urn:ietf:params:oauth:grant-type:jwt-bearer") {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "unsupported_grant_type", "error_description": "Invalid grant_type: "})),
        )
            .into_response();
    }
    let Some(assertion) = form.get("assertion") else {
        return invalid_grant("Invalid JWT: missing assertion.");
    };
    // The issuer picks the public key; the signature, audience and expiry are checked with it.
    let mut unverified = Validation::new(Algorithm::RS256);
    unverified.insecure_disable_signature_validation();
    unverified.validate_aud = false;
    let unverified = jsonwebtoken::decode::<Claims>(assertion, &DecodingKey::from_secret(&[]), &unverified);
    let Some(issuer) = unverified.ok().map(|t| t.claims.iss) else {
        return invalid_grant(
            "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe.",
        );
    };
    let project = inner.projects.iter().position(|project| {
        project.public_key.is_some()
            && inner
                .keys
                .get(&ProviderKind::Vertex)
                .and_then(|keys| keys.get(&issuer))
                .is_some_and(|k| !k.revoked && inner.projects[k.project].name == project.name)
    });
    let Some((project, pem)) = project.and_then(|i| Some((i, inner.projects[i].public_key.as_deref()?)))
    else {
        super::stats::bump(&inner.totals.unauthorized);
        return invalid_grant("Invalid grant: account not found");
    };
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    let mut validation = Validation::new(Algorithm::RS256);
    validation.set_audience(&[format!("http://{host}/token")]);
    validation.set_issuer(&[issuer.as_str()]);
    validation.set_required_spec_claims(&["exp", "iat", "aud", "iss"]);
    let verified = DecodingKey::from_rsa_pem(pem.as_bytes())
        .ok()
        .and_then(|key| jsonwebtoken::decode::<Claims>(assertion, &key, &validation).ok());
    let Some(verified) = verified else {
        super::stats::bump(&inner.totals.unauthorized);
        return invalid_grant("Invalid JWT Signature.");
    };
    if !verified
        .claims
        .scope
        .split(' ')
        .any(|s| s == "https://www.googleapis.com/auth/cloud-platform")
    {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "invalid_scope", "error_description": "Invalid OAuth scope or ID token audience provided."})),
        )
            .into_response();
    }
    let access_token = format!("ya29.mock-{}", hex_id(32));
    let expires = inner.unix_secs() + TOKEN_SECS as i64;
    inner
        .vertex_tokens()
        .insert(access_token.clone(), (project, expires));
    Json(json!({"access_token": access_token, "expires_in": TOKEN_SECS - 1, "token_type": "Bearer"}))
        .into_response()
}

/// The path of a model call on Vertex AI.
#[derive(Deserialize)]
pub(super) struct ModelPath {
    project: String,
    location: String,
    publisher: String,
    model_action: String,
}

pub(super) async fn predict(
    State(p): State<MockProvider>,
    UrlPath(path): UrlPath<ModelPath>,
    Query(query): Query<HashMap<String, String>>,
    req: Request,
) -> Response {
    let inner = &*p.inner;
    let in_flight = inner.totals.begin();
    let (parts, body) = req.into_parts();
    let token = parts
        .headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let now = inner.unix_secs();
    let project = token.and_then(|t| {
        inner
            .vertex_tokens()
            .get(t)
            .filter(|(_, expires)| *expires > now)
            .map(|(project, _)| *project)
    });
    let Some(project) = project else {
        super::stats::bump(&inner.totals.unauthorized);
        return super::gemini::error(
            inner,
            StatusCode::UNAUTHORIZED,
            "UNAUTHENTICATED",
            "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project.",
        );
    };
    let (model, method) = path
        .model_action
        .split_once(':')
        .unwrap_or((&path.model_action, ""));
    if path.project != inner.projects[project].name {
        super::stats::bump(&inner.totals.unauthorized);
        let message = format!(
            "Permission 'aiplatform.endpoints.predict' denied on resource '//aiplatform.googleapis.com/projects/{}/locations/{}/publishers/{}/models/{model}' (or it may not exist).",
            path.project, path.location, path.publisher
        );
        return super::gemini::error(inner, StatusCode::FORBIDDEN, "PERMISSION_DENIED", &message);
    }
    match (path.publisher.as_str(), method) {
        ("google", _) => {
            super::gemini::answer(&p, in_flight, project, &path.model_action, &query, body).await
        }
        ("anthropic", "rawPredict" | "streamRawPredict") => {
            super::anthropic::vertex(&p, in_flight, project, model, body).await
        }
        _ => {
            super::stats::bump(&inner.totals.not_found);
            let message = format!(
                "Publisher Model `projects/{}/locations/{}/publishers/{}/models/{model}` not found.",
                path.project, path.location, path.publisher
            );
            super::gemini::error(inner, StatusCode::NOT_FOUND, "NOT_FOUND", &message)
        }
    }
}
