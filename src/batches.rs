//! The bulk model: files and batches as OpenAI's Files and Batch APIs define them — ids,
//! statuses, rows, completion windows. A batch's lines are ordinary jobs (class `batch`
//! unless the batch names another) that carry the batch id, their `custom_id` and their
//! input line; its output and error files are built from those jobs when it finishes.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::model::JobClass;

/// A new file id: `file-` + a UUIDv7 in hex, so ids sort by creation time.
pub fn new_file_id() -> String {
    format!("file-{}", Uuid::now_v7().simple())
}

/// A new batch id: `batch_` + a UUIDv7 in hex.
pub fn new_batch_id() -> String {
    format!("batch_{}", Uuid::now_v7().simple())
}

/// File purposes tollgate accepts and produces.
pub const PURPOSE_BATCH: &str = "batch";
pub const PURPOSE_BATCH_OUTPUT: &str = "batch_output";

/// The one endpoint batch lines may call: it is what the dispatcher runs.
pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchStatus {
    Validating,
    Failed,
    InProgress,
    Finalizing,
    Completed,
    Expired,
    Cancelling,
    Cancelled,
}

impl BatchStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Validating => "validating",
            Self::Failed => "failed",
            Self::InProgress => "in_progress",
            Self::Finalizing => "finalizing",
            Self::Completed => "completed",
            Self::Expired => "expired",
            Self::Cancelling => "cancelling",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Validating,
            Self::Failed,
            Self::InProgress,
            Self::Finalizing,
            Self::Completed,
            Self::Expired,
            Self::Cancelling,
            Self::Cancelled,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }

    /// Finished: its output and error files exist and nothing about it changes any more.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Failed | Self::Completed | Self::Expired | Self::Cancelled
        )
    }

    /// The webhook event announcing this terminal status.
    pub fn event_type(self) -> Option<&'static str> {
        match self {
            Self::Completed => Some("batch.completed"),
            Self::Failed => Some("batch.failed"),
            Self::Expired => Some("batch.expired"),
            Self::Cancelled => Some("batch.cancelled"),
            _ => None,
        }
    }
}

/// A row of `files` (without its bytes).
#[derive(Debug, Clone, sqlx::FromRow)]
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
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct BatchRow {
    pub id: String,
    pub tenant: String,
    pub endpoint: String,
    pub input_file_id: String,
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
}

impl BatchRow {
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
    fn ids_sort_by_creation() {
        let (a, b) = (new_batch_id(), new_batch_id());
        assert!(a < b && a.starts_with("batch_") && a.len() == 38, "{a} {b}");
        assert!(new_file_id().starts_with("file-"));
    }
}
