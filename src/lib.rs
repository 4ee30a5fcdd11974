//! session-store: an event-sourced session store for AI agent sidecars.
//!
//! Transcript rows, tool results, compactions and mode switches are appended
//! to a per-session log ([`Store`], SQLite or PostgreSQL). A pure projector
//! ([`SessionState`]) folds the log into the *effective context* (what the
//! model sees after compaction) and the *deferred activation set* (which
//! deferred tools the next request must carry). Because the activation set
//! is a pure function of the durable log, a new prompt, a mode switch, a
//! restart or another instance can never show the model evidence of a tool
//! whose schema the next request leaves out.
//!
//! Layout: [`event`] (types, parsed once at the boundary), [`validate`] (the
//! rules, pure), [`projector`] (the fold, pure), [`store`] (both backends,
//! one API), `cli` (the binary's commands, with the `cli` feature),
//! [`audit`] (explain and refresh history), [`pi`] (pi coding agent session
//! files read into events, pure), `bench` (`session-store bench`, with the
//! `bench` feature), [`pgtemp`] (throw-away PostgreSQL servers for tests
//! and the bench).

// Every public type can be printed with `{:?}` (an embedder logs what it
// holds; Rust API guidelines C-DEBUG). Clippy runs with -D warnings.
#![warn(missing_debug_implementations)]

pub mod audit;
#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "cli")]
pub mod cli;
pub mod error;
pub mod event;
pub mod integrity;
pub mod pgtemp;
pub mod pi;
pub mod projector;
#[cfg(feature = "server")]
pub mod server;
pub mod store;
pub mod validate;

#[cfg(test)]
mod testkit;

pub use error::{Error, Result, Rule, ValidationError};
pub use event::{EventBody, NewEvent, StoredEvent, ToolStatus};
pub use projector::{Activation, Activations, Context, ContextRow, SessionState, View};
pub use store::{
    AppendOutcome, AppendPaths, Appended, BackendKind, CacheUsage, ChangeRow, Recovery,
    RetryPolicy, SchemaChange, Store, StoreOptions, Subscription, DEFAULT_STATE_CACHE_BYTES,
    DEFAULT_TENANT,
};
