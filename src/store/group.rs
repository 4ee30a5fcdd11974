//! Group commit: appends that arrive while another append of this process
//! is committing are committed together, in one transaction, by whoever
//! takes the writer slot next.
//!
//! Why: every append must take the store-wide write lock (SQLite's file
//! lock, PostgreSQL's position counter) and pay a durable commit (an fsync)
//! while holding it. One commit per append caps a process at one fsync per
//! append however many sessions it serves; measured by `session-store
//! bench`, sixteen writers on distinct sessions got a twentieth of what raw
//! inserts of the same rows achieve (docs/benchmarks.md). Committing the
//! queue together pays one lock and one fsync for the whole group.
//!
//! How (leader and followers, no background task of its own): an append
//! queues itself, then waits for either its reply or the writer slot. The
//! one that gets the slot takes the whole queue and commits it in a task it
//! spawns (so a caller that gives up waiting cannot cancel the others'
//! commit); the task releases the slot when it has replied to everyone. A
//! queue of one append, the leader's own, is committed in the leader's task:
//! nobody else's append can be cancelled with it, and it saves the task
//! switch and wake-up that a lone writer otherwise paid on every append.
//! An append whose caller stopped waiting before its group started is
//! dropped rather than tried. One whose group had started may still be
//! stored after its caller gave up: on PostgreSQL, a statement already at
//! the server waits for the position counter up to the lock timeout (10 s)
//! and then commits (`Store::append` says how to settle it).
//!
//! Each append of a group is judged exactly as alone: the idempotent-retry
//! check, the expected seq and validation run against the log as the
//! group's earlier appends left it, and nothing is written until the batch
//! is accepted, so a rejected append leaves no trace and the others go on.
//! (An optimistic SQLite group sends rows ahead of their acceptance, but
//! any refusal there sends the whole group, rolled back, to the lock.)
//! Only a failure of the database itself while writing (or the commit)
//! fails the whole group, which rolls back; each of its appends gets the
//! error, and none of them was stored.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{oneshot, OwnedMutexGuard};
use uuid::Uuid;

use super::postgres::OptimisticMiss;
use super::{append_in, Backend, LogTx, StateCache, StoreOptions, Warm};
use crate::error::{Error, Result, ValidationError};
use crate::event::{EventBody, NewEvent};
use crate::store::AppendOutcome;

/// What a store's groups share besides the writer slot:
/// [`super::AppendPaths`], counted as groups are committed, and the last
/// time a group found the storage unavailable ([`Outage`]).
#[derive(Default)]
pub(crate) struct PathCounters {
    locked: AtomicU64,
    optimistic: AtomicU64,
    abandoned: AtomicU64,
    sends_ahead: AtomicU64,
    outage: Outage,
}

/// When a group last failed whole because the storage could not be had
/// for [`OUTAGE_WAIT`] or longer: no connection to PostgreSQL within the
/// connection timeout, PostgreSQL's position counter or SQLite's write
/// lock not had within the lock or busy timeout (a writer stalled holding
/// it). Only these failures count: the call that opens the group's write
/// (`begin_write`, or the optimistic call, which takes the counter first),
/// timed by itself, failing with nothing stored. And what the storage said.
///
/// Why: the appends queued behind such a group waited for it, and the
/// next group would then wait its own timeout: with PostgreSQL down, an
/// append that arrived while another waited for a connection was answered
/// after two connection timeouts, 10 s instead of 5 (found by a review of
/// `serve` during outages). The appends that were queued before the
/// failure are answered with it at once, untried; an append queued after
/// it is tried as usual. Nothing is stored either way, and the answer is
/// retryable. A call that fails at once (a connection found dead after a
/// server restart, a full disk) held nobody up: the appends behind it are
/// tried, on the connections that answer a ping (`postgres::pool_options`).
#[derive(Default)]
struct Outage {
    last: std::sync::Mutex<Option<(std::time::Instant, String)>>,
}

/// How long the failing call must have waited for its failure to answer
/// the appends queued behind it ([`Outage`]).
const OUTAGE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl Outage {
    /// Records `e`, the failure of the call that opens a group's write
    /// after `waited`, when it says the storage is unavailable and the call
    /// waited [`OUTAGE_WAIT`] for it.
    fn found(&self, e: &Error, waited: std::time::Duration) {
        if let (Error::Unavailable(m), true, Ok(mut last)) =
            (e, waited >= OUTAGE_WAIT, self.last.lock())
        {
            *last = Some((std::time::Instant::now(), m.clone()));
        }
    }

    /// Answers the appends of `group` queued before the last outage was
    /// found, untried, and gives back the others.
    fn answer_stale(&self, group: Vec<Pending>) -> Vec<Pending> {
        let Some((at, why)) = self.last.lock().ok().and_then(|last| last.clone()) else {
            return group;
        };
        let (stale, fresh): (Vec<Pending>, Vec<Pending>) =
            group.into_iter().partition(|p| p.queued < at);
        for p in stale {
            let _ = p.reply.send(Err(Error::Unavailable(format!(
                "{why} (found while this append waited behind others; it was not tried, \
                 and nothing of it is stored)"
            ))));
        }
        fresh
    }
}

impl PathCounters {
    pub(crate) fn snapshot(&self) -> super::AppendPaths {
        super::AppendPaths {
            locked: self.locked.load(Ordering::Relaxed),
            optimistic: self.optimistic.load(Ordering::Relaxed),
            optimistic_abandoned: self.abandoned.load(Ordering::Relaxed),
            sends_ahead: self.sends_ahead.load(Ordering::Relaxed),
        }
    }
}

/// One append waiting in the queue.
pub(crate) struct Pending {
    pub(crate) tenant: Option<String>,
    pub(crate) session_id: Uuid,
    /// `None`: at whatever the head is (`append_at_head`).
    pub(crate) expected_seq: Option<i64>,
    pub(crate) events: Vec<NewEvent>,
    /// The error of the batch's next event (at index `events.len()`),
    /// which could not be read as an event: judged after the events
    /// before it, as SEMANTICS §2 orders ([`crate::Store::refuse_batch`]).
    pub(crate) invalid_tail: Option<ValidationError>,
    pub(crate) reply: oneshot::Sender<Result<AppendOutcome>>,
    /// When it was queued ([`Outage`]).
    pub(crate) queued: std::time::Instant,
}

/// Why one append of a group failed.
pub(crate) struct Failed {
    pub(crate) error: Error,
    /// Whether the transaction can no longer be committed for the others:
    /// something was written, or the database failed (PostgreSQL aborts the
    /// transaction on any error).
    pub(crate) broken: bool,
}

impl From<Error> for Failed {
    /// An error of a database call: the transaction is broken unless the
    /// error is a judgement (conflict, validation, not found).
    fn from(error: Error) -> Failed {
        let broken = matches!(
            error,
            Error::Database(_)
                | Error::Unavailable(_)
                | Error::OutcomeUnknown(_)
                | Error::RetriesExhausted { .. }
        );
        Failed { error, broken }
    }
}

/// What a refused append of a group that did not commit is told: its
/// refusal was judged against appends that are not stored (or not known
/// to be), so it is not said; nothing of it was written (a refusal writes
/// nothing), and sent again it is judged afresh.
fn unsettled(e: &Error) -> Error {
    let cause = match e {
        Error::Database(m) | Error::Unavailable(m) | Error::OutcomeUnknown(m) => m.clone(),
        e => e.to_string(),
    };
    Error::Unavailable(format!(
        "this append was judged together with others whose transaction failed ({cause}); \
         nothing of it was stored: send it again"
    ))
}

/// The same failure for another append of the group.
fn again(e: &Error) -> Error {
    match e {
        Error::Unavailable(m) => Error::Unavailable(m.clone()),
        Error::OutcomeUnknown(m) => Error::OutcomeUnknown(m.clone()),
        other => {
            // A database error's words without their "database error: ",
            // which the new error says once.
            let cause = match other {
                Error::Database(m) => m.clone(),
                e => e.to_string(),
            };
            Error::Database(format!(
                "the transaction this append was written in failed, and nothing of it was stored: {cause}"
            ))
        }
    }
}

/// A failure of an optimistic group's commit (PostgreSQL's one
/// autocommitted call, SQLite's commit query), for each append of the
/// group. `Unavailable` from a remote commit (a lost connection, the
/// deadline) may have come after the server committed: the appends are
/// told their outcome is unknown. SQLite's commit is in this process: it
/// either commits or rolls back and says so, and its failures stay as
/// they are.
fn commit_failed(remote_commit: bool, e: &Error) -> Error {
    match e {
        Error::Unavailable(m) if remote_commit => Error::OutcomeUnknown(m.clone()),
        _ => again(e),
    }
}

/// The reply to a committed append: its outcome, unless a test asked for
/// the reply to be lost (`StoreOptions::fault_lose_replies`), as when the
/// connection drops between the commit and its acknowledgement.
fn reply_after_commit(options: &StoreOptions, outcome: AppendOutcome) -> Result<AppendOutcome> {
    let lose = options.fault_lose_replies.as_ref().is_some_and(|left| {
        left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    });
    match lose {
        true => Err(Error::OutcomeUnknown(
            "the reply of this committed append was lost (fault injection)".to_owned(),
        )),
        false => Ok(outcome),
    }
}

/// Commits `group` and replies to each append; releases the writer slot
/// when done.
pub(crate) async fn commit_group(
    backend: Backend,
    options: StoreOptions,
    states: StateCache,
    paths: Arc<PathCounters>,
    group: Vec<Pending>,
    slot: OwnedMutexGuard<()>,
) {
    let group = paths.outage.answer_stale(group);
    if group.is_empty() {
        return;
    }
    let group = match &backend {
        _ if options.fault_pause_before_commit.is_some() => Some(group),
        Backend::Postgres(b) => optimistic(b.optimistic(), &options, &states, &paths, group).await,
        Backend::Sqlite(b) => match b.begin_optimistic().await {
            Ok(Some(tx)) => optimistic(tx, &options, &states, &paths, group).await,
            // The locked path opens the writer again and says any error.
            _ => Some(group),
        },
    };
    if let Some(group) = group {
        paths.locked.fetch_add(1, Ordering::Relaxed);
        match &backend {
            Backend::Sqlite(b) => {
                let tx = opened(&paths.outage, b.begin_write()).await;
                run(tx, &options, &states, group).await
            }
            Backend::Postgres(b) => {
                let tx = opened(&paths.outage, b.begin_write()).await;
                run(tx, &options, &states, group).await
            }
        }
    }
    drop(slot);
}

/// The write transaction `begin` opens, its failure told to `outage` with
/// how long it waited for it.
async fn opened<T>(
    outage: &Outage,
    begin: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let start = std::time::Instant::now();
    let tx = begin.await;
    if let Err(e) = &tx {
        outage.found(e, start.elapsed());
    }
    tx
}

/// Judges and commits `group` under the write lock. A failed commit is
/// told to each append as the backend said it ([`LogTx::commit_append`]:
/// `OutcomeUnknown` when the answer to a `COMMIT` sent to a server was
/// lost, a failure before the `COMMIT` as it is: nothing stored).
async fn run<T: LogTx>(
    tx: Result<T>,
    options: &StoreOptions,
    states: &StateCache,
    group: Vec<Pending>,
) {
    let mut tx = match tx {
        Ok(tx) => tx,
        Err(e) => {
            for p in group {
                let _ = p.reply.send(Err(again(&e)));
            }
            return;
        }
    };
    // One read for the judgements of the whole group: heads, stored ids,
    // views and calls index rows, served to each append's reads (both
    // backends' transactions keep what they read ahead current through the
    // group's own writes).
    let mut sessions: Vec<Uuid> = Vec::new();
    let mut ids: Vec<Uuid> = Vec::new();
    let mut calls: Vec<(Uuid, &str)> = Vec::new();
    for p in group.iter().filter(|p| !p.reply.is_closed()) {
        if !sessions.contains(&p.session_id) {
            sessions.push(p.session_id);
        }
        ids.extend(p.events.iter().filter_map(|e| e.event_id));
        calls.extend(p.events.iter().filter_map(|e| match &e.body {
            // Not a call id holding U+0000: never stored (validation
            // refuses it), and PostgreSQL would fail the read on it.
            EventBody::ToolCall { call_id, .. } | EventBody::ToolResult { call_id, .. }
                if !call_id.contains('\0') =>
            {
                Some((p.session_id, call_id.as_str()))
            }
            _ => None,
        }));
    }
    // A view this process's cache knows is not read ahead (a group of 16
    // appends read 16 views it did not use); if another writer appended
    // meanwhile, the judgement reads it when it asks.
    let views: Vec<Uuid> = sessions
        .iter()
        .copied()
        .filter(|s| !states.knows(*s))
        .collect();
    let prefetched = tx.prefetch(&sessions, &views, &ids, &calls).await;
    drop(calls);
    if let Err(e) = prefetched {
        for p in group {
            let _ = p.reply.send(Err(again(&e)));
        }
        return;
    }
    // The states of the sessions this group appended to, as its accepted
    // appends left them; they go to the cache only if the commit succeeds.
    tracing::debug!(appends = group.len(), "group commit");
    let mut local: HashMap<Uuid, Warm> = HashMap::new();
    let mut accepted = Vec::new();
    // Per session, whether no other writer appended since this process's
    // last group on it ([`StateCache::set_contended`]), as its first
    // accepted append here found.
    let mut quiet: Vec<(Uuid, bool)> = Vec::new();
    let mut broken: Option<Error> = None;
    // Refusals are answered once the group's outcome is known, as its
    // acceptances are: an append is judged against the group's earlier,
    // uncommitted ones, so a 409 may name a head that is not committed
    // yet (a read right after it did not find it: a review's finding), or
    // one that a failed commit never makes true; so may a refusal of an
    // id or call id an earlier member took. Should the group not commit,
    // they are told to try again, and judged afresh then.
    let mut refused: Vec<(oneshot::Sender<Result<AppendOutcome>>, Error)> = Vec::new();
    for p in group {
        if p.reply.is_closed() {
            // Its caller gave up before the append was tried: it is not
            // tried at all (as if it had been cancelled earlier).
            continue;
        }
        if let Some(e) = &broken {
            let _ = p.reply.send(Err(again(e)));
            continue;
        }
        // The seq this process last left the session at, for its group's
        // first append to it: whether another writer appended since.
        let mut last_seen = None;
        let mut cached = match local.remove(&p.session_id) {
            Some(warm) => Some(warm),
            None => {
                let warm = states.take(p.session_id);
                last_seen = warm.as_ref().map(|w| w.state.seq);
                warm
            }
        };
        let result = append_in(&mut tx, &mut cached, &p, options).await;
        if let Some(state) = cached {
            local.insert(p.session_id, state);
        }
        match result {
            Ok(outcome) => {
                if let (Some(seen), Some(first), false) =
                    (last_seen, outcome.events.first(), outcome.replayed)
                {
                    quiet.push((p.session_id, first.seq == seen + 1));
                }
                accepted.push((p.reply, outcome))
            }
            Err(Failed {
                error,
                broken: true,
            }) => {
                broken = Some(again(&error));
                // Those accepted before are rolled back with this one, and
                // those refused were judged against them.
                for (reply, _) in accepted.drain(..) {
                    let _ = reply.send(Err(again(&error)));
                }
                for (reply, _) in refused.drain(..) {
                    let _ = reply.send(Err(unsettled(&error)));
                }
                let _ = p.reply.send(Err(error));
            }
            Err(Failed { error, .. }) => refused.push((p.reply, error)),
        }
    }
    if broken.is_some() {
        // Dropping the transaction rolls it back; the states advanced by
        // its accepted appends go with it.
        return;
    }
    if accepted.is_empty() {
        // Every append was refused, each against committed rows only: no
        // state was advanced (a refused batch leaves its state untouched
        // or takes it), so the cache keeps them.
        for warm in local.into_values() {
            states.put(warm);
        }
        for (reply, error) in refused {
            let _ = reply.send(Err(error));
        }
        return;
    }
    if let Some(pause) = options.fault_pause_before_commit {
        tokio::time::sleep(pause).await;
    }
    match tx.commit_append().await {
        Ok(()) => {
            if let Some(pause) = options.fault_pause_after_commit {
                tokio::time::sleep(pause).await;
            }
            for state in local.into_values() {
                states.put(state);
            }
            for (session_id, quiet) in quiet {
                states.set_contended(session_id, !quiet);
            }
            for (reply, outcome) in accepted {
                let _ = reply.send(reply_after_commit(options, outcome));
            }
            for (reply, error) in refused {
                let _ = reply.send(Err(error));
            }
        }
        Err(e) => {
            for (reply, _) in accepted {
                let _ = reply.send(Err(again(&e)));
            }
            for (reply, _) in refused {
                let _ = reply.send(Err(unsettled(&e)));
            }
        }
    }
}

/// The one-round-trip group (docs/design.md, "Optimistic appends"): when
/// an append of this process left every session of the group in the cache,
/// with its head's hash, stored view and owner known, the group is judged
/// against those without reading the database, and its writes go in one
/// round trip that checks what the judgement assumed before it commits:
/// on PostgreSQL one autocommitted call of `session_store_append`
/// (migration 0007), which takes the counter's lock, checks that every
/// session's head is still the one judged against and that no call id the
/// judgement took as new is stored, then writes, with the positions moved
/// past the counter; on SQLite one query that takes the write lock, checks
/// that the log still ends where this writer's last commit left it, that
/// every session's head is still the one judged against and that no call
/// id taken as new is stored, then writes and commits (with long batches,
/// the lock, that check of the heads and rows go ahead in queries of their
/// own while the rest is judged: docs/design.md, "Rows sent ahead").
///
/// Returns the group untouched (no reply sent) when it must be judged
/// under the lock instead: a session not known, a read the cache cannot
/// answer, any refusal (the judgement is redone against the database,
/// which has the last word), or a check of the write that failed (raised
/// before the commit, so nothing was written). States that an accepted
/// append of the attempt advanced are dropped (the locked path reads
/// them afresh); the others go back to the cache. A call that failed in
/// any other way may have committed: its appends get the error.
async fn optimistic<T: OptimisticTx>(
    mut tx: T,
    options: &StoreOptions,
    states: &StateCache,
    paths: &PathCounters,
    group: Vec<Pending>,
) -> Option<Vec<Pending>> {
    // Another writer appended to one of these sessions between this
    // process's last groups on it: the attempt's check would fail.
    if states.any_contended(group.iter().map(|p| p.session_id)) {
        return Some(group);
    }
    let mut local: HashMap<Uuid, Warm> = HashMap::new();
    let mut heads: HashMap<Uuid, i64> = HashMap::new();
    for p in group.iter().filter(|p| !p.reply.is_closed()) {
        if local.contains_key(&p.session_id) {
            continue;
        }
        // A session not in the cache, or left there by a read: nothing is
        // known to judge against, so every state taken goes back.
        match states.take(p.session_id) {
            Some(warm) if warm.known.is_some() => {
                tx.assume(&warm);
                heads.insert(p.session_id, warm.state.seq);
                local.insert(p.session_id, warm);
            }
            other => {
                other
                    .into_iter()
                    .chain(local.into_values())
                    .for_each(|w| states.put(w));
                return Some(group);
            }
        }
    }
    paths.optimistic.fetch_add(1, Ordering::Relaxed);
    let mut outcomes = Vec::with_capacity(group.len());
    // Sessions an accepted append of this group advanced: their states
    // hold writes that are not stored yet.
    let mut advanced: HashSet<Uuid> = HashSet::new();
    for (i, p) in group.iter().enumerate() {
        if p.reply.is_closed() {
            continue;
        }
        let mut cached = local.remove(&p.session_id);
        let result = append_in(&mut tx, &mut cached, p, options).await;
        if let Some(warm) = cached {
            local.insert(p.session_id, warm);
        }
        match result {
            Ok(outcome) => {
                advanced.insert(p.session_id);
                outcomes.push((i, outcome));
            }
            Err(Failed { error, .. }) => {
                paths
                    .sends_ahead
                    .fetch_add(tx.sends_ahead(), Ordering::Relaxed);
                // The states no accepted append advanced are still true (a
                // refused batch leaves its state untouched or takes it).
                for (session_id, warm) in local {
                    if !advanced.contains(&session_id) {
                        states.put(warm);
                    }
                }
                if let Some(e) = tx.ahead_failure() {
                    // Rows sent ahead failed for the storage's reason (the
                    // transaction is rolled back, nothing is stored): said
                    // now, as a failed commit is, rather than waited out
                    // again under the lock.
                    for p in group {
                        let _ = p.reply.send(Err(commit_failed(T::REMOTE_COMMIT, &e)));
                    }
                    return None;
                }
                // Judged again under the lock, which has the last word.
                tracing::debug!(session = %p.session_id, %error, "optimistic append left to the locked path");
                paths.abandoned.fetch_add(1, Ordering::Relaxed);
                return Some(group);
            }
        }
    }
    paths
        .sends_ahead
        .fetch_add(tx.sends_ahead(), Ordering::Relaxed);
    if outcomes.is_empty() {
        // Every caller gave up before its append was tried.
        local.into_values().for_each(|w| states.put(w));
        return None;
    }
    let calling = std::time::Instant::now();
    let base = match tx.commit_optimistic().await {
        Ok(base) => base,
        Err(OptimisticMiss::Rejected(why)) => {
            tracing::debug!(%why, "optimistic append refused by its checks; judged again under the lock");
            paths.abandoned.fetch_add(1, Ordering::Relaxed);
            // Which session moved is not said: all of them go to the lock
            // until a locked group finds each one quiet.
            for p in &group {
                states.set_contended(p.session_id, true);
            }
            return Some(group);
        }
        Err(OptimisticMiss::NotStored(e)) => {
            // The call never went out (no connection), or the server said
            // it failed before its commit: nothing is stored, said as it
            // is (a full disk stays "storage unavailable", not an unknown
            // outcome).
            paths.outage.found(&e, calling.elapsed());
            for p in group {
                let _ = p.reply.send(Err(again(&e)));
            }
            return None;
        }
        Err(OptimisticMiss::Failed(e)) => {
            // Answered like a failed commit, never tried again behind the
            // caller's back: PostgreSQL's call may have committed (its
            // outcome is unknown), SQLite's query failed whole.
            if !T::REMOTE_COMMIT {
                // SQLite's write lock not had within the busy timeout (its
                // query opens the transaction): nothing stored, as the
                // answer says (`Unavailable`; a failure after the frames
                // were written is `OutcomeUnknown`, never recorded).
                paths.outage.found(&e, calling.elapsed());
            }
            for p in group {
                let _ = p.reply.send(Err(commit_failed(T::REMOTE_COMMIT, &e)));
            }
            return None;
        }
    };
    if let Some(pause) = options.fault_pause_after_commit {
        tokio::time::sleep(pause).await;
    }
    // Positions were reserved from 0: move them past the counter's value.
    for (session_id, mut warm) in local {
        let head = heads.get(&session_id).copied().unwrap_or(0);
        for r in warm
            .state
            .rows
            .iter_mut()
            .rev()
            .take_while(|r| r.seq > head)
        {
            r.position += base;
        }
        states.put(warm);
    }
    let mut replies: Vec<Option<Pending>> = group.into_iter().map(Some).collect();
    for (i, mut outcome) in outcomes {
        for a in &mut outcome.events {
            a.position += base;
        }
        if let Some(p) = replies[i].take() {
            let _ = p.reply.send(reply_after_commit(options, outcome));
        }
    }
    None
}

/// A transaction an optimistic group is judged in ([`optimistic`]).
pub(crate) trait OptimisticTx: LogTx {
    /// Whether the commit is a round trip to a server, whose answer can be
    /// lost after it committed ([`commit_failed`]).
    const REMOTE_COMMIT: bool;
    /// Judge `warm`'s session against its cached head, hash, view and
    /// owner (the commit checks the head).
    fn assume(&mut self, warm: &Warm);
    /// Why rows sent ahead of the commit ([`LogTx::send_ahead`]) were not
    /// written, when the storage failed rather than a check: nothing is
    /// stored, and the group's callers are told.
    fn ahead_failure(&mut self) -> Option<Error> {
        None
    }
    /// How many times rows were sent ahead in this transaction.
    fn sends_ahead(&self) -> u64 {
        0
    }
    /// Commits the group's writes in one round trip, checking what the
    /// judgement assumed; `Ok` has the base its positions were reserved
    /// from (PostgreSQL reserves them from 0 and moves them past its
    /// counter; SQLite knows where the log ends: 0).
    fn commit_optimistic(
        self,
    ) -> impl std::future::Future<Output = std::result::Result<i64, OptimisticMiss>> + Send;
}

#[cfg(test)]
mod tests {
    //! What each append of a group is told when the commit fails.

    use super::*;

    /// A lost connection at PostgreSQL's `COMMIT` may come after the
    /// server committed: the appends may be stored, and are told so. A
    /// SQLite commit fails whole, and a failure that is not the
    /// connection's (a refusal at commit) is said as what it is.
    #[test]
    fn a_lost_connection_at_a_remote_commit_leaves_the_outcome_unknown() {
        let cut = Error::Unavailable("the connection was cut".to_owned());
        assert!(matches!(
            commit_failed(true, &cut),
            Error::OutcomeUnknown(m) if m == "the connection was cut"
        ));
        assert!(matches!(commit_failed(false, &cut), Error::Unavailable(_)));
        let refused = Error::Database("could not serialize access".to_owned());
        assert!(matches!(commit_failed(true, &refused), Error::Database(_)));
        // The other appends of the group are told the same.
        let unknown = commit_failed(true, &cut);
        assert!(matches!(again(&unknown), Error::OutcomeUnknown(_)));
        assert!(unknown.is_retryable());
    }
}
