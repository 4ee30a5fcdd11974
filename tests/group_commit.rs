//! Group commit (src/store/group.rs): appends that run at the same time in
//! one process may share a transaction, and each is still judged alone, on
//! SQLite and PostgreSQL.

mod common;

use std::sync::Arc;

use std::time::Duration;

use session_store::{
    BackendKind, Error, EventBody, NewEvent, RetryPolicy, Store, StoreOptions, ToolStatus,
};
use uuid::Uuid;

fn started() -> NewEvent {
    NewEvent::new(EventBody::SessionStarted {
        mode: "agent".into(),
        metadata: None,
    })
}

fn prompt(text: &str) -> NewEvent {
    NewEvent::new(EventBody::PromptSubmitted { text: text.into() })
}

fn orphan_result() -> NewEvent {
    NewEvent::new(EventBody::ToolResult {
        call_id: "never-called".into(),
        tool_name: "Read".into(),
        status: ToolStatus::Success,
        output: None,
        added_tool_names: None,
    })
}

async fn spawn_appends(
    store: &Arc<Store>,
    sessions: &[Uuid],
    round: usize,
) -> Vec<Result<(), Error>> {
    let mut tasks = Vec::new();
    for (i, s) in sessions.iter().copied().enumerate() {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            // Every fourth writer sends a batch that breaks a rule, every
            // fifth expects a seq the session is not at.
            let batch = if i % 4 == 3 {
                vec![prompt("fine"), orphan_result()]
            } else {
                vec![prompt(&format!("round {round}"))]
            };
            let expected = match (i % 4 == 3, i % 5 == 4) {
                (_, true) => 0,
                (true, false) => 1,
                (false, false) => 1 + round as i64,
            };
            store.append(s, expected, batch).await.map(|_| ())
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

both_backends!(
    concurrent_appends_are_judged_one_by_one_and_positions_stay_dense,
    |url: String| async move {
        let store = Arc::new(Store::open(&url).await.unwrap());
        let sessions: Vec<Uuid> = (0..16).map(|_| Uuid::new_v4()).collect();
        for s in &sessions {
            store.append(*s, 0, vec![started()]).await.unwrap();
        }
        let mut stored = sessions.len() as i64;
        for round in 0..10 {
            let results = spawn_appends(&store, &sessions, round).await;
            for (i, r) in results.iter().enumerate() {
                match (i % 4 == 3, i % 5 == 4) {
                    (_, true) => assert!(
                        matches!(r, Err(Error::Conflict { .. })),
                        "writer {i}: a stale expected seq conflicts: {r:?}"
                    ),
                    (true, false) => assert!(
                        matches!(r, Err(Error::Invalid(_))),
                        "writer {i}: the invalid batch is rejected: {r:?}"
                    ),
                    (false, false) => assert!(r.is_ok(), "writer {i}: {r:?}"),
                }
            }
            stored += results.iter().filter(|r| r.is_ok()).count() as i64;
        }
        // Only the accepted batches are stored, each whole, and the global
        // order has no hole where a rejected batch was judged.
        let feed = store.feed(0, 100_000).await.unwrap();
        assert_eq!(feed.len() as i64, stored);
        let positions: Vec<i64> = feed.iter().map(|e| e.position).collect();
        assert_eq!(positions, (1..=stored).collect::<Vec<_>>());
        for (i, s) in sessions.iter().enumerate() {
            let expected = if i % 4 == 3 || i % 5 == 4 { 1 } else { 11 };
            assert_eq!(store.head_seq(*s).await.unwrap(), expected, "session {i}");
            assert_eq!(store.verify(*s).await.unwrap(), None, "session {i}");
        }
        store.close().await;
    }
);

both_backends!(
    many_writers_at_the_head_of_one_session_all_land,
    |url: String| async move {
        let store = Arc::new(Store::open(&url).await.unwrap());
        let session = Uuid::new_v4();
        store.append(session, 0, vec![started()]).await.unwrap();
        let mut tasks = Vec::new();
        for w in 0..16 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..10 {
                    let e = prompt(&format!("w{w} {i}")).with_id(Uuid::new_v4());
                    store
                        .append_at_head(session, vec![e], &RetryPolicy::default())
                        .await
                        .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(store.head_seq(session).await.unwrap(), 161);
        assert_eq!(store.verify(session).await.unwrap(), None);
        // A fresh process sees the same state as this one's cache.
        let cached = store.activations(session, None).await.unwrap();
        store.clear_cache();
        assert_eq!(store.activations(session, None).await.unwrap(), cached);
        store.close().await;
    }
);

fn call(call_id: &str, tool: &str) -> NewEvent {
    NewEvent::new(EventBody::ToolCall {
        call_id: call_id.into(),
        tool_name: tool.into(),
        input: serde_json::json!({}),
    })
}

fn result(call_id: &str, tool: &str, added: Option<Vec<String>>) -> NewEvent {
    NewEvent::new(EventBody::ToolResult {
        call_id: call_id.into(),
        tool_name: tool.into(),
        status: ToolStatus::Success,
        output: None,
        added_tool_names: added,
    })
}

// A refusal judged against an earlier append of its own group is answered
// once that append is committed: a 409 names a head a read then finds (a
// review read the head right after a 409 and found the append that made
// it not yet committed, 45 times in 900).
both_backends!(
    a_conflict_is_answered_after_the_commit_that_made_its_head,
    |url: String| async move {
        let options = StoreOptions {
            fault_pause_before_commit: Some(Duration::from_millis(600)),
            ..StoreOptions::default()
        };
        let store = Arc::new(Store::open_with(&url, options).await.unwrap());
        let reader = Store::open(&url).await.unwrap();
        let (s, blocker) = (Uuid::new_v4(), Uuid::new_v4());
        store.append(s, 0, vec![started()]).await.unwrap();
        let first = store.clone();
        let holder = tokio::spawn(async move { first.append(blocker, 0, vec![started()]).await });
        tokio::time::sleep(Duration::from_millis(150)).await;
        // Both queue behind the held commit, so they share the next group.
        let a = {
            let store = store.clone();
            tokio::spawn(async move { store.append(s, 1, vec![prompt("a")]).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let refused = store.append(s, 1, vec![prompt("b")]).await;
        let head_then = reader.head_seq(s).await.unwrap();
        match refused {
            Err(Error::Conflict { current, .. }) => assert_eq!(current, 2),
            other => panic!("expected a conflict: {other:?}"),
        }
        assert_eq!(head_then, 2, "the 409's head is committed when it is said");
        assert_eq!(a.await.unwrap().unwrap().events[0].seq, 2);
        holder.await.unwrap().unwrap();
    }
);

// Appends that depend on one another, queued behind a commit held open so
// that they are committed in one group: a call and its result in different
// appends, two refresh points, a retry of an event the group wrote, a
// reused event id, a session created by a tenant and appended to again.
// A backend that reads ahead for the group and writes late (PostgreSQL)
// must judge and store them exactly as one by one.
both_backends!(
    dependent_appends_in_one_group_are_judged_as_one_by_one,
    |url: String| async move {
        let options = StoreOptions {
            fault_pause_before_commit: Some(Duration::from_millis(600)),
            ..StoreOptions::default()
        };
        let store = Arc::new(Store::open_with(&url, options).await.unwrap());
        let (s, blocker, owned) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let catalog = NewEvent::new(EventBody::CatalogDefined {
            mode: "agent".into(),
            deferred_tools: vec!["Deploy".into(), "Grep".into()],
        });
        store.append(s, 0, vec![started(), catalog]).await.unwrap();

        let first = store.clone();
        let holder = tokio::spawn(async move { first.append(blocker, 0, vec![started()]).await });
        tokio::time::sleep(Duration::from_millis(150)).await;

        let search = call("c1", "ToolSearch").with_id(Uuid::new_v4());
        let mut reused = call("c9", "Grep");
        reused.event_id = search.event_id;
        type Job = (Option<&'static str>, Uuid, i64, Vec<NewEvent>);
        let jobs: Vec<Job> = vec![
            (None, s, 2, vec![search.clone()]),
            (
                None,
                s,
                3,
                vec![
                    result("c1", "ToolSearch", Some(vec!["Deploy".into()])),
                    prompt("one"),
                ],
            ),
            (None, s, 2, vec![search.clone()]),
            (None, s, 5, vec![reused]),
            (None, s, 5, vec![call("c2", "Deploy"), prompt("two")]),
            (Some("t1"), owned, 0, vec![started()]),
            (None, s, 7, vec![result("c2", "Deploy", None)]),
            (Some("t1"), owned, 1, vec![prompt("mine")]),
        ];
        let mut tasks = Vec::new();
        for (tenant, session, expected, events) in jobs {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                store.append_as(tenant, session, expected, events).await
            }));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.unwrap());
        }
        holder.await.unwrap().unwrap();

        let seqs = |i: usize| -> Vec<i64> {
            let o = outcomes[i]
                .as_ref()
                .unwrap_or_else(|e| panic!("append {i}: {e}"));
            o.events.iter().map(|a| a.seq).collect()
        };
        assert_eq!(seqs(0), vec![3]);
        assert_eq!(seqs(1), vec![4, 5]);
        assert_eq!(seqs(2), vec![3], "the retry is answered from the log");
        assert!(outcomes[2].as_ref().unwrap().replayed);
        assert!(
            matches!(outcomes[3], Err(Error::Invalid(_))),
            "a reused event id is refused: {:?}",
            outcomes[3]
        );
        assert_eq!(seqs(4), vec![6, 7]);
        assert_eq!(seqs(5), vec![1]);
        assert_eq!(seqs(6), vec![8]);
        assert_eq!(seqs(7), vec![2]);

        assert_eq!(store.head_seq(s).await.unwrap(), 8);
        assert_eq!(store.verify(s).await.unwrap(), None);
        assert_eq!(store.verify(owned).await.unwrap(), None);
        assert_eq!(
            store.session_owner(owned).await.unwrap().as_deref(),
            Some("t1")
        );
        let cached = store.activations(s, None).await.unwrap();
        store.clear_cache();
        let fresh = store.activations(s, None).await.unwrap();
        assert_eq!(fresh, cached);
        let names: Vec<&str> = fresh.tools.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, vec!["Deploy"]);
        // Dense global order: 8 events of `s`, 1 of the holder, 2 of `owned`.
        let feed = store.feed(0, 1000).await.unwrap();
        let positions: Vec<i64> = feed.iter().map(|e| e.position).collect();
        assert_eq!(positions, (1..=11).collect::<Vec<_>>());
        store.close().await;
    }
);

// Two instances on one database: each append of one instance after the
// other wrote is judged against the log, not against the head the first
// instance last saw (PostgreSQL judges a lone append on that head and
// checks it in the write).
both_backends!(
    appends_after_another_instance_wrote_are_judged_against_the_log,
    |url: String| async move {
        let a = Store::open(&url).await.unwrap();
        let b = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        a.append(s, 0, vec![started()]).await.unwrap();
        a.append(s, 1, vec![prompt("a1")]).await.unwrap();
        let from_b = prompt("b1").with_id(Uuid::new_v4());
        b.append(s, 2, vec![from_b.clone()]).await.unwrap();

        // `a` last saw head 2; the head is 3.
        match a.append(s, 2, vec![]).await {
            Err(Error::Conflict { current, .. }) => assert_eq!(current, 3),
            other => panic!("an empty batch at a stale seq conflicts: {other:?}"),
        }
        match a.append(s, 2, vec![prompt("late")]).await {
            Err(Error::Conflict { current, .. }) => assert_eq!(current, 3),
            other => panic!("a stale expected seq conflicts: {other:?}"),
        }
        let retry = a.append(s, 2, vec![from_b]).await.unwrap();
        assert!(retry.replayed, "b's event sent again through a is a retry");
        assert_eq!(retry.events[0].seq, 3);
        assert_eq!(
            a.append(s, 3, vec![prompt("a2")]).await.unwrap().events[0].seq,
            4
        );

        // `a` saw head 4 committed; `b` appends 5; `a` appends at the head.
        b.append(s, 4, vec![prompt("b2")]).await.unwrap();
        let at_head = a
            .append_at_head(s, vec![prompt("a3")], &RetryPolicy::default())
            .await
            .unwrap();
        assert_eq!(at_head.events[0].seq, 6);
        b.append(s, 5, vec![])
            .await
            .expect_err("b's expected seq is stale");
        assert_eq!(
            b.append(s, 6, vec![prompt("b3")]).await.unwrap().events[0].seq,
            7
        );

        assert_eq!(a.verify(s).await.unwrap(), None);
        let feed = a.feed(0, 100).await.unwrap();
        let seqs: Vec<i64> = feed.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=7).collect::<Vec<_>>());
        let positions: Vec<i64> = feed.iter().map(|e| e.position).collect();
        assert_eq!(positions, (1..=7).collect::<Vec<_>>());
        a.clear_cache();
        assert_eq!(
            a.activations(s, None).await.unwrap(),
            b.activations(s, None).await.unwrap()
        );
        a.close().await;
        b.close().await;
    }
);

// An append whose caller gives up while its transaction is open (here,
// held open before its commit) is rolled back, and the write lock is free
// again at once: another instance appends where the abandoned append would
// have, and the first instance appends after it. A backend that sends its
// transaction's first statement or its writes late (SQLite's writer) must
// still undo them.
both_backends!(
    an_append_abandoned_before_its_commit_leaves_nothing_and_frees_the_writer,
    |url: String| async move {
        let options = StoreOptions {
            fault_pause_before_commit: Some(Duration::from_millis(800)),
            ..StoreOptions::default()
        };
        let slow = Store::open_with(&url, options).await.unwrap();
        let other = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let given_up = tokio::time::timeout(
            Duration::from_millis(200),
            slow.append(s, 0, vec![started()]),
        )
        .await;
        assert!(given_up.is_err(), "the append should still be waiting");

        // Well inside SQLite's 10 s busy timeout: the lock was released.
        let started_at = std::time::Instant::now();
        let o = tokio::time::timeout(
            Duration::from_secs(5),
            other.append(s, 0, vec![started(), prompt("from the other one")]),
        )
        .await
        .expect("the other instance waited for a lock nobody holds")
        .unwrap();
        assert_eq!(o.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
        assert!(started_at.elapsed() < Duration::from_secs(2));

        let o = slow.append(s, 2, vec![prompt("mine")]).await.unwrap();
        assert_eq!(o.events[0].seq, 3);
        assert_eq!(slow.head_seq(s).await.unwrap(), 3);
        assert_eq!(other.verify(s).await.unwrap(), None);
        let texts: Vec<String> = other
            .history(s, 0, 10)
            .await
            .unwrap()
            .into_iter()
            .filter_map(|e| match e.body {
                EventBody::PromptSubmitted { text } => Some(text),
                _ => None,
            })
            .collect();
        assert_eq!(texts, ["from the other one", "mine"]);
        slow.close().await;
        other.close().await;
    }
);

// A group does not read ahead the view of a session whose state this
// process's cache knows (an append of its own left it). When another
// instance appended a refresh point meanwhile, the append must read the
// view it changed, and write its view and activation changes as if it had
// been read ahead: `verify` recomputes both from the log.
both_backends!(
    a_view_changed_by_another_instance_is_read_when_the_cache_is_stale,
    |url: String| async move {
        let (a, b) = (
            Store::open(&url).await.unwrap(),
            Store::open(&url).await.unwrap(),
        );
        let s = Uuid::new_v4();
        let catalog = NewEvent::new(EventBody::CatalogDefined {
            mode: "agent".into(),
            deferred_tools: vec!["Deploy".into(), "Grep".into()],
        });
        a.append(s, 0, vec![started(), catalog, prompt("one")])
            .await
            .unwrap();
        b.append(
            s,
            3,
            vec![
                call("c1", "ToolSearch"),
                result("c1", "ToolSearch", Some(vec!["Deploy".into()])),
                prompt("two"),
            ],
        )
        .await
        .unwrap();
        // No read by `a` in between: its cache still holds seq 3.
        a.append(s, 6, vec![prompt("three")]).await.unwrap();
        assert_eq!(a.verify(s).await.unwrap(), None);
        let active = a.activations(s, None).await.unwrap();
        assert_eq!(active.as_of_seq, 7);
        assert_eq!(
            active
                .tools
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            vec!["Deploy"]
        );
    }
);

// A group whose appends hold more event rows than one insert statement
// takes (500 on SQLite) writes them in several, in position order, across
// appends; warm sessions make it an optimistic group on both backends.
both_backends!(
    a_group_of_more_rows_than_one_insert_takes_is_stored_whole_and_in_order,
    |url: String| async move {
        let (store, sessions, holder) = four_warm_sessions_behind_a_held_slot(&url).await;
        let mut tasks = Vec::new();
        for (i, s) in sessions.iter().copied().enumerate() {
            let store = store.clone();
            let expected = if i == 0 { 3 } else { 2 };
            tasks.push(tokio::spawn(async move {
                let batch: Vec<NewEvent> = (0..180).map(|n| prompt(&format!("{i}:{n}"))).collect();
                store.append(s, expected, batch).await
            }));
        }
        holder.await.unwrap().unwrap();
        for t in tasks {
            let outcome = t.await.unwrap().unwrap();
            assert_eq!(outcome.events.len(), 180);
        }
        let feed = store.feed(0, 10_000).await.unwrap();
        let positions: Vec<i64> = feed.iter().map(|e| e.position).collect();
        assert_eq!(positions, (1..=feed.len() as i64).collect::<Vec<_>>());
        assert_eq!(feed.len(), 4 * 2 + 1 + 4 * 180);
        for s in &sessions {
            let seqs: Vec<i64> = feed
                .iter()
                .filter(|e| e.session_id == *s)
                .map(|e| e.seq)
                .collect();
            assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
            assert_eq!(store.verify(*s).await.unwrap(), None);
        }
        let paths = store.append_paths();
        assert!(paths.optimistic >= 1, "{paths:?}");
    }
);

// Rows sent ahead (docs/design.md, "Rows sent ahead"): in an optimistic
// group of long batches, SQLite writes the first batches' rows while the
// later ones are judged. One batch refused at its end sends the whole
// group to the lock, which stores the others whole and nothing of it, at
// positions without a hole.
both_backends!(
    a_refused_long_batch_of_an_optimistic_group_leaves_nothing_behind,
    |url: String| async move {
        let (store, sessions, holder) = four_warm_sessions_behind_a_held_slot(&url).await;
        let mut tasks = Vec::new();
        for (i, s) in sessions.iter().copied().enumerate() {
            let store = store.clone();
            let expected = if i == 0 { 3 } else { 2 };
            tasks.push(tokio::spawn(async move {
                let mut batch: Vec<NewEvent> =
                    (0..40).map(|n| prompt(&format!("{i}:{n}"))).collect();
                if i == 2 {
                    batch.push(orphan_result());
                }
                store.append(s, expected, batch).await
            }));
        }
        holder.await.unwrap().unwrap();
        for (i, t) in tasks.into_iter().enumerate() {
            match (i, t.await.unwrap()) {
                (2, Err(Error::Invalid(v))) => assert_eq!(v.index, Some(40)),
                (2, other) => panic!("the third batch ends with an orphan result: {other:?}"),
                (_, Ok(outcome)) => assert_eq!(outcome.events.len(), 40),
                (_, Err(e)) => panic!("batch {i} is valid: {e:?}"),
            }
        }
        let feed = store.feed(0, 10_000).await.unwrap();
        let positions: Vec<i64> = feed.iter().map(|e| e.position).collect();
        assert_eq!(positions, (1..=feed.len() as i64).collect::<Vec<_>>());
        assert_eq!(feed.len(), 4 * 2 + 1 + 3 * 40);
        assert_eq!(store.head_seq(sessions[2]).await.unwrap(), 2);
        store.clear_cache();
        for (i, s) in sessions.iter().enumerate() {
            let expected = match i {
                0 => 43,
                2 => 2,
                _ => 42,
            };
            assert_eq!(store.head_seq(*s).await.unwrap(), expected);
            assert_eq!(store.verify(*s).await.unwrap(), None);
        }
        let paths = store.append_paths();
        assert!(paths.optimistic_abandoned >= 1, "{paths:?}");
        // SQLite sent the first batches' rows while judging the later ones.
        let sqlite = store.kind() == BackendKind::Sqlite;
        assert_eq!(paths.sends_ahead > 0, sqlite, "{paths:?}");
    }
);

/// A store whose writer slot is held 300 ms after each commit, four warm
/// sessions (two events each, so their next groups are optimistic), and a
/// held append to the first (seq 3) in flight: appends sent now make one
/// group.
async fn four_warm_sessions_behind_a_held_slot(
    url: &str,
) -> (
    Arc<Store>,
    Vec<Uuid>,
    tokio::task::JoinHandle<Result<session_store::AppendOutcome, Error>>,
) {
    let options = StoreOptions {
        // The slot is held this long after each commit, so the appends
        // sent meanwhile make one group.
        fault_pause_after_commit: Some(Duration::from_millis(300)),
        ..StoreOptions::default()
    };
    let store = Arc::new(Store::open_with(url, options).await.unwrap());
    let sessions: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    for s in &sessions {
        store.append(*s, 0, vec![started()]).await.unwrap();
        store.append(*s, 1, vec![prompt("warm")]).await.unwrap();
    }
    let holder = {
        let store = store.clone();
        let s = sessions[0];
        tokio::spawn(async move { store.append(s, 2, vec![prompt("hold")]).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    (store, sessions, holder)
}
