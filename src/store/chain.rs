//! The hash chain inside the store: the previous hash an append chains
//! to, the one-time chaining of sessions written before the chain existed,
//! and `verify --integrity` (docs/integrity.md).
//!
//! The encoding and the checker are pure (`crate::integrity`); this module
//! only moves rows. Hashes are computed in the append's own transaction,
//! under the write lock, so a session's chain can never fork.

use serde::Serialize;
use tracing::info;
use uuid::Uuid;

use super::{Backend, LogTx, Store};
use crate::error::{Error, Result};
use crate::event::StoredEvent;
use crate::integrity::{event_hash, BreakKind, ChainChecker, IntegrityBreak};

/// Rows read per page while chaining or checking.
const PAGE: i64 = 2_000;

/// One row of a session's log as the chain's pages read it: not only the
/// event but what `verify --integrity` must see of a row edited around
/// the store.
pub(crate) struct ChainedRow {
    /// The row as an event, or why it cannot be read as one (its payload,
    /// ids or time edited into something the store never writes).
    pub(crate) event: std::result::Result<StoredEvent, String>,
    /// The row's seq and event id, as stored (the id `None` when it is not
    /// a UUID), for a break at a row that cannot be read.
    pub(crate) seq: i64,
    pub(crate) event_id: Option<Uuid>,
    /// Its stored chain hash.
    pub(crate) hash: Option<String>,
    /// Its `type` column: a copy of the payload's type that the audit
    /// queries and the sparse indexes read, so it must agree with it.
    pub(crate) type_column: String,
}

impl ChainedRow {
    /// A row read back, decoded with the backend's `decode`.
    pub(crate) fn read(
        event: Result<StoredEvent>,
        seq: i64,
        event_id: Option<Uuid>,
        hash: Option<String>,
        type_column: String,
    ) -> ChainedRow {
        ChainedRow {
            event: event.map_err(|e| e.to_string()),
            seq,
            event_id,
            hash,
            type_column,
        }
    }
}

/// The hash to chain to after the session's event at `head` (`""` for a
/// new session), given the hash stored with that event (read with the head,
/// [`LogTx::head`]), chaining the session first if it predates the chain.
pub(crate) async fn head_hash<T: LogTx>(
    tx: &mut T,
    session_id: Uuid,
    head: i64,
    stored: Option<String>,
) -> Result<String> {
    if head == 0 {
        return Ok(String::new());
    }
    match stored {
        Some(h) => Ok(h),
        None if tx.is_backfill_pending(session_id).await? => chain_session(tx, session_id).await,
        // A missing hash on a chained session is a break verify reports;
        // the new rows chain to nothing rather than hide it.
        None => Ok(String::new()),
    }
}

/// Chains a session written before the chain existed: fills in every
/// missing hash in seq order; returns the head's hash.
///
/// A session written before the chain has no hash at all (a session is
/// chained in one transaction, and an append to a listed session chains
/// it first). One listed with hashed rows was listed behind the store's
/// back, the way to get an edited row re-hashed ("repaired") by the next
/// open, even by the `verify --integrity` meant to catch it: it is taken
/// off the list and nothing is filled in, so its rows without a hash stay
/// `missing_hash` breaks (returns `""`: new rows chain to nothing, as
/// after any missing hash).
async fn chain_session<T: LogTx>(tx: &mut T, session_id: Uuid) -> Result<String> {
    // First every row is looked at, then hashes are filled in: nothing is
    // written for a session with a hashed row anywhere (a one-time cost
    // of one more read of the sessions from before the chain).
    let mut after = 0;
    loop {
        let page = tx.chained_page(session_id, after, PAGE).await?;
        let Some(last) = page.last() else { break };
        if let Some(hashed) = page.iter().find(|r| r.hash.is_some()) {
            tracing::warn!(session = %session_id, seq = hashed.seq, "a session listed for its one-time chaining already has hashed rows (the list was edited behind the store's back): nothing is filled in, and verify --integrity reports its rows without a hash");
            tx.backfill_done(session_id).await?;
            return Ok(String::new());
        }
        after = last.seq;
    }
    let mut prev = String::new();
    let mut after = 0;
    loop {
        let page = tx.chained_page(session_id, after, PAGE).await?;
        if page.is_empty() {
            break;
        }
        for row in page {
            let event = row.event.map_err(Error::Corrupt)?;
            let h = event_hash(&event, &prev);
            tx.set_hash(event.position, &h).await?;
            prev = h;
            after = event.seq;
        }
    }
    tx.backfill_done(session_id).await?;
    Ok(prev)
}

/// One session's chain head: record it somewhere else to detect a
/// truncated log later (docs/integrity.md, "What a chain cannot see").
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChainHead {
    /// The session.
    pub session_id: Uuid,
    /// Its latest seq.
    pub seq: i64,
    /// That event's hash.
    pub hash: String,
}

/// What `verify --integrity` found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IntegrityReport {
    /// Sessions whose chains were recomputed.
    pub sessions: usize,
    /// Events checked.
    pub events: u64,
    /// The first broken link of each broken session.
    pub breaks: Vec<IntegrityBreak>,
    /// Problems of the log as a whole (rows missing from the global order).
    pub log_problems: Vec<String>,
    /// The head of every intact session.
    pub heads: Vec<ChainHead>,
}

impl IntegrityReport {
    /// True when nothing is broken.
    pub fn intact(&self) -> bool {
        self.breaks.is_empty() && self.log_problems.is_empty()
    }
}

async fn check_session<T: LogTx>(
    tx: &mut T,
    session_id: Uuid,
    report: &mut IntegrityReport,
) -> Result<()> {
    let mut checker = ChainChecker::new();
    let mut after = 0;
    let mut head = None;
    loop {
        let page = tx.chained_page(session_id, after, PAGE).await?;
        if page.is_empty() {
            break;
        }
        for row in &page {
            report.events += 1;
            let edited = |message: String| IntegrityBreak {
                session_id,
                seq: row.seq,
                event_id: row.event_id.unwrap_or_default(),
                kind: BreakKind::HashMismatch,
                message,
            };
            let event = match &row.event {
                Ok(event) => event,
                Err(why) => {
                    report.breaks.push(edited(format!(
                        "session {session_id}: seq {} cannot be read as an event ({why}); it was edited around the store",
                        row.seq
                    )));
                    return Ok(());
                }
            };
            if row.type_column != event.body.type_name() {
                report.breaks.push(edited(format!(
                    "session {session_id}: seq {} (event {}) is a `{}` but its type column says {}; the column was edited around the store (the audit queries read it)",
                    row.seq,
                    event.event_id,
                    event.body.type_name(),
                    crate::error::quoted(&row.type_column)
                )));
                return Ok(());
            }
            if let Some(b) = checker.check(event, row.hash.as_deref()) {
                report.breaks.push(b);
                return Ok(());
            }
            after = event.seq;
            head = row.hash.clone().map(|h| (event.seq, h));
        }
    }
    if let Some((seq, hash)) = head {
        report.heads.push(ChainHead {
            session_id,
            seq,
            hash,
        });
    }
    Ok(())
}

async fn verify_in<T: LogTx>(mut tx: T, only: Option<Uuid>) -> Result<IntegrityReport> {
    let mut report = IntegrityReport::default();
    let sessions = match only {
        Some(s) => vec![s],
        None => tx.session_ids().await?,
    };
    for s in sessions {
        report.sessions += 1;
        check_session(&mut tx, s, &mut report).await?;
    }
    let (count, max, handed_out) = tx.position_summary().await?;
    if count < max {
        // Positions are dense from 1: fewer rows than the highest says
        // some are missing, whether deleted or never there (a row written
        // around the store at a higher position looks the same).
        report.log_problems.push(format!(
            "the log holds {count} events but its positions run to {max}: {} missing (deleted, or a row was written around the store at a higher position)",
            match max - count {
                1 => "1 position is".to_owned(),
                n => format!("{n} positions are"),
            }
        ));
    } else if count > max {
        report.log_problems.push(format!(
            "the log holds {count} events but its positions run only to {max}: rows were written around the store at positions the store never hands out (below 1)"
        ));
    } else if handed_out != max {
        report.log_problems.push(format!(
            "positions were handed out up to {handed_out} but the log ends at {max}: the latest rows were deleted"
        ));
    }
    Ok(report)
}

impl Store {
    /// The one-time work of an upgrade, when there is any: on PostgreSQL
    /// by one instance at a time ([`PgBackend::backfill_turn`]); an
    /// instance that waited for another one's finds nothing left and goes
    /// on. On SQLite every process that opens the store meanwhile does it
    /// too, its write transactions taking turns with the others' (each
    /// backfill transaction is followed by a pause in which a writer
    /// waiting in SQLite's busy handler gets the lock).
    ///
    /// [`PgBackend::backfill_turn`]: super::postgres::PgBackend::backfill_turn
    pub(crate) async fn backfill(&self) -> Result<()> {
        let pending = match &self.backend {
            Backend::Sqlite(b) => {
                let mut tx = b.begin_read().await?;
                !tx.backfill_pending(1).await?.is_empty()
                    || !tx.changes_backfill_pending(1).await?.is_empty()
            }
            Backend::Postgres(b) => {
                let mut tx = b.begin_read().await?;
                !tx.backfill_pending(1).await?.is_empty()
                    || !tx.changes_backfill_pending(1).await?.is_empty()
            }
        };
        if !pending {
            return Ok(());
        }
        let turn = match &self.backend {
            Backend::Postgres(b) => b.backfill_turn().await?,
            Backend::Sqlite(_) => None,
        };
        let done = async {
            self.backfill_chains().await?;
            self.backfill_changes().await
        }
        .await;
        if let Some(conn) = turn {
            super::postgres::PgBackend::end_turn(conn).await;
        }
        done
    }

    /// Chains the sessions written before the chain existed (once, when a
    /// store is opened after migration 0004), a few sessions per write
    /// transaction.
    pub(crate) async fn backfill_chains(&self) -> Result<()> {
        async fn batch<T: LogTx>(mut tx: T) -> Result<usize> {
            let pending = tx.backfill_pending(50).await?;
            let started = std::time::Instant::now();
            let mut done = 0;
            for s in &pending {
                chain_session(&mut tx, *s).await?;
                done += 1;
                if started.elapsed() >= super::BACKFILL_TX_BUDGET {
                    break;
                }
            }
            tx.commit().await?;
            Ok(done)
        }
        // Read first: the write lock is only worth waiting for when there
        // is something to chain, and every command opens the store (a
        // read-only one must not queue behind another process's writer).
        let pending = match &self.backend {
            Backend::Sqlite(b) => b.begin_read().await?.backfill_pending(1).await?,
            Backend::Postgres(b) => b.begin_read().await?.backfill_pending(1).await?,
        };
        if pending.is_empty() {
            return Ok(());
        }
        let mut total = 0;
        loop {
            let n = match &self.backend {
                Backend::Sqlite(b) => batch(b.begin_write().await?).await?,
                Backend::Postgres(b) => batch(b.begin_write().await?).await?,
            };
            if n == 0 {
                break;
            }
            total += n;
            self.backfill_pause().await;
        }
        if total > 0 {
            info!(
                sessions = total,
                "chained sessions written before the hash chain"
            );
        }
        Ok(())
    }

    /// On SQLite, the write lock left free between two backfill
    /// transactions for [`super::rebuild::REBUILD_PAUSE`], as between
    /// rebuilds: SQLite keeps no queue of waiting processes, and one
    /// that opened the store during the work (even to read) waited in the
    /// busy handler, found the lock taken again at once, and exited 4
    /// after 10 s ("database is locked"; a review, 2026-12-07).
    pub(super) async fn backfill_pause(&self) {
        if matches!(self.backend, Backend::Sqlite(_)) {
            tokio::time::sleep(super::rebuild::REBUILD_PAUSE).await;
        }
    }

    /// Recomputes the hash chains of one session or all, and checks that
    /// no row left the global order: the first broken link of each session
    /// (an edited payload, type, time or id, a deleted, inserted or
    /// reordered row, a missing hash), and the head of each intact one.
    /// Reads in pages: memory does not grow with the log. A session that
    /// does not exist is [`crate::Error::SessionNotFound`], as for `verify`, not
    /// a chain of no events reported intact.
    pub async fn verify_integrity(&self, session: Option<Uuid>) -> Result<IntegrityReport> {
        if let Some(id) = session {
            if self.head_seq(id).await? == 0 {
                return Err(crate::error::Error::SessionNotFound(id));
            }
        }
        let _long = self.long_read().await?;
        match &self.backend {
            Backend::Sqlite(b) => verify_in(b.begin_read().await?, session).await,
            Backend::Postgres(b) => verify_in(b.begin_read().await?, session).await,
        }
    }
}
