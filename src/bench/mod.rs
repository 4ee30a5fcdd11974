//! `session-store bench`: the store against its ceilings and baselines, in
//! one run, on SQLite and PostgreSQL (issue 7; results in
//! docs/benchmarks.md).
//!
//! Per backend, four questions, each answered beside what bounds it:
//!
//! 1. append throughput of the realistic mix ([`workload`]) against raw
//!    inserts of the same rows with the same driver and durability
//!    ([`append`]);
//! 2. the pre-request read (latest activation set and context) at 10^3 …
//!    10^6 events against the naive fold of the whole log ([`latency`]);
//! 3. opening a store and recovering a session at the largest size, and
//!    rebuilding every view ([`recovery`]);
//! 4. the peak RSS of each of those phases.
//!
//! Peak RSS can only be read, not reset, so every phase runs in its own
//! child process: the bench re-executes its own binary with the hidden
//! `bench-phase` command and a JSON [`PhaseSpec`]; the child runs one phase
//! and prints one JSON line, its result and its own `VmHWM` read from
//! `/proc/self/status` just before it exits. The parent owns the databases
//! (temp SQLite files, a throw-away PostgreSQL server with `fsync` on),
//! runs `sync` (and on PostgreSQL a `CHECKPOINT`) before each phase so
//! that no phase pays for the previous one's writeback, and writes the
//! report ([`report`]) and the plot
//! ([`plot`]).

pub mod append;
pub mod latency;
pub mod plot;
pub mod recovery;
pub mod report;
pub mod stats;
pub mod workload;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::Error;
use crate::pgtemp::{PgServer, PgTempOptions};
use crate::store::BackendKind;
use report::{BackendReport, LatencyRow, LatencyTarget, Machine, PhaseMemory, Report};

/// The bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A store call failed.
    #[error("{0}")]
    Store(#[from] Error),
    /// Setting up a database or a child process failed.
    #[error("{0}")]
    Setup(String),
    /// A phase's child process failed.
    #[error("the {phase} phase on {backend} failed: {detail}")]
    Phase {
        /// Which phase.
        phase: String,
        /// Which backend.
        backend: String,
        /// What went wrong.
        detail: String,
    },
}

/// What `session-store bench` was asked to do.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// The backends to measure, in order.
    pub backends: Vec<BackendKind>,
    /// Fewer sizes, shorter runs: a smoke test of under a minute.
    pub quick: bool,
    /// Where the JSON report goes.
    pub out: PathBuf,
    /// Where the SVG plot goes.
    pub svg: PathBuf,
    /// An existing PostgreSQL server's admin URL (the bench creates and
    /// drops its own databases there) instead of a throw-away server.
    pub postgres_url: Option<String>,
    /// Where the SQLite files go (the system temp dir by default).
    pub dir: Option<PathBuf>,
    /// The command line, for the report.
    pub command: String,
}

/// One phase a child process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Open the store and exit: the baseline RSS of a process.
    Idle,
    /// Append throughput and its ceiling.
    Append,
    /// Build the long sessions.
    Build,
    /// Pre-request reads.
    Read,
    /// The naive fold.
    Fold,
    /// Open + recover the largest session.
    Recover,
    /// Rebuild every view.
    Rebuild,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Append => "append",
            Phase::Build => "build",
            Phase::Read => "read",
            Phase::Fold => "fold",
            Phase::Recover => "recover",
            Phase::Rebuild => "rebuild",
        }
    }
}

/// What a child is asked to run (its one argument, as JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PhaseSpec {
    /// The phase.
    pub phase: Phase,
    /// The store's URL.
    pub url: String,
    /// `--quick`.
    pub quick: bool,
    /// The built sessions (for read, fold, recover).
    #[serde(default)]
    pub built: Vec<latency::Built>,
}

/// What a child prints: its result and its memory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PhaseOutput {
    /// The phase's result, as JSON.
    pub result: serde_json::Value,
    /// `VmHWM` at the end, KiB (Linux only).
    pub peak_rss_kib: Option<u64>,
    /// `VmRSS` at the end, KiB (Linux only).
    pub rss_kib: Option<u64>,
    /// Seconds the phase took.
    pub seconds: f64,
}

/// A field of `/proc/self/status` in KiB ("VmHWM", "VmRSS").
pub fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Runs one phase in this process (the child side) and returns the line to
/// print.
pub async fn run_phase(spec: &str) -> Result<String, BenchError> {
    let spec: PhaseSpec = serde_json::from_str(spec)
        .map_err(|e| BenchError::Setup(format!("the phase description is not valid: {e}")))?;
    let started = Instant::now();
    let json = |v: Result<serde_json::Value, serde_json::Error>| {
        v.map_err(|e| BenchError::Setup(format!("cannot encode the phase's result: {e}")))
    };
    let largest = || {
        spec.built
            .iter()
            .max_by_key(|b| b.events)
            .ok_or_else(|| BenchError::Setup("no session was built to recover".to_owned()))
    };
    let result = match spec.phase {
        Phase::Idle => {
            crate::store::Store::open(&spec.url).await?.close().await;
            serde_json::Value::Null
        }
        Phase::Append => json(serde_json::to_value(
            append::run(&spec.url, spec.quick).await?,
        ))?,
        Phase::Build => json(serde_json::to_value(
            latency::build(&spec.url, spec.quick).await?,
        ))?,
        Phase::Read => json(serde_json::to_value(
            latency::read(&spec.url, spec.quick, &spec.built).await?,
        ))?,
        Phase::Fold => json(serde_json::to_value(
            latency::fold(&spec.url, spec.quick, &spec.built).await?,
        ))?,
        Phase::Recover => json(serde_json::to_value(
            recovery::recover(&spec.url, largest()?.session_id, 5).await?,
        ))?,
        Phase::Rebuild => json(serde_json::to_value(
            recovery::rebuild(&spec.url, if spec.quick { 1 } else { 3 }).await?,
        ))?,
    };
    let out = PhaseOutput {
        result,
        peak_rss_kib: proc_status_kib("VmHWM"),
        rss_kib: proc_status_kib("VmRSS"),
        seconds: started.elapsed().as_secs_f64(),
    };
    json(serde_json::to_value(&out)).map(|v| v.to_string())
}

/// The databases of one backend: one for the append phase (it fills with
/// many small sessions), one for the long sessions.
struct Databases {
    append_url: String,
    sessions_url: String,
}

/// Where the bench's databases live, removed when dropped.
struct Scratch {
    sqlite_dir: Option<PathBuf>,
    pg_server: Option<PgServer>,
    /// Databases created on an existing server, dropped at the end.
    pg_created: Vec<(String, String)>,
}

impl Scratch {
    fn new() -> Scratch {
        Scratch {
            sqlite_dir: None,
            pg_server: None,
            pg_created: Vec::new(),
        }
    }

    fn sqlite(&mut self, parent: Option<&Path>) -> Result<Databases, BenchError> {
        let dir = parent
            .map(Path::to_path_buf)
            .unwrap_or_else(std::env::temp_dir)
            .join(format!("session-store-bench-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).map_err(|e| {
            BenchError::Setup(format!(
                "cannot create the directory {}: {e}",
                dir.display()
            ))
        })?;
        let dbs = Databases {
            append_url: format!("sqlite://{}", dir.join("append.db").display()),
            sessions_url: format!("sqlite://{}", dir.join("sessions.db").display()),
        };
        self.sqlite_dir = Some(dir);
        Ok(dbs)
    }

    async fn postgres(&mut self, admin: Option<&str>) -> Result<Databases, BenchError> {
        let admin = match admin {
            Some(url) => url.to_owned(),
            None => {
                let bin = crate::pgtemp::find_pg_bin().ok_or_else(|| {
                    BenchError::Setup(
                        "no PostgreSQL server binaries (initdb, postgres) were found on PATH, in $PG_BIN or in /usr/lib/postgresql/*/bin; \
                         install PostgreSQL, pass --postgres-url for an existing server, or run --backend sqlite"
                            .to_owned(),
                    )
                })?;
                eprintln!(
                    "starting a throw-away PostgreSQL server (fsync on) from {}",
                    bin.display()
                );
                let server = tokio::task::spawn_blocking(move || {
                    PgServer::start(&bin, PgTempOptions::default())
                })
                .await
                .map_err(|e| BenchError::Setup(format!("starting PostgreSQL failed: {e}")))?
                .map_err(|e| BenchError::Setup(e.to_string()))?;
                let url = server.url();
                self.pg_server = Some(server);
                url
            }
        };
        let tag = Uuid::new_v4().simple().to_string();
        let mut urls = Vec::new();
        for what in ["append", "sessions"] {
            let name = format!("bench_{what}_{}", &tag[..12]);
            let url = database_url(&admin, &name)?;
            admin_sql(&admin, &format!("CREATE DATABASE {name}")).await?;
            self.pg_created.push((admin.clone(), name.clone()));
            urls.push(url);
        }
        Ok(Databases {
            append_url: urls[0].clone(),
            sessions_url: urls[1].clone(),
        })
    }

    async fn clean(mut self) {
        if let Some(server) = self.pg_server.take() {
            let _ = tokio::task::spawn_blocking(move || server.shutdown()).await;
        } else {
            for (admin, name) in std::mem::take(&mut self.pg_created) {
                let _ = admin_sql(&admin, &format!("DROP DATABASE IF EXISTS {name}")).await;
            }
        }
        if let Some(dir) = self.sqlite_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `admin` (a `postgres://` URL) with its database replaced by `name`,
/// its options (`?sslmode=…`, `?host=/socket/dir`) kept; a URL without a
/// database gets one.
fn database_url(admin: &str, name: &str) -> Result<String, BenchError> {
    let (url, query) = match admin.split_once('?') {
        Some((url, query)) => (url, Some(query)),
        None => (admin, None),
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(BenchError::Setup(format!(
            "{} is not a postgres:// URL",
            crate::error::redact_url(admin)
        )));
    };
    let authority = rest
        .split_once('/')
        .map_or(rest, |(authority, _)| authority);
    Ok(match query {
        Some(query) => format!("{scheme}://{authority}/{name}?{query}"),
        None => format!("{scheme}://{authority}/{name}"),
    })
}

async fn admin_sql(admin: &str, sql: &str) -> Result<(), BenchError> {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(admin).await.map_err(|e| {
        BenchError::Setup(format!(
            "cannot connect to PostgreSQL at {}: {e}",
            crate::error::redact_url(admin)
        ))
    })?;
    sqlx::raw_sql(sql)
        .execute(&mut c)
        .await
        .map_err(|e| BenchError::Setup(format!("{sql} failed: {e}")))?;
    let _ = c.close().await;
    Ok(())
}

fn backend_name(kind: BackendKind) -> &'static str {
    match kind {
        BackendKind::Sqlite => "SQLite",
        BackendKind::Postgres => "PostgreSQL",
    }
}

/// Flushes the machine's dirty pages (`sync`), so that what the previous
/// phase wrote is not written back during, and charged to, the next phase's
/// fsyncs; on PostgreSQL first has the server finish the aftermath of the
/// previous phase's bulk writes, which `sync` cannot reach: `VACUUM
/// (ANALYZE)`, the work autovacuum would otherwise start on `events` in the
/// first seconds of the next phase (the server log of a run shows it
/// starting at the end of the 10^6-event build; the read phase's stalls of
/// 250–330 ms are suspected to be that vacuum's I/O beside a checkpoint's
/// on these machines' slow disks), then `CHECKPOINT` (the checkpoint that
/// build started ran into the read phase). A long-lived store is vacuumed
/// each time it grows by a fifth, beside its traffic; only a bench loads a
/// million events and reads in the next second. Best
/// effort: without a `sync` program, or without the right to `CHECKPOINT`
/// (a superuser's or `pg_checkpoint`'s), that step is skipped.
async fn settle(kind: BackendKind, url: &str) {
    if kind == BackendKind::Postgres {
        if let Err(e) = admin_sql(url, "VACUUM (ANALYZE)").await {
            tracing::warn!(cause = %e, "VACUUM before a bench phase failed; going on without it");
        }
        if let Err(e) = admin_sql(url, "CHECKPOINT").await {
            tracing::warn!(cause = %e, "CHECKPOINT before a bench phase failed; going on without it");
        }
    }
    let _ = tokio::task::spawn_blocking(|| {
        std::process::Command::new("sync")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
    })
    .await;
}

/// Runs one phase in a child process of this binary (after [`settle`]).
async fn child(kind: BackendKind, spec: PhaseSpec) -> Result<PhaseOutput, BenchError> {
    let failed = |detail: String| BenchError::Phase {
        phase: spec.phase.name().to_owned(),
        backend: backend_name(kind).to_owned(),
        detail,
    };
    let exe = std::env::current_exe()
        .map_err(|e| failed(format!("cannot find this program's own binary: {e}")))?;
    let arg = serde_json::to_string(&spec)
        .map_err(|e| failed(format!("cannot encode the phase: {e}")))?;
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .arg("bench-phase")
            .arg(arg)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .output()
    })
    .await
    .map_err(|e| failed(e.to_string()))?
    .map_err(|e| failed(format!("cannot start the child process: {e}")))?;
    if !output.status.success() {
        return Err(failed(format!(
            "the child process exited with {}",
            output.status
        )));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    serde_json::from_str(line)
        .map_err(|e| failed(format!("its report is unreadable ({e}): {line:?}")))
}

fn decode<T: serde::de::DeserializeOwned>(
    kind: BackendKind,
    phase: Phase,
    out: &PhaseOutput,
) -> Result<T, BenchError> {
    serde_json::from_value(out.result.clone()).map_err(|e| BenchError::Phase {
        phase: phase.name().to_owned(),
        backend: backend_name(kind).to_owned(),
        detail: format!("its result is unreadable: {e}"),
    })
}

/// The durability the figures were measured with, as the database says it
/// (a `--postgres-url` server may run with `fsync` off).
async fn durability(kind: BackendKind, url: &str) -> Result<String, BenchError> {
    match kind {
        BackendKind::Sqlite => {
            // Read back from a connection with the settings both the store
            // and the ceiling use, not restated.
            use sqlx::{ConnectOptions, Connection};
            let mut conn = crate::store::sqlite::connect_options(url)?
                .connect()
                .await
                .map_err(Error::from_sqlx)?;
            let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
                .fetch_one(&mut conn)
                .await
                .map_err(Error::from_sqlx)?;
            let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
                .fetch_one(&mut conn)
                .await
                .map_err(Error::from_sqlx)?;
            let _ = conn.close().await;
            let synchronous = match synchronous {
                0 => "OFF",
                1 => "NORMAL",
                2 => "FULL",
                3 => "EXTRA",
                _ => "unknown",
            };
            Ok(format!(
                "journal_mode={journal}, synchronous={synchronous} (read from a connection with the store's settings, which the ceiling uses too)"
            ))
        }
        BackendKind::Postgres => {
            use sqlx::{ConnectOptions, Connection};
            let mut conn = crate::store::postgres::ceiling_connect_options(url)?
                .connect()
                .await
                .map_err(Error::from_sqlx)?;
            let (version, fsync, commit): (String, String, String) = sqlx::query_as(
                "SELECT current_setting('server_version'), current_setting('fsync'), \
                 current_setting('synchronous_commit')",
            )
            .fetch_one(&mut conn)
            .await
            .map_err(Error::from_sqlx)?;
            let _ = conn.close().await;
            Ok(format!(
                "PostgreSQL {version}, fsync={fsync}, synchronous_commit={commit} (read from the server)"
            ))
        }
    }
}

/// Measures one backend, each phase in a child process.
async fn measure(
    kind: BackendKind,
    dbs: &Databases,
    quick: bool,
    server: Option<&PgServer>,
) -> Result<BackendReport, BenchError> {
    let name = backend_name(kind);
    let mut memory = Vec::new();
    let cold_done = std::cell::Cell::new(recovery::Cold::default());
    let cold_done = &cold_done;
    let run = |phase: Phase, url: &str, built: Vec<latency::Built>| {
        let spec = PhaseSpec {
            phase,
            url: url.to_owned(),
            quick,
            built,
        };
        eprintln!("{name}: {} phase", phase.name());
        async move {
            settle(kind, &spec.url).await;
            if phase == Phase::Recover {
                // After the settling, whose VACUUM would read the tables
                // back into the caches.
                let cold = recovery::chill(server, !quick)?;
                eprintln!("{name}: before the first open: {}", cold.describe());
                cold_done.set(cold);
            }
            let out = child(kind, spec).await?;
            Ok::<_, BenchError>((phase, out))
        }
    };
    let mut record = |phase: Phase, out: &PhaseOutput| {
        memory.push(PhaseMemory {
            phase: phase.name().to_owned(),
            peak_rss_mib: out.peak_rss_kib.map(|k| k as f64 / 1024.0),
            end_rss_mib: out.rss_kib.map(|k| k as f64 / 1024.0),
            seconds: out.seconds,
        });
    };
    let (p, out) = run(Phase::Idle, &dbs.append_url, vec![]).await?;
    record(p, &out);
    let (p, out) = run(Phase::Append, &dbs.append_url, vec![]).await?;
    record(p, &out);
    let append: append::AppendResult = decode(kind, p, &out)?;
    let (p, out) = run(Phase::Build, &dbs.sessions_url, vec![]).await?;
    record(p, &out);
    let built: Vec<latency::Built> = decode(kind, p, &out)?;
    let (p, out) = run(Phase::Read, &dbs.sessions_url, built.clone()).await?;
    record(p, &out);
    let reads: Vec<latency::Read> = decode(kind, p, &out)?;
    let (p, out) = run(Phase::Fold, &dbs.sessions_url, built.clone()).await?;
    record(p, &out);
    let folds: Vec<latency::Fold> = decode(kind, p, &out)?;
    let (p, out) = run(Phase::Recover, &dbs.sessions_url, built.clone()).await?;
    record(p, &out);
    let mut recover: recovery::Recover = decode(kind, p, &out)?;
    recover.cold = cold_done.get();
    let (p, out) = run(Phase::Rebuild, &dbs.sessions_url, vec![]).await?;
    record(p, &out);
    let rebuild: recovery::Rebuild = decode(kind, p, &out)?;

    let smallest = reads.first().map(|r| r.pre_request.p50_ms).unwrap_or(0.0);
    let latency: Vec<LatencyRow> = reads
        .iter()
        .map(|r| {
            let (fold, store_fold) = folds
                .iter()
                .find(|f| f.size == r.size)
                .map(|f| (f.fold, f.store_fold))
                .unwrap_or_default();
            LatencyRow {
                size: r.size,
                events: r.events,
                window_events: r.window_events,
                context_bytes: r.context_bytes,
                pre_request: r.pre_request,
                activations_only: r.activations_only,
                next_append: r.next_append,
                naive_fold: fold,
                store_fold,
                fold_over_read: fold.p50_ms / r.pre_request.p50_ms.max(f64::MIN_POSITIVE),
                read_vs_smallest: r.pre_request.p50_ms / smallest.max(f64::MIN_POSITIVE),
            }
        })
        .collect();
    let target_ms = latency::p99_target_ms(kind);
    let largest = latency.last();
    let latency_target = LatencyTarget {
        p99_ms: target_ms,
        at_events: 1_000_000,
        largest_events: largest.map(|l| l.events).unwrap_or(0),
        p99_ms_at_largest: largest.map(|l| l.pre_request.p99_ms).unwrap_or(0.0),
        met: largest
            .filter(|l| l.size >= 1_000_000)
            .map(|l| l.pre_request.p99_ms < target_ms),
    };
    Ok(BackendReport {
        backend: match kind {
            BackendKind::Sqlite => "sqlite",
            BackendKind::Postgres => "postgres",
        }
        .to_owned(),
        name: name.to_owned(),
        durability: durability(kind, &dbs.append_url).await?,
        append,
        build: built,
        latency,
        latency_target,
        recover,
        rebuild,
        memory,
    })
}

/// Runs the bench (the parent side): every phase of every backend, then the
/// table on `out`, the JSON report and the SVG plot.
/// What `bench` does in a build without optimizations (`cargo run`
/// without `--release`): its figures are an unoptimized store's beside a
/// ceiling that does far less of the unoptimized code (a read p99 of 22 ms
/// instead of 1.6, batch ratios of 0.26-0.55 in a `--quick` run measured
/// so), so they say nothing about the targets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unoptimized {
    /// A full run, which would take its ten minutes to mislead: refused.
    Refused(String),
    /// A `--quick` run (the CI smoke test, which runs the test build):
    /// run, with this said first.
    Warned(String),
}

/// Whether a run (`quick` or full) in a build with or without
/// `debug_assertions` (the proxy for an unoptimized build) is refused or
/// warned about; `None` for an optimized build.
pub fn unoptimized_build(quick: bool, debug: bool) -> Option<Unoptimized> {
    const FIX: &str = "build with optimizations: `cargo run --release -- bench …`, or `target/release/session-store bench …`";
    match (debug, quick) {
        (false, _) => None,
        (true, false) => Some(Unoptimized::Refused(format!(
            "this session-store is a debug build, without optimizations: a full bench of it would measure an unoptimized store, about ten times slower than the store, against ceilings that barely run its code; {FIX}"
        ))),
        (true, true) => Some(Unoptimized::Warned(format!(
            "this session-store is a debug build, without optimizations: this --quick run shows that the bench works, but its figures are not the store's; {FIX}"
        ))),
    }
}

pub async fn run(config: &BenchConfig, out: &mut dyn std::io::Write) -> Result<Report, BenchError> {
    let started = Instant::now();
    let started_at = chrono::Utc::now();
    let mut backends = Vec::new();
    for kind in &config.backends {
        // Each backend's databases are removed before the next backend
        // starts: deleting a file drops its dirty pages, which would
        // otherwise be written back during, and slow down, the next
        // backend's fsyncs.
        let mut scratch = Scratch::new();
        let result = async {
            let dbs = match kind {
                BackendKind::Sqlite => scratch.sqlite(config.dir.as_deref())?,
                BackendKind::Postgres => scratch.postgres(config.postgres_url.as_deref()).await?,
            };
            measure(*kind, &dbs, config.quick, scratch.pg_server.as_ref()).await
        }
        .await;
        scratch.clean().await;
        backends.push(result?);
    }
    let report = Report {
        version: 1,
        command: config.command.clone(),
        quick: config.quick,
        build: Some(
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .to_owned(),
        ),
        started_at,
        seconds: started.elapsed().as_secs_f64(),
        machine: Machine::this(),
        mix: workload::MixSummary::sample(Arc::new(workload::TextPool::new()), 20_000),
        backends,
    };
    let write_failed = |what: &Path, e: std::io::Error| {
        BenchError::Setup(format!("cannot write {}: {e}", what.display()))
    };
    report::write_tables(&report, out).map_err(|e| write_failed(Path::new("the table"), e))?;
    for path in [&config.out, &config.svg] {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| write_failed(parent, e))?;
        }
    }
    let json = serde_json::to_string_pretty(&report)
        .map_err(|e| BenchError::Setup(format!("cannot encode the report: {e}")))?;
    std::fs::write(&config.out, json + "\n").map_err(|e| write_failed(&config.out, e))?;
    plot::latency_svg(&report, &config.svg).map_err(BenchError::Setup)?;
    writeln!(
        out,
        "\nreport: {}; plot: {}; {:.0} s in all",
        config.out.display(),
        config.svg.display(),
        report.seconds
    )
    .map_err(|e| write_failed(Path::new("the table"), e))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a debug build is refused (a full run) or warned about (a quick
    /// one); an optimized build runs either without a word.
    /// The bench's databases are named in the admin URL's place, its
    /// options kept, whether or not it names a database.
    #[test]
    fn a_bench_database_replaces_the_admin_urls_database() {
        for (admin, expected) in [
            ("postgres://u:p@h:5432/postgres", "postgres://u:p@h:5432/b1"),
            ("postgres://localhost", "postgres://localhost/b1"),
            ("postgres://localhost/", "postgres://localhost/b1"),
            (
                "postgresql://h/db?sslmode=require&host=/run/pg",
                "postgresql://h/b1?sslmode=require&host=/run/pg",
            ),
        ] {
            assert_eq!(database_url(admin, "b1").unwrap(), expected, "{admin}");
        }
        let Err(BenchError::Setup(said)) = database_url("localhost:5432/db", "b1") else {
            panic!("a URL without a scheme is refused");
        };
        assert!(said.contains("not a postgres:// URL"), "{said}");
    }

    #[test]
    fn an_unoptimized_build_is_refused_a_full_run_and_warned_on_a_quick_one() {
        assert_eq!(unoptimized_build(false, false), None);
        assert_eq!(unoptimized_build(true, false), None);
        let Some(Unoptimized::Refused(why)) = unoptimized_build(false, true) else {
            panic!("a full run of a debug build is refused");
        };
        assert!(why.contains("--release"), "{why}");
        let Some(Unoptimized::Warned(why)) = unoptimized_build(true, true) else {
            panic!("a quick run of a debug build is warned about");
        };
        assert!(why.contains("--release"), "{why}");
    }
}
