//! The replica's gRPC `ReplicaAgent` service: `Info` (static facts), `Snapshot` (every
//! resident block, parent first, with the seq it is consistent with, in chunks) and `Stats`.

use std::pin::Pin;

use kvroute_proto::pb::{self, replica_agent_server::ReplicaAgent};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::engine::Engine;

/// Blocks per snapshot chunk when the client does not choose: ~40 KB of hashes without
/// tokens, well under gRPC's default 4 MiB message limit with 16-token blocks.
const DEFAULT_CHUNK_BLOCKS: usize = 4096;

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
        let n_chunks = snapshot.blocks.len().div_ceil(chunk_blocks).max(1);
        let mut blocks = snapshot.blocks.into_iter();
        let mut chunks = Vec::with_capacity(n_chunks);
        for chunk in 0..n_chunks {
            let these = blocks.by_ref().take(chunk_blocks).collect();
            chunks.push(Ok(pb::SnapshotChunk {
                epoch,
                seq,
                block_size,
                chunk: chunk as u32,
                last: chunk + 1 == n_chunks,
                blocks: these,
                has_seq,
            }));
        }
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn stats(&self, _: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        Ok(Response::new(self.engine.stats()))
    }
}
