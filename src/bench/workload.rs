//! The realistic event mix every phase of the bench writes: the shape of a
//! coding agent's session, turn after turn.
//!
//! A turn is a prompt, sometimes a `ToolSearch` call whose successful result
//! adds a deferred tool (its output carries the tool's schema, 0.6–0.7 KB),
//! zero to three tool calls answered by results with outputs of 1–6 KB (one
//! in ten fails), and an assistant message. Every 25 turns the session is
//! compacted, every 40 it switches to `plan` for a turn and back, every 100
//! the `agent` catalog is rebuilt. The average event is about 1 KB of JSON,
//! three times the rows of `docs/measured-ceilings.md`, because tool
//! outputs dominate real transcripts.
//!
//! Texts come from a small pool built once from a seeded generator, so
//! making an event costs a clone, not a string build, and the append loops
//! measure the store rather than the generator. The words are drawn at
//! random from a small vocabulary, so PostgreSQL's compression of large
//! values does not get the free ride a repeated character would; it still
//! gets more than real text gives it (zlib level 1 packs a 3.5 KB output
//! 3.2 times, real source code about 2 times), for the store and the
//! ceiling alike.

use std::collections::BTreeMap;

use serde_json::json;
use uuid::Uuid;

use crate::event::{EventBody, NewEvent, ToolStatus};

/// A small seeded generator (xorshift64*): deterministic mixes, no crate.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// A number in `lo..=hi`.
    pub fn between(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
}

/// The deferred tools of the `agent` mode.
pub const DEFERRED: [&str; 8] = [
    "web_fetch",
    "notebook_edit",
    "image_view",
    "mcp__github__create_issue",
    "mcp__github__list_pull_requests",
    "mcp__slack__post_message",
    "mcp__jira__search",
    "browser_navigate",
];

/// Core tools: always sent, never in a catalog.
pub const CORE: [&str; 5] = ["Read", "Bash", "Grep", "Edit", "Write"];

const WORDS: [&str; 48] = [
    "the",
    "session",
    "store",
    "returns",
    "error",
    "when",
    "file",
    "config",
    "test",
    "build",
    "function",
    "value",
    "cargo",
    "module",
    "request",
    "response",
    "handler",
    "missing",
    "line",
    "path",
    "src",
    "main",
    "should",
    "could",
    "after",
    "before",
    "parse",
    "json",
    "field",
    "index",
    "query",
    "table",
    "commit",
    "branch",
    "result",
    "output",
    "input",
    "timeout",
    "retry",
    "schema",
    "tool",
    "model",
    "context",
    "compaction",
    "view",
    "writer",
    "reader",
    "latency",
];

/// Pre-built texts of each size class, shared by every generator.
#[derive(Clone, Debug)]
pub struct TextPool {
    prompts: Vec<String>,
    replies: Vec<String>,
    outputs: Vec<String>,
    summaries: Vec<String>,
    commands: Vec<String>,
}

fn words(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        if !s.is_empty() {
            s.push(if rng.below(12) == 0 { '\n' } else { ' ' });
        }
        s.push_str(WORDS[rng.below(WORDS.len())]);
    }
    s
}

impl TextPool {
    /// 32 texts of each class, from a fixed seed.
    pub fn new() -> TextPool {
        let mut rng = Rng::new(7);
        let mut class = |n: usize, lo: usize, hi: usize| -> Vec<String> {
            (0..n)
                .map(|_| {
                    let len = rng.between(lo, hi);
                    words(&mut rng, len)
                })
                .collect()
        };
        TextPool {
            prompts: class(32, 80, 600),
            replies: class(32, 200, 1_500),
            outputs: class(32, 1_000, 6_000),
            summaries: class(8, 1_000, 2_000),
            commands: class(32, 40, 200),
        }
    }
}

impl Default for TextPool {
    fn default() -> Self {
        TextPool::new()
    }
}

/// Turns between two compactions of the mix: the effective window is
/// fullest just before one.
pub const COMPACT_EVERY: u64 = 25;

/// One writer's endless stream of valid events of the mix.
///
/// Call ids carry the writer's number, so several writers can share one
/// session: each writer's results answer its own earlier calls, its
/// compactions keep no earlier row (`first_kept_event_id` absent), and so
/// whatever the others appended in between, every event stays valid.
#[derive(Clone, Debug)]
pub struct Mix {
    rng: Rng,
    pool: std::sync::Arc<TextPool>,
    writer: usize,
    pending: std::collections::VecDeque<EventBody>,
    turns: u64,
    calls: u64,
    /// Whether the stream compacts, switches modes and rebuilds catalogs on
    /// its own (off while writing the fixed tail of a session).
    pub housekeeping: bool,
}

impl Mix {
    /// A stream for `writer`, seeded by `seed`.
    pub fn new(pool: std::sync::Arc<TextPool>, writer: usize, seed: u64) -> Mix {
        Mix {
            rng: Rng::new(seed ^ (writer as u64).wrapping_mul(0x1000_0001)),
            pool,
            writer,
            pending: Default::default(),
            turns: 0,
            calls: 0,
            housekeeping: true,
        }
    }

    /// The first events of a session: `session_started` and the catalogs.
    pub fn header() -> Vec<EventBody> {
        vec![
            EventBody::SessionStarted {
                mode: "agent".into(),
                metadata: Some(
                    json!({"runtime": "session-store bench", "model": "a-model"})
                        .as_object()
                        .cloned()
                        .unwrap_or_default(),
                ),
            },
            EventBody::CatalogDefined {
                mode: "agent".into(),
                deferred_tools: DEFERRED.iter().map(|s| s.to_string()).collect(),
            },
            EventBody::CatalogDefined {
                mode: "plan".into(),
                deferred_tools: DEFERRED[..3].iter().map(|s| s.to_string()).collect(),
            },
        ]
    }

    /// The next event.
    pub fn next_body(&mut self) -> EventBody {
        if self.pending.is_empty() {
            self.turn();
        }
        self.pending.pop_front().unwrap_or_else(|| {
            // `turn` always queues a prompt; this is never reached.
            EventBody::PromptSubmitted {
                text: "next".into(),
            }
        })
    }

    /// The next `n` events, each with a fresh time-ordered id (a sidecar
    /// gives ids so that a retry after a lost reply is idempotent).
    pub fn next_batch(&mut self, n: usize) -> Vec<NewEvent> {
        (0..n)
            .map(|_| NewEvent::new(self.next_body()).with_id(Uuid::now_v7()))
            .collect()
    }

    /// The events still queued from the current turn (so a caller can end a
    /// session on a turn boundary).
    pub fn drain_turn(&mut self) -> Vec<EventBody> {
        self.pending.drain(..).collect()
    }

    /// A compaction that keeps no earlier row.
    pub fn compaction(&mut self) -> EventBody {
        let i = self.rng.below(self.pool.summaries.len());
        EventBody::Compaction {
            summary: self.pool.summaries[i].clone(),
            first_kept_event_id: None,
            tokens_before: Some(self.rng.between(80_000, 180_000) as i64),
        }
    }

    fn pick<'a>(&mut self, v: &'a [String]) -> &'a String {
        &v[self.rng.below(v.len())]
    }

    fn call_id(&mut self) -> String {
        self.calls += 1;
        format!("w{}-c{}", self.writer, self.calls)
    }

    /// Queues one turn.
    fn turn(&mut self) {
        self.turns += 1;
        let pool = self.pool.clone();
        if self.housekeeping {
            if self.turns.is_multiple_of(COMPACT_EVERY) {
                let c = self.compaction();
                self.pending.push_back(c);
            }
            if self.turns.is_multiple_of(100) {
                let drop = self.rng.below(DEFERRED.len());
                let tools = DEFERRED
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != drop)
                    .map(|(_, s)| s.to_string())
                    .collect();
                self.pending.push_back(EventBody::CatalogDefined {
                    mode: "agent".into(),
                    deferred_tools: tools,
                });
            }
            if self.turns.is_multiple_of(40) {
                self.pending.push_back(EventBody::ModeSwitched {
                    mode: "plan".into(),
                });
            } else if self.turns % 40 == 1 && self.turns > 1 {
                self.pending.push_back(EventBody::ModeSwitched {
                    mode: "agent".into(),
                });
            }
        }
        let text = self.pick(&pool.prompts).clone();
        self.pending.push_back(EventBody::PromptSubmitted { text });
        if self.rng.below(10) < 3 {
            let tool = DEFERRED[self.rng.below(DEFERRED.len())];
            let id = self.call_id();
            self.pending.push_back(EventBody::ToolCall {
                call_id: id.clone(),
                tool_name: "ToolSearch".into(),
                input: json!({"query": format!("select:{tool}"), "max_results": 5}),
            });
            let description = self.pick(&pool.commands).clone();
            self.pending.push_back(EventBody::ToolResult {
                call_id: id,
                tool_name: "ToolSearch".into(),
                status: ToolStatus::Success,
                output: Some(json!({"tools": [{
                    "name": tool,
                    "description": description,
                    "input_schema": {"type": "object", "properties": {
                        "url": {"type": "string", "description": "The address to act on; absolute, with its scheme."},
                        "prompt": {"type": "string", "description": "What to do with the content, in a sentence or two."},
                        "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 600000}
                    }, "required": ["url", "prompt"]}
                }]})),
                added_tool_names: Some(vec![tool.to_owned()]),
            });
        }
        let k = match self.rng.below(20) {
            0..=2 => 0,
            3..=9 => 1,
            10..=15 => 2,
            _ => 3,
        };
        let mut calls = Vec::new();
        for _ in 0..k {
            let tool = if self.rng.below(4) == 0 {
                DEFERRED[self.rng.below(3)]
            } else {
                CORE[self.rng.below(CORE.len())]
            };
            let id = self.call_id();
            let command = self.pick(&pool.commands).clone();
            self.pending.push_back(EventBody::ToolCall {
                call_id: id.clone(),
                tool_name: tool.into(),
                input: json!({"command": command, "path": format!("src/module_{}.rs", self.calls % 97)}),
            });
            calls.push((id, tool));
        }
        for (id, tool) in calls {
            let status = match self.rng.below(50) {
                0..=3 => ToolStatus::Error,
                4 => ToolStatus::Interrupted,
                _ => ToolStatus::Success,
            };
            let output = self.pick(&pool.outputs).clone();
            self.pending.push_back(EventBody::ToolResult {
                call_id: id,
                tool_name: tool.into(),
                status,
                output: Some(json!(output)),
                added_tool_names: None,
            });
        }
        let text = self.pick(&pool.replies).clone();
        self.pending.push_back(EventBody::AssistantMessage { text });
    }
}

/// What the mix is made of: events by type and average JSON size, measured
/// on the first `n` events of a writer's stream.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct MixSummary {
    /// Events sampled.
    pub events: usize,
    /// Average JSON text of an event, bytes.
    pub average_event_bytes: f64,
    /// Share of each type, 0–1.
    pub share_by_type: BTreeMap<String, f64>,
    /// Average JSON bytes of each type.
    pub bytes_by_type: BTreeMap<String, f64>,
}

impl MixSummary {
    /// Samples `n` events of writer 0's stream.
    pub fn sample(pool: std::sync::Arc<TextPool>, n: usize) -> MixSummary {
        let mut mix = Mix::new(pool, 0, 1);
        let mut count: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        let mut total = 0usize;
        for _ in 0..n {
            let body = mix.next_body();
            let bytes = body.to_json_text().len();
            total += bytes;
            let c = count.entry(body.type_name().to_owned()).or_default();
            c.0 += 1;
            c.1 += bytes;
        }
        MixSummary {
            events: n,
            average_event_bytes: total as f64 / n.max(1) as f64,
            share_by_type: count
                .iter()
                .map(|(k, (c, _))| (k.clone(), *c as f64 / n.max(1) as f64))
                .collect(),
            bytes_by_type: count
                .iter()
                .map(|(k, (c, b))| (k.clone(), *b as f64 / (*c).max(1) as f64))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::StoredEvent;
    use crate::projector::SessionState;
    use crate::validate::check_event;

    fn fold_checked(bodies: impl IntoIterator<Item = EventBody>) -> SessionState {
        let session = Uuid::nil();
        let mut state = SessionState::empty(session);
        for (i, body) in bodies.into_iter().enumerate() {
            check_event(&state, &body).unwrap_or_else(|e| panic!("event {i} invalid: {e}"));
            state.apply(&StoredEvent {
                session_id: session,
                seq: i as i64 + 1,
                event_id: Uuid::now_v7(),
                position: i as i64 + 1,
                recorded_at: chrono::Utc::now(),
                body,
            });
        }
        state
    }

    #[test]
    fn one_writers_stream_is_valid() {
        let mut mix = Mix::new(Arc::new(TextPool::new()), 0, 3);
        let state = fold_checked(
            Mix::header()
                .into_iter()
                .chain((0..5_000).map(|_| mix.next_body())),
        );
        assert!(state.compaction.is_some(), "the mix compacts");
    }

    #[test]
    fn interleaved_writers_on_one_session_stay_valid() {
        let pool = Arc::new(TextPool::new());
        let mut writers: Vec<Mix> = (0..4).map(|w| Mix::new(pool.clone(), w, 9)).collect();
        let mut rng = Rng::new(5);
        let stream = (0..4_000).map(|_| {
            let w = rng.below(4);
            writers[w].next_body()
        });
        fold_checked(Mix::header().into_iter().chain(stream.collect::<Vec<_>>()));
    }

    #[test]
    fn an_average_event_is_about_a_kilobyte() {
        let s = MixSummary::sample(Arc::new(TextPool::new()), 5_000);
        assert!(
            (500.0..3_000.0).contains(&s.average_event_bytes),
            "{}",
            s.average_event_bytes
        );
    }

    use std::sync::Arc;
}
