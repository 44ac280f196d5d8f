//! Standard Webhooks signatures (spec v1.0.0, symmetric scheme): the secret is
//! `whsec_` + base64 of random bytes; a message is signed as
//! `v1,<base64 HMAC-SHA256(secret, "{webhook-id}.{webhook-timestamp}.{body}")>` and sent
//! with the `webhook-id`, `webhook-timestamp` and `webhook-signature` headers.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The event types tollgate sends.
pub const EVENT_TYPES: [&str; 7] = [
    "job.completed",
    "job.failed",
    "batch.completed",
    "batch.failed",
    "batch.expired",
    "batch.cancelled",
    "budget.threshold",
];

/// Header names, as the spec spells them.
pub const HEADER_ID: &str = "webhook-id";
pub const HEADER_TIMESTAMP: &str = "webhook-timestamp";
pub const HEADER_SIGNATURE: &str = "webhook-signature";

const PREFIX: &str = "whsec_";

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("a webhook secret must start with `whsec_`")]
    Prefix,
    #[error("a webhook secret must be `whsec_` followed by base64")]
    Base64,
    #[error("a webhook secret must hold 24 to 64 bytes")]
    Length,
}

/// A signing secret's key bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Parses `whsec_<base64>`; the key must be 24 to 64 bytes, as the spec asks.
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        let b64 = text.strip_prefix(PREFIX).ok_or(SecretError::Prefix)?;
        let key = STANDARD.decode(b64).map_err(|_| SecretError::Base64)?;
        if !(24..=64).contains(&key.len()) {
            return Err(SecretError::Length);
        }
        Ok(Self(key))
    }

    /// A new random secret (32 bytes), in its `whsec_` form.
    pub fn generate() -> String {
        let key: [u8; 32] = rand::random();
        format!("{PREFIX}{}", STANDARD.encode(key))
    }

    /// The `webhook-signature` header value for this message.
    pub fn sign(&self, msg_id: &str, timestamp: i64, body: &[u8]) -> String {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut mac = match Hmac::<Sha256>::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC takes keys of any length"),
        };
        mac.update(msg_id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference libraries' test vector (standard-webhooks `libraries/*` tests).
    #[test]
    fn signs_like_the_reference_implementation() {
        let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let sig = secret.sign(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn secrets_are_checked() {
        assert_eq!(
            Secret::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap_err(),
            SecretError::Prefix
        );
        assert_eq!(Secret::parse("whsec_!!!").unwrap_err(), SecretError::Base64);
        assert_eq!(Secret::parse("whsec_c2hvcnQ=").unwrap_err(), SecretError::Length);
        let generated = Secret::generate();
        assert!(Secret::parse(&generated).is_ok(), "{generated}");
    }
}
