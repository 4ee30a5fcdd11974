//! `explain` and `refreshes` through the real binary, on both backends,
//! from a hand-written log (tests/fixtures/audit/reasons.jsonl) whose
//! answers are worked out by hand in docs/audit.md: each reason of explain
//! comes from a point of this log that produces it.

mod common;

use std::process::{Command, Output};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_session-store");
const LOG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/audit/reasons.jsonl"
);
const S: &str = "5e55a0d1-0000-4000-8000-00000000a0d1";

fn id(seq: u32) -> String {
    format!("5e55a0d1-0000-4000-8000-{seq:012}")
}

fn run(url: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("--database")
        .arg(url)
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run session-store")
}

fn json_of(o: &Output) -> Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

fn backends() -> Vec<(&'static str, common::TestDb)> {
    let mut v = vec![("sqlite", common::sqlite_db())];
    if let Some(db) = common::postgres_db() {
        v.push(("postgres", db));
    }
    v
}

fn explain(url: &str, tool: &str, at: &[&str]) -> Value {
    let mut args = vec!["explain", S, tool, "--json"];
    args.extend_from_slice(at);
    json_of(&run(url, &args))
}

#[test]
fn explain_gives_each_reason_where_the_log_produces_it() {
    for (backend, db) in backends() {
        let url = db.url.as_str();
        assert!(run(url, &["import", LOG]).status.success(), "{backend}");

        // Active at prompt 2: the ToolSearch result at seq 6 named it.
        let x = explain(url, "web_fetch", &["--at-prompt", "2"]);
        assert_eq!(x["active"], true, "{backend}: {x}");
        assert_eq!(
            (x["as_of_seq"].clone(), x["as_of_prompt"].clone()),
            (json!(9), json!(2))
        );
        assert_eq!(
            x["evidence"],
            json!({"seq": 6, "event_id": id(6), "call_id": "c1", "result_tool": "ToolSearch",
                   "source": "search", "status": "success"}),
            "{backend}"
        );
        assert_eq!(
            x["catalog"],
            json!({"mode": "agent", "seq": 2, "event_id": id(2)})
        );
        assert_eq!(x["reason"], Value::Null);

        // Mode plan's catalog (seq 3) lacks it.
        let x = explain(url, "web_fetch", &["--at-seq", "10"]);
        assert_eq!(
            x["reason"],
            json!({"code": "not_in_mode_catalog", "mode": "plan",
                   "catalog": {"mode": "plan", "seq": 3, "event_id": id(3)},
                   "admitted_in_modes": ["agent"]}),
            "{backend}"
        );

        // The agent catalog rebuilt at seq 12 dropped it.
        let x = explain(url, "web_fetch", &["--at-prompt", "3"]);
        assert_eq!(
            x["reason"],
            json!({"code": "dropped_by_catalog_rebuild", "mode": "agent",
                   "rebuild": {"mode": "agent", "seq": 12, "event_id": id(12)},
                   "previous": {"mode": "agent", "seq": 2, "event_id": id(2)}}),
            "{backend}"
        );

        // The compaction at seq 14 removed image_view's evidence.
        let x = explain(url, "image_view", &[]);
        assert_eq!(x["as_of_seq"], 15);
        assert_eq!(x["reason"]["code"], "compacted", "{backend}: {x}");
        assert_eq!(x["reason"]["compaction_seq"], 14);
        assert_eq!(x["reason"]["compaction_event_id"], json!(id(14)));
        assert_eq!(x["reason"]["removed_evidence"]["seq"], 6);

        // Only its own failed result at seq 8 named notebook_edit.
        let x = explain(url, "notebook_edit", &[]);
        assert_eq!(
            x["reason"],
            json!({"code": "only_unsuccessful", "total": 1, "results": [
                {"seq": 8, "event_id": id(8), "call_id": "c2", "result_tool": "notebook_edit",
                 "source": "own_result", "status": "error"}]}),
            "{backend}"
        );

        // Nothing ever named mcp__x.
        let x = explain(url, "mcp__x", &["--at-seq", "6"]);
        assert_eq!(x["reason"], json!({"code": "never_evidenced"}), "{backend}");

        // The table form is the sentence first.
        let o = run(url, &["explain", S, "web_fetch", "--at-seq", "13"]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            text.starts_with(
                "web_fetch is not active: the catalog of mode agent rebuilt at seq 12 dropped it"
            ),
            "{backend}: {text}"
        );
    }
}

#[test]
fn refreshes_list_every_refresh_point_with_its_difference() {
    for (backend, db) in backends() {
        let url = db.url.as_str();
        assert!(run(url, &["import", LOG]).status.success(), "{backend}");
        // An unknown session: the error alone, no table header before it.
        let o = run(url, &["refreshes", "00000000-0000-4000-8000-000000000000"]);
        assert_eq!(o.status.code(), Some(1), "{backend}");
        assert!(
            o.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&o.stdout)
        );
        let o = run(url, &["refreshes", S]);
        let table = String::from_utf8_lossy(&o.stdout);
        assert!(table.starts_with("   SEQ  TYPE"), "{table}");
        assert_eq!(table.matches("TOOLS / CHANGES").count(), 1, "{table}");
        let o = run(url, &["refreshes", S, "--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let lines: Vec<Value> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let brief: Vec<Value> = lines
            .iter()
            .map(|r| {
                let tools: Vec<Value> = r["tools"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| json!([t["name"], t["evidence_seq"]]))
                    .collect();
                let removed: Vec<Value> = r["removed"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| json!([x["name"], x["reason"]["code"]]))
                    .collect();
                json!([
                    r["seq"],
                    r["type"],
                    r["prompt"],
                    r["mode"],
                    tools,
                    r["added"],
                    removed
                ])
            })
            .collect();
        assert_eq!(
            brief,
            vec![
                json!([4, "prompt_submitted", 1, "agent", [], [], []]),
                json!([
                    9,
                    "prompt_submitted",
                    2,
                    "agent",
                    [["image_view", 6], ["web_fetch", 6]],
                    ["image_view", "web_fetch"],
                    []
                ]),
                json!([
                    10,
                    "mode_switched",
                    2,
                    "plan",
                    [["image_view", 6]],
                    [],
                    [["web_fetch", "not_in_mode_catalog"]]
                ]),
                json!([
                    11,
                    "mode_switched",
                    2,
                    "agent",
                    [["image_view", 6], ["web_fetch", 6]],
                    ["web_fetch"],
                    []
                ]),
                json!([
                    13,
                    "prompt_submitted",
                    3,
                    "agent",
                    [["image_view", 6]],
                    [],
                    [["web_fetch", "dropped_by_catalog_rebuild"]]
                ]),
                json!([
                    15,
                    "prompt_submitted",
                    4,
                    "agent",
                    [],
                    [],
                    [["image_view", "compacted"]]
                ]),
            ],
            "{backend}"
        );
        assert_eq!(lines[2]["event_id"], json!(id(10)));

        // Every refresh point's set is what `activations --at-seq` answers.
        for r in &lines {
            let seq = r["seq"].to_string();
            let act = json_of(&run(url, &["activations", S, "--at-seq", &seq, "--json"]));
            assert_eq!(act["tools"], r["tools"], "{backend} at seq {seq}");
        }
    }
}

#[test]
fn explain_rejects_bad_points_with_a_sentence() {
    let db = common::sqlite_db();
    let url = db.url.as_str();
    assert!(run(url, &["import", LOG]).status.success());
    for (args, want) in [
        (
            vec!["explain", S, "web_fetch", "--at-prompt", "5"],
            "there is no prompt 5",
        ),
        (
            vec!["explain", S, "web_fetch", "--at-prompt", "0"],
            "there is no prompt 0",
        ),
        // Past i64: an answer's error (exit 1), as for `--at-seq`, not a
        // usage error.
        (
            vec![
                "explain",
                S,
                "web_fetch",
                "--at-prompt",
                "99999999999999999999",
            ],
            "there is no prompt",
        ),
        (
            vec!["explain", S, "web_fetch", "--at-seq", "16"],
            "seq 16 is out of range",
        ),
        (vec!["explain", S, ""], "the tool name is empty"),
        (
            vec![
                "explain",
                "11111111-2222-4333-8444-555555555555",
                "web_fetch",
            ],
            "not found",
        ),
        (vec!["refreshes", "nope"], "is not a session UUID"),
    ] {
        let o = run(url, &args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn activation_changes_are_verified_rebuilt_and_backfilled() {
    for (backend, db) in backends() {
        let url = db.url.as_str();
        assert!(run(url, &["import", LOG]).status.success(), "{backend}");
        let changes = |url: &str| {
            json_of(&run(url, &["audit", "changes", "--session", S, "--json"]))["changes"].clone()
        };
        let before = changes(url);
        assert_eq!(before.as_array().unwrap().len(), 6, "{backend}: {before}");

        // A forged row is drift that verify names, and rebuild repairs.
        common::raw_sql(url, "DELETE FROM activation_changes WHERE seq = 13");
        let o = run(url, &["verify", S]);
        assert_eq!(o.status.code(), Some(5), "{backend}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("activation changes differ"),
            "{backend}: {err}"
        );
        assert!(run(url, &["rebuild", S]).status.success());
        assert_eq!(changes(url), before, "{backend}");

        // A row that differs only in a field the sentence would not show
        // otherwise: the field is named.
        common::raw_sql(
            url,
            "UPDATE activation_changes SET evidence_seq = evidence_seq + 1 \
             WHERE evidence_seq IS NOT NULL",
        );
        let o = run(url, &["verify", S]);
        assert_eq!(o.status.code(), Some(5), "{backend}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("has `evidence_seq` ") && err.contains(" in the index but "),
            "{backend}: {err}"
        );
        assert!(run(url, &["rebuild", S]).status.success());
        assert_eq!(changes(url), before, "{backend}");

        // A store from before migration 0005: no rows, listed for backfill;
        // the next open computes them.
        common::raw_sql(url, "DELETE FROM activation_changes");
        common::raw_sql(
            url,
            &format!("INSERT INTO changes_backfill (session_id) VALUES ('{S}')"),
        );
        assert_eq!(changes(url), before, "{backend}");
        assert!(run(url, &["verify", S]).status.success(), "{backend}");
    }
}

#[test]
fn every_audit_query_reads_an_index_on_sqlite() {
    use session_store::store::query::{ChangeQuery, EventQuery, PlanOf, Scope};
    let db = common::sqlite_db();
    assert!(run(&db.url, &["import", LOG]).status.success());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = session_store::Store::open(&db.url).await.unwrap();
        let t = "2026-01-01T00:00:00Z".parse().unwrap();
        let scope = |session, since| Scope {
            tenant: Some("default".into()),
            session,
            since,
            limit: 100,
            ..Scope::default()
        };
        let session: uuid::Uuid = S.parse().unwrap();
        let plain = scope(None, None);
        let timed = scope(None, Some(t));
        let typed = EventQuery {
            scope: plain.clone(),
            event_type: Some("compaction".into()),
            ..EventQuery::default()
        };
        let by_session = EventQuery {
            scope: scope(Some(session), None),
            ..EventQuery::default()
        };
        let by_time = EventQuery {
            scope: timed.clone(),
            ..EventQuery::default()
        };
        let by_position = EventQuery {
            scope: plain.clone(),
            from_position: Some(3),
            to_position: Some(9),
            ..EventQuery::default()
        };
        let by_tool = ChangeQuery {
            scope: plain.clone(),
            tool: Some("web_fetch".into()),
            ..ChangeQuery::default()
        };
        let changes_by_time = ChangeQuery {
            scope: timed.clone(),
            ..ChangeQuery::default()
        };
        for (name, of) in [
            ("events by type", PlanOf::Events(&typed)),
            ("events of a session", PlanOf::Events(&by_session)),
            ("events by time", PlanOf::Events(&by_time)),
            ("events by position", PlanOf::Events(&by_position)),
            ("changes of a tool", PlanOf::Changes(&by_tool)),
            ("changes by time", PlanOf::Changes(&changes_by_time)),
            ("unanswered calls", PlanOf::UnansweredCalls(&plain)),
            ("named results", PlanOf::NamedResults(&plain)),
            ("catalogs", PlanOf::Catalogs(session)),
            ("sessions", PlanOf::Sessions(&plain)),
        ] {
            let plan = store.audit_plan(of).await.unwrap();
            // A bare `SCAN e` (no `USING …`) would read the whole table.
            let full_scans: Vec<&str> = plan
                .lines()
                .filter(|l| l.starts_with("SCAN ") && !l.contains("USING"))
                .collect();
            assert!(full_scans.is_empty(), "{name}: {plan}");
            assert!(
                plan.contains("INDEX") || plan.contains("PRIMARY KEY"),
                "{name}: {plan}"
            );
        }
        // The sparse types through their partial index; the others in
        // position order through the primary key (docs/audit.md).
        for t in session_store::event::EVENT_TYPES {
            let q = EventQuery {
                event_type: Some(t.into()),
                ..typed.clone()
            };
            let plan = store.audit_plan(PlanOf::Events(&q)).await.unwrap();
            let sparse = !matches!(t, "assistant_message" | "tool_call" | "tool_result");
            let used = if sparse {
                "USING INDEX events_sparse_types"
            } else {
                "USING INTEGER PRIMARY KEY"
            };
            assert!(plan.contains(used), "{t}: {plan}");
        }
    });
}

#[test]
fn time_bounds_finer_than_a_microsecond_keep_since_inclusive_and_until_exclusive() {
    // Stored times have whole microseconds; a bound between two of them
    // must neither take the row just below it (`since`) nor drop it
    // (`until`), on both backends.
    let s = "11111111-1111-4111-8111-111111111111";
    let at = |t: &str| format!("\"recorded_at\":\"2026-12-01T00:00:0{t}Z\"");
    let lines = [
        format!(
            r#"{{"session_id":"{s}","type":"session_started","mode":"agent",{}}}"#,
            at("0")
        ),
        format!(
            r#"{{"session_id":"{s}","type":"catalog_defined","mode":"agent","deferred_tools":["web_fetch"],{}}}"#,
            at("0")
        ),
        format!(
            r#"{{"session_id":"{s}","type":"tool_call","call_id":"c1","tool_name":"web_fetch","input":null,{}}}"#,
            at("0")
        ),
        format!(
            r#"{{"session_id":"{s}","type":"tool_result","call_id":"c1","tool_name":"web_fetch","status":"success",{}}}"#,
            at("0")
        ),
        format!(
            r#"{{"session_id":"{s}","type":"prompt_submitted","text":"a",{}}}"#,
            at("1")
        ),
    ];
    for (name, db) in backends() {
        let url = db.url.as_str();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("times.jsonl");
        std::fs::write(&file, lines.join("\n") + "\n").unwrap();
        let o = run(url, &["import", file.to_str().unwrap()]);
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let count = |args: &[&str], key: &str| -> usize {
            let v = json_of(&run(url, args));
            v[key].as_array().unwrap().len()
        };
        let events = |bound: &str, t: &str| {
            count(
                &[
                    "audit",
                    "events",
                    "--type",
                    "prompt_submitted",
                    bound,
                    t,
                    "--json",
                ],
                "events",
            )
        };
        let changes =
            |bound: &str, t: &str| count(&["audit", "changes", bound, t, "--json"], "changes");
        // The row at 00:00:01.000000 is below 00:00:01.0000005.
        let after_row = "2026-12-01T00:00:01.0000005Z";
        assert_eq!(events("--since", after_row), 0, "{name}");
        assert_eq!(events("--until", after_row), 1, "{name}");
        assert_eq!(changes("--since", after_row), 0, "{name}");
        assert_eq!(changes("--until", after_row), 1, "{name}");
        // And above 00:00:00.9999995.
        let before_row = "2026-12-01T00:00:00.9999995Z";
        assert_eq!(events("--since", before_row), 1, "{name}");
        assert_eq!(events("--until", before_row), 0, "{name}");
        assert_eq!(changes("--since", before_row), 1, "{name}");
        assert_eq!(changes("--until", before_row), 0, "{name}");
        // A whole microsecond is taken as it is.
        assert_eq!(events("--since", "2026-12-01T00:00:01Z"), 1, "{name}");
        assert_eq!(events("--until", "2026-12-01T00:00:01Z"), 0, "{name}");
        // Bounds outside the years the store keeps (0000 to 9999 in UTC)
        // mean all rows or none. SQLite compares times as text, where the
        // year 10000 (`+10000-…`) sorted before 2026: every row was after
        // it, and none before.
        let late = "9999-12-31T23:30:00-01:00"; // 10000-01-01T00:30Z
        let early = "0000-01-01T00:30:00+01:00"; // the year -1 in UTC
        assert_eq!(events("--since", late), 0, "{name}");
        assert_eq!(events("--until", late), 1, "{name}");
        assert_eq!(changes("--since", late), 0, "{name}");
        assert_eq!(changes("--until", late), 1, "{name}");
        assert_eq!(events("--since", early), 1, "{name}");
        assert_eq!(events("--until", early), 0, "{name}");
        // A year outside 0000-9999 is refused naming its flag, also
        // written after a space (`-0001-…` looks like a flag to clap).
        for bound in ["--since", "--until"] {
            for year in ["-0001-01-01T00:00:00Z", "+10000-01-01T00:00:00Z"] {
                let o = run(url, &["audit", "events", bound, year]);
                assert_eq!(o.status.code(), Some(2), "{name} {bound} {year}");
                let err = String::from_utf8_lossy(&o.stderr);
                assert!(
                    err.contains(&format!("for '{bound} <"))
                        && err.contains("not an RFC 3339 time"),
                    "{name} {bound} {year}: {err}"
                );
            }
        }
        // View drift is a state of the current views, not of a time.
        for bound in ["--since", "--until"] {
            let o = run(url, &["audit", "anomalies", "view-drift", bound, after_row]);
            assert_eq!(o.status.code(), Some(1), "{name} {bound}");
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                err.contains("does not apply to view drift"),
                "{name}: {err}"
            );
        }
    }
}

/// A page that ends at the last row says so (`next` null) instead of
/// handing out a cursor to an empty page; one that does not, gives the
/// cursor of its last row. Cursors and positions are 0 or more, written
/// `--after -1` or `--after=-1` alike (exit 1 naming the value, not a usage
/// error), on every paged query.
#[test]
fn audit_pages_end_where_the_rows_do_and_refuse_negative_cursors() {
    for (backend, db) in backends() {
        let url = db.url.as_str();
        assert!(run(url, &["import", LOG]).status.success(), "{backend}");
        // A call without its result, for the unanswered calls.
        let open = r#"{"type":"tool_call","call_id":"open","tool_name":"web_fetch","input":null}"#;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("open.jsonl");
        std::fs::write(&file, format!("{open}\n")).unwrap();
        let o = run(
            url,
            &["append", S, "--expected-seq", "15", file.to_str().unwrap()],
        );
        assert!(
            o.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for (query, rows, next) in [
            (vec!["events"], "events", "next_after_position"),
            (vec!["changes"], "changes", "next"),
            (vec!["anomalies", "unanswered-call"], "anomalies", "next"),
        ] {
            let page = |limit: usize| {
                let mut args = vec!["audit"];
                args.extend(&query);
                let limit = limit.to_string();
                args.extend(["--limit", limit.as_str(), "--json"]);
                json_of(&run(url, &args))
            };
            let all = page(1000)[rows].as_array().unwrap().len();
            assert!(all >= 1, "{backend} {query:?}");
            let full = page(all);
            assert_eq!(
                full[rows].as_array().unwrap().len(),
                all,
                "{backend} {query:?}"
            );
            assert_eq!(full[next], Value::Null, "{backend} {query:?}: {full}");
            if all > 1 {
                let short = page(all - 1);
                assert_ne!(short[next], Value::Null, "{backend} {query:?}: {short}");
            }
        }
        for args in [
            vec!["audit", "events", "--after", "-1"],
            vec!["audit", "events", "--from-position", "-1"],
            vec!["audit", "events", "--to-position=-1"],
            vec!["audit", "changes", "--after", "-5:web_fetch"],
            vec!["audit", "anomalies", "unanswered-call", "--after", "-3"],
            vec!["audit", "anomalies", "unknown-evidence-name", "--after=-3"],
            vec!["explain", S, "web_fetch", "--at-prompt", "-1"],
        ] {
            let o = run(url, &args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{backend} {args:?}: {err}");
            assert!(
                err.contains("-1") || err.contains("-3") || err.contains("-5"),
                "{backend} {args:?}: {err}"
            );
            // In the CLI's words: the flag typed, not the HTTP parameter.
            if let Some(flag) = args.iter().find_map(|a| {
                a.strip_prefix("--")
                    .map(|f| f.split('=').next().unwrap_or(f))
                    .filter(|f| *f != "at-prompt")
            }) {
                assert!(
                    err.contains(&format!("field `--{flag}`")) && !err.contains("_position"),
                    "{backend} {args:?}: {err}"
                );
            }
        }
    }
}

/// `unknown-evidence-name` names each unknown tool once, however often the
/// result lists it; and `verify` says a calls index row that is missing as
/// missing, not as a difference of values.
#[test]
fn unknown_names_are_listed_once_and_a_missing_call_row_is_said_as_missing() {
    for (backend, db) in backends() {
        let url = db.url.as_str();
        let s = "22222222-2222-4222-8222-222222222222";
        let lines = [
            format!(r#"{{"session_id":"{s}","type":"session_started","mode":"agent"}}"#),
            format!(
                r#"{{"session_id":"{s}","type":"catalog_defined","mode":"agent","deferred_tools":["web_fetch"]}}"#
            ),
            format!(
                r#"{{"session_id":"{s}","type":"tool_call","call_id":"c1","tool_name":"ToolSearch","input":null}}"#
            ),
            format!(
                r#"{{"session_id":"{s}","type":"tool_result","call_id":"c1","tool_name":"ToolSearch","status":"success","added_tool_names":["ghost","web_fetch","ghost"]}}"#
            ),
        ];
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("names.jsonl");
        std::fs::write(&file, lines.join("\n") + "\n").unwrap();
        assert!(run(url, &["import", file.to_str().unwrap()])
            .status
            .success());
        let page = json_of(&run(
            url,
            &["audit", "anomalies", "unknown-evidence-name", "--json"],
        ));
        // A page exactly full of the only anomaly ends the pages.
        let one = json_of(&run(
            url,
            &[
                "audit",
                "anomalies",
                "unknown-evidence-name",
                "--limit",
                "1",
                "--json",
            ],
        ));
        assert_eq!(
            one["anomalies"].as_array().unwrap().len(),
            1,
            "{backend}: {one}"
        );
        assert_eq!(one["next"], Value::Null, "{backend}: {one}");
        // With more, every page size finds each once, and the last page
        // says it is the last.
        let s2 = "33333333-3333-4333-8333-333333333333";
        let mut more = vec![format!(
            r#"{{"session_id":"{s2}","type":"session_started","mode":"agent"}}"#
        )];
        for i in 0..4 {
            more.push(format!(r#"{{"session_id":"{s2}","type":"tool_call","call_id":"k{i}","tool_name":"ToolSearch","input":null}}"#));
            more.push(format!(r#"{{"session_id":"{s2}","type":"tool_result","call_id":"k{i}","tool_name":"ToolSearch","status":"success","added_tool_names":["g{i}"]}}"#));
        }
        let file2 = dir.path().join("more.jsonl");
        std::fs::write(&file2, more.join("\n") + "\n").unwrap();
        assert!(run(url, &["import", file2.to_str().unwrap()])
            .status
            .success());
        for limit in 1..=6 {
            let (mut seen, mut after, mut pages) = (Vec::new(), None::<String>, 0);
            loop {
                let limit = limit.to_string();
                let mut args = vec![
                    "audit",
                    "anomalies",
                    "unknown-evidence-name",
                    "--limit",
                    &limit,
                    "--json",
                ];
                let cursor;
                if let Some(a) = &after {
                    cursor = a.clone();
                    args.extend(["--after", &cursor]);
                }
                let page = json_of(&run(url, &args));
                pages += 1;
                for a in page["anomalies"].as_array().unwrap() {
                    seen.push(a["position"].as_i64().unwrap());
                }
                match page["next"].as_str() {
                    Some(n) => after = Some(n.to_owned()),
                    None => break,
                }
            }
            let mut unique = seen.clone();
            unique.dedup();
            assert_eq!(
                (seen.len(), unique.len()),
                (5, 5),
                "{backend} limit {limit}: {seen:?}"
            );
            assert_eq!(
                pages,
                5_usize.div_ceil(limit),
                "{backend} limit {limit}: pages"
            );
        }
        let found = &page["anomalies"][0];
        assert_eq!(found["tools"], json!(["ghost"]), "{backend}: {page}");
        assert!(
            found["detail"]
                .as_str()
                .unwrap()
                .contains("names ghost that"),
            "{backend}: {page}"
        );

        common::raw_sql(url, "DELETE FROM calls WHERE call_id = 'c1'");
        let o = run(url, &["verify", s]);
        assert_eq!(o.status.code(), Some(5), "{backend}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains(r#"the calls index has no row for call "c1", where the log says"#),
            "{backend}: {err}"
        );
    }
}

#[test]
fn events_by_type_are_every_event_of_that_type_in_order_on_both_backends() {
    // Sparse types are read through a partial index, the others by
    // scanning the log in position order (migration 0009): both must give
    // exactly the log's rows of the type, page after page.
    let mut logs: Vec<std::path::PathBuf> = std::fs::read_dir(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/examples"
    ))
    .unwrap()
    .map(|e| e.unwrap().path())
    .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
    .collect();
    logs.push(LOG.into());
    for (backend, db) in backends() {
        let url = db.url.as_str();
        for log in &logs {
            let o = run(url, &["import", log.to_str().unwrap()]);
            assert!(o.status.success(), "{backend}: {log:?}");
        }
        // Pages of 2 rows, following `next`, as a client would.
        let all = |extra: &[&str]| -> Vec<Value> {
            let mut rows = Vec::new();
            let mut after = "0".to_owned();
            loop {
                let mut args = vec!["audit", "events", "--limit", "2", "--after", &after];
                args.extend_from_slice(extra);
                args.push("--json");
                let page = json_of(&run(url, &args));
                rows.extend(page["events"].as_array().unwrap().iter().cloned());
                match page["next_after_position"].as_i64() {
                    Some(next) => after = next.to_string(),
                    None => break,
                }
            }
            rows
        };
        let log = all(&[]);
        let mut seen = 0;
        for t in session_store::event::EVENT_TYPES {
            let expected: Vec<&Value> = log.iter().filter(|e| e["type"] == t).collect();
            assert!(!expected.is_empty(), "{backend}: the fixtures have no {t}");
            let typed = all(&["--type", t]);
            assert_eq!(typed.iter().collect::<Vec<_>>(), expected, "{backend}: {t}");
            seen += typed.len();
        }
        assert_eq!(seen, log.len(), "{backend}");
    }
}

#[test]
fn a_store_from_before_the_sparse_type_index_is_upgraded_whole() {
    // Migrations 0009 (the partial type index, both backends) and 0010
    // (views WITHOUT ROWID, SQLite) run on a store that has
    // rows: the store is put back into the shape those migrations found
    // (old index, rowid tables, the two versions unapplied), then opened.
    let view_cols =
        "session_id TEXT PRIMARY KEY, refresh_seq INTEGER NOT NULL, mode TEXT NOT NULL, \
                     window_start INTEGER NOT NULL, compaction_seq INTEGER, summary TEXT, \
                     catalogs TEXT NOT NULL, evidence TEXT NOT NULL, active TEXT NOT NULL";
    for (backend, db) in backends() {
        let url = db.url.as_str();
        assert!(run(url, &["import", LOG]).status.success(), "{backend}");
        let page = |t: &str| json_of(&run(url, &["audit", "events", "--type", t, "--json"]));
        let before = (page("compaction"), page("tool_call"));
        let views =
            "SELECT CAST(COUNT(*) AS TEXT) || ':' || CAST(SUM(refresh_seq) AS TEXT) || ':' \
                     || MAX(active) FROM session_views";
        let views_before = common::scalar(url, views);
        let mut back = vec![
            "DROP INDEX events_sparse_types".to_owned(),
            "CREATE INDEX events_type_position ON events (type, position)".to_owned(),
        ];
        if backend == "sqlite" {
            back.push(format!("CREATE TABLE session_views_rowid ({view_cols})"));
            back.push("INSERT INTO session_views_rowid SELECT * FROM session_views".to_owned());
            back.push("DROP TABLE session_views".to_owned());
            back.push("ALTER TABLE session_views_rowid RENAME TO session_views".to_owned());
        }
        // SQLite's 0009 and 0010; PostgreSQL's 0009 and 0011.
        let versions = if backend == "sqlite" {
            "9, 10"
        } else {
            "9, 11"
        };
        back.push(format!(
            "DELETE FROM _sqlx_migrations WHERE version IN ({versions})"
        ));
        for sql in &back {
            common::raw_sql(url, sql);
        }
        let applied = format!(
            "SELECT CAST(COUNT(*) AS TEXT) FROM _sqlx_migrations WHERE version IN ({versions})"
        );
        assert_eq!(
            common::scalar(url, &applied).as_deref(),
            Some("0"),
            "{backend}"
        );

        // The next open migrates, and says so; the answers and the views
        // are the same, and verify finds the views in agreement with the
        // log.
        let out = run(url, &["audit", "events", "--type", "compaction", "--json"]);
        let said = String::from_utf8_lossy(&out.stderr);
        let (from, to) = if backend == "sqlite" {
            (5, 10)
        } else {
            (8, 12)
        };
        assert_eq!(
            said,
            format!(
                "session-store: upgraded the store's schema from migration {from} to {to}; \
                 builds older than this one refuse the store from now on (docs/operations.md, \"Upgrades\")\n"
            ),
            "{backend}"
        );
        assert_eq!((page("compaction"), page("tool_call")), before, "{backend}");
        assert_eq!(common::scalar(url, views), views_before, "{backend}");
        assert!(run(url, &["verify", S]).status.success(), "{backend}");
        let expected = "2";
        assert_eq!(
            common::scalar(url, &applied).as_deref(),
            Some(expected),
            "{backend}"
        );
        let old_index = match backend {
            "sqlite" => "SELECT name FROM sqlite_master WHERE name = 'events_type_position'",
            _ => "SELECT CAST(to_regclass('events_type_position') AS TEXT)",
        };
        assert_eq!(common::scalar(url, old_index), None, "{backend}");
        if backend == "sqlite" {
            let sql = common::scalar(
                url,
                "SELECT sql FROM sqlite_master WHERE name = 'session_views'",
            )
            .unwrap_or_default();
            assert!(sql.contains("WITHOUT ROWID"), "{sql}");
        }
    }
}

/// The store's PostgreSQL connections do not compile statements with JIT:
/// a paged audit read is costed as the whole scan under its `LIMIT`, and
/// above `jit_above_cost` was compiled on every call, which took most of
/// its time (docs/audit.md, src/store/postgres.rs `SESSION_SETTINGS`).
#[test]
fn postgres_audit_reads_are_not_jit_compiled() {
    use session_store::store::query::{EventQuery, PlanOf};
    use sqlx::Connection;
    let Some(db) = common::postgres_db() else {
        return;
    };
    assert!(run(&db.url, &["import", LOG]).status.success());
    // Every statement above the threshold, even this small table's.
    let name = common::scalar(&db.url, "SELECT current_database()::text").unwrap();
    common::raw_sql(
        &db.url,
        &format!("ALTER DATABASE {name} SET jit_above_cost = 0"),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // A connection with the server's other defaults compiles it: the
        // check below could fail.
        let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
        let plain: Vec<String> = sqlx::query_scalar(
            "EXPLAIN (ANALYZE) SELECT count(*) FROM events WHERE type = 'compaction'",
        )
        .fetch_all(&mut c)
        .await
        .unwrap();
        assert!(plain.iter().any(|l| l.starts_with("JIT:")), "{plain:?}");
        let store = session_store::Store::open(&db.url).await.unwrap();
        let q = EventQuery {
            event_type: Some("compaction".into()),
            ..EventQuery::default()
        };
        let plan = store.audit_plan(PlanOf::Events(&q)).await.unwrap();
        assert!(plan.contains("events_sparse_types"), "{plan}");
        assert!(!plan.contains("JIT:"), "{plan}");
        store.close().await;
    });
}

/// A PostgreSQL store holding the audit log, put back into the shape
/// migrations 0009 and 0011 found: the index of every event by type, no
/// partial one, the versions unapplied (`None` without PostgreSQL, as
/// `common::postgres_db`).
fn pg_store_before_sparse_types() -> Option<common::TestDb> {
    let db = common::postgres_db()?;
    assert!(run(&db.url, &["import", LOG]).status.success());
    for sql in [
        "DROP INDEX events_sparse_types",
        "CREATE INDEX events_type_position ON events (type, position)",
        "DELETE FROM _sqlx_migrations WHERE version IN (9, 11)",
    ] {
        common::raw_sql(&db.url, sql);
    }
    Some(db)
}

/// Opens a store on `url` (which has migrations to apply) while another
/// connection holds a transaction that has read `events`, which the
/// migration waits for; meanwhile a third connection's `read` must answer
/// `expected` at once, not queue behind the migration's locks (it gives
/// up after 2 s). Then the transaction ends and the open must succeed.
fn open_while_a_reader_holds_events(url: &str, read: &str, expected: i64) {
    use sqlx::Connection;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut holder = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::raw_sql("BEGIN; SELECT count(*) FROM events")
            .execute(&mut holder)
            .await
            .unwrap();
        let opening = tokio::spawn({
            let url = url.to_owned();
            async move { session_store::Store::open(&url).await }
        });
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        assert!(!opening.is_finished(), "the migration did not wait");
        let mut reader = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::raw_sql("SET lock_timeout = '2s'")
            .execute(&mut reader)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let n: i64 = sqlx::query_scalar(read)
            .fetch_one(&mut reader)
            .await
            .expect("a read while the migration waits");
        assert_eq!(n, expected);
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
        let store = opening.await.unwrap().expect("the open");
        store.close().await;
    });
}

#[test]
fn postgres_the_type_index_migration_lets_others_read_while_it_waits() {
    // 0011 drops the old index CONCURRENTLY: while it waits for a
    // transaction that has read `events`, other connections still read
    // the table. (A plain DROP INDEX queues for an exclusive lock, and
    // every read behind it waits too.)
    let Some(db) = pg_store_before_sparse_types() else {
        return;
    };
    let url = db.url.clone();
    open_while_a_reader_holds_events(&url, "SELECT count(*) FROM events", 15);
    let gone = "SELECT CAST(to_regclass('events_type_position') AS TEXT)";
    assert_eq!(common::scalar(&url, gone), None);
}

/// What a cut-off concurrent build of 0009 leaves: the index, invalid
/// (the test server's user is a superuser).
fn leave_a_cut_off_sparse_type_index(url: &str) {
    common::raw_sql(
        url,
        "CREATE INDEX events_sparse_types ON events (type, position) \
         WHERE type IN ('session_started', 'catalog_defined', 'prompt_submitted', \
         'compaction', 'mode_switched')",
    );
    common::raw_sql(
        url,
        "UPDATE pg_index SET indisvalid = false \
         WHERE indexrelid = to_regclass('events_sparse_types')",
    );
}

#[test]
fn postgres_an_unfinished_sparse_type_index_is_built_again_without_stopping_reads() {
    // A build of 0009 cut off leaves an invalid index, which its IF NOT
    // EXISTS would pass over (and record 0009): the next open drops it and
    // builds it again, both CONCURRENTLY, so that reads go on meanwhile.
    // (0009 is recorded only after a build that finished.)
    let Some(db) = pg_store_before_sparse_types() else {
        return;
    };
    let url = db.url.clone();
    let valid = "SELECT CAST(indisvalid AS TEXT) FROM pg_index \
                 WHERE indexrelid = to_regclass('events_sparse_types')";
    leave_a_cut_off_sparse_type_index(&url);
    assert_eq!(common::scalar(&url, valid).as_deref(), Some("false"));
    open_while_a_reader_holds_events(
        &url,
        "SELECT count(*) FROM events WHERE type = 'compaction'",
        1,
    );
    assert_eq!(common::scalar(&url, valid).as_deref(), Some("true"));
    let page = json_of(&run(
        &url,
        &["audit", "events", "--type", "compaction", "--json"],
    ));
    assert_eq!(page["events"].as_array().unwrap().len(), 1, "{page}");
}

#[test]
fn postgres_a_rebuild_of_the_type_index_held_up_by_a_lock_says_which_migration() {
    // The rebuild of a cut-off 0009 waits for the lock on `events` another
    // transaction holds: past the lock timeout the open fails naming the
    // migration and the index, as a first attempt's failure does (it said
    // only "canceling statement due to lock timeout"), and the next open
    // once the lock is gone finishes it.
    use sqlx::Connection;
    let Some(db) = pg_store_before_sparse_types() else {
        return;
    };
    let url = db.url.clone();
    leave_a_cut_off_sparse_type_index(&url);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let holder = rt.block_on(async {
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::raw_sql("BEGIN; LOCK TABLE events IN SHARE UPDATE EXCLUSIVE MODE")
            .execute(&mut c)
            .await
            .unwrap();
        c
    });
    let out = run(&url, &["migrate"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{said}");
    assert!(
        said.contains("failed at migration 9, building again the index events_sparse_types")
            && said.contains("lock timeout")
            && said.contains("the next open tries again"),
        "{said}"
    );
    rt.block_on(holder.close()).unwrap();
    let out = run(&url, &["migrate"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let valid = "SELECT CAST(indisvalid AS TEXT) FROM pg_index \
                 WHERE indexrelid = to_regclass('events_sparse_types')";
    assert_eq!(common::scalar(&url, valid).as_deref(), Some("true"));
}

#[test]
fn postgres_an_open_waits_for_another_instances_migration_a_bounded_time() {
    // An instance frozen while it holds the migration lock must not hold
    // every open behind it until its connection dies.
    use sqlx::Connection;
    let Some(db) = pg_store_before_sparse_types() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut frozen = sqlx::PgConnection::connect(&db.url).await.unwrap();
        // `MIGRATION_LOCK` of src/store/postgres.rs (0x5353_4d49_4752_4154).
        sqlx::query("SELECT pg_advisory_lock(6004227705339527508)")
            .execute(&mut frozen)
            .await
            .unwrap();
        let options = session_store::StoreOptions {
            migration_lock_wait: std::time::Duration::from_secs(1),
            ..session_store::StoreOptions::default()
        };
        let started = std::time::Instant::now();
        let err = match session_store::Store::open_with(&db.url, options).await {
            Ok(_) => panic!("opened while another instance holds the migration lock"),
            Err(e) => e,
        };
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert!(
            err.to_string()
                .contains("another instance has been migrating"),
            "{err}"
        );
        // Released, the next open migrates.
        frozen.close().await.unwrap();
        session_store::Store::open(&db.url)
            .await
            .unwrap()
            .close()
            .await;
    });
}

#[test]
fn postgres_instances_opening_together_all_migrate_the_type_index() {
    // Several instances started at once on a store that needs 0009: one
    // migrates while the others wait without holding a statement open,
    // which `CREATE INDEX CONCURRENTLY` would wait for (a deadlock that
    // PostgreSQL breaks by refusing one of them).
    let Some(db) = pg_store_before_sparse_types() else {
        return;
    };
    let url = db.url.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let opens: Vec<_> = (0..3)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { session_store::Store::open(&url).await })
            })
            .collect();
        for open in opens {
            let store = open.await.unwrap().expect("every instance opens");
            store.close().await;
        }
    });
    let valid = "SELECT CAST(indisvalid AS TEXT) FROM pg_index \
                 WHERE indexrelid = to_regclass('events_sparse_types')";
    assert_eq!(common::scalar(&url, valid).as_deref(), Some("true"));
}

/// `audit changes` orders the tools of one refresh point by their bytes on
/// both backends, also on a PostgreSQL database whose collation is not
/// (ICU's `en-US` puts `alpha` before `Zeta`), and pages the same way: a
/// store moved between backends answers alike, page for page.
#[test]
fn changes_order_tools_by_their_bytes_on_every_collation() {
    let session = "c011a7e0-0000-4000-8000-000000000001";
    let line = |body: &str| format!(r#"{{"session_id":"{session}",{body}}}"#);
    let log = [
        line(r#""type":"session_started","mode":"agent""#),
        line(
            r#""type":"catalog_defined","mode":"agent","deferred_tools":["beta","éclair","Zeta","alpha"]"#,
        ),
        line(r#""type":"prompt_submitted","text":"find tools""#),
        line(r#""type":"tool_call","call_id":"s1","tool_name":"ToolSearch","input":{}"#),
        line(
            r#""type":"tool_result","call_id":"s1","tool_name":"ToolSearch","status":"success","output":{},"added_tool_names":["beta","éclair","Zeta","alpha"]"#,
        ),
        line(r#""type":"prompt_submitted","text":"use them""#),
    ]
    .join("\n");
    let mut stores = vec![("sqlite", common::sqlite_db())];
    let icu =
        "TEMPLATE template0 ENCODING 'UTF8' LOCALE 'C' LOCALE_PROVIDER icu ICU_LOCALE 'en-US'";
    if let Some(db) = common::postgres_db_with(icu) {
        // The database sorts as the test means it to.
        let sorted = "SELECT string_agg(t, ',' ORDER BY t) FROM (VALUES ('Zeta'), ('alpha')) v(t)";
        assert_eq!(
            common::scalar(&db.url, sorted),
            Some("alpha,Zeta".to_owned())
        );
        stores.push(("postgres (ICU en-US)", db));
    }
    let want = ["Zeta", "alpha", "beta", "éclair"];
    for (backend, db) in &stores {
        let out = Command::new(BIN)
            .args(["--database", &db.url, "import"])
            .env_remove("DATABASE_URL")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                child.stdin.take().unwrap().write_all(log.as_bytes())?;
                child.wait_with_output()
            })
            .unwrap();
        assert!(
            out.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let page = json_of(&run(&db.url, &["audit", "changes", "--json"]));
        let tools: Vec<&str> = page["changes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["tool"].as_str().unwrap())
            .collect();
        assert_eq!(tools, want, "{backend}: one page");
        let mut paged = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut args = vec!["audit", "changes", "--json", "--limit", "1"];
            if let Some(a) = &after {
                args.extend(["--after", a.as_str()]);
            }
            let page = json_of(&run(&db.url, &args));
            for c in page["changes"].as_array().unwrap() {
                paged.push(c["tool"].as_str().unwrap().to_owned());
            }
            match page["next"].as_str() {
                Some(next) => after = Some(next.to_owned()),
                None => break,
            }
            assert!(paged.len() <= want.len(), "{backend}: {paged:?}");
        }
        assert_eq!(paged, want, "{backend}: pages of one");
    }
}
