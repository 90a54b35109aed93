//! The replica's gRPC `ReplicaAgent` service: `Info` (static facts), `Snapshot` (every
//! resident block, parent first, with the seq it is consistent with, in chunks) and `Stats`.

use std::pin::Pin;

use kvroute_proto::pb::{self, replica_agent_server::ReplicaAgent};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::engine::Engine;

/// Blocks per snapshot chunk when the client does not choose: ~40 KB of hashes without
/// tokens.
const DEFAULT_CHUNK_BLOCKS: usize = 4096;

/// Most encoded bytes of blocks in one chunk (a lone larger block aside), whatever the client
/// chose: well under gRPC's default 4 MiB message limit even with large blocks' tokens (4096
/// blocks of 512 tokens came to ~6 MB, which every client refused).
const CHUNK_BYTES: usize = 1 << 20;

/// Implements `kvroute.v1.ReplicaAgent` over the engine.
#[derive(Clone)]
pub struct AgentService {
    engine: Engine,
    info: pb::InfoResponse,
}

impl AgentService {
    pub fn new(engine: Engine, info: pb::InfoResponse) -> Self {
        Self { engine, info }
    }

    pub fn into_server(self) -> pb::replica_agent_server::ReplicaAgentServer<Self> {
        pb::replica_agent_server::ReplicaAgentServer::new(self)
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::SnapshotChunk, Status>> + Send>>;

#[tonic::async_trait]
impl ReplicaAgent for AgentService {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    type SnapshotStream = ChunkStream;

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Result<Response<ChunkStream>, Status> {
        let request = request.into_inner();
        let chunk_blocks = match request.chunk_blocks {
            0 => DEFAULT_CHUNK_BLOCKS,
            n => n as usize,
        };
        let snapshot = self.engine.snapshot(request.include_tokens);
        let config = self.engine.config();
        let (epoch, block_size) = (config.epoch.0, config.cache.block_size as u32);
        let (seq, has_seq) = (snapshot.seq.unwrap_or(0), snapshot.seq.is_some());
        let parts = split(snapshot.blocks, chunk_blocks, CHUNK_BYTES);
        let n_chunks = parts.len();
        let chunks: Vec<_> = parts
            .into_iter()
            .enumerate()
            .map(|(chunk, blocks)| {
                Ok(pb::SnapshotChunk {
                    epoch,
                    seq,
                    block_size,
                    chunk: chunk as u32,
                    last: chunk + 1 == n_chunks,
                    blocks,
                    has_seq,
                })
            })
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn stats(&self, _: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        Ok(Response::new(self.engine.stats()))
    }
}

/// `blocks` in order, cut into chunks of at most `most_blocks` blocks and (but for a lone larger
/// block) `most_bytes` encoded bytes; one empty chunk for no blocks.
fn split<B: prost::Message>(blocks: Vec<B>, most_blocks: usize, most_bytes: usize) -> Vec<Vec<B>> {
    let mut chunks = vec![Vec::new()];
    let mut bytes = 0;
    for block in blocks {
        let len = prost::Message::encoded_len(&block);
        let last = chunks.last_mut().expect("one chunk at least");
        if !last.is_empty() && (last.len() == most_blocks || bytes + len > most_bytes) {
            chunks.push(Vec::new());
            bytes = 0;
        }
        bytes += len;
        chunks.last_mut().expect("one chunk at least").push(block);
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_cut_by_count_and_by_bytes() {
        let block =
            |tokens: usize| pb::SnapshotBlock { token_ids: vec![u32::MAX; tokens], ..Default::default() };
        let sizes = |chunks: Vec<Vec<pb::SnapshotBlock>>| chunks.iter().map(Vec::len).collect::<Vec<_>>();
        assert_eq!(sizes(split(Vec::new(), 4, 100)), [0]);
        assert_eq!(sizes(split((0..9).map(|_| block(0)).collect(), 4, 1 << 20)), [4, 4, 1]);
        // Large blocks' tokens: by bytes, long before the count; a lone larger one still goes.
        let len = prost::Message::encoded_len(&block(100));
        assert_eq!(sizes(split((0..5).map(|_| block(100)).collect(), 4096, 2 * len)), [2, 2, 1]);
        assert_eq!(sizes(split(vec![block(100), block(1000), block(1)], 4096, len)), [1, 1, 1]);
        // At the default block count, 512-token blocks with a real vocabulary's ids stay under
        // gRPC's 4 MiB limit.
        let chunks = split((0..4096).map(|_| block(512)).collect(), DEFAULT_CHUNK_BLOCKS, CHUNK_BYTES);
        let largest = chunks.iter().map(|c| c.iter().map(prost::Message::encoded_len).sum::<usize>()).max();
        assert!(largest.unwrap() <= CHUNK_BYTES && chunks.len() > 1, "{}", chunks.len());
    }
}
