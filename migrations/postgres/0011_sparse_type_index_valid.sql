-- A build of `events_sparse_types` that 0009 started and did not finish
-- (cut off by a lock or statement timeout, a cancel, a crash) leaves the
-- index invalid, and 0009's IF NOT EXISTS then passes over it: the
-- planner never uses an invalid index, so queries by a sparse type would
-- read the log in position order for ever. Rebuilt here, in the
-- migration's transaction (appends wait for the rebuild; reads do not).
-- Nothing happens when the index is valid, as it is after a build that
-- finished. (0010 is SQLite's.)
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index
               WHERE indexrelid = to_regclass('events_sparse_types') AND NOT indisvalid) THEN
        EXECUTE 'REINDEX INDEX events_sparse_types';
    END IF;
END
$$;
