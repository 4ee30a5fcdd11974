-- The optimistic append (docs/design.md, "Optimistic appends on
-- PostgreSQL"): a group of appends judged by the store against the session
-- states an earlier append of the same process left, written in one
-- autocommitted call. Under the counter's lock it checks what the
-- judgement assumed, then writes exactly as `session_store_write`, with
-- the positions (reserved from 0 by the store) moved past the counter.
-- Any failed check raises, so nothing is written and the store judges the
-- group again under the lock. Returns the counter's value before the
-- write: the store moves the positions it answers with by as much.
CREATE FUNCTION session_store_append(
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
AS $$
DECLARE
    base BIGINT;
BEGIN
    -- The lock every append takes first; each statement below then reads
    -- what the appends before it committed.
    SELECT last INTO base FROM event_position WHERE id = 1 FOR UPDATE;
    IF EXISTS (
        SELECT 1 FROM UNNEST(expect_session, expect_seq) AS x(s, q)
        WHERE COALESCE((SELECT e.seq FROM events e WHERE e.session_id = x.s
                        ORDER BY e.seq DESC LIMIT 1), 0) <> x.q
    ) THEN
        RAISE EXCEPTION 'a session was appended to since this process last wrote it'
            USING ERRCODE = 'SS001';
    END IF;
    -- Both checks look each key up by itself (a subquery per key, which
    -- the planner cannot turn into a join): a join was planned once, as a
    -- scan of the whole table while it was small, and kept (generic plans).
    IF cardinality(absent_session) > 0 AND EXISTS (
        SELECT 1 FROM UNNEST(absent_session, absent_call) AS a(s, id)
        WHERE (SELECT 1 FROM calls c WHERE c.session_id = a.s AND c.call_id = a.id
               LIMIT 1) IS NOT NULL
    ) THEN
        RAISE EXCEPTION 'a call id judged new is already stored' USING ERRCODE = 'SS002';
    END IF;
    PERFORM session_store_write(
        reserved,
        ARRAY(SELECT p + base FROM UNNEST(ev_position) WITH ORDINALITY AS u(p, i) ORDER BY i),
        ev_session, ev_seq, ev_id, ev_type, ev_payload, ev_recorded_at, ev_hash,
        c_session, c_id, c_tool, c_seq, c_result_seq,
        v_session, v_refresh_seq, v_mode, v_window_start, v_compaction, v_summary, v_catalogs,
        v_evidence, v_active,
        o_session, o_tenant,
        ARRAY(SELECT p + base FROM UNNEST(ch_position) WITH ORDINALITY AS u(p, i) ORDER BY i),
        ch_tool, ch_session, ch_seq, ch_recorded_at, ch_change, ch_evidence,
        channel, wakeups);
    RETURN base;
END
$$;
