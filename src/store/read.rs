//! How a session's state is read inside one transaction: from its
//! materialized view and window (cost: the window), caught up page by page
//! over the events after it, or folded from seq 1 without the window's rows
//! for an answer from the log alone; and the streamed view-and-window read
//! that bounds a page in bytes.

use super::*;

/// The state of a session not in the cache: from its materialized view and
/// effective window when it has one (cost: the window, not the history),
/// else empty (the caller folds from seq 1); and the stored view it came
/// from.
pub(super) async fn cold_state<T: LogTx>(
    tx: &mut T,
    session_id: Uuid,
) -> Result<(SessionState, Option<ViewRow>)> {
    match tx.load_view(session_id).await? {
        Some(row) => {
            let view = row.to_view()?;
            let window = tx
                .range(
                    session_id,
                    view.window_start - 1,
                    view.refresh_seq,
                    usize::MAX,
                )
                .await?;
            Ok((SessionState::from_view(&view, &window), Some(row)))
        }
        None => Ok((SessionState::empty(session_id), None)),
    }
}

/// The next page of a fold reaching `upto`: events `after + 1 ..`, at most
/// [`FOLD_PAGE`] and none past `upto`; never empty (the log must have them).
pub(super) async fn fold_page<T: LogTx>(
    tx: &mut T,
    session_id: Uuid,
    after: i64,
    upto: i64,
) -> Result<Vec<StoredEvent>> {
    let page = tx
        .range(
            session_id,
            after,
            upto.min(after + FOLD_PAGE),
            FOLD_PAGE_BYTES,
        )
        .await?;
    if page.is_empty() {
        return Err(Error::Corrupt(format!(
            "session {session_id} has no event after seq {after} although it should reach seq {upto}"
        )));
    }
    Ok(page)
}

/// Folds the events after `state.seq` up to `upto`, a page at a time.
pub(super) async fn catch_up<T: LogTx>(
    tx: &mut T,
    mut state: SessionState,
    upto: i64,
) -> Result<SessionState> {
    while state.seq < upto {
        let page = fold_page(tx, state.session_id, state.seq, upto).await?;
        for e in &page {
            state.apply(e);
        }
    }
    Ok(state)
}

/// The state as of `at` (the head when `None`), read in one transaction so
/// the view, the window and the events after it agree. Without `rows`, a
/// rowless state ([`rowless_state`]).
pub(super) async fn read_state<T: LogTx>(
    mut tx: T,
    cached: Option<SessionState>,
    session_id: Uuid,
    at: Option<i64>,
    from_view: bool,
    rows: bool,
) -> Result<SessionState> {
    let latest = tx.head_seq(session_id).await?;
    if latest == 0 {
        return Err(Error::SessionNotFound(session_id));
    }
    let target = match at {
        None => latest,
        Some(n) if (1..=latest).contains(&n) => n,
        Some(n) => {
            return Err(Error::SeqOutOfRange {
                session_id,
                seq: n,
                latest,
            })
        }
    };
    if !rows {
        return rowless_state(
            &mut tx,
            cached,
            session_id,
            target,
            at.is_none() || from_view,
        )
        .await;
    }
    let state = match cached {
        Some(s) if s.seq <= target => s,
        // (A view past the target is dropped just below.)
        _ if at.is_none() || from_view => cold_state(&mut tx, session_id).await?.0,
        _ => SessionState::empty(session_id),
    };
    let state = if state.seq > target {
        SessionState::empty(session_id)
    } else {
        state
    };
    // A read never validates: the calls outside the window are forgotten
    // page by page, or a fold from seq 1 (`--at-seq`, a stream resuming)
    // would hold every call of the session.
    let mut state = state;
    while state.seq < target {
        for e in &fold_page(&mut tx, session_id, state.seq, target).await? {
            state.apply(e);
        }
        state.forget_calls_outside_window();
    }
    Ok(state)
}

/// The state after event `target` without the window's rows
/// ([`SessionState::is_rowless`]): what an activation set, a view or a
/// context's bounds need, read in pages of bounded bytes, so that no fold
/// holds a session that was never compacted (whose window is its whole
/// log: 708 MB for `activations --at-seq` at 10^6 events before,
/// docs/benchmarks.md item 22). From the view when `from_view` and the view
/// is at or before `target`, else from seq 1 (an answer from the log
/// alone). A cached state already at `target` is the answer as it is.
pub(super) async fn rowless_state<T: LogTx>(
    tx: &mut T,
    cached: Option<SessionState>,
    session_id: Uuid,
    target: i64,
    from_view: bool,
) -> Result<SessionState> {
    if let Some(state) = cached.filter(|s| s.seq == target) {
        return Ok(state);
    }
    let view = match from_view {
        true => tx.load_view(session_id).await?,
        false => None,
    };
    let mut state = match view {
        Some(row) if row.refresh_seq <= target => {
            SessionState::from_view_without_rows(&row.to_view()?)
        }
        _ => SessionState::empty_without_rows(session_id),
    };
    let mut kept = KeptSeqs::default();
    while state.seq < target {
        for e in fold_page(tx, session_id, state.seq, target).await? {
            let kept = kept.of(tx, &e).await?;
            state.apply_rowless(e, kept);
        }
    }
    Ok(state)
}

/// [`kept_seq`] for a fold, which remembers its last answer: compactions
/// that keep from the same row (each keeping the whole window again) made
/// one lookup each, on PostgreSQL a round trip each (4 000 for a cold read
/// of a session of 4 000 such compactions, a review's finding).
#[derive(Default)]
pub(super) struct KeptSeqs {
    last: Option<(Uuid, Option<i64>)>,
}

impl KeptSeqs {
    pub(super) async fn of<T: LogTx>(
        &mut self,
        tx: &mut T,
        event: &StoredEvent,
    ) -> Result<Option<i64>> {
        let EventBody::Compaction {
            first_kept_event_id: Some(id),
            ..
        } = &event.body
        else {
            return Ok(None);
        };
        if let Some((last, seq)) = self.last {
            if last == *id {
                return Ok(seq);
            }
        }
        let seq = kept_seq(tx, event).await?;
        self.last = Some((*id, seq));
        Ok(seq)
    }
}

/// The seq of the row a compaction keeps from, looked up in the log (a
/// rowless state does not hold it); `None` for any other event, or a
/// compaction that keeps nothing.
pub(super) async fn kept_seq<T: LogTx>(tx: &mut T, event: &StoredEvent) -> Result<Option<i64>> {
    let EventBody::Compaction {
        first_kept_event_id: Some(id),
        ..
    } = &event.body
    else {
        return Ok(None);
    };
    Ok(tx
        .stored_by_ids(&[*id])
        .await?
        .into_iter()
        .find(|kept| kept.session_id == event.session_id)
        .map(|kept| kept.seq))
}

/// The rows of a view-and-window read (`view_and_window` of each backend)
/// as they stream in: the view, then the events from the window's start
/// (or from after the view, for a window longer than `max_window`). The
/// events after the view stop at `max_bytes` of payloads, so a run of
/// large events after the last prompt is not read whole (2 000 events of
/// 100 KB took 411 MB); the window comes whole for a caller that needs its
/// rows, and counts toward the bound for one that does not. A page is
/// cut only when the rows come as the statement orders them (the view,
/// then the first event expected and each next seq), which every plan
/// here does; out of order, every row is read, as before.
#[derive(Clone)]
pub(crate) struct WindowRead {
    max_window: i64,
    /// Whether the window's payloads count too (a caller that needs no
    /// rows, which then reads the events after the view page by page).
    window_too: bool,
    max_bytes: usize,
    pub(crate) view: Option<ViewRow>,
    pub(crate) events: Vec<StoredEvent>,
    bytes: usize,
    last_seq: Option<i64>,
    in_order: bool,
    /// Whether reading stopped at `max_bytes` (more may follow).
    pub(crate) cut: bool,
}

impl WindowRead {
    pub(crate) fn new(max_window: i64, window_too: bool, max_bytes: usize) -> WindowRead {
        WindowRead {
            max_window,
            window_too,
            max_bytes,
            view: None,
            events: Vec::new(),
            bytes: 0,
            last_seq: None,
            in_order: true,
            cut: false,
        }
    }

    /// The longest window the read includes (a longer one is left out).
    pub(crate) fn max_window(&self) -> i64 {
        self.max_window
    }

    /// Whether the window's payloads count toward the bound.
    pub(crate) fn window_too(&self) -> bool {
        self.window_too
    }

    /// The bound, in bytes of payloads.
    pub(crate) fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Counts the next event row, at `seq` with a payload of `len` bytes;
    /// false once the page is cut there (keep this row, read no more).
    /// The backend keeps the rows and decodes them after the statement
    /// (decoding each as it came held the driver's thread back: the
    /// SQLite pre-request read was 12 % slower).
    pub(crate) fn admit(&mut self, seq: i64, len: usize) -> bool {
        let Some(view) = &self.view else {
            self.in_order = false;
            return true;
        };
        let expected = match self.last_seq {
            Some(last) => last + 1,
            None if view.refresh_seq - view.window_start + 1 > self.max_window => {
                view.refresh_seq + 1
            }
            None => view.window_start,
        };
        self.last_seq = Some(seq);
        self.in_order &= seq == expected;
        if self.window_too || seq > view.refresh_seq {
            self.bytes += len;
        }
        if self.in_order && self.bytes >= self.max_bytes {
            self.cut = true;
        }
        !self.cut
    }
}

/// Decodes rows one at a time until their payloads reach `max_bytes` (the
/// row that reaches it included) or the rows end: `history_within`.
pub(crate) async fn take_within<R, T>(
    rows: &mut (impl tokio_stream::Stream<Item = std::result::Result<R, sqlx::Error>> + Unpin),
    max_bytes: usize,
    payload_len: impl Fn(&R) -> usize,
    decode: impl Fn(R) -> Result<T>,
) -> Result<Vec<T>> {
    Ok(take_within_cut(rows, max_bytes, payload_len, decode)
        .await?
        .0)
}

/// [`take_within`], also saying whether the bytes stopped it (true when
/// the row that reached `max_bytes` was read, whether or not others
/// followed): a page whose reader must say "more may follow".
pub(crate) async fn take_within_cut<R, T>(
    rows: &mut (impl tokio_stream::Stream<Item = std::result::Result<R, sqlx::Error>> + Unpin),
    max_bytes: usize,
    payload_len: impl Fn(&R) -> usize,
    decode: impl Fn(R) -> Result<T>,
) -> Result<(Vec<T>, bool)> {
    use tokio_stream::StreamExt;
    let mut page = Vec::new();
    let mut bytes = 0usize;
    while let Some(row) = rows.next().await {
        let row = row.map_err(Error::from_sqlx)?;
        bytes = bytes.saturating_add(payload_len(&row));
        page.push(decode(row)?);
        if bytes >= max_bytes {
            return Ok((page, true));
        }
    }
    Ok((page, false))
}
