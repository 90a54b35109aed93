//! vLLM / SGLang KV-cache events: the msgpack payload of the live `[topic, seq, payload]`
//! frames (see [`crate::framing`]), decoded leniently and encoded the way vLLM 0.33 does.
//!
//! ```text
//! batch  = [ts: float, events: [event..], dp_rank: int|nil, ..ignored]   (2 elements in vLLM 0.9.0)
//!        | {"ts":.., "events":.., "data_parallel_rank"|"dp_rank"|"attn_dp_rank":..}   (insurance)
//! event  = {"type": "BlockStored", "block_hashes": [h..], ..}           vLLM >= 0.24, new SGLang
//!        | ["BlockStored", block_hashes, parent, token_ids, block_size,   vLLM <= 0.23, old SGLang
//!           lora_id, medium, lora_name, extra_keys, group_idx,
//!           kv_cache_spec_kind, kv_cache_spec_sliding_window, ..ignored]
//!        | ["BlockRemoved", block_hashes, medium, group_idx, ..ignored]
//!        | ["AllBlocksCleared", ..ignored]
//! h      = uint (any width) | negative int64 (SGLang: same 64 bits) | bin (vLLM's digest)
//! ```
//!
//! Decoding rules (from `shared/reference/kv-events-wire.md`, checked against 11 vLLM
//! releases): map events are read by key name, in any order, unknown keys skipped and
//! missing optional keys read as `None`; positional events may be shorter (older releases)
//! or longer (trailing elements ignored) than the newest layout. An unknown tag becomes
//! [`VllmEvent::Unknown`] instead of failing the batch, and an event that does not decode
//! (EAGLE's bigram `token_ids`, say) becomes [`VllmEvent::Malformed`]: only a batch whose
//! own shape is wrong, or that is not whole msgpack, is an error. `block_hashes`,
//! `token_ids` and `block_size` (BlockStored) and `block_hashes` (BlockRemoved) are
//! required.
//!
//! Robustness: every input gives `Ok` or `Err`, never a panic. Payloads are read from the
//! slice (no allocation by declared string/bin length), nesting is limited to
//! [`MAX_DEPTH`], the hand-written visitors cap pre-allocation at [`MAX_PREALLOC`]
//! elements whatever length a header declares (serde's own `Vec` impl caps at 1 MiB), a
//! batch holds at most [`MAX_EVENTS`] events (the native decoder's bound too), and its lists
//! (hashes, token ids, extra keys) at most eight times the payload's bytes and a mebibyte of
//! memory: a one-byte nil or fixint decodes to up to 32 bytes.
//!
//! The encoder writes what vLLM 0.33 sends: an array batch `[ts, events, dp_rank]`, events
//! as maps with vLLM's keys (default-valued optional keys omitted), hashes as msgpack uint.
//! Byte equality with msgspec is not a goal (header widths may differ); decoded equality is.

use bytes::Bytes;
use thiserror::Error;

use crate::framing::{self, FrameError};
use crate::{BlockHash, Seq};

mod de;
mod lenient;
mod ser;

/// Deepest msgpack nesting accepted (a valid batch nests about 6 levels deep); deeper input
/// is an error rather than a risk to the stack.
pub const MAX_DEPTH: usize = 32;

/// Most elements the decoder reserves room for up front, whatever an array header claims.
pub const MAX_PREALLOC: usize = 1024;

/// Most events one batch may hold. A decoded event takes hundreds of bytes where a nil one
/// takes one on the wire, so without a bound a message the ZMTP guard lets through (64 MiB)
/// would ask for tens of gigabytes; an engine step produces a few thousand at most.
pub const MAX_EVENTS: usize = 1 << 18;

/// One decoded `KVEventBatch`: the events of one engine scheduler step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VllmBatch {
    /// Engine wall-clock time of the step, seconds since the Unix epoch.
    pub ts: f64,
    pub events: Vec<VllmEvent>,
    /// `data_parallel_rank` (vLLM) / `attn_dp_rank` (SGLang); `None` when absent or nil.
    pub dp_rank: Option<u32>,
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq)]
#[allow(
    clippy::large_enum_variant,
    reason = "batches are short-lived and mostly BlockStored; boxing would cost an allocation per event"
)]
pub enum VllmEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    /// The engine dropped its whole prefix cache (`reset_prefix_cache`).
    AllBlocksCleared,
    /// An event tag this decoder does not know; consumers skip it.
    Unknown(String),
    /// An event that did not decode (a field of the wrong type, a required one missing, a
    /// shape from a newer engine); the rest of its batch stands. Encoded as nil, which
    /// decodes to `Malformed` again, without its tag.
    Malformed(MalformedEvent),
}

/// What is known of an event that did not decode.
#[derive(Clone, Debug, PartialEq)]
pub struct MalformedEvent {
    /// Its tag, if one could be read: a consumer can skip a `BlockStored` it cannot read (it
    /// misses blocks), but not a removal (it would keep blocks the engine dropped).
    pub tag: Option<String>,
    /// Why it did not decode.
    pub reason: String,
}

impl MalformedEvent {
    /// Whether it announced stored blocks (and nothing else).
    pub fn is_store(&self) -> bool {
        self.tag.as_deref() == Some("BlockStored")
    }
}

/// Newly cached, full blocks of one request in one KV-cache group.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockStored {
    /// Engine hashes of the new blocks, in chain order (opaque ids: see the wire doc §5).
    pub block_hashes: Vec<BlockHash>,
    /// Hash of the block before the first one here; `None` when the event starts at token 0.
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens of the whole range (may be empty for connector placeholder events).
    pub token_ids: Vec<u32>,
    /// Tokens per block for this group (0 for connector placeholders).
    pub block_size: u32,
    /// Deprecated adapter int id (vLLM), always present in SGLang events.
    pub lora_id: Option<i64>,
    /// Storage tier: `"GPU"`, `"CPU"`, `"cpu"`, `"STORAGE"`, `"CPU_PINNED"`, `"DISK"`, ...
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block: [`ExtraKey::Nil`] for plain text, else the tuple of untagged
    /// extra keys that went into that block's hash (LoRA name, `(mm_id, offset)`, salt..).
    pub extra_keys: Option<Vec<ExtraKey>>,
    /// KV-cache group (hybrid models announce the same tokens once per group).
    pub group_idx: Option<u32>,
    /// `full_attention`, `mla_attention`, `sliding_window`, `mamba`, ...
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// `"LOCAL"` / `"REMOTE"` (vLLM >= 0.26).
    pub locality: Option<String>,
    /// Secondary offloading tier id (vLLM >= 0.31).
    pub ownership: Option<String>,
    /// vLLM >= 0.31, SGLang.
    pub session_id: Option<String>,
    /// Tokens after each block folded into its hash (vLLM 0.33 lookahead hashing).
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
    /// SGLang only: the request's cache salt (vLLM folds it into `extra_keys` instead).
    pub cache_salt: Option<String>,
    /// How the blocks came to be announced: `"NEW"` (cached by this request) or `"REUSED"`
    /// (prefix-cache hits re-announced under `kv_cache_report_mode="full"`); proposed in
    /// vLLM PR 51699, absent before.
    pub origin: Option<String>,
}

/// Blocks evicted (or re-hashed) by the engine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<BlockHash>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

/// One value inside an `extra_keys` entry; msgpack's data model minus maps, which no engine
/// sends there (a map decodes to [`ExtraKey::Other`] with its content skipped).
#[derive(Clone, Debug, PartialEq)]
pub enum ExtraKey {
    Nil,
    Bool(bool),
    /// A negative integer (non-negative ones are [`ExtraKey::UInt`]).
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    /// A Python tuple or list.
    Tuple(Vec<ExtraKey>),
    /// Anything else (a map); encoded back as nil.
    Other,
}

impl BlockStored {
    /// Whether any block carries extra hash keys (LoRA, multimodal, salt, prompt embeds), i.e.
    /// whether equal `token_ids` may still have different engine hashes.
    pub fn has_extra_keys(&self) -> bool {
        self.extra_keys.iter().flatten().any(|k| *k != ExtraKey::Nil)
    }
}

/// Why a vLLM / SGLang event message could not be decoded.
#[derive(Debug, Error)]
pub enum DecodeError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("payload is not a vLLM KV-event batch")]
    Payload(#[source] rmp_serde::decode::Error),
    #[error("trailing bytes after the vLLM KV-event batch")]
    TrailingBytes,
}

/// Normalises a `bin` block hash to the integer vLLM publishes: the digest read big-endian,
/// keeping the low 64 bits (`int.from_bytes(d, "big") & (2**64 - 1)`). So a digest of 8 bytes
/// or more gives its last 8 bytes big-endian; a shorter one is zero-extended on the left
/// (`[0x01, 0x02]` -> `0x0102`, empty -> 0), the same value Python computes.
pub fn block_hash_from_digest(digest: &[u8]) -> BlockHash {
    let tail = &digest[digest.len().saturating_sub(8)..];
    let mut be = [0u8; 8];
    be[8 - tail.len()..].copy_from_slice(tail);
    BlockHash(u64::from_be_bytes(be))
}

/// Decodes a msgpack `KVEventBatch` payload (live or replayed).
///
/// A batch that does not decode as a whole is read again event by event (`vllm/lenient.rs`): if
/// only some of its events are at fault, they come back as [`VllmEvent::Malformed`] and the
/// rest as usual.
pub fn decode_payload(payload: &[u8]) -> Result<VllmBatch, DecodeError> {
    // Lists may take eight times the payload and a mebibyte (real batches take about as much
    // as their bytes on the wire); each reading gets the whole allowance.
    let budget = payload.len().saturating_mul(8).saturating_add(1 << 20);
    de::with_budget(budget, || decode_whole::<VllmBatch>(payload))
        .or_else(|strict| de::with_budget(budget, || lenient::decode(payload)).ok_or(strict))
}

/// One `T` that is the whole of `payload`.
fn decode_whole<'a, T: serde::Deserialize<'a>>(payload: &'a [u8]) -> Result<T, DecodeError> {
    use serde::Deserialize;

    let mut de = rmp_serde::Deserializer::from_read_ref(payload);
    de.set_max_depth(MAX_DEPTH);
    let value = T::deserialize(&mut de).map_err(DecodeError::Payload)?;
    // rmp-serde does not expose the unread rest; reading one more value only succeeds if
    // something follows the batch.
    match serde::de::IgnoredAny::deserialize(&mut de) {
        Err(rmp_serde::decode::Error::InvalidMarkerRead(e))
            if e.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            Ok(value)
        }
        _ => Err(DecodeError::TrailingBytes),
    }
}

/// Decodes a live message `[topic, seq, payload]` into its topic, seq and batch.
pub fn decode_live(frames: &[Bytes]) -> Result<(Bytes, Seq, VllmBatch), DecodeError> {
    let msg = framing::decode_live(frames)?;
    let batch = decode_payload(&msg.payload)?;
    Ok((msg.topic, msg.seq, batch))
}

/// The msgpack payload vLLM 0.33 would publish for `batch`.
pub fn encode_payload(batch: &VllmBatch) -> Bytes {
    let bytes = rmp_serde::to_vec(batch).expect("encoding a VllmBatch into a Vec cannot fail");
    Bytes::from(bytes)
}

/// The live frames `[topic, seq, payload]` of `batch` in vLLM format.
pub fn encode_live(topic: Bytes, seq: Seq, batch: &VllmBatch) -> Vec<Bytes> {
    framing::encode_live(topic, seq, encode_payload(batch))
}

#[cfg(test)]
mod tests;
