//! The fuzz targets of `kvroute-proto`'s decoders, as plain functions of one byte slice so
//! that libFuzzer (`fuzz_targets/*.rs`) and the stable smoke test in `cargo test`
//! (`proto/tests/fuzz_smoke.rs`, which includes this file) run exactly the same checks.
//!
//! Each target must never panic, and where the decoder has an encoder the decoded value must
//! survive a round trip:
//! - [`native_decode`]: `native::decode` of the input split into frames; a decoded batch
//!   re-encodes to frames that decode to the same topic and batch.
//! - [`vllm_decode`]: `vllm::decode_payload` of the raw input and `vllm::decode_live` of it
//!   split into frames; a decoded batch re-encodes to a payload that decodes again, and
//!   encoding is a fixed point from there (the codec is lossy only where documented: NaN
//!   timestamps, map-valued extra keys).
//! - [`framing`]: `decode_live`, `decode_replay_request`, `decode_replay_reply`; whatever
//!   decodes re-encodes to the same frames (a replay request, read leniently as vLLM reads
//!   one, to frames that read the same).
//! - [`openai_request`]: the input as a `/v1/completions`, a `/v1/chat/completions` and a
//!   `/v1/messages` body (converted to the chat request it stands for): `ParsedRequest::parse`, then token ids (builtin tokenizer and chat template),
//!   namespace and block hashes.
//!
//! Frames are cut from the input as `[len: u16 LE][len bytes]`, repeated, at most
//! [`MAX_FRAMES`]; a short last frame takes what is left.

use std::sync::OnceLock;

use bytes::Bytes;
use kvroute_proto::framing::{self, ReplayReply};
use kvroute_proto::openai::{Endpoint, ParsedRequest, Tokenization, TokenizationConfig};
use kvroute_proto::{Seq, native, vllm};

/// Most frames cut from one input.
pub const MAX_FRAMES: usize = 6;

/// Cuts `data` into frames (see the module documentation).
pub fn frames(mut data: &[u8]) -> Vec<Bytes> {
    let mut frames = Vec::new();
    while data.len() >= 2 && frames.len() < MAX_FRAMES {
        let len = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
        frames.push(Bytes::copy_from_slice(&data[2..2 + len]));
        data = &data[2 + len..];
    }
    frames
}

/// The inverse of [`frames`], for writing seeds.
pub fn join(frames: &[Bytes]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        let len = u16::try_from(f.len()).expect("seed frames are under 64 KiB");
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

pub fn native_decode(data: &[u8]) {
    let frames = frames(data);
    if let Ok((topic, batch)) = native::decode(&frames) {
        let again = native::decode(&native::encode(topic.clone(), &batch)).expect("re-encoded batch decodes");
        assert_eq!(again, (topic, batch));
    }
    if let Ok(batch) = native::decode_payload(Seq(0), data) {
        assert_eq!(batch.seq, 0);
    }
}

pub fn vllm_decode(data: &[u8]) {
    if let Ok(batch) = vllm::decode_payload(data) {
        round_trip_vllm(&batch);
    }
    if let Ok((topic, seq, batch)) = vllm::decode_live(&frames(data)) {
        let (topic2, seq2, _) = vllm::decode_live(&vllm::encode_live(topic.clone(), seq, &batch))
            .expect("re-encoded frames decode");
        assert_eq!((topic2, seq2), (topic, seq));
        round_trip_vllm(&batch);
    }
}

fn round_trip_vllm(batch: &vllm::VllmBatch) {
    let once = vllm::encode_payload(batch);
    let decoded = vllm::decode_payload(&once).expect("re-encoded payload decodes");
    assert_eq!(decoded.events.len(), batch.events.len());
    assert_eq!(vllm::encode_payload(&decoded), once, "encoding is a fixed point after one round");
}

pub fn framing(data: &[u8]) {
    let frames = frames(data);
    if let Ok(m) = framing::decode_live(&frames) {
        assert_eq!(framing::encode_live(m.topic, m.seq, m.payload), frames);
    }
    // Read leniently, as vLLM reads one: what it reads is what its canonical form reads.
    if let Ok(seq) = framing::decode_replay_request(&frames) {
        assert_eq!(framing::decode_replay_request(&framing::encode_replay_request(seq)), Ok(seq));
        // Python's `int.from_bytes(b, "big")`, past `u64` read as its largest.
        let read = frames[1].iter().try_fold(0u64, |n, &b| n.checked_mul(256).map(|n| n | u64::from(b)));
        assert_eq!(seq.0, read.unwrap_or(u64::MAX));
    }
    match framing::decode_replay_reply(&frames) {
        Ok(ReplayReply::Batch(m)) => {
            let mut expected = framing::encode_replay_batch(m.topic, m.seq, m.payload);
            if frames.len() == 3 {
                expected.remove(1); // the vLLM <= 0.24 layout has no topic
            }
            assert_eq!(expected, frames);
        }
        Ok(ReplayReply::End) => {
            let seq = &frames[frames.len() - 2];
            let payload = &frames[frames.len() - 1];
            assert!(payload.is_empty() || seq[..] == framing::END_SEQ.to_be_bytes());
        }
        Err(_) => {}
    }
}

fn tokenization() -> &'static Tokenization {
    static TOKENIZATION: OnceLock<Tokenization> = OnceLock::new();
    TOKENIZATION.get_or_init(|| {
        let config = TokenizationConfig {
            base_model: "kvroute-sim".into(),
            lora_adapters: vec!["adapter-a".into()],
            ..TokenizationConfig::default()
        };
        Tokenization::new(&config).expect("the builtin tokenizer loads")
    })
}

pub fn openai_request(data: &[u8]) {
    let t = tokenization();
    for endpoint in
        [Endpoint::Completions, Endpoint::ChatCompletions, Endpoint::Messages, Endpoint::Responses]
    {
        let Ok((endpoint, data)) = t.readable(endpoint, data) else { continue };
        let Ok(request) = ParsedRequest::parse(endpoint, &data) else { continue };
        let _ = (request.model(), request.cache_salt(), request.stream(), request.max_tokens());
        let _ = t.namespace(&request);
        if let Ok(prompts) = t.prompt_tokens(&request) {
            let hashes = t.block_hashes(&request, 4).expect("tokenizes the second time too");
            assert_eq!(hashes.len(), prompts.len());
            for (h, p) in hashes.iter().zip(&prompts) {
                assert_eq!(h.len(), p.len() / 4);
            }
        }
    }
}
