//! Subscriptions: "tell me when session S passes seq N" and "stream all
//! events from position P".
//!
//! Every waiter of a store shares one source of wake-ups (`Pulse`): on
//! PostgreSQL one connection LISTENs on the store's channel; on SQLite,
//! which has no notifications, one task polls the latest position every
//! 20 ms. A wake-up is only a hint (a notification's payload is
//! "session:seq", never the event): after every wake-up, every reconnect
//! and at least once a second a waiter re-reads the log, so a notification
//! lost while the connection was down loses nothing.
//!
//! Why shared: each waiter used to have its own (a PostgreSQL connection
//! per HTTP stream, a poll of its session's head every 20 ms per stream on
//! SQLite). A review's 1 000 idle streams on SQLite kept the server at
//! 133 % CPU and made every read 50 times slower; 45 streams on a
//! PostgreSQL with `max_connections = 40` took every connection the
//! server had. The source runs while anyone waits and stops when the last
//! waiter is gone.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tracing::debug;
use uuid::Uuid;

use super::{Backend, Store};
use crate::error::{Error, Result};
use crate::event::StoredEvent;

/// How often a waiter re-reads the log without a wake-up.
const SAFETY_POLL: Duration = Duration::from_secs(1);
/// How often the SQLite source polls.
const SQLITE_POLL: Duration = Duration::from_millis(20);

/// A store's one source of wake-ups (see the module docs): a counter that
/// moves when the log may have grown.
#[derive(Default)]
pub(crate) struct Pulse {
    /// The running source's sender; `None` when none runs. A source
    /// clears it, under this lock, before it stops (or, should its task end
    /// any other way, when it is dropped), so a waiter that finds a sender
    /// here has a running source behind it. Never held across an await.
    beat: std::sync::Mutex<Option<watch::Sender<u64>>>,
}

/// What a new source starts from, made outside the lock.
enum Source {
    Listen(PgListener),
    Poll(super::sqlite::SqliteBackend, i64),
}

impl Pulse {
    fn beat(&self) -> std::sync::MutexGuard<'_, Option<watch::Sender<u64>>> {
        // Nothing panics while holding it; a poisoned lock is still sound.
        self.beat.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a source is running (for tests and metrics).
    pub(crate) fn running(&self) -> bool {
        self.beat().is_some()
    }

    /// A receiver of the running source, starting one if none runs. On
    /// PostgreSQL a new source returns only once it LISTENs, so nothing
    /// committed after this returns can go unnoticed.
    async fn receiver(self: &Arc<Self>, backend: &Backend) -> Result<watch::Receiver<u64>> {
        if let Some(tx) = self.beat().as_ref() {
            return Ok(tx.subscribe());
        }
        // Connected outside the lock: a connection that cannot be made
        // (the database out of connections, say) takes seconds to fail,
        // and waiters must not queue behind one another's attempts.
        let source = match backend {
            Backend::Postgres(b) => {
                let mut listener = PgListener::connect_with(&b.listener_pool())
                    .await
                    .map_err(Error::from_sqlx)?;
                listener
                    .listen(super::postgres::NOTIFY_CHANNEL)
                    .await
                    .map_err(Error::from_sqlx)?;
                Source::Listen(listener)
            }
            Backend::Sqlite(b) => Source::Poll(b.clone(), b.last_position().await.unwrap_or(0)),
        };
        let (tx, rx) = watch::channel(0u64);
        {
            let mut beat = self.beat();
            if let Some(running) = beat.as_ref() {
                // Another waiter started one meanwhile: join it (this
                // listener, already listening, is dropped).
                return Ok(running.subscribe());
            }
            *beat = Some(tx.clone());
        }
        // Spawned with the lock released: a task dropped at once (its
        // runtime shutting down) clears the sender in its drop.
        let running = Running {
            pulse: self.clone(),
            tx,
        };
        match source {
            Source::Listen(listener) => tokio::spawn(listen(running, listener)),
            Source::Poll(b, first) => tokio::spawn(poll(running, b, first)),
        };
        Ok(rx)
    }
}

/// A running source's hold on its [`Pulse`].
struct Running {
    pulse: Arc<Pulse>,
    tx: watch::Sender<u64>,
}

impl Running {
    fn wake(&self) {
        self.tx.send_modify(|n| *n += 1);
    }

    /// Whether the source should stop: nobody waits. Decided under the
    /// lock, and the sender cleared there, so no waiter joins a source
    /// that is stopping.
    fn stop_if_unwatched(&self) -> bool {
        if self.tx.receiver_count() > 0 {
            return false;
        }
        let mut beat = self.pulse.beat();
        if self.tx.receiver_count() > 0 {
            return false;
        }
        *beat = None;
        true
    }
}

impl Drop for Running {
    /// A task that ends any other way (a panic, its runtime shut down)
    /// still clears its sender, so the next waiter starts a new source
    /// instead of waiting on one nothing ticks.
    fn drop(&mut self) {
        let mut beat = self.pulse.beat();
        if beat.as_ref().is_some_and(|t| t.same_channel(&self.tx)) {
            *beat = None;
        }
    }
}

/// The PostgreSQL source: a wake-up per notification, per lost connection
/// (the listener reconnects; what was missed meanwhile is re-read) and per
/// second.
async fn listen(source: Running, mut listener: PgListener) {
    loop {
        match tokio::time::timeout(SAFETY_POLL, listener.try_recv()).await {
            Ok(Ok(Some(n))) => debug!(payload = n.payload(), "woken by a notification"),
            Ok(Ok(None)) => {
                debug!("notification connection lost; catching up");
                // The pool's connections may be as dead as this one.
                super::postgres::connection_lost();
            }
            Ok(Err(e)) => {
                debug!(cause = %e, "cannot listen for now; polling");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => {}
        }
        source.wake();
        if source.stop_if_unwatched() {
            return;
        }
    }
}

/// The SQLite source: a wake-up whenever the latest position moved (or
/// could not be read: the waiters then see the error themselves).
async fn poll(source: Running, backend: super::sqlite::SqliteBackend, mut last: i64) {
    loop {
        tokio::time::sleep(SQLITE_POLL).await;
        match backend.last_position().await {
            Ok(p) if p == last => {}
            Ok(p) => {
                last = p;
                source.wake();
            }
            Err(e) => {
                debug!(cause = %e, "cannot read the latest position; waking the waiters");
                source.wake();
            }
        }
        if source.stop_if_unwatched() {
            return;
        }
    }
}

/// Waits for wake-ups from the store's shared source.
struct Waker {
    beat: watch::Receiver<u64>,
}

impl Waker {
    async fn new(store: &Store) -> Result<Waker> {
        Ok(Waker {
            beat: store.pulse.receiver(&store.backend).await?,
        })
    }

    /// Returns after a wake-up or the safety poll interval.
    async fn wait(&mut self) {
        match tokio::time::timeout(SAFETY_POLL, self.beat.changed()).await {
            Ok(Ok(())) | Err(_) => {}
            // The source is gone (it never stops while this waits): wait
            // as a poll would.
            Ok(Err(_)) => tokio::time::sleep(SQLITE_POLL).await,
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

    /// Whether this store's shared source of wake-ups runs: one LISTEN
    /// connection (PostgreSQL) or one poll (SQLite) however many waiters
    /// there are, from the first [`Store::watch`] or [`Store::subscribe`]
    /// until shortly after the last one is dropped.
    pub fn wakeups_running(&self) -> bool {
        self.pulse.running()
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

impl std::fmt::Debug for Watch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
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
        // A timeout past what an Instant can hold (`Duration::MAX`, "wait
        // forever") waits forever instead of overflowing.
        let deadline = tokio::time::Instant::now().checked_add(timeout);
        loop {
            let head = self.store.head_seq(session_id).await?;
            if head > seq {
                return Ok(Some(head));
            }
            match deadline {
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline, self.waker.wait())
                        .await
                        .is_err()
                    {
                        return Ok(None);
                    }
                }
                None => self.waker.wait().await,
            }
        }
    }
}
