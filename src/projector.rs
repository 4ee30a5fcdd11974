//! The pure fold: events in seq order -> session state, from which the
//! effective context (SEMANTICS §5), the current mode and catalog (§6) and the
//! deferred activation set (§7) are read.
//!
//! [`SessionState::apply`] never fails: it is only given events that
//! [`crate::validate`] accepted (or that the log already holds). The same state
//! is what validation judges the next event against, so the two can never
//! disagree about what is effective.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;
use uuid::Uuid;

use crate::event::{EventBody, StoredEvent};

/// What validation needs to know about one tool call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CallInfo {
    pub(crate) tool_name: String,
    pub(crate) seq: i64,
    pub(crate) result_seq: Option<i64>,
}

/// A session folded up to [`SessionState::seq`]. Its fields are public for
/// reading; change a state only through its methods, which keep the
/// evidence it derives from `rows` in step.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionState {
    /// The session.
    pub session_id: Uuid,
    /// The last applied seq (0 before any event).
    pub seq: i64,
    /// Whether `session_started` was seen.
    pub started: bool,
    /// The current mode (§6).
    pub mode: String,
    /// Each mode's deferred catalog, with the seq of the `catalog_defined`
    /// that set it.
    pub catalogs: HashMap<String, (Vec<String>, i64)>,
    /// The latest compaction's summary and seq, if any.
    pub compaction: Option<(String, i64)>,
    /// Transcript rows with seq >= this are effective (§5): 1 without a
    /// compaction, else `seq(first_kept_event_id)` or the compaction's seq + 1.
    pub window_start: i64,
    /// The seq of the latest refresh point (§8), 0 before the first.
    pub refresh_seq: i64,
    /// The effective transcript rows, in seq order (§5).
    pub rows: Vec<StoredEvent>,
    pub(crate) calls: HashMap<String, CallInfo>,
    /// Every name with evidence in `rows` and its evidence seq, kept as
    /// rows come and recomputed from the remaining rows at each compaction
    /// (the only place rows leave): each refresh point reads it instead of
    /// scanning the window, which made a long session without compactions
    /// quadratic to append. The methods keep the two in step; the public
    /// fields are for reading (a state whose `rows` are changed by hand
    /// answers from stale evidence).
    evidence: BTreeMap<String, i64>,
    /// Built from a view without the window's rows
    /// ([`SessionState::from_view_without_rows`]): `rows` and `calls` stay
    /// empty, and a compaction needs the seq of the row it keeps from
    /// ([`SessionState::apply_rowless`]).
    rowless: bool,
    /// About how many bytes `rows` hold ([`row_bytes`] each), kept as rows
    /// come and go: [`SessionState::approx_bytes`] is read at each cache
    /// insert, and a walk of a long window there would cost what the
    /// append it follows does.
    row_bytes: usize,
}

/// About how many bytes one row of the window takes: the event and what
/// its body holds on the heap.
fn row_bytes(row: &StoredEvent) -> usize {
    std::mem::size_of::<StoredEvent>() + row.body.heap_bytes()
}

/// The state of a session at its latest refresh point (SEMANTICS §8), as the
/// store keeps it: enough to answer "as of the latest event" by folding only
/// the events after `refresh_seq` and reading the effective window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct View {
    /// The session.
    pub session_id: Uuid,
    /// The seq of the refresh point.
    pub refresh_seq: i64,
    /// The mode there.
    pub mode: String,
    /// Where the effective context starts.
    pub window_start: i64,
    /// The latest compaction's summary and seq.
    pub compaction: Option<(String, i64)>,
    /// Every mode's catalog and the seq that defined it.
    pub catalogs: HashMap<String, (Vec<String>, i64)>,
    /// Every name with evidence in the window, with its evidence seq.
    pub evidence: BTreeMap<String, i64>,
    /// The activation set there.
    pub active: Vec<Activation>,
}

/// One name of the activation set (§7).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Activation {
    /// The deferred tool.
    pub name: String,
    /// The largest seq of an effective row that gave evidence for it.
    pub evidence_seq: i64,
}

/// The effective context at a seq, in the §9 JSON shape.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Context {
    /// The session.
    pub session_id: Uuid,
    /// The seq this answer is as of.
    pub as_of_seq: i64,
    /// The current mode.
    pub mode: String,
    /// The latest compaction's summary, `null` without one.
    pub summary: Option<String>,
    /// The effective transcript rows.
    pub rows: Vec<ContextRow>,
}

impl Context {
    /// The JSON text of this context without its rows, up to the opening
    /// of the `rows` array: for a writer that streams a long context's
    /// rows ([`crate::Store::context_paged`]). Each row's `serde_json`
    /// text follows, separated by commas, then `]}`; the whole is the
    /// same text as this context's with those rows.
    pub fn json_head(&self) -> serde_json::Result<String> {
        let empty = Context {
            session_id: self.session_id,
            as_of_seq: self.as_of_seq,
            mode: self.mode.clone(),
            summary: self.summary.clone(),
            rows: Vec::new(),
        };
        let text = serde_json::to_string(&empty)?;
        // The rows are the last field (serde writes fields in order).
        Ok(text
            .strip_suffix("[]}")
            .map(|open| format!("{open}["))
            .unwrap_or(text))
    }
}

impl From<StoredEvent> for ContextRow {
    fn from(e: StoredEvent) -> ContextRow {
        ContextRow {
            seq: e.seq,
            event_id: e.event_id,
            body: e.body,
        }
    }
}

/// One row of [`Context`]: the stored event without the global envelope.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ContextRow {
    /// The row's seq.
    pub seq: i64,
    /// The row's event id.
    pub event_id: Uuid,
    /// Type and payload.
    #[serde(flatten)]
    pub body: EventBody,
}

/// The activation set at a seq, in the §9 JSON shape.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Activations {
    /// The session.
    pub session_id: Uuid,
    /// The seq this answer is as of.
    pub as_of_seq: i64,
    /// The current mode.
    pub mode: String,
    /// Sorted by name in byte order.
    pub tools: Vec<Activation>,
}

/// `body` without what [`SessionState::shed_payloads`] empties, in place.
fn shed(body: &mut EventBody) {
    match body {
        EventBody::PromptSubmitted { text } | EventBody::AssistantMessage { text } => {
            *text = String::new()
        }
        EventBody::ToolCall { input, .. } => *input = serde_json::Value::Null,
        EventBody::ToolResult { output, .. } => *output = None,
        _ => {}
    }
}

/// Records `row`'s evidence (§7) in `evidence`. Rows come in seq order, so
/// a name's last record is its largest seq.
fn note_evidence(evidence: &mut BTreeMap<String, i64>, row: &StoredEvent) {
    for name in row.body.evidence() {
        match evidence.get_mut(name) {
            Some(seq) => *seq = row.seq,
            None => {
                evidence.insert(name.to_owned(), row.seq);
            }
        }
    }
}

impl SessionState {
    /// The state of a session with no events.
    pub fn empty(session_id: Uuid) -> SessionState {
        SessionState {
            session_id,
            seq: 0,
            started: false,
            mode: String::new(),
            catalogs: HashMap::new(),
            compaction: None,
            window_start: 1,
            refresh_seq: 0,
            rows: Vec::new(),
            calls: HashMap::new(),
            evidence: BTreeMap::new(),
            rowless: false,
            row_bytes: 0,
        }
    }

    /// Folds `events` (seq 1, 2, … of one session) into a state.
    pub fn fold<'a>(session_id: Uuid, events: impl IntoIterator<Item = &'a StoredEvent>) -> Self {
        let mut state = SessionState::empty(session_id);
        for e in events {
            state.apply(e);
        }
        state
    }

    /// Applies one accepted event.
    pub fn apply(&mut self, event: &StoredEvent) {
        if self.fold_in(event) {
            self.push_row(event.clone());
        }
    }

    /// Adds a row of the window and its evidence (§7). Rows come in seq
    /// order, so a name's last insert is its largest seq.
    fn push_row(&mut self, row: StoredEvent) {
        note_evidence(&mut self.evidence, &row);
        self.row_bytes += row_bytes(&row);
        self.rows.push(row);
    }

    /// [`SessionState::apply`] for an event the caller no longer needs: a
    /// transcript row is kept as it is instead of copied (an append's rows
    /// carry outputs of a few KB).
    pub fn apply_owned(&mut self, event: StoredEvent) {
        if self.fold_in(&event) {
            self.push_row(event);
        }
    }

    /// Forgets the calls that neither sit in the effective window nor are
    /// answered in it. Reading needs none of them (§7 reads the window);
    /// validating an append loads any it names from the calls index, and a
    /// compaction's check needs the calls of the window's results, which
    /// stay. Keeps a long session's state the size of its window.
    pub(crate) fn forget_calls_outside_window(&mut self) {
        self.forget_calls_keeping_open(0);
    }

    /// [`SessionState::forget_calls_outside_window`], but keeping the
    /// `keep_open` latest calls before the window that are not answered
    /// yet: what the state cache holds. A compaction can leave a call
    /// before its new window while its result is still to come (a
    /// session several writers append to, a tool that runs across a
    /// compaction). An optimistic append takes a call its state does not
    /// know as absent, so that result would be refused from the cache and
    /// its whole group judged again under the lock, every time. Bounded,
    /// because calls that are never answered would otherwise pile up in a
    /// long session's state; one dropped is only read again when named.
    pub(crate) fn forget_calls_keeping_open(&mut self, keep_open: usize) {
        let window_start = self.window_start;
        let in_window =
            |c: &CallInfo| c.seq >= window_start || c.result_seq.is_some_and(|r| r >= window_start);
        // The seq from which unanswered calls before the window stay.
        let mut open: Vec<i64> = self
            .calls
            .values()
            .filter(|c| c.result_seq.is_none() && !in_window(c))
            .map(|c| c.seq)
            .collect();
        let open_from = if open.len() <= keep_open {
            i64::MIN
        } else if keep_open == 0 {
            i64::MAX
        } else {
            let at = open.len() - keep_open;
            *open.select_nth_unstable(at).1
        };
        self.calls
            .retain(|_, c| in_window(c) || (c.result_seq.is_none() && c.seq >= open_from));
        // The table's buckets stay after a retain: after a compaction of a
        // long window they would hold megabytes for a handful of calls.
        if self.calls.capacity() > 2 * self.calls.len() + 16 {
            self.calls.shrink_to_fit();
        }
    }

    /// Empties the texts, call inputs and result outputs of the window's
    /// rows, keeping everything the activation set reads (§7: which calls
    /// and results, their tools, statuses and added names). For a holder
    /// that only ever asks for [`SessionState::activations`], such as an
    /// HTTP stream: the window's texts can be megabytes per row, and each
    /// open stream kept its own copy. [`SessionState::context`] of a shed
    /// state has empty texts; do not ask it.
    pub fn shed_payloads(&mut self) {
        for row in &mut self.rows {
            shed(&mut row.body);
        }
        self.row_bytes = self.rows.iter().map(row_bytes).sum();
    }

    /// [`SessionState::apply_owned`] followed by
    /// [`SessionState::shed_payloads`] of the new row.
    pub fn apply_shed(&mut self, mut event: StoredEvent) {
        if self.fold_in(&event) {
            shed(&mut event.body);
            self.push_row(event);
        }
    }

    /// Everything [`SessionState::apply`] does but keeping the row; true
    /// when the event is a transcript row of the window.
    fn fold_in(&mut self, event: &StoredEvent) -> bool {
        self.seq = event.seq;
        if event.body.is_refresh_point() {
            self.refresh_seq = event.seq;
        }
        match &event.body {
            EventBody::SessionStarted { mode, .. } => {
                self.started = true;
                self.mode = mode.clone();
                false
            }
            EventBody::ModeSwitched { mode } => {
                self.mode = mode.clone();
                false
            }
            EventBody::CatalogDefined {
                mode,
                deferred_tools,
            } => {
                self.catalogs
                    .insert(mode.clone(), (deferred_tools.clone(), event.seq));
                false
            }
            EventBody::Compaction {
                summary,
                first_kept_event_id,
                ..
            } => {
                let keep_from = first_kept_event_id
                    .and_then(|id| self.rows.iter().position(|r| r.event_id == id))
                    .unwrap_or(self.rows.len());
                self.window_start = self
                    .rows
                    .get(keep_from)
                    .map(|r| r.seq)
                    .unwrap_or(event.seq + 1);
                let gone: usize = self.rows.drain(..keep_from).map(|r| row_bytes(&r)).sum();
                self.row_bytes = self.row_bytes.saturating_sub(gone);
                // The old window's allocation goes too: a state cached
                // after a compaction kept it (and was weighed by it).
                if self.rows.capacity() > 2 * self.rows.len() + 16 {
                    self.rows.shrink_to_fit();
                }
                // Evidence of the dropped rows no longer counts (§7). A
                // compaction that keeps the whole window drops none: the
                // evidence stands as it is (folding it again from every row
                // made a session of such compactions quadratic, 8.5 s for
                // a cold append after 16 000 of them, a review's finding).
                if keep_from > 0 {
                    self.evidence.clear();
                    for row in &self.rows {
                        note_evidence(&mut self.evidence, row);
                    }
                } else if cfg!(debug_assertions) {
                    let mut again = Default::default();
                    for row in &self.rows {
                        note_evidence(&mut again, row);
                    }
                    debug_assert!(
                        again == self.evidence,
                        "evidence not derived from the window"
                    );
                }
                self.compaction = Some((summary.clone(), event.seq));
                false
            }
            EventBody::ToolCall {
                call_id, tool_name, ..
            } => {
                self.calls.insert(
                    call_id.clone(),
                    CallInfo {
                        tool_name: tool_name.clone(),
                        seq: event.seq,
                        result_seq: None,
                    },
                );
                true
            }
            EventBody::ToolResult { call_id, .. } => {
                if let Some(call) = self.calls.get_mut(call_id) {
                    call.result_seq = Some(event.seq);
                }
                true
            }
            EventBody::PromptSubmitted { .. } | EventBody::AssistantMessage { .. } => true,
        }
    }

    /// Rebuilds a state from a materialized view (§8) taken at
    /// `view.refresh_seq` and the effective rows at that point (the log's
    /// rows with `window_start <= seq <= refresh_seq`). Calls of the session
    /// outside the window are not known to the result; the store looks
    /// them up when a batch needs them.
    pub fn from_view(view: &View, window_rows: &[StoredEvent]) -> SessionState {
        let mut state = SessionState::empty(view.session_id);
        state.started = true;
        for row in window_rows.iter().filter(|r| r.body.is_row()) {
            state.apply(row);
        }
        state.seq = view.refresh_seq;
        state.refresh_seq = view.refresh_seq;
        state.mode = view.mode.clone();
        state.catalogs = view.catalogs.clone();
        state.compaction = view.compaction.clone();
        state.window_start = view.window_start;
        state
    }

    /// A state that answers [`SessionState::activations`] and what
    /// `recover` reads from a view alone, with the view's evidence instead
    /// of the window's rows (§8: the view holds every name with evidence
    /// in the window). Events after the view may be applied, except a
    /// compaction, which needs the rows to find where the window starts.
    /// Its [`SessionState::context`] lacks the window's rows: the store
    /// never caches it or hands it out, only the answers above.
    pub(crate) fn from_view_without_rows(view: &View) -> SessionState {
        let mut state = SessionState::from_view(view, &[]);
        state.evidence = view.evidence.clone();
        state.rowless = true;
        state
    }

    /// This state without its window's rows and calls, as
    /// [`SessionState::from_view_without_rows`] would build it at the same
    /// seq (the evidence is kept in step with the rows, so it is the
    /// same): what an activation set or a paged context needs of a long
    /// cached window, without copying every row's text.
    pub(crate) fn without_rows(&self) -> SessionState {
        SessionState {
            session_id: self.session_id,
            seq: self.seq,
            started: self.started,
            mode: self.mode.clone(),
            catalogs: self.catalogs.clone(),
            compaction: self.compaction.clone(),
            window_start: self.window_start,
            refresh_seq: self.refresh_seq,
            rows: Vec::new(),
            calls: HashMap::new(),
            evidence: self.evidence.clone(),
            rowless: true,
            row_bytes: 0,
        }
    }

    /// The rowless state of a session with no events: a fold from seq 1
    /// that answers activation sets, and views, without holding the
    /// window's rows (a session never compacted has its whole log as its
    /// window). Events go in through [`SessionState::apply_rowless`].
    pub(crate) fn empty_without_rows(session_id: Uuid) -> SessionState {
        let mut state = SessionState::empty(session_id);
        state.rowless = true;
        state
    }

    /// About how many bytes this state holds: its window's rows with their
    /// texts and values (most of it), the calls it keeps, the evidence
    /// and catalogs. An estimate (allocator and map overheads are
    /// guessed), kept in step with the rows rather than walked, so it
    /// costs the same for any window; what the store's state cache is
    /// bounded by ([`crate::StoreOptions::state_cache_bytes`]).
    pub fn approx_bytes(&self) -> usize {
        /// A call id, tool name and the map entry holding them (a guess:
        /// walking every call at each insert would cost what the append
        /// does; ids and names are usually a few dozen bytes).
        const CALL_BYTES: usize = 160;
        /// A name's `String`, its seq and its share of `BTreeMap` nodes.
        const EVIDENCE_BYTES: usize = 64;
        // Evidence and catalogs are walked: a few names each, but a name
        // may be long.
        let evidence: usize = self
            .evidence
            .keys()
            .map(|name| EVIDENCE_BYTES + name.len())
            .sum();
        let catalogs: usize = self
            .catalogs
            .iter()
            .map(|(mode, (tools, _))| {
                64 + mode.len() + tools.iter().map(|t| 48 + t.len()).sum::<usize>()
            })
            .sum();
        std::mem::size_of::<SessionState>()
            + self.row_bytes
            + (self.rows.capacity() - self.rows.len()) * std::mem::size_of::<StoredEvent>()
            + self.calls.len() * CALL_BYTES
            + (self.calls.capacity() - self.calls.len())
                * (std::mem::size_of::<(String, CallInfo)>() + 1)
            + evidence
            + catalogs
            + self.compaction.as_ref().map_or(0, |(s, _)| s.len())
    }

    /// Whether this state lacks the window's rows (and so needs
    /// [`SessionState::apply_rowless`] for a compaction).
    pub(crate) fn is_rowless(&self) -> bool {
        self.rowless
    }

    /// Applies one event to a rowless state, keeping only what the
    /// activation set reads (mode, catalogs, evidence, the window's
    /// bounds). A compaction cannot find the row
    /// it keeps from among rows the state does not hold, so the caller
    /// gives that row's seq (`kept_seq`, looked up in the log; `None` when
    /// it keeps nothing). §4 has every stored compaction keep from a
    /// transcript row of the effective context, so the window then starts
    /// there, as [`SessionState::apply`] would find; the evidence that
    /// stays is each name's whose largest evidence seq is in the new
    /// window (its rows with smaller seqs are gone, and its largest one is
    /// what remains), as a scan of the remaining rows would give.
    pub(crate) fn apply_rowless(&mut self, event: StoredEvent, kept_seq: Option<i64>) {
        let EventBody::Compaction { summary, .. } = &event.body else {
            // Only the evidence is kept: a rowless state answers activation
            // sets, so neither rows nor calls are held, however long the
            // events after its view run (an agent's loop of tool calls
            // with no prompt between).
            if self.fold_in(&event) {
                note_evidence(&mut self.evidence, &event);
            }
            self.calls.clear();
            return;
        };
        self.seq = event.seq;
        let start = kept_seq.unwrap_or(event.seq + 1);
        self.window_start = start;
        self.evidence.retain(|_, seq| *seq >= start);
        self.compaction = Some((summary.clone(), event.seq));
    }

    /// The materialized view of this state (meaningful at a refresh point).
    pub fn view(&self) -> View {
        View {
            session_id: self.session_id,
            refresh_seq: self.seq,
            mode: self.mode.clone(),
            window_start: self.window_start,
            compaction: self.compaction.clone(),
            catalogs: self.catalogs.clone(),
            active: self.activation_set(),
            evidence: self.evidence.clone(),
        }
    }

    /// The current mode's deferred catalog (§6), empty when it has none.
    pub fn current_catalog(&self) -> &[String] {
        self.catalogs
            .get(&self.mode)
            .map(|(tools, _)| tools.as_slice())
            .unwrap_or(&[])
    }

    /// Every name with evidence in the effective context and its evidence
    /// seq, whether or not the catalog admits it.
    pub fn evidence(&self) -> &BTreeMap<String, i64> {
        &self.evidence
    }

    /// The deferred activation set (§7), sorted by name in byte order: the
    /// names with evidence that the current catalog admits.
    pub fn activation_set(&self) -> Vec<Activation> {
        let catalog: HashSet<&str> = self.current_catalog().iter().map(String::as_str).collect();
        self.evidence
            .iter()
            .filter(|(name, _)| catalog.contains(name.as_str()))
            .map(|(name, evidence_seq)| Activation {
                name: name.clone(),
                evidence_seq: *evidence_seq,
            })
            .collect()
    }

    /// The effective context (§5) in the §9 shape.
    pub fn context(&self) -> Context {
        Context {
            session_id: self.session_id,
            as_of_seq: self.seq,
            mode: self.mode.clone(),
            summary: self.compaction.as_ref().map(|(s, _)| s.clone()),
            rows: self
                .rows
                .iter()
                .map(|r| ContextRow {
                    seq: r.seq,
                    event_id: r.event_id,
                    body: r.body.clone(),
                })
                .collect(),
        }
    }

    /// The activation set in the §9 shape.
    pub fn activations(&self) -> Activations {
        Activations {
            session_id: self.session_id,
            as_of_seq: self.seq,
            mode: self.mode.clone(),
            tools: self.activation_set(),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The consequences listed in SEMANTICS §7, each one a test.

    use crate::event::EventBody;
    use crate::event::ToolStatus::*;
    use crate::projector::SessionState;
    use crate::testkit::*;

    fn searched() -> Log {
        Log::new()
            .push(started("agent"))
            .push(catalog(
                "agent",
                &["web_fetch", "notebook_edit", "image_view"],
            ))
            .push(prompt("find"))
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
    }

    /// A compaction of a long window gives back the rows' allocation, and
    /// forgetting the calls outside the new window gives back their
    /// table's: the cache weighs a state by what it holds.
    #[test]
    fn a_compacted_state_gives_back_its_old_windows_memory() {
        let mut log = Log::new().push(started("agent"));
        for i in 0..5_000 {
            let id = format!("c{i}");
            log = log
                .push(call(&id, "Read"))
                .push(result(&id, "Read", Success, &[]));
        }
        let mut state = log.push(compaction(None)).push(prompt("after")).state();
        assert_eq!(state.rows.len(), 1);
        assert!(state.rows.capacity() <= 18, "{}", state.rows.capacity());
        state.forget_calls_outside_window();
        assert!(state.calls.is_empty());
        assert!(state.calls.capacity() <= 16, "{}", state.calls.capacity());
        assert!(state.approx_bytes() < 16 << 10, "{}", state.approx_bytes());
    }

    /// The cache keeps the latest unanswered calls from before the window,
    /// up to its bound, and every call the window needs; reads keep none
    /// from before it.
    #[test]
    fn the_cache_keeps_the_latest_open_calls_before_the_window() {
        let mut log = Log::new().push(started("agent")).push(prompt("go"));
        for i in 0..10 {
            log = log.push(call(&format!("open{i}"), "Read"));
        }
        log = log
            .push(call("done", "Read"))
            .push(result("done", "Read", Success, &[]));
        let state = log
            .push(compaction(None))
            .push(call("late", "Read"))
            .state();
        let kept = |keep: usize| {
            let mut s = state.clone();
            s.forget_calls_keeping_open(keep);
            let mut ids: Vec<String> = s.calls.keys().cloned().collect();
            ids.sort();
            ids
        };
        assert_eq!(kept(0), ["late"]);
        assert_eq!(kept(3), ["late", "open7", "open8", "open9"]);
        let mut all: Vec<String> = (0..10).map(|i| format!("open{i}")).collect();
        all.push("late".into());
        all.sort();
        assert_eq!(kept(10), all);
        assert_eq!(kept(64), all);
        let mut read = state.clone();
        read.forget_calls_outside_window();
        assert_eq!(read.calls.len(), 1);
    }

    #[test]
    fn a_shed_state_has_the_same_activation_set_at_every_seq() {
        // Streams keep states without texts, inputs or outputs: the set
        // must not depend on them, whether shed at once or row by row.
        let log = searched()
            .push(call("c2", "web_fetch"))
            .push(result("c2", "web_fetch", Success, &[]))
            .push(prompt("more"))
            .push(compaction(Some(6)))
            .push(switch("plan"))
            .push(catalog("plan", &["web_fetch"]))
            .push(switch("agent"))
            .push(call("c3", "ToolSearch"))
            .push(result("c3", "ToolSearch", Error, &[]))
            .push(prompt("again"));
        let mut shed_each = SessionState::empty(uuid::Uuid::nil());
        for n in 1..=log.events.len() {
            let full = SessionState::fold(uuid::Uuid::nil(), &log.events[..n]);
            let mut shed_once = full.clone();
            shed_once.shed_payloads();
            shed_each.apply_shed(log.events[n - 1].clone());
            assert_eq!(shed_once.activations(), full.activations(), "seq {n}");
            assert_eq!(shed_each.activations(), full.activations(), "seq {n}");
            assert!(shed_each.rows.iter().all(|r| match &r.body {
                EventBody::PromptSubmitted { text } | EventBody::AssistantMessage { text } =>
                    text.is_empty(),
                EventBody::ToolCall { input, .. } => input.is_null(),
                EventBody::ToolResult { output, .. } => output.is_none(),
                _ => true,
            }));
        }
    }

    #[test]
    fn a_successful_search_activates_its_names() {
        assert_eq!(searched().tools(), vec![("web_fetch".into(), 5)]);
    }

    #[test]
    fn error_interrupted_and_placeholder_results_contribute_nothing() {
        for status in [Error, Interrupted, Placeholder] {
            let log = Log::new()
                .push(started("agent"))
                .push(catalog("agent", &["web_fetch", "image_view"]))
                .push(call("c1", "image_view"))
                .push(result("c1", "image_view", status, &[]));
            assert!(log.tools().is_empty(), "{status:?}");
        }
    }

    #[test]
    fn prose_is_never_read_for_names() {
        // The prompt, the assistant text, the call's input and the result's
        // output all mention catalog names; none activates.
        let log = Log::new()
            .push(started("agent"))
            .push(catalog("agent", &["web_fetch", "image_view"]))
            .push(prompt("use web_fetch"))
            .push(crate::event::EventBody::AssistantMessage {
                text: "web_fetch is now available".into(),
            })
            .push(call("c1", "Read"))
            .push(result("c1", "Read", Success, &[]));
        assert!(log.tools().is_empty());
    }

    #[test]
    fn evidence_removed_by_compaction_no_longer_counts() {
        let log = searched().push(prompt("two")).push(compaction(Some(6)));
        assert!(log.tools().is_empty());
        let log = searched().push(compaction(None));
        assert!(log.tools().is_empty());
    }

    #[test]
    fn evidence_kept_by_compaction_still_counts() {
        let log = searched().push(prompt("two")).push(compaction(Some(3)));
        assert_eq!(log.tools(), vec![("web_fetch".into(), 5)]);
        assert_eq!(log.state().window_start, 3);
    }

    #[test]
    fn switching_to_a_mode_without_the_name_drops_it_and_back_restores_it() {
        let log = searched()
            .push(catalog("chat", &["image_view"]))
            .push(switch("chat"));
        assert!(log.tools().is_empty());
        let log = log.push(switch("agent"));
        assert_eq!(log.tools(), vec![("web_fetch".into(), 5)]);
    }

    #[test]
    fn a_rebuilt_catalog_that_drops_a_name_drops_it_and_one_that_keeps_it_keeps_it() {
        let dropped = searched().push(catalog("agent", &["notebook_edit"]));
        assert!(dropped.tools().is_empty());
        let kept = searched().push(catalog("agent", &["web_fetch"]));
        assert_eq!(kept.tools(), vec![("web_fetch".into(), 5)]);
    }

    #[test]
    fn evidence_older_than_the_catalog_that_admits_it_counts() {
        let log = Log::new()
            .push(started("agent"))
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]));
        assert!(log.tools().is_empty());
        let log = log.push(catalog("agent", &["web_fetch"]));
        assert_eq!(log.tools(), vec![("web_fetch".into(), 3)]);
    }

    #[test]
    fn a_core_tools_success_activates_nothing() {
        let log = searched()
            .push(call("c2", "Read"))
            .push(result("c2", "Read", Success, &[]));
        assert_eq!(log.tools(), vec![("web_fetch".into(), 5)]);
    }

    #[test]
    fn a_deferred_tools_own_success_activates_it_and_any_result_may_add_names() {
        let log = searched().push(call("c2", "image_view")).push(result(
            "c2",
            "image_view",
            Success,
            &["notebook_edit"],
        ));
        assert_eq!(
            log.tools(),
            vec![
                ("image_view".into(), 7),
                ("notebook_edit".into(), 7),
                ("web_fetch".into(), 5)
            ]
        );
    }

    #[test]
    fn evidence_seq_is_the_latest_effective_evidence_and_names_sort_by_bytes() {
        let log = Log::new()
            .push(started("agent"))
            .push(catalog("agent", &["a", "B", "web_fetch"]))
            .push(call("c1", "ToolSearch"))
            .push(result(
                "c1",
                "ToolSearch",
                Success,
                &["web_fetch", "a", "B"],
            ))
            .push(call("c2", "ToolSearch"))
            .push(result("c2", "ToolSearch", Success, &["web_fetch"]));
        assert_eq!(
            log.tools(),
            vec![("B".into(), 4), ("a".into(), 4), ("web_fetch".into(), 6)]
        );
    }

    #[test]
    fn only_the_latest_compaction_counts_and_null_keeps_only_later_rows() {
        let log = searched()
            .push(compaction(Some(3)))
            .push(prompt("after"))
            .push(compaction(None))
            .push(prompt("last"));
        let ctx = log.state().context();
        assert_eq!(ctx.summary.as_deref(), Some("summary"));
        assert_eq!(ctx.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![9]);
        assert!(log.tools().is_empty());
    }
}
