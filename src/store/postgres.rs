//! The PostgreSQL backend: one store shared by many sidecar instances.
//!
//! Global order: every append first locks the one-row `event_position`
//! counter (`SELECT … FOR UPDATE`), then takes its positions from it and
//! commits. Appends are therefore serialized store-wide, and positions become
//! visible in the order they were handed out, so a reader paging by position
//! never skips an event that commits later with a lower position. The cost
//! is one commit at a time; docs/design.md weighs it against `xid8`.
//!
//! Session settings keep one stuck client from stalling everyone behind the
//! counter lock: `statement_timeout`, `lock_timeout` and
//! `idle_in_transaction_session_timeout` (values in docs/design.md).

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use super::{LogTx, PendingRow, StoreOptions};
use crate::error::{Error, Result};
use crate::event::{EventBody, StoredEvent};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

type Row = (i64, Uuid, i64, Uuid, String, DateTime<Utc>);

const COLUMNS: &str = "position, session_id, seq, event_id, payload, recorded_at";

/// Server-side limits set on every connection (see the module docs).
const SESSION_SETTINGS: [(&str, &str); 3] = [
    ("statement_timeout", "30s"),
    ("lock_timeout", "10s"),
    ("idle_in_transaction_session_timeout", "30s"),
];

pub(crate) struct PgBackend {
    pool: PgPool,
}

fn decode(row: Row) -> Result<StoredEvent> {
    let (position, session_id, seq, event_id, payload, recorded_at) = row;
    Ok(StoredEvent {
        session_id,
        seq,
        event_id,
        position,
        recorded_at,
        body: EventBody::from_json_text(&payload)
            .map_err(|e| Error::Corrupt(format!("event at position {position}: {e}")))?,
    })
}

impl PgBackend {
    pub(crate) async fn connect(url: &str, options: &StoreOptions) -> Result<PgBackend> {
        let connect = PgConnectOptions::from_str(url)
            .map_err(|_| Error::BadUrl(url.to_owned()))?
            .options(SESSION_SETTINGS);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(options.connect_timeout_secs.max(1)))
            .connect_with(connect)
            .await
            .map_err(|e| match Error::from_sqlx(e) {
                Error::Unavailable(m) | Error::Database(m) => {
                    Error::Unavailable(format!("cannot connect to PostgreSQL: {m}"))
                }
                other => other,
            })?;
        Ok(PgBackend { pool })
    }

    pub(crate) async fn migrate(&self) -> Result<()> {
        MIGRATOR
            .run(&self.pool)
            .await
            .map_err(|e| Error::Database(format!("migrating the PostgreSQL database failed: {e}")))
    }

    pub(crate) async fn begin_write(&self) -> Result<PgTx> {
        let mut tx = self.pool.begin().await.map_err(Error::from_sqlx)?;
        let (last,): (i64,) =
            sqlx::query_as("SELECT last FROM event_position WHERE id = 1 FOR UPDATE")
                .fetch_one(&mut *tx)
                .await
                .map_err(Error::from_sqlx)?;
        Ok(PgTx { tx, last })
    }

    pub(crate) async fn head_seq(&self, session_id: Uuid) -> Result<i64> {
        head_seq(&self.pool, session_id).await
    }

    pub(crate) async fn page(
        &self,
        session_id: Uuid,
        after: i64,
        limit: i64,
    ) -> Result<Vec<StoredEvent>> {
        let rows: Vec<Row> = sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM events WHERE session_id = $1 AND seq > $2 ORDER BY seq LIMIT $3"
        ))
        .bind(session_id)
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(Error::from_sqlx)?;
        rows.into_iter().map(decode).collect()
    }

    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }
}

async fn head_seq<'e, E: sqlx::PgExecutor<'e>>(ex: E, session_id: Uuid) -> Result<i64> {
    let (seq,): (i64,) =
        sqlx::query_as("SELECT COALESCE(MAX(seq), 0)::BIGINT FROM events WHERE session_id = $1")
            .bind(session_id)
            .fetch_one(ex)
            .await
            .map_err(Error::from_sqlx)?;
    Ok(seq)
}

/// A write transaction holding the position counter's row lock.
pub(crate) struct PgTx {
    tx: Transaction<'static, Postgres>,
    /// The counter's value when the lock was taken.
    last: i64,
}

impl LogTx for PgTx {
    async fn head_seq(&mut self, session_id: Uuid) -> Result<i64> {
        head_seq(&mut *self.tx, session_id).await
    }

    async fn stored_by_ids(&mut self, ids: &[Uuid]) -> Result<Vec<StoredEvent>> {
        let rows: Vec<Row> = sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM events WHERE event_id = ANY($1)"
        ))
        .bind(ids)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(Error::from_sqlx)?;
        rows.into_iter().map(decode).collect()
    }

    async fn range(&mut self, session_id: Uuid, after: i64, upto: i64) -> Result<Vec<StoredEvent>> {
        let rows: Vec<Row> = sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM events WHERE session_id = $1 AND seq > $2 AND seq <= $3 ORDER BY seq"
        ))
        .bind(session_id)
        .bind(after)
        .bind(upto)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(Error::from_sqlx)?;
        rows.into_iter().map(decode).collect()
    }

    async fn reserve_positions(&mut self, n: i64) -> Result<i64> {
        sqlx::query("UPDATE event_position SET last = last + $1 WHERE id = 1")
            .bind(n)
            .execute(&mut *self.tx)
            .await
            .map_err(Error::from_sqlx)?;
        let first = self.last + 1;
        self.last += n;
        Ok(first)
    }

    async fn insert(&mut self, rows: &[PendingRow]) -> Result<()> {
        let positions: Vec<i64> = rows.iter().map(|r| r.position).collect();
        let sessions: Vec<Uuid> = rows.iter().map(|r| r.session_id).collect();
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        let ids: Vec<Uuid> = rows.iter().map(|r| r.event_id).collect();
        let types: Vec<&str> = rows.iter().map(|r| r.type_name).collect();
        let payloads: Vec<&str> = rows.iter().map(|r| r.payload.as_str()).collect();
        let times: Vec<DateTime<Utc>> = rows.iter().map(|r| r.recorded_at).collect();
        sqlx::query(
            "INSERT INTO events (position, session_id, seq, event_id, type, payload, recorded_at) \
             SELECT * FROM UNNEST($1::BIGINT[], $2::UUID[], $3::BIGINT[], $4::UUID[], $5::TEXT[], $6::TEXT[], $7::TIMESTAMPTZ[])",
        )
        .bind(positions)
        .bind(sessions)
        .bind(seqs)
        .bind(ids)
        .bind(types)
        .bind(payloads)
        .bind(times)
        .execute(&mut *self.tx)
        .await
        .map_err(Error::from_sqlx)?;
        Ok(())
    }

    async fn commit(self) -> Result<()> {
        self.tx.commit().await.map_err(Error::from_sqlx)
    }
}
