//! The life of a job through the API: submit, long-poll, result, and everything a client
//! can do to it along the way.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use tollgate_api::broker::Roles;

use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, eventually, job};

fn queue_only() -> TestOptions {
    TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    }
}

#[tokio::test]
async fn openai_job_is_accepted_then_completes_with_usage() {
    let app = TestApp::spawn().await;
    let (status, accepted) = app.submit(ACME, &job("oai/gpt-4o-mini", "hello there")).await;
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(accepted["object"], "job");
    assert!(matches!(
        accepted["state"].as_str(),
        Some("queued" | "running" | "succeeded")
    ));
    assert_eq!(accepted["class"], "standard");
    let id = accepted["id"].as_str().unwrap().to_owned();

    let done = app.wait_job(ACME, &id, 30).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["result"]["object"], "chat.completion");
    assert!(
        done["result"]["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
    );
    assert_eq!(done["provider"], "oai");
    assert_eq!(done["provider_model"], "gpt-4o-mini");
    assert_eq!(done["attempts"], 1);
    assert!(done["usage"]["input_tokens"].as_i64().unwrap() > 0);
    assert_eq!(done["usage"]["output_tokens"], 12);
    assert!(
        done["provider_request_id"]
            .as_str()
            .is_some_and(|r| r.starts_with("req_"))
    );
    assert!(done["error"].is_null());
    let stats = app.mock.stats();
    assert_eq!(stats.succeeded, 1);
    app.shutdown().await;
}

#[tokio::test]
async fn anthropic_target_is_translated_both_ways() {
    let app = TestApp::spawn().await;
    let mut body = job("ant/claude-3-5-haiku-latest", "hi");
    body["request"]["messages"] = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"}
    ]);
    let (status, accepted) = app.submit(GLOBEX, &body).await;
    assert_eq!(status, 202, "{accepted}");
    let done = app.wait_job(GLOBEX, accepted["id"].as_str().unwrap(), 30).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["provider"], "ant");
    let result = &done["result"];
    assert_eq!(result["object"], "chat.completion");
    assert!(result["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!(result["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        result["usage"]["total_tokens"].as_i64().unwrap(),
        result["usage"]["prompt_tokens"].as_i64().unwrap()
            + result["usage"]["completion_tokens"].as_i64().unwrap()
    );
    app.shutdown().await;
}

#[tokio::test]
async fn same_idempotency_key_returns_the_same_job() {
    let app = TestApp::spawn_with(queue_only()).await;
    let mut body = job("fast", "once");
    body["idempotency_key"] = json!("order-17");
    let (first_status, first) = app.submit(ACME, &body).await;
    let (second_status, second) = app.submit(ACME, &body).await;
    assert_eq!((first_status, second_status), (202, 200));
    assert_eq!(first["id"], second["id"]);

    // The key may also come as a header.
    let plain = job("fast", "header");
    let send = |b: &Value| {
        app.http
            .post(app.url("/v1/jobs"))
            .bearer_auth(ACME)
            .header("Idempotency-Key", "hdr-1")
            .json(b)
            .send()
    };
    let a = send(&plain).await.unwrap();
    let b = send(&plain).await.unwrap();
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (202, 200));

    // Reusing a key for a different request is a conflict, not a silent mix-up.
    let mut other = job("fast", "something else");
    other["idempotency_key"] = json!("order-17");
    let (status, err) = app.submit(ACME, &other).await;
    assert_eq!(status, 409, "{err}");
    assert_eq!(err["error"]["code"], "idempotency_key_reused");

    // Keys are per tenant: another tenant's same key is a new job.
    let (status, theirs) = app.submit(GLOBEX, &body).await;
    assert_eq!(status, 202);
    assert_ne!(theirs["id"], first["id"]);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(count, 3);
    app.shutdown().await;
}

#[tokio::test]
async fn submissions_side_by_side_are_each_written_once_and_a_shared_key_makes_one_job() {
    let app = TestApp::spawn_with(queue_only()).await;
    // 64 jobs and 8 submissions of one keyed job at once: single submissions are written
    // together, and one statement may hold several of the keyed ones.
    let mut keyed = job("fast", "keyed");
    keyed["idempotency_key"] = json!("burst-1");
    let plain: Vec<Value> = (0..64).map(|i| job("fast", &format!("plain {i}"))).collect();
    let (plain, keyed) = tokio::join!(
        futures::future::join_all(plain.iter().map(|b| app.submit(ACME, b))),
        futures::future::join_all((0..8).map(|_| app.submit(ACME, &keyed))),
    );
    assert!(plain.iter().all(|(status, _)| *status == 202), "{plain:?}");
    let ids: std::collections::HashSet<&str> = plain.iter().filter_map(|(_, b)| b["id"].as_str()).collect();
    assert_eq!(ids.len(), 64);
    let mut statuses: Vec<u16> = keyed.iter().map(|(status, _)| *status).collect();
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 200, 200, 202], "{keyed:?}");
    let keyed_ids: std::collections::HashSet<&str> =
        keyed.iter().filter_map(|(_, b)| b["id"].as_str()).collect();
    assert_eq!(keyed_ids.len(), 1, "{keyed:?}");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(count, 65);
    app.shutdown().await;
}

#[tokio::test]
async fn cancel_a_queued_job() {
    let app = TestApp::spawn_with(queue_only()).await;
    let (_, accepted) = app.submit(ACME, &job("fast", "cancel me")).await;
    let id = accepted["id"].as_str().unwrap();
    let (status, cancelled) = app.post(ACME, &format!("/v1/jobs/{id}/cancel"), &json!({})).await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "cancelled");
    assert_eq!(cancelled["error"]["code"], "cancelled");
    let (status, again) = app.post(ACME, &format!("/v1/jobs/{id}/cancel"), &json!({})).await;
    assert_eq!(status, 409);
    assert_eq!(again["error"]["code"], "job_already_finished");
    // A cancelled job is never claimed.
    let claimed = tollgate::store::claim_jobs(
        &app.db.pool,
        "t",
        10,
        Utc::now(),
        std::time::Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert!(claimed.is_empty());
    app.shutdown().await;
}

#[tokio::test]
async fn long_poll_returns_when_the_job_finishes() {
    let app = TestApp::spawn_with(queue_only()).await;
    let (_, accepted) = app.submit(ACME, &job("fast", "poll me")).await;
    let id = accepted["id"].as_str().unwrap().to_owned();
    // Without a wait the job is returned as it is now.
    let (status, now) = app.get(ACME, &format!("/v1/jobs/{id}")).await;
    assert_eq!((status, now["state"].as_str()), (200, Some("queued")));
    // A long-poll is waiting while another client cancels: it returns the terminal state.
    let poll = {
        let http = app.http.clone();
        let url = app.url(&format!("/v1/jobs/{id}?wait=25"));
        async move {
            http.get(url)
                .bearer_auth(ACME)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let cancel = async {
        // Let the poll subscribe first: it must see the job queued on its first read.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        app.post(ACME, &format!("/v1/jobs/{id}/cancel"), &json!({})).await
    };
    let started = std::time::Instant::now();
    let (polled, (cancel_status, _)) = tokio::join!(poll, cancel);
    assert_eq!(cancel_status, 200);
    assert_eq!(polled["state"], "cancelled");
    // It returned because of the cancellation, not because the wait ran out.
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    // A wait on a job that stays queued ends when the wait does, with the job as it is.
    let (_, other) = app.submit(ACME, &job("fast", "stays")).await;
    let (status, still) = app
        .get(
            ACME,
            &format!("/v1/jobs/{}?wait=0.3", other["id"].as_str().unwrap()),
        )
        .await;
    assert_eq!((status, still["state"].as_str()), (200, Some("queued")));
    app.shutdown().await;
}

#[tokio::test]
async fn tenants_see_only_their_own_jobs() {
    let app = TestApp::spawn_with(queue_only()).await;
    let (_, mine) = app.submit(ACME, &job("fast", "acme's")).await;
    let id = mine["id"].as_str().unwrap();
    let (status, err) = app.get(GLOBEX, &format!("/v1/jobs/{id}")).await;
    assert_eq!(status, 404, "{err}");
    assert_eq!(err["error"]["code"], "not_found");
    let (status, _) = app
        .post(GLOBEX, &format!("/v1/jobs/{id}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 404);
    let (_, theirs) = app.get(GLOBEX, "/v1/jobs").await;
    assert_eq!(theirs["data"].as_array().unwrap().len(), 0);
    let (_, ours) = app.get(ACME, "/v1/jobs").await;
    assert_eq!(ours["data"][0]["id"], mine["id"]);
    // The job is untouched by the other tenant's cancel.
    let (_, still) = app.get(ACME, &format!("/v1/jobs/{id}")).await;
    assert_eq!(still["state"], "queued");
    app.shutdown().await;
}

#[tokio::test]
async fn list_pages_newest_first_with_a_cursor() {
    let app = TestApp::spawn_with(queue_only()).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let (_, j) = app.submit(ACME, &job("fast", &format!("job {i}"))).await;
        ids.push(j["id"].as_str().unwrap().to_owned());
    }
    ids.reverse(); // newest first
    let (_, page1) = app.get(ACME, "/v1/jobs?limit=2").await;
    assert_eq!(page1["has_more"], true);
    let got: Vec<&str> = page1["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(got, ids[..2]);
    let after = page1["last_id"].as_str().unwrap();
    let (_, page2) = app.get(ACME, &format!("/v1/jobs?limit=2&after={after}")).await;
    let got: Vec<&str> = page2["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(got, ids[2..4]);
    let (_, page3) = app
        .get(
            ACME,
            &format!("/v1/jobs?limit=2&after={}", page2["last_id"].as_str().unwrap()),
        )
        .await;
    assert_eq!(page3["data"].as_array().unwrap().len(), 1);
    assert_eq!(page3["has_more"], false);
    // Filter by state.
    app.post(ACME, &format!("/v1/jobs/{}/cancel", ids[0]), &json!({}))
        .await;
    let (_, cancelled) = app.get(ACME, "/v1/jobs?state=cancelled").await;
    assert_eq!(cancelled["data"].as_array().unwrap().len(), 1);
    let (status, bad) = app.get(ACME, "/v1/jobs?limit=500").await;
    assert_eq!(
        (status, bad["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );
    app.shutdown().await;
}

#[tokio::test]
async fn chat_completions_endpoint_answers_synchronously() {
    let app = TestApp::spawn().await;
    let r = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(ACME)
        .json(&json!({"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let job_id = r
        .headers()
        .get("x-tollgate-job-id")
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(
        body["usage"]["completion_tokens"], 5,
        "max_tokens caps the mock's output"
    );
    // It went through the queue as an interactive job.
    let (_, j) = app.get(ACME, &format!("/v1/jobs/{job_id}")).await;
    assert_eq!(
        (j["class"].as_str(), j["state"].as_str()),
        (Some("interactive"), Some("succeeded"))
    );
    // It names the process its caller waited on (a job fetched later names none): should
    // that process die holding the call, the call is not sent again.
    let (_, fetched_later) = app.submit(ACME, &crate::harness::job("fast", "hi")).await;
    let callers: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT caller_process FROM jobs WHERE id = ANY(ARRAY[$1, $2]::uuid[]) ORDER BY id = $1::uuid DESC",
    )
    .bind(&job_id)
    .bind(fetched_later["id"].as_str().unwrap())
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert!(
        matches!(callers.as_slice(), [Some(process), None] if !process.is_empty()),
        "{callers:?}"
    );

    let r = app
        .http
        .post(app.url("/v1/chat/completions"))
        .bearer_auth(ACME)
        .json(&json!({"model": "gpt-99", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "unknown_model");
    assert_eq!(err["error"]["param"], "model");
    app.shutdown().await;
}

/// A synchronous caller is answered as its call returns, before the outcome is written;
/// what it does next with the job — read it, cancel it, list it — finds the outcome
/// written, however many callers race.
#[tokio::test]
async fn what_a_synchronous_caller_does_next_finds_its_answer_recorded() {
    let app = TestApp::spawn().await;
    let call = |n: usize| {
        let app = &app;
        async move {
            let r = app
                .http
                .post(app.url("/v1/chat/completions"))
                .bearer_auth(ACME)
                .json(&json!({"model": "fast", "messages": [{"role": "user", "content": format!("call {n}")}], "max_tokens": 5}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200);
            let id = r.headers()["x-tollgate-job-id"].to_str().unwrap().to_owned();
            let answer: Value = r.json().await.unwrap();
            let (_, job) = app.get(ACME, &format!("/v1/jobs/{id}")).await;
            assert_eq!(job["state"], "succeeded", "read right after its answer: {job}");
            assert_eq!(job["result"], answer, "the record is the answer the caller got");
            let (status, refused) = app.post(ACME, &format!("/v1/jobs/{id}/cancel"), &json!({})).await;
            assert_eq!(
                (status, refused["error"]["code"].as_str()),
                (409, Some("job_already_finished")),
                "cancelled right after its answer: {refused}"
            );
        }
    };
    futures::future::join_all((0..40).map(call)).await;
    let (_, jobs) = app.get(ACME, "/v1/jobs?state=succeeded&limit=100").await;
    assert_eq!(jobs["data"].as_array().unwrap().len(), 40);
    app.shutdown().await;
}

#[tokio::test]
async fn rate_limited_job_is_requeued_after_retry_after() {
    let mut mock = crate::harness::mock_config();
    mock.projects[0].rpm = 1; // the first request empties the bucket; the next waits ~60 s
    let app = TestApp::spawn_with(TestOptions {
        mock,
        ..TestOptions::default()
    })
    .await;
    let (_, first) = app.submit(ACME, &job("oai/gpt-4o-mini", "one")).await;
    let done = app.wait_job(ACME, first["id"].as_str().unwrap(), 30).await;
    assert_eq!(done["state"], "succeeded");
    let (_, second) = app.submit(ACME, &job("oai/gpt-4o-mini", "two")).await;
    let id = second["id"].as_str().unwrap().to_owned();
    let waiting = eventually(30, "the 429 to be seen and the job requeued", || async {
        let (_, j) = app.get(ACME, &format!("/v1/jobs/{id}")).await;
        (j["state"] == "queued" && j["attempts"] == 1).then_some(j)
    })
    .await;
    assert_eq!(waiting["error"]["code"], "rate_limited");
    // Retry-After is a lower bound: the job is not tried again before it.
    let not_before: DateTime<Utc> = waiting["not_before"].as_str().unwrap().parse().unwrap();
    assert!(
        not_before > Utc::now() + chrono::Duration::seconds(40),
        "not_before {not_before}"
    );
    assert_eq!(app.mock.stats().rate_limited_429, 1);
    let attempts: Vec<(String, Option<i32>)> =
        sqlx::query_as("SELECT outcome, status FROM job_attempts WHERE job_id = $1::uuid")
            .bind(&id)
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, vec![("failed".to_owned(), Some(429))]);
    app.shutdown().await;
}

#[tokio::test]
async fn revoked_key_fails_the_job_with_a_reason() {
    let app = TestApp::spawn_with(TestOptions {
        extra_config: String::new(),
        ..TestOptions::default()
    })
    .await;
    // Point a fresh broker config's key at a revoked key by submitting to a provider whose
    // only key is revoked: reuse the mock's revoked key through a direct provider call.
    let providers = tollgate_workers::providers::Providers::from_config(
        &tollgate::config::Config::parse(
            &crate::harness::config_text(app.mock_addr, "").replace("sk-test-1", "sk-revoked"),
            "revoked",
        )
        .unwrap(),
    )
    .unwrap();
    let chat = tollgate::vocab::Endpoint::ChatCompletions;
    let target = tollgate::routing::resolve(&app.config, "oai/gpt-4o-mini", chat)
        .unwrap()
        .remove(0);
    let outcome = providers
        .call(&target, chat, &job("oai/gpt-4o-mini", "x")["request"])
        .await;
    let failure = outcome.result.unwrap_err();
    assert_eq!(failure.code.as_str(), "upstream_auth_failed");
    assert!(!failure.class.is_retryable());
    assert_eq!(outcome.status, Some(401));
    app.shutdown().await;
}

#[tokio::test]
async fn a_synchronous_call_that_cannot_be_served_in_time_is_told_why_at_once() {
    let mut mock = crate::harness::mock_config();
    mock.projects[0].rpm = 1;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 1\n".into(),
        server_config: "sync_timeout_secs = 5".into(),
        ..TestOptions::default()
    })
    .await;
    let call = || {
        app.http
            .post(app.url("/v1/chat/completions"))
            .bearer_auth(ACME)
            .json(&json!({"model": "oai/gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}))
            .send()
    };
    assert_eq!(call().await.unwrap().status().as_u16(), 200);
    // The next request fits only in about a minute, after its 5 s deadline: 429 now, with
    // the limit that holds it.
    let r = call().await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    // Retry-After is when the limit is expected to allow it (about a minute), not a guess.
    let retry_after: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((30..=61).contains(&retry_after), "{retry_after}");
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "deadline_unmeetable");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("provider:oai:gpt-4o-mini:rpm"),
        "{err}"
    );
    assert_eq!(
        app.mock.stats().rate_limited_429,
        0,
        "the provider never saw the request"
    );
    app.shutdown().await;
}

#[tokio::test]
async fn a_providers_429_pauses_its_target_for_every_queued_job() {
    // tollgate knows no limit for this model; the provider allows 3 requests a minute.
    let mut mock = crate::harness::mock_config();
    mock.projects[0].rpm = 3;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        // One call at a time, so the 429 is seen before the next job could go.
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nconcurrency = 1\n".into(),
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..10 {
        let (_, j) = app.submit(ACME, &job("oai/gpt-4o-mini", &format!("p{i}"))).await;
        ids.push(j["id"].as_str().unwrap().to_owned());
    }
    eventually(30, "the 429 to pause the target", || async {
        let paused: Option<DateTime<Utc>> =
            sqlx::query_scalar("SELECT until FROM pauses WHERE scope = 'provider:oai:gpt-4o-mini'")
                .fetch_optional(&app.db.pool)
                .await
                .unwrap();
        paused
    })
    .await;
    // The other jobs wait for the Retry-After instead of each meeting a 429 of its own.
    let waiting = eventually(30, "the queued jobs to explain the pause", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE state = 'queued' AND admission->>'reason' = 'provider_rate_limited'",
        )
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        (n >= 5).then_some(n)
    })
    .await;
    assert!(waiting >= 5);
    let stats = app.mock.stats();
    assert_eq!(stats.succeeded, 3);
    assert_eq!(stats.rate_limited_429, 1, "one 429, not one per queued job");
    app.shutdown().await;
}
