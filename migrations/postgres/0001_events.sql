-- The append-only event log (SEMANTICS §2).
-- position: global order; assigned from event_position, a one-row counter
-- locked (SELECT ... FOR UPDATE) at the start of every append, so positions
-- are handed out in commit order (docs/design.md, "Global order").
CREATE TABLE events (
    position    BIGINT      PRIMARY KEY,
    session_id  UUID        NOT NULL,
    seq         BIGINT      NOT NULL CHECK (seq >= 1),
    event_id    UUID        NOT NULL UNIQUE,
    type        TEXT        NOT NULL,
    payload     TEXT        NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL,
    CONSTRAINT events_session_seq UNIQUE (session_id, seq)
);

CREATE TABLE event_position (
    id   SMALLINT PRIMARY KEY CHECK (id = 1),
    last BIGINT   NOT NULL
);
INSERT INTO event_position (id, last) VALUES (1, 0);

-- The database refuses to change history, whoever asks.
CREATE FUNCTION events_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events are append-only: % is not allowed', TG_OP;
END
$$;

CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_refuse_change();

CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change();

-- Every tool call of a session, written with the events: validation looks
-- calls up here instead of folding the whole history (a derived index;
-- `rebuild` recomputes it).
CREATE TABLE calls (
    session_id UUID   NOT NULL,
    call_id    TEXT   NOT NULL,
    tool_name  TEXT   NOT NULL,
    call_seq   BIGINT NOT NULL,
    result_seq BIGINT,
    PRIMARY KEY (session_id, call_id)
);

-- The materialized view (SEMANTICS §8): each session's state at its latest
-- refresh point, written in the transaction that appends the refresh point.
CREATE TABLE session_views (
    session_id     UUID   PRIMARY KEY,
    refresh_seq    BIGINT NOT NULL,
    mode           TEXT   NOT NULL,
    window_start   BIGINT NOT NULL,
    compaction_seq BIGINT,
    summary        TEXT,
    catalogs       TEXT   NOT NULL, -- {"mode": {"tools": [...], "seq": n}}
    evidence       TEXT   NOT NULL, -- {"name": evidence_seq} for the window
    active         TEXT   NOT NULL  -- [{"name", "evidence_seq"}], sorted
);
