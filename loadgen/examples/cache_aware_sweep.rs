//! Sweeps the cache-aware policy's weights on a trace: for each eviction policy, speed-up and
//! (`miss_weight`, `balance_weight`) pair, one simulation of N = 8 x 2048 blocks, printed as
//! one line with the hit rate, % of the pooled reference, load skew and TTFT, and how many prompt
//! tokens the policy sent away from the replica with the longest cached prefix.
//!
//! ```text
//! cargo run --release -p kvroute-loadgen --example cache_aware_sweep -- \
//!     TRACE [EVICTIONS=lru,lfu,s3fifo] [MISS_WEIGHTS=1,2,4] [BALANCE_WEIGHTS=0,4] [SPEEDUPS=1]
//! ```

use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use clap::ValueEnum;
use kvroute_loadgen::sim::{self, SimConfig};
use kvroute_loadgen::workload::mooncake;
use kvroute_proto::hit_tokens;
use kvroute_replica_agent::cache;
use kvroute_router::policy::{
    CacheAware, CacheAwareParams, Decision, Policy, PolicyKind, ReplicaView, RequestView,
};

/// The cache-aware policy, counting the cached tokens it chose to give up.
struct Counting {
    inner: CacheAware,
    diverted_tokens: AtomicU64,
}

impl Policy for Counting {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }

    fn choose(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision {
        let decision = self.inner.choose(request, replicas);
        let cached =
            |r: &ReplicaView| hit_tokens(r.overlap_blocks, request.block_size, request.prompt_tokens);
        let best = replicas.iter().map(cached).max().unwrap_or(0);
        let got = decision.chosen.map_or(0, |i| cached(&replicas[i]));
        self.diverted_tokens.fetch_add((best - got) as u64, Ordering::Relaxed);
        decision
    }
}

fn list<T>(
    arg: Option<&String>,
    default: &str,
    parse: impl Fn(&str) -> anyhow::Result<T>,
) -> anyhow::Result<Vec<T>> {
    arg.map_or(default, String::as_str).split(',').map(parse).collect()
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path =
        args.first().context("usage: cache_aware_sweep TRACE [EVICTIONS] [MISS] [BALANCE] [SPEEDUPS]")?;
    let trace = mooncake::read_file(path.as_ref())?;
    let evictions = list(args.get(1), "lru,lfu,s3fifo", |s| {
        cache::PolicyKind::from_str(s, true).map_err(|e| anyhow::anyhow!(e))
    })?;
    let number = |s: &str| s.parse::<f64>().with_context(|| format!("not a number: {s}"));
    let miss_weights = list(args.get(2), "1,2,4", number)?;
    let balance_weights = list(args.get(3), "0,4", number)?;
    let speedups = list(args.get(4), "1", number)?;
    for &eviction in &evictions {
        for &speedup in &speedups {
            for &miss_weight in &miss_weights {
                for &balance_weight in &balance_weights {
                    let params =
                        CacheAwareParams { miss_weight, balance_weight, ..CacheAwareParams::default() };
                    let config = SimConfig {
                        replicas: 8,
                        capacity_blocks: 2048,
                        eviction,
                        cache_aware: params,
                        speedup,
                        ..SimConfig::default()
                    };
                    let policy =
                        Counting { inner: CacheAware::new(params), diverted_tokens: AtomicU64::new(0) };
                    let r = sim::simulate_with(&trace, &config, &policy)?;
                    let (p50, p99, mean) = r
                        .latency
                        .as_ref()
                        .map_or((0.0, 0.0, 0.0), |l| (l.ttft_p50_ms, l.ttft_p99_ms, l.ttft_mean_ms));
                    println!(
                        "{:<7} speedup {speedup:<4} miss {miss_weight:<4} balance {balance_weight:<4} | hit {:6.2}% pooled {:6.2}% = {:5.1}% skew {:.3} | TTFT p50 {p50:4.0} ms p99 {p99:5.0} ms mean {mean:4.0} ms | diverted {:.2}% of prompt tokens",
                        eviction.to_possible_value().map_or_else(String::new, |v| v.get_name().to_owned()),
                        r.overall_hit_rate * 100.0,
                        r.pooled.overall_hit_rate * 100.0,
                        r.pct_of_pooled.unwrap_or(100.0),
                        r.load_skew,
                        policy.diverted_tokens.load(Ordering::Relaxed) as f64 * 100.0
                            / r.total_prompt_tokens as f64,
                    );
                }
            }
        }
    }
    Ok(())
}
