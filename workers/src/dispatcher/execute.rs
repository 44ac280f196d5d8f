//! One attempt of one job, claimed or handed over: the target the gate admitted it for,
//! the checks before the call (the deadline; a key or target this process just saw
//! rejected or rate-limited), the provider call, and the [`Outcome`] built from its
//! [`CallOutcome`]. A handed-over job that was cancelled while it waited for its slot
//! (checked as its slot came: [`super::handover`]) is not sent; a call whose job the
//! heartbeat finds no longer held here is stopped ([`Dispatcher::abandon`]). After a failure,
//! [`retry::decide`] says what follows — retry, fall back, rotate the key, pause a scope,
//! or fail — and this writes exactly that. A job of the flex lane is sent with
//! `service_tier: "flex"` and charged the flex price; when the tier has no capacity
//! (`flex_unavailable`) it goes online at once, nothing learned or paused.

use std::time::Duration;

use chrono::Utc;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::attempt::{Call, End, Holder, Outcome, Served};
use tollgate::buckets::{self, Settlement};
use tollgate::keyring::KeyAccount;
use tollgate::learning::Observation;
use tollgate::model::{Job, Usage};
use tollgate::retry::{self, FailedCall, Failure, FailureClass, Next};
use tollgate::routing::{self, Target};
use tracing::Instrument;

use super::{Dispatcher, Via, lock, log_write};
use crate::providers::CallOutcome;
use tollgate::vocab::{Lane, ReasonCode};

tokio::task_local! {
    /// The slot (`dispatch.concurrency`) of the call this task makes. Given back when the
    /// call's outcome is handed to the completer: the slot bounds calls in flight to
    /// providers, and holding it through the completer's commit as well would make every
    /// slot wait on a disk flush (throughput = slots ÷ commit latency).
    /// (With a job the gate handed over, also its room: see [`super::handover`].)
    pub(super) static SLOT: std::cell::RefCell<Vec<OwnedSemaphorePermit>>;
}

impl Dispatcher {
    /// Runs `job` (claimed or handed over) as its own task, holding `permits` (its slot,
    /// and its room if handed over) until its outcome goes to the completer.
    pub(super) fn spawn_execute(
        &self,
        in_flight: &TaskTracker,
        job: Job,
        via: Via,
        permits: Vec<OwnedSemaphorePermit>,
    ) {
        let this = self.clone();
        in_flight.spawn(SLOT.scope(std::cell::RefCell::new(permits), async move {
            this.execute(job, via).await;
        }));
    }

    /// One attempt of one job, from target choice to the guarded write of its outcome.
    pub(super) async fn execute(&self, job: Job, via: Via) {
        let tracked = self.track(&job);
        let span = tracing::info_span!(
            "attempt",
            job_id = %job.id,
            tenant = %job.tenant,
            route = %job.model,
            attempt = job.attempt
        );
        self.execute_in_span(job, via, tracked.stop.clone())
            .instrument(span)
            .await;
    }

    /// Ends an attempt whose job is no longer this process's to run — its lease was lost
    /// (rescued) or it was cancelled — without its call, or with its call stopped. Nothing
    /// of it is written: the outcome's write is guarded by (running, attempt, owner) and
    /// carries no call record. Only a job cancelled meanwhile, still leased here, has its
    /// reservation settled, as `settlement` says.
    pub(super) async fn abandon(&self, job: &Job, served: Option<Served>, settlement: Settlement) {
        let end = End::retry(
            self.inner.clock.now(),
            ReasonCode::LeaseExpired,
            "the job was no longer held by this dispatcher; its call was not finished",
        );
        let outcome = Outcome::new(self.holder(job), served, end, settlement);
        match self.write(outcome, self.inner.clock.now()).await {
            Ok(true) => tracing::warn!("an abandoned attempt was written: the job was still held here"),
            Ok(false) => tracing::info!("attempt abandoned: the job was rescued or cancelled meanwhile"),
            Err(e) => tracing::warn!(error = %e, "could not settle an abandoned attempt; the rescuer will"),
        }
    }

    /// This process as the holder of `job`'s current attempt: the guard of its writes.
    pub(super) fn holder(&self, job: &Job) -> Holder {
        Holder {
            id: job.id,
            attempt: job.attempt,
            owner: self.inner.owner.clone(),
        }
    }

    /// The target the gate admitted the job for (its reservation is for that target).
    pub(super) fn target(&self, job: &Job) -> Option<Target> {
        let (provider, model) = (job.provider.as_deref()?, job.provider_model.as_deref()?);
        let kind = self.inner.config.provider(provider)?.kind;
        Some(Target {
            provider: provider.to_owned(),
            kind,
            model: model.to_owned(),
            key: job.provider_key.clone(),
        })
    }

    /// What the reservation is settled with: actual usage and its price (recorded as the
    /// call's spend).
    pub(super) fn settlement(&self, job: &Job, target: &Target, usage: Option<Usage>) -> Settlement {
        let provider = self.inner.config.provider(&target.provider);
        let price = provider.and_then(|p| p.price_for(&target.model));
        // What the provider counted against its token limit when the request started: the
        // cap it was sent, for every choice.
        let charged_output = provider.filter(|p| p.charges_max_tokens).map(|_| {
            f64::from(tollgate::estimate::endpoint_output_tokens(
                job.endpoint,
                &job.request,
            ))
        });
        let (lane, discount) = match provider.filter(|_| is_flex(job)) {
            Some(p) => (Lane::Flex, p.flex.discount),
            None => (Lane::Online, 1.0),
        };
        let online = usage.map_or(0.0, |u| {
            buckets::spend_micro_usd(
                price,
                u.input_tokens as f64,
                u.cached_tokens as f64,
                u.output_tokens as f64,
            )
        });
        let actual_spend = discount * online;
        if usage.is_some() {
            tollgate::metrics::call_spend(
                &job.tenant,
                &target.provider,
                &target.model,
                job.endpoint,
                lane,
                actual_spend,
            );
        }
        Settlement {
            charged_output,
            usage,
            actual_spend,
            sent: true,
            saved: online - actual_spend,
        }
    }

    async fn execute_in_span(&self, job: Job, via: Via, stop: CancellationToken) {
        let inner = &self.inner;
        let holder = self.holder(&job);
        let target = self.target(&job).or_else(|| {
            routing::resolve(&inner.config, &job.model, job.endpoint)
                .ok()
                .and_then(|t| t.into_iter().next())
        });
        let Some(target) = target else {
            let message = format!("model {:?} is no longer configured", job.model);
            let end = End::failed(ReasonCode::UnknownModel, message);
            let outcome = Outcome::new(holder, None, end, Settlement::UNSENT);
            log_write(self.write(outcome, inner.clock.now()).await);
            return;
        };
        let served = Served::new(&target.provider, &target.model);
        if let Some(key) = target.key.as_deref().filter(|k| {
            self.paused_here(&buckets::key_scope(&target.provider, k))
                .is_some()
        }) {
            let message = format!("key {key} was rejected by the provider; another key will be used");
            let end = End::retry(inner.clock.now(), ReasonCode::UpstreamKeyRotated, message);
            let outcome = Outcome::new(holder, Some(served), end, Settlement::UNSENT);
            log_write(self.write(outcome, inner.clock.now()).await);
            return;
        }
        let started_at = inner.clock.now();
        // The claim checked the deadline, but a busy process may reach the call later.
        if started_at >= job.deadline {
            tollgate::metrics::job_finished(
                &job.tenant,
                job.class,
                "failed",
                ReasonCode::DeadlineExceeded.as_str(),
                job.attempt,
            );
            let end = End::failed(
                ReasonCode::DeadlineExceeded,
                "the deadline passed before the call could be sent",
            );
            let outcome = Outcome::new(holder, Some(served), end, Settlement::UNSENT);
            log_write(self.write(outcome, started_at).await);
            return;
        }
        // A job handed over that was cancelled while it waited for its slot is not sent. One
        // that found a slot free is as good as in its call already: a cancel now is a cancel
        // during the call (its outcome is discarded and its reservation settled).
        if via == (Via::Handover { held: false }) {
            return self.abandon(&job, Some(served), Settlement::UNSENT).await;
        }
        // Checked last before the call, so that a 429 met meanwhile by a call beside it
        // stops this one: a 429's pause on the model holds the job until it ends; one on its
        // key's pool only sends it back to the gate, which may start it on another pool now.
        let model_scope = buckets::target_scope(&target.provider, &target.model);
        let pool_scope = self.learned_scope(&target.provider, &target.model, target.key.as_deref());
        let paused = match self.paused_here(&model_scope) {
            Some(wait) => Some((
                wait,
                "the provider answered 429 for this model: back to the queue until the pause ends",
            )),
            None => self.paused_here(&pool_scope).map(|_| {
                (
                    Duration::ZERO,
                    "the provider answered 429 for this key's quota pool: back to the queue for another pool",
                )
            }),
        };
        if let Some((wait, message)) = paused {
            let end = End::retry(inner.clock.now() + wait, ReasonCode::TargetPaused, message);
            let outcome = Outcome::new(holder, Some(served), end, Settlement::UNSENT);
            log_write(self.write(outcome, inner.clock.now()).await);
            return;
        }
        let flex = is_flex(&job);
        let at_flex_tier;
        let request = if flex {
            at_flex_tier = flex_tier(&job.request);
            &at_flex_tier
        } else {
            &job.request
        };
        let called = tokio::select! {
            called = inner.providers.call(&target, job.endpoint, request) => called,
            _ = stop.cancelled() => {
                // The request may have reached the provider: settled as sent.
                let settlement = self.settlement(&job, &target, None);
                return self.abandon(&job, Some(served), settlement).await;
            }
        };
        if called.result.is_ok() {
            inner.served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let finished_at = inner.clock.now();
        crate::observe::provider_call(&job, &target, &called);
        let observation = self.observation(&target, &called, finished_at);
        let call = Self::call_record(&job, &called, started_at, finished_at);
        let outcome = match &called.result {
            Ok(success) => {
                let end = End::Succeeded {
                    result: success.body.clone(),
                    usage: success.usage,
                    provider_request_id: called.request_id.clone(),
                };
                let settlement = self.settlement(&job, &target, Some(success.usage));
                Outcome {
                    call: Some(call),
                    observation,
                    ..Outcome::new(holder, Some(served), end, settlement)
                }
            }
            Err(failure) if flex && failure.code == ReasonCode::FlexUnavailable => {
                // The flex tier's own refusal: online now, the online limits untouched.
                match tollgate::store::leave_flex(&inner.pool, job.id, &inner.owner).await {
                    Ok(_) => tracing::info!("the flex tier had no capacity; the job goes online"),
                    Err(e) => {
                        tracing::warn!(error = %e, "could not move the job off the flex lane; it tries flex again")
                    }
                }
                let end = End::retry(finished_at, failure.code, failure.message.clone());
                Outcome {
                    call: Some(call),
                    observation,
                    ..Outcome::new(holder, Some(served), end, Settlement::UNSENT)
                }
            }
            Err(failure) => {
                let settlement = if called.counted() {
                    self.settlement(&job, &target, None)
                } else {
                    Settlement::UNSENT
                };
                let key = Some(called.key_name.as_str()).filter(|k| !k.is_empty());
                Outcome {
                    call: Some(call),
                    observation,
                    ..self.after_failure(&job, served, key, failure, settlement, finished_at)
                }
            }
        };
        tollgate::job_trace::attempted(&job, &outcome, started_at, finished_at);
        // A caller waiting here has its answer now, not after the outcome's commit; the
        // process's other requests wait for that commit while it is under way.
        let answered = outcome
            .end
            .state()
            .is_terminal()
            .then(|| inner.notifications.answer_early(job.id, &outcome.end))
            .flatten();
        let written = self.write(outcome, inner.clock.now()).await;
        drop(answered);
        match written {
            Ok(true) => {}
            Ok(false) => tracing::info!("outcome discarded: the job was cancelled or rescued meanwhile"),
            Err(e) => {
                tracing::warn!(error = %e, "could not write the outcome; the lease will expire and the job will be retried")
            }
        }
    }

    /// How long the pause of `scope` this process wrote still holds (`None`: none holds).
    fn paused_here(&self, scope: &str) -> Option<Duration> {
        lock(&self.inner.paused_here)
            .get(scope)
            .and_then(|until| until.checked_duration_since(std::time::Instant::now()))
    }

    fn pause_here(&self, scope: &str, wait: Duration) {
        lock(&self.inner.paused_here).insert(scope.to_owned(), std::time::Instant::now() + wait);
    }

    /// What a response said about its provider's limits, for the gate to learn from:
    /// readings of headers or 429 bodies, or a bare 429. `None` when the request was not
    /// answered or the provider's limits are not learned.
    fn observation(
        &self,
        target: &Target,
        called: &CallOutcome,
        at: chrono::DateTime<Utc>,
    ) -> Option<Observation> {
        called.status?;
        let provider = self.inner.config.provider(&target.provider)?;
        if !provider.learn_limits {
            return None;
        }
        let throttled = matches!(&called.result, Err(f) if f.class == FailureClass::Capacity);
        let ring = self.inner.providers.keyring();
        let key = called.key_name.as_str();
        let account = called
            .signals
            .account
            .as_ref()
            .filter(|a| !key.is_empty() && ring.observed_account(&provider.name, key) != Some(a.as_str()))
            .map(|a| KeyAccount {
                provider: provider.name.clone(),
                key: key.to_owned(),
                account: a.clone(),
                observed_at: at,
            });
        Some(Observation {
            scope: self.learned_scope(&target.provider, &target.model, Some(key)),
            readings: called.signals.readings.clone(),
            throttled: throttled && !called.signals.has_limits(),
            bound: called.signals.bound,
            at,
            account,
        })
    }

    /// The scope `provider`'s `model` has its limits learned under when called with `key`
    /// ([`buckets::key_learned_scope`]).
    fn learned_scope(&self, provider: &str, model: &str, key: Option<&str>) -> String {
        let ring = self.inner.providers.keyring();
        buckets::key_learned_scope(&self.inner.config, &ring, provider, model, key)
    }

    /// The outcome [`retry::decide`] says follows `failure` of the call to `served` with
    /// `key`: the job's next step, the pause to write (also kept here, for the jobs this
    /// process runs before the gate sees it) and the target the job leaves.
    fn after_failure(
        &self,
        job: &Job,
        served: Served,
        key: Option<&str>,
        failure: &Failure,
        settlement: Settlement,
        now: chrono::DateTime<Utc>,
    ) -> Outcome {
        let route = routing::resolve(&self.inner.config, &job.model, job.endpoint).unwrap_or_default();
        let scope = self.learned_scope(&served.provider, &served.model, key);
        let failed = FailedCall {
            failure,
            provider: &served.provider,
            model: &served.model,
            key,
            scope: &scope,
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            deadline: job.deadline,
            failed_targets: job.failed_targets.as_deref().unwrap_or_default(),
            route: &route,
        };
        let decision = retry::decide(&failed, &self.inner.policy, now, rand::random);
        if let Some(pause) = &decision.pause {
            if let (FailureClass::KeyUnusable, Some(key)) = (failure.class, key) {
                tracing::warn!(
                    key,
                    code = failure.code.as_str(),
                    "provider rejected a key; rotating it out"
                );
            }
            self.pause_here(&pause.scope, (pause.until - now).to_std().unwrap_or_default());
        }
        let end = match decision.next {
            Next::Fail { code, message } => {
                tollgate::metrics::job_finished(&job.tenant, job.class, "failed", code.as_str(), job.attempt);
                End::failed(code, message)
            }
            next => {
                let (not_before, delay) = match next {
                    Next::Retry { at, delay } => (at, delay),
                    _ => (now, Duration::ZERO),
                };
                tollgate::metrics::retry(
                    &job.tenant,
                    &served.provider,
                    &served.model,
                    failure.code.as_str(),
                );
                tracing::info!(
                    code = failure.code.as_str(),
                    delay_ms = delay.as_millis() as u64,
                    "retrying later"
                );
                End::retry(not_before, failure.code, failure.message.clone())
            }
        };
        if let Some(here) = &decision.leave_target {
            tracing::info!(target = %here, code = failure.code.as_str(), "falling back to the route's next target");
        }
        Outcome {
            pause: decision.pause,
            failed_target: decision.leave_target,
            ..Outcome::new(self.holder(job), Some(served), end, settlement)
        }
    }

    /// The record of one provider call, written with the attempt's outcome.
    pub(super) fn call_record(
        job: &Job,
        called: &CallOutcome,
        started_at: chrono::DateTime<Utc>,
        finished_at: chrono::DateTime<Utc>,
    ) -> Call {
        let (error_code, usage) = match &called.result {
            Ok(s) => (None, Some(s.usage)),
            Err(f) => (Some(f.code), None),
        };
        Call {
            tenant: job.tenant.clone(),
            key_name: called.key_name.clone(),
            status: called.status.map(i32::from),
            error_code,
            provider_request_id: called.request_id.clone(),
            usage,
            estimated_input_tokens: job.estimated_input_tokens,
            estimated_output_tokens: job.estimated_output_tokens,
            rate_limit: called.rate_limit.clone(),
            started_at,
            finished_at,
        }
    }
}

/// Whether `job` goes by the flex lane.
fn is_flex(job: &Job) -> bool {
    job.dispatch_via.as_deref() == Some(Lane::Flex.as_str())
}

/// `request` at the provider's flex tier: `service_tier: "flex"`.
fn flex_tier(request: &serde_json::Value) -> serde_json::Value {
    let mut request = request.clone();
    if let Some(obj) = request.as_object_mut() {
        obj.insert("service_tier".to_owned(), serde_json::Value::from("flex"));
    }
    request
}
