//! Streams at the provider layer: [`Providers::call_stream`] sends a request with `stream:
//! true` through the same send path as plain calls and, once the provider has answered
//! 2xx, hands back a [`ChatStream`] that yields the provider's events — as OpenAI
//! `chat.completion.chunk`s for chat, as they are for Anthropic Messages and Responses —
//! while keeping count of the usage.
//! What an event means is the adapter's ([`StreamEvents`], one per provider file); this
//! module owns what every stream shares: reading the body, the end-marker and failure
//! rules, and the usage tally.
//!
//! - Admission failures (any non-2xx before the stream starts) are classified exactly as
//!   for non-streaming calls and come back as a [`CallOutcome`] whose `result` is the
//!   `Err`, ready for the attempt record.
//! - Cancellation: the [`ChatStream`] owns the upstream response body; dropping it drops
//!   the body and so closes the upstream connection, which is how the provider learns
//!   that the call is abandoned. Nothing is spawned.
//! - The usage chunk (`"choices": []` plus `usage`) is always requested and always
//!   yielded, last; whether the client sees it is the caller's decision
//!   ([`ChatStream::client_wants_usage`], [`ChatStream::last_was_usage`]).
//! - The HTTP client's `dispatch.request_timeout_secs` bounds the whole stream, body
//!   included; hitting it ends the stream with a `provider_timeout` failure.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::body::Bytes;
use futures::Stream;
use reqwest::header::{CONTENT_TYPE, HeaderMap};
use serde_json::Value;
use tollgate::model::Usage;
use tollgate::retry::{Failure, FailureClass, classify_response};
use tollgate::routing::Target;
use tollgate::vocab::{Endpoint, ReasonCode};

use super::as_chat::{AsChat, ChunkEvents};
use super::aws_events::AwsEventReader;
use super::sse::{SseEvent, SseParser};
use super::{Answered, CallOutcome, Mode, Providers, send_failure};

/// How one provider's stream events become the chunks relayed to the client: OpenAI
/// chunks for chat (translated where the provider's events are not), or the events as
/// they are for Anthropic Messages and Responses. A fresh value per stream, so it may keep
/// what later chunks repeat (Anthropic's message id and model).
pub trait StreamEvents: Send {
    /// How the provider frames its events on the wire.
    fn framing(&self) -> Framing {
        Framing::Sse
    }

    /// Handles one event with data: chunks to yield and usage go to `out`, and
    /// `out.finish()` when it is the provider's end marker. An error event (or one that
    /// is not JSON) is the `Err`, which ends the stream.
    fn on_event(&mut self, event: SseEvent, out: &mut StreamOut) -> Result<(), Failure>;
}

/// How a provider frames the events of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `text/event-stream` (every provider but Bedrock).
    Sse,
    /// AWS's binary `application/vnd.amazon.eventstream` (Bedrock's ConverseStream), each
    /// message read as an event named by its `:event-type` header
    /// ([`super::aws_events`]).
    AwsEventStream,
}

impl Framing {
    /// The content type a stream of this framing is answered with.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Sse => "text/event-stream",
            Self::AwsEventStream => "application/vnd.amazon.eventstream",
        }
    }

    fn decoder(self) -> Decoder {
        match self {
            Self::Sse => Decoder::Sse(SseParser::default()),
            Self::AwsEventStream => Decoder::Aws(AwsEventReader::default()),
        }
    }
}

/// The reader of a stream's bytes into events, by its [`Framing`].
enum Decoder {
    Sse(SseParser),
    Aws(AwsEventReader),
}

impl Decoder {
    fn push(&mut self, bytes: &[u8]) -> Result<(), String> {
        match self {
            Self::Sse(p) => p.push(bytes),
            Self::Aws(r) => r.push(bytes),
        }
    }

    fn finish(&mut self) {
        if let Self::Sse(p) = self {
            p.finish();
        }
    }

    fn next_event(&mut self) -> Option<SseEvent> {
        match self {
            Self::Sse(p) => p.next_event(),
            Self::Aws(r) => r.next_event(),
        }
    }
}

/// Whether an event reports an error instead of content: an SSE `event: error`, an
/// object of `"type": "error"` (Anthropic) or one carrying an `error` (OpenAI).
pub fn is_error_event(event: &SseEvent, v: &Value) -> bool {
    event.event.as_deref() == Some("error")
        || v.get("type").and_then(Value::as_str) == Some("error")
        || v.get("error").is_some_and(|e| !e.is_null())
}

/// What every OpenAI chunk of a translated stream repeats: the message's id and model, and
/// when it was created. An adapter that translates its provider's events keeps one.
#[derive(Debug, Default)]
pub struct ChunkHead {
    pub id: Value,
    pub model: Value,
    pub created: i64,
}

impl ChunkHead {
    pub fn new(id: Value, model: Value) -> Self {
        Self {
            id,
            model,
            created: chrono::Utc::now().timestamp(),
        }
    }

    /// An OpenAI chunk with one choice carrying `delta`.
    pub fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> String {
        serde_json::json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        })
        .to_string()
    }

    /// The usage chunk (`"choices": []` with `usage`) of the usage `out` holds, then the
    /// end of the stream.
    pub fn finish_with_usage(&self, out: &mut StreamOut) {
        let usage = out.usage();
        let chunk = serde_json::json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": {
                "prompt_tokens": usage.input_tokens,
                "completion_tokens": usage.output_tokens,
                "total_tokens": usage.input_tokens + usage.output_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            },
        });
        out.usage_chunk(chunk.to_string());
        out.finish();
    }
}

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
    parser: Decoder,
    events: Box<dyn StreamEvents>,
    out: StreamOut,
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
            .field("finished", &self.out.finished)
            .field("usage", &self.usage())
            .finish_non_exhaustive()
    }
}

/// What a stream's events have produced: the chunks not yet returned, the usage so far,
/// and whether the provider sent its end marker. Adapters write to it through
/// [`StreamEvents::on_event`].
pub struct StreamOut {
    /// HTTP status of the upstream response, for failures of a malformed event.
    status: u16,
    pending: VecDeque<Pending>,
    tally: Tally,
    /// The provider sent its end marker (`[DONE]` / `message_stop`).
    finished: bool,
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

impl StreamOut {
    fn new(status: u16, estimated_input: i64) -> Self {
        Self {
            status,
            pending: VecDeque::new(),
            tally: Tally {
                estimated_input,
                ..Tally::default()
            },
            finished: false,
        }
    }

    /// Yields `text` (the JSON of one OpenAI chunk) as the next chunk.
    pub fn chunk(&mut self, text: String) {
        self.pending.push_back(Pending { text, usage: false });
    }

    /// Yields `text` as the usage chunk (`"choices": []` with `usage`).
    pub fn usage_chunk(&mut self, text: String) {
        self.pending.push_back(Pending { text, usage: true });
    }

    /// The provider has ended the stream normally.
    pub fn finish(&mut self) {
        self.finished = true;
    }

    /// Counts a content delta, for the output estimate of a stream that is cut.
    pub fn content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.tally.deltas += 1;
        self.tally.chars += i64::try_from(text.chars().count()).unwrap_or(i64::MAX);
    }

    /// Input tokens the provider reported (cached ones included), and of them cached.
    pub fn input(&mut self, tokens: i64, cached: i64) {
        self.tally.input = Some(tokens);
        self.tally.cached = cached;
    }

    /// Output tokens the provider reported.
    pub fn output(&mut self, tokens: i64) {
        self.tally.output = Some(tokens);
    }

    /// Usage seen so far: see [`ChatStream::usage`].
    pub fn usage(&self) -> Usage {
        let t = &self.tally;
        Usage {
            input_tokens: t.input.unwrap_or(t.estimated_input),
            output_tokens: t.output.unwrap_or_else(|| t.deltas.max((t.chars + 3) / 4)),
            cached_tokens: t.cached,
        }
    }

    /// An event's data as JSON; a `provider_bad_response` failure when it is not.
    pub fn json(&self, data: &str) -> Result<Value, Failure> {
        serde_json::from_str(data)
            .map_err(|e| self.bad_response(format!("provider sent a stream event that is not JSON: {e}")))
    }

    /// Classifies an error event sent after the stream started through `status`, the HTTP
    /// status its error type stands for (the adapter knows its provider's types); the
    /// HTTP status was 2xx, so the failure carries none.
    pub fn error_event(&self, status: u16, raw: &str) -> Failure {
        let mut failure = classify_response(status, &HeaderMap::new(), raw.as_bytes());
        failure.status = None;
        failure.message = format!("error event in the stream: {}", failure.message);
        failure
    }

    fn bad_response(&self, reason: impl Into<String>) -> Failure {
        Failure::bad_response(reason, self.status)
    }
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
        self.out.usage()
    }

    /// The provider ended the stream normally (`[DONE]`, or Anthropic's `message_stop`).
    pub fn finished(&self) -> bool {
        self.out.finished
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
            if let Some(p) = self.out.pending.pop_front() {
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
                if self.out.finished {
                    self.end();
                }
                continue;
            }
            match ready!(self.body.as_mut().poll_next(cx)) {
                Some(Ok(bytes)) => {
                    if let Err(reason) = self.parser.push(&bytes) {
                        let f = self.out.bad_response(reason);
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
                        if self.out.finished {
                            break;
                        }
                    }
                    self.end();
                    if !self.out.finished {
                        let f = Failure::network("the provider ended the stream before its end marker");
                        return Poll::Ready(Some(Err(self.fail(f))));
                    }
                }
            }
        }
    }

    /// Events without data (keep-alives) mean nothing; the rest are the adapter's.
    fn on_event(&mut self, event: SseEvent) -> Result<(), Failure> {
        if event.data.trim().is_empty() {
            return Ok(());
        }
        self.events.on_event(event, &mut self.out)
    }

    /// Stops reading and lets go of the upstream body (closing the connection if the
    /// provider has not closed it yet).
    fn end(&mut self) {
        self.ended = true;
        self.body = Box::pin(futures::stream::empty());
    }

    /// Ends the stream on a failure; chunks not yet returned are dropped.
    fn fail(&mut self, failure: Failure) -> Failure {
        self.out.pending.clear();
        self.end();
        failure
    }
}

impl Stream for ChatStream {
    type Item = Result<String, Failure>;

    /// The same items as [`ChatStream::next_chunk`].
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_next_chunk(cx)
    }
}

impl Providers {
    /// Sends `request` (OpenAI chat format) to `target` with `stream: true` and the
    /// provider's next key, through the send path of [`Providers::call`]: the adapter
    /// builds the provider's streaming request (for OpenAI-style providers with
    /// `stream_options.include_usage` set, so that usage arrives). A provider tollgate
    /// does not stream from is refused with `streaming_unsupported` before anything is
    /// sent. A non-2xx answer (or a 2xx that is not an event stream) is classified exactly
    /// as non-streaming calls are and returned as a [`CallOutcome`] whose `result` is the
    /// `Err`.
    pub async fn call_stream(
        &self,
        target: &Target,
        endpoint: Endpoint,
        request: &Value,
    ) -> Result<ChatStream, CallOutcome> {
        let client = self.client(target).map_err(CallOutcome::refused)?;
        // A request of an endpoint the target does not speak streams as chat, relayed as
        // the endpoint's events.
        let as_chat = AsChat::of(target.kind, endpoint);
        let chat;
        let (endpoint, request) = match as_chat {
            Some(as_chat) => {
                chat = as_chat.chat_request(request);
                (Endpoint::ChatCompletions, &chat)
            }
            None => (endpoint, request),
        };
        let events = client
            .api
            .stream_events(endpoint, &target.model)
            .map(|chat| -> Box<dyn StreamEvents> {
                match as_chat {
                    Some(as_chat) => Box::new(Translated {
                        chat,
                        events: as_chat.events(),
                    }),
                    None => chat,
                }
            });
        let Some(events) = events else {
            return Err(CallOutcome::refused(Failure {
                class: FailureClass::Request,
                code: ReasonCode::StreamingUnsupported,
                message: format!(
                    "provider {:?} does not stream through tollgate yet; send the request without `stream`",
                    target.provider
                ),
                status: None,
                retry_after: None,
            }));
        };
        let Answered {
            response,
            headers,
            mut outcome,
        } = client
            .send(&self.http, target, endpoint, request, Mode::Stream)
            .await?;
        let status = response.status().as_u16();
        let framing = events.framing();
        let content_type = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(framing.content_type());
        if !content_type.trim_start().starts_with(framing.content_type()) {
            outcome.result = Err(Failure::bad_response(
                format!("provider answered a streaming request with {content_type:?}, not an event stream"),
                status,
            ));
            return Err(outcome);
        }
        Ok(ChatStream {
            key_name: outcome.key_name,
            status,
            request_id: outcome.request_id,
            rate_limit: outcome.rate_limit,
            body: Box::pin(response.bytes_stream()),
            parser: framing.decoder(),
            events,
            out: StreamOut::new(
                status,
                i64::from(tollgate::estimate::input_tokens(request, Some(&target.model))),
            ),
            ended: false,
            last_was_usage: false,
        })
    }
}

/// A chat stream's chunks relayed as another endpoint's events, for a job sent to its
/// target as chat ([`AsChat`]): the target's own chat events read first, then each chunk
/// they made translated.
struct Translated {
    chat: Box<dyn StreamEvents>,
    events: Box<dyn ChunkEvents>,
}

impl StreamEvents for Translated {
    fn framing(&self) -> Framing {
        self.chat.framing()
    }

    fn on_event(&mut self, event: SseEvent, out: &mut StreamOut) -> Result<(), Failure> {
        let (before, was_finished) = (out.pending.len(), out.finished);
        self.chat.on_event(event, out)?;
        let chunks: Vec<Pending> = out.pending.drain(before..).collect();
        for chunk in chunks {
            let chunk = out.json(&chunk.text)?;
            for e in self.events.chunk(&chunk) {
                out.chunk(e.to_string());
            }
        }
        if out.finished && !was_finished {
            for e in self.events.end() {
                out.chunk(e.to_string());
            }
        }
        Ok(())
    }
}

impl ChatStream {
    /// A stream over `pieces` of a 2xx body, read by `events`, without HTTP; the request's
    /// input is estimated at 42 tokens. For the tests and the fuzz body.
    pub(crate) fn over(events: Box<dyn StreamEvents>, pieces: Vec<Bytes>) -> Self {
        let chunks: Vec<reqwest::Result<Bytes>> = pieces.into_iter().map(Ok).collect();
        ChatStream {
            key_name: "k".to_owned(),
            status: 200,
            request_id: None,
            rate_limit: None,
            body: Box::pin(futures::stream::iter(chunks)),
            parser: events.framing().decoder(),
            events,
            out: StreamOut::new(200, 42),
            ended: false,
            last_was_usage: false,
        }
    }
}

#[cfg(test)]
impl ChatStream {
    /// [`ChatStream::over`] text pieces.
    pub(crate) fn canned(events: Box<dyn StreamEvents>, pieces: &[&str]) -> Self {
        let pieces = pieces
            .iter()
            .map(|p| Bytes::copy_from_slice(p.as_bytes()))
            .collect();
        Self::over(events, pieces)
    }

    /// Every chunk, parsed, with whether it was the usage chunk; panics on a failure.
    pub(crate) async fn flagged(&mut self) -> (Vec<Value>, Vec<bool>) {
        let mut chunks = Vec::new();
        let mut usage_flags = Vec::new();
        while let Some(c) = self.next_chunk().await {
            chunks.push(serde_json::from_str::<Value>(&c.unwrap()).unwrap());
            usage_flags.push(self.last_was_usage());
        }
        (chunks, usage_flags)
    }

    /// Every chunk, then the failure the stream ended in, if any.
    pub(crate) async fn drain(&mut self) -> (Vec<String>, Option<Failure>) {
        let mut chunks = Vec::new();
        while let Some(item) = self.next_chunk().await {
            match item {
                Ok(c) => chunks.push(c),
                Err(f) => {
                    assert!(self.next_chunk().await.is_none(), "nothing after a failure");
                    return (chunks, Some(f));
                }
            }
        }
        (chunks, None)
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
    use crate::providers::openai;
    use tollgate_mock::{LocalMock, MockConfig, MockProvider, MockStats};

    /// An API handler holds the stream (and awaits the call) across awaits: both must be
    /// `Send`.
    #[test]
    fn stream_and_call_are_send() {
        fn send<T: Send>(_: &T) {}
        fn _call(p: &Providers, t: &Target, r: &Value) {
            send(&p.call_stream(t, Endpoint::ChatCompletions, r));
        }
        let s = ChatStream::canned(Box::new(openai::Chunks), &[]);
        send(&s);
    }

    #[tokio::test]
    async fn keep_alives_are_skipped_and_a_missing_end_marker_fails() {
        let mut s = ChatStream::canned(
            Box::new(openai::Chunks),
            &["data: 

: keep-alive

"],
        );
        let (chunks, failure) = s.drain().await;
        assert!(chunks.is_empty());
        assert_eq!(failure.unwrap().code, ReasonCode::NetworkError);
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
        let mut s = t
            .providers
            .call_stream(&openai(), Endpoint::ChatCompletions, &request(None))
            .await
            .unwrap();
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
            .call_stream(&openai(), Endpoint::ChatCompletions, &request(Some(2)))
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
        let mut s = t
            .providers
            .call_stream(&anthropic_target(), Endpoint::ChatCompletions, &r)
            .await
            .unwrap();
        assert_eq!(s.key_name, "a1");
        assert!(s.request_id.as_deref().unwrap().starts_with("req_"));
        let (chunks, usage_flags) = s.flagged().await;
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
            let mut first = t
                .providers
                .call_stream(&target, Endpoint::ChatCompletions, &request(Some(2)))
                .await
                .unwrap();
            collect(&mut first).await;
            let Err(outcome) = t
                .providers
                .call_stream(&target, Endpoint::ChatCompletions, &request(Some(2)))
                .await
            else {
                panic!("{} should be rate limited", target.label());
            };
            assert_eq!(outcome.status, Some(429));
            assert!(outcome.request_id.as_deref().unwrap().starts_with("req_"));
            assert!(!outcome.key_name.is_empty());
            assert!(outcome.rate_limit.as_ref().unwrap().get("retry-after").is_some());
            let f = outcome.result.unwrap_err();
            assert_eq!(
                (f.class, f.code, f.status),
                (FailureClass::Capacity, ReasonCode::RateLimited, Some(429))
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
            .call_stream(&unknown, Endpoint::ChatCompletions, &request(None))
            .await
            .unwrap_err();
        assert_eq!(outcome.result.unwrap_err().code, ReasonCode::UnknownProvider);
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
            let mut s = t
                .providers
                .call_stream(&target, Endpoint::ChatCompletions, &request(None))
                .await
                .unwrap();
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
