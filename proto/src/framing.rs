//! ZeroMQ message layouts, as plain frame lists (`[Bytes]`) so this crate stays independent
//! of the socket library.
//!
//! ```text
//! live message     [topic, seq (u64 BE, 8 bytes), payload]
//! replay request   [b"", start_seq (u64 BE)]                      DEALER -> ROUTER
//! replay reply     [b"", topic, seq, payload]                     vLLM >= 0.26, kvroute
//!                  [b"", seq, payload]                            vLLM <= 0.24
//! replay end       [b"", b"", ff ff ff ff ff ff ff ff, b""]       vLLM >= 0.26, kvroute
//!                  [b"", ff ff ff ff ff ff ff ff, b""]            vLLM <= 0.24
//! ```
//!
//! A ROUTER socket sees the peer's identity as an extra first frame; the functions here take
//! and produce frames without it.

use bytes::Bytes;
use thiserror::Error;

use crate::Seq;

/// The seq value a replay's end marker carries (`-1` as a signed 64-bit integer).
pub const END_SEQ: u64 = u64::MAX;

/// Why a list of frames is not a well-formed message.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: &'static str, got: usize },
    #[error("seq frame must be 8 bytes, got {0}")]
    SeqLength(usize),
    #[error("first frame must be the empty delimiter, got {0} bytes")]
    MissingDelimiter(usize),
}

/// One live message from a publisher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveMessage {
    pub topic: Bytes,
    pub seq: Seq,
    pub payload: Bytes,
}

/// Frames of a live message.
pub fn encode_live(topic: Bytes, seq: Seq, payload: Bytes) -> Vec<Bytes> {
    vec![topic, seq_frame(seq), payload]
}

/// Parses a live message; it must have exactly three frames.
pub fn decode_live(frames: &[Bytes]) -> Result<LiveMessage, FrameError> {
    let [topic, seq, payload] = frames else {
        return Err(FrameError::FrameCount { expected: "3", got: frames.len() });
    };
    Ok(LiveMessage { topic: topic.clone(), seq: parse_seq(seq)?, payload: payload.clone() })
}

/// Frames a DEALER sends to ask for every buffered batch with seq >= `start`.
pub fn encode_replay_request(start: Seq) -> Vec<Bytes> {
    vec![Bytes::new(), seq_frame(start)]
}

/// Parses a replay request as a ROUTER receives it, identity frame already removed, as
/// vLLM reads one: the middle frame is not looked at, and the seq is a big-endian integer of
/// any length (`int.from_bytes`: empty is 0; one past `u64` asks for nothing buffered).
pub fn decode_replay_request(frames: &[Bytes]) -> Result<Seq, FrameError> {
    let [_, seq] = frames else {
        return Err(FrameError::FrameCount { expected: "2", got: frames.len() });
    };
    let significant = &seq[seq.iter().position(|&b| b != 0).unwrap_or(seq.len())..];
    if significant.len() > 8 {
        return Ok(Seq(u64::MAX));
    }
    Ok(Seq(significant.iter().fold(0, |n, &b| n << 8 | u64::from(b))))
}

/// One message of a replay answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayReply {
    /// A buffered batch (the topic is empty in the vLLM <= 0.24 layout).
    Batch(LiveMessage),
    /// No more batches follow.
    End,
}

/// The reply frames for one buffered batch (kvroute / vLLM >= 0.26 layout).
pub fn encode_replay_batch(topic: Bytes, seq: Seq, payload: Bytes) -> Vec<Bytes> {
    vec![Bytes::new(), topic, seq_frame(seq), payload]
}

/// The frames that end a replay (kvroute / vLLM >= 0.26 layout).
pub fn encode_replay_end() -> Vec<Bytes> {
    vec![Bytes::new(), Bytes::new(), seq_frame(Seq(END_SEQ)), Bytes::new()]
}

/// Parses one replay answer message, in either layout: after the empty delimiter the last
/// frame is the payload, the one before it the seq, and an optional topic precedes them. An
/// empty payload or a seq of [`END_SEQ`] ends the replay.
pub fn decode_replay_reply(frames: &[Bytes]) -> Result<ReplayReply, FrameError> {
    let (topic, seq, payload) = match frames {
        [delim, seq, payload] => (Bytes::new(), check_delim(delim).and(Ok(seq))?, payload),
        [delim, topic, seq, payload] => (topic.clone(), check_delim(delim).and(Ok(seq))?, payload),
        _ => {
            return Err(FrameError::FrameCount { expected: "3 or 4", got: frames.len() });
        }
    };
    let seq = parse_seq(seq)?;
    if seq.0 == END_SEQ || payload.is_empty() {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch(LiveMessage { topic, seq, payload: payload.clone() }))
}

fn check_delim(delim: &Bytes) -> Result<(), FrameError> {
    if delim.is_empty() { Ok(()) } else { Err(FrameError::MissingDelimiter(delim.len())) }
}

fn seq_frame(seq: Seq) -> Bytes {
    Bytes::copy_from_slice(&seq.0.to_be_bytes())
}

fn parse_seq(frame: &[u8]) -> Result<Seq, FrameError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(Seq(u64::from_be_bytes(bytes)))
}

/// The endpoint data-parallel rank `rank` publishes on, vLLM's way: `tcp://h:P` →
/// `tcp://h:P+rank`, `ipc://x` / `inproc://x` → `…x_dp{rank}`; rank 0 and port 0 are
/// unchanged. `None` for another transport, a bad port, or a port past 65535.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Option<String> {
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let (host, port) = rest.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        if rank == 0 || port == 0 {
            return Some(endpoint.to_owned());
        }
        let port = u16::try_from(u32::from(port).checked_add(rank)?).ok()?;
        return Some(format!("tcp://{host}:{port}"));
    }
    if endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://") {
        return Some(if rank == 0 { endpoint.to_owned() } else { format!("{endpoint}_dp{rank}") });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &'static [u8]) -> Bytes {
        Bytes::from_static(s)
    }

    #[test]
    fn live_round_trips() {
        let frames = encode_live(b(b"kv"), Seq(0x0102_0304_0506_0708), b(b"payload"));
        assert_eq!(&frames[1][..], &[1, 2, 3, 4, 5, 6, 7, 8]);
        let msg = decode_live(&frames).unwrap();
        assert_eq!(
            msg,
            LiveMessage { topic: b(b"kv"), seq: Seq(0x0102_0304_0506_0708), payload: b(b"payload") }
        );
    }

    #[test]
    fn live_rejects_wrong_frame_count() {
        for n in [0, 1, 2, 4, 5] {
            let frames = vec![Bytes::from_static(&[0u8; 8]); n];
            assert_eq!(decode_live(&frames), Err(FrameError::FrameCount { expected: "3", got: n }));
        }
    }

    #[test]
    fn live_rejects_bad_seq_length() {
        for len in [0usize, 1, 7, 9, 16] {
            let frames = vec![b(b"t"), Bytes::from(vec![0u8; len]), b(b"p")];
            assert_eq!(decode_live(&frames), Err(FrameError::SeqLength(len)));
        }
    }

    /// Read as vLLM reads one (`client_id, _, start_seq_bytes = frame`, `int.from_bytes`).
    #[test]
    fn replay_request_round_trips_and_reads_as_vllm_does() {
        let frames = encode_replay_request(Seq(42));
        assert_eq!(decode_replay_request(&frames), Ok(Seq(42)));
        assert_eq!(decode_replay_request(&[b(b"x"), frames[1].clone()]), Ok(Seq(42)), "any middle frame");
        assert_eq!(
            decode_replay_request(&frames[1..]),
            Err(FrameError::FrameCount { expected: "2", got: 1 })
        );
        assert_eq!(decode_replay_request(&[Bytes::new(), b(&[1, 0])]), Ok(Seq(256)));
        assert_eq!(decode_replay_request(&[Bytes::new(), Bytes::new()]), Ok(Seq(0)));
        let wide = [[0u8; 4].as_slice(), &42u64.to_be_bytes()].concat();
        assert_eq!(decode_replay_request(&[Bytes::new(), Bytes::from(wide)]), Ok(Seq(42)));
        assert_eq!(decode_replay_request(&[Bytes::new(), b(&[1; 9])]), Ok(Seq(u64::MAX)));
    }

    #[test]
    fn replay_reply_both_layouts() {
        let new = encode_replay_batch(b(b"kv"), Seq(7), b(b"p"));
        assert_eq!(
            decode_replay_reply(&new),
            Ok(ReplayReply::Batch(LiveMessage { topic: b(b"kv"), seq: Seq(7), payload: b(b"p") }))
        );
        let old = vec![Bytes::new(), seq_frame(Seq(7)), b(b"p")];
        assert_eq!(
            decode_replay_reply(&old),
            Ok(ReplayReply::Batch(LiveMessage { topic: Bytes::new(), seq: Seq(7), payload: b(b"p") }))
        );
        assert_eq!(decode_replay_reply(&encode_replay_end()), Ok(ReplayReply::End));
        let old_end = vec![Bytes::new(), seq_frame(Seq(END_SEQ)), Bytes::new()];
        assert_eq!(decode_replay_reply(&old_end), Ok(ReplayReply::End));
    }

    #[test]
    fn replay_reply_rejects_malformed() {
        assert_eq!(
            decode_replay_reply(&[Bytes::new(), b(b"p")]),
            Err(FrameError::FrameCount { expected: "3 or 4", got: 2 })
        );
        assert_eq!(
            decode_replay_reply(&[b(b"x"), seq_frame(Seq(1)), b(b"p")]),
            Err(FrameError::MissingDelimiter(1))
        );
        assert_eq!(decode_replay_reply(&[Bytes::new(), b(b"short"), b(b"p")]), Err(FrameError::SeqLength(5)));
    }
}
