//! `ApiError`: every error the API answers with — a status, a stable `code` a client can
//! branch on, and a safe message. Bodies use OpenAI's error shape
//! (`{"error": {"message", "type", "param", "code"}}`) so OpenAI SDKs surface them as is.
//! 5xx bodies never carry internals; the cause is logged once, here.

use std::time::Duration;
use tollgate::vocab::ApiErrorCode;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ApiErrorCode,
    pub message: String,
    pub param: Option<String>,
    pub retry_after: Option<Duration>,
    /// `deadline_unmeetable` at submission: the earliest deadline the work would be
    /// accepted with (its forecast p90).
    pub earliest_feasible_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: ApiErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            param: None,
            retry_after: None,
            earliest_feasible_at: None,
        }
    }

    pub fn bad_request(code: ApiErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_earliest_feasible_at(mut self, at: chrono::DateTime<chrono::Utc>) -> Self {
        self.earliest_feasible_at = Some(at);
        self
    }

    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub fn not_found(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ApiErrorCode::NotFound,
            format!("no such {what}"),
        )
    }

    /// An internal failure: logged with its cause, answered without it.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ApiErrorCode::InternalError,
            "internal error; the request may be retried",
        )
    }

    /// The database is unreachable: 503 so clients and load balancers back off and retry.
    pub fn unavailable(cause: impl std::fmt::Display) -> Self {
        tracing::warn!(error = %cause, "database unavailable");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ApiErrorCode::DatabaseUnavailable,
            "the queue's database is unreachable; retry shortly",
        )
        .with_retry_after(Duration::from_secs(1))
    }

    fn error_type(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }
}

/// SQLSTATEs that say "not now" rather than "never": the client should retry (503 with
/// `Retry-After`), and nothing about its request is wrong.
fn is_transient(sqlstate: &str) -> bool {
    // 57P01..57P03: the server is shutting down, crashed or starting (a restart);
    // 08xxx: the connection failed; 53xxx: out of connections, memory or disk;
    // 25006: a read-only server (a replica, or a primary being failed over);
    // 40001 / 40P01: a serialization failure or deadlock, which a retry resolves.
    sqlstate.starts_with("57P")
        || sqlstate.starts_with("08")
        || sqlstate.starts_with("53")
        || matches!(sqlstate, "25006" | "40001" | "40P01")
}

impl From<tollgate::store::StoreError> for ApiError {
    fn from(e: tollgate::store::StoreError) -> Self {
        match &e {
            tollgate::store::StoreError::Database(
                sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed,
            ) => Self::unavailable(e),
            tollgate::store::StoreError::Database(sqlx::Error::Database(d))
                if d.code().is_some_and(|c| is_transient(&c)) =>
            {
                Self::unavailable(e)
            }
            _ => Self::internal(e),
        }
    }
}

impl ApiError {
    /// The body: OpenAI's error shape, with `earliest_feasible_at` when there is one.
    pub fn body(&self) -> serde_json::Value {
        let mut body = json!({
            "error": {
                "message": self.message,
                "type": self.error_type(),
                "param": self.param,
                "code": self.code,
            }
        });
        if let Some(at) = self.earliest_feasible_at {
            body["error"]["earliest_feasible_at"] = json!(at);
        }
        body
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(after) = self.retry_after {
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        response
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_server_that_cannot_serve_now_is_a_503_not_a_500() {
        for transient in ["57P01", "08006", "53300", "25006", "40001", "40P01"] {
            assert!(super::is_transient(transient), "{transient}");
        }
        for permanent in ["23505", "22P05", "42P01", "XX000"] {
            assert!(!super::is_transient(permanent), "{permanent}");
        }
    }
}
