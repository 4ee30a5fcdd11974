-- The views keyed by session alone (WITHOUT ROWID).
--
-- A rowid table whose primary key is not an INTEGER one is two B-trees:
-- the rows by rowid, and the key's index pointing at them. A view is
-- rewritten at each refresh point with INSERT OR REPLACE, which deleted
-- the old row and its key entry and inserted both again under a new rowid:
-- a leaf of the key's index for each session of a commit, and the
-- table's last leaf. Stored in the key's B-tree, a view is replaced in
-- its one leaf: 4.8 WAL pages a commit of 16 sessions' single events
-- became 3.7 (docs/benchmarks.md, item 34). Nothing reads views by rowid.
--
-- `calls` stays a rowid table: there a result updates its call's row,
-- which sits in the table's last leaves when the call is recent, where
-- keyed by session it would be one more leaf per session of a commit
-- (13 WAL pages a commit of 16 sessions against 8.6, measured). So does
-- `activation_changes`: keyed by (position, tool) alone, its rows in key
-- order made SQLite's planner read a time range by scanning the whole
-- table in position order rather than through `activation_changes_time`
-- (tests/audit.rs).
--
-- The rows are derived (`rebuild` recomputes them): copied as they are.
CREATE TABLE session_views_by_key (
    session_id     TEXT    NOT NULL PRIMARY KEY,
    refresh_seq    INTEGER NOT NULL,
    mode           TEXT    NOT NULL,
    window_start   INTEGER NOT NULL,
    compaction_seq INTEGER,
    summary        TEXT,
    catalogs       TEXT    NOT NULL, -- {"mode": {"tools": [...], "seq": n}}
    evidence       TEXT    NOT NULL, -- {"name": evidence_seq} for the window
    active         TEXT    NOT NULL  -- [{"name", "evidence_seq"}], sorted
) WITHOUT ROWID;
INSERT INTO session_views_by_key (session_id, refresh_seq, mode, window_start, compaction_seq,
                                  summary, catalogs, evidence, active)
    SELECT session_id, refresh_seq, mode, window_start, compaction_seq,
           summary, catalogs, evidence, active FROM session_views;
DROP TABLE session_views;
ALTER TABLE session_views_by_key RENAME TO session_views;
