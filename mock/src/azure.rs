//! `POST /openai/deployments/{deployment}/chat/completions?api-version=…` in Azure
//! OpenAI's shape (`docs/PROVIDERS.md` §4): `api-key` auth, the deployment in the path (checked
//! against the project's `models`), a required `api-version`, OpenAI's body and response,
//! `x-ratelimit-remaining-requests` / `-tokens` headers (no limits or resets, as Azure
//! usually sends), and 429s whose body has the **string** code `"429"` and a "Please
//! retry after N seconds" message, with `retry-after` and `retry-after-ms`. Other errors
//! use Azure's `{"error":{"code","message"}}` shape.
//!
//! The `requests` header reports RPM (or RPD when there is no RPM); `tokens` reports TPM.

use std::collections::HashMap;

use axum::body::{Body, to_bytes};
use axum::extract::{Path as UrlPath, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::json;

use super::buckets::{Denial, LimitKind, LimitsView};
use super::openai::{Admit, complete};
use super::reply::Respond;
use super::request::{ChatRequest, input_tokens};
use super::{Inner, KeyLookup, MAX_BODY_BYTES, MockProvider, ProviderKind, ceil_secs};

struct Reply<'a> {
    inner: &'a Inner,
    request_id: String,
}

pub(super) async fn chat_completions(
    State(p): State<MockProvider>,
    UrlPath(deployment): UrlPath<String>,
    Query(query): Query<HashMap<String, String>>,
    req: Request,
) -> Response {
    let inner = &*p.inner;
    let in_flight = inner.totals.begin();
    let reply = Reply {
        inner,
        request_id: super::uuid_v7(inner).to_string(),
    };
    let (parts, body) = req.into_parts();
    let key = parts
        .headers
        .get("api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty());
    let project = match key.map(|k| inner.lookup(ProviderKind::Azure, k)) {
        Some(KeyLookup::Valid(idx)) => idx,
        _ => {
            super::stats::bump(&inner.totals.unauthorized);
            return reply.error(
                StatusCode::UNAUTHORIZED,
                "401",
                "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key for an active subscription and use a correct regional API endpoint for your resource.",
                None,
            );
        }
    };
    let Some(api_version) = query.get("api-version").filter(|v| !v.is_empty()) else {
        super::stats::bump(&inner.totals.not_found);
        return reply.error(StatusCode::NOT_FOUND, "404", "Resource not found", None);
    };
    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        return reply.bad_request("The request body could not be read.");
    };
    let req: ChatRequest = match serde_json::from_slice(&bytes) {
        Ok(r) => r,
        Err(e) => return reply.bad_request(&format!("Invalid request body: {e}")),
    };
    let Some(messages) = req.messages.as_ref().filter(|m| m.count > 0) else {
        return reply.bad_request("'messages' is a required property and must not be empty.");
    };
    if let Some(message) = &messages.tool_turn_error {
        return reply.bad_request(message);
    }
    let max_out = req.max_out();
    if max_out == Some(0) {
        return reply.bad_request("max_tokens must be at least 1.");
    }
    let choices = match req.choices() {
        Ok(n) => n,
        Err(message) => return reply.bad_request(&message),
    };
    if !inner.model_allowed(project, &deployment) {
        super::stats::bump(&inner.totals.not_found);
        return reply.error(
            StatusCode::NOT_FOUND,
            "DeploymentNotFound",
            "The API deployment for this resource does not exist. If you created the deployment within the last 5 minutes, please wait a moment and try again.",
            None,
        );
    }
    if let Some(status) = inner.fault(project) {
        let (code, message) = match status.as_u16() {
            500 => (
                "InternalServerError",
                "The server had an error while processing your request.",
            ),
            _ => (
                "ServiceUnavailable",
                "The service is temporarily unable to process your request. Please try again later.",
            ),
        };
        return reply.error(status, code, message, Some(&inner.view(project)));
    }

    let chat = Admit {
        project,
        model: &deployment,
        input: input_tokens(messages, None),
        max_out,
        choices,
        stream: req.stream == Some(true),
        include_usage: req.stream_options.as_ref().and_then(|o| o.include_usage) == Some(true),
        fixed: req.fixed_answer(),
    };
    complete(&p, in_flight, &reply, chat, |d, view| {
        reply.rate_limited(api_version, d, view)
    })
    .await
}

impl Respond for Reply<'_> {
    fn respond(
        &self,
        status: StatusCode,
        body: Body,
        content_type: &'static str,
        view: Option<&LimitsView>,
    ) -> Response {
        let mut resp = super::reply::base(status, body, content_type);
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&self.request_id) {
            h.insert("apim-request-id", v.clone());
            h.insert("x-request-id", v);
        }
        h.insert("x-ms-region", HeaderValue::from_static("Sweden Central"));
        if let Some(view) = view.filter(|_| self.inner.send_rate_limit_headers) {
            rate_limit_headers(h, view);
        }
        resp
    }
}

impl Reply<'_> {
    /// An error in Azure's own shape: `{"error":{"code","message"}}`.
    fn error(&self, status: StatusCode, code: &str, message: &str, view: Option<&LimitsView>) -> Response {
        self.json(
            status,
            &json!({"error": {"code": code, "message": message}}),
            view,
        )
    }

    /// Body errors pass through in OpenAI's shape, as Azure relays them.
    fn bad_request(&self, message: &str) -> Response {
        super::stats::bump(&self.inner.totals.bad_request);
        let body = json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}});
        self.json(StatusCode::BAD_REQUEST, &body, None)
    }

    fn rate_limited(&self, api_version: &str, d: &Denial, view: &LimitsView) -> Response {
        let what = match d.kind {
            LimitKind::Rpm | LimitKind::Rpd => "call rate limit",
            LimitKind::Tpm | LimitKind::Itpm | LimitKind::Otpm => "token rate limit",
        };
        let secs = ceil_secs(d.wait_ns);
        let message = if d.too_large {
            format!(
                "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version {api_version} exceed the {what} of your current OpenAI S0 pricing tier on their own: requested {}, limit {}.",
                d.requested, d.limit
            )
        } else {
            format!(
                "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version {api_version} have exceeded {what} of your current OpenAI S0 pricing tier. Please retry after {secs} seconds. Please go here: https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."
            )
        };
        let mut resp = self.error(StatusCode::TOO_MANY_REQUESTS, "429", &message, Some(view));
        if self.inner.send_rate_limit_headers && !d.too_large {
            let h = resp.headers_mut();
            h.insert("retry-after", HeaderValue::from(secs));
            h.insert("retry-after-ms", HeaderValue::from(d.wait_ns.div_ceil(1_000_000)));
        }
        resp
    }
}

fn rate_limit_headers(h: &mut HeaderMap, view: &LimitsView) {
    if let Some(b) = view.rpm.as_ref().or(view.rpd.as_ref()) {
        h.insert("x-ratelimit-remaining-requests", HeaderValue::from(b.remaining));
    }
    if let Some(b) = &view.tpm {
        h.insert("x-ratelimit-remaining-tokens", HeaderValue::from(b.remaining));
    }
}
