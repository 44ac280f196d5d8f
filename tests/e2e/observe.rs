//! Seeing the broker: `/openapi.json` describes every route the server answers, and
//! describes the job as the server renders it.

use serde_json::Value;

use crate::harness::{ACME, TestApp, job};

#[tokio::test]
async fn openapi_document_matches_what_the_server_serves() {
    let app = TestApp::spawn().await;
    let r = app.http.get(app.url("/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 8, "{:?}", paths.keys());
    // Every described operation is served: unauthenticated, each answers something other
    // than the fallback's `no_such_endpoint` or 405.
    for (path, item) in paths {
        let concrete = path.replace("{id}", "0190b7a0-0000-7000-8000-000000000000");
        for method in item.as_object().unwrap().keys() {
            let m: reqwest::Method = method.to_uppercase().parse().unwrap();
            let r = app
                .http
                .request(m.clone(), app.url(&concrete))
                .header("content-type", "application/json")
                .body("{}")
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            assert!(
                status != 405 && body["error"]["code"] != "no_such_endpoint",
                "{m} {path} is described but not served: {status} {body}"
            );
        }
    }
    // The job as described is the job as served.
    let (status, served) = app.submit(ACME, &job("fast", "describe me")).await;
    assert_eq!(status, 202);
    let mut served_keys: Vec<&String> = served.as_object().unwrap().keys().collect();
    let described = doc["components"]["schemas"]["Job"]["properties"]
        .as_object()
        .unwrap();
    let mut described_keys: Vec<&String> = described.keys().collect();
    served_keys.sort();
    described_keys.sort();
    assert_eq!(
        served_keys, described_keys,
        "the Job schema drifted from jobs::job_view"
    );
    app.shutdown().await;
}
