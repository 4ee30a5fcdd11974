//! `import`: JSON lines (SEMANTICS §9) and pi session files
//! (docs/pi-import.md) read as they stream, batched per session and
//! appended each at its session's head, with the line of any refusal;
//! what a retried or interrupted import stores again, and what it does not.

use super::*;

/// Lines of one session that `import` appends as one batch.
const IMPORT_BATCH: usize = 500;

/// The most bytes of input lines one batch of `import` holds (a batch
/// always takes its first line, whatever its size). A batch is held a few
/// times over while it is appended (the parsed events, the copy each
/// attempt sends, their JSON text): 500 lines of 200 KB tool outputs took
/// an import of 100 MB to 880 MB of memory.
const IMPORT_BATCH_BYTES: usize = 8 * 1024 * 1024;

/// Line `line` of an input, not UTF-8 text: said with its first bad byte.
fn not_utf8(line: usize, e: std::str::Utf8Error) -> CliError {
    CliError::Line {
        line,
        error: ValidationError::new(
            Rule::MalformedJson,
            None,
            format!(
                "the line is not UTF-8 text (byte {} is not valid UTF-8)",
                e.valid_up_to() + 1
            ),
        ),
    }
}

/// Whether an event of `bytes` starts a new batch after `held` events of
/// `held_bytes`: past `most` events or [`IMPORT_BATCH_BYTES`].
fn batch_is_full(held: usize, held_bytes: usize, bytes: usize, most: usize) -> bool {
    held >= most || (held > 0 && held_bytes.saturating_add(bytes) > IMPORT_BATCH_BYTES)
}

/// A SIGINT or SIGTERM that asks a running `import` to stop. The append
/// in flight is let finish (it commits whole or not at all, and its
/// answer says which), then the import stops before its next one and says
/// which lines are stored, so that the user knows where a re-run resumes:
/// killed outright, it said nothing, and input without event ids could
/// not be resumed safely (a review's finding). A second signal ends the
/// process at once.
#[derive(Clone)]
pub(crate) struct Interrupt(tokio::sync::watch::Receiver<Option<Signal>>);

/// The signal that stopped an import, with the exit code a shell gives a
/// process that signal kills (128 + its number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signal {
    /// `SIGINT` or `SIGTERM`.
    pub name: &'static str,
    /// 130 or 143.
    pub exit_code: i32,
}

impl Interrupt {
    /// One that never comes (the library's `import`, tests).
    pub(crate) fn never() -> Interrupt {
        Interrupt(tokio::sync::watch::channel(None).1)
    }

    /// SIGINT and SIGTERM, from now on. Where they cannot be listened for,
    /// they keep their default (the process ends), as before.
    pub(crate) fn on_signals() -> Interrupt {
        let (tx, rx) = tokio::sync::watch::channel(None);
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut int), Ok(mut term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) else {
                return Interrupt(rx);
            };
            tokio::spawn(async move {
                let mut seen = false;
                loop {
                    let got = tokio::select! {
                        _ = int.recv() => Signal { name: "SIGINT", exit_code: 130 },
                        _ = term.recv() => Signal { name: "SIGTERM", exit_code: 143 },
                    };
                    if seen {
                        eprintln!(
                            "session-store: {} again: stopping now; the append in flight, if any, is stored whole or not at all",
                            got.name
                        );
                        std::process::exit(got.exit_code);
                    }
                    seen = true;
                    tracing::info!(
                        signal = got.name,
                        "import: stopping after the append in flight"
                    );
                    let _ = tx.send(Some(got));
                }
            });
        }
        Interrupt(rx)
    }

    /// The signal received, if one was.
    fn received(&self) -> Option<Signal> {
        *self.0.borrow()
    }

    /// Waits for the signal (for ever when none can come).
    async fn arrived(&mut self) -> Signal {
        match self.0.wait_for(Option::is_some).await {
            Ok(s) => s.unwrap_or(Signal {
                name: "SIGINT",
                exit_code: 130,
            }),
            Err(_) => std::future::pending().await,
        }
    }
}

/// `file`, or standard input without one, for reading lines.
pub(super) fn open_input(file: Option<&PathBuf>) -> Result<Box<dyn BufRead + Send>, CliError> {
    Ok(match file {
        // `-` is standard input, as for most tools that read files.
        // A directory opens, and fails at its first read ("cannot read
        // line 1 of the input: Is a directory", without its name).
        Some(path) if path.is_dir() => {
            return Err(CliError::Io(format!(
                "cannot read {}: it is a directory, not a file of events",
                path.display()
            )))
        }
        Some(path) if path.as_os_str() != "-" => Box::new(std::io::BufReader::new(
            std::fs::File::open(path)
                .map_err(|e| CliError::Io(format!("cannot read {}: {e}", path.display())))?,
        )),
        _ => Box::new(std::io::BufReader::new(std::io::stdin())),
    })
}

/// A line that holds only JSON's whitespace (space, tab, CR, LF), which
/// `import` and `append` skip. Other blanks (a form feed, U+00A0, U+3000)
/// are not JSON's, so a line of them is a malformed line, said as such.
fn is_blank(line: &[u8]) -> bool {
    line.iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
}

/// The longest line of a pi session file `import --format pi` reads: an
/// entry may carry more than the events made of it (a tool result's
/// `details`, of which only `addedToolNames` is kept), so more than a JSON
/// line's [`crate::event::line_limit`], but not without end.
pub fn pi_line_limit(max_event_bytes: usize) -> usize {
    crate::event::line_limit(max_event_bytes).max(64 << 20)
}

/// A pi session file copied to a temporary file without a name (in
/// `TMPDIR`; the system frees it when the process ends, however it ends),
/// so that the import can read it more than once (its tree, then its path,
/// docs/pi-import.md "Size") without holding it: standard input cannot be
/// read twice, and a pi still writing the file would give the passes
/// different lines.
pub struct PiSpool {
    file: std::fs::File,
}

impl std::fmt::Debug for PiSpool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PiSpool").field("file", &self.file).finish()
    }
}

impl PiSpool {
    /// Copies `input` whole, line by line, checking that each line is
    /// UTF-8 text of at most `limit` bytes (`pi_line_limit`): a file
    /// that is not is refused before any of it is read as pi entries, and
    /// a line is never held past the limit (`/dev/zero` as the input grew
    /// until the allocator aborted the process).
    pub fn copy(mut input: Box<dyn BufRead + Send>, limit: usize) -> Result<PiSpool, CliError> {
        let tmp_error = |e: std::io::Error| {
            CliError::Io(format!(
                "cannot copy the pi session file to a temporary file in {}: {e}",
                std::env::temp_dir().display()
            ))
        };
        let mut file = tempfile::tempfile().map_err(tmp_error)?;
        let mut out = std::io::BufWriter::new(&mut file);
        let mut line = Vec::new();
        for n in 1.. {
            line.clear();
            // The limit is on the line's text: room for its CR and LF.
            let cap = (limit as u64).saturating_add(2);
            let read = <&mut Box<dyn BufRead + Send> as std::io::Read>::take(&mut input, cap)
                .read_until(b'\n', &mut line)
                .map_err(|e| CliError::Io(format!("cannot read line {n} of the input: {e}")))?;
            if read == 0 {
                break;
            }
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            let text_len = text.strip_suffix(b"\r").unwrap_or(text).len();
            if text_len > limit {
                return Err(CliError::Line {
                    line: n,
                    error: ValidationError::new(
                        Rule::TooLarge,
                        None,
                        format!(
                            "the line is over {limit} bytes, the most a line of a pi session file may hold (64 MiB, or six times --max-event-bytes and {} KiB when that is more)",
                            crate::event::LINE_ENVELOPE_BYTES / 1024
                        ),
                    ),
                });
            }
            // Said as the JSON lines' import says it: the line's fault
            // (exit 1), with the byte, not as input that could not be read.
            if let Err(e) = std::str::from_utf8(&line) {
                return Err(not_utf8(n, e));
            }
            out.write_all(&line).map_err(tmp_error)?;
        }
        out.flush().map_err(tmp_error)?;
        drop(out);
        Ok(PiSpool { file })
    }

    /// The file's non-blank lines, numbered from 1, from its start (each
    /// call reads with an offset of its own).
    pub fn lines(
        &self,
    ) -> Result<impl Iterator<Item = Result<(usize, String), CliError>> + Send + '_, CliError> {
        let reader = SpoolReader {
            file: &self.file,
            at: 0,
        };
        let lines = std::io::BufReader::new(reader).lines().enumerate();
        Ok(lines.filter_map(|(i, line)| match line {
            Err(e) => Some(Err(CliError::Io(format!(
                "cannot read line {} of the input: {e}",
                i + 1
            )))),
            Ok(l) => {
                // A byte order mark some editors put first is not text.
                let l = match i {
                    0 => l.strip_prefix('\u{feff}').map(str::to_owned).unwrap_or(l),
                    _ => l,
                };
                match is_blank(l.as_bytes()) {
                    true => None,
                    false => Some(Ok((i + 1, l))),
                }
            }
        }))
    }
}

/// A reader of the spool from its start, at an offset of its own.
struct SpoolReader<'f> {
    file: &'f std::fs::File,
    at: u64,
}

impl std::io::Read for SpoolReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let n = self.file.read_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// The input's non-blank lines, read one at a time, so that `import`
/// holds one batch of the input, never all of it: a producer piped into
/// `import` has each batch stored (500 lines of one session, a change of
/// session, or the end of the input) while it still runs, and a huge
/// input costs no more memory than a small one. A line is read up to `limit` bytes: a
/// longer one is refused (as `parse_line` would refuse it) without being
/// held whole.
pub struct InputLines {
    reader: Box<dyn BufRead + Send>,
    number: usize,
    limit: usize,
    buf: Vec<u8>,
    done: bool,
}

impl std::fmt::Debug for InputLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputLines")
            .field("number", &self.number)
            .field("limit", &self.limit)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl InputLines {
    /// The lines of `reader`.
    pub fn new(reader: Box<dyn BufRead + Send>, limit: usize) -> InputLines {
        InputLines {
            reader,
            number: 0,
            limit,
            buf: Vec::new(),
            done: false,
        }
    }

    fn read_one(&mut self) -> Result<Option<(usize, String)>, CliError> {
        loop {
            self.number += 1;
            let line = self.number;
            let mut buf = std::mem::take(&mut self.buf);
            buf.clear();
            let read = self.read_piece(&mut buf);
            self.buf = buf;
            if read? == 0 {
                return Ok(None);
            }
            let ended = self.buf.last() == Some(&b'\n');
            if ended {
                self.buf.pop();
                if self.buf.last() == Some(&b'\r') {
                    self.buf.pop();
                }
            }
            if self.buf.len() > self.limit {
                if self.blank_to_end_of_line(ended)? {
                    continue;
                }
                return Err(CliError::Line {
                    line,
                    error: ValidationError::new(
                        Rule::TooLarge,
                        None,
                        format!(
                            "the line is over {} bytes, the most a line may hold (six times --max-event-bytes, for escapes, and {} KiB for its envelope and spacing)",
                            self.limit,
                            crate::event::LINE_ENVELOPE_BYTES / 1024
                        ),
                    ),
                });
            }
            // A byte order mark some editors put first is not text. It is
            // dropped once the line is known to be whole (it counts
            // against the limit, which has room to spare for it).
            if line == 1 && self.buf.starts_with(UTF8_BOM) {
                self.buf.drain(..UTF8_BOM.len());
            }
            let text = match std::str::from_utf8(&self.buf) {
                Ok(text) => text,
                Err(e) => return Err(not_utf8(line, e)),
            };
            if !is_blank(text.as_bytes()) {
                return Ok(Some((line, text.to_owned())));
            }
        }
    }

    /// Reads into `into` up to the end of the line, or one byte past the
    /// limit and the newline: enough to know a line is too long without
    /// reading the rest of it. Returns the bytes read (0 at the end).
    fn read_piece(&mut self, into: &mut Vec<u8>) -> Result<usize, CliError> {
        let cap = (self.limit as u64).saturating_add(2);
        <&mut Box<dyn BufRead + Send> as std::io::Read>::take(&mut self.reader, cap)
            .read_until(b'\n', into)
            .map_err(|e| {
                CliError::Io(format!(
                    "cannot read line {} of the input: {e}",
                    self.number
                ))
            })
    }

    /// A line over the limit that is blank so far: reads the rest of it (up
    /// to its newline, unless `ended` says it was read) a piece at a time,
    /// and says whether all of it was blank (a blank line is skipped
    /// whatever its length, as a short one is).
    fn blank_to_end_of_line(&mut self, mut ended: bool) -> Result<bool, CliError> {
        let mut piece = std::mem::take(&mut self.buf);
        let mut blank = is_blank(&piece);
        while blank && !ended {
            piece.clear();
            let read = self.read_piece(&mut piece)?;
            ended = read == 0 || piece.last() == Some(&b'\n');
            blank = is_blank(&piece);
        }
        self.buf = piece;
        Ok(blank)
    }
}

impl Iterator for InputLines {
    type Item = Result<(usize, String), CliError>;

    /// The next non-blank line, numbered from 1; after an error, nothing.
    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let next = self.read_one().transpose();
        self.done = !matches!(next, Some(Ok(_)));
        next
    }
}

/// One line that [`InputLines`] read, parsed as `kind`: the line's number
/// and event, or the error naming the line.
pub(super) fn parse_input_line(
    line: Result<(usize, String), CliError>,
    kind: LineKind,
    max_bytes: usize,
) -> Result<(usize, ParsedLine), CliError> {
    let (n, text) = line?;
    parse_line(&text, kind, max_bytes)
        .map(|p| (n, p))
        .map_err(|mut error| {
            // A pi session file's header, given to the JSONL import.
            if kind == LineKind::Import
                && n == 1
                && error.rule == Rule::MissingField
                && error.field.as_deref() == Some("session_id")
                && serde_json::from_str::<serde_json::Value>(&text)
                    .is_ok_and(|v| v["type"] == "session")
            {
                error
                    .message
                    .push_str("; this looks like a pi session file: import it with --format pi");
            }
            CliError::Line { line: n, error }
        })
}

/// Turns a batch-indexed validation error into one that names the line.
pub(super) fn at_line(e: Error, line_numbers: &[usize]) -> CliError {
    match e {
        Error::Invalid(mut v) => match v.index.take() {
            Some(i) if i < line_numbers.len() => CliError::Line {
                line: line_numbers[i],
                error: v,
            },
            _ => Error::Invalid(v).into(),
        },
        other => other.into(),
    }
}

/// What an import stored.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ImportSummary {
    /// Events written.
    pub written: usize,
    /// Lines that were already stored (idempotent retries).
    pub replayed: usize,
    /// Of `replayed`, lines a retry found stored after an attempt's answer
    /// was lost (a connection cut at its commit): most likely stored by
    /// this import.
    pub confirmed: usize,
    /// Distinct sessions touched.
    pub sessions: usize,
    /// The last line of the input whose event is stored (0: none yet):
    /// every line up to it is, none after it (runs are stored in the
    /// input's order).
    pub through_line: usize,
}

/// Imports JSON lines (SEMANTICS §9): each event at its session's current
/// seq, consecutive lines of one session batched; a bad line (or a line
/// that cannot be read) stops the import with the lines before it stored
/// and nothing of it. `lines` is consumed as it goes ([`InputLines`]).
pub async fn import(
    store: &Store,
    lines: impl IntoIterator<Item = Result<(usize, String), CliError>>,
    max_bytes: usize,
) -> Result<ImportSummary, CliError> {
    let mut target = WriteTarget::of(store);
    let feed = Feed::Lines(lines.into_iter());
    import_fed(&mut target, feed, max_bytes, Interrupt::never()).await
}

/// How long `import` waits for the next line of its input before it
/// stores the lines it holds: a producer piped into it that pauses has
/// what it wrote stored, not held until 500 lines of one session come.
pub const IMPORT_IDLE: std::time::Duration = std::time::Duration::from_millis(200);

/// [`import()`] of lines read on a thread of their own: a run is also
/// stored when the input has nothing more for [`IMPORT_IDLE`] (a
/// producer that pauses), not only at 500 lines of one session, another
/// session or the end. At most one run of lines is read ahead.
pub(crate) async fn import_piped(
    target: &mut WriteTarget<'_>,
    lines: impl Iterator<Item = Result<(usize, String), CliError>> + Send + 'static,
    max_bytes: usize,
    interrupt: Interrupt,
) -> Result<ImportSummary, CliError> {
    let (tx, rx) = tokio::sync::mpsc::channel(IMPORT_BATCH);
    // A plain thread: it may block on the input for ever (a producer that
    // never writes again), and the process does not wait for it at exit.
    std::thread::spawn(move || {
        for line in lines {
            if tx.blocking_send(line).is_err() {
                return;
            }
        }
    });
    let feed = Feed::<std::iter::Empty<_>>::Piped(rx);
    import_fed(target, feed, max_bytes, interrupt).await
}

type InputLine = Result<(usize, String), CliError>;

/// Where `import` takes its lines from.
enum Feed<I> {
    /// As the caller's iterator gives them.
    Lines(I),
    /// From a reading thread, with a wait for each.
    Piped(tokio::sync::mpsc::Receiver<InputLine>),
}

/// What `import`'s input gives next.
enum Fed {
    Line(InputLine),
    /// Nothing for [`IMPORT_IDLE`]: store the run held so far.
    Idle,
    End,
}

impl<I: Iterator<Item = InputLine>> Feed<I> {
    /// The next line; `holding` says lines wait to be stored, so that a
    /// pause of the input is worth saying.
    async fn next(&mut self, holding: bool) -> Fed {
        let line = match self {
            Feed::Lines(lines) => lines.next(),
            Feed::Piped(rx) if !holding => rx.recv().await,
            Feed::Piped(rx) => match tokio::time::timeout(IMPORT_IDLE, rx.recv()).await {
                Ok(line) => line,
                Err(_) => return Fed::Idle,
            },
        };
        line.map_or(Fed::End, Fed::Line)
    }
}

async fn import_fed<I: Iterator<Item = InputLine>>(
    target: &mut WriteTarget<'_>,
    feed: Feed<I>,
    max_bytes: usize,
    interrupt: Interrupt,
) -> Result<ImportSummary, CliError> {
    let mut summary = ImportSummary::default();
    match import_into(target, feed, max_bytes, &mut summary, interrupt).await {
        Ok(()) => Ok(summary),
        Err(e @ CliError::Interrupted { .. }) => Err(e),
        // The lines before the bad one are stored (§9): say how many, so
        // the user knows what a re-run will find.
        Err(e) if summary.written + summary.replayed > 0 => Err(CliError::ImportStopped {
            cause: Box::new(e),
            written: summary.written,
            replayed: summary.replayed,
            confirmed: summary.confirmed,
        }),
        Err(e) => Err(e),
    }
}

async fn import_into<I: Iterator<Item = InputLine>>(
    target: &mut WriteTarget<'_>,
    mut feed: Feed<I>,
    max_bytes: usize,
    summary: &mut ImportSummary,
    mut interrupt: Interrupt,
) -> Result<(), CliError> {
    let mut sessions: HashSet<Uuid> = HashSet::new();
    let mut batch: Vec<(usize, NewEvent)> = Vec::new();
    let mut batch_bytes = 0;
    let mut batch_session = None;
    loop {
        // A signal stops the import between appends, never within one
        // (`flush` is not raced against it): the lines held and not yet
        // sent are not stored, and said so.
        let next = tokio::select! {
            biased;
            signal = interrupt.arrived() => {
                summary.sessions = sessions.len();
                return Err(CliError::Interrupted {
                    signal,
                    through_line: summary.through_line,
                    stored: summary.written + summary.replayed,
                    replayed: summary.replayed,
                    pi_session: None,
                });
            }
            next = feed.next(!batch.is_empty()) => next,
        };
        let line = match next {
            Fed::Line(line) => line,
            Fed::End => break,
            Fed::Idle => {
                flush_held(
                    target,
                    batch_session.take(),
                    &mut batch,
                    &mut sessions,
                    summary,
                )
                .await?;
                continue;
            }
        };
        let bytes = line.as_ref().map_or(0, |(_, text)| text.len());
        let parsed = parse_input_line(line, LineKind::Import, max_bytes);
        let (n, ParsedLine { session_id, event }) = match parsed {
            Ok(p) => p,
            Err(error) => {
                flush_held(
                    target,
                    batch_session.take(),
                    &mut batch,
                    &mut sessions,
                    summary,
                )
                .await?;
                return Err(error);
            }
        };
        let session = session_id.unwrap_or_default();
        // A line repeating an event id of the current batch starts a new
        // batch, so it is judged as its own append would be (an idempotent
        // retry, or a reused id), not as a duplicate within one batch.
        let repeats = event
            .event_id
            .is_some_and(|id| batch.iter().any(|(_, e)| e.event_id == Some(id)));
        if batch_session != Some(session)
            || batch_is_full(batch.len(), batch_bytes, bytes, IMPORT_BATCH)
            || repeats
        {
            flush_held(target, batch_session, &mut batch, &mut sessions, summary).await?;
            batch_session = Some(session);
            batch_bytes = 0;
        }
        batch.push((n, event));
        batch_bytes += bytes;
    }
    flush_held(target, batch_session, &mut batch, &mut sessions, summary).await?;
    summary.sessions = sessions.len();
    info!(
        written = summary.written,
        replayed = summary.replayed,
        "import done"
    );
    Ok(())
}

/// [`flush`] of the run held, if there is one (`held`, its session): its
/// lines are moved out of `batch`.
async fn flush_held(
    target: &mut WriteTarget<'_>,
    held: Option<Uuid>,
    batch: &mut Vec<(usize, NewEvent)>,
    sessions: &mut HashSet<Uuid>,
    summary: &mut ImportSummary,
) -> Result<(), CliError> {
    match held {
        Some(session) => flush(target, session, std::mem::take(batch), sessions, summary).await,
        None => Ok(()),
    }
}

/// Appends one session's run of lines. On a validation error the valid
/// prefix is appended and the bad line reported; a batch that is partly
/// stored already (an import re-run after a stop) goes line by line.
async fn flush(
    target: &mut WriteTarget<'_>,
    session: Uuid,
    batch: Vec<(usize, NewEvent)>,
    sessions: &mut HashSet<Uuid>,
    summary: &mut ImportSummary,
) -> Result<(), CliError> {
    if batch.is_empty() {
        return Ok(());
    }
    tracing::debug!(
        %session,
        lines = batch.len(),
        first_line = batch[0].0,
        "import: appending a batch"
    );
    match append_at_head(target, session, &batch, sessions, summary).await {
        Ok(()) => Ok(()),
        Err(Error::Invalid(v)) if v.rule == Rule::PartlyStoredBatch => {
            for one in batch.chunks(1) {
                append_at_head(target, session, one, sessions, summary)
                    .await
                    .map_err(|e| at_line(e, &[one[0].0]))?;
            }
            Ok(())
        }
        Err(Error::Invalid(v)) => {
            let bad = v.index.unwrap_or(0).min(batch.len() - 1);
            if bad > 0 {
                Box::pin(flush(
                    target,
                    session,
                    batch[..bad].to_vec(),
                    sessions,
                    summary,
                ))
                .await?;
            }
            let lines: Vec<usize> = batch.iter().map(|(n, _)| *n).collect();
            let mut v = v;
            v.index = v.index.map(|_| bad);
            Err(at_line(Error::Invalid(v), &lines))
        }
        // The storage failed: the run's lines are named, so that the user
        // knows where a re-run resumes.
        Err(e) => Err(CliError::LinesNotStored {
            first: batch[0].0,
            last: batch[batch.len() - 1].0,
            session,
            cause: e,
        }),
    }
}

async fn append_at_head(
    target: &mut WriteTarget<'_>,
    session: Uuid,
    batch: &[(usize, NewEvent)],
    sessions: &mut HashSet<Uuid>,
    summary: &mut ImportSummary,
) -> Result<(), Error> {
    let events: Vec<NewEvent> = batch.iter().map(|(_, e)| e.clone()).collect();
    let outcome = target
        .append_at_head(session, events, &RetryPolicy::default())
        .await?;
    sessions.insert(session);
    if outcome.replayed {
        summary.replayed += outcome.events.len();
        if outcome.confirmed_on_retry {
            summary.confirmed += outcome.events.len();
        }
    } else {
        summary.written += outcome.events.len();
    }
    summary.through_line = batch.last().map_or(summary.through_line, |(n, _)| *n);
    Ok(())
}

/// Imports a pi file's path (its tree read from `spool`) all or nothing as
/// far as the file goes. A session that already holds a prefix of it (an
/// earlier import of this file, or of a shorter version of it) gets only
/// the rest; one that holds anything else is left alone with an error.
pub async fn import_pi(
    store: &Store,
    tree: &crate::pi::PiTree,
    spool: &PiSpool,
    max_bytes: usize,
) -> Result<ImportSummary, CliError> {
    let target = &mut WriteTarget::of(store);
    import_pi_into(target, tree, spool, max_bytes, &Interrupt::never()).await
}

/// [`import_pi`] into `target`: a file the judging pass refuses is refused
/// without opening a store that is not there yet (`target.rs`).
pub(crate) async fn import_pi_into(
    target: &mut WriteTarget<'_>,
    tree: &crate::pi::PiTree,
    spool: &PiSpool,
    max_bytes: usize,
    interrupt: &Interrupt,
) -> Result<ImportSummary, CliError> {
    // Another import of the same file (or of a longer one) may append
    // between the read of the session and an append: the append then
    // conflicts, or finds part of its batch stored, and is judged again
    // against what the other one wrote.
    let mut attempts = 0;
    loop {
        attempts += 1;
        match import_pi_once(target, tree, spool, max_bytes, interrupt).await {
            Err(PiAttempt::Raced(_)) if attempts < 5 => {
                tracing::debug!(session = %tree.session_id(), attempts, "pi import raced another writer; judged again");
            }
            Err(PiAttempt::Raced(e)) | Err(PiAttempt::Failed(e)) => return Err(e),
            Ok(summary) => return Ok(summary),
        }
    }
}

/// How one attempt of [`import_pi`] ended without importing.
enum PiAttempt {
    /// Another writer appended to the session since it was read.
    Raced(CliError),
    /// Anything else, final.
    Failed(CliError),
}

impl From<Error> for PiAttempt {
    fn from(e: Error) -> PiAttempt {
        PiAttempt::Failed(e.into())
    }
}

impl From<CliError> for PiAttempt {
    fn from(e: CliError) -> PiAttempt {
        PiAttempt::Failed(e)
    }
}

/// Events a pi import appends at once (at most [`IMPORT_BATCH_BYTES`] of
/// them, as `import`'s batches). The whole file is judged before
/// the first run is written, so a run is refused only by a race or by
/// storage; one batch of the whole path held every event of a large file
/// in the store's judging at once (600 MB for 100 000 entries).
const PI_RUN: usize = 1_000;

/// Two passes over the file's path, one event converted at a time: the
/// first compares the events the session holds with the stored ones and
/// judges the rest as the store would judge them as one batch (§4: size,
/// time, each event against the session as it stands before it), without
/// writing; the second writes the rest in runs of [`PI_RUN`].
async fn import_pi_once(
    target: &mut WriteTarget<'_>,
    tree: &crate::pi::PiTree,
    spool: &PiSpool,
    max_bytes: usize,
    interrupt: &Interrupt,
) -> Result<ImportSummary, PiAttempt> {
    let id = tree.session_id();
    // A signal stops the import between its appends (see [`Interrupt`]).
    let stop = |signal: Signal, stored: i64, replayed: i64| {
        PiAttempt::Failed(CliError::Interrupted {
            signal,
            through_line: 0,
            stored: stored as usize,
            replayed: replayed as usize,
            pi_session: Some(id),
        })
    };
    // The judging pass's reads (the throw-away store where the store is
    // not there yet, which holds nothing as it does).
    let tenant = target.tenant().map(str::to_owned);
    let store = target.reader().await?;
    let head = store.head_seq(id).await?;
    // For a tenant, whose the session is comes first (as for an append,
    // SEMANTICS §2's order): another tenant's session is refused before
    // its events are compared with the file's. An empty append at the
    // head judges it and writes nothing.
    if let Some(tenant) = &tenant {
        if let Err(Error::SessionNotFound(session_id)) =
            store.append_as(Some(tenant), id, head, Vec::new()).await
        {
            return Err(PiAttempt::Failed(CliError::Store(Error::OtherTenant {
                session_id,
                tenant: tenant.clone(),
            })));
        }
    }
    let different = |seq: i64, what: String| {
        PiAttempt::Failed(CliError::Input(format!(
            "session {id} already holds events this file does not produce (seq {seq}: {what}); \
             it was imported from another branch or version of the pi file, or written by something else, \
             and is left unchanged. To keep both: `export` it to keep a copy, then import the file \
             into a store that does not hold this session (its id comes from the file's header; \
             docs/pi-import.md, \"Re-import\")"
        )))
    };
    // The judging state keeps the window's rows without their texts.
    let mut state = crate::projector::SessionState::empty(id);
    let now = chrono::Utc::now();
    let mut page = Vec::new().into_iter();
    let mut made: i64 = 0;
    // The first difference from the stored session, or the first event
    // the store would refuse. The file is still converted to its end after
    // either: an error in the file is said first, whatever the store holds
    // or would refuse.
    let mut differs = None;
    // The events past the head whose ids are still to be looked up: an id
    // another session holds would be refused by the store (SEMANTICS §2)
    // only once the runs before it were written.
    let mut unlooked: Vec<Unlooked> = Vec::new();
    for p in tree.events(spool.lines()?) {
        // Before the stored events are compared with the file's: nothing
        // said of them, and nothing written.
        if let Some(signal) = interrupt.received() {
            return Err(stop(signal, 0, 0));
        }
        let p = p?;
        let seq = made + 1;
        made = seq;
        if differs.is_some() {
            continue;
        }
        if seq <= head {
            // The stored event at this seq, read a page at a time.
            let s = match page.next() {
                Some(s) => s,
                None => {
                    page = store
                        .history_within(id, seq - 1, 1_000, crate::store::PAGE_BYTES)
                        .await?
                        .into_iter();
                    page.next().ok_or_else(|| {
                        PiAttempt::Failed(CliError::Store(Error::Database(format!(
                            "session {id} held {head} events, but no event after seq {} could be read",
                            seq - 1
                        ))))
                    })?
                }
            };
            if Some(s.event_id) != p.event.event_id || !s.body.same_content(&p.event.body) {
                let what = match Some(s.event_id) == p.event.event_id {
                    // The same entry, edited since it was imported.
                    true => format!(
                        "stored {} {} differs in content from what line {} gives",
                        s.body.type_name(),
                        s.event_id,
                        p.line
                    ),
                    false => format!(
                        "stored {} {}, but line {} gives {} {}",
                        s.body.type_name(),
                        s.event_id,
                        p.line,
                        p.event.body.type_name(),
                        p.event.event_id.unwrap_or_default()
                    ),
                };
                differs = Some(different(seq, what));
                continue;
            }
        } else {
            let e = &p.event;
            let len = e.body.to_json_text().len();
            if let Err(v) = crate::validate::check_new_event(&state, e, len, max_bytes) {
                // An id of an earlier event stored elsewhere comes first.
                differs = Some(match stored_elsewhere(store, id, &mut unlooked).await? {
                    Some(earlier) => earlier,
                    None => PiAttempt::Failed(pi_refusal(
                        Error::Invalid(v.at_index(0)),
                        std::slice::from_ref(&p),
                    )),
                });
                continue;
            }
            if let Some(event_id) = e.event_id {
                unlooked.push(Unlooked {
                    event_id,
                    line: p.line,
                    entry_id: p.entry_id.clone(),
                });
            }
            if unlooked.len() >= PI_RUN {
                differs = stored_elsewhere(store, id, &mut unlooked).await?;
                if differs.is_some() {
                    continue;
                }
            }
        }
        let e = p.event;
        state.apply_shed(crate::event::StoredEvent {
            session_id: id,
            seq,
            event_id: e.event_id.unwrap_or_default(),
            position: 0,
            recorded_at: e.recorded_at.unwrap_or(now),
            body: e.body,
        });
    }
    drop(state);
    if differs.is_none() {
        differs = stored_elsewhere(store, id, &mut unlooked).await?;
    }
    if let Some(e) = differs {
        return Err(e);
    }
    if made < head {
        return Err(different(
            made + 1,
            format!("the session goes on past the file's {made} events"),
        ));
    }
    let mut summary = ImportSummary {
        written: 0,
        replayed: head as usize,
        confirmed: 0,
        sessions: 1,
        through_line: 0,
    };
    // The writes, to the store itself.
    let store = target.store().await?;
    let mut events = tree.events(spool.lines()?).skip(head as usize).peekable();
    let mut at = head;
    // The size of a converted event as its run weighs it (an error ends
    // the run, and is then said).
    let weight = |p: &Result<crate::pi::PiEvent, CliError>| {
        p.as_ref().map_or(0, |p| p.event.body.heap_bytes())
    };
    loop {
        if let Some(signal) = interrupt.received() {
            return Err(stop(signal, at, head));
        }
        let mut run = Vec::new();
        let mut run_bytes = 0;
        while let Some(p) =
            events.next_if(|p| !batch_is_full(run.len(), run_bytes, weight(p), PI_RUN))
        {
            let p = p?;
            run_bytes += p.event.body.heap_bytes();
            run.push(p);
        }
        if run.is_empty() {
            break;
        }
        let batch = run.iter().map(|e| e.event.clone()).collect();
        let appended = store.append_as(tenant.as_deref(), id, at, batch).await;
        let outcome = appended.map_err(|e| match e {
            Error::SessionNotFound(session_id) if tenant.is_some() => {
                PiAttempt::Failed(CliError::Store(Error::OtherTenant {
                    session_id,
                    tenant: tenant.clone().unwrap_or_default(),
                }))
            }
            Error::Conflict { .. } => PiAttempt::Raced(e.into()),
            Error::Invalid(v) if v.rule == Rule::PartlyStoredBatch => {
                PiAttempt::Raced(Error::Invalid(v).into())
            }
            e @ Error::Invalid(_) => PiAttempt::Failed(pi_refusal(e, &run)),
            other => other.into(),
        })?;
        at += run.len() as i64;
        if outcome.replayed {
            summary.replayed += outcome.events.len();
        } else {
            summary.written += outcome.events.len();
        }
    }
    info!(session = %id, written = summary.written, replayed = summary.replayed, "pi import done");
    Ok(summary)
}

/// A store's refusal of one of `events`, said with the pi line, entry and
/// field it came from.
fn pi_refusal(e: Error, events: &[crate::pi::PiEvent]) -> CliError {
    let Error::Invalid(mut v) = e else {
        return e.into();
    };
    match v.index.take().and_then(|i| events.get(i)) {
        Some(at) => {
            let field = v.field.as_deref().map(|f| match f {
                "first_kept_event_id" => at.kept_field.to_owned(),
                f => pi_field(f, &at.event.body),
            });
            pi_error(&v, at.line, at.entry_id.as_deref(), field)
        }
        None => Error::Invalid(v).into(),
    }
}

/// Refusal `v` of the event made from the entry `entry_id` (`None`: the
/// header) at `line`, its store field said as the pi `field` it came from.
fn pi_error(
    v: &ValidationError,
    line: usize,
    entry_id: Option<&str>,
    field: Option<String>,
) -> CliError {
    CliError::Pi(crate::pi::PiError {
        line,
        field,
        message: match entry_id {
            Some(entry) => format!("pi entry {entry:?}: {} (rule {})", v.message, v.rule),
            None => format!("the session header: {} (rule {})", v.message, v.rule),
        },
    })
}

/// An event past the head of the session a pi file is imported into,
/// whose id is still to be looked up in the store.
struct Unlooked {
    event_id: Uuid,
    line: usize,
    entry_id: Option<String>,
}

/// Looks `unlooked` up in the store (then empties it): the refusal of the
/// first whose id another session holds, as the store would refuse it
/// (SEMANTICS §2), or `None`. An id this session holds is left to the
/// store's own judgement when its run is appended: the events up to the
/// head were compared with the file already.
async fn stored_elsewhere(
    store: &Store,
    session_id: Uuid,
    unlooked: &mut Vec<Unlooked>,
) -> Result<Option<PiAttempt>, PiAttempt> {
    let ids: Vec<Uuid> = unlooked.iter().map(|u| u.event_id).collect();
    let elsewhere: HashSet<Uuid> = store
        .stored_events(&ids)
        .await?
        .into_iter()
        .filter(|s| s.session_id != session_id)
        .map(|s| s.event_id)
        .collect();
    let first = unlooked.iter().find(|u| elsewhere.contains(&u.event_id));
    let refusal = first.map(|u| {
        let v = crate::store::event_id_reused(u.event_id);
        PiAttempt::Failed(pi_error(
            &v,
            u.line,
            u.entry_id.as_deref(),
            Some("id".to_owned()),
        ))
    });
    unlooked.clear();
    Ok(refusal)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spool(text: &str, limit: usize) -> Result<Vec<String>, CliError> {
        let input: Box<dyn BufRead + Send> = Box::new(std::io::Cursor::new(text.to_owned()));
        let spool = PiSpool::copy(input, limit)?;
        let lines = spool.lines()?.map(|l| l.map(|(_, t)| t)).collect();
        lines
    }

    /// The limit is on a line's text, whatever ends it (LF, CR LF, or the
    /// end of the input), as for JSON lines.
    #[test]
    fn a_pi_line_of_exactly_the_limit_is_read_however_it_ends() {
        for ending in ["\n", "\r\n", ""] {
            let text = format!("{}{ending}", "x".repeat(10));
            assert_eq!(spool(&text, 10).unwrap(), ["x".repeat(10)], "{ending:?}");
            let text = format!("ok\n{}{ending}", "x".repeat(11));
            match spool(&text, 10) {
                Err(CliError::Line { line: 2, error }) => {
                    assert!(error.message.contains("over 10 bytes"), "{}", error.message)
                }
                other => panic!("{ending:?}: {other:?}"),
            }
        }
    }
}
