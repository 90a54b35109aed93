//! Short-lived credits: right after a routing decision, the chosen replica is credited with
//! the request's blocks, because its `BlockStored` events arrive only after it has admitted
//! the request. Without credits, a burst of requests sharing a new prefix would each see no
//! replica holding it and scatter across the fleet, paying the prefill once per replica.
//!
//! A credit ends when the replica's events confirm it: a `BlockStored` (the index now holds
//! the block, so the credit is redundant) or a `BlockRemoved` (the replica no longer holds
//! it) for that (block, replica) drops the credit at once, so a block that was cached and
//! later evicted is never predicted from a stale credit. A credit no event confirms lapses
//! after `ttl` (`--credit-ttl-ms`): the request failed, or the replica never cached it.
//! Lookups extend each replica's index overlap through credited blocks: overlap = longest
//! prefix of blocks that are in the index or credited, for that replica. Expired credits are
//! swept on every insert and lookup, in expiry order.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use kvroute_proto::{BlockHash, ReplicaId};
use tokio::time::Instant;

use super::FoldState;

/// Credits of pending routing decisions.
#[derive(Debug)]
pub struct Credits {
    ttl: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Credited (block, replica) pairs with the expiry of their latest credit (block hashes
    /// are uniform already: the index's one-multiply hasher, not SipHash).
    held: HashMap<(BlockHash, ReplicaId), Instant, FoldState>,
    /// Credits in the order they expire.
    queue: VecDeque<(Instant, ReplicaId, Vec<BlockHash>)>,
}

impl Credits {
    pub fn new(ttl: Duration) -> Self {
        let inner = Inner { held: HashMap::with_hasher(FoldState::random()), queue: VecDeque::new() };
        Self { ttl, inner: Mutex::new(inner) }
    }

    /// Credits `replica` with `blocks` for the TTL.
    pub fn credit(&self, replica: ReplicaId, blocks: &[BlockHash]) {
        if self.ttl.is_zero() || blocks.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.sweep(now);
        let expiry = now + self.ttl;
        for &b in blocks {
            inner.held.insert((b, replica), expiry);
        }
        inner.queue.push_back((expiry, replica, blocks.to_vec()));
    }

    /// The replica's events settled these blocks (stored: the index holds them now; removed:
    /// the replica dropped them): their credits end.
    pub fn confirm(&self, replica: ReplicaId, blocks: &[BlockHash]) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.held.is_empty() {
            return;
        }
        for &b in blocks {
            inner.held.remove(&(b, replica));
        }
    }

    /// Extends `overlap` (the replica's index overlap of `blocks`) through credited blocks.
    ///
    /// Sweeps expired credits first (amortized O(1) per credited block), so `held` is exact;
    /// scanning the queue for live credits instead cost O(credits in flight) per replica and
    /// request, which at a few thousand requests/s made this the decision path's hot spot.
    pub fn extend(&self, replica: ReplicaId, blocks: &[BlockHash], overlap: usize) -> usize {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.held.is_empty() {
            return overlap;
        }
        inner.sweep(Instant::now());
        overlap + blocks[overlap..].iter().take_while(|b| inner.held.contains_key(&(**b, replica))).count()
    }

    /// Live credited (block, replica) pairs (for metrics and tests).
    pub fn len(&self) -> usize {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.sweep(Instant::now());
        inner.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every credit of a replica (it was removed or restarted).
    pub fn forget(&self, replica: ReplicaId) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.held.retain(|(_, r), _| *r != replica);
        inner.queue.retain(|(_, r, _)| *r != replica);
    }
}

impl Inner {
    fn sweep(&mut self, now: Instant) {
        while self.queue.front().is_some_and(|(t, ..)| *t <= now) {
            let (_, replica, blocks) = self.queue.pop_front().expect("front exists");
            for b in blocks {
                // A later credit of the same pair keeps it alive.
                if self.held.get(&(b, replica)).is_some_and(|t| *t <= now) {
                    self.held.remove(&(b, replica));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> BlockHash {
        BlockHash(n)
    }

    #[tokio::test(start_paused = true)]
    async fn credits_extend_the_prefix_until_they_expire() {
        let c = Credits::new(Duration::from_secs(2));
        let (r0, r1) = (ReplicaId(0), ReplicaId(1));
        c.credit(r0, &[h(1), h(2), h(3)]);
        let req = [h(1), h(2), h(3), h(4)];
        assert_eq!(c.extend(r0, &req, 0), 3);
        assert_eq!(c.extend(r0, &req, 1), 3, "index overlap 1 continues through credits");
        assert_eq!(c.extend(r1, &req, 0), 0, "credits are per replica");
        assert_eq!(c.extend(r0, &[h(9), h(1)], 0), 0, "only a contiguous prefix counts");
        tokio::time::advance(Duration::from_secs(1)).await;
        c.credit(r0, &[h(1)]);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(c.extend(r0, &req, 0), 1, "the first credit lapsed, the second holds block 1");
        assert_eq!(c.len(), 1);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(c.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn events_end_credits_so_an_evicted_block_is_not_predicted() {
        let c = Credits::new(Duration::from_secs(60));
        let r = ReplicaId(0);
        c.credit(r, &[h(1), h(2), h(3)]);
        // BlockStored for 1 and 2: the index holds them now; the credit for 3 remains.
        c.confirm(r, &[h(1), h(2)]);
        assert_eq!(c.extend(r, &[h(1), h(2), h(3)], 2), 3);
        // Later the replica evicts block 2: the index overlap stops at 1 and no stale credit
        // carries the prediction through it.
        assert_eq!(c.extend(r, &[h(1), h(2), h(3)], 1), 1);
        // BlockRemoved ends a credit too.
        c.confirm(r, &[h(3)]);
        assert!(c.is_empty());
    }

    #[test]
    fn forget_drops_a_replica() {
        let c = Credits::new(Duration::from_secs(60));
        c.credit(ReplicaId(3), &[h(1), h(2)]);
        c.forget(ReplicaId(3));
        assert_eq!(c.extend(ReplicaId(3), &[h(1)], 0), 0);
        assert!(c.is_empty());
    }
}
