//! Simulator tests with stand-in routing policies (the router's own are exercised in
//! `tests/it`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_router::policy::{Decision, PolicyKind};

use super::*;
use crate::workload::Request;
use crate::workload::synth::{BatchParams, ChatParams, RagParams, Workload};

/// Replica `i mod N` for the i-th request.
#[derive(Default)]
struct RoundRobin(AtomicUsize);

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }
    fn choose(&self, _: &RequestView, replicas: &[ReplicaView]) -> Decision {
        let i = self.0.fetch_add(1, Ordering::Relaxed) % replicas.len();
        Decision { chosen: Some(i), costs: vec![0.0; replicas.len()] }
    }
}

/// Always the first replica, recording every view it is shown.
#[derive(Default)]
struct Recorder(Mutex<Vec<(RequestView, Vec<ReplicaView>)>>);

impl Policy for Recorder {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }
    fn choose(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision {
        self.0.lock().unwrap().push((*request, replicas.to_vec()));
        Decision { chosen: Some(0), costs: vec![0.0; replicas.len()] }
    }
}

fn req(ms: u64, input_len: usize, hash_ids: Vec<u64>) -> Request {
    Request { arrival: Duration::from_millis(ms), input_len, output_len: 4, hash_ids, segments: Vec::new() }
}

fn config(replicas: usize, capacity_blocks: usize, eviction: cache::PolicyKind) -> SimConfig {
    SimConfig { replicas, capacity_blocks, eviction, ..SimConfig::default() }
}

fn workloads() -> Vec<Trace> {
    vec![
        Workload::Chat(ChatParams { conversations: 40, ..ChatParams::default() }).generate().unwrap(),
        Workload::Rag(RagParams { requests: 200, ..RagParams::default() }).generate().unwrap(),
        Workload::Batch(BatchParams { jobs: 3, requests_per_job: 40, ..BatchParams::default() })
            .generate()
            .unwrap(),
    ]
}

const EVICTIONS: [cache::PolicyKind; 3] =
    [cache::PolicyKind::Lru, cache::PolicyKind::Lfu, cache::PolicyKind::S3fifo];

#[test]
fn one_replica_is_the_seed000_replay_and_its_own_pooled_bound() {
    for trace in workloads() {
        for eviction in EVICTIONS {
            let cfg = config(1, 64, eviction);
            let report = simulate_with(&trace, &cfg, &RoundRobin::default()).unwrap();
            let mut reference = BlockCache::new(&CacheConfig {
                capacity_blocks: 64,
                block_size: 512,
                policy: eviction,
                s3fifo: S3FifoParams::default(),
            })
            .unwrap();
            for (r, got) in trace.requests.iter().zip(&report.per_request) {
                let blocks: Vec<BlockHash> = r.hash_ids.iter().map(|&h| BlockHash(h)).collect();
                let want = reference.access_request(&blocks, r.input_len).unwrap();
                assert_eq!(got.hit_tokens, want.hit_tokens as u64);
            }
            assert_eq!(report.final_cache_blocks, reference.len());
            assert_eq!(report.pooled.total_hit_tokens, report.total_hit_tokens);
            assert_eq!(report.pct_of_pooled.unwrap_or(100.0), 100.0);
            assert_eq!(report.load_skew, 1.0);
            check_seed000_sanity(&trace, &report, 64);
        }
    }
}

/// Seed 000's sanity rules, plus the per-replica sums.
fn check_seed000_sanity(trace: &Trace, report: &SimReport, capacity: usize) {
    assert_eq!(report.overall_hit_rate, report.total_hit_tokens as f64 / report.total_prompt_tokens as f64);
    assert_eq!(report.per_request.iter().map(|r| r.hit_tokens).sum::<u64>(), report.total_hit_tokens);
    assert_eq!(report.per_request.iter().map(|r| r.prompt_tokens).sum::<u64>(), report.total_prompt_tokens);
    assert_eq!(report.total_prompt_tokens, trace.prompt_tokens());
    assert_eq!(report.per_replica.iter().map(|r| r.hit_tokens).sum::<u64>(), report.total_hit_tokens);
    assert_eq!(report.per_replica.iter().map(|r| r.prompt_tokens).sum::<u64>(), report.total_prompt_tokens);
    for r in &report.per_replica {
        assert!(r.final_cache_blocks <= capacity);
    }
    let mut seen = std::collections::HashSet::new();
    for (r, got) in trace.requests.iter().zip(&report.per_request) {
        assert!(got.hit_tokens <= got.prompt_tokens);
        if !seen.contains(&r.hash_ids[0]) {
            assert_eq!(got.hit_tokens, 0, "a first block never seen cannot hit");
        }
        seen.extend(r.hash_ids.iter().copied());
    }
}

#[test]
fn sharded_replay_keeps_the_sanity_rules_and_the_pooled_bound_is_one_big_cache() {
    for trace in workloads() {
        for eviction in EVICTIONS {
            let report = simulate_with(&trace, &config(4, 32, eviction), &RoundRobin::default()).unwrap();
            check_seed000_sanity(&trace, &report, 32);
            let big = simulate_with(&trace, &config(1, 128, eviction), &RoundRobin::default()).unwrap();
            assert_eq!(report.pooled.total_hit_tokens, big.total_hit_tokens);
            assert_eq!(report.pooled.final_cache_blocks, big.final_cache_blocks);
            assert_eq!(report.pooled.capacity_blocks, 128);
            // Round robin spreads requests evenly.
            for r in &report.per_replica {
                assert!(r.requests.abs_diff(trace.len() as u64 / 4) <= 1);
            }
            assert!(report.load_skew >= 1.0);
        }
    }
}

#[test]
fn views_carry_each_replicas_resident_prefix_and_engine_load() {
    // Two replicas, everything routed to replica 0.
    let trace = Trace::new(vec![
        req(0, 1500, vec![1, 2, 3]),
        req(0, 1100, vec![1, 2, 4]),
        req(10_000, 600, vec![1, 5]),
        req(10_000, 600, vec![9, 5]),
    ]);
    let policy = Recorder::default();
    simulate_with(&trace, &config(2, 16, cache::PolicyKind::Lru), &policy).unwrap();
    let seen = policy.0.into_inner().unwrap();
    let overlaps: Vec<Vec<usize>> =
        seen.iter().map(|(_, views)| views.iter().map(|v| v.overlap_blocks).collect()).collect();
    assert_eq!(overlaps, [vec![0, 0], vec![2, 0], vec![1, 0], vec![0, 0]]);
    // The key is the last id, the partial block's (as the router's takes in the tail).
    assert_eq!(seen[0].0, RequestView { prompt_tokens: 1500, blocks: 3, block_size: 512, key: 3 });
    // The second request arrives with the first queued on replica 0, nothing prefilled yet.
    let load = seen[1].1[0].load;
    assert_eq!((load.in_flight, load.pending_prefill_tokens, load.recent_prompt_tokens), (1, 1500, 1500));
    assert_eq!(seen[1].1[1].load, Load::default());
    // Ten seconds later both have finished; their prompt tokens are remembered, decayed as the
    // router's `Upstream` decays them.
    let mut recent = RecentTokens::default();
    recent.add(Duration::ZERO, 2600);
    let ten_s = Duration::from_secs(10);
    assert_eq!(seen[2].1[0].load, Load { recent_prompt_tokens: recent.tokens(ten_s), ..Load::default() });
    assert!((2390..2395).contains(&recent.tokens(ten_s)));
    // The third is still running when the fourth arrives at the same instant.
    assert_eq!(seen[3].1[0].load.in_flight, 1);
    assert_eq!(seen[3].1[0].load.pending_prefill_tokens, 600 - 512);
}

#[test]
fn latency_reflects_hits_and_speedup_raises_load() {
    let trace = Workload::Chat(ChatParams { conversations: 60, ..ChatParams::default() }).generate().unwrap();
    let cfg = config(2, 256, cache::PolicyKind::Lru);
    let base = simulate_with(&trace, &cfg, &RoundRobin::default()).unwrap();
    let lat = base.latency.unwrap();
    assert!(lat.ttft_p50_ms > 0.0 && lat.ttft_p50_ms <= lat.ttft_p99_ms);
    assert!(lat.e2e_p99_ms >= lat.ttft_p99_ms);
    assert!(base.per_request.iter().all(|r| r.timing.is_some()));
    let fast =
        simulate_with(&trace, &SimConfig { speedup: 20.0, ..cfg.clone() }, &RoundRobin::default()).unwrap();
    // Same routing, same hits; only time is compressed, so queues and TTFT grow.
    assert_eq!(fast.total_hit_tokens, base.total_hit_tokens);
    assert!(fast.latency.unwrap().ttft_p99_ms > lat.ttft_p99_ms);
    let none = simulate_with(&trace, &SimConfig { engine: None, ..cfg }, &RoundRobin::default()).unwrap();
    assert_eq!(none.latency, None);
    assert_eq!(none.total_hit_tokens, base.total_hit_tokens);
}

#[test]
fn token_blocks_match_hash_ids_on_whole_blocks_and_rechunk_at_smaller_sizes() {
    // Whole-block prompts: chained token blocks and hash ids describe the same sharing.
    let trace = Trace::new(vec![
        req(0, 1024, vec![1, 2]),
        req(1, 1536, vec![1, 2, 3]),
        req(2, 1024, vec![1, 4]),
        req(3, 512, vec![1]),
    ]);
    let ids = simulate_with(&trace, &config(1, 64, cache::PolicyKind::Lru), &RoundRobin::default()).unwrap();
    let tokens = simulate_with(
        &trace,
        &SimConfig { blocks: BlockIdentity::Tokens, ..config(1, 64, cache::PolicyKind::Lru) },
        &RoundRobin::default(),
    )
    .unwrap();
    let hits = |r: &SimReport| r.per_request.iter().map(|r| r.hit_tokens).collect::<Vec<_>>();
    assert_eq!(hits(&ids), [0, 1024, 512, 512]);
    assert_eq!(hits(&tokens), hits(&ids));
    assert_eq!(tokens.setup.blocks, BlockIdentity::Tokens);
    // Block size 128 (`Auto` picks tokens): four blocks per content block.
    let small = SimConfig { block_size: 128, ..config(1, 256, cache::PolicyKind::Lru) };
    let rechunked = simulate_with(&trace, &small, &RoundRobin::default()).unwrap();
    assert_eq!(rechunked.setup.blocks, BlockIdentity::Tokens);
    assert_eq!(hits(&rechunked), [0, 1024, 512, 512]);
    // A partial tail: hash ids count its block, tokens never cache it.
    let tail = Trace::new(vec![req(0, 700, vec![1, 7]), req(1, 700, vec![1, 7])]);
    let by_ids = simulate_with(&tail, &config(1, 8, cache::PolicyKind::Lru), &RoundRobin::default()).unwrap();
    assert_eq!(hits(&by_ids), [0, 700]);
    let by_tokens = simulate_with(
        &tail,
        &SimConfig { blocks: BlockIdentity::Tokens, ..config(1, 8, cache::PolicyKind::Lru) },
        &RoundRobin::default(),
    )
    .unwrap();
    assert_eq!(hits(&by_tokens), [0, 512]);
}

/// Requests whose key is `hot` to replica 0, everything else to replica 1.
struct Partition {
    hot: u64,
}

impl Policy for Partition {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }
    fn choose(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision {
        Decision { chosen: Some(usize::from(request.key != self.hot)), costs: vec![0.0; replicas.len()] }
    }
}

/// The pooled cache is a reference, not an upper bound: two LRU caches of one block, one
/// kept for a hot prompt and one taking a scan, keep the hot prompt that one shared LRU cache
/// of two blocks loses to the scan.
#[test]
fn separate_caches_can_beat_the_pooled_reference() {
    let trace = Trace::new(vec![
        req(0, 512, vec![1]),
        req(1, 512, vec![1]),
        req(2, 512, vec![2]),
        req(3, 512, vec![3]),
        req(4, 512, vec![1]),
    ]);
    let report = simulate_with(&trace, &config(2, 1, cache::PolicyKind::Lru), &Partition { hot: 1 }).unwrap();
    assert_eq!((report.total_hit_tokens, report.pooled.total_hit_tokens), (1024, 512));
    assert_eq!(report.pct_of_pooled, Some(200.0));
}

#[test]
fn bad_configurations_are_errors() {
    let trace = Trace::new(vec![req(0, 10, vec![1])]);
    let rr = RoundRobin::default();
    assert!(matches!(
        simulate_with(&trace, &config(0, 8, cache::PolicyKind::Lru), &rr),
        Err(SimError::NoReplicas)
    ));
    let slow = SimConfig { speedup: 0.0, ..config(1, 8, cache::PolicyKind::Lru) };
    assert!(matches!(simulate_with(&trace, &slow, &rr), Err(SimError::Speedup(_))));
    // So slow that the arrivals overflow.
    let late = Trace::new(vec![req(1_000_000, 10, vec![1])]);
    let glacial = SimConfig { speedup: 1e-20, ..config(1, 8, cache::PolicyKind::Lru) };
    assert!(matches!(simulate_with(&late, &glacial, &rr), Err(SimError::Speedup(_))));
    // Arrivals that fit a Duration but leave the engine model's clock little room to run on
    // (near Duration::MAX it panicked adding a step); an output of billions of steps.
    let ages = Trace::new(vec![req(1 << 62, 10, vec![1])]);
    assert!(matches!(
        simulate_with(&ages, &config(1, 8, cache::PolicyKind::Lru), &rr),
        Err(SimError::TooLate(_))
    ));
    let endless = Trace::new(vec![Request { output_len: u32::MAX, ..req(0, 10, vec![1]) }]);
    let refused = simulate_with(&endless, &config(1, 8, cache::PolicyKind::Lru), &rr).unwrap_err();
    assert!(refused.to_string().contains("4294967295 output tokens"), "{refused}");
    let cache_only = SimConfig { engine: None, ..config(1, 8, cache::PolicyKind::Lru) };
    assert!(simulate_with(&endless, &cache_only, &rr).is_ok(), "without the engine model no step is run");
    assert!(matches!(
        simulate_with(&trace, &config(1, 0, cache::PolicyKind::Lru), &rr),
        Err(SimError::Cache(_))
    ));
    // Regression: hash ids are 512-token blocks; at block size 16 each counted as 16 tokens.
    let small_ids =
        SimConfig { block_size: 16, blocks: BlockIdentity::HashIds, ..config(1, 8, cache::PolicyKind::Lru) };
    assert!(matches!(simulate_with(&trace, &small_ids, &rr), Err(SimError::HashIdsBlockSize(16))));
    // S3FIFO needs a non-empty small queue.
    assert!(matches!(
        simulate_with(&trace, &config(1, 2, cache::PolicyKind::S3fifo), &rr),
        Err(SimError::Cache(_))
    ));
}

#[test]
fn every_problem_is_reported_at_once() {
    let trace = Trace::new(vec![Request { output_len: u32::MAX, ..req(0, 10, vec![1]) }]);
    let engine = EngineModel { max_num_seqs: 0, max_num_batched_tokens: 8, ..EngineModel::default() };
    let bad = SimConfig {
        speedup: f64::NAN,
        block_size: 16,
        blocks: BlockIdentity::HashIds,
        engine: Some(engine),
        ..config(0, 0, cache::PolicyKind::Lru)
    };
    let Err(SimError::Several(problems)) = check(&trace, &bad) else { panic!("several problems expected") };
    let shown = SimError::Several(problems).to_string();
    for expected in [
        "7 problems",
        "at least one replica",
        "speed-up NaN",
        "block size 16",
        "4294967295 output tokens",
        "--max-num-seqs must be at least 1",
        "--max-num-batched-tokens (8) must be at least the block size (16)",
        "invalid cache configuration: ",
    ] {
        assert!(shown.contains(expected), "{expected:?} missing from {shown}");
    }
    // One problem alone is itself, as before.
    let plain = Trace::new(vec![req(0, 10, vec![1])]);
    assert!(matches!(check(&plain, &config(0, 8, cache::PolicyKind::Lru)), Err(SimError::NoReplicas)));
    // So many replicas that their caches would not fit in memory: refused, not an abort.
    let huge = config(2_000_000_000, 1, cache::PolicyKind::Lru);
    assert!(matches!(check(&plain, &huge), Err(SimError::TooManyReplicas(2_000_000_000))));
    assert!(check(&plain, &config(MAX_REPLICAS, 1, cache::PolicyKind::Lru)).is_ok());
}

#[test]
fn empty_trace_reports_zeros() {
    let report =
        simulate_with(&Trace::default(), &config(2, 8, cache::PolicyKind::Lru), &RoundRobin::default())
            .unwrap();
    assert_eq!((report.requests, report.total_prompt_tokens, report.overall_hit_rate), (0, 0, 0.0));
    assert_eq!(report.load_skew, 1.0);
    assert_eq!(report.pct_of_pooled, None);
    assert_eq!(report.latency, None);
}

/// Without events the router sees its LRU prediction, the hits are the true cache's: under
/// LFU, a block the prediction holds can be gone (a block used twice outlives a newer one).
#[test]
fn without_events_the_router_routes_on_its_lru_prediction() {
    let trace = Trace::new(vec![
        req(0, 512, vec![1]),
        req(1, 512, vec![1]),
        req(2, 512, vec![2]),
        req(3, 512, vec![3]),
        req(4, 512, vec![2]),
    ]);
    let run = |predicted| {
        let cfg = SimConfig { predicted, ..config(1, 2, cache::PolicyKind::Lfu) };
        simulate_with(&trace, &cfg, &Recorder::default()).unwrap()
    };
    let (exact, predicted) = (run(false), run(true));
    let last = |report: &SimReport| {
        let r = report.per_request.last().unwrap();
        (r.overlap_blocks, r.hit_tokens)
    };
    assert_eq!(last(&exact), (0, 0), "LFU evicted block 2 (used once) for block 3");
    assert_eq!(last(&predicted), (1, 0), "an LRU still holds it: predicted, not hit");
    assert_eq!(exact.overall_hit_rate, predicted.overall_hit_rate, "one replica: the same caches");
    // Under LRU the prediction is the cache.
    let lru = |predicted| {
        let cfg = SimConfig { predicted, ..config(1, 2, cache::PolicyKind::Lru) };
        simulate_with(&trace, &cfg, &Recorder::default()).unwrap()
    };
    assert_eq!(lru(true).per_request, lru(false).per_request);
}
