-- Payloads and the view's JSON columns compressed with lz4 instead of
-- PostgreSQL's default pglz. A tool result of a few KB is compressed on
-- every append (TOAST compresses any row over about 2 KB), and perf of a
-- batch-of-100 append probe put `pglz_compress` at 43 % of the server's
-- CPU (docs/benchmarks.md, item 14 of "What changed in the evening of
-- 2026-12-04"); lz4 compresses several times faster and decompresses
-- faster on reads. Only new values use it: stored ones keep pglz, and
-- PostgreSQL reads either. A server built without lz4 (or older than 14)
-- keeps pglz: the store works the same, only slower.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE events ALTER COLUMN payload SET COMPRESSION lz4';
    EXECUTE 'ALTER TABLE session_views
                 ALTER COLUMN summary  SET COMPRESSION lz4,
                 ALTER COLUMN catalogs SET COMPRESSION lz4,
                 ALTER COLUMN evidence SET COMPRESSION lz4,
                 ALTER COLUMN active   SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    RAISE NOTICE 'lz4 compression is not available on this server; payloads keep pglz';
END
$$;
