//! OpenAI's Files and Batch APIs (`docs/PROVIDERS.md` §1.5–1.6): `POST /v1/files` (multipart,
//! `purpose=batch`), `GET /v1/files/{id}/content`, `POST /v1/batches`,
//! `GET /v1/batches` (the list), `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`. Bearer keys as on the online
//! endpoint; a project sees only its own files and batches. Azure OpenAI's Global Batch
//! is the same API below `/openai` ([`Azure`]): `api-key` keys of an `azure` project, and
//! endpoints named without `/v1` (`/chat/completions`, `/embeddings`).

use std::collections::HashMap;

use axum::Json;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::batch_state::{BatchApi, Line, MockBatch, StoredFile};
use super::config::ProviderKind;
use super::openai::Embeddings;
use super::{Inner, KeyLookup, MockProvider, uuid_v7};

/// Most embedding inputs across the requests of one batch of embeddings.
const MAX_EMBEDDING_INPUTS: usize = 50_000;

/// The Files and Batch APIs as a host serves them: OpenAI's own ([`OpenAi`]) or Azure's
/// ([`Azure`]).
pub(super) trait FilesApi: BatchApi {
    /// The endpoints a batch may carry (one per batch), as the API names them.
    const ENDPOINTS: &'static [&'static str];
}

fn error(status: StatusCode, message: &str, code: Option<&str>) -> Response {
    let kind = if status == StatusCode::UNAUTHORIZED || status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    };
    (
        status,
        Json(json!({"error": {"message": message, "type": kind, "param": null, "code": code}})),
    )
        .into_response()
}

/// The project of the request's bearer key, or the 401 to answer.
/// The request's project, or the error to answer (boxed: a response is large).
fn project(inner: &Inner, headers: &HeaderMap) -> Result<usize, Box<Response>> {
    match super::openai::bearer(headers).map(|k| inner.lookup(ProviderKind::Openai, k)) {
        Some(KeyLookup::Valid(p)) => Ok(p),
        Some(_) => Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            "Incorrect API key provided.",
            Some("invalid_api_key"),
        ))),
        None => Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            "You didn't provide an API key.",
            None,
        ))),
    }
}

fn file_object(id: &str, f: &StoredFile) -> Value {
    json!({
        "id": id, "object": "file", "bytes": f.bytes.len(), "created_at": f.created_at,
        "filename": f.filename, "purpose": f.purpose, "status": "processed",
        "expires_at": null, "status_details": null,
    })
}

pub(super) async fn upload_file<A: FilesApi>(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    mut form: Multipart,
) -> Response {
    let inner = &*p.inner;
    let project = match A::project(inner, &headers) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let (mut purpose, mut file) = (None, None);
    loop {
        match form.next_field().await {
            Ok(Some(field)) => {
                let name = field.name().unwrap_or_default().to_owned();
                let filename = field.file_name().unwrap_or("upload.jsonl").to_owned();
                let Ok(bytes) = field.bytes().await else {
                    return error(StatusCode::BAD_REQUEST, "The upload could not be read.", None);
                };
                match name.as_str() {
                    "purpose" => purpose = Some(String::from_utf8_lossy(&bytes).into_owned()),
                    "file" => file = Some((filename, bytes.to_vec())),
                    _ => {}
                }
            }
            Ok(None) => break,
            Err(_) => return error(StatusCode::BAD_REQUEST, "The multipart body is malformed.", None),
        }
    }
    if purpose.as_deref() != Some("batch") {
        return error(StatusCode::BAD_REQUEST, "'purpose' must be 'batch'.", None);
    }
    let Some((filename, bytes)) = file else {
        return error(
            StatusCode::BAD_REQUEST,
            "Missing required parameter: 'file'.",
            None,
        );
    };
    let id = format!("file-{}", uuid_v7(inner).simple());
    let f = StoredFile {
        project,
        purpose: "batch",
        filename,
        bytes,
        created_at: inner.unix_secs(),
    };
    let body = file_object(&id, &f);
    inner.batch_state().files.insert(id, f);
    Json(body).into_response()
}

pub(super) async fn file_content<A: FilesApi>(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let inner = &*p.inner;
    let project = match A::project(inner, &headers) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let state = inner.batch_state();
    match state.files.get(&id).filter(|f| f.project == project) {
        Some(f) => ([("content-type", "application/octet-stream")], f.bytes.clone()).into_response(),
        None => error(StatusCode::NOT_FOUND, &format!("No such File object: {id}"), None),
    }
}

pub(super) async fn create_batch<A: FilesApi>(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let inner = &*p.inner;
    let project = match A::project(inner, &headers) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let (Some(input), Some(endpoint)) = (
        body.get("input_file_id").and_then(Value::as_str),
        body.get("endpoint").and_then(Value::as_str),
    ) else {
        return error(
            StatusCode::BAD_REQUEST,
            "Missing required parameter: 'input_file_id' or 'endpoint'.",
            None,
        );
    };
    if !A::ENDPOINTS.contains(&endpoint) {
        let message = format!(
            "Invalid value for 'endpoint': '{endpoint}'. Supported values are: {}.",
            A::ENDPOINTS
                .iter()
                .map(|e| format!("'{e}'"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        return error(StatusCode::BAD_REQUEST, &message, Some("invalid_value"));
    }
    if body.get("completion_window").and_then(Value::as_str) != Some("24h") {
        return error(StatusCode::BAD_REQUEST, "completion_window must be '24h'.", None);
    }
    let mut state = inner.batch_state();
    let Some(file) = state
        .files
        .get(input)
        .filter(|f| f.project == project && f.purpose == "batch")
    else {
        return error(
            StatusCode::NOT_FOUND,
            &format!("No such File object: {input}"),
            None,
        );
    };
    let mut lines = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, raw) in file.bytes.split(|b| *b == b'\n').enumerate() {
        if raw.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let parsed: Option<(String, Value)> = serde_json::from_slice::<Value>(raw).ok().and_then(|v| {
            let id = v.get("custom_id")?.as_str()?.to_owned();
            (v.get("url")?.as_str()? == endpoint && v.get("method")?.as_str()? == "POST")
                .then(|| Some((id, v.get("body")?.clone())))?
        });
        match parsed {
            Some((custom_id, body)) if seen.insert(custom_id.clone()) => lines.push(Line { custom_id, body }),
            _ => {
                let msg = format!(
                    "line {}: not a valid batch request line or a repeated custom_id",
                    i + 1
                );
                return error(StatusCode::BAD_REQUEST, &msg, Some("invalid_request"));
            }
        }
    }
    let inputs: usize = lines
        .iter()
        .map(|l| Embeddings::check(&l.body).map_or(1, |e| e.inputs()))
        .sum();
    if endpoint.ends_with("/embeddings") && inputs > MAX_EMBEDDING_INPUTS {
        let message = format!(
            "A batch of embeddings may hold at most {MAX_EMBEDDING_INPUTS} embedding inputs across its requests; this one has {inputs}."
        );
        return error(StatusCode::BAD_REQUEST, &message, Some("invalid_request"));
    }
    let id = format!("batch_{}", uuid_v7(inner).simple());
    let batch = MockBatch {
        kind: A::KIND,
        project,
        input_file_id: Some(input.to_owned()),
        endpoint: endpoint.to_owned(),
        metadata: body.get("metadata").cloned().unwrap_or(Value::Null),
        lines,
        created_ns: inner.clock.now_ns(),
        cancel_ns: None,
        ended: None,
    };
    state.batches.insert(id.clone(), batch);
    state.advance(inner, &id);
    Json(batch_object(inner, &id, &state.batches[&id])).into_response()
}

/// `GET /v1/batches`: the project's batches, newest first, `limit` (1–100, default 20)
/// at a time after the batch `after`, as OpenAI lists them.
pub(super) async fn list_batches<A: FilesApi>(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    Query(page): Query<HashMap<String, String>>,
) -> Response {
    let inner = &*p.inner;
    let project = match A::project(inner, &headers) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let limit = match page.get("limit").map(|l| l.parse::<usize>()) {
        None => 20,
        Some(Ok(l)) if (1..=100).contains(&l) => l,
        Some(_) => return error(StatusCode::BAD_REQUEST, "limit must be between 1 and 100.", None),
    };
    let mut state = inner.batch_state();
    // Ids are UUIDv7: newest first is descending order.
    let mut ids: Vec<String> = state
        .batches
        .iter()
        .filter(|(_, b)| b.project == project && b.kind == A::KIND)
        .map(|(id, _)| id.clone())
        .collect();
    ids.sort_unstable_by(|a, b| b.cmp(a));
    let start = page
        .get("after")
        .and_then(|after| ids.iter().position(|id| id == after).map(|i| i + 1))
        .unwrap_or(0);
    let page_ids: Vec<String> = ids.iter().skip(start).take(limit).cloned().collect();
    let mut data = Vec::with_capacity(page_ids.len());
    for id in &page_ids {
        state.advance(inner, id);
        data.push(batch_object(inner, id, &state.batches[id]));
    }
    Json(json!({
        "object": "list",
        "data": data,
        "first_id": page_ids.first(),
        "last_id": page_ids.last(),
        "has_more": start + page_ids.len() < ids.len(),
    }))
    .into_response()
}

/// OpenAI's own Files and Batch APIs (and their batch routes: `batch_state::get_batch`,
/// `batch_state::cancel_batch`).
pub(super) struct OpenAi;

impl FilesApi for OpenAi {
    const ENDPOINTS: &'static [&'static str] = &[
        "/v1/responses",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/completions",
        "/v1/moderations",
    ];
}

/// Azure OpenAI's Global Batch: the same API, `api-key` keys of an `azure` project.
pub(super) struct Azure;

impl FilesApi for Azure {
    const ENDPOINTS: &'static [&'static str] = &["/chat/completions", "/embeddings"];
}

impl BatchApi for Azure {
    const KIND: ProviderKind = ProviderKind::Azure;

    fn project(inner: &Inner, headers: &HeaderMap) -> Result<usize, Box<Response>> {
        let key = headers
            .get("api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        match key.map(|k| inner.lookup(ProviderKind::Azure, k)) {
            Some(KeyLookup::Valid(p)) => Ok(p),
            _ => Err(Box::new(error(
                StatusCode::UNAUTHORIZED,
                "Access denied due to invalid subscription key or wrong API endpoint.",
                Some("401"),
            ))),
        }
    }

    fn not_found(id: &str) -> Response {
        OpenAi::not_found(id)
    }

    fn object(inner: &Inner, id: &str, b: &MockBatch) -> Value {
        batch_object(inner, id, b)
    }
}

impl BatchApi for OpenAi {
    const KIND: ProviderKind = ProviderKind::Openai;

    fn project(inner: &Inner, headers: &HeaderMap) -> Result<usize, Box<Response>> {
        project(inner, headers)
    }

    fn not_found(id: &str) -> Response {
        error(
            StatusCode::NOT_FOUND,
            &format!("No such Batch object: {id}"),
            None,
        )
    }

    fn object(inner: &Inner, id: &str, b: &MockBatch) -> Value {
        batch_object(inner, id, b)
    }
}

fn batch_object(inner: &Inner, id: &str, b: &MockBatch) -> Value {
    let secs = |ns: u64| i64::try_from(inner.clock.unix_ns_at(ns).div_euclid(1_000_000_000)).unwrap_or(0);
    let created = secs(b.created_ns);
    let total = b.lines.len();
    let (succeeded, errored, expired, canceled) = b.counts();
    let status = match (&b.ended, b.cancel_ns) {
        (None, None) => "in_progress",
        (None, Some(_)) => "cancelling",
        (Some(_), Some(_)) => "cancelled",
        (Some(_), None) if expired > 0 => "expired",
        (Some(_), None) => "completed",
    };
    let ended_at = b.ended.as_ref().map(|e| secs(e.at_ns));
    let at = |s: &str| if status == s { ended_at } else { None };
    json!({
        "id": id, "object": "batch", "endpoint": b.endpoint, "errors": null,
        "input_file_id": b.input_file_id, "completion_window": "24h", "status": status,
        "output_file_id": b.ended.as_ref().and_then(|e| e.output_file_id.clone()),
        "error_file_id": b.ended.as_ref().and_then(|e| e.error_file_id.clone()),
        "created_at": created, "in_progress_at": created, "expires_at": created + 86_400,
        "finalizing_at": ended_at, "completed_at": at("completed"), "failed_at": null,
        "expired_at": at("expired"), "cancelling_at": b.cancel_ns.map(secs), "cancelled_at": at("cancelled"),
        "request_counts": {
            "total": total,
            "completed": if b.ended.is_some() { succeeded } else { b.processed(inner, inner.clock.now_ns()) },
            "failed": errored + expired + canceled,
        },
        "metadata": b.metadata,
    })
}
