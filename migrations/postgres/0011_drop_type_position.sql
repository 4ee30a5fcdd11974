-- no-transaction
-- The index of every event by type, replaced by `events_sparse_types`
-- (0009). Dropped CONCURRENTLY, outside a transaction (so alone in its
-- file): a plain DROP INDEX takes an ACCESS EXCLUSIVE lock on `events`
-- until its transaction ends, which stops every other instance's reads
-- and appends, and waits behind any open transaction on the table.
DROP INDEX CONCURRENTLY IF EXISTS events_type_position;
