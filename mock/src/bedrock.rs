//! AWS Bedrock's Converse API: `POST /model/{modelId}/converse` and `/converse-stream`.
//!
//! Every request must carry a valid SigV4 signature (service `bedrock`): the mock reads
//! the access key id from the `Credential` scope, finds its secret (a project key is
//! `ACCESS_KEY_ID:SECRET`), signs the request as received with AWS's own signer and
//! compares. Errors as AWS sends them: the type in `x-amzn-ErrorType`, a
//! `{"message": …}` body, a request id in `x-amzn-RequestId` — no signature → 403
//! `MissingAuthenticationTokenException`, an unknown or revoked key → 403
//! `UnrecognizedClientException`, a wrong signature → 403 `InvalidSignatureException`, a
//! stamp over 5 minutes off → 403 `InvalidSignatureException` ("Signature expired"), a bad
//! body → 400 `ValidationException`, a limit → 429 `ThrottlingException` (no
//! `Retry-After`: Bedrock sends none, nor any rate-limit header), a fault window → 503
//! `ServiceUnavailableException` or 500 `InternalServerException`.
//!
//! Token rule as elsewhere: each message's text blocks count as one message, `system`
//! as one more. A request that offers tools and whose last turn is no tool result is
//! answered with a `toolUse` of the first tool (plain calls only). ConverseStream answers
//! `application/vnd.amazon.eventstream`: `messageStart`, a `contentBlockDelta` per token,
//! `contentBlockStop`, `messageStop` and `metadata` with the usage (`stream`).

use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use axum::body::{Body, to_bytes};
use axum::extract::{Path as UrlPath, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};

use super::buckets::{Admission, Charge, LimitsView};
use super::reply::Respond;
use super::request::{MessagesTokens, message_tokens};
use super::stream::{self, Shape, StreamGuard};
use super::{Inner, KeyLookup, MAX_BODY_BYTES, MockProvider, ProviderKind};

/// How far a request's `x-amz-date` may be from the mock's clock.
const MAX_SKEW: Duration = Duration::from_secs(300);

struct Reply<'a> {
    inner: &'a Inner,
    request_id: String,
}

pub(super) async fn converse(
    State(p): State<MockProvider>,
    UrlPath((model, operation)): UrlPath<(String, String)>,
    req: Request,
) -> Response {
    let inner = &*p.inner;
    let in_flight = inner.totals.begin();
    let reply = Reply {
        inner,
        request_id: super::uuid_v7(inner).to_string(),
    };
    let streamed = match operation.as_str() {
        "converse" => false,
        "converse-stream" => true,
        _ => {
            super::stats::bump(&inner.totals.not_found);
            return reply.error(StatusCode::NOT_FOUND, "UnknownOperationException", "");
        }
    };
    let (parts, body) = req.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        return reply.validation("The request body could not be read.");
    };
    let project = match reply.authenticate(&parts, &bytes) {
        Ok(project) => project,
        Err(response) => return *response,
    };
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        return reply.validation("The request body is not valid JSON.");
    };
    let (messages, system) = match read_conversation(&body) {
        Ok(read) => read,
        Err(message) => return reply.validation(&message),
    };
    let max_tokens = body.pointer("/inferenceConfig/maxTokens").and_then(Value::as_u64);
    if max_tokens == Some(0) {
        return reply.validation(
            "1 validation error detected: Value '0' at 'inferenceConfig.maxTokens' failed to satisfy constraint: Member must have value greater than or equal to 1",
        );
    }
    if !inner.model_allowed(project, &model) {
        super::stats::bump(&inner.totals.not_found);
        return reply.error(
            StatusCode::NOT_FOUND,
            "ResourceNotFoundException",
            "Could not resolve the foundation model from the provided model identifier.",
        );
    }
    if let Some(status) = inner.fault(project) {
        let (kind, message) = match status.as_u16() {
            500 => (
                "InternalServerException",
                "The server encountered an internal error.",
            ),
            _ => (
                "ServiceUnavailableException",
                "Bedrock is unable to process your request.",
            ),
        };
        return reply.error(status, kind, message);
    }
    let input = super::request::input_tokens(&messages, system.as_ref());
    let reserved = max_tokens.unwrap_or(inner.output_tokens);
    let output = inner.completion_tokens(max_tokens);
    let charge = Charge {
        tokens: input.saturating_add(reserved),
        input,
        output: reserved,
    };
    let view = match inner.admit(project, charge, input, output) {
        Admission::Admitted(view) => view,
        Admission::Denied(denial, _) if denial.too_large => {
            return reply.validation("Input is too long for requested model.");
        }
        Admission::Denied(..) => {
            return reply.error(
                StatusCode::TOO_MANY_REQUESTS,
                "ThrottlingException",
                "Too many requests, please wait before trying again.",
            );
        }
    };
    let stop_reason = if output < inner.output_tokens {
        "max_tokens"
    } else {
        "end_turn"
    };
    super::stats::bump(&inner.totals.succeeded);
    if streamed {
        in_flight.hand_over();
        let otpm_reserved = if view.otpm.is_some() { reserved } else { 0 };
        let guard = StreamGuard::new(p.clone(), project, output, otpm_reserved);
        let shape = Shape::Bedrock { stop_reason, input };
        let mut resp = reply.respond(
            StatusCode::OK,
            stream::body(guard, shape),
            "application/vnd.amazon.eventstream",
            Some(&view),
        );
        resp.headers_mut().insert(
            "x-amzn-bedrock-content-type",
            HeaderValue::from_static("application/json"),
        );
        return resp;
    }
    let refund = inner.generate(project, &view, reserved, output).await;
    let (content, stop_reason) = match tool_use(&body) {
        Some(call) => (json!([{"toolUse": call}]), "tool_use"),
        None => (json!([{"text": inner.text.words(output)}]), stop_reason),
    };
    let answer = json!({
        "output": {"message": {"role": "assistant", "content": content}},
        "stopReason": stop_reason,
        "usage": {"inputTokens": input, "outputTokens": output, "totalTokens": input + output},
        "metrics": {"latencyMs": inner.latency.as_millis()},
    });
    let response = reply.json(StatusCode::OK, &answer, Some(&view));
    drop(refund);
    response
}

/// The messages (each turn's text blocks and tool results counted as one message) and
/// system blocks of a Converse request, checked as Bedrock does: at least one message,
/// the first from the user, roles alternating, and tool blocks only with a `toolConfig`.
fn read_conversation(body: &Value) -> Result<(MessagesTokens, Option<super::request::TextChars>), String> {
    let turns = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("1 validation error detected: Value null at 'messages' failed to satisfy constraint: Member must not be null")?;
    if turns.first().and_then(|t| t.get("role")).and_then(Value::as_str) != Some("user") {
        return Err("A conversation must start with a user message. Try again with a conversation that starts with a user message.".to_owned());
    }
    let mut tokens = MessagesTokens::default();
    let mut previous = "";
    for turn in turns {
        let role = turn.get("role").and_then(Value::as_str).unwrap_or_default();
        if role == previous {
            return Err("A conversation must alternate between user and assistant roles. Make sure the conversation alternates between user and assistant roles and try again.".to_owned());
        }
        previous = role;
        let blocks = turn
            .get("content")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let uses_tools = blocks
            .iter()
            .any(|b| b.get("toolUse").is_some() || b.get("toolResult").is_some());
        if uses_tools && body.get("toolConfig").is_none() {
            return Err(
                "The toolConfig field must be defined when using toolUse and toolResult content blocks."
                    .to_owned(),
            );
        }
        let chars: usize = blocks
            .iter()
            .map(|b| {
                b.get("text")
                    .or_else(|| b.pointer("/toolResult/content/0/text"))
                    .and_then(Value::as_str)
                    .map_or(0, |t| t.chars().count())
            })
            .sum();
        tokens.count += 1;
        tokens.tokens += message_tokens(chars as u64);
    }
    let system_chars: usize = body
        .get("system")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .map(|t| t.chars().count())
        .sum();
    let system = body
        .get("system")
        .is_some()
        .then_some(super::request::TextChars(system_chars as u64));
    Ok((tokens, system))
}

/// The `toolUse` the mock answers with: of the first tool offered, when the last turn is
/// not a tool result.
fn tool_use(body: &Value) -> Option<Value> {
    let spec = body.pointer("/toolConfig/tools/0/toolSpec")?;
    let answered = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .and_then(|t| t.get("content"))
        .and_then(Value::as_array)
        .is_some_and(|blocks| blocks.iter().any(|b| b.get("toolResult").is_some()));
    if answered {
        return None;
    }
    let input = super::request::mock_object(spec.pointer("/inputSchema/json"));
    Some(
        json!({"toolUseId": format!("tooluse_{}", super::hex_id(22)), "name": spec.get("name"), "input": input}),
    )
}

/// The parts of an `Authorization: AWS4-HMAC-SHA256 Credential=…, SignedHeaders=…,
/// Signature=…` header.
struct Authorization<'a> {
    access_key_id: &'a str,
    region: &'a str,
    service: &'a str,
    signed_headers: Vec<&'a str>,
    signature: &'a str,
}

fn authorization(header: &str) -> Option<Authorization<'_>> {
    let fields = header.strip_prefix("AWS4-HMAC-SHA256 ")?;
    let field = |name: &str| {
        fields
            .split(',')
            .map(str::trim)
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
    };
    let mut scope = field("Credential")?.split('/');
    let access_key_id = scope.next()?;
    let _date = scope.next()?;
    let region = scope.next()?;
    let service = scope.next()?;
    Some(Authorization {
        access_key_id,
        region,
        service,
        signed_headers: field("SignedHeaders")?.split(';').collect(),
        signature: field("Signature")?,
    })
}

impl Reply<'_> {
    /// The project of the request's signing key, once its signature checks.
    fn authenticate(&self, parts: &axum::http::request::Parts, body: &[u8]) -> Result<usize, Box<Response>> {
        let forbidden = |kind: &str, message: &str| {
            super::stats::bump(&self.inner.totals.unauthorized);
            Box::new(self.error(StatusCode::FORBIDDEN, kind, message))
        };
        let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
        let Some(auth) = header("authorization").and_then(authorization) else {
            return Err(forbidden(
                "MissingAuthenticationTokenException",
                "Missing Authentication Token",
            ));
        };
        let invalid_key = || {
            forbidden(
                "UnrecognizedClientException",
                "The security token included in the request is invalid.",
            )
        };
        let keys = self.inner.keys.get(&ProviderKind::Bedrock);
        let Some((key, secret)) = keys
            .into_iter()
            .flatten()
            .map(|(key, _)| key)
            .find_map(|key| Some((key, key.strip_prefix(auth.access_key_id)?.strip_prefix(':')?)))
        else {
            return Err(invalid_key());
        };
        let project = match self.inner.lookup(ProviderKind::Bedrock, key) {
            KeyLookup::Valid(project) => project,
            KeyLookup::Revoked | KeyLookup::Unknown => return Err(invalid_key()),
        };
        let signed_at = header("x-amz-date")
            .and_then(|d| chrono::NaiveDateTime::parse_from_str(d, "%Y%m%dT%H%M%SZ").ok())
            .map(|d| {
                SystemTime::UNIX_EPOCH
                    + Duration::from_secs(u64::try_from(d.and_utc().timestamp()).unwrap_or(0))
            });
        let now = SystemTime::UNIX_EPOCH
            + Duration::from_nanos(
                u64::try_from(self.inner.clock.unix_ns_at(self.inner.clock.now_ns())).unwrap_or(0),
            );
        let skew = signed_at.map(|at| now.duration_since(at).unwrap_or_else(|e| e.duration()));
        if skew.is_none_or(|skew| skew > MAX_SKEW) {
            return Err(forbidden(
                "InvalidSignatureException",
                "Signature expired: the request's x-amz-date is more than 5 minutes from the server's time.",
            ));
        }
        let host = header("host").unwrap_or_default();
        let url = format!(
            "http://{host}{}",
            parts.uri.path_and_query().map_or("/", |p| p.as_str())
        );
        let expected = signed_headers_of(parts, &auth.signed_headers).and_then(|headers| {
            recompute(
                auth.access_key_id,
                secret,
                auth.region,
                auth.service,
                &url,
                &headers,
                body,
                signed_at?,
            )
        });
        if auth.service != "bedrock" || expected.as_deref() != Some(auth.signature) {
            return Err(forbidden(
                "InvalidSignatureException",
                "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.",
            ));
        }
        Ok(project)
    }

    fn error(&self, status: StatusCode, kind: &str, message: &str) -> Response {
        let mut resp = self.json(status, &json!({"message": message}), None);
        let error_type = format!("{kind}:http://internal.amazon.com/coral/com.amazon.bedrock/");
        if let Ok(v) = HeaderValue::from_str(&error_type) {
            resp.headers_mut().insert("x-amzn-errortype", v);
        }
        resp
    }

    fn validation(&self, message: &str) -> Response {
        super::stats::bump(&self.inner.totals.bad_request);
        self.error(StatusCode::BAD_REQUEST, "ValidationException", message)
    }
}

/// The request's signed headers other than those the signer makes itself (`host` from
/// the URL, `x-amz-date` from the time), as `(name, value)`; `None` when one is missing.
fn signed_headers_of(parts: &axum::http::request::Parts, names: &[&str]) -> Option<Vec<(String, String)>> {
    names
        .iter()
        .filter(|n| !matches!(**n, "host" | "x-amz-date"))
        .map(|n| {
            let value = parts.headers.get(*n)?.to_str().ok()?;
            Some(((*n).to_owned(), value.to_owned()))
        })
        .collect()
}

/// The signature AWS's signer makes of this request with this secret.
#[allow(clippy::too_many_arguments)]
fn recompute(
    access_key_id: &str,
    secret: &str,
    region: &str,
    service: &str,
    url: &str,
    headers: &[(String, String)],
    body: &[u8],
    at: SystemTime,
) -> Option<String> {
    let identity: Identity = Credentials::new(access_key_id, secret, None, None, "mock").into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(service)
        .time(at)
        .settings(SigningSettings::default())
        .build()
        .ok()?
        .into();
    let headers = headers.iter().map(|(n, v)| (n.as_str(), v.as_str()));
    let signable = SignableRequest::new("POST", url, headers, SignableBody::Bytes(body)).ok()?;
    Some(sign(signable, &params).ok()?.signature().to_owned())
}

impl Respond for Reply<'_> {
    /// AWS's request id; no rate-limit headers (`_view` is ignored).
    fn respond(
        &self,
        status: StatusCode,
        body: Body,
        content_type: &'static str,
        _view: Option<&LimitsView>,
    ) -> Response {
        let mut resp = super::reply::base(status, body, content_type);
        if let Ok(id) = HeaderValue::from_str(&self.request_id) {
            resp.headers_mut().insert("x-amzn-requestid", id);
        }
        resp
    }
}
