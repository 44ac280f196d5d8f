//! What both APIs' replies share: a JSON body or an event stream, over the headers each API
//! sets itself (its request id, its rate-limit headers as of the admission).

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde::Serialize;

use super::buckets::LimitsView;

/// A bare response: status, body, content type; each API adds its own headers.
pub(super) fn base(status: StatusCode, body: Body, content_type: &'static str) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert("content-type", HeaderValue::from_static(content_type));
    resp
}

pub(super) trait Respond {
    /// A response with this API's headers.
    fn respond(
        &self,
        status: StatusCode,
        body: Body,
        content_type: &'static str,
        view: Option<&LimitsView>,
    ) -> Response;

    fn json<T: Serialize>(&self, status: StatusCode, body: &T, view: Option<&LimitsView>) -> Response {
        let (status, bytes) = match serde_json::to_vec(body) {
            Ok(b) => (status, b),
            Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, Vec::new()),
        };
        self.respond(status, Body::from(bytes), "application/json", view)
    }

    /// A 200 `text/event-stream` response with the usual headers (rate limits as of the
    /// admission).
    fn stream(&self, body: Body, view: &LimitsView) -> Response {
        let mut resp = self.respond(StatusCode::OK, body, "text/event-stream", Some(view));
        resp.headers_mut()
            .insert("cache-control", HeaderValue::from_static("no-cache"));
        resp
    }
}
