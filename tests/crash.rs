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

/// Four sessions' logs of `events` events each, and a file of their
/// lines interleaved for an import; the generator goes on from there.
fn import_input(seed: u64, events: usize) -> (Vec<Vec<StoredEvent>>, tempfile::NamedTempFile, Rng) {
    let logs: Vec<Vec<StoredEvent>> = (0..4)
        .map(|i| valid_log(seed + i, Uuid::new_v4(), events))
        .collect();
    let mut rng = Rng::new(seed);
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), interleaved(&logs, &mut rng)).unwrap();
    (logs, file, rng)
}

/// `program` (the binary, or a shell that runs it) told to import `file`
/// into `url`, its errors piped, its output dropped.
fn importing(mut program: Command, url: &str, file: &std::path::Path) -> Command {
    program
        .arg("--database")
        .arg(url)
        .arg("import")
        .arg(file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    program
}

fn kill_during_import(url: &str, seed: u64) {
    let (logs, file, mut rng) = import_input(seed, 1500);
    let total: usize = logs.iter().map(Vec::len).sum();
    let mut last = 0;
    let mut kills = 0;
    for round in 0..4 {
        let mut child = importing(Command::new(BIN), url, file.path())
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

/// The size of the largest of `files`, in KiB (0 when none exists).
fn largest_file_kib(files: impl IntoIterator<Item = std::path::PathBuf>) -> u64 {
    files
        .into_iter()
        .filter_map(|path| std::fs::metadata(path).ok())
        .map(|m| m.len().div_ceil(1024))
        .max()
        .unwrap_or(0)
}

/// Every file under `dir`, recursively.
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        match path.is_dir() {
            true => files.extend(files_under(&path)),
            false => files.push(path),
        }
    }
    files
}

/// A disk that fills during an import: before each of up to six runs,
/// `fill` leaves room for a few hundred KiB more than the store's files
/// hold and gives the command that runs the binary under that limit. Each
/// run stops with a sentence that `said` is part of (exit 4), never a panic
/// or a debug dump; what it left is a prefix of every session, views and
/// hash chains agreeing with the log, positions without holes, and exactly
/// the events the import said it stored. With room again the import
/// finishes, storing nothing twice. The import's runs of up to 30 lines of
/// a session make optimistic groups, whose rows go ahead of the commit on
/// SQLite (docs/design.md, "Rows sent ahead").
fn full_disk_during_import(
    url: &str,
    seed: u64,
    events: usize,
    said: &str,
    mut fill: impl FnMut(Option<u64>) -> Command,
) {
    let (logs, file, mut rng) = import_input(seed, events);
    let total: usize = logs.iter().map(Vec::len).sum();
    let (mut last, mut full) = (0, 0);
    for round in 0..6 {
        let room = 32 + rng.below(224) as u64;
        let out = importing(fill(Some(room)), url, file.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let committed = check_agreement(url, &logs);
        let (code, _, err) = cli(url, &["verify", "--integrity"]);
        assert_eq!(code, 0, "round {round}: {err}");
        assert!(committed >= last, "round {round}: events disappeared");
        if out.status.success() {
            assert_eq!(committed, total);
            break;
        }
        full += 1;
        assert_eq!(out.status.code(), Some(4), "round {round}: {stderr}");
        assert!(stderr.starts_with("session-store: "), "{stderr}");
        assert!(stderr.contains(said), "{stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("{ "),
            "{stderr}"
        );
        // The server (or SQLite, in this process) said the write failed:
        // its outcome is known, nothing of the failed run was stored.
        assert!(!stderr.contains("may or may not be stored"), "{stderr}");
        assert!(
            !stderr.contains("could not be confirmed stored"),
            "{stderr}"
        );
        // The group's failure wraps the cause once.
        assert!(
            stderr.matches("was written in failed").count() <= 1,
            "{stderr}"
        );
        // Every event the import said it stored is stored, and no other.
        let acknowledged: usize = stderr
            .rsplit_once("; the ")
            .and_then(|(_, tail)| tail.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("round {round}: no count of stored events in {stderr}"));
        assert_eq!(committed, acknowledged, "round {round}: {stderr}");
        eprintln!("round {round}, room {room} KiB: {committed} of {total} stored; {stderr}");
        last = committed;
    }
    assert!(full >= 3, "the limit stopped only {full} imports");
    let out = importing(fill(None), url, file.path()).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(check_agreement(url, &logs), total);
    let (code, _, err) = cli(url, &["verify", "--integrity"]);
    assert_eq!(code, 0, "{err}");
}

/// SQLite: the import's own process may not grow any file of the store
/// past the limit (`ulimit -f`, with `SIGXFSZ` ignored so that the write
/// fails rather than the process). A failed commit was often of an
/// optimistic group that sent rows ahead: acknowledging such a failed
/// commit (a sabotage of `commit_optimistic`'s error path) fails this test
/// in its first round.
#[test]
fn sqlite_survives_a_full_disk_during_import() {
    let db = common::sqlite_db();
    let path = std::path::PathBuf::from(db.url.trim_start_matches("sqlite://"));
    // The store exists (migrated) before the first limited run.
    let (code, _, err) = cli(&db.url, &["migrate"]);
    assert_eq!(code, 0, "{err}");
    let store_files = || {
        ["", "-wal", "-shm"].map(|suffix| {
            let mut file = path.as_os_str().to_owned();
            file.push(suffix);
            std::path::PathBuf::from(file)
        })
    };
    full_disk_during_import(
        &db.url,
        31,
        1500,
        "storage unavailable: disk I/O error",
        |room| {
            let Some(room) = room else {
                return Command::new(BIN);
            };
            let limit = largest_file_kib(store_files()) + room;
            let mut c = Command::new("bash");
            c.args([
                "-c",
                r#"trap '' XFSZ; ulimit -f "$1"; shift; exec "$@""#,
                "bash",
            ])
            .arg(limit.to_string())
            .arg(BIN);
            c
        },
    );
}

/// SQLite: a disk that fills while a new store is migrated. Each attempt
/// of the migration now runs on a connection of its own and only a race
/// is tried again: before, a later attempt on the pool "succeeded" inside
/// a transaction never committed, so `migrate` said "migrations applied"
/// with migrations 9 and 10 not on disk (a limit of 200 KiB), or the
/// command failed on "no such table: chain_backfill" (40 KiB). Now each
/// says the storage's failure at once, and with room again the store
/// migrates and verifies.
#[test]
fn sqlite_says_a_full_disk_during_its_migration() {
    for room in [40, 200] {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().join("m.db").display().to_string();
        let out = Command::new("bash")
            .args([
                "-c",
                r#"trap '' XFSZ; ulimit -f "$1"; shift; exec "$@""#,
                "bash",
            ])
            .arg(room.to_string())
            .args([BIN, "--database", &url, "migrate"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(4), "{room} KiB: {err}");
        assert!(
            err.starts_with(
                "session-store: storage unavailable: migrating the SQLite database failed"
            ),
            "{room} KiB: {err}"
        );
        let (code, said, err) = cli(&url, &["migrate"]);
        assert_eq!(code, 0, "{room} KiB: {err}");
        // Created or upgraded from where the full disk stopped it.
        assert!(
            said.starts_with("created the schema: migration ")
                || said.starts_with("upgraded the schema from migration "),
            "{said}"
        );
        let (code, _, err) = cli(&url, &["import"]);
        assert_eq!(code, 0, "{room} KiB: {err}");
        let (code, _, err) = cli(&url, &["verify", "--integrity"]);
        assert_eq!(code, 0, "{room} KiB: {err}");
    }
}

/// PostgreSQL: the server is restarted before each run under a limit a few
/// hundred KiB past its largest table file (WAL segments of 1 MiB, which
/// fit), so the statement that extends a table fails, inside the
/// optimistic call of `session_store_append` or the locked path's write.
#[test]
fn postgres_survives_a_full_disk_during_import() {
    let Some(bin) = common::pg_bin() else {
        return;
    };
    let options = session_store::pgtemp::PgTempOptions {
        fsync: false,
        wal_segment_mib: Some(1),
        ..Default::default()
    };
    let mut server = common::PgServer::start(&bin, options).unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let (code, _, err) = cli(&url, &["migrate"]);
    assert_eq!(code, 0, "{err}");
    let base = server.dir.join("data/base");
    full_disk_during_import(&url, 41, 3000, "could not extend file", |room| {
        let limit = room.map(|room| largest_file_kib(files_under(&base)).max(1024) + room);
        server.stop();
        server.set_file_size_limit_kib(limit);
        server.launch().unwrap_or_else(|e| panic!("{e}"));
        Command::new(BIN)
    });
}
