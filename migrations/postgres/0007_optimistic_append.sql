-- Every write of a group commit in one call, in place of
-- `session_store_write` (migration 0006, whose reasons hold: its
-- statements keep their plans), now also the optimistic append
-- (docs/design.md, "Optimistic appends on PostgreSQL").
--
-- Locked (`optimistic` false): the caller's transaction holds the
-- counter's lock and the positions are final; returns 0.
--
-- Optimistic: one autocommitted call for a group the store judged against
-- the session states an earlier append of the same process left. Under the
-- counter's lock it checks what the judgement assumed, then writes, with
-- the positions (reserved from 0 by the store) moved past the counter. Any
-- failed check raises, so nothing is written and the store judges the
-- group again under the lock. Returns the counter's value before the
-- write: the store moves the positions it answers with by as much.
CREATE FUNCTION session_store_append(
    optimistic     BOOLEAN,
    expect_session UUID[],
    expect_seq     BIGINT[],
    absent_session UUID[],
    absent_call    TEXT[],
    reserved       BIGINT,
    ev_position    BIGINT[],
    ev_session     UUID[],
    ev_seq         BIGINT[],
    ev_id          UUID[],
    ev_type        TEXT[],
    ev_payload     TEXT[],
    ev_recorded_at TIMESTAMPTZ[],
    ev_hash        TEXT[],
    c_session      UUID[],
    c_id           TEXT[],
    c_tool         TEXT[],
    c_seq          BIGINT[],
    c_result_seq   BIGINT[],
    v_session      UUID[],
    v_refresh_seq  BIGINT[],
    v_mode         TEXT[],
    v_window_start BIGINT[],
    v_compaction   BIGINT[],
    v_summary      TEXT[],
    v_catalogs     TEXT[],
    v_evidence     TEXT[],
    v_active       TEXT[],
    o_session      UUID[],
    o_tenant       TEXT[],
    ch_position    BIGINT[],
    ch_tool        TEXT[],
    ch_session     UUID[],
    ch_seq         BIGINT[],
    ch_recorded_at TIMESTAMPTZ[],
    ch_change      TEXT[],
    ch_evidence    BIGINT[],
    channel        TEXT,
    wakeups        TEXT[]
) RETURNS BIGINT
LANGUAGE plpgsql
SET plan_cache_mode = 'auto'
-- Generic plans are made once per connection, with the statistics of that
-- moment. Costed on a table that was empty when last analyzed (a new
-- store), the checks below were planned as scans of the whole table, kept
-- while it grew, and appends fell to a twentieth of their rate
-- (docs/benchmarks.md). Every read here is a lookup by key: no plan may
-- scan a table.
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    base  BIGINT := 0;
    moved BOOLEAN;
    taken BOOLEAN;
    sent  BIGINT;
BEGIN
    -- Three statements in all: each one a plpgsql statement costs a
    -- snapshot and an executor start, which for a small group were most of
    -- the call (docs/benchmarks.md).
    IF optimistic THEN
        -- The lock every append takes first (and the counter's value
        -- before this group's positions); each statement below then reads
        -- what the appends before it committed.
        UPDATE event_position SET last = last + reserved WHERE id = 1
            RETURNING last - reserved INTO base;
        -- Each key is looked up by itself (a subquery per key, which the
        -- planner cannot turn into a join).
        SELECT EXISTS (
                   SELECT 1 FROM UNNEST(expect_session, expect_seq) AS x(s, q)
                   WHERE COALESCE((SELECT e.seq FROM events e WHERE e.session_id = x.s
                                   ORDER BY e.seq DESC LIMIT 1), 0) <> x.q),
               cardinality(absent_session) > 0 AND EXISTS (
                   SELECT 1 FROM UNNEST(absent_session, absent_call) AS a(s, id)
                   WHERE (SELECT 1 FROM calls c WHERE c.session_id = a.s AND c.call_id = a.id
                          LIMIT 1) IS NOT NULL)
            INTO moved, taken;
        IF moved THEN
            RAISE EXCEPTION 'a session was appended to since this process last wrote it'
                USING ERRCODE = 'SS001';
        END IF;
        IF taken THEN
            RAISE EXCEPTION 'a call id judged new is already stored' USING ERRCODE = 'SS002';
        END IF;
    ELSIF reserved > 0 THEN
        UPDATE event_position SET last = last + reserved WHERE id = 1;
    END IF;
    -- Every write in one statement (data-modifying CTEs run to completion
    -- whether read or not; each writes another table, and the store sends
    -- at most one row per key of each).
    WITH ev AS (
        INSERT INTO events (position, session_id, seq, event_id, type, payload, recorded_at,
                            hash)
            SELECT p + base, s, q, id, t, pl, r, h
            FROM UNNEST(ev_position, ev_session, ev_seq, ev_id, ev_type, ev_payload,
                        ev_recorded_at, ev_hash) AS u(p, s, q, id, t, pl, r, h)
    ), c AS (
        INSERT INTO calls (session_id, call_id, tool_name, call_seq, result_seq)
            SELECT * FROM UNNEST(c_session, c_id, c_tool, c_seq, c_result_seq)
            ON CONFLICT (session_id, call_id) DO UPDATE SET result_seq = EXCLUDED.result_seq
    ), v AS (
        INSERT INTO session_views
            (session_id, refresh_seq, mode, window_start, compaction_seq, summary, catalogs,
             evidence, active)
            SELECT * FROM UNNEST(v_session, v_refresh_seq, v_mode, v_window_start, v_compaction,
                                 v_summary, v_catalogs, v_evidence, v_active)
            ON CONFLICT (session_id) DO UPDATE SET refresh_seq = EXCLUDED.refresh_seq,
                mode = EXCLUDED.mode, window_start = EXCLUDED.window_start,
                compaction_seq = EXCLUDED.compaction_seq, summary = EXCLUDED.summary,
                catalogs = EXCLUDED.catalogs, evidence = EXCLUDED.evidence,
                active = EXCLUDED.active
    ), o AS (
        INSERT INTO session_owners (session_id, tenant)
            SELECT * FROM UNNEST(o_session, o_tenant)
    ), ch AS (
        INSERT INTO activation_changes
            (position, tool, session_id, seq, recorded_at, change, evidence_seq)
            SELECT p + base, t, s, q, r, c, e
            FROM UNNEST(ch_position, ch_tool, ch_session, ch_seq, ch_recorded_at, ch_change,
                        ch_evidence) AS u(p, t, s, q, r, c, e)
    )
    SELECT count(pg_notify(channel, w)) INTO sent FROM UNNEST(wakeups) AS w;
    RETURN base;
END
$$;

-- `session_store_write` stays: instances of the previous version, still
-- running beside a migrated one during a rolling upgrade, call it.
