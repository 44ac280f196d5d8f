//! File rows and their bytes (in ~1 MiB chunks, so uploads and downloads stream).

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use super::Result;
use crate::batches::FileRow;

/// `sqlx::query_as!` of [`FileRow`]s: the statement is `$head`, the file's columns, then
/// `$tail`.
macro_rules! query_files {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            FileRow,
            $head + " id, tenant, purpose, filename, bytes, lines, created_at, expires_at " + $tail
            $(, $arg)*
        )
    };
}

/// Creates a file row; its chunks follow, then [`set_file_size`] (same transaction).
pub async fn insert_file(ex: impl PgExecutor<'_>, f: &FileRow) -> Result<()> {
    sqlx::query!(
        "INSERT INTO files (id, tenant, purpose, filename, bytes, lines, created_at, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &f.id,
        &f.tenant,
        &f.purpose,
        &f.filename,
        f.bytes,
        f.lines,
        f.created_at,
        f.expires_at,
    )
    .execute(ex)
    .await?;
    Ok(())
}

pub async fn insert_chunk(ex: impl PgExecutor<'_>, file_id: &str, seq: i32, data: &[u8]) -> Result<()> {
    sqlx::query!(
        "INSERT INTO file_chunks (file_id, seq, data) VALUES ($1, $2, $3)",
        file_id,
        seq,
        data,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// What a tenant keeps stored: its files and their bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredFiles {
    pub files: i64,
    pub bytes: i64,
}

/// First key of the advisory locks that make a tenant's file quotas exact: "tgfq". The
/// second is the hash of the tenant.
const FILE_QUOTA_LOCKS: i32 = 0x7467_6671;

/// What `tenant` keeps stored, leaving out file `except` (an upload being checked, whose
/// row is written before its size is known).
pub async fn stored_files(
    ex: impl PgExecutor<'_>,
    tenant: &str,
    except: Option<&str>,
) -> Result<StoredFiles> {
    let row = sqlx::query!(
        r#"SELECT count(*) AS "files!", coalesce(sum(bytes), 0)::bigint AS "bytes!" FROM files
           WHERE tenant = $1 AND ($2::text IS NULL OR id <> $2)"#,
        tenant,
        except,
    )
    .fetch_one(ex)
    .await?;
    Ok(StoredFiles {
        files: row.files,
        bytes: row.bytes,
    })
}

/// Takes the lock of `tenant`'s file quotas for the rest of the transaction on `conn`.
/// An upload takes it just before it commits, then reads [`stored_files`]: two uploads
/// finishing at once are checked one after the other, so they cannot both take the last
/// room. Taken at the end, not the start, so a slow upload holds up no other.
pub async fn lock_file_quota(conn: &mut PgConnection, tenant: &str) -> Result<()> {
    sqlx::query!(
        "SELECT pg_advisory_xact_lock($1, hashtext($2))",
        FILE_QUOTA_LOCKS,
        tenant
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Records what the upload turned out to be: purpose, size, lines, expiry.
pub async fn set_file_size(ex: impl PgExecutor<'_>, f: &FileRow) -> Result<()> {
    sqlx::query!(
        "UPDATE files SET purpose = $2, bytes = $3, lines = $4, expires_at = $5 WHERE id = $1",
        &f.id,
        &f.purpose,
        f.bytes,
        f.lines,
        f.expires_at,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// A tenant's file (any tenant's for `None`: the operators'), or `None` (also when it
/// belongs to another tenant).
pub async fn get_file(ex: impl PgExecutor<'_>, tenant: Option<&str>, id: &str) -> Result<Option<FileRow>> {
    Ok(query_files!(
        "SELECT",
        "FROM files WHERE id = $1 AND ($2::text IS NULL OR tenant = $2)",
        id,
        tenant
    )
    .fetch_optional(ex)
    .await?)
}

/// A tenant's files, newest first (or oldest first with `ascending`); `after` is the last
/// id of the previous page.
pub async fn list_files(
    ex: impl PgExecutor<'_>,
    tenant: Option<&str>,
    purpose: Option<&str>,
    after: Option<&str>,
    ascending: bool,
    limit: i64,
) -> Result<Vec<FileRow>> {
    Ok(query_files!(
        "SELECT",
        "FROM files
         WHERE ($1::text IS NULL OR tenant = $1) AND ($2::text IS NULL OR purpose = $2)
           AND ($3::text IS NULL OR (CASE WHEN $4 THEN id > $3 ELSE id < $3 END))
         ORDER BY CASE WHEN $4 THEN id END ASC, id DESC
         LIMIT $5",
        tenant,
        purpose,
        after,
        ascending,
        limit,
    )
    .fetch_all(ex)
    .await?)
}

/// Deletes a tenant's file and its bytes; `false` if there was none.
pub async fn delete_file(ex: impl PgExecutor<'_>, tenant: &str, id: &str) -> Result<bool> {
    Ok(
        sqlx::query!("DELETE FROM files WHERE id = $1 AND tenant = $2", id, tenant)
            .execute(ex)
            .await?
            .rows_affected()
            > 0,
    )
}

/// Chunk `seq` of a file (0-based), or `None` past its end.
pub async fn file_chunk(ex: impl PgExecutor<'_>, file_id: &str, seq: i32) -> Result<Option<Vec<u8>>> {
    Ok(sqlx::query_scalar!(
        "SELECT data FROM file_chunks WHERE file_id = $1 AND seq = $2",
        file_id,
        seq
    )
    .fetch_optional(ex)
    .await?)
}

/// Writes `data` as a new file's chunks of `chunk_bytes`, starting at chunk `first_seq`;
/// returns the next free chunk number.
pub async fn insert_chunks(
    conn: &mut PgConnection,
    file_id: &str,
    first_seq: i32,
    data: &[u8],
    chunk_bytes: usize,
) -> Result<i32> {
    let mut seq = first_seq;
    for part in data.chunks(chunk_bytes.max(1)) {
        insert_chunk(&mut *conn, file_id, seq, part).await?;
        seq += 1;
    }
    Ok(seq)
}

/// Deletes up to `limit` files whose expiry passed; returns how many.
pub async fn prune_expired_files(ex: impl PgExecutor<'_>, now: DateTime<Utc>, limit: i64) -> Result<u64> {
    Ok(sqlx::query!(
        "DELETE FROM files WHERE id IN (
             SELECT id FROM files WHERE expires_at <= $1 ORDER BY expires_at LIMIT $2)",
        now,
        limit,
    )
    .execute(ex)
    .await?
    .rows_affected())
}
