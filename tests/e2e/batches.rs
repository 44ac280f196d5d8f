//! Files and batches through the OpenAI-compatible API: upload, ingest with per-line
//! validation, completion, output and error files joined on `custom_id`, cancel, expiry,
//! limits, retention — and 10,000 lines with 3% malformed, also across a SIGKILL of the
//! serving process.

use std::collections::{HashMap, HashSet};

use chrono::Utc;
use serde_json::{Value, json};
use tollgate_api::broker::Roles;
use tollgate_workers::batches::BatchFinalizer;
use tollgate_workers::retention::Retention;

use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, eventually};

/// The broker without gate, dispatcher or maintenance: jobs stay queued, tests drive
/// the loops.
fn api_only() -> TestOptions {
    TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    }
}

/// One input line calling chat completions.
pub fn line(custom_id: &str, model: &str, text: &str) -> String {
    json!({
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16},
    })
    .to_string()
}

/// A multipart/form-data body with `purpose` and `file`: (content type, body).
pub fn multipart(purpose: &str, filename: &str, content: &[u8]) -> (String, Vec<u8>) {
    let b = "tollgate-test-boundary-5f1c9a";
    let mut body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n\
         --{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
         Content-Type: application/jsonl\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(content);
    body.extend_from_slice(format!("\r\n--{b}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={b}"), body)
}

/// Uploads a JSONL file to `api`; returns status and body.
pub async fn upload(http: &reqwest::Client, api: &str, key: &str, content: &[u8]) -> (u16, Value) {
    let (content_type, body) = multipart("batch", "input.jsonl", content);
    let r = http
        .post(format!("{api}/v1/files"))
        .bearer_auth(key)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .expect("POST /v1/files");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Creates a batch over an uploaded file; returns status and body.
pub async fn create_batch(http: &reqwest::Client, api: &str, key: &str, body: &Value) -> (u16, Value) {
    let r = http
        .post(format!("{api}/v1/batches"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .expect("POST /v1/batches");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

pub fn batch_body(file_id: &str) -> Value {
    json!({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
}

/// Uploads `text` as `key`'s batch input and creates a batch of it (24 h window): its id.
pub async fn start_batch(http: &reqwest::Client, api: &str, key: &str, text: &[u8]) -> String {
    let (status, file) = upload(http, api, key, text).await;
    assert_eq!(status, 200, "{file}");
    let (status, batch) = create_batch(http, api, key, &batch_body(file["id"].as_str().unwrap())).await;
    assert_eq!(status, 200, "{batch}");
    batch["id"].as_str().unwrap().to_owned()
}

/// A file's content as text.
pub async fn content(http: &reqwest::Client, api: &str, key: &str, file_id: &str) -> String {
    let r = http
        .get(format!("{api}/v1/files/{file_id}/content"))
        .bearer_auth(key)
        .send()
        .await
        .expect("GET content");
    assert_eq!(r.status().as_u16(), 200, "content of {file_id}");
    r.text().await.expect("content body")
}

/// Polls a batch until it reaches a terminal status.
pub async fn wait_batch(http: &reqwest::Client, api: &str, key: &str, id: &str, secs: u64) -> Value {
    eventually(secs, "the batch to finish", || async {
        let b = crate::harness::get_json(http, &format!("{api}/v1/batches/{id}"), key).await?;
        matches!(
            b["status"].as_str(),
            Some("completed" | "failed" | "expired" | "cancelled")
        )
        .then_some(b)
    })
    .await
}

fn jsonl(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// 10,000 lines, 3% malformed (six kinds in turn); returns the file and the custom_ids
/// that must come back as results.
pub fn ten_thousand_lines() -> (String, HashSet<String>) {
    let mut text = String::new();
    let mut ok = HashSet::new();
    for i in 0..10_000 {
        let id = format!("req-{i}");
        let l = if i % 100 < 3 {
            match (i / 100) % 6 {
                0 => "{\"custom_id\": \"broken".to_owned(),
                1 => line("", "fast", "no id").replace("\"custom_id\":\"\",", ""),
                2 => line(&format!("req-{}", i - 50), "fast", "duplicate"),
                3 => line(&id, "fast", "x").replace("\"POST\"", "\"GET\""),
                4 => line(&id, "fast", "x").replace("/v1/chat/completions", "/v1/embeddings"),
                _ => line(&id, "no-such-model", "x"),
            }
        } else {
            ok.insert(id.clone());
            line(
                &id,
                if i % 2 == 0 { "fast" } else { "oai/gpt-4o-mini" },
                &format!("item {i}"),
            )
        };
        text.push_str(&l);
        text.push('\n');
    }
    (text, ok)
}

/// Checks the output and error files of the 10k batch: every line exactly once.
pub fn check_ten_thousand(output: &str, errors: &str, ok: &HashSet<String>) {
    let out = jsonl(output);
    let err = jsonl(errors);
    assert_eq!(out.len(), 9_700, "output lines");
    assert_eq!(err.len(), 300, "error lines");
    let out_ids: HashSet<String> = out
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(out_ids.len(), 9_700, "no custom_id twice in the output");
    assert_eq!(&out_ids, ok, "every valid line has its result");
    for l in &out {
        assert_eq!(l["response"]["status_code"], 200, "{l}");
        assert_eq!(l["response"]["body"]["object"], "chat.completion", "{l}");
        assert!(l["error"].is_null());
        assert!(l["id"].as_str().unwrap().starts_with("batch_req_"));
    }
    let mut codes: HashMap<String, usize> = HashMap::new();
    for l in &err {
        assert!(l["response"].is_null(), "{l}");
        *codes
            .entry(l["error"]["code"].as_str().unwrap().to_owned())
            .or_default() += 1;
        if let Some(cid) = l["custom_id"].as_str()
            && l["error"]["code"] != "duplicate_custom_id"
        {
            assert!(!ok.contains(cid), "{cid} is in both files");
        }
    }
    let expected: HashMap<String, usize> = [
        ("invalid_json", 51),
        ("missing_custom_id", 51),
        ("duplicate_custom_id", 51),
        ("invalid_method", 51),
        ("invalid_url", 48),
        ("unknown_model", 48),
    ]
    .into_iter()
    .map(|(c, n)| (c.to_owned(), n))
    .collect();
    assert_eq!(codes, expected);
}

#[tokio::test]
async fn batch_runs_to_completed_with_output_and_error_files() {
    let app = TestApp::spawn_with(TestOptions {
        extra_config: "[batches]\nmax_line_bytes = 2048\n".to_owned(),
        ..TestOptions::default()
    })
    .await;
    let http = &app.http;
    let long = "x".repeat(3000);
    let text = [
        line("a", "fast", "one"),
        line("b", "oai/gpt-4o-mini", "two"),
        line("c", "ant/claude-3-5-haiku-latest", "three"),
        String::new(),
        "not json".to_owned(),
        line("a", "fast", "again"),
        line("d", "nope", "x"),
        line("e", "fast", &long),
        json!({"custom_id": "f", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "fast"}})
            .to_string(),
    ]
    .join("\n");
    let (status, file) = upload(http, &app.api, ACME, text.as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    assert_eq!(file["object"], "file");
    assert_eq!(file["purpose"], "batch");
    assert_eq!(file["bytes"], text.len());
    assert_eq!(file["filename"], "input.jsonl");
    assert!(file["created_at"].is_i64());
    let file_id = file["id"].as_str().unwrap();
    // Files are the tenant's: another tenant cannot see it.
    assert_eq!(app.get(GLOBEX, &format!("/v1/files/{file_id}")).await.0, 404);
    let (_, got) = app.get(ACME, &format!("/v1/files/{file_id}")).await;
    assert_eq!(got, file);
    assert_eq!(content(http, &app.api, ACME, file_id).await, text);

    let mut body = batch_body(file_id);
    body["metadata"] = json!({"run": "e2e"});
    let (status, batch) = create_batch(http, &app.api, ACME, &body).await;
    assert_eq!(status, 200, "{batch}");
    assert_eq!(batch["object"], "batch");
    assert_eq!(batch["status"], "in_progress");
    assert_eq!(
        batch["request_counts"],
        json!({"total": 8, "completed": 0, "failed": 5})
    );
    assert_eq!(batch["metadata"], json!({"run": "e2e"}));
    assert_eq!(batch["class"], "batch");
    let created = batch["created_at"].as_i64().unwrap();
    assert_eq!(batch["expires_at"].as_i64().unwrap() - created, 86_400);
    let id = batch["id"].as_str().unwrap();
    assert!(id.starts_with("batch_"));
    assert_eq!(app.get(GLOBEX, &format!("/v1/batches/{id}")).await.0, 404);

    let done = wait_batch(http, &app.api, ACME, id, 60).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": 8, "completed": 3, "failed": 5})
    );
    for t in ["in_progress_at", "finalizing_at", "completed_at"] {
        assert!(done[t].as_i64().is_some_and(|v| v >= created), "{t}: {done}");
    }
    assert!(done["cancelled_at"].is_null() && done["failed_at"].is_null());
    assert!(done["usage"]["input_tokens"].as_i64().unwrap() > 0);
    assert_eq!(done["usage"]["output_tokens"], 36);

    let output = jsonl(&content(http, &app.api, ACME, done["output_file_id"].as_str().unwrap()).await);
    let by_id: HashMap<&str, &Value> = output
        .iter()
        .map(|l| (l["custom_id"].as_str().unwrap(), l))
        .collect();
    assert_eq!(by_id.len(), 3);
    assert_eq!(by_id["c"]["response"]["body"]["object"], "chat.completion");
    assert!(
        by_id["a"]["response"]["request_id"]
            .as_str()
            .unwrap()
            .starts_with("req_")
    );
    let errors = jsonl(&content(http, &app.api, ACME, done["error_file_id"].as_str().unwrap()).await);
    let codes: Vec<(Option<&str>, &str)> = errors
        .iter()
        .map(|l| (l["custom_id"].as_str(), l["error"]["code"].as_str().unwrap()))
        .collect();
    assert_eq!(
        codes,
        vec![
            (None, "invalid_json"),
            (Some("a"), "duplicate_custom_id"),
            (Some("d"), "unknown_model"),
            (None, "line_too_large"),
            (Some("f"), "missing_field"),
        ]
    );
    assert!(
        errors[0]["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("line 5:"),
        "{}",
        errors[0]
    );
    let (_, out_file) = app
        .get(
            ACME,
            &format!("/v1/files/{}", done["output_file_id"].as_str().unwrap()),
        )
        .await;
    assert_eq!(out_file["purpose"], "batch_output");

    // Files list and delete.
    let (_, files) = app.get(ACME, "/v1/files?purpose=batch").await;
    assert_eq!(files["data"].as_array().unwrap().len(), 1);
    let (_, files) = app.get(ACME, "/v1/files?limit=1").await;
    assert_eq!(files["has_more"], true);
    let (status, deleted) = app.delete(ACME, &format!("/v1/files/{file_id}")).await;
    assert_eq!(status, 200);
    assert_eq!(deleted, json!({"id": file_id, "object": "file", "deleted": true}));
    assert_eq!(app.get(ACME, &format!("/v1/files/{file_id}")).await.0, 404);
    // A finished batch cannot be cancelled.
    let (status, err) = app
        .post(ACME, &format!("/v1/batches/{id}/cancel"), &json!({}))
        .await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (409, Some("batch_already_finished"))
    );
    app.shutdown().await;
}

#[tokio::test]
async fn cancel_then_cancelled_and_expiry_then_expired() {
    let app = TestApp::spawn_with(api_only()).await;
    let http = &app.http;
    let text: Vec<String> = (0..5).map(|i| line(&format!("c{i}"), "fast", "wait")).collect();
    let (_, file) = upload(http, &app.api, ACME, text.join("\n").as_bytes()).await;
    let file_id = file["id"].as_str().unwrap();
    let finalizer = BatchFinalizer::new(app.db.pool.clone());

    let (_, batch) = create_batch(http, &app.api, ACME, &batch_body(file_id)).await;
    let id = batch["id"].as_str().unwrap();
    // Nothing runs (no gate or dispatcher here): the batch stays in progress.
    assert_eq!(finalizer.run_once(Utc::now()).await.unwrap(), 0);
    let (status, cancelling) = app
        .post(ACME, &format!("/v1/batches/{id}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 200, "{cancelling}");
    assert_eq!(cancelling["status"], "cancelling");
    assert!(cancelling["cancelling_at"].is_i64());
    assert_eq!(finalizer.run_once(Utc::now()).await.unwrap(), 1);
    let (_, cancelled) = app.get(ACME, &format!("/v1/batches/{id}")).await;
    assert_eq!(cancelled["status"], "cancelled");
    assert!(cancelled["cancelled_at"].is_i64());
    assert!(cancelled["output_file_id"].is_null());
    assert_eq!(
        cancelled["request_counts"],
        json!({"total": 5, "completed": 0, "failed": 5})
    );
    let errors = jsonl(&content(http, &app.api, ACME, cancelled["error_file_id"].as_str().unwrap()).await);
    assert_eq!(errors.len(), 5);
    assert!(errors.iter().all(|l| l["error"]["code"] == "batch_cancelled"));
    // Its jobs are cancelled too.
    let (_, jobs) = app.get(ACME, "/v1/jobs?state=cancelled").await;
    assert_eq!(jobs["data"].as_array().unwrap().len(), 5);

    // A 15-minute window: the jobs' deadline; past it the batch expires.
    let mut body = batch_body(file_id);
    body["completion_window"] = json!("15m");
    let (_, batch) = create_batch(http, &app.api, ACME, &body).await;
    let id = batch["id"].as_str().unwrap();
    assert_eq!(
        batch["expires_at"].as_i64().unwrap() - batch["created_at"].as_i64().unwrap(),
        900
    );
    let (_, jobs) = app.get(ACME, "/v1/jobs?state=queued").await;
    let deadline = jobs["data"][0]["deadline"].as_str().unwrap();
    assert_eq!(
        chrono::DateTime::parse_from_rfc3339(deadline)
            .unwrap()
            .timestamp(),
        batch["expires_at"].as_i64().unwrap()
    );
    let later = Utc::now() + chrono::Duration::minutes(16);
    assert_eq!(finalizer.run_once(later).await.unwrap(), 1);
    let (_, expired) = app.get(ACME, &format!("/v1/batches/{id}")).await;
    assert_eq!(expired["status"], "expired", "{expired}");
    assert!(expired["expired_at"].is_i64());
    let errors = jsonl(&content(http, &app.api, ACME, expired["error_file_id"].as_str().unwrap()).await);
    assert_eq!(errors.len(), 5);
    assert!(
        errors.iter().all(|l| l["error"]["code"] == "batch_expired"),
        "{errors:?}"
    );

    // Paging: newest first, `after` = the previous page's last id.
    let (_, page) = app.get(ACME, "/v1/batches?limit=1").await;
    assert_eq!(
        (page["data"][0]["id"].as_str(), page["has_more"].as_bool()),
        (Some(id), Some(true))
    );
    let (_, page2) = app
        .get(
            ACME,
            &format!("/v1/batches?limit=1&after={}", page["last_id"].as_str().unwrap()),
        )
        .await;
    assert_eq!(page2["data"].as_array().unwrap().len(), 1);
    assert_eq!(page2["has_more"], false);
    app.shutdown().await;
}

#[tokio::test]
async fn limits_and_bad_batches_get_clear_4xx() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[batches]\nmax_file_bytes = 4000\nmax_lines = 5\nmax_completion_window_secs = 3600\n"
            .to_owned(),
        ..TestOptions::default()
    })
    .await;
    let http = &app.http;
    let big = "x".repeat(5000);
    let (status, err) = upload(http, &app.api, ACME, big.as_bytes()).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (413, Some("file_too_large")),
        "{err}"
    );
    let six: Vec<String> = (0..6).map(|i| line(&i.to_string(), "fast", "x")).collect();
    let (status, err) = upload(http, &app.api, ACME, six.join("\n").as_bytes()).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (400, Some("too_many_lines")),
        "{err}"
    );
    let (content_type, body) = multipart("fine-tune", "x.jsonl", b"{}");
    let r = http
        .post(app.url("/v1/files"))
        .bearer_auth(ACME)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "invalid_purpose"
    );
    let r = http
        .post(app.url("/v1/files"))
        .bearer_auth(ACME)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "invalid_multipart"
    );
    // Nothing of the refused uploads was kept.
    let (_, files) = app.get(ACME, "/v1/files").await;
    assert_eq!(files["data"], json!([]));

    let (_, file) = upload(http, &app.api, ACME, line("a", "fast", "x").as_bytes()).await;
    let file_id = file["id"].as_str().unwrap();
    for (change, code) in [
        (json!({"endpoint": "/v1/audio/speech"}), "unsupported_endpoint"),
        (json!({"completion_window": "24h"}), "invalid_completion_window"),
        (json!({"completion_window": "soon"}), "invalid_completion_window"),
        (json!({"input_file_id": "file-nope"}), "not_found"),
        (json!({"metadata": {"k": "v".repeat(600)}}), "invalid_request"),
        (
            json!({"webhook": {"url": "http://127.0.0.1:9/h", "secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}}),
            "webhook_url_not_allowed",
        ),
        (
            json!({"webhook": {"url": "https://example.com/h", "secret": "nope"}}),
            "invalid_webhook_secret",
        ),
    ] {
        let mut body = batch_body(file_id);
        body["completion_window"] = json!("1h");
        body.as_object_mut()
            .unwrap()
            .extend(change.as_object().unwrap().clone());
        let (status, err) = create_batch(http, &app.api, ACME, &body).await;
        assert!(status == 400 || status == 404, "{status} {err}");
        assert_eq!(err["error"]["code"], code, "{change}: {err}");
    }
    // Another tenant's file is not found.
    let mut body = batch_body(file_id);
    body["completion_window"] = json!("1h");
    let (status, _) = create_batch(http, &app.api, GLOBEX, &body).await;
    assert_eq!(status, 404);
    app.shutdown().await;
}

/// The 10k-line tests load both cores for a minute or more: one at a time, so the rest
/// of the suite (latency and rate checks among it) keeps some CPU.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn ten_thousand_lines_three_percent_malformed_none_lost_none_doubled() {
    let _one_at_a_time = HEAVY.lock().await;
    let app = TestApp::spawn().await;
    let http = &app.http;
    let (text, ok) = ten_thousand_lines();
    let (status, file) = upload(http, &app.api, ACME, text.as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    let started = std::time::Instant::now();
    let (status, batch) = create_batch(http, &app.api, ACME, &batch_body(file["id"].as_str().unwrap())).await;
    eprintln!(
        "ingest of 10,000 lines: {:.0} lines/s",
        10_000.0 / started.elapsed().as_secs_f64()
    );
    assert_eq!(status, 200, "{batch}");
    assert_eq!(
        batch["request_counts"],
        json!({"total": 10_000, "completed": 0, "failed": 300})
    );
    let done = wait_batch(http, &app.api, ACME, batch["id"].as_str().unwrap(), 600).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": 10_000, "completed": 9_700, "failed": 300})
    );
    let output = content(http, &app.api, ACME, done["output_file_id"].as_str().unwrap()).await;
    let errors = content(http, &app.api, ACME, done["error_file_id"].as_str().unwrap()).await;
    check_ten_thousand(&output, &errors, &ok);
    app.shutdown().await;
}

/// A measurement for BENCHMARKS.md (run it with `--release -- --ignored`); the 10k-line
/// tests cover the same path in every run.
#[tokio::test]
#[ignore = "measurement: cargo test --release -p tollgate-cli --test e2e -- --ignored ingest_of_fifty"]
async fn ingest_of_fifty_thousand_lines_is_bulk() {
    let app = TestApp::spawn_with(api_only()).await;
    let http = &app.http;
    let text: String = (0..50_000)
        .map(|i| {
            line(
                &format!("r{i}"),
                "fast",
                &format!("Summarize item {i} of the catalogue in one line."),
            ) + "\n"
        })
        .collect();
    let (status, file) = upload(http, &app.api, ACME, text.as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    assert_eq!(
        file["bytes"],
        text.len(),
        "a file far larger than server.max_body_bytes streams in"
    );
    let started = std::time::Instant::now();
    let (status, batch) = create_batch(http, &app.api, ACME, &batch_body(file["id"].as_str().unwrap())).await;
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(status, 200, "{batch}");
    eprintln!(
        "ingest of 50,000 lines ({} MB): {secs:.2} s, {:.0} lines/s",
        text.len() / 1_000_000,
        50_000.0 / secs
    );
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE batch_id = $1")
        .bind(batch["id"].as_str().unwrap())
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 50_000);
    app.shutdown().await;
}

#[tokio::test]
async fn retention_prunes_old_finished_work() {
    let app = TestApp::spawn().await;
    let http = &app.http;
    let (_, file) = upload(http, &app.api, ACME, line("a", "fast", "x").as_bytes()).await;
    let mut body = batch_body(file["id"].as_str().unwrap());
    body["max_cost_usd"] = json!(5);
    let (_, batch) = create_batch(http, &app.api, ACME, &body).await;
    let cap = tollgate::buckets::batch_cap_key(batch["id"].as_str().unwrap());
    let cap_buckets = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM buckets WHERE key = $1")
            .bind(&cap)
            .fetch_one(&app.db.pool)
            .await
            .unwrap()
    };
    assert_eq!(cap_buckets().await, 1, "the batch's cost cap is a bucket");
    let done = wait_batch(http, &app.api, ACME, batch["id"].as_str().unwrap(), 60).await;
    assert_eq!(done["status"], "completed");
    let (_, single) = app.submit(ACME, &crate::harness::job("fast", "single")).await;
    let single = app.wait_job(ACME, single["id"].as_str().unwrap(), 30).await;
    assert_eq!(single["state"], "succeeded");
    let config = app.config.retention.clone();
    let retention = Retention::new(app.db.pool.clone(), config);
    // Now: nothing is old enough.
    assert_eq!(retention.run_once(Utc::now()).await.unwrap().total(), 0);
    // An alert of a budget window that ended a week ago: forgotten with the rest.
    sqlx::query("INSERT INTO budget_alerts (bucket_key, resets_at, threshold) VALUES ('tenant:acme:daily_spend', now() - interval '7 days', 0.8)")
        .execute(&app.db.pool)
        .await
        .unwrap();
    // 31 days later everything finished is gone, files included (they expire after 30).
    let later = Utc::now() + chrono::Duration::days(31);
    let retention = Retention::new(app.db.pool.clone(), app.config.retention.clone());
    let pruned = retention.run_once(later).await.unwrap();
    assert_eq!(
        (pruned.jobs, pruned.batches, pruned.files, pruned.budget_alerts),
        (2, 1, 2, 1),
        "{pruned:?}"
    );
    assert_eq!(cap_buckets().await, 0, "the batch's cap bucket goes with it");
    assert_eq!(
        app.get(ACME, &format!("/v1/jobs/{}", single["id"].as_str().unwrap()))
            .await
            .0,
        404
    );
    assert_eq!(
        app.get(ACME, &format!("/v1/batches/{}", batch["id"].as_str().unwrap()))
            .await
            .0,
        404
    );
    app.shutdown().await;
}

#[tokio::test]
async fn openai_python_sdk_drives_files_and_batches() {
    // "slow": a route limited to one request a minute, so a batch on it can be cancelled
    // while it runs.
    let app = TestApp::spawn_with(TestOptions {
        extra_config: r#"
[[routes]]
alias = "slow"
targets = ["oai/gpt-4o-mini"]
limits = { rpm = 1 }
"#
        .to_owned(),
        ..TestOptions::default()
    })
    .await;
    let base_url = app.url("/v1");
    let out = crate::python::run_script(
        "openai_batch.py",
        &[],
        &[("TOLLGATE_BASE_URL", &base_url), ("TOLLGATE_API_KEY", ACME)],
    )
    .await;
    let summary: Value = serde_json::from_str(out.trim()).expect("the script's JSON summary");
    let (_, batch) = app
        .get(
            ACME,
            &format!("/v1/batches/{}", summary["batch"].as_str().unwrap()),
        )
        .await;
    assert_eq!(batch["status"], "completed");
    let (_, cancelled) = app
        .get(
            ACME,
            &format!("/v1/batches/{}", summary["cancelled"].as_str().unwrap()),
        )
        .await;
    assert_eq!(cancelled["status"], "cancelled");
    app.shutdown().await;
}

#[tokio::test]
async fn ten_thousand_lines_complete_once_across_a_sigkill_of_the_server() {
    let _one_at_a_time = HEAVY.lock().await;
    use nix::sys::signal::Signal;
    use tollgate_mock::MockProvider;

    use crate::durability::{Serve, free_port, short_lease_config};
    use crate::harness::{fresh_db_with, mock_config, serve_connections};

    let db = fresh_db_with(serve_connections()).await;
    let local_mock = MockProvider::new(mock_config()).start_local().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config_path = short_lease_config(dir.path(), local_mock.addr);
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();

    let mut first = Serve::start(&config_path, &db.url, port);
    first.wait_ready(&api).await;
    let (text, ok) = ten_thousand_lines();
    let id = start_batch(&http, &api, ACME, text.as_bytes()).await;
    let succeeded = |pool: sqlx::PgPool, id: String| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM jobs WHERE batch_id = $1 AND state = 'succeeded'")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    eventually(300, "a share of the batch to be done", || {
        let (pool, id) = (db.pool.clone(), id.clone());
        async move { (succeeded(pool, id).await >= 1500).then_some(()) }
    })
    .await;
    first.signal(Signal::SIGKILL);
    let _ = first.child.wait();
    let at_kill = succeeded(db.pool.clone(), id.clone()).await;
    assert!(
        at_kill < 9_700,
        "the batch must still be running when the server dies ({at_kill} done)"
    );

    let mut second = Serve::start(&config_path, &db.url, port);
    second.wait_ready(&api).await;
    let done = wait_batch(&http, &api, ACME, &id, 600).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": 10_000, "completed": 9_700, "failed": 300})
    );
    let output = content(&http, &api, ACME, done["output_file_id"].as_str().unwrap()).await;
    let errors = content(&http, &api, ACME, done["error_file_id"].as_str().unwrap()).await;
    check_ten_thousand(&output, &errors, &ok);
    // Each result written once: one successful attempt per job on record.
    let (attempts, jobs): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT a.job_id) FROM job_attempts a JOIN jobs j ON j.id = a.job_id
         WHERE j.batch_id = $1 AND a.outcome = 'succeeded'",
    )
    .bind(&id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((attempts, jobs), (9_700, 9_700));
    second.signal(Signal::SIGTERM);
    assert!(second.child.wait().unwrap().success());
    local_mock.shutdown().await;
}

/// A batch is work queued like any other: it may not take the interactive class, and its
/// lines count against the tenant's queue of its class.
#[tokio::test]
async fn a_batch_keeps_to_its_class_and_the_tenant_s_queue_cap() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[classes.batch]\ndefault_deadline_secs = 86400\nmax_queued_per_tenant = 5\n".into(),
        ..TestOptions::default()
    })
    .await;
    let text: String = (0..6)
        .map(|i| line(&format!("c{i}"), "fast", "hi") + "\n")
        .collect();
    let (status, file) = upload(&app.http, &app.api, ACME, text.as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    let id = file["id"].as_str().unwrap();

    let mut interactive = batch_body(id);
    interactive["class"] = json!("interactive");
    let (status, body) = create_batch(&app.http, &app.api, ACME, &interactive).await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("class")),
        "{body}"
    );

    let (status, body) = create_batch(&app.http, &app.api, ACME, &batch_body(id)).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (429, Some("queue_full")),
        "{body}"
    );
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(queued, 0, "a refused batch left jobs");

    // Within the cap (another class has none), it is taken.
    let mut background = batch_body(id);
    background["class"] = json!("background");
    let (status, body) = create_batch(&app.http, &app.api, ACME, &background).await;
    assert_eq!(status, 200, "{body}");
}

/// The batch's lines by state: acme's jobs without metadata (the test's other jobs have some).
async fn lines_by_state(app: &TestApp) -> std::collections::BTreeMap<String, Vec<Value>> {
    let mut by_state = std::collections::BTreeMap::<String, Vec<Value>>::new();
    let (_, jobs) = app.get(ACME, "/v1/jobs?limit=100").await;
    for j in jobs["data"].as_array().unwrap() {
        if j["metadata"].is_null() {
            by_state
                .entry(j["state"].as_str().unwrap().to_owned())
                .or_default()
                .push(j.clone());
        }
    }
    by_state
}

/// Reads batch `id`'s results from `cursor` to the end of what is readable: the lines'
/// custom_ids, and the next cursor.
async fn read_results(app: &TestApp, id: &str, cursor: &str) -> (Vec<String>, String) {
    let r = app
        .http
        .get(app.url(&format!("/v1/batches/{id}/results?after={cursor}&limit=7")))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["content-type"], "application/jsonl");
    let next = r.headers()["x-next-cursor"].to_str().unwrap().to_owned();
    let ids = jsonl(&r.text().await.unwrap())
        .iter()
        .map(|l| {
            assert_eq!(l["response"]["status_code"], 200, "{l}");
            l["custom_id"].as_str().unwrap().to_owned()
        })
        .collect();
    (ids, next)
}

/// A running batch's results are read in the order the lines' endings committed, and a
/// cursor never passes a line whose ending is still uncommitted: the line ended after it,
/// committed first, waits until it has committed (read on from a cursor past that line,
/// it would be lost).
#[tokio::test]
async fn a_results_cursor_never_passes_a_line_whose_ending_commits_late() {
    let app = TestApp::spawn_with(api_only()).await;
    let text: String = ["early", "late"].map(|c| line(c, "fast", "hi") + "\n").concat();
    let id = &start_batch(&app.http, &app.api, ACME, text.as_bytes()).await;
    let end_line = "UPDATE jobs SET state = 'succeeded', attempt = 1, finished_at = now(),
                           result = '{\"id\": \"chatcmpl-1\", \"object\": \"chat.completion\", \"choices\": []}'
                    WHERE batch_id = $1 AND custom_id = $2";
    let mut still_open = app.db.pool.begin().await.unwrap();
    sqlx::query(end_line)
        .bind(id)
        .bind("early")
        .execute(&mut *still_open)
        .await
        .unwrap();
    sqlx::query(end_line)
        .bind(id)
        .bind("late")
        .execute(&app.db.pool)
        .await
        .unwrap();
    let (ids, _) = read_results(&app, id, "0").await;
    assert!(ids.is_empty(), "read past a line still ending: {ids:?}");

    still_open.commit().await.unwrap();
    let (ids, next) = eventually(30, "both lines readable", || async {
        let (ids, next) = read_results(&app, id, "0").await;
        (ids.len() == 2).then_some((ids, next))
    })
    .await;
    assert_eq!(ids, ["early", "late"]);
    let (more, last) = read_results(&app, id, &next).await;
    assert_eq!((more.len(), last), (0, next));
}

#[tokio::test]
async fn a_running_batch_pauses_resumes_and_changes_and_its_results_read_while_it_runs() {
    // Two calls at a time on "paced", each taking 200 ms: 30 lines take three seconds.
    let mut mock = crate::harness::mock_config();
    mock.latency_ms = 200;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: r#"
[[routes]]
alias = "paced"
targets = ["oai/gpt-4o-mini"]
limits = { concurrency = 2 }
"#
        .to_owned(),
        ..TestOptions::default()
    })
    .await;
    let http = &app.http;
    let text: Vec<String> = (0..30).map(|i| line(&format!("p{i}"), "paced", "hi")).collect();
    let (_, file) = upload(http, &app.api, ACME, text.join("\n").as_bytes()).await;
    let (_, batch) = create_batch(http, &app.api, ACME, &batch_body(file["id"].as_str().unwrap())).await;
    let id = batch["id"].as_str().unwrap().to_owned();
    assert_eq!(
        (&batch["priority"], &batch["paused_at"]),
        (&json!(0), &Value::Null)
    );

    // Paused: what is in flight finishes, the rest waits, saying why.
    let (status, paused) = app
        .post(ACME, &format!("/v1/batches/{id}/pause"), &json!({}))
        .await;
    assert_eq!(status, 200, "{paused}");
    assert!(paused["paused_at"].is_i64(), "{paused}");
    let settled = eventually(20, "nothing of the batch in flight", || async {
        let lines = lines_by_state(&app).await;
        (!lines.contains_key("admitted") && !lines.contains_key("running")).then_some(lines)
    })
    .await;
    let queued = settled.get("queued").cloned().unwrap_or_default();
    assert!(queued.len() >= 20, "most lines wait: {:?}", settled.keys());
    assert!(
        queued.iter().all(|j| j["admission"]["reason"] == "batch_paused"),
        "{queued:?}"
    );
    // The gate goes on for other work, and still leaves the batch's lines alone.
    let mut other = crate::harness::job("paced", "other work");
    other["metadata"] = json!({"not": "a line"});
    let (_, other) = app.submit(ACME, &other).await;
    let done = app.wait_job(ACME, other["id"].as_str().unwrap(), 30).await;
    assert_eq!(done["state"], "succeeded");
    let after = lines_by_state(&app).await;
    assert_eq!(
        after.get("queued").map(Vec::len),
        Some(queued.len()),
        "no paused line admitted"
    );

    // What finished so far reads as results, a page at a time.
    let finished = 30 - queued.len();
    let (mut seen, mut cursor) = (Vec::new(), "0".to_owned());
    let published = eventually(30, "the finished lines readable", || {
        let (app, id, cursor) = (&app, id.clone(), cursor.clone());
        async move {
            let (ids, next) = read_results(app, &id, &cursor).await;
            (!ids.is_empty() || finished == 0).then_some((ids, next))
        }
    })
    .await;
    seen.extend(published.0);
    cursor = published.1;

    // Changed while paused: its queued lines take the new priority and class.
    let (status, e) = app
        .patch(ACME, &format!("/v1/batches/{id}"), &json!({"priority": 5000}))
        .await;
    assert_eq!((status, &e["error"]["param"]), (400, &json!("priority")), "{e}");
    let (status, e) = app
        .patch(
            ACME,
            &format!("/v1/batches/{id}"),
            &json!({"deadline": "2001-01-01T00:00:00Z"}),
        )
        .await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (400, &json!("invalid_deadline")),
        "{e}"
    );
    let deadline = (Utc::now() + chrono::Duration::hours(2)).to_rfc3339();
    let (status, changed) = app
        .patch(
            ACME,
            &format!("/v1/batches/{id}"),
            &json!({"priority": 7, "class": "background", "deadline": deadline}),
        )
        .await;
    assert_eq!(status, 200, "{changed}");
    assert_eq!(
        (&changed["priority"], &changed["class"]),
        (&json!(7), &json!("background"))
    );
    let lines = lines_by_state(&app).await;
    for j in &lines["queued"] {
        assert_eq!(
            (&j["priority"], &j["class"]),
            (&json!(7), &json!("background")),
            "{j}"
        );
        assert_eq!(
            chrono::DateTime::parse_from_rfc3339(j["deadline"].as_str().unwrap())
                .unwrap()
                .timestamp(),
            chrono::DateTime::parse_from_rfc3339(&deadline)
                .unwrap()
                .timestamp()
        );
    }

    // Resumed: the rest runs, and reading on from the cursor gives every line once.
    let (status, resumed) = app
        .post(ACME, &format!("/v1/batches/{id}/resume"), &json!({}))
        .await;
    assert_eq!((status, &resumed["paused_at"]), (200, &Value::Null), "{resumed}");
    let ended = wait_batch(http, &app.api, ACME, &id, 60).await;
    assert_eq!(ended["status"], "completed", "{ended}");
    loop {
        let (ids, next) = read_results(&app, &id, &cursor).await;
        if ids.is_empty() {
            break;
        }
        seen.extend(ids);
        cursor = next;
    }
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!((seen.len(), sorted.len()), (30, 30), "every line once: {seen:?}");
    let (status, e) = app
        .post(ACME, &format!("/v1/batches/{id}/pause"), &json!({}))
        .await;
    assert_eq!(
        (status, &e["error"]["code"]),
        (409, &json!("batch_already_finished"))
    );
    let (status, _) = app
        .get(crate::harness::GLOBEX, &format!("/v1/batches/{id}/results"))
        .await;
    assert_eq!(status, 404, "another tenant's batch is not found");
    app.shutdown().await;
}

#[tokio::test]
async fn a_batch_stops_at_its_cost_cap_and_at_its_error_rate() {
    // gpt-4o-mini at $1,000 per million tokens: a line reserves about $0.04.
    let app = TestApp::spawn_with(TestOptions {
        extra_config: "[providers.prices.\"gpt-4o-mini\"]\ninput_per_mtok = 1000\noutput_per_mtok = 1000\n"
            .to_owned(),
        ..TestOptions::default()
    })
    .await;
    let http = &app.http;
    let text: Vec<String> = (0..10).map(|i| line(&format!("c{i}"), "fast", "hi")).collect();
    let (_, file) = upload(http, &app.api, ACME, text.join("\n").as_bytes()).await;
    let file_id = file["id"].as_str().unwrap();
    let mut body = batch_body(file_id);
    body["max_cost_usd"] = json!(-1);
    let (status, e) = create_batch(http, &app.api, ACME, &body).await;
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("max_cost_usd")),
        "{e}"
    );
    let cap = 0.1;
    body["max_cost_usd"] = json!(cap);
    let (status, batch) = create_batch(http, &app.api, ACME, &body).await;
    assert_eq!((status, &batch["max_cost_usd"]), (200, &json!(cap)), "{batch}");
    let id = batch["id"].as_str().unwrap();
    let ended = wait_batch(http, &app.api, ACME, id, 60).await;
    assert_eq!(ended["status"], "completed", "{ended}");
    let (_, jobs) = app.get(ACME, "/v1/jobs?limit=100").await;
    let lines = jobs["data"].as_array().unwrap();
    assert_eq!(lines.len(), 10);
    let spent: f64 = lines
        .iter()
        .filter_map(|j| j["cost"]["charged_usd"].as_f64())
        .sum();
    let succeeded = lines.iter().filter(|j| j["state"] == "succeeded").count();
    let capped = lines
        .iter()
        .filter(|j| j["error"]["code"] == "batch_cost_cap_reached")
        .count();
    assert!(spent <= cap + 1e-12, "the batch cost ${spent} against its ${cap}");
    assert!(succeeded >= 1 && capped >= 1, "{succeeded} ran, {capped} stopped");
    // The batch shows what its lines were charged: their sum, and nothing held any more.
    assert!(
        (ended["cost"]["charged_usd"].as_f64().unwrap() - spent).abs() < 1e-9,
        "{ended}"
    );
    assert_eq!(ended["cost"]["reserved_usd"], 0.0, "{ended}");
    assert_eq!(
        succeeded + capped,
        10,
        "every line ran or was stopped by the cap: {lines:?}"
    );

    // Every call fails (max_attempts 1): past half of ten finished lines failing, it stops.
    app.shutdown().await;
    let mut mock = crate::harness::mock_config();
    mock.faults = vec![tollgate_mock::FaultConfig {
        project: None,
        start_ms: 0,
        duration_ms: 0,
        status: 500,
        probability: 1.0,
    }];
    let app = TestApp::spawn_with(TestOptions {
        mock,
        retry_config: "max_attempts = 1\n".to_owned(),
        ..TestOptions::default()
    })
    .await;
    let http = &app.http;
    let text: Vec<String> = (0..30).map(|i| line(&format!("e{i}"), "fast", "hi")).collect();
    let (_, file) = upload(http, &app.api, ACME, text.join("\n").as_bytes()).await;
    let mut body = batch_body(file["id"].as_str().unwrap());
    body["max_error_rate"] = json!(0.5);
    let (status, batch) = create_batch(http, &app.api, ACME, &body).await;
    assert_eq!(status, 200, "{batch}");
    let ended = wait_batch(http, &app.api, ACME, batch["id"].as_str().unwrap(), 60).await;
    assert_eq!(ended["status"], "cancelled", "{ended}");
    assert_eq!(
        ended["errors"]["data"][0]["code"], "batch_error_rate_exceeded",
        "{ended}"
    );
    app.shutdown().await;
}

/// A batch ends soon after its last line, not at the next maintenance pass: with passes an
/// hour apart (the first ran at start, before the batch existed), the batch steps between
/// them publish its lines and complete it.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_completes_between_maintenance_passes() {
    let app = TestApp::spawn_with(TestOptions {
        dispatch_config: "maintenance_interval_ms = 3600000".into(),
        ..TestOptions::default()
    })
    .await;
    let http = &app.http;
    let text = [line("a", "fast", "one"), line("b", "fast", "two")].join("\n");
    let id = &start_batch(http, &app.api, ACME, text.as_bytes()).await;
    let done = wait_batch(http, &app.api, ACME, id, 30).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": 2, "completed": 2, "failed": 0})
    );
    let output = content(http, &app.api, ACME, done["output_file_id"].as_str().unwrap()).await;
    let ids: HashSet<String> = jsonl(&output)
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, HashSet::from(["a".to_owned(), "b".to_owned()]));
    let (lines, _) = read_results(&app, id, "0").await;
    assert_eq!(lines.len(), 2, "both lines published: {lines:?}");
}
