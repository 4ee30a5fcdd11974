//! Opening a SQLite store safely: what a URL names (a file, never an
//! in-memory database), whether that file is a store, one being migrated,
//! or something else to leave alone, and the connection settings every
//! connection gets (WAL, `synchronous=FULL`, the busy timeout).

use super::*;

pub(super) fn path_of(url: &str) -> &str {
    url.strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url)
}

/// Every table the migrations make, and the migrator's own: a file with
/// any other table is not a store (`check_file`); a store another process
/// is migrating right now has only some of them.
pub(super) const STORE_TABLES: [&str; 8] = [
    "_sqlx_migrations",
    "events",
    "calls",
    "session_views",
    "session_owners",
    "chain_backfill",
    "activation_changes",
    "changes_backfill",
];

/// Whether a path's lookup failed because nothing is there: the file, or
/// a directory on its way (a file where a directory should be).
fn is_missing(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
    )
}

/// A name beside `path` that no other process uses: this process's id and
/// a random part.
fn probe_path(path: &str) -> String {
    static PROBE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let suffix =
        PROBE.get_or_init(|| format!("{}-{}", std::process::id(), Uuid::new_v4().simple()));
    format!("{path}.probe-{suffix}")
}

/// Where a new store file would go: a missing directory is the caller's
/// mistake (exit 1), said as such, not the "unable to open database file"
/// of a storage outage.
fn check_parent(path: &str) -> Result<()> {
    let parent = match std::path::Path::new(path).parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(meta) if !meta.is_dir() => Err(Error::NotAStore(format!(
            "cannot create a session store at {path}: {} is not a directory",
            parent.display()
        ))),
        Err(e) if is_missing(&e) => Err(Error::NotAStore(format!(
            "cannot create a session store at {path}: the directory {} does not exist",
            parent.display()
        ))),
        // A directory, or one that cannot be looked at: a file made there
        // under a name of this process's own says whether SQLite could
        // make the store (SQLite would only say "unable to open database
        // file"). Never the store's own path: another process may be
        // creating the store there at this moment.
        _ => match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(probe_path(path))
        {
            Ok(_) => {
                let _ = std::fs::remove_file(probe_path(path));
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(Error::Unavailable(format!(
                "cannot create a session store at {path}: {e} (SQLite makes the file, and its -wal and -shm files, in {}, which must be writable by this user)",
                match parent.as_os_str() == "." {
                    true => "the current directory".to_owned(),
                    false => parent.display().to_string(),
                }
            ))),
        },
    }
}

/// The file a SQLite URL names, as the driver will open it (its URL parser
/// percent-decodes the path and reads `?mode=…` options); `None` for a
/// database in memory or a temporary one.
fn file_of(url: &str) -> Result<Option<String>> {
    let target = connect_options(url)?;
    let name = target.get_filename().to_string_lossy().into_owned();
    let path = match name.strip_prefix("file:") {
        // A SQLite URI, which the driver hands on for SQLite to decode: the
        // file it names is checked as any other (it was not, and a `file:`
        // name of another application's database was migrated).
        Some(_) => match uri_file(&name).ok_or_else(|| Error::BadUrl(url.to_owned()))? {
            Some(path) => path,
            None => return Ok(None),
        },
        None => name,
    };
    if path.contains('\0') {
        return Err(Error::BadUrl(url.to_owned()));
    }
    Ok(Some(path))
}

/// Whether `url` names a SQLite file that does not exist (so that opening
/// it with [`StoreOptions::create_if_missing`] would make a new store); an
/// error where it could not be made (a directory that does not exist or
/// cannot be written), as opening would say.
pub(crate) fn file_is_missing(url: &str) -> Result<bool> {
    if path_of(url).is_empty() {
        return Err(Error::BadUrl(url.to_owned()));
    }
    match file_of(url)? {
        Some(path) if std::fs::metadata(&path).is_err_and(|e| is_missing(&e)) => {
            check_parent(&path).map(|()| true)
        }
        _ => Ok(false),
    }
}

/// Refuses a path that holds no session store before anything is written
/// to it: opening turns a file into WAL mode and migrates it, which must
/// not happen to another application's database named by mistake.
/// - A missing file is created only when `create` is set (the CLI's
///   commands that only read do not set it).
/// - An existing file is read first, through a connection that never
///   creates (and is read-only where the URL says `mode=ro` or the file
///   allows no writes): it must be empty, or a SQLite database with no
///   tables but the store's (all of them, or the first ones while another
///   process migrates it). Reading it lets SQLite roll back a transaction
///   a killed process left in its `-journal` file, as any opening would.
///
/// Answers the path of a file it found missing and that opening will
/// create (`None` when the file exists, or its path is SQLite's to find).
pub(super) async fn check_file(url: &str, create: bool) -> Result<Option<String>> {
    let (_, query) = path_of(url).split_once('?').unwrap_or(("", ""));
    let Some(path) = file_of(url)? else {
        // No file (in memory, or a temporary database): refused by
        // `check_durable` once opened.
        return Ok(None);
    };
    let path = path.as_str();
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if is_missing(&e) => {
            // A symbolic link to nothing: what SQLite would make is its
            // target, so the target's directory is the one to check.
            let target =
                std::fs::read_link(path)
                    .ok()
                    .map(|t| match std::path::Path::new(path).parent() {
                        Some(dir) if t.is_relative() => dir.join(t),
                        _ => t,
                    });
            let made = target.as_deref().and_then(|t| t.to_str()).unwrap_or(path);
            return match create {
                true => check_parent(made).map(|()| Some(path.to_owned())),
                false => Err(Error::NotAStore(format!(
                    "there is no session store at {path}: the file does not exist (import, append, migrate, serve and tail --follow create one)"
                ))),
            };
        }
        // Symbolic links that lead back to themselves (ELOOP on Linux):
        // the path's fault, not the storage's.
        #[cfg(target_os = "linux")]
        Err(e) if e.raw_os_error() == Some(40) => {
            return Err(Error::NotAStore(format!(
                "{path} is a symbolic link that leads back to itself ({e}), not a session store file"
            )));
        }
        // Left to the connection, whose error names the cause.
        Err(_) => return Ok(None),
    };
    if meta.is_dir() {
        return Err(Error::NotAStore(format!(
            "{path} is a directory, not a session store file"
        )));
    }
    if !meta.is_file() {
        // SQLite would write its -journal beside a device (`/dev/null`
        // made `/dev/null-journal`) and then fail with an I/O error.
        return Err(Error::NotAStore(format!(
            "{path} is not a regular file (a device, a pipe or a socket), so not a session store file"
        )));
    }
    // A command that only reads does not make a store of an empty file
    // either: what it would answer ("session not found") would hide that
    // the file is not the store the user meant, such as a copy of a
    // running store's file made without its -wal file.
    let empty = |what: &str| {
        Error::NotAStore(format!(
            "there is no session store in {path}: {what} (another process may be creating one there this moment; or it is a copy of a store's file made without its -wal file, which looks like this: back up with sqlite3's .backup instead; import, append, migrate, serve and tail --follow make a store of it)"
        ))
    };
    if meta.len() == 0 {
        return match create {
            true => Ok(None),
            false => Err(empty("the file is empty")),
        };
    }
    // Read-write where the file allows it (SQLite opens it read-only where
    // it does not), but never created: a process killed while it created
    // the store can leave a hot rollback journal (written before WAL mode
    // is on), which the first connection must roll back, and a read-only
    // connection cannot: every command after such a crash failed with
    // "attempt to write a readonly database".
    let read_only = query.split('&').any(|o| o == "mode=ro");
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(false)
        .read_only(read_only)
        .busy_timeout(Duration::from_secs(10));
    let hot_journal = !read_only && is_hot_journal(&format!("{path}-journal"));
    // Only "not a database" (SQLITE_NOTADB) says what the file is; a
    // permission, lock or I/O failure is the storage's, said as such.
    let not_sqlite = |e: sqlx::Error| {
        let notadb = match &e {
            sqlx::Error::Database(d) => {
                d.code().as_deref() == Some("26") || d.message().contains("not a database")
            }
            _ => false,
        };
        match notadb {
            true => Error::NotAStore(format!(
                "{path} is not a SQLite database, so not a session store ({})",
                sqlx_message(&e)
            )),
            false => match Error::from_sqlx(e) {
                Error::Unavailable(m) | Error::Database(m) if m.contains("readonly") => {
                    Error::Unavailable(format!(
                        "cannot read {path}: {m} (a store is in WAL mode: reading it needs write access to the file and to its directory, where SQLite keeps the -shm and -wal files)"
                    ))
                }
                Error::Unavailable(m) | Error::Database(m) => {
                    Error::Unavailable(format!("cannot read {path}: {m}"))
                }
                other => other,
            },
        }
    };
    let mut conn = SqliteConnection::connect_with(&options)
        .await
        .map_err(not_sqlite)?;
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .fetch_all(&mut conn)
            .await
            .map_err(not_sqlite)?;
    let _ = conn.close().await;
    if tables.is_empty() && !create {
        return Err(empty("the SQLite database holds no tables"));
    }
    // A store's tables come with the migrator's own, made before any of
    // them and written in each migration's transaction: tables without it
    // are another program's, even one named as the store's (`events`),
    // which the first migration would have failed on after making
    // `_sqlx_migrations` in the file.
    let migrated = tables.iter().any(|t| t == "_sqlx_migrations");
    let foreign: Vec<&str> = tables
        .iter()
        .map(String::as_str)
        .filter(|t| !t.starts_with("sqlite_"))
        .filter(|t| !migrated || !STORE_TABLES.contains(t))
        .collect();
    if foreign.is_empty() {
        return Ok(None);
    }
    let mut listed: Vec<&str> = foreign.iter().take(5).copied().collect();
    if foreign.len() > 5 {
        listed.push("…");
    }
    let left = match hot_journal {
        true => "SQLite rolled back the unfinished transaction it found in its -journal file, as any program opening it would, and changed nothing else",
        false => "it was left unchanged",
    };
    Err(Error::NotAStore(format!(
        "{path} is a SQLite database of something else (tables: {}), not a session store; {left}",
        listed.join(", ")
    )))
}

/// The file a SQLite `file:` URI names (SQLite's rules: an authority
/// that is empty or `localhost`, the path percent-decoded, up to its `?`
/// or `#`): `Some(None)` for one that names no file (`file::memory:`, an
/// empty name), `None` for one SQLite would refuse (another host, a bad
/// escape, a name that is not UTF-8 once decoded).
pub(super) fn uri_file(uri: &str) -> Option<Option<String>> {
    let rest = uri.strip_prefix("file:")?;
    let rest = rest.split(['?', '#']).next().unwrap_or("");
    let path = match rest.strip_prefix("//") {
        Some(authority_and_path) => {
            let (authority, path) = authority_and_path
                .split_once('/')
                .map_or((authority_and_path, ""), |(a, p)| (a, p));
            if !(authority.is_empty() || authority == "localhost") {
                return None;
            }
            format!("/{path}")
        }
        None => rest.to_owned(),
    };
    if path.is_empty() || path == ":memory:" {
        return Some(None);
    }
    let mut bytes = Vec::with_capacity(path.len());
    let mut raw = path.bytes();
    while let Some(b) = raw.next() {
        match b {
            b'%' => {
                let hex = [raw.next()?, raw.next()?];
                let hex = std::str::from_utf8(&hex).ok()?;
                bytes.push(u8::from_str_radix(hex, 16).ok()?);
            }
            b => bytes.push(b),
        }
    }
    let path = String::from_utf8(bytes).ok()?;
    Some((path != ":memory:").then_some(path))
}

/// Whether `journal` holds a transaction to roll back: a rollback journal
/// whose header still has SQLite's magic number (a committed one is
/// deleted, truncated or, with `journal_mode=persist`, has its header
/// zeroed).
fn is_hot_journal(journal: &str) -> bool {
    const MAGIC: [u8; 8] = [0xd9, 0xd5, 0x05, 0xf9, 0x20, 0xa1, 0x63, 0xd7];
    let mut header = [0u8; 8];
    std::fs::File::open(journal)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut header))
        .is_ok_and(|()| header == MAGIC)
}

/// The database's own words for a driver error.
pub(super) fn sqlx_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(d) => d.message().to_owned(),
        other => other.to_string(),
    }
}

/// Connections in the read pool: readers run beside the one writer (WAL).
pub(crate) const MAX_CONNECTIONS: u32 = 4;

/// The pool settings, shared by the store and the bench's raw-insert
/// ceiling. No ping before each acquire (sqlx's default): the database is
/// in this process, so a connection cannot go stale, and the ping cost a
/// hop to the connection's worker thread on every transaction.
pub(crate) fn pool_options() -> SqlitePoolOptions {
    SqlitePoolOptions::new()
        .max_connections(MAX_CONNECTIONS)
        .test_before_acquire(false)
        // No reaper task (see `postgres::pool_options`).
        .idle_timeout(None)
        .max_lifetime(None)
}

/// The connection settings of the module docs (WAL, `synchronous=FULL`, a
/// busy timeout, statement journals in memory); the bench opens its
/// raw-insert ceiling with the same ones. `temp_store=memory` keeps the
/// statement journal of a multi-row insert inside a transaction (which
/// SQLite writes so that a failing statement can be undone alone) off a
/// temporary file: measured, a batch of 100 events spilled it to disk on
/// every append. It holds nothing a crash needs: the WAL does.
/// `wal_autocheckpoint=4000` (SQLite's default is 1000 pages): a commit
/// rewrites the same right-hand leaves of the indexes and the view's page,
/// and a checkpoint copies each page once however many commits wrote it,
/// so checkpointing a quarter as often copies far fewer pages per event
/// (measured: 10–15 % more events/s at batches of 100, docs/benchmarks.md
/// item 16). The price is a WAL of up to about 16 MB between checkpoints.
pub(crate) fn connect_options(url: &str) -> Result<SqliteConnectOptions> {
    let path = path_of(url);
    // A NUL cannot be in a file name: SQLite would fail to open it, said
    // as a retryable I/O failure.
    if path.is_empty() || path.contains('\0') || is_in_memory(path) {
        return Err(Error::BadUrl(url.to_owned()));
    }
    Ok(SqliteConnectOptions::from_str(&format!("sqlite://{path}"))
        .map_err(|e| match e {
            // An option it does not know, or a value of one: said in the
            // driver's words (the URL holds no password), not as a URL of
            // no backend.
            sqlx::Error::Configuration(cause) => Error::UrlRefused {
                url: url.to_owned(),
                why: format!("{cause} (a SQLite URL's options are mode, cache, immutable and vfs)"),
            },
            _ => Error::BadUrl(url.to_owned()),
        })?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(10))
        .pragma("temp_store", "memory")
        .pragma("wal_autocheckpoint", "4000")
        .foreign_keys(true))
}

/// Whether `path` (a URL's, after its scheme) names an in-memory database:
/// `:memory:`, or `mode=memory` in its options or in a `file:` URI's. A
/// store there would acknowledge appends that end with the process (and
/// each pooled connection would see a database of its own), so it is
/// refused as a URL the store cannot use.
fn is_in_memory(path: &str) -> bool {
    let (name, query) = path.split_once('?').unwrap_or((path, ""));
    let name = name.strip_prefix("file:").unwrap_or(name);
    name == ":memory:"
        || query
            .split('&')
            .any(|o| o.eq_ignore_ascii_case("mode=memory") || o.eq_ignore_ascii_case("vfs=memdb"))
}

/// What SQLite opened is a file in WAL mode, as every store is: a URL
/// whose in-memory or temporary database the spelling hid from
/// [`is_in_memory`] (a percent-encoded `:memory:` or option, a `file:`
/// URI's, the `memdb` VFS, an empty `file:` name) has a main database
/// without a file, or one that cannot be in WAL mode, and is refused
/// before anything is written to it.
pub(super) async fn check_durable(conn: &mut SqliteConnection, url: &str) -> Result<()> {
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut *conn)
        .await
        .map_err(Error::from_sqlx)?;
    let file: Option<String> =
        sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
            .fetch_optional(&mut *conn)
            .await
            .map_err(Error::from_sqlx)?;
    match (mode.eq_ignore_ascii_case("wal"), file.is_some_and(|f| !f.is_empty())) {
        (true, true) => Ok(()),
        // A file, but not in WAL mode: an option of the URL (immutable,
        // a VFS without shared memory) kept SQLite from it. Said as that,
        // not as a URL of no backend (a review's finding).
        (false, true) => Err(Error::UrlRefused {
            url: url.to_owned(),
            why: format!(
                "SQLite opened the file without its write-ahead log (journal mode {mode}), which the store \
                 needs to keep appends durable while others read: leave out the immutable and vfs options"
            ),
        }),
        // In memory, or a temporary database: no file to keep appends in.
        (_, false) => Err(Error::BadUrl(url.to_owned())),
    }
}

/// Runs `open` (a pool or a connection), retrying for a few seconds while
/// the file is busy: turning a new file into WAL mode needs an exclusive
/// lock, and SQLite answers BUSY at once (without the busy handler) while
/// another process holds the file.
pub(super) async fn open_busy<T, F, Fut>(path: &str, mut open: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        match open().await {
            Ok(opened) => return Ok(opened),
            Err(e) if attempt < 50 && e.to_string().contains("database is locked") => {
                tracing::debug!(attempt, "SQLite file busy while opening; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => {
                return Err(Error::Unavailable(format!(
                    "cannot open SQLite database {path:?}: {e}"
                )))
            }
        }
    }
}
