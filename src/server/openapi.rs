//! The OpenAPI 3 document, generated from the handlers' annotations and the
//! types' doc comments (utoipa), so it cannot drift from the code; CI
//! compares it with the committed `docs/openapi.json`.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::*;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "session-store",
        description = "Event-sourced session store for AI agent sidecars: append events, read the effective context and the deferred activation set. See docs/api.md.",
    ),
    paths(
        append, history, context, activations, recover, stream, healthz, readyz, metrics_text,
        openapi_doc, audit::explain, audit::refreshes, audit::audit_events, audit::audit_changes,
        audit::audit_anomalies
    ),
    components(schemas(
        AppendRequest, EventInput, AppendResponse, AppendedEvent, HistoryPage, Health, ErrorBody,
        crate::event::EventBody, crate::event::ToolStatus, StoredEvent, Context,
        crate::projector::ContextRow, Activations, crate::projector::Activation, Recovery,
        crate::audit::Explanation, crate::audit::EvidenceRow, crate::audit::EvidenceSource,
        crate::audit::CatalogRef, crate::audit::Reason, crate::audit::Refresh,
        crate::audit::Removed, audit::RefreshList, crate::store::query::EventPage,
        crate::store::query::ChangePage, crate::store::ChangeRow,
        crate::store::query::AnomalyPage, crate::store::query::Anomaly,
        crate::store::query::AnomalyKind
    )),
    modifiers(&Bearer),
    tags((name = "session-store"))
)]
struct ApiDoc;

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A token from the server's token document; it names a tenant and scopes (read, write, audit).",
                    ))
                    .build(),
            ),
        );
    }
}

/// The OpenAPI document as pretty JSON (what `GET /openapi.json` and
/// `session-store openapi` print).
pub fn openapi_json() -> String {
    let mut doc = ApiDoc::openapi();
    // The crate version would make the committed copy change on every
    // release without an API change; the API's version is its `/v1` prefix.
    doc.info.version = "1".to_owned();
    doc.to_pretty_json()
        .map(|mut s| {
            s.push('\n');
            s
        })
        .unwrap_or_else(|e| format!("{{\"error\": \"cannot render the OpenAPI document: {e}\"}}\n"))
}
