//! The rows an append writes besides the log's own (the activation
//! changes, the calls index, the materialized view), as both backends bind
//! and read them, and what an accepted batch hands to a backend's write.

use super::*;

/// A row ready to insert.
#[derive(Clone, Debug)]
pub(crate) struct PendingRow {
    pub(crate) position: i64,
    pub(crate) session_id: Uuid,
    pub(crate) seq: i64,
    pub(crate) event_id: Uuid,
    pub(crate) type_name: &'static str,
    pub(crate) payload: String,
    pub(crate) recorded_at: DateTime<Utc>,
    /// The chain hash (docs/integrity.md).
    pub(crate) hash: String,
}

/// What an accepted batch writes (see [`LogTx::write_accepted`]).
pub(crate) struct Accepted<'a> {
    pub(crate) session_id: Uuid,
    pub(crate) rows: &'a [PendingRow],
    pub(crate) calls: &'a [CallRow],
    /// The view at the batch's last refresh point, if it has one.
    pub(crate) view: Option<&'a ViewRow>,
    /// The tenant to record as the owner of a session this batch creates.
    pub(crate) claim_for: Option<&'a str>,
    /// The session's seq after the batch (for the wake-up).
    pub(crate) seq: i64,
    /// The `activation_changes` rows of the batch's refresh points.
    pub(crate) changes: &'a [ChangeRow],
}

/// One row of `activation_changes`: a name entering or leaving the
/// activation set at a refresh point (docs/audit.md).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct ChangeRow {
    /// The session.
    pub session_id: Uuid,
    /// The refresh point's seq.
    pub seq: i64,
    /// The refresh point's global position.
    pub position: i64,
    /// The refresh point's time.
    pub recorded_at: DateTime<Utc>,
    /// The deferred tool.
    pub tool: String,
    /// `added` or `removed`.
    pub change: String,
    /// For `added`: the evidence seq it entered with.
    pub evidence_seq: Option<i64>,
}

/// The refresh point an activation change is recorded at.
pub(crate) struct ChangeAt {
    session_id: Uuid,
    seq: i64,
    position: i64,
    recorded_at: DateTime<Utc>,
}

impl ChangeAt {
    /// Where `e` is.
    pub(crate) fn of(e: &StoredEvent) -> ChangeAt {
        ChangeAt {
            session_id: e.session_id,
            seq: e.seq,
            position: e.position,
            recorded_at: e.recorded_at,
        }
    }
}

/// The rows of `activation_changes` for one refresh point: the names of
/// `after` not in `before` (added) and of `before` not in `after`.
pub(crate) fn change_rows(
    refresh: &ChangeAt,
    before: &[Activation],
    after: &[Activation],
) -> Vec<ChangeRow> {
    let row = |a: &Activation, change: &str, evidence_seq| ChangeRow {
        session_id: refresh.session_id,
        seq: refresh.seq,
        position: refresh.position,
        recorded_at: refresh.recorded_at,
        tool: a.name.clone(),
        change: change.to_owned(),
        evidence_seq,
    };
    // Sets of names for large lists, not a scan of one list per name of
    // the other: a catalog of 40 000 names, all activated, made each
    // prompt compare 1.6 × 10^9 names under the write lock (10 s an
    // event, every other session's appends waiting). Small lists (an
    // agent's handful of deferred tools, at every prompt) keep the scan,
    // which allocates nothing.
    let large = before.len().saturating_mul(after.len()) > 256;
    fn names(list: &[Activation], large: bool) -> HashSet<&str> {
        match large {
            true => list.iter().map(|a| a.name.as_str()).collect(),
            false => HashSet::new(),
        }
    }
    let (before_names, after_names) = (names(before, large), names(after, large));
    let holds = |list: &[Activation], set: &HashSet<&str>, name: &str| match large {
        true => set.contains(name),
        false => list.iter().any(|a| a.name == name),
    };
    let mut rows: Vec<ChangeRow> = after
        .iter()
        .filter(|a| !holds(before, &before_names, &a.name))
        .map(|a| row(a, "added", Some(a.evidence_seq)))
        .chain(
            before
                .iter()
                .filter(|b| !holds(after, &after_names, &b.name))
                .map(|b| row(b, "removed", None)),
        )
        .collect();
    rows.sort_by(|a, b| a.tool.cmp(&b.tool));
    rows
}

/// One row of the calls index: call id, tool name, call seq, result seq.
pub(crate) type CallRow = (String, String, i64, Option<i64>);

/// Applies a written calls index row to rows read ahead, as the store's
/// upsert does in the database: a known call gets only its result seq.
pub(crate) fn upsert_call<K: Eq + std::hash::Hash>(
    rows: &mut HashMap<K, CallRow>,
    key: K,
    call: &CallRow,
) {
    match rows.get_mut(&key) {
        Some(known) => known.3 = call.3,
        None => {
            rows.insert(key, call.clone());
        }
    }
}

/// A materialized view as stored: the scalar columns plus JSON text for the
/// catalogs, the window's evidence and the activation set.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ViewRow {
    pub(crate) session_id: Uuid,
    pub(crate) refresh_seq: i64,
    pub(crate) mode: String,
    pub(crate) window_start: i64,
    pub(crate) compaction_seq: Option<i64>,
    pub(crate) summary: Option<String>,
    pub(crate) catalogs: String,
    pub(crate) evidence: String,
    pub(crate) active: String,
}

/// The columns of `session_views` after `session_id`, in table order, as
/// both backends select them.
pub(crate) type ViewColumns = (
    i64,
    String,
    i64,
    Option<i64>,
    Option<String>,
    String,
    String,
    String,
);

impl ViewRow {
    pub(crate) fn from_columns(session_id: Uuid, c: ViewColumns) -> ViewRow {
        ViewRow {
            session_id,
            refresh_seq: c.0,
            mode: c.1,
            window_start: c.2,
            compaction_seq: c.3,
            summary: c.4,
            catalogs: c.5,
            evidence: c.6,
            active: c.7,
        }
    }

    pub(crate) fn from_view(v: &View) -> ViewRow {
        ViewRow {
            session_id: v.session_id,
            refresh_seq: v.refresh_seq,
            mode: v.mode.clone(),
            window_start: v.window_start,
            compaction_seq: v.compaction.as_ref().map(|(_, s)| *s),
            summary: v.compaction.as_ref().map(|(s, _)| s.clone()),
            catalogs: serde_json::to_string(&v.catalogs).unwrap_or_default(),
            evidence: serde_json::to_string(&v.evidence).unwrap_or_default(),
            active: serde_json::to_string(&v.active).unwrap_or_default(),
        }
    }

    pub(crate) fn to_view(&self) -> Result<View> {
        let corrupt = |what: &str, e: serde_json::Error| {
            Error::Corrupt(format!(
                "the stored view of session {} has unreadable {what} ({e}); the log itself is not affected, and a rebuild (`Store::rebuild`, or `session-store rebuild {}`) recomputes the view from it",
                self.session_id, self.session_id
            ))
        };
        let active: Vec<ActiveJson> =
            serde_json::from_str(&self.active).map_err(|e| corrupt("active", e))?;
        Ok(View {
            session_id: self.session_id,
            refresh_seq: self.refresh_seq,
            mode: self.mode.clone(),
            window_start: self.window_start,
            compaction: match (&self.summary, self.compaction_seq) {
                (Some(s), Some(seq)) => Some((s.clone(), seq)),
                _ => None,
            },
            catalogs: serde_json::from_str(&self.catalogs).map_err(|e| corrupt("catalogs", e))?,
            evidence: serde_json::from_str(&self.evidence).map_err(|e| corrupt("evidence", e))?,
            active: active
                .into_iter()
                .map(|a| Activation {
                    name: a.name,
                    evidence_seq: a.evidence_seq,
                })
                .collect(),
        })
    }
}

#[derive(serde::Deserialize)]
struct ActiveJson {
    name: String,
    evidence_seq: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: impl Iterator<Item = usize>) -> Vec<Activation> {
        names
            .map(|i| Activation {
                name: format!("t{i:05}"),
                evidence_seq: i as i64,
            })
            .collect()
    }

    /// The scan (small sets) and the lookups (large ones) give the same
    /// rows: the names only after added, only before removed, in name
    /// order.
    #[test]
    fn changes_are_the_same_for_small_and_large_sets() {
        let at = ChangeAt {
            session_id: Uuid::nil(),
            seq: 9,
            position: 9,
            recorded_at: Utc::now(),
        };
        for n in [4, 40, 4_000] {
            let before = set((0..n).rev());
            let after = set(n / 2..n + n / 2);
            let rows = change_rows(&at, &before, &after);
            let added: Vec<&str> = rows
                .iter()
                .filter(|r| r.change == "added")
                .map(|r| r.tool.as_str())
                .collect();
            let removed: Vec<&str> = rows
                .iter()
                .filter(|r| r.change == "removed")
                .map(|r| r.tool.as_str())
                .collect();
            let want_added: Vec<String> = (n..n + n / 2).map(|i| format!("t{i:05}")).collect();
            let want_removed: Vec<String> = (0..n / 2).map(|i| format!("t{i:05}")).collect();
            assert_eq!(added, want_added, "n = {n}");
            assert_eq!(removed, want_removed, "n = {n}");
            assert!(rows.windows(2).all(|w| w[0].tool < w[1].tool), "n = {n}");
            assert!(rows
                .iter()
                .all(|r| (r.change == "added") == r.evidence_seq.is_some()));
        }
    }
}
