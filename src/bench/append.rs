//! Phase 1, append throughput: the store against a raw-insert ceiling
//! measured in the same run.
//!
//! Each cell of the grid (batch size × writers × distinct or shared
//! session) runs for a fixed time per repeat, store and ceiling
//! alternating (which goes first flips every repeat, so drift in a noisy
//! machine hits both alike).
//!
//! - **Store**: `Store::append` of the realistic mix (`workload`), each
//!   writer at its own session's head (the seq its last append returned), or,
//!   on one shared session, `Store::append_at_head` (what a writer that
//!   appends "at the end, whatever it is" calls).
//! - **Ceiling**: the same events, serialized to the same JSON, inserted into
//!   a bare table with the columns and unique keys of `events` and nothing
//!   else: one multi-row `INSERT` per batch, on its own (a statement is a
//!   transaction), with the same driver (sqlx) and the same connection
//!   settings as the store's writes, and so the same durability. On
//!   SQLite the writers share one held connection, as the store's writes
//!   do (SQLite admits one writer at a time; connections of their own
//!   would queue in its busy handler, which sleeps); on PostgreSQL they
//!   share a pool of the store's size (`pool_options`), each insert on the
//!   connection it gets, and so the same durability
//!   (SQLite WAL with `synchronous=FULL`; PostgreSQL with `fsync` and
//!   `synchronous_commit` on), and on PostgreSQL the payload column
//!   compressed with the method the store's `events.payload` uses (lz4,
//!   migration 0008). One setting differs on PostgreSQL: the
//!   ceiling keeps the default plan caching, because forced custom plans
//!   (which the store's reads need) would slow a bare `INSERT` for nothing.
//!   It validates nothing, keeps no view and takes no store-wide lock: what
//!   the engine and driver allow, which no store on top of them can beat.
//! - **Grouped ceiling** (two writers or more): the same inserts, but the
//!   writers' batches queued meanwhile go in one transaction, committed by
//!   whichever writer holds the connection, as the store commits a group
//!   of appends (`store::group`). A ceiling of one statement per batch
//!   pays a commit (an fsync) per batch, which the store does not once
//!   several writers wait: the store beat it by up to 2x with 16 writers,
//!   so that ratios above 1 said nothing about the targets. Each cell with
//!   several writers measures both ceilings and compares the store with
//!   the faster one (PostgreSQL's own group commit of concurrent
//!   transactions can make one statement per batch the faster).
//!
//! The cells run in the order writers × batch × (distinct, shared): the
//! database grows through the phase (both sides alike), so the two kinds
//! of session are measured at about the same size.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sqlx::{ConnectOptions, Connection, PgPool, QueryBuilder, Sqlite, SqliteConnection};
use uuid::Uuid;

use super::stats::Spread;
use super::workload::{Mix, TextPool};
use super::BenchError;
use crate::error::Error;
use crate::event::NewEvent;
use crate::store::{BackendKind, RetryPolicy, Store};

/// Target ratio store/ceiling for batches (issue 7).
pub const BATCH_TARGET: f64 = 0.7;
/// Target ratio store/ceiling for single events.
pub const SINGLE_TARGET: f64 = 0.5;

/// The grid and how long each measurement runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AppendPlan {
    /// Events per append.
    pub batches: Vec<usize>,
    /// Concurrent writers.
    pub writers: Vec<usize>,
    /// Repeats of each cell (store and ceiling each).
    pub repeats: usize,
    /// How long each repeat appends.
    pub seconds: f64,
}

impl AppendPlan {
    /// The full grid (`quick`: shorter and fewer repeats, same cells).
    pub fn new(quick: bool) -> AppendPlan {
        AppendPlan {
            batches: vec![1, 10, 100],
            writers: vec![1, 4, 16],
            repeats: if quick { 3 } else { 5 },
            seconds: if quick { 0.1 } else { 0.6 },
        }
    }
}

/// One cell's figures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AppendCell {
    /// `distinct` (one session per writer) or `shared` (one session).
    pub sessions: String,
    /// Concurrent writers.
    pub writers: usize,
    /// Events per append.
    pub batch: usize,
    /// The store, events/s.
    pub store: Spread,
    /// The raw-insert ceiling, events/s: the faster (by median) of
    /// `ceiling_each` and `ceiling_grouped`.
    pub ceiling: Spread,
    /// Which ceiling `ceiling` is: `each` (a statement per batch) or
    /// `grouped` (the batches queued meanwhile in one transaction).
    #[serde(default)]
    pub ceiling_kind: String,
    /// The ceiling with a statement, and so a commit, per batch.
    #[serde(default)]
    pub ceiling_each: Option<Spread>,
    /// The ceiling that commits the batches queued meanwhile together
    /// (measured with two writers or more).
    #[serde(default)]
    pub ceiling_grouped: Option<Spread>,
    /// Median store / median ceiling.
    pub ratio: f64,
    /// The target for this ratio.
    pub target: f64,
    /// `ratio >= target`.
    pub meets_target: bool,
    /// Appends made over all repeats, store and ceiling: how many commits
    /// the figures rest on.
    pub appends: u64,
}

/// The phase's result.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AppendResult {
    /// What was run.
    pub plan: AppendPlan,
    /// One entry per cell.
    pub cells: Vec<AppendCell>,
}

/// Runs the grid on the store at `url`.
pub async fn run(url: &str, quick: bool) -> Result<AppendResult, BenchError> {
    run_plan(url, AppendPlan::new(quick), &[false, true]).await
}

/// Runs `plan` on the store at `url`, for the session kinds in `shared`
/// (`false`: distinct sessions; `true`: one shared session). The full bench
/// runs both; `examples/append_probe` runs one cell while profiling.
pub async fn run_plan(
    url: &str,
    plan: AppendPlan,
    shared_kinds: &[bool],
) -> Result<AppendResult, BenchError> {
    let store = Arc::new(Store::open(url).await?);
    let raw = Arc::new(Grouped::new(Raw::open(store.kind(), url).await?));
    let pool = Arc::new(TextPool::new());
    let duration = Duration::from_secs_f64(plan.seconds);
    let mut cells = Vec::new();
    for &writers in &plan.writers {
        for &batch in &plan.batches {
            for &shared in shared_kinds {
                let mut store_rates = Vec::new();
                let mut each_rates = Vec::new();
                let mut grouped_rates = Vec::new();
                let mut appends = 0u64;
                // One writer has nothing to group with.
                let sides = if writers > 1 { 3 } else { 2 };
                for rep in 0..plan.repeats {
                    let cell = Cell {
                        batch,
                        writers,
                        shared,
                        duration,
                        seed: rep as u64,
                    };
                    // Which side goes first turns with each repeat.
                    for side in 0..sides {
                        let (m, rates) = match (rep + side) % sides {
                            0 => (cell.store(&store, &pool).await?, &mut store_rates),
                            1 => (cell.ceiling(&raw, &pool, false).await?, &mut each_rates),
                            _ => (cell.ceiling(&raw, &pool, true).await?, &mut grouped_rates),
                        };
                        rates.push(m.rate);
                        appends += m.appends;
                    }
                }
                let store_s = Spread::of(&store_rates);
                let each_s = Spread::of(&each_rates);
                let grouped_s = (!grouped_rates.is_empty()).then(|| Spread::of(&grouped_rates));
                let (ceiling_kind, ceiling_s) = match grouped_s {
                    Some(g) if g.median > each_s.median => ("grouped", g),
                    _ => ("each", each_s),
                };
                let ratio = store_s.median / ceiling_s.median.max(f64::MIN_POSITIVE);
                let target = if batch == 1 {
                    SINGLE_TARGET
                } else {
                    BATCH_TARGET
                };
                let kind = if shared { "shared" } else { "distinct" };
                tracing::info!(
                    kind,
                    writers,
                    batch,
                    store = store_s.median,
                    ceiling = ceiling_s.median,
                    "append cell"
                );
                eprintln!(
                    "  append {kind:>8} writers={writers:<2} batch={batch:<3}: store {:>8.0} ev/s, ceiling {:>8.0} ev/s ({ceiling_kind}), ratio {ratio:.2}",
                    store_s.median, ceiling_s.median
                );
                cells.push(AppendCell {
                    sessions: kind.to_owned(),
                    writers,
                    batch,
                    store: store_s,
                    ceiling: ceiling_s,
                    ceiling_kind: ceiling_kind.to_owned(),
                    ceiling_each: Some(each_s),
                    ceiling_grouped: grouped_s,
                    ratio,
                    target,
                    meets_target: ratio >= target,
                    appends,
                });
            }
        }
    }
    store.close().await;
    // Every writer task has ended, so this is the last handle.
    if let Ok(grouped) = Arc::try_unwrap(raw) {
        grouped.raw.close().await;
    }
    Ok(AppendResult { plan, cells })
}

/// One repeat of one cell.
struct Cell {
    batch: usize,
    writers: usize,
    shared: bool,
    duration: Duration,
    seed: u64,
}

/// What one repeat measured.
struct Measured {
    /// Events per second.
    rate: f64,
    /// Appends made.
    appends: u64,
}

impl Cell {
    /// The sessions the writers append to: fresh ones, one per writer or
    /// one for all.
    fn sessions(&self) -> Vec<Uuid> {
        let one = Uuid::new_v4();
        (0..self.writers)
            .map(|_| if self.shared { one } else { Uuid::new_v4() })
            .collect()
    }

    async fn store(&self, store: &Arc<Store>, pool: &Arc<TextPool>) -> Result<Measured, Error> {
        let sessions = self.sessions();
        for (w, s) in sessions.iter().enumerate() {
            if w == 0 || !self.shared {
                let header = Mix::header().into_iter().map(NewEvent::new).collect();
                store.append(*s, 0, header).await?;
            }
        }
        let paths_before = store.append_paths();
        let start = Instant::now();
        let deadline = start + self.duration;
        let mut tasks = Vec::new();
        for (w, session) in sessions.into_iter().enumerate() {
            let store = store.clone();
            let mut mix = Mix::new(pool.clone(), w, self.seed);
            let batch = self.batch;
            let shared = self.shared;
            tasks.push(tokio::spawn(async move {
                let mut head = Mix::header().len() as i64;
                let (mut events, mut appends) = (0u64, 0u64);
                let policy = RetryPolicy::default();
                while Instant::now() < deadline {
                    let events_of_batch = mix.next_batch(batch);
                    if shared {
                        store
                            .append_at_head(session, events_of_batch, &policy)
                            .await?;
                    } else {
                        let outcome = store.append(session, head, events_of_batch).await?;
                        head = outcome.events.last().map(|a| a.seq).unwrap_or(head);
                    }
                    events += batch as u64;
                    appends += 1;
                }
                Ok((events, appends))
            }));
        }
        let (events, appends) = join(tasks).await?;
        let elapsed = start.elapsed().as_secs_f64();
        // This repeat's groups alone: one store serves every cell.
        let paths = store.append_paths();
        tracing::debug!(
            locked = paths.locked - paths_before.locked,
            optimistic = paths.optimistic - paths_before.optimistic,
            abandoned = paths.optimistic_abandoned - paths_before.optimistic_abandoned,
            appends,
            "append cell's groups by path"
        );
        Ok(Measured {
            rate: events as f64 / elapsed,
            appends,
        })
    }

    /// The ceiling: a statement per batch, or (`grouped`) the batches
    /// queued meanwhile in one transaction.
    async fn ceiling(
        &self,
        raw: &Arc<Grouped>,
        pool: &Arc<TextPool>,
        grouped: bool,
    ) -> Result<Measured, Error> {
        let sessions = self.sessions();
        // Seqs come from a counter per session (shared by the writers of a
        // shared session): the ceiling has no conflicts to pay for.
        let one = Arc::new(AtomicI64::new(0));
        let counters: Vec<Arc<AtomicI64>> = (0..self.writers)
            .map(|_| match self.shared {
                true => one.clone(),
                false => Arc::new(AtomicI64::new(0)),
            })
            .collect();
        let start = Instant::now();
        let deadline = start + self.duration;
        let mut tasks = Vec::new();
        for (w, (session, counter)) in sessions.into_iter().zip(counters).enumerate() {
            let raw = raw.clone();
            let mut mix = Mix::new(pool.clone(), w, self.seed);
            let batch = self.batch;
            tasks.push(tokio::spawn(async move {
                let (mut events, mut appends) = (0u64, 0u64);
                while Instant::now() < deadline {
                    let events_of_batch = mix.next_batch(batch);
                    let first = counter.fetch_add(batch as i64, Ordering::Relaxed) + 1;
                    let rows = RawRow::of(session, first, &events_of_batch);
                    match grouped {
                        true => raw.insert(rows).await?,
                        false => raw.raw.insert_rows(&rows).await?,
                    }
                    events += batch as u64;
                    appends += 1;
                }
                Ok((events, appends))
            }));
        }
        let (events, appends) = join(tasks).await?;
        let elapsed = start.elapsed().as_secs_f64();
        Ok(Measured {
            rate: events as f64 / elapsed,
            appends,
        })
    }
}

type Counts = tokio::task::JoinHandle<Result<(u64, u64), Error>>;

async fn join(tasks: Vec<Counts>) -> Result<(u64, u64), Error> {
    let (mut events, mut appends) = (0, 0);
    for t in tasks {
        let (e, a) = t
            .await
            .map_err(|e| Error::Database(format!("a bench writer task failed: {e}")))??;
        events += e;
        appends += a;
    }
    Ok((events, appends))
}

/// The ceiling's bare table, on the store's own database. Public for the
/// probes in `examples/` that set other loops beside the ceiling.
pub enum Raw {
    /// On SQLite, one connection with the store's connection settings,
    /// shared by the writers as the store's one writer connection is: SQLite
    /// admits one writer at a time, and writers on connections of their own
    /// would take turns through the busy handler, which sleeps (a ceiling
    /// that weak is no ceiling; docs/benchmarks.md item 20).
    Sqlite(tokio::sync::Mutex<SqliteConnection>),
    /// On PostgreSQL, with the store's pool settings.
    Postgres(PgPool),
}

impl std::fmt::Debug for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Raw::Sqlite(_) => "Raw::Sqlite",
            Raw::Postgres(_) => "Raw::Postgres",
        })
    }
}

/// A fixed chain hash: the ceiling stores a value of the same size as the
/// store's sha256 hex without computing it.
const HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

impl Raw {
    /// Opens a pool on `url` and creates the table if it is missing.
    pub async fn open(kind: BackendKind, url: &str) -> Result<Raw, Error> {
        match kind {
            BackendKind::Sqlite => {
                let mut conn = crate::store::sqlite::connect_options(url)?
                    .connect()
                    .await
                    .map_err(Error::from_sqlx)?;
                sqlx::raw_sql(
                    "CREATE TABLE IF NOT EXISTS bench_raw (
                        position    INTEGER PRIMARY KEY,
                        session_id  TEXT    NOT NULL,
                        seq         INTEGER NOT NULL,
                        event_id    TEXT    NOT NULL UNIQUE,
                        type        TEXT    NOT NULL,
                        payload     TEXT    NOT NULL,
                        recorded_at TEXT    NOT NULL,
                        hash        TEXT,
                        UNIQUE (session_id, seq))",
                )
                .execute(&mut conn)
                .await
                .map_err(Error::from_sqlx)?;
                Ok(Raw::Sqlite(tokio::sync::Mutex::new(conn)))
            }
            BackendKind::Postgres => {
                let pool = crate::store::postgres::ceiling_pool_options()
                    .connect_with(crate::store::postgres::ceiling_connect_options(url)?)
                    .await
                    .map_err(Error::from_sqlx)?;
                sqlx::raw_sql(
                    "CREATE TABLE IF NOT EXISTS bench_raw (
                        position    BIGSERIAL   PRIMARY KEY,
                        session_id  UUID        NOT NULL,
                        seq         BIGINT      NOT NULL,
                        event_id    UUID        NOT NULL UNIQUE,
                        type        TEXT        NOT NULL,
                        payload     TEXT        NOT NULL,
                        recorded_at TIMESTAMPTZ NOT NULL,
                        hash        TEXT,
                        UNIQUE (session_id, seq))",
                )
                .execute(&pool)
                .await
                .map_err(Error::from_sqlx)?;
                // Payloads compressed as the store compresses them (lz4
                // where the server has it, migration 0008): the ratio then
                // measures the store's own work, not a faster compressor.
                // A server older than 14 has no `attcompression` (and one
                // method): the query fails and nothing is changed.
                let method: Option<String> = sqlx::query_scalar(
                    "SELECT CASE attcompression WHEN 'l' THEN 'lz4' WHEN 'p' THEN 'pglz' END \
                     FROM pg_attribute WHERE attrelid = to_regclass('events') AND attname = 'payload'",
                )
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten()
                .flatten();
                if let Some(method) = method {
                    sqlx::raw_sql(&format!(
                        "ALTER TABLE bench_raw ALTER COLUMN payload SET COMPRESSION {method}"
                    ))
                    .execute(&pool)
                    .await
                    .map_err(Error::from_sqlx)?;
                }
                Ok(Raw::Postgres(pool))
            }
        }
    }

    /// One statement inserting the batch with seqs `first_seq..`.
    pub async fn insert(
        &self,
        session: Uuid,
        first_seq: i64,
        events: &[NewEvent],
    ) -> Result<(), Error> {
        self.insert_rows(&RawRow::of(session, first_seq, events))
            .await
    }

    /// Inserts `rows` (of any sessions) in one transaction: one statement
    /// when they fit one (SQLite binds at most `SQLITE_ROWS` rows a
    /// statement, as the store's inserts do), else a transaction of such
    /// statements.
    pub async fn insert_rows(&self, rows: &[RawRow]) -> Result<(), Error> {
        let now = chrono::Utc::now();
        match self {
            Raw::Sqlite(conn) => {
                let at = now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
                let mut conn = conn.lock().await;
                if rows.len() <= SQLITE_ROWS {
                    sqlite_insert(rows, &at)
                        .build()
                        .execute(&mut *conn)
                        .await
                        .map_err(Error::from_sqlx)?;
                } else {
                    let mut tx = conn.begin().await.map_err(Error::from_sqlx)?;
                    for chunk in rows.chunks(SQLITE_ROWS) {
                        sqlite_insert(chunk, &at)
                            .build()
                            .execute(&mut *tx)
                            .await
                            .map_err(Error::from_sqlx)?;
                    }
                    tx.commit().await.map_err(Error::from_sqlx)?;
                }
            }
            Raw::Postgres(pool) => {
                let n = rows.len();
                sqlx::query(
                    "INSERT INTO bench_raw (session_id, seq, event_id, type, payload, recorded_at, hash) \
                     SELECT * FROM UNNEST($1::UUID[], $2::BIGINT[], $3::UUID[], $4::TEXT[], $5::TEXT[], $6::TIMESTAMPTZ[], $7::TEXT[])",
                )
                .bind(rows.iter().map(|r| r.session).collect::<Vec<_>>())
                .bind(rows.iter().map(|r| r.seq).collect::<Vec<_>>())
                .bind(rows.iter().map(|r| r.event_id).collect::<Vec<_>>())
                .bind(rows.iter().map(|r| r.kind).collect::<Vec<_>>())
                .bind(rows.iter().map(|r| r.payload.as_str()).collect::<Vec<_>>())
                .bind(vec![now; n])
                .bind(vec![HASH; n])
                .execute(pool)
                .await
                .map_err(Error::from_sqlx)?;
            }
        }
        Ok(())
    }

    /// Closes the pool.
    pub async fn close(self) {
        match self {
            Raw::Sqlite(c) => {
                // Every measured row was committed before: a failure to
                // close loses none of them.
                let _ = c.into_inner().close().await;
            }
            Raw::Postgres(p) => p.close().await,
        }
    }
}

/// The multi-row `INSERT` of `rows` into the SQLite ceiling's table.
fn sqlite_insert<'a>(rows: &'a [RawRow], at: &'a str) -> QueryBuilder<'a, Sqlite> {
    let mut q = QueryBuilder::<Sqlite>::new(
        "INSERT INTO bench_raw (session_id, seq, event_id, type, payload, recorded_at, hash) ",
    );
    q.push_values(rows, |mut b, r| {
        b.push_bind(r.session.to_string())
            .push_bind(r.seq)
            .push_bind(r.event_id.to_string())
            .push_bind(r.kind)
            .push_bind(r.payload.as_str())
            .push_bind(at)
            .push_bind(HASH);
    });
    q
}

/// The most rows one SQLite insert of the ceiling binds: the store's
/// multi-row inserts stop at 500 too (7 parameters a row, well inside
/// SQLite's limit of 32 766).
const SQLITE_ROWS: usize = 500;

/// One row of the ceiling's table.
pub struct RawRow {
    session: Uuid,
    seq: i64,
    event_id: Uuid,
    kind: &'static str,
    payload: String,
}

impl std::fmt::Debug for RawRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawRow")
            .field("session", &self.session)
            .field("seq", &self.seq)
            .field("event_id", &self.event_id)
            .field("kind", &self.kind)
            .field("payload_bytes", &self.payload.len())
            .finish()
    }
}

impl RawRow {
    /// The rows of `events`, with seqs `first_seq..`, serialized as the
    /// store serializes them.
    pub fn of(session: Uuid, first_seq: i64, events: &[NewEvent]) -> Vec<RawRow> {
        events
            .iter()
            .enumerate()
            .map(|(i, e)| RawRow {
                session,
                seq: first_seq + i as i64,
                event_id: e.event_id.unwrap_or_else(Uuid::now_v7),
                kind: e.body.type_name(),
                payload: e.body.to_json_text(),
            })
            .collect()
    }
}

/// The grouped ceiling: [`Raw`] with the store's way of committing what
/// several writers wait to write. A writer queues its rows, then takes the
/// slot; whoever holds it inserts every queued row in one transaction and
/// answers each writer. A writer that finds its rows answered when it gets
/// the slot is done.
pub struct Grouped {
    /// The table and its connection(s).
    pub raw: Raw,
    queue: std::sync::Mutex<Vec<Queued>>,
    slot: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Grouped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grouped")
            .field("raw", &self.raw)
            .finish_non_exhaustive()
    }
}

/// One writer's rows waiting in [`Grouped`], and where to answer.
struct Queued {
    rows: Vec<RawRow>,
    reply: tokio::sync::oneshot::Sender<Result<(), String>>,
}

impl Grouped {
    /// `raw`, with an empty queue.
    pub fn new(raw: Raw) -> Grouped {
        Grouped {
            raw,
            queue: std::sync::Mutex::new(Vec::new()),
            slot: tokio::sync::Mutex::new(()),
        }
    }

    /// Inserts `rows`, with whatever other writers queued meanwhile.
    pub async fn insert(&self, rows: Vec<RawRow>) -> Result<(), Error> {
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        let queued = |e: String| Error::Database(format!("the ceiling's queue: {e}"));
        self.queue
            .lock()
            .map_err(|e| queued(e.to_string()))?
            .push(Queued { rows, reply });
        let _slot = self.slot.lock().await;
        if let Ok(done) = answer.try_recv() {
            return done.map_err(Error::Database);
        }
        // Everything queued before this writer took the slot, its own rows
        // among them (no earlier holder answered them).
        let group: Vec<Queued> =
            std::mem::take(&mut *self.queue.lock().map_err(|e| queued(e.to_string()))?);
        let mut rows = Vec::new();
        let mut replies = Vec::new();
        for q in group {
            rows.extend(q.rows);
            replies.push(q.reply);
        }
        let done = self.raw.insert_rows(&rows).await.map_err(|e| e.to_string());
        for reply in replies {
            let _ = reply.send(done.clone());
        }
        answer
            .await
            .map_err(|_| queued("a writer's rows were not answered".to_owned()))?
            .map_err(Error::Database)
    }
}
