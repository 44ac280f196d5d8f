//! Azure OpenAI: `POST {base_url}/openai/deployments/{deployment}/{chat/completions,embeddings}
//! ?api-version={azure_api_version}` with an `api-key` header. The target's model names
//! the deployment. Bodies, responses and stream chunks are OpenAI's, so only the URL and
//! the auth header live here; the rest is [`super::openai`]'s. Its Batch API (Global
//! Batch: a global-batch deployment, lines naming it as their `model`) is OpenAI's Files
//! and Batch below `{base_url}/openai` with the `api-version` ([`openai::FilesBatch`]);
//! its batches carry no tag to be found by. Azure's rate-limit
//! signals (`x-ratelimit-remaining-*`, `retry-after-ms`, string-code 429s) are read by
//! the `azure` dialect.

use reqwest::RequestBuilder;
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;
use tollgate::config::{ProviderConfig, ProviderKind};
use tollgate::vocab::Endpoint;

use super::batch_api::BatchApi;
use super::streaming::StreamEvents;
use super::{Mode, ProviderApi, Success, openai};

/// An Azure OpenAI resource.
pub struct Azure {
    base_url: String,
    /// The `api-version` query parameter.
    api_version: String,
    /// Its Files and Batch APIs.
    files_batch: openai::FilesBatch,
}

impl Azure {
    pub fn from_config(p: &ProviderConfig) -> Self {
        Self::new(super::base_url(p), p.azure_api_version.clone())
    }

    fn new(base_url: String, api_version: String) -> Self {
        let query: String = url::form_urlencoded::byte_serialize(api_version.as_bytes()).collect();
        Self {
            files_batch: openai::FilesBatch {
                root: format!("{base_url}/openai"),
                query: format!("?api-version={query}"),
                line_url,
                tags: false,
                cap_field: openai::cap_field(ProviderKind::Azure),
            },
            base_url,
            api_version,
        }
    }
}

/// The endpoint a batch line names on Azure: its path without `/v1`.
fn line_url(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::ChatCompletions => "/chat/completions",
        Endpoint::Embeddings => "/embeddings",
        Endpoint::Responses => "/responses",
        Endpoint::Completions => "/completions",
        Endpoint::Moderations => "/moderations",
        Endpoint::Messages => "/messages",
    }
}

impl ProviderApi for Azure {
    fn url(&self, deployment: &str, endpoint: Endpoint, _mode: Mode) -> String {
        let mut url = format!(
            "{}/openai/deployments/{deployment}/{}",
            self.base_url,
            openai::path(endpoint)
        );
        url.push_str("?api-version=");
        url.extend(url::form_urlencoded::byte_serialize(self.api_version.as_bytes()));
        url
    }

    fn authorize(&self, request: RequestBuilder, key: &SecretString) -> RequestBuilder {
        request.header("api-key", key.expose_secret())
    }

    fn body(&self, deployment: &str, endpoint: Endpoint, request: &Value, mode: Mode) -> Value {
        openai::body(
            deployment,
            endpoint,
            request,
            mode,
            openai::cap_field(ProviderKind::Azure),
        )
    }

    fn parse_success(&self, body: &[u8], endpoint: Endpoint, _model: &str) -> Result<Success, String> {
        openai::parse_success(body, endpoint)
    }

    fn stream_events(&self, _endpoint: Endpoint, _model: &str) -> Option<Box<dyn StreamEvents>> {
        Some(Box::new(openai::Chunks))
    }

    fn batch(&self) -> Option<&dyn BatchApi> {
        Some(&self.files_batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tollgate::vocab::ReasonCode;

    fn adapter() -> Azure {
        Azure::new("https://res.openai.azure.com".to_owned(), "2024-10-21".to_owned())
    }

    #[test]
    fn url_header_and_body() {
        let http = reqwest::Client::new();
        let key = SecretString::from("az-key");
        let request =
            json!({"model": "fast", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
        for mode in [Mode::Whole, Mode::Stream] {
            let req = adapter()
                .request(
                    &http,
                    &key,
                    "gpt-4o-deploy",
                    Endpoint::ChatCompletions,
                    &request,
                    mode,
                )
                .build()
                .unwrap();
            assert_eq!(
                req.url().as_str(),
                "https://res.openai.azure.com/openai/deployments/gpt-4o-deploy/chat/completions?api-version=2024-10-21"
            );
            assert_eq!(req.headers()["api-key"], "az-key");
            assert!(req.headers().get("authorization").is_none());
            let body: Value = serde_json::from_slice(req.body().unwrap().as_bytes().unwrap()).unwrap();
            assert_eq!(body["model"], "gpt-4o-deploy");
            match mode {
                Mode::Whole => assert!(body.get("stream").is_none()),
                Mode::Stream => assert_eq!(body["stream_options"]["include_usage"], true),
            }
        }
    }

    #[test]
    fn reads_openai_answers() {
        let ok = br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#;
        let s = adapter()
            .parse_success(ok, Endpoint::ChatCompletions, "gpt-4o-deploy")
            .unwrap();
        assert_eq!((s.usage.input_tokens, s.usage.output_tokens), (4, 1));
        let headers = reqwest::header::HeaderMap::new();
        let limited = br#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 have exceeded token rate limit of your current OpenAI S0 pricing tier. Please retry after 6 seconds."}}"#;
        let f = adapter().classify_error(429, &headers, limited);
        assert_eq!(f.code, ReasonCode::RateLimited);
    }

    /// Global Batch: OpenAI's Files and Batch below `/openai`, the `api-version` on every
    /// URL, lines naming the endpoint without `/v1` and the deployment as their model.
    #[test]
    fn global_batch_requests() {
        let a = adapter();
        let batch = a.batch().unwrap();
        let r = json!({"messages": [{"role": "user", "content": "hi"}]});
        let lines = [("job-1".to_owned(), &r)];
        let up = batch
            .upload("gpt-4o-global-batch", Endpoint::ChatCompletions, &lines, "pack-1")
            .unwrap();
        assert_eq!(
            up.url,
            "https://res.openai.azure.com/openai/files?api-version=2024-10-21"
        );
        let text = String::from_utf8(up.body).unwrap();
        let line: Value = serde_json::from_str(text.lines().find(|l| l.starts_with('{')).unwrap()).unwrap();
        assert_eq!(
            (line["url"].as_str(), line["body"]["model"].as_str()),
            (Some("/chat/completions"), Some("gpt-4o-global-batch"))
        );
        let (url, body) = batch.create(
            "gpt-4o-global-batch",
            Endpoint::ChatCompletions,
            &lines,
            "pack-1",
            Some("file-1"),
        );
        assert_eq!(
            url,
            "https://res.openai.azure.com/openai/batches?api-version=2024-10-21"
        );
        assert_eq!(
            body,
            json!({"input_file_id": "file-1", "endpoint": "/chat/completions", "completion_window": "24h"})
        );
        assert_eq!(
            batch.status_url("b1"),
            "https://res.openai.azure.com/openai/batches/b1?api-version=2024-10-21"
        );
        assert_eq!(
            batch.cancel_url("b1"),
            "https://res.openai.azure.com/openai/batches/b1/cancel?api-version=2024-10-21"
        );
        assert!(
            batch.list_url().is_none(),
            "Azure's batches carry no tag to be found by"
        );
    }
}
