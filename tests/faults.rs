//! Many instances on PostgreSQL (and SQLite where it applies): global order
//! under held-open transactions, notifications (latency, and nothing lost
//! when the listener's connection is killed), a server stopped mid-load, and
//! a writer killed between commit and reply.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use session_store::{Error, EventBody, NewEvent, RetryPolicy, Store, StoreOptions, ToolStatus};
use uuid::Uuid;

fn started() -> NewEvent {
    NewEvent::new(EventBody::SessionStarted {
        mode: "agent".into(),
        metadata: None,
    })
}

fn prompt(t: &str) -> NewEvent {
    NewEvent::new(EventBody::PromptSubmitted { text: t.into() })
}

/// A writer takes positions and sleeps before commit while another writer
/// tries to commit past it: the reader paging by position never skips the
/// first writer's events.
async fn reader_never_skips_a_slow_commit(url: &str) {
    let slow = Store::open_with(
        url,
        StoreOptions {
            fault_pause_before_commit: Some(Duration::from_millis(800)),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let fast = Store::open(url).await.unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    fast.append(a, 0, vec![started()]).await.unwrap();
    fast.append(b, 0, vec![started()]).await.unwrap();
    let start = fast
        .feed(0, 100_000)
        .await
        .unwrap()
        .last()
        .unwrap()
        .position;

    let reader_url = url.to_owned();
    let reader = tokio::spawn(async move {
        let store = Store::open(&reader_url).await.unwrap();
        let mut after = start;
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(4);
        while Instant::now() < deadline && seen.len() < 4 {
            for e in store.feed(after, 100).await.unwrap() {
                after = e.position;
                seen.push((e.position, e.session_id));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen
    });
    let slow_began = Instant::now();
    let slow_task = tokio::spawn(async move {
        slow.append(a, 1, vec![prompt("slow 1"), prompt("slow 2")])
            .await
            .unwrap();
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    fast.append(b, 1, vec![prompt("fast 1"), prompt("fast 2")])
        .await
        .unwrap();
    let fast_done = Instant::now();
    slow_task.await.unwrap();
    let seen = reader.await.unwrap();
    // Everything was seen, in position order, dense, nothing skipped.
    let positions: Vec<i64> = seen.iter().map(|s| s.0).collect();
    assert_eq!(
        positions,
        (start + 1..=start + 4).collect::<Vec<_>>(),
        "{seen:?}"
    );
    // The slow writer held the lower positions; the fast one waited for its
    // commit, 800 ms after it began. (Compared with when the slow task got
    // its answer, the test raced the task's wake-up on a busy machine.)
    assert_eq!(seen[0].1, a);
    assert!(
        fast_done >= slow_began + Duration::from_millis(750),
        "the fast append finished {:?} after the slow one began",
        fast_done - slow_began
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_reader_never_skips_a_slow_commit() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    reader_never_skips_a_slow_commit(&db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reader_never_skips_a_slow_commit() {
    let db = common::sqlite_db();
    reader_never_skips_a_slow_commit(&db.url).await;
}

/// Instance B learns of an activation appended through instance A, and
/// still sees every event after its listening connection is killed.
async fn notifications_reach_another_instance(url: &str, kill: bool) -> Vec<Duration> {
    let a = Store::open(url).await.unwrap();
    let b = Arc::new(Store::open(url).await.unwrap());
    let s = Uuid::new_v4();
    a.append(
        s,
        0,
        vec![
            started(),
            NewEvent::new(EventBody::CatalogDefined {
                mode: "agent".into(),
                deferred_tools: vec!["web_fetch".into()],
            }),
        ],
    )
    .await
    .unwrap();
    let from = a.feed(0, 100_000).await.unwrap().last().unwrap().position + 1;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let b2 = b.clone();
    let follower = tokio::spawn(async move {
        let mut sub = b2.subscribe(from).await.unwrap();
        loop {
            let batch = sub.next_batch().await.unwrap();
            let now = Instant::now();
            for e in batch {
                if tx.send((e, now)).is_err() {
                    return;
                }
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut latencies = Vec::new();
    let mut received = Vec::new();
    let mut seq = 2;
    for round in 0..20 {
        if kill && round == 10 {
            let admin = sqlx::PgPool::connect(url).await.unwrap();
            let killed: Vec<(bool,)> = sqlx::query_as(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = 'session-store listener' AND pid <> pg_backend_pid()",
            )
            .fetch_all(&admin)
            .await
            .unwrap();
            assert!(!killed.is_empty(), "no listener connection found to kill");
            // Events appended while B is reconnecting.
            for i in 0..3 {
                a.append(s, seq, vec![prompt(&format!("during {i}"))])
                    .await
                    .unwrap();
                seq += 1;
            }
        }
        let call = format!("c{round}");
        let sent = Instant::now();
        a.append(
            s,
            seq,
            vec![
                NewEvent::new(EventBody::ToolCall {
                    call_id: call.clone(),
                    tool_name: "ToolSearch".into(),
                    input: serde_json::json!(null),
                }),
                NewEvent::new(EventBody::ToolResult {
                    call_id: call,
                    tool_name: "ToolSearch".into(),
                    status: ToolStatus::Success,
                    output: None,
                    added_tool_names: Some(vec!["web_fetch".into()]),
                }),
            ],
        )
        .await
        .unwrap();
        seq += 2;
        // Wait until B has seen the result.
        loop {
            let (e, at) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("B learned of the event within 10 s")
                .unwrap();
            received.push(e.seq);
            if e.seq == seq {
                latencies.push(at.saturating_duration_since(sent));
                break;
            }
        }
    }
    // B saw every event of the session exactly once, in order, including
    // those appended while its listener was being reconnected.
    assert_eq!(received, (3..=seq).collect::<Vec<_>>());
    follower.abort();
    // B saw every event exactly once, in order: compare with the log.
    let got = b
        .wait_past(s, seq - 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(got, Some(seq));
    latencies.sort();
    latencies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_notifications_survive_a_killed_listener() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let lat = notifications_reach_another_instance(&db.url, true).await;
    eprintln!(
        "PostgreSQL notification latency: median {:?}, max {:?}",
        lat[lat.len() / 2],
        lat[lat.len() - 1]
    );
    assert!(lat[lat.len() / 2] < Duration::from_secs(1));
}

/// A listening connection that stops answering without a word (its
/// backend stopped, as a firewall's dropped connection looks) brings no
/// notification and no error: it is found by a ping and replaced, and the
/// waiters read again within seconds, not at their 10 s safety read (a
/// review measured 9.4 s before the ping).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_listener_that_stops_answering_is_replaced() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let store = Store::open(&db.url).await.unwrap();
    let other = Store::open(&db.url).await.unwrap();
    let s = Uuid::new_v4();
    store.append(s, 0, vec![started()]).await.unwrap();
    let mut watch = store.watch().await.unwrap();
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    let pid: i32 = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'session-store listener' \
         AND datname = current_database()",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let started_at = Instant::now();
    let appending = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        other
            .append(s, 1, vec![prompt("while the listener is stopped")])
            .await
    };
    let (head, appended) = tokio::join!(
        tokio::time::timeout(
            Duration::from_secs(20),
            watch.wait_past(s, 1, Duration::MAX)
        ),
        appending
    );
    let waited = started_at.elapsed();
    // A new listening connection while the old one is still stopped: the
    // one given up on holds its pool's connection (sqlx's drop of a
    // listener waits for its `UNLISTEN` on it), and a listener that shared
    // that pool never came (the waiters were woken each second instead).
    let mut replaced = None;
    for _ in 0..100 {
        replaced = sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'session-store listener' \
             AND datname = current_database() AND pid <> $1",
        )
        .bind(pid)
        .fetch_optional(&admin)
        .await
        .unwrap();
        if replaced.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let relistened = started_at.elapsed();
    signal("-CONT");
    appended.unwrap();
    assert_eq!(head.expect("woken").unwrap(), Some(2));
    assert!(waited < Duration::from_secs(7), "woken after {waited:?}");
    assert!(
        replaced.is_some(),
        "no new listening connection {relistened:?} after the old one stopped"
    );
    // And it listens: an append is seen through it.
    other
        .append(s, 2, vec![prompt("after the new listener")])
        .await
        .unwrap();
    let head = tokio::time::timeout(Duration::from_secs(5), watch.wait_past(s, 2, Duration::MAX))
        .await
        .expect("woken by the new listener");
    assert_eq!(head.unwrap(), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_subscribers_poll_promptly() {
    let db = common::sqlite_db();
    let lat = notifications_reach_another_instance(&db.url, false).await;
    eprintln!(
        "SQLite polling latency: median {:?}, max {:?}",
        lat[lat.len() / 2],
        lat[lat.len() - 1]
    );
    assert!(lat[lat.len() / 2] < Duration::from_secs(1));
}

/// The test owns its PostgreSQL: stopped in the middle of a load and started
/// again, appends in flight fail with a retryable error, the writers'
/// retries (same event ids) succeed, nothing is lost or duplicated.
/// A throw-away PostgreSQL server of the test's own, which it may stop and
/// start; `None` where the test cannot run: a shared server was given
/// (`TEST_DATABASE_URL`), or no PostgreSQL binaries (never under CI=true).
fn own_server() -> Option<common::PgServer> {
    if std::env::var("TEST_DATABASE_URL").is_ok() {
        eprintln!("this test needs its own server; it runs when TEST_DATABASE_URL is unset");
        return None;
    }
    common::pg_bin().map(|bin| common::start_pg_server(&bin))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_in_the_middle_of_a_load_loses_nothing() {
    let Some(server) = own_server() else { return };
    let server = Arc::new(server);
    let url = server.url();
    let store = Arc::new(Store::open(&url).await.unwrap());
    let sessions: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    for s in &sessions {
        store.append(*s, 0, vec![started()]).await.unwrap();
    }
    // Writers keep writing until the server is back, so some append is
    // always in flight while it is down, however fast or slow this machine.
    let restarted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for (w, s) in sessions.iter().copied().enumerate() {
        let store = store.clone();
        let restarted = restarted.clone();
        writers.push(tokio::spawn(async move {
            let policy = RetryPolicy {
                max_attempts: 400,
                initial_backoff: Duration::from_millis(20),
                max_backoff: Duration::from_millis(200),
                max_unavailable: Duration::from_secs(120),
            };
            let mut ids = Vec::new();
            let mut retryable_errors = 0;
            let mut slowest = Duration::ZERO;
            let mut i = 0;
            while i < 60 || !restarted.load(std::sync::atomic::Ordering::SeqCst) {
                i += 1;
                let started = Instant::now();
                let batch: Vec<NewEvent> = (0..2)
                    .map(|k| prompt(&format!("w{w} {i}.{k}")).with_id(Uuid::new_v4()))
                    .collect();
                // One try by hand, to see the error a writer sees...
                let head = store.head_seq(s).await.unwrap_or(-1);
                match store.append(s, head, batch.clone()).await {
                    Ok(_) => {}
                    Err(e) => {
                        assert!(e.is_retryable(), "not retryable: {e}");
                        retryable_errors += 1;
                        // ...then the retrying helper, with the same ids.
                        store
                            .append_at_head(s, batch.clone(), &policy)
                            .await
                            .unwrap();
                    }
                }
                ids.extend(batch.iter().map(|e| e.event_id.unwrap()));
                slowest = slowest.max(started.elapsed());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (ids, retryable_errors, slowest)
        }));
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let s2 = server.clone();
    tokio::task::spawn_blocking(move || {
        s2.stop();
        std::thread::sleep(Duration::from_millis(1500));
        s2.launch().unwrap();
    })
    .await
    .unwrap();
    restarted.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut errors = 0;
    let mut slowest = Duration::ZERO;
    for (w, writer) in writers.into_iter().enumerate() {
        let (ids, retryable, slow) = writer.await.unwrap();
        errors += retryable;
        slowest = slowest.max(slow);
        let events = store.history(sessions[w], 0, 10_000).await.unwrap();
        let stored: Vec<Uuid> = events.iter().skip(1).map(|e| e.event_id).collect();
        assert_eq!(
            stored, ids,
            "writer {w}: every acknowledged event once, in order"
        );
        assert_eq!(store.verify(sessions[w]).await.unwrap(), None);
    }
    // The writers felt the restart: an append in flight failed, or a
    // read or append that met the stopped server waited for it to come
    // back (a read that meets a broken connection is tried again, and a
    // new connection is waited for up to the connection timeout).
    assert!(
        errors > 0 || slowest >= Duration::from_secs(1),
        "the restart should have failed some appends or held some writer up: \
         {errors} failed, the slowest turn took {slowest:?}"
    );
    eprintln!(
        "{errors} appends failed with a retryable error during the restart and were retried; \
         the slowest writer's turn took {slowest:?}"
    );
    // With the server down for good, the retry bound is reached and the
    // error says so, naming the last failure.
    server.stop();
    let policy = RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(20),
        ..RetryPolicy::default()
    };
    let err = store
        .append_at_head(sessions[0], vec![prompt("after the end")], &policy)
        .await
        .unwrap_err();
    match &err {
        Error::RetriesExhausted { attempts, last, .. } => {
            // Three attempts, or two when the ten seconds of
            // `max_unavailable` end it first: an attempt that meets a dead
            // pooled connection fails at once, one that pings it first
            // (a connection failure was seen) waits the 5 s connection
            // timeout for a new one, as the others do.
            assert!((2..=3).contains(attempts), "{attempts} attempts");
            // Unavailable, or OutcomeUnknown when the first attempt sent
            // its one call on a connection the stop then cut (it cannot
            // tell whether the server had it).
            assert!(
                matches!(**last, Error::Unavailable(_) | Error::OutcomeUnknown(_)),
                "{last:?}"
            );
        }
        other => panic!("expected RetriesExhausted, got {other:?}"),
    }
    assert!(
        err.to_string().starts_with("gave up appending to session"),
        "{err}"
    );
}

/// A writer killed (SIGKILL) between commit and reply retries its batch and
/// gets the idempotent answer.
fn killed_between_commit_and_reply(url: &str) {
    let bin = env!("CARGO_BIN_EXE_session-store");
    let s = Uuid::new_v4().to_string();
    let lines = format!(
        "{{\"event_id\":\"{}\",\"type\":\"session_started\",\"mode\":\"agent\"}}\n{{\"event_id\":\"{}\",\"type\":\"prompt_submitted\",\"text\":\"hi\"}}\n",
        Uuid::new_v4(),
        Uuid::new_v4()
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &lines).unwrap();
    let mut child = std::process::Command::new(bin)
        .args(["--database", url, "append", &s, "--expected-seq", "0"])
        .arg(file.path())
        .env("SESSION_STORE_FAULT_PAUSE_AFTER_COMMIT_MS", "5000")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the commit to be visible, then kill before the reply.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = std::process::Command::new(bin)
            .args(["--database", url, "history", &s, "--json"])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&out.stdout).lines().count() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the append never committed");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.stdout.is_empty(), "the reply was lost");
    let retry = std::process::Command::new(bin)
        .args(["--database", url, "append", &s, "--expected-seq", "0"])
        .arg(file.path())
        .output()
        .unwrap();
    assert!(
        retry.status.success(),
        "{}",
        String::from_utf8_lossy(&retry.stderr)
    );
    let seqs: Vec<i64> = String::from_utf8_lossy(&retry.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, vec![1, 2]);
    let out = std::process::Command::new(bin)
        .args(["--database", url, "history", &s, "--json"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        2,
        "nothing twice"
    );
}

#[test]
fn sqlite_writer_killed_between_commit_and_reply_gets_the_idempotent_answer() {
    let db = common::sqlite_db();
    killed_between_commit_and_reply(&db.url);
}

#[test]
fn postgres_writer_killed_between_commit_and_reply_gets_the_idempotent_answer() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    killed_between_commit_and_reply(&db.url);
}

#[test]
fn postgres_tail_follow_outlives_a_server_restart() {
    let Some(server) = own_server() else { return };
    let url = server.url();
    let store_bin = env!("CARGO_BIN_EXE_session-store");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Uuid::new_v4();
    rt.block_on(async {
        let store = Store::open(&url).await.unwrap();
        store.append(s, 0, vec![started()]).await.unwrap();
        store.close().await;
    });
    let mut tail = std::process::Command::new(store_bin)
        .args(["--database", &url, "tail", "--follow", "--json"])
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = tail.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .take(2)
            .map(|l| l.unwrap())
            .collect::<Vec<_>>()
    });
    std::thread::sleep(Duration::from_millis(500));
    server.stop();
    // Longer than the store's 5 s connect timeout, so that the follower's
    // reads fail as unavailable rather than wait the outage out.
    std::thread::sleep(Duration::from_millis(7000));
    assert!(
        tail.try_wait().unwrap().is_none(),
        "tail --follow exited while the server was down"
    );
    server.launch().unwrap();
    rt.block_on(async {
        let store = Store::open(&url).await.unwrap();
        store
            .append(s, 1, vec![prompt("after the restart")])
            .await
            .unwrap();
        store.close().await;
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !reader.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = tail.kill();
    let _ = tail.wait();
    let lines = reader.join().unwrap();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[1].contains("after the restart"), "{lines:?}");
    // The outage was said, each time once, as a sentence (not also as a
    // log line).
    let mut said = String::new();
    std::io::Read::read_to_string(&mut tail.stderr.take().unwrap(), &mut said).unwrap();
    assert!(
        said.contains("waiting and reading on after position 1"),
        "{said}"
    );
    assert!(
        said.lines().all(|l| l.starts_with("session-store: ")),
        "{said}"
    );
}

/// An append waiting for the counter's lock is cancelled (as a lock or
/// statement timeout would end it): the connection must not go back to
/// the pool inside the aborted transaction, where every later statement
/// on it fails with "current transaction is aborted" until the server's
/// idle-in-transaction timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_cancelled_wait_for_the_counter_leaves_no_aborted_connection() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let store = Arc::new(Store::open(&db.url).await.unwrap());
    let session = Uuid::new_v4();
    store.append(session, 0, vec![started()]).await.unwrap();
    let holder = sqlx::PgPool::connect(&db.url).await.unwrap();
    let mut lock = holder.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM event_position WHERE id = 1 FOR UPDATE")
        .execute(&mut *lock)
        .await
        .unwrap();
    // A new session: the group takes the lock (no optimistic path).
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move { store.append(Uuid::new_v4(), 0, vec![started()]).await })
    };
    let waiter = loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%event_position%' AND pid <> pg_backend_pid()",
        )
        .fetch_optional(&holder)
        .await
        .unwrap();
        if let Some(pid) = pid {
            break pid;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    sqlx::query("SELECT pg_cancel_backend($1)")
        .bind(waiter)
        .execute(&holder)
        .await
        .unwrap();
    let cancelled = waiting.await.unwrap();
    assert!(cancelled.is_err(), "{cancelled:?}");
    lock.rollback().await.unwrap();
    // Every connection of the pool is fit for use again.
    let mut seq = 1;
    for i in 0..30 {
        let r = store
            .append(session, seq, vec![prompt(&format!("p{i}"))])
            .await;
        let r = r.unwrap_or_else(|e| panic!("append {i} after the cancel: {e}"));
        seq = r.events.last().unwrap().seq;
        store
            .context(session, None)
            .await
            .unwrap_or_else(|e| panic!("read {i} after the cancel: {e}"));
        let other = Uuid::new_v4();
        store
            .append(other, 0, vec![started()])
            .await
            .unwrap_or_else(|e| panic!("new session {i} after the cancel: {e}"));
    }
    let aborted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction (aborted)'",
    )
    .fetch_one(&holder)
    .await
    .unwrap();
    assert_eq!(aborted, 0);
}

/// A caller that gives up on an append or a read while its `BEGIN` is in
/// flight (a timeout around the library's future) must not leave that
/// connection in the pool inside a transaction: appends acknowledged on it
/// later were never committed (lost when it closed) and held the position
/// counter's lock, every writer waiting behind it (a cancellation review's
/// finding; sqlx queues no rollback for a `BEGIN` it has no answer to).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_caller_that_gives_up_during_begin_leaves_no_open_transaction() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let store = Store::open(&db.url).await.unwrap();
    let monitor = sqlx::PgPool::connect(&db.url).await.unwrap();
    let stuck = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%' \
             AND now() - state_change > interval '10 ms'",
        )
        .fetch_one(&monitor)
        .await
        .unwrap()
    };
    // A session whose appends then take the one-call path (its state is
    // cached): the call that ran inside a left-open transaction.
    let warm = Uuid::new_v4();
    store.append(warm, 0, vec![started()]).await.unwrap();
    let past = Uuid::new_v4();
    store
        .append(past, 0, vec![started(), prompt("a"), prompt("b")])
        .await
        .unwrap();
    // The span to give up within: up to the time a whole call takes here
    // (a debug build's is several times a release build's).
    let t = Instant::now();
    store
        .append(Uuid::new_v4(), 0, vec![started()])
        .await
        .unwrap();
    store.activations(past, Some(2)).await.unwrap();
    let span = (t.elapsed().as_micros() as u64).clamp(1500, 20_000);
    let mut given_up = 0;
    for round in 0..6u64 {
        // New sessions (the locked path, which starts with `BEGIN`) and
        // reads as of a past seq (a read-only transaction), given up after
        // 0 to 1.5 ms.
        for step in 0..60u64 {
            let micros = span * step / 60 + round * 7;
            let limit = Duration::from_micros(micros);
            let gave_up = if step % 2 == 0 {
                tokio::time::timeout(limit, store.append(Uuid::new_v4(), 0, vec![started()]))
                    .await
                    .is_err()
            } else {
                tokio::time::timeout(limit, store.activations(past, Some(2)))
                    .await
                    .is_err()
            };
            if gave_up {
                given_up += 1;
                // Looked for at once: the next `BEGIN` on a connection
                // left so would end its transaction, hiding it.
                tokio::time::sleep(Duration::from_millis(20)).await;
                assert_eq!(
                    stuck().await,
                    0,
                    "given up after {micros} µs: a connection was left in a transaction"
                );
            }
        }
    }
    assert!(given_up > 0, "no call was given up on");
    // Every acknowledged append is stored, and none waits for a lock.
    let mut acknowledged = Vec::new();
    let mut head = 1;
    for i in 0..20 {
        let event = prompt(&format!("after {i}")).with_id(Uuid::now_v7());
        let id = event.event_id.unwrap();
        let started_at = Instant::now();
        let done = store.append(warm, head, vec![event]).await.unwrap();
        assert!(
            started_at.elapsed() < Duration::from_secs(5),
            "append {i} waited"
        );
        head = done.events[0].seq;
        acknowledged.push(id);
    }
    store.close().await;
    let again = Store::open(&db.url).await.unwrap();
    assert_eq!(again.stored_events(&acknowledged).await.unwrap().len(), 20);
    assert_eq!(again.head_seq(warm).await.unwrap(), 21);
}

/// With the server gone for good, an append that retries says so within
/// about `max_unavailable` (and one more attempt's connection timeout),
/// not after every attempt has waited out its own timeout (20 × 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retries_give_up_on_a_server_that_stays_down_within_seconds() {
    let Some(server) = own_server() else { return };
    let store = Store::open(&server.url()).await.unwrap();
    let session = Uuid::new_v4();
    store.append(session, 0, vec![started()]).await.unwrap();
    server.stop();
    let start = Instant::now();
    let r = store
        .append_at_head(session, vec![prompt("after")], &RetryPolicy::default())
        .await;
    let took = start.elapsed();
    match r {
        Err(Error::RetriesExhausted { last, attempts, .. }) => {
            // (OutcomeUnknown: the first attempt's call went out on a
            // connection the stop cut, as above.)
            assert!(
                matches!(*last, Error::Unavailable(_) | Error::OutcomeUnknown(_)),
                "{last}"
            );
            assert!(attempts < 20, "{attempts} attempts");
        }
        other => panic!("{other:?}"),
    }
    assert!(took < Duration::from_secs(20), "gave up after {took:?}");
}

/// An optimistic append that finds no connection to send its call on (the
/// server stopped, the pooled connection's ping failed, no new one within
/// the connect timeout) sent nothing: it is said not stored
/// (`Unavailable`), not of unknown outcome, so the caller may retry it
/// without an event id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_optimistic_append_without_a_connection_is_said_not_stored() {
    let Some(server) = own_server() else { return };
    let store = Store::open_with(
        &server.url(),
        StoreOptions {
            connect_timeout_secs: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let session = Uuid::new_v4();
    store.append(session, 0, vec![started()]).await.unwrap();
    server.stop();
    // Idle past the pool's trust (one second): the connection is pinged
    // before it is handed out, and the ping finds the server gone.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let start = Instant::now();
    match store.append(session, 1, vec![prompt("after")]).await {
        Err(Error::Unavailable(why)) => assert!(!why.contains("may or may not"), "{why}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    server.launch().unwrap();
    let reopened = Store::open(&server.url()).await.unwrap();
    assert_eq!(
        reopened.head_seq(session).await.unwrap(),
        1,
        "nothing more stored"
    );
}

/// An import whose storage goes away names the lines it could not store
/// (where a re-run resumes) beside the count of those it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_import_cut_off_names_the_lines_not_stored() {
    let Some(server) = own_server() else { return };
    let store = Store::open(&server.url()).await.unwrap();
    let session = Uuid::new_v4();
    let lines = import_lines(session);
    // The server stops once the first run of 500 lines is stored and the
    // second is being read.
    let input = lines.into_iter().enumerate().map(|(i, l)| {
        if i == 700 {
            server.stop();
        }
        Ok((i + 1, l))
    });
    let err = session_store::cli::import(&store, input, 1 << 20)
        .await
        .unwrap_err();
    let said = err.to_string();
    assert_eq!(err.exit_code(), 4, "{said}");
    let not_stored = names_second_run(&said, session);
    assert!(
        said.contains("storage unavailable")
            && said.ends_with("the 500 events before it are stored"),
        "{said}"
    );
    server.launch().unwrap();
    let stored = Store::open(&server.url())
        .await
        .unwrap()
        .history(session, 0, 1_000)
        .await
        .unwrap();
    if not_stored {
        assert_eq!(stored.len(), 500, "said not stored: {said}");
    }
}

/// Whether `said` names lines 501–1000 of `session` as not stored (the
/// storage said nothing was) rather than as not confirmed stored (a commit
/// may have gone through unseen); fails if it names them otherwise.
fn names_second_run(said: &str, session: Uuid) -> bool {
    let run = format!("lines 501–1000 (session {session}) ");
    let rest = said.strip_prefix(&run).unwrap_or_else(|| panic!("{said}"));
    if rest.starts_with("were not stored: ") {
        assert!(!said.contains("may or may not"), "{said}");
        true
    } else {
        assert!(
            rest.starts_with("could not be confirmed stored: ") && said.contains("may or may not"),
            "{said}"
        );
        false
    }
}

/// The postmaster's and its children's pids, for signals.
fn server_pids(server: &common::PgServer) -> Vec<String> {
    let pid_file = std::fs::read_to_string(server.dir.join("data/postmaster.pid")).unwrap();
    let postmaster = pid_file.lines().next().unwrap().trim().to_owned();
    let mut pids = vec![postmaster.clone()];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // "pid (comm) state ppid …": the comm may hold spaces and parens.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1));
        if ppid == Some(postmaster.as_str()) {
            pids.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    pids
}

/// Continues a stopped server whatever the test's outcome.
struct Continue(Vec<String>);

/// Stops the server (SIGSTOP to the postmaster and its children: the
/// kernel still acknowledges their packets) until the guard is dropped.
fn stop(server: &common::PgServer) -> Continue {
    let pids = server_pids(server);
    let status = std::process::Command::new("kill")
        .arg("-STOP")
        .args(&pids)
        .status()
        .unwrap();
    assert!(status.success());
    Continue(pids)
}

impl Drop for Continue {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .arg("-CONT")
            .args(&self.0)
            .status();
    }
}

/// A server that stops answering in the middle of an import (SIGSTOP: the
/// kernel still acknowledges its packets, so no connection error ever
/// comes) is said within seconds (SEMANTICS §9: exit 4), naming the lines
/// not (confirmed) stored, instead of being waited on until it resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_server_that_stops_answering_mid_import_is_said_within_seconds() {
    let Some(server) = own_server() else { return };
    let options = session_store::StoreOptions {
        write_deadline: Some(Duration::from_secs(2)),
        ..Default::default()
    };
    let store = Store::open_with(&server.url(), options).await.unwrap();
    let session = Uuid::new_v4();
    let lines = import_lines(session);
    // The server stops once the first run of 500 lines is stored.
    let mut stopped = None;
    let input = lines.into_iter().enumerate().map(|(i, l)| {
        if i == 700 {
            stopped = Some(stop(&server));
        }
        Ok((i + 1, l))
    });
    let started = std::time::Instant::now();
    let err = session_store::cli::import(&store, input, 1 << 20)
        .await
        .unwrap_err();
    let took = started.elapsed();
    drop(stopped);
    let said = err.to_string();
    assert_eq!(err.exit_code(), 4, "{said}");
    let not_stored = names_second_run(&said, session);
    assert!(said.contains("within 2 s"), "{said}");
    assert!(took < Duration::from_secs(20), "said after {took:?}");
    // Resumed, the server has the first run, and the second whole or not
    // at all: it was said as not confirmed because the one-call append of
    // a cached session may already sit in the stopped server's socket,
    // which runs it on resuming (a CI run saw 1 000), while the locked
    // path's statements wait for answers and never reach COMMIT.
    let stored = store.history(session, 0, 1_000).await.unwrap();
    assert!(
        stored.len() == 500 || stored.len() == 1_000,
        "{} events stored: a run is stored whole or not at all",
        stored.len()
    );
    if not_stored {
        assert_eq!(stored.len(), 500, "said not stored: {said}");
    }
    assert!(stored.iter().zip(1..).all(|(e, seq)| e.seq == seq));
}

/// 1 000 import lines of one session: a start and 999 prompts (two runs of
/// 500 for `import`).
fn import_lines(session: Uuid) -> Vec<String> {
    let mut lines = vec![format!(
        r#"{{"session_id":"{session}","type":"session_started","mode":"a"}}"#
    )];
    for i in 1..1_000 {
        lines.push(format!(
            r#"{{"session_id":"{session}","type":"prompt_submitted","text":"p{i}"}}"#
        ));
    }
    lines
}

/// How long a read took, and its error (a read of a stopped server must
/// fail).
async fn failed_read<T: std::fmt::Debug>(
    read: impl std::future::Future<Output = session_store::Result<T>>,
) -> (Error, Duration) {
    let started = Instant::now();
    let err = read.await.expect_err("a read of a stopped server answered");
    (err, started.elapsed())
}

/// A server that stops answering while the store is open and connected
/// (SIGSTOP: the kernel still acknowledges its packets, so no connection
/// error ever comes): each read is said as unavailable within seconds
/// (SEMANTICS §9: exit 4), instead of being waited on until the server
/// resumes; the pre-request read, a page, a fold (`verify`, `explain`)
/// and an audit query alike. Resumed, the same store reads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_reads_of_a_server_that_stops_answering_are_said_within_seconds() {
    let Some(server) = own_server() else { return };
    let options = StoreOptions {
        read_deadline: Some(Duration::from_secs(2)),
        ..Default::default()
    };
    let store = Store::open_with(&server.url(), options).await.unwrap();
    let session = Uuid::new_v4();
    store
        .append(session, 0, vec![started(), prompt("a"), prompt("b")])
        .await
        .unwrap();
    store.clear_cache();
    let resume = stop(&server);
    let said = vec![
        (
            "activations",
            failed_read(store.activations(session, None)).await,
        ),
        ("history", failed_read(store.history(session, 0, 100)).await),
        ("verify", failed_read(store.verify(session)).await),
        (
            "explain",
            failed_read(store.explain(session, "web_fetch", session_store::audit::At::Latest))
                .await,
        ),
        (
            "audit events",
            failed_read(store.audit_events(&session_store::store::query::EventQuery::default()))
                .await,
        ),
        // A write transaction's round trips are bounded the same way.
        ("rebuild", failed_read(store.rebuild(session)).await),
    ];
    drop(resume);
    for (read, (err, took)) in said {
        assert!(
            matches!(err, Error::Unavailable(_)),
            "{read}: {err:?} after {took:?}"
        );
        // 2 s of the read's deadline; the pool may first wait up to its
        // 5 s for a connection whose ping got no answer.
        assert!(
            took < Duration::from_secs(10),
            "{read} said after {took:?}: {err}"
        );
    }
    let active = store.activations(session, None).await.unwrap();
    assert_eq!(active.as_of_seq, 3);
    assert_eq!(store.verify(session).await.unwrap(), None);
}

/// The CLI says a server that stops answering in the middle of a long
/// read within `--read-timeout` (exit 4), here `export` of a 20 000-event
/// session stopped after its first lines: each page is a round trip of its
/// own, bounded, and closing the store does not wait for the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cli_export_cut_off_mid_stream_exits_4_within_its_read_timeout() {
    use std::io::{BufRead, Read};
    let Some(server) = own_server() else { return };
    let store = Store::open(&server.url()).await.unwrap();
    let session = Uuid::new_v4();
    let mut seq = 0;
    for chunk in 0..20 {
        let mut batch: Vec<NewEvent> = (0..1_000)
            .map(|i| prompt(&format!("p{chunk}-{i}")))
            .collect();
        if chunk == 0 {
            batch[0] = started();
        }
        store.append(session, seq, batch).await.unwrap();
        seq += 1_000;
    }
    store.close().await;
    let mut export = std::process::Command::new(env!("CARGO_BIN_EXE_session-store"))
        .args(["--database", &server.url(), "--read-timeout", "2", "export"])
        .arg(session.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(export.stdout.take().unwrap()).lines();
    for _ in 0..1_000 {
        lines.next().unwrap().unwrap();
    }
    let resume = stop(&server);
    let stopped = Instant::now();
    let rest = lines.count();
    let code = export.wait().unwrap().code();
    let took = stopped.elapsed();
    drop(resume);
    let mut said = String::new();
    export
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    assert_eq!(code, Some(4), "{said}");
    assert!(
        rest < 19_000,
        "{rest} more lines: the export was not cut off"
    );
    assert!(
        said.contains("PostgreSQL did not answer within 2 s"),
        "{said}"
    );
    // 2 s for the read, and the close after it does not wait for the
    // connection the server left unanswered.
    assert!(took < Duration::from_secs(6), "said after {took:?}: {said}");
}

/// Waiting behind another writer for the position counter is healthy: the
/// server bounds it (`lock_timeout`, 10 s), and `read_deadline` bounds a
/// round trip on top of that, so an append behind a 4 s lock succeeds
/// with a 2 s deadline.
#[test]
fn postgres_an_append_behind_a_held_lock_is_not_cut_off_by_the_read_deadline() {
    use sqlx::Connection;
    let Some(db) = common::postgres_db() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let options = StoreOptions {
            read_deadline: Some(Duration::from_secs(2)),
            ..Default::default()
        };
        let store = Store::open_with(&db.url, options).await.unwrap();
        let session = Uuid::new_v4();
        store.append(session, 0, vec![started()]).await.unwrap();
        let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
        let hold = sqlx::raw_sql(
            "BEGIN; SELECT 1 FROM event_position WHERE id = 1 FOR UPDATE; \
             SELECT pg_sleep(4); COMMIT;",
        )
        .execute(&mut holder);
        let behind = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            // Cold, the append takes the locked path (`begin_write`), not
            // the optimistic call.
            store.clear_cache();
            let started_at = Instant::now();
            store
                .append(session, 1, vec![prompt("behind")])
                .await
                .unwrap();
            started_at.elapsed()
        };
        let (held, waited) = tokio::join!(hold, behind);
        held.unwrap();
        assert!(
            waited > Duration::from_secs(2),
            "the lock was not held: {waited:?}"
        );
        store.close().await;
    });
}

/// Instances queued behind a stuck holder of the position counter each
/// give up after `lock_timeout` (10 s), not after the waiters ahead of
/// them: PostgreSQL times each lock wait on its own, and a second waiter
/// for a row first waits for the first waiter (its tuple lock), then for
/// the holder, so a bare `lock_timeout` let the second instance in line
/// wait 20 s and the third 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_instances_queued_for_a_stuck_counter_each_wait_one_lock_timeout() {
    use sqlx::Connection;
    let Some(db) = common::postgres_db() else {
        return;
    };
    let stores = [
        Store::open(&db.url).await.unwrap(),
        Store::open(&db.url).await.unwrap(),
        Store::open(&db.url).await.unwrap(),
    ];
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT 1 FROM event_position WHERE id = 1 FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let wait = |i: usize| {
        let store = &stores[i];
        async move {
            // In line one after the other, each on its own connection.
            tokio::time::sleep(Duration::from_millis(300 * i as u64)).await;
            let started_at = Instant::now();
            // A new session: the locked path (`begin_write`).
            let r = store.append(Uuid::new_v4(), 0, vec![started()]).await;
            (r, started_at.elapsed())
        }
    };
    let (a, b, c) = tokio::join!(wait(0), wait(1), wait(2));
    let waits = [a, b, c];
    for (i, (r, waited)) in waits.iter().enumerate() {
        let e = r.as_ref().expect_err("appended past a held counter");
        assert!(matches!(e, Error::Unavailable(_)), "{i}: {e:?}");
        assert!(
            e.to_string().contains("lock"),
            "{i}: the cause is not named: {e}"
        );
        assert!(
            *waited >= Duration::from_secs(9) && *waited < Duration::from_secs(13),
            "writer {i} waited {waited:?}"
        );
    }
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    // The counter free, every store appends again.
    for store in &stores {
        store
            .append(Uuid::new_v4(), 0, vec![started()])
            .await
            .unwrap();
        store.close().await;
    }
}

/// A migration changed since it was applied is refused at open, on
/// PostgreSQL as on SQLite: the open's quick check compares checksums too.
#[test]
fn postgres_a_modified_migration_is_refused_at_open() {
    use sqlx::Connection;
    let Some(db) = common::postgres_db() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        Store::open(&db.url).await.unwrap().close().await;
        let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
        sqlx::raw_sql(
            "UPDATE _sqlx_migrations SET checksum = '\\x00' \
             WHERE version = (SELECT MAX(version) FROM _sqlx_migrations)",
        )
        .execute(&mut c)
        .await
        .unwrap();
        let err = match Store::open(&db.url).await {
            Ok(_) => panic!("a modified migration was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("modified"), "{err}");
    });
}

/// An attempt that may have committed unseen stays said when the retries
/// after it find the server gone: `RetriesExhausted`'s `last` is
/// `OutcomeUnknown`, not the later attempts' `Unavailable` (which says
/// nothing was stored, and the first attempt's batch is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retries_after_an_unknown_outcome_keep_it_unknown() {
    let Some(server) = own_server() else { return };
    let url = server.url();
    Store::open(&url)
        .await
        .unwrap()
        .append(Uuid::nil(), 0, vec![started()])
        .await
        .unwrap();
    // The commit goes through, then the append waits past its deadline:
    // its outcome is unknown to the caller. (The deadline is longer than
    // the connection timeout, so that a later attempt can find the server
    // gone before its deadline says it cannot tell.)
    let store = Store::open_with(
        &url,
        StoreOptions {
            fault_pause_after_commit: Some(Duration::from_secs(4)),
            write_deadline: Some(Duration::from_secs(2)),
            connect_timeout_secs: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let server = std::sync::Arc::new(server);
    let stopper = {
        let server = server.clone();
        let url = url.clone();
        tokio::spawn(async move {
            // Once the first attempt's event is stored, the server goes.
            let reader = Store::open(&url).await.unwrap();
            while reader.head_seq(Uuid::nil()).await.unwrap() < 2 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            drop(reader);
            tokio::task::spawn_blocking(move || server.stop())
                .await
                .unwrap();
        })
    };
    let policy = RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_secs(2),
        max_backoff: Duration::from_secs(2),
        ..RetryPolicy::default()
    };
    let err = store
        .append_at_head(Uuid::nil(), vec![prompt("stored unseen")], &policy)
        .await
        .unwrap_err();
    stopper.await.unwrap();
    match &err {
        Error::RetriesExhausted { attempts, last, .. } => {
            assert!(*attempts >= 2, "{attempts} attempts");
            match &**last {
                Error::OutcomeUnknown(why) => assert!(
                    why.contains("did not finish the append")
                        && why.contains("a later attempt found the storage unavailable"),
                    "{why}"
                ),
                other => panic!("expected OutcomeUnknown, got {other:?}"),
            }
        }
        other => panic!("expected RetriesExhausted, got {other:?}"),
    }
    server.launch().unwrap();
    let log = Store::open(&url)
        .await
        .unwrap()
        .history(Uuid::nil(), 0, 10)
        .await
        .unwrap();
    assert_eq!(log.len(), 2, "the first attempt's event is stored, once");
}

/// A server that holds every commit (it waits for a synchronous standby
/// that does not exist) does not hold the one-call optimistic append
/// forever: the call is bounded by `read_deadline` and the lock timeout,
/// and answers `OutcomeUnknown` (the commit is in the server's hands:
/// once released, the event is stored, once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_optimistic_append_whose_commit_is_held_is_cut_off() {
    let Some(server) = own_server() else { return };
    let url = server.url();
    let store = Store::open_with(
        &url,
        StoreOptions {
            read_deadline: Some(Duration::from_secs(1)),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let session = Uuid::new_v4();
    store.append(session, 0, vec![started()]).await.unwrap();
    store
        .append(session, 1, vec![prompt("cached")])
        .await
        .unwrap();
    let before = store.append_paths();
    assert!(before.optimistic >= 1, "{before:?}");
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let set = |sql: &'static str| {
        let admin = admin.clone();
        async move {
            sqlx::query(sql).execute(&admin).await.unwrap();
            sqlx::query("SELECT pg_reload_conf()")
                .execute(&admin)
                .await
                .unwrap();
        }
    };
    sqlx::query("CREATE TABLE IF NOT EXISTS probe (x int)")
        .execute(&admin)
        .await
        .unwrap();
    set("ALTER SYSTEM SET synchronous_standby_names = 'nobody'").await;
    // The server holds commits once its checkpointer has read the new
    // setting: wait until a probe's commit is held (it stays held, and
    // goes through with the append's when the setting is reset).
    let mut held_probe = false;
    for _ in 0..100 {
        // A connection of its own: one left waiting must not go back to
        // the pool that resets the setting.
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
            .await
            .unwrap();
        let probe = sqlx::query("INSERT INTO probe VALUES (1)").execute(&mut conn);
        if tokio::time::timeout(Duration::from_millis(300), probe)
            .await
            .is_err()
        {
            held_probe = true;
            break;
        }
    }
    assert!(held_probe, "the server never held a commit");
    let start = Instant::now();
    let held = tokio::time::timeout(
        Duration::from_secs(40),
        store.append(session, 2, vec![prompt("held")]),
    )
    .await;
    let took = start.elapsed();
    set("ALTER SYSTEM RESET synchronous_standby_names").await;
    match held {
        Ok(Err(Error::OutcomeUnknown(why))) => {
            assert!(
                why.contains("did not answer the append within 11 s"),
                "{why}"
            )
        }
        Ok(other) => panic!("expected OutcomeUnknown, got {other:?}"),
        Err(_) => panic!("the append was still waiting after {took:?}"),
    }
    assert!(took < Duration::from_secs(20), "cut off after {took:?}");
    assert_eq!(
        store.append_paths().optimistic,
        before.optimistic + 1,
        "the one-call path was the one held"
    );
    // Released, the held commit went through: the event is stored once,
    // and a retry with its seq conflicts rather than storing it again.
    let mut log = Vec::new();
    for _ in 0..50 {
        log = store.history(session, 0, 10).await.unwrap();
        if log.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(log.len(), 3, "{log:?}");
}

/// An instance that waits for another one's migration (the store's
/// migration lock held elsewhere, here by the test's own connection) asks
/// for the lock every 200 ms; a server that stops answering meanwhile is
/// said within `--read-timeout`, exit 4, as for any read, instead of being
/// waited on until the kernel gives up on the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_waiting_for_another_instances_migration_is_bounded_by_the_read_timeout() {
    use sqlx::Connection;
    use std::io::Read;
    let Some(server) = own_server() else { return };
    // A new database: every migration is pending, so the opening waits
    // for the lock. The key is the store's (`MIGRATION_LOCK`,
    // src/store/postgres.rs).
    let mut holder = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(0x5353_4d49_4752_4154_i64)
        .fetch_one(&mut holder)
        .await
        .unwrap();
    assert!(held);
    let mut migrate = std::process::Command::new(env!("CARGO_BIN_EXE_session-store"))
        .args([
            "--database",
            &server.url(),
            "--read-timeout",
            "2",
            "migrate",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Polling for the lock (it never gets it while the test holds it).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        migrate.try_wait().unwrap().is_none(),
        "migrate did not wait"
    );
    let resume = stop(&server);
    let stopped = Instant::now();
    let mut code = None;
    while stopped.elapsed() < Duration::from_secs(20) {
        if let Some(status) = migrate.try_wait().unwrap() {
            code = status.code();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = stopped.elapsed();
    drop(resume);
    if code.is_none() {
        let _ = migrate.kill();
        let _ = migrate.wait();
    }
    let mut said = String::new();
    migrate
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    assert_eq!(code, Some(4), "after {took:?}: {said}");
    assert!(
        said.contains("PostgreSQL did not answer within 2 s"),
        "{said}"
    );
    assert!(took < Duration::from_secs(6), "said after {took:?}: {said}");
    // Released, the migration goes through.
    drop(holder);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_session-store"))
        .args(["--database", &server.url(), "migrate"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A server restarted right after every pooled connection was used leaves
/// them all dead, each trusted for a second (`TRUSTED_IDLE`): the first
/// read that meets one fails on it, and is read again on a connection the
/// pool pings or opens (a read changes nothing), so no read fails; the
/// pool then pings the other connections opened before the failure
/// instead of failing a request on each of them. Each kind of read (a
/// statement of its own, a stream of rows, a read transaction, an audit
/// query) is the first after a restart of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_restart_fails_no_read() {
    let Some(server) = own_server() else { return };
    let store = Arc::new(Store::open(&server.url()).await.unwrap());
    let s = Uuid::new_v4();
    store.append(s, 0, vec![started()]).await.unwrap();
    store
        .append(s, 1, vec![prompt("before the restarts")])
        .await
        .unwrap();
    let kinds = [
        "head",
        "history",
        "context",
        "activations",
        "owner",
        "audit events",
    ];
    for kind in kinds {
        // Every pooled connection opened and just used.
        let readers: Vec<_> = (0..12)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    for _ in 0..30 {
                        store.history(s, 0, 10).await.unwrap();
                    }
                })
            })
            .collect();
        for r in readers {
            r.await.unwrap();
        }
        server.stop();
        server.launch().unwrap();
        // Nothing this process cached answers for the database.
        store.clear_cache();
        let read = match kind {
            "head" => store.head_seq(s).await.map(|h| assert_eq!(h, 2)),
            "history" => store
                .history(s, 0, 10)
                .await
                .map(|page| assert_eq!(page.len(), 2)),
            "context" => store
                .context(s, None)
                .await
                .map(|c| assert_eq!(c.as_of_seq, 2)),
            "activations" => store
                .activations(s, None)
                .await
                .map(|a| assert_eq!(a.as_of_seq, 2)),
            "owner" => store
                .session_owner(s)
                .await
                .map(|o| assert_eq!(o.as_deref(), Some("default"))),
            _ => store
                .audit_events(&session_store::store::query::EventQuery::default())
                .await
                .map(|page| assert_eq!(page.events.len(), 2)),
        };
        if let Err(e) = read {
            panic!("the first read ({kind}) after a restart failed: {e}");
        }
        let mut failed = Vec::new();
        for i in 0..12 {
            if let Err(e) = store.history(s, 0, 10).await {
                failed.push(format!("{i}: {e}"));
            }
        }
        assert!(
            failed.is_empty(),
            "reads after the restart ({kind} first) that failed: {failed:?}"
        );
    }
    // Appends too go through healthy connections.
    let head = store.head_seq(s).await.unwrap();
    store
        .append(s, head, vec![prompt("after the restarts")])
        .await
        .unwrap();
    assert_eq!(store.head_seq(s).await.unwrap(), head + 1);
}

/// With PostgreSQL down, a read is answered `Unavailable` after one
/// connection timeout (5 s), whether it meets a dead pooled connection at
/// once (used within the last second) or after the pool's ping: it is
/// tried again only when its own statement met the broken connection,
/// and then the second try's wait is the only one. The first version of
/// that retry read any failure of the process (the pool's pings, its
/// failed attempts) as the read's, and `serve`'s reads and `/readyz` took
/// 10 s during an outage (an adversarial review's finding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_read_during_an_outage_waits_one_connection_timeout() {
    let Some(server) = own_server() else { return };
    let store = Store::open(&server.url()).await.unwrap();
    let s = Uuid::new_v4();
    store.append(s, 0, vec![started()]).await.unwrap();
    for idle in [Duration::ZERO, Duration::from_millis(1_200)] {
        // Connections used just now, then left idle for `idle`.
        store.history(s, 0, 10).await.unwrap();
        server.stop();
        tokio::time::sleep(idle).await;
        for read in 0..2 {
            store.clear_cache();
            let start = Instant::now();
            let said = store.head_seq(s).await;
            let took = start.elapsed();
            assert!(
                matches!(said, Err(Error::Unavailable(_))),
                "idle {idle:?}, read {read}: {said:?}"
            );
            assert!(
                took < Duration::from_secs(8),
                "idle {idle:?}, read {read}: answered after {took:?}, more than one connection timeout (5 s)"
            );
        }
        server.launch().unwrap();
    }
}

/// A connection the server refuses (class 28: here a role that may no
/// longer log in; a changed password or pg_hba's `reject` are the same
/// class) is the storage being unavailable, retryable, for reads and
/// appends: the pool of a running store met it when it opened a new
/// connection, and `serve` answered 500 `internal` (an adversarial
/// review's finding; the CLI, which connects at start, said exit 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_refused_login_is_unavailable_not_a_server_error() {
    let Some(server) = own_server() else { return };
    let admin = sqlx::PgPool::connect(&server.url()).await.unwrap();
    for sql in ["CREATE ROLE app LOGIN", "CREATE DATABASE appdb OWNER app"] {
        sqlx::raw_sql(sql).execute(&admin).await.unwrap();
    }
    let url = server
        .url()
        .replace("postgres@", "app@")
        .replace("/postgres", "/appdb");
    let store = Store::open(&url).await.unwrap();
    let s = Uuid::new_v4();
    store.append(s, 0, vec![started()]).await.unwrap();
    sqlx::raw_sql("ALTER ROLE app NOLOGIN")
        .execute(&admin)
        .await
        .unwrap();
    sqlx::raw_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'app'")
        .execute(&admin)
        .await
        .unwrap();
    // Past the trusted second: each pooled connection is pinged, found
    // cut, and a new one refused.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    store.clear_cache();
    let read = store.head_seq(s).await;
    assert!(
        matches!(&read, Err(Error::Unavailable(m)) if m.contains("not permitted to log in")),
        "{read:?}"
    );
    let append = store.append(s, 1, vec![prompt("refused")]).await;
    assert!(matches!(&append, Err(Error::Unavailable(_))), "{append:?}");
    assert!(append.unwrap_err().is_retryable());
    // Allowed again, the same store goes on.
    sqlx::raw_sql("ALTER ROLE app LOGIN")
        .execute(&admin)
        .await
        .unwrap();
    store.append(s, 1, vec![prompt("allowed")]).await.unwrap();
    assert_eq!(store.head_seq(s).await.unwrap(), 2);
}

/// With PostgreSQL down, an append that arrives while another waits for a
/// connection is answered with that one's failure, not after a connection
/// timeout of its own on top (10 s instead of 5, found by a review of
/// `serve` during an outage); nothing of either is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_appends_queued_during_an_outage_wait_one_connection_timeout() {
    let Some(server) = own_server() else { return };
    let store = Arc::new(Store::open(&server.url()).await.unwrap());
    let sessions: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    for s in &sessions {
        store.append(*s, 0, vec![started()]).await.unwrap();
    }
    server.stop();
    // Let the pooled connections go idle past the trusted second, so each
    // is pinged (and found dead) rather than failing a call at once.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut appends = Vec::new();
    for (i, s) in sessions.iter().copied().enumerate() {
        let store = store.clone();
        appends.push(tokio::spawn(async move {
            let start = Instant::now();
            let result = store
                .append(s, 1, vec![prompt(&format!("during the outage {i}"))])
                .await;
            (start.elapsed(), result)
        }));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut waits = Vec::new();
    for a in appends {
        let (waited, result) = a.await.unwrap();
        match result {
            Err(Error::Unavailable(_)) => {}
            other => panic!("expected Unavailable, got {other:?}"),
        }
        waits.push(waited);
    }
    assert!(
        waits.iter().all(|w| *w < Duration::from_secs(8)),
        "each append waits one connection timeout (5 s) at most, with margin: {waits:?}"
    );
    server.launch().unwrap();
    for s in &sessions {
        assert_eq!(store.head_seq(*s).await.unwrap(), 1, "nothing stored");
    }
}

/// A transaction's `BEGIN` given up on at its deadline while the server is
/// stopped still runs when the server resumes. Its connection must not go
/// back into use inside that transaction: a review saw an instance answer
/// every third request with "current transaction is aborted" after such a
/// stop, and writes run inside a leftover read-only transaction; a
/// one-call append (this process wrote the session last) run inside a
/// leftover transaction would be answered as stored and never committed.
/// Resumed, the same store appends first (one call each) and reads at
/// once, no connection of the server is left idle in a transaction, and a
/// fresh store reads every append.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_begin_given_up_on_leaves_no_transaction_behind() {
    let Some(server) = own_server() else { return };
    let options = StoreOptions {
        read_deadline: Some(Duration::from_secs(1)),
        ..Default::default()
    };
    let store = Arc::new(Store::open_with(&server.url(), options).await.unwrap());
    let (session, other) = (Uuid::new_v4(), Uuid::new_v4());
    store
        .append(session, 0, vec![started(), prompt("a"), prompt("b")])
        .await
        .unwrap();
    store.append(other, 0, vec![started()]).await.unwrap();
    // Reads at a seq each begin a read transaction; run together, they
    // leave the pool several open connections.
    let reads_at = |n: usize| {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let mut all = Vec::new();
            for _ in 0..n {
                all.push(store.state(session, Some(2)).await.map(|s| s.seq));
            }
            all
        })
    };
    let warm: Vec<_> = (0..6).map(|_| reads_at(3)).collect();
    for w in warm {
        assert!(w.await.unwrap().iter().all(|r| matches!(r, Ok(2))));
    }
    let resume = stop(&server);
    // Each `BEGIN` goes to an idle pooled connection of the stopped server
    // and is given up on after 1 s: reads', and a write's (`rebuild` of
    // another session, so this one's state stays cached and its next
    // append is one call).
    let stopped: Vec<_> = (0..4).map(|_| reads_at(1)).collect();
    let (rebuild_err, _) = failed_read(store.rebuild(other)).await;
    assert!(
        matches!(rebuild_err, Error::Unavailable(_)),
        "{rebuild_err:?}"
    );
    for s in stopped {
        for r in s.await.unwrap() {
            assert!(matches!(r, Err(Error::Unavailable(_))), "{r:?}");
        }
    }
    drop(resume);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..10 {
        let appended = tokio::time::timeout(
            Duration::from_secs(5),
            store.append(session, 3 + i, vec![prompt(&format!("after {i}"))]),
        )
        .await;
        assert!(
            matches!(appended, Ok(Ok(_))),
            "append {i} after the server resumed: {appended:?}"
        );
    }
    let after: Vec<_> = (0..4).map(|_| reads_at(10)).collect();
    for a in after {
        for r in a.await.unwrap() {
            assert!(matches!(r, Ok(2)), "a read after the server resumed: {r:?}");
        }
    }
    let admin = sqlx::PgPool::connect(&server.url()).await.unwrap();
    // A connection the store closed may show for a moment as idle in the
    // transaction its late `BEGIN` opened, until its backend reads the
    // close (seen once in CI, under load); one the store kept would stay
    // so until idle_in_transaction_session_timeout (30 s). Watched for
    // 5 s: left means still there then.
    let settled = Instant::now();
    loop {
        let in_tx: Vec<(i32, Option<String>)> = sqlx::query_as(
            "SELECT pid, query FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'",
        )
        .fetch_all(&admin)
        .await
        .unwrap();
        if in_tx.is_empty() {
            break;
        }
        assert!(
            settled.elapsed() < Duration::from_secs(5),
            "connections left idle in a transaction: {in_tx:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fresh = Store::open(&server.url()).await.unwrap();
    assert_eq!(fresh.head_seq(session).await.unwrap(), 13);
}

both_backends!(
    long_reads_leave_a_connection_for_the_short_ones,
    |url: String| async move {
        // Twelve reads as of a past seq, each holding its connection for
        // 2 s (a fold of a long log): more than either pool has. A latest
        // read of another session still gets a connection at once (it
        // waited for a long read to end, then for the connect timeout).
        let store = Arc::new(
            Store::open_with(
                &url,
                StoreOptions {
                    fault_pause_in_long_read: Some(Duration::from_secs(2)),
                    ..StoreOptions::default()
                },
            )
            .await
            .unwrap(),
        );
        let (old, other) = (Uuid::new_v4(), Uuid::new_v4());
        store
            .append(old, 0, vec![started(), prompt("a")])
            .await
            .unwrap();
        store
            .append(other, 0, vec![started(), prompt("b")])
            .await
            .unwrap();
        let long: Vec<_> = (0..12)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.activations(old, Some(1)).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started_at = Instant::now();
        let context = store.context(other, None).await.unwrap();
        let waited = started_at.elapsed();
        assert_eq!(context.as_of_seq, 2);
        assert!(waited < Duration::from_millis(1500), "waited {waited:?}");
        for read in long {
            read.await.unwrap().unwrap();
        }
    }
);

/// A group whose commit fails tells the appends it refused to send again,
/// as it tells the ones it accepted: the refusal was judged against an
/// earlier member that is not stored, so a 409 naming its head would be
/// false (here the head stays where it was, and the refused append, sent
/// again, is stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_refusal_in_a_group_whose_commit_fails_is_told_to_send_again() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let options = StoreOptions {
        fault_pause_before_commit: Some(Duration::from_millis(600)),
        ..StoreOptions::default()
    };
    let store = Arc::new(Store::open_with(&db.url, options).await.unwrap());
    let (s, blocker) = (Uuid::new_v4(), Uuid::new_v4());
    store.append(s, 0, vec![started()]).await.unwrap();
    let first = store.clone();
    let holder = tokio::spawn(async move { first.append(blocker, 0, vec![started()]).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Both queue behind the held commit, so they share the next group: the
    // first is accepted, the second refused against it.
    let accepted = {
        let store = store.clone();
        tokio::spawn(async move { store.append(s, 1, vec![prompt("a")]).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let refused = {
        let store = store.clone();
        tokio::spawn(async move { store.append(s, 1, vec![prompt("b")]).await })
    };
    holder.await.unwrap().unwrap();
    // The group is in its pause before the commit: its connection is cut.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(&admin)
    .await
    .unwrap();
    assert!(accepted.await.unwrap().is_err(), "the group did not commit");
    match refused.await.unwrap() {
        Err(Error::Unavailable(m)) => assert!(m.contains("send it again"), "{m}"),
        other => panic!("expected to be told to send it again: {other:?}"),
    }
    let reader = Store::open(&db.url).await.unwrap();
    assert_eq!(reader.head_seq(s).await.unwrap(), 1);
    let again = store.append(s, 1, vec![prompt("b")]).await.unwrap();
    assert_eq!(again.events[0].seq, 2);
}
