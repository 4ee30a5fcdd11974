//! Cross-session audit queries (docs/audit.md): events by type, session,
//! time and position; where tools entered or left activation sets; and
//! anomalies. Every query is paged by a cursor and read through an index
//! (the plans are in docs/audit.md); every query can be restricted to one
//! tenant, which the HTTP server always does.
//!
//! The SQL is written once, generic over the backend: `Dialect` binds
//! the two column types the backends store differently (ids and times).

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Postgres, QueryBuilder, Sqlite};
use uuid::Uuid;

use super::{Backend, ChangeRow, Store, DEFAULT_TENANT, PAGE_BYTES};
use crate::error::{quoted, Error, Result, Rule, ValidationError};
use crate::event::{EventBody, StoredEvent, EVENT_TYPES};

/// The most rows one page returns.
pub const MAX_PAGE: i64 = 1_000;

/// How many `tool_result` rows one page of the unknown-names check reads
/// at most, whatever it finds (the cursor says where to go on).
const NAME_SCAN: i64 = 2_000;

/// Binds ids and times as each backend stores them.
pub(crate) trait Dialect: sqlx::Database {
    /// What makes a comparison or an order of text columns byte order:
    /// SQLite's default (BINARY) is; a PostgreSQL database's collation may
    /// not be (ICU's `en-US` puts `a` before `Z`), and the two backends
    /// must page an audit query alike (a review's finding).
    const BYTE_ORDER: &'static str;
    fn push_uuid(q: &mut QueryBuilder<'_, Self>, id: Uuid);
    fn push_time(q: &mut QueryBuilder<'_, Self>, t: DateTime<Utc>);
}

impl Dialect for Sqlite {
    const BYTE_ORDER: &'static str = "";
    fn push_uuid(q: &mut QueryBuilder<'_, Self>, id: Uuid) {
        q.push_bind(id.to_string());
    }
    fn push_time(q: &mut QueryBuilder<'_, Self>, t: DateTime<Utc>) {
        q.push_bind(super::sqlite::sqlite_time(&t));
    }
}

impl Dialect for Postgres {
    const BYTE_ORDER: &'static str = " COLLATE \"C\"";
    fn push_uuid(q: &mut QueryBuilder<'_, Self>, id: Uuid) {
        q.push_bind(id);
    }
    fn push_time(q: &mut QueryBuilder<'_, Self>, t: DateTime<Utc>) {
        q.push_bind(t);
    }
}

/// What every audit query can be narrowed by. The default narrows by
/// nothing and pages by [`DEFAULT_PAGE`] rows (a `limit` of 0 would be
/// refused).
#[derive(Clone, Debug, PartialEq)]
pub struct Scope {
    /// Only this tenant's sessions (`None`: every tenant, for the CLI).
    pub tenant: Option<String>,
    /// Only this session.
    pub session: Option<Uuid>,
    /// Only rows recorded at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only rows recorded before this time.
    pub until: Option<DateTime<Utc>>,
    /// Rows per page (1 to [`MAX_PAGE`]).
    pub limit: i64,
}

/// How many audit queries a process runs at once (the others wait their turn):
/// fewer than the pool's connections, so that the others stay for the
/// pre-request reads and appends.
pub const AUDIT_TURNS: usize = 2;

/// Rows per page of an audit query that does not say.
pub const DEFAULT_PAGE: i64 = 100;

impl Default for Scope {
    fn default() -> Scope {
        Scope {
            tenant: None,
            session: None,
            since: None,
            until: None,
            limit: DEFAULT_PAGE,
        }
    }
}

/// `audit events`: events in global order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventQuery {
    /// Tenant, session, time range, page size.
    pub scope: Scope,
    /// Only events of this type.
    pub event_type: Option<String>,
    /// Only events at this position or later.
    pub from_position: Option<i64>,
    /// Only events at this position or earlier.
    pub to_position: Option<i64>,
    /// The cursor: events after this position.
    pub after_position: i64,
}

/// A page of events and the cursor of the next page (`None` at the end).
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct EventPage {
    /// In position order.
    pub events: Vec<StoredEvent>,
    /// Pass as `after` for the next page (the CLI's `--after`); `null`
    /// when this page reached the end.
    pub next_after_position: Option<i64>,
}

/// `audit changes`: where deferred tools entered or left activation sets.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChangeQuery {
    /// Tenant, session, time range, page size.
    pub scope: Scope,
    /// Only this tool.
    pub tool: Option<String>,
    /// Only `added` or only `removed`.
    pub change: Option<String>,
    /// The cursor: rows after this one (see [`ChangePage::next`]).
    pub after: Option<String>,
}

/// A page of activation changes.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ChangePage {
    /// In position order, then by tool.
    pub changes: Vec<ChangeRow>,
    /// Pass as `after` for the next page; `null` at the end.
    pub next: Option<String>,
}

/// Which anomaly to look for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AnomalyKind {
    /// A `tool_call` with no `tool_result` (yet).
    UnansweredCall,
    /// A successful result whose `added_tool_names` names a tool that no
    /// catalog of its session ever listed: it can never activate it.
    UnknownEvidenceName,
    /// A session whose view, calls index or activation changes disagree
    /// with its log.
    ViewDrift,
}

impl AnomalyKind {
    /// Parses the spelling of the CLI and the query string.
    pub fn parse(s: &str) -> Option<AnomalyKind> {
        match s.replace('-', "_").as_str() {
            "unanswered_call" | "unanswered_calls" => Some(AnomalyKind::UnansweredCall),
            "unknown_evidence_name" | "unknown_evidence_names" => {
                Some(AnomalyKind::UnknownEvidenceName)
            }
            "view_drift" => Some(AnomalyKind::ViewDrift),
            _ => None,
        }
    }
}

/// `audit anomalies`.
#[derive(Clone, Debug, PartialEq)]
pub struct AnomalyQuery {
    /// Tenant, session, time range, page size.
    pub scope: Scope,
    /// What to look for.
    pub kind: AnomalyKind,
    /// The cursor of the previous page's `next`.
    pub after: Option<String>,
}

/// One anomaly.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Anomaly {
    /// What was found.
    pub kind: AnomalyKind,
    /// The session.
    pub session_id: Uuid,
    /// The event concerned (`null` for a view drift).
    pub seq: Option<i64>,
    /// Its event id.
    pub event_id: Option<Uuid>,
    /// Its position.
    pub position: Option<i64>,
    /// Its time.
    pub recorded_at: Option<DateTime<Utc>>,
    /// The tools concerned: the unanswered call's tool, or the names no
    /// catalog lists.
    pub tools: Vec<String>,
    /// The unanswered call's or the result's call id.
    pub call_id: Option<String>,
    /// The finding as a sentence.
    pub detail: String,
}

/// A page of anomalies.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct AnomalyPage {
    /// What this page found (it may be empty while `next` is not: the
    /// page stopped after reading its share of rows).
    pub anomalies: Vec<Anomaly>,
    /// Pass as `after` for the next page; `null` when the scan is done.
    pub next: Option<String>,
}

/// The first and the last time the store keeps (years 0000 to 9999 in
/// UTC, whole microseconds).
fn stored_times() -> (DateTime<Utc>, DateTime<Utc>) {
    let at = |s: &str| {
        DateTime::parse_from_rfc3339(s)
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or_default()
    };
    (
        at("0000-01-01T00:00:00Z"),
        at("9999-12-31T23:59:59.999999Z"),
    )
}

/// `t` moved up to a whole microsecond (itself when it is one).
fn ceil_micros(t: DateTime<Utc>) -> DateTime<Utc> {
    let below = i64::from(t.timestamp_subsec_nanos() % 1_000);
    match below {
        0 => t,
        // The last representable instant has no next microsecond: kept.
        n => t
            .checked_add_signed(chrono::Duration::nanoseconds(1_000 - n))
            .unwrap_or(t),
    }
}

/// A query argument out of its range, naming it (`mistyped-field`): 422
/// `invalid` over HTTP, as the server answers for every such argument.
pub(crate) fn bad(field: &str, message: String) -> Error {
    Error::Invalid(ValidationError::new(
        Rule::MistypedField,
        Some(field),
        message,
    ))
}

impl Scope {
    fn check(&self) -> Result<()> {
        if !(1..=MAX_PAGE).contains(&self.limit) {
            return Err(bad(
                "limit",
                format!(
                    "`limit` must be between 1 and {MAX_PAGE}, not {}",
                    self.limit
                ),
            ));
        }
        if let (Some(a), Some(b)) = (self.since, self.until) {
            if a >= b {
                return Err(bad(
                    "until",
                    format!("`until` ({b}) must be later than `since` ({a})"),
                ));
            }
        }
        Ok(())
    }

    /// `AND …` for the scope's filters on the table aliased `t` (which has
    /// `session_id` and `recorded_at`).
    fn push<DB: Dialect>(&self, q: &mut QueryBuilder<'_, DB>, t: &str)
    where
        for<'a> String: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    {
        if let Some(s) = self.session {
            q.push(format!(" AND {t}.session_id = "));
            DB::push_uuid(q, s);
        }
        // Stored times have whole microseconds: a bound finer than that
        // is moved up to the next one, which keeps `since` inclusive and
        // `until` exclusive exactly (cut down, both would take or drop a
        // row at the microsecond below the bound).
        //
        // Stored times lie in the years 0000 to 9999 (`check_recorded_at`),
        // and SQLite compares them as text, where `+10000-…` sorts before
        // `2026-…`: a bound outside those years is said as what it means,
        // all rows or none, rather than compared.
        let (first, last) = stored_times();
        if let Some(since) = self.since.map(ceil_micros) {
            if since > last {
                q.push(" AND 1 = 0");
            } else if since > first {
                q.push(format!(" AND {t}.recorded_at >= "));
                DB::push_time(q, since);
            }
        }
        if let Some(until) = self.until.map(ceil_micros) {
            if until <= first {
                q.push(" AND 1 = 0");
            } else if until <= last {
                q.push(format!(" AND {t}.recorded_at < "));
                DB::push_time(q, until);
            }
        }
        if let Some(tenant) = &self.tenant {
            // A session without an owner row belongs to the default tenant.
            q.push(format!(
                " AND COALESCE((SELECT o.tenant FROM session_owners o WHERE o.session_id = {t}.session_id), "
            ));
            q.push_bind(DEFAULT_TENANT.to_owned());
            q.push(") = ");
            q.push_bind(tenant.clone());
        }
    }
}

const EVENT_COLUMNS: &str =
    "SELECT e.position, e.session_id, e.seq, e.event_id, e.payload, e.recorded_at FROM events e";

/// The event types the partial index `events_sparse_types` holds (a
/// small share of any log: a session's start, catalogs, prompts,
/// compactions, mode switches), whose `WHERE` a query by one of them
/// repeats word for word ([`sparse_types_term`]): SQLite uses a partial
/// index only for a query whose `WHERE` holds each term of the index's
/// (migration 0009).
///
/// The other three types are most of a log; a query by one of them reads
/// the log in position order and keeps its rows, as fast as an index would
/// find them when every few rows is one, and an append does not pay for
/// an index entry per event (docs/audit.md, "Events by type").
const SPARSE_TYPES: [&str; 5] = [
    "session_started",
    "catalog_defined",
    "prompt_submitted",
    "compaction",
    "mode_switched",
];

/// `AND e.type IN (…)` listing [`SPARSE_TYPES`] in their order, as the
/// partial index's `WHERE` does (SQLite compares the two term by term).
fn sparse_types_term() -> &'static str {
    static TERM: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TERM.get_or_init(|| {
        let listed = SPARSE_TYPES.map(|t| format!("'{t}'")).join(", ");
        format!(" AND e.type IN ({listed})")
    })
}

fn events_sql<'a, DB: Dialect>(prefix: &str, q: &EventQuery) -> QueryBuilder<'a, DB>
where
    for<'b> String: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
    for<'b> i64: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
{
    let mut b = QueryBuilder::new(format!("{prefix}{EVENT_COLUMNS}"));
    b.push(" WHERE e.position > ");
    b.push_bind(q.after_position);
    if let Some(t) = &q.event_type {
        b.push(" AND e.type = ");
        b.push_bind(t.clone());
        if SPARSE_TYPES.contains(&t.as_str()) {
            b.push(sparse_types_term());
        }
    }
    if let Some(p) = q.from_position {
        b.push(" AND e.position >= ");
        b.push_bind(p);
    }
    if let Some(p) = q.to_position {
        b.push(" AND e.position <= ");
        b.push_bind(p);
    }
    q.scope.push(&mut b, "e");
    // Within one session seq order is position order (both grow with
    // each commit), and (session_id, seq) is the index that finds it.
    b.push(if q.scope.session.is_some() {
        " ORDER BY e.session_id, e.seq LIMIT "
    } else {
        " ORDER BY e.position LIMIT "
    });
    b.push_bind(q.scope.limit + 1);
    b
}

fn changes_sql<'a, DB: Dialect>(
    prefix: &str,
    q: &ChangeQuery,
    after: Option<(i64, String)>,
) -> QueryBuilder<'a, DB>
where
    for<'b> String: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
    for<'b> i64: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
{
    let mut b = QueryBuilder::new(format!(
        "{prefix}SELECT c.position, c.tool, c.session_id, c.seq, c.recorded_at, c.change, c.evidence_seq \
         FROM activation_changes c WHERE 1 = 1"
    ));
    if let Some((position, tool)) = after {
        b.push(" AND (c.position > ");
        b.push_bind(position);
        b.push(" OR (c.position = ");
        b.push_bind(position);
        b.push(" AND c.tool > ");
        b.push_bind(tool);
        b.push(DB::BYTE_ORDER);
        b.push("))");
    }
    if let Some(t) = &q.tool {
        b.push(" AND c.tool = ");
        b.push_bind(t.clone());
    }
    if let Some(c) = &q.change {
        b.push(" AND c.change = ");
        b.push_bind(c.clone());
    }
    q.scope.push(&mut b, "c");
    b.push(format!(
        " ORDER BY c.position, c.tool{} LIMIT ",
        DB::BYTE_ORDER
    ));
    b.push_bind(q.scope.limit + 1);
    b
}

/// Unanswered calls: the `tool_call` events whose calls index row has no
/// result, read through the partial index `calls_unanswered`.
fn unanswered_sql<'a, DB: Dialect>(prefix: &str, scope: &Scope, after: i64) -> QueryBuilder<'a, DB>
where
    for<'b> String: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
    for<'b> i64: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
{
    let mut b = QueryBuilder::new(format!("{prefix}{EVENT_COLUMNS}"));
    b.push(
        " JOIN calls c ON c.session_id = e.session_id AND c.call_seq = e.seq \
         WHERE c.result_seq IS NULL AND e.position > ",
    );
    b.push_bind(after);
    scope.push(&mut b, "e");
    b.push(" ORDER BY e.position LIMIT ");
    b.push_bind(scope.limit + 1);
    b
}

/// Successful results that carry `added_tool_names`, in position order.
fn named_results_sql<'a, DB: Dialect>(
    prefix: &str,
    scope: &Scope,
    after: i64,
) -> QueryBuilder<'a, DB>
where
    for<'b> String: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
    for<'b> i64: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
{
    let mut b = QueryBuilder::new(format!("{prefix}{EVENT_COLUMNS}"));
    b.push(" WHERE e.type = 'tool_result' AND e.position > ");
    b.push_bind(after);
    // The stored text leaves absent fields out, so this skips results
    // without names before they are parsed.
    b.push(" AND e.payload LIKE '%\"added_tool_names\"%'");
    scope.push(&mut b, "e");
    b.push(" ORDER BY e.position LIMIT ");
    b.push_bind(NAME_SCAN + 1);
    b
}

/// The `catalog_defined` events of these sessions.
fn catalogs_sql<'a, DB: Dialect>(prefix: &str, sessions: &[Uuid]) -> QueryBuilder<'a, DB>
where
    for<'b> String: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
{
    let mut b = QueryBuilder::new(format!("{prefix}{EVENT_COLUMNS}"));
    b.push(" WHERE e.type = 'catalog_defined' AND e.session_id IN (");
    for (i, s) in sessions.iter().enumerate() {
        if i > 0 {
            b.push(", ");
        }
        DB::push_uuid(&mut b, *s);
    }
    b.push(") ORDER BY e.session_id, e.seq");
    b
}

/// A PostgreSQL audit page of events that the server itself stops after
/// the row whose payload brings it to `max_bytes` (as the history pages'
/// statement does, src/store/postgres.rs): the client stops decoding
/// there, but sqlx reads a result to its end before the connection's next
/// statement, so a page of 1 000 events of 1 MiB moved 1 GB from the
/// server, on a pooled connection, after the answer. The query `build`
/// makes (with the prefix it is given) is wrapped whole: its own order and
/// `LIMIT` pick the rows, and the running sum follows `position`, which is
/// that order (within one session seq order is position order). An
/// unbounded read (`usize::MAX`) is the query as built.
fn pg_within(
    prefix: &str,
    build: impl Fn(&str) -> QueryBuilder<'static, Postgres>,
    max_bytes: usize,
) -> QueryBuilder<'static, Postgres> {
    if max_bytes == usize::MAX {
        return build(prefix);
    }
    let mut b = build(&format!(
        "{prefix}SELECT position, session_id, seq, event_id, payload, recorded_at FROM (\
           SELECT q.*, SUM(octet_length(q.payload)) OVER (ORDER BY q.position ROWS UNBOUNDED PRECEDING) \
                  - octet_length(q.payload) AS before FROM ("
    ));
    b.push(") q) p WHERE p.before < GREATEST(");
    b.push_bind(i64::try_from(max_bytes).unwrap_or(i64::MAX));
    b.push(", 1) ORDER BY p.position");
    b
}

/// Session ids after a cursor, in id order, with the scope's tenant.
fn sessions_sql<'a, DB: Dialect>(
    prefix: &str,
    scope: &Scope,
    after: Option<Uuid>,
) -> QueryBuilder<'a, DB>
where
    for<'b> String: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
    for<'b> i64: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
{
    // Each session's first event, found through the (session_id, seq)
    // index; sessions and their owners are few next to events.
    let mut b = QueryBuilder::new(format!(
        "{prefix}SELECT e.session_id FROM events e WHERE e.seq = 1"
    ));
    if let Some(a) = after {
        b.push(" AND e.session_id > ");
        DB::push_uuid(&mut b, a);
    }
    let scope = Scope {
        since: None,
        until: None,
        ..scope.clone()
    };
    scope.push(&mut b, "e");
    b.push(" ORDER BY e.session_id LIMIT ");
    b.push_bind(scope.limit + 1);
    b
}

impl Store {
    /// Runs an audit query that selects event rows, built by the closure
    /// of the store's backend (each is called once, PostgreSQL's twice when
    /// the first try met a broken connection), decoding rows until their
    /// payloads reach `max_bytes` (true: the bytes stopped it, so more may
    /// follow): a page of 1 000 events of 1 MiB each was built whole in
    /// memory, by any holder of an audit token, before it was answered.
    async fn fetch_events(
        &self,
        sqlite: impl FnOnce(&str) -> QueryBuilder<'static, Sqlite>,
        postgres: impl Fn(&str) -> QueryBuilder<'static, Postgres>,
        max_bytes: usize,
    ) -> Result<(Vec<StoredEvent>, bool)> {
        match &self.backend {
            Backend::Sqlite(b) => b.fetch_events(sqlite(""), max_bytes).await,
            Backend::Postgres(b) => {
                b.fetch_events(|| pg_within("", &postgres, max_bytes), max_bytes)
                    .await
            }
        }
    }

    /// An audit query's turn: at most [`AUDIT_TURNS`] run at once in a
    /// process, the others wait (an audit read may take a connection for
    /// seconds on a large store, and forty at once took every connection
    /// of the pool: other tenants' reads and `/readyz` answered 503, a
    /// review's finding). `None` for the turn's second part when the scope
    /// can hold no row: a session another tenant owns is answered as an
    /// empty page at once, without reading the log (whose rows the query
    /// would pass over one by one, in a time that told the session's
    /// length).
    async fn audit_turn(&self, scope: &Scope) -> Result<(tokio::sync::SemaphorePermit<'_>, bool)> {
        scope.check()?;
        let turn = self
            .audit_turns
            .acquire()
            .await
            .map_err(|_| Error::Unavailable("the store is closed".to_owned()))?;
        let holds = match (&scope.tenant, scope.session) {
            (Some(tenant), Some(session)) => {
                self.session_owner(session).await?.as_deref() == Some(tenant.as_str())
            }
            _ => true,
        };
        Ok((turn, holds))
    }

    /// One page of events across sessions (`audit events`).
    pub async fn audit_events(&self, q: &EventQuery) -> Result<EventPage> {
        q.scope.check()?;
        // Positions start at 1 and the cursor at 0, as `after_seq` on the
        // session routes: a negative one is a mistake, not "from the start".
        for (field, value) in [
            ("after", Some(q.after_position)),
            ("from_position", q.from_position),
            ("to_position", q.to_position),
        ] {
            if let Some(v) = value.filter(|v| *v < 0) {
                return Err(bad(
                    field,
                    format!("`{field}` must be a position, 0 or more, not {v}"),
                ));
            }
        }
        if let (Some(from), Some(to)) = (q.from_position, q.to_position) {
            if from > to {
                return Err(bad(
                    "to_position",
                    format!("`to_position` ({to}) must not be below `from_position` ({from})"),
                ));
            }
        }
        if let Some(t) = &q.event_type {
            if !EVENT_TYPES.contains(&t.as_str()) {
                return Err(bad(
                    "type",
                    format!(
                        "unknown event type {}: expected one of {}",
                        quoted(t),
                        EVENT_TYPES.join(", ")
                    ),
                ));
            }
        }
        let (_turn, holds) = self.audit_turn(&q.scope).await?;
        if !holds {
            return Ok(EventPage {
                events: Vec::new(),
                next_after_position: None,
            });
        }
        let (events, more) = page_of(
            self.fetch_events(|p| events_sql(p, q), |p| events_sql(p, q), PAGE_BYTES)
                .await?,
            q.scope.limit,
        );
        let next = more.then(|| events.last().map(|e| e.position)).flatten();
        Ok(EventPage {
            events,
            next_after_position: next,
        })
    }

    /// One page of activation changes across sessions (`audit changes`).
    pub async fn audit_changes(&self, q: &ChangeQuery) -> Result<ChangePage> {
        q.scope.check()?;
        if let Some(c) = &q.change {
            if c != "added" && c != "removed" {
                return Err(bad(
                    "change",
                    format!("`change` must be added or removed, not {}", quoted(c)),
                ));
            }
        }
        // A name no event could carry (§3: empty, over 256 bytes, or with
        // a control character) can match no row: said, not answered with
        // an empty page. PostgreSQL would also refuse U+0000 in the
        // parameter.
        if let Some(tool) = q.tool.as_deref() {
            crate::validate::check_tool_name(tool, "tool")?;
        }
        let after = match &q.after {
            None => None,
            Some(cursor) => Some(
                cursor
                    .split_once(':')
                    // The tool a page ended on is a name some event
                    // carried (§3), as the `tool` filter's is.
                    .filter(|(_, t)| crate::validate::check_tool_name(t, "after").is_ok())
                    .and_then(|(p, t)| Some((p.parse::<i64>().ok()?, t.to_owned())))
                    .filter(|(p, _)| *p >= 0)
                    .ok_or_else(|| {
                        bad(
                            "after",
                            format!(
                                "{} is not a cursor of this query (POSITION:TOOL)",
                                quoted(cursor)
                            ),
                        )
                    })?,
            ),
        };
        let (_turn, holds) = self.audit_turn(&q.scope).await?;
        if !holds {
            return Ok(ChangePage {
                changes: Vec::new(),
                next: None,
            });
        }
        let changes = match &self.backend {
            Backend::Sqlite(b) => b.fetch_changes(changes_sql("", q, after.clone())).await?,
            Backend::Postgres(b) => {
                b.fetch_changes(|| changes_sql("", q, after.clone()))
                    .await?
            }
        };
        let (changes, more) = page_of((changes, false), q.scope.limit);
        let next = more
            .then(|| changes.last().map(|c| format!("{}:{}", c.position, c.tool)))
            .flatten();
        Ok(ChangePage { changes, next })
    }

    /// One page of anomalies of one kind (`audit anomalies`).
    pub async fn audit_anomalies(&self, q: &AnomalyQuery) -> Result<AnomalyPage> {
        let (_turn, holds) = self.audit_turn(&q.scope).await?;
        if !holds {
            return Ok(AnomalyPage {
                anomalies: Vec::new(),
                next: None,
            });
        }
        match q.kind {
            AnomalyKind::UnansweredCall => self.unanswered(q).await,
            AnomalyKind::UnknownEvidenceName => self.unknown_names(q).await,
            AnomalyKind::ViewDrift => {
                // Drift is a state of a session's derived rows now, not of
                // a time: a time filter would be silently ignored.
                for (name, given) in [("since", q.scope.since), ("until", q.scope.until)] {
                    if given.is_some() {
                        return Err(bad(
                            name,
                            format!("`{name}` does not apply to view drift: it is checked on every session's current view"),
                        ));
                    }
                }
                self.drifted(q).await
            }
        }
    }

    async fn unanswered(&self, q: &AnomalyQuery) -> Result<AnomalyPage> {
        let after = position_cursor(q.after.as_deref())?;
        let calls = self
            .fetch_events(
                |p| unanswered_sql(p, &q.scope, after),
                |p| unanswered_sql(p, &q.scope, after),
                PAGE_BYTES,
            )
            .await?;
        let (calls, more) = page_of(calls, q.scope.limit);
        let next = more
            .then(|| calls.last().map(|e| e.position.to_string()))
            .flatten();
        let anomalies = calls
            .into_iter()
            .map(|e| {
                let (call_id, tool) = match &e.body {
                    EventBody::ToolCall {
                        call_id, tool_name, ..
                    } => (call_id.clone(), tool_name.clone()),
                    _ => (String::new(), String::new()),
                };
                Anomaly {
                    kind: AnomalyKind::UnansweredCall,
                    session_id: e.session_id,
                    seq: Some(e.seq),
                    event_id: Some(e.event_id),
                    position: Some(e.position),
                    recorded_at: Some(e.recorded_at),
                    detail: format!(
                        "call {} of {tool} at seq {} has no result",
                        crate::error::quoted(&call_id),
                        e.seq
                    ),
                    tools: vec![tool],
                    call_id: Some(call_id),
                }
            })
            .collect();
        Ok(AnomalyPage { anomalies, next })
    }

    async fn unknown_names(&self, q: &AnomalyQuery) -> Result<AnomalyPage> {
        let mut after = position_cursor(q.after.as_deref())?;
        let mut catalogs: HashMap<Uuid, HashSet<String>> = HashMap::new();
        let mut anomalies = Vec::new();
        let (results, more) = page_of(
            self.fetch_events(
                |p| named_results_sql(p, &q.scope, after),
                |p| named_results_sql(p, &q.scope, after),
                PAGE_BYTES,
            )
            .await?,
            NAME_SCAN,
        );
        // One lookup of every catalog of the page's sessions.
        let mut sessions: Vec<Uuid> = results.iter().map(|e| e.session_id).collect();
        sessions.sort();
        sessions.dedup();
        for chunk in sessions.chunks(500) {
            let defs = self
                .fetch_events(
                    |p| catalogs_sql(p, chunk),
                    |p| catalogs_sql(p, chunk),
                    // Every catalog of the sessions: a page cannot stop
                    // among them. Not bounded (docs/audit.md): agents have
                    // a few catalogs of tens of names.
                    usize::MAX,
                )
                .await?
                .0;
            for d in defs {
                if let EventBody::CatalogDefined { deferred_tools, .. } = d.body {
                    catalogs
                        .entry(d.session_id)
                        .or_default()
                        .extend(deferred_tools);
                }
            }
        }
        let none = HashSet::new();
        // Where the page ends: the last result read, or the result of the
        // last anomaly it can hold when more are found.
        let mut full_at = None;
        for e in &results {
            if full_at.is_some() {
                break;
            }
            after = e.position;
            let EventBody::ToolResult {
                call_id,
                added_tool_names: Some(names),
                ..
            } = &e.body
            else {
                continue;
            };
            let known = catalogs.get(&e.session_id).unwrap_or(&none);
            // Each name once, in the order of the result (a result may
            // name a tool twice).
            let mut seen = HashSet::new();
            let unknown: Vec<String> = names
                .iter()
                .filter(|n| !known.contains(*n) && seen.insert(n.as_str()))
                .cloned()
                .collect();
            if unknown.is_empty() {
                continue;
            }
            anomalies.push(Anomaly {
                kind: AnomalyKind::UnknownEvidenceName,
                session_id: e.session_id,
                seq: Some(e.seq),
                event_id: Some(e.event_id),
                position: Some(e.position),
                recorded_at: Some(e.recorded_at),
                detail: format!(
                    "the result at seq {} names {} that no catalog of the session lists",
                    e.seq,
                    unknown.join(", ")
                ),
                tools: unknown,
                call_id: Some(call_id.clone()),
            });
            if anomalies.len() as i64 == q.scope.limit {
                full_at = Some(e.position);
            }
        }
        // A page is done when nothing is left to scan after it: past the
        // anomaly that filled it, the rest of this scan must hold none.
        let done =
            match full_at {
                None => !more,
                Some(at) => !more && !results.iter().filter(|e| e.position > at).any(|e| {
                    let known = catalogs.get(&e.session_id).unwrap_or(&none);
                    matches!(&e.body, EventBody::ToolResult { added_tool_names: Some(names), .. }
                            if names.iter().any(|n| !known.contains(n)))
                }),
            };
        Ok(AnomalyPage {
            anomalies,
            next: (!done).then(|| after.to_string()),
        })
    }

    async fn drifted(&self, q: &AnomalyQuery) -> Result<AnomalyPage> {
        let after = match q.after.as_deref() {
            None => None,
            Some(c) => Some(Uuid::parse_str(c).map_err(|_| {
                bad(
                    "after",
                    format!("{} is not a cursor of this query (a session id)", quoted(c)),
                )
            })?),
        };
        let sessions = match &self.backend {
            Backend::Sqlite(b) => b.fetch_sessions(sessions_sql("", &q.scope, after)).await?,
            Backend::Postgres(b) => {
                b.fetch_sessions(|| sessions_sql("", &q.scope, after))
                    .await?
            }
        };
        let (sessions, more) = page_of((sessions, false), q.scope.limit);
        let mut anomalies = Vec::new();
        for s in &sessions {
            if let Some(detail) = self.verify(*s).await? {
                anomalies.push(Anomaly {
                    kind: AnomalyKind::ViewDrift,
                    session_id: *s,
                    seq: None,
                    event_id: None,
                    position: None,
                    recorded_at: None,
                    tools: Vec::new(),
                    call_id: None,
                    detail,
                });
            }
        }
        let next = more.then(|| sessions.last().map(Uuid::to_string)).flatten();
        Ok(AnomalyPage { anomalies, next })
    }
}

/// A cursor of the queries paged by position: 0 or more, as the events
/// query's `after` (a negative one is a mistake, not "from the start").
fn position_cursor(after: Option<&str>) -> Result<i64> {
    match after {
        None => Ok(0),
        Some(c) => c.parse().ok().filter(|p: &i64| *p >= 0).ok_or_else(|| {
            bad(
                "after",
                format!(
                    "{} is not a cursor of this query (a position, 0 or more)",
                    quoted(c)
                ),
            )
        }),
    }
}

/// The page of a query that asked for one row more than `limit`, and
/// whether there is more: a page that ends exactly at the last row says
/// so, instead of a cursor to an empty page. Rows `cut` by their bytes
/// ([`PAGE_BYTES`]) always say more (the next page may then be empty).
fn page_of<T>((mut rows, cut): (Vec<T>, bool), limit: i64) -> (Vec<T>, bool) {
    let limit = usize::try_from(limit).unwrap_or(0);
    let more = cut || rows.len() > limit;
    rows.truncate(limit);
    (rows, more)
}

/// An audit query whose plan [`Store::audit_plan`] shows (docs/audit.md).
#[derive(Clone, Debug)]
pub enum PlanOf<'a> {
    /// `audit events`.
    Events(&'a EventQuery),
    /// `audit changes`.
    Changes(&'a ChangeQuery),
    /// `audit anomalies unanswered-call`.
    UnansweredCalls(&'a Scope),
    /// The scan of `audit anomalies unknown-evidence-name`.
    NamedResults(&'a Scope),
    /// Its per-session catalog lookup.
    Catalogs(Uuid),
    /// The session list of `audit anomalies view-drift`.
    Sessions(&'a Scope),
}

impl Store {
    /// The database's plan of one audit query, executed: PostgreSQL's
    /// `EXPLAIN (ANALYZE, BUFFERS)`, SQLite's `EXPLAIN QUERY PLAN`. For
    /// docs/audit.md and for operators checking an index is used.
    pub async fn audit_plan(&self, of: PlanOf<'_>) -> Result<String> {
        fn build<DB: Dialect>(prefix: &str, of: &PlanOf<'_>) -> QueryBuilder<'static, DB>
        where
            for<'b> String: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
            for<'b> i64: sqlx::Encode<'b, DB> + sqlx::Type<DB>,
        {
            match of {
                PlanOf::Events(q) => events_sql(prefix, q),
                PlanOf::Changes(q) => changes_sql(prefix, q, None),
                PlanOf::UnansweredCalls(s) => unanswered_sql(prefix, s, 0),
                PlanOf::NamedResults(s) => named_results_sql(prefix, s, 0),
                PlanOf::Catalogs(id) => catalogs_sql(prefix, std::slice::from_ref(id)),
                PlanOf::Sessions(s) => sessions_sql(prefix, s, None),
            }
        }
        let lines = match &self.backend {
            Backend::Sqlite(b) => b.fetch_plan(build("EXPLAIN QUERY PLAN ", &of)).await?,
            Backend::Postgres(b) => {
                // The statements the pages run: bounded by the server.
                let bytes = match of {
                    PlanOf::Events(_) | PlanOf::UnansweredCalls(_) | PlanOf::NamedResults(_) => {
                        PAGE_BYTES
                    }
                    _ => usize::MAX,
                };
                b.fetch_plan(|| pg_within("EXPLAIN (ANALYZE, BUFFERS) ", |p| build(p, &of), bytes))
                    .await?
            }
        };
        Ok(lines.join("\n"))
    }
}

#[cfg(test)]
mod default_tests {
    use super::*;

    /// A default query asks for a first page of the default size, not for
    /// a refused `limit` of 0.
    #[tokio::test]
    async fn a_default_query_is_a_valid_one() {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().join("s.db").display().to_string();
        let store = crate::Store::open(&url).await.unwrap();
        assert_eq!(Scope::default().limit, DEFAULT_PAGE);
        let page = store.audit_events(&EventQuery::default()).await.unwrap();
        assert!(page.events.is_empty());
        store.close().await;
    }

    /// Audit queries take turns, [`AUDIT_TURNS`] at once, so that they
    /// leave the pool's other connections to the reads and appends; and a
    /// tenant's query narrowed to another tenant's session answers an
    /// empty page without reading the log.
    #[tokio::test]
    async fn audit_queries_take_turns_and_another_tenants_session_holds_nothing() {
        use crate::event::{EventBody, NewEvent};
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().join("s.db").display().to_string();
        let store = std::sync::Arc::new(crate::Store::open(&url).await.unwrap());
        let theirs = Uuid::new_v4();
        let started = NewEvent::new(EventBody::SessionStarted {
            mode: "agent".into(),
            metadata: None,
        });
        store
            .append_as(Some("globex"), theirs, 0, vec![started])
            .await
            .unwrap();
        let held: Vec<_> = (0..AUDIT_TURNS)
            .map(|_| store.audit_turns.try_acquire().unwrap())
            .collect();
        let waiting = {
            let store = store.clone();
            tokio::spawn(async move { store.audit_events(&EventQuery::default()).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "a third audit query ran beside two");
        drop(held);
        let page = waiting.await.unwrap().unwrap();
        assert_eq!(page.events.len(), 1);
        let acme = EventQuery {
            scope: Scope {
                tenant: Some("acme".into()),
                session: Some(theirs),
                ..Scope::default()
            },
            ..EventQuery::default()
        };
        let page = store.audit_events(&acme).await.unwrap();
        assert!(page.events.is_empty() && page.next_after_position.is_none());
        let globex = EventQuery {
            scope: Scope {
                tenant: Some("globex".into()),
                ..acme.scope.clone()
            },
            ..EventQuery::default()
        };
        assert_eq!(store.audit_events(&globex).await.unwrap().events.len(), 1);
    }

    /// The term a query by a sparse type adds is the partial index's
    /// `WHERE` on both backends, listing the same types in the same order
    /// (SQLite compares the two term by term), each of them a known type.
    #[test]
    fn the_sparse_types_term_is_the_partial_index_where() {
        let listed = SPARSE_TYPES.map(|t| format!("'{t}'")).join(", ");
        let squeezed = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(
            squeezed(sparse_types_term()),
            format!("AND e.type IN ({listed})")
        );
        for migration in [
            include_str!("../../migrations/sqlite/0009_sparse_type_index.sql"),
            include_str!("../../migrations/postgres/0009_sparse_type_index.sql"),
        ] {
            assert!(
                squeezed(migration).contains(&format!("WHERE type IN ({listed});")),
                "{migration}"
            );
        }
        assert!(SPARSE_TYPES.iter().all(|t| EVENT_TYPES.contains(t)));
    }

    /// The bounds of the stored times are the first and last microsecond
    /// of the years 0000 to 9999 (not a fallback of the parse).
    #[test]
    fn stored_times_span_the_years_0000_to_9999() {
        use chrono::{Datelike, Timelike};
        let (first, last) = stored_times();
        assert_eq!(
            (
                first.year(),
                first.ordinal(),
                first.num_seconds_from_midnight()
            ),
            (0, 1, 0)
        );
        assert_eq!(
            (
                last.year(),
                last.ordinal(),
                last.num_seconds_from_midnight()
            ),
            (9999, 365, 86_399)
        );
        assert_eq!(last.nanosecond(), 999_999_000);
    }
}
