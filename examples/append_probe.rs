//! Runs cells of the bench's append phase alone, on a throw-away
//! PostgreSQL server (fsync on) or a temp SQLite file: the loop used while
//! profiling the append path (docs/benchmarks.md).
//!
//! `cargo run --release --example append_probe -- postgres|sqlite
//! distinct|shared WRITERS BATCH [SECONDS] [REPEATS]`; with `PROBE_PG_URL`
//! set, on that PostgreSQL server instead of a throw-away one.

use session_store::bench::append::{run_plan, AppendPlan};
use session_store::pgtemp::{find_pg_bin, PgServer, PgTempOptions};

// The binary's allocator (src/main.rs), so the figures are the bench's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        return Err(
            "usage: append_probe postgres|sqlite distinct|shared WRITERS BATCH [SECONDS] [REPEATS]"
                .into(),
        );
    }
    let plan = AppendPlan {
        batches: args[3]
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()?,
        writers: args[2]
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()?,
        seconds: args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(0.6),
        repeats: args.get(5).map(|s| s.parse()).transpose()?.unwrap_or(3),
    };
    let shared = [args[1] == "shared"];
    let dir = tempfile::tempdir()?;
    let server;
    let url = if let (true, Ok(url)) = (args[0] == "postgres", std::env::var("PROBE_PG_URL")) {
        // A server of one's own (say, with auto_explain on).
        url
    } else if args[0] == "postgres" {
        let bin = find_pg_bin().ok_or("no PostgreSQL binaries found")?;
        server = PgServer::start(&bin, PgTempOptions::default())?;
        server.url()
    } else {
        format!("sqlite://{}", dir.path().join("probe.db").display())
    };
    let result = run_plan(&url, plan, &shared).await?;
    for c in result.cells {
        println!(
            "{} writers={} batch={}: store {:.0} ceiling {:.0} ratio {:.2}",
            c.sessions, c.writers, c.batch, c.store.median, c.ceiling.median, c.ratio
        );
    }
    Ok(())
}
