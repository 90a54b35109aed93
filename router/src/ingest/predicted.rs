//! Replicas without KV events: their cache is predicted from this router's own routing.
//!
//! A replica configured with no event endpoint (an engine started without
//! `--kv-events-config`, or one that publishes none) is not routed on load alone: every
//! request this router sends it that the replica answers with success stores the request's
//! prompt blocks in the index under the replica, at the answer's first data (the prefill is
//! done, so the replica holds them; not when that data is an error the replica reports in
//! its stream). Those entries are what the replica's events would have
//! said, as far as this router can see; they leave the index by age and by size:
//!
//! - **Age.** A block leaves the index `ttl` after the last request that used it
//!   (`--predicted-ttl-ms`; checked every `ttl / 4` and before each record, so up to a
//!   quarter TTL later when nothing is recorded meanwhile). The age bound
//!   stands for what the router cannot see: other routers' and clients' requests to the
//!   replica, and its generated tokens, which evict blocks too.
//! - **Size.** The replica is predicted to hold at most its capacity: what its metrics
//!   page says its KV cache holds (vLLM's `vllm:cache_config_info` `num_gpu_blocks` times
//!   its `block_size`, SGLang's `sglang:max_total_num_tokens`, the agent's
//!   `kvroute_agent_capacity_blocks`), else `--predicted-cache-tokens`, in blocks of the
//!   router's size. Past it, the least recently used blocks leave
//!   first, as from vLLM's and SGLang's caches (a prefix shared by later requests stays, the
//!   rest of an old request goes). A vLLM without prefix caching holds nothing.
//! - **Down or restarted.** See below: the prediction goes, and the credits of the requests
//!   routed there end (as when an event stream is unreachable).
//!
//! Layout: each block's last use (a stamp: microseconds since the prediction began, made
//! strictly increasing), and the uses in order, oldest first; a use whose stamp is not its
//! block's last is stale and skipped when it comes to the front (the queue is compacted
//! when over half of it is stale). So a record costs O(1) a block, amortised.
//!
//! A replica that restarted has lost its cache, and its prediction is dropped: when its
//! health checks find it unhealthy on a check that failed (not one answered late: busy),
//! and when the start time its metrics page reports changes (`process_start_time_seconds`,
//! which vLLM's Prometheus client exports with one API server, and the replica agent;
//! SGLang's multiprocess page has none, so its restarts are seen by the health checks only).
//!
//! # Measured
//! `loadgen simulate --without-events` routes on such a prediction offline (an LRU of the
//! requests sent, no TTL) while the hits are the true caches'. Shared Mooncake trace, 8
//! replicas x 2048 blocks of 512 tokens, cache-aware, hit rate with events / predicted:
//!
//! | replicas evict by | with events | predicted |
//! |---|---|---|
//! | LRU (vLLM, SGLang) | 53.70% | 53.70% |
//! | LFU | 54.55% | 40.62% |
//! | S3FIFO | 29.63% | 40.43% |
//!
//! Under LRU the prediction is the cache. Under LFU it keeps predicting blocks the replica
//! evicted. Under S3FIFO it does better than the events: a prefix's first blocks leave a
//! replica's small queue before the prefix returns, and the events then send it elsewhere,
//! while the prediction keeps it where its second use would promote it (the cache-aware
//! module's notes on S3FIFO). Live, the demo without events matches the one with them (82.0%,
//! predicted to the token; README).
//!
//! The replica's stream state is `PREDICTED`. Each router predicts from its own requests
//! only: with several routers in front of one such fleet, each sees part of every replica's
//! cache (the replicas' reported load is still shared).

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kvroute_proto::{BlockHash, ReplicaId};
use tokio::time::Instant;

use super::ReplicaMetrics;
use crate::index::{FoldState, SharedIndex};

/// Stale uses the queue may hold beyond its live ones before it is compacted.
const SLACK: usize = 64;

/// The predicted cache of one replica without events: what it puts in the index, and when
/// it takes it out.
#[derive(Debug)]
pub struct Prediction {
    replica: ReplicaId,
    index: SharedIndex,
    ttl: Duration,
    epoch: Instant,
    /// Its blocks gauge and stored and removed counters.
    metrics: ReplicaMetrics,
    inner: Mutex<Lru>,
}

#[derive(Debug)]
struct Lru {
    /// Each block predicted, with the stamp of its last use.
    last: HashMap<BlockHash, u64, FoldState>,
    /// Uses, oldest first: `(block, stamp)`.
    uses: VecDeque<(BlockHash, u64)>,
    /// The last stamp given.
    stamp: u64,
    /// The replica left: nothing more goes into the index.
    closed: bool,
    /// The start time the replica last reported.
    started: Option<f64>,
    /// The most blocks predicted.
    capacity: usize,
}

impl Prediction {
    /// The prediction of `replica`'s cache of at most `capacity_blocks`, each block kept for
    /// `ttl` after its last use.
    pub fn new(
        replica: ReplicaId,
        index: SharedIndex,
        (ttl, capacity_blocks): (Duration, usize),
        metrics: ReplicaMetrics,
    ) -> Self {
        let inner = Lru {
            last: HashMap::with_hasher(FoldState::random()),
            uses: VecDeque::new(),
            stamp: 0,
            closed: false,
            started: None,
            capacity: capacity_blocks.max(1),
        };
        Self { replica, index, ttl, epoch: Instant::now(), metrics, inner: Mutex::new(inner) }
    }

    /// How often [`Self::expire`] is to run.
    pub fn check_every(&self) -> Duration {
        (self.ttl / 4).max(Duration::from_millis(1))
    }

    /// The replica was sent `blocks` and began answering: it holds them now, the most
    /// recently used.
    pub fn record(&self, blocks: &[BlockHash]) {
        let now = self.now();
        let mut inner = self.lock();
        if inner.closed || inner.capacity == 0 {
            return;
        }
        let mut gone = self.expired(&mut inner, now);
        let mut new = Vec::new();
        // Last block first: of one request, the tail is the least recently used, and leaves
        // first, as vLLM frees a request's blocks (a head without its tail still matches; a
        // tail without its head never does).
        for &block in blocks.iter().rev() {
            inner.stamp = inner.stamp.saturating_add(1).max(now);
            let stamp = inner.stamp;
            if inner.last.insert(block, stamp).is_none() {
                new.push(block);
            }
            inner.uses.push_back((block, stamp));
        }
        gone.extend(inner.over_capacity());
        let Lru { last, uses, .. } = &mut *inner;
        if uses.len() > 2 * last.len() + SLACK {
            uses.retain(|(block, stamp)| last.get(block) == Some(stamp));
        }
        // (Written under the lock, stores before removals: the index takes one replica's
        // writes in order, and a block both new and evicted here is stored once, removed once.)
        self.index.store(self.replica, &new);
        self.metrics.blocks_stored.inc_by(new.len() as u64);
        self.take_out(&inner, &gone);
    }

    /// Takes out of the index what has not been used for the TTL.
    pub fn expire(&self) {
        let now = self.now();
        let mut inner = self.lock();
        if !inner.closed {
            let gone = self.expired(&mut inner, now);
            self.take_out(&inner, &gone);
        }
    }

    /// The replica lost its cache (it went down, or restarted): nothing of it is predicted,
    /// and the credits of the requests routed to it end (they went down with it).
    pub fn forget(&self) {
        let mut inner = self.lock();
        if inner.closed {
            return;
        }
        self.index.credits().forget(self.replica);
        if inner.last.is_empty() {
            return;
        }
        let gone: Vec<BlockHash> = inner.last.drain().map(|(block, _)| block).collect();
        inner.uses = VecDeque::new();
        self.take_out(&inner, &gone);
    }

    /// The replica reports a cache of `blocks` (of the router's size): the least recently used
    /// past it leave. 0: it keeps nothing for later requests (vLLM without prefix caching).
    pub fn set_capacity(&self, blocks: usize) {
        let mut inner = self.lock();
        if inner.closed || inner.capacity == blocks {
            return;
        }
        inner.capacity = blocks;
        let gone = inner.over_capacity();
        self.take_out(&inner, &gone);
    }

    /// The replica reports it started at `started` (unix seconds): a start time other than the
    /// last one reported means it restarted, with an empty cache.
    pub fn started(&self, started: f64) {
        let before = self.lock().started.replace(started);
        if before.is_some_and(|before| before.to_bits() != started.to_bits()) {
            tracing::info!(
                replica = self.replica.0,
                "replica without events restarted: its prediction is dropped"
            );
            self.forget();
        }
    }

    /// The replica left (its index entries are cleared next): nothing more is recorded.
    pub fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        inner.last = HashMap::with_hasher(FoldState::random());
        inner.uses = VecDeque::new();
    }

    /// Distinct blocks predicted.
    pub fn blocks(&self) -> usize {
        self.lock().last.len()
    }

    /// Takes `gone` (out of `inner` already) out of the index; counts it.
    fn take_out(&self, inner: &Lru, gone: &[BlockHash]) {
        self.index.remove(self.replica, gone);
        self.metrics.blocks_removed.inc_by(gone.len() as u64);
        self.metrics.blocks.set(i64::try_from(inner.last.len()).unwrap_or(i64::MAX));
    }

    /// Takes the blocks last used `ttl` or longer before `now` out of `inner`; returns them.
    fn expired(&self, inner: &mut Lru, now: u64) -> Vec<BlockHash> {
        let ttl = u64::try_from(self.ttl.as_micros()).unwrap_or(u64::MAX);
        let mut gone = Vec::new();
        while let Some(&(block, stamp)) = inner.uses.front() {
            if stamp.saturating_add(ttl) > now {
                break;
            }
            inner.uses.pop_front();
            if inner.last.get(&block) == Some(&stamp) {
                inner.last.remove(&block);
                gone.push(block);
            }
        }
        gone
    }

    /// Microseconds since the prediction began.
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Lru {
    /// Takes the least recently used blocks past the capacity out; returns them.
    fn over_capacity(&mut self) -> Vec<BlockHash> {
        let mut gone = Vec::new();
        while self.last.len() > self.capacity {
            let Some((block, stamp)) = self.uses.pop_front() else { break };
            if self.last.get(&block) == Some(&stamp) {
                self.last.remove(&block);
                gone.push(block);
            }
        }
        gone
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

    /// `R`'s prediction, in `index`.
    fn predict(index: &SharedIndex, ttl_secs: u64, capacity: usize) -> Prediction {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = super::super::IngestMetrics::register(
            &mut registry,
            index.clone(),
            SharedIndex::new(),
            SharedIndex::new(),
        );
        Prediction::new(R, index.clone(), (Duration::from_secs(ttl_secs), capacity), metrics.replica("r"))
    }

    /// Recorded blocks are the replica's overlap at once; a block used twice is one entry.
    #[tokio::test(start_paused = true)]
    async fn recorded_blocks_are_held_once() {
        let index = SharedIndex::new();
        let p = predict(&index, 10, 1000);
        p.record(&hs(0..4));
        p.record(&hs(0..6));
        assert_eq!(index.lookup(&hs(0..8)).get(R), 6);
        assert_eq!(index.blocks(R), 6);
        assert_eq!(p.blocks(), 6);
    }

    /// A block leaves the TTL after its last use; one used again stays.
    #[tokio::test(start_paused = true)]
    async fn blocks_leave_the_ttl_after_their_last_use() {
        let index = SharedIndex::new();
        let p = predict(&index, 10, 1000);
        p.record(&hs(0..4));
        tokio::time::advance(Duration::from_secs(6)).await;
        p.expire();
        assert_eq!(index.blocks(R), 4, "within the TTL: still held");
        p.record(&hs(0..2));
        tokio::time::advance(Duration::from_secs(5)).await;
        p.expire();
        assert_eq!(index.lookup(&hs(0..4)).get(R), 2, "the two used again stay");
        assert_eq!(index.blocks(R), 2);
        tokio::time::advance(Duration::from_secs(6)).await;
        p.expire();
        assert_eq!(index.blocks(R), 0, "a whole TTL unused: gone");
        assert_eq!(p.blocks(), 0);
    }

    /// Past the capacity the least recently used blocks leave: a prefix used again stays,
    /// older requests' blocks go.
    #[tokio::test(start_paused = true)]
    async fn the_least_recently_used_blocks_leave_past_the_capacity() {
        let index = SharedIndex::new();
        let p = predict(&index, 3600, 8);
        p.record(&hs(0..4));
        p.record(&hs(10..14));
        p.record(&hs(20..24));
        assert_eq!(index.blocks(R), 8);
        assert_eq!(index.lookup(&hs(0..4)).get(R), 0, "the first sent is gone");
        p.record(&hs(10..14));
        p.record(&hs(30..34));
        assert_eq!(index.blocks(R), 8);
        assert_eq!(index.lookup(&hs(10..14)).get(R), 4, "used again: kept");
        assert_eq!(index.lookup(&hs(20..24)).get(R), 0, "least recently used: gone");
        // A request larger than the whole cache keeps its first blocks, as vLLM frees a
        // request's tail first.
        p.record(&hs(100..120));
        assert_eq!(index.blocks(R), 8);
        assert_eq!(index.lookup(&hs(100..120)).get(R), 8);
        // A replica that reports a smaller cache keeps the most recent of it, head first.
        p.set_capacity(3);
        assert_eq!((index.blocks(R), p.metrics.blocks.get()), (3, 3));
        assert_eq!(index.lookup(&hs(100..120)).get(R), 3);
        p.set_capacity(100);
        p.record(&hs(0..10));
        assert_eq!(index.blocks(R), 13, "a larger one holds more");
    }

    /// Uses of blocks already held do not pile up: the queue stays within twice the blocks.
    #[tokio::test(start_paused = true)]
    async fn uses_of_held_blocks_do_not_pile_up() {
        let index = SharedIndex::new();
        let p = predict(&index, 3600, 100);
        for _ in 0..1000 {
            p.record(&hs(0..4));
        }
        assert_eq!(index.blocks(R), 4);
        assert!(p.lock().uses.len() <= 2 * 4 + SLACK, "{} uses", p.lock().uses.len());
    }

    /// A replica that reports another start time than before restarted: its prediction goes;
    /// the gauge follows what is predicted.
    #[tokio::test(start_paused = true)]
    async fn a_new_start_time_drops_the_prediction() {
        let index = SharedIndex::with_credit_ttl(Duration::from_secs(60));
        let p = predict(&index, 10, 100);
        p.started(1.5);
        p.record(&hs(0..4));
        index.credits().credit(R, &hs(10..12));
        assert_eq!(p.metrics.blocks.get(), 4);
        p.started(1.5);
        assert_eq!(index.blocks(R), 4, "the same start: the same cache");
        assert_eq!(index.credits().extend(R, &hs(10..12), 0), 2);
        p.started(2.5);
        assert_eq!((index.blocks(R), p.blocks(), p.metrics.blocks.get()), (0, 0, 0));
        assert_eq!(index.credits().extend(R, &hs(10..12), 0), 0, "its routed requests' credits end");
        p.record(&hs(0..2));
        assert_eq!(index.lookup(&hs(0..4)).get(R), 2, "predicted again from what it is sent");
        assert_eq!(p.metrics.blocks_removed.get(), 4);
    }

    /// A replica that keeps nothing (a capacity of 0: vLLM without prefix caching) is predicted
    /// to hold nothing.
    #[tokio::test(start_paused = true)]
    async fn a_replica_without_prefix_caching_is_predicted_empty() {
        let index = SharedIndex::new();
        let p = predict(&index, 10, 100);
        p.record(&hs(0..4));
        p.set_capacity(0);
        assert_eq!((index.blocks(R), p.blocks()), (0, 0));
        p.record(&hs(0..4));
        assert_eq!((index.blocks(R), p.blocks()), (0, 0));
        p.set_capacity(8);
        p.record(&hs(0..4));
        assert_eq!(index.blocks(R), 4);
    }

    /// A closed prediction records nothing more (its replica's entries were cleared).
    #[tokio::test(start_paused = true)]
    async fn a_closed_prediction_records_nothing() {
        let index = SharedIndex::new();
        let p = predict(&index, 10, 100);
        p.record(&hs(0..2));
        p.close();
        index.clear_replica(R);
        p.record(&hs(0..4));
        p.expire();
        assert_eq!(index.blocks(R), 0);
    }
}
