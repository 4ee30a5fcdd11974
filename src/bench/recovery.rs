//! Phase 3, recovery: how soon a restarted sidecar can serve a session, and
//! how fast the views can be recomputed from the log.
//!
//! - **recover**: `Store::open` (connect, migrations check) and
//!   `Store::recover` of the largest session, the first time in a fresh
//!   process, cold: nothing of the store cached, the bench's own
//!   PostgreSQL server restarted, and in a full run where the bench may
//!   (see [`Cold`]) the operating system's page cache dropped, as after a
//!   host's restart; then again with a new `Store` each time, warm.
//! - **rebuild**: `Store::rebuild` of every session of the database (the
//!   built sessions), events of the log per second.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::stats::{Latency, Spread};
use super::BenchError;
use crate::store::Store;

/// What was emptied before the first open of the recover phase, so that a
/// report says how cold "cold" was. Dropping the page cache needs root on
/// Linux (and a full run); only a server the bench started itself is
/// restarted (never one given with `--postgres-url`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cold {
    /// The operating system's page cache was dropped
    /// (`/proc/sys/vm/drop_caches`, after a `sync`).
    pub page_cache_dropped: bool,
    /// PostgreSQL was shut down and started again, its buffers empty.
    pub server_restarted: bool,
}

impl Cold {
    /// How the first open was cold, in words.
    pub fn describe(&self) -> &'static str {
        match (self.page_cache_dropped, self.server_restarted) {
            (true, true) => "page cache dropped, server restarted",
            (true, false) => "page cache dropped",
            (false, true) => "server restarted, page cache warm",
            (false, false) => "page cache warm",
        }
    }
}

/// Empties what the bench may before a cold open: PostgreSQL's buffers
/// (by restarting `server`, the bench's own), then, when `drop_page_cache`
/// (a full run: the drop slows every process of the machine for a while,
/// so a `--quick` smoke test, run beside other tests, leaves it), the
/// kernel's page cache. A failed drop is reported as not done: a warm
/// figure labelled as such is still a figure. A failed restart is an
/// error, since the server may be left stopped and every later phase
/// would fail for a reason it could not tell. Blocking: the parent
/// process waits for nothing else meanwhile.
pub fn chill(
    server: Option<&crate::pgtemp::PgServer>,
    drop_page_cache: bool,
) -> Result<Cold, BenchError> {
    let mut cold = Cold::default();
    if let Some(server) = server {
        server.restart().map_err(|e| {
            BenchError::Setup(format!(
                "restarting PostgreSQL before the recover phase failed: {e}"
            ))
        })?;
        cold.server_restarted = true;
    }
    if drop_page_cache {
        let synced = std::process::Command::new("sync")
            .stdin(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        // 3: the page cache and the dentries and inodes; writable by root
        // only, and absent outside Linux.
        cold.page_cache_dropped = synced && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
    }
    Ok(cold)
}

/// Recovery of one session.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Recover {
    /// The session's events.
    pub events: i64,
    /// Open + recover, the first time in the process, ms.
    pub first_open_and_recover_ms: f64,
    /// Of which `recover` alone, ms.
    pub first_recover_ms: f64,
    /// Open + recover over all repeats (the first included).
    pub open_and_recover: Latency,
    /// What was emptied before the first open (absent in reports before
    /// it was recorded: those first opens had warm page caches).
    #[serde(default)]
    pub cold: Cold,
}

/// Opens the store and recovers `session`, `repeats` times.
pub async fn recover(url: &str, session: Uuid, repeats: usize) -> Result<Recover, BenchError> {
    let mut samples: Vec<Duration> = Vec::new();
    let mut first_recover = Duration::ZERO;
    let mut events = 0;
    for i in 0..repeats.max(1) {
        let t = Instant::now();
        let store = Store::open(url).await?;
        let opened = t.elapsed();
        let r = store.recover(session).await?;
        let total = t.elapsed();
        if i == 0 {
            first_recover = total - opened;
        }
        events = r.latest_seq;
        samples.push(total);
        store.close().await;
    }
    let out = Recover {
        events,
        first_open_and_recover_ms: samples[0].as_secs_f64() * 1e3,
        first_recover_ms: first_recover.as_secs_f64() * 1e3,
        open_and_recover: Latency::of(&samples),
        cold: Cold::default(),
    };
    eprintln!(
        "  open + recover at {events} events: first {:.2} ms (recover {:.2} ms), median {:.2} ms",
        out.first_open_and_recover_ms, out.first_recover_ms, out.open_and_recover.p50_ms
    );
    Ok(out)
}

/// Rebuild of every view.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Rebuild {
    /// Sessions rebuilt.
    pub sessions: usize,
    /// Their events.
    pub events: i64,
    /// Seconds, the median run.
    pub seconds: f64,
    /// Events of the log per second, the median run.
    pub events_per_s: f64,
    /// Events per second of each run: their median and spread.
    #[serde(default)]
    pub runs: Spread,
}

/// Rebuilds every session's view and calls index, `repeats` times (each
/// run rebuilds everything again: a rebuild rewrites what it finds).
pub async fn rebuild(url: &str, repeats: usize) -> Result<Rebuild, BenchError> {
    let store = Store::open(url).await?;
    let sessions = store.sessions().await?;
    let mut events = 0;
    for s in &sessions {
        events += store.head_seq(*s).await?;
    }
    let mut rates = Vec::new();
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        for s in &sessions {
            store.rebuild(*s).await?;
        }
        let seconds = t.elapsed().as_secs_f64();
        eprintln!(
            "  rebuilt {} sessions ({events} events) in {seconds:.1} s: {:.0} events/s",
            sessions.len(),
            events as f64 / seconds
        );
        rates.push(events as f64 / seconds);
    }
    store.close().await;
    let runs = Spread::of(&rates);
    Ok(Rebuild {
        sessions: sessions.len(),
        events,
        seconds: events as f64 / runs.median.max(f64::MIN_POSITIVE),
        events_per_s: runs.median,
        runs,
    })
}
