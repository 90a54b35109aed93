//! The snapshot client: reads a replica agent's `Snapshot` stream (every resident block,
//! parent before child, then those it holds in host memory, and the seq it is consistent
//! with) under one overall timeout.

use std::time::Duration;

use kvroute_proto::pb::replica_agent_client::ReplicaAgentClient;
use kvroute_proto::pb::{SnapshotBlock, SnapshotRequest};
use kvroute_proto::{Epoch, Seq};

/// A complete snapshot.
#[derive(Debug)]
pub(crate) struct Snapshot {
    pub epoch: Epoch,
    /// The newest seq the snapshot includes; `None` if nothing was published yet.
    pub seq: Option<Seq>,
    pub block_size: u32,
    pub blocks: Vec<SnapshotBlock>,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum SnapshotError {
    #[error("cannot connect to the agent at {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("snapshot rpc failed")]
    Rpc(#[from] tonic::Status),
    #[error("snapshot timed out")]
    Timeout,
    #[error("snapshot stream ended before its last chunk")]
    Truncated,
    #[error("snapshot chunks disagree or are out of order")]
    Inconsistent,
    #[error("snapshot holds more than {limit} blocks of one tier (the cache, or host memory)")]
    TooLarge { limit: usize },
    #[error("snapshot blocks take more than {limit} bytes (with their tokens, adapter names and salts)")]
    TooManyBytes { limit: usize },
    #[error("snapshot of block size {got}, where the replica's is {want}")]
    BlockSize { got: u32, want: u32 },
    #[error("a snapshot block has {tokens} tokens, not the block size of {block_size}")]
    BadBlock { tokens: usize, block_size: u32 },
}

/// What a snapshot may keep, a block on average: the block and 256 bytes of tokens, adapter
/// name and salt (a 64-token block's tokens; a prompt's first block names its namespace).
/// Without it, the count of blocks bounded nothing of a block's strings.
const BYTES_A_BLOCK: usize = size_of::<SnapshotBlock>() + 256;

/// What a snapshot may be: at most `max_blocks` blocks (and [`BYTES_A_BLOCK`] bytes a block
/// in all) of the cache, and as many of host memory (each tier is held to that cap when
/// its events are applied), of the replica's block size when it is known.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_blocks: usize,
    pub block_size: Option<u32>,
}

/// Fetches a whole snapshot within `limits`; `include_tokens` when the router must hash
/// blocks itself.
pub(crate) async fn fetch(
    endpoint: &str,
    include_tokens: bool,
    timeout: Duration,
    limits: Limits,
) -> Result<Snapshot, SnapshotError> {
    tokio::time::timeout(timeout, fetch_inner(endpoint, include_tokens, limits))
        .await
        .map_err(|_| SnapshotError::Timeout)?
}

/// The bytes `block` keeps: itself, its tokens and its names.
fn kept_bytes(block: &SnapshotBlock) -> usize {
    let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    size_of::<SnapshotBlock>()
        + block.token_ids.len() * size_of::<u32>()
        + text(&block.lora_name)
        + text(&block.cache_salt)
        + text(&block.medium)
}

/// Whether `block` is in the cache (no `medium`, or the GPU), not in host memory (or a tier
/// the router does not index, skipped when applied).
fn on_device(block: &SnapshotBlock) -> bool {
    super::decode::tier(block.medium.as_deref()) == Some(super::decode::Tier::Device)
}

async fn fetch_inner(
    endpoint: &str,
    include_tokens: bool,
    limits: Limits,
) -> Result<Snapshot, SnapshotError> {
    let Limits { max_blocks, block_size } = limits;
    let max_bytes = max_blocks.saturating_mul(BYTES_A_BLOCK);
    // Blocks and bytes kept of each tier: the cache's, host memory's.
    let mut kept = [(0usize, 0usize); 2];
    let mut client = ReplicaAgentClient::connect(endpoint.to_owned())
        .await
        .map_err(|source| SnapshotError::Connect { endpoint: endpoint.to_owned(), source })?;
    let mut stream = client.snapshot(SnapshotRequest { include_tokens, chunk_blocks: 0 }).await?.into_inner();
    let mut snapshot: Option<Snapshot> = None;
    let mut next_chunk = 0u32;
    while let Some(mut chunk) = stream.message().await? {
        if chunk.chunk != next_chunk {
            return Err(SnapshotError::Inconsistent);
        }
        next_chunk += 1;
        let seq = chunk.has_seq.then_some(Seq(chunk.seq));
        let snap = snapshot.get_or_insert_with(|| Snapshot {
            epoch: Epoch(chunk.epoch),
            seq,
            block_size: chunk.block_size,
            blocks: Vec::new(),
        });
        if snap.epoch != Epoch(chunk.epoch) || snap.seq != seq || snap.block_size != chunk.block_size {
            return Err(SnapshotError::Inconsistent);
        }
        // Blocks of another size would be skipped one by one when stored: refused whole, the
        // rank rebuilds from its live stream instead.
        if let Some(want) = block_size.filter(|want| *want != chunk.block_size) {
            return Err(SnapshotError::BlockSize { got: chunk.block_size, want });
        }
        // A block's tokens are kept only when asked for, and only a block's worth: the count
        // of blocks bounds what is kept only if each is a block. (A block in host memory is
        // named by its hash alone.)
        for block in &mut chunk.blocks {
            if !include_tokens || !on_device(block) {
                block.token_ids = Vec::new();
            } else if block.token_ids.len() != chunk.block_size as usize {
                return Err(SnapshotError::BadBlock {
                    tokens: block.token_ids.len(),
                    block_size: chunk.block_size,
                });
            }
        }
        // The agent decides how many chunks it sends: bound what is kept, not only how long
        // it takes.
        for block in &chunk.blocks {
            let (blocks, bytes) = &mut kept[usize::from(!on_device(block))];
            *blocks += 1;
            if *blocks > max_blocks {
                return Err(SnapshotError::TooLarge { limit: max_blocks });
            }
            *bytes = bytes.saturating_add(kept_bytes(block));
            if *bytes > max_bytes {
                return Err(SnapshotError::TooManyBytes { limit: max_bytes });
            }
        }
        snap.blocks.extend(chunk.blocks);
        if chunk.last {
            return Ok(snapshot.expect("set above"));
        }
    }
    Err(SnapshotError::Truncated)
}
