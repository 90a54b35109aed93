//! Prefix-index benchmarks (`cargo bench -p kvroute-router --bench index`).
//!
//! Criterion measures ingest throughput (block-ops/s, one core) and lookup latency for
//! requests of 32, 128 and 1024 blocks against 4, 16 and 64 replicas. Before that, in `--bench`
//! mode only, this binary prints to stdout:
//! - memory: bytes per (block, replica) entry at 1 M distinct blocks, counted by the
//!   `#[global_allocator]` below (heap bytes live after building minus before);
//! - lookup p50/p99/p99.9 from timing single lookups with `Instant`;
//! - the concurrency comparison behind `SharedIndex`: one `RwLock` around the index vs a
//!   `DashMap` of presence masks (lock per block) vs snapshot publishing (cost of a clone),
//!   alone and with a writer thread churning the index.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hash::{BuildHasher, Hasher};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use dashmap::DashMap;
use kvroute_proto::{BlockHash, ReplicaId};
use kvroute_router::index::{Overlaps, PrefixIndex, SharedIndex};

// ---- counting allocator ----

struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to `System` unchanged and only keeps a byte count on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live_bytes() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

// ---- workload ----

/// splitmix64: a tiny seeded generator, so every run builds the same fleet.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(kvroute_proto::mix::GOLDEN);
        kvroute_proto::mix::mix64(self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn hashes(&mut self, n: usize) -> Vec<BlockHash> {
        (0..n).map(|_| BlockHash(self.next())).collect()
    }
}

const FAMILIES: usize = 32;
const FAMILY_LEN: usize = 1024;
const BACKGROUND_PER_REPLICA: usize = 20_000;

/// A fleet sharing popular prefixes: 32 prompt families (1024-block chains); each replica
/// holds 60 % of the families to a random depth, with a middle block evicted in a fifth of
/// them, plus 20 k blocks of its own. Requests are a family's first `n` blocks, half of them
/// diverging into fresh blocks at a random point.
struct Fleet {
    index: SharedIndex,
    families: Vec<Vec<BlockHash>>,
}

impl Fleet {
    fn build(replicas: u32, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let families: Vec<_> = (0..FAMILIES).map(|_| rng.hashes(FAMILY_LEN)).collect();
        let index = SharedIndex::new();
        for id in 0..replicas {
            let replica = ReplicaId(id);
            for family in &families {
                if !rng.chance(60) {
                    continue;
                }
                let depth = rng.below(FAMILY_LEN as u64 + 1) as usize;
                index.store(replica, &family[..depth]);
                if depth > 0 && rng.chance(20) {
                    let evicted = rng.below(depth as u64) as usize;
                    index.remove(replica, &family[evicted..=evicted]);
                }
            }
            index.store(replica, &rng.hashes(BACKGROUND_PER_REPLICA));
        }
        Self { index, families }
    }

    fn requests(&self, blocks: usize, count: usize, seed: u64) -> Vec<Vec<BlockHash>> {
        let mut rng = Rng(seed);
        (0..count)
            .map(|_| {
                let family = &self.families[rng.below(FAMILIES as u64) as usize];
                let mut request = family[..blocks.min(FAMILY_LEN)].to_vec();
                if rng.chance(50) {
                    let diverge = rng.below(blocks as u64) as usize;
                    request.truncate(diverge);
                }
                let fresh = blocks - request.len();
                request.extend(rng.hashes(fresh));
                request
            })
            .collect()
    }
}

/// A steady churn for ingest: batch `k` of 128 fresh blocks is stored by replica `k % 16`
/// and removed again 4096 batches later, so about 512 k (block, replica) pairs stay live.
struct Churn {
    pool: Vec<Vec<BlockHash>>,
    next: usize,
}

/// A replica and the blocks it stores or removes.
type Batch<'a> = (ReplicaId, &'a [BlockHash]);

const CHURN_BATCH: usize = 128;
const CHURN_POOL: usize = 8191;
const CHURN_WINDOW: usize = 4096;
const CHURN_REPLICAS: usize = 16;

impl Churn {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        Self { pool: (0..CHURN_POOL).map(|_| rng.hashes(CHURN_BATCH)).collect(), next: 0 }
    }

    /// The next (replica, batch to store) and (replica, batch to remove), if any.
    fn step(&mut self) -> (Batch<'_>, Option<Batch<'_>>) {
        let k = self.next;
        self.next += 1;
        let replica = |k: usize| ReplicaId((k % CHURN_REPLICAS) as u32);
        let store = (replica(k), &self.pool[k % CHURN_POOL][..]);
        let remove = k.checked_sub(CHURN_WINDOW).map(|old| (replica(old), &self.pool[old % CHURN_POOL][..]));
        (store, remove)
    }

    fn warm(&mut self, mut apply: impl FnMut(bool, ReplicaId, &[BlockHash])) {
        for _ in 0..CHURN_WINDOW {
            let ((replica, batch), _) = self.step();
            apply(true, replica, batch);
        }
    }
}

// ---- the DashMap alternative (presence masks only, no reference counts) ----

#[derive(Clone, Copy, Default)]
struct Fold;

impl BuildHasher for Fold {
    type Hasher = FoldHasher;
    fn build_hasher(&self) -> FoldHasher {
        FoldHasher(0)
    }
}

struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, x: u64) {
        let wide = u128::from(self.0 ^ x) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (wide as u64) ^ ((wide >> 64) as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Clone, Default)]
struct DashIndex {
    masks: Arc<DashMap<BlockHash, u64, Fold>>,
}

impl DashIndex {
    fn store(&self, replica: ReplicaId, hashes: &[BlockHash]) {
        let bit = 1u64 << replica.0;
        for &hash in hashes {
            *self.masks.entry(hash).or_insert(0) |= bit;
        }
    }

    fn remove(&self, replica: ReplicaId, hashes: &[BlockHash]) {
        let bit = 1u64 << replica.0;
        for hash in hashes {
            self.masks.remove_if_mut(hash, |_, mask| {
                *mask &= !bit;
                *mask == 0
            });
        }
    }

    fn lookup(&self, live: u64, hashes: &[BlockHash], out: &mut Vec<(ReplicaId, usize)>) {
        out.clear();
        let mut alive = live;
        for (depth, hash) in hashes.iter().enumerate() {
            let present = self.masks.get(hash).map_or(0, |mask| *mask);
            let mut dropped = alive & !present;
            while dropped != 0 && depth > 0 {
                out.push((ReplicaId(dropped.trailing_zeros()), depth));
                dropped &= dropped - 1;
            }
            alive &= present;
            if alive == 0 {
                return;
            }
        }
        let mut rest = alive;
        while rest != 0 {
            out.push((ReplicaId(rest.trailing_zeros()), hashes.len()));
            rest &= rest - 1;
        }
    }
}

// ---- stdout reports ----

fn percentiles(mut nanos: Vec<u64>) -> String {
    nanos.sort_unstable();
    let at = |q: f64| nanos[((nanos.len() as f64 * q) as usize).min(nanos.len() - 1)];
    format!("p50 {:>6} ns  p99 {:>6} ns  p99.9 {:>6} ns", at(0.5), at(0.99), at(0.999))
}

fn time_each(rounds: usize, mut op: impl FnMut(usize)) -> Vec<u64> {
    (0..rounds)
        .map(|i| {
            let start = Instant::now();
            op(i);
            start.elapsed().as_nanos() as u64
        })
        .collect()
}

fn report_memory() {
    println!("\n== memory: heap bytes per (block, replica) entry, counting allocator ==");
    for &(distinct, sharing) in &[(500_000, 1), (1_000_000, 1), (1_500_000, 1), (1_000_000, 4)] {
        let mut rng = Rng(distinct as u64 + sharing);
        let blocks = rng.hashes(distinct);
        // Each block goes to `sharing` distinct replicas out of 16 (consecutive ids).
        let owners: Vec<u32> = (0..distinct).map(|_| rng.below(16) as u32).collect();
        let before = live_bytes();
        let mut index = PrefixIndex::new();
        for (chunk, owners) in blocks.chunks(128).zip(owners.chunks(128)) {
            for copy in 0..sharing as u32 {
                let replica = ReplicaId((owners[0] + copy) % 16);
                index.store(replica, chunk);
            }
        }
        let bytes = live_bytes() - before;
        let entries = index.entries();
        println!(
            "{distinct:>9} distinct blocks × {sharing} replica(s): {entries:>9} entries, \
             {:>6.1} MiB, {:>5.1} B/entry, {:>5.1} B/distinct block (estimate {:>5.1} B/entry)",
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / entries as f64,
            bytes as f64 / distinct as f64,
            index.memory_bytes() as f64 / entries as f64,
        );
        if distinct == 1_000_000 && sharing == 1 {
            let start = Instant::now();
            let snapshot = black_box(index.clone());
            println!("  snapshot publish (clone of the index): {:?}", start.elapsed());
            drop(snapshot);
            let shared = SharedIndex::new();
            for (chunk, owners) in blocks.chunks(128).zip(owners.chunks(128)) {
                shared.store(ReplicaId(owners[0]), chunk);
            }
            let start = Instant::now();
            let freed = shared.clear_replica(ReplicaId(0));
            println!("  clear_replica of {freed} blocks (of 1 M): {:?}", start.elapsed());
            // Beside another replica's references beyond the first (vLLM stores blocks it
            // holds again), which live in the blocks' shards: each of the clear's 256 steps
            // sweeps only its own shard's.
            let beside = SharedIndex::new();
            beside.store(ReplicaId(1), &blocks[..200_000]);
            beside.store(ReplicaId(1), &blocks[..200_000]);
            beside.store(ReplicaId(0), &blocks[200_000..201_000]);
            let start = Instant::now();
            let freed = beside.clear_replica(ReplicaId(0));
            println!(
                "  clear_replica of {freed} blocks beside 200 k duplicate references: {:?}",
                start.elapsed()
            );
            // A replica of 1 000 blocks beside 999 000 of another's: swept, and cleared by its
            // references (as the ingest clears a rank whose references are few beside the
            // table, `SharedIndex::clear_held`).
            let small = || {
                let index = SharedIndex::new();
                index.store(ReplicaId(1), &blocks[..999_000]);
                index.store(ReplicaId(0), &blocks[999_000..]);
                index
            };
            let swept = small();
            let start = Instant::now();
            swept.sweep_replica(ReplicaId(0));
            let sweep = start.elapsed();
            let by_reference = small();
            let start = Instant::now();
            by_reference.clear_held(ReplicaId(0), &blocks[999_000..]);
            println!("  1 000 blocks beside 999 000: swept {sweep:?}, by reference {:?}", start.elapsed());
        }
    }
}

fn report_lookup_percentiles() {
    println!("\n== lookup latency, single lookups timed with Instant (incl. ~20 ns timer) ==");
    for replicas in [4, 16, 64] {
        let fleet = Fleet::build(replicas, 7);
        for blocks in [32, 128, 1024] {
            let requests = fleet.requests(blocks, 4096, blocks as u64);
            let mut out = Overlaps::new();
            let mut walked = 0;
            for request in &requests {
                fleet.index.lookup_into(request, &mut out);
                let longest = out.iter().map(|(_, n)| n).max().unwrap_or(0);
                walked += (longest + 1).min(request.len());
            }
            let nanos = time_each(200_000, |i| {
                fleet.index.lookup_into(black_box(&requests[i % requests.len()]), &mut out);
            });
            println!(
                "{blocks:>5} blocks × {replicas:>2} replicas: {}  (avg {:.0} blocks walked)",
                percentiles(nanos),
                walked as f64 / requests.len() as f64
            );
        }
    }
}

/// How hard the writer thread of the concurrency comparison pushes.
#[derive(Clone, Copy)]
enum Writer {
    Idle,
    /// About this many block-ops per second, in steps of 256.
    Paced(f64),
    FlatOut,
}

/// One reader timing lookups (128 blocks × 16 replicas) while one writer thread churns the
/// same index (fresh 128-block batches stored and removed across 16 replicas).
fn report_concurrency() {
    println!(
        "\n== concurrency: one RwLock per lookup (shared = SharedIndex) vs DashMap (lock per block); control = writer on another index =="
    );
    let mut rng = Rng(99);
    let families: Vec<_> = (0..FAMILIES).map(|_| rng.hashes(128)).collect();
    let requests: Vec<Vec<BlockHash>> = (0..4096).map(|i| families[i % FAMILIES].clone()).collect();
    for writer in [Writer::Idle, Writer::Paced(1e6), Writer::FlatOut] {
        let shared = SharedIndex::new();
        let dash = DashIndex::default();
        for replica in 0..16u32 {
            for family in &families {
                let depth = rng.below(129) as usize;
                shared.store(ReplicaId(replica), &family[..depth]);
                dash.store(ReplicaId(replica), &family[..depth]);
            }
        }
        let label = match writer {
            Writer::Idle => "writer idle        ".to_owned(),
            Writer::Paced(rate) => format!("writer at {:.0} M op/s", rate / 1e6),
            Writer::FlatOut => "writer flat out    ".to_owned(),
        };

        let mut churn = Churn::new(5);
        let (nanos, rate) = with_writer(
            writer,
            || {
                let ((r, add), old) = churn.step();
                shared_step(&shared, r, add, old)
            },
            || {
                let mut out = Overlaps::new();
                time_each(300_000, |i| shared.lookup_into(&requests[i % requests.len()], &mut out))
            },
        );
        println!("shared  {label}: lookup {}  (writer {rate})", percentiles(nanos));

        // Control: the same writer load on a different index, so no lock is shared. What
        // remains of the tail is the CPU scheduler, not the index.
        let other = SharedIndex::new();
        let mut churn = Churn::new(5);
        let (nanos, rate) = with_writer(
            writer,
            || {
                let ((r, add), old) = churn.step();
                shared_step(&other, r, add, old)
            },
            || {
                let mut out = Overlaps::new();
                time_each(300_000, |i| shared.lookup_into(&requests[i % requests.len()], &mut out))
            },
        );
        println!("control {label}: lookup {}  (writer {rate})", percentiles(nanos));

        let mut churn = Churn::new(5);
        let (nanos, rate) = with_writer(
            writer,
            || {
                let ((r, add), old) = churn.step();
                dash.store(r, add);
                old.map_or(0, |(r, old)| {
                    dash.remove(r, old);
                    old.len()
                }) + add.len()
            },
            || {
                let mut out = Vec::new();
                time_each(300_000, |i| dash.lookup(u64::MAX, &requests[i % requests.len()], &mut out))
            },
        );
        println!("DashMap {label}: lookup {}  (writer {rate})", percentiles(nanos));
    }
}

fn shared_step(
    index: &SharedIndex,
    replica: ReplicaId,
    add: &[BlockHash],
    old: Option<(ReplicaId, &[BlockHash])>,
) -> usize {
    index.store(replica, add);
    let mut ops = add.len();
    if let Some((replica, old)) = old {
        index.remove(replica, old);
        ops += old.len();
    }
    ops
}

/// Runs `read` on this thread while another thread repeats `step` (which returns the
/// block-ops it did) as `writer` says; returns the reader's timings and the writer's rate.
fn with_writer(
    writer: Writer,
    mut step: impl FnMut() -> usize + Send,
    read: impl FnOnce() -> Vec<u64>,
) -> (Vec<u64>, String) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let handle = (!matches!(writer, Writer::Idle)).then(|| {
            scope.spawn(|| {
                let start = Instant::now();
                let mut ops = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    ops += step();
                    if let Writer::Paced(rate) = writer {
                        let due = start + Duration::from_secs_f64(ops as f64 / rate);
                        std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    }
                }
                ops as f64 / start.elapsed().as_secs_f64()
            })
        });
        let nanos = read();
        stop.store(true, Ordering::Relaxed);
        let rate = handle.map_or_else(
            || "idle".to_owned(),
            |w| format!("{:.1} M block-ops/s", w.join().expect("writer thread") / 1e6),
        );
        (nanos, rate)
    })
}

// ---- criterion ----

fn bench_ingest(c: &mut Criterion) {
    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements(2 * CHURN_BATCH as u64));

    let shared = SharedIndex::new();
    let mut churn = Churn::new(1);
    churn.warm(|_, replica, batch| {
        shared.store(replica, batch);
    });
    group.bench_function("shared_index", |b| {
        b.iter(|| {
            let ((replica, add), old) = churn.step();
            shared_step(&shared, replica, add, old)
        })
    });

    let dash = DashIndex::default();
    let mut churn = Churn::new(1);
    churn.warm(|_, replica, batch| dash.store(replica, batch));
    group.bench_function("dashmap_masks_only", |b| {
        b.iter(|| {
            let ((replica, add), old) = churn.step();
            dash.store(replica, add);
            if let Some((replica, old)) = old {
                dash.remove(replica, old);
            }
        })
    });
    group.finish();
}

fn bench_lookup(c: &mut Criterion) {
    let mut group = c.benchmark_group("lookup");
    for replicas in [4, 16, 64] {
        let fleet = Fleet::build(replicas, 7);
        for blocks in [32, 128, 1024] {
            let requests = fleet.requests(blocks, 4096, blocks as u64);
            let mut out = Overlaps::new();
            let mut i = 0;
            let id = BenchmarkId::new(format!("{blocks}_blocks"), format!("{replicas}_replicas"));
            group.bench_function(id, |b| {
                b.iter(|| {
                    i = (i + 1) % requests.len();
                    fleet.index.lookup_into(&requests[i], &mut out);
                    out.len()
                })
            });
        }
    }
    group.finish();
}

fn main() {
    // `INDEX_REPORTS=memory,latency,concurrency` picks reports (default all; "" for none).
    let reports = std::env::var("INDEX_REPORTS").unwrap_or("memory,latency,concurrency".into());
    if std::env::args().any(|arg| arg == "--bench") {
        if reports.contains("memory") {
            report_memory();
        }
        if reports.contains("latency") {
            report_lookup_percentiles();
        }
        if reports.contains("concurrency") {
            report_concurrency();
        }
        println!();
    }
    let mut criterion = Criterion::default().warm_up_time(Duration::from_secs(1)).configure_from_args();
    bench_ingest(&mut criterion);
    bench_lookup(&mut criterion);
    criterion.final_summary();
}
