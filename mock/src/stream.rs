//! Streaming responses (`"stream": true`, Gemini's `streamGenerateContent`) as
//! server-sent events.
//!
//! Admission is the handlers' (same checks, same errors, same charges as non-streaming);
//! this module only produces the body of an admitted stream. Timing: the headers go out
//! at once, the base latency passes before the first event, and the per-output-token
//! latency before each token event, so the whole stream takes what the non-streaming
//! response would. Token `i` is [`CannedText::token`]: the tokens concatenate to the
//! non-streaming text. With `n` choices, as OpenAI streams them, each choice has its own
//! role chunk, its tokens interleaved with the others' (chunk `k` carries choice `k % n`)
//! and its own finish chunk; the usage chunk sums them.
//!
//! Accounting ([`StreamGuard`]): a stream that produces its last event is settled right
//! then (`streams_completed`, OTPM corrected to its output), before the client can read
//! that event. A body dropped earlier — the client disconnected — counts only the tokens
//! it produced: OTPM gets the rest of the reservation back, `output_tokens_admitted` is
//! corrected, and `streams_cancelled` goes up. `in_flight` goes down when the body is
//! dropped either way.

use std::time::Duration;

use axum::body::{Body, Bytes};
use serde_json::{Value, json};

use super::request::CannedText;
use super::{MockProvider, stats};

/// What an admitted stream sends, besides its tokens.
pub(super) enum Shape {
    /// Chat Completions chunks: `data: {chunk}` lines, then `data: [DONE]`.
    OpenAi {
        id: String,
        created: i64,
        model: String,
        finish_reason: &'static str,
        /// `stream_options.include_usage`: every chunk carries `"usage": null` and a
        /// last chunk with `"choices": []` carries the usage.
        include_usage: bool,
        input: u64,
        /// `n`: choices streamed side by side.
        choices: u64,
    },
    /// Messages API events: `event: X` + `data: {json}`.
    Anthropic {
        id: String,
        model: String,
        stop_reason: &'static str,
        input: u64,
    },
    /// `streamGenerateContent?alt=sse`: each event a `GenerateContentResponse` with one
    /// token's text, the last with the `finishReason`, the function call if the mock makes
    /// one, and the whole `usageMetadata`. Events end in `\r\n\r\n`, as Google's do.
    Gemini {
        id: String,
        model: String,
        finish_reason: &'static str,
        input: u64,
        call: Option<Value>,
    },
    /// ConverseStream: AWS event-stream messages (`messageStart`, a `contentBlockDelta` per
    /// token, `contentBlockStop`, `messageStop`, `metadata` with the usage).
    Bedrock { stop_reason: &'static str, input: u64 },
}

/// Settles an admitted stream's accounting at its last event or, failing that, when its
/// body is dropped; owns the request's `in_flight` count (the handler's guard was handed
/// over).
pub(super) struct StreamGuard {
    provider: MockProvider,
    project: usize,
    /// Tokens the stream generates if it runs to the end.
    output: u64,
    /// OTPM reserved at admission; 0 when the project has no OTPM limit (nothing to give back).
    otpm_reserved: u64,
    /// Token events sent so far.
    produced: u64,
    /// The last event was produced and the stream settled.
    completed: bool,
}

impl StreamGuard {
    /// Takes over an admitted request; counts the stream as started.
    pub(super) fn new(provider: MockProvider, project: usize, output: u64, otpm_reserved: u64) -> Self {
        stats::bump(&provider.inner.totals.streams_started);
        Self {
            provider,
            project,
            output,
            otpm_reserved,
            produced: 0,
            completed: false,
        }
    }

    /// The last event is being produced: count the stream complete and correct OTPM to
    /// its output.
    fn complete(&mut self) {
        if self.completed {
            return;
        }
        self.completed = true;
        stats::bump(&self.provider.inner.totals.streams_completed);
        self.refund(self.output);
    }

    /// Gives back the OTPM reserved beyond `generated`.
    fn refund(&self, generated: u64) {
        let inner = &*self.provider.inner;
        let refund = self.otpm_reserved.saturating_sub(generated);
        if refund > 0 {
            inner.lock(self.project).refund_output(refund, &inner.clock);
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let inner = &*self.provider.inner;
        if !self.completed {
            stats::bump(&inner.totals.streams_cancelled);
            inner.projects[self.project]
                .counters
                .not_generated(self.output.saturating_sub(self.produced));
            self.refund(self.produced);
            tracing::debug!(
                project = %inner.projects[self.project].name,
                produced = self.produced,
                of = self.output,
                "mock stream dropped by the client"
            );
        }
        inner.totals.end();
    }
}

/// Where a stream is.
struct Cursor {
    guard: StreamGuard,
    shape: Shape,
    /// Index of the next event: the shape's opening events, then the tokens, then its
    /// closing events.
    step: u64,
    latency: Duration,
    per_token: Duration,
}

/// The SSE body of an admitted stream.
pub(super) fn body(guard: StreamGuard, shape: Shape) -> Body {
    let inner = &guard.provider.inner;
    let cursor = Cursor {
        latency: inner.latency,
        per_token: inner.latency_per_output_token,
        guard,
        shape,
        step: 0,
    };
    let events = futures::stream::unfold(cursor, |mut c| async move {
        let event = c.next().await?;
        Some((Ok::<_, std::convert::Infallible>(event), c))
    });
    Body::from_stream(events)
}

impl Cursor {
    async fn next(&mut self) -> Option<Bytes> {
        let opening = self.shape.opening();
        let n = self.guard.output;
        let step = self.step;
        self.step += 1;
        if step == 0 && !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        if step < opening {
            return Some(self.shape.opening_event(step));
        }
        let i = step - opening;
        if i < n {
            if !self.per_token.is_zero() {
                tokio::time::sleep(self.per_token).await;
            }
            self.guard.produced += 1;
            return Some(self.shape.token_event(i));
        }
        let j = i - n;
        let closing = self.shape.closing();
        if j >= closing {
            return None;
        }
        if j + 1 == closing {
            self.guard.complete();
        }
        Some(self.shape.closing_event(j, n))
    }
}

fn data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// One AWS event-stream message: `:event-type` `name`, a JSON payload.
fn aws_event(name: &str, v: &Value) -> Bytes {
    use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
    let string = |s: &str| HeaderValue::String(s.to_owned().into());
    let message = Message::new(v.to_string().into_bytes())
        .add_header(Header::new(":event-type", string(name)))
        .add_header(Header::new(":content-type", string("application/json")))
        .add_header(Header::new(":message-type", string("event")));
    let mut out = Vec::new();
    match aws_smithy_eventstream::frame::write_message_to(&message, &mut out) {
        Ok(()) => Bytes::from(out),
        Err(e) => {
            tracing::error!(%e, "mock event-stream message not written");
            Bytes::new()
        }
    }
}

fn event(name: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}

impl Shape {
    /// Events before the first token.
    fn opening(&self) -> u64 {
        match self {
            Shape::OpenAi { choices, .. } => *choices,
            Shape::Anthropic { .. } => 3,
            Shape::Gemini { .. } => 0,
            Shape::Bedrock { .. } => 1,
        }
    }

    /// Events after the last token.
    fn closing(&self) -> u64 {
        match self {
            Shape::OpenAi {
                include_usage,
                choices,
                ..
            } => choices + 1 + u64::from(*include_usage),
            Shape::Anthropic { .. } => 3,
            Shape::Gemini { .. } => 1,
            Shape::Bedrock { .. } => 3,
        }
    }

    /// A Chat Completions chunk of choice `index`.
    fn chunk(&self, index: u64, delta: Value, finish_reason: Option<&str>) -> Value {
        let Shape::OpenAi {
            id,
            created,
            model,
            include_usage,
            ..
        } = self
        else {
            return Value::Null;
        };
        let mut chunk = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        });
        if *include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    fn opening_event(&self, step: u64) -> Bytes {
        match self {
            Shape::Gemini { .. } => Bytes::new(),
            Shape::Bedrock { .. } => aws_event("messageStart", &json!({"role": "assistant"})),
            Shape::OpenAi { .. } => {
                data(&self.chunk(step, json!({"role": "assistant", "content": ""}), None))
            }
            Shape::Anthropic { id, model, input, .. } => match step {
                0 => event(
                    "message_start",
                    &json!({"type": "message_start", "message": {
                        "id": id, "type": "message", "role": "assistant", "model": model,
                        "content": [], "stop_reason": null, "stop_sequence": null,
                        "usage": {"input_tokens": input, "output_tokens": 1},
                    }}),
                ),
                1 => event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}),
                ),
                _ => event("ping", &json!({"type": "ping"})),
            },
        }
    }

    /// Token event `i` of the stream.
    fn token_event(&self, i: u64) -> Bytes {
        match self {
            Shape::OpenAi { choices, .. } => data(&self.chunk(
                i % choices,
                json!({"content": CannedText::token(i / choices)}),
                None,
            )),
            Shape::Anthropic { .. } => event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": CannedText::token(i)}}),
            ),
            Shape::Bedrock { .. } => aws_event(
                "contentBlockDelta",
                &json!({"contentBlockIndex": 0, "delta": {"text": CannedText::token(i)}}),
            ),
            Shape::Gemini { input, .. } => self.gemini(
                json!([{"text": CannedText::token(i)}]),
                None,
                json!({"promptTokenCount": input, "totalTokenCount": input}),
            ),
        }
    }

    /// A Gemini event: one candidate of `parts`, its finish reason, and `usage`.
    fn gemini(&self, parts: Value, finish_reason: Option<&str>, usage: Value) -> Bytes {
        let Shape::Gemini { id, model, .. } = self else {
            return Bytes::new();
        };
        let mut candidate = json!({"content": {"parts": parts, "role": "model"}, "index": 0});
        if let Some(reason) = finish_reason {
            candidate["finishReason"] = json!(reason);
        }
        let response = json!({"candidates": [candidate], "usageMetadata": usage,
                              "modelVersion": model, "responseId": id});
        Bytes::from(format!("data: {response}\r\n\r\n"))
    }

    fn closing_event(&self, j: u64, output: u64) -> Bytes {
        match self {
            Shape::OpenAi {
                id,
                created,
                model,
                finish_reason,
                include_usage,
                input,
                choices,
            } => match (j, include_usage) {
                (j, _) if j < *choices => data(&self.chunk(j, json!({}), Some(finish_reason))),
                (j, true) if j == *choices => data(&json!({
                    "id": id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": input,
                        "completion_tokens": output,
                        "total_tokens": input + output,
                    },
                })),
                _ => Bytes::from_static(b"data: [DONE]\n\n"),
            },
            Shape::Anthropic { stop_reason, .. } => match j {
                0 => event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                ),
                1 => event(
                    "message_delta",
                    &json!({"type": "message_delta",
                            "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                            "usage": {"output_tokens": output}}),
                ),
                _ => event("message_stop", &json!({"type": "message_stop"})),
            },
            Shape::Gemini {
                finish_reason,
                input,
                call,
                ..
            } => {
                let parts = match call {
                    Some(call) => json!([{"functionCall": call}]),
                    None => json!([{"text": ""}]),
                };
                let usage = json!({"promptTokenCount": input, "candidatesTokenCount": output,
                                   "totalTokenCount": input + output});
                self.gemini(parts, Some(finish_reason), usage)
            }
            Shape::Bedrock { stop_reason, input } => match j {
                0 => aws_event("contentBlockStop", &json!({"contentBlockIndex": 0})),
                1 => aws_event("messageStop", &json!({"stopReason": stop_reason})),
                _ => aws_event(
                    "metadata",
                    &json!({"usage": {"inputTokens": input, "outputTokens": output,
                                      "totalTokens": input + output},
                            "metrics": {"latencyMs": 1}}),
                ),
            },
        }
    }
}
