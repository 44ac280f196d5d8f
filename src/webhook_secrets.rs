//! Secrets at rest: webhook signing secrets, and provider keys added at runtime (sealed for
//! their provider and name, [`provider_key_context`]). Standard Webhooks signs with the shared secret itself,
//! so the database must hold something the sender can turn back into it: each secret is
//! sealed with XChaCha20-Poly1305 under the server's webhook key, and that key never
//! enters the database. A dump shows `sealed:v1:<key id>:<base64 of nonce and ciphertext>`
//! per endpoint: nothing a signature could be forged from.
//!
//! The key is 32 random bytes, base64, read from the environment variable that
//! `webhooks.secret_key_env` names or from `webhooks.secret_key_file` (which is created,
//! mode 0600, with a fresh key when it does not exist); the webhooks configuration
//! loads it once per configuration. Every process that accepts or sends webhooks must hold
//! the same key. The key id in each sealed value (derived from the key, revealing nothing
//! of it) names the key that sealed it, so a process holding another key says so instead
//! of signing with garbage. Rows written before secrets were sealed hold the secret itself;
//! they are read as they are ([`StoredSecret::is_sealed`]) and sealed at start.
//!
//! The tenant is the associated data of the sealing, so a sealed secret moved to another
//! tenant's endpoint does not open.

use std::io::{self, Write};
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use secrecy::{ExposeSecret, SecretString};
use sha2::Sha256;

use crate::webhook_signing::{Secret, SecretError};

/// How a sealed secret starts; anything else is a secret stored as it is.
pub const SEALED_PREFIX: &str = "sealed:";
const SEALED_V1: &str = "sealed:v1:";
const NONCE_BYTES: usize = 24;
const KEY_BYTES: usize = 32;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("the webhook secret key must be base64 of {KEY_BYTES} bytes (`openssl rand -base64 32`)")]
    Malformed,
    #[error("environment variable {0} (named by `webhooks.secret_key_env`) is not set")]
    EnvUnset(String),
    #[error("webhook secret key file {path}: {reason}")]
    File { path: String, reason: String },
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum OpenError {
    #[error(
        "the endpoint's secret is sealed with webhook key {sealed_with}, this process holds key {held}: every process needs the same `webhooks.secret_key_file` or `secret_key_env`"
    )]
    OtherKey { sealed_with: String, held: String },
    #[error("the sealed secret does not open (damaged, or sealed for another tenant or key)")]
    Damaged,
    #[error("the endpoint's secret is unusable: {0}")]
    Unusable(#[from] SecretError),
}

/// The server's webhook key: what seals and opens the stored secrets.
#[derive(Clone)]
pub struct SealingKey {
    cipher: XChaCha20Poly1305,
    id: String,
}

impl std::fmt::Debug for SealingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SealingKey({})", self.id)
    }
}

impl SealingKey {
    /// The key written as base64 of 32 bytes (surrounding whitespace ignored).
    pub fn from_base64(text: &str) -> Result<Self, KeyError> {
        let material = STANDARD.decode(text.trim()).map_err(|_| KeyError::Malformed)?;
        if material.len() != KEY_BYTES {
            return Err(KeyError::Malformed);
        }
        // The cipher's key and the key id are both derived from the configured bytes, so
        // the id (stored beside every sealed secret) says nothing about the cipher's key.
        let cipher_key = derive(&material, b"tollgate webhook secrets: sealing key");
        let id = derive(&material, b"tollgate webhook secrets: key id")[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let cipher = XChaCha20Poly1305::new_from_slice(&cipher_key).map_err(|_| KeyError::Malformed)?;
        Ok(Self { cipher, id })
    }

    /// A new random key, base64.
    pub fn generate_base64() -> String {
        let material: [u8; KEY_BYTES] = rand::random();
        STANDARD.encode(material)
    }

    /// The key in the file at `path`; a missing file is created first with a new key,
    /// mode 0600 (written aside and linked into place, so processes starting together
    /// all end up with the one key that got there first). A file others could read is
    /// restricted to its owner, with a warning.
    pub fn load_or_create(path: &Path) -> Result<Self, KeyError> {
        let fail = |reason: String| KeyError::File {
            path: path.display().to_string(),
            reason,
        };
        match read_key_file(path) {
            Ok(text) => return Self::from_base64(&text).map_err(|e| fail(e.to_string())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(e.to_string())),
        }
        create_key_file(path).map_err(|e| fail(format!("cannot create it: {e}")))?;
        let text = read_key_file(path).map_err(|e| fail(e.to_string()))?;
        Self::from_base64(&text).map_err(|e| fail(e.to_string()))
    }

    /// Names the key in sealed values and messages.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// `secret` sealed for `tenant`'s endpoint.
    pub fn seal(&self, tenant: &str, secret: &str) -> StoredSecret {
        let nonce_bytes: [u8; NONCE_BYTES] = rand::random();
        let nonce = XNonce::from(nonce_bytes);
        let payload = Payload {
            msg: secret.as_bytes(),
            aad: tenant.as_bytes(),
        };
        // Sealing fails only for messages of gigabytes; a secret is under a hundred bytes.
        let Ok(sealed) = self.cipher.encrypt(&nonce, payload) else {
            unreachable!("XChaCha20-Poly1305 seals any message shorter than 256 GiB")
        };
        let mut bytes = nonce_bytes.to_vec();
        bytes.extend_from_slice(&sealed);
        StoredSecret(format!("{SEALED_V1}{}:{}", self.id, STANDARD.encode(bytes)))
    }

    /// The signing secret of `tenant`'s endpoint, from what the database holds.
    pub fn open(&self, tenant: &str, stored: &StoredSecret) -> Result<Secret, OpenError> {
        if !stored.0.starts_with(SEALED_V1) {
            // A row from before secrets were sealed (or an unknown format, which the
            // secret's own check refuses).
            return Ok(Secret::parse(&stored.0)?);
        }
        let plain = self.open_sealed(tenant, &stored.0)?;
        Ok(Secret::parse(plain.expose_secret())?)
    }

    /// A value [`SealingKey::seal`]ed for `context` (a tenant, or a provider key's
    /// [`provider_key_context`]), opened. What was not sealed does not open.
    pub fn open_sealed(&self, context: &str, sealed: &str) -> Result<SecretString, OpenError> {
        let rest = sealed.strip_prefix(SEALED_V1).ok_or(OpenError::Damaged)?;
        let (id, body) = rest.split_once(':').ok_or(OpenError::Damaged)?;
        if id != self.id {
            return Err(OpenError::OtherKey {
                sealed_with: id.to_owned(),
                held: self.id.clone(),
            });
        }
        let bytes = STANDARD.decode(body).map_err(|_| OpenError::Damaged)?;
        if bytes.len() < NONCE_BYTES {
            return Err(OpenError::Damaged);
        }
        let (nonce, sealed) = bytes.split_at(NONCE_BYTES);
        let nonce = XNonce::try_from(nonce).map_err(|_| OpenError::Damaged)?;
        let payload = Payload {
            msg: sealed,
            aad: context.as_bytes(),
        };
        let plain = self
            .cipher
            .decrypt(&nonce, payload)
            .map_err(|_| OpenError::Damaged)?;
        Ok(SecretString::from(
            String::from_utf8(plain).map_err(|_| OpenError::Damaged)?,
        ))
    }
}

/// What a provider key is sealed for: its provider and name, so a sealed value moved to
/// another key's row does not open. No tenant name holds a `:` or `/`, so no tenant's
/// webhook secret is sealed for the same.
pub fn provider_key_context(provider: &str, name: &str) -> String {
    format!("provider-key:{provider}/{name}")
}

fn derive(material: &[u8], label: &[u8]) -> [u8; 32] {
    // HMAC accepts keys of any length, so this cannot fail.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(material) else {
        unreachable!("HMAC takes keys of any length")
    };
    mac.update(label);
    mac.finalize().into_bytes().into()
}

fn read_key_file(path: &Path) -> io::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let text = std::fs::read_to_string(path)?;
    let mode = std::fs::metadata(path)?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777), "the webhook secret key file was readable by others; now 0600");
    }
    Ok(text)
}

fn create_key_file(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let suffix: u64 = rand::random();
    let staging = path.with_extension(format!("tmp-{}-{suffix:016x}", std::process::id()));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&staging)?;
        file.write_all(format!("{}\n", SealingKey::generate_base64()).as_bytes())?;
        file.sync_all()?;
        // A link fails when the name exists: whoever linked first wins, and the key in
        // place is never half written.
        match std::fs::hard_link(&staging, path) {
            Ok(()) => {
                tracing::info!(path = %path.display(), "generated the webhook secret key; keep it: the webhook secrets in the database are sealed with it");
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e),
        }
    })();
    let _ = std::fs::remove_file(&staging);
    written
}

/// A webhook secret as the database holds it: sealed, or — rows from before sealing — the
/// secret itself. Never shown by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredSecret(String);

impl StoredSecret {
    /// The text to store.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is sealed (rather than a secret from before sealing).
    pub fn is_sealed(&self) -> bool {
        self.0.starts_with(SEALED_PREFIX)
    }
}

impl From<String> for StoredSecret {
    fn from(text: String) -> Self {
        Self(text)
    }
}

impl std::fmt::Debug for StoredSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_sealed() {
            f.write_str("StoredSecret(sealed)")
        } else {
            f.write_str("StoredSecret(..)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    fn key() -> SealingKey {
        SealingKey::from_base64(&SealingKey::generate_base64()).unwrap()
    }

    fn signature(secret: &Secret) -> String {
        secret.sign("msg_1", 1_700_000_000, b"{}")
    }

    #[test]
    fn a_sealed_secret_opens_to_the_same_signing_secret_and_shows_nothing_of_it() {
        let key = key();
        let sealed = key.seal("acme", PLAIN);
        assert!(sealed.is_sealed());
        assert!(sealed.as_str().starts_with(&format!("sealed:v1:{}:", key.id())));
        let b64 = PLAIN.trim_start_matches("whsec_");
        assert!(!sealed.as_str().contains(b64), "{}", sealed.as_str());
        assert_ne!(key.seal("acme", PLAIN), sealed, "a fresh nonce per sealing");
        let opened = key.open("acme", &sealed).unwrap();
        assert_eq!(signature(&opened), signature(&Secret::parse(PLAIN).unwrap()));
    }

    #[test]
    fn another_key_another_tenant_or_a_damaged_value_does_not_open() {
        let (key, other) = (key(), key());
        let sealed = key.seal("acme", PLAIN);
        assert!(matches!(
            other.open("acme", &sealed),
            Err(OpenError::OtherKey { sealed_with, held }) if sealed_with == key.id() && held == other.id()
        ));
        assert_eq!(key.open("globex", &sealed).unwrap_err(), OpenError::Damaged);
        let mut text = sealed.as_str().to_owned();
        let last = text.pop().unwrap();
        text.push(if last == 'A' { 'B' } else { 'A' });
        assert_eq!(
            key.open("acme", &StoredSecret::from(text)).unwrap_err(),
            OpenError::Damaged
        );
        let cut = format!("sealed:v1:{}:AAAA", key.id());
        assert_eq!(
            key.open("acme", &StoredSecret::from(cut)).unwrap_err(),
            OpenError::Damaged
        );
    }

    #[test]
    fn a_secret_stored_before_sealing_still_opens() {
        let stored = StoredSecret::from(PLAIN.to_owned());
        assert!(!stored.is_sealed());
        let opened = key().open("acme", &stored).unwrap();
        assert_eq!(signature(&opened), signature(&Secret::parse(PLAIN).unwrap()));
        assert!(matches!(
            key().open("acme", &StoredSecret::from("nope".to_owned())),
            Err(OpenError::Unusable(_))
        ));
    }

    #[test]
    fn debug_shows_no_secret_and_no_key() {
        let text = SealingKey::generate_base64();
        let key = SealingKey::from_base64(&text).unwrap();
        let shown = format!(
            "{key:?} {:?} {:?}",
            key.seal("acme", PLAIN),
            StoredSecret::from(PLAIN.to_owned())
        );
        assert!(!shown.contains(&text) && !shown.contains("MfKQ9r8"), "{shown}");
        assert!(shown.contains(key.id()), "the id names the key: {shown}");
    }

    #[test]
    fn keys_are_checked() {
        assert_eq!(
            SealingKey::from_base64("not base64!").unwrap_err(),
            KeyError::Malformed
        );
        assert_eq!(
            SealingKey::from_base64(&STANDARD.encode([7u8; 16])).unwrap_err(),
            KeyError::Malformed
        );
        let text = SealingKey::generate_base64();
        let (a, b) = (
            SealingKey::from_base64(&text).unwrap(),
            SealingKey::from_base64(&format!("  {text}\n")).unwrap(),
        );
        assert_eq!(a.id(), b.id(), "the same key has the same id");
        assert_ne!(a.id(), key().id());
    }

    #[test]
    fn the_key_file_is_made_0600_once_and_then_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys/webhook-secret.key");
        let first = SealingKey::load_or_create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        let dir_mode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(dir_mode & 0o777, 0o700, "{dir_mode:o}");
        let again = SealingKey::load_or_create(&path).unwrap();
        assert_eq!(first.id(), again.id(), "the file is read, not replaced");
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "{leftovers:?}");

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(SealingKey::load_or_create(&path).unwrap().id(), first.id());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "restricted again: {mode:o}");

        std::fs::write(&path, "short").unwrap();
        let err = SealingKey::load_or_create(&path).unwrap_err().to_string();
        assert!(
            err.contains("webhook-secret.key") && err.contains("base64"),
            "{err}"
        );
    }
}
