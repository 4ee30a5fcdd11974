//! Subscriptions: "tell me when session S passes seq N" and "stream all
//! events from position P".
//!
//! Every waiter of a store shares one source of wake-ups (`Pulse`): on
//! PostgreSQL one connection LISTENs on the store's channel; on SQLite,
//! which has no notifications, one task polls the latest position every
//! 20 ms. A wake-up is only a hint (a notification's payload is
//! "session:seq", never the event). A waiter on one session re-reads the
//! log after a wake-up that names its session, after one that may concern
//! any (a reconnect of the listening connection, a source that failed, a
//! notification it cannot read) and at least every [`SAFETY_POLL`]; a
//! subscription to every session re-reads after every wake-up. So a
//! notification lost while the connection was down loses nothing, and an
//! append wakes the waiters of its own session only: a review's 1 000 idle
//! streams each re-read the log after every append to any session and once
//! a second (185 PostgreSQL transactions an append, 1 200 a second idle).
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

/// How often a waiter re-reads the log without a wake-up that concerns it:
/// a belt to the source's braces (a notification is sent at each commit and
/// a lost connection wakes everyone), so it can be rare.
const SAFETY_POLL: Duration = Duration::from_secs(10);
/// The most positions the SQLite source reads the sessions of, after one
/// poll; past it (an import running) it wakes every waiter instead.
const SQLITE_MOVES_READ: i64 = 10_000;
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
    /// Which sessions moved at which wake-up, for the waiters on one
    /// session. Never held across an await.
    moves: std::sync::Mutex<Moves>,
    /// Reads of a session's head by its waiters, for tests.
    reads: std::sync::atomic::AtomicU64,
}

/// What a wake-up concerned. Wake-ups are numbered (the source's watch
/// value); a waiter on a session that saw up to number `n` re-reads when
/// `all > n` or its session's entry is.
#[derive(Default)]
struct Moves {
    /// Waiters per session (only their sessions' moves are kept).
    watched: std::collections::HashMap<Uuid, usize>,
    /// The wake-up at which each watched session last moved.
    moved: std::collections::HashMap<Uuid, u64>,
    /// The last wake-up that may concern any session.
    all: u64,
    /// The last wake-up's number. Kept here, not only in a source's
    /// channel, so that a source started after another stopped goes on
    /// counting from it: counting from 0 again, every waiter would have
    /// found `all` ahead of what it saw and re-read on every wake-up.
    n: u64,
}

/// What a new source starts from, made outside the lock.
enum Source {
    Listen(PgListener, super::postgres::PgBackend),
    Poll(super::sqlite::SqliteBackend, i64),
}

impl Pulse {
    fn beat(&self) -> std::sync::MutexGuard<'_, Option<watch::Sender<u64>>> {
        // Nothing panics while holding it; a poisoned lock is still sound.
        self.beat.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn moves(&self) -> std::sync::MutexGuard<'_, Moves> {
        self.moves.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a waiter on `session` (its moves are kept from now on).
    fn watch_session(&self, session: Uuid) {
        *self.moves().watched.entry(session).or_insert(0) += 1;
    }

    /// Uncounts one; the last one's session is no longer kept.
    fn unwatch_session(&self, session: Uuid) {
        let mut moves = self.moves();
        if let Some(n) = moves.watched.get_mut(&session) {
            *n -= 1;
            if *n == 0 {
                moves.watched.remove(&session);
                moves.moved.remove(&session);
            }
        }
    }

    /// Whether a wake-up after number `seen` concerns `session`.
    fn moved_since(&self, session: Uuid, seen: u64) -> bool {
        let moves = self.moves();
        moves.all > seen || moves.moved.get(&session).is_some_and(|&at| at > seen)
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
                let listener = new_listener(b).await.map_err(Error::from_sqlx)?;
                Source::Listen(listener, b.clone())
            }
            Backend::Sqlite(b) => Source::Poll(b.clone(), b.last_position().await.unwrap_or(0)),
        };
        let (tx, rx) = watch::channel(self.moves().n);
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
            Source::Listen(listener, b) => tokio::spawn(listen(running, listener, b)),
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
    /// A wake-up that may concern any session.
    fn wake(&self) {
        let mut moves = self.pulse.moves();
        moves.n += 1;
        moves.all = moves.n;
        let n = moves.n;
        self.tx.send_modify(|value| *value = n);
    }

    /// A wake-up for appends to `sessions`: their waiters re-read, the
    /// others' only see the number move (subscriptions to every session
    /// re-read on any).
    fn wake_sessions(&self, sessions: impl IntoIterator<Item = Uuid>) {
        let mut moves = self.pulse.moves();
        moves.n += 1;
        let n = moves.n;
        for session in sessions {
            if moves.watched.contains_key(&session) {
                moves.moved.insert(session, n);
            }
        }
        self.tx.send_modify(|value| *value = n);
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

/// The PostgreSQL source: a wake-up per notification (for its session).
/// A lost connection (or any error of it, or a connection that stops
/// answering a ping) makes a new listener ([`relisten`]), waking every
/// waiter meanwhile.
async fn listen(source: Running, mut listener: PgListener, backend: super::postgres::PgBackend) {
    /// How often the source checks whether anyone still waits.
    const IDLE_CHECK: Duration = Duration::from_secs(1);
    /// How often an idle listening connection is asked whether it still
    /// answers, and how long it has to: one that died without a word (a
    /// firewall's dropped connection, a stopped backend) brings no
    /// notification and no error, and its waiters were left to their 10 s
    /// safety reads (a review measured 9.4 s).
    const PING_EVERY: Duration = Duration::from_secs(2);
    const PING_WITHIN: Duration = Duration::from_secs(2);
    let mut pinged = tokio::time::Instant::now();
    loop {
        // Cancelled by the timeout only while waiting: a lost connection
        // is answered at once (`eager_reconnect` off), not reconnected
        // inside the call, where the timeout could cut the reconnection
        // off and the loss go unsaid.
        let lost = match tokio::time::timeout(IDLE_CHECK, listener.try_recv()).await {
            Ok(Ok(Some(n))) => {
                debug!(payload = n.payload(), "woken by a notification");
                match notified_session(n.payload()) {
                    Some(session) => source.wake_sessions([session]),
                    None => source.wake(),
                }
                false
            }
            Ok(Ok(None)) | Ok(Err(_)) => true,
            Err(_) if pinged.elapsed() >= PING_EVERY => {
                pinged = tokio::time::Instant::now();
                let ping = sqlx::query("SELECT 1").execute(&mut listener);
                !matches!(tokio::time::timeout(PING_WITHIN, ping).await, Ok(Ok(_)))
            }
            Err(_) => false,
        };
        if lost {
            debug!("notification connection lost; listening again");
            // The pool's connections may be as dead as this one.
            super::postgres::connection_lost();
            match relisten(&source, &backend, listener).await {
                Some(again) => listener = again,
                None => return,
            }
        }
        if source.stop_if_unwatched() {
            return;
        }
    }
}

/// A new listener in place of `old`, once the database takes one. Each
/// attempt has a pool of its own: `old` is dropped, and sqlx's drop of a
/// listener sends `UNLISTEN *` on its connection before giving it back to
/// its pool, which never ends on a connection that died without a word (a
/// review saw every attempt on the old one-connection pool time out for
/// as long as it watched, the waiters woken each second meanwhile). Meanwhile
/// every waiter is woken each second, also while an attempt waits for its
/// connection (each reads the log again, and meets the outage itself:
/// `tail --follow` says it), and once more when listening again, to read
/// what was committed while nobody listened. `None` when nobody waits any
/// more.
async fn relisten(
    source: &Running,
    backend: &super::postgres::PgBackend,
    old: PgListener,
) -> Option<PgListener> {
    drop(old);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        // Bounded as a whole: a server that takes the connection and then
        // stops answering would hold it for ever.
        let attempt = tokio::time::timeout(Duration::from_secs(10), new_listener(backend));
        tokio::pin!(attempt);
        let attempted = loop {
            tokio::select! {
                attempted = &mut attempt => break attempted,
                _ = tick.tick() => {
                    source.wake();
                    if source.stop_if_unwatched() {
                        return None;
                    }
                }
            }
        };
        match attempted {
            Ok(Ok(listener)) => {
                debug!("listening again");
                source.wake();
                return Some(listener);
            }
            // The next attempt after the next tick: one that fails at once
            // (a password refused) is not retried in a tight loop.
            Ok(Err(e)) => debug!(cause = %e, "cannot listen yet"),
            Err(_) => debug!("cannot listen yet: no answer within 10 s"),
        }
        tick.tick().await;
        source.wake();
        if source.stop_if_unwatched() {
            return None;
        }
    }
}

/// A listener on a pool of its own ([`PgBackend::listener_pool`], kept by
/// the listener) that LISTENs on the store's channel, and answers a lost
/// connection at once rather than reconnecting inside `try_recv` (see
/// [`listen`]).
///
/// [`PgBackend::listener_pool`]: super::postgres::PgBackend::listener_pool
async fn new_listener(
    backend: &super::postgres::PgBackend,
) -> std::result::Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(&backend.listener_pool()).await?;
    listener.eager_reconnect(false);
    listener.listen(super::postgres::NOTIFY_CHANNEL).await?;
    Ok(listener)
}

/// The session of a notification's "session:seq" payload.
fn notified_session(payload: &str) -> Option<Uuid> {
    let (session, _) = payload.split_once(':')?;
    Uuid::parse_str(session).ok()
}

/// The SQLite source: a wake-up whenever the latest position moved (or
/// could not be read: the waiters then see the error themselves).
async fn poll(source: Running, backend: super::sqlite::SqliteBackend, mut last: i64) {
    loop {
        tokio::time::sleep(SQLITE_POLL).await;
        match backend.last_position().await {
            Ok(p) if p == last => {}
            Ok(p) if p - last > SQLITE_MOVES_READ => {
                last = p;
                source.wake();
            }
            Ok(p) => match backend.sessions_between(last, p).await {
                Ok(sessions) => {
                    last = p;
                    source.wake_sessions(sessions);
                }
                Err(e) => {
                    debug!(cause = %e, "cannot read which sessions moved; waking the waiters");
                    last = p;
                    source.wake();
                }
            },
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

    /// Returns after a wake-up past number `seen` that concerns
    /// `session`, or after the safety poll interval.
    async fn wait_for(&mut self, pulse: &Pulse, session: Uuid, seen: u64) {
        let safety = tokio::time::sleep(SAFETY_POLL);
        tokio::pin!(safety);
        loop {
            tokio::select! {
                () = &mut safety => return,
                changed = self.beat.changed() => match changed {
                    Ok(()) if pulse.moved_since(session, seen) => return,
                    Ok(()) => {}
                    // The source is gone (it never stops while this
                    // waits): wait as a poll would.
                    Err(_) => return tokio::time::sleep(SQLITE_POLL).await,
                },
            }
        }
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

    /// How many times waiters on a session read its head ([`Watch`]): a
    /// test counts that an append wakes only its own session's.
    #[doc(hidden)]
    pub fn waiter_reads(&self) -> u64 {
        self.pulse.reads.load(std::sync::atomic::Ordering::Relaxed)
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
    /// calls is never missed; it is read again only after a wake-up that
    /// concerns this session (see the module docs).
    pub async fn wait_past(
        &mut self,
        session_id: Uuid,
        seq: i64,
        timeout: Duration,
    ) -> Result<Option<i64>> {
        // A timeout past what an Instant can hold (`Duration::MAX`, "wait
        // forever") waits forever instead of overflowing.
        let deadline = tokio::time::Instant::now().checked_add(timeout);
        let pulse = self.store.pulse.clone();
        pulse.watch_session(session_id);
        // Uncounted however this ends (a stream's wait is dropped when its
        // client goes).
        let _watching = Watching {
            pulse: &pulse,
            session_id,
        };
        loop {
            // The wake-ups up to here are the read's: a move after it is
            // what the wait is for.
            let seen = *self.waker.beat.borrow_and_update();
            pulse
                .reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let head = self.store.head_seq(session_id).await?;
            if head > seq {
                return Ok(Some(head));
            }
            let moved = self.waker.wait_for(&pulse, session_id, seen);
            match deadline {
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline, moved).await.is_err() {
                        return Ok(None);
                    }
                }
                None => moved.await,
            }
        }
    }
}

/// A waiter's count on its session, taken back when dropped.
struct Watching<'a> {
    pulse: &'a Pulse,
    session_id: Uuid,
}

impl Drop for Watching<'_> {
    fn drop(&mut self) {
        self.pulse.unwatch_session(self.session_id);
    }
}
