//! The agent's KV events and gRPC service, as a router sees them: a real ZMQ SUB and DEALER,
//! and a real gRPC client.

use std::collections::HashSet;
use std::time::Duration;

use kvroute_proto::framing::{self, ReplayReply};
use kvroute_proto::pb::{self, event, replica_agent_client::ReplicaAgentClient};
use kvroute_proto::{CacheNamespace, Seq, native};
use serde_json::json;
use zeromq::prelude::*;
use zeromq::{DealerSocket, SubSocket, ZmqMessage};

use crate::support::{Agent, MODEL, config};

/// Every batch the agent published so far, from its replay socket.
pub(crate) async fn replay_all(endpoint: &str) -> Vec<pb::EventBatch> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.unwrap();
    let req = ZmqMessage::try_from(framing::encode_replay_request(Seq(0))).unwrap();
    dealer.send(req).await.unwrap();
    let mut batches = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), dealer.recv()).await.unwrap().unwrap();
        match framing::decode_replay_reply(&msg.into_vec()).unwrap() {
            ReplayReply::Batch(m) => batches.push(native::decode_payload(m.seq, &m.payload).unwrap()),
            ReplayReply::End => return batches,
        }
    }
}

pub(crate) fn stored(batches: &[pb::EventBatch]) -> Vec<&pb::BlockStored> {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match &e.kind {
            Some(event::Kind::Stored(s)) => Some(s),
            _ => None,
        })
        .collect()
}

fn removed(batches: &[pb::EventBatch]) -> HashSet<u64> {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match &e.kind {
            Some(event::Kind::Removed(r)) => Some(r.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

#[tokio::test]
async fn a_subscriber_sees_stored_blocks_with_parent_links_then_removals() {
    let agent = Agent::with(crate::support::Config { capacity_blocks: 8, ..config() }).await;
    let mut sub = SubSocket::new();
    sub.connect(&agent.events_endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();

    let prompt = "one two three four five six seven eight nine ten eleven twelve thirteen";
    let tokens = agent.client.tokenize(&json!({"model": MODEL, "prompt": prompt})).await;
    let expected = CacheNamespace::new(MODEL).chain(&tokens, agent.config.block_size as usize);
    assert!(expected.len() >= 3, "prompt spans several blocks");
    // The subscription may not have reached the publisher yet (slow joiner), so the first
    // batch is read back from the replay socket, which keeps everything.
    let reply = agent
        .client
        .post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}))
        .await;
    assert_eq!(reply.status, 200);
    let batches = replay_all(agent.replay_endpoint.as_deref().unwrap()).await;
    let first = stored(&batches)[0];
    assert_eq!(first.parent_block_hash, None, "the prompt's first block has no parent");
    assert_eq!(first.block_hashes, expected.iter().map(|h| h.0).collect::<Vec<_>>());
    assert_eq!(first.token_ids, tokens[..expected.len() * agent.config.block_size as usize]);

    // The live stream carries the same batches to a subscriber that joined in time.
    let mut seen_live = 0;
    for i in 0..50 {
        let p = format!("unrelated prompt number {i} with enough words to fill two blocks at least");
        agent.client.post("/v1/completions", &json!({"model": MODEL, "prompt": p, "max_tokens": 1})).await;
        while let Ok(Ok(msg)) = tokio::time::timeout(Duration::from_millis(20), sub.recv()).await {
            native::decode(&msg.into_vec()).unwrap();
            seen_live += 1;
        }
        if seen_live > 0 && !removed(&replay_all(agent.replay_endpoint.as_deref().unwrap()).await).is_empty()
        {
            break;
        }
    }
    assert!(seen_live > 0, "live batches reach a subscriber");
    let batches = replay_all(agent.replay_endpoint.as_deref().unwrap()).await;
    let gone = removed(&batches);
    assert!(
        expected.iter().any(|h| gone.contains(&h.0)),
        "capacity 8: the first prompt's blocks were evicted"
    );
    // Every stored run links to a parent that was stored before it (or starts a prompt).
    let mut known = HashSet::new();
    for s in stored(&batches) {
        if let Some(p) = s.parent_block_hash {
            assert!(known.contains(&p), "parent {p:x} was stored earlier");
        }
        known.extend(s.block_hashes.iter().copied());
    }
    let seqs: Vec<u64> = batches.iter().map(|b| b.seq).collect();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>(), "replay returns every batch in order");
}

/// What the agent still runs after a shutdown (its grace) publishes its events: a request
/// waiting when the shutdown came is prefilled in the grace, and a router still following the
/// agent sees its blocks stored.
#[tokio::test]
async fn the_shutdown_graces_events_are_published() {
    let agent = Agent::with(crate::support::Config { time_scale: 1.0, max_num_seqs: 1, ..config() }).await;
    let mut sub = SubSocket::new();
    sub.connect(&agent.events_endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    // Past the slow joiner: a batch reaches the subscriber.
    for i in 0.. {
        assert!(i < 100, "no batch reached the subscriber");
        let p = format!("joining {i} with enough words to fill a block or two of tokens here");
        agent.client.post("/v1/completions", &json!({"model": MODEL, "prompt": p, "max_tokens": 1})).await;
        if tokio::time::timeout(Duration::from_millis(50), sub.recv()).await.is_ok() {
            break;
        }
    }
    let waiting = "the request that waits while another runs and is prefilled after the shutdown came";
    let tokens = agent.client.tokenize(&json!({"model": MODEL, "prompt": waiting})).await;
    let first_block = CacheNamespace::new(MODEL).chain(&tokens, agent.config.block_size as usize)[0].0;
    let m = agent.engine.metrics();
    let gauge = |g: &std::sync::atomic::AtomicU64| g.load(std::sync::atomic::Ordering::Relaxed);
    let running = json!({"model": MODEL, "prompt": "a long one", "max_tokens": 100});
    let stored_after_shutdown = async {
        // Current-thread runtime: yield until the second request waits behind the first.
        while (gauge(&m.running), gauge(&m.waiting)) != (1, 1) {
            tokio::task::yield_now().await;
        }
        let seen = async {
            loop {
                let msg = sub.recv().await.expect("the stream goes on");
                let (_, batch) = native::decode(&msg.into_vec()).unwrap();
                if stored(std::slice::from_ref(&batch)).iter().any(|s| s.block_hashes.contains(&first_block))
                {
                    return;
                }
            }
        };
        let (seen, ()) = tokio::join!(tokio::time::timeout(Duration::from_secs(30), seen), agent.stop());
        seen.expect("the waiting request's blocks were published");
    };
    let (first, second, ()) = tokio::join!(
        agent.client.post("/v1/completions", &running),
        async {
            while gauge(&m.running) == 0 {
                tokio::task::yield_now().await;
            }
            agent
                .client
                .post("/v1/completions", &json!({"model": MODEL, "prompt": waiting, "max_tokens": 1}))
                .await
        },
        stored_after_shutdown,
    );
    assert_eq!((first.status.as_u16(), second.status.as_u16()), (200, 200), "both ran in the grace");
}

#[tokio::test]
async fn grpc_snapshot_equals_the_resident_blocks_and_info_describes_the_agent() {
    let agent = Agent::with(crate::support::Config { capacity_blocks: 16, ..config() }).await;
    for i in 0..12 {
        let p = format!("prompt {i} shares nothing with the others but is long enough for blocks");
        agent.client.post("/v1/completions", &json!({"model": MODEL, "prompt": p, "max_tokens": 1})).await;
    }
    let mut client = ReplicaAgentClient::connect(agent.grpc_url.clone()).await.unwrap();
    let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.model, MODEL);
    assert_eq!(info.block_size, agent.config.block_size);
    assert_eq!(info.capacity_blocks, 16);
    assert_eq!(info.endpoints.unwrap().events, agent.events_endpoint);

    let mut stream = client
        .snapshot(pb::SnapshotRequest { include_tokens: true, chunk_blocks: 5 })
        .await
        .unwrap()
        .into_inner();
    let mut blocks = Vec::new();
    let mut chunks = 0;
    while let Some(chunk) = stream.message().await.unwrap() {
        assert_eq!(chunk.chunk, chunks);
        chunks += 1;
        assert!(chunk.blocks.len() <= 5);
        blocks.extend(chunk.blocks);
        if chunk.last {
            break;
        }
    }
    let snapshot: HashSet<u64> = blocks.iter().map(|b| b.hash).collect();
    let resident: HashSet<u64> = agent.engine.resident().into_iter().map(|h| h.0).collect();
    assert_eq!(snapshot, resident);
    assert_eq!(snapshot.len(), 16);
    assert!(chunks >= 4);
    // Parent before child, and each block's tokens hash to it under its parent.
    let mut seen = HashSet::new();
    for b in &blocks {
        let parent =
            b.parent.map(kvroute_proto::BlockHash).unwrap_or_else(|| CacheNamespace::new(MODEL).root());
        assert_eq!(kvroute_proto::block_hash(parent, &b.token_ids).0, b.hash);
        if let Some(p) = b.parent {
            assert!(seen.contains(&p) || !resident.contains(&p));
        }
        seen.insert(b.hash);
    }
    let stats = client.stats(pb::StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.resident_blocks, 16);
    assert_eq!(stats.requests_served, 12);
}
