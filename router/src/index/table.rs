//! [`PrefixIndex`]: the single-threaded index. [`super::SharedIndex`] wraps it in a lock.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::mem::size_of;

use kvroute_proto::{BlockHash, ReplicaId};

use super::Overlaps;
use super::hasher::FoldState;

/// log2 of the number of shards each group's block table is split into.
const SHARD_BITS: u32 = 8;
/// Shards per group. Splitting bounds the pause of a table resize and lets
/// `SharedIndex::clear_replica` release the lock between shards.
pub(crate) const SHARDS: usize = 1 << SHARD_BITS;
/// Replica slots per group: one bit each in a `u64` mask.
const GROUP_SLOTS: usize = 64;
/// Tables below this many item slots are never shrunk (only freed once empty).
const MIN_SHRINK_CAPACITY: usize = 16;

type Map<K, V> = HashMap<K, V, FoldState>;

/// Presence masks of up to 64 replica slots: block → bit `s % 64` set iff slot `s` holds it.
#[derive(Clone, Debug)]
struct Group {
    shards: Box<[Map<BlockHash, u64>]>,
    /// Bits of the slots in this group that are assigned to a replica.
    live: u64,
}

impl Group {
    fn new(hasher: FoldState) -> Self {
        Self { shards: (0..SHARDS).map(|_| Map::with_hasher(hasher)).collect(), live: 0 }
    }
}

#[derive(Clone, Debug)]
struct Slot {
    id: ReplicaId,
    /// Distinct blocks this replica holds (not references).
    blocks: usize,
}

/// Which replicas hold which blocks, with a reference count per (replica, block), answering
/// "how long a contiguous prefix of this request does each replica hold" in one walk.
///
/// See the [module documentation](super) for the layout and its invariants.
#[derive(Clone, Debug)]
pub struct PrefixIndex {
    hasher: FoldState,
    /// `groups[g]` covers slots `64g .. 64g + 64`.
    groups: Vec<Group>,
    slots: Vec<Option<Slot>>,
    by_id: Map<ReplicaId, u32>,
    /// References beyond the first, for (block, slot) pairs stored more than once, in the
    /// block's shard (so a clear step sweeps only its shard's); no shards until the first.
    extra: Vec<Map<(BlockHash, u32), u32>>,
    /// Sum of `Slot::blocks`: (block, replica) pairs present.
    entries: usize,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

fn shard_of(hash: BlockHash) -> usize {
    (hash.0 >> (u64::BITS - SHARD_BITS)) as usize
}

fn split(slot: u32) -> (usize, u64) {
    let slot = slot as usize;
    (slot / GROUP_SLOTS, 1u64 << (slot % GROUP_SLOTS))
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        let hasher = FoldState::random();
        Self {
            hasher,
            groups: Vec::new(),
            slots: Vec::new(),
            by_id: Map::with_hasher(hasher),
            extra: Vec::new(),
            entries: 0,
        }
    }

    /// Adds one reference from `replica` to each of `hashes` (a hash listed twice gets two).
    /// Returns how many blocks became newly present on `replica`.
    pub fn store(&mut self, replica: ReplicaId, hashes: &[BlockHash]) -> usize {
        if hashes.is_empty() {
            return 0;
        }
        let slot = self.slot_or_assign(replica);
        let (g, bit) = split(slot);
        let group = &mut self.groups[g];
        let mut added = 0;
        for &hash in hashes {
            let mask = group.shards[shard_of(hash)].entry(hash).or_insert(0);
            if *mask & bit == 0 {
                *mask |= bit;
                added += 1;
            } else {
                if self.extra.is_empty() {
                    self.extra = (0..SHARDS).map(|_| Map::with_hasher(self.hasher)).collect();
                }
                // (Saturating: a publisher storing one block without end, under ever new
                // engine hashes, must not wrap the count to nothing.)
                let more = self.extra[shard_of(hash)].entry((hash, slot)).or_insert(0);
                *more = more.saturating_add(1);
            }
        }
        self.slot_mut(slot).blocks += added;
        self.entries += added;
        added
    }

    /// Drops one reference from `replica` to each of `hashes`; a block leaves the replica when
    /// its last reference goes. Hashes the replica does not hold are ignored. Returns how
    /// many references were actually removed.
    pub fn remove(&mut self, replica: ReplicaId, hashes: &[BlockHash]) -> usize {
        let Some(&slot) = self.by_id.get(&replica) else {
            return 0;
        };
        let (g, bit) = split(slot);
        let group = &mut self.groups[g];
        let (mut removed, mut freed) = (0, 0);
        for &hash in hashes {
            let shard = &mut group.shards[shard_of(hash)];
            let Some(mask) = shard.get_mut(&hash) else { continue };
            if *mask & bit == 0 {
                continue;
            }
            removed += 1;
            if let Some(extra) = self.extra.get_mut(shard_of(hash))
                && !extra.is_empty()
                && let Entry::Occupied(mut more) = extra.entry((hash, slot))
            {
                *more.get_mut() -= 1;
                if *more.get() == 0 {
                    more.remove();
                    shrink_if_sparse(extra);
                }
                continue;
            }
            *mask &= !bit;
            freed += 1;
            if *mask == 0 {
                shard.remove(&hash);
                shrink_if_sparse(shard);
            }
        }
        self.slot_mut(slot).blocks -= freed;
        self.entries -= freed;
        removed
    }

    /// Forgets everything `replica` holds and releases its slot. Returns how many distinct
    /// blocks it held. Cost: one pass over the block table of the replica's group.
    pub fn clear_replica(&mut self, replica: ReplicaId) -> usize {
        let freed = (0..SHARDS).map(|shard| self.clear_shard(replica, shard)).sum();
        self.release(replica);
        freed
    }

    /// Clears `replica`'s bit from one shard of its group's table (a step of
    /// [`Self::clear_replica`] that lets a caller release its lock in between).
    pub(crate) fn clear_shard(&mut self, replica: ReplicaId, shard: usize) -> usize {
        let Some(&slot) = self.by_id.get(&replica) else {
            return 0;
        };
        let (g, bit) = split(slot);
        let map = &mut self.groups[g].shards[shard];
        let mut freed = 0;
        map.retain(|_, mask| {
            if *mask & bit != 0 {
                *mask &= !bit;
                freed += 1;
            }
            *mask != 0
        });
        shrink_if_sparse(map);
        if let Some(extra) = self.extra.get_mut(shard)
            && !extra.is_empty()
        {
            extra.retain(|&(_, s), _| s != slot);
            shrink_if_sparse(extra);
        }
        self.slot_mut(slot).blocks -= freed;
        self.entries -= freed;
        freed
    }

    /// Releases `replica`'s slot once [`Self::clear_shard`] has run on every shard. If the
    /// replica stored blocks meanwhile (its writer raced its own clear), it keeps the slot:
    /// a slot is only ever reused with no bit of it left in any table.
    pub(crate) fn release(&mut self, replica: ReplicaId) {
        let Some(&slot) = self.by_id.get(&replica) else { return };
        if self.slot(slot).blocks != 0 {
            return;
        }
        self.by_id.remove(&replica);
        let (g, bit) = split(slot);
        self.groups[g].live &= !bit;
        self.slots[slot as usize] = None;
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
        }
        // Drop trailing groups nobody uses; their tables are empty by now.
        self.groups.truncate(self.slots.len().div_ceil(GROUP_SLOTS));
        if self.slots.is_empty() {
            // The last replica left: give back the bookkeeping too.
            self.groups.shrink_to_fit();
            self.slots.shrink_to_fit();
            self.by_id.shrink_to_fit();
            self.extra = Vec::new();
        }
    }

    /// For every replica, the number of leading blocks of `hashes` it holds, without a gap.
    /// Replicas with no overlap are left out. Allocates only if `out` has to grow.
    pub fn lookup_into(&self, hashes: &[BlockHash], out: &mut Overlaps) {
        out.hits.clear();
        for (g, group) in self.groups.iter().enumerate() {
            let mut alive = group.live;
            let mut depth = 0;
            for hash in hashes {
                if alive == 0 {
                    break;
                }
                let present = group.shards[shard_of(*hash)].get(hash).copied().unwrap_or(0);
                let dropped = alive & !present;
                if dropped != 0 {
                    if depth > 0 {
                        self.push_hits(g, dropped, depth, out);
                    }
                    alive &= present;
                }
                depth += 1;
            }
            if alive != 0 && depth > 0 {
                self.push_hits(g, alive, depth, out);
            }
        }
        // By replica, for `Overlaps::get`'s binary search: a decision reads every member's.
        out.hits.sort_unstable_by_key(|&(id, _)| id);
    }

    /// For every replica listed in `from` with `(replica, start)`, where its run of blocks of
    /// `hashes` held here, begun at block `start`, ends: the first block at or past `start`
    /// that it does not hold. A replica whose run is empty, or not listed, is left out. One
    /// walk for all, from the least start: a replica joins it at its own start.
    pub fn continue_into(&self, hashes: &[BlockHash], from: &[(ReplicaId, usize)], out: &mut Overlaps) {
        out.hits.clear();
        for (g, group) in self.groups.iter().enumerate() {
            // (start, bit) of the group's slots that are listed, by start.
            let mut joins: Vec<(usize, u64)> = from
                .iter()
                .filter(|&&(_, start)| start < hashes.len())
                .filter_map(|&(id, start)| {
                    let (slot_group, bit) = split(*self.by_id.get(&id)?);
                    (slot_group == g && group.live & bit != 0).then_some((start, bit))
                })
                .collect();
            if joins.is_empty() {
                continue;
            }
            joins.sort_unstable_by_key(|&(start, _)| start);
            let (mut alive, mut started, mut next) = (0u64, 0u64, 0);
            let mut depth = joins[0].0;
            while depth < hashes.len() {
                while let Some(&(start, bit)) = joins.get(next).filter(|&&(start, _)| start <= depth) {
                    debug_assert_eq!(start, depth);
                    alive |= bit;
                    next += 1;
                }
                if alive == 0 {
                    match joins.get(next) {
                        Some(&(start, _)) => depth = start,
                        None => break,
                    }
                    continue;
                }
                let hash = hashes[depth];
                let present = group.shards[shard_of(hash)].get(&hash).copied().unwrap_or(0);
                let dropped = alive & !present;
                if dropped != 0 {
                    // Those that held some of it end here (those that held none are no run).
                    self.push_hits(g, dropped & started, depth, out);
                    alive &= present;
                }
                started |= alive;
                depth += 1;
            }
            self.push_hits(g, alive & started, depth, out);
        }
        out.hits.sort_unstable_by_key(|&(id, _)| id);
    }

    fn push_hits(&self, group: usize, mut bits: u64, depth: usize, out: &mut Overlaps) {
        while bits != 0 {
            let slot = group * GROUP_SLOTS + bits.trailing_zeros() as usize;
            if let Some(Some(s)) = self.slots.get(slot) {
                out.hits.push((s.id, depth));
            }
            bits &= bits - 1;
        }
    }

    /// Distinct blocks `replica` holds.
    pub fn blocks(&self, replica: ReplicaId) -> usize {
        self.by_id.get(&replica).map_or(0, |&slot| self.slot(slot).blocks)
    }

    /// (block, replica) pairs present, over all replicas.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Replicas holding at least one block.
    pub fn replicas(&self) -> usize {
        self.slots.iter().flatten().filter(|slot| slot.blocks > 0).count()
    }

    /// Heap bytes held by the index, from table capacities (hashbrown's layout: per bucket
    /// one key-value pair plus one control byte, plus 16 trailing control bytes per table).
    pub fn memory_bytes(&self) -> usize {
        let tables: usize = self.groups.iter().flat_map(|group| group.shards.iter()).map(table_bytes).sum();
        let groups = self.groups.capacity() * size_of::<Group>()
            + self.groups.len() * SHARDS * size_of::<Map<BlockHash, u64>>();
        tables
            + groups
            + table_bytes(&self.by_id)
            + self.extra.iter().map(table_bytes).sum::<usize>()
            + self.extra.capacity() * size_of::<Map<(BlockHash, u32), u32>>()
            + self.slots.capacity() * size_of::<Option<Slot>>()
    }

    fn slot_or_assign(&mut self, replica: ReplicaId) -> u32 {
        if let Some(&slot) = self.by_id.get(&replica) {
            return slot;
        }
        let index = match self.slots.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[index] = Some(Slot { id: replica, blocks: 0 });
        let slot = u32::try_from(index).expect("fewer than 2^32 replicas");
        let (g, bit) = split(slot);
        while self.groups.len() <= g {
            self.groups.push(Group::new(self.hasher));
        }
        self.groups[g].live |= bit;
        self.by_id.insert(replica, slot);
        slot
    }

    fn slot(&self, slot: u32) -> &Slot {
        self.slots[slot as usize].as_ref().expect("slot in by_id is assigned")
    }

    fn slot_mut(&mut self, slot: u32) -> &mut Slot {
        self.slots[slot as usize].as_mut().expect("slot in by_id is assigned")
    }
}

/// Frees an empty table and halves a sparse one, so memory follows the live blocks.
/// Shrinking only below a quarter full keeps the cost amortised O(1) per removal.
pub(crate) fn shrink_if_sparse<K, V, S>(map: &mut HashMap<K, V, S>)
where
    K: std::hash::Hash + Eq,
    S: std::hash::BuildHasher + Clone,
{
    if map.is_empty() {
        if map.capacity() > 0 {
            *map = HashMap::with_hasher(map.hasher().clone());
        }
    } else if map.capacity() > MIN_SHRINK_CAPACITY && map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}

/// Allocation size of a hashbrown table, reconstructed from its item capacity.
fn table_bytes<K, V>(map: &Map<K, V>) -> usize {
    const GROUP_WIDTH: usize = 16;
    let buckets = match map.capacity() {
        0 => return 0,
        cap if cap < 8 => cap + 1,
        cap => cap / 7 * 8,
    };
    buckets * (size_of::<(K, V)>() + 1) + GROUP_WIDTH
}
