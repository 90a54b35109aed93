//! Hashing throughput of the block-hash chain, in tokens per second, for 16-, 64- and
//! 512-token blocks (target: >= 1 G tokens/s per core at 512).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_proto::{CacheNamespace, hash::extend_chain};
use std::hint::black_box;

fn bench_chain(c: &mut Criterion) {
    let root = CacheNamespace::new("bench-model").root();
    let mut group = c.benchmark_group("hash_chain");
    for block_size in [16usize, 64, 512] {
        // 64 Ki tokens per iteration: large enough to amortise call overhead.
        let tokens: Vec<u32> = (0..65_536u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_000).collect();
        let mut out = Vec::with_capacity(tokens.len() / block_size);
        group.throughput(Throughput::Elements(tokens.len() as u64));
        group.bench_function(format!("block_size_{block_size}"), |b| {
            b.iter(|| {
                out.clear();
                extend_chain(root, black_box(&tokens), block_size, &mut out);
                black_box(out.last().copied())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_chain);
criterion_main!(benches);
