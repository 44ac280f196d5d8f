//! Spend in dollars: each job shows what it cost at the configured prices, and
//! `GET /v1/usage` sums the jobs — per tenant for a tenant, every tenant's for the admin —
//! grouped as asked, as JSON or CSV.

use serde_json::{Value, json};

use crate::harness::{ACME, GLOBEX, TestApp, TestOptions, job};

/// USD per million tokens of gpt-4o-mini in this test.
const INPUT_PRICE: f64 = 0.15;
const OUTPUT_PRICE: f64 = 0.6;
const ADMIN: &str = "tk-admin-usage";

#[tokio::test]
async fn usage_sums_what_each_job_cost() {
    let app = TestApp::spawn_with(TestOptions {
        server_config: format!("admin_key = \"{ADMIN}\""),
        extra_config: format!(
            "[providers.prices.\"gpt-4o-mini\"]\ninput_per_mtok = {INPUT_PRICE}\noutput_per_mtok = {OUTPUT_PRICE}\n"
        ),
        ..TestOptions::default()
    })
    .await;
    let mut acme_cost = 0.0;
    let mut acme_tokens = (0, 0);
    for i in 0..3 {
        let done = app
            .run_job(ACME, &job("oai/gpt-4o-mini", &format!("hello {i}")), 30)
            .await;
        assert_eq!(done["state"], "succeeded", "{done}");
        let (input, output) = (
            done["usage"]["input_tokens"].as_i64().unwrap(),
            done["usage"]["output_tokens"].as_i64().unwrap(),
        );
        let charged = done["cost"]["charged_usd"].as_f64().unwrap();
        let priced = (input as f64 * INPUT_PRICE + output as f64 * OUTPUT_PRICE) / 1e6;
        assert!((charged - priced).abs() < 1e-12, "{charged} vs {priced}: {done}");
        assert_eq!(done["cost"]["lane"], "online");
        acme_cost += charged;
        acme_tokens = (acme_tokens.0 + input, acme_tokens.1 + output);
    }
    let globex = app.run_job(GLOBEX, &job("oai/gpt-4o-mini", "hi"), 30).await;
    let globex_cost = globex["cost"]["charged_usd"].as_f64().unwrap();

    // A tenant sees its own jobs, grouped as it asks.
    let (status, usage) = app.get(ACME, "/v1/usage?group_by=day,model,endpoint,lane").await;
    assert_eq!(status, 200, "{usage}");
    let rows = usage["data"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{usage}");
    let row = &rows[0];
    assert_eq!(
        (&row["model"], &row["endpoint"], &row["lane"], &row["requests"]),
        (
            &json!("gpt-4o-mini"),
            &json!("/v1/chat/completions"),
            &json!("online"),
            &json!(3)
        ),
        "{row}"
    );
    assert_eq!(row["day"], chrono::Utc::now().format("%Y-%m-%d").to_string());
    assert!(
        (row["usd"].as_f64().unwrap() - acme_cost).abs() < 1e-12,
        "{row} vs {acme_cost}"
    );
    assert_eq!(
        (row["input_tokens"].as_i64(), row["output_tokens"].as_i64()),
        (Some(acme_tokens.0), Some(acme_tokens.1))
    );
    assert!(row.get("tenant").is_none(), "only the fields asked for: {row}");

    // The admin sees every tenant's; by tenant, the sums are each tenant's.
    let (status, all) = app.get(ADMIN, "/v1/usage?group_by=tenant").await;
    assert_eq!(status, 200, "{all}");
    let by_tenant: Vec<(String, f64, i64)> = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["tenant"].as_str().unwrap().to_owned(),
                r["usd"].as_f64().unwrap(),
                r["requests"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(by_tenant.len(), 2, "{all}");
    assert_eq!((by_tenant[0].0.as_str(), by_tenant[0].2), ("acme", 3));
    assert!((by_tenant[0].1 - acme_cost).abs() < 1e-12);
    assert_eq!((by_tenant[1].0.as_str(), by_tenant[1].2), ("globex", 1));
    assert!((by_tenant[1].1 - globex_cost).abs() < 1e-12);
    // A tenant never sees another's, even asking by tenant.
    let (_, own) = app.get(GLOBEX, "/v1/usage?group_by=tenant").await;
    assert_eq!(own["data"].as_array().map(Vec::len), Some(1), "{own}");
    assert_eq!(own["data"][0]["tenant"], "globex");

    // CSV: a header, then a row per group.
    let csv = app
        .http
        .get(app.url("/v1/usage?group_by=hour,tenant&format=csv"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(csv.status(), 200);
    assert!(
        csv.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/csv")
    );
    let text = csv.text().await.unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "hour,tenant,usd,input_tokens,output_tokens,requests");
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[1].contains(",acme,") && lines[1].ends_with(",3"), "{text}");

    // The CLI prints the same rows as a table, and the server's CSV as it is.
    let (code, table, err) =
        crate::cli::tollgate(&app, ACME, &["usage", "--group-by", "model,endpoint"]).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].contains("MODEL") && lines[0].contains("USD") && lines[0].contains("REQUESTS"),
        "{table}"
    );
    assert!(
        lines[1].contains("gpt-4o-mini") && lines[1].contains(&format!("{acme_cost:.6}")),
        "{table}"
    );
    let (code, csv, err) =
        crate::cli::tollgate(&app, ACME, &["usage", "--group-by", "tenant", "--csv"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        csv.starts_with("tenant,usd,input_tokens,output_tokens,requests\nacme,"),
        "{csv}"
    );

    // What it cannot group by, or a period that is not one, is refused by its parameter.
    for (query, param) in [
        ("group_by=day,hour", "group_by"),
        ("group_by=colour", "group_by"),
        ("format=xml", "format"),
        ("from=2030-01-01T00:00:00Z&to=2029-01-01T00:00:00Z", "from"),
    ] {
        let (status, refused) = app.get(ACME, &format!("/v1/usage?{query}")).await;
        assert_eq!(
            (status, refused["error"]["param"].as_str()),
            (400, Some(param)),
            "{query}: {refused}"
        );
    }
    // Nothing finished in a period: no rows.
    let (_, empty) = app
        .get(
            ACME,
            "/v1/usage?from=2020-01-01T00:00:00Z&to=2020-02-01T00:00:00Z",
        )
        .await;
    assert_eq!(empty["data"], Value::Array(Vec::new()));
    app.shutdown().await;
}
