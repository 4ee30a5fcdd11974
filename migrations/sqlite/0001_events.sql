-- The append-only event log (SEMANTICS §2).
-- position: global order; assigned by the store under the write lock
-- (BEGIN IMMEDIATE), so it grows in commit order.
CREATE TABLE events (
    position    INTEGER PRIMARY KEY,
    session_id  TEXT    NOT NULL,
    seq         INTEGER NOT NULL CHECK (seq >= 1),
    event_id    TEXT    NOT NULL UNIQUE,
    type        TEXT    NOT NULL,
    payload     TEXT    NOT NULL,
    recorded_at TEXT    NOT NULL,
    UNIQUE (session_id, seq)
);

-- The database refuses to change history, whoever asks.
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN
    SELECT RAISE(ABORT, 'events are append-only: UPDATE is not allowed');
END;

CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN
    SELECT RAISE(ABORT, 'events are append-only: DELETE is not allowed');
END;

-- Every tool call of a session, written with the events: validation looks
-- calls up here instead of folding the whole history (a derived index;
-- `rebuild` recomputes it).
CREATE TABLE calls (
    session_id TEXT    NOT NULL,
    call_id    TEXT    NOT NULL,
    tool_name  TEXT    NOT NULL,
    call_seq   INTEGER NOT NULL,
    result_seq INTEGER,
    PRIMARY KEY (session_id, call_id)
);

-- The materialized view (SEMANTICS §8): each session's state at its latest
-- refresh point, written in the transaction that appends the refresh point.
CREATE TABLE session_views (
    session_id     TEXT    PRIMARY KEY,
    refresh_seq    INTEGER NOT NULL,
    mode           TEXT    NOT NULL,
    window_start   INTEGER NOT NULL,
    compaction_seq INTEGER,
    summary        TEXT,
    catalogs       TEXT    NOT NULL, -- {"mode": {"tools": [...], "seq": n}}
    evidence       TEXT    NOT NULL, -- {"name": evidence_seq} for the window
    active         TEXT    NOT NULL  -- [{"name", "evidence_seq"}], sorted
);
