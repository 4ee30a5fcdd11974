//! The projector against a deliberately simple second implementation: a
//! straight transcription of SEMANTICS §5–§7 that recomputes everything from
//! the events with seq <= N by seq comparisons, with no incremental state.
//! For random valid logs, both must agree at every seq. The audit fold
//! (`explain`) is held to the same transcription, and each reason it gives
//! is checked against what the log says.

mod common;

use std::collections::BTreeMap;

use common::gen::valid_log;
use common::gen::TOOLS;
use proptest::prelude::*;
use session_store::audit::{Auditor, Reason};
use session_store::{EventBody, SessionState, StoredEvent, ToolStatus};
use uuid::Uuid;

#[derive(Debug, PartialEq)]
struct Answer {
    mode: String,
    summary: Option<String>,
    row_seqs: Vec<i64>,
    tools: Vec<(String, i64)>,
}

fn oracle(log: &[StoredEvent], n: i64) -> Answer {
    let events: Vec<&StoredEvent> = log.iter().filter(|e| e.seq <= n).collect();
    // §5: the latest compaction C with seq <= N.
    let c = events
        .iter()
        .rfind(|e| matches!(e.body, EventBody::Compaction { .. }));
    let (lower, summary) = match c {
        None => (1, None),
        Some(c) => match &c.body {
            EventBody::Compaction {
                summary,
                first_kept_event_id: Some(id),
                ..
            } => (
                events.iter().find(|e| e.event_id == *id).unwrap().seq,
                Some(summary.clone()),
            ),
            EventBody::Compaction { summary, .. } => (c.seq + 1, Some(summary.clone())),
            _ => unreachable!(),
        },
    };
    let rows: Vec<&&StoredEvent> = events
        .iter()
        .filter(|e| {
            matches!(
                e.body,
                EventBody::PromptSubmitted { .. }
                    | EventBody::AssistantMessage { .. }
                    | EventBody::ToolCall { .. }
                    | EventBody::ToolResult { .. }
            ) && e.seq >= lower
        })
        .collect();
    // §6: mode of the latest mode_switched, else of session_started.
    let mut mode = String::new();
    for e in &events {
        match &e.body {
            EventBody::SessionStarted { mode: m, .. } | EventBody::ModeSwitched { mode: m } => {
                mode = m.clone()
            }
            _ => {}
        }
    }
    let mut catalog: Vec<String> = Vec::new();
    for e in &events {
        if let EventBody::CatalogDefined {
            mode: m,
            deferred_tools,
        } = &e.body
        {
            if *m == mode {
                catalog = deferred_tools.clone();
            }
        }
    }
    // §7: evidence of effective successful results, intersected with the catalog.
    let mut evidence: BTreeMap<String, i64> = BTreeMap::new();
    for r in &rows {
        if let EventBody::ToolResult {
            tool_name,
            status: ToolStatus::Success,
            added_tool_names,
            ..
        } = &r.body
        {
            let mut names = vec![tool_name.clone()];
            names.extend(added_tool_names.clone().unwrap_or_default());
            for name in names {
                let seq = evidence.entry(name).or_insert(0);
                *seq = (*seq).max(r.seq);
            }
        }
    }
    let tools = evidence
        .into_iter()
        .filter(|(name, _)| catalog.contains(name))
        .collect();
    Answer {
        mode,
        summary,
        row_seqs: rows.iter().map(|r| r.seq).collect(),
        tools,
    }
}

fn projector(log: &[StoredEvent], n: i64) -> Answer {
    let state = SessionState::fold(log[0].session_id, log.iter().filter(|e| e.seq <= n));
    let ctx = state.context();
    let act = state.activations();
    assert_eq!((ctx.as_of_seq, act.as_of_seq), (n, n));
    Answer {
        mode: ctx.mode,
        summary: ctx.summary,
        row_seqs: ctx.rows.iter().map(|r| r.seq).collect(),
        tools: act
            .tools
            .into_iter()
            .map(|t| (t.name, t.evidence_seq))
            .collect(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn projector_equals_the_transcription_at_every_seq(seed in any::<u64>(), len in 1usize..90) {
        let log = valid_log(seed, Uuid::new_v4(), len);
        for n in 1..=log.len() as i64 {
            prop_assert_eq!(projector(&log, n), oracle(&log, n), "at seq {}", n);
        }
    }
}

/// Names with a successful result naming them among the events <= n, and
/// among the effective rows.
fn successes(log: &[StoredEvent], n: i64, effective: &[i64]) -> (Vec<String>, Vec<String>) {
    let mut ever = Vec::new();
    let mut eff = Vec::new();
    for e in log.iter().filter(|e| e.seq <= n) {
        if let EventBody::ToolResult {
            tool_name,
            status: ToolStatus::Success,
            added_tool_names,
            ..
        } = &e.body
        {
            let mut names = vec![tool_name.clone()];
            names.extend(added_tool_names.clone().unwrap_or_default());
            if effective.contains(&e.seq) {
                eff.extend(names.iter().cloned());
            }
            ever.extend(names);
        }
    }
    (ever, eff)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn explain_agrees_with_the_transcription_at_every_seq(seed in any::<u64>(), len in 1usize..90) {
        let log = valid_log(seed, Uuid::new_v4(), len);
        let mut auditor = Auditor::new(log[0].session_id);
        for e in &log {
            auditor.apply(e);
            let want = oracle(&log, e.seq);
            let got: Vec<(String, i64)> = auditor
                .activation_set()
                .into_iter()
                .map(|a| (a.name, a.evidence_seq))
                .collect();
            prop_assert_eq!(&got, &want.tools, "at seq {}", e.seq);
            let (ever, effective) = successes(&log, e.seq, &want.row_seqs);
            for tool in TOOLS {
                let x = auditor.explain(tool);
                let active = want.tools.iter().find(|(n, _)| n == tool);
                prop_assert_eq!(x.active, active.is_some(), "{} at seq {}", tool, e.seq);
                match (&x.reason, active) {
                    (None, Some((_, seq))) => {
                        prop_assert_eq!(x.evidence.as_ref().map(|r| r.seq), Some(*seq));
                    }
                    (Some(Reason::NeverEvidenced | Reason::OnlyUnsuccessful { .. }), None) => {
                        prop_assert!(!ever.iter().any(|n| n == tool));
                    }
                    (Some(Reason::Compacted { compaction_seq, .. }), None) => {
                        prop_assert!(ever.iter().any(|n| n == tool));
                        prop_assert!(!effective.iter().any(|n| n == tool));
                        prop_assert!(*compaction_seq <= e.seq);
                    }
                    (
                        Some(Reason::NotInModeCatalog { mode, .. })
                        | Some(Reason::DroppedByCatalogRebuild { mode, .. }),
                        None,
                    ) => {
                        prop_assert!(effective.iter().any(|n| n == tool));
                        prop_assert_eq!(mode, &want.mode);
                    }
                    (reason, active) => {
                        prop_assert!(false, "{} at seq {}: {:?} / {:?}", tool, e.seq, reason, active);
                    }
                }
            }
        }
    }
}
