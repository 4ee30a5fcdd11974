//! The `session-store` binary: parse arguments, set up tracing, run the
//! command, map its error to an exit code (0 ok, 1 invalid input or not
//! found, 2 usage, 3 conflict, 4 storage unavailable).

use std::io::Write;

use clap::Parser;
use session_store::cli::{run, Cli};

/// mimalloc rather than the system's allocator: a pre-request read decodes
/// a window of events into many small JSON values and frees them, and
/// glibc's malloc and free were a quarter of its time (`perf`); with
/// mimalloc its median fell by about a quarter (docs/benchmarks.md, item
/// 41). Only the binary's choice: the library leaves the allocator to the
/// program that embeds it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let cli = Cli::parse();
    // sqlx's own warnings (a pooled connection that failed its test on
    // release or before an acquire, a slow acquire) are the driver's
    // internals, in its words: left out by default, for `serve` too. What
    // they come to for a request, the store says itself: `serve` logs a
    // storage failure once a period with how many answers met it
    // (server/error.rs), and a one-shot command's outcome is its one
    // sentence on stderr. (An operability review, 2026-12-07, read three
    // such lines per PostgreSQL restart as noise.) PostgreSQL's own
    // warnings to the client (a database nearing transaction-ID
    // wraparound, a server shutting down) are kept for `serve`, whose log
    // is an operator's; a one-shot command's stderr stays its one
    // sentence. Slow-statement warnings quote the store's SQL.
    let default_filter = match cli.command {
        session_store::cli::Command::Serve(_) => "warn,sqlx=error,sqlx::postgres::notice=warn",
        _ => "warn,sqlx=error",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal: a log file or a
        // collector gets plain text, not escape codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("session-store: cannot start the async runtime: {e}");
            std::process::exit(4);
        }
    };
    let stdout = std::io::stdout();
    let mut out = session_store::cli::Printable::new(stdout.lock());
    let code = match runtime.block_on(run(cli, &mut out)) {
        Ok(()) => 0,
        Err(session_store::cli::CliError::OutputClosed) => 0,
        Err(e) => {
            // Through the same filter as standard output: a message may
            // quote what the input held (a type, a tool name), and a DEL
            // or C1 character in it must not reach the terminal raw.
            let mut err = session_store::cli::Printable::new(std::io::stderr().lock());
            let _ = writeln!(err, "session-store: {e}");
            drop(err);
            e.exit_code()
        }
    };
    drop(out);
    std::process::exit(code);
}
