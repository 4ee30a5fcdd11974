//! Prometheus metrics of the server (`GET /metrics`, OpenMetrics text).
//!
//! Labels never name a tenant, a session or a tool: the endpoint is
//! unauthenticated (scrapers rarely carry tokens) and must not leak who
//! uses the store, and unbounded label values would grow without limit.

use std::sync::atomic::AtomicI64;
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::store::CacheUsage;

/// The outcome of one append request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `ok`, `replayed`, `conflict`, `invalid`, `not_found`, `error`.
    pub outcome: String,
}

/// How a group of appends was committed (`Store::append_paths`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabel {
    /// `locked`, `optimistic`, `optimistic_abandoned`.
    pub path: String,
}

/// Which of the store's state caches (`Store::state_cache_usage`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheLabel {
    /// `rows` (states with their window) or `rowless`.
    pub cache: String,
}

/// The route of a request (the matched pattern, not the path).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    /// E.g. `/v1/sessions/{id}/events`.
    pub route: String,
    /// `GET`, `POST`.
    pub method: String,
    /// The status code.
    pub status: u16,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// Append requests by outcome.
    pub appends: Family<OutcomeLabel, Counter>,
    /// Events written (replays excluded).
    pub appended_events: Counter,
    /// Appends refused because the expected seq was stale.
    pub conflicts: Counter,
    /// Refresh points written (each one rewrites a session's view).
    pub refreshes: Counter,
    /// Request latency by route, method and status.
    pub request_seconds: Family<RouteLabel, Histogram>,
    /// Append latency (the store call, commit included).
    pub append_seconds: Histogram,
    /// Delivery time minus `recorded_at` of events sent on streams.
    pub subscription_lag_seconds: Histogram,
    /// Open streams.
    pub streams: Gauge<i64, AtomicI64>,
    /// Groups of appends by how they were committed, brought up to the
    /// store's counts at each scrape (`observe_paths`).
    pub append_groups: Family<PathLabel, Counter>,
    /// Queries of rows optimistic SQLite groups sent ahead of their
    /// commit, brought up to the store's count at each scrape.
    pub append_sends_ahead: Counter,
    /// Cached session states by cache, set at each scrape.
    pub state_cache_sessions: Family<CacheLabel, Gauge<i64, AtomicI64>>,
    /// About how many bytes they hold: with
    /// `state_cache_evictions` climbing, a sign that `--state-cache-memory`
    /// is smaller than the sessions in use.
    pub state_cache_bytes: Family<CacheLabel, Gauge<i64, AtomicI64>>,
    /// States dropped to make room, brought up to the store's counts at
    /// each scrape.
    pub state_cache_evictions: Family<CacheLabel, Counter>,
    /// Serializes `observe_paths` and `observe_cache`, so two scrapes
    /// cannot add one increment twice.
    paths_sync: Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// A registry with every metric registered.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("session_store");
        let appends = Family::<OutcomeLabel, Counter>::default();
        let appended_events = Counter::default();
        let conflicts = Counter::default();
        let refreshes = Counter::default();
        // 0.5 ms to 32.8 s: the last finite bucket past the 30 s request
        // and read timeouts (at 16.4 s, what they cut off fell in +Inf).
        let request_seconds = Family::<RouteLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 17))
        });
        let append_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 17));
        let subscription_lag_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let streams = Gauge::<i64, AtomicI64>::default();
        let append_groups = Family::<PathLabel, Counter>::default();
        let append_sends_ahead = Counter::default();
        registry.register("appends", "Append requests by outcome", appends.clone());
        registry.register(
            "appended_events",
            "Events written to the log (idempotent replays excluded)",
            appended_events.clone(),
        );
        registry.register(
            "append_conflicts",
            "Appends refused because the expected seq was not the session's",
            conflicts.clone(),
        );
        registry.register(
            "view_refreshes",
            "Refresh points written (prompts and mode switches)",
            refreshes.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "HTTP request latency by route, method and status",
            request_seconds.clone(),
        );
        registry.register(
            "append_duration_seconds",
            "Latency of the store's append, commit included",
            append_seconds.clone(),
        );
        registry.register(
            "subscription_lag_seconds",
            "Time from an event's recorded_at to its delivery on a stream",
            subscription_lag_seconds.clone(),
        );
        registry.register("open_streams", "Open event streams", streams.clone());
        registry.register(
            "append_groups",
            "Groups of appends judged, one transaction each, whatever became of their appends, by path: locked (judged under the write lock), optimistic (one round trip; on SQLite only while no other process writes between this one's groups), optimistic_abandoned (sent back to the lock: another instance wrote, or a refusal)",
            append_groups.clone(),
        );
        registry.register(
            "append_sends_ahead",
            "Queries of rows that optimistic SQLite groups sent ahead of their commit, written while the rest of the group was judged (docs/design.md, Rows sent ahead); 0 on PostgreSQL",
            append_sends_ahead.clone(),
        );
        let state_cache_sessions = Family::<CacheLabel, Gauge<i64, AtomicI64>>::default();
        let state_cache_bytes = Family::<CacheLabel, Gauge<i64, AtomicI64>>::default();
        let state_cache_evictions = Family::<CacheLabel, Counter>::default();
        registry.register(
            "state_cache_sessions",
            "Session states this process keeps, by cache: rows (with their window) or rowless",
            state_cache_sessions.clone(),
        );
        registry.register(
            "state_cache_bytes",
            "About how many bytes the cached session states hold, by cache (bounded by --state-cache-memory each)",
            state_cache_bytes.clone(),
        );
        registry.register(
            "state_cache_evictions",
            "Session states dropped to keep the cache within its sessions and bytes, by cache",
            state_cache_evictions.clone(),
        );
        Metrics {
            registry: Mutex::new(registry),
            appends,
            appended_events,
            conflicts,
            refreshes,
            request_seconds,
            append_seconds,
            subscription_lag_seconds,
            streams,
            append_groups,
            append_sends_ahead,
            state_cache_sessions,
            state_cache_bytes,
            state_cache_evictions,
            paths_sync: Mutex::new(()),
        }
    }

    /// Brings `append_groups` and `append_sends_ahead` up to the store's
    /// counts (they only grow).
    /// Many optimistic groups abandoned means instances keep writing the
    /// same sessions (docs/design.md, "Optimistic appends").
    pub fn observe_paths(&self, paths: crate::store::AppendPaths) {
        let Ok(_guard) = self.paths_sync.lock() else {
            return;
        };
        for (path, count) in [
            ("locked", paths.locked),
            ("optimistic", paths.optimistic),
            ("optimistic_abandoned", paths.optimistic_abandoned),
        ] {
            let counter = self.append_groups.get_or_create(&PathLabel {
                path: path.to_owned(),
            });
            catch_up(&counter, count);
        }
        catch_up(&self.append_sends_ahead, paths.sends_ahead);
    }

    /// Sets the state cache figures to what the store's caches hold.
    pub fn observe_cache(&self, (rows, rowless): (CacheUsage, CacheUsage)) {
        let Ok(_guard) = self.paths_sync.lock() else {
            return;
        };
        for (cache, usage) in [("rows", rows), ("rowless", rowless)] {
            let label = CacheLabel {
                cache: cache.to_owned(),
            };
            self.state_cache_sessions
                .get_or_create(&label)
                .set(i64::try_from(usage.sessions).unwrap_or(i64::MAX));
            self.state_cache_bytes
                .get_or_create(&label)
                .set(i64::try_from(usage.bytes).unwrap_or(i64::MAX));
            catch_up(
                &self.state_cache_evictions.get_or_create(&label),
                usage.evicted,
            );
        }
    }

    /// Counts one append request's outcome.
    pub fn append_outcome(&self, outcome: &str) {
        self.appends
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Ok(r) = self.registry.lock() {
            // Writing into a String cannot fail.
            let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        }
        out
    }
}

/// Brings `counter` up to `total`, a count the store keeps (only growing):
/// a counter can only be increased, so it takes the difference.
fn catch_up(counter: &Counter, total: u64) {
    let seen = counter.get();
    if total > seen {
        counter.inc_by(total - seen);
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}
