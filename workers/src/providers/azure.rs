//! Azure OpenAI: `POST {base_url}/openai/deployments/{deployment}/{chat/completions,embeddings}
//! ?api-version={azure_api_version}` with an `api-key` header. The target's model names
//! the deployment. Bodies, responses and stream chunks are OpenAI's, so only the URL and
//! the auth header live here; the rest is [`super::openai`]'s. Azure's rate-limit
//! signals (`x-ratelimit-remaining-*`, `retry-after-ms`, string-code 429s) are read by
//! the `azure` dialect.

use reqwest::RequestBuilder;
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;
use tollgate::config::{ProviderConfig, ProviderKind};
use tollgate::vocab::Endpoint;

use super::streaming::StreamEvents;
use super::{Mode, ProviderApi, Success, openai};

/// An Azure OpenAI resource.
pub struct Azure {
    base_url: String,
    /// The `api-version` query parameter.
    api_version: String,
}

impl Azure {
    pub fn from_config(p: &ProviderConfig) -> Self {
        Self {
            base_url: super::base_url(p),
            api_version: p.azure_api_version.clone(),
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tollgate::vocab::ReasonCode;

    fn adapter() -> Azure {
        Azure {
            base_url: "https://res.openai.azure.com".to_owned(),
            api_version: "2024-10-21".to_owned(),
        }
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
        assert!(adapter().batch().is_none());
    }
}
