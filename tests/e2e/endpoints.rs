//! Endpoints beside chat: embeddings synchronous and queued, reserved at their input alone,
//! refused where no target serves them, held under a provider's TPM by three processes;
//! the model list; bare provider model names.

use serde_json::{Value, json};
use tollgate_api::broker::Roles;

use crate::gate::{assert_the_provider_saw_every_job_within_its_limits, flood, wait_all_finished};
use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, mock_config};

/// An `emb` provider (OpenAI kind) serving `text-embedding-3-small` (and
/// `omni-moderation-latest`) from the mock's
/// `oai-embed` project, whose key is `sk-embed`.
const EMBEDDINGS_PROVIDER: &str = r#"
[[providers]]
name = "emb"
kind = "openai"
base_url = "http://MOCK_ADDR/v1"
keys = [{ name = "e1", value = "sk-embed" }]
models = ["text-embedding-3-small", "omni-moderation-latest"]
learn_limits = false
"#;

fn embeddings_mock(tpm: u64) -> tollgate_mock::MockConfig {
    let mut mock = mock_config();
    let mut project = mock.projects[0].clone();
    project.name = "oai-embed".to_owned();
    project.keys = vec!["sk-embed".to_owned()];
    project.revoked_keys = Vec::new();
    project.tpm = tpm;
    mock.projects.push(project);
    mock
}

async fn app_with_embeddings() -> TestApp {
    TestApp::spawn_with(TestOptions {
        mock: embeddings_mock(100_000_000),
        extra_config: EMBEDDINGS_PROVIDER.to_owned(),
        ..TestOptions::default()
    })
    .await
}

/// Runs an official-SDK script from `tests/python/` against the app at `base_url` with
/// acme's key; its JSON summary.
async fn sdk_summary(script: &str, base_url: &str) -> Value {
    let out = crate::python::run_script(
        script,
        &[],
        &[("TOLLGATE_BASE_URL", base_url), ("TOLLGATE_API_KEY", ACME)],
    )
    .await;
    serde_json::from_str(out.trim()).expect("the script's JSON summary")
}

/// The tenant's batch `id` completed, its lines calling `endpoint`.
async fn assert_batch_completed(app: &TestApp, id: &Value, endpoint: &str) {
    let (_, batch) = app
        .get(ACME, &format!("/v1/batches/{}", id.as_str().unwrap()))
        .await;
    assert_eq!(
        (batch["endpoint"].as_str(), batch["status"].as_str()),
        (Some(endpoint), Some("completed")),
        "{batch}"
    );
}

async fn post_raw(app: &TestApp, key: &str, path: &str, body: &Value) -> reqwest::Response {
    app.http
        .post(app.url(path))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn embeddings_are_queued_reserved_at_their_input_and_answered_in_openai_shape() {
    let app = app_with_embeddings().await;
    // Synchronous, by the bare model name a provider lists.
    let body = json!({"model": "text-embedding-3-small", "input": ["abcdefgh", "abcd"], "encoding_format": "float", "dimensions": 4});
    let answer = post_raw(&app, ACME, "/v1/embeddings", &body).await;
    assert_eq!(answer.status(), 200);
    let job_id = answer.headers()["x-tollgate-job-id"].to_str().unwrap().to_owned();
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["object"], "list");
    let data = answer["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[1]["index"], 1);
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), 4);
    // The mock counts a token per started four characters: 2 + 1.
    assert_eq!(answer["usage"]["prompt_tokens"], 3);

    let (_, job) = app.get(ACME, &format!("/v1/jobs/{job_id}")).await;
    assert_eq!(job["endpoint"], "/v1/embeddings");
    assert_eq!(job["class"], "interactive");
    assert_eq!(
        (job["provider"].as_str(), job["provider_model"].as_str()),
        (Some("emb"), Some("text-embedding-3-small"))
    );
    assert_eq!(
        job["estimate"]["output_tokens"], 0,
        "embeddings reserve no output"
    );
    assert!(job["estimate"]["input_tokens"].as_i64().unwrap() >= 3);
    assert_eq!(job["usage"]["input_tokens"], 3);
    assert_eq!(job["usage"]["output_tokens"], 0);

    // Queued through /v1/jobs with its endpoint; the mock charged its TPM the input alone.
    let before = app.mock.stats().projects["oai-embed"].clone();
    let queued = json!({"endpoint": "/v1/embeddings", "request": {"model": "emb/text-embedding-3-small", "input": "x".repeat(40)}});
    let done = app.run_job(ACME, &queued, 30).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["endpoint"], "/v1/embeddings");
    assert_eq!(done["result"]["data"][0]["object"], "embedding");
    let after = app.mock.stats().projects["oai-embed"].clone();
    assert_eq!(after.requests_admitted - before.requests_admitted, 1);
    assert_eq!(after.input_tokens_admitted - before.input_tokens_admitted, 10);
    assert_eq!(after.output_tokens_admitted, before.output_tokens_admitted);

    // A moderation reserves a request and no tokens, and reports none.
    let before = app.mock.stats().projects["oai-embed"].clone();
    let answer = post_raw(
        &app,
        ACME,
        "/v1/moderations",
        &json!({"model": "omni-moderation-latest", "input": ["a", "b"]}),
    )
    .await;
    assert_eq!(answer.status(), 200);
    let job_id = answer.headers()["x-tollgate-job-id"].to_str().unwrap().to_owned();
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["results"].as_array().unwrap().len(), 2, "{answer}");
    let (_, job) = app.get(ACME, &format!("/v1/jobs/{job_id}")).await;
    assert_eq!(job["endpoint"], "/v1/moderations");
    assert_eq!(job["estimate"], json!({"input_tokens": 0, "output_tokens": 0}));
    assert_eq!(
        (
            job["usage"]["input_tokens"].as_i64(),
            job["usage"]["output_tokens"].as_i64()
        ),
        (Some(0), Some(0))
    );
    let after = app.mock.stats().projects["oai-embed"].clone();
    assert_eq!(after.requests_admitted - before.requests_admitted, 1);
    assert_eq!(after.input_tokens_admitted, before.input_tokens_admitted);
    let (status, refused) = app
        .post(
            ACME,
            "/v1/moderations",
            &json!({"model": "ant/claude-3-5-haiku-latest", "input": "x"}),
        )
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (400, Some("endpoint_not_served"))
    );

    // Chat jobs are what they were: no endpoint is chat.
    let chat = app.run_job(GLOBEX, &crate::harness::job("fast", "hi"), 30).await;
    assert_eq!(chat["endpoint"], "/v1/chat/completions");
    assert_eq!(chat["state"], "succeeded");
    app.shutdown().await;
}

#[tokio::test]
async fn an_endpoint_no_target_serves_is_refused_up_front_naming_the_model() {
    let app = app_with_embeddings().await;
    let refused = |status: u16, code: &str, param: &str, answer: &Value| {
        assert_eq!(
            (
                status,
                answer["error"]["code"].as_str(),
                answer["error"]["param"].as_str()
            ),
            (400, Some(code), Some(param)),
            "{answer}"
        );
    };
    // Anthropic has no embeddings API.
    let to_anthropic = json!({"model": "ant/claude-3-5-haiku-latest", "input": "hello"});
    let (status, answer) = app.post(ACME, "/v1/embeddings", &to_anthropic).await;
    refused(status, "endpoint_not_served", "model", &answer);
    let (status, answer) = app
        .submit(
            ACME,
            &json!({"endpoint": "/v1/embeddings", "request": to_anthropic}),
        )
        .await;
    refused(status, "endpoint_not_served", "request.model", &answer);
    // An embedding model is no chat model of a route, and an embeddings body no chat body.
    let (status, answer) = app
        .post(
            ACME,
            "/v1/embeddings",
            &json!({"model": "text-embedding-3-small", "input": []}),
        )
        .await;
    refused(status, "invalid_request", "input", &answer);
    let (status, answer) = app
        .submit(
            ACME,
            &json!({"endpoint": "/v1/embeddings", "request": {"model": "fast", "messages": []}}),
        )
        .await;
    refused(status, "missing_field", "request.input", &answer);
    let (status, answer) = app
        .post(ACME, "/v1/embeddings", &json!({"model": "nope", "input": "x"}))
        .await;
    refused(status, "unknown_model", "model", &answer);
    let (status, answer) = app
        .submit(
            ACME,
            &json!({"endpoint": "/v1/audio/speech", "request": {"model": "fast"}}),
        )
        .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (400, Some("invalid_request")),
        "{answer}"
    );
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/embeddings"),
        "{answer}"
    );
    let stats = app.mock.stats();
    assert_eq!(stats.requests, 0, "nothing refused reached the provider");
    app.shutdown().await;
}

#[tokio::test]
async fn the_model_list_names_every_alias_provider_model_and_bare_model_with_what_it_serves() {
    let app = app_with_embeddings().await;
    let (status, list) = app.get(ACME, "/v1/models").await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["object"], "list");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            "fast",
            "ant/claude-3-5-haiku-latest",
            "oai/gpt-4o-mini",
            "emb/text-embedding-3-small",
            "emb/omni-moderation-latest",
            "claude-3-5-haiku-latest",
            "gpt-4o-mini",
            "text-embedding-3-small",
            "omni-moderation-latest",
        ]
    );
    let (status, fast) = app.get(ACME, "/v1/models/fast").await;
    assert_eq!(status, 200);
    assert_eq!(
        fast,
        json!({"id": "fast", "object": "model", "created": 0, "owned_by": "tollgate",
               "endpoints": ["/v1/chat/completions", "/v1/embeddings", "/v1/moderations", "/v1/responses", "/v1/messages",
                             "/v1/completions"],
               "targets": ["oai/gpt-4o-mini"]})
    );
    let (_, claude) = app.get(ACME, "/v1/models/ant/claude-3-5-haiku-latest").await;
    assert_eq!(claude["owned_by"], "ant");
    assert_eq!(
        claude["endpoints"],
        json!(["/v1/chat/completions", "/v1/responses", "/v1/messages"]),
        "Responses reach Claude as chat"
    );
    let (_, encoded) = app.get(ACME, "/v1/models/emb%2Ftext-embedding-3-small").await;
    assert_eq!(encoded["id"], "emb/text-embedding-3-small");
    let (status, missing) = app.get(ACME, "/v1/models/gpt-5").await;
    assert_eq!(
        (status, missing["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let anonymous = app.http.get(app.url("/v1/models")).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);

    // A bare provider model name runs unchanged.
    let done = app
        .run_job(ACME, &crate::harness::job("gpt-4o-mini", "bare"), 30)
        .await;
    assert_eq!(
        (done["state"].as_str(), done["provider"].as_str()),
        (Some("succeeded"), Some("oai"))
    );
    app.shutdown().await;
}

/// `JOBS` jobs made by `body`, queued at a process that only serves the API, then drained
/// by three processes with every role against the mock's `oai-embed` project allowing
/// `TPM` tokens a minute (and the broker configured with it): every job answered, no
/// provider 429, no limit passed. The app is returned for the test's own checks.
async fn drained_by_three_processes_under_tpm(
    tpm: u64,
    jobs: usize,
    body: impl Fn(usize) -> Value,
) -> TestApp {
    let app = TestApp::spawn_with(TestOptions {
        mock: embeddings_mock(tpm),
        extra_config: format!(
            "{}[providers.limits.\"text-embedding-3-small\"]\ntpm = {tpm}\n",
            EMBEDDINGS_PROVIDER.replace("learn_limits = false", "learn_limits = true")
        ),
        gate_config: "interactive_reserve = 0.0".into(),
        roles: Roles::API_ONLY,
        peers: 3,
        ..TestOptions::default()
    })
    .await;
    let apis = vec![app.api.clone()];
    assert_eq!(flood(&app, &apis, ACME, jobs, body).await, jobs);
    let peers = [
        app.spawn_peer(Roles::ALL).await,
        app.spawn_peer(Roles::ALL).await,
        app.spawn_peer(Roles::ALL).await,
    ];
    wait_all_finished(&app, jobs as i64, 120).await;
    assert_the_provider_saw_every_job_within_its_limits(&app, jobs, u64::MAX).await;
    for peer in peers {
        peer.shutdown().await;
    }
    app
}

#[tokio::test]
async fn three_processes_hold_embeddings_under_the_providers_tpm() {
    // 160 jobs of 500 tokens: 80k tokens against 60k a minute, so a third of them wait for
    // the bucket to refill.
    let app = drained_by_three_processes_under_tpm(60_000, 160, |_| {
        // 2,000 characters: 500 tokens by the mock's count and the broker's (" the" is
        // one token in cl100k).
        let text = "the ".repeat(500);
        json!({"endpoint": "/v1/embeddings", "request": {"model": "emb/text-embedding-3-small", "input": [text]}})
    })
    .await;
    let project = app.mock.stats().projects["oai-embed"].clone();
    assert_eq!(project.input_tokens_admitted, 500 * 160);
    assert_eq!(project.output_tokens_admitted, 0);
    app.shutdown().await;
}

#[tokio::test]
async fn three_processes_hold_responses_under_the_providers_tpm() {
    // 160 responses charged 500 tokens each at their start (250 of input, 250 of
    // max_output_tokens, as OpenAI counts them): 80k tokens against 60k a minute.
    let app = drained_by_three_processes_under_tpm(60_000, 160, |_| {
        // 3 + (4 + 243) tokens of input by the mock's count and the broker's character
        // rule (" the" is one token in cl100k, so the BPE count is no larger).
        let text = "the ".repeat(243);
        json!({"endpoint": "/v1/responses", "request": {"model": "emb/text-embedding-3-small",
               "input": text.trim_end(), "max_output_tokens": 250}})
    })
    .await;
    let project = app.mock.stats().projects["oai-embed"].clone();
    assert_eq!(
        (project.requests_admitted, project.input_tokens_admitted),
        (160, 250 * 160)
    );
    app.shutdown().await;
}

#[tokio::test]
async fn openai_python_sdk_embeds_lists_models_and_batches_embeddings() {
    let app = app_with_embeddings().await;
    let summary = sdk_summary("openai_endpoints.py", &app.url("/v1")).await;
    let (_, job) = app
        .get(ACME, &format!("/v1/jobs/{}", summary["job"].as_str().unwrap()))
        .await;
    assert_eq!(
        (job["endpoint"].as_str(), job["state"].as_str()),
        (Some("/v1/embeddings"), Some("succeeded"))
    );
    assert_batch_completed(&app, &summary["batch"], "/v1/embeddings").await;
    app.shutdown().await;
}

#[tokio::test]
async fn anthropic_python_sdk_sends_and_streams_messages_through_the_queue() {
    let app = TestApp::spawn().await;
    let summary = sdk_summary("anthropic_messages.py", &app.api).await;
    let (_, job) = app
        .get(ACME, &format!("/v1/jobs/{}", summary["job"].as_str().unwrap()))
        .await;
    assert_eq!(job["endpoint"], "/v1/messages");
    assert_eq!(job["state"], "succeeded");
    assert_eq!(job["provider"], "ant");
    assert_eq!(
        job["estimate"]["output_tokens"], 32,
        "a Messages job reserves its max_tokens"
    );
    assert_eq!(
        job["result"]["id"], summary["message"],
        "the message as Anthropic sent it"
    );
    assert_eq!(job["result"]["type"], "message");
    // The messages (plain and streamed), the tool calls (plain and streamed) and the
    // answer reached the provider; nothing refused did.
    let stats = app.mock.stats();
    assert_eq!((stats.succeeded, stats.requests), (5, 5), "{stats:?}");
    // A streamed call is stored as the message its events make.
    let (_, jobs) = app.get(ACME, "/v1/jobs?limit=100").await;
    let calls: Vec<&Value> = jobs["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["result"]["stop_reason"] == "tool_use")
        .collect();
    assert_eq!(calls.len(), 2, "{jobs}");
    for call in calls {
        assert_eq!(
            call["result"]["content"][0]["input"],
            json!({"city": "mock"}),
            "{call}"
        );
        assert_eq!(call["result"]["type"], "message");
    }
    app.shutdown().await;
}

#[tokio::test]
async fn openai_python_sdk_drives_legacy_completions() {
    let app = TestApp::spawn().await;
    let summary = sdk_summary("openai_completions.py", &app.url("/v1")).await;
    let job = |key: &str| {
        let id = summary[key].as_str().unwrap().to_owned();
        let app = &app;
        async move { app.get(ACME, &format!("/v1/jobs/{id}")).await.1 }
    };
    let plain = job("job").await;
    assert_eq!(
        (
            plain["endpoint"].as_str(),
            plain["state"].as_str(),
            plain["provider"].as_str()
        ),
        (Some("/v1/completions"), Some("succeeded"), Some("oai")),
        "{plain}"
    );
    assert_eq!(plain["estimate"]["output_tokens"], 8, "its max_tokens");
    let several = job("several").await;
    assert_eq!(
        several["estimate"]["output_tokens"], 20,
        "5 tokens for each of the 2 choices of each of the 2 prompts"
    );
    assert_batch_completed(&app, &summary["batch"], "/v1/completions").await;
    // What the mock charged for the multi-prompt request is what tollgate reserved.
    assert_eq!(several["usage"]["output_tokens"], 20, "{several}");
    app.shutdown().await;
}

#[tokio::test]
async fn anthropic_sdk_reaches_an_openai_model_and_its_tools() {
    let app = TestApp::spawn().await;
    let summary = sdk_summary("anthropic_to_openai.py", &app.api).await;
    let (_, job) = app
        .get(ACME, &format!("/v1/jobs/{}", summary["job"].as_str().unwrap()))
        .await;
    assert_eq!(
        (
            job["endpoint"].as_str(),
            job["provider"].as_str(),
            job["state"].as_str()
        ),
        (Some("/v1/messages"), Some("oai"), Some("succeeded")),
        "{job}"
    );
    assert_eq!(
        job["result"]["type"], "message",
        "stored as the message the client got"
    );
    assert_eq!(job["result"]["id"], summary["message"]);
    // Every call went to OpenAI as chat (the mock checked each tool turn and answered the
    // JSON schema), none to Anthropic; the refused ones went nowhere.
    let stats = app.mock.stats();
    assert_eq!(stats.projects["oai-test"].requests_admitted, 8, "{stats:?}");
    assert_eq!(stats.projects["ant-test"].requests_admitted, 0, "{stats:?}");
    assert_eq!((stats.succeeded, stats.requests), (8, 8), "{stats:?}");
    app.shutdown().await;
}

#[tokio::test]
async fn anthropic_python_sdk_drives_message_batches() {
    // "slow-claude": a route limited to one request a minute, so a batch on it can be
    // cancelled while it runs.
    let app = TestApp::spawn_with(TestOptions {
        extra_config: r#"
[[routes]]
alias = "slow-claude"
targets = ["ant/claude-3-5-haiku-latest"]
limits = { rpm = 1 }
[[routes]]
alias = "held-claude"
targets = ["ant/claude-3-5-haiku-latest"]
limits = { rpm = 1 }
"#
        .to_owned(),
        ..TestOptions::default()
    })
    .await;
    // Refused whole, with the reason and the request it is about.
    let slow = |custom_id: &str| {
        json!({"custom_id": custom_id, "params": {"model": "held-claude", "max_tokens": 8,
               "messages": [{"role": "user", "content": "hi"}]}})
    };
    for (body, param) in [
        (json!({"requests": []}), "requests"),
        (
            json!({"requests": [slow("ok"), slow(&"x".repeat(65))]}),
            "requests.1.custom_id",
        ),
        (
            json!({"requests": [slow("ok"), slow("ok")]}),
            "requests.1.custom_id",
        ),
        (json!({"requests": [slow("a b")]}), "requests.0.custom_id"),
        (json!({"requests": [{"custom_id": "p"}]}), "requests.0.params"),
    ] {
        let (status, error) = app.post(ACME, "/v1/messages/batches", &body).await;
        assert_eq!(
            (status, error["type"].as_str(), error["error"]["param"].as_str()),
            (400, Some("error"), Some(param)),
            "{error}"
        );
    }
    // A batch still running has no results and cannot be deleted yet.
    let (status, running) = app
        .post(
            ACME,
            "/v1/messages/batches",
            &json!({"requests": [slow("r1"), slow("r2")]}),
        )
        .await;
    assert_eq!(status, 200, "{running}");
    let id = running["id"].as_str().unwrap().to_owned();
    for (status, error) in [
        app.get(ACME, &format!("/v1/messages/batches/{id}/results")).await,
        app.delete(ACME, &format!("/v1/messages/batches/{id}")).await,
    ] {
        assert_eq!(
            (status, error["error"]["code"].as_str()),
            (409, Some("batch_not_finished")),
            "{error}"
        );
    }
    let (status, _) = app
        .post(ACME, &format!("/v1/messages/batches/{id}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 200);
    let summary = sdk_summary("anthropic_batches.py", &app.api).await;
    // The deleted batch is gone from both APIs; the cancelled one is a batch of Messages
    // jobs, to the Anthropic provider.
    let deleted = summary["batch"].as_str().unwrap();
    let (status, _) = app.get(ACME, &format!("/v1/batches/{deleted}")).await;
    assert_eq!(status, 404);
    let canceled = summary["canceled"].as_str().unwrap();
    let (_, batch) = app.get(ACME, &format!("/v1/batches/{canceled}")).await;
    assert_eq!(
        (
            batch["endpoint"].as_str(),
            batch["status"].as_str(),
            batch["input_file_id"].is_null()
        ),
        (Some("/v1/messages"), Some("cancelled"), true),
        "{batch}"
    );
    // Another tenant sees none of them.
    let (status, _) = app.get(GLOBEX, &format!("/v1/messages/batches/{canceled}")).await;
    assert_eq!(status, 404);
    let (_, listed) = app.get(GLOBEX, "/v1/messages/batches").await;
    assert_eq!(listed["data"], json!([]));
    // Only jobs that were started reached the provider: no refused request, no cancelled
    // job that had not started. A started job of the cancelled batch may have been stopped
    // before its request left (so at most `started`), and every succeeded job was one call.
    let (_, jobs) = app.get(ACME, "/v1/jobs?limit=100").await;
    let jobs = jobs["data"].as_array().unwrap();
    let started = jobs.iter().filter(|j| !j["started_at"].is_null()).count() as u64;
    let succeeded = jobs.iter().filter(|j| j["state"] == "succeeded").count() as u64;
    let stats = app.mock.stats();
    assert!(
        (succeeded..=started).contains(&stats.requests),
        "provider calls between {succeeded} succeeded and {started} started jobs: {stats:?}"
    );
    assert!(
        succeeded >= 2,
        "the first batch's two good requests ran: {stats:?}"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn openai_python_sdk_drives_responses() {
    let app = TestApp::spawn().await;
    let summary = sdk_summary("openai_responses.py", &app.url("/v1")).await;
    let (_, job) = app
        .get(ACME, &format!("/v1/jobs/{}", summary["job"].as_str().unwrap()))
        .await;
    assert_eq!(
        (job["endpoint"].as_str(), job["state"].as_str()),
        (Some("/v1/responses"), Some("succeeded"))
    );
    assert_eq!(
        job["estimate"]["output_tokens"], 32,
        "a response reserves its max_output_tokens"
    );
    assert_eq!(
        job["usage"]["input_tokens"],
        job["result"]["usage"]["input_tokens"]
    );
    // Streamed calls are stored as the response their last event carries.
    let (_, jobs) = app.get(ACME, "/v1/jobs?limit=100").await;
    let calls = jobs["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["result"]["output"][0]["type"] == "function_call")
        .count();
    assert_eq!(calls, 4, "two per model: {jobs}");
    // The Claude model's job is a Responses job served by Anthropic, its result a response.
    let (_, job) = app
        .get(
            ACME,
            &format!("/v1/jobs/{}", summary["anthropic_job"].as_str().unwrap()),
        )
        .await;
    assert_eq!(
        (job["endpoint"].as_str(), job["provider"].as_str()),
        (Some("/v1/responses"), Some("ant")),
        "{job}"
    );
    assert_eq!(job["result"]["object"], "response", "{job}");
    assert_eq!(
        job["usage"]["output_tokens"],
        job["result"]["usage"]["output_tokens"]
    );
    assert_batch_completed(&app, &summary["batch"], "/v1/responses").await;
    app.shutdown().await;
}
