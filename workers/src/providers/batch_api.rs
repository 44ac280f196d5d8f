//! Providers' own batch APIs: OpenAI Files + Batch (`{base_url}/files`,
//! `{base_url}/batches`) and Anthropic Message Batches (`{base_url}/v1/messages/batches`).
//! Lines go in as OpenAI chat requests (translated per provider, as online) and results
//! come back in OpenAI chat format, keyed by `custom_id`.

use std::collections::HashMap;

use secrecy::ExposeSecret;
use serde_json::{Value, json};
use tollgate::config::ProviderKind;

use super::{ProviderClient, ProviderKey, Providers, Success, anthropic, openai};

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
    output_file_id: Option<String>,
    error_file_id: Option<String>,
}

/// What became of one line.
#[derive(Debug, Clone)]
pub enum LineResult {
    Succeeded {
        success: Success,
        request_id: Option<String>,
    },
    /// Failed, expired or cancelled at the provider: `code` says which.
    Failed { code: String, message: String },
}

/// One provider's batch API, with the key to use.
pub struct BatchClient<'a> {
    http: &'a reqwest::Client,
    client: &'a ProviderClient,
    key: &'a ProviderKey,
}

impl Providers {
    /// `provider`'s batch API with key `key` (else the next key serving `model`).
    pub fn batch_client(&self, provider: &str, model: &str, key: Option<&str>) -> Option<BatchClient<'_>> {
        let client = self.get(provider)?;
        let key = match key.and_then(|k| client.keys.iter().find(|c| c.name == k)) {
            Some(k) => k,
            None => client.pick_key(&tollgate::routing::Target {
                provider: provider.to_owned(),
                kind: client.kind,
                model: model.to_owned(),
                key: None,
            }),
        };
        Some(BatchClient {
            http: &self.http,
            client,
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
    fn base(&self) -> &str {
        &self.client.base_url
    }

    fn get(&self, url: String) -> reqwest::RequestBuilder {
        self.auth(self.http.get(url))
    }

    fn post(&self, url: String) -> reqwest::RequestBuilder {
        self.auth(self.http.post(url))
    }

    fn auth(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let secret = self.key.secret.expose_secret();
        match self.client.kind {
            ProviderKind::Anthropic => rb
                .header("x-api-key", secret)
                .header("anthropic-version", &self.client.anthropic_version),
            _ => rb.bearer_auth(secret),
        }
    }

    /// Submits `lines` (custom_id, OpenAI chat request) for `model`; `tag` goes into
    /// the batch's metadata where the API has one.
    pub async fn submit(
        &self,
        model: &str,
        lines: &[(String, &Value)],
        tag: &str,
    ) -> Result<Submitted, String> {
        let (url, body, input_file_id) = match self.client.kind {
            ProviderKind::Anthropic => {
                let requests: Vec<Value> = lines
                    .iter()
                    .map(|(id, r)| json!({"custom_id": id, "params": anthropic::translate_request(model, r)}))
                    .collect();
                let url = format!("{}/v1/messages/batches", self.base());
                (url, json!({"requests": requests}), None)
            }
            _ => {
                let mut jsonl = Vec::new();
                for (id, r) in lines {
                    let line = json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions",
                                      "body": openai::body(model, r)});
                    jsonl.extend_from_slice(line.to_string().as_bytes());
                    jsonl.push(b'\n');
                }
                let file = self.upload(jsonl, tag).await?;
                let body = json!({"input_file_id": file, "endpoint": "/v1/chat/completions",
                                  "completion_window": "24h", "metadata": {"tollgate_pack": tag}});
                (format!("{}/batches", self.base()), body, Some(file))
            }
        };
        let resp = self.post(url).json(&body).send().await.map_err(http_error)?;
        Ok(Submitted {
            batch_id: id_of(&body_of(resp).await?, "batch")?,
            input_file_id,
            key_name: self.key.name.clone(),
        })
    }

    /// `POST /files` as multipart (`purpose=batch`), built by hand: one file part.
    async fn upload(&self, jsonl: Vec<u8>, tag: &str) -> Result<String, String> {
        let boundary = format!("tollgate-{}", uuid::Uuid::now_v7().simple());
        let mut body = Vec::with_capacity(jsonl.len() + 512);
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{tag}.jsonl\"\r\n\
                 Content-Type: application/jsonl\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(&jsonl);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let resp = self
            .post(format!("{}/files", self.base()))
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(body)
            .send()
            .await
            .map_err(http_error)?;
        id_of(&body_of(resp).await?, "file")
    }

    pub async fn status(&self, batch_id: &str) -> Result<Status, String> {
        let url = match self.client.kind {
            ProviderKind::Anthropic => format!("{}/v1/messages/batches/{batch_id}", self.base()),
            _ => format!("{}/batches/{batch_id}", self.base()),
        };
        let resp = self.get(url).send().await.map_err(http_error)?;
        let b: Value = serde_json::from_slice(&body_of(resp).await?).map_err(|e| e.to_string())?;
        let s = |k: &str| b.get(k).and_then(Value::as_str).map(str::to_owned);
        Ok(match self.client.kind {
            ProviderKind::Anthropic => {
                let status = s("processing_status").unwrap_or_default();
                Status {
                    ended: status == "ended",
                    status,
                    output_file_id: None,
                    error_file_id: None,
                }
            }
            _ => {
                let status = s("status").unwrap_or_default();
                Status {
                    ended: matches!(status.as_str(), "completed" | "failed" | "expired" | "cancelled"),
                    status,
                    output_file_id: s("output_file_id"),
                    error_file_id: s("error_file_id"),
                }
            }
        })
    }

    /// Best effort: asks the provider to stop a batch tollgate no longer tracks.
    pub async fn cancel(&self, batch_id: &str) -> Result<(), String> {
        let url = match self.client.kind {
            ProviderKind::Anthropic => format!("{}/v1/messages/batches/{batch_id}/cancel", self.base()),
            _ => format!("{}/batches/{batch_id}/cancel", self.base()),
        };
        body_of(self.post(url).send().await.map_err(http_error)?)
            .await
            .map(|_| ())
    }

    /// The results of an ended batch, by `custom_id`. Lines missing from them were not
    /// processed (a failed batch has none).
    pub async fn results(
        &self,
        batch_id: &str,
        status: &Status,
    ) -> Result<HashMap<String, LineResult>, String> {
        let mut out = HashMap::new();
        if self.client.kind == ProviderKind::Anthropic {
            let url = format!("{}/v1/messages/batches/{batch_id}/results", self.base());
            let bytes = body_of(self.get(url).send().await.map_err(http_error)?).await?;
            for line in jsonl(&bytes) {
                let Some(id) = line.get("custom_id").and_then(Value::as_str) else {
                    continue;
                };
                let result = &line["result"];
                let kind = result.get("type").and_then(Value::as_str).unwrap_or("errored");
                let r = match (kind, result.get("message")) {
                    ("succeeded", Some(m)) => match anthropic::parse_success(m.to_string().as_bytes()) {
                        Ok(success) => LineResult::Succeeded {
                            success,
                            request_id: None,
                        },
                        Err(message) => failed("provider_bad_response", message),
                    },
                    ("errored", _) => {
                        let e = &result["error"]["error"];
                        let message = e.get("message").and_then(Value::as_str).unwrap_or("errored");
                        failed("provider_batch_errored", message.to_owned())
                    }
                    (other, _) => failed(
                        &format!("provider_batch_{other}"),
                        format!("the line was {other}"),
                    ),
                };
                out.insert(id.to_owned(), r);
            }
            return Ok(out);
        }
        for file in [&status.output_file_id, &status.error_file_id]
            .into_iter()
            .flatten()
        {
            let url = format!("{}/files/{file}/content", self.base());
            let bytes = body_of(self.get(url).send().await.map_err(http_error)?).await?;
            for line in jsonl(&bytes) {
                let Some(id) = line.get("custom_id").and_then(Value::as_str) else {
                    continue;
                };
                let response = line.get("response").filter(|r| !r.is_null());
                let code = response
                    .and_then(|r| r.get("status_code"))
                    .and_then(Value::as_u64);
                let r = match (response, code) {
                    (Some(resp), Some(200)) => {
                        match openai::parse_success(resp["body"].to_string().as_bytes()) {
                            Ok(success) => LineResult::Succeeded {
                                success,
                                request_id: resp.get("request_id").and_then(Value::as_str).map(str::to_owned),
                            },
                            Err(message) => failed("provider_bad_response", message),
                        }
                    }
                    (Some(resp), code) => {
                        let message = resp["body"]["error"]["message"]
                            .as_str()
                            .unwrap_or("request failed");
                        failed(
                            "provider_batch_errored",
                            format!("HTTP {}: {message}", code.unwrap_or(0)),
                        )
                    }
                    (None, _) => {
                        let e = &line["error"];
                        let code = e.get("code").and_then(Value::as_str).unwrap_or("errored");
                        let message = e.get("message").and_then(Value::as_str).unwrap_or_default();
                        let code = if code == "batch_expired" {
                            "provider_batch_expired".to_owned()
                        } else {
                            format!("provider_{code}")
                        };
                        failed(&code, message.to_owned())
                    }
                };
                out.insert(id.to_owned(), r);
            }
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

fn failed(code: &str, message: String) -> LineResult {
    LineResult::Failed {
        code: code.to_owned(),
        message,
    }
}

fn jsonl(bytes: &[u8]) -> impl Iterator<Item = Value> + '_ {
    bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
        .filter_map(|l| serde_json::from_slice(l).ok())
}
