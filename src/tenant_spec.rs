//! What a tenant is, as stored and as given: its limits, budgets and settings, and the
//! rules a name and each value follow. A leaf of the core (it imports nothing of it), so
//! the config's `[[tenants]]` and the admin API check tenants by the same rules.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Longest tenant name: names are parts of bucket keys and Prometheus labels.
pub const MAX_TENANT_NAME: usize = 64;

/// A tenant's own limits across all its jobs; each is optional.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u64>,
    /// Tokens (input + output) per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    /// Requests per UTC day.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpd: Option<u64>,
    /// Provider calls in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u64>,
}

/// The calendar window a budget resets on (UTC): midnight, Monday's midnight, the first
/// of the month.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum BudgetWindow {
    Day,
    Week,
    Month,
}

impl BudgetWindow {
    /// The name of its bucket (`tenant:acme:daily_spend`).
    pub fn bucket_name(self) -> &'static str {
        match self {
            BudgetWindow::Day => "daily_spend",
            BudgetWindow::Week => "weekly_spend",
            BudgetWindow::Month => "monthly_spend",
        }
    }
}

/// Spend allowed per window, in USD, priced with `providers[].prices`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    pub window: BudgetWindow,
    pub usd: f64,
}

/// What a tenant may keep stored and how fast it may call one API process, where it has
/// its own (else `[quotas]` and `server.api_rate_per_sec` / `api_burst`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_files: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_stored_file_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_rate_per_sec: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_burst: Option<f64>,
}

/// Limits and budgets of something within a tenant — one of its applications, or one of
/// its keys — reserved on top of the tenant's own.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Allowance {
    #[serde(default)]
    pub limits: TenantLimits,
    #[serde(default)]
    pub budgets: Vec<Budget>,
}

impl Allowance {
    pub fn is_empty(&self) -> bool {
        self.limits == TenantLimits::default() && self.budgets.is_empty()
    }
}

/// A tenant as stored: what the admin API and the config file give.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantSpec {
    pub name: String,
    pub weight: u32,
    pub parent: Option<String>,
    pub limits: TenantLimits,
    pub budgets: Vec<Budget>,
    /// Its applications' own limits and budgets, by application name: every key labelled
    /// with the application shares them.
    pub applications: BTreeMap<String, Allowance>,
    pub settings: TenantSettings,
}

/// Who wrote a tenant or key last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The config file (at start and on `SIGHUP`).
    File,
    /// The admin API.
    Api,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::File => "file",
            Source::Api => "api",
        }
    }

    pub fn parse(text: &str) -> Self {
        if text == "file" { Source::File } else { Source::Api }
    }
}

/// Why a tenant as given cannot be stored: the field, and the reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidTenant {
    pub field: String,
    pub reason: String,
}

fn invalid(field: &str, reason: impl Into<String>) -> InvalidTenant {
    InvalidTenant {
        field: field.to_owned(),
        reason: reason.into(),
    }
}

/// Whether `name` may name a tenant (or a key, an application): names are parts of
/// bucket scopes (`tenant:<name>:…`) and of prefix filters, so a `:` or `/` in one would
/// let tenant `a` match `a:b`'s rows.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TENANT_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The reason [`valid_name`] refuses a name.
pub fn name_rule() -> String {
    format!("must be 1 to {MAX_TENANT_NAME} of A-Z a-z 0-9 - _ . (it is part of bucket scopes)")
}

/// The first thing wrong with `limits` and `budgets` (a tenant's or a key's), naming the
/// field.
pub fn check_limits(limits: &TenantLimits, budgets: &[Budget]) -> Result<(), InvalidTenant> {
    check_limits_at("", limits, budgets)
}

/// [`check_limits`] of fields under `prefix` (`applications.chatbot.`).
fn check_limits_at(prefix: &str, limits: &TenantLimits, budgets: &[Budget]) -> Result<(), InvalidTenant> {
    for (field, value) in [
        ("limits.rpm", limits.rpm),
        ("limits.tpm", limits.tpm),
        ("limits.rpd", limits.rpd),
        ("limits.concurrency", limits.concurrency),
    ] {
        if value == Some(0) {
            return Err(invalid(
                &format!("{prefix}{field}"),
                "must be at least 1 (leave it out for no limit)",
            ));
        }
    }
    let mut windows = std::collections::HashSet::new();
    for (i, b) in budgets.iter().enumerate() {
        if !(b.usd.is_finite() && b.usd >= 0.0 && b.usd < 1e9) {
            return Err(invalid(
                &format!("{prefix}budgets[{i}].usd"),
                "must be a number of USD from 0 to 1e9",
            ));
        }
        if !windows.insert(b.window) {
            return Err(invalid(
                &format!("{prefix}budgets[{i}].window"),
                "one budget per window",
            ));
        }
    }
    Ok(())
}

impl TenantSpec {
    /// The first thing wrong with it, naming the field.
    pub fn check(&self) -> Result<(), InvalidTenant> {
        if !valid_name(&self.name) {
            return Err(invalid("name", name_rule()));
        }
        if self.weight == 0 {
            return Err(invalid("weight", "must be at least 1"));
        }
        if self.parent.as_deref() == Some(self.name.as_str()) {
            return Err(invalid("parent", "a tenant cannot be its own parent"));
        }
        if self.parent.as_deref().is_some_and(|p| !valid_name(p)) {
            return Err(invalid("parent", name_rule()));
        }
        check_limits(&self.limits, &self.budgets)?;
        for (name, allowance) in &self.applications {
            if !valid_name(name) {
                return Err(invalid(&format!("applications.{name}"), name_rule()));
            }
            check_limits_at(
                &format!("applications.{name}."),
                &allowance.limits,
                &allowance.budgets,
            )?;
        }
        let s = &self.settings;
        if s.api_rate_per_sec.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
            return Err(invalid("settings.api_rate_per_sec", "must be a positive number"));
        }
        if s.api_burst.is_some_and(|b| !(b.is_finite() && b >= 1.0)) {
            return Err(invalid("settings.api_burst", "must be at least 1"));
        }
        Ok(())
    }
}
