//! A throw-away PostgreSQL server: `initdb` into a temp dir, `postgres` on a
//! free loopback port, stopped and removed when its owner is done.
//!
//! The tests start one per test binary (with `fsync=off`: they check
//! behaviour, not durability), and `session-store bench` starts one with the
//! server's default durability (`fsync=on`, `synchronous_commit=on`), so its
//! figures include the fsync a production server pays. It lives in the
//! library rather than in `tests/` so that both can use it.
//!
//! As root (CI containers) the server runs as the `postgres` system user
//! through `runuser`, since PostgreSQL refuses to run as root. A watchdog
//! shell stops the server and removes its directory when the owning process
//! exits, even if it is killed, so no server outlives a crashed run.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A throw-away server could not be found, set up or started.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PgTempError(String);

/// How the throw-away server runs.
#[derive(Clone, Debug)]
pub struct PgTempOptions {
    /// `fsync` (and so the durability of commits). Off is faster and fine
    /// for behaviour tests; benchmarks keep it on.
    pub fsync: bool,
    /// `max_connections`.
    pub max_connections: u32,
    /// `initdb --wal-segsize` (MiB; `None`: the server's 16). Small
    /// segments let [`PgTempOptions::file_size_limit_kib`] be small.
    pub wal_segment_mib: Option<u32>,
    /// The largest file the server may write, in KiB (`ulimit -f`, set at
    /// each [`PgServer::launch`]; `None`: no limit): a full disk for one
    /// table at a time. PostgreSQL ignores `SIGXFSZ`, so a write past the
    /// limit fails (`EFBIG`) and the statement that extends a table with it
    /// fails. It must leave room for whole WAL segments.
    pub file_size_limit_kib: Option<u64>,
}

impl Default for PgTempOptions {
    /// The server's defaults for durability: `fsync=on`.
    fn default() -> Self {
        PgTempOptions {
            fsync: true,
            max_connections: 200,
            wal_segment_mib: None,
            file_size_limit_kib: None,
        }
    }
}

/// The directory holding `initdb` and `postgres`: `$PG_BIN`, then `PATH`,
/// then the newest `/usr/lib/postgresql/*/bin`.
pub fn find_pg_bin() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(dir) = std::env::var("PG_BIN") {
        candidates.push(dir.into());
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path));
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("bin")).collect();
        versions.sort();
        versions.reverse();
        candidates.extend(versions);
    }
    candidates
        .into_iter()
        .find(|d| d.join("initdb").is_file() && d.join("postgres").is_file())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A command running one of the server's programs, as the `postgres` user
/// when we are root.
pub fn pg_command(bin: &Path, program: &str) -> Command {
    limited_pg_command(bin, program, None)
}

/// [`pg_command`], run under a limit of `limit_kib` KiB on the size of any
/// file it (and every process it starts) writes, when given.
fn limited_pg_command(bin: &Path, program: &str, limit_kib: Option<u64>) -> Command {
    let mut argv: Vec<std::ffi::OsString> = Vec::new();
    if is_root() {
        argv.extend(["runuser", "-u", "postgres", "--"].map(Into::into));
    }
    argv.push(bin.join(program).into());
    let mut c = match limit_kib {
        Some(kib) => {
            // bash counts `ulimit -f` in KiB (a POSIX sh in 512 bytes).
            let mut c = Command::new("bash");
            c.args(["-c", r#"ulimit -f "$1" && shift && exec "$@""#, "bash"])
                .arg(kib.to_string());
            c.args(&argv);
            c
        }
        None => {
            let mut c = Command::new(&argv[0]);
            c.args(&argv[1..]);
            c
        }
    };
    c.stdin(Stdio::null());
    c
}

/// A free loopback port (bound and released; another process could take it
/// before the server does, which is unlikely enough for tests and benches).
pub fn free_port() -> std::io::Result<u16> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
}

/// A running throw-away server.
#[derive(Debug)]
pub struct PgServer {
    /// Where `pg_ctl` and friends are.
    pub bin: PathBuf,
    /// The server's directory (data dir, socket, log); removed at the end.
    pub dir: PathBuf,
    /// The loopback port it listens on.
    pub port: u16,
    options: PgTempOptions,
}

impl PgServer {
    /// Runs `initdb` into a new temp dir and starts the server; a watchdog
    /// stops it when this process exits.
    pub fn start(bin: &Path, options: PgTempOptions) -> Result<PgServer, PgTempError> {
        let dir = std::env::temp_dir().join(format!(
            "session-store-pg-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| {
            PgTempError(format!(
                "cannot create the PostgreSQL directory {}: {e}",
                dir.display()
            ))
        })?;
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                return Err(PgTempError(format!(
                    "cannot give {} to the postgres user (chown failed); as root the server must run as postgres",
                    dir.display()
                )));
            }
        }
        let data = dir.join("data");
        let out = pg_command(bin, "initdb")
            .args(["-D"])
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .args(
                options
                    .wal_segment_mib
                    .map(|mib| format!("--wal-segsize={mib}")),
            )
            .output()
            .map_err(|e| PgTempError(format!("cannot run initdb: {e}")))?;
        if !out.status.success() {
            return Err(PgTempError(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let port = free_port().map_err(|e| PgTempError(format!("no free port: {e}")))?;
        let server = PgServer {
            bin: bin.to_owned(),
            dir,
            port,
            options,
        };
        server.spawn_watchdog()?;
        server.launch()?;
        Ok(server)
    }

    /// The limit on the size of the server's files from its next
    /// [`PgServer::launch`] on ([`PgTempOptions::file_size_limit_kib`]).
    pub fn set_file_size_limit_kib(&mut self, kib: Option<u64>) {
        self.options.file_size_limit_kib = kib;
    }

    /// Starts the server on its data dir and waits until it accepts
    /// connections (also after [`PgServer::stop`]).
    pub fn launch(&self) -> Result<(), PgTempError> {
        let data = self.dir.join("data");
        let log = self.dir.join("server.log");
        let out = limited_pg_command(&self.bin, "pg_ctl", self.options.file_size_limit_kib)
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .arg("-o")
            .arg(format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync={} -c max_connections={}",
                self.port,
                self.dir.display(),
                if self.options.fsync { "on" } else { "off" },
                self.options.max_connections
            ))
            .args(["-w", "-t", "60", "start"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| PgTempError(format!("cannot run pg_ctl start: {e}")))?;
        if !out.status.success() {
            return Err(PgTempError(format!(
                "pg_ctl start failed: {} {}",
                String::from_utf8_lossy(&out.stdout).trim(),
                std::fs::read_to_string(&log).unwrap_or_default().trim()
            )));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                return Err(PgTempError(format!(
                    "PostgreSQL did not accept connections on port {} within 30 s",
                    self.port
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Stops the server at once, as a crash would (`-m immediate`); its data
    /// dir stays, so [`PgServer::launch`] starts it again.
    pub fn stop(&self) {
        let _ = self.pg_ctl_stop("immediate");
    }

    /// Shuts the server down cleanly (`-m fast`: a final checkpoint, no
    /// crash recovery at the next start) and starts it again: its shared
    /// buffers start empty, as after a host's restart.
    pub fn restart(&self) -> Result<(), PgTempError> {
        self.pg_ctl_stop("fast")?;
        self.launch()
    }

    /// `pg_ctl stop` in `mode`, waiting for the server to be gone (at most
    /// pg_ctl's 60 s).
    fn pg_ctl_stop(&self, mode: &str) -> Result<(), PgTempError> {
        let out = pg_command(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", mode, "-w", "stop"])
            .output()
            .map_err(|e| PgTempError(format!("cannot run pg_ctl stop: {e}")))?;
        if !out.status.success() {
            return Err(PgTempError(format!(
                "pg_ctl stop -m {mode} failed: {} {}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }

    /// Stops the server and removes its directory now, rather than when the
    /// process exits.
    pub fn shutdown(self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// A shell that waits for this process to exit, then stops the server
    /// and removes its directory.
    // The watchdog must outlive this process, so it is never waited for.
    #[allow(clippy::zombie_processes)]
    fn spawn_watchdog(&self) -> Result<(), PgTempError> {
        let pg_ctl = self.bin.join("pg_ctl");
        let data = self.dir.join("data");
        let stop = if is_root() {
            format!(
                "runuser -u postgres -- {} -D {} -m immediate stop",
                pg_ctl.display(),
                data.display()
            )
        } else {
            format!(
                "{} -D {} -m immediate stop",
                pg_ctl.display(),
                data.display()
            )
        };
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; if [ -d {dir} ]; then {stop} >/dev/null 2>&1; rm -rf {dir}; fi",
            pid = std::process::id(),
            dir = self.dir.display()
        );
        Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map(|_| ())
            .map_err(|e| PgTempError(format!("cannot start the server's watchdog: {e}")))
    }

    /// The admin URL (user `postgres`, database `postgres`).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}
