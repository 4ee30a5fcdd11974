-- Audit queries (docs/audit.md). Each cross-session query reads an index.

-- Events by type in global order, and by time.
CREATE INDEX events_type_position ON events (type, position);
CREATE INDEX events_recorded_at ON events (recorded_at, position);

-- Results that carry added_tool_names (the unknown-evidence-name scan:
-- the stored text leaves absent fields out), and each session's catalogs.
CREATE INDEX events_named_results ON events (position)
    WHERE type = 'tool_result' AND payload LIKE '%"added_tool_names"%';
CREATE INDEX events_catalogs ON events (session_id, seq) WHERE type = 'catalog_defined';

-- Tool calls never answered.
CREATE INDEX calls_unanswered ON calls (session_id, call_seq) WHERE result_seq IS NULL;

-- Where a deferred tool entered or left the activation set: one row per
-- name and refresh point whose set differs from the previous refresh
-- point's. Derived like session_views: written in the append's
-- transaction, recomputed by rebuild, compared by verify.
CREATE TABLE activation_changes (
    position     INTEGER NOT NULL, -- the refresh point's
    tool         TEXT    NOT NULL,
    session_id   TEXT    NOT NULL,
    seq          INTEGER NOT NULL,
    recorded_at  TEXT    NOT NULL,
    change       TEXT    NOT NULL CHECK (change IN ('added', 'removed')),
    evidence_seq INTEGER,          -- for 'added'
    PRIMARY KEY (position, tool)
);
CREATE INDEX activation_changes_tool ON activation_changes (tool, recorded_at, position);
CREATE INDEX activation_changes_time ON activation_changes (recorded_at, position);
CREATE INDEX activation_changes_session ON activation_changes (session_id, seq);

-- Sessions written before this table existed: the store computes their
-- changes once, when it opens.
CREATE TABLE changes_backfill (session_id TEXT PRIMARY KEY);
INSERT INTO changes_backfill SELECT DISTINCT session_id FROM events;
