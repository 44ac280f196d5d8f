//! One tollgate process: the API, the gate (when elected), a dispatcher, maintenance (with
//! batch finalization, retention and the provider-batch worker), the webhook sender and the notification listener,
//! on one database. [`Broker::start`] brings them up; [`Broker::shutdown`] runs
//! the written shutdown sequence: stop accepting and claiming → drain in-flight provider
//! calls up to `dispatch.drain_timeout_secs` → release the leases of what did not finish
//! → exit. Every role reckons time by one [`Clock`]: the database's, so processes on
//! hosts whose clocks disagree agree on leases, deadlines and holds.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate::clock::Clock;
use tollgate::config::Config;
use tollgate::notify::Notifications;
use tollgate::tenants::TenantDirectory;
use tollgate_workers::dispatcher::Dispatcher;
use tollgate_workers::gate::Gate;
use tollgate_workers::maintenance::Maintenance;
use tollgate_workers::provider_batches::ProviderBatcher;
use tollgate_workers::providers::Providers;
use tollgate_workers::webhooks::WebhookSender;

use crate::AppState;
use crate::supervise::{spawn_supervised, supervise};

/// Which roles this process runs. `serve` runs those its `--roles` names (all by default).
#[derive(Debug, Clone, Copy)]
pub struct Roles {
    pub api: bool,
    /// Competes for the active gate (one process at a time admits).
    pub gate: bool,
    pub dispatch: bool,
    pub maintenance: bool,
}

impl Roles {
    pub const ALL: Roles = Roles {
        api: true,
        gate: true,
        dispatch: true,
        maintenance: true,
    };
    /// Accepts and serves jobs but sends nothing: work stays queued (tests, API-only nodes).
    pub const API_ONLY: Roles = Roles {
        api: true,
        gate: false,
        dispatch: false,
        maintenance: false,
    };
}

/// A running broker.
pub struct Broker {
    /// Where the API listens (when it runs).
    pub addr: Option<SocketAddr>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

/// Connections of the gate's own pool, and of the maintenance's.
const GATE_CONNECTIONS: u32 = 4;
const MAINTENANCE_CONNECTIONS: u32 = 2;

/// Connections of the dispatcher's own pool: one per two call slots, 4 to 32.
fn dispatch_connections(config: &Config) -> u32 {
    (config.dispatch.concurrency as u32 / 2).clamp(4, 32)
}

/// Connections a broker may open beside the pool it is given: one pool per role.
pub fn role_connections(config: &Config) -> u32 {
    dispatch_connections(config) + GATE_CONNECTIONS + MAINTENANCE_CONNECTIONS + crate::arrivals::CONNECTIONS
}

/// What [`Broker::start`] builds from `config` before it starts anything — the tenants with their
/// keys, the provider clients with theirs (from the environment or files) — or the
/// first thing wrong with it. `tollgate config check` runs it alone.
pub fn check(config: &Config) -> anyhow::Result<(TenantDirectory, Providers)> {
    let tenants = TenantDirectory::from_config(config).map_err(anyhow::Error::msg)?;
    let providers = Providers::from_config(config)?;
    Ok((tenants, providers))
}

/// Applies the config file's tenants and keys to the control plane (at start, and on
/// `SIGHUP`): those it names are created or updated, every process sees them within a
/// second; tenants created through the admin API stay.
pub async fn seed_tenants(pool: &PgPool, config: &Config) -> anyhow::Result<tollgate::control::Applied> {
    let seed = tollgate::tenants::Seed::from_config(config).map_err(anyhow::Error::msg)?;
    let now = tollgate::store::database_time(pool).await?;
    tollgate::control::apply_seed(pool, &seed, now)
        .await
        .context("applying the config file's tenants and keys")
}

impl Broker {
    /// Starts the roles on `pool` (already migrated). The API serves on `listener`.
    pub async fn start(
        config: Arc<Config>,
        pool: PgPool,
        listener: Option<TcpListener>,
        roles: Roles,
    ) -> anyhow::Result<Self> {
        let clock = Clock::database(&pool)
            .await
            .context("reading the database's time")?;
        Self::start_with_clock(config, pool, listener, roles, clock).await
    }

    /// [`Broker::start`] with the roles reckoning time by `clock`. For tests: a clock
    /// [`Clock::offset_by`] some seconds stands for a process whose clock is wrong.
    pub async fn start_with_clock(
        config: Arc<Config>,
        pool: PgPool,
        listener: Option<TcpListener>,
        roles: Roles,
        clock: Clock,
    ) -> anyhow::Result<Self> {
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let notifications = Notifications::default();
        tollgate::store::sync_buckets(&pool, &tollgate::buckets::configured(&config), clock.now())
            .await
            .context("syncing the configured buckets")?;
        tollgate_workers::webhooks::sync_config_endpoints(&pool, &config)
            .await
            .context("syncing the configured webhook endpoints")?;
        notifications.spawn_listener(pool.clone(), &tracker, cancel.clone());
        tracker.spawn(clock.clone().keep_sampling(cancel.clone()));
        // Load the tokenizers now, not on some client's first request.
        tokio::task::spawn_blocking(tollgate::estimate::warm_up).await?;
        // Each role gets its own connections, so a burst of completions cannot starve the
        // API or the gate (the API keeps `pool`).
        let role_pool = |connections: u32| {
            tollgate::db::pool_options(connections)
                .min_connections(1)
                .connect_lazy_with((*pool.connect_options()).clone())
        };
        let dispatch_pool = role_pool(dispatch_connections(&config));
        let gate_pool = role_pool(GATE_CONNECTIONS);
        let maintenance_pool = role_pool(MAINTENANCE_CONNECTIONS);
        let (_, providers) = check(&config)?;
        let applied = seed_tenants(&pool, &config).await?;
        if !applied.changes.is_empty() {
            tracing::info!(created = ?applied.created(), updated = ?applied.updated(), "tenants from the config file");
        }
        let tenants = tollgate::control::Directory::load(&pool, config.clone())
            .await
            .context("reading the tenants and keys")?;
        tracker.spawn(
            tenants
                .clone()
                .keep_current(pool.clone(), notifications.clone(), cancel.clone()),
        );
        let providers = providers.with_control(tenants.clone());
        let dispatcher = Dispatcher::with_clock(
            dispatch_pool,
            config.clone(),
            providers.clone(),
            notifications.clone(),
            clock.clone(),
        );
        let relays = TaskTracker::new();
        let gate = roles.gate.then(|| {
            let gate = Gate::new(gate_pool, config.clone(), notifications.clone())
                .with_clock(clock.clone())
                .with_tenants(tenants.clone());
            Arc::new(if roles.dispatch {
                gate.with_handoff(dispatcher.handoff())
            } else {
                gate
            })
        });
        let state = AppState::new(crate::Shared {
            arrivals: match &gate {
                Some(gate) if roles.dispatch && roles.api => Some(crate::arrivals::Arrivals::start(
                    gate.clone(),
                    role_pool(crate::arrivals::CONNECTIONS),
                )?),
                _ => None,
            },
            inserts: crate::inserts::Inserts::start(pool.clone(), &tracker, &cancel),
            pool: pool.clone(),
            config: config.clone(),
            tenants,
            notifications: notifications.clone(),
            dispatcher: dispatcher.clone(),
            relays: relays.clone(),
            readiness: crate::Readiness::default(),
            queue_room: crate::jobs::QueueRoom::default(),
            clock: clock.clone(),
            tenant_rate: crate::guard::TenantRate::new(&config.server),
            forecasts: Arc::default(),
        });
        let mut addr = None;
        if roles.api {
            let listener = listener.context("the API role needs a listener")?;
            addr = Some(listener.local_addr()?);
            spawn_supervised(
                &tracker,
                "status sampler",
                &cancel,
                pool.clone(),
                crate::status::sample,
            );
            let limits = crate::serve::ConnectionLimits::from_config(&config.server);
            let app = crate::router(state);
            let stop = cancel.clone();
            let relays = relays.clone();
            tracker.spawn(async move {
                crate::serve::serve(listener, app, limits, stop).await;
                // Streams still relaying finish their attempts before the process exits.
                relays.close();
                relays.wait().await;
            });
        } else if let Some(listener) = listener {
            // No API here: the probes alone, so an orchestrator can watch this process.
            addr = Some(listener.local_addr()?);
            let limits = crate::serve::ConnectionLimits::from_config(&config.server);
            let app = crate::probes(state);
            let stop = cancel.clone();
            tracker.spawn(async move { crate::serve::serve(listener, app, limits, stop).await });
        }
        if roles.dispatch {
            spawn_supervised(
                &tracker,
                "dispatcher",
                &cancel,
                dispatcher.clone(),
                Dispatcher::run,
            );
        } else if roles.api {
            // Streams run here: their leases need the heartbeat the dispatch loop would give.
            spawn_supervised(
                &tracker,
                "heartbeat",
                &cancel,
                dispatcher.clone(),
                Dispatcher::keep_leases,
            );
        }
        if let Some(gate) = gate {
            let stop = cancel.clone();
            tracker.spawn(supervise("gate", cancel.clone(), move || {
                let (gate, stop) = (gate.clone(), stop.clone());
                async move {
                    run_on_own_thread("tollgate-gate", move || async move { gate.run(stop).await })?.await
                }
            }));
        }
        if roles.maintenance {
            let m = Maintenance::new(
                maintenance_pool,
                Duration::from_millis(config.dispatch.maintenance_interval_ms),
            )
            .with_retention(config.retention.clone())
            .with_clock(clock.clone());
            spawn_supervised(&tracker, "maintenance", &cancel, m, Maintenance::run);
            let sender = WebhookSender::new(role_pool(2), &config.webhooks)?.with_clock(clock.clone());
            spawn_supervised(&tracker, "webhook sender", &cancel, sender, WebhookSender::run);
            if tollgate::provider_batches::any_enabled(&config) {
                let batcher = ProviderBatcher::new(role_pool(2), config.clone(), providers.clone())
                    .with_clock(clock.clone());
                spawn_supervised(
                    &tracker,
                    "provider batches",
                    &cancel,
                    batcher,
                    ProviderBatcher::run,
                );
            }
        }
        tracker.close();
        Ok(Self {
            addr,
            cancel,
            tracker,
        })
    }

    /// A token that stops the broker when cancelled.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Resolves when every role has stopped (after [`Broker::shutdown`] or the token).
    pub async fn stopped(&self) {
        self.tracker.wait().await;
    }

    /// The shutdown sequence; returns when every role has stopped.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tracker.wait().await;
    }
}

/// Runs the future `make` returns on a thread of its own, with its own single-threaded
/// runtime (built there), and returns a future of its output. For the gate: admission is on
/// every job's path, and on the shared runtime each of its rounds waited behind whatever else
/// was ready to run (hundreds of API requests and provider calls per second) between its
/// statements. Connections it opens are its own (the gate's pool connects lazily, there).
/// The bench runs its load generator this way too, as an outside client would run.
pub fn run_on_own_thread<F, Fut, T>(
    name: &str,
    make: F,
) -> anyhow::Result<impl std::future::Future<Output = anyhow::Result<T>> + use<F, Fut, T>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
    T: Send + 'static,
{
    let (ended, on_end) = tokio::sync::oneshot::channel();
    let thread = name.to_owned();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let _ = ended.send(runtime.map(|r| r.block_on(make())));
        })
        .with_context(|| format!("starting the {name} thread"))?;
    Ok(async move {
        on_end
            .await
            .map_err(|_| anyhow::anyhow!("the {thread} thread ended without an outcome"))?
            .with_context(|| format!("building the {thread} thread's runtime"))
    })
}
