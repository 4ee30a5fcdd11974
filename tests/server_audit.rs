//! The audit routes in-process, on both backends: explain and refreshes of
//! a session (scope read), and the cross-session queries under /v1/audit
//! (scope audit), which only ever see the token's tenant.

mod common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use session_store::server::{Server, ServerConfig, Tokens};
use session_store::Store;
use tower::ServiceExt;
use uuid::Uuid;

const TOKENS: &str = r#"{"tokens": [
  {"token": "tenant-a-writer-0123456789", "tenant": "a", "scopes": ["read", "write"]},
  {"token": "tenant-a-auditor-012345678", "tenant": "a", "scopes": ["audit"]},
  {"token": "tenant-b-writer-0123456789", "tenant": "b", "scopes": ["read", "write"]},
  {"token": "tenant-b-auditor-012345678", "tenant": "b", "scopes": ["audit"]}
]}"#;
const A_WRITER: &str = "tenant-a-writer-0123456789";
const A_AUDITOR: &str = "tenant-a-auditor-012345678";
const B_WRITER: &str = "tenant-b-writer-0123456789";
const B_AUDITOR: &str = "tenant-b-auditor-012345678";

async fn app(url: &str) -> Router {
    let store = Arc::new(Store::open(url).await.expect("open store"));
    let config = ServerConfig {
        tokens: Some(Tokens::parse(TOKENS, "the test tokens").expect("tokens")),
        ..ServerConfig::default()
    };
    Server::new(store, config).router()
}

async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    token: &str,
    body: Body,
) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap();
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn get(app: &Router, uri: &str, token: &str) -> (StatusCode, Value) {
    call(app, Method::GET, uri, token, Body::empty()).await
}

/// A session that searched for web_fetch, switched to a mode without it,
/// and left a call unanswered and a result naming an uncatalogued tool.
async fn seed(app: &Router, token: &str) -> Uuid {
    let id = Uuid::new_v4();
    let batch = json!({"expected_seq": 0, "events": [
        {"type": "session_started", "mode": "code"},
        {"type": "catalog_defined", "mode": "code", "deferred_tools": ["web_fetch"]},
        {"type": "catalog_defined", "mode": "ask", "deferred_tools": []},
        {"type": "prompt_submitted", "text": "one"},
        {"type": "tool_call", "call_id": "c1", "tool_name": "ToolSearch", "input": {}},
        {"type": "tool_result", "call_id": "c1", "tool_name": "ToolSearch", "status": "success",
         "added_tool_names": ["web_fetch", "ghost_tool"]},
        {"type": "prompt_submitted", "text": "two"},
        {"type": "mode_switched", "mode": "ask"},
        {"type": "tool_call", "call_id": "c2", "tool_name": "Read", "input": {}}
    ]});
    let (s, v) = call(
        app,
        Method::POST,
        &format!("/v1/sessions/{id}/events"),
        token,
        Body::from(batch.to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    id
}

both_backends!(explain_and_refreshes_over_http, |url: String| async move {
    let app = app(&url).await;
    let id = seed(&app, A_WRITER).await;

    // A name no event could carry is a mistake, not an unknown tool; a
    // parameter a route does not take is one too.
    let long = "t".repeat(300);
    let (s, v) = get(&app, &format!("/v1/sessions/{id}/explain/{long}"), A_WRITER).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_eq!(v["rule"], "bad-tool-name");
    for route in ["refreshes", "recover"] {
        let (s, v) = get(&app, &format!("/v1/sessions/{id}/{route}?x=1"), A_WRITER).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{route}: {v}");
        assert_eq!(
            v["message"], "unknown query parameter `x`: this request takes none",
            "{route}: {v}"
        );
    }
    // A query parameter the framework cannot read is said in a sentence
    // that names it and what it takes.
    for (uri, says) in [
        (
            format!("/v1/sessions/{id}/explain/web_fetch?at_seq=abc"),
            "the query parameter `at_seq` is not valid: invalid digit found in string (it takes a whole number)",
        ),
        (
            "/v1/audit/events?since=yesterday".to_owned(),
            "the query parameter `since` is not valid",
        ),
        // Times the CLI's --since refuses too (serde's DateTime took them).
        (
            "/v1/audit/events?since=%2B10000-01-01T00:00:00Z".to_owned(),
            "the query parameter `since` is not valid: \"+10000-01-01T00:00:00Z\" is not an RFC 3339 time",
        ),
        (
            "/v1/audit/changes?until=-0001-01-01T00:00:00Z".to_owned(),
            "the query parameter `until` is not valid",
        ),
        (
            "/v1/audit/events?since=1-01-01T00:00:00Z".to_owned(),
            "the query parameter `since` is not valid",
        ),
        (
            "/v1/audit/events?color=red".to_owned(),
            "unknown query parameter `color`: this request takes `",
        ),
    ] {
        let token = if uri.contains("audit") { A_AUDITOR } else { A_WRITER };
        let (s, v) = get(&app, &uri, token).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{uri}: {v}");
        let m = v["message"].as_str().unwrap_or_default();
        assert!(m.starts_with(says), "{uri}: {m}");
        if uri.contains("since") {
            assert!(m.contains("RFC 3339"), "{m}");
        }
    }
    // The audit routes share one parameter struct; an unknown parameter
    // is answered with the route's own list, not every route's.
    for (route, takes) in [
        (
            "events",
            "`type`, `from_position`, `to_position`, `session`, `since`, `until`, `after`, `limit`",
        ),
        (
            "changes",
            "`tool`, `change`, `session`, `since`, `until`, `after`, `limit`",
        ),
        (
            "anomalies",
            "`kind`, `session`, `since`, `until`, `after`, `limit`",
        ),
    ] {
        let (s, v) = get(&app, &format!("/v1/audit/{route}?tenant=beta"), A_AUDITOR).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{route}: {v}");
        assert_eq!(
            v["message"],
            format!("unknown query parameter `tenant`: this request takes {takes}"),
            "{route}"
        );
    }

    let (s, v) = get(
        &app,
        &format!("/v1/sessions/{id}/explain/web_fetch?at_prompt=2"),
        A_WRITER,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["active"], true);
    assert_eq!(v["evidence"]["seq"], 6);
    assert_eq!(v["as_of_seq"], 7);

    let (s, v) = get(
        &app,
        &format!("/v1/sessions/{id}/explain/web_fetch"),
        A_WRITER,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["reason"]["code"], "not_in_mode_catalog");
    assert_eq!(v["reason"]["mode"], "ask");
    assert_eq!(v["reason"]["admitted_in_modes"], json!(["code"]));

    let (s, v) = get(&app, &format!("/v1/sessions/{id}/refreshes"), A_WRITER).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let seqs: Vec<i64> = v["refreshes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, vec![4, 7, 8]);
    assert_eq!(v["refreshes"][1]["added"], json!(["web_fetch"]));
    assert_eq!(
        v["refreshes"][2]["removed"][0]["reason"]["code"],
        "not_in_mode_catalog"
    );

    // Statuses: out of range, both points, another tenant, no read scope.
    let (s, v) = get(
        &app,
        &format!("/v1/sessions/{id}/explain/web_fetch?at_prompt=3"),
        A_WRITER,
    )
    .await;
    assert_eq!(
        (s, v["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("prompt_out_of_range")
        ),
        "{v}"
    );
    let (s, v) = get(
        &app,
        &format!("/v1/sessions/{id}/explain/web_fetch?at_seq=99"),
        A_WRITER,
    )
    .await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("seq_out_of_range")),
        "{v}"
    );
    let (s, _) = get(
        &app,
        &format!("/v1/sessions/{id}/explain/web_fetch?at_seq=2&at_prompt=1"),
        A_WRITER,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = get(
        &app,
        &format!("/v1/sessions/{id}/explain/web_fetch?at=2"),
        A_WRITER,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    for uri in [
        format!("/v1/sessions/{id}/explain/web_fetch"),
        format!("/v1/sessions/{id}/refreshes"),
    ] {
        let (s, v) = get(&app, &uri, B_WRITER).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::NOT_FOUND, Some("not_found")),
            "{uri}: {v}"
        );
        let (s, _) = get(&app, &uri, A_AUDITOR).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{uri}");
    }
    let (s, _) = get(&app, "/v1/sessions/not-a-uuid/refreshes", A_WRITER).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
});

both_backends!(
    audit_queries_see_only_their_tenant,
    |url: String| async move {
        let app = app(&url).await;
        let a = seed(&app, A_WRITER).await;
        let b = seed(&app, B_WRITER).await;

        // Events by type, paged with the cursor.
        let (s, v) = get(
            &app,
            "/v1/audit/events?type=prompt_submitted&limit=1",
            A_AUDITOR,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["events"].as_array().unwrap().len(), 1);
        assert_eq!(v["events"][0]["session_id"], json!(a.to_string()));
        let next = v["next_after_position"].as_i64().expect("a next page");
        let (_, v) = get(
            &app,
            &format!("/v1/audit/events?type=prompt_submitted&limit=1&after={next}"),
            A_AUDITOR,
        )
        .await;
        assert_eq!(v["events"][0]["seq"], 7);
        // a's last prompt ends the pages: tenant b's prompts are not a's.
        assert_eq!(v["next_after_position"], Value::Null, "{v}");

        // Asking for another tenant's session finds nothing.
        let (_, v) = get(&app, &format!("/v1/audit/events?session={b}"), A_AUDITOR).await;
        assert_eq!(v["events"], json!([]));
        let (_, v) = get(&app, &format!("/v1/audit/events?session={b}"), B_AUDITOR).await;
        assert_eq!(v["events"].as_array().unwrap().len(), 9);

        // Activation changes of a tool.
        let (s, v) = get(&app, "/v1/audit/changes?tool=web_fetch", A_AUDITOR).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let got: Vec<Value> = v["changes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| json!([c["session_id"], c["seq"], c["change"]]))
            .collect();
        assert_eq!(
            got,
            vec![
                json!([a.to_string(), 7, "added"]),
                json!([a.to_string(), 8, "removed"])
            ]
        );
        let (_, v) = get(
            &app,
            "/v1/audit/changes?tool=web_fetch&change=removed",
            B_AUDITOR,
        )
        .await;
        assert_eq!(v["changes"].as_array().unwrap().len(), 1);
        assert_eq!(v["changes"][0]["session_id"], json!(b.to_string()));

        // A time range that ends before anything was written.
        let (_, v) = get(
            &app,
            "/v1/audit/changes?until=2000-01-01T00:00:00Z",
            A_AUDITOR,
        )
        .await;
        assert_eq!(v["changes"], json!([]));

        // Anomalies.
        let (_, v) = get(&app, "/v1/audit/anomalies?kind=unanswered_call", A_AUDITOR).await;
        let found: Vec<Value> = v["anomalies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| json!([x["session_id"], x["call_id"]]))
            .collect();
        assert_eq!(found, vec![json!([a.to_string(), "c2"])]);
        let (_, v) = get(
            &app,
            "/v1/audit/anomalies?kind=unknown_evidence_name",
            B_AUDITOR,
        )
        .await;
        assert_eq!(v["anomalies"].as_array().unwrap().len(), 1, "{v}");
        assert_eq!(v["anomalies"][0]["tools"], json!(["ghost_tool"]));
        assert_eq!(v["anomalies"][0]["session_id"], json!(b.to_string()));
        let (_, v) = get(&app, "/v1/audit/anomalies?kind=view_drift", A_AUDITOR).await;
        assert_eq!(v["anomalies"], json!([]));
        // Drift is of the current views: a time filter does not apply.
        for bound in ["since", "until"] {
            let (s, v) = get(
                &app,
                &format!("/v1/audit/anomalies?kind=view_drift&{bound}=2099-01-01T00:00:00Z"),
                A_AUDITOR,
            )
            .await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
            assert!(
                v["message"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("`{bound}` does not apply")),
                "{v}"
            );
        }

        // Scope and bad input.
        let (s, _) = get(&app, "/v1/audit/events", A_WRITER).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        for bad in [
            "/v1/audit/events?type=nope",
            "/v1/audit/events?limit=0",
            "/v1/audit/events?limit=5000",
            "/v1/audit/changes?change=maybe",
            "/v1/audit/events?since=2026-02-01T00:00:00Z&until=2026-01-01T00:00:00Z",
            "/v1/audit/events?after=-1",
            "/v1/audit/events?from_position=-1",
            "/v1/audit/events?limit=99999999999999999999",
            "/v1/audit/events?from_position=10&to_position=5",
            // A cursor no page gives: its tool is no name an event carries.
            "/v1/audit/changes?after=5:",
            "/v1/audit/changes?after=5:%01x",
            &format!("/v1/audit/changes?after=5:{}", "a".repeat(300)),
        ] {
            let (s, v) = get(&app, bad, A_AUDITOR).await;
            assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {v}");
            assert!(v["message"].as_str().unwrap().len() > 10, "{v}");
        }
        // A long value is echoed cut, as every message quotes one.
        let long = "a".repeat(50_000);
        for bad in [
            format!("/v1/audit/anomalies?kind={long}"),
            format!("/v1/audit/events?after={long}"),
        ] {
            let (s, v) = get(&app, &bad, A_AUDITOR).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
            let message = v["message"].as_str().unwrap();
            assert!(
                message.len() < 400 && message.contains("50000 bytes"),
                "{message}"
            );
        }
        for bad in [
            "/v1/audit/anomalies",
            "/v1/audit/anomalies?kind=everything",
            "/v1/audit/events?tool=web_fetch",
            "/v1/audit/events?since=yesterday",
            "/v1/audit/events?after=x",
            "/v1/audit/changes?after=12",
            "/v1/audit/events?session=../../etc",
            "/v1/audit/events?color=red",
        ] {
            let (s, v) = get(&app, bad, A_AUDITOR).await;
            assert!(
                s == StatusCode::BAD_REQUEST || s == StatusCode::UNPROCESSABLE_ENTITY,
                "{bad}: {s} {v}"
            );
            assert!(
                v["message"].as_str().is_some_and(|m| m.len() > 10),
                "{bad}: {v}"
            );
        }
        // A parameter that is not UTF-8 once percent-decoded is refused by
        // name, not read as U+FFFD (which asked for a tool of that name
        // and answered an empty page); anywhere, the same.
        for (bad, message) in [
            (
                "/v1/audit/events?tool=%FF",
                "query parameter \"tool\" is not UTF-8 once percent-decoded (it was sent as \"%FF\")",
            ),
            (
                "/v1/audit/changes?tool=web%C3&limit=5",
                "query parameter \"tool\" is not UTF-8 once percent-decoded (it was sent as \"web%C3\")",
            ),
            (
                "/v1/audit/events?%FE%FF=1",
                "a query parameter's name is not UTF-8 once percent-decoded (it was sent as \"%FE%FF\")",
            ),
        ] {
            let (s, v) = get(&app, bad, A_AUDITOR).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
            assert_eq!(v["message"], message, "{bad}");
        }
        // Who asks is judged first, as for any other bad query: no token
        // is 401, a token without the scope 403, another tenant's session
        // 404; then the query.
        let session = seed(&app, A_WRITER).await;
        let context = format!("/v1/sessions/{session}/context?at_seq=%80");
        for (token, status) in [
            ("no-such-token-0123456789", StatusCode::UNAUTHORIZED),
            (A_AUDITOR, StatusCode::FORBIDDEN),
            (B_WRITER, StatusCode::NOT_FOUND),
        ] {
            assert_eq!(get(&app, &context, token).await.0, status, "{token}");
        }
        let (s, v) = get(&app, "/v1/audit/events?tool=%FF", B_WRITER).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
        let (s, v) = get(&app, &context, A_WRITER).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(
            v["message"],
            "query parameter \"at_seq\" is not UTF-8 once percent-decoded (it was sent as \"%80\")"
        );
        let (s, _) = get(&app, "/healthz?x=%FF", A_AUDITOR).await;
        assert_eq!(s, StatusCode::OK, "the probes ignore their query");
        // Encoded UTF-8 is a name like any other.
        let (s, v) = get(&app, "/v1/audit/changes?tool=%E2%9C%93", A_AUDITOR).await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
);

both_backends!(
    refreshes_stream_a_long_session_page_by_page,
    |url: String| async move {
        let store = Arc::new(Store::open(&url).await.expect("open store"));
        let config = ServerConfig {
            tokens: Some(Tokens::parse(TOKENS, "the test tokens").expect("tokens")),
            ..ServerConfig::default()
        };
        let app = Server::new(store.clone(), config).router();
        // Over two pages of the log (the pass reads 2 000 events at a
        // time), with refresh points that add, drop and restore tools.
        let id = Uuid::new_v4();
        let mut seq = 0;
        let mut events = vec![
            json!({"type": "session_started", "mode": "code"}),
            json!({"type": "catalog_defined", "mode": "code", "deferred_tools": ["t0", "t1", "t2", "t3"]}),
            json!({"type": "catalog_defined", "mode": "ask", "deferred_tools": ["t1"]}),
        ];
        for i in 0..1_300 {
            let call = format!("c{i}");
            let tool = format!("t{}", i % 5);
            events.push(json!({"type": "prompt_submitted", "text": format!("p{i}")}));
            events.push(json!({"type": "tool_call", "call_id": call, "tool_name": "ToolSearch", "input": {}}));
            events.push(
                json!({"type": "tool_result", "call_id": call, "tool_name": "ToolSearch",
                "status": "success", "added_tool_names": [tool]}),
            );
            if i % 7 == 0 {
                let mode = if i % 14 == 0 { "ask" } else { "code" };
                events.push(json!({"type": "mode_switched", "mode": mode}));
            }
        }
        for chunk in events.chunks(500) {
            let batch = json!({"expected_seq": seq, "events": chunk});
            let (s, v) = call(
                &app,
                Method::POST,
                &format!("/v1/sessions/{id}/events"),
                A_WRITER,
                Body::from(batch.to_string()),
            )
            .await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            seq += chunk.len() as i64;
        }
        assert!(seq > 4_000, "{seq} events");

        let mut expected = Vec::new();
        store
            .refreshes(id, session_store::audit::At::Latest, |r| {
                expected.push(serde_json::to_value(r).unwrap());
                Ok::<(), session_store::Error>(())
            })
            .await
            .unwrap();
        assert!(expected.len() > 1_400, "{} refresh points", expected.len());

        // Sent as it is made: no length is known up front.
        let req = Request::builder()
            .uri(format!("/v1/sessions/{id}/refreshes"))
            .header(header::AUTHORIZATION, format!("Bearer {A_WRITER}"))
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        assert!(response.headers().get(header::CONTENT_LENGTH).is_none());
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["session_id"], json!(id.to_string()));
        assert_eq!(v["refreshes"], Value::Array(expected));
    }
);

both_backends!(
    pages_of_large_events_stop_at_four_mebibytes,
    |url: String| async move {
        // Eight events, six of about 900 KB: a page of history or of audit
        // events stops after the event that brings it to 4 MiB (the fifth
        // large one), with a cursor, whatever its `limit` (before, one
        // request could make the server hold 1 000 events of 1 MiB).
        let app = app(&url).await;
        let id = Uuid::new_v4();
        let text = "z".repeat(900_000);
        let batches = [
            json!([{"type": "session_started", "mode": "code"},
                   {"type": "assistant_message", "text": text},
                   {"type": "assistant_message", "text": text}]),
            json!([{"type": "assistant_message", "text": text},
                   {"type": "assistant_message", "text": text},
                   {"type": "assistant_message", "text": text}]),
            json!([{"type": "assistant_message", "text": text},
                   {"type": "tool_call", "call_id": "c1", "tool_name": "Read", "input": "small"}]),
        ];
        let mut expected_seq = 0;
        for events in batches {
            let n = events.as_array().unwrap().len() as i64;
            let body = json!({"expected_seq": expected_seq, "events": events});
            let (s, v) = call(
                &app,
                Method::POST,
                &format!("/v1/sessions/{id}/events"),
                A_WRITER,
                Body::from(body.to_string()),
            )
            .await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            expected_seq += n;
        }
        let seqs = |v: &Value| -> Vec<i64> {
            v["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["seq"].as_i64().unwrap())
                .collect()
        };
        let (s, v) = get(
            &app,
            &format!("/v1/sessions/{id}/events?limit=1000"),
            A_WRITER,
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(
            (seqs(&v), &v["next_after_seq"]),
            (vec![1, 2, 3, 4, 5, 6], &json!(6))
        );
        let (_, v) = get(
            &app,
            &format!("/v1/sessions/{id}/events?limit=1000&after_seq=6"),
            A_WRITER,
        )
        .await;
        assert_eq!((seqs(&v), &v["next_after_seq"]), (vec![7, 8], &Value::Null));

        let (s, v) = get(
            &app,
            &format!("/v1/audit/events?session={id}&limit=1000"),
            A_AUDITOR,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(seqs(&v), vec![1, 2, 3, 4, 5, 6]);
        let after = v["next_after_position"].as_i64().expect("a cursor");
        let (_, v) = get(
            &app,
            &format!("/v1/audit/events?session={id}&limit=1000&after={after}"),
            A_AUDITOR,
        )
        .await;
        assert_eq!(
            (seqs(&v), &v["next_after_position"]),
            (vec![7, 8], &Value::Null)
        );

        // PostgreSQL: the server itself stops there. The page's statement,
        // executed under `EXPLAIN ANALYZE`, returned the page's six rows,
        // not the eight its `LIMIT` allows (sqlx reads a result to its end:
        // the rows the client did not keep still came over the wire).
        if url.starts_with("postgres") {
            use session_store::store::query::{EventQuery, PlanOf, Scope};
            let store = Store::open(&url).await.expect("open store");
            let q = EventQuery {
                scope: Scope {
                    session: Some(id),
                    limit: 1000,
                    ..Scope::default()
                },
                ..EventQuery::default()
            };
            let plan = store.audit_plan(PlanOf::Events(&q)).await.unwrap();
            let top = plan.lines().next().unwrap_or_default();
            assert!(top.contains(" rows=6 loops=1)"), "{plan}");
            store.close().await;
        }
    }
);
