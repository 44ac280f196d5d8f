//! Bad input gets a 4xx with a stable `code` — never a 5xx, never a panic.

use serde_json::{Value, json};
use tollgate_api::broker::Roles;

use crate::harness::{ACME, TestApp, TestOptions, job};

struct Case {
    name: &'static str,
    key: Option<&'static str>,
    path: &'static str,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
}

fn case(name: &'static str, body: Value, status: u16, code: &'static str) -> Case {
    Case {
        name,
        key: Some(ACME),
        path: "/v1/jobs",
        body: serde_json::to_vec(&body).unwrap(),
        status,
        code,
    }
}

#[tokio::test]
async fn bad_requests_get_4xx_with_stable_codes() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let with = |f: &dyn Fn(&mut Value)| {
        let mut b = job("fast", "hi");
        f(&mut b);
        b
    };
    let cases = vec![
        Case {
            name: "invalid JSON",
            body: b"{\"request\": ".to_vec(),
            ..case("", json!(null), 400, "invalid_json")
        },
        case("body is not an object", json!([1, 2]), 400, "invalid_request"),
        case(
            "missing request",
            json!({"class": "batch"}),
            400,
            "invalid_request",
        ),
        case(
            "missing messages",
            with(&|b| {
                b["request"].as_object_mut().unwrap().remove("messages");
            }),
            400,
            "missing_field",
        ),
        case(
            "empty messages",
            with(&|b| b["request"]["messages"] = json!([])),
            400,
            "invalid_request",
        ),
        case(
            "messages wrong type",
            with(&|b| b["request"]["messages"] = json!("hi")),
            400,
            "invalid_request",
        ),
        case(
            "message without role",
            with(&|b| b["request"]["messages"] = json!([{"content": "x"}])),
            400,
            "invalid_request",
        ),
        case(
            "content wrong type",
            with(&|b| b["request"]["messages"][0]["content"] = json!(5)),
            400,
            "invalid_request",
        ),
        case(
            "missing model",
            with(&|b| {
                b["request"].as_object_mut().unwrap().remove("model");
            }),
            400,
            "missing_field",
        ),
        case(
            "model wrong type",
            with(&|b| b["request"]["model"] = json!(7)),
            400,
            "invalid_request",
        ),
        case(
            "unknown model",
            with(&|b| b["request"]["model"] = json!("gpt-99")),
            400,
            "unknown_model",
        ),
        case(
            "unknown provider model",
            with(&|b| b["request"]["model"] = json!("oai/gpt-99")),
            400,
            "unknown_model",
        ),
        case(
            "max_tokens zero",
            with(&|b| b["request"]["max_tokens"] = json!(0)),
            400,
            "invalid_request",
        ),
        case(
            "n out of range",
            with(&|b| b["request"]["n"] = json!(0)),
            400,
            "invalid_request",
        ),
        case(
            "service tier billed above standard",
            with(&|b| b["request"]["service_tier"] = json!("priority")),
            400,
            "unsupported_field",
        ),
        case(
            "audio input part",
            with(&|b| {
                b["request"]["messages"][0]["content"] =
                    json!([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
            }),
            400,
            "unsupported_field",
        ),
        case(
            "priority wrong type",
            with(&|b| b["priority"] = json!("high")),
            400,
            "invalid_request",
        ),
        case(
            "priority out of range",
            with(&|b| b["priority"] = json!(5000)),
            400,
            "invalid_request",
        ),
        case(
            "unknown class",
            with(&|b| b["class"] = json!("urgent")),
            400,
            "invalid_request",
        ),
        case(
            "deadline not a date",
            with(&|b| b["deadline"] = json!("tomorrow")),
            400,
            "invalid_request",
        ),
        case(
            "deadline in the past",
            with(&|b| b["deadline"] = json!("2001-01-01T00:00:00Z")),
            400,
            "invalid_deadline",
        ),
        case(
            "unknown field",
            with(&|b| b["colour"] = json!("red")),
            400,
            "invalid_request",
        ),
        case(
            "metadata not an object",
            with(&|b| b["metadata"] = json!([1])),
            400,
            "invalid_request",
        ),
        case(
            "empty idempotency key",
            with(&|b| b["idempotency_key"] = json!("")),
            400,
            "invalid_request",
        ),
        case(
            "streaming job",
            with(&|b| b["request"]["stream"] = json!(true)),
            400,
            "stream_not_supported",
        ),
        case(
            "body over the limit",
            with(&|b| b["request"]["messages"][0]["content"] = json!("x".repeat(100_000))),
            413,
            "body_too_large",
        ),
        Case {
            key: None,
            ..case("no key", job("fast", "hi"), 401, "missing_api_key")
        },
        Case {
            key: Some("tk-wrong"),
            ..case("wrong key", job("fast", "hi"), 401, "invalid_api_key")
        },
        Case {
            path: "/v1/chat/completions",
            body: b"not json".to_vec(),
            ..case("chat: invalid JSON", json!(null), 400, "invalid_json")
        },
        Case {
            path: "/v1/chat/completions",
            ..case(
                "chat: missing messages",
                json!({"model": "fast"}),
                400,
                "missing_field",
            )
        },
        Case {
            path: "/v1/chat/completions",
            ..case(
                "chat: audio output",
                json!({"model": "fast", "messages": [{"role": "user", "content": "hi"}],
                       "modalities": ["text", "audio"]}),
                400,
                "unsupported_field",
            )
        },
        Case {
            path: "/v1/nothing",
            ..case("unknown endpoint", json!({}), 404, "no_such_endpoint")
        },
    ];
    for c in cases {
        let mut req = app
            .http
            .post(app.url(c.path))
            .header("content-type", "application/json")
            .body(c.body.clone());
        if let Some(key) = c.key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        assert_eq!(status, c.status, "{}: {body}", c.name);
        assert_eq!(body["error"]["code"], c.code, "{}: {body}", c.name);
        assert!(
            body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}: {body}",
            c.name
        );
    }
    // Reads too: a malformed id is simply not found; a bad wait is a 400.
    let (status, body) = app.get(ACME, "/v1/jobs/not-a-uuid").await;
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("not_found")));
    let (_, accepted) = app.submit(ACME, &job("fast", "hi")).await;
    let (status, body) = app
        .get(
            ACME,
            &format!("/v1/jobs/{}?wait=-1", accepted["id"].as_str().unwrap()),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );
    let (status, _) = app.get(ACME, "/v1/jobs?state=exploded").await;
    assert_eq!(status, 400);
    // Nothing half-written: only the one valid job exists.
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
    app.shutdown().await;
}
