//! The rules of SEMANTICS §3–§4, pure: an event is judged against the
//! session as it stands ([`SessionState`]) before it is applied.

use std::collections::HashMap;

use chrono::{DateTime, Datelike, Utc};

use crate::error::{quoted, Rule, ValidationError};
use crate::event::EventBody;
use crate::projector::SessionState;
use serde_json::Value;

/// The longest tool name, in bytes of UTF-8 (§3).
pub const MAX_TOOL_NAME_BYTES: usize = 256;

/// The longest `call_id` a `tool_call` may introduce, in bytes of UTF-8.
/// §3 asks only for a non-empty string; the store keys its calls index by
/// it, and a PostgreSQL index entry holds at most 2 704 bytes: a call id of
/// about 2.7 KB failed its group's commit there ("index row size exceeds
/// btree maximum"), and every other append of that group with it, while
/// SQLite took it. Refused on both backends alike, alone, with the field
/// named; agents' call ids are tens of bytes. 2 048 bytes and the entry's
/// other parts (the session id, headers) stay below the index's bound
/// whether or not the id compresses.
pub const MAX_CALL_ID_BYTES: usize = 2048;

/// The default limit on one event's JSON text (§4).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1024 * 1024;

/// What a tenant's name may be, said when it is not: 1 to 200 bytes of
/// UTF-8, no control characters, no characters that reorder displayed
/// text (a name shown reversed in a log or a token document), no
/// whitespace at either end (`acme ` would be a tenant of its own, beside
/// `acme`). One rule for the token documents, `--tenant` and the audit
/// filters (docs/api.md).
pub fn tenant_name_problem(name: &str) -> Option<&'static str> {
    const BIDI: &[char] = &[
        '\u{061C}', '\u{200E}', '\u{200F}', '\u{202A}', '\u{202B}', '\u{202C}', '\u{202D}',
        '\u{202E}', '\u{2066}', '\u{2067}', '\u{2068}', '\u{2069}',
    ];
    if name.is_empty() || name.len() > 200 {
        Some("a tenant is 1 to 200 bytes of UTF-8")
    } else if name.chars().any(char::is_control) {
        Some("a tenant holds no control characters")
    } else if name.chars().any(|c| BIDI.contains(&c)) {
        Some("a tenant holds no characters that change the direction of text")
    } else if name.trim() != name {
        Some("a tenant neither starts nor ends with whitespace")
    } else {
        None
    }
}

/// Whether `s` holds a control character as §3 counts them (U+0000–U+001F,
/// U+007F), which no tool name may.
pub fn has_control_char(s: &str) -> bool {
    s.chars().any(|c| c <= '\u{1f}' || c == '\u{7f}')
}

/// A tool name as §3 defines it: non-empty, at most 256 bytes, no control
/// character. Also applied to the names audit queries ask about, which
/// can match nothing else.
pub fn check_tool_name(name: &str, field: &str) -> Result<(), ValidationError> {
    let problem = if name.is_empty() {
        Some("is empty".to_owned())
    } else if name.len() > MAX_TOOL_NAME_BYTES {
        Some(format!(
            "is {} bytes long, over the limit of {MAX_TOOL_NAME_BYTES}",
            name.len()
        ))
    } else if has_control_char(name) {
        Some("holds a control character".to_owned())
    } else {
        None
    };
    match problem {
        Some(p) => Err(ValidationError::new(
            Rule::BadToolName,
            Some(field),
            format!("tool name {} in `{field}` {p}", quoted(name)),
        )),
        None => Ok(()),
    }
}

fn check_non_empty(value: &str, field: &str) -> Result<(), ValidationError> {
    if value.is_empty() {
        Err(ValidationError::new(
            Rule::EmptyField,
            Some(field),
            format!("`{field}` must be a non-empty string"),
        ))
    } else {
        Ok(())
    }
}

/// Refuses a JSON value of `body` (a call's `input`, a result's `output`,
/// a session's `metadata`) that the store could not read back: arrays and
/// objects nested deeper than [`crate::event::MAX_JSON_DEPTH`] levels
/// (counting the event's own object, as the parser counts them), or an
/// object key that serde_json reserves ([`crate::event::RESERVED_KEYS`]).
/// The command line and the HTTP server refuse both when they parse the
/// text; a library caller hands the store values, which must be judged
/// the same way before anything serializes, compares or hashes them:
/// stored, such an event made its session unreadable after a restart, and
/// a value tens of thousands of levels deep overflowed the stack of the
/// thread serializing it. Walked with an explicit stack.
pub fn check_values(body: &EventBody) -> Result<(), ValidationError> {
    // (field, value, level of the value if it is an array or object)
    let mut stack: Vec<(&str, &Value, usize)> = Vec::new();
    match body {
        EventBody::ToolCall { input, .. } => stack.push(("input", input, 2)),
        EventBody::ToolResult {
            output: Some(output),
            ..
        } => stack.push(("output", output, 2)),
        EventBody::SessionStarted {
            metadata: Some(metadata),
            ..
        } => {
            for (key, value) in metadata {
                check_key("metadata", key)?;
                stack.push(("metadata", value, 3));
            }
        }
        _ => {}
    }
    check_tree(stack)
}

/// [`check_values`] of an event object handed over as a map
/// ([`crate::event::parse_event_object`]), before it is read into an
/// event: reading a value tens of thousands of levels deep overflowed the
/// reader's stack, and a reserved key turned an object into a number.
pub fn check_object_values(map: &serde_json::Map<String, Value>) -> Result<(), ValidationError> {
    let mut stack = Vec::with_capacity(map.len());
    for (key, value) in map {
        check_key(key, key)?;
        stack.push((key.as_str(), value, 2));
    }
    check_tree(stack)
}

/// Refuses a key serde_json reserves, in `field`.
fn check_key(field: &str, key: &str) -> Result<(), ValidationError> {
    match crate::event::RESERVED_KEYS.contains(&key) {
        true => Err(ValidationError::new(
            Rule::MalformedJson,
            Some(field),
            format!(
                "`{field}` has the object key {}, which cannot be stored: the JSON library the store is built on reserves it",
                quoted(key)
            ),
        )),
        false => Ok(()),
    }
}

/// Walks `stack` (a field, a value, the value's level were it an array or
/// an object) with no recursion: every key checked, no level past
/// [`crate::event::MAX_JSON_DEPTH`].
fn check_tree(mut stack: Vec<(&str, &Value, usize)>) -> Result<(), ValidationError> {
    use crate::event::MAX_JSON_DEPTH;
    while let Some((field, value, level)) = stack.pop() {
        if !matches!(value, Value::Array(_) | Value::Object(_)) {
            continue;
        }
        if level > MAX_JSON_DEPTH {
            return Err(ValidationError::new(
                Rule::MalformedJson,
                Some(field),
                format!(
                    "`{field}` nests arrays and objects more than {MAX_JSON_DEPTH} levels deep (counting the event's own object), more than the store reads"
                ),
            ));
        }
        match value {
            Value::Array(items) => stack.extend(items.iter().map(|v| (field, v, level + 1))),
            Value::Object(map) => {
                for (key, v) in map {
                    check_key(field, key)?;
                    stack.push((field, v, level + 1));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// [`MAX_CALL_ID_BYTES`], judged where a call id is introduced (a
/// `tool_call`): a result names a stored call, and one longer than the
/// limit answers no call stored since.
fn check_call_id_len(call_id: &str) -> Result<(), ValidationError> {
    if call_id.len() <= MAX_CALL_ID_BYTES {
        return Ok(());
    }
    Err(ValidationError::new(
        Rule::MistypedField,
        Some("call_id"),
        format!(
            "`call_id` is {} bytes long, over the limit of {MAX_CALL_ID_BYTES} (the store keys its calls index by it)",
            call_id.len()
        ),
    ))
}

/// Refuses U+0000 in the strings the store keeps outside the payload's
/// JSON text, which §3 allows: `mode` (the view), `call_id` (the calls
/// index) and `summary` (the view). PostgreSQL cannot store U+0000 in a
/// text column, so such an event, taken by SQLite, would fail a
/// PostgreSQL commit, and with it every other append of its group.
/// Refused here, it fails alike on both backends, alone, with the field
/// named. Strings inside the payload's JSON (`text`, `input`, `output`,
/// `metadata`) are stored as escaped JSON text and round-trip; tool names
/// are refused any control character by `check_tool_name`.
fn check_no_nul(body: &EventBody) -> Result<(), ValidationError> {
    let (field, value) = match body {
        EventBody::SessionStarted { mode, .. }
        | EventBody::CatalogDefined { mode, .. }
        | EventBody::ModeSwitched { mode } => ("mode", mode),
        EventBody::ToolCall { call_id, .. } | EventBody::ToolResult { call_id, .. } => {
            ("call_id", call_id)
        }
        EventBody::Compaction { summary, .. } => ("summary", summary),
        EventBody::PromptSubmitted { .. } | EventBody::AssistantMessage { .. } => return Ok(()),
    };
    if !value.contains('\0') {
        return Ok(());
    }
    Err(ValidationError::new(
        Rule::MistypedField,
        Some(field),
        format!("`{field}` holds the character U+0000, which the store does not accept there"),
    ))
}

/// A time the store can write and read back as RFC 3339 on both backends,
/// and that an export re-imports: years 0000 to 9999 in UTC, and no leap
/// second (second 60), which PostgreSQL reads back as the next second's
/// start: the time exported would differ from the time hashed, and the
/// chain would report an untouched row as changed.
pub fn check_recorded_at(t: &DateTime<Utc>) -> Result<(), ValidationError> {
    if chrono::Timelike::nanosecond(t) >= 1_000_000_000 {
        return Err(ValidationError::new(
            Rule::MistypedField,
            Some("recorded_at"),
            format!(
                "`recorded_at` is a leap second ({}); the store keeps times both backends read back equal, and PostgreSQL has no second 60",
                t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
            ),
        ));
    }
    if (0..=9999).contains(&t.year()) {
        return Ok(());
    }
    Err(ValidationError::new(
        Rule::MistypedField,
        Some("recorded_at"),
        format!(
            "`recorded_at` falls in the year {} in UTC; the store keeps times of the years 0000 to 9999",
            t.year()
        ),
    ))
}

/// The shape rules that need no session: a non-empty mode at
/// `session_started` and non-empty call ids, well-formed tool names, and no
/// U+0000 where PostgreSQL could not store it. §3 asks for a non-empty
/// `mode` only at `session_started`: a `mode_switched` or `catalog_defined`
/// naming the mode `""` is taken as written (it is a mode no session starts
/// in, and one a sidecar may still switch to and give a catalog).
pub fn check_shape(body: &EventBody) -> Result<(), ValidationError> {
    check_no_nul(body)?;
    match body {
        EventBody::SessionStarted { mode, .. } => check_non_empty(mode, "mode"),
        EventBody::ModeSwitched { .. } => Ok(()),
        EventBody::CatalogDefined { deferred_tools, .. } => deferred_tools
            .iter()
            .try_for_each(|n| check_tool_name(n, "deferred_tools")),
        EventBody::ToolCall {
            call_id, tool_name, ..
        } => {
            check_non_empty(call_id, "call_id")?;
            check_call_id_len(call_id)?;
            check_tool_name(tool_name, "tool_name")
        }
        EventBody::ToolResult {
            call_id,
            tool_name,
            status,
            added_tool_names,
            ..
        } => {
            check_non_empty(call_id, "call_id")?;
            check_tool_name(tool_name, "tool_name")?;
            let added = added_tool_names.as_deref().unwrap_or(&[]);
            added
                .iter()
                .try_for_each(|n| check_tool_name(n, "added_tool_names"))?;
            if !added.is_empty() && *status != crate::event::ToolStatus::Success {
                return Err(ValidationError::new(
                    Rule::AddedNamesWithoutSuccess,
                    Some("added_tool_names"),
                    format!(
                        "a `tool_result` with status {:?} must not have non-empty `added_tool_names`",
                        status.as_str()
                    ),
                ));
            }
            Ok(())
        }
        EventBody::PromptSubmitted { .. }
        | EventBody::AssistantMessage { .. }
        | EventBody::Compaction { .. } => Ok(()),
    }
}

/// Refuses an event whose JSON text (`payload_len` bytes) is over the
/// store's limit (§4).
pub fn check_size(payload_len: usize, max_event_bytes: usize) -> Result<(), ValidationError> {
    match payload_len > max_event_bytes {
        true => Err(ValidationError::new(
            Rule::TooLarge,
            None,
            format!(
                "the event is {payload_len} bytes of JSON, over the limit of {max_event_bytes} bytes"
            ),
        )),
        false => Ok(()),
    }
}

/// Judges `event`, whose JSON text is `payload_len` bytes, as the next
/// event of the session in `state`, as an append does (§4): its size, its
/// time, then the rules. The one judgement of an event, shared by the
/// store and by a whole file judged before it is written (pi import).
pub fn check_new_event(
    state: &SessionState,
    event: &crate::event::NewEvent,
    payload_len: usize,
    max_event_bytes: usize,
) -> Result<(), ValidationError> {
    check_size(payload_len, max_event_bytes)?;
    if let Some(t) = &event.recorded_at {
        check_recorded_at(t)?;
    }
    check_event(state, &event.body)
}

/// Judges `body` as the next event of the session in `state` (§4).
pub fn check_event(state: &SessionState, body: &EventBody) -> Result<(), ValidationError> {
    check_shape(body)?;
    match body {
        EventBody::SessionStarted { .. } if state.started => {
            return Err(ValidationError::new(
                Rule::AlreadyStarted,
                Some("type"),
                "the session has already started; `session_started` must be its first event only",
            ))
        }
        EventBody::SessionStarted { .. } => return Ok(()),
        _ if !state.started => {
            return Err(ValidationError::new(
                Rule::NotStarted,
                Some("type"),
                format!(
                    "a `{}` event cannot come before `session_started`",
                    body.type_name()
                ),
            ))
        }
        _ => {}
    }
    match body {
        EventBody::ToolCall { call_id, .. } if state.calls.contains_key(call_id) => {
            Err(ValidationError::new(
                Rule::DuplicateCallId,
                Some("call_id"),
                format!(
                    "`call_id` {} is already used in this session",
                    quoted(call_id)
                ),
            ))
        }
        EventBody::ToolResult {
            call_id, tool_name, ..
        } => match state.calls.get(call_id) {
            None => Err(ValidationError::new(
                Rule::ResultWithoutCall,
                Some("call_id"),
                format!(
                    "`tool_result` for `call_id` {}, which has no earlier `tool_call`",
                    quoted(call_id)
                ),
            )),
            Some(call) if call.result_seq.is_some() => Err(ValidationError::new(
                Rule::DuplicateResult,
                Some("call_id"),
                format!("the call {} already has a result", quoted(call_id)),
            )),
            Some(call) if &call.tool_name != tool_name => Err(ValidationError::new(
                Rule::ResultToolMismatch,
                Some("tool_name"),
                format!(
                    "`tool_name` {} differs from the call's {}",
                    quoted(tool_name),
                    quoted(&call.tool_name)
                ),
            )),
            Some(_) => Ok(()),
        },
        EventBody::Compaction {
            first_kept_event_id: Some(id),
            ..
        } => {
            let Some(start) = state.rows.iter().position(|r| r.event_id == *id) else {
                return Err(ValidationError::new(
                    Rule::CompactionKeepsNonEffectiveRow,
                    Some("first_kept_event_id"),
                    format!("`first_kept_event_id` {id} is not a transcript row of the effective context"),
                ));
            };
            // §4: a compaction may not keep a result whose call *it*
            // summarizes, that is a call among the effective rows before
            // the first kept one. A result whose call an earlier compaction
            // summarized is already apart from it and may stay; naming a
            // result as the first kept row always splits it (§4).
            let first = &state.rows[start];
            if let EventBody::ToolResult { call_id, .. } = &first.body {
                return Err(ValidationError::new(
                    Rule::CompactionSplitsCall,
                    Some("first_kept_event_id"),
                    format!(
                        "`first_kept_event_id` names the result at seq {} of the call {}: a compaction that keeps from a result always splits it from its call",
                        first.seq,
                        quoted(call_id)
                    ),
                ));
            }
            let summarized: HashMap<&str, i64> = state.rows[..start]
                .iter()
                .filter_map(|r| match &r.body {
                    EventBody::ToolCall { call_id, .. } => Some((call_id.as_str(), r.seq)),
                    _ => None,
                })
                .collect();
            // Nothing summarized (the whole window kept): no result can
            // be split from its call, and the window is not walked.
            let kept = match summarized.is_empty() {
                true => &state.rows[..0],
                false => &state.rows[start..],
            };
            for row in kept {
                if let EventBody::ToolResult { call_id, .. } = &row.body {
                    if let Some(call_seq) = summarized.get(call_id.as_str()) {
                        return Err(ValidationError::new(
                            Rule::CompactionSplitsCall,
                            Some("first_kept_event_id"),
                            format!(
                                "the compaction would keep the result at seq {} but summarize its call {} at seq {call_seq}",
                                row.seq,
                                quoted(call_id)
                            ),
                        ));
                    }
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    //! Each rule of SEMANTICS §3–§4 that needs the session, one test each,
    //! asserting the rule and the field. (Parsing rules are tested in
    //! `event.rs`; every rule also runs through the binary in tests/cli.rs.)

    use super::*;

    /// `check_values` refuses a value exactly when the line holding it
    /// would not parse: the same depth, in each field that holds values.
    #[test]
    fn check_values_agrees_with_the_parser_on_depth() {
        use crate::event::{parse_line, LineKind, MAX_JSON_DEPTH};
        let nested = |levels: usize| {
            let mut v = serde_json::json!(1);
            for _ in 0..levels {
                v = serde_json::Value::Array(vec![v]);
            }
            v
        };
        for levels in MAX_JSON_DEPTH - 3..=MAX_JSON_DEPTH + 1 {
            let v = nested(levels);
            let bodies = [
                EventBody::ToolCall {
                    call_id: "c".into(),
                    tool_name: "T".into(),
                    input: v.clone(),
                },
                EventBody::ToolResult {
                    call_id: "c".into(),
                    tool_name: "T".into(),
                    status: crate::event::ToolStatus::Success,
                    output: Some(v.clone()),
                    added_tool_names: None,
                },
                EventBody::SessionStarted {
                    mode: "m".into(),
                    metadata: Some(serde_json::Map::from_iter([("k".to_owned(), v.clone())])),
                },
            ];
            for body in bodies {
                let parsed = parse_line(&body.to_json_text(), LineKind::Append, 1 << 20).is_ok();
                assert_eq!(
                    check_values(&body).is_ok(),
                    parsed,
                    "{levels} levels in a {}",
                    body.type_name()
                );
            }
        }
    }
    use crate::event::ToolStatus::*;
    use crate::testkit::*;

    fn rejects(log: &Log, body: EventBody) -> (Rule, Option<String>) {
        let e = check_event(&log.state(), &body).expect_err("should be rejected");
        (e.rule, e.field)
    }

    fn accepts(log: &Log, body: EventBody) {
        check_event(&log.state(), &body).expect("should be accepted");
    }

    fn base() -> Log {
        Log::new()
            .push(started("agent"))
            .push(prompt("one"))
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
            .push(prompt("two"))
            .push(call("c2", "Read"))
    }

    fn field(f: &str) -> Option<String> {
        Some(f.to_owned())
    }

    #[test]
    fn an_event_before_session_started_is_rejected() {
        assert_eq!(
            rejects(&Log::new(), prompt("x")),
            (Rule::NotStarted, field("type"))
        );
    }

    #[test]
    fn a_second_session_started_is_rejected() {
        assert_eq!(
            rejects(&base(), started("agent")),
            (Rule::AlreadyStarted, field("type"))
        );
    }

    #[test]
    fn a_reused_call_id_is_rejected() {
        assert_eq!(
            rejects(&base(), call("c1", "x")),
            (Rule::DuplicateCallId, field("call_id"))
        );
    }

    #[test]
    fn a_result_without_its_call_is_rejected() {
        let r = result("nope", "Read", Success, &[]);
        assert_eq!(
            rejects(&base(), r),
            (Rule::ResultWithoutCall, field("call_id"))
        );
    }

    #[test]
    fn a_second_result_for_a_call_is_rejected() {
        let r = result("c1", "ToolSearch", Error, &[]);
        assert_eq!(
            rejects(&base(), r),
            (Rule::DuplicateResult, field("call_id"))
        );
    }

    #[test]
    fn a_result_naming_another_tool_than_its_call_is_rejected() {
        let r = result("c2", "Write", Success, &[]);
        assert_eq!(
            rejects(&base(), r),
            (Rule::ResultToolMismatch, field("tool_name"))
        );
    }

    #[test]
    fn added_names_on_a_result_that_did_not_succeed_are_rejected() {
        for status in [Error, Interrupted, Placeholder] {
            let r = result("c2", "Read", status, &["web_fetch"]);
            assert_eq!(
                rejects(&base(), r),
                (Rule::AddedNamesWithoutSuccess, field("added_tool_names"))
            );
        }
        // An empty array is no names at all.
        let empty = EventBody::ToolResult {
            call_id: "c2".into(),
            tool_name: "Read".into(),
            status: Error,
            output: None,
            added_tool_names: Some(vec![]),
        };
        accepts(&base(), empty);
    }

    #[test]
    fn a_compaction_must_keep_from_an_effective_row() {
        // Unknown id, a non-row (session_started), a row summarized earlier.
        assert_eq!(
            rejects(&base(), compaction(Some(99))).0,
            Rule::CompactionKeepsNonEffectiveRow
        );
        assert_eq!(
            rejects(&base(), compaction(Some(1))),
            (
                Rule::CompactionKeepsNonEffectiveRow,
                field("first_kept_event_id")
            )
        );
        let compacted = base().push(compaction(Some(5)));
        assert_eq!(
            rejects(&compacted, compaction(Some(2))).0,
            Rule::CompactionKeepsNonEffectiveRow
        );
        accepts(&compacted, compaction(Some(5)));
        accepts(&compacted, compaction(None));
    }

    #[test]
    fn a_compaction_must_not_split_a_call_from_its_result() {
        // Naming a result always splits it from its call.
        assert_eq!(
            rejects(&base(), compaction(Some(4))),
            (Rule::CompactionSplitsCall, field("first_kept_event_id"))
        );
        // Keeping from a row between a call and its result splits them.
        let log = base()
            .push(prompt("three"))
            .push(result("c2", "Read", Success, &[]));
        assert_eq!(
            rejects(&log, compaction(Some(7))).0,
            Rule::CompactionSplitsCall
        );
        // Keeping the call with its result is fine.
        accepts(&log, compaction(Some(6)));
        accepts(&log, compaction(Some(3)));
    }

    #[test]
    fn tool_names_are_non_empty_short_and_free_of_control_characters() {
        let ok = "x".repeat(MAX_TOOL_NAME_BYTES);
        accepts(&base(), call("c9", &ok));
        let long = "x".repeat(MAX_TOOL_NAME_BYTES + 1);
        for bad in ["", long.as_str(), "a\u{0}b", "a\nb", "a\u{1f}b", "a\u{7f}b"] {
            assert_eq!(
                rejects(&base(), call("c9", bad)),
                (Rule::BadToolName, field("tool_name"))
            );
            assert_eq!(
                rejects(&base(), catalog("agent", &["ok", bad])),
                (Rule::BadToolName, field("deferred_tools"))
            );
            assert_eq!(
                rejects(&base(), result("c2", "Read", Success, &[bad])),
                (Rule::BadToolName, field("added_tool_names"))
            );
        }
        // Multi-byte names count bytes: 128 two-byte characters is 256 bytes.
        accepts(&base(), call("c9", &"é".repeat(128)));
        assert_eq!(
            rejects(&base(), call("c9", &"é".repeat(129))).0,
            Rule::BadToolName
        );
    }

    #[test]
    fn call_ids_are_at_most_2048_bytes_where_a_call_introduces_them() {
        accepts(&base(), call(&"é".repeat(MAX_CALL_ID_BYTES / 2), "Read"));
        assert_eq!(
            rejects(&base(), call(&"x".repeat(MAX_CALL_ID_BYTES + 1), "Read")),
            (Rule::MistypedField, field("call_id"))
        );
        // A result names a call: one longer than any call the store took
        // since is a result without a call, as any unknown id.
        assert_eq!(
            rejects(
                &base(),
                result(&"x".repeat(MAX_CALL_ID_BYTES + 1), "Read", Success, &[])
            )
            .0,
            Rule::ResultWithoutCall
        );
    }

    #[test]
    fn the_starting_mode_and_call_ids_are_non_empty() {
        // §3 asks for a non-empty mode at session_started only.
        check_shape(&switch("")).unwrap();
        check_shape(&catalog("", &[])).unwrap();
        assert_eq!(
            rejects(&base(), call("", "Read")),
            (Rule::EmptyField, field("call_id"))
        );
        assert_eq!(
            rejects(&Log::new(), started("")),
            (Rule::EmptyField, field("mode"))
        );
    }
}
