//! `[providers.flex]`: whether a provider's flex tier may serve jobs whose deadline leaves
//! it time — OpenAI's (`service_tier: "flex"`: the batch price, slower, and a 429 "Resource
//! Unavailable" when it has no capacity) and Groq's (`service_tier: "flex"`: the on-demand
//! price at higher rate limits, a 498 `capacity_exceeded` when it has none), also Azure
//! OpenAI's preview.

use serde::Deserialize;

use super::ProviderKind;
use crate::vocab::Endpoint;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FlexConfig {
    /// Send eligible jobs (not interactive, chat or Responses, their deadline far enough)
    /// at the provider's flex tier. Default false.
    pub enabled: bool,
    /// Fraction of the online price a flex call costs: 0.5 for OpenAI's (the batch price),
    /// 1.0 for Groq's (the on-demand price). Default 0.5.
    pub discount: f64,
    /// A job goes flex only if its deadline is at least this far away: the tier is slow,
    /// and a call it refuses must still find time online. Default 15 minutes. Once the
    /// tier has been observed (`tollgate::provider_batches::MIN_FLEX_OBSERVATIONS` jobs in
    /// the last hour), its p90 latency plus `fallback_secs` is the time needed instead.
    pub min_deadline_secs: u64,
    /// The time a job the tier refused or kept needs online afterwards: with the tier
    /// observed, a job goes flex when its deadline is at least the tier's p90 latency plus
    /// this away. Default 5 minutes.
    pub fallback_secs: u64,
}

impl Default for FlexConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            discount: 0.5,
            min_deadline_secs: 900,
            fallback_secs: 300,
        }
    }
}

impl FlexConfig {
    /// Whether `kind` has a flex tier tollgate sends to: the OpenAI family's
    /// `service_tier`.
    pub fn supported(kind: ProviderKind) -> bool {
        matches!(
            kind,
            ProviderKind::Openai | ProviderKind::OpenaiCompatible | ProviderKind::Azure
        )
    }

    /// Whether the flex tier serves `endpoint`: chat and Responses.
    pub fn serves(endpoint: Endpoint) -> bool {
        matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Responses)
    }

    pub(super) fn validate(&self, kind: ProviderKind) -> Result<(), String> {
        if self.enabled && !Self::supported(kind) {
            return Err(
                "only `openai`, `openai-compatible` and `azure` providers have a flex tier tollgate sends to"
                    .into(),
            );
        }
        if !(self.discount > 0.0 && self.discount <= 1.0) {
            return Err("`discount` must be in (0, 1]".into());
        }
        Ok(())
    }
}
