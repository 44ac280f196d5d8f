//! The Files API, as OpenAI's: `POST /v1/files` (multipart `file` + `purpose=batch`),
//! `GET /v1/files`, `GET /v1/files/{id}`, `GET /v1/files/{id}/content`,
//! `DELETE /v1/files/{id}`. Uploads stream into ~1 MiB chunks inside one transaction,
//! counting bytes and lines as they arrive, so a file over `batches.max_file_bytes` or
//! `batches.max_lines` is refused as soon as it crosses the limit without being held in
//! memory; downloads stream chunk by chunk.
//!
//! Each tenant's storage is bounded by its quotas (`quotas.max_files`,
//! `quotas.max_stored_file_bytes`, or its own): checked before an upload is read, as its
//! bytes arrive, and once more under the tenant's quota lock just before it commits, so
//! uploads racing for the last room cannot both get it.

use axum::Json;
use axum::body::Body;
use axum::extract::multipart::{Field, MultipartError, MultipartRejection};
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SubsecRound, Utc};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgConnection;
use tollgate::batches::{FileRow, PURPOSE_BATCH, new_file_id};
use tollgate::config::Quotas;
use tollgate::store::{self, StoreError, StoredFiles};
use tollgate::vocab::ApiErrorCode;
use tollgate_workers::batches::FILE_CHUNK_BYTES;

use crate::AppState;
use crate::auth::{AuthTenant, Viewer};
use crate::error::ApiError;
use crate::openapi as doc;
use crate::paging;

/// Shortest and longest `expires_after[seconds]` OpenAI accepts (1 hour to 30 days).
pub(crate) const EXPIRES_AFTER_RANGE: std::ops::RangeInclusive<i64> = 3600..=2_592_000;

/// A database error as an API error.
pub(crate) fn db(e: sqlx::Error) -> ApiError {
    ApiError::from(StoreError::from(e))
}

/// Unix seconds, as OpenAI's objects carry time.
pub(crate) fn unix(t: DateTime<Utc>) -> i64 {
    t.timestamp()
}

/// The file as clients see it (OpenAI's file object).
pub(crate) fn file_view(f: &FileRow) -> Value {
    json!({
        "id": f.id,
        "object": "file",
        "tenant": f.tenant,
        "bytes": f.bytes,
        "created_at": unix(f.created_at),
        "expires_at": f.expires_at.map(unix),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": null,
    })
}

fn multipart_error(e: MultipartError) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large_error();
    }
    ApiError::bad_request(
        ApiErrorCode::InvalidMultipart,
        format!("the multipart body is malformed: {}", e.body_text()),
    )
}

fn too_large_error() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        ApiErrorCode::FileTooLarge,
        "the file is larger than the server accepts (batches.max_file_bytes)",
    )
    .with_param("file")
}

/// 429 `quota_exceeded`, `param` naming the quota.
fn quota_exceeded(quota: &'static str, message: String) -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        ApiErrorCode::QuotaExceeded,
        message,
    )
    .with_param(quota)
}

/// Refuses an upload of `bytes` that would take the tenant, keeping `stored` besides it,
/// past one of its quotas.
fn check_quotas(quotas: &Quotas, stored: StoredFiles, bytes: u64) -> Result<(), ApiError> {
    let files = u64::try_from(stored.files).unwrap_or(0);
    if files >= quotas.max_files {
        return Err(quota_exceeded(
            "max_files",
            format!(
                "the tenant keeps {files} files, its quota (quotas.max_files is {}): delete files, or wait for them to expire, before uploading more",
                quotas.max_files
            ),
        ));
    }
    let kept = u64::try_from(stored.bytes).unwrap_or(0);
    if kept.saturating_add(bytes) > quotas.max_stored_file_bytes {
        return Err(quota_exceeded(
            "max_stored_file_bytes",
            format!(
                "the tenant's files hold {kept} bytes; with this upload they would pass its quota of {} (quotas.max_stored_file_bytes): delete files before uploading more",
                quotas.max_stored_file_bytes
            ),
        ));
    }
    Ok(())
}

/// Counts bytes and non-blank lines of a stream, enforcing the limits as it goes.
pub(crate) struct Counter {
    bytes: u64,
    lines: u64,
    line_has_content: bool,
    max_bytes: u64,
    max_lines: u64,
    /// The tenant's quotas, and what it kept stored when the upload began: an upload
    /// crossing them is refused as it does, not after it was all read.
    quotas: Quotas,
    stored: StoredFiles,
}

impl Counter {
    /// A count from zero, refusing more than `max_bytes` or `max_lines`, or what would
    /// take the tenant, keeping `stored`, past its `quotas`.
    pub(crate) fn new(max_bytes: u64, max_lines: u64, quotas: Quotas, stored: StoredFiles) -> Self {
        Self {
            bytes: 0,
            lines: 0,
            line_has_content: false,
            max_bytes,
            max_lines,
            quotas,
            stored,
        }
    }

    /// Bytes and non-blank lines counted so far.
    pub(crate) fn counted(&self) -> (u64, u64) {
        (self.bytes, self.lines)
    }

    fn feed(&mut self, data: &[u8]) -> Result<(), ApiError> {
        self.bytes += data.len() as u64;
        if self.bytes > self.max_bytes {
            return Err(too_large_error());
        }
        check_quotas(&self.quotas, self.stored, self.bytes)?;
        for &b in data {
            if b == b'\n' {
                self.lines += u64::from(self.line_has_content);
                self.line_has_content = false;
            } else if !b.is_ascii_whitespace() {
                self.line_has_content = true;
            }
        }
        self.check_lines()
    }

    fn finish(&mut self) -> Result<(), ApiError> {
        self.lines += u64::from(std::mem::take(&mut self.line_has_content));
        self.check_lines()
    }

    fn check_lines(&self) -> Result<(), ApiError> {
        if self.lines > self.max_lines {
            return Err(ApiError::bad_request(
                ApiErrorCode::TooManyLines,
                format!(
                    "the file has more than {} lines (batches.max_lines)",
                    self.max_lines
                ),
            )
            .with_param("file"));
        }
        Ok(())
    }
}

/// Largest value of a field other than `file` (`purpose`, `expires_after[seconds]`, or
/// one tollgate ignores): they are short words and numbers.
pub(crate) const MAX_TEXT_FIELD_BYTES: usize = 1024;
/// Most fields in one upload.
pub(crate) const MAX_FIELDS: usize = 16;

/// Where the `file` field's bytes go as they arrive, counted and within the limits: the
/// upload's chunks in the database ([`Chunks`]), or memory for the fuzz body.
pub(crate) trait FileSink {
    /// The `file` field begins; `filename` is the name it is stored under.
    fn begin(&mut self, filename: String);
    /// The field's next bytes.
    async fn write(&mut self, data: &[u8]) -> Result<(), ApiError>;
    /// The field ended.
    async fn finish(&mut self) -> Result<(), ApiError>;
}

/// The `file` field stored as chunks of `row.id`. The transaction that writes them is
/// opened only when the first chunk is full (or the field ends): an upload that stalls
/// before sending a chunk's worth holds memory for at most that chunk, and no database
/// connection.
struct Chunks<'p> {
    pool: &'p sqlx::PgPool,
    row: FileRow,
    buf: Vec<u8>,
    seq: i32,
    tx: Option<sqlx::Transaction<'p, sqlx::Postgres>>,
}

impl Chunks<'_> {
    /// Writes what is buffered, as chunks from `self.seq` on.
    async fn flush(&mut self) -> Result<(), ApiError> {
        let conn = open_file(self.pool, &self.row, &mut self.tx).await?;
        self.seq = store::insert_chunks(conn, &self.row.id, self.seq, &self.buf, FILE_CHUNK_BYTES).await?;
        self.buf.clear();
        Ok(())
    }
}

/// The upload's transaction, begun (with the file's row written) on first use.
async fn open_file<'t, 'p>(
    pool: &'p sqlx::PgPool,
    file: &FileRow,
    tx: &'t mut Option<sqlx::Transaction<'p, sqlx::Postgres>>,
) -> Result<&'t mut PgConnection, ApiError> {
    if tx.is_none() {
        let mut begun = pool.begin().await.map_err(db)?;
        store::insert_file(&mut *begun, file).await?;
        *tx = Some(begun);
    }
    match tx {
        Some(tx) => Ok(&mut **tx),
        None => Err(ApiError::internal("the upload's transaction was not opened")),
    }
}

impl FileSink for Chunks<'_> {
    fn begin(&mut self, filename: String) {
        self.row.filename = filename;
        self.buf.reserve(FILE_CHUNK_BYTES);
    }

    async fn write(&mut self, data: &[u8]) -> Result<(), ApiError> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= FILE_CHUNK_BYTES {
            self.flush().await?;
        }
        Ok(())
    }

    async fn finish(&mut self) -> Result<(), ApiError> {
        self.flush().await
    }
}

/// What an upload's form said besides its file.
#[derive(Debug, Default)]
pub(crate) struct Form {
    pub(crate) purpose: Option<String>,
    pub(crate) expires_secs: Option<i64>,
    /// The `file` field came (and went to the sink whole).
    pub(crate) file: bool,
}

/// Reads an upload's fields: at most [`MAX_FIELDS`]; `purpose`, `expires_after[seconds]`
/// and any other short field up to [`MAX_TEXT_FIELD_BYTES`]; one `file`, whose bytes go
/// to `sink` as they arrive, counted by `counter`, so a file crossing a limit is refused
/// as it does.
pub(crate) async fn read_form(
    multipart: &mut Multipart,
    counter: &mut Counter,
    sink: &mut impl FileSink,
) -> Result<Form, ApiError> {
    let mut form = Form::default();
    let mut fields = 0;
    while let Some(mut field) = multipart.next_field().await.map_err(multipart_error)? {
        fields += 1;
        if fields > MAX_FIELDS {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidMultipart,
                format!(
                    "an upload has at most {MAX_FIELDS} fields: `file`, `purpose`, `expires_after[seconds]`"
                ),
            ));
        }
        match field.name().unwrap_or_default() {
            "purpose" => form.purpose = Some(text_field(field).await?),
            "expires_after[seconds]" => {
                let text = text_field(field).await?;
                form.expires_secs = Some(
                    text.trim()
                        .parse::<i64>()
                        .ok()
                        .filter(|s| EXPIRES_AFTER_RANGE.contains(s))
                        .ok_or_else(|| {
                            ApiError::bad_request(
                                ApiErrorCode::InvalidRequest,
                                "`expires_after[seconds]` must be 3600 to 2592000",
                            )
                            .with_param("expires_after")
                        })?,
                );
            }
            "file" if !form.file => {
                form.file = true;
                sink.begin(
                    field
                        .file_name()
                        .unwrap_or("upload.jsonl")
                        .chars()
                        .filter(|c| *c != tollgate::sanitize::NUL)
                        .take(255)
                        .collect(),
                );
                while let Some(data) = field.chunk().await.map_err(multipart_error)? {
                    counter.feed(&data)?;
                    sink.write(&data).await?;
                }
                counter.finish()?;
                sink.finish().await?;
            }
            "file" => {
                return Err(
                    ApiError::bad_request(ApiErrorCode::InvalidRequest, "send exactly one `file`")
                        .with_param("file"),
                );
            }
            // Read (bounded) and dropped: OpenAI's clients send none, others may.
            _ => drop(text_field(field).await?),
        }
    }
    Ok(form)
}

/// A short field's text, refused past [`MAX_TEXT_FIELD_BYTES`] without reading further.
async fn text_field(mut field: Field<'_>) -> Result<String, ApiError> {
    let name = field.name().unwrap_or_default().to_owned();
    let mut bytes = Vec::new();
    while let Some(data) = field.chunk().await.map_err(multipart_error)? {
        if bytes.len() + data.len() > MAX_TEXT_FIELD_BYTES {
            return Err(ApiError::bad_request(
                ApiErrorCode::InvalidMultipart,
                format!("the field {name:?} is longer than {MAX_TEXT_FIELD_BYTES} bytes"),
            ));
        }
        bytes.extend_from_slice(&data);
    }
    String::from_utf8(bytes).map_err(|_| {
        ApiError::bad_request(
            ApiErrorCode::InvalidMultipart,
            format!("the field {name:?} is not UTF-8 text"),
        )
    })
}

/// `POST /v1/files`.
#[utoipa::path(
    post,
    path = "/v1/files",
    operation_id = "upload_file",
    tag = "files",
    request_body(content = Object, content_type = "multipart/form-data", description = "`file` (JSONL) and `purpose=batch`; optional `expires_after[seconds]`"),
    responses(
        (status = 200, description = "OpenAI's file object", body = Object),
        (status = 400, description = "`invalid_request`, `invalid_file_purpose`, `empty_file`, `too_many_lines`", body = doc::ErrorBody),
        (status = 413, description = "`file_too_large`", body = doc::ErrorBody),
        (status = 429, description = "`quota_exceeded`: `param` names the quota (`max_files`, `max_stored_file_bytes`)", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn upload(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Json<Value>, ApiError> {
    let mut multipart = multipart.map_err(|e| {
        ApiError::bad_request(
            ApiErrorCode::InvalidMultipart,
            format!("send the file as multipart/form-data: {}", e.body_text()),
        )
    })?;
    let limits = &state.config.batches;
    let now = Utc::now().trunc_subsecs(6);
    // Refused before a byte is read when the tenant is at its quotas already.
    let stored = store::stored_files(&state.pool, &tenant.name, None).await?;
    check_quotas(&tenant.quotas, stored, 0)?;
    let mut counter = Counter::new(limits.max_file_bytes, limits.max_lines, tenant.quotas, stored);
    let mut chunks = Chunks {
        pool: &state.pool,
        row: FileRow {
            id: new_file_id(),
            tenant: tenant.name.clone(),
            purpose: String::new(),
            filename: String::new(),
            bytes: 0,
            lines: 0,
            created_at: now,
            expires_at: None,
        },
        buf: Vec::new(),
        seq: 0,
        tx: None,
    };
    let form = read_form(&mut multipart, &mut counter, &mut chunks).await?;
    let purpose = form.purpose.ok_or_else(|| {
        ApiError::bad_request(ApiErrorCode::MissingField, "`purpose` is required").with_param("purpose")
    })?;
    if purpose != PURPOSE_BATCH {
        return Err(ApiError::bad_request(
            ApiErrorCode::InvalidPurpose,
            format!("purpose {purpose:?} is not supported here; use \"batch\""),
        )
        .with_param("purpose"));
    }
    let (Some(mut tx), mut row) = (chunks.tx, chunks.row) else {
        return Err(
            ApiError::bad_request(ApiErrorCode::MissingField, "`file` is required").with_param("file"),
        );
    };
    row.purpose = purpose;
    let (bytes, lines) = counter.counted();
    row.bytes = bytes as i64;
    row.lines = lines as i64;
    let keep = form
        .expires_secs
        .unwrap_or(limits.file_expires_secs.min(i64::MAX as u64) as i64);
    row.expires_at = Some(now + chrono::Duration::seconds(keep));
    // Checked again with the quota lock held until the commit: what others stored while
    // this upload streamed counts too. Refused, the transaction rolls back: no row, no
    // chunk is kept.
    store::lock_file_quota(&mut tx, &tenant.name).await?;
    let stored = store::stored_files(&mut *tx, &tenant.name, Some(&row.id)).await?;
    check_quotas(&tenant.quotas, stored, bytes)?;
    store::set_file_size(&mut *tx, &row).await?;
    tx.commit().await.map_err(db)?;
    Ok(Json(file_view(&row)))
}

/// A tenant's file (any tenant's for `None`: the operators').
async fn tenant_file(state: &AppState, tenant: Option<&str>, id: &str) -> Result<FileRow, ApiError> {
    store::get_file(&state.pool, tenant, id)
        .await?
        .ok_or_else(|| ApiError::not_found("file"))
}

/// `GET /v1/files/{id}`.
#[utoipa::path(
    get,
    path = "/v1/files/{id}",
    operation_id = "get_file",
    tag = "files",
    params(("id" = String, Path, description = "File id")),
    responses(
        (status = 200, description = "OpenAI's file object", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn get(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(file_view(&tenant_file(&state, viewer.tenant(), &id).await?)))
}

/// `DELETE /v1/files/{id}`.
#[utoipa::path(
    delete,
    path = "/v1/files/{id}",
    operation_id = "delete_file",
    tag = "files",
    params(("id" = String, Path, description = "File id")),
    responses(
        (status = 200, description = "`{id, object: \"file\", deleted: true}`", body = Object),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn delete(
    State(state): State<AppState>,
    AuthTenant(tenant): AuthTenant,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if !store::delete_file(&state.pool, &tenant.name, &id).await? {
        return Err(ApiError::not_found("file"));
    }
    Ok(Json(json!({"id": id, "object": "file", "deleted": true})))
}

/// `GET /v1/files/{id}/content`: the bytes, streamed chunk by chunk.
#[utoipa::path(
    get,
    path = "/v1/files/{id}/content",
    operation_id = "get_file_content",
    tag = "files",
    params(("id" = String, Path, description = "File id")),
    responses(
        (status = 200, description = "The file's bytes (JSONL)", content_type = "application/octet-stream", body = String),
        (status = 404, description = "`not_found`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn content(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let file = tenant_file(&state, viewer.tenant(), &id).await?;
    let pool = state.pool.clone();
    let chunks = futures::stream::unfold(Some(0i32), move |seq| {
        let (pool, id) = (pool.clone(), file.id.clone());
        async move {
            let seq = seq?;
            match store::file_chunk(&pool, &id, seq).await {
                Ok(Some(data)) => Some((Ok(data), Some(seq + 1))),
                Ok(None) => None,
                Err(e) => {
                    tracing::error!(error = %e, file = %id, "reading a file chunk failed");
                    Some((Err(std::io::Error::other("reading the file failed")), None))
                }
            }
        }
    });
    let mut response = Body::from_stream(chunks).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    Ok(response)
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListParams {
    purpose: Option<String>,
    limit: Option<i64>,
    order: Option<String>,
    after: Option<String>,
}

/// `GET /v1/files?purpose=&limit=&order=&after=`.
#[utoipa::path(
    get,
    path = "/v1/files",
    operation_id = "list_files",
    tag = "files",
    params(
        ("purpose" = Option<String>, Query, description = "Only files of this purpose"),
        ("limit" = Option<i64>, Query, description = "Page size"),
        ("order" = Option<String>, Query, description = "`asc` or `desc` (default)"),
        ("after" = Option<String>, Query, description = "The previous page's last id"),
    ),
    responses(
        (status = 200, description = "`{object: \"list\", data, first_id, last_id, has_more}`", body = Object),
        (status = 400, description = "`invalid_request`", body = doc::ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    viewer: Viewer,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let params = paging::params(params)?;
    let limit = paging::limit(params.limit, 10_000, 10_000)?;
    let ascending = match params.order.as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(_) => {
            return Err(
                ApiError::bad_request(ApiErrorCode::InvalidRequest, "`order` must be asc or desc")
                    .with_param("order"),
            );
        }
    };
    let files = store::list_files(
        &state.pool,
        viewer.tenant(),
        params.purpose.as_deref(),
        params.after.as_deref(),
        ascending,
        limit + 1,
    )
    .await?;
    Ok(Json(paging::page(files, limit, |f| f.id.clone(), file_view)))
}
