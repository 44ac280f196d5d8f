//! Routing: the `model` a client asks for → the provider targets that may serve it, in
//! order of preference. A route alias names its targets; `provider/model` is its own
//! single target; a bare model name that is no alias (`gpt-4o-mini`) goes to every
//! provider listing it, in the config's order. Only targets whose provider kind serves the
//! request's endpoint are kept.

use crate::config::{Config, ProviderKind};
use crate::vocab::Endpoint;

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

/// Why a requested model has no target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unresolved {
    /// Neither a route alias, a configured `provider/model`, nor a model a provider lists.
    UnknownModel,
    /// Its targets exist, but none is of a provider kind that serves the endpoint.
    EndpointNotServed,
}

/// The targets that may serve `requested` for a request of `endpoint`, in order of
/// preference.
pub fn resolve(config: &Config, requested: &str, endpoint: Endpoint) -> Result<Vec<Target>, Unresolved> {
    let all = targets(config, requested).ok_or(Unresolved::UnknownModel)?;
    let serving: Vec<Target> = all.into_iter().filter(|t| t.kind.serves(endpoint)).collect();
    if serving.is_empty() {
        return Err(Unresolved::EndpointNotServed);
    }
    Ok(serving)
}

/// Every target of `requested`, whatever it serves; `None` when it names none.
fn targets(config: &Config, requested: &str) -> Option<Vec<Target>> {
    let target = |provider: &crate::config::ProviderConfig, model: &str| Target {
        provider: provider.name.clone(),
        kind: provider.kind,
        model: model.to_owned(),
        key: None,
    };
    if let Some(route) = config.routes.iter().find(|r| r.alias == requested) {
        return route
            .targets
            .iter()
            .map(|t| config.provider_target(t).map(|(p, m)| target(p, m)))
            .collect();
    }
    if let Some((p, m)) = config.provider_target(requested) {
        return Some(vec![target(p, m)]);
    }
    let listing: Vec<Target> = config
        .providers
        .iter()
        .filter(|p| p.models.iter().any(|m| m == requested))
        .map(|p| target(p, requested))
        .collect();
    (!listing.is_empty()).then_some(listing)
}

/// The names a client may put in `model`: every route alias, every `provider/model`, and
/// every model a provider lists, each once, in the config's order.
pub fn names(config: &Config) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let aliases = config.routes.iter().map(|r| r.alias.clone());
    let qualified = config
        .providers
        .iter()
        .flat_map(|p| p.models.iter().map(move |m| format!("{}/{m}", p.name)));
    let bare = config.providers.iter().flat_map(|p| p.models.iter().cloned());
    aliases
        .chain(qualified)
        .chain(bare)
        .filter(|n| seen.insert(n.clone()))
        .collect()
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
        let chat = Endpoint::ChatCompletions;
        let labels = |t: Vec<Target>| t.iter().map(Target::label).collect::<Vec<_>>();
        let fast = resolve(&c, "fast", chat).unwrap();
        assert_eq!(fast[1].kind, ProviderKind::Anthropic);
        assert_eq!(labels(fast), ["oai/m1", "ant/c1"]);
        assert_eq!(resolve(&c, "ant/c1", chat).unwrap().len(), 1);
        assert_eq!(resolve(&c, "gpt-4o", chat), Err(Unresolved::UnknownModel));
        assert_eq!(resolve(&c, "oai/c1", chat), Err(Unresolved::UnknownModel));
        // A model a provider lists is a name of its own.
        assert_eq!(labels(resolve(&c, "c1", chat).unwrap()), ["ant/c1"]);
        // Embeddings keep the targets that serve them.
        let embeddings = Endpoint::Embeddings;
        assert_eq!(labels(resolve(&c, "fast", embeddings).unwrap()), ["oai/m1"]);
        assert_eq!(
            resolve(&c, "ant/c1", embeddings),
            Err(Unresolved::EndpointNotServed)
        );
        assert_eq!(names(&c), ["fast", "oai/m1", "ant/c1", "m1", "c1"]);
    }
}
