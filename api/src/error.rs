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
}

impl ApiError {
    pub fn new(status: StatusCode, code: ApiErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    pub fn bad_request(code: ApiErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
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

impl From<tollgate::store::StoreError> for ApiError {
    fn from(e: tollgate::store::StoreError) -> Self {
        match &e {
            tollgate::store::StoreError::Database(
                sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed,
            ) => Self::unavailable(e),
            // 57P01..57P03: the server is shutting down, crashed or starting (a restart).
            tollgate::store::StoreError::Database(sqlx::Error::Database(d))
                if d.code().is_some_and(|c| c.starts_with("57P")) =>
            {
                Self::unavailable(e)
            }
            _ => Self::internal(e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.error_type(),
                "param": self.param,
                "code": self.code,
            }
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(after) = self.retry_after {
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        response
    }
}
