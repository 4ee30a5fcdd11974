//! Where a SQLite append's worker time goes, query by query: sqlx times
//! each query on its worker thread (the `sqlx::query` events its logger
//! emits at debug level), and this sums them by the query's text, per
//! commit, for the store and for the bench's bare ceiling (item 43 of
//! docs/benchmarks.md).
//!
//! One writer, one session, a fresh file each:
//! `cargo run --release --features bench,cli --example stmt_times -- [BATCH] [SECONDS]`
//!
//! The logger's own cost (formatting each query's text) slows both loops;
//! the times it reports are measured before it.
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use session_store::bench::append::Raw;
use session_store::bench::workload::{Mix, TextPool};
use session_store::store::BackendKind;
use session_store::{NewEvent, Store};
use tracing_subscriber::layer::SubscriberExt;
use uuid::Uuid;

/// Per query text (digits dropped, so row counts share a line): how many
/// ran and their seconds.
static TIMES: Mutex<BTreeMap<String, (u64, f64)>> = Mutex::new(BTreeMap::new());

/// The layer that sums sqlx's query events into [`TIMES`].
struct Times;

/// One event's query text (its first 70 characters) and time.
struct V {
    key: String,
    secs: f64,
}
impl tracing::field::Visit for V {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        if f.name() == "db.statement" && self.key.is_empty() {
            let s = format!("{v:?}");
            self.key = s
                .replace("\\n", " ")
                .trim_matches('"')
                .trim()
                .chars()
                .take(70)
                .collect();
        }
    }
    fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
        if f.name() == "db.statement" && !v.trim().is_empty() {
            self.key = v.replace('\n', " ").trim().chars().take(70).collect();
        } else if f.name() == "summary" && self.key.is_empty() {
            self.key = v.to_owned();
        }
    }
    fn record_f64(&mut self, f: &tracing::field::Field, v: f64) {
        if f.name() == "elapsed_secs" {
            self.secs = v;
        }
    }
}
impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Times {
    fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if e.metadata().target() != "sqlx::query" {
            return;
        }
        let mut v = V {
            key: String::new(),
            secs: 0.0,
        };
        e.record(&mut v);
        let key = v
            .key
            .chars()
            .filter(|c| !c.is_ascii_digit())
            .collect::<String>();
        let mut t = TIMES.lock().unwrap();
        let x = t.entry(key).or_default();
        x.0 += 1;
        x.1 += v.secs;
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batch: usize = std::env::args().nth(1).unwrap_or("100".into()).parse()?;
    let secs: f64 = std::env::args().nth(2).unwrap_or("3".into()).parse()?;
    let filter = tracing_subscriber::filter::Targets::new()
        .with_target("sqlx::query", tracing::Level::DEBUG);
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry().with(Times).with(filter),
    )?;
    let texts = std::sync::Arc::new(TextPool::new());
    for kind in ["bare", "store"] {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("t.db");
        let url = format!("sqlite://{}", path.display());
        let mut mix = Mix::new(texts.clone(), 0, 1);
        let session = Uuid::new_v4();
        TIMES.lock().unwrap().clear();
        let start;
        let mut events = 0u64;
        if kind == "store" {
            let store = Store::open(&url).await?;
            let header: Vec<NewEvent> = Mix::header().into_iter().map(NewEvent::new).collect();
            let mut head = header.len() as i64;
            store.append(session, 0, header).await?;
            TIMES.lock().unwrap().clear();
            start = Instant::now();
            while start.elapsed().as_secs_f64() < secs {
                let o = store.append(session, head, mix.next_batch(batch)).await?;
                head = o.events.last().map_or(head, |a| a.seq);
                events += batch as u64;
            }
        } else {
            let raw = Raw::open(BackendKind::Sqlite, &url).await?;
            TIMES.lock().unwrap().clear();
            start = Instant::now();
            while start.elapsed().as_secs_f64() < secs {
                raw.insert(session, events as i64 + 1, &mix.next_batch(batch))
                    .await?;
                events += batch as u64;
            }
        }
        let wall = start.elapsed().as_secs_f64();
        let commits = events as f64 / batch as f64;
        println!(
            "\n{kind}: {:.0} events/s, {:.0} µs/commit wall",
            events as f64 / wall,
            wall / commits * 1e6
        );
        let t = TIMES.lock().unwrap();
        let mut total = 0.0;
        for (k, (n, s)) in t.iter() {
            total += s;
            println!(
                "  {:>6.2}/commit {:>8.1} µs/commit  {k}",
                *n as f64 / commits,
                s / commits * 1e6
            );
        }
        println!("  worker-side total {:.1} µs/commit", total / commits * 1e6);
    }
    Ok(())
}
