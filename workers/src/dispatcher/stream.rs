//! Streaming jobs, run for the API process whose client is connected: claimed by id,
//! relayed event by event as SSE payloads in the endpoint's shape (OpenAI chunks for chat and
//! legacy completions, Anthropic's and Responses' events as they are), and finished — succeeded, failed,
//! or `client_disconnected` — with the answer put back together and the usage produced so
//! far. No retries: the client is waiting. A stream whose job the heartbeat finds no
//! longer held here (rescued, cancelled) is cut off, and nothing of it is written.

use chrono::Utc;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;
use tollgate::attempt::{End, Outcome, Served};
use tollgate::buckets::Settlement;
use tollgate::model::{Job, JobId, Usage};
use tollgate::retry::{Failure, FailureClass};
use tollgate::routing::Target;
use tollgate::store::{self, StoreError};

use super::{Dispatcher, log_write};
use crate::providers::streaming::ChatStream;
use crate::providers::{CallOutcome, Success, assistant_message};
use tollgate::vocab::{Endpoint, ReasonCode};

impl Dispatcher {
    /// Claims an admitted streaming job for this process (its client is connected here).
    pub async fn claim_stream(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        store::claim_stream_job(
            &self.inner.pool,
            id,
            &self.inner.owner,
            self.inner.clock.now(),
            self.inner.config.dispatch.lease(),
        )
        .await
    }

    /// Runs a claimed streaming job: opens the provider's stream and relays it, as the
    /// `data:` payloads of SSE (a chat stream ending with `[DONE]`), into the returned
    /// receiver. When the stream ends — or the receiver is dropped because the client went
    /// away, which cancels the upstream call — the attempt is recorded and the job
    /// finished with the usage produced so far, settling its reservation. No retries: the
    /// client is waiting; a refusal before the stream starts comes back as the failure.
    pub async fn stream(&self, job: Job, relays: &TaskTracker) -> Result<mpsc::Receiver<String>, Failure> {
        let target = self.target(&job).ok_or_else(|| Failure {
            class: FailureClass::Request,
            code: ReasonCode::UnknownModel,
            message: format!("model {:?} is no longer configured", job.model),
            status: None,
            retry_after: None,
        })?;
        let tracked = self.track(&job);
        let stop = tracked.stop.clone();
        let started_at = self.inner.clock.now();
        let opened = tokio::select! {
            opened = self.inner.providers.call_stream(&target, job.endpoint, &job.request) => opened,
            _ = stop.cancelled() => {
                let settlement = self.settlement(&job, &target, None);
                let served = Served::new(&target.provider, &target.model);
                self.abandon(&job, Some(served), settlement).await;
                return Err(Failure::network("the job was no longer held by this process"));
            }
        };
        let mut upstream = match opened {
            Ok(s) => s,
            Err(called) => {
                let failure = match &called.result {
                    Err(f) => f.clone(),
                    Ok(_) => Failure::network("the provider refused the stream"),
                };
                let settlement = if called.counted() {
                    self.settlement(&job, &target, None)
                } else {
                    Settlement::UNSENT
                };
                let served = Served::new(&target.provider, &target.model);
                let end = End::failed(failure.code, failure.message.clone());
                let finished_at = self.inner.clock.now();
                let outcome = Outcome {
                    call: Some(Self::call_record(&job, &called, started_at, finished_at)),
                    ..Outcome::new(self.holder(&job), Some(served), end, settlement)
                };
                tollgate::job_trace::attempted(&job, &outcome, started_at, finished_at);
                log_write(self.write(outcome, self.inner.clock.now()).await);
                return Err(failure);
            }
        };
        let (tx, rx) = mpsc::channel::<String>(32);
        let this = self.clone();
        let wants_usage = ChatStream::client_wants_usage(&job.request);
        relays.spawn(async move {
            let _tracked = tracked;
            let mut assembled = Assembled::for_endpoint(job.endpoint);
            let mut ended: Result<(), Failure> = Ok(());
            let mut client_gone = false;
            loop {
                let next = tokio::select! {
                    next = upstream.next_chunk() => next,
                    _ = stop.cancelled() => {
                        // Not ours any more: the client's stream ends here, unfinished.
                        drop(upstream);
                        let message = "the job was taken from this process (rescued or cancelled)";
                        let _ = tx.try_send(error_event(job.endpoint, message, ReasonCode::LeaseExpired));
                        let settlement = this.settlement(&job, &target, None);
                        let served = Served::new(&target.provider, &target.model);
                        this.abandon(&job, Some(served), settlement).await;
                        return;
                    }
                };
                let Some(next) = next else { break };
                match next {
                    Ok(chunk) => {
                        assembled.add(&chunk);
                        if upstream.last_was_usage() && !wants_usage {
                            continue;
                        }
                        if tx.send(chunk).await.is_err() {
                            client_gone = true;
                            break;
                        }
                    }
                    Err(failure) => {
                        let _ = tx
                            .send(error_event(job.endpoint, &failure.message, failure.code))
                            .await;
                        ended = Err(failure);
                        break;
                    }
                }
            }
            // OpenAI's chat and completions streams end with `[DONE]`; Anthropic's with
            // their `message_stop`, Responses' with `response.completed`.
            let done_marker = matches!(job.endpoint, Endpoint::ChatCompletions | Endpoint::Completions);
            if !client_gone && ended.is_ok() && done_marker {
                let _ = tx.send("[DONE]".to_owned()).await;
            }
            let usage = upstream.usage();
            let called = CallOutcome {
                key_name: upstream.key_name.clone(),
                reached: true,
                status: Some(upstream.status),
                request_id: upstream.request_id.clone(),
                rate_limit: upstream.rate_limit.clone(),
                signals: tollgate::ratelimit::Signals::default(),
                result: match &ended {
                    Ok(()) => Ok(Success {
                        body: assembled.result(usage),
                        usage,
                    }),
                    Err(f) => Err(f.clone()),
                },
            };
            drop(upstream); // closes the upstream connection if it is still open
            this.finish_stream(job, target, called, client_gone, started_at)
                .await;
        });
        Ok(rx)
    }

    async fn finish_stream(
        &self,
        job: Job,
        target: Target,
        called: CallOutcome,
        client_gone: bool,
        started_at: chrono::DateTime<Utc>,
    ) {
        let finished_at = self.inner.clock.now();
        let call = Self::call_record(&job, &called, started_at, finished_at);
        crate::observe::provider_call(&job, &target, &called);
        let usage = match &called.result {
            Ok(s) => s.usage,
            Err(_) => Usage::default(),
        };
        let settlement = self.settlement(&job, &target, Some(usage));
        let end = match (&called.result, client_gone) {
            (Ok(success), false) => End::Succeeded {
                result: success.body.clone(),
                usage,
                provider_request_id: called.request_id.clone(),
            },
            (_, true) => End::failed(
                ReasonCode::ClientDisconnected,
                "the client closed the stream; the upstream call was cancelled",
            ),
            (Err(failure), false) => End::failed(failure.code, failure.message.clone()),
        };
        let served = Served::new(&target.provider, &target.model);
        let outcome = Outcome {
            call: Some(call),
            ..Outcome::new(self.holder(&job), Some(served), end, settlement)
        };
        tollgate::job_trace::attempted(&job, &outcome, started_at, finished_at);
        log_write(self.write(outcome, self.inner.clock.now()).await);
    }
}

/// The error event that ends a client's stream, in its endpoint's shape.
fn error_event(endpoint: Endpoint, message: &str, code: ReasonCode) -> String {
    let event = match endpoint {
        Endpoint::Messages => serde_json::json!({"type": "error",
            "error": {"type": "api_error", "message": message, "code": code.as_str()}}),
        Endpoint::Responses => serde_json::json!({"type": "error", "code": code.as_str(), "message": message,
            "param": null}),
        _ => serde_json::json!({"error": {"message": message, "type": "server_error", "param": null,
            "code": code.as_str()}}),
    };
    event.to_string()
}

/// A streamed answer put back together, to store as the job's result: a chat completion
/// from OpenAI chunks, an Anthropic message from its events, or the response a Responses
/// stream's last event carries whole.
enum Assembled {
    Chat(AssembledChat),
    Completion(AssembledCompletion),
    Message(AssembledMessage),
    Response(Value),
}

impl Assembled {
    fn for_endpoint(endpoint: Endpoint) -> Self {
        match endpoint {
            Endpoint::Messages => Self::Message(AssembledMessage::default()),
            Endpoint::Responses => Self::Response(Value::Null),
            Endpoint::Completions => Self::Completion(AssembledCompletion::default()),
            // Embeddings and moderations do not stream (`Endpoint::streams`).
            Endpoint::ChatCompletions | Endpoint::Embeddings | Endpoint::Moderations => {
                Self::Chat(AssembledChat::default())
            }
        }
    }

    fn add(&mut self, chunk: &str) {
        let Ok(v) = serde_json::from_str::<Value>(chunk) else {
            return;
        };
        match self {
            Self::Chat(chat) => chat.add(&v),
            Self::Completion(completion) => completion.add(&v),
            Self::Message(message) => message.add(&v),
            Self::Response(response) => {
                if let Some(whole) = v.get("response").filter(|_| {
                    matches!(
                        v["type"].as_str(),
                        Some("response.completed" | "response.incomplete")
                    )
                }) {
                    *response = whole.clone();
                }
            }
        }
    }

    fn result(&self, usage: Usage) -> Value {
        match self {
            Self::Chat(chat) => chat.completion(usage),
            Self::Completion(completion) => completion.completion(usage),
            Self::Message(message) => message.message(usage),
            Self::Response(response) => response.clone(),
        }
    }
}

/// OpenAI chunks put back together: the text, each tool call's id, name and arguments.
#[derive(Default)]
struct AssembledChat {
    id: Option<Value>,
    model: Option<Value>,
    content: String,
    /// By the chunks' tool call `index`.
    tool_calls: Vec<Value>,
    finish_reason: Option<Value>,
}

impl AssembledChat {
    fn add(&mut self, v: &Value) {
        if self.id.is_none() {
            self.id = v.get("id").cloned();
            self.model = v.get("model").cloned();
        }
        let choice = &v["choices"][0];
        if let Some(text) = choice["delta"]["content"].as_str() {
            self.content.push_str(text);
        }
        for call in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap_or(0) as usize;
            while self.tool_calls.len() <= index {
                self.tool_calls
                    .push(serde_json::json!({"id": null, "type": "function",
                    "function": {"name": null, "arguments": ""}}));
            }
            let assembled = &mut self.tool_calls[index];
            for at in ["/id", "/function/name"] {
                if let Some(v) = call.pointer(at).filter(|v| !v.is_null())
                    && let Some(slot) = assembled.pointer_mut(at)
                {
                    *slot = v.clone();
                }
            }
            append(
                &mut assembled["function"]["arguments"],
                call.pointer("/function/arguments"),
            );
        }
        if !choice["finish_reason"].is_null() {
            self.finish_reason = Some(choice["finish_reason"].clone());
        }
    }

    fn completion(&self, usage: Usage) -> Value {
        let message = assistant_message(self.content.clone(), self.tool_calls.clone());
        serde_json::json!({
            "id": self.id,
            "object": "chat.completion",
            "created": Utc::now().timestamp(), // shown to the client only
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "finish_reason": self.finish_reason,
            }],
            "usage": {
                "prompt_tokens": usage.input_tokens,
                "completion_tokens": usage.output_tokens,
                "total_tokens": usage.input_tokens + usage.output_tokens,
            },
        })
    }
}

/// A legacy completion's chunks put back together: each choice's text and finish reason,
/// by its `index` (several prompts, or `n`, stream side by side).
#[derive(Default)]
struct AssembledCompletion {
    id: Option<Value>,
    model: Option<Value>,
    choices: Vec<(String, Value)>,
}

impl AssembledCompletion {
    fn add(&mut self, v: &Value) {
        if self.id.is_none() {
            self.id = v.get("id").cloned();
            self.model = v.get("model").cloned();
        }
        for choice in v["choices"].as_array().into_iter().flatten() {
            let index = choice["index"].as_u64().unwrap_or(0) as usize;
            while self.choices.len() <= index {
                self.choices.push((String::new(), Value::Null));
            }
            let (text, finish) = &mut self.choices[index];
            text.push_str(choice["text"].as_str().unwrap_or_default());
            if !choice["finish_reason"].is_null() {
                *finish = choice["finish_reason"].clone();
            }
        }
    }

    fn completion(&self, usage: Usage) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, (text, finish))| {
                serde_json::json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
            })
            .collect();
        serde_json::json!({
            "id": self.id,
            "object": "text_completion",
            "created": Utc::now().timestamp(), // shown to the client only
            "model": self.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": usage.input_tokens,
                "completion_tokens": usage.output_tokens,
                "total_tokens": usage.input_tokens + usage.output_tokens,
            },
        })
    }
}

/// `v` if it is an object, else an empty one.
fn object(v: &Value) -> Value {
    if v.is_object() {
        v.clone()
    } else {
        serde_json::json!({})
    }
}

/// `slot`'s text with `piece` (a delta's text) added at its end.
fn append(slot: &mut Value, piece: Option<&Value>) {
    let Some(piece) = piece.and_then(Value::as_str) else {
        return;
    };
    *slot = Value::String(format!("{}{piece}", slot.as_str().unwrap_or_default()));
}

/// Anthropic's events put back together: the message of `message_start`, its content
/// blocks with their deltas (a tool's input from its JSON pieces), its stop reason.
#[derive(Default)]
struct AssembledMessage {
    message: Value,
    blocks: Vec<Value>,
    /// Per block, the pieces of a tool's input JSON.
    inputs: Vec<String>,
}

impl AssembledMessage {
    fn add(&mut self, v: &Value) {
        match v["type"].as_str().unwrap_or_default() {
            // Objects only, so that what is written into them below cannot meet another type.
            "message_start" => self.message = object(&v["message"]),
            "content_block_start" => {
                self.blocks.push(object(&v["content_block"]));
                self.inputs.push(String::new());
            }
            "content_block_delta" => {
                let (Some(block), Some(input)) = (self.blocks.last_mut(), self.inputs.last_mut()) else {
                    return;
                };
                let delta = &v["delta"];
                match delta["type"].as_str().unwrap_or_default() {
                    "text_delta" => append(&mut block["text"], delta.get("text")),
                    "thinking_delta" => append(&mut block["thinking"], delta.get("thinking")),
                    "signature_delta" => block["signature"] = delta["signature"].clone(),
                    "input_json_delta" => input.push_str(delta["partial_json"].as_str().unwrap_or_default()),
                    _ => {}
                }
            }
            "message_delta" => {
                for field in ["stop_reason", "stop_sequence"] {
                    if let Some(value) = v["delta"].get(field) {
                        self.message[field] = value.clone();
                    }
                }
            }
            _ => {}
        }
    }

    fn message(&self, usage: Usage) -> Value {
        let content: Vec<Value> = self
            .blocks
            .iter()
            .zip(&self.inputs)
            .map(|(block, input)| {
                let mut block = block.clone();
                if !input.is_empty() {
                    block["input"] = serde_json::from_str(input).unwrap_or_else(|_| serde_json::json!({}));
                }
                block
            })
            .collect();
        let mut message = self.message.clone();
        message["content"] = Value::Array(content);
        message["usage"] =
            serde_json::json!({"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens});
        message
    }
}
