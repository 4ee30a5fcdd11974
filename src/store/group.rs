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
//! dropped rather than tried, so an abandoned append is never stored long
//! after its caller gave up.
//!
//! Each append of a group is judged exactly as alone: the idempotent-retry
//! check, the expected seq and validation run against the log as the
//! group's earlier appends left it, and nothing is written until the batch
//! is accepted, so a rejected append leaves no trace and the others go on.
//! Only a failure of the database itself while writing (or the commit)
//! fails the whole group, which rolls back; each of its appends gets the
//! error, and none of them was stored.

use std::collections::HashMap;

use tokio::sync::{oneshot, OwnedMutexGuard};
use uuid::Uuid;

use super::{append_in, Backend, LogTx, StateCache, StoreOptions};
use crate::error::{Error, Result};
use crate::event::{EventBody, NewEvent};
use crate::projector::SessionState;
use crate::store::AppendOutcome;

/// One append waiting in the queue.
pub(crate) struct Pending {
    pub(crate) tenant: Option<String>,
    pub(crate) session_id: Uuid,
    /// `None`: at whatever the head is (`append_at_head`).
    pub(crate) expected_seq: Option<i64>,
    pub(crate) events: Vec<NewEvent>,
    pub(crate) reply: oneshot::Sender<Result<AppendOutcome>>,
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
            Error::Database(_) | Error::Unavailable(_) | Error::RetriesExhausted { .. }
        );
        Failed { error, broken }
    }
}

/// The same failure for another append of the group.
fn again(e: &Error) -> Error {
    match e {
        Error::Unavailable(m) => Error::Unavailable(m.clone()),
        other => Error::Database(format!(
            "the transaction this append was committed in failed: {other}"
        )),
    }
}

/// Commits `group` and replies to each append; releases the writer slot
/// when done.
pub(crate) async fn commit_group(
    backend: Backend,
    options: StoreOptions,
    states: StateCache,
    group: Vec<Pending>,
    slot: OwnedMutexGuard<()>,
) {
    match &backend {
        Backend::Sqlite(b) => run(b.begin_write().await, &options, &states, group).await,
        Backend::Postgres(b) => run(b.begin_write().await, &options, &states, group).await,
    }
    drop(slot);
}

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
            EventBody::ToolCall { call_id, .. } | EventBody::ToolResult { call_id, .. } => {
                Some((p.session_id, call_id.as_str()))
            }
            _ => None,
        }));
    }
    let prefetched = tx.prefetch(&sessions, &ids, &calls).await;
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
    let mut local: HashMap<Uuid, SessionState> = HashMap::new();
    let mut accepted = Vec::new();
    let mut broken: Option<Error> = None;
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
        let mut cached = local
            .remove(&p.session_id)
            .or_else(|| states.take(p.session_id));
        let result = append_in(
            &mut tx,
            &mut cached,
            p.tenant.as_deref(),
            p.session_id,
            p.expected_seq,
            &p.events,
            options,
        )
        .await;
        if let Some(state) = cached {
            local.insert(p.session_id, state);
        }
        match result {
            Ok(outcome) => accepted.push((p.reply, outcome)),
            Err(Failed { error, broken: b }) => {
                if b {
                    broken = Some(again(&error));
                    // Those accepted before are rolled back with this one.
                    for (reply, _) in accepted.drain(..) {
                        let _ = reply.send(Err(again(&error)));
                    }
                }
                let _ = p.reply.send(Err(error));
            }
        }
    }
    if broken.is_some() || accepted.is_empty() {
        // Dropping the transaction rolls it back.
        return;
    }
    if let Some(pause) = options.fault_pause_before_commit {
        tokio::time::sleep(pause).await;
    }
    match tx.commit().await {
        Ok(()) => {
            if let Some(pause) = options.fault_pause_after_commit {
                tokio::time::sleep(pause).await;
            }
            for state in local.into_values() {
                states.put(state);
            }
            for (reply, outcome) in accepted {
                let _ = reply.send(Ok(outcome));
            }
        }
        Err(e) => {
            for (reply, _) in accepted {
                let _ = reply.send(Err(again(&e)));
            }
        }
    }
}
