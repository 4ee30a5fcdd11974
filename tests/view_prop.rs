//! SEMANTICS §8 as a property, on both backends: for random valid logs
//! appended in random batches, the incrementally maintained view equals a
//! rebuild from the log at every refresh point, and every latest-state
//! answer served through the view equals the plain fold of the log.

mod common;

use common::gen::{valid_log, Rng};
use proptest::prelude::*;
use session_store::store::{PAGE_BYTES, ROWLESS_WINDOW};
use session_store::{NewEvent, SessionState, Store, StoreOptions};
use uuid::Uuid;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn check_log(url: &str, seed: u64, len: usize) -> Result<(), TestCaseError> {
    let session = Uuid::new_v4();
    let events = valid_log(seed, session, len);
    let writer = Store::open(url).await.unwrap();
    // A reader that stays open, answering from the view alone: it keeps
    // its rowless state and applies each batch's events to it.
    let kept = rowless_store(url).await;
    // A reader whose cache is warm from the batch before: the writer's
    // appends since must show in its latest context and activation set.
    let warm = Store::open(url).await.unwrap();
    let mut rng = Rng::new(seed ^ 0xabcdef);
    let mut done = 0;
    while done < events.len() {
        let n = 1 + rng.below(6);
        let batch: Vec<NewEvent> = events[done..(done + n).min(events.len())]
            .iter()
            .map(|e| NewEvent::new(e.body.clone()).with_id(e.event_id))
            .collect();
        let k = batch.len();
        writer.append(session, done as i64, batch).await.unwrap();
        done += k;
        // The view after this batch equals a rebuild from the log.
        prop_assert_eq!(
            writer.verify(session).await.unwrap(),
            None,
            "after {} events",
            done
        );
        // A fresh store (no cache: view + window + tail) answers as the fold.
        let reader = Store::open(url).await.unwrap();
        let expected = SessionState::fold(session, &events[..done]);
        prop_assert_eq!(
            reader.activations(session, None).await.unwrap(),
            expected.activations()
        );
        prop_assert_eq!(
            reader.context(session, None).await.unwrap(),
            expected.context()
        );
        let r = reader.recover(session).await.unwrap();
        prop_assert_eq!(r.latest_seq, done as i64);
        prop_assert_eq!(r.context_start_seq, expected.window_start);
        prop_assert_eq!(&r.catalog, &expected.current_catalog().to_vec());
        reader.close().await;
        prop_assert_eq!(
            warm.context(session, None).await.unwrap(),
            expected.context(),
            "a warm reader's context after {} events",
            done
        );
        prop_assert_eq!(
            warm.activations(session, None).await.unwrap(),
            expected.activations()
        );
        // One that reads no window (as for a never-compacted session's
        // long one): the view's evidence and the events after it.
        let rowless = rowless_store(url).await;
        prop_assert_eq!(
            rowless.activations(session, None).await.unwrap(),
            expected.activations()
        );
        prop_assert_eq!(&rowless.recover(session).await.unwrap(), &r);
        rowless.close().await;
        prop_assert_eq!(
            kept.activations(session, None).await.unwrap(),
            expected.activations()
        );
        prop_assert_eq!(&kept.recover(session).await.unwrap(), &r);
        // One whose cold read stops after the first event's bytes (as for
        // events of megabytes after the last prompt): the activation set
        // and recovery go on page by page, the context through the
        // transactional path.
        let cut = Store::open_with(
            url,
            StoreOptions {
                window_read_bytes: 1,
                ..StoreOptions::default()
            },
        )
        .await
        .unwrap();
        prop_assert_eq!(
            cut.activations(session, None).await.unwrap(),
            expected.activations()
        );
        prop_assert_eq!(&cut.recover(session).await.unwrap(), &r);
        cut.clear_cache();
        prop_assert_eq!(
            context_of_pages(&cut, session, None).await,
            expected.context()
        );
        cut.clear_cache();
        prop_assert_eq!(
            cut.context(session, None).await.unwrap(),
            expected.context()
        );
        cut.close().await;
    }
    // As of every seq, from the log alone: the activation set, and the
    // context whole (a short window) or in pages (any window with
    // `rowless_window` 0), equal the fold of that prefix.
    let paged = rowless_store(url).await;
    for n in 1..=events.len() {
        let expected = SessionState::fold(session, &events[..n]);
        let at = Some(n as i64);
        prop_assert_eq!(
            writer.activations(session, at).await.unwrap(),
            expected.activations(),
            "activations at seq {}",
            n
        );
        for store in [&writer, &paged] {
            prop_assert_eq!(
                context_of_pages(store, session, at).await,
                expected.context(),
                "context at seq {}",
                n
            );
        }
    }
    paged.close().await;
    kept.close().await;
    warm.close().await;
    // Rebuilding changes nothing that verify can see.
    writer.rebuild(session).await.unwrap();
    prop_assert_eq!(writer.verify(session).await.unwrap(), None);
    writer.close().await;
    Ok(())
}

/// A store that reads no window, answering from the view's evidence and
/// the events after it (as for a never-compacted session's long window),
/// and pages every context.
async fn rowless_store(url: &str) -> Store {
    let options = StoreOptions {
        rowless_window: 0,
        ..StoreOptions::default()
    };
    Store::open_with(url, options).await.unwrap()
}

/// [`Store::context_paged`]'s answer with its pages' rows put in.
async fn context_of_pages(store: &Store, session: Uuid, at: Option<i64>) -> session_store::Context {
    let (mut ctx, pages) = store.context_paged(session, at).await.unwrap();
    if let Some(mut pages) = pages {
        assert!(ctx.rows.is_empty(), "a paged context comes without rows");
        while let Some(page) = pages.next_page(store).await.unwrap() {
            ctx.rows.extend(page);
        }
    }
    ctx
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn sqlite_view_equals_rebuild_at_every_refresh_point(seed in any::<u64>(), len in 1usize..70) {
        let db = common::sqlite_db();
        runtime().block_on(check_log(&db.url, seed, len))?;
    }

    #[test]
    fn postgres_view_equals_rebuild_at_every_refresh_point(seed in any::<u64>(), len in 1usize..70) {
        let Some(db) = common::postgres_db() else { return Ok(()); };
        runtime().block_on(check_log(&db.url, seed, len))?;
    }
}

#[test]
fn generated_logs_exercise_every_event_type() {
    let mut seen = std::collections::BTreeMap::new();
    let mut kept_compactions = 0;
    for seed in 0..20 {
        for e in valid_log(seed, Uuid::new_v4(), 60) {
            *seen.entry(e.body.type_name()).or_insert(0) += 1;
            if let session_store::EventBody::Compaction {
                first_kept_event_id: Some(_),
                ..
            } = e.body
            {
                kept_compactions += 1;
            }
        }
    }
    assert_eq!(seen.len(), 8, "{seen:?}");
    assert!(
        kept_compactions > 5,
        "{kept_compactions} compactions keep rows: {seen:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// The evidence a state keeps as rows come (and rebuilds at a
    /// compaction) is, after every event, what a scan of its window gives
    /// (§7: each name's largest effective evidence seq), for states folded
    /// whole, shed row by row, or shed at once.
    #[test]
    fn kept_evidence_equals_a_scan_of_the_window(seed in any::<u64>(), len in 1usize..120) {
        let session = Uuid::new_v4();
        let events = valid_log(seed, session, len);
        let mut whole = SessionState::empty(session);
        let mut shed = SessionState::empty(session);
        for e in &events {
            whole.apply(e);
            shed.apply_shed(e.clone());
            let mut scan = std::collections::BTreeMap::new();
            for row in &whole.rows {
                for name in row.body.evidence() {
                    scan.insert(name.to_owned(), row.seq);
                }
            }
            prop_assert_eq!(whole.evidence(), &scan, "at seq {}", e.seq);
            prop_assert_eq!(shed.evidence(), &scan, "shed, at seq {}", e.seq);
            let mut at_once = whole.clone();
            at_once.shed_payloads();
            prop_assert_eq!(at_once.activation_set(), whole.activation_set());
        }
    }
}

/// A fresh store's cold `activations` and `recover` of `session` equal the
/// fold of its log; answers the length of the fold's window.
async fn answers_from_the_view_match_the_fold(url: &str, session: Uuid, what: &str) -> i64 {
    let store = Store::open(url).await.unwrap();
    let all = store.history(session, 0, 100_000).await.unwrap();
    let expected = SessionState::fold(session, &all);
    assert_eq!(
        store.activations(session, None).await.unwrap(),
        expected.activations(),
        "{what}"
    );
    store.clear_cache();
    let r = store.recover(session).await.unwrap();
    assert_eq!(r.latest_seq, expected.seq, "{what}");
    assert_eq!(r.tools, expected.activation_set(), "{what}");
    assert_eq!(r.mode, expected.mode, "{what}");
    assert_eq!(r.context_start_seq, expected.window_start, "{what}");
    store.close().await;
    expected.seq - expected.window_start
}

/// A session that is never compacted has its whole log as its window. The
/// activation set and recovery of one longer than the store reads as a
/// window (`ROWLESS_WINDOW`) come from the view and the events after it,
/// and equal the fold's: after a tail with a mode switch, a catalog and
/// new evidence, and, through the transactional path, after a tail with a
/// compaction.
async fn long_uncompacted_session(url: &str) {
    use session_store::event::ToolStatus;
    use session_store::EventBody;
    let session = Uuid::new_v4();
    let store = Store::open(url).await.unwrap();
    let mut log = Vec::new();
    let mut push = |body: EventBody| log.push(NewEvent::new(body));
    push(EventBody::SessionStarted {
        mode: "agent".into(),
        metadata: None,
    });
    push(EventBody::CatalogDefined {
        mode: "agent".into(),
        deferred_tools: vec!["web_fetch".into(), "image_view".into()],
    });
    let rounds = (session_store::store::ROWLESS_WINDOW as usize) / 3 + 10;
    for i in 0..rounds {
        push(EventBody::PromptSubmitted {
            text: format!("p{i}"),
        });
        push(EventBody::ToolCall {
            call_id: format!("c{i}"),
            tool_name: "ToolSearch".into(),
            input: serde_json::Value::Null,
        });
        push(EventBody::ToolResult {
            call_id: format!("c{i}"),
            tool_name: "ToolSearch".into(),
            status: ToolStatus::Success,
            output: None,
            added_tool_names: Some(vec![if i == 5 { "image_view" } else { "web_fetch" }.into()]),
        });
    }
    let mut seq = 0;
    for chunk in log.chunks(500) {
        store.append(session, seq, chunk.to_vec()).await.unwrap();
        seq += chunk.len() as i64;
    }
    assert!(
        answers_from_the_view_match_the_fold(url, session, "at a refresh point").await
            > ROWLESS_WINDOW
    );
    // After the view: a mode switch and back, a new catalog, new evidence.
    let tail = vec![
        NewEvent::new(EventBody::ModeSwitched {
            mode: "plan".into(),
        }),
        NewEvent::new(EventBody::CatalogDefined {
            mode: "agent".into(),
            deferred_tools: vec!["image_view".into(), "notebook_edit".into()],
        }),
        NewEvent::new(EventBody::ToolCall {
            call_id: "late".into(),
            tool_name: "notebook_edit".into(),
            input: serde_json::Value::Null,
        }),
        NewEvent::new(EventBody::ToolResult {
            call_id: "late".into(),
            tool_name: "notebook_edit".into(),
            status: ToolStatus::Success,
            output: None,
            added_tool_names: None,
        }),
    ];
    store.append(session, seq, tail.clone()).await.unwrap();
    seq += tail.len() as i64;
    answers_from_the_view_match_the_fold(url, session, "after a tail").await;
    // A compaction after the view keeps the last rows only.
    let all = store.history(session, seq - 2, 10).await.unwrap();
    store
        .append(
            session,
            seq,
            vec![NewEvent::new(EventBody::Compaction {
                summary: "s".into(),
                first_kept_event_id: Some(all[0].event_id),
                tokens_before: None,
            })],
        )
        .await
        .unwrap();
    let fresh = Store::open(url).await.unwrap();
    let all = fresh.history(session, 0, 100_000).await.unwrap();
    let expected = SessionState::fold(session, &all);
    assert_eq!(
        fresh.activations(session, None).await.unwrap(),
        expected.activations(),
        "after a compaction"
    );
    fresh.close().await;
    store.close().await;
}

#[test]
fn a_long_uncompacted_session_is_answered_from_its_view_on_sqlite() {
    let db = common::sqlite_db();
    runtime().block_on(long_uncompacted_session(&db.url));
}

#[test]
fn a_long_uncompacted_session_is_answered_from_its_view_on_postgres() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    runtime().block_on(long_uncompacted_session(&db.url));
}

/// A session's start, its catalog of `web_fetch` and `image_view`, and its
/// first prompt.
fn opening() -> Vec<NewEvent> {
    use session_store::EventBody;
    vec![
        NewEvent::new(EventBody::SessionStarted {
            mode: "agent".into(),
            metadata: None,
        }),
        NewEvent::new(EventBody::CatalogDefined {
            mode: "agent".into(),
            deferred_tools: vec!["web_fetch".into(), "image_view".into()],
        }),
        NewEvent::new(EventBody::PromptSubmitted { text: "go".into() }),
    ]
}

/// A session whose last refresh point is its first prompt, followed by an
/// agent's loop of more than a page (2 000 events) of tool calls and
/// results with no prompt between: the window at the view is short, what
/// follows it is long. The activation set and recovery read the rest page
/// by page without holding it, and equal the fold's, before and after a
/// compaction in it.
async fn long_tail_after_the_view(url: &str) {
    use session_store::event::ToolStatus;
    use session_store::EventBody;
    let session = Uuid::new_v4();
    let store = Store::open(url).await.unwrap();
    let mut log = opening();
    for i in 0..1_300 {
        log.push(NewEvent::new(EventBody::ToolCall {
            call_id: format!("c{i}"),
            tool_name: "ToolSearch".into(),
            input: serde_json::Value::Null,
        }));
        log.push(NewEvent::new(EventBody::ToolResult {
            call_id: format!("c{i}"),
            tool_name: "ToolSearch".into(),
            status: if i % 7 == 0 {
                ToolStatus::Error
            } else {
                ToolStatus::Success
            },
            output: None,
            added_tool_names: (i % 7 != 0).then(|| {
                vec![if i % 2 == 0 {
                    "web_fetch"
                } else {
                    "image_view"
                }
                .into()]
            }),
        }));
    }
    let mut seq = 0;
    for chunk in log.chunks(500) {
        store.append(session, seq, chunk.to_vec()).await.unwrap();
        seq += chunk.len() as i64;
    }
    answers_from_the_view_match_the_fold(url, session, "a long tail").await;
    let kept = store.history(session, seq - 10, 1).await.unwrap()[0].event_id;
    store
        .append(
            session,
            seq,
            vec![NewEvent::new(EventBody::Compaction {
                summary: "s".into(),
                first_kept_event_id: Some(kept),
                tokens_before: None,
            })],
        )
        .await
        .unwrap();
    answers_from_the_view_match_the_fold(url, session, "a long tail and a compaction in it").await;
    store.close().await;
}

#[test]
fn a_long_tail_after_the_view_is_read_page_by_page_on_sqlite() {
    let db = common::sqlite_db();
    runtime().block_on(long_tail_after_the_view(&db.url));
}

#[test]
fn a_long_tail_after_the_view_is_read_page_by_page_on_postgres() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    runtime().block_on(long_tail_after_the_view(&db.url));
}

/// A session of tool results of 100 KB, 12 MB in all, with a compaction
/// that keeps a row: every fold of it (`verify`, `rebuild`, `--at-seq`,
/// the paged context, the cold read) goes in pages that stop at 4 MiB of
/// payloads, and each answer equals the fold's. A page holds the events
/// up to the one that brings it to 4 MiB, and no more (on PostgreSQL the
/// server stops it, so the rows after it never cross the wire).
async fn large_events(url: &str) {
    use session_store::event::ToolStatus;
    use session_store::EventBody;
    let session = Uuid::new_v4();
    let store = Store::open(url).await.unwrap();
    let output = "z".repeat(100_000);
    let mut log = opening();
    for i in 0..60 {
        log.push(NewEvent::new(EventBody::ToolCall {
            call_id: format!("c{i}"),
            tool_name: "ToolSearch".into(),
            input: serde_json::Value::Null,
        }));
        log.push(NewEvent::new(EventBody::ToolResult {
            call_id: format!("c{i}"),
            tool_name: "ToolSearch".into(),
            status: ToolStatus::Success,
            output: Some(serde_json::Value::String(output.clone())),
            added_tool_names: Some(vec![if i < 30 { "web_fetch" } else { "image_view" }.into()]),
        }));
        if i == 40 {
            log.push(NewEvent::new(EventBody::PromptSubmitted {
                text: "on".into(),
            }));
        }
    }
    let mut seq = 0;
    for chunk in log.chunks(20) {
        store.append(session, seq, chunk.to_vec()).await.unwrap();
        seq += chunk.len() as i64;
    }
    // A compaction keeping the rows from the 45th call on, then a prompt.
    let all = store.history(session, 0, 1_000).await.unwrap();
    let kept = all
        .iter()
        .find(|e| matches!(&e.body, EventBody::ToolCall { call_id, .. } if call_id == "c45"))
        .unwrap()
        .event_id;
    let tail = vec![
        NewEvent::new(EventBody::Compaction {
            summary: "s".into(),
            first_kept_event_id: Some(kept),
            tokens_before: None,
        }),
        NewEvent::new(EventBody::PromptSubmitted { text: "end".into() }),
    ];
    store.append(session, seq, tail).await.unwrap();
    seq += 2;
    // One page, of a session's history or of the global feed: the events
    // up to the one that reaches 4 MiB.
    let ends_at_the_bound = |page: &[session_store::StoredEvent], what: &str| {
        let sizes: Vec<usize> = page.iter().map(|e| e.body.to_json_text().len()).collect();
        let before_last: usize = sizes[..sizes.len() - 1].iter().sum();
        assert!(before_last < PAGE_BYTES, "{what}: {} events", page.len());
        assert!(
            before_last + sizes[sizes.len() - 1] >= PAGE_BYTES,
            "{what}: {} events",
            page.len()
        );
    };
    let page = store
        .history_within(session, 0, 2_000, PAGE_BYTES)
        .await
        .unwrap();
    ends_at_the_bound(&page, "history");
    // However small the bound, a page holds an event when there is one.
    let one = store.history_within(session, 0, 10, 0).await.unwrap();
    assert_eq!(one.len(), 1);
    let feed = store.feed(0, 1_000).await.unwrap();
    ends_at_the_bound(&feed, "feed");
    // Pages of any size add up to the whole log, in order.
    let mut after = 0;
    let mut fed = 0;
    loop {
        let page = store.feed(after, 1_000).await.unwrap();
        let Some(last) = page.last() else { break };
        assert!(last.position > after);
        after = last.position;
        fed += page.len() as i64;
    }
    assert_eq!(fed, seq);
    let chain = store.verify_integrity(Some(session)).await.unwrap();
    assert!(chain.intact(), "{chain:?}");
    assert_eq!(chain.events, seq as u64);
    let all = store.history(session, 0, 1_000).await.unwrap();
    assert_eq!(all.len() as i64, seq);
    assert_eq!(store.verify(session).await.unwrap(), None);
    store.rebuild(session).await.unwrap();
    assert_eq!(store.verify(session).await.unwrap(), None);
    for n in [3, 60, 90, 95, seq - 1, seq] {
        let expected = SessionState::fold(session, &all[..n as usize]);
        assert_eq!(
            store.activations(session, Some(n)).await.unwrap(),
            expected.activations(),
            "at {n}"
        );
        assert_eq!(
            context_of_pages(&store, session, Some(n)).await,
            expected.context(),
            "at {n}"
        );
    }
    answers_from_the_view_match_the_fold(url, session, "large events").await;
    store.close().await;
}

#[test]
fn large_events_are_folded_in_pages_of_bounded_bytes_on_sqlite() {
    let db = common::sqlite_db();
    runtime().block_on(large_events(&db.url));
}

#[test]
fn large_events_are_folded_in_pages_of_bounded_bytes_on_postgres() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    runtime().block_on(large_events(&db.url));
}
