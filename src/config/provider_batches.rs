//! `[providers.batch_api]`: whether and how a provider's own batch API (OpenAI Batch,
//! Anthropic Message Batches, Gemini Batch Mode, Azure's Global Batch, an
//! OpenAI-compatible server's copy of OpenAI's) may carry `batch`-class jobs.

use serde::Deserialize;

use super::ProviderKind;
use crate::vocab::Endpoint;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BatchApiConfig {
    /// Send eligible `batch`-class jobs through the provider's batch API (for an
    /// `openai-compatible` server: it has a copy of OpenAI's). Default false.
    pub enabled: bool,
    /// Fraction of the online price a batch line costs (0.5: half price).
    pub discount: f64,
    /// The provider's completion window: a job is eligible only if its deadline is at
    /// least this far away (else the provider could legally answer after it). Default 24 h.
    pub min_deadline_secs: u64,
    /// Most lines in one provider batch. Default by kind: OpenAI 50,000, Anthropic and
    /// Azure 100,000.
    pub max_lines: Option<u64>,
    /// Largest provider batch in bytes. Default by kind: OpenAI 200 MB, Anthropic 256 MB.
    pub max_bytes: Option<u64>,
    /// Most embedding inputs across the lines of one OpenAI batch of embeddings. Default
    /// 50,000, OpenAI's limit.
    pub max_embedding_inputs: Option<u64>,
    /// Gemini: the largest batch sent inline in its create request (Google takes up to
    /// 20 MB so); a larger one goes as an uploaded JSONL file. Default 19,000,000 bytes.
    pub inline_max_bytes: u64,
    /// The provider's enqueued-token pool per model (prompt tokens of unfinished batches):
    /// becomes the gauge bucket `provider:<p>:<m>:batch_queue_tokens`. None = unlimited.
    pub enqueued_tokens: Option<u64>,
    /// How often an open provider batch is polled, in milliseconds. Default 60 s.
    pub poll_interval_ms: u64,
    /// How long admitted lines are gathered before a partial pack is submitted, in
    /// milliseconds (a full pack goes at once). Default 60 s.
    pub pack_wait_ms: u64,
    /// The time the lines of a provider batch running late need online: a batch still
    /// running this long before its earliest line's deadline — or whose progress so far
    /// says it will still be running then — is pulled back (cancelled at the provider;
    /// its finished lines kept, the rest sent online). Default 1 h.
    pub pull_back_secs: u64,
}

impl Default for BatchApiConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            discount: 0.5,
            min_deadline_secs: 24 * 3600,
            max_lines: None,
            max_bytes: None,
            max_embedding_inputs: None,
            inline_max_bytes: 19_000_000,
            enqueued_tokens: None,
            poll_interval_ms: 60_000,
            pack_wait_ms: 60_000,
            pull_back_secs: 3600,
        }
    }
}

impl BatchApiConfig {
    /// Whether `kind` has a batch API tollgate can drive.
    pub fn supported(kind: ProviderKind) -> bool {
        Endpoint::all().iter().any(|e| Self::carries(kind, *e))
    }

    /// Whether `kind`'s batch API takes jobs of `endpoint`: OpenAI's Batch API its five
    /// endpoints as they are; Azure's Global Batch chat and embeddings; Anthropic's Message
    /// Batches Messages requests, and chat translated as online; Gemini's Batch Mode chat
    /// translated as online. A request translated per call (Messages to a non-Anthropic
    /// target, Responses to a non-OpenAI one) goes online.
    pub fn carries(kind: ProviderKind, endpoint: Endpoint) -> bool {
        match kind {
            ProviderKind::Openai => endpoint != Endpoint::Messages,
            ProviderKind::Anthropic => matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Messages),
            // Servers that copy OpenAI's Batch API (Groq, Together, xAI, vLLM) take chat,
            // and some embeddings and completions; which server has one is the
            // provider's `enabled` to say, never assumed.
            ProviderKind::OpenaiCompatible => matches!(
                endpoint,
                Endpoint::ChatCompletions | Endpoint::Embeddings | Endpoint::Completions
            ),
            // Global Batch, on a global-batch deployment.
            ProviderKind::Azure => matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Embeddings),
            ProviderKind::Gemini => endpoint == Endpoint::ChatCompletions,
            // Bedrock's batch inference reads S3 and Vertex's batch prediction GCS or
            // BigQuery: object stores tollgate does not drive.
            ProviderKind::Bedrock | ProviderKind::Vertex => false,
        }
    }

    pub(super) fn validate(&self, kind: ProviderKind) -> Result<(), String> {
        if self.enabled && !Self::supported(kind) {
            return Err(
                "only `openai`, `openai-compatible`, `azure`, `anthropic` and `gemini` providers have a batch API tollgate drives (Bedrock's and Vertex AI's read object stores)".into(),
            );
        }
        if !(self.discount > 0.0 && self.discount <= 1.0) {
            return Err("`discount` must be in (0, 1]".into());
        }
        if self.max_lines == Some(0)
            || self.max_bytes == Some(0)
            || self.max_embedding_inputs == Some(0)
            || self.poll_interval_ms == 0
        {
            return Err(
                "`max_lines`, `max_bytes`, `max_embedding_inputs` and `poll_interval_ms` must be at least 1"
                    .into(),
            );
        }
        Ok(())
    }

    /// Most embedding inputs across the lines of one provider batch of `endpoint` to `kind`
    /// (OpenAI's batches of embeddings: configured, else 50,000); `None` where only lines
    /// and bytes count.
    pub fn max_inputs(&self, kind: ProviderKind, endpoint: Endpoint) -> Option<u64> {
        (kind == ProviderKind::Openai && endpoint == Endpoint::Embeddings)
            .then(|| self.max_embedding_inputs.unwrap_or(50_000))
    }

    /// Lines and bytes per provider batch: configured, else the provider's own limits.
    pub fn limits(&self, kind: ProviderKind) -> (u64, u64) {
        let (lines, bytes) = match kind {
            ProviderKind::Anthropic => (100_000, 256 * 1024 * 1024),
            ProviderKind::Azure => (100_000, 200 * 1024 * 1024),
            _ => (50_000, 200 * 1024 * 1024),
        };
        (self.max_lines.unwrap_or(lines), self.max_bytes.unwrap_or(bytes))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, ProviderKind};

    #[test]
    fn the_example_block_parses_and_defaults_follow_the_kind() {
        let base = include_str!("../../tollgate.example.toml");
        // The example's commented block, switched on (it follows the `oai` provider).
        let mut inside = false;
        let on: String = base
            .lines()
            .map(|l| {
                inside = l == "# [providers.batch_api]" || (inside && l.starts_with("# "));
                if inside { &l[2..] } else { l }
            })
            .collect::<Vec<_>>()
            .join("\n");
        let c = Config::parse(&on, "t.toml").unwrap();
        let oai = c.provider("oai").unwrap();
        assert!(oai.batch_api.enabled);
        assert_eq!(oai.batch_api.enqueued_tokens, Some(2_000_000));
        assert_eq!(oai.batch_api.limits(oai.kind), (50_000, 209_715_200));
        let ant = c.provider("ant").unwrap();
        assert!(!ant.batch_api.enabled);
        assert_eq!(
            ant.batch_api.limits(ProviderKind::Anthropic),
            (100_000, 256 * 1024 * 1024)
        );

        let bad = on.replace("discount = 0.5", "discount = 1.5");
        let e = Config::parse(&bad, "t.toml").unwrap_err().to_string();
        assert!(e.contains("providers[0].batch_api"), "{e}");
    }
}
