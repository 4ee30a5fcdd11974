-- Tenant ownership (docs/api.md, "Tenants"): the tenant whose token created
-- a session. Written in the transaction of the session's first append, so
-- two tenants racing to create one id cannot both own it. A session without
-- a row (appended through the CLI or before this migration) belongs to the
-- tenant "default".
CREATE TABLE session_owners (
    session_id TEXT PRIMARY KEY,
    tenant     TEXT NOT NULL
);

CREATE INDEX session_owners_tenant ON session_owners (tenant, session_id);
