//! The HTTP edge against clients that do not play fair, over raw TCP where a polite
//! client library would hide what happens:
//!
//! - a client that sends half its headers, or sits on an idle keep-alive connection, is
//!   disconnected after `server.header_timeout_secs`;
//! - connections beyond `server.max_connections` get 503 `server_busy`, and the slots come
//!   back when their holders are cut off; one source holds at most
//!   `server.max_connections_per_source` of them;
//! - requests without a valid key are throttled per source (key guessing), refusals held
//!   a second, while a tenant with its key and the probes go on;
//! - stalled uploads hold no database connection, and their short fields are bounded;
//! - `/metrics` is nobody's without an admin key;
//! - U+0000 is refused at the edge in job bodies, bulk bodies and batch lines (one error
//!   line), and a provider's answer holding it is stored with it replaced, without
//!   failing the write it shares with other jobs' outcomes.

use std::time::Duration;

use axum::Json;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, timeout};
use tokio_util::task::TaskTracker;
use tollgate_api::broker::Roles;

use crate::batches::{batch_body, create_batch, line, multipart, upload};
use crate::harness::{ACME, TestApp, TestOptions, job};

/// Reads until the server closes the connection; what it sent meanwhile, or `None` if it
/// kept the connection open past `limit`.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> Option<String> {
    let mut got = Vec::new();
    let read = timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    read.ok().map(|()| String::from_utf8_lossy(&got).into_owned())
}

fn addr(app: &TestApp) -> String {
    app.api.trim_start_matches("http://").to_owned()
}

#[tokio::test]
async fn slow_headers_and_idle_connections_are_cut_off() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        server_config: "header_timeout_secs = 1".into(),
        ..TestOptions::default()
    })
    .await;
    // Slowloris: a request line and one header, then nothing.
    let mut slow = TcpStream::connect(addr(&app)).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let answered = read_until_closed(&mut slow, Duration::from_secs(20)).await;
    assert!(
        answered.is_some(),
        "a connection with half its headers was kept open for 20 s"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "cut off before the timeout"
    );

    // Keep-alive: one whole request answered, then silence.
    let mut idle = TcpStream::connect(addr(&app)).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answered = read_until_closed(&mut idle, Duration::from_secs(20))
        .await
        .expect("an idle keep-alive connection was kept open for 20 s");
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
    assert!(answered.ends_with("ok"), "{answered}");
}

#[tokio::test]
async fn connections_beyond_the_cap_are_refused_and_slots_come_back() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        server_config: "max_connections = 4\nheader_timeout_secs = 3".into(),
        ..TestOptions::default()
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(addr(&app)).await.unwrap());
    }
    let mut extra = TcpStream::connect(addr(&app)).await.unwrap();
    let answer = read_until_closed(&mut extra, Duration::from_secs(10))
        .await
        .expect("the connection over the cap was neither answered nor closed");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    let body: Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "server_busy", "{answer}");

    // The held connections send nothing, so the header timeout frees their slots.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = reqwest::get(app.url("/healthz")).await;
        if r.is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(Instant::now() < deadline, "the slots never came back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(held);
}

#[tokio::test]
async fn one_source_cannot_take_every_connection() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        server_config: "max_connections_per_source = 3".into(),
        ..TestOptions::default()
    })
    .await;
    let target: std::net::SocketAddr = addr(&app).parse().unwrap();
    let from_neighbour = || async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        socket.connect(target).await.unwrap()
    };
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(from_neighbour().await);
    }
    let mut extra = from_neighbour().await;
    let answer = read_until_closed(&mut extra, Duration::from_secs(10))
        .await
        .expect("the connection over the source's limit was neither answered nor closed");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("server_busy"), "{answer}");
    // Every other source is served while the neighbour holds its connections.
    let (status, body) = app.submit(ACME, &job("fast", "beside a greedy neighbour")).await;
    assert_eq!(status, 202, "{body}");
    // A connection the neighbour closes is its to use again.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut again = from_neighbour().await;
        again
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = read_until_closed(&mut again, Duration::from_secs(10))
            .await
            .unwrap_or_default();
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the closed connection's slot never came back: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(held);
}

#[tokio::test]
async fn key_guessing_is_throttled_per_source_and_tenants_go_on() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        server_config: "anonymous_rate_per_sec = 0.5\nanonymous_burst = 5".into(),
        ..TestOptions::default()
    })
    .await;
    let guess = |n: usize| {
        app.http
            .get(app.url("/v1/jobs"))
            .bearer_auth(format!("tk-guess-{n}"))
            .send()
    };
    for n in 0..5 {
        assert_eq!(guess(n).await.unwrap().status(), 401, "guess {n}");
    }
    let asked = Instant::now();
    let throttled = guess(5).await.unwrap();
    assert_eq!(throttled.status(), 429);
    // The refusal is held, so a loop waiting for its answers guesses once a second.
    assert!(
        asked.elapsed() >= tollgate_api::guard::REFUSAL_HOLD,
        "answered after {:?}",
        asked.elapsed()
    );
    assert!(throttled.headers().contains_key("retry-after"));
    let body: Value = throttled.json().await.unwrap();
    assert_eq!(body["error"]["code"], "api_rate_limited", "{body}");
    // No key at all is the same source's traffic.
    let r = app.http.get(app.url("/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 429);
    // The tenant with its key, and the probes, are not this source's throttle.
    let (status, _) = app.get(ACME, "/v1/jobs").await;
    assert_eq!(status, 200);
    for probe in ["/healthz", "/readyz"] {
        let r = app.http.get(app.url(probe)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{probe}");
    }
}

#[tokio::test]
async fn stalled_uploads_hold_no_database_connection_and_fields_are_bounded() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        server_config: "body_idle_timeout_secs = 120".into(),
        ..TestOptions::default()
    })
    .await;
    // More uploads than the API has connections (the harness gives it 10), each stalled
    // a few lines into its file.
    let (content_type, body) = multipart(
        "batch",
        "stalled.jsonl",
        line("s", "fast", "hi").repeat(4).as_bytes(),
    );
    let stalled_at = body.len() - 40;
    let mut stalled = Vec::new();
    for _ in 0..14 {
        let mut conn = TcpStream::connect(addr(&app)).await.unwrap();
        let head = format!(
            "POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ACME}\r\n\
             Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&body[..stalled_at]).await.unwrap();
        stalled.push(conn);
    }
    // For a second and more, no transaction sits open for them (one open for half a second
    // waits on its client; a broker's own between two statements is younger) ...
    let watch = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < watch {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND state = 'idle in transaction'
               AND xact_start < now() - interval '500 milliseconds'",
        )
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        assert_eq!(open, 0, "stalled uploads hold transactions");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ... and every other request gets a connection (it would wait out the pool's
    // acquire timeout and get 503 otherwise).
    for _ in 0..5 {
        let (status, body) = app.submit(ACME, &job("fast", "beside the stalled uploads")).await;
        assert_eq!(status, 202, "{body}");
    }
    drop(stalled);

    let (content_type, mut body) = multipart("batch", "big-field.jsonl", b"{}\n");
    let huge_purpose = format!(
        "--tollgate-test-boundary-5f1c9a\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\n{}\r\n",
        "x".repeat(64 * 1024)
    );
    body.splice(0..0, huge_purpose.into_bytes());
    let r = app
        .http
        .post(app.url("/v1/files"))
        .bearer_auth(ACME)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_multipart", "{body}");
}

/// Token counts are int4 columns; their sums and per-row totals must not overflow into a
/// 500 however large one job's estimate is.
#[tokio::test]
async fn metrics_survive_the_largest_estimates() {
    const ADMIN: &str = "tk-admin-edge-0123456789abcdef";
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        server_config: format!("admin_key = \"{ADMIN}\""),
        ..TestOptions::default()
    })
    .await;
    sqlx::query(
        "INSERT INTO jobs (id, tenant, class, priority, state, request, model, deadline, not_before, max_attempts,
                           estimated_input_tokens, estimated_output_tokens, created_at, admitted_at)
         SELECT gen_random_uuid(), 'acme', 'standard', 0, 'admitted', '{}'::jsonb, 'fast',
                now() + interval '1 hour', now(), 4, 2147483647, 2147483647, now(), now()
         FROM generate_series(1, 2)",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();
    let r = app
        .http
        .get(app.url("/metrics"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    let (status, body) = app.get(ADMIN, "/v1/status").await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn metrics_are_nobody_s_without_an_admin_key() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let anonymous = app.http.get(app.url("/metrics")).send().await.unwrap();
    assert_eq!(anonymous.status(), 403);
    let body: Value = anonymous.json().await.unwrap();
    assert_eq!(body["error"]["code"], "admin_only", "{body}");
    let tenant = app
        .http
        .get(app.url("/metrics"))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(tenant.status(), 403);
    let text = tenant.text().await.unwrap();
    assert!(!text.contains("acme"), "{text}");
}

#[tokio::test]
async fn answers_carry_protective_headers() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    for path in ["/dashboard", "/v1/jobs", "/no-such-path"] {
        let r = app
            .http
            .get(app.url(path))
            .bearer_auth(ACME)
            .send()
            .await
            .unwrap();
        let h = r.headers();
        assert_eq!(h["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(h["x-frame-options"], "DENY", "{path}");
        assert_eq!(h["referrer-policy"], "no-referrer", "{path}");
    }
    let page = app.http.get(app.url("/dashboard")).send().await.unwrap();
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    for directive in [
        "script-src 'self'",
        "frame-ancestors 'none'",
        "default-src 'none'",
    ] {
        assert!(csp.contains(directive), "{csp}");
    }
}

#[tokio::test]
async fn nul_is_refused_at_the_edge() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let mut in_message = job("fast", "a\u{0}b");
    let (status, body) = app.submit(ACME, &in_message).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("nul_character")),
        "{body}"
    );
    assert_eq!(body["error"]["param"], "/request/messages/0/content", "{body}");
    in_message = job("fast", "fine");
    in_message["metadata"] = json!({"k": "\u{0}"});
    let (status, body) = app.submit(ACME, &in_message).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("nul_character")),
        "{body}"
    );
    let (status, body) = app
        .post(
            ACME,
            "/v1/jobs/bulk",
            &json!({"jobs": [job("fast", "ok"), job("fast", "\u{0}")]}),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("nul_character")),
        "{body}"
    );
    let (_, jobs) = app.get(ACME, "/v1/jobs").await;
    assert_eq!(
        jobs["data"].as_array().map(Vec::len),
        Some(0),
        "a refused body left jobs: {jobs}"
    );

    // In a batch file: that line is an error line; the batch and its other lines stand.
    let file = format!(
        "{}\n{}\n",
        line("good", "fast", "hello"),
        line("bad", "fast", "x\u{0}y")
    );
    let (status, f) = upload(&app.http, &app.api, ACME, file.as_bytes()).await;
    assert_eq!(status, 200, "{f}");
    let (status, b) = create_batch(&app.http, &app.api, ACME, &batch_body(f["id"].as_str().unwrap())).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["request_counts"]["total"], 2, "{b}");
    assert_eq!(b["request_counts"]["failed"], 1, "{b}");
}

/// An OpenAI-shaped provider whose every answer holds U+0000; it lives as long as `tasks`.
async fn provider_answering_nul(tasks: &TaskTracker) -> std::net::SocketAddr {
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(|Json(request): Json<Value>| async move {
            Json(json!({
                "id": "chatcmpl-nul\u{0}", "object": "chat.completion", "created": 1,
                "model": request["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "before\u{0}after"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
            }))
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tasks.spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::test]
async fn a_provider_answer_with_nul_is_stored_scrubbed_and_fails_nobody_else() {
    let tasks = TaskTracker::new();
    let nul_provider = provider_answering_nul(&tasks).await;
    let app = TestApp::spawn_with(TestOptions {
        extra_config: format!(
            "[[providers]]\nname = \"odd\"\nkind = \"openai\"\nbase_url = \"http://{nul_provider}/v1\"\n\
             keys = [{{ name = \"o1\", value = \"sk-odd\" }}]\nmodels = [\"odd-model\"]\nlearn_limits = false\n"
        ),
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..40 {
        let model = if i % 8 == 0 { "odd/odd-model" } else { "fast" };
        let (status, body) = app.submit(ACME, &job(model, &format!("job {i}"))).await;
        assert_eq!(status, 202, "{body}");
        ids.push((model, body["id"].as_str().unwrap().to_owned()));
    }
    for (model, id) in &ids {
        let done = app.wait_job(ACME, id, 60).await;
        assert_eq!(done["state"], "succeeded", "{model}: {done}");
        assert_eq!(done["attempts"], 1, "{model} was called again: {done}");
        if model.starts_with("odd/") {
            assert_eq!(
                done["result"]["choices"][0]["message"]["content"], "before\u{FFFD}after",
                "{done}"
            );
        }
    }
}

/// A synchronous caller who hangs up before its answer leaves nothing behind: its job is
/// cancelled (never sent, its reservation given back), not kept until its deadline.
#[tokio::test]
async fn a_synchronous_caller_who_hangs_up_has_its_job_cancelled() {
    // No gate or dispatcher: the job can only wait, so the caller gives up first.
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    for stream in [false, true] {
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        let gave_up = impatient
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(ACME)
            .json(&json!({"model": "fast", "stream": stream, "max_tokens": 8,
                          "messages": [{"role": "user", "content": format!("gone {stream}")}]}))
            .send()
            .await;
        assert!(gave_up.is_err(), "the call cannot have been answered");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let states: Vec<String> = sqlx::query_scalar(
                "SELECT state::text FROM jobs WHERE request->'messages'->0->>'content' = $1",
            )
            .bind(format!("gone {stream}"))
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
            if states == ["cancelled"] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "stream {stream}: the abandoned job is {states:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Synchronous callers at once on three processes sharing one database are answered —
/// 200, or 429 with `Retry-After` — and never `503 database_unavailable` while the
/// database is healthy. (Admission on arrival once held a connection while waiting for
/// others, so arrivals side by side could starve their pool until its acquire timeout;
/// `gate::an_arrival_never_holds_a_connection_while_waiting_for_another` pins that.)
#[tokio::test(flavor = "multi_thread")]
async fn synchronous_callers_at_once_on_three_processes_never_get_503() {
    let app = TestApp::spawn_with(TestOptions {
        peers: 2,
        ..TestOptions::default()
    })
    .await;
    let peers = [app.spawn_peer(Roles::ALL).await, app.spawn_peer(Roles::ALL).await];
    let apis: Vec<String> = std::iter::once(app.api.clone())
        .chain(peers.iter().map(|p| format!("http://{}", p.addr.unwrap())))
        .collect();
    let calls = (0..256).map(|i| {
        app.http
            .post(format!("{}/v1/chat/completions", apis[i % apis.len()]))
            .bearer_auth(ACME)
            .json(&json!({"model": "fast", "messages": [{"role": "user", "content": format!("hi {i}")}], "max_tokens": 5}))
            .send()
    });
    let answers = futures::future::join_all(calls).await;
    let mut refused = Vec::new();
    for answer in answers {
        let answer = answer.expect("every caller is answered");
        let status = answer.status().as_u16();
        let retry_after = answer.headers().contains_key("retry-after");
        if status != 200 && !(status == 429 && retry_after) {
            refused.push((status, answer.text().await.unwrap_or_default()));
        }
    }
    assert!(refused.is_empty(), "{} callers got: {refused:?}", refused.len());
    for peer in peers {
        peer.shutdown().await;
    }
    app.shutdown().await;
}
