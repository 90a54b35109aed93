//! The fuzz targets of `proto/fuzz` on stable Rust, in every `cargo test`: each target runs
//! over its committed seed corpus (`proto/fuzz/corpus/<target>/`) and over a few thousand
//! proptest inputs (random bytes and mutated seeds). The long runs are libFuzzer's job (see
//! `proto/fuzz/README.md`); this keeps the targets compiling and their checks passing, and
//! holds the regression tests of what the fuzzers found.
//!
//! `cargo test -p kvroute-proto --features openai --test fuzz_smoke -- --ignored
//! write_seed_corpus` regenerates the seeds from the encoders.
#![cfg(feature = "openai")]

#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use bytes::Bytes;
use kvroute_proto::pb::{AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch, event};
use kvroute_proto::vllm::{self, VllmBatch, VllmEvent};
use kvroute_proto::{BlockHash, Seq, framing, native};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 4] = [
    ("native_decode", targets::native_decode),
    ("vllm_decode", targets::vllm_decode),
    ("framing", targets::framing),
    ("openai_request", targets::openai_request),
];

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target)
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .collect();
    files.sort();
    files.iter().map(|f| std::fs::read(f).expect("seed file")).collect()
}

/// Every target's seeds, in [`TARGETS`] order.
static SEEDS: LazyLock<Vec<Vec<Vec<u8>>>> =
    LazyLock::new(|| TARGETS.iter().map(|(name, _)| seeds(name)).collect());

#[test]
fn every_target_passes_its_seed_corpus() {
    for (i, (name, target)) in TARGETS.iter().enumerate() {
        let seeds = &SEEDS[i];
        assert!(seeds.len() >= 3, "{name} has too few seeds");
        for seed in seeds {
            target(seed);
        }
    }
}

/// A seed with a few random edits: byte flips, truncation, a duplicated span.
fn mutated(seed: &[u8], edits: &[(u16, u8, u8)]) -> Vec<u8> {
    let mut out = seed.to_vec();
    for &(at, value, kind) in edits {
        if out.is_empty() {
            out.push(value);
            continue;
        }
        let i = usize::from(at) % out.len();
        match kind % 4 {
            0 => out[i] = value,
            1 => out[i] ^= 1 << (value % 8),
            2 => out.truncate(i),
            _ => {
                let span: Vec<u8> = out[i..].iter().take(usize::from(value)).copied().collect();
                out.splice(i..i, span);
            }
        }
    }
    out
}

/// Fixed seed: the same inputs on every run (the fuzzers explore; this guards).
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 1500,
        rng_seed: RngSeed::Fixed(0x0066_757a_7a65_7273),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn targets_survive_random_bytes(data in prop::collection::vec(any::<u8>(), 0..600)) {
        for (_, target) in TARGETS {
            target(&data);
        }
    }

    #[test]
    fn targets_survive_mutated_seeds(
        which in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<u16>(), any::<u8>(), any::<u8>()), 1..6),
    ) {
        for (i, (_, target)) in TARGETS.iter().enumerate() {
            target(&mutated(which.get::<Vec<u8>>(&SEEDS[i]), &edits));
        }
    }
}

// ---------------------------------------------------------------------------------------
// The seed corpus

fn native_batches() -> Vec<EventBatch> {
    let stored = |hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>| Event {
        kind: Some(event::Kind::Stored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens,
            ..Default::default()
        })),
    };
    let batch = |seq: u64, events: Vec<Event>| EventBatch {
        replica: "agent-0".into(),
        epoch: 0xdead_beef,
        seq,
        ts_unix_nanos: 1_700_000_000_000_000_000,
        block_size: 2,
        dp_rank: 0,
        events,
    };
    vec![
        batch(0, vec![]),
        batch(0, vec![stored(vec![1, 2], None, vec![1, 2, 3, 4])]),
        batch(
            7,
            vec![
                stored(vec![3], Some(2), vec![5, 6]),
                Event {
                    kind: Some(event::Kind::Removed(BlockRemoved { block_hashes: vec![2, 3], medium: None })),
                },
                Event { kind: Some(event::Kind::Cleared(AllBlocksCleared {})) },
            ],
        ),
    ]
}

fn vllm_batches() -> Vec<VllmBatch> {
    let stored = vllm::BlockStored {
        block_hashes: vec![BlockHash(11), BlockHash(12)],
        parent_block_hash: Some(BlockHash(10)),
        token_ids: (1..=32).collect(),
        block_size: 16,
        lora_name: Some("adapter-a".into()),
        medium: Some("GPU".into()),
        extra_keys: Some(vec![vllm::ExtraKey::Nil, vllm::ExtraKey::Str("salt".into())]),
        ..Default::default()
    };
    let removed = vllm::BlockRemoved { block_hashes: vec![BlockHash(11)], ..Default::default() };
    vec![
        VllmBatch { ts: 1.5, events: vec![], dp_rank: None },
        VllmBatch { ts: 1_700_000_000.25, events: vec![VllmEvent::BlockStored(stored)], dp_rank: Some(0) },
        VllmBatch {
            ts: 2.0,
            events: vec![VllmEvent::BlockRemoved(removed), VllmEvent::AllBlocksCleared],
            dp_rank: Some(1),
        },
    ]
}

/// Frames captured from a real vLLM server (`tests/data/vllm-capture.jsonl`).
fn captured_frames() -> Vec<Vec<Bytes>> {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm-capture.jsonl"))
            .expect("capture file");
    text.lines()
        .take(4)
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("jsonl");
            v["frames_hex"]
                .as_array()
                .expect("frames_hex")
                .iter()
                .map(|h| Bytes::from(hex::decode(h.as_str().expect("hex string")).expect("hex")))
                .collect()
        })
        .collect()
}

const OPENAI_SEEDS: [&str; 12] = [
    r#"{"model":"kvroute-sim","prompt":"Hello world, this is a prompt.","max_tokens":16}"#,
    r#"{"model":"kvroute-sim","prompt":["one prompt","and <|im_start|> another"],"stream":true}"#,
    r#"{"model":"kvroute-sim","prompt":[17,18,19,20,21,22,23,24],"cache_salt":"tenant-a"}"#,
    r#"{"model":"adapter-a","prompt":[[17,18,19,20],[21,22,23,24,25]]}"#,
    r#"{"model":"kvroute-sim","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi there"}]}"#,
    r#"{"model":"kvroute-sim","messages":[{"role":"user","content":[{"type":"text","text":"part one"},{"type":"text","text":" part two"}]}],"stream":true,"stream_options":{"include_usage":true}}"#,
    r#"{"model":"kvroute-sim","messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"q2"}],"add_generation_prompt":true,"max_completion_tokens":8}"#,
    r#"{"model":"kvroute-sim","prompt":"\u00e9t\u00e9 \ud83d\ude00 emoji","max_tokens":null}"#,
    r#"{"model":"kvroute-sim","prompt":""}"#,
    r#"{"prompt":"no model"}"#,
    r#"{"model":"kvroute-sim","max_tokens":4,"system":[{"type":"text","text":"Be brief."}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"r"}]}]},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{"a":1}}]}],"tools":[{"name":"f","input_schema":{}}]}"#,
    r#"{"max_tokens":1,"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"},{"role":"system","content":"late"}],"thinking":{"type":"disabled"}}"#,
];

/// Writes `proto/fuzz/corpus/<target>/seed-NN` from the encoders (run by hand, see top).
#[test]
#[ignore = "writes files; run by hand to regenerate the seed corpus"]
fn write_seed_corpus() {
    let topic = Bytes::from_static(b"kv-events");
    let mut native_seeds: Vec<Vec<u8>> = Vec::new();
    for b in native_batches() {
        native_seeds.push(targets::join(&native::encode(topic.clone(), &b)));
        if b.seq == 0 {
            native_seeds.push(native::encode_payload(&b).to_vec());
        }
    }
    let mut vllm_seeds: Vec<Vec<u8>> = Vec::new();
    for (i, b) in vllm_batches().iter().enumerate() {
        vllm_seeds.push(vllm::encode_payload(b).to_vec());
        vllm_seeds.push(targets::join(&vllm::encode_live(topic.clone(), Seq(i as u64), b)));
    }
    for frames in captured_frames() {
        vllm_seeds.push(frames[2].to_vec());
        vllm_seeds.push(targets::join(&frames));
    }
    let payload = Bytes::from_static(b"payload");
    let framing_seeds: Vec<Vec<u8>> = [
        framing::encode_live(topic.clone(), Seq(3), payload.clone()),
        framing::encode_replay_request(Seq(42)),
        framing::encode_replay_batch(topic.clone(), Seq(5), payload.clone()),
        framing::encode_replay_end(),
        vec![Bytes::new(), Bytes::copy_from_slice(&5u64.to_be_bytes()), payload],
        vec![Bytes::new(), Bytes::copy_from_slice(&u64::MAX.to_be_bytes()), Bytes::new()],
    ]
    .iter()
    .map(|f| targets::join(f))
    .collect();
    let openai_seeds: Vec<Vec<u8>> = OPENAI_SEEDS.iter().map(|s| s.as_bytes().to_vec()).collect();
    for (name, seeds) in [
        ("native_decode", native_seeds),
        ("vllm_decode", vllm_seeds),
        ("framing", framing_seeds),
        ("openai_request", openai_seeds),
    ] {
        let dir = corpus_dir(name);
        std::fs::create_dir_all(&dir).expect("corpus dir");
        for (i, seed) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}")), seed).expect("write seed");
        }
    }
}
