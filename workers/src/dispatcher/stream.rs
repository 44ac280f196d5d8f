//! Streaming jobs, run for the API process whose client is connected: claimed by id,
//! relayed chunk by chunk as OpenAI-style SSE payloads, and finished — succeeded, failed,
//! or `client_disconnected` — with the answer put back together and the usage produced so
//! far. No retries: the client is waiting. A stream whose job the heartbeat finds no
//! longer held here (rescued, cancelled) is cut off, and nothing of it is written.

use chrono::Utc;
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
use crate::providers::{CallOutcome, Success};
use tollgate::vocab::ReasonCode;

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
    /// `data:` payloads of OpenAI-style SSE (ending with `[DONE]`), into the returned
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
            opened = self.inner.providers.call_stream(&target, &job.request) => opened,
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
                let settlement = if called.status.is_some() {
                    self.settlement(&job, &target, None)
                } else {
                    Settlement::UNSENT
                };
                let served = Served::new(&target.provider, &target.model);
                let end = End::failed(failure.code, failure.message.clone());
                let outcome = Outcome {
                    call: Some(Self::call_record(
                        &job,
                        &called,
                        started_at,
                        self.inner.clock.now(),
                    )),
                    ..Outcome::new(self.holder(&job), Some(served), end, settlement)
                };
                log_write(self.write(outcome, self.inner.clock.now()).await);
                return Err(failure);
            }
        };
        let (tx, rx) = mpsc::channel::<String>(32);
        let this = self.clone();
        let wants_usage = ChatStream::client_wants_usage(&job.request);
        relays.spawn(async move {
            let _tracked = tracked;
            let mut assembled = Assembled::default();
            let mut ended: Result<(), Failure> = Ok(());
            let mut client_gone = false;
            loop {
                let next = tokio::select! {
                    next = upstream.next_chunk() => next,
                    _ = stop.cancelled() => {
                        // Not ours any more: the client's stream ends here, unfinished.
                        drop(upstream);
                        let error = serde_json::json!({"error": {
                            "message": "the job was taken from this process (rescued or cancelled)",
                            "type": "server_error", "param": null, "code": ReasonCode::LeaseExpired.as_str()}});
                        let _ = tx.try_send(error.to_string());
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
                        let error = serde_json::json!({"error": {"message": failure.message, "type": "server_error", "param": null, "code": failure.code}});
                        let _ = tx.send(error.to_string()).await;
                        ended = Err(failure);
                        break;
                    }
                }
            }
            if !client_gone && ended.is_ok() {
                let _ = tx.send("[DONE]".to_owned()).await;
            }
            let usage = upstream.usage();
            let called = CallOutcome {
                key_name: upstream.key_name.clone(),
                status: Some(upstream.status),
                request_id: upstream.request_id.clone(),
                rate_limit: upstream.rate_limit.clone(),
                signals: tollgate::ratelimit::Signals::default(),
                result: match &ended {
                    Ok(()) => Ok(Success {
                        body: assembled.completion(usage),
                        usage,
                    }),
                    Err(f) => Err(f.clone()),
                },
            };
            drop(upstream); // closes the upstream connection if it is still open
            this.finish_stream(job, target, called, client_gone, started_at).await;
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
        let call = Self::call_record(&job, &called, started_at, self.inner.clock.now());
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
        log_write(self.write(outcome, self.inner.clock.now()).await);
    }
}

/// A streamed answer put back together, to store as the job's result.
#[derive(Default)]
struct Assembled {
    id: Option<serde_json::Value>,
    model: Option<serde_json::Value>,
    content: String,
    finish_reason: Option<serde_json::Value>,
}

impl Assembled {
    fn add(&mut self, chunk: &str) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(chunk) else {
            return;
        };
        if self.id.is_none() {
            self.id = v.get("id").cloned();
            self.model = v.get("model").cloned();
        }
        let choice = &v["choices"][0];
        if let Some(text) = choice["delta"]["content"].as_str() {
            self.content.push_str(text);
        }
        if !choice["finish_reason"].is_null() {
            self.finish_reason = Some(choice["finish_reason"].clone());
        }
    }

    fn completion(&self, usage: Usage) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "object": "chat.completion",
            "created": Utc::now().timestamp(), // shown to the client only
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": self.content},
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
