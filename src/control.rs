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
//! - Provider keys ([`add_provider_key`], [`change_provider_key`],
//!   [`remove_provider_key`]): added at runtime (sealed with the server's secret key,
//!   `webhook_secrets`), rotated, disabled and enabled (the file's too); each process's
//!   [`Keyring`] is swapped with its directory. The account each key's responses named
//!   (its quota pool, `store::record_key_accounts`) is part of it: a key seen under a new
//!   account is a change like the others.
//! - Routes ([`put_route`], [`remove_route`]): aliases added at runtime,
//!   in force through [`Directory::config`], the file's configuration with them.
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
use crate::config::{Config, ModelLimits, ProviderConfig, RouteConfig};
use crate::keyring::{Keyring, KeyringEntry};
use crate::notify::Notifications;
use crate::store::ProviderKeyRecord;
use crate::store::{self, KeyRecord, NewKey, StoreError, TenantRecord, Undeletable};
use crate::tenants::{
    self, Budget, Caller, KeyEntry, KeyLimits, KeyScopes, Seed, Source, Tenant, TenantDirectory,
    TenantLimits, TenantSpec,
};
use crate::webhook_secrets::provider_key_context;

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
    #[error("provider {0:?} has a key {1:?} already")]
    ProviderKeyExists(String, String),
    #[error("provider {0:?} has no key {1:?}")]
    NoSuchProviderKey(String, String),
    #[error("provider keys are sealed with the server's secret key, which is not available: {0}")]
    Sealing(String),
    #[error("a route {0:?} exists already")]
    RouteExists(String),
    #[error("no route {0:?} was added at runtime")]
    NoSuchRoute(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for ControlError {
    fn from(e: sqlx::Error) -> Self {
        ControlError::Store(e.into())
    }
}

/// What a process holds of the control plane at one version.
#[derive(Clone)]
pub struct Snapshot {
    pub tenants: Arc<TenantDirectory>,
    pub keyring: Arc<Keyring>,
    /// The config file's, with the routes added at runtime.
    pub config: Arc<Config>,
}

/// One process's view of the control plane. Cheap to clone.
#[derive(Clone)]
pub struct Directory {
    current: Arc<RwLock<Snapshot>>,
    /// Keys used since their last write, and when.
    used: Arc<Mutex<HashMap<Uuid, DateTime<Utc>>>>,
    config: Arc<Config>,
}

impl Directory {
    /// The directory as the database holds it now.
    pub async fn load(pool: &PgPool, config: Arc<Config>) -> Result<Self, ControlError> {
        let snapshot = read(pool, &config).await?;
        Ok(Self {
            current: Arc::new(RwLock::new(snapshot)),
            used: Arc::default(),
            config,
        })
    }

    /// A directory of the config's tenants alone, never reloaded (tests and tools that run
    /// without the control plane's rows).
    pub fn fixed(directory: TenantDirectory, config: Arc<Config>) -> Self {
        let snapshot = Snapshot {
            tenants: Arc::new(directory),
            keyring: Arc::default(),
            config: config.clone(),
        };
        Self {
            current: Arc::new(RwLock::new(snapshot)),
            used: Arc::default(),
            config,
        }
    }

    /// The control plane now, all of one version.
    pub fn snapshot(&self) -> Snapshot {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The tenants and keys now. Holding them does not hold back a reload.
    pub fn current(&self) -> Arc<TenantDirectory> {
        self.snapshot().tenants
    }

    /// The provider keys now.
    pub fn keyring(&self) -> Arc<Keyring> {
        self.snapshot().keyring
    }

    /// The configuration in force now: the file's, with the routes added at runtime. What
    /// resolves a job's model (the API's checks, the planner) reads it here.
    pub fn config(&self) -> Arc<Config> {
        self.snapshot().config
    }

    /// `presented_key`'s tenant at `now`, noting the key's use for `last_used_at` (the
    /// API's guard, once per request; handlers look up in [`Directory::current`]).
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
        if fresh.tenants.version > current.tenants.version {
            *current = fresh;
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

/// The tenants, their keys and the provider keys the database holds, at its version.
async fn read(pool: &PgPool, config: &Config) -> Result<Snapshot, ControlError> {
    let mut tx = store::begin_snapshot(pool).await?;
    let version = store::control_version(&mut *tx).await?;
    let tenants = store::list_tenants(&mut *tx).await?;
    let keys = store::directory_keys(&mut *tx).await?;
    let provider_keys = store::list_provider_keys(&mut *tx).await?;
    let accounts = store::key_accounts(&mut *tx).await?;
    let routes = store::list_routes(&mut *tx).await?;
    tx.commit().await?;
    let admin = tenants::admin_digest(config).unwrap_or(None);
    let tenants = tenants
        .iter()
        .map(|r| Tenant::resolve(&r.spec, &config.quotas, &config.server));
    let key_limits: Vec<(Uuid, KeyLimits)> = keys
        .iter()
        .map(|k| {
            let limits = KeyLimits {
                own: tenants::Allowance {
                    limits: k.limits,
                    budgets: k.budgets.clone(),
                },
                application: k.application.clone(),
            };
            (k.id, limits)
        })
        .collect();
    let live = keys.into_iter().filter(|k| !k.revoked).map(|k| {
        let entry = KeyEntry {
            id: k.id,
            tenant: k.tenant,
            expires_at: k.expires_at,
            scopes: Arc::new(k.scopes),
        };
        (k.digest, entry)
    });
    let tenants = TenantDirectory::with_key_limits(tenants, live, key_limits, admin, version);
    Ok(Snapshot {
        tenants: Arc::new(tenants),
        keyring: Arc::new(
            keyring(config, provider_keys)
                .with_accounts(accounts.into_iter().map(|a| (a.provider, a.key, a.account))),
        ),
        config: Arc::new(with_routes(config, routes)),
    })
}

/// `config` with the routes added at runtime after its own (an alias of the file is never
/// one of them: [`add_route`] refuses it).
fn with_routes(config: &Config, routes: Vec<store::RouteRecord>) -> Config {
    let mut effective = config.clone();
    effective.routes.extend(
        routes
            .into_iter()
            .filter(|r| !config.routes.iter().any(|f| f.alias == r.alias))
            .map(|r| RouteConfig {
                alias: r.alias,
                targets: r.targets,
                limits: r.limits,
            }),
    );
    effective
}

/// The provider keys of `rows`, those added at runtime opened with the server's secret key
/// (a key that does not open is left unusable, and said so).
fn keyring(config: &Config, rows: Vec<ProviderKeyRecord>) -> Keyring {
    let sealing = config.webhooks.sealing_key();
    let entries = rows
        .into_iter()
        .map(|r| {
            let secret = r.sealed_value.as_deref().and_then(|sealed| {
                let context = provider_key_context(&r.provider, &r.name);
                let opened = match &sealing {
                    Ok(key) => key.open_sealed(&context, sealed).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                opened
                    .inspect_err(|e| tracing::warn!(provider = %r.provider, key = %r.name, error = %e, "a provider key added at runtime does not open; it is not used"))
                    .ok()
            });
            KeyringEntry {
                runtime: r.sealed_value.is_some(),
                provider: r.provider,
                name: r.name,
                weight: r.weight,
                models: r.models,
                limits: r.limits,
                account: r.account,
                disabled: r.disabled_at.is_some(),
                secret,
            }
        })
        .collect();
    Keyring::new(entries)
}

/// `spec`'s buckets: its limits and budgets, and its applications', as the gate reserves
/// them.
fn tenant_specs(spec: &TenantSpec) -> Vec<buckets::BucketSpec> {
    let apps = spec.applications.iter().flat_map(|(app, a)| {
        buckets::limit_specs(
            &buckets::application_scope(&spec.name, app),
            &a.limits,
            &a.budgets,
        )
    });
    buckets::limit_specs(&buckets::tenant_scope(&spec.name), &spec.limits, &spec.budgets)
        .into_iter()
        .chain(apps)
        .collect()
}

/// Ends a change: syncs `specs` (the buckets of what changed), then [`announce`]s it.
async fn finish(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    specs: &[buckets::BucketSpec],
    now: DateTime<Utc>,
) -> Result<(), ControlError> {
    store::sync_buckets(&mut *tx, specs, now).await?;
    announce(tx).await
}

/// Bumps the control plane's version (its NOTIFY goes out as this commits) and commits.
async fn announce(mut tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), ControlError> {
    store::changed(&mut tx).await?;
    tx.commit().await?;
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
    finish(tx, &tenant_specs(spec), now).await?;
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
    announce(tx).await
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
    /// What it may submit.
    pub scopes: KeyScopes,
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
        scopes: &request.scopes,
        expires_at: request.expires_at,
    };
    let record = store::insert_key(&mut tx, &key, Source::Api, now).await?;
    let specs = buckets::limit_specs(&buckets::api_key_scope(key.id), &request.limits, &request.budgets);
    finish(tx, &specs, now).await?;
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
    announce(tx).await?;
    Ok(record)
}

/// What applying a seed changed: the tenants written (each as it was before), the
/// tenants whose file key was set, and the tenants the file does not name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Applied {
    pub keys: Vec<String>,
    /// Each tenant written: as it was (`None`: new) and as the file has it.
    pub changes: Vec<(Option<TenantSpec>, TenantSpec)>,
    /// Tenants the file does not name (left as they are).
    pub untouched: Vec<String>,
}

impl Applied {
    /// The tenants created.
    pub fn created(&self) -> Vec<&str> {
        self.written(false)
    }

    /// The tenants that were there and changed.
    pub fn updated(&self) -> Vec<&str> {
        self.written(true)
    }

    fn written(&self, existed: bool) -> Vec<&str> {
        self.changes
            .iter()
            .filter(|(before, _)| before.is_some() == existed)
            .map(|(_, after)| after.name.as_str())
            .collect()
    }

    /// Whether anything was (or would be) written.
    pub fn changed(&self) -> bool {
        !(self.changes.is_empty() && self.keys.is_empty())
    }
}

/// Applies the config file's tenants and keys: creates the tenants it names that are not
/// there, updates those that differ, gives each its file key. Tenants it does not name
/// are left as they are. Parents are written before their children.
pub async fn apply_seed(pool: &PgPool, seed: &Seed, now: DateTime<Utc>) -> Result<Applied, ControlError> {
    write_seed(pool, seed, now, true).await
}

/// What [`apply_seed`] would change, written in a transaction that is rolled back.
pub async fn plan_seed(pool: &PgPool, seed: &Seed, now: DateTime<Utc>) -> Result<Applied, ControlError> {
    write_seed(pool, seed, now, false).await
}

async fn write_seed(
    pool: &PgPool,
    seed: &Seed,
    now: DateTime<Utc>,
    commit: bool,
) -> Result<Applied, ControlError> {
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
        store::sync_buckets(&mut *tx, &tenant_specs(spec), now).await?;
        applied.changes.push((before.map(|b| b.spec), spec.clone()));
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
    applied.untouched = store::list_tenants(&mut *tx)
        .await?
        .into_iter()
        .map(|t| t.spec.name)
        .filter(|name| !seed.tenants.iter().any(|s| &s.name == name))
        .collect();
    if !commit {
        tx.rollback().await?;
        return Ok(applied);
    }
    if applied.changed() {
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
            applications: Default::default(),
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

/// A provider key to add (`POST /v1/admin/provider-keys`).
#[derive(Debug, Clone)]
pub struct NewProviderKey {
    pub provider: String,
    pub name: String,
    pub value: secrecy::SecretString,
    pub weight: u32,
    /// Empty: every model of its provider.
    pub models: Vec<String>,
    pub limits: Option<ModelLimits>,
    /// The account (quota pool) it is declared in.
    pub account: Option<String>,
}

/// What to change of a provider key; each `Some` replaces. A key of the config file takes
/// only `disabled`.
#[derive(Debug, Clone, Default)]
pub struct ProviderKeyChange {
    /// A new secret: the key rotated.
    pub value: Option<secrecy::SecretString>,
    pub weight: Option<u32>,
    pub models: Option<Vec<String>>,
    pub limits: Option<Option<ModelLimits>>,
    pub account: Option<Option<String>>,
    pub disabled: Option<bool>,
}

fn invalid_field(field: &str, reason: impl Into<String>) -> ControlError {
    ControlError::Invalid(tenants::InvalidTenant {
        field: field.to_owned(),
        reason: reason.into(),
    })
}

/// The provider `name` of the config, or the refusal.
fn provider<'a>(config: &'a Config, name: &str) -> Result<&'a ProviderConfig, ControlError> {
    config
        .provider(name)
        .ok_or_else(|| invalid_field("provider", format!("no provider {name:?} is configured")))
}

/// Checks a key's secret, weight and models against its provider.
fn check_provider_key(
    p: &ProviderConfig,
    value: Option<&secrecy::SecretString>,
    weight: u32,
    models: &[String],
    account: Option<&str>,
) -> Result<(), ControlError> {
    use secrecy::ExposeSecret;
    // A Vertex key is a service account's JSON key, spaces and all; the others are one token.
    let json_key = p.kind == crate::config::ProviderKind::Vertex;
    let malformed = |v: &str| {
        v.is_empty()
            || v.len() > 16_384
            || (!json_key && (v.len() > 4096 || v.chars().any(|c| c.is_whitespace() || c.is_control())))
    };
    if value.map(ExposeSecret::expose_secret).is_some_and(malformed) {
        return Err(invalid_field(
            "value",
            "must be the provider's key: 1 to 4096 characters, no spaces (a vertex key: a service account's JSON key)",
        ));
    }
    if let Some(reason) = value.and_then(|v| crate::config::key_fault(p.kind, v)) {
        return Err(invalid_field("value", reason));
    }
    if weight == 0 {
        return Err(invalid_field("weight", "must be at least 1"));
    }
    if account.is_some_and(|a| !tenants::valid_name(a)) {
        return Err(invalid_field("account", tenants::name_rule()));
    }
    if let Some(m) = models.iter().find(|m| !p.models.contains(m)) {
        return Err(invalid_field(
            "models",
            format!("{m:?} is not a model of provider {:?}", p.name),
        ));
    }
    Ok(())
}

/// `value` sealed for key `provider/name` with the server's secret key.
fn seal(
    config: &Config,
    provider: &str,
    name: &str,
    value: &secrecy::SecretString,
) -> Result<String, ControlError> {
    use secrecy::ExposeSecret;
    let key = config
        .webhooks
        .sealing_key()
        .map_err(|e| ControlError::Sealing(e.to_string()))?;
    Ok(key
        .seal(&provider_key_context(provider, name), value.expose_secret())
        .as_str()
        .to_owned())
}

/// Writes `key` with its limits' buckets and the version bump.
async fn write_provider_key(
    pool: &PgPool,
    key: &store::ProviderKeyWrite<'_>,
    now: DateTime<Utc>,
) -> Result<ProviderKeyRecord, ControlError> {
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    let record = store::put_provider_key(&mut tx, key, now).await?;
    let specs = key.limits.map(|l| buckets::key_specs(key.provider, key.name, l));
    finish(tx, specs.as_deref().unwrap_or_default(), now).await?;
    Ok(record)
}

/// Adds a provider key: sealed with the server's secret key, in use on every process
/// within a second.
pub async fn add_provider_key(
    pool: &PgPool,
    config: &Config,
    new: &NewProviderKey,
    now: DateTime<Utc>,
) -> Result<ProviderKeyRecord, ControlError> {
    let p = provider(config, &new.provider)?;
    if !tenants::valid_name(&new.name) {
        return Err(invalid_field("name", tenants::name_rule()));
    }
    check_provider_key(
        p,
        Some(&new.value),
        new.weight,
        &new.models,
        new.account.as_deref(),
    )?;
    let exists = p.keys.iter().any(|k| k.name == new.name)
        || store::get_provider_key(pool, &new.provider, &new.name)
            .await?
            .is_some_and(|r| r.sealed_value.is_some());
    if exists {
        return Err(ControlError::ProviderKeyExists(
            new.provider.clone(),
            new.name.clone(),
        ));
    }
    let sealed = seal(config, &new.provider, &new.name, &new.value)?;
    let write = store::ProviderKeyWrite {
        provider: &new.provider,
        name: &new.name,
        sealed_value: Some(&sealed),
        weight: new.weight,
        models: &new.models,
        limits: new.limits.as_ref(),
        account: new.account.as_deref(),
        disabled: false,
    };
    write_provider_key(pool, &write, now).await
}

/// Changes provider key `provider/name`: rotates its secret, its weight, models or limits
/// (a key added at runtime), or disables or enables it (any key, the file's too).
pub async fn change_provider_key(
    pool: &PgPool,
    config: &Config,
    provider_name: &str,
    name: &str,
    change: &ProviderKeyChange,
    now: DateTime<Utc>,
) -> Result<ProviderKeyRecord, ControlError> {
    let p = provider(config, provider_name)?;
    let stored = store::get_provider_key(pool, provider_name, name).await?;
    let of_file = p.keys.iter().find(|k| k.name == name);
    if of_file.is_some()
        && (change.value.is_some()
            || change.weight.is_some()
            || change.models.is_some()
            || change.limits.is_some()
            || change.account.is_some())
    {
        return Err(invalid_field(
            "disabled",
            "a key of the config file changes in the file; through the admin API it is only disabled or enabled",
        ));
    }
    let runtime = stored.as_ref().filter(|r| r.sealed_value.is_some());
    if of_file.is_none() && runtime.is_none() {
        return Err(ControlError::NoSuchProviderKey(
            provider_name.to_owned(),
            name.to_owned(),
        ));
    }
    let weight = change
        .weight
        .or(runtime.map(|r| r.weight))
        .or(of_file.map(|k| k.weight))
        .unwrap_or(1);
    let models = change
        .models
        .clone()
        .or_else(|| runtime.map(|r| r.models.clone()))
        .unwrap_or_default();
    let limits = match &change.limits {
        Some(limits) => limits.clone(),
        None => runtime.and_then(|r| r.limits.clone()),
    };
    let account = match &change.account {
        Some(account) => account.clone(),
        None => runtime.and_then(|r| r.account.clone()),
    };
    check_provider_key(p, change.value.as_ref(), weight, &models, account.as_deref())?;
    let sealed = match &change.value {
        Some(value) => Some(seal(config, provider_name, name, value)?),
        None => None,
    };
    let disabled = change
        .disabled
        .unwrap_or_else(|| stored.as_ref().is_some_and(|r| r.disabled_at.is_some()));
    let write = store::ProviderKeyWrite {
        provider: provider_name,
        name,
        sealed_value: sealed.as_deref(),
        weight,
        models: &models,
        limits: limits.as_ref(),
        account: account.as_deref(),
        disabled,
    };
    write_provider_key(pool, &write, now).await
}

/// Removes a provider key added at runtime (a key of the file is disabled instead).
pub async fn remove_provider_key(
    pool: &PgPool,
    config: &Config,
    provider_name: &str,
    name: &str,
) -> Result<(), ControlError> {
    let p = provider(config, provider_name)?;
    if p.keys.iter().any(|k| k.name == name) {
        return Err(invalid_field(
            "name",
            "a key of the config file is removed from the file; through the admin API it is disabled",
        ));
    }
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    if !store::delete_provider_key(&mut tx, provider_name, name).await? {
        return Err(ControlError::NoSuchProviderKey(
            provider_name.to_owned(),
            name.to_owned(),
        ));
    }
    announce(tx).await
}

/// Writes route `alias` — a model name clients may send, resolved to `targets` in order
/// on every process within a second: a new one, or (`replace`) over the one added at
/// runtime, with its limits' buckets.
pub async fn put_route(
    pool: &PgPool,
    config: &Config,
    alias: &str,
    targets: &[String],
    limits: Option<&ModelLimits>,
    replace: bool,
    now: DateTime<Utc>,
) -> Result<store::RouteRecord, ControlError> {
    if config.routes.iter().any(|r| r.alias == alias) {
        return Err(match replace {
            true => invalid_field("alias", "a route of the config file changes in the file"),
            false => ControlError::RouteExists(alias.to_owned()),
        });
    }
    let route = RouteConfig {
        alias: alias.to_owned(),
        targets: targets.to_vec(),
        limits: limits.cloned(),
    };
    if let Some((field, reason)) = route.fault(config) {
        return Err(invalid_field(&field, reason));
    }
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    let record = store::put_route(&mut tx, alias, targets, limits, replace, now)
        .await?
        .ok_or_else(|| match replace {
            true => ControlError::NoSuchRoute(alias.to_owned()),
            false => ControlError::RouteExists(alias.to_owned()),
        })?;
    let specs = limits.map(|l| buckets::route_specs(alias, l));
    finish(tx, specs.as_deref().unwrap_or_default(), now).await?;
    Ok(record)
}

/// Removes route `alias` (one added at runtime): jobs queued for it fail `unknown_model`.
pub async fn remove_route(pool: &PgPool, config: &Config, alias: &str) -> Result<(), ControlError> {
    if config.routes.iter().any(|r| r.alias == alias) {
        return Err(invalid_field(
            "alias",
            "a route of the config file is removed from the file",
        ));
    }
    let mut tx = pool.begin().await?;
    store::lock_control(&mut tx).await?;
    if !store::delete_route(&mut tx, alias).await? {
        return Err(ControlError::NoSuchRoute(alias.to_owned()));
    }
    announce(tx).await
}
