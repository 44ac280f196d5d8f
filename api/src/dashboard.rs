//! `GET /dashboard`: the console, served by tollgate itself. Plain HTML, CSS and JS embedded
//! in the binary (`api/assets/`) with uPlot for the charts (vendored, MIT, its licence
//! beside it), no external service, CDN or build step. The page talks to the public API
//! only, with the key given in its URL fragment (`/dashboard#key=…`, never sent to the
//! server) or typed into its form: the overview (`/v1/status` every second, the history
//! from `/v1/status/history`), jobs (filters, search, a job's page with its attempts,
//! cancel, retry), batches (progress, cost, pause, resume, cancel, outputs), and for the
//! admin key tenants, keys, pauses and provider keys. A tenant key sees its own. The page
//! itself holds no data.

use axum::http::header;
use axum::response::IntoResponse;

const HTML: &str = include_str!("../assets/dashboard.html");
const JS: &str = include_str!("../assets/dashboard.js");
const CSS: &str = include_str!("../assets/dashboard.css");
const UPLOT_JS: &str = include_str!("../assets/vendor/uplot/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/vendor/uplot/uPlot.min.css");

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

/// uPlot, the charting library (MIT; `api/assets/vendor/uplot/LICENSE`).
#[utoipa::path(
    get,
    path = "/dashboard/vendor/uplot.js",
    operation_id = "dashboard_chart_script",
    tag = "operations",
    responses((status = 200, description = "JavaScript", content_type = "text/javascript", body = String))
)]
pub(crate) async fn chart_script() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        UPLOT_JS,
    )
}

/// uPlot's style sheet.
#[utoipa::path(
    get,
    path = "/dashboard/vendor/uplot.css",
    operation_id = "dashboard_chart_style",
    tag = "operations",
    responses((status = 200, description = "CSS", content_type = "text/css", body = String))
)]
pub(crate) async fn chart_style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], UPLOT_CSS)
}
