//! `explain` and `refreshes` on a stored session: one streaming pass over
//! the log through [`crate::audit`], page by page, so the answer comes from
//! the log alone (never from the view it audits) without holding the
//! session in memory. The same pages carry a long context's rows
//! ([`Store::context_paged`]).

use uuid::Uuid;

use super::{Store, FOLD_PAGE, FOLD_PAGE_BYTES};
use crate::audit::{At, Auditor, Explanation, Refresh, RefreshTracker};
use crate::error::{Error, Result};
use crate::event::{EventBody, StoredEvent};
use crate::projector::{Context, ContextRow};

impl Store {
    /// Whether `tool` is in the activation set of `session_id` at `at`, and
    /// why. Errors: [`Error::SessionNotFound`], [`Error::SeqOutOfRange`],
    /// [`Error::PromptOutOfRange`].
    pub async fn explain(&self, session_id: Uuid, tool: &str, at: At) -> Result<Explanation> {
        // A name no event could carry (§3) is a mistake, not a tool that
        // was never evidenced.
        crate::validate::check_tool_name(tool, "tool")?;
        let mut auditor = Auditor::new(session_id);
        self.each_event(session_id, at, |e| {
            auditor.apply(e);
            Ok::<(), Error>(())
        })
        .await?;
        Ok(auditor.explain(tool))
    }

    /// Calls `sink` with every refresh point of the session up to `at`, in
    /// seq order: the activation set after it and its difference from the
    /// previous one. A `sink` error (of the caller's own type, such as a
    /// failed write of the output) stops the pass and is returned as is.
    pub async fn refreshes<E: From<Error>>(
        &self,
        session_id: Uuid,
        at: At,
        mut sink: impl FnMut(Refresh) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let mut tracker = RefreshTracker::new(session_id);
        self.each_event(session_id, at, |e| match tracker.apply(e) {
            Some(r) => sink(r),
            None => Ok(()),
        })
        .await
    }

    /// The session's events from seq 1 up to `at`, to be read a page at a
    /// time with [`EventPages::next_page`]. Errors:
    /// [`Error::SessionNotFound`], [`Error::SeqOutOfRange`]; a prompt past
    /// the session's last one is said by the last `next_page`.
    pub async fn event_pages(&self, session_id: Uuid, at: At) -> Result<EventPages> {
        let latest = self.head_seq(session_id).await?;
        if latest == 0 {
            return Err(Error::SessionNotFound(session_id));
        }
        let (target, prompt) = match at {
            At::Latest => (latest, None),
            At::Seq(n) if (1..=latest).contains(&n) => (n, None),
            At::Seq(n) => {
                return Err(Error::SeqOutOfRange {
                    session_id,
                    seq: n,
                    latest,
                })
            }
            At::Prompt(k) => (latest, Some(k)),
        };
        Ok(EventPages {
            session_id,
            target,
            prompt,
            prompts: 0,
            after: 0,
            done: false,
        })
    }

    /// The effective context (§5) as of `at_seq` or the latest event. A
    /// context whose window is short comes whole, with `None`. A long one
    /// (a session never compacted has its whole log as its window) comes
    /// without its rows, and with the pages that hold them, in order. A
    /// caller that writes the answer as it reads it (the CLI, the HTTP
    /// server) holds a page, not the session; the rows are the log's,
    /// which never change, so later pages agree with the answer's seq.
    /// As [`Store::context`], an answer as of `at_seq` comes from the log
    /// alone (a fold from seq 1 that keeps no rows, then the window's
    /// rows read). Errors: [`Error::SessionNotFound`],
    /// [`Error::SeqOutOfRange`].
    pub async fn context_paged(
        &self,
        session_id: Uuid,
        at_seq: Option<i64>,
    ) -> Result<(Context, Option<ContextPages>)> {
        let state = match at_seq {
            None => self.latest_without_rows(session_id).await?,
            Some(n) => self.rowless_at(session_id, n, false).await?,
        };
        // A rowless state holds no rows: its context is the head alone.
        let mut head = state.context();
        if !state.is_rowless() {
            return Ok((head, None));
        }
        // The first page: the answer whole when it holds the window (a
        // short one, of at most 4 MiB of payloads), else the first of the
        // pages.
        let window = state.seq - state.window_start + 1;
        let first = self
            .history_within(
                session_id,
                state.window_start - 1,
                window.min(FOLD_PAGE),
                self.options.window_read_bytes,
            )
            .await?;
        // The first page is read by count, so a hole would also pull in
        // rows past the answer's seq: checked as the later pages are.
        if let Some(missing) = first_gap(state.window_start - 1, state.seq, &first) {
            return Err(gap(session_id, missing, state.seq));
        }
        let after = first.last().map_or(state.window_start - 1, |e| e.seq);
        let first = context_rows(first);
        if after >= state.seq && window <= self.options.rowless_window {
            head.rows = first;
            return Ok((head, None));
        }
        let events = EventPages {
            session_id,
            target: state.seq,
            prompt: None,
            prompts: 0,
            after,
            done: false,
        };
        Ok((
            head,
            Some(ContextPages {
                first: Some(first),
                events,
            }),
        ))
    }

    /// Feeds the session's events from seq 1 up to `at` to `f`, a page at
    /// a time.
    async fn each_event<E: From<Error>>(
        &self,
        session_id: Uuid,
        at: At,
        mut f: impl FnMut(&StoredEvent) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let mut pages = self.event_pages(session_id, at).await?;
        while let Some(page) = pages.next_page(self).await? {
            for e in &page {
                f(e)?;
            }
        }
        Ok(())
    }
}

/// A pass over one session's log from seq 1, a page at a time: what
/// `explain` and `refreshes` fold, and what the HTTP server streams a
/// session's refresh points from without holding them all. It keeps no
/// store, so that a task that outlives a request can own it beside its
/// own handle on the store.
#[derive(Debug)]
pub struct EventPages {
    session_id: Uuid,
    /// The last seq to read.
    target: i64,
    /// Stop after the K-th `prompt_submitted` (`At::Prompt`).
    prompt: Option<i64>,
    /// Prompts read so far.
    prompts: i64,
    /// The last seq read.
    after: i64,
    done: bool,
}

impl EventPages {
    /// The next page of events, in seq order; `None` once every event up
    /// to the target was given. With `At::Prompt(k)` the pass ends at the
    /// k-th prompt, and a session with fewer prompts ends with
    /// [`Error::PromptOutOfRange`] after its last page.
    pub async fn next_page(&mut self, store: &Store) -> Result<Option<Vec<StoredEvent>>> {
        if self.done {
            return Ok(None);
        }
        let mut page = match self.after < self.target {
            true => {
                store
                    .history_within(
                        self.session_id,
                        self.after,
                        FOLD_PAGE.min(self.target - self.after),
                        FOLD_PAGE_BYTES,
                    )
                    .await?
            }
            false => Vec::new(),
        };
        // At::Prompt: cut at the K-th prompt first, so that a hole after
        // it, outside the answer, is not the answer's.
        let mut reached = false;
        if let Some(k) = self.prompt {
            let prompts = &mut self.prompts;
            let at = page.iter().position(|e| {
                let prompt = matches!(e.body, EventBody::PromptSubmitted { .. });
                *prompts += i64::from(prompt);
                prompt && *prompts == k
            });
            if let Some(i) = at {
                page.truncate(i + 1);
                reached = true;
            }
        }
        // The log's seqs are dense (§2): a seq missing between two pages,
        // within one or before the target is a row removed or moved by an
        // edit around the store. Said, not passed over: an export would
        // otherwise write a log with a hole, and explain fold past it.
        if let Some(missing) = first_gap(self.after, self.target, &page) {
            self.done = true;
            return Err(gap(self.session_id, missing, self.target));
        }
        let Some(last) = page.last() else {
            self.done = true;
            return match self.prompt {
                Some(k) => Err(Error::PromptOutOfRange {
                    session_id: self.session_id,
                    prompt: k,
                    prompts: self.prompts,
                }),
                None => Ok(None),
            };
        };
        self.after = last.seq;
        self.done = reached;
        Ok(Some(page))
    }
}

/// A pass up to seq `target` found no event at seq `missing`.
fn gap(session_id: Uuid, missing: i64, target: i64) -> Error {
    Error::Corrupt(format!(
        "session {session_id}: the log has no event at seq {missing} (the pass reads to seq \
         {target}): its row was removed or moved by an edit around the store; `verify \
         --integrity` names what changed"
    ))
}

/// The first seq missing from `page`, the events read after seq `after`
/// of a pass up to `target`: a seq the page skips, or the next one when
/// the page is empty before the target.
fn first_gap(after: i64, target: i64, page: &[StoredEvent]) -> Option<i64> {
    if page.is_empty() {
        return (after < target).then_some(after + 1);
    }
    page.iter()
        .zip(after + 1..)
        .find(|(e, expected)| e.seq != *expected)
        .map(|(_, expected)| expected)
}

/// The rows of a long context ([`Store::context_paged`]), a page at a
/// time: the transcript rows among the events from the window's start to
/// the answer's seq.
#[derive(Debug)]
pub struct ContextPages {
    /// The rows of the page read to size the answer, given first.
    first: Option<Vec<ContextRow>>,
    events: EventPages,
}

impl ContextPages {
    /// The next page of rows (possibly empty, when a page of the log holds
    /// none); `None` once every row was given.
    pub async fn next_page(&mut self, store: &Store) -> Result<Option<Vec<ContextRow>>> {
        if let Some(first) = self.first.take() {
            return Ok(Some(first));
        }
        Ok(self.events.next_page(store).await?.map(context_rows))
    }
}

/// The transcript rows among a page of events, as a context shows them.
fn context_rows(page: Vec<StoredEvent>) -> Vec<ContextRow> {
    page.into_iter()
        .filter(|e| e.body.is_row())
        .map(ContextRow::from)
        .collect()
}
