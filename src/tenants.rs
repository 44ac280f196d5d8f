//! Tenant identity: API key → tenant. Keys are kept only as SHA-256 digests, so a memory
//! dump or a log line never holds one, and lookup by digest does not leak timing about
//! the key's bytes: what a lookup compares is the digest, which an attacker cannot steer
//! byte by byte. The config may hold only the digest (`api_key_sha256`). The admin digest
//! is compared in constant time.

use std::collections::HashMap;

use secrecy::ExposeSecret;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{ApiRate, Config, Quotas};

#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    pub name: String,
    pub weight: u32,
    /// What the tenant may keep stored (its own, or `[quotas]`).
    pub quotas: Quotas,
    /// How fast it may call one API process (its own, or the server's).
    pub api_rate: ApiRate,
}

#[derive(Debug, Clone, Default)]
pub struct TenantDirectory {
    by_key_digest: HashMap<[u8; 32], Tenant>,
    /// `server.admin_key`'s digest: the operators, who see every tenant.
    admin_digest: Option<[u8; 32]>,
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl TenantDirectory {
    /// Builds the directory from validated config (keys resolved from the environment).
    pub fn from_config(config: &Config) -> Result<Self, String> {
        let mut by_key_digest = HashMap::new();
        for t in &config.tenants {
            let key_digest = t.key_sha256()?;
            let tenant = Tenant {
                name: t.name.clone(),
                weight: t.weight,
                quotas: t.quotas(&config.quotas),
                api_rate: t.api_rate(&config.server),
            };
            if by_key_digest.insert(key_digest, tenant).is_some() {
                return Err(format!(
                    "tenant {:?} shares its API key with another tenant",
                    t.name
                ));
            }
        }
        let admin_key = config.server.admin_key()?;
        let admin_digest = admin_key.map(|k| digest(k.expose_secret()));
        if admin_digest.is_some_and(|d| by_key_digest.contains_key(&d)) {
            return Err("`server.admin_key` is also a tenant's API key".to_owned());
        }
        Ok(Self {
            by_key_digest,
            admin_digest,
        })
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

    pub fn authenticate(&self, presented_key: &str) -> Option<&Tenant> {
        self.by_key_digest.get(&digest(presented_key))
    }
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

    #[test]
    fn the_admin_key_is_nobody_s_tenant_key() {
        let dir = TenantDirectory::from_config(&config("admin_key = \"tk-admin\"")).unwrap();
        assert!(dir.has_admin());
        assert!(dir.is_admin("tk-admin"));
        assert!(!dir.is_admin("tk-acme"));
        assert!(
            dir.authenticate("tk-admin").is_none(),
            "the admin key is not a tenant"
        );
        assert_eq!(dir.authenticate("tk-acme").map(|t| t.name.as_str()), Some("acme"));
        let shared = TenantDirectory::from_config(&config("admin_key = \"tk-acme\""));
        assert!(shared.unwrap_err().contains("admin_key"));
        let none = TenantDirectory::from_config(&config("")).unwrap();
        assert!(!none.has_admin() && !none.is_admin(""));
    }

    #[test]
    fn a_tenant_may_be_configured_by_its_key_s_digest_only() {
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
        assert_eq!(dir.authenticate("tk-acme").map(|t| t.name.as_str()), Some("acme"));
        assert!(dir.authenticate(&hex).is_none(), "the digest is not itself a key");
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
}
