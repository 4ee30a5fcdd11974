//! `import --format pi` through the real binary, on both backends: the
//! path to the leaf of a pi session file becomes one session (branches
//! dropped, compaction kept from its first kept entry, `isError` and
//! `details.addedToolNames` kept), re-import stores nothing twice, and a bad
//! file fails naming its line and field and changes nothing. The fixtures
//! under tests/fixtures/pi/ are written by hand from pi's session format
//! description; docs/pi-import.md gives the mapping.

mod common;

use std::process::{Command, Output, Stdio};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_session-store");
const PI: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pi");

const PLAIN: &str = "0b6a3f1e-6c1d-4e8a-9f2b-1a2b3c4d5e01";
const COMPACTION: &str = "3c2d1e0f-4a5b-4c6d-8e7f-90a1b2c3d4e5";
const TOOLS: &str = "7e8f9a0b-1c2d-4e3f-a4b5-c6d7e8f90a1b";

fn run(url: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("--database")
        .arg(url)
        .args(args)
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .output()
        .expect("run session-store")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn fixture(name: &str) -> String {
    format!("{PI}/{name}.jsonl")
}

/// Imports a pi file that must succeed; returns the summary line.
fn import(url: &str, path: &str) -> String {
    let out = run(url, &["import", "--format", "pi", path]);
    assert!(out.status.success(), "import {path}: {}", stderr(&out));
    stdout(&out)
}

/// The session id an import summary names.
fn session_of(summary: &str) -> String {
    summary
        .split("into session ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no session in {summary:?}"))
        .to_owned()
}

fn json_of(url: &str, args: &[&str]) -> Value {
    let out = run(url, args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    serde_json::from_str(&stdout(&out)).unwrap()
}

fn context(url: &str, session: &str) -> Value {
    json_of(url, &["context", session, "--json"])
}

fn activations(url: &str, session: &str, at: Option<i64>) -> Value {
    match at {
        Some(n) => json_of(
            url,
            &["activations", session, "--at-seq", &n.to_string(), "--json"],
        ),
        None => json_of(url, &["activations", session, "--json"]),
    }
}

/// Every stored event of a session, as `history --json` prints them.
fn history(url: &str, session: &str) -> Vec<Value> {
    let out = run(url, &["history", session, "--json"]);
    assert!(out.status.success(), "history: {}", stderr(&out));
    stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Every event of the store, in position order.
fn feed(url: &str) -> String {
    let out = run(url, &["tail", "--json"]);
    assert!(out.status.success(), "tail: {}", stderr(&out));
    stdout(&out)
}

/// Nothing is stored at `url`, which held nothing before: on SQLite not
/// even a store file (a refused import makes none), on PostgreSQL an empty
/// feed.
fn assert_nothing_stored(url: &str, what: &str) {
    match url.strip_prefix("sqlite://") {
        Some(path) => assert!(
            !std::path::Path::new(path).exists(),
            "{what}: a store was made"
        ),
        None => assert_eq!(feed(url), "", "{what}"),
    }
}

/// A row as `(seq, type, text or call id)`.
fn rows(ctx: &Value) -> Vec<(i64, String, String)> {
    ctx["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let what = r
                .get("text")
                .or_else(|| r.get("call_id"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            (
                r["seq"].as_i64().unwrap(),
                r["type"].as_str().unwrap().to_owned(),
                what.to_owned(),
            )
        })
        .collect()
}

fn row(seq: i64, ty: &str, what: &str) -> (i64, String, String) {
    (seq, ty.to_owned(), what.to_owned())
}

fn tools(act: &Value) -> Vec<(String, i64)> {
    act["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_owned(),
                t["evidence_seq"].as_i64().unwrap(),
            )
        })
        .collect()
}

fn tool(name: &str, seq: i64) -> (String, i64) {
    (name.to_owned(), seq)
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

#[test]
fn a_plain_session_becomes_its_transcript_rows_in_order() {
    for (backend, db) in backends() {
        // Given a linear pi session with a tool call, a model change, a
        // thinking level change and a label,
        let summary = import(&db.url, &fixture("plain"));
        // then its UUID is the session id,
        assert!(
            summary.starts_with(&format!("imported 8 events into session {PLAIN}")),
            "{backend}: {summary}"
        );
        // and messages become rows; thinking, model, thinking level and
        // label entries none.
        let ctx = context(&db.url, PLAIN);
        assert_eq!(ctx["summary"], Value::Null, "{backend}");
        assert_eq!(ctx["mode"], "agent", "{backend}");
        assert_eq!(
            rows(&ctx),
            vec![
                row(2, "prompt_submitted", "List the files in src"),
                row(3, "assistant_message", "Let me look."),
                row(4, "tool_call", "toolu_01"),
                row(5, "tool_result", "toolu_01"),
                row(6, "assistant_message", "src holds lib.rs and main.rs."),
                row(7, "prompt_submitted", "Thanks!"),
                row(8, "assistant_message", "You're welcome."),
            ],
            "{backend}"
        );
        let call = &ctx["rows"][2];
        assert_eq!(call["tool_name"], "bash");
        assert_eq!(call["input"], json!({"command": "ls src"}));
        let result = &ctx["rows"][3];
        assert_eq!(result["status"], "success");
        assert_eq!(
            result["output"],
            json!([{"type": "text", "text": "lib.rs\nmain.rs"}])
        );
        // A core tool's result activates nothing.
        assert_eq!(tools(&activations(&db.url, PLAIN, None)), vec![]);
        // The header is kept as the session's metadata, entry times as
        // event times.
        let events = history(&db.url, PLAIN);
        assert_eq!(events[0]["type"], "session_started");
        assert_eq!(events[0]["metadata"]["source"], "pi");
        assert_eq!(events[0]["metadata"]["pi_session_id"], PLAIN);
        assert_eq!(events[0]["metadata"]["cwd"], "/home/dev/project");
        assert_eq!(events[0]["recorded_at"], "2025-06-01T10:00:00Z");
        assert_eq!(events[1]["recorded_at"], "2025-06-01T10:00:01Z");
    }
}

#[test]
fn a_branch_off_the_path_to_the_leaf_is_dropped() {
    for (backend, db) in backends() {
        // Given a session whose ToolSearch branch was left for another one
        // (with a branch summary),
        let summary = import(&db.url, &fixture("branch"));
        assert!(
            summary.contains("4 pi entries on other branches dropped"),
            "{backend}: {summary}"
        );
        // the non-UUID pi id becomes a name-based UUID (version 5),
        let session = session_of(&summary);
        assert_eq!(&session[14..15], "5", "{session}");
        // only the path to the last entry is imported,
        let ctx = context(&db.url, &session);
        assert_eq!(
            rows(&ctx),
            vec![
                row(2, "prompt_submitted", "Hello"),
                row(3, "assistant_message", "Hi, what shall we do?"),
                row(
                    4,
                    "prompt_submitted",
                    "[branch summary]\nThe user looked for a web fetching tool; ToolSearch added web_fetch."
                ),
                row(5, "prompt_submitted", "Instead, read README.md"),
                row(6, "tool_call", "call_r1"),
                row(7, "tool_result", "call_r1"),
                row(8, "assistant_message", "The README says hello."),
            ],
            "{backend}"
        );
        // and the dropped branch's ToolSearch evidence activates nothing.
        assert_eq!(tools(&activations(&db.url, &session, None)), vec![]);
        let types: Vec<Value> = history(&db.url, &session)
            .iter()
            .map(|e| e["type"].clone())
            .collect();
        assert!(!types.contains(&json!("catalog_defined")), "{types:?}");
    }
}

#[test]
fn a_compaction_keeps_from_its_first_kept_entry_and_drops_summarized_evidence() {
    for (backend, db) in backends() {
        // Given ToolSearch adding web_fetch and web_search, both used, then
        // a compaction whose first kept entry is a thinking level change
        // just before the prompt "Fetch them",
        import(&db.url, &fixture("compaction"));
        let ctx = context(&db.url, COMPACTION);
        // the context is the summary and the rows from that prompt on,
        assert_eq!(
            ctx["summary"],
            "The user asked to research the payments API. ToolSearch added web_fetch and web_search; web_search found the docs URL.",
            "{backend}"
        );
        assert_eq!(
            rows(&ctx),
            vec![
                row(9, "prompt_submitted", "Fetch them"),
                row(10, "tool_call", "call_3"),
                row(11, "tool_result", "call_3"),
                row(12, "assistant_message", "Fetched the docs."),
                row(14, "prompt_submitted", "Summarize what you fetched"),
                row(
                    15,
                    "assistant_message",
                    "It documents creating and reading charges."
                ),
            ],
            "{backend}"
        );
        let events = history(&db.url, COMPACTION);
        let compaction = &events[12];
        assert_eq!(compaction["type"], "compaction");
        assert_eq!(compaction["tokens_before"], 12000);
        assert_eq!(compaction["first_kept_event_id"], events[8]["event_id"]);
        // web_fetch keeps the evidence of its own kept result; web_search's
        // evidence was all summarized.
        assert_eq!(
            tools(&activations(&db.url, COMPACTION, None)),
            vec![tool("web_fetch", 11)],
            "{backend}"
        );
        // Before the compaction both were active.
        assert_eq!(
            tools(&activations(&db.url, COMPACTION, Some(12))),
            vec![tool("web_fetch", 11), tool("web_search", 7)],
            "{backend}"
        );
    }
}

#[test]
fn a_tool_search_result_activates_its_added_names_and_error_results_nothing() {
    for (backend, db) in backends() {
        // Given a failed bash call, a failed ToolSearch that still lists a
        // name, a successful one adding two names, a failed call of one of
        // them and a successful call of the other,
        import(&db.url, &fixture("tools"));
        let act = activations(&db.url, TOOLS, None);
        assert_eq!(
            act,
            json!({"session_id": TOOLS, "as_of_seq": 16, "mode": "agent", "tools": [
                {"name": "mcp__github__create_issue", "evidence_seq": 10},
                {"name": "mcp__github__list_issues", "evidence_seq": 14},
            ]}),
            "{backend}"
        );
        let ctx = context(&db.url, TOOLS);
        let by_call = |id: &str| -> Value {
            ctx["rows"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["type"] == "tool_result" && r["call_id"] == id)
                .cloned()
                .unwrap_or_else(|| panic!("no result for {id}"))
        };
        // isError becomes the status; a failed result keeps no names.
        assert_eq!(by_call("call_b")["status"], "error");
        let failed_search = by_call("call_s1");
        assert_eq!(failed_search["status"], "error");
        assert_eq!(
            failed_search.get("added_tool_names").cloned(),
            None,
            "{failed_search}"
        );
        let search = by_call("call_s2");
        assert_eq!(search["status"], "success");
        assert_eq!(search["seq"], 10);
        assert_eq!(
            search["added_tool_names"],
            json!(["mcp__github__create_issue", "mcp__github__list_issues"])
        );
        assert_eq!(by_call("call_g1")["status"], "error");
        // Before the successful search nothing was active.
        assert_eq!(tools(&activations(&db.url, TOOLS, Some(8))), vec![]);
        // The names a search added make the deferred catalog, defined just
        // before the result that added them.
        let events = history(&db.url, TOOLS);
        assert_eq!(events[8]["type"], "catalog_defined");
        assert_eq!(
            events[8]["deferred_tools"],
            json!(["mcp__github__create_issue", "mcp__github__list_issues"])
        );
    }
}

#[test]
fn reimport_stores_nothing_twice_and_a_longer_file_appends_only_the_rest() {
    for (backend, db) in backends() {
        // Given a pi file imported once,
        for name in ["plain", "branch", "compaction", "tools"] {
            import(&db.url, &fixture(name));
        }
        let before = feed(&db.url);
        // importing each again stores nothing and changes nothing.
        for name in ["plain", "branch", "compaction", "tools"] {
            let summary = import(&db.url, &fixture(name));
            assert!(
                summary.starts_with("imported 0 events"),
                "{backend} {name}: {summary}"
            );
        }
        assert_eq!(feed(&db.url), before, "{backend}");

        // Given the first lines of a session that pi went on writing,
        let dir = tempfile::tempdir().unwrap();
        let full = std::fs::read_to_string(fixture("tools")).unwrap();
        let short: String = full.lines().take(6).map(|l| format!("{l}\n")).collect();
        let short_path = dir.path().join("short.jsonl");
        std::fs::write(&short_path, short).unwrap();
        let other = common::sqlite_db();
        let summary = import(&other.url, short_path.to_str().unwrap());
        assert!(summary.starts_with("imported 7 events"), "{summary}");
        // the whole file later appends only what is new,
        let summary = import(&other.url, &fixture("tools"));
        assert!(
            summary.starts_with("imported 9 events") && summary.contains("(7 already stored"),
            "{summary}"
        );
        // with the same ids and payloads as importing it at once.
        let strip = |events: Vec<Value>| -> Vec<Value> {
            events
                .into_iter()
                .map(|mut e| {
                    e.as_object_mut().unwrap().remove("position");
                    e
                })
                .collect()
        };
        assert_eq!(
            strip(history(&other.url, TOOLS)),
            strip(history(&db.url, TOOLS)),
            "{backend}"
        );
    }
}

#[test]
fn a_session_holding_another_branch_of_the_file_is_left_unchanged() {
    for (backend, db) in backends() {
        // Given the branch fixture imported,
        let summary = import(&db.url, &fixture("branch"));
        let session = session_of(&summary);
        let before = feed(&db.url);
        // a version of the file whose last entry is on the other branch
        let dir = tempfile::tempdir().unwrap();
        let full = std::fs::read_to_string(fixture("branch")).unwrap();
        let other: String = full.lines().take(7).map(|l| format!("{l}\n")).collect();
        let path = dir.path().join("other-branch.jsonl");
        std::fs::write(&path, other).unwrap();
        let out = run(
            &db.url,
            &["import", "--format", "pi", path.to_str().unwrap()],
        );
        // is refused, naming the first seq that differs,
        assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!("session {session} already holds events"))
                && stderr(&out).contains("seq 4"),
            "{backend}: {}",
            stderr(&out)
        );
        // and stores nothing.
        assert_eq!(feed(&db.url), before, "{backend}");
    }
}

/// A pi file of `turns` user/assistant turns, the user text of turn `big`
/// (if any) `big_len` bytes long.
fn long_file(turns: usize, big: Option<usize>, big_len: usize) -> String {
    let mut out = String::from(
        r#"{"type":"session","version":3,"id":"long-1","timestamp":"2025-06-01T10:00:00Z","cwd":"/p"}"#,
    );
    out.push('\n');
    let mut parent = "null".to_owned();
    for t in 0..turns {
        let text = match big == Some(t) {
            true => "x".repeat(big_len),
            false => format!("turn {t}"),
        };
        let (u, a) = (format!("u{t}"), format!("a{t}"));
        out.push_str(&format!(
            r#"{{"type":"message","id":"{u}","parentId":{parent},"message":{{"role":"user","content":"{text}"}}}}"#
        ));
        out.push('\n');
        out.push_str(&format!(
            r#"{{"type":"message","id":"{a}","parentId":"{u}","message":{{"role":"assistant","content":[{{"type":"text","text":"ok {t}"}}],"stopReason":"stop"}}}}"#
        ));
        out.push('\n');
        parent = format!("\"{a}\"");
    }
    out
}

#[test]
fn a_long_file_is_judged_whole_before_its_runs_are_written() {
    for (backend, db) in backends() {
        let dir = tempfile::tempdir().unwrap();
        // 2 401 events, written in runs of 1 000; the prompt of turn
        // 1 149 (line 2 300, in the third run) is over the limit, so
        // nothing is written.
        assert!(run(&db.url, &["migrate"]).status.success());
        let bad = dir.path().join("bad.jsonl");
        std::fs::write(&bad, long_file(1_200, Some(1_149), 3_000)).unwrap();
        let before = feed(&db.url);
        let out = run(
            &db.url,
            &[
                "--max-event-bytes",
                "2000",
                "import",
                "--format",
                "pi",
                bad.to_str().unwrap(),
            ],
        );
        assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("line 2300") && stderr(&out).contains("over the limit of 2000"),
            "{backend}: {}",
            stderr(&out)
        );
        assert_eq!(feed(&db.url), before, "{backend}: nothing written");
        // The file without it imports whole, in three runs, and again as
        // nothing new.
        let good = dir.path().join("good.jsonl");
        std::fs::write(&good, long_file(1_200, None, 0)).unwrap();
        let summary = import(&db.url, good.to_str().unwrap());
        assert!(
            summary.starts_with("imported 2401 events"),
            "{backend}: {summary}"
        );
        let session = session_of(&summary);
        assert_eq!(history(&db.url, &session).len(), 2_401, "{backend}");
        let again = import(&db.url, good.to_str().unwrap());
        assert!(
            again.contains("(2401 already stored)"),
            "{backend}: {again}"
        );
    }
}

/// A pi import stopped by SIGINT between its runs says how many of the
/// file's events are stored (exit 130, as a shell says a process SIGINT
/// ended), and the same import run again stores the rest, once.
#[test]
fn an_interrupted_pi_import_says_what_is_stored_and_a_re_run_completes_it() {
    let db = common::sqlite_db();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("long.jsonl");
    std::fs::write(&file, long_file(30_000, None, 0)).unwrap();
    let session = session_store::pi::uuid_v5(session_store::pi::NAMESPACE, "long-1").to_string();
    let child = Command::new(BIN)
        .args(["--database", &db.url, "import", "--format", "pi"])
        .arg(&file)
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stored = || {
        let out = run(&db.url, &["history", &session, "--json"]);
        stdout(&out).lines().count()
    };
    // Its first run of 1 000 is stored: it is writing the others.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while stored() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    let n = stored();
    assert!(n > 0 && n < 60_001 && n % 1_000 == 0, "{n} stored");
    assert_eq!(
        stderr(&out),
        format!(
            "session-store: interrupted by SIGINT: {n} events of the file are stored in session {session}; \
             the same import run again stores the rest\n"
        )
    );
    let again = import(&db.url, file.to_str().unwrap());
    assert_eq!(
        again,
        format!(
            "imported {} events into session {session} ({n} already stored)\n",
            60_001 - n
        )
    );
    assert_eq!(stored(), 60_001);
    let out = run(&db.url, &["verify"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// An event id another session holds is refused by the store (SEMANTICS
/// §2); the import looks the file's ids up before writing its first run,
/// so a collision in the second run leaves the store unchanged, as any
/// other refusal does (docs/pi-import.md, "Errors").
#[test]
fn an_event_id_held_by_another_session_is_refused_before_any_run_is_written() {
    use session_store::pi::{uuid_v5, NAMESPACE};
    for (backend, db) in backends() {
        let dir = tempfile::tempdir().unwrap();
        // 1 201 events; the prompt of turn 550 is seq 1 102, on line 1 102,
        // in the second run of 1 000.
        let file = dir.path().join("long.jsonl");
        std::fs::write(&file, long_file(600, None, 0)).unwrap();
        let pi_session = uuid_v5(NAMESPACE, "long-1");
        let taken = uuid_v5(pi_session, "u550#0");
        let other = "88888888-2222-4333-8444-555555555555";
        let line =
            json!({"session_id": other, "event_id": taken, "type": "session_started", "mode": "x"});
        let lines = dir.path().join("other.jsonl");
        std::fs::write(&lines, format!("{line}\n")).unwrap();
        let out = run(&db.url, &["import", lines.to_str().unwrap()]);
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        let before = feed(&db.url);
        let out = run(
            &db.url,
            &["import", "--format", "pi", file.to_str().unwrap()],
        );
        assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
        let said = stderr(&out);
        assert!(
            said.contains("line 1102")
                && said.contains("pi entry \"u550\"")
                && said.contains("event-id-reused-with-other-content")
                && said.contains(&taken.to_string()),
            "{backend}: {said}"
        );
        assert_eq!(feed(&db.url), before, "{backend}: nothing written");
        let out = run(&db.url, &["history", &pi_session.to_string(), "--json"]);
        assert_eq!(stdout(&out), "", "{backend}: the pi session holds nothing");
    }
}

#[test]
fn an_entry_edited_since_its_import_is_named_as_edited() {
    for (backend, db) in backends() {
        let summary = import(&db.url, &fixture("tools"));
        let session = session_of(&summary);
        let before = feed(&db.url);
        // The first user message's text changed in place.
        let full = std::fs::read_to_string(fixture("tools")).unwrap();
        let edited = full.replacen(
            "Open an issue for the failing build",
            "Open an issue for the broken build",
            1,
        );
        assert_ne!(edited, full);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edited.jsonl");
        std::fs::write(&path, edited).unwrap();
        let out = run(
            &db.url,
            &["import", "--format", "pi", path.to_str().unwrap()],
        );
        assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!("session {session} already holds events"))
                && stderr(&out).contains("differs in content from what line 2 gives"),
            "{backend}: {}",
            stderr(&out)
        );
        assert_eq!(feed(&db.url), before, "{backend}");
    }
}

#[test]
fn a_content_block_that_is_not_an_object_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    let path = dir.path().join("f.jsonl");
    std::fs::write(
        &path,
        concat!(
            r#"{"type":"session","version":3,"id":"x1","timestamp":"2025-06-01T10:00:00Z","cwd":"/p"}"#,
            "\n",
            r#"{"type":"message","id":"e1","parentId":null,"message":{"role":"user","content":["hello",{"type":"file","name":"a.pdf"}]}}"#,
            "\n"
        ),
    )
    .unwrap();
    let out = run(&url, &["import", "--format", "pi", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("line 2") && stderr(&out).contains("message.content[0]"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_bad_file_fails_naming_line_and_field_and_changes_nothing() {
    // (file, line, text the message must contain)
    let cases = [
        ("malformed", 3, "malformed JSON"),
        // A Latin-1 byte: the line's fault, named, as the JSON lines' import
        // names it.
        ("not-utf8", 3, "the line is not UTF-8 text (byte"),
        ("no-header", 1, "missing the pi session header"),
        ("dangling-parent", 4, "field `parentId`"),
        ("duplicate-id", 4, "field `id`"),
        ("unknown-call", 5, "field `message.toolCallId`"),
        ("mistyped-is-error", 4, "field `message.isError`"),
        ("kept-unknown", 6, "field `firstKeptEntryId`"),
        // Caught by the store's own rule, reported in pi's terms.
        ("kept-result", 11, "compaction-splits-call-from-result"),
        // A version 1 file names the kept entry by its number: the field
        // said is the one the file has.
        (
            "kept-result-v1",
            5,
            "(rule compaction-splits-call-from-result) (field `firstKeptEntryIndex`)",
        ),
    ];
    for (backend, db) in backends() {
        // On an empty store, a bad file leaves it empty;
        for (name, line, text) in cases {
            let out = run(
                &db.url,
                &["import", "--format", "pi", &fixture(&format!("bad/{name}"))],
            );
            assert_eq!(
                out.status.code(),
                Some(1),
                "{backend} {name}: {}",
                stderr(&out)
            );
            let err = stderr(&out);
            assert!(
                err.contains(&format!("line {line}: ")) && err.contains(text),
                "{backend} {name}: {err}"
            );
            assert_nothing_stored(&db.url, &format!("{backend} {name}"));
        }
        // on a store holding the good session the bad files share an id
        // with, it leaves that session as it was.
        import(&db.url, &fixture("plain"));
        let before = feed(&db.url);
        for (name, line, _) in cases {
            let out = run(
                &db.url,
                &["import", "--format", "pi", &fixture(&format!("bad/{name}"))],
            );
            assert_eq!(
                out.status.code(),
                Some(1),
                "{backend} {name}: {}",
                stderr(&out)
            );
            assert!(
                stderr(&out).contains(&format!("line {line}: ")),
                "{backend} {name}: {}",
                stderr(&out)
            );
            assert_eq!(feed(&db.url), before, "{backend} {name}");
        }
    }
}

#[test]
fn the_default_format_is_still_json_lines() {
    let db = common::sqlite_db();
    // A pi file read as this store's JSON lines is rejected at line 1.
    let out = run(&db.url, &["import", &fixture("plain")]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("line 1"), "{}", stderr(&out));
    let out = run(&db.url, &["import", "--format", "yaml", &fixture("plain")]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[test]
fn a_longer_stored_session_that_differs_is_named_at_the_first_seq_that_differs() {
    for (backend, db) in backends() {
        let dir = tempfile::tempdir().unwrap();
        let full = std::fs::read_to_string(fixture("tools")).unwrap();
        let lines: Vec<&str> = full.lines().collect();
        // Stored: the file and one more entry after its leaf.
        let longer = format!(
            "{full}{}\n",
            r#"{"type":"message","id":"d000000e","parentId":"d000000d","timestamp":"2025-06-04T12:00:21.000Z","message":{"role":"assistant","content":[{"type":"text","text":"ok"}],"stopReason":"stop","timestamp":1749038421000}}"#
        );
        let path = dir.path().join("longer.jsonl");
        std::fs::write(&path, longer).unwrap();
        import(&db.url, path.to_str().unwrap());
        // The file: the same, but its last entry on another branch.
        let mut other: Vec<&str> = lines[..lines.len() - 1].to_vec();
        let alt = r#"{"type":"message","id":"d000000f","parentId":"d000000c","timestamp":"2025-06-04T12:00:22.000Z","message":{"role":"user","content":"alt","timestamp":1749038422000}}"#;
        other.push(alt);
        let path = dir.path().join("other.jsonl");
        std::fs::write(&path, other.join("\n") + "\n").unwrap();
        let out = run(
            &db.url,
            &["import", "--format", "pi", path.to_str().unwrap()],
        );
        assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("(seq 16: stored prompt_submitted"),
            "{backend}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn imports_of_a_file_and_its_longer_version_racing_each_other_are_judged_again() {
    for (backend, db) in backends() {
        let dir = tempfile::tempdir().unwrap();
        let full = std::fs::read_to_string(fixture("tools")).unwrap();
        let short: String = full.lines().take(6).map(|l| format!("{l}\n")).collect();
        let short_path = dir.path().join("short.jsonl");
        std::fs::write(&short_path, short).unwrap();
        let full_path = fixture("tools");
        let children: Vec<_> = (0..8)
            .map(|i| {
                let file = if i % 2 == 0 {
                    short_path.to_str().unwrap().to_owned()
                } else {
                    full_path.clone()
                };
                std::process::Command::new(env!("CARGO_BIN_EXE_session-store"))
                    .args(["--database", &db.url, "import", "--format", "pi", &file])
                    .env_remove("DATABASE_URL")
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        // The whole file's imports all succeed, whoever commits first. A
        // short one that comes after a whole one is refused as documented
        // (the session goes on past the file); it never blames the user
        // for the race with a partly stored batch.
        for (i, child) in children.into_iter().enumerate() {
            let out = child.wait_with_output().unwrap();
            if i % 2 == 1 || out.status.success() {
                assert!(out.status.success(), "{backend} {i}: {}", stderr(&out));
            } else {
                assert!(
                    stderr(&out).contains("the session goes on past the file's 7 events"),
                    "{backend} {i}: {}",
                    stderr(&out)
                );
            }
        }
        assert_eq!(history(&db.url, TOOLS).len(), 16, "{backend}");
    }
}

/// A file piped in is read twice like a named one (its tree, then its
/// path): through a copy, since standard input cannot be read again.
#[test]
fn a_file_on_standard_input_imports_as_the_named_file_does() {
    use std::io::Write;
    for (backend, db) in backends() {
        for name in ["branch", "compaction", "tools"] {
            let text = std::fs::read(fixture(name)).unwrap();
            let mut child = Command::new(BIN)
                .arg("--database")
                .arg(&db.url)
                .args(["import", "--format", "pi"])
                .env_remove("DATABASE_URL")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(&text).unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "{backend} {name}: {}", stderr(&out));
            let piped = feed(&db.url);
            // The named file then finds every event stored.
            let again = import(&db.url, &fixture(name));
            assert!(
                again.starts_with("imported 0 events"),
                "{backend} {name}: {again}"
            );
            assert_eq!(feed(&db.url), piped, "{backend} {name}");
            assert_eq!(
                session_of(&stdout(&out)),
                session_of(&again),
                "{backend} {name}"
            );
        }
    }
}

/// A line longer than a pi file's lines may be (64 MiB with the default
/// limit) is refused at its number without being held whole: `/dev/zero`
/// as the input grew until the allocator aborted the process. The writer
/// stops at the first write the importer no longer reads.
#[test]
fn a_line_past_the_limit_is_refused_unread() {
    use std::io::Write;
    let db = common::sqlite_db();
    let mut child = Command::new(BIN)
        .arg("--database")
        .arg(&db.url)
        .args(["import", "--format", "pi"])
        .env_remove("DATABASE_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let header = format!(
            "{}\n",
            json!({"type": "session", "version": 3, "id": "s1", "timestamp": "2026-01-01T00:00:00Z", "cwd": "/"})
        );
        stdin.write_all(header.as_bytes())?;
        let chunk = vec![b'x'; 1 << 20];
        // 200 MiB at most: far past the limit, short of a test's patience.
        for _ in 0..200 {
            stdin.write_all(&chunk)?;
        }
        Ok::<(), std::io::Error>(())
    });
    let out = child.wait_with_output().unwrap();
    let _ = writer.join().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("line 2") && stderr(&out).contains("over 67108864 bytes"),
        "{}",
        stderr(&out)
    );
    assert_nothing_stored(&db.url, "a line past the limit");
}

/// Errors are said in the order a reader of the whole file would meet
/// them, as when the file was read whole (before it was read in passes):
/// a line that is not UTF-8 anywhere, then the first bad entry, then what
/// the store would refuse; a byte order mark alone on the first line is a
/// blank line, and one before the header is skipped.
#[test]
fn errors_are_said_in_file_order_whatever_the_passes() {
    let db = common::sqlite_db();
    let dir = tempfile::tempdir().unwrap();
    let header =
        r#"{"type":"session","version":3,"id":"s2","timestamp":"2025-06-01T10:00:00.000Z"}"#;
    let user =
        r#"{"type":"message","id":"a","parentId":null,"message":{"role":"user","content":"hi"}}"#;
    let unnamed_call = r#"{"type":"message","id":"b","parentId":"a","message":{"role":"assistant","content":[{"type":"toolCall","id":"c1","name":"","arguments":{}}]}}"#;
    let weird =
        r#"{"type":"message","id":"c","parentId":"b","message":{"role":"weird","content":"x"}}"#;
    let write = |name: &str, bytes: Vec<u8>| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        // The store's rule (line 3, an empty tool name) comes after the
        // file's own error on line 4.
        (
            "judged-then-bad-entry",
            format!("{header}\n{user}\n{unnamed_call}\n{weird}\n").into_bytes(),
            Some("line 4: unknown message role"),
        ),
        // A line that is not UTF-8 is said before a bad line above it.
        (
            "bad-json-then-not-utf8",
            [
                format!("{header}\n{user}\n{{bad json\n").into_bytes(),
                b"{\"type\":\"message\",\"id\":\"b\",\"parentId\":\"a\",\"message\":{\"role\":\"user\",\"content\":\"\xff\xfe\"}}\n".to_vec(),
            ]
            .concat(),
            Some("line 4: the line is not UTF-8 text (byte 79"),
        ),
        (
            "bom-alone-first",
            format!("\u{feff}\n{header}\n{user}\n").into_bytes(),
            None,
        ),
        // Before the header, as JSON-lines import skips it; anywhere
        // else it is not JSON.
        (
            "bom-before-header",
            format!("\u{feff}{header}\n{user}\n").into_bytes(),
            None,
        ),
        (
            "bom-on-line-2",
            format!("{header}\n\u{feff}{user}\n").into_bytes(),
            Some("line 2: the line starts with a byte order mark"),
        ),
    ];
    for (name, bytes, error) in cases {
        let path = write(name, bytes);
        let out = run(&db.url, &["import", "--format", "pi", &path]);
        match error {
            Some(said) => {
                assert_eq!(out.status.code(), Some(1), "{name}: {}", stderr(&out));
                assert!(stderr(&out).contains(said), "{name}: {}", stderr(&out));
            }
            None => assert!(out.status.success(), "{name}: {}", stderr(&out)),
        }
    }
}

/// A file newer than the format this import knows is read as that format,
/// and the command says so in a sentence (not a log line), then imports.
#[test]
fn a_newer_pi_version_is_said_and_read_as_the_current_one() {
    let db = common::sqlite_db();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v4.jsonl");
    let header =
        r#"{"type":"session","version":4,"id":"s4","timestamp":"2025-06-01T10:00:00.000Z"}"#;
    let user =
        r#"{"type":"message","id":"a","parentId":null,"message":{"role":"user","content":"hi"}}"#;
    std::fs::write(&path, format!("{header}\n{user}\n")).unwrap();
    let out = run(
        &db.url,
        &["import", "--format", "pi", path.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stderr(&out).trim(),
        "session-store: the pi session file is version 4, newer than 3; it is read as version 3"
    );
    assert!(
        stdout(&out).starts_with("imported 2 events"),
        "{}",
        stdout(&out)
    );
    // Version 3 says nothing.
    let v3 = header.replace(":4,", ":3,").replace("s4", "s3");
    std::fs::write(&path, format!("{v3}\n{user}\n")).unwrap();
    let out = run(
        &db.url,
        &["import", "--format", "pi", path.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "");
}
