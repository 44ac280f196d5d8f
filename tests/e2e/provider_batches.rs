//! Provider batch APIs as a scheduling choice, end to end against the mock: a tollgate
//! batch whose lines go through the mock's OpenAI Batch API (files + batches) or
//! Anthropic Message Batches API, complete, come back in the output file at the batch
//! price with the savings reported; a job whose deadline is too close goes online; lines
//! the mock fails or expires go back online and finish there. Every endpoint a provider's
//! batch API takes goes that way: OpenAI's five, and Message Batches to Anthropic as they
//! are.

use std::collections::HashSet;

use chrono::Utc;
use serde_json::{Value, json};
use tollgate_mock::{BatchMockConfig, MockConfig};

use crate::batches::{batch_body, content, create_batch, upload, wait_batch};
use crate::harness::{ACME, TestApp, TestOptions, mock_config};

/// USD per million tokens of the test models: micro-USD per token.
const INPUT_PRICE: f64 = 0.15;
const OUTPUT_PRICE: f64 = 0.6;

fn batch_api(extra: &str) -> String {
    format!(
        "[providers.batch_api]\nenabled = true\nmin_deadline_secs = 3600\nenqueued_tokens = 1000000\n\
         poll_interval_ms = 50\npack_wait_ms = 0\n{extra}"
    )
}

fn prices(model: &str) -> String {
    format!(
        "[providers.prices.\"{model}\"]\ninput_per_mtok = {INPUT_PRICE}\noutput_per_mtok = {OUTPUT_PRICE}\n"
    )
}

fn mock(fail_every_nth: u64, expire_every_nth: u64) -> MockConfig {
    MockConfig {
        batch: BatchMockConfig {
            lines_per_sec: 500.0,
            fail_every_nth,
            expire_every_nth,
        },
        ..mock_config()
    }
}

/// The work of a test batch: its endpoint, the body of line `i` for a model, the field
/// every answer of the endpoint holds, and whether the endpoint is charged by tokens.
struct Work {
    endpoint: &'static str,
    body: fn(&str, usize) -> Value,
    answer_holds: &'static str,
    tokens: bool,
}

const CHAT: Work = Work {
    endpoint: "/v1/chat/completions",
    body: |model, i| json!({"model": model, "messages": [{"role": "user", "content": format!("item {i}")}], "max_tokens": 16}),
    answer_holds: "choices",
    tokens: true,
};

const EMBEDDINGS: Work = Work {
    endpoint: "/v1/embeddings",
    body: |model, i| json!({"model": model, "input": [format!("document {i}"), "and its title"]}),
    answer_holds: "data",
    tokens: true,
};

const RESPONSES: Work = Work {
    endpoint: "/v1/responses",
    body: |model, i| json!({"model": model, "instructions": "be brief", "input": format!("item {i}"), "max_output_tokens": 16}),
    answer_holds: "output",
    tokens: true,
};

const COMPLETIONS: Work = Work {
    endpoint: "/v1/completions",
    body: |model, i| json!({"model": model, "prompt": format!("item {i}"), "max_tokens": 8}),
    answer_holds: "choices",
    tokens: true,
};

const MODERATIONS: Work = Work {
    endpoint: "/v1/moderations",
    body: |model, i| json!({"model": model, "input": format!("item {i}")}),
    answer_holds: "results",
    tokens: false,
};

fn input(model: &str, work: &Work, n: usize) -> String {
    (0..n)
        .map(|i| {
            json!({"custom_id": format!("line-{i}"), "method": "POST", "url": work.endpoint,
                   "body": (work.body)(model, i)})
            .to_string()
                + "\n"
        })
        .collect()
}

/// (id, dispatch_via, dispatch_reason, provider_batch_id, state) of a batch's jobs.
type Row = (uuid::Uuid, Option<String>, Option<String>, Option<String>, String);

async fn jobs_of(app: &TestApp, batch_id: &str) -> Vec<Row> {
    sqlx::query_as(
        "SELECT id, dispatch_via, dispatch_reason, provider_batch_id, state::text FROM jobs
         WHERE batch_id = $1 ORDER BY batch_line",
    )
    .bind(batch_id)
    .fetch_all(&app.db.pool)
    .await
    .expect("jobs of the batch")
}

/// Nothing stays reserved: the enqueued-token pool is whole again and no job holds a
/// reservation, once the gate has applied the refunds.
async fn all_released(app: &TestApp) {
    crate::harness::eventually(20, "every reservation to be released", || async {
        let (level, capacity): (f64, f64) =
            sqlx::query_as("SELECT level, capacity FROM buckets WHERE key LIKE '%:batch_queue_tokens'")
                .fetch_one(&app.db.pool)
                .await
                .ok()?;
        let held: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE reserved_buckets IS NOT NULL")
            .fetch_one(&app.db.pool)
            .await
            .ok()?;
        ((level - capacity).abs() < 1e-6 && held == 0).then_some(())
    })
    .await;
}

/// Runs a tollgate batch of `n` lines of `work` for `model` and checks everything that
/// must hold whichever provider carried it; returns the finished batch object.
async fn run_batch(app: &TestApp, model: &str, work: &Work, n: usize, batch_id_prefix: &str) -> Value {
    let http = &app.http;
    let (status, file) = upload(http, &app.api, ACME, input(model, work, n).as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    let mut body = batch_body(file["id"].as_str().unwrap());
    body["endpoint"] = json!(work.endpoint);
    let (status, batch) = create_batch(http, &app.api, ACME, &body).await;
    assert_eq!(status, 200, "{batch}");
    let id = batch["id"].as_str().unwrap().to_owned();
    let done = wait_batch(http, &app.api, ACME, &id, 60).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["request_counts"]["completed"], n, "{done}");
    assert_eq!(done["request_counts"]["failed"], 0, "{done}");

    // Every line once in the output file, answered 200.
    let output = content(http, &app.api, ACME, done["output_file_id"].as_str().unwrap()).await;
    let ids: Vec<String> = output
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["response"]["status_code"], 200, "{v}");
            assert!(
                v["response"]["body"][work.answer_holds].is_array(),
                "{}: {v}",
                work.endpoint
            );
            v["custom_id"].as_str().unwrap().to_owned()
        })
        .collect();
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!((ids.len(), unique.len()), (n, n), "each line exactly once");

    // Each line went through a provider batch (its id recorded); the provider's own ids
    // have the API's shape.
    let rows = jobs_of(app, &id).await;
    assert_eq!(rows.len(), n);
    // A pack is marked ended just after its lines' outcomes are written.
    type Pack = (String, Option<String>, String, String);
    let packs: Vec<Pack> = crate::harness::eventually(20, "the packs to end", || async {
        let packs: Vec<Pack> = sqlx::query_as(
            "SELECT id, provider_batch_id, status, endpoint FROM provider_batches
             WHERE id IN (SELECT provider_batch_id FROM jobs WHERE batch_id = $1) ORDER BY id",
        )
        .bind(&id)
        .fetch_all(&app.db.pool)
        .await
        .ok()?;
        packs.iter().all(|p| p.2 == "ended").then_some(packs)
    })
    .await;
    assert!(!packs.is_empty());
    for (_, provider_id, _, endpoint) in &packs {
        assert!(
            provider_id.as_deref().unwrap().starts_with(batch_id_prefix),
            "{provider_id:?}"
        );
        assert_eq!(endpoint, work.endpoint, "a pack carries its lines' endpoint");
    }
    for (job, ..) in &rows {
        let (status, view) = app.get(ACME, &format!("/v1/jobs/{job}")).await;
        assert_eq!(status, 200);
        assert_eq!(view["state"], "succeeded", "{view}");
        assert!(view["dispatch"]["provider_batch_id"].is_string(), "{view}");
    }

    // Spend: the succeeded batch lines cost the batch price; the saving is the other half.
    let (online, batch_cost): (f64, f64) = sqlx::query_as(
        "SELECT COALESCE(sum(online_cost_micro_usd), 0)::float8, COALESCE(sum(batch_cost_micro_usd), 0)::float8
         FROM provider_batches WHERE id IN (SELECT provider_batch_id FROM jobs WHERE batch_id = $1)",
    )
    .bind(&id)
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    let (expected_online,): (f64,) = sqlx::query_as(
        "SELECT COALESCE(sum((usage->>'input_tokens')::float8 * $2 + (usage->>'output_tokens')::float8 * $3), 0)
         FROM jobs WHERE batch_id = $1 AND dispatch_via = 'provider_batch'",
    )
    .bind(&id)
    .bind(INPUT_PRICE)
    .bind(OUTPUT_PRICE)
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(online > 0.0, work.tokens, "{}: {online}", work.endpoint);
    let (charged,): (f64,) = sqlx::query_as(
        "SELECT COALESCE(sum(spend_micro_usd), 0)::float8 FROM jobs WHERE batch_id = $1 AND dispatch_via = 'provider_batch'",
    )
    .bind(&id)
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert!(
        (charged - batch_cost).abs() < 1e-6,
        "each line is charged the batch price: {charged} vs {batch_cost}"
    );
    assert!(
        (online - expected_online).abs() < 1e-6,
        "{online} vs {expected_online}"
    );
    assert!(
        (batch_cost - online * 0.5).abs() < 1e-6,
        "batch price is half: {batch_cost} of {online}"
    );
    let (_, view) = app.get(ACME, &format!("/v1/batches/{id}")).await;
    let saved = view["provider_batch"]["estimated_savings_usd"].as_f64().unwrap();
    assert!((saved - (online - batch_cost) / 1e6).abs() < 1e-9, "{view}");
    assert_eq!(saved > 0.0, work.tokens, "{view}");

    all_released(app).await;
    done
}

#[tokio::test]
async fn openai_batch_api_carries_a_batch_at_half_price() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(0, 0),
        extra_config: batch_api("") + &prices("gpt-4o-mini"),
        ..TestOptions::default()
    })
    .await;
    let done = run_batch(&app, "oai/gpt-4o-mini", &CHAT, 12, "batch_").await;
    let rows = jobs_of(&app, done["id"].as_str().unwrap()).await;
    for (_, via, reason, pb, _) in &rows {
        assert_eq!(via.as_deref(), Some("provider_batch"));
        assert_eq!(reason.as_deref(), Some("deadline_allows_batch_api"));
        assert!(pb.is_some());
    }
    // No online call was made for them.
    assert_eq!(
        app.mock.stats().succeeded,
        0,
        "the online endpoint served nothing"
    );
    app.shutdown().await;
}

/// A broker whose provider `antb` (Anthropic) sends `batch`-class jobs through its
/// Message Batches API.
async fn anthropic_batch_app() -> TestApp {
    let extra = format!(
        "[[providers]]\nname = \"antb\"\nkind = \"anthropic\"\nbase_url = \"http://MOCK_ADDR\"\n\
         keys = [{{ name = \"a1\", value = \"sk-ant-test\" }}]\nmodels = [\"claude-3-5-haiku-latest\"]\n\
         learn_limits = false\n{}{}",
        batch_api(""),
        prices("claude-3-5-haiku-latest")
    );
    TestApp::spawn_with(TestOptions {
        mock: mock(0, 0),
        extra_config: extra,
        ..TestOptions::default()
    })
    .await
}

#[tokio::test]
async fn anthropic_message_batches_carry_a_batch_at_half_price() {
    let app = anthropic_batch_app().await;
    let done = run_batch(&app, "antb/claude-3-5-haiku-latest", &CHAT, 9, "msgbatch_").await;
    let rows = jobs_of(&app, done["id"].as_str().unwrap()).await;
    assert!(
        rows.iter().all(|r| r.1.as_deref() == Some("provider_batch")),
        "{rows:?}"
    );
    assert_eq!(
        app.mock.stats().succeeded,
        0,
        "the online endpoint served nothing"
    );
    app.shutdown().await;
}

/// A batch due sooner than the provider's window goes online while nothing is known of
/// its batches; once three have ended in a second or so, the same deadline goes through the
/// batch API: their observed turnaround plus `pull_back_secs` fits.
#[tokio::test]
async fn observed_turnaround_opens_the_batch_api_to_closer_deadlines() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(0, 0),
        extra_config: "[providers.batch_api]\nenabled = true\nmin_deadline_secs = 7200\npull_back_secs = 60\n\
                       enqueued_tokens = 1000000\npoll_interval_ms = 50\npack_wait_ms = 0\n"
            .to_owned() + &prices("gpt-4o-mini"),
        ..TestOptions::default()
    })
    .await;
    let run = |window: &'static str| {
        let app = &app;
        async move {
            let (_, file) = upload(
                &app.http,
                &app.api,
                ACME,
                input("oai/gpt-4o-mini", &CHAT, 3).as_bytes(),
            )
            .await;
            let mut body = batch_body(file["id"].as_str().unwrap());
            body["completion_window"] = json!(window);
            let (status, batch) = create_batch(&app.http, &app.api, ACME, &body).await;
            assert_eq!(status, 200, "{batch}");
            let id = batch["id"].as_str().unwrap().to_owned();
            let done = wait_batch(&app.http, &app.api, ACME, &id, 60).await;
            assert_eq!(done["status"], "completed", "{done}");
            let reasons: HashSet<Option<String>> = jobs_of(app, &id).await.into_iter().map(|r| r.2).collect();
            reasons
        }
    };
    let one = |r: &str| HashSet::from([Some(r.to_owned())]);
    assert_eq!(
        run("1h").await,
        one("deadline_too_close_for_batch_api"),
        "nothing observed yet"
    );
    for _ in 0..3 {
        assert_eq!(run("24h").await, one("deadline_allows_batch_api"));
    }
    assert_eq!(run("1h").await, one("observed_turnaround_allows_batch_api"));
    app.shutdown().await;
}

/// Azure OpenAI's Global Batch: a tollgate batch to an `azure` provider's global-batch
/// deployment goes through Azure's Files and Batch APIs (below `/openai`, the
/// `api-version` on every URL, `api-key` auth) at half price.
#[tokio::test]
async fn azure_global_batch_carries_a_batch_at_half_price() {
    let mut mock = mock(0, 0);
    mock.projects.push(crate::harness::mock_project(
        "az-batch",
        tollgate_mock::ProviderKind::Azure,
        &["az-key"],
        &["gpt-4o-global-batch"],
        100_000,
    ));
    let extra = format!(
        "[[providers]]\nname = \"az\"\nkind = \"azure\"\nbase_url = \"http://MOCK_ADDR\"\n\
         keys = [{{ name = \"z1\", value = \"az-key\" }}]\nmodels = [\"gpt-4o-global-batch\"]\nlearn_limits = false\n{}{}",
        batch_api(""),
        prices("gpt-4o-global-batch")
    );
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: extra,
        ..TestOptions::default()
    })
    .await;
    for (work, n) in [(&CHAT, 7), (&EMBEDDINGS, 4)] {
        let done = run_batch(&app, "az/gpt-4o-global-batch", work, n, "batch_").await;
        let rows = jobs_of(&app, done["id"].as_str().unwrap()).await;
        assert!(
            rows.iter().all(|r| r.1.as_deref() == Some("provider_batch")),
            "{}: {rows:?}",
            work.endpoint
        );
    }
    assert_eq!(app.mock.stats().succeeded, 0, "nothing went online");
    app.shutdown().await;
}

/// Gemini Batch Mode carries chat batches two ways: a small batch inline in its create
/// request (`gi`), a larger one — here anything over one byte — uploaded first as a JSONL
/// file by Google's resumable upload (`gf`); both answered at half price, nothing online.
#[tokio::test]
async fn gemini_batch_mode_carries_a_batch_inline_or_as_a_file() {
    let mut mock = mock(0, 0);
    mock.projects.push(crate::harness::mock_project(
        "gm-batch",
        tollgate_mock::ProviderKind::Gemini,
        &["gm-key"],
        &["gemini-2.5-flash"],
        100_000,
    ));
    let provider = |name: &str, extra: &str| {
        format!(
            "[[providers]]\nname = \"{name}\"\nkind = \"gemini\"\nbase_url = \"http://MOCK_ADDR\"\n\
             keys = [{{ name = \"{name}1\", value = \"gm-key\" }}]\nmodels = [\"gemini-2.5-flash\"]\nlearn_limits = false\n{}{}",
            batch_api(extra),
            prices("gemini-2.5-flash")
        )
    };
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: provider("gi", "") + &provider("gf", "inline_max_bytes = 1\n"),
        ..TestOptions::default()
    })
    .await;
    for (provider, n, uploaded) in [("gi", 7, false), ("gf", 5, true)] {
        let done = run_batch(
            &app,
            &format!("{provider}/gemini-2.5-flash"),
            &CHAT,
            n,
            "batches/",
        )
        .await;
        let rows = jobs_of(&app, done["id"].as_str().unwrap()).await;
        assert!(
            rows.iter().all(|r| r.1.as_deref() == Some("provider_batch")),
            "{provider}: {rows:?}"
        );
        let files: Vec<Option<String>> = sqlx::query_scalar(
            "SELECT input_file_id FROM provider_batches
             WHERE id IN (SELECT provider_batch_id FROM jobs WHERE batch_id = $1)",
        )
        .bind(done["id"].as_str().unwrap())
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
        assert!(
            files
                .iter()
                .all(|f| f.as_deref().is_some_and(|f| f.starts_with("files/")) == uploaded),
            "{provider}: {files:?}"
        );
    }
    assert_eq!(app.mock.stats().succeeded, 0, "nothing went online");
    app.shutdown().await;
}

/// An OpenAI-compatible server whose config says it has OpenAI's Batch API carries
/// batches through it; one that says nothing is never assumed to have one.
#[tokio::test]
async fn an_openai_compatible_batch_api_is_used_only_where_enabled() {
    let compatible = |name: &str, batch: &str| {
        format!(
            "[[providers]]\nname = \"{name}\"\nkind = \"openai-compatible\"\nbase_url = \"http://MOCK_ADDR/v1\"\n\
             keys = [{{ name = \"k1\", value = \"sk-test-1\" }}]\nmodels = [\"llama-3.3-70b\"]\nlearn_limits = false\n{batch}{}",
            prices("llama-3.3-70b")
        )
    };
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(0, 0),
        extra_config: compatible("groq", &batch_api("")) + &compatible("vllm", ""),
        ..TestOptions::default()
    })
    .await;
    let done = run_batch(&app, "groq/llama-3.3-70b", &CHAT, 6, "batch_").await;
    let rows = jobs_of(&app, done["id"].as_str().unwrap()).await;
    assert!(
        rows.iter().all(|r| r.1.as_deref() == Some("provider_batch")),
        "{rows:?}"
    );
    assert_eq!(app.mock.stats().succeeded, 0, "nothing went online");

    let (_, file) = upload(
        &app.http,
        &app.api,
        ACME,
        input("vllm/llama-3.3-70b", &CHAT, 3).as_bytes(),
    )
    .await;
    let (_, batch) = create_batch(
        &app.http,
        &app.api,
        ACME,
        &batch_body(file["id"].as_str().unwrap()),
    )
    .await;
    let id = batch["id"].as_str().unwrap();
    let done = wait_batch(&app.http, &app.api, ACME, id, 60).await;
    assert_eq!(done["status"], "completed", "{done}");
    for (_, via, reason, ..) in jobs_of(&app, id).await {
        assert_eq!(
            (via.as_deref(), reason.as_deref()),
            (Some("online"), Some("route_has_no_batch_api"))
        );
    }
    app.shutdown().await;
}

#[tokio::test]
async fn openai_batch_api_carries_every_endpoint_it_takes() {
    let models = [
        "text-embedding-3-small",
        "gpt-4o-mini",
        "gpt-3.5-turbo-instruct",
        "omni-moderation-latest",
    ];
    let extra = format!(
        "[[providers]]\nname = \"oaib\"\nkind = \"openai\"\nbase_url = \"http://MOCK_ADDR/v1\"\n\
         keys = [{{ name = \"k1\", value = \"sk-test-1\" }}]\nmodels = {models:?}\nlearn_limits = false\n{}{}",
        batch_api(""),
        models.map(prices).concat()
    );
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(0, 0),
        extra_config: extra,
        server_config: format!("admin_key = \"{}\"", crate::observe::ADMIN),
        ..TestOptions::default()
    })
    .await;
    for (model, work) in [
        ("oaib/text-embedding-3-small", &EMBEDDINGS),
        ("oaib/gpt-4o-mini", &RESPONSES),
        ("oaib/gpt-3.5-turbo-instruct", &COMPLETIONS),
        ("oaib/omni-moderation-latest", &MODERATIONS),
    ] {
        let done = run_batch(&app, model, work, 5, "batch_").await;
        for (_, via, reason, ..) in jobs_of(&app, done["id"].as_str().unwrap()).await {
            assert_eq!(via.as_deref(), Some("provider_batch"), "{}", work.endpoint);
            assert_eq!(reason.as_deref(), Some("deadline_allows_batch_api"));
        }
    }
    // Embeddings are charged input only, as online.
    let (input, output): (i64, i64) = sqlx::query_as(
        "SELECT sum((usage->>'input_tokens')::bigint)::bigint, sum((usage->>'output_tokens')::bigint)::bigint
         FROM jobs WHERE endpoint = '/v1/embeddings'",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert!(input > 0 && output == 0, "{input} in, {output} out");
    assert_eq!(
        app.mock.stats().succeeded,
        0,
        "the online endpoints served nothing"
    );
    // The spend of each endpoint's lines, at the batch price, is in the metrics.
    let metrics = crate::observe::scrape(&app).await;
    for endpoint in [EMBEDDINGS.endpoint, RESPONSES.endpoint, COMPLETIONS.endpoint] {
        let (cost,): (f64,) = sqlx::query_as(
            "SELECT sum(batch_cost_micro_usd)::float8 FROM provider_batches WHERE endpoint = $1",
        )
        .bind(endpoint)
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        let labels = [
            ("provider", "oaib"),
            ("endpoint", endpoint),
            ("lane", "provider_batch"),
        ];
        let recorded = crate::observe::metric(&metrics, "tollgate_call_spend_micro_usd_sum", &labels);
        assert!(
            cost > 0.0 && (recorded - cost).abs() < 1e-6,
            "{endpoint}: {recorded} vs {cost}"
        );
    }
    app.shutdown().await;
}

#[tokio::test]
async fn a_batch_of_embeddings_is_packed_within_the_providers_input_limit() {
    // Five lines of two inputs each, at most five inputs per provider batch: packs of two
    // lines, then one.
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(0, 0),
        extra_config: batch_api("max_embedding_inputs = 5\n") + &prices("gpt-4o-mini"),
        ..TestOptions::default()
    })
    .await;
    let done = run_batch(&app, "oai/gpt-4o-mini", &EMBEDDINGS, 5, "batch_").await;
    let lines: Vec<i32> = sqlx::query_scalar(
        "SELECT lines FROM provider_batches WHERE id IN (SELECT provider_batch_id FROM jobs WHERE batch_id = $1)
         ORDER BY created_at",
    )
    .bind(done["id"].as_str().unwrap())
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(lines, [2, 2, 1], "packs of at most five inputs");
    app.shutdown().await;
}

#[tokio::test]
async fn a_message_batch_reaches_anthropics_batch_api_in_its_own_shape() {
    let app = anthropic_batch_app().await;
    // `top_k` has no chat counterpart: sent as it is, it shows the line was not translated.
    let requests: Vec<Value> = (0..4)
        .map(|i| {
            json!({"custom_id": format!("q{i}"), "params": {"model": "antb/claude-3-5-haiku-latest",
                   "max_tokens": 32, "top_k": 5, "system": "be brief",
                   "messages": [{"role": "user", "content": format!("question {i}")}]}})
        })
        .collect();
    let (status, batch) = app
        .post(ACME, "/v1/messages/batches", &json!({"requests": requests}))
        .await;
    assert_eq!(status, 200, "{batch}");
    let id = batch["id"].as_str().unwrap().to_owned();
    let ended = crate::harness::eventually(60, "the Message Batch to end", || async {
        let (_, b) = app.get(ACME, &format!("/v1/messages/batches/{id}")).await;
        (b["processing_status"] == "ended").then_some(b)
    })
    .await;
    assert_eq!(ended["request_counts"]["succeeded"], 4, "{ended}");
    let results = app
        .http
        .get(app.url(&format!("/v1/messages/batches/{id}/results")))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut answered: Vec<String> = results
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["result"]["type"], "succeeded", "{v}");
            assert_eq!(v["result"]["message"]["type"], "message", "{v}");
            assert_eq!(v["result"]["message"]["role"], "assistant", "{v}");
            assert!(
                v["result"]["message"]["usage"]["input_tokens"].as_u64() > Some(0),
                "{v}"
            );
            v["custom_id"].as_str().unwrap().to_owned()
        })
        .collect();
    answered.sort();
    assert_eq!(answered, ["q0", "q1", "q2", "q3"]);
    let rows = jobs_of(&app, &id).await;
    assert_eq!(rows.len(), 4);
    assert!(
        rows.iter().all(|r| r.1.as_deref() == Some("provider_batch")),
        "{rows:?}"
    );
    let endpoints: Vec<String> = sqlx::query_scalar("SELECT DISTINCT endpoint FROM provider_batches")
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(endpoints, ["/v1/messages"]);
    assert_eq!(
        app.mock.stats().succeeded,
        0,
        "the online endpoint served nothing"
    );
    all_released(&app).await;
    app.shutdown().await;
}

#[tokio::test]
async fn failed_and_expired_lines_go_back_online_and_finish() {
    // Every 4th line fails, every 5th expires: lines 4, 8 (failed) and 5, 10 (expired)
    // of 10 come back from the mock unanswered.
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(4, 5),
        extra_config: batch_api("") + &prices("gpt-4o-mini"),
        ..TestOptions::default()
    })
    .await;
    let done = run_batch(&app, "oai/gpt-4o-mini", &CHAT, 10, "batch_").await;
    let rows = jobs_of(&app, done["id"].as_str().unwrap()).await;
    let online: Vec<usize> = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.1.as_deref() == Some("online"))
        .map(|(i, r)| {
            assert_eq!(
                r.2.as_deref(),
                Some("provider_batch_failed_retry_online"),
                "{r:?}"
            );
            i + 1
        })
        .collect();
    assert_eq!(
        online,
        vec![4, 5, 8, 10],
        "the lines the mock did not answer went online"
    );
    assert_eq!(
        app.mock.stats().succeeded,
        4,
        "the online endpoint served exactly those"
    );
    let (_, job) = app.get(ACME, &format!("/v1/jobs/{}", rows[3].0)).await;
    assert_eq!(job["dispatch"]["via"], "online", "{job}");
    assert_eq!(
        job["dispatch"]["reason"], "provider_batch_failed_retry_online",
        "{job}"
    );
    app.shutdown().await;
}

/// A provider batch too slow for its lines' deadline (the mock does a line a second; the
/// batch has 35 s and the lines need `pull_back_secs` = 20 online): tollgate cancels it at
/// the provider, keeps what it finished at the batch price and sends the rest online,
/// billed online. Every line once in the output, none past its deadline.
#[tokio::test]
async fn a_provider_batch_running_late_is_pulled_back_and_finishes_in_time() {
    pull_back("", ("online", "pulled_back_from_provider_batch", 1.0)).await;
}

/// The same with the provider's flex tier on: the lines pulled back have the time it needs,
/// so they go there, billed at its price.
#[tokio::test]
async fn lines_pulled_back_go_to_the_flex_tier_when_it_has_the_time() {
    pull_back(
        "[providers.flex]\nenabled = true\nmin_deadline_secs = 5\n",
        ("flex", "pulled_back_to_flex", 0.5),
    )
    .await;
}

/// A batch of 40 lines whose provider batch runs late is pulled back; the pulled-back lines
/// go `(via, reason)` and are billed `price` × the online price.
async fn pull_back(flex: &str, (via, reason, price): (&str, &str, f64)) {
    const LINES: usize = 40;
    let mut mock = mock(0, 0);
    mock.batch.lines_per_sec = 1.0;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: "[providers.batch_api]\nenabled = true\nmin_deadline_secs = 10\npull_back_secs = 20\n\
                       enqueued_tokens = 1000000\npoll_interval_ms = 50\npack_wait_ms = 0\n"
            .to_owned()
            + flex
            + &prices("gpt-4o-mini"),
        ..TestOptions::default()
    })
    .await;
    let http = &app.http;
    let (_, file) = upload(
        http,
        &app.api,
        ACME,
        input("oai/gpt-4o-mini", &CHAT, LINES).as_bytes(),
    )
    .await;
    let mut body = batch_body(file["id"].as_str().unwrap());
    body["completion_window"] = json!("35s");
    let (status, batch) = create_batch(http, &app.api, ACME, &body).await;
    assert_eq!(status, 200, "{batch}");
    let id = batch["id"].as_str().unwrap().to_owned();
    let done = wait_batch(http, &app.api, ACME, &id, 60).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["request_counts"]["completed"], LINES, "{done}");

    let output = content(http, &app.api, ACME, done["output_file_id"].as_str().unwrap()).await;
    let ids: HashSet<String> = output
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["custom_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        (output.lines().count(), ids.len()),
        (LINES, LINES),
        "each line exactly once"
    );

    let rows = jobs_of(&app, &id).await;
    let reasons = |r: &str| rows.iter().filter(|row| row.2.as_deref() == Some(r)).count();
    let (kept, pulled) = (reasons("deadline_allows_batch_api"), reasons(reason));
    assert!(kept > 0 && pulled > 0, "{rows:?}");
    assert_eq!(kept + pulled, LINES, "{rows:?}");
    assert!(
        rows.iter()
            .all(|r| r.2.as_deref() != Some(reason) || r.1.as_deref() == Some(via)),
        "{rows:?}"
    );
    assert!(rows.iter().all(|r| r.4 == "succeeded"), "{rows:?}");
    let (late,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM jobs WHERE batch_id = $1 AND finished_at > deadline")
            .bind(&id)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(late, 0, "no line finished past its deadline");
    // The pulled-back lines were served online (or at the flex tier), once each.
    assert_eq!(app.mock.stats().succeeded, pulled as u64);
    // Billing: the kept lines at half the online price, the pulled-back ones at their lane's.
    let spend_ratio = |via: &str| {
        let pool = app.db.pool.clone();
        let id = id.clone();
        let via = via.to_owned();
        async move {
            let (charged, online): (f64, f64) = sqlx::query_as(
                "SELECT sum(spend_micro_usd)::float8,
                        sum((usage->>'input_tokens')::float8 * $2 + (usage->>'output_tokens')::float8 * $3)
                 FROM jobs WHERE batch_id = $1 AND dispatch_via = $4",
            )
            .bind(&id)
            .bind(INPUT_PRICE)
            .bind(OUTPUT_PRICE)
            .bind(&via)
            .fetch_one(&pool)
            .await
            .unwrap();
            charged / online
        }
    };
    assert!((spend_ratio("provider_batch").await - 0.5).abs() < 1e-9);
    assert!((spend_ratio(via).await - price).abs() < 1e-9);
    let (provider_status,): (Option<String>,) = sqlx::query_as(
        "SELECT provider_status FROM provider_batches WHERE id IN (SELECT provider_batch_id FROM jobs WHERE batch_id = $1)",
    )
    .bind(&id)
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(provider_status.as_deref(), Some("cancelled"));
    all_released(&app).await;
    app.shutdown().await;
}

#[tokio::test]
async fn a_deadline_too_close_for_the_batch_api_goes_online() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(0, 0),
        extra_config: batch_api("") + &prices("gpt-4o-mini"),
        ..TestOptions::default()
    })
    .await;
    let submit = |minutes: i64| {
        let mut body = crate::harness::job("oai/gpt-4o-mini", "hello");
        body["class"] = json!("batch");
        body["deadline"] = json!(Utc::now() + chrono::Duration::minutes(minutes));
        body
    };
    let (status, close) = app.submit(ACME, &submit(10)).await;
    assert_eq!(status, 202, "{close}");
    let (status, far) = app.submit(ACME, &submit(120)).await;
    assert_eq!(status, 202, "{far}");
    let close = app.wait_job(ACME, close["id"].as_str().unwrap(), 30).await;
    let far = app.wait_job(ACME, far["id"].as_str().unwrap(), 30).await;
    assert_eq!(close["state"], "succeeded", "{close}");
    assert_eq!(close["dispatch"]["via"], "online", "{close}");
    assert_eq!(
        close["dispatch"]["reason"], "deadline_too_close_for_batch_api",
        "{close}"
    );
    assert!(close["dispatch"]["provider_batch_id"].is_null());
    assert_eq!(far["state"], "succeeded", "{far}");
    assert_eq!(far["dispatch"]["via"], "provider_batch", "{far}");
    assert_eq!(far["dispatch"]["reason"], "deadline_allows_batch_api", "{far}");
    assert!(far["dispatch"]["provider_batch_id"].is_string(), "{far}");
    assert_eq!(
        app.mock.stats().succeeded,
        1,
        "one online call: the close deadline's"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn a_line_cancelled_while_at_the_provider_releases_what_it_held() {
    // One line per second: the pack stays at the provider long enough to cancel a line.
    let app = TestApp::spawn_with(TestOptions {
        mock: MockConfig {
            batch: BatchMockConfig {
                lines_per_sec: 1.0,
                ..BatchMockConfig::default()
            },
            ..mock_config()
        },
        extra_config: batch_api("") + &prices("gpt-4o-mini"),
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let mut body = crate::harness::job("oai/gpt-4o-mini", &format!("line {i}"));
        body["class"] = json!("batch");
        body["deadline"] = json!(Utc::now() + chrono::Duration::hours(2));
        let (status, job) = app.submit(ACME, &body).await;
        assert_eq!(status, 202, "{job}");
        ids.push(job["id"].as_str().unwrap().to_owned());
    }
    let first = ids[0].clone();
    crate::harness::eventually(20, "the line to be at the provider", || async {
        let (_, job) = app.get(ACME, &format!("/v1/jobs/{first}")).await;
        (job["state"] == "running" && job["dispatch"]["provider_batch_id"].is_string()).then_some(())
    })
    .await;
    let (status, cancelled) = app
        .post(ACME, &format!("/v1/jobs/{first}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "cancelled");
    for id in &ids[1..] {
        let job = app.wait_job(ACME, id, 30).await;
        assert_eq!(job["state"], "succeeded", "{job}");
    }
    all_released(&app).await;
    let (_, job) = app.get(ACME, &format!("/v1/jobs/{first}")).await;
    assert_eq!(
        job["state"], "cancelled",
        "the provider's answer does not revive it: {job}"
    );
    let saved: Option<f64> = sqlx::query_scalar("SELECT saved_micro_usd FROM jobs WHERE id = $1::uuid")
        .bind(&first)
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(saved, None, "a cancelled line saved nothing");
    app.shutdown().await;
}

/// Queues `n` batch-class jobs and admits them through the gate: each is admitted for a
/// provider batch. Returns the pack group they form.
async fn admitted_for_a_pack(app: &TestApp, n: usize) -> tollgate::store::PackGroup {
    for i in 0..n {
        let body = json!({"request": {"model": "oai/gpt-4o-mini", "max_tokens": 16,
                                      "messages": [{"role": "user", "content": format!("item {i}")}]},
                          "class": "batch"});
        let (status, job) = app.submit(ACME, &body).await;
        assert_eq!(status, 202, "{job}");
    }
    let gate = tollgate_workers::gate::Gate::new(
        app.db.pool.clone(),
        app.config.clone(),
        tollgate::notify::Notifications::default(),
    );
    assert_eq!(gate.run_once(Utc::now()).await.unwrap().admitted, n);
    let groups = tollgate::store::pack_groups(&app.db.pool).await.unwrap();
    assert_eq!(groups.len(), 1, "{groups:?}");
    groups.into_iter().next().unwrap()
}

/// Opens pack `id` of `group` as a submitter does, holding it for a minute from `now`.
async fn open(
    app: &TestApp,
    id: &str,
    group: &tollgate::store::PackGroup,
    now: chrono::DateTime<Utc>,
) -> Vec<tollgate::model::Job> {
    let pack = tollgate::store::NewPack {
        id,
        group,
        max_lines: 100,
        max_bytes: 1 << 20,
        max_inputs: 100,
        lease_until: now + chrono::Duration::hours(2),
        submit_until: now + chrono::Duration::seconds(60),
    };
    tollgate::store::open_pack(&app.db.pool, &pack, now)
        .await
        .unwrap()
}

async fn pack_row(app: &TestApp, id: &str) -> (String, Option<String>) {
    sqlx::query_as("SELECT status, provider_batch_id FROM provider_batches WHERE id = $1")
        .bind(id)
        .fetch_one(&app.db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_submission_never_recorded_is_found_by_its_tag_and_adopted_not_sent_twice() {
    let app = TestApp::spawn_with(TestOptions {
        mock: mock(0, 0),
        roles: tollgate_api::broker::Roles::API_ONLY,
        extra_config: batch_api("") + &prices("gpt-4o-mini"),
        ..TestOptions::default()
    })
    .await;
    let providers = tollgate_workers::providers::Providers::from_config(&app.config).unwrap();
    let batcher = tollgate_workers::provider_batches::ProviderBatcher::new(
        app.db.pool.clone(),
        app.config.clone(),
        providers.clone(),
    );
    let now = Utc::now();
    let after_the_hold = now + chrono::Duration::seconds(61);

    // A submitter that died before the provider had its pack: abandoned, lines requeued.
    let group = admitted_for_a_pack(&app, 2).await;
    assert_eq!(open(&app, "pb_never_sent", &group, now).await.len(), 2);
    // Within its hold the pack is its submitter's.
    let step = batcher
        .run_once(now + chrono::Duration::seconds(30))
        .await
        .unwrap();
    assert_eq!((step.adopted, step.abandoned), (0, 0), "{step:?}");
    let step = batcher.run_once(after_the_hold).await.unwrap();
    assert_eq!(
        (step.adopted, step.abandoned, step.requeued),
        (0, 1, 2),
        "{step:?}"
    );
    assert_eq!(
        pack_row(&app, "pb_never_sent").await,
        ("abandoned".to_owned(), None)
    );

    // A submitter the provider answered, that died (or lost the database) before recording
    // the answer: the batch is found by its tag and adopted; its lines are not sent again.
    let group = admitted_for_a_pack(&app, 2).await;
    let jobs = open(&app, "pb_unrecorded", &group, now).await;
    let lines: Vec<(String, &Value)> = jobs.iter().map(|j| (j.id.to_string(), &j.request)).collect();
    let client = providers
        .batch_client(&group.provider, &group.model, group.key.as_deref())
        .unwrap();
    let sent = client
        .submit(&group.model, group.endpoint, &lines, "pb_unrecorded")
        .await
        .unwrap();
    let step = batcher.run_once(after_the_hold).await.unwrap();
    assert_eq!(
        (step.adopted, step.abandoned, step.requeued),
        (1, 0, 0),
        "{step:?}"
    );
    // Polled from then on (the same step may find it done already).
    let (status, provider_batch) = pack_row(&app, "pb_unrecorded").await;
    assert_eq!(provider_batch, Some(sent.batch_id.clone()));
    assert!(status == "in_progress" || status == "ended", "{status}");
    crate::harness::eventually(30, "the adopted pack to end", || async {
        batcher
            .run_once(Utc::now() + chrono::Duration::seconds(61))
            .await
            .ok()?;
        (pack_row(&app, "pb_unrecorded").await.0 == "ended").then_some(())
    })
    .await;
    let states: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT state::text, provider_batch_id FROM jobs WHERE id = ANY($1) ORDER BY id")
            .bind(jobs.iter().map(|j| j.id.0).collect::<Vec<_>>())
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(
        states,
        vec![("succeeded".to_owned(), Some("pb_unrecorded".to_owned())); 2]
    );
    // The provider holds that one batch only, and no online call was made.
    let listing: Value = app
        .http
        .get(format!("http://{}/v1/batches", app.mock_addr))
        .bearer_auth("sk-test-1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listing["data"].as_array().map(Vec::len), Some(1), "{listing}");
    assert_eq!(app.mock.stats().requests, 0);
    app.shutdown().await;
}
