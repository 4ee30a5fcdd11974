//! Builders for unit tests: sessions as plain vectors of events.

use serde_json::json;
use uuid::Uuid;

use crate::event::{EventBody, StoredEvent, ToolStatus};
use crate::projector::SessionState;

/// A log under construction: events get seq 1, 2, … and ids derived from
/// their seq, so a test can name any event's id with [`Log::id`].
pub(crate) struct Log {
    pub(crate) events: Vec<StoredEvent>,
}

impl Log {
    pub(crate) fn new() -> Log {
        Log { events: Vec::new() }
    }

    pub(crate) fn id(seq: i64) -> Uuid {
        Uuid::from_u128(seq as u128)
    }

    pub(crate) fn push(mut self, body: EventBody) -> Log {
        let seq = self.events.len() as i64 + 1;
        self.events.push(StoredEvent {
            session_id: Uuid::nil(),
            seq,
            event_id: Log::id(seq),
            position: seq,
            recorded_at: chrono::Utc::now(),
            body,
        });
        self
    }

    pub(crate) fn state(&self) -> SessionState {
        SessionState::fold(Uuid::nil(), &self.events)
    }

    pub(crate) fn tools(&self) -> Vec<(String, i64)> {
        self.state()
            .activation_set()
            .into_iter()
            .map(|a| (a.name, a.evidence_seq))
            .collect()
    }
}

pub(crate) fn started(mode: &str) -> EventBody {
    EventBody::SessionStarted {
        mode: mode.into(),
        metadata: None,
    }
}

pub(crate) fn catalog(mode: &str, tools: &[&str]) -> EventBody {
    EventBody::CatalogDefined {
        mode: mode.into(),
        deferred_tools: tools.iter().map(|t| t.to_string()).collect(),
    }
}

pub(crate) fn prompt(text: &str) -> EventBody {
    EventBody::PromptSubmitted { text: text.into() }
}

pub(crate) fn call(id: &str, tool: &str) -> EventBody {
    EventBody::ToolCall {
        call_id: id.into(),
        tool_name: tool.into(),
        input: json!({"query": "select:web_fetch"}),
    }
}

pub(crate) fn result(id: &str, tool: &str, status: ToolStatus, added: &[&str]) -> EventBody {
    EventBody::ToolResult {
        call_id: id.into(),
        tool_name: tool.into(),
        status,
        output: Some(json!({"matches": ["image_view"]})),
        added_tool_names: (!added.is_empty())
            .then(|| added.iter().map(|t| t.to_string()).collect()),
    }
}

pub(crate) fn compaction(first_kept_seq: Option<i64>) -> EventBody {
    EventBody::Compaction {
        summary: "summary".into(),
        first_kept_event_id: first_kept_seq.map(Log::id),
        tokens_before: None,
    }
}

pub(crate) fn switch(mode: &str) -> EventBody {
    EventBody::ModeSwitched { mode: mode.into() }
}
