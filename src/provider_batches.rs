//! The lanes a job may take besides one online call, as a scheduling choice ([`lane`]):
//!
//! - A `batch`-class job whose route's first target has `batch_api.enabled` and a batch
//!   API that takes the job's endpoint ([`BatchApiConfig::carries`]), and whose deadline is
//!   at least the provider's completion window away — or, once the provider's batches have
//!   been seen to end sooner, their observed turnaround (p90 of the last day's) plus the
//!   `pull_back_secs` its lines would need online ([`Turnarounds`]) — goes through the
//!   provider's own batch API (OpenAI Batch, Anthropic Message Batches) at the batch price.
//! - Else a job that is not interactive, whose route's first target has `flex.enabled`,
//!   of an endpoint the flex tier serves, and whose deadline is at least
//!   `flex.min_deadline_secs` away, is sent at the provider's flex tier ([`Lane::Flex`]) at
//!   its price; when the tier has no capacity the dispatcher sends it online. Once the
//!   tier has been observed ([`MIN_FLEX_OBSERVATIONS`] jobs served or refused in the last
//!   [`FLEX_OBSERVATION_SECS`], [`FlexObservations`]), what it did decides instead: none
//!   while it refuses most ([`FLEX_MAX_REFUSED_SHARE`]), else those whose deadline is at
//!   least its p90 latency plus `flex.fallback_secs` away — sooner than
//!   `min_deadline_secs` where it has been fast, later where it has been slow.
//! - A provider batch running late is pulled back (cancelled at the provider by the
//!   provider-batch worker); its unfinished lines go to the provider's flex tier where it
//!   may serve them in time ([`pulled_back`]), else online.
//!
//! Flow: the gate ([`decide_candidates`]) records the decision on each undecided queued
//! `batch`-class job it reads (`dispatch_via`, `dispatch_reason`); the gate admits a
//! provider-batch job against its tenant's buckets and the provider's enqueued-token pool
//! ([`path`]) instead of the online rate limits; online dispatchers skip it; the
//! provider-batch worker (`tollgate-workers`) packs, submits, polls and writes results
//! back through the ordinary completion path, sending lines the provider failed or
//! expired back online when their deadline allows.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::buckets;
use crate::config::{BatchApiConfig, Config, FlexConfig, ProviderConfig};
use crate::model::{Decision, JobClass, Lane, LaneReason};
use crate::routing::{self, Target};
use crate::store::{self, Candidate, FlexObservations, FlexObserved, StoreError, Turnarounds};
use crate::vocab::{Dimension, Endpoint};

/// `jobs.dispatch_via` of a job the provider's batch API carries.
pub const VIA_PROVIDER_BATCH: &str = "provider_batch";

/// The provider config of `target` when its batch API may carry jobs.
pub fn batch_api<'a>(config: &'a Config, target: &Target) -> Option<&'a ProviderConfig> {
    config
        .provider(&target.provider)
        .filter(|p| p.batch_api.enabled && BatchApiConfig::supported(p.kind))
}

/// Whether any provider sends jobs through its batch API (else no provider batch runs).
pub fn any_enabled(config: &Config) -> bool {
    config
        .providers
        .iter()
        .any(|p| p.batch_api.enabled && BatchApiConfig::supported(p.kind))
}

/// Packs a provider model must have ended before its observed turnaround counts.
pub const MIN_TURNAROUND_PACKS: i64 = 3;

/// Jobs a flex tier must have served or refused in the last [`FLEX_OBSERVATION_SECS`]
/// before what it did decides its lane.
pub const MIN_FLEX_OBSERVATIONS: i64 = 20;

/// How far back a flex tier's jobs are observed: a tier's capacity changes by the minute,
/// and a tier set aside for refusing is tried again once its refusals are this old.
pub const FLEX_OBSERVATION_SECS: i64 = 900;

/// A flex tier that refused more than this share of its observed jobs is sent none.
pub const FLEX_MAX_REFUSED_SHARE: f64 = 0.5;

/// What the lanes have done lately, by (provider, model): the batch APIs' turnarounds and
/// the flex tiers' service.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    pub turnarounds: &'a Turnarounds,
    pub flex: &'a FlexObservations,
}

/// The decision for a `batch`-class job of `endpoint` asking for `model` with `deadline`,
/// at `now`, given the batches' observed `turnarounds`.
pub fn decide(
    config: &Config,
    turnarounds: &Turnarounds,
    endpoint: Endpoint,
    model: &str,
    deadline: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Decision {
    let online = |reason| Decision {
        via: Lane::Online,
        reason,
    };
    let first = routing::resolve(config, model, endpoint)
        .ok()
        .and_then(|t| t.into_iter().next());
    let Some(provider) = first.as_ref().and_then(|t| batch_api(config, t)) else {
        return online(LaneReason::RouteHasNoBatchApi);
    };
    if !BatchApiConfig::carries(provider.kind, endpoint) {
        return online(LaneReason::EndpointNotBatched);
    }
    let left = deadline - now;
    if left >= secs(provider.batch_api.min_deadline_secs) {
        return Decision {
            via: Lane::ProviderBatch,
            reason: LaneReason::DeadlineAllowsBatchApi,
        };
    }
    // Sooner than the provider promises, but its batches have ended sooner, and a late one
    // is pulled back with the time its lines need online.
    let observed = first
        .as_ref()
        .and_then(|t| turnarounds.get(&(t.provider.clone(), t.model.clone())));
    match observed {
        Some(turnaround) if left >= *turnaround + secs(provider.batch_api.pull_back_secs) => Decision {
            via: Lane::ProviderBatch,
            reason: LaneReason::ObservedTurnaroundAllowsBatchApi,
        },
        _ => online(LaneReason::DeadlineTooCloseForBatchApi),
    }
}

/// The config of `provider` when its flex tier may serve jobs of `endpoint`.
pub fn flex<'a>(config: &'a Config, provider: &str, endpoint: Endpoint) -> Option<&'a ProviderConfig> {
    config
        .provider(provider)
        .filter(|p| p.flex.enabled && FlexConfig::supported(p.kind) && FlexConfig::serves(endpoint))
}

/// The lane of a line of `endpoint` pulled back from `provider`'s batch for `model`, with
/// `deadline`, at `now`: the provider's flex tier where it may serve the line in time (given
/// what it did lately, `seen`) — `pulled_back_to_flex` —, else online
/// (`pulled_back_from_provider_batch`).
pub fn pulled_back(
    config: &Config,
    seen: &FlexObservations,
    (provider, model): (&str, &str),
    endpoint: Endpoint,
    deadline: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Decision {
    let flex = flex(config, provider, endpoint).and_then(|p| {
        flex_decision(
            p,
            seen.get(&(provider.to_owned(), model.to_owned())),
            deadline - now,
        )
    });
    match flex {
        Some(d) if d.via == Lane::Flex => Decision {
            via: Lane::Flex,
            reason: LaneReason::PulledBackToFlex,
        },
        _ => Decision {
            via: Lane::Online,
            reason: LaneReason::PulledBackFromProviderBatch,
        },
    }
}

/// The lane of a job of `class` and `endpoint` asking for `model` with `deadline`, at
/// `now`, given what the lanes did lately: a `batch`-class job's is always decided (its
/// provider batch, or online and why); another's only when its route's first target has a
/// flex tier that may serve it (else `None`: online, nothing to record). Interactive jobs
/// are always online.
pub fn lane(
    config: &Config,
    observed: Observed<'_>,
    class: JobClass,
    endpoint: Endpoint,
    model: &str,
    deadline: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Option<Decision> {
    let batch = (class == JobClass::Batch)
        .then(|| decide(config, observed.turnarounds, endpoint, model, deadline, now));
    if batch.as_ref().is_some_and(|d| d.via == Lane::ProviderBatch) || class == JobClass::Interactive {
        return batch;
    }
    let first = routing::resolve(config, model, endpoint)
        .ok()
        .and_then(|t| t.into_iter().next());
    let Some((target, provider)) = first
        .as_ref()
        .and_then(|t| Some((t, flex(config, &t.provider, endpoint)?)))
    else {
        return batch;
    };
    let seen = observed
        .flex
        .get(&(target.provider.clone(), target.model.clone()));
    flex_decision(provider, seen, deadline - now).or(batch)
}

/// Whether a job whose deadline is `left` away goes to `provider`'s flex tier, given what
/// the tier did lately (`seen`): `None` where neither the configuration nor what was seen
/// sends it there (online, nothing to say).
fn flex_decision(
    provider: &ProviderConfig,
    seen: Option<&FlexObserved>,
    left: chrono::Duration,
) -> Option<Decision> {
    let decision = |via, reason| Some(Decision { via, reason });
    let configured = left >= secs(provider.flex.min_deadline_secs);
    let Some(seen) = seen else {
        return configured.then_some(Decision {
            via: Lane::Flex,
            reason: LaneReason::DeadlineAllowsFlex,
        });
    };
    if seen.refused_share() > FLEX_MAX_REFUSED_SHARE {
        return decision(Lane::Online, LaneReason::FlexMostlyUnavailable);
    }
    let needed = seen.p90_latency.unwrap_or_else(chrono::Duration::zero) + secs(provider.flex.fallback_secs);
    match (left >= needed, configured) {
        (true, true) => decision(Lane::Flex, LaneReason::DeadlineAllowsFlex),
        (true, false) => decision(Lane::Flex, LaneReason::ObservedLatencyAllowsFlex),
        (false, true) => decision(Lane::Online, LaneReason::FlexTooSlowForDeadline),
        (false, false) => None,
    }
}

/// A configured number of seconds as a duration (one beyond any date: the longest chrono
/// holds, where `Duration::seconds` would panic).
pub fn secs(s: u64) -> chrono::Duration {
    chrono::Duration::seconds(i64::try_from(s).unwrap_or(i64::MAX / 1000))
}

/// Whether any provider has a lane besides online: a batch API or a flex tier.
fn any_lane(config: &Config) -> bool {
    any_enabled(config) || any_flex(config)
}

/// Whether any provider has a flex tier enabled (else no flex observations are read).
pub fn any_flex(config: &Config) -> bool {
    config
        .providers
        .iter()
        .any(|p| p.flex.enabled && FlexConfig::supported(p.kind))
}

/// What the flex tiers did lately ([`FLEX_OBSERVATION_SECS`], at least
/// [`MIN_FLEX_OBSERVATIONS`] jobs); nothing to read unless some provider has one enabled.
pub async fn flex_observations(
    pool: &PgPool,
    config: &Config,
    now: DateTime<Utc>,
) -> Result<FlexObservations, StoreError> {
    if !any_flex(config) {
        return Ok(FlexObservations::new());
    }
    let since = now - chrono::Duration::seconds(FLEX_OBSERVATION_SECS);
    store::flex_observations(pool, since, MIN_FLEX_OBSERVATIONS).await
}

/// The gate's step before planning: decides the round's candidates not yet decided
/// ([`lane`], given what the flex tiers did lately: `flex`, [`flex_observations`]),
/// records the decisions (on jobs still queued) and marks the candidates, so no job is
/// admitted before it is decided. Does nothing unless some provider has a batch API or a
/// flex tier enabled.
pub async fn decide_candidates(
    pool: &PgPool,
    config: &Config,
    flex: &FlexObservations,
    candidates: &mut [Candidate],
    now: DateTime<Utc>,
) -> Result<usize, StoreError> {
    if !any_lane(config) {
        return Ok(0);
    }
    let undecided_batch = candidates
        .iter()
        .any(|c| c.class == JobClass::Batch && c.dispatch_via.is_none());
    let turnarounds = match undecided_batch && any_enabled(config) {
        true => store::batch_turnarounds(pool, now, MIN_TURNAROUND_PACKS).await?,
        false => Turnarounds::new(),
    };
    let mut decisions = Vec::new();
    for c in candidates.iter_mut().filter(|c| c.dispatch_via.is_none()) {
        let observed = Observed {
            turnarounds: &turnarounds,
            flex,
        };
        let Some(d) = lane(config, observed, c.class, c.endpoint, &c.model, c.deadline, now) else {
            continue;
        };
        c.dispatch_via = Some(d.via.as_str().to_owned());
        decisions.push((c.id, d));
    }
    if decisions.is_empty() {
        return Ok(0);
    }
    store::set_dispatch(pool, &decisions).await
}

/// The buckets a provider-batch job sent to `target` must fit: its holders' (`held`: its
/// key's and tenants'; all but concurrency: a line waiting at the provider holds no
/// connection) and the provider's enqueued-token pool, not the online rate limits.
pub fn path(config: &Config, held: &[(String, Dimension)], target: &Target) -> Vec<(String, Dimension)> {
    let mut keys: Vec<(String, Dimension)> = held
        .iter()
        .filter(|(_, d)| *d != Dimension::Concurrency)
        .cloned()
        .collect();
    if batch_api(config, target).is_some_and(|p| p.batch_api.enqueued_tokens.is_some()) {
        keys.push((
            buckets::batch_queue_key(&target.provider, &target.model),
            Dimension::InputTokens,
        ));
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_api_carries_the_endpoints_its_provider_takes() {
        let example = include_str!("../tollgate.example.toml");
        let config = Config::parse(
            &example.replacen(
                "# [providers.batch_api]\n# enabled = true\n",
                "[providers.batch_api]\nenabled = true\nmin_deadline_secs = 3600\n",
                1,
            ),
            "t.toml",
        )
        .unwrap();
        let now = Utc::now();
        let lane = |endpoint, model, hours| {
            let d = decide(
                &config,
                &Turnarounds::new(),
                endpoint,
                model,
                now + chrono::Duration::hours(hours),
                now,
            );
            (d.via, d.reason)
        };
        let batched = (Lane::ProviderBatch, LaneReason::DeadlineAllowsBatchApi);
        for endpoint in [
            Endpoint::ChatCompletions,
            Endpoint::Embeddings,
            Endpoint::Responses,
            Endpoint::Completions,
            Endpoint::Moderations,
        ] {
            assert_eq!(lane(endpoint, "oai/gpt-4o-mini", 2), batched, "{endpoint}");
        }
        assert_eq!(
            lane(Endpoint::Messages, "oai/gpt-4o-mini", 2),
            (Lane::Online, LaneReason::EndpointNotBatched),
            "a Messages request to OpenAI is translated per call"
        );
        assert_eq!(
            lane(Endpoint::Embeddings, "oai/gpt-4o-mini", 0),
            (Lane::Online, LaneReason::DeadlineTooCloseForBatchApi)
        );
        assert_eq!(
            lane(Endpoint::Messages, "ant/claude-3-5-haiku-latest", 2),
            (Lane::Online, LaneReason::RouteHasNoBatchApi)
        );
        assert!(BatchApiConfig::carries(
            crate::config::ProviderKind::Anthropic,
            Endpoint::Messages
        ));
        assert!(!BatchApiConfig::carries(
            crate::config::ProviderKind::Anthropic,
            Endpoint::Embeddings
        ));
    }

    /// The flex tier takes what has the time and is not interactive; a batch line the
    /// batch API takes stays there.
    #[test]
    fn the_flex_lane_takes_jobs_with_time() {
        let example = include_str!("../tollgate.example.toml");
        let config = Config::parse(
            &example.replacen(
                "# [providers.batch_api]\n# enabled = true\n",
                "[providers.batch_api]\nenabled = true\nmin_deadline_secs = 7200\n[providers.flex]\nenabled = true\n",
                1,
            ),
            "t.toml",
        )
        .unwrap();
        let now = Utc::now();
        let (turnarounds, flex) = (Turnarounds::new(), FlexObservations::new());
        let observed = Observed {
            turnarounds: &turnarounds,
            flex: &flex,
        };
        let lane_of = |class, endpoint, minutes| {
            lane(
                &config,
                observed,
                class,
                endpoint,
                "oai/gpt-4o-mini",
                now + chrono::Duration::minutes(minutes),
                now,
            )
            .map(|d| (d.via, d.reason))
        };
        let flex = Some((Lane::Flex, LaneReason::DeadlineAllowsFlex));
        assert_eq!(lane_of(JobClass::Standard, Endpoint::ChatCompletions, 60), flex);
        assert_eq!(lane_of(JobClass::Background, Endpoint::Responses, 60), flex);
        assert_eq!(
            lane_of(JobClass::Batch, Endpoint::ChatCompletions, 60),
            flex,
            "too soon for the batch API"
        );
        assert_eq!(
            lane_of(JobClass::Batch, Endpoint::ChatCompletions, 180),
            Some((Lane::ProviderBatch, LaneReason::DeadlineAllowsBatchApi))
        );
        assert_eq!(
            lane_of(JobClass::Interactive, Endpoint::ChatCompletions, 60),
            None
        );
        assert_eq!(
            lane_of(JobClass::Standard, Endpoint::ChatCompletions, 10),
            None,
            "too soon for flex"
        );
        assert_eq!(
            lane_of(JobClass::Standard, Endpoint::Embeddings, 60),
            None,
            "flex serves chat and Responses"
        );
        assert_eq!(
            lane_of(JobClass::Batch, Endpoint::ChatCompletions, 10),
            Some((Lane::Online, LaneReason::DeadlineTooCloseForBatchApi))
        );
    }

    /// Once the tier has been observed, what it did decides: a fast tier takes deadlines
    /// sooner than `min_deadline_secs`, a slow one leaves out those it would make late, one
    /// refusing most calls gets none.
    #[test]
    fn the_flex_lane_follows_what_the_tier_did() {
        let example = include_str!("../tollgate.example.toml");
        let config = Config::parse(
            &example.replacen(
                "# [providers.flex]\n# enabled = true\n",
                "[providers.flex]\nenabled = true\nmin_deadline_secs = 1800\nfallback_secs = 300\n",
                1,
            ),
            "t.toml",
        )
        .unwrap();
        let now = Utc::now();
        let turnarounds = Turnarounds::new();
        let lane_with = |served, refused, p90_secs: i64, minutes| {
            let mut flex = FlexObservations::new();
            flex.insert(
                ("oai".to_owned(), "gpt-4o-mini".to_owned()),
                FlexObserved {
                    served,
                    refused,
                    p90_latency: (served > 0).then(|| chrono::Duration::seconds(p90_secs)),
                },
            );
            let observed = Observed {
                turnarounds: &turnarounds,
                flex: &flex,
            };
            lane(
                &config,
                observed,
                JobClass::Standard,
                Endpoint::ChatCompletions,
                "oai/gpt-4o-mini",
                now + chrono::Duration::minutes(minutes),
                now,
            )
            .map(|d| (d.via, d.reason))
        };
        // Fast (p90 20 s): 10 minutes is enough (20 s + 5 min), though under 30.
        assert_eq!(
            lane_with(30, 2, 20, 10),
            Some((Lane::Flex, LaneReason::ObservedLatencyAllowsFlex))
        );
        assert_eq!(
            lane_with(30, 2, 20, 60),
            Some((Lane::Flex, LaneReason::DeadlineAllowsFlex))
        );
        assert_eq!(lane_with(30, 2, 20, 4), None, "under the fallback time");
        // Slow (p90 40 min): an hour's deadline would be late.
        assert_eq!(
            lane_with(30, 2, 2400, 40),
            Some((Lane::Online, LaneReason::FlexTooSlowForDeadline))
        );
        assert_eq!(
            lane_with(30, 2, 2400, 60),
            Some((Lane::Flex, LaneReason::DeadlineAllowsFlex))
        );
        // Refusing most: none, whatever the deadline.
        assert_eq!(
            lane_with(5, 20, 20, 600),
            Some((Lane::Online, LaneReason::FlexMostlyUnavailable))
        );
        assert_eq!(
            lane_with(0, 25, 0, 600),
            Some((Lane::Online, LaneReason::FlexMostlyUnavailable))
        );
    }

    /// A line pulled back from a provider batch goes to the provider's flex tier when the
    /// tier may serve it in time, else online.
    #[test]
    fn a_pulled_back_line_goes_flex_when_the_tier_has_the_time() {
        let example = include_str!("../tollgate.example.toml");
        let flexible = example.replacen(
            "# [providers.flex]\n# enabled = true\n",
            "[providers.flex]\nenabled = true\n",
            1,
        );
        let now = Utc::now();
        let lane_of = |text: &str, endpoint, minutes| {
            let config = Config::parse(text, "t.toml").unwrap();
            let d = pulled_back(
                &config,
                &FlexObservations::new(),
                ("oai", "gpt-4o-mini"),
                endpoint,
                now + chrono::Duration::minutes(minutes),
                now,
            );
            (d.via, d.reason)
        };
        let online = (Lane::Online, LaneReason::PulledBackFromProviderBatch);
        assert_eq!(
            lane_of(&flexible, Endpoint::ChatCompletions, 30),
            (Lane::Flex, LaneReason::PulledBackToFlex)
        );
        assert_eq!(
            lane_of(&flexible, Endpoint::ChatCompletions, 5),
            online,
            "under min_deadline_secs"
        );
        assert_eq!(
            lane_of(&flexible, Endpoint::Embeddings, 30),
            online,
            "flex serves chat and Responses"
        );
        assert_eq!(
            lane_of(example, Endpoint::ChatCompletions, 30),
            online,
            "no flex tier"
        );
    }
}
