//! [`Ranks`]: which data-parallel rank of one replica holds which blocks, so that a request
//! can be sent to the rank that holds its prefix.
//!
//! A replica of `dp_size` > 1 (vLLM's `--data-parallel-size` behind one API server, SGLang's
//! DP attention) runs one engine per rank, each with a KV cache and an event stream of its
//! own; its API server picks a rank for each request by load, unless the request names one
//! (`X-data-parallel-rank`, which vLLM and SGLang both honour). The main index keeps the
//! union of the ranks (a block is the replica's while any rank holds it), which is what a
//! replica can offer only if the request reaches the rank that holds it. So the ingest keeps
//! an index of ranks beside the main one, with credits of its own: one for every such
//! replica, each rank under an id of its own ([`Ranks::id`]), so that a decision walks it once
//! for every data-parallel replica ([`views`]). The cache-aware policy scores the replica with
//! its best rank's overlap (and the whole replica's load) and names that rank.
//!
//! Ranks are chosen with the cache-aware cost ([`crate::policy::CacheAware::cost`]) over each
//! rank's overlap (index and credits) and its load (below): a prefix every rank holds (a system prompt) is spread over the ranks by load, as the
//! replicas are, and a new prefix goes to the least loaded rank (between equals, by a
//! rendezvous hash of the request and the replica's name, so that routers in front of one
//! replica agree), credited there
//! so that the requests right behind it follow. A rank's load is the sequences this router
//! has in flight there, and the others' work the replica reports on it: vLLM labels its
//! `num_requests_running` and `_waiting` by engine (`engine="r"`), SGLang its running and
//! queued requests by `dp_rank`, read with each health check as the replica's totals are
//! ([`Ranks::set_reported`]).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use kvroute_proto::{BlockHash, ReplicaId};
use tokio::time::Instant;

use super::{CreditHold, SharedIndex};
use crate::policy::{RecentTokens, ReportMark};

/// One data-parallel replica's ranks: where their blocks are indexed, and the load on each.
#[derive(Debug)]
pub struct Ranks {
    /// Blocks by rank (under [`Self::id`]), with credits of the requests sent to a rank:
    /// shared by every data-parallel replica.
    pub index: SharedIndex,
    /// The id of rank 0 in `index`.
    first: u32,
    load: Box<[RankLoad]>,
    /// What the ranks' recent prompt tokens are timed from.
    epoch: Instant,
}

/// One rank's load.
#[derive(Debug, Default)]
struct RankLoad {
    /// Sequences in flight on the rank, as named by this router.
    in_flight: AtomicU32,
    /// Sequences ever sent to it (for [`ReportMark`]).
    begun: AtomicU64,
    /// Requests the replica reported on the rank at its last health check beyond this
    /// router's own.
    others: AtomicU32,
    /// Uncached prompt tokens sent to the rank not known to be prefilled (the replica's
    /// [`crate::proxy::upstream::PendingPrefill`], attached to the rank).
    pending_prefill: AtomicU64,
    /// Prompt tokens sent to the rank lately, as the replica's are counted.
    recent: Mutex<RecentTokens>,
}

/// A rank's hold of a request's prefix, and its load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankView {
    pub rank: u32,
    /// Leading blocks held (index, then credits).
    pub overlap_blocks: usize,
    /// Leading blocks the index shows it holding (credits not counted).
    pub indexed_blocks: usize,
    /// Sequences this router has in flight on it.
    pub in_flight: u32,
    /// Others' requests the replica last reported on it.
    pub others: u32,
    /// Uncached prompt tokens sent to it not known to be prefilled.
    pub pending_prefill_tokens: u64,
    /// Prompt tokens sent to it lately ([`RecentTokens`]).
    pub recent_prompt_tokens: u64,
    /// Its stream is FALLBACK (what it holds is unknown): it is not named.
    pub fallback: bool,
}

impl Ranks {
    /// The ranks of replica `replica` in the fleet's rank `index`, or `None` when its ids
    /// would not fit (past 4 M replica ids).
    pub fn new(dp_size: u32, index: SharedIndex, replica: ReplicaId) -> Option<Self> {
        let first = replica.0.checked_mul(crate::replicas::MAX_DP_SIZE)?;
        let load = (0..dp_size.clamp(1, crate::replicas::MAX_DP_SIZE)).map(|_| RankLoad::default()).collect();
        Some(Self { index, first, load, epoch: Instant::now() })
    }

    /// Rank `rank`'s id in the rank index.
    pub fn id(&self, rank: u32) -> ReplicaId {
        ReplicaId(self.first + rank)
    }

    pub fn len(&self) -> u32 {
        self.load.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.load.is_empty()
    }

    /// Every rank's overlap of `blocks` (its index overlap extended through its credits)
    /// and load ([`views`] of this replica alone).
    pub fn views(&self, blocks: &[BlockHash]) -> Vec<RankView> {
        views(&[self], blocks, Instant::now()).pop().unwrap_or_default()
    }

    /// Each rank's view, its overlaps taken from `overlaps` (one a rank, in order: the index's,
    /// and through the credits).
    fn views_with(&self, overlaps: impl Iterator<Item = (usize, usize)>, now: Instant) -> Vec<RankView> {
        let since = now.saturating_duration_since(self.epoch);
        (self.load.iter().zip(0..))
            .zip(overlaps)
            .map(|((load, rank), (indexed_blocks, overlap_blocks))| RankView {
                rank,
                overlap_blocks,
                indexed_blocks,
                in_flight: load.in_flight.load(Ordering::Relaxed),
                others: load.others.load(Ordering::Relaxed),
                pending_prefill_tokens: load.pending_prefill.load(Ordering::Relaxed),
                recent_prompt_tokens: load.recent.lock().unwrap_or_else(|e| e.into_inner()).tokens(since),
                fallback: false,
            })
            .collect()
    }

    /// `tokens` of a request's prefill on `rank` are pending.
    pub fn add_prefill(&self, rank: u32, tokens: u64) {
        if let Some(load) = self.load.get(rank as usize) {
            load.pending_prefill.fetch_add(tokens, Ordering::Relaxed);
        }
    }

    /// `tokens` of a request's prefill on `rank` are done (never below none pending).
    pub fn sub_prefill(&self, rank: u32, tokens: u64) {
        if let Some(load) = self.load.get(rank as usize) {
            let _ = load
                .pending_prefill
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_sub(tokens)));
        }
    }

    /// Every rank's [`ReportMark`] as a health check begins.
    pub fn report_marks(&self) -> Vec<ReportMark> {
        // `begun` first: a request begun between the two reads then counts twice as this
        // router's (its others one short till the next check), never as nobody's.
        let mark = |load: &RankLoad| {
            let begun = load.begun.load(Ordering::Relaxed);
            ReportMark { in_flight: load.in_flight.load(Ordering::Relaxed), begun }
        };
        self.load.iter().map(mark).collect()
    }

    /// What the replica reports running and waiting on each rank (`reported(rank)`; `None`:
    /// nothing for it), the health check having begun at `marks`: the excess over this
    /// router's own is the rank's others.
    pub fn set_reported(&self, marks: &[ReportMark], reported: impl Fn(u32) -> Option<u32>) {
        for ((load, mark), rank) in self.load.iter().zip(marks).zip(0..) {
            let others = reported(rank).map_or(0, |n| mark.others(n, load.begun.load(Ordering::Relaxed)));
            load.others.store(others, Ordering::Relaxed);
        }
    }

    /// A request of `sequences` is sent to `rank`, which held `held` of its `blocks` (index
    /// and credits; `indexed` of them in the index): counted in the rank's load until the
    /// guard drops (its `prompt_tokens` in the rank's recent tokens, which only decay), and its
    /// blocks past the `indexed` credited to the rank, pinned, as the replica's are
    /// ([`super::Credits::pin`]; the rank's cache cleared, what the index showed goes with it,
    /// not kept as credits). If the replica [took](RankGuard::keep) the request, the pins come
    /// off when its prefill is done (or the guard drops) and the credits last the TTL; else
    /// the credits only this request made end when the guard drops ([`RankGuard::withdraw`]).
    pub fn begin(
        self: &std::sync::Arc<Self>,
        rank: u32,
        sequences: u32,
        (blocks, indexed, held): (&[BlockHash], usize, usize),
        prompt_tokens: u64,
    ) -> RankGuard {
        if let Some(load) = self.load.get(rank as usize) {
            load.in_flight.fetch_add(sequences, Ordering::Relaxed);
            load.begun.fetch_add(u64::from(sequences), Ordering::Relaxed);
            let since = Instant::now().saturating_duration_since(self.epoch);
            load.recent.lock().unwrap_or_else(|e| e.into_inner()).add(since, prompt_tokens);
        }
        // What only this request credits is worked out if it is withdrawn, not here.
        let all: std::sync::Arc<[BlockHash]> = blocks.into();
        let past = blocks[indexed.min(blocks.len())..].to_vec();
        let hold = CreditHold::pin(&self.index, self.id(rank), past).adding(all, held);
        let adds = held < blocks.len();
        RankGuard { ranks: self.clone(), rank, sequences, hold: Some(hold), adds, kept: false }
    }

    /// The ranks' credits end (they restarted, or are unreachable).
    pub fn forget(&self) {
        for rank in 0..self.len() {
            self.index.credits().forget(self.id(rank));
        }
    }

    /// Everything the ranks hold goes from the index, and their credits (the replica left).
    pub fn clear(&self) {
        for rank in 0..self.len() {
            self.index.clear_replica(self.id(rank));
        }
        self.forget();
    }
}

/// Every rank's view of `blocks` at `now`, for each of `replicas` (in order), whose ranks
/// share one index: it is walked once for all of them.
pub fn views(replicas: &[&Ranks], blocks: &[BlockHash], now: Instant) -> Vec<Vec<RankView>> {
    let Some(first) = replicas.first() else { return Vec::new() };
    let ids = replicas.iter().flat_map(|ranks| (0..ranks.len()).map(|rank| ranks.id(rank)));
    let (_, overlaps) = first.index.lookup_with_credits(blocks, |overlaps, credits| {
        let indexed: Vec<(ReplicaId, usize)> = ids.map(|id| (id, overlaps.get(id))).collect();
        let extended = credits.extend_each(blocks, indexed.iter().copied().map(Some));
        indexed.into_iter().map(|(_, n)| n).zip(extended).collect::<Vec<_>>()
    });
    let mut overlaps = overlaps.into_iter();
    replicas.iter().map(|ranks| ranks.views_with(overlaps.by_ref().take(ranks.len() as usize), now)).collect()
}

/// A request's load and pinned credits on a rank, released when dropped.
#[derive(Debug)]
pub struct RankGuard {
    ranks: std::sync::Arc<Ranks>,
    rank: u32,
    sequences: u32,
    /// The pins, which know the blocks only this request credited on the rank.
    hold: Option<CreditHold>,
    /// Blocks past those the rank held are credited: a prompt that is one chain stores one
    /// later.
    adds: bool,
    /// The replica took the request (a success answer): its credits stand.
    kept: bool,
}

impl RankGuard {
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The replica's ranks.
    pub fn ranks(&self) -> &std::sync::Arc<Ranks> {
        &self.ranks
    }

    /// The replica took the request: its credits stand once the guard drops.
    pub fn keep(&mut self) {
        self.kept = true;
    }

    /// The replica refused the request: the credits only it made end now.
    pub fn withdraw(&mut self) {
        if let Some(hold) = self.hold.take() {
            hold.withdraw_own();
        }
    }

    /// The request's prefill is done: the pins come off (its credits last the TTL) if the
    /// replica took it.
    pub fn prefill_done(&mut self) {
        if self.kept {
            self.hold = None;
        }
    }

    /// Tells `waiter` when the rank's events store the request's last block (its prefill
    /// reached the prompt's end): [`CreditHold::tell_when_stored`]. Nothing is told when the
    /// rank held the whole prompt already (no store is to come).
    pub fn tell_when_stored(&mut self, waiter: std::sync::Arc<dyn super::OnStored>) {
        if let (Some(hold), true) = (self.hold.as_mut(), self.adds) {
            hold.tell_when_stored(waiter);
        }
    }
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        if let Some(load) = self.ranks.load.get(self.rank as usize) {
            load.in_flight.fetch_sub(self.sequences, Ordering::Relaxed);
        }
        if !self.kept {
            self.withdraw();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    fn hashes(n: u64) -> Vec<BlockHash> {
        (1..=n).map(BlockHash).collect()
    }

    #[test]
    fn each_rank_has_its_own_overlap_and_credits() {
        let index = SharedIndex::with_credit_ttl(Duration::from_secs(60));
        let ranks = Arc::new(Ranks::new(3, index.clone(), ReplicaId(5)).unwrap());
        let blocks = hashes(4);
        ranks.index.store(ranks.id(1), &blocks[..3]);
        ranks.index.store(ranks.id(2), &blocks[..1]);
        let overlaps = |r: &Ranks| r.views(&blocks).iter().map(|v| v.overlap_blocks).collect::<Vec<_>>();
        assert_eq!(overlaps(&ranks), [0, 3, 1]);
        // A request sent to rank 2 credits its blocks there until the rank stores them.
        let mut guard = ranks.begin(2, 2, (&blocks, 1, 1), 64);
        assert_eq!(overlaps(&ranks), [0, 3, 4]);
        assert_eq!(ranks.views(&blocks)[2].in_flight, 2);
        assert_eq!(ranks.views(&blocks)[2].recent_prompt_tokens, 64, "its prompt, decaying from now");
        ranks.add_prefill(2, 100);
        ranks.sub_prefill(2, 150);
        assert_eq!(ranks.views(&blocks)[2].pending_prefill_tokens, 0, "never below none");
        guard.keep();
        drop(guard);
        assert_eq!(ranks.views(&blocks)[2].in_flight, 0, "released");
        assert_eq!(overlaps(&ranks), [0, 3, 4], "the credit of a request taken outlives it, until its TTL");
        ranks.forget();
        assert_eq!(overlaps(&ranks), [0, 3, 1]);
        // One that failed there takes back what only it credited.
        let guard = ranks.begin(0, 1, (&blocks, 0, 0), 64);
        assert_eq!(overlaps(&ranks), [4, 3, 1]);
        drop(guard);
        assert_eq!(overlaps(&ranks), [0, 3, 1]);
    }

    /// A rank is credited the blocks past those its index shows, as a replica is: when its
    /// cache is cleared, what the index showed goes with it. Regression: the whole prompt was
    /// credited, and the rank still seemed to hold it for the credits' TTL.
    #[test]
    fn a_rank_is_credited_only_what_its_index_does_not_show() {
        let index = SharedIndex::with_credit_ttl(Duration::from_secs(60));
        let ranks = Arc::new(Ranks::new(2, index.clone(), ReplicaId(5)).unwrap());
        let blocks = hashes(4);
        ranks.index.store(ranks.id(1), &blocks[..3]);
        let views = ranks.views(&blocks);
        assert_eq!((views[1].indexed_blocks, views[1].overlap_blocks), (3, 3));
        let mut guard = ranks.begin(1, 1, (&blocks, 3, 3), 64);
        guard.keep();
        drop(guard);
        assert_eq!(index.credits().len(), 1, "the last block alone");
        ranks.index.clear_replica(ranks.id(1));
        assert_eq!(ranks.views(&blocks)[1].overlap_blocks, 0, "nothing left of the prefix");
    }

    /// Several replicas' ranks share one index, walked once for all; each replica reads its
    /// own ranks, and leaving takes only its own.
    #[test]
    fn replicas_share_the_rank_index_and_keep_to_their_ranks() {
        let index = SharedIndex::with_credit_ttl(Duration::from_secs(60));
        let a = Ranks::new(2, index.clone(), ReplicaId(0)).unwrap();
        let b = Ranks::new(3, index.clone(), ReplicaId(1)).unwrap();
        let blocks = hashes(4);
        a.index.store(a.id(1), &blocks);
        b.index.store(b.id(0), &blocks[..2]);
        b.index.store(b.id(2), &blocks[..1]);
        let overlaps = |views: &[RankView]| views.iter().map(|v| v.overlap_blocks).collect::<Vec<_>>();
        let both = views(&[&a, &b], &blocks, Instant::now());
        assert_eq!((overlaps(&both[0]), overlaps(&both[1])), (vec![0, 4], vec![2, 0, 1]));
        a.clear();
        let both = views(&[&a, &b], &blocks, Instant::now());
        assert_eq!((overlaps(&both[0]), overlaps(&both[1])), (vec![0, 0], vec![2, 0, 1]));
        assert!(Ranks::new(2, index, ReplicaId(u32::MAX / 2)).is_none(), "ids past u32 are refused");
    }
}
