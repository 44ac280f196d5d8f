//! The `tollgate` binary: parse the command line, load config, run until stopped.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tollgate::config::Config;
use tollgate::db::Database;
use tollgate_api::broker::{Broker, Roles};
use tollgate_mock::{MockConfig, MockProvider};

/// The command line. Named `tollgate` (not the package's name) in usage and `--version`;
/// without a command it prints the help and exits 2, as clap does for other usage errors.
#[derive(Parser)]
#[command(
    name = "tollgate",
    version,
    about = "tollgate: a durable job-queue broker for LLM API work, on PostgreSQL",
    long_about = LONG_ABOUT,
    arg_required_else_help = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines are written to stderr: `text`, or `json` (one object per line).
    #[arg(
        long,
        global = true,
        env = "TOLLGATE_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: telemetry::LogFormat,
}

mod telemetry;

const LONG_ABOUT: &str = "tollgate: a durable job-queue broker for LLM API work, on PostgreSQL.

Run the broker with `tollgate serve --config FILE`. With DATABASE_URL unset, it starts a \
private PostgreSQL from the server binaries installed on this machine (data under \
`database.embedded_dir`, default .tollgate/pg), migrates it, and stops it on exit.

Check a config file without starting anything with `tollgate config check FILE`.

The client commands (status, jobs, submit, batches, files, usage) talk to a running server: \
--url / TOLLGATE_URL, --key / TOLLGATE_KEY.";

#[derive(Subcommand)]
enum Command {
    /// Run the broker's roles: by default all of them (API, gate, dispatcher, maintenance).
    Serve {
        /// Config file (TOML); see tollgate.example.toml.
        #[arg(long, env = "TOLLGATE_CONFIG")]
        config: PathBuf,
        /// Address for the API; overrides `server.listen`.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// The roles this process runs, comma-separated. Without `api` it serves only
        /// `/healthz` and `/readyz` on the listen address (for probes).
        #[arg(
            long,
            env = "TOLLGATE_ROLES",
            value_enum,
            value_delimiter = ',',
            default_value = "api,gate,dispatch,maintenance"
        )]
        roles: Vec<Role>,
    },
    /// Apply a config file's tenants and keys to its database, as `serve` does at start and
    /// on SIGHUP, printing the difference (GitOps); `--dry-run` prints it only.
    Apply {
        /// Config file (TOML).
        file: PathBuf,
        /// Print what would change; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Check a config file without starting anything.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Apply database migrations and exit.
    Migrate {
        #[arg(long, env = "TOLLGATE_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Run the mock LLM provider (OpenAI and Anthropic APIs, limits and errors included).
    MockProvider {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:18080")]
        listen: std::net::SocketAddr,
        /// Mock config (TOML); defaults give one OpenAI and one Anthropic project.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Start everything (embedded PostgreSQL, mock provider, broker), run a sample
    /// workload from three tenants across two providers, and print a summary.
    Demo(tollgate_bench::demo::DemoArgs),
    /// Measure end-to-end throughput against the mock provider, beside a baseline that
    /// calls the mock directly; prints a Markdown table for BENCHMARKS.md.
    Bench(tollgate_bench::BenchArgs),
    /// A running server's queues by tenant and class, and its buckets with use and limit.
    Status(tollgate_api::cli::StatusArgs),
    /// A running server's jobs: list (filtered, searched), get, cancel, retry, attempts.
    Jobs(tollgate_api::cli::JobsArgs),
    /// Submit each line of a JSONL file as a job; with --wait, follow them with a progress
    /// bar. Exits 1 when any job failed or was rejected.
    Submit(tollgate_api::cli::SubmitArgs),
    /// A running server's batches: list, get, cancel, and their output files.
    Batches(tollgate_api::cli::BatchesArgs),
    /// A running server's files: list, get, delete, content.
    Files(tollgate_api::cli::FilesArgs),
    /// What a running server's finished jobs used and cost, in USD and tokens, grouped.
    Usage(tollgate_api::cli::UsageArgs),
    /// A running server's tenants (the admin key): list, get, create, update, delete.
    Tenants(tollgate_api::cli::TenantsArgs),
    /// A tenant's API keys (the admin key): list, create, revoke.
    Keys(tollgate_api::cli::KeysArgs),
    /// Provider keys at runtime (the admin key): list, add, rotate, disable, enable, remove.
    ProviderKeys(tollgate_api::cli::ProviderKeysArgs),
    /// Pause and resume a tenant's queue, a route or a provider model (the admin key).
    Pauses(tollgate_api::cli::PausesArgs),
}

/// A role `serve` may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Role {
    /// The HTTP API, the dashboard and /metrics.
    Api,
    /// Admission (one process at a time admits; the others stand by).
    Gate,
    /// Claims admitted jobs and calls the providers.
    Dispatch,
    /// Rescues, deadlines, batch finalization, webhooks, retention, provider batches.
    Maintenance,
}

impl Role {
    fn all_of(roles: &[Role]) -> Roles {
        Roles {
            api: roles.contains(&Role::Api),
            gate: roles.contains(&Role::Gate),
            dispatch: roles.contains(&Role::Dispatch),
            maintenance: roles.contains(&Role::Maintenance),
        }
    }
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Validate FILE as `serve` would before starting (syntax, every rule, the secrets its
    /// keys name in the environment or files): prints what it configures, or the first
    /// error and exits 1.
    Check {
        /// Config file (TOML).
        file: PathBuf,
    },
}

/// mimalloc instead of glibc's allocator: the broker allocates per request, per job and
/// per row, and glibc's malloc/free took 9 % of the machine at full throughput.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The demo and the bench print their own report; their logs stay quiet unless asked.
    let default_filter = match cli.command {
        Command::Serve { .. } | Command::Migrate { .. } | Command::MockProvider { .. } => "info,sqlx=warn",
        _ => "warn",
    };
    telemetry::init_log(cli.log_format, default_filter);
    match cli.command {
        Command::Serve {
            config,
            listen,
            roles,
        } => serve(config, listen, Role::all_of(&roles)).await,
        Command::Config {
            command: ConfigCommand::Check { file },
        } => exit_unless(tollgate_api::cli::config_check(&file)),
        Command::Migrate { config } => {
            let db_config = match config {
                Some(path) => Config::load(&path)?.database,
                None => Default::default(),
            };
            let db = Database::open(&db_config).await?;
            tracing::info!(database = %db.display_url, "migrations applied");
            db.close().await?;
            Ok(())
        }
        Command::MockProvider { listen, config } => {
            let config = match config {
                Some(path) => MockConfig::load(&path)?,
                None => tollgate_bench::demo::default_mock_config(),
            };
            let listener = TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding {listen}"))?;
            tracing::info!(addr = %listener.local_addr()?, "mock provider listening");
            let cancel = CancellationToken::new();
            let served = MockProvider::new(config).serve(listener, cancel.clone());
            tokio::pin!(served);
            tokio::select! {
                r = &mut served => return Ok(r?),
                _ = shutdown_signal() => {}
            }
            cancel.cancel();
            served.await?;
            Ok(())
        }
        Command::Bench(args) => tollgate_bench::run(args).await,
        Command::Status(args) => exit_unless(tollgate_api::cli::status(args).await?),
        Command::Jobs(args) => exit_unless(tollgate_api::cli::jobs(args).await?),
        Command::Submit(args) => exit_unless(tollgate_api::cli::submit(args).await?),
        Command::Batches(args) => exit_unless(tollgate_api::cli::batches(args).await?),
        Command::Files(args) => exit_unless(tollgate_api::cli::files(args).await?),
        Command::Usage(args) => exit_unless(tollgate_api::cli::usage(args).await?),
        Command::Apply { file, dry_run } => exit_unless(tollgate_api::cli::apply(&file, dry_run).await?),
        Command::Tenants(args) => exit_unless(tollgate_api::cli::tenants(args).await?),
        Command::Keys(args) => exit_unless(tollgate_api::cli::keys(args).await?),
        Command::ProviderKeys(args) => exit_unless(tollgate_api::cli::provider_keys(args).await?),
        Command::Pauses(args) => exit_unless(tollgate_api::cli::pauses(args).await?),
        Command::Demo(args) => {
            let ok = tollgate_bench::demo::run(args).await?;
            if !ok {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

async fn serve(
    config_path: PathBuf,
    listen: Option<std::net::SocketAddr>,
    roles: Roles,
) -> anyhow::Result<()> {
    let mut config = Config::load(&config_path)?;
    if let Some(listen) = listen {
        // Checked again: what is allowed depends on where the API listens (short keys).
        config.server.listen = listen;
        config.validate()?;
    }
    let traces = telemetry::init_traces()?;
    let db = Database::open(&config.database).await?;
    tracing::info!(database = %db.display_url, "database ready");
    let addr = config.server.listen;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let broker = Broker::start(Arc::new(config), db.pool.clone(), Some(listener), roles).await?;
    if let Some(addr) = broker.addr {
        tracing::info!(%addr, ?roles, "tollgate serving");
    }
    let reloads = reload_on_hangup(config_path, db.pool.clone());
    tokio::select! {
        _ = shutdown_signal() => tracing::info!("shutting down: draining in-flight calls"),
        _ = broker.stopped() => tracing::warn!("a role stopped on its own; shutting down"),
        _ = reloads => {}
    }
    broker.shutdown().await;
    if let Some(Err(e)) = traces.map(|t| t.shutdown()) {
        tracing::warn!(error = %e, "the last job spans could not be sent");
    }
    db.close().await?;
    Ok(())
}

/// Exit 1 when a command did not succeed (a job failed), after its output.
fn exit_unless(ok: bool) -> anyhow::Result<()> {
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// On every SIGHUP, reads the config file again and applies its tenants and keys (the
/// rest of the file takes effect at the next start). A file that does not load is
/// reported and changes nothing. Never resolves (without SIGHUP support, at once).
async fn reload_on_hangup(config_path: PathBuf, pool: tollgate_api::PgPool) {
    #[cfg(unix)]
    {
        let Ok(mut hangups) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
            return std::future::pending().await;
        };
        while hangups.recv().await.is_some() {
            let applied = match Config::load(&config_path) {
                Ok(config) => tollgate_api::broker::seed_tenants(&pool, &config).await,
                Err(e) => Err(e.into()),
            };
            match applied {
                Ok(a) => tracing::info!(
                    file = %config_path.display(),
                    created = ?a.created(),
                    updated = ?a.updated(),
                    keys = ?a.keys,
                    "SIGHUP: the config file's tenants and keys applied (other settings take effect at the next start)"
                ),
                Err(e) => {
                    tracing::error!(file = %config_path.display(), error = %format!("{e:#}"), "SIGHUP: the config file was not applied")
                }
            }
        }
    }
    std::future::pending().await
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
