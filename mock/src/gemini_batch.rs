//! Gemini Batch Mode (`docs/PROVIDERS.md` §3) and the Files API it reads: `POST
//! /v1beta/models/{model}:batchGenerateContent` with `{"batch": {displayName, inputConfig}}`
//! — inline (`requests.requests[]`, each `{request, metadata}`) or a JSONL file of
//! `{"key", "request"}` lines (`fileName`) — answered with the long-running operation
//! `batches/{id}` (`metadata`: state, `batchStats` with int64s as strings, `output`);
//! `GET /v1beta/batches/{id}`, `GET /v1beta/batches` (`operations`),
//! `POST /v1beta/batches/{id}:cancel`. An inline batch's answers come in its `output`
//! (`inlinedResponses`, in order, each with its request's `metadata`); a file batch's in a
//! responses file of `{"key", "response" | "error"}` lines read from
//! `GET /download/v1beta/files/{id}:download?alt=media`. Files are uploaded with Google's
//! resumable protocol: `POST /upload/v1beta/files` with `x-goog-upload-command: start`
//! answers `x-goog-upload-url`, to which the bytes go with `upload, finalize`. Lines are
//! answered as `generateContent` answers them, outside the online limits; a project sees
//! only its own batches and files.

use std::collections::HashMap;

use axum::Json;
use axum::body::{Body, to_bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat};
use serde_json::{Value, json};

use super::batch_state::{Fate, Line, MockBatch, StoredFile};
use super::config::ProviderKind;
use super::gemini::{authenticate, error};
use super::{Inner, MAX_BODY_BYTES, MockProvider, uuid_v7};

type Q = Query<HashMap<String, String>>;

fn bad_request(inner: &Inner, message: &str) -> Response {
    error(inner, StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", message)
}

fn not_found(inner: &Inner, what: &str) -> Response {
    error(
        inner,
        StatusCode::NOT_FOUND,
        "NOT_FOUND",
        &format!("Requested entity was not found: {what}."),
    )
}

/// `models/{model}:batchGenerateContent`, its caller authenticated as `project`.
pub(super) async fn create(inner: &Inner, project: usize, model: &str, body: Body) -> Response {
    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        return bad_request(inner, "The request body could not be read.");
    };
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        return bad_request(inner, "Invalid JSON payload received.");
    };
    let batch = &body["batch"];
    let Some(display_name) = batch["displayName"].as_str().filter(|n| !n.is_empty()) else {
        return bad_request(
            inner,
            "* BatchGenerateContentRequest.batch.display_name: required\n",
        );
    };
    if !inner.model_allowed(project, model) {
        return not_found(inner, &format!("models/{model}"));
    }
    let input = &batch["inputConfig"];
    let (lines, input_file_id, line_metadata) = match (
        input["requests"]["requests"].as_array(),
        input["fileName"].as_str(),
    ) {
        (Some(requests), None) if !requests.is_empty() => {
            let mut lines = Vec::with_capacity(requests.len());
            for (i, r) in requests.iter().enumerate() {
                let Some(request) = r.get("request").filter(|r| r.is_object()) else {
                    return bad_request(
                        inner,
                        &format!("* inputConfig.requests.requests[{i}].request: required\n"),
                    );
                };
                lines.push(Line {
                    custom_id: i.to_string(),
                    body: request.clone(),
                });
            }
            let metadata: Vec<Value> = requests.iter().map(|r| r["metadata"].clone()).collect();
            (lines, None, metadata)
        }
        (None, Some(file)) => {
            let state = inner.batch_state();
            let Some(f) = state.files.get(file).filter(|f| f.project == project) else {
                return not_found(inner, file);
            };
            let mut lines = Vec::new();
            for (i, l) in f
                .bytes
                .split(|b| *b == b'\n')
                .filter(|l| !l.is_empty())
                .enumerate()
            {
                let parsed: Option<Value> = serde_json::from_slice(l).ok();
                let key = parsed.as_ref().and_then(|v| v["key"].as_str()).map(str::to_owned);
                let request = parsed.as_ref().map(|v| &v["request"]).filter(|r| r.is_object());
                let (Some(key), Some(request)) = (key, request) else {
                    return bad_request(
                        inner,
                        &format!("line {}: each line needs a `key` and a `request`", i + 1),
                    );
                };
                lines.push(Line {
                    custom_id: key,
                    body: request.clone(),
                });
            }
            if lines.is_empty() {
                return bad_request(inner, "the input file holds no requests");
            }
            (lines, Some(file.to_owned()), Vec::new())
        }
        _ => {
            return bad_request(
                inner,
                "* BatchGenerateContentRequest.batch.input_config: exactly one of `requests` (non-empty) or `file_name` is required\n",
            );
        }
    };
    let id = format!("batches/{}", uuid_v7(inner).simple());
    let mut state = inner.batch_state();
    state.batches.insert(
        id.clone(),
        MockBatch {
            kind: ProviderKind::Gemini,
            project,
            input_file_id,
            endpoint: format!("models/{model}:generateContent"),
            metadata: json!({"displayName": display_name, "lines": line_metadata}),
            lines,
            created_ns: inner.clock.now_ns(),
            cancel_ns: None,
            ended: None,
        },
    );
    state.advance(inner, &id);
    Json(operation(inner, &id, &state.batches[&id])).into_response()
}

/// `GET /v1beta/batches/{id}`.
pub(super) async fn get_batch(
    State(p): State<MockProvider>,
    Path(id): Path<String>,
    Query(query): Q,
    headers: HeaderMap,
) -> Response {
    match touch(&p.inner, &headers, &query, &id, false) {
        Ok(operation) => Json(operation).into_response(),
        Err(refused) => *refused,
    }
}

/// `POST /v1beta/batches/{id}:cancel`: lines answered so far keep their answers.
pub(super) async fn cancel_batch(
    State(p): State<MockProvider>,
    Path(id_action): Path<String>,
    Query(query): Q,
    headers: HeaderMap,
) -> Response {
    let Some(id) = id_action.strip_suffix(":cancel") else {
        return not_found(&p.inner, &format!("batches/{id_action}"));
    };
    match touch(&p.inner, &headers, &query, id, true) {
        Ok(_) => Json(json!({})).into_response(),
        Err(refused) => *refused,
    }
}

/// Batch `batches/{id}` of the caller's project as of now (cancelled first if asked), as
/// an operation; else the error to answer.
fn touch(
    inner: &Inner,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
    id: &str,
    cancel: bool,
) -> Result<Value, Box<Response>> {
    let project = authenticate(inner, headers, query)?;
    let name = format!("batches/{id}");
    let mut state = inner.batch_state();
    match state.touch(inner, &name, project, ProviderKind::Gemini, cancel) {
        Some(b) => Ok(operation(inner, &name, b)),
        None => Err(Box::new(not_found(inner, &name))),
    }
}

/// `GET /v1beta/batches`: the project's batches, newest first.
pub(super) async fn list_batches(
    State(p): State<MockProvider>,
    Query(query): Q,
    headers: HeaderMap,
) -> Response {
    let inner = &*p.inner;
    let project = match authenticate(inner, &headers, &query) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let size = query
        .get("pageSize")
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(50)
        .clamp(1, 1000);
    let state = inner.batch_state();
    let mut mine: Vec<(&String, &MockBatch)> = state
        .batches
        .iter()
        .filter(|(_, b)| b.kind == ProviderKind::Gemini && b.project == project)
        .collect();
    mine.sort_by_key(|(id, _)| std::cmp::Reverse(*id));
    let operations: Vec<Value> = mine
        .into_iter()
        .take(size)
        .map(|(id, b)| operation(inner, id, b))
        .collect();
    Json(json!({"operations": operations})).into_response()
}

/// `POST /upload/v1beta/files`: a resumable upload's `start` (authenticated by key), then
/// its `upload, finalize` at the session URL it answered (authenticated by the session).
pub(super) async fn upload(State(p): State<MockProvider>, Query(query): Q, req: Request) -> Response {
    let inner = &*p.inner;
    let (parts, body) = req.into_parts();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    };
    let command = header("x-goog-upload-command").to_owned();
    if command == "start" {
        let project = match authenticate(inner, &parts.headers, &query) {
            Ok(p) => p,
            Err(refused) => return *refused,
        };
        if header("x-goog-upload-protocol") != "resumable" {
            return bad_request(inner, "The mock takes uploads by the resumable protocol only.");
        }
        let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
            return bad_request(inner, "The request body could not be read.");
        };
        let meta: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let display = meta["file"]["displayName"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let session = uuid_v7(inner).simple().to_string();
        let host = header("host").to_owned();
        inner
            .batch_state()
            .uploads
            .insert(session.clone(), (project, display));
        return (
            [
                ("x-goog-upload-status", "active".to_owned()),
                (
                    "x-goog-upload-url",
                    format!(
                        "http://{host}/upload/v1beta/files?upload_id={session}&upload_protocol=resumable"
                    ),
                ),
            ],
            "",
        )
            .into_response();
    }
    let Some((project, display)) = query
        .get("upload_id")
        .and_then(|s| inner.batch_state().uploads.remove(s))
    else {
        return not_found(inner, "upload session");
    };
    if command != "upload, finalize" || header("x-goog-upload-offset") != "0" {
        return bad_request(
            inner,
            "The mock takes a file in one chunk: `upload, finalize` at offset 0.",
        );
    }
    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        return bad_request(inner, "The request body could not be read.");
    };
    let name = format!("files/{}", &uuid_v7(inner).simple().to_string()[20..]);
    let file = file_object(&name, &display, bytes.len(), inner.unix_secs(), "UPLOADED");
    inner.batch_state().files.insert(
        name,
        StoredFile {
            project,
            purpose: "batch",
            filename: display,
            bytes: bytes.to_vec(),
            created_at: inner.unix_secs(),
        },
    );
    ([("x-goog-upload-status", "final")], Json(json!({"file": file}))).into_response()
}

/// `GET /download/v1beta/files/{id}:download?alt=media`: a file the batches produced.
pub(super) async fn download(
    State(p): State<MockProvider>,
    Path(id_action): Path<String>,
    Query(query): Q,
    headers: HeaderMap,
) -> Response {
    let inner = &*p.inner;
    let project = match authenticate(inner, &headers, &query) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let name = format!(
        "files/{}",
        id_action.strip_suffix(":download").unwrap_or(&id_action)
    );
    if query.get("alt").map(String::as_str) != Some("media") {
        return bad_request(inner, "Download with `alt=media`.");
    }
    let state = inner.batch_state();
    match state
        .files
        .get(&name)
        .filter(|f| f.project == project && f.purpose == "batch_output")
    {
        Some(f) => ([("content-type", "application/octet-stream")], f.bytes.clone()).into_response(),
        None => not_found(inner, &name),
    }
}

/// A Files API `File` object.
fn file_object(name: &str, display: &str, size: usize, created: i64, source: &str) -> Value {
    let stamp = DateTime::from_timestamp(created, 0).map(|t| t.to_rfc3339_opts(SecondsFormat::Secs, true));
    json!({"name": name, "displayName": display, "mimeType": "application/jsonl",
           "sizeBytes": size.to_string(), "createTime": stamp, "updateTime": stamp,
           "state": "ACTIVE", "source": source})
}

/// A line's answer as Batch Mode gives it: `{"response"}` or `{"error"}` (a
/// `google.rpc.Status`); `None` for a line cancelled before it ran.
fn answer_of(fate: &Fate) -> Option<Value> {
    let status = |code: u16, name: &str, message: &str| json!({"error": {"code": code, "message": message, "status": name}});
    Some(match fate {
        Fate::Succeeded(response) => json!({"response": response}),
        Fate::Errored => status(500, "INTERNAL", "An internal error has occurred."),
        Fate::Invalid(message) => status(400, "INVALID_ARGUMENT", message),
        Fate::Expired => status(
            504,
            "DEADLINE_EXCEEDED",
            "The request was not processed before the batch expired.",
        ),
        Fate::Canceled => return None,
    })
}

/// The responses file of a file batch's lines: `{"key", "response" | "error"}` each.
pub(super) fn responses_file(lines: &[Line], fates: &[Fate]) -> Vec<u8> {
    let mut out = Vec::new();
    for (line, fate) in lines.iter().zip(fates) {
        if let Some(mut answer) = answer_of(fate) {
            answer["key"] = json!(line.custom_id);
            out.extend_from_slice(answer.to_string().as_bytes());
            out.push(b'\n');
        }
    }
    out
}

/// The batch as Google answers it: a long-running operation whose metadata is the
/// `GenerateContentBatch`; once ended, `done` with the output also as its `response`.
fn operation(inner: &Inner, name: &str, b: &MockBatch) -> Value {
    let stamp = |ns: u64| {
        let secs = i64::try_from(inner.clock.unix_ns_at(ns).div_euclid(1_000_000_000)).unwrap_or(0);
        DateTime::from_timestamp(secs, 0).map(|t| t.to_rfc3339_opts(SecondsFormat::Secs, true))
    };
    let total = b.lines.len();
    let now = inner.clock.now_ns();
    let (state, succeeded, failed) = match (&b.ended, b.cancel_ns) {
        (Some(_), cancel) => {
            let (ok, errored, expired, _) = b.counts();
            let state = if cancel.is_some() {
                "BATCH_STATE_CANCELLED"
            } else {
                "BATCH_STATE_SUCCEEDED"
            };
            (state, ok, errored + expired)
        }
        (None, _) => {
            let done = b.processed(inner, now);
            (
                if done == 0 {
                    "BATCH_STATE_PENDING"
                } else {
                    "BATCH_STATE_RUNNING"
                },
                done,
                0,
            )
        }
    };
    let mut metadata = json!({
        "@type": "type.googleapis.com/google.ai.generativelanguage.v1beta.GenerateContentBatch",
        "name": name,
        "model": b.endpoint.split(':').next(),
        "displayName": b.metadata["displayName"],
        "createTime": stamp(b.created_ns),
        "updateTime": stamp(b.ended.as_ref().map_or(now, |e| e.at_ns)),
        "state": state,
        "batchStats": {
            "requestCount": total.to_string(),
            "successfulRequestCount": succeeded.to_string(),
            "failedRequestCount": failed.to_string(),
            "pendingRequestCount": (total - succeeded - failed).to_string(),
        },
    });
    let mut op = json!({"name": name, "metadata": metadata.clone()});
    let Some(ended) = &b.ended else {
        return op;
    };
    let output = match &ended.output_file_id {
        Some(file) => json!({"responsesFile": file}),
        None => {
            let answers: Vec<Value> = ended
                .fates
                .iter()
                .zip(b.metadata["lines"].as_array().into_iter().flatten())
                .filter_map(|(fate, meta)| {
                    let mut answer = answer_of(fate)?;
                    if !meta.is_null() {
                        answer["metadata"] = meta.clone();
                    }
                    Some(answer)
                })
                .collect();
            json!({"inlinedResponses": {"inlinedResponses": answers}})
        }
    };
    metadata["endTime"] = json!(stamp(ended.at_ns));
    metadata["output"] = output.clone();
    op["metadata"] = metadata;
    op["done"] = json!(true);
    let mut response = output;
    response["@type"] =
        json!("type.googleapis.com/google.ai.generativelanguage.v1beta.GenerateContentBatchOutput");
    op["response"] = response;
    op
}
