//! The plans and latencies of the audit queries on PostgreSQL with a
//! 1 000 000-event table, for docs/audit.md.
//!
//! `cargo run --release --example audit_plans [EVENTS] [SESSIONS]` starts a
//! throw-away PostgreSQL server (as the tests do), fills it with random
//! valid sessions (the tests' generator: catalogs, searches, failed and
//! unanswered calls, compactions, mode switches) split between tenants
//! `a` and `b`, then prints, for each audit query, its executed plan
//! (`EXPLAIN (ANALYZE, BUFFERS)`) and the median latency of the Store call
//! over 15 runs, as markdown.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use session_store::store::query::{
    AnomalyKind, AnomalyQuery, ChangeQuery, EventQuery, PlanOf, Scope,
};
use session_store::{NewEvent, Store};
use uuid::Uuid;

const RUNS: usize = 15;

async fn median<F, Fut, T>(mut f: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = session_store::Result<T>>,
{
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let t = Instant::now();
        f().await.expect("audit query");
        times.push(t.elapsed());
    }
    times.sort();
    times[RUNS / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("EVENTS and SESSIONS are numbers"))
        .collect();
    let events = args.first().copied().unwrap_or(1_000_000);
    let sessions = args.get(1).copied().unwrap_or(1_000);
    let per_session = events / sessions;
    let db = common::postgres_db().expect("PostgreSQL for the audit plans");
    let store = Arc::new(Store::open(&db.url).await.expect("open"));

    let started = Instant::now();
    let mut ids = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..sessions {
        let id = Uuid::new_v4();
        ids.push(id);
        let store = store.clone();
        if tasks.len() >= 4 {
            tasks.join_next().await.unwrap().unwrap();
        }
        tasks.spawn(async move {
            let tenant = if s % 2 == 0 { "a" } else { "b" };
            let log = common::gen::valid_log(s as u64, id, per_session);
            let mut done = 0i64;
            for chunk in log.chunks(500) {
                let batch: Vec<NewEvent> = chunk
                    .iter()
                    .map(|e| NewEvent::new(e.body.clone()).with_id(e.event_id))
                    .collect();
                store
                    .append_as(Some(tenant), id, done, batch)
                    .await
                    .expect("append");
                done += chunk.len() as i64;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let load = started.elapsed();
    let total = store.feed(0, 1).await.unwrap();
    let mid = store
        .audit_events(&EventQuery {
            scope: Scope {
                limit: 1,
                ..Scope::default()
            },
            after_position: (events / 2) as i64,
            ..EventQuery::default()
        })
        .await
        .unwrap()
        .events[0]
        .recorded_at;
    sqlx_analyze(&db.url).await;
    println!(
        "{} events in {} sessions loaded in {:.0} s (first position {})\n",
        per_session * sessions,
        sessions,
        load.as_secs_f64(),
        total[0].position
    );

    let a = |limit| Scope {
        tenant: Some("a".into()),
        limit,
        ..Scope::default()
    };
    let window = Scope {
        since: Some(mid),
        until: Some(mid + chrono::Duration::seconds(1)),
        ..a(100)
    };
    let one_session = Scope {
        session: Some(ids[sessions / 2]),
        ..Scope::default()
    };
    let q_type = EventQuery {
        scope: a(100),
        event_type: Some("compaction".into()),
        ..EventQuery::default()
    };
    let q_dense_type = EventQuery {
        scope: a(100),
        event_type: Some("tool_result".into()),
        ..EventQuery::default()
    };
    let q_session = EventQuery {
        scope: Scope {
            limit: 100,
            ..one_session.clone()
        },
        ..EventQuery::default()
    };
    let q_time = EventQuery {
        scope: window.clone(),
        ..EventQuery::default()
    };
    let q_positions = EventQuery {
        scope: a(100),
        from_position: Some((events / 2) as i64),
        to_position: Some((events / 2 + 100) as i64),
        ..EventQuery::default()
    };
    let c_tool = ChangeQuery {
        scope: a(100),
        tool: Some("web_fetch".into()),
        ..ChangeQuery::default()
    };
    let c_time = ChangeQuery {
        scope: window.clone(),
        ..ChangeQuery::default()
    };
    let anomaly = |kind, limit| AnomalyQuery {
        scope: a(limit),
        kind,
        after: None,
    };

    macro_rules! report {
        ($title:expr, $plan:expr, $call:expr) => {{
            let latency = median(|| $call).await;
            let plan = store.audit_plan($plan).await.expect("plan");
            println!(
                "### {}\n\nMedian of {RUNS}: **{}**\n\n```\n{plan}\n```\n",
                $title,
                ms(latency)
            );
        }};
    }
    report!(
        "Events by type (`audit events --type compaction --tenant a`)",
        PlanOf::Events(&q_type),
        store.audit_events(&q_type)
    );
    report!(
        "Events of a type most of the log is (`audit events --type tool_result --tenant a`)",
        PlanOf::Events(&q_dense_type),
        store.audit_events(&q_dense_type)
    );
    report!(
        "Events of one session (`audit events --session S`)",
        PlanOf::Events(&q_session),
        store.audit_events(&q_session)
    );
    report!(
        "Events in a time range (`audit events --since T --until T+1s --tenant a`)",
        PlanOf::Events(&q_time),
        store.audit_events(&q_time)
    );
    report!(
        "Events in a position range (`audit events --from-position P --to-position P+100 --tenant a`)",
        PlanOf::Events(&q_positions),
        store.audit_events(&q_positions)
    );
    report!(
        "Where a tool became active or inactive (`audit changes --tool web_fetch --tenant a`)",
        PlanOf::Changes(&c_tool),
        store.audit_changes(&c_tool)
    );
    report!(
        "Activation changes in a time range (`audit changes --since T --until T+1s --tenant a`)",
        PlanOf::Changes(&c_time),
        store.audit_changes(&c_time)
    );
    let unanswered = anomaly(AnomalyKind::UnansweredCall, 100);
    report!(
        "Unanswered calls (`audit anomalies unanswered-call --tenant a`)",
        PlanOf::UnansweredCalls(&unanswered.scope),
        store.audit_anomalies(&unanswered)
    );
    let names = anomaly(AnomalyKind::UnknownEvidenceName, 100);
    report!(
        "Results naming uncatalogued tools, the scan (`audit anomalies unknown-evidence-name --tenant a`, one page)",
        PlanOf::NamedResults(&names.scope),
        store.audit_anomalies(&names)
    );
    report!(
        "… and its catalog lookup per session",
        PlanOf::Catalogs(ids[sessions / 2]),
        store.audit_plan(PlanOf::Catalogs(ids[sessions / 2]))
    );
    let drift = anomaly(AnomalyKind::ViewDrift, 10);
    report!(
        "Sessions whose view fails verification (`audit anomalies view-drift --tenant a --limit 10`; the latency includes verifying 10 sessions)",
        PlanOf::Sessions(&drift.scope),
        store.audit_anomalies(&drift)
    );
}

/// Fresh statistics and visibility map, as autovacuum keeps them on a live store.
async fn sqlx_analyze(url: &str) {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    sqlx::query("VACUUM ANALYZE").execute(&pool).await.unwrap();
}
