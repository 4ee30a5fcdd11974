//! Two instances taking turns on one session, as behind a load balancer
//! without affinity: the latency of one instance's appends, and which path
//! its groups took (docs/design.md, "Optimistic appends", the contended
//! sessions). Both `Store`s live in this process, each with its own pool
//! and cache, as two sidecar instances would.
//!
//! `cargo run --release --example turns_probe -- postgres|sqlite TURNS
//! [EVERY]`: `other` appends once every EVERY turns of this instance
//! (1: strict turns; a large EVERY: an instance mostly alone). With
//! `PROBE_PG_URL` set, on that PostgreSQL server instead of a throw-away
//! one.

use std::time::{Duration, Instant};

use session_store::bench::stats::Latency;
use session_store::pgtemp::{find_pg_bin, PgServer, PgTempOptions};
use session_store::{EventBody, NewEvent, RetryPolicy, Store};
use uuid::Uuid;

fn prompt(text: String) -> Vec<NewEvent> {
    vec![NewEvent::new(EventBody::PromptSubmitted { text })]
}

// The binary's allocator (src/main.rs), so the figures are the bench's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: turns_probe postgres|sqlite TURNS [EVERY]";
    let backend = args.first().ok_or(usage)?;
    let turns: usize = args.get(1).ok_or(usage)?.parse()?;
    let every: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let dir = tempfile::tempdir()?;
    let server;
    let url = match (backend.as_str(), std::env::var("PROBE_PG_URL")) {
        ("postgres", Ok(url)) => url,
        ("postgres", Err(_)) => {
            let bin = find_pg_bin().ok_or("no PostgreSQL binaries found")?;
            server = PgServer::start(&bin, PgTempOptions::default())?;
            server.url()
        }
        _ => format!("sqlite://{}", dir.path().join("probe.db").display()),
    };
    let this = Store::open(&url).await?;
    let other = Store::open(&url).await?;
    let s = Uuid::new_v4();
    let policy = RetryPolicy::default();
    let started = NewEvent::new(EventBody::SessionStarted {
        mode: "agent".into(),
        metadata: None,
    });
    this.append_at_head(s, vec![started], &policy).await?;
    let before = this.append_paths();
    let mut took: Vec<Duration> = Vec::with_capacity(turns);
    for turn in 0..turns {
        if turn % every == 0 {
            other
                .append_at_head(s, prompt(format!("other {turn}")), &policy)
                .await?;
        }
        let t = Instant::now();
        this.append_at_head(s, prompt(format!("this {turn}")), &policy)
            .await?;
        took.push(t.elapsed());
    }
    let paths = this.append_paths();
    let l = Latency::of(&took);
    println!(
        "{backend} turns={turns} every={every}: this instance's append p50 {:.3} ms, p99 {:.3} ms, mean {:.3} ms; groups locked {}, optimistic {}, abandoned {}",
        l.p50_ms,
        l.p99_ms,
        l.mean_ms,
        paths.locked - before.locked,
        paths.optimistic - before.optimistic,
        paths.optimistic_abandoned - before.optimistic_abandoned
    );
    this.close().await;
    other.close().await;
    Ok(())
}
