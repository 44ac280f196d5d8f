//! OpenAI Chat Completions, Embeddings, Moderations and Responses, and every
//! OpenAI-compatible server (Groq, Mistral, Together, DeepSeek, vLLM, Ollama): `POST
//! {base_url}/{path}` with bearer auth ([`path`]). The client's request is already in this
//! format, and so are the answers and stream events: only the model is set, a chat or
//! Responses request given an output cap where it has none (the one the gate reserved:
//! `tollgate::estimate::output_cap`, `responses_output_cap`), and usage read out. Also the OpenAI
//! request readers the translating adapters share ([`content_text`], [`stop_sequences`]),
//! and OpenAI's batch API: the lines uploaded as a JSONL file (`POST {base_url}/files`), then
//! `POST {base_url}/batches`; results in the batch's output and error files.

use std::collections::HashMap;

use reqwest::RequestBuilder;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};
use tollgate::config::{ProviderConfig, ProviderKind};
use tollgate::estimate;
use tollgate::model::Usage;
use tollgate::retry::Failure;
use tollgate::vocab::{Endpoint, ReasonCode};

use super::batch_api::{BatchApi, LineResult, Status, Upload, UploadProtocol, by_custom_id, failed};
use super::sse::SseEvent;
use super::streaming::{self, StreamEvents, StreamOut};
use super::{Mode, ProviderApi, Success, int};

/// An OpenAI or OpenAI-compatible provider.
pub struct OpenAi {
    base_url: String,
    /// Where a request without an output cap gets one ([`cap_field`]).
    cap_field: &'static str,
    /// Its Files and Batch APIs.
    files_batch: FilesBatch,
}

impl OpenAi {
    pub fn from_config(p: &ProviderConfig) -> Self {
        let base_url = super::base_url(p);
        Self {
            files_batch: FilesBatch {
                root: base_url.clone(),
                query: String::new(),
                line_url: Endpoint::as_str,
                tags: true,
                cap_field: cap_field(p.kind),
            },
            base_url,
            cap_field: cap_field(p.kind),
        }
    }
}

/// OpenAI's Files and Batch APIs wherever they are served: OpenAI's own (and the servers
/// that copy them) below the API root, or an Azure OpenAI resource's below `/openai` with
/// its `api-version` on every URL and endpoints named without `/v1`.
pub(super) struct FilesBatch {
    /// `{root}/files`, `{root}/batches`.
    pub(super) root: String,
    /// Appended to every URL (`?api-version=…` on Azure; empty on OpenAI).
    pub(super) query: String,
    /// The endpoint a batch line (and the batch) names: OpenAI's `/v1/chat/completions`,
    /// Azure's `/chat/completions`.
    pub(super) line_url: fn(Endpoint) -> &'static str,
    /// Batches carry `metadata` (the pack's tag) and can be listed to be found by it.
    pub(super) tags: bool,
    /// The output cap's field in a line's body ([`cap_field`]).
    pub(super) cap_field: &'static str,
}

/// The field a request without an output cap is given one in: `max_completion_tokens` on
/// OpenAI's and Azure's APIs (`max_tokens` is deprecated there, and reasoning models refuse
/// it), `max_tokens` on OpenAI-compatible servers (the one they all read).
pub(super) fn cap_field(kind: ProviderKind) -> &'static str {
    match kind {
        ProviderKind::Openai | ProviderKind::Azure => "max_completion_tokens",
        _ => "max_tokens",
    }
}

impl ProviderApi for OpenAi {
    fn url(&self, _model: &str, endpoint: Endpoint, _mode: Mode) -> String {
        format!("{}/{}", self.base_url, path(endpoint))
    }

    fn authorize(&self, request: RequestBuilder, key: &SecretString) -> RequestBuilder {
        request.bearer_auth(key.expose_secret())
    }

    fn body(&self, model: &str, endpoint: Endpoint, request: &Value, mode: Mode) -> Value {
        body(model, endpoint, request, mode, self.cap_field)
    }

    fn parse_success(&self, body: &[u8], endpoint: Endpoint, _model: &str) -> Result<Success, String> {
        parse_success(body, endpoint)
    }

    fn stream_events(&self, endpoint: Endpoint, _model: &str) -> Option<Box<dyn StreamEvents>> {
        match endpoint {
            Endpoint::Responses => Some(Box::new(ResponseEvents)),
            _ => Some(Box::new(Chunks)),
        }
    }

    fn batch(&self) -> Option<&dyn BatchApi> {
        Some(&self.files_batch)
    }
}

/// An endpoint's path below the API root (`{base_url}/…`, an Azure deployment's URL).
pub(super) fn path(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::ChatCompletions => "chat/completions",
        Endpoint::Embeddings => "embeddings",
        Endpoint::Responses => "responses",
        Endpoint::Moderations => "moderations",
        Endpoint::Completions => "completions",
        // Sent to this family as chat (`ProviderKind::translates`); named for completeness.
        Endpoint::Messages => "messages",
    }
}

/// The client's request with the target's model. A chat request also gets, in
/// `cap_field`, the output cap the gate reserved when the request sets none, so the
/// provider cannot generate more; a whole call has the streaming fields removed; a stream
/// has `stream: true` and `stream_options.include_usage: true` (other stream options kept),
/// so that usage arrives in the last chunk. A Responses request gets its cap as
/// `max_output_tokens`, and `stream` as the mode says (its last event carries the usage).
pub(super) fn body(model: &str, endpoint: Endpoint, request: &Value, mode: Mode, cap_field: &str) -> Value {
    let mut body = request.clone();
    if let Some(obj) = body.as_object_mut() {
        obj.insert("model".to_owned(), Value::String(model.to_owned()));
        match endpoint {
            Endpoint::ChatCompletions => {}
            Endpoint::Responses => {
                obj.insert(
                    "max_output_tokens".to_owned(),
                    json!(estimate::responses_output_cap(request)),
                );
                match mode {
                    Mode::Whole => obj.remove("stream"),
                    Mode::Stream => obj.insert("stream".to_owned(), Value::Bool(true)),
                };
                return body;
            }
            Endpoint::Completions => {
                // The API's own default cap (16) is what the gate reserved when none is set.
                streaming_fields(obj, mode);
                return body;
            }
            Endpoint::Embeddings | Endpoint::Moderations | Endpoint::Messages => return body,
        }
        if !["max_completion_tokens", "max_tokens"]
            .iter()
            .any(|k| obj.get(*k).is_some_and(Value::is_i64))
        {
            obj.insert(cap_field.to_owned(), json!(estimate::output_cap(request)));
        }
        streaming_fields(obj, mode);
    }
    body
}

/// A chat or completions body's streaming fields as `mode` wants them: none for a whole
/// call; `stream: true` and `stream_options.include_usage: true` (other options kept) for a
/// stream, so that usage arrives in the last chunk.
fn streaming_fields(obj: &mut serde_json::Map<String, Value>, mode: Mode) {
    match mode {
        Mode::Whole => {
            obj.remove("stream");
            obj.remove("stream_options");
        }
        Mode::Stream => {
            obj.insert("stream".to_owned(), Value::Bool(true));
            let options = obj.entry("stream_options").or_insert_with(|| json!({}));
            if !options.is_object() {
                *options = json!({});
            }
            options["include_usage"] = Value::Bool(true);
        }
    }
}

/// The body is already in the format clients expect; only usage is read out (an
/// embeddings list reports input only; a response names its counts as Responses do).
pub(super) fn parse_success(body: &[u8], endpoint: Endpoint) -> Result<Success, String> {
    let body: Value = serde_json::from_slice(body)
        .map_err(|e| format!("provider answered 2xx with a body that is not JSON: {e}"))?;
    let answer = match endpoint {
        Endpoint::ChatCompletions | Endpoint::Completions => "choices",
        Endpoint::Embeddings => "data",
        Endpoint::Responses => "output",
        Endpoint::Moderations => "results",
        Endpoint::Messages => "content",
    };
    if body.get(answer).is_none() {
        return Err(format!("provider answered 2xx without `{answer}`"));
    }
    let u = body.get("usage").cloned().unwrap_or(Value::Null);
    let usage = match endpoint {
        Endpoint::Responses => responses_usage(&u),
        _ => Usage {
            input_tokens: int(&u, &["prompt_tokens"]),
            output_tokens: int(&u, &["completion_tokens"]),
            cached_tokens: int(&u, &["prompt_tokens_details", "cached_tokens"]),
        },
    };
    Ok(Success { body, usage })
}

/// A response's `usage` (`input_tokens`, `output_tokens` with reasoning in it, cached
/// input in `input_tokens_details`).
fn responses_usage(u: &Value) -> Usage {
    Usage {
        input_tokens: int(u, &["input_tokens"]),
        output_tokens: int(u, &["output_tokens"]),
        cached_tokens: int(u, &["input_tokens_details", "cached_tokens"]),
    }
}

/// OpenAI `stop` (a string or a list) as a list of stop sequences.
pub(super) fn stop_sequences(request: &Value) -> Option<Value> {
    match request.get("stop") {
        Some(Value::String(s)) => Some(json!([s])),
        Some(Value::Array(a)) => Some(Value::Array(a.clone())),
        _ => None,
    }
}

/// The text of a message's `content`: a string, or the `text` of its parts joined.
pub(super) fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// A Responses stream's events as they are (the relay names each by its `type`): text
/// deltas counted, the usage read from the final `response.completed` (or
/// `response.incomplete`), which ends the stream; `response.failed` and `error` events end
/// it as failures.
struct ResponseEvents;

impl StreamEvents for ResponseEvents {
    fn on_event(&mut self, event: SseEvent, out: &mut StreamOut) -> Result<(), Failure> {
        let v = out.json(&event.data)?;
        let kind = v.get("type").and_then(Value::as_str).unwrap_or_default();
        if kind == "response.failed" || streaming::is_error_event(&event, &v) {
            return Err(out.error_event(500, &event.data));
        }
        match kind {
            "response.output_text.delta" | "response.function_call_arguments.delta" => {
                out.content(v.get("delta").and_then(Value::as_str).unwrap_or_default());
            }
            "response.completed" | "response.incomplete" => {
                let usage = responses_usage(v.pointer("/response/usage").unwrap_or(&Value::Null));
                out.input(usage.input_tokens, usage.cached_tokens);
                out.output(usage.output_tokens);
                out.finish();
            }
            _ => {}
        }
        out.chunk(event.data.to_string());
        Ok(())
    }
}

/// OpenAI stream events are already OpenAI chunks: each is passed through as sent (with
/// the `"usage": null` the forced `include_usage` adds), content and usage counted; the
/// usage chunk (or `data: [DONE]`, when none comes) ends the stream.
pub(super) struct Chunks;

impl StreamEvents for Chunks {
    fn on_event(&mut self, event: SseEvent, out: &mut StreamOut) -> Result<(), Failure> {
        if event.data.trim() == "[DONE]" {
            out.finish();
            return Ok(());
        }
        let v = out.json(&event.data)?;
        if streaming::is_error_event(&event, &v) {
            return Err(out.error_event(stream_error_status(&v), &event.data));
        }
        for choice in v.get("choices").and_then(Value::as_array).into_iter().flatten() {
            // A chat chunk's delta, or a legacy completion chunk's text.
            let text = choice.pointer("/delta/content").or_else(|| choice.get("text"));
            if let Some(text) = text.and_then(Value::as_str) {
                out.content(text);
            }
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            out.input(
                int(u, &["prompt_tokens"]),
                int(u, &["prompt_tokens_details", "cached_tokens"]),
            );
            out.output(int(u, &["completion_tokens"]));
        }
        if is_usage_chunk(&v) {
            // The usage chunk is the stream's last: what a provider sends after it is not read.
            out.usage_chunk(event.data);
            out.finish();
        } else {
            out.chunk(event.data);
        }
        Ok(())
    }
}

/// The usage-only chunk OpenAI sends last when `include_usage` is set.
fn is_usage_chunk(v: &Value) -> bool {
    v.get("usage").is_some_and(Value::is_object)
        && v.get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty)
}

/// The HTTP status an error chunk's `error` stands for. OpenAI's own: rate limits by
/// `code` or by `type` (`requests`, `tokens`), `invalid_request_error`; other type names
/// as Anthropic uses them, which OpenAI-compatible servers (DeepSeek's
/// `authentication_error`, proxies in front of Claude) reuse.
fn stream_error_status(v: &Value) -> u16 {
    let field = |name: &str| v.get("error").and_then(|e| e.get(name)).and_then(Value::as_str);
    match (field("type"), field("code")) {
        (_, Some("rate_limit_exceeded")) | (Some("requests" | "tokens"), _) => 429,
        (Some("invalid_request_error"), _) => 400,
        (Some(other), _) => super::anthropic::error_type_status(other).unwrap_or(500),
        (None, _) => 500,
    }
}

impl BatchApi for FilesBatch {
    /// The lines as JSONL, `POST /files` as multipart (`purpose=batch`), built by hand:
    /// one file part.
    fn upload(
        &self,
        model: &str,
        endpoint: Endpoint,
        lines: &[(String, &Value)],
        tag: &str,
    ) -> Option<Upload> {
        let mut jsonl = Vec::new();
        for (id, r) in lines {
            let line = json!({"custom_id": id, "method": "POST", "url": (self.line_url)(endpoint),
                              "body": body(model, endpoint, r, Mode::Whole, self.cap_field)});
            jsonl.extend_from_slice(line.to_string().as_bytes());
            jsonl.push(b'\n');
        }
        let boundary = format!("tollgate-{}", uuid::Uuid::now_v7().simple());
        let mut body = Vec::with_capacity(jsonl.len() + 512);
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{tag}.jsonl\"\r\n\
                 Content-Type: application/jsonl\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(&jsonl);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        Some(Upload {
            url: format!("{}/files{}", self.root, self.query),
            protocol: UploadProtocol::Form {
                content_type: format!("multipart/form-data; boundary={boundary}"),
            },
            body,
        })
    }

    fn create(
        &self,
        _model: &str,
        endpoint: Endpoint,
        _lines: &[(String, &Value)],
        tag: &str,
        file_id: Option<&str>,
    ) -> (String, Value) {
        let mut body = json!({"input_file_id": file_id, "endpoint": (self.line_url)(endpoint),
                              "completion_window": "24h"});
        if self.tags {
            body["metadata"] = json!({"tollgate_pack": tag});
        }
        (format!("{}/batches{}", self.root, self.query), body)
    }

    fn status_url(&self, batch_id: &str) -> String {
        format!("{}/batches/{batch_id}{}", self.root, self.query)
    }

    fn parse_status(&self, b: &Value) -> Status {
        let s = |k: &str| b.get(k).and_then(Value::as_str).map(str::to_owned);
        let status = s("status").unwrap_or_default();
        let count = |k: &str| b.pointer(&format!("/request_counts/{k}")).and_then(Value::as_u64);
        let finished = count("completed").zip(count("failed")).map(|(c, f)| c + f);
        Status {
            ended: matches!(status.as_str(), "completed" | "failed" | "expired" | "cancelled"),
            progress: finished.zip(count("total")),
            status,
            result_files: [s("output_file_id"), s("error_file_id")]
                .into_iter()
                .flatten()
                .collect(),
        }
    }

    fn cancel_url(&self, batch_id: &str) -> String {
        format!("{}/batches/{batch_id}/cancel{}", self.root, self.query)
    }

    fn list_url(&self) -> Option<String> {
        self.tags.then(|| format!("{}/batches?limit=100", self.root))
    }

    fn tagged(&self, listing: &Value, tag: &str) -> Option<String> {
        listing["data"]
            .as_array()?
            .iter()
            .find(|b| b["metadata"]["tollgate_pack"] == tag)
            .and_then(|b| b["id"].as_str())
            .map(str::to_owned)
    }

    /// The output file (successes) and the error file (failures), where the batch has them.
    fn result_urls(&self, _batch_id: &str, status: &Status) -> Vec<String> {
        status
            .result_files
            .iter()
            .map(|file| format!("{}/files/{file}/content{}", self.root, self.query))
            .collect()
    }

    fn parse_results(&self, endpoint: Endpoint, body: &[u8], out: &mut HashMap<String, LineResult>) {
        by_custom_id(body, out, |line| line_result(line, endpoint));
    }
}

/// One line of an output or error file of a batch of `endpoint`.
fn line_result(line: &Value, endpoint: Endpoint) -> LineResult {
    let response = line.get("response").filter(|r| !r.is_null());
    let code = response
        .and_then(|r| r.get("status_code"))
        .and_then(Value::as_u64);
    match (response, code) {
        (Some(resp), Some(200)) => match parse_success(resp["body"].to_string().as_bytes(), endpoint) {
            Ok(success) => LineResult::Succeeded {
                success,
                request_id: resp.get("request_id").and_then(Value::as_str).map(str::to_owned),
            },
            Err(message) => failed(ReasonCode::ProviderBadResponse, message),
        },
        (Some(resp), code) => {
            let message = resp["body"]["error"]["message"]
                .as_str()
                .unwrap_or("request failed");
            failed(
                ReasonCode::ProviderBatchErrored,
                format!("HTTP {}: {message}", code.unwrap_or(0)),
            )
        }
        (None, _) => {
            let e = &line["error"];
            let code = e.get("code").and_then(Value::as_str).unwrap_or("errored");
            let message = e.get("message").and_then(Value::as_str).unwrap_or_default();
            if code == "batch_expired" {
                failed(ReasonCode::ProviderBatchExpired, message.to_owned())
            } else if code == "batch_cancelled" {
                failed(ReasonCode::ProviderBatchCanceled, message.to_owned())
            } else {
                failed(ReasonCode::ProviderBatchErrored, format!("{code}: {message}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tollgate::retry::FailureClass;

    use super::*;
    use crate::providers::batch_api::{failure_of, jsonl_of};
    use crate::providers::streaming::ChatStream;

    fn adapter() -> OpenAi {
        OpenAi {
            base_url: "https://api.openai.com/v1".to_owned(),
            cap_field: "max_completion_tokens",
            files_batch: FilesBatch {
                root: "https://api.openai.com/v1".to_owned(),
                query: String::new(),
                line_url: Endpoint::as_str,
                tags: true,
                cap_field: "max_completion_tokens",
            },
        }
    }

    fn built(mode: Mode, request: &Value) -> reqwest::Request {
        built_for(Endpoint::ChatCompletions, mode, request)
    }

    fn built_for(endpoint: Endpoint, mode: Mode, request: &Value) -> reqwest::Request {
        adapter()
            .request(
                &reqwest::Client::new(),
                &SecretString::from("sk-test"),
                "gpt-4o-mini",
                endpoint,
                request,
                mode,
            )
            .build()
            .unwrap()
    }

    fn body_of(req: &reqwest::Request) -> Value {
        serde_json::from_slice(req.body().unwrap().as_bytes().unwrap()).unwrap()
    }

    #[test]
    fn builds_plain_and_streamed_requests() {
        let r = json!({"model": "fast", "stream": true, "stream_options": {"include_usage": false, "x": 1},
                       "messages": [{"role": "user", "content": "hi"}]});
        let plain = built(Mode::Whole, &r);
        assert_eq!(plain.url().as_str(), "https://api.openai.com/v1/chat/completions");
        assert_eq!(plain.headers()["authorization"], "Bearer sk-test");
        let b = body_of(&plain);
        assert_eq!(b["model"], "gpt-4o-mini");
        assert!(b.get("stream").is_none() && b.get("stream_options").is_none());
        assert_eq!(b["messages"], r["messages"]);

        let streamed = built(Mode::Stream, &r);
        assert_eq!(streamed.url(), plain.url());
        let b = body_of(&streamed);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"], json!({"include_usage": true, "x": 1}));
        let b = body_of(&built(Mode::Stream, &json!({"stream_options": "bad"})));
        assert_eq!(b["stream_options"], json!({"include_usage": true}));
    }

    #[test]
    fn a_request_without_a_cap_is_sent_the_reserved_one() {
        let r = json!({"model": "fast", "n": 3, "messages": [{"role": "user", "content": "hi"}]});
        let b = body_of(&built(Mode::Whole, &r));
        assert_eq!(
            b["max_completion_tokens"],
            tollgate::estimate::DEFAULT_OUTPUT_TOKENS
        );
        assert!(b.get("max_tokens").is_none());
        assert_eq!(
            b["n"], 3,
            "n is forwarded; the estimate reserved 3 choices of the cap"
        );
        // A cap of the client's own is sent as it is, and no second one beside it.
        let own = body_of(&built(Mode::Whole, &json!({"max_tokens": 9, "messages": []})));
        assert_eq!(own["max_tokens"], 9);
        assert!(own.get("max_completion_tokens").is_none());
        let compatible = body(
            "llama",
            Endpoint::ChatCompletions,
            &r,
            Mode::Whole,
            cap_field(ProviderKind::OpenaiCompatible),
        );
        assert_eq!(
            compatible["max_tokens"],
            tollgate::estimate::DEFAULT_OUTPUT_TOKENS
        );
    }

    #[test]
    fn reads_usage_and_rejects_non_chat_bodies() {
        let ok = br#"{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        let s = parse_success(ok, Endpoint::ChatCompletions).unwrap();
        assert_eq!(
            s.usage,
            Usage {
                input_tokens: 10,
                output_tokens: 5,
                cached_tokens: 4
            }
        );
        assert!(parse_success(b"not json", Endpoint::ChatCompletions).is_err());
        assert!(parse_success(b"{}", Endpoint::ChatCompletions).is_err());
    }

    #[tokio::test]
    async fn responses_are_capped_streamed_as_they_are_and_read_for_usage() {
        let r = json!({"model": "fast", "input": "hi", "stream": true});
        let plain = built_for(Endpoint::Responses, Mode::Whole, &r);
        assert_eq!(plain.url().as_str(), "https://api.openai.com/v1/responses");
        assert_eq!(
            body_of(&plain),
            json!({"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": estimate::DEFAULT_OUTPUT_TOKENS})
        );
        assert_eq!(
            body_of(&built_for(Endpoint::Responses, Mode::Stream, &r))["stream"],
            true
        );
        let ok = br#"{"object":"response","output":[],"usage":{"input_tokens":7,"output_tokens":3,"input_tokens_details":{"cached_tokens":2}}}"#;
        let u = parse_success(ok, Endpoint::Responses).unwrap().usage;
        assert_eq!((u.input_tokens, u.output_tokens, u.cached_tokens), (7, 3, 2));
        let events = [
            r#"{"type":"response.created","response":{"id":"resp_1","output":[]}}"#,
            r#"{"type":"response.output_text.delta","delta":"hel"}"#,
            r#"{"type":"response.output_text.delta","delta":"lo"}"#,
            r#"{"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":5,"output_tokens":2}}}"#,
        ];
        let body: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        let mut s = ChatStream::canned(Box::new(ResponseEvents), &[&body]);
        let (chunks, _) = s.flagged().await;
        assert!(s.finished());
        assert_eq!(chunks.len(), 4, "every event relayed as it is");
        assert_eq!(chunks[1]["delta"], "hel");
        assert_eq!((s.usage().input_tokens, s.usage().output_tokens), (5, 2));
        let failed = "data: {\"type\":\"response.failed\",\"response\":{}}\n\n";
        let mut s = ChatStream::canned(Box::new(ResponseEvents), &[failed]);
        assert!(
            s.drain().await.1.is_some(),
            "response.failed ends the stream as a failure"
        );
    }

    #[test]
    fn embeddings_go_to_their_path_as_sent_and_report_input_only() {
        let r = json!({"model": "embed", "input": ["a", "b"], "dimensions": 8});
        let req = built_for(Endpoint::Embeddings, Mode::Whole, &r);
        assert_eq!(req.url().as_str(), "https://api.openai.com/v1/embeddings");
        let mut expected = r.clone();
        expected["model"] = json!("gpt-4o-mini");
        assert_eq!(body_of(&req), expected, "no output cap, nothing else added");
        let ok = br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1]}],"model":"m","usage":{"prompt_tokens":7,"total_tokens":7}}"#;
        let s = parse_success(ok, Endpoint::Embeddings).unwrap();
        assert_eq!((s.usage.input_tokens, s.usage.output_tokens), (7, 0));
        let chat = br#"{"choices":[],"usage":{"prompt_tokens":1}}"#;
        assert!(parse_success(chat, Endpoint::Embeddings).is_err(), "no `data`");
    }

    #[test]
    fn classifies_error_answers() {
        let a = adapter();
        let headers = reqwest::header::HeaderMap::new();
        let rpm = br#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on requests per min (RPM): Limit 3, Used 3, Requested 1. Please try again in 20s.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
        let f = a.classify_error(429, &headers, rpm);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Capacity, ReasonCode::RateLimited)
        );
        assert_eq!(f.retry_after, Some(std::time::Duration::from_secs(20)));
        let quota = br#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
        let f = a.classify_error(429, &headers, quota);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::KeyUnusable, ReasonCode::InsufficientQuota)
        );
        let too_large = br#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 31538.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
        let f = a.classify_error(429, &headers, too_large);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Request, ReasonCode::RequestTooLarge)
        );
        let f = a.classify_error(401, &headers, br#"{"error":{"message":"bad key","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::KeyUnusable, ReasonCode::UpstreamAuthFailed)
        );
    }

    #[test]
    fn error_chunks_map_to_the_status_they_stand_for() {
        let status = |e: Value| stream_error_status(&json!({ "error": e }));
        assert_eq!(
            status(json!({"type": "tokens", "code": "rate_limit_exceeded"})),
            429
        );
        assert_eq!(status(json!({"type": "requests", "code": null})), 429);
        assert_eq!(status(json!({"type": "invalid_request_error"})), 400);
        assert_eq!(status(json!({"type": "authentication_error"})), 401);
        assert_eq!(status(json!({"type": "server_error"})), 500);
        assert_eq!(status(json!({"message": "boom"})), 500);
    }

    #[tokio::test]
    async fn chunks_pass_through_verbatim() {
        let role = r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#;
        let word =
            r#"{"id":"c1",  "choices":[{"index":0,"delta":{"content":"héllo"},"finish_reason":null}]}"#;
        let fin = r#"{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        let usage = r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        let body = format!(
            ": ping\n\ndata: {role}\n\ndata: {word}\r\n\r\ndata: {fin}\n\ndata: {usage}\n\ndata: [DONE]\n\n"
        );
        let (a, b) = body.split_at(37);
        let mut s = ChatStream::canned(Box::new(Chunks), &[a, b]);
        let mut seen = Vec::new();
        while let Some(c) = s.next_chunk().await {
            seen.push((c.unwrap(), s.last_was_usage()));
        }
        let expected: Vec<(String, bool)> = [(role, false), (word, false), (fin, false), (usage, true)]
            .into_iter()
            .map(|(c, u)| (c.to_owned(), u))
            .collect();
        assert_eq!(seen, expected);
        assert!(s.finished());
        assert_eq!(
            s.usage(),
            Usage {
                input_tokens: 9,
                output_tokens: 2,
                cached_tokens: 4
            }
        );
        assert!(s.next_chunk().await.is_none());
    }

    /// Found by the `sse_stream` fuzz target: chunks a provider sent after its usage chunk
    /// were yielded after it, though a stream's usage chunk is its last (the relay and the
    /// settlement take it as the final word).
    #[tokio::test]
    async fn the_usage_chunk_ends_the_stream() {
        let usage = r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}"#;
        let late =
            r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"late"}}],"usage":{"prompt_tokens":1}}"#;
        let body = format!("data: {usage}\n\ndata: {late}\n\ndata: [DONE]\n\n");
        let mut s = ChatStream::canned(Box::new(Chunks), &[&body]);
        let (chunks, failure) = s.drain().await;
        assert_eq!((chunks, failure.is_none()), (vec![usage.to_owned()], true));
        assert!(s.finished());
        assert_eq!((s.usage().input_tokens, s.usage().output_tokens), (9, 2));
    }

    #[tokio::test]
    async fn cut_streams_fail_and_estimate_usage() {
        let body = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"abcdefghij\"}}]}\n\n\
                    data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"k\"}}]}\n\n";
        let mut s = ChatStream::canned(Box::new(Chunks), &[body]);
        let (chunks, failure) = s.drain().await;
        assert_eq!(chunks.len(), 2);
        let f = failure.unwrap();
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Network, ReasonCode::NetworkError)
        );
        assert!(!s.finished());
        // 2 deltas, 11 chars → max(2, ceil(11/4) = 3); input estimated from the request.
        assert_eq!(
            s.usage(),
            Usage {
                input_tokens: 42,
                output_tokens: 3,
                cached_tokens: 0
            }
        );
        let mut s = ChatStream::canned(Box::new(Chunks), &["data: {not json\n\n"]);
        assert_eq!(s.drain().await.1.unwrap().code, ReasonCode::ProviderBadResponse);
    }

    #[tokio::test]
    async fn error_chunks_are_classified() {
        let openai = "data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\",\"param\":null,\"code\":null}}\n\n";
        let mut s = ChatStream::canned(Box::new(Chunks), &[openai]);
        let f = s.drain().await.1.unwrap();
        assert_eq!(
            (f.class, f.code, f.status),
            (FailureClass::Overload, ReasonCode::ProviderError, None)
        );
        assert!(f.message.contains("boom"));
        let limited = "data: {\"error\":{\"message\":\"slow down\",\"type\":\"tokens\",\"param\":null,\"code\":\"rate_limit_exceeded\"}}\n\n";
        let mut s = ChatStream::canned(Box::new(Chunks), &[limited]);
        let f = s.drain().await.1.unwrap();
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Capacity, ReasonCode::RateLimited)
        );
    }

    /// The one JSON line of an upload's multipart body.
    fn jsonl_line(body: &str) -> Value {
        body.lines()
            .find(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .unwrap()
    }

    #[test]
    fn batch_requests() {
        let a = adapter().files_batch;
        let r = json!({"model": "fast", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
        let lines = [("job-1".to_owned(), &r)];
        let up = a
            .upload("gpt-4o-mini", Endpoint::ChatCompletions, &lines, "pack-1")
            .unwrap();
        assert_eq!(up.url, "https://api.openai.com/v1/files");
        let UploadProtocol::Form { content_type } = &up.protocol else {
            panic!("{up:?}");
        };
        let boundary = content_type
            .strip_prefix("multipart/form-data; boundary=")
            .unwrap();
        let text = String::from_utf8(up.body).unwrap();
        assert!(text.starts_with(&format!("--{boundary}\r\n")));
        assert!(text.ends_with(&format!("\r\n--{boundary}--\r\n")));
        assert!(text.contains("name=\"purpose\"\r\n\r\nbatch\r\n"));
        assert!(text.contains("filename=\"pack-1.jsonl\""));
        let line = jsonl_line(&text);
        assert_eq!(
            line,
            json!({"custom_id": "job-1", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
                            "max_completion_tokens": 1024}})
        );
        let (url, body) = a.create(
            "gpt-4o-mini",
            Endpoint::ChatCompletions,
            &lines,
            "pack-1",
            Some("file-1"),
        );
        assert_eq!(url, "https://api.openai.com/v1/batches");
        assert_eq!(
            body,
            json!({"input_file_id": "file-1", "endpoint": "/v1/chat/completions",
                   "completion_window": "24h", "metadata": {"tollgate_pack": "pack-1"}})
        );

        // A batch of embeddings: its lines' url and body are the endpoint's, uncapped.
        let r = json!({"model": "embed", "input": ["a", "b"]});
        let lines = [("job-2".to_owned(), &r)];
        let up = a
            .upload("text-embedding-3-small", Endpoint::Embeddings, &lines, "pack-2")
            .unwrap();
        let text = String::from_utf8(up.body).unwrap();
        let line = jsonl_line(&text);
        assert_eq!(
            line,
            json!({"custom_id": "job-2", "method": "POST", "url": "/v1/embeddings",
                   "body": {"model": "text-embedding-3-small", "input": ["a", "b"]}})
        );
        let (_, body) = a.create(
            "text-embedding-3-small",
            Endpoint::Embeddings,
            &lines,
            "pack-2",
            Some("f"),
        );
        assert_eq!(body["endpoint"], "/v1/embeddings");
        assert_eq!(a.status_url("b1"), "https://api.openai.com/v1/batches/b1");
        assert_eq!(a.cancel_url("b1"), "https://api.openai.com/v1/batches/b1/cancel");
    }

    #[test]
    fn batch_status_and_results() {
        let a = adapter().files_batch;
        let running = a.parse_status(&json!({"id": "b1", "object": "batch", "status": "in_progress",
                                              "output_file_id": null, "error_file_id": null}));
        assert!(!running.ended);
        assert_eq!(running.status, "in_progress");
        assert!(a.result_urls("b1", &running).is_empty());
        let done = a.parse_status(&json!({"id": "b1", "status": "completed",
                                           "output_file_id": "file-out", "error_file_id": "file-err"}));
        assert!(done.ended);
        assert_eq!(
            a.result_urls("b1", &done),
            [
                "https://api.openai.com/v1/files/file-out/content",
                "https://api.openai.com/v1/files/file-err/content"
            ]
        );
        for ended in ["failed", "expired", "cancelled"] {
            assert!(a.parse_status(&json!({"status": ended})).ended, "{ended}");
        }

        let lines = [
            json!({"id": "r1", "custom_id": "ok", "response": {"status_code": 200, "request_id": "req_1",
                   "body": {"id": "c", "object": "chat.completion", "choices": [],
                            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}}, "error": null}),
            json!({"custom_id": "bad", "response": {"status_code": 400,
                   "body": {"error": {"message": "no such model", "type": "invalid_request_error"}}}, "error": null}),
            json!({"custom_id": "late", "response": null, "error": {"code": "batch_expired", "message": "expired"}}),
            json!({"custom_id": "other", "response": null, "error": {"code": "server_error", "message": "oops"}}),
            json!({"no_id": true}),
        ];
        let mut out = HashMap::new();
        a.parse_results(Endpoint::ChatCompletions, &jsonl_of(&lines), &mut out);
        assert_eq!(out.len(), 4);
        let Some(LineResult::Succeeded { success, request_id }) = out.get("ok") else {
            panic!("{out:?}");
        };
        assert_eq!(request_id.as_deref(), Some("req_1"));
        assert_eq!((success.usage.input_tokens, success.usage.output_tokens), (3, 2));
        let code = |id: &str| failure_of(&out, id);
        assert_eq!(
            code("bad"),
            (
                "provider_batch_errored".to_owned(),
                "HTTP 400: no such model".to_owned()
            )
        );
        assert_eq!(code("late").0, "provider_batch_expired");
        assert_eq!(
            code("other"),
            (
                "provider_batch_errored".to_owned(),
                "server_error: oops".to_owned()
            )
        );
    }
}
