//! Test support: a throw-away PostgreSQL server per test binary and a fresh
//! database (or SQLite file) per test, so every storage test runs on both
//! backends.
//!
//! The server is `session_store::pgtemp` (`initdb` into a temp dir,
//! `postgres` on a free loopback port, as the `postgres` system user when
//! root, a watchdog that stops it when the test process exits), run with
//! `fsync=off`. `TEST_DATABASE_URL` replaces the throw-away server when set.
//! Without PostgreSQL binaries the PostgreSQL half of a test is skipped with
//! a message, except under `CI=true`, where it fails.

#![allow(dead_code)]

pub mod gen;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The binary on `url` with `args`, `stdin` written to it and `env` set
/// (`DATABASE_URL` and `PGPASSWORD` removed, so that only what a test
/// gives counts). A command refused before it reads its input may have
/// exited already: its answer is what the test judges, not the write.
pub fn run_bin(
    url: &str,
    args: &[&str],
    stdin: &str,
    env: &[(&str, &std::ffi::OsStr)],
) -> std::process::Output {
    use std::io::Write;
    use std::process::{Command, Stdio};
    // Set for the tests; the examples that share this module run no binary.
    let bin = option_env!("CARGO_BIN_EXE_session-store").unwrap_or("session-store");
    let mut child = Command::new(bin)
        .arg("--database")
        .arg(url)
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("PGPASSWORD")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run session-store");
    match child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other.unwrap(),
    }
    child.wait_with_output().unwrap()
}

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
    postgres_db_with("")
}

/// [`postgres_db`] created with `options` after `CREATE DATABASE name`
/// (a template, an encoding, a collation).
pub fn postgres_db_with(options: &str) -> Option<TestDb> {
    let admin = postgres_admin_url()?;
    static N: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "t_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        uuid::Uuid::new_v4().simple()
    );
    let (base, _) = admin.rsplit_once('/').expect("admin url has a database");
    psql(&admin, &format!("CREATE DATABASE {name} {options}"));
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
        pg_bin().map(|bin| start_pg_server(&bin).url())
    })
    .clone()
}

/// The PostgreSQL binaries' directory, or `None` (the test is skipped,
/// and says so) where there are none; under CI=true their absence fails
/// the test, since CI must run every PostgreSQL test.
pub fn pg_bin() -> Option<std::path::PathBuf> {
    match find_pg_bin() {
        Some(bin) => Some(bin),
        None if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("CI=true but no PostgreSQL server binaries (initdb, postgres) were found on PATH or in /usr/lib/postgresql/*/bin")
        }
        None => {
            eprintln!("SKIPPED: PostgreSQL binaries not found; the PostgreSQL half of these tests did not run");
            None
        }
    }
}

pub use session_store::pgtemp::{find_pg_bin, PgServer};

/// A free loopback port (bound and released).
pub fn free_port() -> u16 {
    session_store::pgtemp::free_port().expect("free port")
}

/// Starts a throw-away server for tests: `fsync=off`, since tests check
/// behaviour, not durability.
pub fn start_pg_server(bin: &Path) -> PgServer {
    let options = session_store::pgtemp::PgTempOptions {
        fsync: false,
        ..Default::default()
    };
    PgServer::start(bin, options).unwrap_or_else(|e| panic!("{e}"))
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
    block_on(async {
        if url.starts_with("postgres") {
            let pool = sqlx::PgPool::connect(url).await.unwrap();
            sqlx::query(sql).execute(&pool).await.unwrap();
        } else {
            let pool = sqlx::SqlitePool::connect(url).await.unwrap();
            sqlx::query(sql).execute(&pool).await.unwrap();
        }
    });
}

/// The first column of the first row of `sql`, as text (`None` when there
/// is no row or it is NULL), read around the store.
pub fn scalar(url: &str, sql: &str) -> Option<String> {
    block_on(async {
        if url.starts_with("postgres") {
            let pool = sqlx::PgPool::connect(url).await.unwrap();
            sqlx::query_scalar(sql).fetch_optional(&pool).await.unwrap()
        } else {
            let pool = sqlx::SqlitePool::connect(url).await.unwrap();
            sqlx::query_scalar(sql).fetch_optional(&pool).await.unwrap()
        }
    })
    .flatten()
}

/// `f` run to completion on a runtime of its own (the tests are sync).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}
