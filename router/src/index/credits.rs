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
//! prefix of blocks that are in the index or credited, for that replica.
//!
//! Storage: credits live in two generations of `ttl` each, with their expiry. A credit is
//! read as live until its expiry; when the current generation is `ttl` old it becomes the
//! previous one and the one before, all of whose credits have expired by then, is cleared
//! whole and reused. So a credit costs one insert and nothing to expire: removing each
//! expired pair one by one from a table holding every credit of the last `ttl` cost as
//! much as inserting it (a request with a new 8 k-token prompt credits 512 blocks).

use std::collections::HashMap;
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

/// Credited (block, replica) pairs and their expiry, in microseconds since `epoch` (block
/// hashes are uniform already: the index's one-multiply hasher, not SipHash).
type Held = HashMap<(BlockHash, ReplicaId), u64, FoldState>;

#[derive(Debug)]
struct Inner {
    /// Credits made since `since`.
    current: Held,
    /// Credits made in the `ttl` before `since`.
    previous: Held,
    since: Instant,
    epoch: Instant,
}

impl Credits {
    pub fn new(ttl: Duration) -> Self {
        let now = Instant::now();
        let held = || HashMap::with_hasher(FoldState::random());
        let inner = Inner { current: held(), previous: held(), since: now, epoch: now };
        Self { ttl, inner: Mutex::new(inner) }
    }

    /// Credits `replica` with `blocks` for the TTL.
    pub fn credit(&self, replica: ReplicaId, blocks: &[BlockHash]) {
        if self.ttl.is_zero() || blocks.is_empty() {
            return;
        }
        let mut inner = self.lock();
        let now = inner.now(self.ttl);
        let expiry = now + self.ttl.as_micros() as u64;
        inner.current.extend(blocks.iter().map(|&b| ((b, replica), expiry)));
    }

    /// The replica's events settled these blocks (stored: the index holds them now; removed:
    /// the replica dropped them): their credits end.
    pub fn confirm(&self, replica: ReplicaId, blocks: &[BlockHash]) {
        let mut inner = self.lock();
        if inner.is_empty() {
            return;
        }
        for &b in blocks {
            inner.current.remove(&(b, replica));
            inner.previous.remove(&(b, replica));
        }
    }

    /// The request these blocks were credited for went elsewhere (the replica refused it or
    /// failed): their credits end.
    pub fn withdraw(&self, replica: ReplicaId, blocks: &[BlockHash]) {
        self.confirm(replica, blocks);
    }

    /// Extends `overlap` (the replica's index overlap of `blocks`) through credited blocks.
    pub fn extend(&self, replica: ReplicaId, blocks: &[BlockHash], overlap: usize) -> usize {
        let mut inner = self.lock();
        if inner.is_empty() {
            return overlap;
        }
        let now = inner.now(self.ttl);
        overlap + blocks[overlap..].iter().take_while(|&&b| inner.live((b, replica), now)).count()
    }

    /// Live credited (block, replica) pairs (for metrics and tests).
    pub fn len(&self) -> usize {
        let mut inner = self.lock();
        let now = inner.now(self.ttl);
        let inner = &*inner;
        let current = inner.current.values().filter(|&&e| e > now).count();
        let previous = inner
            .previous
            .iter()
            .filter(|&(k, &e)| e > now && inner.current.get(k).is_none_or(|&c| c <= now));
        current + previous.count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every credit of a replica (it was removed or restarted).
    pub fn forget(&self, replica: ReplicaId) {
        let mut inner = self.lock();
        inner.current.retain(|(_, r), _| *r != replica);
        inner.previous.retain(|(_, r), _| *r != replica);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    /// Now, in microseconds since `epoch`, after turning the generations over if the current
    /// one is `ttl` old.
    fn now(&mut self, ttl: Duration) -> u64 {
        let now = Instant::now();
        if now.duration_since(self.since) >= ttl {
            // Everything in `previous` was credited at least `ttl` before `since`: expired.
            self.previous.clear();
            std::mem::swap(&mut self.previous, &mut self.current);
            if now.duration_since(self.since) >= 2 * ttl {
                self.previous.clear();
            }
            self.since = now;
        }
        now.duration_since(self.epoch).as_micros() as u64
    }

    fn live(&self, key: (BlockHash, ReplicaId), now: u64) -> bool {
        self.current.get(&key).or_else(|| self.previous.get(&key)).is_some_and(|&expiry| expiry > now)
    }

    fn is_empty(&self) -> bool {
        self.current.is_empty() && self.previous.is_empty()
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

    #[derive(Clone, Debug)]
    enum Op {
        Credit(u32, Vec<u64>),
        Confirm(u32, Vec<u64>),
        Forget(u32),
        /// Milliseconds.
        Advance(u64),
        Extend(u32, Vec<u64>, usize),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let blocks = || proptest::collection::vec(0..12u64, 0..6);
        prop_oneof![
            3 => (0..3u32, blocks()).prop_map(|(r, b)| Op::Credit(r, b)),
            1 => (0..3u32, blocks()).prop_map(|(r, b)| Op::Confirm(r, b)),
            1 => (0..3u32).prop_map(Op::Forget),
            3 => prop_oneof![0..5u64, 30..70u64, 90..110u64, 190..450u64].prop_map(Op::Advance),
            3 => (0..3u32, blocks(), 0..3usize).prop_map(|(r, b, o)| Op::Extend(r, b, o)),
        ]
    }

    proptest::proptest! {
        /// Against a map of every credit's expiry, with a 100 ms TTL and time moving by
        /// less than, about and more than it: every credit lives exactly its TTL unless
        /// confirmed or forgotten, whichever generation holds it.
        #[test]
        fn credits_behave_like_a_map_of_expiries(ops in proptest::collection::vec(op(), 1..60)) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
            runtime.block_on(async {
                let ttl = Duration::from_millis(100);
                let credits = Credits::new(ttl);
                let mut model: HashMap<(BlockHash, ReplicaId), u64> = HashMap::new();
                let mut now = 0u64;
                for op in ops {
                    match op {
                        Op::Credit(r, blocks) => {
                            credits.credit(ReplicaId(r), &blocks.iter().map(|&b| h(b)).collect::<Vec<_>>());
                            for b in blocks {
                                model.insert((h(b), ReplicaId(r)), now + 100);
                            }
                        }
                        Op::Confirm(r, blocks) => {
                            credits.confirm(ReplicaId(r), &blocks.iter().map(|&b| h(b)).collect::<Vec<_>>());
                            for b in blocks {
                                model.remove(&(h(b), ReplicaId(r)));
                            }
                        }
                        Op::Forget(r) => {
                            credits.forget(ReplicaId(r));
                            model.retain(|(_, replica), _| replica.0 != r);
                        }
                        Op::Advance(ms) => {
                            tokio::time::advance(Duration::from_millis(ms)).await;
                            now += ms;
                        }
                        Op::Extend(r, blocks, overlap) => {
                            let blocks: Vec<BlockHash> = blocks.iter().map(|&b| h(b)).collect();
                            let overlap = overlap.min(blocks.len());
                            let live = |b: &BlockHash| model.get(&(*b, ReplicaId(r))).is_some_and(|&e| e > now);
                            let want = overlap + blocks[overlap..].iter().take_while(|b| live(b)).count();
                            proptest::prop_assert_eq!(credits.extend(ReplicaId(r), &blocks, overlap), want);
                        }
                    }
                    let live = model.values().filter(|&&e| e > now).count();
                    proptest::prop_assert_eq!(credits.len(), live);
                }
                Ok(())
            })?;
        }
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
