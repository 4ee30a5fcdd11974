//! The event enum and its envelope.
//!
//! Events are parsed once, at the boundary ([`parse_event_object`]), from a
//! JSON object into the typed [`EventBody`]; the rest of the crate never sees
//! raw JSON where a type would do. Deserialization is done by hand (read
//! `type`, then deserialize that type's payload struct with
//! `deny_unknown_fields`) rather than through serde's internally tagged
//! enums, because those buffer numbers and would lose the exact JSON numbers
//! that SEMANTICS §3 says must round-trip.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::error::{Rule, ValidationError};

/// The outcome of a tool call, as the runtime recorded it (SEMANTICS §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolStatus {
    /// The call succeeded; only such results give evidence (§7).
    Success,
    /// The call failed.
    Error,
    /// The call was cut off.
    Interrupted,
    /// The row a runtime writes when a call got no result.
    Placeholder,
}

impl ToolStatus {
    /// The status as it is spelled in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolStatus::Success => "success",
            ToolStatus::Error => "error",
            ToolStatus::Interrupted => "interrupted",
            ToolStatus::Placeholder => "placeholder",
        }
    }
}

/// One event's type and payload: the eight types of SEMANTICS §3.
///
/// Optional fields that were absent (or `null`, which means the same) are
/// `None` and are left out when the event is serialized again. `output` is the
/// exception: `Some(Value::Null)` records an explicit `null`.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventBody {
    /// Opens the stream; must be seq 1.
    SessionStarted {
        /// The mode the session starts in.
        mode: String,
        /// Free-form metadata of the runtime.
        #[serde(skip_serializing_if = "Option::is_none")]
        metadata: Option<Map<String, Value>>,
    },
    /// Replaces one mode's deferred catalog from this seq on.
    CatalogDefined {
        /// The mode whose catalog this is.
        mode: String,
        /// The deferred tools of that mode.
        deferred_tools: Vec<String>,
    },
    /// A user prompt: a transcript row and a refresh point.
    PromptSubmitted {
        /// The prompt text.
        text: String,
    },
    /// A model reply: a transcript row.
    AssistantMessage {
        /// The reply text.
        text: String,
    },
    /// A tool call: a transcript row.
    ToolCall {
        /// Unique within the session.
        call_id: String,
        /// The called tool.
        tool_name: String,
        /// The call's input; required, may be `null`.
        input: Value,
    },
    /// A tool result: a transcript row; successful ones give evidence.
    ToolResult {
        /// The call this answers.
        call_id: String,
        /// Must equal the call's `tool_name`.
        tool_name: String,
        /// How the call ended.
        status: ToolStatus,
        /// The output; `Some(Null)` is an explicit `null`.
        #[serde(skip_serializing_if = "Option::is_none")]
        output: Option<Value>,
        /// Names a search added; only allowed non-empty on success.
        #[serde(skip_serializing_if = "Option::is_none")]
        added_tool_names: Option<Vec<String>>,
    },
    /// Replaces older rows by a summary.
    Compaction {
        /// What the summarized rows said.
        summary: String,
        /// The first row kept; `None` keeps no earlier row.
        #[serde(skip_serializing_if = "Option::is_none")]
        first_kept_event_id: Option<Uuid>,
        /// Size of the context before compaction, for the record.
        #[serde(skip_serializing_if = "Option::is_none")]
        tokens_before: Option<i64>,
    },
    /// Switches the current mode; a refresh point.
    ModeSwitched {
        /// The new mode.
        mode: String,
    },
}

/// Every `type` name, in SEMANTICS §3 order; used in error messages.
pub const EVENT_TYPES: [&str; 8] = [
    "session_started",
    "catalog_defined",
    "prompt_submitted",
    "assistant_message",
    "tool_call",
    "tool_result",
    "compaction",
    "mode_switched",
];

/// The bytes the allocator hands out for `len` bytes of heap: glibc's
/// chunks carry an 8-byte header and are multiples of 16, at least 32.
fn allocated(len: usize) -> usize {
    match len {
        0 => 0,
        n => ((n + 8 + 15) & !15).max(32),
    }
}

/// What one entry of a JSON map takes in its `BTreeMap`'s nodes: its key
/// and value, and about half as much again of nodes' slack and links.
const MAP_ENTRY_BYTES: usize =
    (std::mem::size_of::<String>() + std::mem::size_of::<Value>()) * 3 / 2;

/// [`value_heap_bytes`] of a map.
fn map_heap_bytes(map: &Map<String, Value>) -> usize {
    map.iter()
        .map(|(key, item)| MAP_ENTRY_BYTES + allocated(key.len()) + value_heap_bytes(item))
        .sum()
}

/// About how many heap bytes `value` holds beyond its own `Value`: its
/// strings, numbers (their text, with `arbitrary_precision`), arrays and maps
/// (`BTreeMap` nodes, about half again their entries' size). Walked with
/// an explicit stack, so a deep value cannot overflow the thread's.
fn value_heap_bytes(value: &Value) -> usize {
    let mut total = 0;
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            Value::Null | Value::Bool(_) => {}
            // With `arbitrary_precision` a number keeps its text: a
            // number of a million digits is a megabyte (it was weighed
            // at 32 bytes, and a budget of 8 MiB held 1.5 GB of them).
            Value::Number(n) => total += allocated(n.as_str().len()),
            Value::String(s) => total += allocated(s.len()),
            Value::Array(items) => {
                total += allocated(items.len() * std::mem::size_of::<Value>());
                stack.extend(items);
            }
            Value::Object(map) => {
                total += map.len() * MAP_ENTRY_BYTES;
                for (key, item) in map {
                    total += allocated(key.len());
                    stack.push(item);
                }
            }
        }
    }
    total
}

/// [`drop_flat`] of an event object's map.
fn drop_flat_map(map: Map<String, Value>) {
    drop_values(map.into_iter().map(|(_, v)| v).collect());
}

/// Drops `body` with an explicit stack instead of the recursive drop of
/// its JSON values, which overflows a thread's stack on a value tens of
/// thousands of levels deep (a library caller's, refused by
/// `validate::check_values`).
pub(crate) fn drop_flat(body: EventBody) {
    drop_values(match body {
        EventBody::ToolCall { input, .. } => vec![input],
        EventBody::ToolResult { output, .. } => output.into_iter().collect(),
        EventBody::SessionStarted { metadata, .. } => {
            metadata.into_iter().flatten().map(|(_, v)| v).collect()
        }
        _ => Vec::new(),
    })
}

/// Drops `stack`'s values a level at a time.
fn drop_values(mut stack: Vec<Value>) {
    while let Some(mut value) = stack.pop() {
        match &mut value {
            Value::Array(items) => stack.append(items),
            Value::Object(map) => stack.extend(std::mem::take(map).into_iter().map(|(_, v)| v)),
            _ => {}
        }
    }
}

impl EventBody {
    /// About how many bytes this body holds on the heap (its texts,
    /// names and JSON values): what a cached session state is weighed by
    /// (the store's state cache has a byte budget), an estimate rather
    /// than a count.
    pub fn heap_bytes(&self) -> usize {
        let names = |names: &[String]| {
            allocated(std::mem::size_of_val(names))
                + names.iter().map(|n| allocated(n.len())).sum::<usize>()
        };
        match self {
            EventBody::SessionStarted { mode, metadata } => {
                allocated(mode.len()) + metadata.as_ref().map_or(0, map_heap_bytes)
            }
            EventBody::CatalogDefined {
                mode,
                deferred_tools,
            } => allocated(mode.len()) + names(deferred_tools),
            EventBody::PromptSubmitted { text } | EventBody::AssistantMessage { text } => {
                allocated(text.len())
            }
            EventBody::ToolCall {
                call_id,
                tool_name,
                input,
            } => allocated(call_id.len()) + allocated(tool_name.len()) + value_heap_bytes(input),
            EventBody::ToolResult {
                call_id,
                tool_name,
                output,
                added_tool_names,
                ..
            } => {
                allocated(call_id.len())
                    + allocated(tool_name.len())
                    + output.as_ref().map_or(0, value_heap_bytes)
                    + added_tool_names.as_deref().map_or(0, names)
            }
            EventBody::Compaction { summary, .. } => allocated(summary.len()),
            EventBody::ModeSwitched { mode } => allocated(mode.len()),
        }
    }

    /// The `type` tag of this event.
    pub fn type_name(&self) -> &'static str {
        match self {
            EventBody::SessionStarted { .. } => "session_started",
            EventBody::CatalogDefined { .. } => "catalog_defined",
            EventBody::PromptSubmitted { .. } => "prompt_submitted",
            EventBody::AssistantMessage { .. } => "assistant_message",
            EventBody::ToolCall { .. } => "tool_call",
            EventBody::ToolResult { .. } => "tool_result",
            EventBody::Compaction { .. } => "compaction",
            EventBody::ModeSwitched { .. } => "mode_switched",
        }
    }

    /// Transcript rows are the four types that appear in the effective context.
    pub fn is_row(&self) -> bool {
        matches!(
            self,
            EventBody::PromptSubmitted { .. }
                | EventBody::AssistantMessage { .. }
                | EventBody::ToolCall { .. }
                | EventBody::ToolResult { .. }
        )
    }

    /// Refresh points are where the materialized view is updated (§8).
    pub fn is_refresh_point(&self) -> bool {
        matches!(
            self,
            EventBody::PromptSubmitted { .. } | EventBody::ModeSwitched { .. }
        )
    }

    /// Whether the event leaves the activation set as it was: §7 computes
    /// it from the mode, the mode's catalog and the successful results in
    /// the effective context, which a prompt, an assistant message or a
    /// call does not change. Lets a fold take a refresh point's set from
    /// the previous one instead of computing it again (debug builds check
    /// that it is the same).
    pub fn leaves_activations_alone(&self) -> bool {
        matches!(
            self,
            EventBody::PromptSubmitted { .. }
                | EventBody::AssistantMessage { .. }
                | EventBody::ToolCall { .. }
        )
    }

    /// The names this event is evidence for (§7): empty unless it is a
    /// successful `tool_result`.
    pub fn evidence(&self) -> Vec<&str> {
        match self {
            EventBody::ToolResult {
                tool_name,
                status: ToolStatus::Success,
                added_tool_names,
                ..
            } => {
                let mut names = vec![tool_name.as_str()];
                if let Some(added) = added_tool_names {
                    names.extend(added.iter().map(String::as_str));
                }
                names
            }
            _ => Vec::new(),
        }
    }

    /// The canonical JSON text stored in the log (with `type`).
    pub fn to_json_text(&self) -> String {
        // Serializing a value built from strings, maps and serde_json values
        // cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Whether `other` is the same event content "as JSON values" (§2's
    /// idempotent retry): key order aside, numbers compare by their value,
    /// so `1.0`, `1`, `1e0` and `10e-1` are one number, as they are to
    /// `jq` or Python after an export has been through them. The stored
    /// text keeps the digits it was first sent with either way.
    pub fn same_content(&self, other: &EventBody) -> bool {
        if self == other {
            return true;
        }
        if self.type_name() != other.type_name() {
            return false;
        }
        match (serde_json::to_value(self), serde_json::to_value(other)) {
            (Ok(a), Ok(b)) => json_equal(&a, &b),
            _ => false,
        }
    }

    /// Reads back a body stored by [`EventBody::to_json_text`].
    pub fn from_json_text(text: &str) -> Result<EventBody, ValidationError> {
        let value: Value = serde_json::from_str(text).map_err(|e| {
            ValidationError::new(
                Rule::MalformedJson,
                None,
                json_error_said("malformed JSON", &e),
            )
        })?;
        match value {
            Value::Object(mut map) => map
                .remove("type")
                .ok_or_else(|| {
                    ValidationError::new(Rule::MissingField, Some("type"), "missing field `type`")
                })
                .and_then(|t| parse_body(t, map)),
            _ => Err(ValidationError::new(
                Rule::MalformedJson,
                None,
                "an event must be a JSON object",
            )),
        }
    }
}

/// A new event, as a writer hands it to the store.
#[derive(Clone, Debug, PartialEq)]
pub struct NewEvent {
    /// Supplied for idempotency; generated (UUIDv7) when `None`.
    pub event_id: Option<Uuid>,
    /// Kept as the event's time when given (import of an export).
    pub recorded_at: Option<DateTime<Utc>>,
    /// Type and payload.
    pub body: EventBody,
}

impl NewEvent {
    /// A new event without id or time.
    pub fn new(body: EventBody) -> NewEvent {
        NewEvent {
            event_id: None,
            recorded_at: None,
            body,
        }
    }

    /// The same event with a writer-chosen id.
    pub fn with_id(mut self, id: Uuid) -> NewEvent {
        self.event_id = Some(id);
        self
    }
}

/// A stored event: the envelope of SEMANTICS §2 and the body.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StoredEvent {
    /// The stream.
    pub session_id: Uuid,
    /// Dense per-session order, from 1.
    pub seq: i64,
    /// Unique across the store.
    pub event_id: Uuid,
    /// Global order across sessions.
    pub position: i64,
    /// Store time (or the imported time).
    pub recorded_at: DateTime<Utc>,
    /// Type and payload.
    #[serde(flatten)]
    pub body: EventBody,
}

impl StoredEvent {
    /// The event as `export` writes it and `import` reads it back: the
    /// envelope without `seq` and `position`, which the store assigns again
    /// (in the same order).
    pub fn export_line(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let Some(map) = v.as_object_mut() {
            map.remove("seq");
            map.remove("position");
        }
        v
    }
}

/// Which envelope fields a JSON line may carry besides the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineKind {
    /// `import`: `session_id` required, `recorded_at` allowed.
    Import,
    /// `append`: neither `session_id` nor `recorded_at` (§3: only an
    /// `import` line may carry them; the session is the one appended to,
    /// and the time is the store's).
    Append,
}

/// A parsed input line: the event and, for imports, its session.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedLine {
    /// The session the line names, if it names one.
    pub session_id: Option<Uuid>,
    /// The event.
    pub event: NewEvent,
}

/// Equality of JSON values, with numbers compared by their exact decimal
/// value (see [`EventBody::same_content`]).
pub fn json_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.to_string(), y.to_string());
            x == y || decimal(&x).is_some_and(|d| decimal(&y) == Some(d))
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_equal(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w)))
        }
        _ => a == b,
    }
}

/// A JSON number's exact value as (negative, significant digits without
/// leading or trailing zeros, power of ten), zero as `(false, "", 0)`
/// whatever its sign; `None` for text that is not a JSON number or an
/// exponent too long to hold, which then only equals itself.
fn decimal(text: &str) -> Option<(bool, String, i128)> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, "0"),
    };
    let exponent = exponent.strip_prefix('+').unwrap_or(exponent);
    let (minus, magnitude) = match exponent.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, exponent),
    };
    let magnitude = match magnitude.trim_start_matches('0') {
        "" if !magnitude.is_empty() => "0",
        m => m,
    };
    if magnitude.len() > 30 {
        return None;
    }
    let mut exponent: i128 = magnitude.parse().ok()?;
    if minus {
        exponent = -exponent;
    }
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() || !(int.bytes().chain(frac.bytes())).all(|b| b.is_ascii_digit()) {
        return None;
    }
    exponent -= frac.len() as i128;
    let all = format!("{int}{frac}");
    let digits = all.trim_start_matches('0');
    let significant = digits.trim_end_matches('0');
    exponent += (digits.len() - significant.len()) as i128;
    match significant.is_empty() {
        true => Some((false, String::new(), 0)),
        false => Some((negative, significant.to_owned(), exponent)),
    }
}

/// The object keys serde_json uses to carry a number (built with
/// `arbitrary_precision`, so that numbers keep the digits they were
/// written with, §3) and a raw JSON text (`raw_value`, which a dependency
/// turns on) through serde: an object with one as its first key parses as
/// that number or text (or fails as one), so it cannot be stored as it was
/// sent.
pub const RESERVED_KEYS: [&str; 2] = [
    "$serde_json::private::Number",
    "$serde_json::private::RawValue",
];

/// Refuses a JSON text in which an object has one of [`RESERVED_KEYS`] as a key,
/// however it is spelled (`\u0024…`), naming the column (in bytes, from 1)
/// where the key starts; to be run before the text is parsed, whose error
/// would otherwise be a misleading one, or none with the object stored as
/// a number. Text that is not JSON passes: the parser says what is wrong.
pub fn check_reserved_key(text: &[u8]) -> Result<(), String> {
    // Every spelling of a key holds its last word, or an escape.
    let has = |needle: &[u8]| memchr::memmem::find(text, needle).is_some();
    if !has(b"Number") && !has(b"RawValue") && !has(b"\\u") {
        return Ok(());
    }
    let mut i = 0;
    while i < text.len() {
        if text[i] != b'"' {
            i += 1;
            continue;
        }
        let start = i;
        let mut escaped = false;
        i += 1;
        while i < text.len() && text[i] != b'"' {
            if text[i] == b'\\' {
                escaped = true;
                i += 1;
            }
            i += 1;
        }
        if i >= text.len() {
            return Ok(());
        }
        i += 1;
        let literal = &text[start..i];
        let after = text[i..]
            .iter()
            .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
        if after != Some(&b':') {
            continue;
        }
        let key = match escaped {
            false => std::str::from_utf8(&literal[1..literal.len() - 1])
                .ok()
                .map(str::to_owned),
            true => serde_json::from_slice::<String>(literal).ok(),
        };
        if let Some(key) = key.filter(|k| RESERVED_KEYS.contains(&k.as_str())) {
            return Err(format!(
                "the object key {} at column {} cannot be stored: the JSON library the store is built on reserves it",
                crate::error::quoted(&key),
                start + 1
            ));
        }
    }
    Ok(())
}

/// Refuses a JSON object that gives one key twice, at any depth: a parser
/// keeps only one of them, so the stored event would not be the one that
/// was sent (§3: values round-trip, nothing but key order may change).
/// Runs over text that has already parsed as JSON, so its only error is a
/// duplicate key, with serde_json's line and column.
pub fn check_unique_keys(text: &[u8]) -> Result<(), serde_json::Error> {
    use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

    struct Unique;
    impl<'de> DeserializeSeed<'de> for Unique {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(Unique)
        }
    }
    impl<'de> Visitor<'de> for Unique {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element_seed(Unique)?.is_some() {}
            Ok(())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if !seen.insert(key.clone()) {
                    return Err(A::Error::custom(format!(
                        "the key {} appears twice",
                        crate::error::quoted(&key)
                    )));
                }
                map.next_value_seed(Unique)?;
            }
            Ok(())
        }
    }
    let mut de = serde_json::Deserializer::from_slice(text);
    Unique.deserialize(&mut de)
}

/// What a line may hold beyond the event's own JSON text: its envelope
/// (`session_id`, `event_id`, `recorded_at`, about 150 bytes) and any
/// spacing. The limit of §4 is on the event's JSON text as the store keeps
/// it (the store checks it at append); a line is refused before it is
/// parsed only when it is over [`line_limit`], so that an export of an
/// event at the limit re-imports.
pub const LINE_ENVELOPE_BYTES: usize = 64 * 1024;

/// How much longer than the store's JSON text an event's line may be
/// written: `export` writes DEL (one byte as kept) and C1 characters (two)
/// as six-byte escapes (`\u007f`), so that no line can drive a terminal.
pub const LINE_ESCAPE_FACTOR: usize = 6;

/// Levels of arrays and objects the JSON parser reads, counting the
/// event's own object: serde_json stops at its recursion limit (128) so
/// that a hostile input cannot exhaust the stack.
pub const MAX_JSON_DEPTH: usize = 127;

/// [`json_error_said`] of one line of input ("malformed JSON"): serde_json
/// places its error at line 1 of the text it was given, which is the
/// input's line, whose number is the caller's to give: the column is what
/// is left to say.
pub(crate) fn line_json_error(e: &serde_json::Error) -> String {
    json_error_said("malformed JSON", e).replace(" at line 1 column ", " at column ")
}

/// serde_json's error said for a person, after `prefix` ("malformed
/// JSON"). Its recursion limit is no flaw of the text, so it is said as
/// the store's limit, not as malformed JSON. Its words for a `\u` escape
/// of half a surrogate pair named neither the surrogate nor the pair (a
/// high one alone was "unexpected end of hex escape", a low one alone a
/// "lone leading surrogate").
pub fn json_error_said(prefix: &str, e: &serde_json::Error) -> String {
    let said = e.to_string();
    if let Some(at) = said.strip_prefix("recursion limit exceeded") {
        return format!(
            "the JSON nests arrays and objects more than {MAX_JSON_DEPTH} levels deep, more than the store reads{at}"
        );
    }
    const SURROGATES: [(&str, &str); 2] = [
        (
            "unexpected end of hex escape",
            "a \\u escape is cut short, or is a high surrogate (D800–DBFF) not followed by the \\u escape of its low half",
        ),
        (
            "lone leading surrogate in hex escape",
            "a \\u escape is half of a surrogate pair (D800–DFFF) without its other half, which is no character",
        ),
    ];
    for (theirs, ours) in SURROGATES {
        if let Some(at) = said.strip_prefix(theirs) {
            return format!("{prefix}: {ours}{at}");
        }
    }
    format!("{prefix}: {said}")
}

/// The longest line `import` and `append` read for a limit of
/// `max_event_bytes`: room for an event at the limit written with every
/// character escaped ([`LINE_ESCAPE_FACTOR`]) and its envelope
/// ([`LINE_ENVELOPE_BYTES`]).
pub fn line_limit(max_event_bytes: usize) -> usize {
    max_event_bytes
        .saturating_mul(LINE_ESCAPE_FACTOR)
        .saturating_add(LINE_ENVELOPE_BYTES)
}

/// Parses one JSON line into an event, checking the envelope fields allowed
/// for `kind`. A line over [`line_limit`] of `max_bytes` is refused
/// unparsed; the event's own size is the store's to judge.
pub fn parse_line(
    line: &str,
    kind: LineKind,
    max_bytes: usize,
) -> Result<ParsedLine, ValidationError> {
    if line.len() > line_limit(max_bytes) {
        return Err(ValidationError::new(
            Rule::TooLarge,
            None,
            format!(
                "the line is {} bytes, over the {} a line may hold for events of up to {max_bytes} bytes of JSON (six times that, for escapes, and {} KiB for the envelope and spacing)",
                line.len(),
                line_limit(max_bytes),
                LINE_ENVELOPE_BYTES / 1024
            ),
        ));
    }
    // A reader drops the mark before an input's first line; one here
    // starts a later line (files joined with `cat`), which serde_json
    // said only as "expected value at column 1".
    if line.starts_with('\u{feff}') {
        return Err(ValidationError::new(
            Rule::MalformedJson,
            None,
            "the line starts with a byte order mark (U+FEFF): one is skipped before an input's first line, and no other (were files joined?)",
        ));
    }
    let malformed =
        |e: serde_json::Error| ValidationError::new(Rule::MalformedJson, None, line_json_error(&e));
    check_reserved_key(line.as_bytes())
        .map_err(|m| ValidationError::new(Rule::MalformedJson, None, m))?;
    let value: Value = serde_json::from_str(line).map_err(malformed)?;
    check_unique_keys(line.as_bytes()).map_err(malformed)?;
    let Value::Object(map) = value else {
        return Err(ValidationError::new(
            Rule::MalformedJson,
            None,
            "an event must be a JSON object",
        ));
    };
    read_event_object(map, kind)
}

fn take_uuid(
    map: &mut Map<String, Value>,
    field: &'static str,
) -> Result<Option<Uuid>, ValidationError> {
    match map.remove(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Uuid::parse_str(&s).map(Some).map_err(|_| {
            ValidationError::new(
                Rule::BadUuid,
                Some(field),
                format!("`{field}` is not a UUID: {}", crate::error::quoted(&s)),
            )
        }),
        Some(other) => Err(ValidationError::new(
            Rule::MistypedField,
            Some(field),
            format!("`{field}` must be a UUID string, found {}", kind_of(&other)),
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

/// Parses an event from a JSON object (see [`parse_line`]).
pub fn parse_event_object(
    map: Map<String, Value>,
    kind: LineKind,
) -> Result<ParsedLine, ValidationError> {
    // A map built by a caller, not parsed from text: judged as the parser
    // judges text (depth, reserved keys) before anything reads it. Dropped
    // a level at a time when refused (its drop may be as deep).
    if let Err(e) = crate::validate::check_object_values(&map) {
        drop_flat_map(map);
        return Err(e);
    }
    read_event_object(map, kind)
}

/// [`parse_event_object`] of a map whose depth and keys are already
/// judged: one [`parse_line`] parsed from text, whose parser and
/// [`check_reserved_key`] did.
fn read_event_object(
    mut map: Map<String, Value>,
    kind: LineKind,
) -> Result<ParsedLine, ValidationError> {
    for forbidden in ["seq", "position"] {
        if map.contains_key(forbidden) {
            return Err(ValidationError::new(
                Rule::UnknownField,
                Some(forbidden),
                format!("`{forbidden}` is assigned by the store and must not be given"),
            ));
        }
    }
    if kind == LineKind::Append {
        // Present at all, even as null: §3 rejects a field that is not the
        // type's, and these two are only an import line's.
        for (envelope, why) in [
            (
                "session_id",
                "an append's events belong to the session it is made to",
            ),
            ("recorded_at", "the store records the time of an append"),
        ] {
            if map.contains_key(envelope) {
                return Err(ValidationError::new(
                    Rule::UnknownField,
                    Some(envelope),
                    format!("`{envelope}` is only accepted by import: {why}"),
                ));
            }
        }
    }
    let session_id = take_uuid(&mut map, "session_id")?;
    if kind == LineKind::Import && session_id.is_none() {
        return Err(ValidationError::new(
            Rule::MissingField,
            Some("session_id"),
            "missing field `session_id`",
        ));
    }
    let event_id = take_uuid(&mut map, "event_id")?;
    let recorded_at = match map.remove("recorded_at") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => {
            let t = DateTime::parse_from_rfc3339(&s)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| {
                    ValidationError::new(
                        Rule::MistypedField,
                        Some("recorded_at"),
                        format!(
                            "`recorded_at` is not an RFC 3339 time: {}",
                            crate::error::quoted(&s)
                        ),
                    )
                })?;
            crate::validate::check_recorded_at(&t)?;
            Some(t)
        }
        Some(other) => {
            return Err(ValidationError::new(
                Rule::MistypedField,
                Some("recorded_at"),
                format!(
                    "`recorded_at` must be an RFC 3339 string, found {}",
                    kind_of(&other)
                ),
            ))
        }
    };
    let type_value = map.remove("type").ok_or_else(|| {
        ValidationError::new(Rule::MissingField, Some("type"), "missing field `type`")
    })?;
    let body = parse_body(type_value, map)?;
    Ok(ParsedLine {
        session_id,
        event: NewEvent {
            event_id,
            recorded_at,
            body,
        },
    })
}

fn some_value<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionStartedP {
    mode: String,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
}
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogDefinedP {
    mode: String,
    deferred_tools: Vec<String>,
}
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TextP {
    text: String,
}
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolCallP {
    call_id: String,
    tool_name: String,
    input: Value,
}
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolResultP {
    call_id: String,
    tool_name: String,
    status: ToolStatus,
    #[serde(default, deserialize_with = "some_value")]
    output: Option<Value>,
    #[serde(default)]
    added_tool_names: Option<Vec<String>>,
}
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompactionP {
    summary: String,
    #[serde(default)]
    first_kept_event_id: Option<String>,
    #[serde(default)]
    tokens_before: Option<i64>,
}
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModeP {
    mode: String,
}

fn payload<T: for<'de> Deserialize<'de>>(
    type_name: &str,
    map: Map<String, Value>,
) -> Result<T, ValidationError> {
    // serde_path_to_error names the field (e.g. `deferred_tools[2]`) that a
    // bare serde error would leave out.
    serde_path_to_error::deserialize(Value::Object(map)).map_err(|e| {
        let path = cut_long(&e.path().to_string());
        let msg = cut_long_quotes(&in_json_terms(&path, e.inner().to_string()));
        let (rule, field) = if msg.starts_with("unknown field") {
            (Rule::UnknownField, msg.split('`').nth(1).map(str::to_owned))
        } else if msg.starts_with("missing field") {
            (Rule::MissingField, msg.split('`').nth(1).map(str::to_owned))
        } else {
            (Rule::MistypedField, (path != ".").then(|| path.clone()))
        };
        let text = match (&rule, &field) {
            (Rule::MistypedField, Some(f)) => {
                format!("invalid `{type_name}` event: field `{f}`: {msg}")
            }
            _ => format!("invalid `{type_name}` event: {msg}"),
        };
        ValidationError::new(rule, None, text).with_field_name(field)
    })
}

/// What serde quotes (between backticks: a field's name; between double
/// quotes: a string value) cut past 120 characters, with its length
/// said: an unknown key or a `status` of 500 KB made an error of 1 MB,
/// the key in it twice.
fn cut_long_quotes(msg: &str) -> String {
    let mut out = msg.to_owned();
    for mark in ['`', '"'] {
        out = out
            .split(mark)
            .enumerate()
            .map(|(i, part)| match i % 2 {
                1 => cut_long(part),
                _ => part.to_owned(),
            })
            .collect::<Vec<_>>()
            .join(&mark.to_string());
    }
    out
}

/// `s` cut as [`crate::error::quoted`] cuts, with its length said.
fn cut_long(s: &str) -> String {
    match crate::error::cut_head(s) {
        None => s.to_owned(),
        Some(head) => format!("{head}… ({} bytes)", s.len()),
    }
}

/// serde's words for a mistyped field said in JSON's (an array, an
/// object, null), and what the two fields with a narrower type than JSON's
/// must hold, instead of `invalid number` or `expected i64`.
fn in_json_terms(field: &str, msg: String) -> String {
    match field {
        "tokens_before" if !msg.starts_with("unknown") => {
            return format!(
                "must be a whole number from {} to {}, or null",
                i64::MIN,
                i64::MAX
            )
        }
        "status" if msg.starts_with("invalid type") => {
            return "must be one of `success`, `error`, `interrupted`, `placeholder`".to_owned()
        }
        _ => {}
    }
    let mut msg = msg;
    for (serde, json) in [
        ("a sequence", "an array"),
        ("sequence", "array"),
        ("a map", "an object"),
        ("map", "object"),
        ("unit value", "null"),
    ] {
        msg = msg
            .replace(
                &format!("invalid type: {serde},"),
                &format!("invalid type: {json},"),
            )
            .replace(&format!("expected {serde}"), &format!("expected {json}"));
    }
    msg
}

fn parse_body(type_value: Value, map: Map<String, Value>) -> Result<EventBody, ValidationError> {
    let Value::String(type_name) = type_value else {
        return Err(ValidationError::new(
            Rule::MistypedField,
            Some("type"),
            format!("`type` must be a string, found {}", kind_of(&type_value)),
        ));
    };
    let body = match type_name.as_str() {
        "session_started" => {
            let p: SessionStartedP = payload(&type_name, map)?;
            EventBody::SessionStarted {
                mode: p.mode,
                metadata: p.metadata,
            }
        }
        "catalog_defined" => {
            let p: CatalogDefinedP = payload(&type_name, map)?;
            EventBody::CatalogDefined {
                mode: p.mode,
                deferred_tools: p.deferred_tools,
            }
        }
        "prompt_submitted" => EventBody::PromptSubmitted {
            text: payload::<TextP>(&type_name, map)?.text,
        },
        "assistant_message" => EventBody::AssistantMessage {
            text: payload::<TextP>(&type_name, map)?.text,
        },
        "tool_call" => {
            let p: ToolCallP = payload(&type_name, map)?;
            EventBody::ToolCall {
                call_id: p.call_id,
                tool_name: p.tool_name,
                input: p.input,
            }
        }
        "tool_result" => {
            let p: ToolResultP = payload(&type_name, map)?;
            EventBody::ToolResult {
                call_id: p.call_id,
                tool_name: p.tool_name,
                status: p.status,
                output: p.output,
                added_tool_names: p.added_tool_names,
            }
        }
        "compaction" => {
            let p: CompactionP = payload(&type_name, map)?;
            let first_kept_event_id = match p.first_kept_event_id {
                None => None,
                Some(s) => Some(Uuid::parse_str(&s).map_err(|_| {
                    ValidationError::new(
                        Rule::BadUuid,
                        Some("first_kept_event_id"),
                        format!(
                            "`first_kept_event_id` is not a UUID: {}",
                            crate::error::quoted(&s)
                        ),
                    )
                })?),
            };
            EventBody::Compaction {
                summary: p.summary,
                first_kept_event_id,
                tokens_before: p.tokens_before,
            }
        }
        "mode_switched" => EventBody::ModeSwitched {
            mode: payload::<ModeP>(&type_name, map)?.mode,
        },
        other => {
            return Err(ValidationError::new(
                Rule::UnknownType,
                Some("type"),
                format!(
                    "unknown event type {}; expected one of {}",
                    crate::error::quoted(other),
                    EVENT_TYPES.join(", ")
                ),
            ))
        }
    };
    Ok(body)
}

#[cfg(test)]
mod tests {
    //! Parsing rules of SEMANTICS §3–§4 and §9 (import lines).

    use super::*;

    const S: &str = "11111111-2222-4333-8444-555555555555";

    fn parse(line: &str) -> Result<ParsedLine, ValidationError> {
        parse_line(line, LineKind::Import, DEFAULT_LIMIT)
    }

    /// A map built by a caller is judged as text is: a key serde_json
    /// reserves is refused (it turned the object into a number), and a
    /// value far too deep is refused on a small stack without overflowing
    /// it (reading or dropping it recursively did).
    #[test]
    fn an_event_object_built_in_code_is_judged_as_text_is() {
        let call = |input: Value| {
            let mut map = Map::new();
            map.insert("type".into(), Value::from("tool_call"));
            map.insert("call_id".into(), Value::from("c"));
            map.insert("tool_name".into(), Value::from("T"));
            map.insert("input".into(), input);
            map
        };
        for key in RESERVED_KEYS {
            let mut inner = Map::new();
            inner.insert(key.to_owned(), Value::from("12345"));
            let e = parse_event_object(call(serde_json::json!({"a": inner})), LineKind::Append)
                .map(|p| p.event.body)
                .expect_err("a reserved key");
            assert_eq!(
                (e.rule, e.field.as_deref()),
                (Rule::MalformedJson, Some("input")),
                "{e}"
            );
            assert!(e.message.contains(key), "{e}");
        }
        let deep = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let mut v = Value::from(1);
                for _ in 0..50_000 {
                    v = Value::Array(vec![v]);
                }
                parse_event_object(call(v), LineKind::Append).map(|p| p.event.body)
            })
            .unwrap()
            .join()
            .expect("no stack overflow");
        let e = deep.expect_err("too deep");
        assert_eq!(e.rule, Rule::MalformedJson, "{e}");
    }

    const DEFAULT_LIMIT: usize = 1 << 20;

    fn rule(line: &str) -> (Rule, Option<String>) {
        let e = parse(line).expect_err("should be rejected");
        (e.rule, e.field)
    }

    fn line(rest: &str) -> String {
        format!(r#"{{"session_id":"{S}",{rest}}}"#)
    }

    #[test]
    fn half_a_surrogate_pair_is_said_as_such() {
        for (text, said) in [
            (r#""a\ud800b""#, "high surrogate (D800–DBFF) not followed"),
            (
                r#""\udc00""#,
                "half of a surrogate pair (D800–DFFF) without its other half",
            ),
        ] {
            let e = parse(&line(&format!(
                r#""type":"assistant_message","text":{text}"#
            )))
            .expect_err("half a pair is refused");
            assert_eq!(e.rule, Rule::MalformedJson);
            assert!(
                e.message.contains(said) && e.message.contains(" at column "),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn malformed_json_and_non_objects_are_rejected() {
        assert_eq!(rule("{").0, Rule::MalformedJson);
        assert_eq!(rule("[1]").0, Rule::MalformedJson);
        assert_eq!(rule("null").0, Rule::MalformedJson);
    }

    #[test]
    fn json_nested_past_the_parser_limit_is_refused_as_too_deep_not_as_garbled() {
        // The event's object is one level; `input` adds the rest.
        let nested = |levels: usize| {
            let arrays = levels - 1;
            line(&format!(
                r#""type":"tool_call","call_id":"c","tool_name":"T","input":{}{}"#,
                "[".repeat(arrays),
                "]".repeat(arrays)
            ))
        };
        assert!(parse(&nested(MAX_JSON_DEPTH)).is_ok());
        let e = parse(&nested(MAX_JSON_DEPTH + 1)).expect_err("one level too deep");
        assert_eq!(e.rule, Rule::MalformedJson);
        assert!(
            e.message.contains("more than 127 levels deep") && !e.message.contains("malformed"),
            "{}",
            e.message
        );
    }
    #[test]
    fn an_unknown_type_is_rejected() {
        assert_eq!(
            rule(&line(r#""type":"nope""#)),
            (Rule::UnknownType, Some("type".into()))
        );
        assert_eq!(
            rule(&line(r#""type":5"#)),
            (Rule::MistypedField, Some("type".into()))
        );
        assert_eq!(
            rule(&format!(r#"{{"session_id":"{S}"}}"#)).0,
            Rule::MissingField
        );
    }

    #[test]
    fn missing_mistyped_and_unknown_fields_are_rejected_by_name() {
        assert_eq!(
            rule(&line(r#""type":"tool_call","call_id":"c","tool_name":"t""#)),
            (Rule::MissingField, Some("input".into()))
        );
        assert_eq!(
            rule(&line(r#""type":"prompt_submitted","text":5"#)),
            (Rule::MistypedField, Some("text".into()))
        );
        assert_eq!(
            rule(&line(
                r#""type":"prompt_submitted","text":"x","mode":"agent""#
            )),
            (Rule::UnknownField, Some("mode".into()))
        );
        assert_eq!(
            rule(&line(
                r#""type":"compaction","summary":"s","tokens_before":1.5"#
            ))
            .0,
            Rule::MistypedField
        );
        assert_eq!(
            rule(&line(
                r#""type":"session_started","mode":"a","metadata":[1]"#
            )),
            (Rule::MistypedField, Some("metadata".into()))
        );
    }

    /// A long unknown key or bad value is quoted cut, with its length: a
    /// key of 500 KB made an error of 1 MB.
    #[test]
    fn a_long_name_or_value_is_quoted_cut() {
        let key = "k".repeat(500_000);
        let value = "s".repeat(500_000);
        for rest in [
            format!(r#""type":"prompt_submitted","text":"x","{key}":1"#),
            format!(r#""type":"tool_result","call_id":"c","tool_name":"t","status":"{value}""#),
        ] {
            let e = parse(&line(&rest)).expect_err("should be rejected");
            let said = e.to_string();
            assert!(said.len() < 1_000, "{} bytes: {}", said.len(), &said[..300]);
            assert!(said.contains("… (500000 bytes)"), "{said}");
            assert!(
                e.field.as_ref().is_some_and(|f| f.len() < 200),
                "{:?}",
                e.field.map(|f| f.len())
            );
        }
    }

    #[test]
    fn bad_uuids_are_rejected() {
        assert_eq!(
            rule(r#"{"session_id":"x","type":"prompt_submitted","text":"x"}"#),
            (Rule::BadUuid, Some("session_id".into()))
        );
        assert_eq!(
            rule(&line(
                r#""event_id":"1-2","type":"prompt_submitted","text":"x""#
            )),
            (Rule::BadUuid, Some("event_id".into()))
        );
        assert_eq!(
            rule(&line(
                r#""type":"compaction","summary":"s","first_kept_event_id":"zz""#
            )),
            (Rule::BadUuid, Some("first_kept_event_id".into()))
        );
    }

    #[test]
    fn the_store_assigns_seq_and_position() {
        for f in ["seq", "position"] {
            let l = line(&format!(r#""type":"prompt_submitted","text":"x","{f}":1"#));
            assert_eq!(rule(&l), (Rule::UnknownField, Some(f.into())));
        }
    }

    #[test]
    fn an_import_line_needs_its_session_and_append_lines_take_no_time() {
        assert_eq!(
            rule(r#"{"type":"prompt_submitted","text":"x"}"#),
            (Rule::MissingField, Some("session_id".into()))
        );
        let l = r#"{"type":"prompt_submitted","text":"x","recorded_at":"2025-01-01T00:00:00Z"}"#;
        let e = parse_line(l, LineKind::Append, DEFAULT_LIMIT).unwrap_err();
        assert_eq!(e.rule, Rule::UnknownField);
        let bad_time = line(r#""type":"prompt_submitted","text":"x","recorded_at":"yesterday""#);
        assert_eq!(
            rule(&bad_time),
            (Rule::MistypedField, Some("recorded_at".into()))
        );
    }

    #[test]
    fn a_mistyped_field_is_said_in_json_terms() {
        for (rest, said) in [
            (
                r#""type":"compaction","summary":"s","tokens_before":1.0"#,
                "must be a whole number from",
            ),
            (
                r#""type":"compaction","summary":"s","tokens_before":"5""#,
                "must be a whole number from",
            ),
            (
                r#""type":"compaction","summary":"s","tokens_before":99999999999999999999"#,
                "must be a whole number from",
            ),
            (
                r#""type":"tool_result","call_id":"c","tool_name":"t","status":1"#,
                "must be one of `success`, `error`",
            ),
            (
                r#""type":"catalog_defined","mode":"a","deferred_tools":"x""#,
                "expected an array",
            ),
            (
                r#""type":"session_started","mode":"a","metadata":[1]"#,
                "invalid type: array, expected an object",
            ),
            (
                r#""type":"session_started","mode":null"#,
                "invalid type: null, expected a string",
            ),
        ] {
            let e = parse(&line(rest)).unwrap_err();
            assert_eq!(e.rule, Rule::MistypedField, "{rest}");
            assert!(e.message.contains(said), "{rest}: {}", e.message);
            assert!(
                !e.message.contains("i64") && !e.message.contains("sequence"),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn numbers_are_equal_by_value_whatever_their_spelling() {
        let v = |t: &str| serde_json::from_str::<Value>(t).unwrap();
        for (a, b) in [
            ("1", "1.0"),
            ("100", "1e2"),
            ("100", "1E+2"),
            ("0.5", "0.50"),
            ("0.5", "5e-1"),
            ("-0", "0"),
            ("-0.0", "0e5"),
            ("10", "1e0000000000000000000000000000001"),
            ("0.1", "1E-00000000000000000000000000000000001"),
            (
                "123456789012345678901234567890",
                "1.2345678901234567890123456789e29",
            ),
            (
                r#"{"a": [1, {"b": 2.50}], "c": 3}"#,
                r#"{"c": 3e0, "a": [1.0, {"b": 2.5}]}"#,
            ),
        ] {
            assert!(json_equal(&v(a), &v(b)), "{a} = {b}");
            assert!(json_equal(&v(b), &v(a)), "{b} = {a}");
        }
        for (a, b) in [
            ("1", "-1"),
            ("1", "10"),
            ("0.1", "0.01"),
            ("1e2", "1e3"),
            ("1", "\"1\""),
            ("[1, 2]", "[2, 1]"),
            (r#"{"a": 1}"#, r#"{"a": 1, "b": 1}"#),
            (
                "1e99999999999999999999999999999999",
                "1e99999999999999999999999999999998",
            ),
        ] {
            assert!(!json_equal(&v(a), &v(b)), "{a} ≠ {b}");
        }
    }

    #[test]
    fn the_number_key_of_serde_json_is_refused_however_spelled() {
        // Stored as given, it would read back as the number 12, or fail
        // to parse with a message about numbers.
        for payload in [
            r#"{"$serde_json::private::Number":"12"}"#,
            r#"{"k": {"$serde_json::private::Number" : "1", "x": 2}}"#,
            r#"{"x": 2, "\u0024serde_json::private::Numbe\u0072": "1"}"#,
            r#"{"$serde_json::private::RawValue": "[1,2]"}"#,
            r#"[{"$serde_json::private::RawValu\u0065": "{\"$serde_json::private::Number\":\"12\"}"}]"#,
        ] {
            let l = line(&format!(
                r#""type":"tool_call","call_id":"c","tool_name":"t","input":{payload}"#
            ));
            let e = parse(&l).unwrap_err();
            assert_eq!(e.rule, Rule::MalformedJson, "{payload}");
            assert!(e.message.contains("cannot be stored"), "{}", e.message);
        }
        // As a value, beside numbers, or a key that only resembles it.
        for payload in [
            r#"{"k": "$serde_json::private::Number", "n": 1.50, "Number": 1e400}"#,
            r#"{"$serde_json::private::Number2": "12", "\u0041": ["Number"]}"#,
        ] {
            let l = line(&format!(
                r#""type":"tool_call","call_id":"c","tool_name":"t","input":{payload}"#
            ));
            let parsed = parse(&l).unwrap();
            let EventBody::ToolCall { input, .. } = parsed.event.body else {
                panic!("{parsed:?}")
            };
            assert_eq!(
                input.to_string(),
                serde_json::from_str::<Value>(payload).unwrap().to_string()
            );
        }
        assert_eq!(check_reserved_key(b"{\"a\": \"\\\""), Ok(()));
    }

    #[test]
    fn a_line_past_the_limit_and_the_envelopes_room_is_rejected_unparsed() {
        let l = line(r#""type":"prompt_submitted","text":"xxxxxxxxxxxxxxxx""#);
        // Parsed up to six times the limit and the envelope's room (the
        // event's own size is the store's to judge), refused unread past.
        let max = 10;
        assert_eq!(line_limit(max), 60 + LINE_ENVELOPE_BYTES);
        let at_limit = format!("{l}{}", " ".repeat(line_limit(max) - l.len()));
        assert!(parse_line(&at_limit, LineKind::Import, max).is_ok());
        let e = parse_line(&format!("{at_limit} "), LineKind::Import, max).unwrap_err();
        assert_eq!(e.rule, Rule::TooLarge);
        assert!(e.message.contains("six times"), "{}", e.message);
    }

    #[test]
    fn optional_nulls_equal_absent_fields_but_output_null_is_kept() {
        let with_nulls = parse(&line(
            r#""type":"tool_result","call_id":"c","tool_name":"t","status":"error","output":null,"added_tool_names":null"#,
        ))
        .unwrap();
        let EventBody::ToolResult {
            output,
            added_tool_names,
            ..
        } = &with_nulls.event.body
        else {
            panic!()
        };
        assert_eq!(output, &Some(Value::Null));
        assert_eq!(added_tool_names, &None);
        let absent = parse(&line(
            r#""type":"tool_result","call_id":"c","tool_name":"t","status":"error""#,
        ))
        .unwrap();
        assert_ne!(
            absent.event.body, with_nulls.event.body,
            "output null differs from absent"
        );
        let a = parse(&line(
            r#""type":"compaction","summary":"s","first_kept_event_id":null,"tokens_before":null"#,
        ))
        .unwrap();
        let b = parse(&line(r#""type":"compaction","summary":"s""#)).unwrap();
        assert_eq!(a.event.body, b.event.body);
        let a = parse(&line(
            r#""type":"session_started","mode":"m","metadata":null"#,
        ))
        .unwrap();
        let b = parse(&line(r#""type":"session_started","mode":"m""#)).unwrap();
        assert_eq!(a.event.body, b.event.body);
        let call = parse(&line(
            r#""type":"tool_call","call_id":"c","tool_name":"t","input":null"#,
        ))
        .unwrap();
        assert!(matches!(
            call.event.body,
            EventBody::ToolCall {
                input: Value::Null,
                ..
            }
        ));
    }

    #[test]
    fn payload_values_round_trip_exactly() {
        let l = line(
            r#""type":"tool_call","call_id":"c","tool_name":"t","input":{"big":123456789012345678901234567890,"neg":-0.5,"s":"é\u0000","a":[{},[]]}"#,
        );
        let body = parse(&l).unwrap().event.body;
        let text = body.to_json_text();
        assert!(text.contains("123456789012345678901234567890"), "{text}");
        assert_eq!(EventBody::from_json_text(&text).unwrap(), body);
    }
}
