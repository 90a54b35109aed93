//! Replicas without KV events: their cache is predicted from this router's own routing.
//!
//! A replica configured with no event endpoint (an engine started without
//! `--kv-events-config`, or one that publishes none) is not routed on load alone: every
//! request this router sends it that the replica answers with success stores the request's
//! prompt blocks in the index under the replica, at the answer's first data (the prefill is
//! done, so the replica holds them). Those entries are what the replica's events would have
//! said, as far as this router can see; they leave the index by age and by size:
//!
//! - **Age.** Blocks are kept in two generations of `ttl / 2` each: a block used again moves
//!   to the current one; when the current one is `ttl / 2` old it becomes the previous one,
//!   and what the previous one held that was not used since leaves the index. So a block
//!   leaves between `ttl / 2` and `ttl` after the last request that used it
//!   (`--predicted-ttl-ms`). The age bound stands for what the router cannot see: other
//!   routers' and clients' requests to the replica, and its generated tokens, which evict
//!   blocks too.
//! - **Size.** When the current generation holds half the replica's capacity
//!   (`--predicted-cache-tokens` in blocks), the generations turn before the next request's
//!   blocks go in. So the replica is never predicted to hold more than its capacity and one
//!   request's blocks, and what it holds is what it was
//!   sent last: the least recently used blocks leave first, as from vLLM's and SGLang's
//!   caches.
//!
//! The replica's stream state is `PREDICTED`. Each router predicts from its own requests
//! only: with several routers in front of one such fleet, each sees part of every replica's
//! cache (the replicas' reported load is still shared).

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kvroute_proto::{BlockHash, ReplicaId};
use tokio::time::Instant;

use crate::index::{FoldState, SharedIndex};

type Blocks = HashSet<BlockHash, FoldState>;

/// The predicted cache of one replica without events: what it puts in the index, and when
/// it takes it out.
#[derive(Debug)]
pub struct Prediction {
    replica: ReplicaId,
    index: SharedIndex,
    /// How long a generation lasts: half the TTL.
    generation: Duration,
    /// Blocks the current generation may reach before the generations turn.
    half_capacity: usize,
    inner: Mutex<Generations>,
}

#[derive(Debug)]
struct Generations {
    /// Blocks used since `since`.
    current: Blocks,
    /// Blocks used in the generation before, and not since.
    previous: Blocks,
    since: Instant,
    /// The replica left: nothing more goes into the index.
    closed: bool,
}

impl Prediction {
    /// The prediction of `replica`'s cache of at most `capacity_blocks`, each block kept for
    /// at most `ttl` after its last use.
    pub fn new(replica: ReplicaId, index: SharedIndex, ttl: Duration, capacity_blocks: usize) -> Self {
        let hasher = FoldState::random();
        let inner = Generations {
            current: HashSet::with_hasher(hasher),
            previous: HashSet::with_hasher(hasher),
            since: Instant::now(),
            closed: false,
        };
        Self {
            replica,
            index,
            generation: ttl / 2,
            half_capacity: (capacity_blocks / 2).max(1),
            inner: Mutex::new(inner),
        }
    }

    /// How often [`Self::expire`] is to run.
    pub fn generation(&self) -> Duration {
        self.generation
    }

    /// The replica was sent `blocks` and began answering: it holds them now.
    pub fn record(&self, blocks: &[BlockHash]) {
        let mut inner = self.lock();
        if inner.closed {
            return;
        }
        self.turn_if_due(&mut inner);
        if inner.current.len() >= self.half_capacity {
            self.turn(&mut inner);
        }
        let Generations { current, previous, .. } = &mut *inner;
        let new: Vec<BlockHash> =
            blocks.iter().copied().filter(|&b| current.insert(b) && !previous.remove(&b)).collect();
        // (Written under the lock: the index takes one replica's writes in order.)
        self.index.store(self.replica, &new);
    }

    /// Takes out of the index what has not been used for the TTL.
    pub fn expire(&self) {
        let mut inner = self.lock();
        if !inner.closed {
            self.turn_if_due(&mut inner);
        }
    }

    /// The replica left (its index entries are cleared next): nothing more is recorded.
    pub fn close(&self) {
        let mut inner = self.lock();
        let Generations { current, previous, closed, .. } = &mut *inner;
        *closed = true;
        for blocks in [current, previous] {
            blocks.clear();
            blocks.shrink_to_fit();
        }
    }

    /// Distinct blocks predicted.
    pub fn blocks(&self) -> usize {
        let inner = self.lock();
        inner.current.len() + inner.previous.len()
    }

    fn turn_if_due(&self, inner: &mut Generations) {
        let age = inner.since.elapsed();
        if age >= self.generation {
            self.turn(inner);
            // Nothing was used for a whole generation more: what was current goes too.
            if age >= 2 * self.generation {
                self.turn(inner);
            }
        }
    }

    /// The current generation becomes the previous one; the previous one leaves the index.
    fn turn(&self, inner: &mut Generations) {
        let gone: Vec<BlockHash> = inner.previous.drain().collect();
        self.index.remove(self.replica, &gone);
        std::mem::swap(&mut inner.previous, &mut inner.current);
        inner.since = Instant::now();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> BlockHash {
        BlockHash(n)
    }

    fn hs(range: std::ops::Range<u64>) -> Vec<BlockHash> {
        range.map(h).collect()
    }

    const R: ReplicaId = ReplicaId(3);

    /// Recorded blocks are the replica's overlap at once; a block used twice is one entry.
    #[tokio::test(start_paused = true)]
    async fn recorded_blocks_are_held_once() {
        let index = SharedIndex::new();
        let p = Prediction::new(R, index.clone(), Duration::from_secs(10), 1000);
        p.record(&hs(0..4));
        p.record(&hs(0..6));
        assert_eq!(index.lookup(&hs(0..8)).get(R), 6);
        assert_eq!(index.blocks(R), 6);
        assert_eq!(p.blocks(), 6);
    }

    /// A block leaves between half the TTL and the TTL after its last use; one used again
    /// stays.
    #[tokio::test(start_paused = true)]
    async fn blocks_leave_within_the_ttl_of_their_last_use() {
        let index = SharedIndex::new();
        let p = Prediction::new(R, index.clone(), Duration::from_secs(10), 1000);
        p.record(&hs(0..4));
        tokio::time::advance(Duration::from_secs(5)).await;
        p.expire();
        assert_eq!(index.blocks(R), 4, "half the TTL: still held");
        p.record(&hs(0..2));
        tokio::time::advance(Duration::from_secs(5)).await;
        p.expire();
        assert_eq!(index.lookup(&hs(0..4)).get(R), 2, "the two used again stay");
        assert_eq!(index.blocks(R), 2);
        tokio::time::advance(Duration::from_secs(10)).await;
        p.expire();
        assert_eq!(index.blocks(R), 0, "a whole TTL unused: gone");
        assert_eq!(p.blocks(), 0);
    }

    /// Past half the capacity the generations turn: the most recently sent blocks stay, the
    /// oldest leave, and the prediction stays about the capacity.
    #[tokio::test(start_paused = true)]
    async fn the_least_recently_used_blocks_leave_past_the_capacity() {
        let index = SharedIndex::new();
        let p = Prediction::new(R, index.clone(), Duration::from_secs(3600), 8);
        p.record(&hs(0..4));
        p.record(&hs(10..14));
        p.record(&hs(20..24));
        assert!(index.blocks(R) <= 8, "{} blocks over a capacity of 8", index.blocks(R));
        assert_eq!(index.lookup(&hs(20..24)).get(R), 4, "the last sent is held");
        assert_eq!(index.lookup(&hs(10..14)).get(R), 4);
        assert_eq!(index.lookup(&hs(0..4)).get(R), 0, "the first sent is gone");
    }

    /// A closed prediction records nothing more (its replica's entries were cleared).
    #[tokio::test(start_paused = true)]
    async fn a_closed_prediction_records_nothing() {
        let index = SharedIndex::new();
        let p = Prediction::new(R, index.clone(), Duration::from_secs(10), 100);
        p.record(&hs(0..2));
        p.close();
        index.clear_replica(R);
        p.record(&hs(0..4));
        p.expire();
        assert_eq!(index.blocks(R), 0);
    }
}
