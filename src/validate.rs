//! The rules of SEMANTICS §3–§4, pure: an event is judged against the
//! session as it stands ([`SessionState`]) before it is applied.

use crate::error::{Rule, ValidationError};
use crate::event::EventBody;
use crate::projector::SessionState;

/// The longest tool name, in bytes of UTF-8 (§3).
pub const MAX_TOOL_NAME_BYTES: usize = 256;

/// The default limit on one event's JSON text (§4).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1024 * 1024;

fn check_tool_name(name: &str, field: &str) -> Result<(), ValidationError> {
    let problem = if name.is_empty() {
        Some("is empty".to_owned())
    } else if name.len() > MAX_TOOL_NAME_BYTES {
        Some(format!(
            "is {} bytes long, over the limit of {MAX_TOOL_NAME_BYTES}",
            name.len()
        ))
    } else if name.chars().any(|c| c <= '\u{1f}' || c == '\u{7f}') {
        Some("holds a control character".to_owned())
    } else {
        None
    };
    match problem {
        Some(p) => Err(ValidationError::new(
            Rule::BadToolName,
            Some(field),
            format!("tool name {name:?} in `{field}` {p}"),
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

/// The shape rules that need no session: non-empty modes and call ids, and
/// well-formed tool names.
pub fn check_shape(body: &EventBody) -> Result<(), ValidationError> {
    match body {
        EventBody::SessionStarted { mode, .. } | EventBody::ModeSwitched { mode } => {
            check_non_empty(mode, "mode")
        }
        EventBody::CatalogDefined {
            mode,
            deferred_tools,
        } => {
            check_non_empty(mode, "mode")?;
            deferred_tools
                .iter()
                .try_for_each(|n| check_tool_name(n, "deferred_tools"))
        }
        EventBody::ToolCall {
            call_id, tool_name, ..
        } => {
            check_non_empty(call_id, "call_id")?;
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
                        serde_json::to_value(status).unwrap_or_default()
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
                format!("`call_id` {call_id:?} is already used in this session"),
            ))
        }
        EventBody::ToolResult {
            call_id, tool_name, ..
        } => match state.calls.get(call_id) {
            None => Err(ValidationError::new(
                Rule::ResultWithoutCall,
                Some("call_id"),
                format!(
                    "`tool_result` for `call_id` {call_id:?}, which has no earlier `tool_call`"
                ),
            )),
            Some(call) if call.result_seq.is_some() => Err(ValidationError::new(
                Rule::DuplicateResult,
                Some("call_id"),
                format!("the call {call_id:?} already has a result"),
            )),
            Some(call) if &call.tool_name != tool_name => Err(ValidationError::new(
                Rule::ResultToolMismatch,
                Some("tool_name"),
                format!(
                    "`tool_name` {tool_name:?} differs from the call's {:?}",
                    call.tool_name
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
            let first_seq = state.rows[start].seq;
            for row in &state.rows[start..] {
                if let EventBody::ToolResult { call_id, .. } = &row.body {
                    let call_seq = state.calls.get(call_id).map(|c| c.seq).unwrap_or(0);
                    if call_seq < first_seq {
                        return Err(ValidationError::new(
                            Rule::CompactionSplitsCall,
                            Some("first_kept_event_id"),
                            format!(
                                "the compaction would keep the result at seq {} but summarize its call {call_id:?} at seq {call_seq}",
                                row.seq
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
