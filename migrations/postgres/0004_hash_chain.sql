-- Tamper evidence (docs/integrity.md): every event stores a sha256 chained
-- to the previous event of its session, computed by the store at append.
ALTER TABLE events ADD COLUMN hash TEXT;

-- Rows without a hash: only rows written before this migration, which the
-- store chains once when it opens (chain_backfill lists their sessions).
-- After that a missing hash is a break that verify --integrity reports.
CREATE INDEX events_unchained ON events (session_id, seq) WHERE hash IS NULL;
CREATE TABLE chain_backfill (session_id UUID PRIMARY KEY);
INSERT INTO chain_backfill SELECT DISTINCT session_id FROM events;

-- Still append-only; the one update allowed is filling in a missing hash,
-- once, with every other column unchanged (the backfill above).
CREATE OR REPLACE FUNCTION events_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.hash IS NULL AND NEW.hash IS NOT NULL
       AND (NEW.position, NEW.session_id, NEW.seq, NEW.event_id, NEW.type, NEW.payload, NEW.recorded_at)
           IS NOT DISTINCT FROM
           (OLD.position, OLD.session_id, OLD.seq, OLD.event_id, OLD.type, OLD.payload, OLD.recorded_at)
    THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'events are append-only: % is not allowed', TG_OP;
END
$$;
