//! Golden tests of the vLLM / SGLang msgpack codec (`kvroute_proto::vllm`): frames captured
//! from a real vLLM server, the golden vectors of `shared/reference/kv-events-wire.md` §4.4,
//! every per-version shape (§4.3), SGLang's shape (§7), lenient and malformed cases, and a
//! fuzz test that no input panics.

use bytes::Bytes;
use kvroute_proto::vllm::{self, BlockRemoved, BlockStored, DecodeError, ExtraKey, VllmBatch, VllmEvent};
use kvroute_proto::{BlockHash, Seq};
use proptest::prelude::*;
use rmpv::Value;
use serde_json::{Value as Json, json};

// ---------------------------------------------------------------------------------------
// Helpers

fn pack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn arr(items: Vec<Value>) -> Value {
    Value::Array(items)
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn u(x: u64) -> Value {
    Value::from(x)
}

fn tokens_1_to_8() -> Value {
    arr((1..=8u64).map(u).collect())
}

fn decode_hex(payload_hex: &str) -> Result<VllmBatch, DecodeError> {
    vllm::decode_payload(&hex::decode(payload_hex).unwrap())
}

/// Renders an event the way Python's msgpack decoder shows vLLM's map form: the fields vLLM
/// always writes, plus the optional ones only when present.
fn event_to_json(e: &VllmEvent) -> Json {
    fn hashes(h: &[BlockHash]) -> Json {
        h.iter().map(|h| json!(h.0)).collect()
    }
    fn extra(k: &ExtraKey) -> Json {
        match k {
            ExtraKey::Nil | ExtraKey::Other => Json::Null,
            ExtraKey::Bool(b) => json!(b),
            ExtraKey::Int(i) => json!(i),
            ExtraKey::UInt(u) => json!(u),
            ExtraKey::Float(f) => json!(f),
            ExtraKey::Str(s) => json!(s),
            ExtraKey::Bytes(b) => json!(b),
            ExtraKey::Tuple(t) => t.iter().map(extra).collect(),
        }
    }
    fn put<T: serde::Serialize>(m: &mut serde_json::Map<String, Json>, k: &str, v: &Option<T>) {
        if let Some(v) = v {
            m.insert(k.into(), json!(v));
        }
    }
    let mut m = serde_json::Map::new();
    match e {
        VllmEvent::BlockStored(b) => {
            m.insert("type".into(), json!("BlockStored"));
            m.insert("block_hashes".into(), hashes(&b.block_hashes));
            m.insert("parent_block_hash".into(), json!(b.parent_block_hash.map(|h| h.0)));
            m.insert("token_ids".into(), json!(b.token_ids));
            m.insert("block_size".into(), json!(b.block_size));
            m.insert("lora_id".into(), json!(b.lora_id));
            m.insert("medium".into(), json!(b.medium));
            m.insert("lora_name".into(), json!(b.lora_name));
            if let Some(keys) = &b.extra_keys {
                m.insert("extra_keys".into(), keys.iter().map(extra).collect());
            }
            put(&mut m, "group_idx", &b.group_idx);
            put(&mut m, "kv_cache_spec_kind", &b.kv_cache_spec_kind);
            put(&mut m, "kv_cache_spec_sliding_window", &b.kv_cache_spec_sliding_window);
            put(&mut m, "locality", &b.locality);
            put(&mut m, "ownership", &b.ownership);
            put(&mut m, "session_id", &b.session_id);
            put(&mut m, "lookahead_token_ids", &b.lookahead_token_ids);
            put(&mut m, "cache_salt", &b.cache_salt);
            put(&mut m, "origin", &b.origin);
        }
        VllmEvent::BlockRemoved(b) => {
            m.insert("type".into(), json!("BlockRemoved"));
            m.insert("block_hashes".into(), hashes(&b.block_hashes));
            m.insert("medium".into(), json!(b.medium));
            put(&mut m, "group_idx", &b.group_idx);
            put(&mut m, "locality", &b.locality);
            put(&mut m, "ownership", &b.ownership);
        }
        VllmEvent::AllBlocksCleared => {
            m.insert("type".into(), json!("AllBlocksCleared"));
        }
        VllmEvent::Unknown(tag) => {
            m.insert("type".into(), json!(tag));
        }
        VllmEvent::Malformed(bad) => {
            m.insert("malformed".into(), json!(bad.reason));
        }
    }
    Json::Object(m)
}

// ---------------------------------------------------------------------------------------
// Frames captured from a real vLLM server

struct Captured {
    frames: Vec<Bytes>,
    topic: String,
    seq: u64,
    decoded: Json,
}

fn capture() -> Vec<Captured> {
    let text = include_str!("data/vllm-capture.jsonl");
    let lines: Vec<Captured> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let j: Json = serde_json::from_str(line).unwrap();
            let frames = j["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| Bytes::from(hex::decode(f.as_str().unwrap()).unwrap()))
                .collect();
            Captured {
                frames,
                topic: j["topic"].as_str().unwrap().to_owned(),
                seq: j["seq"].as_u64().unwrap(),
                decoded: j["decoded"].clone(),
            }
        })
        .collect();
    assert_eq!(lines.len(), 11, "the capture has 11 messages");
    lines
}

#[test]
fn decodes_every_captured_vllm_frame_like_python() {
    let mut events = 0;
    for c in capture() {
        let (topic, seq, batch) = vllm::decode_live(&c.frames).unwrap();
        assert_eq!(&topic[..], c.topic.as_bytes());
        assert_eq!(seq, Seq(c.seq));
        let want = c.decoded.as_array().unwrap();
        assert_eq!(want.len(), 3, "seq {}: vLLM batches are [ts, events, dp_rank]", c.seq);
        // serde_json may round the last bit of a float; the payload's float64 is exact.
        assert!((batch.ts - want[0].as_f64().unwrap()).abs() < 1e-6, "seq {}", c.seq);
        assert_eq!(batch.dp_rank.map(u64::from), want[2].as_u64(), "seq {}", c.seq);
        let got: Vec<Json> = batch.events.iter().map(event_to_json).collect();
        assert_eq!(&got, want[1].as_array().unwrap(), "seq {}", c.seq);
        events += got.len();
    }
    assert_eq!(events, 31);
}

/// The capture's engine wrote fixmaps for BlockStored (not msgspec's map16 of the wire doc's
/// §4.4), with smallest-width ints, exactly as rmp-serde does: re-encoding is byte-identical.
#[test]
fn reencoding_captured_batches_gives_the_engine_bytes() {
    for c in capture() {
        let batch = vllm::decode_payload(&c.frames[2]).unwrap();
        assert_eq!(vllm::encode_payload(&batch), c.frames[2], "seq {}", c.seq);
    }
}

// ---------------------------------------------------------------------------------------
// Golden vectors of kv-events-wire.md §4.4

const H1: BlockHash = BlockHash(9_561_501_211_280_363_793);
const H2: BlockHash = BlockHash(15_292_913_576_410_714_033);
const TS: f64 = 1_700_000_000.5;

const GOLDEN_A_TOPIC: &str = "6b764031302e302e302e373a38303030405177656e2f5177656e332d302e3642";
const GOLDEN_A: &str = "93cb41d954fc4020000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf84b146b151d55111cfd43b57df56b58fb1b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfd43b57df56b58fb1a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";
const GOLDEN_B: &str = "93cb41d954fc40200000939cab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1c098010203040506070804c0a3475055c092c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76656491cfd43b57df56b58fb1a34750550091b0416c6c426c6f636b73436c656172656400";
/// sha256_cbor digests of blocks [1,2,3,4] and [5,6,7,8] (wire doc §5).
const DIGEST_1: &str = "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111";
const DIGEST_2: &str = "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1";

fn golden_batch() -> VllmBatch {
    VllmBatch {
        ts: TS,
        events: vec![
            VllmEvent::BlockStored(BlockStored {
                block_hashes: vec![H1, H2],
                parent_block_hash: None,
                token_ids: (1..=8).collect(),
                block_size: 4,
                medium: Some("GPU".into()),
                extra_keys: Some(vec![ExtraKey::Nil, ExtraKey::Nil]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..Default::default()
            }),
            VllmEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![H2],
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..Default::default()
            }),
            VllmEvent::AllBlocksCleared,
        ],
        dp_rank: Some(0),
    }
}

#[test]
fn golden_a_vllm_0_33_map_events() {
    let frames = vec![
        Bytes::from(hex::decode(GOLDEN_A_TOPIC).unwrap()),
        Bytes::from_static(&[0; 8]),
        Bytes::from(hex::decode(GOLDEN_A).unwrap()),
    ];
    let (topic, seq, batch) = vllm::decode_live(&frames).unwrap();
    assert_eq!(&topic[..], b"kv@10.0.0.7:8000@Qwen/Qwen3-0.6B");
    assert_eq!(seq, Seq(0));
    assert_eq!(batch, golden_batch());
}

#[test]
fn golden_b_vllm_0_23_array_events() {
    assert_eq!(decode_hex(GOLDEN_B).unwrap(), golden_batch());
}

#[test]
fn golden_c_bin_hashes_give_the_same_ints() {
    let c = GOLDEN_A
        .replace("cf84b146b151d55111", &format!("c420{DIGEST_1}"))
        .replace("cfd43b57df56b58fb1", &format!("c420{DIGEST_2}"));
    assert_eq!(c.matches("c420").count(), 3);
    assert_eq!(decode_hex(&c).unwrap(), golden_batch());
}

#[test]
fn encoder_output_decodes_to_the_golden_batch() {
    let encoded = vllm::encode_payload(&golden_batch());
    assert_eq!(vllm::decode_payload(&encoded).unwrap(), golden_batch());
    // Same msgpack values as vLLM's bytes, header widths aside (msgspec wrote map16 there).
    let ours = rmpv::decode::read_value(&mut &encoded[..]).unwrap();
    let engine = rmpv::decode::read_value(&mut &hex::decode(GOLDEN_A).unwrap()[..]).unwrap();
    assert_eq!(ours, engine);
}

// ---------------------------------------------------------------------------------------
// Minimal shapes of each vLLM release (§4.4 d)

fn stored_minimal(medium: Option<&str>, group_idx: Option<u32>) -> VllmEvent {
    VllmEvent::BlockStored(BlockStored {
        block_hashes: vec![H1, H2],
        token_ids: (1..=8).collect(),
        block_size: 4,
        medium: medium.map(Into::into),
        group_idx,
        ..Default::default()
    })
}

fn removed_minimal(medium: Option<&str>) -> VllmEvent {
    VllmEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![H2],
        medium: medium.map(Into::into),
        ..Default::default()
    })
}

#[test]
fn every_vllm_release_shape_decodes() {
    let hashes = || arr(vec![u(H1.0), u(H2.0)]);
    let stored_prefix = || vec![s("BlockStored"), hashes(), Value::Nil, tokens_1_to_8(), u(4), Value::Nil];
    let with = |mut v: Vec<Value>, tail: Vec<Value>| {
        v.extend(tail);
        arr(v)
    };
    let cleared = || arr(vec![s("AllBlocksCleared")]);
    let removed = |tail: Vec<Value>| with(vec![s("BlockRemoved"), arr(vec![u(H2.0)])], tail);
    let gpu = || s("GPU");
    let nil = || Value::Nil;

    let want = |medium: Option<&str>, group_idx, dp_rank| VllmBatch {
        ts: TS,
        events: vec![stored_minimal(medium, group_idx), removed_minimal(medium), VllmEvent::AllBlocksCleared],
        dp_rank,
    };

    #[rustfmt::skip]
    let cases: Vec<(&str, Value, VllmBatch)> = vec![
        ("0.9.0", arr(vec![Value::F64(TS), arr(vec![with(stored_prefix(), vec![]), removed(vec![]), cleared()])]),
            want(None, None, None)),
        ("0.10.0", arr(vec![Value::F64(TS), arr(vec![with(stored_prefix(), vec![]), removed(vec![]), cleared()]), u(0)]),
            want(None, None, Some(0))),
        ("0.11.0", arr(vec![Value::F64(TS), arr(vec![with(stored_prefix(), vec![gpu()]), removed(vec![gpu()]), cleared()]), u(0)]),
            want(Some("GPU"), None, Some(0))),
        ("0.15.0", arr(vec![Value::F64(TS), arr(vec![with(stored_prefix(), vec![gpu(), nil()]), removed(vec![gpu()]), cleared()]), u(0)]),
            want(Some("GPU"), None, Some(0))),
        ("0.20.0", arr(vec![Value::F64(TS), arr(vec![with(stored_prefix(), vec![gpu(), nil(), nil(), u(0)]), removed(vec![gpu(), nil()]), cleared()]), u(0)]),
            want(Some("GPU"), Some(0), Some(0))),
        ("0.23.0", arr(vec![Value::F64(TS), arr(vec![with(stored_prefix(), vec![gpu(), nil(), nil(), u(0), nil(), nil()]), removed(vec![gpu(), nil()]), cleared()]), u(0)]),
            want(Some("GPU"), Some(0), Some(0))),
        ("0.24.0+", arr(vec![Value::F64(TS), arr(vec![
            map(vec![("type", s("BlockStored")), ("block_hashes", hashes()), ("parent_block_hash", nil()),
                     ("token_ids", tokens_1_to_8()), ("block_size", u(4)), ("lora_id", nil()),
                     ("medium", gpu()), ("lora_name", nil()), ("group_idx", u(0))]),
            map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![u(H2.0)])), ("medium", gpu())]),
            map(vec![("type", s("AllBlocksCleared"))]),
        ]), u(0)]), want(Some("GPU"), Some(0), Some(0))),
    ];
    for (version, value, want) in cases {
        assert_eq!(vllm::decode_payload(&pack(&value)).unwrap(), want, "vLLM {version}");
    }
}

// ---------------------------------------------------------------------------------------
// SGLang (§7)

/// SGLang publishes the first 16 hex chars of a SHA-256 as a signed int64.
const SGLANG_HASH: u64 = 0x84c0_483d_3001_1b13;

#[test]
fn sglang_map_events_with_negative_hashes() {
    let neg = || Value::from(SGLANG_HASH as i64);
    let value = arr(vec![
        Value::F64(TS),
        arr(vec![
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", arr(vec![neg()])),
                ("parent_block_hash", Value::from(-1i64)),
                ("token_ids", arr(vec![u(1), u(2)])),
                ("block_size", u(2)),
                ("lora_id", Value::Nil),
                ("medium", s("CPU_PINNED")),
                ("cache_salt", s("tenant-a")),
                ("session_id", s("sess")),
                ("lora_name", s("adapter")),
            ]),
            map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![neg()])), ("medium", s("GPU"))]),
            map(vec![("type", s("AllBlocksCleared"))]),
        ]),
        Value::Nil, // attn_dp_rank unset
    ]);
    let bytes = pack(&value);
    assert!(hex::encode(&bytes).contains("d384c0483d30011b13"), "the hash must be on the wire as int64");
    let want = VllmBatch {
        ts: TS,
        events: vec![
            VllmEvent::BlockStored(BlockStored {
                block_hashes: vec![BlockHash(SGLANG_HASH)],
                parent_block_hash: Some(BlockHash(u64::MAX)),
                token_ids: vec![1, 2],
                block_size: 2,
                medium: Some("CPU_PINNED".into()),
                cache_salt: Some("tenant-a".into()),
                session_id: Some("sess".into()),
                lora_name: Some("adapter".into()),
                ..Default::default()
            }),
            VllmEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash(SGLANG_HASH)],
                medium: Some("GPU".into()),
                ..Default::default()
            }),
            VllmEvent::AllBlocksCleared,
        ],
        dp_rank: None,
    };
    assert_eq!(vllm::decode_payload(&bytes).unwrap(), want);
}

#[test]
fn old_sglang_positional_events() {
    let value = arr(vec![
        Value::F64(TS),
        arr(vec![arr(vec![
            s("BlockStored"),
            arr(vec![Value::from(SGLANG_HASH as i64)]),
            Value::Nil,
            arr(vec![u(1), u(2)]),
            u(2),
            Value::from(7),
            s("GPU"),
        ])]),
        u(1),
    ]);
    let batch = vllm::decode_payload(&pack(&value)).unwrap();
    assert_eq!(batch.dp_rank, Some(1));
    let VllmEvent::BlockStored(e) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!(
        (e.block_hashes[0], e.lora_id, e.medium.as_deref()),
        (BlockHash(SGLANG_HASH), Some(7), Some("GPU"))
    );
}

// ---------------------------------------------------------------------------------------
// Leniency: unknown tags, unknown keys, extra elements, other batch shapes

#[test]
fn unknown_tags_become_unknown_events() {
    let value = arr(vec![
        Value::F64(TS),
        arr(vec![
            map(vec![("type", s("BlockUpdated")), ("block_hashes", s("not hashes")), ("x", map(vec![]))]),
            map(vec![("weird", arr(vec![map(vec![("a", u(1))])])), ("type", s("Later"))]),
            arr(vec![s("KVCacheTierChanged"), u(1), map(vec![("a", arr(vec![u(1)]))])]),
            arr(vec![s("AllBlocksCleared")]),
        ]),
        u(0),
    ]);
    let batch = vllm::decode_payload(&pack(&value)).unwrap();
    assert_eq!(
        batch.events,
        vec![
            VllmEvent::Unknown("BlockUpdated".into()),
            VllmEvent::Unknown("Later".into()),
            VllmEvent::Unknown("KVCacheTierChanged".into()),
            VllmEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn unknown_keys_and_key_order_do_not_matter() {
    let value = arr(vec![
        Value::F64(TS),
        arr(vec![
            Value::Map(vec![
                (s("token_ids"), tokens_1_to_8()),
                (u(17), s("an int key")),
                (s("future_field"), map(vec![("nested", arr(vec![Value::Nil, Value::F32(1.0)]))])),
                (s("block_hashes"), arr(vec![u(H1.0), u(H2.0)])),
                (s("block_size"), u(4)),
                (s("type"), s("BlockStored")),
                (s("kv_cache_spec_sliding_window"), u(128)),
                (s("locality"), s("REMOTE")),
                (s("ownership"), s("t1")),
                (s("lookahead_token_ids"), arr(vec![arr(vec![u(9)]), arr(vec![u(10)])])),
                (
                    s("extra_keys"),
                    arr(vec![
                        arr(vec![s("lora-a"), arr(vec![s("mm-hash"), u(3)]), Value::Binary(vec![1, 2])]),
                        Value::Nil,
                    ]),
                ),
            ]),
            map(vec![
                ("medium", s("CPU")),
                ("type", s("BlockRemoved")),
                ("token_ids", arr(vec![])), // a key that BlockRemoved does not have
                ("block_hashes", arr(vec![u(H1.0)])),
                ("locality", s("LOCAL")),
            ]),
        ]),
        u(2),
    ]);
    let batch = vllm::decode_payload(&pack(&value)).unwrap();
    let want = vec![
        VllmEvent::BlockStored(BlockStored {
            block_hashes: vec![H1, H2],
            token_ids: (1..=8).collect(),
            block_size: 4,
            kv_cache_spec_sliding_window: Some(128),
            locality: Some("REMOTE".into()),
            ownership: Some("t1".into()),
            lookahead_token_ids: Some(vec![vec![9], vec![10]]),
            extra_keys: Some(vec![
                ExtraKey::Tuple(vec![
                    ExtraKey::Str("lora-a".into()),
                    ExtraKey::Tuple(vec![ExtraKey::Str("mm-hash".into()), ExtraKey::UInt(3)]),
                    ExtraKey::Bytes(vec![1, 2]),
                ]),
                ExtraKey::Nil,
            ]),
            ..Default::default()
        }),
        VllmEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![H1],
            medium: Some("CPU".into()),
            locality: Some("LOCAL".into()),
            ..Default::default()
        }),
    ];
    assert_eq!(batch.events, want);
    assert_eq!(batch.dp_rank, Some(2));
    let VllmEvent::BlockStored(stored) = &batch.events[0] else { unreachable!() };
    assert!(stored.has_extra_keys());
}

/// Regression: a key another event has, of another type than that event's field (a removal's
/// `token_ids: nil`), made the event malformed and its batch lost, though the tag before it
/// said the key was none of the event's.
#[test]
fn another_events_field_of_another_type_is_skipped() {
    let value = arr(vec![
        Value::F64(TS),
        arr(vec![
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", arr(vec![u(H1.0)])),
                ("token_ids", Value::Nil),
                ("block_size", s("sixteen")),
                ("parent_block_hash", s("none")),
            ]),
            map(vec![("type", s("AllBlocksCleared")), ("block_hashes", s("all")), ("medium", u(1))]),
        ]),
    ]);
    let batch = vllm::decode_payload(&pack(&value)).unwrap();
    let removed = BlockRemoved { block_hashes: vec![H1], ..Default::default() };
    assert_eq!(batch.events, [VllmEvent::BlockRemoved(removed), VllmEvent::AllBlocksCleared]);
    // The event's own fields are still typed.
    let own = map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![u(H1.0)])), ("medium", u(1))]);
    let bad = vllm::decode_payload(&pack(&arr(vec![Value::F64(TS), arr(vec![own])]))).unwrap();
    let [VllmEvent::Malformed(malformed)] = &bad.events[..] else { panic!("{:?}", bad.events) };
    assert!(malformed.reason.contains("integer") || malformed.reason.contains("string"), "{malformed:?}");
}

#[test]
fn longer_arrays_are_read_by_their_known_prefix() {
    let mut stored =
        vec![s("BlockStored"), arr(vec![u(H1.0)]), u(H2.0), arr(vec![u(1)]), u(1), Value::from(-2)];
    stored.extend([s("GPU"), s("lora"), arr(vec![Value::Nil]), u(1), s("mamba"), u(64)]);
    stored.extend([s("future"), map(vec![("x", u(1))]), arr(vec![u(1)])]); // 15 elements
    let value = arr(vec![
        Value::F64(TS),
        arr(vec![
            arr(stored),
            arr(vec![s("BlockRemoved"), arr(vec![u(H1.0)]), s("GPU"), u(1), s("LOCAL"), Value::Nil]),
            arr(vec![s("AllBlocksCleared"), u(1), u(2)]),
        ]),
        u(0),
        s("extra batch element"),
        arr(vec![u(1)]),
    ]);
    let batch = vllm::decode_payload(&pack(&value)).unwrap();
    assert_eq!(
        batch,
        VllmBatch {
            ts: TS,
            events: vec![
                VllmEvent::BlockStored(BlockStored {
                    block_hashes: vec![H1],
                    parent_block_hash: Some(H2),
                    token_ids: vec![1],
                    block_size: 1,
                    lora_id: Some(-2),
                    medium: Some("GPU".into()),
                    lora_name: Some("lora".into()),
                    extra_keys: Some(vec![ExtraKey::Nil]),
                    group_idx: Some(1),
                    kv_cache_spec_kind: Some("mamba".into()),
                    kv_cache_spec_sliding_window: Some(64),
                    ..Default::default()
                }),
                VllmEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![H1],
                    medium: Some("GPU".into()),
                    group_idx: Some(1),
                    ..Default::default()
                }),
                VllmEvent::AllBlocksCleared,
            ],
            dp_rank: Some(0),
        }
    );
}

#[test]
fn hashes_of_every_width_and_form() {
    let hashes = arr(vec![
        u(0),
        u(127),
        u(255),
        u(65_535),
        u(u32::MAX.into()),
        u(u64::MAX),
        Value::from(-1i64),
        Value::from(i64::MIN),
        Value::Binary(vec![0xab; 32]),
        Value::Binary(vec![1, 2, 3]),
    ]);
    let value = arr(vec![Value::F64(TS), arr(vec![arr(vec![s("BlockRemoved"), hashes])]), Value::Nil]);
    let batch = vllm::decode_payload(&pack(&value)).unwrap();
    let VllmEvent::BlockRemoved(e) = &batch.events[0] else { panic!() };
    let got: Vec<u64> = e.block_hashes.iter().map(|h| h.0).collect();
    assert_eq!(
        got,
        [0, 127, 255, 65_535, u32::MAX.into(), u64::MAX, u64::MAX, 1 << 63, 0xabab_abab_abab_abab, 0x01_0203]
    );
}

#[test]
fn map_shaped_batch_is_accepted() {
    for rank_key in ["data_parallel_rank", "dp_rank", "attn_dp_rank"] {
        let value = map(vec![
            ("events", arr(vec![map(vec![("type", s("AllBlocksCleared"))])])),
            ("something_new", arr(vec![u(1)])),
            (rank_key, u(5)),
            ("ts", u(1_700_000_000)),
        ]);
        assert_eq!(
            vllm::decode_payload(&pack(&value)).unwrap(),
            VllmBatch { ts: 1_700_000_000.0, events: vec![VllmEvent::AllBlocksCleared], dp_rank: Some(5) }
        );
    }
}

// ---------------------------------------------------------------------------------------
// Malformed input

#[test]
fn every_truncation_of_the_golden_vectors_is_an_error() {
    for golden in [GOLDEN_A, GOLDEN_B] {
        let bytes = hex::decode(golden).unwrap();
        for len in 0..bytes.len() {
            assert!(
                matches!(vllm::decode_payload(&bytes[..len]), Err(DecodeError::Payload(_))),
                "prefix of {len} bytes"
            );
        }
    }
}

/// A batch whose own shape is wrong is an error; an event whose shape is wrong is
/// `Malformed`, and the events around it stand.
#[test]
fn wrong_shapes_and_types_fail_the_batch_or_the_event() {
    let ts = || Value::F64(TS);
    let stored = |fields: Vec<(&'static str, Value)>| {
        let mut all = vec![
            ("type", s("BlockStored")),
            ("block_hashes", arr(vec![u(1)])),
            ("token_ids", arr(vec![u(1)])),
            ("block_size", u(1)),
        ];
        all.retain(|(k, _)| !fields.iter().any(|(f, _)| f == k));
        all.extend(fields.into_iter().filter(|(_, v)| *v != Value::Boolean(false)));
        map(all)
    };
    let absent = Value::Boolean(false); // marker: drop this key
    #[rustfmt::skip]
    let batches: Vec<(&str, Value)> = vec![
        ("int batch", u(5)),
        ("string batch", s("batch")),
        ("nil batch", Value::Nil),
        ("bin batch", Value::Binary(vec![0x93, 0x00])),
        ("empty batch", arr(vec![])),
        ("ts only", arr(vec![ts()])),
        ("ts is a string", arr(vec![s("now"), arr(vec![]), u(0)])),
        ("events is an int", arr(vec![ts(), u(5), u(0)])),
        ("events is a bin", arr(vec![ts(), Value::Binary(vec![0x90]), u(0)])),
        ("dp_rank is a string", arr(vec![ts(), arr(vec![]), s("0")])),
        ("dp_rank is negative", arr(vec![ts(), arr(vec![]), Value::from(-1)])),
        ("map batch without events", map(vec![("ts", ts())])),
    ];
    for (what, value) in batches {
        assert!(matches!(vllm::decode_payload(&pack(&value)), Err(DecodeError::Payload(_))), "{what}");
    }
    #[rustfmt::skip]
    let events: Vec<(&str, Value, bool)> = vec![
        ("event is an int", u(5), false),
        ("event is nil", Value::Nil, false),
        ("event is an empty array", arr(vec![]), false),
        ("tag is an int", arr(vec![u(1), arr(vec![])]), false),
        ("array BlockStored too short", arr(vec![s("BlockStored"), arr(vec![u(1)]), Value::Nil]), true),
        ("array BlockRemoved without hashes", arr(vec![s("BlockRemoved")]), false),
        ("map BlockRemoved with a string hash", map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![s("x")]))]), false),
        ("map event without type", map(vec![("block_hashes", arr(vec![]))]), false),
        ("missing token_ids", stored(vec![("token_ids", absent.clone())]), true),
        ("missing block_hashes", stored(vec![("block_hashes", absent.clone())]), true),
        ("missing block_size", stored(vec![("block_size", absent)]), true),
        ("hashes is a string", stored(vec![("block_hashes", s("abc"))]), true),
        ("hash is a string", stored(vec![("block_hashes", arr(vec![s("abc")]))]), true),
        ("hash is a float", stored(vec![("block_hashes", arr(vec![Value::F64(1.0)]))]), true),
        ("hashes is a bin", stored(vec![("block_hashes", Value::Binary(vec![1; 8]))]), true),
        ("negative token", stored(vec![("token_ids", arr(vec![Value::from(-1)]))]), true),
        ("token beyond u32", stored(vec![("token_ids", arr(vec![u(1 << 32)]))]), true),
        ("bigram token_ids (EAGLE)", stored(vec![("token_ids", arr(vec![arr(vec![u(1), u(2)])]))]), true),
        ("block_size nil", stored(vec![("block_size", Value::Nil)]), true),
        ("medium is an int", stored(vec![("medium", u(1))]), true),
        ("extra_keys is a string", stored(vec![("extra_keys", s("x"))]), true),
    ];
    let good = stored(vec![]);
    let removed = map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![u(9)]))]);
    let good_events =
        vllm::decode_payload(&pack(&arr(vec![ts(), arr(vec![good.clone(), removed.clone()]), u(0)])))
            .expect("valid")
            .events;
    for (what, bad, store) in events {
        let payload = pack(&arr(vec![ts(), arr(vec![good.clone(), bad.clone(), removed.clone()]), u(2)]));
        let batch = vllm::decode_payload(&payload).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(batch.dp_rank, Some(2), "{what}");
        assert_eq!(batch.events.len(), 3, "{what}");
        let VllmEvent::Malformed(malformed) = &batch.events[1] else {
            panic!("{what}: {:?}", batch.events[1])
        };
        assert_eq!(malformed.is_store(), store, "{what}: {malformed:?}");
        assert_eq!([&batch.events[0], &batch.events[2]], [&good_events[0], &good_events[1]], "{what}");
        // The same events in a map-shaped batch.
        let events = arr(vec![good.clone(), bad, removed.clone()]);
        let in_map = pack(&map(vec![("dp_rank", u(2)), ("events", events), ("ts", ts())]));
        let from_map = vllm::decode_payload(&in_map).unwrap_or_else(|e| panic!("{what} (map batch): {e}"));
        assert_eq!(from_map, batch, "{what} (map batch)");
    }
    // A second `events` key would hide the first one's events: the batch is an error.
    let unreadable_removal = map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![s("x")]))]);
    let twice = map(vec![("ts", ts()), ("events", arr(vec![unreadable_removal])), ("events", arr(vec![]))]);
    assert!(matches!(vllm::decode_payload(&pack(&twice)), Err(DecodeError::Payload(_))));
    let twice_readable =
        map(vec![("ts", ts()), ("events", arr(vec![removed.clone()])), ("events", arr(vec![]))]);
    assert!(matches!(vllm::decode_payload(&pack(&twice_readable)), Err(DecodeError::Payload(_))));
    assert!(matches!(vllm::decode_payload(&[]), Err(DecodeError::Payload(_))));
    let mut trailing = hex::decode(GOLDEN_A).unwrap();
    trailing.push(0x00);
    assert!(matches!(vllm::decode_payload(&trailing), Err(DecodeError::TrailingBytes)));
    // A malformed event encodes as nil, which decodes as malformed again.
    let bad = vllm::MalformedEvent { tag: None, reason: "x".into() };
    let batch = VllmBatch { ts: TS, events: vec![VllmEvent::Malformed(bad)], dp_rank: None };
    let back = vllm::decode_payload(&vllm::encode_payload(&batch)).expect("valid batch");
    assert!(matches!(&back.events[..], [VllmEvent::Malformed(_)]));
}

// ---------------------------------------------------------------------------------------
// Fuzz: no input panics or hangs

fn valid_payloads() -> Vec<Vec<u8>> {
    let mut out = vec![hex::decode(GOLDEN_A).unwrap(), hex::decode(GOLDEN_B).unwrap()];
    out.extend(capture().into_iter().map(|c| c.frames[2].to_vec()).take(3));
    out.push(vllm::encode_payload(&golden_batch()).to_vec());
    out
}

#[derive(Clone, Debug)]
enum Mutation {
    Set(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Remove),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

/// Decodes without panicking; whatever decodes must survive an encode/decode cycle.
fn check(payload: &[u8]) {
    if let Ok(batch) = vllm::decode_payload(payload) {
        let encoded = vllm::encode_payload(&batch);
        let again = vllm::decode_payload(&encoded).expect("the encoder's output decodes");
        assert_eq!(vllm::encode_payload(&again), encoded);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        check(&bytes);
        // Also behind a valid batch/event prefix, so the random part reaches the visitors.
        check(&[&hex::decode("93cb41d954fc4020000091").unwrap()[..], &bytes].concat());
    }

    #[test]
    fn mutated_valid_payloads_never_panic(
        which in 0usize..6,
        mutations in proptest::collection::vec(mutation(), 1..8),
    ) {
        let payloads = valid_payloads();
        let mut p = payloads[which % payloads.len()].clone();
        for m in mutations {
            let len = p.len().max(1);
            match m {
                Mutation::Set(i, b) if !p.is_empty() => p[i % len] = b,
                Mutation::Insert(i, b) => p.insert(i % (p.len() + 1), b),
                Mutation::Remove(i) if !p.is_empty() => {
                    p.remove(i % len);
                }
                Mutation::Truncate(i) => p.truncate(i % len),
                _ => {}
            }
        }
        check(&p);
    }
}
