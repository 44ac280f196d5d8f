//! `POST /v1/jobs/bulk`: many jobs in one request, all of them or none.

use serde_json::{Value, json};

use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, eventually, job};

async fn count_jobs(app: &TestApp, tenant: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM jobs WHERE tenant = $1")
        .bind(tenant)
        .fetch_one(&app.db.pool)
        .await
        .expect("count jobs")
}

fn jobs(n: usize, key_prefix: Option<&str>) -> Vec<Value> {
    (0..n)
        .map(|i| {
            let mut j = job("fast", &format!("bulk {i}"));
            if let Some(p) = key_prefix {
                j["idempotency_key"] = json!(format!("{p}-{i}"));
            }
            j
        })
        .collect()
}

#[tokio::test]
async fn a_bulk_submission_queues_every_job_and_each_finishes() {
    let app = TestApp::spawn().await;
    let (status, body) = app
        .post(ACME, "/v1/jobs/bulk", &json!({"jobs": jobs(300, None)}))
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["created"], 300);
    assert_eq!(body["existing"], 0);
    let ids: Vec<String> = body["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|d| d["id"].as_str().expect("id").to_owned())
        .collect();
    assert_eq!(ids.len(), 300);
    let done: i64 = eventually(60, "every bulk job to succeed", || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM jobs WHERE id::text = ANY($1) AND state = 'succeeded'")
                .bind(&ids)
                .fetch_one(&app.db.pool)
                .await
                .expect("count");
        (n == 300).then_some(n)
    })
    .await;
    assert_eq!(done, 300);
    // Each id is the tenant's job, readable as any other.
    let (status, one) = app.get(ACME, &format!("/v1/jobs/{}", ids[17])).await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["state"], "succeeded");
    // In the order sent: item 17 is the job holding "bulk 17".
    let text: String =
        sqlx::query_scalar("SELECT request->'messages'->0->>'content' FROM jobs WHERE id::text = $1")
            .bind(&ids[17])
            .fetch_one(&app.db.pool)
            .await
            .expect("stored request");
    assert_eq!(text, "bulk 17");
    let (status, _) = app.get(GLOBEX, &format!("/v1/jobs/{}", ids[17])).await;
    assert_eq!(status, 404, "another tenant must not see it");
    app.shutdown().await;
}

#[tokio::test]
async fn one_bad_item_rejects_the_whole_request_and_names_it() {
    let app = TestApp::spawn().await;
    let mut items = jobs(50, None);
    items[3]["request"]["model"] = json!("no-such-model");
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({"jobs": items})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "unknown_model");
    assert_eq!(body["error"]["param"], "jobs[3].request.model");

    let mut items = jobs(50, None);
    items[49]["priority"] = json!(5000);
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({"jobs": items})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "jobs[49].priority");

    let mut items = jobs(5, None);
    items[2] = json!({"request": {"model": "fast"}, "surprise": 1});
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({"jobs": items})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "jobs[2]");

    for (bad, code) in [
        (json!({"jobs": []}), "too_many_jobs"),
        (json!({"jobs": "x"}), "invalid_request"),
        (json!([1, 2]), "invalid_request"),
        (json!({"jobs": jobs(2, None), "more": 1}), "invalid_request"),
    ] {
        let (status, body) = app.post(ACME, "/v1/jobs/bulk", &bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(body["error"]["code"], code, "{bad}: {body}");
    }
    let r = app
        .http
        .post(app.url("/v1/jobs/bulk"))
        .bearer_auth(ACME)
        .body("{\"jobs\": [")
        .send()
        .await
        .expect("POST");
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(count_jobs(&app, "acme").await, 0, "nothing may be half-written");
    app.shutdown().await;
}

#[tokio::test]
async fn bulk_limits_on_count_and_size_are_clear() {
    let app = TestApp::spawn_with(TestOptions {
        server_config: "max_bulk_jobs = 20\nmax_bulk_body_bytes = 4096".into(),
        ..TestOptions::default()
    })
    .await;
    let (status, body) = app
        .post(ACME, "/v1/jobs/bulk", &json!({"jobs": jobs(21, None)}))
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "too_many_jobs");
    let mut big = jobs(2, None);
    big[0]["metadata"] = json!({"pad": "x".repeat(5000)});
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({"jobs": big})).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "body_too_large");
    assert_eq!(count_jobs(&app, "acme").await, 0);
    app.shutdown().await;
}

/// Each item is one job, and may be no larger than one job's body (`server.max_body_bytes`,
/// 64 KiB here): a bulk once let a single item be as large as the whole bulk limit.
#[tokio::test]
async fn an_item_larger_than_one_job_may_be_is_refused_by_its_index() {
    let app = TestApp::spawn_with(TestOptions {
        roles: tollgate_api::broker::Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let mut items = jobs(5, None);
    items[3] = job("fast", &"x".repeat(70_000));
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({"jobs": items})).await;
    assert_eq!(
        (
            status,
            body["error"]["code"].as_str(),
            body["error"]["param"].as_str()
        ),
        (413, Some("item_too_large"), Some("jobs[3]")),
        "{body}"
    );
    assert_eq!(count_jobs(&app, "acme").await, 0, "nothing may be written");
    // Just under the limit, the same item is taken.
    items[3] = job("fast", &"x".repeat(60_000));
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({"jobs": items})).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(count_jobs(&app, "acme").await, 5);
    app.shutdown().await;
}

#[tokio::test]
async fn idempotency_keys_replay_and_a_reused_key_rolls_back_everything() {
    let app = TestApp::spawn_with(TestOptions {
        roles: tollgate_api::broker::Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let first = json!({"jobs": jobs(10, Some("k"))});
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &first).await;
    assert_eq!(status, 202, "{body}");
    let ids: Vec<Value> = body["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|d| d["id"].clone())
        .collect();

    // The same request again: the same jobs, nothing new.
    let (status, again) = app.post(ACME, "/v1/jobs/bulk", &first).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["created"], 0);
    assert_eq!(again["existing"], 10);
    let replayed: Vec<Value> = again["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|d| d["id"].clone())
        .collect();
    assert_eq!(replayed, ids);

    // Five new jobs plus one old key with another request: refused, and the five are not kept.
    let mut mixed = jobs(5, Some("new"));
    let mut reused = job("fast", "something else");
    reused["idempotency_key"] = json!("k-4");
    mixed.push(reused);
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({"jobs": mixed})).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "idempotency_key_reused");
    assert_eq!(body["error"]["param"], "jobs[5].idempotency_key");
    assert_eq!(count_jobs(&app, "acme").await, 10);

    // Two items sharing a key in one request.
    let mut twins = jobs(2, Some("twin"));
    twins[1]["idempotency_key"] = json!("twin-0");
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({"jobs": twins})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "duplicate_idempotency_key");
    assert_eq!(body["error"]["param"], "jobs[1].idempotency_key");

    // Keys are per tenant: another tenant may use the same ones.
    let (status, body) = app.post(GLOBEX, "/v1/jobs/bulk", &first).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["created"], 10);
    app.shutdown().await;
}

#[tokio::test]
async fn the_gate_starts_what_its_dispatcher_has_room_for_and_the_rest_is_claimed() {
    // 300 jobs in one commit: the gate starts what this process's dispatcher has room for
    // in the admission's own write, and admits the rest for any dispatcher to claim.
    let app = TestApp::spawn().await;
    let (status, body) = app
        .post(ACME, "/v1/jobs/bulk", &json!({"jobs": jobs(300, None)}))
        .await;
    assert_eq!(status, 202, "{body}");
    eventually(60, "every job to succeed", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'")
            .fetch_one(&app.db.pool)
            .await
            .expect("count");
        (n == 300).then_some(())
    })
    .await;
    // Started by the gate: its admission wrote `started_at` with the same timestamp.
    // Claimed: any other `started_at` — the claim stamps its dispatcher's `now`, which may
    // have been taken just before the gate's round stamped `admitted_at`.
    let (started, claimed): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE started_at = admitted_at), count(*) FILTER (WHERE started_at <> admitted_at)
         FROM jobs",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("paths");
    assert!(started > 0 && started <= 300, "started by the gate: {started}");
    assert_eq!(
        started + claimed,
        300,
        "every job was started one way or the other"
    );
    // Either way, exactly one call per job, recorded once.
    let attempts: Vec<(i64,)> = sqlx::query_as("SELECT count(*) FROM job_attempts GROUP BY job_id")
        .fetch_all(&app.db.pool)
        .await
        .expect("attempts");
    assert_eq!(attempts.len(), 300);
    assert!(attempts.iter().all(|(n,)| *n == 1), "one attempt each");
    assert_eq!(app.mock.stats().requests, 300, "one provider call per job");
    app.shutdown().await;
}

/// Two bulks sharing idempotency keys, sent at once in opposite orders, once took each
/// other's key locks in opposite orders and deadlocked (40P01). Both must be answered, and
/// each key must name one job.
#[tokio::test(flavor = "multi_thread")]
async fn bulks_sharing_keys_in_opposite_orders_do_not_deadlock() {
    let app = TestApp::spawn_with(TestOptions {
        roles: tollgate_api::broker::Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    const KEYS: usize = 300;
    for round in 0..4 {
        let items = |reverse: bool| {
            let mut items: Vec<Value> = (0..KEYS)
                .map(|i| {
                    let mut j = job("fast", &format!("shared {round} {i}"));
                    j["idempotency_key"] = json!(format!("r{round}-k{i:04}"));
                    j
                })
                .collect();
            if reverse {
                items.reverse();
            }
            json!({ "jobs": items })
        };
        let (forward, backward) = (items(false), items(true));
        let ((a, body_a), (b, body_b)) = tokio::join!(
            app.post(ACME, "/v1/jobs/bulk", &forward),
            app.post(ACME, "/v1/jobs/bulk", &backward),
        );
        // One inserts (202), the other finds every key taken (200) or some of each (202).
        for (status, body) in [(a, &body_a), (b, &body_b)] {
            assert!(
                matches!(status, 200 | 202),
                "round {round}: {status} {}",
                body["error"]
            );
        }
        assert_eq!(
            body_a["created"].as_u64().unwrap() + body_b["created"].as_u64().unwrap(),
            KEYS as u64
        );
    }
    assert_eq!(count_jobs(&app, "acme").await, 4 * KEYS as i64);
}
