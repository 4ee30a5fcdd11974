//! Storage behaviour (SEMANTICS §2), each test written once and run on
//! SQLite and PostgreSQL.

mod common;

use serde_json::json;
use session_store::event::{parse_line, LineKind};
use session_store::{Error, EventBody, NewEvent, Rule, Store, ToolStatus};
use uuid::Uuid;

fn started() -> NewEvent {
    NewEvent::new(EventBody::SessionStarted {
        mode: "agent".into(),
        metadata: None,
    })
}

fn catalog(tools: &[&str]) -> NewEvent {
    NewEvent::new(EventBody::CatalogDefined {
        mode: "agent".into(),
        deferred_tools: tools.iter().map(|s| s.to_string()).collect(),
    })
}

fn prompt(text: &str) -> NewEvent {
    NewEvent::new(EventBody::PromptSubmitted { text: text.into() })
}

fn call(id: &str, tool: &str) -> NewEvent {
    NewEvent::new(EventBody::ToolCall {
        call_id: id.into(),
        tool_name: tool.into(),
        input: json!({"q": tool}),
    })
}

fn result(id: &str, tool: &str, status: ToolStatus, added: &[&str]) -> NewEvent {
    NewEvent::new(EventBody::ToolResult {
        call_id: id.into(),
        tool_name: tool.into(),
        status,
        output: Some(json!(null)),
        added_tool_names: Some(added.iter().map(|s| s.to_string()).collect()),
    })
}

fn with_ids(events: Vec<NewEvent>) -> Vec<NewEvent> {
    events
        .into_iter()
        .map(|e| e.with_id(Uuid::new_v4()))
        .collect()
}

async fn all_events(store: &Store, s: Uuid) -> Vec<session_store::StoredEvent> {
    store.history(s, 0, 100_000).await.unwrap()
}

both_backends!(
    appends_get_dense_seqs_and_increasing_positions,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let other = Uuid::new_v4();
        let a = store
            .append(s, 0, vec![started(), catalog(&["web_fetch"])])
            .await
            .unwrap();
        assert_eq!(
            a.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2]
        );
        store.append(other, 0, vec![started()]).await.unwrap();
        let b = store.append(s, 2, vec![prompt("hi")]).await.unwrap();
        assert_eq!(b.events[0].seq, 3);
        let events = all_events(&store, s).await;
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        let positions: Vec<i64> = events.iter().map(|e| e.position).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
        assert_eq!(store.head_seq(s).await.unwrap(), 3);
    }
);

both_backends!(
    wrong_expected_seq_is_a_conflict_with_the_current_seq,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store
            .append(s, 0, vec![started(), prompt("a")])
            .await
            .unwrap();
        let err = store.append(s, 1, vec![prompt("b")]).await.unwrap_err();
        match err {
            Error::Conflict {
                current, expected, ..
            } => {
                assert_eq!((current, expected), (2, 1));
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
        let err = store
            .append(Uuid::new_v4(), 3, vec![started()])
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Conflict { current: 0, .. }), "{err:?}");
        assert_eq!(all_events(&store, s).await.len(), 2);
    }
);

both_backends!(
    a_batch_with_an_invalid_event_writes_nothing,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let err = store
            .append(
                s,
                0,
                vec![
                    started(),
                    prompt("ok"),
                    result("nope", "x", ToolStatus::Success, &[]),
                ],
            )
            .await
            .unwrap_err();
        match err {
            Error::Invalid(v) => {
                assert_eq!(v.rule, Rule::ResultWithoutCall);
                assert_eq!(v.index, Some(2));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(store.head_seq(s).await.unwrap(), 0);
        assert!(matches!(
            store.context(s, None).await,
            Err(Error::SessionNotFound(_))
        ));
    }
);

both_backends!(
    a_retried_event_answers_its_stored_seq_whatever_the_expected_seq,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let first = with_ids(vec![started()]);
        store.append(s, 0, first.clone()).await.unwrap();
        let p = with_ids(vec![prompt("hello")]);
        let stored = store.append(s, 1, p.clone()).await.unwrap();
        let retry = store.append(s, 1, p.clone()).await.unwrap();
        assert!(retry.replayed);
        assert_eq!(retry.events, stored.events);
        let retry_stale = store.append(s, 0, p).await.unwrap();
        assert_eq!(retry_stale.events[0].seq, 2);
        assert_eq!(all_events(&store, s).await.len(), 2);
    }
);

both_backends!(
    a_retried_batch_answers_its_stored_seqs,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let batch = with_ids(vec![started(), catalog(&["web_fetch"]), prompt("x")]);
        let a = store.append(s, 0, batch.clone()).await.unwrap();
        store.append(s, 3, vec![prompt("later")]).await.unwrap();
        let b = store.append(s, 0, batch.clone()).await.unwrap();
        assert!(b.replayed);
        assert_eq!(a.events, b.events);
        // Same events, another order: rejected.
        let mut reversed = batch.clone();
        reversed.reverse();
        let err = store.append(s, 4, reversed).await.unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(v) if v.rule == Rule::PartlyStoredBatch),
            "{err:?}"
        );
        // Partly stored: rejected, nothing written; said at the first
        // stored event, with its seq.
        let mut partly = vec![prompt("new").with_id(Uuid::new_v4())];
        partly.extend(batch[1..].to_vec());
        let err = store.append(s, 4, partly).await.unwrap_err();
        match &err {
            Error::Invalid(v) => {
                assert_eq!((v.rule, v.index), (Rule::PartlyStoredBatch, Some(1)));
                assert!(
                    v.message.starts_with(
                        "2 of the batch's 3 events are already stored, this one first (as seq 2);"
                    ),
                    "{}",
                    v.message
                );
            }
            _ => panic!("{err:?}"),
        }
        assert_eq!(store.head_seq(s).await.unwrap(), 4);
    }
);

both_backends!(
    an_event_id_reused_with_other_content_is_rejected,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let id = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();
        store
            .append(s, 1, vec![prompt("one").with_id(id)])
            .await
            .unwrap();
        let err = store
            .append(s, 2, vec![prompt("two").with_id(id)])
            .await
            .unwrap_err();
        // Said as this session's own event, with its seq (the writer can
        // read it).
        assert!(
            matches!(&err, Error::Invalid(v) if v.rule == Rule::EventIdReused
                && v.message.contains("already stored at seq 2 of this session with other content")),
            "{err:?}"
        );
        // The same id in another session is other content too, said
        // without naming that session or its seq.
        let other = Uuid::new_v4();
        store.append(other, 0, vec![started()]).await.unwrap();
        let err = store
            .append(other, 1, vec![prompt("one").with_id(id)])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(v) if v.rule == Rule::EventIdReused
                && v.message == format!("`event_id` {id} is already stored in another session")),
            "{err:?}"
        );
        // Twice in one batch.
        let dup = Uuid::new_v4();
        let err = store
            .append(
                s,
                2,
                vec![prompt("a").with_id(dup), prompt("a").with_id(dup)],
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(v) if v.rule == Rule::DuplicateEventIdInBatch),
            "{err:?}"
        );
        assert_eq!(store.head_seq(s).await.unwrap(), 2);
        assert_eq!(store.head_seq(other).await.unwrap(), 1);
    }
);

both_backends!(
    equal_json_in_another_key_order_is_an_idempotent_retry,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let id = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();
        let line_a = format!(
            r#"{{"event_id":"{id}","type":"tool_call","call_id":"c1","tool_name":"t","input":{{"a":1,"b":[1,2]}}}}"#
        );
        let line_b = format!(
            r#"{{"input":{{"b":[1,2],"a":1}},"tool_name":"t","call_id":"c1","type":"tool_call","event_id":"{id}"}}"#
        );
        let a = parse_line(&line_a, LineKind::Append, 1 << 20)
            .unwrap()
            .event;
        let b = parse_line(&line_b, LineKind::Append, 1 << 20)
            .unwrap()
            .event;
        store.append(s, 1, vec![a]).await.unwrap();
        let retry = store.append(s, 2, vec![b]).await.unwrap();
        assert!(retry.replayed);
        assert_eq!(store.head_seq(s).await.unwrap(), 2);
    }
);

both_backends!(history_pages_by_seq, |url: String| async move {
    let store = Store::open(&url).await.unwrap();
    let s = Uuid::new_v4();
    let mut batch = vec![started()];
    batch.extend((0..25).map(|i| prompt(&format!("p{i}"))));
    store.append(s, 0, batch).await.unwrap();
    let mut seen = Vec::new();
    let mut after = 0;
    loop {
        let page = store.history(s, after, 10).await.unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 10);
        after = page.last().unwrap().seq;
        seen.extend(page.into_iter().map(|e| e.seq));
    }
    assert_eq!(seen, (1..=26).collect::<Vec<_>>());
});

both_backends!(payloads_round_trip_exactly, |url: String| async move {
    let store = Store::open(&url).await.unwrap();
    let s = Uuid::new_v4();
    let line = r#"{"type":"session_started","mode":"agent","metadata":{"big":123456789012345678901234567890,"f":1.5e300,"s":"é\u0000x","nested":{"z":[true,null]}}}"#;
    let e = parse_line(line, LineKind::Append, 1 << 20).unwrap().event;
    let body = e.body.clone();
    store.append(s, 0, vec![e]).await.unwrap();
    // A fresh store (no cache) reads it back from the database.
    let reopened = Store::open(&url).await.unwrap();
    let back = reopened.history(s, 0, 10).await.unwrap();
    assert_eq!(back[0].body, body);
    let text = serde_json::to_string(&back[0].body).unwrap();
    assert!(text.contains("123456789012345678901234567890"), "{text}");
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["metadata"]["f"].as_f64(), Some(1.5e300));
    assert_eq!(value["metadata"]["s"], "é\u{0}x");
});

both_backends!(imported_recorded_at_is_kept, |url: String| async move {
    let store = Store::open(&url).await.unwrap();
    let s = Uuid::new_v4();
    let line = format!(
        r#"{{"session_id":"{s}","type":"session_started","mode":"agent","recorded_at":"2025-01-02T03:04:05.123456Z"}}"#
    );
    let e = parse_line(&line, LineKind::Import, 1 << 20).unwrap().event;
    store.append(s, 0, vec![e]).await.unwrap();
    let back = store.history(s, 0, 1).await.unwrap();
    assert_eq!(
        back[0].recorded_at.to_rfc3339(),
        "2025-01-02T03:04:05.123456+00:00"
    );
});

both_backends!(
    call_ids_are_kept_to_what_both_backends_index,
    |url: String| async move {
        // The longest call id the store takes, of bytes no compression
        // shrinks, commits on both backends (a PostgreSQL index entry holds
        // at most 2 704 bytes; 2.7 KB failed the commit), and its result
        // answers it. One byte more is refused alike, alone, the session
        // unchanged.
        let max = session_store::validate::MAX_CALL_ID_BYTES;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let id: String = (0..max)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                char::from(b'!' + (x % 94) as u8)
            })
            .collect();
        assert_eq!(id.len(), max);
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();
        store.append(s, 1, vec![call(&id, "Read")]).await.unwrap();
        let other = Uuid::new_v4();
        store.append(other, 0, vec![started()]).await.unwrap();
        let longer = format!("{id}!");
        let err = store
            .append(other, 1, vec![call(&longer, "Read")])
            .await
            .unwrap_err();
        match &err {
            Error::Invalid(v) => {
                assert_eq!(
                    (v.rule, v.field.as_deref()),
                    (Rule::MistypedField, Some("call_id"))
                );
                let said = format!("{} bytes", max + 1);
                assert!(v.message.contains(&said), "{}", v.message);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(store.head_seq(other).await.unwrap(), 1);
        store
            .append(s, 2, vec![result(&id, "Read", ToolStatus::Success, &[])])
            .await
            .unwrap();
        assert_eq!(store.head_seq(s).await.unwrap(), 3);
        store.close().await;
    }
);

both_backends!(oversized_events_are_rejected, |url: String| async move {
    let opts = session_store::StoreOptions {
        max_event_bytes: 200,
        ..Default::default()
    };
    let store = Store::open_with(&url, opts).await.unwrap();
    let s = Uuid::new_v4();
    store.append(s, 0, vec![started()]).await.unwrap();
    let err = store
        .append(s, 1, vec![prompt(&"x".repeat(300))])
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(v) if v.rule == Rule::TooLarge),
        "{err:?}"
    );
    assert_eq!(store.head_seq(s).await.unwrap(), 1);
});

both_backends!(
    context_and_activations_as_of_any_seq,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store
            .append(
                s,
                0,
                vec![
                    started(),
                    catalog(&["web_fetch", "image_view"]),
                    prompt("find"),
                    call("c1", "ToolSearch"),
                    result("c1", "ToolSearch", ToolStatus::Success, &["web_fetch"]),
                    prompt("next"),
                ],
            )
            .await
            .unwrap();
        let now = store.activations(s, None).await.unwrap();
        assert_eq!(now.as_of_seq, 6);
        assert_eq!(now.tools.len(), 1);
        assert_eq!(
            (now.tools[0].name.as_str(), now.tools[0].evidence_seq),
            ("web_fetch", 5)
        );
        let before = store.activations(s, Some(4)).await.unwrap();
        assert!(before.tools.is_empty());
        let ctx = store.context(s, Some(5)).await.unwrap();
        assert_eq!(
            ctx.rows.iter().map(|r| r.seq).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        assert!(matches!(
            store.context(s, Some(7)).await,
            Err(Error::SeqOutOfRange { latest: 6, .. })
        ));
        assert!(matches!(
            store.context(s, Some(0)).await,
            Err(Error::SeqOutOfRange { .. })
        ));
        assert!(matches!(
            store.activations(Uuid::new_v4(), None).await,
            Err(Error::SessionNotFound(_))
        ));
        // Another process (a fresh store) appending is seen by this one.
        let other = Store::open(&url).await.unwrap();
        other
            .append(
                s,
                6,
                vec![NewEvent::new(EventBody::ModeSwitched {
                    mode: "plan".into(),
                })],
            )
            .await
            .unwrap();
        let after = store.activations(s, None).await.unwrap();
        assert_eq!(
            (after.as_of_seq, after.mode.as_str(), after.tools.len()),
            (7, "plan", 0)
        );
        // And this store validates against what the other one wrote.
        let err = store
            .append(s, 7, vec![call("c1", "again")])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(v) if v.rule == Rule::DuplicateCallId),
            "{err:?}"
        );
    }
);

both_backends!(
    the_database_refuses_updates_and_deletes,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store
            .append(s, 0, vec![started(), prompt("keep me")])
            .await
            .unwrap();
        let statements = ["UPDATE events SET payload = '{}'", "DELETE FROM events"];
        if url.starts_with("postgres") {
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            for sql in statements.iter().chain(["TRUNCATE events"].iter()) {
                let err = sqlx::query(sql).execute(&pool).await.unwrap_err();
                assert!(err.to_string().contains("append-only"), "{sql}: {err}");
            }
        } else {
            let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
            for sql in statements {
                let err = sqlx::query(sql).execute(&pool).await.unwrap_err();
                assert!(err.to_string().contains("append-only"), "{sql}: {err}");
            }
        }
        assert_eq!(all_events(&store, s).await.len(), 2);
    }
);

both_backends!(
    concurrent_appends_to_one_session_never_share_a_seq,
    |url: String| async move {
        let s = Uuid::new_v4();
        let store = std::sync::Arc::new(Store::open(&url).await.unwrap());
        store.append(s, 0, vec![started()]).await.unwrap();
        let mut tasks = Vec::new();
        for w in 0..4 {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let store = Store::open(&url).await.unwrap();
                let mut written = 0;
                while written < 10 {
                    let head = store.head_seq(s).await.unwrap();
                    match store
                        .append(s, head, vec![prompt(&format!("w{w}-{written}"))])
                        .await
                    {
                        Ok(_) => written += 1,
                        Err(Error::Conflict { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let events = all_events(&store, s).await;
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (1..=41).collect::<Vec<_>>()
        );
    }
);

#[test]
fn processes_opening_a_new_sqlite_file_at_once_all_succeed() {
    let bin = env!("CARGO_BIN_EXE_session-store");
    for _ in 0..3 {
        let db = common::sqlite_db();
        let spawned: Vec<_> = (0..6)
            .map(|_| {
                std::process::Command::new(bin)
                    .args(["--database", &db.url, "migrate"])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for child in spawned {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

// Calls that left the effective window are known only to the calls index,
// which an append reads ahead with its group (src/store/group.rs): a call id
// used before a compaction stays taken, and its late result is still
// accepted, by the instance that wrote it (warm cache) and by a fresh one.
both_backends!(
    calls_compacted_away_are_still_judged_from_the_calls_index,
    |url: String| async move {
        let compaction = || {
            NewEvent::new(EventBody::Compaction {
                summary: "earlier work".into(),
                first_kept_event_id: None,
                tokens_before: None,
            })
        };
        for fresh in [false, true] {
            let writer = Store::open(&url).await.unwrap();
            let s = Uuid::new_v4();
            let head = writer
                .append(
                    s,
                    0,
                    vec![
                        started(),
                        catalog(&["web_fetch"]),
                        prompt("go"),
                        call("c1", "ToolSearch"),
                        result("c1", "ToolSearch", ToolStatus::Success, &["web_fetch"]),
                        call("c2", "Read"),
                        compaction(),
                        prompt("next"),
                    ],
                )
                .await
                .unwrap()
                .events
                .last()
                .unwrap()
                .seq;
            let store = if fresh {
                writer.close().await;
                Store::open(&url).await.unwrap()
            } else {
                writer
            };
            let reused = store
                .append(s, head, vec![call("c1", "Grep")])
                .await
                .expect_err("a call id used before the compaction is taken");
            match &reused {
                Error::Invalid(v) => assert_eq!(v.rule, Rule::DuplicateCallId, "{reused}"),
                other => panic!("expected a validation error, got {other:?}"),
            }
            let answered = store
                .append(
                    s,
                    head,
                    vec![result("c2", "Read", ToolStatus::Success, &[])],
                )
                .await
                .unwrap();
            assert_eq!(answered.events[0].seq, head + 1);
            let twice = store
                .append(
                    s,
                    head + 1,
                    vec![result("c2", "Read", ToolStatus::Success, &[])],
                )
                .await
                .expect_err("a second result for the same call");
            match &twice {
                Error::Invalid(v) => assert_eq!(v.rule, Rule::DuplicateResult, "{twice}"),
                other => panic!("expected a validation error, got {other:?}"),
            }
            // The compaction dropped the search result's evidence (§7), and
            // the view the next refresh point writes says so.
            store
                .append(s, head + 1, vec![prompt("more")])
                .await
                .unwrap();
            assert!(store.activations(s, None).await.unwrap().tools.is_empty());
            assert_eq!(store.verify(s).await.unwrap(), None, "fresh: {fresh}");
            store.close().await;
        }
    }
);

both_backends!(
    nul_where_postgresql_cannot_store_it_is_refused_alone,
    |url: String| async move {
        // U+0000 in a call id would reach the calls index's text column:
        // refused as invalid on both backends, before anything is written,
        // while an append to another session committed beside it succeeds.
        let store = std::sync::Arc::new(Store::open(&url).await.unwrap());
        let (bad, good) = (Uuid::new_v4(), Uuid::new_v4());
        store.append(bad, 0, vec![started()]).await.unwrap();
        store.append(good, 0, vec![started()]).await.unwrap();
        let (refused, accepted) = tokio::join!(
            store.append(bad, 1, vec![call("c\u{0}1", "Read")]),
            store.append(good, 1, vec![prompt("fine")]),
        );
        let err = refused.unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(v) if v.rule == Rule::MistypedField
                && v.field.as_deref() == Some("call_id")),
            "{err:?}"
        );
        assert_eq!(accepted.unwrap().events[0].seq, 2);
        assert_eq!(store.head_seq(bad).await.unwrap(), 1);
        // The session stays usable: the same call with a clean id goes in.
        store
            .append(bad, 1, vec![call("c1", "Read")])
            .await
            .unwrap();
        assert_eq!(store.verify(bad).await.unwrap(), None);
    }
);

both_backends!(
    recorded_at_outside_years_0000_to_9999_is_refused,
    |url: String| async move {
        use chrono::TimeZone;
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();
        let late = chrono::Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap();
        let mut e = prompt("from the far future");
        e.recorded_at = Some(late);
        let err = store.append(s, 1, vec![prompt("ok"), e]).await.unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(v) if v.rule == Rule::MistypedField
                && v.field.as_deref() == Some("recorded_at") && v.index == Some(1)),
            "{err:?}"
        );
        assert_eq!(store.head_seq(s).await.unwrap(), 1);
        // The last instant of 9999 is kept, and read back.
        let last = chrono::Utc
            .with_ymd_and_hms(9999, 12, 31, 23, 59, 59)
            .unwrap();
        let mut e = prompt("at the edge");
        e.recorded_at = Some(last);
        store.append(s, 1, vec![e]).await.unwrap();
        let back = store.history(s, 0, 10).await.unwrap();
        assert_eq!(back[1].recorded_at, last);
        assert_eq!(store.context(s, None).await.unwrap().rows.len(), 1);
    }
);

both_backends!(
    append_at_head_retry_after_a_lost_reply_stores_the_events_once,
    |url: String| async move {
        // The first attempt commits but its reply is lost (as when the
        // connection drops after COMMIT): the retry must answer from the
        // log, not append the id-less events a second time.
        let lost = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let options = session_store::StoreOptions {
            fault_lose_replies: Some(lost.clone()),
            ..Default::default()
        };
        let store = Store::open_with(&url, options).await.unwrap();
        let s = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();
        // Appended once without retries, the lost reply is said as an
        // unknown outcome, not as storage that stored nothing.
        lost.store(1, std::sync::atomic::Ordering::SeqCst);
        match store.append(s, 1, vec![prompt("unsure")]).await {
            Err(Error::OutcomeUnknown(m)) => assert!(m.contains("lost"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(store.head_seq(s).await.unwrap(), 2);
        lost.store(1, std::sync::atomic::Ordering::SeqCst);
        let policy = session_store::RetryPolicy {
            max_attempts: 3,
            initial_backoff: std::time::Duration::from_millis(5),
            max_backoff: std::time::Duration::from_millis(10),
            ..Default::default()
        };
        let outcome = store
            .append_at_head(s, vec![prompt("once"), prompt("only")], &policy)
            .await
            .unwrap();
        assert_eq!(lost.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert!(
            outcome.replayed && outcome.confirmed_on_retry,
            "the retry should be answered from the log, as this call's: {outcome:?}"
        );
        let seqs: Vec<i64> = outcome.events.iter().map(|a| a.seq).collect();
        assert_eq!(seqs, [3, 4]);
        // The same events sent again: a replay, but not this call's.
        let stored: Vec<_> = all_events(&store, s).await.into_iter().skip(2).collect();
        let again = stored
            .iter()
            .map(|e| session_store::NewEvent::new(e.body.clone()).with_id(e.event_id))
            .collect();
        let outcome = store.append_at_head(s, again, &policy).await.unwrap();
        assert!(
            outcome.replayed && !outcome.confirmed_on_retry,
            "{outcome:?}"
        );
        let texts: Vec<String> = all_events(&store, s)
            .await
            .iter()
            .skip(2)
            .map(|e| serde_json::to_string(&e.body).unwrap())
            .collect();
        assert_eq!(texts.len(), 2, "stored twice: {texts:?}");
    }
);

both_backends!(
    audit_changes_refuse_a_tool_name_no_event_could_carry,
    |url: String| async move {
        use session_store::store::query::{ChangeQuery, Scope};
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store
            .append(s, 0, vec![started(), catalog(&["web_fetch"]), prompt("hi")])
            .await
            .unwrap();
        let scope = Scope {
            limit: 10,
            ..Scope::default()
        };
        // Names no event could carry (§3): with a control character, empty,
        // or over 256 bytes.
        let impossible = ["web\u{0}fetch".to_owned(), String::new(), "t".repeat(257)];
        let mut cases: Vec<(ChangeQuery, &str)> = impossible
            .iter()
            .map(|name| {
                (
                    ChangeQuery {
                        scope: scope.clone(),
                        tool: Some(name.clone()),
                        ..ChangeQuery::default()
                    },
                    "tool",
                )
            })
            .collect();
        cases.extend([(
            ChangeQuery {
                scope: scope.clone(),
                after: Some("3:web\u{0}fetch".into()),
                ..ChangeQuery::default()
            },
            "after",
        )]);
        for (q, field) in cases {
            let err = store.audit_changes(&q).await.unwrap_err();
            assert!(
                matches!(&err, Error::Invalid(v) if v.field.as_deref() == Some(field)),
                "{field}: {err:?}"
            );
        }
        // A clean filter still answers.
        let page = store
            .audit_changes(&ChangeQuery {
                scope,
                tool: Some("web_fetch".into()),
                ..ChangeQuery::default()
            })
            .await
            .unwrap();
        assert!(page.changes.is_empty());
    }
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_whose_file_is_removed_acknowledges_nothing_more() {
    // A connection still open on a removed file would take appends that no
    // later open can read: after the removal every append fails, and the
    // store no longer says it is ready.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gone.db");
    let store = Store::open(&path.display().to_string()).await.unwrap();
    let s = Uuid::new_v4();
    store.append(s, 0, vec![started()]).await.unwrap();
    // Warm and quiet: the next append is optimistic.
    store.append(s, 1, vec![prompt("warm")]).await.unwrap();
    store.ready().await.unwrap();
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    // A long batch, whose first rows the optimistic transaction would send
    // ahead (docs/design.md, "Rows sent ahead"): the removal is said there,
    // without a second try under the lock.
    let before = store.append_paths();
    let long: Vec<NewEvent> = (0..40).map(|i| prompt(&format!("long {i}"))).collect();
    let err = store.append(s, 2, long).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
    let paths = store.append_paths();
    assert_eq!(
        (
            paths.optimistic - before.optimistic,
            paths.optimistic_abandoned - before.optimistic_abandoned,
            paths.locked - before.locked,
            paths.sends_ahead - before.sends_ahead
        ),
        (1, 0, 0, 1),
        "{paths:?}"
    );
    for i in 0..3 {
        let err = store
            .append(s, 2, vec![prompt(&format!("after the removal {i}"))])
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
    }
    let err = store.ready().await.unwrap_err();
    assert!(err.to_string().contains("was removed"), "{err}");
    // Nothing was made at the path in the meantime.
    assert!(!path.exists(), "a new file was created at the store's path");
    store.close().await;
}

both_backends!(
    subscribers_never_take_the_connections_appends_need,
    |url: String| async move {
        // More watchers and subscriptions than the store's pool has
        // connections (8 on PostgreSQL): appends and reads still go through
        // at once.
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();
        let mut watchers = Vec::new();
        let mut subscriptions = Vec::new();
        for _ in 0..6 {
            watchers.push(store.watch().await.unwrap());
            subscriptions.push(store.subscribe(1).await.unwrap());
        }
        let started_at = std::time::Instant::now();
        store
            .append(s, 1, vec![prompt("still here")])
            .await
            .unwrap();
        assert_eq!(store.head_seq(s).await.unwrap(), 2);
        assert!(
            started_at.elapsed() < std::time::Duration::from_secs(2),
            "append and read took {:?} beside 12 subscribers",
            started_at.elapsed()
        );
        drop(subscriptions);
        drop(watchers);
    }
);

/// `rebuild` of every session, run by one process, leaves the file's write
/// lock to another process's writer within moments: each session is its
/// own transaction, but one taken again at once left a writer sleeping in
/// SQLite's busy handler to find the lock free by chance, and a rebuild of
/// a few seconds made it give up (a review saw other instances answer 503
/// after their 10 s busy timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_long_rebuild_lets_another_processs_writer_in() {
    use sqlx::ConnectOptions;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rebuild.db");
    let url = path.display().to_string();
    let store = Store::open(&url).await.unwrap();
    let mut sessions = Vec::new();
    for i in 0..60 {
        let s = Uuid::new_v4();
        let mut batch = vec![started()];
        batch.extend((0..399).map(|j| prompt(&format!("session {i} prompt {j}"))));
        store.append(s, 0, batch).await.unwrap();
        sessions.push(s);
    }
    // Another process's writer, with a short busy timeout (a rebuild's
    // run holds the lock 1 s at most): it takes the lock every 50 ms while
    // the rebuild runs.
    let mut other = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .busy_timeout(std::time::Duration::from_millis(1500))
        .connect()
        .await
        .unwrap();
    let rebuilding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let rebuild = {
        let rebuilding = rebuilding.clone();
        let store = &store;
        let sessions = &sessions;
        async move {
            // Round after round (`rebuild` of every session, run again),
            // for longer than the other writer's busy timeout, however fast
            // the machine.
            let started_at = std::time::Instant::now();
            while started_at.elapsed() < std::time::Duration::from_secs(4) {
                for s in sessions {
                    store.rebuild(*s).await.unwrap();
                }
            }
            rebuilding.store(false, std::sync::atomic::Ordering::SeqCst);
            started_at.elapsed()
        }
    };
    let writer = async {
        let mut waits = Vec::new();
        while rebuilding.load(std::sync::atomic::Ordering::SeqCst) {
            let asked = std::time::Instant::now();
            let took = sqlx::raw_sql("BEGIN IMMEDIATE; ROLLBACK")
                .execute(&mut other)
                .await;
            waits.push((asked.elapsed(), took.err().map(|e| e.to_string())));
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        waits
    };
    let (rebuilt_in, waits) = tokio::join!(rebuild, writer);
    assert!(waits.len() >= 2, "{} waits in {rebuilt_in:?}", waits.len());
    let failed: Vec<_> = waits.iter().filter(|(_, e)| e.is_some()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} waits failed: {failed:?}",
        failed.len(),
        waits.len()
    );
    assert_eq!(store.verify(sessions[0]).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_append_cancelled_at_any_point_never_keeps_the_write_lock() {
    // An append alone in its group commits in its caller's task; a caller
    // that gives up (a timeout) at any point must leave the file's write
    // lock free for another process's store within moments.
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("cancel.db").display().to_string();
    let a = Store::open(&url).await.unwrap();
    let b = Store::open(&url).await.unwrap();
    let (sa, sb) = (Uuid::new_v4(), Uuid::new_v4());
    a.append(sa, 0, vec![started()]).await.unwrap();
    b.append(sb, 0, vec![started()]).await.unwrap();
    let mut cancelled = 0;
    for step in 0..60u64 {
        let head = a.head_seq(sa).await.unwrap();
        let give_up = std::time::Duration::from_micros(50 + step * 60);
        let batch: Vec<NewEvent> = (0..20).map(|i| prompt(&format!("a {step}.{i}"))).collect();
        if tokio::time::timeout(give_up, a.append(sa, head, batch))
            .await
            .is_err()
        {
            cancelled += 1;
        }
        // Let a rollback spawned by the cancelled append run.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let head_b = b.head_seq(sb).await.unwrap();
        let other = tokio::time::timeout(
            std::time::Duration::from_secs(3),
            b.append(sb, head_b, vec![prompt(&format!("b {step}"))]),
        )
        .await;
        assert!(
            matches!(other, Ok(Ok(_))),
            "step {step}: the other store could not append: {other:?}"
        );
    }
    assert!(cancelled > 0, "no append was cancelled");
    assert_eq!(a.verify(sa).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reads_never_wait_for_another_processs_writer() {
    // WAL readers never block (docs/multi-instance.md): opening a store and
    // reading it must not queue for the file's write lock, which another
    // process may hold for a long time (a stalled writer, a long rebuild).
    use sqlx::Connection;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("busy.db");
    let url = path.display().to_string();
    let s = Uuid::new_v4();
    {
        let store = Store::open(&url).await.unwrap();
        store
            .append(s, 0, vec![started(), catalog(&["web_fetch"]), prompt("hi")])
            .await
            .unwrap();
        store.close().await;
    }
    let mut writer = sqlx::SqliteConnection::connect(&format!("sqlite://{url}"))
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut writer)
        .await
        .unwrap();
    let started_at = std::time::Instant::now();
    let reads = async {
        let store = Store::open(&url).await.unwrap();
        assert_eq!(store.head_seq(s).await.unwrap(), 3);
        assert_eq!(store.history(s, 0, 10).await.unwrap().len(), 3);
        assert_eq!(store.context(s, None).await.unwrap().as_of_seq, 3);
        assert!(store.activations(s, None).await.unwrap().tools.is_empty());
        assert_eq!(store.recover(s).await.unwrap().latest_seq, 3);
        assert_eq!(store.verify(s).await.unwrap(), None);
        assert!(store.verify_integrity(None).await.unwrap().intact());
        assert_eq!(store.feed(0, 10).await.unwrap().len(), 3);
        store.close().await;
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), reads)
        .await
        .expect("reads waited for another connection's write lock");
    assert!(
        started_at.elapsed() < std::time::Duration::from_secs(5),
        "took {:?}",
        started_at.elapsed()
    );
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut writer)
        .await
        .unwrap();
}

both_backends!(
    an_append_wakes_only_the_waiters_of_its_session,
    |url: String| async move {
        // A review's 1 000 idle streams each read the log again after every
        // append to any session (185 PostgreSQL transactions an append)
        // and once a second. Waiters on session a are not woken by appends
        // to b, through another store of the same database, and are by
        // one to a.
        let store = std::sync::Arc::new(Store::open(&url).await.unwrap());
        let other = Store::open(&url).await.unwrap();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        store.append(a, 0, vec![started()]).await.unwrap();
        other.append(b, 0, vec![started()]).await.unwrap();
        let waiters = 20;
        let mut tasks = Vec::new();
        for _ in 0..waiters {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut watch = store.watch().await.unwrap();
                watch
                    .wait_past(a, 1, std::time::Duration::from_secs(30))
                    .await
            }));
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while store.waiter_reads() < waiters {
            assert!(
                std::time::Instant::now() < deadline,
                "waiters did not start"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let before = store.waiter_reads();
        for seq in 1..=10 {
            other
                .append(b, seq, vec![prompt("not for a")])
                .await
                .unwrap();
            // Past SQLite's poll, so that each is seen alone.
            tokio::time::sleep(std::time::Duration::from_millis(40)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert_eq!(
            store.waiter_reads(),
            before,
            "waiters on a read again for appends to b"
        );
        other.append(a, 1, vec![prompt("for a")]).await.unwrap();
        for task in tasks {
            let head = tokio::time::timeout(std::time::Duration::from_secs(5), task)
                .await
                .expect("woken by the append to a")
                .unwrap()
                .unwrap();
            assert_eq!(head, Some(2));
        }
    }
);

both_backends!(
    every_waiter_of_a_store_shares_one_source_of_wakeups,
    |url: String| async move {
        // Waiters used to have one each: a PostgreSQL connection per HTTP
        // stream, a poll every 20 ms per stream on SQLite. Many waiters
        // now share one, which stops when the last is gone, and each is
        // still woken by an append from another store.
        let store = Store::open(&url).await.unwrap();
        let other = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();
        assert!(!store.wakeups_running());
        let mut watches = Vec::new();
        for _ in 0..40 {
            watches.push(store.watch().await.unwrap());
        }
        assert!(store.wakeups_running());
        if url.starts_with("postgres") {
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            let listening: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'session-store listener' AND datname = current_database()",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            // This store's one, and none yet for `other`.
            assert_eq!(listening, 1, "listening connections");
            pool.close().await;
        }
        // The first waiter is woken by another store's append, through the
        // shared source; the others see the new head.
        let appending = async {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            other.append(s, 1, vec![prompt("wake up")]).await.unwrap();
        };
        let started_at = std::time::Instant::now();
        // `Duration::MAX`, "wait forever", once overflowed an Instant and
        // panicked; bounded here by the test's own timeout.
        let (head, ()) = tokio::join!(
            tokio::time::timeout(
                std::time::Duration::from_secs(10),
                watches[0].wait_past(s, 1, std::time::Duration::MAX)
            ),
            appending
        );
        assert_eq!(head.expect("woken").unwrap(), Some(2));
        assert!(
            started_at.elapsed() < std::time::Duration::from_secs(3),
            "woken after {:?}",
            started_at.elapsed()
        );
        for w in &mut watches[1..] {
            let head = w.wait_past(s, 1, std::time::Duration::from_secs(1)).await;
            assert_eq!(head.unwrap(), Some(2));
        }
        drop(watches);
        let stopped_at = std::time::Instant::now();
        while store.wakeups_running() {
            assert!(
                stopped_at.elapsed() < std::time::Duration::from_secs(5),
                "the source still runs with nobody waiting"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        // And starts again for the next waiter.
        let mut again = store.watch().await.unwrap();
        assert!(store.wakeups_running());
        assert_eq!(
            again
                .wait_past(s, 1, std::time::Duration::from_secs(1))
                .await
                .unwrap(),
            Some(2)
        );
    }
);

both_backends!(
    history_within_stops_at_its_byte_budget,
    |url: String| async move {
        // A stream reads pages of at most about this many bytes, however
        // large the events after a run of small ones.
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let mut events = vec![started(), prompt("a"), prompt("b"), prompt("c")];
        events.extend((0..5).map(|i| prompt(&format!("{i}{}", "x".repeat(100_000)))));
        store.append(s, 0, events).await.unwrap();
        let full = store.history(s, 0, 500).await.unwrap();
        assert_eq!(full.len(), 9);
        let page = store.history_within(s, 0, 500, 250_000).await.unwrap();
        // Four small events, then large ones until 250 000 bytes are read:
        // the third large one crosses it.
        assert_eq!(page.len(), 7);
        assert_eq!(page, full[..7]);
        // At least one event, and no more than the limit.
        assert_eq!(
            store.history_within(s, 4, 500, 1).await.unwrap(),
            full[4..5]
        );
        assert_eq!(
            store.history_within(s, 0, 2, usize::MAX).await.unwrap(),
            full[..2]
        );
        assert_eq!(
            store.history_within(s, 0, 500, usize::MAX).await.unwrap(),
            full
        );
        assert!(store.history_within(s, 9, 500, 1).await.unwrap().is_empty());
    }
);

both_backends!(
    verify_and_rebuild_check_every_call_across_pages,
    |url: String| async move {
        // verify and rebuild fold the log in pages of 2 000 events and
        // compare or write each call's row once it is answered: calls
        // answered pages later, answered in the same page, and never
        // answered must all be checked and rebuilt.
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let mut events = vec![started(), catalog(&["web_fetch"]), call("open", "Read")];
        for i in 0..1_600 {
            events.push(call(&format!("c{i}"), "Read"));
            events.push(result(&format!("c{i}"), "Read", ToolStatus::Success, &[]));
        }
        events.push(call("late", "Read"));
        events.push(prompt("next"));
        events.extend((0..1_000).map(|i| prompt(&format!("p{i}"))));
        events.push(result("open", "Read", ToolStatus::Success, &[]));
        events.push(call("never", "Read"));
        let mut head = 0;
        for chunk in events.chunks(500) {
            store.append(s, head, chunk.to_vec()).await.unwrap();
            head += chunk.len() as i64;
        }
        assert_eq!(store.verify(s).await.unwrap(), None);
        let tamper = |sql: String| {
            let url = url.clone();
            async move {
                if url.starts_with("postgres") {
                    let pool = sqlx::PgPool::connect(&url).await.unwrap();
                    sqlx::query(&sql).execute(&pool).await.unwrap();
                } else {
                    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
                    sqlx::query(&sql).execute(&pool).await.unwrap();
                }
            }
        };
        for (call_id, sql) in [
            (
                "open",
                "UPDATE calls SET result_seq = NULL WHERE call_id = 'open'",
            ),
            (
                "c1500",
                "UPDATE calls SET tool_name = 'Write' WHERE call_id = 'c1500'",
            ),
            ("never", "DELETE FROM calls WHERE call_id = 'never'"),
            (
                "late",
                "UPDATE calls SET result_seq = 7 WHERE call_id = 'late'",
            ),
        ] {
            tamper(sql.to_owned()).await;
            let drift = store.verify(s).await.unwrap().expect("drift found");
            assert!(
                drift.contains(&format!("\"{call_id}\"")),
                "{call_id}: {drift}"
            );
            store.rebuild(s).await.unwrap();
            assert_eq!(store.verify(s).await.unwrap(), None, "{call_id} rebuilt");
        }
    }
);

both_backends!(
    a_stream_resuming_from_the_view_sees_what_the_fold_sees,
    |url: String| async move {
        // Streams resume on the stored view when it is at or before the
        // resume point: at every seq the state must equal the fold's.
        let writer = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let mut events = with_ids(vec![
            started(),
            catalog(&["web_fetch", "notebook_edit"]),
            prompt("one"),
            call("c1", "ToolSearch"),
            result("c1", "ToolSearch", ToolStatus::Success, &["web_fetch"]),
            prompt("two"),
            call("c2", "web_fetch"),
        ]);
        let kept = events[5].event_id;
        events.push(NewEvent::new(EventBody::Compaction {
            summary: "earlier".into(),
            first_kept_event_id: kept,
            tokens_before: None,
        }));
        events.push(result("c2", "web_fetch", ToolStatus::Success, &[]));
        events.push(NewEvent::new(EventBody::ModeSwitched {
            mode: "plan".into(),
        }));
        events.push(call("c3", "ToolSearch"));
        events.push(result(
            "c3",
            "ToolSearch",
            ToolStatus::Success,
            &["notebook_edit"],
        ));
        events.push(prompt("three"));
        events.push(call("c4", "Read"));
        let head = events.len() as i64;
        writer.append(s, 0, events).await.unwrap();
        // A fresh store: no cached state, so the view path is taken.
        for n in 1..=head {
            let reader = Store::open(&url).await.unwrap();
            let resumed = reader.state_resuming(s, n).await.unwrap();
            let folded = reader.state(s, Some(n)).await.unwrap();
            assert_eq!(resumed.seq, n);
            assert_eq!(resumed.activations(), folded.activations(), "seq {n}");
            assert_eq!(resumed.context(), folded.context(), "seq {n}");
            reader.close().await;
        }
        let err = writer.state_resuming(s, head + 1).await.unwrap_err();
        assert!(matches!(err, Error::SeqOutOfRange { .. }), "{err:?}");
    }
);

/// A closed store's appends fail at once: `append_at_head` does not spend
/// its retry budget on storage that cannot come back.
#[tokio::test]
async fn an_append_on_a_closed_store_is_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    let store = Store::open(&url).await.unwrap();
    let s = Uuid::new_v4();
    store.append(s, 0, vec![started()]).await.unwrap();
    store.close().await;
    let at = std::time::Instant::now();
    let r = store
        .append_at_head(
            s,
            vec![prompt("late")],
            &session_store::RetryPolicy::default(),
        )
        .await;
    // Said as the closed store it is (Store::close's doc), not as retries
    // exhausted.
    assert!(
        matches!(&r, Err(Error::Unavailable(m)) if m.contains("closed")),
        "{r:?}"
    );
    assert!(
        at.elapsed() < std::time::Duration::from_secs(2),
        "gave up after {:?}",
        at.elapsed()
    );
}

/// A copy of a SQLite file in rollback-journal mode with a hot journal, as
/// a process killed mid-transaction leaves it: `committed` runs first, then
/// a transaction that spills pages into the file (and their originals into
/// the journal) is copied while open. Returns the copy's path.
async fn copy_with_hot_journal(dir: &std::path::Path, committed: &str) -> std::path::PathBuf {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
    use sqlx::{ConnectOptions, Connection};
    let (src, dst) = (dir.join("src.db"), dir.join("store.db"));
    let mut writer = SqliteConnectOptions::new()
        .filename(&src)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Delete)
        .pragma("cache_size", "10")
        .connect()
        .await
        .unwrap();
    sqlx::raw_sql(committed).execute(&mut writer).await.unwrap();
    sqlx::raw_sql(
        "BEGIN IMMEDIATE;
         CREATE TABLE half_made (x BLOB);
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 400)
         INSERT INTO half_made SELECT randomblob(1000) FROM n;",
    )
    .execute(&mut writer)
    .await
    .unwrap();
    assert!(std::fs::metadata(journal(&src)).unwrap().len() > 0);
    std::fs::copy(&src, &dst).unwrap();
    std::fs::copy(journal(&src), journal(&dst)).unwrap();
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut writer)
        .await
        .unwrap();
    writer.close().await.unwrap();
    dst
}

fn journal(db: &std::path::Path) -> std::path::PathBuf {
    db.with_extension("db-journal")
}

/// A process killed while it created a SQLite store can leave a hot
/// rollback journal (the store is not in WAL mode yet). The next process
/// must roll it back and go on, not fail every command with "attempt to
/// write a readonly database" (found by killing `append` at random
/// moments of a new store's creation).
#[tokio::test]
async fn a_hot_journal_left_by_a_killed_store_creation_is_rolled_back() {
    use sqlx::sqlite::SqliteConnectOptions;
    use sqlx::{ConnectOptions, Connection};
    let dir = tempfile::tempdir().unwrap();
    let dst = copy_with_hot_journal(dir.path(), "SELECT 1").await;
    let url = format!("sqlite://{}", dst.display());
    let store = Store::open(&url).await.expect("the journal is rolled back");
    let s = Uuid::new_v4();
    let appended = store.append(s, 0, vec![started()]).await.unwrap();
    assert_eq!(appended.events[0].seq, 1);
    store.close().await;
    // The half-made table went with the rollback, and the journal with it.
    let mut conn = SqliteConnectOptions::new()
        .filename(&dst)
        .connect()
        .await
        .unwrap();
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE name = 'half_made'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(left, 0);
    conn.close().await.unwrap();
    assert!(!journal(&dst).exists());
}

/// The check before opening honours `mode=ro` (nothing is written, the hot
/// journal stays), and says what opening did to another application's
/// database with a hot journal (SQLite rolled it back) instead of claiming
/// it was left unchanged.
#[tokio::test]
async fn the_file_check_keeps_mode_ro_and_says_when_sqlite_rolled_a_journal_back() {
    let dir = tempfile::tempdir().unwrap();
    let dst = copy_with_hot_journal(dir.path(), "CREATE TABLE keep (x)").await;
    let (size, journal_size) = (
        std::fs::metadata(&dst).unwrap().len(),
        std::fs::metadata(journal(&dst)).unwrap().len(),
    );
    let read_only = session_store::StoreOptions {
        create_if_missing: false,
        ..Default::default()
    };
    let url = format!("sqlite://{}?mode=ro", dst.display());
    assert!(Store::open_with(&url, read_only).await.is_err());
    assert_eq!(std::fs::metadata(&dst).unwrap().len(), size);
    assert_eq!(
        std::fs::metadata(journal(&dst)).unwrap().len(),
        journal_size
    );

    let url = format!("sqlite://{}", dst.display());
    let Err(Error::NotAStore(m)) = Store::open(&url).await else {
        panic!("another application's database is not a store")
    };
    assert!(
        m.contains("tables: keep") && m.contains("rolled back"),
        "{m}"
    );
    assert!(!m.contains("left unchanged"), "{m}");

    // A journal that holds nothing to roll back (journal_mode=persist
    // keeps the file, its header zeroed) is not said to have been.
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
    use sqlx::{ConnectOptions, Connection};
    let persisted = dir.path().join("persist.db");
    let mut c = SqliteConnectOptions::new()
        .filename(&persisted)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Persist)
        .connect()
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE keep (x); INSERT INTO keep VALUES (1);")
        .execute(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    assert!(journal(&persisted).exists());
    let url = format!("sqlite://{}", persisted.display());
    let Err(Error::NotAStore(m)) = Store::open(&url).await else {
        panic!("another application's database is not a store")
    };
    assert!(m.contains("left unchanged"), "{m}");
}

/// A value `levels` arrays deep (`levels` 0: a number).
fn nested_array(levels: usize) -> serde_json::Value {
    let mut v = json!(1);
    for _ in 0..levels {
        v = serde_json::Value::Array(vec![v]);
    }
    v
}

fn call_with_input(id: &str, input: serde_json::Value) -> NewEvent {
    NewEvent::new(EventBody::ToolCall {
        call_id: id.into(),
        tool_name: "T".into(),
        input,
    })
}

// A library caller hands the store JSON values, not text: what the command
// line's parser refuses in a line (nesting past 127 levels counting the
// event's object, serde_json's reserved keys) is refused in values too,
// with the rule, field and index, before anything is stored. Stored, such
// an event could not be read back after a restart (its session and the
// global feed failed on it), and a value thousands of levels deep
// overflowed the stack of the task serializing it.
both_backends!(
    values_the_store_could_not_read_back_are_refused_before_they_are_stored,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();

        // The deepest value a line may hold (126 levels inside the event's
        // object) is stored and read back by a new process's store.
        let deepest = nested_array(126);
        let line = format!(
            r#"{{"type": "tool_call", "call_id": "c0", "tool_name": "T", "input": {deepest}}}"#
        );
        assert!(parse_line(&line, LineKind::Append, 1 << 20).is_ok());
        store
            .append(s, 1, vec![call_with_input("c0", deepest.clone())])
            .await
            .unwrap();

        // One level more, in a batch after a valid event: refused at its
        // index, nothing of the batch stored.
        let err = store
            .append(
                s,
                2,
                vec![prompt("before"), call_with_input("c1", nested_array(127))],
            )
            .await
            .unwrap_err();
        let Error::Invalid(v) = &err else {
            panic!("expected a validation error, got {err:?}")
        };
        assert_eq!(v.rule, Rule::MalformedJson, "{v}");
        assert_eq!(v.field.as_deref(), Some("input"), "{v}");
        assert_eq!(v.index, Some(1), "{v}");
        assert!(v.message.contains("127 levels"), "{v}");

        // An earlier event's own error comes first (§2: event by event).
        let err = store
            .append(
                s,
                2,
                vec![
                    NewEvent::new(EventBody::ToolResult {
                        call_id: "nobody".into(),
                        tool_name: "T".into(),
                        status: ToolStatus::Success,
                        output: None,
                        added_tool_names: None,
                    }),
                    call_with_input("c1", nested_array(127)),
                ],
            )
            .await
            .unwrap_err();
        let Error::Invalid(v) = &err else {
            panic!("expected a validation error, got {err:?}")
        };
        assert_eq!(v.rule, Rule::ResultWithoutCall, "{v}");
        assert_eq!(v.index, Some(0), "{v}");

        // Far deeper, judged on a runtime worker's stack: refused, no
        // overflow.
        let deep = tokio::spawn({
            let store = Store::open(&url).await.unwrap();
            async move {
                let r = store
                    .append(s, 2, vec![call_with_input("c2", nested_array(20_000))])
                    .await;
                // append_at_head retries with copies of its batch: cut
                // before any copy is made.
                let at_head = store
                    .append_at_head(
                        s,
                        vec![prompt("first"), call_with_input("c2", nested_array(20_000))],
                        &session_store::RetryPolicy::default(),
                    )
                    .await;
                store.close().await;
                match at_head {
                    Err(Error::Invalid(v)) if v.index == Some(1) => r,
                    other => panic!("append_at_head answered {other:?}"),
                }
            }
        })
        .await
        .unwrap();
        assert!(
            matches!(&deep, Err(Error::Invalid(v)) if v.rule == Rule::MalformedJson),
            "{deep:?}"
        );

        // serde_json's reserved keys, in an input and as a metadata key.
        for key in [
            "$serde_json::private::Number",
            "$serde_json::private::RawValue",
        ] {
            let mut input = serde_json::Map::new();
            input.insert(key.to_owned(), json!("1"));
            let err = store
                .append(s, 2, vec![call_with_input("c3", json!({"a": [input]}))])
                .await
                .unwrap_err();
            assert!(
                matches!(&err, Error::Invalid(v) if v.rule == Rule::MalformedJson
                    && v.field.as_deref() == Some("input") && v.message.contains(key)),
                "{err:?}"
            );
            let mut metadata = serde_json::Map::new();
            metadata.insert(key.to_owned(), json!(1));
            let err = store
                .append(
                    Uuid::new_v4(),
                    0,
                    vec![NewEvent::new(EventBody::SessionStarted {
                        mode: "agent".into(),
                        metadata: Some(metadata),
                    })],
                )
                .await
                .unwrap_err();
            assert!(
                matches!(&err, Error::Invalid(v) if v.field.as_deref() == Some("metadata")),
                "{err:?}"
            );
        }

        // Nothing of the refused batches was stored, and what was stored
        // reads back in a new store (no cache).
        store.close().await;
        let reopened = Store::open(&url).await.unwrap();
        let events = all_events(&reopened, s).await;
        assert_eq!(events.len(), 2);
        match &events[1].body {
            EventBody::ToolCall { input, .. } => assert_eq!(input, &deepest),
            other => panic!("{other:?}"),
        }
        assert_eq!(reopened.verify(s).await.unwrap(), None);
    }
);

// Found by a review of the library's other entry points: a result naming a
// hundred thousand tools made `explain` and `refreshes` quadratic (15 s),
// `verify_integrity` of a session that does not exist said it was intact,
// and `stored_events` answered a repeated id once per chunk it fell in.
both_backends!(
    edge_inputs_of_the_audit_and_integrity_reads,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let names: Vec<String> = (0..50_000).map(|i| format!("t{i}")).collect();
        store
            .append(
                s,
                0,
                vec![
                    started(),
                    call("c1", "ToolSearch"),
                    NewEvent::new(EventBody::ToolResult {
                        call_id: "c1".into(),
                        tool_name: "ToolSearch".into(),
                        status: ToolStatus::Success,
                        output: None,
                        added_tool_names: Some(names),
                    }),
                    prompt("next"),
                ],
            )
            .await
            .unwrap();
        let start = std::time::Instant::now();
        let why = store
            .explain(s, "t49999", session_store::audit::At::Latest)
            .await
            .unwrap();
        let mut refreshes = 0;
        store
            .refreshes(s, session_store::audit::At::Latest, |_| {
                refreshes += 1;
                Ok::<(), Error>(())
            })
            .await
            .unwrap();
        // Seconds of margin for a debug build on a busy machine; the
        // quadratic dedup took tens of seconds here.
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "explain and refreshes of 50 000 names took {:?}",
            start.elapsed()
        );
        assert!(format!("{why:?}").contains("t49999"), "{why:?}");
        assert_eq!(refreshes, 1);

        let missing = Uuid::new_v4();
        let r = store.verify_integrity(Some(missing)).await;
        assert!(
            matches!(r, Err(Error::SessionNotFound(id)) if id == missing),
            "{r:?}"
        );

        let stored = all_events(&store, s).await;
        let mut ids = vec![stored[0].event_id; 5_000];
        ids.push(stored[1].event_id);
        let found = store.stored_events(&ids).await.unwrap();
        assert_eq!(found.len(), 2, "each stored id once");
    }
);

/// A command that only reads (`create_if_missing: false`) does not make
/// the store's tables in a PostgreSQL database that has none (another
/// application's, a mistyped name): it says there is no store there, and
/// the database is left as it was, as for a SQLite path (found by an
/// adversarial review: `context` made 9 tables in another application's
/// database). A store made by a writer then opens for reading.
#[tokio::test]
async fn postgres_a_read_of_a_database_without_a_store_changes_nothing() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let tables = || async {
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        pool.close().await;
        n
    };
    {
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        sqlx::query("CREATE TABLE customers (id INTEGER)")
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
    let read_only = || session_store::StoreOptions {
        create_if_missing: false,
        ..Default::default()
    };
    match Store::open_with(&db.url, read_only()).await {
        Err(Error::NotAStore(m)) => assert!(
            m.contains("there is no session store in the PostgreSQL database"),
            "{m}"
        ),
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert_eq!(tables().await, 1, "only the application's own table");
    let writer = Store::open(&db.url).await.unwrap();
    writer.close().await;
    let reader = Store::open_with(&db.url, read_only()).await.unwrap();
    assert_eq!(reader.head_seq(Uuid::new_v4()).await.unwrap(), 0);
    reader.close().await;
}

/// A database without the migrator's table but with a table of the
/// store's name is another application's: no command, not even one that
/// may create the store, migrates it (the first migration made
/// `_sqlx_migrations` beside it and then failed on `events`, exit 4).
#[tokio::test]
async fn postgres_a_foreign_table_of_the_stores_name_is_not_migrated_over() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::query("CREATE TABLE events (x TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    match Store::open(&db.url).await {
        Err(Error::NotAStore(m)) => assert!(
            m.contains("is not a session store") && m.contains("holds events"),
            "{m}"
        ),
        other => panic!("{:?}", other.map(|_| ())),
    }
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(tables, ["events"]);
    pool.close().await;
}

/// The store lives in the schema its migrations write to (the first of
/// the `search_path` that exists): another application's `public.events`
/// on the path is not the store's, and a new store in a schema of its own
/// beside it is made (the check of a foreign table once looked a name up
/// through the whole path and refused it). A role that may not read the
/// migrator's table is said as that, not as a database of something else.
#[tokio::test]
async fn postgres_a_store_in_a_schema_of_its_own_beside_a_public_events_table() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    for sql in [
        "CREATE TABLE public.events (x TEXT)",
        "CREATE SCHEMA sess",
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET search_path = sess, public', current_database()); END $$",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    pool.close().await;
    let store = Store::open(&db.url).await.unwrap();
    let s = Uuid::new_v4();
    store.append(s, 0, vec![started()]).await.unwrap();
    store.close().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let events_tables: Vec<String> = sqlx::query_scalar(
        "SELECT schemaname::text FROM pg_tables WHERE tablename = 'events' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(events_tables, ["public", "sess"]);
    let n: i64 = sqlx::query_scalar("SELECT count(x) FROM public.events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0, "the application's table is as it was");

    let role = format!("stranger_{}", Uuid::new_v4().simple());
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA sess TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA sess TO {role}"),
        format!("REVOKE ALL ON sess._sqlx_migrations FROM {role}"),
    ] {
        sqlx::query(&sql).execute(&pool).await.unwrap();
    }
    pool.close().await;
    let url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    assert_ne!(url, db.url);
    match Store::open(&url).await {
        Err(Error::NotAStore(m)) => panic!("said as no store: {m}"),
        Err(e) => assert!(e.to_string().contains("permission denied"), "{e}"),
        Ok(_) => panic!("opened without reading the migrations"),
    }
}

both_backends!(
    a_position_at_the_end_of_its_range_is_said_not_overflowed,
    |url: String| async move {
        // Positions and seqs are i64s the store hands out one by one; a row
        // (or PostgreSQL's counter) written around the store at the end of
        // the range must be said, not overflowed (a panic in a debug build,
        // negative positions no feed returns in a release build).
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store.append(s, 0, vec![started()]).await.unwrap();
        store.close().await;
        let edit = if url.starts_with("postgres") {
            "UPDATE event_position SET last = 9223372036854775807 WHERE id = 1".to_owned()
        } else {
            format!(
                "INSERT INTO events (position, session_id, seq, event_id, type, payload, recorded_at) \
                 VALUES (9223372036854775807, '{}', 1, '{}', 'session_started', \
                 '{{\"type\":\"session_started\",\"mode\":\"a\"}}', '2026-12-07T00:00:00.000000Z')",
                Uuid::new_v4(),
                Uuid::new_v4()
            )
        };
        let at = url.clone();
        tokio::task::spawn_blocking(move || common::raw_sql(&at, &edit))
            .await
            .unwrap();
        let store = Store::open(&url).await.unwrap();
        let err = store.append(s, 1, vec![prompt("p")]).await.unwrap_err();
        assert!(
            matches!(&err, Error::Corrupt(m) if m.contains("9223372036854775807")),
            "{err:?}"
        );
        assert_eq!(store.head_seq(s).await.unwrap(), 1, "nothing stored");
    }
);
