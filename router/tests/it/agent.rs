//! The replica agent's real engine, publisher and gRPC service as the event source: the
//! router joins late (the agent's replay buffer has wrapped, so it resyncs from `Snapshot`)
//! and then follows the live stream; the index must equal the engine's resident blocks.

use std::time::Duration;

use kvroute_proto::{CacheNamespace, Epoch, pb};
use kvroute_replica_agent::Config;
use kvroute_replica_agent::cache::{CacheConfig, PolicyKind, S3FifoParams};
use kvroute_replica_agent::engine::{Engine, EngineConfig, Job, Output};
use kvroute_replica_agent::grpc::AgentService;
use kvroute_replica_agent::publisher::{EventFormat, Publisher, PublisherConfig};
use kvroute_router::ingest::Outcome;
use kvroute_router::replicas::{EngineKind, Replica, ReplicaSpec, StreamState};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::support::*;

struct RealAgent {
    engine: Engine,
    events: String,
    replay: Option<String>,
    grpc: String,
    shutdown: CancellationToken,
}

impl RealAgent {
    async fn start(format: EventFormat) -> Self {
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let publisher_config = PublisherConfig { format, buffer_steps: 4, ..PublisherConfig::default() };
        let (publisher, endpoints) =
            Publisher::bind(publisher_config, "tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), &tracker)
                .await
                .expect("bind publisher");
        let config = Config { time_scale: 1000.0, ..Config::loopback("real-agent") };
        let engine = Engine::start(
            EngineConfig {
                replica: "real-agent".into(),
                epoch: Epoch(0x0123_4567),
                dp_rank: 0,
                cache: CacheConfig {
                    capacity_blocks: 48,
                    block_size: BLOCK as usize,
                    policy: PolicyKind::Lru,
                    s3fifo: S3FifoParams::default(),
                },
                offload_blocks: 0,
                max_num_seqs: 8,
                max_num_batched_tokens: 2048,
                max_waiting: 256,
                timing: config.timing(),
                seed: 1,
                shutdown_grace: Duration::from_secs(1),
            },
            publisher,
            &tracker,
            shutdown.clone(),
        )
        .expect("engine");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind gRPC");
        let grpc = format!("http://{}", listener.local_addr().expect("addr"));
        let service = AgentService::new(engine.clone(), pb::InfoResponse::default()).into_server();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    stop.cancelled_owned(),
                )
                .await;
            served.expect("gRPC server");
        });
        Self { engine, events: endpoints.events, replay: endpoints.replay, grpc, shutdown }
    }

    /// Runs `n` generation requests over prompts that share prefixes, to completion.
    async fn serve(&self, rng: &mut Rng, n: usize) {
        let bases: Vec<Vec<u32>> = (0..4).map(|_| rng.tokens(3)).collect();
        for _ in 0..n {
            let mut prompt = bases[rng.below(bases.len() as u64) as usize].clone();
            let extra = rng.below(5) as usize;
            prompt.extend(rng.tokens(extra));
            let job = Job::new(CacheNamespace::new(MODEL), prompt, BLOCK as usize, 2);
            let mut outputs = self.engine.submit(job).expect("submit");
            while let Some(output) = outputs.recv().await {
                match output {
                    Output::Done(_) => break,
                    Output::Failed(why) => panic!("job failed: {why}"),
                    _ => {}
                }
            }
        }
    }
}

impl Drop for RealAgent {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn mirrors(h: &Harness, r: &Replica, engine: &Engine) -> bool {
    let resident = engine.resident();
    h.index.blocks(r.id) == resident.len() && resident.iter().all(|b| h.index.lookup(&[*b]).get(r.id) == 1)
}

async fn late_router_mirrors_the_agent(format: EventFormat, engine_kind: EngineKind) {
    let agent = RealAgent::start(format).await;
    let mut rng = Rng::new(21);
    agent.serve(&mut rng, 30).await;
    assert!(agent.engine.last_seq().unwrap_or(0) > 4, "the replay buffer must have wrapped");

    let h = Harness::start();
    let spec = ReplicaSpec {
        grpc_endpoint: Some(agent.grpc.clone()),
        ..spec("real", engine_kind, &agent.events, agent.replay.as_deref())
    };
    let (r, m) = h.add(spec);
    h.synced(&r).await;
    wait_until("index mirrors the engine after the snapshot", || mirrors(&h, &r, &agent.engine)).await;
    assert!(m.snapshots(Outcome::Ok).get() >= 1);
    assert!(m.replays(Outcome::Incomplete).get() >= 1);

    agent.serve(&mut rng, 30).await;
    wait_until("index mirrors the engine after live events", || {
        r.status.last_seq().map(|s| s.0) == agent.engine.last_seq() && mirrors(&h, &r, &agent.engine)
    })
    .await;
    assert!(m.blocks_removed.get() > 0, "the small cache evicted");
    assert_eq!(r.status.state(), StreamState::Exact);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_router_mirrors_a_real_kvroute_agent() {
    late_router_mirrors_the_agent(EventFormat::Kvroute, EngineKind::Kvroute).await;
}

/// vLLM format: the snapshot carries tokens and the router rebuilds its hashes from them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_router_mirrors_a_real_vllm_format_agent() {
    late_router_mirrors_the_agent(EventFormat::Vllm, EngineKind::Vllm).await;
}
