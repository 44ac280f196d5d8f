//! Buckets: one limit each — `(scope, dimension, rule, capacity)` — and the arithmetic
//! of taking from them, refilling them and settling what a job took.
//!
//! - Which buckets exist comes from the config ([`configured`]): tenant limits and
//!   budgets, and each provider model's limits.
//! - Which buckets a job must fit, and how much it takes from each, is its *path*
//!   ([`path`]): its tenant's buckets plus its target's.
//! - The level of a bucket is what can be taken now. Rolling buckets refill continuously
//!   (`capacity` per `window_secs`); fixed windows refill all at once at `resets_at`;
//!   gauges (concurrency) refill only when holders give back.
//! - Settling ([`refund`]) replaces a job's estimate with its actual use.
//!
//! Provider accounting stays explicit: OpenAI counts `max_tokens` against TPM at request
//! time (`tpm` = input + output estimate); Anthropic limits input (`itpm`) and output
//! (`otpm`) separately and corrects output at the end; Groq's request limit is per day
//! (`rpd`).

use chrono::{DateTime, Datelike, TimeZone, Utc};

use crate::config::{Config, ModelLimits, ModelPrice};
use crate::keyring::Keyring;
use crate::model::Usage;
use crate::routing::Target;
use crate::tenants::{Budget, BudgetWindow, TenantLimits};
use crate::vocab::{Dimension, PriceSource, Rule};
use strum::VariantArray;

/// A bucket as configured: what `buckets` rows are synced from.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketSpec {
    pub key: String,
    pub scope: String,
    pub dimension: Dimension,
    pub rule: Rule,
    pub capacity: f64,
    pub window_secs: i64,
    /// Ramp buckets: growth allowed per window.
    pub ramp_step: Option<f64>,
}

const MINUTE: i64 = 60;
const DAY: i64 = 86_400;
/// A fixed window of a week resets at Monday 00:00 UTC.
pub const WEEK: i64 = 7 * DAY;
/// A fixed window of this length is a calendar month: it resets on the first, 00:00 UTC.
pub const MONTH: i64 = 31 * DAY;

fn spec(
    scope: &str,
    name: &str,
    dimension: Dimension,
    rule: Rule,
    capacity: f64,
    window_secs: i64,
) -> BucketSpec {
    BucketSpec {
        key: format!("{scope}:{name}"),
        scope: scope.to_owned(),
        dimension,
        rule,
        capacity,
        window_secs,
        ramp_step: (rule == Rule::Ramp).then_some(capacity),
    }
}

pub fn tenant_scope(tenant: &str) -> String {
    format!("tenant:{tenant}")
}

pub fn target_scope(provider: &str, model: &str) -> String {
    format!("provider:{provider}:{model}")
}

/// The scope of the limits one provider account (a quota pool) has for `model`: the
/// learned limits of the keys of `account` when a model's keys are in several pools
/// (`crate::keyring::Keyring::pool_account`). A `:` in the account is not kept, so the
/// model (which may hold `:`) is still the rest of the scope.
pub fn pool_scope(provider: &str, account: &str, model: &str) -> String {
    format!("pool:{provider}:{}:{model}", account.replace(':', "_"))
}

/// A pool's bucket key (`pool:<p>:<account>:<model>:<limit>`, a learned limit or probe
/// of [`pool_scope`]) as its provider and what follows the account: the buckets of one
/// model's pools for one limit share both and differ in the account.
pub fn pool_bucket_siblings(key: &str) -> Option<(&str, &str)> {
    let (provider, rest) = key.strip_prefix("pool:")?.split_once(':')?;
    let (_account, model_limit) = rest.split_once(':')?;
    Some((provider, model_limit))
}

/// The scope a target's learned limits live under: its pool's, when its key's account is
/// one of several serving the model, else the model's (every key in one pool).
pub fn learned_scope(provider: &str, model: &str, pool: Option<&str>) -> String {
    match pool {
        Some(account) => pool_scope(provider, account, model),
        None => target_scope(provider, model),
    }
}

/// [`learned_scope`] of a call to `provider`'s `model` with key `name`: the key's pool is
/// its account where the model's keys are in several ([`Keyring::pool_account`]).
pub fn key_learned_scope(
    config: &Config,
    keyring: &Keyring,
    provider: &str,
    model: &str,
    name: Option<&str>,
) -> String {
    let pool = config
        .provider(provider)
        .zip(name)
        .and_then(|(p, name)| keyring.pool_account(p, model, name));
    learned_scope(provider, model, pool)
}

/// The provider and model of a target or pool scope (`provider:oai:gpt-4o` and
/// `pool:oai:org-a:gpt-4o` → `("oai", "gpt-4o")`).
pub fn scope_target(scope: &str) -> (&str, &str) {
    if let Some(rest) = scope.strip_prefix("pool:") {
        let (provider, rest) = rest.split_once(':').unwrap_or((rest, ""));
        return (provider, rest.split_once(':').map_or("", |(_, model)| model));
    }
    let rest = scope.strip_prefix("provider:").unwrap_or(scope);
    rest.split_once(':').unwrap_or((rest, ""))
}

/// Whether bucket `key` is held for a tenant — its own limits and budgets, its
/// applications', its API keys' — and so shown to that tenant alone (and the admin).
pub fn is_tenant_held(key: &str) -> bool {
    ["tenant:", "app:", "apikey:", "batch:"]
        .iter()
        .any(|p| key.starts_with(p))
}

/// The key prefixes of `tenant`'s own buckets and its applications'.
pub fn tenant_prefixes(tenant: &str) -> [String; 2] {
    [format!("{}:", tenant_scope(tenant)), format!("app:{tenant}:")]
}

/// The scope of the limits and budgets of a tenant's application (shared by its keys).
pub fn application_scope(tenant: &str, application: &str) -> String {
    format!("app:{tenant}:{application}")
}

/// The bucket of a batch's `max_cost_usd`: on the path of every line of the batch.
pub fn batch_cap_key(batch_id: &str) -> String {
    format!("batch:{batch_id}:max_cost")
}

/// Whether bucket `key` is a batch's cost cap ([`batch_cap_key`]).
pub fn is_batch_cap(key: &str) -> bool {
    key.starts_with("batch:")
}

/// The bucket of a batch's cost cap of `usd`: spend that never comes back (its window
/// outlasts any batch), so what its lines may cost together is reserved like a budget.
pub fn batch_cap_spec(batch_id: &str, usd: f64) -> BucketSpec {
    BucketSpec {
        key: batch_cap_key(batch_id),
        scope: format!("batch:{batch_id}"),
        dimension: Dimension::SpendMicroUsd,
        rule: Rule::Fixed,
        capacity: usd * 1e6,
        window_secs: 100 * 366 * DAY,
        ramp_step: None,
    }
}

/// The scope of a tenant's API key's own limits and budgets.
pub fn api_key_scope(id: uuid::Uuid) -> String {
    format!("apikey:{id}")
}

pub fn route_scope(alias: &str) -> String {
    format!("route:{alias}")
}

pub fn key_scope(provider: &str, key: &str) -> String {
    format!("key:{provider}:{key}")
}

/// The provider's enqueued-token pool of `model` (prompt tokens of its unfinished
/// batches): a gauge, held from admission until the provider batch ends.
pub fn batch_queue_key(provider: &str, model: &str) -> String {
    format!("{}:batch_queue_tokens", target_scope(provider, model))
}

fn batch_queue_spec(provider: &str, model: &str, tokens: u64) -> BucketSpec {
    spec(
        &target_scope(provider, model),
        "batch_queue_tokens",
        Dimension::InputTokens,
        Rule::Gauge,
        tokens as f64,
        0,
    )
}

/// The buckets of route `alias`: its own share, whichever target serves its jobs.
pub fn route_specs(alias: &str, limits: &ModelLimits) -> Vec<BucketSpec> {
    target_specs(&route_scope(alias), limits)
}

/// The buckets of provider key `name` of `provider`: its own limits, across models.
pub fn key_specs(provider: &str, name: &str, limits: &ModelLimits) -> Vec<BucketSpec> {
    target_specs(&key_scope(provider, name), limits)
}

/// Buckets of the provider's side (its models' and pools' limits, its keys'): they keep
/// headroom for requests in transit and the interactive reserve.
pub fn is_provider_side(key: &str) -> bool {
    ["provider:", "pool:", "key:"].iter().any(|p| key.starts_with(p))
}

/// The buckets of one provider model, from its configured limits.
fn target_specs(scope: &str, limits: &ModelLimits) -> Vec<BucketSpec> {
    let mut out = Vec::new();
    let mut add = |name, dim, rule, cap: Option<u64>, window| {
        if let Some(cap) = cap {
            out.push(spec(scope, name, dim, rule, cap as f64, window));
        }
    };
    add("rpm", Dimension::Requests, Rule::Rolling, limits.rpm, MINUTE);
    // OpenAI-style TPM counts input + max output at request time; Anthropic's "tokens"
    // limit is input + output too.
    add("tpm", Dimension::TotalTokens, Rule::Rolling, limits.tpm, MINUTE);
    add("itpm", Dimension::InputTokens, Rule::Rolling, limits.itpm, MINUTE);
    add(
        "otpm",
        Dimension::OutputTokens,
        Rule::Rolling,
        limits.otpm,
        MINUTE,
    );
    add("rpd", Dimension::Requests, Rule::Fixed, limits.rpd, DAY);
    add("ramp", Dimension::Requests, Rule::Ramp, limits.ramp_rpm, MINUTE);
    add(
        "concurrency",
        Dimension::Concurrency,
        Rule::Gauge,
        limits.concurrency,
        0,
    );
    out
}

/// The buckets of a tenant's or a key's limits and budgets, in `scope`.
pub fn limit_specs(scope: &str, limits: &TenantLimits, budgets: &[Budget]) -> Vec<BucketSpec> {
    let mut out = Vec::new();
    let mut add = |name, dim, rule, cap: Option<f64>, window| {
        if let Some(cap) = cap {
            out.push(spec(scope, name, dim, rule, cap, window));
        }
    };
    add(
        "rpm",
        Dimension::Requests,
        Rule::Rolling,
        limits.rpm.map(|v| v as f64),
        MINUTE,
    );
    add(
        "tpm",
        Dimension::TotalTokens,
        Rule::Rolling,
        limits.tpm.map(|v| v as f64),
        MINUTE,
    );
    add(
        "rpd",
        Dimension::Requests,
        Rule::Fixed,
        limits.rpd.map(|v| v as f64),
        DAY,
    );
    add(
        "concurrency",
        Dimension::Concurrency,
        Rule::Gauge,
        limits.concurrency.map(|v| v as f64),
        0,
    );
    for b in budgets {
        add(
            b.window.bucket_name(),
            Dimension::SpendMicroUsd,
            Rule::Fixed,
            Some((b.usd * 1e6).round()),
            window_secs(b.window),
        );
    }
    out
}

/// A budget window's length as its bucket records it (a calendar month is [`MONTH`]).
pub fn window_secs(window: BudgetWindow) -> i64 {
    match window {
        BudgetWindow::Day => DAY,
        BudgetWindow::Week => WEEK,
        BudgetWindow::Month => MONTH,
    }
}

/// Every provider-side bucket the config defines: its models', keys' and routes' limits.
/// Tenants' buckets come from the directory ([`tenant_specs`]).
pub fn configured(config: &Config) -> Vec<BucketSpec> {
    let mut out = Vec::new();
    for p in &config.providers {
        for model in &p.models {
            if let Some(limits) = p.limits_for(model) {
                out.extend(target_specs(&target_scope(&p.name, model), limits));
            }
        }
        if let Some(tokens) = p.batch_api.enqueued_tokens.filter(|_| p.batch_api.enabled) {
            for model in &p.models {
                out.push(batch_queue_spec(&p.name, model, tokens));
            }
        }
        for k in &p.keys {
            if let Some(limits) = &k.limits {
                out.extend(target_specs(&key_scope(&p.name, &k.name), limits));
            }
        }
    }
    for r in &config.routes {
        if let Some(limits) = &r.limits {
            out.extend(target_specs(&route_scope(&r.alias), limits));
        }
    }
    out
}

/// What a job is estimated to use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    pub input_tokens: f64,
    pub output_tokens: f64,
}

impl Demand {
    pub fn total_tokens(&self) -> f64 {
        self.input_tokens + self.output_tokens
    }
}

/// What a job's estimate costs on a target: micro-USD at its price, and where the price
/// comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EstimatedCost {
    pub micro_usd: f64,
    pub price_source: PriceSource,
}

impl Default for EstimatedCost {
    fn default() -> Self {
        Self {
            micro_usd: 0.0,
            price_source: PriceSource::Unpriced,
        }
    }
}

/// Spend in micro-USD: a price per million tokens times tokens is exactly micro-USD.
pub fn spend_micro_usd(price: Option<&ModelPrice>, input: f64, cached_input: f64, output: f64) -> f64 {
    let Some(p) = price else { return 0.0 };
    let cached_price = p.cached_input_per_mtok.unwrap_or(p.input_per_mtok);
    (input - cached_input).max(0.0) * p.input_per_mtok
        + cached_input * cached_price
        + output * p.output_per_mtok
}

/// How much a job with `demand` takes from a bucket of `dimension`.
pub fn amount(dimension: Dimension, demand: Demand, spend: f64) -> f64 {
    match dimension {
        Dimension::Requests | Dimension::Concurrency => 1.0,
        Dimension::InputTokens => demand.input_tokens,
        Dimension::OutputTokens => demand.output_tokens,
        Dimension::TotalTokens => demand.total_tokens(),
        Dimension::SpendMicroUsd => spend,
    }
}

/// The keys of the buckets a job sent to `target` must fit: the route's (when the job
/// asked for a route alias, `requested`), its holders' (`held`: its API key's, its
/// tenant's, the tenants' above), the target model's and the chosen provider key's
/// (`key_limits`, the file's or those it was added with:
/// [`crate::keyring::Keyring::limits`]).
pub fn path(
    config: &Config,
    held: &[(String, Dimension)],
    requested: &str,
    target: &Target,
    key_limits: Option<&ModelLimits>,
) -> Vec<(String, Dimension)> {
    let target_scope = target_scope(&target.provider, &target.model);
    let mut keys = Vec::new();
    if let Some(limits) = config
        .routes
        .iter()
        .find(|r| r.alias == requested)
        .and_then(|r| r.limits.as_ref())
    {
        for s in target_specs(&route_scope(requested), limits) {
            keys.push((s.key, s.dimension));
        }
    }
    keys.extend(held.iter().cloned());
    if let Some(p) = config.provider(&target.provider) {
        if let Some(limits) = p.limits_for(&target.model) {
            for s in target_specs(&target_scope, limits) {
                keys.push((s.key, s.dimension));
            }
        }
        if let Some((name, limits)) = target.key.as_deref().zip(key_limits) {
            for s in key_specs(&p.name, name, limits) {
                keys.push((s.key, s.dimension));
            }
        }
    }
    keys
}

/// What to give back to a bucket when a job's use is known: the estimate minus the
/// actual (negative when it used more), the actual being [`Settlement::used`] (the whole
/// reservation where that says nothing). The settling statement (`store::settle`) gives
/// back the same; a gauge's holding goes back whole whatever the job used.
pub fn refund(
    dimension: Dimension,
    reserved: f64,
    usage: Option<&Usage>,
    actual_spend: f64,
    sent: bool,
    charged_output: Option<f64>,
) -> f64 {
    let settlement = Settlement {
        usage: usage.copied(),
        actual_spend,
        sent,
        charged_output,
        saved: 0.0,
    };
    reserved - settlement.used(dimension).unwrap_or(reserved)
}

/// A bucket row with its level brought up to date.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    pub id: i64,
    pub key: String,
    pub dimension: Dimension,
    pub rule: Rule,
    pub capacity: f64,
    pub window_secs: i64,
    pub level: f64,
    pub updated_at: DateTime<Utc>,
    pub resets_at: Option<DateTime<Utc>>,
    /// Ramp buckets: growth allowed per window.
    pub ramp_step: Option<f64>,
    /// What the config says (`None` for buckets only learned).
    pub configured_capacity: Option<f64>,
    /// When a provider's reading or 429 last set the capacity (`None`: as configured).
    pub learned_at: Option<DateTime<Utc>>,
}

/// The next UTC midnight after `now`.
pub fn next_utc_midnight(now: DateTime<Utc>) -> DateTime<Utc> {
    let tomorrow = now.date_naive().succ_opt().unwrap_or(now.date_naive());
    Utc.with_ymd_and_hms(tomorrow.year(), tomorrow.month(), tomorrow.day(), 0, 0, 0)
        .single()
        .unwrap_or(now)
}

/// When a fixed window of `window_secs` that is open at `now` ends: the next midnight
/// (a day), the next Monday's ([`WEEK`]), the next month's first ([`MONTH`]), all UTC; a
/// longer window (a batch's cost cap) ends that long from `now`.
pub fn next_window_reset(now: DateTime<Utc>, window_secs: i64) -> DateTime<Utc> {
    let midnight = next_utc_midnight(now);
    match window_secs {
        WEEK => {
            let days = (7 - midnight.weekday().num_days_from_monday()) % 7;
            midnight + chrono::Duration::days(i64::from(days))
        }
        MONTH => {
            let (year, month) = match now.month() {
                12 => (now.year() + 1, 1),
                m => (now.year(), m + 1),
            };
            Utc.with_ymd_and_hms(year, month, 1, 0, 0, 0)
                .single()
                .unwrap_or(midnight)
        }
        // Longer than any calendar window (a batch's cost cap): one window from now.
        longer if longer > MONTH => now + chrono::Duration::seconds(longer),
        _ => midnight,
    }
}

impl Bucket {
    /// Refill per second of a rolling bucket.
    pub fn rate(&self) -> f64 {
        if self.rule == Rule::Rolling && self.window_secs > 0 {
            self.capacity / self.window_secs as f64
        } else {
            0.0
        }
    }

    /// Brings the level to `now`: continuous refill, or the window's reset.
    pub fn refill(&mut self, now: DateTime<Utc>) {
        match self.rule {
            Rule::Rolling => {
                let elapsed = (now - self.updated_at).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6;
                if elapsed > 0.0 {
                    self.level = (self.level + elapsed * self.rate()).min(self.capacity);
                    self.updated_at = now;
                }
            }
            Rule::Fixed => {
                match self.resets_at {
                    Some(at) if now >= at => {
                        self.level = self.capacity;
                        self.resets_at = Some(next_window_reset(now, self.window_secs));
                    }
                    None => self.resets_at = Some(next_window_reset(now, self.window_secs)),
                    _ => {}
                }
                self.updated_at = now;
            }
            Rule::Gauge => self.updated_at = now,
            Rule::Ramp => {
                let window = chrono::Duration::seconds(self.window_secs.max(1));
                let step = self.ramp_step.unwrap_or(self.capacity);
                match self.resets_at {
                    Some(at) if now >= at => {
                        // A window passed idle in between used nothing.
                        let used = if now >= at + window {
                            0.0
                        } else {
                            (self.capacity - self.level).max(0.0)
                        };
                        self.capacity = (used + step).max(step);
                        self.level = self.capacity;
                        self.resets_at = Some(if now >= at + window {
                            now + window
                        } else {
                            at + window
                        });
                    }
                    None => self.resets_at = Some(now + window),
                    _ => {}
                }
                self.updated_at = now;
            }
        }
    }

    /// Can `amount` be taken now, keeping `headroom` in reserve? The headroom never makes
    /// a job that fits a full bucket impossible: it shrinks to what the job leaves free.
    pub fn fits(&self, amount: f64, headroom: f64) -> bool {
        amount <= self.level - self.kept(amount, headroom) + 1e-9
    }

    /// What of `headroom` is kept back beside `amount`: never more than the amount leaves
    /// of a full bucket (a job larger than capacity less headroom still fits a full one).
    pub fn kept(&self, amount: f64, headroom: f64) -> f64 {
        headroom.min((self.capacity - amount).max(0.0))
    }

    /// Would `amount` ever fit (a full bucket can hold it)?
    pub fn can_ever_fit(&self, amount: f64) -> bool {
        // A ramp's allowance grows with use; anything fits eventually.
        self.rule == Rule::Ramp || amount <= self.capacity + 1e-9
    }

    pub fn take(&mut self, amount: f64) {
        self.level -= amount;
    }

    /// Settles a refund: what a job did not use comes back (never above capacity); a
    /// negative refund takes what it used beyond its estimate.
    pub fn give_back(&mut self, refund: f64) {
        self.level = (self.level + refund).min(self.capacity);
    }

    /// When `amount` will fit, if it is only a matter of time; `None` for gauges (they
    /// wait for a release, whose time is unknown).
    pub fn ready_at(&self, amount: f64, headroom: f64, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let missing = amount + self.kept(amount, headroom) - self.level;
        if missing <= 0.0 {
            return Some(now);
        }
        match self.rule {
            Rule::Rolling if self.rate() > 0.0 => {
                let secs = missing / self.rate();
                Some(now + chrono::Duration::microseconds((secs * 1e6).ceil() as i64))
            }
            Rule::Fixed | Rule::Ramp => self.resets_at,
            Rule::Rolling | Rule::Gauge => None,
        }
    }

    /// The headroom a provider bucket keeps: `headroom_secs` of refill.
    pub fn headroom(&self, headroom_secs: f64) -> f64 {
        self.rate() * headroom_secs
    }
}

/// How a reservation ends: what the job really used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settlement {
    /// Usage the provider reported, if it reported any.
    pub usage: Option<Usage>,
    /// Actual spend in micro-USD (0 without usage or prices).
    pub actual_spend: f64,
    /// Whether the request reached the provider (its limits count it even if it failed).
    pub sent: bool,
    /// Output the provider counts against its token limits whatever was generated (its
    /// `max_tokens`, for providers that charge it up front).
    pub charged_output: Option<f64>,
    /// What the call saved against the online price, in micro-USD: a cheaper lane's
    /// discount (a provider batch, the flex tier); 0 online.
    pub saved: f64,
}

impl Settlement {
    /// What the job counts as having used of `dimension`; `None`: what it reserved (the
    /// provider reported no usage to replace the estimate, or a request is a request).
    /// A request that never reached the provider used nothing (failed requests that did
    /// still count against provider limits); a concurrency slot is always given back.
    ///
    /// `charged_output` is the output a provider counts against its token limit whatever
    /// was generated (OpenAI counts `max_tokens` against TPM when the request starts and
    /// never gives it back), so a total-token bucket keeps it.
    pub fn used(&self, dimension: Dimension) -> Option<f64> {
        if dimension == Dimension::Concurrency || !self.sent {
            return Some(0.0);
        }
        let u = self.usage?;
        match dimension {
            Dimension::Requests => None,
            Dimension::InputTokens => Some(u.input_tokens as f64),
            Dimension::OutputTokens => Some(u.output_tokens as f64),
            Dimension::TotalTokens => {
                Some(u.input_tokens as f64 + (u.output_tokens as f64).max(self.charged_output.unwrap_or(0.0)))
            }
            Dimension::SpendMicroUsd => Some(self.actual_spend),
            Dimension::Concurrency => Some(0.0),
        }
    }

    /// [`Self::used`] of each dimension it says something of, keyed by the dimension's
    /// name: what the settling statement reads (`store::settle`).
    pub fn used_by_dimension(&self) -> serde_json::Value {
        Dimension::VARIANTS
            .iter()
            .filter_map(|&d| Some((<&str>::from(d).to_owned(), serde_json::Value::from(self.used(d)?))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// The job never left: everything goes back.
    pub const UNSENT: Settlement = Settlement {
        usage: None,
        actual_spend: 0.0,
        sent: false,
        charged_output: None,
        saved: 0.0,
    };
    /// Sent, outcome unknown (holder died, call failed): keep what rate limits count, give
    /// back the concurrency slot.
    pub const SENT_UNKNOWN: Settlement = Settlement {
        usage: None,
        actual_spend: 0.0,
        sent: true,
        charged_output: None,
        saved: 0.0,
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provider_batch_api_has_a_bucket_of_enqueued_tokens_per_model() {
        let example = include_str!("../tollgate.example.toml");
        let with_batch_api = example.replacen(
            "# [providers.batch_api]\n# enabled = true\n",
            "[providers.batch_api]\nenabled = true\nenqueued_tokens = 2000000\n",
            1,
        );
        assert_ne!(
            with_batch_api, example,
            "the example has a batch_api block to switch on"
        );
        let config = Config::parse(&with_batch_api, "t.toml").unwrap();
        let keys: Vec<String> = configured(&config).into_iter().map(|b| b.key).collect();
        assert!(
            keys.iter()
                .any(|k| k == "provider:oai:gpt-4o-mini:batch_queue_tokens"),
            "{keys:?}"
        );
        let without = configured(&Config::parse(example, "t.toml").unwrap());
        assert!(!without.iter().any(|b| b.key.ends_with(":batch_queue_tokens")));
    }

    fn bucket(rule: Rule, capacity: f64, level: f64, at: DateTime<Utc>) -> Bucket {
        Bucket {
            id: 1,
            key: "k".into(),
            dimension: Dimension::Requests,
            rule,
            capacity,
            window_secs: if rule == Rule::Fixed { DAY } else { MINUTE },
            level,
            updated_at: at,
            resets_at: None,
            ramp_step: (rule == Rule::Ramp).then_some(capacity),
            configured_capacity: Some(capacity),
            learned_at: None,
        }
    }

    #[test]
    fn ramp_allows_last_windows_use_plus_the_step() {
        let t0 = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
        let mut b = bucket(Rule::Ramp, 10.0, 10.0, t0);
        b.refill(t0);
        b.take(10.0);
        assert!(!b.fits(1.0, 0.0));
        assert_eq!(b.ready_at(1.0, 0.0, t0), Some(t0 + chrono::Duration::seconds(60)));
        // Used 10 in the first minute: the next allows 20.
        b.refill(t0 + chrono::Duration::seconds(60));
        assert_eq!((b.capacity, b.level), (20.0, 20.0));
        b.take(5.0);
        // Used only 5: the next allows 15.
        b.refill(t0 + chrono::Duration::seconds(121));
        assert_eq!(b.capacity, 15.0);
        // An idle minute in between: back to the step.
        b.refill(t0 + chrono::Duration::seconds(400));
        assert_eq!(b.capacity, 10.0);
        assert!(b.can_ever_fit(50.0));
    }

    #[test]
    fn rolling_refills_continuously_up_to_capacity() {
        let t0 = Utc::now();
        let mut b = bucket(Rule::Rolling, 60.0, 0.0, t0);
        b.refill(t0 + chrono::Duration::seconds(10));
        assert!((b.level - 10.0).abs() < 1e-6);
        b.refill(t0 + chrono::Duration::seconds(1000));
        assert_eq!(b.level, 60.0);
        b.take(59.5);
        assert!(b.fits(0.5, 0.0) && !b.fits(1.0, 0.0));
        let at = b.ready_at(1.0, 0.0, b.updated_at).unwrap();
        assert_eq!((at - b.updated_at).num_milliseconds(), 500);
    }

    #[test]
    fn fixed_window_resets_at_utc_midnight() {
        let t0 = Utc.with_ymd_and_hms(2026, 11, 29, 23, 0, 0).unwrap();
        let mut b = bucket(Rule::Fixed, 100.0, 100.0, t0);
        b.refill(t0);
        assert_eq!(
            b.resets_at,
            Some(Utc.with_ymd_and_hms(2026, 11, 30, 0, 0, 0).unwrap())
        );
        b.take(100.0);
        b.refill(t0 + chrono::Duration::minutes(59));
        assert_eq!(b.level, 0.0);
        assert_eq!(b.ready_at(1.0, 0.0, t0), b.resets_at);
        b.refill(t0 + chrono::Duration::minutes(61));
        assert_eq!(b.level, 100.0);
        assert_eq!(
            b.resets_at,
            Some(Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap())
        );
    }

    #[test]
    fn weekly_and_monthly_windows_reset_on_monday_and_on_the_first() {
        let at = |y, m, d, h| Utc.with_ymd_and_hms(y, m, d, h, 0, 0).unwrap();
        // 2026-12-04 is a Friday.
        assert_eq!(next_window_reset(at(2026, 12, 4, 10), WEEK), at(2026, 12, 7, 0));
        assert_eq!(next_window_reset(at(2026, 12, 6, 23), WEEK), at(2026, 12, 7, 0));
        assert_eq!(next_window_reset(at(2026, 12, 7, 0), WEEK), at(2026, 12, 14, 0));
        assert_eq!(next_window_reset(at(2026, 12, 4, 10), MONTH), at(2027, 1, 1, 0));
        assert_eq!(next_window_reset(at(2027, 1, 31, 23), MONTH), at(2027, 2, 1, 0));
        assert_eq!(next_window_reset(at(2027, 1, 31, 23), DAY), at(2027, 2, 1, 0));
        let mut b = bucket(Rule::Fixed, 100.0, 0.0, at(2026, 12, 4, 10));
        b.window_secs = MONTH;
        b.refill(at(2026, 12, 4, 10));
        b.refill(at(2026, 12, 31, 23));
        assert_eq!(b.level, 0.0, "a month's budget does not come back at midnight");
        b.refill(at(2027, 1, 1, 0));
        assert_eq!((b.level, b.resets_at), (100.0, Some(at(2027, 2, 1, 0))));
    }

    #[test]
    fn gauges_do_not_refill_by_time() {
        let t0 = Utc::now();
        let mut b = bucket(Rule::Gauge, 2.0, 0.0, t0);
        b.refill(t0 + chrono::Duration::hours(1));
        assert_eq!(b.level, 0.0);
        assert_eq!(b.ready_at(1.0, 0.0, t0), None);
    }

    #[test]
    fn refunds_replace_estimates_with_actuals() {
        let u = Usage {
            input_tokens: 100,
            output_tokens: 20,
            cached_tokens: 0,
        };
        assert_eq!(
            refund(Dimension::TotalTokens, 300.0, Some(&u), 0.0, true, None),
            180.0
        );
        // Charged max_tokens of 150 stays charged: only the input estimate is corrected.
        assert_eq!(
            refund(Dimension::TotalTokens, 300.0, Some(&u), 0.0, true, Some(150.0)),
            50.0
        );
        assert_eq!(
            refund(Dimension::OutputTokens, 10.0, Some(&u), 0.0, true, None),
            -10.0
        );
        assert_eq!(refund(Dimension::Requests, 1.0, Some(&u), 0.0, true, None), 0.0);
        assert_eq!(refund(Dimension::Concurrency, 1.0, None, 0.0, true, None), 1.0);
        assert_eq!(refund(Dimension::TotalTokens, 300.0, None, 0.0, true, None), 0.0);
        assert_eq!(
            refund(Dimension::TotalTokens, 300.0, None, 0.0, false, None),
            300.0
        );
        assert_eq!(
            refund(Dimension::SpendMicroUsd, 50.0, Some(&u), 20.0, true, None),
            30.0
        );
    }

    #[test]
    fn spend_is_tokens_times_price_per_million() {
        let p = ModelPrice {
            input_per_mtok: 0.15,
            output_per_mtok: 0.6,
            cached_input_per_mtok: Some(0.075),
            batch_discount: None,
        };
        let micro = spend_micro_usd(Some(&p), 1000.0, 200.0, 100.0);
        assert!((micro - (800.0 * 0.15 + 200.0 * 0.075 + 100.0 * 0.6)).abs() < 1e-9);
        assert_eq!(spend_micro_usd(None, 1000.0, 0.0, 10.0), 0.0);
    }

    mod properties {
        //! The bucket arithmetic under random sequences of refills, reservations and
        //! settlements: a level never goes over capacity, never below zero by more than
        //! jobs used beyond their estimates, and what is reserved and refunded adds up to
        //! what was used.

        use proptest::prelude::*;

        use super::*;

        #[derive(Debug, Clone)]
        enum Op {
            /// Time passes (milliseconds).
            Wait(u32),
            /// A job reserves this much, if it fits (with this headroom).
            Reserve(u32, u16),
            /// The oldest open reservation settles: it used this fraction of its estimate
            /// (above 1.0: more than estimated), or was never sent.
            Settle { used: f64, sent: bool },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0u32..120_000).prop_map(Op::Wait),
                (1u32..5_000, 0u16..500).prop_map(|(a, h)| Op::Reserve(a, h)),
                (0.0f64..3.0, any::<bool>()).prop_map(|(used, sent)| Op::Settle { used, sent }),
            ]
        }

        fn rule() -> impl Strategy<Value = Rule> {
            prop_oneof![
                Just(Rule::Rolling),
                Just(Rule::Fixed),
                Just(Rule::Gauge),
                Just(Rule::Ramp)
            ]
        }

        const EPS: f64 = 1e-6;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

            #[test]
            fn levels_stay_within_capacity_and_overdraw_only_by_overuse(
                rule in rule(),
                capacity in 1.0f64..100_000.0,
                ops in proptest::collection::vec(op(), 1..80),
            ) {
                let t0 = Utc.with_ymd_and_hms(2030, 1, 1, 23, 0, 0).unwrap();
                let mut b = bucket(rule, capacity, capacity, t0);
                let mut now = t0;
                let mut open: std::collections::VecDeque<f64> = Default::default();
                let mut overuse = 0.0;
                for op in ops {
                    match op {
                        Op::Wait(ms) => {
                            now += chrono::Duration::milliseconds(ms.into());
                            let before = b.level;
                            b.refill(now);
                            if rule == Rule::Rolling || rule == Rule::Gauge {
                                prop_assert!(b.level >= before - EPS, "a refill took tokens away");
                            }
                        }
                        Op::Reserve(amount, headroom) => {
                            let (amount, headroom) = (f64::from(amount), f64::from(headroom));
                            if b.fits(amount, headroom) {
                                b.take(amount);
                                open.push_back(amount);
                                prop_assert!(b.level >= -overuse - EPS, "a reservation overdrew: {b:?}");
                            } else if b.level >= amount + headroom.min((b.capacity - amount).max(0.0)) + EPS {
                                prop_assert!(false, "{amount} did not fit a level of {}", b.level);
                            }
                        }
                        Op::Settle { used, sent } => {
                            let Some(reserved) = open.pop_front() else { continue };
                            let actual = (reserved * used).round();
                            let usage = Usage { input_tokens: actual as i64, output_tokens: 0, cached_tokens: 0 };
                            let refund = refund(Dimension::InputTokens, reserved, Some(&usage), 0.0, sent, None);
                            if sent {
                                prop_assert!((reserved - refund - actual).abs() < EPS, "reserved - refund = used");
                                overuse += (actual - reserved).max(0.0);
                            } else {
                                prop_assert_eq!(refund, reserved, "an unsent request costs nothing");
                            }
                            b.give_back(refund);
                        }
                    }
                    prop_assert!(b.level <= b.capacity + EPS, "over capacity: {b:?}");
                    prop_assert!(b.level >= -overuse - EPS, "negative beyond overuse {overuse}: {b:?}");
                    prop_assert!(b.level.is_finite() && b.capacity.is_finite());
                }
            }

            #[test]
            fn without_refill_reservations_and_refunds_conserve_tokens(
                capacity in 1.0f64..1_000_000.0,
                steps in proptest::collection::vec((1u32..10_000, 0.0f64..1.0, any::<bool>(), any::<bool>()), 1..60),
            ) {
                // A gauge never refills by itself: every token is accounted for by
                // what is still reserved and what settled reservations used.
                let t0 = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
                let mut b = bucket(Rule::Gauge, capacity, capacity, t0);
                let (mut outstanding, mut used_total) = (Vec::new(), 0.0);
                for (amount, used, sent, settle) in steps {
                    let amount = f64::from(amount);
                    if b.fits(amount, 0.0) {
                        b.take(amount);
                        outstanding.push(amount);
                    }
                    if settle && let Some(reserved) = outstanding.pop() {
                        let actual = (reserved * used).floor();
                        let usage = Usage { input_tokens: 0, output_tokens: actual as i64, cached_tokens: 0 };
                        b.give_back(refund(Dimension::OutputTokens, reserved, Some(&usage), 0.0, sent, None));
                        if sent {
                            used_total += actual;
                        }
                    }
                    let accounted = b.level + outstanding.iter().sum::<f64>() + used_total;
                    prop_assert!((accounted - capacity).abs() < 1e-6 * capacity.max(1.0), "{accounted} != {capacity}");
                }
            }

            #[test]
            fn refunds_return_exactly_the_unused_estimate(
                reserved in 0.0f64..1e7,
                input in 0i64..10_000_000,
                output in 0i64..10_000_000,
                charged in proptest::option::of(0.0f64..1e6),
                spend in 0.0f64..1e9,
            ) {
                let usage = Usage { input_tokens: input, output_tokens: output, cached_tokens: 0 };
                let total = input as f64 + (output as f64).max(charged.unwrap_or(0.0));
                for (dimension, actual) in [
                    (Dimension::InputTokens, input as f64),
                    (Dimension::OutputTokens, output as f64),
                    (Dimension::TotalTokens, total),
                    (Dimension::SpendMicroUsd, spend),
                    (Dimension::Requests, reserved),
                    (Dimension::Concurrency, 0.0),
                ] {
                    let r = refund(dimension, reserved, Some(&usage), spend, true, charged);
                    prop_assert!((reserved - r - actual).abs() < 1e-6 * reserved.max(actual).max(1.0), "{dimension:?}");
                    // Not sent, or no usage reported: never more than the estimate back.
                    prop_assert_eq!(refund(dimension, reserved, Some(&usage), spend, false, charged), reserved);
                    let none = refund(dimension, reserved, None, spend, true, charged);
                    prop_assert!(none == 0.0 || (dimension == Dimension::Concurrency && none == reserved));
                }
            }
        }
    }
}
