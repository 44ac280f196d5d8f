//! Gemini Batch Mode: `POST {base_url}/v1beta/models/{model}:batchGenerateContent`, each
//! line the online `GenerateContentRequest` of its chat request (translated as online).
//! A batch up to `inline_max_bytes` goes inline (`inputConfig.requests`, each request's
//! `metadata.key` its custom_id; the answers come back in the batch object, in order, with
//! their metadata); a larger one is uploaded first through the Files API's resumable
//! upload as JSONL lines `{"key", "request"}` (`inputConfig.fileName`), and its answers come
//! back as a file of `{"key", "response" | "error"}` lines. The batch is a long-running
//! operation named `batches/{id}`: its state and statistics are in `metadata`.

use std::collections::HashMap;

use serde_json::{Value, json};
use tollgate::config::ProviderConfig;
use tollgate::vocab::{Endpoint, ReasonCode};

use super::batch_api::{BatchApi, LineResult, Status, Upload, UploadProtocol, failed, jsonl};
use super::gemini::{parse_success, translate_request};

/// Gemini Batch Mode for one provider.
pub(super) struct GeminiBatch {
    base_url: String,
    inline_max_bytes: u64,
}

impl GeminiBatch {
    pub(super) fn from_config(p: &ProviderConfig) -> Self {
        Self {
            base_url: super::base_url(p),
            inline_max_bytes: p.batch_api.inline_max_bytes,
        }
    }

    /// The lines as JSONL `{"key", "request"}`, when they are too large to go inline.
    fn file_lines(&self, lines: &[(String, &Value)]) -> Option<Vec<u8>> {
        let mut jsonl = Vec::new();
        for (id, r) in lines {
            let line = json!({"key": id, "request": translate_request(r)});
            jsonl.extend_from_slice(line.to_string().as_bytes());
            jsonl.push(b'\n');
        }
        (jsonl.len() as u64 > self.inline_max_bytes).then_some(jsonl)
    }
}

/// Gemini's batch states; the last four are final.
const ENDED: [&str; 4] = [
    "BATCH_STATE_SUCCEEDED",
    "BATCH_STATE_FAILED",
    "BATCH_STATE_CANCELLED",
    "BATCH_STATE_EXPIRED",
];

impl BatchApi for GeminiBatch {
    fn upload(
        &self,
        _model: &str,
        _endpoint: Endpoint,
        lines: &[(String, &Value)],
        tag: &str,
    ) -> Option<Upload> {
        let body = self.file_lines(lines)?;
        Some(Upload {
            url: format!("{}/upload/v1beta/files", self.base_url),
            protocol: UploadProtocol::GoogleResumable {
                content_type: "application/jsonl".to_owned(),
                metadata: json!({"file": {"displayName": tag}}),
            },
            body,
        })
    }

    /// The uploaded file's resource name, `files/{id}`.
    fn uploaded_id(&self, answer: &Value) -> Option<String> {
        answer.pointer("/file/name")?.as_str().map(str::to_owned)
    }

    fn create(
        &self,
        model: &str,
        _endpoint: Endpoint,
        lines: &[(String, &Value)],
        tag: &str,
        file_id: Option<&str>,
    ) -> (String, Value) {
        let input = match file_id {
            Some(file) => json!({"fileName": file}),
            None => {
                let requests: Vec<Value> = lines
                    .iter()
                    .map(|(id, r)| json!({"request": translate_request(r), "metadata": {"key": id}}))
                    .collect();
                json!({"requests": {"requests": requests}})
            }
        };
        (
            format!("{}/v1beta/models/{model}:batchGenerateContent", self.base_url),
            json!({"batch": {"displayName": tag, "inputConfig": input}}),
        )
    }

    /// The operation's resource name, `batches/{id}`.
    fn created_id(&self, answer: &Value) -> Option<String> {
        answer.get("name")?.as_str().map(str::to_owned)
    }

    fn status_url(&self, batch_id: &str) -> String {
        format!("{}/v1beta/{batch_id}", self.base_url)
    }

    fn parse_status(&self, operation: &Value) -> Status {
        let meta = &operation["metadata"];
        let status = meta["state"].as_str().unwrap_or_default().to_owned();
        // int64 fields are JSON strings in Google's APIs.
        let count = |k: &str| {
            let v = &meta["batchStats"][k];
            v.as_u64().or_else(|| v.as_str()?.parse().ok())
        };
        let finished =
            count("successfulRequestCount").unwrap_or(0) + count("failedRequestCount").unwrap_or(0);
        let output = output_of(operation);
        Status {
            ended: ENDED.contains(&status.as_str()),
            status,
            result_files: output
                .and_then(|o| o.get("responsesFile")?.as_str())
                .map(str::to_owned)
                .into_iter()
                .collect(),
            progress: count("requestCount").map(|total| (finished, total)),
        }
    }

    fn cancel_url(&self, batch_id: &str) -> String {
        format!("{}/v1beta/{batch_id}:cancel", self.base_url)
    }

    fn list_url(&self) -> Option<String> {
        Some(format!("{}/v1beta/batches?pageSize=100", self.base_url))
    }

    fn tagged(&self, listing: &Value, tag: &str) -> Option<String> {
        listing["operations"]
            .as_array()?
            .iter()
            .find(|op| op["metadata"]["displayName"] == tag)
            .and_then(|op| op["name"].as_str())
            .map(str::to_owned)
    }

    /// The responses file where the batch has one; else the batch object itself, which
    /// holds the answers of an inline batch.
    fn result_urls(&self, batch_id: &str, status: &Status) -> Vec<String> {
        match status.result_files.as_slice() {
            [] => vec![self.status_url(batch_id)],
            files => files
                .iter()
                .map(|f| format!("{}/download/v1beta/{f}:download?alt=media", self.base_url))
                .collect(),
        }
    }

    fn parse_results(&self, _endpoint: Endpoint, body: &[u8], out: &mut HashMap<String, LineResult>) {
        // One JSON document is the batch object (inline answers); else the JSONL file.
        if let Ok(operation) = serde_json::from_slice::<Value>(body)
            && let Some(answers) = output_of(&operation)
                .and_then(|o| o.pointer("/inlinedResponses/inlinedResponses"))
                .and_then(Value::as_array)
        {
            for answer in answers {
                if let Some(key) = answer.pointer("/metadata/key").and_then(Value::as_str) {
                    out.insert(key.to_owned(), line_result(answer));
                }
            }
            return;
        }
        for line in jsonl(body) {
            if let Some(key) = line.get("key").and_then(Value::as_str) {
                out.insert(key.to_owned(), line_result(&line));
            }
        }
    }
}

/// The batch's output: in `metadata.output` (as the SDK reads it), else in the finished
/// operation's `response`.
fn output_of(operation: &Value) -> Option<&Value> {
    operation
        .pointer("/metadata/output")
        .or_else(|| operation.get("response"))
        .filter(|o| o.is_object())
}

/// One answer, inline or a line of the responses file: a `GenerateContentResponse` read
/// as the online answer, or a `google.rpc.Status` error.
fn line_result(answer: &Value) -> LineResult {
    if let Some(response) = answer.get("response").filter(|r| r.is_object()) {
        return match parse_success(response.to_string().as_bytes(), "") {
            Ok(success) => LineResult::Succeeded {
                success,
                request_id: response
                    .get("responseId")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
            },
            Err(message) => failed(ReasonCode::ProviderBadResponse, message),
        };
    }
    let error = answer.get("error").or_else(|| answer.get("status"));
    let message = error
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .unwrap_or("the request failed in the batch");
    let code = error
        .and_then(|e| e.get("code"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    failed(
        ReasonCode::ProviderBatchErrored,
        format!("HTTP {code}: {message}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::batch_api::{failure_of, jsonl_of};

    fn api(inline_max_bytes: u64) -> GeminiBatch {
        GeminiBatch {
            base_url: "https://generativelanguage.googleapis.com".to_owned(),
            inline_max_bytes,
        }
    }

    fn chat(text: &str) -> Value {
        json!({"model": "gemini-2.5-flash", "messages": [{"role": "user", "content": text}], "max_tokens": 8})
    }

    #[test]
    fn a_small_batch_goes_inline_a_large_one_as_a_file() {
        let (a, b) = (chat("one"), chat("two"));
        let lines = [("j1".to_owned(), &a), ("j2".to_owned(), &b)];
        let small = api(1 << 20);
        assert!(
            small
                .upload("gemini-2.5-flash", Endpoint::ChatCompletions, &lines, "pack-1")
                .is_none()
        );
        let (url, body) = small.create(
            "gemini-2.5-flash",
            Endpoint::ChatCompletions,
            &lines,
            "pack-1",
            None,
        );
        assert_eq!(
            url,
            "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash:batchGenerateContent"
        );
        assert_eq!(body["batch"]["displayName"], "pack-1");
        let requests = &body["batch"]["inputConfig"]["requests"]["requests"];
        assert_eq!(requests[1]["metadata"]["key"], "j2");
        assert_eq!(requests[1]["request"]["contents"][0]["parts"][0]["text"], "two");
        assert_eq!(requests[1]["request"]["generationConfig"]["maxOutputTokens"], 8);

        let large = api(10);
        let upload = large
            .upload("gemini-2.5-flash", Endpoint::ChatCompletions, &lines, "pack-1")
            .unwrap();
        assert_eq!(
            upload.url,
            "https://generativelanguage.googleapis.com/upload/v1beta/files"
        );
        assert!(matches!(upload.protocol, UploadProtocol::GoogleResumable { .. }));
        let first: Value = jsonl(&upload.body).next().unwrap();
        assert_eq!(first["key"], "j1");
        assert_eq!(first["request"]["contents"][0]["parts"][0]["text"], "one");
        assert_eq!(
            large
                .uploaded_id(&json!({"file": {"name": "files/abc"}}))
                .as_deref(),
            Some("files/abc")
        );
        let (_, body) = large.create(
            "gemini-2.5-flash",
            Endpoint::ChatCompletions,
            &lines,
            "pack-1",
            Some("files/abc"),
        );
        assert_eq!(body["batch"]["inputConfig"], json!({"fileName": "files/abc"}));
    }

    #[test]
    fn reads_the_operation_its_state_progress_and_where_results_are() {
        let a = api(1 << 20);
        assert_eq!(
            a.created_id(&json!({"name": "batches/b1"})).as_deref(),
            Some("batches/b1")
        );
        assert_eq!(
            a.status_url("batches/b1"),
            "https://generativelanguage.googleapis.com/v1beta/batches/b1"
        );
        assert_eq!(
            a.cancel_url("batches/b1"),
            "https://generativelanguage.googleapis.com/v1beta/batches/b1:cancel"
        );
        let running = a.parse_status(&json!({"name": "batches/b1", "metadata": {"state": "BATCH_STATE_RUNNING",
            "batchStats": {"requestCount": "10", "successfulRequestCount": "3", "failedRequestCount": "1", "pendingRequestCount": "6"}}}));
        assert!(!running.ended);
        assert_eq!(running.progress, Some((4, 10)));
        let inline = a.parse_status(
            &json!({"name": "batches/b1", "metadata": {"state": "BATCH_STATE_SUCCEEDED",
            "output": {"inlinedResponses": {"inlinedResponses": []}}}}),
        );
        assert!(inline.ended);
        assert_eq!(a.result_urls("batches/b1", &inline), [a.status_url("batches/b1")]);
        let file = a.parse_status(
            &json!({"name": "batches/b1", "done": true, "metadata": {"state": "BATCH_STATE_SUCCEEDED"},
            "response": {"responsesFile": "files/out"}}),
        );
        assert_eq!(
            a.result_urls("batches/b1", &file),
            ["https://generativelanguage.googleapis.com/download/v1beta/files/out:download?alt=media"]
        );
        for state in ENDED {
            assert!(
                a.parse_status(&json!({"metadata": {"state": state}})).ended,
                "{state}"
            );
        }
        let listing = json!({"operations": [{"name": "batches/x", "metadata": {"displayName": "other"}},
                                            {"name": "batches/y", "metadata": {"displayName": "pack-7"}}]});
        assert_eq!(a.tagged(&listing, "pack-7").as_deref(), Some("batches/y"));
        assert_eq!(a.tagged(&listing, "pack-8"), None);
    }

    #[test]
    fn reads_answers_inline_and_from_the_responses_file() {
        let a = api(1 << 20);
        let response = json!({"candidates": [{"content": {"parts": [{"text": "hi"}], "role": "model"}, "finishReason": "STOP"}],
            "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 1, "totalTokenCount": 5},
            "modelVersion": "gemini-2.5-flash", "responseId": "r1"});
        let error = json!({"code": 400, "message": "Invalid argument", "status": "INVALID_ARGUMENT"});
        let operation = json!({"name": "batches/b1", "metadata": {"state": "BATCH_STATE_SUCCEEDED", "output": {
            "inlinedResponses": {"inlinedResponses": [
                {"response": response, "metadata": {"key": "ok"}},
                {"error": error, "metadata": {"key": "bad"}}]}}}});
        let pretty = serde_json::to_vec_pretty(&operation).unwrap();
        let mut out = HashMap::new();
        a.parse_results(Endpoint::ChatCompletions, &pretty, &mut out);
        assert_eq!(out.len(), 2);
        let Some(LineResult::Succeeded { success, request_id }) = out.get("ok") else {
            panic!("{out:?}");
        };
        assert_eq!(success.body["choices"][0]["message"]["content"], "hi");
        assert_eq!(success.body["model"], "gemini-2.5-flash");
        assert_eq!((success.usage.input_tokens, success.usage.output_tokens), (4, 1));
        assert_eq!(request_id.as_deref(), Some("r1"));
        assert_eq!(
            failure_of(&out, "bad"),
            (
                "provider_batch_errored".to_owned(),
                "HTTP 400: Invalid argument".to_owned()
            )
        );

        let file = jsonl_of(&[
            json!({"key": "ok", "response": response}),
            json!({"key": "bad", "error": error}),
            json!({"no_key": true}),
        ]);
        let mut out = HashMap::new();
        a.parse_results(Endpoint::ChatCompletions, &file, &mut out);
        assert_eq!(out.len(), 2);
        assert!(matches!(out["ok"], LineResult::Succeeded { .. }));
        assert_eq!(failure_of(&out, "bad").0, "provider_batch_errored");
    }
}
