-- `session_store_append` (migration 0007) with a statement per table a
-- group writes, in place of one statement of data-modifying CTEs that
-- wrote all five tables whatever the group held.
--
-- A plpgsql statement's executor start opens every table it writes and
-- every index of each (`events` has eight, `activation_changes` four):
-- the CTEs paid that for the calls, views, owners and activation changes
-- of a group of prompts and assistant text, which has none. Measured on
-- one PostgreSQL server of its own (fsync on), the two bodies swapped in
-- place between runs of `append_probe postgres distinct 1,4,16 1 2 2`,
-- three alternating rounds: the call's server time 13-30 % lower for
-- single events, 5 % more of them stored in each of the nine pairs;
-- batches of 10 and 100 within the noise (docs/benchmarks.md, item 39).
--
-- Same arguments, checks and result: an instance of the previous version,
-- still running during a rolling upgrade, calls this one unchanged. The
-- writes now run one after the other, each seeing the ones before it,
-- where the CTEs shared one snapshot: they write different tables, and
-- none reads another's rows.
CREATE OR REPLACE FUNCTION session_store_append(
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
    -- The checks in two statements, then one statement per table the
    -- group writes: each costs a snapshot and an executor start, and a
    -- table left out costs neither (see the head of this file).
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
    INSERT INTO events (position, session_id, seq, event_id, type, payload, recorded_at, hash)
        SELECT p + base, s, q, id, t, pl, r, h
        FROM UNNEST(ev_position, ev_session, ev_seq, ev_id, ev_type, ev_payload,
                    ev_recorded_at, ev_hash) AS u(p, s, q, id, t, pl, r, h);
    -- The store sends at most one row per key of each table below.
    IF cardinality(c_session) > 0 THEN
        INSERT INTO calls (session_id, call_id, tool_name, call_seq, result_seq)
            SELECT * FROM UNNEST(c_session, c_id, c_tool, c_seq, c_result_seq)
            ON CONFLICT (session_id, call_id) DO UPDATE SET result_seq = EXCLUDED.result_seq;
    END IF;
    IF cardinality(v_session) > 0 THEN
        INSERT INTO session_views
            (session_id, refresh_seq, mode, window_start, compaction_seq, summary, catalogs,
             evidence, active)
            SELECT * FROM UNNEST(v_session, v_refresh_seq, v_mode, v_window_start, v_compaction,
                                 v_summary, v_catalogs, v_evidence, v_active)
            ON CONFLICT (session_id) DO UPDATE SET refresh_seq = EXCLUDED.refresh_seq,
                mode = EXCLUDED.mode, window_start = EXCLUDED.window_start,
                compaction_seq = EXCLUDED.compaction_seq, summary = EXCLUDED.summary,
                catalogs = EXCLUDED.catalogs, evidence = EXCLUDED.evidence,
                active = EXCLUDED.active;
    END IF;
    IF cardinality(o_session) > 0 THEN
        INSERT INTO session_owners (session_id, tenant)
            SELECT * FROM UNNEST(o_session, o_tenant);
    END IF;
    IF cardinality(ch_position) > 0 THEN
        INSERT INTO activation_changes
            (position, tool, session_id, seq, recorded_at, change, evidence_seq)
            SELECT p + base, t, s, q, r, c, e
            FROM UNNEST(ch_position, ch_tool, ch_session, ch_seq, ch_recorded_at, ch_change,
                        ch_evidence) AS u(p, t, s, q, r, c, e);
    END IF;
    SELECT count(pg_notify(channel, w)) INTO sent FROM UNNEST(wakeups) AS w;
    RETURN base;
END
$$;
