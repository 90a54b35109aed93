//! The prefix index: which replica holds which KV blocks, and for a request's chained block
//! hashes `[h0, hn)` how many leading blocks each replica holds without a gap, for every
//! replica in one walk.
//!
//! # Data structure
//!
//! - Each replica gets a dense *slot* (lowest free one first); slot `s` is bit `s % 64` of
//!   *group* `s / 64`. Fleets up to 64 replicas have one group.
//! - Per group, a table `BlockHash → u64` presence mask (bit set ⇔ that slot holds the
//!   block): 16 bytes a row, shared by all the replicas that hold the block. It is split into
//!   256 shards by the hash's top 8 bits, so a resize or a `clear_replica` step only ever
//!   holds the lock over 1/256 of it. Tables are std `HashMap`s (hashbrown) with a folded
//!   multiply for a hasher (`index/hasher.rs`): block hashes are already uniform xxh3 outputs.
//! - Reference counts: the bit is the first reference. References beyond the first (vLLM
//!   stores a block it already holds, and removes it as often) go to a side table
//!   `(BlockHash, slot) → extra`, empty in the common case, so refcounts cost nothing per
//!   entry. It is split into the same 256 shards (created at the first such reference,
//!   dropped when the last replica leaves), so a `clear_replica` step sweeps only its own.
//! - Per slot: the replica id and its count of distinct blocks.
//!
//! **Lookup.** Per group: `alive` = the group's assigned slots; for block `i`,
//! `alive' = alive & mask(h_i)`; the slots in `alive & !alive'` have overlap `i`; stop when
//! `alive` is empty; the survivors have overlap `n`. That is one table probe and an AND per
//! block walked (per group). Results go to a reusable [`Overlaps`] buffer, which only lists
//! replicas with a non-zero overlap.
//!
//! **Invariants.** (1) A table has a row for `h` iff its mask is non-zero: a block's memory is
//! freed when its last holder releases it; an emptied table frees its allocation and one
//! under a quarter full halves (amortised O(1)). (2) An `extra` row for `(h, s)` implies bit
//! `s` is set in `h`'s mask. (3) A slot's block count equals the number of masks with its
//! bit; `entries()` is their sum. (4) A slot is only reused once no table holds its bit.
//!
//! **Costs.** `store`/`remove`: O(1) per hash. `clear_replica`: one sweep of its group's
//! table and of the references beyond the first, O(distinct blocks in the group + such
//! references) rather than O(blocks it held); 1 k blocks cleared beside another replica's
//! 200 k such references take 1.5 ms in all (`benches/index.rs`). Keeping a per-replica
//! block list instead would add 10-20 bytes to every (block, replica) entry for an operation
//! that only runs when a replica restarts or leaves; the sweep of a 1 M-block table takes
//! 2.9 ms, as 256 lock holds of about 11 µs.
//!
//! # Concurrency: one `RwLock` around the index, taken once per lookup
//!
//! [`SharedIndex`] wraps a [`PrefixIndex`] in a `std::sync::RwLock`. A lookup takes the read
//! lock once for its whole walk; writers apply at most 32 hashes (or one table shard) per
//! write-lock hold, about a microsecond.
//!
//! One refinement was needed. The std lock lets a writer that unlocks and relocks at once
//! barge past the readers it just woke: with a writer streaming chunks back to back (a
//! snapshot replay) on a core of its own, lookups measured p50 3.8 µs, p99 0.53 ms, p99.9
//! 1.2 ms. So a blocked lookup counts itself in `queued_readers`, and a writer lets that
//! count drain before its next chunk; both sides spin up to 3 µs (longer than a chunk),
//! then yield, and only block after 20 µs (a preempted lock holder).
//!
//! Measured on the 2-core build machine, shared with other builds (so the spread between
//! runs is large), reader timing 128-block × 16-replica lookups while one writer thread
//! churns the index (`INDEX_REPORTS=concurrency`, 3-10 runs each). The plain lock's better
//! best cases are runs where the writer did not get a core to itself, which hides barging:
//!
//! | design | p50 / p99, no writer | p99, writer at 1 M block-ops/s | p99, writer flat out |
//! |---|---|---|---|
//! | `SharedIndex` (chosen) | 0.41 / 0.45-0.9 µs | 0.65-3.8 µs | 1.0-7 µs |
//! | plain std `RwLock`, 64-hash chunks | 0.40 / 0.5-1.0 µs | 0.6-1.4 µs | 0.75-3.5 µs, 530 µs when the writer had a free core |
//! | `parking_lot` `RwLock`, fair unlock | 0.40 / 0.5-0.8 µs | 1.6-71 µs | 0.9-70 µs (hand-off waits for the reader to wake) |
//! | `DashMap<BlockHash, u64>` masks, lock per block | 1.65 / 1.8-2.4 µs | 1.8-12 µs | 2.4-38 µs |
//! | snapshots (arc-swap style) | publishing one means cloning the index: 17-22 ms at 1 M blocks, and twice the memory | | |
//!
//! The DashMap costs 13 ns per block in shard locking alone and ingests no faster (18-21 M
//! vs 17-22 M block-ops/s, without even keeping refcounts). p99.9 under a writer is 2-70 µs
//! for every design, and as high for a control whose writer churns a *different* index:
//! that tail is the CPU scheduler on an oversubscribed machine, not the index.
//!
//! # Measured (`cargo bench -p kvroute-router --bench index`, release, 2 shared cores)
//!
//! - Ingest: 17-22 M block-ops/s on one core through `SharedIndex` (store + remove churn of
//!   128-block batches over 16 replicas, 512 k entries live); 11-15 M in runs at load 3-4.
//! - Memory (counting allocator): 35.7 bytes per (block, replica) entry at 1 M distinct
//!   blocks each held by one replica, which is the worst case (hashbrown is at its least
//!   full, 48 %, just past a doubling); 23.8 B at 1.5 M; 8.9 B at 1 M blocks × 4 replicas.
//! - Lookup, fleet with shared prefixes and partial overlaps, p50 / p99 (single lookups timed
//!   with `Instant`, including about 20 ns of timer):
//!
//! | blocks | 4 replicas | 16 replicas | 64 replicas |
//! |---|---|---|---|
//! | 32 | 140 / 190 ns | 150 / 190 ns | 190 / 360 ns |
//! | 128 | 440 / 540 ns | 480 / 620 ns | 620 / 1020 ns |
//! | 1024 | 2.8 / 5.2 µs | 4.4 / 10 µs | 8.0 / 14 µs |
//!
//!   That is 5-11 ns per block walked (a 1024-block request walks 550-750 blocks before
//!   every replica has dropped out).

mod credits;
pub(crate) mod hasher;
mod ranks;
mod table;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, TryLockError};
use std::time::{Duration, Instant};

use kvroute_proto::{BlockHash, ReplicaId};

pub use credits::{CreditHold, Credits, Stamp};
pub(crate) use hasher::FoldState;
pub use ranks::{RankGuard, RankView, Ranks, views as rank_views};
pub use table::PrefixIndex;
pub(crate) use table::shrink_if_sparse;

/// Who waits for which (block, replica) to be stored.
type Waiters = HashMap<(BlockHash, ReplicaId), Vec<Arc<dyn OnStored>>>;

/// Told once the replica's events store a block ([`SharedIndex::wait_stored`]).
pub trait OnStored: Send + Sync + std::fmt::Debug {
    fn stored(&self);
}

/// Hashes applied per write-lock hold by [`SharedIndex`], bounding how long a lookup waits.
const WRITE_CHUNK: usize = 32;
/// See [`SharedIndex::clears_by_reference`]: removing one reference costs about what a sweep
/// costs an entry several times over (a hash lookup against a pass over a table).
const SWEEP_SHARE: usize = 8;

/// How long a lock waiter busy-spins: longer than a write chunk's lock hold (about 1 µs).
const SPIN: Duration = Duration::from_micros(3);
/// How long a lock waiter spins and yields before it blocks; a writer also lets queued
/// lookups go first for at most this long.
const MAX_WAIT: Duration = Duration::from_micros(20);

/// Per-replica overlaps found by a lookup: `(replica, leading blocks held)` for every replica
/// whose overlap is at least one block. Reuse one value across lookups to avoid allocating.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlaps {
    /// In replica order.
    hits: Vec<(ReplicaId, usize)>,
}

impl Overlaps {
    /// An empty result, to pass to `lookup_into`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leading blocks `replica` holds (0 if it holds none of them).
    pub fn get(&self, replica: ReplicaId) -> usize {
        self.hits.binary_search_by_key(&replica, |&(id, _)| id).map_or(0, |i| self.hits[i].1)
    }

    /// Every replica with a non-zero overlap, in replica order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (ReplicaId, usize)> + '_ {
        self.hits.iter().copied()
    }

    /// The replica with the longest overlap (the lowest id among ties), if any.
    pub fn best(&self) -> Option<(ReplicaId, usize)> {
        self.iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
    }

    /// Replicas with a non-zero overlap.
    pub fn len(&self) -> usize {
        self.hits.len()
    }

    /// True if no replica holds the request's first block.
    pub fn is_empty(&self) -> bool {
        self.hits.is_empty()
    }
}

/// Size figures for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Replicas holding at least one block.
    pub replicas: usize,
    /// (block, replica) pairs present.
    pub entries: usize,
    /// Estimated heap bytes (see [`PrefixIndex::memory_bytes`]).
    pub memory_bytes: usize,
}

/// The index shared by the ingest tasks (writers) and the request path (readers): a cheap,
/// cloneable handle to one [`PrefixIndex`] behind a reader-writer lock.
///
/// A lookup takes the read lock once for its whole walk. Writes take the write lock for at
/// most 32 hashes (or one table shard, for `clear_replica`) at a time and let waiting
/// lookups go first, so a lookup waits for at most about a microsecond of one writer's work.
/// Each replica's operations must come from one writer (its ingest task), in event order.
/// A very large `store` (a snapshot of a million blocks) runs for tens of milliseconds;
/// call it from a blocking-friendly context.
#[derive(Clone, Debug)]
pub struct SharedIndex {
    inner: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    index: RwLock<PrefixIndex>,
    /// Pending routing decisions; events for a (block, replica) end its credit.
    credits: Credits,
    /// Requests waiting for a block to be stored on a replica ([`SharedIndex::wait_stored`]),
    /// and how many there are (read without the lock by every store).
    waiters: Mutex<Waiters>,
    waiting: AtomicUsize,
    /// Lookups blocked on the lock. The std lock lets a writer that unlocks and relocks at
    /// once barge past readers it just woke, so a writer streaming chunks back to back
    /// (a snapshot replay) could starve lookups for milliseconds; writers wait for this to
    /// drain (up to [`MAX_WAIT`]) before each chunk instead.
    queued_readers: AtomicUsize,
}

impl Default for SharedIndex {
    fn default() -> Self {
        Self::with_credit_ttl(Duration::ZERO)
    }
}

impl SharedIndex {
    /// An empty index without credits.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index whose routing credits last `ttl` unless events settle them first.
    pub fn with_credit_ttl(ttl: Duration) -> Self {
        Self {
            inner: Arc::new(Shared {
                index: RwLock::default(),
                credits: Credits::new(ttl),
                waiters: Mutex::default(),
                waiting: AtomicUsize::new(0),
                queued_readers: AtomicUsize::new(0),
            }),
        }
    }

    /// Credits of pending routing decisions (see [`Credits`]).
    pub fn credits(&self) -> &Credits {
        &self.inner.credits
    }

    /// See [`PrefixIndex::store`]; then ends the replica's credits for these blocks (after:
    /// a lookup between the chunks of a long run sees each block credited or stored, never
    /// neither).
    pub fn store(&self, replica: ReplicaId, hashes: &[BlockHash]) -> usize {
        let stored =
            hashes.chunks(WRITE_CHUNK).map(|chunk| self.write(|index| index.store(replica, chunk))).sum();
        self.inner.credits.confirm(replica, hashes);
        if self.inner.waiting.load(Ordering::Acquire) > 0 {
            self.notify_stored(replica, hashes);
        }
        stored
    }

    /// Calls `waiter` once the replica's events store `block` on `replica` (unless
    /// [`Self::unwait_stored`] comes first).
    pub fn wait_stored(&self, replica: ReplicaId, block: BlockHash, waiter: Arc<dyn OnStored>) {
        let mut waiters = self.inner.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        waiters.entry((block, replica)).or_default().push(waiter);
        self.inner.waiting.fetch_add(1, Ordering::Release);
    }

    /// Takes back a [`Self::wait_stored`] that has not been called.
    pub fn unwait_stored(&self, replica: ReplicaId, block: BlockHash, waiter: &Arc<dyn OnStored>) {
        let mut waiters = self.inner.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(list) = waiters.get_mut(&(block, replica)) else { return };
        let before = list.len();
        list.retain(|w| !std::ptr::addr_eq(Arc::as_ptr(w), Arc::as_ptr(waiter)));
        self.inner.waiting.fetch_sub(before - list.len(), Ordering::Release);
        if list.is_empty() {
            waiters.remove(&(block, replica));
        }
    }

    fn notify_stored(&self, replica: ReplicaId, hashes: &[BlockHash]) {
        let mut called = Vec::new();
        {
            let mut waiters = self.inner.waiters.lock().unwrap_or_else(PoisonError::into_inner);
            for &hash in hashes {
                if let Some(list) = waiters.remove(&(hash, replica)) {
                    called.extend(list);
                }
            }
            self.inner.waiting.fetch_sub(called.len(), Ordering::Release);
        }
        for waiter in called {
            waiter.stored();
        }
    }

    /// See [`PrefixIndex::remove`]; also ends the replica's credits for these blocks.
    pub fn remove(&self, replica: ReplicaId, hashes: &[BlockHash]) -> usize {
        self.inner.credits.confirm(replica, hashes);
        hashes.chunks(WRITE_CHUNK).map(|chunk| self.write(|index| index.remove(replica, chunk))).sum()
    }

    /// See [`PrefixIndex::clear_replica`], and forgets the replica's credits (it was removed);
    /// releases the lock between table shards.
    pub fn clear_replica(&self, replica: ReplicaId) -> usize {
        self.inner.credits.forget(replica);
        self.sweep_replica(replica)
    }

    /// [`Self::clear_replica`] keeping the replica's credits: the requests sent to it still
    /// store their prompts (its cache was reset, or its view is rebuilt).
    pub fn sweep_replica(&self, replica: ReplicaId) -> usize {
        let freed =
            (0..table::SHARDS).map(|shard| self.write(|index| index.clear_shard(replica, shard))).sum();
        self.write(|index| index.release(replica));
        freed
    }

    /// Whether clearing a replica that holds `references` is quicker reference by reference
    /// ([`Self::clear_held`]) than by a sweep, which visits the whole table of the replica's
    /// group (up to 64 replicas' blocks, 256 times under the write lock): when they are under
    /// a [`SWEEP_SHARE`]th of the table's entries.
    pub fn clears_by_reference(&self, references: usize) -> bool {
        references.saturating_mul(SWEEP_SHARE) < self.read().entries()
    }

    /// [`Self::sweep_replica`] of a replica whose every reference is in `held` (repeats
    /// included): the ingest's engine map, which mirrors what the replica's events put in
    /// the index. They are removed one by one; whatever of the replica's is left then (the
    /// map and the index disagreed) is swept. Credits stay, as with the sweep.
    pub fn clear_held(&self, replica: ReplicaId, held: &[BlockHash]) {
        self.drop_held(replica, held);
        if self.blocks(replica) == 0 {
            self.write(|index| index.release(replica));
        } else {
            tracing::warn!(
                replica = replica.0,
                "the index held blocks its events did not account for; swept"
            );
            self.sweep_replica(replica);
        }
    }

    /// Takes the references `held` (repeats included) off the replica, keeping its credits
    /// ([`Self::remove`] ends them): one data-parallel rank's share of a replica, cleared
    /// while the requests sent to the replica still store their prompts.
    pub fn drop_held(&self, replica: ReplicaId, held: &[BlockHash]) {
        for chunk in held.chunks(WRITE_CHUNK) {
            self.write(|index| index.remove(replica, chunk));
        }
    }

    /// Every replica's overlap with `hashes` (see [`PrefixIndex::lookup_into`]).
    pub fn lookup_into(&self, hashes: &[BlockHash], out: &mut Overlaps) {
        self.read().lookup_into(hashes, out);
    }

    /// [`Self::lookup`], then `with_credits` of its result and the credits, under the same
    /// read of the index: a [`Self::store`] (the index, then the end of its credits) cannot
    /// fall between the two, so each block is seen stored or credited, never neither. (Read
    /// one after the other, a block stored and confirmed in between was seen as neither.)
    pub fn lookup_with_credits<T>(
        &self,
        hashes: &[BlockHash],
        with_credits: impl FnOnce(&Overlaps, &Credits) -> T,
    ) -> (Overlaps, T) {
        let index = self.read();
        let mut out = Overlaps::new();
        index.lookup_into(hashes, &mut out);
        // No writer takes the index's lock while it holds the credits', so this cannot deadlock.
        let credited = with_credits(&out, &self.inner.credits);
        drop(index);
        (out, credited)
    }

    /// Where each listed replica's run of `hashes` held here, begun at its start, ends (see
    /// [`PrefixIndex::continue_into`]); nothing for an empty index, without a walk.
    pub fn continue_from(&self, hashes: &[BlockHash], from: &[(ReplicaId, usize)]) -> Overlaps {
        let mut out = Overlaps::new();
        let index = self.read();
        if index.entries() > 0 {
            index.continue_into(hashes, from, &mut out);
        }
        out
    }

    /// Whether no replica holds a block here.
    pub fn is_empty(&self) -> bool {
        self.read().entries() == 0
    }

    /// Like [`Self::lookup_into`] with a fresh result.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Overlaps {
        let mut out = Overlaps::new();
        self.lookup_into(hashes, &mut out);
        out
    }

    /// Distinct blocks `replica` holds.
    pub fn blocks(&self, replica: ReplicaId) -> usize {
        self.read().blocks(replica)
    }

    /// Current size figures.
    pub fn stats(&self) -> IndexStats {
        let index = self.read();
        IndexStats {
            replicas: index.replicas(),
            entries: index.entries(),
            memory_bytes: index.memory_bytes(),
        }
    }

    // Every operation leaves the index consistent before it could panic (only on a broken
    // invariant), so a poisoned lock still guards a usable index.
    fn read(&self) -> RwLockReadGuard<'_, PrefixIndex> {
        let try_read = || match self.inner.index.try_read() {
            Ok(index) => Some(index),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if let Some(index) = try_read() {
            return index;
        }
        // A writer holds the lock for one chunk. Spin (rather than sleep and pay a wake-up of
        // tens of microseconds) while counted as queued, so the writer lets us in next.
        // Relaxed: the counter is only a scheduling hint; the lock orders the data.
        self.inner.queued_readers.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        let index = loop {
            if let Some(index) = try_read() {
                break index;
            }
            if !back_off(start) {
                break self.inner.index.read().unwrap_or_else(PoisonError::into_inner);
            }
        };
        self.inner.queued_readers.fetch_sub(1, Ordering::Relaxed);
        index
    }

    /// Runs one bounded write step under the write lock. The writer spins for the lock
    /// (after any queued lookups) instead of blocking at once: a blocked writer makes the
    /// std lock turn new readers away until it has woken up, which takes tens of
    /// microseconds on a busy machine.
    fn write<T>(&self, step: impl FnOnce(&mut PrefixIndex) -> T) -> T {
        let try_write = || {
            if self.inner.queued_readers.load(Ordering::Relaxed) != 0 {
                return None;
            }
            match self.inner.index.try_write() {
                Ok(index) => Some(index),
                Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            }
        };
        let mut index = match try_write() {
            Some(index) => index,
            None => {
                let start = Instant::now();
                loop {
                    if !back_off(start) {
                        break self.inner.index.write().unwrap_or_else(PoisonError::into_inner);
                    }
                    if let Some(index) = try_write() {
                        break index;
                    }
                }
            }
        };
        step(&mut index)
    }
}

/// One step of waiting for the lock that began at `start`: spin through a normal chunk's
/// hold, then yield the CPU (the holder may be preempted, or waiting for this very core);
/// false once [`MAX_WAIT`] has passed and the caller should block instead.
fn back_off(start: Instant) -> bool {
    let waited = start.elapsed();
    if waited < SPIN {
        std::hint::spin_loop();
    } else if waited < MAX_WAIT {
        std::thread::yield_now();
    } else {
        return false;
    }
    true
}
