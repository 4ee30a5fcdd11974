//! Explaining activations from the log alone: why a deferred tool is (or is
//! not) in the activation set at a seq, and how the set changed at every
//! refresh point.
//!
//! [`Auditor`] is a second fold of the same events as
//! [`crate::projector::SessionState`], but it keeps what the projector
//! forgets on purpose: failed results, the compaction that removed each
//! name's evidence, and every catalog a mode ever had. It keeps no payloads
//! (a row is its seq and id; an evidence row its names), so a session of a
//! million events is explained in one streaming pass with memory bounded by
//! the effective window's ids and the number of distinct tool names. A
//! property test checks that its activation set equals the projector's at
//! every seq, so the two folds cannot drift apart.
//!
//! The reason for an absent name is the *first* that applies, in the order
//! the audit issue lists them (see `docs/audit.md`):
//! `never_evidenced`, `only_unsuccessful`, `compacted`,
//! `dropped_by_catalog_rebuild` / `not_in_mode_catalog`. The last two are
//! exclusive: a rebuild is named when an earlier catalog of the current mode
//! admitted the name, else the mode's catalog never did.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use serde::Serialize;
use uuid::Uuid;

use crate::event::{EventBody, StoredEvent, ToolStatus};
use crate::projector::Activation;

/// Which point of a session an audit answer is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// After the latest event.
    Latest,
    /// After the event with this seq.
    Seq(i64),
    /// After the K-th `prompt_submitted` (1-based): the state the request
    /// of that prompt was built from.
    Prompt(i64),
}

/// At most this many unsuccessful results are listed per name; the total is
/// always counted.
pub const MAX_LISTED_RESULTS: usize = 20;

/// The answer of `explain`: whether `tool` is in the activation set as of
/// `as_of_seq`, and why.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Explanation {
    /// The session.
    pub session_id: Uuid,
    /// The deferred tool asked about.
    pub tool: String,
    /// The seq this answer is as of.
    pub as_of_seq: i64,
    /// How many `prompt_submitted` events there are up to `as_of_seq`: the
    /// answer is about the request of this prompt.
    pub as_of_prompt: i64,
    /// The current mode there.
    pub mode: String,
    /// Whether the tool is in the activation set.
    pub active: bool,
    /// When active: the effective row whose evidence admits it (the one
    /// with the largest seq, the activation's `evidence_seq`).
    pub evidence: Option<EvidenceRow>,
    /// The `catalog_defined` event that set the current mode's catalog;
    /// `null` when the mode has none.
    pub catalog: Option<CatalogRef>,
    /// When not active: the first reason that applies.
    pub reason: Option<Reason>,
    /// The answer as one sentence.
    pub why: String,
}

/// A `tool_result` that gives (or would have given) evidence for a name.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct EvidenceRow {
    /// The result's seq.
    pub seq: i64,
    /// The result's event id.
    pub event_id: Uuid,
    /// The call it answers.
    pub call_id: String,
    /// The tool whose result it is.
    pub result_tool: String,
    /// `own_result` when the result is the tool's own, `search` when the
    /// name came from `added_tool_names` of another tool's result.
    pub source: EvidenceSource,
    /// The result's status.
    pub status: ToolStatus,
}

/// How a result names a tool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EvidenceSource {
    /// The result of the tool itself.
    OwnResult,
    /// The name is in the result's `added_tool_names`.
    Search,
}

/// A `catalog_defined` event.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct CatalogRef {
    /// The mode it defines.
    pub mode: String,
    /// Its seq.
    pub seq: i64,
    /// Its event id.
    pub event_id: Uuid,
}

/// Why a name is not in the activation set.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum Reason {
    /// No result ever named it (successful or not).
    NeverEvidenced,
    /// Only failed, interrupted or placeholder results named it.
    OnlyUnsuccessful {
        /// The first [`MAX_LISTED_RESULTS`] of them, in seq order.
        results: Vec<EvidenceRow>,
        /// How many there are.
        total: usize,
    },
    /// It had successful evidence, and compaction removed the last of it.
    Compacted {
        /// The compaction's seq.
        compaction_seq: i64,
        /// The compaction's event id.
        compaction_event_id: Uuid,
        /// The latest evidence row it removed for this name.
        removed_evidence: EvidenceRow,
    },
    /// Its evidence is effective but the current mode's catalog never
    /// admitted it.
    NotInModeCatalog {
        /// The current mode.
        mode: String,
        /// The event that defined the mode's catalog; `null` when the mode
        /// has none.
        catalog: Option<CatalogRef>,
        /// Modes whose current catalog would admit it.
        admitted_in_modes: Vec<String>,
    },
    /// Its evidence is effective, an earlier catalog of the current mode
    /// admitted it, and a rebuilt catalog dropped it.
    DroppedByCatalogRebuild {
        /// The current mode.
        mode: String,
        /// The first `catalog_defined` of the mode without the name after
        /// the last one with it.
        rebuild: CatalogRef,
        /// The last catalog of the mode that admitted it.
        previous: CatalogRef,
    },
}

/// One refresh point of `refreshes`: the activation set after it and the
/// difference from the one after the previous refresh point.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Refresh {
    /// The refresh point's seq.
    pub seq: i64,
    /// Its event id.
    pub event_id: Uuid,
    /// `prompt_submitted` or `mode_switched`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The prompt's number (1 for the session's first) for a
    /// `prompt_submitted`, else the number of prompts before it.
    pub prompt: i64,
    /// The mode after it.
    pub mode: String,
    /// The activation set after it, sorted by name.
    pub tools: Vec<Activation>,
    /// Names in this set and not in the previous one.
    pub added: Vec<String>,
    /// Names in the previous set and not in this one, each with the reason
    /// `explain` gives at this seq.
    pub removed: Vec<Removed>,
}

/// A name that left the activation set at a refresh point.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Removed {
    /// The tool.
    pub name: String,
    /// Why it is no longer active.
    pub reason: Reason,
}

#[derive(Clone, Debug)]
struct EvRow {
    seq: i64,
    event_id: Uuid,
    call_id: String,
    result_tool: String,
    names: Vec<String>,
}

impl EvRow {
    fn row_for(&self, name: &str, status: ToolStatus) -> EvidenceRow {
        EvidenceRow {
            seq: self.seq,
            event_id: self.event_id,
            call_id: self.call_id.clone(),
            result_tool: self.result_tool.clone(),
            source: if self.result_tool == name {
                EvidenceSource::OwnResult
            } else {
                EvidenceSource::Search
            },
            status,
        }
    }
}

#[derive(Clone, Debug)]
struct CatalogDef {
    seq: i64,
    event_id: Uuid,
    tools: BTreeSet<String>,
}

/// The streaming fold behind `explain` and `refreshes`: feed it a session's
/// events in seq order with [`Auditor::apply`], ask at any point.
#[derive(Clone, Debug)]
pub struct Auditor {
    session_id: Uuid,
    seq: i64,
    prompts: i64,
    mode: String,
    /// Every definition of every mode's catalog, in seq order.
    catalogs: HashMap<String, Vec<CatalogDef>>,
    /// The effective transcript rows' seq and id (what compaction needs).
    rows: VecDeque<(i64, Uuid)>,
    /// The effective successful results, in seq order.
    evidence_rows: VecDeque<EvRow>,
    /// Name -> largest effective evidence seq.
    effective: BTreeMap<String, i64>,
    /// Names that ever had successful evidence.
    ever: BTreeSet<String>,
    /// Name -> (listed unsuccessful results, total).
    failed: HashMap<String, (Vec<EvidenceRow>, usize)>,
    /// Name -> the compaction that removed its latest evidence row.
    removed_by: HashMap<String, (i64, Uuid, EvidenceRow)>,
}

impl Auditor {
    /// The auditor of a session before its first event.
    pub fn new(session_id: Uuid) -> Auditor {
        Auditor {
            session_id,
            seq: 0,
            prompts: 0,
            mode: String::new(),
            catalogs: HashMap::new(),
            rows: VecDeque::new(),
            evidence_rows: VecDeque::new(),
            effective: BTreeMap::new(),
            ever: BTreeSet::new(),
            failed: HashMap::new(),
            removed_by: HashMap::new(),
        }
    }

    /// The last applied seq.
    pub fn seq(&self) -> i64 {
        self.seq
    }

    /// How many `prompt_submitted` events were applied.
    pub fn prompts(&self) -> i64 {
        self.prompts
    }

    /// Applies the next accepted event of the session (SEMANTICS §5–§7).
    pub fn apply(&mut self, event: &StoredEvent) {
        self.seq = event.seq;
        match &event.body {
            EventBody::SessionStarted { mode, .. } | EventBody::ModeSwitched { mode } => {
                self.mode = mode.clone();
            }
            EventBody::CatalogDefined {
                mode,
                deferred_tools,
            } => self
                .catalogs
                .entry(mode.clone())
                .or_default()
                .push(CatalogDef {
                    seq: event.seq,
                    event_id: event.event_id,
                    tools: deferred_tools.iter().cloned().collect(),
                }),
            EventBody::Compaction {
                first_kept_event_id,
                ..
            } => self.compact(event, *first_kept_event_id),
            EventBody::ToolResult {
                call_id,
                tool_name,
                status,
                added_tool_names,
                ..
            } => {
                self.rows.push_back((event.seq, event.event_id));
                // In order, each once; a set beside the list, since one
                // result may name a hundred thousand tools (a list's
                // `contains` made this quadratic: 15 s an `explain`).
                let mut names = vec![tool_name.clone()];
                let mut seen: HashSet<&str> = HashSet::from([tool_name.as_str()]);
                for n in added_tool_names.iter().flatten() {
                    if seen.insert(n.as_str()) {
                        names.push(n.clone());
                    }
                }
                let row = EvRow {
                    seq: event.seq,
                    event_id: event.event_id,
                    call_id: call_id.clone(),
                    result_tool: tool_name.clone(),
                    names,
                };
                if *status == ToolStatus::Success {
                    for n in &row.names {
                        self.effective.insert(n.clone(), row.seq);
                        self.ever.insert(n.clone());
                    }
                    self.evidence_rows.push_back(row);
                } else {
                    for n in &row.names {
                        let (listed, total) = self.failed.entry(n.clone()).or_default();
                        *total += 1;
                        if listed.len() < MAX_LISTED_RESULTS {
                            listed.push(row.row_for(n, *status));
                        }
                    }
                }
            }
            EventBody::PromptSubmitted { .. } => {
                self.prompts += 1;
                self.rows.push_back((event.seq, event.event_id));
            }
            EventBody::AssistantMessage { .. } | EventBody::ToolCall { .. } => {
                self.rows.push_back((event.seq, event.event_id))
            }
        }
    }

    /// §5: rows before the first kept one (all rows without one) leave the
    /// effective context; their evidence goes with them.
    fn compact(&mut self, event: &StoredEvent, first_kept: Option<Uuid>) {
        let window_start = first_kept
            .and_then(|id| self.rows.iter().find(|(_, rid)| *rid == id))
            .map(|(seq, _)| *seq)
            .unwrap_or(event.seq + 1);
        while self.rows.front().is_some_and(|(s, _)| *s < window_start) {
            self.rows.pop_front();
        }
        let mut removed_any = false;
        while self
            .evidence_rows
            .front()
            .is_some_and(|r| r.seq < window_start)
        {
            if let Some(row) = self.evidence_rows.pop_front() {
                for n in &row.names {
                    self.removed_by.insert(
                        n.clone(),
                        (
                            event.seq,
                            event.event_id,
                            row.row_for(n, ToolStatus::Success),
                        ),
                    );
                }
                removed_any = true;
            }
        }
        if removed_any {
            self.effective.clear();
            for row in &self.evidence_rows {
                for n in &row.names {
                    self.effective.insert(n.clone(), row.seq);
                }
            }
        }
    }

    fn current_catalog(&self) -> Option<&CatalogDef> {
        self.catalogs.get(&self.mode).and_then(|defs| defs.last())
    }

    fn catalog_ref(&self, mode: &str, def: &CatalogDef) -> CatalogRef {
        CatalogRef {
            mode: mode.to_owned(),
            seq: def.seq,
            event_id: def.event_id,
        }
    }

    /// The activation set (§7) after the last applied event.
    pub fn activation_set(&self) -> Vec<Activation> {
        let Some(catalog) = self.current_catalog() else {
            return Vec::new();
        };
        self.effective
            .iter()
            .filter(|(name, _)| catalog.tools.contains(*name))
            .map(|(name, seq)| Activation {
                name: name.clone(),
                evidence_seq: *seq,
            })
            .collect()
    }

    /// Why `tool` is not active now; `None` when it is.
    pub fn reason(&self, tool: &str) -> Option<Reason> {
        if !self.ever.contains(tool) {
            return Some(match self.failed.get(tool) {
                Some((results, total)) => Reason::OnlyUnsuccessful {
                    results: results.clone(),
                    total: *total,
                },
                None => Reason::NeverEvidenced,
            });
        }
        if !self.effective.contains_key(tool) {
            // Ever had evidence and none is effective: only compaction
            // removes rows, so it recorded which one did.
            let (seq, event_id, row) = self.removed_by.get(tool)?.clone();
            return Some(Reason::Compacted {
                compaction_seq: seq,
                compaction_event_id: event_id,
                removed_evidence: row,
            });
        }
        let defs = self
            .catalogs
            .get(&self.mode)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        if defs.last().is_some_and(|d| d.tools.contains(tool)) {
            return None;
        }
        if let Some(last_with) = defs.iter().rposition(|d| d.tools.contains(tool)) {
            return Some(Reason::DroppedByCatalogRebuild {
                mode: self.mode.clone(),
                rebuild: self.catalog_ref(&self.mode, &defs[last_with + 1]),
                previous: self.catalog_ref(&self.mode, &defs[last_with]),
            });
        }
        let mut admitted_in_modes: Vec<String> = self
            .catalogs
            .iter()
            .filter(|(_, defs)| defs.last().is_some_and(|d| d.tools.contains(tool)))
            .map(|(mode, _)| mode.clone())
            .collect();
        admitted_in_modes.sort();
        Some(Reason::NotInModeCatalog {
            mode: self.mode.clone(),
            catalog: defs.last().map(|d| self.catalog_ref(&self.mode, d)),
            admitted_in_modes,
        })
    }

    /// The full answer for `tool` after the last applied event.
    pub fn explain(&self, tool: &str) -> Explanation {
        let reason = self.reason(tool);
        let catalog = self
            .current_catalog()
            .map(|d| self.catalog_ref(&self.mode, d));
        let evidence = match reason {
            Some(_) => None,
            None => self
                .evidence_rows
                .iter()
                .rev()
                .find(|r| r.names.iter().any(|n| n == tool))
                .map(|r| r.row_for(tool, ToolStatus::Success)),
        };
        let why = sentence(tool, &self.mode, evidence.as_ref(), reason.as_ref());
        Explanation {
            session_id: self.session_id,
            tool: tool.to_owned(),
            as_of_seq: self.seq,
            as_of_prompt: self.prompts,
            mode: self.mode.clone(),
            active: reason.is_none(),
            evidence,
            catalog,
            reason,
            why,
        }
    }
}

/// Produces [`Refresh`] entries while events are applied.
#[derive(Clone, Debug)]
pub struct RefreshTracker {
    auditor: Auditor,
    previous: Vec<Activation>,
}

impl RefreshTracker {
    /// A tracker of a session before its first event.
    pub fn new(session_id: Uuid) -> RefreshTracker {
        RefreshTracker {
            auditor: Auditor::new(session_id),
            previous: Vec::new(),
        }
    }

    /// Applies the next event; returns the refresh entry when it is a
    /// refresh point (§8).
    pub fn apply(&mut self, event: &StoredEvent) -> Option<Refresh> {
        self.auditor.apply(event);
        if !event.body.is_refresh_point() {
            return None;
        }
        let tools = self.auditor.activation_set();
        let now: BTreeSet<&str> = tools.iter().map(|a| a.name.as_str()).collect();
        let before: BTreeSet<&str> = self.previous.iter().map(|a| a.name.as_str()).collect();
        let added = now.difference(&before).map(|n| n.to_string()).collect();
        let removed = before
            .difference(&now)
            .filter_map(|n| {
                self.auditor.reason(n).map(|reason| Removed {
                    name: n.to_string(),
                    reason,
                })
            })
            .collect();
        let entry = Refresh {
            seq: event.seq,
            event_id: event.event_id,
            kind: event.body.type_name().to_owned(),
            prompt: self.auditor.prompts,
            mode: self.auditor.mode.clone(),
            tools: tools.clone(),
            added,
            removed,
        };
        self.previous = tools;
        Some(entry)
    }
}

/// The one-sentence form of an answer, for people.
fn sentence(
    tool: &str,
    mode: &str,
    evidence: Option<&EvidenceRow>,
    reason: Option<&Reason>,
) -> String {
    match (evidence, reason) {
        (Some(e), None) => format!(
            "{tool} is active: {} at seq {} (call {}) gives evidence for it and the catalog of mode {mode} admits it.",
            match e.source {
                EvidenceSource::OwnResult => "its own successful result".to_owned(),
                EvidenceSource::Search => format!("the successful {} result", e.result_tool),
            },
            e.seq,
            e.call_id
        ),
        (_, Some(r)) => format!("{tool} is not active: {}.", reason_text(r)),
        (None, None) => format!("{tool} is active."),
    }
}

/// The reason as a clause, used by the CLI's table output too.
pub fn reason_text(reason: &Reason) -> String {
    match reason {
        Reason::NeverEvidenced => "no result ever gave evidence for it".to_owned(),
        Reason::OnlyUnsuccessful { results, total } => format!(
            "only unsuccessful results named it ({total}: {}{})",
            results
                .iter()
                .map(|r| format!("{} at seq {}", r.status.as_str(), r.seq))
                .collect::<Vec<_>>()
                .join(", "),
            // The list is cut at its first ones (docs/audit.md): said, so
            // that it is not read as all of them.
            match total.saturating_sub(results.len()) {
                0 => String::new(),
                more => format!(" and {more} more"),
            }
        ),
        Reason::Compacted {
            compaction_seq,
            removed_evidence,
            ..
        } => format!(
            "the compaction at seq {compaction_seq} removed its evidence (the result at seq {})",
            removed_evidence.seq
        ),
        Reason::NotInModeCatalog {
            mode,
            catalog,
            admitted_in_modes,
        } => {
            let defined = match catalog {
                Some(c) => format!("defined at seq {}", c.seq),
                None => "the mode has no catalog".to_owned(),
            };
            let elsewhere = if admitted_in_modes.is_empty() {
                String::new()
            } else {
                match admitted_in_modes.as_slice() {
                    [one] => format!("; mode {one} admits it"),
                    many => format!("; modes {} admit it", many.join(", ")),
                }
            };
            format!("the catalog of mode {mode} does not admit it ({defined}{elsewhere})")
        }
        Reason::DroppedByCatalogRebuild {
            mode,
            rebuild,
            previous,
        } => format!(
            "the catalog of mode {mode} rebuilt at seq {} dropped it (the one at seq {} admitted it)",
            rebuild.seq, previous.seq
        ),
    }
}

#[cfg(test)]
mod tests {
    //! Each reason built from a log that produces it, and the two folds
    //! compared on the §7 consequences.

    use super::*;
    use crate::event::ToolStatus::*;
    use crate::testkit::*;

    fn audit(log: &Log) -> Auditor {
        let mut a = Auditor::new(Uuid::nil());
        for e in &log.events {
            a.apply(e);
        }
        a
    }

    fn base() -> Log {
        Log::new()
            .push(started("agent"))
            .push(catalog("agent", &["web_fetch", "image_view"]))
            .push(prompt("go"))
    }

    #[test]
    fn active_names_search_evidence_mode_and_catalog() {
        let log = base().push(call("c1", "ToolSearch")).push(result(
            "c1",
            "ToolSearch",
            Success,
            &["web_fetch"],
        ));
        let e = audit(&log).explain("web_fetch");
        assert!(e.active, "{e:?}");
        let ev = e.evidence.expect("evidence row");
        assert_eq!((ev.seq, ev.event_id), (5, Log::id(5)));
        assert_eq!(ev.source, EvidenceSource::Search);
        assert_eq!(ev.result_tool, "ToolSearch");
        assert_eq!(e.catalog.map(|c| c.seq), Some(2));
        assert_eq!(e.mode, "agent");
        assert!(e.why.contains("seq 5"), "{}", e.why);
    }

    #[test]
    fn a_cut_list_of_unsuccessful_results_says_how_many_more() {
        let mut log = base();
        for i in 0..MAX_LISTED_RESULTS + 3 {
            let id = format!("c{i}");
            log = log
                .push(call(&id, "web_fetch"))
                .push(result(&id, "web_fetch", Error, &[]));
        }
        let why = audit(&log).explain("web_fetch").why;
        let total = MAX_LISTED_RESULTS + 3;
        assert!(
            why.contains(&format!("({total}: error at seq 5,")) && why.ends_with(" and 3 more)."),
            "{why}"
        );
        let few = base()
            .push(call("c1", "web_fetch"))
            .push(result("c1", "web_fetch", Error, &[]));
        let why = audit(&few).explain("web_fetch").why;
        assert!(why.ends_with("(1: error at seq 5)."), "{why}");
    }

    #[test]
    fn own_result_is_named_as_such() {
        let log =
            base()
                .push(call("c1", "web_fetch"))
                .push(result("c1", "web_fetch", Success, &[]));
        let e = audit(&log).explain("web_fetch");
        assert_eq!(
            e.evidence.map(|r| r.source),
            Some(EvidenceSource::OwnResult)
        );
    }

    #[test]
    fn never_evidenced() {
        let log = base().push(call("c1", "ToolSearch")).push(result(
            "c1",
            "ToolSearch",
            Success,
            &["image_view"],
        ));
        assert_eq!(
            audit(&log).explain("web_fetch").reason,
            Some(Reason::NeverEvidenced)
        );
    }

    #[test]
    fn only_unsuccessful_lists_every_status() {
        let log = base()
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Error, &["web_fetch"]))
            .push(call("c2", "web_fetch"))
            .push(result("c2", "web_fetch", Interrupted, &[]))
            .push(call("c3", "ToolSearch"))
            .push(result("c3", "ToolSearch", Placeholder, &["web_fetch"]));
        match audit(&log).explain("web_fetch").reason {
            Some(Reason::OnlyUnsuccessful { results, total }) => {
                assert_eq!(total, 3);
                let got: Vec<_> = results.iter().map(|r| (r.seq, r.status)).collect();
                assert_eq!(got, vec![(5, Error), (7, Interrupted), (9, Placeholder)]);
                assert_eq!(results[1].source, EvidenceSource::OwnResult);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn compacted_names_the_compaction_and_the_removed_row() {
        let log = base()
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
            .push(prompt("more"))
            .push(compaction(Some(6)));
        let a = audit(&log);
        assert!(a.activation_set().is_empty());
        match a.explain("web_fetch").reason {
            Some(Reason::Compacted {
                compaction_seq,
                compaction_event_id,
                removed_evidence,
            }) => {
                assert_eq!((compaction_seq, compaction_event_id), (7, Log::id(7)));
                assert_eq!(removed_evidence.seq, 5);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn failed_then_compacted_success_is_compacted() {
        let log = base()
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
            .push(compaction(None))
            .push(call("c2", "web_fetch"))
            .push(result("c2", "web_fetch", Error, &[]));
        assert!(matches!(
            audit(&log).reason("web_fetch"),
            Some(Reason::Compacted {
                compaction_seq: 6,
                ..
            })
        ));
    }

    #[test]
    fn not_in_mode_catalog_names_mode_catalog_and_other_modes() {
        let log = base()
            .push(catalog("plan", &["image_view"]))
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
            .push(switch("plan"));
        match audit(&log).explain("web_fetch").reason {
            Some(Reason::NotInModeCatalog {
                mode,
                catalog,
                admitted_in_modes,
            }) => {
                assert_eq!(mode, "plan");
                assert_eq!(catalog.map(|c| (c.seq, c.event_id)), Some((4, Log::id(4))));
                assert_eq!(admitted_in_modes, vec!["agent".to_owned()]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_mode_without_catalog_is_not_in_mode_catalog() {
        let log = base()
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
            .push(switch("bare"));
        assert!(matches!(
            audit(&log).reason("web_fetch"),
            Some(Reason::NotInModeCatalog { catalog: None, .. })
        ));
    }

    #[test]
    fn dropped_by_catalog_rebuild_names_both_catalogs() {
        let log = base()
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
            .push(catalog("agent", &["image_view"]))
            .push(catalog("agent", &["image_view", "notebook_edit"]))
            .push(prompt("again"));
        match audit(&log).explain("web_fetch").reason {
            Some(Reason::DroppedByCatalogRebuild {
                mode,
                rebuild,
                previous,
            }) => {
                assert_eq!(mode, "agent");
                assert_eq!(rebuild.seq, 6);
                assert_eq!(previous.seq, 2);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn switching_back_restores_and_refreshes_report_each_step() {
        let log = base()
            .push(catalog("plan", &[]))
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
            .push(prompt("p2"))
            .push(switch("plan"))
            .push(switch("agent"));
        let mut t = RefreshTracker::new(Uuid::nil());
        let refreshes: Vec<Refresh> = log.events.iter().filter_map(|e| t.apply(e)).collect();
        let seqs: Vec<i64> = refreshes.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![3, 7, 8, 9]);
        assert_eq!(refreshes[1].added, vec!["web_fetch".to_owned()]);
        assert_eq!(refreshes[2].removed.len(), 1);
        assert!(matches!(
            refreshes[2].removed[0].reason,
            Reason::NotInModeCatalog { .. }
        ));
        assert_eq!(refreshes[3].added, vec!["web_fetch".to_owned()]);
        assert_eq!(refreshes[3].tools[0].evidence_seq, 6);
    }

    #[test]
    fn agrees_with_the_projector_on_the_consequences() {
        let log = base()
            .push(call("c1", "ToolSearch"))
            .push(result(
                "c1",
                "ToolSearch",
                Success,
                &["web_fetch", "image_view"],
            ))
            .push(call("c2", "Read"))
            .push(result("c2", "Read", Success, &[]))
            .push(compaction(Some(6)))
            .push(call("c3", "web_fetch"))
            .push(result("c3", "web_fetch", Success, &[]));
        let mut a = Auditor::new(Uuid::nil());
        let mut prefix = Log::new();
        for e in &log.events {
            a.apply(e);
            prefix = prefix.push(e.body.clone());
            assert_eq!(a.activation_set(), prefix.state().activation_set());
        }
    }
}
