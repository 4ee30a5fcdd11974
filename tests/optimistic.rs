//! Optimistic appends (docs/design.md, "Optimistic appends"): once an
//! append of this process has left a session in its cache, the next group
//! is judged against the cache and written in one round trip that checks
//! what it assumed (PostgreSQL: the heads, in one call; SQLite: that the
//! log still ends where this writer's last commit left it, in the query
//! that takes the lock and commits). Every case here must end exactly as
//! an append judged under the lock would, on both backends; the tests also
//! check which path was taken, so a change that quietly sends everything
//! to the locked path (or nothing) fails. SQLite goes optimistic only
//! while the log is quiet: a locked group that finds another process wrote
//! since this one's last commit keeps the next group locked too.

mod common;

use session_store::store::query::{ChangeQuery, Scope};
use session_store::{
    AppendPaths, BackendKind, Error, EventBody, NewEvent, RetryPolicy, Rule, Store, ToolStatus,
};
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
        deferred_tools: tools.iter().map(|t| t.to_string()).collect(),
    })
}

fn prompt(text: &str) -> NewEvent {
    NewEvent::new(EventBody::PromptSubmitted { text: text.into() })
}

fn call(call_id: &str, tool: &str) -> NewEvent {
    NewEvent::new(EventBody::ToolCall {
        call_id: call_id.into(),
        tool_name: tool.into(),
        input: serde_json::json!({"q": call_id}),
    })
}

fn result(call_id: &str, tool: &str, added: &[&str]) -> NewEvent {
    NewEvent::new(EventBody::ToolResult {
        call_id: call_id.into(),
        tool_name: tool.into(),
        status: ToolStatus::Success,
        output: Some(serde_json::json!({"text": format!("output of {call_id}")})),
        added_tool_names: (!added.is_empty())
            .then(|| added.iter().map(|t| t.to_string()).collect()),
    })
}

fn compaction(summary: &str) -> NewEvent {
    NewEvent::new(EventBody::Compaction {
        summary: summary.into(),
        first_kept_event_id: None,
        tokens_before: None,
    })
}

/// The paths taken since `before`.
fn since(store: &Store, before: AppendPaths) -> AppendPaths {
    let now = store.append_paths();
    AppendPaths {
        locked: now.locked - before.locked,
        optimistic: now.optimistic - before.optimistic,
        optimistic_abandoned: now.optimistic_abandoned - before.optimistic_abandoned,
        sends_ahead: now.sends_ahead - before.sends_ahead,
    }
}

fn is_pg(store: &Store) -> bool {
    store.kind() == BackendKind::Postgres
}

/// What the store answers from its cache equals what a fresh process reads
/// from the log: state (positions included), activations; and the stored
/// view and calls index agree with a fold of the log.
async fn agrees_with_the_log(store: &Store, session: Uuid) {
    let cached = store.state(session, None).await.unwrap();
    let activations = store.activations(session, None).await.unwrap();
    store.clear_cache();
    let fresh = store.state(session, None).await.unwrap();
    assert_eq!(fresh.seq, cached.seq);
    let positions = |s: &session_store::SessionState| -> Vec<(i64, i64)> {
        s.rows.iter().map(|r| (r.seq, r.position)).collect()
    };
    assert_eq!(positions(&fresh), positions(&cached));
    assert_eq!(store.activations(session, None).await.unwrap(), activations);
    assert_eq!(store.verify(session).await.unwrap(), None);
    let report = store.verify_integrity(Some(session)).await.unwrap();
    assert!(report.breaks.is_empty(), "{:?}", report.breaks);
}

// A session's whole life appended one batch at a time by one instance:
// after the first append every group is optimistic on PostgreSQL, and the
// answers (seqs, positions), the global order, the activation changes and
// the cached state all agree with the log.
both_backends!(
    warm_appends_are_written_in_one_call_and_agree_with_the_log,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let other = Store::open(&url).await.unwrap();
        let (s, elsewhere) = (Uuid::new_v4(), Uuid::new_v4());
        let before = store.append_paths();
        let batches = vec![
            vec![started(), catalog(&["Deploy", "Grep"])],
            vec![prompt("find the deploy tool")],
            vec![call("c1", "ToolSearch")],
            vec![result("c1", "ToolSearch", &["Deploy"]), prompt("deploy it")],
            vec![call("c2", "Deploy"), result("c2", "Deploy", &[])],
            vec![compaction("searched and deployed"), prompt("again")],
            vec![call("c3", "Deploy")],
            vec![result("c3", "Deploy", &[]), prompt("done")],
        ];
        let mut answered = Vec::new();
        let mut head = 0;
        other.append(elsewhere, 0, vec![started()]).await.unwrap();
        for (i, batch) in batches.into_iter().enumerate() {
            let outcome = store.append(s, head, batch).await.unwrap();
            head = outcome.events.last().unwrap().seq;
            answered.extend(outcome.events);
            // Another instance takes positions in between: the optimistic
            // write must move this one's past them.
            if i % 3 == 1 {
                other
                    .append_at_head(
                        elsewhere,
                        vec![prompt("meanwhile")],
                        &RetryPolicy::default(),
                    )
                    .await
                    .unwrap();
            }
        }
        let paths = since(&store, before);
        if is_pg(&store) {
            assert_eq!(paths.locked, 1, "only the first append is cold: {paths:?}");
            assert_eq!(paths.optimistic, 7, "{paths:?}");
            assert_eq!(paths.optimistic_abandoned, 0, "{paths:?}");
        } else {
            // Batches 0 and 1 locked (no commit known, then the log seen
            // quiet); 2 and 5 follow the other instance's appends: their
            // check fails and they go to the lock, which sees the log was
            // not quiet, so 3 and 6 are locked too; 4 and 7 are optimistic.
            assert_eq!(
                (paths.optimistic, paths.optimistic_abandoned, paths.locked),
                (4, 2, 6),
                "{paths:?}"
            );
        }

        let feed = store.feed(0, 1000).await.unwrap();
        let positions: Vec<i64> = feed.iter().map(|e| e.position).collect();
        assert_eq!(positions, (1..=feed.len() as i64).collect::<Vec<_>>());
        for a in &answered {
            let stored = feed.iter().find(|e| e.event_id == a.event_id).unwrap();
            assert_eq!((stored.seq, stored.position), (a.seq, a.position));
        }
        // Each activation change carries its event's position.
        let changes = store
            .audit_changes(&ChangeQuery {
                scope: Scope {
                    session: Some(s),
                    limit: 100,
                    ..Scope::default()
                },
                ..ChangeQuery::default()
            })
            .await
            .unwrap()
            .changes;
        assert!(!changes.is_empty());
        for c in &changes {
            let event = feed.iter().find(|e| e.session_id == s && e.seq == c.seq);
            assert_eq!(event.map(|e| e.position), Some(c.position), "{c:?}");
        }
        agrees_with_the_log(&store, s).await;
        store.close().await;
        other.close().await;
    }
);

// A compaction can leave a call before the window while its result is
// still to come (several writers on one session; a tool that runs across a
// compaction). The cache keeps the latest 64 such calls (`OPEN_CALLS_KEPT`
// in src/store/cache.rs), so their results are judged from it; before, each
// such result was refused from the cache and its group judged again under
// the lock. An older one is still answered, under the lock.
both_backends!(
    a_result_for_a_call_before_the_window_stays_optimistic,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let mut head = 0;
        let append = |head: &mut i64, batch: Vec<NewEvent>| {
            let store = &store;
            let at = *head;
            *head += batch.len() as i64;
            async move { store.append(s, at, batch).await.unwrap() }
        };
        append(&mut head, vec![started(), catalog(&["Deploy"])]).await;
        append(&mut head, vec![prompt("deploy")]).await;
        let calls: Vec<String> = (0..65).map(|i| format!("c{i}")).collect();
        append(&mut head, calls.iter().map(|c| call(c, "Deploy")).collect()).await;
        append(
            &mut head,
            vec![compaction("65 deploys started"), prompt("go on")],
        )
        .await;
        // Warm again after the compaction's group (SQLite's first groups
        // are locked until the log is seen quiet).
        append(&mut head, vec![prompt("still waiting")]).await;

        let before = store.append_paths();
        append(&mut head, vec![result("c64", "Deploy", &[])]).await;
        append(
            &mut head,
            vec![result("c1", "Deploy", &[]), prompt("two done")],
        )
        .await;
        let paths = since(&store, before);
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (2, 0, 0),
            "{paths:?}"
        );
        // A second result is refused, while the call is cached (here) and
        // once it is not (below).
        let duplicate = |e: Error| match e {
            Error::Invalid(v) => assert_eq!(v.rule, Rule::DuplicateResult),
            other => panic!("{other:?}"),
        };
        duplicate(
            store
                .append(s, head, vec![result("c64", "Deploy", &[])])
                .await
                .unwrap_err(),
        );
        // The refusal took the session out of the cache: warm it again.
        append(&mut head, vec![prompt("warm again")]).await;

        // c0 is the 65th open call before the window: forgotten by the
        // cache, read under the lock, and accepted there.
        let before = store.append_paths();
        let outcome = append(&mut head, vec![result("c0", "Deploy", &[])]).await;
        assert_eq!(outcome.events.len(), 1);
        let paths = since(&store, before);
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (1, 1, 1),
            "{paths:?}"
        );
        store.clear_cache();
        duplicate(
            store
                .append(s, head, vec![result("c64", "Deploy", &[])])
                .await
                .unwrap_err(),
        );
        agrees_with_the_log(&store, s).await;
        store.close().await;
    }
);

// Two instances taking turns on one session (a load balancer without
// affinity): each turn's optimistic call would find the head moved, then
// read the session cold and judge it again under the lock. After the first
// miss the session goes to the lock directly, caught up from the cache;
// once the other instance stops, a locked group finds the session quiet and
// the next one is optimistic again.
both_backends!(
    instances_taking_turns_go_to_the_lock_directly,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let other = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        async fn at_head(store: &Store, s: Uuid, batch: Vec<NewEvent>) {
            let policy = RetryPolicy::default();
            store.append_at_head(s, batch, &policy).await.unwrap();
        }
        at_head(&store, s, vec![started(), catalog(&["Deploy"])]).await;
        at_head(&store, s, vec![prompt("one")]).await;
        at_head(&store, s, vec![prompt("two")]).await;
        let before = store.append_paths();
        for turn in 0..6 {
            at_head(&other, s, vec![prompt(&format!("other {turn}"))]).await;
            at_head(&store, s, vec![prompt(&format!("this {turn}"))]).await;
        }
        // One failed attempt, then the lock directly (SQLite's rule that
        // stays locked while the log is not quiet did this already; on
        // PostgreSQL, without the mark, each turn failed: (6, 6, 6)).
        let paths = since(&store, before);
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (1, 1, 6),
            "{paths:?}"
        );
        // The other instance stops: one locked group finds the session
        // quiet, the next is optimistic.
        let before = store.append_paths();
        for i in 0..3 {
            at_head(&store, s, vec![prompt(&format!("alone {i}"))]).await;
        }
        let paths = since(&store, before);
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (2, 0, 1),
            "{paths:?}"
        );
        agrees_with_the_log(&store, s).await;
        agrees_with_the_log(&other, s).await;
        store.close().await;
        other.close().await;
    }
);

// Judged against the cache, these look new or wrong; the log says
// otherwise, and the log wins: each is answered as under the lock, the
// optimistic attempt leaves nothing behind, and the next append is
// optimistic again.
both_backends!(
    what_the_cache_cannot_see_is_judged_again_under_the_lock,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let other = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store
            .append(s, 0, vec![started(), catalog(&["Deploy"])])
            .await
            .unwrap();
        store
            .append(s, 2, vec![call("c1", "ToolSearch"), prompt("p")])
            .await
            .unwrap();
        // The compaction drops c1 from the window, and from the cache.
        store
            .append(s, 4, vec![compaction("searched")])
            .await
            .unwrap();

        // 1. A call id used before the window: the write's check finds it.
        let before = store.append_paths();
        let err = store
            .append(s, 5, vec![call("c1", "Deploy")])
            .await
            .expect_err("c1 is already used in this session");
        match err {
            Error::Invalid(v) => assert_eq!(v.rule, Rule::DuplicateCallId),
            other => panic!("expected a duplicate call id, got {other:?}"),
        }
        let paths = since(&store, before);
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (1, 1, 1)
        );
        assert_eq!(store.head_seq(s).await.unwrap(), 5);

        // 2. The result of a call before the window: the cache does not know
        // the call; the log does, and the result is accepted (§4).
        let ok = store
            .append(s, 5, vec![result("c1", "ToolSearch", &["Deploy"])])
            .await
            .unwrap();
        assert_eq!(ok.events[0].seq, 6);

        // 3. A retry of a stored batch (same event ids) at the head.
        let batch = vec![
            prompt("once").with_id(Uuid::new_v4()),
            call("c2", "Deploy").with_id(Uuid::new_v4()),
        ];
        let first = store
            .append_at_head(s, batch.clone(), &RetryPolicy::default())
            .await
            .unwrap();
        let before = store.append_paths();
        let again = store
            .append_at_head(s, batch, &RetryPolicy::default())
            .await
            .unwrap();
        assert!(again.replayed);
        assert_eq!(again.events, first.events);
        let paths = since(&store, before);
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (1, 1, 1)
        );

        // 4. Another instance appended: the head the cache holds is stale.
        store
            .append_at_head(
                s,
                vec![result("c2", "Deploy", &[])],
                &RetryPolicy::default(),
            )
            .await
            .unwrap();
        other
            .append(s, 9, vec![prompt("from other")])
            .await
            .unwrap();
        let before = store.append_paths();
        let moved = store
            .append_at_head(s, vec![prompt("after other")], &RetryPolicy::default())
            .await
            .unwrap();
        assert_eq!(moved.events[0].seq, 11);
        match store.append(s, 9, vec![prompt("stale")]).await {
            Err(Error::Conflict { current, .. }) => assert_eq!(current, 11),
            other => panic!("a stale expected seq conflicts: {other:?}"),
        }
        store.append(s, 11, vec![prompt("last")]).await.unwrap();
        let paths = since(&store, before);
        // The first write's check found the head moved (SQLite: the log)
        // and went to the lock; the session, marked as appended to by
        // another writer, then goes to the lock directly: the stale
        // expected seq is refused there, and the last append, locked too,
        // finds the session quiet (the next one would be optimistic).
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (1, 1, 3),
            "{paths:?}"
        );
        assert_eq!(store.head_seq(s).await.unwrap(), 12);
        agrees_with_the_log(&store, s).await;
        store.close().await;
        other.close().await;
    }
);

// A result whose call an earlier compaction summarized stays in the
// window; a later compaction's check needs that call. The cache keeps it,
// so that compaction is optimistic rather than refused by the write's
// check of call ids taken as new.
both_backends!(
    a_compaction_after_a_result_of_a_summarized_call_stays_optimistic,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        let batches = vec![
            vec![started(), catalog(&["Deploy"])],
            vec![call("c1", "ToolSearch")],
            vec![compaction("a search is running")],
            vec![result("c1", "ToolSearch", &["Deploy"])],
        ];
        let mut head = 0;
        for batch in batches {
            head = store
                .append(s, head, batch)
                .await
                .unwrap()
                .events
                .last()
                .unwrap()
                .seq;
        }
        let before = store.append_paths();
        head = store
            .append(s, head, vec![prompt("go on")])
            .await
            .unwrap()
            .events[0]
            .seq;
        store
            .append(s, head, vec![compaction("found Deploy")])
            .await
            .unwrap();
        let paths = since(&store, before);
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (2, 0, 0)
        );
        agrees_with_the_log(&store, s).await;
        store.close().await;
    }
);

// A tenant's session: the owner read under the lock is cached with the
// state, so the tenant's next appends are optimistic, and another tenant
// still finds no such session.
both_backends!(
    a_tenants_warm_session_stays_its_own,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store
            .append_as(Some("acme"), s, 0, vec![started()])
            .await
            .unwrap();
        let before = store.append_paths();
        store
            .append_as(Some("acme"), s, 1, vec![prompt("mine")])
            .await
            .unwrap();
        match store
            .append_as(Some("globex"), s, 2, vec![prompt("theirs")])
            .await
        {
            Err(Error::SessionNotFound(id)) => assert_eq!(id, s),
            other => panic!("another tenant's session does not exist: {other:?}"),
        }
        store
            .append_as(Some("acme"), s, 2, vec![prompt("mine again")])
            .await
            .unwrap();
        let paths = since(&store, before);
        // The refusal went back to the lock (which refused it too). On
        // SQLite the first of these appends is locked (the log seen quiet
        // once), and the refused group's lock saw it quiet again.
        let optimistic = if is_pg(&store) { 3 } else { 2 };
        assert_eq!(paths.optimistic, optimistic, "{paths:?}");
        assert_eq!(paths.optimistic_abandoned, 1, "{paths:?}");
        assert_eq!(store.head_seq(s).await.unwrap(), 3);
        assert_eq!(
            store.session_owner(s).await.unwrap().as_deref(),
            Some("acme")
        );
        agrees_with_the_log(&store, s).await;
        store.close().await;
    }
);

/// `seq_scan` of `events` and `calls` once the statistics of `inserted`
/// events have been flushed (a backend flushes them when it exits).
async fn seq_scans(admin: &sqlx::PgPool, inserted: i64) -> (i64, i64) {
    for _ in 0..100 {
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(admin)
            .await
            .unwrap();
        let (ins, events, calls): (i64, i64, i64) = sqlx::query_as(
            "SELECT e.n_tup_ins, e.seq_scan, c.seq_scan FROM pg_stat_user_tables e, \
             pg_stat_user_tables c WHERE e.relname = 'events' AND c.relname = 'calls'",
        )
        .fetch_one(admin)
        .await
        .unwrap();
        if ins >= inserted {
            return (events, calls);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the statistics of {inserted} inserted events never arrived");
}

// A new store's tables are analyzed while empty (autovacuum does it too).
// Plans made then and kept (the write function's generic plans) must not
// scan a table: every warm append's checks look keys up, so however many
// appends run, the tables are not scanned. Measured with the server's
// per-table counters, not with a clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_appends_never_scan_a_table_planned_while_empty() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let store = Store::open(&db.url).await.unwrap();
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::query("ANALYZE").execute(&admin).await.unwrap();
    let s = Uuid::new_v4();
    store
        .append(s, 0, vec![started(), catalog(&["Deploy"])])
        .await
        .unwrap();
    store.close().await;
    let (events_before, calls_before) = seq_scans(&admin, 2).await;

    let store = Store::open(&db.url).await.unwrap();
    let mut head = store
        .append_at_head(s, vec![prompt("cold")], &RetryPolicy::default())
        .await
        .unwrap()
        .events[0]
        .seq;
    let before = store.append_paths();
    // Enough appends for every pooled connection to switch to a generic
    // plan (after five executions).
    for i in 0..120 {
        let batch = match i % 3 {
            0 => vec![prompt(&format!("p{i}"))],
            1 => vec![call(&format!("c{i}"), "Read")],
            _ => vec![result(&format!("c{}", i - 1), "Read", &[])],
        };
        head = store.append(s, head, batch).await.unwrap().events[0].seq;
    }
    let paths = since(&store, before);
    assert_eq!(paths.optimistic, 120, "{paths:?}");
    store.close().await;
    let (events_after, calls_after) = seq_scans(&admin, 123).await;
    // The one cold append reads under custom plans, which may scan the
    // tiny tables; a scan per warm append would add over a hundred.
    assert!(
        events_after - events_before <= 5 && calls_after - calls_before <= 5,
        "scans of events {events_before} -> {events_after}, of calls {calls_before} -> {calls_after}"
    );
    admin.close().await;
}

// A server (or database) whose default isolation is SERIALIZABLE: a
// write that waited for the counter's lock would fail with a
// serialization error, since its snapshot predates the lock. The store
// sets its own connections to READ COMMITTED, so two instances appending
// at once see no error and lose nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_do_not_depend_on_the_servers_default_isolation() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    let name: (String,) = sqlx::query_as("SELECT current_database()")
        .fetch_one(&admin)
        .await
        .unwrap();
    sqlx::query(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'serializable'",
        name.0
    ))
    .execute(&admin)
    .await
    .unwrap();
    admin.close().await;
    let stores = [
        std::sync::Arc::new(Store::open(&db.url).await.unwrap()),
        std::sync::Arc::new(Store::open(&db.url).await.unwrap()),
    ];
    let mut tasks = Vec::new();
    for w in 0..8 {
        let store = stores[w % 2].clone();
        tasks.push(tokio::spawn(async move {
            let s = Uuid::new_v4();
            let mut head = store.append(s, 0, vec![started()]).await?.events[0].seq;
            for i in 0..15 {
                head = store
                    .append(s, head, vec![prompt(&format!("{w}:{i}"))])
                    .await?
                    .events[0]
                    .seq;
            }
            Ok::<i64, Error>(head)
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().expect("no append fails"), 16);
    }
    let feed = stores[0].feed(0, 1000).await.unwrap();
    let positions: Vec<i64> = feed.iter().map(|e| e.position).collect();
    assert_eq!(positions, (1..=128).collect::<Vec<_>>());
    for s in stores {
        s.close().await;
    }
}

// Migration 0008: a payload big enough for TOAST to compress (a tool
// result of a few KB) is compressed with lz4, on both write paths (the
// first append of a session goes under the lock, the next ones one round
// trip), and so is the view's JSON; the bench's raw-insert ceiling stores
// its payloads the same way, so that its ratio compares like with like.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_are_compressed_with_lz4_on_postgres() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let store = Store::open(&db.url).await.unwrap();
    let s = Uuid::new_v4();
    // Text that compresses (TOAST keeps a value uncompressed when
    // compressing it does not pay).
    let output = "the same line of a tool's output, again and again\n".repeat(120);
    let big = |call: &str| {
        vec![
            NewEvent::new(EventBody::ToolCall {
                call_id: call.into(),
                tool_name: "read_file".into(),
                input: serde_json::json!({"path": call}),
            }),
            NewEvent::new(EventBody::ToolResult {
                call_id: call.into(),
                tool_name: "read_file".into(),
                status: session_store::ToolStatus::Success,
                output: Some(serde_json::json!(output)),
                added_tool_names: None,
            }),
        ]
    };
    let mut first = vec![NewEvent::new(EventBody::SessionStarted {
        mode: "agent".into(),
        metadata: None,
    })];
    first.extend(big("c1"));
    store.append(s, 0, first).await.unwrap();
    store.append(s, 3, big("c2")).await.unwrap();
    assert!(
        store.append_paths().optimistic >= 1,
        "{:?}",
        store.append_paths()
    );

    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    let methods: Vec<(i64, Option<String>)> = sqlx::query_as(
        "SELECT seq, pg_column_compression(payload)::text FROM events \
         WHERE session_id = $1 AND type = 'tool_result' ORDER BY seq",
    )
    .bind(s)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(
        methods,
        vec![(3, Some("lz4".to_owned())), (5, Some("lz4".to_owned()))]
    );
    let view_columns: Vec<(String, String)> = sqlx::query_as(
        "SELECT attname::text, attcompression::text FROM pg_attribute \
         WHERE attrelid = 'session_views'::regclass \
           AND attname IN ('summary', 'catalogs', 'evidence', 'active') ORDER BY attname",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(view_columns.len(), 4);
    assert!(
        view_columns.iter().all(|(_, m)| m == "l"),
        "{view_columns:?}"
    );
    // Read back whole.
    let stored = store.history(s, 0, 10).await.unwrap();
    assert!(matches!(
        &stored[4].body,
        EventBody::ToolResult { output: Some(o), .. } if o.as_str() == Some(output.as_str())
    ));

    let raw = session_store::bench::append::Raw::open(
        session_store::store::BackendKind::Postgres,
        &db.url,
    )
    .await
    .unwrap();
    raw.insert(s, 1, &big("c3")).await.unwrap();
    let ceiling: Vec<(Option<String>,)> = sqlx::query_as(
        "SELECT pg_column_compression(payload)::text FROM bench_raw WHERE type = 'tool_result'",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(ceiling, vec![(Some("lz4".to_owned()),)]);
    raw.close().await;
    admin.close().await;
    store.close().await;
}

// Another process appends to a session this one has cached, and this one
// then commits to other sessions, so that the log again ends where its
// last commit left it: the optimistic check of the log's end passes, yet
// the cached state of that session is stale. An empty batch at the stale
// seq writes nothing that a unique index could refuse; queued in one group
// with a write, it must still be a conflict (each session's head is
// checked, not only the log's end).
both_backends!(
    a_session_appended_to_before_this_writers_last_commit_is_not_judged_stale,
    |url: String| async move {
        let options = session_store::StoreOptions {
            // A group's writer slot is held this long after its commit, so
            // that the appends sent meanwhile make the next group together.
            fault_pause_after_commit: Some(std::time::Duration::from_millis(400)),
            ..session_store::StoreOptions::default()
        };
        let store = std::sync::Arc::new(Store::open_with(&url, options).await.unwrap());
        let other = Store::open(&url).await.unwrap();
        let (s, t) = (Uuid::new_v4(), Uuid::new_v4());
        store
            .append(s, 0, vec![started(), prompt("s")])
            .await
            .unwrap();
        store.append(t, 0, vec![started()]).await.unwrap();
        other.append(s, 2, vec![prompt("elsewhere")]).await.unwrap();
        // The first finds the log moved (optimistic on PostgreSQL: its
        // check of t's head passes); the second finds it quiet again.
        store.append(t, 1, vec![prompt("t1")]).await.unwrap();
        store.append(t, 2, vec![prompt("t2")]).await.unwrap();

        let holder = {
            let store = store.clone();
            tokio::spawn(async move { store.append(t, 3, vec![prompt("t3")]).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        let write = {
            let store = store.clone();
            tokio::spawn(async move { store.append(t, 4, vec![prompt("t4")]).await })
        };
        let empty = {
            let store = store.clone();
            tokio::spawn(async move { store.append(s, 2, Vec::new()).await })
        };
        holder.await.unwrap().unwrap();
        assert_eq!(write.await.unwrap().unwrap().events[0].seq, 5);
        match empty.await.unwrap() {
            Err(Error::Conflict { current, .. }) => assert_eq!(current, 3),
            other => panic!("an empty batch at a stale seq conflicts: {other:?}"),
        }
        agrees_with_the_log(&store, s).await;
        agrees_with_the_log(&store, t).await;
        other.close().await;
    }
);

// Another process holds SQLite's write lock past the busy timeout: the
// optimistic query's `BEGIN IMMEDIATE` waits it out once, and the append
// is answered unavailable then (nothing stored), not sent to the locked
// path to wait it out a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lock_held_elsewhere_is_waited_for_once() {
    use sqlx::Connection;
    let db = common::sqlite_db();
    let store = Store::open(&db.url).await.unwrap();
    let s = Uuid::new_v4();
    for (i, batch) in [vec![started()], vec![prompt("a")], vec![prompt("b")]]
        .into_iter()
        .enumerate()
    {
        store.append(s, i as i64, batch).await.unwrap();
    }
    let before = store.append_paths();
    store.append(s, 3, vec![prompt("c")]).await.unwrap();
    assert_eq!(since(&store, before).optimistic, 1, "warm: optimistic");

    let mut holder = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let started_at = std::time::Instant::now();
    let err = store
        .append(s, 4, vec![prompt("blocked")])
        .await
        .expect_err("the lock is held elsewhere");
    let took = started_at.elapsed();
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
    // SQLite's busy timeout is 10 s: once, not twice.
    assert!(
        took < std::time::Duration::from_secs(15),
        "said after {took:?}"
    );
    assert_eq!(store.head_seq(s).await.unwrap(), 4);
    store.append(s, 4, vec![prompt("after")]).await.unwrap();
    agrees_with_the_log(&store, s).await;
}

/// A long batch of a warm session: calls with their results and a prompt
/// every few events, `n` events in all, numbered from `from`.
fn long_batch(from: usize, n: usize) -> Vec<NewEvent> {
    (from..from + n)
        .map(|i| match i % 5 {
            0 => prompt(&format!("prompt {i}")),
            1 => call(&format!("long-{i}"), "ToolSearch"),
            2 => result(&format!("long-{}", i - 1), "ToolSearch", &["Deploy"]),
            3 => call(&format!("long-{i}"), "Deploy"),
            _ => result(&format!("long-{}", i - 1), "Deploy", &[]),
        })
        .collect()
}

// Rows sent ahead (docs/design.md, "Rows sent ahead"): SQLite's optimistic
// transaction writes a long batch's first rows while its later events are
// judged. A batch refused at its end leaves none of them behind
// (in a group: tests/group_commit.rs); a batch whose opening check finds the log moved goes to
// the lock whole. Every answer is what the lock would give.
both_backends!(
    rows_sent_ahead_of_a_refusal_leave_nothing_behind,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let other = Store::open(&url).await.unwrap();
        let (s, elsewhere) = (Uuid::new_v4(), Uuid::new_v4());
        store
            .append(s, 0, vec![started(), catalog(&["Deploy"])])
            .await
            .unwrap();
        store.append(s, 2, vec![prompt("warm")]).await.unwrap();
        other.append(elsewhere, 0, vec![started()]).await.unwrap();
        // Seen moved, then quiet: the next group is optimistic.
        store.append(s, 3, vec![prompt("moved")]).await.unwrap();
        store.append(s, 4, vec![prompt("quiet")]).await.unwrap();
        let last_position = |feed: &[session_store::StoredEvent]| {
            feed.iter().map(|e| e.position).max().unwrap_or(0)
        };
        let before_feed = store.feed(0, 10_000).await.unwrap();

        // 1. Sixty events, the last a result of a call never made.
        let before = store.append_paths();
        let mut batch = long_batch(0, 59);
        batch.push(result("never-called", "Deploy", &[]));
        match store.append(s, 5, batch).await {
            Err(Error::Invalid(v)) => {
                assert_eq!(v.rule, Rule::ResultWithoutCall);
                assert_eq!(v.index, Some(59));
            }
            other => panic!("the batch's last event has no call: {other:?}"),
        }
        let paths = since(&store, before);
        if is_pg(&store) {
            assert_eq!(paths.sends_ahead, 0, "{paths:?}");
        } else {
            // Rows 0-15, 16-31 and 32-47 were sent while the next 16 (the
            // last 12) were judged; the refusal then undid them.
            assert_eq!(
                (paths.optimistic, paths.optimistic_abandoned, paths.locked),
                (1, 1, 1),
                "{paths:?}"
            );
            assert_eq!(paths.sends_ahead, 3, "{paths:?}");
        }
        assert_eq!(store.head_seq(s).await.unwrap(), 5);
        let after_feed = store.feed(0, 10_000).await.unwrap();
        assert_eq!(after_feed.len(), before_feed.len());
        store.clear_cache();
        assert_eq!(store.head_seq(s).await.unwrap(), 5);

        // The same batch without its bad event is taken whole, at the
        // positions right after the log's end (none lost to the refusal).
        let ok = store.append(s, 5, long_batch(0, 59)).await.unwrap();
        let first = ok.events[0].position;
        assert_eq!(first, last_position(&after_feed) + 1);
        let positions: Vec<i64> = ok.events.iter().map(|a| a.position).collect();
        assert_eq!(positions, (first..first + 59).collect::<Vec<_>>());
        let mut head = ok.events.last().unwrap().seq;
        // Warm and quiet again: the next long batch is optimistic.
        let before = store.append_paths();
        head = store
            .append(s, head, long_batch(100, 40))
            .await
            .unwrap()
            .events
            .last()
            .unwrap()
            .seq;
        let paths = since(&store, before);
        assert_eq!(
            (paths.optimistic, paths.optimistic_abandoned, paths.locked),
            (1, 0, 0),
            "{paths:?}"
        );
        assert_eq!(paths.sends_ahead, if is_pg(&store) { 0 } else { 2 });

        // 2. Another instance appended: the check sent with the first rows
        // finds the log moved, and the lock takes the batch whole.
        other
            .append_at_head(
                elsewhere,
                vec![prompt("meanwhile")],
                &RetryPolicy::default(),
            )
            .await
            .unwrap();
        let before = store.append_paths();
        let moved = store.append(s, head, long_batch(200, 40)).await.unwrap();
        assert_eq!(moved.events[0].seq, head + 1);
        head = moved.events.last().unwrap().seq;
        let paths = since(&store, before);
        if !is_pg(&store) {
            // One send: the first 16 rows, behind the check that failed.
            assert_eq!(
                (
                    paths.optimistic,
                    paths.optimistic_abandoned,
                    paths.locked,
                    paths.sends_ahead
                ),
                (1, 1, 1, 1),
                "{paths:?}"
            );
        }

        let feed = store.feed(0, 10_000).await.unwrap();
        let positions: Vec<i64> = feed.iter().map(|e| e.position).collect();
        assert_eq!(positions, (1..=feed.len() as i64).collect::<Vec<_>>());
        assert_eq!(store.head_seq(s).await.unwrap(), head);
        agrees_with_the_log(&store, s).await;
        store.close().await;
        other.close().await;
    }
);

// A batch with an event that could not be read as one (`refuse_batch`,
// what the CLI and the HTTP server call for it) is judged up to it as any
// batch is (SEMANTICS §2: the expected seq, then each event before it),
// and refused; on SQLite its valid rows were sent ahead first, and the
// refusal leaves none of them behind.
both_backends!(
    a_batch_refused_for_an_unreadable_event_leaves_nothing_behind,
    |url: String| async move {
        let store = Store::open(&url).await.unwrap();
        let s = Uuid::new_v4();
        store
            .append(s, 0, vec![started(), catalog(&["Deploy"])])
            .await
            .unwrap();
        store.append(s, 2, vec![prompt("warm")]).await.unwrap();
        let unreadable = || {
            session_store::ValidationError::new(
                Rule::UnknownField,
                Some("bogus"),
                "unknown field `bogus`",
            )
        };
        let before_feed = store.feed(0, 10_000).await.unwrap();

        // Every event before it valid: the unreadable one's error, at its
        // index, after rows were sent ahead on SQLite.
        let before = store.append_paths();
        match store
            .refuse_batch(None, s, 3, long_batch(0, 59), unreadable())
            .await
        {
            Error::Invalid(v) => assert_eq!((v.rule, v.index), (Rule::UnknownField, Some(59))),
            other => panic!("{other:?}"),
        }
        if !is_pg(&store) {
            assert_eq!(since(&store, before).sends_ahead, 3);
        }
        // An earlier event's error answers first; a stale expected seq
        // before any; with no event before it, index 0.
        let mut early = long_batch(0, 30);
        early[10] = result("never-called", "Deploy", &[]);
        match store.refuse_batch(None, s, 3, early, unreadable()).await {
            Error::Invalid(v) => {
                assert_eq!((v.rule, v.index), (Rule::ResultWithoutCall, Some(10)))
            }
            other => panic!("{other:?}"),
        }
        match store
            .refuse_batch(None, s, 2, long_batch(0, 3), unreadable())
            .await
        {
            Error::Conflict { current, .. } => assert_eq!(current, 3),
            other => panic!("{other:?}"),
        }
        match store
            .refuse_batch(None, s, 3, Vec::new(), unreadable())
            .await
        {
            Error::Invalid(v) => assert_eq!(v.index, Some(0)),
            other => panic!("{other:?}"),
        }
        // A batch whose first events are stored is partly stored (the
        // retry check comes first), never answered as a replay.
        let stored: Vec<NewEvent> = long_batch(0, 2)
            .into_iter()
            .map(|e| e.with_id(Uuid::new_v4()))
            .collect();
        store.append(s, 3, stored.clone()).await.unwrap();
        match store.refuse_batch(None, s, 5, stored, unreadable()).await {
            // Said at the unreadable event: the ones after it were not read.
            Error::Invalid(v) => {
                assert_eq!((v.rule, v.index), (Rule::PartlyStoredBatch, Some(2)));
                assert!(v.message.contains("2 of the 2 events before it"), "{v}");
            }
            other => panic!("{other:?}"),
        }

        // Nothing else stored; the positions go on without a hole.
        assert_eq!(store.head_seq(s).await.unwrap(), 5);
        let feed = store.feed(0, 10_000).await.unwrap();
        assert_eq!(feed.len(), before_feed.len() + 2);
        let ok = store.append(s, 5, long_batch(10, 59)).await.unwrap();
        assert_eq!(ok.events[0].position, feed.len() as i64 + 1);
        agrees_with_the_log(&store, s).await;
        store.close().await;
    }
);
