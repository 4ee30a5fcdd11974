//! The Store API: append, history, context and activations, on SQLite or
//! PostgreSQL behind one interface.
//!
//! The append path is written once (`append_in`) against the small
//! `LogTx` trait that each backend implements for its own transaction
//! type; SQL lives in the backend modules. Each append:
//!
//! 1. takes the write lock up front (SQLite `BEGIN IMMEDIATE`, PostgreSQL the
//!    position counter row), so what it reads cannot change under it and no
//!    two appends can race for a seq or an event id;
//! 2. answers an idempotent retry with the stored seqs (§2);
//! 3. checks the expected seq (a [`Error::Conflict`]);
//! 4. validates each event against the session state after the batch's
//!    earlier events (§4) and inserts the batch in one transaction.
//!
//! A group of appends to sessions this process wrote last is judged against
//! what those appends knew (`Known`) and written in one round trip that
//! checks, under the lock, that nothing changed since (`group`,
//! docs/design.md "Optimistic appends"); the steps above run
//! again under the lock when it did.
//!
//! The session state used for validation is cached per session and caught up
//! by folding only the events appended since (by this or another process), so
//! appending to a long session does not re-read its history. An append moves
//! the state out of the cache under the write lock and back after the commit
//! (no clone), and the cache keeps only the calls of the effective window
//! and a bounded few unanswered ones before it (the calls index has the
//! rest), so neither the time of an append nor the memory of the cache
//! grows with the session's history.
//!
//! Where each part lives: this file holds the [`Store`] API and the `LogTx`
//! trait; `read` how a state is read in a transaction; `rows` the derived
//! rows an append writes; `append` the judgement and write of one batch;
//! `group` the group commit around it; `cache` the per-session states;
//! `rebuild` `verify`, `rebuild` and the activation-change backfill;
//! `chain` the hash chain; `explain`, `query` and `subscribe` the audit
//! answers, the cross-session queries and the feed's waiters; `sqlite` and
//! `postgres` the backends, with all the SQL.

mod append;
mod cache;
mod chain;
mod explain;
mod group;
pub(crate) mod postgres;
pub mod query;
mod read;
mod rebuild;
mod rows;
pub(crate) mod sqlite;
mod subscribe;

pub(crate) use append::append_in;
pub use cache::CacheUsage;
pub(crate) use cache::{Known, StateCache, Warm};
pub use chain::{ChainHead, IntegrityReport};
pub use explain::{ContextPages, EventPages};
#[doc(hidden)]
pub use postgres::BACKFILL_LOCK;
use read::*;
pub(crate) use read::{take_within, take_within_cut, WindowRead};
pub use rows::ChangeRow;
pub(crate) use rows::*;
pub use subscribe::{Subscription, Watch};

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Mutex;
use std::task::Poll;

use chrono::{DateTime, SubsecRound, Utc};
use tracing::{debug, instrument};
use uuid::Uuid;

use crate::error::{Error, Result, Rule, ValidationError};
use crate::event::{EventBody, NewEvent, StoredEvent};
use crate::projector::{Activation, Activations, Context, SessionState, View};
use crate::validate::DEFAULT_MAX_EVENT_BYTES;

/// How many events one read fetches when folding a log.
const FOLD_PAGE: i64 = 2_000;

/// The most bytes of payloads a page of the log holds (more by at most
/// one event): every paged pass over events (folds, long contexts, the
/// feed, `export`, the chain's checks) stops there, so 1 000 or 2 000
/// events of a few KB make a page, but not of the largest accepted size
/// (1 000 events of 1 MiB were a page of a gigabyte).
pub const PAGE_BYTES: usize = 4 << 20;

/// How long one transaction of a one-time backfill (the hash chain of
/// sessions from before migration 0004, the activation changes of those
/// from before 0005) goes on taking sessions, at least one: on PostgreSQL
/// it holds the position counter, which every other process's append and
/// open wait for (10 s at most, then exit 4). 50 sessions of 25 000
/// events held it about 8 s in an upgrade review; a session longer than
/// the budget still goes whole, in one transaction.
const BACKFILL_TX_BUDGET: std::time::Duration = std::time::Duration::from_millis(500);

/// [`PAGE_BYTES`], by the name the folds use.
const FOLD_PAGE_BYTES: usize = PAGE_BYTES;

/// The longest window an answer that needs no rows reads (the activation
/// set, recovery); a longer one is answered from the view's evidence and
/// the events after it ([`Store::activations`]). At or below it, the
/// window is read and the state cached, as for the context.
pub const ROWLESS_WINDOW: i64 = FOLD_PAGE;

/// What a latest-state read must be able to answer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Needs {
    /// The context: the window's rows.
    Rows,
    /// Only the activation set, mode, catalogs and window bounds.
    Evidence,
}

/// A latest state read without a transaction (`Store::latest_fast`).
enum Latest {
    /// With the window's rows: answers everything, and is cached.
    Full(SessionState),
    /// Without them ([`SessionState::from_view_without_rows`]): answers
    /// only the activation set and recovery, and is cached apart
    /// ([`Store::latest_without_rows`]).
    Rowless(SessionState),
    /// Read from the cache, still the latest: with rows when they were
    /// needed or are short, else without ([`SessionState::without_rows`]).
    /// Nothing to cache again.
    Cached(SessionState),
}

/// How many groups of appends (one commit each, see `group`) this process
/// committed each way: a figure for operators and tests, since the
/// optimistic path is the one that makes an append one round trip
/// (docs/design.md, "Optimistic appends").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppendPaths {
    /// Groups judged against the log under the write lock.
    pub locked: u64,
    /// Groups judged against this process's cached states and written in
    /// one round trip (on SQLite, only while no other process writes
    /// between this one's groups).
    pub optimistic: u64,
    /// Optimistic groups whose write found the log moved (another instance
    /// appended) or that a judgement could not finish from the cache; each
    /// was then judged again under the lock, and counts there too.
    pub optimistic_abandoned: u64,
    /// Queries of rows that optimistic groups sent ahead of their commit,
    /// while judging the rest (SQLite only; docs/design.md, "Rows sent
    /// ahead").
    pub sends_ahead: u64,
}

/// Store settings beyond the URL.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Largest accepted event, in bytes of JSON text (§4).
    pub max_event_bytes: usize,
    /// PostgreSQL: how long an open waits for another instance that is
    /// migrating the database (15 minutes by default: an index build of a
    /// large log takes minutes) before it fails, saying so. Bounded so
    /// that an instance frozen while it holds the migration lock cannot
    /// hold every open behind it until its connection dies.
    pub migration_lock_wait: std::time::Duration,
    /// Seconds to wait for a connection before saying the storage is
    /// unavailable; at most [`MAX_CONNECT_SECS`] (a day), however large.
    pub connect_timeout_secs: u64,
    /// Fault injection for tests: sleep this long after the events are
    /// written and before the transaction commits (holding the write lock).
    #[doc(hidden)]
    pub fault_pause_before_commit: Option<std::time::Duration>,
    /// Fault injection for tests: sleep this long in a read of a state as
    /// of a past seq, holding its connection (a long fold).
    #[doc(hidden)]
    pub fault_pause_in_long_read: Option<std::time::Duration>,
    /// Fault injection for tests: sleep this long after the commit and
    /// before the append returns (a reply that may be lost).
    #[doc(hidden)]
    pub fault_pause_after_commit: Option<std::time::Duration>,
    /// Fault injection for tests: this many committed appends are answered
    /// with [`Error::OutcomeUnknown`] instead of their outcome (a reply
    /// lost after the commit), then the count stops at 0.
    #[doc(hidden)]
    pub fault_lose_replies: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
    /// The longest one append may take, queue and commit included, before
    /// it answers [`Error::OutcomeUnknown`] (it may still have committed).
    /// `None` (the default) waits as long as the database takes; the CLI's
    /// `import` and `append` set `--write-timeout`, so that a database that
    /// stops answering is said within seconds (SEMANTICS §9).
    pub write_deadline: Option<std::time::Duration>,
    /// The longest one round trip to PostgreSQL may take before what made
    /// it answers [`Error::Unavailable`]: each statement of a read, of a
    /// write transaction (`rebuild`, the backfills at open, the locked
    /// path of an append, whose `COMMIT` cut off answers
    /// [`Error::OutcomeUnknown`]) and the check of the schema at open. Per round
    /// trip, not per call: `verify` or a fold at `--at-seq` of a long
    /// session make many, each bounded. `None` (the default) waits as long
    /// as the server takes; the CLI sets `--read-timeout`. SQLite is local
    /// and its reads, in WAL mode, wait for no lock, so it is not bounded.
    pub read_deadline: Option<std::time::Duration>,
    /// Whether opening a SQLite path that does not exist, or a PostgreSQL
    /// database without the store's tables, creates the store there (the
    /// default). The CLI's commands that only read set it to `false`, so a
    /// mistyped path or database name (or another application's database)
    /// is an error ([`Error::NotAStore`]), not a new empty store.
    pub create_if_missing: bool,
    /// The longest window the activation set and recovery read
    /// ([`ROWLESS_WINDOW`]); tests set 0 to answer every session with a
    /// view from the view alone.
    #[doc(hidden)]
    pub rowless_window: i64,
    /// The payload bytes after which the cold read stops reading the
    /// events after the view (`WindowRead`), and a context's first page
    /// ([`Store::context_paged`]) stops (4 MiB); tests set it small to cut
    /// every such page.
    #[doc(hidden)]
    pub window_read_bytes: usize,
    /// About how many bytes the cached session states may hold
    /// ([`DEFAULT_STATE_CACHE_BYTES`]); past it the least recently used
    /// are dropped (and read again from the view when next needed). The
    /// states of sessions read without their window are kept apart under
    /// the same budget. One state larger than the budget is still kept,
    /// beside it: its appends would otherwise read its whole window each
    /// time (docs/design.md, "The state cache").
    pub state_cache_bytes: usize,
}

/// [`StoreOptions::state_cache_bytes`] unless set: 256 MiB, a few hundred
/// sessions with windows of some MB, or one never-compacted session of
/// about 10^5 events of a few KB.
pub const DEFAULT_STATE_CACHE_BYTES: usize = 256 << 20;

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            connect_timeout_secs: 5,
            fault_pause_before_commit: None,
            fault_pause_in_long_read: None,
            fault_pause_after_commit: None,
            fault_lose_replies: None,
            write_deadline: None,
            read_deadline: None,
            rowless_window: ROWLESS_WINDOW,
            window_read_bytes: FOLD_PAGE_BYTES,
            create_if_missing: true,
            state_cache_bytes: DEFAULT_STATE_CACHE_BYTES,
            migration_lock_wait: std::time::Duration::from_secs(15 * 60),
        }
    }
}

/// How [`Store::append_at_head`] retries.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Appends tried before giving up (at least 1).
    pub max_attempts: u32,
    /// The first backoff; it doubles each retry, with jitter.
    pub initial_backoff: std::time::Duration,
    /// The longest backoff.
    pub max_backoff: std::time::Duration,
    /// How long storage may stay unavailable before the append gives up,
    /// whatever attempts are left: each attempt at an unreachable database
    /// waits out the connection timeout (5 s), so twenty of them took
    /// 100 s to say what one says in 5 (SEMANTICS §9: said within
    /// seconds). Checked after each attempt that ends unavailable, counted
    /// from the first attempt; a restart shorter than this is ridden out.
    pub max_unavailable: std::time::Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 20,
            initial_backoff: std::time::Duration::from_millis(5),
            max_backoff: std::time::Duration::from_millis(500),
            max_unavailable: std::time::Duration::from_secs(10),
        }
    }
}

/// The longest [`StoreOptions::connect_timeout_secs`] taken (a day): the
/// pool adds the timeout to the current instant, which overflows (and
/// panics) for values near `u64::MAX` seconds.
pub const MAX_CONNECT_SECS: u64 = 86_400;

/// What one appended event was given by the store.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Appended {
    /// The event's id (supplied or generated).
    pub event_id: Uuid,
    /// Its seq in the session.
    pub seq: i64,
    /// Its global position.
    pub position: i64,
}

/// The outcome of an append.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendOutcome {
    /// One entry per event of the batch, in order.
    pub events: Vec<Appended>,
    /// True when the whole batch was already stored (an idempotent retry)
    /// and nothing was written.
    pub replayed: bool,
    /// True for a replay that [`Store::append_at_head`]'s retry found
    /// after an earlier attempt of the same call lost its answer: that
    /// attempt most likely stored the batch (the call gave the events
    /// their ids), so a caller counting what it stored should count it.
    pub confirmed_on_retry: bool,
}

/// The restart-recovery state of a session (see [`Store::recover`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Recovery {
    /// The session.
    pub session_id: Uuid,
    /// The latest seq: append after it.
    pub latest_seq: i64,
    /// The current mode.
    pub mode: String,
    /// The current mode's deferred catalog.
    pub catalog: Vec<String>,
    /// The deferred activation set, with evidence seqs.
    pub tools: Vec<Activation>,
    /// The first seq of the effective context.
    pub context_start_seq: i64,
    /// The seq of the latest compaction, if any.
    pub compaction_seq: Option<i64>,
    /// Its summary.
    pub summary: Option<String>,
}

/// The operations the shared append path needs inside one write
/// transaction. Each backend implements it for its transaction type.
pub(crate) trait LogTx: Send {
    /// The session's current seq (0 when it has no events).
    fn head_seq(&mut self, session_id: Uuid) -> impl Future<Output = Result<i64>> + Send;
    /// The session's current seq and that event's chain hash, in one
    /// statement (the append path's; a backend may also note what it needs
    /// to reserve positions without another statement).
    fn head(
        &mut self,
        session_id: Uuid,
    ) -> impl Future<Output = Result<(i64, Option<String>)>> + Send;
    /// The stored events with any of these ids.
    fn stored_by_ids(
        &mut self,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<Vec<StoredEvent>>> + Send;
    /// Events of a session with `after < seq <= upto`, in seq order,
    /// stopping after the one that brings the payloads read to `max_bytes`
    /// (at least one event when there is one; `usize::MAX` for all): rows
    /// are decoded as they stream in, so a page of large events never sits
    /// in memory whole.
    fn range(
        &mut self,
        session_id: Uuid,
        after: i64,
        upto: i64,
        max_bytes: usize,
    ) -> impl Future<Output = Result<Vec<StoredEvent>>> + Send;
    /// The stored events with any of `ids`, and the session's head seq and
    /// its hash: the reads that open every append. The default makes two
    /// statements of it; a backend may make one.
    fn judge_reads(
        &mut self,
        session_id: Uuid,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<(Vec<StoredEvent>, i64, Option<String>)>> + Send {
        async move {
            let stored = match ids.is_empty() {
                true => Vec::new(),
                false => self.stored_by_ids(ids).await?,
            };
            let (head, hash) = self.head(session_id).await?;
            Ok((stored, head, hash))
        }
    }
    /// Reads ahead what the group's judgements will ask for: the heads of
    /// `sessions`, the stored events with any of `ids`, and (where the
    /// backend serves them too) the views of `views` (sessions whose view
    /// this process's cache does not know; a backend may read those of all
    /// `sessions`) and the calls index rows of `calls` (session, call id),
    /// in one round trip, so that the reads of each append of a group cost
    /// none until the transaction writes that session. A view not read
    /// ahead is read when asked for. The default reads nothing.
    fn prefetch(
        &mut self,
        sessions: &[Uuid],
        views: &[Uuid],
        ids: &[Uuid],
        calls: &[(Uuid, &str)],
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (sessions, views, ids, calls);
        async { Ok(()) }
    }
    /// Writes an accepted batch: its rows, calls, view and owner, and the
    /// wake-up. The default makes a statement of each; a backend may make
    /// one statement of all.
    fn write_accepted(&mut self, w: Accepted<'_>) -> impl Future<Output = Result<()>> + Send {
        async move {
            self.insert(w.rows).await?;
            if !w.calls.is_empty() {
                self.record_calls(w.session_id, w.calls).await?;
            }
            if let Some(view) = w.view {
                self.write_view(view).await?;
            }
            if !w.changes.is_empty() {
                self.record_changes(w.changes).await?;
            }
            if let Some(tenant) = w.claim_for {
                self.claim_session(w.session_id, tenant).await?;
            }
            self.notify(w.session_id, w.seq).await
        }
    }
    /// At most how many judged rows this transaction takes ahead of their
    /// batch's acceptance, to write them while the judgement goes on
    /// (docs/design.md, "Rows sent ahead"); `None`: it takes only accepted
    /// batches. Only a transaction that any refusal abandons whole may
    /// (SQLite's optimistic one): rows of a batch refused later are then
    /// undone with it. Its positions are reserved before the judgement.
    fn rows_ahead(&self) -> Option<usize> {
        None
    }
    /// Rows of accepted batches waiting in this transaction to be sent.
    fn rows_waiting(&self) -> usize {
        0
    }
    /// Sends the rows waiting in this transaction, then `rows` (the
    /// leading judged rows of the batch being judged, none of them sent
    /// before), to be written while the caller judges on. Only called
    /// when [`LogTx::rows_ahead`] is `Some`.
    fn send_ahead(&mut self, rows: &[PendingRow]) -> impl Future<Output = Result<()>> + Send {
        let _ = rows;
        async {
            Err(Error::Database(
                "this transaction takes no rows ahead of their batch".to_owned(),
            ))
        }
    }
    /// Reserves `n` global positions; returns the first. A log whose last
    /// position leaves no room for `n` more (written around the store) is
    /// said corrupt ([`append::no_room_after`]), not overflowed.
    fn reserve_positions(&mut self, n: i64) -> impl Future<Output = Result<i64>> + Send;
    /// Inserts the rows.
    fn insert(&mut self, rows: &[PendingRow]) -> impl Future<Output = Result<()>> + Send;
    /// The session's materialized view, if it has one.
    fn load_view(
        &mut self,
        session_id: Uuid,
    ) -> impl Future<Output = Result<Option<ViewRow>>> + Send;
    /// Inserts or replaces the session's materialized view.
    fn write_view(&mut self, view: &ViewRow) -> impl Future<Output = Result<()>> + Send;
    /// The calls index rows of these call ids.
    fn calls(
        &mut self,
        session_id: Uuid,
        call_ids: &[String],
    ) -> impl Future<Output = Result<Vec<CallRow>>> + Send;
    /// Writes calls into the calls index in one statement: a new call is
    /// inserted, a known one gets its result seq (an upsert). Each call id
    /// appears at most once in `rows`.
    fn record_calls(
        &mut self,
        session_id: Uuid,
        rows: &[CallRow],
    ) -> impl Future<Output = Result<()>> + Send;
    /// The seq of the session's latest refresh point (0 without one).
    fn last_refresh_seq(&mut self, session_id: Uuid) -> impl Future<Output = Result<i64>> + Send;
    /// Removes the session's view and calls index (before a rebuild).
    fn clear_derived(&mut self, session_id: Uuid) -> impl Future<Output = Result<()>> + Send;
    /// Every session id in the log, in id order.
    fn session_ids(&mut self) -> impl Future<Output = Result<Vec<Uuid>>> + Send;
    /// Tells listeners, at commit, that the session reached `seq` (a
    /// wake-up only: PostgreSQL NOTIFY with "session:seq"; SQLite no-op).
    fn notify(&mut self, session_id: Uuid, seq: i64) -> impl Future<Output = Result<()>> + Send;
    /// The tenant recorded as the session's owner, if any (docs/api.md,
    /// "Tenants").
    fn session_owner(
        &mut self,
        session_id: Uuid,
    ) -> impl Future<Output = Result<Option<String>>> + Send;
    /// Records `tenant` as the owner of a session being created.
    fn claim_session(
        &mut self,
        session_id: Uuid,
        tenant: &str,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Events of a session with `seq > after`, at most `limit` and
    /// [`PAGE_BYTES`] of payloads (at least one), in seq order, each with
    /// its stored chain hash.
    fn chained_page(
        &mut self,
        session_id: Uuid,
        after: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<chain::ChainedRow>>> + Send;
    /// Fills in the missing hash of the event at `position`.
    fn set_hash(&mut self, position: i64, hash: &str) -> impl Future<Output = Result<()>> + Send;
    /// Sessions written before the chain existed and not chained yet.
    fn backfill_pending(&mut self, limit: i64) -> impl Future<Output = Result<Vec<Uuid>>> + Send;
    /// Whether `session_id` is such a session.
    fn is_backfill_pending(
        &mut self,
        session_id: Uuid,
    ) -> impl Future<Output = Result<bool>> + Send;
    /// Marks a session chained.
    fn backfill_done(&mut self, session_id: Uuid) -> impl Future<Output = Result<()>> + Send;
    /// `(number of events, largest position, positions handed out)`: equal
    /// when no row was removed.
    fn position_summary(&mut self) -> impl Future<Output = Result<(i64, i64, i64)>> + Send;
    /// Inserts rows of `activation_changes`.
    fn record_changes(&mut self, rows: &[ChangeRow]) -> impl Future<Output = Result<()>> + Send;
    /// The session's `activation_changes`, in seq then name order.
    fn load_changes(
        &mut self,
        session_id: Uuid,
    ) -> impl Future<Output = Result<Vec<ChangeRow>>> + Send;
    /// Sessions whose activation changes were never computed (written
    /// before migration 0005).
    fn changes_backfill_pending(
        &mut self,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send;
    /// Marks a session's activation changes computed.
    fn changes_backfill_done(
        &mut self,
        session_id: Uuid,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Commits.
    fn commit(self) -> impl Future<Output = Result<()>> + Send;
    /// Commits a group of appends: as [`LogTx::commit`], but a `COMMIT`
    /// sent to a server whose answer was lost (it may have committed) is
    /// [`Error::OutcomeUnknown`]; a failure before it (nothing stored) is
    /// said as it is. SQLite commits in this process and knows.
    fn commit_append(self) -> impl Future<Output = Result<()>> + Send
    where
        Self: Sized,
    {
        self.commit()
    }
}

#[derive(Clone)]
enum Backend {
    Sqlite(sqlite::SqliteBackend),
    Postgres(postgres::PgBackend),
}

/// The tenant of sessions created without one (through the CLI, the
/// library, or a server without tokens).
pub const DEFAULT_TENANT: &str = "default";

/// [`Store::tenants`]'s statement (SQLite's placeholder; PostgreSQL's
/// `$1` in its place): a session is counted by its first event, its
/// tenant the owner row's or, without one, the default tenant.
const TENANTS_SQL: &str = "SELECT COALESCE(o.tenant, ?) AS tenant, COUNT(*) AS sessions \
     FROM events e LEFT JOIN session_owners o ON o.session_id = e.session_id \
     WHERE e.seq = 1 GROUP BY 1";

/// Which database a URL names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// An embedded SQLite file.
    Sqlite,
    /// A PostgreSQL server.
    Postgres,
}

/// The migration a store is at: the latest of `known` that it has
/// applied with every one before it (a store missing one in the middle,
/// as only an edit leaves it, is at the one before the gap).
pub(crate) fn migrated_through(known: &sqlx::migrate::Migrator, applied: &[i64]) -> i64 {
    let mut through = 0;
    for m in known.iter() {
        if !applied.contains(&m.version) {
            break;
        }
        through = m.version;
    }
    through
}

/// What opening a store (or [`Store::migrate`]) did to its schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchemaChange {
    /// Nothing: it was at this build's latest migration.
    None,
    /// A new store: every migration, up to `to`.
    Created {
        /// The latest migration, now applied.
        to: i64,
    },
    /// An existing store moved from migration `from` to `to`; builds
    /// that know only migrations up to `from` refuse it from now on.
    Upgraded {
        /// The store's latest migration before.
        from: i64,
        /// Its latest now.
        to: i64,
    },
}

/// An open session store.
///
/// ```no_run
/// # async fn demo() -> session_store::Result<()> {
/// use session_store::{EventBody, NewEvent, Store};
/// let store = Store::open("sqlite://session-store.db").await?;
/// let session = uuid::Uuid::new_v4();
/// store
///     .append(session, 0, vec![NewEvent::new(EventBody::SessionStarted {
///         mode: "agent".into(),
///         metadata: None,
///     })])
///     .await?;
/// let tools = store.activations(session, None).await?;
/// assert!(tools.tools.is_empty());
/// # Ok(()) }
/// ```
pub struct Store {
    backend: Backend,
    options: StoreOptions,
    states: StateCache,
    /// Rowless states ([`SessionState::is_rowless`]) of sessions whose
    /// latest activation set was read without their window, kept apart
    /// from `states` (which appends and row-reading answers take): the
    /// next read applies only the events appended since.
    rowless: StateCache,
    /// How this process's groups were committed.
    paths: std::sync::Arc<group::PathCounters>,
    /// Appends waiting to be committed by the next group (`group`).
    queue: Mutex<Vec<group::Pending>>,
    /// Held by the task committing a group; whoever takes it next commits
    /// everything queued meanwhile.
    writer: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// The one source of wake-ups of every waiter (`subscribe`).
    pulse: std::sync::Arc<subscribe::Pulse>,
    /// Set by [`Store::close`]: an append retrying unavailable storage
    /// gives up at once, as no retry can succeed.
    closed: std::sync::atomic::AtomicBool,
    /// SQLite: when this store's run of back-to-back [`Store::rebuild`]s
    /// started, and when the last one ended ([`rebuild::REBUILD_RUN`]).
    rebuilds: Mutex<Option<(std::time::Instant, std::time::Instant)>>,
    /// What the open did to the schema.
    schema_change: SchemaChange,
    /// Reads that may hold a pooled connection for as long as a fold of a
    /// whole log takes (a state as of a past seq, `verify`): one fewer
    /// than the pool has, so one is always left for the short reads. Twelve
    /// `activations?at_seq` of a session of 10^6 events (7 s each) held
    /// all four of SQLite's, and another tenant's latest context waited
    /// 15 s for one and answered 503.
    long_reads: tokio::sync::Semaphore,
    /// Turns of the audit queries ([`query::AUDIT_TURNS`]).
    audit_turns: tokio::sync::Semaphore,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.kind())
            .finish_non_exhaustive()
    }
}

/// Which backend a URL selects: `postgres://`/`postgresql://` for
/// PostgreSQL, `sqlite:` or a plain file path for SQLite.
pub fn backend_kind(url: &str) -> BackendKind {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        BackendKind::Postgres
    } else {
        BackendKind::Sqlite
    }
}

/// Refuses a URL of a scheme the store does not know (`mysql://…`,
/// `POSTGRES://…`) before it is read as a file path, whose errors would
/// quote it whole, password and all.
fn check_scheme(url: &str) -> Result<()> {
    // Read as a SQLite path it would be a file of that name, and quoted
    // in messages with its password: refused unless such a file exists.
    if crate::error::is_conninfo(url) && !std::path::Path::new(url).exists() {
        return Err(Error::UrlRefused {
            url: url.to_owned(),
            why: "it is a libpq connection string (key=value words), which the store does not read: \
                  name a PostgreSQL database as postgres://USER@HOST:PORT/DBNAME (?sslmode=… and the \
                  other parameters after it), a SQLite store by its file's path"
                .to_owned(),
        });
    }
    if let Some(scheme) = crate::error::postgres_scheme_typo(url) {
        if !std::path::Path::new(url).exists() {
            return Err(Error::UrlRefused {
                url: url.to_owned(),
                why: format!("a PostgreSQL URL begins {scheme}:// (two slashes)"),
            });
        }
    }
    match url.split_once("://") {
        Some((scheme, _)) if !["sqlite", "postgres", "postgresql"].contains(&scheme) => {
            Err(Error::BadUrl(url.to_owned()))
        }
        _ => Ok(()),
    }
}

impl Store {
    /// Whether `url` names a SQLite file that does not exist yet, which
    /// opening with [`StoreOptions::create_if_missing`] would make. Never
    /// for PostgreSQL (its database exists before the store; opening makes
    /// only the store's tables). The CLI's writes judge their input before
    /// they make such a file (README, "--database").
    pub fn would_create_file(url: &str) -> Result<bool> {
        check_scheme(url)?;
        match backend_kind(url) {
            BackendKind::Postgres => Ok(false),
            BackendKind::Sqlite => sqlite::file_is_missing(url),
        }
    }

    /// Opens (creating a SQLite file if needed) and migrates a store.
    pub async fn open(url: &str) -> Result<Store> {
        Store::open_with(url, StoreOptions::default()).await
    }

    /// [`Store::open`] with explicit options.
    // Not the URL: it may carry the database password.
    #[instrument(skip(url, options), fields(backend = ?backend_kind(url)))]
    pub async fn open_with(url: &str, options: StoreOptions) -> Result<Store> {
        check_scheme(url)?;
        let backend = match backend_kind(url) {
            BackendKind::Postgres => {
                Backend::Postgres(postgres::PgBackend::connect(url, &options).await?)
            }
            BackendKind::Sqlite => {
                Backend::Sqlite(sqlite::SqliteBackend::connect(url, &options).await?)
            }
        };
        let long_reads = match &backend {
            Backend::Postgres(_) => postgres::MAX_CONNECTIONS,
            Backend::Sqlite(_) => sqlite::MAX_CONNECTIONS,
        }
        .saturating_sub(1)
        .max(1) as usize;
        let store = Store {
            long_reads: tokio::sync::Semaphore::new(long_reads),
            audit_turns: tokio::sync::Semaphore::new(query::AUDIT_TURNS),
            backend,
            states: StateCache::new(options.state_cache_bytes),
            rowless: StateCache::new(options.state_cache_bytes),
            options,
            paths: Default::default(),
            queue: Mutex::new(Vec::new()),
            writer: Default::default(),
            pulse: Default::default(),
            closed: Default::default(),
            rebuilds: Mutex::new(None),
            schema_change: SchemaChange::None,
        };
        let mut store = store;
        store.schema_change = store.migrate().await?;
        store.backfill().await?;
        Ok(store)
    }

    /// What this store's open did to its schema: an upgrade is said by
    /// the command line and `serve`, since builds older than this one
    /// refuse the store from then on (docs/operations.md, "Upgrades").
    pub fn schema_change(&self) -> SchemaChange {
        self.schema_change
    }

    /// Whether the store can serve: the database answers a read and, on
    /// SQLite, the path still names the file the store opened (a store
    /// whose file was removed or replaced must not look ready).
    pub async fn ready(&self) -> Result<()> {
        if let Backend::Sqlite(b) = &self.backend {
            b.check_file_identity().await?;
        }
        self.head_seq(Uuid::nil()).await.map(|_| ())
    }

    /// Which backend this store runs on.
    pub fn kind(&self) -> BackendKind {
        match self.backend {
            Backend::Sqlite(_) => BackendKind::Sqlite,
            Backend::Postgres(_) => BackendKind::Postgres,
        }
    }

    /// The version of the latest migration this build knows for the
    /// store's backend: once opened, the store's schema is at it (an open
    /// migrates, and refuses a store migrated past it).
    pub fn schema_version(&self) -> i64 {
        match self.backend {
            Backend::Sqlite(_) => sqlite::latest_migration(),
            Backend::Postgres(_) => postgres::latest_migration(),
        }
    }

    /// Applies pending migrations (also done by [`Store::open`]), and
    /// says what that changed.
    pub async fn migrate(&self) -> Result<SchemaChange> {
        let from = match &self.backend {
            Backend::Sqlite(b) => b.migrate().await?,
            Backend::Postgres(b) => b.migrate().await?,
        };
        let to = self.schema_version();
        Ok(match from {
            0 => SchemaChange::Created { to },
            from if from < to => SchemaChange::Upgraded { from, to },
            _ => SchemaChange::None,
        })
    }

    /// Appends `events` to `session_id` atomically, if the session is at
    /// `expected_seq` (0 for a new session). See the module docs for the
    /// order in which a batch is judged.
    ///
    /// Give events ids ([`NewEvent::with_id`]) when you may retry: an
    /// [`Error::OutcomeUnknown`] comes when the commit's answer was lost
    /// (the batch may be stored), and a future dropped after its group
    /// took it commits anyway. An [`Error::Unavailable`] stored nothing. The
    /// same batch sent again then answers with the stored seqs (§2); a
    /// batch without ids would be appended a second time, or conflict.
    ///
    /// A dropped future's outcome is settled only by sending the batch
    /// again: on PostgreSQL its statement may already be at the server,
    /// waiting for the position counter behind another writer, and commit
    /// up to the lock timeout (10 s) after the drop, while reads meanwhile
    /// do not find it. Sent again, it waits behind that statement and
    /// answers with the stored seqs, or stores it once.
    ///
    /// An empty batch stores nothing and answers no seqs once the expected
    /// seq holds. An event's `recorded_at`, when given, is kept as its time
    /// (how `import` restores an export); leave it `None` for the store's
    /// time of the append. JSON values the store could not read back (too
    /// deep, or a key serde_json reserves) are refused as the command line
    /// refuses them in text ([`crate::validate::check_values`]).
    pub async fn append(
        &self,
        session_id: Uuid,
        expected_seq: i64,
        events: Vec<NewEvent>,
    ) -> Result<AppendOutcome> {
        self.append_as(None, session_id, expected_seq, events).await
    }

    /// [`Store::append`] on behalf of a tenant (the HTTP server's callers).
    /// With `Some(tenant)`, a session owned by another tenant answers
    /// [`Error::SessionNotFound`], exactly like a missing one, before
    /// anything else is judged, and a session this append creates is
    /// recorded as the tenant's in the same transaction. `None` is the
    /// operator (CLI, library): no check, no claim.
    #[instrument(skip(self, events), fields(session = %session_id, n = events.len()))]
    pub async fn append_as(
        &self,
        tenant: Option<&str>,
        session_id: Uuid,
        expected_seq: i64,
        events: Vec<NewEvent>,
    ) -> Result<AppendOutcome> {
        self.append_inner(tenant, session_id, Some(expected_seq), events, None)
            .await
    }

    /// The answer to a batch whose event at index `events.len()` could not
    /// be read as an event (`invalid`: not JSON, not an object, a missing,
    /// mistyped or unknown field), with `events` the ones before it. Nothing
    /// is written. The batch is judged as [`Store::append_as`] judges one,
    /// in SEMANTICS §2's order: the tenant, the idempotent-retry check, the
    /// expected seq, then each event before the unreadable one against the
    /// session as it stands after the ones before it; only if all of those
    /// pass is the answer `invalid` itself (at its index).
    pub async fn refuse_batch(
        &self,
        tenant: Option<&str>,
        session_id: Uuid,
        expected_seq: i64,
        events: Vec<NewEvent>,
        invalid: ValidationError,
    ) -> Error {
        let invalid = invalid.at_index(events.len());
        match self
            .append_inner(
                tenant,
                session_id,
                Some(expected_seq),
                events,
                Some(invalid),
            )
            .await
        {
            // A batch with an unreadable event is never written, whatever
            // became of the attempt: not "may or may not be stored".
            Err(Error::OutcomeUnknown(why)) => Error::Unavailable(format!(
                "{why}; nothing of this batch was stored, since one of its events is not valid"
            )),
            Err(e) => e,
            Ok(_) => Error::Database(
                "a batch with an event that is not valid was accepted: this is a bug of the store"
                    .to_owned(),
            ),
        }
    }

    /// The append of [`Store::append_as`]; `expected_seq: None` appends at
    /// whatever the head is when the write lock is held (no conflict is
    /// possible then).
    ///
    /// The append joins the queue of the group commit (`group`): it waits
    /// for its reply, or for the writer slot, and then commits the whole
    /// queue in one transaction. The cached state of a session is taken out
    /// of the cache under the write lock and put back (advanced by the
    /// batch) after the commit: it is moved, never cloned (a clone costs the
    /// whole window, and used to cost every call of the session).
    async fn append_inner(
        &self,
        tenant: Option<&str>,
        session_id: Uuid,
        expected_seq: Option<i64>,
        events: Vec<NewEvent>,
        invalid_tail: Option<ValidationError>,
    ) -> Result<AppendOutcome> {
        let (events, invalid_tail) = cut_at_unreadable(events, invalid_tail);
        let append = self.append_once(tenant, session_id, expected_seq, events, invalid_tail);
        let Some(deadline) = self.options.write_deadline else {
            return append.await;
        };
        // A database that stops answering (a stopped server, a network
        // that drops packets) would otherwise be waited on without end:
        // the kernel acknowledges a stopped server's packets, and sqlx has
        // no read timeout. Dropping the append is safe (it is cancel-safe,
        // and an uncommitted transaction rolls back), but its commit may
        // have gone through unseen.
        tokio::time::timeout(deadline, append)
            .await
            .unwrap_or_else(|_| {
                Err(Error::OutcomeUnknown(format!(
                    "the database did not finish the append within {} s",
                    deadline.as_secs_f64()
                )))
            })
    }

    /// [`Store::append_inner`] without its deadline.
    async fn append_once(
        &self,
        tenant: Option<&str>,
        session_id: Uuid,
        expected_seq: Option<i64>,
        events: Vec<NewEvent>,
        invalid_tail: Option<ValidationError>,
    ) -> Result<AppendOutcome> {
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        let pending = group::Pending {
            tenant: tenant.map(str::to_owned),
            session_id,
            expected_seq,
            events,
            invalid_tail,
            reply,
            queued: std::time::Instant::now(),
        };
        match self.queue.lock() {
            Ok(mut q) => q.push(pending),
            Err(_) => {
                return Err(Error::Database(
                    "the append queue is unusable after a panic in another append".to_owned(),
                ))
            }
        }
        let lost = || {
            Error::OutcomeUnknown(
                "the task committing this append stopped before answering".to_owned(),
            )
        };
        let slot = tokio::select! {
            biased;
            result = &mut answer => return result.unwrap_or_else(|_| Err(lost())),
            slot = self.writer.clone().lock_owned() => slot,
        };
        // A group committed before this one may have taken the append.
        if let Ok(result) = answer.try_recv() {
            return result;
        }
        let batch = self
            .queue
            .lock()
            .map(|mut q| std::mem::take(&mut *q))
            .unwrap_or_default();
        // Every earlier group has answered (it held the slot until then),
        // so this append is either answered or in the batch: a batch of one
        // is this append.
        let alone = batch.len() == 1;
        let commit = group::commit_group(
            self.backend.clone(),
            self.options.clone(),
            self.states.clone(),
            self.paths.clone(),
            batch,
            slot,
        );
        if alone {
            // A group of this append alone: committed in this task, which
            // saves a task switch and a wake-up on each side; if the caller
            // gives up, only its own append is abandoned (rolled back, or
            // committed without an answer, as any cancelled call).
            commit.await;
        } else {
            tokio::spawn(commit);
        }
        answer.await.unwrap_or_else(|_| Err(lost()))
    }

    /// Appends `events` at the session's current head, whatever it is. The
    /// head is read inside the append's own write transaction (SQLite's
    /// write lock, PostgreSQL's position counter lock), so no other writer
    /// can move it in between and the append never conflicts; the batch is
    /// validated against the session as it then stands. On unavailable
    /// storage it waits and tries again, with exponential backoff and
    /// jitter, up to `policy.max_attempts`; then [`Error::RetriesExhausted`],
    /// whose `last` is [`Error::OutcomeUnknown`] when any attempt's was
    /// (that attempt may have stored the batch; a later one that found the
    /// storage unavailable could not tell).
    /// Events without an id get one before the first attempt, so that a
    /// retry after a commit whose reply was lost answers idempotently
    /// instead of appending twice; give them ids yourself to make your own
    /// retries of this call safe too.
    pub async fn append_at_head(
        &self,
        session_id: Uuid,
        events: Vec<NewEvent>,
        policy: &RetryPolicy,
    ) -> Result<AppendOutcome> {
        self.append_at_head_as(None, session_id, events, policy)
            .await
    }

    /// [`Store::append_at_head`] on behalf of a tenant, as
    /// [`Store::append_as`] (`import --tenant`).
    pub async fn append_at_head_as(
        &self,
        tenant: Option<&str>,
        session_id: Uuid,
        events: Vec<NewEvent>,
        policy: &RetryPolicy,
    ) -> Result<AppendOutcome> {
        // Cut at an event whose values the store could not read back, before
        // anything clones the batch: a value deep enough to be refused may
        // be deep enough to overflow the stack of a recursive clone.
        let (events, invalid_tail) = cut_at_unreadable(events, None);
        // Every event gets its id before the first attempt: an attempt whose
        // commit went through unseen (its reply lost with the connection)
        // is then answered idempotently by the retry, not appended twice.
        let events: Vec<NewEvent> = events
            .into_iter()
            .map(|mut e| {
                e.event_id.get_or_insert_with(Uuid::now_v7);
                e
            })
            .collect();
        let mut backoff = policy.initial_backoff;
        let mut attempts = 0;
        let start = std::time::Instant::now();
        // The first attempt that may have committed unseen: a later one
        // that finds the storage unavailable does not make it less so.
        let mut uncertain: Option<String> = None;
        loop {
            attempts += 1;
            let result = self
                .append_inner(
                    tenant,
                    session_id,
                    None,
                    events.clone(),
                    invalid_tail.clone(),
                )
                .await;
            if let Err(Error::OutcomeUnknown(why)) = &result {
                uncertain.get_or_insert_with(|| why.clone());
            }
            match result {
                Ok(mut outcome) => {
                    outcome.confirmed_on_retry = outcome.replayed && uncertain.is_some();
                    return Ok(outcome);
                }
                // A closed store is not storage to wait for: said as it is
                // ([`Store::close`]), unless an earlier attempt's outcome
                // is unknown.
                Err(e @ Error::Unavailable(_))
                    if uncertain.is_none()
                        && self.closed.load(std::sync::atomic::Ordering::SeqCst) =>
                {
                    return Err(e)
                }
                Err(e)
                    if e.is_retryable()
                        && attempts < policy.max_attempts.max(1)
                        && !(matches!(e, Error::Unavailable(_) | Error::OutcomeUnknown(_))
                            && (start.elapsed() >= policy.max_unavailable
                                || self.closed.load(std::sync::atomic::Ordering::SeqCst))) =>
                {
                    debug!(session = %session_id, attempts, cause = %e, "append retried");
                    sleep_jittered(&mut backoff, policy).await;
                }
                Err(e) if e.is_retryable() => {
                    let last = match (uncertain, e) {
                        (Some(why), e @ Error::Unavailable(_)) => Error::OutcomeUnknown(format!(
                            "{why}, and a later attempt found the storage unavailable ({e})"
                        )),
                        (_, e) => e,
                    };
                    return Err(Error::RetriesExhausted {
                        session_id,
                        attempts,
                        last: Box::new(last),
                    });
                }
                // A later attempt's failure of the database does not make
                // an earlier unknown outcome known. (A judgement cannot
                // follow one: a stored batch answers as a replay.)
                Err(e @ (Error::Invalid(_) | Error::Conflict { .. })) => return Err(e),
                Err(e) => {
                    return Err(match uncertain {
                        Some(why) => Error::OutcomeUnknown(format!(
                            "{why}, and a later attempt failed ({e})"
                        )),
                        None => e,
                    })
                }
            }
        }
    }

    /// Every tenant that holds a session, with how many it holds, by name
    /// (sessions created without a tenant are [`DEFAULT_TENANT`]'s). What
    /// a store holds for whom, which no token document says once a
    /// tenant's tokens are retired: the list a move of the store goes
    /// through (docs/operations.md, "Moving a store"). Reads every
    /// session's first event: an operator's query, not a request's.
    pub async fn tenants(&self) -> Result<Vec<(String, i64)>> {
        let mut tenants = match &self.backend {
            Backend::Sqlite(b) => b.tenants().await?,
            Backend::Postgres(b) => b.tenants().await?,
        };
        // By bytes, the same on both backends (a PostgreSQL database's
        // collation orders names by its locale).
        tenants.sort_unstable();
        Ok(tenants)
    }

    /// One page of the global feed: events of every session with
    /// `position > after`, in position order, at most `limit`, and none
    /// after the one that brings the page's payloads to [`PAGE_BYTES`] (a
    /// page holds at least one event when there is one; a short page does
    /// not mean the end). Paging by position never skips an event that
    /// commits later (docs/design.md, "Global order").
    pub async fn feed(&self, after: i64, limit: i64) -> Result<Vec<StoredEvent>> {
        let limit = limit.clamp(0, 100_000);
        match &self.backend {
            Backend::Sqlite(b) => b.feed(after, limit, PAGE_BYTES).await,
            Backend::Postgres(b) => b.feed(after, limit, PAGE_BYTES).await,
        }
    }

    fn cached_state(&self, session_id: Uuid) -> Option<SessionState> {
        self.states.get(session_id)
    }

    fn cache_state(&self, state: SessionState) {
        self.states.put_read(state);
    }

    /// The session's latest seq (0 when it has no events).
    pub async fn head_seq(&self, session_id: Uuid) -> Result<i64> {
        match &self.backend {
            Backend::Sqlite(b) => b.head_seq(session_id).await,
            Backend::Postgres(b) => b.head_seq(session_id).await,
        }
    }

    /// One page of a session's history: events with seq > `after_seq`, at
    /// most `limit` of them, in seq order. A session that does not exist
    /// has an empty history (not [`Error::SessionNotFound`], which the
    /// reads of a state answer).
    pub async fn history(
        &self,
        session_id: Uuid,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<StoredEvent>> {
        self.history_within(session_id, after_seq, limit, usize::MAX)
            .await
    }

    /// One page of a session's history for a reader that must not hold
    /// `limit` events of the largest accepted size at once (an HTTP
    /// client asking for 1 000 events of 1 MiB each took the server to
    /// 1 GB per request): at most `limit` events and, past the first,
    /// [`PAGE_BYTES`] of payloads, and whether more follow (events after
    /// the page's last, including ones appended since the page was read).
    pub async fn history_page(
        &self,
        session_id: Uuid,
        after_seq: i64,
        limit: i64,
    ) -> Result<(Vec<StoredEvent>, bool)> {
        let limit = limit.clamp(0, 100_000);
        let mut events = self
            .history_within(session_id, after_seq, limit + 1, PAGE_BYTES)
            .await?;
        if events.len() as i64 > limit {
            events.truncate(limit as usize);
            return Ok((events, true));
        }
        // A short page ended at the session's head, or at its bytes.
        let more = match events.last() {
            Some(last) => self.head_seq(session_id).await? > last.seq,
            None => false,
        };
        Ok((events, more))
    }

    /// [`Store::history`] that stops after the event whose payload brings
    /// the page to `max_bytes` of JSON (a page holds at least one event
    /// when there is one): for a reader that must not hold `limit` events
    /// of the largest accepted size at once, such as an HTTP stream.
    pub async fn history_within(
        &self,
        session_id: Uuid,
        after_seq: i64,
        limit: i64,
        max_bytes: usize,
    ) -> Result<Vec<StoredEvent>> {
        let limit = limit.clamp(0, 100_000);
        match &self.backend {
            Backend::Sqlite(b) => b.page(session_id, after_seq, limit, max_bytes).await,
            Backend::Postgres(b) => b.page(session_id, after_seq, limit, max_bytes).await,
        }
    }

    /// The session folded up to `at_seq` (the latest seq when `None`).
    /// Errors: [`Error::SessionNotFound`], [`Error::SeqOutOfRange`].
    pub async fn state(&self, session_id: Uuid, at_seq: Option<i64>) -> Result<SessionState> {
        if at_seq.is_none() {
            match self.latest_fast(session_id, Needs::Rows).await? {
                Some(Latest::Full(state)) => {
                    self.cache_state(state.clone());
                    return Ok(state);
                }
                Some(Latest::Cached(state)) => return Ok(state),
                _ => {}
            }
        }
        self.state_read(session_id, at_seq).await
    }

    /// The latest state for an answer that needs no window rows (the
    /// activation set, recovery): as [`Store::state`], except that a
    /// session whose window is longer than [`ROWLESS_WINDOW`] is answered
    /// from its view and the events after it, without reading the window.
    /// A session that is never compacted has its whole log as its window:
    /// reading it took 0.8 s and 355 MB at 10^5 events
    /// (docs/benchmarks.md, item 21). Also the state an HTTP stream starts
    /// from, which then applies later events through
    /// [`Store::apply_to_rowless`], so an open stream does not hold a long
    /// window either.
    ///
    /// A rowless state is cached apart: the log only grows, so the state
    /// stays the fold of a prefix of it, and the next read applies the
    /// events appended since, in one statement when there are none. Before
    /// that, every read of such a session folded all the events after its
    /// view again (0.63 s at 10^5 events after the only prompt,
    /// docs/benchmarks.md item 26).
    pub(crate) async fn latest_without_rows(&self, session_id: Uuid) -> Result<SessionState> {
        if let Some(cached) = self.rowless.get(session_id) {
            let state = self
                .rowless_follow(cached, Vec::new(), true, i64::MAX)
                .await?;
            self.rowless.put_read(state.clone());
            return Ok(state);
        }
        match self.latest_fast(session_id, Needs::Evidence).await? {
            Some(Latest::Full(state)) => {
                self.cache_state(state.clone());
                Ok(state)
            }
            Some(Latest::Rowless(state)) => {
                self.rowless.put_read(state.clone());
                Ok(state)
            }
            Some(Latest::Cached(state)) => Ok(state),
            None => self.state_read(session_id, None).await,
        }
    }

    /// The rowless state of a view ([`SessionState::from_view_without_rows`])
    /// with the events after it up to `upto` applied: `first`, a first page
    /// of them as the view's read gave it (`first_cut`: stopped at its
    /// bytes), then the log's next pages ([`Store::rowless_follow`]).
    async fn rowless_from(
        &self,
        view: &View,
        first: Vec<StoredEvent>,
        first_cut: bool,
        upto: i64,
    ) -> Result<SessionState> {
        let session_id = view.session_id;
        if first.first().is_some_and(|e| e.seq != view.refresh_seq + 1) {
            return Err(Error::Corrupt(format!(
                "session {session_id}: the view is at seq {} but the next event the log has is at seq {}",
                view.refresh_seq, first[0].seq
            )));
        }
        let state = SessionState::from_view_without_rows(view);
        // The first page is all there was unless it is full or was cut at
        // its bytes.
        let more = first_cut || first.len() as i64 >= FOLD_PAGE;
        self.rowless_follow(state, first, more, upto).await
    }

    /// Applies to a rowless `state` the events after it up to `upto`:
    /// `first`, a page already read, then, while `more`, the log's next
    /// pages (a page may be short for its bytes, so only an empty one
    /// ends). The pages may hold events appended since the caller's read:
    /// the log is append-only, so the state is still the fold of a prefix
    /// of it.
    async fn rowless_follow(
        &self,
        mut state: SessionState,
        first: Vec<StoredEvent>,
        mut more: bool,
        upto: i64,
    ) -> Result<SessionState> {
        let session_id = state.session_id;
        let mut page = first;
        loop {
            for e in page {
                if e.seq > upto {
                    return Ok(state);
                }
                self.apply_to_rowless(&mut state, e).await?;
            }
            if !more || state.seq >= upto {
                return Ok(state);
            }
            page = self
                .history_within(session_id, state.seq, FOLD_PAGE, FOLD_PAGE_BYTES)
                .await?;
            more = !page.is_empty();
        }
    }

    /// The state after event `at` without the window's rows, read in one
    /// transaction a page at a time ([`rowless_state`]): what an activation
    /// set as of `at` needs, and the bounds of the context there. From the
    /// log alone unless `from_view`, which lets a view at or before `at`
    /// start it (a stream resuming after the latest refresh point, as every
    /// reconnecting client does). Errors: [`Error::SessionNotFound`],
    /// [`Error::SeqOutOfRange`].
    pub(crate) async fn rowless_at(
        &self,
        session_id: Uuid,
        at: i64,
        from_view: bool,
    ) -> Result<SessionState> {
        self.read_in_tx(session_id, Some(at), from_view, false)
            .await
    }

    /// [`read_state`] in a read transaction of the backend, with the
    /// cached state.
    async fn read_in_tx(
        &self,
        session_id: Uuid,
        at: Option<i64>,
        from_view: bool,
        rows: bool,
    ) -> Result<SessionState> {
        // A read without rows takes none from the cache either.
        let cached = match rows {
            true => self.cached_state(session_id),
            false => self.states.peek(session_id, SessionState::without_rows),
        };
        // A state as of a past seq may fold the log from its start.
        let _long = match at {
            Some(_) => Some(self.long_read().await?),
            None => None,
        };
        let pause = self
            .options
            .fault_pause_in_long_read
            .filter(|_| at.is_some());
        match &self.backend {
            Backend::Sqlite(b) => {
                let tx = b.begin_read().await?;
                if let Some(p) = pause {
                    tokio::time::sleep(p).await;
                }
                read_state(tx, cached, session_id, at, from_view, rows).await
            }
            Backend::Postgres(b) => {
                let tx = b.begin_read().await?;
                if let Some(p) = pause {
                    tokio::time::sleep(p).await;
                }
                read_state(tx, cached, session_id, at, from_view, rows).await
            }
        }
    }

    /// A turn among the reads that may hold a connection for a whole fold
    /// ([`Store::long_reads`](Store)).
    pub(crate) async fn long_read(&self) -> Result<tokio::sync::SemaphorePermit<'_>> {
        self.long_reads
            .acquire()
            .await
            .map_err(|_| Error::Unavailable("the store is closed".to_owned()))
    }

    /// The session's view and, in one statement (each is a hop to the
    /// driver's worker thread or a round trip, and a pooled connection's
    /// release costs another), the events from its window's start on (the
    /// window and a page more), or only a page of those after the view when
    /// the window is longer than `max_window`. `None` without a view.
    /// The events stop at [`StoreOptions::window_read_bytes`] of payloads
    /// ([`WindowRead`]: those after the view, and for an answer without
    /// rows the window's too); the flag says the page was cut there.
    async fn view_and_window(
        &self,
        session_id: Uuid,
        needs: Needs,
    ) -> Result<Option<(View, Vec<StoredEvent>, bool)>> {
        let read = WindowRead::new(
            self.max_window(needs),
            needs == Needs::Evidence,
            self.options.window_read_bytes,
        );
        let read = match &self.backend {
            Backend::Sqlite(b) => b.view_and_window(session_id, FOLD_PAGE, read).await?,
            Backend::Postgres(b) => b.view_and_window(session_id, FOLD_PAGE, read).await?,
        };
        match read.view {
            Some(row) => Ok(Some((row.to_view()?, read.events, read.cut))),
            None => Ok(None),
        }
    }

    /// Applies an event to a state that may lack its window's rows
    /// ([`SessionState::is_rowless`]), shed of its texts: a compaction's
    /// kept row is looked up in the log, one statement, since the state
    /// does not hold it. For a holder that answers only activation sets
    /// (an HTTP stream) and the rowless reads.
    pub(crate) async fn apply_to_rowless(
        &self,
        state: &mut SessionState,
        event: StoredEvent,
    ) -> Result<()> {
        if !state.is_rowless() {
            state.apply_shed(event);
            return Ok(());
        }
        let kept = match &event.body {
            EventBody::Compaction {
                first_kept_event_id: Some(id),
                ..
            } => match &self.backend {
                Backend::Sqlite(b) => b.seq_of(state.session_id, *id).await?,
                Backend::Postgres(b) => b.seq_of(state.session_id, *id).await?,
            },
            _ => None,
        };
        state.apply_rowless(event, kept);
        Ok(())
    }

    /// [`Store::state`] through a read transaction (the cache, the view and
    /// window, the fold of what follows).
    async fn state_read(&self, session_id: Uuid, at_seq: Option<i64>) -> Result<SessionState> {
        let state = self.read_in_tx(session_id, at_seq, false, true).await?;
        if at_seq.is_none() {
            self.cache_state(state.clone());
        }
        Ok(state)
    }

    /// The state after event `seq`, for a stream resuming there: built on
    /// the materialized view when the view is at or before `seq` (a client
    /// reconnecting after the latest refresh point, the usual case), as the
    /// latest-state reads are, instead of folding the log from seq 1 (9 s
    /// before the first byte on a session of 10^6 events). Otherwise, and
    /// with the same errors, [`Store::state`] at `Some(seq)`.
    pub async fn state_resuming(&self, session_id: Uuid, seq: i64) -> Result<SessionState> {
        self.read_in_tx(session_id, Some(seq), true, true).await
    }

    /// The latest state in one statement and no transaction: the
    /// read a sidecar makes before every model request, so its round trips
    /// are most of its cost (docs/benchmarks.md).
    ///
    /// With a cached state, one statement reads the head: nothing appended
    /// since means the cache is the answer. Without, one statement reads
    /// the view and every event from the view's window start on (the
    /// window and what came after the view), both from its snapshot.
    /// `None` (something was appended since the cached state, no view, or
    /// more than a page after the view) leaves it to the transactional
    /// path.
    async fn latest_fast(&self, session_id: Uuid, needs: Needs) -> Result<Option<Latest>> {
        let max_window = self.max_window(needs);
        // Rows are copied out only when needed, or when the cold read
        // would have read them too (a short window, within its bytes): a
        // never-compacted session's window, cached by its appends, was
        // copied whole for each activation set.
        let cached = self.states.peek(session_id, |state| {
            let long = state.seq - state.window_start + 1 > max_window
                || state.approx_bytes() > self.options.window_read_bytes;
            match needs == Needs::Evidence && long {
                true => state.without_rows(),
                false => state.clone(),
            }
        });
        if let Some(cached) = cached {
            let head = self.head_seq(session_id).await?;
            if head == cached.seq {
                return Ok(Some(Latest::Cached(cached)));
            }
            // Another writer appended since. Without rows, the events
            // since are applied to the copy; the transactional path would
            // copy the whole window out again (a 100 MB window took a
            // server to 300 MB for an activation set, and its context
            // was no longer paged).
            if cached.is_rowless() && head > cached.seq {
                let state = self
                    .rowless_follow(cached, Vec::new(), true, i64::MAX)
                    .await?;
                return Ok(Some(Latest::Rowless(state)));
            }
            return Ok(None);
        }
        let Some((view, events, cut)) = self.view_and_window(session_id, needs).await? else {
            return Ok(None);
        };
        let window = view.refresh_seq - view.window_start + 1;
        if window < 0 {
            return Ok(None);
        }
        // The events are the window (unless longer than `max_window`) and
        // a page after the view: more may follow when that page is full,
        // in events or in bytes.
        let page = match window > max_window {
            true => FOLD_PAGE,
            false => window + FOLD_PAGE,
        };
        let full = cut || events.len() as i64 >= page;
        if window > max_window || (full && needs == Needs::Evidence) {
            // Without rows: the events after the view (a first page of
            // them, the rest read page by page). Also a short window
            // followed by more than a page (an agent's loop of tool calls
            // with no prompt between), or one too large in bytes.
            let tail = events
                .into_iter()
                .filter(|e| e.seq > view.refresh_seq)
                .collect();
            let state = self.rowless_from(&view, tail, full, i64::MAX).await?;
            return Ok(Some(Latest::Rowless(state)));
        }
        let split = events.partition_point(|e| e.seq <= view.refresh_seq);
        if split as i64 != window {
            return Err(Error::Corrupt(format!(
                "session {session_id}: the view starts its window at seq {} but the log has {split} of the {window} events up to its refresh point",
                view.window_start
            )));
        }
        if full {
            // With rows, more than a page after the view: the
            // transactional path.
            return Ok(None);
        }
        let mut state = SessionState::from_view(&view, &events[..split]);
        for e in &events[split..] {
            state.apply(e);
        }
        Ok(Some(Latest::Full(state)))
    }

    /// The longest window a latest-state read of `needs` reads: any for
    /// rows, [`StoreOptions::rowless_window`] without them.
    fn max_window(&self, needs: Needs) -> i64 {
        match needs {
            Needs::Rows => i64::MAX,
            Needs::Evidence => self.options.rowless_window,
        }
    }

    /// The effective context (§5) as of `at_seq` or the latest event.
    pub async fn context(&self, session_id: Uuid, at_seq: Option<i64>) -> Result<Context> {
        // The latest context of a cached session is made from the cached
        // state in place: copying the state first, then its rows into the
        // answer, copied the window twice (a sidecar asks this before every
        // request, right after the activation set loaded the state).
        // The head is checked first, so a state another instance has
        // appended past is not copied only to be thrown away.
        if at_seq.is_none() {
            if let Some(seq) = self.states.peek(session_id, |state| state.seq) {
                if self.head_seq(session_id).await? == seq {
                    let context = self.states.peek(session_id, |state| {
                        (state.seq == seq).then(|| state.context())
                    });
                    if let Some(Some(context)) = context {
                        return Ok(context);
                    }
                }
            }
        }
        Ok(self.state(session_id, at_seq).await?.context())
    }

    /// The deferred activation set (§7) as of `at_seq` or the latest event.
    pub async fn activations(&self, session_id: Uuid, at_seq: Option<i64>) -> Result<Activations> {
        Ok(match at_seq {
            None => self.latest_without_rows(session_id).await?,
            Some(n) => self.rowless_at(session_id, n, false).await?,
        }
        .activations())
    }

    /// What a restarting sidecar needs (§8): current mode and catalog, the
    /// activation set with evidence, where the effective context starts, the
    /// summary and the latest seq. Reads the view, the window and the events
    /// after the view; never the whole history.
    pub async fn recover(&self, session_id: Uuid) -> Result<Recovery> {
        let state = self.latest_without_rows(session_id).await?;
        Ok(Recovery {
            session_id,
            latest_seq: state.seq,
            mode: state.mode.clone(),
            catalog: state.current_catalog().to_vec(),
            tools: state.activation_set(),
            context_start_seq: state.window_start,
            compaction_seq: state.compaction.as_ref().map(|(_, s)| *s),
            summary: state.compaction.as_ref().map(|(s, _)| s.clone()),
        })
    }

    /// The tenant that owns a session: the one recorded when it was created
    /// through [`Store::append_as`], else [`DEFAULT_TENANT`]; `None` when
    /// the session has no events.
    pub async fn session_owner(&self, session_id: Uuid) -> Result<Option<String>> {
        async fn owner_in<T: LogTx>(mut tx: T, session_id: Uuid) -> Result<Option<String>> {
            if tx.head_seq(session_id).await? == 0 {
                return Ok(None);
            }
            Ok(Some(
                tx.session_owner(session_id)
                    .await?
                    .unwrap_or_else(|| DEFAULT_TENANT.to_owned()),
            ))
        }
        match &self.backend {
            Backend::Sqlite(b) => owner_in(b.begin_read().await?, session_id).await,
            Backend::Postgres(b) => owner_in(b.begin_read().await?, session_id).await,
        }
    }

    /// The stored events, of any session, whose ids are among `ids`: for
    /// a caller that judges a long run of events before appending any of
    /// it (`import --format pi`), so that an id another session holds
    /// (SEMANTICS §2, [`event_id_reused`]) is said before the first run
    /// is written rather than after.
    pub async fn stored_events(&self, ids: &[Uuid]) -> Result<Vec<StoredEvent>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // Each id once: looked up in chunks, a repeated id would be found
        // once per chunk it falls in.
        let mut seen = HashSet::new();
        let ids: Vec<Uuid> = ids.iter().copied().filter(|id| seen.insert(*id)).collect();
        let ids = ids.as_slice();
        match &self.backend {
            Backend::Sqlite(b) => b.begin_read().await?.stored_by_ids(ids).await,
            Backend::Postgres(b) => b.begin_read().await?.stored_by_ids(ids).await,
        }
    }

    /// Every session in the store, in id order.
    pub async fn sessions(&self) -> Result<Vec<Uuid>> {
        match &self.backend {
            Backend::Sqlite(b) => b.begin_read().await?.session_ids().await,
            Backend::Postgres(b) => b.begin_read().await?.session_ids().await,
        }
    }

    /// How this process's appends have been committed so far (see
    /// [`AppendPaths`]).
    pub fn append_paths(&self) -> AppendPaths {
        self.paths.snapshot()
    }

    /// What the cache of session states holds now: those with their
    /// window's rows (every session this process appended to or read the
    /// context of), and apart, those read without them
    /// ([`StoreOptions::state_cache_bytes`] bounds each).
    pub fn state_cache_usage(&self) -> (CacheUsage, CacheUsage) {
        (self.states.usage(), self.rowless.usage())
    }

    /// Drops every cached session state, so the next call reads the
    /// materialized view as a freshly started process would (benchmarks and
    /// tests use it to measure the cold path).
    pub fn clear_cache(&self) {
        self.states.clear();
        self.rowless.clear();
    }

    fn forget(&self, session_id: Uuid) {
        self.states.remove(session_id);
        self.rowless.remove(session_id);
    }

    /// Closes the connection pool, waiting for connections to finish. Every
    /// call after it fails with [`Error::Unavailable`];
    /// [`Store::append_at_head`] does not retry it.
    pub async fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        match &self.backend {
            Backend::Sqlite(b) => b.close().await,
            Backend::Postgres(b) => b.close().await,
        }
    }
}

/// The refusal of an event whose id is already stored with other content
/// or in another session (SEMANTICS §2). Names neither the other session
/// nor its seq: the caller may not be allowed to know they exist.
pub fn event_id_reused(event_id: Uuid) -> ValidationError {
    ValidationError::new(
        Rule::EventIdReused,
        Some("event_id"),
        format!("`event_id` {event_id} is already stored in another session"),
    )
}

/// [`event_id_reused`] for an id stored in the session appended to, at
/// `seq`, with other content: said as such (the caller can read that
/// session), so a writer knows it reused its own id rather than met
/// another session's.
pub(crate) fn event_id_reused_here(event_id: Uuid, seq: i64) -> ValidationError {
    ValidationError::new(
        Rule::EventIdReused,
        Some("event_id"),
        format!(
            "`event_id` {event_id} is already stored at seq {seq} of this session with other content; give a new event a new id"
        ),
    )
}

/// `events` up to the first whose JSON values the store could not read
/// back ([`crate::validate::check_values`]), and that event's error as
/// the batch's unreadable tail, as the command line has it for a line it
/// cannot read: the events before it are judged first (§2's order), and
/// nothing after it is serialized, compared or hashed. An `invalid_tail`
/// given already stays when it comes first.
fn cut_at_unreadable(
    mut events: Vec<NewEvent>,
    invalid_tail: Option<ValidationError>,
) -> (Vec<NewEvent>, Option<ValidationError>) {
    let unreadable = events.iter().enumerate().find_map(|(i, e)| {
        crate::validate::check_values(&e.body)
            .err()
            .map(|err| (i, err.at_index(i)))
    });
    match unreadable {
        Some((i, err)) => {
            // Dropped a level at a time: a value deep enough to be refused
            // may be deep enough to overflow the stack of its own drop.
            events
                .drain(i..)
                .for_each(|e| crate::event::drop_flat(e.body));
            (events, Some(err))
        }
        None => (events, invalid_tail),
    }
}

/// Sleeps for about `backoff` (between half and all of it), then doubles it.
/// `max_backoff` bounds the first sleep too, and a backoff too long to
/// double or to count in nanoseconds saturates instead of panicking or
/// wrapping to nothing.
async fn sleep_jittered(backoff: &mut std::time::Duration, policy: &RetryPolicy) {
    let capped = (*backoff).min(policy.max_backoff);
    let nanos = u64::try_from(capped.as_nanos()).unwrap_or(u64::MAX);
    let jitter = Uuid::new_v4().as_u64_pair().0 % (nanos / 2 + 1);
    tokio::time::sleep(std::time::Duration::from_nanos(nanos / 2 + jitter)).await;
    *backoff = capped.saturating_mul(2).min(policy.max_backoff);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backoff past `max_backoff`, or too long to double, is capped and
    /// saturates: no panic, no wrap to a sleep of nothing.
    #[tokio::test]
    async fn retry_backoffs_are_capped_and_saturate() {
        let policy = RetryPolicy {
            max_backoff: std::time::Duration::from_millis(10),
            ..RetryPolicy::default()
        };
        for start in [
            std::time::Duration::MAX,
            std::time::Duration::from_secs(1 << 63),
            std::time::Duration::from_secs(4),
        ] {
            let mut backoff = start;
            let at = std::time::Instant::now();
            sleep_jittered(&mut backoff, &policy).await;
            assert!(
                at.elapsed() < std::time::Duration::from_secs(1),
                "{start:?}"
            );
            assert_eq!(backoff, policy.max_backoff);
        }
    }
}
