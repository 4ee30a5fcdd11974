//! Flat-cost reads (SEMANTICS §8): builds sessions of 1 000 … 1 000 000
//! events (with compactions, as long real sessions have) on SQLite and
//! PostgreSQL, and measures in one run, with a cold cache (as a freshly
//! started sidecar would):
//!
//! - the latest-state `activations` read (view + window + events after it),
//! - a refresh (appending a `prompt_submitted`, which rewrites the view),
//! - the naive full fold of the log, the baseline.
//!
//! `cargo bench --bench view` (all sizes, both backends);
//! `BENCH_SIZES=1000,10000 cargo bench --bench view` for a quick run.
//! Prints a markdown table of medians and ratios for docs/benchmarks.md.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use session_store::{EventBody, NewEvent, Store};
use uuid::Uuid;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

struct Row {
    backend: &'static str,
    events: usize,
    window: i64,
    read: Duration,
    refresh: Duration,
    fold: Duration,
}

async fn build(store: &Store, events: usize, seed: u64) -> Uuid {
    let session = Uuid::new_v4();
    let log = common::gen::valid_log(seed, session, events);
    let mut done = 0usize;
    for chunk in log.chunks(2_000) {
        let batch: Vec<NewEvent> = chunk
            .iter()
            .map(|e| NewEvent::new(e.body.clone()).with_id(e.event_id))
            .collect();
        store.append(session, done as i64, batch).await.unwrap();
        done += chunk.len();
    }
    // The same recent past for every size: a compaction, then 20 turns in
    // which a search activates a tool, ending on a refresh point. So every
    // session has the same effective window and only the history before it
    // differs, which is what the read must not depend on.
    let mut tail = vec![NewEvent::new(EventBody::Compaction {
        summary: "earlier work".into(),
        first_kept_event_id: None,
        tokens_before: Some(100_000),
    })];
    for t in 0..20 {
        tail.push(NewEvent::new(EventBody::PromptSubmitted {
            text: format!("turn {t}"),
        }));
        tail.push(NewEvent::new(EventBody::ToolCall {
            call_id: format!("tail-{t}"),
            tool_name: "ToolSearch".into(),
            input: serde_json::json!({"query": "select:web_fetch"}),
        }));
        tail.push(NewEvent::new(EventBody::ToolResult {
            call_id: format!("tail-{t}"),
            tool_name: "ToolSearch".into(),
            status: session_store::ToolStatus::Success,
            output: Some(serde_json::json!({"matches": ["web_fetch"]})),
            added_tool_names: Some(vec!["web_fetch".into()]),
        }));
    }
    tail.push(NewEvent::new(EventBody::PromptSubmitted {
        text: "next".into(),
    }));
    store.append(session, done as i64, tail).await.unwrap();
    session
}

async fn measure(backend: &'static str, url: &str, sizes: &[usize]) -> Vec<Row> {
    let store = Store::open(url).await.unwrap();
    let mut rows = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let t = Instant::now();
        let session = build(&store, n, 1000 + i as u64).await;
        eprintln!(
            "{backend}: built {n} events in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let mut reads = Vec::new();
        for _ in 0..31 {
            store.clear_cache();
            let t = Instant::now();
            let a = store.activations(session, None).await.unwrap();
            reads.push(t.elapsed());
            std::hint::black_box(a);
        }
        let mut refreshes = Vec::new();
        for _ in 0..11 {
            store.clear_cache();
            let head = store.head_seq(session).await.unwrap();
            let t = Instant::now();
            store
                .append(
                    session,
                    head,
                    vec![NewEvent::new(EventBody::PromptSubmitted {
                        text: "again".into(),
                    })],
                )
                .await
                .unwrap();
            refreshes.push(t.elapsed());
        }
        let window = store.recover(session).await.unwrap();
        let latest = window.latest_seq;
        let fold_reps = if n >= 100_000 { 3 } else { 7 };
        let mut folds = Vec::new();
        for _ in 0..fold_reps {
            store.clear_cache();
            let t = Instant::now();
            let s = store.state(session, Some(latest)).await.unwrap();
            folds.push(t.elapsed());
            std::hint::black_box(s.activations());
        }
        rows.push(Row {
            backend,
            events: n,
            window: latest - window.context_start_seq + 1,
            read: median(reads),
            refresh: median(refreshes),
            fold: median(folds),
        });
    }
    store.close().await;
    rows
}

#[tokio::main]
async fn main() {
    let sizes: Vec<usize> = std::env::var("BENCH_SIZES")
        .unwrap_or_else(|_| "1000,10000,100000,1000000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let sqlite = common::sqlite_db();
    let mut rows = measure("SQLite", &sqlite.url, &sizes).await;
    match common::postgres_db() {
        Some(pg) => rows.extend(measure("PostgreSQL", &pg.url, &sizes).await),
        None => eprintln!("PostgreSQL not found: its rows are missing"),
    }
    println!("| backend | events | effective window | activations read, median ms | refresh, median ms | full fold, median ms | read vs 1 000-event read | full fold / read |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let base = rows
            .iter()
            .find(|b| b.backend == r.backend)
            .map(|b| b.read)
            .unwrap_or(r.read);
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.2}x | {:.0}x |",
            r.backend,
            r.events,
            r.window,
            ms(r.read),
            ms(r.refresh),
            ms(r.fold),
            r.read.as_secs_f64() / base.as_secs_f64(),
            r.fold.as_secs_f64() / r.read.as_secs_f64()
        );
    }
}
