//! The one JSON error shape every endpoint answers with.
//!
//! A sidecar in any language branches on `error` (a stable code) and shows
//! `message` (a sentence); validation failures add the rule, field and batch
//! index of SEMANTICS §4, conflicts the seq to retry from. Internal details
//! (SQL, driver errors) are logged, never sent: the client gets a sentence
//! and a status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use tracing::{error, warn};
use utoipa::ToSchema;

use crate::{Error, ValidationError};

/// How often a storage failure with the same words is logged: once, then
/// at most once per [`REPEAT_EVERY`] while answers keep meeting it, with
/// how many did since its last line (`repeated`); what is left when it
/// stops is said by the server's ticker ([`log_held_back`]) within a
/// period, and at shutdown. A failure is one condition, not one line per
/// request: a server whose logins PostgreSQL refused logged ~700
/// identical lines a second under 40 clients (a review, 2026-12-07).
/// The last [`REPEAT_KINDS`] different words are remembered, so that
/// failures taking turns are each held back (one pushed out has its count
/// said first).
struct Repeats(std::sync::Mutex<Vec<Held>>);

/// One kind of failure: the line it is logged as, its words, when it was
/// last logged, and the answers that met it since.
struct Held {
    line: &'static str,
    words: String,
    at: std::time::Instant,
    count: u64,
}

const REPEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(10);
const REPEAT_KINDS: usize = 16;

static REPEATS: Repeats = Repeats(std::sync::Mutex::new(Vec::new()));

impl Repeats {
    /// `Some(n)` when `said` is to be logged now, `n` the answers that said
    /// it since it was last logged; `None` when it was logged within
    /// [`REPEAT_EVERY`] (it is counted).
    fn say(&self, line: &'static str, said: &str) -> Option<u64> {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        let Some(held) = seen.iter_mut().find(|h| h.line == line && h.words == said) else {
            if seen.len() == REPEAT_KINDS {
                // The one logged longest ago makes room, its count said.
                if let Some(oldest) = (0..seen.len()).min_by_key(|&i| seen[i].at) {
                    let gone = seen.swap_remove(oldest);
                    if gone.count > 0 {
                        warn!(cause = %gone.words, repeated = gone.count, "{}", gone.line);
                    }
                }
            }
            seen.push(Held {
                line,
                words: said.to_owned(),
                at: now,
                count: 0,
            });
            return Some(0);
        };
        if now.duration_since(held.at) < REPEAT_EVERY {
            held.count += 1;
            return None;
        }
        let repeated = held.count;
        (held.at, held.count) = (now, 0);
        Some(repeated)
    }

    /// The counts held back for a period or more (all of them when `all`),
    /// taken: `(line, words, count)`.
    fn held_back(&self, all: bool) -> Vec<(&'static str, String, u64)> {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        seen.iter_mut()
            .filter(|h| h.count > 0 && (all || now.duration_since(h.at) >= REPEAT_EVERY))
            .map(|h| {
                let taken = (h.line, h.words.clone(), h.count);
                (h.at, h.count) = (now, 0);
                taken
            })
            .collect()
    }
}

/// Logs `said` as `line` unless the same was logged within a period
/// ([`Repeats`]).
fn log_repeated(line: &'static str, said: &str) {
    if let Some(repeated) = REPEATS.say(line, said) {
        warn!(cause = %said, repeated, "{line}");
    }
}

/// Logs the counts of storage failures held back for a period or more
/// (every one, `at_shutdown`): the server's ticker calls it each period,
/// so that the answers an outage met after its last line are said soon
/// after it ends, not with the next one.
pub(crate) fn log_held_back(at_shutdown: bool) {
    for (line, words, repeated) in REPEATS.held_back(at_shutdown) {
        warn!(cause = %words, repeated, "{line}");
    }
}

/// The body of every error answer.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize, ToSchema)]
pub struct ErrorBody {
    /// A stable code: `unauthorized`, `forbidden`, `not_found`,
    /// `method_not_allowed`, `bad_request`, `unsupported_media_type`,
    /// `payload_too_large`, `invalid`, `seq_out_of_range`,
    /// `prompt_out_of_range`, `conflict`, `unavailable`, `outcome_unknown`
    /// (an append that may or may not be stored), `timeout`, `busy`,
    /// `internal`. Any route may also answer 405 `method_not_allowed` to a
    /// method it does not take, and 503 `unavailable`, `timeout` or `busy`.
    /// (A request the HTTP layer cannot read as one, such as a request line
    /// over 64 KiB (414), too many headers (431) or a garbled request line
    /// (400), is answered before any route, with an empty body.)
    pub error: String,
    /// One sentence saying what is wrong.
    pub message: String,
    /// The SEMANTICS §4 rule broken (its kebab-case code): for `invalid`,
    /// and `malformed-json` for a `bad_request` body that is not JSON, or
    /// not the append's JSON object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// For `invalid`: the field at fault, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// For `invalid`: the index of the event in the batch (0-based).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// For `conflict`: the session's current seq; retry with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_seq: Option<i64>,
}

/// An error answer: a status and an [`ErrorBody`].
#[derive(Debug)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The JSON body (boxed: errors travel in `Result`s that should stay
    /// small).
    pub body: Box<ErrorBody>,
}

impl ApiError {
    /// An answer with no rule, field or seq.
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: Box::new(ErrorBody {
                error: code.to_owned(),
                message: message.into(),
                rule: None,
                field: None,
                index: None,
                current_seq: None,
            }),
        }
    }

    /// 400 with `bad_request`.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// 404: a missing session and another tenant's answer the same.
    pub fn not_found(session_id: impl std::fmt::Display) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("session {session_id} not found"),
        )
    }

    /// 422 naming the rule, field and index.
    pub fn invalid(v: &ValidationError) -> ApiError {
        // JSON clients index from 0: say `events[i]`, as `index` does
        // (the CLI's sentence counts events from 1).
        let text = match v.index {
            Some(i) => format!("events[{i}]: {}", v.message),
            None => v.message.clone(),
        };
        let mut e = ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid", text);
        e.body.rule = Some(v.rule.code().to_owned());
        e.body.field = v.field.clone();
        e.body.index = v.index;
        e
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        match e {
            Error::Invalid(v) => ApiError::invalid(&v),
            Error::Conflict { current, .. } => {
                let mut a = ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string());
                a.body.current_seq = Some(current);
                a
            }
            Error::SessionNotFound(id) | Error::OtherTenant { session_id: id, .. } => {
                ApiError::not_found(id)
            }
            Error::SeqOutOfRange { .. } => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "seq_out_of_range",
                e.to_string(),
            ),
            Error::PromptOutOfRange { .. } => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "prompt_out_of_range",
                e.to_string(),
            ),
            Error::OutcomeUnknown(_) => {
                log_repeated("append outcome unknown", &e.to_string());
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "outcome_unknown",
                    "the append was sent to the database but no answer came back (the connection failed, or the write deadline passed), so it may or may not be stored: send it again with the same event ids (a stored batch is answered with its seqs), or read the session's head before appending again",
                )
            }
            Error::RetriesExhausted { last, .. } if matches!(*last, Error::OutcomeUnknown(_)) => {
                ApiError::from(*last)
            }
            Error::Unavailable(_) | Error::RetriesExhausted { .. } => {
                log_repeated("storage unavailable", &e.to_string());
                // The one cause a client's operator can act on without
                // the server's log; other causes may name paths and hosts.
                // SQLite: "database or disk is full"; PostgreSQL (class 53):
                // "… No space left on device".
                let said = e.to_string();
                let full =
                    said.contains("disk is full") || said.contains("No space left on device");
                // SQLite's file removed or replaced under the server: a
                // retry cannot help until the operator acts. Appends and
                // the readiness probe check the file; a read that opens a
                // new connection finds it gone (SQLITE_CANTOPEN's words:
                // the store was open, so the file was there).
                let moved = said.contains("while the store was open")
                    || matches!(&e, Error::Unavailable(m) if m == "unable to open database file");
                // SQLite's file (or its filesystem) that this process may
                // not write: opened read-only, which reads do not show.
                // Retrying cannot help until the operator acts.
                let read_only = said.contains("attempt to write a readonly database");
                let message = match (full, moved, read_only) {
                    (true, ..) => "the database's disk is full; nothing was stored; try again once space is freed",
                    (false, true, _) => "the store's database file was removed or replaced while the server ran; nothing was stored; it answers again once the file is back and the server is restarted",
                    (false, false, true) => "the store's database file cannot be written by the server (its permissions, or a read-only filesystem); nothing was stored; reads still answer",
                    (false, false, false) => "the database is unavailable; nothing was stored or changed; try again shortly",
                };
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
            }
            // `NotAStore` is found when the server opens its store, before
            // it serves anything.
            Error::BadUrl(_)
            | Error::UrlRefused { .. }
            | Error::NotAStore(_)
            | Error::Database(_)
            | Error::Corrupt(_) => {
                error!(cause = %e, "request failed in the store");
                // A role that may not write: the operator's to fix, and
                // no secret of the server's.
                let message = match e.to_string().contains("the database refused this role") {
                    true => "the database refuses this server's role (it may not write, or not read, the store's tables); nothing was stored or changed; the server log has the cause",
                    false => "the store failed to answer; the server log has the cause",
                };
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            // RFC 9110 §11.6.1: a 401 names the scheme it wants.
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same words are said once per period, with the count held back;
    /// other words are said at once, and each kind keeps its own period;
    /// what is held back when a failure stops is taken by the ticker.
    #[test]
    fn repeated_failures_are_said_once_a_period_with_their_count() {
        let r = Repeats(std::sync::Mutex::new(Vec::new()));
        let say = |words: &str| r.say("storage unavailable", words);
        assert_eq!(say("a"), Some(0));
        assert_eq!(say("a"), None);
        assert_eq!(say("b"), Some(0));
        assert_eq!(say("a"), None);
        assert_eq!(say("b"), None);
        // The same words as another line are another kind.
        assert_eq!(r.say("append outcome unknown", "a"), Some(0));
        // Within the period the ticker takes nothing; at shutdown, all.
        assert!(r.held_back(false).is_empty());
        let age = |r: &Repeats| {
            for h in r.0.lock().unwrap().iter_mut() {
                h.at -= REPEAT_EVERY;
            }
        };
        // A period later: said again, with how many were held back.
        age(&r);
        assert_eq!(say("a"), Some(2));
        assert_eq!(say("a"), None);
        // The ticker takes what a stopped failure left: b's one.
        let taken = r.held_back(false);
        assert_eq!(taken, [("storage unavailable", "b".to_owned(), 1)]);
        assert_eq!(say("b"), None, "taken counts restart the period");
        let all = r.held_back(true);
        assert_eq!(all.len(), 2, "{all:?}");
        assert!(r.held_back(true).is_empty());
        // Past the kinds remembered, the oldest is forgotten.
        for i in 0..REPEAT_KINDS {
            assert_eq!(say(&format!("k{i}")), Some(0));
        }
        assert_eq!(r.0.lock().unwrap().len(), REPEAT_KINDS);
    }

    /// A full disk and a removed store file are said to the client (its
    /// operator can act on them); other storage failures stay generic,
    /// since their causes may name paths.
    #[test]
    fn a_full_disk_is_named_and_other_causes_are_not() {
        for (cause, full) in [
            ("database or disk is full", true),
            (
                "could not extend file \"base/5/16384\": No space left on device",
                true,
            ),
            ("cannot read /srv/secret/path.db: locked", false),
        ] {
            let e = ApiError::from(Error::Unavailable(cause.into()));
            assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
            let said = &e.body.message;
            assert_eq!(said.contains("disk is full"), full, "{said}");
            assert!(!said.contains("/srv"), "{said}");
        }
        // A removed store file is named (a retry cannot help), not its path.
        let removed = "the store's file /srv/secret/s.db was removed while the store was open; nothing more is written until it is back and the store is opened again";
        let e = ApiError::from(Error::Unavailable(removed.into()));
        let said = &e.body.message;
        assert!(
            said.contains("removed or replaced") && said.contains("restarted"),
            "{said}"
        );
        assert!(!said.contains("/srv"), "{said}");
        // A file the server may not write (opened read-only): said, since
        // a retry cannot help, and that reads still answer.
        let e = ApiError::from(Error::Unavailable(
            "attempt to write a readonly database".into(),
        ));
        assert!(
            e.body.message.contains("cannot be written by the server")
                && !e.body.message.contains("try again"),
            "{}",
            e.body.message
        );
        // A read's new connection finding no file says the same.
        let e = ApiError::from(Error::Unavailable("unable to open database file".into()));
        assert!(
            e.body.message.contains("removed or replaced"),
            "{}",
            e.body.message
        );
    }
}
