//! The sidecar-facing HTTP server (`session-store serve`, docs/api.md).
//!
//! Sidecars in any language reach the store over JSON/HTTP. The server is a
//! thin layer: every rule lives in the [`Store`] and the projector, so an
//! answer over HTTP is the answer the CLI and the library give. What the
//! layer adds is who may ask (bearer tokens with a tenant and scopes,
//! [`auth`]), limits (body size, a per-request timeout), one JSON error
//! shape ([`error`]), metrics ([`metrics`]), server-sent event streams and
//! a graceful shutdown that lets every started append finish.
//!
//! Tenant isolation: a session belongs to the tenant whose token created
//! it (recorded in the append's transaction, migration 0003). Another
//! tenant's session answers 404 exactly like a missing one, on every
//! route, so a token cannot even learn that it exists.

mod audit;
pub mod auth;
pub mod error;
pub mod metrics;
mod openapi;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{mpsc, watch, RwLock};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{debug, info, warn};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::error::{Rule, ValidationError};
use crate::event::{parse_event_object, LineKind, NewEvent, StoredEvent};
use crate::projector::{Activations, Context, SessionState};
use crate::store::{Appended, Recovery, Store};
use crate::Error;

pub use auth::{Principal, Scope, Tokens};
pub use error::{ApiError, ErrorBody};
pub use metrics::Metrics;
pub use openapi::openapi_json;

/// The default largest request body: room for a batch of several events at
/// the store's default 1 MiB per event.
pub const DEFAULT_BODY_LIMIT: usize = 8 * 1024 * 1024;

/// The default most events one append may carry. Judging and writing a
/// batch costs a few KB of memory an event whatever the event's size (a
/// batch of 150 000 empty prompts, 6 MB of body, took the server to 444
/// MB), so the body limit alone does not bound an append's memory.
pub const DEFAULT_MAX_BATCH_EVENTS: usize = 10_000;
/// The default time a request may take before it answers 503 `timeout`.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The default time shutdown waits for in-flight requests and appends.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// The default page size of `GET …/events`.
pub const DEFAULT_PAGE: i64 = 100;
/// The largest page size of `GET …/events`.
pub const MAX_PAGE: i64 = 1_000;
/// How often an idle stream sends a keep-alive comment. A client that
/// hung up is noticed only when a write to it fails (half-close is on, and
/// a reset came through no sooner in a review's measurements), so this
/// bounds how long a gone stream keeps its connection slot: at 15 s, 4 500
/// streams opened and dropped by one client made another's read wait
/// 12.6 s at the default `--max-connections`.
const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// How long a stream waits for its session to move before it reads again
/// anyway (the wait itself re-reads on every wake-up for the session and
/// every 10 s, src/store/subscribe.rs).
const STREAM_WAIT: Duration = Duration::from_secs(60);
/// The default time a client has to send a request's headers, and the
/// longest a kept-alive connection may sit idle.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(15);
/// The default number of connections served at once (streams included).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4_096;
/// The default bytes of answers held for clients at once (256 MiB).
pub const DEFAULT_RESPONSE_MEMORY: usize = 256 << 20;
/// Answers smaller than this are not counted against the response
/// memory: they cannot add up to much before the connection cap does.
const UNCOUNTED_RESPONSE: usize = 64 << 10;
/// An answer is handed to the connection in pieces of this size.
const RESPONSE_CHUNK: usize = 64 << 10;

/// How the server behaves.
#[derive(Debug)]
pub struct ServerConfig {
    /// The accepted tokens; `None` serves everyone as the default tenant
    /// with every scope (only sensible on loopback, see docs/api.md).
    pub tokens: Option<Tokens>,
    /// Without tokens, on a loopback address: answer only requests whose
    /// `Host` names a loopback address or `localhost`. A web page the
    /// user visits can make the browser send requests to 127.0.0.1 under
    /// a name of the page's own that resolves there (DNS rebinding); such
    /// a request carries that name, and without tokens it would read and
    /// write every session (a security review's finding). `serve` sets it
    /// unless `--insecure` says something in front (which may pass a
    /// public `Host` on) authenticates.
    pub loopback_hosts_only: bool,
    /// The largest request body, in bytes.
    pub body_limit: usize,
    /// The most events one append may carry ([`DEFAULT_MAX_BATCH_EVENTS`]).
    pub max_batch_events: usize,
    /// The longest a request may take to produce its answer.
    pub request_timeout: Duration,
    /// How long shutdown waits for in-flight work.
    pub shutdown_grace: Duration,
    /// How long a client has to send a request's headers once it connected
    /// or its previous answer was sent (an idle kept-alive connection is
    /// closed after as long): a client that connects and stalls cannot hold
    /// a connection.
    pub header_timeout: Duration,
    /// Connections served at once; more wait in the listen queue until one
    /// closes, so the process never runs out of file descriptors.
    pub max_connections: usize,
    /// Bytes of made answers (`GET …/events` pages, contexts, audit pages)
    /// held for their clients at once. An answer is held until its client
    /// has read it, so clients that ask for large answers and do not read
    /// them could otherwise hold the server's memory without bound; an
    /// answer that finds the budget spent answers 503 `busy` at once.
    /// Streamed answers (`/stream`, `/refreshes`) hold a page at a time and
    /// are not counted.
    pub response_memory: usize,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            tokens: None,
            loopback_hosts_only: true,
            body_limit: DEFAULT_BODY_LIMIT,
            max_batch_events: DEFAULT_MAX_BATCH_EVENTS,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            response_memory: DEFAULT_RESPONSE_MEMORY,
        }
    }
}

struct Inner {
    store: Arc<Store>,
    config: ServerConfig,
    /// The response memory, in KiB permits.
    response_kib: Arc<tokio::sync::Semaphore>,
    /// The append bodies over 64 KiB being parsed (off the runtime) and
    /// appended at once, in KiB permits ([`parse_append_aside`]).
    parse_kib: Arc<tokio::sync::Semaphore>,
    metrics: Metrics,
    /// Turns true when shutdown starts: streams end, so connections drain.
    shutdown: watch::Sender<bool>,
    /// Every running append holds a read guard; shutdown takes the write
    /// lock, so it returns only when they have all finished.
    appends: Arc<RwLock<()>>,
}

/// The HTTP server over one [`Store`].
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// A server over `store`.
    pub fn new(store: Arc<Store>, config: ServerConfig) -> Server {
        let (shutdown, _) = watch::channel(false);
        let response_kib = Arc::new(tokio::sync::Semaphore::new(response_kib_total(&config)));
        let parse_kib = Arc::new(tokio::sync::Semaphore::new(parse_kib_total(&config)));
        Server {
            inner: Arc::new(Inner {
                store,
                response_kib,
                parse_kib,
                config,
                metrics: Metrics::new(),
                shutdown,
                appends: Arc::new(RwLock::new(())),
            }),
        }
    }

    /// The server's metrics (what `GET /metrics` encodes).
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Every route, with limits, metrics and JSON fallbacks: a
    /// `tower::Service` to serve or to call in-process.
    pub fn router(&self) -> Router {
        let timeout = self.inner.config.request_timeout;
        let limit = self.inner.config.body_limit;
        Router::new()
            .route("/v1/sessions/{id}/events", post(append).get(history))
            .route("/v1/sessions/{id}/context", get(context))
            .route("/v1/sessions/{id}/activations", get(activations))
            .route("/v1/sessions/{id}/recover", get(recover))
            .route("/v1/sessions/{id}/stream", get(stream))
            .route("/v1/sessions/{id}/explain/{tool}", get(audit::explain))
            .route("/v1/sessions/{id}/refreshes", get(audit::refreshes))
            .route("/v1/audit/events", get(audit::audit_events))
            .route("/v1/audit/changes", get(audit::audit_changes))
            .route("/v1/audit/anomalies", get(audit::audit_anomalies))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics_text))
            .route("/openapi.json", get(openapi_doc))
            // Inside `track`, so that a `busy` answer is counted as the
            // 503 it is.
            .route_layer(middleware::from_fn_with_state(
                self.clone(),
                within_response_memory,
            ))
            // Inside `track` too, so that a request cut off by the timeout
            // is counted as the 503 it answers (outside, it was not counted
            // at all). The fallbacks answer at once and need none.
            .route_layer(middleware::from_fn(move |req: Request, next: Next| {
                with_timeout(timeout, req, next)
            }))
            // Inside `track` as well, so that a body announced over the
            // limit is counted and logged as the 413 it answers (outside,
            // an operability review found it in no metric and no log).
            .route_layer(middleware::from_fn(move |req: Request, next: Next| {
                refuse_announced_size(limit, req, next)
            }))
            // Every route, the health, metrics and API document ones too
            // (a rebinding page could read the counters), and counted as
            // the 403 it answers.
            .route_layer(middleware::from_fn_with_state(
                self.clone(),
                loopback_hosts_only,
            ))
            .route_layer(middleware::from_fn_with_state(self.clone(), track))
            .fallback(not_found_route)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(DefaultBodyLimit::max(self.inner.config.body_limit))
            .with_state(self.clone())
    }

    /// Serves on `listener` until `signal` completes, then shuts down
    /// gracefully: stops accepting connections, ends streams, lets
    /// in-flight requests answer and in-flight appends commit, for at most
    /// the configured grace.
    ///
    /// Connections are served by hyper directly (not `axum::serve`) for two
    /// limits `axum::serve` does not set: a header-read timeout, which also
    /// closes idle kept-alive connections, and a cap on connections served
    /// at once. Without them a client that opened connections and sent
    /// nothing (or half a request) kept them forever, until the process ran
    /// out of file descriptors and answered nobody.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        signal: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        use hyper_util::rt::{TokioIo, TokioTimer};
        use hyper_util::server::graceful::GracefulShutdown;
        use hyper_util::service::TowerToHyperService;

        let inner = self.inner.clone();
        let grace = inner.config.shutdown_grace;
        let service = TowerToHyperService::new(self.router());
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(inner.config.header_timeout)
            // A client may shut its side down once its request is sent
            // (`nc -N`, some proxies) and still wait for the answer;
            // without this hyper closed such a connection unanswered,
            // leaving the client unsure whether its append was stored.
            .half_close(true);
        let slots = Arc::new(tokio::sync::Semaphore::new(
            inner.config.max_connections.max(1),
        ));
        let connections = GracefulShutdown::new();
        // Says the storage failures held back once they stop (server/error.rs).
        let ticker = tokio::spawn(async {
            let mut every = tokio::time::interval(Duration::from_secs(10));
            loop {
                every.tick().await;
                error::log_held_back(false);
            }
        });
        tokio::pin!(signal);
        loop {
            // A slot first: at the cap, connections wait in the listen
            // queue rather than being accepted and starved.
            let slot = tokio::select! {
                () = &mut signal => break,
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
            };
            let stream = tokio::select! {
                () = &mut signal => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors, or a connection reset before
                        // it was accepted: wait a moment and go on.
                        warn!(cause = %e, "cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let connection =
                connections.watch(http.serve_connection(TokioIo::new(stream), service.clone()));
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    debug!(cause = %e, "connection ended");
                }
                drop(slot);
            });
        }
        drop(listener);
        info!("shutting down: finishing in-flight requests");
        inner.shutdown.send_replace(true);
        // One grace for both waits: shutdown takes at most --shutdown-grace.
        let deadline = tokio::time::Instant::now() + grace;
        tokio::select! {
            () = connections.shutdown() => {}
            () = tokio::time::sleep_until(deadline) => warn!(grace_s = grace.as_secs_f64(), "requests still open after the shutdown grace; closing them"),
        }
        // Appends run in their own tasks (a client hanging up must not cut
        // one off); wait for the last to commit or fail.
        if tokio::time::timeout_at(deadline, inner.appends.write())
            .await
            .is_err()
        {
            warn!("appends still running after the shutdown grace");
        }
        ticker.abort();
        error::log_held_back(true);
        info!("shut down");
        Ok(())
    }
}

/// Records every routed request's latency by route, method and status.
async fn track(State(server): State<Server>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = req.method().as_str().to_owned();
    let started = Instant::now();
    let response = next.run(req).await;
    let status = response.status().as_u16();
    server
        .inner
        .metrics
        .request_seconds
        .get_or_create(&metrics::RouteLabel {
            route: route.clone(),
            method: method.clone(),
            status,
        })
        .observe(started.elapsed().as_secs_f64());
    debug!(%route, %method, status, elapsed_ms = started.elapsed().as_millis() as u64, "request");
    response
}

/// Answers 413 at once when `Content-Length` announces a body over the
/// limit, before waiting for a body that would be refused anyway (and
/// before the request timeout could call it a slow append).
async fn refuse_announced_size(limit: usize, req: Request, next: Next) -> Response {
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match announced {
        Some(n) if n > limit as u64 => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body is {n} bytes, over the limit of {limit} bytes; send smaller batches"),
        )
        .into_response(),
        _ => next.run(req).await,
    }
}

/// Two bodies of the largest size taken, one a core here: parsing is
/// CPU-bound, and a body's JSON tree takes up to about 30 times its bytes
/// (an 8 MB array of `{}` took 235 MB), so more at once would only hold
/// more memory.
fn parse_kib_total(config: &ServerConfig) -> usize {
    (config.body_limit / 1024)
        .saturating_add(1)
        .saturating_mul(2)
        .clamp(1, tokio::sync::Semaphore::MAX_PERMITS)
}

fn response_kib_total(config: &ServerConfig) -> usize {
    (config.response_memory / 1024).clamp(1, tokio::sync::Semaphore::MAX_PERMITS)
}

/// Holds a made answer of 64 KiB or more against the response memory
/// until its client has read it (see [`ServerConfig::response_memory`]).
/// An answer that finds the budget spent is dropped at once and answered
/// 503 `busy`: waiting would keep it in memory uncounted (answers are made
/// before their size is known), and a queue would hold small answers up
/// behind a large one. An answer larger than the whole budget takes all of
/// it, so it is still served, alone. A `HEAD` answer has no body to hold.
async fn within_response_memory(
    State(server): State<Server>,
    req: Request,
    next: Next,
) -> Response {
    use hyper::body::Body as _;
    let head = req.method() == axum::http::Method::HEAD;
    let response = next.run(req).await;
    let Some(size) = response.body().size_hint().exact() else {
        return response; // streamed: holds a page at a time
    };
    let size = usize::try_from(size).unwrap_or(usize::MAX);
    if head || size < UNCOUNTED_RESPONSE {
        return response;
    }
    let inner = &server.inner;
    let kib = size.div_ceil(1024).min(response_kib_total(&inner.config));
    let permit = match inner
        .response_kib
        .clone()
        .try_acquire_many_owned(u32::try_from(kib).unwrap_or(u32::MAX))
    {
        Ok(permit) => permit,
        Err(_) => {
            warn!(bytes = size, "an answer found the response memory spent");
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "busy",
                format!(
                    "the server holds {} MiB of answers that their clients have not read yet, its --response-memory; try again shortly, or ask for smaller pages",
                    inner.config.response_memory >> 20
                ),
            )
            .into_response();
        }
    };
    let (parts, body) = response.into_parts();
    match axum::body::to_bytes(body, usize::MAX).await {
        Ok(data) => Response::from_parts(
            parts,
            axum::body::Body::new(Budgeted {
                data,
                permit: Some(permit),
            }),
        ),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("the answer could not be sent: {e}"),
        )
        .into_response(),
    }
}

/// A made answer handed to the connection a piece at a time, holding its
/// share of the response memory until the last piece is taken.
struct Budgeted {
    data: axum::body::Bytes,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl hyper::body::Body for Budgeted {
    type Data = axum::body::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<axum::body::Bytes>, Self::Error>>> {
        if self.data.is_empty() {
            self.permit = None;
            return std::task::Poll::Ready(None);
        }
        let n = self.data.len().min(RESPONSE_CHUNK);
        let piece = self.data.split_to(n);
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.data.len() as u64)
    }
}

/// [`ServerConfig::loopback_hosts_only`]: a server without tokens answers
/// 403 to a request whose `Host` is not a loopback name, on every route.
async fn loopback_hosts_only(State(server): State<Server>, req: Request, next: Next) -> Response {
    let config = &server.inner.config;
    if config.tokens.is_none() && config.loopback_hosts_only && !loopback_host(req.headers()) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "a server without tokens answers only requests for a loopback address or \
             localhost (the Host header): another name could be a web page's, resolved \
             to this machine; give the server --tokens to serve other names",
        )
        .into_response();
    }
    next.run(req).await
}

/// Answers 503 `timeout` when a request takes longer than the limit to
/// produce its answer (a stream's body is not limited, only its start).
async fn with_timeout(limit: Duration, req: Request, next: Next) -> Response {
    // Only an append changes anything: a read's answer says no more than
    // that it took too long.
    let append = req.method() == axum::http::Method::POST;
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(r) => r,
        Err(_) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "timeout",
            format!(
                "the request took longer than {} s; {}",
                limit.as_secs_f64(),
                match append {
                    true => "an append whose body had arrived may still commit: retry it with the same event ids",
                    false => "nothing was changed: retry it",
                }
            ),
        )
        .into_response(),
    }
}

async fn not_found_route() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such route; the API is described at /openapi.json",
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not answer that method; see /openapi.json",
    )
}

/// Whether the request's `Host` is `localhost` or a loopback address
/// (with any port). A request without one (HTTP/1.0) is a program's, not a
/// browser's, which always sends it.
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(axum::http::header::HOST) else {
        return true;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        // [::1]:8080
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    // A fully qualified `localhost.` is the same name.
    let name = name.strip_suffix('.').unwrap_or(name);
    name.eq_ignore_ascii_case("localhost")
        || name.parse::<std::net::IpAddr>().is_ok_and(|ip| match ip {
            std::net::IpAddr::V6(v6) => v6
                .to_ipv4_mapped()
                .map_or(v6.is_loopback(), |v4| v4.is_loopback()),
            ip => ip.is_loopback(),
        })
}

impl Server {
    /// Who is calling: the token's principal, or the open principal when
    /// the server has no tokens.
    fn principal(&self, headers: &HeaderMap) -> Result<Principal, ApiError> {
        match &self.inner.config.tokens {
            // Requests for other names were answered 403 before any
            // handler ([`loopback_hosts_only`]).
            None => Ok(Principal::open()),
            Some(tokens) => tokens.authenticate(headers),
        }
    }

    /// Authenticates, checks `scope`, parses the session id and checks that
    /// the session exists and is the caller's tenant's (404 otherwise).
    async fn session_for(
        &self,
        headers: &HeaderMap,
        scope: Scope,
        id: &str,
    ) -> Result<(Principal, Uuid), ApiError> {
        let principal = self.principal(headers)?;
        principal.require(scope)?;
        let session_id = parse_session_id(id)?;
        match self.inner.store.session_owner(session_id).await? {
            Some(owner) if owner == principal.tenant => Ok((principal, session_id)),
            _ => Err(ApiError::not_found(session_id)),
        }
    }
}

/// The `{id}` of a session route, raw: parsed by [`parse_session_id`] so a
/// bad one answers the JSON error shape (axum's own rejection is text).
struct SessionPath(String);

impl axum::extract::FromRequestParts<Server> for SessionPath {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        server: &Server,
    ) -> Result<SessionPath, ApiError> {
        match Path::<String>::from_request_parts(parts, server).await {
            Ok(Path(id)) => Ok(SessionPath(id)),
            // The one way a single segment fails: its bytes are not UTF-8
            // once percent-decoded (axum's wording names its internals).
            // Said only to a known caller: without a token, 401 whatever
            // the path, as on every route.
            Err(_) => {
                server.principal(&parts.headers)?;
                Err(ApiError::bad_request(
                    "the session id in the path is not UTF-8 once percent-decoded: session ids are UUIDs"
                        .to_owned(),
                ))
            }
        }
    }
}

/// What is wrong with a query string whose names or values are not UTF-8
/// once percent-decoded, naming the parameter; `None` when it decodes.
/// axum's decoding replaces such bytes with U+FFFD, so `?tool=%FF` asked
/// for a tool named "\u{fffd}" and answered an empty page as if the
/// question were sound.
fn undecodable(query: Option<&str>) -> Option<String> {
    query?.split('&').find_map(|pair| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decodes = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .is_ok()
        };
        match (decodes(name), decodes(value)) {
            (true, true) => None,
            (true, false) => {
                let name = percent_encoding::percent_decode_str(name).decode_utf8_lossy();
                Some(format!(
                    "query parameter {} is not UTF-8 once percent-decoded (it was sent as {})",
                    crate::error::quoted(&name),
                    crate::error::quoted(value)
                ))
            }
            (false, _) => Some(format!(
                "a query parameter's name is not UTF-8 once percent-decoded (it was sent as {})",
                crate::error::quoted(name)
            )),
        }
    })
}

/// A route's query parameters, parsed but not yet judged: the handler
/// asks ([`query`], [`query_taking`]) after it has checked its caller, so
/// that a caller without a token hears 401 whatever its query, as on
/// every route. (A layer that refused undecodable queries answered them
/// 400 before the caller check.)
pub(crate) struct Params<T>(Result<T, QueryProblem>);

/// Why a query string was not parsed.
pub(crate) enum QueryProblem {
    /// A name or value is not UTF-8 once percent-decoded ([`undecodable`]).
    NotUtf8(String),
    /// The framework's rejection (a bad value, an unknown parameter).
    Rejected(QueryRejection),
}

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequestParts<S>
    for Params<T>
{
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Infallible> {
        if let Some(why) = undecodable(parts.uri.query()) {
            return Ok(Params(Err(QueryProblem::NotUtf8(why))));
        }
        Ok(Params(
            Query::<T>::from_request_parts(parts, state)
                .await
                .map(|Query(t)| t)
                .map_err(QueryProblem::Rejected),
        ))
    }
}

fn parse_session_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id).map_err(|_| {
        ApiError::bad_request(format!(
            "{} is not a session id: session ids are UUIDs",
            crate::error::quoted(id)
        ))
    })
}

fn query<T>(q: Params<T>) -> Result<T, ApiError> {
    q.0.map_err(|e| match e {
        QueryProblem::NotUtf8(why) => ApiError::bad_request(why),
        QueryProblem::Rejected(e) => {
            let text = e.body_text();
            beyond_range(&text).unwrap_or_else(|| ApiError::bad_request(query_message(&text)))
        }
    })
}

/// A whole number past what its parameter's type holds (`limit=` twenty
/// digits): out of range, 422 as any other out-of-range value, not 400
/// as a value that is not a number.
fn beyond_range(text: &str) -> Option<ApiError> {
    let text = text
        .strip_prefix("Failed to deserialize query string: ")
        .unwrap_or(text);
    let (field, why) = text.split_once(": ")?;
    let past = match why {
        "number too large to fit in target type" => "largest",
        "number too small to fit in target type" => "smallest",
        _ => return None,
    };
    if field.is_empty() || !field.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
        return None;
    }
    Some(ApiError::from(crate::store::query::bad(
        field,
        format!("`{field}` is past the {past} whole number it takes"),
    )))
}

/// The parameter an unknown-field rejection names (at most 80 characters of
/// it) and the rest of the framework's sentence after it.
/// "x: unknown field `x`, expected one of `a`, `b`" / ", there are no fields"
fn unknown_parameter(text: &str) -> Option<(String, &str)> {
    let i = text.find("unknown field `")?;
    let rest = &text[i + "unknown field `".len()..];
    let (name, tail) = rest.split_once('`').unwrap_or((rest, ""));
    Some((name.chars().take(80).collect(), tail))
}

/// [`query`] for a route whose parameter struct serves other routes too
/// (the audit routes): an unknown parameter is answered with the route's
/// own parameters, `takes`, not every field of the struct.
fn query_taking<T>(q: Params<T>, takes: &[&str]) -> Result<T, ApiError> {
    q.0.map_err(|e| {
        let e = match e {
            QueryProblem::NotUtf8(why) => return ApiError::bad_request(why),
            QueryProblem::Rejected(e) => e,
        };
        let text = e.body_text();
        if let Some(beyond) = beyond_range(&text) {
            return beyond;
        }
        let text = text
            .strip_prefix("Failed to deserialize query string: ")
            .unwrap_or(&text);
        ApiError::bad_request(match unknown_parameter(text) {
            Some((name, _)) => {
                let list: Vec<String> = takes.iter().map(|t| format!("`{t}`")).collect();
                format!(
                    "unknown query parameter `{name}`: this request takes {}",
                    list.join(", ")
                )
            }
            None => query_message(text),
        })
    })
}

/// The framework's query rejection ("Failed to deserialize query string:
/// at_seq: invalid digit found in string") as a sentence that names the
/// parameter and what it takes.
fn query_message(text: &str) -> String {
    let text = text
        .strip_prefix("Failed to deserialize query string: ")
        .unwrap_or(text);
    if let Some((name, tail)) = unknown_parameter(text) {
        // serde's wording: "expected `a`", "expected `a` or `b`", or
        // "expected one of `a`, `b`, `c`".
        let list = tail
            .strip_prefix(", expected one of ")
            .or_else(|| tail.strip_prefix(", expected "));
        return match list {
            Some(list) => format!("unknown query parameter `{name}`: this request takes {list}"),
            None if tail.contains("there are no fields") => {
                format!("unknown query parameter `{name}`: this request takes none")
            }
            None => format!("unknown query parameter `{name}`"),
        };
    }
    match text.split_once(": ") {
        Some((field, why)) if !field.is_empty() && !field.contains(' ') => {
            let takes = match field {
                "since" | "until" => " (it takes an RFC 3339 time such as 2026-12-01T00:00:00Z)",
                "at_seq" | "at_prompt" | "after_seq" | "from_position" | "to_position"
                | "limit" => " (it takes a whole number)",
                _ => "",
            };
            format!("the query parameter `{field}` is not valid: {why}{takes}")
        }
        _ => format!("bad query string: {text}"),
    }
}

/// The body of `POST /v1/sessions/{id}/events`.
#[derive(Debug, ToSchema)]
#[allow(dead_code)] // Documents the request; parsing is by hand, for §4 errors.
pub struct AppendRequest {
    /// The seq the writer last saw: 0 for a new session.
    expected_seq: i64,
    /// The batch, appended atomically, in order. Each event is a SEMANTICS
    /// §3 object: `type`, its payload, optionally `event_id` (give one so a
    /// retry is idempotent); never `session_id` (the path names the
    /// session), `recorded_at`, `seq` or `position`.
    events: Vec<EventInput>,
}

/// One event of an append batch: `type`, its payload and optionally
/// `event_id`.
#[derive(Debug, Serialize, ToSchema)]
#[allow(dead_code)]
pub struct EventInput {
    /// Optional; generated when absent. Supply it to make retries safe.
    #[serde(skip_serializing_if = "Option::is_none")]
    event_id: Option<Uuid>,
    /// The type and payload.
    #[serde(flatten)]
    body: crate::event::EventBody,
}

/// The answer to an append.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AppendResponse {
    /// The session.
    pub session_id: Uuid,
    /// One entry per event of the batch, in order.
    pub events: Vec<AppendedEvent>,
    /// True when the whole batch was already stored (an idempotent retry)
    /// and nothing was written; the ids and seqs are the stored ones.
    pub replayed: bool,
}

/// What one appended event was given.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AppendedEvent {
    /// The event's id.
    pub event_id: Uuid,
    /// Its seq in the session.
    pub seq: i64,
    /// Its global position.
    pub position: i64,
}

impl From<&Appended> for AppendedEvent {
    fn from(a: &Appended) -> AppendedEvent {
        AppendedEvent {
            event_id: a.event_id,
            seq: a.seq,
            position: a.position,
        }
    }
}

/// An append body's events up to the first that cannot be read as an
/// event, and that one's error (at its index).
type ParsedEvents = (Vec<NewEvent>, Option<ValidationError>);

/// Parses an append body into `(expected_seq, events)`, with the rule,
/// field and batch index of whatever is wrong. A body whose envelope is
/// wrong is an error at once; an event that is wrong is returned beside
/// the events before it, and judged after them (SEMANTICS §2: a stale
/// writer hears of the conflict first, and the events are judged one by
/// one, so an earlier event's error answers first).
fn parse_append(body: &[u8], max_events: usize) -> Result<(i64, ParsedEvents), ApiError> {
    let malformed = |m: String| {
        let mut a = ApiError::bad_request(m);
        a.body.rule = Some(Rule::MalformedJson.code().to_owned());
        a
    };
    // A byte order mark before the JSON is ignored (RFC 8259 §8.1 allows
    // it), as `import` ignores one before its first line.
    let body = body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body);
    crate::event::check_reserved_key(body).map_err(|m| malformed(format!("the body: {m}")))?;
    let value: Value = serde_json::from_slice(body)
        .and_then(|v| crate::event::check_unique_keys(body).map(|()| v))
        .map_err(|e| malformed(crate::event::json_error_said("the body is not JSON", &e)))?;
    let Value::Object(mut map) = value else {
        let mut a = ApiError::bad_request(
            "the body must be a JSON object: {\"expected_seq\": N, \"events\": [...]}",
        );
        a.body.rule = Some(Rule::MalformedJson.code().to_owned());
        return Err(a);
    };
    let envelope = |rule: Rule, field: &str, message: String| {
        ApiError::invalid(&ValidationError::new(rule, Some(field), message))
    };
    let expected_seq = match map.remove("expected_seq") {
        None | Some(Value::Null) => {
            return Err(envelope(
                Rule::MissingField,
                "expected_seq",
                "missing field `expected_seq` (0 for a new session)".to_owned(),
            ))
        }
        Some(Value::Number(n)) => match n.as_i64() {
            Some(s) if s >= 0 => s,
            _ => {
                return Err(envelope(
                    Rule::MistypedField,
                    "expected_seq",
                    format!("`expected_seq` must be a whole number ≥ 0, found {n}"),
                ))
            }
        },
        Some(other) => {
            return Err(envelope(
                Rule::MistypedField,
                "expected_seq",
                format!(
                    "`expected_seq` must be a whole number ≥ 0, found {}",
                    short(&other)
                ),
            ))
        }
    };
    let events = match map.remove("events") {
        None | Some(Value::Null) => {
            return Err(envelope(
                Rule::MissingField,
                "events",
                "missing field `events` (an array of events)".to_owned(),
            ))
        }
        Some(Value::Array(a)) if a.len() > max_events => {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!(
                    "the batch holds {} events, over the limit of {max_events} per append (--max-batch-events); send them as several appends, each atomic on its own",
                    a.len()
                ),
            ))
        }
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(envelope(
                Rule::MistypedField,
                "events",
                format!("`events` must be an array, found {}", short(&other)),
            ))
        }
    };
    if let Some(unknown) = map.keys().next() {
        let unknown: String = unknown.chars().take(80).collect();
        return Err(envelope(
            Rule::UnknownField,
            &unknown,
            format!("unknown field `{unknown}`: the body has `expected_seq` and `events` only"),
        ));
    }
    Ok((expected_seq, parse_events(events)))
}

/// The batch's events, up to the first that cannot be read, and why it
/// cannot. (An event's size is the store's to judge: a batch already
/// stored is answered with its seqs before any size is measured, §2.)
fn parse_events(events: Vec<Value>) -> ParsedEvents {
    let mut batch = Vec::with_capacity(events.len());
    for (i, e) in events.into_iter().enumerate() {
        let Value::Object(obj) = e else {
            let v = ValidationError::new(
                Rule::MalformedJson,
                None,
                format!("an event must be a JSON object, found {}", short(&e)),
            );
            return (batch, Some(v.at_index(i)));
        };
        match parse_event_object(obj, LineKind::Append) {
            Ok(parsed) => batch.push(parsed.event),
            Err(v) => return (batch, Some(v.at_index(i))),
        }
    }
    (batch, None)
}

/// A JSON value's kind, for error sentences (never the value itself,
/// which may be huge).
fn short(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    // RFC 9110 §8.4: a body in a coding the server does not apply is 415.
    // Ignored, a gzip body was said to be "not JSON" and a body labelled
    // `br` but sent plain was stored.
    let codings: Vec<&str> = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("?").split(','))
        .map(str::trim)
        .filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity"))
        .collect();
    if let Some(coding) = codings.first() {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!(
                "the body is sent with `Content-Encoding: {coding}`, which this server does not decode; send it unencoded"
            ),
        ));
    }
    let unsupported = |message: String| {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            message,
        )
    };
    // Two different types (a proxy's and the client's, say): which one the
    // body is in is not known, so neither is taken.
    let mut given: Vec<String> = headers
        .get_all(header::CONTENT_TYPE)
        .iter()
        .map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .trim()
                .to_ascii_lowercase()
        })
        .collect();
    given.sort();
    given.dedup();
    if given.len() > 1 {
        return Err(unsupported(format!(
            "the request has {} different `Content-Type` headers; send one, `application/json`",
            given.len()
        )));
    }
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mut parts = ct.split(';');
    let essence = parts.next().unwrap_or("").trim();
    // JSON is read as UTF-8 (RFC 8259 §8.1): a body said to be in another
    // charset is refused as such, rather than "not JSON" at its first byte.
    let charset = parts
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("charset"))
        .map(|(_, v)| v.trim().trim_matches('"'));
    // UTF-8 by its labels, and ASCII, which is UTF-8 too.
    let utf8 = |c: &str| {
        ["utf-8", "utf8", "us-ascii", "ascii"]
            .iter()
            .any(|label| c.eq_ignore_ascii_case(label))
    };
    if let Some(charset) = charset.filter(|c| !utf8(c)) {
        return Err(unsupported(format!(
            "the body is said to be in charset {}; JSON is taken in UTF-8 only",
            crate::error::quoted(charset)
        )));
    }
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(unsupported(if ct.is_empty() {
            "the body must be sent with `Content-Type: application/json`".to_owned()
        } else {
            format!(
                "the body must be `application/json`, not {}",
                crate::error::quoted(ct)
            )
        }))
    }
}

/// Reads a request body of at most `limit` bytes into one buffer, copying
/// each piece as it comes. hyper hands a body over in pieces that share
/// its read buffer (8 KiB): collected as they came (axum's `Bytes`), a
/// body sent in small TCP segments held a buffer per segment, so that 180
/// KB sent a byte at a time held 1.3 GB until the request timed out. Read
/// only after the request's token, scope and headers were judged, so that
/// a client without a token is answered 401 at once, not after its body.
async fn read_body(mut body: axum::body::Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    use hyper::body::Body as _;
    let mut data = Vec::new();
    loop {
        let frame = std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await;
        let piece = match frame {
            None => return Ok(data),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(piece) => piece,
                Err(_) => continue, // trailers
            },
            Some(Err(e)) => {
                tracing::debug!(cause = %e, "request body not read");
                return Err(ApiError::bad_request(
                    "the body could not be read to its end: the connection closed or failed before it, or it was shorter than its Content-Length"
                        .to_owned(),
                ));
            }
        };
        if data.len().saturating_add(piece.len()) > limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("the body is over the limit of {limit} bytes; send smaller batches"),
            ));
        }
        data.extend_from_slice(&piece);
    }
}

/// Bodies up to this size are parsed where their request runs.
const PARSE_INLINE_BYTES: usize = 64 * 1024;

/// [`parse_append`], for a body over [`PARSE_INLINE_BYTES`] on the
/// blocking pool, within the budget of large bodies ([`parse_kib_total`]);
/// with the body's share of the budget, which its append holds to its end.
///
/// Parsed on the runtime's threads (two here), two 8 MB bodies of small
/// JSON values (1.5–3 s each) held every other request, `/healthz`
/// included, for seconds, and 32 at once took the server to 3 GB before
/// their refusals (a review, 2026-12-07). A body waits for its share of
/// the budget (its request's timeout bounds the wait). The share is held
/// while its events are parsed and appended (their JSON trees live until
/// the store has judged them), even when the request was given up on
/// meanwhile; a body parsed where it is read holds none.
async fn parse_append_aside(
    server: &Server,
    body: Vec<u8>,
    max_events: usize,
) -> Result<
    (
        (i64, ParsedEvents),
        Option<tokio::sync::OwnedSemaphorePermit>,
    ),
    ApiError,
> {
    if body.len() <= PARSE_INLINE_BYTES {
        return parse_append(&body, max_events).map(|parsed| (parsed, None));
    }
    let total = parse_kib_total(&server.inner.config);
    let kib = (body.len() / 1024).saturating_add(1).clamp(1, total);
    let share = u32::try_from(kib).unwrap_or(u32::MAX);
    let failed = |cause: &dyn std::fmt::Display| {
        warn!(cause = %cause, "parsing an append's body failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the append's body could not be parsed; the server log has the cause",
        )
    };
    // The budget is never closed: an error here is not expected.
    let permit = server
        .inner
        .parse_kib
        .clone()
        .acquire_many_owned(share)
        .await
        .map_err(|e| failed(&e))?;
    tokio::task::spawn_blocking(move || {
        parse_append(&body, max_events).map(|parsed| (parsed, Some(permit)))
    })
    .await
    .map_err(|e| failed(&e))?
}

/// Appends a batch.
#[utoipa::path(
    post,
    path = "/v1/sessions/{id}/events",
    params(("id" = Uuid, Path, description = "The session")),
    request_body = AppendRequest,
    responses(
        (status = 201, description = "Appended (or replayed: `replayed` is true)", body = AppendResponse),
        (status = 400, description = "Not JSON, or a bad session id", body = ErrorBody),
        (status = 401, description = "No or unknown token", body = ErrorBody),
        (status = 403, description = "The token lacks `write`", body = ErrorBody),
        (status = 404, description = "Another tenant's session", body = ErrorBody),
        (status = 409, description = "`expected_seq` is stale; `current_seq` says where the session is", body = ErrorBody),
        (status = 413, description = "The body is over the size limit", body = ErrorBody),
        (status = 415, description = "Not `application/json` (or two types, or a charset other than UTF-8), or sent with a `Content-Encoding` other than `identity` (none is decoded)", body = ErrorBody),
        (status = 422, description = "Breaks a SEMANTICS §4 rule: `rule`, `field`, `index`", body = ErrorBody),
        (status = 503, description = "The database is unavailable (nothing stored), the commit got no answer (`outcome_unknown`: it may or may not be stored; send it again with the same event ids), the request timed out (`timeout`: it may still commit), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn append(
    State(server): State<Server>,
    headers: HeaderMap,
    SessionPath(id): SessionPath,
    q: Params<NoQuery>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let principal = server.principal(&headers)?;
    principal.require(Scope::Write)?;
    let session_id = parse_session_id(&id)?;
    // The batch and its expected seq are in the body: a query parameter
    // (`?expected_seq=0`, say) is a mistake, not something to ignore.
    query(q)?;
    require_json(&headers)?;
    let body = read_body(body, server.inner.config.body_limit).await?;
    let max_events = server.inner.config.max_batch_events;
    let ((expected_seq, parsed), share) = parse_append_aside(&server, body, max_events)
        .await
        .inspect_err(|_| {
            server.inner.metrics.append_outcome("invalid");
        })?;
    // With an event that could not be read, the batch is judged up to it
    // (the tenant, the expected seq, the events before it) and refused.
    let (events, invalid) = parsed;
    let refreshes = events.iter().filter(|e| e.body.is_refresh_point()).count() as u64;
    let n = events.len() as u64;

    // The append runs in its own task: a client hanging up or the request
    // timeout must not cut it off between "committed" and "answered"
    // (retries are idempotent, but a finished append is cheaper), and
    // shutdown waits for it.
    let guard = server.inner.appends.clone().read_owned().await;
    let store = server.inner.store.clone();
    let tenant = principal.tenant.clone();
    let counted = server.clone();
    let started = Instant::now();
    let task = tokio::spawn(async move {
        let r = match invalid {
            None => {
                store
                    .append_as(Some(&tenant), session_id, expected_seq, events)
                    .await
            }
            Some(invalid) => Err(store
                .refuse_batch(Some(&tenant), session_id, expected_seq, events, invalid)
                .await),
        };
        drop(guard);
        drop(share);
        // Counted here, not in the handler: an append whose request was
        // cut off (its timeout, its client hanging up) still ran to its
        // end, and what it stored is counted (a review found such appends
        // stored and never counted).
        let m = &counted.inner.metrics;
        m.append_seconds.observe(started.elapsed().as_secs_f64());
        match &r {
            Ok(outcome) if outcome.replayed => m.append_outcome("replayed"),
            Ok(_) => {
                m.append_outcome("ok");
                m.appended_events.inc_by(n);
                m.refreshes.inc_by(refreshes);
            }
            Err(e) => {
                m.append_outcome(match e {
                    Error::Conflict { .. } => "conflict",
                    Error::Invalid(_) => "invalid",
                    Error::SessionNotFound(_) => "not_found",
                    // Apart from `error`: an append that may be stored is
                    // what a client must resend with its ids, and what an
                    // operator alerts on.
                    e if e.may_be_stored() => "outcome_unknown",
                    _ => "error",
                });
                if matches!(e, Error::Conflict { .. }) {
                    m.conflicts.inc();
                }
            }
        }
        r
    });
    let result = task.await.map_err(|e| {
        warn!(cause = %e, "append task failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the append failed unexpectedly; the server log has the cause",
        )
    })?;
    match result {
        Ok(outcome) => {
            let body = AppendResponse {
                session_id,
                events: outcome.events.iter().map(AppendedEvent::from).collect(),
                replayed: outcome.replayed,
            };
            Ok((StatusCode::CREATED, Json(body)).into_response())
        }
        Err(e) => Err(e.into()),
    }
}

/// Query of `GET …/events`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct HistoryQuery {
    /// Events with a greater seq (0, the beginning, by default).
    #[param(minimum = 0)]
    after_seq: Option<i64>,
    /// At most this many (100 by default, at most 1000).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// One page of a session's history.
#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryPage {
    /// The session.
    pub session_id: Uuid,
    /// The events, in seq order.
    pub events: Vec<StoredEvent>,
    /// Pass as `after_seq` for the next page; `null` when this page is the
    /// last one.
    pub next_after_seq: Option<i64>,
}

/// A session's events in seq order, a page at a time.
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/events",
    params(("id" = Uuid, Path, description = "The session"), HistoryQuery),
    responses(
        (status = 200, body = HistoryPage),
        (status = 400, description = "Bad id or query", body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 422, description = "`limit` or `after_seq` out of range (`invalid`, naming it)", body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn history(
    State(server): State<Server>,
    headers: HeaderMap,
    SessionPath(id): SessionPath,
    q: Params<HistoryQuery>,
) -> Result<Json<HistoryPage>, ApiError> {
    let (_, session_id) = server.session_for(&headers, Scope::Read, &id).await?;
    let q = query(q)?;
    let after = q.after_seq.unwrap_or(0);
    if after < 0 {
        return Err(out_of_range(
            "after_seq",
            "`after_seq` must be ≥ 0".to_owned(),
        ));
    }
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(out_of_range(
            "limit",
            format!("`limit` must be between 1 and {MAX_PAGE}, not {limit}"),
        ));
    }
    let (events, more) = server
        .inner
        .store
        .history_page(session_id, after, limit)
        .await?;
    let next_after_seq = if more {
        events.last().map(|e| e.seq)
    } else {
        None
    };
    Ok(Json(HistoryPage {
        session_id,
        events,
        next_after_seq,
    }))
}

/// Query of the "as of" reads.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AtSeqQuery {
    /// Answer as of this seq (1 to the latest) instead of the latest.
    #[param(minimum = 1)]
    at_seq: Option<i64>,
}

/// The effective context (SEMANTICS §5, shape §9).
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/context",
    params(("id" = Uuid, Path, description = "The session"), AtSeqQuery),
    responses(
        (status = 200, body = Context),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 422, description = "`at_seq` out of range (`seq_out_of_range`)", body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn context(
    State(server): State<Server>,
    headers: HeaderMap,
    SessionPath(id): SessionPath,
    q: Params<AtSeqQuery>,
) -> Result<Response, ApiError> {
    let (_, session_id) = server.session_for(&headers, Scope::Read, &id).await?;
    let q = query(q)?;
    let store = server.inner.store.clone();
    let (head, pages) = store.context_paged(session_id, q.at_seq).await?;
    let Some(mut pages) = pages else {
        return Ok(Json(head).into_response());
    };
    // A long window (a session never compacted) is sent as its rows are
    // read, a page at a time: built whole, one answer could take the
    // server gigabytes. A failure after the first bytes cuts the body off
    // (an unfinished JSON document, never a shorter context).
    let open = head.json_head().map_err(|e| {
        ApiError::from(crate::error::Error::Database(format!(
            "the context could not be written as JSON: {e}"
        )))
    })?;
    let (tx, rx) = mpsc::channel::<Result<Vec<u8>, crate::error::Error>>(2);
    tokio::spawn(async move {
        let mut buf = open.into_bytes();
        let mut first = true;
        loop {
            let page = match pages.next_page(&store).await {
                Ok(Some(page)) => page,
                Ok(None) => break,
                Err(e) => {
                    warn!(%session_id, cause = %e, "context cut off");
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            for row in page {
                if !first {
                    buf.push(b',');
                }
                first = false;
                if let Err(e) = serde_json::to_writer(&mut buf, &row) {
                    let _ = tx
                        .send(Err(crate::error::Error::Database(format!(
                            "a context row could not be written as JSON: {e}"
                        ))))
                        .await;
                    return;
                }
            }
            if tx.send(Ok(std::mem::take(&mut buf))).await.is_err() {
                return;
            }
        }
        buf.extend_from_slice(b"]}");
        let _ = tx.send(Ok(buf)).await;
    });
    Ok(audit::streamed_json(&server, rx))
}

/// The deferred activation set (SEMANTICS §7, shape §9).
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/activations",
    params(("id" = Uuid, Path, description = "The session"), AtSeqQuery),
    responses(
        (status = 200, body = Activations),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 422, description = "`at_seq` out of range (`seq_out_of_range`)", body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn activations(
    State(server): State<Server>,
    headers: HeaderMap,
    SessionPath(id): SessionPath,
    q: Params<AtSeqQuery>,
) -> Result<Json<Activations>, ApiError> {
    let (_, session_id) = server.session_for(&headers, Scope::Read, &id).await?;
    let q = query(q)?;
    Ok(Json(
        server.inner.store.activations(session_id, q.at_seq).await?,
    ))
}

/// What a restarting sidecar needs (SEMANTICS §8).
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/recover",
    params(("id" = Uuid, Path, description = "The session")),
    responses(
        (status = 200, body = Recovery),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn recover(
    State(server): State<Server>,
    headers: HeaderMap,
    SessionPath(id): SessionPath,
    q: Params<NoQuery>,
) -> Result<Json<Recovery>, ApiError> {
    // Who asks first, as on every route: a caller without a token hears
    // 401, whatever its query.
    let (_, session_id) = server.session_for(&headers, Scope::Read, &id).await?;
    query(q)?;
    Ok(Json(server.inner.store.recover(session_id).await?))
}

/// The query of a route that takes no parameters: any is a mistake,
/// answered 400 like an unknown parameter of the other routes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoQuery {}

/// Query of the stream.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// Replay the events after this seq first (`Last-Event-ID` wins when
    /// both are given). Without either, the stream starts at the latest
    /// event with the current activation set.
    #[param(minimum = 0)]
    after_seq: Option<i64>,
}

/// Server-sent events of the session: `event: event` for each new event
/// (`id` its seq, data the stored event), `event: activations` after each
/// refresh point (data the §9 activations object).
#[utoipa::path(
    get,
    path = "/v1/sessions/{id}/stream",
    params(
        ("id" = Uuid, Path, description = "The session"),
        ("Last-Event-ID" = Option<i64>, Header, description = "Resume after this seq (the last `id` received)"),
        StreamQuery
    ),
    responses(
        (status = 200, description = "`text/event-stream`", content_type = "text/event-stream", body = String),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 422, description = "The cursor is past the latest event, or `after_seq` is below 0 (`invalid`)", body = ErrorBody),
        (status = 503, description = "The database is unavailable, the request timed out (`timeout`), or the answers held for clients fill --response-memory (`busy`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
async fn stream(
    State(server): State<Server>,
    headers: HeaderMap,
    SessionPath(id): SessionPath,
    q: Params<StreamQuery>,
) -> Result<Response, ApiError> {
    let (_, session_id) = server.session_for(&headers, Scope::Read, &id).await?;
    let q = query(q)?;
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .map(str::trim)
                // Digits only: `+3` parses as an integer, but is no id
                // this server sent (nor an `after_seq` it takes).
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request("`Last-Event-ID` must be a seq (a whole number ≥ 0)")
                })?,
        ),
    };
    if q.after_seq.is_some_and(|s| s < 0) {
        return Err(out_of_range(
            "after_seq",
            "`after_seq` must be ≥ 0".to_owned(),
        ));
    }
    let store = &server.inner.store;
    let (mut state, announce) = match last_event_id.or(q.after_seq) {
        Some(0) => (SessionState::empty(session_id), false),
        // `event N` and `activations N` share the id N: a client cut off
        // between the two resumes with N and must still get the set, so
        // the set at a refresh point N is sent again (twice at most, the
        // same set both times).
        Some(after) => {
            // The window is never read: the state starts from the view
            // when it is at or before the cursor (a client reconnecting
            // after the latest refresh point), else from seq 1, and holds
            // no rows either way (a session never compacted has its whole
            // log as its window).
            let state = store.rowless_at(session_id, after, true).await?;
            let refresh = state.refresh_seq == after;
            (state, refresh)
        }
        // A session with a long window (one never compacted) starts
        // from its view alone, not its whole window.
        None => (store.latest_without_rows(session_id).await?, true),
    };
    // The stream only ever announces activation sets: the window's texts,
    // inputs and outputs are not kept (one copy per open stream).
    state.shed_payloads();
    // A few events ahead of the client, not more: with events of up to the
    // largest accepted size, each one held here is memory a client that
    // stops reading makes the server keep.
    let (tx, rx) = mpsc::channel::<Result<SseEvent, Infallible>>(STREAM_AHEAD);
    tokio::spawn(feed_stream(server.clone(), session_id, state, announce, tx));
    Ok(Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response())
}

/// A query parameter that parsed but is out of its range: 422 `invalid`
/// naming it, as the audit routes answer (docs/api.md: what does not parse
/// is 400, what parses but is refused is 422).
fn out_of_range(field: &'static str, message: String) -> ApiError {
    ApiError::from(crate::store::query::bad(field, message))
}

/// Events a stream's task may have sent ahead of what its client read.
const STREAM_AHEAD: usize = 2;
/// About how many bytes of events a stream reads from the store at once
/// (more by at most one event): a page of large events (up to the store's
/// event limit, 1 MiB by default) must not hold hundreds of megabytes per
/// stream, while small events still come 500 at a time.
const STREAM_PAGE_BYTES: usize = 1024 * 1024;
/// The most events a stream reads at once (small events).
const STREAM_PAGE_EVENTS: i64 = 500;

fn sse_json<T: Serialize>(kind: &str, id: i64, value: &T) -> SseEvent {
    // Our types always serialize; an empty object would be the fallback.
    let data = serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned());
    SseEvent::default()
        .event(kind)
        .id(id.to_string())
        .data(data)
}

/// The sending side of a stream's events.
type StreamTx = mpsc::Sender<Result<SseEvent, Infallible>>;

/// Waits before a stream reads again after a failure; true when its client
/// left meanwhile (nothing else would notice while the stream retries).
async fn gone_before_retry(tx: &StreamTx) -> bool {
    tokio::select! {
        _ = tx.closed() => true,
        _ = tokio::time::sleep(Duration::from_millis(500)) => false,
    }
}

/// Ends a stream with one `error` event saying `e`.
async fn end_with_error(tx: &StreamTx, seq: i64, e: Error) {
    let _ = tx
        .send(Ok(sse_json("error", seq, &ApiError::from(e).body)))
        .await;
}

/// Sends a session's events from `state.seq` on, then waits for more,
/// until the client hangs up or the server shuts down.
async fn feed_stream(
    server: Server,
    session_id: Uuid,
    mut state: SessionState,
    announce: bool,
    tx: StreamTx,
) {
    let inner = server.inner.clone();
    let metrics = &inner.metrics;
    metrics.streams.inc();
    let mut shutdown = inner.shutdown.subscribe();
    let store = inner.store.clone();
    // Lag is the delivery of what was appended while the stream was open:
    // a catch-up over a session's past, or imported events (which keep
    // the `recorded_at` of their source, years back), would report their
    // age instead (a review saw the histogram's sum reach 6.4e10 s).
    let opened = chrono::Utc::now();
    let run = async {
        if announce
            && tx
                .send(Ok(sse_json("activations", state.seq, &state.activations())))
                .await
                .is_err()
        {
            return;
        }
        // A client gone while the watch was being set up (it may wait for
        // a connection) ends the stream at once.
        let watching = tokio::select! {
            w = store.watch() => w,
            _ = tx.closed() => return,
        };
        let mut watch = match watching {
            Ok(w) => w,
            Err(e) => {
                warn!(cause = %e, "cannot watch the session");
                return end_with_error(&tx, state.seq, e).await;
            }
        };
        loop {
            // Catch up page by page, then wait for the head to move.
            loop {
                let page = match store
                    .history_within(session_id, state.seq, STREAM_PAGE_EVENTS, STREAM_PAGE_BYTES)
                    .await
                {
                    Ok(p) => p,
                    // Storage that is down for now: read again, unless the
                    // client has gone meanwhile (nothing else would notice).
                    Err(e) if e.is_retryable() => {
                        warn!(cause = %e, "stream read failed; retrying");
                        if gone_before_retry(&tx).await {
                            return;
                        }
                        continue;
                    }
                    // A failure that reading again will not mend (a row the
                    // store cannot read back): said, and the stream ends.
                    Err(e) => {
                        warn!(cause = %e, "stream read failed; the stream ends");
                        return end_with_error(&tx, state.seq, e).await;
                    }
                };
                if page.is_empty() {
                    break;
                }
                for ev in page {
                    if ev.recorded_at >= opened {
                        let lag = (chrono::Utc::now() - ev.recorded_at).num_milliseconds();
                        metrics
                            .subscription_lag_seconds
                            .observe(lag.max(0) as f64 / 1000.0);
                    }
                    let (seq, refresh) = (ev.seq, ev.body.is_refresh_point());
                    let sent = sse_json("event", seq, &ev);
                    // The event itself goes to the state, shed of its texts.
                    if let Err(e) = store.apply_to_rowless(&mut state, ev).await {
                        // The client resumes from the last event it got.
                        warn!(cause = %e, "stream could not follow a compaction");
                        return end_with_error(&tx, state.seq, e).await;
                    }
                    if tx.send(Ok(sent)).await.is_err() {
                        return;
                    }
                    if refresh
                        && tx
                            .send(Ok(sse_json("activations", seq, &state.activations())))
                            .await
                            .is_err()
                    {
                        return;
                    }
                }
                // Nor every call of a long replay.
                state.forget_calls_outside_window();
            }
            tokio::select! {
                _ = tx.closed() => return,
                r = watch.wait_past(session_id, state.seq, STREAM_WAIT) => {
                    if let Err(e) = r {
                        debug!(cause = %e, "stream wait failed; retrying");
                        if gone_before_retry(&tx).await {
                            return;
                        }
                    }
                }
            }
        }
    };
    tokio::select! {
        _ = run => {}
        _ = shutdown.wait_for(|s| *s) => debug!("stream closed by shutdown"),
    }
    metrics.streams.dec();
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "Alive", body = Health)))]
async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// Liveness and readiness answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok` or `ready`.
    pub status: &'static str,
}

/// Readiness: the database answers a read, and (SQLite) its file is the
/// one the store opened.
#[utoipa::path(
    get,
    path = "/readyz",
    responses(
        (status = 200, description = "The database answers", body = Health),
        (status = 503, description = "It does not", body = ErrorBody),
    )
)]
async fn readyz(State(server): State<Server>) -> Result<Json<Health>, ApiError> {
    server.inner.store.ready().await?;
    Ok(Json(Health { status: "ready" }))
}

/// Prometheus metrics (OpenMetrics text); no labels name tenants,
/// sessions or tools.
#[utoipa::path(
    get,
    path = "/metrics",
    responses((status = 200, description = "OpenMetrics text", content_type = "application/openmetrics-text", body = String))
)]
async fn metrics_text(State(server): State<Server>) -> Response {
    server
        .inner
        .metrics
        .observe_paths(server.inner.store.append_paths());
    server
        .inner
        .metrics
        .observe_cache(server.inner.store.state_cache_usage());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        server.inner.metrics.encode(),
    )
        .into_response()
}

/// This API's OpenAPI 3 document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    responses((status = 200, description = "The document", content_type = "application/json", body = Object))
)]
async fn openapi_doc() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], openapi_json()).into_response()
}
