//! Tamper evidence on both backends: the log is broken with raw SQL, after
//! disabling the append-only trigger as an attacker with database access
//! would, and `verify --integrity` (library and CLI) must name the first
//! broken link. Also: export → import gives an identical session, chain
//! included, and sessions written before the chain existed are chained
//! once at open.

mod common;

use std::process::Command;

use session_store::integrity::BreakKind;
use session_store::{Error, EventBody, NewEvent, Store, StoreOptions, ToolStatus};
use uuid::Uuid;

fn events() -> Vec<NewEvent> {
    let mut v = vec![
        EventBody::SessionStarted {
            mode: "code".into(),
            metadata: None,
        },
        EventBody::CatalogDefined {
            mode: "code".into(),
            deferred_tools: vec!["web_fetch".into(), "grep".into()],
        },
        EventBody::PromptSubmitted {
            text: "find it".into(),
        },
        EventBody::ToolCall {
            call_id: "c1".into(),
            tool_name: "ToolSearch".into(),
            input: serde_json::json!({"q": "fetch"}),
        },
        EventBody::ToolResult {
            call_id: "c1".into(),
            tool_name: "ToolSearch".into(),
            status: ToolStatus::Success,
            output: Some(serde_json::json!("found")),
            added_tool_names: Some(vec!["web_fetch".into()]),
        },
        EventBody::PromptSubmitted { text: "go".into() },
    ];
    v.drain(..).map(NewEvent::new).collect()
}

/// Runs SQL on the store's database behind its back.
async fn raw(url: &str, sql: &str) {
    use sqlx::Connection;
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::raw_sql(sql)
            .execute(&mut c)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    } else {
        let path = url.trim_start_matches("sqlite://");
        let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{path}"))
            .await
            .unwrap();
        sqlx::raw_sql(sql)
            .execute(&mut c)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

/// Turns the append-only protection off, as an attacker would.
fn disable_triggers(url: &str) -> &'static str {
    if url.starts_with("postgres") {
        "ALTER TABLE events DISABLE TRIGGER USER;"
    } else {
        "DROP TRIGGER events_no_update; DROP TRIGGER events_no_delete;"
    }
}

/// A session id as an SQL literal (text on SQLite, cast to uuid on
/// PostgreSQL).
fn sid(_url: &str, id: Uuid) -> String {
    format!("'{id}'")
}

/// Two sessions: `victim` (6 events, appended in two batches) and
/// `bystander` (appended last, so the victim's rows are not the log's
/// last).
async fn setup(url: &str) -> (Store, Uuid, Uuid) {
    let store = Store::open(url).await.unwrap();
    let victim = Uuid::new_v4();
    let bystander = Uuid::new_v4();
    let mut evs = events();
    let rest = evs.split_off(3);
    store.append(victim, 0, evs).await.unwrap();
    store.append(victim, 3, rest).await.unwrap();
    store.append(bystander, 0, events()).await.unwrap();
    let report = store.verify_integrity(None).await.unwrap();
    assert!(report.intact(), "{report:?}");
    assert_eq!(report.events, 12);
    assert_eq!(report.heads.len(), 2);
    (store, victim, bystander)
}

/// Removes the row at `seq` of `session` behind the store's back.
async fn delete_row(url: &str, session: Uuid, seq: i64) {
    raw(
        url,
        &format!(
            "{} DELETE FROM events WHERE session_id = {} AND seq = {seq};",
            disable_triggers(url),
            sid(url, session)
        ),
    )
    .await;
}

async fn first_break(url: &str, session: Uuid) -> (i64, BreakKind) {
    let store = Store::open(url).await.unwrap();
    let report = store.verify_integrity(Some(session)).await.unwrap();
    let b = report
        .breaks
        .first()
        .unwrap_or_else(|| panic!("a break in {report:?}"));
    (b.seq, b.kind.clone())
}

fn cli_verify(url: &str) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .args(["--database", url, "verify", "--integrity"])
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

/// The binary's exit code and its standard error.
fn cli(url: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .args(["--database", url])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

both_backends!(an_untouched_log_verifies, |url: String| async move {
    let (store, _, _) = setup(&url).await;
    store.close().await;
    let (code, text) = cli_verify(&url);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("hash chains of 12 events are intact"),
        "{text}"
    );
});

both_backends!(
    the_json_report_says_view_drift_beside_intact_chains,
    |url: String| async move {
        // A view changed behind the store's back leaves every chain
        // intact: the exit code is 5, and the JSON a program reads says
        // why, not only "no breaks".
        let (store, a, _) = setup(&url).await;
        store.close().await;
        let json = |url: &str| {
            let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
                .args(["--database", url, "verify", "--integrity", "--json"])
                .output()
                .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            (
                out.status.code(),
                v,
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        let (code, v, _) = json(&url);
        assert_eq!(code, Some(0));
        assert_eq!(v["view_drift"], serde_json::Value::Null, "{v}");
        raw(
            &url,
            &format!(
                "UPDATE session_views SET mode = 'chat' WHERE session_id = {}",
                sid(&url, a)
            ),
        )
        .await;
        let (code, v, err) = json(&url);
        assert_eq!(code, Some(5), "{err}");
        assert_eq!(v["breaks"], serde_json::json!([]), "{v}");
        let drift = v["view_drift"].as_str().unwrap_or_default();
        assert!(drift.contains("`mode` is \"chat\""), "{v}");
        assert!(err.contains(drift), "{err}");
    }
);

both_backends!(
    the_append_only_trigger_refuses_edits,
    |url: String| async move {
        let (store, victim, _) = setup(&url).await;
        store.close().await;
        use sqlx::Connection;
        let sql = format!(
            "UPDATE events SET payload = payload WHERE session_id = {} AND seq = 3",
            sid(&url, victim)
        );
        let refused = if url.starts_with("postgres") {
            let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
            sqlx::raw_sql(&sql).execute(&mut c).await.is_err()
        } else {
            let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
            sqlx::raw_sql(&sql).execute(&mut c).await.is_err()
        };
        assert!(
            refused,
            "an UPDATE of an event is refused while the trigger is on"
        );
    }
);

both_backends!(an_edited_payload_is_caught, |url: String| async move {
    let (store, victim, _) = setup(&url).await;
    store.close().await;
    raw(&url, &format!(
        "{} UPDATE events SET payload = replace(payload, 'find it', 'delete it') WHERE session_id = {} AND seq = 3;",
        disable_triggers(&url), sid(&url, victim)
    )).await;
    assert_eq!(
        first_break(&url, victim).await,
        (3, BreakKind::HashMismatch)
    );
    let (code, text) = cli_verify(&url);
    assert_eq!(code, 5, "{text}");
    assert!(text.contains("seq 3"), "{text}");
});

both_backends!(an_edited_type_column_is_caught, |url: String| async move {
    // The column is a copy of the payload's type that the audit queries
    // and the sparse indexes read: an edit of it alone is a break.
    let (store, victim, _) = setup(&url).await;
    store.close().await;
    raw(
        &url,
        &format!(
            "{} UPDATE events SET type = 'x_' || type WHERE session_id = {} AND seq = 3;",
            disable_triggers(&url),
            sid(&url, victim)
        ),
    )
    .await;
    assert_eq!(
        first_break(&url, victim).await,
        (3, BreakKind::HashMismatch)
    );
    let (code, text) = cli_verify(&url);
    assert_eq!(code, 5, "{text}");
    assert!(text.contains("type column"), "{text}");
});

both_backends!(
    a_payload_edited_into_no_event_is_a_break_not_a_failure,
    |url: String| async move {
        // Reported at its row like any edit (exit 5), not as the storage
        // failing (exit 4, no report, later sessions unchecked).
        let (store, victim, bystander) = setup(&url).await;
        store.close().await;
        raw(
            &url,
            &format!(
                "{} UPDATE events SET payload = 'not an event' WHERE session_id = {} AND seq = 3;",
                disable_triggers(&url),
                sid(&url, victim)
            ),
        )
        .await;
        assert_eq!(
            first_break(&url, victim).await,
            (3, BreakKind::HashMismatch)
        );
        let store = Store::open(&url).await.unwrap();
        let report = store.verify_integrity(None).await.unwrap();
        assert_eq!(report.breaks.len(), 1, "{report:?}");
        assert!(
            report.heads.iter().any(|h| h.session_id == bystander),
            "the other session is still checked: {report:?}"
        );
        let (code, text) = cli_verify(&url);
        assert_eq!(code, 5, "{text}");
        assert!(text.contains("cannot be read as an event"), "{text}");
        // The views' check (plain `verify`, and the JSON report's
        // `view_drift`) says it as a difference too, not as the storage
        // failing (exit 4).
        for args in [vec!["verify"], vec!["verify", "--integrity", "--json"]] {
            let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
                .args(["--database", url.as_str()])
                .args(&args)
                .output()
                .unwrap();
            let said = String::from_utf8_lossy(&out.stderr).into_owned()
                + &String::from_utf8_lossy(&out.stdout);
            assert_eq!(out.status.code(), Some(5), "{args:?}: {said}");
            assert!(said.contains("position"), "{args:?}: {said}");
        }
    }
);

both_backends!(
    evidence_forged_into_a_result_is_caught,
    |url: String| async move {
        let (store, victim, _) = setup(&url).await;
        store.close().await;
        raw(&url, &format!(
        "{} UPDATE events SET payload = replace(payload, '\"web_fetch\"]', '\"web_fetch\",\"grep\"]') WHERE session_id = {} AND seq = 5;",
        disable_triggers(&url), sid(&url, victim)
    )).await;
        assert_eq!(
            first_break(&url, victim).await,
            (5, BreakKind::HashMismatch)
        );
    }
);

both_backends!(a_deleted_row_is_caught, |url: String| async move {
    let (store, victim, _) = setup(&url).await;
    store.close().await;
    delete_row(&url, victim, 2).await;
    assert_eq!(first_break(&url, victim).await, (3, BreakKind::SeqGap));
    assert_eq!(cli_verify(&url).0, 5);
    // The passes over the log say the hole, not fold or export past it.
    let (code, text) = cli(&url, &["export", &victim.to_string()]);
    assert_eq!(code, 4, "{text}");
    assert!(text.contains("no event at seq 2"), "{text}");
    let (code, text) = cli(&url, &["explain", &victim.to_string(), "web_fetch"]);
    assert_eq!(code, 4, "{text}");
    assert!(text.contains("no event at seq 2"), "{text}");
});

both_backends!(
    a_hole_is_said_where_an_answer_reads_it,
    |url: String| async move {
        // Seq 4 of the victim (a tool call) removed behind the store's back.
        let (store, victim, _) = setup(&url).await;
        store.close().await;
        delete_row(&url, victim, 4).await;
        let id = victim.to_string();
        // An answer as of the first prompt (seq 3) reads nothing past it.
        let (code, text) = cli(&url, &["explain", &id, "web_fetch", "--at-prompt", "1"]);
        assert_eq!(code, 0, "{text}");
        let (code, text) = cli(&url, &["explain", &id, "web_fetch"]);
        assert_eq!(code, 4, "{text}");
        assert!(
            text.contains("no event at seq 4 (the pass reads to seq 6)"),
            "{text}"
        );
        // A long context's first page (every window is long here) is
        // checked as its later pages are.
        let store = Store::open_with(
            &url,
            StoreOptions {
                rowless_window: 1,
                ..StoreOptions::default()
            },
        )
        .await
        .unwrap();
        let got = store.context_paged(victim, None).await.map(|_| ());
        assert!(
            matches!(&got, Err(Error::Corrupt(m)) if m.contains("no event at seq 4")),
            "{got:?}"
        );
    }
);

both_backends!(
    a_deleted_last_row_is_caught_by_the_global_order,
    |url: String| async move {
        // The victim's last event is not the log's last: its removal leaves a
        // hole in the positions even though the victim's chain still checks.
        let (store, victim, _) = setup(&url).await;
        store.close().await;
        delete_row(&url, victim, 6).await;
        let store = Store::open(&url).await.unwrap();
        let report = store.verify_integrity(None).await.unwrap();
        assert!(report.breaks.is_empty(), "{report:?}");
        assert_eq!(report.log_problems.len(), 1, "{report:?}");
        assert!(
            report.log_problems[0].contains("1 position is missing"),
            "{report:?}"
        );
        let (code, text) = cli_verify(&url);
        assert_eq!(code, 5, "{text}");
    }
);

both_backends!(reordered_rows_are_caught, |url: String| async move {
    let (store, victim, _) = setup(&url).await;
    store.close().await;
    let s = sid(&url, victim);
    raw(
        &url,
        &format!(
            "{} UPDATE events SET seq = 100 WHERE session_id = {s} AND seq = 2; \
         UPDATE events SET seq = 2 WHERE session_id = {s} AND seq = 3; \
         UPDATE events SET seq = 3 WHERE session_id = {s} AND seq = 100;",
            disable_triggers(&url)
        ),
    )
    .await;
    assert_eq!(
        first_break(&url, victim).await,
        (2, BreakKind::HashMismatch)
    );
});

both_backends!(a_changed_timestamp_is_caught, |url: String| async move {
    let (store, victim, _) = setup(&url).await;
    store.close().await;
    let shift = if url.starts_with("postgres") {
        "recorded_at = recorded_at - interval '1 hour'".to_owned()
    } else {
        "recorded_at = '2001-01-01T00:00:00.000000Z'".to_owned()
    };
    raw(
        &url,
        &format!(
            "{} UPDATE events SET {shift} WHERE session_id = {} AND seq = 4;",
            disable_triggers(&url),
            sid(&url, victim)
        ),
    )
    .await;
    assert_eq!(
        first_break(&url, victim).await,
        (4, BreakKind::HashMismatch)
    );
});

both_backends!(
    an_erased_hash_is_caught_and_not_repaired,
    |url: String| async move {
        // An erased hash is a break, and opening the store does not "repair"
        // it: only sessions written before the chain existed are chained.
        let (store, victim, _) = setup(&url).await;
        store.close().await;
        raw(
            &url,
            &format!(
                "{} UPDATE events SET hash = NULL WHERE session_id = {} AND seq = 4;",
                disable_triggers(&url),
                sid(&url, victim)
            ),
        )
        .await;
        assert_eq!(first_break(&url, victim).await, (4, BreakKind::MissingHash));
        assert_eq!(
            first_break(&url, victim).await,
            (4, BreakKind::MissingHash),
            "still, after a second open"
        );
    }
);

both_backends!(
    stores_opened_together_on_a_store_to_backfill_chain_every_session_once,
    |url: String| async move {
        // Sessions as from before the chain (no hash, listed), and four
        // stores opened at once: on PostgreSQL one does the work while the
        // others wait for its lock, then find nothing left; every one
        // opens, and every session's chain is the one a fresh store
        // computes (the heads before the erasure).
        let (store, victim, bystander) = setup(&url).await;
        let before = store.verify_integrity(None).await.unwrap().heads;
        store.close().await;
        raw(
            &url,
            &format!(
                "{} UPDATE events SET hash = NULL; \
                 INSERT INTO chain_backfill (session_id) VALUES ({}), ({});",
                disable_triggers(&url),
                sid(&url, victim),
                sid(&url, bystander)
            ),
        )
        .await;
        let (a, b, c, d) = tokio::join!(
            Store::open(&url),
            Store::open(&url),
            Store::open(&url),
            Store::open(&url)
        );
        let stores: Vec<Store> = [a, b, c, d]
            .into_iter()
            .map(|s| s.expect("every store opens"))
            .collect();
        let report = stores[0].verify_integrity(None).await.unwrap();
        assert!(report.intact(), "{report:?}");
        assert_eq!(report.heads, before);
        for s in stores {
            s.close().await;
        }
    }
);

/// The one-time work's lock held by an instance that froze (here a
/// connection of the test's, never released): a store that opens meanwhile
/// waits for it at most its bound (`migration_lock_wait`, here 1 s), then
/// does the work beside it, instead of every open waiting 15 minutes. The
/// lock of another schema's store is not this one's: no wait at all.
#[tokio::test]
async fn postgres_a_frozen_backfill_holder_does_not_stop_the_others() {
    use sqlx::Connection;
    let Some(db) = common::postgres_db() else {
        return;
    };
    let url = db.url.clone();
    let (store, victim, bystander) = setup(&url).await;
    let before = store.verify_integrity(None).await.unwrap().heads;
    store.close().await;
    let erase = format!(
        "{} UPDATE events SET hash = NULL; \
         INSERT INTO chain_backfill (session_id) VALUES ({}), ({});",
        disable_triggers(&url),
        sid(&url, victim),
        sid(&url, bystander)
    );
    let options = || session_store::StoreOptions {
        migration_lock_wait: std::time::Duration::from_secs(1),
        ..Default::default()
    };
    for (schema, waits) in [("another_schema", false), ("public", true)] {
        raw(&url, &erase).await;
        let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("SELECT pg_advisory_lock($1 # hashtext($2)::bigint)")
            .bind(session_store::store::BACKFILL_LOCK)
            .bind(schema)
            .execute(&mut holder)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let store = Store::open_with(&url, options()).await.expect("opens");
        let waited = started.elapsed();
        assert_eq!(
            waited >= std::time::Duration::from_secs(1),
            waits,
            "{schema}: {waited:?}"
        );
        let report = store.verify_integrity(None).await.unwrap();
        assert!(report.intact(), "{report:?}");
        assert_eq!(report.heads, before);
        store.close().await;
        holder.close().await.unwrap();
    }
}

both_backends!(
    a_session_listed_for_chaining_behind_the_stores_back_is_not_repaired,
    |url: String| async move {
        // An edited row, the hashes from it on erased, and the session put
        // on the one-time chaining list: the next open (here the very
        // verify meant to catch it) re-hashed the edited rows and said
        // "intact". A session from before the chain has no hashed row, so
        // this one is taken off the list with nothing filled in.
        let (store, victim, _) = setup(&url).await;
        store.close().await;
        raw(&url, &format!(
            "{} UPDATE events SET payload = replace(payload, 'find it', 'delete it') WHERE session_id = {s} AND seq = 3; \
             UPDATE events SET hash = NULL WHERE session_id = {s} AND seq >= 3; \
             INSERT INTO chain_backfill (session_id) VALUES ({s});",
            disable_triggers(&url), s = sid(&url, victim)
        ))
        .await;
        let (code, text) = cli_verify(&url);
        assert_eq!(code, 5, "{text}");
        assert!(text.contains("seq 3"), "{text}");
        assert_eq!(first_break(&url, victim).await, (3, BreakKind::MissingHash));
    }
);

both_backends!(
    a_session_without_events_listed_for_its_changes_does_not_stop_the_store,
    |url: String| async move {
        // Listed behind the store's back: every command failed at open
        // with "session not found", verify included.
        let (store, _, _) = setup(&url).await;
        store.close().await;
        raw(
            &url,
            &format!(
                "INSERT INTO changes_backfill (session_id) VALUES ({});",
                sid(&url, Uuid::new_v4())
            ),
        )
        .await;
        let (code, text) = cli_verify(&url);
        assert_eq!(code, 0, "{text}");
        let store = Store::open(&url).await.unwrap();
        assert!(store.verify_integrity(None).await.unwrap().intact());
    }
);

both_backends!(
    sessions_from_before_the_chain_are_chained_once,
    |url: String| async move {
        // Simulate a log written before migration 0004: no hashes, and the
        // session listed for the one-time chaining.
        let (store, victim, _) = setup(&url).await;
        let before = store.verify_integrity(Some(victim)).await.unwrap().heads;
        store.close().await;
        raw(&url, &format!(
        "{} UPDATE events SET hash = NULL WHERE session_id = {s}; INSERT INTO chain_backfill (session_id) VALUES ({s});",
        disable_triggers(&url), s = sid(&url, victim)
    )).await;
        let store = Store::open(&url).await.unwrap();
        let report = store.verify_integrity(Some(victim)).await.unwrap();
        assert!(report.intact(), "{report:?}");
        assert_eq!(report.heads, before, "the same chain as written at append");
        // And appends continue the chain.
        store
            .append(
                victim,
                6,
                vec![NewEvent::new(EventBody::AssistantMessage {
                    text: "done".into(),
                })],
            )
            .await
            .unwrap();
        assert!(store.verify_integrity(None).await.unwrap().intact());
    }
);

both_backends!(
    export_then_import_gives_an_identical_session,
    |url: String| async move {
        let (store, victim, _) = setup(&url).await;
        let original = store.history(victim, 0, 100).await.unwrap();
        let head = store.verify_integrity(Some(victim)).await.unwrap().heads;
        let activations = store.activations(victim, None).await.unwrap();
        let context = store.context(victim, None).await.unwrap();
        store.close().await;
        let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
            .args(["--database", &url, "export", &victim.to_string()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("export.jsonl");
        std::fs::write(&file, &out.stdout).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 6);

        let target = common::sqlite_db();
        let imported = Command::new(env!("CARGO_BIN_EXE_session-store"))
            .args(["--database", &target.url, "import"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            imported.status.success(),
            "{}",
            String::from_utf8_lossy(&imported.stderr)
        );
        let copy = Store::open(&target.url).await.unwrap();
        let mut got = copy.history(victim, 0, 100).await.unwrap();
        let mut want = original.clone();
        for e in got.iter_mut().chain(want.iter_mut()) {
            e.position = 0; // the global order is the target store's own
        }
        assert_eq!(got, want, "same ids, seqs, times and payloads");
        assert_eq!(
            copy.verify_integrity(Some(victim)).await.unwrap().heads,
            head,
            "same chain"
        );
        assert_eq!(copy.activations(victim, None).await.unwrap(), activations);
        assert_eq!(copy.context(victim, None).await.unwrap(), context);
        // Importing the export again stores nothing twice.
        let again = Command::new(env!("CARGO_BIN_EXE_session-store"))
            .args(["--database", &target.url, "import"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(again.status.success());
        assert_eq!(copy.head_seq(victim).await.unwrap(), 6);
    }
);

/// Rows an edit around a SQLite store left unreadable (a payload that is
/// not UTF-8, which SQLite does not check; a session id that is no UUID)
/// are differences `verify` names with their position (exit 5), not the
/// storage failing (exit 4, the driver's words, a review's finding), and
/// other reads name the row too; a drift verdict outlives an output that
/// cannot be written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_sqlite_rows_are_named_by_their_position() {
    let db = common::sqlite_db();
    let url = db.url.clone();
    let (store, victim, _) = setup(&url).await;
    store.close().await;
    // The victim's rows were the store's first: its seq 3 is position 3.
    let position = 3;
    raw(
        &url,
        &format!(
            "{} UPDATE events SET payload = CAST(x'7b2274657874223a22ff227d' AS TEXT) \
             WHERE position = {position};",
            disable_triggers(&url)
        ),
    )
    .await;
    let named =
        format!("event at position {position}: its payload is not UTF-8 text (byte 9 is not)");
    for args in [&["verify"][..], &["verify", "--integrity"]] {
        let (code, said) = cli(&url, args);
        assert_eq!(code, 5, "{args:?}: {said}");
        assert!(
            said.contains("the log was changed behind the store's back: ")
                && said.contains(&named)
                && !said.contains("rebuild recomputes"),
            "{args:?}: {said}"
        );
    }
    let (code, said) = cli(&url, &["history", &victim.to_string()]);
    assert_eq!(code, 4, "{said}");
    assert!(said.contains(&named), "{said}");
    // The drift is said when the JSON report cannot be written.
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .args(["--database", &url, "verify", "--integrity", "--json"])
        .stdout(full)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{said}");
    assert!(said.contains("the report could not be written"), "{said}");

    raw(
        &url,
        &format!("UPDATE events SET session_id = 'zzz' WHERE position = {position};"),
    )
    .await;
    let named = format!("event at position {position}: its session_id \"zzz\" is not a UUID");
    for args in [&["verify"][..], &["verify", "--integrity"]] {
        let (code, said) = cli(&url, args);
        assert_eq!(code, 5, "{args:?}: {said}");
        assert!(said.contains(&named), "{args:?}: {said}");
    }
}
