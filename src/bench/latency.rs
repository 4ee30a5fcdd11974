//! Phase 2, pre-request latency: what a sidecar reads before each model
//! request (the latest activation set and effective context), against the
//! naive fold of the whole log that a store without a view (a JSONL file,
//! the agent SDK sessions of `docs/measured-ceilings.md`) must do.
//!
//! Three steps, each its own child process so each has its own peak RSS:
//!
//! - **build**: one session per size, written with the realistic mix in
//!   appends of 1 000 events through `Store::append` (timed: the bulk-load
//!   throughput). Every session ends on the same kind of recent past: a
//!   compaction, then the turns of the mix up to the next one (the fullest
//!   window the mix reaches, about 140 events) and a prompt, so the
//!   effective window is the same at every size and only the history
//!   before it grows.
//! - **read**: per size, `Store::activations` then `Store::context`, both
//!   "as of the latest event", each sample after `Store::clear_cache` (a
//!   freshly started sidecar's path: the view, the window, the events
//!   after the view, with the store's cache empty; the database's and the
//!   kernel's caches are warm); p50/p99 over the samples. Then the next
//!   turn: prompts appended one at a time (each rewrites the view), timed.
//! - **fold**: per size, the session written once as a JSON-lines file
//!   (`export`'s lines, what a JSONL-file store keeps), then, timed, the
//!   naive fold: the file read and every line parsed (the store's own line
//!   parser) and folded with `SessionState::apply`, then the same two
//!   answers. Beside it the store's own fold of the whole log through
//!   `Store::history` pages (the `--at-seq` path), which pays the
//!   database's reads on top.

use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::stats::Latency;
use super::workload::{Mix, TextPool, COMPACT_EVERY};
use super::BenchError;
use crate::event::{parse_line, EventBody, LineKind, NewEvent, StoredEvent};
use crate::projector::SessionState;
use crate::store::{BackendKind, Store};

/// Events per append while building.
pub const BUILD_BATCH: usize = 1_000;

/// Target p99 of the pre-request read at 10^6 events, ms (issue 7).
pub fn p99_target_ms(kind: BackendKind) -> f64 {
    match kind {
        BackendKind::Sqlite => 2.0,
        BackendKind::Postgres => 5.0,
    }
}

/// The session lengths measured.
pub fn sizes(quick: bool) -> Vec<u64> {
    if quick {
        vec![1_000, 10_000]
    } else {
        vec![1_000, 10_000, 100_000, 1_000_000]
    }
}

/// One built session.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Built {
    /// The nominal size (10^k).
    pub size: u64,
    /// The session.
    pub session_id: Uuid,
    /// Its events.
    pub events: i64,
    /// Seconds the build took.
    pub seconds: f64,
    /// Events per second of the build.
    pub events_per_s: f64,
}

/// Builds one session per size.
pub async fn build(url: &str, quick: bool) -> Result<Vec<Built>, BenchError> {
    build_sizes(url, &sizes(quick)).await
}

/// Builds one session of each of `sizes` (`examples/read_probe` builds one).
pub async fn build_sizes(url: &str, sizes: &[u64]) -> Result<Vec<Built>, BenchError> {
    let store = Store::open(url).await?;
    let pool = Arc::new(TextPool::new());
    let mut out = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let session = Uuid::new_v4();
        let mut mix = Mix::new(pool.clone(), 0, 100 + i as u64);
        let started = Instant::now();
        let mut head = 0i64;
        let mut pending: Vec<NewEvent> = Mix::header().into_iter().map(NewEvent::new).collect();
        // The history: all but about the last 150 events (the tail).
        let history = size.saturating_sub(150) as i64;
        while head + (pending.len() as i64) < history {
            let left = (history - head) as usize - pending.len();
            let room = BUILD_BATCH.saturating_sub(pending.len());
            pending.extend(mix.next_batch(left.min(room)));
            let batch = std::mem::take(&mut pending);
            let n = batch.len() as i64;
            store.append(session, head, batch).await?;
            head += n;
        }
        // The recent past, the same at every size.
        let mut tail: Vec<EventBody> = std::mem::take(&mut pending)
            .into_iter()
            .map(|e| e.body)
            .collect();
        tail.extend(mix.drain_turn());
        tail.push(mix.compaction());
        mix.housekeeping = false;
        for _ in 1..COMPACT_EVERY {
            tail.push(mix.next_body());
            tail.extend(mix.drain_turn());
        }
        tail.push(EventBody::PromptSubmitted {
            text: "the next request".into(),
        });
        let tail: Vec<NewEvent> = tail.into_iter().map(NewEvent::new).collect();
        let n = tail.len() as i64;
        store.append(session, head, tail).await?;
        head += n;
        let seconds = started.elapsed().as_secs_f64();
        eprintln!(
            "  built a session of {head} events in {seconds:.1} s ({:.0} events/s)",
            head as f64 / seconds
        );
        out.push(Built {
            size,
            session_id: session,
            events: head,
            seconds,
            events_per_s: head as f64 / seconds,
        });
    }
    store.close().await;
    Ok(out)
}

/// The pre-request read of one session.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Read {
    /// The nominal size.
    pub size: u64,
    /// The session's events.
    pub events: i64,
    /// Events of the effective window (from its start to the latest).
    pub window_events: i64,
    /// Bytes of JSON of the context's rows.
    pub context_bytes: usize,
    /// Activations + context, the store's cache emptied before each.
    pub pre_request: Latency,
    /// Activations alone, the store's cache emptied before each.
    pub activations_only: Latency,
    /// Appending one prompt after the reads, cache warm.
    pub next_append: Latency,
}

/// Prompts appended (and timed) after the reads of each session: enough
/// for a p99 that is not the largest sample (21 made it the largest).
fn append_samples(quick: bool) -> usize {
    if quick {
        21
    } else {
        101
    }
}

/// Samples per size.
fn read_samples(quick: bool) -> usize {
    if quick {
        101
    } else {
        301
    }
}

/// Measures the pre-request read of each built session.
pub async fn read(url: &str, quick: bool, built: &[Built]) -> Result<Vec<Read>, BenchError> {
    let store = Store::open(url).await?;
    let mut out = Vec::new();
    for b in built {
        let s = b.session_id;
        let recovery = store.recover(s).await?;
        let context = store.context(s, None).await?;
        let context_bytes = context
            .rows
            .iter()
            .map(|r| r.body.to_json_text().len())
            .sum();
        for _ in 0..5 {
            store.clear_cache();
            std::hint::black_box(store.activations(s, None).await?);
            std::hint::black_box(store.context(s, None).await?);
        }
        let mut both = Vec::new();
        let mut alone = Vec::new();
        for _ in 0..read_samples(quick) {
            store.clear_cache();
            let t = Instant::now();
            let a = store.activations(s, None).await?;
            let c = store.context(s, None).await?;
            both.push(t.elapsed());
            std::hint::black_box((a, c));
            store.clear_cache();
            let t = Instant::now();
            std::hint::black_box(store.activations(s, None).await?);
            alone.push(t.elapsed());
        }
        // The turn after the request: appending a prompt (a refresh point,
        // so the view is rewritten), the process's cache warm after the
        // first one, as a sidecar's is.
        let mut appends = Vec::new();
        for (i, head) in (recovery.latest_seq..)
            .take(append_samples(quick) + 1)
            .enumerate()
        {
            let prompt = NewEvent::new(EventBody::PromptSubmitted {
                text: format!("a follow-up {i}"),
            })
            .with_id(Uuid::now_v7());
            let t = Instant::now();
            store.append(s, head, vec![prompt]).await?;
            if i > 0 {
                appends.push(t.elapsed());
            }
        }
        let r = Read {
            size: b.size,
            events: recovery.latest_seq,
            window_events: recovery.latest_seq - recovery.context_start_seq + 1,
            context_bytes,
            pre_request: Latency::of(&both),
            activations_only: Latency::of(&alone),
            next_append: Latency::of(&appends),
        };
        eprintln!(
            "  pre-request read at {} events: p50 {:.3} ms, p99 {:.3} ms",
            r.events, r.pre_request.p50_ms, r.pre_request.p99_ms
        );
        out.push(r);
    }
    store.close().await;
    Ok(out)
}

/// The naive fold of one session.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Fold {
    /// The nominal size.
    pub size: u64,
    /// The session's events.
    pub events: i64,
    /// Bytes of the session's JSON-lines file.
    pub jsonl_bytes: u64,
    /// The JSON-lines file read, parsed and folded + the two answers.
    pub fold: Latency,
    /// The store's fold of its whole log + the two answers.
    pub store_fold: Latency,
}

fn fold_repeats(size: u64, quick: bool) -> usize {
    match (size, quick) {
        (_, true) if size <= 1_000 => 11,
        (_, true) => 5,
        (..=1_000, _) => 21,
        (..=10_000, _) => 11,
        (..=100_000, _) => 5,
        _ => 3,
    }
}

/// Folds every event of the session from seq 1, read from the store.
pub async fn naive_fold(store: &Store, session: Uuid) -> Result<SessionState, BenchError> {
    let mut state = SessionState::empty(session);
    loop {
        let page = store.history(session, state.seq, 5_000).await?;
        if page.is_empty() {
            return Ok(state);
        }
        for e in &page {
            state.apply(e);
        }
    }
}

/// Writes the session as JSON lines (`export`'s), returning the bytes.
async fn write_jsonl(store: &Store, session: Uuid, path: &Path) -> Result<u64, BenchError> {
    let io = |e: std::io::Error| BenchError::Setup(format!("writing {}: {e}", path.display()));
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let mut pages = store.event_pages(session, crate::audit::At::Latest).await?;
    while let Some(page) = pages.next_page(store).await? {
        for e in &page {
            serde_json::to_writer(&mut file, &e.export_line())
                .map_err(|e| io(std::io::Error::other(e)))?;
            file.write_all(b"\n").map_err(io)?;
        }
    }
    file.flush().map_err(io)?;
    Ok(std::fs::metadata(path).map_err(io)?.len())
}

/// What a JSONL-file store does to answer: read every line of the file,
/// parse it and fold it. The seq of an event is its line number.
pub fn jsonl_fold(path: &Path, session: Uuid) -> Result<SessionState, BenchError> {
    let bad =
        |n: usize, why: String| BenchError::Setup(format!("line {n} of {}: {why}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| bad(0, e.to_string()))?;
    let mut state = SessionState::empty(session);
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| bad(n, e.to_string()))?;
        let event = parse_line(&line, LineKind::Import, usize::MAX)
            .map_err(|e| bad(n, e.to_string()))?
            .event;
        state.apply(&StoredEvent {
            session_id: session,
            seq: n as i64,
            event_id: event.event_id.unwrap_or_default(),
            position: n as i64,
            recorded_at: event.recorded_at.unwrap_or_default(),
            body: event.body,
        });
    }
    Ok(state)
}

/// Measures the naive fold of each built session, from its JSON-lines file
/// and from the store.
pub async fn fold(url: &str, quick: bool, built: &[Built]) -> Result<Vec<Fold>, BenchError> {
    let store = Store::open(url).await?;
    let mut out = Vec::new();
    for b in built {
        let path = std::env::temp_dir().join(format!(
            "session-store-bench-{}-{}.jsonl",
            std::process::id(),
            b.session_id
        ));
        let measured = fold_one(&store, b, quick, &path).await;
        let _ = std::fs::remove_file(&path);
        let f = measured?;
        eprintln!(
            "  naive fold at {} events: median {:.1} ms from JSON lines, {:.1} ms from the store, over {} runs",
            f.events, f.fold.p50_ms, f.store_fold.p50_ms, f.fold.n
        );
        out.push(f);
    }
    store.close().await;
    Ok(out)
}

async fn fold_one(store: &Store, b: &Built, quick: bool, path: &Path) -> Result<Fold, BenchError> {
    let jsonl_bytes = write_jsonl(store, b.session_id, path).await?;
    let (mut from_file, mut from_store) = (Vec::new(), Vec::new());
    let mut events = 0;
    // Alternating, so a drift of the machine hits both alike.
    for _ in 0..fold_repeats(b.size, quick) {
        let t = Instant::now();
        let state = jsonl_fold(path, b.session_id)?;
        let answers = (state.activations(), state.context());
        from_file.push(t.elapsed());
        std::hint::black_box(answers);
        let t = Instant::now();
        let state = naive_fold(store, b.session_id).await?;
        let answers = (state.activations(), state.context());
        from_store.push(t.elapsed());
        events = state.seq;
        std::hint::black_box(answers);
    }
    Ok(Fold {
        size: b.size,
        events,
        jsonl_bytes,
        fold: Latency::of(&from_file),
        store_fold: Latency::of(&from_store),
    })
}
