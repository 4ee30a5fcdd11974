//! The store `import` and `append` write to, opened at their first write.
//!
//! Both commands create the store where a SQLite path has no file yet. A
//! write refused for its input stores nothing, but opening had already
//! made the file: a mistyped path then held a new empty store, and every
//! later command at that path answered "session not found" instead of
//! "there is no session store here". So, while the file does not exist,
//! what may be refused is first judged on a throw-away store in a
//! temporary directory (a store that does not exist and an empty one judge
//! every input alike: each session is at seq 0, no event id is taken), and
//! the file is made only for a write that will store something. A refusal
//! so judged holds at the moment the file was seen missing, as one judged
//! by the store itself would at its own read. Where no temporary store can
//! be made (an unwritable temporary directory), the store is opened as
//! before. PostgreSQL databases exist before the store, so they are opened
//! at once.

use tracing::debug;
use uuid::Uuid;

use crate::error::{Error, ValidationError};
use crate::event::NewEvent;
use crate::store::{AppendOutcome, RetryPolicy, Store, StoreOptions};

/// Where a command's writes go; see the module's documentation.
pub(crate) struct WriteTarget<'a> {
    store: Target<'a>,
    /// The throw-away store refusals are judged on while the file does not
    /// exist (made at the first need), and its directory, removed when
    /// dropped (after the store is closed).
    scratch: Option<(Store, tempfile::TempDir)>,
    /// No throw-away store could be made: the store itself judges.
    no_scratch: bool,
    /// The tenant the writes are for (`--tenant`): sessions they create
    /// are claimed for it, and others' are refused. `None`: the operator's
    /// writes, neither checked nor claimed (the tenant `default`'s).
    tenant: Option<String>,
}

enum Target<'a> {
    Borrowed(&'a Store),
    Owned(Box<Store>),
    /// Not opened yet: its SQLite file did not exist.
    Later {
        url: String,
        options: StoreOptions,
    },
}

/// Where an append goes in its session.
#[derive(Clone, Copy)]
enum At<'r> {
    /// At an expected seq ([`Store::append_as`]).
    Expected(i64),
    /// At the head, whatever it is, retried on unavailable storage
    /// ([`Store::append_at_head_as`]).
    Head(&'r RetryPolicy),
}

impl At<'_> {
    async fn append(
        self,
        store: &Store,
        tenant: Option<&str>,
        session: Uuid,
        events: Vec<NewEvent>,
    ) -> Result<AppendOutcome, Error> {
        match self {
            At::Expected(seq) => store.append_as(tenant, session, seq, events).await,
            At::Head(retry) => {
                store
                    .append_at_head_as(tenant, session, events, retry)
                    .await
            }
        }
    }
}

/// Whether `e` refuses the input (nothing was or would be written), as
/// opposed to saying that the storage failed.
fn refuses(e: &Error) -> bool {
    matches!(
        e,
        Error::Invalid(_) | Error::Conflict { .. } | Error::SessionNotFound(_)
    )
}

impl<'a> WriteTarget<'a> {
    /// Writes to a store already open.
    pub(crate) fn of(store: &'a Store) -> WriteTarget<'a> {
        WriteTarget {
            store: Target::Borrowed(store),
            scratch: None,
            no_scratch: false,
            tenant: None,
        }
    }

    /// Closes `store` with the target (the commands that only read).
    pub(crate) fn owning(store: Store) -> WriteTarget<'a> {
        WriteTarget {
            store: Target::Owned(Box::new(store)),
            scratch: None,
            no_scratch: false,
            tenant: None,
        }
    }

    /// The store at `url`: opened now, unless it is a SQLite file that does
    /// not exist yet (opened, and made, at the first write).
    pub(crate) async fn open(url: &str, options: StoreOptions) -> Result<WriteTarget<'a>, Error> {
        let store = match options.create_if_missing && Store::would_create_file(url)? {
            true => Target::Later {
                url: url.to_owned(),
                options,
            },
            false => Target::Owned(Box::new(Store::open_with(url, options).await?)),
        };
        Ok(WriteTarget {
            store,
            scratch: None,
            no_scratch: false,
            tenant: None,
        })
    }

    /// The writes are for `tenant` (see the field).
    pub(crate) fn for_tenant(mut self, tenant: Option<String>) -> WriteTarget<'a> {
        self.tenant = tenant;
        self
    }

    /// The tenant the writes are for.
    pub(crate) fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// `e`, with a session another tenant owns said as such (the store
    /// answers it as not found, for the HTTP API).
    pub(crate) fn said(&self, e: Error) -> Error {
        match (e, &self.tenant) {
            (Error::SessionNotFound(session_id), Some(tenant)) => Error::OtherTenant {
                session_id,
                tenant: tenant.clone(),
            },
            (e, _) => e,
        }
    }

    /// The store, opened (its file made) now if it was not.
    pub(crate) async fn store(&mut self) -> Result<&Store, Error> {
        if let Target::Later { url, options } = &self.store {
            debug!("making the store's file for a write");
            self.store = Target::Owned(Box::new(Store::open_with(url, options.clone()).await?));
            // Judged by the store from now on: the throw-away one goes at
            // once (a command killed later would leave it in TMPDIR).
            if let Some((scratch, dir)) = self.scratch.take() {
                scratch.close().await;
                drop(dir);
            }
        }
        match &self.store {
            Target::Borrowed(store) => Ok(store),
            Target::Owned(store) => Ok(store),
            Target::Later { .. } => Err(Error::Unavailable("the store was not opened".into())),
        }
    }

    /// The throw-away store to judge on, while the store is not opened;
    /// `None` once it is (or when none can be made).
    async fn scratch(&mut self) -> Option<&Store> {
        let Target::Later { options, .. } = &self.store else {
            return None;
        };
        if self.scratch.is_none() && !self.no_scratch {
            match scratch_store(options).await {
                Ok(made) => self.scratch = Some(made),
                Err(e) => {
                    debug!(error = %e, "no throw-away store to judge on; the store judges");
                    self.no_scratch = true;
                }
            }
        }
        self.scratch.as_ref().map(|(store, _)| store)
    }

    /// Where a judgement made before anything is written reads the store:
    /// the throw-away store while the store is not opened (each holds
    /// nothing), else the store (opened now if it was not).
    pub(crate) async fn reader(&mut self) -> Result<&Store, Error> {
        if self.scratch().await.is_none() {
            return self.store().await;
        }
        match &self.scratch {
            Some((scratch, _)) => Ok(scratch),
            None => Err(Error::Unavailable("no store to read".into())),
        }
    }

    /// [`Store::append`], the batch judged first where the store is not
    /// opened yet: refused there, it is refused without making the file.
    pub(crate) async fn append(
        &mut self,
        session: Uuid,
        expected_seq: i64,
        events: Vec<NewEvent>,
    ) -> Result<AppendOutcome, Error> {
        self.write(session, events, At::Expected(expected_seq))
            .await
    }

    /// [`Store::append_at_head`], judged first as [`WriteTarget::append`].
    pub(crate) async fn append_at_head(
        &mut self,
        session: Uuid,
        events: Vec<NewEvent>,
        retry: &RetryPolicy,
    ) -> Result<AppendOutcome, Error> {
        self.write(session, events, At::Head(retry)).await
    }

    /// The two appends: judged on the throw-away store first while the
    /// store is not opened, then written to the store.
    async fn write(
        &mut self,
        session: Uuid,
        events: Vec<NewEvent>,
        at: At<'_>,
    ) -> Result<AppendOutcome, Error> {
        let tenant = self.tenant.clone();
        let tenant = tenant.as_deref();
        if let Some(scratch) = self.scratch().await {
            match at.append(scratch, tenant, session, events.clone()).await {
                Err(e) if refuses(&e) => return Err(self.said(e)),
                _ => {}
            }
        }
        let store = self.store().await?;
        let appended = at.append(store, tenant, session, events).await;
        appended.map_err(|e| self.said(e))
    }

    /// Judges an empty batch at `expected_seq` (whether the session is
    /// there), which writes nothing: on the throw-away store while the
    /// store is not opened.
    pub(crate) async fn check_expected(
        &mut self,
        session: Uuid,
        expected_seq: i64,
    ) -> Result<(), Error> {
        let tenant = self.tenant.clone();
        let tenant = tenant.as_deref();
        if let Some(scratch) = self.scratch().await {
            match scratch
                .append_as(tenant, session, expected_seq, Vec::new())
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if refuses(&e) => return Err(self.said(e)),
                Err(_) => {}
            }
        }
        let checked = self
            .store()
            .await?
            .append_as(tenant, session, expected_seq, Vec::new())
            .await;
        checked.map(|_| ()).map_err(|e| self.said(e))
    }

    /// [`Store::refuse_batch`] (which writes nothing): on the throw-away
    /// store while the store is not opened.
    pub(crate) async fn refuse_batch(
        &mut self,
        session: Uuid,
        expected_seq: i64,
        events: Vec<NewEvent>,
        error: ValidationError,
    ) -> Error {
        let tenant = self.tenant.clone();
        let tenant = tenant.as_deref();
        if let Some(scratch) = self.scratch().await {
            let refused = scratch
                .refuse_batch(tenant, session, expected_seq, events.clone(), error.clone())
                .await;
            if refuses(&refused) {
                return self.said(refused);
            }
        }
        let refused = match self.store().await {
            Ok(store) => {
                store
                    .refuse_batch(tenant, session, expected_seq, events, error)
                    .await
            }
            Err(e) => e,
        };
        self.said(refused)
    }

    /// What opening the store did to its schema, once it is open (not the
    /// throw-away judging store's).
    pub(crate) fn schema_change(&self) -> Option<crate::store::SchemaChange> {
        match &self.store {
            Target::Owned(store) => Some(store.schema_change()),
            Target::Borrowed(store) => Some(store.schema_change()),
            _ => None,
        }
    }

    /// Closes what this target opened, each within `bound` (see `run`).
    pub(crate) async fn close(self, bound: std::time::Duration) {
        let scratch = self.scratch.map(|(store, dir)| (store, Some(dir)));
        let owned = match self.store {
            Target::Owned(store) => Some((*store, None)),
            _ => None,
        };
        for (store, dir) in owned.into_iter().chain(scratch) {
            if tokio::time::timeout(bound, store.close()).await.is_err() {
                debug!("the store did not close within its timeout; exiting without waiting");
            }
            drop(dir);
        }
    }
}

/// A new store in a new temporary directory, with `options`' limits.
async fn scratch_store(options: &StoreOptions) -> Result<(Store, tempfile::TempDir), Error> {
    let dir = tempfile::Builder::new()
        .prefix("session-store-judge-")
        .tempdir()
        .map_err(|e| Error::Unavailable(format!("cannot make a temporary directory: {e}")))?;
    let path = dir.path().join("judge.db");
    let path = path
        .to_str()
        .ok_or_else(|| Error::Unavailable("the temporary directory's path is not UTF-8".into()))?;
    let options = StoreOptions {
        create_if_missing: true,
        fault_pause_before_commit: None,
        fault_pause_after_commit: None,
        fault_pause_in_long_read: None,
        fault_lose_replies: None,
        ..options.clone()
    };
    let store = Store::open_with(path, options).await?;
    Ok((store, dir))
}
