//! `tollgate tenants …`, `tollgate keys …` and `tollgate provider-keys …`: the admin API
//! from the command line (the admin key); and `tollgate apply FILE [--dry-run]`, the
//! file's tenants applied to its database, the difference printed. Money is in USD.

use clap::{Args, Subcommand};
use reqwest::Method;
use serde_json::{Map, Value, json};
use tollgate::config::Config;
use tollgate::control;
use tollgate::db::Database;
use tollgate::tenants::{Seed, TenantSpec};

use super::table::{Align, Table, fields};
use super::{Remote, cell, print_json, segment, when};

#[derive(Debug, Args)]
pub struct TenantsArgs {
    #[command(subcommand)]
    pub command: TenantsCommand,
}

/// A tenant's settings as flags: each given one is set.
#[derive(Debug, Default, Args)]
pub struct TenantFlags {
    /// Share of contended capacity relative to other tenants.
    #[arg(long)]
    weight: Option<u32>,
    /// A tenant whose limits and budgets also cover this one.
    #[arg(long)]
    parent: Option<String>,
    #[command(flatten)]
    limits: LimitFlags,
}

/// Limits and budgets (a tenant's or a key's) as flags: each given one is set.
#[derive(Debug, Default, Args)]
pub struct LimitFlags {
    /// Requests per minute.
    #[arg(long)]
    rpm: Option<u64>,
    /// Tokens (input + output) per minute.
    #[arg(long)]
    tpm: Option<u64>,
    /// Requests per UTC day.
    #[arg(long)]
    rpd: Option<u64>,
    /// Provider calls in flight at once.
    #[arg(long)]
    concurrency: Option<u64>,
    /// Budget per UTC day, in USD.
    #[arg(long)]
    daily_usd: Option<f64>,
    /// Budget per week (from Monday 00:00 UTC), in USD.
    #[arg(long)]
    weekly_usd: Option<f64>,
    /// Budget per calendar month (UTC), in USD.
    #[arg(long)]
    monthly_usd: Option<f64>,
}

#[derive(Debug, Subcommand)]
pub enum TenantsCommand {
    /// Every tenant.
    List {
        /// Print the server's JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// One tenant.
    Get {
        name: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Create a tenant.
    Create {
        name: String,
        #[command(flatten)]
        flags: TenantFlags,
        #[command(flatten)]
        remote: Remote,
    },
    /// Change what the flags give (limits and budgets not named stay).
    Update {
        name: String,
        #[command(flatten)]
        flags: TenantFlags,
        /// Remove the tenant's parent.
        #[arg(long, conflicts_with = "parent")]
        no_parent: bool,
        /// Set the limit and budget flags on this application of the tenant (shared by its
        /// keys labelled with it) instead of on the tenant.
        #[arg(long)]
        application: Option<String>,
        /// Remove this application's limits and budgets.
        #[arg(long, conflicts_with = "application")]
        remove_application: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Delete a tenant and its keys (refused while it has jobs not finished or children).
    Delete {
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
}

#[derive(Debug, Args)]
pub struct KeysArgs {
    #[command(subcommand)]
    pub command: KeysCommand,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// A tenant's keys, newest first, revoked ones too.
    List {
        tenant: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Create a key for a tenant and print its secret (shown this once).
    Create {
        tenant: String,
        /// What the key is for.
        #[arg(long, default_value = "default")]
        name: String,
        /// The tenant's application that uses it.
        #[arg(long)]
        application: Option<String>,
        /// When it stops working (RFC 3339).
        #[arg(long)]
        expires_at: Option<String>,
        /// Its own limits and budgets, on top of its tenant's.
        #[command(flatten)]
        limits: LimitFlags,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Revoke a key: refused by every server process within a second.
    Revoke {
        tenant: String,
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
}

impl LimitFlags {
    /// The limits the flags set, over `limits`.
    fn limits(&self, mut limits: Map<String, Value>) -> Map<String, Value> {
        for (name, value) in [
            ("rpm", self.rpm),
            ("tpm", self.tpm),
            ("rpd", self.rpd),
            ("concurrency", self.concurrency),
        ] {
            if let Some(v) = value {
                limits.insert(name.to_owned(), json!(v));
            }
        }
        limits
    }

    /// The budgets the flags set, over `budgets` (one per window).
    fn budgets(&self, budgets: &[Value]) -> Vec<Value> {
        let mut out: Vec<Value> = budgets.to_vec();
        for (window, usd) in [
            ("day", self.daily_usd),
            ("week", self.weekly_usd),
            ("month", self.monthly_usd),
        ] {
            if let Some(usd) = usd {
                out.retain(|b| b["window"] != window);
                out.push(json!({"window": window, "usd": usd}));
            }
        }
        out
    }

    /// `{"limits", "budgets"}` of `before` (a tenant, an application) with the flags set
    /// over them.
    fn over(&self, before: &Value) -> Value {
        json!({
            "limits": self.limits(before["limits"].as_object().cloned().unwrap_or_default()),
            "budgets": self.budgets(before["budgets"].as_array().map_or(&[], Vec::as_slice)),
        })
    }

    fn sets_limits(&self) -> bool {
        self.rpm.or(self.tpm).or(self.rpd).or(self.concurrency).is_some()
    }

    fn sets_budgets(&self) -> bool {
        self.daily_usd.or(self.weekly_usd).or(self.monthly_usd).is_some()
    }
}

/// A tenant's limits as `rpm 60, tpm 100000`.
fn limits_text(limits: &Value) -> String {
    let parts: Vec<String> = limits
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, v)| format!("{name} {}", cell(v)))
        .collect();
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(", ")
    }
}

/// A tenant's budgets as `$5.00/day, $100.00/month`.
fn budgets_text(budgets: &Value) -> String {
    let parts: Vec<String> = budgets
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| format!("${:.2}/{}", b["usd"].as_f64().unwrap_or(0.0), cell(&b["window"])))
        .collect();
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(", ")
    }
}

/// A tenant's applications as `chatbot: rpm 60, $5.00/day; search: $1.00/day`.
fn applications_text(applications: &Value) -> String {
    let parts: Vec<String> = applications
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, a)| {
            let own: Vec<String> = [limits_text(&a["limits"]), budgets_text(&a["budgets"])]
                .into_iter()
                .filter(|t| t != "-")
                .collect();
            format!(
                "{name}: {}",
                if own.is_empty() {
                    "-".to_owned()
                } else {
                    own.join(", ")
                }
            )
        })
        .collect();
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join("; ")
    }
}

fn render_tenant(t: &Value) -> String {
    fields(&[
        ("NAME", cell(&t["name"])),
        ("WEIGHT", cell(&t["weight"])),
        ("PARENT", cell(&t["parent"])),
        ("LIMITS", limits_text(&t["limits"])),
        ("BUDGETS", budgets_text(&t["budgets"])),
        ("APPLICATIONS", applications_text(&t["applications"])),
        ("SOURCE", cell(&t["source"])),
        ("UPDATED", when(&t["updated_at"])),
    ])
}

pub async fn tenants(args: TenantsArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    match args.command {
        TenantsCommand::List { json, remote } => {
            let Some(tenants) = remote.table_items(&http, "/v1/admin/tenants", json).await? else {
                return Ok(true);
            };
            let mut t = Table::new(&[
                ("NAME", Align::Left),
                ("WEIGHT", Align::Right),
                ("PARENT", Align::Left),
                ("LIMITS", Align::Left),
                ("BUDGETS", Align::Left),
                ("SOURCE", Align::Left),
            ]);
            for tenant in &tenants {
                t.row(vec![
                    cell(&tenant["name"]),
                    cell(&tenant["weight"]),
                    cell(&tenant["parent"]),
                    limits_text(&tenant["limits"]),
                    budgets_text(&tenant["budgets"]),
                    cell(&tenant["source"]),
                ]);
            }
            print!("{}", t.render_or("(no tenants)"));
            Ok(true)
        }
        TenantsCommand::Get { name, json, remote } => {
            let t = remote
                .get(&http, &format!("/v1/admin/tenants/{}", segment(&name)))
                .await?;
            if json {
                print_json(&t)?;
            } else {
                print!("{}", render_tenant(&t));
            }
            Ok(true)
        }
        TenantsCommand::Create { name, flags, remote } => {
            let mut body = json!({
                "name": name,
                "limits": flags.limits.limits(Map::new()),
                "budgets": flags.limits.budgets(&[]),
            });
            if let Some(weight) = flags.weight {
                body["weight"] = json!(weight);
            }
            if let Some(parent) = &flags.parent {
                body["parent"] = json!(parent);
            }
            let t = remote
                .json(&http, Method::POST, "/v1/admin/tenants", Some(&body))
                .await?;
            print!("{}", render_tenant(&t));
            Ok(true)
        }
        TenantsCommand::Update {
            name,
            flags,
            no_parent,
            application,
            remove_application,
            remote,
        } => {
            let path = format!("/v1/admin/tenants/{}", segment(&name));
            let mut change = Map::new();
            let limits = &flags.limits;
            let sets = limits.sets_limits() || limits.sets_budgets();
            if sets || application.is_some() || remove_application.is_some() {
                let before = remote.get(&http, &path).await?;
                let mut applications = before["applications"].as_object().cloned().unwrap_or_default();
                if let Some(app) = &remove_application {
                    applications.remove(app);
                }
                match &application {
                    Some(app) => {
                        let own = applications.get(app).cloned().unwrap_or_else(|| json!({}));
                        applications.insert(app.clone(), limits.over(&own));
                    }
                    None if sets => {
                        change.extend(limits.over(&before).as_object().cloned().unwrap_or_default())
                    }
                    None => {}
                }
                if application.is_some() || remove_application.is_some() {
                    change.insert("applications".to_owned(), Value::Object(applications));
                }
            }
            if let Some(weight) = flags.weight {
                change.insert("weight".to_owned(), json!(weight));
            }
            if let Some(parent) = &flags.parent {
                change.insert("parent".to_owned(), json!(parent));
            }
            if no_parent {
                change.insert("parent".to_owned(), Value::Null);
            }
            let t = remote
                .json(&http, Method::PATCH, &path, Some(&Value::Object(change)))
                .await?;
            print!("{}", render_tenant(&t));
            Ok(true)
        }
        TenantsCommand::Delete { name, remote } => {
            let path = format!("/v1/admin/tenants/{}", segment(&name));
            remote.json(&http, Method::DELETE, &path, None).await?;
            println!("tenant {name} deleted");
            Ok(true)
        }
    }
}

#[derive(Debug, Args)]
pub struct ProviderKeysArgs {
    #[command(subcommand)]
    pub command: ProviderKeysCommand,
}

#[derive(Debug, Subcommand)]
pub enum ProviderKeysCommand {
    /// Every provider key: the config file's and those added at runtime (never a value).
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Add a provider key; its value is read from the environment variable `--value-env`
    /// names (default TOLLGATE_PROVIDER_KEY), so it appears in no command line.
    Add {
        provider: String,
        name: String,
        #[arg(long, default_value = "TOLLGATE_PROVIDER_KEY")]
        value_env: String,
        /// Its share of the provider's requests.
        #[arg(long)]
        weight: Option<u32>,
        /// A model it may serve (repeat for more; default all of its provider's).
        #[arg(long = "model")]
        models: Vec<String>,
        /// The provider account (quota pool) it is in, where responses do not name it
        /// (a Gemini key's Google Cloud project).
        #[arg(long)]
        account: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Rotate a key added at runtime: its new value from `--value-env`'s variable.
    Rotate {
        provider: String,
        name: String,
        #[arg(long, default_value = "TOLLGATE_PROVIDER_KEY")]
        value_env: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Stop sending with a key (the config file's too), on every process within a second.
    Disable {
        provider: String,
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Send with a disabled key again.
    Enable {
        provider: String,
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Remove a key added at runtime.
    Remove {
        provider: String,
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
}

/// The value of the variable `var`, or why there is none.
fn key_value(var: &str) -> anyhow::Result<String> {
    std::env::var(var)
        .map_err(|_| anyhow::anyhow!("set the provider key's value in the environment variable {var}"))
}

pub async fn provider_keys(args: ProviderKeysArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    let path = |provider: &str, name: &str| {
        format!("/v1/admin/provider-keys/{}/{}", segment(provider), segment(name))
    };
    let (what, answer) = match args.command {
        ProviderKeysCommand::List { json, remote } => {
            let Some(keys) = remote.table_items(&http, "/v1/admin/provider-keys", json).await? else {
                return Ok(true);
            };
            let mut t = Table::new(&[
                ("PROVIDER", Align::Left),
                ("NAME", Align::Left),
                ("SOURCE", Align::Left),
                ("WEIGHT", Align::Right),
                ("MODELS", Align::Left),
                ("ACCOUNT", Align::Left),
                ("DISABLED", Align::Left),
            ]);
            for k in &keys {
                let models: Vec<String> = k["models"].as_array().into_iter().flatten().map(cell).collect();
                t.row(vec![
                    cell(&k["provider"]),
                    cell(&k["name"]),
                    cell(&k["source"]),
                    cell(&k["weight"]),
                    if models.is_empty() {
                        "all".to_owned()
                    } else {
                        models.join(",")
                    },
                    cell(&k["account"]),
                    if k["disabled"] == true {
                        "yes".to_owned()
                    } else {
                        "-".to_owned()
                    },
                ]);
            }
            print!("{}", t.render_or("(no provider keys)"));
            return Ok(true);
        }
        ProviderKeysCommand::Add {
            provider,
            name,
            value_env,
            weight,
            models,
            account,
            remote,
        } => {
            let body = json!({"provider": provider, "name": name, "value": key_value(&value_env)?,
                              "weight": weight, "models": models, "account": account});
            let added = remote
                .json(&http, Method::POST, "/v1/admin/provider-keys", Some(&body))
                .await?;
            ("added", added)
        }
        ProviderKeysCommand::Rotate {
            provider,
            name,
            value_env,
            remote,
        } => {
            let body = json!({"value": key_value(&value_env)?});
            let changed = remote
                .json(&http, Method::PATCH, &path(&provider, &name), Some(&body))
                .await?;
            ("rotated", changed)
        }
        ProviderKeysCommand::Disable {
            provider,
            name,
            remote,
        } => {
            let body = json!({"disabled": true});
            let changed = remote
                .json(&http, Method::PATCH, &path(&provider, &name), Some(&body))
                .await?;
            ("disabled", changed)
        }
        ProviderKeysCommand::Enable {
            provider,
            name,
            remote,
        } => {
            let body = json!({"disabled": false});
            let changed = remote
                .json(&http, Method::PATCH, &path(&provider, &name), Some(&body))
                .await?;
            ("enabled", changed)
        }
        ProviderKeysCommand::Remove {
            provider,
            name,
            remote,
        } => {
            let removed = remote
                .json(&http, Method::DELETE, &path(&provider, &name), None)
                .await?;
            ("removed", removed)
        }
    };
    println!(
        "provider key {}/{} {what}",
        cell(&answer["provider"]),
        cell(&answer["name"])
    );
    Ok(true)
}

pub async fn keys(args: KeysArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    match args.command {
        KeysCommand::List { tenant, json, remote } => {
            let path = format!("/v1/admin/tenants/{}/keys", segment(&tenant));
            let Some(keys) = remote.table_items(&http, &path, json).await? else {
                return Ok(true);
            };
            let mut t = Table::new(&[
                ("ID", Align::Left),
                ("NAME", Align::Left),
                ("APPLICATION", Align::Left),
                ("PREFIX", Align::Left),
                ("CREATED", Align::Left),
                ("LAST USED", Align::Left),
                ("EXPIRES", Align::Left),
                ("REVOKED", Align::Left),
            ]);
            for k in &keys {
                t.row(vec![
                    cell(&k["id"]),
                    cell(&k["name"]),
                    cell(&k["application"]),
                    cell(&k["prefix"]),
                    when(&k["created_at"]),
                    when(&k["last_used_at"]),
                    when(&k["expires_at"]),
                    when(&k["revoked_at"]),
                ]);
            }
            print!("{}", t.render_or("(no keys)"));
            Ok(true)
        }
        KeysCommand::Create {
            tenant,
            name,
            application,
            expires_at,
            limits,
            json,
            remote,
        } => {
            let path = format!("/v1/admin/tenants/{}/keys", segment(&tenant));
            let body = json!({
                "name": name,
                "application": application,
                "expires_at": expires_at,
                "limits": limits.limits(Map::new()),
                "budgets": limits.budgets(&[]),
            });
            let k = remote.json(&http, Method::POST, &path, Some(&body)).await?;
            if json {
                print_json(&k)?;
            } else {
                print!(
                    "{}",
                    fields(&[
                        ("ID", cell(&k["id"])),
                        ("TENANT", cell(&k["tenant"])),
                        ("NAME", cell(&k["name"])),
                        ("LIMITS", limits_text(&k["limits"])),
                        ("BUDGETS", budgets_text(&k["budgets"])),
                        ("EXPIRES", when(&k["expires_at"])),
                        ("KEY", cell(&k["key"])),
                    ])
                );
                eprintln!("(the key is shown this once: store it now)");
            }
            Ok(true)
        }
        KeysCommand::Revoke { tenant, id, remote } => {
            let path = format!("/v1/admin/tenants/{}/keys/{}", segment(&tenant), segment(&id));
            let k = remote.json(&http, Method::DELETE, &path, None).await?;
            println!("key {} of {tenant} revoked", cell(&k["id"]));
            Ok(true)
        }
    }
}

/// A tenant's settings in a line: `weight 3, parent unit, rpm 60, $5.00/month`.
fn spec_text(spec: &TenantSpec) -> String {
    let mut parts = vec![format!("weight {}", spec.weight)];
    parts.extend(spec.parent.as_ref().map(|p| format!("parent {p}")));
    let limits = serde_json::to_value(spec.limits).unwrap_or(Value::Null);
    let budgets = serde_json::to_value(&spec.budgets).unwrap_or(Value::Null);
    parts.extend(
        [limits_text(&limits), budgets_text(&budgets)]
            .into_iter()
            .filter(|t| t != "-"),
    );
    parts.join(", ")
}

/// What differs between `before` and `after`, field by field.
fn spec_changes(before: &TenantSpec, after: &TenantSpec) -> String {
    let mut changes = Vec::new();
    if before.weight != after.weight {
        changes.push(format!("weight {} → {}", before.weight, after.weight));
    }
    if before.parent != after.parent {
        let show = |p: &Option<String>| p.clone().unwrap_or_else(|| "-".to_owned());
        changes.push(format!(
            "parent {} → {}",
            show(&before.parent),
            show(&after.parent)
        ));
    }
    let limits = |s: &TenantSpec| limits_text(&serde_json::to_value(s.limits).unwrap_or(Value::Null));
    if before.limits != after.limits {
        changes.push(format!("limits {} → {}", limits(before), limits(after)));
    }
    let budgets = |s: &TenantSpec| budgets_text(&serde_json::to_value(&s.budgets).unwrap_or(Value::Null));
    if before.budgets != after.budgets {
        changes.push(format!("budgets {} → {}", budgets(before), budgets(after)));
    }
    if before.settings != after.settings {
        changes.push("quotas or API rate".to_owned());
    }
    if changes.is_empty() {
        // Written by the admin API before; now the file's again.
        changes.push("taken back by the file".to_owned());
    }
    changes.join("; ")
}

/// `tollgate apply FILE [--dry-run]`: the file's tenants and keys applied to the database
/// of its `[database]` (as `serve` applies them at start and on `SIGHUP`), the difference
/// printed; with `--dry-run`, printed only.
pub async fn apply(file: &std::path::Path, dry_run: bool) -> anyhow::Result<bool> {
    let config = Config::load(file)?;
    let seed = Seed::from_config(&config).map_err(anyhow::Error::msg)?;
    let db = Database::open(&config.database).await?;
    let now = tollgate::store::database_time(&db.pool).await?;
    let applied = if dry_run {
        control::plan_seed(&db.pool, &seed, now).await?
    } else {
        control::apply_seed(&db.pool, &seed, now).await?
    };
    for (before, after) in &applied.changes {
        match before {
            None => println!("+ tenant {}: {}", after.name, spec_text(after)),
            Some(before) => println!("~ tenant {}: {}", after.name, spec_changes(before, after)),
        }
    }
    for tenant in &applied.keys {
        println!("~ key of tenant {tenant}: the file's key set");
    }
    if !applied.untouched.is_empty() {
        println!(
            "= {} tenant(s) the file does not name, left as they are: {}",
            applied.untouched.len(),
            applied.untouched.join(", ")
        );
    }
    let summary = format!(
        "{} created, {} updated, {} key(s) set",
        applied.created().len(),
        applied.updated().len(),
        applied.keys.len()
    );
    match (dry_run, applied.changed()) {
        (_, false) => println!("nothing to change"),
        (true, true) => println!("dry run: {summary}; nothing applied"),
        (false, true) => println!("applied: {summary}; in force on every process within a second"),
    }
    db.close().await?;
    Ok(true)
}

#[derive(Debug, Args)]
pub struct PausesArgs {
    #[command(subcommand)]
    pub command: PausesCommand,
}

#[derive(Debug, Subcommand)]
pub enum PausesCommand {
    /// Every pause in force: the operators' and those providers caused.
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Pause a tenant's queue, a route or a provider model until resumed: nothing of it is
    /// admitted (a paused model's jobs fail over to their route's next target).
    Add {
        #[arg(long, required_unless_present_any = ["route", "model"], conflicts_with_all = ["route", "model"])]
        tenant: Option<String>,
        #[arg(long, conflicts_with = "model")]
        route: Option<String>,
        /// `provider/model`.
        #[arg(long)]
        model: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Resume what was paused, by its scope as `list` shows it (`tenant:acme`).
    Resume {
        scope: String,
        #[command(flatten)]
        remote: Remote,
    },
}

/// `tollgate pauses …`.
pub async fn pauses(args: PausesArgs) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    match args.command {
        PausesCommand::List { json, remote } => {
            let Some(pauses) = remote.table_items(&http, "/v1/admin/pauses", json).await? else {
                return Ok(true);
            };
            let mut t = Table::new(&[
                ("SCOPE", Align::Left),
                ("BY", Align::Left),
                ("REASON", Align::Left),
                ("SINCE", Align::Left),
                ("UNTIL", Align::Left),
            ]);
            for p in &pauses {
                t.row(vec![
                    cell(&p["scope"]),
                    cell(&p["by"]),
                    cell(&p["reason"]),
                    when(&p["created_at"]),
                    when(&p["until"]),
                ]);
            }
            print!("{}", t.render_or("(nothing paused)"));
        }
        PausesCommand::Add {
            tenant,
            route,
            model,
            remote,
        } => {
            let body = match (tenant, route, model) {
                (Some(tenant), _, _) => json!({"tenant": tenant}),
                (_, Some(route), _) => json!({"route": route}),
                (_, _, Some(target)) => {
                    let Some((provider, model)) = target.split_once('/') else {
                        anyhow::bail!("--model {target:?}: give it as provider/model");
                    };
                    json!({"provider": provider, "model": model})
                }
                _ => anyhow::bail!("give --tenant, --route or --model"),
            };
            let pause = remote
                .json(&http, Method::POST, "/v1/admin/pauses", Some(&body))
                .await?;
            println!("paused {}", cell(&pause["scope"]));
        }
        PausesCommand::Resume { scope, remote } => {
            let path = format!("/v1/admin/pauses/{}", segment(&scope));
            remote.json(&http, Method::DELETE, &path, None).await?;
            println!("resumed {scope}");
        }
    }
    Ok(true)
}
