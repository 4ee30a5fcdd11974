//! Embedding the store in a Rust sidecar: open, append a turn in which a
//! `ToolSearch` activates a deferred tool, and ask which deferred tools the
//! next model request must carry.
//!
//! Run with `cargo run --example embed` (uses a temporary SQLite file), or
//! pass a database URL: `cargo run --example embed -- postgres://…`.

use serde_json::json;
use session_store::{EventBody, NewEvent, Store, ToolStatus};
use uuid::Uuid;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("session-store-example-{}", Uuid::new_v4()));
    std::fs::create_dir_all(&dir)?;
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| format!("sqlite://{}", dir.join("example.db").display()));
    let store = Store::open(&url).await?;

    let session = Uuid::new_v4();
    let turn = vec![
        EventBody::SessionStarted {
            mode: "agent".into(),
            metadata: None,
        },
        EventBody::CatalogDefined {
            mode: "agent".into(),
            deferred_tools: vec!["web_fetch".into(), "notebook_edit".into()],
        },
        EventBody::PromptSubmitted {
            text: "fetch example.org".into(),
        },
        EventBody::ToolCall {
            call_id: "c1".into(),
            tool_name: "ToolSearch".into(),
            input: json!({"query": "select:web_fetch"}),
        },
        EventBody::ToolResult {
            call_id: "c1".into(),
            tool_name: "ToolSearch".into(),
            status: ToolStatus::Success,
            output: Some(json!({"matches": ["web_fetch"]})),
            added_tool_names: Some(vec!["web_fetch".into()]),
        },
    ];
    // Writer-chosen event ids make a retry after a lost reply safe.
    let events = turn
        .into_iter()
        .map(|body| NewEvent::new(body).with_id(Uuid::now_v7()))
        .collect();
    let outcome = store.append(session, 0, events).await?;
    println!("appended seqs 1..={}", outcome.events.len());

    let next = store.activations(session, None).await?;
    for tool in &next.tools {
        println!(
            "send the schema of {} (evidence at seq {})",
            tool.name, tool.evidence_seq
        );
    }
    store.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
