//! End-to-end tests of the mock over real HTTP (server on 127.0.0.1:0, reqwest client).
//! Most use a pinned clock so limits, headers and waits are exact without sleeping.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::clock::{Clock, ManualClock};
use super::*;

mod batches;

struct Harness {
    base: String,
    client: reqwest::Client,
    provider: MockProvider,
    clock: Arc<ManualClock>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.tracker.close();
    }
}

fn start_wall() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap()
}

async fn start(toml: &str) -> Harness {
    start_at(toml, start_wall(), true).await
}

async fn start_at(toml: &str, wall: DateTime<Utc>, pinned: bool) -> Harness {
    let config = MockConfig::from_toml_str(toml).unwrap();
    let clock = ManualClock::new(wall);
    let provider = if pinned {
        MockProvider::with_clock(config, Clock::Manual(clock.clone()))
    } else {
        MockProvider::new(config)
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    tracker.spawn(provider.clone().serve(listener, cancel.clone()));
    Harness {
        base,
        client: reqwest::Client::new(),
        provider,
        clock,
        cancel,
        tracker,
    }
}

impl Harness {
    async fn openai(&self, key: &str, body: Value) -> reqwest::Response {
        self.client
            .post(format!("{}/v1/chat/completions", self.base))
            .bearer_auth(key)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn anthropic(&self, key: &str, body: Value) -> reqwest::Response {
        self.client
            .post(format!("{}/v1/messages", self.base))
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn stats(&self) -> MockStats {
        let r = self
            .client
            .get(format!("{}/mock/stats", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }

    fn advance(&self, d: Duration) {
        self.clock.advance(d);
    }
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .unwrap_or_else(|| panic!("missing header {name}"))
        .to_str()
        .unwrap()
}

fn header_u64(r: &reqwest::Response, name: &str) -> u64 {
    header(r, name).parse().unwrap()
}

/// 12 characters: 3 + (4 + 3) = 10 input tokens.
fn chat(max_tokens: Option<u64>) -> Value {
    let mut body = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hello world!"}],
    });
    if let Some(m) = max_tokens {
        body["max_tokens"] = json!(m);
    }
    body
}

/// 3 + (4 + 3) = 10 input tokens.
fn claude(max_tokens: u64) -> Value {
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello world!"}],
    })
}

const OPENAI: &str = r#"
[[projects]]
name = "oai"
kind = "openai"
keys = ["sk-1", "sk-2"]
revoked_keys = ["sk-revoked"]
models = ["gpt-4o-mini"]
rpm = 60
tpm = 1000
"#;

const ANTHROPIC: &str = r#"
[[projects]]
name = "ant"
kind = "anthropic"
keys = ["ak-1"]
revoked_keys = ["ak-revoked"]
rpm = 50
itpm = 30000
otpm = 8000
"#;

#[tokio::test]
async fn openai_success_shape_and_usage() {
    let h = start(OPENAI).await;
    let r = h.openai("sk-1", chat(Some(5))).await;
    assert_eq!(r.status(), 200);
    assert!(header(&r, "x-request-id").starts_with("req_"));
    header(&r, "openai-processing-ms").parse::<u64>().unwrap();
    let b: Value = r.json().await.unwrap();
    assert!(b["id"].as_str().unwrap().starts_with("chatcmpl-"));
    uuid::Uuid::parse_str(&b["id"].as_str().unwrap()["chatcmpl-".len()..]).unwrap();
    assert_eq!(b["object"], "chat.completion");
    assert_eq!(b["created"], start_wall().timestamp());
    assert_eq!(b["model"], "gpt-4o-mini");
    assert_eq!(b["choices"][0]["index"], 0);
    assert_eq!(b["choices"][0]["message"]["role"], "assistant");
    let text = b["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.split(' ').count(), 5);
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert_eq!(
        b["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15})
    );

    // No max_tokens: output_tokens (default 16), finish "stop"; max_completion_tokens wins.
    let b: Value = h.openai("sk-1", chat(None)).await.json().await.unwrap();
    assert_eq!(b["usage"]["completion_tokens"], 16);
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    let mut body = chat(Some(100));
    body["max_completion_tokens"] = json!(3);
    let b: Value = h.openai("sk-1", body).await.json().await.unwrap();
    assert_eq!(b["usage"]["completion_tokens"], 3);

    let s = h.stats().await;
    assert_eq!((s.requests, s.succeeded), (3, 3));
    let p = &s.projects["oai"];
    assert_eq!(p.requests_admitted, 3);
    assert_eq!(p.input_tokens_admitted, 30);
    assert_eq!(p.output_tokens_admitted, 5 + 16 + 3);
}

/// `n` choices as OpenAI answers them: n choices of up to the cap each, the prompt
/// counted once, completion tokens summed, TPM charged `input + n × max_tokens`.
#[tokio::test]
async fn openai_n_choices_are_generated_and_charged_n_times() {
    let h = start(OPENAI).await;
    let mut body = chat(Some(5));
    body["n"] = json!(3);
    let r = h.openai("sk-1", body).await;
    assert_eq!(r.status(), 200);
    // 1000 TPM - (10 input + 3 × 5 output).
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 1000 - 25);
    let b: Value = r.json().await.unwrap();
    let choices = b["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "lorem ipsum dolor sit amet");
        assert_eq!(c["finish_reason"], "length");
    }
    assert_eq!(
        b["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 15, "total_tokens": 25})
    );
    // Asking for more than the remaining TPM allows is a 429, nothing charged.
    let mut big = chat(Some(100));
    big["n"] = json!(10);
    assert_eq!(h.openai("sk-1", big).await.status(), 429);
    for bad in [json!(0), json!(129)] {
        let mut body = chat(Some(5));
        body["n"] = bad;
        assert_eq!(h.openai("sk-1", body).await.status(), 400);
    }
    let p = &h.stats().await.projects["oai"];
    assert_eq!(
        (
            p.requests_admitted,
            p.input_tokens_admitted,
            p.output_tokens_admitted
        ),
        (1, 10, 15)
    );
}

/// A stream of `n` choices: a role chunk per choice, their tokens interleaved, a finish
/// chunk per choice, the usage summed.
#[tokio::test]
async fn openai_streams_n_choices_side_by_side() {
    let h = start(OPENAI).await;
    let mut body = chat(Some(2));
    body["n"] = json!(2);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = sse_events(&h.openai("sk-1", body).await.text().await.unwrap());
    assert_eq!(events.len(), 2 + 4 + 2 + 1 + 1);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..9]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let index = |c: &Value| c["choices"][0]["index"].as_u64().unwrap();
    assert_eq!(
        chunks[..8].iter().map(index).collect::<Vec<_>>(),
        [0, 1, 0, 1, 0, 1, 0, 1]
    );
    for choice in 0..2 {
        let text: String = chunks[2..6]
            .iter()
            .filter(|c| index(c) == choice)
            .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(text, "lorem ipsum", "choice {choice}");
    }
    assert!(
        chunks[6..8]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"] == "length")
    );
    assert_eq!(
        chunks[8]["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14})
    );
    let s = stats_until(&h, "the stream to finish", |s| s.in_flight == 0).await;
    assert_eq!(s.streams_completed, 1);
    assert_eq!(s.projects["oai"].output_tokens_admitted, 4);
}

#[tokio::test]
async fn anthropic_success_shape_and_usage() {
    let h = start(ANTHROPIC).await;
    let body = json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "system": "You are terse.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}, {"type": "text", "text": "ij"}]},
        ],
    });
    let r = h.anthropic("ak-1", body).await;
    assert_eq!(r.status(), 200);
    assert!(header(&r, "request-id").starts_with("req_"));
    let b: Value = r.json().await.unwrap();
    assert!(b["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(b["type"], "message");
    assert_eq!(b["role"], "assistant");
    assert_eq!(b["model"], "claude-sonnet-4-5");
    assert_eq!(b["content"][0]["type"], "text");
    assert_eq!(b["content"][0]["text"].as_str().unwrap().split(' ').count(), 16);
    assert_eq!(b["stop_reason"], "end_turn");
    assert_eq!(b["stop_sequence"], Value::Null);
    // 3 + system (4 + ceil(14/4)=4) + message (4 + ceil(10/4)=3) = 18
    assert_eq!(b["usage"], json!({"input_tokens": 18, "output_tokens": 16}));

    let b: Value = h.anthropic("ak-1", claude(4)).await.json().await.unwrap();
    assert_eq!(b["stop_reason"], "max_tokens");
    assert_eq!(b["usage"]["output_tokens"], 4);
}

#[tokio::test]
async fn openai_headers_present_and_parse() {
    let h = start(OPENAI).await;
    let r = h.openai("sk-1", chat(Some(5))).await;
    assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 60);
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 59);
    assert_eq!(header_u64(&r, "x-ratelimit-limit-tokens"), 1000);
    // Charged input 10 + max_tokens 5.
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 985);
    // One request at 1/s; 15 tokens at 1000/60 per s = 0.9 s.
    assert_eq!(header(&r, "x-ratelimit-reset-requests"), "1s");
    assert_eq!(header(&r, "x-ratelimit-reset-tokens"), "900ms");
    assert_eq!(header(&r, "openai-organization"), "org-oai");

    h.advance(Duration::from_millis(500));
    let r = h.openai("sk-2", chat(Some(5))).await;
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 58);
    assert_eq!(header(&r, "x-ratelimit-reset-requests"), "1.5s");
    // 15 missing, 8.33 refilled, 15 more taken: 21.67 tokens at 16.67/s.
    assert_eq!(header(&r, "x-ratelimit-reset-tokens"), "1.3s");
}

#[tokio::test]
async fn anthropic_headers_present_and_parse() {
    let h = start(ANTHROPIC).await;
    let r = h.anthropic("ak-1", claude(1000)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header_u64(&r, "anthropic-ratelimit-requests-limit"), 50);
    assert_eq!(header_u64(&r, "anthropic-ratelimit-requests-remaining"), 49);
    assert_eq!(header_u64(&r, "anthropic-ratelimit-input-tokens-limit"), 30000);
    assert_eq!(
        header_u64(&r, "anthropic-ratelimit-input-tokens-remaining"),
        29990
    );
    assert_eq!(header_u64(&r, "anthropic-ratelimit-output-tokens-limit"), 8000);
    // Charged max_tokens 1000 at start, corrected to the 16 generated at the end.
    assert_eq!(
        header_u64(&r, "anthropic-ratelimit-output-tokens-remaining"),
        7984
    );
    assert_eq!(header_u64(&r, "anthropic-ratelimit-tokens-limit"), 38000);
    assert_eq!(
        header_u64(&r, "anthropic-ratelimit-tokens-remaining"),
        29990 + 7984
    );
    let reset = header(&r, "anthropic-ratelimit-requests-reset");
    assert!(reset.ends_with('Z') && !reset.contains('.'), "{reset}");
    // 1 request at 50/min refills in 1.2 s, rounded up to the second.
    let t = DateTime::parse_from_rfc3339(reset).unwrap();
    assert_eq!(t, start_wall() + chrono::Duration::seconds(2));
    for name in ["input-tokens", "output-tokens", "tokens"] {
        let v = header(&r, &format!("anthropic-ratelimit-{name}-reset"));
        DateTime::parse_from_rfc3339(v).unwrap();
    }
    assert_eq!(h.stats().await.projects["ant"].output_tokens_admitted, 16);
}

#[tokio::test]
async fn rpm_exhaustion_gives_exact_429_and_retry_after() {
    let h = start(
        r#"
        [[projects]]
        name = "oai"
        kind = "openai"
        keys = ["sk-1"]
        rpm = 2
        "#,
    )
    .await;
    for _ in 0..2 {
        assert_eq!(h.openai("sk-1", chat(None)).await.status(), 200);
    }
    let r = h.openai("sk-1", chat(None)).await;
    assert_eq!(r.status(), 429);
    // 2 per minute: one more fits after 30 s.
    assert_eq!(header(&r, "retry-after"), "30");
    assert_eq!(header(&r, "retry-after-ms"), "30000");
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 0);
    assert_eq!(header(&r, "x-ratelimit-reset-requests"), "1m0s");
    let b: Value = r.json().await.unwrap();
    assert_eq!(
        b,
        json!({"error": {
            "message": "Rate limit reached for gpt-4o-mini in organization org-oai on requests per min (RPM): Limit 2, Used 2, Requested 1. Please try again in 30s. Visit https://platform.openai.com/account/rate-limits to learn more.",
            "type": "requests",
            "param": null,
            "code": "rate_limit_exceeded",
        }})
    );

    h.advance(Duration::from_millis(29_999));
    assert_eq!(h.openai("sk-1", chat(None)).await.status(), 429);
    h.advance(Duration::from_millis(1));
    assert_eq!(h.openai("sk-1", chat(None)).await.status(), 200);
    let s = h.stats().await;
    assert_eq!(s.rate_limited_429, 2);
    assert_eq!(s.projects["oai"].rate_limited_429, 2);
    assert_eq!(s.limit_violations, 0);
}

#[tokio::test]
async fn anthropic_429_shape_and_retry_after() {
    let h = start(
        r#"
        [[projects]]
        name = "ant"
        kind = "anthropic"
        keys = ["ak-1"]
        itpm = 20000
        "#,
    )
    .await;
    let big = "x".repeat(4 * 15_000);
    let body = json!({"model": "c", "max_tokens": 10, "messages": [{"role": "user", "content": big}]});
    assert_eq!(h.anthropic("ak-1", body.clone()).await.status(), 200);
    let r = h.anthropic("ak-1", body).await;
    assert_eq!(r.status(), 429);
    let rid = header(&r, "request-id").to_owned();
    // 15,007 input tokens needed, 4,993 left, 20,000/min: 30.042 s.
    assert_eq!(header(&r, "retry-after"), "31");
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["type"], "error");
    assert_eq!(b["error"]["type"], "rate_limit_error");
    assert_eq!(b["request_id"], rid.as_str());
    let msg = b["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("This request would exceed the rate limit for your organization (org-ant) of 20,000 input tokens per minute."), "{msg}");
}

#[tokio::test]
async fn tpm_counts_max_tokens_and_too_large_is_final() {
    let h = start(
        r#"
        [[projects]]
        name = "oai"
        kind = "openai"
        keys = ["sk-1"]
        tpm = 100
        "#,
    )
    .await;
    // 10 input + 80 max_tokens = 90, although only 16 are generated.
    let r = h.openai("sk-1", chat(Some(80))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 10);
    let r = h.openai("sk-1", chat(Some(80))).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "tokens");
    assert_eq!(b["error"]["code"], "rate_limit_exceeded");
    let msg = b["error"]["message"].as_str().unwrap();
    // 90 needed, 10 left at 100/min: 48 s.
    assert!(
        msg.contains("on tokens per min (TPM): Limit 100, Used 90, Requested 90. Please try again in 48s."),
        "{msg}"
    );
    // Without max_tokens the default output_tokens (16) is charged: 26 > 10.
    assert_eq!(h.openai("sk-1", chat(None)).await.status(), 429);

    let r = h.openai("sk-1", chat(Some(200))).await;
    assert_eq!(r.status(), 429);
    assert!(!r.headers().contains_key("retry-after"));
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "tokens");
    assert_eq!(
        b["error"]["message"],
        "Request too large for gpt-4o-mini in organization org-oai on tokens per min (TPM): Limit 100, Requested 210. The input or output tokens must be reduced in order to run successfully. Visit https://platform.openai.com/account/rate-limits to learn more."
    );
}

#[tokio::test]
async fn keys_of_one_project_share_buckets() {
    let h = start(
        r#"
        [[projects]]
        name = "oai"
        kind = "openai"
        keys = ["sk-1", "sk-2"]
        rpm = 1
        [[projects]]
        name = "other"
        kind = "openai"
        keys = ["sk-3"]
        rpm = 1
        "#,
    )
    .await;
    assert_eq!(h.openai("sk-1", chat(None)).await.status(), 200);
    assert_eq!(h.openai("sk-2", chat(None)).await.status(), 429);
    assert_eq!(h.openai("sk-3", chat(None)).await.status(), 200);
}

#[tokio::test]
async fn revoked_and_unknown_keys_get_401() {
    let h = start(&format!("{OPENAI}{ANTHROPIC}")).await;
    for key in ["sk-revoked", "sk-nope", "ak-1"] {
        let r = h.openai(key, chat(None)).await;
        assert_eq!(r.status(), 401, "{key}");
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["code"], "invalid_api_key");
        assert_eq!(b["error"]["param"], Value::Null);
        assert!(!b["error"]["message"].as_str().unwrap().contains(key));
    }
    let r = h
        .client
        .post(format!("{}/v1/chat/completions", h.base))
        .json(&chat(None))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    for key in ["ak-revoked", "sk-1"] {
        let r = h.anthropic(key, claude(5)).await;
        assert_eq!(r.status(), 401);
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["type"], "error");
        assert_eq!(b["error"]["type"], "authentication_error");
        assert!(b["request_id"].as_str().unwrap().starts_with("req_"));
    }
    assert_eq!(h.stats().await.unauthorized, 6);
}

#[tokio::test]
async fn bad_requests_and_unknown_models() {
    let h = start(&format!("{OPENAI}{ANTHROPIC}")).await;
    let bad = |b: Value| {
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], Value::Null);
        assert_eq!(b["error"]["code"], Value::Null);
    };
    let r = h
        .client
        .post(format!("{}/v1/chat/completions", h.base))
        .bearer_auth("sk-1")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    bad(r.json().await.unwrap());
    let r = h.openai("sk-1", json!({"model": "gpt-4o-mini"})).await;
    assert_eq!(r.status(), 400);
    bad(r.json().await.unwrap());
    let r = h
        .openai("sk-1", json!({"messages": [{"role": "user", "content": "x"}]}))
        .await;
    assert_eq!(r.status(), 400);
    bad(r.json().await.unwrap());

    let mut body = chat(None);
    body["model"] = json!("gpt-5");
    let r = h.openai("sk-1", body).await;
    assert_eq!(r.status(), 404);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["code"], "model_not_found");

    let r = h
        .client
        .post(format!("{}/v1/messages", h.base))
        .header("x-api-key", "ak-1")
        .json(&claude(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "invalid_request_error");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("anthropic-version")
    );
    let r = h
        .anthropic(
            "ak-1",
            json!({"model": "c", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["message"], "max_tokens: Field required");

    let s = h.stats().await;
    assert_eq!((s.bad_request, s.not_found, s.succeeded), (5, 1, 0));
    // Nothing was charged.
    assert_eq!(s.projects["oai"].requests_admitted, 0);
}

#[tokio::test]
async fn fault_windows_fail_then_recover() {
    let h = start(&format!(
        r#"{OPENAI}{ANTHROPIC}
        [[faults]]
        project = "oai"
        start_ms = 1000
        duration_ms = 2000
        status = 503
        [[faults]]
        project = "ant"
        status = 529
        duration_ms = 1000
        [[faults]]
        status = 500
        probability = 0.0
        "#
    ))
    .await;
    assert_eq!(h.openai("sk-1", chat(None)).await.status(), 200);
    let r = h.anthropic("ak-1", claude(5)).await;
    assert_eq!(r.status(), 529);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["type"], "error");
    assert_eq!(
        b["error"],
        json!({"type": "overloaded_error", "message": "Overloaded"})
    );

    h.advance(Duration::from_millis(1000));
    assert_eq!(h.anthropic("ak-1", claude(5)).await.status(), 200);
    let r = h.openai("sk-1", chat(None)).await;
    assert_eq!(r.status(), 503);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "server_error");
    assert_eq!(b["error"]["code"], Value::Null);

    h.advance(Duration::from_millis(2000));
    assert_eq!(h.openai("sk-1", chat(None)).await.status(), 200);
    let s = h.stats().await;
    assert_eq!(s.faults_5xx, 2);
    // Faults are not charged to the buckets.
    assert_eq!(s.projects["oai"].requests_admitted, 2);
    assert_eq!(s.projects["ant"].faults_5xx, 1);
}

#[tokio::test]
async fn set_limits_halves_capacity() {
    let h = start(
        r#"
        [[projects]]
        name = "oai"
        kind = "openai"
        keys = ["sk-1"]
        rpm = 10
        "#,
    )
    .await;
    assert_eq!(h.openai("sk-1", chat(None)).await.status(), 200);
    assert!(h.provider.set_limits(
        "oai",
        ProjectLimits {
            rpm: 5,
            ..Default::default()
        }
    ));
    assert!(!h.provider.set_limits("nope", ProjectLimits::default()));
    // 9 left, clamped to the new capacity of 5.
    let r = h.openai("sk-1", chat(None)).await;
    assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 5);
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 4);
    for _ in 0..4 {
        assert_eq!(h.openai("sk-1", chat(None)).await.status(), 200);
    }
    let r = h.openai("sk-1", chat(None)).await;
    assert_eq!(r.status(), 429);
    // Refill is now 5/min: 12 s per request.
    assert_eq!(header(&r, "retry-after"), "12");

    // The HTTP route: full replacement, 0 / absent = unlimited.
    let r = h
        .client
        .post(format!("{}/mock/limits/oai", h.base))
        .json(&json!({"tpm": 1000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = h.openai("sk-1", chat(None)).await;
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("x-ratelimit-limit-requests"));
    assert_eq!(header_u64(&r, "x-ratelimit-limit-tokens"), 1000);
    let r = h
        .client
        .post(format!("{}/mock/limits/nope", h.base))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let s = h.stats().await;
    assert_eq!(s.projects["oai"].limits.tpm, 1000);
    assert_eq!(s.limit_violations, 0);
}

#[tokio::test]
async fn otpm_is_corrected_to_actual_output() {
    let h = start(
        r#"
        output_tokens = 10
        [[projects]]
        name = "ant"
        kind = "anthropic"
        keys = ["ak-1"]
        otpm = 100
        "#,
    )
    .await;
    // Each request reserves 60 but uses 10: without the correction the second would wait.
    for remaining in [90, 80, 70] {
        let r = h.anthropic("ak-1", claude(60)).await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            header_u64(&r, "anthropic-ratelimit-output-tokens-remaining"),
            remaining
        );
    }
    let r = h.anthropic("ak-1", claude(101)).await;
    assert_eq!(r.status(), 429);
    assert!(!r.headers().contains_key("retry-after"));
}

#[tokio::test]
async fn rpd_resets_at_utc_midnight() {
    let wall = Utc.with_ymd_and_hms(2026, 3, 1, 23, 59, 0).unwrap();
    let h = start_at(
        r#"
        [[projects]]
        name = "groq"
        kind = "openai"
        keys = ["gsk-1"]
        rpd = 2
        "#,
        wall,
        true,
    )
    .await;
    let r = h.openai("gsk-1", chat(None)).await;
    // Groq-like: the requests headers report the daily limit.
    assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 2);
    assert_eq!(header(&r, "x-ratelimit-reset-requests"), "1m0s");
    assert_eq!(h.openai("gsk-1", chat(None)).await.status(), 200);
    let r = h.openai("gsk-1", chat(None)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "retry-after"), "60");
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "requests");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("requests per day (RPD): Limit 2, Used 2")
    );
    h.advance(Duration::from_secs(60));
    assert_eq!(h.openai("gsk-1", chat(None)).await.status(), 200);
}

#[tokio::test]
async fn burst_with_moving_clock_has_no_limit_violations() {
    let h = Arc::new(
        start(
            r#"
            [[projects]]
            name = "oai"
            kind = "openai"
            keys = ["sk-1"]
            rpm = 30
            tpm = 600
            [[projects]]
            name = "ant"
            kind = "anthropic"
            keys = ["ak-1"]
            rpm = 40
            itpm = 300
            otpm = 400
            "#,
        )
        .await,
    );
    let tracker = TaskTracker::new();
    for i in 0..200u64 {
        let client = h.clone();
        tracker.spawn(async move {
            if i % 2 == 0 {
                client.openai("sk-1", chat(Some(i % 20 + 1))).await.status()
            } else {
                client.anthropic("ak-1", claude(i % 30 + 1)).await.status()
            }
        });
        if i % 10 == 0 {
            h.advance(Duration::from_millis(700));
        }
    }
    tracker.close();
    tracker.wait().await;
    let s = h.stats().await;
    assert_eq!(s.requests, 200);
    assert_eq!(s.succeeded + s.rate_limited_429, 200);
    assert!(s.rate_limited_429 > 0, "the burst should hit the limits");
    assert_eq!(s.limit_violations, 0);
    // 14 s passed: at most capacity + 14/60 of it.
    assert!(s.projects["oai"].requests_admitted <= 30 + 7);
    assert!(s.projects["ant"].requests_admitted <= 40 + 9);
}

#[tokio::test]
async fn burst_on_real_clock_has_no_limit_violations() {
    let h = Arc::new(
        start_at(
            r#"
            latency_ms = 20
            [[projects]]
            name = "oai"
            kind = "openai"
            keys = ["sk-1"]
            rpm = 100
            tpm = 2000
            "#,
            start_wall(),
            false,
        )
        .await,
    );
    let tracker = TaskTracker::new();
    for _ in 0..300 {
        let h = h.clone();
        tracker.spawn(async move { h.openai("sk-1", chat(Some(3))).await.status() });
    }
    tracker.close();
    tracker.wait().await;
    let s = h.stats().await;
    assert_eq!(s.limit_violations, 0);
    assert_eq!(s.succeeded + s.rate_limited_429, 300);
    assert!(s.projects["oai"].requests_admitted >= 100);
    assert!(s.max_in_flight >= 2, "{}", s.max_in_flight);
    assert_eq!(s.in_flight, 0);
}

#[tokio::test]
async fn no_headers_when_disabled() {
    let h = start(
        r#"
        send_rate_limit_headers = false
        [[projects]]
        name = "ds"
        kind = "openai"
        keys = ["sk-1"]
        rpm = 1
        tpm = 1000
        [[projects]]
        name = "ant"
        kind = "anthropic"
        keys = ["ak-1"]
        rpm = 1
        "#,
    )
    .await;
    let ok = h.openai("sk-1", chat(None)).await;
    let limited = h.openai("sk-1", chat(None)).await;
    assert_eq!((ok.status().as_u16(), limited.status().as_u16()), (200, 429));
    let a_ok = h.anthropic("ak-1", claude(5)).await;
    let a_limited = h.anthropic("ak-1", claude(5)).await;
    assert_eq!((a_ok.status().as_u16(), a_limited.status().as_u16()), (200, 429));
    for r in [&ok, &limited, &a_ok, &a_limited] {
        for name in r.headers().keys() {
            let n = name.as_str();
            assert!(!n.contains("ratelimit") && !n.starts_with("retry-after"), "{n}");
        }
    }
}

#[tokio::test]
async fn stats_reset_and_in_flight() {
    let h = start(
        r#"
        latency_ms = 200
        [[projects]]
        name = "oai"
        kind = "openai"
        keys = ["sk-1"]
        "#,
    )
    .await;
    let (a, b, c) = tokio::join!(
        h.openai("sk-1", chat(None)),
        h.openai("sk-1", chat(None)),
        h.openai("sk-1", chat(None)),
    );
    for r in [&a, &b, &c] {
        assert_eq!(r.status(), 200);
    }
    let s = h.stats().await;
    assert!(s.max_in_flight >= 2, "{}", s.max_in_flight);
    assert_eq!(s.projects["oai"].requests_admitted, 3);
    assert_eq!(s, h.provider.stats());
    let r = h
        .client
        .post(format!("{}/mock/reset", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let s = h.stats().await;
    assert_eq!((s.requests, s.succeeded, s.max_in_flight), (0, 0, 0));
    assert_eq!(s.projects["oai"].requests_admitted, 0);
}

#[tokio::test]
async fn serve_stops_on_cancel() {
    let h = start(OPENAI).await;
    h.cancel.cancel();
    h.tracker.close();
    tokio::time::timeout(Duration::from_secs(5), h.tracker.wait())
        .await
        .unwrap();
}

#[test]
fn config_defaults_and_validation() {
    let c = MockConfig::from_toml_str("").unwrap();
    assert_eq!(c.latency_ms, 0);
    assert_eq!(c.latency_per_output_token_us, 0);
    assert_eq!(c.output_tokens, 16);
    assert!(c.send_rate_limit_headers);
    assert!(c.projects.is_empty() && c.faults.is_empty());

    let c = MockConfig::from_toml_str(
        r#"
        [[projects]]
        name = "p"
        kind = "anthropic"
        keys = ["k"]
        [[faults]]
        duration_ms = 5
        "#,
    )
    .unwrap();
    assert_eq!(c.projects[0].limits(), ProjectLimits::default());
    assert_eq!(c.faults[0].status, 503);
    assert_eq!(c.faults[0].probability, 1.0);
    assert_eq!(c.faults[0].project, None);

    let invalid = |s: &str| matches!(MockConfig::from_toml_str(s), Err(MockConfigError::Invalid(_)));
    assert!(invalid(
        "[[projects]]\nname='a'\nkind='openai'\nkeys=['k']\n[[projects]]\nname='a'\nkind='openai'\nkeys=['j']"
    ));
    assert!(invalid(
        "[[projects]]\nname='a'\nkind='openai'\nkeys=['k']\n[[projects]]\nname='b'\nkind='anthropic'\nkeys=['k']"
    ));
    assert!(invalid("[[faults]]\nproject='x'"));
    assert!(invalid("[[faults]]\nstatus=429"));
    assert!(invalid("[[faults]]\nprobability=1.5"));
    assert!(matches!(
        MockConfig::from_toml_str("latency = 3"),
        Err(MockConfigError::Parse(_))
    ));
    assert!(matches!(
        MockConfig::from_toml_str("[[projects]]\nname='a'\nkind='cohere'\nkeys=[]"),
        Err(MockConfigError::Parse(_))
    ));
    assert!(matches!(
        MockConfig::load(std::path::Path::new("/nonexistent/mock.toml")),
        Err(MockConfigError::Read { .. })
    ));
}

// ---- streaming ----

/// The events of an SSE body: (event name, data) pairs.
fn sse_events(body: &str) -> Vec<(Option<String>, String)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let mut name = None;
            let mut data = String::new();
            for line in e.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    name = Some(v.to_owned());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data.push_str(v);
                } else {
                    panic!("unexpected line {line:?}");
                }
            }
            (name, data)
        })
        .collect()
}

/// Polls the stats until `done` holds (the mock settles a stream when hyper drops its
/// body, a moment after the client has read it).
async fn stats_until(h: &Harness, what: &str, done: impl Fn(&MockStats) -> bool) -> MockStats {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = h.provider.stats();
        if done(&s) {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn openai_stream_shape_and_usage_chunk() {
    let h = start(OPENAI).await;
    let mut body = chat(Some(3));
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = h.openai("sk-1", body.clone()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    assert!(header(&r, "x-request-id").starts_with("req_"));
    assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 60);
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 1000 - 13);
    let events = sse_events(&r.text().await.unwrap());
    assert!(events.iter().all(|(name, _)| name.is_none()));
    assert_eq!(events.len(), 1 + 3 + 1 + 1 + 1);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..6]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["created"], start_wall().timestamp());
        assert_eq!(c["model"], "gpt-4o-mini");
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(chunks[0]["choices"][0]["finish_reason"], Value::Null);
    // With include_usage every chunk carries "usage": null, as OpenAI does.
    assert_eq!(chunks[0]["usage"], Value::Null);
    assert!(chunks[0].as_object().unwrap().contains_key("usage"));
    let text: String = chunks[1..4]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        text, "lorem ipsum dolor",
        "tokens concatenate to the non-streaming text"
    );
    assert_eq!(chunks[4]["choices"][0]["delta"], json!({}));
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(
        chunks[5]["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13})
    );

    // Without include_usage: no usage chunk and no usage fields; finish "stop" at the default.
    let mut body = chat(None);
    body["stream"] = json!(true);
    let events = sse_events(&h.openai("sk-1", body).await.text().await.unwrap());
    assert_eq!(events.len(), 1 + 16 + 1 + 1);
    let finish: Value = serde_json::from_str(&events[17].1).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert!(events[..18].iter().all(|(_, d)| !d.contains("usage")));

    let s = stats_until(&h, "two finished streams", |s| s.in_flight == 0).await;
    assert_eq!((s.requests, s.succeeded), (2, 2));
    assert_eq!(
        (s.streams_started, s.streams_completed, s.streams_cancelled),
        (2, 2, 0)
    );
    assert_eq!(s.projects["oai"].output_tokens_admitted, 3 + 16);
}

#[tokio::test]
async fn anthropic_stream_shape() {
    let h = start(ANTHROPIC).await;
    let mut body = claude(4);
    body["stream"] = json!(true);
    let r = h.anthropic("ak-1", body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    assert!(header(&r, "request-id").starts_with("req_"));
    // The headers are sent at admission: OTPM still holds the max_tokens reservation.
    assert_eq!(
        header_u64(&r, "anthropic-ratelimit-output-tokens-remaining"),
        8000 - 4
    );
    let events = sse_events(&r.text().await.unwrap());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let data: Vec<Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    for (name, d) in names.iter().zip(&data) {
        assert_eq!(d["type"], *name);
    }
    let m = &data[0]["message"];
    assert!(m["id"].as_str().unwrap().starts_with("msg_01"));
    assert_eq!(
        (&m["type"], &m["role"], &m["model"]),
        (
            &json!("message"),
            &json!("assistant"),
            &json!("claude-sonnet-4-5")
        )
    );
    assert_eq!(m["content"], json!([]));
    assert_eq!(m["stop_reason"], Value::Null);
    assert_eq!(m["usage"], json!({"input_tokens": 10, "output_tokens": 1}));
    assert_eq!(
        data[1],
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    );
    let text: String = data[3..7]
        .iter()
        .map(|d| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(text, "lorem ipsum dolor sit");
    assert_eq!(data[7], json!({"type": "content_block_stop", "index": 0}));
    assert_eq!(
        data[8],
        json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
               "usage": {"output_tokens": 4}})
    );

    let mut body = claude(100);
    body["stream"] = json!(true);
    let events = sse_events(&h.anthropic("ak-1", body).await.text().await.unwrap());
    let delta: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(delta["usage"]["output_tokens"], 16);
    let s = stats_until(&h, "two finished streams", |s| s.in_flight == 0).await;
    assert_eq!(
        (s.streams_started, s.streams_completed, s.streams_cancelled),
        (2, 2, 0)
    );
    // OTPM was corrected to the output when each stream ended (the clock is pinned).
    assert_eq!(h.provider.inner.view(0).otpm.unwrap().remaining, 8000 - 4 - 16);
}

#[tokio::test]
async fn stream_latency_is_spent_between_tokens() {
    let h = start_at(
        r#"
        latency_ms = 50
        latency_per_output_token_us = 30000
        output_tokens = 4
        [[projects]]
        name = "oai"
        kind = "openai"
        keys = ["sk-1"]
        "#,
        start_wall(),
        false,
    )
    .await;
    let mut body = chat(None);
    body["stream"] = json!(true);
    let sent = std::time::Instant::now();
    let mut r = h.openai("sk-1", body).await;
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(piece) = r.chunk().await.unwrap() {
        arrivals.push(sent.elapsed());
        text.push_str(std::str::from_utf8(&piece).unwrap());
    }
    assert_eq!(sse_events(&text).len(), 1 + 4 + 1 + 1);
    // The events arrive spread out, not in one piece at the end.
    assert!(arrivals.len() >= 4, "{arrivals:?}");
    assert!(arrivals[0] >= Duration::from_millis(50), "{arrivals:?}");
    let last = *arrivals.last().unwrap();
    assert!(
        last - arrivals[0] >= Duration::from_millis(3 * 30),
        "{arrivals:?}"
    );
}

#[tokio::test]
async fn client_disconnect_midway_counts_what_was_produced() {
    // Pinned bucket clock (no refill), real sleeps between tokens.
    let h = start(
        r#"
        output_tokens = 1000
        latency_per_output_token_us = 5000
        [[projects]]
        name = "ant"
        kind = "anthropic"
        keys = ["ak-1"]
        otpm = 5000
        "#,
    )
    .await;
    let mut body = claude(1000);
    body["stream"] = json!(true);
    let mut r = h.anthropic("ak-1", body).await;
    assert_eq!(r.status(), 200);
    let mut text = String::new();
    while text.matches("content_block_delta").count() < 6 {
        text.push_str(std::str::from_utf8(&r.chunk().await.unwrap().unwrap()).unwrap());
    }
    let s = h.provider.stats();
    assert_eq!((s.streams_started, s.streams_cancelled, s.in_flight), (1, 0, 1));
    drop(r);
    let s = stats_until(&h, "the mock to notice the disconnect", |s| {
        s.streams_cancelled == 1
    })
    .await;
    assert_eq!((s.streams_completed, s.succeeded), (0, 1));
    let s = stats_until(&h, "in_flight back to 0", |s| s.in_flight == 0).await;
    let produced = s.projects["ant"].output_tokens_admitted;
    assert!((3..1000).contains(&produced), "produced {produced}");
    // OTPM was corrected to what was produced: only that stays charged.
    assert_eq!(h.provider.inner.view(0).otpm.unwrap().remaining, 5000 - produced);
}

#[tokio::test]
async fn stream_requests_are_admitted_like_others() {
    let h = start(
        r#"
        [[projects]]
        name = "oai"
        kind = "openai"
        keys = ["sk-1"]
        rpm = 1
        [[projects]]
        name = "ant"
        kind = "anthropic"
        keys = ["ak-1"]
        rpm = 1
        [[faults]]
        project = "ant"
        start_ms = 60000
        status = 529
        "#,
    )
    .await;
    let mut body = chat(Some(2));
    body["stream"] = json!(true);
    assert_eq!(h.openai("sk-1", body.clone()).await.status(), 200);
    let r = h.openai("sk-1", body.clone()).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "content-type"), "application/json");
    assert!(r.headers().contains_key("retry-after"));
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["code"], "rate_limit_exceeded");
    let r = h.openai("sk-bad", body.clone()).await;
    assert_eq!(r.status(), 401);

    let mut body = claude(2);
    body["stream"] = json!(true);
    assert_eq!(h.anthropic("ak-1", body.clone()).await.status(), 200);
    let r = h.anthropic("ak-1", body.clone()).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "content-type"), "application/json");
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "rate_limit_error");
    h.advance(Duration::from_secs(60));
    let r = h.anthropic("ak-1", body).await;
    assert_eq!(r.status(), 529);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "overloaded_error");

    let s = stats_until(&h, "streams to end", |s| s.in_flight == 0).await;
    assert_eq!((s.streams_started, s.rate_limited_429, s.faults_5xx), (2, 2, 1));
}

// ---- Gemini and Azure ----

const GEMINI: &str = r#"
[[projects]]
name = "gem"
kind = "gemini"
keys = ["g-1"]
revoked_keys = ["g-revoked"]
models = ["gemini-2.0-flash"]
rpm = 2
[[projects]]
name = "oai"
kind = "openai"
keys = ["sk-1"]
"#;

impl Harness {
    async fn gemini(&self, model: &str, key: Option<&str>, body: Value) -> reqwest::Response {
        let mut r = self
            .client
            .post(format!("{}/v1beta/models/{model}:generateContent", self.base))
            .json(&body);
        if let Some(key) = key {
            r = r.header("x-goog-api-key", key);
        }
        r.send().await.unwrap()
    }

    async fn azure(
        &self,
        deployment: &str,
        key: &str,
        version: Option<&str>,
        body: Value,
    ) -> reqwest::Response {
        let mut url = format!("{}/openai/deployments/{deployment}/chat/completions", self.base);
        if let Some(v) = version {
            url.push_str(&format!("?api-version={v}"));
        }
        self.client
            .post(url)
            .header("api-key", key)
            .json(&body)
            .send()
            .await
            .unwrap()
    }
}

/// 3 + (4 + 3) + system (4 + 1) = 15 input tokens.
fn gemini_body(max: u64) -> Value {
    json!({
        "systemInstruction": {"parts": [{"text": "be"}]},
        "contents": [{"role": "user", "parts": [{"text": "hello "}, {"text": "world!"}]}],
        "generationConfig": {"maxOutputTokens": max},
    })
}

#[tokio::test]
async fn gemini_calls_declared_functions_and_checks_their_responses() {
    let h = start("[[projects]]\nname = \"gem\"\nkind = \"gemini\"\nkeys = [\"g-1\"]\n").await;
    let tools = json!([{"functionDeclarations": [
        {"name": "other", "parametersJsonSchema": {"type": "object"}},
        {"name": "get_weather", "parametersJsonSchema": {"type": "object", "properties": {"city": {"type": "string"}}}}]}]);
    let ask = json!({"role": "user", "parts": [{"text": "Oslo?"}]});
    let call = json!({"role": "model", "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}]});
    let answer = |n: usize| {
        let part = json!({"functionResponse": {"name": "get_weather", "response": {"result": "sunny"}}});
        json!({"role": "user", "parts": vec![part; n]})
    };
    let body =
        |contents: Value, config: Value| json!({"contents": contents, "tools": tools, "toolConfig": config});
    let named = json!({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}});
    let r = h
        .gemini("gemini-2.0-flash", Some("g-1"), body(json!([ask]), named))
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["candidates"][0]["content"]["parts"][0]["functionCall"],
        json!({"name": "get_weather", "args": {"city": "mock"}})
    );
    // Answered, or told not to call: text.
    let none = json!({"functionCallingConfig": {"mode": "NONE"}});
    for (contents, config) in [(json!([ask, call, answer(1)]), json!({})), (json!([ask]), none)] {
        let r = h
            .gemini("gemini-2.0-flash", Some("g-1"), body(contents, config))
            .await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert!(
            v["candidates"][0]["content"]["parts"][0]["text"].is_string(),
            "{v}"
        );
    }
    // A response with no call before it, or one response for two calls: 400.
    let two_calls = json!({"role": "model", "parts": [call["parts"][0], call["parts"][0]]});
    for contents in [json!([ask, answer(1)]), json!([ask, two_calls, answer(1)])] {
        let r = h
            .gemini("gemini-2.0-flash", Some("g-1"), body(contents, json!({})))
            .await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["status"], "INVALID_ARGUMENT", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("function response"),
            "{v}"
        );
    }
}

#[tokio::test]
async fn gemini_success_errors_and_quota_429() {
    let h = start(GEMINI).await;
    let r = h.gemini("gemini-2.0-flash", Some("g-1"), gemini_body(3)).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()
            .keys()
            .all(|k| !k.as_str().contains("ratelimit") && k != "retry-after"),
        "Gemini sends no rate-limit headers: {:?}",
        r.headers()
    );
    let body: Value = r.json().await.unwrap();
    let c = &body["candidates"][0];
    assert_eq!(c["content"]["role"], "model");
    assert_eq!(c["content"]["parts"][0]["text"], "lorem ipsum dolor");
    assert_eq!(c["finishReason"], "MAX_TOKENS");
    assert_eq!(
        (
            &body["usageMetadata"]["promptTokenCount"],
            &body["usageMetadata"]["candidatesTokenCount"],
            &body["usageMetadata"]["totalTokenCount"]
        ),
        (&json!(15), &json!(3), &json!(18))
    );

    // Auth as Google answers it; an OpenAI key is not a Gemini key.
    let r = h.gemini("gemini-2.0-flash", None, gemini_body(3)).await;
    assert_eq!(r.status(), 403);
    let e: Value = r.json().await.unwrap();
    assert_eq!(
        (e["error"]["code"].as_u64(), e["error"]["status"].as_str()),
        (Some(403), Some("PERMISSION_DENIED"))
    );
    for key in ["nope", "sk-1"] {
        let r = h.gemini("gemini-2.0-flash", Some(key), gemini_body(3)).await;
        assert_eq!(r.status(), 400);
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["status"], "INVALID_ARGUMENT");
        assert_eq!(e["error"]["details"][0]["reason"], "API_KEY_INVALID");
    }
    let r = h
        .gemini("gemini-2.0-flash", Some("g-revoked"), gemini_body(3))
        .await;
    assert_eq!(r.status(), 403);
    let r = h.gemini("gemini-9", Some("g-1"), gemini_body(3)).await;
    assert_eq!(r.status(), 404);
    let r = h
        .gemini("gemini-2.0-flash", Some("g-1"), json!({"contents": []}))
        .await;
    assert_eq!(r.status(), 400);

    // rpm = 2: the second call is admitted, the third gets the quota 429.
    assert_eq!(
        h.gemini("gemini-2.0-flash", Some("g-1"), gemini_body(3))
            .await
            .status(),
        200
    );
    let r = h.gemini("gemini-2.0-flash", Some("g-1"), gemini_body(3)).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().get("retry-after").is_none());
    let bytes = r.bytes().await.unwrap();
    let e: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(e["error"]["code"], 429);
    assert_eq!(e["error"]["status"], "RESOURCE_EXHAUSTED");
    let violation = &e["error"]["details"][0]["violations"][0];
    assert_eq!(
        violation["quotaId"],
        "GenerateRequestsPerMinutePerProjectPerModel"
    );
    assert_eq!(violation["quotaValue"], "2");
    let delay = e["error"]["details"][2]["retryDelay"].as_str().unwrap();
    assert_eq!(delay, "30s", "a 2 RPM bucket refills one request in 30 s");
    // tollgate's own parser reads what the mock sent.
    let signals = tollgate::ratelimit::read(
        tollgate::vocab::Dialect::Gemini,
        &axum::http::HeaderMap::new(),
        &bytes,
        Utc::now(),
    );
    assert_eq!(signals.retry_after, Some(Duration::from_secs(30)));
    let rpm = signals.readings[0];
    assert_eq!(
        (rpm.name, rpm.limit),
        (tollgate::vocab::LimitName::Rpm, Some(2.0))
    );
    let s = h.stats().await;
    assert_eq!(
        (
            s.succeeded,
            s.rate_limited_429,
            s.unauthorized,
            s.not_found,
            s.bad_request
        ),
        (2, 1, 4, 1, 1)
    );
}

const AZURE: &str = r#"
[[projects]]
name = "az"
kind = "azure"
keys = ["az-1"]
models = ["gpt-4o-deploy"]
rpm = 1
tpm = 1000
[[projects]]
name = "oai"
kind = "openai"
keys = ["sk-1"]
"#;

#[tokio::test]
async fn azure_success_headers_and_string_code_429() {
    let h = start(AZURE).await;
    let r = h
        .azure("gpt-4o-deploy", "az-1", Some("2024-10-21"), chat(Some(4)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 0);
    // 10 input + 4 max output charged.
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 986);
    assert!(r.headers().get("x-ratelimit-limit-requests").is_none());
    assert!(!header(&r, "apim-request-id").is_empty());
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "gpt-4o-deploy");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14})
    );

    let r = h
        .azure("gpt-4o-deploy", "az-1", Some("2024-10-21"), chat(Some(4)))
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(header_u64(&r, "retry-after"), 60);
    assert_eq!(header_u64(&r, "retry-after-ms"), 60_000);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "429", "a string, not a number");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("API version 2024-10-21") && msg.contains("Please retry after 60 seconds"),
        "{msg}"
    );

    for (deployment, key, version, status, code) in [
        ("gpt-4o-deploy", "sk-1", Some("2024-10-21"), 401, "401"),
        ("gpt-4o-deploy", "az-1", None, 404, "404"),
        ("other", "az-1", Some("2024-10-21"), 404, "DeploymentNotFound"),
    ] {
        let r = h.azure(deployment, key, version, chat(Some(4))).await;
        assert_eq!(r.status(), status, "{deployment} {key} {version:?}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], code);
    }
    let s = h.stats().await;
    assert_eq!(
        (s.succeeded, s.rate_limited_429, s.unauthorized, s.not_found),
        (1, 1, 1, 2)
    );
}

const UNLIMITED: &str = r#"
[[projects]]
name = "oai"
kind = "openai"
keys = ["sk-1"]
[[projects]]
name = "ant"
kind = "anthropic"
keys = ["ak-1"]
"#;

fn with_mix(mix: &str) -> String {
    format!("{UNLIMITED}\n[fault_mix]\nseed = 42\n{mix}\n")
}

#[tokio::test]
async fn fault_mix_5xx_kinds_speak_each_api() {
    for (share, status, oai_type, ant_type) in [
        ("http_500", 500, "server_error", "api_error"),
        ("http_503", 503, "server_error", "api_error"),
        ("http_529", 529, "server_error", "overloaded_error"),
    ] {
        let h = start(&with_mix(&format!("{share} = 1.0"))).await;
        let r = h.openai("sk-1", chat(None)).await;
        assert_eq!(r.status().as_u16(), status, "{share}");
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["error"]["type"], oai_type, "{share}");
        let r = h.anthropic("ak-1", claude(5)).await;
        assert_eq!(r.status().as_u16(), status, "{share}");
        let b: Value = r.json().await.unwrap();
        assert_eq!(b["error"]["type"], ant_type, "{share}");
        let s = h.stats().await;
        assert_eq!(s.faults_injected.total(), 2, "{share}");
        // Nothing was admitted, so nothing was charged.
        assert_eq!(s.projects["oai"].requests_admitted, 0);
        assert_eq!(s.succeeded, 0);
    }
}

#[tokio::test]
async fn fault_mix_reset_closes_the_connection_without_a_reply() {
    let h = start(&with_mix("reset = 1.0")).await;
    let sent = h
        .client
        .post(format!("{}/v1/chat/completions", h.base))
        .bearer_auth("sk-1")
        .json(&chat(None))
        .send()
        .await;
    // Either the head never arrives, or the body breaks before its first byte.
    let failed = match sent {
        Err(e) => !e.is_timeout(),
        Ok(r) => r.bytes().await.is_err(),
    };
    assert!(failed, "a reset must not read as a complete reply");
    assert_eq!(h.stats().await.faults_injected.reset, 1);
}

#[tokio::test]
async fn fault_mix_hang_outlasts_the_client_timeout() {
    let h = start(&with_mix("hang = 1.0\nhang_ms = 10000")).await;
    let err = h
        .client
        .post(format!("{}/v1/messages", h.base))
        .header("x-api-key", "ak-1")
        .header("anthropic-version", "2023-06-01")
        .timeout(Duration::from_millis(200))
        .json(&claude(5))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let s = h.stats().await;
    assert_eq!((s.faults_injected.hang, s.succeeded), (1, 0));
}

#[tokio::test]
async fn fault_mix_spoils_bodies_it_was_told_to() {
    let h = start(&with_mix("non_json = 1.0")).await;
    let r = h.openai("sk-1", chat(None)).await;
    assert_eq!(r.status(), 200);
    assert!(header(&r, "content-type").starts_with("text/html"));
    assert!(serde_json::from_slice::<Value>(&r.bytes().await.unwrap()).is_err());

    let h = start(&with_mix("truncated = 1.0")).await;
    for r in [
        h.openai("sk-1", chat(None)).await,
        h.anthropic("ak-1", claude(5)).await,
    ] {
        assert_eq!(r.status(), 200);
        let body = r.bytes().await.unwrap();
        assert!(!body.is_empty());
        assert!(
            serde_json::from_slice::<Value>(&body).is_err(),
            "truncated JSON must not parse"
        );
    }
    let s = h.stats().await;
    // A truncated reply was served: it counts against the limits.
    assert_eq!(
        (s.faults_injected.truncated, s.projects["oai"].requests_admitted),
        (2, 1)
    );

    let h = start(&with_mix("no_usage = 1.0")).await;
    let oai: Value = h.openai("sk-1", chat(None)).await.json().await.unwrap();
    assert!(oai.get("usage").is_none() && oai["choices"][0]["message"]["content"].is_string());
    let ant: Value = h.anthropic("ak-1", claude(5)).await.json().await.unwrap();
    assert!(ant.get("usage").is_none() && ant["content"][0]["text"].is_string());
    // A stream is never spoiled.
    let mut streaming = chat(None);
    streaming["stream"] = json!(true);
    let r = h.openai("sk-1", streaming).await;
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("[DONE]"));
    assert_eq!(h.stats().await.faults_injected.no_usage, 3);
}

#[tokio::test]
async fn fault_mix_is_reproducible_by_seed_and_counts_every_fault() {
    let mix = with_mix("http_500 = 0.1\nhttp_503 = 0.1\nhttp_529 = 0.1\nnon_json = 0.1\nno_usage = 0.1");
    let mut runs = Vec::new();
    for _ in 0..2 {
        let h = start(&mix).await;
        let mut seen = Vec::new();
        for _ in 0..200 {
            let r = h.openai("sk-1", chat(None)).await;
            let html = header(&r, "content-type").starts_with("text/html");
            let body: Option<Value> = r.json().await.ok();
            seen.push((html, body.map(|b| b.get("usage").is_some())));
        }
        runs.push((seen, h.stats().await));
    }
    assert_eq!(runs[0].0, runs[1].0, "the same seed draws the same faults");
    let s = &runs[0].1;
    let f = s.faults_injected;
    assert_eq!(s.faults_injected, runs[1].1.faults_injected);
    for (kind, n) in [
        ("500", f.http_500),
        ("503", f.http_503),
        ("529", f.http_529),
        ("html", f.non_json),
        ("no usage", f.no_usage),
    ] {
        assert!(n > 0, "no {kind} fault in 200 draws at 10%");
    }
    assert_eq!((f.reset, f.hang, f.truncated), (0, 0, 0));
    // Every request either met a fault or succeeded with usage.
    assert_eq!(s.requests, 200);
    assert_eq!(
        s.succeeded,
        200 - f.http_500 - f.http_503 - f.http_529 - f.non_json
    );
    let with_usage = runs[0].0.iter().filter(|(_, u)| *u == Some(true)).count() as u64;
    assert_eq!(with_usage, 200 - f.total());
}

#[test]
fn fault_mix_shares_are_validated() {
    assert!(MockConfig::from_toml_str(&with_mix("reset = 0.6\nhang = 0.6")).is_err());
    assert!(MockConfig::from_toml_str(&with_mix("reset = -0.1")).is_err());
    let c = MockConfig::from_toml_str(&with_mix("reset = 0.5\nhang = 0.5")).unwrap();
    assert_eq!(c.fault_mix.seed, 42);
    assert_eq!(MockConfig::default().fault_mix, FaultMix::default());
}
