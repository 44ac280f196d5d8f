//! The scheduler without a database: hand-made plans and buckets, rounds run back to back.

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;

use chrono::{Duration, TimeZone};
use proptest::prelude::*;
use uuid::Uuid;

use super::*;
use crate::config::{Config, ProviderKind};
use crate::vocab::Dimension;
use crate::vocab::Endpoint;

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap()
}

fn candidate(n: u128, tenant: &str, class: JobClass) -> Candidate {
    Candidate {
        endpoint: Endpoint::ChatCompletions,
        id: JobId(Uuid::from_u128(n)),
        tenant: tenant.to_owned(),
        class,
        priority: 0,
        model: "fast".to_owned(),
        deadline: t0() + Duration::days(1),
        created_at: t0(),
        estimated_input_tokens: 0,
        estimated_output_tokens: 0,
        admission: None,
        failed_targets: None,
        dispatch_via: None,
        stream: false,
        api_key: None,
        batch_id: None,
    }
}

fn target(model: &str, key: Option<&str>) -> Target {
    Target {
        provider: "p".to_owned(),
        kind: ProviderKind::Openai,
        model: model.to_owned(),
        key: key.map(str::to_owned),
    }
}

fn route(model: &str, path: &[(&str, f64)]) -> Route {
    Route {
        target: target(model, None),
        scope: buckets::target_scope("p", model),
        path: path.iter().map(|(k, a)| ((*k).to_owned(), *a)).collect(),
        cost: Default::default(),
    }
}

/// Job `n` of `tenant` with `weight`, costing `cost` tokens, on one route through `path`.
fn plan(n: u128, tenant: &str, weight: f64, class: JobClass, cost: f64, path: &[(&str, f64)]) -> Plan {
    Plan {
        job: candidate(n, tenant, class),
        class,
        weight,
        cost,
        routes: vec![route("m", path)],
        unread_behind: false,
    }
}

fn bucket(id: i64, key: &str, rule: Rule, capacity: f64, level: f64) -> Bucket {
    Bucket {
        id,
        key: key.to_owned(),
        dimension: Dimension::TotalTokens,
        rule,
        capacity,
        window_secs: if rule == Rule::Rolling { 60 } else { 0 },
        level,
        updated_at: t0(),
        resets_at: None,
        ramp_step: None,
        configured_capacity: Some(capacity),
        learned_at: None,
    }
}

fn map(buckets: Vec<Bucket>) -> HashMap<String, Bucket> {
    buckets.into_iter().map(|b| (b.key.clone(), b)).collect()
}

/// No transit headroom, no interactive reserve, unless a test asks for them.
fn gate() -> GateConfig {
    GateConfig {
        headroom_secs: 0.0,
        interactive_reserve: 0.0,
        ..GateConfig::default()
    }
}

fn scheduler() -> Scheduler {
    Scheduler::new(Policy::new(gate()))
}

fn no_pauses() -> Pauses {
    Pauses::new()
}

fn no_guesses() -> HashSet<String> {
    HashSet::new()
}

fn admitted_ids(d: &Decision) -> Vec<u128> {
    d.admitted.iter().map(|a| a.plan.job.id.0.as_u128()).collect()
}

const SHARED: &str = "route:shared:tokens";

/// Rounds over one shared bucket, refilled to `capacity` before each round; every tenant
/// (name, weight, the costs of its jobs in turn) always has more queued than fits. Returns
/// the tokens admitted per tenant.
fn contend(tenants: &[(String, f64, Vec<f64>)], capacity: f64, rounds: usize) -> HashMap<String, f64> {
    let mut s = scheduler();
    let mut next: Vec<usize> = vec![0; tenants.len()];
    let mut served: HashMap<String, f64> = HashMap::new();
    for _ in 0..rounds {
        let mut plans = Vec::new();
        for (t, (name, weight, costs)) in tenants.iter().enumerate() {
            // More than the bucket can hold: the tenant always has work that waits.
            let cheapest = costs.iter().copied().fold(f64::INFINITY, f64::min);
            let queued = (capacity / cheapest).ceil() as usize + 1;
            for i in next[t]..next[t] + queued {
                let cost = costs[i % costs.len()];
                let n = ((t as u128) << 64) | i as u128;
                plans.push(plan(
                    n,
                    name,
                    *weight,
                    JobClass::Standard,
                    cost,
                    &[(SHARED, cost)],
                ));
            }
        }
        let mut buckets = map(vec![bucket(1, SHARED, Rule::Gauge, capacity, capacity)]);
        let d = s.schedule(plans, &mut buckets, &no_guesses(), &no_pauses(), usize::MAX, t0());
        for a in &d.admitted {
            let t = tenants.iter().position(|x| x.0 == a.plan.job.tenant).unwrap();
            next[t] += 1;
            *served.entry(a.plan.job.tenant.clone()).or_default() += a.plan.cost;
        }
        s.admitted(d.admitted.iter().map(|a| a.plan.job.id));
    }
    served
}

#[test]
fn weights_share_a_contended_bucket() {
    let tenants = vec![
        ("light".to_owned(), 1.0, vec![100.0]),
        ("heavy".to_owned(), 3.0, vec![100.0]),
    ];
    let served = contend(&tenants, 4000.0, 10);
    let (light, heavy) = (served["light"], served["heavy"]);
    assert_eq!(light + heavy, 40_000.0, "{served:?}");
    let ratio = heavy / light;
    assert!((2.9..=3.1).contains(&ratio), "heavy/light = {ratio} ({served:?})");
}

#[test]
fn class_precedence_goes_before_virtual_time() {
    let mut s = scheduler();
    let plans = vec![
        plan(1, "acme", 1.0, JobClass::Batch, 10.0, &[(SHARED, 10.0)]),
        plan(2, "acme", 1.0, JobClass::Standard, 10.0, &[(SHARED, 10.0)]),
        plan(3, "globex", 1.0, JobClass::Interactive, 10.0, &[(SHARED, 10.0)]),
        plan(4, "initech", 1.0, JobClass::Background, 10.0, &[(SHARED, 10.0)]),
    ];
    let mut buckets = map(vec![bucket(1, SHARED, Rule::Gauge, 20.0, 20.0)]);
    let d = s.schedule(plans, &mut buckets, &no_guesses(), &no_pauses(), usize::MAX, t0());
    assert_eq!(admitted_ids(&d), vec![3, 2]);
    // The next class in line waits for the bucket; the one after it meets it closed.
    assert_eq!(d.blocked, 2);
    assert!(d.closed.contains(SHARED));
    let background = d.waiting.iter().find(|w| w.job.id.0.as_u128() == 4).unwrap();
    assert_eq!(background.note["reason"], "waiting_for_capacity");
    let batch = d.waiting.iter().find(|w| w.job.id.0.as_u128() == 1).unwrap();
    assert_eq!(batch.note["reason"], "waiting_for_turn");
}

const CONFIG: &str = r#"
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://127.0.0.1:18080/v1"
keys = [{ name = "k1", value = "sk-1" }]
models = ["gpt-4o-mini"]
[providers.limits."gpt-4o-mini"]
rpm = 600

[[routes]]
alias = "fast"
targets = ["oai/gpt-4o-mini"]

[[tenants]]
name = "acme"
api_key = "tk-acme"
weight = 2

[[tenants]]
name = "globex"
api_key = "tk-globex"
"#;

#[test]
fn the_starvation_guard_promotes_a_job_that_waited_too_long() {
    let config = Config::parse(CONFIG, "test.toml").unwrap();
    let (calibration, known, turn) = (HashMap::new(), Known::default(), AtomicUsize::new(0));
    let tenants = directory(&config);
    let planner = Planner {
        config: &config,
        tenants: &tenants,
        keyring: &crate::keyring::Keyring::default(),
        calibration: &calibration,
        known: &known,
        key_turn: &turn,
    };
    let old = |now| {
        let mut c = candidate(1, "acme", JobClass::Background);
        c.estimated_input_tokens = 10;
        planner.plan(c, now).unwrap()
    };
    let fresh = |now| {
        let mut c = candidate(2, "globex", JobClass::Standard);
        c.created_at = now;
        c.estimated_input_tokens = 10;
        planner.plan(c, now).unwrap()
    };
    assert_eq!(old(t0() + Duration::seconds(60)).class, JobClass::Background);
    assert_eq!(old(t0() + Duration::seconds(61)).class, JobClass::Interactive);
    let p = old(t0());
    assert_eq!((p.weight, p.cost), (2.0, 10.0));
    assert_eq!(fresh(t0()).weight, 1.0);

    // One request of room: the fresh standard job goes first until the old one starves.
    let round = |now| {
        let (a, b) = (old(now), fresh(now));
        let mut buckets: HashMap<String, Bucket> = a
            .bucket_keys()
            .enumerate()
            .map(|(i, k)| {
                let amount = a.routes[0].path[i].1;
                (k.clone(), bucket(i as i64, k, Rule::Gauge, amount, amount))
            })
            .collect();
        assert!(!buckets.is_empty());
        let d = scheduler().schedule(
            vec![a, b],
            &mut buckets,
            &no_guesses(),
            &no_pauses(),
            usize::MAX,
            now,
        );
        admitted_ids(&d)
    };
    assert_eq!(round(t0() + Duration::seconds(30)), vec![2]);
    assert_eq!(round(t0() + Duration::seconds(90)), vec![1]);
}

#[test]
fn a_tenant_s_work_past_its_guard_goes_by_deadline_whatever_class_it_came_from() {
    // Both starving, read class by class: the standard job (due in a day) comes first,
    // the background one is due in two minutes. Room for one.
    let mut standard = plan(1, "acme", 1.0, JobClass::Interactive, 10.0, &[(SHARED, 1.0)]);
    standard.job.class = JobClass::Standard;
    let mut background = plan(2, "acme", 1.0, JobClass::Interactive, 10.0, &[(SHARED, 1.0)]);
    background.job.class = JobClass::Background;
    background.job.deadline = t0() + Duration::minutes(2);
    let mut buckets = map(vec![bucket(1, SHARED, Rule::Gauge, 1.0, 1.0)]);
    let d = scheduler().schedule(
        vec![standard, background],
        &mut buckets,
        &no_guesses(),
        &no_pauses(),
        usize::MAX,
        t0(),
    );
    assert_eq!(admitted_ids(&d), vec![2]);
}

#[test]
fn a_blocked_tenant_does_not_hold_back_others_on_other_buckets() {
    let mut s = scheduler();
    let plans = vec![
        plan(
            1,
            "acme",
            1.0,
            JobClass::Standard,
            10.0,
            &[("route:x:tokens", 10.0)],
        ),
        plan(
            2,
            "acme",
            1.0,
            JobClass::Standard,
            10.0,
            &[("route:y:tokens", 10.0)],
        ),
        plan(
            3,
            "globex",
            1.0,
            JobClass::Standard,
            10.0,
            &[("route:y:tokens", 10.0)],
        ),
    ];
    let mut buckets = map(vec![
        bucket(1, "route:x:tokens", Rule::Gauge, 10.0, 0.0),
        bucket(2, "route:y:tokens", Rule::Gauge, 100.0, 100.0),
    ]);
    let d = s.schedule(plans, &mut buckets, &no_guesses(), &no_pauses(), usize::MAX, t0());
    // acme's first job waits on x; its next job and globex's go out on y.
    assert_eq!(admitted_ids(&d), vec![2, 3]);
    assert_eq!(d.closed, HashSet::from(["route:x:tokens".to_owned()]));
    assert_eq!(d.waiting.len(), 1);
    assert_eq!(d.waiting[0].note["bucket"], "route:x:tokens");
    assert_eq!(d.waiting[0].note["remaining"], 0.0);
    assert_eq!(d.waiting[0].note["needs"], 10.0);
    assert_eq!(buckets["route:y:tokens"].level, 80.0);
}

/// A big job and a stream of small ones share a bucket refilled by `refill` per round.
/// Returns the round the big job was admitted in, if it was within `rounds`.
fn big_among_small(big: f64, small: f64, small_weight: f64, refill: f64, rounds: usize) -> Option<usize> {
    let capacity = 10_000.0;
    let per_sec = capacity / 60.0;
    let mut s = scheduler();
    let mut b = bucket(1, SHARED, Rule::Rolling, capacity, 0.0);
    let mut next_small = 0u128;
    for round in 1..=rounds {
        let now = t0() + Duration::microseconds((round as f64 * refill / per_sec * 1e6) as i64);
        b.refill(now);
        let mut plans = vec![plan(1, "big", 1.0, JobClass::Standard, big, &[(SHARED, big)])];
        for i in 0..50 {
            let n = 1000 + next_small + i;
            plans.push(plan(
                n,
                "small",
                small_weight,
                JobClass::Standard,
                small,
                &[(SHARED, small)],
            ));
        }
        let mut buckets = map(vec![b.clone()]);
        let d = s.schedule(plans, &mut buckets, &no_guesses(), &no_pauses(), usize::MAX, now);
        b = buckets[SHARED].clone();
        if admitted_ids(&d).contains(&1) {
            return Some(round);
        }
        next_small += d.admitted.len() as u128;
    }
    None
}

#[test]
fn a_big_job_is_not_starved_by_a_stream_of_small_ones() {
    // Refill of 1,000 a round; the big job needs 9,000: without closing the bucket to the
    // small jobs behind it, they would take every refill.
    let round = big_among_small(9000.0, 100.0, 1.0, 1000.0, 30);
    assert!(round.is_some_and(|r| r <= 10), "admitted in round {round:?}");
}

#[test]
fn deadline_unmeetable_when_capacity_comes_too_late() {
    // 10 tokens a second, none left; the job needs 300: 30 s away.
    let decide = |deadline: DateTime<Utc>| {
        let mut p = plan(1, "acme", 1.0, JobClass::Standard, 300.0, &[(SHARED, 300.0)]);
        p.job.deadline = deadline;
        let mut buckets = map(vec![bucket(1, SHARED, Rule::Rolling, 600.0, 0.0)]);
        scheduler().schedule(
            vec![p],
            &mut buckets,
            &no_guesses(),
            &no_pauses(),
            usize::MAX,
            t0(),
        )
    };
    let d = decide(t0() + Duration::seconds(10));
    assert_eq!(d.failed.len(), 1);
    assert_eq!(d.failed[0].verdict, Verdict::DeadlineUnmeetable);
    assert_eq!(d.failed[0].verdict.code().as_str(), "deadline_unmeetable");
    assert_eq!(d.failed[0].bucket, SHARED);
    assert!(d.failed[0].message.contains(SHARED), "{}", d.failed[0].message);
    assert!(d.closed.is_empty(), "a job that fails closes nothing");

    let d = decide(t0() + Duration::seconds(60));
    assert!(d.failed.is_empty());
    let ready = t0() + Duration::seconds(30);
    assert_eq!(d.next_ready, Some(ready));
    assert_eq!(d.waiting[0].note["expected_at"], serde_json::json!(ready));
    assert_eq!(d.waiting[0].note["limit"], 600.0);
}

#[test]
fn a_stale_learned_capacity_is_probed_by_a_job_larger_than_it() {
    let key = "provider:p:m:tpm";
    // A provider reported 2,000 TPM (a bogus or outdated reading); nothing is configured.
    let learned = |learned_at: DateTime<Utc>, level: f64| {
        let mut b = bucket(1, key, Rule::Rolling, 2_000.0, level);
        b.configured_capacity = None;
        b.learned_at = Some(learned_at);
        map(vec![b])
    };
    let job = || plan(1, "acme", 1.0, JobClass::Standard, 5_000.0, &[(key, 5_000.0)]);

    // Fresh: trusted, the job can never fit.
    let mut b = learned(t0(), 2_000.0);
    let d = scheduler().schedule(vec![job()], &mut b, &no_guesses(), &no_pauses(), usize::MAX, t0());
    assert_eq!(d.failed.len(), 1);
    assert_eq!(d.failed[0].verdict, Verdict::ExceedsLimit);

    // Stale and not full: it waits for the whole bucket, and says so.
    let stale = t0() - Duration::seconds(learning::TRUSTED_FOR.as_secs() as i64);
    let mut b = learned(stale, 1_500.0);
    let d = scheduler().schedule(vec![job()], &mut b, &no_guesses(), &no_pauses(), usize::MAX, t0());
    assert!(d.failed.is_empty() && d.admitted.is_empty());
    assert_eq!(d.waiting[0].note["needs"], 2_000.0);
    assert_eq!(d.next_ready, Some(t0() + Duration::seconds(15)));

    // Stale and full: it goes, alone, taking the whole bucket (the probe).
    let mut b = learned(stale, 2_000.0);
    let second = plan(2, "acme", 1.0, JobClass::Standard, 10.0, &[(key, 10.0)]);
    let d = scheduler().schedule(
        vec![job(), second],
        &mut b,
        &no_guesses(),
        &no_pauses(),
        usize::MAX,
        t0(),
    );
    assert_eq!(admitted_ids(&d), vec![1]);
    assert_eq!(d.admitted[0].admission.amounts, vec![2_000.0]);
    assert_eq!(b[key].level, 0.0);

    // Fresh but only guessed from 429s: a 429 never says one request is too large, so it
    // goes alone once the bucket is full.
    let mut b = learned(t0(), 2_000.0);
    let guessed = HashSet::from([key.to_owned()]);
    let d = scheduler().schedule(vec![job()], &mut b, &guessed, &no_pauses(), usize::MAX, t0());
    assert_eq!(admitted_ids(&d), vec![1]);
    assert_eq!(d.admitted[0].admission.amounts, vec![2_000.0]);

    // A configured capacity that cannot hold the job still refuses it, stale or not.
    let mut b = learned(stale, 2_000.0);
    b.get_mut(key).unwrap().configured_capacity = Some(3_000.0);
    let d = scheduler().schedule(vec![job()], &mut b, &no_guesses(), &no_pauses(), usize::MAX, t0());
    assert_eq!(d.failed[0].verdict, Verdict::ExceedsLimit);
}

#[test]
fn exceeds_limit_only_when_no_route_can_ever_hold_it() {
    let small = "route:small:tokens";
    let big = "route:big:tokens";
    let buckets = || {
        map(vec![
            bucket(1, small, Rule::Gauge, 100.0, 100.0),
            bucket(2, big, Rule::Gauge, 1000.0, 1000.0),
        ])
    };
    let mut p = plan(1, "acme", 1.0, JobClass::Standard, 200.0, &[(small, 200.0)]);
    let mut b = buckets();
    let d = scheduler().schedule(
        vec![p.clone()],
        &mut b,
        &no_guesses(),
        &no_pauses(),
        usize::MAX,
        t0(),
    );
    assert_eq!(d.failed.len(), 1);
    assert_eq!(
        (d.failed[0].verdict, d.failed[0].bucket.as_str()),
        (Verdict::ExceedsLimit, small)
    );
    assert_eq!(
        d.failed[0].message,
        "the job needs 200 of route:small:tokens but its whole capacity is 100"
    );

    // A second target that can hold it: admitted there (a fallback).
    p.routes.push(route("other", &[(big, 200.0)]));
    let mut b = buckets();
    let d = scheduler().schedule(vec![p], &mut b, &no_guesses(), &no_pauses(), usize::MAX, t0());
    assert!(d.failed.is_empty());
    assert_eq!(d.admitted[0].route, 1);
    assert_eq!(d.admitted[0].target().model, "other");
    assert_eq!(d.admitted[0].preferred().model, "m");
    assert_eq!(
        (
            d.admitted[0].admission.bucket_ids.clone(),
            d.admitted[0].admission.amounts.clone()
        ),
        (vec![2], vec![200.0])
    );
    assert_eq!(b[big].level, 800.0);
    assert_eq!(b[small].level, 100.0);
}

#[test]
fn rejected_keys_are_skipped_and_all_rejected_fail() {
    let keyed = |key| Route {
        target: target("m", Some(key)),
        scope: buckets::target_scope("p", "m"),
        path: vec![],
        cost: Default::default(),
    };
    let p = Plan {
        routes: vec![keyed("k1"), keyed("k2")],
        ..plan(1, "acme", 1.0, JobClass::Standard, 1.0, &[])
    };
    let mut paused = Pauses::new();
    paused.insert(buckets::key_scope("p", "k1"), t0() + Duration::days(365));
    let d = scheduler().schedule(
        vec![p.clone()],
        &mut HashMap::new(),
        &no_guesses(),
        &paused,
        usize::MAX,
        t0(),
    );
    assert_eq!(d.admitted[0].admission.key.as_deref(), Some("k2"));

    paused.insert(buckets::key_scope("p", "k2"), t0() + Duration::days(365));
    let d = scheduler().schedule(
        vec![p],
        &mut HashMap::new(),
        &no_guesses(),
        &paused,
        usize::MAX,
        t0(),
    );
    assert!(d.admitted.is_empty());
    assert_eq!(d.failed[0].verdict, Verdict::UpstreamCredentialsExhausted);
    assert!(!d.failed[0].verdict.by_bucket());
}

#[test]
fn a_paused_model_waits_for_its_retry_after() {
    let until = t0() + Duration::seconds(5);
    let mut paused = Pauses::new();
    paused.insert(buckets::target_scope("p", "m"), until);
    let p = plan(1, "acme", 1.0, JobClass::Standard, 1.0, &[]);
    let d = scheduler().schedule(
        vec![p.clone()],
        &mut HashMap::new(),
        &no_guesses(),
        &paused,
        usize::MAX,
        t0(),
    );
    assert!(d.admitted.is_empty() && d.failed.is_empty());
    assert_eq!(d.next_ready, Some(until));
    assert_eq!(d.waiting[0].note["reason"], "provider_rate_limited");
    assert_eq!(d.waiting[0].note["scope"], "provider:p:m");
    assert_eq!(d.waiting[0].note["expected_at"], serde_json::json!(until));

    // Another target of the route is not paused: the job goes there.
    let mut p = p;
    p.routes.push(route("other", &[]));
    let d = scheduler().schedule(
        vec![p],
        &mut HashMap::new(),
        &no_guesses(),
        &paused,
        usize::MAX,
        t0(),
    );
    assert_eq!(d.admitted[0].target().model, "other");

    // Past the pause (the store reads only active pauses), it goes to its first target.
    let p = plan(1, "acme", 1.0, JobClass::Standard, 1.0, &[]);
    let d = scheduler().schedule(
        vec![p],
        &mut HashMap::new(),
        &no_guesses(),
        &no_pauses(),
        usize::MAX,
        until,
    );
    assert_eq!(d.admitted[0].target().model, "m");
}

#[test]
fn an_operator_s_pause_holds_jobs_whatever_their_deadline_and_others_go_on() {
    let mut paused = Pauses::new();
    paused.insert(
        crate::holds::Held::Tenant("acme".into()).scope(),
        crate::holds::held_until(),
    );
    // A deadline a minute away: a pause with no end does not fail it as unmeetable.
    let mut held = plan(1, "acme", 1.0, JobClass::Standard, 1.0, &[]);
    held.job.deadline = t0() + Duration::minutes(1);
    let other = plan(2, "globex", 1.0, JobClass::Standard, 1.0, &[]);
    let d = scheduler().schedule(
        vec![held, other],
        &mut HashMap::new(),
        &no_guesses(),
        &paused,
        usize::MAX,
        t0(),
    );
    assert_eq!(admitted_ids(&d), vec![2]);
    assert!(d.failed.is_empty());
    assert_eq!(d.waiting[0].note["reason"], "paused_by_operator");
    assert_eq!(d.waiting[0].note["scope"], "tenant:acme");

    // A model held by the operator: the route's next target serves; with none, the job
    // waits (not failed) and says who holds it.
    let mut paused = Pauses::new();
    paused.insert(buckets::target_scope("p", "m"), crate::holds::held_until());
    let mut p = plan(3, "acme", 1.0, JobClass::Standard, 1.0, &[]);
    p.job.deadline = t0() + Duration::minutes(1);
    let d = scheduler().schedule(
        vec![p.clone()],
        &mut HashMap::new(),
        &no_guesses(),
        &paused,
        usize::MAX,
        t0(),
    );
    assert!(d.admitted.is_empty() && d.failed.is_empty());
    assert_eq!(d.waiting[0].note["reason"], "paused_by_operator");
    assert_eq!(d.waiting[0].note["scope"], "provider:p:m");
    p.routes.push(route("other", &[]));
    let d = scheduler().schedule(
        vec![p],
        &mut HashMap::new(),
        &no_guesses(),
        &paused,
        usize::MAX,
        t0(),
    );
    assert_eq!(d.admitted[0].target().model, "other");
}

#[test]
fn the_interactive_reserve_is_kept_from_lower_classes() {
    let key = "provider:p:m:rpm";
    let policy = Policy::new(GateConfig {
        interactive_reserve: 0.05,
        ..gate()
    });
    let decide = |class| {
        let mut buckets = map(vec![bucket(1, key, Rule::Rolling, 100.0, 4.0)]);
        let p = plan(1, "acme", 1.0, class, 1.0, &[(key, 1.0)]);
        Scheduler::new(policy.clone()).schedule(
            vec![p],
            &mut buckets,
            &no_guesses(),
            &no_pauses(),
            usize::MAX,
            t0(),
        )
    };
    assert_eq!(decide(JobClass::Interactive).admitted.len(), 1);
    let d = decide(JobClass::Standard);
    assert!(d.admitted.is_empty());
    assert_eq!(d.waiting[0].note["reason"], "waiting_for_capacity");
    // Non-provider buckets keep nothing back.
    let tenant = bucket(2, "tenant:acme:rpm", Rule::Rolling, 100.0, 4.0);
    assert_eq!(policy.headroom(&tenant, JobClass::Standard), 0.0);
    let provider = bucket(3, key, Rule::Rolling, 600.0, 600.0);
    let with_transit = Policy::new(GateConfig {
        headroom_secs: 2.0,
        interactive_reserve: 0.05,
        ..gate()
    });
    assert_eq!(with_transit.headroom(&provider, JobClass::Interactive), 20.0);
    assert_eq!(with_transit.headroom(&provider, JobClass::Batch), 50.0);
}

#[test]
fn a_wait_is_explained_once_until_its_note_changes() {
    let mut s = scheduler();
    let round = |s: &mut Scheduler, level: f64| {
        let p = plan(1, "acme", 1.0, JobClass::Standard, 300.0, &[(SHARED, 300.0)]);
        let mut buckets = map(vec![bucket(1, SHARED, Rule::Rolling, 600.0, level)]);
        s.schedule(
            vec![p],
            &mut buckets,
            &no_guesses(),
            &no_pauses(),
            usize::MAX,
            t0(),
        )
    };
    assert_eq!(round(&mut s, 0.0).waiting.len(), 1);
    let again = round(&mut s, 0.0);
    assert_eq!((again.waiting.len(), again.blocked), (0, 1));
    // More capacity now: expected sooner, a new note.
    assert_eq!(round(&mut s, 200.0).waiting.len(), 1);
    // Once admitted, it is forgotten: a later wait is explained again.
    s.admitted([JobId(Uuid::from_u128(1))]);
    assert_eq!(round(&mut s, 200.0).waiting.len(), 1);
}

#[test]
fn the_limit_ends_the_round_and_the_batch_makes_it_full() {
    let plans = || {
        (0..10)
            .map(|i| plan(i, "acme", 1.0, JobClass::Standard, 1.0, &[(SHARED, 1.0)]))
            .collect::<Vec<_>>()
    };
    let buckets = || map(vec![bucket(1, SHARED, Rule::Gauge, 100.0, 100.0)]);
    let mut b = buckets();
    let d = scheduler().schedule(plans(), &mut b, &no_guesses(), &no_pauses(), 3, t0());
    assert_eq!(admitted_ids(&d), vec![0, 1, 2]);
    assert!(!d.full, "stopped by the dispatchers' room, not the batch");
    assert_eq!(b[SHARED].level, 97.0);
    let mut s = Scheduler::new(Policy::new(GateConfig { batch: 3, ..gate() }));
    assert!(
        s.schedule(plans(), &mut buckets(), &no_guesses(), &no_pauses(), 3, t0())
            .full
    );
    assert!(
        !s.schedule(plans(), &mut buckets(), &no_guesses(), &no_pauses(), 11, t0())
            .full
    );
}

#[test]
fn a_returning_tenant_gets_at_most_its_burst_credit() {
    // globex is served once, then idles while acme runs alone; when it returns it may run
    // ahead by its burst credit only (ten jobs of 100), then shares evenly.
    let burst = 1000;
    let mut s = Scheduler::new(Policy::new(GateConfig {
        burst_credit_tokens: burst,
        ..gate()
    }));
    let jobs = |tenant: &str, from: u128, n: u128| -> Vec<Plan> {
        (from..from + n)
            .map(|i| plan(i, tenant, 1.0, JobClass::Standard, 100.0, &[(SHARED, 100.0)]))
            .collect()
    };
    let mut round = |plans: Vec<Plan>, capacity: f64| {
        let mut b = map(vec![bucket(1, SHARED, Rule::Gauge, capacity, capacity)]);
        let d = s.schedule(plans, &mut b, &no_guesses(), &no_pauses(), usize::MAX, t0());
        d.admitted
            .iter()
            .filter(|a| a.plan.job.tenant == "globex")
            .count()
    };
    let mut first = jobs("acme", 0, 10);
    first.extend(jobs("globex", 100, 10));
    assert_eq!(round(first, 2000.0), 10);
    for r in 1..=20u128 {
        assert_eq!(round(jobs("acme", r * 1000, 10), 1000.0), 0);
    }
    let mut last = jobs("acme", 100_000, 30);
    last.extend(jobs("globex", 200_000, 30));
    let globex = round(last, 3000.0);
    // Its credit (10 jobs, and the one at the same virtual time) plus half of the rest.
    assert!((19..=21).contains(&globex), "globex got {globex} of 30");
}

/// (weight, job costs in turn) per tenant.
/// The config's tenants as the directory holds them.
fn directory(config: &Config) -> crate::tenants::TenantDirectory {
    crate::tenants::TenantDirectory::from_config(config).unwrap()
}

fn tenants(max: usize) -> impl Strategy<Value = Vec<(f64, Vec<f64>)>> {
    prop::collection::vec(
        (1u32..=5, prop::collection::vec(200u32..=2000, 1..8))
            .prop_map(|(w, c)| (f64::from(w), c.into_iter().map(f64::from).collect())),
        2..=max,
    )
}

fn named(t: Vec<(f64, Vec<f64>)>) -> Vec<(String, f64, Vec<f64>)> {
    t.into_iter()
        .enumerate()
        .map(|(i, (w, c))| (format!("t{i}"), w, c))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Under contention each tenant's admitted tokens are its weight's share of the total.
    #[test]
    fn admitted_cost_follows_the_weights(t in tenants(4)) {
        let t = named(t);
        let (capacity, rounds) = (20_000.0, 60);
        let served = contend(&t, capacity, rounds);
        let total: f64 = served.values().sum();
        prop_assert!(total >= rounds as f64 * (capacity - 2000.0), "total {total}");
        let weights: f64 = t.iter().map(|x| x.1).sum();
        for (name, weight, _) in &t {
            let share = served.get(name).copied().unwrap_or(0.0) / total;
            let fair = weight / weights;
            prop_assert!((share - fair).abs() <= 0.05, "{name}: share {share:.3}, weight's {fair:.3}, {served:?}");
        }
    }

    /// Every tenant with work that fits is served, whatever the weights.
    #[test]
    fn every_tenant_with_fitting_work_is_served(t in tenants(8)) {
        let t = named(t);
        let served = contend(&t, 10_000.0, 30);
        for (name, _, _) in &t {
            prop_assert!(served.get(name).copied().unwrap_or(0.0) > 0.0, "{name} starved: {served:?}");
        }
    }

    /// A job that fits the bucket's capacity goes out once the refill has gathered it,
    /// however many small jobs of any weight compete for the same bucket.
    #[test]
    fn a_big_job_goes_out_once_the_refill_holds_it(
        big in 2000u32..=10_000, small in 1u32..=500, weight in 1u32..=10, refill in 200u32..=2000,
    ) {
        let (big, small, refill) = (f64::from(big), f64::from(small), f64::from(refill));
        // At most one small job goes before the big one's first turn.
        let bound = ((big + small) / refill).ceil() as usize + 1;
        let round = big_among_small(big, small, f64::from(weight), refill, bound + 5);
        prop_assert!(round.is_some_and(|r| r <= bound), "round {round:?}, bound {bound}");
    }

    /// Whatever the buckets and plans: no admission takes more than a bucket holds, each
    /// takes exactly its route's amounts, and every plan is admitted, waits or fails once.
    #[test]
    fn a_round_never_overdraws_and_accounts_for_every_plan(
        levels in prop::collection::vec((1u32..=1000, 0u32..=1000, prop::bool::ANY), 1..5),
        jobs in prop::collection::vec(
            (0usize..3, 0usize..4, prop::collection::vec((0usize..5, 1u32..=600), 0..3), 1u32..=5),
            0..40,
        ),
        limit in 1usize..50,
    ) {
        let keys: Vec<String> = (0..levels.len()).map(|i| format!("route:r{i}:tokens")).collect();
        let mut buckets: HashMap<String, Bucket> = levels
            .iter()
            .enumerate()
            .map(|(i, (cap, level, rolling))| {
                let (cap, level) = (f64::from(*cap), f64::from(*level).min(f64::from(*cap)));
                let rule = if *rolling { Rule::Rolling } else { Rule::Gauge };
                (keys[i].clone(), bucket(i as i64, &keys[i], rule, cap, level))
            })
            .collect();
        let before = buckets.clone();
        let classes = [JobClass::Interactive, JobClass::Standard, JobClass::Batch];
        let plans: Vec<Plan> = jobs
            .iter()
            .enumerate()
            .map(|(n, (tenant, class, path, weight))| {
                // A path names each bucket once.
                let mut path: Vec<(&str, f64)> = path
                    .iter()
                    .map(|(k, a)| (keys[k % keys.len()].as_str(), f64::from(*a)))
                    .collect();
                path.sort_by(|a, b| a.0.cmp(b.0));
                path.dedup_by(|a, b| a.0 == b.0);
                let cost = path.iter().map(|p| p.1).sum::<f64>();
                plan(n as u128, &format!("t{tenant}"), f64::from(*weight), classes[class % 3], cost, &path)
            })
            .collect();
        let count = plans.len();
        let d = scheduler().schedule(plans, &mut buckets, &no_guesses(), &no_pauses(), limit, t0());
        prop_assert!(d.admitted.len() <= limit);
        for (key, b) in &buckets {
            prop_assert!(b.level >= -1e-6, "{key} overdrawn: {}", b.level);
            let taken: f64 = d
                .admitted
                .iter()
                .flat_map(|a| a.plan.routes[a.route].path.iter())
                .filter(|(k, _)| k == key)
                .map(|(_, a)| a)
                .sum();
            prop_assert!((before[key].level - b.level - taken).abs() < 1e-6);
        }
        let deadline_failures = d.failed.iter().filter(|f| f.verdict == Verdict::DeadlineUnmeetable).count();
        let decided = d.admitted.len() + d.failed.len() + d.blocked - deadline_failures;
        if d.admitted.len() < limit {
            prop_assert_eq!(decided, count);
        } else {
            prop_assert!(decided <= count);
        }
    }
}

#[test]
fn a_tenant_whose_next_jobs_were_not_read_is_not_passed_by_the_others() {
    // Two of each tenant's queue read, more waiting unread; room for all four.
    let key = "provider:p:m:tpm";
    let mut b = map(vec![bucket(1, key, Rule::Rolling, 1_000.0, 1_000.0)]);
    let read_in_part = |n, tenant, weight| Plan {
        unread_behind: true,
        ..plan(n, tenant, weight, JobClass::Standard, 10.0, &[(key, 10.0)])
    };
    let plans = vec![
        read_in_part(1, "acme", 3.0),
        read_in_part(2, "acme", 3.0),
        read_in_part(3, "globex", 1.0),
        read_in_part(4, "globex", 1.0),
    ];
    let d = scheduler().schedule(plans, &mut b, &no_guesses(), &no_pauses(), usize::MAX, t0());
    // acme's second job goes at the virtual time globex's second would have passed it at:
    // the round ends there, and the next reads on.
    assert_eq!(admitted_ids(&d), vec![1, 3, 2]);
    assert!(d.full);
}

#[test]
fn every_job_promoted_past_its_guard_was_submitted_before_the_gate_reads_its_class_starving() {
    let config = Config::parse(CONFIG, "test.toml").unwrap();
    // The standard class's guard is 60 s: a job of t0 competes as interactive from 61 s on.
    for waited in [59, 60, 61, 120] {
        let now = t0() + Duration::seconds(waited);
        let job = candidate(1, "a", JobClass::Standard);
        let promoted = plan::competing_class(&config, &job, now) == JobClass::Interactive;
        let read = job.created_at < plan::starving_before(&config, JobClass::Standard, now);
        assert_eq!(promoted, waited > 60, "{waited} s");
        assert!(
            !promoted || read,
            "promoted at {waited} s but not read as starving"
        );
    }
    // Interactive work has no class to be promoted from: none is read as starving.
    assert_eq!(
        plan::starving_before(&config, JobClass::Interactive, t0()),
        DateTime::<Utc>::UNIX_EPOCH
    );
}
