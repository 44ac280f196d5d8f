//! The control plane's rows: tenants, their API keys, provider keys added or disabled at
//! runtime and the accounts their responses named, and the version every change bumps.
//!
//! Every change runs in a transaction that first takes the control plane's lock
//! ([`lock_control`]) and ends with [`changed`], which bumps `control_version` and sends
//! NOTIFY `tollgate_control`: changes are serialized (so no two can close a loop of
//! parents between them), and every process learns of each as it commits.

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::Result;
use crate::config::ModelLimits;
pub use crate::keyring::KeyAccount;
use std::collections::BTreeMap;

use crate::tenants::{Allowance, Budget, KeyScopes, Source, TenantLimits, TenantSettings, TenantSpec};

/// Channel on which every change of the control plane is announced (payload: the version).
pub const CHANNEL_CONTROL: &str = "tollgate_control";

/// The control plane's advisory lock: "tgcp".
const CONTROL_LOCK: i64 = 0x7467_6370;

/// A tenant row.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantRecord {
    pub spec: TenantSpec,
    pub source: Source,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// An API key row (never the secret: only its digest is stored, and not read back).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRecord {
    pub id: Uuid,
    pub tenant: String,
    pub name: String,
    pub application: Option<String>,
    pub prefix: String,
    pub source: Source,
    pub limits: TenantLimits,
    pub budgets: Vec<Budget>,
    pub scopes: KeyScopes,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub last_used_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

/// A key as the directory reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct DirectoryKey {
    pub id: Uuid,
    pub tenant: String,
    pub digest: [u8; 32],
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked: bool,
    pub application: Option<String>,
    pub limits: TenantLimits,
    pub budgets: Vec<Budget>,
    pub scopes: KeyScopes,
}

/// A key to store.
#[derive(Debug, Clone)]
pub struct NewKey<'a> {
    pub id: Uuid,
    pub tenant: &'a str,
    pub name: &'a str,
    pub application: Option<&'a str>,
    pub digest: [u8; 32],
    pub prefix: &'a str,
    pub limits: &'a TenantLimits,
    pub budgets: &'a [Budget],
    pub scopes: &'a KeyScopes,
    pub expires_at: Option<DateTime<Utc>>,
}

struct TenantRow {
    name: String,
    weight: i32,
    parent: Option<String>,
    limits: Json<TenantLimits>,
    budgets: Json<Vec<Budget>>,
    applications: Json<BTreeMap<String, Allowance>>,
    settings: Json<TenantSettings>,
    source: String,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl From<TenantRow> for TenantRecord {
    fn from(r: TenantRow) -> Self {
        TenantRecord {
            spec: TenantSpec {
                name: r.name,
                weight: u32::try_from(r.weight).unwrap_or(1).max(1),
                parent: r.parent,
                limits: r.limits.0,
                budgets: r.budgets.0,
                applications: r.applications.0,
                settings: r.settings.0,
            },
            source: Source::parse(&r.source),
            created_at: r.created_at,
            updated_at: r.updated_at,
        }
    }
}

/// `sqlx::query_as!` of tenant rows: `$head`, the columns, `$tail`.
macro_rules! query_tenants {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            TenantRow,
            $head
                + r#" name, weight, parent, limits AS "limits: Json<TenantLimits>",
                      budgets AS "budgets: Json<Vec<Budget>>",
                      applications AS "applications: Json<BTreeMap<String, Allowance>>",
                      settings AS "settings: Json<TenantSettings>", source, created_at, updated_at "#
                + $tail
            $(, $arg)*
        )
    };
}

struct KeyRow {
    id: Uuid,
    tenant: String,
    name: String,
    application: Option<String>,
    prefix: String,
    source: String,
    limits: Json<TenantLimits>,
    budgets: Json<Vec<Budget>>,
    scopes: Json<KeyScopes>,
    expires_at: Option<DateTime<Utc>>,
    revoked_at: Option<DateTime<Utc>>,
    last_used_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
}

impl From<KeyRow> for KeyRecord {
    fn from(r: KeyRow) -> Self {
        KeyRecord {
            id: r.id,
            tenant: r.tenant,
            name: r.name,
            application: r.application,
            prefix: r.prefix,
            source: Source::parse(&r.source),
            limits: r.limits.0,
            budgets: r.budgets.0,
            scopes: r.scopes.0,
            expires_at: r.expires_at,
            revoked_at: r.revoked_at,
            last_used_at: r.last_used_at,
            created_at: r.created_at,
        }
    }
}

/// `sqlx::query_as!` of key rows: `$head`, the columns, `$tail`.
macro_rules! query_keys {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            KeyRow,
            $head
                + r#" id, tenant, name, application, prefix, source, limits AS "limits: Json<TenantLimits>",
                      budgets AS "budgets: Json<Vec<Budget>>", scopes AS "scopes: Json<KeyScopes>", expires_at, revoked_at,
                      last_used_at, created_at "#
                + $tail
            $(, $arg)*
        )
    };
}

/// Takes the control plane's lock for the rest of the transaction on `conn`.
pub async fn lock_control(conn: &mut PgConnection) -> Result<()> {
    sqlx::query!("SELECT pg_advisory_xact_lock($1)", CONTROL_LOCK)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Records a change: bumps the version and announces it (delivered when the transaction
/// commits). Returns the new version.
pub async fn changed(conn: &mut PgConnection) -> Result<i64> {
    Ok(sqlx::query_scalar!(
        "WITH bumped AS (UPDATE control_version SET version = version + 1 RETURNING version)
         SELECT version AS \"version!\" FROM bumped, pg_notify('tollgate_control', version::text)"
    )
    .fetch_one(&mut *conn)
    .await?)
}

/// A read-only transaction that sees one snapshot: the version read with the rows it counts.
pub async fn begin_snapshot(pool: &sqlx::PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = pool.begin().await?;
    sqlx::query!("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

/// The control plane's version now.
pub async fn control_version(ex: impl PgExecutor<'_>) -> Result<i64> {
    Ok(sqlx::query_scalar!("SELECT version FROM control_version")
        .fetch_one(ex)
        .await?)
}

/// Every tenant, by name.
pub async fn list_tenants(ex: impl PgExecutor<'_>) -> Result<Vec<TenantRecord>> {
    let rows = query_tenants!("SELECT", "FROM tenants ORDER BY name")
        .fetch_all(ex)
        .await?;
    Ok(rows.into_iter().map(Into::into).collect())
}

pub async fn get_tenant(ex: impl PgExecutor<'_>, name: &str) -> Result<Option<TenantRecord>> {
    let row = query_tenants!("SELECT", "FROM tenants WHERE name = $1", name)
        .fetch_optional(ex)
        .await?;
    Ok(row.map(Into::into))
}

/// Whether making `parent` the parent of `name` would close a loop (`name` is `parent` or
/// above it).
pub async fn would_loop(conn: &mut PgConnection, name: &str, parent: &str) -> Result<bool> {
    Ok(sqlx::query_scalar!(
        r#"WITH RECURSIVE up(name, parent) AS (
               SELECT name, parent FROM tenants WHERE name = $2
               UNION
               SELECT t.name, t.parent FROM tenants t JOIN up ON t.name = up.parent
           )
           SELECT EXISTS (SELECT 1 FROM up WHERE name = $1) AS "loops!""#,
        name,
        parent,
    )
    .fetch_one(&mut *conn)
    .await?)
}

/// Writes `spec` as tenant `spec.name`: creates it, or (when `replace`) updates it.
/// Returns the row, or `None` when it exists and `replace` is false.
pub async fn put_tenant(
    conn: &mut PgConnection,
    spec: &TenantSpec,
    source: Source,
    replace: bool,
    now: DateTime<Utc>,
) -> Result<Option<TenantRecord>> {
    let weight = i32::try_from(spec.weight).unwrap_or(i32::MAX);
    let row = query_tenants!(
        "INSERT INTO tenants AS t (name, weight, parent, limits, budgets, settings, source, created_at, updated_at,
                                   applications)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $10)
         ON CONFLICT (name) DO UPDATE SET
             weight = excluded.weight, parent = excluded.parent, limits = excluded.limits,
             budgets = excluded.budgets, applications = excluded.applications, settings = excluded.settings,
             source = excluded.source, updated_at = excluded.updated_at
         WHERE $9
         RETURNING",
        "",
        &spec.name,
        weight,
        spec.parent.as_deref(),
        Json(spec.limits) as _,
        Json(&spec.budgets) as _,
        Json(spec.settings) as _,
        source.as_str(),
        now,
        replace,
        Json(&spec.applications) as _,
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(Into::into))
}

/// Why a tenant cannot be deleted.
#[derive(Debug, Clone, PartialEq)]
pub enum Undeletable {
    /// Tenants name it as their parent.
    HasChildren(Vec<String>),
    /// It has jobs not finished.
    HasWork(i64),
}

/// Deletes tenant `name` and its keys, unless tenants name it as their parent or it has
/// jobs that are not finished. `Ok(Ok(false))`: there was no such tenant.
pub async fn delete_tenant(
    conn: &mut PgConnection,
    name: &str,
) -> Result<std::result::Result<bool, Undeletable>> {
    let children = sqlx::query_scalar!("SELECT name FROM tenants WHERE parent = $1 ORDER BY name", name)
        .fetch_all(&mut *conn)
        .await?;
    if !children.is_empty() {
        return Ok(Err(Undeletable::HasChildren(children)));
    }
    let unfinished = sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM jobs
           WHERE tenant = $1 AND state IN ('queued', 'admitted', 'running')"#,
        name
    )
    .fetch_one(&mut *conn)
    .await?;
    if unfinished > 0 {
        return Ok(Err(Undeletable::HasWork(unfinished)));
    }
    let deleted = sqlx::query!("DELETE FROM tenants WHERE name = $1", name)
        .execute(&mut *conn)
        .await?;
    Ok(Ok(deleted.rows_affected() > 0))
}

/// Stores a new key.
pub async fn insert_key(
    conn: &mut PgConnection,
    key: &NewKey<'_>,
    source: Source,
    now: DateTime<Utc>,
) -> Result<KeyRecord> {
    let row = query_keys!(
        "INSERT INTO api_keys (id, tenant, name, application, key_sha256, prefix, source, expires_at, created_at,
                               limits, budgets, scopes)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
         RETURNING",
        "",
        key.id,
        key.tenant,
        key.name,
        key.application,
        &key.digest[..],
        key.prefix,
        source.as_str(),
        key.expires_at,
        now,
        Json(key.limits) as _,
        Json(key.budgets) as _,
        Json(key.scopes) as _,
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(row.into())
}

/// The tenant of the key with this digest, revoked or not (a digest is never reused).
pub async fn key_owner(conn: &mut PgConnection, digest: &[u8; 32]) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar!("SELECT tenant FROM api_keys WHERE key_sha256 = $1", &digest[..])
            .fetch_optional(&mut *conn)
            .await?,
    )
}

/// Makes `digest` the key the config file gives `tenant`: its file key (named `config`)
/// is created, or given the new digest when the file's key changed. Returns whether
/// anything changed.
pub async fn put_file_key(
    conn: &mut PgConnection,
    tenant: &str,
    digest: &[u8; 32],
    now: DateTime<Utc>,
) -> Result<bool> {
    let updated = sqlx::query!(
        "UPDATE api_keys SET key_sha256 = $2, revoked_at = NULL
         WHERE tenant = $1 AND source = 'file' AND (key_sha256 <> $2 OR revoked_at IS NOT NULL)",
        tenant,
        &digest[..],
    )
    .execute(&mut *conn)
    .await?;
    if updated.rows_affected() > 0 {
        return Ok(true);
    }
    let inserted = sqlx::query!(
        "INSERT INTO api_keys (id, tenant, name, key_sha256, prefix, source, created_at)
         SELECT $1, $2, 'config', $3, 'config', 'file', $4
         WHERE NOT EXISTS (SELECT 1 FROM api_keys WHERE tenant = $2 AND source = 'file')",
        Uuid::now_v7(),
        tenant,
        &digest[..],
        now,
    )
    .execute(&mut *conn)
    .await?;
    Ok(inserted.rows_affected() > 0)
}

/// A tenant's keys, newest first (revoked ones too).
pub async fn list_keys(ex: impl PgExecutor<'_>, tenant: &str) -> Result<Vec<KeyRecord>> {
    let rows = query_keys!(
        "SELECT",
        "FROM api_keys WHERE tenant = $1 ORDER BY created_at DESC, id DESC",
        tenant
    )
    .fetch_all(ex)
    .await?;
    Ok(rows.into_iter().map(Into::into).collect())
}

/// Revokes `tenant`'s key `id` at `now` (a key revoked before keeps its time). Returns
/// the key, or `None` when the tenant has no such key.
pub async fn revoke_key(
    conn: &mut PgConnection,
    tenant: &str,
    id: Uuid,
    now: DateTime<Utc>,
) -> Result<Option<KeyRecord>> {
    let row = query_keys!(
        "UPDATE api_keys SET revoked_at = coalesce(revoked_at, $3) WHERE tenant = $1 AND id = $2 RETURNING",
        "",
        tenant,
        id,
        now,
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(Into::into))
}

/// Every key, for the directory (which accepts those not revoked, and keeps every key's
/// limits for the jobs it submitted).
pub async fn directory_keys(ex: impl PgExecutor<'_>) -> Result<Vec<DirectoryKey>> {
    let rows = sqlx::query!(
        r#"SELECT id, tenant, key_sha256, expires_at, revoked_at IS NOT NULL AS "revoked!", application,
                  limits AS "limits: Json<TenantLimits>", budgets AS "budgets: Json<Vec<Budget>>",
                  scopes AS "scopes: Json<KeyScopes>"
           FROM api_keys"#
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            Some(DirectoryKey {
                id: r.id,
                tenant: r.tenant,
                digest: r.key_sha256.try_into().ok()?,
                expires_at: r.expires_at,
                revoked: r.revoked,
                application: r.application,
                limits: r.limits.0,
                budgets: r.budgets.0,
                scopes: r.scopes.0,
            })
        })
        .collect())
}

/// Records when keys were last used (a key's time only moves forward).
pub async fn touch_keys(ex: impl PgExecutor<'_>, ids: &[Uuid], at: &[DateTime<Utc>]) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        "UPDATE api_keys k SET last_used_at = greatest(k.last_used_at, t.at)
         FROM unnest($1::uuid[], $2::timestamptz[]) AS t(id, at) WHERE k.id = t.id",
        ids,
        at,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// A provider key row: one added at runtime (with its sealed value), or a key of the
/// config file disabled at runtime (no value).
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderKeyRecord {
    pub provider: String,
    pub name: String,
    /// `sealed:v1:…`; `None` for a key of the config file.
    pub sealed_value: Option<String>,
    pub weight: u32,
    /// Empty: every model of its provider.
    pub models: Vec<String>,
    pub limits: Option<ModelLimits>,
    /// The account (quota pool) it was declared in.
    pub account: Option<String>,
    pub disabled_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A provider key to write (see [`put_provider_key`]).
#[derive(Debug, Clone)]
pub struct ProviderKeyWrite<'a> {
    pub provider: &'a str,
    pub name: &'a str,
    /// `None` keeps the stored value (or, for a key of the file, none).
    pub sealed_value: Option<&'a str>,
    pub weight: u32,
    pub models: &'a [String],
    pub limits: Option<&'a ModelLimits>,
    pub account: Option<&'a str>,
    pub disabled: bool,
}

struct ProviderKeyRow {
    provider: String,
    name: String,
    sealed_value: Option<String>,
    weight: i32,
    models: Option<Vec<String>>,
    limits: Option<Json<ModelLimits>>,
    account: Option<String>,
    disabled_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl From<ProviderKeyRow> for ProviderKeyRecord {
    fn from(r: ProviderKeyRow) -> Self {
        ProviderKeyRecord {
            provider: r.provider,
            name: r.name,
            sealed_value: r.sealed_value,
            weight: u32::try_from(r.weight).unwrap_or(1).max(1),
            models: r.models.unwrap_or_default(),
            limits: r.limits.map(|l| l.0),
            account: r.account,
            disabled_at: r.disabled_at,
            created_at: r.created_at,
            updated_at: r.updated_at,
        }
    }
}

/// `sqlx::query_as!` of provider key rows: `$head`, the columns, `$tail`.
macro_rules! query_provider_keys {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            ProviderKeyRow,
            $head
                + r#" provider, name, sealed_value, weight, models, limits AS "limits: Json<ModelLimits>",
                      account, disabled_at, created_at, updated_at "#
                + $tail
            $(, $arg)*
        )
    };
}

/// Every provider key row, by provider and name.
pub async fn list_provider_keys(ex: impl PgExecutor<'_>) -> Result<Vec<ProviderKeyRecord>> {
    let rows = query_provider_keys!("SELECT", "FROM provider_keys ORDER BY provider, name")
        .fetch_all(ex)
        .await?;
    Ok(rows.into_iter().map(Into::into).collect())
}

pub async fn get_provider_key(
    ex: impl PgExecutor<'_>,
    provider: &str,
    name: &str,
) -> Result<Option<ProviderKeyRecord>> {
    let row = query_provider_keys!(
        "SELECT",
        "FROM provider_keys WHERE provider = $1 AND name = $2",
        provider,
        name
    )
    .fetch_optional(ex)
    .await?;
    Ok(row.map(Into::into))
}

/// Creates or replaces provider key `provider/name` with `key` (its sealed value kept
/// when `key` gives none).
pub async fn put_provider_key(
    conn: &mut PgConnection,
    key: &ProviderKeyWrite<'_>,
    now: DateTime<Utc>,
) -> Result<ProviderKeyRecord> {
    let models = (!key.models.is_empty()).then_some(key.models);
    let row = query_provider_keys!(
        "INSERT INTO provider_keys AS p (provider, name, sealed_value, weight, models, limits, disabled_at,
                                         created_at, updated_at, account)
         VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $7 THEN $8::timestamptz END, $8, $8, $9)
         ON CONFLICT (provider, name) DO UPDATE SET
             sealed_value = coalesce(excluded.sealed_value, p.sealed_value), weight = excluded.weight,
             models = excluded.models, limits = excluded.limits, account = excluded.account,
             disabled_at = CASE WHEN $7 THEN coalesce(p.disabled_at, $8) END, updated_at = $8
         RETURNING",
        "",
        key.provider,
        key.name,
        key.sealed_value,
        i32::try_from(key.weight).unwrap_or(i32::MAX),
        models as Option<&[String]>,
        key.limits.map(Json) as _,
        key.disabled,
        now,
        key.account,
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(row.into())
}

/// Deletes provider key row `provider/name`, and the account it was seen serving under (a
/// key added again by that name may be another account's); whether there was one.
pub async fn delete_provider_key(conn: &mut PgConnection, provider: &str, name: &str) -> Result<bool> {
    sqlx::query!(
        "DELETE FROM provider_key_accounts WHERE provider = $1 AND key = $2",
        provider,
        name
    )
    .execute(&mut *conn)
    .await?;
    let deleted = sqlx::query!(
        "DELETE FROM provider_keys WHERE provider = $1 AND name = $2",
        provider,
        name
    )
    .execute(&mut *conn)
    .await?;
    Ok(deleted.rows_affected() > 0)
}

/// Every key's account as last seen.
pub async fn key_accounts(ex: impl PgExecutor<'_>) -> Result<Vec<KeyAccount>> {
    Ok(sqlx::query_as!(
        KeyAccount,
        "SELECT provider, key, account, observed_at FROM provider_key_accounts ORDER BY provider, key"
    )
    .fetch_all(ex)
    .await?)
}

/// Records the accounts keys' responses named. A key whose account changed (or is new)
/// changes the pools the gate plans with, so that is a control-plane change: every process
/// reloads its keyring. Sightings that change nothing write nothing.
pub async fn record_key_accounts(pool: &sqlx::PgPool, seen: &[KeyAccount]) -> Result<()> {
    if seen.is_empty() {
        return Ok(());
    }
    let mut tx = pool.begin().await?;
    lock_control(&mut tx).await?;
    let providers: Vec<&str> = seen.iter().map(|s| s.provider.as_str()).collect();
    let keys: Vec<&str> = seen.iter().map(|s| s.key.as_str()).collect();
    let accounts: Vec<&str> = seen.iter().map(|s| s.account.as_str()).collect();
    let at: Vec<DateTime<Utc>> = seen.iter().map(|s| s.observed_at).collect();
    let changed_rows = sqlx::query!(
        "INSERT INTO provider_key_accounts AS a (provider, key, account, observed_at)
         SELECT DISTINCT ON (p, k) p, k, acc, at
         FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[]) AS t(p, k, acc, at)
         ORDER BY p, k, at DESC
         ON CONFLICT ON CONSTRAINT provider_key_accounts_pkey DO UPDATE SET
             account = excluded.account, observed_at = excluded.observed_at
         WHERE a.account IS DISTINCT FROM excluded.account AND excluded.observed_at >= a.observed_at",
        &providers as &[&str],
        &keys as &[&str],
        &accounts as &[&str],
        &at,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if changed_rows > 0 {
        changed(&mut tx).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// A route alias added at runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRecord {
    pub alias: String,
    pub targets: Vec<String>,
    pub limits: Option<ModelLimits>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

struct RouteRow {
    alias: String,
    targets: Vec<String>,
    limits: Option<Json<ModelLimits>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl From<RouteRow> for RouteRecord {
    fn from(r: RouteRow) -> Self {
        RouteRecord {
            alias: r.alias,
            targets: r.targets,
            limits: r.limits.map(|l| l.0),
            created_at: r.created_at,
            updated_at: r.updated_at,
        }
    }
}

/// Every route added at runtime, by alias.
pub async fn list_routes(ex: impl PgExecutor<'_>) -> Result<Vec<RouteRecord>> {
    let rows = sqlx::query_as!(
        RouteRow,
        r#"SELECT alias, targets, limits AS "limits: Json<ModelLimits>", created_at, updated_at
           FROM routes ORDER BY alias"#
    )
    .fetch_all(ex)
    .await?;
    Ok(rows.into_iter().map(Into::into).collect())
}

/// Writes route `alias`: creates it, or (when `replace`) replaces it. `None` when it
/// exists and `replace` is false, or does not and `replace` is true.
pub async fn put_route(
    conn: &mut PgConnection,
    alias: &str,
    targets: &[String],
    limits: Option<&ModelLimits>,
    replace: bool,
    now: DateTime<Utc>,
) -> Result<Option<RouteRecord>> {
    let row = sqlx::query_as!(
        RouteRow,
        r#"INSERT INTO routes AS r (alias, targets, limits, created_at, updated_at)
           SELECT $1, $2, $3, $4, $4 WHERE NOT $5 OR EXISTS (SELECT 1 FROM routes WHERE alias = $1)
           ON CONFLICT (alias) DO UPDATE SET targets = excluded.targets, limits = excluded.limits,
                                             updated_at = excluded.updated_at
           WHERE $5
           RETURNING alias, targets, limits AS "limits: Json<ModelLimits>", created_at, updated_at"#,
        alias,
        targets,
        limits.map(Json) as _,
        now,
        replace,
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(Into::into))
}

/// Deletes route `alias`; whether there was one.
pub async fn delete_route(conn: &mut PgConnection, alias: &str) -> Result<bool> {
    let deleted = sqlx::query!("DELETE FROM routes WHERE alias = $1", alias)
        .execute(&mut *conn)
        .await?;
    Ok(deleted.rows_affected() > 0)
}
