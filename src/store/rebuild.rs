//! `verify` and `rebuild`: a session's whole log folded again, page by
//! page, into what its derived rows (view, calls index, activation changes)
//! must hold, then compared with them or written over them; and the
//! backfill of activation changes for sessions stored before they existed.

use super::*;

/// How long back-to-back rebuilds of a SQLite store hold the file's write
/// lock before they let other processes have it for [`REBUILD_PAUSE`].
/// Each session is rebuilt in a transaction of its own, but the next one
/// takes the lock again at once, while another process's writer waits in
/// SQLite's busy handler, which sleeps between tries (up to 100 ms at a
/// time) and finds the lock free only by chance: a `rebuild` of 240 000
/// events answered other instances' appends with 503 after their 10 s busy
/// timeout (a review's finding; tests/storage.rs).
pub(super) const REBUILD_RUN: std::time::Duration = std::time::Duration::from_secs(1);

/// The lock left free after each [`REBUILD_RUN`]: longer than the busy
/// handler's longest sleep, so every waiting writer tries during it.
pub(super) const REBUILD_PAUSE: std::time::Duration = std::time::Duration::from_millis(150);

impl Store {
    /// Recomputes one session's view and calls index from the log and
    /// compares them with the stored ones: `Ok(None)` when they agree, else
    /// the first difference as a sentence.
    ///
    /// A row of the log or a stored view that cannot be read (edited
    /// around the store into something it never writes) is such a
    /// difference too, said as one (`verify`'s exit 5), not as the storage
    /// failing.
    pub async fn verify(&self, session_id: Uuid) -> Result<Option<String>> {
        let _long = self.long_read().await?;
        let verified = match &self.backend {
            Backend::Sqlite(b) => verify_in(b.begin_read().await?, session_id).await,
            Backend::Postgres(b) => verify_in(b.begin_read().await?, session_id).await,
        };
        match verified {
            Err(Error::Corrupt(why)) => Ok(Some(why)),
            other => other,
        }
    }

    /// Recomputes one session's view and calls index from the log, under
    /// the write lock, replacing what was stored.
    ///
    /// On SQLite, rebuilds called back to back (`rebuild` of every
    /// session) leave the file's write lock free for 150 ms after each
    /// second of them, so that other processes' appends get in: SQLite
    /// keeps no queue of the processes waiting for the lock.
    pub async fn rebuild(&self, session_id: Uuid) -> Result<()> {
        if matches!(self.backend, Backend::Sqlite(_)) && self.rebuild_due_pause() {
            tokio::time::sleep(REBUILD_PAUSE).await;
        }
        let rebuilt = self.rebuild_now(session_id).await;
        if let Some((_, ended)) = self
            .rebuilds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            *ended = std::time::Instant::now();
        }
        rebuilt
    }

    /// Whether this rebuild continues a run of them that has held SQLite's
    /// write lock for [`REBUILD_RUN`]; a new run starts after the pause,
    /// and after a rebuild that follows the last one by more than a pause
    /// (the lock was free meanwhile).
    fn rebuild_due_pause(&self) -> bool {
        let mut run = self.rebuilds.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        match *run {
            Some((started, ended)) if now.duration_since(ended) < REBUILD_PAUSE => {
                if now.duration_since(started) < REBUILD_RUN {
                    return false;
                }
                // The pause is taken now: the run after it starts then.
                *run = Some((now + REBUILD_PAUSE, now + REBUILD_PAUSE));
                true
            }
            _ => {
                *run = Some((now, now));
                false
            }
        }
    }

    async fn rebuild_now(&self, session_id: Uuid) -> Result<()> {
        // Holding the writer slot: no group of this process can put back
        // a state (and what its append knew about the old view) meanwhile.
        let _slot = self.writer.clone().lock_owned().await;
        self.forget(session_id);
        let rebuilt = match &self.backend {
            Backend::Sqlite(b) => rebuild_in(b.begin_write().await?, session_id).await,
            Backend::Postgres(b) => rebuild_in(b.begin_write().await?, session_id).await,
        };
        self.forget(session_id);
        rebuilt
    }
}

/// The whole log of one session folded page by page, for `verify` and
/// `rebuild`, which must see every call of the session without holding
/// them all: a call leaves memory once it is answered (handed out by
/// [`LogFold::next_calls`]), and only unanswered ones wait for the end.
/// (Holding the fold's full calls map took `verify` from 21 to 190 MiB on
/// a session of 10^6 events, docs/benchmarks.md item 19.)
struct LogFold {
    state: SessionState,
    /// The view at the latest refresh point, once the fold passed it.
    view: Option<View>,
    refresh: i64,
    head: i64,
    /// Calls not answered yet: id -> (tool, call seq).
    open: HashMap<String, (String, i64)>,
    /// The activation changes the log implies (the set at each refresh
    /// point against the one at the previous refresh point), computed in
    /// the same pass: a second fold of the log for them doubled the time
    /// of `verify` and `rebuild` (docs/benchmarks.md item 24).
    changes: Vec<ChangeRow>,
    /// The activation set at the last refresh point folded.
    before: Vec<Activation>,
    /// Whether no event since that refresh point could move the set
    /// (`append.rs`'s `unmoved`): the next prompt's set is `before`, not
    /// computed again (a session of 3 200 prompts with 10^5 active names
    /// spent minutes there, past PostgreSQL's idle-in-transaction timeout).
    unmoved: bool,
    /// The rows compactions keep from, looked up once each in a run.
    kept: super::read::KeptSeqs,
}

impl LogFold {
    async fn start<T: LogTx>(tx: &mut T, session_id: Uuid) -> Result<LogFold> {
        let head = tx.head_seq(session_id).await?;
        if head == 0 {
            return Err(Error::SessionNotFound(session_id));
        }
        let refresh = tx.last_refresh_seq(session_id).await?;
        Ok(LogFold {
            // The fold holds no rows: a session never compacted has its
            // whole log as its window (800 MB at 10^6 events before).
            state: SessionState::empty_without_rows(session_id),
            view: None,
            refresh,
            head,
            open: HashMap::new(),
            changes: Vec::new(),
            before: Vec::new(),
            unmoved: false,
            kept: Default::default(),
        })
    }

    /// Folds the next page; returns the calls index rows of the calls
    /// answered in it (in call seq order), or `None` once the log is folded.
    async fn next_calls<T: LogTx>(&mut self, tx: &mut T) -> Result<Option<Vec<CallRow>>> {
        let seq = self.state.seq;
        if seq >= self.head {
            return Ok(None);
        }
        // A page ends at the latest refresh point, where the view is taken.
        let stop = if seq < self.refresh {
            self.refresh
        } else {
            self.head
        };
        let page = fold_page(tx, self.state.session_id, seq, stop).await?;
        let mut answered = Vec::new();
        for e in page {
            match &e.body {
                EventBody::ToolCall {
                    call_id, tool_name, ..
                } => {
                    self.open
                        .insert(call_id.clone(), (tool_name.clone(), e.seq));
                }
                EventBody::ToolResult { call_id, .. } => {
                    if let Some((tool, call_seq)) = self.open.remove(call_id) {
                        answered.push((call_id.clone(), tool, call_seq, Some(e.seq)));
                    }
                }
                _ => {}
            }
            let kept = self.kept.of(tx, &e).await?;
            let refresh = e.body.is_refresh_point().then(|| ChangeAt::of(&e));
            self.unmoved &= e.body.leaves_activations_alone();
            self.state.apply_rowless(e, kept);
            if let Some(at) = refresh {
                debug_assert!(
                    !self.unmoved || self.before == self.state.activation_set(),
                    "an event the activation set was taken not to depend on moved it"
                );
                if !self.unmoved {
                    let now = self.state.activation_set();
                    self.changes.extend(change_rows(&at, &self.before, &now));
                    self.before = now;
                }
                self.unmoved = true;
            }
        }
        if self.refresh > 0 && self.state.seq == self.refresh {
            self.view = Some(self.state.view());
        }
        answered.sort_by_key(|r| r.2);
        Ok(Some(answered))
    }

    /// The view at the latest refresh point, the calls index rows of the
    /// calls never answered, and the activation changes.
    fn finish(self) -> (Option<View>, Vec<CallRow>, Vec<ChangeRow>) {
        let mut unanswered: Vec<CallRow> = self
            .open
            .into_iter()
            .map(|(id, (tool, seq))| (id, tool, seq, None))
            .collect();
        unanswered.sort_by_key(|r| r.2);
        (self.view, unanswered, self.changes)
    }
}

/// The first of `expected` (rows the log implies) that the calls index
/// does not hold as such, said as a sentence.
async fn calls_difference<T: LogTx>(
    tx: &mut T,
    session_id: Uuid,
    expected: &[CallRow],
) -> Result<Option<String>> {
    if expected.is_empty() {
        return Ok(None);
    }
    let ids: Vec<String> = expected.iter().map(|c| c.0.clone()).collect();
    let stored = tx.calls(session_id, &ids).await?;
    let stored: HashMap<&str, &CallRow> = stored.iter().map(|r| (r.0.as_str(), r)).collect();
    let said =
        |r: &CallRow| serde_json::json!({"tool_name": r.1, "call_seq": r.2, "result_seq": r.3});
    Ok(expected
        .iter()
        .find(|e| stored.get(e.0.as_str()) != Some(e))
        .map(|e| match stored.get(e.0.as_str()) {
            Some(row) => format!(
                "session {session_id}: the calls index differs from the log for call {}: the index says {}, the log says {}",
                serde_json::json!(e.0),
                said(row),
                said(e)
            ),
            None => format!(
                "session {session_id}: the calls index has no row for call {}, where the log says {}",
                serde_json::json!(e.0),
                said(e)
            ),
        }))
}

async fn verify_in<T: LogTx>(mut tx: T, session_id: Uuid) -> Result<Option<String>> {
    // The calls are compared page by page as the fold answers them; a
    // difference of the view or of the activation changes is still said
    // first.
    let mut fold = LogFold::start(&mut tx, session_id).await?;
    let mut calls_differ = None;
    while let Some(rows) = fold.next_calls(&mut tx).await? {
        if calls_differ.is_none() {
            calls_differ = calls_difference(&mut tx, session_id, &rows).await?;
        }
    }
    let (expected, unanswered, expected_changes) = fold.finish();
    if calls_differ.is_none() {
        calls_differ = calls_difference(&mut tx, session_id, &unanswered).await?;
    }
    let stored = match tx.load_view(session_id).await? {
        // Drift like any other: the log is intact, and a rebuild fixes it.
        Some(row) => match row.to_view() {
            Ok(view) => Some(view),
            Err(Error::Corrupt(why)) => return Ok(Some(why)),
            Err(e) => return Err(e),
        },
        None => None,
    };
    let difference = match (&stored, &expected) {
        (None, None) => None,
        (Some(s), None) => Some(format!(
            "session {session_id}: a view is stored at seq {} but the log has no refresh point",
            s.refresh_seq
        )),
        (None, Some(e)) => Some(format!(
            "session {session_id}: no view is stored, but the log's latest refresh point is seq {}",
            e.refresh_seq
        )),
        (Some(s), Some(e)) => first_view_difference(s, e)
            .map(|d| format!("session {session_id}: the stored view differs from the log: {d}")),
    };
    if difference.is_some() {
        return Ok(difference);
    }
    let stored_changes = tx.load_changes(session_id).await?;
    if expected_changes != stored_changes {
        let first = expected_changes
            .iter()
            .zip(stored_changes.iter())
            .position(|(e, s)| e != s)
            .unwrap_or(expected_changes.len().min(stored_changes.len()));
        let said = |c: &ChangeRow| format!("{} {} at seq {}", c.change, c.tool, c.seq);
        let shown = |rows: &[ChangeRow]| rows.get(first).map_or("nothing".to_owned(), said);
        // The same change, seq and tool on both sides: the field that
        // differs is named, or the sentence would say the same thing twice.
        if let (Some(s), Some(e)) = (stored_changes.get(first), expected_changes.get(first)) {
            use serde_json::json;
            let fields = [
                ("evidence_seq", json!(s.evidence_seq), json!(e.evidence_seq)),
                ("position", json!(s.position), json!(e.position)),
                ("recorded_at", json!(s.recorded_at), json!(e.recorded_at)),
                ("session_id", json!(s.session_id), json!(e.session_id)),
            ];
            let other = fields.into_iter().find(|(_, a, b)| a != b);
            if let (true, Some((field, a, b))) = (said(s) == said(e), other) {
                return Ok(Some(format!(
                    "session {session_id}: the activation changes differ from the log: change {} ({}) has `{field}` {a} in the index but {b} from the log",
                    first + 1,
                    said(e)
                )));
            }
        }
        return Ok(Some(format!(
            "session {session_id}: the activation changes differ from the log: change {} is {} in the index but {} from the log",
            first + 1,
            shown(&stored_changes),
            shown(&expected_changes)
        )));
    }
    Ok(calls_differ)
}

/// The first field where the stored view and the log's disagree, said in
/// JSON (the shape `activations --json` and the API use), not in Rust's
/// debug notation.
fn first_view_difference(stored: &View, expected: &View) -> Option<String> {
    use serde_json::json;
    let compaction = |v: &View| match &v.compaction {
        Some((summary, seq)) => json!({"seq": seq, "summary": summary}),
        None => serde_json::Value::Null,
    };
    let catalogs = |v: &View| {
        let sorted: std::collections::BTreeMap<_, _> = v
            .catalogs
            .iter()
            .map(|(mode, (tools, seq))| (mode, json!({"tools": tools, "seq": seq})))
            .collect();
        json!(sorted)
    };
    type Field = fn(&View) -> serde_json::Value;
    let fields: [(&str, Field); 7] = [
        ("refresh_seq", |v| json!(v.refresh_seq)),
        ("mode", |v| json!(v.mode)),
        ("window_start", |v| json!(v.window_start)),
        ("compaction", compaction),
        ("catalogs", catalogs),
        ("evidence", |v| json!(v.evidence)),
        ("active", |v| json!(v.active)),
    ];
    fields.iter().find_map(|(name, of)| {
        let (s, e) = (of(stored), of(expected));
        (s != e).then(|| format!("`{name}` is {s} in the view but {e} from the log"))
    })
}

async fn rebuild_in<T: LogTx>(mut tx: T, session_id: Uuid) -> Result<()> {
    rebuild_session(&mut tx, session_id).await?;
    tx.commit().await
}

/// Recomputes every derived row of a session (view, calls index,
/// activation changes) from its log, inside the caller's transaction.
async fn rebuild_session<T: LogTx>(tx: &mut T, session_id: Uuid) -> Result<()> {
    // The fold reads only the log: the derived rows are cleared first, and
    // the calls written as the fold answers them.
    let mut fold = LogFold::start(tx, session_id).await?;
    tx.clear_derived(session_id).await?;
    while let Some(rows) = fold.next_calls(tx).await? {
        if !rows.is_empty() {
            tx.record_calls(session_id, &rows).await?;
        }
    }
    let (view, unanswered, changes) = fold.finish();
    if !unanswered.is_empty() {
        tx.record_calls(session_id, &unanswered).await?;
    }
    if let Some(view) = &view {
        tx.write_view(&ViewRow::from_view(view)).await?;
    }
    tx.record_changes(&changes).await?;
    tx.changes_backfill_done(session_id).await
}

impl Store {
    /// Computes the activation changes of sessions written before
    /// migration 0005 (once, when a store is opened after it), a few
    /// sessions per write transaction.
    pub(super) async fn backfill_changes(&self) -> Result<()> {
        async fn batch<T: LogTx>(mut tx: T) -> Result<usize> {
            let pending = tx.changes_backfill_pending(20).await?;
            let started = std::time::Instant::now();
            let mut done = 0;
            for s in &pending {
                if started.elapsed() >= super::BACKFILL_TX_BUDGET {
                    break;
                }
                done += 1;
                // A listed session without events was listed behind the
                // store's back: taken off the list (folding it failed
                // every command's open, `verify` included, with "not
                // found").
                if tx.head_seq(*s).await? == 0 {
                    tracing::warn!(session = %s, "a session listed for its activation changes has no events: taken off the list");
                    tx.changes_backfill_done(*s).await?;
                    continue;
                }
                rebuild_session(&mut tx, *s).await?;
            }
            tx.commit().await?;
            Ok(done)
        }
        // Read first, as `backfill_chains` does: no write lock when nothing
        // is pending.
        let pending = match &self.backend {
            Backend::Sqlite(b) => b.begin_read().await?.changes_backfill_pending(1).await?,
            Backend::Postgres(b) => b.begin_read().await?.changes_backfill_pending(1).await?,
        };
        if pending.is_empty() {
            return Ok(());
        }
        let mut total = 0;
        loop {
            let n = match &self.backend {
                Backend::Sqlite(b) => batch(b.begin_write().await?).await?,
                Backend::Postgres(b) => batch(b.begin_write().await?).await?,
            };
            if n == 0 {
                break;
            }
            total += n;
            self.backfill_pause().await;
        }
        if total > 0 {
            tracing::info!(
                sessions = total,
                "computed the activation changes of sessions written before them"
            );
        }
        Ok(())
    }
}
