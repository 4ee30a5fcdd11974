//! The judgement of one batch and its write into an open write
//! transaction (SEMANTICS §2 and §4), written once against [`LogTx`] for
//! both backends; `group` decides which transaction and when it commits.

use super::*;

/// Rejects a batch that names one `event_id` twice.
fn check_batch_ids(events: &[NewEvent]) -> Result<()> {
    let mut seen = HashSet::new();
    for (i, e) in events.iter().enumerate() {
        if let Some(id) = e.event_id {
            if !seen.insert(id) {
                return Err(ValidationError::new(
                    Rule::DuplicateEventIdInBatch,
                    Some("event_id"),
                    format!("`event_id` {id} appears twice in the batch"),
                )
                .at_index(i)
                .into());
            }
        }
    }
    Ok(())
}

/// Judges one batch and, if it is accepted, writes it into the open write
/// transaction `tx` (the caller commits; see `group`). Nothing is written
/// until the whole batch is accepted, so a rejected batch leaves `tx` as it
/// was and the group's other appends go on; except in a transaction that
/// takes rows ahead ([`LogTx::rows_ahead`]), which any refusal abandons
/// whole.
pub(crate) async fn append_in<T: LogTx>(
    tx: &mut T,
    cached: &mut Option<Warm>,
    p: &group::Pending,
    options: &StoreOptions,
) -> std::result::Result<AppendOutcome, group::Failed> {
    let mut wrote = false;
    judge_and_write(
        tx,
        cached,
        p.tenant.as_deref(),
        p.session_id,
        p.expected_seq,
        &p.events,
        p.invalid_tail.as_ref(),
        options,
        &mut wrote,
    )
    .await
    .map_err(|error| {
        let mut failed = group::Failed::from(error);
        failed.broken |= wrote;
        failed
    })
}

/// The body of [`append_in`] (see the module docs for the order in which a
/// batch is judged); sets `wrote` before its first write.
#[allow(clippy::too_many_arguments)]
async fn judge_and_write<T: LogTx>(
    tx: &mut T,
    cached: &mut Option<Warm>,
    tenant: Option<&str>,
    session_id: Uuid,
    expected_seq: Option<i64>,
    events: &[NewEvent],
    invalid_tail: Option<&ValidationError>,
    options: &StoreOptions,
    wrote: &mut bool,
) -> Result<AppendOutcome> {
    // 0. Tenant isolation: another tenant's session does not exist for
    // this caller, whatever else the batch says.
    let mut creates_for = None;
    let mut owner = None;
    if let Some(tenant) = tenant {
        if tx.head_seq(session_id).await? > 0 {
            let stored = tx.session_owner(session_id).await?;
            let stored = stored.unwrap_or_else(|| DEFAULT_TENANT.to_owned());
            if stored != tenant {
                return Err(Error::SessionNotFound(session_id));
            }
            owner = Some(stored);
        } else {
            creates_for = Some(tenant);
            owner = Some(tenant.to_owned());
        }
    }

    // 1. Idempotent retry (the head, for step 2, is read in the same
    // statement where the backend can). An `event_id` named twice in the
    // batch is refused first (§2 lists it with the retry check's
    // refusals), after the tenant: another tenant's session is not found,
    // whatever the batch holds.
    check_batch_ids(events)?;
    let ids: Vec<Uuid> = events.iter().filter_map(|e| e.event_id).collect();
    let (stored, head, head_hash) = tx.judge_reads(session_id, &ids).await?;
    if !stored.is_empty() {
        let by_id: HashMap<Uuid, &StoredEvent> = stored.iter().map(|e| (e.event_id, e)).collect();
        for (i, e) in events.iter().enumerate() {
            let Some(prior) = e.event_id.and_then(|id| by_id.get(&id)) else {
                continue;
            };
            if prior.session_id != session_id {
                return Err(event_id_reused(prior.event_id).at_index(i).into());
            }
            if !prior.body.same_content(&e.body) {
                let reused = super::event_id_reused_here(prior.event_id, prior.seq);
                return Err(reused.at_index(i).into());
            }
        }
        let answer: Vec<Appended> = events
            .iter()
            .filter_map(|e| e.event_id.and_then(|id| by_id.get(&id)))
            .map(|p| Appended {
                event_id: p.event_id,
                seq: p.seq,
                position: p.position,
            })
            .collect();
        if let Some(invalid) = invalid_tail {
            // A batch with an event that could not be read is never all
            // stored: partly stored, said at the unreadable event (its
            // line, its index), since the events after it were not read.
            let mut refused = ValidationError::new(
                Rule::PartlyStoredBatch,
                Some("event_id"),
                format!(
                    "this event is not valid ({}), and {} of the {} events before it {} already stored; send only the events not stored yet",
                    invalid.message,
                    answer.len(),
                    events.len(),
                    if answer.len() == 1 { "is" } else { "are" },
                ),
            );
            refused.index = invalid.index;
            return Err(refused.into());
        }
        let all_stored = events
            .iter()
            .all(|e| e.event_id.is_some_and(|id| by_id.contains_key(&id)));
        let in_order = answer.windows(2).all(|w| w[0].seq < w[1].seq);
        if all_stored && in_order {
            debug!(session = %session_id, "idempotent retry answered from the log");
            return Ok(AppendOutcome {
                events: answer,
                replayed: true,
                confirmed_on_retry: false,
            });
        }
        // Said at the first stored event (its index, so its line on the
        // command line), with its seq: the writer knows where the stored
        // part is, and that only the events not stored are to be sent.
        let (first, first_seq) = events
            .iter()
            .enumerate()
            .find_map(|(i, e)| Some((i, by_id.get(&e.event_id?)?.seq)))
            .unwrap_or((0, 0));
        let message = if all_stored {
            "every event of the batch is already stored, but in another order".to_owned()
        } else {
            format!(
                "{} of the batch's {} events {} already stored, this one first (as seq {first_seq}); retry exactly the batch that was sent, or only the events not stored",
                answer.len(),
                events.len(),
                if answer.len() == 1 { "is" } else { "are" },
            )
        };
        let mut refused = ValidationError::new(Rule::PartlyStoredBatch, Some("event_id"), message);
        refused.index = Some(first);
        return Err(refused.into());
    }

    // 2. Expected seq.
    if let Some(expected) = expected_seq.filter(|e| *e != head) {
        return Err(Error::Conflict {
            session_id,
            expected,
            current: head,
        });
    }
    // Seqs are counted in i64: one near its end was written around the
    // store (a hand-edited row), and is said, not overflowed. (Positions
    // are checked where they are reserved, `LogTx::reserve_positions`.)
    no_room_after(head, events.len(), "seq of the session")?;
    if events.is_empty() {
        return match invalid_tail {
            Some(invalid) => Err(invalid.clone().into()),
            None => Ok(AppendOutcome {
                events: Vec::new(),
                replayed: false,
                confirmed_on_retry: false,
            }),
        };
    }

    // 3. Catch the session state up to the head, then validate. The state
    // is taken: whatever fails from here leaves the cache without it (it
    // may hold part of the batch).
    // What an earlier append of this process knew holds only if nobody
    // appended since. `stored_view`: the stored view as of the head, `None`
    // while unknown.
    let (state, mut stored_view) = match cached.take() {
        Some(w) if w.state.seq <= head => {
            let known = w.known.filter(|_| w.state.seq == head);
            if let Some(k) = &known {
                owner = owner.or_else(|| k.owner.clone());
            }
            (w.state, known.map(|k| k.view))
        }
        _ => {
            let (state, view) = cold_state(tx, session_id).await?;
            (state, Some(view))
        }
    };
    let mut state = catch_up(tx, state, head).await?;
    prefetch_calls(tx, &mut state, events).await?;
    let mut prev_hash = chain::head_hash(tx, session_id, head, head_hash).await?;
    let now = Utc::now().trunc_subsecs(6);
    let mut rows = Vec::with_capacity(events.len());
    // The calls index rows this batch writes, one per call id.
    let mut calls: Vec<CallRow> = Vec::new();
    let mut call_index: HashMap<&str, usize> = HashMap::new();
    let mut last_view = None;
    // The activation set at the previous refresh point, read only when the
    // batch has a refresh point (activation_changes are diffs against it).
    let mut previous_active: Option<Vec<Activation>> = None;
    // Whether every event since the batch's previous refresh point left the
    // activation set as it was: SEMANTICS §7 computes it from the mode,
    // its catalog and the successful results in the effective context, so
    // prompts, assistant messages and calls do not move it. A prompt then
    // takes the previous set instead of computing it again: with a large
    // catalog all active (10^5 names) each prompt of a batch cost 14-28 ms
    // of set building under the process's writer slot, and a batch of 800
    // prompts held every other session's appends for 13 s (a review's
    // finding).
    let mut unmoved = false;
    let mut changes: Vec<ChangeRow> = Vec::new();
    // Only the batch's last refresh point writes the view; the ones before
    // it need just their activation sets, for the changes.
    let last_refresh = events.iter().rposition(|e| e.body.is_refresh_point());
    // The stored view the first refresh point diffs against, read before
    // the judgement so that the judgement itself makes no statement (and
    // can run while rows sent ahead are written).
    if last_refresh.is_some() && stored_view.is_none() {
        stored_view = Some(tx.load_view(session_id).await?);
    }
    // A transaction that takes rows ahead of their batch's acceptance gets
    // them while the rest of the batch is judged (docs/design.md, "Rows
    // sent ahead"); their positions are reserved first.
    let ahead = tx.rows_ahead();
    let reserved = match ahead {
        Some(_) => Some(tx.reserve_positions(events.len() as i64).await?),
        None => None,
    };
    let mut judge = |i: usize, rows: &mut Vec<PendingRow>| -> Result<()> {
        let e = &events[i];
        let payload = e.body.to_json_text();
        crate::validate::check_new_event(&state, e, payload.len(), options.max_event_bytes)
            .map_err(|err| err.at_index(i))?;
        let stored = StoredEvent {
            session_id,
            seq: head + 1 + i as i64,
            event_id: e.event_id.unwrap_or_else(Uuid::now_v7),
            // Positions are reserved once the batch is accepted (below),
            // or before the judgement when rows go ahead.
            position: reserved.map_or(0, |first| first + i as i64),
            recorded_at: e.recorded_at.map(|t| t.trunc_subsecs(6)).unwrap_or(now),
            body: e.body.clone(),
        };
        prev_hash = crate::integrity::event_hash_of(&stored, &payload, &prev_hash);
        let refresh = ChangeAt::of(&stored);
        unmoved &= e.body.leaves_activations_alone();
        let row = PendingRow {
            position: stored.position,
            session_id,
            seq: stored.seq,
            event_id: stored.event_id,
            type_name: e.body.type_name(),
            payload,
            recorded_at: stored.recorded_at,
            hash: prev_hash.clone(),
        };
        state.apply_owned(stored);
        match &e.body {
            EventBody::ToolCall {
                call_id, tool_name, ..
            } => {
                call_index.insert(call_id, calls.len());
                calls.push((call_id.clone(), tool_name.clone(), row.seq, None));
            }
            EventBody::ToolResult {
                call_id, tool_name, ..
            } => match call_index.get(call_id.as_str()) {
                Some(&i) => calls[i].3 = Some(row.seq),
                None => {
                    // Validation found the call in the state (loaded by
                    // `prefetch_calls` when it was not there).
                    let call_seq = state.calls.get(call_id).map(|c| c.seq).unwrap_or(0);
                    call_index.insert(call_id, calls.len());
                    calls.push((call_id.clone(), tool_name.clone(), call_seq, Some(row.seq)));
                }
            },
            body if body.is_refresh_point() => {
                let view = (last_refresh == Some(i)).then(|| state.view());
                let same = unmoved && previous_active.is_some();
                let active = match (&view, same) {
                    (Some(v), _) => v.active.clone(),
                    (None, true) => previous_active.clone().unwrap_or_default(),
                    (None, false) => state.activation_set(),
                };
                debug_assert!(
                    !same || previous_active.as_ref() == Some(&state.activation_set()),
                    "an event the activation set was taken not to depend on moved it"
                );
                let before = match previous_active.take() {
                    Some(a) => a,
                    // Read before the judgement (above).
                    None => match stored_view.as_ref().and_then(Option::as_ref) {
                        Some(v) => v.to_view()?.active,
                        None => Vec::new(),
                    },
                };
                if !same {
                    changes.extend(change_rows(&refresh, &before, &active));
                }
                previous_active = Some(active);
                unmoved = true;
                if view.is_some() {
                    last_view = view;
                }
            }
            _ => {}
        }
        rows.push(row);
        Ok(())
    };
    match ahead {
        None => {
            for i in 0..events.len() {
                judge(i, &mut rows)?;
            }
        }
        Some(step) => {
            // Whenever `step` rows wait (this batch's judged ones, and the
            // group's earlier batches'), they are sent, and the next
            // `step` events judged while the database writes them.
            let mut sent = 0;
            let mut i = 0;
            while i < events.len() {
                let end = (i + step).min(events.len());
                let mut fresh = Vec::with_capacity(end - i);
                if rows.len() - sent + tx.rows_waiting() >= step {
                    *wrote = true;
                    let mut send = std::pin::pin!(tx.send_ahead(&rows[sent..]));
                    // One poll hands the rows to the database's thread.
                    let first =
                        std::future::poll_fn(|cx| Poll::Ready(send.as_mut().poll(cx))).await;
                    let judged = (i..end).try_for_each(|j| judge(j, &mut fresh));
                    match first {
                        Poll::Ready(written) => written?,
                        Poll::Pending => send.await?,
                    }
                    judged?;
                    sent = rows.len();
                } else {
                    (i..end).try_for_each(|j| judge(j, &mut fresh))?;
                }
                rows.extend(fresh);
                i = end;
            }
        }
    }
    // Every event before an unreadable one passed: the batch is refused
    // for that one.
    if let Some(invalid) = invalid_tail {
        return Err(invalid.clone().into());
    }
    // Accepted: reserve positions (a rejected batch must not take any, or
    // the global order would have holes) and write.
    *wrote = true;
    let first_position = match reserved {
        Some(first) => first,
        None => tx.reserve_positions(events.len() as i64).await?,
    };
    for (i, row) in rows.iter_mut().enumerate() {
        row.position = first_position + i as i64;
    }
    for r in state.rows.iter_mut().rev().take_while(|r| r.seq > head) {
        r.position = first_position + (r.seq - head - 1);
    }
    for c in &mut changes {
        c.position = first_position + (c.seq - head - 1);
    }
    let view = last_view.as_ref().map(ViewRow::from_view);
    if view.is_none() && stored_view.is_none() {
        // Read before the write: after it, a backend would have to send
        // the write first.
        stored_view = Some(tx.load_view(session_id).await?);
    }
    tx.write_accepted(Accepted {
        session_id,
        rows: &rows,
        calls: &calls,
        view: view.as_ref(),
        claim_for: creates_for,
        seq: head + events.len() as i64,
        changes: &changes,
    })
    .await?;
    let appended = rows
        .iter()
        .map(|r| Appended {
            event_id: r.event_id,
            seq: r.seq,
            position: r.position,
        })
        .collect();
    let known = Known {
        head_hash: prev_hash,
        view: view.or_else(|| stored_view.flatten()),
        owner,
    };
    *cached = Some(Warm {
        state,
        known: Some(known),
    });
    Ok(AppendOutcome {
        events: appended,
        replayed: false,
        confirmed_on_retry: false,
    })
}

/// Loads from the calls index the calls that validating `events` may need
/// and that `state` does not know: those the batch names, and those of the
/// window's results (a compaction check needs their seqs).
async fn prefetch_calls<T: LogTx>(
    tx: &mut T,
    state: &mut SessionState,
    events: &[NewEvent],
) -> Result<()> {
    let mut wanted: Vec<String> = Vec::new();
    // Asked once each; a set, not `wanted.contains`, which made a batch
    // of n calls cost n² string comparisons (a 100 000-event pi import
    // spent two thirds of its time there).
    let mut asked: HashSet<String> = HashSet::new();
    // A call id holding U+0000 is never stored (validation refuses it),
    // and PostgreSQL would fail the read, with the group, on it.
    let mut add = |id: &String, state: &SessionState| {
        if !id.contains('\0') && !state.calls.contains_key(id) && !asked.contains(id) {
            asked.insert(id.clone());
            wanted.push(id.clone());
        }
    };
    for e in events {
        if let EventBody::ToolCall { call_id, .. } | EventBody::ToolResult { call_id, .. } = &e.body
        {
            add(call_id, state);
        }
        if matches!(e.body, EventBody::Compaction { .. }) {
            for row in &state.rows {
                if let EventBody::ToolResult { call_id, .. } = &row.body {
                    add(call_id, state);
                }
            }
        }
    }
    if wanted.is_empty() {
        return Ok(());
    }
    for (call_id, tool_name, seq, result_seq) in tx.calls(state.session_id, &wanted).await? {
        state.calls.insert(
            call_id,
            crate::projector::CallInfo {
                tool_name,
                seq,
                result_seq,
            },
        );
    }
    Ok(())
}

/// Refuses to count `n` more after `last` (a seq or a position) when that
/// passes `i64::MAX`: the store never hands out such a number, so the row
/// that holds `last` was written around it, and the log is said corrupt
/// rather than overflowed (a panic in a debug build, a wrap to negative
/// positions that no feed or cursor returns in a release build).
pub(crate) fn no_room_after(last: i64, n: usize, what: &str) -> Result<()> {
    match i64::try_from(n).ok().and_then(|n| last.checked_add(n)) {
        Some(_) => Ok(()),
        None => Err(Error::Corrupt(format!(
            "the latest {what} is {last}, which leaves no room for {n} more: a row was written around the store"
        ))),
    }
}
