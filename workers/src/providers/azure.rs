//! Azure OpenAI: `POST {base_url}/openai/deployments/{deployment}/chat/completions
//! ?api-version={azure_api_version}` with an `api-key` header. The target's model names
//! the deployment. Bodies, responses and stream chunks are OpenAI's, so only the URL and
//! the auth header live here; the rest is [`super::openai`]'s.

use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;

/// The request to Azure, without a body: shared by plain and streaming calls.
pub(super) fn post(
    http: &reqwest::Client,
    base_url: &str,
    key: &SecretString,
    api_version: &str,
    deployment: &str,
) -> reqwest::RequestBuilder {
    http.post(format!(
        "{base_url}/openai/deployments/{deployment}/chat/completions"
    ))
    .query(&[("api-version", api_version)])
    .header("api-key", key.expose_secret())
}

pub(super) fn build(
    http: &reqwest::Client,
    base_url: &str,
    key: &SecretString,
    api_version: &str,
    deployment: &str,
    request: &Value,
) -> reqwest::RequestBuilder {
    post(http, base_url, key, api_version, deployment).json(&super::openai::body(deployment, request))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn url_header_and_body() {
        let http = reqwest::Client::new();
        let key = SecretString::from("az-key");
        let req = build(
            &http,
            "https://res.openai.azure.com",
            &key,
            "2024-10-21",
            "gpt-4o-deploy",
            &json!({"model": "fast", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
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
        assert!(body.get("stream").is_none());
    }
}
