//! Cache accesses per second for each eviction policy on a chat-like workload: requests pick
//! one of 2 000 shared prefixes (system prompts / documents, 8-64 blocks) with Zipf(1.0)
//! popularity and add a private tail of 2-36 blocks, against a 16 384-block cache.
//!
//! `replay` is the simulator's path (`access_request`); `engine` is `start_request` with pins
//! and events, then `finish_request`. Throughput counts block accesses.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_proto::BlockHash;
use kvroute_replica_agent::cache::{BlockCache, CacheConfig, PolicyKind, S3FifoParams};

const CAPACITY: usize = 16_384;
const BLOCK_SIZE: usize = 16;
const PREFIXES: usize = 2_000;
const REQUESTS: usize = 4_000;

/// SplitMix64: a tiny deterministic generator, so runs are comparable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(kvroute_proto::mix::GOLDEN);
        kvroute_proto::mix::mix64(self.0)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn workload() -> Vec<(Vec<BlockHash>, usize)> {
    let mut rng = Rng(42);
    let prefixes: Vec<Vec<BlockHash>> =
        (0..PREFIXES).map(|_| (0..8 + rng.below(57)).map(|_| BlockHash(rng.next())).collect()).collect();
    // Zipf(1.0) CDF over prefix ranks.
    let weights: Vec<f64> = (1..=PREFIXES).map(|r| 1.0 / r as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    let cdf: Vec<f64> = weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect();
    (0..REQUESTS)
        .map(|_| {
            let u = rng.unit();
            let rank = cdf.partition_point(|&c| c < u).min(PREFIXES - 1);
            let mut blocks = prefixes[rank].clone();
            blocks.extend((0..2 + rng.below(35)).map(|_| BlockHash(rng.next())));
            let prompt_len = blocks.len() * BLOCK_SIZE - rng.below(BLOCK_SIZE);
            (blocks, prompt_len)
        })
        .collect()
}

fn new_cache(policy: PolicyKind) -> BlockCache {
    let config = CacheConfig {
        capacity_blocks: CAPACITY,
        block_size: BLOCK_SIZE,
        policy,
        s3fifo: S3FifoParams::default(),
    };
    BlockCache::new(&config).expect("valid config")
}

fn bench(c: &mut Criterion) {
    let requests = workload();
    let accesses: usize = requests.iter().map(|(b, _)| b.len()).sum();
    let policies = [PolicyKind::Lru, PolicyKind::Lfu, PolicyKind::S3fifo];

    for policy in policies {
        let mut cache = new_cache(policy);
        for _ in 0..2 {
            for (blocks, len) in &requests {
                cache.access_request(blocks, *len).expect("no pins");
            }
        }
        let s = cache.stats();
        eprintln!(
            "{policy:?}: {} requests, {} accesses/pass, token hit rate {:.3} over two passes",
            REQUESTS,
            accesses,
            s.hit_tokens as f64 / s.prompt_tokens as f64
        );
    }

    let mut group = c.benchmark_group("replay");
    group.throughput(Throughput::Elements(accesses as u64));
    for policy in policies {
        let mut cache = new_cache(policy);
        group.bench_function(format!("{policy:?}").to_lowercase(), |b| {
            b.iter(|| {
                for (blocks, len) in &requests {
                    black_box(cache.access_request(blocks, *len).expect("no pins"));
                }
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(accesses as u64));
    for policy in policies {
        let mut cache = new_cache(policy);
        let mut events = Vec::new();
        group.bench_function(format!("{policy:?}").to_lowercase(), |b| {
            b.iter(|| {
                for (blocks, len) in &requests {
                    events.clear();
                    black_box(cache.start_request(blocks, *len, &mut events).expect("fits"));
                    cache.finish_request(blocks).expect("pinned above");
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
