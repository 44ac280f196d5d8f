//! What the batch APIs share: the files and batches held in memory, and how a batch's
//! lines are processed — `lines_per_sec` from its creation, every `fail_every_nth` line
//! failing and every `expire_every_nth` line expiring — with the online endpoints' reply
//! bodies (and usage) for the lines that succeed, and their 400s for the lines the
//! endpoint refuses.

use std::collections::HashMap;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::config::ProviderKind;
use super::openai::{Embeddings, Moderation};
use super::openai_completions::Completion;
use super::openai_responses::Responses;
use super::request::{ChatRequest, MessagesRequest, input_tokens};
use super::{Inner, MockProvider, uuid_v7};

/// What the two batch APIs answer their own way: auth, not-found, the batch object.
pub(super) trait BatchApi {
    const KIND: ProviderKind;
    /// The request's project, or the error to answer (boxed: a response is large).
    fn project(inner: &Inner, headers: &HeaderMap) -> Result<usize, Box<Response>>;
    fn not_found(id: &str) -> Response;
    fn object(inner: &Inner, id: &str, b: &MockBatch) -> Value;
}

/// `GET` a batch of API `A`.
pub(super) async fn get_batch<A: BatchApi>(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    answer::<A>(&p, &headers, &id, false)
}

/// Cancel a batch of API `A`: lines processed so far keep their results.
pub(super) async fn cancel_batch<A: BatchApi>(
    State(p): State<MockProvider>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    answer::<A>(&p, &headers, &id, true)
}

/// The batch as of now (after cancelling it, if asked).
fn answer<A: BatchApi>(p: &MockProvider, headers: &HeaderMap, id: &str, cancel: bool) -> Response {
    let inner = &*p.inner;
    let project = match A::project(inner, headers) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let mut state = inner.batch_state();
    match state.touch(inner, id, project, A::KIND, cancel) {
        Some(b) => Json(A::object(inner, id, b)).into_response(),
        None => A::not_found(id),
    }
}

/// An uploaded or produced file (OpenAI Files API).
pub(super) struct StoredFile {
    pub project: usize,
    pub purpose: &'static str,
    pub filename: String,
    pub bytes: Vec<u8>,
    pub created_at: i64,
}

/// One request line of a batch.
pub(super) struct Line {
    pub custom_id: String,
    /// The endpoint body (OpenAI) or `params` (Anthropic).
    pub body: Value,
}

/// What became of a line.
pub(super) enum Fate {
    Succeeded(Value),
    Errored,
    /// Refused as the online endpoint refuses it: the message of its 400.
    Invalid(String),
    Expired,
    Canceled,
}

pub(super) struct MockBatch {
    pub kind: ProviderKind,
    pub project: usize,
    pub input_file_id: Option<String>,
    pub endpoint: String,
    pub metadata: Value,
    pub lines: Vec<Line>,
    pub created_ns: u64,
    pub cancel_ns: Option<u64>,
    /// Set once every line has its fate.
    pub ended: Option<Ended>,
}

pub(super) struct Ended {
    pub at_ns: u64,
    pub fates: Vec<Fate>,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
}

#[derive(Default)]
pub(super) struct BatchState {
    pub files: HashMap<String, StoredFile>,
    pub batches: HashMap<String, MockBatch>,
    /// Gemini's resumable uploads started and not yet finalized: (project, display name)
    /// by session id.
    pub uploads: HashMap<String, (usize, String)>,
}

impl MockBatch {
    /// Lines processed by `now_ns`.
    pub fn processed(&self, inner: &Inner, now_ns: u64) -> usize {
        let total = self.lines.len();
        if let Some(e) = &self.ended {
            return e
                .fates
                .iter()
                .filter(|f| !matches!(f, Fate::Expired | Fate::Canceled))
                .count();
        }
        let lps = inner.batch_config.lines_per_sec;
        if lps <= 0.0 {
            return total;
        }
        let until = self.cancel_ns.unwrap_or(now_ns).min(now_ns);
        let secs = until.saturating_sub(self.created_ns) as f64 / 1e9;
        ((secs * lps).floor() as usize).min(total)
    }

    /// Counts (succeeded, errored, expired, canceled) once ended; while running, all
    /// lines count as processing.
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let Some(e) = &self.ended else {
            return (0, 0, 0, 0);
        };
        let mut c = (0, 0, 0, 0);
        for f in &e.fates {
            match f {
                Fate::Succeeded(_) => c.0 += 1,
                Fate::Errored | Fate::Invalid(_) => c.1 += 1,
                Fate::Expired => c.2 += 1,
                Fate::Canceled => c.3 += 1,
            }
        }
        c
    }
}

impl BatchState {
    /// Batch `id` of `project` on `kind`'s API as of now, cancelled first if asked.
    pub fn touch(
        &mut self,
        inner: &Inner,
        id: &str,
        project: usize,
        kind: ProviderKind,
        cancel: bool,
    ) -> Option<&MockBatch> {
        let b = self
            .batches
            .get_mut(id)
            .filter(|b| b.project == project && b.kind == kind)?;
        if cancel && b.ended.is_none() {
            b.cancel_ns = Some(inner.clock.now_ns());
        }
        self.advance(inner, id);
        self.batches.get(id)
    }

    /// Brings batch `id` up to `now`: ends it when every line is processed (or, once
    /// cancelled, when those processed are), deciding each line's fate and, for OpenAI,
    /// writing its output and error files.
    pub fn advance(&mut self, inner: &Inner, id: &str) {
        let now = inner.clock.now_ns();
        let Some(b) = self.batches.get_mut(id) else { return };
        if b.ended.is_some() {
            return;
        }
        let processed = b.processed(inner, now);
        if processed < b.lines.len() && b.cancel_ns.is_none() {
            return;
        }
        let cfg = inner.batch_config;
        let nth = |n: u64, i: usize| n > 0 && (i as u64 + 1).is_multiple_of(n);
        let fates: Vec<Fate> = b
            .lines
            .iter()
            .enumerate()
            .map(|(i, line)| {
                if i >= processed {
                    Fate::Canceled
                } else if nth(cfg.fail_every_nth, i) {
                    Fate::Errored
                } else if nth(cfg.expire_every_nth, i) {
                    Fate::Expired
                } else {
                    match reply(inner, b.kind, &b.endpoint, &line.body) {
                        Ok(answer) => Fate::Succeeded(answer),
                        Err(message) => Fate::Invalid(message),
                    }
                }
            })
            .collect();
        let (mut output_file_id, mut error_file_id) = (None, None);
        if b.kind == ProviderKind::Gemini && b.input_file_id.is_some() {
            let name = format!("files/{}", &uuid_v7(inner).simple().to_string()[20..]);
            self.files.insert(
                name.clone(),
                StoredFile {
                    project: b.project,
                    purpose: "batch_output",
                    filename: format!("{id}_responses.jsonl"),
                    bytes: super::gemini_batch::responses_file(&b.lines, &fates),
                    created_at: inner.unix_secs(),
                },
            );
            output_file_id = Some(name);
        }
        if matches!(b.kind, ProviderKind::Openai | ProviderKind::Azure) {
            let (out, err) = openai_files(inner, &b.lines, &fates);
            let created_at = inner.unix_secs();
            for (bytes, slot) in [(out, &mut output_file_id), (err, &mut error_file_id)] {
                if bytes.is_empty() {
                    continue;
                }
                let fid = format!("file-{}", uuid_v7(inner).simple());
                self.files.insert(
                    fid.clone(),
                    StoredFile {
                        project: b.project,
                        purpose: "batch_output",
                        filename: format!("{id}_output.jsonl"),
                        bytes,
                        created_at,
                    },
                );
                *slot = Some(fid);
            }
        }
        b.ended = Some(Ended {
            at_ns: now,
            fates,
            output_file_id,
            error_file_id,
        });
    }
}

/// The online endpoint's reply to a line's body, with usage: a message (Anthropic), a
/// `GenerateContentResponse` (Gemini, whose `endpoint` is `models/{model}:generateContent`),
/// or the answer of the batch's `endpoint` (OpenAI, Azure); the message of its 400 when the
/// endpoint refuses the body.
fn reply(inner: &Inner, kind: ProviderKind, endpoint: &str, body: &Value) -> Result<Value, String> {
    match kind {
        ProviderKind::Anthropic => return Ok(message_reply(inner, body)),
        ProviderKind::Gemini => {
            let model = endpoint
                .trim_start_matches("models/")
                .split(':')
                .next()
                .unwrap_or_default();
            return super::gemini::batch_answer(inner, model, body);
        }
        _ => {}
    }
    // Azure names the endpoints without `/v1`.
    match endpoint.strip_prefix("/v1").unwrap_or(endpoint) {
        "/embeddings" => Ok(Embeddings::check(body)?.answer()),
        "/moderations" => Ok(Moderation::check(body)?.answer()),
        "/completions" => Ok(Completion::check(body)?.whole(inner)),
        "/responses" => Ok(Responses::check(body)?.whole(inner)),
        _ => Ok(chat_reply(inner, body)),
    }
}

/// A message answering a Messages request.
fn message_reply(inner: &Inner, body: &Value) -> Value {
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default();
    let req: Option<MessagesRequest> = serde_json::from_value(body.clone()).ok();
    let input = req
        .as_ref()
        .and_then(|r| Some(input_tokens(r.messages.as_ref()?, r.system.as_ref())))
        .unwrap_or(0);
    let max = req.as_ref().and_then(|r| r.max_tokens);
    let output = inner.completion_tokens(max);
    let stop = if output < inner.output_tokens {
        "max_tokens"
    } else {
        "end_turn"
    };
    let id = format!("msg_01{}", uuid_v7(inner).simple());
    let m = super::anthropic::message(inner, id, model, input, output, stop);
    serde_json::to_value(m).unwrap_or(Value::Null)
}

/// A chat completion answering a chat request.
fn chat_reply(inner: &Inner, body: &Value) -> Value {
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default();
    let req: Option<ChatRequest> = serde_json::from_value(body.clone()).ok();
    let input = req
        .as_ref()
        .and_then(|r| Some(input_tokens(r.messages.as_ref()?, None)))
        .unwrap_or(0);
    let max = req.as_ref().and_then(ChatRequest::max_out);
    let choices = req.as_ref().and_then(|r| r.choices().ok()).unwrap_or(1);
    let output = inner.completion_tokens(max);
    let finish = if output < inner.output_tokens {
        "length"
    } else {
        "stop"
    };
    let c = super::openai::completion(inner, model, input, output, choices, finish);
    serde_json::to_value(c).unwrap_or(Value::Null)
}

/// OpenAI's output file (succeeded lines) and error file (the others), as JSONL.
fn openai_files(inner: &Inner, lines: &[Line], fates: &[Fate]) -> (Vec<u8>, Vec<u8>) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    for (line, fate) in lines.iter().zip(fates) {
        let id = format!("batch_req_{}", uuid_v7(inner).simple());
        let request_id = format!("req_{}", super::hex_id(32));
        let (record, to) = match fate {
            Fate::Succeeded(body) => (
                serde_json::json!({"id": id, "custom_id": line.custom_id,
                    "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": null}),
                &mut out,
            ),
            Fate::Errored => (
                serde_json::json!({"id": id, "custom_id": line.custom_id,
                    "response": {"status_code": 500, "request_id": request_id, "body": {"error": {
                        "message": "The server had an error while processing your request. Sorry about that!",
                        "type": "server_error", "param": null, "code": null}}},
                    "error": null}),
                &mut err,
            ),
            Fate::Invalid(message) => (
                serde_json::json!({"id": id, "custom_id": line.custom_id,
                    "response": {"status_code": 400, "request_id": request_id, "body": {"error": {
                        "message": message, "type": "invalid_request_error", "param": null, "code": null}}},
                    "error": null}),
                &mut err,
            ),
            Fate::Expired => (
                serde_json::json!({"id": id, "custom_id": line.custom_id, "response": null,
                    "error": {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}}),
                &mut err,
            ),
            Fate::Canceled => (
                serde_json::json!({"id": id, "custom_id": line.custom_id, "response": null,
                    "error": {"code": "batch_cancelled", "message": "This request was not executed because the batch was cancelled."}}),
                &mut err,
            ),
        };
        to.extend_from_slice(record.to_string().as_bytes());
        to.push(b'\n');
    }
    (out, err)
}
