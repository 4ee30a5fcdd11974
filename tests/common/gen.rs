//! Random valid session logs, for property tests, the crash test and the
//! benchmarks: a seeded random walk that proposes events from small pools
//! and keeps those the validator accepts, so every rule shapes the log.

#![allow(dead_code)]

use serde_json::json;
use session_store::validate::check_event;
use session_store::{EventBody, SessionState, StoredEvent, ToolStatus};
use uuid::Uuid;

/// A small, fast, seeded generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

pub const MODES: [&str; 3] = ["agent", "chat", "plan"];
pub const TOOLS: [&str; 6] = [
    "web_fetch",
    "notebook_edit",
    "image_view",
    "mcp__x",
    "ToolSearch",
    "Read",
];

/// One candidate event for the session in `state`.
fn propose(
    rng: &mut Rng,
    state: &SessionState,
    open_calls: &[(String, String)],
    n: usize,
) -> EventBody {
    if !state.started {
        return EventBody::SessionStarted {
            mode: rng.pick(&MODES).to_string(),
            metadata: None,
        };
    }
    match rng.below(20) {
        0 | 1 => {
            let tools: Vec<String> = TOOLS
                .iter()
                .filter(|_| rng.below(2) == 0)
                .map(|t| t.to_string())
                .collect();
            EventBody::CatalogDefined {
                mode: rng.pick(&MODES).to_string(),
                deferred_tools: tools,
            }
        }
        2..=4 => EventBody::PromptSubmitted {
            text: format!("prompt {n}"),
        },
        5 | 6 => EventBody::AssistantMessage {
            text: format!("reply {n} web_fetch"),
        },
        7..=9 => EventBody::ToolCall {
            call_id: format!("c{n}"),
            tool_name: rng.pick(&TOOLS).to_string(),
            input: json!({"q": rng.pick(&TOOLS)}),
        },
        10..=13 if !open_calls.is_empty() => {
            let (call_id, tool_name) = rng.pick(open_calls).clone();
            let status = *rng.pick(&[
                ToolStatus::Success,
                ToolStatus::Success,
                ToolStatus::Error,
                ToolStatus::Interrupted,
                ToolStatus::Placeholder,
            ]);
            let added = if status == ToolStatus::Success && rng.below(2) == 0 {
                Some(
                    TOOLS
                        .iter()
                        .filter(|_| rng.below(3) == 0)
                        .map(|t| t.to_string())
                        .collect(),
                )
            } else {
                None
            };
            EventBody::ToolResult {
                call_id,
                tool_name,
                status,
                output: Some(json!({"matches": ["image_view"]})),
                added_tool_names: added,
            }
        }
        14 | 15 => {
            let first_kept = if state.rows.is_empty() || rng.below(4) == 0 {
                None
            } else {
                Some(rng.pick(&state.rows).event_id)
            };
            EventBody::Compaction {
                summary: format!("summary {n}"),
                first_kept_event_id: first_kept,
                tokens_before: Some(1000),
            }
        }
        16 | 17 => EventBody::ModeSwitched {
            mode: rng.pick(&MODES).to_string(),
        },
        _ => EventBody::PromptSubmitted {
            text: format!("prompt {n}"),
        },
    }
}

/// A valid log of `len` events for `session`, from `seed`.
pub fn valid_log(seed: u64, session: Uuid, len: usize) -> Vec<StoredEvent> {
    let mut rng = Rng::new(seed);
    let mut state = SessionState::empty(session);
    let mut events: Vec<StoredEvent> = Vec::with_capacity(len);
    let mut open_calls: Vec<(String, String)> = Vec::new();
    let mut attempts = 0;
    while events.len() < len && attempts < len * 20 {
        attempts += 1;
        let body = propose(&mut rng, &state, &open_calls, attempts);
        if check_event(&state, &body).is_err() {
            continue;
        }
        match &body {
            EventBody::ToolCall {
                call_id, tool_name, ..
            } => open_calls.push((call_id.clone(), tool_name.clone())),
            EventBody::ToolResult { call_id, .. } => open_calls.retain(|(c, _)| c != call_id),
            _ => {}
        }
        let event = StoredEvent {
            session_id: session,
            seq: events.len() as i64 + 1,
            event_id: Uuid::from_u64_pair(seed, attempts as u64),
            position: 0,
            recorded_at: chrono::Utc::now(),
            body,
        };
        state.apply(&event);
        events.push(event);
    }
    events
}

/// The log as `import` lines (with session_id and event_id).
pub fn import_lines(events: &[StoredEvent]) -> String {
    let mut out = String::new();
    for e in events {
        let mut v = serde_json::to_value(&e.body).unwrap();
        v["session_id"] = json!(e.session_id.to_string());
        v["event_id"] = json!(e.event_id.to_string());
        out.push_str(&serde_json::to_string(&v).unwrap());
        out.push('\n');
    }
    out
}
