//! The client commands of the `tollgate` binary, talking HTTP to a running server
//! (`--url`, `--key` or `TOLLGATE_URL`, `TOLLGATE_KEY`):
//!
//! - `tollgate status`: queues by tenant and class, buckets with use and limit, rates.
//! - `tollgate jobs get ID [--wait S]`: one job.
//! - `tollgate submit FILE.jsonl [--wait] [--deadline …] [--json]`: each line becomes a
//!   job ([`upload`]); with `--wait`, a progress bar (done, failed, admission rate, ETA)
//!   until all are finished. Exits non-zero when any job failed or was rejected.
//! - `tollgate batches list`: batches in progress.
//!
//! Each command returns whether it succeeded; `main` turns that into the exit code.

#![allow(clippy::print_stdout)] // these commands' output is their user interface

use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

/// Where the server is and who is asking.
#[derive(Debug, Clone, Args)]
pub struct Remote {
    /// The server's base URL.
    #[arg(long, env = "TOLLGATE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// A tenant API key, or the admin key (sees every tenant).
    #[arg(long, env = "TOLLGATE_KEY", hide_env_values = true)]
    pub key: String,
}

impl Remote {
    fn endpoint(&self, path: &str) -> String {
        format!("{}{path}", self.url.trim_end_matches('/'))
    }

    /// GET `path` → JSON; an error answer becomes an error naming its code.
    async fn get(&self, http: &reqwest::Client, path: &str) -> anyhow::Result<Value> {
        let r = http
            .get(self.endpoint(path))
            .bearer_auth(&self.key)
            .send()
            .await
            .with_context(|| format!("GET {}", self.endpoint(path)))?;
        let status = r.status();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!(
                "GET {path}: {status}: {} ({})",
                body["error"]["message"].as_str().unwrap_or(""),
                body["error"]["code"].as_str().unwrap_or("")
            );
        }
        Ok(body)
    }
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// Print the server's JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct JobsArgs {
    #[command(subcommand)]
    pub command: JobsCommand,
}

#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// Print one job as JSON.
    Get {
        id: String,
        /// Wait up to this many seconds for it to finish.
        #[arg(long, default_value_t = 0.0)]
        wait: f64,
        #[command(flatten)]
        remote: Remote,
    },
}

#[derive(Debug, Args)]
pub struct BatchesArgs {
    #[command(subcommand)]
    pub command: BatchesCommand,
}

#[derive(Debug, Subcommand)]
pub enum BatchesCommand {
    /// Batches in progress.
    List {
        #[command(flatten)]
        remote: Remote,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// JSONL: one job per line — a `POST /v1/jobs` body (`{"request": …}`), an OpenAI
    /// batch line (`{"custom_id", "body": …}`), or a bare chat request (`{"model", "messages"}`).
    pub file: PathBuf,
    /// Follow the jobs until all are finished, with a progress bar.
    #[arg(long)]
    pub wait: bool,
    /// Deadline of every job: RFC 3339, or from now (`90s`, `30m`, `2h`, `1d`).
    #[arg(long)]
    pub deadline: Option<String>,
    /// Class of every job (`interactive`, `standard`, `background`, `batch`).
    #[arg(long)]
    pub class: Option<String>,
    /// Requests in flight while uploading and following.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Print one JSON summary (with every job's id and final state) instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub remote: Remote,
}

/// `tollgate status`.
pub async fn status(args: StatusArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    let s = args.remote.get(&http, "/v1/status").await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(true);
    }
    print!("{}", render_status(&s));
    Ok(true)
}

/// The status as text tables.
pub fn render_status(s: &Value) -> String {
    let empty = Vec::new();
    let rows = |v: &Value| v.as_array().unwrap_or(&empty).clone();
    let mut out = format!(
        "tollgate status ({})\n\nQUEUES\n",
        s["scope"].as_str().unwrap_or("?")
    );
    out.push_str(&format!(
        "{:<20} {:<12} {:>8} {:>9} {:>8} {:>10}\n",
        "TENANT", "CLASS", "QUEUED", "ADMITTED", "RUNNING", "OLDEST"
    ));
    let queues = rows(&s["queues"]);
    if queues.is_empty() {
        out.push_str("(no unfinished jobs)\n");
    }
    for q in queues {
        out.push_str(&format!(
            "{:<20} {:<12} {:>8} {:>9} {:>8} {:>9.1}s\n",
            q["tenant"].as_str().unwrap_or(""),
            q["class"].as_str().unwrap_or(""),
            q["queued"],
            q["admitted"],
            q["running"],
            q["oldest_queued_secs"].as_f64().unwrap_or(0.0)
        ));
    }
    out.push_str(&format!(
        "\nBUCKETS\n{:<44} {:<16} {:>14} {:>14} {:>6}  {}\n",
        "BUCKET", "DIMENSION", "USED", "LIMIT", "USE", "SOURCE"
    ));
    for b in rows(&s["buckets"]) {
        let (used, cap) = (
            b["used"].as_f64().unwrap_or(0.0),
            b["capacity"].as_f64().unwrap_or(0.0),
        );
        let pct = if cap > 0.0 { 100.0 * used / cap } else { 0.0 };
        out.push_str(&format!(
            "{:<44} {:<16} {:>14.0} {:>14.0} {:>5.0}%  {}\n",
            b["bucket"].as_str().unwrap_or(""),
            b["dimension"].as_str().unwrap_or(""),
            used,
            cap,
            pct,
            b["source"].as_str().unwrap_or("")
        ));
    }
    let r = &s["rates"];
    out.push_str(&format!(
        "\nLAST {} s: {:.2} jobs/s, {:.0} tokens/s, {} failed attempts, {} provider 429s, {} provider 5xx\n",
        r["window_secs"],
        r["jobs_per_sec"].as_f64().unwrap_or(0.0),
        r["tokens_per_sec"].as_f64().unwrap_or(0.0),
        r["failed_attempts"],
        r["provider_429s"],
        r["provider_5xxs"]
    ));
    out
}

/// `tollgate jobs …`.
pub async fn jobs(args: JobsArgs) -> anyhow::Result<bool> {
    match args.command {
        JobsCommand::Get { id, wait, remote } => {
            let http = reqwest::Client::new();
            let job = remote.get(&http, &format!("/v1/jobs/{id}?wait={wait}")).await?;
            println!("{}", serde_json::to_string_pretty(&job)?);
            Ok(job["state"] != "failed")
        }
    }
}

/// `tollgate batches …`.
pub async fn batches(args: BatchesArgs) -> anyhow::Result<bool> {
    match args.command {
        BatchesCommand::List { remote, json } => {
            let http = reqwest::Client::new();
            let batches = remote.get(&http, "/v1/status").await?["batches"].clone();
            if json {
                println!("{}", serde_json::to_string_pretty(&batches)?);
                return Ok(true);
            }
            let list = batches.as_array().cloned().unwrap_or_default();
            if list.is_empty() {
                println!("(no batches in progress)");
            }
            for b in list {
                println!(
                    "{}  {}  {}  {}/{} done, {} failed",
                    b["id"].as_str().unwrap_or(""),
                    b["tenant"].as_str().unwrap_or(""),
                    b["state"].as_str().unwrap_or(""),
                    b["completed"],
                    b["total"],
                    b["failed"]
                );
            }
            Ok(true)
        }
    }
}

/// A deadline: RFC 3339, or a duration from `now` (`90s`, `30m`, `2h`, `1d`).
pub fn parse_deadline(text: &str, now: DateTime<Utc>) -> anyhow::Result<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: i64 = number
        .parse()
        .with_context(|| format!("deadline {text:?}: RFC 3339, or a number with s, m, h or d"))?;
    let secs = match unit {
        "s" | "" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => bail!("deadline {text:?}: unknown unit {unit:?} (s, m, h, d)"),
    };
    Ok(now + chrono::Duration::seconds(secs))
}

/// One JSONL line as a `POST /v1/jobs` body.
pub fn job_body(line: &Value, deadline: Option<DateTime<Utc>>, class: Option<&str>) -> Value {
    let mut body = if line.get("request").is_some() {
        line.clone()
    } else if let Some(request) = line.get("body") {
        // An OpenAI batch line: its custom_id travels as metadata.
        let mut b = json!({"request": request});
        if let Some(id) = line.get("custom_id") {
            b["metadata"] = json!({"custom_id": id});
        }
        b
    } else {
        json!({"request": line})
    };
    if let Some(d) = deadline {
        body["deadline"] = json!(d);
    }
    if let Some(c) = class {
        body["class"] = json!(c);
    }
    body
}

/// What became of one line.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub line: usize,
    /// The job's id, when it was accepted.
    pub id: Option<String>,
    /// `queued` when accepted, then the final state; `rejected` when refused.
    pub state: String,
    /// The refusal or failure: `{code, message}`.
    pub error: Option<Value>,
}

/// Sends the jobs to the server, `concurrency` at a time. This is the one place that
/// knows how jobs are uploaded (one `POST /v1/jobs` each, for now).
pub async fn upload(
    http: &reqwest::Client,
    remote: &Remote,
    bodies: Vec<Value>,
    concurrency: usize,
    bar: &ProgressBar,
) -> Vec<Submitted> {
    let mut done: Vec<Submitted> = futures::stream::iter(bodies.into_iter().enumerate())
        .map(|(line, body)| async move {
            let sent = http
                .post(remote.endpoint("/v1/jobs"))
                .bearer_auth(&remote.key)
                .json(&body)
                .send()
                .await;
            let (status, answer) = match sent {
                Ok(r) => (r.status(), r.json::<Value>().await.unwrap_or(Value::Null)),
                Err(e) => {
                    let error = json!({"code": "network_error", "message": e.to_string()});
                    return Submitted {
                        line: line + 1,
                        id: None,
                        state: "rejected".into(),
                        error: Some(error),
                    };
                }
            };
            bar.inc(1);
            if status.is_success() {
                Submitted {
                    line: line + 1,
                    id: answer["id"].as_str().map(str::to_owned),
                    state: answer["state"].as_str().unwrap_or("queued").to_owned(),
                    error: None,
                }
            } else {
                Submitted {
                    line: line + 1,
                    id: None,
                    state: "rejected".into(),
                    error: Some(answer["error"].clone()),
                }
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    done.sort_by_key(|s| s.line);
    done
}

fn is_terminal(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled" | "rejected")
}

/// `tollgate submit`.
pub async fn submit(args: SubmitArgs) -> anyhow::Result<bool> {
    let file = std::fs::File::open(&args.file).with_context(|| format!("opening {}", args.file.display()))?;
    let deadline = args
        .deadline
        .as_deref()
        .map(|d| parse_deadline(d, Utc::now()))
        .transpose()?;
    let mut bodies = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", args.file.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(&line)
            .with_context(|| format!("{} line {}: not JSON", args.file.display(), i + 1))?;
        bodies.push(job_body(&value, deadline, args.class.as_deref()));
    }
    let http = reqwest::Client::new();
    let total = bodies.len() as u64;
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:40}] {pos}/{len} {msg} (ETA {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix("uploading");
    let started = Instant::now();
    let mut jobs = upload(&http, &args.remote, bodies, args.concurrency, &bar).await;
    if args.wait {
        follow(&http, &args.remote, &mut jobs, args.concurrency, &bar, started).await;
    }
    bar.finish_and_clear();
    let count = |s: &str| jobs.iter().filter(|j| j.state == s).count();
    let ok = count("failed") + count("rejected") + count("cancelled") == 0;
    if args.json {
        let list: Vec<Value> = jobs
            .iter()
            .map(|j| json!({"line": j.line, "id": j.id, "state": j.state, "error": j.error}))
            .collect();
        let summary = json!({
            "submitted": jobs.len() - count("rejected"),
            "rejected": count("rejected"),
            "succeeded": count("succeeded"),
            "failed": count("failed"),
            "cancelled": count("cancelled"),
            "jobs": list,
        });
        println!("{summary}");
    } else {
        if !args.wait {
            for j in &jobs {
                println!("{}", j.id.as_deref().unwrap_or("-"));
            }
        }
        for j in jobs
            .iter()
            .filter(|j| j.error.is_some() && j.state != "succeeded")
        {
            eprintln!(
                "line {}: {}: {} ({})",
                j.line,
                j.state,
                j.error.as_ref().and_then(|e| e["message"].as_str()).unwrap_or(""),
                j.error.as_ref().and_then(|e| e["code"].as_str()).unwrap_or("")
            );
        }
        eprintln!(
            "{} submitted, {} rejected{}",
            jobs.len() - count("rejected"),
            count("rejected"),
            if args.wait {
                format!(
                    "; {} succeeded, {} failed, {} cancelled",
                    count("succeeded"),
                    count("failed"),
                    count("cancelled")
                )
            } else {
                String::new()
            }
        );
    }
    Ok(ok)
}

/// Long-polls every accepted job until it is finished, updating the bar: done and failed
/// counts, the admission rate (from the tenant's queue in `/v1/status`), the ETA.
/// `started`: when the upload began (admissions start then).
async fn follow(
    http: &reqwest::Client,
    remote: &Remote,
    jobs: &mut [Submitted],
    concurrency: usize,
    bar: &ProgressBar,
    started: Instant,
) {
    bar.set_prefix("running");
    bar.set_position(jobs.iter().filter(|j| is_terminal(&j.state)).count() as u64);
    bar.reset_eta();
    let waiting: Vec<(usize, String)> = jobs
        .iter()
        .enumerate()
        .filter(|(_, j)| !is_terminal(&j.state))
        .filter_map(|(i, j)| j.id.clone().map(|id| (i, id)))
        .collect();
    let accepted = waiting.len() as f64;
    let mut finished = futures::stream::iter(waiting)
        .map(|(i, id)| async move {
            loop {
                match remote.get(http, &format!("/v1/jobs/{id}?wait=30")).await {
                    Ok(job) if is_terminal(job["state"].as_str().unwrap_or("")) => return (i, job),
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                }
            }
        })
        .buffer_unordered(concurrency.max(1));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let (mut failed, mut done) = (0u64, 0u64);
    let mut admission = String::from("admitted …");
    // (when, admitted so far) at the previous tick: the admission rate is their slope.
    let mut previous: Option<(Instant, f64)> = None;
    loop {
        tokio::select! {
            next = finished.next() => {
                let Some((i, job)) = next else { break };
                let state = job["state"].as_str().unwrap_or("").to_owned();
                if state == "succeeded" { done += 1 } else { failed += 1 }
                jobs[i].error = job.get("error").filter(|e| !e.is_null()).cloned();
                jobs[i].state = state;
                bar.inc(1);
            }
            _ = tick.tick() => {
                // Admitted so far = accepted − still queued (the tenant's queue, all classes).
                if let Ok(s) = remote.get(http, "/v1/status").await {
                    let queued: f64 = s["queues"].as_array().map_or(0.0, |q| {
                        q.iter().map(|q| q["queued"].as_f64().unwrap_or(0.0)).sum()
                    });
                    let admitted = (accepted - queued).max(0.0);
                    let now = Instant::now();
                    let rate = match previous {
                        Some((at, before)) => (admitted - before).max(0.0) / (now - at).as_secs_f64().max(0.001),
                        None => admitted / started.elapsed().as_secs_f64().max(0.001),
                    };
                    previous = Some((now, admitted));
                    admission = format!("admitted {admitted:.0}/{accepted:.0} at {rate:.1}/s");
                }
            }
        }
        bar.set_message(format!("{done} done, {failed} failed, {admission}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_are_rfc3339_or_from_now() {
        let now = Utc::now();
        assert_eq!(
            parse_deadline("90s", now).unwrap(),
            now + chrono::Duration::seconds(90)
        );
        assert_eq!(
            parse_deadline("2h", now).unwrap(),
            now + chrono::Duration::hours(2)
        );
        assert_eq!(
            parse_deadline("2030-01-01T00:00:00Z", now).unwrap().to_rfc3339(),
            "2030-01-01T00:00:00+00:00"
        );
        assert!(parse_deadline("soon", now).is_err());
        assert!(parse_deadline("3w", now).is_err());
    }

    #[test]
    fn lines_become_job_bodies() {
        let chat = json!({"model": "fast", "messages": []});
        assert_eq!(job_body(&chat, None, None), json!({"request": chat}));
        let batch = json!({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": chat});
        assert_eq!(
            job_body(&batch, None, Some("batch")),
            json!({"request": chat, "metadata": {"custom_id": "r1"}, "class": "batch"})
        );
        let full = json!({"request": chat, "priority": 5});
        assert_eq!(job_body(&full, None, None), full);
    }
}
