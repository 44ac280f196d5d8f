//! Text from outside made safe to store and to show: U+0000, which PostgreSQL's `text`
//! and `jsonb` cannot hold, and secrets a provider quotes back in its error messages.
//!
//! Client text holding U+0000 is refused at the edge ([`first_nul`] finds it); a
//! provider's answer is not the client's fault, so there it is replaced ([`replace_nul`]).
//! A provider's error message reaches the tenant as the job's error, so key-like tokens
//! in it — a masked key (`sk-proj-…abcd`), an organization or project id — are cut to
//! their prefix first ([`redact_secrets`]).

use serde_json::Value;

/// U+0000, which PostgreSQL's `text` and `jsonb` cannot hold: text from outside that
/// carries it is refused at the edge ([`first_nul`]) or, when it comes from a provider,
/// has it replaced ([`replace_nul`]) before anything is written.
pub const NUL: char = '\0';

/// The JSON pointer of the first string — object key or value — holding U+0000, if any.
pub fn first_nul(value: &Value) -> Option<String> {
    fn walk(value: &Value, at: &mut String) -> bool {
        match value {
            Value::String(s) => s.contains(NUL),
            Value::Array(items) => items.iter().enumerate().any(|(i, item)| {
                let len = at.len();
                at.push('/');
                at.push_str(&i.to_string());
                let found = walk(item, at);
                if !found {
                    at.truncate(len);
                }
                found
            }),
            Value::Object(fields) => fields.iter().any(|(key, item)| {
                let len = at.len();
                at.push('/');
                at.push_str(&key.replace('~', "~0").replace('/', "~1").replace(NUL, "\\u0000"));
                let found = key.contains(NUL) || walk(item, at);
                if !found {
                    at.truncate(len);
                }
                found
            }),
            _ => false,
        }
    }
    let mut at = String::new();
    walk(value, &mut at).then_some(at)
}

/// Replaces U+0000 in every string of `value` (keys too) with U+FFFD.
pub fn replace_nul(value: &mut Value) {
    match value {
        Value::String(s) => replace_nul_in(s),
        Value::Array(items) => items.iter_mut().for_each(replace_nul),
        Value::Object(fields) => {
            if fields.keys().any(|k| k.contains(NUL)) {
                *fields = std::mem::take(fields)
                    .into_iter()
                    .map(|(k, v)| (k.replace(NUL, "\u{FFFD}"), v))
                    .collect();
            }
            fields.values_mut().for_each(replace_nul);
        }
        _ => {}
    }
}

/// Replaces U+0000 in `text` with U+FFFD.
pub fn replace_nul_in(text: &mut String) {
    if text.contains(NUL) {
        *text = text.replace(NUL, "\u{FFFD}");
    }
}

/// Prefixes of the secrets and account ids providers quote in their messages: OpenAI keys
/// (`sk-`, `sk-proj-`, `sk-svcacct-`, `sk-admin-`), Anthropic keys (`sk-ant-`), Google
/// API keys (`AIza`), OpenAI organization and project ids (`org-`, `proj_`).
const SECRET_PREFIXES: [&str; 5] = ["sk-", "sk_", "AIza", "org-", "proj_"];
/// A token of key characters at least this long is taken for a secret, whatever it starts with.
const SECRET_TOKEN_CHARS: usize = 32;

/// `message` with every key-like token cut to its prefix and `…`: a token starting with a
/// [`SECRET_PREFIXES`] entry (`sk-proj-****abcd` → `sk-…`), or a run of at least
/// [`SECRET_TOKEN_CHARS`] key characters (letters, digits, `-`, `_`, `*`, `.`) that is not
/// a UUID.
pub fn redact_secrets(message: &str) -> String {
    let is_key_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '*' | '.' | '…');
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(start) = rest.find(is_key_char) {
        out.push_str(&rest[..start]);
        let token_len = rest[start..]
            .find(|c: char| !is_key_char(c))
            .unwrap_or(rest.len() - start);
        let whole = &rest[start..start + token_len];
        // A sentence's full stop is not part of the token (but a lone `.` is one).
        let token = match whole.trim_end_matches('.') {
            "" => whole,
            trimmed => trimmed,
        };
        match SECRET_PREFIXES
            .iter()
            .find(|p| token.starts_with(**p) && token.len() > p.len())
        {
            Some(prefix) => {
                out.push_str(prefix);
                out.push('…');
            }
            // Ids (UUIDs) are long too, and say which job or batch: kept.
            None if token.chars().count() >= SECRET_TOKEN_CHARS
                && !token.contains("..")
                && uuid::Uuid::parse_str(token).is_err() =>
            {
                out.push('…')
            }
            None => out.push_str(token),
        }
        rest = &rest[start + token.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finds_nul_in_values_and_keys_and_replaces_it() {
        assert_eq!(
            first_nul(&json!({"a": [1, "ok", {"b": "x\u{0}y"}]})),
            Some("/a/2/b".into())
        );
        assert_eq!(first_nul(&json!({"k\u{0}": 1})), Some("/k\\u0000".into()));
        assert_eq!(first_nul(&json!({"a/b": ["\u{0}"]})), Some("/a~1b/0".into()));
        assert_eq!(first_nul(&json!({"clean": ["text", 1, null]})), None);

        let mut v = json!({"k\u{0}": ["a\u{0}b", {"c": "\u{0}"}]});
        replace_nul(&mut v);
        assert_eq!(v, json!({"k\u{FFFD}": ["a\u{FFFD}b", {"c": "\u{FFFD}"}]}));
        assert_eq!(first_nul(&v), None);
    }

    #[test]
    fn keys_and_account_ids_in_provider_messages_are_cut_to_their_prefix() {
        let cases = [
            (
                "Incorrect API key provided: sk-proj-****abcd. You can find your API key at https://platform.openai.com/account/api-keys.",
                "Incorrect API key provided: sk-…. You can find your API key at https://platform.openai.com/account/api-keys.",
            ),
            (
                "Rate limit reached for gpt-4o in organization org-Ab12Cd on tokens per min (TPM): Limit 30000",
                "Rate limit reached for gpt-4o in organization org-… on tokens per min (TPM): Limit 30000",
            ),
            ("invalid x-api-key sk-ant-api03-AAAA", "invalid x-api-key sk-…"),
            ("API key not valid: AIzaSyA1b2C3", "API key not valid: AIza…"),
            ("project proj_9xYz has no access", "project proj_… has no access"),
            ("token 0123456789abcdef0123456789abcdef0 leaked", "token … leaked"),
            (
                "upstream (gpt-4o-mini) timed out after 30 s",
                "upstream (gpt-4o-mini) timed out after 30 s",
            ),
        ];
        for (message, want) in cases {
            assert_eq!(redact_secrets(message), want, "{message}");
        }
        // Whatever the text, it ends, and text without secrets is left as it is.
        for plain in ["", ".", "...", "a.", "…", "x…y.", " . . ", "é.-_*", "-"] {
            assert_eq!(redact_secrets(plain), plain, "{plain:?}");
        }
    }
}
