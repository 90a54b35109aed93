//! The snapshot client: reads a replica agent's `Snapshot` stream (every resident block,
//! parent before child, and the seq it is consistent with) under one overall timeout.

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
    #[error("snapshot holds more than {limit} blocks")]
    TooLarge { limit: usize },
    #[error("a snapshot block has {tokens} tokens, not the block size of {block_size}")]
    BadBlock { tokens: usize, block_size: u32 },
}

/// Fetches a whole snapshot of at most `max_blocks` blocks; `include_tokens` when the router
/// must hash blocks itself.
pub(crate) async fn fetch(
    endpoint: &str,
    include_tokens: bool,
    timeout: Duration,
    max_blocks: usize,
) -> Result<Snapshot, SnapshotError> {
    tokio::time::timeout(timeout, fetch_inner(endpoint, include_tokens, max_blocks))
        .await
        .map_err(|_| SnapshotError::Timeout)?
}

async fn fetch_inner(
    endpoint: &str,
    include_tokens: bool,
    max_blocks: usize,
) -> Result<Snapshot, SnapshotError> {
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
        // A block's tokens are kept only when asked for, and only a block's worth: the count
        // of blocks bounds what is kept only if each is a block.
        for block in &mut chunk.blocks {
            if !include_tokens {
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
        if snap.blocks.len().saturating_add(chunk.blocks.len()) > max_blocks {
            return Err(SnapshotError::TooLarge { limit: max_blocks });
        }
        snap.blocks.extend(chunk.blocks);
        if chunk.last {
            return Ok(snapshot.expect("set above"));
        }
    }
    Err(SnapshotError::Truncated)
}
