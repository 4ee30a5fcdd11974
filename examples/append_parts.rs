//! Where a SQLite append's time and WAL pages go, against raw inserts: the
//! probe behind "Where the SQLite batch gap is" in docs/benchmarks.md.
//!
//! One writer, one session, a fresh file for every run, and three loops
//! that alternate round by round (a noisy machine hits all of them alike):
//!
//! - `bare`: the bench's ceiling itself (`bench::append::Raw`): multi-row
//!   `INSERT`s into a table with the columns and unique keys of `events`;
//! - `indexed`: the same, into a table that also has every other index
//!   `events` has (the audit indexes and the partial ones);
//! - `store`: `Store::append` of the same mix.
//!
//! For each it prints events/s, the CPU each thread spent per event (the
//! caller's thread, and sqlx's worker thread where SQLite runs) and the
//! WAL pages a commit wrote, by B-tree: the frames of the WAL since its
//! last restart, mapped to their table or index through SQLite's `dbstat`.
//!
//! `cargo run --release --example append_parts -- BATCH [SECONDS] [ROUNDS]`
//! (`PARTS_ONLY=store`, `bare` or `indexed` runs that loop alone, for a
//! profiler)

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use session_store::bench::append::Raw;
use session_store::bench::stats::Spread;
use session_store::bench::workload::{Mix, TextPool};
use session_store::store::BackendKind;
use session_store::{NewEvent, Store};
use sqlx::sqlite::SqlitePool;
use uuid::Uuid;

type Error = Box<dyn std::error::Error>;

/// The other indexes of `events` (migrations/sqlite 0004 and 0005).
const INDEXES: &str = "CREATE INDEX raw_type ON bench_raw (type, position); \
    CREATE INDEX IF NOT EXISTS raw_time ON bench_raw (recorded_at, position); \
    CREATE INDEX IF NOT EXISTS raw_named ON bench_raw (position) \
        WHERE type = 'tool_result' AND payload LIKE '%\"added_tool_names\"%'; \
    CREATE INDEX IF NOT EXISTS raw_catalogs ON bench_raw (session_id, seq) WHERE type = 'catalog_defined'; \
    CREATE INDEX IF NOT EXISTS raw_unchained ON bench_raw (session_id, seq) WHERE hash IS NULL;";

/// What one run measured.
struct Run {
    rate: f64,
    /// CPU seconds per event of each thread that used any, by thread name.
    cpu: BTreeMap<String, f64>,
    /// WAL pages per commit by B-tree, and the commits they were counted over.
    pages: BTreeMap<String, f64>,
    commits: usize,
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let batch: usize = args
        .first()
        .ok_or("usage: append_parts BATCH [SECONDS] [ROUNDS]")?
        .parse()?;
    let seconds: f64 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(3.0);
    let rounds: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(3);
    let texts = Arc::new(TextPool::new());
    let mut runs: BTreeMap<&str, Vec<Run>> = BTreeMap::new();
    for round in 0..rounds {
        for kind in ["bare", "indexed", "store"] {
            if std::env::var("PARTS_ONLY").is_ok_and(|only| only != kind) {
                continue;
            }
            let dir = tempfile::tempdir()?;
            let path = dir.path().join("parts.db");
            let mix = Mix::new(texts.clone(), 0, round as u64 + 1);
            let run = match kind {
                "store" => store_run(&path, mix, batch, seconds).await?,
                "bare" => raw_run(&path, mix, batch, seconds, false).await?,
                _ => raw_run(&path, mix, batch, seconds, true).await?,
            };
            eprintln!("round {round} {kind:>7}: {:.0} events/s", run.rate);
            runs.entry(kind).or_default().push(run);
        }
    }
    let bare = runs.get("bare").map_or(f64::NAN, |rs| {
        Spread::of(&rs.iter().map(|r| r.rate).collect::<Vec<_>>()).median
    });
    println!("batch {batch}, {rounds} rounds of {seconds} s; medians");
    for (kind, rs) in &runs {
        let rate = Spread::of(&rs.iter().map(|r| r.rate).collect::<Vec<_>>());
        println!(
            "\n{kind}: {:.0} events/s ({:.0}–{:.0}), {:.2} of bare",
            rate.median,
            rate.min,
            rate.max,
            rate.median / bare
        );
        let threads: std::collections::BTreeSet<&String> =
            rs.iter().flat_map(|r| r.cpu.keys()).collect();
        for t in threads {
            let per: Vec<f64> = rs
                .iter()
                .map(|r| r.cpu.get(t).copied().unwrap_or(0.0) * 1e6)
                .collect();
            println!("  CPU {t:<16} {:>6.1} µs/event", Spread::of(&per).median);
        }
        let commits: usize = rs.iter().map(|r| r.commits).sum();
        let trees: std::collections::BTreeSet<&String> =
            rs.iter().flat_map(|r| r.pages.keys()).collect();
        let mut by_tree: Vec<(f64, &String)> = trees
            .into_iter()
            .map(|t| {
                let per: Vec<f64> = rs
                    .iter()
                    .map(|r| r.pages.get(t).copied().unwrap_or(0.0))
                    .collect();
                (Spread::of(&per).median, t)
            })
            .collect();
        by_tree.sort_by(|a, b| b.0.total_cmp(&a.0));
        let total: f64 = by_tree.iter().map(|(p, _)| p).sum();
        println!("  WAL pages per commit: {total:.1} (counted over {commits} commits)");
        for (p, t) in by_tree.iter().filter(|(p, _)| *p >= 0.05) {
            println!("    {t:<40} {p:>5.2}");
        }
    }
    Ok(())
}

async fn store_run(path: &Path, mut mix: Mix, batch: usize, seconds: f64) -> Result<Run, Error> {
    let store = Store::open(&format!("sqlite://{}", path.display())).await?;
    let session = Uuid::new_v4();
    let header: Vec<NewEvent> = Mix::header().into_iter().map(NewEvent::new).collect();
    let mut head = header.len() as i64;
    store.append(session, 0, header).await?;
    let before = thread_cpu();
    let start = Instant::now();
    let mut events = 0u64;
    while start.elapsed().as_secs_f64() < seconds {
        let outcome = store.append(session, head, mix.next_batch(batch)).await?;
        head = outcome.events.last().map_or(head, |a| a.seq);
        events += batch as u64;
    }
    let run = measured(path, start, &before, events).await;
    store.close().await;
    run
}

async fn raw_run(
    path: &Path,
    mut mix: Mix,
    batch: usize,
    seconds: f64,
    indexed: bool,
) -> Result<Run, Error> {
    let raw = Raw::open(BackendKind::Sqlite, &format!("sqlite://{}", path.display())).await?;
    if let (true, Raw::Sqlite(conn)) = (indexed, &raw) {
        sqlx::raw_sql(INDEXES)
            .execute(&mut *conn.lock().await)
            .await?;
    }
    let session = Uuid::new_v4();
    let before = thread_cpu();
    let start = Instant::now();
    let mut events = 0u64;
    while start.elapsed().as_secs_f64() < seconds {
        raw.insert(session, events as i64 + 1, &mix.next_batch(batch))
            .await?;
        events += batch as u64;
    }
    let run = measured(path, start, &before, events).await;
    raw.close().await;
    run
}

/// What a loop that started at `start` with the threads' CPU at `before`
/// measured once it wrote `events` events, its writer idle.
async fn measured(
    path: &Path,
    start: Instant,
    before: &BTreeMap<String, f64>,
    events: u64,
) -> Result<Run, Error> {
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = cpu_per_event(before, &thread_cpu(), events);
    let (pages, commits) = wal_pages(path).await?;
    Ok(Run {
        rate: events as f64 / elapsed,
        cpu,
        pages,
        commits,
    })
}

/// CPU seconds (user + system) of each of this process's threads, by name.
fn thread_cpu() -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in tasks.flatten() {
        let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // Fields after the parenthesized name: utime and stime are the 12th
        // and 13th, in clock ticks (100 a second on Linux).
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let ticks: f64 = [11, 12]
            .iter()
            .filter_map(|&i| fields.get(i).and_then(|f| f.parse::<f64>().ok()))
            .sum();
        *out.entry(name.trim().to_owned()).or_insert(0.0) += ticks / 100.0;
    }
    out
}

fn cpu_per_event(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    events: u64,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(t, a)| {
            (
                t.clone(),
                (a - before.get(t).unwrap_or(&0.0)) / events.max(1) as f64,
            )
        })
        .filter(|(_, s)| *s > 0.0)
        .collect()
}

/// WAL pages per commit by B-tree, over the commits since the WAL's last
/// restart (frames whose salt matches the header's), from a copy of the
/// database and its WAL taken while the writer is idle.
async fn wal_pages(path: &Path) -> Result<(BTreeMap<String, f64>, usize), Error> {
    let copy = path.with_extension("copy.db");
    std::fs::copy(path, &copy)?;
    let wal = std::fs::read(format!("{}-wal", path.display()))?;
    std::fs::write(format!("{}-wal", copy.display()), &wal)?;
    let be = |at: usize| u32::from_be_bytes([wal[at], wal[at + 1], wal[at + 2], wal[at + 3]]);
    if wal.len() < 32 {
        return Ok((BTreeMap::new(), 0));
    }
    let page_size = be(8) as usize;
    let salt = (be(16), be(20));
    let (mut commits, mut pending, mut counted) = (0usize, Vec::new(), Vec::new());
    let mut at = 32;
    while at + 24 + page_size <= wal.len() && (be(at + 8), be(at + 12)) == salt {
        pending.push(be(at));
        if be(at + 4) != 0 {
            // A commit frame (it carries the database size).
            counted.append(&mut pending);
            commits += 1;
        }
        at += 24 + page_size;
    }
    // The copy is in WAL mode already (the mode is kept in the file), so
    // SQLite reads its WAL: no setting of the store's connections matters
    // to a read.
    let pool = SqlitePool::connect(&format!("sqlite://{}", copy.display())).await?;
    let names: BTreeMap<i64, String> = sqlx::query_as("SELECT pageno, name FROM dbstat")
        .fetch_all(&pool)
        .await?
        .into_iter()
        .collect();
    pool.close().await;
    let mut pages = BTreeMap::new();
    for page in counted {
        let name = names
            .get(&(page as i64))
            .cloned()
            .unwrap_or_else(|| "(free)".into());
        *pages.entry(name).or_insert(0.0) += 1.0 / commits.max(1) as f64;
    }
    Ok((pages, commits))
}
