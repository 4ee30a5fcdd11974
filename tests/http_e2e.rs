//! End to end with real processes: one PostgreSQL, two `session-store
//! serve` instances on it. A client appends a `ToolSearch` result through
//! instance A and reads the activation set and the stream through
//! instance B; tenants stay apart across instances; SIGTERM shuts both
//! down cleanly. Also: `serve` refuses to run without tokens on a public
//! address, and says why.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use uuid::Uuid;

const TOKENS: &str = r#"{"tokens": [
  {"token": "e2e-tenant-a-token-0001", "tenant": "a", "scopes": ["read", "write"]},
  {"token": "e2e-tenant-b-token-0001", "tenant": "b", "scopes": ["read", "write"]}
]}"#;
const A: &str = "e2e-tenant-a-token-0001";
const B: &str = "e2e-tenant-b-token-0001";

struct Instance {
    child: Child,
    base: String,
}

impl Instance {
    /// Starts `serve` on a free port and waits for its "listening on" line.
    fn start(database: &str) -> Instance {
        let mut child = Command::new(env!("CARGO_BIN_EXE_session-store"))
            .args(["--database", database, "serve", "--listen", "127.0.0.1:0"])
            .env("SESSION_STORE_TOKENS", TOKENS)
            .env_remove("SESSION_STORE_TOKENS_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read the listening line");
        let base = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_owned();
        assert!(line.contains("PostgreSQL store"), "{line}");
        assert!(
            !line.contains("e2e-tenant"),
            "tokens are never printed: {line}"
        );
        Instance { child, base }
    }

    /// SIGTERM, then the exit status.
    fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        for _ in 0..100 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        panic!("serve did not exit within 10 s of SIGTERM");
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads the stream until an `activations` event lists `tool`; returns
/// every `event:` name seen with its id.
async fn read_until_active(response: reqwest::Response, tool: &str) -> Vec<(String, String)> {
    let mut response = response;
    let mut text = String::new();
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let chunk = tokio::time::timeout_at(deadline, response.chunk())
            .await
            .expect("the activation set arrives on the stream in time")
            .expect("the stream reads")
            .expect("the stream stays open");
        text.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = text.find("\n\n") {
            let block: String = text.drain(..end + 2).collect();
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .unwrap_or_default()
                    .to_owned()
            };
            let (kind, id, data) = (field("event: "), field("id: "), field("data: "));
            if kind.is_empty() {
                continue;
            }
            seen.push((kind.clone(), id));
            if kind == "activations" {
                let v: Value = serde_json::from_str(&data).unwrap();
                if v["tools"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|t| t["name"] == tool)
                {
                    return seen;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_postgres() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let mut a = Instance::start(&db.url);
    let b = Instance::start(&db.url);
    let client = reqwest::Client::new();
    let id = Uuid::new_v4();

    // A stream needs an existing session: create it through A.
    let start = json!({"expected_seq": 0, "events": [
        {"type": "session_started", "mode": "code"},
        {"type": "catalog_defined", "mode": "code", "deferred_tools": ["web_fetch", "sql_query"]},
        {"type": "prompt_submitted", "text": "what does the page say?"}
    ]});
    let r = client
        .post(format!("{}/v1/sessions/{id}/events", a.base))
        .bearer_auth(A)
        .json(&start)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);

    // B's stream, opened before the search happens.
    let stream = client
        .get(format!("{}/v1/sessions/{id}/stream", b.base))
        .bearer_auth(A)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);

    // The search, through A.
    let search = json!({"expected_seq": 3, "events": [
        {"type": "tool_call", "call_id": "s1", "tool_name": "ToolSearch", "input": {"query": "fetch a page"}},
        {"type": "tool_result", "call_id": "s1", "tool_name": "ToolSearch", "status": "success",
         "added_tool_names": ["web_fetch"], "output": "web_fetch: fetches a URL"},
        {"type": "prompt_submitted", "text": "go on"}
    ]});
    let r = client
        .post(format!("{}/v1/sessions/{id}/events", a.base))
        .bearer_auth(A)
        .json(&search)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let appended: Value = r.json().await.unwrap();
    assert_eq!(appended["events"][1]["seq"], 5);

    // B's stream sees the events and the new activation set.
    let seen = read_until_active(stream, "web_fetch").await;
    assert!(
        seen.contains(&("event".to_owned(), "5".to_owned())),
        "{seen:?}"
    );
    assert_eq!(
        seen.last().unwrap(),
        &("activations".to_owned(), "6".to_owned())
    );

    // B answers the activation set A's append produced.
    let r = client
        .get(format!("{}/v1/sessions/{id}/activations", b.base))
        .bearer_auth(A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"session_id": id, "as_of_seq": 6, "mode": "code",
               "tools": [{"name": "web_fetch", "evidence_seq": 5}]})
    );

    // A writer on B with a stale seq gets 409 and where to retry from.
    let r = client
        .post(format!("{}/v1/sessions/{id}/events", b.base))
        .bearer_auth(A)
        .json(
            &json!({"expected_seq": 3, "events": [{"type": "assistant_message", "text": "late"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["current_seq"], 6);

    // Tenant b sees nothing of a's session on either instance.
    for base in [&a.base, &b.base] {
        let r = client
            .get(format!("{base}/v1/sessions/{id}/recover"))
            .bearer_auth(B)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
        let r = client
            .get(format!("{base}/v1/sessions/{id}/recover"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
    }

    // SIGHUP (an operator's "reload") is ignored, not a way down: by
    // default it ended the process at once, without the graceful
    // shutdown.
    let pid = a.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(a.child.try_wait().unwrap().is_none(), "SIGHUP ended serve");
    let r = client
        .get(format!("{}/healthz", a.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // Both shut down cleanly on SIGTERM.
    assert!(a.stop().success());
    assert!(b.stop().success());
}

#[test]
fn serve_refuses_a_public_address_without_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("s.db");
    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .arg("--database")
        .arg(&db)
        .args(["serve", "--listen", "0.0.0.0:0"])
        .env_remove("SESSION_STORE_TOKENS")
        .env_remove("SESSION_STORE_TOKENS_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to serve 0.0.0.0:0 without tokens"),
        "{err}"
    );
    assert!(err.contains("--insecure"), "{err}");

    // A bad token document is refused with the reason, naming its source.
    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .arg("--database")
        .arg(&db)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env(
            "SESSION_STORE_TOKENS",
            r#"{"tokens": [{"token": "short", "tenant": "a", "scopes": ["read"]}]}"#,
        )
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SESSION_STORE_TOKENS"), "{err}");
    assert!(err.contains("at least 16 characters"), "{err}");
    assert!(
        !err.contains("short\""),
        "the token itself is not echoed: {err}"
    );

    // A token file variable set to nothing is a usage error that names the
    // variable (a template's empty value), not only the flag.
    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .arg("--database")
        .arg(&db)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env_remove("SESSION_STORE_TOKENS")
        .env("SESSION_STORE_TOKENS_FILE", "")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SESSION_STORE_TOKENS_FILE"), "{err}");
    assert!(err.contains("empty"), "{err}");

    // So is the document's variable set to nothing (or blanks): taken as
    // unset, it served without authentication.
    for empty in ["", "  \n"] {
        let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
            .arg("--database")
            .arg(&db)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env("SESSION_STORE_TOKENS", empty)
            .env_remove("SESSION_STORE_TOKENS_FILE")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{empty:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("SESSION_STORE_TOKENS is set but empty"),
            "{err}"
        );
    }

    // A token file an editor began with a byte order mark is read as its
    // document (here one whose token is too short, said as that, not as
    // text that is not JSON).
    let file = dir.path().join("tokens.json");
    std::fs::write(
        &file,
        "\u{feff}{\"tokens\": [{\"token\": \"short\", \"tenant\": \"a\", \"scopes\": [\"read\"]}]}",
    )
    .unwrap();
    let serve_with_the_file = || {
        Command::new(env!("CARGO_BIN_EXE_session-store"))
            .arg("--database")
            .arg(&db)
            .args(["serve", "--listen", "127.0.0.1:0", "--tokens"])
            .arg(&file)
            .env_remove("SESSION_STORE_TOKENS")
            .env_remove("SESSION_STORE_TOKENS_FILE")
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let out = serve_with_the_file();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at least 16 characters"), "{err}");
    // A token file every user may read is said; one of its owner's alone
    // is not.
    use std::os::unix::fs::PermissionsExt;
    for (mode, warned) in [(0o644, true), (0o600, false)] {
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = serve_with_the_file();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            err.contains("the token file can be read by every user of this machine"),
            warned,
            "{mode:o}: {err}"
        );
    }
}

/// `serve` of the SQLite store `db` with `args` and no tokens (killed when
/// dropped, so a failed assertion leaves no server behind), and the first
/// line it printed.
fn serve_without_tokens(db: &std::path::Path, args: &[&str]) -> (Instance, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .arg("--database")
        .arg(db)
        .arg("serve")
        .args(args)
        .env_remove("SESSION_STORE_TOKENS")
        .env_remove("SESSION_STORE_TOKENS_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let child = Instance {
        child,
        base: String::new(),
    };
    (child, line)
}

/// `--listen` takes a host name as well as an IP (resolved once, to a
/// loopback address for `localhost`, so no tokens are needed), and an
/// address that is neither is a usage error naming the flag and the value.
#[test]
fn serve_listens_on_a_host_name() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("s.db");
    let (child, line) = serve_without_tokens(&db, &["--listen", "localhost:0"]);
    drop(child);
    assert!(
        line.starts_with("listening on http://127.0.0.1:")
            || line.starts_with("listening on http://[::1]:"),
        "{line}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .arg("--database")
        .arg(&db)
        .args(["serve", "--listen", "localhost"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(r#""localhost" is not an address to listen on (IP:PORT or HOST:PORT)"#),
        "{err}"
    );

    // A body limit of 0 would refuse every append: refused by name.
    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .arg("--database")
        .arg(&db)
        .args(["serve", "--listen", "127.0.0.1:0", "--body-limit", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--body-limit") && err.contains("at least 1"),
        "{err}"
    );
}

/// `--state-cache-memory` bounds what the server's cached session states
/// hold: appends to sessions of about 400 KB each, past a budget of 1 MiB,
/// leave at most that cached, and `/metrics` counts the states dropped.
/// Below 1 MiB the flag is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_keeps_its_states_within_state_cache_memory() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("s.db");
    let (child, line) = serve_without_tokens(
        &db,
        &["--listen", "127.0.0.1:0", "--state-cache-memory", "1048576"],
    );
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    let client = reqwest::Client::new();
    let text = "w".repeat(400_000);
    for _ in 0..6 {
        let batch = json!({"expected_seq": 0, "events": [
            {"type": "session_started", "mode": "code"},
            {"type": "prompt_submitted", "text": text}
        ]});
        let r = client
            .post(format!("{base}/v1/sessions/{}/events", Uuid::new_v4()))
            .json(&batch)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
    }
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    drop(child);
    let figure = |name: &str| -> u64 {
        let prefix = format!("session_store_{name}{{cache=\"rows\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("no {prefix} in {metrics}"))
            .parse()
            .unwrap()
    };
    let bytes = figure("state_cache_bytes");
    assert!(
        (800_000..=1_048_576).contains(&bytes),
        "{bytes} bytes cached"
    );
    assert_eq!(figure("state_cache_sessions"), 2);
    assert_eq!(figure("state_cache_evictions_total"), 4);

    let out = Command::new(env!("CARGO_BIN_EXE_session-store"))
        .arg("--database")
        .arg(&db)
        .args(["serve", "--state-cache-memory", "1000"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--state-cache-memory"), "{err}");
}
