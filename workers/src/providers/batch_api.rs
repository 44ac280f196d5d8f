//! The providers' own batch APIs, behind [`BatchApi`]: a batch carries the jobs of one
//! endpoint; each line goes in as the adapter's online body of its request (translated
//! per provider, as online) and its result comes back as the online answer is read,
//! keyed by `custom_id`. An adapter says what to send and how to read the
//! answers (OpenAI Files + Batch in `openai.rs`, Anthropic Message Batches in
//! `anthropic.rs`); [`BatchClient`] does the HTTP, the same for every provider.

use std::collections::HashMap;

use serde_json::Value;

use super::{ProviderClient, ProviderKey, Providers, Success};
use tollgate::vocab::{Endpoint, ReasonCode};

/// What tollgate needs to drive one provider's batch API. Methods are pure: they build
/// URLs and bodies and read answers; [`BatchClient`] sends.
pub trait BatchApi: Send + Sync {
    /// The file to upload before the batch is created, where the API takes its lines as a
    /// file (OpenAI); `None` where the lines go inline (Anthropic).
    fn upload(
        &self,
        model: &str,
        endpoint: Endpoint,
        lines: &[(String, &Value)],
        tag: &str,
    ) -> Option<Upload>;

    /// The request that creates the batch (URL, JSON body); `file_id` is the uploaded
    /// file's id, if there was an upload. `tag` goes into the batch's metadata where the
    /// API has one.
    fn create(
        &self,
        model: &str,
        endpoint: Endpoint,
        lines: &[(String, &Value)],
        tag: &str,
        file_id: Option<&str>,
    ) -> (String, Value);

    fn status_url(&self, batch_id: &str) -> String;

    /// The provider's batch object, read.
    fn parse_status(&self, batch: &Value) -> Status;

    fn cancel_url(&self, batch_id: &str) -> String;

    /// Where the results of an ended batch are read from, each a JSONL body.
    fn result_urls(&self, batch_id: &str, status: &Status) -> Vec<String>;

    /// Reads the lines of one results body of a batch of `endpoint` into `out`, by
    /// `custom_id`.
    fn parse_results(
        &self,
        endpoint: Endpoint,
        lines: &mut dyn Iterator<Item = Value>,
        out: &mut HashMap<String, LineResult>,
    );

    /// Where the key's newest batches are listed, where a batch can be found by its tag
    /// (its metadata); `None` where the API keeps no metadata (Anthropic).
    fn list_url(&self) -> Option<String> {
        None
    }

    /// The id of the batch of a listing ([`BatchApi::list_url`]) tagged `tag`.
    fn tagged(&self, _listing: &Value, _tag: &str) -> Option<String> {
        None
    }
}

/// A file to upload: a ready multipart body.
#[derive(Debug)]
pub struct Upload {
    pub url: String,
    pub content_type: String,
    pub body: Vec<u8>,
}

/// A batch the provider accepted.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub batch_id: String,
    pub input_file_id: Option<String>,
    /// The key it was submitted with (polls must use it: batches are scoped to a project).
    pub key_name: String,
}

/// A provider batch as last seen.
#[derive(Debug, Clone)]
pub struct Status {
    /// The provider's own status word.
    pub status: String,
    /// No more lines will be processed: results can be read.
    pub ended: bool,
    /// The provider's ids of the files holding results (OpenAI's output and error files).
    pub(super) result_files: Vec<String>,
    /// Lines the provider has finished, of all the batch's lines, where it counts them.
    pub progress: Option<(u64, u64)>,
}

/// What became of one line.
#[derive(Debug, Clone)]
pub enum LineResult {
    Succeeded {
        success: Success,
        request_id: Option<String>,
    },
    /// Failed, expired or cancelled at the provider: `code` says which.
    Failed { code: ReasonCode, message: String },
}

/// One provider's batch API, with the key to use.
pub struct BatchClient<'a> {
    http: &'a reqwest::Client,
    client: &'a ProviderClient,
    api: &'a dyn BatchApi,
    key: &'a ProviderKey,
}

impl Providers {
    /// `provider`'s batch API with each of its keys (a batch is visible only to the keys
    /// of its project).
    pub fn batch_clients(&self, provider: &str) -> Vec<BatchClient<'_>> {
        let Some((client, api)) = self.get(provider).and_then(|c| Some((c, c.api.batch()?))) else {
            return Vec::new();
        };
        client
            .keys
            .iter()
            .map(|key| BatchClient {
                http: &self.http,
                client,
                api,
                key,
            })
            .collect()
    }

    /// `provider`'s batch API with key `key` (else the next key serving `model`); `None`
    /// when the provider is not configured or has no batch API tollgate drives.
    pub fn batch_client(&self, provider: &str, model: &str, key: Option<&str>) -> Option<BatchClient<'_>> {
        let client = self.get(provider)?;
        let api = client.api.batch()?;
        let key = match key.and_then(|k| client.keys.iter().find(|c| c.name == k)) {
            Some(k) => k,
            None => {
                let target = tollgate::routing::Target {
                    provider: provider.to_owned(),
                    kind: client.kind,
                    model: model.to_owned(),
                    key: None,
                };
                client.pick_file_key(&target, &client.keyring())
            }
        };
        Some(BatchClient {
            http: &self.http,
            client,
            api,
            key,
        })
    }
}

/// A request's error message, without the key (reqwest's errors carry no headers).
fn http_error(e: reqwest::Error) -> String {
    format!("{}", e.without_url())
}

async fn body_of(resp: reqwest::Response) -> Result<Vec<u8>, String> {
    let status = resp.status();
    let bytes = resp.bytes().await.map_err(http_error)?;
    if !status.is_success() {
        let text = String::from_utf8_lossy(&bytes);
        return Err(format!(
            "HTTP {}: {}",
            status.as_u16(),
            text.chars().take(500).collect::<String>()
        ));
    }
    Ok(bytes.to_vec())
}

impl BatchClient<'_> {
    fn get(&self, url: String) -> reqwest::RequestBuilder {
        self.client.api.authorize(self.http.get(url), &self.key.secret)
    }

    fn post(&self, url: String) -> reqwest::RequestBuilder {
        self.client.api.authorize(self.http.post(url), &self.key.secret)
    }

    /// Submits `lines` (custom_id, the client's request) of `endpoint` for `model`; `tag`
    /// goes into the batch's metadata where the API has one.
    pub async fn submit(
        &self,
        model: &str,
        endpoint: Endpoint,
        lines: &[(String, &Value)],
        tag: &str,
    ) -> Result<Submitted, String> {
        let input_file_id = match self.api.upload(model, endpoint, lines, tag) {
            Some(upload) => {
                let resp = self
                    .post(upload.url)
                    .header("content-type", upload.content_type)
                    .body(upload.body)
                    .send()
                    .await
                    .map_err(http_error)?;
                Some(id_of(&body_of(resp).await?, "file")?)
            }
            None => None,
        };
        let (url, body) = self
            .api
            .create(model, endpoint, lines, tag, input_file_id.as_deref());
        let resp = self.post(url).json(&body).send().await.map_err(http_error)?;
        Ok(Submitted {
            batch_id: id_of(&body_of(resp).await?, "batch")?,
            input_file_id,
            key_name: self.key.name.clone(),
        })
    }

    pub async fn status(&self, batch_id: &str) -> Result<Status, String> {
        let resp = self
            .get(self.api.status_url(batch_id))
            .send()
            .await
            .map_err(http_error)?;
        let b: Value = serde_json::from_slice(&body_of(resp).await?).map_err(|e| e.to_string())?;
        Ok(self.api.parse_status(&b))
    }

    /// The name of the key this client uses.
    pub fn key_name(&self) -> &str {
        &self.key.name
    }

    /// Whether a batch of this API can be found by its tag ([`BatchClient::find_tagged`]).
    pub fn finds_tagged(&self) -> bool {
        self.api.list_url().is_some()
    }

    /// The batch of this key's project tagged `tag`, among the newest the provider lists:
    /// a submission whose answer was never recorded (its submitter died, or the write
    /// failed) is found this way instead of being sent again.
    pub async fn find_tagged(&self, tag: &str) -> Result<Option<Submitted>, String> {
        let Some(url) = self.api.list_url() else {
            return Ok(None);
        };
        let resp = self.get(url).send().await.map_err(http_error)?;
        let listing: Value = serde_json::from_slice(&body_of(resp).await?).map_err(|e| e.to_string())?;
        Ok(self.api.tagged(&listing, tag).map(|batch_id| Submitted {
            batch_id,
            input_file_id: None,
            key_name: self.key.name.clone(),
        }))
    }

    /// Best effort: asks the provider to stop a batch tollgate no longer tracks.
    pub async fn cancel(&self, batch_id: &str) -> Result<(), String> {
        body_of(
            self.post(self.api.cancel_url(batch_id))
                .send()
                .await
                .map_err(http_error)?,
        )
        .await
        .map(|_| ())
    }

    /// The results of an ended batch of `endpoint`, by `custom_id`. Lines missing from
    /// them were not processed (a failed batch has none).
    pub async fn results(
        &self,
        batch_id: &str,
        endpoint: Endpoint,
        status: &Status,
    ) -> Result<HashMap<String, LineResult>, String> {
        let mut out = HashMap::new();
        for url in self.api.result_urls(batch_id, status) {
            let bytes = body_of(self.get(url).send().await.map_err(http_error)?).await?;
            self.api.parse_results(endpoint, &mut jsonl(&bytes), &mut out);
        }
        Ok(out)
    }
}

/// The `id` of the object a provider answered with.
fn id_of(body: &[u8], what: &str) -> Result<String, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    v.get("id")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| format!("no {what} id in the answer"))
}

/// A line that did not succeed.
pub(super) fn failed(code: ReasonCode, message: String) -> LineResult {
    LineResult::Failed { code, message }
}

/// The JSON lines of a JSONL body; blank and unreadable lines skipped.
pub(crate) fn jsonl(bytes: &[u8]) -> impl Iterator<Item = Value> + '_ {
    bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
        .filter_map(|l| serde_json::from_slice(l).ok())
}

/// The code and message of a line that failed; panics on any other.
#[cfg(test)]
pub(crate) fn failure_of(results: &HashMap<String, LineResult>, id: &str) -> (String, String) {
    match &results[id] {
        LineResult::Failed { code, message } => (code.to_string(), message.clone()),
        other => panic!("{id}: {other:?}"),
    }
}
