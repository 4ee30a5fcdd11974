//! `session-store bench --quick` as a smoke test: it runs, and its JSON
//! report has every section with positive figures. No figure is compared
//! with a target here: a shared CI machine says nothing about the targets,
//! and docs/benchmarks.md is where they are judged.

mod common;

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_session-store");

/// The report of a `--quick` run, and what it said on stderr.
fn run_bench(backend: &str, dir: &Path, extra: &[&str]) -> (Value, String) {
    let out = dir.join("report.json");
    let output = Command::new(BIN)
        .args(["bench", "--quick", "--backend", backend, "--out"])
        .arg(&out)
        .args(extra)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run session-store bench");
    assert!(
        output.status.success(),
        "bench failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8_lossy(&output.stdout);
    for heading in [
        "Append throughput",
        "Pre-request latency",
        "Recovery",
        "Memory",
    ] {
        assert!(
            table.contains(heading),
            "the table has no {heading:?} section"
        );
    }
    let svg = std::fs::read_to_string(dir.join("bench-latency.svg")).expect("the SVG plot");
    assert!(svg.starts_with("<svg"), "the plot is an SVG document");
    let report =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("the report")).expect("JSON");
    (report, String::from_utf8_lossy(&output.stderr).into_owned())
}

/// The build this test's binary is (the tests and the binary are built
/// with one profile).
const BUILD: &str = if cfg!(debug_assertions) {
    "debug"
} else {
    "release"
};

fn positive(v: &Value, path: &str) {
    let mut at = v;
    for key in path.split('.') {
        at = match key.parse::<usize>() {
            Ok(i) => &at[i],
            Err(_) => &at[key],
        };
    }
    let n = at
        .as_f64()
        .unwrap_or_else(|| panic!("{path} is not a number: {at}"));
    assert!(n > 0.0, "{path} is {n}, not positive");
}

fn check_backend(report: &Value, name: &str) {
    let backends = report["backends"].as_array().expect("backends");
    let b = backends
        .iter()
        .find(|b| b["backend"] == name)
        .unwrap_or_else(|| panic!("no {name} section"));
    let cells = b["append"]["cells"].as_array().expect("append cells");
    // 3 batch sizes x 1, 4, 16 writers x distinct and shared sessions.
    assert_eq!(cells.len(), 18, "every cell of the append grid");
    for (i, _) in cells.iter().enumerate() {
        for field in [
            "store.median",
            "store.max",
            "ceiling.median",
            "ratio",
            "target",
        ] {
            positive(b, &format!("append.cells.{i}.{field}"));
        }
    }
    assert!(cells.iter().any(|c| c["sessions"] == "shared"));
    let latency = b["latency"].as_array().expect("latency rows");
    assert_eq!(latency.len(), 2, "--quick measures 10^3 and 10^4 events");
    for (i, _) in latency.iter().enumerate() {
        for field in [
            "events",
            "window_events",
            "pre_request.p50_ms",
            "pre_request.p99_ms",
            "naive_fold.p50_ms",
            "fold_over_read",
        ] {
            positive(b, &format!("latency.{i}.{field}"));
        }
    }
    assert!(
        b["latency_target"]["met"].is_null(),
        "10^6 was not measured"
    );
    for field in [
        "recover.events",
        "recover.first_open_and_recover_ms",
        "recover.open_and_recover.p50_ms",
        "rebuild.events",
        "rebuild.events_per_s",
        "build.1.events_per_s",
    ] {
        positive(b, field);
    }
    let phases: Vec<&str> = b["memory"]
        .as_array()
        .expect("memory")
        .iter()
        .map(|m| m["phase"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        phases,
        ["idle", "append", "build", "read", "fold", "recover", "rebuild"]
    );
    if cfg!(target_os = "linux") {
        for i in 0..phases.len() {
            positive(b, &format!("memory.{i}.peak_rss_mib"));
        }
    }
}

#[test]
fn quick_bench_on_sqlite_writes_every_section() {
    let dir = tempfile::tempdir().unwrap();
    let (report, stderr) = run_bench(
        "sqlite",
        dir.path(),
        &["--dir", &dir.path().display().to_string()],
    );
    assert_eq!(report["quick"], true);
    // The report says which build measured it, and a debug build's run
    // says first that its figures are not the store's.
    assert_eq!(report["build"], BUILD, "{}", report["build"]);
    assert_eq!(
        stderr.contains("is a debug build, without optimizations"),
        BUILD == "debug",
        "{stderr}"
    );
    positive(&report, "machine.cpus");
    positive(&report, "mix.average_event_bytes");
    check_backend(&report, "sqlite");
    // A smoke test leaves the machine's page cache alone (only a full run
    // drops it), and SQLite has no server to restart.
    let cold = &report["backends"][0]["recover"]["cold"];
    assert_eq!(cold["page_cache_dropped"], false, "{cold}");
    assert_eq!(cold["server_restarted"], false, "{cold}");
}

#[test]
fn quick_bench_on_postgres_writes_every_section() {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = Vec::new();
    if let Ok(url) = std::env::var("TEST_DATABASE_URL") {
        extra.push("--postgres-url".to_owned());
        extra.push(url);
    } else if common::pg_bin().is_none() {
        return;
    }
    let own_server = extra.is_empty();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let (report, _) = run_bench("postgres", dir.path(), &extra);
    check_backend(&report, "postgres");
    // The bench restarts only a server it started itself, before the
    // recover phase, and the phases after it ran on the restarted server.
    let cold = &report["backends"][0]["recover"]["cold"];
    assert_eq!(cold["server_restarted"], own_server, "{cold}");
    assert_eq!(cold["page_cache_dropped"], false, "{cold}");
}

/// A full run of a debug build would take its ten minutes to measure an
/// unoptimized store: it is refused at once, with the command that works,
/// and writes no report. (A release build's full run is the bench itself;
/// `bench::unoptimized_build`'s unit test covers that it is not refused.)
#[cfg(debug_assertions)]
#[test]
fn a_full_bench_of_a_debug_build_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report.json");
    let started = std::time::Instant::now();
    let output = Command::new(BIN)
        .args(["bench", "--backend", "sqlite", "--out"])
        .arg(&out)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run session-store bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("debug build"), "{stderr}");
    assert!(stderr.contains("cargo run --release -- bench"), "{stderr}");
    assert!(!out.exists(), "no report is written");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}
