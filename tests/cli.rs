//! The real binary, on both backends: the spec's worked examples, bad input
//! (each rule of SEMANTICS §4 leaves the store unchanged), exit codes.

mod common;

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_session-store");
const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/examples");

/// The binary on `url` with `args`, its standard streams piped.
fn spawn(url: &str, args: &[&str]) -> std::process::Child {
    Command::new(BIN)
        .arg("--database")
        .arg(url)
        .args(args)
        .env_remove("DATABASE_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run session-store")
}

fn run(url: &str, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = spawn(url, args);
    {
        let mut input = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            // A command refused before it reads its input (a path that
            // holds no store, a usage error) may have exited already:
            // its answer is what the test judges, not this write.
            match input.write_all(text.as_bytes()) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                other => other.unwrap(),
            }
        }
    }
    child.wait_with_output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every backend available to this run: SQLite always, PostgreSQL unless
/// skipped (never under CI=true).
fn backends() -> Vec<(&'static str, common::TestDb)> {
    let mut v = vec![("sqlite", common::sqlite_db())];
    if let Some(db) = common::postgres_db() {
        v.push(("postgres", db));
    }
    v
}

fn strip_envelope(mut v: Value) -> Value {
    if let Some(rows) = v.get_mut("rows").and_then(Value::as_array_mut) {
        for row in rows {
            if let Some(o) = row.as_object_mut() {
                o.remove("position");
                o.remove("recorded_at");
            }
        }
    }
    v
}

#[test]
fn spec_examples_print_their_expected_json_on_both_backends() {
    let mut names: Vec<String> = std::fs::read_dir(EXAMPLES)
        .unwrap()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(".jsonl")
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    assert_eq!(names.len(), 5, "{names:?}");
    for (backend, db) in backends() {
        for name in &names {
            let log = format!("{EXAMPLES}/{name}.jsonl");
            let expected: Value = serde_json::from_str(
                &std::fs::read_to_string(format!("{EXAMPLES}/{name}.expected.json")).unwrap(),
            )
            .unwrap();
            let out = run(&db.url, &["import", &log], None);
            assert!(out.status.success(), "{backend} {name}: {}", stderr(&out));
            let session = expected["context"]["session_id"].as_str().unwrap();
            for command in ["context", "activations"] {
                let out = run(&db.url, &[command, session, "--json"], None);
                assert!(
                    out.status.success(),
                    "{backend} {name} {command}: {}",
                    stderr(&out)
                );
                let got: Value = serde_json::from_str(&stdout(&out)).unwrap();
                assert_eq!(
                    strip_envelope(got),
                    expected[command],
                    "{backend} {name} {command}"
                );
            }
            // Re-importing stores nothing twice.
            let out = run(&db.url, &["import", &log], None);
            assert!(out.status.success(), "{}", stderr(&out));
            assert!(
                stdout(&out).starts_with("imported 0 events"),
                "{}",
                stdout(&out)
            );
        }
    }
}

const S: &str = "11111111-2222-4333-8444-555555555555";

fn base_log() -> String {
    [
        r#"{"type":"session_started","mode":"agent"}"#,
        r#"{"type":"catalog_defined","mode":"agent","deferred_tools":["web_fetch"]}"#,
        r#"{"type":"prompt_submitted","text":"one"}"#,
        r#"{"event_id":"aaaaaaaa-0000-4000-8000-000000000001","type":"tool_call","call_id":"c1","tool_name":"ToolSearch","input":null}"#,
        r#"{"event_id":"aaaaaaaa-0000-4000-8000-000000000002","type":"tool_result","call_id":"c1","tool_name":"ToolSearch","status":"success","added_tool_names":["web_fetch"]}"#,
        r#"{"event_id":"aaaaaaaa-0000-4000-8000-000000000003","type":"prompt_submitted","text":"two"}"#,
        r#"{"type":"tool_call","call_id":"c2","tool_name":"Read","input":{}}"#,
    ]
    .iter()
    .map(|l| with_session(l))
    .collect::<Vec<_>>()
    .join("\n")
}

fn with_session(line: &str) -> String {
    format!(r#"{{"session_id":"{S}",{}"#, &line[1..])
}

#[test]
fn bad_input_is_rejected_with_a_clear_error_and_changes_nothing() {
    // (what, line, text the message must contain)
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "malformed JSON",
            format!(r#"{{"session_id":"{S}","type":"#),
            "malformed JSON",
        ),
        ("not an object", "[1,2]".into(), "must be a JSON object"),
        (
            "wrong UUID",
            r#"{"session_id":"not-a-uuid","type":"prompt_submitted","text":"x"}"#.into(),
            "bad-uuid",
        ),
        (
            "wrong event UUID",
            with_session(r#"{"event_id":"123","type":"prompt_submitted","text":"x"}"#),
            "bad-uuid",
        ),
        (
            "unknown type",
            with_session(r#"{"type":"prompt_deleted","text":"x"}"#),
            "unknown-type",
        ),
        (
            "missing field",
            with_session(r#"{"type":"tool_call","call_id":"c9","tool_name":"x"}"#),
            "missing field `input`",
        ),
        (
            "mistyped field",
            with_session(r#"{"type":"prompt_submitted","text":5}"#),
            "mistyped-field",
        ),
        (
            "unknown field",
            with_session(r#"{"type":"prompt_submitted","text":"x","extra":1}"#),
            "unknown-field",
        ),
        (
            "seq given",
            with_session(r#"{"type":"prompt_submitted","text":"x","seq":8}"#),
            "assigned by the store",
        ),
        (
            "second session_started",
            with_session(r#"{"type":"session_started","mode":"agent"}"#),
            "second-session-started",
        ),
        (
            "duplicate call id",
            with_session(r#"{"type":"tool_call","call_id":"c1","tool_name":"x","input":1}"#),
            "duplicate-call-id",
        ),
        (
            "result without call",
            with_session(
                r#"{"type":"tool_result","call_id":"zz","tool_name":"x","status":"success"}"#,
            ),
            "result-without-call",
        ),
        (
            "second result",
            with_session(
                r#"{"type":"tool_result","call_id":"c1","tool_name":"ToolSearch","status":"success"}"#,
            ),
            "second-result-for-call",
        ),
        (
            "tool name differs",
            with_session(
                r#"{"type":"tool_result","call_id":"c2","tool_name":"Write","status":"success"}"#,
            ),
            "result-tool-name-mismatch",
        ),
        (
            "added names on error",
            with_session(
                r#"{"type":"tool_result","call_id":"c2","tool_name":"Read","status":"error","added_tool_names":["web_fetch"]}"#,
            ),
            "added-tool-names-without-success",
        ),
        (
            "bad status",
            with_session(
                r#"{"type":"tool_result","call_id":"c2","tool_name":"Read","status":"ok"}"#,
            ),
            "mistyped-field",
        ),
        (
            "control char in tool name",
            with_session(
                r#"{"type":"catalog_defined","mode":"agent","deferred_tools":["a\u0007b"]}"#,
            ),
            "bad-tool-name",
        ),
        (
            "empty call id",
            with_session(r#"{"type":"tool_call","call_id":"","tool_name":"Read","input":null}"#),
            "empty-field",
        ),
        (
            "compaction keeps unknown row",
            with_session(
                r#"{"type":"compaction","summary":"s","first_kept_event_id":"aaaaaaaa-0000-4000-8000-0000000000ff"}"#,
            ),
            "compaction-keeps-non-effective-row",
        ),
        (
            "compaction keeps a result",
            with_session(
                r#"{"type":"compaction","summary":"s","first_kept_event_id":"aaaaaaaa-0000-4000-8000-000000000002"}"#,
            ),
            "compaction-splits-call-from-result",
        ),
        (
            "reused event id",
            with_session(
                r#"{"event_id":"aaaaaaaa-0000-4000-8000-000000000003","type":"prompt_submitted","text":"changed"}"#,
            ),
            "event-id-reused-with-other-content",
        ),
        (
            "oversized event",
            with_session(&format!(
                r#"{{"type":"prompt_submitted","text":"{}"}}"#,
                "x".repeat(1024 * 1024 + 1)
            )),
            "event-too-large",
        ),
    ];
    for (backend, db) in backends() {
        let out = run(&db.url, &["import"], Some(&base_log()));
        assert!(out.status.success(), "{}", stderr(&out));
        let before = stdout(&run(&db.url, &["history", S, "--json"], None));
        assert_eq!(before.lines().count(), 7);
        for (what, line, needle) in &cases {
            let input = format!("\n{line}\n");
            let out = run(&db.url, &["import"], Some(&input));
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(1), "{backend} {what}: {err}");
            assert!(err.contains("line 2"), "{backend} {what}: {err}");
            assert!(err.contains(needle), "{backend} {what}: {err}");
            assert_eq!(
                err.trim().lines().count(),
                1,
                "{backend} {what}: one sentence: {err}"
            );
            let after = stdout(&run(&db.url, &["history", S, "--json"], None));
            assert_eq!(before, after, "{backend} {what}: the store changed");
        }
        // An event before session_started, in a new session.
        let line = r#"{"session_id":"99999999-2222-4333-8444-555555555555","type":"prompt_submitted","text":"x"}"#;
        let out = run(&db.url, &["import"], Some(line));
        assert_eq!(out.status.code(), Some(1));
        assert!(
            stderr(&out).contains("event-before-session-started"),
            "{}",
            stderr(&out)
        );
    }
}

#[test]
fn import_stops_at_the_bad_line_keeping_the_lines_before_it() {
    for (backend, db) in backends() {
        let good = base_log();
        let bad = with_session(
            r#"{"type":"tool_result","call_id":"nope","tool_name":"x","status":"error"}"#,
        );
        let tail = with_session(r#"{"type":"prompt_submitted","text":"never"}"#);
        let input = format!("{good}\n\n{bad}\n{tail}\n");
        let out = run(&db.url, &["import"], Some(&input));
        assert_eq!(out.status.code(), Some(1), "{backend}");
        assert!(
            stderr(&out).contains("line 9"),
            "{backend}: {}",
            stderr(&out)
        );
        let history = stdout(&run(&db.url, &["history", S, "--json"], None));
        assert_eq!(history.lines().count(), 7, "{backend}");
        // Re-running the fixed import stores nothing twice for lines with
        // event ids, and the rest is appended after them.
        let with_ids: Vec<&str> = good.lines().filter(|l| l.contains("event_id")).collect();
        let fixed = format!("{}\n{tail}\n", with_ids.join("\n"));
        let out = run(&db.url, &["import"], Some(&fixed));
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert!(
            stdout(&out).contains("imported 1 event into"),
            "{backend}: {}",
            stdout(&out)
        );
        let history = stdout(&run(&db.url, &["history", S, "--json"], None));
        assert_eq!(history.lines().count(), 8, "{backend}");
        let ids: Vec<String> = history
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["event_id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        for id in [
            "aaaaaaaa-0000-4000-8000-000000000001",
            "aaaaaaaa-0000-4000-8000-000000000003",
        ] {
            assert_eq!(
                ids.iter().filter(|i| *i == id).count(),
                1,
                "{backend}: {id}"
            );
        }
    }
}

#[test]
fn append_prints_seqs_and_a_conflict_exits_3() {
    for (backend, db) in backends() {
        let lines = base_log()
            .lines()
            .take(3)
            .map(|l| l.replace(&format!(r#""session_id":"{S}","#), ""))
            .collect::<Vec<_>>()
            .join("\n");
        let out = run(&db.url, &["append", S, "--expected-seq", "0"], Some(&lines));
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        let seqs: Vec<i64> = stdout(&out)
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["seq"]
                    .as_i64()
                    .unwrap()
            })
            .collect();
        assert_eq!(seqs, vec![1, 2, 3], "{backend}");
        let out = run(
            &db.url,
            &["append", S, "--expected-seq", "1"],
            Some(r#"{"type":"prompt_submitted","text":"late"}"#),
        );
        assert_eq!(out.status.code(), Some(3), "{backend}");
        assert!(
            stderr(&out).contains("at seq 3"),
            "{backend}: {}",
            stderr(&out)
        );
        // A line naming a session, even the one appended to, or a time is
        // refused (§3: only import lines carry them), and the batch with it.
        let other = r#"{"session_id":"99999999-2222-4333-8444-555555555555","type":"prompt_submitted","text":"x"}"#;
        let own = format!(r#"{{"session_id":"{S}","type":"prompt_submitted","text":"x"}}"#);
        let timed = r#"{"type":"prompt_submitted","text":"x","recorded_at":null}"#;
        for line in [other, &own, timed] {
            let out = run(&db.url, &["append", S, "--expected-seq", "3"], Some(line));
            assert_eq!(out.status.code(), Some(1), "{backend}: {line}");
            assert!(
                stderr(&out).contains("only accepted by import"),
                "{backend}: {}",
                stderr(&out)
            );
        }
        // §2: a stale expected seq is judged before the events, so a stale
        // writer with an unreadable line hears of the conflict first.
        for bad in [
            "not json",
            r#"{"type":"tool_call","call_id":"c","tool_name":"t"}"#,
        ] {
            let out = run(&db.url, &["append", S, "--expected-seq", "1"], Some(bad));
            assert_eq!(out.status.code(), Some(3), "{backend}: {}", stderr(&out));
            let out = run(&db.url, &["append", S, "--expected-seq", "3"], Some(bad));
            assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
        }
        // A line that is not UTF-8 too.
        for (expected, code) in [("1", 3), ("3", 1)] {
            let mut child = spawn(&db.url, &["append", S, "--expected-seq", expected]);
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b"\xff\xfe\n")
                .unwrap();
            let out = child.wait_with_output().unwrap();
            assert_eq!(out.status.code(), Some(code), "{backend}: {}", stderr(&out));
        }
        // An invalid second line rejects the whole batch and names line 2.
        let batch = "{\"type\":\"prompt_submitted\",\"text\":\"ok\"}\n{\"type\":\"tool_result\",\"call_id\":\"x\",\"tool_name\":\"y\",\"status\":\"success\"}";
        let out = run(&db.url, &["append", S, "--expected-seq", "3"], Some(batch));
        assert_eq!(out.status.code(), Some(1), "{backend}");
        assert!(
            stderr(&out).contains("line 2"),
            "{backend}: {}",
            stderr(&out)
        );
        let history = stdout(&run(&db.url, &["history", S, "--json"], None));
        assert_eq!(history.lines().count(), 3, "{backend}");
        // §2 judges the events one by one: an earlier line's error answers
        // before a later line that cannot be read as an event (unknown
        // field, not JSON); with the earlier lines valid, the later one's.
        let result = r#"{"type":"tool_result","call_id":"x","tool_name":"y","status":"success"}"#;
        let prompt = r#"{"type":"prompt_submitted","text":"ok"}"#;
        for (unreadable, its_rule) in [
            (
                r#"{"type":"prompt_submitted","text":"x","bogus":1}"#,
                "unknown-field",
            ),
            ("not json", "malformed-json"),
            (r#"{"type":"prompt_submitted"}"#, "missing-field"),
        ] {
            for (first, second, line, rule) in [
                (prompt, result, "line 2", "result-without-call"),
                (result, prompt, "line 1", "result-without-call"),
                (prompt, prompt, "line 3", its_rule),
            ] {
                let batch = format!("{first}\n{second}\n{unreadable}\n{prompt}");
                let out = run(&db.url, &["append", S, "--expected-seq", "3"], Some(&batch));
                assert_eq!(out.status.code(), Some(1), "{backend}: {batch}");
                let said = stderr(&out);
                assert!(
                    said.starts_with(&format!("session-store: {line}: ")) && said.contains(rule),
                    "{backend}: {batch}: {said}"
                );
                // A stale expected seq still answers first.
                let out = run(&db.url, &["append", S, "--expected-seq", "2"], Some(&batch));
                assert_eq!(out.status.code(), Some(3), "{backend}: {}", stderr(&out));
            }
        }
        let history = stdout(&run(&db.url, &["history", S, "--json"], None));
        assert_eq!(history.lines().count(), 3, "{backend}");
        // A batch over --max-batch-events is refused whole at the first
        // line past it, after the expected seq; at the bound, it is stored.
        let prompts = |n: usize| -> String {
            (0..n)
                .map(|i| format!("{{\"type\":\"prompt_submitted\",\"text\":\"p{i}\"}}\n"))
                .collect()
        };
        let capped = |expected: &'static str| {
            vec![
                "append",
                S,
                "--expected-seq",
                expected,
                "--max-batch-events",
                "3",
            ]
        };
        let out = run(&db.url, &capped("1"), Some(&prompts(4)));
        assert_eq!(out.status.code(), Some(3), "{backend}: {}", stderr(&out));
        let out = run(&db.url, &capped("3"), Some(&prompts(4)));
        assert_eq!(out.status.code(), Some(1), "{backend}");
        assert!(
            stderr(&out).contains(
                "line 4: the batch holds more than 3 events (--max-batch-events): one append is one transaction"
            ),
            "{backend}: {}",
            stderr(&out)
        );
        // The bound holds whether the line past it is readable or not.
        let out = run(
            &db.url,
            &capped("3"),
            Some(&format!("{}not json\n", prompts(3))),
        );
        assert!(
            stderr(&out).contains("line 4: the batch holds more than 3 events"),
            "{backend}: {}",
            stderr(&out)
        );
        // So does --max-batch-bytes, counted in bytes of lines: the line
        // that crosses it is named.
        let three = prompts(3);
        let two_lines = three
            .lines()
            .take(2)
            .map(str::len)
            .sum::<usize>()
            .to_string();
        let out = run(
            &db.url,
            &[
                "append",
                S,
                "--expected-seq",
                "3",
                "--max-batch-bytes",
                &two_lines,
            ],
            Some(&three),
        );
        assert_eq!(out.status.code(), Some(1), "{backend}");
        assert!(
            stderr(&out).contains(&format!(
                "line 3: the batch holds more than {two_lines} bytes of lines (--max-batch-bytes)"
            )),
            "{backend}: {}",
            stderr(&out)
        );
        let history = stdout(&run(&db.url, &["history", S, "--json"], None));
        assert_eq!(history.lines().count(), 3, "{backend}: nothing stored");
        let all_lines = three.lines().map(str::len).sum::<usize>().to_string();
        let mut at_the_bounds = capped("3");
        at_the_bounds.extend(["--max-batch-bytes", &all_lines]);
        let out = run(&db.url, &at_the_bounds, Some(&three));
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert_eq!(stdout(&out).lines().count(), 3, "{backend}");
    }
}

#[test]
fn not_found_out_of_range_and_usage_have_their_exit_codes() {
    for (backend, db) in backends() {
        assert!(run(&db.url, &["migrate"], None).status.success());
        let out = run(&db.url, &["activations", S, "--json"], None);
        assert_eq!(out.status.code(), Some(1), "{backend}");
        assert!(stderr(&out).contains("not found"), "{}", stderr(&out));
        run(&db.url, &["import"], Some(&base_log()));
        // Any whole number that is not a seq of the session is exit 1
        // (§9), negative or past i64 too; a word is a usage error.
        for at in [
            "8",
            "0",
            "-1",
            "99999999999999999999",
            "-99999999999999999999",
        ] {
            for cmd in ["context", "activations", "explain"] {
                let mut args = vec![cmd, S];
                if cmd == "explain" {
                    args.push("Read");
                }
                args.extend(["--at-seq", at, "--json"]);
                let out = run(&db.url, &args, None);
                assert_eq!(
                    out.status.code(),
                    Some(1),
                    "{backend} {cmd} {at}: {}",
                    stderr(&out)
                );
                // The number as typed, not the i64 it was read as.
                assert!(
                    stderr(&out).contains(&format!("seq {at} is out of range")),
                    "{backend} {cmd}: {}",
                    stderr(&out)
                );
            }
        }
        let out = run(&db.url, &["activations", S, "--at-seq", "five"], None);
        assert_eq!(out.status.code(), Some(2), "{backend}");
        let out = run(&db.url, &["context", S, "--at-seq", "5", "--json"], None);
        let v: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(v["as_of_seq"], 5);
        assert_eq!(v["rows"].as_array().unwrap().len(), 3);
        let out = run(&db.url, &["activations", "not-a-uuid"], None);
        assert_eq!(out.status.code(), Some(1), "{backend}");
        let out = run(&db.url, &["frobnicate"], None);
        assert_eq!(out.status.code(), Some(2), "{backend}");
        let out = run(&db.url, &["context"], None);
        assert_eq!(out.status.code(), Some(2), "{backend}");
        // Values a flag cannot take are usage errors, not a conflict or a
        // limit that refuses every event.
        let out = run(&db.url, &["append", S, "--expected-seq=-1"], Some(""));
        assert_eq!(out.status.code(), Some(2), "{backend}: {}", stderr(&out));
        let out = run(&db.url, &["--max-event-bytes", "0", "history", S], None);
        assert_eq!(out.status.code(), Some(2), "{backend}: {}", stderr(&out));
        assert!(stderr(&out).contains("at least 1"), "{}", stderr(&out));
        // The readable tables.
        let out = run(&db.url, &["activations", S], None);
        assert!(stdout(&out).contains("web_fetch  5"), "{}", stdout(&out));
        let out = run(&db.url, &["context", S], None);
        assert!(
            stdout(&out).contains("ToolSearch (call c1) success, added [web_fetch]"),
            "{}",
            stdout(&out)
        );
    }
}

#[test]
fn unreachable_storage_exits_4_within_seconds() {
    let port = common::free_port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/none");
    let started = Instant::now();
    let out = run(&url, &["activations", S], None);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(started.elapsed() < Duration::from_secs(10));
    // The cause, not only the pool's timeout: where, and what happened.
    assert!(
        stderr(&out).contains("storage unavailable")
            && stderr(&out).contains(&format!("127.0.0.1:{port}"))
            && stderr(&out).to_lowercase().contains("refused"),
        "{}",
        stderr(&out)
    );
    // A file in a directory that does not exist: the caller's mistake
    // (exit 1, naming the directory) for a command that writes, no store
    // there for one that reads.
    let out = run(
        "/nonexistent-dir/x/store.db",
        &["import"],
        Some(&base_log()),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the directory /nonexistent-dir/x does not exist"),
        "{}",
        stderr(&out)
    );
    let out = run("/nonexistent-dir/x/store.db", &["activations", S], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("there is no session store at"),
        "{}",
        stderr(&out)
    );
}

use common::raw_sql as tamper;

#[test]
fn recover_verify_and_rebuild_through_the_binary() {
    for (backend, db) in backends() {
        let log = format!("{EXAMPLES}/compaction_drops_evidence.jsonl");
        assert!(run(&db.url, &["import", &log], None).status.success());
        let log = format!("{EXAMPLES}/mode_switch_and_back.jsonl");
        assert!(run(&db.url, &["import", &log], None).status.success());
        let session = "e05e0748-e772-568b-8c6d-d1e2feee48b2";
        let out = run(&db.url, &["recover", session, "--json"], None);
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        let r: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(r["latest_seq"], 10);
        assert_eq!(r["mode"], "agent");
        assert_eq!(r["context_start_seq"], 1);
        assert_eq!(r["summary"], Value::Null);
        assert_eq!(
            r["tools"],
            serde_json::json!([{"name": "notebook_edit", "evidence_seq": 7}, {"name": "web_fetch", "evidence_seq": 7}])
        );
        assert_eq!(r["catalog"].as_array().unwrap().len(), 4);
        let c = run(
            &db.url,
            &["recover", "94513509-d834-5173-bbea-1516f5f4b7a3", "--json"],
            None,
        );
        let c: Value = serde_json::from_str(&stdout(&c)).unwrap();
        assert_eq!(c["context_start_seq"], 7);
        assert_eq!(c["summary"], "user searched for web_fetch earlier");
        assert_eq!(c["tools"], serde_json::json!([]));

        let out = run(&db.url, &["verify"], None);
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert!(
            stdout(&out).contains("2 sessions agree"),
            "{}",
            stdout(&out)
        );

        // Drift: the view says another mode. verify names it and exits 5.
        tamper(&db.url, "UPDATE session_views SET mode = 'chat'");
        let out = run(&db.url, &["verify", session], None);
        assert_eq!(out.status.code(), Some(5), "{backend}");
        assert!(
            stderr(&out).contains("`mode` is \"chat\"")
                && stderr(&out).contains("`session-store rebuild` recomputes the views"),
            "{backend}: {}",
            stderr(&out)
        );
        // rebuild repairs it.
        let out = run(&db.url, &["rebuild"], None);
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert!(
            stdout(&out).starts_with("rebuilt the views of 2 sessions"),
            "{}",
            stdout(&out)
        );
        assert!(
            run(&db.url, &["verify"], None).status.success(),
            "{backend}"
        );
        // A changed compaction is said in JSON, not in Rust's notation.
        tamper(
            &db.url,
            "UPDATE session_views SET summary = NULL, compaction_seq = NULL",
        );
        let compacted = "94513509-d834-5173-bbea-1516f5f4b7a3";
        let out = run(&db.url, &["verify", compacted], None);
        assert_eq!(out.status.code(), Some(5), "{backend}");
        let err = stderr(&out);
        assert!(
            err.contains("`compaction` is null in the view but {\"seq\":")
                && !err.contains("Some(")
                && !err.contains("None"),
            "{backend}: {err}"
        );
        // A view whose JSON cannot be read is drift too: exit 5, not a
        // failure of the store, and the message says how to repair it.
        tamper(&db.url, "UPDATE session_views SET catalogs = 'not json'");
        let out = run(&db.url, &["verify", session], None);
        assert_eq!(out.status.code(), Some(5), "{backend}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("unreadable catalogs")
                && stderr(&out).contains("session-store rebuild"),
            "{backend}: {}",
            stderr(&out)
        );
        assert!(run(&db.url, &["rebuild"], None).status.success());
        // A broken calls index is drift too.
        tamper(&db.url, "UPDATE calls SET result_seq = NULL");
        let out = run(&db.url, &["verify"], None);
        assert_eq!(out.status.code(), Some(5), "{backend}");
        let err = stderr(&out);
        assert!(
            err.contains("calls index")
                && err.contains("\"result_seq\":")
                && !err.contains("Some("),
            "{backend}: {err}"
        );
        assert!(run(&db.url, &["rebuild", session], None).status.success());
        assert!(run(
            &db.url,
            &["rebuild", "94513509-d834-5173-bbea-1516f5f4b7a3"],
            None
        )
        .status
        .success());
        assert!(
            run(&db.url, &["verify"], None).status.success(),
            "{backend}"
        );
        let out = run(&db.url, &["recover", S, "--json"], None);
        assert_eq!(out.status.code(), Some(1), "{backend}: unknown session");
    }
}

#[test]
fn tail_prints_the_global_feed_and_follows_it() {
    use std::io::BufRead;
    for (backend, db) in backends() {
        for name in ["search_activates", "mode_switch_and_back"] {
            let log = format!("{EXAMPLES}/{name}.jsonl");
            assert!(run(&db.url, &["import", &log], None).status.success());
        }
        let out = run(&db.url, &["tail", "--json"], None);
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        let positions: Vec<i64> = stdout(&out)
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["position"]
                    .as_i64()
                    .unwrap()
            })
            .collect();
        assert_eq!(positions.len(), 17, "{backend}");
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]),
            "{backend}: {positions:?}"
        );
        let from = positions[10].to_string();
        let out = run(&db.url, &["tail", "--json", "--from-position", &from], None);
        assert_eq!(stdout(&out).lines().count(), 7, "{backend}");

        let mut follower = Command::new(BIN)
            .args([
                "--database",
                &db.url,
                "tail",
                "--json",
                "--follow",
                "--from-position",
            ])
            .arg((positions[16] + 1).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let reader = std::io::BufReader::new(follower.stdout.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in reader.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let out = run(
            &db.url,
            &[
                "append",
                "f8107687-15cd-5875-8d51-79a78ed3a5d0",
                "--expected-seq",
                "7",
            ],
            Some(r#"{"type":"assistant_message","text":"followed"}"#),
        );
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("tail --follow saw the append");
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["text"], "followed", "{backend}");
        assert_eq!(v["seq"], 8);
        follower.kill().unwrap();
        let _ = follower.wait();
    }
}

/// `serve` listens before it opens the store: one that cannot listen (the
/// port taken) exits saying so, without having created a store at a new
/// path (nor, by the same order, upgraded an old one).
#[test]
fn serve_that_cannot_listen_leaves_the_store_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.db");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = run(
        &path.display().to_string(),
        &["serve", "--listen", &addr],
        None,
    );
    assert_ne!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("cannot listen on {addr}")),
        "{}",
        stderr(&out)
    );
    assert!(!path.exists(), "a store was created at {}", path.display());
}

#[test]
fn an_unknown_url_scheme_is_a_usage_error() {
    let out = run("mysql://127.0.0.1/db", &["activations", S], None);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("unsupported database URL"),
        "{}",
        stderr(&out)
    );
}

/// `history --after-seq` below 0 is a usage error (exit 2), as a negative
/// `after_seq` is refused over HTTP (422), not a page from the start.
#[test]
fn history_refuses_a_negative_after_seq() {
    let db = common::sqlite_db();
    let started = r#"{"type":"session_started","mode":"agent"}"#;
    let out = run(
        &db.url,
        &["append", "--expected-seq", "0", S],
        Some(started),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run(&db.url, &["history", S, "--after-seq=-1"], None);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--after-seq"), "{}", stderr(&out));
    // Written with a space, the value is still judged as a value (not
    // taken for a flag, with clap's advice to write `-- -1`).
    for args in [
        vec!["history", S, "--after-seq", "-1"],
        vec!["history", S, "--limit", "-1"],
        vec!["audit", "events", "--limit", "-1"],
        vec!["append", S, "--expected-seq", "-1"],
    ] {
        let out = run(&db.url, &args, Some(started));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("invalid value '-1'") && !stderr(&out).contains("-- -1"),
            "{args:?}: {}",
            stderr(&out)
        );
        // Said as the bound it breaks, not as clap's range up to i64::MAX.
        let said = if args[0] == "audit" {
            "1..=1000"
        } else {
            "-1 is below"
        };
        assert!(stderr(&out).contains(said), "{args:?}: {}", stderr(&out));
        assert!(
            !stderr(&out).contains("9223372036854775807"),
            "{}",
            stderr(&out)
        );
    }
    let out = run(
        &db.url,
        &["history", S, "--limit", "99999999999999999999"],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("is out of range"), "{}", stderr(&out));
    let out = run(&db.url, &["history", S, "--limit", "ten"], None);
    assert!(
        stderr(&out).contains("\"ten\" is not a whole number"),
        "{}",
        stderr(&out)
    );
    let out = run(&db.url, &["history", S, "--after-seq=0", "--json"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().count(), 1);
    // So does `tail --from-position`, which takes 0 (the beginning) too.
    let out = run(&db.url, &["tail", "--from-position", "-5"], None);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--from-position"), "{}", stderr(&out));
    let out = run(&db.url, &["tail", "--from-position", "0", "--json"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().count(), 1);
}

/// An append whose answer cannot be written (a full disk behind standard
/// output) was stored all the same: the error says so, with the seqs and
/// where to read them, so that exit 1 is not taken for "nothing stored".
#[test]
fn an_append_whose_answer_cannot_be_written_says_it_was_stored() {
    let db = common::sqlite_db();
    let started = r#"{"type":"session_started","mode":"agent"}"#;
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let mut child = Command::new(BIN)
        .arg("--database")
        .arg(&db.url)
        .args(["append", "--expected-seq", "0", S])
        .env_remove("DATABASE_URL")
        .stdin(Stdio::piped())
        .stdout(full)
        .stderr(Stdio::piped())
        .spawn()
        .expect("run session-store");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(started.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let said = stderr(&out);
    assert!(
        said.contains("the batch was stored at seqs 1-1")
            && said.contains(&format!("history {S} --after-seq 0"))
            && said.contains("No space left on device"),
        "{said}"
    );
    let out = run(&db.url, &["history", S, "--json"], None);
    assert_eq!(stdout(&out).lines().count(), 1, "stored once");
}

/// A SQLite database in memory would acknowledge appends that end with
/// the process: every spelling of one is refused before anything is
/// acknowledged (exit 2), and no file is left behind.
#[test]
fn an_in_memory_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let on_disk = dir.path().join("m.db");
    for url in [
        ":memory:".to_owned(),
        "sqlite::memory:".to_owned(),
        "sqlite://:memory:?cache=shared".to_owned(),
        "file::memory:".to_owned(),
        format!("file:{}?mode=memory", on_disk.display()),
        format!("{}?mode=memory&cache=shared", on_disk.display()),
    ] {
        let started = r#"{"type":"session_started","mode":"agent"}"#;
        let out = run(&url, &["append", "--expected-seq", "0", S], Some(started));
        assert_eq!(out.status.code(), Some(2), "{url}: {}", stderr(&out));
        assert!(out.stdout.is_empty(), "{url}: acknowledged");
        assert!(
            stderr(&out).contains("unsupported database URL"),
            "{url}: {}",
            stderr(&out)
        );
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn import_treats_a_repeated_line_as_its_own_append() {
    for (backend, db) in backends() {
        let lines: Vec<String> = base_log().lines().map(str::to_owned).collect();
        // Line 5 (a result with an event id) repeated right after itself: an
        // idempotent retry, not a duplicate in one batch.
        let mut input = lines[..5].to_vec();
        input.push(lines[4].clone());
        input.extend(lines[5..].iter().cloned());
        let out = run(&db.url, &["import"], Some(&input.join("\n")));
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert!(
            stdout(&out).contains("(1 already stored)"),
            "{backend}: {}",
            stdout(&out)
        );
        let history = stdout(&run(&db.url, &["history", S, "--json"], None));
        assert_eq!(history.lines().count(), 7, "{backend}");
        // The same id with other content is refused, naming its line.
        let changed = lines[4]
            .replace("\"success\"", "\"error\"")
            .replace(",\"added_tool_names\":[\"web_fetch\"]", "");
        let out = run(
            &db.url,
            &["import"],
            Some(&format!("{}\n{changed}", lines[5])),
        );
        assert_eq!(out.status.code(), Some(1), "{backend}");
        assert!(
            stderr(&out).contains("line 2"),
            "{backend}: {}",
            stderr(&out)
        );
        assert!(
            stderr(&out).contains("event-id-reused-with-other-content"),
            "{}",
            stderr(&out)
        );
    }
}

#[test]
fn import_keeps_the_lines_before_an_unreadable_or_oversized_line() {
    let db = common::sqlite_db();
    // Line 9 is not UTF-8: the seven lines before it are stored.
    let mut input = format!("{}\n\n", base_log()).into_bytes();
    input.extend_from_slice(b"{\"type\":\"prompt_submitted\",\"text\":\"\xff\"}\n");
    input.extend_from_slice(
        with_session(r#"{"type":"prompt_submitted","text":"never"}"#).as_bytes(),
    );
    let mut child = spawn(&db.url, &["import"]);
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("line 9") && err.contains("not UTF-8"), "{err}");
    let history = stdout(&run(&db.url, &["history", S, "--json"], None));
    assert_eq!(history.lines().count(), 7);
    // A line over the event limit is refused without being held whole, the
    // lines before it kept.
    let long = with_session(&format!(
        r#"{{"type":"prompt_submitted","text":"{}"}}"#,
        "x".repeat(5_000)
    ));
    let input = format!(
        "{}\n{long}\n",
        with_session(r#"{"type":"prompt_submitted","text":"three"}"#)
    );
    let out = run(
        &db.url,
        &["--max-event-bytes", "1000", "import"],
        Some(&input),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("line 2") && err.contains("over the limit of 1000"),
        "{err}"
    );
    let history = stdout(&run(&db.url, &["history", S, "--json"], None));
    assert_eq!(history.lines().count(), 8);
}

#[test]
fn import_holds_batches_of_a_few_megabytes_not_500_large_lines() {
    // Twelve lines of about 900 KB after the base log's seven: a batch
    // ends before its lines pass 8 MiB (an import of 100 MB of such lines
    // held 880 MB), here after the ninth large line, between a call and
    // its result; every event is stored and the result still answers the
    // call in the other batch.
    let db = common::sqlite_db();
    let text = "y".repeat(900_000);
    let mut lines = vec![base_log()];
    for i in 1..=12 {
        lines.push(with_session(&match i {
            9 => format!(
                r#"{{"type":"tool_call","call_id":"c3","tool_name":"web_fetch","input":"{text}"}}"#
            ),
            10 => format!(
                r#"{{"type":"tool_result","call_id":"c3","tool_name":"web_fetch","status":"success","output":"{text}"}}"#
            ),
            _ => format!(r#"{{"type":"assistant_message","text":"{text}"}}"#),
        }));
    }
    let mut child = Command::new(BIN)
        .args(["--database", &db.url, "import"])
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "session_store::cli=debug")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(lines.join("\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "imported 19 events into 1 session (0 already stored)\n"
    );
    let batches: Vec<String> = stderr(&out)
        .lines()
        .filter(|l| l.contains("import: appending a batch"))
        .map(|l| l.split("lines=").nth(1).unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        batches,
        ["16 first_line=1", "3 first_line=17"],
        "{}",
        stderr(&out)
    );
    let history = stdout(&run(&db.url, &["history", S, "--json"], None));
    assert_eq!(history.lines().count(), 19);
    let calls = stdout(&run(&db.url, &["activations", S, "--json"], None));
    assert!(calls.contains("web_fetch"), "{calls}");
}

#[test]
fn import_stores_a_producers_lines_as_they_come() {
    // A producer that has written 600 lines and is still running: the
    // first run (500 lines) is stored as it is full, and the other 100
    // once the input pauses (`IMPORT_IDLE`), before the input ends; then
    // so is a single line written later.
    let db = common::sqlite_db();
    let mut child = spawn(&db.url, &["import"]);
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = vec![with_session(r#"{"type":"session_started","mode":"agent"}"#)];
    for i in 1..600 {
        lines.push(with_session(&format!(
            r#"{{"type":"prompt_submitted","text":"p{i}"}}"#
        )));
    }
    stdin
        .write_all(format!("{}\n", lines.join("\n")).as_bytes())
        .unwrap();
    stdin.flush().unwrap();
    let stored_within = |want: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = run(&db.url, &["history", S, "--json"], None);
            let n = stdout(&out).lines().count();
            if n >= want || Instant::now() > deadline {
                break n;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let stored = stored_within(600);
    assert_eq!(stored, 600, "lines stored while the input was open");
    stdin
        .write_all(
            format!(
                "{}\n",
                with_session(r#"{"type":"prompt_submitted","text":"late"}"#)
            )
            .as_bytes(),
        )
        .unwrap();
    stdin.flush().unwrap();
    assert_eq!(
        stored_within(601),
        601,
        "a late line stored while the input was open"
    );
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "imported 601 events into 1 session (0 already stored)\n"
    );
    let history = stdout(&run(&db.url, &["history", S, "--json"], None));
    assert_eq!(history.lines().count(), 601);
}

/// An import stopped by SIGINT or SIGTERM lets its append in flight end,
/// then says which lines are stored and where a re-run resumes (exit 128
/// plus the signal's number, as a shell says a killed process); the lines
/// it names as the rest complete the import, even without event ids.
#[test]
fn an_interrupted_import_says_where_a_re_run_resumes() {
    let db = common::sqlite_db();
    let lines: Vec<String> =
        std::iter::once(with_session(r#"{"type":"session_started","mode":"agent"}"#))
            .chain(
                (2..=1500).map(|i| {
                    with_session(&format!(r#"{{"type":"prompt_submitted","text":"p{i}"}}"#))
                }),
            )
            .collect();
    let stored = || {
        let out = run(&db.url, &["history", S, "--json"], None);
        stdout(&out).lines().count()
    };
    let stored_within = |want: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let n = stored();
            if n >= want || Instant::now() > deadline {
                break n;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let signal = |child: &std::process::Child, name: &str| {
        let sent = Command::new("kill")
            .args([format!("-{name}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    };
    // The input open, all of it stored: the import waits for more.
    let mut child = spawn(&db.url, &["import"]);
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(format!("{}\n", lines[..600].join("\n")).as_bytes())
        .unwrap();
    stdin.flush().unwrap();
    assert_eq!(stored_within(600), 600);
    signal(&child, "INT");
    let out = child.wait_with_output().unwrap();
    drop(stdin);
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        "session-store: interrupted by SIGINT: lines 1–600 of the input are stored (600 events), \
         none after; the lines from 601 on (`tail -n +601 FILE`) complete the import \
         (the whole input run again does too, where each line has an event_id)\n"
    );
    // Stopped while lines are held, or between runs: the line it names is
    // the last one stored, whichever it was.
    let rest = &lines[600..];
    let mut child = spawn(&db.url, &["import"]);
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(format!("{}\n", rest.join("\n")).as_bytes())
        .unwrap();
    stdin.flush().unwrap();
    stored_within(1100);
    signal(&child, "TERM");
    let out = child.wait_with_output().unwrap();
    drop(stdin);
    assert_eq!(out.status.code(), Some(143), "{}", stderr(&out));
    let said = stderr(&out);
    let through: usize = said
        .split("lines 1–")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no line named: {said}"));
    assert!((500..=900).contains(&through), "{said}");
    assert_eq!(stored(), 600 + through, "{said}");
    assert!(
        said.contains(&format!("`tail -n +{} FILE`", through + 1)),
        "{said}"
    );
    // The rest, as the message says.
    let out = run(&db.url, &["import"], Some(&rest[through..].join("\n")));
    assert!(out.status.success(), "{}", stderr(&out));
    let history = stdout(&run(&db.url, &["history", S, "--json"], None));
    let texts: Vec<String> = history
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["text"].to_string())
        .collect();
    let want: Vec<String> = (2..=1500).map(|i| format!("\"p{i}\"")).collect();
    let first_off = texts.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(
        (texts.len(), first_off),
        (want.len(), None),
        "every line once, in order"
    );
}

#[test]
fn a_path_that_holds_no_session_store_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).display().to_string();
    let session = "00000000-0000-4000-8000-000000000001";
    // A read command at a mistyped path creates nothing.
    let typo = path("typo.db");
    let out = run(&typo, &["history", session], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("there is no session store at"),
        "{}",
        stderr(&out)
    );
    assert!(!std::path::Path::new(&typo).exists(), "typo.db was created");
    // Another application's SQLite database is neither migrated nor
    // switched to WAL, by a read or by a write.
    let app = path("app.db");
    // (schema, journal mode) of a SQLite file, through the store's driver.
    let inspect = |p: &str, create: Option<&str>| -> (String, String) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            use sqlx::ConnectOptions;
            let mut c = sqlx::sqlite::SqliteConnectOptions::new()
                .filename(p)
                .create_if_missing(create.is_some())
                .connect()
                .await
                .unwrap();
            if let Some(sql) = create {
                sqlx::query(sql).execute(&mut c).await.unwrap();
            }
            let names: String = sqlx::query_scalar("select group_concat(name) from sqlite_master")
                .fetch_one(&mut c)
                .await
                .unwrap();
            let mode: String = sqlx::query_scalar("pragma journal_mode")
                .fetch_one(&mut c)
                .await
                .unwrap();
            (names, mode)
        })
    };
    assert_eq!(
        inspect(&app, Some("create table users(id int)")),
        ("users".to_owned(), "delete".to_owned())
    );
    let before = std::fs::read(&app).unwrap();
    for args in [
        vec!["context", session],
        vec!["import", "-"],
        vec!["migrate"],
    ] {
        let args: Vec<&str> = args.into_iter().filter(|a| *a != "-").collect();
        let out = run(&app, &args, Some(&base_log()));
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("is a SQLite database of something else (tables: users)"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    assert_eq!(std::fs::read(&app).unwrap(), before, "app.db changed");
    assert_eq!(
        inspect(&app, None),
        ("users".to_owned(), "delete".to_owned())
    );
    // Another program's table of the store's own name, without the
    // migrator's table: not a store either (the first migration made
    // `_sqlx_migrations` in the file, then failed on `events`, exit 4).
    let named = path("named.db");
    assert_eq!(
        inspect(&named, Some("create table events(x text)")),
        ("events".to_owned(), "delete".to_owned())
    );
    let before = std::fs::read(&named).unwrap();
    for args in [vec!["context", session], vec!["import"], vec!["migrate"]] {
        let out = run(&named, &args, Some(&base_log()));
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("is a SQLite database of something else (tables: events)"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    assert_eq!(std::fs::read(&named).unwrap(), before, "named.db changed");
    // A file that is not SQLite at all.
    let text = path("notes.db");
    std::fs::write(&text, "hello\n".repeat(200)).unwrap();
    let out = run(&text, &["recover", session], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("is not a SQLite database"),
        "{}",
        stderr(&out)
    );
    // A store in a directory that does not exist is the caller's mistake
    // (exit 1, said so), not a storage outage (exit 4).
    for (bad, says) in [
        (path("missing/s.db"), "does not exist"),
        (format!("{text}/s.db"), "is not a directory"),
    ] {
        let out = run(&bad, &["migrate"], None);
        assert_eq!(out.status.code(), Some(1), "{bad}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{bad}: {}", stderr(&out));
    }
    // An input file that cannot be read leaves no new store behind.
    let unread = path("unread.db");
    for args in [
        vec!["import", "no-such-file.jsonl"],
        vec!["append", S, "--expected-seq", "0", "no-such-file.jsonl"],
    ] {
        let out = run(&unread, &args, None);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("cannot read"), "{}", stderr(&out));
        assert!(
            !std::path::Path::new(&unread).exists(),
            "{args:?} made a store"
        );
    }
    // A directory given as the input is said by its name.
    let out = run(&unread, &["import", dir.path().to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!(
            "cannot read {}: it is a directory",
            dir.path().display()
        )),
        "{}",
        stderr(&out)
    );
    assert!(!std::path::Path::new(&unread).exists(), "a store was made");
    // A new path is created by the commands that write, and read after.
    let new = path("new.db");
    assert!(run(&new, &["import"], Some(&base_log())).status.success());
    let out = run(&new, &["history", S, "--json"], None);
    assert_eq!(stdout(&out).lines().count(), 7, "{}", stderr(&out));
}

/// The binary on `url` with `args` and `stdin`, its temporary files made
/// in `tmp`.
fn run_with_tmp(url: &str, args: &[&str], stdin: &str, tmp: &std::path::Path) -> Output {
    common::run_bin(url, args, stdin, &[("TMPDIR", tmp.as_os_str())])
}

#[test]
fn a_write_refused_at_a_path_with_no_store_makes_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let path = |name: &str| dir.path().join(name).display().to_string();
    let started = r#"{"type":"session_started","mode":"agent"}"#;
    let first = with_session(started);
    // A result whose call was never stored: refused by what the store
    // knows (SEMANTICS §4), not by the line's shape.
    let orphan = r#"{"type":"tool_result","call_id":"nope","tool_name":"Read","status":"success","output":"x"}"#;
    let refused: Vec<(Vec<&str>, String, i32, &str)> = vec![
        (
            vec!["import"],
            "not json\n".to_owned(),
            1,
            "line 1: malformed JSON",
        ),
        (
            vec!["import"],
            format!("{}\n", with_session(orphan)),
            1,
            "line 1:",
        ),
        (
            vec!["import", "--format", "pi"],
            "not json\n".to_owned(),
            1,
            "line 1",
        ),
        (
            vec!["append", S, "--expected-seq", "3"],
            format!("{started}\n"),
            3,
            "expected seq 3, but the session is at seq 0",
        ),
        (
            vec!["append", S, "--expected-seq", "0"],
            format!("{orphan}\n"),
            1,
            "line 1:",
        ),
        (
            vec!["append", S, "--expected-seq", "0"],
            format!("{started}\n{{\n"),
            1,
            "line 2: malformed JSON",
        ),
        (
            vec![
                "append",
                S,
                "--expected-seq",
                "0",
                "--max-batch-events",
                "1",
            ],
            format!("{started}\n{started}\n"),
            1,
            "more than 1 event (--max-batch-events)",
        ),
    ];
    for (i, (args, input, code, says)) in refused.iter().enumerate() {
        let at = path(&format!("refused-{i}.db"));
        let out = run_with_tmp(&at, args, input, &tmp);
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
        assert!(
            !std::path::Path::new(&at).exists(),
            "case {i}, {args:?}, made a store"
        );
    }
    // A path where no store can be made is said so before its input is
    // judged.
    let out = run_with_tmp(&path("missing/s.db"), &["import"], "not json\n", &tmp);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the directory") && stderr(&out).contains("does not exist"),
        "{}",
        stderr(&out)
    );
    // The input was judged on a throw-away store, which is gone.
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "left in TMPDIR"
    );
    // Where no throw-away store can be made, the store judges as before:
    // the same answer, with the new store left behind.
    let at = path("no-tmp.db");
    let out = run_with_tmp(
        &at,
        &["append", S, "--expected-seq", "0"],
        orphan,
        &dir.path().join("none"),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("line 1:"), "{}", stderr(&out));
    assert!(std::path::Path::new(&at).exists());
    // A write that stores its first lines makes the store, and keeps them.
    let at = path("partly.db");
    let input = format!("{first}\n{}\n", with_session(orphan));
    let out = run_with_tmp(&at, &["import"], &input, &tmp);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("line 2:"), "{}", stderr(&out));
    let out = run(&at, &["history", S, "--json"], None);
    assert_eq!(stdout(&out).lines().count(), 1, "{}", stderr(&out));
    // Writes that succeed make a store, even of nothing.
    for (i, (args, input)) in [
        (vec!["import"], String::new()),
        (vec!["append", S, "--expected-seq", "0"], String::new()),
        (
            vec!["append", S, "--expected-seq", "0"],
            format!("{started}\n"),
        ),
    ]
    .iter()
    .enumerate()
    {
        let at = path(&format!("made-{i}.db"));
        let out = run_with_tmp(&at, args, input, &tmp);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let out = run(&at, &["history", S, "--json"], None);
        let seqs = stdout(&out).lines().count();
        match out.status.code() {
            Some(0) => assert_eq!(seqs, 1, "{args:?}"),
            _ => assert!(
                stderr(&out).contains("not found"),
                "{args:?}: {}",
                stderr(&out)
            ),
        }
    }
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "left in TMPDIR"
    );
}

/// How many events `audit events --tenant TENANT` finds.
fn tenants_events(url: &str, tenant: &str) -> usize {
    let out = run(
        url,
        &["audit", "events", "--tenant", tenant, "--json"],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let page: Value = serde_json::from_str(&stdout(&out)).unwrap();
    page["events"].as_array().unwrap().len()
}

/// `import --tenant` and `append --tenant` write on behalf of a tenant:
/// what they create is the tenant's (its tokens see it), another tenant's
/// session is refused unchanged, and a store moved by export and import
/// keeps its sessions' tenants (a review moved a store and every session
/// became the tenant `default`'s, so their tenants' tokens answered 404).
#[test]
fn writes_for_a_tenant_claim_their_sessions_and_refuse_others() {
    for (backend, db) in backends() {
        let url = db.url.as_str();
        let out = run(url, &["import", "--tenant", "acme"], Some(&base_log()));
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert_eq!(tenants_events(url, "acme"), 7, "{backend}");
        assert_eq!(tenants_events(url, "default"), 0, "{backend}");
        let prompt = r#"{"type":"prompt_submitted","text":"three"}"#;
        let refused = [
            (
                vec!["append", S, "--expected-seq", "7", "--tenant", "globex"],
                prompt.to_owned(),
            ),
            (vec!["import", "--tenant", "globex"], with_session(prompt)),
        ];
        for (args, input) in refused {
            let out = run(url, &args, Some(&input));
            assert_eq!(
                out.status.code(),
                Some(1),
                "{backend} {args:?}: {}",
                stderr(&out)
            );
            assert!(
                stderr(&out).contains(&format!(
                    "session {S} belongs to another tenant than \"globex\"; nothing of it was written"
                )),
                "{backend} {args:?}: {}",
                stderr(&out)
            );
            assert_eq!(tenants_events(url, "acme"), 7, "{backend}");
            assert_eq!(tenants_events(url, "globex"), 0, "{backend}");
        }
        let out = run(
            url,
            &["append", S, "--expected-seq", "7", "--tenant", "acme"],
            Some(prompt),
        );
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert_eq!(tenants_events(url, "acme"), 8, "{backend}");
        // Names no token document may hold are refused by the writes (an
        // empty one by audit too: it answered an empty page, exit 0, so a
        // loop over tenants moved nothing and said nothing). Audit's
        // filter takes what a store written before the rule may hold.
        for (name, says, audit) in [
            ("", "1 to 200 bytes", Some(2)),
            ("acme ", "whitespace", Some(0)),
            ("\u{202E}acme", "direction of text", Some(0)),
        ] {
            let out = run(url, &["import", "--tenant", name], Some(""));
            assert_eq!(
                out.status.code(),
                Some(2),
                "{backend} {name:?}: {}",
                stderr(&out)
            );
            assert!(
                stderr(&out).contains(says),
                "{backend} {name:?}: {}",
                stderr(&out)
            );
            let out = run(url, &["audit", "events", "--tenant", name], None);
            assert_eq!(
                out.status.code(),
                audit,
                "{backend} {name:?}: {}",
                stderr(&out)
            );
        }
        // A name starting with `-` is given as `--tenant=-ops` (as the
        // move loop writes it); `--tenant` followed by a flag is a missing
        // value, not a tenant named by the flag.
        let dashed = r#"{"session_id":"88888888-0000-4000-8000-000000000008","type":"session_started","mode":"agent"}"#;
        let out = run(
            url,
            &["import", "--tenant", "--write-timeout=10"],
            Some(dashed),
        );
        assert_eq!(out.status.code(), Some(2), "{backend}: {}", stderr(&out));
        let out = run(url, &["import", "--tenant=-ops"], Some(dashed));
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        let out = run(url, &["audit", "events", "--tenant=-ops", "--json"], None);
        let page: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(page["events"].as_array().unwrap().len(), 1, "{backend}");
        // The tenants the store holds, with the default tenant's sessions
        // (no owner row): what a move goes through.
        let other = r#"{"session_id":"99999999-0000-4000-8000-000000000009","type":"session_started","mode":"agent"}"#;
        let out = run(url, &["import"], Some(other));
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        let out = run(url, &["audit", "tenants", "--json"], None);
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        // As text: the keys in the documented order, `tenant` first.
        assert_eq!(
            stdout(&out),
            "{\"tenants\":[{\"tenant\":\"-ops\",\"sessions\":1},\
             {\"tenant\":\"acme\",\"sessions\":1},\
             {\"tenant\":\"default\",\"sessions\":1}]}\n",
            "{backend}"
        );
        let out = run(url, &["audit", "tenants"], None);
        assert_eq!(
            stdout(&out),
            "         1  \"-ops\"\n         1  \"acme\"\n         1  \"default\"\n",
            "{backend}"
        );
        // Moved: exported, and imported for its tenant into a new store.
        let export = run(url, &["export", S], None);
        assert!(export.status.success(), "{backend}: {}", stderr(&export));
        let moved = common::sqlite_db();
        let out = run(
            &moved.url,
            &["import", "--tenant", "acme"],
            Some(&stdout(&export)),
        );
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert_eq!(tenants_events(&moved.url, "acme"), 8, "{backend}");
        // A pi file too.
        let pi = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pi/plain.jsonl");
        let out = run(
            &moved.url,
            &["import", "--format", "pi", "--tenant", "globex", pi],
            None,
        );
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        assert!(tenants_events(&moved.url, "globex") > 0, "{backend}");
        // The same file, and one whose events differ from the stored
        // ones: the tenant is judged first, and the other tenant's events
        // are not described.
        let edited = tempfile::NamedTempFile::new().unwrap();
        let text = std::fs::read_to_string(pi).unwrap();
        std::fs::write(
            edited.path(),
            text.replacen("List the files in src", "List the files in lib", 1),
        )
        .unwrap();
        for file in [pi, edited.path().to_str().unwrap()] {
            let out = run(
                &moved.url,
                &["import", "--format", "pi", "--tenant", "acme", file],
                None,
            );
            assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
            assert!(
                stderr(&out).contains("belongs to another tenant than \"acme\""),
                "{backend}: {}",
                stderr(&out)
            );
        }
    }
}

#[test]
fn input_lines_skip_blank_lines_of_any_length_and_number_the_rest() {
    use session_store::cli::InputLines;
    let text = format!(
        "a\n{}\n\nb\r\n{}\n  c  \n{}",
        " ".repeat(30),
        "\t".repeat(25),
        " ".repeat(15)
    );
    let lines: Vec<(usize, String)> =
        InputLines::new(Box::new(std::io::Cursor::new(text.into_bytes())), 10)
            .collect::<Result<_, _>>()
            .unwrap();
    assert_eq!(
        lines,
        [
            (1, "a".to_owned()),
            (4, "b".to_owned()),
            (6, "  c  ".to_owned())
        ]
    );
    // A line over the limit that is not blank is refused at its number,
    // and nothing is read after it.
    let text = format!("a\n{}x\nb\n", " ".repeat(20));
    let mut lines = InputLines::new(Box::new(std::io::Cursor::new(text.into_bytes())), 10);
    assert_eq!(lines.next().unwrap().unwrap(), (1, "a".to_owned()));
    let err = lines.next().unwrap().unwrap_err();
    assert!(err.to_string().starts_with("line 2:"), "{err}");
    assert!(lines.next().is_none());
}

#[test]
fn tail_follow_on_a_new_path_waits_for_the_first_events() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("new.db").display().to_string();
    let mut tail = spawn(&url, &["tail", "--follow", "--json"]);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        tail.try_wait().unwrap().is_none(),
        "tail --follow stopped on a new path"
    );
    assert!(run(&url, &["import"], Some(&base_log())).status.success());
    let stdout = tail.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .take(7)
            .map(|l| l.unwrap())
            .collect::<Vec<_>>()
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !reader.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = tail.kill();
    let _ = tail.wait();
    let lines = reader.join().unwrap();
    assert_eq!(lines.len(), 7, "{lines:?}");
}

#[test]
fn a_store_its_reader_cannot_write_is_refused_with_the_reason() {
    // Needs a second user: run as root (as CI does), read as `nobody`.
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    let setpriv = Command::new("setpriv").arg("--version").output().is_ok();
    if !(root && setpriv) {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI runs as root with setpriv"
        );
        eprintln!("SKIPPED: needs root and setpriv");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let url = dir.path().join("s.db").display().to_string();
    assert!(run(&url, &["import"], Some(&base_log())).status.success());
    let out = Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            BIN,
        ])
        .args(["--database", &url, "activations", S])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("needs write access to the file and to its directory"),
        "{}",
        stderr(&out)
    );
    let seq = stdout(&run(&url, &["recover", S, "--json"], None));
    let seq = serde_json::from_str::<Value>(&seq).unwrap()["latest_seq"].to_string();
    // Its directory and file its own, the file read-only: reads answer, and
    // an append is refused saying what to check (it said only "attempt to
    // write a readonly database").
    let own = Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(own.success());
    std::fs::set_permissions(&url, std::fs::Permissions::from_mode(0o444)).unwrap();
    let as_nobody = |args: &[&str]| {
        let mut child = Command::new("setpriv")
            .args([
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                BIN,
            ])
            .args(["--database", &url])
            .args(args)
            .env_remove("DATABASE_URL")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(br#"{"type":"prompt_submitted","text":"x"}"#)
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let out = as_nobody(&["activations", S]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = as_nobody(&["append", S, "--expected-seq", &seq]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .contains("cannot be written by this process: check their owner and permissions"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_reader_that_closes_the_output_early_ends_the_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    // About 200 KB of history: more than a pipe holds.
    let mut lines = vec![format!(
        r#"{{"session_id":"{S}","type":"session_started","mode":"agent"}}"#
    )];
    let text = "x".repeat(200);
    for i in 0..1000 {
        lines.push(format!(
            r#"{{"session_id":"{S}","type":"prompt_submitted","text":"{i} {text}"}}"#
        ));
    }
    let out = run(&url, &["import"], Some(&lines.join("\n")));
    assert!(out.status.success(), "{}", stderr(&out));
    for args in [vec!["history", S, "--json"], vec!["export", S]] {
        let mut child = spawn(&url, &args);
        drop(child.stdin.take());
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
        assert!(first.contains("session_started"), "{first}");
        drop(stdout);
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "{args:?}");
    }
}

#[test]
fn an_export_of_an_event_at_the_size_limit_imports_again() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        dir.path().join("a.db").display().to_string(),
        dir.path().join("b.db").display().to_string(),
    );
    let limit = 2_000;
    let overhead = session_store::EventBody::PromptSubmitted {
        text: String::new(),
    }
    .to_json_text()
    .len();
    let text = "x".repeat(limit - overhead);
    let lines = format!(
        "{}\n{}\n",
        r#"{"type":"session_started","mode":"agent"}"#,
        serde_json::json!({"type": "prompt_submitted", "text": text})
    );
    let flag = limit.to_string();
    let out = run(
        &a,
        &[
            "--max-event-bytes",
            &flag,
            "append",
            S,
            "--expected-seq",
            "0",
        ],
        Some(&lines),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // One byte more is over the limit, whatever the line's envelope.
    let over = serde_json::json!({"type": "prompt_submitted", "text": format!("{text}y")});
    let out = run(
        &a,
        &[
            "--max-event-bytes",
            &flag,
            "append",
            S,
            "--expected-seq",
            "2",
        ],
        Some(&over.to_string()),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("event-too-large"), "{}", stderr(&out));
    // The export's lines carry the envelope too, and still import.
    let export = stdout(&run(&a, &["export", S], None));
    assert!(export.lines().any(|l| l.len() > limit), "{export}");
    let out = run(&b, &["--max-event-bytes", &flag, "import"], Some(&export));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&run(&b, &["export", S], None)), export);
}

#[test]
fn text_a_session_holds_cannot_drive_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        dir.path().join("a.db").display().to_string(),
        dir.path().join("b.db").display().to_string(),
    );
    let hostile = "\u{1b}]0;pwned\u{7}\u{1b}[31mred\r\u{7f}";
    let lines = [
        serde_json::json!({"session_id": S, "type": "session_started", "mode": format!("m{hostile}")}),
        serde_json::json!({"session_id": S, "type": "prompt_submitted", "text": hostile}),
        serde_json::json!({"session_id": S, "type": "tool_call", "call_id": format!("c{hostile}"), "tool_name": "Read", "input": hostile}),
    ]
    .map(|v| v.to_string())
    .join("\n");
    assert!(run(&a, &["import"], Some(&lines)).status.success());
    for args in [
        vec!["history", S],
        vec!["context", S],
        vec!["history", S, "--json"],
        vec!["export", S],
        vec!["tail"],
    ] {
        let out = run(&a, &args, None);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let raw = &out.stdout;
        assert!(
            !raw.iter()
                .any(|&b| (b < 0x20 && b != b'\n' && b != b'\t') || b == 0x7f),
            "{args:?} wrote a raw control byte: {}",
            String::from_utf8_lossy(raw)
        );
        if args.len() == 2 && args[0] != "export" {
            assert!(
                stdout(&out).contains(r"\u001b"),
                "{args:?}: {}",
                stdout(&out)
            );
        }
    }
    // The export still says exactly what was stored.
    let export = stdout(&run(&a, &["export", S], None));
    assert!(run(&b, &["import"], Some(&export)).status.success());
    assert_eq!(stdout(&run(&b, &["export", S], None)), export);
    let v: Value = serde_json::from_str(export.lines().nth(1).unwrap()).unwrap();
    assert_eq!(v["text"], hostile);
}

/// Processes creating one new store at once all get it: none trips over
/// another's checks (a probe file made at the store's own path once made
/// about 1 % of such runs fail with a disk I/O error).
#[test]
fn processes_creating_a_store_at_once_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..150 {
        let url = dir
            .path()
            .join(format!("s{round}.db"))
            .display()
            .to_string();
        let children: Vec<_> = (0..4)
            .map(|_| {
                let mut child = spawn(
                    &url,
                    &[
                        "append",
                        &uuid::Uuid::new_v4().to_string(),
                        "--expected-seq",
                        "0",
                    ],
                );
                child
                    .stdin
                    .take()
                    .unwrap()
                    .write_all(br#"{"type":"session_started","mode":"a"}"#)
                    .unwrap();
                child
            })
            .collect();
        for child in children {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "round {round}: {}", stderr(&out));
        }
    }
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("probe"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn dash_reads_stdin_and_only_json_whitespace_is_blank() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    // A non-UUID session is said before a store file is made.
    let out = run(&url, &["append", "nope", "--expected-seq", "0"], Some(""));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(!dir.path().join("s.db").exists());
    let input = format!(
        "{}\n \t\r\n\n{}\n",
        with_session(r#"{"type":"session_started","mode":"agent"}"#),
        with_session(r#"{"type":"prompt_submitted","text":"x"}"#)
    );
    let out = run(&url, &["import", "-"], Some(&input));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("imported 2 events"),
        "{}",
        stdout(&out)
    );
    // A no-break space or a form feed is not JSON's whitespace: the line
    // is malformed, not skipped.
    for blank in ["\u{a0}", "\u{c}", "\u{3000}"] {
        let line = format!("{blank}\n");
        let out = run(
            &url,
            &["append", S, "--expected-seq", "2", "-"],
            Some(&line),
        );
        assert_eq!(out.status.code(), Some(1), "{blank:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("line 1: malformed JSON"),
            "{}",
            stderr(&out)
        );
    }
}

#[test]
fn a_retry_that_respells_numbers_is_the_same_event() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    let lines = [
        r#"{"type":"session_started","mode":"a"}"#,
        r#"{"type":"tool_call","call_id":"c","tool_name":"t","input":{"limit":1e3,"ratio":1.50,"n":[-0,7]}}"#,
    ]
    .join("\n");
    let out = run(&url, &["append", S, "--expected-seq", "0"], Some(&lines));
    assert!(out.status.success(), "{}", stderr(&out));
    let export = stdout(&run(&url, &["export", S], None));
    // What jq or Python write back: 1e+3 as 1000, 1.50 as 1.5, -0 as 0.
    let respelled = export
        .replace("1e+3", "1000")
        .replace("1.50", "1.5")
        .replace("[0,7]", "[0.0,7e0]");
    assert_ne!(respelled, export);
    let out = run(&url, &["import"], Some(&respelled));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("(2 already stored)"),
        "{}",
        stdout(&out)
    );
    // Stored as first sent.
    assert_eq!(stdout(&run(&url, &["export", S], None)), export);
    // A different number is other content.
    let other = export.replace("1.50", "1.51");
    let out = run(&url, &["import"], Some(&other));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("of this session with other content"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn an_export_of_escaped_characters_at_the_limit_imports_again() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        dir.path().join("a.db").display().to_string(),
        dir.path().join("b.db").display().to_string(),
    );
    // Kept as one (DEL) or two (C1) bytes each, exported as six: an event
    // near the limit makes a line several times the limit.
    let text = "\u{7f}\u{85}".repeat(10_000);
    let lines = [
        serde_json::json!({"session_id": S, "type": "session_started", "mode": "a"}),
        serde_json::json!({"session_id": S, "type": "prompt_submitted", "text": text}),
    ]
    .map(|v| v.to_string())
    .join("\n");
    let limit = ["--max-event-bytes", "30200"];
    let out = run(&a, &[&limit[..], &["import"]].concat(), Some(&lines));
    assert!(out.status.success(), "{}", stderr(&out));
    let export = stdout(&run(&a, &["export", S], None));
    // Over the limit and the envelope's room: refused unread before.
    assert!(export.lines().nth(1).unwrap().len() > 30_200 + 64 * 1024);
    let out = run(&b, &[&limit[..], &["import"]].concat(), Some(&export));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&run(&b, &["export", S], None)), export);
}

#[test]
fn an_error_message_quoting_the_input_cannot_drive_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    // DEL and C1 (U+009B is CSI) in what a message quotes back: the
    // unknown type, a tool name.
    for line in [
        serde_json::json!({"type": "x\u{9b}2J\u{7f}"}),
        serde_json::json!({"type": "tool_call", "call_id": "c", "tool_name": "a\u{7f}\u{9d}0;t\u{9c}", "input": {}}),
    ] {
        let out = run(
            &url,
            &["append", S, "--expected-seq", "0"],
            Some(&line.to_string()),
        );
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        let raw = &out.stderr;
        assert!(
            !raw.windows(2).any(|w| w[0] == 0x7f
                || w[1] == 0x7f
                || (w[0] == 0xc2 && (0x80..=0x9f).contains(&w[1]))),
            "a raw control character: {}",
            String::from_utf8_lossy(raw)
        );
    }
    let out = run(
        &url,
        &["append", S, "--expected-seq", "0"],
        Some(r#"{"type":"x\u009b2J\u007f"}"#),
    );
    assert!(
        stderr(&out).contains(r#""x\u009b2J\u007f""#),
        "{}",
        stderr(&out)
    );
}

#[test]
fn import_says_what_it_kept_and_reads_past_a_byte_order_mark() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    // A byte order mark before the first line is not text.
    let input = format!(
        "\u{feff}{}\n{}\nnot json\n",
        with_session(r#"{"type":"session_started","mode":"agent"}"#),
        with_session(r#"{"type":"prompt_submitted","text":"x"}"#)
    );
    let out = run(&url, &["import"], Some(&input));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    // The line's number, the column in it, and what was kept.
    assert!(
        err.contains("line 3: malformed JSON")
            && err.contains("at column 2")
            && !err.contains("line 1 column")
            && err.contains("the 2 events before it are stored"),
        "{err}"
    );
    // One before a later line (files joined with `cat`) is said as such.
    let joined = format!(
        "{}\n\u{feff}{}\n",
        with_session(r#"{"type":"prompt_submitted","text":"y"}"#),
        with_session(r#"{"type":"prompt_submitted","text":"z"}"#)
    );
    let out = run(&url, &["import"], Some(&joined));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("line 2: the line starts with a byte order mark (U+FEFF)")
            && stderr(&out).contains("(rule malformed-json)"),
        "{}",
        stderr(&out)
    );
    // A pi session file given to the JSONL reader says so.
    let pi = std::fs::read_to_string("tests/fixtures/pi/plain.jsonl").unwrap();
    let out = run(&url, &["import"], Some(&pi));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--format pi"), "{}", stderr(&out));
}

#[test]
fn printable_escapes_c0_del_and_c1_however_the_writes_split_them() {
    use session_store::cli::Printable;
    let text = "a\u{1b}[2J b\u{9b}2J c\u{9d}0;t\u{9c} é\u{a0}ü\t\n";
    let bytes = text.as_bytes();
    // Every split point, so a C1 character's two bytes land in two writes.
    for cut in 0..=bytes.len() {
        let mut out = Vec::new();
        {
            let mut p = Printable::new(&mut out);
            p.write_all(&bytes[..cut]).unwrap();
            p.write_all(&bytes[cut..]).unwrap();
            p.flush().unwrap();
        }
        let shown = String::from_utf8(out).unwrap();
        assert_eq!(
            shown, "a\\u001b[2J b\\u009b2J c\\u009d0;t\\u009c é\u{a0}ü\t\n",
            "cut at {cut}"
        );
    }
}

#[test]
fn a_named_pipe_is_read_once_and_a_closed_output_keeps_the_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    // import from a named pipe: opened once, before the store, so the
    // producer is not cut off and the import does not wait for a second
    // writer.
    let fifo = dir.path().join("in.fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let producer = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::write(&fifo, base_log()))
    };
    let mut child = spawn(&url, &["import", fifo.to_str().unwrap()]);
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "import from a named pipe hangs");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success());
    producer.join().unwrap().unwrap();
    // A broken chain is exit 5 even when the reader of the JSON report
    // has gone.
    tamper(
        &url,
        "DROP TRIGGER events_no_update; UPDATE events SET payload = replace(payload, 'agent', 'chat') WHERE seq = 1;",
    );
    let mut child = spawn(&url, &["verify", "--integrity", "--json"]);
    drop(child.stdin.take());
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
}

/// `--write-timeout` holds on SQLite while another process holds the write
/// lock: the append answers at its deadline (exit 4), and the command does
/// not then wait out SQLite's own 10 s wait for the lock while it closes.
#[test]
fn a_write_held_up_by_another_process_lock_exits_4_at_the_write_timeout() {
    let db = common::sqlite_db();
    let imported = run(&db.url, &["import"], Some(&base_log()));
    assert_eq!(imported.status.code(), Some(0), "{}", stderr(&imported));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut holder = rt.block_on(async {
        use sqlx::Connection;
        let mut c = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut c)
            .await
            .unwrap();
        c
    });
    let t = Instant::now();
    let out = run(
        &db.url,
        &["append", "--write-timeout", "1", S, "--expected-seq", "7"],
        Some(r#"{"type":"prompt_submitted","text":"late"}"#),
    );
    let took = t.elapsed();
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(stderr(&out).contains("within 1 s"), "{}", stderr(&out));
    assert!(took < Duration::from_secs(6), "exited after {took:?}");
    rt.block_on(async {
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut holder)
            .await
            .unwrap();
    });
}

/// The latest context of a long window (more than the 2 000 events the
/// store reads as a window) is written as its rows are read, a page at a
/// time; it prints the same bytes, JSON and text, as the fold of the log
/// (`--at-seq` the latest seq) does: a session never compacted, one whose
/// compaction after the last prompt keeps almost all of it, and one whose
/// only prompt is its first (a short window at the view, and 2 000
/// events after it).
#[test]
fn a_long_context_prints_page_by_page_what_the_fold_prints() {
    for (backend, db) in backends() {
        for (compacted, prompts) in [(false, true), (true, true), (false, false)] {
            let session = uuid::Uuid::new_v4().to_string();
            let line = |body: &str| format!(r#"{{"session_id":"{session}",{body}}}"#);
            let mut lines = vec![
                line(r#""type":"session_started","mode":"agent""#),
                line(r#""type":"catalog_defined","mode":"agent","deferred_tools":["web_fetch"]"#),
            ];
            for i in 0..700 {
                // Without prompts after the first, the view stays at seq 3
                // and 2 000 events follow it.
                let text = format!(r#""type":"prompt_submitted","text":"p{i}""#);
                lines.push(line(&if prompts || i == 0 {
                    text
                } else {
                    r#""type":"assistant_message","text":"thinking""#.to_owned()
                }));
                lines.push(line(&format!(
                    r#""type":"tool_call","call_id":"c{i}","tool_name":"web_fetch","input":{{"n":{i}}}"#
                )));
                lines.push(line(&format!(
                    r#""type":"tool_result","call_id":"c{i}","tool_name":"web_fetch","status":"success","output":"o{i}""#
                )));
            }
            let out = run(&db.url, &["import"], Some(&(lines.join("\n") + "\n")));
            assert!(out.status.success(), "{backend}: {}", stderr(&out));
            let mut last = lines.len();
            if compacted {
                // Keep from the 5th event (the first prompt's call).
                let history = stdout(&run(
                    &db.url,
                    &["history", &session, "--json", "--limit", "5"],
                    None,
                ));
                let kept: Value = serde_json::from_str(history.lines().nth(3).unwrap()).unwrap();
                let tail = [
                    line(&format!(
                        r#""type":"compaction","summary":"s","first_kept_event_id":"{}""#,
                        kept["event_id"].as_str().unwrap()
                    )),
                    line(r#""type":"assistant_message","text":"after""#),
                ];
                let out = run(&db.url, &["import"], Some(&(tail.join("\n") + "\n")));
                assert!(out.status.success(), "{backend}: {}", stderr(&out));
                last += tail.len();
            }
            let latest = last.to_string();
            for json in [true, false] {
                let mut paged = vec!["context", session.as_str()];
                if json {
                    paged.push("--json");
                }
                let mut folded = paged.clone();
                folded.extend(["--at-seq", latest.as_str()]);
                let (a, b) = (run(&db.url, &paged, None), run(&db.url, &folded, None));
                assert!(a.status.success(), "{backend}: {}", stderr(&a));
                assert!(b.status.success(), "{backend}: {}", stderr(&b));
                assert!(stdout(&a).lines().count() > if json { 0 } else { 2_000 });
                assert!(
                    stdout(&a) == stdout(&b),
                    "{backend} compacted={compacted} prompts={prompts} json={json}: the paged context differs from the fold"
                );
            }
        }
    }
}

/// A symbolic link that loops, or that leads to a directory that does not
/// exist, is the path's fault (exit 1, said as such), not the storage
/// failing (exit 4, "unable to open database file").
#[test]
fn symbolic_links_that_lead_nowhere_are_said_as_the_paths_fault() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, dangling) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("dangling"),
    );
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    std::os::unix::fs::symlink(dir.path().join("no-such-dir/s.db"), &dangling).unwrap();
    let started = r#"{"type":"session_started","mode":"agent"}"#;
    let a = a.display().to_string();
    for args in [&["history", S][..], &["append", S, "--expected-seq", "0"]] {
        let out = run(&a, args, Some(started));
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("is a symbolic link that leads back to itself"),
            "{}",
            stderr(&out)
        );
    }
    let dangling = dangling.display().to_string();
    let out = run(
        &dangling,
        &["append", S, "--expected-seq", "0"],
        Some(started),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no-such-dir does not exist"),
        "{}",
        stderr(&out)
    );
}
