//! Embedded PostgreSQL: the private cluster `tollgate` runs when no `DATABASE_URL` is
//! given, and the one `cargo test` runs against, built from the server binaries already
//! installed on the machine.
//!
//! This module owns the whole life of that cluster and nothing else: finding the
//! binaries ([`find_bin_dir`]), `initdb` on first use, starting `postgres` as a child on
//! 127.0.0.1 (TCP only, no Unix socket, never port 5432 unless asked), waiting until it
//! accepts connections, and stopping it ([`EmbeddedPostgres::stop`]). Migrations and all
//! SQL belong to `store`; this module only hands out URLs.
//!
//! **Why a password.** A loopback port is open to every local user and to every sidecar
//! of a pod, and the cluster's only role is a superuser (`COPY … TO PROGRAM` runs
//! commands as the server's OS user). So the cluster accepts nobody without its
//! password: `pg_hba.conf` allows SCRAM over 127.0.0.1 and nothing else, and the
//! password — random, made at `initdb` — is kept in `<data_dir>.password`, mode 0600,
//! readable only by the OS user tollgate runs as. A cluster made by an older tollgate
//! with trust authentication is locked down the same way on its first start.
//!
//! **Why the `postgres` OS user.** `initdb` and `postgres` refuse to run as root: a
//! server owned by root would let any database superuser run code as root (`COPY …
//! PROGRAM`, untrusted languages). Builds and CI here run as root, so when the effective
//! uid is 0 the cluster's files are chowned to the `postgres` OS user and both programs
//! run with its uid/gid. The data directory's ancestors must let that user through: one
//! owned by us (root) is given search permission for others (`o+x`, never read), one
//! owned by anybody else is left as it is and `start` says which directory blocks the
//! way. As any other user, everything runs as that user.
//!
//! **Why the server cannot outlive us.** `postgres` is not daemonized: it is a child,
//! spawned through `setpriv --pdeathsig INT` (util-linux) from a dedicated thread that
//! does nothing but wait for it. `setpriv` sets `PR_SET_PDEATHSIG` after the uid switch
//! (a credential change clears it) and then execs `postgres`, so when that thread
//! ends — which, while the server runs, only happens if this whole process dies, SIGKILL
//! included — the kernel sends the server SIGINT, i.e. a fast shutdown. The server also
//! runs in its own process group so a terminal's Ctrl-C reaches only us, and we decide
//! when to shut it down. Without `setpriv` the server still starts, with a warning.
//!
//! **Why a lock file.** Two tollgates must not share one cluster unknowingly, and a
//! second `start` on a data directory must tell "another tollgate is using it" from "a
//! server of a dead tollgate is still shutting down". The process whose server runs on a
//! data directory holds an exclusive `flock` on `<data_dir>.lock` (its pid written in
//! it) for as long as the server runs: a second `start` finds it taken at once and says
//! so ([`EmbeddedError::InUse`]). The kernel releases it when its holder dies, SIGKILL
//! included, so a dead tollgate leaves nothing to clean up; only then is a live
//! `postmaster.pid` waited for, as the fast shutdown its parent's death began.
//!
//! The server's stdout/stderr (and `initdb`'s) go to a log file beside the data
//! directory (`<data_dir>.log`); start errors quote its last lines.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{self, Signal};
use nix::unistd::{Pid, User};
use sqlx::Connection;
use tokio::sync::oneshot::{self, error::TryRecvError};
use tokio::time::{Instant, sleep, timeout};

/// How long `start` waits for the server to accept connections.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);
/// How long `initdb` may take before we give up on it.
const INITDB_DEADLINE: Duration = Duration::from_secs(120);
/// How long `start` waits for a previous server on the same data directory to exit
/// (it may be in the middle of the fast shutdown its parent's death triggered).
const PREVIOUS_SERVER_DEADLINE: Duration = Duration::from_secs(30);
/// Fast shutdown ends with a checkpoint; give it time before escalating.
const FAST_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(30);
/// Wait after SIGQUIT, and after SIGKILL.
const ESCALATION_DEADLINE: Duration = Duration::from_secs(5);
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// One readiness probe; a closed port fails at once, a stuck one must not eat the deadline.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Attempts with a freshly picked port when another process took ours between
/// picking it and the server binding it.
const PORT_ATTEMPTS: u32 = 5;
const LOG_TAIL_LINES: usize = 8;
/// A log larger than this is truncated at start, so repeated runs do not grow it forever.
const LOG_TRUNCATE_BYTES: u64 = 16 << 20;
const DEFAULT_MAX_CONNECTIONS: u32 = 200;
const BIN_DIR_ENV: &str = "TOLLGATE_PG_BIN_DIR";
/// The database superuser `initdb -U` creates and URLs connect as (SCRAM, loopback only).
const SUPERUSER: &str = "postgres";
/// The cluster's whole `pg_hba.conf`: password (SCRAM) connections over loopback TCP only.
const PG_HBA: &str = "# Written by tollgate: SCRAM password connections over 127.0.0.1, nothing else.\nhost all all 127.0.0.1/32 scram-sha-256\n";
/// Random bytes in the superuser's password (hex-encoded, so it needs no escaping in a URL).
const PASSWORD_BYTES: usize = 24;

/// How to run the embedded cluster.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// The cluster's data directory; created and initialised if it holds no `PG_VERSION`.
    /// Its log goes beside it, to `<data_dir>.log`, and its superuser's password to
    /// `<data_dir>.password` (mode 0600).
    pub data_dir: PathBuf,
    /// Directory with `postgres` and `initdb`; `None` = [`find_bin_dir`].
    pub bin_dir: Option<PathBuf>,
    /// Port on 127.0.0.1; `None` = a free one picked at start (retried if taken meanwhile).
    pub port: Option<u16>,
    /// `false` turns off `fsync`, `synchronous_commit` and `full_page_writes` (and runs
    /// `initdb --no-sync`): a crash may lose or corrupt data. For tests only.
    pub durable: bool,
    /// The server's `max_connections`; default 200.
    pub max_connections: u32,
}

impl EmbeddedOptions {
    /// Durable defaults for a cluster in `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            bin_dir: None,
            port: None,
            durable: true,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

impl Default for EmbeddedOptions {
    /// The project-local default: `./.tollgate/pg`, durable.
    fn default() -> Self {
        Self::new(".tollgate/pg")
    }
}

/// Why the embedded cluster could not be started or stopped. Each message is one line
/// that says what to install, change or look at.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error(
        "no PostgreSQL server binaries found: install PostgreSQL (Debian: apt-get install postgresql) or set DATABASE_URL or {BIN_DIR_ENV}"
    )]
    NoBinaries,
    #[error(
        "{origin} = {} has no PostgreSQL server binaries (postgres, initdb): point it at the server's bin directory (see `pg_config --bindir`)",
        dir.display()
    )]
    BadBinDir { origin: &'static str, dir: PathBuf },
    #[error(
        "running as root, which PostgreSQL refuses, and the `postgres` OS user to run it as is missing ({reason}): create it (Debian: adduser --system --group postgres) or set DATABASE_URL"
    )]
    NoPostgresUser { reason: String },
    #[error(
        "{} exists but is not a PostgreSQL data directory (no PG_VERSION): remove it or choose another data directory",
        dir.display()
    )]
    NotACluster { dir: PathBuf },
    #[error(
        "the postgres OS user cannot reach {} (owned by uid {owner}, mode {mode:o}), which the embedded PostgreSQL's data directory is under: choose a data directory it can reach, or let it through yourself (chmod o+x or setfacl -m u:postgres:x on that directory); tollgate changes only directories it owns",
        dir.display()
    )]
    NotSearchable { dir: PathBuf, owner: u32, mode: u32 },
    #[error(
        "{} is a password-protected cluster but its password file {} is missing: restore it, or remove the cluster to start afresh",
        data_dir.display(), password_file.display()
    )]
    PasswordMissing {
        data_dir: PathBuf,
        password_file: PathBuf,
    },
    #[error("cannot lock down the cluster in {} with a password: {source}", data_dir.display())]
    LockDown { data_dir: PathBuf, source: sqlx::Error },
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot run {}: {source}", program.display())]
    Spawn { program: PathBuf, source: io::Error },
    #[error("initdb failed ({outcome}); last lines of {}: {tail}", log.display())]
    Initdb {
        outcome: String,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "another tollgate ({holder}) is running on the embedded PostgreSQL in {}: stop that one first, or give this one its own data directory (database.embedded_dir) or a DATABASE_URL",
        data_dir.display()
    )]
    InUse { data_dir: PathBuf, holder: String },
    #[error(
        "a PostgreSQL server (pid {pid}) that no running tollgate owns is still serving {} and did not exit within {waited_secs} s: if nothing else uses it, stop it (pg_ctl -D {} stop -m fast) and retry",
        data_dir.display(), data_dir.display()
    )]
    AlreadyRunning {
        pid: i32,
        data_dir: PathBuf,
        waited_secs: u64,
    },
    #[error(
        "port {port} on 127.0.0.1 is already in use: choose another port or leave it unset to pick a free one (log: {})",
        log.display()
    )]
    PortInUse { port: u16, log: PathBuf },
    #[error("PostgreSQL exited during startup ({status}); last lines of {}: {tail}", log.display())]
    Exited {
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "PostgreSQL did not accept connections within {waited_secs} s; last lines of {}: {tail}",
        log.display()
    )]
    NotReady {
        waited_secs: u64,
        log: PathBuf,
        tail: String,
    },
    #[error("cannot send {signal} to PostgreSQL (pid {pid}): {source}")]
    Signal { pid: Pid, signal: Signal, source: Errno },
    #[error("PostgreSQL (pid {pid}) did not exit even after SIGKILL")]
    StopTimeout { pid: Pid },
}

/// A running embedded server. Call [`stop`](Self::stop) to shut it down and wait; a
/// value dropped without `stop` sends SIGINT (fast shutdown) and does not wait.
#[derive(Debug)]
pub struct EmbeddedPostgres {
    port: u16,
    /// The superuser's password (hex), as kept in `<data_dir>.password`.
    password: String,
    /// The postmaster's pid (`setpriv` execs it, so it is our child's pid).
    pid: Pid,
    log_path: PathBuf,
    /// Resolved by the thread that owns the child once the server has exited and been
    /// reaped; until then `pid` is certainly the server's and safe to signal.
    exit: oneshot::Receiver<io::Result<ExitStatus>>,
    exited: bool,
    /// `<data_dir>.lock`, held while the server runs (see the module's doc).
    _lock: Option<Flock<File>>,
}

impl EmbeddedPostgres {
    /// Initialises the cluster if `opts.data_dir` has no `PG_VERSION`, starts the server
    /// and returns once it accepts connections (deadline 30 s).
    pub async fn start(opts: EmbeddedOptions) -> Result<Self, EmbeddedError> {
        let bin_dir = match &opts.bin_dir {
            Some(dir) if has_server_binaries(dir) => dir.clone(),
            Some(dir) => {
                return Err(EmbeddedError::BadBinDir {
                    origin: "EmbeddedOptions::bin_dir",
                    dir: dir.clone(),
                });
            }
            None => find_bin_dir()?,
        };
        let data_dir =
            std::path::absolute(&opts.data_dir).map_err(io_err("resolve data directory", &opts.data_dir))?;
        let parent = data_dir
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("/"));
        let log_path = sibling(&data_dir, "log");
        let password_path = sibling(&data_dir, "password");
        let run_as = run_as()?;

        fs::create_dir_all(&parent).map_err(io_err("create directory", &parent))?;
        if let Some(user) = run_as {
            make_searchable(&parent, user)?;
        }
        // Before anything touches the cluster (initdb included).
        let lock = lock_data_dir(&data_dir)?;

        let (password, lock_down) = if data_dir.join("PG_VERSION").is_file() {
            if let Some(user) = run_as {
                let owner = fs::metadata(&data_dir)
                    .map_err(io_err("inspect", &data_dir))?
                    .uid();
                // Walk the tree only when the top is not the user's: a cluster we created
                // is owned by it throughout, a copied or restored one usually not at all.
                if owner != user.uid {
                    chown_tree(&data_dir, user).map_err(io_err("chown to postgres", &data_dir))?;
                }
            }
            wait_for_previous_server(&data_dir).await?;
            match read_password(&password_path)? {
                Some(password) => (password, false),
                None if trusts_anyone(&data_dir)? => {
                    let password = new_password();
                    write_password(&password_path, &password)?;
                    (password, true)
                }
                None => {
                    return Err(EmbeddedError::PasswordMissing {
                        data_dir,
                        password_file: password_path,
                    });
                }
            }
        } else {
            let password = new_password();
            // Kept before the cluster exists: a cluster whose password was lost is locked.
            write_password(&password_path, &password)?;
            initdb(
                &bin_dir,
                &data_dir,
                &parent,
                &log_path,
                run_as,
                opts.durable,
                &password,
            )
            .await?;
            (password, false)
        };

        let setpriv = find_setpriv();
        if setpriv.is_none() {
            tracing::warn!(
                "setpriv (util-linux) not found: the embedded PostgreSQL will keep running if this process is killed"
            );
        }
        let launch = Launch {
            bin_dir: &bin_dir,
            data_dir: &data_dir,
            parent: &parent,
            log_path: &log_path,
            run_as,
            setpriv: setpriv.as_deref(),
            opts: &opts,
            password: &password,
        };
        let mut attempt = 1;
        let mut server = loop {
            let port = match opts.port {
                Some(port) => port,
                None => pick_free_port()?,
            };
            match launch.run(port).await {
                Err(EmbeddedError::PortInUse { port, .. })
                    if opts.port.is_none() && attempt < PORT_ATTEMPTS =>
                {
                    tracing::debug!(port, attempt, "picked port was taken; retrying");
                    attempt += 1;
                }
                result => break result?,
            }
        };
        server._lock = Some(lock);
        if lock_down {
            server.lock_down(&data_dir).await?;
        }
        Ok(server)
    }

    /// `postgres://postgres:<password>@127.0.0.1:{port}/{database}`; `database` is used
    /// verbatim. The URL carries the password: log it only through `db::redact`.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{}@127.0.0.1:{}/{database}",
            self.password, self.port
        )
    }

    /// Gives a cluster that trusted every loopback connection its password and the
    /// SCRAM-only `pg_hba.conf`, then reloads it; connections from here on need the password.
    async fn lock_down(&self, data_dir: &Path) -> Result<(), EmbeddedError> {
        let lock_down_err = |source| EmbeddedError::LockDown {
            data_dir: data_dir.to_path_buf(),
            source,
        };
        let mut conn = sqlx::PgConnection::connect(&self.url("postgres"))
            .await
            .map_err(lock_down_err)?;
        sqlx::raw_sql(&format!(
            "SET password_encryption = 'scram-sha-256'; ALTER ROLE {SUPERUSER} PASSWORD '{}'",
            self.password
        ))
        .execute(&mut conn)
        .await
        .map_err(lock_down_err)?;
        write_pg_hba(data_dir)?;
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&mut conn)
            .await
            .map_err(lock_down_err)?;
        let _ = conn.close().await;
        tracing::warn!(data_dir = %data_dir.display(), "the embedded PostgreSQL trusted every local connection; it needs its password now");
        Ok(())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's log (also `initdb`'s), beside the data directory.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Fast shutdown (SIGINT) and wait for the server to exit; escalates to SIGQUIT and
    /// then SIGKILL if it does not exit in time.
    pub async fn stop(mut self) -> Result<(), EmbeddedError> {
        self.shutdown().await
    }

    async fn shutdown(&mut self) -> Result<(), EmbeddedError> {
        let steps = [
            (Signal::SIGINT, FAST_SHUTDOWN_DEADLINE),
            (Signal::SIGQUIT, ESCALATION_DEADLINE),
            (Signal::SIGKILL, ESCALATION_DEADLINE),
        ];
        for (sig, wait) in steps {
            if self.poll_exited() {
                return Ok(());
            }
            match signal::kill(self.pid, sig) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(source) => {
                    return Err(EmbeddedError::Signal {
                        pid: self.pid,
                        signal: sig,
                        source,
                    });
                }
            }
            if let Ok(result) = timeout(wait, &mut self.exit).await {
                self.exited = true;
                match result {
                    Ok(Ok(status)) if status.success() => {
                        tracing::debug!(pid = %self.pid, "embedded PostgreSQL stopped");
                    }
                    other => {
                        tracing::warn!(pid = %self.pid, ?other, "embedded PostgreSQL exited uncleanly")
                    }
                }
                return Ok(());
            }
            tracing::warn!(pid = %self.pid, signal = %sig, ?wait, "embedded PostgreSQL did not exit in time; escalating");
        }
        Err(EmbeddedError::StopTimeout { pid: self.pid })
    }

    /// Whether the server has exited (and been reaped, so `pid` may no longer be ours).
    fn poll_exited(&mut self) -> bool {
        if !self.exited && !matches!(self.exit.try_recv(), Err(TryRecvError::Empty)) {
            self.exited = true;
        }
        self.exited
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        if !self.poll_exited() {
            // Best effort; the owning thread keeps reaping the child after we are gone.
            let _ = signal::kill(self.pid, Signal::SIGINT);
        }
    }
}

/// Finds PostgreSQL's server binaries: `TOLLGATE_PG_BIN_DIR`, then `pg_config --bindir`,
/// then the highest `/usr/lib/postgresql/<version>/bin` (Debian), then `initdb` on `PATH`.
pub fn find_bin_dir() -> Result<PathBuf, EmbeddedError> {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV).filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        return if has_server_binaries(&dir) {
            Ok(dir)
        } else {
            Err(EmbeddedError::BadBinDir {
                origin: BIN_DIR_ENV,
                dir,
            })
        };
    }
    // pg_config may come from libpq-dev without a server, so its answer is checked too.
    let candidates = [pg_config_bindir(), highest_debian_bin_dir(), initdb_on_path()];
    candidates
        .into_iter()
        .flatten()
        .find(|dir| has_server_binaries(dir))
        .ok_or(EmbeddedError::NoBinaries)
}

fn has_server_binaries(dir: &Path) -> bool {
    dir.join("postgres").is_file() && dir.join("initdb").is_file()
}

fn pg_config_bindir() -> Option<PathBuf> {
    let out = Command::new("pg_config")
        .arg("--bindir")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    let dir = dir.trim();
    (out.status.success() && !dir.is_empty()).then(|| PathBuf::from(dir))
}

fn highest_debian_bin_dir() -> Option<PathBuf> {
    fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            // "15", or "9.6" before PostgreSQL 10.
            let version = entry
                .file_name()
                .to_str()?
                .split('.')
                .map(str::parse::<u32>)
                .collect::<Result<Vec<_>, _>>()
                .ok()?;
            let bin = entry.path().join("bin");
            has_server_binaries(&bin).then_some((version, bin))
        })
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, bin)| bin)
}

fn initdb_on_path() -> Option<PathBuf> {
    find_on_path("initdb")?.parent().map(Path::to_path_buf)
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

fn find_setpriv() -> Option<PathBuf> {
    find_on_path("setpriv").or_else(|| {
        ["/usr/bin/setpriv", "/bin/setpriv"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
    })
}

/// The OS user `initdb` and `postgres` run as, when it differs from ours (we are root).
#[derive(Debug, Clone, Copy)]
struct RunAs {
    uid: u32,
    gid: u32,
}

fn run_as() -> Result<Option<RunAs>, EmbeddedError> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    match User::from_name("postgres") {
        Ok(Some(user)) => Ok(Some(RunAs {
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
        })),
        Ok(None) => Err(EmbeddedError::NoPostgresUser {
            reason: "no such user".into(),
        }),
        Err(errno) => Err(EmbeddedError::NoPostgresUser {
            reason: errno.to_string(),
        }),
    }
}

/// Lets the postgres user through each directory from `dir` up to `/` that it could not
/// traverse: a directory we own (e.g. a 0700 tempdir made by root) gets search permission
/// for others (`o+x`, not read); one owned by anybody else is not ours to loosen, and is
/// reported instead.
fn make_searchable(dir: &Path, user: RunAs) -> Result<(), EmbeddedError> {
    let us = nix::unistd::geteuid().as_raw();
    for ancestor in dir.ancestors() {
        let meta = fs::metadata(ancestor).map_err(io_err("inspect", ancestor))?;
        let mode = meta.mode();
        let searchable = (meta.uid() == user.uid && mode & 0o100 != 0)
            || (meta.gid() == user.gid && mode & 0o010 != 0)
            || mode & 0o001 != 0;
        if searchable {
            continue;
        }
        if meta.uid() != us {
            return Err(EmbeddedError::NotSearchable {
                dir: ancestor.to_path_buf(),
                owner: meta.uid(),
                mode: mode & 0o7777,
            });
        }
        fs::set_permissions(ancestor, fs::Permissions::from_mode((mode & 0o7777) | 0o001))
            .map_err(io_err("make searchable for the postgres user", ancestor))?;
        tracing::warn!(dir = %ancestor.display(), "added o+x so the postgres user can reach the data directory");
    }
    Ok(())
}

fn chown_tree(path: &Path, user: RunAs) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    if meta.uid() != user.uid || meta.gid() != user.gid {
        std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid))?;
    }
    if meta.is_dir() {
        for entry in fs::read_dir(path)? {
            chown_tree(&entry?.path(), user)?;
        }
    }
    Ok(())
}

/// `<data_dir>.<extension>`, beside the data directory: `initdb` needs the directory
/// empty, and the log must survive deleting the cluster.
fn sibling(data_dir: &Path, extension: &str) -> PathBuf {
    match data_dir.file_name() {
        Some(name) => {
            let mut path = OsString::from(name);
            path.push(".");
            path.push(extension);
            data_dir.with_file_name(path)
        }
        None => data_dir.join("..").join(format!("postgres.{extension}")),
    }
}

fn new_password() -> String {
    let bytes: [u8; PASSWORD_BYTES] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `password` to `path` with mode 0600 (through a temporary file and a rename, so a
/// crash leaves the old password or the new one, never half of one).
fn write_password(path: &Path, password: &str) -> Result<(), EmbeddedError> {
    use std::io::Write;
    let staging = sibling(path, "tmp");
    let _ = fs::remove_file(&staging);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&staging)
        .map_err(io_err("create password file", &staging))?;
    file.write_all(password.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io_err("write password file", &staging))?;
    fs::rename(&staging, path).map_err(io_err("move password file to", path))
}

/// The password kept at `path`, or `None` when there is no such file. A file others could
/// read is restricted to its owner first, with a warning.
fn read_password(path: &Path) -> Result<Option<String>, EmbeddedError> {
    match fs::read_to_string(path) {
        Ok(password) => {
            let mode = fs::metadata(path).map_err(io_err("inspect", path))?.mode();
            if mode & 0o077 != 0 {
                fs::set_permissions(path, fs::Permissions::from_mode(0o600))
                    .map_err(io_err("restrict to its owner", path))?;
                tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777), "the embedded PostgreSQL's password file was readable by others; now 0600");
            }
            Ok(Some(password.trim().to_owned()))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("read password file", path)(e)),
    }
}

/// Whether the cluster's `pg_hba.conf` lets anybody in without a password (a cluster made
/// by an older tollgate, with `initdb -A trust`).
fn trusts_anyone(data_dir: &Path) -> Result<bool, EmbeddedError> {
    let path = data_dir.join("pg_hba.conf");
    let hba = fs::read_to_string(&path).map_err(io_err("read", &path))?;
    Ok(hba
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .any(|line| line.split_whitespace().any(|word| word == "trust")))
}

fn write_pg_hba(data_dir: &Path) -> Result<(), EmbeddedError> {
    let path = data_dir.join("pg_hba.conf");
    fs::write(&path, PG_HBA).map_err(io_err("write", &path))
}

/// Opens the log for appending; returns it and the offset where this run's output starts.
fn open_log(path: &Path, run_as: Option<RunAs>) -> Result<(File, u64), EmbeddedError> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io_err("open log file", path))?;
    let mut len = file.metadata().map_err(io_err("inspect", path))?.len();
    if len > LOG_TRUNCATE_BYTES {
        file.set_len(0).map_err(io_err("truncate log file", path))?;
        len = 0;
    }
    if let Some(user) = run_as {
        // We pass our descriptor, so the server can write regardless; this is for humans
        // and for a later run as the postgres user itself.
        let _ = std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid));
    }
    Ok((file, len))
}

/// The last lines written to the log since `offset`, on one line.
fn log_tail(path: &Path, offset: u64) -> String {
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(offset.max(len.saturating_sub(64 * 1024))))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
            let tail = lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join(" | ");
            if tail.is_empty() {
                "(nothing logged)".into()
            } else {
                tail
            }
        }
        Err(e) => format!("(log unreadable: {e})"),
    }
}

/// Runs `initdb` into a sibling directory and renames it into place only on success, so
/// `PG_VERSION` in `data_dir` always means a complete cluster, even if we were killed
/// half-way through. The superuser gets `password`, and `pg_hba.conf` is [`PG_HBA`].
async fn initdb(
    bin_dir: &Path,
    data_dir: &Path,
    parent: &Path,
    log_path: &Path,
    run_as: Option<RunAs>,
    durable: bool,
    password: &str,
) -> Result<(), EmbeddedError> {
    let not_empty = match fs::read_dir(data_dir) {
        Ok(mut entries) => entries.next().is_some(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(io_err("read", data_dir)(e)),
    };
    if not_empty {
        return Err(EmbeddedError::NotACluster {
            dir: data_dir.to_path_buf(),
        });
    }
    let mut staging_name = OsString::from(".");
    staging_name.push(data_dir.file_name().unwrap_or_else(|| "pg".as_ref()));
    staging_name.push(".initdb");
    let staging = parent.join(staging_name);
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(io_err("remove leftover", &staging))?;
    }
    fs::create_dir(&staging).map_err(io_err("create directory", &staging))?;
    if let Some(user) = run_as {
        std::os::unix::fs::chown(&staging, Some(user.uid), Some(user.gid))
            .map_err(io_err("chown to postgres", &staging))?;
    }

    // `initdb --pwfile` reads the password as the user it runs as; the file lives only as
    // long as `initdb` does.
    let pwfile = sibling(&staging, "pw");
    write_password(&pwfile, password)?;
    if let Some(user) = run_as {
        std::os::unix::fs::chown(&pwfile, Some(user.uid), Some(user.gid))
            .map_err(io_err("chown to postgres", &pwfile))?;
    }
    let (log, offset) = open_log(log_path, run_as)?;
    let program = bin_dir.join("initdb");
    let mut cmd = tokio::process::Command::new(&program);
    cmd.arg("-D")
        .arg(&staging)
        .args(["-U", SUPERUSER, "-A", "scram-sha-256", "-E", "UTF8", "--locale=C"])
        .arg(format!("--pwfile={}", pwfile.display()))
        .env("LC_ALL", "C")
        .current_dir(parent)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(io_err("open log file", log_path))?)
        .stderr(log)
        .kill_on_drop(true);
    if !durable {
        cmd.arg("--no-sync");
    }
    if let Some(user) = run_as {
        cmd.uid(user.uid).gid(user.gid);
    }
    tracing::info!(data_dir = %data_dir.display(), "initialising embedded PostgreSQL cluster");
    let mut child = cmd.spawn().map_err(|source| EmbeddedError::Spawn {
        program: program.clone(),
        source,
    })?;
    let outcome = match timeout(INITDB_DEADLINE, child.wait()).await {
        Ok(Ok(status)) if status.success() => None,
        Ok(Ok(status)) => Some(status.to_string()),
        Ok(Err(e)) => Some(format!("waiting for it failed: {e}")),
        Err(_) => {
            let _ = child.kill().await;
            Some(format!("no result within {} s", INITDB_DEADLINE.as_secs()))
        }
    };
    let _ = fs::remove_file(&pwfile);
    if let Some(outcome) = outcome {
        let _ = fs::remove_dir_all(&staging);
        return Err(EmbeddedError::Initdb {
            outcome,
            log: log_path.to_path_buf(),
            tail: log_tail(log_path, offset),
        });
    }
    write_pg_hba(&staging)?;
    // Replaces an empty `data_dir` too (rename(2) allows an empty target directory).
    fs::rename(&staging, data_dir).map_err(io_err("move the new cluster to", data_dir))?;
    if durable {
        File::open(parent)
            .and_then(|dir| dir.sync_all())
            .map_err(io_err("sync", parent))?;
    }
    Ok(())
}

/// Takes `<data_dir>.lock` and writes our pid in it, or says who holds it.
fn lock_data_dir(data_dir: &Path) -> Result<Flock<File>, EmbeddedError> {
    let path = sibling(data_dir, "lock");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io_err("open", &path))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut lock) => {
            lock.set_len(0)
                .and_then(|()| writeln!(lock, "{}", std::process::id()))
                .map_err(io_err("write", &path))?;
            Ok(lock)
        }
        Err((_, Errno::EWOULDBLOCK)) => {
            let holder = fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .map_or_else(|| "pid unknown".to_owned(), |pid| format!("pid {pid}"));
            Err(EmbeddedError::InUse {
                data_dir: data_dir.to_path_buf(),
                holder,
            })
        }
        Err((_, errno)) => Err(io_err("lock", &path)(io::Error::from(errno))),
    }
}

/// A killed run can leave `postmaster.pid` behind. PostgreSQL ignores it when that pid is
/// dead, but not when the pid is alive — a zombie, or reused by an unrelated process — and
/// a server of ours may still be finishing the fast shutdown its parent's death began.
async fn wait_for_previous_server(data_dir: &Path) -> Result<(), EmbeddedError> {
    let pid_file = data_dir.join("postmaster.pid");
    let Some(pid) = fs::read_to_string(&pid_file)
        .ok()
        .and_then(|s| s.lines().next()?.trim().parse::<i32>().ok())
        .filter(|pid| *pid > 0)
    else {
        return Ok(());
    };
    let deadline = Instant::now() + PREVIOUS_SERVER_DEADLINE;
    loop {
        if !is_previous_server(pid, data_dir) {
            match fs::remove_file(&pid_file) {
                Ok(()) => tracing::info!(pid, "removed stale postmaster.pid"),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("remove stale", &pid_file)(e)),
            }
            return Ok(());
        }
        // A tollgate that takes no lock (an older one) is still its parent: it is not
        // shutting down, and waiting for it would only delay the same answer.
        if let Some(parent) = live_tollgate_parent(pid) {
            return Err(EmbeddedError::InUse {
                data_dir: data_dir.to_path_buf(),
                holder: format!("pid {parent}"),
            });
        }
        if Instant::now() >= deadline {
            return Err(EmbeddedError::AlreadyRunning {
                pid,
                data_dir: data_dir.to_path_buf(),
                waited_secs: PREVIOUS_SERVER_DEADLINE.as_secs(),
            });
        }
        sleep(POLL_INTERVAL).await;
    }
}

/// Whether `pid` is a live postgres that may be serving `data_dir`. In doubt (e.g. its
/// `/proc` entries are unreadable) the answer is yes: waiting is safe, deleting the lock
/// file of a running server is not.
fn is_previous_server(pid: i32, data_dir: &Path) -> bool {
    if !process_alive(Pid::from_raw(pid)) {
        return false;
    }
    if fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim() != "postgres") {
        return false;
    }
    // The postmaster chdirs into its data directory.
    match (
        fs::read_link(format!("/proc/{pid}/cwd")),
        fs::canonicalize(data_dir),
    ) {
        (Ok(cwd), Ok(ours)) => cwd == ours,
        _ => true,
    }
}

/// The parent of `pid` when it is a live `tollgate` (the postmaster of a running
/// tollgate is its child; one whose tollgate died has been reparented).
fn live_tollgate_parent(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let ppid: i32 = rest.split_whitespace().nth(1)?.parse().ok()?;
    let comm = fs::read_to_string(format!("/proc/{ppid}/comm")).ok()?;
    (ppid > 1 && comm.trim() == "tollgate" && process_alive(Pid::from_raw(ppid))).then_some(ppid)
}

/// Alive and not a zombie (an orphan whose reaper does not reap still answers kill(0)).
fn process_alive(pid: Pid) -> bool {
    match signal::kill(pid, None) {
        Err(Errno::ESRCH) => false,
        Ok(()) | Err(_) => !fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let (_, rest) = stat.rsplit_once(')')?;
                Some(rest.trim_start().starts_with('Z'))
            })
            .unwrap_or(false),
    }
}

fn pick_free_port() -> Result<u16, EmbeddedError> {
    let addr = std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .map_err(|source| EmbeddedError::Io {
            action: "pick a free port on",
            path: PathBuf::from("127.0.0.1"),
            source,
        })?;
    Ok(addr.port())
}

/// Everything one start attempt needs except the port.
struct Launch<'a> {
    bin_dir: &'a Path,
    data_dir: &'a Path,
    parent: &'a Path,
    log_path: &'a Path,
    run_as: Option<RunAs>,
    setpriv: Option<&'a Path>,
    opts: &'a EmbeddedOptions,
    password: &'a str,
}

impl Launch<'_> {
    async fn run(&self, port: u16) -> Result<EmbeddedPostgres, EmbeddedError> {
        let (log, offset) = open_log(self.log_path, self.run_as)?;
        let stdout = log.try_clone().map_err(io_err("open log file", self.log_path))?;
        let postgres = self.bin_dir.join("postgres");
        let mut cmd = match self.setpriv {
            Some(setpriv) => {
                let mut cmd = Command::new(setpriv);
                cmd.args(["--pdeathsig", "INT", "--"]).arg(&postgres);
                cmd
            }
            None => Command::new(&postgres),
        };
        cmd.arg("-D")
            .arg(self.data_dir)
            .arg("-p")
            .arg(port.to_string())
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "unix_socket_directories="])
            .arg("-c")
            .arg(format!("max_connections={}", self.opts.max_connections));
        if !self.opts.durable {
            for setting in ["fsync=off", "synchronous_commit=off", "full_page_writes=off"] {
                cmd.arg("-c").arg(setting);
            }
        }
        cmd.env("LC_ALL", "C")
            .current_dir(self.parent)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log)
            .process_group(0);
        if let Some(user) = self.run_as {
            cmd.uid(user.uid).gid(user.gid);
        }

        let program = self.setpriv.unwrap_or(&postgres).to_path_buf();
        let (spawned_tx, spawned_rx) = oneshot::channel();
        let (exit_tx, exit_rx) = oneshot::channel();
        // PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, so the
        // child is forked by a thread that lives exactly as long as the child does.
        std::thread::Builder::new()
            .name("tollgate-postgres".into())
            .spawn(move || match cmd.spawn() {
                Err(e) => {
                    let _ = spawned_tx.send(Err(e));
                }
                Ok(mut child) => {
                    let _ = spawned_tx.send(Ok(child.id()));
                    let _ = exit_tx.send(child.wait());
                }
            })
            .map_err(|source| EmbeddedError::Spawn {
                program: program.clone(),
                source,
            })?;
        let pid = spawned_rx
            .await
            .unwrap_or_else(|_| Err(io::Error::other("spawning thread died")))
            .map_err(|source| EmbeddedError::Spawn {
                program: program.clone(),
                source,
            })?;
        #[allow(clippy::cast_possible_wrap)] // pids fit in pid_t
        let pid = Pid::from_raw(pid as i32);
        let mut server = EmbeddedPostgres {
            port,
            password: self.password.to_owned(),
            pid,
            log_path: self.log_path.to_path_buf(),
            exit: exit_rx,
            exited: false,
            _lock: None,
        };
        tracing::debug!(%pid, port, "embedded PostgreSQL spawned");

        let deadline = Instant::now() + STARTUP_DEADLINE;
        let url = server.url(SUPERUSER);
        loop {
            match server.exit.try_recv() {
                Err(TryRecvError::Empty) => {}
                exited => {
                    server.exited = true;
                    let tail = log_tail(self.log_path, offset);
                    if tail.contains("Address already in use") {
                        return Err(EmbeddedError::PortInUse {
                            port,
                            log: self.log_path.to_path_buf(),
                        });
                    }
                    return Err(EmbeddedError::Exited {
                        status: match exited {
                            Ok(Ok(status)) => status.to_string(),
                            Ok(Err(e)) => format!("waiting for it failed: {e}"),
                            Err(_) => "its thread died".into(),
                        },
                        log: self.log_path.to_path_buf(),
                        tail,
                    });
                }
            }
            if self.is_ours(&url).await {
                tracing::info!(%pid, port, data_dir = %self.data_dir.display(), "embedded PostgreSQL ready");
                return Ok(server);
            }
            if Instant::now() >= deadline {
                if let Err(e) = server.shutdown().await {
                    tracing::warn!(error = %e, "could not stop the embedded PostgreSQL that never became ready");
                }
                return Err(EmbeddedError::NotReady {
                    waited_secs: STARTUP_DEADLINE.as_secs(),
                    log: self.log_path.to_path_buf(),
                    tail: log_tail(self.log_path, offset),
                });
            }
            sleep(POLL_INTERVAL).await;
        }
    }

    /// Whether a server on `url` accepts connections and serves our data directory — if
    /// another server grabbed the port first, ours is about to exit with "address in use".
    async fn is_ours(&self, url: &str) -> bool {
        let probe = async {
            let mut conn = sqlx::PgConnection::connect(url).await.ok()?;
            let dir: String = sqlx::query_scalar("SHOW data_directory")
                .fetch_one(&mut conn)
                .await
                .ok()?;
            let _ = conn.close().await;
            Some(dir)
        };
        match timeout(PROBE_TIMEOUT, probe).await {
            Ok(Some(dir)) => {
                let theirs = fs::canonicalize(&dir).unwrap_or_else(|_| PathBuf::from(&dir));
                let ours = fs::canonicalize(self.data_dir).unwrap_or_else(|_| self.data_dir.to_path_buf());
                theirs == ours
            }
            _ => false,
        }
    }
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> EmbeddedError + 'a {
    move |source| EmbeddedError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set only in the helper process `server_dies_with_its_parent` starts.
    const KILL_HELPER_ENV: &str = "TOLLGATE_EMBEDDED_KILL_HELPER_DIR";

    fn test_options(data_dir: PathBuf) -> EmbeddedOptions {
        EmbeddedOptions {
            durable: false,
            ..EmbeddedOptions::new(data_dir)
        }
    }

    async fn poll_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + limit;
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            sleep(POLL_INTERVAL).await;
        }
    }

    #[test]
    fn find_bin_dir_finds_server_binaries() {
        let dir = find_bin_dir().unwrap();
        assert!(has_server_binaries(&dir), "{}", dir.display());
        assert_eq!(
            EmbeddedError::NoBinaries.to_string(),
            "no PostgreSQL server binaries found: install PostgreSQL (Debian: apt-get install postgresql) or set DATABASE_URL or TOLLGATE_PG_BIN_DIR"
        );
    }

    #[tokio::test]
    async fn start_query_stop_restart_keeps_data() {
        let tmp = tempfile::tempdir().unwrap();
        let data_dir = tmp.path().join("pg");

        let pg = EmbeddedPostgres::start(test_options(data_dir.clone()))
            .await
            .unwrap();
        assert_ne!(pg.port(), 5432);
        let mut conn = sqlx::PgConnection::connect(&pg.url("postgres")).await.unwrap();
        let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut conn).await.unwrap();
        assert_eq!(one, 1);
        sqlx::query("CREATE DATABASE kept")
            .execute(&mut conn)
            .await
            .unwrap();
        conn.close().await.unwrap();
        let mut conn = sqlx::PgConnection::connect(&pg.url("kept")).await.unwrap();
        sqlx::raw_sql("CREATE TABLE t (x int); INSERT INTO t VALUES (42)")
            .execute(&mut conn)
            .await
            .unwrap();
        conn.close().await.unwrap();
        let log = pg.log_path().to_path_buf();
        pg.stop().await.unwrap();
        assert!(!data_dir.join("postmaster.pid").exists());
        assert!(fs::metadata(&log).unwrap().len() > 0);

        // A stale lock file naming a live, unrelated process of the server's user (a
        // reused pid) blocks PostgreSQL itself; start must see through it.
        let mut stranger = Command::new("sleep");
        stranger.arg("60");
        if let Some(user) = run_as().unwrap() {
            stranger.uid(user.uid).gid(user.gid);
        }
        let mut stranger = stranger.spawn().unwrap();
        let lock = format!("{}\n{}\n", stranger.id(), data_dir.display());
        fs::write(data_dir.join("postmaster.pid"), lock).unwrap();

        let started = EmbeddedPostgres::start(test_options(data_dir.clone())).await;
        stranger.kill().unwrap();
        stranger.wait().unwrap();
        let pg = started.unwrap();
        let mut conn = sqlx::PgConnection::connect(&pg.url("kept")).await.unwrap();
        let x: i32 = sqlx::query_scalar("SELECT x FROM t")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(x, 42);
        conn.close().await.unwrap();
        pg.stop().await.unwrap();
    }

    /// A second start on a data directory whose server runs says at once that another
    /// tollgate uses it (it waited 30 s, then suggested stopping that server), and
    /// leaves the first one serving; once the first stops, the directory is free.
    #[tokio::test]
    async fn a_second_start_on_a_directory_in_use_says_so_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let data_dir = tmp.path().join("pg");
        let first = EmbeddedPostgres::start(test_options(data_dir.clone()))
            .await
            .unwrap();

        let asked = std::time::Instant::now();
        let second = EmbeddedPostgres::start(test_options(data_dir.clone())).await;
        let waited = asked.elapsed();
        let e = second.unwrap_err();
        assert!(matches!(e, EmbeddedError::InUse { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains(&format!("another tollgate (pid {})", std::process::id())),
            "{text}"
        );
        assert!(!text.contains("pg_ctl"), "{text}");
        assert!(waited < Duration::from_secs(5), "answered after {waited:?}");

        let mut conn = sqlx::PgConnection::connect(&first.url("postgres")).await.unwrap();
        let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut conn).await.unwrap();
        assert_eq!(one, 1);
        conn.close().await.unwrap();
        first.stop().await.unwrap();

        let again = EmbeddedPostgres::start(test_options(data_dir)).await.unwrap();
        again.stop().await.unwrap();
    }

    /// What anybody on the machine could try over the loopback port, and reading the
    /// password file as another OS user.
    #[tokio::test]
    async fn accepts_nobody_without_its_password() {
        let tmp = tempfile::tempdir().unwrap();
        let data_dir = tmp.path().join("pg");
        let pg = EmbeddedPostgres::start(test_options(data_dir.clone()))
            .await
            .unwrap();
        let password_file = sibling(&data_dir, "password");
        let mode = fs::metadata(&password_file).unwrap().mode();
        assert_eq!(mode & 0o777, 0o600, "password file mode {mode:o}");

        let no_password = format!("postgres://{SUPERUSER}@127.0.0.1:{}/postgres", pg.port());
        let wrong_password = format!("postgres://{SUPERUSER}:guess@127.0.0.1:{}/postgres", pg.port());
        for url in [&no_password, &wrong_password] {
            let refused = sqlx::PgConnection::connect(url).await;
            assert!(refused.is_err(), "{url} got in");
        }
        let hba = fs::read_to_string(data_dir.join("pg_hba.conf")).unwrap();
        assert_eq!(hba, PG_HBA);
        assert!(!trusts_anyone(&data_dir).unwrap());
        let conn = sqlx::PgConnection::connect(&pg.url("postgres")).await.unwrap();
        conn.close().await.unwrap();

        if nix::unistd::geteuid().is_root() {
            let nobody = User::from_name("nobody").unwrap().expect("the nobody user");
            let read = Command::new("cat")
                .arg(&password_file)
                .uid(nobody.uid.as_raw())
                .gid(nobody.gid.as_raw())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap();
            assert!(!read.success(), "another OS user read the password file");
        }
        pg.stop().await.unwrap();
    }

    #[tokio::test]
    async fn a_cluster_that_trusted_everyone_is_locked_down_on_start() {
        let tmp = tempfile::tempdir().unwrap();
        let data_dir = tmp.path().join("pg");
        let pg = EmbeddedPostgres::start(test_options(data_dir.clone()))
            .await
            .unwrap();
        let mut conn = sqlx::PgConnection::connect(&pg.url("postgres")).await.unwrap();
        sqlx::query("CREATE DATABASE kept")
            .execute(&mut conn)
            .await
            .unwrap();
        conn.close().await.unwrap();
        pg.stop().await.unwrap();
        // What an older tollgate left: trust for every loopback connection, no password.
        fs::write(data_dir.join("pg_hba.conf"), "host all all 127.0.0.1/32 trust\n").unwrap();
        fs::remove_file(sibling(&data_dir, "password")).unwrap();

        let pg = EmbeddedPostgres::start(test_options(data_dir.clone()))
            .await
            .unwrap();
        let no_password = format!("postgres://{SUPERUSER}@127.0.0.1:{}/kept", pg.port());
        assert!(sqlx::PgConnection::connect(&no_password).await.is_err());
        let conn = sqlx::PgConnection::connect(&pg.url("kept")).await.unwrap();
        conn.close().await.unwrap();
        pg.stop().await.unwrap();

        // The password file is what opens a locked cluster: without it, a clear refusal.
        fs::remove_file(sibling(&data_dir, "password")).unwrap();
        let err = EmbeddedPostgres::start(test_options(data_dir)).await.unwrap_err();
        assert!(matches!(err, EmbeddedError::PasswordMissing { .. }), "{err}");
    }

    /// As root, the server runs as `postgres`; a directory of another user's on the way to
    /// the data directory is reported, not opened up.
    #[tokio::test]
    async fn leaves_the_directories_of_others_as_they_are() {
        let Some(_) = run_as().unwrap() else {
            return; // not root: everything runs as us and nothing is chmodded
        };
        let tmp = tempfile::tempdir().unwrap();
        let theirs = tmp.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        let nobody = User::from_name("nobody").unwrap().expect("the nobody user");
        std::os::unix::fs::chown(&theirs, Some(nobody.uid.as_raw()), Some(nobody.gid.as_raw())).unwrap();
        fs::set_permissions(&theirs, fs::Permissions::from_mode(0o700)).unwrap();

        let err = EmbeddedPostgres::start(test_options(theirs.join("pg")))
            .await
            .unwrap_err();
        assert!(matches!(err, EmbeddedError::NotSearchable { .. }), "{err}");
        assert_eq!(fs::metadata(&theirs).unwrap().mode() & 0o7777, 0o700);
    }

    #[tokio::test]
    async fn refuses_a_directory_that_is_not_a_cluster() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("notes.txt"), "mine").unwrap();
        let err = EmbeddedPostgres::start(test_options(tmp.path().to_path_buf()))
            .await
            .unwrap_err();
        assert!(matches!(err, EmbeddedError::NotACluster { .. }), "{err}");
        assert!(!err.to_string().contains('\n'));
    }

    /// The helper `server_dies_with_its_parent` runs in a child process: starts a server,
    /// publishes the postmaster's pid, and waits to be SIGKILLed. A no-op otherwise.
    #[tokio::test]
    async fn kill_helper() {
        let Some(dir) = std::env::var_os(KILL_HELPER_ENV) else {
            return;
        };
        let dir = PathBuf::from(dir);
        let pg = EmbeddedPostgres::start(test_options(dir.join("pg")))
            .await
            .unwrap();
        fs::write(dir.join("pid.tmp"), pg.pid.to_string()).unwrap();
        fs::rename(dir.join("pid.tmp"), dir.join("pid")).unwrap();
        std::future::pending::<()>().await;
    }

    #[tokio::test]
    async fn server_dies_with_its_parent() {
        let tmp = tempfile::tempdir().unwrap();
        let mut helper = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "embedded::tests::kill_helper",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(KILL_HELPER_ENV, tmp.path())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid_file = tmp.path().join("pid");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !pid_file.exists() {
            assert!(
                helper.try_wait().unwrap().is_none(),
                "helper exited before starting PostgreSQL"
            );
            assert!(Instant::now() < deadline, "helper did not start PostgreSQL");
            sleep(POLL_INTERVAL).await;
        }
        let postmaster = Pid::from_raw(fs::read_to_string(&pid_file).unwrap().parse().unwrap());
        assert!(process_alive(postmaster));

        helper.start_kill().unwrap(); // SIGKILL: no destructor, no stop()
        helper.wait().await.unwrap();

        poll_until("the postmaster to exit", Duration::from_secs(30), || {
            !process_alive(postmaster)
        })
        .await;
    }
}
