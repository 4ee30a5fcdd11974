-- Every write of a group commit's accepted batches in one call (the
-- store's `PgTx::flush`). Why a function: the connections plan each
-- statement anew (`plan_cache_mode = force_custom_plan`, which the reads
-- need: a generic plan costed while the tables were small kept scanning
-- after they grew), and re-planning this many-CTE write took more time
-- than running it (0.70 against 0.32 ms per single-event append,
-- docs/benchmarks.md). Inside the function the statements are prepared
-- once per connection and, with `plan_cache_mode = auto`, switch to one
-- generic plan; inserts from arrays and upserts by primary key have no
-- plan that depends on a table's size.
CREATE FUNCTION session_store_write(
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
) RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = 'auto'
AS $$
BEGIN
    IF reserved > 0 THEN
        UPDATE event_position SET last = last + reserved WHERE id = 1;
    END IF;
    INSERT INTO events (position, session_id, seq, event_id, type, payload, recorded_at, hash)
        SELECT * FROM UNNEST(ev_position, ev_session, ev_seq, ev_id, ev_type, ev_payload,
                             ev_recorded_at, ev_hash);
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
            SELECT * FROM UNNEST(ch_position, ch_tool, ch_session, ch_seq, ch_recorded_at,
                                 ch_change, ch_evidence);
    END IF;
    PERFORM pg_notify(channel, w) FROM UNNEST(wakeups) AS w;
END
$$;
