//! The Python environment the SDK tests run in: a venv under `target/` with the official
//! `openai` and `anthropic` packages and `standardwebhooks`, created (and the packages installed from
//! PyPI) on first use. Needs `python3` with the `venv` module; a missing interpreter or a
//! failed install fails the test loudly, never skips it.

use std::path::PathBuf;
use std::process::Output;

use tokio::process::Command;
use tokio::sync::OnceCell;

const PACKAGES: [&str; 3] = ["openai", "anthropic", "standardwebhooks"];

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// A script under `tests/python/`.
pub fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/python")
        .join(name)
}

async fn run(cmd: &mut Command, what: &str) -> Output {
    cmd.output().await.unwrap_or_else(|e| {
        panic!("{what}: cannot run it ({e}); the Python SDK tests need python3 with venv")
    })
}

/// The venv's interpreter, with the packages importable.
pub async fn python() -> PathBuf {
    static PYTHON: OnceCell<PathBuf> = OnceCell::const_new();
    PYTHON
        .get_or_init(|| async {
            let venv = target_dir().join("pyvenv");
            let python = venv.join("bin/python");
            let importable = |python: PathBuf| async move {
                Command::new(python)
                    .args(["-c", "import openai, anthropic, standardwebhooks"])
                    .output()
                    .await
                    .is_ok_and(|o| o.status.success())
            };
            if importable(python.clone()).await {
                return python;
            }
            let made = run(
                Command::new("python3").arg("-m").arg("venv").arg(&venv),
                "python3 -m venv",
            )
            .await;
            assert!(
                made.status.success(),
                "python3 -m venv {}: {}",
                venv.display(),
                String::from_utf8_lossy(&made.stderr)
            );
            let pip = run(
                Command::new(&python)
                    .args(["-m", "pip", "install", "--quiet"])
                    .args(PACKAGES),
                "pip install",
            )
            .await;
            assert!(
                pip.status.success(),
                "pip install {PACKAGES:?}: {}",
                String::from_utf8_lossy(&pip.stderr)
            );
            assert!(
                importable(python.clone()).await,
                "the packages are still not importable"
            );
            python
        })
        .await
        .clone()
}

/// Runs a script from `tests/python/` in the venv; panics with its output if it fails.
pub async fn run_script(name: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(python().await);
    cmd.arg(script(name)).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run(&mut cmd, name).await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name} failed ({}):\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
