//! The database: a URL (`DATABASE_URL` or `database.url`) or, with neither, the embedded
//! PostgreSQL under `database.embedded_dir`; connected, migrated, ready.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::config::DatabaseConfig;
use crate::embedded::{EmbeddedError, EmbeddedOptions, EmbeddedPostgres};

/// Name of the database tollgate creates inside its embedded cluster.
pub const EMBEDDED_DATABASE: &str = "tollgate";

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error(transparent)]
    Embedded(#[from] EmbeddedError),
    #[error("cannot connect to PostgreSQL at {url}: {source}")]
    Connect { url: String, source: sqlx::Error },
    #[error("migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database error: {0}")]
    Sql(#[from] sqlx::Error),
}

/// A connected, migrated database; holds the embedded server (if any) so it lives as long.
pub struct Database {
    pub pool: PgPool,
    pub embedded: Option<EmbeddedPostgres>,
    /// Where the pool connects, without credentials.
    pub display_url: String,
}

impl Database {
    /// Connects as configured (`DATABASE_URL` wins), starting the embedded server when no URL
    /// is given, and applies migrations.
    pub async fn open(config: &DatabaseConfig) -> Result<Self, DbError> {
        let url = std::env::var("DATABASE_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .or_else(|| config.url.clone());
        let (url, embedded) = match url {
            Some(url) => (url, None),
            None => {
                let server = EmbeddedPostgres::start(EmbeddedOptions {
                    data_dir: config.embedded_dir.clone(),
                    bin_dir: None,
                    port: None,
                    durable: true,
                    max_connections: 200,
                })
                .await?;
                create_database_if_missing(&server.url("postgres"), EMBEDDED_DATABASE).await?;
                (server.url(EMBEDDED_DATABASE), Some(server))
            }
        };
        let pool = connect(&url, config.max_connections).await?;
        crate::MIGRATOR.run(&pool).await?;
        Ok(Self {
            pool,
            embedded,
            display_url: redact(&url),
        })
    }

    /// Closes the pool, then stops the embedded server if this process started it.
    pub async fn close(self) -> Result<(), DbError> {
        self.pool.close().await;
        if let Some(server) = self.embedded {
            server.stop().await?;
        }
        Ok(())
    }
}

/// A connection idle longer than this is pinged before it is handed out; one used more
/// recently is handed out as it is. sqlx pings on every acquire by default: a round trip
/// before each statement's own, on every step of a synchronous request's path.
const PING_IF_IDLE: Duration = Duration::from_secs(1);

/// Every pool's options: at most `max_connections`, a caller waits up to 10 s for one, and
/// only connections idle over [`PING_IF_IDLE`] are checked first (one that died in between
/// fails its statement, which every caller already handles as a database error).
pub fn pool_options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > PING_IF_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// A pool that retries its first connection for a while: the server may be starting.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    let options: PgConnectOptions = url.parse().map_err(|source| DbError::Connect {
        url: redact(url),
        source,
    })?;
    // PostgreSQL's own plan cache (`plan_cache_mode = auto`): a statement is planned for
    // its first five runs on a connection, then its generic plan is kept when that is no
    // dearer. Batch statements pass their rows as arrays, and a generic plan assumes ten;
    // that is safe because each by-id statement reaches the jobs only through their ids
    // (`store`'s module doc): a nested loop over the ids with a primary-key probe each,
    // right at any count. Forcing custom plans instead costs PostgreSQL CPU on every
    // statement and gives the finishing statement worse joins than its generic plan
    // (measured in BENCHMARKS.md). Cached plans are rebuilt when `jobs` is analyzed, which maintenance does as soon as a fifth
    // of it changed (`store::refresh_job_statistics`).
    pool_options(max_connections)
        .connect_with(options)
        .await
        .map_err(|source| DbError::Connect {
            url: redact(url),
            source,
        })
}

/// `CREATE DATABASE name` unless it exists; `admin_url` points at an existing database.
pub async fn create_database_if_missing(admin_url: &str, name: &str) -> Result<(), DbError> {
    let pool = connect(admin_url, 1).await?;
    let exists = sqlx::query_scalar!(
        r#"SELECT 1 AS "exists!" FROM pg_database WHERE datname = $1"#,
        name
    )
    .fetch_optional(&pool)
    .await?;
    if exists.is_none() {
        // A database's name is an identifier, which no statement takes as a parameter: the
        // one statement whose text is made at run time.
        let quoted = name.replace('"', "\"\"");
        sqlx::query(&format!("CREATE DATABASE \"{quoted}\""))
            .execute(&pool)
            .await?;
    }
    pool.close().await;
    Ok(())
}

/// The same server URL with another database name (query string kept).
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let after_scheme = base.find("://").map_or(0, |i| i + 3);
    let root = match base[after_scheme..].find('/') {
        Some(i) => &base[..after_scheme + i],
        None => base,
    };
    match query {
        Some(q) => format!("{root}/{database}?{q}"),
        None => format!("{root}/{database}"),
    }
}

/// A URL without its password, for logs and messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{}@{}", &url[..scheme_end + 3], user, &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn swaps_the_database_in_a_url() {
        use super::with_database;
        assert_eq!(with_database("postgres://u@h:1/db", "x"), "postgres://u@h:1/x");
        assert_eq!(with_database("postgres://u@h:1", "x"), "postgres://u@h:1/x");
        assert_eq!(
            with_database("postgres://u@h/db?sslmode=disable", "x"),
            "postgres://u@h/x?sslmode=disable"
        );
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(super::redact("postgres://u:secret@h:5/db"), "postgres://u@h:5/db");
        assert_eq!(super::redact("postgres://u@h/db"), "postgres://u@h/db");
    }
}
