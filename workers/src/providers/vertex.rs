//! Google Vertex AI: Gemini models and Anthropic's Claude models of one Google Cloud
//! project and location, under
//! `{base_url}/v1/projects/{project}/locations/{location}/publishers/{publisher}/models/{model}:{method}`.
//!
//! - A Gemini model (`publishers/google`) takes Gemini's own request and answer
//!   (`generateContent`, `streamGenerateContent?alt=sse`), translated as by [`super::gemini`].
//! - A Claude model (named `claude-…`, `publishers/anthropic`) takes Anthropic's Messages
//!   body without `model` and with `anthropic_version: "vertex-2023-10-16"`
//!   (`rawPredict`, `streamRawPredict`), translated as by [`super::anthropic`].
//!
//! Calls carry `Authorization: Bearer` with an OAuth2 access token. A key is a service
//! account's JSON key; its token is had by the JWT-bearer grant (RFC 7523) at the key's
//! `token_uri`: a JWT of the account, scope `cloud-platform`, signed RS256 with its
//! private key (`jsonwebtoken`), exchanged for a token kept until five minutes before it
//! expires (read without a lock held across calls), one exchange at a time. A key the token endpoint refuses is the
//! call's `upstream_auth_failed` (the key is set aside like any rejected key). Vertex
//! sends no rate-limit headers; its 429s are Google's `RESOURCE_EXHAUSTED` bodies.

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::RequestBuilder;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tollgate::config::ProviderConfig;
use tollgate::retry::{Failure, FailureClass};
use tollgate::vocab::{Endpoint, ReasonCode};

use super::anthropic::Anthropic;
use super::streaming::StreamEvents;
use super::{Mode, ProviderApi, Success, Unexpressed, anthropic, gemini};

/// The `anthropic_version` Vertex AI takes in the body.
const ANTHROPIC_VERSION: &str = "vertex-2023-10-16";
/// The OAuth2 scope of the tokens asked for.
const SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
/// A token is renewed this long before it expires.
const RENEW_BEFORE: Duration = Duration::from_secs(300);

/// A Vertex AI provider.
pub struct Vertex {
    base_url: String,
    project: String,
    location: String,
    /// Claude's translation (its base URL unused).
    anthropic: Anthropic,
    /// Access tokens by service account key (its JSON), read by every call without
    /// waiting on another.
    tokens: RwLock<HashMap<String, Token>>,
    /// Held through an exchange, so concurrent calls needing a token wait for one
    /// exchange rather than each making their own.
    exchanging: tokio::sync::Mutex<()>,
}

struct Token {
    access: SecretString,
    renew_at: Instant,
}

/// Who publishes a model on Vertex AI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Publisher {
    Google,
    Anthropic,
}

impl Publisher {
    fn of(model: &str) -> Self {
        if model.starts_with("claude") {
            Self::Anthropic
        } else {
            Self::Google
        }
    }
}

impl Vertex {
    pub fn from_config(p: &ProviderConfig) -> Self {
        Self {
            base_url: super::base_url(p),
            project: p.project.clone().unwrap_or_default(),
            location: p.location.clone().unwrap_or_default(),
            anthropic: Anthropic::from_config(p),
            tokens: RwLock::default(),
            exchanging: tokio::sync::Mutex::default(),
        }
    }

    /// The cached access token of `key`, while it is not about to expire.
    fn cached(&self, key: &SecretString) -> Option<SecretString> {
        let tokens = self.tokens.read().unwrap_or_else(PoisonError::into_inner);
        tokens
            .get(key.expose_secret())
            .filter(|t| t.renew_at > Instant::now())
            .map(|t| t.access.clone())
    }

    /// A valid access token of the service account `key`, exchanged for when there is none
    /// or it is about to expire.
    async fn token(&self, http: &reqwest::Client, key: &SecretString) -> Result<SecretString, Failure> {
        if let Some(access) = self.cached(key) {
            return Ok(access);
        }
        let _one_at_a_time = self.exchanging.lock().await;
        // Another call may have exchanged while this one waited.
        if let Some(access) = self.cached(key) {
            return Ok(access);
        }
        let account: ServiceAccount = serde_json::from_str(key.expose_secret())
            .map_err(|_| refused("the key is not a service account's JSON key"))?;
        let token = exchange(http, &account).await?;
        let access = token.access.clone();
        self.tokens
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.expose_secret().to_owned(), token);
        Ok(access)
    }
}

/// The fields of a service account's JSON key an exchange needs.
#[derive(Deserialize)]
struct ServiceAccount {
    client_email: String,
    #[serde(default)]
    private_key_id: String,
    private_key: SecretString,
    token_uri: String,
}

#[derive(Serialize)]
struct Claims<'a> {
    iss: &'a str,
    scope: &'a str,
    aud: &'a str,
    iat: i64,
    exp: i64,
}

#[derive(Deserialize)]
struct TokenAnswer {
    access_token: SecretString,
    #[serde(default = "default_expiry")]
    expires_in: u64,
}

fn default_expiry() -> u64 {
    3600
}

/// A failure of the key itself (no token can be had with it).
fn refused(reason: impl Into<String>) -> Failure {
    Failure {
        class: FailureClass::KeyUnusable,
        code: ReasonCode::UpstreamAuthFailed,
        message: reason.into(),
        status: None,
        retry_after: None,
    }
}

/// The JWT-bearer grant: a signed assertion of `account` exchanged at its token URI.
async fn exchange(http: &reqwest::Client, account: &ServiceAccount) -> Result<Token, Failure> {
    let now = chrono::Utc::now().timestamp();
    let claims = Claims {
        iss: &account.client_email,
        scope: SCOPE,
        aud: &account.token_uri,
        iat: now,
        exp: now + 3600,
    };
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(account.private_key_id.clone()).filter(|k| !k.is_empty());
    let signing_key = EncodingKey::from_rsa_pem(account.private_key.expose_secret().as_bytes())
        .map_err(|_| refused("the service account's private_key is not an RSA key in PEM"))?;
    let assertion = jsonwebtoken::encode(&header, &claims, &signing_key)
        .map_err(|e| refused(format!("the token request could not be signed: {e}")))?;
    let form = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("grant_type", "urn:ietf:params:oauth:grant-type:jwt-bearer")
        .append_pair("assertion", &assertion)
        .finish();
    let started = Instant::now();
    let response = http
        .post(&account.token_uri)
        .header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(form)
        .send()
        .await
        .map_err(super::send_failure)?;
    let status = response.status().as_u16();
    let body = response.bytes().await.map_err(super::send_failure)?;
    if !(200..300).contains(&status) {
        let answer: Option<Value> = serde_json::from_slice(&body).ok();
        let error = answer.as_ref().and_then(|a| {
            let field = |k: &str| a.get(k).and_then(Value::as_str);
            Some(format!(
                "{}: {}",
                field("error")?,
                field("error_description").unwrap_or_default()
            ))
        });
        let message = format!(
            "the token endpoint refused the service account {}: {}",
            account.client_email,
            error.unwrap_or_else(|| format!("HTTP {status}"))
        );
        let mut failure = match status {
            400 | 401 | 403 => refused(message),
            _ => Failure {
                class: FailureClass::Overload,
                code: ReasonCode::ProviderError,
                message,
                status: None,
                retry_after: None,
            },
        };
        failure.status = Some(status);
        return Err(failure);
    }
    let answer: TokenAnswer = serde_json::from_slice(&body).map_err(|e| {
        Failure::bad_response(
            format!("the token endpoint answered without a token: {e}"),
            status,
        )
    })?;
    let lifetime = Duration::from_secs(answer.expires_in).saturating_sub(RENEW_BEFORE);
    Ok(Token {
        access: answer.access_token,
        renew_at: started + lifetime,
    })
}

impl ProviderApi for Vertex {
    fn url(&self, model: &str, _endpoint: Endpoint, mode: Mode) -> String {
        let (publisher, method) = match (Publisher::of(model), mode) {
            (Publisher::Google, mode) => ("google", gemini::action(mode)),
            (Publisher::Anthropic, Mode::Whole) => ("anthropic", "rawPredict"),
            (Publisher::Anthropic, Mode::Stream) => ("anthropic", "streamRawPredict"),
        };
        format!(
            "{}/v1/projects/{}/locations/{}/publishers/{publisher}/models/{model}:{method}",
            self.base_url, self.project, self.location
        )
    }

    /// `key` is the access token [`Vertex::credential`] had for the configured key.
    fn authorize(&self, request: RequestBuilder, key: &SecretString) -> RequestBuilder {
        request.bearer_auth(key.expose_secret())
    }

    fn credential<'a>(
        &'a self,
        http: &'a reqwest::Client,
        key: &'a SecretString,
    ) -> BoxFuture<'a, Result<SecretString, Failure>> {
        Box::pin(self.token(http, key))
    }

    fn body(&self, model: &str, endpoint: Endpoint, request: &Value, mode: Mode) -> Value {
        match Publisher::of(model) {
            Publisher::Google => gemini::translate_request(request),
            Publisher::Anthropic => {
                let mut body = self.anthropic.body(model, endpoint, request, mode);
                if let Some(obj) = body.as_object_mut() {
                    obj.remove("model");
                    obj.insert("anthropic_version".to_owned(), Value::from(ANTHROPIC_VERSION));
                }
                body
            }
        }
    }

    fn parse_success(&self, body: &[u8], endpoint: Endpoint, model: &str) -> Result<Success, String> {
        match Publisher::of(model) {
            Publisher::Google => gemini::parse_success(body, model),
            Publisher::Anthropic => self.anthropic.parse_success(body, endpoint, model),
        }
    }

    fn stream_events(&self, endpoint: Endpoint, model: &str) -> Option<Box<dyn StreamEvents>> {
        match Publisher::of(model) {
            Publisher::Google => Some(Box::new(gemini::Events::default())),
            Publisher::Anthropic => self.anthropic.stream_events(endpoint, model),
        }
    }

    fn unexpressed(&self, model: &str, request: &Value) -> Option<Unexpressed> {
        match Publisher::of(model) {
            Publisher::Google => gemini::unexpressed(request),
            Publisher::Anthropic => anthropic::unexpressed(request),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn adapter() -> Vertex {
        let config = tollgate::config::Config::parse(
            r#"
            [[providers]]
            name = "vx"
            kind = "vertex"
            project = "acme-prod"
            location = "europe-west4"
            keys = [{ name = "k", value = '{"client_email":"a@b","private_key":"x","token_uri":"https://oauth2.googleapis.com/token"}' }]
            models = ["gemini-2.0-flash", "claude-sonnet-4@20250514"]
            [[tenants]]
            name = "t"
            api_key = "tk-test"
            "#,
            "vertex test",
        )
        .unwrap();
        Vertex::from_config(&config.providers[0])
    }

    #[test]
    fn addresses_each_publisher_in_its_own_shape() {
        let v = adapter();
        assert_eq!(
            v.url("gemini-2.0-flash", Endpoint::ChatCompletions, Mode::Stream),
            "https://europe-west4-aiplatform.googleapis.com/v1/projects/acme-prod/locations/europe-west4/publishers/google/models/gemini-2.0-flash:streamGenerateContent?alt=sse"
        );
        assert_eq!(
            v.url("claude-sonnet-4@20250514", Endpoint::ChatCompletions, Mode::Whole),
            "https://europe-west4-aiplatform.googleapis.com/v1/projects/acme-prod/locations/europe-west4/publishers/anthropic/models/claude-sonnet-4@20250514:rawPredict"
        );
        let r = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9});
        let claude = v.body(
            "claude-sonnet-4@20250514",
            Endpoint::ChatCompletions,
            &r,
            Mode::Stream,
        );
        assert_eq!(claude["anthropic_version"], ANTHROPIC_VERSION);
        assert_eq!((claude.get("model"), &claude["stream"]), (None, &json!(true)));
        assert_eq!(claude["max_tokens"], 9);
        let gemini = v.body("gemini-2.0-flash", Endpoint::ChatCompletions, &r, Mode::Whole);
        assert_eq!(gemini["generationConfig"]["maxOutputTokens"], 9);
        // What each publisher cannot express is its own: a seed goes to Gemini, not Claude.
        let seeded = json!({"messages": [], "seed": 1});
        assert!(v.unexpressed("gemini-2.0-flash", &seeded).is_none());
        assert_eq!(
            v.unexpressed("claude-sonnet-4@20250514", &seeded)
                .map(|u| u.param),
            Some("seed".to_owned())
        );
    }

    #[tokio::test]
    async fn a_key_that_is_no_service_account_is_refused_before_any_call() {
        let v = adapter();
        let failure = v
            .credential(&reqwest::Client::new(), &SecretString::from("sk-not-json"))
            .await
            .err()
            .unwrap();
        assert_eq!(failure.class, FailureClass::KeyUnusable);
        let bad_pem = SecretString::from(
            r#"{"client_email":"a@b","private_key":"not a key","token_uri":"http://127.0.0.1:1/token"}"#,
        );
        let failure = v
            .credential(&reqwest::Client::new(), &bad_pem)
            .await
            .err()
            .unwrap();
        assert_eq!(failure.code, ReasonCode::UpstreamAuthFailed);
        assert!(!failure.message.contains("not a key"), "the key is never quoted");
    }
}
