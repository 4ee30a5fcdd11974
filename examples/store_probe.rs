//! The store's appends alone, for a profiler: WRITERS tasks append the
//! bench's mix to distinct sessions of one SQLite store for SECONDS, in
//! batches of BATCH, and the events/s are printed. No ceiling runs beside
//! it (`append_probe` has one), so a `perf record` of this process is the
//! store's time only.
//!
//! `cargo run --release --example store_probe -- WRITERS BATCH SECONDS`
//! (`PROBE_KEEP=DIR` keeps the database in DIR; `RUST_LOG=sqlx::query=debug`
//! logs each statement with its time).

use std::sync::Arc;
use std::time::Instant;

use session_store::bench::workload::{Mix, TextPool};
use session_store::{NewEvent, Store};
use uuid::Uuid;

type Error = Box<dyn std::error::Error + Send + Sync>;

// The binary's allocator (src/main.rs), so the figures are the bench's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<(), Error> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<f64>())
        .collect::<Result<Vec<_>, _>>()?;
    let [writers, batch, seconds] = args[..] else {
        return Err("usage: store_probe WRITERS BATCH SECONDS".into());
    };
    let dir = tempfile::tempdir()?;
    let path = match std::env::var("PROBE_KEEP") {
        Ok(keep) => {
            std::fs::create_dir_all(&keep)?;
            std::path::PathBuf::from(keep).join("probe.db")
        }
        Err(_) => dir.path().join("probe.db"),
    };
    let store = Arc::new(Store::open(&format!("sqlite://{}", path.display())).await?);
    let texts = Arc::new(TextPool::new());
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers as usize {
        let store = store.clone();
        let mut mix = Mix::new(texts.clone(), w, 1);
        tasks.push(tokio::spawn(async move {
            let session = Uuid::new_v4();
            let header: Vec<NewEvent> = Mix::header().into_iter().map(NewEvent::new).collect();
            let mut head = header.len() as i64;
            store.append(session, 0, header).await?;
            let mut events = 0u64;
            while start.elapsed().as_secs_f64() < seconds {
                let outcome = store
                    .append(session, head, mix.next_batch(batch as usize))
                    .await?;
                head = outcome.events.last().map_or(head, |a| a.seq);
                events += batch as u64;
            }
            Ok::<u64, Error>(events)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    println!(
        "{:.0} events/s",
        total as f64 / start.elapsed().as_secs_f64()
    );
    store.close().await;
    Ok(())
}
