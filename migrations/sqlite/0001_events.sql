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
