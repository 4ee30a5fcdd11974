//! Prints the markdown tables of a `session-store bench` JSON report
//! (`cargo run --example bench_tables -- REPORT.json`), as `bench` printed
//! them when it ran: for docs/benchmarks.md from a committed report.

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: bench_tables REPORT.json");
    let text = std::fs::read_to_string(&path).expect("read the report");
    let report: session_store::bench::report::Report =
        serde_json::from_str(&text).expect("a bench report");
    session_store::bench::report::write_tables(&report, &mut std::io::stdout())
        .expect("write the tables");
}
