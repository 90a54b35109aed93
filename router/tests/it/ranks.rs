//! A data-parallel replica (one API server, an engine and an event stream per rank): the
//! router sends a request to the rank that holds its prefix, named in `X-data-parallel-rank`
//! as vLLM and SGLang read it, and predicts what that rank holds. Real ZeroMQ streams (one
//! per rank, on adjacent ports) and a real HTTP replica that records what it is sent; then a
//! real agent with two ranks.

use std::time::Duration;

use kvroute_proto::BlockHash;
use kvroute_proto::loopback_port::unused;
use kvroute_proto::pb::{self, router_admin_client::RouterAdminClient};
use serde_json::json;

use crate::fleet::{FLEET_MODEL, Fleet, Http, agent_config, first_data};
use crate::headers::recording_replica;

use crate::support::{
    BLOCK, FakePublisher, MODEL, WAIT, batch, chain, cleared_event, rank_publishers, removed_event,
    store_chain, wait_until,
};
use kvroute_replica_agent::publisher::EventFormat;

const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";

/// `blocks` blocks of token ids of their own (within the builtin vocabulary).
fn tokens(seed: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * BLOCK).map(|i| 100 + seed * 1000 + i).collect()
}

/// A router (as `router` sets it) in front of one real agent of two data-parallel ranks (as
/// `agent` sets it, from the fleet tests' agent config).
async fn two_ranks(
    agent: impl Fn(kvroute_replica_agent::Config) -> kvroute_replica_agent::Config,
    router: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config,
) -> Fleet {
    let config =
        |name: &str| agent(kvroute_replica_agent::Config { data_parallel_size: 2, ..agent_config(name) });
    Fleet::with(1, config, router).await
}

/// A router (as `config` sets it) in front of `dp`, a replica of two data-parallel ranks whose
/// rank 0 publishes on `events`, and whose HTTP API records what it is sent.
async fn recorded_ranks(
    events: &str,
    config: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config,
) -> (
    kvroute_router::RunningRouter,
    tokio::sync::mpsc::UnboundedReceiver<crate::headers::Seen>,
    tokio_util::sync::CancellationToken,
) {
    let (replica, seen) = recording_replica(ANSWER).await;
    let spec = format!("name=dp,http=http://{replica},events={events},engine=kvroute,dp-size=2");
    let config = config(kvroute_router::Config {
        model: MODEL.into(),
        block_size: BLOCK,
        replicas: vec![spec.parse().unwrap()],
        ..kvroute_router::Config::loopback(Vec::new())
    });
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    (router, seen, shutdown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_goes_to_the_rank_that_holds_its_prefix() {
    let (mut rank0, mut rank1) = rank_publishers().await;
    let (router, mut seen, shutdown) = recorded_ranks(&rank0.events, |c| c).await;
    let ranks = router.fleet().member("dp").unwrap().replica.ranks.get().cloned().expect("a rank index");

    // Rank 1 holds `a` (3 blocks), rank 0 holds `b` (2 blocks).
    let (a, b) = (tokens(1, 3), tokens(2, 2));
    let held =
        |blocks: &[BlockHash]| ranks.views(blocks).iter().map(|v| v.overlap_blocks).collect::<Vec<_>>();
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut seq = 0;
    // One batch on each rank's stream, with the same seq (each stream's seqs follow on).
    let mut publish = async |on_rank0: Vec<pb::Event>, on_rank1: Vec<pb::Event>| {
        let payload = |events| EventFormat::Kvroute.encode_payload(&batch(0, seq, events));
        rank0.send(seq, payload(on_rank0)).await;
        rank1.send(seq, payload(on_rank1)).await;
        seq += 1;
    };
    // Publishing again covers a batch lost to the subscription race.
    while held(&chain(&a)) != [0, 3] || held(&chain(&b)) != [2, 0] {
        assert!(tokio::time::Instant::now() < deadline, "both ranks' blocks indexed");
        publish(vec![store_chain(&b, 0)], vec![store_chain(&a, 0)]).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until("the replica synced", || router.fleet().ready()).await;

    // `Explain` shows the rank a request would go to, and that rank's overlap and load.
    ranks.add_prefill(1, 7);
    let mut admin = RouterAdminClient::connect(router.admin_url()).await.unwrap();
    let body = |prompt: &[u32]| json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    let explained = admin
        .explain(pb::ExplainRequest {
            path: "/v1/completions".into(),
            body: body(&a).to_string().into_bytes(),
        })
        .await
        .unwrap()
        .into_inner();
    let candidate = &explained.candidates[0];
    assert_eq!((candidate.dp_rank, candidate.overlap_blocks), (Some(1), 3));
    let rank_load = candidate.dp_rank_load.expect("the rank's load");
    assert_eq!((rank_load.pending_prefill_tokens, candidate.pending_prefill_tokens), (7, 0), "{candidate:?}");
    ranks.sub_prefill(1, 7);
    // `ListReplicas` shows each rank: its stream, its blocks.
    let listed = admin.list_replicas(pb::ListReplicasRequest {}).await.unwrap().into_inner();
    let ranks_listed: Vec<(u32, u64)> = listed.replicas[0].ranks.iter().map(|r| (r.rank, r.blocks)).collect();
    assert_eq!(ranks_listed, [(0, 2), (1, 3)]);
    assert!(listed.replicas[0].ranks.iter().all(|r| r.state == pb::StreamState::Exact as i32), "{listed:?}");

    let http = Http::new();
    let mut send = async |prompt: Vec<u32>| {
        let reply = http.post(&format!("{}/v1/completions", router.url()), &body(&prompt)).await;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        let predicted: u64 = reply.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
        let request = tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the request");
        let rank = request.values("x-data-parallel-rank").first().map(|r| r.to_string());
        assert_eq!(reply.header("x-kvroute-rank").map(str::to_owned), rank, "the client sees the rank");
        (rank, predicted)
    };
    let with_tail = |mut prompt: Vec<u32>| {
        prompt.extend([7, 8, 9]);
        prompt
    };
    assert_eq!(send(with_tail(a.clone())).await, (Some("1".into()), 3 * u64::from(BLOCK)));
    assert_eq!(send(with_tail(b.clone())).await, (Some("0".into()), 2 * u64::from(BLOCK)));
    // A new prefix goes to a rank too, credited there: the same prompt right behind it
    // follows it, and is predicted to hit (the rank's events have not stored it yet).
    let (rank, predicted) = send(tokens(3, 2)).await;
    assert!(rank.is_some() && predicted == 0, "{rank:?} {predicted}");
    assert_eq!(send(tokens(3, 2)).await, (rank, 2 * u64::from(BLOCK)));

    // A prefix split between the ranks: their union holds 4 blocks, rank 0 the first 2, rank
    // 1 the last 2 (whose first block it lacks). Only rank 0's 2 can be hit.
    let c = tokens(4, 4);
    publish(vec![store_chain(&c[..2 * BLOCK as usize], 0)], vec![store_chain(&c, 2)]).await;
    let id = router.fleet().member("dp").unwrap().replica.id;
    let union = || router.state.decider.index.lookup(&chain(&c)).get(id);
    // Both ranks' batches applied: rank 1's shows only in the union.
    wait_until("the split prefix indexed", || held(&chain(&c)) == [2, 0] && union() == 4).await;
    assert_eq!(send(with_tail(c)).await, (Some("0".into()), 2 * u64::from(BLOCK)));

    // Removals and clears reach the rank index: rank 1 evicts `a`'s last block, rank 0 drops
    // everything (its credits of `b` run out with their TTL). The stores published again for
    // the subscription race may have reached rank 1 more than once, each a reference (as an
    // engine's repeated store is): the removal goes as often, until the block is gone.
    publish(vec![cleared_event()], vec![removed_event(&chain(&a)[2..])]).await;
    while held(&chain(&a)) != [0, 2] {
        assert!(tokio::time::Instant::now() < deadline + WAIT, "the removal applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
        if held(&chain(&a)) != [0, 2] {
            publish(vec![], vec![removed_event(&chain(&a)[2..])]).await;
        }
    }
    wait_until("the clear applied", || held(&chain(&b)) == [0, 0]).await;
    shutdown.cancel();
}

/// A real agent with two ranks behind the router: each prompt is served by one rank, and
/// its repeat by the same rank, which finds it cached as the router predicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_data_parallel_agent_hits_where_the_router_predicts() {
    let fleet = two_ranks(|c| c, |c| c).await;
    let send = async |prompt: &str| {
        let body = json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 1});
        let reply = fleet.http.post(&fleet.url("/v1/completions"), &body).await;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        let predicted: u64 = reply.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
        let rank = reply.header("x-kvroute-rank").expect("a rank").to_owned();
        (rank, predicted, reply.cached_tokens())
    };
    let mut used = std::collections::BTreeSet::new();
    for i in 0..8 {
        let prompt = format!("prompt {i} of a conversation with some words in it to fill blocks");
        let (rank, predicted, cached) = send(&prompt).await;
        assert_eq!((predicted, cached), (0, 0), "a new prompt");
        let (again, predicted, cached) = send(&prompt).await;
        assert_eq!(again, rank, "the repeat goes to the rank that holds it");
        assert!(cached > 0 && predicted == cached, "prompt {i}: predicted {predicted}, cached {cached}");
        used.insert(rank);
    }
    assert_eq!(used.len(), 2, "new prompts are spread over the ranks: {used:?}");
    // The rank indexes are in the index's memory figures.
    let metrics = fleet.http.get(&fleet.url("/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let gauge = |name: &str| -> u64 {
        let line = text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' '));
        line.unwrap_or_else(|| panic!("no {name}")).trim().parse().unwrap()
    };
    assert!(gauge("kvroute_ingest_rank_index_entries") >= 8, "each prompt's blocks on its rank");
    assert!(gauge("kvroute_ingest_rank_index_memory_bytes") > 0);
    // The replica's ranks leave the rank index (shared by every data-parallel replica) with it.
    let ranks = fleet.router.fleet().member("agent-0").unwrap().replica.ranks.get().cloned().expect("ranks");
    fleet.router.fleet().remove("agent-0").await.expect("removed");
    assert_eq!(ranks.index.stats().entries, 0, "nothing of its ranks is left");
    fleet.shutdown.cancel();
}

/// Work other clients put on a rank (vLLM reports it by engine) steers new prefixes to the
/// other rank: the rank's load is not this router's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn others_work_on_a_rank_sends_new_prefixes_to_the_other() {
    // Real time: the other client's streams run 2000 steps of at least 6 ms.
    let fleet = two_ranks(|c| kvroute_replica_agent::Config { time_scale: 1.0, ..c }, |c| c).await;
    let agent = fleet.agent(0).http_url();
    let long =
        json!({"model": FLEET_MODEL, "prompt": "another client's", "max_tokens": 2000, "stream": true});
    let mut streams = Vec::new();
    for _ in 0..2 {
        let response = fleet
            .http
            .stream_with(&format!("{agent}/v1/completions"), &long, &[("x-data-parallel-rank", "0")])
            .await;
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        first_data(&mut body).await;
        streams.push(body);
    }
    let ranks = fleet.router.fleet().member("agent-0").unwrap().replica.ranks.get().cloned().expect("ranks");
    let others = || ranks.views(&[]).iter().map(|v| v.others).collect::<Vec<_>>();
    wait_until("a health check saw rank 0's work", || others() == [2, 0]).await;

    for i in 0..6 {
        let body = json!({"model": FLEET_MODEL, "prompt": format!("new prompt {i}"), "max_tokens": 1});
        let reply = fleet.http.post(&fleet.url("/v1/completions"), &body).await;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        assert_eq!(reply.header("x-kvroute-rank"), Some("1"), "prompt {i} goes to the idle rank");
    }
    drop(streams);
    fleet.shutdown.cancel();
}

/// A stored Responses answer's continuation goes to the rank that made it (the store is the
/// API server's, every rank's; the conversation's blocks are that rank's), and finds its
/// conversation cached there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_goes_to_the_rank_that_made_its_response() {
    let fleet = two_ranks(|c| kvroute_replica_agent::Config { responses_store: true, ..c }, |c| c).await;
    let url = fleet.url("/v1/responses");
    let mut homes = std::collections::BTreeSet::new();
    for c in 0..6 {
        let instructions = (0..30).map(|i| format!("sys{c}w{i}")).collect::<Vec<_>>().join(" ");
        let body = json!({"model": FLEET_MODEL, "instructions": instructions, "input": "start",
            "max_output_tokens": 3});
        let first = fleet.http.post(&url, &body).await;
        assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
        let id = first.json()["id"].as_str().unwrap().to_owned();
        let rank = first.header("x-kvroute-rank").expect("a rank").to_owned();
        let next = json!({"model": FLEET_MODEL, "previous_response_id": id, "input": "go on",
            "instructions": instructions, "max_output_tokens": 2});
        let next = fleet.http.post(&url, &next).await;
        assert_eq!(next.status, 200, "{}", String::from_utf8_lossy(&next.body));
        assert_eq!(
            next.header("x-kvroute-rank"),
            Some(rank.as_str()),
            "conversation {c} goes on on its rank"
        );
        let cached = next.json()["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert!(cached > 30, "conversation {c}: the conversation so far is cached there ({cached})");
        homes.insert(rank);
    }
    assert_eq!(homes.len(), 2, "conversations on both ranks: {homes:?}");
    fleet.shutdown.cancel();
}

/// A prefix every request shares (a system prompt) does not draw a burst of them all to the
/// rank that cached it first: ranks are weighed on their load (in flight, pending prefill,
/// recent tokens) as replicas are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_does_not_send_a_burst_to_one_rank() {
    let fleet = two_ranks(|c| kvroute_replica_agent::Config { time_scale: 20.0, ..c }, |c| c).await;
    let system = (0..24).map(|i| format!("system{i}")).collect::<Vec<_>>().join(" ");
    let mut tasks = Vec::new();
    for i in 0..48 {
        let words = (0..10).map(|w| format!("q{i}w{w}")).collect::<Vec<_>>().join(" ");
        let body = json!({"model": FLEET_MODEL, "prompt": format!("{system} question {i} {words}"), "max_tokens": 16});
        let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
        tasks.push(tokio::spawn(async move { http.post(&url, &body).await }));
    }
    let mut per_rank = std::collections::BTreeMap::<String, u32>::new();
    for task in tasks {
        let reply = task.await.unwrap();
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        *per_rank.entry(reply.header("x-kvroute-rank").expect("a rank").to_owned()).or_default() += 1;
    }
    assert_eq!(per_rank.len(), 2, "both ranks served: {per_rank:?}");
    assert!(per_rank.values().all(|n| *n <= 36), "skewed: {per_rank:?}");
    fleet.shutdown.cancel();
}

/// A replica one of whose ranks has no stream is FALLBACK, but its other ranks are still
/// chosen by what they hold, and the rank without a stream is not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_without_a_stream_is_passed_over_and_the_others_still_chosen() {
    // Rank 1's port is taken from the ports handed out, and never bound: its stream never
    // connects.
    let mut rank0 = loop {
        let (port, next) = (unused().unwrap(), unused().unwrap());
        if next == port + 1
            && let Some(rank0) = FakePublisher::try_bind(&format!("tcp://127.0.0.1:{port}")).await
        {
            break rank0;
        }
    };
    let (router, mut seen, shutdown) =
        recorded_ranks(&rank0.events, |c| kvroute_router::Config { events_fallback_ms: 300, ..c }).await;
    let member = router.fleet().member("dp").unwrap();
    let ranks = member.replica.ranks.get().cloned().expect("a rank index");
    let a = tokens(5, 3);
    let mut seq = 0;
    while ranks.views(&chain(&a))[0].overlap_blocks != 3 {
        rank0.send(seq, EventFormat::Kvroute.encode_payload(&batch(0, seq, vec![store_chain(&a, 0)]))).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until("rank 1 is FALLBACK", || {
        member.replica.status.rank_state(1) == Some(kvroute_router::replicas::StreamState::Fallback)
    })
    .await;
    let http = Http::new();
    for prompt in [a.clone(), tokens(6, 2), tokens(7, 2)] {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
        let reply = http.post(&format!("{}/v1/completions", router.url()), &body).await;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        let request = tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the request");
        assert_eq!(request.values("x-data-parallel-rank"), ["0"], "the followed rank is named");
    }
    // A batch on rank 0's stream that says it is rank 1's (a dp-size or port layout that is
    // not the replica's) is counted.
    let mismatches = async || {
        let page = http.get(&format!("{}/metrics", router.url())).await;
        let text = String::from_utf8_lossy(&page.body).into_owned();
        let series = "kvroute_ingest_rank_mismatches_total{replica=\"dp\"} ";
        text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse::<u64>().ok()).unwrap_or(0)
    };
    assert_eq!(mismatches().await, 0, "rank 0's own batches");
    let misplaced = pb::EventBatch { dp_rank: 1, ..batch(0, seq, vec![]) };
    rank0.send(seq, EventFormat::Kvroute.encode_payload(&misplaced)).await;
    crate::support::wait_until_async("the mismatch counted", async || mismatches().await == 1).await;
    shutdown.cancel();
}

/// With `--no-rank-routing` (engines that ignore the header) no rank is named: the replica's
/// own balancing places each request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_rank_routing_no_rank_is_named() {
    let fleet = two_ranks(|c| c, |c| kvroute_router::Config { no_rank_routing: true, ..c }).await;
    let body = json!({"model": FLEET_MODEL, "prompt": "one prompt of a few words", "max_tokens": 1});
    let reply = fleet.http.post(&fleet.url("/v1/completions"), &body).await;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.header("x-kvroute-rank"), None);
    fleet.shutdown.cancel();
}
