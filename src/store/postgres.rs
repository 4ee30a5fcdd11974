//! The PostgreSQL backend: one store shared by many sidecar instances.
//!
//! Global order: every append first locks the one-row `event_position`
//! counter (`SELECT … FOR UPDATE`), then takes its positions from it and
//! commits. Appends are therefore serialized store-wide, and positions become
//! visible in the order they were handed out, so a reader paging by position
//! never skips an event that commits later with a lower position. The cost
//! is one commit at a time; docs/design.md weighs it against `xid8`.
//!
//! Session settings keep one stuck client from stalling everyone behind the
//! counter lock: `statement_timeout`, `lock_timeout` and
//! `idle_in_transaction_session_timeout` (values in docs/design.md).

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, Postgres, Transaction};
use tokio_stream::StreamExt as _;
use tracing::{debug, warn};
use uuid::Uuid;

use super::{
    upsert_call, Accepted, CallRow, ChangeRow, LogTx, PendingRow, StoreOptions, ViewColumns,
    ViewRow,
};
use crate::error::{Error, Result};
use crate::event::{EventBody, StoredEvent};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

/// The latest migration this build knows: an open store's schema is at it.
pub(crate) fn latest_migration() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

type Row = (i64, Uuid, i64, Uuid, String, DateTime<Utc>);

/// A [`Row`] with its chain hash and its `type` column (`chained_page`).
type TypedRow = (
    i64,
    Uuid,
    i64,
    Uuid,
    String,
    DateTime<Utc>,
    Option<String>,
    String,
);

/// A row of `prefetch`: a [`Row`] with its chain hash and whether it is the session's
/// head, or (with the last column set) the counter's value and the views
/// and calls index rows asked for, as JSON.
type JudgeRow = (
    i64,
    Uuid,
    i64,
    Uuid,
    String,
    DateTime<Utc>,
    Option<String>,
    bool,
    Option<String>,
);

/// The relations the store's migrations make (tables, their sequence-like
/// counter), and the migrator's own table: in a schema without
/// `_sqlx_migrations`, one of the others taken is another application's.
const STORE_RELATIONS: [&str; 9] = [
    "_sqlx_migrations",
    "events",
    "event_position",
    "calls",
    "session_views",
    "session_owners",
    "chain_backfill",
    "activation_changes",
    "changes_backfill",
];

/// A row of `view_and_window`: an event's [`Row`], or (with the last
/// column set) the view as a JSON array.
type ViewOrEvent = (i64, Uuid, i64, Uuid, String, DateTime<Utc>, Option<String>);

/// A calls index row as `prefetch` returns it (JSON array).
type CallJson = (Uuid, String, String, i64, Option<i64>);

const COLUMNS: &str = "position, session_id, seq, event_id, payload, recorded_at";

/// The rows of `events` matching `filter`, in `order`, at most `$N`
/// (`limit`), and none after the one whose payload brings the page to
/// `$M` (`bytes`) bytes: every paged read of events. The byte bound is the
/// server's to keep: a page the client stopped reading still came over
/// the wire whole (sqlx reads a result to its end before the
/// connection's next statement), so folds of 100 KB events moved 8 times
/// their bytes. `octet_length` of a compressed or out-of-line payload
/// reads its header, not the value; rows past the bound are neither
/// decompressed nor sent.
fn bounded_page(columns: &str, filter: &str, order: &str, limit: &str, bytes: &str) -> String {
    format!(
        "SELECT {columns} FROM (\
           SELECT {columns}, \
                  SUM(octet_length(payload)) OVER (ORDER BY {order} ROWS UNBOUNDED PRECEDING) \
                    - octet_length(payload) AS before \
             FROM events WHERE {filter} ORDER BY {order} LIMIT {limit}) page \
         WHERE before < GREATEST({bytes}, 1) ORDER BY {order}"
    )
}

/// A page of one session's events: `$2 < seq <= $3`, at most `$4`, and
/// when `bounded`, at most `$5` bytes of payloads ([`bounded_page`]).
/// Unbounded reads (`history`, a whole window) keep the plain statement:
/// the running sum tripled the server's time for a page of small events.
fn session_page(bounded: bool) -> String {
    let filter = "session_id = $1 AND seq > $2 AND seq <= $3";
    match bounded {
        true => bounded_page(COLUMNS, filter, "seq", "$4", "$5"),
        false => format!("SELECT {COLUMNS} FROM events WHERE {filter} ORDER BY seq LIMIT $4"),
    }
}

/// A byte count as the statements bind it.
fn byte_bound(max_bytes: usize) -> i64 {
    i64::try_from(max_bytes).unwrap_or(i64::MAX)
}

/// The server's `lock_timeout` below: how long a write waits for the
/// position counter behind other writers before the server refuses it.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// The locked path's wait for the position counter, in one round trip: at
/// most [`LOCK_TIMEOUT`] in all. `lock_timeout` alone does not bound it:
/// PostgreSQL times each lock a statement waits for on its own, and a
/// writer queued behind another waiter for the counter's row first waits
/// for that waiter (the row's tuple lock), then for the holder, so the
/// second instance in line waited twice `lock_timeout` and the third
/// three times (tests/faults.rs). The statement's own timeout covers all
/// its waits; it is set back to the connection's after the lock.
const LOCK_COUNTER: &str = "SET LOCAL statement_timeout = '10s'; \
    SELECT 1 FROM event_position WHERE id = 1 FOR UPDATE; \
    SET LOCAL statement_timeout = '30s'";

/// A failed [`LOCK_COUNTER`]: its timeout said as the wait it bounds.
fn counter_not_had(e: Error) -> Error {
    match e {
        Error::Unavailable(why) if why.contains("statement timeout") => {
            let limit = LOCK_TIMEOUT.as_secs();
            Error::Unavailable(format!(
                "the position counter's lock was not had within {limit} s: \
                 another writer holds it ({why})"
            ))
        }
        other => other,
    }
}

/// Server-side settings of every connection: limits (see the module docs),
/// the isolation the write path needs and the plans the reads need.
const SESSION_SETTINGS: [(&str, &str); 6] = [
    // A write takes the counter's lock and then reads what the appends
    // before it committed: each statement needs a snapshot taken after
    // the lock, which READ COMMITTED gives. A server or database whose
    // default is REPEATABLE READ or SERIALIZABLE would fail every write
    // that waited for the lock with a serialization error. Read snapshots
    // ask for REPEATABLE READ themselves.
    ("default_transaction_isolation", "read committed"),
    ("statement_timeout", "30s"),
    ("lock_timeout", "10s"),
    ("idle_in_transaction_session_timeout", "30s"),
    // sqlx prepares every statement once per connection, and after five
    // executions PostgreSQL may switch a prepared statement to a generic
    // plan, costed with the statistics of that moment. A store's tables
    // grow from empty: a plan chosen while `events` was small (a scan)
    // kept running after it was large, and an append's reads took 10-20 ms
    // instead of 0.5 ms until the next ANALYZE (docs/benchmarks.md). Custom
    // plans are costed with the current table size on every execution.
    ("plan_cache_mode", "force_custom_plan"),
    // The store's reads are key lookups and index scans a `LIMIT` stops
    // early, but the planner costs a scan under a `LIMIT` as if it ran to
    // the end: an audit page by type of a 10^6-event log was costed above
    // `jit_above_cost` and compiled (LLVM) on every call, 5.4 of its 5.8 ms
    // for `compaction`, 68 of 70 ms for `tool_result`, whose scan read
    // 1.1 ms (docs/audit.md). No statement here runs long enough for
    // compiled expressions to pay back their compilation.
    ("jit", "off"),
];

/// [`SESSION_SETTINGS`] as the statements every new connection runs first
/// ([`pool_options`]), not as startup options: a connection pooler
/// (PgBouncer) refuses a startup `options` parameter, or, told to ignore
/// it, drops it in silence, and the store then ran without its lock and
/// statement timeouts (an append waiting 45 s on a stuck writer was stored
/// after its client had been told it timed out) and under the database's
/// default isolation (a pooler review's findings). `SET` holds for the
/// session, which a pooler in session mode gives a client whole.
static SETTINGS_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    SESSION_SETTINGS
        .iter()
        .map(|(name, value)| format!("SET {name} = '{value}';"))
        .collect::<Vec<_>>()
        .join(" ")
});

/// Runs [`SETTINGS_SQL`] on a connection just made (a pool's
/// `after_connect`).
fn apply_settings<'c>(
    conn: &'c mut sqlx::PgConnection,
    _: sqlx::pool::PoolConnectionMetadata,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = std::result::Result<(), sqlx::Error>> + Send + 'c>,
> {
    // A `&str` without arguments goes as one simple query: its
    // statements in one round trip.
    Box::pin(async move {
        sqlx::Executor::execute(conn, SETTINGS_SQL.as_str())
            .await
            .map(|_| ())
    })
}

/// A concurrent index build of a migration (0009) that was cut off (a lock
/// timeout, a cancel, a crash) leaves its index invalid, which the
/// migration's `IF NOT EXISTS` would then pass over, and which the planner
/// never uses. Dropped and built again, both `CONCURRENTLY` (each its own
/// statement, outside a transaction), so that other instances go on
/// reading and appending, as during the first build.
async fn repair_cut_off_builds(
    conn: &mut sqlx::PgConnection,
    deadline: Option<Duration>,
) -> Result<()> {
    use sqlx::Executor;
    let invalid: Option<bool> = trip(
        deadline,
        sqlx::query_scalar(
            "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass('events_sparse_types')",
        )
        .fetch_optional(&mut *conn),
    )
    .await?;
    if invalid != Some(true) {
        return Ok(());
    }
    tracing::warn!("building again the index events_sparse_types, whose build was cut off");
    let build = MIGRATOR
        .iter()
        .find(|m| m.version == 9)
        .map(|m| m.sql.to_string())
        .unwrap_or_default();
    // Said as the migration it finishes, as a first attempt's failure is
    // (a review's finding: a lock timeout here said only "canceling
    // statement due to lock timeout").
    let said = |e: sqlx::Error| {
        let doing = "migrating the PostgreSQL database failed at migration 9, building again \
                     the index events_sparse_types, whose build an earlier open left cut off";
        let next = "the next open tries again; a transaction left open on events (another \
                    program's) holds it up";
        match Error::from_sqlx(e) {
            Error::Unavailable(m) => Error::Unavailable(format!("{doing}: {m}; {next}")),
            Error::Database(m) => Error::Database(format!("{doing}: {m}; {next}")),
            other => other,
        }
    };
    conn.execute("DROP INDEX CONCURRENTLY IF EXISTS events_sparse_types")
        .await
        .map_err(said)?;
    conn.execute(build.as_str()).await.map_err(said)?;
    Ok(())
}

/// The advisory lock an instance holds while it migrates the database
/// (`PgBackend::migrate`): any constant, distinct from the migrator's own.
const MIGRATION_LOCK: i64 = 0x5353_4d49_4752_4154;

/// The advisory lock an instance holds while it does the one-time work of
/// an upgrade (`PgBackend::backfill_turn`), XORed with the hash of the
/// store's schema. Public for the tests that hold it.
#[doc(hidden)]
pub const BACKFILL_LOCK: i64 = 0x5353_4246_494c_4c53;

/// How long an instance waits for another one's one-time upgrade work
/// before doing it beside it ([`PgBackend::backfill_turn`]).
const BACKFILL_WAIT: Duration = Duration::from_secs(30);

/// The `application_name` of the connection that LISTENs for wake-ups.
pub const LISTENER_APPLICATION_NAME: &str = "session-store listener";

/// The LISTEN/NOTIFY channel: payload "session:seq", a wake-up only.
pub(crate) const NOTIFY_CHANNEL: &str = "session_store_events";

#[derive(Clone)]
pub(crate) struct PgBackend {
    pool: PgPool,
    /// How to connect, for listeners: each gets a connection of its own,
    /// outside `pool`, so that subscribers (an SSE stream, `tail
    /// --follow`) can never take the connections appends and reads need.
    connect: std::sync::Arc<sqlx::postgres::PgConnectOptions>,
    /// [`StoreOptions::read_deadline`]: the longest one round trip of a
    /// read may take.
    read_deadline: Option<Duration>,
    /// [`StoreOptions::migration_lock_wait`].
    migration_lock_wait: Duration,
    /// [`StoreOptions::create_if_missing`]: whether opening may make the
    /// store's tables in a database that has none.
    create: bool,
}

/// Waits for one round trip at most `deadline` (`None`: as long as the
/// server takes). A server that is stopped or cut off by a network that
/// drops packets gives no error, and sqlx has no read timeout, so without
/// a bound a read waits until the connection breaks, which can take the
/// kernel many minutes (docs/operations.md). A round trip dropped at its
/// deadline leaves its connection waiting for the answer, which sqlx reads
/// before the connection's next statement, so no caller reads another's
/// answer; what the statement does on the server still happens once it
/// runs. For a statement outside a transaction that is the statement's
/// own effect (an append's is an unknown outcome); a `BEGIN`'s would be a
/// transaction nobody knows of, so `BEGIN` has a deadline of its own
/// ([`begin_within`]).
async fn trip<T>(
    deadline: Option<Duration>,
    round_trip: impl std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
) -> Result<T> {
    within(deadline, async {
        round_trip.await.map_err(|e| {
            failed(&e);
            Error::from_sqlx(e)
        })
    })
    .await
}

/// [`trip`] of a round trip that already answers the store's errors (a
/// page decoded as it streams in).
async fn within<T>(
    deadline: Option<Duration>,
    round_trip: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let Some(limit) = deadline else {
        return round_trip.await;
    };
    tokio::time::timeout(limit, round_trip)
        .await
        .unwrap_or_else(|_| Err(no_answer(limit)))
}

/// A round trip's deadline passed.
fn no_answer(limit: Duration) -> Error {
    Error::Unavailable(format!(
        "PostgreSQL did not answer within {} s: the server may be stopped or cut off",
        limit.as_secs_f64()
    ))
}

/// A transaction begun on a pooled connection (with `statement`, or a
/// plain `BEGIN`), within `deadline`.
///
/// sqlx counts a transaction only once the server has answered its
/// `BEGIN`, and rolls back on drop only the transactions it counts. A
/// `BEGIN` given up on at its deadline (the server stopped, not gone) is
/// still run when the server answers again, and its connection went back
/// to the pool inside that transaction, unknown to sqlx: a review saw
/// every third request of an instance fail with "current transaction is
/// aborted" for as long as traffic kept the connection busy, writes run
/// inside a read-only transaction, and a one-call append could have been
/// answered as stored inside a transaction that later rolled back. Which
/// connection it was is not known here (the `BEGIN`'s future owns it), so
/// giving up on a `BEGIN` marks every connection open at that moment to be
/// closed, not reused, when it is next released or handed out
/// ([`opened_before_abandoned`], `pool_options`): after such an outage the
/// pool opens its connections again, once.
///
/// The connection is had first, under a deadline of its own: a wait for
/// one (a busy pool) sends nothing, and giving up on it marks nothing.
/// The `BEGIN` is then sent the way `Pool::begin` sends it
/// (`Transaction::begin`, hidden from sqlx's docs but what its pool
/// calls; sqlx is pinned by Cargo.lock).
async fn begin_within(
    pool: &PgPool,
    deadline: Option<Duration>,
    statement: Option<&'static str>,
) -> Result<Transaction<'static, Postgres>> {
    let conn = trip(deadline, pool.acquire()).await?;
    let begin = Transaction::begin(conn, statement.map(std::borrow::Cow::Borrowed));
    tokio::pin!(begin);
    // Declared after the `BEGIN`'s future, so dropped before it: a caller
    // that gives up while the `BEGIN` is in flight (a timeout, a client
    // gone) marks the abandonment before the connection's release looks
    // for it. sqlx queues no `ROLLBACK` for a `BEGIN` not yet answered, so
    // that connection went back to the pool inside a transaction: later
    // appends on it were acknowledged and never committed (lost at its
    // close), and held the position counter's lock, every writer waiting
    // behind it (a cancellation review's finding).
    let mut unanswered = Abandoned(true);
    let begun = match deadline {
        None => trip(None, begin.as_mut()).await,
        Some(limit) => tokio::select! {
            biased;
            begun = begin.as_mut() => begun.map_err(|e| {
                failed(&e);
                Error::from_sqlx(e)
            }),
            () = tokio::time::sleep(limit) => {
                // Marked before the `BEGIN`'s future (and its connection)
                // is dropped, at this function's end: its release sees
                // the mark.
                begin_abandoned();
                Err(no_answer(limit))
            }
        },
    };
    unanswered.0 = false;
    begun
}

/// Calls [`begin_abandoned`] when dropped armed: a `BEGIN` whose answer
/// its caller stopped waiting for ([`begin_within`]).
struct Abandoned(bool);

impl Drop for Abandoned {
    fn drop(&mut self) {
        if self.0 {
            begin_abandoned();
        }
    }
}

/// Runs `read`, and once more when its own statement failed on a broken
/// connection ([`failed`] marked it: the server restarted or failed over
/// since the connection's last use). A read changes nothing, so the second
/// try, on a connection the pool has pinged or opened since ([`suspect`]),
/// answers what the first would have; without it the first request after
/// a restart failed (docs/design.md, "Connection health"). Any other
/// failure (no connection within the connection timeout, a timeout, a
/// refusal, a bad request), and the second try's, is answered as it is: a
/// read during an outage waits one connection timeout, not two.
pub(crate) async fn again<T, F, Fut>(read: F) -> Result<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let (first, broke) = BROKE
        .scope(std::cell::Cell::new(false), async {
            let result = read().await;
            (result, BROKE.with(std::cell::Cell::get))
        })
        .await;
    match first {
        Err(Error::Unavailable(why)) if broke => {
            debug!(%why, "a read met a broken PostgreSQL connection; reading again");
            read().await
        }
        other => other,
    }
}

tokio::task_local! {
    /// Whether the read [`again`] runs met a broken connection: set by
    /// [`failed`] for the errors the read's own statements return, not for
    /// a ping's inside the pool (which only makes the pool take another
    /// connection) nor for another task's (the first version counted every
    /// failure of the process, and a read during an outage, seeing the
    /// pool's failed attempts, waited out the connection timeout twice).
    static BROKE: std::cell::Cell<bool>;
}

fn decode(row: Row) -> Result<StoredEvent> {
    let (position, session_id, seq, event_id, payload, recorded_at) = row;
    Ok(StoredEvent {
        session_id,
        seq,
        event_id,
        position,
        recorded_at,
        body: EventBody::from_json_text(&payload)
            .map_err(|e| Error::Corrupt(format!("event at position {position}: {e}")))?,
    })
}

/// Connections in the pool.
pub(crate) const MAX_CONNECTIONS: u32 = 8;

/// A pooled connection used this recently is handed out without a ping.
const TRUSTED_IDLE: Duration = Duration::from_secs(1);

/// The pool settings, shared by the store and the bench's raw-insert
/// ceiling. sqlx pings every connection before handing it out (a round trip
/// on every transaction: one in six of a single-event append's). Here only
/// a connection idle for [`TRUSTED_IDLE`] or longer is pinged (a failed ping
/// closes it and another is taken, as before); one used within the last
/// second is trusted. sqlx still pings each connection when it is released,
/// so one that failed during use is closed then. What this gives up: a
/// server restart less than a second after a connection's last use fails
/// the next statement on it, once: a read's is tried again ([`again`]), an
/// append's answers a retryable error (docs/design.md, "Connection
/// health").
///
/// No idle timeout and no lifetime, so sqlx runs no reaper task: in sqlx
/// 0.8.6 that task can read a transiently underflowed idle count (a
/// release racing an acquire) and loop about 10^19 times, a worker thread
/// at 100 % for good (launchbadge/sqlx#3645, fixed upstream by #4289, not
/// in a release this crate uses). A CI run of this suite wedged on it
/// (2026-12-05). Idle connections stay open instead of closing after 10
/// minutes: at most `MAX_CONNECTIONS` a process.
///
/// After a connection fails (a server restart, a failover), the pooled
/// connections opened before it are suspect too: each is pinged when next
/// handed out, for [`SUSPECT_FOR`], however recently it was used
/// ([`suspect`]). Without that, a pool of `MAX_CONNECTIONS` connections to
/// a server that restarted failed that many requests in a row, one on each
/// dead connection, where now the one that found the failure does.
pub(crate) fn pool_options() -> PgPoolOptions {
    pool_health().after_connect(apply_settings)
}

/// The bench's raw-insert ceiling's pool: the store's pool without its
/// settings, which the ceiling sends as startup options of its own
/// ([`ceiling_connect_options`], without `plan_cache_mode`).
#[cfg(feature = "bench")]
pub(crate) fn ceiling_pool_options() -> PgPoolOptions {
    pool_health()
}

/// [`pool_options`] but the settings: the pool's size and its connections'
/// health checks.
fn pool_health() -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(MAX_CONNECTIONS)
        .test_before_acquire(false)
        .idle_timeout(None)
        .max_lifetime(None)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if opened_before_abandoned(meta.age) {
                    return Ok(false);
                }
                if meta.idle_for >= TRUSTED_IDLE || suspect(meta.age) {
                    conn.ping().await.inspect_err(noted)?;
                }
                Ok(true)
            })
        })
        // Before sqlx's ping on release, which would wait for a stopped
        // server's answer to an abandoned `BEGIN` ([`begin_within`]).
        .after_release(|_, meta| Box::pin(async move { Ok(!opened_before_abandoned(meta.age)) }))
}

/// When this process last gave up on a `BEGIN` (at its deadline, or its
/// caller's: [`begin_within`]), in milliseconds since [`EPOCH`] (0:
/// never). Every connection opened before then is closed at its next
/// release or acquire, up to the whole pool reopened, since finding the
/// one left inside a transaction would need sqlx's private transaction
/// status (docs/design.md weighs it).
static ABANDONED_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Records that a `BEGIN` was given up on now, rounded up as
/// [`connection_lost`] does: a connection opened in the same millisecond
/// is closed too.
fn begin_abandoned() {
    let now = u64::try_from(since_epoch().as_millis()).unwrap_or(u64::MAX - 1) + 1;
    ABANDONED_AT.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a connection of age `age` was open when a `BEGIN` was last
/// given up on: it may be inside a transaction sqlx does not know of, and
/// is closed rather than used again. Connections opened since are not.
fn opened_before_abandoned(age: Duration) -> bool {
    match ABANDONED_AT.load(std::sync::atomic::Ordering::Relaxed) {
        0 => false,
        at => age >= since_epoch().saturating_sub(Duration::from_millis(at)),
    }
}

/// How long after a connection failure the connections opened before it
/// are pinged before each use: longer than [`TRUSTED_IDLE`], after which
/// the idle ping covers any still unused.
const SUSPECT_FOR: Duration = Duration::from_secs(5);

/// The instant this process's clock for [`FAILED_AT`] counts from.
static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// When a PostgreSQL connection of this process last failed, in
/// milliseconds since [`EPOCH`] (0: never). One value for every store of
/// the process: another store's failure costs this one a few pings, no
/// more.
static FAILED_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn since_epoch() -> Duration {
    EPOCH.get_or_init(std::time::Instant::now).elapsed()
}

/// Whether `e` is a connection's failure: the connection broke, or the
/// server said it is shutting down or the connection is gone (classes 08
/// and 57P).
fn broken(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
        _ => false,
    }
}

/// Records `e` when it is a connection's failure ([`broken`]).
fn noted(e: &sqlx::Error) {
    if broken(e) {
        connection_lost();
    }
}

/// [`noted`], for the error a statement returns to its caller: a read
/// that [`again`] runs is then tried once more.
fn failed(e: &sqlx::Error) {
    if broken(e) {
        connection_lost();
        let _ = BROKE.try_with(|b| b.set(true));
    }
}

/// Records that a connection to PostgreSQL was lost now (also said by a
/// listener's connection, which is often the first to see a restart). The
/// instant is rounded up, so a connection opened in the same millisecond
/// is suspect too; a later failure is never overwritten by an earlier one
/// racing it.
pub(crate) fn connection_lost() {
    let now = u64::try_from(since_epoch().as_millis()).unwrap_or(u64::MAX - 1) + 1;
    FAILED_AT.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
}

/// A row of a streamed read, its connection's failure [`failed`].
fn watched<R>(row: std::result::Result<R, sqlx::Error>) -> std::result::Result<R, sqlx::Error> {
    row.inspect_err(failed)
}

/// Whether a connection of age `age` was opened before a connection
/// failure of the last [`SUSPECT_FOR`].
fn suspect(age: Duration) -> bool {
    match FAILED_AT.load(std::sync::atomic::Ordering::Relaxed) {
        0 => false,
        at => {
            let since = since_epoch().saturating_sub(Duration::from_millis(at));
            since < SUSPECT_FOR && age > since
        }
    }
}

/// A URL's connection options, judged. The session settings are not among
/// them: every pool runs them on each new connection ([`SETTINGS_SQL`]).
/// Nor is `extra_float_digits`, which sqlx sends by default and a pooler
/// refuses as a startup parameter it does not know: the store reads no
/// floating-point column, and PostgreSQL 12 and later send the shortest
/// exact text of one anyway.
pub(crate) fn connect_options(url: &str) -> Result<PgConnectOptions> {
    Ok(options_of(url)?.extra_float_digits(None))
}

fn options_of(url: &str) -> Result<PgConnectOptions> {
    let refused = |why: String| Error::UrlRefused {
        url: url.to_owned(),
        why,
    };
    let url_text = with_socket_host(url);
    // Parsed here first: the driver logs a parameter it does not know
    // with its value (which may be a password), and its syntax errors are
    // the parser's.
    let parsed = url::Url::parse(&url_text).map_err(|e| {
        let cause = e.to_string();
        refused(match cause.as_str() {
            "empty host" => format!(
                "{cause} (name the host, or the socket's directory as ?host=/DIR)"
            ),
            _ => format!(
                "{cause} (a password or name holding `@`, `:`, `/`, `?`, `#`, `%` or a space must be percent-encoded)"
            ),
        })
    })?;
    // A piece without `=` is most often a value's tail after an unencoded
    // `&` (a password's): not named.
    let query = parsed.query().unwrap_or("");
    if query.split('&').any(|p| !p.is_empty() && !p.contains('=')) {
        return Err(refused(
            "a part of its query has no `=` (a value holding `&`, as a password may, must write it as %26)"
                .to_owned(),
        ));
    }
    if let Some((key, _)) = parsed.query_pairs().find(|(key, _)| !honoured(key)) {
        return Err(refused(format!(
            "the parameter `{key}` is not one the PostgreSQL driver honours (it would be ignored); \
             it takes {}, and `options[NAME]`",
            URL_PARAMETERS.join(", ")
        )));
    }
    let options = PgConnectOptions::from_str(&url_text).map_err(|e| {
        let cause = match e {
            sqlx::Error::Configuration(cause) => cause.to_string(),
            other => other.to_string(),
        };
        // A parameter's value, said by the driver in its own words, but
        // for the name it gives `sslmode` inside.
        refused(match cause.strip_prefix("error with configuration: ") {
            Some(value) => value.replace("`ssl_mode`", "`sslmode`"),
            None => format!("a parameter's value is not valid: {cause}"),
        })
    })?;
    tls_settings(&parsed).map_err(refused)?;
    warn_of_ignored_environment();
    Ok(options)
}

/// The TLS settings the driver would otherwise find wrong only when it
/// connects, and say as a failed connection (exit 4, "try again"): a
/// certificate or key file that cannot be read or holds no PEM block the
/// driver reads (PEM only, and no encrypted key: a file of no certificate
/// made every server's certificate "unknown issuer"), a client certificate
/// without its key, and a `PGSSLMODE` it does not know, which it passes
/// over in silence (connecting as `prefer`).
///
/// Only the files the mode reads are judged, as the driver reads them: the
/// authority's under `verify-ca` and `verify-full`; the client's under
/// those and `require` (under `prefer` only if the server offers TLS,
/// which is not known here: not judged). A variable set for `psql`
/// (`PGSSLROOTCERT=system`) does not stop a URL that does not use it.
fn tls_settings(url: &url::Url) -> std::result::Result<(), String> {
    use sqlx::postgres::PgSslMode;
    /// A file's parameters (the last given wins, as in the driver) and its
    /// environment variable.
    struct File {
        keys: &'static [&'static str],
        variable: &'static str,
    }
    const ROOT: File = File {
        keys: &["sslrootcert", "ssl-root-cert", "ssl-ca"],
        variable: "PGSSLROOTCERT",
    };
    const CERT: File = File {
        keys: &["sslcert", "ssl-cert"],
        variable: "PGSSLCERT",
    };
    const KEY: File = File {
        keys: &["sslkey", "ssl-key"],
        variable: "PGSSLKEY",
    };
    let given = |file: &File| -> Option<(String, String)> {
        url.query_pairs()
            .filter(|(k, _)| file.keys.contains(&k.as_ref()))
            .last()
            .map(|(k, v)| (format!("`{k}`"), v.into_owned()))
            .or_else(|| {
                std::env::var(file.variable)
                    .ok()
                    .map(|v| (format!("{} (in the environment)", file.variable), v))
            })
    };
    let in_url = url
        .query_pairs()
        .filter(|(k, _)| k == "sslmode" || k == "ssl-mode")
        .last()
        .map(|(_, v)| v.into_owned());
    let mode = match in_url {
        // Judged by the driver already (options_with).
        Some(mode) => mode.parse::<PgSslMode>().unwrap_or_default(),
        None => match std::env::var("PGSSLMODE") {
            Ok(mode) => mode.parse::<PgSslMode>().map_err(|_| {
                format!(
                    "PGSSLMODE (in the environment) is {mode:?}, not a mode the driver knows (disable, allow, prefer, require, verify-ca, verify-full): it would connect as `prefer`"
                )
            })?,
            Err(_) => PgSslMode::Prefer,
        },
    };
    let verifies = matches!(mode, PgSslMode::VerifyCa | PgSslMode::VerifyFull);
    if verifies {
        if let Some((named_by, value)) = given(&ROOT) {
            if value == "system" {
                return Err(format!(
                    "{named_by} is libpq's `system` (the system's certificate store), which the driver does not read: leave it out to check the certificate against the public authorities built into the binary, or name the authority's PEM file"
                ));
            }
            pem_file(
                &named_by,
                &value,
                &["-----BEGIN CERTIFICATE-----"],
                "certificate",
            )?;
        }
    }
    if verifies || matches!(mode, PgSslMode::Require) {
        match (given(&CERT), given(&KEY)) {
            (Some((cert_by, cert)), Some((key_by, key))) => {
                pem_file(
                    &cert_by,
                    &cert,
                    &["-----BEGIN CERTIFICATE-----"],
                    "certificate",
                )?;
                let blocks = [
                    "-----BEGIN PRIVATE KEY-----",
                    "-----BEGIN RSA PRIVATE KEY-----",
                    "-----BEGIN EC PRIVATE KEY-----",
                ];
                pem_file(&key_by, &key, &blocks, "private key").map_err(|e| {
                    match pem_file(&key_by, &key, &["-----BEGIN ENCRYPTED PRIVATE KEY-----"], "") {
                        Ok(()) => format!(
                            "{key_by} names an encrypted private key, which the driver cannot decrypt (it takes no key password): decrypt it (openssl pkey -in KEY -out PLAIN) into a file only the store's user may read"
                        ),
                        Err(_) => e,
                    }
                })?;
            }
            (Some((by, _)), None) | (None, Some((by, _))) => {
                return Err(format!(
                    "{by} is given alone: a client certificate (`sslcert`) and its key (`sslkey`) go together"
                ));
            }
            (None, None) => {}
        }
    }
    Ok(())
}

/// Whether `value` (a path, or PEM text given inline as the driver takes
/// it) holds one of the PEM `blocks`; said as the problem where not.
fn pem_file(
    named_by: &str,
    value: &str,
    blocks: &[&str],
    kind: &str,
) -> std::result::Result<(), String> {
    let trimmed = value.trim();
    let text = if trimmed.starts_with("-----BEGIN") && trimmed.ends_with("-----") {
        value.as_bytes().to_vec()
    } else {
        let path = std::path::Path::new(value);
        match std::fs::metadata(path) {
            Ok(m) if !m.is_file() => {
                return Err(format!("{named_by} names {path:?}, which is not a file"));
            }
            Ok(m) if m.len() > 16 << 20 => {
                return Err(format!(
                    "{named_by} names {path:?}, of {} bytes: not a PEM {kind} file",
                    m.len()
                ));
            }
            Ok(_) => std::fs::read(path),
            Err(e) => Err(e),
        }
        .map_err(|e| format!("{named_by} names {path:?}, which cannot be read ({e})"))?
    };
    let text = String::from_utf8_lossy(&text);
    if blocks.iter().any(|b| text.contains(b)) {
        return Ok(());
    }
    Err(format!(
        "{named_by} names {}, which holds no PEM {kind} (a block `{}`; the driver reads PEM only)",
        match trimmed.starts_with("-----BEGIN") {
            true => "PEM text".to_owned(),
            false => format!("{value:?}"),
        },
        blocks[0]
    ))
}

/// Says once a process (a warning) which of libpq's environment variables
/// that are set the driver does not read: a `PGTARGETSESSIONATTRS` or
/// `PGCHANNELBINDING` meant for this process has no effect. Not refused:
/// the environment may be set for other programs (psql) too.
fn warn_of_ignored_environment() {
    const IGNORED: &[&str] = &[
        "PGCONNECT_TIMEOUT",
        "PGTARGETSESSIONATTRS",
        "PGCHANNELBINDING",
        "PGREQUIREAUTH",
        "PGREQUIRESSL",
        "PGSSLCRL",
        "PGSSLCRLDIR",
        "PGSSLMINPROTOCOLVERSION",
        "PGSSLMAXPROTOCOLVERSION",
        "PGSSLNEGOTIATION",
        "PGSSLPASSWORD",
        "PGGSSENCMODE",
        "PGSERVICE",
        "PGSERVICEFILE",
        "PGLOADBALANCEHOSTS",
    ];
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        let set: Vec<&str> = IGNORED
            .iter()
            .copied()
            .filter(|v| std::env::var_os(v).is_some())
            .collect();
        if !set.is_empty() {
            warn!(
                variables = %set.join(", "),
                "libpq environment variables set here are not read by the PostgreSQL driver and have no effect (docs/operations.md, \"Connecting to PostgreSQL\")"
            );
        }
    });
}

/// The query parameters of a PostgreSQL URL that sqlx's driver reads. It
/// passes over any other with a log line only, so a URL asking for
/// `channel_binding=require` or `target_session_attrs=read-write` would
/// connect without them: refused instead.
const URL_PARAMETERS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "application_name",
    "options",
    "statement-cache-capacity",
    "ssl-mode",
    "ssl-root-cert",
    "ssl-ca",
    "ssl-cert",
    "ssl-key",
];

fn honoured(key: &str) -> bool {
    URL_PARAMETERS.contains(&key) || (key.starts_with("options[") && key.ends_with(']'))
}

/// The names of `url`'s query parameters, as written.
fn url_parameters(url: &str) -> impl Iterator<Item = &str> {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let query = query.split_once('#').map_or(query, |(q, _)| q);
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').map_or(p, |(key, _)| key))
}

/// libpq's `postgres://user@/db?host=/socket/dir` (no host: the socket
/// directory is the parameter's) fails the URL parser, which wants a host
/// after user info. Given a `host` parameter, the empty host is written
/// `localhost`, which the parameter then replaces.
fn with_socket_host(url: &str) -> std::borrow::Cow<'_, str> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.into();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, host_port) = match authority.rsplit_once('@') {
        Some((userinfo, host_port)) => (Some(userinfo), host_port),
        None => (None, authority),
    };
    // No host before the port (`u@:5433`, `u@`), and a `host` parameter.
    let no_host = host_port.is_empty() || host_port.starts_with(':');
    if !no_host || userinfo.is_none() && host_port.is_empty() {
        // `postgres:///db?host=…` the parser takes as it is.
        return url.into();
    }
    if !url_parameters(url).any(|key| key == "host") {
        return url.into();
    }
    let userinfo = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
    format!("{scheme}://{userinfo}localhost{host_port}{tail}").into()
}

/// The settings of the bench's raw-insert ceiling: the same timeouts, but
/// PostgreSQL's default plan caching. Forced custom plans re-plan every
/// execution (the store needs them for its reads, see `SESSION_SETTINGS`);
/// a bare `INSERT` does not, and the ceiling should be the best a raw
/// insert does (0.21 instead of 0.32 ms per single-row insert here).
#[cfg(feature = "bench")]
pub(crate) fn ceiling_connect_options(url: &str) -> Result<PgConnectOptions> {
    // Startup options: the ceiling's connections are made once each,
    // directly to the bench's own server (the startup options are split
    // at spaces; a backslash keeps a value whole).
    let settings = SESSION_SETTINGS
        .iter()
        .filter(|(name, _)| *name != "plan_cache_mode")
        .map(|(name, value)| (*name, value.replace(' ', "\\ ")));
    Ok(options_of(url)?.options(settings))
}

impl PgBackend {
    pub(crate) async fn connect(url: &str, options: &StoreOptions) -> Result<PgBackend> {
        let connect = connect_options(url)?;
        let pool = pool_options()
            .acquire_timeout(Duration::from_secs(
                options
                    .connect_timeout_secs
                    .clamp(1, super::MAX_CONNECT_SECS),
            ))
            .connect_with(connect.clone())
            .await;
        match pool {
            Ok(pool) => Ok(PgBackend {
                pool,
                connect: std::sync::Arc::new(connect),
                read_deadline: options.read_deadline,
                migration_lock_wait: options.migration_lock_wait,
                create: options.create_if_missing,
            }),
            Err(sqlx::Error::PoolTimedOut) => {
                // The pool's timeout hides why each attempt failed: one
                // more attempt of our own says it (refused, unknown host,
                // bad password…).
                let at = format!("{}:{}", connect.get_host(), connect.get_port());
                // With the settings the pool runs on each connection: one
                // the server refuses (a version without it) fails every
                // pooled connection, and is the cause to say.
                let attempt = async {
                    let mut conn = sqlx::postgres::PgConnection::connect_with(&connect).await?;
                    sqlx::Executor::execute(&mut conn, SETTINGS_SQL.as_str()).await?;
                    Ok::<_, sqlx::Error>(conn)
                };
                let cause = match tokio::time::timeout(Duration::from_secs(2), attempt).await {
                    Ok(Err(e)) => match Error::from_sqlx(e) {
                        Error::Unavailable(m) | Error::Database(m) => m,
                        other => other.to_string(),
                    },
                    Ok(Ok(_)) => "it answered only after the connect timeout".to_owned(),
                    Err(_) => "no answer within the connect timeout".to_owned(),
                };
                Err(Error::Unavailable(format!(
                    "cannot connect to PostgreSQL at {at}: {cause}"
                )))
            }
            Err(e) => Err(match Error::from_sqlx(e) {
                Error::Unavailable(m) | Error::Database(m) => {
                    Error::Unavailable(format!("cannot connect to PostgreSQL: {m}"))
                }
                other => other,
            }),
        }
    }

    /// Applies what is pending; returns the migration the store was at
    /// before (0: no store yet), as read under the migration lock.
    pub(crate) async fn migrate(&self) -> Result<i64> {
        // Every open migrates; almost always there is nothing to apply.
        // That is checked first in one bounded read, so that a server that
        // stops answering during an open is said within the read deadline
        // (sqlx's migrator takes an advisory lock and reads its table with
        // no bound). Only a store with migrations to apply, or with ones
        // this build does not know (which the migrator refuses, naming
        // them), goes through the migrator, whose statements may run long.
        // Versions and checksums, as the migrator compares them: a
        // migration changed since it was applied is its to refuse.
        // Which of the store's relations the schema the migrations write to
        // (`current_schema()`, where their unqualified names go) already
        // holds, the migrator's table among them. Looked up there only: a
        // table of the same name in another schema on the `search_path`
        // (`public.events` beside a store in a schema of its own) is not
        // the store's.
        let present: Vec<String> = trip(
            self.read_deadline,
            sqlx::query_scalar(
                "SELECT c.relname::text FROM pg_class c \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = current_schema() AND c.relname = ANY($1) ORDER BY 1",
            )
            .bind(&STORE_RELATIONS[..])
            .fetch_all(&self.pool),
        )
        .await?;
        let applied: Option<Vec<(i64, Vec<u8>)>> =
            match present.iter().any(|t| t == "_sqlx_migrations") {
                // Any failure to read it (a role without the right to) is
                // said as itself, not taken for a database without a store.
                true => Some(
                    trip(
                        self.read_deadline,
                        sqlx::query_as(
                            "SELECT version, checksum FROM _sqlx_migrations WHERE success ORDER BY version",
                        )
                        .fetch_all(&self.pool),
                    )
                    .await?,
                ),
                // No table yet (a new database): the migrator makes it.
                false => None,
            };
        let known: Vec<(i64, Vec<u8>)> = MIGRATOR
            .iter()
            .map(|m| (m.version, m.checksum.to_vec()))
            .collect();
        if applied.as_ref() == Some(&known) {
            return Ok(latest_migration());
        }
        if applied.is_none() {
            let db = self.connect.get_database().unwrap_or("postgres");
            let (host, port) = (self.connect.get_host(), self.connect.get_port());
            // A schema without the migrator's table holds no store: a
            // table of the store's name there is another application's,
            // which the first migration would fail on (said as a database
            // error, exit 4) after making `_sqlx_migrations` beside it.
            if !present.is_empty() {
                return Err(Error::NotAStore(format!(
                    "the PostgreSQL database {db:?} at {host}:{port} is not a session store: its schema has no record of the store's migrations but already holds {} of the names the store's tables take; it was left unchanged",
                    present.join(", ")
                )));
            }
            // As for a SQLite path that names no store: a command that only
            // reads does not make the store's tables in a database that has
            // none (another application's, a mistyped name), and says so.
            if !self.create {
                return Err(Error::NotAStore(format!(
                    "there is no session store in the PostgreSQL database {db:?} at {host}:{port}: it has none of the store's tables, and this command only reads (import, append, migrate, serve and tail --follow make them)"
                )));
            }
        }
        // On a connection of its own without the statement timeout: a
        // migration that builds an index reads the whole log, which on a
        // large store takes longer than any one statement of the store's
        // may (30 s). The lock timeout stays: a migration waiting on a
        // lock that others then queue behind is said, not waited on.
        let mut conn = self.detached().await?;
        let result = async {
            // The round trips before the migrator's are bounded as reads
            // are: a server that stops answering while this instance waits
            // for another one's migration is said, not waited on.
            trip(
                self.read_deadline,
                sqlx::query("SET statement_timeout = 0").execute(&mut conn),
            )
            .await?;
            // One instance migrates at a time. The migrator's own lock is
            // a blocking `pg_advisory_lock`, and an instance blocked in it
            // is a statement in progress, which `CREATE INDEX
            // CONCURRENTLY` (0009) waits for while the instance waits for
            // the lock holder: a deadlock, one of them refused. So this
            // lock is asked for without blocking, again every 200 ms, and
            // only its holder goes on to the migrator's (then free).
            let doing = "migrating the PostgreSQL database";
            let wait = self.migration_lock_wait;
            if !self
                .take_turn(&mut conn, MIGRATION_LOCK, false, doing, wait)
                .await?
            {
                return Err(Error::Unavailable(format!(
                    "another instance has been {doing} for {} s (or stopped while it held \
                     its lock); try again once it is done",
                    wait.as_secs()
                )));
            }
            repair_cut_off_builds(&mut conn, self.read_deadline).await?;
            // Where the store is now, under the lock: another instance
            // may have migrated it since the read above.
            let table: bool = trip(
                self.read_deadline,
                sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_class c \
                     JOIN pg_namespace n ON n.oid = c.relnamespace \
                     WHERE n.nspname = current_schema() AND c.relname = '_sqlx_migrations')",
                )
                .fetch_one(&mut conn),
            )
            .await?;
            let from = match table {
                true => {
                    let applied: Vec<i64> = trip(
                        self.read_deadline,
                        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                            .fetch_all(&mut conn),
                    )
                    .await?;
                    super::migrated_through(&MIGRATOR, &applied)
                }
                false => 0,
            };
            MIGRATOR
                .run_direct(&mut conn)
                .await
                .map_err(|e| Error::from_migration("PostgreSQL", e))?;
            Ok(from)
        }
        .await;
        // Its settings are not the store's: closed, not returned (which
        // also releases the lock).
        Self::end_turn(conn).await;
        result
    }

    /// A connection of its own holding the backfill lock: one instance at
    /// a time does the one-time work of an upgrade (chaining, activation
    /// changes) in a schema, the others wait for it here, asking every
    /// 200 ms, without holding the position counter. When each instance
    /// that opened the store meanwhile took its turns at the work,
    /// transaction by transaction, the work took three times as long (28 s
    /// alone, 85 s for two processes, measured 2026-12-07) and each command
    /// waited for all of it. The wait is bounded by [`BACKFILL_WAIT`]:
    /// past it (`None`) the instance does the work beside the holder,
    /// transaction by transaction as before, which is correct (each
    /// transaction holds the write lock and takes only what is still
    /// listed), so a holder frozen or cut off while it keeps its
    /// connection cannot stop every open for longer. Closed by
    /// [`PgBackend::end_turn`] (or dropped: the server releases the lock
    /// with the connection).
    pub(crate) async fn backfill_turn(&self) -> Result<Option<sqlx::PgConnection>> {
        let mut conn = self.detached().await?;
        let doing = "doing the one-time work of an upgrade";
        let wait = BACKFILL_WAIT.min(self.migration_lock_wait);
        match self
            .take_turn(&mut conn, BACKFILL_LOCK, true, doing, wait)
            .await
        {
            Ok(true) => Ok(Some(conn)),
            Ok(false) => {
                tracing::info!(
                    waited_s = wait.as_secs(),
                    "another instance is still doing the one-time work of an upgrade: doing it beside it"
                );
                Self::end_turn(conn).await;
                Ok(None)
            }
            Err(e) => {
                Self::end_turn(conn).await;
                Err(e)
            }
        }
    }

    /// Takes the advisory lock `key` on `conn` (with `per_schema`, the
    /// key of `current_schema()`'s: stores in two schemas of a database do
    /// not wait for each other), asking without blocking every 200 ms for
    /// at most `wait` (logging every 10 s) while another instance is
    /// `doing` what the lock guards; false when the wait ran out. Never a
    /// blocking `pg_advisory_lock`: an instance blocked in it is a
    /// statement in progress, which `CREATE INDEX CONCURRENTLY` waits for
    /// while the instance waits for the holder.
    async fn take_turn(
        &self,
        conn: &mut sqlx::PgConnection,
        key: i64,
        per_schema: bool,
        doing: &str,
        wait: Duration,
    ) -> Result<bool> {
        let sql = match per_schema {
            true => {
                "SELECT pg_try_advisory_lock($1 # hashtext(coalesce(current_schema(), ''))::bigint)"
            }
            false => "SELECT pg_try_advisory_lock($1)",
        };
        let started = std::time::Instant::now();
        let mut said = started;
        while !trip(
            self.read_deadline,
            sqlx::query_scalar::<_, bool>(sql)
                .bind(key)
                .fetch_one(&mut *conn),
        )
        .await?
        {
            if started.elapsed() >= wait {
                return Ok(false);
            }
            if said.elapsed() >= Duration::from_secs(10) {
                tracing::info!("waiting for another instance that is {doing}");
                said = std::time::Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(true)
    }

    /// A connection taken out of the pool for good, for a session-level
    /// advisory lock (the migration's, the backfill's) or settings that are
    /// not the store's: it must not go back to the pool holding either,
    /// and is closed by [`PgBackend::end_turn`].
    async fn detached(&self) -> Result<sqlx::PgConnection> {
        Ok(self
            .pool
            .acquire()
            .await
            .map_err(Error::from_sqlx)?
            .detach())
    }

    /// Ends a [`PgBackend::detached`] connection (a migration's, a
    /// [`PgBackend::backfill_turn`]): closed, its locks going with it, not
    /// returned to the pool; a server that stopped answering is not waited
    /// for.
    pub(crate) async fn end_turn(conn: sqlx::PgConnection) {
        let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
    }

    pub(crate) async fn begin_write(&self) -> Result<PgTx> {
        // The transaction, then the counter's lock; the counter's value is
        // read later, by the group's read-ahead or when positions are
        // reserved. Two round trips, not one: sent as one message
        // (`begin_with("BEGIN; SELECT … FOR UPDATE")`), a lock that fails
        // (lock or statement timeout, a cancel) leaves the server inside
        // the aborted transaction while sqlx, which counts the transaction
        // only once its `BEGIN` succeeded, sends no `ROLLBACK` and hands the
        // connection back to the pool: every statement on it then failed
        // until the server's idle-in-transaction timeout (a review's
        // finding, tests/faults.rs). Begun apart, the transaction is
        // sqlx's, and a failed lock rolls back with it.
        // A `BEGIN` that fails has written nothing: tried again as a read.
        let mut tx = again(|| begin_within(&self.pool, self.read_deadline, None)).await?;
        // Waiting for the lock behind another writer is healthy, and the
        // server bounds it ([`LOCK_COUNTER`]); the client's bound comes on
        // top of that, for a server that stops answering.
        trip(
            self.read_deadline.map(|d| d + LOCK_TIMEOUT),
            sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(LOCK_COUNTER)),
        )
        .await
        .map_err(counter_not_had)?;
        // Each round trip of a write is bounded as a read's is: `rebuild`
        // and the backfills at open have no other bound, and an append's
        // own deadline (when set) is no shorter.
        let mut tx = PgTx::new(tx);
        tx.deadline = self.read_deadline;
        Ok(tx)
    }

    /// A transaction that takes no lock and reads nothing: the group
    /// commit's optimistic path (`group::optimistic`).
    pub(crate) fn optimistic(&self) -> PgTx {
        let mut tx = PgTx::with(PgConn::Optimistic(self.pool.clone()));
        tx.deadline = self.read_deadline;
        tx
    }

    /// A read transaction: one snapshot (REPEATABLE READ) for the view,
    /// window and tail; it takes no lock.
    pub(crate) async fn begin_read(&self) -> Result<PgTx> {
        let tx = again(|| {
            begin_within(
                &self.pool,
                self.read_deadline,
                Some("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"),
            )
        })
        .await?;
        let mut tx = PgTx::new(tx);
        tx.deadline = self.read_deadline;
        Ok(tx)
    }

    pub(crate) async fn head_seq(&self, session_id: Uuid) -> Result<i64> {
        again(|| head_seq(&self.pool, self.read_deadline, session_id)).await
    }

    /// The seq of one event of the session, if the log has it.
    pub(crate) async fn seq_of(&self, session_id: Uuid, event_id: Uuid) -> Result<Option<i64>> {
        again(|| {
            trip(
                self.read_deadline,
                sqlx::query_scalar(
                    "SELECT seq FROM events WHERE event_id = $1 AND session_id = $2",
                )
                .bind(event_id)
                .bind(session_id)
                .fetch_optional(&self.pool),
            )
        })
        .await
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
        let bounded = max_bytes != usize::MAX;
        let sql = session_page(bounded);
        again(|| async {
            let mut query = sqlx::query_as::<_, Row>(&sql)
                .bind(session_id)
                .bind(after)
                .bind(i64::MAX)
                .bind(limit);
            if bounded {
                query = query.bind(byte_bound(max_bytes));
            }
            let mut rows = query.fetch(&self.pool).map(watched);
            within(
                self.read_deadline,
                super::take_within(&mut rows, max_bytes, |r: &Row| r.4.len(), decode),
            )
            .await
        })
        .await
    }

    /// The session's view and the events from its window start on (at
    /// most the window and `after` more), in one statement: the cold
    /// pre-request read, one round trip instead of two. A window longer
    /// than `max_window` is left out: only the (at most `after`) events
    /// after the view come. `None` when the session has no view.
    pub(crate) async fn view_and_window(
        &self,
        session_id: Uuid,
        after: i64,
        read: super::WindowRead,
    ) -> Result<super::WindowRead> {
        again(|| self.view_and_window_once(session_id, after, read.clone())).await
    }

    async fn view_and_window_once(
        &self,
        session_id: Uuid,
        after: i64,
        mut read: super::WindowRead,
    ) -> Result<super::WindowRead> {
        use tokio_stream::StreamExt;
        // The view as JSON in a row of its own (the last column set), then
        // the events, each part from the same snapshot. The server leaves
        // out the events past the byte bound ([`bounded_page`]'s running
        // sum, of the events after the view, or of all of them when the
        // window's count too), so a cut read does not carry the rest over
        // the wire.
        let max_window = read.max_window();
        let mut rows = sqlx::query_as::<_, ViewOrEvent>(
            "SELECT 0::BIGINT, v.session_id, 0::BIGINT, v.session_id, '', now(), \
                     json_build_array(v.refresh_seq, v.mode, v.window_start, v.compaction_seq, \
                       v.summary, v.catalogs, v.evidence, v.active)::TEXT \
                   FROM session_views v WHERE v.session_id = $1 \
                 UNION ALL \
                 SELECT e.position, e.session_id, e.seq, e.event_id, e.payload, e.recorded_at, NULL \
                   FROM session_views v CROSS JOIN LATERAL \
                     (SELECT position, session_id, seq, event_id, payload, recorded_at, \
                             COALESCE(SUM(CASE WHEN $4 OR seq > v.refresh_seq \
                                               THEN octet_length(payload) ELSE 0 END) \
                               OVER (ORDER BY seq ROWS BETWEEN UNBOUNDED PRECEDING \
                                                       AND 1 PRECEDING), 0) AS before \
                        FROM events \
                      WHERE session_id = $1 \
                        AND seq >= CASE WHEN v.refresh_seq - v.window_start + 1 > $3 \
                                        THEN v.refresh_seq + 1 ELSE v.window_start END \
                      ORDER BY seq \
                      LIMIT CASE WHEN v.refresh_seq - v.window_start + 1 > $3 THEN $2 \
                                 ELSE GREATEST(0, v.refresh_seq - v.window_start + 1 + $2) END) AS e \
                   WHERE v.session_id = $1 AND e.before < GREATEST($5, 1)"
        )
        .bind(session_id)
        .bind(after)
        .bind(max_window)
        .bind(read.window_too())
        .bind(byte_bound(read.max_bytes()))
        .fetch(&self.pool).map(watched);
        let mut events = Vec::new();
        within(self.read_deadline, async {
            while let Some(row) = rows.next().await {
                let (p, s, q, e, payload, t, json) = row.map_err(Error::from_sqlx)?;
                let Some(json) = json else {
                    let len = payload.len();
                    events.push((p, s, q, e, payload, t));
                    if !read.admit(q, len) {
                        break;
                    }
                    continue;
                };
                let columns: ViewColumns = serde_json::from_str(&json).map_err(|e| {
                    Error::Corrupt(format!(
                        "the view of session {session_id} could not be read: {e}"
                    ))
                })?;
                read.view = Some(ViewRow::from_columns(session_id, columns));
            }
            Ok(())
        })
        .await?;
        drop(rows);
        read.events = events.into_iter().map(decode).collect::<Result<_>>()?;
        // Each part comes in its own order; the events in seq order (a
        // page is only cut when they came so).
        read.events.sort_by_key(|e| e.seq);
        Ok(read)
    }

    /// Up to `limit` events of every session after `position`, and none
    /// after the one that brings the payloads to `max_bytes`.
    /// [`crate::Store::tenants`]: each tenant with its number of sessions.
    pub(crate) async fn tenants(&self) -> Result<Vec<(String, i64)>> {
        again(|| async {
            trip(
                self.read_deadline,
                sqlx::query_as(&super::TENANTS_SQL.replace('?', "$1"))
                    .bind(super::DEFAULT_TENANT)
                    .fetch_all(&self.pool),
            )
            .await
        })
        .await
    }

    pub(crate) async fn feed(
        &self,
        after: i64,
        limit: i64,
        max_bytes: usize,
    ) -> Result<Vec<StoredEvent>> {
        let sql = bounded_page(COLUMNS, "position > $1", "position", "$2", "$3");
        again(|| async {
            let mut rows = sqlx::query_as::<_, Row>(&sql)
                .bind(after)
                .bind(limit)
                .bind(byte_bound(max_bytes))
                .fetch(&self.pool)
                .map(watched);
            within(
                self.read_deadline,
                super::take_within(&mut rows, max_bytes, |r: &Row| r.4.len(), decode),
            )
            .await
        })
        .await
    }

    /// A pool of one connection for one listener (see `connect`), made
    /// for each listener and kept by it: a new listener never waits for
    /// the connection of one given up on (src/store/subscribe.rs).
    pub(crate) fn listener_pool(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(5))
            .idle_timeout(None)
            .max_lifetime(None)
            .after_connect(apply_settings)
            // Named, so that an operator (and a test) tells it apart in
            // pg_stat_activity: its last query is a ping, not `LISTEN`.
            .connect_lazy_with(
                (*self.connect)
                    .clone()
                    .application_name(LISTENER_APPLICATION_NAME),
            )
    }

    /// Runs an audit query that selects event rows (src/store/query.rs),
    /// decoding rows until their payloads reach `max_bytes` (true: the
    /// bytes stopped it). The query stops there itself (query.rs's
    /// `pg_within`); any rows after would be read off the connection and
    /// dropped one by one, not held.
    pub(crate) async fn fetch_events(
        &self,
        query: impl Fn() -> sqlx::QueryBuilder<'static, Postgres>,
        max_bytes: usize,
    ) -> Result<(Vec<StoredEvent>, bool)> {
        again(|| async {
            let mut q = query();
            let mut rows = q.build_query_as::<Row>().fetch(&self.pool).map(watched);
            within(
                self.read_deadline,
                super::take_within_cut(&mut rows, max_bytes, |r: &Row| r.4.len(), decode),
            )
            .await
        })
        .await
    }

    /// Runs an audit query that selects `activation_changes` rows.
    pub(crate) async fn fetch_changes(
        &self,
        query: impl Fn() -> sqlx::QueryBuilder<'static, Postgres>,
    ) -> Result<Vec<ChangeRow>> {
        let rows: Vec<PgChange> = again(|| async {
            let mut q = query();
            trip(self.read_deadline, q.build_query_as().fetch_all(&self.pool)).await
        })
        .await?;
        Ok(rows.into_iter().map(decode_change).collect())
    }

    /// The `EXPLAIN` lines of a query.
    pub(crate) async fn fetch_plan(
        &self,
        query: impl Fn() -> sqlx::QueryBuilder<'static, Postgres>,
    ) -> Result<Vec<String>> {
        let rows: Vec<(String,)> = again(|| async {
            let mut q = query();
            trip(self.read_deadline, q.build_query_as().fetch_all(&self.pool)).await
        })
        .await?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    /// Runs an audit query that selects session ids.
    pub(crate) async fn fetch_sessions(
        &self,
        query: impl Fn() -> sqlx::QueryBuilder<'static, Postgres>,
    ) -> Result<Vec<Uuid>> {
        let rows: Vec<(Uuid,)> = again(|| async {
            let mut q = query();
            trip(self.read_deadline, q.build_query_as().fetch_all(&self.pool)).await
        })
        .await?;
        Ok(rows.into_iter().map(|(s,)| s).collect())
    }

    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }
}

async fn head_seq<'e, E: sqlx::PgExecutor<'e>>(
    ex: E,
    deadline: Option<Duration>,
    session_id: Uuid,
) -> Result<i64> {
    let (seq,): (i64,) = trip(
        deadline,
        sqlx::query_as("SELECT COALESCE(MAX(seq), 0)::BIGINT FROM events WHERE session_id = $1")
            .bind(session_id)
            .fetch_one(ex),
    )
    .await?;
    Ok(seq)
}

/// A write transaction holding the position counter's row lock.
///
/// Why it reads ahead and writes late: a group commit (`group`) judges and
/// writes its appends one after another, and each statement is a round
/// trip to the server while the store-wide counter lock is held. So the
/// transaction reads the heads and stored ids of the whole group in one
/// statement (`prefetch`), keeps each session's head current as batches
/// are accepted, and buffers the accepted writes (`write_accepted`) until
/// the commit, or until a read that could see them: a read about a session
/// with buffered writes, or any read not about one session, sends them
/// first (`flush`). Other sessions' reads do not, so a group of appends to
/// distinct sessions costs one read and one write statement in all.
/// Correct because the counter lock is held: nobody else writes meanwhile,
/// so what was read ahead stays true except for this transaction's own
/// writes, which the transaction tracks.
pub(crate) struct PgTx {
    conn: PgConn,
    /// Sessions the judgement was told to assume (`assume`): their heads,
    /// checked by the optimistic write.
    assumed: Vec<(Uuid, i64)>,
    /// Owners known from the cache (`assume`).
    owners: HashMap<Uuid, String>,
    /// Calls index keys the optimistic judgement took as absent, checked
    /// by its write.
    absent_calls: Vec<(Uuid, String)>,
    /// The counter's value under the lock, plus what was reserved; `None`
    /// until read.
    last: Option<i64>,
    /// Positions reserved but not yet added to the stored counter: the next
    /// insert adds them in its own statement, saving a round trip.
    unwritten: i64,
    /// Heads (seq, hash) known exactly: read ahead or written here.
    heads: HashMap<Uuid, (i64, Option<String>)>,
    /// Event ids whose stored rows were read ahead (into `prefetched` when
    /// stored).
    asked: HashSet<Uuid>,
    prefetched: HashMap<Uuid, StoredEvent>,
    /// Event ids this transaction wrote, sent or not: what was read ahead
    /// about them is out of date.
    written: HashSet<Uuid>,
    /// Accepted writes not yet sent.
    buffered: Buffered,
    /// Views read ahead (`None`: the session has none), until this
    /// transaction writes the session.
    views: HashMap<Uuid, Option<ViewRow>>,
    /// Calls index rows asked for ahead (session, call id), until this
    /// transaction writes the session, and those found.
    calls_asked: HashSet<(Uuid, String)>,
    calls_found: HashMap<(Uuid, String), CallRow>,
    /// The longest one round trip may take: the store's read deadline
    /// ([`StoreOptions::read_deadline`]), in a read snapshot and in a
    /// write alike; `None` for the optimistic append, whose one call an
    /// append's own deadline bounds.
    deadline: Option<Duration>,
}

/// The writes of accepted batches not yet sent, merged so that one
/// statement can send them (an upsert may touch each row only once).
#[derive(Default)]
struct Buffered {
    /// Sessions with buffered writes.
    sessions: HashSet<Uuid>,
    /// Event ids of the buffered rows.
    ids: HashSet<Uuid>,
    rows: Vec<PendingRow>,
    /// Calls index rows, the latest per (session, call id).
    calls: Vec<(Uuid, CallRow)>,
    call_index: HashMap<(Uuid, String), usize>,
    /// The latest view of each session.
    views: HashMap<Uuid, ViewRow>,
    owners: Vec<(Uuid, String)>,
    wakeups: Vec<String>,
    changes: Vec<ChangeRow>,
}

/// Where a [`PgTx`] sends its statements.
enum PgConn {
    /// A transaction holding the counter's lock (or a read snapshot).
    Locked(Transaction<'static, Postgres>),
    /// No transaction: reads are answered from what `assume` was given,
    /// and the writes go in one autocommitted call at the commit.
    Optimistic(PgPool),
}

/// Why an optimistic group was not committed.
pub(crate) enum OptimisticMiss {
    /// The call's checks refused it (a head moved, a call id or an event id
    /// is stored): nothing was written.
    Rejected(String),
    /// The call failed otherwise: a connection's failure or a call cut off
    /// by the deadline (it may have committed: told as an unknown outcome),
    /// or another error of the database (told as it is).
    Failed(Error),
    /// The call never went out (no connection could be had from the pool)
    /// or the server said it failed before it committed (a full disk, a
    /// lock or statement timeout, a serialization failure): nothing was
    /// written, and the group's appends are told so, not that their
    /// outcome is unknown.
    NotStored(Error),
}

/// Whether the server's error ends an autocommitted statement before its
/// commit: the statement ran out of a resource (class 53: a full disk,
/// memory), was cancelled by its timeout (57014) or a lock timeout
/// (55P03), or lost a serialization conflict or a deadlock (40001,
/// 40P01); the transaction is rolled back. A connection's failure (class
/// 08, a shutdown's 57P) may come after the commit, and a pooler may
/// report a lost server connection as an error of its own: those stay
/// unknown.
fn ended_before_commit(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    let code = db.code().unwrap_or_default();
    code.starts_with("53") || ["57014", "55P03", "40001", "40P01"].contains(&code.as_ref())
}

/// The error of an append's commit (a `COMMIT`, or the optimistic call
/// that commits as it runs). An error the server answered with ended the
/// statement, which then did not commit: said as it is ([`Error::from_sqlx`]).
/// Anything else (a lost connection, a reply that could not be read or
/// decoded) may have come after the commit: [`Error::OutcomeUnknown`].
fn commit_error(e: sqlx::Error) -> Error {
    noted(&e);
    if matches!(e, sqlx::Error::Database(_)) {
        return Error::from_sqlx(e);
    }
    match Error::from_sqlx(e) {
        Error::Unavailable(m) | Error::Database(m) => Error::OutcomeUnknown(m),
        other => Error::OutcomeUnknown(other.to_string()),
    }
}

/// `f`, unless `until` (a limit and the instant it ends) passes first:
/// then the limit, for the caller's message.
async fn before<T>(
    until: Option<(Duration, tokio::time::Instant)>,
    f: impl std::future::Future<Output = T>,
) -> std::result::Result<T, Duration> {
    match until {
        None => Ok(f.await),
        Some((limit, at)) => tokio::time::timeout_at(at, f).await.map_err(|_| limit),
    }
}

/// The error of a read an optimistic transaction cannot answer; never
/// seen by a caller (the group is judged again under the lock).
fn optimistic_miss() -> Error {
    Error::Database("an optimistic append needed a read the cache cannot answer".to_owned())
}

impl PgTx {
    fn new(tx: Transaction<'static, Postgres>) -> PgTx {
        PgTx::with(PgConn::Locked(tx))
    }

    fn with(conn: PgConn) -> PgTx {
        PgTx {
            conn,
            assumed: Vec::new(),
            owners: HashMap::new(),
            absent_calls: Vec::new(),
            last: None,
            unwritten: 0,
            heads: HashMap::new(),
            asked: HashSet::new(),
            prefetched: HashMap::new(),
            written: HashSet::new(),
            buffered: Buffered::default(),
            views: HashMap::new(),
            calls_asked: HashSet::new(),
            calls_found: HashMap::new(),
            deadline: None,
        }
    }

    /// The connection for a statement of this transaction; an optimistic
    /// one has none to give.
    fn conn(&mut self) -> Result<&mut sqlx::PgConnection> {
        match &mut self.conn {
            PgConn::Locked(tx) => Ok(&mut **tx),
            PgConn::Optimistic(_) => Err(optimistic_miss()),
        }
    }

    fn is_optimistic(&self) -> bool {
        matches!(self.conn, PgConn::Optimistic(_))
    }

    /// Keeps the views and calls index rows of `prefetch` (JSON: an array
    /// of views and an array of calls).
    fn read_ahead_derived(&mut self, json: &str) -> Result<()> {
        let corrupt = |e: serde_json::Error| {
            Error::Corrupt(format!("a read-ahead view or call could not be read: {e}"))
        };
        let (views, calls): (Vec<(Uuid, ViewColumns)>, Vec<CallJson>) =
            serde_json::from_str(json).map_err(corrupt)?;
        for (id, columns) in views {
            self.views
                .insert(id, Some(ViewRow::from_columns(id, columns)));
        }
        for (s, call_id, tool_name, call_seq, result_seq) in calls {
            self.calls_found.insert(
                (s, call_id.clone()),
                (call_id, tool_name, call_seq, result_seq),
            );
        }
        Ok(())
    }

    /// This transaction writes derived rows of `session_id`: what was read
    /// ahead about its view and calls is out of date.
    fn forget(&mut self, session_id: Uuid) {
        self.views.remove(&session_id);
        self.calls_asked.retain(|(s, _)| *s != session_id);
    }

    /// Sends the buffered writes if a read about `session_id` could see
    /// them.
    async fn flush_for(&mut self, session_id: Uuid) -> Result<()> {
        match self.buffered.sessions.contains(&session_id) {
            true => self.flush().await,
            false => Ok(()),
        }
    }

    /// Sends every buffered write (and the reserved positions' counter
    /// update) in one call of `session_store_append` (migration 0007), not
    /// optimistic: one round trip, and statements that are not re-planned
    /// on every call.
    async fn flush(&mut self) -> Result<()> {
        if self.buffered.sessions.is_empty() {
            return Ok(());
        }
        let b = std::mem::take(&mut self.buffered);
        let none: (Vec<Uuid>, Vec<i64>, Vec<Uuid>, Vec<&str>) = Default::default();
        let query = sqlx::query(WRITE_CALL)
            .bind(false)
            .bind(none.0)
            .bind(none.1)
            .bind(none.2)
            .bind(none.3);
        trip(
            self.deadline,
            bind_writes(query, &b, self.unwritten).execute(self.conn()?),
        )
        .await?;
        self.unwritten = 0;
        Ok(())
    }
}

impl super::group::OptimisticTx for PgTx {
    const REMOTE_COMMIT: bool = true;

    /// Makes an optimistic transaction judge `warm`'s session against its
    /// cached head, hash, view and owner (the write checks the head).
    fn assume(&mut self, warm: &super::Warm) {
        let Some(known) = &warm.known else { return };
        let session_id = warm.state.session_id;
        self.assumed.push((session_id, warm.state.seq));
        self.heads
            .insert(session_id, (warm.state.seq, Some(known.head_hash.clone())));
        self.views.insert(session_id, known.view.clone());
        if let Some(owner) = &known.owner {
            self.owners.insert(session_id, owner.clone());
        }
        if self.last.is_none() {
            // Positions are reserved from 0 and moved past the counter by
            // the write.
            self.last = Some(0);
        }
    }

    /// Sends an optimistic transaction's writes in one autocommitted call
    /// of `session_store_append` (migration 0007); returns the counter's
    /// value before them, by which every reserved position moves.
    async fn commit_optimistic(mut self) -> std::result::Result<i64, OptimisticMiss> {
        let PgConn::Optimistic(pool) = &self.conn else {
            return Err(OptimisticMiss::Failed(Error::Database(
                "commit_optimistic called on a locked transaction".to_owned(),
            )));
        };
        let pool = pool.clone();
        let b = std::mem::take(&mut self.buffered);
        let (absent_sessions, absent_ids): (Vec<Uuid>, Vec<&str>) = self
            .absent_calls
            .iter()
            .map(|(s, c)| (*s, c.as_str()))
            .unzip();
        let query = sqlx::query(WRITE_CALL)
            .bind(true)
            .bind(self.assumed.iter().map(|a| a.0).collect::<Vec<Uuid>>())
            .bind(self.assumed.iter().map(|a| a.1).collect::<Vec<i64>>())
            .bind(absent_sessions)
            .bind(absent_ids);
        // Bounded as the locked path's writes are (the call waits for the
        // counter's lock, up to the server's lock timeout): a server that
        // stops answering would otherwise hold this instance's appends
        // until the connection broke. Cut off, the call may have committed
        // (the group answers `OutcomeUnknown`).
        let until = self
            .deadline
            .map(|d| d + LOCK_TIMEOUT)
            .map(|l| (l, tokio::time::Instant::now() + l));
        // The connection first, on its own: a pool that has none to give
        // (the server down, the pool's timeout) fails before anything is
        // sent, so nothing can have been stored.
        let mut conn = before(until, pool.acquire())
            .await
            .map_err(|limit| {
                OptimisticMiss::NotStored(Error::Unavailable(format!(
                    "no connection to PostgreSQL was ready within {} s; the append was not sent",
                    limit.as_secs_f64()
                )))
            })?
            .map_err(|e| {
                noted(&e);
                OptimisticMiss::NotStored(Error::from_sqlx(e))
            })?;
        let call = bind_writes(query, &b, self.unwritten).fetch_one(&mut *conn);
        let result = before(until, call).await.map_err(|limit| {
            OptimisticMiss::Failed(Error::Unavailable(format!(
                "PostgreSQL did not answer the append within {} s: the server may be stopped or cut off",
                limit.as_secs_f64()
            )))
        })?
        .and_then(|row| sqlx::Row::try_get::<i64, _>(&row, 0));
        match result {
            Ok(base) => Ok(base),
            // Only the function's own checks and a stored event id say
            // "judge again": each is raised before the commit, so nothing
            // was written. Any other error is the caller's: said as not
            // stored when the server answered with a cause that ends a
            // statement before its commit, and otherwise as `Failed`
            // ([`commit_error`]: the server's other refusals stay as they
            // are; a connection's failure, or a reply that could not be
            // read, may come after the commit and is an unknown outcome).
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("SS001" | "SS002" | "23505")) =>
            {
                Err(OptimisticMiss::Rejected(e.message().to_owned()))
            }
            Err(e) if ended_before_commit(&e) => {
                Err(OptimisticMiss::NotStored(Error::from_sqlx(e)))
            }
            Err(e) => Err(OptimisticMiss::Failed(commit_error(e))),
        }
    }
}

/// The call of `session_store_append` (migration 0007): whether it is
/// optimistic and what it checks, then [`bind_writes`]'s arguments.
const WRITE_CALL: &str = "SELECT session_store_append($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
     $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, \
     $29, $30, $31, $32, $33, $34, $35, $36, $37, $38, $39)";

/// Binds the writes' arguments of `session_store_append`: `reserved`
/// positions to add to the counter, then the buffered rows, calls, views,
/// owners, activation changes and wake-ups as arrays.
fn bind_writes<'q>(
    query: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    b: &'q Buffered,
    reserved: i64,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    let rows = &b.rows;
    let views: Vec<&ViewRow> = b.views.values().collect();
    let changes = &b.changes;
    query
        .bind(reserved)
        .bind(rows.iter().map(|r| r.position).collect::<Vec<i64>>())
        .bind(rows.iter().map(|r| r.session_id).collect::<Vec<Uuid>>())
        .bind(rows.iter().map(|r| r.seq).collect::<Vec<i64>>())
        .bind(rows.iter().map(|r| r.event_id).collect::<Vec<Uuid>>())
        .bind(rows.iter().map(|r| r.type_name).collect::<Vec<&str>>())
        .bind(
            rows.iter()
                .map(|r| r.payload.as_str())
                .collect::<Vec<&str>>(),
        )
        .bind(
            rows.iter()
                .map(|r| r.recorded_at)
                .collect::<Vec<DateTime<Utc>>>(),
        )
        .bind(rows.iter().map(|r| r.hash.as_str()).collect::<Vec<&str>>())
        .bind(b.calls.iter().map(|c| c.0).collect::<Vec<Uuid>>())
        .bind(
            b.calls
                .iter()
                .map(|c| c.1 .0.as_str())
                .collect::<Vec<&str>>(),
        )
        .bind(
            b.calls
                .iter()
                .map(|c| c.1 .1.as_str())
                .collect::<Vec<&str>>(),
        )
        .bind(b.calls.iter().map(|c| c.1 .2).collect::<Vec<i64>>())
        .bind(b.calls.iter().map(|c| c.1 .3).collect::<Vec<Option<i64>>>())
        .bind(views.iter().map(|v| v.session_id).collect::<Vec<Uuid>>())
        .bind(views.iter().map(|v| v.refresh_seq).collect::<Vec<i64>>())
        .bind(views.iter().map(|v| v.mode.as_str()).collect::<Vec<&str>>())
        .bind(views.iter().map(|v| v.window_start).collect::<Vec<i64>>())
        .bind(
            views
                .iter()
                .map(|v| v.compaction_seq)
                .collect::<Vec<Option<i64>>>(),
        )
        .bind(
            views
                .iter()
                .map(|v| v.summary.as_deref())
                .collect::<Vec<Option<&str>>>(),
        )
        .bind(
            views
                .iter()
                .map(|v| v.catalogs.as_str())
                .collect::<Vec<&str>>(),
        )
        .bind(
            views
                .iter()
                .map(|v| v.evidence.as_str())
                .collect::<Vec<&str>>(),
        )
        .bind(
            views
                .iter()
                .map(|v| v.active.as_str())
                .collect::<Vec<&str>>(),
        )
        .bind(b.owners.iter().map(|o| o.0).collect::<Vec<Uuid>>())
        .bind(b.owners.iter().map(|o| o.1.as_str()).collect::<Vec<&str>>())
        .bind(changes.iter().map(|c| c.position).collect::<Vec<i64>>())
        .bind(
            changes
                .iter()
                .map(|c| c.tool.as_str())
                .collect::<Vec<&str>>(),
        )
        .bind(changes.iter().map(|c| c.session_id).collect::<Vec<Uuid>>())
        .bind(changes.iter().map(|c| c.seq).collect::<Vec<i64>>())
        .bind(
            changes
                .iter()
                .map(|c| c.recorded_at)
                .collect::<Vec<DateTime<Utc>>>(),
        )
        .bind(
            changes
                .iter()
                .map(|c| c.change.as_str())
                .collect::<Vec<&str>>(),
        )
        .bind(
            changes
                .iter()
                .map(|c| c.evidence_seq)
                .collect::<Vec<Option<i64>>>(),
        )
        .bind(NOTIFY_CHANNEL)
        .bind(&b.wakeups)
}

impl LogTx for PgTx {
    async fn head_seq(&mut self, session_id: Uuid) -> Result<i64> {
        if let Some((seq, _)) = self.heads.get(&session_id) {
            return Ok(*seq);
        }
        let deadline = self.deadline;
        head_seq(self.conn()?, deadline, session_id).await
    }

    async fn head(&mut self, session_id: Uuid) -> Result<(i64, Option<String>)> {
        if let Some(head) = self.heads.get(&session_id) {
            return Ok(head.clone());
        }
        let row: Option<(i64, Option<String>)> = trip(
            self.deadline,
            sqlx::query_as(
                "SELECT seq, hash FROM events WHERE session_id = $1 ORDER BY seq DESC LIMIT 1",
            )
            .bind(session_id)
            .fetch_optional(self.conn()?),
        )
        .await?;
        Ok(row.unwrap_or((0, None)))
    }

    async fn judge_reads(
        &mut self,
        session_id: Uuid,
        ids: &[Uuid],
    ) -> Result<(Vec<StoredEvent>, i64, Option<String>)> {
        if self.is_optimistic() {
            // The event ids are taken as new (the write's unique index
            // checks it) unless this transaction wrote them.
            return match self.heads.get(&session_id) {
                Some((head, hash)) if !ids.iter().any(|id| self.written.contains(id)) => {
                    Ok((Vec::new(), *head, hash.clone()))
                }
                _ => Err(optimistic_miss()),
            };
        }
        // Served from what was read ahead; read now (the same way) when it
        // was not, or when this transaction has written some of the ids.
        let read_ahead = self.heads.contains_key(&session_id)
            && ids
                .iter()
                .all(|id| self.asked.contains(id) && !self.written.contains(id));
        if !read_ahead {
            self.prefetch(&[session_id], &[session_id], ids, &[])
                .await?;
        }
        let (head, hash) = self.heads.get(&session_id).cloned().unwrap_or((0, None));
        let stored = ids
            .iter()
            .filter_map(|id| self.prefetched.get(id).cloned())
            .collect();
        Ok((stored, head, hash))
    }

    async fn prefetch(
        &mut self,
        sessions: &[Uuid],
        _views: &[Uuid],
        ids: &[Uuid],
        calls: &[(Uuid, &str)],
    ) -> Result<()> {
        // The views of all `sessions` are read (in the one JSON value that
        // also brings the calls, so they cost no round trip of their own).
        if self.is_optimistic() {
            // Everything it would read was assumed.
            return Ok(());
        }
        self.flush().await?;
        // The rows with these ids, then each session's head row (its
        // payload left out: only its seq and hash are wanted), then one row
        // of the counter's value (the lock is held) and, as JSON, the
        // sessions' views and the calls index rows asked for.
        let call_sessions: Vec<Uuid> = calls.iter().map(|c| c.0).collect();
        let call_ids: Vec<&str> = calls.iter().map(|c| c.1).collect();
        let rows: Vec<JudgeRow> = trip(self.deadline, sqlx::query_as(
            "SELECT position, session_id, seq, event_id, payload, recorded_at, hash, false, NULL::TEXT \
                 FROM events WHERE event_id = ANY($1) \
                 UNION ALL \
                 SELECT h.position, h.session_id, h.seq, h.event_id, '', h.recorded_at, h.hash, true, NULL \
                 FROM UNNEST($2::UUID[]) AS s(id) CROSS JOIN LATERAL \
                 (SELECT position, session_id, seq, event_id, recorded_at, hash FROM events \
                  WHERE session_id = s.id ORDER BY seq DESC LIMIT 1) AS h \
                 UNION ALL \
                 SELECT (SELECT last FROM event_position WHERE id = 1), '00000000-0000-0000-0000-000000000000'::UUID, 0, \
                 '00000000-0000-0000-0000-000000000000'::UUID, '', now(), NULL, false, \
                 json_build_array( \
                   (SELECT COALESCE(json_agg(json_build_array(v.session_id, json_build_array(v.refresh_seq, \
                      v.mode, v.window_start, v.compaction_seq, v.summary, v.catalogs, v.evidence, \
                      v.active))), '[]') \
                    FROM session_views v WHERE v.session_id = ANY($2)), \
                   (SELECT COALESCE(json_agg(json_build_array(c.session_id, c.call_id, c.tool_name, \
                      c.call_seq, c.result_seq)), '[]') \
                    FROM UNNEST($3::UUID[], $4::TEXT[]) AS w(s, id) \
                    JOIN calls c ON c.session_id = w.s AND c.call_id = w.id))::TEXT",
        )
        .bind(ids)
        .bind(sessions)
        .bind(call_sessions)
        .bind(call_ids)
        .fetch_all(self.conn()?)).await?;
        for s in sessions {
            self.heads.insert(*s, (0, None));
        }
        // Read after every write was sent: up to date for these ids.
        for id in ids {
            self.asked.insert(*id);
            self.written.remove(id);
            self.prefetched.remove(id);
        }
        for s in sessions {
            self.views.insert(*s, None);
        }
        for (s, c) in calls {
            self.calls_asked.insert((*s, (*c).to_owned()));
            self.calls_found.remove(&(*s, (*c).to_owned()));
        }
        for (p, s, q, e, payload, t, h, is_head, extra) in rows {
            if let Some(json) = extra {
                // The counter moves only under the lock, which this
                // transaction holds: a value already known includes its
                // own reservations.
                self.last.get_or_insert(p);
                self.read_ahead_derived(&json)?;
            } else if is_head {
                self.heads.insert(s, (q, h));
            } else {
                let event = decode((p, s, q, e, payload, t))?;
                self.prefetched.insert(event.event_id, event);
            }
        }
        Ok(())
    }

    async fn write_accepted(&mut self, w: Accepted<'_>) -> Result<()> {
        // Buffered until the commit or a read that could see it (see
        // [`PgTx`]); the reserved positions' counter update goes with it.
        // What was read ahead about the session's view and calls becomes
        // what the database will hold once the buffer is sent.
        if let Some(view) = w.view {
            self.views.insert(w.session_id, Some(view.clone()));
        }
        for call in w.calls {
            let key = (w.session_id, call.0.clone());
            self.calls_asked.insert(key.clone());
            upsert_call(&mut self.calls_found, key, call);
        }
        let b = &mut self.buffered;
        b.sessions.insert(w.session_id);
        b.ids.extend(w.rows.iter().map(|r| r.event_id));
        self.written.extend(w.rows.iter().map(|r| r.event_id));
        b.rows.extend_from_slice(w.rows);
        for call in w.calls {
            match b.call_index.get(&(w.session_id, call.0.clone())) {
                // As the upsert would: only the result's seq changes.
                Some(&i) => b.calls[i].1 .3 = call.3,
                None => {
                    b.call_index
                        .insert((w.session_id, call.0.clone()), b.calls.len());
                    b.calls.push((w.session_id, call.clone()));
                }
            }
        }
        if let Some(view) = w.view {
            b.views.insert(w.session_id, view.clone());
        }
        if let Some(tenant) = w.claim_for {
            b.owners.push((w.session_id, tenant.to_owned()));
        }
        b.wakeups.push(format!("{}:{}", w.session_id, w.seq));
        b.changes.extend_from_slice(w.changes);
        if let Some(last) = w.rows.last() {
            self.heads
                .insert(w.session_id, (last.seq, Some(last.hash.clone())));
        }
        Ok(())
    }

    async fn stored_by_ids(&mut self, ids: &[Uuid]) -> Result<Vec<StoredEvent>> {
        if ids.iter().any(|id| self.buffered.ids.contains(id)) {
            self.flush().await?;
        }
        let rows: Vec<Row> = trip(
            self.deadline,
            sqlx::query_as(&format!(
                "SELECT {COLUMNS} FROM events WHERE event_id = ANY($1)"
            ))
            .bind(ids)
            .fetch_all(self.conn()?),
        )
        .await?;
        rows.into_iter().map(decode).collect()
    }

    async fn range(
        &mut self,
        session_id: Uuid,
        after: i64,
        upto: i64,
        max_bytes: usize,
    ) -> Result<Vec<StoredEvent>> {
        self.flush_for(session_id).await?;
        let deadline = self.deadline;
        let bounded = max_bytes != usize::MAX;
        let sql = session_page(bounded);
        let mut query = sqlx::query_as::<_, Row>(&sql)
            .bind(session_id)
            .bind(after)
            .bind(upto)
            .bind(i64::MAX);
        if bounded {
            query = query.bind(byte_bound(max_bytes));
        }
        let mut rows = query.fetch(self.conn()?).map(watched);
        within(
            deadline,
            super::take_within(&mut rows, max_bytes, |r: &Row| r.4.len(), decode),
        )
        .await
    }

    async fn reserve_positions(&mut self, n: i64) -> Result<i64> {
        // The counter row is locked and `last` read: the positions are ours.
        // Writing the counter back waits for the insert, which does it in
        // the same statement (or for the commit).
        let last = match self.last {
            Some(last) => last,
            None => {
                let (last,): (i64,) = trip(
                    self.deadline,
                    sqlx::query_as("SELECT last FROM event_position WHERE id = 1")
                        .fetch_one(self.conn()?),
                )
                .await?;
                last
            }
        };
        super::append::no_room_after(
            last,
            usize::try_from(n).unwrap_or(usize::MAX),
            "position of the log",
        )?;
        self.last = Some(last + n);
        self.unwritten += n;
        Ok(last + 1)
    }

    async fn insert(&mut self, rows: &[PendingRow]) -> Result<()> {
        self.flush().await?;
        for r in rows {
            self.heads.remove(&r.session_id);
            self.written.insert(r.event_id);
        }
        let positions: Vec<i64> = rows.iter().map(|r| r.position).collect();
        let sessions: Vec<Uuid> = rows.iter().map(|r| r.session_id).collect();
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        let ids: Vec<Uuid> = rows.iter().map(|r| r.event_id).collect();
        let types: Vec<&str> = rows.iter().map(|r| r.type_name).collect();
        let payloads: Vec<&str> = rows.iter().map(|r| r.payload.as_str()).collect();
        let times: Vec<DateTime<Utc>> = rows.iter().map(|r| r.recorded_at).collect();
        let hashes: Vec<&str> = rows.iter().map(|r| r.hash.as_str()).collect();
        trip(self.deadline, sqlx::query(
            "WITH counter AS (UPDATE event_position SET last = last + $9 WHERE id = 1 AND $9 > 0) \
             INSERT INTO events (position, session_id, seq, event_id, type, payload, recorded_at, hash) \
             SELECT * FROM UNNEST($1::BIGINT[], $2::UUID[], $3::BIGINT[], $4::UUID[], $5::TEXT[], $6::TEXT[], $7::TIMESTAMPTZ[], $8::TEXT[])",
        )
        .bind(positions)
        .bind(sessions)
        .bind(seqs)
        .bind(ids)
        .bind(types)
        .bind(payloads)
        .bind(times)
        .bind(hashes)
        .bind(self.unwritten)
        .execute(self.conn()?)).await?;
        self.unwritten = 0;
        Ok(())
    }

    async fn load_view(&mut self, session_id: Uuid) -> Result<Option<ViewRow>> {
        // A buffered view is the latest; without one the stored view is
        // (buffered writes of the session do not change it).
        if let Some(view) = self.buffered.views.get(&session_id) {
            return Ok(Some(view.clone()));
        }
        if let Some(view) = self.views.get(&session_id) {
            return Ok(view.clone());
        }
        let row: Option<ViewColumns> = trip(self.deadline, sqlx::query_as(
            "SELECT refresh_seq, mode, window_start, compaction_seq, summary, catalogs, evidence, active \
             FROM session_views WHERE session_id = $1",
        )
        .bind(session_id)
        .fetch_optional(self.conn()?)).await?;
        Ok(row.map(|r| ViewRow::from_columns(session_id, r)))
    }

    async fn write_view(&mut self, v: &ViewRow) -> Result<()> {
        self.forget(v.session_id);
        self.flush().await?;
        trip(self.deadline, sqlx::query(
            "INSERT INTO session_views \
             (session_id, refresh_seq, mode, window_start, compaction_seq, summary, catalogs, evidence, active) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (session_id) DO UPDATE SET refresh_seq = EXCLUDED.refresh_seq, \
             mode = EXCLUDED.mode, window_start = EXCLUDED.window_start, \
             compaction_seq = EXCLUDED.compaction_seq, summary = EXCLUDED.summary, \
             catalogs = EXCLUDED.catalogs, evidence = EXCLUDED.evidence, active = EXCLUDED.active",
        )
        .bind(v.session_id)
        .bind(v.refresh_seq)
        .bind(&v.mode)
        .bind(v.window_start)
        .bind(v.compaction_seq)
        .bind(&v.summary)
        .bind(&v.catalogs)
        .bind(&v.evidence)
        .bind(&v.active)
        .execute(self.conn()?)).await?;
        Ok(())
    }

    async fn calls(&mut self, session_id: Uuid, call_ids: &[String]) -> Result<Vec<CallRow>> {
        if self.is_optimistic() {
            // Calls this transaction did not write are taken as absent
            // (the cached state knows the window's and the latest
            // unanswered ones before it; any other the batch
            // names is new or its result is refused, which the locked path
            // judges again); the write checks they are.
            for c in call_ids {
                if self.calls_asked.insert((session_id, c.clone())) {
                    self.absent_calls.push((session_id, c.clone()));
                }
            }
        }
        let asked = |c: &String| self.calls_asked.contains(&(session_id, c.clone()));
        if call_ids.iter().all(asked) {
            return Ok(call_ids
                .iter()
                .filter_map(|c| self.calls_found.get(&(session_id, c.clone())).cloned())
                .collect());
        }
        self.flush_for(session_id).await?;
        trip(
            self.deadline,
            sqlx::query_as(
                "SELECT call_id, tool_name, call_seq, result_seq FROM calls \
             WHERE session_id = $1 AND call_id = ANY($2)",
            )
            .bind(session_id)
            .bind(call_ids)
            .fetch_all(self.conn()?),
        )
        .await
    }

    async fn record_calls(&mut self, session_id: Uuid, rows: &[CallRow]) -> Result<()> {
        self.forget(session_id);
        self.flush().await?;
        if rows.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = rows.iter().map(|c| c.0.as_str()).collect();
        let names: Vec<&str> = rows.iter().map(|c| c.1.as_str()).collect();
        let seqs: Vec<i64> = rows.iter().map(|c| c.2).collect();
        let result_seqs: Vec<Option<i64>> = rows.iter().map(|c| c.3).collect();
        trip(
            self.deadline,
            sqlx::query(
                "INSERT INTO calls (session_id, call_id, tool_name, call_seq, result_seq) \
             SELECT $1, * FROM UNNEST($2::TEXT[], $3::TEXT[], $4::BIGINT[], $5::BIGINT[]) \
             ON CONFLICT (session_id, call_id) DO UPDATE SET result_seq = EXCLUDED.result_seq",
            )
            .bind(session_id)
            .bind(ids)
            .bind(names)
            .bind(seqs)
            .bind(result_seqs)
            .execute(self.conn()?),
        )
        .await?;
        Ok(())
    }

    async fn last_refresh_seq(&mut self, session_id: Uuid) -> Result<i64> {
        self.flush_for(session_id).await?;
        let (seq,): (i64,) = trip(
            self.deadline,
            sqlx::query_as(
                "SELECT COALESCE(MAX(seq), 0)::BIGINT FROM events WHERE session_id = $1 \
             AND type IN ('prompt_submitted', 'mode_switched')",
            )
            .bind(session_id)
            .fetch_one(self.conn()?),
        )
        .await?;
        Ok(seq)
    }

    async fn clear_derived(&mut self, session_id: Uuid) -> Result<()> {
        self.forget(session_id);
        self.flush().await?;
        for sql in [
            "DELETE FROM session_views WHERE session_id = $1",
            "DELETE FROM calls WHERE session_id = $1",
            "DELETE FROM activation_changes WHERE session_id = $1",
        ] {
            trip(
                self.deadline,
                sqlx::query(sql).bind(session_id).execute(self.conn()?),
            )
            .await?;
        }
        Ok(())
    }

    async fn session_ids(&mut self) -> Result<Vec<Uuid>> {
        self.flush().await?;
        let rows: Vec<(Uuid,)> = trip(
            self.deadline,
            sqlx::query_as("SELECT DISTINCT session_id FROM events ORDER BY session_id")
                .fetch_all(self.conn()?),
        )
        .await?;
        Ok(rows.into_iter().map(|(s,)| s).collect())
    }

    async fn session_owner(&mut self, session_id: Uuid) -> Result<Option<String>> {
        if self.is_optimistic() {
            return match self.owners.get(&session_id) {
                Some(owner) => Ok(Some(owner.clone())),
                None => Err(optimistic_miss()),
            };
        }
        self.flush_for(session_id).await?;
        let row: Option<(String,)> = trip(
            self.deadline,
            sqlx::query_as("SELECT tenant FROM session_owners WHERE session_id = $1")
                .bind(session_id)
                .fetch_optional(self.conn()?),
        )
        .await?;
        Ok(row.map(|(t,)| t))
    }

    async fn claim_session(&mut self, session_id: Uuid, tenant: &str) -> Result<()> {
        self.flush().await?;
        trip(
            self.deadline,
            sqlx::query("INSERT INTO session_owners (session_id, tenant) VALUES ($1, $2)")
                .bind(session_id)
                .bind(tenant)
                .execute(self.conn()?),
        )
        .await?;
        Ok(())
    }

    async fn notify(&mut self, session_id: Uuid, seq: i64) -> Result<()> {
        self.flush().await?;
        trip(
            self.deadline,
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(NOTIFY_CHANNEL)
                .bind(format!("{session_id}:{seq}"))
                .execute(self.conn()?),
        )
        .await?;
        Ok(())
    }

    async fn chained_page(
        &mut self,
        session_id: Uuid,
        after: i64,
        limit: i64,
    ) -> Result<Vec<super::chain::ChainedRow>> {
        self.flush_for(session_id).await?;
        let sql = bounded_page(
            &format!("{COLUMNS}, hash, type"),
            "session_id = $1 AND seq > $2",
            "seq",
            "$3",
            "$4",
        );
        let deadline = self.deadline;
        let mut rows = sqlx::query_as::<_, TypedRow>(&sql)
            .bind(session_id)
            .bind(after)
            .bind(limit)
            .bind(byte_bound(super::PAGE_BYTES))
            .fetch(self.conn()?)
            .map(watched);
        within(
            deadline,
            super::take_within(
                &mut rows,
                super::PAGE_BYTES,
                |r: &TypedRow| r.4.len(),
                |(p, s, q, e, pl, t, h, ty)| {
                    Ok(super::chain::ChainedRow::read(
                        decode((p, s, q, e, pl, t)),
                        q,
                        Some(e),
                        h,
                        ty,
                    ))
                },
            ),
        )
        .await
    }

    async fn set_hash(&mut self, position: i64, hash: &str) -> Result<()> {
        self.flush().await?;
        // It may be a head's hash.
        self.heads.clear();
        trip(
            self.deadline,
            sqlx::query("UPDATE events SET hash = $1 WHERE position = $2 AND hash IS NULL")
                .bind(hash)
                .bind(position)
                .execute(self.conn()?),
        )
        .await?;
        Ok(())
    }

    async fn backfill_pending(&mut self, limit: i64) -> Result<Vec<Uuid>> {
        self.flush().await?;
        let rows: Vec<(Uuid,)> = trip(
            self.deadline,
            sqlx::query_as("SELECT session_id FROM chain_backfill ORDER BY session_id LIMIT $1")
                .bind(limit)
                .fetch_all(self.conn()?),
        )
        .await?;
        Ok(rows.into_iter().map(|(s,)| s).collect())
    }

    async fn is_backfill_pending(&mut self, session_id: Uuid) -> Result<bool> {
        self.flush_for(session_id).await?;
        let row: Option<(i32,)> = trip(
            self.deadline,
            sqlx::query_as("SELECT 1 FROM chain_backfill WHERE session_id = $1")
                .bind(session_id)
                .fetch_optional(self.conn()?),
        )
        .await?;
        Ok(row.is_some())
    }

    async fn backfill_done(&mut self, session_id: Uuid) -> Result<()> {
        self.flush().await?;
        trip(
            self.deadline,
            sqlx::query("DELETE FROM chain_backfill WHERE session_id = $1")
                .bind(session_id)
                .execute(self.conn()?),
        )
        .await?;
        Ok(())
    }

    async fn position_summary(&mut self) -> Result<(i64, i64, i64)> {
        self.flush().await?;
        let (count, max, last): (i64, i64, i64) = trip(self.deadline, sqlx::query_as(
            "SELECT (SELECT COUNT(*) FROM events), (SELECT COALESCE(MAX(position), 0) FROM events), \
             (SELECT last FROM event_position WHERE id = 1)",
        )
        .fetch_one(self.conn()?)).await?;
        Ok((count, max, last))
    }

    async fn record_changes(&mut self, rows: &[ChangeRow]) -> Result<()> {
        self.flush().await?;
        if rows.is_empty() {
            return Ok(());
        }
        let positions: Vec<i64> = rows.iter().map(|r| r.position).collect();
        let tools: Vec<&str> = rows.iter().map(|r| r.tool.as_str()).collect();
        let sessions: Vec<Uuid> = rows.iter().map(|r| r.session_id).collect();
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        let times: Vec<DateTime<Utc>> = rows.iter().map(|r| r.recorded_at).collect();
        let changes: Vec<&str> = rows.iter().map(|r| r.change.as_str()).collect();
        let evidence: Vec<Option<i64>> = rows.iter().map(|r| r.evidence_seq).collect();
        trip(self.deadline, sqlx::query(
            "INSERT INTO activation_changes (position, tool, session_id, seq, recorded_at, change, evidence_seq) \
             SELECT * FROM UNNEST($1::BIGINT[], $2::TEXT[], $3::UUID[], $4::BIGINT[], $5::TIMESTAMPTZ[], $6::TEXT[], $7::BIGINT[])",
        )
        .bind(positions)
        .bind(tools)
        .bind(sessions)
        .bind(seqs)
        .bind(times)
        .bind(changes)
        .bind(evidence)
        .execute(self.conn()?)).await?;
        Ok(())
    }

    async fn load_changes(&mut self, session_id: Uuid) -> Result<Vec<ChangeRow>> {
        self.flush_for(session_id).await?;
        let rows: Vec<PgChange> = trip(
            self.deadline,
            sqlx::query_as(
                "SELECT position, tool, session_id, seq, recorded_at, change, evidence_seq \
             FROM activation_changes WHERE session_id = $1 ORDER BY seq, tool",
            )
            .bind(session_id)
            .fetch_all(self.conn()?),
        )
        .await?;
        Ok(rows.into_iter().map(decode_change).collect())
    }

    async fn changes_backfill_pending(&mut self, limit: i64) -> Result<Vec<Uuid>> {
        self.flush().await?;
        let rows: Vec<(Uuid,)> = trip(
            self.deadline,
            sqlx::query_as("SELECT session_id FROM changes_backfill ORDER BY session_id LIMIT $1")
                .bind(limit)
                .fetch_all(self.conn()?),
        )
        .await?;
        Ok(rows.into_iter().map(|(s,)| s).collect())
    }

    async fn changes_backfill_done(&mut self, session_id: Uuid) -> Result<()> {
        self.flush().await?;
        trip(
            self.deadline,
            sqlx::query("DELETE FROM changes_backfill WHERE session_id = $1")
                .bind(session_id)
                .execute(self.conn()?),
        )
        .await?;
        Ok(())
    }

    async fn commit(self) -> Result<()> {
        self.finish(false).await
    }

    async fn commit_append(self) -> Result<()> {
        self.finish(true).await
    }
}

impl PgTx {
    /// [`LogTx::commit`]: the buffered writes, the counter, the `COMMIT`.
    /// Everything before the `COMMIT` fails, if it does, with the
    /// transaction open: nothing is stored. The `COMMIT`'s answer lost (a
    /// cut connection, no answer within the deadline) may come after the
    /// server committed: `unknown_on_lost_answer` says so as
    /// [`Error::OutcomeUnknown`] (an append's commit), otherwise it stays
    /// `Unavailable` (`rebuild`, the backfills, whose callers look again).
    async fn finish(mut self, unknown_on_lost_answer: bool) -> Result<()> {
        self.flush().await?;
        if self.unwritten > 0 {
            trip(
                self.deadline,
                sqlx::query("UPDATE event_position SET last = last + $1 WHERE id = 1")
                    .bind(self.unwritten)
                    .execute(self.conn()?),
            )
            .await?;
        }
        match self.conn {
            PgConn::Locked(tx) => {
                let commit = async {
                    match tx.commit().await {
                        Err(e) if unknown_on_lost_answer => Err(commit_error(e)),
                        other => other.map_err(|e| {
                            noted(&e);
                            Error::from_sqlx(e)
                        }),
                    }
                };
                match within(self.deadline, commit).await {
                    Err(Error::Unavailable(m)) if unknown_on_lost_answer => {
                        Err(Error::OutcomeUnknown(m))
                    }
                    other => other,
                }
            }
            PgConn::Optimistic(_) => Err(optimistic_miss()),
        }
    }
}

/// An `activation_changes` row as PostgreSQL returns it.
pub(crate) type PgChange = (i64, String, Uuid, i64, DateTime<Utc>, String, Option<i64>);

pub(crate) fn decode_change(r: PgChange) -> ChangeRow {
    let (position, tool, session_id, seq, recorded_at, change, evidence_seq) = r;
    ChangeRow {
        session_id,
        seq,
        position,
        recorded_at,
        tool,
        change,
        evidence_seq,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_whose_reply_is_lost_or_unreadable_has_an_unknown_outcome() {
        for e in [
            sqlx::Error::Io(std::io::Error::other("connection reset")),
            sqlx::Error::Protocol("unexpected message".to_owned()),
            sqlx::Error::ColumnNotFound("base".to_owned()),
            sqlx::Error::WorkerCrashed,
        ] {
            let said = e.to_string();
            assert!(
                matches!(commit_error(e), Error::OutcomeUnknown(_)),
                "{said}"
            );
        }
    }

    /// The lock's bound is [`LOCK_TIMEOUT`], and what it sets back is the
    /// connection's own `statement_timeout`.
    #[test]
    fn the_counters_lock_is_bounded_as_the_connection_settings_say() {
        let setting = |name: &str| {
            SESSION_SETTINGS
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| *v)
                .unwrap()
        };
        assert_eq!(
            setting("lock_timeout"),
            format!("{}s", LOCK_TIMEOUT.as_secs())
        );
        assert!(LOCK_COUNTER.starts_with(&format!(
            "SET LOCAL statement_timeout = '{}';",
            setting("lock_timeout")
        )));
        assert!(LOCK_COUNTER.ends_with(&format!(
            "SET LOCAL statement_timeout = '{}'",
            setting("statement_timeout")
        )));
    }
}
