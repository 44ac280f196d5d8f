//! The provider-batch worker: packs admitted provider-batch jobs per (provider, model,
//! key, endpoint) within the provider's limits (lines, bytes, embedding inputs), submits
//! each pack to the provider's batch API, polls it, and writes each line's result back
//! through the ordinary completion path (`finish_attempts`, guarded by the pack's lease,
//! so a repeated write is a no-op) at the batch price. Lines the provider failed or expired go back to the queue as online
//! jobs when their deadline allows (`provider_batch_failed_retry_online`), else fail.
//!
//! Pull-back: a pack still running `pull_back_secs` before its earliest line's deadline —
//! or whose pace so far says it will be — is cancelled at the provider. When the provider
//! ends it, the lines it finished are written back at the batch price as usual and the
//! ones it cancelled go online (`pulled_back_from_provider_batch`) with the time left:
//! no line runs twice, and none waits past its deadline in a slow batch.
//!
//! Crash safety: a pack's row and its jobs' claim commit together (`submitting`) before
//! the provider is called; the provider's batch id is recorded as soon as it answers
//! (tried again for a while if the database cannot take it). The jobs' lease belongs to
//! the pack (`provider_batch:<id>`) and lasts the provider's window plus a margin, so
//! whichever process polls next picks the pack up. The submitter holds the pack
//! `submitting` for [`SUBMIT_HOLD`], renewed while an upload takes long; a pack whose
//! hold ended (its submitter died, or never recorded the provider's answer) is resolved
//! by whoever finds it: where the API finds batches by the tag they carry (OpenAI's
//! metadata) a batch the provider has is adopted and polled — no line is sent twice;
//! where none is found, or the API has no metadata (Anthropic), the pack is abandoned and
//! its jobs requeued. There, only a submitter killed between the provider's answer and
//! recording it can send lines twice (one that merely could not record it cancels the
//! provider's batch first).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tollgate::attempt::{Call, End, Holder, Outcome, Served};
use tollgate::buckets;
use tollgate::clock::Clock;
use tollgate::config::{Config, ProviderConfig};
use tollgate::model::{Decision, Job, JobId};
use tollgate::provider_batches;
use tollgate::store::{
    self, FlexObservations, NewPack, PackEnd, PackGroup, ProviderBatch, Settlement, StoreError,
};
use tollgate::vocab::{Lane, LaneReason, ReasonCode};

use crate::providers::Providers;
use crate::providers::batch_api::{BatchClient, LineResult, Status, Submitted};

/// How long a submitter holds its pack `submitting` without renewing the hold.
const SUBMIT_HOLD: Duration = Duration::from_secs(60);
/// How often a submitter renews its hold while the provider takes the pack.
const SUBMIT_RENEW: Duration = Duration::from_secs(20);
/// Attempts to record the provider's answer before giving up (1, 2, 4, 8 s apart).
const RECORD_TRIES: u32 = 5;
/// A stale pack whose provider cannot be asked is abandoned after this, found or not.
const ORPHAN_SEARCH_FOR: Duration = Duration::from_secs(3600);
/// While one process polls a pack, others leave it alone this long.
const POLL_HOLD: Duration = Duration::from_secs(300);
/// Most packs polled per step.
const POLLS_PER_STEP: i64 = 20;
/// Lease margin beyond the provider's window.
const LEASE_MARGIN_SECS: u64 = 3600;

/// What one step did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Step {
    /// Packs submitted to a provider.
    pub submitted: usize,
    /// Packs whose results were written back.
    pub ended: usize,
    /// Lines sent back to the queue as online jobs.
    pub requeued: usize,
    /// Packs abandoned before submission.
    pub abandoned: usize,
    /// Stale packs whose batch was found at the provider and is polled from now on.
    pub adopted: usize,
    /// Packs cancelled at the provider because their lines would miss their deadline.
    pub pulled_back: usize,
}

#[derive(Clone)]
pub struct ProviderBatcher {
    pool: PgPool,
    config: Arc<Config>,
    providers: Providers,
    /// The time holds and leases are reckoned in (a broker's: the database's).
    clock: Clock,
}

impl ProviderBatcher {
    pub fn new(pool: PgPool, config: Arc<Config>, providers: Providers) -> Self {
        Self {
            pool,
            config,
            providers,
            clock: Clock::system(),
        }
    }

    /// Reckons time by `clock` (a broker's: the database's).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// How often the loop wakes: the shortest pack wait or poll interval configured.
    fn tick(&self) -> Duration {
        let ms = self
            .config
            .providers
            .iter()
            .filter(|p| p.batch_api.enabled)
            .map(|p| p.batch_api.poll_interval_ms.min(p.batch_api.pack_wait_ms.max(1)))
            .min()
            .unwrap_or(60_000);
        Duration::from_millis(ms).clamp(Duration::from_millis(20), Duration::from_secs(10))
    }

    pub async fn run(self, cancel: CancellationToken) {
        let tick = self.tick();
        loop {
            if let Err(e) = self.run_once(self.clock.now()).await {
                tracing::warn!(error = %e, "provider batch step failed");
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(tick) => {}
            }
        }
    }

    /// One step: resolve stale packs, pack and submit what is ready, poll what is due.
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<Step, StoreError> {
        let mut step = Step::default();
        for pack in store::take_stale_packs(&self.pool, now, SUBMIT_HOLD).await? {
            self.resolve_stale(&pack, now, &mut step).await?;
        }
        for group in store::pack_groups(&self.pool).await? {
            self.pack(&group, now, &mut step).await?;
        }
        for pack in store::due_packs(&self.pool, now, POLL_HOLD, POLLS_PER_STEP).await? {
            self.poll(&pack, now, &mut step).await?;
        }
        Ok(step)
    }

    /// A pack left `submitting` past its hold: the provider may have it. A batch found by
    /// its tag is adopted; else the pack is abandoned and its jobs go back to the queue.
    /// When the provider cannot be asked now, the pack waits for the next hold (for up to
    /// [`ORPHAN_SEARCH_FOR`]) rather than risk sending its lines twice.
    async fn resolve_stale(
        &self,
        pack: &ProviderBatch,
        now: DateTime<Utc>,
        step: &mut Step,
    ) -> Result<(), StoreError> {
        let clients = self.providers.batch_clients(&pack.provider);
        let searchable = clients
            .iter()
            .filter(|c| c.finds_tagged() && pack.key_name.as_deref().is_none_or(|k| k == c.key_name()));
        let give_up =
            now - pack.created_at >= chrono::Duration::from_std(ORPHAN_SEARCH_FOR).unwrap_or_default();
        for client in searchable {
            match client.find_tagged(&pack.id).await {
                Ok(Some(found)) => {
                    if store::pack_submitted(
                        &self.pool,
                        &pack.id,
                        &found.batch_id,
                        None,
                        &found.key_name,
                        now,
                    )
                    .await?
                    {
                        tracing::warn!(pack = %pack.id, provider_batch = %found.batch_id,
                            "adopted a provider batch whose submission was never recorded");
                        step.adopted += 1;
                    }
                    return Ok(());
                }
                Ok(None) => {}
                Err(e) if !give_up => {
                    tracing::warn!(pack = %pack.id, error = %e, "could not ask the provider for a stale pack; asking again later");
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(pack = %pack.id, error = %e, "the provider could not be asked for a stale pack; abandoning it")
                }
            }
        }
        if !store::abandon_pack(&self.pool, &pack.id, now).await? {
            return Ok(());
        }
        step.abandoned += 1;
        let jobs = store::pack_jobs(&self.pool, &pack.id).await?;
        let failed = jobs
            .into_iter()
            .map(|j| {
                (
                    j,
                    ReasonCode::ProviderBatchNotSubmitted,
                    "the pack was never submitted".to_owned(),
                )
            })
            .collect();
        step.requeued += self.back_online(&pack.id, failed, now, None).await?;
        Ok(())
    }

    fn provider(&self, name: &str) -> Option<&ProviderConfig> {
        self.config.provider(name).filter(|p| p.batch_api.enabled)
    }

    /// Opens and submits the group's packs, if the group is ready: a full pack, or lines
    /// that waited `pack_wait_ms`.
    async fn pack(&self, group: &PackGroup, now: DateTime<Utc>, step: &mut Step) -> Result<(), StoreError> {
        let Some(p) = self.provider(&group.provider) else {
            return Ok(());
        };
        let (max_lines, max_bytes) = p.batch_api.limits(p.kind);
        let waited = (now - group.oldest).num_milliseconds() >= p.batch_api.pack_wait_ms as i64;
        if (group.waiting as u64) < max_lines && !waited {
            return Ok(());
        }
        let lease = chrono::Duration::seconds((p.batch_api.min_deadline_secs + LEASE_MARGIN_SECS) as i64);
        loop {
            let id = format!("pb_{}", uuid::Uuid::now_v7().simple());
            let pack = NewPack {
                id: &id,
                group,
                max_lines: max_lines as i64,
                max_bytes: max_bytes as i64,
                max_inputs: p
                    .batch_api
                    .max_inputs(p.kind, group.endpoint)
                    .map_or(i64::MAX, |n| n as i64),
                lease_until: now + lease,
                submit_until: now + SUBMIT_HOLD,
            };
            let jobs = store::open_pack(&self.pool, &pack, now).await?;
            if jobs.is_empty() {
                return Ok(());
            }
            let full = jobs.len() as u64 >= max_lines;
            self.submit(&id, group, jobs, now, step).await?;
            if !full {
                return Ok(());
            }
        }
    }

    async fn submit(
        &self,
        id: &str,
        group: &PackGroup,
        jobs: Vec<Job>,
        now: DateTime<Utc>,
        step: &mut Step,
    ) -> Result<(), StoreError> {
        let client = self
            .providers
            .batch_client(&group.provider, &group.model, group.key.as_deref());
        let lines: Vec<(String, &serde_json::Value)> =
            jobs.iter().map(|j| (j.id.to_string(), &j.request)).collect();
        let submitting = async {
            match &client {
                Some(c) => c.submit(&group.model, group.endpoint, &lines, id).await,
                None => Err(format!("provider {:?} is not configured", group.provider)),
            }
        };
        match self.holding(id, now, submitting).await {
            Ok(s) => match self.record(id, &s, now).await {
                Ok(true) => {
                    tracing::info!(pack = id, provider_batch = %s.batch_id, lines = jobs.len(), "provider batch submitted");
                    step.submitted += 1;
                }
                Ok(false) => {
                    // Abandoned meanwhile: its jobs went back to the queue; stop the provider's copy.
                    if let Some(c) = &client {
                        let _ = c.cancel(&s.batch_id).await;
                    }
                }
                Err(e) => {
                    // Whoever resolves the stale pack finds the batch by its tag, if the API
                    // can; if it cannot, the pack will be abandoned: stop the provider's copy.
                    if let Some(c) = client.as_ref().filter(|c| !c.finds_tagged()) {
                        let _ = c.cancel(&s.batch_id).await;
                    }
                    return Err(e);
                }
            },
            Err(reason) => {
                tracing::warn!(pack = id, %reason, "the provider refused the batch; its lines go online");
                store::pack_refused(&self.pool, id, &reason, now).await?;
                let failed = jobs
                    .into_iter()
                    .map(|j| (j, ReasonCode::ProviderBatchRefused, reason.clone()))
                    .collect();
                step.requeued += self.back_online(id, failed, now, None).await?;
            }
        }
        Ok(())
    }

    async fn poll(
        &self,
        pack: &ProviderBatch,
        now: DateTime<Utc>,
        step: &mut Step,
    ) -> Result<(), StoreError> {
        let interval = self
            .provider(&pack.provider)
            .map_or(60_000, |p| p.batch_api.poll_interval_ms);
        let later = now + chrono::Duration::milliseconds(interval as i64);
        let (Some(batch_id), Some(client)) = (
            pack.provider_batch_id.as_deref(),
            self.providers
                .batch_client(&pack.provider, &pack.model, pack.key_name.as_deref()),
        ) else {
            return Ok(());
        };
        let status = match client.status(batch_id).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(pack = %pack.id, error = %e, "could not poll the provider batch");
                store::poll_later(
                    &self.pool,
                    &pack.id,
                    pack.provider_status.as_deref().unwrap_or(""),
                    later,
                )
                .await?;
                return Ok(());
            }
        };
        if !status.ended {
            if self.pull_back(pack, batch_id, &client, &status, now).await? {
                step.pulled_back += 1;
            }
            store::poll_later(&self.pool, &pack.id, &status.status, later).await?;
            return Ok(());
        }
        let results = match client.results(batch_id, pack.endpoint, &status).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(pack = %pack.id, error = %e, "could not read the provider batch's results");
                store::poll_later(&self.pool, &pack.id, &status.status, later).await?;
                return Ok(());
            }
        };
        self.write_back(pack, &status, results, now, step).await
    }

    /// Cancels `pack`'s provider batch when its lines would otherwise miss their deadline
    /// ([`pull_back_due`]); the lines come back when the provider ends it.
    async fn pull_back(
        &self,
        pack: &ProviderBatch,
        batch_id: &str,
        client: &BatchClient<'_>,
        status: &Status,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let Some(p) = self.provider(&pack.provider) else {
            return Ok(false);
        };
        if matches!(status.status.as_str(), "cancelling" | "canceling") {
            return Ok(false);
        }
        let Some(deadline) = store::pack_deadline(&self.pool, &pack.id).await? else {
            return Ok(false);
        };
        let margin = provider_batches::secs(p.batch_api.pull_back_secs);
        let started = pack.submitted_at.unwrap_or(pack.created_at);
        let Some(why) = pull_back_due(started, status.progress, deadline, margin, now) else {
            return Ok(false);
        };
        match client.cancel(batch_id).await {
            Ok(()) => {
                tracing::warn!(pack = %pack.id, provider_batch = batch_id, %deadline, why, "provider batch pulled back");
                Ok(true)
            }
            Err(e) => {
                tracing::warn!(pack = %pack.id, error = %e, "could not cancel a provider batch to pull it back; trying at the next poll");
                Ok(false)
            }
        }
    }

    /// Writes each held line's outcome: successes at the batch price, the rest back online.
    async fn write_back(
        &self,
        pack: &ProviderBatch,
        status: &Status,
        mut results: HashMap<String, LineResult>,
        now: DateTime<Utc>,
        step: &mut Step,
    ) -> Result<(), StoreError> {
        let owner = store::pack_owner(&pack.id);
        let provider = self.config.provider(&pack.provider);
        let discount = provider.map_or(1.0, |p| p.batch_api.discount);
        let price = provider.and_then(|p| p.price_for(&pack.model));
        let jobs = store::pack_jobs(&self.pool, &pack.id).await?;
        let mut end = PackEnd {
            provider_status: status.status.clone(),
            ..PackEnd::default()
        };
        let mut outcomes = Vec::new();
        let mut failed = Vec::new();
        for job in jobs {
            let result = results.remove(&job.id.to_string());
            let (success, request_id) = match result {
                Some(LineResult::Succeeded { success, request_id }) => (success, request_id),
                Some(LineResult::Failed { code, message }) => {
                    failed.push((job, code, message));
                    continue;
                }
                None => {
                    let message = format!("the provider batch ended {} without this line", status.status);
                    failed.push((job, ReasonCode::ProviderBatchMissingResult, message));
                    continue;
                }
            };
            let u = success.usage;
            let online = buckets::spend_micro_usd(
                price,
                u.input_tokens as f64,
                u.cached_tokens as f64,
                u.output_tokens as f64,
            );
            let batch_cost = online * discount;
            tollgate::metrics::call_spend(
                &job.tenant,
                &pack.provider,
                &pack.model,
                pack.endpoint,
                Lane::ProviderBatch,
                batch_cost,
            );
            end.succeeded += 1;
            end.online_cost_micro_usd += online;
            end.batch_cost_micro_usd += batch_cost;
            let holder = Holder {
                id: job.id,
                attempt: job.attempt,
                owner: owner.clone(),
            };
            let settlement = Settlement {
                usage: Some(u),
                actual_spend: batch_cost,
                sent: true,
                charged_output: None,
                saved: online - batch_cost,
            };
            let call = Call {
                tenant: job.tenant.clone(),
                key_name: pack.key_name.clone().unwrap_or_default(),
                status: Some(200),
                error_code: None,
                provider_request_id: request_id.clone(),
                usage: Some(u),
                estimated_input_tokens: job.estimated_input_tokens,
                estimated_output_tokens: job.estimated_output_tokens,
                rate_limit: None,
                started_at: job.started_at.unwrap_or(now),
                finished_at: now,
            };
            let end = End::Succeeded {
                result: success.body,
                usage: u,
                provider_request_id: request_id,
            };
            let served = Served::new(&pack.provider, &pack.model);
            outcomes.push(Outcome {
                call: Some(call),
                ..Outcome::new(holder, Some(served), end, settlement)
            });
        }
        end.failed = failed.len() as i32;
        let requeued = self.back_online(&pack.id, failed, now, Some(pack)).await?;
        end.requeued = requeued as i32;
        end.failed -= end.requeued;
        // The pack ends last, so a crash before that polls it again and rewrites nothing
        // (the outcomes are guarded).
        store::finish_attempts(&self.pool, &outcomes, now).await?;
        store::pack_ended(&self.pool, &pack.id, &end, now).await?;
        tracing::info!(
            pack = %pack.id, succeeded = end.succeeded, requeued = end.requeued, failed = end.failed,
            saved_micro_usd = end.online_cost_micro_usd - end.batch_cost_micro_usd, "provider batch ended"
        );
        step.ended += 1;
        step.requeued += requeued;
        Ok(())
    }

    /// Runs `submit`, renewing the pack's hold every [`SUBMIT_RENEW`] until it returns.
    async fn holding<T>(
        &self,
        id: &str,
        now: DateTime<Utc>,
        submit: impl std::future::Future<Output = T>,
    ) -> T {
        let started = tokio::time::Instant::now();
        tokio::pin!(submit);
        let mut renew = tokio::time::interval_at(started + SUBMIT_RENEW, SUBMIT_RENEW);
        loop {
            tokio::select! {
                out = &mut submit => return out,
                _ = renew.tick() => {
                    let until = now + started.elapsed() + SUBMIT_HOLD;
                    if let Err(e) = store::extend_submission(&self.pool, id, until).await {
                        tracing::warn!(pack = id, error = %e, "could not renew the pack's hold");
                    }
                }
            }
        }
    }

    /// Records the provider's answer, trying again while the database cannot take it.
    /// False when the pack was abandoned meanwhile.
    async fn record(&self, id: &str, s: &Submitted, now: DateTime<Utc>) -> Result<bool, StoreError> {
        let mut wait = Duration::from_secs(1);
        let mut tries = 1;
        loop {
            let recorded = store::pack_submitted(
                &self.pool,
                id,
                &s.batch_id,
                s.input_file_id.as_deref(),
                &s.key_name,
                now,
            )
            .await;
            match recorded {
                Err(e) if tries < RECORD_TRIES => {
                    tracing::warn!(pack = id, provider_batch = %s.batch_id, error = %e, "could not record the provider's batch; trying again");
                }
                done => return done,
            }
            tokio::time::sleep(wait).await;
            wait *= 2;
            tries += 1;
        }
    }

    /// Lines of pack `pack_id` the provider did not answer: back to the queue when their
    /// deadline has not passed — online, or, pulled back from `pack` (the pack's provider
    /// batch, once it ran), to its provider's flex tier where it may serve them in time
    /// ([`provider_batches::pulled_back`]) — else failed with the provider's reason.
    /// Returns how many were requeued.
    async fn back_online(
        &self,
        pack_id: &str,
        lines: Vec<(Job, ReasonCode, String)>,
        now: DateTime<Utc>,
        pack: Option<&ProviderBatch>,
    ) -> Result<usize, StoreError> {
        if lines.is_empty() {
            return Ok(0);
        }
        let owner = store::pack_owner(pack_id);
        let pulled_back = lines.iter().any(|l| l.1 == ReasonCode::ProviderBatchCanceled);
        let flex_seen = match pulled_back && pack.is_some() {
            true => provider_batches::flex_observations(&self.pool, &self.config, now).await?,
            false => FlexObservations::new(),
        };
        let mut lanes: HashMap<Decision, Vec<JobId>> = HashMap::new();
        for (job, code, _) in lines.iter().filter(|l| l.0.deadline > now) {
            let decision = match (code, pack) {
                (ReasonCode::ProviderBatchCanceled, Some(pack)) => provider_batches::pulled_back(
                    &self.config,
                    &flex_seen,
                    (&pack.provider, &pack.model),
                    pack.endpoint,
                    job.deadline,
                    now,
                ),
                _ => Decision {
                    via: Lane::Online,
                    reason: LaneReason::ProviderBatchFailedRetryOnline,
                },
            };
            lanes.entry(decision).or_default().push(job.id);
        }
        for (decision, ids) in lanes {
            store::dispatch_again(&self.pool, pack_id, &ids, decision).await?;
        }
        let outcomes: Vec<Outcome> = lines
            .iter()
            .map(|(job, code, message)| {
                let holder = Holder {
                    id: job.id,
                    attempt: job.attempt,
                    owner: owner.clone(),
                };
                let end = if job.deadline > now {
                    End::retry(now, *code, message)
                } else {
                    End::failed(*code, message)
                };
                // The provider did not serve the line: nothing it reserved was used.
                Outcome::new(holder, None, end, Settlement::UNSENT)
            })
            .collect();
        // Written with the gate notified (requeued work).
        let written = store::finish_attempts(&self.pool, &outcomes, now).await?;
        Ok(lines
            .iter()
            .zip(&written)
            .filter(|((job, ..), w)| **w && job.deadline > now)
            .count())
    }
}

/// Why a provider batch started at `started` must be pulled back at `now`, if it must: its
/// earliest line's `deadline` is within `margin` (the time its lines need online), or, once
/// it has finished a tenth of its lines, its pace says it will still run then.
pub fn pull_back_due(
    started: DateTime<Utc>,
    progress: Option<(u64, u64)>,
    deadline: DateTime<Utc>,
    margin: chrono::Duration,
    now: DateTime<Utc>,
) -> Option<&'static str> {
    let latest_end = deadline - margin;
    if now >= latest_end {
        return Some("its earliest line's deadline is within pull_back_secs");
    }
    let (done, total) = progress.filter(|(done, total)| *done > 0 && done * 10 >= *total)?;
    let elapsed_ms = (now - started).num_milliseconds().max(0) as f64;
    let projected =
        started + chrono::Duration::milliseconds((elapsed_ms * total as f64 / done as f64) as i64);
    (projected > latest_end)
        .then_some("at its pace it would end within pull_back_secs of its earliest line's deadline")
}

#[cfg(test)]
mod tests {
    use chrono::{Duration, TimeZone};

    use super::*;

    #[test]
    fn a_batch_is_pulled_back_by_its_margin_or_its_pace() {
        let t0 = Utc.with_ymd_and_hms(2026, 12, 4, 0, 0, 0).unwrap();
        let deadline = t0 + Duration::hours(24);
        let margin = Duration::hours(1);
        let at = |h: i64| t0 + Duration::hours(h);
        // On pace (half done in half the time the margin leaves): kept.
        assert_eq!(
            pull_back_due(t0, Some((500, 1000)), deadline, margin, at(11)),
            None
        );
        // Too little done to judge the pace: kept until the margin.
        assert_eq!(pull_back_due(t0, Some((5, 1000)), deadline, margin, at(20)), None);
        assert_eq!(pull_back_due(t0, None, deadline, margin, at(22)), None);
        assert!(pull_back_due(t0, None, deadline, margin, at(23)).is_some());
        // A fifth done in half the time: it would end long after the deadline.
        assert!(pull_back_due(t0, Some((200, 1000)), deadline, margin, at(12)).is_some());
    }
}
