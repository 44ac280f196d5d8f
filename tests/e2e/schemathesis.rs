//! Schemathesis (PyPI `schemathesis`, 4.x CLI) against the running broker's own
//! `/openapi.json`: generated requests, valid and invalid, to every operation, with a
//! tenant key. No 5xx (`not_a_server_error`) and every response matches the schema the
//! document gives for its status (`response_schema_conformance`); any failure fails the
//! test with schemathesis's report. Installed into its own venv under `target/` on first
//! use (its dependencies are not the SDK tests'); a failed install fails the test.

use std::path::PathBuf;

use tokio::process::Command;
use tokio::sync::OnceCell;

use crate::harness::{ACME, TestApp, job};
use crate::python::target_dir;

/// The schemathesis major version whose CLI flags this test uses.
const PACKAGE: &str = "schemathesis>=4,<5";
/// Examples per operation and phase: bounded so the run takes well under two minutes.
const MAX_EXAMPLES: &str = "30";

async fn schemathesis() -> PathBuf {
    static BIN: OnceCell<PathBuf> = OnceCell::const_new();
    BIN.get_or_init(|| async {
        let venv = target_dir().join("pyvenv-schemathesis");
        let bin = venv.join("bin/schemathesis");
        let works = |bin: PathBuf| async move {
            Command::new(bin)
                .arg("--version")
                .output()
                .await
                .is_ok_and(|o| o.status.success())
        };
        if works(bin.clone()).await {
            return bin;
        }
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .output()
            .await
            .expect("python3 -m venv (needs python3 with venv)");
        assert!(
            made.status.success(),
            "venv: {}",
            String::from_utf8_lossy(&made.stderr)
        );
        let pip = Command::new(venv.join("bin/python"))
            .args(["-m", "pip", "install", "--quiet", PACKAGE])
            .output()
            .await
            .expect("pip install schemathesis");
        assert!(
            pip.status.success(),
            "pip install {PACKAGE}: {}",
            String::from_utf8_lossy(&pip.stderr)
        );
        assert!(works(bin.clone()).await, "schemathesis is still not runnable");
        bin
    })
    .await
    .clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn generated_requests_get_no_5xx_and_responses_match_the_schema() {
    let app = TestApp::spawn().await;
    // Something to find: a finished job, so lists and reads have rows to serialize.
    let (status, accepted) = app.submit(ACME, &job("fast", "seed")).await;
    assert_eq!(status, 202, "{accepted}");
    app.wait_job(ACME, accepted["id"].as_str().unwrap(), 30).await;

    let report = target_dir().join("schemathesis-report");
    let out = Command::new(schemathesis().await)
        .arg("run")
        .arg(app.url("/openapi.json"))
        .args(["--checks", "not_a_server_error,response_schema_conformance"])
        .args(["--header", &format!("Authorization: Bearer {ACME}")])
        .args(["--max-examples", MAX_EXAMPLES])
        .args(["--phases", "examples,coverage,fuzzing"])
        .args(["--seed", "20261129"])
        // One worker: CPython 3.11's `ast.parse`, which hypothesis calls to describe
        // filters, is not thread-safe (`SystemError: AST constructor recursion depth
        // mismatch` with several workers).
        .args(["--workers", "1", "--request-timeout", "60"])
        .args(["--generation-database", "none", "--no-color"])
        .arg("--report-dir")
        .arg(&report)
        // Its cache (`.schemathesis/`) goes under target/, not into the source tree.
        .current_dir(target_dir())
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("run schemathesis");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found failures ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // It really ran: requests were generated and checked (its summary's "N generated, M
    // passed", M above 0).
    let checked = stdout.lines().find_map(|l| {
        let (_, passed) = l.trim().split_once(" generated, ")?;
        passed.strip_suffix(" passed")?.parse::<u64>().ok()
    });
    assert!(
        checked.is_some_and(|n| n > 0),
        "schemathesis tested nothing:\n{stdout}"
    );
    // The API is still serving after the generated inputs.
    let (status, _) = app.get(ACME, "/v1/jobs").await;
    assert_eq!(status, 200);
    app.shutdown().await;
}
