//! kvroute's native event stream: protobuf [`EventBatch`]es inside the live framing.

use bytes::Bytes;
use prost::Message;
use thiserror::Error;

use crate::Seq;
use crate::framing::{self, FrameError};
use crate::pb::EventBatch;

/// Why a native message could not be decoded.
#[derive(Debug, Error)]
pub enum DecodeError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("payload is not a protobuf EventBatch")]
    Payload(#[source] prost::DecodeError),
    #[error("frame seq {frame} does not match batch seq {batch}")]
    SeqMismatch { frame: u64, batch: u64 },
}

/// The live frames for `batch` (its `seq` goes in frame 1).
pub fn encode(topic: Bytes, batch: &EventBatch) -> Vec<Bytes> {
    framing::encode_live(topic, Seq(batch.seq), encode_payload(batch))
}

/// The protobuf payload of `batch` alone.
pub fn encode_payload(batch: &EventBatch) -> Bytes {
    Bytes::from(batch.encode_to_vec())
}

/// Decodes a live native message into its topic and batch.
pub fn decode(frames: &[Bytes]) -> Result<(Bytes, EventBatch), DecodeError> {
    let msg = framing::decode_live(frames)?;
    let batch = decode_payload(msg.seq, &msg.payload)?;
    Ok((msg.topic, batch))
}

/// Decodes a payload that arrived with frame seq `seq` (live or replayed).
pub fn decode_payload(seq: Seq, payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let batch = EventBatch::decode(payload).map_err(DecodeError::Payload)?;
    if batch.seq != seq.0 {
        return Err(DecodeError::SeqMismatch { frame: seq.0, batch: batch.seq });
    }
    Ok(batch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{AllBlocksCleared, BlockRemoved, BlockStored, Event, event};

    fn sample() -> EventBatch {
        EventBatch {
            replica: "agent-0".into(),
            epoch: 0xdead_beef,
            seq: 5,
            ts_unix_nanos: 1_700_000_000_000_000_000,
            block_size: 2,
            dp_rank: 0,
            events: vec![
                Event {
                    kind: Some(event::Kind::Stored(BlockStored {
                        block_hashes: vec![1, 2],
                        parent_block_hash: None,
                        token_ids: vec![1, 2, 3, 4],
                        lora_name: Some("adapter".into()),
                        cache_salt: Some("tenant".into()),
                    })),
                },
                Event { kind: Some(event::Kind::Removed(BlockRemoved { block_hashes: vec![2] })) },
                Event { kind: Some(event::Kind::Cleared(AllBlocksCleared {})) },
            ],
        }
    }

    #[test]
    fn round_trips() {
        let batch = sample();
        let frames = encode(Bytes::from_static(b"kv"), &batch);
        let (topic, back) = decode(&frames).unwrap();
        assert_eq!(&topic[..], b"kv");
        assert_eq!(back, batch);
    }

    #[test]
    fn undecodable_payload_is_an_error() {
        let frames = framing::encode_live(Bytes::new(), Seq(0), Bytes::from_static(&[0xff, 0xff, 0xff]));
        assert!(matches!(decode(&frames), Err(DecodeError::Payload(_))));
    }

    #[test]
    fn seq_mismatch_is_an_error() {
        let batch = sample();
        let frames = framing::encode_live(Bytes::new(), Seq(6), encode_payload(&batch));
        assert!(matches!(decode(&frames), Err(DecodeError::SeqMismatch { frame: 6, batch: 5 })));
    }

    #[test]
    fn frame_errors_pass_through() {
        assert!(matches!(decode(&[]), Err(DecodeError::Frame(FrameError::FrameCount { .. }))));
    }
}
