//! Streaming chat completions: queued and admitted like any job, relayed as SSE in OpenAI
//! chunk format, settled from the final usage; a client that goes away cancels the
//! upstream call; a caller who asks is told where its job stands while it waits.

use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::harness::{ACME, TestApp, TestOptions, eventually, job, mock_config};

/// Reads an SSE body into its `data:` payloads.
fn data_lines(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim().to_owned())
        .collect()
}

async fn stream_request(app: &TestApp, body: &Value) -> reqwest::Response {
    app.http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(ACME)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn content_of(chunks: &[String]) -> String {
    chunks
        .iter()
        .filter(|c| *c != "[DONE]")
        .filter_map(|c| serde_json::from_str::<Value>(c).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn openai_and_anthropic_streams_are_relayed_as_openai_chunks_and_settled() {
    let app = TestApp::spawn_with(TestOptions {
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 4\notpm = 1000000\n".into(),
        ..TestOptions::default()
    })
    .await;
    for model in ["oai/gpt-4o-mini", "ant/claude-3-5-haiku-latest"] {
        let body = json!({
            "model": model,
            "messages": [{"role": "user", "content": "tell me"}],
            "max_tokens": 10,
            "stream": true,
            "stream_options": {"include_usage": true}
        });
        let resp = stream_request(&app, &body).await;
        assert_eq!(resp.status().as_u16(), 200, "{model}");
        assert!(
            resp.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        let job_id = resp.headers()["x-tollgate-job-id"].to_str().unwrap().to_owned();
        let chunks = data_lines(&resp.text().await.unwrap());
        assert_eq!(
            chunks.last().map(String::as_str),
            Some("[DONE]"),
            "{model}: {chunks:?}"
        );
        let first: Value = serde_json::from_str(&chunks[0]).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk", "{model}");
        let text = content_of(&chunks);
        assert!(!text.is_empty(), "{model}");
        let usage: Value = chunks
            .iter()
            .filter_map(|c| serde_json::from_str::<Value>(c).ok())
            .find(|v| v["usage"].is_object())
            .map(|v| v["usage"].clone())
            .expect("a usage chunk");
        assert_eq!(
            usage["completion_tokens"], 10,
            "{model}: max_tokens caps the output"
        );
        // The job holds the assembled answer and its usage; nothing stays reserved.
        let job = app.wait_job(ACME, &job_id, 10).await;
        assert_eq!(job["state"], "succeeded", "{model}: {job}");
        assert_eq!(job["class"], "interactive");
        assert_eq!(job["result"]["choices"][0]["message"]["content"], text.as_str());
        assert_eq!(job["usage"]["output_tokens"], 10);
    }
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE reserved_buckets IS NOT NULL")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(held, 0);
    // Without include_usage the client gets no usage chunk.
    let resp = stream_request(
        &app,
        &json!({"model": "fast", "messages": [{"role": "user", "content": "x"}], "stream": true, "max_tokens": 3}),
    )
    .await;
    let chunks = data_lines(&resp.text().await.unwrap());
    assert!(
        chunks.iter().all(|c| !c.contains("\"prompt_tokens\"")),
        "{chunks:?}"
    );
    assert_eq!(app.mock.stats().streams_completed, 3);
    app.shutdown().await;
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_the_upstream_call_and_is_settled() {
    let mut mock = mock_config();
    mock.output_tokens = 200;
    mock.latency_per_output_token_us = 20_000; // 20 ms a token: 4 s for the whole answer
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 2\n".into(),
        ..TestOptions::default()
    })
    .await;
    let body = json!({"model": "oai/gpt-4o-mini", "messages": [{"role": "user", "content": "long"}], "max_tokens": 200, "stream": true});
    let resp = stream_request(&app, &body).await;
    assert_eq!(resp.status().as_u16(), 200);
    let job_id = resp.headers()["x-tollgate-job-id"].to_str().unwrap().to_owned();
    let mut body_stream = resp.bytes_stream();
    // Read until some content arrived, then hang up.
    let mut seen = String::new();
    while !seen.contains("\"content\":\"") || seen.matches("data:").count() < 3 {
        let bytes = body_stream.next().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&bytes));
    }
    drop(body_stream);
    eventually(10, "the upstream stream to be cancelled", || async {
        (app.mock.stats().streams_cancelled == 1).then_some(())
    })
    .await;
    let job = app.wait_job(ACME, &job_id, 10).await;
    assert_eq!(job["state"], "failed", "{job}");
    assert_eq!(job["error"]["code"], "client_disconnected");
    let output = job["usage"].clone();
    let attempt: (Option<i32>,) =
        sqlx::query_as("SELECT output_tokens FROM job_attempts WHERE job_id = $1::uuid")
            .bind(&job_id)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    let produced = attempt.0.unwrap_or(0);
    assert!(
        produced > 0 && produced < 200,
        "partial output recorded: {produced} ({output})"
    );
    // The concurrency slot comes back.
    eventually(10, "the concurrency slot to return", || async {
        let level: f64 = sqlx::query_scalar(
            "SELECT level FROM buckets WHERE key = 'provider:oai:gpt-4o-mini:concurrency'",
        )
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        (level == 2.0).then_some(())
    })
    .await;
    app.shutdown().await;
}

/// The queue updates (`: tollgate {…}` comments) in an SSE body, in order.
fn queue_updates(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix(": tollgate "))
        .map(|c| serde_json::from_str(c).unwrap())
        .collect()
}

/// A streaming call that asks for queue updates; the answer's headers are in.
async fn stream_with_updates(app: &TestApp, path: &str, body: &Value) -> reqwest::Response {
    app.http
        .post(app.url(path))
        .bearer_auth(ACME)
        .header("x-tollgate-queue-updates", "true")
        .json(body)
        .send()
        .await
        .unwrap()
}

/// An app whose model allows six requests a minute, all six spent: one more fits every
/// ten seconds.
async fn six_a_minute_spent() -> TestApp {
    let app = TestApp::spawn_with(TestOptions {
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 6\n".into(),
        ..TestOptions::default()
    })
    .await;
    for i in 0..6 {
        let (status, accepted) = app
            .submit(ACME, &job("oai/gpt-4o-mini", &format!("spend {i}")))
            .await;
        assert_eq!(status, 202, "{accepted}");
        let done = app.wait_job(ACME, accepted["id"].as_str().unwrap(), 30).await;
        assert_eq!(done["state"], "succeeded", "{done}");
    }
    app
}

#[tokio::test]
async fn a_waiting_streaming_caller_is_told_its_place_and_eta_then_streams() {
    let app = six_a_minute_spent().await;
    let body = |text: &str| {
        json!({"model": "oai/gpt-4o-mini", "messages": [{"role": "user", "content": text}],
               "max_tokens": 5, "stream": true})
    };
    // Two callers one after the other: the second waits behind the first.
    let first = stream_with_updates(&app, "/v1/chat/completions", &body("first")).await;
    let second = stream_with_updates(&app, "/v1/chat/completions", &body("second")).await;
    for r in [&first, &second] {
        assert_eq!(r.status().as_u16(), 200);
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
    }
    let (first, second) = tokio::join!(first.text(), second.text());
    let (first, second) = (first.unwrap(), second.unwrap());
    let (first_updates, second_updates) = (queue_updates(&first), queue_updates(&second));
    for (body, updates) in [(&first, &first_updates), (&second, &second_updates)] {
        assert!(!updates.is_empty(), "{body}");
        // Every update comes before the stream, which is the one an SDK reads.
        let last_update = body.rfind(": tollgate ").unwrap();
        assert!(last_update < body.find("data:").unwrap(), "{body}");
        let chunks = data_lines(body);
        assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"), "{body}");
        assert!(!content_of(&chunks).is_empty(), "{body}");
        assert!(updates.iter().all(|u| u["state"] == "queued"), "{updates:?}");
        // The gate says which limit holds it, and when it expects it to fit.
        assert!(
            updates
                .iter()
                .any(|u| u["waiting_for"]["bucket"] == "provider:oai:gpt-4o-mini:rpm"
                    && u["waiting_for"]["expected_at"].is_string()),
            "{updates:?}"
        );
    }
    let eta_p50 = |u: &Value| {
        u["eta"]["p50"]
            .as_str()
            .unwrap()
            .parse::<DateTime<Utc>>()
            .unwrap()
    };
    assert_eq!(first_updates[0]["ahead"], 0, "{first_updates:?}");
    assert_eq!(second_updates[0]["ahead"], 1, "{second_updates:?}");
    // The second's forecast counts the first ahead of it: a request's worth later.
    assert!(
        eta_p50(&second_updates[0]) > eta_p50(&first_updates[0]) + chrono::Duration::seconds(5),
        "{first_updates:?} {second_updates:?}"
    );
    assert!(
        first_updates
            .iter()
            .all(|u| eta_p50(u) > Utc::now() - chrono::Duration::seconds(30))
    );
    app.assert_no_provider_429s().await;
    app.shutdown().await;
}

#[tokio::test]
async fn a_streaming_caller_with_updates_is_refused_by_an_error_event_in_its_endpoint_s_shape() {
    // One request a minute; the second call's 5 s cannot reach the next. Anthropic's
    // Messages API, served by an OpenAI model.
    let app = TestApp::spawn_with(TestOptions {
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 1\n".into(),
        server_config: "sync_timeout_secs = 5".into(),
        ..TestOptions::default()
    })
    .await;
    let body = json!({"model": "oai/gpt-4o-mini", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "hi"}]});
    let r = app
        .http
        .post(app.url("/v1/messages"))
        .bearer_auth(ACME)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let r = stream_with_updates(&app, "/v1/messages", &streaming).await;
    assert_eq!(r.status().as_u16(), 200);
    let job_id = r.headers()["x-tollgate-job-id"].to_str().unwrap().to_owned();
    let text = r.text().await.unwrap();
    // Anthropic's error event, as its SDK raises it: named `error`, typed by the refusal.
    let error_at = text.find("event: error").expect(&text);
    let data = data_lines(&text[error_at..]);
    let error: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["error"]["type"], "rate_limit_error", "{error}");
    assert_eq!(error["error"]["code"], "deadline_unmeetable", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("provider:oai:gpt-4o-mini:rpm"),
        "{error}"
    );
    assert_eq!(data.len(), 1, "nothing follows the error: {text}");
    let job = app.wait_job(ACME, &job_id, 10).await;
    assert_eq!(job["error"]["code"], "deadline_unmeetable", "{job}");
    // Responses' error event, and chat's error chunk (no event name, OpenAI's error shape).
    let responses =
        json!({"model": "oai/gpt-4o-mini", "input": "hi", "max_output_tokens": 16, "stream": true});
    let text = stream_with_updates(&app, "/v1/responses", &responses)
        .await
        .text()
        .await
        .unwrap();
    let error_at = text.find("event: error").expect(&text);
    let error: Value = serde_json::from_str(&data_lines(&text[error_at..])[0]).unwrap();
    assert_eq!(
        (&error["type"], &error["code"]),
        (&json!("error"), &json!("deadline_unmeetable")),
        "{error}"
    );
    let chat = json!({"model": "oai/gpt-4o-mini", "max_tokens": 5, "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    let text = stream_with_updates(&app, "/v1/chat/completions", &chat)
        .await
        .text()
        .await
        .unwrap();
    assert!(!text.contains("event:"), "{text}");
    let data = data_lines(&text);
    let error: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(
        (&error["error"]["type"], &error["error"]["code"]),
        (&json!("rate_limit_error"), &json!("deadline_unmeetable")),
        "{error}"
    );
    assert_eq!(data.len(), 1, "nothing follows the error: {text}");
    app.assert_no_provider_429s().await;
    app.shutdown().await;
}

#[tokio::test]
async fn sdks_stream_as_usual_while_queue_updates_arrive() {
    // Each SDK call waits about ten seconds for its turn.
    let app = six_a_minute_spent().await;
    let out = crate::python::run_script(
        "queue_updates.py",
        &[],
        &[("TOLLGATE_BASE_URL", &app.api), ("TOLLGATE_API_KEY", ACME)],
    )
    .await;
    let summary: Value = serde_json::from_str(out.trim()).expect("the script's JSON summary");
    // Both calls waited and then streamed. The second waits for the slot after the first's,
    // ten seconds (so updates, one a second, were sent while it did); the first waits out
    // what is left of the ten seconds the spend began, less the spend and the SDKs' start,
    // which on a loaded machine can be all of it.
    let waited: Vec<(String, f64)> = sqlx::query_as(
        "SELECT endpoint, extract(epoch FROM started_at - created_at)::float8 FROM jobs
         WHERE stream ORDER BY created_at",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(waited.len(), 2, "{waited:?}");
    assert_eq!(waited[0].0, "/v1/chat/completions");
    assert_eq!(waited[1].0, "/v1/messages");
    assert!(waited[1].1 > 1.5, "{waited:?}");
    let (_, chat) = app
        .get(
            ACME,
            &format!("/v1/jobs/{}", summary["chat_job"].as_str().unwrap()),
        )
        .await;
    assert_eq!(chat["state"], "succeeded", "{chat}");
    app.assert_no_provider_429s().await;
    app.shutdown().await;
}
