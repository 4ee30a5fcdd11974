//! The per-session states this process keeps between appends and reads
//! (the module docs of `store` say why): a least-recently-used cache bounded
//! in sessions and in bytes, and, for a session this process appended to
//! last, what that append knew under the write lock (`Known`), which lets
//! the next group of appends judge without reading the database.

use super::*;

/// How many session states the cache keeps; past it the least recently
/// used is dropped.
const STATE_CACHE_SESSIONS: usize = 256;

/// How many unanswered calls from before its window a cached state keeps
/// ([`SessionState::forget_calls_keeping_open`]): at most about 10 KiB a
/// state. Sixteen writers on one session each have at most one call in
/// flight in the bench's mix; an agent runs a handful at once.
const OPEN_CALLS_KEPT: usize = 64;

/// How many sessions the cache remembers as appended to by other writers
/// ([`StateCache::set_contended`]); past it the marks are forgotten.
const CONTENDED_KEPT: usize = 4_096;

/// The per-session states of this process (see the module docs), shared
/// with the group commit task.
#[derive(Clone)]
pub(crate) struct StateCache(std::sync::Arc<Mutex<Lru>>);

/// The cached states, when each was last used and about how many bytes
/// each holds ([`SessionState::approx_bytes`]). A full cache, in sessions
/// ([`STATE_CACHE_SESSIONS`]) or in bytes (its budget), makes room by
/// dropping the least recently used states. It used to drop them all, so
/// a server with more active sessions than the cache holds read every one
/// cold; and it used to count only sessions, so fifty never-compacted
/// sessions of a few hundred MB each took a server to 12 GB.
pub(crate) struct Lru {
    states: HashMap<Uuid, Cached>,
    tick: u64,
    /// The sum of the entries' `bytes`, but the one `over` the budget.
    bytes: usize,
    /// The most `bytes` may reach.
    budget: usize,
    /// The one state larger than the whole budget, kept beside it (see
    /// [`StateCache::put`]).
    over: Option<Uuid>,
    /// States dropped to make room, since the process started.
    evicted: u64,
    /// Sessions another writer (instance or process) appended to between
    /// two groups of this one, as last seen: their groups skip the
    /// optimistic attempt, which would fail its check of the head
    /// ([`StateCache::set_contended`]).
    contended: HashSet<Uuid>,
}

/// One entry of [`Lru`].
struct Cached {
    warm: Warm,
    used: u64,
    bytes: usize,
}

impl Lru {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn remove(&mut self, session_id: &Uuid) -> Option<Warm> {
        let entry = self.states.remove(session_id)?;
        if self.over == Some(*session_id) {
            self.over = None;
        } else {
            self.bytes = self.bytes.saturating_sub(entry.bytes);
        }
        Some(entry.warm)
    }

    /// Drops the least recently used state within the budget (not the one
    /// over it); false when there is none.
    fn evict_oldest(&mut self) -> bool {
        let over = self.over;
        let oldest = self
            .states
            .iter()
            .filter(|(k, _)| Some(**k) != over)
            .min_by_key(|(_, c)| c.used)
            .map(|(k, _)| *k);
        match oldest {
            Some(id) => {
                self.remove(&id);
                self.evicted += 1;
                true
            }
            None => false,
        }
    }
}

/// What a state cache holds, for operators (`/metrics`) and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheUsage {
    /// Sessions whose state is cached.
    pub sessions: usize,
    /// About how many bytes their states hold.
    pub bytes: usize,
    /// States dropped to make room since the process started.
    pub evicted: u64,
}

/// A cached session state and, when an append of this process left it,
/// what that append knew under the write lock.
pub(crate) struct Warm {
    pub(crate) state: SessionState,
    /// `None` when the state came from a read (or a catch-up past what this
    /// process wrote): then nothing below is known.
    pub(crate) known: Option<Known>,
}

/// What an append of this process left true as of its state's seq: the
/// head's chain hash, the stored view and the session's owner. An
/// optimistic append (PostgreSQL, `group`) judges a batch against these
/// without reading the database, and its one write checks that the head
/// is still that seq, so they hold or nothing is written.
#[derive(Clone, Debug)]
pub(crate) struct Known {
    pub(crate) head_hash: String,
    /// The stored view (`None`: the session has none yet).
    pub(crate) view: Option<ViewRow>,
    /// The owning tenant ([`DEFAULT_TENANT`] for a session created without
    /// one), when an append had to read it.
    pub(crate) owner: Option<String>,
}

impl Known {
    /// About how many bytes this holds: the stored view's texts (its
    /// summary and catalogs may be large) and the hash.
    fn approx_bytes(&self) -> usize {
        let view = self.view.as_ref().map_or(0, |v| {
            std::mem::size_of::<ViewRow>()
                + v.mode.len()
                + v.summary.as_ref().map_or(0, String::len)
                + v.catalogs.len()
                + v.evidence.len()
                + v.active.len()
        });
        std::mem::size_of::<Known>()
            + self.head_hash.len()
            + view
            + self.owner.as_ref().map_or(0, String::len)
    }
}

impl StateCache {
    /// An empty cache whose states may hold about `budget` bytes.
    pub(crate) fn new(budget: usize) -> StateCache {
        StateCache(std::sync::Arc::new(Mutex::new(Lru {
            states: HashMap::new(),
            tick: 0,
            bytes: 0,
            budget,
            over: None,
            evicted: 0,
            contended: HashSet::new(),
        })))
    }

    /// Whether another writer appended to any of these sessions between
    /// this process's last two groups on it.
    pub(crate) fn any_contended(&self, sessions: impl IntoIterator<Item = Uuid>) -> bool {
        self.0.lock().is_ok_and(|m| {
            !m.contended.is_empty() && sessions.into_iter().any(|s| m.contended.contains(&s))
        })
    }

    /// Notes whether another writer appended to `session_id` since this
    /// process's last group on it. Instances that take turns on a session
    /// (a load balancer without affinity) would otherwise pay, on every
    /// turn, an optimistic call whose check of the head fails, then a cold
    /// read of the session (the attempt's state is dropped) and the locked
    /// path: a contended session goes to the lock directly, catching its
    /// cached state up, until a locked group finds it was not appended to
    /// by another writer. A mark lost (the set is bounded) costs one
    /// failed attempt, never a wrong judgement: skipping the optimistic
    /// path is always safe.
    pub(crate) fn set_contended(&self, session_id: Uuid, contended: bool) {
        if let Ok(mut m) = self.0.lock() {
            if !contended {
                m.contended.remove(&session_id);
                return;
            }
            if m.contended.len() >= CONTENDED_KEPT {
                m.contended.clear();
            }
            m.contended.insert(session_id);
        }
    }

    /// A copy of the session's state (for reads).
    pub(super) fn get(&self, session_id: Uuid) -> Option<SessionState> {
        self.peek(session_id, SessionState::clone)
    }

    /// What `read` makes of the session's cached state, without copying
    /// the state: a read that needs only part of it (the activation set
    /// of a long window) would otherwise copy every row's text.
    pub(super) fn peek<R>(
        &self,
        session_id: Uuid,
        read: impl FnOnce(&SessionState) -> R,
    ) -> Option<R> {
        let mut m = self.0.lock().ok()?;
        let tick = m.next_tick();
        m.states.get_mut(&session_id).map(|c| {
            c.used = tick;
            read(&c.warm.state)
        })
    }

    /// Whether an append of this process left the session's state here with
    /// what it knew ([`Known`]: the stored view among it), so a group need
    /// not read its view ahead.
    pub(crate) fn knows(&self, session_id: Uuid) -> bool {
        self.0.lock().is_ok_and(|m| {
            m.states
                .get(&session_id)
                .is_some_and(|c| c.warm.known.is_some())
        })
    }

    /// The session's state, taken out (for an append, under the write lock).
    pub(crate) fn take(&self, session_id: Uuid) -> Option<Warm> {
        self.0.lock().ok().and_then(|mut m| m.remove(&session_id))
    }

    /// Caches a state, keeping only the calls of its effective window (a
    /// call or its result in it) and the latest [`OPEN_CALLS_KEPT`]
    /// unanswered calls before it, whose results may still come
    /// ([`SessionState::forget_calls_keeping_open`]): the calls index holds the others, and
    /// `prefetch_calls` loads any a batch names, so validation needs no
    /// more, and a long session's cached state stays the size of its
    /// window rather than of its history. A compaction's check needs the
    /// calls of the window's results, so those stay too (else an
    /// optimistic append would take them as absent and always fail).
    ///
    /// Room is made by dropping the least recently used states until the
    /// new one fits the budget. A state larger than the whole budget is
    /// kept beside it, one at a time (a second one takes its place).
    /// Dropping it would make each append to its session read the whole
    /// window again (seconds for a never-compacted session of 10^6
    /// events), while keeping it costs no more than that append holds
    /// anyway; and kept in the budget, the next state of any other session
    /// would push it out. So the cache holds at most the budget and one
    /// state larger than it.
    pub(crate) fn put(&self, mut warm: Warm) {
        warm.state.forget_calls_keeping_open(OPEN_CALLS_KEPT);
        let bytes = warm.state.approx_bytes() + warm.known.as_ref().map_or(0, Known::approx_bytes);
        if let Ok(mut m) = self.0.lock() {
            let id = warm.state.session_id;
            m.remove(&id);
            if bytes > m.budget {
                if let Some(previous) = m.over.take() {
                    if m.states.remove(&previous).is_some() {
                        m.evicted += 1;
                    }
                }
                while m.states.len() >= STATE_CACHE_SESSIONS && m.evict_oldest() {}
                m.over = Some(id);
            } else {
                while (m.states.len() >= STATE_CACHE_SESSIONS || m.bytes + bytes > m.budget)
                    && m.evict_oldest()
                {}
                m.bytes += bytes;
            }
            let tick = m.next_tick();
            m.states.insert(
                id,
                Cached {
                    warm,
                    used: tick,
                    bytes,
                },
            );
        }
    }

    /// Caches a state a read produced; what an append knew about the same
    /// seq is kept (the read saw the same head), anything older dropped.
    pub(super) fn put_read(&self, state: SessionState) {
        let known = self.0.lock().ok().and_then(|mut m| {
            m.states
                .get_mut(&state.session_id)
                .filter(|c| c.warm.state.seq == state.seq)
                .and_then(|c| c.warm.known.take())
        });
        self.put(Warm { state, known });
    }

    pub(super) fn remove(&self, session_id: Uuid) {
        self.take(session_id);
    }

    pub(super) fn clear(&self) {
        if let Ok(mut m) = self.0.lock() {
            m.states.clear();
            m.bytes = 0;
            m.over = None;
        }
    }

    pub(super) fn usage(&self) -> CacheUsage {
        self.0
            .lock()
            .map(|m| CacheUsage {
                sessions: m.states.len(),
                bytes: m.bytes
                    + m.over
                        .and_then(|id| m.states.get(&id))
                        .map_or(0, |c| c.bytes),
                evicted: m.evicted,
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full cache drops the state used longest ago, not every state.
    #[test]
    fn a_full_cache_drops_the_least_recently_used_state() {
        let cache = StateCache::new(usize::MAX);
        let ids: Vec<Uuid> = (0..STATE_CACHE_SESSIONS).map(|_| Uuid::new_v4()).collect();
        for id in &ids {
            cache.put(Warm {
                state: SessionState::empty(*id),
                known: None,
            });
        }
        // The first is read again: the second is now the oldest.
        assert!(cache.get(ids[0]).is_some());
        let newcomer = Uuid::new_v4();
        cache.put(Warm {
            state: SessionState::empty(newcomer),
            known: None,
        });
        assert!(cache.get(newcomer).is_some());
        assert!(cache.get(ids[0]).is_some(), "the recently read state stays");
        assert!(
            cache.get(ids[1]).is_none(),
            "the least recently used is dropped"
        );
        let kept = ids.iter().filter(|id| cache.get(**id).is_some()).count();
        assert_eq!(kept, STATE_CACHE_SESSIONS - 1);
        assert_eq!(cache.usage().evicted, 1);
    }

    /// A started session whose window is one prompt of `text_bytes`.
    fn state_with_prompt(text_bytes: usize) -> SessionState {
        let session = Uuid::new_v4();
        let event = |seq: i64, body: EventBody| StoredEvent {
            session_id: session,
            seq,
            event_id: Uuid::new_v4(),
            position: seq,
            recorded_at: Utc::now(),
            body,
        };
        let events = [
            event(
                1,
                EventBody::SessionStarted {
                    mode: "agent".into(),
                    metadata: None,
                },
            ),
            event(
                2,
                EventBody::PromptSubmitted {
                    text: "x".repeat(text_bytes),
                },
            ),
        ];
        SessionState::fold(session, &events)
    }

    fn warm(state: SessionState) -> Warm {
        Warm { state, known: None }
    }

    /// The budget bounds the bytes, not only the sessions: the least
    /// recently used states go until the newcomer fits, and the figures
    /// follow.
    #[test]
    fn a_cache_over_its_bytes_drops_the_least_recently_used_states() {
        let cache = StateCache::new(1 << 20);
        let states: Vec<SessionState> = (0..4).map(|_| state_with_prompt(300 << 10)).collect();
        let ids: Vec<Uuid> = states.iter().map(|s| s.session_id).collect();
        for s in &states {
            cache.put(warm(s.clone()));
        }
        // Four of about 300 KiB do not fit in 1 MiB: the first went.
        assert!(cache.get(ids[0]).is_none());
        assert!(ids[1..].iter().all(|id| cache.get(*id).is_some()));
        let usage = cache.usage();
        assert_eq!((usage.sessions, usage.evicted), (3, 1));
        let expected: usize = states[1..].iter().map(|s| s.clone().approx_bytes()).sum();
        assert_eq!(usage.bytes, expected);
        assert!(usage.bytes <= 1 << 20 && usage.bytes > 900 << 10);
        // Read the second again: the third is now the oldest, and a state
        // of 600 KiB needs both the third and fourth gone.
        assert!(cache.get(ids[1]).is_some());
        let big = state_with_prompt(600 << 10);
        let big_id = big.session_id;
        cache.put(warm(big));
        assert!(cache.get(ids[1]).is_some(), "the recently read state stays");
        assert!(cache.get(ids[2]).is_none() && cache.get(ids[3]).is_none());
        assert!(cache.get(big_id).is_some());
        assert_eq!(cache.usage().evicted, 3);
        // Taking a state out and clearing give their bytes back.
        let taken = cache.take(big_id).expect("cached");
        assert_eq!(cache.usage().bytes, states[1].clone().approx_bytes());
        cache.put(taken);
        cache.clear();
        assert_eq!(cache.usage().bytes, 0);
    }

    /// A state larger than the budget is kept beside it, rather than read
    /// whole again by each append to its session, and the states of
    /// other sessions do not push it out; a second such state takes its
    /// place.
    #[test]
    fn a_state_larger_than_the_budget_is_kept_beside_it() {
        let cache = StateCache::new(1 << 20);
        let huge = state_with_prompt(3 << 20);
        let huge_id = huge.session_id;
        cache.put(warm(huge));
        assert!(cache.get(huge_id).is_some());
        let smalls: Vec<SessionState> = (0..8).map(|_| state_with_prompt(300 << 10)).collect();
        for small in &smalls {
            cache.put(warm(small.clone()));
        }
        assert!(cache.get(huge_id).is_some(), "other sessions leave it");
        let usage = cache.usage();
        // The budget holds three of the small ones; the large one is beside.
        assert_eq!(usage.sessions, 4, "{usage:?}");
        assert!(usage.bytes > (3 << 20) + (900 << 10), "{usage:?}");
        assert!(
            usage.bytes < (3 << 20) + (1 << 20) + (64 << 10),
            "{usage:?}"
        );
        // Putting it again replaces it, counted once.
        let again = cache.take(huge_id).expect("cached");
        cache.put(warm(again.state.clone()));
        cache.put(warm(again.state));
        assert_eq!(cache.usage().sessions, 4);
        // A second large state takes the first's place.
        let other = state_with_prompt(2 << 20);
        let other_id = other.session_id;
        let evicted = cache.usage().evicted;
        cache.put(warm(other));
        assert!(cache.get(huge_id).is_none() && cache.get(other_id).is_some());
        assert_eq!(cache.usage().evicted, evicted + 1);
        assert_eq!(cache.usage().sessions, 4);
    }

    /// What an append knew (the stored view, whose summary and catalogs
    /// may be large) is weighed with its state.
    #[test]
    fn what_an_append_knew_is_weighed_too() {
        let cache = StateCache::new(usize::MAX);
        let state = state_with_prompt(10);
        let id = state.session_id;
        let bare = state.clone().approx_bytes();
        cache.put(Warm {
            state,
            known: Some(Known {
                head_hash: "0".repeat(64),
                view: Some(ViewRow {
                    session_id: id,
                    refresh_seq: 2,
                    mode: "agent".into(),
                    window_start: 1,
                    compaction_seq: None,
                    summary: Some("s".repeat(500_000)),
                    catalogs: "{}".into(),
                    evidence: "{}".into(),
                    active: "[]".into(),
                }),
                owner: None,
            }),
        });
        assert!(cache.usage().bytes > bare + 500_000, "{:?}", cache.usage());
    }
}
