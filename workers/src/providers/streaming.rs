//! Streaming chat completions at the provider layer: [`Providers::call_stream`] sends an
//! OpenAI-format request with `stream: true` and, once the provider has answered 2xx,
//! hands back a [`ChatStream`] that yields the provider's events as OpenAI
//! `chat.completion.chunk`s (Anthropic events are translated) while keeping count of
//! the usage.
//!
//! - Admission failures (any non-2xx before the stream starts) are classified exactly as
//!   for non-streaming calls ([`classify_response`]) and come back as a [`CallOutcome`]
//!   whose `result` is the `Err`, ready for the attempt record.
//! - Cancellation: the [`ChatStream`] owns the upstream response body; dropping it drops
//!   the body and so closes the upstream connection, which is how the provider learns
//!   that the call is abandoned. Nothing is spawned.
//! - The usage chunk (`"choices": []` plus `usage`) is always requested from OpenAI
//!   (`stream_options.include_usage = true`) and always yielded, last; whether the client
//!   sees it is the caller's decision ([`ChatStream::client_wants_usage`],
//!   [`ChatStream::last_was_usage`]). Because of the forced `include_usage`, OpenAI's
//!   other chunks carry `"usage": null`; they are passed through as sent.
//! - The HTTP client's `dispatch.request_timeout_secs` bounds the whole stream, body
//!   included; hitting it ends the stream with a `provider_timeout` failure.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::body::Bytes;
use futures::Stream;
use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderMap};
use secrecy::ExposeSecret;
use serde_json::{Value, json};
use tollgate::config::ProviderKind;
use tollgate::model::Usage;
use tollgate::retry::{Failure, FailureClass, classify_response};
use tollgate::routing::Target;

use tollgate::ratelimit::{self, Signals};

use super::{CallOutcome, Providers, anthropic, azure, int, rate_limit_headers, request_id, send_failure};

/// Largest SSE event (or line) accepted, in bytes; a provider that sends more without an
/// event boundary is broken, and buffering it without bound would be a memory leak.
const MAX_EVENT_BYTES: usize = 8 * 1024 * 1024;

/// A started stream: the upstream answered 2xx; chunks follow.
pub struct ChatStream {
    /// The provider key used (its name, never the secret).
    pub key_name: String,
    /// HTTP status of the upstream response (2xx).
    pub status: u16,
    /// The provider's request id (`x-request-id` / `request-id`).
    pub request_id: Option<String>,
    /// The rate-limit headers as sent (names lower-case), for the attempt record.
    pub rate_limit: Option<Value>,
    /// The upstream body; dropping it closes the upstream connection.
    body: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    parser: SseParser,
    translate: Translate,
    /// Chunks made from events already read, not yet returned.
    pending: VecDeque<Pending>,
    tally: Tally,
    /// The provider sent its end marker (`[DONE]` / `message_stop`).
    finished: bool,
    /// Nothing more is read: finished, failed or cut.
    ended: bool,
    /// The chunk last returned was the usage chunk.
    last_was_usage: bool,
}

impl std::fmt::Debug for ChatStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatStream")
            .field("key_name", &self.key_name)
            .field("status", &self.status)
            .field("request_id", &self.request_id)
            .field("finished", &self.finished)
            .field("usage", &self.usage())
            .finish_non_exhaustive()
    }
}

/// A chunk ready to be returned.
struct Pending {
    text: String,
    usage: bool,
}

/// Usage as far as the stream has told it.
#[derive(Debug, Default)]
struct Tally {
    /// Input tokens reported by the provider.
    input: Option<i64>,
    /// Final output tokens reported by the provider.
    output: Option<i64>,
    cached: i64,
    /// Input tokens estimated from the request, used when none are reported.
    estimated_input: i64,
    /// Content-bearing deltas seen.
    deltas: i64,
    /// Characters of content seen.
    chars: i64,
}

/// How provider events become OpenAI chunks.
enum Translate {
    /// Already OpenAI chunks: passed through as sent.
    OpenAi,
    Anthropic(AnthropicMessage),
}

/// What the chunks translated from an Anthropic stream repeat.
#[derive(Default)]
struct AnthropicMessage {
    id: Value,
    model: Value,
    created: i64,
}

impl ChatStream {
    /// Next event in OpenAI chunk format, already serialized as the JSON text of one
    /// `data:` line (without the `data: ` prefix). `None` at the end, after which
    /// [`ChatStream::usage`] is final; the `data: [DONE]` terminator is not yielded, the
    /// caller writes its own. A failure (broken connection, timeout, an error event, a
    /// stream cut before its end marker) is yielded once, then `None`.
    ///
    /// Cancel-safe: dropping the future loses nothing, so it can sit in a `select!`.
    pub async fn next_chunk(&mut self) -> Option<Result<String, Failure>> {
        std::future::poll_fn(|cx| self.poll_next_chunk(cx)).await
    }

    /// Usage seen so far (final after the end): input from the start event or usage
    /// chunk (estimated from the request until then), output from the final usage or, if
    /// the stream was cut, an estimate of what was produced: the larger of the number of
    /// content deltas and a quarter of their characters.
    pub fn usage(&self) -> Usage {
        let t = &self.tally;
        Usage {
            input_tokens: t.input.unwrap_or(t.estimated_input),
            output_tokens: t.output.unwrap_or_else(|| t.deltas.max((t.chars + 3) / 4)),
            cached_tokens: t.cached,
        }
    }

    /// The provider ended the stream normally (`[DONE]`, or Anthropic's `message_stop`).
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// The chunk last returned by [`ChatStream::next_chunk`] was the usage chunk
    /// (`"choices": []` with `usage`), which the client gets only if it asked
    /// ([`ChatStream::client_wants_usage`]).
    pub fn last_was_usage(&self) -> bool {
        self.last_was_usage
    }

    /// Whether an OpenAI-format request asked for the usage chunk
    /// (`"stream_options": {"include_usage": true}`).
    pub fn client_wants_usage(request: &Value) -> bool {
        request.pointer("/stream_options/include_usage") == Some(&Value::Bool(true))
    }

    fn poll_next_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<String, Failure>>> {
        loop {
            if let Some(p) = self.pending.pop_front() {
                self.last_was_usage = p.usage;
                return Poll::Ready(Some(Ok(p.text)));
            }
            self.last_was_usage = false;
            if self.ended {
                return Poll::Ready(None);
            }
            if let Some(event) = self.parser.next_event() {
                if let Err(f) = self.on_event(event) {
                    return Poll::Ready(Some(Err(self.fail(f))));
                }
                if self.finished {
                    self.end();
                }
                continue;
            }
            match ready!(self.body.as_mut().poll_next(cx)) {
                Some(Ok(bytes)) => {
                    if let Err(reason) = self.parser.push(&bytes) {
                        let f = self.bad_response(reason);
                        return Poll::Ready(Some(Err(self.fail(f))));
                    }
                }
                Some(Err(e)) => {
                    let f = send_failure(e);
                    return Poll::Ready(Some(Err(self.fail(f))));
                }
                None => {
                    self.parser.finish();
                    while let Some(event) = self.parser.next_event() {
                        if let Err(f) = self.on_event(event) {
                            return Poll::Ready(Some(Err(self.fail(f))));
                        }
                        if self.finished {
                            break;
                        }
                    }
                    self.end();
                    if !self.finished {
                        let f = Failure::network("the provider ended the stream before its end marker");
                        return Poll::Ready(Some(Err(self.fail(f))));
                    }
                }
            }
        }
    }

    /// Stops reading and lets go of the upstream body (closing the connection if the
    /// provider has not closed it yet).
    fn end(&mut self) {
        self.ended = true;
        self.body = Box::pin(futures::stream::empty());
    }

    /// Ends the stream on a failure; chunks not yet returned are dropped.
    fn fail(&mut self, failure: Failure) -> Failure {
        self.pending.clear();
        self.end();
        failure
    }

    fn bad_response(&self, reason: impl Into<String>) -> Failure {
        Failure {
            class: FailureClass::Network,
            code: "provider_bad_response",
            message: reason.into(),
            status: Some(self.status),
            retry_after: None,
        }
    }

    fn push(&mut self, chunk: &Value) {
        self.pending.push_back(Pending {
            text: chunk.to_string(),
            usage: false,
        });
    }

    fn on_event(&mut self, event: SseEvent) -> Result<(), Failure> {
        if event.data.trim() == "[DONE]" {
            self.finished = true;
            return Ok(());
        }
        if event.data.trim().is_empty() {
            return Ok(());
        }
        let v: Value = serde_json::from_str(&event.data)
            .map_err(|e| self.bad_response(format!("provider sent a stream event that is not JSON: {e}")))?;
        let is_error = event.event.as_deref() == Some("error")
            || v.get("type").and_then(Value::as_str) == Some("error")
            || v.get("error").is_some_and(|e| !e.is_null());
        if is_error {
            return Err(stream_error(&v, &event.data));
        }
        match self.translate {
            Translate::OpenAi => {
                self.on_openai_chunk(&v);
                let usage = is_usage_chunk(&v);
                self.pending.push_back(Pending {
                    text: event.data,
                    usage,
                });
            }
            Translate::Anthropic(_) => self.on_anthropic_event(&v),
        }
        Ok(())
    }

    fn on_openai_chunk(&mut self, v: &Value) {
        for choice in v.get("choices").and_then(Value::as_array).into_iter().flatten() {
            if let Some(text) = choice.pointer("/delta/content").and_then(Value::as_str)
                && !text.is_empty()
            {
                self.count_content(text);
            }
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.tally.input = Some(int(u, &["prompt_tokens"]));
            self.tally.output = Some(int(u, &["completion_tokens"]));
            self.tally.cached = int(u, &["prompt_tokens_details", "cached_tokens"]);
        }
    }

    fn count_content(&mut self, text: &str) {
        self.tally.deltas += 1;
        self.tally.chars += i64::try_from(text.chars().count()).unwrap_or(i64::MAX);
    }

    fn on_anthropic_event(&mut self, v: &Value) {
        match v.get("type").and_then(Value::as_str).unwrap_or_default() {
            "message_start" => {
                let m = v.get("message").cloned().unwrap_or(Value::Null);
                if let Translate::Anthropic(meta) = &mut self.translate {
                    meta.id = m.get("id").cloned().unwrap_or(Value::Null);
                    meta.model = m.get("model").cloned().unwrap_or(Value::Null);
                    meta.created = chrono::Utc::now().timestamp();
                }
                if let Some(u) = m.get("usage") {
                    self.anthropic_input(u);
                }
                let chunk = self.anthropic_chunk(json!({"role": "assistant", "content": ""}), None);
                self.push(&chunk);
            }
            "content_block_start" => {
                let block = v.get("content_block");
                let text = block
                    .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
                    .and_then(|b| b.get("text"))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                self.anthropic_content(text);
            }
            "content_block_delta" => {
                let delta = v.get("delta");
                let text = delta
                    .filter(|d| d.get("type").and_then(Value::as_str) == Some("text_delta"))
                    .and_then(|d| d.get("text"))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                self.anthropic_content(text);
            }
            "message_delta" => {
                if let Some(u) = v.get("usage") {
                    if u.get("input_tokens").is_some() {
                        self.anthropic_input(u);
                    }
                    if let Some(out) = u.get("output_tokens").and_then(Value::as_i64) {
                        self.tally.output = Some(out);
                    }
                }
                let reason = v.pointer("/delta/stop_reason").and_then(Value::as_str);
                let chunk = self.anthropic_chunk(json!({}), Some(finish_reason(reason)));
                self.push(&chunk);
            }
            "message_stop" => {
                let usage = self.usage();
                let mut chunk = self.anthropic_chunk(Value::Null, None);
                chunk["choices"] = json!([]);
                chunk["usage"] = json!({
                    "prompt_tokens": usage.input_tokens,
                    "completion_tokens": usage.output_tokens,
                    "total_tokens": usage.input_tokens + usage.output_tokens,
                    "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
                });
                self.pending.push_back(Pending {
                    text: chunk.to_string(),
                    usage: true,
                });
                self.finished = true;
            }
            // ping, content_block_stop, and event types this adapter does not translate
            // (tool input, thinking).
            _ => {}
        }
    }

    /// Input usage the way `anthropic::parse_success` counts it: uncached, cache writes
    /// and cache reads together; cache reads are also the cached tokens.
    fn anthropic_input(&mut self, u: &Value) {
        let cache_read = int(u, &["cache_read_input_tokens"]);
        self.tally.input =
            Some(int(u, &["input_tokens"]) + int(u, &["cache_creation_input_tokens"]) + cache_read);
        self.tally.cached = cache_read;
    }

    fn anthropic_content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.count_content(text);
        let chunk = self.anthropic_chunk(json!({"content": text}), None);
        self.push(&chunk);
    }

    /// An OpenAI chunk of the translated message with one choice carrying `delta`.
    fn anthropic_chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        let (id, model, created) = match &self.translate {
            Translate::Anthropic(m) => (m.id.clone(), m.model.clone(), m.created),
            Translate::OpenAi => (Value::Null, Value::Null, 0),
        };
        json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        })
    }
}

impl Stream for ChatStream {
    type Item = Result<String, Failure>;

    /// The same items as [`ChatStream::next_chunk`].
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_next_chunk(cx)
    }
}

/// `stop_reason` → `finish_reason`, as `anthropic::parse_success` maps it.
fn finish_reason(stop_reason: Option<&str>) -> &'static str {
    match stop_reason {
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    }
}

/// The usage-only chunk OpenAI sends last when `include_usage` is set.
fn is_usage_chunk(v: &Value) -> bool {
    v.get("usage").is_some_and(Value::is_object)
        && v.get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty)
}

/// Classifies an error event sent after the stream started (Anthropic `event: error`,
/// or an OpenAI chunk with an `error` object) through the status its error type stands
/// for; the HTTP status was 2xx, so the failure carries none.
fn stream_error(v: &Value, raw: &str) -> Failure {
    let field = |name: &str| v.get("error").and_then(|e| e.get(name)).and_then(Value::as_str);
    let status = match (field("type"), field("code")) {
        (_, Some("rate_limit_exceeded")) => 429,
        (Some("overloaded_error"), _) => 529,
        (Some("rate_limit_error" | "requests" | "tokens"), _) => 429,
        (Some("invalid_request_error"), _) => 400,
        (Some("authentication_error"), _) => 401,
        (Some("billing_error"), _) => 402,
        (Some("permission_error"), _) => 403,
        (Some("not_found_error"), _) => 404,
        (Some("request_too_large"), _) => 413,
        (Some("timeout_error"), _) => 504,
        _ => 500,
    };
    let mut failure = classify_response(status, &HeaderMap::new(), raw.as_bytes());
    failure.status = None;
    failure.message = format!("error event in the stream: {}", failure.message);
    failure
}

impl Providers {
    /// Sends `request` (OpenAI chat format) to `target` with `stream: true` and the
    /// provider's next key; for OpenAI-style providers `stream_options.include_usage` is
    /// set so that usage arrives, for Anthropic the request is translated as for
    /// [`Providers::call`]. A non-2xx answer (or a 2xx that is not an event stream) is
    /// classified exactly as non-streaming calls are and returned as a [`CallOutcome`]
    /// whose `result` is the `Err`.
    pub async fn call_stream(&self, target: &Target, request: &Value) -> Result<ChatStream, CallOutcome> {
        let Some(client) = self.get(&target.provider) else {
            return Err(CallOutcome::refused(Failure {
                class: FailureClass::Request,
                code: "unknown_provider",
                message: format!("provider {:?} is not configured", target.provider),
                status: None,
                retry_after: None,
            }));
        };
        let key = client.pick_key(target);
        let (builder, translate) = match client.kind {
            ProviderKind::Openai | ProviderKind::OpenaiCompatible => (
                self.http
                    .post(format!("{}/chat/completions", client.base_url))
                    .bearer_auth(key.secret.expose_secret())
                    .json(&openai_body(&target.model, request)),
                Translate::OpenAi,
            ),
            ProviderKind::Anthropic => {
                let mut body = anthropic::translate_request(&target.model, request);
                if let Some(obj) = body.as_object_mut() {
                    obj.insert("stream".to_owned(), Value::Bool(true));
                }
                (
                    self.http
                        .post(format!("{}/v1/messages", client.base_url))
                        .header("x-api-key", key.secret.expose_secret())
                        .header("anthropic-version", &client.anthropic_version)
                        .json(&body),
                    Translate::Anthropic(AnthropicMessage::default()),
                )
            }
            ProviderKind::Azure => (
                azure::post(
                    &self.http,
                    &client.base_url,
                    &key.secret,
                    &client.azure_api_version,
                    &target.model,
                )
                .json(&openai_body(&target.model, request)),
                Translate::OpenAi,
            ),
            ProviderKind::Gemini => {
                return Err(CallOutcome::refused(Failure {
                    class: FailureClass::Request,
                    code: "streaming_unsupported",
                    message: format!(
                        "provider {:?} (gemini) does not stream through tollgate yet; send the request without `stream`",
                        target.provider
                    ),
                    status: None,
                    retry_after: None,
                }));
            }
        };
        let mut outcome = CallOutcome {
            key_name: key.name.clone(),
            status: None,
            request_id: None,
            rate_limit: None,
            signals: Signals::default(),
            result: Err(Failure::network("request was not sent")),
        };
        let response = match builder.header(ACCEPT, "text/event-stream").send().await {
            Ok(r) => r,
            Err(e) => {
                outcome.result = Err(send_failure(e));
                return Err(outcome);
            }
        };
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        outcome.status = Some(status);
        outcome.request_id = request_id(&headers);
        outcome.rate_limit = rate_limit_headers(&headers);
        if !(200..300).contains(&status) {
            outcome.result = Err(match response.bytes().await {
                Ok(body) => {
                    outcome.signals = ratelimit::read(client.dialect, &headers, &body, chrono::Utc::now());
                    classify_response(status, &headers, &body)
                }
                Err(e) => send_failure(e),
            });
            return Err(outcome);
        }
        let content_type = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("text/event-stream");
        if !content_type.trim_start().starts_with("text/event-stream") {
            outcome.result = Err(Failure {
                class: FailureClass::Network,
                code: "provider_bad_response",
                message: format!(
                    "provider answered a streaming request with {content_type:?}, not an event stream"
                ),
                status: Some(status),
                retry_after: None,
            });
            return Err(outcome);
        }
        Ok(ChatStream {
            key_name: outcome.key_name,
            status,
            request_id: outcome.request_id,
            rate_limit: outcome.rate_limit,
            body: Box::pin(response.bytes_stream()),
            parser: SseParser::default(),
            translate,
            pending: VecDeque::new(),
            tally: Tally {
                estimated_input: i64::from(tollgate::estimate::char_rule(request)),
                ..Tally::default()
            },
            finished: false,
            ended: false,
            last_was_usage: false,
        })
    }
}

/// The OpenAI request body of a stream: the client's request with the target's model,
/// `stream: true` and `stream_options.include_usage: true` (other stream options kept).
fn openai_body(model: &str, request: &Value) -> Value {
    let mut body = request.clone();
    if let Some(obj) = body.as_object_mut() {
        obj.insert("model".to_owned(), Value::String(model.to_owned()));
        obj.insert("stream".to_owned(), Value::Bool(true));
        let options = obj.entry("stream_options").or_insert_with(|| json!({}));
        if !options.is_object() {
            *options = json!({});
        }
        options["include_usage"] = Value::Bool(true);
    }
    body
}

/// One server-sent event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines, joined with `\n`.
    pub data: String,
}

/// Incremental `text/event-stream` parser (WHATWG HTML §9.2.6): bytes in any split,
/// lines ended by `\r\n`, `\n` or `\r`, comments (`: keep-alive`) ignored, `data:`
/// lines of one event joined with `\n`, `id:` and `retry:` ignored, a leading BOM
/// dropped. Unlike the spec, at the end of input a last line without its line ending
/// and an event without its blank line are still delivered ([`SseParser::finish`]):
/// a provider that closes right after `data: [DONE]` has still said it.
#[derive(Debug, Default)]
pub(crate) struct SseParser {
    /// Bytes of the line being read.
    line: Vec<u8>,
    /// The last line ended with `\r`: a `\n` right after it belongs to it.
    after_cr: bool,
    /// A line has been completed (the BOM can only precede the first).
    seen_line: bool,
    event: Option<String>,
    data: String,
    has_data: bool,
    ready: VecDeque<SseEvent>,
}

impl SseParser {
    /// Feeds bytes; complete events become available from [`SseParser::next_event`].
    /// Errors when an event grows beyond [`MAX_EVENT_BYTES`].
    pub(crate) fn push(&mut self, mut bytes: &[u8]) -> Result<(), String> {
        if self.after_cr && !bytes.is_empty() {
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
            self.after_cr = false;
        }
        while let Some(i) = bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.line.extend_from_slice(&bytes[..i]);
            let ended_by_cr = bytes[i] == b'\r';
            bytes = &bytes[i + 1..];
            self.take_line();
            if ended_by_cr {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        self.line.extend_from_slice(bytes);
        if self.line.len() + self.data.len() > MAX_EVENT_BYTES {
            return Err(format!(
                "provider sent a stream event larger than {MAX_EVENT_BYTES} bytes"
            ));
        }
        Ok(())
    }

    /// End of input: delivers what is still buffered (see the type's doc).
    pub(crate) fn finish(&mut self) {
        if !self.line.is_empty() {
            self.take_line();
        }
        self.dispatch();
    }

    pub(crate) fn next_event(&mut self) -> Option<SseEvent> {
        self.ready.pop_front()
    }

    fn take_line(&mut self) {
        let mut raw = std::mem::take(&mut self.line);
        self.on_line(&String::from_utf8_lossy(&raw));
        // Keep the allocation for the next line.
        raw.clear();
        self.line = raw;
    }

    fn on_line(&mut self, mut line: &str) {
        if !self.seen_line {
            self.seen_line = true;
            line = line.strip_prefix('\u{feff}').unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch();
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_owned()),
            _ => {}
        }
    }

    fn dispatch(&mut self) {
        let event = self.event.take();
        if self.has_data {
            self.has_data = false;
            self.ready.push_back(SseEvent {
                event,
                data: std::mem::take(&mut self.data),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use serde_json::{Value, json};
    use tollgate::config::{Config, ProviderKind};
    use tollgate::model::Usage;
    use tollgate::retry::FailureClass;
    use tollgate::routing::Target;

    use super::*;
    use tollgate_mock::{LocalMock, MockConfig, MockProvider, MockStats};

    // ---- SSE parser ----

    fn parse_in_pieces(input: &[u8], piece: usize) -> Vec<SseEvent> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for chunk in input.chunks(piece.max(1)) {
            p.push(chunk).unwrap();
            out.extend(std::iter::from_fn(|| p.next_event()));
        }
        p.finish();
        out.extend(std::iter::from_fn(|| p.next_event()));
        out
    }

    fn ev(event: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
        }
    }

    #[test]
    fn sse_lines_split_anywhere() {
        let input = "data: {\"a\":1}\n\nevent: message_start\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        let expected = vec![
            ev(None, "{\"a\":1}"),
            ev(Some("message_start"), "{\"b\":2}"),
            ev(None, "[DONE]"),
        ];
        for piece in 1..=input.len() {
            assert_eq!(
                parse_in_pieces(input.as_bytes(), piece),
                expected,
                "pieces of {piece}"
            );
        }
    }

    #[test]
    fn sse_crlf_and_lone_cr() {
        let crlf = "event: ping\r\ndata: x\r\n\r\ndata: y\r\n\r\n";
        let cr = "event: ping\rdata: x\r\rdata: y\r\r";
        let expected = vec![ev(Some("ping"), "x"), ev(None, "y")];
        for input in [crlf, cr] {
            for piece in 1..=input.len() {
                assert_eq!(
                    parse_in_pieces(input.as_bytes(), piece),
                    expected,
                    "{input:?} / {piece}"
                );
            }
        }
    }

    #[test]
    fn sse_comments_multiline_data_and_fields() {
        let input = ": keep-alive\n\n:\ndata: one\ndata:two\ndata\nid: 7\nretry: 10\nfoo: bar\n\n\
                     event: lonely\n\ndata: after\n\n";
        assert_eq!(
            parse_in_pieces(input.as_bytes(), 3),
            // A comment alone is no event; the event type without data is dropped.
            vec![ev(None, "one\ntwo\n"), ev(None, "after")]
        );
        // Only one space after the colon is stripped; a BOM before the first line is dropped.
        let input = "\u{feff}data:  two spaces\n\n";
        assert_eq!(
            parse_in_pieces(input.as_bytes(), 1),
            vec![ev(None, " two spaces")]
        );
        // UTF-8 split between pushes.
        let input = "data: h\u{e9}llo \u{1f600}\n\n";
        assert_eq!(
            parse_in_pieces(input.as_bytes(), 1),
            vec![ev(None, "h\u{e9}llo \u{1f600}")]
        );
    }

    #[test]
    fn sse_end_of_input_delivers_the_rest() {
        assert_eq!(parse_in_pieces(b"data: [DONE]", 4), vec![ev(None, "[DONE]")]);
        assert_eq!(parse_in_pieces(b"data: a\ndata: b\n", 4), vec![ev(None, "a\nb")]);
        assert!(parse_in_pieces(b": only a comment", 4).is_empty());
    }

    #[test]
    fn sse_refuses_unbounded_events() {
        let mut p = SseParser::default();
        let big = vec![b'x'; MAX_EVENT_BYTES / 2 + 1];
        p.push(b"data: ").unwrap();
        p.push(&big).unwrap();
        p.push(b"\ndata: ").unwrap();
        assert!(p.push(&big).is_err());
    }

    /// An API handler holds the stream (and awaits the call) across awaits: both must be
    /// `Send`.
    #[test]
    fn stream_and_call_are_send() {
        fn send<T: Send>(_: &T) {}
        fn _call(p: &Providers, t: &Target, r: &Value) {
            send(&p.call_stream(t, r));
        }
        let s = canned(Translate::OpenAi, &[]);
        send(&s);
    }

    // ---- translation, without HTTP ----

    fn canned(translate: Translate, pieces: &[&str]) -> ChatStream {
        let chunks: Vec<reqwest::Result<Bytes>> = pieces
            .iter()
            .map(|p| Ok(Bytes::copy_from_slice(p.as_bytes())))
            .collect();
        ChatStream {
            key_name: "k".to_owned(),
            status: 200,
            request_id: None,
            rate_limit: None,
            body: Box::pin(futures::stream::iter(chunks)),
            parser: SseParser::default(),
            translate,
            pending: VecDeque::new(),
            tally: Tally {
                estimated_input: 42,
                ..Tally::default()
            },
            finished: false,
            ended: false,
            last_was_usage: false,
        }
    }

    async fn drain(s: &mut ChatStream) -> (Vec<String>, Option<Failure>) {
        let mut chunks = Vec::new();
        while let Some(item) = s.next_chunk().await {
            match item {
                Ok(c) => chunks.push(c),
                Err(f) => {
                    assert!(s.next_chunk().await.is_none(), "nothing after a failure");
                    return (chunks, Some(f));
                }
            }
        }
        (chunks, None)
    }

    #[tokio::test]
    async fn openai_chunks_pass_through_verbatim() {
        let role = r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#;
        let word =
            r#"{"id":"c1",  "choices":[{"index":0,"delta":{"content":"héllo"},"finish_reason":null}]}"#;
        let fin = r#"{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        let usage = r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        let body = format!(
            ": ping\n\ndata: {role}\n\ndata: {word}\r\n\r\ndata: {fin}\n\ndata: {usage}\n\ndata: [DONE]\n\n"
        );
        let (a, b) = body.split_at(37);
        let mut s = canned(Translate::OpenAi, &[a, b]);
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

    #[tokio::test]
    async fn cut_stream_fails_and_estimates_usage() {
        let body = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"abcdefghij\"}}]}\n\n\
                    data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"k\"}}]}\n\n";
        let mut s = canned(Translate::OpenAi, &[body]);
        let (chunks, failure) = drain(&mut s).await;
        assert_eq!(chunks.len(), 2);
        let f = failure.unwrap();
        assert_eq!((f.class, f.code), (FailureClass::Network, "network_error"));
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
        let mut s = canned(Translate::OpenAi, &["data: {not json\n\n"]);
        assert_eq!(drain(&mut s).await.1.unwrap().code, "provider_bad_response");
    }

    #[tokio::test]
    async fn error_events_are_classified() {
        let overloaded = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"c\",\"usage\":{\"input_tokens\":7,\"output_tokens\":1}}}\n\n\
            event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        let mut s = canned(Translate::Anthropic(AnthropicMessage::default()), &[overloaded]);
        let (chunks, failure) = drain(&mut s).await;
        assert_eq!(chunks.len(), 1, "the role chunk came before the error");
        let f = failure.unwrap();
        assert_eq!(
            (f.class, f.code, f.status),
            (FailureClass::Overload, "provider_overloaded", None)
        );
        assert_eq!(s.usage().input_tokens, 7);

        let openai = "data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\",\"param\":null,\"code\":null}}\n\n";
        let mut s = canned(Translate::OpenAi, &[openai]);
        let f = drain(&mut s).await.1.unwrap();
        assert_eq!((f.class, f.code), (FailureClass::Overload, "provider_error"));
        assert!(f.message.contains("boom"));
    }

    // ---- against the mock over HTTP ----

    struct Setup {
        mock: MockProvider,
        providers: Providers,
        /// Kept so the mock serves as long as the test runs.
        _serving: LocalMock,
    }

    async fn setup(mock_toml: &str) -> Setup {
        let serving = MockProvider::new(MockConfig::from_toml_str(mock_toml).unwrap())
            .start_local()
            .await
            .unwrap();
        let (mock, addr) = (serving.provider.clone(), serving.addr);
        let config = Config::parse(
            &format!(
                r#"
                [[providers]]
                name = "oai"
                kind = "openai"
                base_url = "http://{addr}/v1"
                keys = [{{ name = "k1", value = "sk-1" }}]
                models = ["gpt-4o-mini"]
                [[providers]]
                name = "ant"
                kind = "anthropic"
                base_url = "http://{addr}"
                keys = [{{ name = "a1", value = "ak-1" }}]
                models = ["claude-x"]
                [[tenants]]
                name = "t"
                api_key = "tk-test"
                "#
            ),
            "streaming test",
        )
        .unwrap();
        Setup {
            mock,
            providers: Providers::from_config(&config).unwrap(),
            _serving: serving,
        }
    }

    const MOCK: &str = r#"
        output_tokens = 5
        [[projects]]
        name = "oai"
        kind = "openai"
        keys = ["sk-1"]
        rpm = 100
        tpm = 100000
        [[projects]]
        name = "ant"
        kind = "anthropic"
        keys = ["ak-1"]
        rpm = 100
        otpm = 10000
    "#;

    fn openai() -> Target {
        Target {
            provider: "oai".to_owned(),
            kind: ProviderKind::Openai,
            model: "gpt-4o-mini".to_owned(),
            key: None,
        }
    }

    fn anthropic_target() -> Target {
        Target {
            provider: "ant".to_owned(),
            kind: ProviderKind::Anthropic,
            model: "claude-x".to_owned(),
            key: None,
        }
    }

    /// 3 + (4 + 3) = 10 input tokens by the mock's rule.
    fn request(max_tokens: Option<u64>) -> Value {
        let mut r = json!({"model": "fast", "messages": [{"role": "user", "content": "hello world!"}]});
        if let Some(m) = max_tokens {
            r["max_tokens"] = json!(m);
        }
        r
    }

    async fn collect(s: &mut ChatStream) -> Vec<Value> {
        let mut out = Vec::new();
        while let Some(c) = s.next_chunk().await {
            out.push(serde_json::from_str(&c.unwrap()).unwrap());
        }
        out
    }

    fn text_of(chunks: &[Value]) -> String {
        chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/delta/content").and_then(Value::as_str))
            .collect()
    }

    fn finish_of(chunks: &[Value]) -> Vec<&str> {
        chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/finish_reason").and_then(Value::as_str))
            .collect()
    }

    async fn until(mock: &MockProvider, what: &str, done: impl Fn(&MockStats) -> bool) -> MockStats {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = mock.stats();
            if done(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}: {s:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn openai_stream_reassembles_text_and_usage() {
        let t = setup(MOCK).await;
        let mut s = t.providers.call_stream(&openai(), &request(None)).await.unwrap();
        assert_eq!((s.key_name.as_str(), s.status), ("k1", 200));
        assert!(s.request_id.as_deref().unwrap().starts_with("req_"));
        assert_eq!(
            s.rate_limit.as_ref().unwrap()["x-ratelimit-limit-requests"],
            "100"
        );
        let chunks = collect(&mut s).await;
        assert!(s.finished());
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
        assert_eq!(text_of(&chunks), "lorem ipsum dolor sit amet");
        assert_eq!(finish_of(&chunks), ["stop"]);
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(
            last["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15})
        );
        assert!(!s.last_was_usage(), "reset after the end");
        assert_eq!(
            s.usage(),
            Usage {
                input_tokens: 10,
                output_tokens: 5,
                cached_tokens: 0
            }
        );

        // A cap below output_tokens: finish_reason "length".
        let mut s = t
            .providers
            .call_stream(&openai(), &request(Some(2)))
            .await
            .unwrap();
        let chunks = collect(&mut s).await;
        assert_eq!(text_of(&chunks), "lorem ipsum");
        assert_eq!(finish_of(&chunks), ["length"]);
        assert_eq!(s.usage().output_tokens, 2);
        let stats = until(&t.mock, "both streams done", |s| s.in_flight == 0).await;
        assert_eq!((stats.streams_started, stats.streams_completed), (2, 2));
        assert!(ChatStream::client_wants_usage(
            &json!({"stream_options": {"include_usage": true}})
        ));
        assert!(!ChatStream::client_wants_usage(&request(None)));
    }

    #[tokio::test]
    async fn anthropic_stream_translates_to_openai_chunks() {
        let t = setup(MOCK).await;
        let mut r = request(Some(3));
        r["messages"] = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello world!"}
        ]);
        let mut s = t.providers.call_stream(&anthropic_target(), &r).await.unwrap();
        assert_eq!(s.key_name, "a1");
        assert!(s.request_id.as_deref().unwrap().starts_with("req_"));
        let mut chunks = Vec::new();
        let mut usage_flags = Vec::new();
        while let Some(c) = s.next_chunk().await {
            chunks.push(serde_json::from_str::<Value>(&c.unwrap()).unwrap());
            usage_flags.push(s.last_was_usage());
        }
        assert!(s.finished());
        assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
        assert!(chunks.iter().all(|c| c["model"] == "claude-x"));
        let id = chunks[0]["id"].as_str().unwrap();
        assert!(id.starts_with("msg_"));
        assert!(chunks.iter().all(|c| c["id"] == id));
        assert_eq!(
            chunks[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(text_of(&chunks), "lorem ipsum dolor");
        assert_eq!(finish_of(&chunks), ["length"]);
        // role, 3 tokens, finish, usage
        assert_eq!(chunks.len(), 6);
        assert_eq!(usage_flags, [false, false, false, false, false, true]);
        // system "be brief" (8 chars) counts as a message: 3 + (4 + 2) + (4 + 3) = 16.
        assert_eq!(
            chunks[5]["usage"],
            json!({"prompt_tokens": 16, "completion_tokens": 3, "total_tokens": 19,
                   "prompt_tokens_details": {"cached_tokens": 0}})
        );
        assert_eq!(chunks[5]["choices"], json!([]));
        assert_eq!(
            s.usage(),
            Usage {
                input_tokens: 16,
                output_tokens: 3,
                cached_tokens: 0
            }
        );
        let stats = until(&t.mock, "the stream to end", |s| s.in_flight == 0).await;
        assert_eq!((stats.streams_completed, stats.streams_cancelled), (1, 0));
    }

    #[tokio::test]
    async fn rate_limited_before_the_stream_is_classified() {
        let t = setup(
            r#"
            [[projects]]
            name = "oai"
            kind = "openai"
            keys = ["sk-1"]
            rpm = 1
            [[projects]]
            name = "ant"
            kind = "anthropic"
            keys = ["ak-1"]
            rpm = 1
            "#,
        )
        .await;
        for target in [openai(), anthropic_target()] {
            let mut first = t.providers.call_stream(&target, &request(Some(2))).await.unwrap();
            collect(&mut first).await;
            let Err(outcome) = t.providers.call_stream(&target, &request(Some(2))).await else {
                panic!("{} should be rate limited", target.label());
            };
            assert_eq!(outcome.status, Some(429));
            assert!(outcome.request_id.as_deref().unwrap().starts_with("req_"));
            assert!(!outcome.key_name.is_empty());
            assert!(outcome.rate_limit.as_ref().unwrap().get("retry-after").is_some());
            let f = outcome.result.unwrap_err();
            assert_eq!(
                (f.class, f.code, f.status),
                (FailureClass::Capacity, "rate_limited", Some(429))
            );
            assert!(f.retry_after.is_some());
        }
        let stats = t.mock.stats();
        assert_eq!((stats.streams_started, stats.rate_limited_429), (2, 2));

        let unknown = Target {
            provider: "nope".to_owned(),
            ..openai()
        };
        let outcome = t
            .providers
            .call_stream(&unknown, &request(None))
            .await
            .unwrap_err();
        assert_eq!(outcome.result.unwrap_err().code, "unknown_provider");
    }

    #[tokio::test]
    async fn dropping_the_stream_cancels_the_upstream_call() {
        let t = setup(
            r#"
            output_tokens = 400
            latency_per_output_token_us = 10000
            [[projects]]
            name = "oai"
            kind = "openai"
            keys = ["sk-1"]
            [[projects]]
            name = "ant"
            kind = "anthropic"
            keys = ["ak-1"]
            "#,
        )
        .await;
        for (i, target) in [openai(), anthropic_target()].into_iter().enumerate() {
            let mut s = t.providers.call_stream(&target, &request(None)).await.unwrap();
            let mut content = 0;
            while content < 3 {
                let c: Value = serde_json::from_str(&s.next_chunk().await.unwrap().unwrap()).unwrap();
                if c.pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty())
                {
                    content += 1;
                }
            }
            // The estimate covers at least what was received.
            assert!(s.usage().output_tokens >= 3);
            assert!(!s.finished());
            drop(s);
            let cancelled = i as u64 + 1;
            let stats = until(&t.mock, "the mock to see the disconnect", |s| {
                s.streams_cancelled == cancelled && s.in_flight == 0
            })
            .await;
            assert_eq!(stats.streams_completed, 0);
            let project = if i == 0 { "oai" } else { "ant" };
            let produced = stats.projects[project].output_tokens_admitted;
            assert!((3..400).contains(&produced), "{project} produced {produced}");
        }
    }
}
