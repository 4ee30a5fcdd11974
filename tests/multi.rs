//! Many writers, one store: 4 processes × 4 tasks append to the same 8
//! sessions (batches and single events, with retried event ids), on
//! PostgreSQL and on one SQLite file. Afterwards every session's seqs are
//! dense, every acknowledged event is stored exactly once, no event whose
//! append failed is stored, and the views verify.
//!
//! The worker processes are this test binary itself, re-run with
//! `MULTI_WORKER` set, so each is a real separate process with its own pool.

mod common;

use std::collections::{HashMap, HashSet};
use std::process::Command;

use session_store::{EventBody, NewEvent, RetryPolicy, Store};
use uuid::Uuid;

const SESSIONS: usize = 8;
const PROCESSES: usize = 4;
const TASKS: usize = 4;
const ROUNDS: usize = 12;

fn session_ids(seed: u128) -> Vec<Uuid> {
    (0..SESSIONS as u128)
        .map(|i| Uuid::from_u128(seed + i))
        .collect()
}

/// One worker process: TASKS tasks, each ROUNDS rounds over the sessions.
/// Prints `ACK id` for every acknowledged event and `FAIL id` for events
/// whose append finally failed.
#[test]
#[ignore = "a worker process of the multi-process tests, started by them"]
fn multi_worker() {
    let (Ok(url), Ok(seed), Ok(worker)) = (
        std::env::var("MULTI_WORKER_URL"),
        std::env::var("MULTI_WORKER_SEED"),
        std::env::var("MULTI_WORKER"),
    ) else {
        return; // Only runs as a child of the tests below.
    };
    let seed: u128 = seed.parse().unwrap();
    let worker: usize = worker.parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = std::sync::Arc::new(Store::open(&url).await.unwrap());
        let mut tasks = Vec::new();
        for task in 0..TASKS {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let policy = RetryPolicy {
                    max_attempts: 200,
                    ..RetryPolicy::default()
                };
                let mut lines = Vec::new();
                for round in 0..ROUNDS {
                    for (i, session) in session_ids(seed).into_iter().enumerate() {
                        let tag = format!("w{worker}t{task}r{round}s{i}");
                        let events: Vec<NewEvent> = if round % 3 == 0 {
                            vec![
                                NewEvent::new(EventBody::ToolCall {
                                    call_id: format!("{tag}-c"),
                                    tool_name: "ToolSearch".into(),
                                    input: serde_json::json!({"q": tag}),
                                }),
                                NewEvent::new(EventBody::ToolResult {
                                    call_id: format!("{tag}-c"),
                                    tool_name: "ToolSearch".into(),
                                    status: session_store::ToolStatus::Success,
                                    output: None,
                                    added_tool_names: Some(vec!["web_fetch".into()]),
                                }),
                                NewEvent::new(EventBody::PromptSubmitted { text: tag.clone() }),
                            ]
                        } else {
                            vec![NewEvent::new(EventBody::AssistantMessage {
                                text: tag.clone(),
                            })]
                        };
                        let events: Vec<NewEvent> = events
                            .into_iter()
                            .map(|e| e.with_id(Uuid::new_v4()))
                            .collect();
                        let ids: Vec<Uuid> = events.iter().map(|e| e.event_id.unwrap()).collect();
                        match store.append_at_head(session, events.clone(), &policy).await {
                            Ok(_) => {
                                // Every other round, retry the same batch as a
                                // writer that lost the reply would.
                                if round % 2 == 1 {
                                    let again = store.append(session, 0, events).await.unwrap();
                                    assert!(again.replayed);
                                }
                                lines.extend(ids.iter().map(|id| format!("ACK {id}")));
                            }
                            Err(e) => {
                                eprintln!("append failed: {e}");
                                lines.extend(ids.iter().map(|id| format!("FAIL {id}")));
                            }
                        }
                    }
                }
                lines
            }));
        }
        for t in tasks {
            for line in t.await.unwrap() {
                println!("{line}");
            }
        }
    });
}

async fn run_load(url: &str) {
    let seed = Uuid::new_v4().as_u128() & !0xff;
    let store = Store::open(url).await.unwrap();
    for s in session_ids(seed) {
        store
            .append(
                s,
                0,
                vec![
                    NewEvent::new(EventBody::SessionStarted {
                        mode: "agent".into(),
                        metadata: None,
                    }),
                    NewEvent::new(EventBody::CatalogDefined {
                        mode: "agent".into(),
                        deferred_tools: vec!["web_fetch".into()],
                    }),
                ],
            )
            .await
            .unwrap();
    }
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..PROCESSES)
        .map(|w| {
            Command::new(&exe)
                .args([
                    "multi_worker",
                    "--exact",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("MULTI_WORKER_URL", url)
                .env("MULTI_WORKER_SEED", seed.to_string())
                .env("MULTI_WORKER", w.to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut acked = HashSet::new();
    let mut failed = HashSet::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "worker failed: {stderr}");
        assert!(!stderr.contains("database is locked"), "{stderr}");
        // The test harness prints "test multi_worker ... " before the
        // worker's first line, so look for the markers anywhere in a line.
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(i) = line.find("ACK ") {
                let id = &line[i + 4..i + 40];
                assert!(
                    acked.insert(id.parse::<Uuid>().unwrap()),
                    "acked twice: {id}"
                );
            } else if let Some(i) = line.find("FAIL ") {
                failed.insert(line[i + 5..i + 41].parse::<Uuid>().unwrap());
            }
        }
    }
    let per_session_events = PROCESSES * TASKS * (ROUNDS / 3 * 3 + (ROUNDS - ROUNDS / 3));
    assert_eq!(acked.len() + failed.len(), SESSIONS * per_session_events);
    let mut stored: HashMap<Uuid, usize> = HashMap::new();
    for s in session_ids(seed) {
        let events = store.history(s, 0, 1_000_000).await.unwrap();
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(
            seqs,
            (1..=events.len() as i64).collect::<Vec<_>>(),
            "dense seqs"
        );
        for e in events.iter().skip(2) {
            *stored.entry(e.event_id).or_default() += 1;
        }
        assert_eq!(store.verify(s).await.unwrap(), None);
    }
    for id in &acked {
        assert_eq!(stored.get(id), Some(&1), "acknowledged {id} stored once");
    }
    for id in &failed {
        assert!(!stored.contains_key(id), "failed {id} is stored");
    }
    assert_eq!(stored.len(), acked.len(), "nothing but acknowledged events");
    eprintln!(
        "{} events acknowledged, {} failed",
        acked.len(),
        failed.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_one_file_many_processes() {
    let db = common::sqlite_db();
    run_load(&db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_many_processes() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    run_load(&db.url).await;
}
