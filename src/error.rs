//! Typed errors of the library.
//!
//! A [`ValidationError`] names the SEMANTICS §4 rule it enforces (a stable
//! kebab-case code), the field at fault and, inside a batch, the event's
//! index; the CLI adds the line number. [`Error`] is what every store call
//! returns; the binary maps its variants to exit codes.

use std::fmt;

use uuid::Uuid;

/// The validation rules of SEMANTICS §3–§4, each with a stable code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The text is not JSON, or not a JSON object.
    MalformedJson,
    /// `type` names no known event type.
    UnknownType,
    /// A required field is absent.
    MissingField,
    /// A field has the wrong JSON type or value.
    MistypedField,
    /// A field that is not the type's.
    UnknownField,
    /// A UUID field that does not parse.
    BadUuid,
    /// The event's JSON text is over the configured limit.
    TooLarge,
    /// A tool name is empty, too long or holds control characters.
    BadToolName,
    /// A `mode` or `call_id` is empty.
    EmptyField,
    /// An event before `session_started`.
    NotStarted,
    /// A second `session_started`.
    AlreadyStarted,
    /// A `tool_call` reusing a `call_id`.
    DuplicateCallId,
    /// A `tool_result` with no earlier `tool_call`.
    ResultWithoutCall,
    /// A second `tool_result` for one call.
    DuplicateResult,
    /// A `tool_result` whose `tool_name` differs from its call's.
    ResultToolMismatch,
    /// Non-empty `added_tool_names` on a result that did not succeed.
    AddedNamesWithoutSuccess,
    /// `first_kept_event_id` is not an effective transcript row.
    CompactionKeepsNonEffectiveRow,
    /// The compaction would keep a result whose call it summarizes.
    CompactionSplitsCall,
    /// An `event_id` twice in one batch.
    DuplicateEventIdInBatch,
    /// An `event_id` already stored with other content.
    EventIdReused,
    /// A batch of which only some events are already stored.
    PartlyStoredBatch,
}

impl Rule {
    /// The stable code printed in messages.
    pub fn code(self) -> &'static str {
        match self {
            Rule::MalformedJson => "malformed-json",
            Rule::UnknownType => "unknown-type",
            Rule::MissingField => "missing-field",
            Rule::MistypedField => "mistyped-field",
            Rule::UnknownField => "unknown-field",
            Rule::BadUuid => "bad-uuid",
            Rule::TooLarge => "event-too-large",
            Rule::BadToolName => "bad-tool-name",
            Rule::EmptyField => "empty-field",
            Rule::NotStarted => "event-before-session-started",
            Rule::AlreadyStarted => "second-session-started",
            Rule::DuplicateCallId => "duplicate-call-id",
            Rule::ResultWithoutCall => "result-without-call",
            Rule::DuplicateResult => "second-result-for-call",
            Rule::ResultToolMismatch => "result-tool-name-mismatch",
            Rule::AddedNamesWithoutSuccess => "added-tool-names-without-success",
            Rule::CompactionKeepsNonEffectiveRow => "compaction-keeps-non-effective-row",
            Rule::CompactionSplitsCall => "compaction-splits-call-from-result",
            Rule::DuplicateEventIdInBatch => "duplicate-event-id-in-batch",
            Rule::EventIdReused => "event-id-reused-with-other-content",
            Rule::PartlyStoredBatch => "batch-partly-stored",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// An event that breaks a rule; nothing of its batch was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationError {
    /// The rule broken.
    pub rule: Rule,
    /// The field at fault, when one is.
    pub field: Option<String>,
    /// The index of the event in its batch (0-based), when in a batch.
    pub index: Option<usize>,
    /// One sentence saying what is wrong.
    pub message: String,
}

impl ValidationError {
    /// A new error for `rule`.
    pub fn new(rule: Rule, field: Option<&str>, message: impl Into<String>) -> ValidationError {
        ValidationError {
            rule,
            field: field.map(str::to_owned),
            index: None,
            message: message.into(),
        }
    }

    /// Sets the field name when one is known.
    pub fn with_field_name(mut self, field: Option<String>) -> ValidationError {
        if field.is_some() {
            self.field = field;
        }
        self
    }

    /// Sets the batch index.
    pub fn at_index(mut self, index: usize) -> ValidationError {
        self.index = Some(index);
        self
    }
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(i) = self.index {
            write!(f, "event {} of the batch: ", i + 1)?;
        }
        write!(f, "{} (rule {}", self.message, self.rule)?;
        if let Some(field) = &self.field {
            write!(f, ", field `{field}`")?;
        }
        f.write_str(")")
    }
}

impl std::error::Error for ValidationError {}

/// Every error a store call can return.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Input that breaks the contract; nothing was written.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// The expected seq is not the session's current seq; nothing was written.
    #[error("conflict on session {session_id}: expected seq {expected}, but the session is at seq {current}")]
    Conflict {
        /// The session.
        session_id: Uuid,
        /// What the writer expected.
        expected: i64,
        /// The session's current seq; retry from here.
        current: i64,
    },
    /// The session has no events.
    #[error("session {0} not found")]
    SessionNotFound(Uuid),
    /// An operator's write on behalf of a tenant (`import --tenant`) to a
    /// session another tenant owns; nothing was written. (The HTTP API
    /// answers such a session as not found, as it does a missing one.)
    #[error(
        "session {session_id} belongs to another tenant than {tenant:?}; nothing of it was written"
    )]
    OtherTenant {
        /// The session.
        session_id: Uuid,
        /// The tenant the write was for.
        tenant: String,
    },
    /// A seq to answer at (`at_seq`, the CLI's `--at-seq`) outside
    /// 1..=latest.
    #[error("seq {seq} is out of range for session {session_id}, whose events are 1 to {latest}")]
    SeqOutOfRange {
        /// The session.
        session_id: Uuid,
        /// The seq asked for.
        seq: i64,
        /// The session's latest seq.
        latest: i64,
    },
    /// A prompt to answer at (`At::Prompt`, the CLI's `--at-prompt`) outside
    /// 1..=the session's prompts.
    #[error("there is no prompt {prompt} in session {session_id}: prompts are numbered from 1 and it has {prompts}")]
    PromptOutOfRange {
        /// The session.
        session_id: Uuid,
        /// The prompt number asked for.
        prompt: i64,
        /// How many prompts the session has.
        prompts: i64,
    },
    /// The database URL is not one the store understands. The URL is said
    /// without its password ([`redact_url`]).
    #[error("unsupported database URL {:?}: use a file path, sqlite://PATH or postgres://… (not an in-memory SQLite database, which would lose every acknowledged append with the process, nor a path holding NUL)", redact_url(.0))]
    BadUrl(String),
    /// A database URL of a backend the store knows that it cannot use as
    /// written: it does not parse, or it asks for what the driver would
    /// ignore (`why`). Said without its password ([`redact_url`]).
    #[error("the database URL {:?} cannot be used: {why}", redact_url(.url))]
    UrlRefused {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// The database (the URL given to [`crate::Store::open`], the CLI's
    /// `--database`) names no session store: a SQLite file that does not
    /// exist (for a command that only reads), or a database of something
    /// else, which the store refuses to change.
    #[error("{0}")]
    NotAStore(String),
    /// The database could not be reached or answered with an I/O failure.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// An append's commit was sent, or may have been, and no answer came:
    /// the connection failed, a deadline passed or the committing task
    /// stopped. The batch may or may not be stored. Sent again with the
    /// same event ids, it answers with the stored seqs if it was (§2);
    /// without ids, read the session's head before appending again.
    #[error(
        "storage unavailable while the append was committing, so it may or may not be stored: {0}"
    )]
    OutcomeUnknown(String),
    /// Any other database failure.
    #[error("database error: {0}")]
    Database(String),
    /// The stored log, or a table derived from it, holds something the
    /// store cannot read back.
    #[error("corrupt data in the store: {0}")]
    Corrupt(String),
    /// An append kept conflicting with other writers (or finding the
    /// storage unavailable) until the retry bound.
    #[error(
        "gave up appending to session {session_id} after {attempts} {}: {last}",
        if *.attempts == 1 { "attempt" } else { "attempts" }
    )]
    RetriesExhausted {
        /// The session.
        session_id: Uuid,
        /// How many appends were tried.
        attempts: u32,
        /// The last failure, except that it is [`Error::OutcomeUnknown`]
        /// whenever any attempt's outcome was unknown: that attempt may
        /// have stored the batch, whatever the later ones found. Said in
        /// this error's message, so not also its `source()` (a report
        /// printing the chain would say it twice).
        last: Box<Error>,
    },
}

/// A SQLite error's primary result code (the low byte of its extended
/// code: BUSY 5, CONSTRAINT 19, …), or `None` for any other error.
pub(crate) fn sqlite_primary_code(e: &sqlx::Error) -> Option<i64> {
    match e {
        sqlx::Error::Database(db)
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() =>
        {
            db.code()
                .and_then(|c| c.parse::<i64>().ok())
                .map(|c| c & 0xff)
        }
        _ => None,
    }
}

impl Error {
    /// A failed migration of `backend`: a lost or refused connection is the
    /// storage's (`Unavailable`, exit 4, retried by `import`), as the same
    /// failure is anywhere else; anything else is the schema's.
    pub fn from_migration(backend: &str, e: sqlx::migrate::MigrateError) -> Error {
        use sqlx::migrate::MigrateError;
        let (inner, version) = match e {
            MigrateError::Execute(inner) => (inner, None),
            MigrateError::ExecuteMigration(inner, version) => (inner, Some(version)),
            // A store that a newer build migrated: this build cannot know
            // what the newer schema means, and says what to do.
            MigrateError::VersionMissing(version) => {
                return Error::Database(format!(
                    "this {backend} store was migrated by a newer session-store: its migration {version} is not one this build knows. Run the newer session-store on it, or restore a backup taken before the upgrade (docs/operations.md, \"Upgrades\")"
                ));
            }
            other => {
                return Error::Database(format!(
                    "migrating the {backend} database failed: {other}"
                ));
            }
        };
        // The database's words as `from_sqlx` says them (with the remedy
        // it knows), and the migration that failed.
        let at = version
            .map(|v| format!(" at migration {v}"))
            .unwrap_or_default();
        let failed = format!("migrating the {backend} database failed{at}");
        match Error::from_sqlx(inner) {
            Error::Unavailable(m) => Error::Unavailable(format!("{failed}: {m}")),
            Error::Database(m) => Error::Database(format!("{failed}: {m}")),
            other => Error::Database(format!("{failed}: {other}")),
        }
    }

    /// Classifies a driver error: connection-level failures are
    /// [`Error::Unavailable`] (retryable), the rest [`Error::Database`].
    pub fn from_sqlx(e: sqlx::Error) -> Error {
        match &e {
            // sqlx's own words name its internals ("error communicating
            // with database: expected to read 5 bytes…", "pool timed out
            // while waiting for an open connection"): said as what happened.
            // A certificate rustls refused: the connection's settings,
            // said with what to change.
            // A name mismatch is checked under `verify-ca` too: sqlx 0.8
            // passes over rustls's old error for it, not the one rustls
            // now gives (sqlx issue #3793).
            sqlx::Error::Io(io) if io.to_string().contains("not valid for name") => {
                Error::Unavailable(format!(
                    "the PostgreSQL server's TLS certificate is not for the host connected to ({io}): connect by a name the certificate holds (the driver checks it under sslmode=verify-ca as well as verify-full), or with sslmode=require, which encrypts without checking the certificate"
                ))
            }
            sqlx::Error::Io(io) if io.to_string().contains("certificate") => {
                Error::Unavailable(format!(
                    "the PostgreSQL server's TLS certificate was not accepted ({io}): name the certificate authority that signed it with ?sslrootcert=FILE (when one is named, it did not sign this certificate), or connect with sslmode=require, which encrypts without checking it"
                ))
            }
            sqlx::Error::Io(io) => Error::Unavailable(format!(
                "the connection to the database failed or was cut off ({io})"
            )),
            sqlx::Error::PoolTimedOut => Error::Unavailable(
                "no connection to the database was ready within the connection timeout (the database is down, unreachable or too busy)"
                    .to_owned(),
            ),
            sqlx::Error::PoolClosed => {
                Error::Unavailable("the store's connections are closed (it is shutting down)".to_owned())
            }
            sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => Error::Unavailable(e.to_string()),
            // A stored value of a type or encoding the store never writes
            // (SQLite keeps whatever an edit around the store put there):
            // the data's fault, not the storage's (`verify` says it as a
            // difference, exit 5), said without the driver's words.
            sqlx::Error::ColumnDecode { index, source } => Error::Corrupt(format!(
                "a stored row cannot be read (its column {index}: {source}): `session-store verify --integrity` names rows changed around the store"
            )),
            sqlx::Error::Database(db)
                if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() =>
            {
                // SQLite's extended codes carry the primary code in their
                // low byte: BUSY 5, LOCKED 6, READONLY 8 (also a file moved
                // or removed under an open store), IOERR 10, FULL 13 (the
                // disk), CANTOPEN 14. The storage's state, not the request:
                // "try again" once it is fixed.
                let code = sqlite_primary_code(&e).unwrap_or(0);
                let extended = db.code().and_then(|c| c.parse::<i64>().ok()).unwrap_or(0);
                // READONLY, READONLY_CANTINIT (the -shm file), READONLY_DIRECTORY.
                if code == 8 && [8, 1288, 1544].contains(&extended) {
                    // Plain READONLY: the file or its filesystem may not be
                    // written by this process (a moved file has its own
                    // extended code). Said with what to check; SQLite's
                    // words stay (the server tells the case by them).
                    Error::Unavailable(format!(
                        "{}: the store's SQLite file (or its -wal and -shm files, or their directory) \
                         cannot be written by this process: check their owner and permissions, and \
                         that the filesystem is not mounted read-only",
                        db.message()
                    ))
                } else if [5, 6, 8, 10, 13, 14].contains(&code) {
                    Error::Unavailable(db.message().to_string())
                } else {
                    Error::Database(db.message().to_string())
                }
            }
            sqlx::Error::Database(db) => {
                let code = db.code().map(|c| c.to_string()).unwrap_or_default();
                // No schema to create the store's tables in (3F000): the
                // `search_path` names none that exists. The operator's to
                // fix, said with how.
                if code == "3F000" {
                    return Error::Database(format!(
                        "{}: the schema the connection's search_path names does not exist in this database; create it first (CREATE SCHEMA name), or name an existing one (docs/operations.md, \"A schema of its own\")",
                        db.message()
                    ));
                }
                // PostgreSQL classes 08 (connection), 53 (resources), 57P
                // (shutdown), 57014 (statement timeout), 55P03 (lock
                // timeout), 25P03 (idle-in-transaction timeout), 40001/40P01
                // (serialization, deadlock). All say "try again". So do the
                // refusals of a new connection: class 28 (a bad password, a
                // role that may not log in, pg_hba's reject) and 3D000 (no
                // such database): the database cannot be had, which the
                // operator fixes; a pool that opens a connection after the
                // store's start met them as a server error (HTTP 500).
                // A role that may not write the store's tables (25006: a
                // read-only transaction, a standby or
                // default_transaction_read_only; 42501: no privilege): the
                // database's settings, which the operator fixes. Not
                // `Unavailable`: trying again cannot help (`import` tried
                // for 10 s before it said so).
                if code == "25006" || code == "42501" {
                    return Error::Database(format!(
                        "the database refused this role: {}; the role the store connects as must be able to read and write the store's tables",
                        db.message()
                    ));
                }
                if code.starts_with("08")
                    || code.starts_with("28")
                    || code == "3D000"
                    || code.starts_with("53")
                    || code.starts_with("57P")
                    || ["57014", "55P03", "25P03", "40001", "40P01"].contains(&code.as_str())
                {
                    Error::Unavailable(db.message().to_string())
                } else {
                    Error::Database(db.message().to_string())
                }
            }
            _ => Error::Database(e.to_string()),
        }
    }
}

impl Error {
    /// Whether trying again may succeed: a conflict (after re-reading the
    /// head and judging the batch again: the same `expected_seq` conflicts
    /// again) or storage that is unavailable for now (the same batch, with
    /// its event ids).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Conflict { .. } | Error::Unavailable(_) | Error::OutcomeUnknown(_)
        )
    }

    /// Whether an append that failed with this error may have been stored
    /// all the same: its outcome is unknown, itself or as the last word of
    /// its retries. Every other failure of an append stored nothing.
    pub fn may_be_stored(&self) -> bool {
        match self {
            Error::OutcomeUnknown(_) => true,
            Error::RetriesExhausted { last, .. } => last.may_be_stored(),
            _ => false,
        }
    }
}

/// Shorthand for store results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `url` with the password of its `user:password@` part, and the value of
/// a `password=` parameter, replaced by `***`, for messages and logs: a
/// URL the store cannot use is still the operator's secret. A URL is often
/// refused because its password was not percent-encoded, so the password
/// may hold `/`, `?`, `#` or `@`: the user info is taken to end at the
/// URL's last `@`, which may hide more than the password, never less.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        if is_conninfo(url) {
            // libpq's `key=value` words: each value but the harmless ones
            // hidden, as a URL's parameters are.
            return conninfo_words(url)
                .iter()
                .map(|word| shown_parameter(word, ""))
                .collect::<Vec<_>>()
                .join(" ");
        }
        if let Some(scheme) = postgres_scheme_typo(url) {
            // `postgres:/app:pw@…`: whatever follows may hold a password.
            return format!("{scheme}:***");
        }
        return url.to_owned();
    };
    let said = match rest.rsplit_once('@') {
        Some((userinfo, after)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{after}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    };
    redact_password_parameters(&said)
}

/// `url` with the value of each query parameter as `***`, but for the
/// parameters known to hold no secret: a password may come as
/// `password=`, libpq's `sslpassword=`, a misspelling or a percent-encoded
/// spelling, and a list of secrets would miss some.
fn redact_password_parameters(url: &str) -> String {
    let Some((head, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let params: Vec<String> = query.split('&').map(|p| shown_parameter(p, p)).collect();
    format!("{head}?{}", params.join("&"))
}

/// A `key=value` piece of a URL's query (or of a libpq connection string)
/// as a message may show it: the value hidden but for the parameters known
/// to hold no secret. A piece without `=` is hidden whole (`***`), or
/// shown as `bare` where that is empty (a URL's `&&`): after a password
/// holding an unencoded `&` it is the password's tail.
fn shown_parameter(piece: &str, bare: &str) -> String {
    /// Parameters whose values are names, paths, numbers or modes.
    const SHOWN: &[&str] = &[
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "sslmode",
        "ssl-mode",
        "sslrootcert",
        "ssl-root-cert",
        "ssl-ca",
        "sslcert",
        "ssl-cert",
        "sslkey",
        "ssl-key",
        "application_name",
        "statement-cache-capacity",
        "mode",
        "cache",
        "immutable",
    ];
    match piece.split_once('=') {
        Some((key, _)) if !SHOWN.contains(&key) => format!("{key}=***"),
        Some(_) => piece.to_owned(),
        None if piece.is_empty() => bare.to_owned(),
        None => "***".to_owned(),
    }
}

/// libpq's connection string keywords (its documentation, "Parameter
/// Key Words").
const LIBPQ_KEYS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "require_auth",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "requiressl",
    "sslnegotiation",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslkeylogfile",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
];

/// The words of a libpq connection string as libpq reads them: `key =
/// value` with spaces around `=` taken out, a value in single quotes kept
/// whole (`password='a b'`, `\'` inside), a word without `=` alone.
fn conninfo_words(s: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(char::is_ascii_whitespace).is_some() {}
        if chars.peek().is_none() {
            return words;
        }
        let mut word = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_ascii_whitespace() && *c != '=') {
            word.push(c);
        }
        while chars.next_if(char::is_ascii_whitespace).is_some() {}
        if chars.next_if_eq(&'=').is_some() {
            word.push('=');
            while chars.next_if(char::is_ascii_whitespace).is_some() {}
            if chars.next_if_eq(&'\'').is_some() {
                word.push('\'');
                while let Some(c) = chars.next() {
                    word.push(c);
                    match c {
                        '\\' => word.extend(chars.next()),
                        '\'' => break,
                        _ => {}
                    }
                }
            } else {
                while let Some(c) = chars.next_if(|c| !c.is_ascii_whitespace()) {
                    word.push(c);
                }
            }
        }
        words.push(word);
    }
}

/// Whether `database` is a libpq connection string (`host=… dbname=…`),
/// which the store does not take (it takes a URL): its first word is
/// `key=value` with one of libpq's keywords. One word alone counts only
/// without `/` or `.`, which a SQLite path in a directory named
/// `host=web1` or a file `port=8080.db` has; a path of several words
/// whose first is not such (`my store user=bob.db`) is a path.
pub(crate) fn is_conninfo(database: &str) -> bool {
    if database.contains("://") {
        return false;
    }
    let keyed = |w: &String| {
        w.split_once('=')
            .is_some_and(|(k, _)| LIBPQ_KEYS.contains(&k))
    };
    match conninfo_words(database).as_slice() {
        [] => false,
        [one] => keyed(one) && !one.contains(['/', '.']),
        [first, ..] => keyed(first),
    }
}

/// The scheme of a PostgreSQL URL missing its `//` (`postgres:/app:pw@h/db`,
/// `postgresql:app@h`), which would be read as a SQLite path and quoted
/// whole.
pub(crate) fn postgres_scheme_typo(database: &str) -> Option<&str> {
    let (scheme, rest) = database.split_once(':')?;
    // `postgres:backup.db` is a file's name.
    (!database.contains("://")
        && (rest.starts_with('/') || rest.contains('@'))
        && ["postgres", "postgresql"]
            .iter()
            .any(|p| scheme.eq_ignore_ascii_case(p)))
    .then_some(scheme)
}

/// `s` as a JSON string, for messages that quote what a caller sent: a
/// control character shows as `\u0001`, as in the JSON it came in, not in
/// Rust's `\u{1}`. Past 120 characters it is cut, with its length said:
/// `"aaaa…" (3000 bytes)`.
pub fn quoted(s: &str) -> String {
    // A message echoes what was sent; a name of 64 KiB (a request line
    // allows it) would make a message of as much. Long ones are cut.
    let Some(head) = cut_head(s) else {
        return serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"));
    };
    let head = serde_json::to_string(&head).unwrap_or_else(|_| format!("{head:?}"));
    format!("{}…\" ({} bytes)", &head[..head.len() - 1], s.len())
}

/// How many characters of a name or value a message quotes.
const SHOWN: usize = 120;

/// The first [`SHOWN`] characters of `s` when it has more (`None`: it is
/// quoted whole). [`quoted`] and the cut of serde's own quotes in event
/// errors (`event::cut_long`) share it.
pub(crate) fn cut_head(s: &str) -> Option<String> {
    s.chars()
        .nth(SHOWN)
        .map(|_| s.chars().take(SHOWN).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate for another name is said as that, not as an unknown
    /// authority (a review followed "name the certificate authority" with
    /// the authority already named); another certificate failure as one.
    #[test]
    fn certificate_failures_say_what_to_change() {
        let io = |m: &str| sqlx::Error::Io(std::io::Error::other(m.to_owned()));
        let said = Error::from_sqlx(io(
            "invalid peer certificate: certificate not valid for name \"127.0.0.1\"; certificate is only valid for DnsName(\"db.example\")",
        ))
        .to_string();
        assert!(said.contains("not for the host connected to"), "{said}");
        assert!(said.contains("verify-ca"), "{said}");
        let said = Error::from_sqlx(io("invalid peer certificate: UnknownIssuer")).to_string();
        assert!(said.contains("name the certificate authority"), "{said}");
    }

    /// A long name is quoted cut, with its length; a short one whole.
    #[test]
    fn quoted_cuts_what_is_long() {
        assert_eq!(quoted("a\u{1}b"), "\"a\\u0001b\"");
        let long = "é".repeat(3000);
        let q = quoted(&long);
        assert!(q.starts_with(&format!("\"{}", "é".repeat(120))), "{q}");
        assert!(q.ends_with("…\" (6000 bytes)"), "{q}");
        assert_eq!(quoted(&"x".repeat(120)), format!("\"{}\"", "x".repeat(120)));
    }

    /// A connection lost while the schema is brought up to date is the
    /// storage's, as anywhere else (exit 4, retried by `import`); a schema
    /// that disagrees with the migrations is not.
    #[test]
    fn a_connection_lost_while_migrating_is_unavailable() {
        use sqlx::migrate::MigrateError;
        let reset = || {
            sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "Connection reset by peer",
            ))
        };
        for e in [
            MigrateError::Execute(reset()),
            MigrateError::ExecuteMigration(reset(), 3),
        ] {
            match Error::from_migration("PostgreSQL", e) {
                Error::Unavailable(m) => {
                    assert!(
                        m.starts_with("migrating the PostgreSQL database failed")
                            && m.contains(": the connection"),
                        "{m}"
                    )
                }
                other => panic!("{other:?}"),
            }
        }
        // A store a newer build migrated: said as that, with what to do.
        match Error::from_migration("SQLite", MigrateError::VersionMissing(2)) {
            Error::Database(m) => assert!(
                m.contains("migrated by a newer session-store: its migration 2")
                    && m.contains("restore a backup"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }

    /// Driver failures are said as what happened, not in sqlx's words.
    #[test]
    fn a_lost_connection_is_said_in_a_sentence() {
        let cut = std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "expected to read 5 bytes, got 0 bytes at EOF",
        );
        for (e, said) in [
            (
                sqlx::Error::Io(cut),
                "the connection to the database failed or was cut off",
            ),
            (
                sqlx::Error::PoolTimedOut,
                "no connection to the database was ready",
            ),
            (sqlx::Error::PoolClosed, "shutting down"),
        ] {
            let e = Error::from_sqlx(e);
            assert!(e.is_retryable(), "{e}");
            let text = e.to_string();
            assert!(text.contains(said), "{text}");
            assert!(
                !text.contains("pool timed out") && !text.contains("communicating"),
                "{text}"
            );
        }
    }
}

#[cfg(test)]
mod redaction_and_chain_tests {
    use super::*;

    #[test]
    fn a_url_is_said_without_its_password() {
        for (url, said) in [
            (
                "postgres://app:s3cr3t@db:5432/x?sslmode=require",
                "postgres://app:***@db:5432/x?sslmode=require",
            ),
            (
                "postgresql://app:p%40ss@[::1]/x",
                "postgresql://app:***@[::1]/x",
            ),
            ("postgres://app@db/x", "postgres://app@db/x"),
            ("mysql://u:pw@h/db", "mysql://u:***@h/db"),
            ("/var/lib/s.db", "/var/lib/s.db"),
            // Passwords not percent-encoded, which is why such a URL is
            // refused: whatever they hold stays hidden.
            (
                "postgres://app:top/secret@127.0.0.1:5432/appdb",
                "postgres://app:***@127.0.0.1:5432/appdb",
            ),
            (
                "postgres://app:p@ss:w/rd%#?& x@h:1/d",
                "postgres://app:***@h:1/d",
            ),
            (
                "postgres://h/s?user=postgres&password=S3cret&sslmode=bogus",
                "postgres://h/s?user=postgres&password=***&sslmode=bogus",
            ),
            (
                "postgres://u:pw@h/s?PASSWORD=x#y",
                "postgres://u:***@h/s?PASSWORD=***",
            ),
            (
                "postgres://h/s?sslpassword=a&pasword=b&pass%77ord=c&port=1&sslmode=require",
                "postgres://h/s?sslpassword=***&pasword=***&pass%77ord=***&port=1&sslmode=require",
            ),
            // A password holding an unencoded `&`: its tail is a piece
            // without `=`, hidden whole.
            (
                "postgres://h/s?password=ab&cd-secret-tail&&port=1",
                "postgres://h/s?password=***&***&&port=1",
            ),
            // libpq's connection strings, which the store refuses.
            (
                "host=db port=5432 dbname=x user=app password=S3cret sslmode=require",
                "host=db port=5432 dbname=x user=app password=*** sslmode=require",
            ),
            ("host=db password='a b'", "host=db password=***"),
            (
                "host=db password='it\\'s x' user=u",
                "host=db password=*** user=u",
            ),
            ("host=db password=a b", "host=db password=*** ***"),
            (
                "host = db user = app password = S3cret",
                "host=db user=app password=***",
            ),
            ("sslpassword=S3cret", "sslpassword=***"),
            ("postgres:/app:S3cret@h/db", "postgres:***"),
            ("PostgreSQL:app:S3cret@h", "PostgreSQL:***"),
            // SQLite paths stay as they are.
            ("host=web1/s.db", "host=web1/s.db"),
            ("port=8080.db", "port=8080.db"),
            ("my store user=bob.db", "my store user=bob.db"),
            ("postgres:backup.db", "postgres:backup.db"),
        ] {
            assert_eq!(redact_url(url), said);
        }
        let e = Error::BadUrl("mysql://root:hunter2@h/db".to_owned()).to_string();
        assert!(!e.contains("hunter2") && e.contains("root:***@h"), "{e}");
    }

    #[test]
    fn error_chains_say_each_cause_once() {
        // What `anyhow`'s `{:#}` prints: each message once.
        use std::error::Error as _;
        let v = ValidationError::new(
            Rule::NotStarted,
            Some("type"),
            "the first event must be session_started",
        );
        let invalid = Error::Invalid(v);
        assert!(
            invalid.source().is_none(),
            "transparent: the message is said once"
        );
        assert_eq!(invalid.to_string().matches("session_started").count(), 1);
        let exhausted = Error::RetriesExhausted {
            session_id: Uuid::nil(),
            attempts: 3,
            last: Box::new(Error::Unavailable("down".to_owned())),
        };
        assert!(exhausted.source().is_none());
        assert_eq!(
            exhausted
                .to_string()
                .matches("storage unavailable: down")
                .count(),
            1
        );
    }

    #[test]
    fn only_an_unknown_outcome_may_be_stored() {
        let unknown = || Error::OutcomeUnknown("cut".to_owned());
        let retried = |last: Error| Error::RetriesExhausted {
            session_id: Uuid::nil(),
            attempts: 2,
            last: Box::new(last),
        };
        assert!(unknown().may_be_stored());
        assert!(retried(unknown()).may_be_stored());
        for stored_nothing in [
            Error::Unavailable("full".to_owned()),
            Error::Database("x".to_owned()),
            retried(Error::Unavailable("down".to_owned())),
        ] {
            assert!(!stored_nothing.may_be_stored(), "{stored_nothing}");
        }
    }
}
