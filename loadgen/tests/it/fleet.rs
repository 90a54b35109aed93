//! N > 1 with the router's own policies (`kvroute_router::policy::build`): the pooled reference,
//! and cache-aware routing against round robin.

use kvroute_loadgen::sim::{SimConfig, simulate};
use kvroute_loadgen::workload::synth::{ChatParams, Workload};
use kvroute_replica_agent::cache::PolicyKind as Eviction;
use kvroute_router::policy::PolicyKind;

use crate::support::read_shared_trace;

fn fleet(replicas: usize, capacity_blocks: usize, routing: PolicyKind) -> SimConfig {
    SimConfig { replicas, capacity_blocks, routing, eviction: Eviction::Lru, ..SimConfig::default() }
}

#[test]
fn every_router_policy_runs_and_cache_aware_beats_round_robin_on_chat() {
    let trace =
        Workload::Chat(ChatParams { conversations: 150, ..ChatParams::default() }).generate().unwrap();
    let mut pooled = None;
    for routing in PolicyKind::ALL {
        let report = simulate(&trace, &fleet(4, 256, routing)).unwrap();
        assert_eq!(report.setup.routing, routing);
        assert_eq!(report.requests, trace.len());
        assert!(report.load_skew >= 1.0);
        // The pooled reference does not depend on the routing.
        let bound = report.pooled.total_hit_tokens;
        assert_eq!(*pooled.get_or_insert(bound), bound);
    }
    let rr = simulate(&trace, &fleet(4, 256, PolicyKind::RoundRobin)).unwrap();
    let ca = simulate(&trace, &fleet(4, 256, PolicyKind::CacheAware)).unwrap();
    assert!(
        ca.overall_hit_rate > rr.overall_hit_rate,
        "cache-aware {} vs round robin {}",
        ca.overall_hit_rate,
        rr.overall_hit_rate
    );
}

/// The fleet the issue quotes: 8 replicas x 2048 blocks. The pooled reference is the N = 1 replay
/// at 16384 blocks, which the Python reference gives as 33,092,507 hit tokens (LRU). The
/// issue's target holds for the router's default cache-aware policy under LRU and LFU: at
/// least 97% of the pooled reference with a load skew of at most 1.10, and a lower TTFT than round
/// robin. (The simulation is deterministic: this checks its output, not a timing.)
#[test]
fn shared_trace_on_eight_replicas() {
    let trace = read_shared_trace();
    let rr = simulate(&trace, &fleet(8, 2048, PolicyKind::RoundRobin)).unwrap();
    let ca = simulate(&trace, &fleet(8, 2048, PolicyKind::CacheAware)).unwrap();
    for report in [&rr, &ca] {
        assert_eq!(report.pooled.capacity_blocks, 16384);
        assert_eq!(report.pooled.total_hit_tokens, 33_092_507);
        assert_eq!(report.per_replica.len(), 8);
    }
    assert!(ca.overall_hit_rate > 2.0 * rr.overall_hit_rate);
    let lfu =
        simulate(&trace, &SimConfig { eviction: Eviction::Lfu, ..fleet(8, 2048, PolicyKind::CacheAware) })
            .unwrap();
    for (name, report) in [("lru", &ca), ("lfu", &lfu)] {
        let pct = report.pct_of_pooled.unwrap_or(0.0);
        eprintln!(
            "8 x 2048 {name}: pooled {:.4}, cache-aware {:.4} ({pct:.1}% of pooled, skew {:.3})",
            report.pooled.overall_hit_rate, report.overall_hit_rate, report.load_skew
        );
        assert!(pct >= 97.0, "{name}: cache-aware at {pct:.1}% of the pooled reference");
        assert!(report.load_skew <= 1.10, "{name}: load skew {:.3}", report.load_skew);
    }
    let ttft =
        |r: &kvroute_loadgen::SimReport| r.latency.as_ref().map(|l| (l.ttft_p50_ms, l.ttft_p99_ms)).unwrap();
    let (ca_ttft, rr_ttft) = (ttft(&ca), ttft(&rr));
    assert!(
        ca_ttft.0 < rr_ttft.0 && ca_ttft.1 < rr_ttft.1,
        "TTFT cache-aware {ca_ttft:?} vs round robin {rr_ttft:?}"
    );
}
