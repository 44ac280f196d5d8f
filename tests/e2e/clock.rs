//! Time and ownership across processes: processes whose clocks are off rescue no live
//! job (leases are the database's time); a dispatcher that lost a job's lease stops its
//! call, plain or streamed, and writes nothing of it; a job handed over and cancelled while
//! it waits for a slot is not sent; a gate whose lock connection died admits nothing.

use std::time::Duration;

use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};
use tollgate_api::broker::Roles;

use crate::harness::{ACME, TestApp, TestOptions, eventually, job, mock_config};

/// Every job's state, attempt and lease owner.
async fn states(app: &TestApp) -> Vec<(String, i32, Option<String>)> {
    sqlx::query_as("SELECT state::text, attempt, lease_owner FROM jobs ORDER BY id")
        .fetch_all(&app.db.pool)
        .await
        .unwrap()
}

async fn count(app: &TestApp, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&app.db.pool).await.unwrap()
}

/// Three processes on one database and one mock — one on the database's time, one whose
/// clock runs `skew` ahead, one `skew` behind — with leases (4 s) much shorter than the
/// skew and calls (1.5 s) that span several maintenance passes of each: before leases were
/// the database's time, the process ahead rescued the others' live jobs and the others
/// rescued the jobs of the process behind as soon as it claimed them, so calls were sent
/// again. Now every job finishes once, on its first attempt, with one call each.
#[tokio::test]
async fn processes_whose_clocks_are_off_rescue_no_live_job() {
    for skew in [20, 300] {
        let mut mock = mock_config();
        mock.latency_ms = 1_500;
        let app = TestApp::spawn_with(TestOptions {
            mock,
            peers: 2,
            dispatch_config: "lease_secs = 4\nheartbeat_secs = 1\nmaintenance_interval_ms = 200".into(),
            ..TestOptions::default()
        })
        .await;
        let skew = chrono::Duration::seconds(skew);
        let ahead = app.spawn_peer_on_clock(Roles::ALL, skew).await;
        let behind = app.spawn_peer_on_clock(Roles::ALL, -skew).await;
        let jobs: Vec<Value> = (0..60).map(|i| job("fast", &format!("skewed {i}"))).collect();
        let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({ "jobs": jobs })).await;
        assert_eq!(status, 202, "{body}");
        eventually(90, "every job finished", || async {
            let open = count(
                &app,
                "SELECT count(*) FROM jobs WHERE state NOT IN ('succeeded', 'failed')",
            )
            .await;
            (open == 0).then_some(())
        })
        .await;
        let all = states(&app).await;
        let not_once: Vec<_> = all
            .iter()
            .filter(|(s, a, _)| s != "succeeded" || *a != 1)
            .collect();
        assert!(
            not_once.is_empty(),
            "skew {skew}: jobs not finished on their first attempt: {not_once:?}"
        );
        let stats = app.mock.stats();
        assert_eq!(
            stats.requests, 60,
            "skew {skew}: one call per job, none sent twice"
        );
        assert_eq!(count(&app, "SELECT count(*) FROM job_attempts").await, 60);
        ahead.shutdown().await;
        behind.shutdown().await;
        app.shutdown().await;
    }
}

/// The process running `id`, its lease owner, once the mock holds its call.
async fn running_at_the_mock(app: &TestApp, id: &str) -> String {
    eventually(20, "the job's call in flight at the mock", || async {
        let owner: Option<String> =
            sqlx::query_scalar("SELECT lease_owner FROM jobs WHERE id = $1::uuid AND state = 'running'")
                .bind(id)
                .fetch_optional(&app.db.pool)
                .await
                .unwrap()
                .flatten();
        owner.filter(|_| app.mock.stats().in_flight == 1)
    })
    .await
}

/// Takes `id` from its holder as a rescue and another process's claim would: a new
/// attempt leased to someone else.
async fn take_over(app: &TestApp, id: &str) {
    sqlx::query(
        "UPDATE jobs SET attempt = attempt + 1, lease_owner = 'another-process',
                         lease_expires_at = now() + interval '10 minutes'
         WHERE id = $1::uuid",
    )
    .bind(id)
    .execute(&app.db.pool)
    .await
    .unwrap();
}

/// The job is as the other process left it: nothing of the old holder's attempt written.
async fn untouched_by_the_old_holder(app: &TestApp, id: &str) {
    let (state, attempt, owner, result): (String, i32, Option<String>, Option<Value>) =
        sqlx::query_as("SELECT state::text, attempt, lease_owner, result FROM jobs WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), attempt, owner.as_deref(), result),
        ("running", 2, Some("another-process"), None)
    );
    assert_eq!(count(app, "SELECT count(*) FROM job_attempts").await, 0);
}

fn held_calls() -> TestOptions {
    let mut mock = mock_config();
    mock.latency_ms = 120_000;
    TestOptions {
        mock,
        dispatch_config: "heartbeat_secs = 1".into(),
        ..TestOptions::default()
    }
}

/// A call the mock holds for two minutes; its job is taken from its dispatcher meanwhile.
/// The next heartbeat finds the lease gone and the call is cut off at once (the mock sees
/// the request go), and nothing of that attempt is written. Before, the call ran to its
/// end and only its write was refused.
#[tokio::test]
async fn a_call_whose_lease_is_gone_is_stopped_and_writes_nothing() {
    let app = TestApp::spawn_with(held_calls()).await;
    let (status, accepted) = app.submit(ACME, &job("fast", "held")).await;
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["id"].as_str().unwrap();
    running_at_the_mock(&app, id).await;
    take_over(&app, id).await;
    eventually(10, "the call stopped", || async {
        (app.mock.stats().in_flight == 0).then_some(())
    })
    .await;
    untouched_by_the_old_holder(&app, id).await;
    assert_eq!(app.mock.stats().requests, 1);
    app.shutdown().await;
}

/// The same for a streamed call relayed to a connected client: the stream is cut off.
#[tokio::test]
async fn a_stream_whose_lease_is_gone_is_stopped_and_writes_nothing() {
    let app = TestApp::spawn_with(held_calls()).await;
    let body = json!({"model": "fast", "stream": true, "messages": [{"role": "user", "content": "held"}]});
    let client = app.http.clone();
    let url = app.url("/v1/chat/completions");
    let mut stream = tokio::task::JoinSet::new();
    stream.spawn(async move {
        let resp = client
            .post(url)
            .bearer_auth(ACME)
            .json(&body)
            .send()
            .await
            .unwrap();
        resp.text().await
    });
    let id: String = eventually(20, "the streamed job", || async {
        sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM jobs WHERE stream")
            .fetch_optional(&app.db.pool)
            .await
            .unwrap()
            .map(|id| id.to_string())
    })
    .await;
    running_at_the_mock(&app, &id).await;
    take_over(&app, &id).await;
    eventually(10, "the stream stopped", || async {
        (app.mock.stats().in_flight == 0).then_some(())
    })
    .await;
    // The client's stream ends, unfinished, with the reason.
    let relayed = tokio::time::timeout(Duration::from_secs(10), stream.join_next())
        .await
        .expect("the client's stream ended")
        .expect("the stream's task")
        .unwrap()
        .unwrap();
    assert!(
        relayed.contains("lease_expired") && !relayed.contains("[DONE]"),
        "{relayed}"
    );
    untouched_by_the_old_holder(&app, &id).await;
    app.shutdown().await;
}

/// With one call slot, a second job the gate starts here waits for the slot the first
/// job's (3 s) call holds, and is cancelled while it waits. When the slot frees it is not
/// sent: the provider sees one request. Before, it was sent and its answer discarded.
#[tokio::test]
async fn a_handed_over_job_cancelled_while_it_waits_is_not_sent() {
    let mut mock = mock_config();
    mock.latency_ms = 3_000;
    let app = TestApp::spawn_with(TestOptions {
        mock,
        // No heartbeat in the test's time: the check before the call is what stops it.
        dispatch_config: "concurrency = 1\nlease_secs = 60\nheartbeat_secs = 50".into(),
        ..TestOptions::default()
    })
    .await;
    let (_, first) = app.submit(ACME, &job("fast", "first")).await;
    let first = first["id"].as_str().unwrap().to_owned();
    running_at_the_mock(&app, &first).await;
    let (_, second) = app.submit(ACME, &job("fast", "second")).await;
    let second = second["id"].as_str().unwrap().to_owned();
    // Started here by the gate (running, leased to this process) while the slot is taken.
    eventually(10, "the second job handed over", || async {
        let state: String = sqlx::query_scalar("SELECT state::text FROM jobs WHERE id = $1::uuid")
            .bind(&second)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
        (state == "running").then_some(())
    })
    .await;
    assert_eq!(app.mock.stats().requests, 1, "the second job waits for the slot");
    let (status, cancelled) = app
        .post(ACME, &format!("/v1/jobs/{second}/cancel"), &json!({}))
        .await;
    assert_eq!(
        (status, cancelled["state"].as_str()),
        (200, Some("cancelled")),
        "{cancelled}"
    );
    assert_eq!(app.wait_job(ACME, &first, 20).await["state"], "succeeded");
    // Its attempt is over once its lease is cleared (and its reservation settled).
    eventually(20, "the cancelled job let go", || async {
        let owner: Option<String> = sqlx::query_scalar("SELECT lease_owner FROM jobs WHERE id = $1::uuid")
            .bind(&second)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
        owner.is_none().then_some(())
    })
    .await;
    assert_eq!(app.mock.stats().requests, 1, "the cancelled job was sent");
    app.shutdown().await;
}

/// The session holding the gate's advisory lock in this test's database.
async fn gate_lock_holder(app: &TestApp) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
           AND d.datname = current_database()
           AND ((l.classid::bigint << 32) | l.objid::bigint) = $1",
    )
    .bind(tollgate_workers::gate::GATE_LOCK)
    .fetch_optional(&app.db.pool)
    .await
    .unwrap()
}

/// A gate admitting a long queue in full rounds (4 jobs each, back to back) loses its lock
/// connection (`pg_terminate_backend`), and another holder takes the lock. From then on
/// it admits nothing — before, full rounds never stopped to check the lock, and it went on
/// admitting the whole queue beside the new leader. When the lock is free again it leads
/// and admits again.
#[tokio::test]
async fn a_gate_whose_lock_connection_died_admits_nothing_more() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles {
            api: true,
            gate: true,
            dispatch: false,
            maintenance: false,
        },
        gate_config: "batch = 4".into(),
        // Paced by a limit, so the queue is still being admitted when the lock is lost:
        // 600 at once, then ten a second.
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\nrpm = 600\n".into(),
        ..TestOptions::default()
    })
    .await;
    let jobs: Vec<Value> = (0..2_000).map(|i| job("fast", &format!("queued {i}"))).collect();
    let (status, body) = app.post(ACME, "/v1/jobs/bulk", &json!({ "jobs": jobs })).await;
    assert_eq!(status, 202, "{body}");
    let admitted = || count(&app, "SELECT count(*) FROM jobs WHERE state = 'admitted'");
    eventually(20, "the gate admitting", || async {
        (admitted().await > 0).then_some(())
    })
    .await;
    // Kill the gate's lock session and take the lock (again, if the gate took it back first).
    let mut other = PgConnection::connect(&app.db.url).await.unwrap();
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(pid) = gate_lock_holder(&app).await {
            sqlx::query("SELECT pg_terminate_backend($1, 10000)")
                .bind(pid)
                .execute(&mut other)
                .await
                .unwrap();
        }
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(tollgate_workers::gate::GATE_LOCK)
            .fetch_one(&mut other)
            .await
            .unwrap();
        if got {
            break;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "could not take the gate's lock"
        );
    }
    let at_loss = admitted().await;
    assert!(at_loss < 2_000, "the queue was admitted before the lock was lost");
    // Three seconds (three leader checks) of nothing admitted.
    let watch_until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < watch_until {
        assert_eq!(admitted().await, at_loss, "admitted without the lock");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(tollgate_workers::gate::GATE_LOCK)
        .execute(&mut other)
        .await
        .unwrap();
    eventually(20, "the gate leading again", || async {
        (admitted().await > at_loss).then_some(())
    })
    .await;
    app.shutdown().await;
}
