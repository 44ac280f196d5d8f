//! Operator pauses: an operator stops admission for a tenant's queue, a route or a
//! provider model until they resume it.
//!
//! They live in `pauses` beside the providers' own pauses (a 429's Retry-After, a rejected
//! key), with reason [`OPERATOR`] and an `until` no real pause reaches ([`held_until`]):
//! every gate reads `pauses` each round and every dispatcher checks it when claiming, so
//! an operator's pause holds on every process at once, with no extra read on the
//! admission path. What it does:
//! - a **tenant**: none of its queued jobs is admitted (what was admitted goes on);
//! - a **route** (an alias): none of the jobs sent to it is admitted;
//! - a **provider model**: like a provider's pause of it that never ends — jobs fail over
//!   to their route's next target, or wait; admitted jobs wait too.
//!
//! A job held waits whatever its deadline says (it is not failed as unmeetable: the
//! operator, not capacity, holds it) and explains itself as `paused_by_operator`.

use std::collections::HashMap;

use chrono::{DateTime, TimeZone, Utc};

use crate::buckets;

/// The `reason` of an operator's pause.
pub const OPERATOR: &str = "operator";

/// The admission note of a job an operator's pause holds.
pub const PAUSED_BY_OPERATOR: &str = "paused_by_operator";

/// The `until` of every operator's pause: the last day of year 9999.
pub fn held_until() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(9999, 12, 31, 0, 0, 0)
        .single()
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// Whether a pause lasting until `until` is an operator's.
pub fn is_operator(until: DateTime<Utc>) -> bool {
    until >= held_until()
}

/// What an operator pauses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    Tenant(String),
    Route(String),
    Model { provider: String, model: String },
}

impl Held {
    /// Its scope in `pauses`: `tenant:<name>`, `route:<alias>`, `provider:<p>:<model>`
    /// (the scope a provider's 429 pauses too).
    pub fn scope(&self) -> String {
        match self {
            Held::Tenant(t) => format!("tenant:{t}"),
            Held::Route(alias) => format!("route:{alias}"),
            Held::Model { provider, model } => buckets::target_scope(provider, model),
        }
    }

    /// What a scope pauses (`None` for a rejected key's scope).
    pub fn from_scope(scope: &str) -> Option<Held> {
        if let Some(t) = scope.strip_prefix("tenant:") {
            return Some(Held::Tenant(t.to_owned()));
        }
        if let Some(alias) = scope.strip_prefix("route:") {
            return Some(Held::Route(alias.to_owned()));
        }
        scope.starts_with("provider:").then(|| {
            let (provider, model) = buckets::scope_target(scope);
            Held::Model {
                provider: provider.to_owned(),
                model: model.to_owned(),
            }
        })
    }

    /// `tenant`, `route` or `model`.
    pub fn kind(&self) -> &'static str {
        match self {
            Held::Tenant(_) => "tenant",
            Held::Route(_) => "route",
            Held::Model { .. } => "model",
        }
    }
}

/// The operator's pause that holds a job of `tenant` sent to `requested` (its route alias
/// or `provider/model`), if any, among the active pauses `paused` (scope → until).
pub fn holding(paused: &HashMap<String, DateTime<Utc>>, tenant: &str, requested: &str) -> Option<String> {
    [Held::Tenant(tenant.to_owned()), Held::Route(requested.to_owned())]
        .into_iter()
        .map(|h| h.scope())
        .find(|scope| paused.contains_key(scope))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_name_what_they_hold_and_read_back() {
        for held in [
            Held::Tenant("acme".into()),
            Held::Route("fast".into()),
            Held::Model {
                provider: "oai".into(),
                model: "gpt-4o-mini".into(),
            },
        ] {
            assert_eq!(Held::from_scope(&held.scope()), Some(held));
        }
        assert_eq!(Held::from_scope("key:oai:main"), None);
    }

    #[test]
    fn a_job_is_held_by_its_tenant_or_its_route_not_by_others() {
        let paused: HashMap<String, DateTime<Utc>> = HashMap::from([
            ("tenant:acme".to_owned(), held_until()),
            ("route:slow".to_owned(), held_until()),
        ]);
        assert_eq!(holding(&paused, "acme", "fast").as_deref(), Some("tenant:acme"));
        assert_eq!(holding(&paused, "globex", "slow").as_deref(), Some("route:slow"));
        assert_eq!(holding(&paused, "globex", "fast"), None);
        assert!(is_operator(held_until()));
        assert!(!is_operator(Utc::now()));
    }
}
