use std::collections::HashMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

use super::*;

impl PrefixIndex {
    fn lookup_of(&self, hashes: &[BlockHash]) -> Overlaps {
        let mut out = Overlaps::new();
        self.lookup_into(hashes, &mut out);
        out
    }
}

fn r(id: u32) -> ReplicaId {
    ReplicaId(id)
}

/// Distinct, well-spread hashes (they land in different shards), like real chained hashes.
fn h(i: u64) -> BlockHash {
    let mut z = i.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    BlockHash(z ^ (z >> 31))
}

fn hs(range: std::ops::Range<u64>) -> Vec<BlockHash> {
    range.map(h).collect()
}

fn sorted(overlaps: &Overlaps) -> Vec<(ReplicaId, usize)> {
    let mut hits: Vec<_> = overlaps.iter().collect();
    hits.sort();
    hits
}

#[test]
fn empty_index_has_no_overlap() {
    let index = SharedIndex::new();
    assert!(index.lookup(&hs(0..4)).is_empty());
    assert!(index.lookup(&[]).is_empty());
    assert_eq!(index.stats(), IndexStats::default());
}

#[test]
fn runs_continue_from_each_replicas_own_start() {
    let index = SharedIndex::new();
    index.store(r(1), &hs(2..6));
    index.store(r(2), &hs(0..8));
    index.store(r(3), &hs(4..8));
    let from = [(r(1), 2), (r(2), 5), (r(3), 2), (r(4), 0)];
    // 1 holds 2..6 from 2; 2 from 5 to the end; 3 nothing at 2 (a run must begin at its
    // start); 4 holds nothing.
    assert_eq!(sorted(&index.continue_from(&hs(0..7), &from)), vec![(r(1), 6), (r(2), 7)]);
    assert_eq!(sorted(&index.continue_from(&hs(0..7), &[(r(3), 4)])), vec![(r(3), 7)]);
    assert!(index.continue_from(&hs(0..7), &[(r(2), 7)]).is_empty(), "a start at the end is no run");
    assert!(SharedIndex::new().continue_from(&hs(0..7), &from).is_empty());
}

#[test]
fn overlap_is_the_contiguous_prefix_per_replica() {
    let index = SharedIndex::new();
    index.store(r(1), &hs(0..8));
    index.store(r(2), &hs(0..3));
    index.store(r(3), &hs(1..8)); // misses block 0: no overlap at all
    index.store(r(4), &hs(0..8));
    index.remove(r(4), &[h(5)]); // evicted a middle block
    let found = index.lookup(&hs(0..6));
    assert_eq!(sorted(&found), vec![(r(1), 6), (r(2), 3), (r(4), 5)]);
    assert_eq!(found.get(r(3)), 0);
    assert_eq!(found.best(), Some((r(1), 6)));
    assert_eq!(index.blocks(r(4)), 7);
    assert_eq!(index.stats().entries, 8 + 3 + 7 + 7);
}

#[test]
fn blocks_stay_until_every_reference_is_removed() {
    let index = SharedIndex::new();
    assert_eq!(index.store(r(0), &[h(0), h(0)]), 1);
    assert_eq!(index.store(r(0), &[h(0)]), 0);
    assert_eq!(index.remove(r(0), &[h(0), h(0)]), 2);
    assert_eq!(index.lookup(&[h(0)]).get(r(0)), 1);
    assert_eq!(index.remove(r(0), &[h(0)]), 1);
    assert_eq!(index.lookup(&[h(0)]).get(r(0)), 0);
    assert_eq!(index.remove(r(0), &[h(0)]), 0, "removing an absent block is a no-op");
    assert_eq!(index.blocks(r(0)), 0);
}

#[test]
fn removing_unknown_blocks_or_replicas_is_a_no_op() {
    let index = SharedIndex::new();
    assert_eq!(index.remove(r(9), &hs(0..3)), 0);
    index.store(r(1), &hs(0..2));
    assert_eq!(index.remove(r(1), &hs(1..5)), 1);
    assert_eq!(index.remove(r(2), &hs(0..2)), 0, "r2 never held them");
    assert_eq!(index.lookup(&hs(0..2)).get(r(1)), 1);
}

#[test]
fn clear_replica_frees_its_blocks_and_keeps_others() {
    let index = SharedIndex::new();
    index.store(r(1), &hs(0..1000));
    index.store(r(1), &hs(0..10)); // extra references go too
    index.store(r(2), &hs(0..500));
    assert_eq!(index.clear_replica(r(1)), 1000);
    assert_eq!(index.blocks(r(1)), 0);
    assert_eq!(index.lookup(&hs(0..600)).iter().collect::<Vec<_>>(), vec![(r(2), 500)]);
    assert_eq!(index.clear_replica(r(1)), 0);
    assert_eq!(index.clear_replica(r(2)), 500);
    assert_eq!(index.stats(), IndexStats::default(), "all memory released");
}

#[test]
fn more_than_64_replicas() {
    let index = SharedIndex::new();
    for id in 0..150 {
        index.store(r(id), &hs(0..u64::from(id % 10)));
    }
    let found = index.lookup(&hs(0..100));
    for id in 0..150 {
        assert_eq!(found.get(r(id)), (id % 10) as usize);
    }
    // Free slots in the first group are reused; later groups keep working.
    index.clear_replica(r(3));
    index.store(r(1000), &hs(0..50));
    assert_eq!(index.lookup(&hs(0..100)).get(r(1000)), 50);
    assert_eq!(index.lookup(&hs(0..100)).get(r(149)), 9);
}

#[test]
fn long_batches_are_applied_in_chunks() {
    let index = SharedIndex::new();
    let blocks = hs(0..(3 * WRITE_CHUNK as u64 + 7));
    assert_eq!(index.store(r(0), &blocks), blocks.len());
    assert_eq!(index.lookup(&blocks).get(r(0)), blocks.len());
    assert_eq!(index.remove(r(0), &blocks), blocks.len());
    assert_eq!(index.stats().entries, 0);
}

#[test]
fn lookup_into_reuses_the_buffer() {
    let index = SharedIndex::new();
    index.store(r(0), &hs(0..4));
    let mut out = Overlaps::new();
    index.lookup_into(&hs(0..4), &mut out);
    index.lookup_into(&hs(10..14), &mut out);
    assert!(out.is_empty(), "a lookup replaces the previous result");
}

#[test]
fn memory_estimate_tracks_live_blocks() {
    let mut index = PrefixIndex::new();
    index.store(r(0), &hs(0..100_000));
    let full = index.memory_bytes();
    assert!(full >= 100_000 * 16, "at least key + mask per block, got {full}");
    index.remove(r(0), &hs(0..99_000));
    assert!(index.memory_bytes() < full / 8, "sparse tables shrink");
    index.clear_replica(r(0));
    assert_eq!(index.memory_bytes(), 0);
    // Extra references (several data-parallel ranks holding one block) shrink the same way.
    let blocks = hs(0..100_000);
    index.store(r(0), &blocks);
    index.store(r(0), &blocks);
    let peak = index.memory_bytes();
    index.remove(r(0), &blocks);
    index.remove(r(0), &blocks[..99_000]);
    assert!(index.memory_bytes() < peak / 8, "{} of {peak}", index.memory_bytes());
}

#[test]
fn release_keeps_a_slot_its_writer_refilled() {
    // SharedIndex::clear_replica releases the lock between shards; if the replica stores
    // again before the final release, its slot (and the new block) must survive.
    let mut index = PrefixIndex::new();
    index.store(r(1), &hs(0..10));
    for shard in 0..table::SHARDS {
        index.clear_shard(r(1), shard);
    }
    index.store(r(1), &[h(99)]);
    index.release(r(1));
    assert_eq!(index.blocks(r(1)), 1);
    index.store(r(2), &hs(0..3)); // must not inherit r1's slot
    let found = index.lookup_of(&[h(99)]);
    assert_eq!(sorted(&found), vec![(r(1), 1)]);
}

#[test]
fn concurrent_writers_and_readers_agree_at_the_end() {
    let index = SharedIndex::new();
    std::thread::scope(|scope| {
        for id in 0..4u64 {
            let index = index.clone();
            scope.spawn(move || {
                let own = hs(id * 10_000..id * 10_000 + 2_000);
                for round in 0..20 {
                    index.store(r(id as u32), &own);
                    if round % 2 == 0 {
                        index.remove(r(id as u32), &own[1_000..]);
                    }
                    index.remove(r(id as u32), &own[..10]);
                }
            });
        }
        for _ in 0..2 {
            let index = index.clone();
            scope.spawn(move || {
                let mut out = Overlaps::new();
                for i in 0..2_000u64 {
                    index.lookup_into(&hs((i % 4) * 10_000..(i % 4) * 10_000 + 100), &mut out);
                    assert!(out.len() <= 1);
                }
            });
        }
    });
    for id in 0..4u64 {
        // The first ten blocks were removed as often as stored (20 times); the others keep
        // 20 (first half) or 10 (second half) references.
        let held = index.lookup(&hs(id * 10_000 + 10..id * 10_000 + 2_000));
        assert_eq!(held.get(r(id as u32)), 1_990);
        assert_eq!(index.blocks(r(id as u32)), 1_990);
    }
}

// ---- randomized comparison with a naive model ----

/// Three request "chains" of 12 blocks: stores and lookups mostly use their prefixes.
const CHAINS: u64 = 3;
const CHAIN_LEN: u64 = 12;

#[derive(Clone, Debug)]
enum Op {
    Store(u32, Vec<BlockHash>),
    Remove(u32, Vec<BlockHash>),
    Clear(u32),
    Lookup(Vec<BlockHash>),
}

fn replica() -> impl Strategy<Value = u32> {
    // Mostly a few busy replicas, sometimes any of 100 (more than one 64-slot group).
    prop_oneof![4 => 0u32..5, 1 => 0u32..100]
}

fn blocks() -> impl Strategy<Value = Vec<BlockHash>> {
    let segment = (0..CHAINS, 0..CHAIN_LEN, 0..CHAIN_LEN).prop_map(|(chain, start, len)| {
        let first = chain * CHAIN_LEN + start;
        hs(first..(first + len).min((chain + 1) * CHAIN_LEN))
    });
    let scattered = prop::collection::vec((0..CHAINS * CHAIN_LEN).prop_map(h), 0..6);
    prop_oneof![3 => segment, 1 => scattered]
}

fn op() -> impl Strategy<Value = Op> {
    let request = (0..CHAINS, 0..=CHAIN_LEN + 2, prop::collection::vec(0..40u64, 0..3)).prop_map(
        |(chain, len, tail)| {
            let mut hashes = hs(chain * CHAIN_LEN..chain * CHAIN_LEN + len.min(CHAIN_LEN));
            hashes.extend(tail.into_iter().map(h));
            hashes
        },
    );
    prop_oneof![
        6 => (replica(), blocks()).prop_map(|(r, b)| Op::Store(r, b)),
        4 => (replica(), blocks()).prop_map(|(r, b)| Op::Remove(r, b)),
        1 => replica().prop_map(Op::Clear),
        4 => request.prop_map(Op::Lookup),
    ]
}

#[derive(Default)]
struct Model {
    refs: HashMap<ReplicaId, HashMap<BlockHash, u32>>,
}

impl Model {
    fn store(&mut self, replica: ReplicaId, hashes: &[BlockHash]) -> usize {
        let held = self.refs.entry(replica).or_default();
        hashes
            .iter()
            .filter(|&&hash| {
                let count = held.entry(hash).or_insert(0);
                *count += 1;
                *count == 1
            })
            .count()
    }

    fn remove(&mut self, replica: ReplicaId, hashes: &[BlockHash]) -> usize {
        let Some(held) = self.refs.get_mut(&replica) else { return 0 };
        let mut removed = 0;
        for hash in hashes {
            if let Some(count) = held.get_mut(hash) {
                removed += 1;
                *count -= 1;
                if *count == 0 {
                    held.remove(hash);
                }
            }
        }
        removed
    }

    fn clear(&mut self, replica: ReplicaId) -> usize {
        self.refs.remove(&replica).map_or(0, |held| held.len())
    }

    fn lookup(&self, hashes: &[BlockHash]) -> Vec<(ReplicaId, usize)> {
        let mut hits: Vec<_> = self
            .refs
            .iter()
            .map(|(&replica, held)| {
                (replica, hashes.iter().take_while(|hash| held.contains_key(hash)).count())
            })
            .filter(|&(_, blocks)| blocks > 0)
            .collect();
        hits.sort();
        hits
    }

    /// Where each listed replica's run from its start ends, for those with a run.
    fn continue_from(&self, hashes: &[BlockHash], from: &[(ReplicaId, usize)]) -> Vec<(ReplicaId, usize)> {
        let mut hits: Vec<_> = from
            .iter()
            .filter_map(|&(replica, start)| {
                let held = self.refs.get(&replica)?;
                let run = hashes.iter().skip(start).take_while(|hash| held.contains_key(hash)).count();
                (run > 0).then_some((replica, start + run))
            })
            .collect();
        hits.sort();
        hits
    }

    fn blocks(&self, replica: ReplicaId) -> usize {
        self.refs.get(&replica).map_or(0, HashMap::len)
    }

    fn entries(&self) -> usize {
        self.refs.values().map(HashMap::len).sum()
    }
}

fn config() -> Config {
    Config {
        cases: 256,
        rng_seed: RngSeed::Fixed(0x006b_7672_6f75_7465),
        failure_persistence: None,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn matches_the_naive_model(ops in prop::collection::vec(op(), 1..200)) {
        let index = SharedIndex::new();
        let mut model = Model::default();
        let mut out = Overlaps::new();
        for op in ops {
            match op {
                Op::Store(id, hashes) => {
                    prop_assert_eq!(index.store(r(id), &hashes), model.store(r(id), &hashes));
                    prop_assert_eq!(index.blocks(r(id)), model.blocks(r(id)));
                }
                Op::Remove(id, hashes) => {
                    prop_assert_eq!(index.remove(r(id), &hashes), model.remove(r(id), &hashes));
                    prop_assert_eq!(index.blocks(r(id)), model.blocks(r(id)));
                }
                Op::Clear(id) => {
                    prop_assert_eq!(index.clear_replica(r(id)), model.clear(r(id)));
                    prop_assert_eq!(index.blocks(r(id)), 0);
                }
                Op::Lookup(hashes) => {
                    index.lookup_into(&hashes, &mut out);
                    prop_assert_eq!(sorted(&out), model.lookup(&hashes));
                    // Runs from a start of each replica's own (some past the end, some not
                    // listed), as the offloaded tier continues the device tier's prefixes.
                    let from: Vec<(ReplicaId, usize)> =
                        (0..100).filter(|id| id % 7 != 3).map(|id| (r(id), (id as usize * 5) % (hashes.len() + 2))).collect();
                    prop_assert_eq!(sorted(&index.continue_from(&hashes, &from)), model.continue_from(&hashes, &from));
                }
            }
            let stats = index.stats();
            prop_assert_eq!(stats.entries, model.entries());
            prop_assert_eq!(stats.replicas, model.refs.values().filter(|held| !held.is_empty()).count());
        }
        for id in 0..100 {
            index.clear_replica(r(id));
        }
        prop_assert_eq!(index.stats(), IndexStats::default(), "everything freed");
    }
}

/// `ops` reordered across replicas, each replica's own ops keeping their order: `picks`
/// says which replica's next op comes next (modulo the replicas with ops left).
fn interleave(ops: &[Op], picks: &[u8]) -> Vec<Op> {
    let owner = |op: &Op| match op {
        Op::Store(id, _) | Op::Remove(id, _) | Op::Clear(id) => *id,
        Op::Lookup(_) => u32::MAX,
    };
    let mut queues: Vec<(u32, std::collections::VecDeque<Op>)> = Vec::new();
    for op in ops {
        let id = owner(op);
        match queues.iter_mut().find(|(q, _)| *q == id) {
            Some((_, queue)) => queue.push_back(op.clone()),
            None => queues.push((id, std::collections::VecDeque::from([op.clone()]))),
        }
    }
    let mut out = Vec::with_capacity(ops.len());
    let mut picks = picks.iter().cycle();
    while !queues.is_empty() {
        let i = usize::from(*picks.next().unwrap_or(&0)) % queues.len();
        out.push(queues[i].1.pop_front().expect("queues are never empty"));
        if queues[i].1.is_empty() {
            queues.remove(i);
        }
    }
    out
}

fn apply(index: &SharedIndex, ops: &[Op]) {
    for op in ops {
        match op {
            Op::Store(id, hashes) => drop(index.store(r(*id), hashes)),
            Op::Remove(id, hashes) => drop(index.remove(r(*id), hashes)),
            Op::Clear(id) => drop(index.clear_replica(r(*id))),
            Op::Lookup(_) => {}
        }
    }
}

proptest! {
    #![proptest_config(config())]

    /// Replicas' event streams arrive interleaved in whatever order their ingest tasks run:
    /// the index must end the same for every interleaving that keeps each replica's order.
    #[test]
    fn ingest_order_across_replicas_does_not_matter(
        ops in prop::collection::vec(op(), 1..150),
        picks in prop::collection::vec(any::<u8>(), 1..64),
    ) {
        let (a, b) = (SharedIndex::new(), SharedIndex::new());
        apply(&a, &ops);
        apply(&b, &interleave(&ops, &picks));
        // (Memory depends on the allocation history; the contents must not.)
        let (sa, sb) = (a.stats(), b.stats());
        prop_assert_eq!((sa.replicas, sa.entries), (sb.replicas, sb.entries));
        for id in 0..100 {
            prop_assert_eq!(a.blocks(r(id)), b.blocks(r(id)));
        }
        for chain in 0..CHAINS {
            for len in 0..=CHAIN_LEN {
                let request = hs(chain * CHAIN_LEN..chain * CHAIN_LEN + len);
                prop_assert_eq!(sorted(&a.lookup(&request)), sorted(&b.lookup(&request)));
            }
        }
    }
}

/// A store cannot fall between a lookup and its credits' extension: while the closure runs,
/// a concurrent store of the credited blocks (which ends their credits after it writes the
/// index) waits, so the blocks are still seen credited; afterwards they are stored.
#[test]
fn a_store_waits_for_a_lookup_with_its_credits() {
    let index = SharedIndex::with_credit_ttl(Duration::from_secs(60));
    let blocks = hs(0..4);
    index.credits().credit(r(0), &blocks);
    let (stored, stored_rx) = std::sync::mpsc::channel();
    let (_, seen) = std::thread::scope(|s| {
        index.lookup_with_credits(&blocks, |overlaps, credits| {
            s.spawn(|| {
                index.store(r(0), &blocks);
                stored.send(()).unwrap();
            });
            // Microseconds unhindered; it must not finish while this read lasts.
            let finished = stored_rx.recv_timeout(Duration::from_millis(50)).is_ok();
            (finished, credits.extend(r(0), &blocks, overlaps.get(r(0))))
        })
    });
    assert_eq!(seen, (false, 4), "the store waited, and the blocks were seen credited");
    stored_rx.recv().unwrap();
    assert_eq!(index.lookup(&blocks).get(r(0)), 4);
}

#[derive(Debug, Default)]
struct Told(std::sync::atomic::AtomicU32);

impl OnStored for Told {
    fn stored(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A hold tells its waiter once when its last pinned block is stored on its replica, and
/// not at all once it was withdrawn or ended.
#[test]
fn a_hold_tells_when_its_last_block_is_stored() {
    use std::sync::atomic::Ordering::Relaxed;
    let index = SharedIndex::with_credit_ttl(Duration::from_secs(60));
    let told = Arc::new(Told::default());
    let mut hold = CreditHold::pin(&index, r(0), hs(0..4));
    hold.tell_when_stored(told.clone());
    index.store(r(1), &hs(0..4));
    index.store(r(0), &hs(0..3));
    assert_eq!(told.0.load(Relaxed), 0, "another replica, or not the last block");
    index.store(r(0), &hs(3..4));
    index.store(r(0), &hs(3..4));
    assert_eq!(told.0.load(Relaxed), 1, "once");

    for withdrawn in [true, false] {
        let later = Arc::new(Told::default());
        let mut hold = CreditHold::pin(&index, r(0), hs(10..12));
        hold.tell_when_stored(later.clone());
        match withdrawn {
            true => hold.withdraw(&[]),
            false => drop(hold),
        }
        index.store(r(0), &hs(10..12));
        assert_eq!(later.0.load(Relaxed), 0, "withdrawn: {withdrawn}");
        assert_eq!(Arc::strong_count(&later), 1, "nothing kept");
        index.clear_replica(r(0));
    }
}
