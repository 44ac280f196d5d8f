//! What a job reserves covers what its provider charges: `n` choices are reserved `n`
//! times, and a job without an output cap is sent the one it reserved, so a tenant cannot
//! overdraw the provider's limit or the tenant's own budget through the request's fields.

use serde_json::json;

use crate::gate::assert_the_provider_saw_every_job_within_its_limits;
use crate::harness::{ACME, TestApp, TestOptions, job, mock_config};

/// Six jobs asking for four choices of 100 tokens each against a provider limit of 2,000
/// tokens a minute, which the provider charges as OpenAI does (input + n × max_tokens,
/// when the call starts). Reserving one choice per job would admit all six at once and
/// send about 2,460 tokens to a provider allowing 2,000: 429s. Reserving four, the gate
/// holds the last ones until the limit has room, and the provider never refuses a call.
#[tokio::test]
async fn n_choices_are_reserved_so_the_provider_never_counts_more_than_its_limit() {
    const TPM: u64 = 2000;
    const JOBS: usize = 6;
    let mut mock = mock_config();
    mock.projects[0].tpm = TPM;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: format!("[providers.limits.\"gpt-4o-mini\"]\ntpm = {TPM}\n"),
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..JOBS {
        let mut body = job("oai/gpt-4o-mini", &format!("question {i}"));
        body["request"]["max_tokens"] = json!(100);
        body["request"]["n"] = json!(4);
        let (status, accepted) = app.submit(ACME, &body).await;
        assert_eq!(status, 202, "{accepted}");
        ids.push(accepted["id"].as_str().unwrap().to_owned());
    }
    let mut finished = Vec::new();
    for id in &ids {
        finished.push(app.wait_job(ACME, id, 90).await);
    }
    // No 429, no limit exceeded, within the dispatchers' concurrency.
    assert_the_provider_saw_every_job_within_its_limits(&app, JOBS, 16).await;
    for done in &finished {
        assert_eq!(done["state"], "succeeded", "{done}");
        assert_eq!(done["estimate"]["output_tokens"], 400, "four choices of the cap");
        assert_eq!(done["result"]["choices"].as_array().unwrap().len(), 4);
        // The mock writes 12 tokens a choice; the prompt is counted once.
        assert_eq!(done["usage"]["output_tokens"], 4 * 12);
        assert!(
            done["estimate"]["input_tokens"].as_i64() >= done["usage"]["input_tokens"].as_i64(),
            "{done}"
        );
    }
    assert_eq!(
        app.mock.stats().projects["oai-test"].output_tokens_admitted,
        (JOBS * 4 * 12) as u64
    );
    app.shutdown().await;
}

/// A model that would write 1,500 tokens, and jobs that set no cap: the gate reserves
/// the default cap, and every provider is sent exactly that cap (OpenAI as
/// `max_completion_tokens`, Anthropic as `max_tokens`), so none answers with more output
/// than was reserved.
#[tokio::test]
async fn a_job_without_a_cap_is_sent_the_cap_it_reserved() {
    let mut mock = mock_config();
    mock.output_tokens = 1500;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        ..TestOptions::default()
    })
    .await;
    let default_cap = tollgate::estimate::DEFAULT_OUTPUT_TOKENS;
    for model in ["oai/gpt-4o-mini", "ant/claude-3-5-haiku-latest"] {
        let mut body = job(model, "write at length");
        body["request"].as_object_mut().unwrap().remove("max_tokens");
        let done = app.run_job(ACME, &body, 60).await;
        assert_eq!(done["estimate"]["output_tokens"], default_cap, "{model}");
        assert_eq!(done["usage"]["output_tokens"], default_cap, "{model}: {done}");
        assert_eq!(done["result"]["choices"][0]["finish_reason"], "length", "{model}");
    }
    app.shutdown().await;
}
