//! The provider-batch worker: packs admitted provider-batch jobs per (provider, model,
//! key) within the provider's limits, submits each pack to the provider's batch API,
//! polls it, and writes each line's result back through the ordinary completion path
//! (`finish_attempts`, guarded by the pack's lease, so a repeated write is a no-op) at
//! the batch price. Lines the provider failed or expired go back to the queue as online
//! jobs when their deadline allows (`provider_batch_failed_retry_online`), else fail.
//!
//! Crash safety: a pack's row and its jobs' claim commit together (`submitting`) before
//! the provider is called; the provider's batch id is recorded as soon as it answers. The
//! jobs' lease belongs to the pack (`provider_batch:<id>`) and lasts the provider's window
//! plus a margin, so whichever process polls next picks the pack up. A pack left
//! `submitting` (its submitter died, or the provider refused it) is abandoned and its
//! jobs requeued; only a crash between the provider's answer and recording it could
//! send lines twice.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tollgate::attempt::{Call, End, Holder, Outcome, Served};
use tollgate::buckets;
use tollgate::config::{Config, ProviderConfig};
use tollgate::model::{Job, JobId};
use tollgate::store::{self, NewPack, PackEnd, PackGroup, ProviderBatch, Settlement, StoreError};
use tollgate::vocab::{LaneReason, ReasonCode};

use crate::providers::Providers;
use crate::providers::batch_api::{LineResult, Status};

/// A pack still `submitting` after this was never submitted.
const STALE_SUBMIT: Duration = Duration::from_secs(600);
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
}

#[derive(Clone)]
pub struct ProviderBatcher {
    pool: PgPool,
    config: Arc<Config>,
    providers: Providers,
}

impl ProviderBatcher {
    pub fn new(pool: PgPool, config: Arc<Config>, providers: Providers) -> Self {
        Self {
            pool,
            config,
            providers,
        }
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
            if let Err(e) = self.run_once(Utc::now()).await {
                tracing::warn!(error = %e, "provider batch step failed");
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(tick) => {}
            }
        }
    }

    /// One step: abandon stale packs, pack and submit what is ready, poll what is due.
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<Step, StoreError> {
        let mut step = Step::default();
        for id in store::abandon_stale_packs(&self.pool, now, STALE_SUBMIT).await? {
            step.abandoned += 1;
            let jobs = store::pack_jobs(&self.pool, &id).await?;
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
            step.requeued += self.back_online(&id, failed, now).await?;
        }
        for group in store::pack_groups(&self.pool).await? {
            self.pack(&group, now, &mut step).await?;
        }
        for pack in store::due_packs(&self.pool, now, POLL_HOLD, POLLS_PER_STEP).await? {
            self.poll(&pack, now, &mut step).await?;
        }
        Ok(step)
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
                lease_until: now + lease,
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
        let submitted = match &client {
            Some(c) => c.submit(&group.model, &lines, id).await,
            None => Err(format!("provider {:?} is not configured", group.provider)),
        };
        match submitted {
            Ok(s) => {
                let recorded = store::pack_submitted(
                    &self.pool,
                    id,
                    &s.batch_id,
                    s.input_file_id.as_deref(),
                    &s.key_name,
                    now,
                )
                .await?;
                if recorded {
                    tracing::info!(pack = id, provider_batch = %s.batch_id, lines = jobs.len(), "provider batch submitted");
                    step.submitted += 1;
                } else if let Some(c) = &client {
                    // Abandoned meanwhile: its jobs went back to the queue; stop the provider's copy.
                    let _ = c.cancel(&s.batch_id).await;
                }
            }
            Err(reason) => {
                tracing::warn!(pack = id, %reason, "the provider refused the batch; its lines go online");
                store::pack_refused(&self.pool, id, &reason, now).await?;
                let failed = jobs
                    .into_iter()
                    .map(|j| (j, ReasonCode::ProviderBatchRefused, reason.clone()))
                    .collect();
                step.requeued += self.back_online(id, failed, now).await?;
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
            store::poll_later(&self.pool, &pack.id, &status.status, later).await?;
            return Ok(());
        }
        let results = match client.results(batch_id, &status).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(pack = %pack.id, error = %e, "could not read the provider batch's results");
                store::poll_later(&self.pool, &pack.id, &status.status, later).await?;
                return Ok(());
            }
        };
        self.write_back(pack, &status, results, now, step).await
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
        let mut saved = Vec::new();
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
            end.succeeded += 1;
            end.online_cost_micro_usd += online;
            end.batch_cost_micro_usd += batch_cost;
            saved.push((job.id, online - batch_cost));
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
        let requeued = self.back_online(&pack.id, failed, now).await?;
        end.requeued = requeued as i32;
        end.failed -= end.requeued;
        // Savings first: once a line's outcome is written its tollgate batch may finish,
        // and its report must include them. The pack ends last, so a crash before that
        // polls it again and rewrites nothing (the outcomes are guarded).
        store::record_savings(&self.pool, &pack.id, &saved).await?;
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

    /// Lines the provider did not answer: back to the queue as online jobs when their
    /// deadline has not passed, else failed with the provider's reason. Returns how many
    /// were requeued.
    async fn back_online(
        &self,
        pack_id: &str,
        lines: Vec<(Job, ReasonCode, String)>,
        now: DateTime<Utc>,
    ) -> Result<usize, StoreError> {
        if lines.is_empty() {
            return Ok(0);
        }
        let owner = store::pack_owner(pack_id);
        let online: Vec<JobId> = lines
            .iter()
            .filter(|l| l.0.deadline > now)
            .map(|l| l.0.id)
            .collect();
        store::dispatch_online(
            &self.pool,
            pack_id,
            &online,
            LaneReason::ProviderBatchFailedRetryOnline.as_str(),
        )
        .await?;
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
