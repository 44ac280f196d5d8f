//! The batch APIs over real HTTP with a pinned clock: lines are processed at
//! `lines_per_sec` of mock time, failures and expiries land where the config says.

use super::*;

const BATCH_OPENAI: &str = r#"
[batch]
lines_per_sec = 10.0
fail_every_nth = 2
[[projects]]
name = "oai"
kind = "openai"
keys = ["sk-1"]
[[projects]]
name = "oai-other"
kind = "openai"
keys = ["sk-other"]
"#;

const BATCH_ANTHROPIC: &str = r#"
[batch]
lines_per_sec = 10.0
expire_every_nth = 3
[[projects]]
name = "ant"
kind = "anthropic"
keys = ["ak-1"]
"#;

fn jsonl(text: &str) -> Vec<Value> {
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

impl Harness {
    async fn upload(&self, key: &str, content: &str) -> reqwest::Response {
        let b = "mock-test-boundary";
        let body = format!(
            "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\n\
             Content-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n{content}\r\n--{b}--\r\n"
        );
        self.client
            .post(format!("{}/v1/files", self.base))
            .bearer_auth(key)
            .header("content-type", format!("multipart/form-data; boundary={b}"))
            .body(body)
            .send()
            .await
            .unwrap()
    }

    async fn openai_get(&self, key: &str, path: &str) -> reqwest::Response {
        self.client
            .get(format!("{}{path}", self.base))
            .bearer_auth(key)
            .send()
            .await
            .unwrap()
    }

    /// The OpenAI batch `id` as project `oai` sees it.
    async fn batch_json(&self, id: &str) -> Value {
        let r = self.openai_get("sk-1", &format!("/v1/batches/{id}")).await;
        r.json().await.unwrap()
    }

    async fn anthropic_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> reqwest::Response {
        let mut rb = self
            .client
            .request(method, format!("{}{path}", self.base))
            .header("x-api-key", "ak-1")
            .header("anthropic-version", "2023-06-01");
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        rb.send().await.unwrap()
    }
}

fn openai_lines(n: usize) -> String {
    (0..n)
        .map(|i| {
            json!({"custom_id": format!("c{i}"), "method": "POST", "url": "/v1/chat/completions",
                   "body": chat(Some(5))})
            .to_string()
                + "\n"
        })
        .collect()
}

#[tokio::test]
async fn openai_batch_runs_at_its_speed_with_output_and_error_files() {
    let h = start(BATCH_OPENAI).await;
    let r = h.upload("sk-1", &openai_lines(4)).await;
    assert_eq!(r.status(), 200);
    let file: Value = r.json().await.unwrap();
    assert_eq!(
        (file["object"].as_str(), file["purpose"].as_str()),
        (Some("file"), Some("batch"))
    );
    let fid = file["id"].as_str().unwrap();
    assert!(fid.starts_with("file-"));

    let create =
        json!({"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    let r = h
        .client
        .post(format!("{}/v1/batches", h.base))
        .bearer_auth("sk-1")
        .json(&create)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let id = b["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("batch_"));
    assert_eq!(b["status"], "in_progress");
    assert_eq!(b["request_counts"]["total"], 4);

    // Another project's key sees neither the batch nor the file; no key is a 401.
    assert_eq!(
        h.openai_get("sk-other", &format!("/v1/batches/{id}"))
            .await
            .status(),
        404
    );
    assert_eq!(
        h.openai_get("sk-other", &format!("/v1/files/{fid}/content"))
            .await
            .status(),
        404
    );
    assert_eq!(
        h.openai_get("sk-nope", &format!("/v1/batches/{id}"))
            .await
            .status(),
        401
    );

    // 10 lines per second: 4 lines take 0.4 s of mock time.
    h.advance(Duration::from_millis(200));
    let b: Value = h.batch_json(&id).await;
    assert_eq!(
        (b["status"].as_str(), b["request_counts"]["completed"].as_u64()),
        (Some("in_progress"), Some(2))
    );
    h.advance(Duration::from_millis(300));
    let b: Value = h.batch_json(&id).await;
    assert_eq!(b["status"], "completed", "{b}");
    assert_eq!(
        b["request_counts"],
        json!({"total": 4, "completed": 2, "failed": 2})
    );

    // Every 2nd line failed: c1 and c3 in the error file; c0 and c2 answered like the
    // online endpoint, with usage.
    let out = h
        .openai_get(
            "sk-1",
            &format!("/v1/files/{}/content", b["output_file_id"].as_str().unwrap()),
        )
        .await;
    let out = jsonl(&out.text().await.unwrap());
    let err = h
        .openai_get(
            "sk-1",
            &format!("/v1/files/{}/content", b["error_file_id"].as_str().unwrap()),
        )
        .await;
    let err = jsonl(&err.text().await.unwrap());
    let ids = |v: &[Value]| {
        v.iter()
            .map(|l| l["custom_id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        (ids(&out), ids(&err)),
        (
            vec!["c0".to_owned(), "c2".to_owned()],
            vec!["c1".to_owned(), "c3".to_owned()]
        )
    );
    for l in &out {
        assert_eq!(l["response"]["status_code"], 200);
        assert_eq!(l["response"]["body"]["object"], "chat.completion");
        assert_eq!(l["response"]["body"]["usage"]["prompt_tokens"], 10);
        assert_eq!(l["response"]["body"]["usage"]["completion_tokens"], 5);
    }
    assert!(err.iter().all(|l| l["response"]["status_code"] == 500));
}

impl Harness {
    /// Creates an OpenAI batch of `endpoint` from `lines` as project `oai`.
    async fn openai_batch(&self, endpoint: &str, lines: &[Value]) -> reqwest::Response {
        let content: String = lines.iter().map(|l| l.to_string() + "\n").collect();
        let file: Value = self.upload("sk-1", &content).await.json().await.unwrap();
        let create = json!({"input_file_id": file["id"], "endpoint": endpoint, "completion_window": "24h"});
        self.client
            .post(format!("{}/v1/batches", self.base))
            .bearer_auth("sk-1")
            .json(&create)
            .send()
            .await
            .unwrap()
    }

    /// The lines of the OpenAI file `id` as project `oai` sees it.
    async fn openai_file(&self, id: &Value) -> Vec<Value> {
        let r = self
            .openai_get("sk-1", &format!("/v1/files/{}/content", id.as_str().unwrap()))
            .await;
        jsonl(&r.text().await.unwrap())
    }
}

#[tokio::test]
async fn openai_batches_answer_each_endpoint_as_online_and_refuse_what_it_refuses() {
    let h = start(
        r#"
[batch]
lines_per_sec = 0.0
[[projects]]
name = "oai"
kind = "openai"
keys = ["sk-1"]
"#,
    )
    .await;
    let line = |id: &str, url: &str, body: Value| json!({"custom_id": id, "method": "POST", "url": url, "body": body});
    let cases = [
        (
            "/v1/embeddings",
            json!({"model": "text-embedding-3-small", "input": ["abcd", "abcdefgh"]}),
            json!({"model": "text-embedding-3-small", "input": []}),
        ),
        (
            "/v1/responses",
            json!({"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 16}),
            json!({"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 4}),
        ),
        (
            "/v1/completions",
            json!({"model": "gpt-3.5-turbo-instruct", "prompt": "abcd", "max_tokens": 5}),
            json!({"model": "gpt-3.5-turbo-instruct"}),
        ),
        (
            "/v1/moderations",
            json!({"model": "omni-moderation-latest", "input": ["a", "b"]}),
            json!({"model": "omni-moderation-latest", "input": ""}),
        ),
    ];
    for (endpoint, good, bad) in cases {
        let r = h
            .openai_batch(
                endpoint,
                &[line("ok", endpoint, good.clone()), line("bad", endpoint, bad)],
            )
            .await;
        assert_eq!(r.status(), 200, "{endpoint}");
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["status"], "completed", "{endpoint}: {b}");
        let out = h.openai_file(&b["output_file_id"]).await;
        assert_eq!(out.len(), 1, "{endpoint}: {out:?}");
        let answer = &out[0]["response"]["body"];
        match endpoint {
            "/v1/embeddings" => {
                assert_eq!(answer["data"].as_array().map(Vec::len), Some(2), "{answer}");
                assert_eq!(answer["usage"]["prompt_tokens"], 3, "{answer}");
            }
            "/v1/responses" => {
                assert_eq!(answer["object"], "response", "{answer}");
                assert_eq!(answer["usage"]["output_tokens"], 16, "{answer}");
            }
            "/v1/completions" => {
                assert_eq!(answer["object"], "text_completion", "{answer}");
                assert_eq!(
                    answer["usage"],
                    json!({"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6})
                );
            }
            _ => assert_eq!(answer["results"].as_array().map(Vec::len), Some(2), "{answer}"),
        }
        let err = h.openai_file(&b["error_file_id"]).await;
        assert_eq!(err.len(), 1, "{endpoint}: {err:?}");
        assert_eq!(err[0]["custom_id"], "bad");
        assert_eq!(err[0]["response"]["status_code"], 400, "{endpoint}: {err:?}");
        assert_eq!(
            err[0]["response"]["body"]["error"]["type"],
            "invalid_request_error"
        );
    }
    // A batch carries one of the five endpoints.
    let r = h
        .openai_batch(
            "/v1/images/generations",
            &[line("x", "/v1/images/generations", json!({}))],
        )
        .await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'/v1/embeddings'"),
        "{e}"
    );
}

#[tokio::test]
async fn openai_cancel_keeps_what_was_processed() {
    let h = start(
        BATCH_OPENAI
            .replace("fail_every_nth = 2", "fail_every_nth = 0")
            .as_str(),
    )
    .await;
    let fid: Value = h.upload("sk-1", &openai_lines(10)).await.json().await.unwrap();
    let create =
        json!({"input_file_id": fid["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    let b: Value = h
        .client
        .post(format!("{}/v1/batches", h.base))
        .bearer_auth("sk-1")
        .json(&create)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = b["id"].as_str().unwrap();
    h.advance(Duration::from_millis(500));
    let r = h
        .client
        .post(format!("{}/v1/batches/{id}/cancel", h.base))
        .bearer_auth("sk-1")
        .send()
        .await
        .unwrap();
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["status"], "cancelled", "{b}");
    assert_eq!(
        b["request_counts"],
        json!({"total": 10, "completed": 5, "failed": 5})
    );
}

#[tokio::test]
async fn anthropic_message_batch_ends_with_results_by_custom_id() {
    let h = start(BATCH_ANTHROPIC).await;
    let requests: Vec<Value> = (0..3)
        .map(|i| json!({"custom_id": format!("r{i}"), "params": claude(7)}))
        .collect();
    let r = h
        .anthropic_call(
            reqwest::Method::POST,
            "/v1/messages/batches",
            Some(json!({"requests": requests})),
        )
        .await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let id = b["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("msgbatch_"));
    assert_eq!(b["type"], "message_batch");
    assert_eq!(b["processing_status"], "in_progress");
    assert_eq!(b["request_counts"]["processing"], 3);
    assert!(b["results_url"].is_null());
    let early = h
        .anthropic_call(
            reqwest::Method::GET,
            &format!("/v1/messages/batches/{id}/results"),
            None,
        )
        .await;
    assert_eq!(early.status(), 400, "no results before the batch ends");

    h.advance(Duration::from_millis(300));
    let b: Value = h
        .anthropic_call(reqwest::Method::GET, &format!("/v1/messages/batches/{id}"), None)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(b["processing_status"], "ended", "{b}");
    assert_eq!(
        b["request_counts"],
        json!({"processing": 0, "succeeded": 2, "errored": 0, "canceled": 0, "expired": 1})
    );
    let results = h
        .anthropic_call(
            reqwest::Method::GET,
            &format!("/v1/messages/batches/{id}/results"),
            None,
        )
        .await;
    assert_eq!(results.status(), 200);
    let lines = jsonl(&results.text().await.unwrap());
    let by_id: std::collections::HashMap<&str, &Value> = lines
        .iter()
        .map(|l| (l["custom_id"].as_str().unwrap(), &l["result"]))
        .collect();
    assert_eq!(by_id.len(), 3);
    assert_eq!(by_id["r2"]["type"], "expired", "every 3rd line expires");
    for r in ["r0", "r1"] {
        assert_eq!(by_id[r]["type"], "succeeded");
        assert_eq!(by_id[r]["message"]["type"], "message");
        assert_eq!(
            by_id[r]["message"]["usage"],
            json!({"input_tokens": 10, "output_tokens": 7})
        );
    }

    // Auth as online: no key is a 401, a missing anthropic-version a 400.
    let r = h
        .client
        .get(format!("{}/v1/messages/batches/{id}", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = h
        .client
        .get(format!("{}/v1/messages/batches/{id}", h.base))
        .header("x-api-key", "ak-1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}
