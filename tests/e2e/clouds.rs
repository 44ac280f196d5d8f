//! The enterprise clouds end to end against the mock: AWS Bedrock (Converse and
//! ConverseStream, every request SigV4-signed and the signature checked by the mock) and
//! Google Vertex AI (Gemini and Claude models, plain and streamed, each call with a token
//! the service account's signed JWT was exchanged for). Each provider's first key is
//! wrong (a secret that signs wrong; an account the token endpoint does not know) and
//! weighs the most, so the first call meets it: the call fails as the key's fault, the key
//! is set aside, and the job is served by the next key. Throttles of both are learned from.

use serde_json::{Value, json};
use tollgate_mock::{MockConfig, ProviderKind};

use crate::adapters::{chat, stream};
use crate::harness::{ACME, TestApp, TestOptions, eventually, mock_config, mock_project};

const CLAUDE_ON_BEDROCK: &str = "us.anthropic.claude-3-5-haiku-20241022-v1:0";
const SERVICE_ACCOUNT: &str = include_str!("../fixtures/vertex-test-service-account.json");
const PUBLIC_KEY: &str = include_str!("../fixtures/vertex-test-public.pem");

/// The harness's projects, a Bedrock account and a Vertex project (`tollgate-test`, the
/// fixture's service account).
fn mock(rpm: u64) -> MockConfig {
    let mut m = mock_config();
    m.projects.push(mock_project(
        "bedrock-test",
        ProviderKind::Bedrock,
        &["AKIDTOLLGATETEST:right-secret"],
        &[CLAUDE_ON_BEDROCK],
        rpm,
    ));
    let mut vertex = mock_project(
        "tollgate-test",
        ProviderKind::Vertex,
        &["tollgate-test@tollgate-test.iam.gserviceaccount.com"],
        &["gemini-2.0-flash", "claude-sonnet-4@20250514"],
        rpm,
    );
    vertex.public_key = Some(PUBLIC_KEY.to_owned());
    m.projects.push(vertex);
    m
}

/// A Bedrock provider whose first key signs with the wrong secret (its second holds
/// temporary credentials: the session token goes signed), and a Vertex provider
/// whose first key is an account the mock does not know, then the fixture's service
/// account (its `token_uri` the mock's). The wrong keys weigh the most: the gate's
/// rotation offers them first.
fn providers(learn: bool) -> String {
    let account = SERVICE_ACCOUNT.trim();
    format!(
        r#"
[[providers]]
name = "bed"
kind = "bedrock"
region = "us-east-1"
base_url = "http://MOCK_ADDR"
keys = [
  {{ name = "stale", access_key_id = "AKIDTOLLGATETEST", secret_access_key = "wrong-secret", weight = 1000 }},
  {{ name = "current", access_key_id = "AKIDTOLLGATETEST", secret_access_key = "right-secret", session_token = "FwoGZXIvYXdzEXAMPLE" }},
]
models = ["{CLAUDE_ON_BEDROCK}"]
learn_limits = {learn}
[[providers]]
name = "vx"
kind = "vertex"
project = "tollgate-test"
location = "us-central1"
base_url = "http://MOCK_ADDR"
keys = [
  {{ name = "stranger", value = '''{stranger}''', weight = 1000 }},
  {{ name = "sa", value = '''{account}''' }},
]
models = ["gemini-2.0-flash", "claude-sonnet-4@20250514"]
learn_limits = {learn}
"#,
        stranger = account.replace("tollgate-test@", "stranger@"),
    )
}

async fn run(app: &TestApp, model: &str) -> Value {
    app.run_job(ACME, &json!({"request": chat(model)}), 30).await
}

#[tokio::test]
async fn bedrock_answers_plain_and_streamed_signed_with_sigv4() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(100_000),
        extra_config: providers(false),
        ..TestOptions::default()
    })
    .await;
    let model = format!("bed/{CLAUDE_ON_BEDROCK}");
    for first in [true, false] {
        let done = run(&app, &model).await;
        assert_eq!(done["state"], "succeeded", "{done}");
        let result = &done["result"];
        assert_eq!(result["object"], "chat.completion");
        assert_eq!(result["model"], CLAUDE_ON_BEDROCK);
        assert_eq!(result["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            result["choices"][0]["message"]["content"]
                .as_str()
                .map(|t| t.split(' ').count()),
            Some(12)
        );
        // System counted as a message: 3 + (4 + 3) + (4 + 2) = 16.
        assert_eq!(
            (
                done["usage"]["input_tokens"].as_i64(),
                done["usage"]["output_tokens"].as_i64()
            ),
            (Some(16), Some(12))
        );
        assert!(
            done["provider_request_id"]
                .as_str()
                .is_some_and(|id| !id.is_empty()),
            "{done}"
        );
        let expected = if first {
            vec![("stale", "upstream_auth_failed"), ("current", "")]
        } else {
            vec![("current", "")]
        };
        assert_eq!(
            key_attempts(&app, &done).await,
            pairs(&expected),
            "the wrong signature refused, then the key set aside"
        );
    }
    let (content, usage) = stream(&app, &model).await;
    assert_eq!(content, "lorem ipsum dolor");
    assert_eq!(
        (
            usage["prompt_tokens"].as_i64(),
            usage["completion_tokens"].as_i64()
        ),
        (Some(16), Some(3))
    );

    let stats = app.mock.stats();
    assert_eq!(stats.projects["bedrock-test"].requests_admitted, 3, "{stats:?}");
    assert_eq!(stats.streams_completed, 1);
    assert_eq!(
        stats.unauthorized, 1,
        "only the stale key's first call was refused: {stats:?}"
    );
    app.shutdown().await;
}

fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected
        .iter()
        .map(|(k, c)| ((*k).to_owned(), (*c).to_owned()))
        .collect()
}

/// Each provider call of a finished job: its key and its error code (empty when it
/// succeeded).
async fn key_attempts(app: &TestApp, job: &Value) -> Vec<(String, String)> {
    let (status, attempts) = app
        .get(
            ACME,
            &format!("/v1/jobs/{}/attempts", job["id"].as_str().unwrap()),
        )
        .await;
    assert_eq!(status, 200, "{attempts}");
    attempts["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let field = |k: &str| a[k].as_str().unwrap_or_default().to_owned();
            (field("key"), field("error_code"))
        })
        .collect()
}

#[tokio::test]
async fn vertex_serves_gemini_and_claude_with_a_service_account_token() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(100_000),
        extra_config: providers(false),
        ..TestOptions::default()
    })
    .await;
    for (i, model) in ["vx/gemini-2.0-flash", "vx/claude-sonnet-4@20250514"]
        .into_iter()
        .enumerate()
    {
        let done = run(&app, model).await;
        if i == 0 {
            let expected = [("stranger", "upstream_auth_failed"), ("sa", "")];
            assert_eq!(
                key_attempts(&app, &done).await,
                pairs(&expected),
                "the unknown account refused, then set aside"
            );
        }
        assert_eq!(done["state"], "succeeded", "{model}: {done}");
        assert_eq!(done["result"]["object"], "chat.completion");
        // System counted as a message (Gemini's instruction, Claude's `system`): 16.
        assert_eq!(done["usage"]["input_tokens"], 16, "{model}: {done}");
        assert_eq!(done["usage"]["output_tokens"], 12, "{model}");
        let (content, usage) = stream(&app, model).await;
        assert_eq!(content, "lorem ipsum dolor", "{model}");
        assert_eq!(usage["completion_tokens"], 3, "{model}");
    }
    let stats = app.mock.stats();
    assert_eq!(stats.projects["tollgate-test"].requests_admitted, 4, "{stats:?}");
    // The stranger's token request was refused once; its key was set aside after it.
    assert_eq!(stats.unauthorized, 1, "{stats:?}");
    app.shutdown().await;
}

#[tokio::test]
async fn bedrock_and_vertex_throttles_teach_the_rpm_limit() {
    const RPM: u64 = 3;
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(RPM),
        extra_config: providers(true),
        ..TestOptions::default()
    })
    .await;
    let targets = [
        (
            format!("bed/{CLAUDE_ON_BEDROCK}"),
            format!("provider:bed:{CLAUDE_ON_BEDROCK}:rpm"),
            "bedrock-test",
        ),
        (
            "vx/gemini-2.0-flash".to_owned(),
            "provider:vx:gemini-2.0-flash:rpm".to_owned(),
            "tollgate-test",
        ),
        // Claude on Vertex: the quota's 429 in Google's shape, no Anthropic headers.
        (
            "vx/claude-sonnet-4@20250514".to_owned(),
            "provider:vx:claude-sonnet-4@20250514:rpm".to_owned(),
            "tollgate-test",
        ),
    ];
    for (model, _, _) in &targets {
        for i in 0..8 {
            let mut body = json!({"request": chat(model)});
            body["request"]["messages"][1]["content"] = json!(format!("job {i}"));
            let (status, accepted) = app.submit(ACME, &body).await;
            assert_eq!(status, 202, "{accepted}");
        }
    }
    for (_, bucket, project) in &targets {
        let learned = eventually(60, "a learned rpm bucket", || async {
            let (status, body) = app.get(ACME, "/v1/limits").await;
            assert_eq!(status, 200, "{body}");
            body["data"]
                .as_array()?
                .iter()
                .find(|b| b["bucket"] == *bucket)
                .cloned()
        })
        .await;
        assert_eq!(learned["source"], "learned", "{learned}");
        assert!(app.mock.stats().projects[*project].rate_limited_429 >= 1);
    }
    // The throttles were capacity: the jobs that met them wait to retry, none failed.
    let failed: Vec<(String, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT model, error_code, error_message FROM jobs WHERE state = 'failed'")
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    app.shutdown().await;
}
