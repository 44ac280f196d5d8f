//! The client commands of the real `tollgate` binary against a running server: submit a
//! JSONL file and wait (exit code reflects failures), read, list and cancel jobs, print
//! the status, batches and files; a refused key stops at once; `--version` and a bare
//! `tollgate`.

use serde_json::{Value, json};

use tollgate_api::broker::Roles;

use crate::batches::{batch_body, content, create_batch, start_batch, upload, wait_batch};
use crate::harness::{ACME, TestApp, TestOptions, job};

/// Runs `tollgate ARGS` against `app` as `key`; returns (exit code, stdout, stderr).
pub async fn tollgate(app: &TestApp, key: &str, args: &[&str]) -> (i32, String, String) {
    run(&[("TOLLGATE_URL", &app.api), ("TOLLGATE_KEY", key)], args).await
}

/// Runs `tollgate ARGS` with `env` (and none of the test's own TOLLGATE_*, RUST_LOG, RUST_BACKTRACE).
pub(crate) async fn run(env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
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

/// The rows of a table printed by the CLI (the lines after its header), each split into cells.
fn table_rows(out: &str, header: &str) -> Vec<Vec<String>> {
    let mut lines = out.lines().skip_while(|l| !l.starts_with(header));
    assert!(lines.next().is_some(), "no table with {header:?} in:\n{out}");
    lines
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
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
    assert!(help.contains("Usage: tollgate [OPTIONS] <COMMAND>"), "{help}");
    assert!(help.contains("Commands:"), "{help}");
    for command in ["serve", "status", "submit", "jobs", "batches", "files"] {
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

#[tokio::test]
async fn a_refused_key_or_an_absent_server_stops_submit_at_once() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("jobs.jsonl");
    let lines: Vec<String> = (0..40).map(|i| line(&format!("job {i}"), 16)).collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let path = file.to_str().unwrap();

    // One message, not one per line; non-zero exit.
    let (code, out, err) = tollgate(&app, "tk-wrong", &["submit", path, "--wait"]).await;
    assert_ne!(code, 0, "{out}\n{err}");
    assert_eq!(err.matches("invalid_api_key").count(), 1, "{err}");
    assert!(err.contains("refused the key"), "{err}");
    assert!(err.lines().count() <= 2, "{err}");

    // Nothing listening: the same.
    let env = [("TOLLGATE_URL", "http://127.0.0.1:9"), ("TOLLGATE_KEY", ACME)];
    let (code, _, err) = run(&env, &["submit", path]).await;
    assert_ne!(code, 0);
    assert_eq!(err.matches("cannot reach the server").count(), 1, "{err}");
    assert!(!err.contains(" line "), "{err}");
    assert!(err.contains("Connection refused"), "{err}");
    let (_, jobs) = app.get(ACME, "/v1/jobs").await;
    assert_eq!(jobs["data"], json!([]), "{jobs}");
    app.shutdown().await;
}

#[tokio::test]
async fn submit_errors_name_the_file_s_own_line_numbers() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gaps.jsonl");
    let unknown = json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).to_string();
    // Line 4 is refused; lines 2 and 3 are blank.
    std::fs::write(
        &file,
        format!("{}\n\n  \n{unknown}\n{}\n", line("a", 8), line("b", 8)),
    )
    .unwrap();
    let path = file.to_str().unwrap();
    let (code, out, err) = tollgate(&app, ACME, &["submit", path, "--json"]).await;
    assert_eq!(code, 1, "{out}\n{err}");
    let summary: Value = serde_json::from_str(out.trim()).unwrap();
    let lines: Vec<(u64, &str)> = summary["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| (j["line"].as_u64().unwrap(), j["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        lines,
        [(1, "queued"), (4, "rejected"), (5, "queued")],
        "{summary}"
    );
    let (code, _, err) = tollgate(&app, ACME, &["submit", path]).await;
    assert_eq!(code, 1);
    assert!(err.contains(&format!("{path} line 4: rejected")), "{err}");
    assert!(!err.contains("line 2"), "{err}");
    app.shutdown().await;
}

#[tokio::test]
async fn jobs_list_and_cancel() {
    // No gate or dispatcher: jobs stay queued.
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let (status, body) = app.submit(ACME, &job("fast", &format!("job {i}"))).await;
        assert_eq!(status, 202, "{body}");
        ids.push(body["id"].as_str().unwrap().to_owned());
    }

    // A table, newest first, one row per job, its cells under the headers.
    let (code, out, err) = tollgate(&app, ACME, &["jobs", "list"]).await;
    assert_eq!(code, 0, "{err}");
    let rows = table_rows(&out, "ID ");
    let listed: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    let newest_first: Vec<&str> = ids.iter().rev().map(String::as_str).collect();
    assert_eq!(listed, newest_first, "{out}");
    assert!(
        rows.iter().all(|r| r[1] == "queued" && r[2] == "standard"),
        "{out}"
    );
    let header = out.lines().find(|l| l.starts_with("ID ")).unwrap();
    let state_at = header.find("STATE").unwrap();
    for row in out.lines().skip_while(|l| !l.starts_with("ID ")).skip(1) {
        assert_eq!(&row[state_at..state_at + "queued".len()], "queued", "{out}");
    }

    // --limit stops early and says how to go on; --after goes on.
    let (code, out, err) = tollgate(&app, ACME, &["jobs", "list", "--state", "queued", "--limit", "2"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(table_rows(&out, "ID ").len(), 2, "{out}");
    assert!(err.contains(&format!("--after {}", ids[1])), "{err}");
    let (_, out, _) = tollgate(&app, ACME, &["jobs", "list", "--after", &ids[1], "--json"]).await;
    let rest: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rest.as_array().map(Vec::len), Some(1), "{rest}");
    assert_eq!(rest[0]["id"], ids[0].as_str());

    // --json is the API's list.
    let (_, out, _) = tollgate(&app, ACME, &["jobs", "list", "--json"]).await;
    let printed: Value = serde_json::from_str(&out).unwrap();
    let (_, served) = app.get(ACME, "/v1/jobs").await;
    assert_eq!(printed, served["data"]);

    // Cancel: the job is cancelled; a second cancel is refused, non-zero exit.
    let (code, out, err) = tollgate(&app, ACME, &["jobs", "cancel", &ids[0]]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("{} cancelled", ids[0]));
    let (_, served) = app.get(ACME, &format!("/v1/jobs/{}", ids[0])).await;
    assert_eq!(served["state"], "cancelled");
    let (code, _, err) = tollgate(&app, ACME, &["jobs", "cancel", &ids[0]]).await;
    assert_ne!(code, 0);
    assert!(err.contains("job_already_finished"), "{err}");
    let (_, out, _) = tollgate(&app, ACME, &["jobs", "list", "--state", "cancelled", "--json"]).await;
    let cancelled: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(cancelled.as_array().map(Vec::len), Some(1), "{cancelled}");
    app.shutdown().await;
}

#[tokio::test]
async fn batches_and_files_in_progress() {
    let app = TestApp::spawn_with(TestOptions {
        roles: Roles::API_ONLY,
        ..TestOptions::default()
    })
    .await;
    let text = [
        crate::batches::line("a", "fast", "one"),
        crate::batches::line("b", "fast", "two"),
    ]
    .join("\n");
    let (status, file) = upload(&app.http, &app.api, ACME, text.as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    let file_id = file["id"].as_str().unwrap().to_owned();
    let (status, batch) = create_batch(&app.http, &app.api, ACME, &batch_body(&file_id)).await;
    assert_eq!(status, 200, "{batch}");
    let id = batch["id"].as_str().unwrap().to_owned();

    let (code, out, err) = tollgate(&app, ACME, &["batches", "list"]).await;
    assert_eq!(code, 0, "{err}");
    let rows = table_rows(&out, "ID ");
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(
        rows[0][..6],
        [id.as_str(), "acme", "in_progress", "2", "0", "0"],
        "{out}"
    );

    let (code, out, err) = tollgate(&app, ACME, &["batches", "get", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().eq(["STATUS", "in_progress"])),
        "{out}"
    );
    assert!(out.contains("2 total, 0 completed, 0 failed"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().eq(["INPUT", "FILE", file_id.as_str()])),
        "{out}"
    );
    let (_, out, _) = tollgate(&app, ACME, &["batches", "get", &id, "--json"]).await;
    let printed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(printed["id"], id.as_str());

    // No output before it finishes: a clear error, not an empty file.
    let (code, out, err) = tollgate(&app, ACME, &["batches", "outputs", &id]).await;
    assert_ne!(code, 0);
    assert_eq!(out, "");
    assert!(err.contains("has no output file (status in_progress)"), "{err}");

    // Paused and resumed; nothing has finished, so no results yet.
    let (code, out, err) = tollgate(&app, ACME, &["batches", "pause", &id]).await;
    assert_eq!(
        (code, out.trim()),
        (0, format!("{id} in_progress paused").as_str()),
        "{err}"
    );
    let (_, out, _) = tollgate(&app, ACME, &["batches", "get", &id]).await;
    assert!(
        out.lines().any(|l| l.starts_with("PAUSED") && !l.ends_with('-')),
        "{out}"
    );
    let (code, out, err) = tollgate(&app, ACME, &["batches", "resume", &id]).await;
    assert_eq!(
        (code, out.trim()),
        (0, format!("{id} in_progress running").as_str()),
        "{err}"
    );
    let (code, out, err) = tollgate(&app, ACME, &["batches", "results", &id]).await;
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    assert!(err.contains("next cursor: 0"), "{err}");

    let (code, out, err) = tollgate(&app, ACME, &["batches", "cancel", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("{id} cancelling"));
    let (_, served) = app.get(ACME, &format!("/v1/batches/{id}")).await;
    assert_eq!(served["status"], "cancelling");

    // Files: the table, one file's fields, delete.
    let (code, out, err) = tollgate(&app, ACME, &["files", "list"]).await;
    assert_eq!(code, 0, "{err}");
    let rows = table_rows(&out, "ID ");
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(
        rows[0][..4],
        [file_id.as_str(), "batch", &text.len().to_string(), "input.jsonl"],
        "{out}"
    );
    let (_, out, _) = tollgate(&app, ACME, &["files", "list", "--json"]).await;
    let printed: Value = serde_json::from_str(&out).unwrap();
    let (_, served) = app.get(ACME, "/v1/files").await;
    assert_eq!(printed, served["data"]);
    let (code, out, _) = tollgate(&app, ACME, &["files", "get", &file_id]).await;
    assert_eq!(code, 0);
    assert!(
        out.lines().any(|l| l.split_whitespace().eq(["PURPOSE", "batch"])),
        "{out}"
    );
    let (code, out, _) = tollgate(&app, ACME, &["files", "content", &file_id]).await;
    assert_eq!(code, 0);
    assert_eq!(out, text);
    let (code, out, err) = tollgate(&app, ACME, &["files", "delete", &file_id]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("{file_id} deleted"));
    assert_eq!(app.get(ACME, &format!("/v1/files/{file_id}")).await.0, 404);
    let (code, _, err) = tollgate(&app, ACME, &["files", "get", &file_id]).await;
    assert_ne!(code, 0);
    assert!(err.contains("not_found"), "{err}");
    app.shutdown().await;
}

#[tokio::test]
async fn batches_outputs_downloads_the_results() {
    let app = TestApp::spawn().await;
    let text = [
        crate::batches::line("a", "fast", "one"),
        crate::batches::line("b", "nope", "unknown model"),
    ]
    .join("\n");
    let id = start_batch(&app.http, &app.api, ACME, text.as_bytes()).await;
    let done = wait_batch(&app.http, &app.api, ACME, &id, 60).await;
    assert_eq!(done["status"], "completed", "{done}");

    // To stdout: the output file's bytes as the API serves them.
    let (code, out, err) = tollgate(&app, ACME, &["batches", "outputs", &id]).await;
    assert_eq!(code, 0, "{err}");
    let output = content(
        &app.http,
        &app.api,
        ACME,
        done["output_file_id"].as_str().unwrap(),
    )
    .await;
    assert_eq!(out, output);
    assert!(out.contains("\"custom_id\":\"a\""), "{out}");
    // The error file, to a file.
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("errors.jsonl");
    let (code, out, err) = tollgate(
        &app,
        ACME,
        &[
            "batches",
            "outputs",
            &id,
            "--errors",
            "-o",
            dest.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "");
    let errors = content(&app.http, &app.api, ACME, done["error_file_id"].as_str().unwrap()).await;
    assert_eq!(std::fs::read_to_string(&dest).unwrap(), errors);
    assert!(errors.contains("\"custom_id\":\"b\""), "{errors}");

    // Every batch of the tenant, finished ones too.
    let (code, out, err) = tollgate(&app, ACME, &["batches", "list", "--all"]).await;
    assert_eq!(code, 0, "{err}");
    let rows = table_rows(&out, "ID ");
    assert_eq!(
        rows[0][..6],
        [id.as_str(), "completed", "batch", "2", "1", "1"],
        "{out}"
    );
    let (code, _, err) = tollgate(&app, ACME, &["batches", "cancel", &id]).await;
    assert_ne!(code, 0);
    assert!(err.contains("batch_already_finished"), "{err}");
    app.shutdown().await;
}

#[tokio::test]
async fn config_check_validates_a_file_without_starting_anything() {
    let dir = tempfile::tempdir().unwrap();
    let example = include_str!("../../tollgate.example.toml");
    let good = dir.path().join("good.toml");
    std::fs::write(&good, example).unwrap();
    let (code, out, err) = run(&[], &["config", "check", good.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.trim().ends_with("ok (tenants: 2, providers: 2, routes: 1)"),
        "{out}"
    );
    // A field no table has, and a provider key read from a variable that is not set:
    // each named, exit 1.
    let unknown = dir.path().join("unknown.toml");
    std::fs::write(
        &unknown,
        example.replacen("[server]\n", "[server]\nbogus = 1\n", 1),
    )
    .unwrap();
    let (code, _, err) = run(&[], &["config", "check", unknown.to_str().unwrap()]).await;
    assert_eq!(code, 1);
    assert!(err.contains("unknown field `bogus`"), "{err}");
    let missing = dir.path().join("missing.toml");
    std::fs::write(
        &missing,
        example.replacen(
            "{ name = \"k1\", value = \"sk-demo-1\" }",
            "{ name = \"k1\", env = \"TOLLGATE_TEST_UNSET_KEY\" }",
            1,
        ),
    )
    .unwrap();
    let (code, _, err) = run(&[], &["config", "check", missing.to_str().unwrap()]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("TOLLGATE_TEST_UNSET_KEY") && err.contains("providers[0].keys[0]"),
        "{err}"
    );
}

#[tokio::test]
async fn the_shipped_kubernetes_config_checks() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/k8s/tollgate.toml");
    let env = [
        ("TOLLGATE_ADMIN_KEY", "tk-admin-0123456789abcdef0123456789"),
        ("OPENAI_API_KEY", "sk-check"),
        (
            "TOLLGATE_WEBHOOK_KEY",
            "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
        ),
    ];
    let (code, out, err) = run(&env, &["config", "check", config]).await;
    assert_eq!(code, 0, "{out}{err}");
}
