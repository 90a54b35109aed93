//! Offloaded tiers end to end: two vLLM replicas (hand-made: their HTTP APIs record what they
//! are sent, their event streams are hand-written vLLM batches over real ZeroMQ) behind a
//! router, and a real agent with host memory. A prefix a replica holds in host memory, following on from what its KV cache
//! holds, draws the request as a cached prefix would; one it no longer holds, or that does
//! not follow on, does not.

use kvroute_proto::pb::{self, router_admin_client::RouterAdminClient};
use kvroute_proto::vllm::{self, VllmBatch, VllmEvent};
use kvroute_proto::{BlockHash, CacheNamespace, Seq};
use serde_json::json;

use kvroute_replica_agent::publisher::EventFormat;
use kvroute_router::index::SharedIndex;
use kvroute_router::ingest::{IngestConfig, Outcome};
use kvroute_router::replicas::{EngineKind, ReplicaSpec};

use crate::fleet::{FLEET_BLOCK, FLEET_MODEL, Fleet, Http, agent_config};
use crate::headers::recording_replica;
use crate::support::{
    BLOCK, FakePublisher, Harness, MODEL, sample, test_config, wait_until, wait_until_async,
};

const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";

/// `blocks` blocks of token ids of their own.
fn tokens(seed: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * BLOCK).map(|i| 100 + seed * 1000 + i).collect()
}

/// Engine hashes `first..first + n` (opaque ids, as vLLM's are to the router).
fn engine(first: u64, n: usize) -> Vec<BlockHash> {
    (first..first + n as u64).map(BlockHash).collect()
}

/// A store of `tokens`' blocks as `hashes`, after `parent`, in `medium`.
fn stored(hashes: &[BlockHash], parent: Option<u64>, tokens: &[u32], medium: &str) -> VllmEvent {
    VllmEvent::BlockStored(vllm::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent.map(BlockHash),
        token_ids: tokens.to_vec(),
        block_size: if tokens.is_empty() { 0 } else { BLOCK },
        medium: Some(medium.into()),
        ..Default::default()
    })
}

/// What vLLM's offloading connector announces by default: the hashes alone.
fn offloaded(hashes: &[BlockHash]) -> VllmEvent {
    stored(hashes, None, &[], "CPU")
}

fn removed(hashes: &[BlockHash], medium: &str) -> VllmEvent {
    VllmEvent::BlockRemoved(vllm::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Some(medium.into()),
        ..Default::default()
    })
}

/// A vLLM replica's event stream as the test writes it.
struct Stream {
    publisher: FakePublisher,
    replica: std::sync::Arc<kvroute_router::replicas::Replica>,
    seq: u64,
}

impl Stream {
    /// Publishes `events` as the next batch; its seq.
    async fn publish(&mut self, events: Vec<VllmEvent>) -> Seq {
        let payload = vllm::encode_payload(&VllmBatch { ts: 0.0, events, dp_rank: None });
        self.publisher.send(self.seq, payload).await;
        self.seq += 1;
        Seq(self.seq - 1)
    }

    /// Publishes `events` as the next batch, and waits until the router applied it.
    async fn send(&mut self, events: Vec<VllmEvent>) {
        let seq = self.publish(events).await;
        wait_until("the batch applied", || self.replica.status.last_seq() == Some(seq)).await;
    }

    /// Publishes empty batches until the router applies one: its subscription is in place
    /// (batches published before it reached the publisher are lost).
    async fn warm_up(&mut self) {
        wait_until_async("the publisher reached the router", async || {
            self.publish(Vec::new()).await;
            self.replica.status.last_seq().is_some()
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_in_host_memory_draws_its_requests() {
    // `c` is an SGLang replica: its events say their namespace.
    let replicas = [("a", "vllm"), ("b", "vllm"), ("c", "sglang")];
    let mut specs = Vec::new();
    let mut publishers = Vec::new();
    let mut seen = std::collections::HashMap::new();
    for (name, engine) in replicas {
        let (addr, recorded) = recording_replica(ANSWER).await;
        let publisher = FakePublisher::start(None).await;
        specs.push(format!("name={name},http=http://{addr},events={},engine={engine}", publisher.events));
        publishers.push(publisher);
        seen.insert(name.to_owned(), recorded);
    }
    let config = kvroute_router::Config {
        model: MODEL.into(),
        block_size: BLOCK,
        replicas: specs.iter().map(|s| s.parse().unwrap()).collect(),
        // Each request is decided on the tiers alone: not on a replica's share of the
        // requests so far, nor on the credits an earlier one left it.
        balance_weight: 0.0,
        credit_ttl_ms: 1,
        ..kvroute_router::Config::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    let mut streams = Vec::new();
    for ((name, _), publisher) in replicas.into_iter().zip(publishers) {
        let replica = router.fleet().member(name).unwrap().replica.clone();
        let mut stream = Stream { publisher, replica, seq: 0 };
        stream.warm_up().await;
        streams.push(stream);
    }
    let [a, b, c] = &mut streams[..] else { unreachable!() };
    let http = Http::new();
    // Sends a prompt of `blocks` full blocks and a few tokens more; the replica it went to and
    // the tokens predicted cached there.
    let mut send = async |prompt: &[u32]| {
        let prompt = [prompt, &[7, 7, 7]].concat();
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
        let reply = http.post(&format!("{}/v1/completions", router.url()), &body).await;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        let predicted: u64 = reply.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
        let to = reply.header("x-kvroute-replica").unwrap().to_owned();
        assert!(seen.get_mut(&to).unwrap().recv().await.is_some(), "the replica named was sent it");
        (to, predicted)
    };
    let block = u64::from(BLOCK);

    // p: `a` caches its first block; `b` cached it all and offloaded it (hashes only, as vLLM's
    // connector says by default), then evicted it from its KV cache.
    let p = tokens(1, 6);
    a.send(vec![stored(&engine(100, 1), None, &p[..BLOCK as usize], "GPU")]).await;
    b.send(vec![stored(&engine(200, 6), None, &p, "GPU")]).await;
    b.send(vec![offloaded(&engine(200, 6)), removed(&engine(200, 6), "GPU")]).await;
    assert_eq!(send(&p).await, ("b".into(), 6 * block), "loaded from host memory, all of it");

    // q: `a` caches three blocks; `b` two, and the four after them in host memory, announced
    // with their tokens (vLLM's self-describing events) after its cache announced them.
    let q = tokens(2, 6);
    let tail = &q[2 * BLOCK as usize..];
    a.send(vec![stored(&engine(110, 3), None, &q[..3 * BLOCK as usize], "GPU")]).await;
    b.send(vec![stored(&engine(300, 6), None, &q, "GPU")]).await;
    b.send(vec![stored(&engine(302, 4), Some(301), tail, "CPU"), removed(&engine(302, 4), "GPU")]).await;
    // `Explain` tells the two tiers apart.
    let mut admin = RouterAdminClient::connect(router.admin_url()).await.unwrap();
    let prompt = [&q[..], &[7, 7, 7]].concat();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    let request = pb::ExplainRequest { path: "/v1/completions".into(), body: body.to_string().into_bytes() };
    let explained = admin.explain(request).await.unwrap().into_inner();
    let tiers: Vec<(&str, u32, u32, u64)> = (explained.candidates.iter())
        .map(|c| (c.replica.as_str(), c.overlap_blocks, c.offloaded_blocks, c.predicted_cached_tokens))
        .collect();
    assert_eq!(tiers, [("a", 3, 0, 3 * block), ("b", 6, 4, 6 * block), ("c", 0, 0, 0)]);
    assert_eq!(send(&q).await, ("b".into(), 6 * block), "its cache, then host memory");

    // The same on SGLang (HiCache), for blocks its cache never announced: chained from their
    // parent, in the namespace the event names. (vLLM's are not: its events do not say their
    // salt or multimodal keys.)
    let q2 = tokens(5, 6);
    let tail = &q2[2 * BLOCK as usize..];
    a.send(vec![stored(&engine(140, 3), None, &q2[..3 * BLOCK as usize], "GPU")]).await;
    b.send(vec![stored(&engine(700, 2), None, &q2[..2 * BLOCK as usize], "GPU")]).await;
    b.send(vec![stored(&engine(702, 4), Some(701), tail, "CPU")]).await;
    c.send(vec![stored(&engine(600, 2), None, &q2[..2 * BLOCK as usize], "GPU")]).await;
    c.send(vec![stored(&engine(602, 4), Some(601), tail, "CPU_PINNED")]).await;
    assert_eq!(send(&q2).await, ("c".into(), 6 * block), "SGLang's host memory, chained");

    // r: offloaded, then evicted from host memory too: `a`'s one block wins.
    let r = tokens(3, 6);
    a.send(vec![stored(&engine(120, 1), None, &r[..BLOCK as usize], "GPU")]).await;
    b.send(vec![stored(&engine(400, 6), None, &r, "GPU")]).await;
    b.send(vec![offloaded(&engine(400, 6)), removed(&engine(400, 6), "GPU")]).await;
    b.send(vec![removed(&engine(400, 6), "CPU")]).await;
    assert_eq!(send(&r).await, ("a".into(), block), "nothing left in host memory");

    // s: host memory holds all but the first block, which neither tier holds: no run.
    let s = tokens(4, 6);
    a.send(vec![stored(&engine(130, 1), None, &s[..BLOCK as usize], "GPU")]).await;
    b.send(vec![stored(&engine(500, 6), None, &s, "GPU")]).await;
    b.send(vec![offloaded(&engine(501, 5)), removed(&engine(500, 6), "GPU")]).await;
    assert_eq!(send(&s).await, ("a".into(), block), "a run must follow on from the cache");

    // A cleared replica's host tier goes with its cache (vLLM does not say which it cleared).
    let metrics = async || {
        let reply = http.get(&format!("{}/metrics", router.url())).await;
        String::from_utf8_lossy(&reply.body).into_owned()
    };
    let offloaded_of_b = |text: &str| sample(text, "kvroute_ingest_replica_offloaded_blocks{replica=\"b\"}");
    // p's 6 and q's 4 blocks; s's 5 (no names lost: the cache still held them).
    assert_eq!(offloaded_of_b(&metrics().await), Some(15));
    b.send(vec![VllmEvent::AllBlocksCleared]).await;
    assert_eq!(offloaded_of_b(&metrics().await), Some(0));
    // p is `a`'s again, whose first block is all that is left of it.
    let p_again = send(&p).await;
    assert_eq!(p_again, ("a".into(), block));
    shutdown.cancel();
}

/// A real agent with host memory (`--offload-blocks`), in both event formats (vLLM's names
/// what it offloads by hash alone): a prompt pushed out of its cache and held in host memory
/// is predicted cached, and the agent reports it cached.
async fn a_real_agents_host_memory_is_followed(format: EventFormat, engine: EngineKind) {
    let agent = |name: &str| kvroute_replica_agent::Config {
        capacity_blocks: 8,
        offload_blocks: 64,
        event_format: format,
        ..agent_config(name)
    };
    let fleet = Fleet::with(1, agent, |mut c| {
        c.replicas.iter_mut().for_each(|r| r.engine = engine);
        c
    })
    .await;
    let block = FLEET_BLOCK as usize;
    let prompt =
        |seed: u32| -> Vec<u32> { (0..6 * block as u32 + 2).map(|i| 100 + seed * 1000 + i).collect() };
    let complete = async |prompt: &[u32]| {
        let body = json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 1});
        let reply = fleet.http.post(&fleet.url("/v1/completions"), &body).await;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        reply
    };
    let a = prompt(1);
    assert_eq!(complete(&a).await.cached_tokens(), 0);
    // Two more prompts of six blocks push `a` out of the 8-block cache.
    complete(&prompt(2)).await;
    complete(&prompt(3)).await;
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let body = json!({"model": FLEET_MODEL, "prompt": a, "max_tokens": 1});
    wait_until_async("`a` seen in host memory alone", async || {
        let request =
            pb::ExplainRequest { path: "/v1/completions".into(), body: body.to_string().into_bytes() };
        let explained = admin.explain(request).await.unwrap().into_inner();
        let c = &explained.candidates[0];
        (c.overlap_blocks, c.offloaded_blocks) == (6, 6)
    })
    .await;
    let again = complete(&a).await;
    let predicted: u64 = again.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
    assert_eq!((predicted, again.cached_tokens()), (6 * block as u64, 6 * block as u64));
    // Two more push `a` out again; prompt 2's blocks are in host memory alone.
    complete(&prompt(4)).await;
    complete(&prompt(5)).await;

    // A router that joins now, without the replay, learns the agent's host memory from its
    // snapshot. vLLM's hashes name only what the cache holds too (the connector's events
    // say no more). Its cap holds each tier, as the live stream's does: 8 blocks of the
    // cache and 30 of host memory are not 38 of one.
    let h = Harness::with_config(IngestConfig { snapshot_max_blocks: 32, ..test_config() });
    let agent = fleet.agent(0);
    let spec = ReplicaSpec {
        grpc_endpoint: Some(agent.grpc_url()),
        block_size: Some(FLEET_BLOCK),
        ..ReplicaSpec::new("late", &agent.events_endpoint, engine, FLEET_MODEL)
    };
    let (r, m) = h.add(spec);
    h.synced(&r).await;
    assert_eq!(m.snapshots(Outcome::Ok).get(), 1);
    let held = |index: &SharedIndex, seed: u32| {
        index.lookup(&CacheNamespace::new(FLEET_MODEL).chain(&prompt(seed), block)).get(r.id)
    };
    assert_eq!(held(&h.index, 5), 6);
    assert_eq!(held(h.ingest.host_index(), 5), 6, "host memory holds what the cache holds too");
    assert_eq!(held(&h.index, 2), 0);
    let alone = if format == EventFormat::Kvroute { 6 } else { 0 };
    assert_eq!(held(h.ingest.host_index(), 2), alone);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_kvroute_agents_host_memory_is_followed() {
    a_real_agents_host_memory_is_followed(EventFormat::Kvroute, EngineKind::Kvroute).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_vllm_format_agents_host_memory_is_followed() {
    a_real_agents_host_memory_is_followed(EventFormat::Vllm, EngineKind::Vllm).await;
}
