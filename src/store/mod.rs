//! The Store API: append, history, context and activations, on SQLite or
//! PostgreSQL behind one interface.
//!
//! The append path is written once ([`append_in`]) against the small
//! [`LogTx`] trait that each backend implements for its own transaction
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
//! The session state used for validation is cached per session and caught up
//! by folding only the events appended since (by this or another process), so
//! appending to a long session does not re-read its history.

mod postgres;
mod sqlite;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Mutex;

use chrono::{DateTime, SubsecRound, Utc};
use tracing::{debug, instrument};
use uuid::Uuid;

use crate::error::{Error, Result, Rule, ValidationError};
use crate::event::{NewEvent, StoredEvent};
use crate::projector::{Activations, Context, SessionState};
use crate::validate::{check_event, DEFAULT_MAX_EVENT_BYTES};

/// How many events one read fetches when folding a log.
const FOLD_PAGE: i64 = 2_000;

/// How many session states the write cache keeps before it starts over.
const STATE_CACHE_SESSIONS: usize = 256;

/// Store settings beyond the URL.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Largest accepted event, in bytes of JSON text (§4).
    pub max_event_bytes: usize,
    /// Seconds to wait for a connection before saying the storage is
    /// unavailable.
    pub connect_timeout_secs: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            connect_timeout_secs: 5,
        }
    }
}

/// What one appended event was given by the store.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
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
}

/// A row ready to insert.
#[derive(Clone, Debug)]
pub(crate) struct PendingRow {
    pub(crate) position: i64,
    pub(crate) session_id: Uuid,
    pub(crate) seq: i64,
    pub(crate) event_id: Uuid,
    pub(crate) type_name: &'static str,
    pub(crate) payload: String,
    pub(crate) recorded_at: DateTime<Utc>,
}

/// The operations the shared append path needs inside one write
/// transaction. Each backend implements it for its transaction type.
pub(crate) trait LogTx: Send {
    /// The session's current seq (0 when it has no events).
    fn head_seq(&mut self, session_id: Uuid) -> impl Future<Output = Result<i64>> + Send;
    /// The stored events with any of these ids.
    fn stored_by_ids(
        &mut self,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<Vec<StoredEvent>>> + Send;
    /// Events of a session with `after < seq <= upto`, in seq order.
    fn range(
        &mut self,
        session_id: Uuid,
        after: i64,
        upto: i64,
    ) -> impl Future<Output = Result<Vec<StoredEvent>>> + Send;
    /// Reserves `n` global positions; returns the first.
    fn reserve_positions(&mut self, n: i64) -> impl Future<Output = Result<i64>> + Send;
    /// Inserts the rows.
    fn insert(&mut self, rows: &[PendingRow]) -> impl Future<Output = Result<()>> + Send;
    /// Commits.
    fn commit(self) -> impl Future<Output = Result<()>> + Send;
}

enum Backend {
    Sqlite(sqlite::SqliteBackend),
    Postgres(postgres::PgBackend),
}

/// Which database a URL names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// An embedded SQLite file.
    Sqlite,
    /// A PostgreSQL server.
    Postgres,
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
    states: Mutex<HashMap<Uuid, SessionState>>,
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

impl Store {
    /// Opens (creating a SQLite file if needed) and migrates a store.
    pub async fn open(url: &str) -> Result<Store> {
        Store::open_with(url, StoreOptions::default()).await
    }

    /// [`Store::open`] with explicit options.
    #[instrument(skip(options), fields(backend = ?backend_kind(url)))]
    pub async fn open_with(url: &str, options: StoreOptions) -> Result<Store> {
        let backend = match backend_kind(url) {
            BackendKind::Postgres => {
                Backend::Postgres(postgres::PgBackend::connect(url, &options).await?)
            }
            BackendKind::Sqlite => {
                Backend::Sqlite(sqlite::SqliteBackend::connect(url, &options).await?)
            }
        };
        let store = Store {
            backend,
            options,
            states: Mutex::new(HashMap::new()),
        };
        store.migrate().await?;
        Ok(store)
    }

    /// Which backend this store runs on.
    pub fn kind(&self) -> BackendKind {
        match self.backend {
            Backend::Sqlite(_) => BackendKind::Sqlite,
            Backend::Postgres(_) => BackendKind::Postgres,
        }
    }

    /// Applies pending migrations (also done by [`Store::open`]).
    pub async fn migrate(&self) -> Result<()> {
        match &self.backend {
            Backend::Sqlite(b) => b.migrate().await,
            Backend::Postgres(b) => b.migrate().await,
        }
    }

    /// Appends `events` to `session_id` atomically, if the session is at
    /// `expected_seq` (0 for a new session). See the module docs for the
    /// order in which a batch is judged.
    #[instrument(skip(self, events), fields(session = %session_id, n = events.len()))]
    pub async fn append(
        &self,
        session_id: Uuid,
        expected_seq: i64,
        events: Vec<NewEvent>,
    ) -> Result<AppendOutcome> {
        check_batch_ids(&events)?;
        let cached = self.cached_state(session_id);
        let (outcome, state) = match &self.backend {
            Backend::Sqlite(b) => {
                let tx = b.begin_write().await?;
                append_in(tx, cached, session_id, expected_seq, &events, &self.options).await?
            }
            Backend::Postgres(b) => {
                let tx = b.begin_write().await?;
                append_in(tx, cached, session_id, expected_seq, &events, &self.options).await?
            }
        };
        if let Some(state) = state {
            self.cache_state(state);
        }
        Ok(outcome)
    }

    fn cached_state(&self, session_id: Uuid) -> Option<SessionState> {
        self.states
            .lock()
            .ok()
            .and_then(|m| m.get(&session_id).cloned())
    }

    fn cache_state(&self, state: SessionState) {
        if let Ok(mut m) = self.states.lock() {
            if m.len() >= STATE_CACHE_SESSIONS && !m.contains_key(&state.session_id) {
                m.clear();
            }
            m.insert(state.session_id, state);
        }
    }

    /// The session's latest seq (0 when it has no events).
    pub async fn head_seq(&self, session_id: Uuid) -> Result<i64> {
        match &self.backend {
            Backend::Sqlite(b) => b.head_seq(session_id).await,
            Backend::Postgres(b) => b.head_seq(session_id).await,
        }
    }

    /// One page of a session's history: events with seq > `after_seq`, at
    /// most `limit` of them, in seq order.
    pub async fn history(
        &self,
        session_id: Uuid,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<StoredEvent>> {
        let limit = limit.clamp(0, 100_000);
        match &self.backend {
            Backend::Sqlite(b) => b.page(session_id, after_seq, limit).await,
            Backend::Postgres(b) => b.page(session_id, after_seq, limit).await,
        }
    }

    /// The session folded up to `at_seq` (the latest seq when `None`).
    /// Errors: [`Error::SessionNotFound`], [`Error::SeqOutOfRange`].
    pub async fn state(&self, session_id: Uuid, at_seq: Option<i64>) -> Result<SessionState> {
        let latest = self.head_seq(session_id).await?;
        if latest == 0 {
            return Err(Error::SessionNotFound(session_id));
        }
        let target = match at_seq {
            None => latest,
            Some(n) if (1..=latest).contains(&n) => n,
            Some(n) => {
                return Err(Error::SeqOutOfRange {
                    session_id,
                    seq: n,
                    latest,
                })
            }
        };
        let mut state = match self.cached_state(session_id) {
            Some(s) if s.seq <= target => s,
            _ => SessionState::empty(session_id),
        };
        while state.seq < target {
            let page = self
                .history(session_id, state.seq, FOLD_PAGE.min(target - state.seq))
                .await?;
            if page.is_empty() {
                return Err(Error::Corrupt(format!(
                    "session {session_id} has no event after seq {} although its head is {latest}",
                    state.seq
                )));
            }
            for e in &page {
                state.apply(e);
            }
        }
        if at_seq.is_none() {
            self.cache_state(state.clone());
        }
        Ok(state)
    }

    /// The effective context (§5) as of `at_seq` or the latest event.
    pub async fn context(&self, session_id: Uuid, at_seq: Option<i64>) -> Result<Context> {
        Ok(self.state(session_id, at_seq).await?.context())
    }

    /// The deferred activation set (§7) as of `at_seq` or the latest event.
    pub async fn activations(&self, session_id: Uuid, at_seq: Option<i64>) -> Result<Activations> {
        Ok(self.state(session_id, at_seq).await?.activations())
    }

    /// Closes the connection pool, waiting for connections to finish.
    pub async fn close(&self) {
        match &self.backend {
            Backend::Sqlite(b) => b.close().await,
            Backend::Postgres(b) => b.close().await,
        }
    }
}

/// Rejects a batch that names one `event_id` twice.
fn check_batch_ids(events: &[NewEvent]) -> Result<()> {
    let mut seen = HashSet::new();
    for (i, e) in events.iter().enumerate() {
        if let Some(id) = e.event_id {
            if !seen.insert(id) {
                return Err(ValidationError::new(
                    Rule::DuplicateEventIdInBatch,
                    Some("event_id"),
                    format!("`event_id` {id} appears twice in the batch"),
                )
                .at_index(i)
                .into());
            }
        }
    }
    Ok(())
}

/// The append path shared by both backends (see the module docs). Returns
/// the outcome and, when events were written, the session state after them.
async fn append_in<T: LogTx>(
    mut tx: T,
    cached: Option<SessionState>,
    session_id: Uuid,
    expected_seq: i64,
    events: &[NewEvent],
    options: &StoreOptions,
) -> Result<(AppendOutcome, Option<SessionState>)> {
    // 1. Idempotent retry.
    let ids: Vec<Uuid> = events.iter().filter_map(|e| e.event_id).collect();
    if !ids.is_empty() {
        let stored = tx.stored_by_ids(&ids).await?;
        if !stored.is_empty() {
            let by_id: HashMap<Uuid, &StoredEvent> =
                stored.iter().map(|e| (e.event_id, e)).collect();
            for (i, e) in events.iter().enumerate() {
                let Some(prior) = e.event_id.and_then(|id| by_id.get(&id)) else {
                    continue;
                };
                if prior.session_id != session_id || prior.body != e.body {
                    return Err(ValidationError::new(
                        Rule::EventIdReused,
                        Some("event_id"),
                        format!(
                            "`event_id` {} is already stored (session {}, seq {}) with other content",
                            prior.event_id, prior.session_id, prior.seq
                        ),
                    )
                    .at_index(i)
                    .into());
                }
            }
            let all_stored = events
                .iter()
                .all(|e| e.event_id.is_some_and(|id| by_id.contains_key(&id)));
            let answer: Vec<Appended> = events
                .iter()
                .filter_map(|e| e.event_id.and_then(|id| by_id.get(&id)))
                .map(|p| Appended {
                    event_id: p.event_id,
                    seq: p.seq,
                    position: p.position,
                })
                .collect();
            let in_order = answer.windows(2).all(|w| w[0].seq < w[1].seq);
            if all_stored && in_order {
                debug!(session = %session_id, "idempotent retry answered from the log");
                return Ok((
                    AppendOutcome {
                        events: answer,
                        replayed: true,
                    },
                    None,
                ));
            }
            let message = if all_stored {
                "every event of the batch is already stored, but in another order".to_owned()
            } else {
                format!(
                    "{} of the batch's {} events are already stored; retry exactly the batch that was sent, or only the new events",
                    answer.len(),
                    events.len()
                )
            };
            return Err(
                ValidationError::new(Rule::PartlyStoredBatch, Some("event_id"), message).into(),
            );
        }
    }

    // 2. Expected seq.
    let head = tx.head_seq(session_id).await?;
    if head != expected_seq {
        return Err(Error::Conflict {
            session_id,
            expected: expected_seq,
            current: head,
        });
    }
    if events.is_empty() {
        return Ok((
            AppendOutcome {
                events: Vec::new(),
                replayed: false,
            },
            None,
        ));
    }

    // 3. Catch the session state up to the head, then validate.
    let mut state = match cached {
        Some(s) if s.seq <= head => s,
        _ => SessionState::empty(session_id),
    };
    while state.seq < head {
        let upto = head.min(state.seq + FOLD_PAGE);
        let page = tx.range(session_id, state.seq, upto).await?;
        if page.is_empty() {
            return Err(Error::Corrupt(format!(
                "session {session_id} has no event after seq {} although its head is {head}",
                state.seq
            )));
        }
        for e in &page {
            state.apply(e);
        }
    }
    let first_position = tx.reserve_positions(events.len() as i64).await?;
    let now = Utc::now().trunc_subsecs(6);
    let mut rows = Vec::with_capacity(events.len());
    for (i, e) in events.iter().enumerate() {
        let payload = e.body.to_json_text();
        if payload.len() > options.max_event_bytes {
            return Err(ValidationError::new(
                Rule::TooLarge,
                None,
                format!(
                    "the event is {} bytes of JSON, over the limit of {} bytes",
                    payload.len(),
                    options.max_event_bytes
                ),
            )
            .at_index(i)
            .into());
        }
        check_event(&state, &e.body).map_err(|err| err.at_index(i))?;
        let row = PendingRow {
            position: first_position + i as i64,
            session_id,
            seq: head + 1 + i as i64,
            event_id: e.event_id.unwrap_or_else(Uuid::now_v7),
            type_name: e.body.type_name(),
            payload,
            recorded_at: e.recorded_at.map(|t| t.trunc_subsecs(6)).unwrap_or(now),
        };
        state.apply(&StoredEvent {
            session_id,
            seq: row.seq,
            event_id: row.event_id,
            position: row.position,
            recorded_at: row.recorded_at,
            body: e.body.clone(),
        });
        rows.push(row);
    }
    tx.insert(&rows).await?;
    tx.commit().await?;
    let appended = rows
        .iter()
        .map(|r| Appended {
            event_id: r.event_id,
            seq: r.seq,
            position: r.position,
        })
        .collect();
    Ok((
        AppendOutcome {
            events: appended,
            replayed: false,
        },
        Some(state),
    ))
}
