//! Test support: a throw-away PostgreSQL server per test binary and a fresh
//! database (or SQLite file) per test, so every storage test runs on both
//! backends.
//!
//! The server is started with `initdb` into a temp dir and `postgres` on a
//! free loopback port; as root it runs as the `postgres` system user. A
//! watchdog shell stops it and removes its directory when the test process
//! exits. `TEST_DATABASE_URL` replaces the throw-away server when set.
//! Without PostgreSQL binaries the PostgreSQL half of a test is skipped with
//! a message, except under `CI=true`, where it fails.

#![allow(dead_code)]

pub mod gen;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where a backend for one test lives.
pub struct TestDb {
    /// What to pass as `--database` / `Store::open`.
    pub url: String,
    /// Keeps a SQLite file's directory alive.
    _dir: Option<tempfile::TempDir>,
}

/// A fresh SQLite database file.
pub fn sqlite_db() -> TestDb {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("store.db").display());
    TestDb {
        url,
        _dir: Some(dir),
    }
}

/// A fresh PostgreSQL database, or `None` (skipped) outside CI without
/// PostgreSQL.
pub fn postgres_db() -> Option<TestDb> {
    let admin = postgres_admin_url()?;
    static N: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "t_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        uuid::Uuid::new_v4().simple()
    );
    let (base, _) = admin.rsplit_once('/').expect("admin url has a database");
    psql(&admin, &format!("CREATE DATABASE {name}"));
    Some(TestDb {
        url: format!("{base}/{name}"),
        _dir: None,
    })
}

fn psql(url: &str, sql: &str) {
    // Use sqlx in a throw-away runtime so tests need no psql binary.
    let url = url.to_owned();
    let sql = sql.to_owned();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            use sqlx::Connection;
            let mut c = sqlx::PgConnection::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("connect {url}: {e}"));
            sqlx::raw_sql(&sql)
                .execute(&mut c)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        })
    })
    .join()
    .unwrap();
}

/// The admin URL of the shared test server (started on first use).
pub fn postgres_admin_url() -> Option<String> {
    static URL: OnceLock<Option<String>> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("TEST_DATABASE_URL") {
            return Some(url);
        }
        match find_pg_bin() {
            Some(bin) => Some(PgServer::start(&bin).url()),
            None if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("CI=true but no PostgreSQL server binaries (initdb, postgres) were found on PATH or in /usr/lib/postgresql/*/bin")
            }
            None => {
                eprintln!("SKIPPED: PostgreSQL binaries not found; the PostgreSQL half of these tests did not run");
                None
            }
        }
    })
    .clone()
}

/// The directory holding `initdb` and `postgres`.
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

/// Runs a command, as the `postgres` user when we are root.
pub fn pg_command(bin: &Path, program: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin.join(program));
        c
    } else {
        Command::new(bin.join(program))
    }
}

/// A free loopback port (bound and released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A throw-away PostgreSQL server.
pub struct PgServer {
    pub bin: PathBuf,
    pub dir: PathBuf,
    pub port: u16,
}

impl PgServer {
    /// initdb + start; the watchdog stops it when this process exits.
    pub fn start(bin: &Path) -> PgServer {
        let dir = std::env::temp_dir().join(format!(
            "session-store-pg-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("pg dir");
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            assert!(ok, "chown of {} to postgres failed", dir.display());
        }
        let data = dir.join("data");
        let out = pg_command(bin, "initdb")
            .args(["-D"])
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let server = PgServer {
            bin: bin.to_owned(),
            dir,
            port: free_port(),
        };
        server.launch();
        server.spawn_watchdog();
        server
    }

    /// Starts the server on its data dir and waits until it accepts.
    pub fn launch(&self) {
        let data = self.dir.join("data");
        let log = self.dir.join("server.log");
        let out = pg_command(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .arg("-o")
            .arg(format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
                self.port,
                self.dir.display()
            ))
            .args(["-w", "-t", "60", "start"])
            .stdin(Stdio::null())
            .output()
            .expect("run pg_ctl start");
        assert!(
            out.status.success(),
            "pg_ctl start failed: {} {}",
            String::from_utf8_lossy(&out.stdout),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "PostgreSQL did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the server immediately (fault injection).
    pub fn stop(&self) {
        let _ = pg_command(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .output();
    }

    /// A shell that waits for this process to exit, then stops the server
    /// and removes its directory.
    // The watchdog must outlive this process, so it is never waited for.
    #[allow(clippy::zombie_processes)]
    fn spawn_watchdog(&self) {
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
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; {stop} >/dev/null 2>&1; rm -rf {dir}",
            pid = std::process::id(),
            dir = self.dir.display()
        );
        Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn watchdog");
    }

    /// The admin URL.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

/// Writes a test body once and runs it on both backends:
/// `both_backends!(name, |url| async move { ... });`
#[macro_export]
macro_rules! both_backends {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                let db = common::sqlite_db();
                ($body)(db.url.clone()).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let Some(db) = common::postgres_db() else {
                    return;
                };
                ($body)(db.url.clone()).await;
            }
        }
    };
}

/// Runs one SQL statement on the test database behind the store's back,
/// as an operator (or an attacker) with database access would.
#[allow(dead_code)]
pub fn raw_sql(url: &str, sql: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if url.starts_with("postgres") {
            let pool = sqlx::PgPool::connect(url).await.unwrap();
            sqlx::query(sql).execute(&pool).await.unwrap();
        } else {
            let pool = sqlx::SqlitePool::connect(url).await.unwrap();
            sqlx::query(sql).execute(&pool).await.unwrap();
        }
    });
}
