//! `GET /openapi.json`: the OpenAPI 3.1 description of the API, generated from the code.
//!
//! Each handler carries its `#[utoipa::path]` (method, path, parameters, responses); the
//! router is built from those annotations ([`crate::routes`], utoipa-axum's `routes!`), so
//! a route and its description are declared once, together. Adding an endpoint is:
//! annotate the handler, add `.routes(routes!(module::handler))` in [`crate::routes`]. This
//! module holds the document's frame (title, security, error responses every endpoint
//! shares) and the schemas of bodies whose handlers build JSON by hand.

use std::sync::OnceLock;

use axum::Json;
use axum::response::IntoResponse;
use serde::Serialize;
use serde_json::Value;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{OpenApi as Document, RefOr, Response, ResponseBuilder};
use utoipa::{Modify, OpenApi, ToSchema};

use tollgate::vocab::{ApiErrorCode, ReasonCode};

/// The document's frame; the paths come from the router.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "tollgate",
        description = "A durable job-queue broker for LLM API work: submit jobs, poll or long-poll their results, call the OpenAI-compatible endpoint, see the limits, queues and metrics.",
    ),
    modifiers(&Frame),
    components(schemas(ErrorBody, ErrorDetail, ApiErrorCode, ReasonCode)),
    tags(
        (name = "jobs", description = "Queued LLM requests"),
        (name = "openai", description = "The OpenAI-compatible surface"),
        (name = "anthropic", description = "The Anthropic-compatible surface"),
        (name = "limits", description = "Buckets, queues and status"),
        (name = "operations", description = "Health, metrics, dashboard, this document"),
        (name = "admin", description = "The control plane (the admin key only): tenants and their API keys"),
    )
)]
pub struct ApiDoc;

/// Adds the bearer scheme and the error answers every authenticated endpoint can give.
struct Frame;

impl Modify for Frame {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A tenant API key (`tenants[].api_key`), or the admin key (`server.admin_key`) where the endpoint says so",
                    ))
                    .build(),
            ),
        );
    }
}

/// The error answers shared by every authenticated endpoint, added to each operation that
/// declares `security`. Runs after the paths are known ([`document`]).
fn add_common_errors(doc: &mut Document) {
    let error = |description: &str| -> RefOr<Response> {
        RefOr::T(
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    utoipa::openapi::ContentBuilder::new()
                        .schema(Some(utoipa::openapi::Ref::from_schema_name("ErrorBody")))
                        .build(),
                )
                .build(),
        )
    };
    for item in doc.paths.paths.values_mut() {
        for op in [
            &mut item.get,
            &mut item.post,
            &mut item.put,
            &mut item.delete,
            &mut item.patch,
        ]
        .into_iter()
        .flatten()
        {
            let responses = &mut op.responses.responses;
            if op.security.is_some() {
                responses
                    .entry("401".into())
                    .or_insert_with(|| error("`missing_api_key` or `invalid_api_key`"));
            }
            responses.entry("500".into()).or_insert_with(|| {
                error("`internal_error`: nothing internal is disclosed; the request may be retried")
            });
            responses
                .entry("503".into())
                .or_insert_with(|| error("`database_unavailable` (with `Retry-After`)"));
        }
    }
}

/// The whole document: the frame, every routed path, the shared errors. Built once.
pub fn document() -> &'static Document {
    static DOC: OnceLock<Document> = OnceLock::new();
    DOC.get_or_init(|| {
        let (_, mut doc) = crate::routes().split_for_parts();
        add_common_errors(&mut doc);
        doc
    })
}

/// The OpenAPI 3.1 document of this API.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document", content_type = "application/json", body = Object))
)]
pub(crate) async fn openapi_json() -> impl IntoResponse {
    Json(document().clone())
}

/// Every error body: OpenAI's shape, so OpenAI SDKs surface it as is.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Safe, human-readable; 5xx messages never carry internals.
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `permission_error`,
    /// `not_found_error`, `rate_limit_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The field at fault, when one is (`request.messages[0].role`).
    pub param: Option<String>,
    pub code: ApiErrorCode,
    /// `deadline_unmeetable` at submission only: the earliest deadline the work would be
    /// accepted with now (its forecast p90).
    pub earliest_feasible_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// `POST /v1/jobs` body.
#[derive(ToSchema)]
#[schema(as = SubmitJob)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct SubmitJobSchema {
    /// What `request` is: `/v1/chat/completions` (default), `/v1/embeddings`,
    /// `/v1/moderations`, `/v1/responses`, `/v1/completions` or `/v1/messages` (an Anthropic
    /// Messages body).
    endpoint: Option<tollgate::vocab::Endpoint>,
    /// The endpoint's OpenAI body; `model` is a route alias, `provider/model`, or a model a
    /// provider lists.
    #[schema(value_type = Object)]
    request: Value,
    /// `interactive` | `standard` (default) | `background` | `batch`.
    #[schema(value_type = Option<String>, example = "standard")]
    class: Option<String>,
    /// RFC 3339; a job still queued at its deadline fails `deadline_exceeded`. A deadline
    /// set here is checked against the job's forecast: one forecast to finish after it
    /// (p90) is refused `422 deadline_unmeetable` with `earliest_feasible_at`.
    deadline: Option<chrono::DateTime<chrono::Utc>>,
    /// −1000..1000, higher first within a class.
    priority: Option<i32>,
    /// Per tenant; also accepted as the `Idempotency-Key` header.
    idempotency_key: Option<String>,
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
    /// `refuse` (default): a deadline the forecast cannot meet is refused; `accept`: the job
    /// is queued anyway (the gate still fails it if it cannot start in time).
    #[schema(value_type = Option<String>, example = "refuse")]
    on_deadline_risk: Option<String>,
}

/// `POST /v1/jobs/bulk`'s body.
#[derive(ToSchema)]
#[schema(as = BulkSubmit)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct BulkSubmitSchema {
    /// 1 to `server.max_bulk_jobs` jobs, each as `POST /v1/jobs` takes it.
    jobs: Vec<SubmitJobSchema>,
}

/// One job of a bulk submission, in the order sent.
#[derive(ToSchema)]
#[schema(as = BulkAcceptedJob)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct BulkAcceptedJobSchema {
    #[schema(format = Uuid)]
    id: String,
    /// An earlier job with the same idempotency key and request.
    existing: bool,
    /// `{"p50", "p90"}` (RFC 3339): when the job is forecast to finish; null without a
    /// forecast and for a replay.
    #[schema(value_type = Option<Object>)]
    eta: Option<Value>,
}

/// `POST /v1/jobs/bulk`'s answer.
#[derive(ToSchema)]
#[schema(as = BulkAccepted)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct BulkAcceptedSchema {
    /// Always `list`.
    object: String,
    data: Vec<BulkAcceptedJobSchema>,
    /// Jobs queued by this request.
    created: u64,
    /// Idempotent replays among them.
    existing: u64,
}

/// A job as clients see it (`jobs::job_view`; a test keeps the two alike).
#[derive(ToSchema)]
#[schema(as = Job)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct JobSchema {
    #[schema(format = Uuid)]
    id: String,
    /// Always `job`.
    object: String,
    /// The tenant whose job it is.
    tenant: String,
    /// `queued` → `admitted` → `running` → `succeeded` | `failed` | `cancelled`.
    state: String,
    class: String,
    priority: i32,
    endpoint: tollgate::vocab::Endpoint,
    /// As requested: a route alias, `provider/model`, or a model a provider lists.
    model: String,
    provider: Option<String>,
    provider_model: Option<String>,
    provider_request_id: Option<String>,
    /// Route targets (`provider/model`) that failed the job and are left out while the
    /// route has others (fallback).
    failed_targets: Option<Vec<String>>,
    attempts: i32,
    max_attempts: i32,
    deadline: chrono::DateTime<chrono::Utc>,
    /// While queued for a retry: not before this time.
    not_before: Option<chrono::DateTime<chrono::Utc>>,
    created_at: chrono::DateTime<chrono::Utc>,
    admitted_at: Option<chrono::DateTime<chrono::Utc>>,
    started_at: Option<chrono::DateTime<chrono::Utc>>,
    finished_at: Option<chrono::DateTime<chrono::Utc>>,
    /// `{input_tokens, output_tokens}` estimated at submission.
    #[schema(value_type = Object)]
    estimate: Value,
    /// `{p50, p90}` (RFC 3339): when it was forecast at submission to finish, from the work
    /// queued ahead of it, the limits on its path and its lane's observed latency; `null`
    /// when it was not forecast (a batch's line: see the batch's `eta`).
    #[schema(value_type = Option<Object>)]
    eta: Option<Value>,
    /// `{input_tokens, output_tokens, cached_tokens}` as the provider reported them.
    #[schema(value_type = Option<Object>)]
    usage: Option<Value>,
    /// The response, in OpenAI chat format (Anthropic's too).
    #[schema(value_type = Option<Object>)]
    result: Option<Value>,
    /// `{code, message}`: why it failed (`JobErrorCode`), or the last attempt's error while
    /// it waits for a retry.
    #[schema(value_type = Option<Object>)]
    error: Option<Value>,
    /// While queued: why it waits (`reason`, `bucket`, `limit`, `remaining`, `needs`,
    /// `expected_at`; `scope` when a pause holds it).
    #[schema(value_type = Option<Object>)]
    admission: Option<Value>,
    /// Each change of why it waited (the `admission` notes, each with `at`), the last 20.
    #[schema(value_type = Vec<Object>)]
    admission_history: Vec<Value>,
    /// The batch it is a line of (`null`: submitted on its own).
    batch_id: Option<String>,
    /// The request as submitted (`GET /v1/jobs/{id}` only; lists leave it out).
    #[schema(value_type = Option<Object>)]
    request: Option<Value>,
    idempotency_key: Option<String>,
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
    /// The id of the API key it was submitted with (`GET /v1/admin/tenants/{tenant}/keys`).
    api_key: Option<uuid::Uuid>,
    /// The id of its OpenTelemetry trace (its submission, admissions and attempts); null
    /// when jobs are not traced (no `OTEL_EXPORTER_OTLP_ENDPOINT`).
    trace_id: Option<String>,
    /// `{via, reason, provider_batch_id}`: `online` or `provider_batch` (the provider's own
    /// batch API), why (`deadline_allows_batch_api`, `deadline_too_close_for_batch_api`,
    /// `route_has_no_batch_api`, `endpoint_not_batched`,
    /// `provider_batch_failed_retry_online`; null when not decided), and the provider batch
    /// that carries or carried it.
    #[schema(value_type = Object)]
    dispatch: Value,
    /// `{reserved_usd, charged_usd, price_source, lane}`: what its estimate cost when it
    /// was admitted (what its budgets held; null until admitted), what its attempts cost
    /// at the configured prices (a provider-batch line at the batch discount; null until a
    /// provider answers one), where the price comes from (`model`: the provider's price
    /// for the model, `provider`: its `"*"` price, `unpriced`), and the lane that carried it.
    #[schema(value_type = Object)]
    cost: Value,
}

/// `GET /v1/jobs`: a page of jobs, newest first.
#[derive(ToSchema)]
#[schema(as = JobList)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct JobListSchema {
    object: String,
    data: Vec<JobSchema>,
    first_id: Option<String>,
    /// Pass as `after` for the next page.
    last_id: Option<String>,
    has_more: bool,
}

/// One bucket (one limit) and what remains in it now.
#[derive(ToSchema)]
#[schema(as = Limit)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct LimitSchema {
    /// `provider:oai:gpt-4o-mini:tpm`, `tenant:acme:daily_spend`, …
    bucket: String,
    /// `requests`, `input_tokens`, `output_tokens`, `total_tokens`, `concurrency`,
    /// `spend_micro_usd`.
    dimension: String,
    /// `rolling`, `fixed`, `gauge`, `ramp`.
    rule: String,
    capacity: f64,
    remaining: f64,
    window_secs: i64,
    resets_at: Option<chrono::DateTime<chrono::Utc>>,
    /// `configured`, `learned` (a provider's reading or its 429s set it), `probe` (a
    /// cold-start limit on calls in flight while nothing is known of a model's limits) or
    /// `pace` (requests a second to a model whose responses say nothing of its limits).
    source: String,
    /// What the config says, when a learned limit replaced it.
    configured_capacity: Option<f64>,
    learned_at: Option<chrono::DateTime<chrono::Utc>>,
}

#[derive(ToSchema)]
#[schema(as = LimitList)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct LimitListSchema {
    object: String,
    data: Vec<LimitSchema>,
    pools: Vec<PoolSchema>,
}

/// Keys of one provider model that share one quota: keys of one provider account (as
/// their responses named it: `openai-organization`, `anthropic-organization-id`), or all
/// of the model's keys while their accounts are not known apart.
#[derive(ToSchema)]
#[schema(as = Pool)]
#[allow(dead_code)] // a description, read by utoipa only
pub struct PoolSchema {
    provider: String,
    model: String,
    /// The account its keys serve under; null while not every key has named one.
    account: Option<String>,
    keys: Vec<String>,
    /// The scope of the pool's learned buckets (`provider:oai:gpt-4o-mini` for a model
    /// whose keys share one pool, `pool:oai:org-a:gpt-4o-mini` for one of several).
    scope: String,
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The paths the real router serves, read from its `Debug` output (axum lists them
    /// there; it offers no other way to enumerate routes).
    fn routed_paths() -> BTreeSet<String> {
        let (router, _) = crate::routes().split_for_parts();
        let debug = format!("{router:?}");
        // `paths: {RouteId(0): "/v1/jobs", RouteId(1): "/v1/jobs/{id}", …}`
        // Only the path router's: the fallback router lists the fallback's own catch-all.
        let at = debug
            .find("paths: {")
            .expect("axum's Router Debug lists its paths");
        let end = debug
            .find("fallback_router")
            .expect("axum's Router Debug lists its fallback router");
        debug[at..end]
            .split("RouteId(")
            .skip(1)
            .filter_map(|entry| entry.split_once("): \"").map(|(_, rest)| rest))
            .filter_map(|rest| rest.split_once('"').map(|(path, _)| path.to_owned()))
            .collect()
    }

    #[test]
    fn every_routed_path_is_described_and_every_described_path_is_routed() {
        let routed = routed_paths();
        assert!(
            routed.contains("/v1/jobs"),
            "could not read the router's paths: {routed:?}"
        );
        let described: BTreeSet<String> = document().paths.paths.keys().cloned().collect();
        assert_eq!(routed, described, "the router and /openapi.json disagree");
    }

    #[test]
    fn the_document_is_openapi_3_1_with_errors_and_reason_codes() {
        let doc = serde_json::to_value(document()).unwrap();
        assert!(
            doc["openapi"].as_str().unwrap().starts_with("3.1"),
            "{}",
            doc["openapi"]
        );
        let codes = doc["components"]["schemas"]["ErrorCode"]["enum"]
            .as_array()
            .unwrap();
        assert!(codes.iter().any(|c| c == "queue_full"), "{codes:?}");
        let reasons = doc["components"]["schemas"]["JobErrorCode"]["enum"]
            .as_array()
            .unwrap();
        assert!(reasons.iter().any(|c| c == "deadline_unmeetable"), "{reasons:?}");
        // Every operation answers with its errors; authenticated ones with 401 too.
        let submit = &doc["paths"]["/v1/jobs"]["post"];
        for status in ["400", "401", "429", "500", "503"] {
            assert!(
                submit["responses"][status].is_object(),
                "POST /v1/jobs lacks {status}"
            );
        }
        assert_eq!(submit["security"][0]["bearer"], serde_json::json!([]));
        // Client generators name methods by operation id: no two alike.
        let mut ids: Vec<&str> = doc["paths"]
            .as_object()
            .unwrap()
            .values()
            .flat_map(|item| item.as_object().unwrap().values())
            .map(|op| op["operationId"].as_str().unwrap())
            .collect();
        let all = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), all, "duplicate operation ids: {ids:?}");
    }
}
