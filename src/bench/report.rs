//! The bench's report: the JSON written to `--out` and the markdown tables
//! printed (and pasted into docs/benchmarks.md). Each comparison is a ratio
//! of two figures of the same run, printed beside its target.

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::append::AppendResult;
use super::latency::Built;
use super::recovery::{Rebuild, Recover};
use super::stats::{Latency, Spread};
use super::workload::MixSummary;

/// The whole report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The report format's version.
    pub version: u32,
    /// The command line that produced it.
    pub command: String,
    /// Whether it was a `--quick` run.
    pub quick: bool,
    /// `release` (optimized) or `debug` (`cargo run` without `--release`,
    /// whose figures are not the store's: [`super::unoptimized_build`]);
    /// absent from reports written before it was recorded, all of release
    /// builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
    /// When the run started.
    pub started_at: DateTime<Utc>,
    /// How long the run took, seconds.
    pub seconds: f64,
    /// Where it ran.
    pub machine: Machine,
    /// What the events were made of.
    pub mix: MixSummary,
    /// One entry per backend.
    pub backends: Vec<BackendReport>,
}

/// The machine.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Machine {
    /// CPUs available to the process.
    pub cpus: usize,
    /// Physical memory, GiB (Linux only).
    pub memory_gib: Option<f64>,
    /// The CPU model (Linux only).
    pub cpu_model: Option<String>,
    /// The operating system.
    pub os: String,
}

impl Machine {
    /// This machine.
    pub fn this() -> Machine {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_gib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map(|kib| (kib / 1024.0 / 1024.0 * 10.0).round() / 10.0);
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_owned());
        Machine {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory_gib,
            cpu_model,
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        }
    }
}

/// One backend's figures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendReport {
    /// `sqlite` or `postgres`.
    pub backend: String,
    /// `SQLite` or `PostgreSQL`.
    pub name: String,
    /// The durability settings of the store and of its ceiling.
    pub durability: String,
    /// Phase 1.
    pub append: AppendResult,
    /// The long sessions and how fast they were written.
    pub build: Vec<Built>,
    /// Phase 2, one row per size.
    pub latency: Vec<LatencyRow>,
    /// Phase 2's target.
    pub latency_target: LatencyTarget,
    /// Phase 3: open + recover.
    pub recover: Recover,
    /// Phase 3: rebuild.
    pub rebuild: Rebuild,
    /// Phase 4: peak RSS of each phase's process.
    pub memory: Vec<PhaseMemory>,
}

/// The pre-request read and the naive fold at one size.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LatencyRow {
    /// The nominal size.
    pub size: u64,
    /// The session's events.
    pub events: i64,
    /// Events from the context's start to the latest.
    pub window_events: i64,
    /// JSON bytes of the context's rows.
    pub context_bytes: usize,
    /// Activations + context, the store's cache emptied before each.
    pub pre_request: Latency,
    /// Activations alone, the store's cache emptied before each.
    pub activations_only: Latency,
    /// One prompt appended after the reads, cache warm.
    pub next_append: Latency,
    /// The naive fold: the session's JSON-lines file read, parsed and
    /// folded (reports before 2026-12-05 12:00 UTC: the store's fold).
    pub naive_fold: Latency,
    /// The store's fold of its whole log (absent from older reports).
    #[serde(default)]
    pub store_fold: Latency,
    /// Fold p50 / read p50.
    pub fold_over_read: f64,
    /// Read p50 / read p50 at the smallest size.
    pub read_vs_smallest: f64,
}

/// The p99 target of the pre-request read.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LatencyTarget {
    /// The target, ms.
    pub p99_ms: f64,
    /// At this many events.
    pub at_events: i64,
    /// The largest session measured.
    pub largest_events: i64,
    /// Its p99, ms.
    pub p99_ms_at_largest: f64,
    /// Whether the target is met; `None` when 10^6 events were not measured
    /// (`--quick`).
    pub met: Option<bool>,
}

/// The memory of one phase's process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PhaseMemory {
    /// The phase.
    pub phase: String,
    /// `VmHWM`, MiB.
    pub peak_rss_mib: Option<f64>,
    /// `VmRSS` at the end, MiB.
    pub end_rss_mib: Option<f64>,
    /// Seconds the phase took.
    pub seconds: f64,
}

fn rate(v: f64) -> String {
    if v >= 100.0 {
        format!("{:.0}", v)
    } else {
        format!("{:.1}", v)
    }
}

fn spread(s: &Spread) -> String {
    format!("{} ({}–{})", rate(s.median), rate(s.min), rate(s.max))
}

fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn yes(met: bool) -> &'static str {
    if met {
        "yes"
    } else {
        "**no**"
    }
}

fn mib(v: Option<f64>) -> String {
    v.map(|m| format!("{m:.0}"))
        .unwrap_or_else(|| "–".to_owned())
}

/// Prints the report as markdown tables.
pub fn write_tables(r: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "\n## Machine\n\n{} CPUs, {} GiB, {}{}; {} run; average event {:.0} bytes of JSON",
        r.machine.cpus,
        r.machine
            .memory_gib
            .map(|m| format!("{m:.1}"))
            .unwrap_or_else(|| "?".into()),
        r.machine.os,
        r.machine
            .cpu_model
            .as_ref()
            .map(|m| format!(", {m}"))
            .unwrap_or_default(),
        if r.quick { "a --quick" } else { "a full" },
        r.mix.average_event_bytes
    )?;
    if r.build.as_deref() == Some("debug") {
        writeln!(
            out,
            "\n**A debug build, without optimizations: these figures are not the store's** (build with `--release`)."
        )?;
    }

    writeln!(out, "\n## Append throughput (events/s, median (min–max) of {} repeats; ratio = store / ceiling)\n",
        r.backends.first().map(|b| b.append.plan.repeats).unwrap_or(0))?;
    writeln!(
        out,
        "The ceiling is raw multi-row INSERTs of the same rows: a statement per batch (`each`), or, with several writers, the batches queued meanwhile in one transaction (`grouped`, as the store commits), whichever is faster."
    )?;
    if r.quick {
        writeln!(
            out,
            "A --quick run measures each repeat for {} s: its ratios are a smoke test, not a verdict on the targets, so none is judged.",
            r.backends.first().map(|b| b.append.plan.seconds).unwrap_or(0.0)
        )?;
    }
    writeln!(
        out,
        "\n| backend | sessions | writers | batch | store | ceiling (raw INSERT) | ratio | target | met |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---|")?;
    for b in &r.backends {
        for c in &b.append.cells {
            writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {} |",
                b.name,
                c.sessions,
                c.writers,
                c.batch,
                spread(&c.store),
                match c.ceiling_kind.as_str() {
                    "" => spread(&c.ceiling),
                    kind => format!("{} {kind}", spread(&c.ceiling)),
                },
                c.ratio,
                c.target,
                match r.quick {
                    true => "–",
                    false => yes(c.meets_target),
                }
            )?;
        }
    }

    writeln!(
        out,
        "\n## Pre-request latency (activations + context, the store's cache emptied) and the naive fold, ms\n"
    )?;
    writeln!(
        out,
        "| backend | events | window | read p50 | read p99 | vs smallest | naive fold (JSONL) p50 (runs) | fold / read | store's full fold p50 | p99 target | next append p50 / p99 |"
    )?;
    writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"
    )?;
    for b in &r.backends {
        for l in &b.latency {
            let target = if l.size >= b.latency_target.at_events as u64 {
                format!(
                    "< {} ms: {}",
                    b.latency_target.p99_ms,
                    yes(l.pre_request.p99_ms < b.latency_target.p99_ms)
                )
            } else {
                String::new()
            };
            writeln!(
                out,
                "| {} | {} | {} | {} | {} | {:.2}x | {} ({}) | {:.0}x | {} | {} | {} / {} |",
                b.name,
                l.events,
                l.window_events,
                ms(l.pre_request.p50_ms),
                ms(l.pre_request.p99_ms),
                l.read_vs_smallest,
                ms(l.naive_fold.p50_ms),
                l.naive_fold.n,
                l.fold_over_read,
                match l.store_fold.n {
                    0 => "–".to_owned(),
                    _ => ms(l.store_fold.p50_ms),
                },
                target,
                ms(l.next_append.p50_ms),
                ms(l.next_append.p99_ms)
            )?;
        }
    }

    writeln!(
        out,
        "\n## Building the sessions (appends of 1 000 events)\n"
    )?;
    writeln!(out, "| backend | events | seconds | events/s |")?;
    writeln!(out, "|---|---:|---:|---:|")?;
    for b in &r.backends {
        for s in &b.build {
            writeln!(
                out,
                "| {} | {} | {:.1} | {:.0} |",
                b.name, s.events, s.seconds, s.events_per_s
            )?;
        }
    }

    writeln!(out, "\n## Recovery\n")?;
    writeln!(
        out,
        "| backend | session events | open + recover, first (recover alone) ms | first open was cold: | open + recover p50 / max ms | rebuild: sessions, events | rebuild events/s, median (min–max) of runs |"
    )?;
    writeln!(out, "|---|---:|---:|---|---:|---:|---:|")?;
    for b in &r.backends {
        writeln!(
            out,
            "| {} | {} | {} ({}) | {} | {} / {} | {}, {} | {} of {} |",
            b.name,
            b.recover.events,
            ms(b.recover.first_open_and_recover_ms),
            ms(b.recover.first_recover_ms),
            b.recover.cold.describe(),
            ms(b.recover.open_and_recover.p50_ms),
            ms(b.recover.open_and_recover.max_ms),
            b.rebuild.sessions,
            b.rebuild.events,
            match b.rebuild.runs.n {
                0 => format!("{:.0}", b.rebuild.events_per_s),
                _ => spread(&b.rebuild.runs),
            },
            b.rebuild.runs.n.max(1)
        )?;
    }

    writeln!(out, "\n## Memory (peak RSS of each phase's process, MiB)\n")?;
    let phases: Vec<&str> = r
        .backends
        .first()
        .map(|b| b.memory.iter().map(|m| m.phase.as_str()).collect())
        .unwrap_or_default();
    writeln!(out, "| backend | {} |", phases.join(" | "))?;
    writeln!(out, "|---|{}", "---:|".repeat(phases.len()))?;
    for b in &r.backends {
        let cells: Vec<String> = b.memory.iter().map(|m| mib(m.peak_rss_mib)).collect();
        writeln!(out, "| {} | {} |", b.name, cells.join(" | "))?;
    }
    Ok(())
}
