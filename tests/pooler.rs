//! The store behind PgBouncer in session mode, with the pooler's default
//! settings (docs/operations.md, "Behind a connection pooler"): it opens,
//! appends on both write paths and reads, and every statement it runs
//! carries the store's session settings, over database defaults that say
//! otherwise. A store that sent them as startup options could not connect
//! to such a pooler at all ("unsupported startup parameter"), and one told
//! to ignore them lost them in silence (a pooler review's findings).
//!
//! PgBouncer is a Debian package `.ci/run` installs; without it the test
//! says it is skipped, except under CI=true, where it fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use session_store::{AppendOutcome, EventBody, NewEvent, Store, ToolStatus};
use uuid::Uuid;

/// The `pgbouncer` binary, or `None` (skipped, said) outside CI.
fn pgbouncer_bin() -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|p| p.is_file());
    match found {
        Some(bin) => Some(bin),
        None if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("CI=true but pgbouncer was not found on PATH or in /usr/sbin (apt-get install -y pgbouncer)")
        }
        None => {
            eprintln!("SKIPPED: pgbouncer not found; the pooler test did not run");
            None
        }
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A PgBouncer process of the test's own, stopped when dropped.
struct Bouncer {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Bouncer {
    /// Starts PgBouncer in `mode` in front of the server at `host:port`,
    /// with nothing but what it needs to run set (trust, a port, files).
    fn start(bin: &Path, host: &str, pg_port: u16, mode: &str) -> Bouncer {
        let dir = std::env::temp_dir().join(format!("session-store-bouncer-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let port = common::free_port();
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
        std::fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n* = host={host} port={pg_port}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {users}\npool_mode = {mode}\n\
                 default_pool_size = 20\nmax_client_conn = 100\n\
                 logfile = {log}\npidfile = {pid}\n",
                users = dir.join("users.txt").display(),
                log = dir.join("pgbouncer.log").display(),
                pid = dir.join("pgbouncer.pid").display(),
            ),
        )
        .unwrap();
        let ini = dir.join("pgbouncer.ini");
        // PgBouncer refuses to run as root, as PostgreSQL does.
        let mut command = if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown {} to postgres failed", dir.display());
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin);
            c
        } else {
            Command::new(bin)
        };
        let child = command
            .arg(&ini)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pgbouncer");
        let bouncer = Bouncer { child, dir, port };
        let deadline = Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not listen within 15 s: {}",
                std::fs::read_to_string(bouncer.dir.join("pgbouncer.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        bouncer
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        // The process started is runuser's when root: killing it leaves
        // pgbouncer, so it is asked to stop by its pid file first.
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pgbouncer.pid")) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The seq an append's last event took.
fn last_seq(outcome: AppendOutcome) -> i64 {
    outcome.events.last().map_or(0, |e| e.seq)
}

fn event(body: EventBody) -> NewEvent {
    NewEvent::new(body).with_id(Uuid::now_v7())
}

/// A turn in which a ToolSearch activates `web_fetch`.
fn turn(call: &str) -> Vec<NewEvent> {
    vec![
        event(EventBody::PromptSubmitted {
            text: "fetch it".into(),
        }),
        event(EventBody::ToolCall {
            call_id: call.into(),
            tool_name: "ToolSearch".into(),
            input: json!({"query": "select:web_fetch"}),
        }),
        event(EventBody::ToolResult {
            call_id: call.into(),
            tool_name: "ToolSearch".into(),
            status: ToolStatus::Success,
            output: Some(json!({"matches": ["web_fetch"]})),
            added_tool_names: Some(vec!["web_fetch".into()]),
        }),
        event(EventBody::PromptSubmitted {
            text: "thanks".into(),
        }),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_behind_pgbouncer_in_session_mode_keeps_its_settings() {
    let Some(db) = common::postgres_db() else {
        return;
    };
    let Some(bin) = pgbouncer_bin() else {
        return;
    };
    let url = url::Url::parse(&db.url).unwrap();
    let name = url.path().trim_start_matches('/').to_owned();
    let bouncer = Bouncer::start(
        &bin,
        url.host_str().unwrap(),
        url.port().unwrap_or(5432),
        "session",
    );
    // Database defaults the store must override on its connections.
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    for setting in [
        "default_transaction_isolation = 'serializable'",
        "lock_timeout = 0",
        "statement_timeout = 0",
        "idle_in_transaction_session_timeout = 0",
    ] {
        sqlx::query(&format!("ALTER DATABASE {name} SET {setting}"))
            .execute(&admin)
            .await
            .unwrap();
    }
    let pooled = format!("postgres://postgres@127.0.0.1:{}/{name}", bouncer.port);
    let store = Store::open(&pooled)
        .await
        .unwrap_or_else(|e| panic!("open through pgbouncer: {e}"));
    // What each statement that writes events runs under, seen from inside
    // the store's own sessions.
    sqlx::raw_sql(
        "CREATE TABLE seen (isolation TEXT, lock_timeout TEXT, idle TEXT); \
         CREATE FUNCTION note_settings() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO seen VALUES (current_setting('transaction_isolation'), \
             current_setting('lock_timeout'), \
             current_setting('idle_in_transaction_session_timeout')); \
           RETURN NULL; END $$; \
         CREATE TRIGGER note_settings AFTER INSERT ON events \
           FOR EACH STATEMENT EXECUTE FUNCTION note_settings();",
    )
    .execute(&admin)
    .await
    .unwrap();
    let session = Uuid::new_v4();
    let mut head = store
        .append(
            session,
            0,
            vec![
                event(EventBody::SessionStarted {
                    mode: "agent".into(),
                    metadata: None,
                }),
                event(EventBody::CatalogDefined {
                    mode: "agent".into(),
                    deferred_tools: vec!["web_fetch".into(), "notebook_edit".into()],
                }),
            ],
        )
        .await
        .map(last_seq)
        .unwrap();
    // A new session takes the locked path; the warm one the one-call write.
    for i in 0..5 {
        head = store
            .append(session, head, turn(&format!("c{i}")))
            .await
            .map(last_seq)
            .unwrap();
    }
    let activations = store.activations(session, None).await.unwrap();
    let names: Vec<&str> = activations.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["web_fetch"]);
    assert_eq!(store.history(session, 0, 100).await.unwrap().len(), 22);
    assert_eq!(store.verify(session).await.unwrap(), None);
    let seen: Vec<(String, String, String)> =
        sqlx::query_as("SELECT isolation, lock_timeout, idle FROM seen")
            .fetch_all(&admin)
            .await
            .unwrap();
    assert_eq!(seen.len(), 6, "{seen:?}");
    for row in &seen {
        assert_eq!(
            row,
            &(
                "read committed".to_owned(),
                "10s".to_owned(),
                "30s".to_owned()
            ),
            "a write ran without the store's settings: {seen:?}"
        );
    }
    store.close().await;
    drop(bouncer);
}
