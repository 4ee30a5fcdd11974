//! Prints the markdown tables of a `session-store bench` JSON report
//! (`cargo run --example bench_tables -- REPORT.json [PLOT.svg]`), as
//! `bench` printed them when it ran: for docs/benchmarks.md from a
//! committed report. With a second path, draws the report's plot there
//! again (after a change to how the plot is drawn).

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: bench_tables REPORT.json [PLOT.svg]");
    let text = std::fs::read_to_string(&path).expect("read the report");
    let report: session_store::bench::report::Report =
        serde_json::from_str(&text).expect("a bench report");
    session_store::bench::report::write_tables(&report, &mut std::io::stdout())
        .expect("write the tables");
    if let Some(svg) = args.next() {
        session_store::bench::plot::latency_svg(&report, std::path::Path::new(&svg))
            .expect("draw the plot");
    }
}
