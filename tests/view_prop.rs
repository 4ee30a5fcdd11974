//! SEMANTICS §8 as a property, on both backends: for random valid logs
//! appended in random batches, the incrementally maintained view equals a
//! rebuild from the log at every refresh point, and every latest-state
//! answer served through the view equals the plain fold of the log.

mod common;

use common::gen::{valid_log, Rng};
use proptest::prelude::*;
use session_store::{NewEvent, SessionState, Store};
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
        prop_assert_eq!(r.catalog, expected.current_catalog().to_vec());
        reader.close().await;
    }
    // Rebuilding changes nothing that verify can see.
    writer.rebuild(session).await.unwrap();
    prop_assert_eq!(writer.verify(session).await.unwrap(), None);
    writer.close().await;
    Ok(())
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
