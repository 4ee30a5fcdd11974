//! The SQLite backend: the embedded default, one file.
//!
//! Settings fit for a log: WAL (readers never block the writer), a busy
//! timeout (a second process waits for the write lock instead of failing),
//! `synchronous=FULL` (an acknowledged append survives a power loss, see
//! docs/design.md), and write transactions that take the write lock up front
//! with `BEGIN IMMEDIATE`, so a transaction never has to upgrade a read lock
//! and fail with SQLITE_BUSY half-way.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{
    Connection as _, Executor as _, QueryBuilder, Row as _, Sqlite, SqliteConnection, Transaction,
};
use uuid::Uuid;

use super::postgres::OptimisticMiss;
use super::{
    upsert_call, Accepted, CallRow, ChangeRow, LogTx, PendingRow, StoreOptions, ViewColumns,
    ViewRow,
};
use crate::error::{Error, Result};
use crate::event::{EventBody, StoredEvent};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/sqlite");

/// Whether a failed migration may have lost a race with another process
/// migrating the same file, and is worth another attempt: anything but a
/// failure of the storage itself. The loser of a race meets the winner's
/// lock, tables, columns or migration row, each said differently
/// ("duplicate column name: hash", "table … already exists", a UNIQUE
/// constraint, BUSY), so the failures of the storage are what is told
/// apart: I/O (10), a full disk (13), a read-only file (8), a file that
/// cannot be opened (14), memory (7), a damaged file (11, 26). Those are
/// said at once; another attempt would meet them again.
fn migration_raced(e: &sqlx::migrate::MigrateError) -> bool {
    use sqlx::migrate::MigrateError;
    let (MigrateError::Execute(inner) | MigrateError::ExecuteMigration(inner, _)) = e else {
        return false;
    };
    !matches!(
        crate::error::sqlite_primary_code(inner),
        Some(7 | 8 | 10 | 11 | 13 | 14 | 26)
    )
}

/// The latest migration this build knows: an open store's schema is at it.
pub(crate) fn latest_migration() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

mod open;

use open::*;
pub(crate) use open::{connect_options, file_is_missing, pool_options, MAX_CONNECTIONS};

/// Rows per INSERT statement: 7 parameters each, well under SQLite's limit.
const INSERT_CHUNK: usize = 500;

/// Writes of more rows than this are prepared for their one use, not kept
/// in the driver's statement cache. A statement's text depends on its
/// number of rows, and SQLite's prepared program of a multi-row insert
/// takes about 1.3 KB a row: each size of large batch seen kept megabytes
/// for as long as the connection (twelve appends of about 3 000 events,
/// each a size of its own, took a server from 22 to 62 MB, for good).
/// Below it, batches (and the import's runs of 500) keep their prepared
/// statements.
const CACHED_ROWS: usize = INSERT_CHUNK;

/// Rows an optimistic transaction sends ahead at a time, while the
/// judgement goes on (docs/design.md, "Rows sent ahead").
const AHEAD_ROWS: usize = 16;

/// The payload comes as bytes: a TEXT value that is not UTF-8 (an edit
/// around the store; SQLite does not check) is then said as that row's,
/// with its position, not as the driver's failure to decode a column.
type Row = (i64, String, i64, String, Vec<u8>, String);

/// A [`Row`] with its chain hash and its `type` column (`chained_page`).
type TypedRow = (
    i64,
    String,
    i64,
    String,
    Vec<u8>,
    String,
    Option<String>,
    String,
);

/// A [`Row`] with its chain hash (seq optional) and whether it is the head row
/// (`judge_reads`).
type JudgeRow = (
    i64,
    String,
    Option<i64>,
    String,
    Vec<u8>,
    String,
    Option<String>,
    i64,
);

const COLUMNS: &str = "position, session_id, seq, event_id, payload, recorded_at";

/// A read pool and one writer connection on one file.
///
/// SQLite admits one writer at a time, so this process writes through one
/// connection, held here rather than in a pool, for three measured reasons
/// (docs/benchmarks.md, "What changed"):
///
/// - each SQLite connection has its own page cache, dropped at the start of
///   a transaction when another connection wrote since; sqlx hands pooled
///   connections out in turn, so appends alternated between connections
///   and each started with a cold cache;
/// - a pooled connection is returned through a spawned task that pings it
///   first, so the next append waited for a ping and a task switch;
/// - a transaction of our own can send its `BEGIN IMMEDIATE` with its first
///   read and its writes with its `COMMIT` ([`SqliteTx`]): two hops to the
///   driver's worker thread per append instead of four.
///
/// In-process writers queue on the writer's mutex (the group commit makes
/// that rare) instead of in SQLite's busy handler, which sleeps.
#[derive(Clone)]
pub(crate) struct SqliteBackend {
    /// Reads: the view, pages of events, audit queries; and migrations.
    pool: SqlitePool,
    /// Writes: one connection and whether a transaction is open on it.
    writer: Arc<tokio::sync::Mutex<Writer>>,
    /// How to (re)open the writer connection.
    connect: Arc<SqliteConnectOptions>,
    path: Arc<str>,
    /// The file opened (`None` in memory); the writer keeps a copy.
    file: Option<StoreFile>,
}

/// The writer connection. `in_tx`: a `BEGIN` was sent (or is being sent)
/// and neither its `COMMIT` nor a `ROLLBACK` has completed; whoever holds
/// the writer next rolls such a transaction back first.
pub(crate) struct Writer {
    conn: Option<SqliteConnection>,
    in_tx: bool,
    closed: bool,
    /// The store's file as opened (`None` in memory): a commit checks that
    /// the path still names it.
    file: Option<StoreFile>,
    /// The largest position when this writer last committed (`None` when
    /// not known): if the log still ends there, nobody else wrote since,
    /// and an optimistic group may judge against the state cache.
    last_committed: Option<i64>,
    /// Whether this connection has the optimistic check's temporary table.
    has_check: bool,
    /// Whether the log ended where this writer's last commit left it when
    /// its last group looked (its read-ahead), and no optimistic check has
    /// failed since: while another process writes between this one's
    /// groups, each optimistic attempt would be judged twice and fail its
    /// check, so groups go to the lock until the log is quiet again.
    quiet: bool,
}

/// The file a store opened, by device and inode: if it is removed or
/// replaced under a running store, a connection still open on the old
/// inode would acknowledge appends that no later open can see. A commit
/// and the readiness probe check that the path still names this file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoreFile {
    path: std::path::PathBuf,
    id: (u64, u64),
}

impl StoreFile {
    fn of(path: &std::path::Path) -> Option<StoreFile> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok()?;
        Some(StoreFile {
            path: path.to_owned(),
            id: (meta.dev(), meta.ino()),
        })
    }

    /// An error unless the path still names the file the store opened.
    pub(crate) fn check(&self) -> Result<()> {
        match StoreFile::of(&self.path) {
            Some(now) if now.id == self.id => Ok(()),
            Some(_) => Err(Error::Unavailable(format!(
                "the store's file {} was replaced by another file while the store was open; nothing more is written to it until the store is opened again",
                self.path.display()
            ))),
            None => Err(Error::Unavailable(format!(
                "the store's file {} was removed while the store was open; nothing more is written until it is back and the store is opened again",
                self.path.display()
            ))),
        }
    }
}

impl Writer {
    fn conn(&mut self) -> Result<&mut SqliteConnection> {
        self.conn
            .as_mut()
            .ok_or_else(|| Error::Unavailable("the SQLite writer connection is closed".to_owned()))
    }

    /// Opens a write transaction unless one is open. Marked first: if
    /// this is cancelled half-way, the rollback still runs (one with
    /// nothing to undo is harmless).
    async fn begin(&mut self) -> Result<()> {
        if !self.in_tx {
            self.in_tx = true;
            self.conn()?
                .execute("BEGIN IMMEDIATE")
                .await
                .map_err(Error::from_sqlx)?;
        }
        Ok(())
    }

    /// Ends an open transaction without its writes. A connection whose
    /// rollback fails for another reason than "no transaction is active"
    /// (the `COMMIT` went through, or the transaction was already undone)
    /// is dropped and reopened by the next writer, so that no half-known
    /// state is ever written on.
    async fn rollback(&mut self) {
        if !self.in_tx {
            return;
        }
        if let Some(conn) = self.conn.as_mut() {
            if let Err(e) = conn.execute("ROLLBACK").await {
                if !e.to_string().contains("no transaction is active") {
                    tracing::warn!(cause = %e, "rolling back on the SQLite writer failed; reopening it");
                    self.conn = None;
                    self.has_check = false;
                }
            }
        }
        self.in_tx = false;
    }
}

/// The migration a SQLite store is at ([`super::migrated_through`]; 0: no
/// table).
async fn applied_version(
    conn: &mut SqliteConnection,
) -> std::result::Result<i64, sqlx::migrate::MigrateError> {
    let table: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_one(&mut *conn)
    .await?;
    if table == 0 {
        return Ok(0);
    }
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
            .fetch_all(&mut *conn)
            .await?;
    Ok(super::migrated_through(&MIGRATOR, &applied))
}

fn decode(row: Row) -> Result<StoredEvent> {
    let (position, session_id, seq, event_id, payload, recorded_at) = row;
    let corrupt = |what: &str| Error::Corrupt(format!("event at position {position}: {what}"));
    Ok(StoredEvent {
        session_id: Uuid::parse_str(&session_id).map_err(|_| corrupt("bad session_id"))?,
        seq,
        event_id: Uuid::parse_str(&event_id).map_err(|_| corrupt("bad event_id"))?,
        position,
        recorded_at: DateTime::parse_from_rfc3339(&recorded_at)
            .map_err(|_| corrupt("bad recorded_at"))?
            .with_timezone(&Utc),
        body: match String::from_utf8(payload) {
            Ok(text) => EventBody::from_json_text(&text).map_err(|e| corrupt(&e.to_string()))?,
            Err(e) => {
                let at = e.utf8_error().valid_up_to();
                return Err(corrupt(&format!(
                    "its payload is not UTF-8 text (byte {at} is not)"
                )));
            }
        },
    })
}

impl SqliteBackend {
    pub(crate) async fn connect(url: &str, options: &StoreOptions) -> Result<SqliteBackend> {
        let path = path_of(url);
        if path.is_empty() {
            return Err(Error::BadUrl(url.to_owned()));
        }
        let creates = check_file(url, options.create_if_missing).await?;
        let connect = connect_options(url)?;
        let timeout = Duration::from_secs(
            options
                .connect_timeout_secs
                .clamp(1, super::MAX_CONNECT_SECS)
                + 10,
        );
        let mut writer = open_busy(path, || SqliteConnection::connect_with(&connect)).await?;
        if let Err(refused) = check_durable(&mut writer, url).await {
            // A file this open made for a database it then refused (a VFS
            // without WAL, say) is not left behind, while still empty.
            let _ = writer.close().await;
            if let Some(made) = creates {
                if std::fs::metadata(&made).is_ok_and(|m| m.len() == 0) {
                    let _ = std::fs::remove_file(&made);
                }
            }
            return Err(refused);
        }
        // The file exists now. Every later connection (the pool's, a
        // reopened writer) opens it or fails: one that made a new empty
        // file after the store's was removed would take writes no one
        // reads.
        let file = StoreFile::of(connect.get_filename());
        let connect = connect.create_if_missing(false);
        let pool = open_busy(path, || {
            pool_options()
                .acquire_timeout(timeout)
                .connect_with(connect.clone())
        })
        .await?;
        Ok(SqliteBackend {
            pool,
            writer: Arc::new(tokio::sync::Mutex::new(Writer {
                conn: Some(writer),
                in_tx: false,
                closed: false,
                file: file.clone(),
                last_committed: None,
                has_check: false,
                quiet: false,
            })),
            connect: Arc::new(connect),
            path: path.into(),
            file,
        })
    }

    /// Runs the migrations. sqlx takes no lock for SQLite migrations, so two
    /// processes opening a new file at once can race: the loser's migration
    /// fails (its transaction rolls back) while the winner's commits. A retry
    /// then finds the migrations applied.
    ///
    /// Each attempt runs on a connection of its own, closed after it, so
    /// that nothing a failed attempt left behind outlives it; and only a
    /// race is tried again. Before, attempts ran on the pool and any error
    /// was retried: on a disk that filled during a migration, a later
    /// attempt "succeeded" inside a transaction never committed, and the
    /// command failed on a missing table ("no such table: chain_backfill"),
    /// or every later statement on "database is locked" after 10 s, where
    /// the cause was the disk (a review, 2026-12-07, on a full tmpfs).
    /// Applies what is pending; returns the migration the store was at
    /// before (0: no store yet).
    pub(crate) async fn migrate(&self) -> Result<i64> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let connect = &*self.connect;
            let mut conn =
                open_busy(&self.path, || SqliteConnection::connect_with(connect)).await?;
            let from = applied_version(&mut conn).await;
            // `run_direct`: what `run` calls once it has a connection (its
            // `Acquire` bound makes this future not `Send`, as postgres.rs
            // says; sqlx is pinned by Cargo.lock).
            let run = match from {
                Ok(from) => MIGRATOR.run_direct(&mut conn).await.map(|()| from),
                Err(e) => Err(e),
            };
            // Closed, not returned anywhere: SQLite rolls back what it
            // held open.
            let _ = conn.close().await;
            match run {
                Ok(from) => return Ok(from),
                Err(e) if attempt < 5 && migration_raced(&e) => {
                    tracing::debug!(cause = %e, attempt, "SQLite migration raced; retrying");
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                Err(e) => return Err(Error::from_migration("SQLite", e)),
            }
        }
    }

    /// An error if the path no longer names the file this store opened.
    pub(crate) async fn check_file_identity(&self) -> Result<()> {
        match &self.file {
            Some(file) => file.check(),
            None => Ok(()),
        }
    }

    /// The writer, for one write transaction; its `BEGIN IMMEDIATE` goes
    /// with the transaction's first statement.
    pub(crate) async fn begin_write(&self) -> Result<SqliteTx> {
        let mut w = self.writer.clone().lock_owned().await;
        if w.closed {
            return Err(Error::Unavailable("the store is closed".to_owned()));
        }
        // Left open by a transaction dropped where no task could roll it
        // back (outside a runtime).
        w.rollback().await;
        if w.conn.is_none() {
            let connect = &*self.connect;
            w.conn = Some(open_busy(&self.path, || SqliteConnection::connect_with(connect)).await?);
            w.has_check = false;
        }
        Ok(SqliteTx::new(TxConn::Write(w)))
    }

    /// The writer, for an optimistic group (docs/design.md, "Optimistic
    /// appends"): nothing is sent until [`OptimisticTx::commit_optimistic`](super::group::OptimisticTx::commit_optimistic)
    /// (or rows sent ahead, [`LogTx::send_ahead`]),
    /// and reads are answered from what [`OptimisticTx::assume`](super::group::OptimisticTx::assume) was given.
    /// `None` when this writer does not know where the log ended at its
    /// last commit (then the group is judged under the lock).
    pub(crate) async fn begin_optimistic(&self) -> Result<Option<SqliteTx>> {
        let mut tx = self.begin_write().await?;
        let TxConn::Write(w) = &tx.conn else {
            return Ok(None);
        };
        let (Some(last), true) = (w.last_committed, w.quiet) else {
            return Ok(None);
        };
        tx.optimistic = true;
        tx.last_position = Some(last);
        Ok(Some(tx))
    }

    /// A read transaction: one snapshot for the view, window and tail.
    pub(crate) async fn begin_read(&self) -> Result<SqliteTx> {
        let tx = self.pool.begin().await.map_err(Error::from_sqlx)?;
        Ok(SqliteTx::new(TxConn::Read(tx)))
    }

    pub(crate) async fn head_seq(&self, session_id: Uuid) -> Result<i64> {
        head_seq(&self.pool, session_id).await
    }

    /// The seq of one event of the session, if the log has it.
    pub(crate) async fn seq_of(&self, session_id: Uuid, event_id: Uuid) -> Result<Option<i64>> {
        sqlx::query_scalar("SELECT seq FROM events WHERE event_id = ?1 AND session_id = ?2")
            .bind(event_id.to_string())
            .bind(session_id.to_string())
            .fetch_optional(&self.pool)
            .await
            .map_err(Error::from_sqlx)
    }

    /// Up to `limit` of the session's events after seq `after`, stopping
    /// after the one that brings the payloads read to `max_bytes` (at least
    /// one event when there is one): rows are decoded one at a time, so a
    /// page of large events never sits in memory whole.
    pub(crate) async fn page(
        &self,
        session_id: Uuid,
        after: i64,
        limit: i64,
        max_bytes: usize,
    ) -> Result<Vec<StoredEvent>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM events WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT ?"
        );
        let mut rows = sqlx::query_as::<_, Row>(&sql)
            .bind(session_id.to_string())
            .bind(after)
            .bind(limit)
            .fetch(&self.pool);
        super::take_within(&mut rows, max_bytes, |r: &Row| r.4.len(), decode).await
    }

    /// The session's view and the events from its window's start on (at
    /// most the window and `after` more), in one statement: the cold
    /// pre-request read, one hop to the driver's worker instead of two.
    /// A window longer than `max_window` is left out: only the (at most
    /// `after`) events after the view come. `None` when the session has
    /// no view.
    pub(crate) async fn view_and_window(
        &self,
        session_id: Uuid,
        after: i64,
        mut read: super::WindowRead,
    ) -> Result<super::WindowRead> {
        use tokio_stream::StreamExt;
        let mut rows = sqlx::query(VIEW_AND_WINDOW)
            .bind(session_id.to_string())
            .bind(after)
            .bind(read.max_window())
            .fetch(&self.pool);
        let mut events = Vec::new();
        while let Some(row) = rows.next().await {
            let row = row.map_err(Error::from_sqlx)?;
            let kind: i64 = row.try_get(0).map_err(corrupt_row)?;
            if kind == 0 {
                read.view = Some(ViewRow::from_columns(session_id, view_at(&row, 1)?));
                continue;
            }
            let seq: i64 = row.try_get(3).map_err(corrupt_row)?;
            let len = row.try_get::<&str, _>(5).map_err(corrupt_row)?.len();
            events.push(row);
            if !read.admit(seq, len) {
                break;
            }
        }
        drop(rows);
        read.events = events.iter().map(event_at).collect::<Result<_>>()?;
        Ok(read)
    }

    /// The latest position (0 for an empty log): what the subscribers'
    /// shared poll compares (`subscribe`).
    pub(crate) async fn last_position(&self) -> Result<i64> {
        sqlx::query_scalar("SELECT COALESCE(MAX(position), 0) FROM events")
            .fetch_one(&self.pool)
            .await
            .map_err(Error::from_sqlx)
    }

    /// [`crate::Store::tenants`]: each tenant with its number of sessions.
    pub(crate) async fn tenants(&self) -> Result<Vec<(String, i64)>> {
        sqlx::query_as(super::TENANTS_SQL)
            .bind(super::DEFAULT_TENANT)
            .fetch_all(&self.pool)
            .await
            .map_err(Error::from_sqlx)
    }

    /// The sessions of the events at positions after `after` up to
    /// `upto` (the subscription source's wake-ups name them).
    pub(crate) async fn sessions_between(&self, after: i64, upto: i64) -> Result<Vec<Uuid>> {
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT session_id FROM events WHERE position > ? AND position <= ?",
        )
        .bind(after)
        .bind(upto)
        .fetch_all(&self.pool)
        .await
        .map_err(Error::from_sqlx)?;
        ids.iter()
            .map(|s| {
                Uuid::parse_str(s).map_err(|_| Error::Corrupt(format!("bad session_id {s:?}")))
            })
            .collect()
    }

    /// Up to `limit` events of every session after `position`, stopping
    /// after the one that brings the payloads read to `max_bytes`.
    pub(crate) async fn feed(
        &self,
        after: i64,
        limit: i64,
        max_bytes: usize,
    ) -> Result<Vec<StoredEvent>> {
        let sql =
            format!("SELECT {COLUMNS} FROM events WHERE position > ? ORDER BY position LIMIT ?");
        let mut rows = sqlx::query_as::<_, Row>(&sql)
            .bind(after)
            .bind(limit)
            .fetch(&self.pool);
        super::take_within(&mut rows, max_bytes, |r: &Row| r.4.len(), decode).await
    }

    /// Runs an audit query that selects event rows (src/store/query.rs),
    /// decoding rows until their payloads reach `max_bytes` (true: the
    /// bytes stopped it).
    pub(crate) async fn fetch_events(
        &self,
        mut q: QueryBuilder<'static, Sqlite>,
        max_bytes: usize,
    ) -> Result<(Vec<StoredEvent>, bool)> {
        let mut rows = q.build_query_as::<Row>().fetch(&self.pool);
        super::take_within_cut(&mut rows, max_bytes, |r: &Row| r.4.len(), decode).await
    }

    /// Runs an audit query that selects `activation_changes` rows.
    pub(crate) async fn fetch_changes(
        &self,
        mut q: QueryBuilder<'static, Sqlite>,
    ) -> Result<Vec<ChangeRow>> {
        let rows: Vec<SqliteChange> = q
            .build_query_as()
            .fetch_all(&self.pool)
            .await
            .map_err(Error::from_sqlx)?;
        rows.into_iter().map(decode_change).collect()
    }

    /// The `EXPLAIN QUERY PLAN` rows of a query, one line each.
    pub(crate) async fn fetch_plan(
        &self,
        mut q: QueryBuilder<'static, Sqlite>,
    ) -> Result<Vec<String>> {
        let rows: Vec<(i64, i64, i64, String)> = q
            .build_query_as()
            .fetch_all(&self.pool)
            .await
            .map_err(Error::from_sqlx)?;
        Ok(rows.into_iter().map(|r| r.3).collect())
    }

    /// Runs an audit query that selects session ids.
    pub(crate) async fn fetch_sessions(
        &self,
        mut q: QueryBuilder<'static, Sqlite>,
    ) -> Result<Vec<Uuid>> {
        let rows: Vec<(String,)> = q
            .build_query_as()
            .fetch_all(&self.pool)
            .await
            .map_err(Error::from_sqlx)?;
        rows.into_iter()
            .map(|(s,)| {
                Uuid::parse_str(&s)
                    .map_err(|_| Error::Corrupt(format!("the log holds a bad session id {s:?}")))
            })
            .collect()
    }

    pub(crate) async fn close(&self) {
        let mut w = self.writer.lock().await;
        w.rollback().await;
        w.closed = true;
        if let Some(conn) = w.conn.take() {
            if let Err(e) = conn.close().await {
                tracing::debug!(cause = %e, "closing the SQLite writer connection failed");
            }
        }
        drop(w);
        self.pool.close().await;
    }
}

async fn head_seq<'e, E: sqlx::SqliteExecutor<'e>>(ex: E, session_id: Uuid) -> Result<i64> {
    let (seq,): (i64,) =
        sqlx::query_as("SELECT COALESCE(MAX(seq), 0) FROM events WHERE session_id = ?")
            .bind(session_id.to_string())
            .fetch_one(ex)
            .await
            .map_err(Error::from_sqlx)?;
    Ok(seq)
}

/// A transaction (a write transaction holds SQLite's write lock) and what
/// it knows without asking: under the write lock nothing changes but what
/// this transaction writes.
///
/// A write transaction is ours, not sqlx's, to save hops to the driver's
/// worker thread: its `BEGIN IMMEDIATE` is sent with its first statement
/// (the group's read-ahead, in one query of two statements), and the
/// writes of accepted batches wait in `pending` until the next statement or
/// the `COMMIT`, which they go with. Every statement goes through
/// [`SqliteTx::conn`], which sends what waits first, so a read always sees
/// this transaction's writes. Dropped without a commit, it rolls back (in
/// a task of its own, holding the writer until done).
pub(crate) struct SqliteTx {
    conn: TxConn,
    /// Writes of accepted batches not sent yet.
    pending: Pending,
    /// The largest position, once read ([`LogTx::head`], `prefetch`) and
    /// kept current by this transaction's inserts, so reserving positions
    /// needs no statement of its own.
    last_position: Option<i64>,
    /// What `prefetch` read for a group.
    memo: Memo,
    /// An optimistic group's transaction: no statement is sent before its
    /// commit, which checks what the judgement assumed, but for rows sent
    /// ahead ([`LogTx::send_ahead`]), behind the check of the heads.
    optimistic: bool,
    /// Calls index keys the optimistic judgement took as absent (the
    /// cache forgets most calls before a window), checked by the commit.
    absent_calls: Vec<(Uuid, String)>,
    /// The sessions an optimistic judgement assumed, with their heads,
    /// checked by the commit.
    assumed: Vec<(Uuid, i64)>,
    /// Whether rows were sent ahead ([`LogTx::send_ahead`]): the `BEGIN
    /// IMMEDIATE` and the check of the position and heads went first.
    opened_ahead: bool,
    /// How many leading rows of the batch being judged were sent ahead
    /// (its `write_accepted` queues only the others).
    batch_sent: usize,
    /// Why rows sent ahead were not written, when the storage failed
    /// (not a check): said to the group's callers.
    ahead_failure: Option<Error>,
    /// How many times rows were sent ahead (tried).
    sends_ahead: u64,
}

/// The writes of a write transaction's accepted batches that wait for its
/// next statement or its `COMMIT`, kept by table rather than as statements.
///
/// A group commits the appends waiting meanwhile together. Written as each
/// batch's own statements, the query's text would depend on the group's
/// mix (how many batches, which of them had calls, a view, changes, a new
/// owner): nearly every group's text would be new, and the driver prepares
/// a new text again, every statement of it. Kept by table, the writes go as
/// one `INSERT` of the events rows (its text depends on their number only)
/// and four statements of fixed text reading a JSON array each, so the
/// driver's statement cache finds a group's query prepared.
#[derive(Default)]
struct Pending {
    rows: Vec<PendingRow>,
    /// `[session_id, call_id, tool_name, call_seq, result_seq]`, in order:
    /// a later row for a call updates its result seq (the upsert).
    calls: Vec<serde_json::Value>,
    /// The latest view of each session, in the order first written.
    views: Vec<ViewRow>,
    /// `[position, tool, session_id, seq, recorded_at, change, evidence_seq]`.
    changes: Vec<serde_json::Value>,
    /// `[session_id, tenant]`.
    claims: Vec<serde_json::Value>,
}

/// The fixed statements of [`Pending::query`] after the events rows, each
/// binding one JSON array.
const PENDING_DERIVED: &str = "\
INSERT INTO calls (session_id, call_id, tool_name, call_seq, result_seq) \
  SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4 FROM json_each(?) WHERE true \
  ON CONFLICT (session_id, call_id) DO UPDATE SET result_seq = excluded.result_seq;
INSERT OR REPLACE INTO session_views \
  (session_id, refresh_seq, mode, window_start, compaction_seq, summary, catalogs, evidence, active) \
  SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, value ->> 5, value ->> 6, \
    value ->> 7, value ->> 8 FROM json_each(?);
INSERT INTO activation_changes (position, tool, session_id, seq, recorded_at, change, evidence_seq) \
  SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, value ->> 5, value ->> 6 \
  FROM json_each(?);
INSERT INTO session_owners (session_id, tenant) SELECT value ->> 0, value ->> 1 FROM json_each(?);
";

impl Pending {
    fn is_empty(&self) -> bool {
        self.rows.is_empty()
            && self.calls.is_empty()
            && self.views.is_empty()
            && self.changes.is_empty()
            && self.claims.is_empty()
    }

    /// Takes an accepted batch's writes, but for its first `sent` rows
    /// (sent ahead).
    fn add(&mut self, w: &Accepted<'_>, sent: usize) {
        let session = w.session_id.to_string();
        self.rows
            .extend_from_slice(w.rows.get(sent..).unwrap_or_default());
        self.calls.extend(
            w.calls
                .iter()
                .map(|c| serde_json::json!([session, c.0, c.1, c.2, c.3])),
        );
        if let Some(v) = w.view {
            match self.views.iter_mut().find(|p| p.session_id == v.session_id) {
                Some(p) => *p = v.clone(),
                None => self.views.push(v.clone()),
            }
        }
        self.changes.extend(w.changes.iter().map(|c| {
            serde_json::json!([
                c.position,
                c.tool,
                session,
                c.seq,
                sqlite_time(&c.recorded_at),
                c.change,
                c.evidence_seq
            ])
        }));
        if let Some(tenant) = w.claim_for {
            self.claims.push(serde_json::json!([session, tenant]));
        }
    }

    /// The statements writing all of it, in one query of several statements
    /// (the driver binds the `?`s in order across them and runs them all,
    /// for one hop to its worker thread).
    fn query(self) -> QueryBuilder<'static, Sqlite> {
        let mut q = QueryBuilder::<Sqlite>::new("");
        self.push_to(&mut q);
        q
    }

    /// [`Pending::query`]'s statements, after what `q` holds.
    fn push_to(self, q: &mut QueryBuilder<'static, Sqlite>) {
        push_rows(q, self.rows);
        let views: Vec<serde_json::Value> = self
            .views
            .into_iter()
            .map(|v| {
                serde_json::json!([
                    v.session_id.to_string(),
                    v.refresh_seq,
                    v.mode,
                    v.window_start,
                    v.compaction_seq,
                    v.summary,
                    v.catalogs,
                    v.evidence,
                    v.active
                ])
            })
            .collect();
        let mut args = [self.calls, views, self.changes, self.claims]
            .into_iter()
            .map(|rows| serde_json::Value::Array(rows).to_string());
        let mut parts = PENDING_DERIVED.split('?');
        if let Some(first) = parts.next() {
            q.push(first);
        }
        for part in parts {
            q.push_bind(args.next().unwrap_or_else(|| "[]".to_owned()));
            q.push(part);
        }
    }
}

/// `INSERT`s of `rows` into `events`, after what `q` holds.
fn push_rows(q: &mut QueryBuilder<'static, Sqlite>, rows: impl IntoIterator<Item = PendingRow>) {
    let mut rows = rows.into_iter().peekable();
    while rows.peek().is_some() {
        q.push(
            "INSERT INTO events (position, session_id, seq, event_id, type, payload, recorded_at, hash) ",
        );
        q.push_values(rows.by_ref().take(INSERT_CHUNK), |mut b, r| {
            b.push_bind(r.position)
                .push_bind(r.session_id.to_string())
                .push_bind(r.seq)
                .push_bind(r.event_id.to_string())
                .push_bind(r.type_name)
                .push_bind(r.payload)
                .push_bind(sqlite_time(&r.recorded_at))
                .push_bind(r.hash);
        });
        q.push(";\n");
    }
}

enum TxConn {
    Read(Transaction<'static, Sqlite>),
    Write(tokio::sync::OwnedMutexGuard<Writer>),
    /// Committed (or being committed).
    Done,
}

impl Drop for SqliteTx {
    fn drop(&mut self) {
        if let TxConn::Write(mut w) = std::mem::replace(&mut self.conn, TxConn::Done) {
            if w.in_tx {
                // Without a runtime, the next `begin_write` rolls back.
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move { w.rollback().await });
                }
            }
        }
    }
}

/// What `prefetch` read ahead for a group commit, served to the group's
/// judgements instead of a statement each (each statement is a hop to the
/// driver's worker thread). An accepted batch's writes are applied to its
/// session's part (head, view, calls), so that the next append of the group
/// to the same session is served too; any other write to a session drops
/// its part. An event id this transaction wrote is never answered from it.
#[derive(Default)]
struct Memo {
    /// Per session: its head seq and hash, its view, and the calls index
    /// rows of the call ids asked for.
    sessions: HashMap<Uuid, SessionMemo>,
    /// The event ids asked for.
    ids: HashSet<Uuid>,
    /// The stored events among them.
    stored: HashMap<Uuid, StoredEvent>,
    /// Event ids this transaction wrote.
    written: HashSet<Uuid>,
    /// Owners the state cache knew (an optimistic group's).
    owners: HashMap<Uuid, String>,
}

struct SessionMemo {
    head: i64,
    hash: Option<String>,
    /// The stored view, once read or written here (`Some(None)`: none is
    /// stored); `None` while not read (a session whose view the process's
    /// cache knew was not asked for).
    view: Option<Option<ViewRow>>,
    /// The call ids asked for (or written here).
    asked_calls: HashSet<String>,
    /// The calls index rows among them, by call id.
    calls: HashMap<String, CallRow>,
}

/// The prefetch, one statement of rows of three kinds, told apart by the
/// first column (SQLite's columns take any type): 0 one row of the largest
/// position, the sessions' heads (`[session, seq, hash]`) and the calls
/// index rows asked for (`[session, call id, tool, call seq, result seq]`),
/// both as JSON arrays; 1 a stored event with one of the ids; 2 a session's
/// view. The lists come as JSON arrays, so the statement's text never
/// changes and stays prepared. The heads and calls come as one row
/// because the driver hands each row to the caller's task on its own, a
/// thread's wake-up each (a group of 16 appends read ~40 rows).
/// [`SqliteBackend::view_and_window`]: the view row (kind 0), then the
/// events from the view's window start on, at most the window and `?2`
/// more (kind 1); one snapshot, as any single statement. (SQLite refuses
/// a `NULL` limit: without a view, the limit is 0.)
const VIEW_AND_WINDOW: &str = "\
SELECT 0, refresh_seq, mode, window_start, compaction_seq, summary, catalogs, evidence, active \
  FROM session_views WHERE session_id = ?1 \
UNION ALL SELECT * FROM (\
  SELECT 1, session_id, position, seq, event_id, payload, recorded_at, NULL, NULL FROM events \
  WHERE session_id = ?1 \
    AND seq >= (SELECT CASE WHEN refresh_seq - window_start + 1 > ?3 THEN refresh_seq + 1 \
                            ELSE window_start END \
                  FROM session_views WHERE session_id = ?1) \
  ORDER BY seq \
  LIMIT COALESCE((SELECT CASE WHEN refresh_seq - window_start + 1 > ?3 THEN ?2 \
                              ELSE MAX(0, refresh_seq - window_start + 1 + ?2) END \
                   FROM session_views WHERE session_id = ?1), 0))";

macro_rules! prefetch_sql {
    () => {
        "\
SELECT 0, NULL, (SELECT COALESCE(MAX(position), 0) FROM events), \
    (SELECT json_group_array(json_array(s.value, \
        (SELECT seq FROM events WHERE session_id = s.value ORDER BY seq DESC LIMIT 1), \
        (SELECT hash FROM events WHERE session_id = s.value ORDER BY seq DESC LIMIT 1))) \
      FROM json_each(?1) s), \
    (SELECT json_group_array(json_array(c.session_id, c.call_id, c.tool_name, c.call_seq, c.result_seq)) \
      FROM json_each(?3) j JOIN calls c \
        ON c.session_id = json_extract(j.value, '$[0]') AND c.call_id = json_extract(j.value, '$[1]')), \
    NULL, NULL, NULL, NULL, NULL \
UNION ALL SELECT 1, session_id, position, seq, event_id, payload, recorded_at, hash, NULL, NULL \
  FROM events WHERE event_id IN (SELECT value FROM json_each(?2)) \
UNION ALL SELECT 2, session_id, refresh_seq, mode, window_start, compaction_seq, summary, catalogs, evidence, active \
  FROM session_views WHERE session_id IN (SELECT value FROM json_each(?4))"
    };
}
const PREFETCH: &str = prefetch_sql!();
/// [`PREFETCH`] opening the write transaction, in one hop.
const BEGIN_PREFETCH: &str = concat!("BEGIN IMMEDIATE;\n", prefetch_sql!());

impl SqliteTx {
    fn new(conn: TxConn) -> SqliteTx {
        SqliteTx {
            conn,
            pending: Pending::default(),
            last_position: None,
            memo: Memo::default(),
            optimistic: false,
            absent_calls: Vec::new(),
            assumed: Vec::new(),
            opened_ahead: false,
            batch_sent: 0,
            ahead_failure: None,
            sends_ahead: 0,
        }
    }

    /// The connection, ready for a statement of this transaction: on the
    /// writer, the `BEGIN IMMEDIATE` and the pending writes sent first.
    async fn conn(&mut self) -> Result<&mut SqliteConnection> {
        if self.optimistic {
            return Err(optimistic_miss());
        }
        match &mut self.conn {
            TxConn::Read(tx) => Ok(&mut **tx),
            TxConn::Write(w) => {
                w.begin().await?;
                if !self.pending.is_empty() {
                    let pending = std::mem::take(&mut self.pending);
                    let persistent = pending.rows.len() <= CACHED_ROWS;
                    pending
                        .query()
                        .build()
                        .persistent(persistent)
                        .execute(w.conn()?)
                        .await
                        .map_err(Error::from_sqlx)?;
                }
                w.conn()
            }
            TxConn::Done => Err(Error::Database(
                "a statement was sent on a finished transaction".to_owned(),
            )),
        }
    }

    /// This transaction wrote to `session_id`: the memo no longer knows it.
    fn wrote(&mut self, session_id: Uuid) {
        self.memo.sessions.remove(&session_id);
    }

    /// This transaction wrote an accepted batch: its session's part of the
    /// memo becomes what the database now holds.
    fn accepted(&mut self, w: &Accepted<'_>) {
        if let Some(m) = self.memo.sessions.get_mut(&w.session_id) {
            if let Some(last) = w.rows.last() {
                (m.head, m.hash) = (last.seq, Some(last.hash.clone()));
            }
            if let Some(view) = w.view {
                m.view = Some(Some(view.clone()));
            }
            for call in w.calls {
                m.asked_calls.insert(call.0.clone());
                upsert_call(&mut m.calls, call.0.clone(), call);
            }
        }
        self.took(w.rows);
    }

    /// This transaction inserted `rows` outside an accepted batch: their
    /// sessions' parts of the memo are dropped.
    fn inserted(&mut self, rows: &[PendingRow]) {
        for r in rows {
            self.memo.sessions.remove(&r.session_id);
        }
        self.took(rows);
    }

    /// What any insert of `rows` (in position order) tells the memo: their
    /// ids are written here, and the largest position moved on.
    fn took(&mut self, rows: &[PendingRow]) {
        self.memo.written.extend(rows.iter().map(|r| r.event_id));
        if let Some(last) = rows.last() {
            self.last_position = Some(self.last_position.unwrap_or(0).max(last.position));
        }
    }
}

/// A row of the queries that return rows of several kinds (`PREFETCH`,
/// `VIEW_AND_WINDOW`) whose columns are not what its kind says.
fn corrupt_row(e: sqlx::Error) -> Error {
    Error::Corrupt(format!("a row read ahead could not be read: {e}"))
}

/// The error of a read an optimistic transaction cannot answer; never seen
/// by a caller (the group is judged again under the lock).
fn optimistic_miss() -> Error {
    Error::Database("an optimistic append needed a read the cache cannot answer".to_owned())
}

/// The optimistic check's temporary table, created once per writer
/// connection: a row whose `ok` is not 1 raises, any other is dropped.
const CHECK_SETUP: &str = "\
CREATE TEMP TABLE IF NOT EXISTS optimistic_check (ok INTEGER);
CREATE TEMP TRIGGER IF NOT EXISTS optimistic_check_row BEFORE INSERT ON optimistic_check BEGIN \
  SELECT CASE WHEN NEW.ok IS 1 THEN RAISE(IGNORE) \
    ELSE RAISE(ABORT, 'the log moved since the optimistic append was judged') END; \
END;
";

/// What an optimistic transaction checks under the write lock, as a
/// condition of the check's `INSERT`: the log still ends at the position
/// the judgement assumed (nobody else wrote since this writer's last
/// commit, so the positions it reserved are free), and each session's
/// head is still the seq it was judged against (`[session, seq]` pairs:
/// another process may have appended to it before this writer's last
/// commit, which then left the cache's state of that session stale).
/// Checked before any row is written.
const CHECK_END_AND_HEADS: &str = "\
(SELECT COALESCE(MAX(position), 0) FROM events) = ? \
  AND NOT EXISTS (SELECT 1 FROM json_each(?) h \
    WHERE COALESCE((SELECT seq FROM events WHERE session_id = h.value ->> 0 \
                    ORDER BY seq DESC LIMIT 1), 0) IS NOT h.value ->> 1)";

/// The other condition: no call id the judgement took as absent is stored
/// (`[session, call id]` pairs). Checked before the calls index is
/// written, with the commit: rows sent ahead are events rows only, and by
/// then every judgement of the group has made its list.
const CHECK_CALLS: &str = "\
NOT EXISTS (SELECT 1 FROM json_each(?) j JOIN calls c \
    ON c.session_id = j.value ->> 0 AND c.call_id = j.value ->> 1)";

/// The opening of an optimistic transaction's first query: the check's
/// setup where the connection lacks it, the `BEGIN IMMEDIATE`, and the
/// values of [`CHECK_END_AND_HEADS`].
struct Opening<'a> {
    has_check: bool,
    last: i64,
    assumed: &'a [(Uuid, i64)],
}

/// The check's statements, after what `q` holds: with `opening`, the
/// transaction's start and [`CHECK_END_AND_HEADS`]; with `absent` (a JSON
/// array), [`CHECK_CALLS`]; both in one `INSERT` when both are given (a
/// statement less for the commit that opens the transaction too).
fn push_check(
    q: &mut QueryBuilder<'static, Sqlite>,
    opening: Option<Opening<'_>>,
    absent: Option<String>,
) {
    let mut conditions: Vec<(&str, Vec<Bound>)> = Vec::new();
    if let Some(o) = opening {
        if !o.has_check {
            q.push(CHECK_SETUP);
        }
        q.push("BEGIN IMMEDIATE;\n");
        let heads: Vec<serde_json::Value> = o
            .assumed
            .iter()
            .map(|(s, seq)| serde_json::json!([s.to_string(), seq]))
            .collect();
        conditions.push((
            CHECK_END_AND_HEADS,
            vec![
                Bound::Int(o.last),
                Bound::Text(serde_json::Value::Array(heads).to_string()),
            ],
        ));
    }
    if let Some(absent) = absent {
        conditions.push((CHECK_CALLS, vec![Bound::Text(absent)]));
    }
    if conditions.is_empty() {
        return;
    }
    q.push("INSERT INTO temp.optimistic_check (ok) SELECT ");
    for (i, (condition, binds)) in conditions.into_iter().enumerate() {
        if i > 0 {
            q.push(" AND ");
        }
        let mut parts = condition.split('?');
        q.push(parts.next().unwrap_or_default());
        for (bind, part) in binds.into_iter().zip(parts) {
            match bind {
                Bound::Int(v) => q.push_bind(v),
                Bound::Text(v) => q.push_bind(v),
            };
            q.push(part);
        }
    }
    q.push(";\n");
}

/// A value bound into [`push_check`]'s statement.
enum Bound {
    Int(i64),
    Text(String),
}

/// A JSON array of a row read ahead that is not what its statement builds.
fn corrupt_json(e: serde_json::Error) -> Error {
    Error::Corrupt(format!("a list read ahead could not be read: {e}"))
}

/// The event of a row of several kinds: session id, position, seq, event
/// id, payload and time in columns 1 to 6.
fn event_at(row: &sqlx::sqlite::SqliteRow) -> Result<StoredEvent> {
    decode((
        row.try_get(2).map_err(corrupt_row)?,
        row.try_get(1).map_err(corrupt_row)?,
        row.try_get(3).map_err(corrupt_row)?,
        row.try_get(4).map_err(corrupt_row)?,
        row.try_get(5).map_err(corrupt_row)?,
        row.try_get(6).map_err(corrupt_row)?,
    ))
}

/// The view columns of a row of several kinds, from column `first` on.
fn view_at(row: &sqlx::sqlite::SqliteRow, first: usize) -> Result<ViewColumns> {
    Ok((
        row.try_get(first).map_err(corrupt_row)?,
        row.try_get(first + 1).map_err(corrupt_row)?,
        row.try_get(first + 2).map_err(corrupt_row)?,
        row.try_get(first + 3).map_err(corrupt_row)?,
        row.try_get(first + 4).map_err(corrupt_row)?,
        row.try_get(first + 5).map_err(corrupt_row)?,
        row.try_get(first + 6).map_err(corrupt_row)?,
        row.try_get(first + 7).map_err(corrupt_row)?,
    ))
}

impl LogTx for SqliteTx {
    async fn head_seq(&mut self, session_id: Uuid) -> Result<i64> {
        if let (true, Some(m)) = (self.optimistic, self.memo.sessions.get(&session_id)) {
            return Ok(m.head);
        }
        head_seq(self.conn().await?, session_id).await
    }

    async fn head(&mut self, session_id: Uuid) -> Result<(i64, Option<String>)> {
        // Three independent subqueries, so that each keeps its index plan
        // (MAX(position) is a look at the end of the rowid tree).
        let (last_position, seq, hash): (i64, Option<i64>, Option<String>) = sqlx::query_as(
            "SELECT (SELECT COALESCE(MAX(position), 0) FROM events), \
             (SELECT seq FROM events WHERE session_id = ?1 ORDER BY seq DESC LIMIT 1), \
             (SELECT hash FROM events WHERE session_id = ?1 ORDER BY seq DESC LIMIT 1)",
        )
        .bind(session_id.to_string())
        .fetch_one(self.conn().await?)
        .await
        .map_err(Error::from_sqlx)?;
        self.last_position = Some(last_position);
        Ok((seq.unwrap_or(0), hash))
    }

    async fn prefetch(
        &mut self,
        sessions: &[Uuid],
        views: &[Uuid],
        ids: &[Uuid],
        calls: &[(Uuid, &str)],
    ) -> Result<()> {
        if self.optimistic {
            // Everything it would read was assumed.
            return Ok(());
        }
        let json = |v: Vec<serde_json::Value>| serde_json::Value::Array(v).to_string();
        let strings = |v: &[Uuid]| json(v.iter().map(|s| s.to_string().into()).collect());
        let calls_json = json(
            calls
                .iter()
                .map(|(s, c)| serde_json::json!([s.to_string(), c]))
                .collect(),
        );
        // On a writer that has sent nothing yet, the `BEGIN IMMEDIATE` goes
        // with the read (the driver runs the statements of one query in
        // order and binds the parameters to the one that has them).
        let opening = match &mut self.conn {
            TxConn::Write(w) if !w.in_tx && self.pending.is_empty() => {
                w.in_tx = true;
                true
            }
            _ => false,
        };
        let query = sqlx::query(if opening { BEGIN_PREFETCH } else { PREFETCH })
            .bind(strings(sessions))
            .bind(strings(ids))
            .bind(calls_json)
            .bind(strings(views));
        let conn = match &mut self.conn {
            TxConn::Write(w) if opening => w.conn()?,
            _ => self.conn().await?,
        };
        let rows = query.fetch_all(conn).await.map_err(Error::from_sqlx)?;
        let mut memo = Memo {
            ids: ids.iter().copied().collect(),
            ..Memo::default()
        };
        let mut views_read = HashMap::new();
        let mut found_calls: HashMap<Uuid, HashMap<String, CallRow>> = HashMap::new();
        let parse_id = |s: &str| -> Result<Uuid> {
            Uuid::parse_str(s).map_err(|_| Error::Corrupt(format!("bad session_id {s:?}")))
        };
        for row in rows {
            let kind: i64 = row.try_get(0).map_err(corrupt_row)?;
            match kind {
                0 => {
                    let last: i64 = row.try_get(2).map_err(corrupt_row)?;
                    self.last_position = Some(last);
                    if let TxConn::Write(w) = &mut self.conn {
                        w.quiet = w.last_committed == Some(last);
                    }
                    let heads: String = row.try_get(3).map_err(corrupt_row)?;
                    let heads: Vec<(String, Option<i64>, Option<String>)> =
                        serde_json::from_str(&heads).map_err(corrupt_json)?;
                    for (session, head, hash) in heads {
                        memo.sessions.insert(
                            parse_id(&session)?,
                            SessionMemo {
                                head: head.unwrap_or(0),
                                hash,
                                view: None,
                                asked_calls: HashSet::new(),
                                calls: HashMap::new(),
                            },
                        );
                    }
                    let found: String = row.try_get(4).map_err(corrupt_row)?;
                    let found: Vec<(String, String, String, i64, Option<i64>)> =
                        serde_json::from_str(&found).map_err(corrupt_json)?;
                    for (session, call_id, tool, call_seq, result_seq) in found {
                        found_calls
                            .entry(parse_id(&session)?)
                            .or_default()
                            .insert(call_id.clone(), (call_id, tool, call_seq, result_seq));
                    }
                }
                1 => {
                    let event = event_at(&row)?;
                    memo.stored.insert(event.event_id, event);
                }
                _ => {
                    let session: String = row.try_get(1).map_err(corrupt_row)?;
                    let id = parse_id(&session)?;
                    views_read.insert(id, ViewRow::from_columns(id, view_at(&row, 2)?));
                }
            }
        }
        let views: HashSet<&Uuid> = views.iter().collect();
        for (id, m) in memo.sessions.iter_mut() {
            if views.contains(id) {
                m.view = Some(views_read.remove(id));
            }
            m.calls = found_calls.remove(id).unwrap_or_default();
        }
        for (s, c) in calls {
            if let Some(m) = memo.sessions.get_mut(s) {
                m.asked_calls.insert((*c).to_owned());
            }
        }
        self.memo = memo;
        Ok(())
    }

    async fn judge_reads(
        &mut self,
        session_id: Uuid,
        ids: &[Uuid],
    ) -> Result<(Vec<StoredEvent>, i64, Option<String>)> {
        let memo = &self.memo;
        if self.optimistic {
            // Ids are taken as not stored: the commit's insert refuses one
            // that is (its unique index), and the group goes to the lock.
            return match memo.sessions.get(&session_id) {
                Some(m) => Ok((Vec::new(), m.head, m.hash.clone())),
                None => Err(optimistic_miss()),
            };
        }
        if let Some(m) = memo.sessions.get(&session_id) {
            if self.last_position.is_some()
                && ids
                    .iter()
                    .all(|id| memo.ids.contains(id) && !memo.written.contains(id))
            {
                let stored = ids
                    .iter()
                    .filter_map(|id| memo.stored.get(id).cloned())
                    .collect();
                return Ok((stored, m.head, m.hash.clone()));
            }
        }
        if ids.len() > INSERT_CHUNK {
            let stored = self.stored_by_ids(ids).await?;
            let (head, hash) = self.head(session_id).await?;
            return Ok((stored, head, hash));
        }
        // One statement (each statement costs a hop to the driver's worker
        // thread): the rows with these ids, then one row holding the last
        // position, the head seq and its hash (the subqueries of `head`).
        let session = session_id.to_string();
        let mut q = QueryBuilder::<Sqlite>::new(format!(
            "SELECT {COLUMNS}, hash, 0 FROM events WHERE event_id IN ("
        ));
        let mut sep = q.separated(", ");
        for id in ids {
            sep.push_bind(id.to_string());
        }
        q.push(") UNION ALL SELECT (SELECT COALESCE(MAX(position), 0) FROM events), '', ");
        q.push("(SELECT seq FROM events WHERE session_id = ");
        q.push_bind(session.clone());
        q.push(" ORDER BY seq DESC LIMIT 1), '', '', '', ");
        q.push("(SELECT hash FROM events WHERE session_id = ");
        q.push_bind(session);
        q.push(" ORDER BY seq DESC LIMIT 1), 1");
        let rows: Vec<JudgeRow> = q
            .build_query_as()
            .fetch_all(self.conn().await?)
            .await
            .map_err(Error::from_sqlx)?;
        let mut stored = Vec::new();
        let (mut head, mut hash) = (0, None);
        for (position, s, seq, e, payload, t, h, is_head) in rows {
            if is_head == 1 {
                self.last_position = Some(position);
                (head, hash) = (seq.unwrap_or(0), h);
            } else {
                stored.push(decode((position, s, seq.unwrap_or(0), e, payload, t))?);
            }
        }
        Ok((stored, head, hash))
    }

    async fn write_accepted(&mut self, w: Accepted<'_>) -> Result<()> {
        // Sent with the next statement or the COMMIT (`SqliteTx::conn`).
        let sent = std::mem::take(&mut self.batch_sent);
        self.pending.add(&w, sent);
        self.accepted(&w);
        // SQLite has no notifications; subscribers poll.
        Ok(())
    }

    async fn stored_by_ids(&mut self, ids: &[Uuid]) -> Result<Vec<StoredEvent>> {
        let mut out = Vec::new();
        for chunk in ids.chunks(INSERT_CHUNK) {
            let mut q = QueryBuilder::<Sqlite>::new(format!(
                "SELECT {COLUMNS} FROM events WHERE event_id IN ("
            ));
            let mut sep = q.separated(", ");
            for id in chunk {
                sep.push_bind(id.to_string());
            }
            q.push(")");
            let rows: Vec<Row> = q
                .build_query_as()
                .fetch_all(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
            for row in rows {
                out.push(decode(row)?);
            }
        }
        Ok(out)
    }

    async fn range(
        &mut self,
        session_id: Uuid,
        after: i64,
        upto: i64,
        max_bytes: usize,
    ) -> Result<Vec<StoredEvent>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM events WHERE session_id = ? AND seq > ? AND seq <= ? ORDER BY seq"
        );
        let mut rows = sqlx::query_as::<_, Row>(&sql)
            .bind(session_id.to_string())
            .bind(after)
            .bind(upto)
            .fetch(self.conn().await?);
        super::take_within(&mut rows, max_bytes, |r: &Row| r.4.len(), decode).await
    }

    fn rows_ahead(&self) -> Option<usize> {
        self.optimistic.then_some(AHEAD_ROWS)
    }

    fn rows_waiting(&self) -> usize {
        self.pending.rows.len()
    }

    /// Sends, in one query, the waiting rows and `rows`; the first sent
    /// opens the transaction with the check of the position and heads the
    /// judgement assumed. On any failure the transaction is rolled back
    /// (the group is judged again under the lock, or told the storage's
    /// failure: [`ahead_failure`](SqliteTx::ahead_failure)).
    async fn send_ahead(&mut self, rows: &[PendingRow]) -> Result<()> {
        self.sends_ahead += 1;
        let waiting = std::mem::take(&mut self.pending.rows);
        self.batch_sent += rows.len();
        let TxConn::Write(w) = &mut self.conn else {
            return Err(optimistic_miss());
        };
        let Some(last) = w.last_committed.filter(|_| self.optimistic) else {
            return Err(optimistic_miss());
        };
        if let Some(Err(e)) = w.file.as_ref().map(StoreFile::check) {
            self.ahead_failure = Some(e);
            return Err(optimistic_miss());
        }
        let mut q = QueryBuilder::<Sqlite>::new("");
        if !self.opened_ahead {
            let opening = Opening {
                has_check: w.has_check,
                last,
                assumed: &self.assumed,
            };
            push_check(&mut q, Some(opening), None);
        }
        let count = waiting.len() + rows.len();
        push_rows(&mut q, waiting.into_iter().chain(rows.iter().cloned()));
        // Marked first: if this is cancelled half-way, the rollback runs.
        w.in_tx = true;
        self.opened_ahead = true;
        let sent = q
            .build()
            .persistent(count <= CACHED_ROWS)
            .execute(w.conn()?)
            .await;
        if let Err(e) = sent {
            w.rollback().await;
            w.quiet = false;
            // As in `commit_optimistic`: a check or a stored event id is
            // judged again under the lock; the storage's failure is said.
            if crate::error::sqlite_primary_code(&e) != Some(19) {
                self.ahead_failure = Some(Error::from_sqlx(e));
            }
            return Err(optimistic_miss());
        }
        Ok(())
    }

    async fn reserve_positions(&mut self, n: i64) -> Result<i64> {
        // The write lock is held: nobody else can take a position before we
        // commit, so the next free one is simply max + 1 (the insert that
        // takes them moves `last_position` on).
        if let Some(last) = self.last_position {
            super::append::no_room_after(
                last,
                usize::try_from(n).unwrap_or(usize::MAX),
                "position of the log",
            )?;
            return Ok(last + 1);
        }
        let (last,): (i64,) = sqlx::query_as("SELECT COALESCE(MAX(position), 0) FROM events")
            .fetch_one(self.conn().await?)
            .await
            .map_err(Error::from_sqlx)?;
        super::append::no_room_after(
            last,
            usize::try_from(n).unwrap_or(usize::MAX),
            "position of the log",
        )?;
        Ok(last + 1)
    }

    async fn insert(&mut self, rows: &[PendingRow]) -> Result<()> {
        for chunk in rows.chunks(INSERT_CHUNK) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO events (position, session_id, seq, event_id, type, payload, recorded_at, hash) ",
            );
            q.push_values(chunk, |mut b, r| {
                b.push_bind(r.position)
                    .push_bind(r.session_id.to_string())
                    .push_bind(r.seq)
                    .push_bind(r.event_id.to_string())
                    .push_bind(r.type_name)
                    .push_bind(r.payload.as_str())
                    .push_bind(
                        r.recorded_at
                            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    )
                    .push_bind(r.hash.as_str());
            });
            q.build()
                .persistent(chunk.len() <= CACHED_ROWS)
                .execute(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        }
        self.inserted(rows);
        Ok(())
    }

    async fn load_view(&mut self, session_id: Uuid) -> Result<Option<ViewRow>> {
        if let Some(view) = self
            .memo
            .sessions
            .get(&session_id)
            .and_then(|m| m.view.as_ref())
        {
            return Ok(view.clone());
        }
        let row: Option<ViewColumns> = sqlx::query_as(
            "SELECT refresh_seq, mode, window_start, compaction_seq, summary, catalogs, evidence, active \
             FROM session_views WHERE session_id = ?",
        )
        .bind(session_id.to_string())
        .fetch_optional(self.conn().await?)
        .await
        .map_err(Error::from_sqlx)?;
        Ok(row.map(|r| ViewRow::from_columns(session_id, r)))
    }

    async fn write_view(&mut self, v: &ViewRow) -> Result<()> {
        self.wrote(v.session_id);
        sqlx::query(
            "INSERT OR REPLACE INTO session_views \
             (session_id, refresh_seq, mode, window_start, compaction_seq, summary, catalogs, evidence, active) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(v.session_id.to_string())
        .bind(v.refresh_seq)
        .bind(&v.mode)
        .bind(v.window_start)
        .bind(v.compaction_seq)
        .bind(&v.summary)
        .bind(&v.catalogs)
        .bind(&v.evidence)
        .bind(&v.active)
        .execute(self.conn().await?)
        .await
        .map_err(Error::from_sqlx)?;
        Ok(())
    }

    async fn calls(&mut self, session_id: Uuid, call_ids: &[String]) -> Result<Vec<CallRow>> {
        if self.optimistic {
            // What the cached state does not have is taken as absent, and
            // checked by the commit.
            self.absent_calls
                .extend(call_ids.iter().map(|c| (session_id, c.clone())));
            return Ok(Vec::new());
        }
        if let Some(m) = self.memo.sessions.get(&session_id) {
            if call_ids.iter().all(|c| m.asked_calls.contains(c)) {
                return Ok(call_ids
                    .iter()
                    .filter_map(|c| m.calls.get(c).cloned())
                    .collect());
            }
        }
        let mut out = Vec::new();
        for chunk in call_ids.chunks(INSERT_CHUNK) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "SELECT call_id, tool_name, call_seq, result_seq FROM calls WHERE session_id = ",
            );
            q.push_bind(session_id.to_string())
                .push(" AND call_id IN (");
            let mut sep = q.separated(", ");
            for id in chunk {
                sep.push_bind(id.as_str());
            }
            q.push(")");
            let rows: Vec<CallRow> = q
                .build_query_as()
                .fetch_all(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
            out.extend(rows);
        }
        Ok(out)
    }

    async fn record_calls(&mut self, session_id: Uuid, rows: &[CallRow]) -> Result<()> {
        self.wrote(session_id);
        for chunk in rows.chunks(INSERT_CHUNK) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO calls (session_id, call_id, tool_name, call_seq, result_seq) ",
            );
            q.push_values(chunk, |mut b, c| {
                b.push_bind(session_id.to_string())
                    .push_bind(c.0.as_str())
                    .push_bind(c.1.as_str())
                    .push_bind(c.2)
                    .push_bind(c.3);
            });
            q.push(
                " ON CONFLICT (session_id, call_id) DO UPDATE SET result_seq = excluded.result_seq",
            );
            q.build()
                .execute(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        }
        Ok(())
    }

    async fn last_refresh_seq(&mut self, session_id: Uuid) -> Result<i64> {
        let (seq,): (i64,) = sqlx::query_as(
            "SELECT COALESCE(MAX(seq), 0) FROM events WHERE session_id = ? \
             AND type IN ('prompt_submitted', 'mode_switched')",
        )
        .bind(session_id.to_string())
        .fetch_one(self.conn().await?)
        .await
        .map_err(Error::from_sqlx)?;
        Ok(seq)
    }

    async fn clear_derived(&mut self, session_id: Uuid) -> Result<()> {
        self.wrote(session_id);
        for sql in [
            "DELETE FROM session_views WHERE session_id = ?",
            "DELETE FROM calls WHERE session_id = ?",
            "DELETE FROM activation_changes WHERE session_id = ?",
        ] {
            sqlx::query(sql)
                .bind(session_id.to_string())
                .execute(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        }
        Ok(())
    }

    async fn session_ids(&mut self) -> Result<Vec<Uuid>> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT DISTINCT session_id FROM events ORDER BY session_id")
                .fetch_all(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        let mut ids = Vec::with_capacity(rows.len());
        for (s,) in rows {
            match Uuid::parse_str(&s) {
                Ok(id) => ids.push(id),
                // Only an edit around the store writes one: said with
                // where it is, as `verify` says a row it cannot read.
                Err(_) => {
                    let at: Option<i64> =
                        sqlx::query_scalar("SELECT MIN(position) FROM events WHERE session_id = ?")
                            .bind(&s)
                            .fetch_one(self.conn().await?)
                            .await
                            .map_err(Error::from_sqlx)?;
                    return Err(Error::Corrupt(format!(
                        "event at position {}: its session_id {s:?} is not a UUID",
                        at.unwrap_or(0)
                    )));
                }
            }
        }
        Ok(ids)
    }

    async fn session_owner(&mut self, session_id: Uuid) -> Result<Option<String>> {
        if let Some(owner) = self.memo.owners.get(&session_id) {
            return Ok(Some(owner.clone()));
        }
        let row: Option<(String,)> =
            sqlx::query_as("SELECT tenant FROM session_owners WHERE session_id = ?")
                .bind(session_id.to_string())
                .fetch_optional(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        Ok(row.map(|(t,)| t))
    }

    async fn claim_session(&mut self, session_id: Uuid, tenant: &str) -> Result<()> {
        self.wrote(session_id);
        sqlx::query("INSERT INTO session_owners (session_id, tenant) VALUES (?, ?)")
            .bind(session_id.to_string())
            .bind(tenant)
            .execute(self.conn().await?)
            .await
            .map_err(Error::from_sqlx)?;
        Ok(())
    }

    async fn notify(&mut self, _session_id: Uuid, _seq: i64) -> Result<()> {
        // SQLite has no notifications; subscribers poll.
        Ok(())
    }

    async fn chained_page(
        &mut self,
        session_id: Uuid,
        after: i64,
        limit: i64,
    ) -> Result<Vec<super::chain::ChainedRow>> {
        let sql = format!(
            "SELECT {COLUMNS}, hash, type FROM events WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT ?"
        );
        let mut rows = sqlx::query_as::<_, TypedRow>(&sql)
            .bind(session_id.to_string())
            .bind(after)
            .bind(limit)
            .fetch(self.conn().await?);
        super::take_within(
            &mut rows,
            super::PAGE_BYTES,
            |r: &TypedRow| r.4.len(),
            |(p, s, q, e, pl, t, h, ty)| {
                let id = Uuid::parse_str(&e).ok();
                Ok(super::chain::ChainedRow::read(
                    decode((p, s, q, e, pl, t)),
                    q,
                    id,
                    h,
                    ty,
                ))
            },
        )
        .await
    }

    async fn set_hash(&mut self, position: i64, hash: &str) -> Result<()> {
        // Chaining an old session rewrites hashes the memo may hold.
        self.memo.sessions.clear();
        sqlx::query("UPDATE events SET hash = ? WHERE position = ? AND hash IS NULL")
            .bind(hash)
            .bind(position)
            .execute(self.conn().await?)
            .await
            .map_err(Error::from_sqlx)?;
        Ok(())
    }

    async fn backfill_pending(&mut self, limit: i64) -> Result<Vec<Uuid>> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT session_id FROM chain_backfill ORDER BY session_id LIMIT ?")
                .bind(limit)
                .fetch_all(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        rows.into_iter()
            .map(|(s,)| {
                Uuid::parse_str(&s).map_err(|_| {
                    Error::Corrupt(format!("chain_backfill holds a bad session id {s:?}"))
                })
            })
            .collect()
    }

    async fn is_backfill_pending(&mut self, session_id: Uuid) -> Result<bool> {
        let row: Option<(i64,)> =
            sqlx::query_as("SELECT 1 FROM chain_backfill WHERE session_id = ?")
                .bind(session_id.to_string())
                .fetch_optional(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        Ok(row.is_some())
    }

    async fn backfill_done(&mut self, session_id: Uuid) -> Result<()> {
        sqlx::query("DELETE FROM chain_backfill WHERE session_id = ?")
            .bind(session_id.to_string())
            .execute(self.conn().await?)
            .await
            .map_err(Error::from_sqlx)?;
        Ok(())
    }

    async fn position_summary(&mut self) -> Result<(i64, i64, i64)> {
        // Positions are max + 1 at each append, so the counter is the max.
        let (count, max): (i64, i64) =
            sqlx::query_as("SELECT COUNT(*), COALESCE(MAX(position), 0) FROM events")
                .fetch_one(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        Ok((count, max, max))
    }

    async fn record_changes(&mut self, rows: &[ChangeRow]) -> Result<()> {
        for chunk in rows.chunks(INSERT_CHUNK) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO activation_changes (position, tool, session_id, seq, recorded_at, change, evidence_seq) ",
            );
            q.push_values(chunk, |mut b, r| {
                b.push_bind(r.position)
                    .push_bind(r.tool.as_str())
                    .push_bind(r.session_id.to_string())
                    .push_bind(r.seq)
                    .push_bind(sqlite_time(&r.recorded_at))
                    .push_bind(r.change.as_str())
                    .push_bind(r.evidence_seq);
            });
            q.build()
                .execute(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        }
        Ok(())
    }

    async fn load_changes(&mut self, session_id: Uuid) -> Result<Vec<ChangeRow>> {
        let rows: Vec<SqliteChange> = sqlx::query_as(CHANGE_SELECT_SESSION)
            .bind(session_id.to_string())
            .fetch_all(self.conn().await?)
            .await
            .map_err(Error::from_sqlx)?;
        rows.into_iter().map(decode_change).collect()
    }

    async fn changes_backfill_pending(&mut self, limit: i64) -> Result<Vec<Uuid>> {
        let rows: Vec<(String,)> =
            sqlx::query_as("SELECT session_id FROM changes_backfill ORDER BY session_id LIMIT ?")
                .bind(limit)
                .fetch_all(self.conn().await?)
                .await
                .map_err(Error::from_sqlx)?;
        rows.into_iter()
            .map(|(s,)| {
                Uuid::parse_str(&s).map_err(|_| {
                    Error::Corrupt(format!("changes_backfill holds a bad session id {s:?}"))
                })
            })
            .collect()
    }

    async fn changes_backfill_done(&mut self, session_id: Uuid) -> Result<()> {
        sqlx::query("DELETE FROM changes_backfill WHERE session_id = ?")
            .bind(session_id.to_string())
            .execute(self.conn().await?)
            .await
            .map_err(Error::from_sqlx)?;
        Ok(())
    }

    async fn commit(self) -> Result<()> {
        self.finish(false).await
    }

    async fn commit_append(self) -> Result<()> {
        self.finish(true).await
    }
}

impl SqliteTx {
    /// [`LogTx::commit`]; `append`: an append's commit, whose failure after
    /// its frames were written ([`commit_error`]) is an unknown outcome.
    async fn finish(mut self, append: bool) -> Result<()> {
        // The writer stays in `self` while the commit is awaited: if the
        // caller drops this future half-way (a timeout, a `select!`), Drop
        // still finds the open transaction and rolls it back, instead of
        // leaving the file's write lock held until this process writes
        // again.
        let pending = std::mem::take(&mut self.pending);
        match &mut self.conn {
            TxConn::Read(_) => match std::mem::replace(&mut self.conn, TxConn::Done) {
                TxConn::Read(tx) => tx.commit().await.map_err(Error::from_sqlx),
                _ => Ok(()),
            },
            TxConn::Write(w) => {
                if !w.in_tx && pending.is_empty() {
                    // Nothing was sent: nothing to commit.
                    return Ok(());
                }
                if let Err(e) = w.begin().await {
                    w.rollback().await;
                    return Err(e);
                }
                if let Some(Err(e)) = w.file.as_ref().map(StoreFile::check) {
                    w.rollback().await;
                    return Err(e);
                }
                // The pending writes and the COMMIT, in one hop.
                let persistent = pending.rows.len() <= CACHED_ROWS;
                let mut q = if pending.is_empty() {
                    QueryBuilder::<Sqlite>::new("")
                } else {
                    pending.query()
                };
                q.push("COMMIT;");
                let committed = q.build().persistent(persistent).execute(w.conn()?).await;
                match committed {
                    Ok(_) => {
                        w.in_tx = false;
                        w.last_committed = self.last_position;
                        Ok(())
                    }
                    Err(e) => {
                        w.rollback().await;
                        w.last_committed = None;
                        Err(commit_error(e, append))
                    }
                }
            }
            TxConn::Done => Ok(()),
        }
    }
}

impl super::group::OptimisticTx for SqliteTx {
    const REMOTE_COMMIT: bool = false;

    fn ahead_failure(&mut self) -> Option<Error> {
        self.ahead_failure.take()
    }

    fn sends_ahead(&self) -> u64 {
        self.sends_ahead
    }

    /// Makes an optimistic transaction judge `warm`'s session against its
    /// cached head, hash, view and owner.
    fn assume(&mut self, warm: &super::Warm) {
        let Some(known) = &warm.known else { return };
        let session_id = warm.state.session_id;
        self.assumed.push((session_id, warm.state.seq));
        self.memo.sessions.insert(
            session_id,
            SessionMemo {
                head: warm.state.seq,
                hash: Some(known.head_hash.clone()),
                view: Some(known.view.clone()),
                asked_calls: HashSet::new(),
                calls: HashMap::new(),
            },
        );
        if let Some(owner) = &known.owner {
            self.memo.owners.insert(session_id, owner.clone());
        }
    }

    /// Sends an optimistic transaction in one query: the `BEGIN
    /// IMMEDIATE`, the check of what the judgement assumed, the writes and
    /// the `COMMIT` (after rows sent ahead: the check of call ids taken as
    /// absent, the rest of the writes and the `COMMIT`). Any failure rolls it back whole. A failed check or an
    /// event id already stored (`Rejected`): the group is judged again
    /// under the lock, which reads what it needs. Any other failure
    /// (`Failed`): the storage's, said to the group's callers.
    async fn commit_optimistic(mut self) -> std::result::Result<i64, OptimisticMiss> {
        let refused = |why: String| OptimisticMiss::Rejected(why);
        let pending = std::mem::take(&mut self.pending);
        let absent: Vec<serde_json::Value> = self
            .absent_calls
            .iter()
            .map(|(s, c)| serde_json::json!([s.to_string(), c]))
            .collect();
        let TxConn::Write(w) = &mut self.conn else {
            return Err(refused("not a write transaction".to_owned()));
        };
        let nothing = pending.is_empty() && !self.opened_ahead;
        let (Some(assumed), false) = (w.last_committed, nothing) else {
            return Err(refused(
                "nothing to commit, or no position known".to_owned(),
            ));
        };
        if let Some(Err(e)) = w.file.as_ref().map(StoreFile::check) {
            // The storage's state, as below: said now.
            return Err(OptimisticMiss::Failed(e));
        }
        let persistent = pending.rows.len() <= CACHED_ROWS;
        let mut q = QueryBuilder::<Sqlite>::new("");
        let opening = (!self.opened_ahead).then_some(Opening {
            has_check: w.has_check,
            last: assumed,
            assumed: &self.assumed,
        });
        push_check(
            &mut q,
            opening,
            Some(serde_json::Value::Array(absent).to_string()),
        );
        pending.push_to(&mut q);
        q.push("COMMIT;");
        // Marked first: if this is cancelled half-way, the rollback runs.
        w.in_tx = true;
        let committed = q
            .build()
            .persistent(persistent)
            .execute(w.conn().map_err(|e| refused(e.to_string()))?)
            .await;
        match committed {
            Ok(_) => {
                w.in_tx = false;
                w.has_check = true;
                w.last_committed = self.last_position;
                self.conn = TxConn::Done;
                Ok(0)
            }
            Err(e) => {
                w.rollback().await;
                w.quiet = false;
                // The check (its trigger) and a stored event id (a unique
                // index) are constraint failures: the group is judged again
                // under the lock. Anything else (the lock not had within
                // the busy timeout, the disk) is the storage's state: said
                // to the caller now, rather than waited out a second time
                // by the locked path. Nothing was stored either way.
                // SQLITE_CONSTRAINT is 19.
                Err(match crate::error::sqlite_primary_code(&e) == Some(19) {
                    true => refused(sqlx_message(&e)),
                    false => OptimisticMiss::Failed(commit_error(e, true)),
                })
            }
        }
    }
}

/// SQLite's extended result codes of a failure that comes after a commit's
/// frames were written to the WAL: its sync (`SQLITE_IOERR_FSYNC`,
/// `SQLITE_IOERR_DIR_FSYNC`) or the index of the WAL (`SQLITE_IOERR_SHMOPEN`,
/// `_SHMSIZE`, `_SHMMAP`). This process does not see those frames, but
/// they end with a commit marker and valid checksums: opened after a
/// crash, SQLite's recovery of the WAL may find the transaction there.
const FAILED_AFTER_WRITE: [i64; 5] = [1034, 1290, 4618, 4874, 5386];

/// The error of a failed commit query. For an append (`append`), a
/// failure after its frames were written ([`FAILED_AFTER_WRITE`]) is an
/// unknown outcome: it may be stored, and a retry must use the same event
/// ids. Any other failure stored nothing, and is said as it is.
fn commit_error(e: sqlx::Error, append: bool) -> Error {
    let code = match &e {
        sqlx::Error::Database(db) => db.code().and_then(|c| c.parse::<i64>().ok()),
        _ => None,
    };
    match code {
        Some(code) if append && FAILED_AFTER_WRITE.contains(&code) => {
            Error::OutcomeUnknown(format!(
                "{} (SQLite's extended code {code}: the commit was written but not made durable)",
                sqlx_message(&e)
            ))
        }
        _ => Error::from_sqlx(e),
    }
}

/// Times are stored as RFC 3339 text with microseconds and `Z`, so text
/// order is time order.
pub(crate) fn sqlite_time(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// An `activation_changes` row as SQLite returns it.
pub(crate) type SqliteChange = (i64, String, String, i64, String, String, Option<i64>);

const CHANGE_SELECT_SESSION: &str =
    "SELECT position, tool, session_id, seq, recorded_at, change, evidence_seq \
     FROM activation_changes WHERE session_id = ? ORDER BY seq, tool";

pub(crate) fn decode_change(r: SqliteChange) -> Result<ChangeRow> {
    let (position, tool, session_id, seq, recorded_at, change, evidence_seq) = r;
    let corrupt = |what: &str| {
        Error::Corrupt(format!(
            "activation change at position {position} of {tool:?}: {what}"
        ))
    };
    Ok(ChangeRow {
        session_id: Uuid::parse_str(&session_id).map_err(|_| corrupt("bad session_id"))?,
        seq,
        position,
        recorded_at: DateTime::parse_from_rfc3339(&recorded_at)
            .map_err(|_| corrupt("bad recorded_at"))?
            .with_timezone(&Utc),
        tool,
        change,
        evidence_seq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command that only reads refuses a file with no store in it, empty
    /// or a database without tables (a copy made without its -wal file),
    /// rather than making a store of it and answering "not found"; one
    /// that writes makes the store there.
    #[tokio::test]
    async fn a_read_refuses_an_empty_file_or_database() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.db").display().to_string();
        std::fs::write(&empty, b"").unwrap();
        let bare = dir.path().join("bare.db").display().to_string();
        let mut conn = SqliteConnection::connect_with(
            &SqliteConnectOptions::new()
                .filename(&bare)
                .create_if_missing(true),
        )
        .await
        .unwrap();
        sqlx::raw_sql("PRAGMA user_version = 1")
            .execute(&mut conn)
            .await
            .unwrap();
        conn.close().await.unwrap();
        assert!(std::fs::metadata(&bare).unwrap().len() > 0);
        for (path, said) in [(&empty, "the file is empty"), (&bare, "holds no tables")] {
            match check_file(path, false).await {
                Err(Error::NotAStore(m)) => assert!(m.contains(said) && m.contains("-wal"), "{m}"),
                other => panic!("{path}: {other:?}"),
            }
            check_file(path, true).await.unwrap();
        }
    }

    /// A commit that failed at its sync or at the WAL's index (after its
    /// frames were written) may be found by the next open's recovery: an
    /// unknown outcome. A write or space failure, or a failure before the
    /// frames (busy, constraint), stored nothing. The codes are SQLite's
    /// extended ones (`sqlite3_extended_result_codes`, which sqlx turns on).
    #[test]
    fn only_failures_after_the_frames_were_written_leave_a_commit_unknown() {
        // IOERR_FSYNC, IOERR_DIR_FSYNC, IOERR_SHMOPEN, _SHMSIZE, _SHMMAP.
        for code in [
            10 | 4 << 8,
            10 | 5 << 8,
            10 | 18 << 8,
            10 | 19 << 8,
            10 | 21 << 8,
        ] {
            assert!(FAILED_AFTER_WRITE.contains(&code), "{code}");
        }
        // IOERR_READ, IOERR_WRITE, IOERR_SHORT_READ, IOERR_TRUNCATE,
        // FULL, BUSY, CONSTRAINT, CONSTRAINT_UNIQUE, READONLY, CANTOPEN.
        for code in [
            10 | 1 << 8,
            10 | 3 << 8,
            10 | 2 << 8,
            10 | 6 << 8,
            13,
            5,
            19,
            2067,
            8,
            14,
        ] {
            assert!(!FAILED_AFTER_WRITE.contains(&code), "{code}");
        }
    }

    /// Spellings of an in-memory or temporary database that only the
    /// driver's decoding reveals are refused once opened, before anything
    /// is written; nothing is left in the directory.
    #[tokio::test]
    async fn a_database_without_a_file_is_refused_once_opened() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name).display().to_string();
        for url in [
            "sqlite://%3Amemory%3A".to_owned(),
            "sqlite://file:%3Amemory%3A".to_owned(),
            format!("sqlite://file:{}%3Fmode%3Dmemory", at("a.db")),
            format!("sqlite://{}?mode=%6Demory", at("b.db")),
            format!("sqlite://{}?vfs=memdb", at("c.db")),
            "sqlite://file:".to_owned(),
        ] {
            let opened = crate::Store::open(&url).await;
            assert!(
                matches!(opened, Err(Error::BadUrl(_))),
                "{url}: {:?}",
                opened.map(|_| ())
            );
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // A store in a file still opens.
        let store = crate::Store::open(&at("s.db")).await.unwrap();
        store.close().await;
    }

    /// `check_file` looks at the file the driver opens, whatever the URL's
    /// options and encoding.
    #[tokio::test]
    async fn check_file_reads_the_file_the_driver_opens() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.db").display().to_string();
        let url = format!("sqlite://{file}?mode=rwc");
        let missing = check_file(&url, false).await;
        assert!(matches!(missing, Err(Error::NotAStore(_))), "{missing:?}");
        check_file(&url, true).await.unwrap();
        let store = crate::Store::open(&url).await.unwrap();
        store.close().await;
        check_file(&url, false).await.unwrap();
        check_file(&file, false).await.unwrap();
        // A store in memory would lose what it acknowledged: refused.
        for memory in [
            "sqlite::memory:",
            ":memory:",
            "sqlite://:memory:?cache=shared",
            "sqlite://x.db?mode=memory",
            "x.db?cache=shared&mode=memory",
            "file::memory:",
            "file:/tmp/x.db?mode=memory",
        ] {
            let refused = check_file(memory, true).await;
            assert!(
                matches!(refused, Err(Error::BadUrl(_))),
                "{memory}: {refused:?}"
            );
        }
        // A file opened without its write-ahead log (immutable): refused
        // saying so, not as an in-memory database.
        let store_file = dir.path().join("wal.db").display().to_string();
        crate::Store::open(&store_file).await.unwrap().close().await;
        let refused = crate::Store::open(&format!("sqlite://{store_file}?immutable=1"))
            .await
            .map(|_| ());
        assert!(
            matches!(&refused, Err(Error::UrlRefused { why, .. }) if why.contains("write-ahead log")),
            "{refused:?}"
        );
        // A file name cannot hold NUL: a bad URL, not a storage failure to
        // retry.
        let nul = format!("{}/a\0b.db", dir.path().display());
        let refused = crate::Store::open(&nul).await.map(|_| ());
        assert!(matches!(&refused, Err(Error::BadUrl(_))), "{refused:?}");
        assert!(!refused.unwrap_err().is_retryable());
        // The driver percent-decodes the path: the check reads the same
        // file, here another application's database.
        let spaced = dir.path().join("my app.db");
        let mut other = SqliteConnection::connect_with(
            &SqliteConnectOptions::new()
                .filename(&spaced)
                .create_if_missing(true),
        )
        .await
        .unwrap();
        sqlx::query("CREATE TABLE users (id INTEGER)")
            .execute(&mut other)
            .await
            .unwrap();
        other.close().await.unwrap();
        let encoded = format!("sqlite://{}/my%20app.db", dir.path().display());
        let refused = check_file(&encoded, true).await;
        assert!(
            matches!(&refused, Err(Error::NotAStore(m)) if m.contains("users")),
            "{refused:?}"
        );
        // So does SQLite for a `file:` URI, which the driver hands on as it
        // is: the same file, refused the same way, and left unchanged.
        let before = std::fs::read(&spaced).unwrap();
        let d = dir.path().display();
        // (`file://…` alone is a URL of a scheme the store does not know,
        // refused before any file is looked at; after `sqlite://` it is
        // SQLite's.)
        for uri in [
            format!("file:{d}/my%20app.db"),
            format!("sqlite://file:{d}/my%20app.db"),
            format!("sqlite://file://{d}/my%20app.db"),
            format!("sqlite://file://localhost{d}/my%20app.db?cache=private"),
        ] {
            let refused = crate::Store::open(&uri).await.map(|_| ());
            assert!(
                matches!(&refused, Err(Error::NotAStore(m)) if m.contains("users")),
                "{uri}: {refused:?}"
            );
        }
        assert_eq!(std::fs::read(&spaced).unwrap(), before);
        // A `file:` URI of a missing file: created only by a command that
        // writes, as a path's.
        let missing = format!("file:{d}/new.db");
        let said = check_file(&missing, false).await;
        assert!(matches!(said, Err(Error::NotAStore(_))), "{said:?}");
        assert!(!dir.path().join("new.db").exists());
        // A URI of another host, or with a bad escape, is not one to open.
        for bad in [
            format!("file://example.com{d}/s.db"),
            format!("file:{d}/s%zz.db"),
        ] {
            let said = check_file(&bad, true).await;
            assert!(matches!(said, Err(Error::BadUrl(_))), "{bad}: {said:?}");
        }
        // An option the driver does not know, or a value it does not
        // take, is said in its words (it was the in-memory explanation).
        for (bad, says) in [
            (
                format!("file:{d}/s.db?bogus=1"),
                "unknown query parameter `bogus`",
            ),
            (
                format!("sqlite://{d}/s.db?mode=bad"),
                "unknown value \"bad\" for `mode`",
            ),
        ] {
            let said = check_file(&bad, true).await;
            assert!(
                matches!(&said, Err(e @ Error::UrlRefused { .. }) if e.to_string().contains(says)),
                "{bad}: {said:?}"
            );
        }
        // A NUL that only the decoding reveals is a bad URL too.
        for nul in [format!("{d}/a%00b.db"), format!("file:{d}/a%00b.db")] {
            let said = check_file(&nul, true).await;
            assert!(matches!(said, Err(Error::BadUrl(_))), "{nul}: {said:?}");
        }
        // A device is no store file, and nothing is written beside it.
        let journal = std::path::Path::new("/dev/null-journal");
        let had_journal = journal.exists();
        for create in [false, true] {
            let said = check_file("/dev/null", create).await;
            assert!(
                matches!(&said, Err(Error::NotAStore(m)) if m.contains("not a regular file")),
                "{said:?}"
            );
        }
        assert_eq!(journal.exists(), had_journal);
    }

    /// A database SQLite opens but the store refuses (here a VFS without
    /// the shared memory WAL needs) leaves no empty file behind.
    #[tokio::test]
    async fn a_file_made_for_a_refused_database_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/nolock.db?vfs=unix-none", dir.path().display());
        let refused = crate::Store::open(&url).await.map(|_| ());
        assert!(
            matches!(&refused, Err(Error::UrlRefused { why, .. }) if why.contains("write-ahead log")),
            "{refused:?}"
        );
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_file_uri_names_its_file_as_sqlite_reads_it() {
        assert_eq!(uri_file("file:/a/b.db"), Some(Some("/a/b.db".into())));
        assert_eq!(uri_file("file:b.db?mode=ro"), Some(Some("b.db".into())));
        assert_eq!(uri_file("file:///a/b.db"), Some(Some("/a/b.db".into())));
        assert_eq!(
            uri_file("file://localhost/a/my%20b.db#x"),
            Some(Some("/a/my b.db".into()))
        );
        assert_eq!(uri_file("file:"), Some(None));
        assert_eq!(uri_file("file::memory:?cache=shared"), Some(None));
        assert_eq!(uri_file("file:%3Amemory%3A"), Some(None));
        assert_eq!(uri_file("file://host/a.db"), None);
        assert_eq!(uri_file("file:a%2.db"), None);
        assert_eq!(uri_file("file:a%ff.db"), None);
    }

    /// `check_file` knows every table a store has: a migration that adds
    /// one must add it to `STORE_TABLES`, or stores would be refused.
    #[tokio::test]
    async fn store_tables_lists_every_table_of_a_migrated_store() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let store = crate::Store::open(&url).await.unwrap();
        store.close().await;
        let mut conn = SqliteConnection::connect_with(&connect_options(&url).unwrap())
            .await
            .unwrap();
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let mut expected: Vec<&str> = STORE_TABLES.to_vec();
        expected.sort_unstable();
        assert_eq!(tables, expected, "a migration added or dropped a table");
    }

    /// A write of many rows is prepared for its one use: each size of
    /// large batch kept megabytes in the writer's statement cache for as
    /// long as the connection. Small batches keep theirs.
    #[tokio::test]
    async fn large_writes_are_not_kept_prepared() {
        use crate::event::{EventBody, NewEvent};
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let store = crate::Store::open(&url).await.unwrap();
        let batch = |n: usize| {
            let mut events = vec![NewEvent::new(EventBody::SessionStarted {
                mode: "m".to_owned(),
                metadata: None,
            })];
            events.extend((1..n).map(|i| {
                NewEvent::new(EventBody::PromptSubmitted {
                    text: i.to_string(),
                })
            }));
            events
        };
        async fn cached(store: &crate::Store) -> usize {
            match &store.backend {
                crate::store::Backend::Sqlite(b) => {
                    let w = b.writer.lock().await;
                    w.conn.as_ref().map_or(0, |c| c.cached_statements_size())
                }
                _ => unreachable!("a SQLite store"),
            }
        }
        store.append(Uuid::new_v4(), 0, batch(10)).await.unwrap();
        let small = cached(&store).await;
        store.append(Uuid::new_v4(), 0, batch(10)).await.unwrap();
        assert_eq!(
            cached(&store).await,
            small,
            "the same small batch, kept once"
        );
        store
            .append(Uuid::new_v4(), 0, batch(CACHED_ROWS + 1))
            .await
            .unwrap();
        store
            .append(Uuid::new_v4(), 0, batch(CACHED_ROWS + 7))
            .await
            .unwrap();
        assert_eq!(cached(&store).await, small, "large batches were kept");
        store.append(Uuid::new_v4(), 0, batch(11)).await.unwrap();
        assert_eq!(cached(&store).await, small + 1, "a new small size is kept");
        store.close().await;
    }

    /// No pool runs sqlx's reaper task, which can spin for good
    /// (docs/design.md, "Connection health").
    #[test]
    fn pools_have_no_reaper() {
        for (idle, lifetime) in [
            (
                pool_options().get_idle_timeout(),
                pool_options().get_max_lifetime(),
            ),
            (
                crate::store::postgres::pool_options().get_idle_timeout(),
                crate::store::postgres::pool_options().get_max_lifetime(),
            ),
        ] {
            assert_eq!((idle, lifetime), (None, None));
        }
    }

    /// The settings docs/design.md promises ("Durability") are the ones a
    /// connection gets.
    #[tokio::test]
    async fn connections_get_the_documented_settings() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("s.db").display());
        let mut conn = SqliteConnection::connect_with(&connect_options(&url).unwrap())
            .await
            .unwrap();
        for (pragma, expected) in [
            ("journal_mode", "wal"),
            // 2 = FULL.
            ("synchronous", "2"),
            // 2 = MEMORY.
            ("temp_store", "2"),
            ("wal_autocheckpoint", "4000"),
            ("foreign_keys", "1"),
            ("busy_timeout", "10000"),
        ] {
            let row = sqlx::query(&format!("PRAGMA {pragma}"))
                .fetch_one(&mut conn)
                .await
                .unwrap();
            let value: String = match row.try_get::<String, _>(0) {
                Ok(s) => s,
                Err(_) => row.get::<i64, _>(0).to_string(),
            };
            assert_eq!(value, expected, "PRAGMA {pragma}");
        }
    }
}
