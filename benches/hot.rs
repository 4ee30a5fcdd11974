//! Criterion benches of the pure code on every append and every read
//! (issue 7): the fold of the projector, validation, the JSON round trip of
//! a payload and the hash chain. No database: these are the CPU part of an
//! append, which `session-store bench` measures end to end against its
//! raw-insert ceiling.
//!
//! The events are the bench's realistic mix (`bench::workload::Mix`:
//! prompts, assistant text, tool calls, results of a few KB, ToolSearch
//! results, compactions and mode switches).
//!
//! `cargo bench --bench hot` (criterion prints each median and its spread).

use std::hint::black_box;
use std::sync::Arc;

use chrono::Utc;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use session_store::bench::workload::{Mix, TextPool};
use session_store::integrity::{event_hash, event_hash_of, ChainChecker};
use session_store::validate::{check_event, check_shape};
use session_store::{EventBody, SessionState, StoredEvent};
use uuid::Uuid;

/// A session of `n` events of the mix, as stored.
fn session(n: usize) -> Vec<StoredEvent> {
    let session_id = Uuid::new_v4();
    let mut mix = Mix::new(Arc::new(TextPool::new()), 0, 7);
    let mut bodies = Mix::header();
    while bodies.len() < n {
        bodies.push(mix.next_body());
    }
    let now = Utc::now();
    bodies
        .into_iter()
        .enumerate()
        .map(|(i, body)| StoredEvent {
            session_id,
            seq: i as i64 + 1,
            event_id: Uuid::now_v7(),
            position: i as i64 + 1,
            recorded_at: now,
            body,
        })
        .collect()
}

fn fold(c: &mut Criterion) {
    let mut g = c.benchmark_group("fold");
    for n in [1_000usize, 10_000] {
        let events = session(n);
        let id = events[0].session_id;
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("whole session, {n} events"), |b| {
            b.iter(|| black_box(SessionState::fold(id, &events)))
        });
    }
    // One more event onto a long session: the cost an append pays.
    let events = session(10_001);
    let (last, before) = events.split_last().expect("a session has events");
    let state = SessionState::fold(last.session_id, before);
    g.throughput(Throughput::Elements(1));
    g.bench_function("apply one event after 10000", |b| {
        b.iter_batched_ref(
            || state.clone(),
            |s| s.apply(black_box(last)),
            BatchSize::LargeInput,
        )
    });
    g.bench_function("view and activation set after 10000", |b| {
        b.iter(|| black_box((state.view(), state.activation_set())))
    });
    g.finish();
}

fn validation(c: &mut Criterion) {
    let events = session(10_001);
    let (last, before) = events.split_last().expect("a session has events");
    let state = SessionState::fold(last.session_id, before);
    let mut g = c.benchmark_group("validate");
    g.bench_function("check_shape + check_event after 10000", |b| {
        b.iter(|| check_shape(black_box(&last.body)).and_then(|()| check_event(&state, &last.body)))
    });
    g.finish();
}

fn json(c: &mut Criterion) {
    // The largest event of the mix: a tool result with its output.
    let events = session(2_000);
    let body = events
        .iter()
        .map(|e| &e.body)
        .filter(|b| matches!(b, EventBody::ToolResult { .. }))
        .max_by_key(|b| b.to_json_text().len())
        .expect("the mix has tool results");
    let text = body.to_json_text();
    let mut g = c.benchmark_group("json");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function(format!("encode a {}-byte result", text.len()), |b| {
        b.iter(|| black_box(body.to_json_text()))
    });
    g.bench_function(format!("decode a {}-byte result", text.len()), |b| {
        b.iter(|| EventBody::from_json_text(black_box(&text)))
    });
    g.finish();
}

fn chain(c: &mut Criterion) {
    let events = session(1_000);
    let payloads: Vec<String> = events.iter().map(|e| e.body.to_json_text()).collect();
    let mut hashes = Vec::with_capacity(events.len());
    let mut prev = String::new();
    for (e, p) in events.iter().zip(&payloads) {
        prev = event_hash_of(e, p, &prev);
        hashes.push(prev.clone());
    }
    let bytes: usize = payloads.iter().map(String::len).sum();
    let mut g = c.benchmark_group("hash chain");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("hash 1000 events (payload text given)", |b| {
        b.iter(|| {
            let mut prev = String::new();
            for (e, p) in events.iter().zip(&payloads) {
                prev = event_hash_of(e, p, &prev);
            }
            prev
        })
    });
    g.bench_function("hash 1000 events (payload encoded)", |b| {
        b.iter(|| {
            let mut prev = String::new();
            for e in &events {
                prev = event_hash(e, &prev);
            }
            prev
        })
    });
    g.bench_function("verify a chain of 1000 events", |b| {
        b.iter(|| {
            let mut checker = ChainChecker::new();
            events
                .iter()
                .zip(&hashes)
                .all(|(e, h)| checker.check(e, Some(h)).is_none())
        })
    });
    g.finish();
}

criterion_group!(benches, fold, validation, json, chain);
criterion_main!(benches);
