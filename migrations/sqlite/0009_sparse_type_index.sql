-- Events by type: only the sparse types are indexed (docs/audit.md,
-- "Events by type").
--
-- `events_type_position` put every event into an index keyed by type, so a
-- commit dirtied the last leaf of each type's range: about 16 of the 110
-- WAL pages a batch of 100 wrote, for 100 entries of 20 bytes
-- (docs/benchmarks.md, item 34). The three transcript types that make up
-- most of a log (assistant text, tool calls and results) are found as
-- fast by reading the log in position order and keeping theirs, since
-- every few rows is one; the others are a small share of a log, and for
-- them the index is what makes a page of them a short read.
--
-- The WHERE below is the one the queries repeat word for word
-- (`SPARSE_TYPES` in src/store/query.rs): SQLite uses a partial index only
-- for a query whose WHERE holds each term of the index's.
DROP INDEX events_type_position;
CREATE INDEX events_sparse_types ON events (type, position)
    WHERE type IN ('session_started', 'catalog_defined', 'prompt_submitted', 'compaction', 'mode_switched');
