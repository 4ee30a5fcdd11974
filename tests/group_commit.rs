//! Group commit (src/store/group.rs): appends that run at the same time in
//! one process may share a transaction, and each is still judged alone, on
//! SQLite and PostgreSQL.

mod common;

use std::sync::Arc;

use session_store::{Error, EventBody, NewEvent, RetryPolicy, Store, ToolStatus};
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
