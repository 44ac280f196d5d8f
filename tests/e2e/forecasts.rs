//! Forecasts at submission: every job and batch carries its `eta`; a deadline the
//! forecast cannot meet is refused `deadline_unmeetable` with `earliest_feasible_at`
//! (nothing written), unless the client accepts the risk; and concurrent submitters in
//! three processes cannot over-book one limited route — every job accepted finishes by
//! its deadline.

use chrono::{DateTime, Duration, Utc};
use futures::future::join_all;
use serde_json::{Value, json};
use tollgate_api::broker::Roles;

use crate::batches::{create_batch, upload};
use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, job, submit_to};

fn at(v: &Value) -> DateTime<Utc> {
    v.as_str()
        .unwrap_or_else(|| panic!("a time: {v}"))
        .parse()
        .unwrap_or_else(|e| panic!("{v}: {e}"))
}

/// A route of 30 requests a minute (half a request a second once its first 30 are spent).
const RPM: u32 = 30;

fn limited(peers: usize) -> TestOptions {
    TestOptions {
        extra_config: format!("[providers.limits.\"gpt-4o-mini\"]\nrpm = {RPM}\n"),
        peers,
        ..TestOptions::default()
    }
}

#[tokio::test]
async fn concurrent_submitters_in_three_processes_cannot_over_book_a_limited_route() {
    let app = TestApp::spawn_with(limited(2)).await;
    let b = app.spawn_peer(Roles::ALL).await;
    let c = app.spawn_peer(Roles::API_ONLY).await;
    let apis = [
        app.api.clone(),
        format!("http://{}", b.addr.unwrap()),
        format!("http://{}", c.addr.unwrap()),
    ];
    // Everyone asks for the same deadline, 20 s away: the route starts 30 + 20 × 0.5 = 40
    // requests by then, at most.
    let deadline = Utc::now() + Duration::seconds(20);
    let body = |i: usize| {
        let mut body = job("fast", &format!("over-book {i}"));
        body["deadline"] = json!(deadline);
        body
    };
    let http = &app.http;
    let submissions = (0..120).map(|i| {
        let api = &apis[i % apis.len()];
        let key = if i % 2 == 0 { ACME } else { GLOBEX };
        let body = body(i);
        async move { (key, submit_to(http, api, key, &body).await) }
    });
    let answers = join_all(submissions).await;
    let mut accepted = Vec::new();
    for (key, (status, answer)) in &answers {
        match status {
            202 => {
                let (p50, p90) = (at(&answer["eta"]["p50"]), at(&answer["eta"]["p90"]));
                assert!(p50 <= p90, "{answer}");
                accepted.push((*key, answer["id"].as_str().unwrap().to_owned()));
            }
            422 => {
                assert_eq!(answer["error"]["code"], "deadline_unmeetable", "{answer}");
                assert_eq!(answer["error"]["param"], "deadline", "{answer}");
                assert!(
                    at(&answer["error"]["earliest_feasible_at"]) > deadline,
                    "{answer}"
                );
            }
            other => panic!("{other}: {answer}"),
        }
    }
    let served_by_deadline = f64::from(RPM) + 20.0 * f64::from(RPM) / 60.0;
    assert!(!accepted.is_empty(), "some of the first ones fit");
    assert!(
        accepted.len() as f64 <= served_by_deadline,
        "{} accepted; the route starts {served_by_deadline} by the deadline",
        accepted.len()
    );
    // Every job the forecast accepted is served: started by its deadline (one still
    // queued then would fail), finished.
    for (key, id) in &accepted {
        let done = app.wait_job(key, id, 40).await;
        assert_eq!(done["state"], "succeeded", "{done}");
        assert!(at(&done["started_at"]) <= deadline, "{done}");
    }
    // The forecasts are measured against what happened.
    let (_, status) = app.get(ACME, "/v1/status").await;
    assert!(status["forecasts"]["jobs"].as_i64().unwrap() >= 1, "{status}");
    assert_eq!(status["forecasts"]["missed_deadline"], 0, "{status}");
    b.shutdown().await;
    c.shutdown().await;
    app.shutdown().await;
}

/// The broker without a gate: what is queued stays queued, and the forecasts read a
/// queue that does not move under them.
#[tokio::test]
async fn jobs_and_batches_carry_their_eta_and_a_deadline_out_of_reach_is_refused() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..limited(0)
    })
    .await;
    let http = &app.http;

    // A job without a deadline of its own is forecast, not checked.
    let (status, free) = app.submit(ACME, &job("fast", "no deadline")).await;
    assert_eq!(status, 202, "{free}");
    let (p50, p90) = (at(&free["eta"]["p50"]), at(&free["eta"]["p90"]));
    assert!(at(&free["created_at"]) < p50 && p50 <= p90, "{free}");
    let (_, read) = app
        .get(ACME, &format!("/v1/jobs/{}", free["id"].as_str().unwrap()))
        .await;
    assert_eq!(read["eta"], free["eta"], "the forecast is kept with the job");

    // 60 interactive jobs queued go first: 30 fit the route's minute, the rest take a
    // minute more. A job due in 10 s cannot make it.
    for i in 0..60 {
        let mut ahead = job("fast", &format!("ahead {i}"));
        ahead["class"] = json!("interactive");
        assert_eq!(app.submit(GLOBEX, &ahead).await.0, 202);
    }
    let soon = Utc::now() + Duration::seconds(10);
    let mut tight = job("fast", "tight");
    tight["deadline"] = json!(soon);
    tight["idempotency_key"] = json!("tight-1");
    let (status, refused) = app.submit(ACME, &tight).await;
    assert_eq!(status, 422, "{refused}");
    assert_eq!(refused["error"]["code"], "deadline_unmeetable");
    assert_eq!(refused["error"]["param"], "deadline");
    let earliest = at(&refused["error"]["earliest_feasible_at"]);
    assert!(earliest > soon + Duration::seconds(30), "{refused}");

    // Nothing was written: the same key again, accepting the risk, makes a new job.
    tight["on_deadline_risk"] = json!("accept");
    let (status, risky) = app.submit(ACME, &tight).await;
    assert_eq!(status, 202, "{risky}");
    assert!(at(&risky["eta"]["p50"]) <= at(&risky["eta"]["p90"]), "{risky}");
    // Its retry finds that job, without a forecast standing it behind itself.
    let (status, again) = app.submit(ACME, &tight).await;
    assert_eq!((status, &again["id"]), (200, &risky["id"]), "{again}");

    // The earliest feasible time is one the forecast accepts.
    let mut later = job("fast", "later");
    later["deadline"] = json!(earliest + Duration::seconds(10));
    let (status, accepted) = app.submit(ACME, &later).await;
    assert_eq!(status, 202, "{accepted}");
    // Behind the 60 interactive jobs: a minute and more away.
    assert!(
        at(&accepted["eta"]["p50"]) > soon + Duration::seconds(30),
        "{accepted}"
    );

    // Tenants share what is left by weight: globex's one standard job beside acme's
    // three (acme weighs 3) comes sooner than acme's fourth.
    let (_, theirs) = app.submit(GLOBEX, &job("fast", "globex")).await;
    let (_, ours) = app.submit(ACME, &job("fast", "acme again")).await;
    assert!(
        at(&theirs["eta"]["p50"]) < at(&ours["eta"]["p50"]),
        "{theirs} {ours}"
    );

    // A batch whose lines cannot all be served in its window is refused whole.
    let lines: String = (0..200)
        .map(|i| crate::batches::line(&format!("l{i}"), "fast", "hi") + "\n")
        .collect();
    let (_, file) = upload(http, &app.api, ACME, lines.as_bytes()).await;
    let file_id = file["id"].as_str().unwrap();
    let window = |w: &str| json!({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": w});
    let (status, refused) = create_batch(http, &app.api, ACME, &window("2m")).await;
    assert_eq!(status, 422, "{refused}");
    assert_eq!(refused["error"]["code"], "deadline_unmeetable");
    assert!(at(&refused["error"]["earliest_feasible_at"]) > Utc::now() + Duration::minutes(5));
    let (_, list) = app.get(ACME, "/v1/batches").await;
    assert_eq!(
        list["data"].as_array().unwrap().len(),
        0,
        "nothing of it was written: {list}"
    );
    // A day is enough; the batch's eta is its last line's: 265 requests at half a second.
    let (status, batch) = create_batch(http, &app.api, ACME, &window("24h")).await;
    assert_eq!(status, 200, "{batch}");
    let (p50, p90) = (at(&batch["eta"]["p50"]), at(&batch["eta"]["p90"]));
    assert!(p50 > Utc::now() + Duration::minutes(5) && p50 <= p90, "{batch}");
    let id = batch["id"].as_str().unwrap();
    let (_, read) = app.get(ACME, &format!("/v1/batches/{id}")).await;
    assert_eq!(read["eta"], batch["eta"]);
    app.shutdown().await;
}

/// The broker without a gate, so the queue stays as submitted. A job without a deadline of
/// its own waits behind its tenant's jobs that have one — those queued and those still
/// arriving, at the rate they arrived: coming faster than the route serves, they keep it
/// waiting until its class's starvation guard (60 s). One due sooner than they are waits
/// for none of them.
#[tokio::test]
async fn a_job_without_a_deadline_is_forecast_behind_its_tenant_s_jobs_arriving_with_one() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..limited(0)
    })
    .await;
    // 40 due in ten minutes, at once: the route's 30 in hand, then half a request a
    // second — 22 s for a job behind them, were nothing more to come.
    for i in 0..40 {
        let mut due = job("fast", &format!("due {i}"));
        due["deadline"] = json!(Utc::now() + Duration::minutes(10));
        assert_eq!(app.submit(ACME, &due).await.0, 202);
    }
    // What arrives is read every 10 s: ask until it has been. Each job asked with adds 2 s
    // (one more ahead of the next), so ten of them cannot reach the guard without it.
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (status, free) = app.submit(ACME, &job("fast", "no deadline")).await;
        assert_eq!(status, 202, "{free}");
        let wait = at(&free["eta"]["p50"]) - at(&free["created_at"]);
        if wait >= Duration::seconds(59) {
            break;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "forecast to wait {wait} while its tenant's jobs due sooner keep coming: {free}"
        );
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    }
    // Due in five minutes: before every job queued or arriving.
    let mut sooner = job("fast", "due sooner");
    sooner["deadline"] = json!(Utc::now() + Duration::minutes(5));
    let (status, first) = app.submit(ACME, &sooner).await;
    assert_eq!(status, 202, "{first}");
    let wait = at(&first["eta"]["p50"]) - at(&first["created_at"]);
    assert!(wait < Duration::seconds(10), "forecast to wait {wait}: {first}");
    app.shutdown().await;
}

/// A bulk's jobs drain in the order sent: each carries its own eta, later ones later; one
/// whose deadline is out of reach refuses the whole bulk, naming it.
#[tokio::test]
async fn a_bulk_carries_each_job_s_eta_and_one_deadline_out_of_reach_refuses_it_whole() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..limited(0)
    })
    .await;
    // 90 jobs at 30 a minute: the first 30 at once, the rest at one every 2 s.
    let jobs: Vec<Value> = (0..90).map(|i| job("fast", &format!("bulk {i}"))).collect();
    let (status, bulk) = app.post(ACME, "/v1/jobs/bulk", &json!({ "jobs": jobs })).await;
    assert_eq!(status, 202, "{bulk}");
    let data = bulk["data"].as_array().expect("data");
    let p50s: Vec<DateTime<Utc>> = data.iter().map(|j| at(&j["eta"]["p50"])).collect();
    assert!(p50s.windows(2).all(|w| w[0] <= w[1]), "in the order sent: {bulk}");
    assert!(
        p50s[89] > p50s[0] + Duration::seconds(90),
        "the last waits for 60 jobs at one every 2 s: {bulk}"
    );
    for j in data {
        assert!(at(&j["eta"]["p50"]) <= at(&j["eta"]["p90"]), "{j}");
    }
    let last = data[89]["id"].as_str().unwrap();
    let (_, read) = app.get(ACME, &format!("/v1/jobs/{last}")).await;
    assert_eq!(read["eta"], data[89]["eta"], "the forecast is kept with the job");

    // Behind those 90, a job due in 10 s cannot make it: the bulk holding it is refused
    // whole, the item named; accepting the risk lets it in.
    let count = || async {
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs")
            .fetch_one(&app.db.pool)
            .await
            .expect("count");
        n
    };
    let mut tight = job("fast", "tight");
    tight["deadline"] = json!(Utc::now() + Duration::seconds(10));
    let body = json!({ "jobs": [job("fast", "free"), tight.clone()] });
    let (status, refused) = app.post(ACME, "/v1/jobs/bulk", &body).await;
    assert_eq!(status, 422, "{refused}");
    assert_eq!(refused["error"]["code"], "deadline_unmeetable", "{refused}");
    assert_eq!(refused["error"]["param"], "jobs[1].deadline", "{refused}");
    assert!(
        at(&refused["error"]["earliest_feasible_at"]) > Utc::now() + Duration::seconds(60),
        "{refused}"
    );
    assert_eq!(count().await, 90, "nothing of the refused bulk was written");
    tight["on_deadline_risk"] = json!("accept");
    let body = json!({ "jobs": [job("fast", "free"), tight] });
    let (status, accepted) = app.post(ACME, "/v1/jobs/bulk", &body).await;
    assert_eq!(status, 202, "{accepted}");
    assert_eq!(count().await, 92);
    app.shutdown().await;
}

/// A queue's jobs pass their guard as they came: the forecast reads queued work summed by
/// when it came (10 s at a time), so one old job beside many new ones does not read as a
/// queue whose jobs pass their guard all along; what came over an hour ago is one sum.
#[tokio::test]
async fn queued_work_is_read_by_when_it_came() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..limited(0)
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..6 {
        let (status, queued) = app.submit(GLOBEX, &job("fast", &format!("queued {i}"))).await;
        assert_eq!(status, 202, "{queued}");
        ids.push(queued["id"].as_str().expect("id").to_owned());
    }
    // Two submitted hours ago; one 50 s before the others, which came within 2 s of each
    // other (the times set on 10 s boundaries so that none falls across one).
    let band = |at: i64| DateTime::<Utc>::from_timestamp(at, 0).expect("a time");
    let start = (Utc::now().timestamp() / 10 - 10) * 10;
    let (hours_ago, hour_ago) = (start - 3 * 3_600 + 7, start - 2 * 3_600 + 3);
    let submitted = [hours_ago, hour_ago, start + 1, start + 51, start + 52, start + 53];
    for (id, at) in ids.iter().zip(submitted) {
        sqlx::query("UPDATE jobs SET created_at = $1 WHERE id = $2::uuid")
            .bind(band(at))
            .bind(id)
            .execute(&app.db.pool)
            .await
            .expect("set when it came");
    }
    let models: Vec<String> = sqlx::query_scalar("SELECT DISTINCT model FROM jobs")
        .fetch_all(&app.db.pool)
        .await
        .expect("models");
    let behind = tollgate::store::Behind {
        tenant: "acme",
        class: tollgate::model::JobClass::Standard,
        priority: 0,
        deadline: Utc::now(),
        batch_id: None,
    };
    let (mut ahead, after) = tollgate::store::queued_around(&app.db.pool, &models, behind)
        .await
        .expect("queued work");
    assert!(after.is_empty(), "{after:?}");
    ahead.sort_by_key(|q| q.oldest);
    let read: Vec<(f64, DateTime<Utc>, DateTime<Utc>)> =
        ahead.iter().map(|q| (q.jobs, q.oldest, q.newest)).collect();
    assert_eq!(
        read,
        [
            (2.0, band(hours_ago), band(hour_ago)),
            (1.0, band(start + 1), band(start + 1)),
            (3.0, band(start + 51), band(start + 53))
        ]
    );
    app.shutdown().await;
}
