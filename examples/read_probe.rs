//! The pre-request read alone, for a profiler: builds one session of the
//! bench's mix (SIZE events, ending on the fullest window of the mix) in a
//! SQLite or PostgreSQL store, then reads its activation set and context
//! with the store's cache emptied, for SECONDS, and prints the median.
//!
//! `cargo run --release --example read_probe -- URL SIZE SECONDS`

use std::time::{Duration, Instant};

use session_store::bench::latency;
use session_store::Store;

// The binary's allocator (src/main.rs), so the figures are the bench's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, size, seconds] = &args[..] else {
        return Err("usage: read_probe URL SIZE SECONDS".into());
    };
    let size: u64 = size.parse()?;
    let seconds: f64 = seconds.parse()?;
    let built = latency::build_sizes(url, &[size]).await?;
    let s = built[0].session_id;
    let store = Store::open(url).await?;
    let mut samples = Vec::new();
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < until {
        store.clear_cache();
        let t = Instant::now();
        let a = store.activations(s, None).await?;
        let c = store.context(s, None).await?;
        samples.push(t.elapsed());
        std::hint::black_box((a, c));
    }
    samples.sort();
    println!(
        "{} reads, p50 {:.3} ms, p99 {:.3} ms",
        samples.len(),
        samples[samples.len() / 2].as_secs_f64() * 1e3,
        samples[samples.len() * 99 / 100].as_secs_f64() * 1e3
    );
    Ok(())
}
