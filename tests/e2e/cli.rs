//! The client commands of the real `tollgate` binary against a running server: submit a
//! JSONL file and wait (exit code reflects failures), read a job, print the status.

use serde_json::{Value, json};

use crate::harness::{ACME, TestApp, TestOptions};

/// Runs `tollgate ARGS` against `app` as `key`; returns (exit code, stdout, stderr).
async fn tollgate(app: &TestApp, key: &str, args: &[&str]) -> (i32, String, String) {
    run(&[("TOLLGATE_URL", &app.api), ("TOLLGATE_KEY", key)], args).await
}

/// Runs `tollgate ARGS` with `env` (and none of the test's own TOLLGATE_*, RUST_LOG, RUST_BACKTRACE).
async fn run(env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .env_remove("TOLLGATE_URL")
        .env_remove("TOLLGATE_KEY")
        .env_remove("RUST_LOG")
        // anyhow would add a backtrace to error messages.
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .envs(env.iter().copied())
        .output()
        .await
        .expect("run tollgate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn line(text: &str, max_tokens: u32) -> String {
    json!({"model": "fast", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
        .to_string()
}

#[tokio::test]
async fn submit_wait_jobs_get_and_status() {
    let app = TestApp::spawn_with(TestOptions {
        // A job asking for more output than the whole per-minute budget fails at the gate.
        extra_config: "[providers.limits.\"gpt-4o-mini\"]\ntpm = 5000\n".into(),
        server_config: "admin_key = \"tk-admin\"".into(),
        ..TestOptions::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();

    // Every job succeeds: exit 0, and the summary names each job.
    let good = dir.path().join("good.jsonl");
    let lines: Vec<String> = (0..4).map(|i| line(&format!("good {i}"), 16)).collect();
    std::fs::write(&good, lines.join("\n") + "\n").unwrap();
    let (code, out, err) = tollgate(
        &app,
        ACME,
        &[
            "submit",
            good.to_str().unwrap(),
            "--wait",
            "--json",
            "--deadline",
            "10m",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}\n{err}");
    let summary: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (summary["submitted"].as_u64(), summary["succeeded"].as_u64()),
        (Some(4), Some(4)),
        "{summary}"
    );
    let id = summary["jobs"][0]["id"].as_str().unwrap().to_owned();

    // `jobs get` prints what the API says.
    let (code, out, err) = tollgate(&app, ACME, &["jobs", "get", &id]).await;
    assert_eq!(code, 0, "{err}");
    let printed: Value = serde_json::from_str(&out).unwrap();
    let (_, served) = app.get(ACME, &format!("/v1/jobs/{id}")).await;
    assert_eq!(printed, served);
    assert_eq!(printed["state"], "succeeded");
    let deadline: chrono::DateTime<chrono::Utc> = printed["deadline"].as_str().unwrap().parse().unwrap();
    let created: chrono::DateTime<chrono::Utc> = printed["created_at"].as_str().unwrap().parse().unwrap();
    let minutes = (deadline - created).num_seconds() as f64 / 60.0;
    assert!(
        (9.9..=10.1).contains(&minutes),
        "--deadline 10m gave {minutes} min"
    );

    // One job fails (larger than the whole tpm) and one line is refused: exit 1.
    let mixed = dir.path().join("mixed.jsonl");
    let unknown = json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).to_string();
    let text = [line("fine", 16), line("too big", 100_000), unknown].join("\n");
    std::fs::write(&mixed, text).unwrap();
    let (code, out, err) = tollgate(
        &app,
        ACME,
        &["submit", mixed.to_str().unwrap(), "--wait", "--json"],
    )
    .await;
    assert_eq!(code, 1, "{out}\n{err}");
    let summary: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(summary["succeeded"], 1, "{summary}");
    assert_eq!(summary["failed"], 1, "{summary}");
    assert_eq!(summary["rejected"], 1, "{summary}");
    assert_eq!(summary["jobs"][1]["error"]["code"], "exceeds_limit", "{summary}");
    assert_eq!(summary["jobs"][2]["error"]["code"], "unknown_model", "{summary}");

    // Without --json: a human summary, still exit 1.
    let (code, _, err) = tollgate(&app, ACME, &["submit", mixed.to_str().unwrap(), "--wait"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("1 succeeded, 1 failed"), "{err}");

    // `status` as the admin: tables of queues and buckets, the buckets' limits as the API
    // reports them.
    let (code, out, err) = tollgate(&app, "tk-admin", &["status"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("QUEUES") && out.contains("BUCKETS"), "{out}");
    let tpm = out
        .lines()
        .find(|l| l.starts_with("provider:oai:gpt-4o-mini:tpm"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(tpm.contains("5000"), "{tpm}");
    let (code, out, _) = tollgate(&app, ACME, &["status", "--json"]).await;
    assert_eq!(code, 0);
    let printed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(printed["scope"], "acme");
    let (_, served) = app.get(ACME, "/v1/status").await;
    assert_eq!(
        printed["buckets"].as_array().map(Vec::len),
        served["buckets"].as_array().map(Vec::len)
    );

    // A wrong key: a clear error, non-zero exit.
    let (code, _, err) = tollgate(&app, "tk-wrong", &["status"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("invalid_api_key"), "{err}");
    app.shutdown().await;
}

#[tokio::test]
async fn version_and_bare_tollgate_name_the_binary() {
    let (code, out, err) = run(&[], &["--version"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, format!("tollgate {}\n", env!("CARGO_PKG_VERSION")));

    // No command: the usage and the commands, exit 2 like any other usage error.
    let (code, out, err) = run(&[], &[]).await;
    assert_eq!(code, 2, "{out}\n{err}");
    let help = format!("{out}{err}");
    assert!(help.contains("Usage: tollgate <COMMAND>"), "{help}");
    assert!(help.contains("Commands:"), "{help}");
    for command in ["serve", "status", "submit", "jobs", "batches"] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(command)),
            "{command}: {help}"
        );
    }
    assert!(
        help.contains("durable job-queue broker for LLM API work"),
        "{help}"
    );
    assert!(!help.contains("tollgate-cli"), "{help}");
}
