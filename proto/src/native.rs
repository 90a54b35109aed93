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
    #[error("more than {} events in a batch", crate::vllm::MAX_EVENTS)]
    TooManyEvents,
}

/// `EventBatch.events`'s field number.
const EVENTS_FIELD: u64 = 7;

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
    // Counted before decoding: an empty event takes two bytes on the wire and a hundred
    // decoded ([`crate::vllm::MAX_EVENTS`]).
    if events_in(payload).is_some_and(|n| n > crate::vllm::MAX_EVENTS) {
        return Err(DecodeError::TooManyEvents);
    }
    let batch = EventBatch::decode(payload).map_err(DecodeError::Payload)?;
    if batch.seq != seq.0 {
        return Err(DecodeError::SeqMismatch { frame: seq.0, batch: batch.seq });
    }
    Ok(batch)
}

/// How many `events` fields the top level of `payload` holds (unknown groups, which the
/// decoder skips, are walked through); `None` if it does not parse (the decoder then says
/// why).
fn events_in(mut payload: &[u8]) -> Option<usize> {
    use prost::encoding::decode_varint;
    let (mut events, mut groups) = (0, Vec::new());
    while !payload.is_empty() {
        let key = decode_varint(&mut payload).ok()?;
        let (field, wire) = (key >> 3, key & 7);
        let skip = match wire {
            0 => {
                decode_varint(&mut payload).ok()?;
                0
            }
            1 => 8,
            2 => usize::try_from(decode_varint(&mut payload).ok()?).ok()?,
            3 => {
                groups.push(field);
                continue;
            }
            4 if groups.pop() == Some(field) => continue,
            5 => 4,
            _ => return None,
        };
        events += usize::from(groups.is_empty() && field == EVENTS_FIELD && wire == 2);
        payload = payload.get(skip..)?;
    }
    groups.is_empty().then_some(events)
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
                        medium: None,
                    })),
                },
                Event {
                    kind: Some(event::Kind::Removed(BlockRemoved { block_hashes: vec![2], medium: None })),
                },
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

    /// A batch of more events than a step makes is refused before it is decoded: a million
    /// empty events are two megabytes on the wire and a hundred decoded.
    #[test]
    fn too_many_events_are_refused_before_decoding() {
        let mut batch = sample();
        batch.events = vec![Event::default(); crate::vllm::MAX_EVENTS];
        let payload = encode_payload(&batch);
        assert_eq!(decode_payload(Seq(batch.seq), &payload).unwrap().events.len(), crate::vllm::MAX_EVENTS);
        batch.events.push(Event::default());
        let payload = encode_payload(&batch);
        assert!(matches!(decode_payload(Seq(batch.seq), &payload), Err(DecodeError::TooManyEvents)));
        // Behind an unknown group, which the decoder skips, the events are still counted.
        let grouped = [&[(9 << 3) | 3, (9 << 3) | 4][..], &payload].concat();
        assert!(matches!(decode_payload(Seq(batch.seq), &grouped), Err(DecodeError::TooManyEvents)));
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
