//! The bulk model: files and batches as OpenAI's Files and Batch APIs define them — ids,
//! statuses, rows, completion windows. A batch's lines are ordinary jobs (class `batch`
//! unless the batch names another) that carry the batch id, their `custom_id` and their
//! input line; its output and error files are built from those jobs when it finishes.
//! An input file is read as a stream: [`LineSplitter`] cuts it into lines holding at most
//! one line's bytes, and [`parse_line`] checks each line's envelope (both are fuzzed:
//! `fuzz/`, and `tests::fuzz_bodies_*`).

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::model::JobId;
use crate::vocab::{BatchStatus, Endpoint, JobClass};

/// A new file id: `file-` + a UUIDv7 in hex, so ids sort by creation time.
pub fn new_file_id() -> String {
    format!("file-{}", Uuid::now_v7().simple())
}

/// Ids of batches created through OpenAI's Batch API begin with this.
pub const BATCH_PREFIX: &str = "batch_";

/// A new batch id: `batch_` + a UUIDv7 in hex.
pub fn new_batch_id() -> String {
    format!("{BATCH_PREFIX}{}", Uuid::now_v7().simple())
}

/// Ids of batches created as Anthropic's Message Batches begin with this.
pub const MESSAGE_BATCH_PREFIX: &str = "msgbatch_";

/// A new Message Batch id: `msgbatch_` + a UUIDv7 in hex.
pub fn new_message_batch_id() -> String {
    format!("{MESSAGE_BATCH_PREFIX}{}", Uuid::now_v7().simple())
}

/// File purposes tollgate accepts and produces.
pub const PURPOSE_BATCH: &str = "batch";
pub const PURPOSE_BATCH_OUTPUT: &str = "batch_output";

/// A row of `files` (without its bytes).
#[derive(Debug, Clone)]
pub struct FileRow {
    pub id: String,
    pub tenant: String,
    pub purpose: String,
    pub filename: String,
    pub bytes: i64,
    pub lines: i64,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// A row of `batches`.
#[derive(Debug, Clone)]
pub struct BatchRow {
    pub id: String,
    pub tenant: String,
    /// What every line of the batch calls (each line's `url`).
    pub endpoint: Endpoint,
    /// The file its lines came from; `None` for a Message Batch (its requests came inline).
    pub input_file_id: Option<String>,
    pub completion_window: String,
    pub status: String,
    pub class: JobClass,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub metadata: Option<serde_json::Value>,
    pub errors: Option<serde_json::Value>,
    pub total: i32,
    pub rejected: i32,
    pub completed: Option<i32>,
    pub failed: Option<i32>,
    /// Of `failed`: lines cancelled, and lines that expired (frozen with it).
    pub cancelled: Option<i32>,
    pub expired: Option<i32>,
    pub usage: Option<serde_json::Value>,
    pub output_expires_secs: i64,
    pub created_at: DateTime<Utc>,
    pub in_progress_at: Option<DateTime<Utc>>,
    pub expires_at: DateTime<Utc>,
    pub finalizing_at: Option<DateTime<Utc>>,
    pub completed_at: Option<DateTime<Utc>>,
    pub failed_at: Option<DateTime<Utc>>,
    pub expired_at: Option<DateTime<Utc>>,
    pub cancelling_at: Option<DateTime<Utc>>,
    pub cancelled_at: Option<DateTime<Utc>>,
    /// The API key that created it: its lines' jobs carry it.
    pub api_key: Option<uuid::Uuid>,
    /// Since when its queued lines are held out of admission; `None`: not paused.
    pub paused_at: Option<DateTime<Utc>>,
    /// Its lines' priority (as a job's), changed with the batch.
    pub priority: i32,
    /// What its lines may cost together, in USD (a bucket on their path).
    pub max_cost_usd: Option<f64>,
    /// The share of its finished lines that may fail (once [`ERROR_RATE_MIN_LINES`] have
    /// finished) before it is stopped.
    pub max_error_rate: Option<f64>,
    /// When its last line was forecast to finish at creation, p50 and p90
    /// (the `forecast` module).
    pub eta_p50: Option<DateTime<Utc>>,
    pub eta_p90: Option<DateTime<Utc>>,
}

/// Finished lines a batch's error rate is judged on, at least.
pub const ERROR_RATE_MIN_LINES: i64 = 10;

/// Where a read of a batch's finished lines goes on from (`GET /v1/batches/{id}/results`'s
/// `after`): past line `id` of those whose ending committed in transaction `xid`
/// (`store::batch_results_after`). Written `{xid}.{id}`; `0` is the start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResultsCursor {
    pub xid: i64,
    pub id: JobId,
}

impl ResultsCursor {
    /// Before every line.
    pub const START: Self = Self {
        xid: 0,
        id: JobId(Uuid::nil()),
    };
}

impl std::fmt::Display for ResultsCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Self::START {
            return f.write_str("0");
        }
        write!(f, "{}.{}", self.xid, self.id)
    }
}

impl std::str::FromStr for ResultsCursor {
    type Err = ();

    fn from_str(text: &str) -> Result<Self, ()> {
        if text == "0" {
            return Ok(Self::START);
        }
        let (xid, id) = text.split_once('.').ok_or(())?;
        Ok(Self {
            xid: xid.parse().ok().filter(|x: &i64| *x >= 0).ok_or(())?,
            id: id.parse().map_err(|_| ())?,
        })
    }
}

impl BatchRow {
    /// A batch created at `now`, in progress and open for `window`; no input file, no
    /// metadata, its files kept a day.
    pub fn in_progress(
        id: String,
        tenant: &str,
        endpoint: Endpoint,
        class: JobClass,
        completion_window: String,
        window: std::time::Duration,
        now: DateTime<Utc>,
    ) -> Self {
        Self {
            id,
            tenant: tenant.to_owned(),
            endpoint,
            input_file_id: None,
            completion_window,
            status: BatchStatus::InProgress.as_str().to_owned(),
            class,
            output_file_id: None,
            error_file_id: None,
            metadata: None,
            errors: None,
            total: 0,
            rejected: 0,
            completed: None,
            failed: None,
            cancelled: None,
            expired: None,
            usage: None,
            output_expires_secs: 86_400,
            created_at: now,
            in_progress_at: Some(now),
            expires_at: now + chrono::Duration::from_std(window).unwrap_or(chrono::Duration::days(1)),
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
            api_key: None,
            paused_at: None,
            priority: 0,
            max_cost_usd: None,
            max_error_rate: None,
            eta_p50: None,
            eta_p90: None,
        }
    }

    pub fn status(&self) -> BatchStatus {
        BatchStatus::parse(&self.status).unwrap_or(BatchStatus::Failed)
    }
}

/// `request_counts`: every input line is counted once, as completed or failed when it
/// ends (rejected lines are failed from the start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RequestCounts {
    pub total: i64,
    pub completed: i64,
    pub failed: i64,
}

/// Parses a completion window: OpenAI's `"24h"`, or any `<n>s|m|h|d` (tollgate's shorter
/// windows, e.g. `"15m"`). `None` if malformed or zero.
pub fn parse_window(text: &str) -> Option<std::time::Duration> {
    let unit_at = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(unit_at);
    let n: u64 = digits.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "m" => n.checked_mul(60)?,
        "h" => n.checked_mul(3600)?,
        "d" => n.checked_mul(86_400)?,
        _ => return None,
    };
    (secs > 0).then(|| std::time::Duration::from_secs(secs))
}

/// A line as the splitter hands it out.
#[derive(Debug, PartialEq, Eq)]
pub enum Line<'a> {
    Text(&'a [u8]),
    /// Longer than the limit; its bytes were dropped as they came.
    TooLarge,
}

/// Splits a byte stream into non-blank lines numbered from 1 (blank lines count in the
/// numbering, as an editor shows them), holding at most one line of `max` bytes.
pub struct LineSplitter {
    max: usize,
    carry: Vec<u8>,
    carry_too_large: bool,
    number: i32,
    out: Vec<(i32, Option<Vec<u8>>)>,
}

impl LineSplitter {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            carry: Vec::new(),
            carry_too_large: false,
            number: 0,
            out: Vec::new(),
        }
    }

    /// The complete lines in `data` (and, when `last`, the final unterminated one).
    pub fn feed(&mut self, data: &[u8], last: bool) -> Vec<(i32, Line<'_>)> {
        self.out.clear();
        let mut rest = data;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            self.append(&rest[..end]);
            self.end_line();
            rest = &rest[end + 1..];
        }
        self.append(rest);
        if last && (self.carry_too_large || !self.carry.is_empty()) {
            self.end_line();
        }
        self.out
            .iter()
            .map(|(n, l)| (*n, l.as_deref().map_or(Line::TooLarge, Line::Text)))
            .collect()
    }

    fn append(&mut self, part: &[u8]) {
        if self.carry_too_large {
            return;
        }
        if self.carry.len() + part.len() > self.max {
            self.carry_too_large = true;
            self.carry = Vec::new();
        } else {
            self.carry.extend_from_slice(part);
        }
    }

    fn end_line(&mut self) {
        self.number += 1;
        let line = std::mem::take(&mut self.carry);
        if std::mem::take(&mut self.carry_too_large) {
            self.out.push((self.number, None));
        } else if line.iter().any(|b| !b.is_ascii_whitespace()) {
            self.out.push((self.number, Some(line)));
        }
    }
}

/// Longest `custom_id` accepted.
pub const MAX_CUSTOM_ID: usize = 512;

/// A batch input line's envelope, checked: its `custom_id` and the request (`body`).
#[derive(Debug, Clone, PartialEq)]
pub struct LineEnvelope {
    pub custom_id: String,
    pub request: Value,
}

/// Why a line's envelope was refused: a stable code for the error file, and the
/// `custom_id` when it was readable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineReject {
    pub custom_id: Option<String>,
    pub code: &'static str,
    pub message: String,
}

/// Checks a batch input line's envelope, as OpenAI's Batch API defines it: a JSON object
/// with a non-empty `custom_id` not seen on an earlier line (`seen` remembers them),
/// `"method": "POST"` and `"url"` the batch's `endpoint`. Returns the `body` (the
/// request, checked by the caller). Any bytes in; never panics.
pub fn parse_line(
    text: &[u8],
    endpoint: Endpoint,
    seen: &mut HashSet<String>,
) -> Result<LineEnvelope, LineReject> {
    let reject = |custom_id: Option<&str>, code: &'static str, message: String| LineReject {
        custom_id: custom_id.map(str::to_owned),
        code,
        message,
    };
    let value: Value = serde_json::from_slice(text)
        .map_err(|e| reject(None, "invalid_json", format!("the line is not valid JSON: {e}")))?;
    if let Some(at) = crate::sanitize::first_nul(&value) {
        return Err(reject(
            None,
            "nul_character",
            format!("the string at {at} holds U+0000 (NUL), which tollgate cannot store"),
        ));
    }
    let Value::Object(mut obj) = value else {
        return Err(reject(
            None,
            "invalid_json",
            "the line must be a JSON object".to_owned(),
        ));
    };
    let custom_id = match obj.get("custom_id") {
        Some(Value::String(c)) if !c.is_empty() && c.len() <= MAX_CUSTOM_ID => c.clone(),
        Some(Value::String(c)) if !c.is_empty() => {
            return Err(reject(
                None,
                "invalid_custom_id",
                format!("`custom_id` is longer than {MAX_CUSTOM_ID} bytes"),
            ));
        }
        _ => {
            return Err(reject(
                None,
                "missing_custom_id",
                "`custom_id` must be a non-empty string".to_owned(),
            ));
        }
    };
    let cid = Some(custom_id.as_str());
    if !seen.insert(custom_id.clone()) {
        return Err(reject(
            cid,
            "duplicate_custom_id",
            format!("`custom_id` {custom_id:?} appears on an earlier line"),
        ));
    }
    if obj.get("method").and_then(Value::as_str) != Some("POST") {
        return Err(reject(
            cid,
            "invalid_method",
            "`method` must be \"POST\"".to_owned(),
        ));
    }
    if obj.get("url").and_then(Value::as_str) != Some(endpoint.as_str()) {
        return Err(reject(
            cid,
            "invalid_url",
            format!("`url` must be the batch's endpoint, {endpoint}"),
        ));
    }
    let request = obj.remove("body").unwrap_or(Value::Null);
    Ok(LineEnvelope { custom_id, request })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows() {
        assert_eq!(parse_window("24h").unwrap().as_secs(), 86_400);
        assert_eq!(parse_window("15m").unwrap().as_secs(), 900);
        assert_eq!(parse_window("90s").unwrap().as_secs(), 90);
        assert_eq!(parse_window("2d").unwrap().as_secs(), 172_800);
        for bad in ["", "h", "0h", "24", "24 h", "1.5h", "-1h", "24hours"] {
            assert!(parse_window(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_results_cursor_reads_back_as_written() {
        let cursor = ResultsCursor {
            xid: 7_340_032,
            id: JobId::new(),
        };
        assert_eq!(cursor.to_string().parse(), Ok(cursor));
        assert_eq!(ResultsCursor::START.to_string(), "0");
        assert_eq!("0".parse(), Ok(ResultsCursor::START));
        for bad in [
            "",
            "12",
            "-1.0190a000-0000-7000-8000-000000000001",
            "1.x",
            "x.0190a000-0000-7000-8000-000000000001",
        ] {
            assert_eq!(bad.parse::<ResultsCursor>(), Err(()), "{bad}");
        }
    }

    #[test]
    fn ids_sort_by_creation() {
        let (a, b) = (new_batch_id(), new_batch_id());
        assert!(a < b && a.starts_with("batch_") && a.len() == 38, "{a} {b}");
        assert!(new_file_id().starts_with("file-"));
    }

    fn split(max: usize, parts: &[&[u8]]) -> Vec<(i32, String)> {
        let mut s = LineSplitter::new(max);
        let mut out = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            for (n, l) in s.feed(p, i + 1 == parts.len()) {
                out.push((
                    n,
                    match l {
                        Line::Text(t) => String::from_utf8_lossy(t).into_owned(),
                        Line::TooLarge => "<too large>".to_owned(),
                    },
                ));
            }
        }
        out
    }

    #[test]
    fn lines_across_chunks() {
        let got = split(100, &[b"ab", b"c\n\nde", b"f\r\n  \ng", b""]);
        assert_eq!(
            got,
            vec![
                (1, "abc".to_owned()),
                (3, "def\r".to_owned()),
                (5, "g".to_owned())
            ]
        );
    }

    #[test]
    fn long_lines_are_dropped_not_held() {
        let got = split(4, &[b"12345", b"678\nok\n123", b"45", b""]);
        assert_eq!(
            got,
            vec![
                (1, "<too large>".to_owned()),
                (2, "ok".to_owned()),
                (3, "<too large>".to_owned())
            ]
        );
    }
}
