//! Subscriptions: "tell me when session S passes seq N" and "stream all
//! events from position P".
//!
//! On PostgreSQL a LISTEN on the store's channel wakes the subscriber; the
//! notification is only a wake-up (payload "session:seq", never the event):
//! after every wake-up, every reconnect and at least once a second the
//! subscriber re-reads the log, so a notification lost while the connection
//! was down loses nothing. On SQLite, which has no notifications, it polls.

use std::time::Duration;

use sqlx::postgres::PgListener;
use tracing::debug;
use uuid::Uuid;

use super::{Backend, Store};
use crate::error::{Error, Result};
use crate::event::StoredEvent;

/// How often a subscriber re-reads the log without a wake-up.
const SAFETY_POLL: Duration = Duration::from_secs(1);
/// How often a SQLite subscriber polls.
const SQLITE_POLL: Duration = Duration::from_millis(20);

/// Waits for wake-ups: notifications on PostgreSQL, a timer on SQLite.
struct Waker {
    listener: Option<PgListener>,
}

impl Waker {
    async fn new(store: &Store) -> Result<Waker> {
        let listener = match &store.backend {
            Backend::Postgres(b) => {
                let mut l = PgListener::connect_with(&b.listener_pool())
                    .await
                    .map_err(Error::from_sqlx)?;
                l.listen(super::postgres::NOTIFY_CHANNEL)
                    .await
                    .map_err(Error::from_sqlx)?;
                Some(l)
            }
            Backend::Sqlite(_) => None,
        };
        Ok(Waker { listener })
    }

    /// Returns after a notification, a lost connection (the next call
    /// reconnects), an error, or the safety poll interval.
    async fn wait(&mut self) {
        match &mut self.listener {
            None => tokio::time::sleep(SQLITE_POLL).await,
            Some(l) => match tokio::time::timeout(SAFETY_POLL, l.try_recv()).await {
                Ok(Ok(Some(n))) => debug!(payload = n.payload(), "woken by a notification"),
                Ok(Ok(None)) => debug!("notification connection lost; catching up"),
                Ok(Err(e)) => {
                    debug!(cause = %e, "cannot listen for now; polling");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(_) => {}
            },
        }
    }
}

/// A stream of every session's events in position order (see
/// [`Store::subscribe`]).
pub struct Subscription<'a> {
    store: &'a Store,
    after: i64,
    waker: Waker,
}

impl std::fmt::Debug for Subscription<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("after", &self.after)
            .finish_non_exhaustive()
    }
}

impl Subscription<'_> {
    /// The position of the last event returned (the stream resumes after it).
    pub fn position(&self) -> i64 {
        self.after
    }

    /// Waits until events exist after the last one returned, and returns
    /// them (at most 1 000, in position order). Storage errors are returned;
    /// calling again resumes where it stopped.
    pub async fn next_batch(&mut self) -> Result<Vec<StoredEvent>> {
        loop {
            let page = self.store.feed(self.after, 1_000).await?;
            if let Some(last) = page.last() {
                self.after = last.position;
                return Ok(page);
            }
            self.waker.wait().await;
        }
    }
}

impl Store {
    /// Streams all events with `position >= from_position`. The listener is
    /// set up before the first read, so nothing committed after this call
    /// returns can be missed.
    pub async fn subscribe(&self, from_position: i64) -> Result<Subscription<'_>> {
        let waker = Waker::new(self).await?;
        Ok(Subscription {
            store: self,
            after: from_position.max(1) - 1,
            waker,
        })
    }

    /// Waits until `session_id` passes `seq` (its head is greater), for at
    /// most `timeout`; returns the head then, or `None` on timeout.
    pub async fn wait_past(
        &self,
        session_id: Uuid,
        seq: i64,
        timeout: Duration,
    ) -> Result<Option<i64>> {
        self.watch()
            .await?
            .wait_past(session_id, seq, timeout)
            .await
    }

    /// A [`Watch`]: [`Store::wait_past`] for a caller that waits again and
    /// again (a stream), keeping one listener instead of opening one per
    /// wait.
    pub async fn watch(&self) -> Result<Watch<'_>> {
        Ok(Watch {
            store: self,
            waker: Waker::new(self).await?,
        })
    }
}

/// A reusable waiter on one store (see [`Store::watch`]).
pub struct Watch<'a> {
    store: &'a Store,
    waker: Waker,
}

impl Watch<'_> {
    /// Waits until `session_id` passes `seq` (its head is greater), for at
    /// most `timeout`; returns the head then, or `None` on timeout. The
    /// head is read after the listener exists, so a commit between two
    /// calls is never missed.
    pub async fn wait_past(
        &mut self,
        session_id: Uuid,
        seq: i64,
        timeout: Duration,
    ) -> Result<Option<i64>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let head = self.store.head_seq(session_id).await?;
            if head > seq {
                return Ok(Some(head));
            }
            if tokio::time::timeout_at(deadline, self.waker.wait())
                .await
                .is_err()
            {
                return Ok(None);
            }
        }
    }
}
