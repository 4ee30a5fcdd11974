//! Restart recovery under SIGKILL (issue: materialized view): kill the
//! store's process at random points of a long import, reopen, and check that
//! the log, the views and the recovered state agree with a fold of exactly
//! what was committed, on both backends.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::gen::{import_lines, valid_log, Rng};
use serde_json::Value;
use session_store::{SessionState, StoredEvent};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_session-store");

fn cli(url: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .arg("--database")
        .arg(url)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Lines of several sessions, interleaved in runs of a few lines, so the
/// import commits many small batches.
fn interleaved(logs: &[Vec<StoredEvent>], rng: &mut Rng) -> String {
    let mut cursors = vec![0usize; logs.len()];
    let mut out = String::new();
    while cursors.iter().zip(logs).any(|(c, l)| *c < l.len()) {
        let i = rng.below(logs.len());
        let run = 1 + rng.below(30);
        let end = (cursors[i] + run).min(logs[i].len());
        out.push_str(&import_lines(&logs[i][cursors[i]..end]));
        cursors[i] = end;
    }
    out
}

fn stored(url: &str, session: Uuid) -> Vec<StoredEvent> {
    let (code, out, _) = cli(url, &["history", &session.to_string(), "--json"]);
    if code != 0 {
        return Vec::new();
    }
    out.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let mut body = v.clone();
            for k in ["session_id", "seq", "event_id", "position", "recorded_at"] {
                body.as_object_mut().unwrap().remove(k);
            }
            StoredEvent {
                session_id: session,
                seq: v["seq"].as_i64().unwrap(),
                event_id: v["event_id"].as_str().unwrap().parse().unwrap(),
                position: v["position"].as_i64().unwrap(),
                recorded_at: chrono::Utc::now(),
                body: session_store::EventBody::from_json_text(&body.to_string()).unwrap(),
            }
        })
        .collect()
}

fn check_agreement(url: &str, logs: &[Vec<StoredEvent>]) -> usize {
    let (code, _, err) = cli(url, &["verify"]);
    assert_eq!(code, 0, "verify after a kill: {err}");
    let mut committed = 0;
    for log in logs {
        let session = log[0].session_id;
        let got = stored(url, session);
        committed += got.len();
        // Exactly a prefix of what was sent, in order, nothing twice.
        for (g, want) in got.iter().zip(log) {
            assert_eq!((g.event_id, &g.body), (want.event_id, &want.body));
        }
        assert!(got.len() <= log.len());
        if got.is_empty() {
            continue;
        }
        let fold = SessionState::fold(session, &got);
        let (code, out, err) = cli(url, &["recover", &session.to_string(), "--json"]);
        assert_eq!(code, 0, "{err}");
        let r: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(r["latest_seq"], got.len() as i64);
        assert_eq!(r["mode"], fold.mode.as_str());
        assert_eq!(r["context_start_seq"], fold.window_start);
        assert_eq!(
            r["catalog"],
            serde_json::to_value(fold.current_catalog()).unwrap()
        );
        assert_eq!(
            r["tools"],
            serde_json::to_value(fold.activation_set()).unwrap()
        );
        assert_eq!(
            r["summary"],
            serde_json::to_value(fold.compaction.as_ref().map(|c| c.0.clone())).unwrap()
        );
    }
    committed
}

fn kill_during_import(url: &str, seed: u64) {
    let logs: Vec<Vec<StoredEvent>> = (0..4)
        .map(|i| valid_log(seed + i, Uuid::new_v4(), 1500))
        .collect();
    let total: usize = logs.iter().map(Vec::len).sum();
    let mut rng = Rng::new(seed);
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), interleaved(&logs, &mut rng)).unwrap();
    let mut last = 0;
    let mut kills = 0;
    for round in 0..4 {
        let mut child = Command::new(BIN)
            .arg("--database")
            .arg(url)
            .arg("import")
            .arg(file.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(150 + rng.below(600) as u64));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            kills += 1;
        }
        let status = child.wait().unwrap();
        let committed = check_agreement(url, &logs);
        assert!(committed >= last, "round {round}: events disappeared");
        last = committed;
        if status.success() {
            break;
        }
    }
    // Finish the import; the re-runs stored nothing twice.
    let (code, _, err) = cli(url, &["import", file.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_agreement(url, &logs), total);
    eprintln!("{kills} kills, {total} events");
}

#[test]
fn sqlite_survives_sigkill_during_import() {
    let db = common::sqlite_db();
    kill_during_import(&db.url, 7);
}

#[test]
fn postgres_survives_sigkill_during_import() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    kill_during_import(&db.url, 11);
}
