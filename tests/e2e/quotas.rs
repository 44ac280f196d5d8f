//! What one tenant may hold: its queue of each class (`classes.*.max_queued_per_tenant`)
//! and its stored files (`[quotas]`, or its own). Each is raced by concurrent clients —
//! over two API processes on one database where the harness allows it — and must hold
//! exactly: every submission past it refused, nothing of a refused one written.

use serde_json::{Value, json};
use tollgate_api::broker::Roles;

use crate::batches::{batch_body, create_batch, line, upload};
use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, job};

/// `n` requests sent at once, alternating between the two API addresses; their statuses
/// and bodies in the order built.
async fn at_once<F, Fut>(n: usize, send: F) -> Vec<(u16, Value)>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = (u16, Value)>,
{
    futures::future::join_all((0..n).map(send)).await
}

async fn count(app: &TestApp, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&app.db.pool).await.unwrap()
}

/// Refused with 429 and `code`; the others were taken (`ok`).
fn tally(answers: &[(u16, Value)], ok: u16, code: &str) -> usize {
    let mut taken = 0;
    for (status, body) in answers {
        match status {
            s if *s == ok => taken += 1,
            429 => assert_eq!(body["error"]["code"], code, "{body}"),
            other => panic!("unexpected {other}: {body}"),
        }
    }
    taken
}

/// Before, each submitter counted the queue and then inserted: racing submitters all saw
/// room, and the queue ended past its cap. Now the count and the insert are one locked
/// step per (tenant, class), in every process: exactly the cap is queued — by single
/// submissions, bulks and batches alike.
#[tokio::test(flavor = "multi_thread")]
async fn racing_submitters_on_two_processes_fill_a_capped_queue_exactly() {
    let app = TestApp::spawn_with(TestOptions {
        // No gate: what is queued stays queued, so the count is the cap's to hold.
        roles: Roles::API_ONLY,
        extra_config: "[classes.standard]\ndefault_deadline_secs = 3600\nmax_queued_per_tenant = 20\n\
                       [classes.background]\ndefault_deadline_secs = 3600\nmax_queued_per_tenant = 20\n\
                       [classes.batch]\ndefault_deadline_secs = 86400\nmax_queued_per_tenant = 10\n"
            .into(),
        peers: 1,
        ..TestOptions::default()
    })
    .await;
    let peer = app.spawn_peer(Roles::API_ONLY).await;
    let apis = [app.api.clone(), format!("http://{}", peer.addr.unwrap())];
    let post = |i: usize, path: &'static str, body: Value| {
        let (http, url) = (app.http.clone(), format!("{}{path}", apis[i % 2]));
        async move {
            let r = http.post(url).bearer_auth(ACME).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
        }
    };

    // 80 single jobs at a cap of 20.
    let answers = at_once(80, |i| post(i, "/v1/jobs", job("fast", &format!("single {i}")))).await;
    assert_eq!(tally(&answers, 202, "queue_full"), 20);
    assert_eq!(
        count(&app, "SELECT count(*) FROM jobs WHERE class = 'standard'").await,
        20
    );

    // 16 bulks of 5 at a cap of 20: four are taken whole, the rest write nothing.
    let answers = at_once(16, |i| {
        let items: Vec<Value> = (0..5)
            .map(|k| {
                let mut j = job("fast", &format!("bulk {i}.{k}"));
                j["class"] = json!("background");
                j
            })
            .collect();
        post(i, "/v1/jobs/bulk", json!({ "jobs": items }))
    })
    .await;
    assert_eq!(tally(&answers, 202, "queue_full"), 4);
    assert_eq!(
        count(&app, "SELECT count(*) FROM jobs WHERE class = 'background'").await,
        20
    );

    // 6 batches of 4 lines at a cap of 10: two are taken.
    let text: String = (0..4)
        .map(|k| line(&format!("c{k}"), "fast", "hi") + "\n")
        .collect();
    let (status, file) = upload(&app.http, &app.api, ACME, text.as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    let file_id = file["id"].as_str().unwrap().to_owned();
    let answers = at_once(6, |i| {
        let (http, api, body) = (app.http.clone(), apis[i % 2].clone(), batch_body(&file_id));
        async move { create_batch(&http, &api, ACME, &body).await }
    })
    .await;
    assert_eq!(tally(&answers, 200, "queue_full"), 2);
    assert_eq!(
        count(&app, "SELECT count(*) FROM jobs WHERE class = 'batch'").await,
        8
    );
    assert_eq!(count(&app, "SELECT count(*) FROM batches").await, 2);

    // The cap is the tenant's: another tenant's queue of the same class is its own.
    let (status, body) = app.submit(GLOBEX, &job("fast", "globex")).await;
    assert_eq!(status, 202, "{body}");
    peer.shutdown().await;
    app.shutdown().await;
}

/// A bulk to a queue already at its cap is refused before its items are read: a flood of
/// bulks to a full queue costs a count each, not the parsing and estimating of every
/// item. The item here names a model nobody serves — read, it would be a 400
/// `unknown_model`; refused first, it is a 429 `queue_full`.
#[tokio::test]
async fn a_bulk_to_a_full_queue_is_refused_before_its_items_are_read() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[classes.standard]\ndefault_deadline_secs = 3600\nmax_queued_per_tenant = 2\n".into(),
        ..TestOptions::default()
    })
    .await;
    let unreadable = json!({"jobs": [{"request": {"model": "nobody/serves-this", "messages": [{"role": "user", "content": "hi"}]}}]});
    let post = |body: &Value| {
        let (http, url, body) = (app.http.clone(), app.url("/v1/jobs/bulk"), body.clone());
        async move {
            let r = http.post(url).bearer_auth(ACME).json(&body).send().await.unwrap();
            (
                r.status().as_u16(),
                r.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    // With room, the bulk is read and its bad item named.
    let (status, body) = post(&unreadable).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "jobs[0].request.model", "{body}");
    for i in 0..2 {
        let (status, body) = app.submit(ACME, &job("fast", &format!("fill {i}"))).await;
        assert_eq!(status, 202, "{body}");
    }
    let (status, body) = post(&unreadable).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "queue_full", "{body}");
    app.shutdown().await;
}

/// A JSONL body of about `bytes` bytes, one batch line per ~110 bytes.
fn jsonl(bytes: usize) -> Vec<u8> {
    let one = line("x", "fast", "quota") + "\n";
    one.repeat(bytes.div_ceil(one.len())).into_bytes()
}

/// Files a tenant keeps are bounded by count and by bytes, its own quotas or `[quotas]`:
/// past them an upload is `429 quota_exceeded` naming the quota, nothing of it is kept,
/// and deleting a file gives its room back. Uploads racing for the last room are checked
/// one after the other, so only what fits is kept.
#[tokio::test(flavor = "multi_thread")]
async fn uploads_past_a_tenant_s_file_quotas_are_refused_and_leave_nothing() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        extra_config: "[quotas]\nmax_files = 3\nmax_stored_file_bytes = 20000\n\
                       [[tenants]]\nname = \"initech\"\napi_key = \"tk-initech\"\nmax_files = 1\n"
            .into(),
        ..TestOptions::default()
    })
    .await;
    let files_of = |tenant: &'static str| {
        let pool = app.db.pool.clone();
        async move {
            let kept: (i64, i64) = sqlx::query_as(
                "SELECT count(*), (SELECT count(*) FROM file_chunks c JOIN files f ON f.id = c.file_id
                                   WHERE f.tenant = $1)
                 FROM files WHERE tenant = $1",
            )
            .bind(tenant)
            .fetch_one(&pool)
            .await
            .unwrap();
            kept
        }
    };

    // Eight uploads at once against a quota of three files: three are kept.
    let small = jsonl(1000);
    let answers = at_once(8, |_| upload(&app.http, &app.api, ACME, &small)).await;
    assert_eq!(tally(&answers, 200, "quota_exceeded"), 3);
    assert!(
        answers
            .iter()
            .filter(|(s, _)| *s == 429)
            .all(|(_, b)| b["error"]["param"] == "max_files"),
        "{answers:?}"
    );
    assert_eq!(files_of("acme").await, (3, 3));

    // Deleting one gives its room back.
    let kept = answers.iter().find(|(s, _)| *s == 200).unwrap().1["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, _) = app.delete(ACME, &format!("/v1/files/{kept}")).await;
    assert_eq!(status, 200);
    let (status, body) = upload(&app.http, &app.api, ACME, &small).await;
    assert_eq!(status, 200, "{body}");

    // Bytes: 12 kB kept, then 12 kB more would pass 20 kB; 6 kB fits.
    let (status, body) = upload(&app.http, &app.api, GLOBEX, &jsonl(12_000)).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = upload(&app.http, &app.api, GLOBEX, &jsonl(12_000)).await;
    assert_eq!(
        (
            status,
            body["error"]["code"].as_str(),
            body["error"]["param"].as_str()
        ),
        (429, Some("quota_exceeded"), Some("max_stored_file_bytes")),
        "{body}"
    );
    assert_eq!(files_of("globex").await, (1, 1), "a refused upload left rows");
    let (status, body) = upload(&app.http, &app.api, GLOBEX, &jsonl(6_000)).await;
    assert_eq!(status, 200, "{body}");

    // A tenant's own quota wins over `[quotas]`.
    let (status, body) = upload(&app.http, &app.api, "tk-initech", &small).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = upload(&app.http, &app.api, "tk-initech", &small).await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (429, Some("max_files")),
        "{body}"
    );
    assert_eq!(files_of("initech").await, (1, 1));
    app.shutdown().await;
}
