//! Session files of the pi coding agent (badlogic/pi-mono,
//! packages/coding-agent) turned into this store's events: pure, no I/O
//! (the lines come from the caller).
//!
//! A pi file is JSON lines: a `session` header, then entries that form a
//! tree through `id`/`parentId` (branching in place). What pi sends the
//! model is the path from the root to the leaf, the last entry of the file,
//! so that path becomes one session here and entries on other branches are
//! dropped. Session and event ids are derived (UUIDv5) from the pi session
//! id and the entry ids: importing the file again, or a longer version of
//! it, stores nothing twice. Every mapping decision is written down, with
//! its reason, in `docs/pi-import.md`.
//!
//! [`PiTree::read`] reads the tree (each entry's line and parent) in one
//! pass over the lines, and [`PiTree::events`] converts the path in
//! another, an entry at a time, so that a file of any length is never
//! held (docs/pi-import.md, "Size"). Everything that can be named in pi's
//! terms (line and pi field) is checked there, before anything is
//! appended; the store's own rules (§4) then judge the whole session as
//! one batch, and the CLI appends it in runs (docs/pi-import.md, "Errors").

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use sha1::{Digest, Sha1};
use uuid::Uuid;

use crate::event::{EventBody, NewEvent, ToolStatus};

/// The mode every imported session runs in: pi has no modes.
pub const MODE: &str = "agent";

/// The UUIDv5 namespace of pi session ids that are not UUIDs themselves.
pub const NAMESPACE: Uuid = Uuid::from_u128(0x6a1c_5e0b_29d4_4f3e_9b7a_0c2e_51f8_d4a7);

/// The current pi session format; older files are read as pi migrates them,
/// newer ones as this version ([`PiTree::newer_version`]).
pub const CURRENT_VERSION: u64 = 3;

/// Bad pi input: the line (1-based, as in the file), the pi field at fault
/// and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PiError {
    /// 1-based line number in the file.
    pub line: usize,
    /// The pi field at fault (`parentId`, `message.toolCallId`, …).
    pub field: Option<String>,
    /// One sentence saying what is wrong.
    pub message: String,
}

impl PiError {
    fn new(line: usize, field: Option<&str>, message: impl Into<String>) -> PiError {
        PiError {
            line,
            field: field.map(str::to_owned),
            message: message.into(),
        }
    }
}

impl fmt::Display for PiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)?;
        if let Some(field) = &self.field {
            write!(f, " (field `{field}`)")?;
        }
        Ok(())
    }
}

impl std::error::Error for PiError {}

/// One event of the imported session and where in the file it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct PiEvent {
    /// The line of the entry (or header) it was made from.
    pub line: usize,
    /// The pi entry id; `None` for the header's `session_started`.
    pub entry_id: Option<String>,
    /// The event, with its derived id and the entry's time.
    pub event: NewEvent,
    /// The pi field a compaction's `first_kept_event_id` was made from:
    /// `firstKeptEntryIndex` in a version 1 file, else `firstKeptEntryId`
    /// (a refusal of it names the field the file has).
    pub kept_field: &'static str,
}

/// A pi file as one session of this store.
#[derive(Clone, Debug, PartialEq)]
pub struct PiSession {
    /// The pi session id if it is a UUID, else its UUIDv5 in [`NAMESPACE`].
    pub session_id: Uuid,
    /// The events, in order, starting with `session_started`.
    pub events: Vec<PiEvent>,
    /// Entries of the file (header excluded).
    pub entries: usize,
    /// Entries not on the path to the leaf (other branches), dropped.
    pub off_path: usize,
    /// The header's version when newer than [`CURRENT_VERSION`]
    /// ([`PiTree::newer_version`]).
    pub newer_version: Option<u64>,
}

/// A name-based UUID (version 5, SHA-1) of `name` in `namespace`.
pub fn uuid_v5(namespace: Uuid, name: &str) -> Uuid {
    let mut hasher = Sha1::new();
    hasher.update(namespace.as_bytes());
    hasher.update(name.as_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_sha1_bytes(bytes).into_uuid()
}

/// The session id of a pi session id: itself when it is a UUID.
pub fn session_id_for(pi_id: &str) -> Uuid {
    Uuid::parse_str(pi_id).unwrap_or_else(|_| uuid_v5(NAMESPACE, pi_id))
}

/// One entry of the file on the path, as it is converted: its fields are
/// parsed only then, so that a large file's entries are never all held as
/// parsed JSON at once.
struct Entry {
    line: usize,
    id: String,
    kind: String,
    time: Option<DateTime<Utc>>,
    fields: Map<String, Value>,
}

/// One entry of the file in the tree: its line and its parent (an index
/// into [`PiTree::nodes`]), nothing else.
struct Node {
    line: usize,
    parent: Option<u32>,
}

/// A pi file's tree, from one pass over its lines: each entry's line and
/// parent, and the ids. The path to the leaf is known only once the whole
/// file is read, so the conversion is a second pass ([`PiTree::events`])
/// over the same lines, and neither pass holds the file, only about 100
/// bytes an entry (docs/pi-import.md, "Size").
pub struct PiTree {
    header_line: usize,
    header: Header,
    session_id: Uuid,
    nodes: Vec<Node>,
    by_id: HashMap<Box<str>, u32>,
    /// Node indexes from the root to the leaf, increasing (a parent comes
    /// before its children).
    path: Vec<u32>,
}

impl std::fmt::Debug for PiTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PiTree")
            .field("session_id", &self.session_id)
            .field("header_line", &self.header_line)
            .field("entries", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

/// What [`links`] reads of an entry: its type, id and parent id.
type Links = (String, String, Option<String>);

/// An entry's type, id and parent id, taken out of its fields. `previous`:
/// the id of the entry before it, a version 1 entry's parent.
fn links(
    n: usize,
    fields: &mut Map<String, Value>,
    version: u64,
    previous: Option<&str>,
) -> Result<Links, PiError> {
    let kind = match fields.remove("type") {
        Some(Value::String(s)) => s,
        None => return Err(PiError::new(n, Some("type"), "missing field `type`")),
        Some(other) => {
            return Err(PiError::new(
                n,
                Some("type"),
                format!("`type` must be a string, found {}", kind_of(&other)),
            ))
        }
    };
    let legacy = version < 2;
    let id = match fields.remove("id") {
        Some(Value::String(s)) if !s.is_empty() => s,
        None | Some(Value::Null) if legacy => format!("line-{n}"),
        None | Some(Value::Null) => {
            return Err(PiError::new(
                n,
                Some("id"),
                format!("missing field `id` (a version {version} file's entries carry ids)"),
            ))
        }
        Some(other) => {
            return Err(PiError::new(
                n,
                Some("id"),
                format!("`id` must be a non-empty string, found {}", shown(&other)),
            ))
        }
    };
    let parent = match fields.remove("parentId") {
        Some(Value::String(s)) => Some(s),
        Some(Value::Null) => None,
        // Version 1 files are linear: pi links each entry to the one
        // before it when it migrates them.
        None if legacy => previous.map(str::to_owned),
        // Version 2 and 3 entries always carry it (null at a root): one
        // without it would silently start a new root and drop every
        // entry before it from the path.
        None => {
            return Err(PiError::new(
                n,
                Some("parentId"),
                "missing field `parentId` (a version 2 or 3 entry names its parent, or null for a root)",
            ))
        }
        Some(other) => {
            return Err(PiError::new(
                n,
                Some("parentId"),
                format!(
                    "`parentId` must be a string or null, found {}",
                    kind_of(&other)
                ),
            ))
        }
    };
    Ok((kind, id, parent))
}

impl PiTree {
    /// Reads the tree from the file's non-blank lines (numbered from 1, as
    /// in the file), checking each entry's links and time.
    pub fn read<E: From<PiError>>(
        mut lines: impl Iterator<Item = Result<(usize, String), E>>,
    ) -> Result<PiTree, E> {
        let Some(first) = lines.next() else {
            return Err(PiError::new(
                1,
                None,
                "the file is empty; a pi session file starts with a `session` header line",
            )
            .into());
        };
        let (header_line, header_text) = first?;
        let header = Header::read(header_line, &parse_object(header_line, &header_text)?)?;
        let mut tree = PiTree {
            header_line,
            session_id: session_id_for(&header.id),
            header,
            nodes: Vec::new(),
            by_id: HashMap::new(),
            path: Vec::new(),
        };
        let mut previous = None;
        for line in lines {
            let (n, text) = line?;
            previous = Some(tree.add(n, &text, previous.as_deref())?);
        }
        // The leaf is the last entry; walk to the root. Parents come
        // earlier in the file, so the walk ends.
        let mut cursor = tree.nodes.len().checked_sub(1).map(|i| i as u32);
        while let Some(i) = cursor {
            tree.path.push(i);
            cursor = tree.nodes[i as usize].parent;
        }
        tree.path.reverse();
        Ok(tree)
    }

    /// The entry on line `n`; returns its id.
    fn add(&mut self, n: usize, text: &str, previous: Option<&str>) -> Result<String, PiError> {
        let mut fields = parse_object(n, text)?;
        if matches!(fields.get("type"), Some(Value::String(t)) if t == "session") {
            return Err(PiError::new(
                n,
                Some("type"),
                format!(
                    "a second `session` header (the header is line {}); a file holds one session",
                    self.header_line
                ),
            ));
        }
        let (_, id, parent) = links(n, &mut fields, self.header.version, previous)?;
        if let Some(&earlier) = self.by_id.get(id.as_str()) {
            return Err(PiError::new(
                n,
                Some("id"),
                format!(
                    "entry id {id:?} is already used by line {}",
                    self.nodes[earlier as usize].line
                ),
            ));
        }
        let parent = match &parent {
            None => None,
            Some(p) => Some(*self.by_id.get(p.as_str()).ok_or_else(|| {
                PiError::new(
                    n,
                    Some("parentId"),
                    format!(
                        "`parentId` {p:?} names no earlier entry of the file (a parent comes before its children)"
                    ),
                )
            })?),
        };
        timestamp(n, fields.get("timestamp"), "timestamp")?;
        let index = u32::try_from(self.nodes.len()).map_err(|_| {
            PiError::new(
                n,
                None,
                "the file holds more entries than the import can index (2^32)",
            )
        })?;
        self.by_id.insert(id.as_str().into(), index);
        self.nodes.push(Node { line: n, parent });
        Ok(id)
    }

    /// The id of node `i` (a search of every id: for error messages only).
    fn id_of(&self, i: u32) -> String {
        self.by_id
            .iter()
            .find(|(_, &j)| j == i)
            .map(|(id, _)| id.to_string())
            .unwrap_or_default()
    }

    /// The path position of node `i`, if it is on the path.
    fn path_pos(&self, i: u32) -> Option<usize> {
        self.path.binary_search(&i).ok()
    }

    /// The pi session id if it is a UUID, else its UUIDv5 in [`NAMESPACE`].
    pub fn session_id(&self) -> Uuid {
        self.session_id
    }

    /// The header's version when it is newer than [`CURRENT_VERSION`]: the
    /// file is read as that version, which its caller should say (a later
    /// pi may have added what this reading drops).
    pub fn newer_version(&self) -> Option<u64> {
        (self.header.version > CURRENT_VERSION).then_some(self.header.version)
    }

    /// Entries of the file (header excluded).
    pub fn entries(&self) -> usize {
        self.nodes.len()
    }

    /// Entries not on the path to the leaf (other branches), dropped.
    pub fn off_path(&self) -> usize {
        self.nodes.len() - self.path.len()
    }

    /// The session's events, in order, starting with `session_started`,
    /// converted one path entry at a time from `lines`: the same lines
    /// [`PiTree::read`] read (a line found elsewhere is an error). Every
    /// mapping check of docs/pi-import.md is made here; after an error the
    /// iterator ends.
    pub fn events<E: From<PiError>, I: Iterator<Item = Result<(usize, String), E>>>(
        &self,
        lines: I,
    ) -> PiEvents<'_, I> {
        let mut builder = Builder {
            session_id: self.session_id,
            events: Vec::new(),
            calls: HashMap::new(),
            catalog: BTreeSet::new(),
            first_row: vec![None; self.path.len()],
        };
        builder.events.push(PiEvent {
            line: self.header_line,
            entry_id: None,
            kept_field: KEPT_BY_ID,
            event: NewEvent {
                event_id: Some(uuid_v5(self.session_id, "session")),
                recorded_at: self.header.timestamp,
                body: EventBody::SessionStarted {
                    mode: MODE.to_owned(),
                    metadata: Some(self.header.metadata()),
                },
            },
        });
        PiEvents {
            tree: self,
            lines,
            pos: 0,
            builder,
            done: false,
        }
    }
}

/// The events of a [`PiTree`], converted as they are asked for.
pub struct PiEvents<'t, I> {
    tree: &'t PiTree,
    lines: I,
    /// The next path position to convert.
    pos: usize,
    /// Its `events` are the converted events not yet given out.
    builder: Builder,
    done: bool,
}

impl<I> std::fmt::Debug for PiEvents<'_, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PiEvents")
            .field("session_id", &self.tree.session_id)
            .field("pos", &self.pos)
            .finish_non_exhaustive()
    }
}

impl<E: From<PiError>, I: Iterator<Item = Result<(usize, String), E>>> PiEvents<'_, I> {
    /// Converts the entry at the next path position.
    fn convert_next(&mut self) -> Result<(), E> {
        let tree = self.tree;
        let want = tree.nodes[tree.path[self.pos] as usize].line;
        let text = loop {
            let Some(line) = self.lines.next() else {
                return Err(PiError::new(
                    want,
                    None,
                    "the file ended before this line when it was read again",
                )
                .into());
            };
            let (n, text) = line?;
            if n == want {
                break text;
            }
            if n > want {
                return Err(PiError::new(
                    want,
                    None,
                    "the file changed while it was read: this line is no longer an entry",
                )
                .into());
            }
        };
        let mut fields = parse_object(want, &text)?;
        // The parent was checked by `read`; only the type and id are used.
        let (kind, id, _) = links(want, &mut fields, tree.header.version, None)?;
        let entry = Entry {
            line: want,
            id,
            kind,
            time: timestamp(want, fields.get("timestamp"), "timestamp")?,
            fields,
        };
        self.builder
            .entry(self.pos, &entry, tree, tree.header.version)?;
        self.pos += 1;
        Ok(())
    }
}

impl<E: From<PiError>, I: Iterator<Item = Result<(usize, String), E>>> Iterator
    for PiEvents<'_, I>
{
    type Item = Result<PiEvent, E>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if !self.builder.events.is_empty() {
                return Some(Ok(self.builder.events.remove(0)));
            }
            if self.done || self.pos >= self.tree.path.len() {
                return None;
            }
            // An entry makes a few events at most: taking them from the
            // front one by one is cheap.
            if let Err(e) = self.convert_next() {
                self.done = true;
                return Some(Err(e));
            }
        }
    }
}

/// Reads a whole pi session file held in memory (non-blank lines with
/// their 1-based numbers) into one session: the path from the root to the
/// last entry. The CLI reads files through [`PiTree`] instead, without
/// holding them.
pub fn convert(lines: &[(usize, String)]) -> Result<PiSession, PiError> {
    let tree = PiTree::read(lines.iter().cloned().map(Ok::<_, PiError>))?;
    let events = tree
        .events(lines.iter().cloned().map(Ok::<_, PiError>))
        .collect::<Result<Vec<_>, PiError>>()?;
    Ok(PiSession {
        session_id: tree.session_id,
        events,
        entries: tree.entries(),
        off_path: tree.off_path(),
        newer_version: tree.newer_version(),
    })
}

/// The header line.
struct Header {
    id: String,
    version: u64,
    timestamp: Option<DateTime<Utc>>,
    fields: Map<String, Value>,
}

impl Header {
    fn read(line: usize, fields: &Map<String, Value>) -> Result<Header, PiError> {
        match fields.get("type") {
            Some(Value::String(t)) if t == "session" => {}
            found => {
                let found = found.map(shown).unwrap_or_else(|| "no `type`".to_owned());
                return Err(PiError::new(
                    line,
                    Some("type"),
                    format!(
                        "missing the pi session header: the first line must be {{\"type\":\"session\",\"id\":…}}, found {found}"
                    ),
                ));
            }
        }
        let id = match fields.get("id") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            None => {
                return Err(PiError::new(
                    line,
                    Some("id"),
                    "the session header has no `id`",
                ))
            }
            Some(other) => {
                return Err(PiError::new(
                    line,
                    Some("id"),
                    format!(
                        "the session header's `id` must be a non-empty string, found {}",
                        shown(other)
                    ),
                ))
            }
        };
        let version = match fields.get("version") {
            None | Some(Value::Null) => 1,
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => n,
                // Past u64 (a JSON number keeps its digits): a version
                // newer than any, read as the current one below.
                None if v.is_number() && v.to_string().chars().all(|c| c.is_ascii_digit()) => {
                    u64::MAX
                }
                _ => {
                    return Err(PiError::new(
                        line,
                        Some("version"),
                        format!("`version` must be a positive integer, found {}", shown(v)),
                    ))
                }
            },
        };
        Ok(Header {
            id,
            version,
            timestamp: timestamp(line, fields.get("timestamp"), "timestamp")?,
            fields: fields.clone(),
        })
    }

    /// What `session_started` keeps of the header: only header fields, so a
    /// longer version of the file yields the same first event.
    fn metadata(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("source".into(), Value::String("pi".into()));
        m.insert("pi_session_id".into(), Value::String(self.id.clone()));
        m.insert("pi_version".into(), Value::from(self.version));
        for (from, to) in [
            ("cwd", "cwd"),
            ("timestamp", "started_at"),
            ("parentSession", "parent_session"),
            ("branchedFrom", "parent_session"),
        ] {
            if let Some(v @ Value::String(_)) = self.fields.get(from) {
                m.insert(to.into(), v.clone());
            }
        }
        m
    }
}

/// The mapping state along the path.
struct Builder {
    session_id: Uuid,
    events: Vec<PiEvent>,
    /// Tool calls on the path: id -> (tool name, line, answered on line).
    calls: HashMap<String, (String, usize, Option<usize>)>,
    /// The deferred catalog so far: every name a successful result added.
    catalog: BTreeSet<String>,
    /// For each path position, the event id of its first row.
    first_row: Vec<Option<Uuid>>,
}

impl Builder {
    fn push(&mut self, pos: usize, entry: &Entry, suffix: &str, body: EventBody) {
        let event_id = uuid_v5(self.session_id, &format!("{}#{suffix}", entry.id));
        if body.is_row() && self.first_row[pos].is_none() {
            self.first_row[pos] = Some(event_id);
        }
        self.events.push(PiEvent {
            line: entry.line,
            entry_id: Some(entry.id.clone()),
            kept_field: KEPT_BY_ID,
            event: NewEvent {
                event_id: Some(event_id),
                recorded_at: entry.time,
                body,
            },
        });
    }

    fn entry(
        &mut self,
        pos: usize,
        entry: &Entry,
        tree: &PiTree,
        version: u64,
    ) -> Result<(), PiError> {
        let line = entry.line;
        match entry.kind.as_str() {
            "message" => {
                let message = match entry.fields.get("message") {
                    Some(Value::Object(m)) => m,
                    Some(other) => {
                        return Err(PiError::new(
                            line,
                            Some("message"),
                            format!("`message` must be an object, found {}", kind_of(other)),
                        ))
                    }
                    None => {
                        return Err(PiError::new(
                            line,
                            Some("message"),
                            "missing field `message`",
                        ))
                    }
                };
                self.message(pos, entry, message, version)
            }
            "custom_message" => {
                let text = content_text(line, entry.fields.get("content"), "content")?;
                self.push(pos, entry, "0", EventBody::PromptSubmitted { text });
                Ok(())
            }
            "branch_summary" => {
                match entry.fields.get("summary") {
                    Some(Value::String(s)) if !s.is_empty() => {
                        let text = format!("[branch summary]\n{s}");
                        self.push(pos, entry, "0", EventBody::PromptSubmitted { text });
                    }
                    // pi leaves an empty summary out of the context.
                    None | Some(Value::Null) | Some(Value::String(_)) => {}
                    Some(other) => {
                        return Err(PiError::new(
                            line,
                            Some("summary"),
                            format!("`summary` must be a string, found {}", kind_of(other)),
                        ))
                    }
                }
                Ok(())
            }
            "compaction" => self.compaction(pos, entry, tree),
            // model_change, thinking_level_change, custom, label,
            // session_info, and entry types pi may add later: not part of
            // what the model sees (docs/pi-import.md).
            _ => Ok(()),
        }
    }

    fn message(
        &mut self,
        pos: usize,
        entry: &Entry,
        message: &Map<String, Value>,
        version: u64,
    ) -> Result<(), PiError> {
        let line = entry.line;
        let role = match message.get("role") {
            Some(Value::String(r)) => r.as_str(),
            None => {
                return Err(PiError::new(
                    line,
                    Some("message.role"),
                    "missing field `message.role`",
                ))
            }
            Some(other) => {
                return Err(PiError::new(
                    line,
                    Some("message.role"),
                    format!("`message.role` must be a string, found {}", kind_of(other)),
                ))
            }
        };
        match role {
            "user" => {
                let text = content_text(line, message.get("content"), "message.content")?;
                self.push(pos, entry, "0", EventBody::PromptSubmitted { text });
            }
            "assistant" => self.assistant(pos, entry, message)?,
            "toolResult" => self.tool_result(pos, entry, message)?,
            "custom" => {
                let text = content_text(line, message.get("content"), "message.content")?;
                self.push(pos, entry, "0", EventBody::PromptSubmitted { text });
            }
            // Version 3 renamed `hookMessage` to `custom`.
            "hookMessage" if version < 3 => {
                let text = content_text(line, message.get("content"), "message.content")?;
                self.push(pos, entry, "0", EventBody::PromptSubmitted { text });
            }
            "bashExecution" => {
                if message.get("excludeFromContext") == Some(&Value::Bool(true)) {
                    return Ok(());
                }
                let command = string_field(line, message, "command", "message.command")?;
                let output = match message.get("output") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => {
                        return Err(PiError::new(
                            line,
                            Some("message.output"),
                            format!("`message.output` must be a string, found {}", kind_of(other)),
                        ))
                    }
                };
                let mut text = format!("Ran `{command}`\n```\n{output}\n```");
                if message.get("cancelled") == Some(&Value::Bool(true)) {
                    text.push_str("\n(command cancelled)");
                } else {
                    match message.get("exitCode") {
                        None | Some(Value::Null) => {}
                        Some(Value::Number(n)) if n.as_i64() == Some(0) => {}
                        Some(Value::Number(n)) if n.as_i64().is_some() => {
                            text.push_str(&format!("\nCommand exited with code {n}"));
                        }
                        // Dropped, it read as a command that succeeded.
                        Some(other) => {
                            return Err(PiError::new(
                                line,
                                Some("message.exitCode"),
                                format!(
                                    "`message.exitCode` must be a whole number, found {}",
                                    crate::error::quoted(&other.to_string())
                                ),
                            ))
                        }
                    }
                }
                self.push(pos, entry, "0", EventBody::PromptSubmitted { text });
            }
            "branchSummary" => {
                let summary = string_field(line, message, "summary", "message.summary")?;
                if !summary.is_empty() {
                    let text = format!("[branch summary]\n{summary}");
                    self.push(pos, entry, "0", EventBody::PromptSubmitted { text });
                }
            }
            // pi builds these in memory from compaction entries; the
            // compaction entry is what is imported.
            "compactionSummary" => {}
            other => {
                return Err(PiError::new(
                    line,
                    Some("message.role"),
                    format!(
                        "unknown message role {other:?}; expected user, assistant, toolResult, bashExecution, custom or branchSummary"
                    ),
                ))
            }
        }
        Ok(())
    }

    fn assistant(
        &mut self,
        pos: usize,
        entry: &Entry,
        message: &Map<String, Value>,
    ) -> Result<(), PiError> {
        let line = entry.line;
        let blocks = match message.get("content") {
            Some(Value::Array(b)) => b.as_slice(),
            Some(Value::String(s)) => {
                if !s.is_empty() {
                    let text = s.clone();
                    self.push(pos, entry, "0", EventBody::AssistantMessage { text });
                }
                return Ok(());
            }
            None | Some(Value::Null) => &[],
            Some(other) => {
                return Err(PiError::new(
                    line,
                    Some("message.content"),
                    format!(
                        "`message.content` must be an array of blocks, found {}",
                        kind_of(other)
                    ),
                ))
            }
        };
        let mut n = 0;
        let mut text: Vec<&str> = Vec::new();
        for (i, block) in blocks.iter().enumerate() {
            let field = |name: &str| format!("message.content[{i}].{name}");
            let Value::Object(block) = block else {
                return Err(PiError::new(
                    line,
                    Some(&format!("message.content[{i}]")),
                    format!(
                        "a content block must be an object, found {}",
                        kind_of(block)
                    ),
                ));
            };
            match block.get("type").and_then(Value::as_str) {
                Some("text") => match block.get("text") {
                    Some(Value::String(s)) => text.push(s),
                    _ => {
                        return Err(PiError::new(
                            line,
                            Some(&field("text")),
                            "a text block needs a string `text`",
                        ))
                    }
                },
                Some("toolCall") => {
                    self.flush_text(pos, entry, &mut text, &mut n);
                    let call_id = string_field(line, block, "id", &field("id"))?;
                    let tool_name = string_field(line, block, "name", &field("name"))?;
                    if call_id.is_empty() {
                        return Err(PiError::new(
                            line,
                            Some(&field("id")),
                            "a tool call's `id` must not be empty",
                        ));
                    }
                    if let Some((_, at, _)) = self.calls.get(&call_id) {
                        return Err(PiError::new(
                            line,
                            Some(&field("id")),
                            format!(
                                "tool call id {call_id:?} is already used by the call at line {at}"
                            ),
                        ));
                    }
                    let input = block.get("arguments").cloned().unwrap_or(Value::Null);
                    self.calls
                        .insert(call_id.clone(), (tool_name.clone(), line, None));
                    self.push(
                        pos,
                        entry,
                        &n.to_string(),
                        EventBody::ToolCall {
                            call_id,
                            tool_name,
                            input,
                        },
                    );
                    n += 1;
                }
                // Thinking is the model's scratch work, not a transcript
                // row; image and unknown blocks carry no text to keep.
                _ => {}
            }
        }
        self.flush_text(pos, entry, &mut text, &mut n);
        Ok(())
    }

    /// Consecutive text blocks become one `assistant_message`; empty ones
    /// add nothing (not even a line break), so blocks that are all empty
    /// make no row.
    fn flush_text(&mut self, pos: usize, entry: &Entry, text: &mut Vec<&str>, n: &mut usize) {
        text.retain(|t| !t.is_empty());
        let joined = text.join("\n");
        text.clear();
        if joined.is_empty() {
            return;
        }
        self.push(
            pos,
            entry,
            &n.to_string(),
            EventBody::AssistantMessage { text: joined },
        );
        *n += 1;
    }

    fn tool_result(
        &mut self,
        pos: usize,
        entry: &Entry,
        message: &Map<String, Value>,
    ) -> Result<(), PiError> {
        let line = entry.line;
        let call_id = string_field(line, message, "toolCallId", "message.toolCallId")?;
        let Some((call_name, call_line, answered)) = self.calls.get(&call_id).cloned() else {
            return Err(PiError::new(
                line,
                Some("message.toolCallId"),
                format!(
                    "tool result for call {call_id:?}, but no earlier assistant message on the session's path made that call"
                ),
            ));
        };
        if let Some(at) = answered {
            return Err(PiError::new(
                line,
                Some("message.toolCallId"),
                format!(
                    "the call {call_id:?} (line {call_line}) already has a result at line {at}"
                ),
            ));
        }
        let tool_name = match message.get("toolName") {
            None | Some(Value::Null) => call_name.clone(),
            Some(Value::String(s)) if *s == call_name => s.clone(),
            Some(Value::String(s)) => {
                return Err(PiError::new(
                    line,
                    Some("message.toolName"),
                    format!(
                        "`toolName` {s:?} differs from the tool {call_name:?} that the call {call_id:?} (line {call_line}) named"
                    ),
                ))
            }
            Some(other) => {
                return Err(PiError::new(
                    line,
                    Some("message.toolName"),
                    format!("`message.toolName` must be a string, found {}", kind_of(other)),
                ))
            }
        };
        let is_error = match message.get("isError") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(PiError::new(
                    line,
                    Some("message.isError"),
                    format!(
                        "`message.isError` must be a boolean, found {}",
                        kind_of(other)
                    ),
                ))
            }
        };
        let mut added: Vec<String> = Vec::new();
        // Each name once, looked up in a set: a list's `contains` made a
        // line of 160 000 names take 34 s.
        let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::new();
        let details_names = message
            .get("details")
            .and_then(Value::as_object)
            .and_then(|d| d.get("addedToolNames"));
        for (names, field) in [
            (details_names, "message.details.addedToolNames"),
            (message.get("addedToolNames"), "message.addedToolNames"),
        ] {
            match names {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    for (i, item) in items.iter().enumerate() {
                        let Value::String(name) = item else {
                            return Err(PiError::new(
                                line,
                                Some(&format!("{field}[{i}]")),
                                format!("a tool name must be a string, found {}", kind_of(item)),
                            ));
                        };
                        if seen.insert(name.as_str()) {
                            added.push(name.clone());
                        }
                    }
                }
                Some(other) => {
                    return Err(PiError::new(
                        line,
                        Some(field),
                        format!(
                            "`{field}` must be an array of names, found {}",
                            kind_of(other)
                        ),
                    ))
                }
            }
        }
        if let Some(call) = self.calls.get_mut(&call_id) {
            call.2 = Some(line);
        }
        // A failed result gives no evidence (§7), so its names are dropped
        // rather than rejected.
        let added = if is_error || added.is_empty() {
            None
        } else {
            Some(added)
        };
        if let Some(names) = &added {
            let before = self.catalog.len();
            self.catalog.extend(names.iter().cloned());
            if self.catalog.len() > before {
                let deferred_tools = self.catalog.iter().cloned().collect();
                self.push(
                    pos,
                    entry,
                    "catalog",
                    EventBody::CatalogDefined {
                        mode: MODE.to_owned(),
                        deferred_tools,
                    },
                );
            }
        }
        self.push(
            pos,
            entry,
            "0",
            EventBody::ToolResult {
                call_id,
                tool_name,
                status: if is_error {
                    ToolStatus::Error
                } else {
                    ToolStatus::Success
                },
                output: message.get("content").cloned(),
                added_tool_names: added,
            },
        );
        Ok(())
    }

    fn compaction(&mut self, pos: usize, entry: &Entry, tree: &PiTree) -> Result<(), PiError> {
        let line = entry.line;
        let summary = string_field(line, &entry.fields, "summary", "summary")?;
        let tokens_before = match entry.fields.get("tokensBefore") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_i64().ok_or_else(|| {
                PiError::new(
                    line,
                    Some("tokensBefore"),
                    format!("`tokensBefore` must be an integer, found {}", shown(v)),
                )
            })?),
        };
        // The field the file names the kept entry by: a version 1 file's
        // number, or the id.
        let kept_field = match matches!(
            entry.fields.get("firstKeptEntryId"),
            None | Some(Value::Null)
        ) && !matches!(
            entry.fields.get("firstKeptEntryIndex"),
            None | Some(Value::Null)
        ) {
            true => "firstKeptEntryIndex",
            false => KEPT_BY_ID,
        };
        let kept_index = match entry.fields.get("firstKeptEntryId") {
            Some(Value::String(id)) => Some(*tree.by_id.get(id.as_str()).ok_or_else(|| {
                PiError::new(
                    line,
                    Some("firstKeptEntryId"),
                    format!("`firstKeptEntryId` {id:?} names no entry of the file"),
                )
            })?),
            None | Some(Value::Null) => match entry.fields.get("firstKeptEntryIndex") {
                None | Some(Value::Null) => None,
                // Version 1 files count entries of the file, the header
                // being entry 0 (pi's migration reads them so). One that
                // names no entry is an error, as an unknown
                // `firstKeptEntryId` is: keeping nothing would hide a
                // broken file.
                Some(v) => Some(
                    v.as_u64()
                        .and_then(|i| u32::try_from(i).ok())
                        .and_then(|i| i.checked_sub(1))
                        .filter(|i| (*i as usize) < tree.nodes.len())
                        .ok_or_else(|| {
                            PiError::new(
                                line,
                                Some("firstKeptEntryIndex"),
                                format!(
                                    "`firstKeptEntryIndex` must be the number of an entry of the file (1 to {}), found {}",
                                    tree.nodes.len(),
                                    shown(v)
                                ),
                            )
                        })?,
                ),
            },
            Some(other) => {
                return Err(PiError::new(
                    line,
                    Some("firstKeptEntryId"),
                    format!(
                        "`firstKeptEntryId` must be a string, found {}",
                        kind_of(other)
                    ),
                ))
            }
        };
        let first_kept_event_id = match kept_index {
            None => None,
            Some(i) => {
                let kept_pos = tree.path_pos(i).filter(|p| *p < pos);
                let Some(kept_pos) = kept_pos else {
                    return Err(PiError::new(
                        line,
                        Some(kept_field),
                        format!(
                            "`{kept_field}` {:?} (line {}) is not on the session's path before this compaction",
                            tree.id_of(i),
                            tree.nodes[i as usize].line
                        ),
                    ));
                };
                // The first row made from the kept entry or, when it made
                // none (a model change, a thinking-only reply), from the
                // entries after it.
                self.first_row[kept_pos..pos]
                    .iter()
                    .flatten()
                    .next()
                    .copied()
            }
        };
        self.push(
            pos,
            entry,
            "0",
            EventBody::Compaction {
                summary,
                first_kept_event_id,
                tokens_before,
            },
        );
        if let Some(made) = self.events.last_mut() {
            made.kept_field = kept_field;
        }
        Ok(())
    }
}

/// [`PiEvent::kept_field`] of every event but a version 1 compaction's.
const KEPT_BY_ID: &str = "firstKeptEntryId";

fn parse_object(line: usize, text: &str) -> Result<Map<String, Value>, PiError> {
    if text.starts_with('\u{feff}') {
        return Err(PiError::new(
            line,
            None,
            "the line starts with a byte order mark (U+FEFF), which JSON does not allow: \
             pi writes its files without one, so something else edited this file",
        ));
    }
    crate::event::check_reserved_key(text.as_bytes()).map_err(|m| PiError::new(line, None, m))?;
    match serde_json::from_str::<Value>(text) {
        // A key given twice would keep only one of its values (the import
        // line's rule, `event::parse_line`).
        Ok(Value::Object(m)) => match crate::event::check_unique_keys(text.as_bytes()) {
            Ok(()) => Ok(m),
            Err(e) => Err(PiError::new(line, None, crate::event::line_json_error(&e))),
        },
        Ok(other) => Err(PiError::new(
            line,
            None,
            format!(
                "a pi entry must be a JSON object, found {}",
                kind_of(&other)
            ),
        )),
        Err(e) => Err(PiError::new(
            line,
            None,
            crate::event::json_error_said("malformed JSON", &e),
        )),
    }
}

fn timestamp(
    line: usize,
    value: Option<&Value>,
    field: &str,
) -> Result<Option<DateTime<Utc>>, PiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            let t = DateTime::parse_from_rfc3339(s)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| {
                    PiError::new(
                        line,
                        Some(field),
                        format!("`{field}` is not an ISO 8601 / RFC 3339 time: {s:?}"),
                    )
                })?;
            // A time the store would refuse as an event's (a leap second,
            // a year outside 0000-9999 in UTC) is said here, in pi's terms.
            crate::validate::check_recorded_at(&t).map_err(|e| {
                PiError::new(
                    line,
                    Some(field),
                    e.message.replace("`recorded_at`", &format!("`{field}`")),
                )
            })?;
            Ok(Some(t))
        }
        Some(other) => Err(PiError::new(
            line,
            Some(field),
            format!("`{field}` must be a time string, found {}", kind_of(other)),
        )),
    }
}

fn string_field(
    line: usize,
    map: &Map<String, Value>,
    key: &str,
    field: &str,
) -> Result<String, PiError> {
    match map.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) => Err(PiError::new(
            line,
            Some(field),
            format!("missing field `{field}`"),
        )),
        Some(other) => Err(PiError::new(
            line,
            Some(field),
            format!("`{field}` must be a string, found {}", kind_of(other)),
        )),
    }
}

/// The text of a user-side `content`: a string, or text blocks joined by
/// newlines, an image block standing as `[image: MIME]`.
fn content_text(line: usize, content: Option<&Value>, field: &str) -> Result<String, PiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::new();
            for (i, block) in blocks.iter().enumerate() {
                // A block of a type pi may add later is passed over; one
                // that is not an object is no block at all, and skipping
                // it silently could leave an empty prompt.
                if !block.is_object() {
                    return Err(PiError::new(
                        line,
                        Some(&format!("{field}[{i}]")),
                        format!(
                            "a content block must be an object, found {}",
                            kind_of(block)
                        ),
                    ));
                }
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => match block.get("text") {
                        // An empty block adds no line of its own.
                        Some(Value::String(s)) if s.is_empty() => {}
                        Some(Value::String(s)) => parts.push(s.clone()),
                        _ => {
                            return Err(PiError::new(
                                line,
                                Some(&format!("{field}[{i}].text")),
                                "a text block needs a string `text`",
                            ))
                        }
                    },
                    Some("image") => {
                        let mime = block
                            .get("mimeType")
                            .and_then(Value::as_str)
                            .unwrap_or("unknown type");
                        parts.push(format!("[image: {mime}]"));
                    }
                    _ => {}
                }
            }
            Ok(parts.join("\n"))
        }
        None | Some(Value::Null) => Err(PiError::new(
            line,
            Some(field),
            format!("missing field `{field}`"),
        )),
        Some(other) => Err(PiError::new(
            line,
            Some(field),
            format!(
                "`{field}` must be a string or an array of blocks, found {}",
                kind_of(other)
            ),
        )),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A short rendering of a value for messages.
fn shown(v: &Value) -> String {
    let text = v.to_string();
    if text.chars().count() > 40 {
        format!("{}…", text.chars().take(40).collect::<String>())
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    //! The mapping of docs/pi-import.md, on small files written inline.

    use super::*;

    const HEADER: &str = r#"{"type":"session","version":3,"id":"s-1","timestamp":"2025-01-01T00:00:00Z","cwd":"/p"}"#;

    fn lines(text: &[&str]) -> Vec<(usize, String)> {
        text.iter()
            .enumerate()
            .map(|(i, l)| (i + 1, (*l).to_owned()))
            .collect()
    }

    fn convert_ok(text: &[&str]) -> PiSession {
        convert(&lines(text)).unwrap_or_else(|e| panic!("{e}"))
    }

    fn bodies(s: &PiSession) -> Vec<EventBody> {
        s.events.iter().map(|e| e.event.body.clone()).collect()
    }

    fn err(text: &[&str]) -> PiError {
        convert(&lines(text)).expect_err("should be rejected")
    }

    fn user(id: &str, parent: Option<&str>, text: &str) -> String {
        let parent = parent.map_or("null".to_owned(), |p| format!("{p:?}"));
        format!(
            r#"{{"type":"message","id":"{id}","parentId":{parent},"timestamp":"2025-01-01T00:00:01Z","message":{{"role":"user","content":"{text}"}}}}"#
        )
    }

    #[test]
    fn ids_are_derived_so_a_second_conversion_is_identical() {
        let u = user("e1", None, "hi");
        let a = convert_ok(&[HEADER, &u]);
        let b = convert_ok(&[HEADER, &u]);
        assert_eq!(a, b);
        assert_eq!(a.session_id, uuid_v5(NAMESPACE, "s-1"));
        assert_eq!(a.session_id.get_version_num(), 5);
        assert_eq!(
            a.events[1].event.event_id,
            Some(uuid_v5(a.session_id, "e1#0"))
        );
        // A UUID pi id is the session id itself.
        let h = r#"{"type":"session","version":3,"id":"0b6a3f1e-6c1d-4e8a-9f2b-1a2b3c4d5e01"}"#;
        assert_eq!(
            convert_ok(&[h]).session_id.to_string(),
            "0b6a3f1e-6c1d-4e8a-9f2b-1a2b3c4d5e01"
        );
    }

    #[test]
    fn uuid_v5_matches_the_rfc_example() {
        // RFC 9562 appendix A.4: "www.example.com" in the DNS namespace.
        let dns = Uuid::parse_str("6ba7b810-9dad-11d1-80b4-00c04fd430c8").unwrap();
        assert_eq!(
            uuid_v5(dns, "www.example.com").to_string(),
            "2ed6657d-e927-568b-95e1-2665a8aea6a2"
        );
    }

    #[test]
    fn assistant_text_blocks_merge_around_tool_calls_and_thinking_is_dropped() {
        let u = user("e1", None, "go");
        let a = r#"{"type":"message","id":"e2","parentId":"e1","message":{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"thinking","thinking":"hm"},{"type":"text","text":"b"},{"type":"toolCall","id":"c1","name":"read","arguments":{"path":"x"}},{"type":"text","text":"c"}]}}"#;
        let s = convert_ok(&[HEADER, &u, a]);
        let b = bodies(&s);
        assert_eq!(
            b[2],
            EventBody::AssistantMessage {
                text: "a\nb".into()
            }
        );
        assert!(matches!(&b[3], EventBody::ToolCall { call_id, .. } if call_id == "c1"));
        assert_eq!(b[4], EventBody::AssistantMessage { text: "c".into() });
        // Each event of one entry has its own id.
        let ids: BTreeSet<_> = s.events.iter().map(|e| e.event.event_id).collect();
        assert_eq!(ids.len(), s.events.len());
    }

    #[test]
    fn empty_text_blocks_add_nothing_and_all_empty_make_no_row() {
        let u = user("e1", None, "go");
        let a = r#"{"type":"message","id":"e2","parentId":"e1","message":{"role":"assistant","content":[{"type":"text","text":""},{"type":"text","text":""}]}}"#;
        let b = r#"{"type":"message","id":"e3","parentId":"e2","message":{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"text","text":""}]}}"#;
        let p = r#"{"type":"message","id":"e4","parentId":"e3","message":{"role":"user","content":[{"type":"text","text":""},{"type":"text","text":"x"},{"type":"text","text":""}]}}"#;
        let bodies = bodies(&convert_ok(&[HEADER, &u, a, b, p]));
        assert_eq!(
            bodies[2..],
            [
                EventBody::AssistantMessage { text: "a".into() },
                EventBody::PromptSubmitted { text: "x".into() },
            ]
        );
    }

    #[test]
    fn a_version_3_entry_without_parent_id_is_an_error() {
        let a = r#"{"type":"message","id":"e1","parentId":null,"message":{"role":"user","content":"a"}}"#;
        let b = r#"{"type":"message","id":"e2","message":{"role":"user","content":"b"}}"#;
        let e = err(&[HEADER, a, b]);
        assert_eq!((e.line, e.field.as_deref()), (3, Some("parentId")), "{e}");
    }

    #[test]
    fn added_tool_names_may_sit_in_details_or_on_the_message() {
        let u = user("e1", None, "go");
        let a = r#"{"type":"message","id":"e2","parentId":"e1","message":{"role":"assistant","content":[{"type":"toolCall","id":"c1","name":"ToolSearch","arguments":{}}]}}"#;
        let r = r#"{"type":"message","id":"e3","parentId":"e2","message":{"role":"toolResult","toolCallId":"c1","toolName":"ToolSearch","content":[],"isError":false,"details":{"addedToolNames":["b","a"]},"addedToolNames":["a","c"]}}"#;
        let b = bodies(&convert_ok(&[HEADER, &u, a, r]));
        assert_eq!(
            b[3],
            EventBody::CatalogDefined {
                mode: MODE.into(),
                deferred_tools: vec!["a".into(), "b".into(), "c".into()],
            }
        );
        assert!(matches!(&b[4], EventBody::ToolResult {
            status: ToolStatus::Success,
            added_tool_names: Some(n), ..
        } if n == &["b", "a", "c"]));
    }

    #[test]
    fn user_side_entries_become_prompts_and_bookkeeping_entries_nothing() {
        let u = user("e1", None, "go");
        let rest = [
            r#"{"type":"message","id":"e2","parentId":"e1","message":{"role":"bashExecution","command":"ls","output":"a.txt","exitCode":2,"cancelled":false,"truncated":false}}"#,
            r#"{"type":"message","id":"e3","parentId":"e2","message":{"role":"bashExecution","command":"secret","output":"x","exitCode":0,"excludeFromContext":true}}"#,
            r#"{"type":"custom_message","id":"e4","parentId":"e3","customType":"ext","content":[{"type":"text","text":"injected"},{"type":"image","data":"AA==","mimeType":"image/png"}],"display":false}"#,
            r#"{"type":"custom","id":"e5","parentId":"e4","customType":"ext","data":{"n":1}}"#,
            r#"{"type":"session_info","id":"e6","parentId":"e5","name":"demo"}"#,
            r#"{"type":"model_change","id":"e7","parentId":"e6","provider":"openai","modelId":"gpt-4o"}"#,
            r#"{"type":"some_future_entry","id":"e8","parentId":"e7"}"#,
        ];
        let mut file = vec![HEADER, u.as_str()];
        file.extend(rest);
        let b = bodies(&convert_ok(&file));
        assert_eq!(b.len(), 4, "{b:?}");
        assert_eq!(
            b[2],
            EventBody::PromptSubmitted {
                text: "Ran `ls`\n```\na.txt\n```\nCommand exited with code 2".into()
            }
        );
        assert_eq!(
            b[3],
            EventBody::PromptSubmitted {
                text: "injected\n[image: image/png]".into()
            }
        );
    }

    #[test]
    fn a_version_1_file_is_linear_and_counts_kept_entries_by_index() {
        let h =
            r#"{"type":"session","id":"old","timestamp":"2024-12-03T14:00:00.000Z","cwd":"/p"}"#;
        let file = [
            h,
            r#"{"type":"message","timestamp":"2024-12-03T14:00:01.000Z","message":{"role":"user","content":"one"}}"#,
            r#"{"type":"message","timestamp":"2024-12-03T14:00:02.000Z","message":{"role":"assistant","content":[{"type":"text","text":"two"}]}}"#,
            r#"{"type":"message","timestamp":"2024-12-03T14:00:03.000Z","message":{"role":"user","content":"three"}}"#,
            r#"{"type":"compaction","timestamp":"2024-12-03T14:00:04.000Z","summary":"s","firstKeptEntryIndex":3,"tokensBefore":5}"#,
        ];
        let s = convert_ok(&file);
        let b = bodies(&s);
        assert_eq!(b.len(), 5);
        let EventBody::Compaction {
            first_kept_event_id,
            ..
        } = &b[4]
        else {
            panic!("{b:?}")
        };
        assert_eq!(*first_kept_event_id, s.events[3].event.event_id);
        // An index that names no entry of the file is an error at the
        // compaction's line, not a compaction that silently keeps nothing.
        for bad in ["99999999999999", "-1", "0", "\"1\"", "1.5"] {
            let compaction = format!(
                r#"{{"type":"compaction","timestamp":"2024-12-03T14:00:04.000Z","summary":"s","firstKeptEntryIndex":{bad}}}"#
            );
            let mut broken = file[..4].to_vec();
            broken.push(&compaction);
            let e = err(&broken);
            assert_eq!(
                (e.line, e.field.as_deref()),
                (5, Some("firstKeptEntryIndex")),
                "{bad}: {e}"
            );
            assert!(e.message.contains("1 to 4"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_first_kept_entry_that_makes_no_row_keeps_from_the_next_row() {
        let u = user("e1", None, "one");
        let file = [
            HEADER,
            &u,
            r#"{"type":"model_change","id":"e2","parentId":"e1","provider":"x","modelId":"y"}"#,
            &user("e3", Some("e2"), "two"),
            r#"{"type":"compaction","id":"e4","parentId":"e3","summary":"s","firstKeptEntryId":"e2","tokensBefore":1}"#,
        ];
        let s = convert_ok(&file);
        let EventBody::Compaction {
            first_kept_event_id,
            ..
        } = &s.events[3].event.body
        else {
            panic!()
        };
        assert_eq!(*first_kept_event_id, s.events[2].event.event_id);
        // Nothing between the kept entry and the compaction: keep none.
        let file = [
            HEADER,
            &u,
            r#"{"type":"model_change","id":"e2","parentId":"e1","provider":"x","modelId":"y"}"#,
            r#"{"type":"compaction","id":"e4","parentId":"e2","summary":"s","firstKeptEntryId":"e2"}"#,
        ];
        let s = convert_ok(&file);
        assert!(matches!(
            s.events[2].event.body,
            EventBody::Compaction {
                first_kept_event_id: None,
                ..
            }
        ));
    }

    #[test]
    fn the_path_to_the_last_entry_is_the_session() {
        let file = [
            HEADER,
            &user("e1", None, "root"),
            &user("e2", Some("e1"), "left"),
            &user("e3", Some("e1"), "right"),
        ];
        let s = convert_ok(&file);
        assert_eq!(s.off_path, 1);
        assert_eq!(
            bodies(&s)[1..],
            [
                EventBody::PromptSubmitted {
                    text: "root".into()
                },
                EventBody::PromptSubmitted {
                    text: "right".into()
                }
            ]
        );
    }

    /// A version past any integer type is newer than any: read as the
    /// current one (docs/pi-import.md), not refused as "not a positive
    /// integer". Zero, negative and fractional ones are refused.
    #[test]
    fn a_version_beyond_u64_is_read_as_the_current_one() {
        let huge = r#"{"type":"session","version":99999999999999999999,"id":"s-1"}"#;
        let s = convert_ok(&[huge, &user("e1", None, "x")]);
        assert_eq!(bodies(&s).len(), 2);
        assert_eq!(s.newer_version, Some(u64::MAX));
        assert_eq!(
            convert_ok(&[HEADER, &user("e1", None, "x")]).newer_version,
            None
        );
        for bad in ["0", "-3", "2.5", "1e400", "\"3\""] {
            let header = format!(r#"{{"type":"session","version":{bad},"id":"s-1"}}"#);
            let e = err(&[&header]);
            assert_eq!((e.line, e.field.as_deref()), (1, Some("version")), "{bad}");
        }
    }

    #[test]
    fn bad_input_names_line_and_field() {
        assert_eq!(err(&[]).line, 1);
        let e = err(&[HEADER, HEADER]);
        assert_eq!((e.line, e.field.as_deref()), (2, Some("type")));
        let e = err(&[r#"{"type":"session","version":3}"#]);
        assert_eq!((e.line, e.field.as_deref()), (1, Some("id")));
        let e = err(&[HEADER, r#"{"type":"message","parentId":null}"#]);
        assert_eq!((e.line, e.field.as_deref()), (2, Some("id")));
        let e = err(&[HEADER, &user("e1", None, "x"), &user("e2", Some("e9"), "y")]);
        assert_eq!((e.line, e.field.as_deref()), (3, Some("parentId")));
        let e = err(&[
            HEADER,
            r#"{"type":"message","id":"e1","parentId":null,"message":{"role":"robot","content":"x"}}"#,
        ]);
        assert_eq!((e.line, e.field.as_deref()), (2, Some("message.role")));
        let e = err(&[
            HEADER,
            r#"{"type":"message","id":"e1","parentId":null,"timestamp":"yesterday","message":{"role":"user","content":"x"}}"#,
        ]);
        assert_eq!((e.line, e.field.as_deref()), (2, Some("timestamp")));
        // Times the store could not keep are said as pi's field, not later
        // as the store's `recorded_at`.
        for bad in ["2016-12-31T23:59:60Z", "0000-01-01T00:00:00+01:00"] {
            let e = err(&[
                HEADER,
                &format!(
                    r#"{{"type":"message","id":"e1","parentId":null,"timestamp":"{bad}","message":{{"role":"user","content":"x"}}}}"#
                ),
            ]);
            assert_eq!(
                (e.line, e.field.as_deref()),
                (2, Some("timestamp")),
                "{bad}"
            );
            assert!(!e.message.contains("recorded_at"), "{}", e.message);
        }
        // A key given twice, and a byte order mark, are said as such.
        let e = err(&[
            HEADER,
            r#"{"type":"message","id":"e1","id":"e2","parentId":null,"message":{"role":"user","content":"x"}}"#,
        ]);
        assert_eq!(e.line, 2);
        assert!(
            e.message.contains("\"id\" appears twice at column"),
            "{}",
            e.message
        );
        let e = err(&[&format!("\u{feff}{HEADER}")]);
        assert_eq!(e.line, 1);
        assert!(e.message.contains("byte order mark"), "{}", e.message);
        // An exit code that is not a whole number is refused, not dropped
        // (dropped, the command read as one that succeeded).
        for bad in ["1.5", "1e400", "\"1\""] {
            let e = err(&[
                HEADER,
                &format!(
                    r#"{{"type":"message","id":"e1","parentId":null,"message":{{"role":"bashExecution","command":"ls","output":"","exitCode":{bad}}}}}"#
                ),
            ]);
            assert_eq!(
                (e.line, e.field.as_deref()),
                (2, Some("message.exitCode")),
                "{bad}"
            );
        }
        let e = err(&[
            HEADER,
            r#"{"type":"message","id":"e1","parentId":null,"message":{"role":"assistant","content":[{"type":"toolCall","id":"c","name":"a","arguments":{}},{"type":"toolCall","id":"c","name":"b","arguments":{}}]}}"#,
        ]);
        assert_eq!(
            (e.line, e.field.as_deref()),
            (2, Some("message.content[1].id"))
        );
        let call = r#"{"type":"message","id":"e1","parentId":null,"message":{"role":"assistant","content":[{"type":"toolCall","id":"c","name":"a","arguments":{}}]}}"#;
        let wrong_name = r#"{"type":"message","id":"e2","parentId":"e1","message":{"role":"toolResult","toolCallId":"c","toolName":"b","content":[],"isError":false}}"#;
        let e = err(&[HEADER, call, wrong_name]);
        assert_eq!((e.line, e.field.as_deref()), (3, Some("message.toolName")));
        let result = r#"{"type":"message","id":"e2","parentId":"e1","message":{"role":"toolResult","toolCallId":"c","toolName":"a","content":[],"isError":false}}"#;
        let again = r#"{"type":"message","id":"e3","parentId":"e2","message":{"role":"toolResult","toolCallId":"c","toolName":"a","content":[],"isError":false}}"#;
        let e = err(&[HEADER, call, result, again]);
        assert_eq!(
            (e.line, e.field.as_deref()),
            (4, Some("message.toolCallId"))
        );
        let bad_names = r#"{"type":"message","id":"e2","parentId":"e1","message":{"role":"toolResult","toolCallId":"c","toolName":"a","content":[],"isError":false,"details":{"addedToolNames":["x",3]}}}"#;
        let e = err(&[HEADER, call, bad_names]);
        assert_eq!(
            (e.line, e.field.as_deref()),
            (3, Some("message.details.addedToolNames[1]"))
        );
        // A kept entry on another branch.
        let e = err(&[
            HEADER,
            &user("e1", None, "root"),
            &user("e2", Some("e1"), "left"),
            r#"{"type":"compaction","id":"e3","parentId":"e1","summary":"s","firstKeptEntryId":"e2","tokensBefore":1}"#,
        ]);
        assert_eq!((e.line, e.field.as_deref()), (4, Some("firstKeptEntryId")));
        let e = err(&[
            HEADER,
            &user("e1", None, "root"),
            r#"{"type":"compaction","id":"e3","parentId":"e1","summary":"s","firstKeptEntryId":"e1","tokensBefore":1.5}"#,
        ]);
        assert_eq!((e.line, e.field.as_deref()), (3, Some("tokensBefore")));
    }
}
