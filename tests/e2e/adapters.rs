//! The Gemini and Azure OpenAI adapters end to end: jobs routed to a `gemini` and an
//! `azure` provider on the mock come back in OpenAI chat format with the usage the mock
//! reported; Azure streams like OpenAI, Gemini through `streamGenerateContent`; a
//! Gemini 429 (`QuotaFailure` + `RetryInfo`, no headers) teaches the RPM limit. A
//! tool-calling conversation from the `openai` SDK to an Anthropic model, plain and
//! streamed; what Anthropic or Gemini cannot express refused up front, naming the field.

use serde_json::{Value, json};
use tollgate_mock::{MockConfig, ProviderKind};

use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, eventually, mock_config, mock_project};

/// The harness's projects plus a Gemini and an Azure one.
fn mock(gemini_rpm: u64) -> MockConfig {
    let mut m = mock_config();
    m.projects.push(mock_project(
        "gem-test",
        ProviderKind::Gemini,
        &["g-test"],
        &["gemini-2.0-flash"],
        gemini_rpm,
    ));
    m.projects.push(mock_project(
        "az-test",
        ProviderKind::Azure,
        &["az-test"],
        &["gpt-4o-deploy"],
        100_000,
    ));
    m
}

fn providers(learn: bool) -> String {
    format!(
        r#"
[[providers]]
name = "gem"
kind = "gemini"
base_url = "http://MOCK_ADDR"
keys = [{{ name = "g1", value = "g-test" }}]
models = ["gemini-2.0-flash"]
learn_limits = {learn}
[[providers]]
name = "az"
kind = "azure"
base_url = "http://MOCK_ADDR"
azure_api_version = "2024-10-21"
keys = [{{ name = "z1", value = "az-test" }}]
models = ["gpt-4o-deploy"]
learn_limits = false
"#
    )
}

pub(crate) fn chat(model: &str) -> Value {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello world!"}
        ],
        "max_tokens": 32
    })
}

async fn run(app: &TestApp, model: &str) -> Value {
    app.run_job(GLOBEX, &json!({"request": chat(model)}), 30).await
}

#[tokio::test]
async fn gemini_and_azure_jobs_come_back_in_openai_format_with_usage() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(100_000),
        extra_config: providers(false),
        ..TestOptions::default()
    })
    .await;

    let done = run(&app, "gem/gemini-2.0-flash").await;
    assert_eq!(
        (done["provider"].as_str(), done["provider_model"].as_str()),
        (Some("gem"), Some("gemini-2.0-flash"))
    );
    let result = &done["result"];
    assert_eq!(result["object"], "chat.completion");
    assert_eq!(result["model"], "gemini-2.0-flash");
    assert_eq!(result["choices"][0]["message"]["role"], "assistant");
    let text = result["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.split(' ').count(), 12, "{text}");
    assert_eq!(result["choices"][0]["finish_reason"], "stop");
    // The mock counted the system instruction as a message: 3 + (4 + 3) + (4 + 2) = 16.
    assert_eq!(result["usage"]["prompt_tokens"], 16);
    assert_eq!(result["usage"]["total_tokens"], 28);
    assert_eq!(done["usage"]["input_tokens"], 16);
    assert_eq!(done["usage"]["output_tokens"], 12);

    let done = run(&app, "az/gpt-4o-deploy").await;
    assert_eq!(done["provider"], "az");
    let result = &done["result"];
    assert_eq!(result["object"], "chat.completion");
    assert_eq!(result["model"], "gpt-4o-deploy");
    assert!(result["id"].as_str().unwrap().starts_with("chatcmpl-"));
    // System and user both count as messages on the OpenAI shape: 3 + 6 + 7 = 16.
    assert_eq!(done["usage"]["input_tokens"], 16);
    assert_eq!(done["usage"]["output_tokens"], 12);
    assert!(
        done["provider_request_id"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{done}"
    );

    let stats = app.mock.stats();
    assert_eq!(stats.projects["gem-test"].requests_admitted, 1);
    assert_eq!(stats.projects["az-test"].requests_admitted, 1);
    assert_eq!(
        stats.unauthorized + stats.bad_request + stats.not_found,
        0,
        "{stats:?}"
    );
    app.shutdown().await;
}

/// A streamed chat call (three tokens, the usage asked for) as tenant acme: its content
/// and usage chunk.
pub(crate) async fn stream(app: &TestApp, model: &str) -> (String, Value) {
    let mut body = chat(model);
    body["stream"] = json!(true);
    body["max_tokens"] = json!(3);
    body["stream_options"] = json!({"include_usage": true});
    let resp = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(ACME)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{model}");
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{model}: {text}");
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str(d.trim()).ok())
        .collect();
    let content = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let usage = chunks
        .iter()
        .find(|c| c["usage"].is_object())
        .map(|c| c["usage"].clone())
        .unwrap_or_else(|| panic!("{model}: no usage chunk in {text}"));
    (content, usage)
}

#[tokio::test]
async fn azure_and_gemini_stream_in_openai_chunks() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(100_000),
        extra_config: providers(false),
        ..TestOptions::default()
    })
    .await;
    for model in ["az/gpt-4o-deploy", "gem/gemini-2.0-flash"] {
        let (content, usage) = stream(&app, model).await;
        assert_eq!(content, "lorem ipsum dolor", "{model}");
        assert_eq!(
            (
                usage["prompt_tokens"].as_i64(),
                usage["completion_tokens"].as_i64()
            ),
            (Some(16), Some(3)),
            "{model}"
        );
    }
    let stats = app.mock.stats();
    assert_eq!(stats.streams_completed, 2, "{stats:?}");
    assert_eq!(stats.projects["gem-test"].requests_admitted, 1);
    // The job settled with what Gemini's last event reported.
    let (status, jobs) = app.get(ACME, "/v1/jobs?limit=5").await;
    assert_eq!(status, 200, "{jobs}");
    let gemini = jobs["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["provider"] == "gem")
        .unwrap_or_else(|| panic!("{jobs}"))
        .clone();
    assert_eq!(gemini["state"], "succeeded", "{gemini}");
    assert_eq!(
        (
            gemini["usage"]["input_tokens"].as_i64(),
            gemini["usage"]["output_tokens"].as_i64()
        ),
        (Some(16), Some(3))
    );
    app.shutdown().await;
}

#[tokio::test]
async fn a_gemini_429_body_teaches_the_rpm_limit() {
    const RPM: u64 = 3;
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(RPM),
        extra_config: providers(true),
        ..TestOptions::default()
    })
    .await;
    for i in 0..8 {
        let mut body = json!({"request": chat("gem/gemini-2.0-flash")});
        body["request"]["messages"][1]["content"] = json!(format!("job {i}"));
        let (status, accepted) = app.submit(ACME, &body).await;
        assert_eq!(status, 202, "{accepted}");
    }
    let rpm = eventually(30, "a learned gemini rpm bucket", || async {
        let (status, body) = app.get(ACME, "/v1/limits").await;
        assert_eq!(status, 200, "{body}");
        body["data"]
            .as_array()?
            .iter()
            .find(|b| b["bucket"] == "provider:gem:gemini-2.0-flash:rpm")
            .cloned()
    })
    .await;
    assert_eq!(rpm["source"], "learned", "{rpm}");
    assert_eq!(rpm["capacity"], RPM as f64, "{rpm}");
    let stats = app.mock.stats();
    assert!(stats.projects["gem-test"].rate_limited_429 >= 1, "{stats:?}");
    // The 429 was classified as capacity: the job that met it waits to retry, it did not fail.
    let (failed,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs WHERE state = 'failed'")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(failed, 0);
    app.shutdown().await;
}

#[tokio::test]
async fn openai_sdk_tool_calls_reach_anthropic_and_come_back() {
    let app = TestApp::spawn().await;
    let base_url = app.url("/v1");
    let out = crate::python::run_script(
        "openai_tools.py",
        &[],
        &[("TOLLGATE_BASE_URL", &base_url), ("TOLLGATE_API_KEY", ACME)],
    )
    .await;
    let summary: Value = serde_json::from_str(out.trim()).expect("the script's JSON summary");
    assert!(
        summary["call"].as_str().unwrap().starts_with("toolu_"),
        "{summary}"
    );
    // Six requests reached the provider (the refused ones never did): the call, the
    // streamed call, the answer, the two structured answers, and the stray tool result it
    // refused.
    let stats = app.mock.stats();
    assert_eq!((stats.succeeded, stats.bad_request), (5, 1), "{stats:?}");
    // Both calls are stored with their tool call, the streamed one put back together.
    let (_, jobs) = app.get(ACME, "/v1/jobs?limit=100").await;
    let calls: Vec<&Value> = jobs["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|j| j["result"]["choices"][0]["message"]["tool_calls"].get(0))
        .collect();
    assert_eq!(calls.len(), 2, "{jobs}");
    for call in calls {
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(call["function"]["arguments"], r#"{"city":"mock"}"#);
    }
    app.shutdown().await;
}

#[tokio::test]
async fn what_gemini_cannot_express_is_refused_naming_the_field() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(1000),
        extra_config: providers(false),
        ..TestOptions::default()
    })
    .await;
    let user = json!({"role": "user", "content": "hi"});
    for (extra, param) in [
        (json!({"n": 3}), "request.n"),
        (
            json!({"parallel_tool_calls": false}),
            "request.parallel_tool_calls",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}),
            "request.messages[0].content[0].image_url.url",
        ),
        (
            json!({"messages": [user, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}),
            "request.messages[1].tool_call_id",
        ),
    ] {
        let mut request = json!({"model": "gem/gemini-2.0-flash", "messages": [user]});
        for (k, v) in extra.as_object().unwrap() {
            request[k] = v.clone();
        }
        let (status, answer) = app.submit(ACME, &json!({"request": request})).await;
        assert_eq!(
            (
                status,
                answer["error"]["code"].as_str(),
                answer["error"]["param"].as_str()
            ),
            (400, Some("unsupported_field"), Some(param)),
            "{answer}"
        );
    }
    // What it can express still runs: JSON output, a seed.
    let request = json!({"model": "gem/gemini-2.0-flash", "messages": [user], "seed": 7,
        "response_format": {"type": "json_object"}});
    let done = app.run_job(GLOBEX, &json!({"request": request}), 30).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(app.mock.stats().requests, 1);
    app.shutdown().await;
}

#[tokio::test]
async fn a_tool_conversation_reaches_gemini_and_comes_back() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(1000),
        extra_config: providers(false),
        ..TestOptions::default()
    })
    .await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let pixel =
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";
    let question = json!([{"role": "user", "content": [{"type": "text", "text": "Weather where this was taken?"},
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{pixel}")}}]}]);
    let ask = |messages: &Value| {
        json!({"model": "gem/gemini-2.0-flash", "messages": messages, "tools": tools,
               "tool_choice": "required", "max_tokens": 64})
    };
    let (status, called) = app.post(ACME, "/v1/chat/completions", &ask(&question)).await;
    assert_eq!(status, 200, "{called}");
    let choice = &called["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{called}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], r#"{"city":"mock"}"#);
    // The result goes back as a function response; the model answers in text.
    let mut answered = question.as_array().unwrap().clone();
    answered.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
    answered.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "sunny"}));
    let (status, answer) = app
        .post(ACME, "/v1/chat/completions", &ask(&Value::Array(answered)))
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    );
    // A JSON schema answer is asked with the schema.
    let structured = json!({"model": "gem/gemini-2.0-flash", "messages": question, "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}});
    let (status, done) = app.post(ACME, "/v1/chat/completions", &structured).await;
    assert_eq!(status, 200, "{done}");
    let stats = app.mock.stats();
    assert_eq!((stats.succeeded, stats.bad_request), (3, 0), "{stats:?}");
    app.shutdown().await;
}
