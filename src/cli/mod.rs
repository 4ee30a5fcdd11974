//! The command line: parses flags into typed commands (clap) and drives the
//! [`Store`]. Every command that answers a question prints machine-readable
//! output with `--json` (the SEMANTICS §9 shapes) and a readable table
//! otherwise (`import`, `migrate` and `rebuild` say what they did); errors
//! are returned as [`CliError`] and mapped to exit codes by `main`.

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::path::PathBuf;

use clap::builder::TypedValueParser as _;
use clap::{Parser, Subcommand};
use tracing::{info, warn};
use uuid::Uuid;

use crate::audit::{reason_text, At, Explanation, Reason, Refresh};
use crate::error::{Error, Rule, ValidationError};
use crate::event::{parse_line, EventBody, LineKind, NewEvent, ParsedLine};
use crate::projector::{Activations, Context, ContextRow};
use crate::store::query::{AnomalyKind, AnomalyQuery, ChangeQuery, EventQuery, Scope};
use crate::store::{RetryPolicy, Store, StoreOptions};
use crate::validate::DEFAULT_MAX_EVENT_BYTES;

mod import;
mod target;

use import::import_piped;
use import::{at_line, open_input, parse_input_line};
pub use import::{import, import_pi, ImportSummary, InputLines, PiSpool, IMPORT_IDLE};
use target::WriteTarget;

/// Event-sourced session store for AI agent sidecars.
#[derive(Debug, Parser)]
#[command(
    name = "session-store",
    version,
    about,
    after_help = "Exit codes: 0 ok; 1 invalid input, not found, no session store at --database, or input or output that cannot be read or written; 2 usage (a bad flag or value); 3 conflict (the session is not at --expected-seq); 4 storage unavailable or failing; 5 verify found a view that disagrees with the log; 130 and 143 an import stopped by SIGINT or SIGTERM, saying what it stored."
)]
pub struct Cli {
    /// Database: a SQLite file path (or sqlite://PATH) or postgres://…
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "session-store.db",
        global = true
    )]
    pub database: String,

    /// Largest accepted event, in bytes of JSON text (at least 1).
    #[arg(long, default_value_t = DEFAULT_MAX_EVENT_BYTES, global = true,
          value_parser = parse_max_event_bytes)]
    pub max_event_bytes: usize,

    /// Seconds one round trip to a PostgreSQL store may take before the
    /// command exits 4 (under `serve`, before the request answers 503
    /// `unavailable`): a server that stops answering is said, not waited
    /// on without end. Long commands (verify, export, rebuild) make many
    /// round trips, each bounded.
    #[arg(long, default_value = "30", global = true, value_parser = parse_seconds)]
    pub read_timeout: std::time::Duration,

    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// `--max-event-bytes`: a limit of 0 would refuse every event.
fn parse_max_event_bytes(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1 (bytes of JSON per event)".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}")),
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the schema (also done on every open).
    Migrate,
    /// Append JSON lines (each with session_id), each at its session's head;
    /// or, with `--format pi`, a pi coding agent session file as one session
    /// (docs/pi-import.md).
    Import {
        /// What the file holds.
        #[arg(long, value_enum, default_value_t = ImportFormat::Jsonl)]
        format: ImportFormat,
        /// The file; standard input without it or with `-`.
        file: Option<PathBuf>,
        /// Write on behalf of TENANT (a tenant of the HTTP API's tokens,
        /// docs/api.md): the sessions this creates are claimed for it, so
        /// that its tokens see them, and a session another tenant owns is
        /// refused (exit 1). Without it the writes are the operator's,
        /// neither checked nor claimed: their new sessions are the tenant
        /// `default`'s. How a store moves with its tenants:
        /// docs/operations.md.
        #[arg(long, value_parser = parse_tenant)]
        tenant: Option<String>,

        /// Seconds one write (a batch) may take before the command exits 4
        /// saying it could not be confirmed stored: a database that stops
        /// answering is said, not waited on without end.
        #[arg(long, default_value = "30", value_parser = parse_seconds)]
        write_timeout: std::time::Duration,
    },
    /// Append one atomic batch of JSON lines to SESSION.
    Append {
        /// The session's UUID.
        session: String,
        /// The seq the writer last saw (0 for a new session).
        #[arg(long, allow_negative_numbers = true, value_parser = parse_at_least_0)]
        expected_seq: i64,
        /// The JSON-lines file; standard input without it or with `-`.
        file: Option<PathBuf>,
        /// Write on behalf of TENANT (a tenant of the HTTP API's tokens,
        /// docs/api.md): the sessions this creates are claimed for it, so
        /// that its tokens see them, and a session another tenant owns is
        /// refused (exit 1). Without it the writes are the operator's,
        /// neither checked nor claimed: their new sessions are the tenant
        /// `default`'s. How a store moves with its tenants:
        /// docs/operations.md.
        #[arg(long, value_parser = parse_tenant)]
        tenant: Option<String>,
        /// Seconds one write (a batch) may take before the command exits 4
        /// saying it could not be confirmed stored: a database that stops
        /// answering is said, not waited on without end.
        #[arg(long, default_value = "30", value_parser = parse_seconds)]
        write_timeout: std::time::Duration,
        /// Most events the batch may hold (it is judged and written in
        /// memory, as one transaction); more exit 1 with nothing stored.
        /// `import` stores long inputs in runs instead.
        #[arg(long, default_value_t = crate::server::DEFAULT_MAX_BATCH_EVENTS as u32, value_parser = clap::value_parser!(u32).range(1..))]
        max_batch_events: u32,
        /// Most bytes of lines the batch may hold (8 MiB, as `serve`'s
        /// `--body-limit`); more exit 1 with nothing stored. A batch is
        /// judged holding the store's write lock, which other processes
        /// writing to a SQLite file wait for 10 s at most.
        #[arg(long, default_value_t = crate::server::DEFAULT_BODY_LIMIT, value_parser = parse_body_limit)]
        max_batch_bytes: usize,
    },
    /// Print the effective context (SEMANTICS §5).
    Context {
        /// The session's UUID.
        session: String,
        /// Answer as of this seq instead of the latest.
        #[arg(long, allow_negative_numbers = true, value_parser = parse_at_seq)]
        at_seq: Option<AtSeq>,
        /// Print the §9 JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Print the deferred activation set (SEMANTICS §7).
    Activations {
        /// The session's UUID.
        session: String,
        /// Answer as of this seq instead of the latest.
        #[arg(long, allow_negative_numbers = true, value_parser = parse_at_seq)]
        at_seq: Option<AtSeq>,
        /// Print the §9 JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Print what a restarting sidecar needs: mode, catalog, activation set,
    /// context start, summary, latest seq.
    Recover {
        /// The session's UUID.
        session: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Recompute materialized views (and the calls index) from the log.
    Rebuild {
        /// Only this session (all sessions without it).
        session: Option<String>,
    },
    /// Recompute views from the log and compare with the stored ones; exit 5
    /// naming the first difference on drift.
    Verify {
        /// Only this session (all sessions without it).
        session: Option<String>,
        /// Also recompute the hash chains and check that no row left the
        /// global order (docs/integrity.md); exit 5 naming the first broken
        /// link.
        #[arg(long)]
        integrity: bool,
        /// Print the integrity report as JSON (with `--integrity`).
        #[arg(long, requires = "integrity")]
        json: bool,
    },
    /// Write a session as JSON lines that `import` reads back into an
    /// identical session (same ids, times, seqs and chain).
    Export {
        /// The session's UUID.
        session: String,
    },
    /// Explain whether TOOL is in the activation set and why, from the log
    /// alone (docs/audit.md).
    Explain {
        /// The session's UUID.
        session: String,
        /// The deferred tool.
        tool: String,
        /// Answer as of this seq instead of the latest.
        #[arg(long, conflicts_with = "at_prompt", allow_negative_numbers = true, value_parser = parse_at_seq)]
        at_seq: Option<AtSeq>,
        /// Answer for the request of the K-th prompt (1-based).
        #[arg(long, allow_negative_numbers = true, value_parser = parse_at_prompt)]
        at_prompt: Option<i64>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// For every refresh point, the activation set after it and what was
    /// added and removed (with the reason), from the log alone.
    Refreshes {
        /// The session's UUID.
        session: String,
        /// Print JSON lines, one refresh point each.
        #[arg(long)]
        json: bool,
    },
    /// Cross-session audit queries (docs/audit.md), paged.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Print the global feed of every session's events in position order.
    Tail {
        /// Start at this position (1, the beginning, by default; 0 is the
        /// beginning too, a negative one a usage error).
        #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = parse_at_least_0)]
        from_position: i64,
        /// Keep waiting for new events (stop with Ctrl-C).
        #[arg(long)]
        follow: bool,
        /// Print JSON lines, one stored event each.
        #[arg(long)]
        json: bool,
    },
    /// Serve the HTTP API (docs/api.md) until Ctrl-C or SIGTERM.
    Serve(ServeArgs),
    /// Print the HTTP API's OpenAPI 3 document.
    Openapi,
    /// Measure the store against its ceilings and baselines on temp
    /// databases (docs/benchmarks.md): append throughput beside raw
    /// inserts, pre-request latency beside the naive fold, recovery, memory.
    /// Prints tables and writes a JSON report and an SVG plot.
    Bench(BenchArgs),
    /// One phase of `bench`, run by `bench` in a child process so that each
    /// phase has its own peak RSS.
    #[command(hide = true)]
    BenchPhase {
        /// The phase, as JSON.
        spec: String,
    },
    /// Print a session's events in seq order.
    History {
        /// The session's UUID.
        session: String,
        /// Start after this seq (0: from the first event; a negative one
        /// is refused: exit 2 here, 422 over HTTP).
        #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = parse_at_least_0)]
        after_seq: i64,
        /// Print at most this many events (all of them without it).
        #[arg(long, allow_negative_numbers = true, value_parser = parse_at_least_1)]
        limit: Option<i64>,
        /// Print JSON lines, one stored event each.
        #[arg(long)]
        json: bool,
    },
}

/// The `audit` queries.
#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Events across sessions in global order, by type, session, time and
    /// position range.
    Events {
        /// Only events of this type.
        #[arg(long = "type")]
        event_type: Option<String>,
        /// Only events at this position or later.
        #[arg(long, allow_negative_numbers = true)]
        from_position: Option<i64>,
        /// Only events at this position or earlier.
        #[arg(long, allow_negative_numbers = true)]
        to_position: Option<i64>,
        /// The narrowing every audit query takes.
        #[command(flatten)]
        scope: ScopeArgs,
    },
    /// Refresh points where a deferred tool entered or left a session's
    /// activation set.
    Changes {
        /// Only this tool.
        #[arg(long)]
        tool: Option<String>,
        /// Only `added` or only `removed`.
        #[arg(long)]
        change: Option<String>,
        /// The narrowing every audit query takes.
        #[command(flatten)]
        scope: ScopeArgs,
    },
    /// Anomalies of one kind: unanswered-call, unknown-evidence-name or
    /// view-drift.
    Anomalies {
        /// unanswered-call, unknown-evidence-name or view-drift.
        #[arg(value_parser = parse_anomaly)]
        kind: AnomalyKind,
        /// The narrowing every audit query takes.
        #[command(flatten)]
        scope: ScopeArgs,
    },
    /// Every tenant that holds a session, with how many sessions it
    /// holds (sessions written without a tenant are `default`'s): what a
    /// move of the store goes through. Reads each session's first event.
    Tenants {
        /// One JSON object: {"tenants": [{"tenant", "sessions"}]}.
        #[arg(long)]
        json: bool,
    },
}

/// Flags shared by the `audit` queries.
#[derive(Debug, clap::Args)]
pub struct ScopeArgs {
    /// Only this tenant's sessions (every tenant without it).
    #[arg(long, value_parser = parse_tenant_filter)]
    pub tenant: Option<String>,
    /// Only this session.
    #[arg(long)]
    pub session: Option<String>,
    /// Only rows recorded at or after this time (RFC 3339).
    #[arg(long, value_parser = parse_time, allow_hyphen_values = true)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only rows recorded before this time (RFC 3339).
    #[arg(long, value_parser = parse_time, allow_hyphen_values = true)]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Rows per page (1 to 1000).
    #[arg(long, default_value_t = 100, allow_negative_numbers = true, value_parser = clap::value_parser!(i64).range(1..=crate::store::query::MAX_PAGE))]
    pub limit: i64,
    /// The cursor a previous page gave: its last line's "--after …" (in
    /// `--json`, `next_after_position` of `audit events`, `next` of the
    /// others).
    #[arg(long, allow_hyphen_values = true)]
    pub after: Option<String>,
    /// Print the page as one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn parse_anomaly(s: &str) -> Result<AnomalyKind, String> {
    AnomalyKind::parse(s).ok_or_else(|| {
        format!(
            "unknown anomaly {s:?}: expected unanswered-call, unknown-evidence-name or view-drift"
        )
    })
}

fn parse_time(s: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| format!("{s:?} is not an RFC 3339 time such as 2026-12-01T00:00:00Z: {e}"))
}

impl ScopeArgs {
    fn scope(&self) -> Result<Scope, CliError> {
        Ok(Scope {
            tenant: self.tenant.clone(),
            session: self.session.as_deref().map(parse_session).transpose()?,
            since: self.since,
            until: self.until,
            limit: self.limit,
        })
    }
}

/// The formats `import` reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ImportFormat {
    /// This store's JSON lines (SEMANTICS §9), as `export` writes them.
    #[default]
    Jsonl,
    /// A session file of the pi coding agent: the path to its leaf becomes
    /// one session.
    Pi,
}

/// Flags of `serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on, IP:PORT or HOST:PORT (`localhost:8080`; a
    /// name is resolved once, at start, to its first address); port 0
    /// picks a free one (the line printed at start names it).
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = parse_listen)]
    pub listen: std::net::SocketAddr,
    /// The token document (JSON: {"tokens": [{"token", "tenant",
    /// "scopes"}]}); SESSION_STORE_TOKENS may hold the document itself.
    // The value hidden as DATABASE_URL's is: clap shows an unset
    // variable as `NAME=`, which reads as set to empty (refused at start).
    #[arg(long, env = "SESSION_STORE_TOKENS_FILE", hide_env_values = true,
          value_parser = clap::builder::OsStringValueParser::new().try_map(parse_tokens_file))]
    pub tokens: Option<PathBuf>,
    /// Serve without tokens on a non-loopback address (behind a proxy that
    /// authenticates, for instance).
    #[arg(long)]
    pub insecure: bool,
    /// Largest request body, in bytes (at least 1: a limit of 0 would
    /// refuse every append).
    #[arg(long, default_value_t = crate::server::DEFAULT_BODY_LIMIT, value_parser = parse_body_limit)]
    pub body_limit: usize,
    /// Most events one append may carry; more answer 413 (an append's
    /// memory grows with its events, whatever their size).
    #[arg(long, default_value_t = crate::server::DEFAULT_MAX_BATCH_EVENTS as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_batch_events: u32,
    /// Seconds a request may take before it answers 503.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    pub request_timeout: std::time::Duration,
    /// Seconds shutdown waits for in-flight requests and appends.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    pub shutdown_grace: std::time::Duration,
    /// Seconds a client has to send a request's headers; an idle kept-alive
    /// connection is closed after as long.
    #[arg(long, default_value = "15", value_parser = parse_seconds)]
    pub header_timeout: std::time::Duration,
    /// Connections served at once (streams included); more wait until one
    /// closes.
    #[arg(long, default_value_t = crate::server::DEFAULT_MAX_CONNECTIONS as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Bytes of answers held for clients that have not read them yet (of
    /// answers of 64 KiB or more); an answer that finds them spent answers
    /// 503 `busy`. At least 1 MiB.
    #[arg(long, default_value_t = crate::server::DEFAULT_RESPONSE_MEMORY as u64, value_parser = clap::value_parser!(u64).range(1 << 20..))]
    pub response_memory: u64,
    /// Bytes the cached session states may hold (about: each state is
    /// weighed by its window's texts and values); past it the least
    /// recently used are dropped and read again when next needed. One
    /// state larger than this is still kept, beside it. At least 1 MiB.
    #[arg(long, default_value_t = crate::store::DEFAULT_STATE_CACHE_BYTES as u64, value_parser = clap::value_parser!(u64).range(1 << 20..))]
    pub state_cache_memory: u64,
}

/// Which backends `bench` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchBackend {
    /// SQLite only.
    Sqlite,
    /// PostgreSQL only.
    Postgres,
    /// SQLite, then PostgreSQL.
    Both,
}

/// Flags of `bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The backends to measure.
    #[arg(long, value_enum, default_value = "both")]
    pub backend: BenchBackend,
    /// Sessions of 10^3 and 10^4 events only and short repeats: a smoke
    /// test of under a minute.
    #[arg(long)]
    pub quick: bool,
    /// Where the JSON report goes.
    #[arg(long, default_value = "bench-report.json")]
    pub out: PathBuf,
    /// Where the SVG latency plot goes (bench-latency.svg next to the report
    /// by default).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Use this PostgreSQL server (an admin URL; the bench creates and drops
    /// its own databases there) instead of starting a throw-away one.
    #[arg(long)]
    pub postgres_url: Option<String>,
    /// Where the temp SQLite files go (the system temp dir by default).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// A failed command.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A store error.
    #[error("{0}")]
    Store(#[from] Error),
    /// Bad input found at a line of the input.
    #[error("line {line}: {error}")]
    Line {
        /// 1-based line number in the input.
        line: usize,
        /// What is wrong.
        error: ValidationError,
    },
    /// Bad input in a pi session file.
    #[error("{0}")]
    Pi(#[from] crate::pi::PiError),
    /// Bad input outside any line (a bad argument).
    #[error("{0}")]
    Input(String),
    /// The input could not be read.
    #[error("{0}")]
    Io(String),
    /// `verify` found a view that disagrees with the log.
    #[error("{0}")]
    Drift(String),
    /// `bench` could not run.
    #[error("{0}")]
    Bench(#[from] crate::bench::BenchError),
    /// A run of `import`'s lines that could not be stored (the storage
    /// failed, not the lines).
    // "Could not be confirmed stored" when the last attempt's commit may
    // have gone through unseen (a re-run is safe for lines with an
    // event_id, answered from the log, and may store again those without
    // one); "were not stored" when the storage said nothing was.
    #[error("{} (session {session}) {}: {cause}", if first == last { format!("line {first}") } else { format!("lines {first}–{last}") }, if cause.may_be_stored() { "could not be confirmed stored" } else if first == last { "was not stored" } else { "were not stored" })]
    LinesNotStored {
        /// The run's first line.
        first: usize,
        /// Its last line.
        last: usize,
        /// Their session.
        session: Uuid,
        /// Why.
        cause: Error,
    },
    /// `import` stopped at a bad line after storing the lines before it.
    #[error("{cause}; the {} before it {} stored{}", count(*written + *replayed, "event"), if *written + *replayed == 1 { "is" } else { "are" }, if *replayed > 0 { format!(" ({replayed} of them already were{})", confirmed_said(*confirmed)) } else { String::new() })]
    ImportStopped {
        /// What stopped it.
        cause: Box<CliError>,
        /// Events it wrote.
        written: usize,
        /// Events it found already stored.
        replayed: usize,
        /// Of `replayed`, events a retry found stored after an attempt's
        /// answer was lost ([`ImportSummary::confirmed`](import::ImportSummary::confirmed)).
        confirmed: usize,
    },
    /// `import` stopped by SIGINT or SIGTERM between two appends
    /// (it lets the append in flight end): what is stored, and where a re-run
    /// resumes.
    #[error("{}", interrupted_said(*signal, *through_line, *stored, *replayed, *pi_session))]
    Interrupted {
        /// The signal.
        signal: import::Signal,
        /// JSON lines: the last line stored (all before it are, none
        /// after it).
        through_line: usize,
        /// Events stored (JSON lines: by this run; a pi file: of the
        /// file, in its session).
        stored: usize,
        /// Of them, stored before this run.
        replayed: usize,
        /// A pi file's session.
        pi_session: Option<Uuid>,
    },
    /// The reader of the output went away (`| head`): the command stops
    /// quietly, with exit 0, as `head`'s user asked for no more.
    #[error("the reader of the output closed it")]
    OutputClosed,
}

impl CliError {
    /// The exit code of SEMANTICS §9, and 5 for `verify`'s drift (this
    /// store's addition).
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Store(e) => store_exit_code(e),
            CliError::Drift(_) => 5,
            CliError::OutputClosed => 0,
            CliError::ImportStopped { cause, .. } => cause.exit_code(),
            CliError::Interrupted { signal, .. } => signal.exit_code,
            CliError::LinesNotStored { cause, .. } => store_exit_code(cause),
            CliError::Bench(crate::bench::BenchError::Store(e)) => store_exit_code(e),
            CliError::Bench(_) => 4,
            _ => 1,
        }
    }
}

/// [`CliError::Interrupted`]'s sentence.
fn interrupted_said(
    signal: import::Signal,
    through_line: usize,
    stored: usize,
    replayed: usize,
    pi_session: Option<Uuid>,
) -> String {
    let name = signal.name;
    let before = match replayed {
        0 => String::new(),
        n => format!(", {n} of them already before"),
    };
    match pi_session {
        Some(id) if stored == 0 => format!(
            "interrupted by {name} before this import stored anything in session {id}; \
             the same import run again goes on"
        ),
        Some(id) => format!(
            "interrupted by {name}: {} of the file {} stored in session {id}{before}; \
             the same import run again stores the rest",
            count(stored, "event"),
            if stored == 1 { "is" } else { "are" },
        ),
        None if through_line == 0 => format!(
            "interrupted by {name} before anything was stored: the input is not imported; \
             run the import again"
        ),
        None => format!(
            "interrupted by {name}: {} of the input {} stored ({}{before}), \
             none after; the lines from {next} on (`tail -n +{next} FILE`) complete the import \
             (the whole input run again does too, where each line has an event_id)",
            match through_line {
                1 => "line 1".to_owned(),
                n => format!("lines 1–{n}"),
            },
            if through_line == 1 { "is" } else { "are" },
            count(stored, "event"),
            next = through_line + 1,
        ),
    }
}

fn store_exit_code(e: &Error) -> i32 {
    match e {
        Error::Conflict { .. } => 3,
        Error::RetriesExhausted { last, .. } => store_exit_code(last),
        Error::Unavailable(_)
        | Error::OutcomeUnknown(_)
        | Error::Database(_)
        | Error::Corrupt(_) => 4,
        Error::BadUrl(_) | Error::UrlRefused { .. } => 2,
        Error::Invalid(_)
        | Error::NotAStore(_)
        | Error::SessionNotFound(_)
        | Error::OtherTenant { .. }
        | Error::SeqOutOfRange { .. }
        | Error::PromptOutOfRange { .. } => 1,
    }
}

/// `serve --body-limit`, `append`/`import --max-batch-bytes`: a whole
/// number of bytes, at least 1 (clap names the flag).
fn parse_body_limit(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("a limit of 0 bytes would refuse every batch; give at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number of bytes")),
    }
}

/// `serve --tokens` (or SESSION_STORE_TOKENS_FILE): a path. An empty one
/// is most often a variable set to nothing by a deployment's template, so
/// the refusal names both places it may have come from.
fn parse_tokens_file(s: std::ffi::OsString) -> std::result::Result<PathBuf, String> {
    match s.is_empty() {
        true => Err(
            "the token file's path is empty (from --tokens or SESSION_STORE_TOKENS_FILE): \
             give the path of the token document, or unset the variable"
                .to_owned(),
        ),
        false => Ok(PathBuf::from(s)),
    }
}

/// `--at-seq`: any whole number. One outside the session's seqs, however
/// far (negative, or past `i64`), is the store's "not a seq of this
/// session" (exit 1, SEMANTICS §9), not a usage error; past `i64` it is
/// asked as the farthest `i64`, which no session reaches, and the answer
/// names the number as typed.
#[derive(Clone, Debug)]
pub struct AtSeq {
    seq: i64,
    /// The digits typed, when they are past `i64`.
    typed: Option<String>,
}

/// The store's answer at `at` (a `--at-seq` or none): an out-of-range
/// error names the number the user typed rather than the `i64` it was
/// read as.
fn at_answer<T>(at: Option<&AtSeq>, r: Result<T, Error>) -> Result<T, CliError> {
    match (r, at.and_then(|a| a.typed.as_ref())) {
        (
            Err(Error::SeqOutOfRange {
                session_id, latest, ..
            }),
            Some(typed),
        ) => Err(CliError::Input(format!(
            "seq {typed} is out of range for session {session_id}, whose events are 1 to {latest}"
        ))),
        (r, _) => Ok(r?),
    }
}

/// A whole number of at least `min`, said as such ("-1 is below 0"), not
/// as clap's range ("-1 is not in 0..9223372036854775807").
fn parse_at_least(s: &str, min: i64) -> Result<i64, String> {
    match s.parse::<i64>() {
        Ok(n) if n >= min => Ok(n),
        Ok(n) => Err(format!(
            "{n} is below {min}: give a whole number of at least {min}"
        )),
        Err(_) if parse_at_seq(s).is_ok() => Err(format!(
            "{s} is out of range: give a whole number of at least {min}"
        )),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

fn parse_at_least_0(s: &str) -> Result<i64, String> {
    parse_at_least(s, 0)
}

fn parse_at_least_1(s: &str) -> Result<i64, String> {
    parse_at_least(s, 1)
}

fn parse_at_seq(s: &str) -> Result<AtSeq, String> {
    let digits = s.strip_prefix('-').unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?} is not a whole number"));
    }
    Ok(match s.parse::<i64>() {
        Ok(seq) => AtSeq { seq, typed: None },
        Err(_) => AtSeq {
            seq: if s.starts_with('-') {
                i64::MIN
            } else {
                i64::MAX
            },
            typed: Some(s.to_owned()),
        },
    })
}

/// `--at-prompt K`: a whole number, however far past the session's
/// prompts (an error of the answer, exit 1, as for `--at-seq`), not a
/// usage error for a number past `i64`.
fn parse_at_prompt(s: &str) -> Result<i64, String> {
    parse_at_seq(s).map(|at| at.seq)
}

fn parse_session(s: &str) -> Result<Uuid, CliError> {
    Uuid::parse_str(s)
        .map_err(|_| CliError::Input(format!("{} is not a session UUID", crate::error::quoted(s))))
}

/// Runs one parsed command line, writing results to `out`.
pub async fn run(cli: Cli, out: &mut dyn Write) -> Result<(), CliError> {
    // A testing hook (documented in docs/multi-instance.md): pause between
    // commit and reply, so a test can kill the process there.
    let pause_after_commit = std::env::var("SESSION_STORE_FAULT_PAUSE_AFTER_COMMIT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(std::time::Duration::from_millis);
    let write_timeout = match &cli.command {
        Command::Import { write_timeout, .. } | Command::Append { write_timeout, .. } => {
            Some(*write_timeout)
        }
        _ => None,
    };
    let options = StoreOptions {
        max_event_bytes: cli.max_event_bytes,
        fault_pause_after_commit: pause_after_commit,
        // The writes of one-shot commands; `serve` has its request timeout
        // and lets an append that outlives it run to its commit.
        write_deadline: write_timeout,
        read_deadline: Some(cli.read_timeout),
        // Only the commands that write make a new SQLite file; the others
        // say that there is no store at a mistyped path.
        // (`tail --follow` too: it waits for the store's first events,
        // and may start before any writer.)
        create_if_missing: matches!(
            cli.command,
            Command::Migrate
                | Command::Import { .. }
                | Command::Append { .. }
                | Command::Serve(_)
                | Command::Tail { follow: true, .. }
        ),
        ..StoreOptions::default()
    };
    let migrating = matches!(cli.command, Command::Migrate);
    match cli.command {
        Command::Openapi => {
            return write!(out, "{}", crate::server::openapi_json()).map_err(io);
        }
        Command::Serve(args) => return serve(&cli.database, options, args, out).await,
        Command::Bench(args) => return bench(args, out).await,
        Command::BenchPhase { spec } => {
            let line = crate::bench::run_phase(&spec).await?;
            return writeln!(out, "{line}").map_err(io);
        }
        _ => {}
    }
    // The input is opened before the store, and once: a mistyped path
    // must not leave a new, empty store behind, and a named pipe can be
    // opened only once (a second open would wait for a writer that has
    // gone).
    let input = match &cli.command {
        Command::Import { file, .. } => Some(open_input(file.as_ref())?),
        Command::Append { file, session, .. } => {
            // A session that is no UUID is said before a store is made.
            parse_session(session)?;
            Some(open_input(file.as_ref())?)
        }
        _ => None,
    };
    let (result, target) = match input {
        // The writes: the store is opened at their first write
        // (`target.rs`).
        Some(input) => {
            let tenant = match &cli.command {
                Command::Import { tenant, .. } | Command::Append { tenant, .. } => tenant.clone(),
                _ => None,
            };
            let mut target = WriteTarget::open(&cli.database, options)
                .await?
                .for_tenant(tenant);
            say_upgrade(target.schema_change(), migrating);
            let result = run_write(&mut target, cli.command, cli.max_event_bytes, input, out).await;
            (result, target)
        }
        None => {
            let store = Store::open_with(&cli.database, options).await?;
            say_upgrade(Some(store.schema_change()), migrating);
            let result = run_on(&store, cli.command, out).await;
            (result, WriteTarget::owning(store))
        }
    };
    // Closing waits for the writer connection, which after a write that
    // timed out may still be inside SQLite's wait for another process's
    // lock (10 s) or a stalled database: the command's answer is given,
    // and what was not committed rolls back without us, so the wait is
    // bounded (exit closes the files).
    // After the storage was said unavailable, a connection may still be
    // inside a round trip the server will not answer: the answer is given,
    // so the close waits a moment, not a timeout again.
    let unavailable = std::time::Duration::from_secs(1);
    let bound = match &result {
        Err(e) if e.exit_code() == 4 => unavailable,
        _ => write_timeout.map_or(cli.read_timeout, |w| w.min(cli.read_timeout)),
    };
    target.close(bound).await;
    result
}

/// Every command migrates the store it opens; an upgrade, which older
/// builds cannot undo, is said as soon as the store is open (before a
/// command that runs until stopped, such as `tail --follow`); `migrate`
/// says it as its answer.
fn say_upgrade(change: Option<crate::store::SchemaChange>, migrating: bool) {
    if let (Some(crate::store::SchemaChange::Upgraded { from, to }), false) = (change, migrating) {
        eprintln!(
            "session-store: upgraded the store's schema from migration {from} to {to}; {UPGRADE_IS_ONE_WAY}"
        );
    }
}

/// What an upgrade's message adds: why it is worth saying.
const UPGRADE_IS_ONE_WAY: &str =
    "builds older than this one refuse the store from now on (docs/operations.md, \"Upgrades\")";

/// `--tenant`: as a token document's tenant (docs/api.md).
fn parse_tenant(s: &str) -> Result<String, String> {
    match crate::validate::tenant_name_problem(s) {
        Some(problem) => Err(format!(
            "{} is not a tenant: {problem}",
            crate::error::quoted(s)
        )),
        None => Ok(s.to_owned()),
    }
}

/// `audit --tenant`: a name a store may hold, which is looser than what a
/// tenant may be named now ([`parse_tenant`]): a store written before the
/// rule may hold `acme ` (whitespace at an end), and its sessions must
/// still be found, listed and moved (docs/operations.md, "Moving a store").
fn parse_tenant_filter(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 200 || s.chars().any(char::is_control) {
        return Err(format!(
            "{} is not a tenant: 1 to 200 bytes of UTF-8 without control characters",
            crate::error::quoted(s)
        ));
    }
    Ok(s.to_owned())
}

/// `--listen`: an IP and port, or a host name and port resolved to its
/// first address (`localhost:8080` is as common as `127.0.0.1:8080`).
fn parse_listen(s: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    let said =
        |why: String| format!("{s:?} is not an address to listen on (IP:PORT or HOST:PORT): {why}");
    let mut addrs = std::net::ToSocketAddrs::to_socket_addrs(s).map_err(|e| said(e.to_string()))?;
    addrs
        .next()
        .ok_or_else(|| said("the name has no address".to_owned()))
}

/// The longest wait a seconds flag takes: a year. Beyond it a deadline
/// is no longer a deadline, and far enough out it overflows the clock.
const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// A seconds flag (`--request-timeout`, `--shutdown-grace`): a number
/// above 0, at most a year; a value it cannot take is a usage error.
fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(v > 0.0 && v <= MAX_SECONDS) {
        return Err(format!(
            "{s} is out of range: the flag takes seconds above 0, at most {MAX_SECONDS} (a year)"
        ));
    }
    std::time::Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{s} seconds is too short to wait for"))
}

/// Reads the tokens: `--tokens FILE` (or SESSION_STORE_TOKENS_FILE), else
/// the document in SESSION_STORE_TOKENS, else none.
fn load_tokens(file: Option<&PathBuf>) -> Result<Option<crate::server::Tokens>, CliError> {
    use crate::server::Tokens;
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            CliError::Io(format!(
                "cannot read the token file {}: {e}",
                path.display()
            ))
        })?;
        // Bearer tokens any user of the machine can read: said (not
        // refused: a container's secret mount may be so, by design).
        #[cfg(unix)]
        if let Ok(meta) = std::fs::metadata(path) {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode();
            if mode & 0o004 != 0 {
                warn!(
                    file = %path.display(),
                    mode = format!("{:o}", mode & 0o777),
                    "the token file can be read by every user of this machine; `chmod 600` it"
                );
            }
        }
        // A byte order mark some editors put first is not the document.
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        return Tokens::parse(text, &format!("the token file {}", path.display()))
            .map(Some)
            .map_err(CliError::Input);
    }
    match std::env::var_os("SESSION_STORE_TOKENS") {
        None => Ok(None),
        // Set to nothing is most often a secret a deployment's template
        // failed to render: taken as unset, it turned authentication off.
        Some(text) if text.to_str().is_some_and(|t| t.trim().is_empty()) => {
            Err(CliError::Input(
                "SESSION_STORE_TOKENS is set but empty: give it a token document, or unset it to serve without tokens (on a loopback address only, or with --insecure)"
                    .to_owned(),
            ))
        }
        Some(text) => match text.into_string() {
            Ok(text) => Tokens::parse(&text, "SESSION_STORE_TOKENS")
                .map(Some)
                .map_err(CliError::Input),
            Err(_) => Err(CliError::Input(
                "SESSION_STORE_TOKENS is not UTF-8 text, so not a token document".to_owned(),
            )),
        },
    }
}

async fn serve(
    database: &str,
    mut options: StoreOptions,
    args: ServeArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    use crate::server::{Server, ServerConfig};
    let tokens = load_tokens(args.tokens.as_ref())?;
    if tokens.is_none() && !args.listen.ip().is_loopback() && !args.insecure {
        return Err(CliError::Input(format!(
            "refusing to serve {} without tokens: anyone who can reach that address could read and write every session. \
             Give --tokens FILE (or SESSION_STORE_TOKENS), listen on a loopback address such as 127.0.0.1, \
             or pass --insecure if something in front of the server authenticates callers",
            args.listen
        )));
    }
    let config = ServerConfig {
        loopback_hosts_only: tokens.is_none() && args.listen.ip().is_loopback() && !args.insecure,
        tokens,
        body_limit: args.body_limit,
        max_batch_events: args.max_batch_events as usize,
        request_timeout: args.request_timeout,
        shutdown_grace: args.shutdown_grace,
        header_timeout: args.header_timeout,
        max_connections: args.max_connections as usize,
        response_memory: usize::try_from(args.response_memory).unwrap_or(usize::MAX),
    };
    options.state_cache_bytes = usize::try_from(args.state_cache_memory).unwrap_or(usize::MAX);
    // Bound before the store is opened: a server that cannot listen (the
    // port taken, a typo) exits without having created or upgraded the
    // store. Connections that arrive while it opens wait in the backlog.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| CliError::Io(format!("cannot listen on {}: {e}", args.listen)))?;
    let store = std::sync::Arc::new(Store::open_with(database, options).await?);
    if let crate::store::SchemaChange::Upgraded { from, to } = store.schema_change() {
        warn!(
            from,
            to, "upgraded the store's schema; {UPGRADE_IS_ONE_WAY}"
        );
    }
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::Io(format!("cannot read the listening address: {e}")))?;
    let auth = match &config.tokens {
        Some(t) => format!("{} token(s)", t.len()),
        None => "no tokens: every caller is the default tenant".to_owned(),
    };
    let kind = match store.kind() {
        crate::store::BackendKind::Sqlite => "SQLite",
        crate::store::BackendKind::Postgres => "PostgreSQL",
    };
    let signal = shutdown_signal();
    // A banner nobody reads (stdout closed, as under some supervisors)
    // does not stop the server: it serves on, and says why in the log.
    let banner = writeln!(out, "listening on http://{addr} ({kind} store, {auth})")
        .and_then(|()| out.flush());
    match banner.map_err(io) {
        Ok(()) => {}
        Err(CliError::OutputClosed) => warn!("standard output is closed; serving on"),
        Err(e) => return Err(e),
    }
    info!(%addr, "serving");
    let server = Server::new(store.clone(), config);
    let result = server
        .serve(listener, signal)
        .await
        .map_err(|e| CliError::Io(format!("the server failed: {e}")));
    store.close().await;
    result
}

/// `bench`: its databases are its own (temp files, a throw-away server),
/// so `--database` is not used.
async fn bench(args: BenchArgs, out: &mut dyn Write) -> Result<(), CliError> {
    use crate::store::BackendKind;
    match crate::bench::unoptimized_build(args.quick, cfg!(debug_assertions)) {
        Some(crate::bench::Unoptimized::Refused(why)) => return Err(CliError::Input(why)),
        Some(crate::bench::Unoptimized::Warned(why)) => eprintln!("session-store: {why}"),
        None => {}
    }
    let backends = match args.backend {
        BenchBackend::Sqlite => vec![BackendKind::Sqlite],
        BenchBackend::Postgres => vec![BackendKind::Postgres],
        BenchBackend::Both => vec![BackendKind::Sqlite, BackendKind::Postgres],
    };
    let svg = args.svg.unwrap_or_else(|| {
        args.out
            .parent()
            .map(|p| p.join("bench-latency.svg"))
            .unwrap_or_else(|| PathBuf::from("bench-latency.svg"))
    });
    let command = std::env::args()
        .map(|a| {
            if a.contains("://") && a.contains('@') {
                // An admin URL may hold a password.
                "<url>".to_owned()
            } else {
                a
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    let config = crate::bench::BenchConfig {
        backends,
        quick: args.quick,
        out: args.out,
        svg,
        postgres_url: args.postgres_url,
        dir: args.dir,
        command,
    };
    crate::bench::run(&config, out).await?;
    Ok(())
}

/// Completes on Ctrl-C or SIGTERM (what `docker stop` and systemd send).
/// SIGHUP, which operators send to reload a daemon, is said and otherwise
/// ignored: tokens are read at start only, and by default SIGHUP ended the
/// process at once, without the graceful shutdown (docs/operations.md).
/// The handlers are installed when this is called, not when the future is
/// first polled: `serve` calls it before it says it listens, so that a
/// signal sent on reading that line finds them (one sent then used to end
/// the process about one time in two).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let (mut hangup, mut term, mut interrupt) = {
        use tokio::signal::unix::{signal, SignalKind};
        (
            signal(SignalKind::hangup()).ok(),
            signal(SignalKind::terminate()).ok(),
            signal(SignalKind::interrupt()).ok(),
        )
    };
    async move {
        #[cfg(unix)]
        {
            let hangups = async {
                loop {
                    match hangup.as_mut() {
                        Some(h) => {
                            h.recv().await;
                            warn!("SIGHUP ignored: nothing is reloaded (tokens are read at start); restart the server to change them, SIGTERM to stop it");
                        }
                        None => std::future::pending::<()>().await,
                    }
                }
            };
            let ended = |signal: Option<tokio::signal::unix::Signal>| async move {
                match signal {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = ended(term.take()) => {}
                () = ended(interrupt.take()) => {}
                () = hangups => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// `import` and `append`, reading `input` (which `run` opened before the
/// store) and writing to `target`.
async fn run_write(
    target: &mut WriteTarget<'_>,
    command: Command,
    max_bytes: usize,
    input: Box<dyn BufRead + Send>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    match command {
        Command::Import {
            format: ImportFormat::Pi,
            ..
        } => {
            let spool = PiSpool::copy(input, import::pi_line_limit(max_bytes))?;
            let tree = crate::pi::PiTree::read(spool.lines()?)?;
            if let Some(version) = tree.newer_version() {
                let current = crate::pi::CURRENT_VERSION;
                eprintln!(
                    "session-store: the pi session file is version {version}, newer than {current}; it is read as version {current}"
                );
            }
            // Signals are said once the file is read: a stop while it is
            // copied stores nothing, as before.
            let interrupt = import::Interrupt::on_signals();
            let summary =
                import::import_pi_into(target, &tree, &spool, max_bytes, &interrupt).await?;
            let dropped = match tree.off_path() {
                0 => String::new(),
                1 => "; 1 pi entry on another branch dropped".to_owned(),
                n => format!("; {n} pi entries on other branches dropped"),
            };
            let said = format!(
                "imported {} into session {} ({} already stored{dropped})",
                count(summary.written, "event"),
                tree.session_id(),
                summary.replayed
            );
            writeln!(out, "{said}").map_err(|e| unsaid(io(e), &said))?;
        }
        Command::Import {
            format: ImportFormat::Jsonl,
            ..
        } => {
            let lines = InputLines::new(input, crate::event::line_limit(max_bytes));
            let interrupt = import::Interrupt::on_signals();
            let summary = import_piped(target, lines, max_bytes, interrupt).await?;
            // An import that succeeds leaves a store, even of nothing.
            target.store().await?;
            let said = format!(
                "imported {} into {} ({} already stored{})",
                count(summary.written, "event"),
                count(summary.sessions, "session"),
                summary.replayed,
                confirmed_said(summary.confirmed)
            );
            writeln!(out, "{said}").map_err(|e| unsaid(io(e), &said))?;
        }
        Command::Append {
            session,
            expected_seq,
            max_batch_events,
            max_batch_bytes,
            ..
        } => {
            let session = parse_session(&session)?;
            let lines = InputLines::new(input, crate::event::line_limit(max_bytes));
            let mut events = Vec::new();
            let mut line_numbers = Vec::new();
            let mut bytes = 0usize;
            for line in lines {
                bytes = bytes.saturating_add(line.as_ref().map_or(0, |(_, text)| text.len()));
                let parsed = parse_input_line(line, LineKind::Append, max_bytes);
                let bound = if events.len() >= max_batch_events as usize {
                    Some(format!(
                        "more than {} (--max-batch-events)",
                        count(max_batch_events as usize, "event")
                    ))
                } else if bytes > max_batch_bytes {
                    Some(format!(
                        "more than {} of lines (--max-batch-bytes)",
                        count(max_batch_bytes, "byte")
                    ))
                } else {
                    None
                };
                let past_the_bound = match (&parsed, bound) {
                    (Ok((n, _)) | Err(CliError::Line { line: n, .. }), Some(bound)) => {
                        Some((*n, bound))
                    }
                    _ => None,
                };
                if let Some((n, bound)) = past_the_bound {
                    // A line past the bound, readable or not: the expected
                    // seq first, then the bound.
                    target.check_expected(session, expected_seq).await?;
                    return Err(CliError::Input(format!(
                        "line {n}: the batch holds {bound}: \
                         one append is one transaction, judged and written in memory; nothing was stored. \
                         Append fewer at a time, or use `import`, which stores a long input in runs"
                    )));
                }
                match parsed {
                    Ok((n, p)) => {
                        events.push(p.event);
                        line_numbers.push(n);
                    }
                    Err(CliError::Line { line, error }) => {
                        // SEMANTICS §2 judges the expected seq before the
                        // events, and the events one by one: the lines
                        // before this one are judged first (a conflict, or
                        // an earlier line's error, answers first), then
                        // this line's (not JSON, not UTF-8, too long, not
                        // an event). Nothing is stored.
                        line_numbers.push(line);
                        let refused = target
                            .refuse_batch(session, expected_seq, events, error)
                            .await;
                        return Err(at_line(refused, &line_numbers));
                    }
                    Err(e) => return Err(e),
                }
            }
            let outcome = target
                .append(session, expected_seq, events)
                .await
                .map_err(|e| at_line(e, &line_numbers))?;
            for a in &outcome.events {
                print_json(out, a).map_err(|e| stored_unsaid(e, session, &outcome))?;
            }
        }
        _ => {
            return Err(CliError::Input(
                "only import and append are run by `run_write`".to_owned(),
            ))
        }
    }
    Ok(())
}

async fn run_on(store: &Store, command: Command, out: &mut dyn Write) -> Result<(), CliError> {
    match command {
        Command::Serve(_)
        | Command::Openapi
        | Command::Bench(_)
        | Command::BenchPhase { .. }
        | Command::Import { .. }
        | Command::Append { .. } => {
            // `run` answers these before opening a borrowed store, and
            // the writes by `run_write`.
            return Err(CliError::Input(
                "serve, openapi, bench, import and append are run by `run`, not on an open store"
                    .to_owned(),
            ));
        }
        Command::Migrate => {
            // The open migrated: the schema is at this build's latest.
            let said = match store.schema_change() {
                crate::store::SchemaChange::None => format!(
                    "the schema is up to date: migration {}, the latest this build knows",
                    store.schema_version()
                ),
                crate::store::SchemaChange::Created { to } => format!(
                    "created the schema: migration {to}, the latest this build knows"
                ),
                crate::store::SchemaChange::Upgraded { from, to } => format!(
                    "upgraded the schema from migration {from} to {to}, the latest this build knows; {}",
                    UPGRADE_IS_ONE_WAY
                ),
            };
            writeln!(out, "{said}").map_err(io)?;
        }
        Command::Context {
            session,
            at_seq,
            json,
        } => {
            let session = parse_session(&session)?;
            // A long window is written as its rows are read, a page at a
            // time.
            let (ctx, pages) = at_answer(
                at_seq.as_ref(),
                store
                    .context_paged(session, at_seq.as_ref().map(|a| a.seq))
                    .await,
            )?;
            match pages {
                Some(pages) => print_context_paged(store, &ctx, pages, json, out).await?,
                None if json => print_json(out, &ctx)?,
                None => print_context(&ctx, out).map_err(io)?,
            }
        }
        Command::Activations {
            session,
            at_seq,
            json,
        } => {
            let session = parse_session(&session)?;
            let act = at_answer(
                at_seq.as_ref(),
                store
                    .activations(session, at_seq.as_ref().map(|a| a.seq))
                    .await,
            )?;
            if json {
                print_json(out, &act)?;
            } else {
                print_activations(&act, out).map_err(io)?;
            }
        }
        Command::Recover { session, json } => {
            let r = store.recover(parse_session(&session)?).await?;
            if json {
                print_json(out, &r)?;
            } else {
                print_recovery(&r, out).map_err(io)?;
            }
        }
        Command::Rebuild { session } => {
            let sessions = target_sessions(store, session.as_deref()).await?;
            let started = std::time::Instant::now();
            let bar = progress_bar(sessions.len());
            for s in &sessions {
                store.rebuild(*s).await?;
                bar.inc(1);
            }
            bar.finish_and_clear();
            writeln!(
                out,
                "rebuilt the views of {} in {:.2} s",
                count(sessions.len(), "session"),
                started.elapsed().as_secs_f64()
            )
            .map_err(io)?;
        }
        Command::Export { session } => {
            let session = parse_session(&session)?;
            // Page by page (2 000 events, at most 4 MiB of payloads): a
            // session of any length streams in constant memory.
            let mut pages = store.event_pages(session, At::Latest).await?;
            while let Some(page) = pages.next_page(store).await? {
                for e in &page {
                    print_json(out, &e.export_line())?;
                }
            }
        }
        Command::Explain {
            session,
            tool,
            at_seq,
            at_prompt,
            json,
        } => {
            if tool.is_empty() {
                return Err(CliError::Input("the tool name is empty".to_owned()));
            }
            let at = match (&at_seq, at_prompt) {
                (Some(n), _) => At::Seq(n.seq),
                (None, Some(k)) => At::Prompt(k),
                (None, None) => At::Latest,
            };
            let session = parse_session(&session)?;
            let x = at_answer(at_seq.as_ref(), store.explain(session, &tool, at).await)?;
            if json {
                print_json(out, &x)?;
            } else {
                print_explanation(&x, out).map_err(io)?;
            }
        }
        Command::Refreshes { session, json } => {
            let session = parse_session(&session)?;
            // The table's header goes with its first row, so that an
            // unknown session prints its error alone.
            let header = |out: &mut dyn Write| {
                writeln!(
                    out,
                    "{:>6}  {:<17}  {:>6}  {:<12}  TOOLS / CHANGES",
                    "SEQ", "TYPE", "PROMPT", "MODE"
                )
                .map_err(io)
            };
            let mut headed = json;
            store
                .refreshes(session, At::Latest, |r| {
                    if json {
                        return print_json(out, &r);
                    }
                    if !headed {
                        header(out)?;
                        headed = true;
                    }
                    print_refresh(&r, out).map_err(io)
                })
                .await?;
            if !headed {
                header(out)?;
            }
        }
        Command::Audit(query) => audit(store, query, out).await?,
        Command::Verify {
            session,
            integrity,
            json,
        } => {
            let sessions = match target_sessions(store, session.as_deref()).await {
                // A row whose session cannot be told (an edit around the
                // store) is a difference like the others (exit 5).
                Err(CliError::Store(Error::Corrupt(why))) => return Err(log_changed(why)),
                other => other?,
            };
            // The chains first: an edit behind the store's back usually
            // also makes a view disagree, and the chain names the row.
            let report = match integrity {
                true => {
                    let only = match session.as_deref() {
                        Some(s) => Some(parse_session(s)?),
                        None => None,
                    };
                    match store.verify_integrity(only).await {
                        Err(Error::Corrupt(why)) => return Err(log_changed(why)),
                        other => Some(other?),
                    }
                }
                false => None,
            };
            if let (Some(report), true) = (&report, json) {
                // The JSON says both verdicts: the chains', and the first
                // view that disagrees with the log (every session's views
                // are checked, as without --json), so a program reading it
                // sees what the exit code says.
                let mut drift = None;
                for s in &sessions {
                    if let Some(difference) = store.verify(*s).await? {
                        drift = Some(difference);
                        break;
                    }
                }
                let mut said = serde_json::to_value(report)
                    .map_err(|e| CliError::Io(format!("cannot write the report: {e}")))?;
                if let Some(fields) = said.as_object_mut() {
                    fields.insert("view_drift".to_owned(), serde_json::json!(drift));
                }
                // The verdict is the exit code: a reader that closed
                // the output does not turn a broken chain into exit 0, nor
                // an output that cannot be written into exit 1.
                match print_json(out, &said) {
                    Err(CliError::OutputClosed) | Ok(()) => {}
                    Err(e) => {
                        return Err(
                            match chains_broken(report).or_else(|| drift.map(view_drift)) {
                                Some(CliError::Drift(verdict)) => CliError::Drift(format!(
                                    "{verdict} (the report could not be written: {e})"
                                )),
                                _ => e,
                            },
                        )
                    }
                }
                if report.intact() {
                    return match drift {
                        Some(difference) => Err(view_drift(difference)),
                        None => Ok(()),
                    };
                }
            }
            if let Some(broken) = report.as_ref().and_then(chains_broken) {
                return Err(broken);
            }
            let bar = progress_bar(sessions.len());
            for s in &sessions {
                if let Some(difference) = store.verify(*s).await? {
                    bar.finish_and_clear();
                    return Err(view_drift(difference));
                }
                bar.inc(1);
            }
            bar.finish_and_clear();
            match &report {
                Some(r) => writeln!(
                    out,
                    "the views of {} agree with the log; the hash chains of {} are intact",
                    count(sessions.len(), "session"),
                    count(r.events as usize, "event")
                )
                .map_err(io)?,
                None => writeln!(
                    out,
                    "the views of {} agree with the log",
                    count(sessions.len(), "session")
                )
                .map_err(io)?,
            }
        }
        Command::Tail {
            from_position,
            follow,
            json,
        } => {
            if !json {
                writeln!(
                    out,
                    "{:>8}  {:<36}  {:>6}  {:<20}  DETAIL",
                    "POSITION", "SESSION", "SEQ", "TYPE"
                )
                .map_err(io)?;
            }
            let mut after = from_position.max(1) - 1;
            let mut subscription = match follow {
                true => Some(store.subscribe(from_position).await?),
                false => None,
            };
            loop {
                let page = match &mut subscription {
                    // A follower outlives a short outage (a PostgreSQL
                    // restart, a failover): it says so on stderr and reads
                    // on from where it was, losing nothing.
                    Some(sub) => {
                        match sub.next_batch().await {
                            Ok(page) => page,
                            Err(e @ Error::Unavailable(_)) => {
                                eprintln!("session-store: {e}; waiting and reading on after position {after}");
                                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                                continue;
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    None => store.feed(after, 1_000).await?,
                };
                let Some(last) = page.last() else { break };
                after = last.position;
                for e in &page {
                    if json {
                        print_json(out, e)?;
                    } else {
                        writeln!(
                            out,
                            "{:>8}  {:<36}  {:>6}  {:<20}  {}",
                            e.position,
                            e.session_id,
                            e.seq,
                            e.body.type_name(),
                            detail(&e.body)
                        )
                        .map_err(io)?;
                    }
                }
                out.flush().map_err(io)?;
            }
        }
        Command::History {
            session,
            after_seq,
            limit,
            json,
        } => {
            let session = parse_session(&session)?;
            if store.head_seq(session).await? == 0 {
                return Err(Error::SessionNotFound(session).into());
            }
            let mut after = after_seq;
            let mut left = limit.unwrap_or(i64::MAX).max(0);
            if !json {
                writeln!(
                    out,
                    "{:>6}  {:<20}  {:<36}  DETAIL",
                    "SEQ", "TYPE", "EVENT ID"
                )
                .map_err(io)?;
            }
            while left > 0 {
                // Pages bounded in bytes too: 1 000 events of 1 MiB each
                // were held at once.
                let page = store
                    .history_within(session, after, left.min(1_000), crate::store::PAGE_BYTES)
                    .await?;
                let Some(last) = page.last() else { break };
                after = last.seq;
                left -= page.len() as i64;
                for e in &page {
                    if json {
                        print_json(out, e)?;
                    } else {
                        writeln!(
                            out,
                            "{:>6}  {:<20}  {:<36}  {}",
                            e.seq,
                            e.body.type_name(),
                            e.event_id,
                            detail(&e.body)
                        )
                        .map_err(io)?;
                    }
                }
            }
        }
    }
    Ok(())
}

async fn audit(store: &Store, query: AuditCommand, out: &mut dyn Write) -> Result<(), CliError> {
    match query {
        AuditCommand::Events {
            event_type,
            from_position,
            to_position,
            scope,
        } => {
            let after_position = match &scope.after {
                None => 0,
                Some(a) => a
                    .parse()
                    .map_err(|_| CliError::Input(format!("--after {a:?} is not a position")))?,
            };
            let page = store
                .audit_events(&EventQuery {
                    scope: scope.scope()?,
                    event_type,
                    from_position,
                    to_position,
                    after_position,
                })
                .await
                .map_err(in_flags)?;
            if scope.json {
                return print_json(out, &page);
            }
            writeln!(
                out,
                "{:>9}  {:<36}  {:>6}  {:<20}  {:<27}  DETAIL",
                "POSITION", "SESSION", "SEQ", "TYPE", "RECORDED AT"
            )
            .map_err(io)?;
            for e in &page.events {
                writeln!(
                    out,
                    "{:>9}  {:<36}  {:>6}  {:<20}  {:<27}  {}",
                    e.position,
                    e.session_id,
                    e.seq,
                    e.body.type_name(),
                    e.recorded_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    detail(&e.body)
                )
                .map_err(io)?;
            }
            print_next(out, page.next_after_position.map(|p| p.to_string()))
        }
        AuditCommand::Changes {
            tool,
            change,
            scope,
        } => {
            let page = store
                .audit_changes(&ChangeQuery {
                    scope: scope.scope()?,
                    tool,
                    change,
                    after: scope.after.clone(),
                })
                .await
                .map_err(in_flags)?;
            if scope.json {
                return print_json(out, &page);
            }
            writeln!(
                out,
                "{:>9}  {:<36}  {:>6}  {:<27}  {:<8}  TOOL",
                "POSITION", "SESSION", "SEQ", "RECORDED AT", "CHANGE"
            )
            .map_err(io)?;
            for c in &page.changes {
                writeln!(
                    out,
                    "{:>9}  {:<36}  {:>6}  {:<27}  {:<8}  {}",
                    c.position,
                    c.session_id,
                    c.seq,
                    c.recorded_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    c.change,
                    c.tool
                )
                .map_err(io)?;
            }
            print_next(out, page.next)
        }
        AuditCommand::Anomalies { kind, scope } => {
            let page = store
                .audit_anomalies(&AnomalyQuery {
                    scope: scope.scope()?,
                    kind,
                    after: scope.after.clone(),
                })
                .await
                .map_err(in_flags)?;
            if scope.json {
                return print_json(out, &page);
            }
            for a in &page.anomalies {
                writeln!(out, "{}  {}", a.session_id, a.detail).map_err(io)?;
            }
            if page.anomalies.is_empty() {
                writeln!(out, "none found on this page").map_err(io)?;
            }
            print_next(out, page.next)
        }
        AuditCommand::Tenants { json } => {
            let tenants = store.tenants().await?;
            if json {
                /// Structs, not `json!` (whose maps sort their keys), so
                /// that the keys keep the documented order (`tenant`
                /// first).
                #[derive(serde::Serialize)]
                struct TenantRow<'a> {
                    tenant: &'a str,
                    sessions: &'a i64,
                }
                let tenants: Vec<_> = tenants
                    .iter()
                    .map(|(tenant, sessions)| TenantRow { tenant, sessions })
                    .collect();
                #[derive(serde::Serialize)]
                struct Tenants<'a> {
                    tenants: Vec<TenantRow<'a>>,
                }
                return print_json(out, &Tenants { tenants });
            }
            for (tenant, sessions) in &tenants {
                // Quoted: a name may hold spaces inside.
                writeln!(out, "{sessions:>10}  {}", crate::error::quoted(tenant)).map_err(io)?;
            }
            if tenants.is_empty() {
                writeln!(out, "no sessions").map_err(io)?;
            }
            Ok(())
        }
    }
}

/// The audit queries' parameters and the flags that set them.
const AUDIT_FLAGS: [(&str, &str); 11] = [
    ("from_position", "--from-position"),
    ("to_position", "--to-position"),
    ("after", "--after"),
    ("since", "--since"),
    ("until", "--until"),
    ("tool", "--tool"),
    ("type", "--type"),
    ("change", "--change"),
    ("limit", "--limit"),
    ("session", "--session"),
    ("tenant", "--tenant"),
];

/// An audit query's refusal in the CLI's words: the store names the
/// parameters as HTTP does (`from_position`), the user typed flags.
fn in_flags(e: Error) -> CliError {
    let Error::Invalid(mut v) = e else {
        return e.into();
    };
    for (name, flag) in AUDIT_FLAGS {
        v.message = v
            .message
            .replace(&format!("`{name}`"), &format!("`{flag}`"));
        if v.field.as_deref() == Some(name) {
            v.field = Some(flag.to_owned());
        }
    }
    Error::Invalid(v).into()
}

fn print_next(out: &mut dyn Write, next: Option<String>) -> Result<(), CliError> {
    match next {
        Some(n) => writeln!(out, "next page: --after {n}"),
        None => writeln!(out, "end of results"),
    }
    .map_err(io)
}

fn print_explanation(x: &Explanation, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "{}", x.why)?;
    writeln!(
        out,
        "as of seq {} (prompt {}), mode {}",
        x.as_of_seq, x.as_of_prompt, x.mode
    )?;
    match &x.catalog {
        Some(c) => writeln!(
            out,
            "catalog of mode {}: catalog_defined at seq {} ({})",
            c.mode, c.seq, c.event_id
        )?,
        None => writeln!(out, "mode {} has no catalog", x.mode)?,
    }
    if let Some(e) = &x.evidence {
        writeln!(
            out,
            "evidence: {} result of call {} at seq {} ({})",
            e.result_tool, e.call_id, e.seq, e.event_id
        )?;
    }
    if let Some(Reason::OnlyUnsuccessful { results, .. }) = &x.reason {
        for r in results {
            writeln!(
                out,
                "  {} {} result of call {} at seq {} ({})",
                r.status.as_str(),
                r.result_tool,
                r.call_id,
                r.seq,
                r.event_id
            )?;
        }
    }
    Ok(())
}

fn print_refresh(r: &Refresh, out: &mut dyn Write) -> std::io::Result<()> {
    let tools: Vec<&str> = r.tools.iter().map(|a| a.name.as_str()).collect();
    let mut changes: Vec<String> = r.added.iter().map(|n| format!("+{n}")).collect();
    changes.extend(
        r.removed
            .iter()
            .map(|x| format!("-{} ({})", x.name, reason_text(&x.reason))),
    );
    writeln!(
        out,
        "{:>6}  {:<17}  {:>6}  {:<12}  [{}]{}{}",
        r.seq,
        r.kind,
        r.prompt,
        r.mode,
        tools.join(", "),
        if changes.is_empty() { "" } else { "  " },
        changes.join("  ")
    )
}

/// What an import's "already stored" count holds of lines it most likely
/// stored itself: a retry found them stored after an attempt's answer was
/// lost. Counted apart so that "already stored" does not read as an
/// earlier run's.
fn confirmed_said(confirmed: usize) -> String {
    match confirmed {
        0 => String::new(),
        n => format!(
            "; {n} of them found stored by a retry after an attempt's answer was lost, most likely stored by this run"
        ),
    }
}

/// `verify`'s verdict on a view that disagrees with its log, with the
/// remedy: the log is the truth (SEMANTICS §8), so recomputing the views
/// from it repairs them. (A log changed behind the store's back is said
/// apart: no rebuild repairs that.)
fn view_drift(difference: String) -> CliError {
    // A row of the log itself that cannot be read (`event at position
    // …`, an edit around the store): the views are not what is wrong.
    if difference.starts_with("event at position") {
        return log_changed(format!(
            "{difference}; no rebuild repairs a changed log \
             (`session-store verify --integrity` names every changed row; restore the store from a backup)"
        ));
    }
    CliError::Drift(format!(
        "{difference}; `session-store rebuild` recomputes the views from the log"
    ))
}

/// `verify`'s verdict on a log changed behind the store's back: `why`
/// names the first change.
fn log_changed(why: impl std::fmt::Display) -> CliError {
    CliError::Drift(format!(
        "the log was changed behind the store's back: {why}"
    ))
}

/// `verify --integrity`'s verdict when a chain is broken or a row of the
/// log cannot be read: the first of them, and how many more.
fn chains_broken(report: &crate::store::IntegrityReport) -> Option<CliError> {
    let first = report
        .breaks
        .first()
        .map(|b| b.message.clone())
        .or_else(|| report.log_problems.first().cloned())?;
    Some(log_changed(
        match report.breaks.len() + report.log_problems.len() - 1 {
            0 => first,
            more => format!("{first} (and {more} more)"),
        },
    ))
}

/// "1 event", "2 events".
fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// The UTF-8 byte order mark, skipped at the start of an input.
const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";

/// Standard output as the CLI writes it: every control character but the
/// newline and the tab, C0 (U+0000–U+001F), DEL and C1 (U+0080–U+009F, which
/// terminals in UTF-8 mode act on too: U+009B is CSI), is written as its
/// JSON escape (`\u001b`), so that text a session holds (a prompt, a mode,
/// a call id) cannot move the cursor, retitle or clear the terminal that
/// reads `history` or `context`. JSON lines keep their values: an escape
/// reads back as the character it stands for.
pub struct Printable<W: Write> {
    out: W,
    /// The first byte of a two-byte UTF-8 character (0xC2) that ended the
    /// last write: whether it starts a C1 character depends on the next.
    held: bool,
}

impl<W: Write> std::fmt::Debug for Printable<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Printable")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl<W: Write> Printable<W> {
    /// Writes through to `out`.
    pub fn new(out: W) -> Printable<W> {
        Printable { out, held: false }
    }
}

impl<W: Write> Write for Printable<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let c0 = |b: u8| (b < 0x20 && b != b'\n' && b != b'\t') || b == 0x7f;
        let c1 = |b: u8| (0x80..=0x9f).contains(&b);
        let (mut i, mut start) = (0, 0);
        if self.held && !buf.is_empty() {
            self.held = false;
            if c1(buf[0]) {
                write!(self.out, "\\u{:04x}", buf[0])?;
                (i, start) = (1, 1);
            } else {
                self.out.write_all(&[0xc2])?;
            }
        }
        while i < buf.len() {
            let b = buf[i];
            if c0(b) {
                self.out.write_all(&buf[start..i])?;
                write!(self.out, "\\u{b:04x}")?;
                i += 1;
                start = i;
            } else if b == 0xc2 && i + 1 == buf.len() {
                self.out.write_all(&buf[start..i])?;
                self.held = true;
                i += 1;
                start = i;
            } else if b == 0xc2 && c1(buf[i + 1]) {
                self.out.write_all(&buf[start..i])?;
                write!(self.out, "\\u{:04x}", buf[i + 1])?;
                i += 2;
                start = i;
            } else {
                i += 1;
            }
        }
        self.out.write_all(&buf[start..])?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if std::mem::take(&mut self.held) {
            self.out.write_all(&[0xc2])?;
        }
        self.out.flush()
    }
}

impl<W: Write> Drop for Printable<W> {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// Prints one value as one line of JSON.
fn print_json<T: serde::Serialize>(out: &mut dyn Write, value: &T) -> Result<(), CliError> {
    let text = serde_json::to_string(value)
        .map_err(|e| CliError::Io(format!("cannot print the answer as JSON: {e}")))?;
    writeln!(out, "{text}").map_err(io)
}

/// An answer that could not be written after its batch was stored: said
/// as stored, so that whoever reads the error does not take exit 1 for
/// "nothing stored" and append the batch again (events without an
/// `event_id` would then be stored twice).
fn stored_unsaid(e: CliError, session: Uuid, outcome: &crate::store::AppendOutcome) -> CliError {
    let (Some(first), Some(last)) = (outcome.events.first(), outcome.events.last()) else {
        return e;
    };
    let how = match outcome.replayed {
        true => "already stored",
        false => "stored",
    };
    let said = format!(
        "the batch was {how} at seqs {}-{} (`history {session} --after-seq {}` shows it)",
        first.seq,
        last.seq,
        first.seq - 1
    );
    unsaid(e, &said)
}

/// `e`, an output that could not be written, said after what was done
/// (`done`): the store changed, whatever the exit code.
fn unsaid(e: CliError, done: &str) -> CliError {
    match e {
        CliError::Io(why) => CliError::Io(format!("{done}, but then {why}")),
        other => other,
    }
}

fn io(e: std::io::Error) -> CliError {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe => CliError::OutputClosed,
        _ => CliError::Io(format!("cannot write the output: {e}")),
    }
}

/// The pi field that a store field of `body` was made from.
fn pi_field(store_field: &str, body: &EventBody) -> String {
    let pi = match (store_field, body) {
        ("tokens_before", _) => "tokensBefore",
        ("summary", _) => "summary",
        ("call_id", EventBody::ToolCall { .. }) => "message.content[].id",
        ("tool_name", EventBody::ToolCall { .. }) => "message.content[].name",
        ("call_id", EventBody::ToolResult { .. }) => "message.toolCallId",
        ("tool_name", EventBody::ToolResult { .. }) => "message.toolName",
        ("added_tool_names" | "deferred_tools", _) => "message.details.addedToolNames",
        ("text", _) => "message.content",
        _ => return store_field.to_owned(),
    };
    pi.to_owned()
}

fn clip(s: &str, n: usize) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() > n {
        format!("{}…", one_line.chars().take(n).collect::<String>())
    } else {
        one_line
    }
}

/// One readable line about an event.
fn detail(body: &EventBody) -> String {
    match body {
        EventBody::SessionStarted { mode, .. } => format!("mode {mode}"),
        EventBody::CatalogDefined {
            mode,
            deferred_tools,
        } => format!("mode {mode}: [{}]", deferred_tools.join(", ")),
        EventBody::PromptSubmitted { text } | EventBody::AssistantMessage { text } => {
            clip(text, 60)
        }
        EventBody::ToolCall {
            call_id, tool_name, ..
        } => format!("{tool_name} (call {call_id})"),
        EventBody::ToolResult {
            call_id,
            tool_name,
            status,
            added_tool_names,
            ..
        } => {
            let status = status.as_str();
            match added_tool_names.as_deref() {
                Some(added) if !added.is_empty() => {
                    format!(
                        "{tool_name} (call {call_id}) {status}, added [{}]",
                        added.join(", ")
                    )
                }
                _ => format!("{tool_name} (call {call_id}) {status}"),
            }
        }
        EventBody::Compaction { summary, .. } => format!("summary: {}", clip(summary, 50)),
        EventBody::ModeSwitched { mode } => format!("to {mode}"),
    }
}

fn print_context(ctx: &Context, out: &mut dyn Write) -> std::io::Result<()> {
    print_context_head(ctx, out)?;
    for row in &ctx.rows {
        print_context_row(row, out)?;
    }
    if ctx.rows.is_empty() {
        writeln!(out, "(no transcript rows)")?;
    }
    Ok(())
}

fn print_context_head(ctx: &Context, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "session {} as of seq {}, mode {}",
        ctx.session_id, ctx.as_of_seq, ctx.mode
    )?;
    match &ctx.summary {
        Some(s) => writeln!(out, "summary: {}", clip(s, 70))?,
        None => writeln!(out, "summary: (none)")?,
    }
    writeln!(out, "{:>6}  {:<18}  DETAIL", "SEQ", "TYPE")
}

fn print_context_row(row: &ContextRow, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:>6}  {:<18}  {}",
        row.seq,
        row.body.type_name(),
        detail(&row.body)
    )
}

/// [`print_context`] or [`print_json`] of a context whose rows come in
/// pages ([`Store::context_paged`]), written as they are read: the same
/// text, byte for byte, as the whole answer would print.
async fn print_context_paged(
    store: &Store,
    head: &Context,
    mut pages: crate::store::ContextPages,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    fn as_json<T: serde::Serialize>(v: &T) -> Result<String, CliError> {
        serde_json::to_string(v)
            .map_err(|e| CliError::Io(format!("cannot print the answer as JSON: {e}")))
    }
    if json {
        let open = head
            .json_head()
            .map_err(|e| CliError::Io(format!("cannot print the answer as JSON: {e}")))?;
        write!(out, "{open}").map_err(io)?;
    } else {
        print_context_head(head, out).map_err(io)?;
    }
    let mut first = true;
    while let Some(page) = pages.next_page(store).await? {
        for row in page {
            if json {
                let sep = if first { "" } else { "," };
                write!(out, "{sep}{}", as_json(&row)?).map_err(io)?;
            } else {
                print_context_row(&row, out).map_err(io)?;
            }
            first = false;
        }
    }
    match json {
        true => writeln!(out, "]}}").map_err(io),
        false if first => writeln!(out, "(no transcript rows)").map_err(io),
        false => Ok(()),
    }
}

fn print_activations(act: &Activations, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "session {} as of seq {}, mode {}",
        act.session_id, act.as_of_seq, act.mode
    )?;
    if act.tools.is_empty() {
        return writeln!(out, "(no deferred tool is active)");
    }
    let width = act
        .tools
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    writeln!(out, "{:<width$}  EVIDENCE SEQ", "TOOL")?;
    for t in &act.tools {
        writeln!(out, "{:<width$}  {}", t.name, t.evidence_seq)?;
    }
    Ok(())
}

/// The sessions a `rebuild`/`verify` covers: one (which must exist) or all.
async fn target_sessions(store: &Store, session: Option<&str>) -> Result<Vec<Uuid>, CliError> {
    match session {
        Some(s) => {
            let id = parse_session(s)?;
            if store.head_seq(id).await? == 0 {
                return Err(Error::SessionNotFound(id).into());
            }
            Ok(vec![id])
        }
        None => Ok(store.sessions().await?),
    }
}

/// A progress bar on a terminal; hidden otherwise (the summary line says
/// what was done).
fn progress_bar(len: usize) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len as u64);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} sessions, {eta} left")
    {
        bar.set_style(style);
    }
    bar
}

fn print_recovery(r: &crate::store::Recovery, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "session {} at seq {}, mode {}",
        r.session_id, r.latest_seq, r.mode
    )?;
    writeln!(out, "catalog: [{}]", r.catalog.join(", "))?;
    let tools: Vec<String> = r
        .tools
        .iter()
        .map(|t| format!("{} (seq {})", t.name, t.evidence_seq))
        .collect();
    writeln!(out, "active: [{}]", tools.join(", "))?;
    writeln!(out, "context starts at seq {}", r.context_start_seq)?;
    match (&r.summary, r.compaction_seq) {
        (Some(s), Some(seq)) => writeln!(out, "summary (compaction at seq {seq}): {}", clip(s, 60)),
        _ => writeln!(out, "summary: (none)"),
    }
}
