//! Plans: a queued job with everything admission needs, computed from the configuration
//! and what was learned before any lock is taken — the class it competes in (after the
//! starvation guard), its tenant's weight, its cost in tokens, and the targets it may go
//! to, each with its path of buckets and the amount it takes from each.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};

use chrono::{DateTime, Utc};

use super::{Failed, Verdict};
use crate::buckets::{self, Demand, EstimatedCost};
use crate::config::Config;
use crate::keyring::Keyring;
use crate::learning::{self, Learned};
use crate::model::JobClass;
use crate::provider_batches;
use crate::routing::{self, Target};
use crate::store::{Calibration, Candidate};
use crate::tenants::{Tenant, TenantDirectory};
use crate::vocab::{Dimension, PriceSource};

/// Fewest samples before a learned output estimate replaces `max_tokens`.
const MIN_OUTPUT_SAMPLES: i64 = 20;
/// Margin on a learned output estimate.
const OUTPUT_MARGIN: f64 = 1.25;

/// A candidate with everything admission needs.
#[derive(Debug, Clone)]
pub struct Plan {
    pub job: Candidate,
    /// The class it competes in: its own, or interactive once it waited longer than its
    /// class's `starve_after_secs`.
    pub class: JobClass,
    /// Its tenant's weight (at least 1).
    pub weight: f64,
    /// Its estimated tokens (at least 1): what its turn costs its tenant's virtual time.
    pub cost: f64,
    /// Targets in order of preference.
    pub routes: Vec<Route>,
    /// Its tenant's queue holds jobs the round did not read: once the last one read is
    /// admitted, its tenant's next turn cannot be served from what was read.
    pub unread_behind: bool,
}

/// One target a job may go to, and what it takes there.
#[derive(Debug, Clone)]
pub struct Route {
    pub target: Target,
    /// The scope its provider's limits are learned under and a 429 pauses: its key's
    /// pool's where the model's keys are in several pools, else the model's
    /// (`buckets::learned_scope`).
    pub scope: String,
    /// Every bucket on the way, by key, with the amount the job takes from it.
    pub path: Vec<(String, f64)>,
    /// What its estimate costs there.
    pub cost: EstimatedCost,
}

impl Plan {
    /// The keys of the buckets on any of its routes.
    pub fn bucket_keys(&self) -> impl Iterator<Item = &String> {
        self.routes.iter().flat_map(|r| r.path.iter().map(|k| &k.0))
    }
}

/// What the gate knows of provider limits beyond the config, from `learned_limits`.
#[derive(Debug, Default)]
pub struct Known {
    /// Provider model scope → the learned buckets that govern it.
    buckets: HashMap<String, Vec<(String, Dimension)>>,
    /// Scopes a response was seen from (their cold-start probe is over).
    seen: HashSet<String>,
}

impl Known {
    pub fn new(rows: &[Learned]) -> Self {
        let mut known = Known::default();
        for r in rows {
            known.seen.insert(r.scope.clone());
            if r.governs() {
                known
                    .buckets
                    .entry(r.scope.clone())
                    .or_default()
                    .push((r.bucket_key(), r.name.dimension()));
            }
        }
        known
    }
}

/// The cold-start probe bucket of a scope.
pub fn probe_key(scope: &str) -> String {
    format!("{scope}:probe")
}

/// Whether `key` is a cold-start probe bucket (see [`probe_key`]).
pub fn is_probe(key: &str) -> bool {
    key.ends_with(":probe")
}

/// Makes plans from candidates, with what one round (or one arrival) knows.
pub struct Planner<'a> {
    pub config: &'a Config,
    /// The tenants: weights, and the limits and budgets on each job's path.
    pub tenants: &'a TenantDirectory,
    /// The provider keys that may be chosen, and their limits.
    pub keyring: &'a Keyring,
    /// Learned estimates per model.
    pub calibration: &'a HashMap<String, Calibration>,
    pub known: &'a Known,
    /// Rotates the first key tried when keys have their own limits; advances once per
    /// target planned.
    pub key_turn: &'a AtomicUsize,
}

impl Planner<'_> {
    /// The plan of `job` at `now`; a job whose model is no longer configured fails
    /// (`unknown_model`).
    pub fn plan(&self, job: Candidate, now: DateTime<Utc>) -> Result<Plan, Box<Failed>> {
        let config = self.config;
        let Ok(targets) = routing::resolve(config, &job.model, job.endpoint) else {
            let message = format!(
                "model {:?} is no longer configured for {}",
                job.model, job.endpoint
            );
            return Err(Box::new(Failed {
                job,
                verdict: Verdict::UnknownModel,
                bucket: String::new(),
                message,
                note: None,
            }));
        };
        // Fallback: targets that failed the job are left out while the route has others.
        let failed = job.failed_targets.as_deref().unwrap_or_default();
        let fresh: Vec<Target> = targets
            .iter()
            .filter(|t| !failed.contains(&t.label()))
            .cloned()
            .collect();
        let targets = if fresh.is_empty() { targets } else { fresh };
        let lineage = self.tenants.lineage(&job.tenant);
        let weight = self.tenants.weight(&job.tenant);
        let held = self.holders_path(&job, &lineage);
        let estimate = Demand {
            input_tokens: f64::from(job.estimated_input_tokens.max(0)),
            output_tokens: f64::from(job.estimated_output_tokens.max(0)),
        };
        // Provider batch API: only targets whose batch API carries it, against its tenant's
        // buckets and the provider's enqueued-token pool instead of the online limits.
        let batch_api = job.dispatch_via.as_deref() == Some(provider_batches::VIA_PROVIDER_BATCH);
        let routes = targets
            .into_iter()
            .filter(|t| !batch_api || provider_batches::batch_api(config, t).is_some())
            .flat_map(|target| self.per_key(target))
            .map(|target| {
                let demand = self.calibrated(&target, estimate);
                let (price, price_source) = config
                    .provider(&target.provider)
                    .map_or((None, PriceSource::Unpriced), |p| p.priced(&target.model));
                let spend = buckets::spend_micro_usd(price, demand.input_tokens, 0.0, demand.output_tokens);
                let scope = buckets::key_learned_scope(
                    self.config,
                    self.keyring,
                    &target.provider,
                    &target.model,
                    target.key.as_deref(),
                );
                let path = if batch_api {
                    provider_batches::path(config, &held, &target)
                } else {
                    self.full_path(&held, &job.model, &target, &scope)
                };
                let path = path
                    .into_iter()
                    .map(|(key, dim)| (key, buckets::amount(dim, demand, spend)))
                    .collect();
                let cost = EstimatedCost {
                    micro_usd: spend,
                    price_source,
                };
                Route {
                    target,
                    scope,
                    path,
                    cost,
                }
            })
            .collect();
        Ok(Plan {
            cost: estimate.total_tokens().max(1.0),
            class: competing_class(config, &job, now),
            weight,
            routes,
            job,
            unread_behind: false,
        })
    }

    /// The demand to reserve on `target`: input scaled up by the model's learned ratio
    /// (never down: a provider that counts fewer tokens than estimated costs nothing
    /// extra), output from the model's learned p90 where the provider does not charge
    /// `max_tokens` up front.
    fn calibrated(&self, target: &Target, estimate: Demand) -> Demand {
        let Some(c) = self.calibration.get(&target.model) else {
            return estimate;
        };
        let charges_max = self
            .config
            .provider(&target.provider)
            .is_none_or(|p| p.charges_max_tokens);
        let output = match c.output_p90 {
            Some(p90) if !charges_max && c.samples >= MIN_OUTPUT_SAMPLES => {
                estimate.output_tokens.min((p90 * OUTPUT_MARGIN).ceil())
            }
            _ => estimate.output_tokens,
        };
        Demand {
            input_tokens: (estimate.input_tokens * c.input_ratio.max(1.0)).ceil(),
            output_tokens: output,
        }
    }

    /// The buckets of `job`'s own limits and budgets, the same on every route: its API
    /// key's, its key's application's, its tenant's and those of the tenants above it
    /// (`lineage`), and its batch's cost cap.
    fn holders_path(&self, job: &Candidate, lineage: &[&Tenant]) -> Vec<(String, Dimension)> {
        let key = job
            .api_key
            .and_then(|id| Some((id, self.tenants.key_limits(id)?)));
        let key_specs = key.into_iter().flat_map(|(id, k)| {
            buckets::limit_specs(&buckets::api_key_scope(id), &k.own.limits, &k.own.budgets)
        });
        // The application the key is labelled with, where its tenant limits it.
        let application = key
            .and_then(|(_, k)| k.application.as_deref())
            .zip(lineage.first())
            .and_then(|(app, tenant)| {
                Some((
                    buckets::application_scope(&tenant.name, app),
                    tenant.applications.get(app)?,
                ))
            });
        let application_specs = application
            .into_iter()
            .flat_map(|(scope, a)| buckets::limit_specs(&scope, &a.limits, &a.budgets));
        let tenant_specs = lineage
            .iter()
            .flat_map(|t| buckets::limit_specs(&buckets::tenant_scope(&t.name), &t.limits, &t.budgets));
        // A batch's cost cap: a bucket only where the batch has one (none: nothing taken).
        let batch_cap = job
            .batch_id
            .as_deref()
            .map(|id| (buckets::batch_cap_key(id), Dimension::SpendMicroUsd));
        key_specs
            .chain(application_specs)
            .chain(tenant_specs)
            .map(|s| (s.key, s.dimension))
            .chain(batch_cap)
            .collect()
    }

    /// The buckets a job sent to `target` must fit: its configured path (with `held`, its
    /// holders' buckets), the learned buckets of `scope` (the target's model's, or its key's
    /// pool's when the model's keys are in several: [`buckets::key_learned_scope`]), and — while
    /// nothing is known of those limits — their cold-start probe, then, while responses
    /// come without saying them, their pace.
    fn full_path(
        &self,
        held: &[(String, Dimension)],
        requested: &str,
        target: &Target,
        scope: &str,
    ) -> Vec<(String, Dimension)> {
        let provider_key = self.config.provider(&target.provider).zip(target.key.as_deref());
        let key_limits = provider_key.and_then(|(p, name)| self.keyring.limits(p, name));
        let mut path = buckets::path(self.config, held, requested, target, key_limits);
        for (key, dim) in self.known.buckets.get(scope).into_iter().flatten() {
            if !path.iter().any(|(k, _)| k == key) {
                path.push((key.clone(), *dim));
            }
        }
        let unknown = self
            .config
            .provider(&target.provider)
            .is_some_and(|p| p.learn_limits && !p.configures_rates(&target.model));
        if unknown && !self.known.seen.contains(scope) {
            path.push((probe_key(scope), Dimension::Concurrency));
        } else if unknown && !self.known.buckets.contains_key(scope) {
            path.push((learning::pace_key(scope), Dimension::Requests));
        }
        path
    }

    /// A target as the options admission may choose from: one per key that serves the
    /// model, starting from a key chosen by weighted rotation so load spreads as the keys'
    /// weights say (the gate picks the key, so a rejected key can be left out).
    fn per_key(&self, target: Target) -> Vec<Target> {
        let Some(p) = self.config.provider(&target.provider) else {
            return vec![target];
        };
        let keys: Vec<(&str, u32)> = self
            .keyring
            .serving(p, &target.model)
            .into_iter()
            .map(|k| (k.name, k.weight))
            .collect();
        let total: u32 = keys.iter().map(|k| k.1).sum();
        if total == 0 {
            return vec![target];
        }
        let turn = (self.key_turn.fetch_add(1, Ordering::Relaxed) % total as usize) as u32;
        let mut start = 0;
        let mut acc = 0;
        for (i, (_, w)) in keys.iter().enumerate() {
            acc += w;
            if turn < acc {
                start = i;
                break;
            }
        }
        (0..keys.len())
            .map(|i| Target {
                key: Some(keys[(start + i) % keys.len()].0.to_owned()),
                ..target.clone()
            })
            .collect()
    }
}

/// The submissions before which a queued job of `class` has waited past its guard at `now`
/// (every job [`competing_class`] promotes was submitted before it), for the gate to read
/// them wherever they stand in their queue; the epoch, reading none, for interactive work,
/// which has no class to be promoted from.
pub fn starving_before(config: &Config, class: JobClass, now: DateTime<Utc>) -> DateTime<Utc> {
    if class == JobClass::Interactive {
        return DateTime::UNIX_EPOCH;
    }
    let guard = std::time::Duration::from_secs(config.classes.get(class).starve_after_secs);
    chrono::TimeDelta::from_std(guard)
        .ok()
        .and_then(|guard| now.checked_sub_signed(guard))
        .unwrap_or(DateTime::UNIX_EPOCH)
}

/// The class `job` competes in at `now`: interactive once it waited longer than its own
/// class's `starve_after_secs` (the starvation guard), so a steady stream of higher
/// classes cannot hold it forever.
pub fn competing_class(config: &Config, job: &Candidate, now: DateTime<Utc>) -> JobClass {
    let starve_after = config.classes.get(job.class).starve_after_secs;
    let waited = (now - job.created_at).num_seconds().max(0) as u64;
    if waited > starve_after {
        JobClass::Interactive
    } else {
        job.class
    }
}
