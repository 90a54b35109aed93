//! Short-lived credits: right after a routing decision, the chosen replica is credited with
//! the request's blocks, because its `BlockStored` events arrive only after it has admitted
//! the request. Without credits, a burst of requests sharing a new prefix would each see no
//! replica holding it and scatter across the fleet, paying the prefill once per replica.
//!
//! A decision *pins* its credits ([`Credits::pin`]): they hold however long the request waits
//! in the replica's queue, until its prefill is done (its response's first data) or it ends
//! ([`Credits::unpin`]); from then they last `ttl` (`--credit-ttl-ms`), time for the replica's
//! events to arrive. A request that fails there without starting, or whose answer is given
//! up before its first data (a stream its client left, or whose SGLang prefill failed beside
//! it), has its decision's credits withdrawn at once ([`CreditHold::withdraw_own`]): the
//! replica drops it. Pins are counted: one request's retry or end takes only its own. A
//! credit ends when the replica's events confirm it: a `BlockStored` (the index now holds
//! the block, so the credit is redundant) or a `BlockRemoved` (the replica no longer holds
//! it) for that (block, replica) drops the credit at once, pinned or not, so a block that
//! was cached and later evicted is never predicted from a stale credit. A replica removed,
//! restarted or unreachable loses all its credits ([`Credits::forget`]). Lookups extend each
//! replica's index overlap through credited blocks: overlap = its index overlap, then the
//! credited blocks that follow it without a gap (a credited run that stops at a block the
//! index alone shows is not walked past it: the overlap may come out short, never long).
//!
//! Storage: credits live in two generations of `ttl` each, with their expiry. A credit is
//! read as live until its expiry; when the current generation is `ttl` old it becomes the
//! previous one and the one before, all of whose credits have expired by then, is cleared
//! whole and reused. So a credit costs one insert and nothing to expire: removing each
//! expired pair one by one from a table holding every credit of the last `ttl` cost as
//! much as inserting it (a request with a new 8 k-token prompt credits 512 blocks). Pins
//! are counted in a table of their own, which does not turn over: a credit is live while
//! pinned whatever its expiry, and queued requests' pins are not copied each `ttl`.
//!
//! Pins are counted by (block, replica), each count stamped with the pin that began it; a
//! request's release ([`Stamp`]) takes its pin only from a count begun no later than its own
//! pin. So when events end a pinned credit and a later decision pins the block again, the
//! first request's release leaves the later one's pin alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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
    /// Pins of credits whose requests have not yet had their prefill done: how many, and the
    /// stamp of the pin that began the count.
    pins: HashMap<(BlockHash, ReplicaId), (u32, Stamp), FoldState>,
    /// The last pin's stamp.
    stamp: Stamp,
    since: Instant,
    epoch: Instant,
}

impl Credits {
    pub fn new(ttl: Duration) -> Self {
        let now = Instant::now();
        let inner = Inner {
            current: HashMap::with_hasher(FoldState::random()),
            previous: HashMap::with_hasher(FoldState::random()),
            pins: HashMap::with_hasher(FoldState::random()),
            stamp: Stamp(0),
            since: now,
            epoch: now,
        };
        Self { ttl, inner: Mutex::new(inner) }
    }

    /// How long a credit lasts once unpinned.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Credits `replica` with `blocks` for the TTL.
    pub fn credit(&self, replica: ReplicaId, blocks: &[BlockHash]) {
        self.add(replica, blocks, false);
    }

    /// Credits `replica` with `blocks`, pinned: live until the pin is taken off
    /// ([`Credits::unpin`], [`Credits::withdraw`], with the stamp returned here), then for
    /// the TTL.
    pub fn pin(&self, replica: ReplicaId, blocks: &[BlockHash]) -> Stamp {
        self.add(replica, blocks, true)
    }

    fn add(&self, replica: ReplicaId, blocks: &[BlockHash], pin: bool) -> Stamp {
        if self.ttl.is_zero() || blocks.is_empty() {
            return Stamp(0);
        }
        let mut inner = self.lock();
        let now = inner.now(self.ttl);
        let expiry = now.saturating_add(u64::try_from(self.ttl.as_micros()).unwrap_or(u64::MAX));
        inner.current.extend(blocks.iter().map(|&b| ((b, replica), expiry)));
        if !pin {
            return Stamp(0);
        }
        inner.stamp.0 += 1;
        let stamp = inner.stamp;
        for &b in blocks {
            inner.pins.entry((b, replica)).or_insert((0, stamp)).0 += 1;
        }
        stamp
    }

    /// Takes the pin `stamp` off each of `blocks` (the request's prefill is done, or it
    /// ended): they last the TTL from now.
    pub fn unpin(&self, replica: ReplicaId, blocks: &[BlockHash], stamp: Stamp) {
        if self.ttl.is_zero() || blocks.is_empty() {
            return;
        }
        let mut inner = self.lock();
        let now = inner.now(self.ttl);
        let expiry = now.saturating_add(u64::try_from(self.ttl.as_micros()).unwrap_or(u64::MAX));
        for &b in blocks {
            if inner.take_pin((b, replica), stamp) {
                inner.current.insert((b, replica), expiry);
            }
        }
    }

    /// The replica's events settled these blocks (stored: the index holds them now; removed:
    /// the replica dropped them): their credits end, pinned or not.
    pub fn confirm(&self, replica: ReplicaId, blocks: &[BlockHash]) {
        let mut inner = self.lock();
        if inner.is_empty() {
            return;
        }
        for &b in blocks {
            inner.current.remove(&(b, replica));
            inner.previous.remove(&(b, replica));
            inner.pins.remove(&(b, replica));
        }
    }

    /// The request `pinned` was pinned for (with `stamp`) went elsewhere (the replica refused
    /// it or failed): its pins come off, and the credits of `added` (the blocks only its
    /// decision credited) end unless another request pinned them meanwhile.
    pub fn withdraw(&self, replica: ReplicaId, pinned: &[BlockHash], stamp: Stamp, added: &[BlockHash]) {
        let mut inner = self.lock();
        if inner.is_empty() {
            return;
        }
        for &b in pinned {
            inner.take_pin((b, replica), stamp);
        }
        for &b in added {
            let key = (b, replica);
            if !inner.pins.contains_key(&key) {
                inner.current.remove(&key);
                inner.previous.remove(&key);
            }
        }
    }

    /// Extends `overlap` (the replica's index overlap of `blocks`) through credited blocks.
    pub fn extend(&self, replica: ReplicaId, blocks: &[BlockHash], overlap: usize) -> usize {
        self.extend_each(blocks, std::iter::once(Some((replica, overlap))))[0]
    }

    /// [`Self::extend`] for each replica of `overlaps` (a replica and its index overlap of
    /// `blocks`, or `None` for one whose credits do not count, which gets 0), under one hold
    /// of the lock: a decision reads every member's.
    pub fn extend_each(
        &self,
        blocks: &[BlockHash],
        overlaps: impl Iterator<Item = Option<(ReplicaId, usize)>>,
    ) -> Vec<usize> {
        let mut inner = self.lock();
        if inner.is_empty() {
            return overlaps.map(|o| o.map_or(0, |(_, overlap)| overlap)).collect();
        }
        let now = inner.now(self.ttl);
        let extended = |(replica, overlap): (ReplicaId, usize)| {
            overlap + blocks[overlap..].iter().take_while(|&&b| inner.live((b, replica), now)).count()
        };
        overlaps.map(|o| o.map_or(0, extended)).collect()
    }

    /// Live credited (block, replica) pairs (for metrics and tests).
    pub fn len(&self) -> usize {
        let mut inner = self.lock();
        let now = inner.now(self.ttl);
        let inner = &*inner;
        let unpinned = |k: &(BlockHash, ReplicaId)| !inner.pins.contains_key(k);
        let current = inner.current.iter().filter(|&(k, &e)| e > now && unpinned(k)).count();
        let previous = inner
            .previous
            .iter()
            .filter(|&(k, &e)| e > now && unpinned(k) && inner.current.get(k).is_none_or(|&c| c <= now));
        inner.pins.len() + current + previous.count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every credit of a replica (it was removed, restarted, or is unreachable).
    pub fn forget(&self, replica: ReplicaId) {
        let mut inner = self.lock();
        inner.current.retain(|(_, r), _| *r != replica);
        inner.previous.retain(|(_, r), _| *r != replica);
        inner.pins.retain(|(_, r), _| *r != replica);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The blocks of `blocks` past its first `held` that a decision credits anew: not those
/// repeated from the held ones (a batch's later prompts repeat its first one's leading
/// blocks), which are earlier requests' credits to keep.
fn added_past(blocks: &[BlockHash], held: usize) -> Vec<BlockHash> {
    let (held, past) = blocks.split_at(held.min(blocks.len()));
    let held: std::collections::HashSet<&BlockHash> = held.iter().collect();
    past.iter().filter(|b| !held.contains(b)).copied().collect()
}

/// Which pin a release takes off ([`Credits::pin`]): pins are numbered in the order taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(u64);

/// A decision's pins on the credits of the replica its request goes to ([`Credits::pin`]):
/// taken off when the hold is dropped (the request's prefill is done, or it ended), or
/// withdrawn when the request fails there without starting ([`CreditHold::withdraw`]).
#[derive(Debug)]
pub struct CreditHold {
    index: super::SharedIndex,
    replica: ReplicaId,
    blocks: Vec<BlockHash>,
    stamp: Stamp,
    /// Told when the replica stores the last of `blocks` ([`CreditHold::tell_when_stored`]).
    waiter: Option<Arc<dyn super::OnStored>>,
    /// The request's blocks, and how many of them the replica held or earlier decisions had
    /// credited ([`CreditHold::adding`]): what withdrawing it ends ([`added_past`]).
    own: Option<(Arc<[BlockHash]>, usize)>,
}

impl CreditHold {
    /// Pins `blocks` on `replica`.
    pub fn pin(index: &super::SharedIndex, replica: ReplicaId, blocks: Vec<BlockHash>) -> Self {
        let stamp = index.credits().pin(replica, &blocks);
        Self { index: index.clone(), replica, blocks, stamp, waiter: None, own: None }
    }

    /// Told the request's blocks `all`, of which the first `held` were the replica's or earlier
    /// decisions' credits, so that withdrawing it ends only the credits its decision added.
    pub fn adding(mut self, all: Arc<[BlockHash]>, held: usize) -> Self {
        self.own = Some((all, held));
        self
    }

    /// [`CreditHold::withdraw`]n, ending the credits its decision added ([`CreditHold::adding`];
    /// none if it was not told them).
    pub fn withdraw_own(mut self) {
        let added = self.own.take().map(|(all, held)| added_past(&all, held)).unwrap_or_default();
        self.withdraw(&added);
    }

    /// Tells `waiter` when the replica's events store the last block pinned here (its
    /// prefill reached the prompt's end), unless the hold is withdrawn or ends first. Nothing is
    /// pinned when the replica already held the whole prompt, and then nothing is told.
    pub fn tell_when_stored(&mut self, waiter: Arc<dyn super::OnStored>) {
        self.stop_waiting();
        if let Some(&last) = self.blocks.last() {
            self.index.wait_stored(self.replica, last, waiter.clone());
            self.waiter = Some(waiter);
        }
    }

    fn stop_waiting(&mut self) {
        if let (Some(waiter), Some(&last)) = (self.waiter.take(), self.blocks.last()) {
            self.index.unwait_stored(self.replica, last, &waiter);
        }
    }

    /// The request failed on the replica without starting: the pins come off, and the
    /// credits of `added` end ([`Credits::withdraw`]).
    pub fn withdraw(mut self, added: &[BlockHash]) {
        self.stop_waiting();
        self.index.credits().withdraw(self.replica, &self.blocks, self.stamp, added);
        self.blocks.clear();
    }
}

impl Drop for CreditHold {
    fn drop(&mut self) {
        self.stop_waiting();
        self.index.credits().unpin(self.replica, &self.blocks, self.stamp);
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

    /// Takes the pin `stamp` off `key`; whether it was there (its count began no later than
    /// the pin: a later count began after events ended the one it was in).
    fn take_pin(&mut self, key: (BlockHash, ReplicaId), stamp: Stamp) -> bool {
        let Some((pins, began)) = self.pins.get_mut(&key) else { return false };
        if *began > stamp {
            return false;
        }
        *pins -= 1;
        if *pins == 0 {
            self.pins.remove(&key);
        }
        true
    }

    fn live(&self, key: (BlockHash, ReplicaId), now: u64) -> bool {
        let live = |held: &Held| held.get(&key).is_some_and(|&expiry| expiry > now);
        live(&self.current) || live(&self.previous) || self.pins.contains_key(&key)
    }

    fn is_empty(&self) -> bool {
        self.current.is_empty() && self.previous.is_empty() && self.pins.is_empty()
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

    /// A TTL past what microseconds hold (`--credit-ttl-ms` at its largest, "never") keeps
    /// credits: the expiry saturates instead of wrapping to the past (or overflowing).
    #[tokio::test(start_paused = true)]
    async fn a_ttl_too_long_to_count_keeps_credits() {
        let c = Credits::new(Duration::from_millis(u64::MAX));
        tokio::time::advance(Duration::from_millis(2)).await;
        c.credit(ReplicaId(0), &[h(1), h(2)]);
        assert_eq!(c.extend(ReplicaId(0), &[h(1), h(2)], 0), 2);
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
        Pin(u32, Vec<u64>),
        /// Releases one of the pins not yet released (by position among them).
        Unpin(usize),
        /// Withdraws one of the pins not yet released, ending the credits of these blocks.
        Withdraw(usize, Vec<u64>),
        Forget(u32),
        /// Milliseconds.
        Advance(u64),
        Extend(u32, Vec<u64>, usize),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let blocks = || proptest::collection::vec(0..8u64, 0..6);
        prop_oneof![
            3 => (0..3u32, blocks()).prop_map(|(r, b)| Op::Credit(r, b)),
            1 => (0..3u32, blocks()).prop_map(|(r, b)| Op::Confirm(r, b)),
            2 => (0..3u32, blocks()).prop_map(|(r, b)| Op::Pin(r, b)),
            2 => (0..8usize).prop_map(Op::Unpin),
            1 => (0..8usize, blocks()).prop_map(|(i, a)| Op::Withdraw(i, a)),
            1 => (0..3u32).prop_map(Op::Forget),
            3 => prop_oneof![0..5u64, 30..70u64, 90..110u64, 190..450u64].prop_map(Op::Advance),
            3 => (0..3u32, blocks(), 0..3usize).prop_map(|(r, b, o)| Op::Extend(r, b, o)),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]
        /// Against a map of every credit's expiry and the pins on it (which requests', so a
        /// release takes only its own), with a 100 ms TTL and time moving by less than,
        /// about and more than it: every credit lives while pinned and then exactly its TTL
        /// unless confirmed, withdrawn or forgotten, whichever generation holds it.
        #[test]
        fn credits_behave_like_a_map_of_expiries(ops in proptest::collection::vec(op(), 1..60)) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
            runtime.block_on(async {
                let ttl = Duration::from_millis(100);
                let credits = Credits::new(ttl);
                // (expiry, the pins on it: one entry per pin and block occurrence)
                let mut model: HashMap<(BlockHash, ReplicaId), (u64, Vec<usize>)> = HashMap::new();
                // Pins not yet released: (id, replica, blocks, stamp).
                let mut held: Vec<(usize, u32, Vec<u64>, Stamp)> = Vec::new();
                let mut pins_taken = 0;
                // Takes pin `id` off `blocks`' credits on `r`; the blocks it was still on.
                let take = |model: &mut HashMap<(BlockHash, ReplicaId), (u64, Vec<usize>)>, id: usize, r: u32, blocks: &[u64]| {
                    blocks.iter().filter(|&&b| {
                        let Some(credit) = model.get_mut(&(h(b), ReplicaId(r))) else { return false };
                        let Some(at) = credit.1.iter().position(|&p| p == id) else { return false };
                        credit.1.swap_remove(at);
                        true
                    }).copied().collect::<Vec<u64>>()
                };
                let hashes = |blocks: &[u64]| blocks.iter().map(|&b| h(b)).collect::<Vec<_>>();
                let mut now = 0u64;
                for op in ops {
                    match op {
                        Op::Credit(r, blocks) => {
                            credits.credit(ReplicaId(r), &blocks.iter().map(|&b| h(b)).collect::<Vec<_>>());
                            for b in blocks {
                                model.entry((h(b), ReplicaId(r))).or_default().0 = now + 100;
                            }
                        }
                        Op::Pin(r, blocks) => {
                            let stamp = credits.pin(ReplicaId(r), &hashes(&blocks));
                            pins_taken += 1;
                            for &b in &blocks {
                                let credit = model.entry((h(b), ReplicaId(r))).or_default();
                                credit.0 = now + 100;
                                credit.1.push(pins_taken);
                            }
                            held.push((pins_taken, r, blocks, stamp));
                        }
                        Op::Unpin(i) => {
                            if held.is_empty() {
                                continue;
                            }
                            let (id, r, blocks, stamp) = held.swap_remove(i % held.len());
                            credits.unpin(ReplicaId(r), &hashes(&blocks), stamp);
                            for b in take(&mut model, id, r, &blocks) {
                                model.get_mut(&(h(b), ReplicaId(r))).expect("taken from it").0 = now + 100;
                            }
                        }
                        Op::Withdraw(i, added) => {
                            if held.is_empty() {
                                continue;
                            }
                            let (id, r, pinned, stamp) = held.swap_remove(i % held.len());
                            credits.withdraw(ReplicaId(r), &hashes(&pinned), stamp, &hashes(&added));
                            take(&mut model, id, r, &pinned);
                            for b in added {
                                if model.get(&(h(b), ReplicaId(r))).is_some_and(|c| c.1.is_empty()) {
                                    model.remove(&(h(b), ReplicaId(r)));
                                }
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
                            let live = |b: &BlockHash| model.get(&(*b, ReplicaId(r))).is_some_and(|(e, pins)| !pins.is_empty() || *e > now);
                            let want = overlap + blocks[overlap..].iter().take_while(|b| live(b)).count();
                            proptest::prop_assert_eq!(credits.extend(ReplicaId(r), &blocks, overlap), want);
                        }
                    }
                    let live = model.values().filter(|(e, pins)| !pins.is_empty() || *e > now).count();
                    proptest::prop_assert_eq!(credits.len(), live);
                }
                Ok(())
            })?;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_leaves_a_later_requests_pin_alone() {
        let c = Credits::new(Duration::from_millis(100));
        let r = ReplicaId(0);
        let first = c.pin(r, &[h(1)]);
        // The replica stored the block and later evicted it: the first request's pin went
        // with its credit. A second request pins the block again.
        c.confirm(r, &[h(1)]);
        let second = c.pin(r, &[h(1)]);
        c.unpin(r, &[h(1)], first);
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(c.extend(r, &[h(1)], 0), 1, "the second request still waits: its pin holds");
        c.unpin(r, &[h(1)], second);
        tokio::time::advance(Duration::from_millis(150)).await;
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
