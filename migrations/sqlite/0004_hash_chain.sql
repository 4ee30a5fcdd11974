-- Tamper evidence (docs/integrity.md): every event stores a sha256 chained
-- to the previous event of its session, computed by the store at append.
ALTER TABLE events ADD COLUMN hash TEXT;

-- Rows without a hash: only rows written before this migration, which the
-- store chains once when it opens (chain_backfill lists their sessions).
-- After that a missing hash is a break that verify --integrity reports.
CREATE INDEX events_unchained ON events (session_id, seq) WHERE hash IS NULL;
CREATE TABLE chain_backfill (session_id TEXT PRIMARY KEY);
INSERT INTO chain_backfill SELECT DISTINCT session_id FROM events;

-- Still append-only; the one update allowed is filling in a missing hash,
-- once, with every other column unchanged (the backfill above).
DROP TRIGGER events_no_update;
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
WHEN NOT (OLD.hash IS NULL AND NEW.hash IS NOT NULL
          AND NEW.position = OLD.position AND NEW.session_id = OLD.session_id
          AND NEW.seq = OLD.seq AND NEW.event_id = OLD.event_id
          AND NEW.type = OLD.type AND NEW.payload = OLD.payload
          AND NEW.recorded_at = OLD.recorded_at)
BEGIN
    SELECT RAISE(ABORT, 'events are append-only: UPDATE is not allowed');
END;
