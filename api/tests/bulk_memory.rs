//! What reading a bulk body holds on the heap at its peak, measured by dhat. A test
//! binary of its own: the allocator it installs counts this test's allocations alone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::Utc;
use serde_json::{Value, json};
use tollgate::config::Config;
use tollgate::tenants::{Caller, Tenant};
use tollgate_api::bulk::prepare;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const CONFIG: &str = r#"
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://127.0.0.1:1/v1"
keys = [{ name = "k1", value = "sk-1" }]
models = ["gpt-4o-mini"]
[[routes]]
alias = "fast"
targets = ["oai/gpt-4o-mini"]
[[tenants]]
name = "acme"
api_key = "tk-acme"
"#;

/// A bulk of `jobs` jobs, each a conversation of many short turns: the shape whose tree
/// of values is largest against its text.
fn body(jobs: usize) -> Vec<u8> {
    let items: Vec<Value> = (0..jobs)
        .map(|i| {
            let turns: Vec<Value> = (0..40)
                .map(|t| json!({"role": if t % 2 == 0 { "user" } else { "assistant" }, "content": format!("turn {t} of {i}")}))
                .collect();
            json!({"request": {"model": "fast", "messages": turns, "max_tokens": 8}, "metadata": {"n": i}})
        })
        .collect();
    serde_json::to_vec(&json!({ "jobs": items })).unwrap()
}

/// Before, the handler parsed the whole body into one `serde_json::Value` (several times
/// its size) and kept every request as values until the insert. Now items stay text
/// until each is read, and only the requests' text is kept: the peak is about the
/// body's size, not a multiple of it.
#[test]
fn reading_a_bulk_keeps_requests_as_text_and_never_the_body_as_values() {
    let config = Config::parse(CONFIG, "test.toml").unwrap();
    let tenant = Caller::of(Tenant::plain("acme", &config));
    let now = Utc::now();
    let body = body(500);
    // The BPE tables load once per process: not this bulk's cost.
    prepare(&config, &tenant, &self::body(1), now).unwrap();

    let as_values = {
        let _profiler = dhat::Profiler::builder().testing().build();
        let tree: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(tree["jobs"].as_array().map(Vec::len), Some(500));
        dhat::HeapStats::get().max_bytes
    };
    let prepared = {
        let _profiler = dhat::Profiler::builder().testing().build();
        let jobs = prepare(&config, &tenant, &body, now).unwrap().jobs;
        assert_eq!(jobs.len(), 500);
        assert!(jobs[7].request.get().contains("turn 3 of 7"));
        dhat::HeapStats::get().max_bytes
    };
    let size = body.len();
    eprintln!("bulk of {size} bytes: peak {prepared} bytes read as text, {as_values} as values");
    // The reference shows this body is one where the difference shows.
    assert!(
        as_values > 4 * size,
        "the body as values: {as_values} bytes for {size}"
    );
    assert!(
        prepared < 2 * size,
        "reading the bulk peaked at {prepared} bytes for a body of {size} (as values: {as_values})"
    );
}
