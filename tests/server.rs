//! The HTTP API in-process (`tower::ServiceExt::oneshot`), on both backends:
//! every status code the API documents, authentication and tenant
//! isolation, bad input that must change nothing, the SSE stream with
//! `Last-Event-ID`, the request timeout and the graceful shutdown.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use session_store::server::{Server, ServerConfig, Tokens};
use session_store::{Store, StoreOptions};
use tower::ServiceExt;
use uuid::Uuid;

const TOKENS: &str = r#"{"tokens": [
  {"token": "tenant-a-writer-0123456789", "tenant": "a", "scopes": ["read", "write"]},
  {"token": "tenant-a-reader-0123456789", "tenant": "a", "scopes": ["read"]},
  {"token": "tenant-b-writer-0123456789", "tenant": "b", "scopes": ["read", "write"]}
]}"#;
const A_WRITER: &str = "tenant-a-writer-0123456789";
const A_READER: &str = "tenant-a-reader-0123456789";
const B_WRITER: &str = "tenant-b-writer-0123456789";

/// `server` on a free loopback port until `stop` is sent: its address,
/// the sender that stops it, and the task serving (which ends once
/// shutdown is done).
async fn serve_until_stopped(
    server: Server,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve(listener, async move {
        let _ = stopped.await;
    }));
    (addr, stop, serving)
}

/// Stops a server of [`serve_until_stopped`] and waits, at most 10 s, for
/// its shutdown (`what` says what must not hold it up).
async fn stop_serving(
    stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
    what: &str,
) {
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect(what)
        .unwrap()
        .unwrap();
}

/// A store on a new SQLite file in `dir`.
async fn store_in(dir: &tempfile::TempDir) -> Arc<Store> {
    Arc::new(
        Store::open(&dir.path().join("s.db").display().to_string())
            .await
            .unwrap(),
    )
}

async fn open(url: &str, options: StoreOptions) -> Arc<Store> {
    Arc::new(Store::open_with(url, options).await.expect("open store"))
}

fn router(store: &Arc<Store>, config: ServerConfig) -> Router {
    Server::new(store.clone(), config).router()
}

fn with_tokens() -> ServerConfig {
    ServerConfig {
        tokens: Some(Tokens::parse(TOKENS, "the test tokens").expect("tokens")),
        ..ServerConfig::default()
    }
}

/// One request; answers the status, the body as JSON (Null when it is
/// not JSON) and the raw text.
async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    token: Option<&str>,
    content_type: Option<&str>,
    body: impl Into<Body>,
) -> (StatusCode, Value, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    if let Some(ct) = content_type {
        req = req.header(header::CONTENT_TYPE, ct);
    }
    let response = app
        .clone()
        .oneshot(req.body(body.into()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let value = serde_json::from_str(&text).unwrap_or(Value::Null);
    (status, value, text)
}

async fn get(app: &Router, uri: &str, token: Option<&str>) -> (StatusCode, Value) {
    let (s, v, _) = call(app, Method::GET, uri, token, None, Body::empty()).await;
    (s, v)
}

async fn post(app: &Router, uri: &str, token: Option<&str>, body: &Value) -> (StatusCode, Value) {
    let (s, v, _) = call(
        app,
        Method::POST,
        uri,
        token,
        Some("application/json"),
        body.to_string(),
    )
    .await;
    (s, v)
}

fn events_uri(id: Uuid) -> String {
    format!("/v1/sessions/{id}/events")
}

/// A session that searched for `web_fetch` and was then prompted again.
fn searched_batch() -> Value {
    json!([
        {"type": "session_started", "mode": "code"},
        {"type": "catalog_defined", "mode": "code", "deferred_tools": ["web_fetch", "grep"]},
        {"type": "prompt_submitted", "text": "find the docs"},
        {"type": "tool_call", "call_id": "c1", "tool_name": "ToolSearch", "input": {"query": "fetch"}},
        {"type": "tool_result", "call_id": "c1", "tool_name": "ToolSearch", "status": "success",
         "added_tool_names": ["web_fetch"], "output": "found web_fetch"},
        {"type": "prompt_submitted", "text": "now fetch them"}
    ])
}

/// Asserts an error answer: the status, the stable code, a sentence.
fn assert_error(status: StatusCode, body: &Value, want: StatusCode, code: &str) {
    assert_eq!(status, want, "status of {body}");
    assert_eq!(body["error"], code, "error code of {body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.len() > 10, "a sentence, not {body}");
}

both_backends!(every_documented_status, |url: String| async move {
    let store = open(&url, StoreOptions::default()).await;
    let app = router(
        &store,
        ServerConfig {
            body_limit: 64 * 1024,
            ..ServerConfig::default()
        },
    );
    let id = Uuid::new_v4();
    let uri = events_uri(id);

    // 201: each event's id and seq.
    let mut batch = searched_batch();
    let ids: Vec<Uuid> = (0..6).map(|_| Uuid::new_v4()).collect();
    for (e, i) in batch.as_array_mut().unwrap().iter_mut().zip(&ids) {
        e["event_id"] = json!(i);
    }
    let body = json!({"expected_seq": 0, "events": batch});
    let (s, v) = post(&app, &uri, None, &body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["session_id"], json!(id));
    assert_eq!(v["replayed"], false);
    let seqs: Vec<i64> = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5, 6]);
    assert_eq!(v["events"][4]["event_id"], json!(ids[4]));

    // The same batch again: an idempotent retry (SEMANTICS §2), same seqs.
    let (s, v2) = post(&app, &uri, None, &body).await;
    assert_eq!(s, StatusCode::CREATED, "{v2}");
    assert_eq!(v2["replayed"], true);
    assert_eq!(v2["events"], v["events"]);
    assert_eq!(store.head_seq(id).await.unwrap(), 6);

    // 409 with the current seq.
    let stale =
        json!({"expected_seq": 3, "events": [{"type": "prompt_submitted", "text": "late"}]});
    let (s, v) = post(&app, &uri, None, &stale).await;
    assert_error(s, &v, StatusCode::CONFLICT, "conflict");
    assert_eq!(v["current_seq"], 6);

    // 422 naming the rule, field and batch index.
    let bad = json!({"expected_seq": 6, "events": [
        {"type": "prompt_submitted", "text": "ok"},
        {"type": "tool_result", "call_id": "nope", "tool_name": "grep", "status": "success"}
    ]});
    let (s, v) = post(&app, &uri, None, &bad).await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
    assert_eq!(v["index"], 1, "{v}");
    assert_eq!(v["field"], "call_id", "{v}");
    assert!(v["rule"].as_str().is_some_and(|r| !r.is_empty()), "{v}");
    let (s, v) = post(
        &app,
        &uri,
        None,
        &json!({"expected_seq": 6, "events": [{"type": "prompt_submitted"}]}),
    )
    .await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
    assert_eq!(
        (v["rule"].as_str(), v["field"].as_str(), v["index"].as_i64()),
        (Some("missing-field"), Some("text"), Some(0))
    );

    // 413 over the body limit.
    let huge = json!({"expected_seq": 6, "events": [{"type": "prompt_submitted", "text": "x".repeat(100_000)}]});
    let (s, v) = post(&app, &uri, None, &huge).await;
    assert_error(s, &v, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    // Announced too large: refused at once, before any body arrives (the
    // body here would never come).
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::io::Error>>(1);
    let never = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let request = Request::builder()
        .method(Method::POST)
        .uri(&uri)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "99999999999")
        .body(never)
        .unwrap();
    let response = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        app.clone().oneshot(request),
    )
    .await
    .expect("answered at once")
    .unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    drop(tx);

    // 415 without JSON, 400 for malformed JSON and bad ids.
    let (s, v, _) = call(&app, Method::POST, &uri, None, Some("text/plain"), "{}").await;
    assert_error(
        s,
        &v,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    );
    let (s, v, _) = call(
        &app,
        Method::POST,
        &uri,
        None,
        Some("application/json"),
        "{\"expected_seq\": 6,",
    )
    .await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
    assert_eq!(v["rule"], "malformed-json");
    // A byte order mark before the JSON is ignored (RFC 8259 §8.1): the
    // body is read, and its event judged.
    let (s, v, _) = call(
        &app,
        Method::POST,
        &uri,
        None,
        Some("application/json"),
        "\u{feff}{\"expected_seq\": 6, \"events\": [{\"type\": \"no_such_type\"}]}",
    )
    .await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
    assert_eq!(v["rule"], "unknown-type", "{v}");
    // A key given twice would be stored as only one of its values.
    let (s, v, _) = call(
        &app,
        Method::POST,
        &uri,
        None,
        Some("application/json"),
        r#"{"expected_seq": 6, "events": [{"type": "mode_switched", "mode": "a", "mode": "b"}]}"#,
    )
    .await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
    assert_eq!(v["rule"], "malformed-json");
    assert!(
        v["message"].as_str().unwrap().contains("appears twice"),
        "{v}"
    );
    // serde_json's number key would be stored as a number.
    let (s, v, _) = call(
        &app,
        Method::POST,
        &uri,
        None,
        Some("application/json"),
        r#"{"expected_seq": 6, "events": [{"type": "tool_call", "call_id": "n", "tool_name": "t", "input": {"$serde_json::private::Number": "12"}}]}"#,
    )
    .await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
    assert_eq!(v["rule"], "malformed-json");
    assert!(
        v["message"].as_str().unwrap().contains("cannot be stored"),
        "{v}"
    );
    let (s, v) = get(&app, "/v1/sessions/not-a-uuid/context", None).await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
    // Not UTF-8 once percent-decoded: said in the store's words.
    let (s, v) = get(&app, "/v1/sessions/%FF/context", None).await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
    assert_eq!(
        v["message"],
        "the session id in the path is not UTF-8 once percent-decoded: session ids are UUIDs"
    );

    // 200 reads in the §9 shapes.
    let (s, v) = get(&app, &format!("/v1/sessions/{id}/activations"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({"session_id": id, "as_of_seq": 6, "mode": "code",
               "tools": [{"name": "web_fetch", "evidence_seq": 5}]})
    );
    let (s, v) = get(
        &app,
        &format!("/v1/sessions/{id}/activations?at_seq=4"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["tools"], json!([]), "no evidence before the result");
    let (s, v) = get(&app, &format!("/v1/sessions/{id}/context?at_seq=3"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["as_of_seq"], 3);
    assert_eq!(v["summary"], Value::Null);
    assert_eq!(v["rows"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["rows"][0]["text"], "find the docs");
    let (s, v) = get(&app, &format!("/v1/sessions/{id}/recover"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["latest_seq"], 6);
    assert_eq!(v["catalog"], json!(["web_fetch", "grep"]));
    assert_eq!(v["tools"][0]["name"], "web_fetch");

    // History pages.
    let (s, v) = get(&app, &format!("{uri}?after_seq=1&limit=2"), None).await;
    assert_eq!(s, StatusCode::OK);
    let page: Vec<i64> = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(page, [2, 3]);
    assert_eq!(v["next_after_seq"], 3);
    let (_, v) = get(&app, &format!("{uri}?after_seq=3&limit=1000"), None).await;
    assert_eq!(v["events"].as_array().unwrap().len(), 3);
    assert_eq!(v["next_after_seq"], Value::Null);
    // Parsed but out of range: 422 naming the parameter, as the audit
    // routes answer; not a number: 400.
    for (q, field) in [
        ("limit=1001", "limit"),
        ("limit=0", "limit"),
        ("after_seq=-1", "after_seq"),
        // Whole numbers past what the parameter's type holds.
        ("limit=99999999999999999999", "limit"),
        ("after_seq=-99999999999999999999", "after_seq"),
    ] {
        let (s, v) = get(&app, &format!("{uri}?{q}"), None).await;
        assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
        assert_eq!(v["field"], field, "{q}: {v}");
    }
    let (s, v) = get(
        &app,
        &format!("/v1/sessions/{id}/stream?after_seq=-1"),
        None,
    )
    .await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
    let (s, v) = get(&app, &format!("{uri}?limit=ten"), None).await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");

    // 422 for a seq out of range; 404 for a missing session and route;
    // 405 for a wrong method.
    let (s, v) = get(&app, &format!("/v1/sessions/{id}/context?at_seq=7"), None).await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "seq_out_of_range");
    for path in ["context", "activations", "recover", "events", "stream"] {
        let (s, v) = get(
            &app,
            &format!("/v1/sessions/{}/{path}", Uuid::new_v4()),
            None,
        )
        .await;
        assert_error(s, &v, StatusCode::NOT_FOUND, "not_found");
    }
    let (s, v) = get(&app, "/v2/nothing", None).await;
    assert_error(s, &v, StatusCode::NOT_FOUND, "not_found");
    let (s, v, _) = call(&app, Method::DELETE, &uri, None, None, Body::empty()).await;
    assert_error(s, &v, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");

    // A long batch of a warm session, appended through the library: on
    // SQLite its first rows go ahead of the commit, which /metrics counts.
    let warm = Uuid::new_v4();
    let prompts = |n: usize| -> Vec<session_store::NewEvent> {
        (0..n)
            .map(|i| {
                session_store::NewEvent::new(session_store::EventBody::PromptSubmitted {
                    text: format!("prompt {i}"),
                })
            })
            .collect()
    };
    let mut start = vec![session_store::NewEvent::new(
        session_store::EventBody::SessionStarted {
            mode: "agent".into(),
            metadata: None,
        },
    )];
    start.extend(prompts(1));
    store.append(warm, 0, start).await.unwrap();
    store.append(warm, 2, prompts(1)).await.unwrap();
    store.append(warm, 3, prompts(40)).await.unwrap();

    // Health, readiness, metrics, the OpenAPI document.
    assert_eq!(get(&app, "/healthz", None).await.0, StatusCode::OK);
    let (s, v) = get(&app, "/readyz", None).await;
    assert_eq!((s, v["status"].as_str()), (StatusCode::OK, Some("ready")));
    let (s, _, text) = call(&app, Method::GET, "/metrics", None, None, Body::empty()).await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        text.contains("session_store_appends_total{outcome=\"ok\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("session_store_appends_total{outcome=\"replayed\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("session_store_append_conflicts_total 1"),
        "{text}"
    );
    // Every group of the store's appends, by path, as the store counts them.
    let paths = store.append_paths();
    for (path, n) in [
        ("locked", paths.locked),
        ("optimistic", paths.optimistic),
        ("optimistic_abandoned", paths.optimistic_abandoned),
    ] {
        let line = format!("session_store_append_groups_total{{path=\"{path}\"}} {n}\n");
        assert!(text.contains(&line), "{line} in {text}");
    }
    assert!(paths.locked >= 1, "{paths:?}");
    assert_eq!(
        paths.sends_ahead > 0,
        store.kind() == session_store::BackendKind::Sqlite,
        "{paths:?}"
    );
    let line = format!(
        "session_store_append_sends_ahead_total {}\n",
        paths.sends_ahead
    );
    assert!(text.contains(&line), "{line} in {text}");
    // The state caches, as the store weighs them at the scrape (nothing
    // was appended or read since).
    let (rows, rowless) = store.state_cache_usage();
    assert!(rows.sessions >= 1 && rows.bytes > 0, "{rows:?}");
    for (cache, usage) in [("rows", rows), ("rowless", rowless)] {
        for line in [
            format!(
                "session_store_state_cache_sessions{{cache=\"{cache}\"}} {}\n",
                usage.sessions
            ),
            format!(
                "session_store_state_cache_bytes{{cache=\"{cache}\"}} {}\n",
                usage.bytes
            ),
            format!(
                "session_store_state_cache_evictions_total{{cache=\"{cache}\"}} {}\n",
                usage.evicted
            ),
        ] {
            assert!(text.contains(&line), "{line} in {text}");
        }
    }
    assert!(
        text.contains("session_store_appended_events_total 6"),
        "{text}"
    );
    assert!(
        text.contains("session_store_view_refreshes_total 2"),
        "{text}"
    );
    assert!(text.contains("session_store_http_request_duration_seconds_count{route=\"/v1/sessions/{id}/events\",method=\"POST\",status=\"409\"} 1"), "{text}");
    // §2 judges the events one by one: an earlier event's error answers
    // before a later event that cannot be read (an unknown field, not an
    // object), and a stale expected seq before both.
    for unreadable in [
        json!({"type": "prompt_submitted", "text": "x", "bogus": 1}),
        json!("not an event"),
    ] {
        let batch = |expected: i64| {
            json!({"expected_seq": expected, "events": [
                {"type": "prompt_submitted", "text": "ok"},
                {"type": "tool_result", "call_id": "nope", "tool_name": "grep", "status": "success"},
                unreadable.clone(),
            ]})
        };
        let (s, v) = post(&app, &uri, None, &batch(6)).await;
        assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
        assert_eq!(
            (v["rule"].as_str(), v["index"].as_i64()),
            (Some("result-without-call"), Some(1)),
            "{v}"
        );
        let (s, v) = post(&app, &uri, None, &batch(5)).await;
        assert_error(s, &v, StatusCode::CONFLICT, "conflict");
        let valid_first = json!({"expected_seq": 6, "events": [
            {"type": "prompt_submitted", "text": "ok"},
            unreadable.clone(),
        ]});
        let (s, v) = post(&app, &uri, None, &valid_first).await;
        assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
        assert_eq!(v["index"], 1, "{v}");
    }
    assert_eq!(store.head_seq(id).await.unwrap(), 6);

    let (s, v) = get(&app, "/openapi.json", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(v["openapi"].as_str().unwrap().starts_with("3."));
    assert!(v["paths"]["/v1/sessions/{id}/stream"]["get"].is_object());
});

both_backends!(
    readyz_answers_503_when_the_database_is_gone,
    |url: String| async move {
        let store = open(
            &url,
            StoreOptions {
                connect_timeout_secs: 1,
                ..StoreOptions::default()
            },
        )
        .await;
        let app = router(&store, ServerConfig::default());
        assert_eq!(get(&app, "/readyz", None).await.0, StatusCode::OK);
        store.close().await;
        let (s, v) = get(&app, "/readyz", None).await;
        assert_error(s, &v, StatusCode::SERVICE_UNAVAILABLE, "unavailable");
        let (s, v) = post(
            &app,
            &events_uri(Uuid::new_v4()),
            None,
            &json!({"expected_seq": 0, "events": [{"type": "session_started", "mode": "m"}]}),
        )
        .await;
        assert_error(s, &v, StatusCode::SERVICE_UNAVAILABLE, "unavailable");
        // The client is told that the append was not stored (a retry is
        // safe), not only that the database is down.
        let message = v["message"].as_str().unwrap();
        assert!(message.contains("nothing was stored"), "{message}");
    }
);

// An append whose commit's answer was lost (the reply dropped after the
// commit, as a connection cut after PostgreSQL's COMMIT does) is not told
// "unavailable, try again": it may be stored, and says so. Sent again with
// the same ids, it is answered from the log, stored once.
both_backends!(
    an_append_whose_commit_answer_was_lost_says_it_may_be_stored,
    |url: String| async move {
        let lost = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let store = open(
            &url,
            StoreOptions {
                fault_lose_replies: Some(lost.clone()),
                ..StoreOptions::default()
            },
        )
        .await;
        let app = router(&store, ServerConfig::default());
        let s = Uuid::new_v4();
        let id = Uuid::new_v4();
        let body = json!({"expected_seq": 0, "events": [
            {"type": "session_started", "mode": "m", "event_id": id}
        ]});
        lost.store(1, std::sync::atomic::Ordering::SeqCst);
        let (status, v) = post(&app, &events_uri(s), None, &body).await;
        assert_error(
            status,
            &v,
            StatusCode::SERVICE_UNAVAILABLE,
            "outcome_unknown",
        );
        let message = v["message"].as_str().unwrap();
        assert!(message.contains("may or may not be stored"), "{message}");
        assert_eq!(store.head_seq(s).await.unwrap(), 1);
        let (status, v) = post(&app, &events_uri(s), None, &body).await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        assert_eq!(v["replayed"], json!(true), "{v}");
        assert_eq!(store.head_seq(s).await.unwrap(), 1);
        // Counted apart from the failures that stored nothing.
        let (_, _, text) = call(&app, Method::GET, "/metrics", None, None, Body::empty()).await;
        for line in [
            "session_store_appends_total{outcome=\"outcome_unknown\"} 1",
            "session_store_appends_total{outcome=\"replayed\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(!text.contains("outcome=\"error\""), "{text}");
    }
);

both_backends!(tokens_scopes_and_tenants, |url: String| async move {
    let store = open(&url, StoreOptions::default()).await;
    let app = router(&store, with_tokens());
    let id = Uuid::new_v4();
    let uri = events_uri(id);
    let body = json!({"expected_seq": 0, "events": searched_batch()});

    // 401 without a token, with an unknown one, with a malformed header.
    let (s, v) = post(&app, &uri, None, &body).await;
    assert_error(s, &v, StatusCode::UNAUTHORIZED, "unauthorized");
    let response = app
        .clone()
        .oneshot(Request::builder().uri(&uri).body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
    // Who asks is judged before the query, on every session route.
    for route in [
        "events",
        "context",
        "activations",
        "recover",
        "refreshes",
        "explain/web_fetch",
        "stream",
    ] {
        let response = app
            .clone()
            .oneshot(
                Request::builder()
                    .uri(format!("/v1/sessions/{id}/{route}?x=1"))
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{route}");
    }
    // And before the path: a session id or tool name that is not UTF-8
    // once percent-decoded is said (400) only to a known caller.
    for path in [
        "/v1/sessions/%FF/context".to_owned(),
        format!("/v1/sessions/{id}/explain/%FF"),
    ] {
        for (token, want) in [
            (None, StatusCode::UNAUTHORIZED),
            (Some(A_READER), StatusCode::BAD_REQUEST),
        ] {
            let (s, v, _) = call(&app, Method::GET, &path, token, None, Body::empty()).await;
            assert_eq!(s, want, "{path} {token:?}: {v}");
            assert!(!v.to_string().contains("Invalid URL"), "{v}");
        }
    }
    // Two credentials: neither is guessed at.
    for pair in [[A_READER, A_WRITER], [A_WRITER, A_READER]] {
        let response = app
            .clone()
            .oneshot(
                Request::builder()
                    .uri(format!("/v1/sessions/{id}/context"))
                    .header(header::AUTHORIZATION, format!("Bearer {}", pair[0]))
                    .header(header::AUTHORIZATION, format!("Bearer {}", pair[1]))
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{pair:?}");
    }
    let (s, v) = post(&app, &uri, Some("tenant-a-writer-0123456788"), &body).await;
    assert_error(s, &v, StatusCode::UNAUTHORIZED, "unauthorized");
    assert!(
        !v.to_string().contains("0123456788"),
        "the token is not echoed: {v}"
    );
    let (s, v, _) = call(&app, Method::GET, "/readyz", None, None, Body::empty()).await;
    assert_eq!(s, StatusCode::OK, "probes need no token: {v}");
    // 403 without the scope.
    let (s, v) = post(&app, &uri, Some(A_READER), &body).await;
    assert_error(s, &v, StatusCode::FORBIDDEN, "forbidden");
    assert_eq!(store.head_seq(id).await.unwrap(), 0, "nothing written");

    let (s, v) = post(&app, &uri, Some(A_WRITER), &body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(store.session_owner(id).await.unwrap().as_deref(), Some("a"));
    let (s, v) = get(
        &app,
        &format!("/v1/sessions/{id}/activations"),
        Some(A_READER),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["tools"][0]["name"], "web_fetch");

    // Tenant b: a's session answers exactly like a missing one, on reads
    // and on appends at any expected seq (a 409 would tell it exists).
    let missing = Uuid::new_v4();
    for path in ["context", "activations", "recover", "events", "stream"] {
        let (s, theirs) = get(&app, &format!("/v1/sessions/{id}/{path}"), Some(B_WRITER)).await;
        let (s2, none) = get(
            &app,
            &format!("/v1/sessions/{missing}/{path}"),
            Some(B_WRITER),
        )
        .await;
        assert_eq!(
            (s, s2),
            (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND),
            "{path}"
        );
        assert_eq!(
            theirs.to_string().replace(&id.to_string(), "ID"),
            none.to_string().replace(&missing.to_string(), "ID"),
            "{path}"
        );
    }
    // Whatever the batch holds: an id named twice, an unreadable event.
    let twice = json!({"event_id": Uuid::new_v4(), "type": "prompt_submitted", "text": "hijack"});
    for expected in [0, 3, 6] {
        for events in [
            json!([{"type": "prompt_submitted", "text": "hijack"}]),
            json!([twice, twice]),
            json!([{"type": "prompt_submitted", "text": "x"}, {"type": "nope"}]),
        ] {
            let b = json!({"expected_seq": expected, "events": events});
            let (s, v) = post(&app, &uri, Some(B_WRITER), &b).await;
            assert_error(s, &v, StatusCode::NOT_FOUND, "not_found");
        }
    }
    assert_eq!(store.head_seq(id).await.unwrap(), 6, "b wrote nothing");

    // b's own session is b's; a cannot see it.
    let mine = Uuid::new_v4();
    let (s, _) = post(&app, &events_uri(mine), Some(B_WRITER), &body).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, _) = get(
        &app,
        &format!("/v1/sessions/{mine}/recover"),
        Some(A_WRITER),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // A session written by the CLI or the library is the default tenant's:
    // invisible to a and b, visible to a server without tokens.
    let operator = Uuid::new_v4();
    store
        .append(
            operator,
            0,
            vec![session_store::NewEvent::new(
                session_store::EventBody::SessionStarted {
                    mode: "m".into(),
                    metadata: None,
                },
            )],
        )
        .await
        .unwrap();
    let (s, _) = get(
        &app,
        &format!("/v1/sessions/{operator}/recover"),
        Some(A_WRITER),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let open_app = router(&store, ServerConfig::default());
    let (s, _) = get(&open_app, &format!("/v1/sessions/{operator}/recover"), None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = get(&open_app, &format!("/v1/sessions/{id}/recover"), None).await;
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "a's session is not the default tenant's"
    );
});

both_backends!(
    bad_input_answers_4xx_and_changes_nothing,
    |url: String| async move {
        let store = open(&url, StoreOptions::default()).await;
        let app = router(
            &store,
            ServerConfig {
                body_limit: 32 * 1024,
                ..ServerConfig::default()
            },
        );
        let id = Uuid::new_v4();
        let uri = events_uri(id);
        let (s, _) = post(
            &app,
            &uri,
            None,
            &json!({"expected_seq": 0, "events": searched_batch()}),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED);
        let before = store.history(id, 0, 1000).await.unwrap();
        let sessions_before = store.sessions().await.unwrap();

        let sql = "x'); DROP TABLE events; --";
        let cases: Vec<(&str, Option<&str>, String, StatusCode)> = vec![
        ("malformed JSON", Some("application/json"), "{\"expected_seq\": 6, \"events\": [".into(), StatusCode::BAD_REQUEST),
        ("not an object", Some("application/json"), "[1, 2]".into(), StatusCode::BAD_REQUEST),
        ("wrong content type", Some("application/x-www-form-urlencoded"), "expected_seq=6".into(), StatusCode::UNSUPPORTED_MEDIA_TYPE),
        ("no content type", None, json!({"expected_seq": 6, "events": []}).to_string(), StatusCode::UNSUPPORTED_MEDIA_TYPE),
        ("huge body", Some("application/json"), format!("{{\"expected_seq\": 6, \"events\": [{{\"type\": \"prompt_submitted\", \"text\": \"{}\"}}]}}", "y".repeat(40_000)), StatusCode::PAYLOAD_TOO_LARGE),
        ("unknown top-level field", Some("application/json"), json!({"expected_seq": 6, "events": [], "force": true}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("unknown event field", Some("application/json"), json!({"expected_seq": 6, "events": [{"type": "prompt_submitted", "text": "t", "admin": true}]}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("seq given", Some("application/json"), json!({"expected_seq": 6, "events": [{"type": "prompt_submitted", "text": "t", "seq": 1}]}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("another session_id", Some("application/json"), json!({"expected_seq": 6, "events": [{"type": "prompt_submitted", "text": "t", "session_id": Uuid::new_v4()}]}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("the path's own session_id", Some("application/json"), json!({"expected_seq": 6, "events": [{"type": "prompt_submitted", "text": "t", "session_id": id}]}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("recorded_at, even null", Some("application/json"), json!({"expected_seq": 6, "events": [{"type": "prompt_submitted", "text": "t", "recorded_at": null}]}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("stale, with an invalid event: the conflict first (§2)", Some("application/json"), json!({"expected_seq": 2, "events": [{"type": "tool_call", "call_id": "c"}]}).to_string(), StatusCode::CONFLICT),
        ("negative expected_seq", Some("application/json"), json!({"expected_seq": -1, "events": []}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("string expected_seq", Some("application/json"), json!({"expected_seq": "6", "events": []}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("SQL in a mismatched result", Some("application/json"), json!({"expected_seq": 6, "events": [{"type": "tool_result", "call_id": "c1", "tool_name": sql, "status": "success"}]}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("SQL with a control character", Some("application/json"), json!({"expected_seq": 6, "events": [{"type": "tool_call", "call_id": "c9", "tool_name": format!("{sql}\u{0}"), "input": null}]}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
        ("SQL in a catalog, then a bad event", Some("application/json"), json!({"expected_seq": 6, "events": [{"type": "catalog_defined", "mode": "code", "deferred_tools": [sql]}, {"type": "mode_switched"}]}).to_string(), StatusCode::UNPROCESSABLE_ENTITY),
    ];
        for (what, ct, body, want) in cases {
            let (s, v, text) = call(&app, Method::POST, &uri, None, ct, body).await;
            assert_eq!(s, want, "{what}: {text}");
            assert!(
                v["error"].is_string() && v["message"].is_string(),
                "{what}: a JSON error, not {text}"
            );
        }
        // Ids that are paths or SQL: refused before any query.
        for bad in [
            "..%2F..%2Fetc%2Fpasswd",
            "%2e%2e",
            "1%27%3B%20DROP%20TABLE%20events%3B--",
            "%00",
        ] {
            for path in ["events", "context", "recover"] {
                let (s, v) = get(&app, &format!("/v1/sessions/{bad}/{path}"), None).await;
                assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
            }
            let (s, v) = post(
                &app,
                &format!("/v1/sessions/{bad}/events"),
                None,
                &json!({"expected_seq": 0, "events": []}),
            )
            .await;
            assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
        }
        let (s, v) = get(&app, "/v1/sessions/../../etc/passwd", None).await;
        assert!(s.is_client_error(), "{s} {v}");

        assert_eq!(
            store.history(id, 0, 1000).await.unwrap(),
            before,
            "the log is unchanged"
        );
        assert_eq!(
            store.sessions().await.unwrap(),
            sessions_before,
            "no session was created"
        );

        // A SQL-looking name that is a valid tool name is data: stored and read
        // back verbatim, and the tables are intact.
        let ok = json!({"expected_seq": 6, "events": [
            {"type": "tool_call", "call_id": "c2", "tool_name": sql, "input": {"q": "'; DELETE FROM views; --"}}
        ]});
        let (s, v) = post(&app, &uri, None, &ok).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (_, page) = get(&app, &format!("{uri}?after_seq=6"), None).await;
        assert_eq!(page["events"][0]["tool_name"], sql);
        assert_eq!(page["events"][0]["input"]["q"], "'; DELETE FROM views; --");
        assert_eq!(store.history(id, 0, 1000).await.unwrap().len(), 7);
        assert_eq!(
            store.verify(id).await.unwrap(),
            None,
            "the view agrees with the log"
        );
    }
);

/// Reads SSE frames until `want` events (`event:` lines) arrived.
async fn read_sse(body: &mut Body, want: usize) -> Vec<(String, String, Value)> {
    let mut text = String::new();
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while out.len() < want {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .expect("stream events in time")
            .expect("stream open")
            .expect("frame");
        if let Ok(data) = frame.into_data() {
            text.push_str(&String::from_utf8_lossy(&data));
        }
        while let Some(end) = text.find("\n\n") {
            let block: String = text.drain(..end + 2).collect();
            let (mut kind, mut id, mut data) = (String::new(), String::new(), String::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    kind = v.to_owned();
                } else if let Some(v) = line.strip_prefix("id: ") {
                    id = v.to_owned();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data.push_str(v);
                }
            }
            if !kind.is_empty() {
                out.push((kind, id, serde_json::from_str(&data).unwrap_or(Value::Null)));
            }
        }
    }
    out
}

async fn open_stream(app: &Router, uri: &str, last_event_id: Option<&str>) -> Body {
    let mut req = Request::builder().uri(uri);
    if let Some(l) = last_event_id {
        req = req.header("last-event-id", l);
    }
    let response = app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers()[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    response.into_body()
}

/// A server on a store that reads no window for its latest answers, as
/// it does for a window longer than 2 000 events: what a session never
/// compacted gets, without writing 2 000 events.
async fn rowless_app(url: &str) -> (Arc<Store>, Router) {
    let store = open(
        url,
        StoreOptions {
            rowless_window: 0,
            ..StoreOptions::default()
        },
    )
    .await;
    let app = router(&store, ServerConfig::default());
    (store, app)
}

/// GET …/context (cold) and the fold's answer (`at_seq`) are the same
/// bytes; answers how many rows it has.
async fn same_context_as_the_fold(app: &Router, store: &Store, id: Uuid, latest: i64) -> usize {
    store.clear_cache();
    let mut texts = Vec::new();
    for uri in [
        format!("/v1/sessions/{id}/context"),
        format!("/v1/sessions/{id}/context?at_seq={latest}"),
    ] {
        let (s, _, t) = call(app, Method::GET, &uri, None, None, Body::empty()).await;
        assert_eq!(s, StatusCode::OK, "{t}");
        texts.push(t);
    }
    assert!(
        texts[0] == texts[1],
        "the streamed context differs from the fold at {latest}"
    );
    let v: Value = serde_json::from_str(&texts[0]).unwrap();
    v["rows"].as_array().unwrap().len()
}

both_backends!(
    a_long_context_is_sent_as_its_rows_are_read,
    |url: String| async move {
        // A store that reads no window for the latest answers (as for a
        // window of more than 2 000 events): GET …/context writes the
        // rows a page at a time, the same bytes as the fold's answer
        // (`at_seq` the latest), before and after a compaction that keeps
        // a row from before the view.
        let (store, app) = rowless_app(&url).await;
        let id = Uuid::new_v4();
        let uri = events_uri(id);
        let mut events = vec![
            json!({"event_id": "5e55a0d1-0000-4000-8000-000000000001", "type": "session_started", "mode": "code"}),
        ];
        for i in 0..2_100 {
            events.push(json!({"type": "prompt_submitted", "text": format!("p{i} \u{1b}")}));
        }
        events.push(json!({"event_id": "5e55a0d1-0000-4000-8000-000000000099", "type": "assistant_message", "text": "a"}));
        let (status, v) = post(
            &app,
            &uri,
            None,
            &json!({"expected_seq": 0, "events": events}),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        assert_eq!(
            same_context_as_the_fold(&app, &store, id, 2_102).await,
            2_101
        );
        let kept = store.history(id, 10, 1).await.unwrap()[0].event_id;
        let (status, v) = post(
            &app,
            &uri,
            None,
            &json!({"expected_seq": 2_102, "events": [
                {"type": "compaction", "summary": "s", "first_kept_event_id": kept},
                {"type": "assistant_message", "text": "b"}
            ]}),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        // Rows 11 to 2 101, and the two assistant messages.
        assert_eq!(
            same_context_as_the_fold(&app, &store, id, 2_104).await,
            2_093
        );
    }
);

both_backends!(
    a_stream_started_from_a_view_alone_follows_compactions,
    |url: String| async move {
        // A store that answers from the view alone whatever the window's
        // length (as it does for a window of more than 2 000 events): the
        // stream holds no window rows, and a compaction that keeps a row
        // from before the view, then one that keeps a later row, move the
        // window as the fold does.
        let (store, app) = rowless_app(&url).await;
        let id = Uuid::new_v4();
        let uri = events_uri(id);
        let e = |seq: u32| format!("5e55a0d1-0000-4000-8000-{seq:012}");
        let first = json!([
            {"event_id": e(1), "type": "session_started", "mode": "code"},
            {"event_id": e(2), "type": "catalog_defined", "mode": "code", "deferred_tools": ["web_fetch", "image_view"]},
            {"event_id": e(3), "type": "prompt_submitted", "text": "p1"},
            {"event_id": e(4), "type": "tool_call", "call_id": "c1", "tool_name": "ToolSearch", "input": null},
            {"event_id": e(5), "type": "tool_result", "call_id": "c1", "tool_name": "ToolSearch", "status": "success", "added_tool_names": ["web_fetch"]},
            {"event_id": e(6), "type": "prompt_submitted", "text": "p2"}
        ]);
        let (status, v) = post(
            &app,
            &uri,
            None,
            &json!({"expected_seq": 0, "events": first}),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        // As after a restart: the append's state is not in the cache.
        store.clear_cache();
        let mut live = open_stream(&app, &format!("/v1/sessions/{id}/stream"), None).await;
        let hello = read_sse(&mut live, 1).await;
        assert_eq!(hello[0].0, "activations");
        assert_eq!(
            hello[0].2["tools"],
            json!([{"name": "web_fetch", "evidence_seq": 5}])
        );
        // A client reconnecting at the view (its last event, 6) starts
        // from the view alone too, and is sent the set at 6 again.
        let mut resumed = open_stream(&app, &format!("/v1/sessions/{id}/stream"), Some("6")).await;
        let again = read_sse(&mut resumed, 1).await;
        assert_eq!(again[0].0, "activations");
        assert_eq!(again[0].2, hello[0].2);
        let more = json!([
            {"event_id": e(7), "type": "tool_call", "call_id": "c2", "tool_name": "ToolSearch", "input": null},
            {"event_id": e(8), "type": "tool_result", "call_id": "c2", "tool_name": "ToolSearch", "status": "success", "added_tool_names": ["image_view"]},
            {"event_id": e(9), "type": "compaction", "summary": "s1", "first_kept_event_id": e(4)},
            {"event_id": e(10), "type": "prompt_submitted", "text": "p3"},
            {"event_id": e(11), "type": "compaction", "summary": "s2", "first_kept_event_id": e(7)},
            {"event_id": e(12), "type": "prompt_submitted", "text": "p4"}
        ]);
        let (status, v) = post(
            &app,
            &uri,
            None,
            &json!({"expected_seq": 6, "events": more}),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        let got = read_sse(&mut live, 8).await;
        assert_eq!(read_sse(&mut resumed, 8).await, got, "the resumed stream");
        let sets: Vec<(&str, &Value)> = got
            .iter()
            .filter(|(k, _, _)| k == "activations")
            .map(|(_, i, v)| (i.as_str(), v))
            .collect();
        assert_eq!(sets.len(), 2, "{got:?}");
        for (at, set) in sets {
            let folded = store
                .activations(id, Some(at.parse().unwrap()))
                .await
                .unwrap();
            assert_eq!(*set, serde_json::to_value(folded).unwrap(), "at {at}");
        }
        // The second compaction left only image_view's evidence.
        assert_eq!(
            got[7].2["tools"],
            json!([{"name": "image_view", "evidence_seq": 8}])
        );
        // A client resuming from before the view (now at 12) starts from
        // a fold of the log up to its cursor that keeps no rows, and
        // follows both compactions as the live stream did.
        let mut early = open_stream(&app, &format!("/v1/sessions/{id}/stream"), Some("4")).await;
        let replayed = read_sse(&mut early, 11).await;
        let ids: Vec<&str> = replayed[..3].iter().map(|(_, i, _)| i.as_str()).collect();
        assert_eq!(ids, ["5", "6", "6"], "{replayed:?}");
        assert_eq!(replayed[2].0, "activations");
        assert_eq!(replayed[2].2, hello[0].2);
        assert_eq!(replayed[3..], got[..], "the stream resumed before the view");
    }
);

both_backends!(
    stream_sends_new_events_and_activations_and_resumes,
    |url: String| async move {
        let store = open(&url, StoreOptions::default()).await;
        let app = router(&store, ServerConfig::default());
        let id = Uuid::new_v4();
        let uri = events_uri(id);
        let first = json!([
            {"type": "session_started", "mode": "code"},
            {"type": "catalog_defined", "mode": "code", "deferred_tools": ["web_fetch"]},
            {"type": "prompt_submitted", "text": "hi"}
        ]);
        assert_eq!(
            post(
                &app,
                &uri,
                None,
                &json!({"expected_seq": 0, "events": first})
            )
            .await
            .0,
            StatusCode::CREATED
        );

        // Without a cursor: the current activation set, then new events.
        let mut live = open_stream(&app, &format!("/v1/sessions/{id}/stream"), None).await;
        let hello = read_sse(&mut live, 1).await;
        assert_eq!(hello[0].0, "activations");
        assert_eq!(hello[0].1, "3");
        assert_eq!(hello[0].2["tools"], json!([]));
        let more = json!([
            {"type": "tool_call", "call_id": "c1", "tool_name": "ToolSearch", "input": null},
            {"type": "tool_result", "call_id": "c1", "tool_name": "ToolSearch", "status": "success", "added_tool_names": ["web_fetch"]},
            {"type": "prompt_submitted", "text": "use it"}
        ]);
        assert_eq!(
            post(
                &app,
                &uri,
                None,
                &json!({"expected_seq": 3, "events": more})
            )
            .await
            .0,
            StatusCode::CREATED
        );
        let got = read_sse(&mut live, 4).await;
        let kinds: Vec<(&str, &str)> = got
            .iter()
            .map(|(k, i, _)| (k.as_str(), i.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("event", "4"),
                ("event", "5"),
                ("event", "6"),
                ("activations", "6")
            ]
        );
        assert_eq!(got[1].2["type"], "tool_result");
        assert_eq!(got[1].2["seq"], 5);
        assert_eq!(
            got[3].2,
            json!({"session_id": id, "as_of_seq": 6, "mode": "code", "tools": [{"name": "web_fetch", "evidence_seq": 5}]})
        );

        // Resuming after seq 4 replays 5 and 6 (Last-Event-ID wins over
        // after_seq), with the activation set folded from the start.
        let mut resumed = open_stream(
            &app,
            &format!("/v1/sessions/{id}/stream?after_seq=1"),
            Some("4"),
        )
        .await;
        let got = read_sse(&mut resumed, 3).await;
        let kinds: Vec<(&str, &str)> = got
            .iter()
            .map(|(k, i, _)| (k.as_str(), i.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [("event", "5"), ("event", "6"), ("activations", "6")]
        );
        assert_eq!(got[2].2["tools"][0]["name"], "web_fetch");
        // Resuming at a refresh point (a client cut off between `event 6`
        // and `activations 6`, which share the id) gets that set again.
        let mut at_refresh =
            open_stream(&app, &format!("/v1/sessions/{id}/stream"), Some("6")).await;
        let got = read_sse(&mut at_refresh, 1).await;
        assert_eq!((got[0].0.as_str(), got[0].1.as_str()), ("activations", "6"));
        assert_eq!(got[0].2["tools"][0]["name"], "web_fetch");
        let mut from_start =
            open_stream(&app, &format!("/v1/sessions/{id}/stream?after_seq=0"), None).await;
        let got = read_sse(&mut from_start, 2).await;
        assert_eq!((got[0].1.as_str(), got[1].1.as_str()), ("1", "2"));

        // Bad cursors.
        let (s, v, _) = call(
            &app,
            Method::GET,
            &format!("/v1/sessions/{id}/stream?after_seq=99"),
            None,
            None,
            Body::empty(),
        )
        .await;
        assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "seq_out_of_range");
        // Not an id this server sends: a word, a sign, nothing.
        for last in ["abc", "+3", "-0", ""] {
            let req = Request::builder()
                .uri(format!("/v1/sessions/{id}/stream"))
                .header("last-event-id", last)
                .body(Body::empty())
                .unwrap();
            let r = app.clone().oneshot(req).await.unwrap();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{last:?}");
        }
    }
);

both_backends!(
    a_timed_out_append_still_commits_once,
    |url: String| async move {
        let store = open(
            &url,
            StoreOptions {
                fault_pause_before_commit: Some(Duration::from_millis(700)),
                ..StoreOptions::default()
            },
        )
        .await;
        let app = router(
            &store,
            ServerConfig {
                request_timeout: Duration::from_millis(100),
                ..ServerConfig::default()
            },
        );
        let id = Uuid::new_v4();
        let event_id = Uuid::new_v4();
        let body = json!({"expected_seq": 0, "events": [{"type": "session_started", "mode": "m", "event_id": event_id}]});
        let (s, v) = post(&app, &events_uri(id), None, &body).await;
        assert_error(s, &v, StatusCode::SERVICE_UNAVAILABLE, "timeout");
        assert!(
            v["message"]
                .as_str()
                .unwrap_or("")
                .contains("may still commit"),
            "{v}"
        );
        // The append was not cut off: it commits, and the retry the message
        // suggests is answered as a replay.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while store.head_seq(id).await.unwrap() == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the append committed"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // And it is counted, though its request was cut off (the counters
        // were the handler's, which the timeout dropped).
        // Its request too, as the 503 it answered (the histogram was
        // outside the timeout and never saw it).
        let counted = "session_store_appends_total{outcome=\"ok\"} 1";
        let timed_out = "session_store_http_request_duration_seconds_count{route=\"/v1/sessions/{id}/events\",method=\"POST\",status=\"503\"} 1";
        loop {
            let (_, _, text) = call(&app, Method::GET, "/metrics", None, None, Body::empty()).await;
            if text.contains(counted)
                && text.contains("session_store_appended_events_total 1")
                && text.contains(timed_out)
            {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{text}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let patient = router(&store, ServerConfig::default());
        let (s, v) = post(&patient, &events_uri(id), None, &body).await;
        assert_eq!(
            (s, v["replayed"].as_bool()),
            (StatusCode::CREATED, Some(true)),
            "{v}"
        );
        assert_eq!(store.head_seq(id).await.unwrap(), 1);
    }
);

both_backends!(
    shutdown_finishes_in_flight_appends,
    |url: String| async move {
        let store = open(
            &url,
            StoreOptions {
                fault_pause_before_commit: Some(Duration::from_millis(800)),
                ..StoreOptions::default()
            },
        )
        .await;
        let server = Server::new(store.clone(), ServerConfig::default());
        let (addr, stop, serving) = serve_until_stopped(server).await;
        let id = Uuid::new_v4();
        let client = reqwest::Client::new();
        let append = tokio::spawn({
            let client = client.clone();
            async move {
                client
                .post(format!("http://{addr}/v1/sessions/{id}/events"))
                .json(&json!({"expected_seq": 0, "events": [{"type": "session_started", "mode": "m"}]}))
                .send()
                .await
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        stop.send(()).unwrap();
        let response = append
            .await
            .unwrap()
            .expect("the in-flight append is answered");
        assert_eq!(response.status(), 201);
        tokio::time::timeout(Duration::from_secs(10), serving)
            .await
            .expect("shutdown finishes")
            .unwrap()
            .unwrap();
        assert_eq!(store.head_seq(id).await.unwrap(), 1, "and committed");
        assert!(
            client
                .get(format!("http://{addr}/healthz"))
                .send()
                .await
                .is_err(),
            "no longer listening"
        );
    }
);

both_backends!(shutdown_ends_open_streams, |url: String| async move {
    let store = open(&url, StoreOptions::default()).await;
    let id = Uuid::new_v4();
    store
        .append(
            id,
            0,
            vec![session_store::NewEvent::new(
                session_store::EventBody::SessionStarted {
                    mode: "m".into(),
                    metadata: None,
                },
            )],
        )
        .await
        .unwrap();
    let server = Server::new(store.clone(), ServerConfig::default());
    let (addr, stop, serving) = serve_until_stopped(server).await;
    let response = reqwest::get(format!("http://{addr}/v1/sessions/{id}/stream"))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    stop_serving(stop, serving, "a stream does not hold shutdown up").await;
    // The body ends (cleanly or by a reset) instead of hanging.
    let _ = tokio::time::timeout(Duration::from_secs(5), response.bytes())
        .await
        .expect("the stream ended");
});

both_backends!(
    shutdown_cuts_a_long_refresh_history_off,
    |url: String| async move {
        use session_store::{EventBody, NewEvent};
        let store = open(&url, StoreOptions::default()).await;
        let id = Uuid::new_v4();
        let tools: Vec<String> = (0..20).map(|i| format!("deferred_tool_{i:02}")).collect();
        let mut batch = vec![
            NewEvent::new(EventBody::SessionStarted {
                mode: "m".into(),
                metadata: None,
            }),
            NewEvent::new(EventBody::CatalogDefined {
                mode: "m".into(),
                deferred_tools: tools.clone(),
            }),
            NewEvent::new(EventBody::ToolCall {
                call_id: "c".into(),
                tool_name: "ToolSearch".into(),
                input: serde_json::json!({}),
            }),
            NewEvent::new(EventBody::ToolResult {
                call_id: "c".into(),
                tool_name: "ToolSearch".into(),
                status: session_store::ToolStatus::Success,
                output: None,
                added_tool_names: Some(tools),
            }),
        ];
        // About 12 MB of refresh points, every one listing 20 tools.
        let mut seq = 0;
        for round in 0..12 {
            batch.extend((0..1_000).map(|i| {
                NewEvent::new(EventBody::PromptSubmitted {
                    text: format!("p{round}.{i}"),
                })
            }));
            seq = store
                .append(id, seq, std::mem::take(&mut batch))
                .await
                .unwrap()
                .events
                .last()
                .unwrap()
                .seq;
        }
        let server = Server::new(store.clone(), ServerConfig::default());
        let (addr, stop, serving) = serve_until_stopped(server).await;
        let mut response = reqwest::get(format!("http://{addr}/v1/sessions/{id}/refreshes"))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        // A client that reads, slowly: the whole answer would take it
        // minutes.
        let reader = tokio::spawn(async move {
            let mut read = 0;
            while let Ok(Some(chunk)) = response.chunk().await {
                read += chunk.len();
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            read
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(()).unwrap();
        // Within the default 30 s grace, well before the answer's end.
        tokio::time::timeout(Duration::from_secs(10), serving)
            .await
            .expect("a refresh history does not hold shutdown up")
            .unwrap()
            .unwrap();
        let read = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .expect("the body ended")
            .unwrap();
        eprintln!("{read} bytes read before the cut");
        assert!(
            read < 6_000_000,
            "{read} bytes read: the body was not cut off"
        );
    }
);

#[test]
fn committed_openapi_document_matches_the_code() {
    let committed =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json"))
            .expect("docs/openapi.json exists");
    let generated = session_store::server::openapi_json();
    assert!(
        committed == generated,
        "docs/openapi.json is stale: run `cargo run -- openapi > docs/openapi.json` and commit it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_clients_cannot_hold_connections_and_the_cap_queues_the_rest() {
    // A client that connects and sends nothing, half a request's headers,
    // or nothing more after an answer (kept alive) is closed after the
    // header timeout; at the connection cap, a new client waits for a slot
    // instead of being accepted and starved (docs/api.md, "Limits").
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let server = Server::new(
        store,
        ServerConfig {
            header_timeout: Duration::from_secs(1),
            max_connections: 3,
            ..ServerConfig::default()
        },
    );
    let (addr, stop, serving) = serve_until_stopped(server).await;
    let connect = || tokio::net::TcpStream::connect(addr);
    let request = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n";
    let mut silent = connect().await.unwrap();
    let mut half = connect().await.unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .unwrap();
    let mut kept = connect().await.unwrap();
    kept.write_all(request).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = kept.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    // The cap is reached: a fourth client is answered once a slot frees.
    let started = std::time::Instant::now();
    let mut fourth = connect().await.unwrap();
    fourth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), fourth.read_to_end(&mut answer))
        .await
        .expect("the fourth client was answered")
        .unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "answered after {:?}: the cap did not hold it",
        started.elapsed()
    );
    // The three stalled clients were closed by the server.
    for (name, conn) in [
        ("silent", &mut silent),
        ("half", &mut half),
        ("kept", &mut kept),
    ] {
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut rest))
            .await
            .unwrap_or_else(|_| panic!("the {name} connection is still open"))
            .unwrap();
    }
    stop_serving(stop, serving, "shutdown").await;
}

#[tokio::test]
async fn answers_their_clients_do_not_read_are_held_within_the_response_memory() {
    // A client that asks for a large page and never reads it holds the
    // made answer; fifteen such clients took a server to 5 GB. Held
    // answers now count against --response-memory: one that finds it
    // spent answers 503 `busy` (and /metrics counts it so); small and HEAD
    // answers go on; and once the reader reads, the memory is free.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let s = Uuid::new_v4();
    use session_store::{EventBody, NewEvent};
    let started = NewEvent::new(EventBody::SessionStarted {
        mode: "agent".into(),
        metadata: None,
    });
    store.append(s, 0, vec![started]).await.unwrap();
    for i in 0..24 {
        let text = "x".repeat(1_000_000);
        let reply = NewEvent::new(EventBody::AssistantMessage { text });
        store.append(s, i + 1, vec![reply]).await.unwrap();
    }
    let server = Server::new(
        store,
        ServerConfig {
            response_memory: 2 << 20,
            ..ServerConfig::default()
        },
    );
    let (addr, stop, serving) = serve_until_stopped(server).await;
    // Sends a GET of `path` (the answer ends with the connection).
    let ask = |path: String| async move {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        conn.write_all(request.as_bytes()).await.unwrap();
        conn
    };
    let answer = |mut conn: tokio::net::TcpStream| async move {
        let mut all = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut all))
            .await
            .expect("answered")
            .unwrap();
        all
    };

    // A page of 5 MB (its first five events: pages stop at 4 MiB) that
    // nobody reads: more than the sockets' buffers and the 2 MiB held.
    let unread = ask(format!("/v1/sessions/{s}/events?limit=1000")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let refused = answer(ask(format!("/v1/sessions/{s}/events?limit=3")).await).await;
    let text = String::from_utf8_lossy(&refused);
    assert!(
        text.starts_with("HTTP/1.1 503"),
        "{}",
        &text[..text.len().min(300)]
    );
    assert!(text.contains("\"busy\""), "{text}");

    // A HEAD answer has no body to hold: not busy.
    let mut head = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "HEAD /v1/sessions/{s}/events?limit=3 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    );
    head.write_all(request.as_bytes()).await.unwrap();
    let head = answer(head).await;
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&head)
    );

    let small = answer(ask(format!("/v1/sessions/{s}/activations")).await).await;
    assert!(small.starts_with(b"HTTP/1.1 200"));

    let whole = answer(unread).await;
    assert!(whole.starts_with(b"HTTP/1.1 200"));
    assert!(whole.len() > 5_000_000, "{} bytes", whole.len());

    let metrics = answer(ask("/metrics".to_owned()).await).await;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("route=\"/v1/sessions/{id}/events\"")
                && l.contains("status=\"503\"")
                && l.contains("_count")),
        "{metrics}"
    );

    let again = answer(ask(format!("/v1/sessions/{s}/events?limit=3")).await).await;
    assert!(
        again.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        &again[..again.len().min(200)]
    );
    assert!(again.len() > 1_900_000, "{} bytes", again.len());

    stop_serving(stop, serving, "shutdown").await;
}

/// Sends an append of `session_started` to session `s`, its
/// Content-Length declared `extra` bytes longer than the body, shuts the
/// client's side and reads the whole answer.
async fn append_and_shut(addr: std::net::SocketAddr, s: Uuid, extra: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = r#"{"expected_seq":0,"events":[{"type":"session_started","mode":"agent"}]}"#;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(
        format!(
            "POST /v1/sessions/{s}/events HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len() + extra
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    conn.shutdown().await.unwrap();
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut all))
        .await
        .expect("answered")
        .unwrap();
    String::from_utf8_lossy(&all).into_owned()
}

#[tokio::test]
async fn a_client_that_shuts_its_side_after_the_request_still_gets_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let server = Server::new(store.clone(), ServerConfig::default());
    let (addr, stop, serving) = serve_until_stopped(server).await;
    // The race (the server reading the end of input while the answer is
    // being made) is lost now and then: twenty appends, every one answered.
    for _ in 0..20 {
        let s = Uuid::new_v4();
        let text = append_and_shut(addr, s, 0).await;
        assert!(text.starts_with("HTTP/1.1 201"), "{text:?}");
        assert_eq!(store.history(s, 0, 10).await.unwrap().len(), 1);
    }
    stop_serving(stop, serving, "shutdown").await;
}

/// The token is judged before the body is read: a client without one (or
/// with a bad one) is answered 401 at once, even if its body never comes,
/// instead of holding the connection and the server's memory until the
/// request timeout. A body that does come in pieces of a byte is read
/// whole (each piece is copied as it comes: kept as they came, pieces held
/// a read buffer each).
#[tokio::test]
async fn the_token_is_judged_before_the_body_and_a_body_in_tiny_pieces_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let server = Server::new(store.clone(), with_tokens());
    let (addr, stop, serving) = serve_until_stopped(server).await;
    let head = |s: Uuid, auth: &str, len: usize| {
        format!(
            "POST /v1/sessions/{s}/events HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        )
    };
    for auth in ["", "Authorization: Bearer not-a-token-of-this-server\r\n"] {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(head(Uuid::new_v4(), auth, 1000).as_bytes())
            .await
            .unwrap();
        let mut answer = [0u8; 12];
        tokio::time::timeout(Duration::from_secs(5), conn.read_exact(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("{auth:?}: no answer before the body"))
            .unwrap();
        assert_eq!(&answer, b"HTTP/1.1 401", "{auth:?}");
    }
    let s = Uuid::new_v4();
    let body = r#"{"expected_seq":0,"events":[{"type":"session_started","mode":"agent"}]}"#;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.set_nodelay(true).unwrap();
    let auth = format!("Authorization: Bearer {A_WRITER}\r\n");
    conn.write_all(head(s, &auth, body.len()).as_bytes())
        .await
        .unwrap();
    for byte in body.as_bytes() {
        conn.write_all(std::slice::from_ref(byte)).await.unwrap();
        conn.flush().await.unwrap();
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let mut answer = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), conn.read_exact(&mut answer))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(&answer, b"HTTP/1.1 201");
    assert_eq!(store.history(s, 0, 10).await.unwrap().len(), 1);
    stop_serving(stop, serving, "shutdown").await;
}

/// A stream whose client hangs up (here with a reset) gives its
/// connection back within a keep-alive period (5 s): at 15 s, a client
/// opening and dropping streams held every slot and made others wait.
#[tokio::test]
async fn a_stream_whose_client_hangs_up_is_gone_within_a_keep_alive_period() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let s = Uuid::new_v4();
    let started = session_store::NewEvent::new(session_store::EventBody::SessionStarted {
        mode: "agent".into(),
        metadata: None,
    });
    store.append(s, 0, vec![started]).await.unwrap();
    let server = Server::new(store.clone(), ServerConfig::default());
    let (addr, stop, serving) = serve_until_stopped(server).await;
    let open_streams = || async move {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("session_store_open_streams "))
            .and_then(|v| v.trim().parse::<i64>().ok())
            .unwrap_or_else(|| panic!("no open_streams in {text}"))
    };
    let mut streams = Vec::new();
    for _ in 0..5 {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(
            format!("GET /v1/sessions/{s}/stream HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut first = [0u8; 12];
        conn.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        streams.push(conn);
    }
    assert_eq!(open_streams().await, 5);
    let dropped = std::time::Instant::now();
    for conn in streams {
        // A zero linger resets the connection on drop; it does not block
        // (what the deprecation is about).
        #[allow(deprecated)]
        conn.set_linger(Some(Duration::ZERO)).unwrap();
        drop(conn);
    }
    while open_streams().await > 0 {
        assert!(
            dropped.elapsed() < Duration::from_secs(9),
            "streams still open {:?} after their clients reset them",
            dropped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop_serving(stop, serving, "shutdown").await;
}

/// A body cut short (the client closes its side before sending all of
/// its Content-Length) is answered 400 in the store's words, and nothing
/// is stored.
#[tokio::test]
async fn a_body_shorter_than_its_length_is_said_and_nothing_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let server = Server::new(store.clone(), ServerConfig::default());
    let (addr, stop, serving) = serve_until_stopped(server).await;
    let s = Uuid::new_v4();
    let text = append_and_shut(addr, s, 10).await;
    assert!(text.starts_with("HTTP/1.1 400"), "{text:?}");
    assert!(
        text.contains("the body could not be read to its end"),
        "{text:?}"
    );
    assert!(!text.contains("Failed to buffer"), "{text:?}");
    assert!(store.history(s, 0, 10).await.unwrap().is_empty());
    stop_serving(stop, serving, "shutdown").await;
}

/// A stored row the store cannot read back (here edited behind its back)
/// ends a stream that reaches it with one `error` event, instead of a
/// task that reads it again twice a second long after its client left.
#[tokio::test]
async fn a_stream_that_meets_an_unreadable_row_says_so_and_ends() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let app = router(&store, ServerConfig::default());
    let id = Uuid::new_v4();
    let body = json!({"expected_seq": 0, "events": [
        {"type": "session_started", "mode": "m"},
        {"type": "prompt_submitted", "text": "one"},
        {"type": "prompt_submitted", "text": "two"}
    ]});
    let (s, v) = post(&app, &events_uri(id), None, &body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let url = format!("sqlite://{}", dir.path().join("s.db").display());
    tokio::task::spawn_blocking(move || {
        common::raw_sql(
            &url,
            "DROP TRIGGER events_no_update; UPDATE events SET payload = '{not json' WHERE seq = 3;",
        )
    })
    .await
    .unwrap();
    let mut body = open_stream(&app, &format!("/v1/sessions/{id}/stream?after_seq=1"), None).await;
    // The page holding seq 2 and 3 cannot be read: the error names the
    // last seq delivered, 1, where a client resumes.
    let got = read_sse(&mut body, 1).await;
    assert_eq!(
        (got[0].0.as_str(), got[0].1.as_str()),
        ("error", "1"),
        "{got:?}"
    );
    assert_eq!(got[0].2["error"], "internal", "{got:?}");
    // And the stream ends.
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(frame) = body.frame().await {
            frame.unwrap();
        }
    })
    .await;
    assert!(end.is_ok(), "the stream went on after its error");
}

/// An append's memory grows with its events whatever their size, so the
/// number of events one append carries is bounded (`--max-batch-events`):
/// more answer 413 and store nothing.
#[tokio::test]
async fn an_append_over_the_event_limit_answers_413_and_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let app = router(
        &store,
        ServerConfig {
            max_batch_events: 3,
            ..ServerConfig::default()
        },
    );
    let id = Uuid::new_v4();
    let batch = |n: usize| {
        let mut events = vec![json!({"type": "session_started", "mode": "m"})];
        events.extend((1..n).map(|i| json!({"type": "prompt_submitted", "text": i.to_string()})));
        json!({"expected_seq": 0, "events": events})
    };
    let (s, v) = post(&app, &events_uri(id), None, &batch(4)).await;
    assert_error(s, &v, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    let message = v["message"].as_str().unwrap();
    assert!(
        message.contains("4 events, over the limit of 3"),
        "{message}"
    );
    assert!(matches!(
        store.head_seq(id).await,
        Ok(0) | Err(session_store::Error::SessionNotFound(_))
    ));
    let (s, v) = post(&app, &events_uri(id), None, &batch(3)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

/// The append takes its batch and expected seq from the body: a query
/// string is refused, not ignored, and stores nothing; an unknown
/// parameter of a route with one or two is answered with them.
#[tokio::test]
async fn an_append_with_a_query_string_is_refused_and_unknown_parameters_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let app = router(&store, ServerConfig::default());
    let id = Uuid::new_v4();
    let body = json!({"expected_seq": 0, "events": [{"type": "session_started", "mode": "m"}]});
    for q in ["?expected_seq=0", "?foo=1"] {
        let (s, v) = post(&app, &format!("{}{q}", events_uri(id)), None, &body).await;
        assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
        assert!(v["message"].as_str().unwrap().contains("takes none"), "{v}");
    }
    let (s, v) = post(&app, &events_uri(id), None, &body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(
        v["events"][0]["seq"], 1,
        "the refused appends stored nothing"
    );
    for (route, takes) in [
        ("events?foo=1", "`after_seq` or `limit`"),
        ("context?limit=1", "`at_seq`"),
    ] {
        let (s, v) = get(&app, &format!("/v1/sessions/{id}/{route}"), None).await;
        assert_error(s, &v, StatusCode::BAD_REQUEST, "bad_request");
        let message = v["message"].as_str().unwrap();
        assert!(
            message.ends_with(&format!("this request takes {takes}")),
            "{message}"
        );
    }
}

#[tokio::test]
async fn a_body_in_a_coding_the_server_does_not_decode_is_415() {
    let dir = tempfile::tempdir().unwrap();
    let app = router(&store_in(&dir).await, ServerConfig::default());
    let uri = events_uri(Uuid::new_v4());
    // A coding the server does not decode is 415 too, whatever the body
    // (a plain body labelled `br` was stored; a gzip one said "not JSON").
    let plain = json!({"expected_seq": 0, "events": [{"type": "session_started", "mode": "m"}]});
    for coding in ["br", "gzip", "identity, gzip"] {
        let request = Request::builder()
            .method(Method::POST)
            .uri(&uri)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_ENCODING, coding)
            .body(Body::from(plain.to_string()))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_error(
            status,
            &v,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        );
        assert!(
            v["message"].as_str().unwrap().contains("gzip") || coding == "br",
            "{v}"
        );
    }
    // A charset other than UTF-8, and two types: 415 naming why; UTF-8
    // said in any case is JSON's own.
    for (types, says) in [
        (
            &["application/json; charset=utf-16"][..],
            Some("\"utf-16\""),
        ),
        (&["application/json;charset=\"latin1\""], Some("\"latin1\"")),
        (
            &["application/json", "text/plain"],
            Some("2 different `Content-Type` headers"),
        ),
        (&["application/json; charset=UTF-8"], None),
        (&["application/json; charset=utf8"], None),
        (&["application/json; charset=us-ascii"], None),
        (&["application/json", "Application/JSON"], None),
    ] {
        // A session of its own: the `identity` case below stores in `uri`.
        let uri = events_uri(Uuid::new_v4());
        let mut request = Request::builder().method(Method::POST).uri(&uri);
        for t in types {
            request = request.header(header::CONTENT_TYPE, *t);
        }
        let response = app
            .clone()
            .oneshot(request.body(Body::from(plain.to_string())).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        match says {
            Some(says) => {
                assert_error(
                    status,
                    &v,
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                );
                assert!(v["message"].as_str().unwrap().contains(says), "{v}");
            }
            None => assert_eq!(status, StatusCode::CREATED, "{types:?}: {v}"),
        }
    }
    // `identity` is no coding at all.
    let request = Request::builder()
        .method(Method::POST)
        .uri(&uri)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_ENCODING, "identity")
        .body(Body::from(plain.to_string()))
        .unwrap();
    assert_eq!(
        app.clone().oneshot(request).await.unwrap().status(),
        StatusCode::CREATED
    );
}

/// The lag histogram times the delivery of what was appended while a
/// stream was open: a catch-up over an imported past (whose events keep
/// their source's `recorded_at`, here the year 2000) is not lag, which
/// made the histogram's sum reach 6.4e10 s.
#[tokio::test]
async fn stream_lag_counts_only_what_was_appended_while_it_was_open() {
    use session_store::{EventBody, NewEvent};
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let app = router(&store, ServerConfig::default());
    let id = Uuid::new_v4();
    let past: chrono::DateTime<chrono::Utc> = "2000-01-01T00:00:00Z".parse().unwrap();
    let old = |body: EventBody| NewEvent {
        recorded_at: Some(past),
        ..NewEvent::new(body)
    };
    store
        .append(
            id,
            0,
            vec![
                old(EventBody::SessionStarted {
                    mode: "agent".into(),
                    metadata: None,
                }),
                old(EventBody::PromptSubmitted { text: "p1".into() }),
                old(EventBody::AssistantMessage { text: "a1".into() }),
            ],
        )
        .await
        .unwrap();
    // From seq 1 on: the two imported events come as a catch-up.
    let mut stream = open_stream(&app, &format!("/v1/sessions/{id}/stream"), Some("1")).await;
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|(k, i, _): &(String, String, Value)| k == "event" && i == "3")
    {
        seen.extend(read_sse(&mut stream, 1).await);
    }
    let (s, v) = post(
        &app,
        &events_uri(id),
        None,
        &json!({"expected_seq": 3, "events": [{"type": "prompt_submitted", "text": "p2"}]}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    while !seen.iter().any(|(k, i, _)| k == "event" && i == "4") {
        seen.extend(read_sse(&mut stream, 1).await);
    }
    let (_, _, text) = call(&app, Method::GET, "/metrics", None, None, Body::empty()).await;
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    assert_eq!(value("session_store_subscription_lag_seconds_count"), 1.0);
    assert!(
        value("session_store_subscription_lag_seconds_sum") < 60.0,
        "{text}"
    );
}

/// A large body is judged as a small one would be (its size and rules
/// in SEMANTICS §2's order: the expected seq, then the events one by
/// one), and while one parses, other requests are answered: bodies over
/// 64 KiB are parsed off the runtime (a review: two 8 MB bodies held
/// `/healthz` for 2.2 s, sixteen for 9.4 s).
#[tokio::test]
async fn large_bodies_are_judged_as_small_ones_and_hold_no_one_up() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("s.db").display().to_string();
    let store = open(
        &url,
        StoreOptions {
            max_event_bytes: 100_000,
            ..StoreOptions::default()
        },
    )
    .await;
    let app = router(&store, ServerConfig::default());
    let id = Uuid::new_v4();
    let uri = events_uri(id);
    let text = |n: usize| "x".repeat(n);
    let prompt = |n: usize| json!({"type": "prompt_submitted", "text": text(n)});
    // Under the event limit, over the inline bound: stored.
    let (s, v) = post(
        &app,
        &uri,
        None,
        &json!({"expected_seq": 0, "events": [
            {"type": "session_started", "mode": "m"}, prompt(80_000)]}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // An event over the limit: 422 at its index, nothing stored.
    let (s, v) = post(
        &app,
        &uri,
        None,
        &json!({"expected_seq": 2, "events": [prompt(10), prompt(150_000), prompt(10)]}),
    )
    .await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
    assert_eq!(
        (v["rule"].as_str(), v["index"].as_u64()),
        (Some("event-too-large"), Some(1)),
        "{v}"
    );
    assert_eq!(store.head_seq(id).await.unwrap(), 2);
    // A stale expected seq is heard before the event's size.
    let (s, v) = post(
        &app,
        &uri,
        None,
        &json!({"expected_seq": 1, "events": [prompt(150_000)]}),
    )
    .await;
    assert_error(s, &v, StatusCode::CONFLICT, "conflict");
    assert_eq!(v["current_seq"], 2, "{v}");
    // An earlier event's rule is heard before a later event's size.
    let orphan =
        json!({"type": "tool_result", "call_id": "none", "tool_name": "t", "status": "success"});
    let (s, v) = post(
        &app,
        &uri,
        None,
        &json!({"expected_seq": 2, "events": [orphan, prompt(150_000)]}),
    )
    .await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
    assert_eq!(v["index"], 0, "{v}");
    assert_ne!(v["rule"], "event-too-large", "{v}");
    assert_eq!(store.head_seq(id).await.unwrap(), 2);

    // A batch stored under a larger limit (another instance's, or before
    // the limit was lowered), sent again: answered with its seqs, before
    // any size is measured (§2), not refused for its large event.
    let wider = open(
        &url,
        StoreOptions {
            max_event_bytes: 1_000_000,
            ..StoreOptions::default()
        },
    )
    .await;
    let (first, second) = (Uuid::new_v4(), Uuid::new_v4());
    let batch = json!([
        {"type": "prompt_submitted", "text": "small", "event_id": first},
        {"type": "prompt_submitted", "text": text(150_000), "event_id": second}]);
    let events: Vec<session_store::NewEvent> = batch
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let id = Uuid::parse_str(e["event_id"].as_str().unwrap()).unwrap();
            let text = e["text"].as_str().unwrap().to_owned();
            session_store::NewEvent::new(session_store::EventBody::PromptSubmitted { text })
                .with_id(id)
        })
        .collect();
    wider.append(id, 2, events).await.unwrap();
    let (s, v) = post(
        &app,
        &uri,
        None,
        &json!({"expected_seq": 0, "events": batch}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["replayed"], true, "{v}");

    // A body of a few MB of small JSON values takes seconds to parse in a
    // test build. This test's runtime has one thread: parsed there, the
    // body would hold `/healthz` until it was done.
    let heavy = format!(
        r#"{{"expected_seq": 4, "events": [{{"type": "tool_call", "call_id": "c", "tool_name": "t", "input": [{}]}}]}}"#,
        vec!["{}"; 1_000_000].join(",")
    );
    let parse = tokio::spawn({
        let (app, uri) = (app.clone(), uri.clone());
        async move {
            let started = std::time::Instant::now();
            let (s, v, _) = call(
                &app,
                Method::POST,
                &uri,
                None,
                Some("application/json"),
                heavy,
            )
            .await;
            (s, v, started.elapsed())
        }
    });
    let asked = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(get(&app, "/healthz", None).await.0, StatusCode::OK);
    let answered = asked.elapsed();
    let (s, v, took) = parse.await.unwrap();
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid");
    assert_eq!(v["rule"], "event-too-large", "{v}");
    assert!(
        answered < Duration::from_millis(20) + took / 2,
        "/healthz answered {answered:?} after it was asked, beside a body parsed in {took:?}"
    );
}

/// A body whose `Content-Length` announces more than `--body-limit` is
/// refused at once, and counted and timed as the 413 it answers (before,
/// that refusal ran outside the metrics' layer: no series, no log line).
#[tokio::test]
async fn a_body_announced_over_the_limit_is_counted_as_its_413() {
    let dir = tempfile::tempdir().unwrap();
    let app = router(
        &store_in(&dir).await,
        ServerConfig {
            body_limit: 1024,
            ..ServerConfig::default()
        },
    );
    let request = Request::builder()
        .method(Method::POST)
        .uri(events_uri(Uuid::new_v4()))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "1000000")
        .body(Body::from("{}"))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let (_, _, text) = call(&app, Method::GET, "/metrics", None, None, Body::empty()).await;
    assert!(
        text.lines().any(
            |l| l.starts_with("session_store_http_request_duration_seconds_count")
                && l.contains("route=\"/v1/sessions/{id}/events\"")
                && l.contains("status=\"413\"")
                && l.ends_with(" 1")
        ),
        "{text}"
    );
}

/// GETs `path` with `host` as the Host header (none when `None`): the
/// status and the body as text.
async fn get_at(app: Router, path: &str, host: Option<&str>) -> (StatusCode, String) {
    let mut request = Request::builder().uri(path);
    if let Some(host) = host {
        request = request.header(header::HOST, host);
    }
    let response = app
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A server without tokens answers only requests for a loopback address or
/// `localhost`: a web page's own name resolved to 127.0.0.1 (DNS
/// rebinding) must not read or write the sessions; with tokens, or told
/// otherwise (`--insecure`), the name is not judged.
#[tokio::test]
async fn a_tokenless_server_answers_only_loopback_host_names() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(&dir).await;
    let get = |app: Router, host: Option<&'static str>| get_at(app, "/v1/audit/events", host);
    let open = router(&store, ServerConfig::default());
    for host in [
        None,
        Some("localhost"),
        Some("LOCALHOST:8080"),
        Some("127.0.0.1:8080"),
        Some("127.1.2.3"),
        Some("[::1]:8080"),
        Some("localhost.:8080"),
        Some("127.0.0.1."),
        Some("[::ffff:127.0.0.1]:8080"),
    ] {
        let (status, body) = get(open.clone(), host).await;
        assert_eq!(status, StatusCode::OK, "{host:?}: {body}");
    }
    for host in [
        "rebind.attacker.example",
        "rebind.attacker.example:8080",
        "127.0.0.1.nip.io",
        "10.0.0.1:8080",
        "[::2]:80",
    ] {
        let (status, body) = get(open.clone(), Some(host)).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{host}: {body}");
        assert!(body.contains("loopback address or localhost"), "{body}");
    }
    // Not only the sessions' routes: a rebinding page must not read the
    // counters, the readiness or the API document either.
    for path in ["/metrics", "/healthz", "/readyz", "/openapi.json"] {
        let (status, body) = get_at(open.clone(), path, Some("localhost:8080")).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body}");
        let (status, body) = get_at(open.clone(), path, Some("rebind.attacker.example")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path}: {body}");
    }
    let behind_a_proxy = router(
        &store,
        ServerConfig {
            loopback_hosts_only: false,
            ..ServerConfig::default()
        },
    );
    let (status, body) = get(behind_a_proxy, Some("sessions.example.com")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}
