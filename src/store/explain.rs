//! `explain` and `refreshes` on a stored session: one streaming pass over
//! the log through [`crate::audit`], page by page, so the answer comes from
//! the log alone (never from the view it audits) without holding the
//! session in memory.

use uuid::Uuid;

use super::{Store, FOLD_PAGE};
use crate::audit::{At, Auditor, Explanation, Refresh, RefreshTracker};
use crate::error::{Error, Result};
use crate::event::{EventBody, StoredEvent};

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

    /// Feeds the session's events from seq 1 up to `at` to `f`, a page at
    /// a time.
    async fn each_event<E: From<Error>>(
        &self,
        session_id: Uuid,
        at: At,
        mut f: impl FnMut(&StoredEvent) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let latest = self.head_seq(session_id).await?;
        if latest == 0 {
            return Err(Error::SessionNotFound(session_id).into());
        }
        let (target, prompt) = match at {
            At::Latest => (latest, None),
            At::Seq(n) if (1..=latest).contains(&n) => (n, None),
            At::Seq(n) => {
                return Err(Error::SeqOutOfRange {
                    session_id,
                    seq: n,
                    latest,
                }
                .into())
            }
            At::Prompt(k) => (latest, Some(k)),
        };
        let mut prompts = 0;
        let mut reached = false;
        let mut after = 0;
        'pages: while after < target {
            let page = self
                .history(session_id, after, FOLD_PAGE.min(target - after))
                .await?;
            let Some(last) = page.last() else { break };
            after = last.seq;
            for e in &page {
                f(e)?;
                if matches!(e.body, EventBody::PromptSubmitted { .. }) {
                    prompts += 1;
                    if prompt == Some(prompts) {
                        reached = true;
                        break 'pages;
                    }
                }
            }
        }
        match prompt {
            Some(k) if !reached => Err(Error::PromptOutOfRange {
                session_id,
                prompt: k,
                prompts,
            }
            .into()),
            _ => Ok(()),
        }
    }
}
