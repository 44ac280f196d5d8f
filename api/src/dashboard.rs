//! `GET /dashboard`: a live page served by tollgate itself. Plain HTML, CSS and JS embedded
//! in the binary (`api/assets/`), no external service, CDN or build step. The page polls
//! `/v1/status` and `/v1/status/history` every second with the key given in its URL
//! fragment (`/dashboard#key=…`, never sent to the server) or typed into its form: the
//! admin key shows every tenant, a tenant key its own. The page itself holds no data.

use axum::http::header;
use axum::response::IntoResponse;

const HTML: &str = include_str!("../assets/dashboard.html");
const JS: &str = include_str!("../assets/dashboard.js");
const CSS: &str = include_str!("../assets/dashboard.css");

/// The dashboard page.
/// The page loads its own script and stylesheet and talks to this server only; nothing
/// inline runs, nobody frames it. (Inline `style` attributes are allowed: the bars and
/// chart labels set their width and colour that way.)
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

#[utoipa::path(
    get,
    path = "/dashboard",
    operation_id = "dashboard",
    tag = "operations",
    responses((status = 200, description = "The dashboard (HTML); open as `/dashboard#key=<API key>`", content_type = "text/html", body = String))
)]
pub(crate) async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
        ],
        HTML,
    )
}

/// The dashboard's script.
#[utoipa::path(
    get,
    path = "/dashboard/app.js",
    operation_id = "dashboard_script",
    tag = "operations",
    responses((status = 200, description = "JavaScript", content_type = "text/javascript", body = String))
)]
pub(crate) async fn script() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], JS)
}

/// The dashboard's style sheet.
#[utoipa::path(
    get,
    path = "/dashboard/style.css",
    operation_id = "dashboard_style",
    tag = "operations",
    responses((status = 200, description = "CSS", content_type = "text/css", body = String))
)]
pub(crate) async fn style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], CSS)
}
