//! Tenants and their API keys: who may call, what each may spend, and the directory every
//! request is authenticated against.
//!
//! Tenants and keys live in the database (`tenants`, `api_keys`): the admin API changes
//! them at runtime and the config file's `[[tenants]]` seed them ([`Seed`]). Each process
//! holds the current [`TenantDirectory`] (a snapshot, swapped whole by `control` when
//! the control plane changes), so a lookup takes no lock and no query.
//!
//! Keys are kept only as SHA-256 digests, so a memory dump, a table or a log line never
//! holds one, and lookup by digest does not leak timing about the key's bytes: what a
//! lookup compares is the digest, which an attacker cannot steer byte by byte. The admin
//! digest is compared in constant time.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use secrecy::ExposeSecret;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use uuid::Uuid;

use serde::{Deserialize, Serialize};

use crate::config::{ApiRate, Config, Quotas, ServerConfig};
pub use crate::tenant_spec::{
    Allowance, Budget, BudgetWindow, InvalidTenant, MAX_TENANT_NAME, Source, TenantLimits, TenantSettings,
    TenantSpec, check_limits, name_rule, valid_name,
};
use crate::vocab::{Endpoint, JobClass};

/// A tenant as requests see it: its spec with the server's defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    pub name: String,
    pub weight: u32,
    /// The tenant whose limits and budgets also cover this one.
    pub parent: Option<String>,
    pub limits: TenantLimits,
    pub budgets: Vec<Budget>,
    /// Its applications' own limits and budgets, shared by the keys labelled with each.
    pub applications: BTreeMap<String, Allowance>,
    /// What the tenant may keep stored (its own, or `[quotas]`).
    pub quotas: Quotas,
    /// How fast it may call one API process (its own, or the server's).
    pub api_rate: ApiRate,
}

impl Tenant {
    /// `spec` with `[quotas]` and the server's API rate where it sets none of its own.
    pub fn resolve(spec: &TenantSpec, quotas: &Quotas, server: &ServerConfig) -> Self {
        let s = &spec.settings;
        let rate = server.api_rate();
        Tenant {
            name: spec.name.clone(),
            weight: spec.weight,
            parent: spec.parent.clone(),
            limits: spec.limits,
            budgets: spec.budgets.clone(),
            applications: spec.applications.clone(),
            quotas: Quotas {
                max_files: s.max_files.unwrap_or(quotas.max_files),
                max_stored_file_bytes: s.max_stored_file_bytes.unwrap_or(quotas.max_stored_file_bytes),
            },
            api_rate: ApiRate {
                per_sec: s.api_rate_per_sec.unwrap_or(rate.per_sec),
                burst: s.api_burst.unwrap_or(rate.burst),
            },
        }
    }

    /// A tenant named `name` with nothing of its own (tests, benchmarks).
    pub fn plain(name: &str, config: &Config) -> Self {
        let spec = TenantSpec {
            name: name.to_owned(),
            weight: 1,
            parent: None,
            limits: TenantLimits::default(),
            budgets: Vec::new(),
            applications: BTreeMap::new(),
            settings: TenantSettings::default(),
        };
        Self::resolve(&spec, &config.quotas, &config.server)
    }
}

/// A key the directory accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyEntry {
    pub id: Uuid,
    pub tenant: String,
    pub expires_at: Option<DateTime<Utc>>,
    pub scopes: Arc<KeyScopes>,
}

/// What a key may submit; each list left empty allows anything.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyScopes {
    /// The names it may put in `model` (route aliases, `provider/model`, provider models).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// The endpoints its jobs may call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<Endpoint>,
    /// The classes its jobs may take.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<JobClass>,
    /// The highest priority its jobs may ask for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_priority: Option<i32>,
}

impl KeyScopes {
    /// Why a job for `model` (when known), of `endpoint`, `class` and `priority`, is not
    /// this key's to submit: the field it is refused by, and the reason.
    pub fn refuses(
        &self,
        model: Option<&str>,
        endpoint: Endpoint,
        class: JobClass,
        priority: i32,
    ) -> Option<(&'static str, String)> {
        if let Some(reason) = model.and_then(|m| self.refuses_model(m)) {
            return Some(("model", reason));
        }
        if !self.endpoints.is_empty() && !self.endpoints.contains(&endpoint) {
            return Some((
                "endpoint",
                format!("this API key may not call {}", endpoint.as_str()),
            ));
        }
        if !self.classes.is_empty() && !self.classes.contains(&class) {
            return Some((
                "class",
                format!("this API key may not submit {} jobs", class.as_str()),
            ));
        }
        match self.max_priority {
            Some(max) if priority > max => Some((
                "priority",
                format!("this API key may not ask for a priority above {max}"),
            )),
            _ => None,
        }
    }
}

impl KeyScopes {
    /// Why `model` is not this key's to use.
    pub fn refuses_model(&self, model: &str) -> Option<String> {
        (!self.models.is_empty() && !self.models.iter().any(|m| m == model))
            .then(|| format!("this API key may not use model {model:?}"))
    }
}

/// Who is calling: a tenant, through one of its keys (`None` for a directory built from
/// the config alone), with what that key may submit. Reads as its tenant.
#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: Arc<Tenant>,
    pub key: Option<Uuid>,
    pub scopes: Arc<KeyScopes>,
}

impl Caller {
    /// A caller of `tenant` through no key of the control plane (tests, benchmarks).
    pub fn of(tenant: Tenant) -> Self {
        Self {
            tenant: Arc::new(tenant),
            key: None,
            scopes: Arc::default(),
        }
    }
}

impl std::ops::Deref for Caller {
    type Target = Tenant;

    fn deref(&self) -> &Tenant {
        &self.tenant
    }
}

/// What a key's jobs are held to beyond its tenant's limits and budgets: the key's own,
/// and those of the application it is labelled with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyLimits {
    pub own: Allowance,
    pub application: Option<String>,
}

impl KeyLimits {
    pub fn is_empty(&self) -> bool {
        self.own.is_empty() && self.application.is_none()
    }
}

/// The tenants and live keys of one moment, and the admin key.
#[derive(Debug, Clone, Default)]
pub struct TenantDirectory {
    tenants: HashMap<String, Arc<Tenant>>,
    keys: HashMap<[u8; 32], KeyEntry>,
    /// The keys that have limits or budgets of their own or an application label (revoked
    /// ones too: their jobs still queued keep to them).
    key_limits: HashMap<Uuid, KeyLimits>,
    /// `server.admin_key`'s digest: the operators, who see every tenant.
    admin_digest: Option<[u8; 32]>,
    /// The control plane's version this was read at.
    pub version: i64,
}

pub fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The admin key's digest, or why the config's admin key cannot be used.
pub fn admin_digest(config: &Config) -> Result<Option<[u8; 32]>, String> {
    Ok(config.server.admin_key()?.map(|k| digest(k.expose_secret())))
}

impl TenantDirectory {
    /// The directory of `tenants` (resolved) and `keys` (revoked ones left out).
    pub fn new(
        tenants: impl IntoIterator<Item = Tenant>,
        keys: impl IntoIterator<Item = ([u8; 32], KeyEntry)>,
        admin_digest: Option<[u8; 32]>,
        version: i64,
    ) -> Self {
        Self::with_key_limits(tenants, keys, [], admin_digest, version)
    }

    /// [`TenantDirectory::new`] with the keys' own limits and budgets.
    pub fn with_key_limits(
        tenants: impl IntoIterator<Item = Tenant>,
        keys: impl IntoIterator<Item = ([u8; 32], KeyEntry)>,
        key_limits: impl IntoIterator<Item = (Uuid, KeyLimits)>,
        admin_digest: Option<[u8; 32]>,
        version: i64,
    ) -> Self {
        let mut keys: HashMap<[u8; 32], KeyEntry> = keys.into_iter().collect();
        // The admin key is nobody's tenant key, whatever a row says.
        if let Some(d) = admin_digest {
            keys.remove(&d);
        }
        Self {
            tenants: tenants
                .into_iter()
                .map(|t| (t.name.clone(), Arc::new(t)))
                .collect(),
            keys,
            key_limits: key_limits.into_iter().filter(|(_, l)| !l.is_empty()).collect(),
            admin_digest,
            version,
        }
    }

    /// The config's tenants and keys alone, as the file seeds them (`config check`, tests).
    pub fn from_config(config: &Config) -> Result<Self, String> {
        let seed = Seed::from_config(config)?;
        let admin = admin_digest(config)?;
        if admin.is_some_and(|d| seed.keys.iter().any(|(_, k)| *k == d)) {
            return Err("`server.admin_key` is also a tenant's API key".to_owned());
        }
        let tenants = seed
            .tenants
            .iter()
            .map(|s| Tenant::resolve(s, &config.quotas, &config.server));
        let keys = seed.keys.iter().map(|(tenant, d)| {
            let entry = KeyEntry {
                id: Uuid::nil(),
                tenant: tenant.clone(),
                expires_at: None,
                scopes: Arc::default(),
            };
            (*d, entry)
        });
        Ok(Self::new(tenants, keys, admin, 0))
    }

    /// Whether `presented_key` is the admin key.
    pub fn is_admin(&self, presented_key: &str) -> bool {
        self.admin_digest
            .is_some_and(|d| bool::from(d.ct_eq(&digest(presented_key))))
    }

    /// Whether an admin key is configured.
    pub fn has_admin(&self) -> bool {
        self.admin_digest.is_some()
    }

    /// The tenant of a live key: not revoked (revoked keys are not in the directory), not
    /// expired at `now`, its tenant still there.
    pub fn authenticate(&self, presented_key: &str, now: DateTime<Utc>) -> Option<Caller> {
        let key = self.keys.get(&digest(presented_key))?;
        if key.expires_at.is_some_and(|at| at <= now) {
            return None;
        }
        Some(Caller {
            tenant: self.tenants.get(&key.tenant)?.clone(),
            key: Some(key.id).filter(|id| !id.is_nil()),
            scopes: key.scopes.clone(),
        })
    }

    /// Key `id`'s own limits and budgets, when it has any.
    pub fn key_limits(&self, id: Uuid) -> Option<&KeyLimits> {
        self.key_limits.get(&id)
    }

    /// Every tenant, by name.
    pub fn tenants(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        let mut all: Vec<_> = self.tenants.values().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all.into_iter()
    }

    /// The fair-sharing weight of tenant `name` (at least 1; 1 for a tenant not known).
    pub fn weight(&self, name: &str) -> f64 {
        self.tenants.get(name).map_or(1.0, |t| f64::from(t.weight.max(1)))
    }

    /// `name` and the tenants above it (its parent, the parent's parent, …), nearest
    /// first. A loop (which the store refuses to write) ends the walk.
    pub fn lineage(&self, name: &str) -> Vec<&Tenant> {
        let mut out: Vec<&Tenant> = Vec::new();
        let mut next = Some(name);
        while let Some(n) = next {
            let Some(t) = self.tenants.get(n) else { break };
            if out.iter().any(|seen| seen.name == t.name) {
                break;
            }
            out.push(t);
            next = t.parent.as_deref();
        }
        out
    }
}

/// What the config file seeds: its tenants and each one's key digest.
#[derive(Debug, Clone, Default)]
pub struct Seed {
    pub tenants: Vec<TenantSpec>,
    /// (tenant, the digest of its key).
    pub keys: Vec<(String, [u8; 32])>,
}

impl Seed {
    /// The config's `[[tenants]]` (keys resolved from the environment).
    pub fn from_config(config: &Config) -> Result<Self, String> {
        let mut seed = Seed::default();
        for t in &config.tenants {
            let key = t.key_sha256()?;
            if seed.keys.iter().any(|(_, k)| *k == key) {
                return Err(format!(
                    "tenant {:?} shares its API key with another tenant",
                    t.name
                ));
            }
            seed.keys.push((t.name.clone(), key));
            seed.tenants.push(t.spec());
        }
        Ok(seed)
    }
}

/// A new API key's secret: `tg-` and 32 random bytes in hex.
pub fn new_secret() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("tg-{hex}")
}

/// What listings show of a key: its first characters.
pub fn key_prefix(secret: &str) -> String {
    secret.chars().take(8).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(server: &str) -> Config {
        let text = format!(
            "[server]\n{server}\n[[providers]]\nname = \"oai\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\n\
             keys = [{{ name = \"k1\", value = \"sk-1\" }}]\nmodels = [\"m\"]\n\
             [[tenants]]\nname = \"acme\"\napi_key = \"tk-acme\"\n"
        );
        Config::parse(&text, "test.toml").unwrap()
    }

    fn name(a: Option<Caller>) -> Option<String> {
        a.map(|a| a.tenant.name.clone())
    }

    #[test]
    fn the_admin_key_is_nobody_s_tenant_key() {
        let now = Utc::now();
        let dir = TenantDirectory::from_config(&config("admin_key = \"tk-admin\"")).unwrap();
        assert!(dir.has_admin());
        assert!(dir.is_admin("tk-admin"));
        assert!(!dir.is_admin("tk-acme"));
        assert!(
            dir.authenticate("tk-admin", now).is_none(),
            "the admin key is not a tenant"
        );
        assert_eq!(name(dir.authenticate("tk-acme", now)).as_deref(), Some("acme"));
        let shared = TenantDirectory::from_config(&config("admin_key = \"tk-acme\""));
        assert!(shared.unwrap_err().contains("admin_key"));
        let none = TenantDirectory::from_config(&config("")).unwrap();
        assert!(!none.has_admin() && !none.is_admin(""));
    }

    #[test]
    fn a_tenant_may_be_configured_by_its_key_s_digest_only() {
        let now = Utc::now();
        // sha256("tk-acme")
        let hex = format!("{:x}", Sha256::digest(b"tk-acme"));
        let text = |tenant: &str| {
            format!(
                "[[providers]]\nname = \"oai\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\n\
                 keys = [{{ name = \"k1\", value = \"sk-1\" }}]\nmodels = [\"m\"]\n\
                 [[tenants]]\nname = \"acme\"\n{tenant}\n"
            )
        };
        let config = Config::parse(&text(&format!("api_key_sha256 = \"{hex}\"")), "t").unwrap();
        let dir = TenantDirectory::from_config(&config).unwrap();
        assert_eq!(name(dir.authenticate("tk-acme", now)).as_deref(), Some("acme"));
        assert!(
            dir.authenticate(&hex, now).is_none(),
            "the digest is not itself a key"
        );
        for bad in [
            "api_key_sha256 = \"abc\"".to_owned(),
            format!("api_key_sha256 = \"{}\"", "z".repeat(64)),
            format!("api_key = \"tk-acme\"\napi_key_sha256 = \"{hex}\""),
            String::new(),
        ] {
            let e = Config::parse(&text(&bad), "t").unwrap_err().to_string();
            assert!(e.contains("tenants[0]"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_tenant_s_own_quotas_and_api_rate_override_the_defaults() {
        let text = "[server]\napi_rate_per_sec = 50\n[[providers]]\nname = \"oai\"\nkind = \"openai\"\n\
                    base_url = \"http://127.0.0.1:1/v1\"\nkeys = [{ name = \"k1\", value = \"sk-1\" }]\nmodels = [\"m\"]\n\
                    [[tenants]]\nname = \"acme\"\napi_key = \"tk-acme\"\nmax_files = 5\napi_rate_per_sec = 7\n\
                    [[tenants]]\nname = \"globex\"\napi_key = \"tk-globex\"\n\
                    [quotas]\nmax_stored_file_bytes = 1000\n";
        let c = Config::parse(text, "test.toml").unwrap();
        let tenant = |i: usize| Tenant::resolve(&c.tenants[i].spec(), &c.quotas, &c.server);
        let (acme, globex) = (tenant(0), tenant(1));
        assert_eq!(
            (acme.quotas.max_files, acme.quotas.max_stored_file_bytes),
            (5, 1000)
        );
        assert_eq!(
            (globex.quotas.max_files, globex.quotas.max_stored_file_bytes),
            (10_000, 1000)
        );
        assert_eq!((acme.api_rate.per_sec, globex.api_rate.per_sec), (7.0, 50.0));
    }

    #[test]
    fn an_expired_key_or_one_whose_tenant_is_gone_is_refused() {
        let now = Utc::now();
        let config = config("");
        let acme = Tenant::plain("acme", &config);
        let entry = |tenant: &str, expires_at| KeyEntry {
            id: Uuid::nil(),
            tenant: tenant.to_owned(),
            expires_at,
            scopes: Arc::default(),
        };
        let dir = TenantDirectory::new(
            [acme],
            [
                (
                    digest("live"),
                    entry("acme", Some(now + chrono::Duration::seconds(5))),
                ),
                (digest("expired"), entry("acme", Some(now))),
                (digest("orphan"), entry("gone", None)),
            ],
            None,
            1,
        );
        assert_eq!(name(dir.authenticate("live", now)).as_deref(), Some("acme"));
        assert!(dir.authenticate("expired", now).is_none());
        assert!(dir.authenticate("orphan", now).is_none());
    }

    #[test]
    fn a_lineage_walks_up_the_parents_and_stops_at_a_loop() {
        let config = config("");
        let with_parent = |name: &str, parent: &str| Tenant {
            parent: Some(parent.to_owned()),
            ..Tenant::plain(name, &config)
        };
        let dir = TenantDirectory::new(
            [
                with_parent("team", "unit"),
                with_parent("unit", "partner"),
                Tenant::plain("partner", &config),
                with_parent("a", "b"),
                with_parent("b", "a"),
            ],
            [],
            None,
            1,
        );
        let names = |n| dir.lineage(n).iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        assert_eq!(names("team"), ["team", "unit", "partner"]);
        assert_eq!(names("a"), ["a", "b"]);
        assert!(names("nobody").is_empty());
    }

    #[test]
    fn a_spec_names_the_field_it_cannot_take() {
        let config = config("");
        let spec = config.tenants[0].spec();
        assert!(spec.check().is_ok());
        let field = |f: &dyn Fn(&mut TenantSpec)| {
            let mut s = spec.clone();
            f(&mut s);
            s.check().unwrap_err().field
        };
        assert_eq!(field(&|s| s.name = "a:b".into()), "name");
        assert_eq!(field(&|s| s.weight = 0), "weight");
        assert_eq!(field(&|s| s.parent = Some("acme".into())), "parent");
        assert_eq!(field(&|s| s.limits.rpm = Some(0)), "limits.rpm");
        let day = |usd| Budget {
            window: BudgetWindow::Day,
            usd,
        };
        assert_eq!(field(&|s| s.budgets = vec![day(f64::NAN)]), "budgets[0].usd");
        assert_eq!(
            field(&|s| s.budgets = vec![day(1.0), day(2.0)]),
            "budgets[1].window"
        );
        assert_eq!(field(&|s| s.settings.api_burst = Some(0.5)), "settings.api_burst");
        let app = |name: &str, allowance: Allowance| {
            let name = name.to_owned();
            move |s: &mut TenantSpec| {
                s.applications.insert(name.clone(), allowance.clone());
            }
        };
        assert_eq!(field(&app("a:b", Allowance::default())), "applications.a:b");
        let unlimited = Allowance {
            limits: TenantLimits {
                tpm: Some(0),
                ..TenantLimits::default()
            },
            budgets: vec![],
        };
        assert_eq!(field(&app("bot", unlimited)), "applications.bot.limits.tpm");
        let twice = Allowance {
            budgets: vec![day(1.0), day(2.0)],
            ..Allowance::default()
        };
        assert_eq!(field(&app("bot", twice)), "applications.bot.budgets[1].window");
    }

    #[test]
    fn a_new_secret_is_random_and_long() {
        let (a, b) = (new_secret(), new_secret());
        assert_ne!(a, b);
        assert_eq!(a.len(), 3 + 64);
        assert_eq!(key_prefix(&a).len(), 8);
    }
}
