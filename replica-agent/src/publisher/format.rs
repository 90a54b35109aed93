//! The two payload encodings a replica can publish: kvroute's protobuf `EventBatch`, or the
//! msgpack `KVEventBatch` vLLM (>= 0.24, map-shaped events) sends, so that the router's vLLM
//! path can be exercised without a GPU or Python.

use bytes::Bytes;
use kvroute_proto::pb::{self, EventBatch, event};
use kvroute_proto::vllm::{self, ExtraKey, VllmBatch, VllmEvent};
use kvroute_proto::{BlockHash, native};

/// Payload encoding of published batches.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum EventFormat {
    /// kvroute's protobuf `EventBatch` (carries replica name and epoch).
    #[default]
    Kvroute,
    /// vLLM's msgpack `KVEventBatch` (see shared/reference/kv-events-wire.md).
    Vllm,
}

impl EventFormat {
    /// The frame-2 payload for `batch`.
    pub fn encode_payload(self, batch: &EventBatch) -> Bytes {
        match self {
            EventFormat::Kvroute => native::encode_payload(batch),
            EventFormat::Vllm => vllm::encode_payload(&to_vllm(batch)),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EventFormat::Kvroute => "kvroute",
            EventFormat::Vllm => "vllm",
        }
    }
}

/// The vLLM rendering of a native batch: same hashes (opaque ids to a vLLM consumer), same
/// tokens, `medium = "GPU"` (host memory's blocks as vLLM's offloading connector announces
/// them by default: their medium and hashes, nothing else), full-attention group 0, and the
/// namespace as vLLM (>= 0.20) publishes it: `lora_name`, and per block the untagged extra
/// keys that went into its hash (the adapter's name on every block, the salt after it on a
/// prompt's first block; `nil` for a block with neither).
fn to_vllm(batch: &EventBatch) -> VllmBatch {
    let events = batch
        .events
        .iter()
        .filter_map(|e| e.kind.as_ref())
        .map(|kind| match kind {
            // What vLLM's offloading connector says by default: the hashes alone.
            event::Kind::Stored(s) if s.medium.is_some() => VllmEvent::BlockStored(vllm::BlockStored {
                block_hashes: s.block_hashes.iter().copied().map(BlockHash).collect(),
                medium: s.medium.clone(),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..Default::default()
            }),
            event::Kind::Stored(s) => VllmEvent::BlockStored(vllm::BlockStored {
                block_hashes: s.block_hashes.iter().copied().map(BlockHash).collect(),
                parent_block_hash: s.parent_block_hash.map(BlockHash),
                token_ids: s.token_ids.clone(),
                block_size: batch.block_size,
                lora_name: s.lora_name.clone(),
                extra_keys: Some(extra_keys(s)),
                medium: Some("GPU".into()),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..Default::default()
            }),
            event::Kind::Removed(r) => VllmEvent::BlockRemoved(vllm::BlockRemoved {
                block_hashes: r.block_hashes.iter().copied().map(BlockHash).collect(),
                medium: Some(r.medium.clone().unwrap_or_else(|| "GPU".into())),
                group_idx: Some(0),
                ..Default::default()
            }),
            event::Kind::Cleared(_) => VllmEvent::AllBlocksCleared,
        })
        .collect();
    VllmBatch { ts: batch.ts_unix_nanos as f64 / 1e9, events, dp_rank: Some(batch.dp_rank) }
}

/// One `extra_keys` entry per block of `s`, as vLLM's `to_event_extra_keys` writes them.
fn extra_keys(s: &pb::BlockStored) -> Vec<ExtraKey> {
    let first_of_prompt = s.parent_block_hash.is_none();
    (0..s.block_hashes.len())
        .map(|i| {
            let salt = s.cache_salt.as_ref().filter(|_| i == 0 && first_of_prompt);
            let keys: Vec<ExtraKey> =
                s.lora_name.iter().chain(salt).map(|k| ExtraKey::Str(k.clone())).collect();
            if keys.is_empty() { ExtraKey::Nil } else { ExtraKey::Tuple(keys) }
        })
        .collect()
}
