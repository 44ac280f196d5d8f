//! The providers' own batch APIs, behind [`BatchApi`]: a batch carries the jobs of one
//! endpoint; each line goes in as the adapter's online body of its request (translated
//! per provider, as online) and its result comes back as the online answer is read,
//! keyed by `custom_id`. An adapter says what to send and how to read the
//! answers (OpenAI Files + Batch in `openai.rs`, Anthropic Message Batches in
//! `anthropic.rs`, Gemini Batch Mode in `gemini_batch.rs`); [`BatchClient`] does the
//! HTTP, the same for every provider.

use std::collections::HashMap;

use serde_json::Value;

use super::{ProviderClient, ProviderKey, Providers, Success};
use tollgate::vocab::{Endpoint, ReasonCode};

/// What tollgate needs to drive one provider's batch API. Methods are pure: they build
/// URLs and bodies and read answers; [`BatchClient`] sends.
pub trait BatchApi: Send + Sync {
    /// The file to upload before the batch is created, where the API takes its lines as a
    /// file (OpenAI; Gemini's larger batches); `None` where the lines go inline.
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

    /// The id of the file an upload's answer names: OpenAI's `id`.
    fn uploaded_id(&self, answer: &Value) -> Option<String> {
        answer.get("id")?.as_str().map(str::to_owned)
    }

    /// The id of the batch a create's answer names: OpenAI's and Anthropic's `id`.
    fn created_id(&self, answer: &Value) -> Option<String> {
        answer.get("id")?.as_str().map(str::to_owned)
    }

    /// The provider's batch object, read.
    fn parse_status(&self, batch: &Value) -> Status;

    fn cancel_url(&self, batch_id: &str) -> String;

    /// Where the results of an ended batch are read from, each a JSONL body.
    fn result_urls(&self, batch_id: &str, status: &Status) -> Vec<String>;

    /// Reads one results body of a batch of `endpoint` (JSONL, or the batch object where
    /// the results come inline) into `out`, by `custom_id`.
    fn parse_results(&self, endpoint: Endpoint, body: &[u8], out: &mut HashMap<String, LineResult>);

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

/// A file to upload.
#[derive(Debug)]
pub struct Upload {
    pub url: String,
    pub protocol: UploadProtocol,
    pub body: Vec<u8>,
}

/// How a file is uploaded.
#[derive(Debug)]
pub enum UploadProtocol {
    /// One `POST` of a ready body of `content_type` (OpenAI's multipart form).
    Form { content_type: String },
    /// Google's resumable upload in one chunk: a `start` request carrying the file's
    /// `metadata` answers with the session's URL (`x-goog-upload-url`), to which the
    /// bytes go with `upload, finalize`.
    GoogleResumable { content_type: String, metadata: Value },
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
                let answer = json_of(&self.send_file(upload).await?)?;
                let id = self.api.uploaded_id(&answer);
                Some(id.ok_or("no file id in the upload's answer")?)
            }
            None => None,
        };
        let (url, body) = self
            .api
            .create(model, endpoint, lines, tag, input_file_id.as_deref());
        let resp = self.post(url).json(&body).send().await.map_err(http_error)?;
        let answer = json_of(&body_of(resp).await?)?;
        Ok(Submitted {
            batch_id: self
                .api
                .created_id(&answer)
                .ok_or("no batch id in the create's answer")?,
            input_file_id,
            key_name: self.key.name.clone(),
        })
    }

    /// Uploads a file; the provider's answer.
    async fn send_file(&self, upload: Upload) -> Result<Vec<u8>, String> {
        let request = match upload.protocol {
            UploadProtocol::Form { content_type } => {
                self.post(upload.url).header("content-type", content_type)
            }
            UploadProtocol::GoogleResumable {
                content_type,
                metadata,
            } => {
                let start = self
                    .post(upload.url)
                    .header("x-goog-upload-protocol", "resumable")
                    .header("x-goog-upload-command", "start")
                    .header("x-goog-upload-header-content-length", upload.body.len())
                    .header("x-goog-upload-header-content-type", content_type)
                    .json(&metadata)
                    .send()
                    .await
                    .map_err(http_error)?;
                let session = start
                    .headers()
                    .get("x-goog-upload-url")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                body_of(start).await?;
                let session = session.ok_or("the upload's start was answered without x-goog-upload-url")?;
                self.post(session)
                    .header("x-goog-upload-offset", "0")
                    .header("x-goog-upload-command", "upload, finalize")
            }
        };
        body_of(request.body(upload.body).send().await.map_err(http_error)?).await
    }

    pub async fn status(&self, batch_id: &str) -> Result<Status, String> {
        let resp = self
            .get(self.api.status_url(batch_id))
            .send()
            .await
            .map_err(http_error)?;
        Ok(self.api.parse_status(&json_of(&body_of(resp).await?)?))
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
        let listing = json_of(&body_of(resp).await?)?;
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
            self.api.parse_results(endpoint, &bytes, &mut out);
        }
        Ok(out)
    }
}

/// A provider's JSON answer.
fn json_of(body: &[u8]) -> Result<Value, String> {
    serde_json::from_slice(body).map_err(|e| format!("the provider's answer is not JSON: {e}"))
}

/// A line that did not succeed.
pub(super) fn failed(code: ReasonCode, message: String) -> LineResult {
    LineResult::Failed { code, message }
}

/// Each line of a JSONL results body read by `read`, under its `custom_id`.
pub(super) fn by_custom_id(
    body: &[u8],
    out: &mut HashMap<String, LineResult>,
    read: impl Fn(&Value) -> LineResult,
) {
    for line in jsonl(body) {
        if let Some(id) = line.get("custom_id").and_then(Value::as_str) {
            out.insert(id.to_owned(), read(&line));
        }
    }
}

/// The JSON lines of a JSONL body; blank and unreadable lines skipped.
pub(crate) fn jsonl(bytes: &[u8]) -> impl Iterator<Item = Value> + '_ {
    bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
        .filter_map(|l| serde_json::from_slice(l).ok())
}

/// `lines` as a JSONL body.
#[cfg(test)]
pub(crate) fn jsonl_of(lines: &[Value]) -> Vec<u8> {
    lines.iter().flat_map(|l| format!("{l}\n").into_bytes()).collect()
}

/// The code and message of a line that failed; panics on any other.
#[cfg(test)]
pub(crate) fn failure_of(results: &HashMap<String, LineResult>, id: &str) -> (String, String) {
    match &results[id] {
        LineResult::Failed { code, message } => (code.to_string(), message.clone()),
        other => panic!("{id}: {other:?}"),
    }
}
