//! A whole tollgate stack on this machine, for `demo` and `bench`: PostgreSQL (the server
//! named by `DATABASE_URL`, or the embedded one) with a fresh, migrated database; the mock
//! provider on a free port; and a broker configured against it. [`LocalStack::stop`]
//! takes it all down again and drops the database.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tollgate::config::Config;
use tollgate::db;
use tollgate::embedded::{EmbeddedOptions, EmbeddedPostgres};
use tollgate_mock::{LocalMock, MockConfig, MockProvider};

use tollgate_api::broker::{Broker, Roles};

pub struct LocalStack {
    pub pool: PgPool,
    pub mock: MockProvider,
    pub mock_addr: std::net::SocketAddr,
    /// The broker's API root, e.g. `http://127.0.0.1:41234`.
    pub api: String,
    broker: Option<Broker>,
    config: Arc<Config>,
    admin_url: String,
    database: String,
    embedded: Option<EmbeddedPostgres>,
    local_mock: Option<LocalMock>,
}

impl LocalStack {
    /// Starts the stack. `broker_config` turns the mock's address into the broker's config.
    pub async fn start(
        purpose: &str,
        data_dir: PathBuf,
        mock_config: MockConfig,
        roles: Roles,
        broker_config: impl FnOnce(std::net::SocketAddr) -> anyhow::Result<Config>,
    ) -> anyhow::Result<Self> {
        let (admin_url, embedded) = match std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
            Some(url) => (url, None),
            None => {
                let pg = EmbeddedPostgres::start(EmbeddedOptions::new(data_dir)).await?;
                (pg.url("postgres"), Some(pg))
            }
        };
        let database = format!("tollgate_{purpose}_{}", uuid::Uuid::now_v7().simple());
        db::create_database_if_missing(&admin_url, &database).await?;
        let pool = db::connect(&db::with_database(&admin_url, &database), 32).await?;
        tollgate::MIGRATOR
            .run(&pool)
            .await
            .context("migrating the database")?;

        let local_mock = MockProvider::new(mock_config).start_local().await?;
        let (mock, mock_addr) = (local_mock.provider.clone(), local_mock.addr);

        let config = Arc::new(broker_config(mock_addr)?);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let broker = Broker::start(config.clone(), pool.clone(), Some(listener), roles).await?;
        let api = format!("http://{}", broker.addr.context("broker has no API address")?);
        Ok(Self {
            pool,
            mock,
            mock_addr,
            api,
            broker: Some(broker),
            config,
            admin_url,
            database,
            embedded,
            local_mock: Some(local_mock),
        })
    }

    /// Another process of the broker on the same database and config, with its own
    /// connections and API: a deployment of several instances. The caller shuts it down
    /// before [`LocalStack::stop`].
    pub async fn start_peer(&self, roles: Roles) -> anyhow::Result<Broker> {
        let url = db::with_database(&self.admin_url, &self.database);
        let pool = db::connect(&url, self.config.database.max_connections).await?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        Broker::start(self.config.clone(), pool, Some(listener), roles).await
    }

    /// The server's maintenance URL (database `postgres`), for tools run beside the stack.
    pub fn admin_url(&self) -> &str {
        &self.admin_url
    }

    /// Stops the broker (its shutdown sequence) and the mock; the database stays readable.
    pub async fn stop_services(&mut self) {
        if let Some(broker) = self.broker.take() {
            broker.shutdown().await;
        }
        if let Some(m) = self.local_mock.take() {
            m.shutdown().await;
        }
    }

    /// Stops everything, drops the database and stops the embedded server.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.stop_services().await;
        self.pool.close().await;
        let admin = db::connect(&self.admin_url, 1).await?;
        let drop = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.database);
        if let Err(e) = sqlx::query(&drop).execute(&admin).await {
            tracing::warn!(error = %e, database = %self.database, "could not drop the database");
        }
        admin.close().await;
        if let Some(pg) = self.embedded.take() {
            pg.stop().await?;
        }
        Ok(())
    }
}
