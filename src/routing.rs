//! Routing: the `model` a client asks for → the provider targets that may serve it, in
//! order of preference. A route alias names its targets; `provider/model` is its own
//! single target.

use crate::config::{Config, ProviderKind};

/// One place a request can go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub provider: String,
    pub kind: ProviderKind,
    pub model: String,
    /// The provider key to use, when the gate chose one (per-key limits or model
    /// filters); `None` = any of the provider's keys that serves the model.
    pub key: Option<String>,
}

impl Target {
    pub fn label(&self) -> String {
        format!("{}/{}", self.provider, self.model)
    }
}

/// Resolves a requested model; `None` when it is neither a route alias nor a configured
/// `provider/model`.
pub fn resolve(config: &Config, requested: &str) -> Option<Vec<Target>> {
    let target = |spec: &str| {
        config.provider_target(spec).map(|(p, m)| Target {
            provider: p.name.clone(),
            kind: p.kind,
            model: m.to_owned(),
            key: None,
        })
    };
    if let Some(route) = config.routes.iter().find(|r| r.alias == requested) {
        return route.targets.iter().map(|t| target(t)).collect();
    }
    target(requested).map(|t| vec![t])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_and_direct_targets() {
        let c = Config::parse(
            r#"
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://127.0.0.1:1/v1"
keys = [{ name = "k", value = "v" }]
models = ["m1"]
[[providers]]
name = "ant"
kind = "anthropic"
base_url = "http://127.0.0.1:1"
keys = [{ name = "k", value = "v" }]
models = ["c1"]
[[routes]]
alias = "fast"
targets = ["oai/m1", "ant/c1"]
[[tenants]]
name = "t"
api_key = "k"
"#,
            "t.toml",
        )
        .unwrap();
        let fast = resolve(&c, "fast").unwrap();
        assert_eq!(
            fast.iter().map(Target::label).collect::<Vec<_>>(),
            ["oai/m1", "ant/c1"]
        );
        assert_eq!(fast[1].kind, ProviderKind::Anthropic);
        assert_eq!(resolve(&c, "ant/c1").unwrap().len(), 1);
        assert!(resolve(&c, "gpt-4o").is_none());
        assert!(resolve(&c, "oai/c1").is_none());
    }
}
