//! Unit tests of the codec's edges; the engine-captured and golden vectors live in
//! `proto/tests/vllm_golden.rs`.

use super::*;

fn full_stored() -> BlockStored {
    BlockStored {
        block_hashes: vec![BlockHash(u64::MAX), BlockHash(0), BlockHash(1 << 63)],
        parent_block_hash: Some(BlockHash(42)),
        token_ids: vec![0, 1, 127, 128, 65_535, 65_536, u32::MAX],
        block_size: 16,
        lora_id: Some(-3),
        medium: Some("CPU".into()),
        lora_name: Some("adapter".into()),
        extra_keys: Some(vec![
            ExtraKey::Nil,
            ExtraKey::Tuple(vec![
                ExtraKey::Str("lora".into()),
                ExtraKey::Tuple(vec![ExtraKey::Str("mm-1".into()), ExtraKey::UInt(7)]),
                ExtraKey::Bytes(vec![1, 2, 3]),
                ExtraKey::Int(-5),
                ExtraKey::Float(0.5),
                ExtraKey::Bool(true),
            ]),
        ]),
        group_idx: Some(1),
        kv_cache_spec_kind: Some("sliding_window".into()),
        kv_cache_spec_sliding_window: Some(4096),
        locality: Some("REMOTE".into()),
        ownership: Some("tier-2".into()),
        session_id: Some("s-1".into()),
        lookahead_token_ids: Some(vec![vec![9, 10], vec![]]),
        cache_salt: Some("tenant-a".into()),
        origin: Some("REUSED".into()),
    }
}

#[test]
fn every_field_round_trips() {
    let batch = VllmBatch {
        ts: 1_700_000_000.25,
        events: vec![
            VllmEvent::BlockStored(full_stored()),
            VllmEvent::BlockStored(BlockStored { block_hashes: vec![BlockHash(5)], ..Default::default() }),
            VllmEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash(7)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
                locality: Some("LOCAL".into()),
                ownership: Some("o".into()),
            }),
            VllmEvent::BlockRemoved(BlockRemoved::default()),
            VllmEvent::AllBlocksCleared,
            VllmEvent::Unknown("BlockUpdated".into()),
        ],
        dp_rank: Some(3),
    };
    assert_eq!(decode_payload(&encode_payload(&batch)).unwrap(), batch);
    let no_rank = VllmBatch { dp_rank: None, ..batch };
    assert_eq!(decode_payload(&encode_payload(&no_rank)).unwrap(), no_rank);
}

#[test]
fn live_round_trips() {
    let batch = VllmBatch { ts: 1.0, events: vec![VllmEvent::AllBlocksCleared], dp_rank: Some(0) };
    let frames = encode_live(Bytes::from_static(b"kv@a@m"), Seq(9), &batch);
    let (topic, seq, back) = decode_live(&frames).unwrap();
    assert_eq!((&topic[..], seq, back), (&b"kv@a@m"[..], Seq(9), batch));
    assert!(matches!(decode_live(&frames[..2]), Err(DecodeError::Frame(FrameError::FrameCount { .. }))));
}

#[test]
fn has_extra_keys_ignores_nil_entries() {
    let mut e = full_stored();
    assert!(e.has_extra_keys());
    e.extra_keys = Some(vec![ExtraKey::Nil, ExtraKey::Nil]);
    assert!(!e.has_extra_keys());
    e.extra_keys = None;
    assert!(!e.has_extra_keys());
}

#[test]
fn digest_hash_keeps_low_64_bits_big_endian() {
    let mut digest = [0u8; 32];
    digest[24..].copy_from_slice(&0x84b1_46b1_51d5_5111u64.to_be_bytes());
    digest[0] = 0xff;
    assert_eq!(block_hash_from_digest(&digest), BlockHash(0x84b1_46b1_51d5_5111));
    assert_eq!(block_hash_from_digest(&digest[16..]), BlockHash(0x84b1_46b1_51d5_5111));
    assert_eq!(block_hash_from_digest(&[0x01, 0x02]), BlockHash(0x0102));
    assert_eq!(block_hash_from_digest(&[]), BlockHash(0));
}

/// `[ts, [<event header with a huge declared length and no content>]]`: must fail on the
/// missing data without reserving memory for the declared length first.
#[test]
fn huge_declared_lengths_fail_without_allocating() {
    let prefix = [0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
    let cases: [&[u8]; 6] = [
        &[0xdd, 0xff, 0xff, 0xff, 0xff],       // events: array32
        &[0x91, 0xdd, 0xff, 0xff, 0xff, 0xff], // event: array32
        &[0x91, 0xdf, 0xff, 0xff, 0xff, 0xff], // event: map32
        &[
            0x91, 0x92, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e', b'd', 0xdd, 0xff,
            0xff, 0xff, 0xff,
        ], // hashes
        &[0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff], // tag: str32
        &[0x91, 0x91, 0xc6, 0xff, 0xff, 0xff, 0xff], // tag: bin32
    ];
    for case in cases {
        let payload = [&prefix[..], case].concat();
        assert!(matches!(decode_payload(&payload), Err(DecodeError::Payload(_))), "{payload:02x?}");
    }
}

/// A batch of more than [`MAX_EVENTS`] events is refused: a one-byte nil event decodes to
/// hundreds of bytes (a malformed event), so a message the guard lets through would ask for
/// gigabytes. As many as allowed still decode.
#[test]
fn too_many_events_are_an_error() {
    let batch = |n: usize| {
        let mut p = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
        p.extend(u32::try_from(n).unwrap().to_be_bytes());
        p.extend(std::iter::repeat_n(0xc0u8, n));
        p
    };
    assert_eq!(decode_payload(&batch(MAX_EVENTS)).unwrap().events.len(), MAX_EVENTS);
    assert!(matches!(decode_payload(&batch(MAX_EVENTS + 1)), Err(DecodeError::Payload(_))));
}

/// An event whose lists decode to far more memory than the batch's bytes (a one-byte nil
/// extra key takes 32 bytes decoded) is not decoded: 4 MB on the wire would have taken 128 MiB.
#[test]
fn lists_that_decode_to_far_more_than_their_bytes_are_refused() {
    let stored = |n: u32| {
        // [ts, [["BlockStored", [1], nil, [1], 1, nil, nil, nil, [nil x n]]], 0]
        let mut p = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x99, 0xab];
        p.extend(b"BlockStored");
        p.extend([0x91, 0x01, 0xc0, 0x91, 0x01, 0x01, 0xc0, 0xc0, 0xc0, 0xdd]);
        p.extend(n.to_be_bytes());
        p.extend(std::iter::repeat_n(0xc0u8, n as usize));
        p.push(0x00);
        p
    };
    let keys = |payload: &[u8]| match decode_payload(payload).map(|b| b.events) {
        Ok(events) => match &events[..] {
            [VllmEvent::BlockStored(s)] => s.extra_keys.as_ref().map(Vec::len),
            _ => None,
        },
        Err(_) => None,
    };
    assert_eq!(keys(&stored(1)), Some(1));
    assert_eq!(keys(&stored(4 << 20)), None, "decoded whole");
}

/// An event nested deeper than [`MAX_DEPTH`] is malformed, not a stack overflow; the batch
/// around it stands. Where the batch's own parts should be, it is an error.
#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    // [ts, [["BlockStored", [], nil, [], 4, nil, nil, nil, [[[[...]]]]]]]
    let mut p = hex::decode("92cb00000000000000009199ab426c6f636b53746f72656490c09004c0c0c0").unwrap();
    p.extend(std::iter::repeat_n(0x91, 100_000));
    p.push(0xc0);
    let batch = decode_payload(&p).expect("the batch around it is right");
    assert!(
        matches!(&batch.events[..], [VllmEvent::Malformed(bad)] if bad.is_store() && bad.reason.contains("depth")),
        "{:?}",
        batch.events
    );
    // [ts, [[[[...]]]]]: the events array holds no event.
    let mut p = hex::decode("92cb0000000000000000").unwrap();
    p.extend(std::iter::repeat_n(0x91, 100_000));
    p.push(0xc0);
    let batch = decode_payload(&p).expect("one malformed event");
    assert!(matches!(&batch.events[..], [VllmEvent::Malformed(bad)] if bad.tag.is_none()));
    // [[[[...]]]]: no batch at all.
    let p: Vec<u8> = std::iter::repeat_n(0x91, 100_000).chain([0xc0]).collect();
    assert!(matches!(decode_payload(&p), Err(DecodeError::Payload(_))));
}

#[test]
fn trailing_bytes_are_an_error() {
    let mut p = encode_payload(&VllmBatch::default()).to_vec();
    p.push(0xc0);
    assert!(matches!(decode_payload(&p), Err(DecodeError::TrailingBytes)));
    p.pop();
    p.push(0xcf); // a truncated value after the batch
    assert!(matches!(decode_payload(&p), Err(DecodeError::TrailingBytes)));
}
