//! The control plane: tenants and API keys changed at runtime, in force on every process
//! within a second.
//!
//! - Changes ([`create_tenant`], [`update_tenant`], [`delete_tenant`], [`create_key`],
//!   [`revoke_key`], [`apply_seed`]) each run in one transaction under the control
//!   plane's lock: the rows, the tenant's buckets (its limits and budgets, synced as the
//!   gate reserves them) and the version bump with its NOTIFY commit together.
//! - Each process holds a [`Directory`]: the current [`TenantDirectory`], swapped whole
//!   when the version moves. [`Directory::keep_current`] reloads on the NOTIFY and, in
//!   case one was missed, checks the version every second — so a revoked key is refused
//!   everywhere within a second. It also writes the keys' `last_used_at`, gathered in
//!   memory, every few seconds: a request never waits for that write.
//! - The config file seeds the control plane ([`apply_seed`]) at start and on `SIGHUP`:
//!   it creates and updates the tenants it names (and their keys), and never deletes
//!   what the admin API created.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::buckets;
use crate::config::Config;
use crate::notify::Notifications;
use crate::store::{self, KeyRecord, NewKey, StoreError, TenantRecord, Undeletable};
use crate::tenants::{
    self, Budget, Caller, KeyEntry, KeyLimits, Seed, Source, Tenant, TenantDirectory, TenantLimits,
    TenantSpec,
};

/// How often the version is checked in case a notification was missed.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How often keys' `last_used_at` is written.
const TOUCH_EVERY: Duration = Duration::from_secs(5);

/// Why a change was refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}")]
    Invalid(#[from] tenants::InvalidTenant),
    #[error("tenant {0:?} already exists")]
    TenantExists(String),
    #[error("no tenant {0:?}")]
    NoSuchTenant(String),
    #[error("no parent tenant {0:?}")]
    NoSuchParent(String),
    #[error("tenant {tenant:?} is above {parent:?}: making it the parent would close a loop")]
    ParentLoop { tenant: String, parent: String },
    #[error("tenants {0:?} name this tenant as their parent")]
    HasChildren(Vec<String>),
    #[error("the tenant has {0} jobs not finished; cancel them or let them finish")]
    HasWork(i64),
    #[error("no key {0} of this tenant")]
    NoSuchKey(Uuid),
    #[error("the config file's key of tenant {0:?} is another tenant's key")]
    KeyTaken(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for ControlError {
    fn from(e: sqlx::Error) -> Self {
        ControlError::Store(e.into())
    }
}

/// One process's view of the control plane. Cheap to clone.
#[derive(Clone)]
pub struct Directory {
    current: Arc<RwLock<Arc<TenantDirectory>>>,
    /// Keys used since their last write, and when.
    used: Arc<Mutex<HashMap<Uuid, DateTime<Utc>>>>,
    config: Arc<Config>,
}

impl Directory {
    /// The directory as the database holds it now.
    pub async fn load(pool: &PgPool, config: Arc<Config>) -> Result<Self, ControlError> {
        let directory = read(pool, &config).await?;
        Ok(Self {
            current: Arc::new(RwLock::new(Arc::new(directory))),
            used: Arc::default(),
            config,
        })
    }

    /// A directory of the config's tenants alone, never reloaded (tests and tools that run
    /// without the control plane's rows).
    pub fn fixed(directory: TenantDirectory, config: Arc<Config>) -> Self {
        Self {
            current: Arc::new(RwLock::new(Arc::new(directory))),
            used: Arc::default(),
            config,
        }
    }

    /// The directory now. Holding it does not hold back a reload.
    pub fn current(&self) -> Arc<TenantDirectory> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// `presented_key`'s tenant at `now` (and notes the key's use).
    pub fn authenticate(&self, presented_key: &str, now: DateTime<Utc>) -> Option<Caller> {
        let found = self.current().authenticate(presented_key, now)?;
        if let Some(key) = found.key {
            self.used
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(key, now);
        }
        Some(found)
    }

    /// Reads the directory again when the control plane's version moved.
    pub async fn refresh(&self, pool: &PgPool) -> Result<(), ControlError> {
        let version = store::control_version(pool).await?;
        if version == self.current().version {
            return Ok(());
        }
        let fresh = read(pool, &self.config).await?;
        let mut current = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Two refreshes may race: the newer read stays.
        if fresh.version > current.version {
            *current = Arc::new(fresh);
        }
        Ok(())
    }

    /// Writes the uses of keys noted since the last write.
    async fn write_uses(&self, pool: &PgPool) -> Result<(), ControlError> {
        let used: Vec<(Uuid, DateTime<Utc>)> = self
            .used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain()
            .collect();
        let (ids, at): (Vec<Uuid>, Vec<DateTime<Utc>>) = used.into_iter().unzip();
        store::touch_keys(pool, &ids, &at).await?;
        Ok(())
    }

    /// Keeps the directory current until `cancel`: on every control notification, and
    /// every second in case one was missed; writes keys' uses every few seconds and at
    /// the end.
    pub async fn keep_current(self, pool: PgPool, notifications: Notifications, cancel: CancellationToken) {
        let mut check = tokio::time::interval(CHECK_EVERY);
        let mut touch = tokio::time::interval(TOUCH_EVERY);
        loop {
            let changed = notifications.control_changed();
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = changed => {}
                _ = check.tick() => {}
                _ = touch.tick() => {
                    if let Err(e) = self.write_uses(&pool).await {
                        tracing::warn!(error = %e, "could not record when keys were last used");
                    }
                    continue;
                }
            }
            if let Err(e) = self.refresh(&pool).await {
                tracing::warn!(error = %e, "could not reload the tenants and keys; keeping the last ones");
            }
        }
        if let Err(e) = self.write_uses(&pool).await {
            tracing::warn!(error = %e, "could not record when keys were last used");
        }
    }
}

/// The tenants and live keys the database holds, at its version.
async fn read(pool: &PgPool, config: &Config) -> Result<TenantDirectory, ControlError> {
    let mut tx = pool.begin().await?;
    // One snapshot: the version read with the rows it counts.
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut *tx)
        .await?;
    let version = store::control_version(&mut *tx).await?;
    let tenants = store::list_tenants(&mut *tx).await?;
    let keys = store::directory_keys(&mut *tx).await?;
    tx.commit().await?;
    let admin = tenants::admin_digest(config).unwrap_or(None);
    let tenants = tenants
        .iter()
        .map(|r| Tenant::resolve(&r.spec, &config.quotas, &config.server));
    let key_limits: Vec<(Uuid, KeyLimits)> = keys
        .iter()
        .map(|k| {
            let limits = KeyLimits {
                limits: k.limits,
                budgets: k.budgets.clone(),
            };
            (k.id, limits)
        })
        .collect();
    let live = keys.into_iter().filter(|k| !k.revoked).map(|k| {
        let entry = KeyEntry {
            id: k.id,
            tenant: k.tenant,
            expires_at: k.expires_at,
        };
        (k.digest, entry)
    });
    Ok(TenantDirectory::with_key_limits(
        tenants, live, key_limits, admin, version,
    ))
}

/// Syncs `spec`'s buckets: its limits and budgets as the gate reserves them.
async fn sync_tenant_buckets(
    conn: &mut PgConnection,
    spec: &TenantSpec,
    now: DateTime<Utc>,
) -> Result<(), ControlError> {
    let specs = buckets::limit_specs(&buckets::tenant_scope(&spec.name), &spec.limits, &spec.budgets);
    store::sync_buckets(&mut *conn, &specs, now).await?;
    Ok(())
}

/// Checks `spec`'s parent exists and is not below it.
async fn check_parent(conn: &mut PgConnection, spec: &TenantSpec) -> Result<(), ControlError> {
    let Some(parent) = &spec.parent else {
        return Ok(());
    };
    if store::get_tenant(&mut *conn, parent).await?.is_none() {
        return Err(ControlError::NoSuchParent(parent.clone()));
    }
    if store::would_loop(&mut *conn, &spec.name, parent).await? {
        return Err(ControlError::ParentLoop {
            tenant: spec.name.clone(),
            parent: parent.clone(),
        });
    }
    Ok(())
}

/// Creates tenant `spec.name`.
pub async fn create_tenant(
    pool: &PgPool,
    spec: &TenantSpec,
    now: DateTime<Utc>,
) -> Result<TenantRecord, ControlError> {
    write_tenant(pool, spec, false, now).await
}

/// Replaces tenant `spec.name` with `spec` (the caller merged what changed into it).
pub async fn update_tenant(
    pool: &PgPool,
    spec: &TenantSpec,
    now: DateTime<Utc>,
) -> Result<TenantRecord, ControlError> {
    write_tenant(pool, spec, true, now).await
}

/// Writes `spec`: a new tenant, or (`replace`) over the one of its name.
async fn write_tenant(
    pool: &PgPool,
    spec: &TenantSpec,
    replace: bool,
    now: DateTime<Utc>,
) -> Result<TenantRecord, ControlError> {
    spec.check()?;
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    let exists = store::get_tenant(&mut *tx, &spec.name).await?.is_some();
    match (replace, exists) {
        (true, false) => return Err(ControlError::NoSuchTenant(spec.name.clone())),
        (false, true) => return Err(ControlError::TenantExists(spec.name.clone())),
        _ => {}
    }
    check_parent(&mut tx, spec).await?;
    let record = store::put_tenant(&mut tx, spec, Source::Api, replace, now)
        .await?
        .ok_or_else(|| ControlError::TenantExists(spec.name.clone()))?;
    sync_tenant_buckets(&mut tx, spec, now).await?;
    store::changed(&mut tx).await?;
    tx.commit().await?;
    Ok(record)
}

/// Deletes tenant `name` and its keys (refused while tenants name it as their parent or
/// it has jobs not finished).
pub async fn delete_tenant(pool: &PgPool, name: &str) -> Result<(), ControlError> {
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    match store::delete_tenant(&mut tx, name).await? {
        Ok(true) => {}
        Ok(false) => return Err(ControlError::NoSuchTenant(name.to_owned())),
        Err(Undeletable::HasChildren(children)) => return Err(ControlError::HasChildren(children)),
        Err(Undeletable::HasWork(n)) => return Err(ControlError::HasWork(n)),
    }
    store::changed(&mut tx).await?;
    tx.commit().await?;
    Ok(())
}

/// A key to create: everything but the secret, which [`create_key`] makes.
#[derive(Debug, Clone, Default)]
pub struct KeyRequest {
    pub name: String,
    pub application: Option<String>,
    pub expires_at: Option<DateTime<Utc>>,
    /// Its own limits and budgets, on top of its tenant's.
    pub limits: TenantLimits,
    pub budgets: Vec<Budget>,
}

/// Creates a key for `tenant`: its row and its secret, which is returned this once and
/// stored only as its SHA-256.
pub async fn create_key(
    pool: &PgPool,
    tenant: &str,
    request: &KeyRequest,
    now: DateTime<Utc>,
) -> Result<(KeyRecord, String), ControlError> {
    for (field, value) in [
        ("name", Some(&request.name)),
        ("application", request.application.as_ref()),
    ] {
        if value.is_some_and(|v| !tenants::valid_name(v)) {
            return Err(tenants::InvalidTenant {
                field: field.to_owned(),
                reason: tenants::name_rule(),
            }
            .into());
        }
    }
    tenants::check_limits(&request.limits, &request.budgets)?;
    let secret = tenants::new_secret();
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    if store::get_tenant(&mut *tx, tenant).await?.is_none() {
        return Err(ControlError::NoSuchTenant(tenant.to_owned()));
    }
    let key = NewKey {
        id: Uuid::now_v7(),
        tenant,
        name: &request.name,
        application: request.application.as_deref(),
        digest: tenants::digest(&secret),
        prefix: &tenants::key_prefix(&secret),
        limits: &request.limits,
        budgets: &request.budgets,
        expires_at: request.expires_at,
    };
    let record = store::insert_key(&mut tx, &key, Source::Api, now).await?;
    let specs = buckets::limit_specs(&buckets::api_key_scope(key.id), &request.limits, &request.budgets);
    store::sync_buckets(&mut *tx, &specs, now).await?;
    store::changed(&mut tx).await?;
    tx.commit().await?;
    Ok((record, secret))
}

/// Revokes `tenant`'s key `id`: refused by every process within a second.
pub async fn revoke_key(
    pool: &PgPool,
    tenant: &str,
    id: Uuid,
    now: DateTime<Utc>,
) -> Result<KeyRecord, ControlError> {
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    let record = store::revoke_key(&mut tx, tenant, id, now)
        .await?
        .ok_or(ControlError::NoSuchKey(id))?;
    store::changed(&mut tx).await?;
    tx.commit().await?;
    Ok(record)
}

/// What applying a seed changed: tenants created, tenants updated, keys set.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Applied {
    pub created: Vec<String>,
    pub updated: Vec<String>,
    pub keys: Vec<String>,
}

/// Applies the config file's tenants and keys: creates the tenants it names that are not
/// there, updates those that differ, gives each its file key. Tenants it does not name
/// are left as they are. Parents are written before their children.
pub async fn apply_seed(pool: &PgPool, seed: &Seed, now: DateTime<Utc>) -> Result<Applied, ControlError> {
    let mut applied = Applied::default();
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    for spec in parents_first(&seed.tenants) {
        spec.check()?;
        let before = store::get_tenant(&mut *tx, &spec.name).await?;
        if before
            .as_ref()
            .is_some_and(|b| b.spec == *spec && b.source == Source::File)
        {
            continue;
        }
        check_parent(&mut tx, spec).await?;
        store::put_tenant(&mut tx, spec, Source::File, true, now).await?;
        sync_tenant_buckets(&mut tx, spec, now).await?;
        match before {
            Some(_) => applied.updated.push(spec.name.clone()),
            None => applied.created.push(spec.name.clone()),
        }
    }
    for (tenant, digest) in &seed.keys {
        match store::key_owner(&mut tx, digest).await? {
            Some(owner) if owner != *tenant => return Err(ControlError::KeyTaken(tenant.clone())),
            _ => {}
        }
        if store::put_file_key(&mut tx, tenant, digest, now).await? {
            applied.keys.push(tenant.clone());
        }
    }
    if applied != Applied::default() {
        store::changed(&mut tx).await?;
    }
    tx.commit().await?;
    Ok(applied)
}

/// `specs` ordered so that a parent comes before its children.
fn parents_first(specs: &[TenantSpec]) -> Vec<&TenantSpec> {
    let mut out: Vec<&TenantSpec> = Vec::with_capacity(specs.len());
    let mut left: Vec<&TenantSpec> = specs.iter().collect();
    while !left.is_empty() {
        let (ready, waiting): (Vec<&TenantSpec>, Vec<&TenantSpec>) = left.iter().partition(|s| {
            s.parent
                .as_deref()
                .is_none_or(|p| out.iter().any(|o| o.name == p) || !specs.iter().any(|o| o.name == p))
        });
        if ready.is_empty() {
            // A loop: written as given, the store's check refuses it.
            out.extend(waiting);
            break;
        }
        out.extend(ready);
        left = waiting;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::{TenantLimits, TenantSettings};

    fn spec(name: &str, parent: Option<&str>) -> TenantSpec {
        TenantSpec {
            name: name.to_owned(),
            weight: 1,
            parent: parent.map(str::to_owned),
            limits: TenantLimits::default(),
            budgets: Vec::new(),
            settings: TenantSettings::default(),
        }
    }

    #[test]
    fn parents_are_written_before_their_children() {
        let specs = [
            spec("team", Some("unit")),
            spec("unit", Some("partner")),
            spec("partner", None),
            spec("solo", Some("elsewhere")),
        ];
        let order: Vec<&str> = parents_first(&specs).iter().map(|s| s.name.as_str()).collect();
        assert_eq!(order, ["partner", "solo", "unit", "team"]);
    }
}
