//! The audit routes: `explain` and `refreshes` of one session (scope
//! `read`, like every other read of a session) and the cross-session
//! queries under `/v1/audit` (scope `audit`). Cross-session queries are
//! always narrowed to the token's tenant: the store is asked with the
//! tenant as a filter, so another tenant's rows are never read.

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tracing::warn;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::auth::Scope;
use super::error::{ApiError, ErrorBody};
use super::{parse_session_id, query, query_taking, Params, Server, SessionPath};
use crate::audit::{At, Explanation, Refresh, RefreshTracker};
use crate::store::query::{
    AnomalyKind, AnomalyPage, AnomalyQuery, ChangePage, ChangeQuery, EventPage, EventQuery,
    Scope as Narrowing,
};

/// Query of `explain`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ExplainQuery {
    /// Answer as of this seq instead of the latest.
    #[param(minimum = 1)]
    at_seq: Option<i64>,
    /// Answer for the request of the K-th prompt (1-based); not with
    /// `at_seq`.
    #[param(minimum = 1)]
    at_prompt: Option<i64>,
}

/// Whether a deferred tool is in the activation set and why (docs/audit.md).
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/explain/{tool}",
    params(
        ("id" = Uuid, Path, description = "The session"),
        ("tool" = String, Path, description = "The deferred tool"),
        ExplainQuery
    ),
    responses(
        (status = 200, body = Explanation),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 422, description = "`at_seq` or `at_prompt` out of range", body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn explain(
    State(server): State<Server>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
    q: Params<ExplainQuery>,
) -> Result<Json<Explanation>, ApiError> {
    let Ok(Path((id, tool))) = path else {
        // Who asks first, as on every route: a caller without a token
        // hears 401, whatever its path. (A segment fails only when its
        // bytes are not UTF-8 once percent-decoded.)
        server.principal(&headers)?.require(Scope::Read)?;
        return Err(ApiError::bad_request(
            "the session id or the tool name in the path is not UTF-8 once percent-decoded"
                .to_owned(),
        ));
    };
    let (_, session_id) = server.session_for(&headers, Scope::Read, &id).await?;
    let q = query(q)?;
    let at = match (q.at_seq, q.at_prompt) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "give at_seq or at_prompt, not both".to_owned(),
            ))
        }
        (Some(n), None) => At::Seq(n),
        (None, Some(k)) => At::Prompt(k),
        (None, None) => At::Latest,
    };
    Ok(Json(
        server.inner.store.explain(session_id, &tool, at).await?,
    ))
}

/// Every refresh point of a session: the shape of the body
/// [`refreshes`] streams (written by [`RefreshListWriter`]).
#[derive(Debug, Serialize, ToSchema)]
pub struct RefreshList {
    /// The session.
    session_id: Uuid,
    /// In seq order.
    refreshes: Vec<Refresh>,
}

/// Writes a [`RefreshList`] piece by piece, so that a session with a
/// hundred thousand refresh points is sent a page at a time instead of
/// being held whole: the same bytes `serde_json` would write for the
/// whole list.
struct RefreshListWriter {
    buf: Vec<u8>,
    first: bool,
}

impl RefreshListWriter {
    fn new(session_id: Uuid) -> RefreshListWriter {
        RefreshListWriter {
            buf: format!(r#"{{"session_id":"{session_id}","refreshes":["#).into_bytes(),
            first: true,
        }
    }

    fn push(&mut self, r: &Refresh) -> Result<(), crate::error::Error> {
        if !self.first {
            self.buf.push(b',');
        }
        self.first = false;
        serde_json::to_writer(&mut self.buf, r).map_err(|e| {
            crate::error::Error::Database(format!("cannot write a refresh point: {e}"))
        })
    }

    /// What was written since the last take.
    fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    fn finish(mut self) -> Vec<u8> {
        self.buf.extend_from_slice(b"]}");
        self.buf
    }
}

/// A streamed body that ends in an error as soon as `cut` completes,
/// whatever is still queued: the error makes hyper abort the response, so
/// the client sees a cut-off body, never a shorter one that looks whole.
struct CutOff {
    rx: mpsc::Receiver<Result<Vec<u8>, crate::error::Error>>,
    cut: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
}

impl tokio_stream::Stream for CutOff {
    type Item = Result<Vec<u8>, crate::error::Error>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let Some(cut) = self.cut.as_mut() else {
            return Poll::Ready(None);
        };
        if cut.as_mut().poll(cx).is_ready() {
            self.cut = None;
            return Poll::Ready(Some(Err(crate::error::Error::Unavailable(
                "the server is shutting down".to_owned(),
            ))));
        }
        self.rx.poll_recv(cx)
    }
}

/// Pages of the body [`refreshes`] may have ready ahead of its client.
const REFRESH_PAGES_AHEAD: usize = 2;

/// Every refresh point of the session: the activation set after it and
/// the difference from the previous one, with the reason of each removal.
///
/// The body is streamed, one page of the log at a time, so a long session
/// costs the server one page of memory, not its whole list. An unknown
/// session or a database that fails on the first page answers with its
/// status; a failure later cuts the body off, which a client sees as an
/// unfinished JSON document, never as a shorter list.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/refreshes",
    params(("id" = Uuid, Path, description = "The session")),
    responses(
        (status = 200, body = RefreshList),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn refreshes(
    State(server): State<Server>,
    headers: HeaderMap,
    SessionPath(id): SessionPath,
    q: Params<super::NoQuery>,
) -> Result<Response, ApiError> {
    // Who asks first, as on every route: a caller without a token hears
    // 401, whatever its query.
    let (_, session_id) = server.session_for(&headers, Scope::Read, &id).await?;
    query(q)?;
    let store = server.inner.store.clone();
    let mut pages = store.event_pages(session_id, At::Latest).await?;
    let mut page = pages.next_page(&store).await?;
    let (tx, rx) = mpsc::channel::<Result<Vec<u8>, crate::error::Error>>(REFRESH_PAGES_AHEAD);
    tokio::spawn(async move {
        let mut tracker = RefreshTracker::new(session_id);
        let mut out = RefreshListWriter::new(session_id);
        while let Some(events) = page {
            for e in &events {
                if let Some(r) = tracker.apply(e) {
                    if let Err(e) = out.push(&r) {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
            // The client gone (or the body cut off), the pass ends.
            if tx.send(Ok(out.take())).await.is_err() {
                return;
            }
            page = match pages.next_page(&store).await {
                Ok(p) => p,
                Err(e) => {
                    warn!(%session_id, cause = %e, "refreshes cut off");
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
        }
        let _ = tx.send(Ok(out.finish())).await;
    });
    Ok(streamed_json(&server, rx))
}

/// A JSON answer whose body comes from `rx` as a task makes it. Shutdown
/// cuts the body off, as it ends event streams, pages already made
/// included: a long answer to a slow reader must not hold the server up
/// to its grace.
pub(super) fn streamed_json(
    server: &Server,
    rx: mpsc::Receiver<Result<Vec<u8>, crate::error::Error>>,
) -> Response {
    let mut shutdown = server.inner.shutdown.subscribe();
    let cut = Box::pin(async move {
        let _ = shutdown.wait_for(|s| *s).await;
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(CutOff { rx, cut: Some(cut) }),
    )
        .into_response()
}

/// The query of the `/v1/audit` routes, each of which takes only some of
/// these (the others are refused by name); each route's OpenAPI
/// parameters list its own.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditParams {
    /// Only events of this type (`/v1/audit/events`).
    #[serde(rename = "type")]
    event_type: Option<String>,
    /// Only this tool (`/v1/audit/changes`).
    tool: Option<String>,
    /// `added` or `removed` (`/v1/audit/changes`).
    change: Option<String>,
    /// unanswered_call, unknown_evidence_name or view_drift
    /// (`/v1/audit/anomalies`, required there).
    kind: Option<String>,
    /// Only this session.
    session: Option<String>,
    /// Only rows recorded at or after this time (RFC 3339).
    #[serde(default, deserialize_with = "rfc3339")]
    since: Option<DateTime<Utc>>,
    /// Only rows recorded before this time (RFC 3339).
    #[serde(default, deserialize_with = "rfc3339")]
    until: Option<DateTime<Utc>>,
    /// Only events at this position or later (`/v1/audit/events`).
    from_position: Option<i64>,
    /// Only events at this position or earlier (`/v1/audit/events`).
    to_position: Option<i64>,
    /// The cursor of the previous page.
    after: Option<String>,
    /// Rows per page, 1 to 1000 (100 without it).
    limit: Option<i64>,
}

/// A time as the CLI's `--since` takes it: RFC 3339 exactly (a four-digit
/// year). serde's reading of a `DateTime` also took `+10000-01-01…`,
/// `-0001-…` and `1-01-01…`, which the CLI refuses.
fn rfc3339<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
    let text = String::deserialize(d)?;
    DateTime::parse_from_rfc3339(&text)
        .map(|t| Some(t.with_timezone(&Utc)))
        .map_err(|e| serde::de::Error::custom(format!("{text:?} is not an RFC 3339 time: {e}")))
}

impl AuditParams {
    fn narrowing(&self, tenant: &str) -> Result<Narrowing, ApiError> {
        Ok(Narrowing {
            tenant: Some(tenant.to_owned()),
            session: self.session.as_deref().map(parse_session_id).transpose()?,
            since: self.since,
            until: self.until,
            limit: self.limit.unwrap_or(100),
        })
    }

    fn refuse(&self, route: &str, fields: &[(&str, bool)]) -> Result<(), ApiError> {
        match fields.iter().find(|(_, given)| *given) {
            Some((name, _)) => Err(ApiError::bad_request(format!(
                "`{name}` does not apply to {route}"
            ))),
            None => Ok(()),
        }
    }
}

/// Events of the tenant's sessions in global order.
#[utoipa::path(
    get,
    path = "/v1/audit/events",
    params(
        ("type" = Option<String>, Query, description = "Only events of this type"),
        ("from_position" = Option<i64>, Query, description = "Only events at this position or later"),
        ("to_position" = Option<i64>, Query, description = "Only events at this position or earlier"),
        ("session" = Option<Uuid>, Query, description = "Only this session"),
        ("since" = Option<DateTime<Utc>>, Query, description = "Only rows recorded at or after this time (RFC 3339)"),
        ("until" = Option<DateTime<Utc>>, Query, description = "Only rows recorded before this time (RFC 3339)"),
        ("after" = Option<String>, Query, description = "The cursor of the next page: the previous page's `next_after_position` (events) or `next` (changes, anomalies)"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 1000, description = "Rows per page, 1 to 1000 (100 without it)"),
    ),
    responses(
        (status = 200, body = EventPage),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, description = "A filter out of range", body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn audit_events(
    State(server): State<Server>,
    headers: HeaderMap,
    q: Params<AuditParams>,
) -> Result<Json<EventPage>, ApiError> {
    let principal = server.principal(&headers)?;
    principal.require(Scope::Audit)?;
    let q = query_taking(
        q,
        &[
            "type",
            "from_position",
            "to_position",
            "session",
            "since",
            "until",
            "after",
            "limit",
        ],
    )?;
    q.refuse(
        "/v1/audit/events",
        &[
            ("tool", q.tool.is_some()),
            ("change", q.change.is_some()),
            ("kind", q.kind.is_some()),
        ],
    )?;
    let after_position = match &q.after {
        None => 0,
        Some(a) => a.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "`after` {} is not a position",
                crate::error::quoted(a)
            ))
        })?,
    };
    let page = server
        .inner
        .store
        .audit_events(&EventQuery {
            scope: q.narrowing(&principal.tenant)?,
            event_type: q.event_type.clone(),
            from_position: q.from_position,
            to_position: q.to_position,
            after_position,
        })
        .await?;
    Ok(Json(page))
}

/// Refresh points of the tenant's sessions where a tool entered or left
/// the activation set.
#[utoipa::path(
    get,
    path = "/v1/audit/changes",
    params(
        ("tool" = Option<String>, Query, description = "Only this tool"),
        ("change" = Option<String>, Query, description = "`added` or `removed`"),
        ("session" = Option<Uuid>, Query, description = "Only this session"),
        ("since" = Option<DateTime<Utc>>, Query, description = "Only rows recorded at or after this time (RFC 3339)"),
        ("until" = Option<DateTime<Utc>>, Query, description = "Only rows recorded before this time (RFC 3339)"),
        ("after" = Option<String>, Query, description = "The cursor of the next page: the previous page's `next_after_position` (events) or `next` (changes, anomalies)"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 1000, description = "Rows per page, 1 to 1000 (100 without it)"),
    ),
    responses(
        (status = 200, body = ChangePage),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, description = "A filter out of range", body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn audit_changes(
    State(server): State<Server>,
    headers: HeaderMap,
    q: Params<AuditParams>,
) -> Result<Json<ChangePage>, ApiError> {
    let principal = server.principal(&headers)?;
    principal.require(Scope::Audit)?;
    let q = query_taking(
        q,
        &[
            "tool", "change", "session", "since", "until", "after", "limit",
        ],
    )?;
    q.refuse(
        "/v1/audit/changes",
        &[
            ("type", q.event_type.is_some()),
            ("kind", q.kind.is_some()),
            ("from_position", q.from_position.is_some()),
            ("to_position", q.to_position.is_some()),
        ],
    )?;
    let page = server
        .inner
        .store
        .audit_changes(&ChangeQuery {
            scope: q.narrowing(&principal.tenant)?,
            tool: q.tool.clone(),
            change: q.change.clone(),
            after: q.after.clone(),
        })
        .await?;
    Ok(Json(page))
}

/// Anomalies of one kind in the tenant's sessions.
#[utoipa::path(
    get,
    path = "/v1/audit/anomalies",
    params(
        ("kind" = String, Query, description = "unanswered_call, unknown_evidence_name or view_drift (view_drift takes neither `since` nor `until`)"),
        ("session" = Option<Uuid>, Query, description = "Only this session"),
        ("since" = Option<DateTime<Utc>>, Query, description = "Only rows recorded at or after this time (RFC 3339)"),
        ("until" = Option<DateTime<Utc>>, Query, description = "Only rows recorded before this time (RFC 3339)"),
        ("after" = Option<String>, Query, description = "The cursor of the next page: the previous page's `next_after_position` (events) or `next` (changes, anomalies)"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 1000, description = "Rows per page, 1 to 1000 (100 without it)"),
    ),
    responses(
        (status = 200, body = AnomalyPage),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, description = "A filter out of range", body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub(super) async fn audit_anomalies(
    State(server): State<Server>,
    headers: HeaderMap,
    q: Params<AuditParams>,
) -> Result<Json<AnomalyPage>, ApiError> {
    let principal = server.principal(&headers)?;
    principal.require(Scope::Audit)?;
    let q = query_taking(q, &["kind", "session", "since", "until", "after", "limit"])?;
    q.refuse(
        "/v1/audit/anomalies",
        &[
            ("type", q.event_type.is_some()),
            ("tool", q.tool.is_some()),
            ("change", q.change.is_some()),
            ("from_position", q.from_position.is_some()),
            ("to_position", q.to_position.is_some()),
        ],
    )?;
    let kind = match q.kind.as_deref() {
        None => {
            return Err(ApiError::bad_request(
                "`kind` is required: unanswered_call, unknown_evidence_name or view_drift"
                    .to_owned(),
            ))
        }
        Some(k) => AnomalyKind::parse(k).ok_or_else(|| {
            ApiError::bad_request(format!(
                "unknown `kind` {}: expected unanswered_call, unknown_evidence_name or view_drift",
                crate::error::quoted(k)
            ))
        })?,
    };
    if kind == AnomalyKind::ViewDrift {
        q.refuse(
            "/v1/audit/anomalies?kind=view_drift",
            &[("since", q.since.is_some()), ("until", q.until.is_some())],
        )?;
    }
    let page = server
        .inner
        .store
        .audit_anomalies(&AnomalyQuery {
            scope: q.narrowing(&principal.tenant)?,
            kind,
            after: q.after.clone(),
        })
        .await?;
    Ok(Json(page))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ToolStatus::Success;
    use crate::testkit::{call, catalog, prompt, result, started, switch, Log};

    /// The streamed body is, byte for byte, what serializing the whole
    /// list writes: with no refresh point, one, and several.
    #[test]
    fn the_streamed_list_is_the_serialized_list() {
        let log = Log::new()
            .push(started("agent"))
            .push(catalog("agent", &["web_fetch"]))
            .push(prompt("p1"))
            .push(call("c1", "ToolSearch"))
            .push(result("c1", "ToolSearch", Success, &["web_fetch"]))
            .push(prompt("p2"))
            .push(switch("plan"))
            .push(switch("agent"));
        let session_id = Uuid::now_v7();
        let mut tracker = RefreshTracker::new(session_id);
        let all: Vec<Refresh> = log.events.iter().filter_map(|e| tracker.apply(e)).collect();
        assert_eq!(all.len(), 4);
        for n in [0, 1, all.len()] {
            let mut w = RefreshListWriter::new(session_id);
            let mut body = Vec::new();
            for (i, r) in all[..n].iter().enumerate() {
                w.push(r).unwrap();
                // Taken at uneven points, as pages end.
                if i % 2 == 0 {
                    body.extend(w.take());
                }
            }
            body.extend(w.finish());
            let whole = RefreshList {
                session_id,
                refreshes: all[..n].to_vec(),
            };
            assert_eq!(
                String::from_utf8(body).unwrap(),
                serde_json::to_string(&whole).unwrap(),
                "{n} refresh points"
            );
        }
    }
}
