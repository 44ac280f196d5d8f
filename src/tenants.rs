//! Tenant identity: API key → tenant. Keys are kept only as SHA-256 digests, so a memory
//! dump or a log line never holds one, and lookup by digest does not leak timing about
//! the key's bytes.

use std::collections::HashMap;

use secrecy::ExposeSecret;
use sha2::{Digest, Sha256};

use crate::config::Config;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub name: String,
    pub weight: u32,
}

#[derive(Debug, Clone, Default)]
pub struct TenantDirectory {
    by_key_digest: HashMap<[u8; 32], Tenant>,
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl TenantDirectory {
    /// Builds the directory from validated config (keys resolved from the environment).
    pub fn from_config(config: &Config) -> Result<Self, String> {
        let mut by_key_digest = HashMap::new();
        for t in &config.tenants {
            let key = t.resolve_key()?;
            let tenant = Tenant {
                name: t.name.clone(),
                weight: t.weight,
            };
            if by_key_digest
                .insert(digest(key.expose_secret()), tenant)
                .is_some()
            {
                return Err(format!(
                    "tenant {:?} shares its API key with another tenant",
                    t.name
                ));
            }
        }
        Ok(Self { by_key_digest })
    }

    pub fn authenticate(&self, presented_key: &str) -> Option<&Tenant> {
        self.by_key_digest.get(&digest(presented_key))
    }
}
