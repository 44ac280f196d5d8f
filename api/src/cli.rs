//! The client commands of the `tollgate` binary, talking HTTP to a running server
//! (`--url`, `--key` or `TOLLGATE_URL`, `TOLLGATE_KEY`). Each prints aligned tables
//! ([`table`]) by default and the server's JSON with `--json`:
//!
//! - `tollgate status`: queues by tenant and class, buckets with use and limit, rates.
//! - `tollgate jobs list [--state S] [--limit N] [--after ID]`, `jobs get ID [--wait S]`
//!   (JSON), `jobs cancel ID`.
//! - `tollgate submit FILE.jsonl [--wait] [--deadline …] [--json]`: each line becomes a
//!   job ([`upload`]); with `--wait`, a progress bar ([`progress`]: finished, failed,
//!   admission rate, and an ETA once jobs have finished) until all are finished. Errors
//!   name the file's own line numbers. Exits non-zero when any job failed or was rejected.
//! - `tollgate batches list [--all]`, `batches get ID`, `batches cancel ID`,
//!   `batches outputs ID [--errors] [-o FILE]` (the output or error file's content).
//! - `tollgate files list [--purpose P]`, `files get ID`, `files delete ID`,
//!   `files content ID [-o FILE]`.
//! - `tollgate tenants list|get|create|update|delete`, `tollgate keys list|create|revoke`,
//!   `tollgate provider-keys list|add|rotate|disable|enable|remove` ([`admin`]): the admin
//!   API (the admin key).
//!
//! A refused key (401/403) or an unreachable server stops a command at the first
//! request that meets it, with one message ([`Refused`]), instead of once per job
//! (while following jobs, `submit --wait` waits out a server restart).
//! Each command returns whether it succeeded; `main` turns that into the exit code.

#![allow(clippy::print_stdout)] // these commands' output is their user interface

mod admin;
mod progress;
mod table;

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

pub use self::admin::{
    KeysArgs, PausesArgs, ProviderKeysArgs, TenantsArgs, apply, keys, pauses, provider_keys, tenants,
};
use self::progress::{Progress, short_duration};
use self::table::{Align, Table, fields};

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

/// An answer that is not a success, or no answer at all. A refused key or an unreachable
/// server is the same for every request that follows: commands stop at the first.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("the server at {url} refused the key ({status}, {code}: {message}); check --key or TOLLGATE_KEY")]
    Key {
        url: String,
        status: StatusCode,
        code: String,
        message: String,
    },
    #[error("cannot reach the server at {url}: is it running? check --url or TOLLGATE_URL")]
    Unreachable { url: String, source: reqwest::Error },
    #[error("{what}: {status}, {code}: {message}")]
    Answer {
        what: String,
        status: StatusCode,
        code: String,
        message: String,
    },
    #[error("{what} failed")]
    Failed { what: String, source: reqwest::Error },
}

impl Refused {
    /// Whether every later request would meet the same refusal.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Key { .. } | Self::Unreachable { .. })
    }

    /// The `{code, message}` of the error, as the API writes it.
    fn body(&self) -> Value {
        match self {
            Self::Key { code, message, .. } | Self::Answer { code, message, .. } => {
                json!({"code": code, "message": message})
            }
            Self::Unreachable { .. } | Self::Failed { .. } => {
                let cause = std::error::Error::source(self)
                    .map(ToString::to_string)
                    .unwrap_or_default();
                json!({"code": "network_error", "message": format!("{self}: {cause}")})
            }
        }
    }
}

impl Remote {
    fn endpoint(&self, path: &str) -> String {
        format!("{}{path}", self.url.trim_end_matches('/'))
    }

    /// Sends `method path` (with a JSON `body`), and returns the answer when it is a
    /// success; otherwise the refusal, with the error body's code and message.
    async fn send(
        &self,
        http: &reqwest::Client,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<reqwest::Response, Refused> {
        let what = format!("{method} {path}");
        let mut request = http.request(method, self.endpoint(path)).bearer_auth(&self.key);
        if let Some(body) = body {
            request = request.json(body);
        }
        let r = request.send().await.map_err(|source| {
            if source.is_connect() {
                Refused::Unreachable {
                    url: self.url.clone(),
                    source,
                }
            } else {
                Refused::Failed {
                    what: what.clone(),
                    source,
                }
            }
        })?;
        let status = r.status();
        if status.is_success() {
            return Ok(r);
        }
        let text = r.text().await.unwrap_or_default();
        let error = serde_json::from_str::<Value>(&text).unwrap_or(Value::Null)["error"].take();
        let code = error["code"].as_str().unwrap_or("").to_owned();
        let message = error["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| text.chars().take(200).collect());
        if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return Err(Refused::Key {
                url: self.url.clone(),
                status,
                code,
                message,
            });
        }
        Err(Refused::Answer {
            what,
            status,
            code,
            message,
        })
    }

    /// `method path` → the answer's JSON.
    async fn json(
        &self,
        http: &reqwest::Client,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, Refused> {
        let what = format!("{method} {path}");
        self.send(http, method, path, body)
            .await?
            .json()
            .await
            .map_err(|source| Refused::Failed { what, source })
    }

    async fn get(&self, http: &reqwest::Client, path: &str) -> Result<Value, Refused> {
        self.json(http, Method::GET, path, None).await
    }

    /// The `data` of a one-page list (`{object: "list", data}`) to show as a table; with
    /// `json`, the items are printed as JSON instead and `None` returned.
    async fn table_items(
        &self,
        http: &reqwest::Client,
        path: &str,
        json: bool,
    ) -> anyhow::Result<Option<Vec<Value>>> {
        let list = self.get(http, path).await?;
        let items = list["data"].as_array().cloned().unwrap_or_default();
        if json {
            print_json(&Value::Array(items))?;
            return Ok(None);
        }
        Ok(Some(items))
    }

    /// A list endpoint (`{data, has_more, last_id}`), page after page until `limit`
    /// items: the API serves at most 100 a page. Returns the items and whether there are more.
    async fn list(
        &self,
        http: &reqwest::Client,
        path: &str,
        query: &[(&str, String)],
        limit: usize,
        mut after: Option<String>,
    ) -> anyhow::Result<(Vec<Value>, bool)> {
        let mut items = Vec::new();
        loop {
            let page_size = (limit - items.len()).min(100);
            let mut params: Vec<(&str, String)> = query.to_vec();
            params.push(("limit", page_size.to_string()));
            if let Some(a) = &after {
                params.push(("after", a.clone()));
            }
            let query = reqwest::Url::parse_with_params("http://x/", &params)
                .context("encoding the query")?
                .query()
                .map(str::to_owned)
                .unwrap_or_default();
            let page = self.get(http, &format!("{path}?{query}")).await?;
            items.extend(page["data"].as_array().cloned().unwrap_or_default());
            let more = page["has_more"].as_bool().unwrap_or(false);
            after = page["last_id"].as_str().map(str::to_owned);
            if !more || after.is_none() || items.len() >= limit {
                return Ok((items, more));
            }
        }
    }

    /// Streams the content at `path` to `out` (stdout when `None`); returns its size.
    async fn download(&self, http: &reqwest::Client, path: &str, out: Option<&Path>) -> anyhow::Result<u64> {
        let r = self.send(http, Method::GET, path, None).await?;
        let mut sink: Box<dyn Write> = match out {
            Some(file) => Box::new(std::io::BufWriter::new(
                std::fs::File::create(file).with_context(|| format!("creating {}", file.display()))?,
            )),
            None => Box::new(std::io::stdout().lock()),
        };
        let mut bytes = 0u64;
        let mut body = r.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.with_context(|| format!("reading GET {path}"))?;
            sink.write_all(&chunk).context("writing the content")?;
            bytes += chunk.len() as u64;
        }
        sink.flush().context("writing the content")?;
        Ok(bytes)
    }
}

/// Prints `value` as indented JSON.
fn print_json(value: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// A JSON value as a table cell: strings bare, null as `-`.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A time as `YYYY-MM-DD HH:MM:SS` (UTC), from RFC 3339 text or Unix seconds; `-` when absent.
fn when(v: &Value) -> String {
    let t = match v {
        Value::String(s) => DateTime::parse_from_rfc3339(s)
            .ok()
            .map(|t| t.with_timezone(&Utc)),
        Value::Number(n) => n.as_i64().and_then(|s| DateTime::from_timestamp(s, 0)),
        _ => None,
    };
    match t {
        Some(t) => t.format("%Y-%m-%d %H:%M:%S").to_string(),
        None if v.is_null() => "-".to_owned(),
        None => cell(v),
    }
}

/// An id from the command line as one path segment (percent-encoded), so that a `/` or
/// `?` in it cannot reach another endpoint.
fn segment(id: &str) -> String {
    id.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `--limit`: at least 1; pages of 100 are fetched until it is reached.
fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{text:?} is not a positive number")),
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
pub struct UsageArgs {
    /// Comma-separated: at most one of `hour` and `day`, and any of `tenant`, `provider`,
    /// `model`, `endpoint`, `lane`.
    #[arg(long, default_value = "day,model")]
    pub group_by: String,
    /// From this time (RFC 3339); default 30 days before --to.
    #[arg(long)]
    pub from: Option<String>,
    /// Until this time (RFC 3339, exclusive); default now.
    #[arg(long)]
    pub to: Option<String>,
    /// Print the server's CSV instead of a table.
    #[arg(long, conflicts_with = "json")]
    pub csv: bool,
    /// Print the server's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub remote: Remote,
}

#[derive(Debug, Args)]
pub struct JobsArgs {
    #[command(subcommand)]
    pub command: JobsCommand,
}

#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// The tenant's jobs, newest first.
    List {
        /// Only jobs in this state (queued, admitted, running, succeeded, failed, cancelled).
        #[arg(long)]
        state: Option<String>,
        /// Only this tenant's (the admin key).
        #[arg(long)]
        tenant: Option<String>,
        /// Only this class (interactive, standard, background, batch).
        #[arg(long)]
        class: Option<String>,
        /// Only jobs sent to this model (a route alias or provider/model).
        #[arg(long)]
        model: Option<String>,
        /// Only jobs that failed for, or wait for, this reason code.
        #[arg(long)]
        reason: Option<String>,
        /// Only this batch's lines.
        #[arg(long)]
        batch: Option<String>,
        /// A job id, an idempotency key, or key=value of the jobs' metadata.
        #[arg(long)]
        search: Option<String>,
        /// How many.
        #[arg(long, default_value = "20", value_parser = positive)]
        limit: usize,
        /// Jobs older than this one (the last id of a previous list).
        #[arg(long)]
        after: Option<String>,
        /// Print the jobs as JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Print one job as JSON.
    Get {
        /// The job's id.
        id: String,
        /// Wait up to this many seconds for it to finish.
        #[arg(long, default_value_t = 0.0)]
        wait: f64,
        #[command(flatten)]
        remote: Remote,
    },
    /// Cancel a queued, admitted or running job.
    Cancel {
        /// The job's id.
        id: String,
        /// Print the server's JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Queue a failed or cancelled job again (as many attempts as it had before).
    Retry {
        /// The job's id.
        id: String,
        /// Print the server's JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// A job's provider calls: status, outcome, tokens, what the provider said of its limits.
    Attempts {
        /// The job's id.
        id: String,
        #[arg(long)]
        json: bool,
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
    /// Batches in progress (every tenant's, with the admin key); `--all` for the
    /// tenant's batches whatever their status, newest first.
    List {
        /// Every batch of the tenant, finished ones too.
        #[arg(long)]
        all: bool,
        /// How many, with --all.
        #[arg(long, default_value = "20", value_parser = positive, requires = "all")]
        limit: usize,
        /// With --all: batches older than this one.
        #[arg(long, requires = "all")]
        after: Option<String>,
        /// Print the server's JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// One batch: status, request counts, files.
    Get {
        /// The batch's id (`batch_…`).
        id: String,
        /// Print the server's JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Cancel a batch: its unfinished requests are not sent.
    Cancel {
        /// The batch's id (`batch_…`).
        id: String,
        /// Print the server's JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Pause a batch: its queued requests wait; those in flight finish.
    Pause {
        /// The batch's id (`batch_…`).
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Resume a paused batch.
    Resume {
        /// The batch's id (`batch_…`).
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// A batch's finished requests so far (JSONL, in the order they finished), from
    /// `--after` (the cursor this printed last, on stderr) to what is finished now.
    Results {
        /// The batch's id (`batch_…`).
        id: String,
        /// Start after this cursor (printed on stderr by the previous run).
        #[arg(long, default_value = "0")]
        after: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// The content of a batch's output file (JSONL, one result per request).
    Outputs {
        /// The batch's id (`batch_…`).
        id: String,
        /// The error file instead (requests that failed).
        #[arg(long)]
        errors: bool,
        /// Write to this file instead of stdout.
        #[arg(long, short)]
        output: Option<PathBuf>,
        #[command(flatten)]
        remote: Remote,
    },
}

#[derive(Debug, Args)]
pub struct FilesArgs {
    #[command(subcommand)]
    pub command: FilesCommand,
}

#[derive(Debug, Subcommand)]
pub enum FilesCommand {
    /// The tenant's files, newest first.
    List {
        /// Only files of this purpose (`batch`, `batch_output`).
        #[arg(long)]
        purpose: Option<String>,
        #[arg(long, default_value = "20", value_parser = positive)]
        limit: usize,
        /// Files older than this one.
        #[arg(long)]
        after: Option<String>,
        /// Print the server's JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// One file's details.
    Get {
        /// The file's id (`file-…`).
        id: String,
        /// Print the server's JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Delete a file.
    Delete {
        /// The file's id (`file-…`).
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// A file's content.
    Content {
        /// The file's id (`file-…`).
        id: String,
        /// Write to this file instead of stdout.
        #[arg(long, short)]
        output: Option<PathBuf>,
        #[command(flatten)]
        remote: Remote,
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
        print_json(&s)?;
        return Ok(true);
    }
    print!("{}", render_status(&s));
    Ok(true)
}

/// Checks a config file as `serve` does before it starts ([`crate::broker::check`]):
/// prints what it configures, or the first thing wrong with it (false).
#[allow(clippy::print_stderr)] // the error is the command's output
pub fn config_check(file: &Path) -> bool {
    let checked = tollgate::config::Config::load(file)
        .map_err(anyhow::Error::from)
        .and_then(|config| crate::broker::check(&config).map(|_| config));
    match checked {
        Ok(config) => {
            println!(
                "{}: ok (tenants: {}, providers: {}, routes: {})",
                file.display(),
                config.tenants.len(),
                config.providers.len(),
                config.routes.len()
            );
            true
        }
        Err(e) => {
            eprintln!("{e:#}");
            false
        }
    }
}

/// What finished jobs used and cost (`GET /v1/usage`), in USD and tokens, grouped.
pub async fn usage(args: UsageArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    let mut query = vec![("group_by", args.group_by.clone())];
    query.extend(args.from.clone().map(|f| ("from", f)));
    query.extend(args.to.clone().map(|t| ("to", t)));
    if args.csv {
        query.push(("format", "csv".to_owned()));
    }
    let query = reqwest::Url::parse_with_params("http://x/", &query)
        .context("encoding the query")?
        .query()
        .map(str::to_owned)
        .unwrap_or_default();
    let path = format!("/v1/usage?{query}");
    if args.csv {
        let r = args.remote.send(&http, Method::GET, &path, None).await?;
        print!("{}", r.text().await?);
        return Ok(true);
    }
    let u = args.remote.get(&http, &path).await?;
    if args.json {
        print_json(&u)?;
        return Ok(true);
    }
    print!("{}", render_usage(&u));
    Ok(true)
}

/// Usage rows as a table: their group fields, then USD, tokens and requests.
pub fn render_usage(u: &Value) -> String {
    let data = rows(&u["data"]);
    let fields: Vec<String> = data
        .first()
        .and_then(Value::as_object)
        .map(|r| {
            r.keys()
                .filter(|k| !["usd", "input_tokens", "output_tokens", "requests"].contains(&k.as_str()))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let header = |field: &str| match field {
        "hour" => "HOUR",
        "day" => "DAY",
        "tenant" => "TENANT",
        "provider" => "PROVIDER",
        "model" => "MODEL",
        "endpoint" => "ENDPOINT",
        "key" => "KEY",
        "application" => "APPLICATION",
        _ => "LANE",
    };
    let mut columns: Vec<(&'static str, Align)> = fields.iter().map(|f| (header(f), Align::Left)).collect();
    columns.extend([
        ("USD", Align::Right),
        ("INPUT TOKENS", Align::Right),
        ("OUTPUT TOKENS", Align::Right),
        ("REQUESTS", Align::Right),
    ]);
    let mut table = Table::new(&columns);
    for r in data {
        let mut row: Vec<String> = fields.iter().map(|f| cell(&r[f.as_str()])).collect();
        row.push(format!("{:.6}", r["usd"].as_f64().unwrap_or(0.0)));
        row.extend(["input_tokens", "output_tokens", "requests"].map(|k| cell(&r[k])));
        table.row(row);
    }
    table.render_or("(no finished jobs in the period)")
}

fn rows(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

/// The status as aligned tables.
pub fn render_status(s: &Value) -> String {
    let mut out = format!(
        "tollgate status ({})\n\nQUEUES\n",
        s["scope"].as_str().unwrap_or("?")
    );
    let mut queues = Table::new(&[
        ("TENANT", Align::Left),
        ("CLASS", Align::Left),
        ("QUEUED", Align::Right),
        ("ADMITTED", Align::Right),
        ("RUNNING", Align::Right),
        ("OLDEST", Align::Right),
    ]);
    for q in rows(&s["queues"]) {
        queues.row(vec![
            cell(&q["tenant"]),
            cell(&q["class"]),
            cell(&q["queued"]),
            cell(&q["admitted"]),
            cell(&q["running"]),
            format!("{:.1}s", q["oldest_queued_secs"].as_f64().unwrap_or(0.0)),
        ]);
    }
    out.push_str(&queues.render_or("(no unfinished jobs)"));
    out.push_str("\nBUCKETS\n");
    let mut buckets = Table::new(&[
        ("BUCKET", Align::Left),
        ("DIMENSION", Align::Left),
        ("USED", Align::Right),
        ("LIMIT", Align::Right),
        ("USE", Align::Right),
        ("SOURCE", Align::Left),
    ]);
    for b in rows(&s["buckets"]) {
        let (used, cap) = (
            b["used"].as_f64().unwrap_or(0.0),
            b["capacity"].as_f64().unwrap_or(0.0),
        );
        let pct = if cap > 0.0 { 100.0 * used / cap } else { 0.0 };
        let dimension = b["dimension"]
            .as_str()
            .and_then(tollgate::vocab::Dimension::parse)
            .unwrap_or(tollgate::vocab::Dimension::Requests);
        buckets.row(vec![
            cell(&b["bucket"]),
            cell(&b["dimension"]),
            dimension.show(used),
            dimension.show(cap),
            format!("{pct:.0}%"),
            cell(&b["source"]),
        ]);
    }
    out.push_str(&buckets.render_or("(no buckets)"));
    let r = &s["rates"];
    out.push_str(&format!(
        "\nLAST {} s: {:.2} jobs/s, {:.0} tokens/s, {} failed attempts, {} provider 429s, {} provider 5xx\n",
        cell(&r["window_secs"]),
        r["jobs_per_sec"].as_f64().unwrap_or(0.0),
        r["tokens_per_sec"].as_f64().unwrap_or(0.0),
        cell(&r["failed_attempts"]),
        cell(&r["provider_429s"]),
        cell(&r["provider_5xxs"])
    ));
    out
}

/// Jobs as a table.
pub fn render_jobs(jobs: &[Value]) -> String {
    let mut t = Table::new(&[
        ("ID", Align::Left),
        ("STATE", Align::Left),
        ("CLASS", Align::Left),
        ("MODEL", Align::Left),
        ("PROVIDER", Align::Left),
        ("ATTEMPTS", Align::Right),
        ("CHARGED USD", Align::Right),
        ("CREATED", Align::Left),
        ("FINISHED", Align::Left),
        ("ERROR", Align::Left),
    ]);
    for j in jobs {
        let usd = j["cost"]["charged_usd"].as_f64();
        t.row(vec![
            cell(&j["id"]),
            cell(&j["state"]),
            cell(&j["class"]),
            cell(&j["model"]),
            cell(&j["provider"]),
            cell(&j["attempts"]),
            usd.map_or_else(|| "-".to_owned(), |usd| format!("{usd:.6}")),
            when(&j["created_at"]),
            when(&j["finished_at"]),
            j["error"]["code"].as_str().unwrap_or("").to_owned(),
        ]);
    }
    t.render_or("(no jobs)")
}

/// `tollgate jobs …`.
pub async fn jobs(args: JobsArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    match args.command {
        JobsCommand::List {
            state,
            tenant,
            class,
            model,
            reason,
            batch,
            search,
            limit,
            after,
            json,
            remote,
        } => {
            let query: Vec<(&str, String)> = [
                ("state", state),
                ("tenant", tenant),
                ("class", class),
                ("model", model),
                ("reason", reason),
                ("batch", batch),
                ("q", search),
            ]
            .into_iter()
            .filter_map(|(name, value)| Some((name, value?)))
            .collect();
            let (jobs, more) = remote.list(&http, "/v1/jobs", &query, limit, after).await?;
            print_page(jobs, more, json, render_jobs)
        }
        JobsCommand::Get { id, wait, remote } => {
            let job = remote
                .get(&http, &format!("/v1/jobs/{}?wait={wait}", segment(&id)))
                .await?;
            print_json(&job)?;
            Ok(job["state"] != "failed")
        }
        JobsCommand::Cancel { id, json, remote } => job_action(&http, &remote, &id, "cancel", json).await,
        JobsCommand::Retry { id, json, remote } => job_action(&http, &remote, &id, "retry", json).await,
        JobsCommand::Attempts { id, json, remote } => {
            let path = format!("/v1/jobs/{}/attempts", segment(&id));
            let Some(attempts) = remote.table_items(&http, &path, json).await? else {
                return Ok(true);
            };
            let mut t = Table::new(&[
                ("#", Align::Right),
                ("PROVIDER", Align::Left),
                ("MODEL", Align::Left),
                ("KEY", Align::Left),
                ("STATUS", Align::Right),
                ("OUTCOME", Align::Left),
                ("CODE", Align::Left),
                ("IN", Align::Right),
                ("OUT", Align::Right),
                ("FINISHED", Align::Left),
            ]);
            for a in &attempts {
                t.row(vec![
                    cell(&a["attempt"]),
                    cell(&a["provider"]),
                    cell(&a["provider_model"]),
                    cell(&a["key"]),
                    cell(&a["status"]),
                    cell(&a["outcome"]),
                    cell(&a["error_code"]),
                    cell(&a["usage"]["input_tokens"]),
                    cell(&a["usage"]["output_tokens"]),
                    when(&a["finished_at"]),
                ]);
            }
            print!("{}", t.render_or("(no provider calls yet)"));
            Ok(true)
        }
    }
}

/// `POST /v1/jobs/{id}/<action>` (`cancel`, `retry`), the job printed as it is after.
async fn job_action(
    http: &reqwest::Client,
    remote: &Remote,
    id: &str,
    action: &str,
    json: bool,
) -> anyhow::Result<bool> {
    let path = format!("/v1/jobs/{}/{action}", segment(id));
    let job = remote.json(http, Method::POST, &path, None).await?;
    if json {
        print_json(&job)?;
    } else {
        println!("{} {}", cell(&job["id"]), cell(&job["state"]));
    }
    Ok(true)
}

/// A page of a list: as JSON, or as `table` renders it and then, on stderr when the page
/// stopped at its limit, how to see the next one.
fn print_page(
    items: Vec<Value>,
    more: bool,
    json: bool,
    table: impl FnOnce(&[Value]) -> String,
) -> anyhow::Result<bool> {
    if json {
        print_json(&Value::Array(items))?;
        return Ok(true);
    }
    print!("{}", table(&items));
    if let (true, Some(last)) = (more, items.last().and_then(|i| i["id"].as_str())) {
        eprintln!("(more: --after {last})");
    }
    Ok(true)
}

/// One batch as `label value` lines.
pub fn render_batch(b: &Value) -> String {
    let counts = &b["request_counts"];
    fields(&[
        ("ID", cell(&b["id"])),
        ("STATUS", cell(&b["status"])),
        ("CLASS", cell(&b["class"])),
        ("PRIORITY", cell(&b["priority"])),
        ("PAUSED", when(&b["paused_at"])),
        ("ENDPOINT", cell(&b["endpoint"])),
        (
            "REQUESTS",
            format!(
                "{} total, {} completed, {} failed",
                cell(&counts["total"]),
                cell(&counts["completed"]),
                cell(&counts["failed"])
            ),
        ),
        ("INPUT FILE", cell(&b["input_file_id"])),
        ("OUTPUT FILE", cell(&b["output_file_id"])),
        ("ERROR FILE", cell(&b["error_file_id"])),
        ("CREATED", when(&b["created_at"])),
        ("EXPIRES", when(&b["expires_at"])),
        (
            "FINISHED",
            when(
                ["completed_at", "failed_at", "expired_at", "cancelled_at"]
                    .iter()
                    .map(|k| &b[*k])
                    .find(|v| !v.is_null())
                    .unwrap_or(&Value::Null),
            ),
        ),
    ])
}

/// `POST /v1/batches/{id}/{action}` (`pause`, `resume`); prints the batch's id, status,
/// and whether it is paused.
async fn pause_or_resume(
    http: &reqwest::Client,
    remote: &Remote,
    id: &str,
    action: &str,
) -> anyhow::Result<bool> {
    let path = format!("/v1/batches/{}/{action}", segment(id));
    let b = remote.json(http, Method::POST, &path, None).await?;
    let paused = if b["paused_at"].is_null() {
        "running"
    } else {
        "paused"
    };
    println!("{} {} {paused}", cell(&b["id"]), cell(&b["status"]));
    Ok(true)
}

/// `tollgate batches …`.
pub async fn batches(args: BatchesArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    match args.command {
        BatchesCommand::List {
            all: false,
            json,
            remote,
            ..
        } => {
            let batches = remote.get(&http, "/v1/status").await?["batches"].take();
            if json {
                print_json(&batches)?;
                return Ok(true);
            }
            let mut t = Table::new(&[
                ("ID", Align::Left),
                ("TENANT", Align::Left),
                ("STATE", Align::Left),
                ("TOTAL", Align::Right),
                ("COMPLETED", Align::Right),
                ("FAILED", Align::Right),
                ("CREATED", Align::Left),
            ]);
            for b in rows(&batches) {
                t.row(vec![
                    cell(&b["id"]),
                    cell(&b["tenant"]),
                    cell(&b["state"]),
                    cell(&b["total"]),
                    cell(&b["completed"]),
                    cell(&b["failed"]),
                    when(&b["created_at"]),
                ]);
            }
            print!("{}", t.render_or("(no batches in progress)"));
            Ok(true)
        }
        BatchesCommand::List {
            all: true,
            limit,
            after,
            json,
            remote,
        } => {
            let (batches, more) = remote.list(&http, "/v1/batches", &[], limit, after).await?;
            print_page(batches, more, json, |batches| {
                let mut t = Table::new(&[
                    ("ID", Align::Left),
                    ("STATUS", Align::Left),
                    ("CLASS", Align::Left),
                    ("TOTAL", Align::Right),
                    ("COMPLETED", Align::Right),
                    ("FAILED", Align::Right),
                    ("CREATED", Align::Left),
                    ("OUTPUT FILE", Align::Left),
                ]);
                for b in batches {
                    let counts = &b["request_counts"];
                    t.row(vec![
                        cell(&b["id"]),
                        cell(&b["status"]),
                        cell(&b["class"]),
                        cell(&counts["total"]),
                        cell(&counts["completed"]),
                        cell(&counts["failed"]),
                        when(&b["created_at"]),
                        cell(&b["output_file_id"]),
                    ]);
                }
                t.render_or("(no batches)")
            })
        }
        BatchesCommand::Get { id, json, remote } => {
            let b = remote
                .get(&http, &format!("/v1/batches/{}", segment(&id)))
                .await?;
            if json {
                print_json(&b)?;
            } else {
                print!("{}", render_batch(&b));
            }
            Ok(true)
        }
        BatchesCommand::Cancel { id, json, remote } => {
            let path = format!("/v1/batches/{}/cancel", segment(&id));
            let b = remote.json(&http, Method::POST, &path, None).await?;
            if json {
                print_json(&b)?;
            } else {
                println!("{} {}", cell(&b["id"]), cell(&b["status"]));
            }
            Ok(true)
        }
        BatchesCommand::Pause { id, remote } => pause_or_resume(&http, &remote, &id, "pause").await,
        BatchesCommand::Resume { id, remote } => pause_or_resume(&http, &remote, &id, "resume").await,
        BatchesCommand::Results { id, after, remote } => {
            let mut cursor = after;
            loop {
                let path = format!("/v1/batches/{}/results?after={}", segment(&id), segment(&cursor));
                let r = remote.send(&http, Method::GET, &path, None).await?;
                let next = r
                    .headers()
                    .get("x-next-cursor")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
                    .unwrap_or_else(|| cursor.clone());
                let lines = r.text().await?;
                print!("{lines}");
                if lines.is_empty() || next == cursor {
                    break;
                }
                cursor = next;
            }
            eprintln!("next cursor: {cursor}");
            Ok(true)
        }
        BatchesCommand::Outputs {
            id,
            errors,
            output,
            remote,
        } => {
            let b = remote
                .get(&http, &format!("/v1/batches/{}", segment(&id)))
                .await?;
            let (key, what) = if errors {
                ("error_file_id", "error file")
            } else {
                ("output_file_id", "output file")
            };
            let Some(file) = b[key].as_str() else {
                let status = cell(&b["status"]);
                let finished = matches!(status.as_str(), "completed" | "failed" | "expired" | "cancelled");
                let why = match (finished, errors) {
                    (false, _) => "it is written when the batch finishes",
                    (true, false) => "none of its requests succeeded",
                    (true, true) => "none of its requests failed",
                };
                bail!("batch {id} has no {what} (status {status}): {why}");
            };
            download(&http, &remote, file, output.as_deref()).await
        }
    }
}

/// A file's content to `output` or stdout; says on stderr where it went.
async fn download(
    http: &reqwest::Client,
    remote: &Remote,
    file: &str,
    output: Option<&Path>,
) -> anyhow::Result<bool> {
    let bytes = remote
        .download(http, &format!("/v1/files/{}/content", segment(file)), output)
        .await?;
    if let Some(path) = output {
        eprintln!("{file}: {bytes} bytes written to {}", path.display());
    }
    Ok(true)
}

/// `tollgate files …`.
pub async fn files(args: FilesArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    match args.command {
        FilesCommand::List {
            purpose,
            limit,
            after,
            json,
            remote,
        } => {
            let query: Vec<(&str, String)> = purpose.map(|p| ("purpose", p)).into_iter().collect();
            let (files, more) = remote.list(&http, "/v1/files", &query, limit, after).await?;
            print_page(files, more, json, |files| {
                let mut t = Table::new(&[
                    ("ID", Align::Left),
                    ("PURPOSE", Align::Left),
                    ("BYTES", Align::Right),
                    ("FILENAME", Align::Left),
                    ("CREATED", Align::Left),
                    ("EXPIRES", Align::Left),
                ]);
                for f in files {
                    t.row(vec![
                        cell(&f["id"]),
                        cell(&f["purpose"]),
                        cell(&f["bytes"]),
                        cell(&f["filename"]),
                        when(&f["created_at"]),
                        when(&f["expires_at"]),
                    ]);
                }
                t.render_or("(no files)")
            })
        }
        FilesCommand::Get { id, json, remote } => {
            let f = remote.get(&http, &format!("/v1/files/{}", segment(&id))).await?;
            if json {
                print_json(&f)?;
            } else {
                print!(
                    "{}",
                    fields(&[
                        ("ID", cell(&f["id"])),
                        ("PURPOSE", cell(&f["purpose"])),
                        ("BYTES", cell(&f["bytes"])),
                        ("FILENAME", cell(&f["filename"])),
                        ("CREATED", when(&f["created_at"])),
                        ("EXPIRES", when(&f["expires_at"])),
                    ])
                );
            }
            Ok(true)
        }
        FilesCommand::Delete { id, remote } => {
            let path = format!("/v1/files/{}", segment(&id));
            let answer = remote.json(&http, Method::DELETE, &path, None).await?;
            println!("{} deleted", cell(&answer["id"]));
            Ok(true)
        }
        FilesCommand::Content { id, output, remote } => {
            download(&http, &remote, &id, output.as_deref()).await
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
    /// Its line in the file (1-based, blank lines counted).
    pub line: usize,
    /// The job's id, when it was accepted.
    pub id: Option<String>,
    /// `queued` when accepted, then the final state; `rejected` when refused.
    pub state: String,
    /// The refusal or failure: `{code, message}`.
    pub error: Option<Value>,
    /// The class it was queued in, when it was accepted.
    pub class: Option<String>,
}

/// Sends the jobs (each with its line number) to the server, `concurrency` at a time.
/// This is the one place that knows how jobs are uploaded (one `POST /v1/jobs` each, for
/// now). A refused key or an unreachable server stops it: nothing more is sent, and the
/// refusal is the error.
pub async fn upload(
    http: &reqwest::Client,
    remote: &Remote,
    bodies: Vec<(usize, Value)>,
    concurrency: usize,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<Submitted>> {
    let stop = AtomicBool::new(false);
    let refused: Mutex<Option<Refused>> = Mutex::new(None);
    let (stop, refused_ref) = (&stop, &refused);
    let mut done: Vec<Submitted> = futures::stream::iter(bodies)
        // Checked as each line is taken: after a final refusal, no line is sent.
        .take_while(|_| futures::future::ready(!stop.load(Ordering::Relaxed)))
        .map(|(line, body)| async move {
            let answer = remote.json(http, Method::POST, "/v1/jobs", Some(&body)).await;
            bar.inc(1);
            match answer {
                Ok(answer) => Submitted {
                    line,
                    id: answer["id"].as_str().map(str::to_owned),
                    state: answer["state"].as_str().unwrap_or("queued").to_owned(),
                    error: None,
                    class: answer["class"].as_str().map(str::to_owned),
                },
                Err(e) => {
                    let error = Some(e.body());
                    if e.is_final() {
                        stop.store(true, Ordering::Relaxed);
                        let mut first = refused_ref
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        first.get_or_insert(e);
                    }
                    Submitted {
                        line,
                        id: None,
                        state: "rejected".into(),
                        error,
                        class: None,
                    }
                }
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    if let Some(e) = refused
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        let accepted = done.iter().filter(|s| s.id.is_some()).count();
        if accepted == 0 {
            return Err(e.into());
        }
        // Rare (a key revoked, a server stopped, mid-upload): what was accepted runs on.
        bail!("{e}; {accepted} of the file's jobs were accepted before it and will run");
    }
    done.sort_by_key(|s| s.line);
    Ok(done)
}

fn is_terminal(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled" | "rejected")
}

/// The file's jobs, each with its line number (blank lines are skipped but counted).
pub fn read_jobs(
    reader: impl BufRead,
    name: &str,
    deadline: Option<DateTime<Utc>>,
    class: Option<&str>,
) -> anyhow::Result<Vec<(usize, Value)>> {
    let mut bodies = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading {name}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: Value =
            serde_json::from_str(&line).with_context(|| format!("{name} line {}: not JSON", i + 1))?;
        bodies.push((i + 1, job_body(&value, deadline, class)));
    }
    Ok(bodies)
}

/// `tollgate submit`.
pub async fn submit(args: SubmitArgs) -> anyhow::Result<bool> {
    let file = std::fs::File::open(&args.file).with_context(|| format!("opening {}", args.file.display()))?;
    let deadline = args
        .deadline
        .as_deref()
        .map(|d| parse_deadline(d, Utc::now()))
        .transpose()?;
    let bodies = read_jobs(
        std::io::BufReader::new(file),
        &args.file.display().to_string(),
        deadline,
        args.class.as_deref(),
    )?;
    let http = reqwest::Client::new();
    let total = bodies.len() as u64;
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:40}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix("uploading");
    let uploaded = upload(&http, &args.remote, bodies, args.concurrency, &bar).await;
    let mut jobs = match uploaded {
        Ok(jobs) => jobs,
        Err(e) => {
            bar.finish_and_clear();
            return Err(e);
        }
    };
    if args.wait {
        let followed = follow(&http, &args.remote, &mut jobs, args.concurrency, &bar).await;
        if let Err(e) = followed {
            bar.finish_and_clear();
            return Err(e);
        }
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
                "{} line {}: {}: {} ({})",
                args.file.display(),
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

/// Long-polls every accepted job until it is finished, updating the bar from one
/// [`Progress`]: its position is the finished count the message shows, and the ETA is the
/// broker's forecast for the tenant's queues that hold the jobs (`/v1/status`,
/// `eta_secs`), or until the broker has one, the rate jobs finished since following began.
/// The admission rate comes from the same queues. Stops at a refused key; waits out a
/// server restart.
async fn follow(
    http: &reqwest::Client,
    remote: &Remote,
    jobs: &mut [Submitted],
    concurrency: usize,
    bar: &ProgressBar,
) -> anyhow::Result<()> {
    let began = Instant::now();
    let mut progress = Progress::new(jobs.len() as u64, jobs.iter().map(|j| j.state.as_str()));
    // The finished count is in the message only: a `{pos}` beside it could lag it by a frame.
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:40}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix("running");
    bar.set_message(progress.message(Duration::ZERO));
    bar.set_position(progress.finished());
    let waiting: Vec<(usize, String)> = jobs
        .iter()
        .enumerate()
        .filter(|(_, j)| !is_terminal(&j.state))
        .filter_map(|(i, j)| j.id.clone().map(|id| (i, id)))
        .collect();
    let accepted = waiting.len() as f64;
    let classes: std::collections::HashSet<String> = jobs.iter().filter_map(|j| j.class.clone()).collect();
    let mut finished = futures::stream::iter(waiting)
        .map(|(i, id)| async move {
            loop {
                match remote
                    .get(http, &format!("/v1/jobs/{}?wait=30", segment(&id)))
                    .await
                {
                    Ok(job) if is_terminal(job["state"].as_str().unwrap_or("")) => return Ok((i, job)),
                    Ok(_) => {}
                    Err(e @ Refused::Key { .. }) => return Err(e),
                    // The jobs are durable: through a restart (unreachable meanwhile) or a
                    // 5xx, ask again shortly.
                    Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                }
            }
        })
        .buffer_unordered(concurrency.max(1));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut admission = String::new();
    // (when, admitted so far) at the previous tick: the admission rate is their slope.
    let mut previous: Option<(Instant, f64)> = None;
    loop {
        tokio::select! {
            next = finished.next() => {
                let Some(next) = next else { break };
                let (i, job) = next?;
                let state = job["state"].as_str().unwrap_or("").to_owned();
                progress.record(&state);
                jobs[i].error = job.get("error").filter(|e| !e.is_null()).cloned();
                jobs[i].state = state;
            }
            _ = tick.tick() => {
                // Admitted so far = accepted − still queued (the tenant's queue, all classes).
                if let Ok(s) = remote.get(http, "/v1/status").await {
                    let queues: Vec<&Value> = rows(&s["queues"])
                        .iter()
                        .filter(|q| q["class"].as_str().is_some_and(|c| classes.contains(c)))
                        .collect();
                    progress.forecast = queues
                        .iter()
                        .filter_map(|q| q["eta_secs"].as_f64())
                        .reduce(f64::max)
                        .map(Duration::from_secs_f64);
                    let queued: f64 = queues.iter().map(|q| q["queued"].as_f64().unwrap_or(0.0)).sum();
                    let admitted = (accepted - queued).max(0.0);
                    let now = Instant::now();
                    admission = match previous {
                        Some((at, before)) => {
                            let rate = (admitted - before).max(0.0) / (now - at).as_secs_f64().max(0.001);
                            format!("; admitted {admitted:.0}/{accepted:.0} at {rate:.1}/s")
                        }
                        None => format!("; admitted {admitted:.0}/{accepted:.0}"),
                    };
                    previous = Some((now, admitted));
                }
            }
        }
        let elapsed = began.elapsed();
        bar.set_message(format!(
            "{}{admission} ({} elapsed)",
            progress.message(elapsed),
            short_duration(elapsed)
        ));
        bar.set_position(progress.finished());
    }
    Ok(())
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

    #[test]
    fn line_numbers_are_the_file_s_own() {
        let text = "{\"model\": \"a\", \"messages\": []}\n\n   \n{\"model\": \"b\", \"messages\": []}\n";
        let jobs = read_jobs(text.as_bytes(), "f.jsonl", None, None).unwrap();
        let lines: Vec<usize> = jobs.iter().map(|(line, _)| *line).collect();
        assert_eq!(lines, [1, 4]);
        assert_eq!(jobs[1].1["request"]["model"], "b");
        let bad = "{\"model\": \"a\", \"messages\": []}\n\nnot json\n";
        let e = read_jobs(bad.as_bytes(), "f.jsonl", None, None).unwrap_err();
        assert_eq!(e.to_string(), "f.jsonl line 3: not JSON");
    }

    #[test]
    fn status_columns_line_up_under_their_headers() {
        let s = json!({
            "scope": "all",
            "queues": [
                {"tenant": "acme", "class": "standard", "queued": 12, "admitted": 0, "running": 6, "oldest_queued_secs": 3.3},
                {"tenant": "globex-international", "class": "batch", "queued": 1500, "admitted": 20, "running": 0, "oldest_queued_secs": 0.0},
            ],
            "buckets": [{"bucket": "provider:oai:gpt-4o-mini:tpm", "dimension": "tokens", "used": 1234.0, "capacity": 5000.0, "source": "configured"}],
            "rates": {"window_secs": 60, "jobs_per_sec": 1.5, "tokens_per_sec": 10.0, "failed_attempts": 0, "provider_429s": 2, "provider_5xxs": 0},
        });
        let text = render_status(&s);
        let lines: Vec<&str> = text.lines().collect();
        let header = lines.iter().position(|l| l.starts_with("TENANT")).unwrap();
        let (h, acme, globex) = (lines[header], lines[header + 1], lines[header + 2]);
        // Right-aligned numbers end where their header ends.
        for column in ["QUEUED", "ADMITTED", "RUNNING", "OLDEST"] {
            let end = h.find(column).unwrap() + column.len();
            for row in [acme, globex] {
                assert!(!row.as_bytes()[end - 1].is_ascii_whitespace(), "{column}: {text}");
                assert!(
                    row.len() == end || row.as_bytes()[end] == b' ',
                    "{column}: {text}"
                );
            }
        }
        assert_eq!(
            acme.split_whitespace().collect::<Vec<_>>(),
            ["acme", "standard", "12", "0", "6", "3.3s"]
        );
        assert!(globex.starts_with("globex-international  batch"), "{text}");
        let bucket = lines
            .iter()
            .find(|l| l.starts_with("provider:oai:gpt-4o-mini:tpm"))
            .unwrap();
        assert_eq!(
            bucket.split_whitespace().collect::<Vec<_>>(),
            [
                "provider:oai:gpt-4o-mini:tpm",
                "tokens",
                "1234",
                "5000",
                "25%",
                "configured"
            ]
        );
        assert!(text.contains("LAST 60 s: 1.50 jobs/s"), "{text}");
    }

    #[test]
    fn ids_stay_one_path_segment() {
        assert_eq!(segment("batch_01ab-CD"), "batch_01ab-CD");
        assert_eq!(segment("../status?x=1"), "..%2Fstatus%3Fx%3D1");
    }
}
