//! The replica's block-level KV prefix cache: a fixed number of blocks, a pluggable eviction
//! [`Policy`] (LRU, LFU or S3FIFO), and pins for blocks that running requests are using.
//!
//! # Hit semantics (seed 000)
//! For a request with block hashes `h_0..h_{n-1}` and prompt length `L`, `k` is the length of
//! the longest run `h_0..h_{k-1}` that is resident when the request arrives (the scan stops at
//! the first miss) and the request hits `min(k * block_size, L)` tokens
//! ([`kvroute_proto::hit_tokens`]). Then every block, hit or miss, is accessed against the
//! policy in order: hits update recency/frequency, misses are admitted and may evict. `k` is
//! read off the accesses themselves: the accesses before the first miss are hits, and hits
//! never change residency, so this equals scanning first.
//!
//! # Two users
//! - The offline simulator replays a trace with [`BlockCache::access_request`]: no pins, and
//!   exactly the seed-000 results.
//! - The simulated engine calls [`BlockCache::start_request`], which does the same accesses,
//!   pins every block of the request (refcounted) and reports residency changes as
//!   [`CacheEvent`]s in the order they happen (an admission's `Removed` victims, then its
//!   `Stored` with its chain parent), and [`BlockCache::finish_request`] when the request
//!   completes. The cache keeps no parent links: the engine's parent map follows from the
//!   `Stored`/`Removed` events, and [`BlockCache::resident`] lists the blocks for a snapshot.
//!
//! # Pinning
//! A pinned block is never evicted. Each policy keeps pinned blocks out of its victim order
//! (S3FIFO only once one would be the victim) and lets them back in on the last unpin
//! (details in [`Lru`], [`Lfu`], [`S3Fifo`]):
//!
//! | policy | while pinned | on the last unpin |
//! |---|---|---|
//! | LRU | leaves the recency list | rejoins at the most-recent end (finishing is a use) |
//! | LFU | leaves its frequency class's list; hits still count | rejoins at the most-recent end of its class |
//! | S3FIFO, in small | stays in place; if it reaches the head, it is promoted to main with its freq instead of going to ghost | nothing moves |
//! | S3FIFO, in main | stays in place (second chance as usual); if it reaches the head with freq 0, it leaves the main FIFO but still counts in `\|M\|` | a block that left rejoins at the tail with its freq |
//!
//! With no pins, every rule reduces to seed 000. S3FIFO's pins change nothing until a block in
//! use would be a victim, so one request at a time the engine's path gives seed 000's hits as
//! long as no request admits more new blocks than small holds (one that does promotes its own
//! first blocks to main when they reach small's head, where seed 000 sends them to ghost), and
//! no admission's drain goes all the way round main while the request holds a block there
//! (its hit block comes back to main's head with freq 0: parked, where seed 000 evicts it; with
//! `max_freq` 0, any hit at main's head does);
//! LRU and LFU follow vLLM's free-block queue instead (finishing is a use). `finish_request` unpins in reverse request
//! order, so (as in vLLM's free-block queue) a request's tail blocks become victims before its
//! shared prefix.
//!
//! Admission never fails half-way. Each policy has a [`Policy::pin_limit`] (LRU/LFU: the
//! capacity; S3FIFO: `main_cap`, since only main can hold pinned blocks once small drains):
//! an admission can only run out of victims when at least `pin_limit` blocks are pinned. So
//! before touching anything, `start_request` checks that the blocks pinned by others plus the
//! request's distinct blocks fit in `pin_limit` (or that every block is already resident, so
//! nothing is admitted), and `access_request` checks that fewer than `pin_limit` blocks are
//! pinned. Otherwise the call returns [`AdmitError`] and changes nothing. (For S3FIFO the
//! limit is conservative: some pinned blocks may still sit in small.)
//!
//! Layout: `config.rs` (configuration and its validation), `block_cache.rs` (the
//! request-level rules above), `host.rs` (the host memory blocks are offloaded to), `lru.rs`, `lfu.rs`, `s3fifo.rs` (one policy each), and
//! `slab.rs` (the index-linked lists and hash map the policies share).

mod block_cache;
mod config;
mod host;
mod lfu;
mod lru;
mod s3fifo;
mod slab;

#[cfg(test)]
mod tests;

use kvroute_proto::BlockHash;

pub use block_cache::{BlockCache, CacheStats};
pub use config::{CacheConfig, ConfigError, PolicyKind, S3FifoParams};
pub use host::HostTier;
pub use lfu::Lfu;
pub use lru::Lru;
pub use s3fifo::{S3Fifo, small_cap};
pub use slab::{BlockHasher, BlockMap};

/// What one access did to the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The block was resident.
    Hit,
    /// The block was not resident and now is.
    Admitted,
}

/// Returned by [`Policy::access`] when admission needs a victim and every candidate is pinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("every eviction candidate is pinned")]
pub struct Full;

/// An eviction policy over resident blocks: the seam between [`BlockCache`] and LRU, LFU or
/// S3FIFO. Implementations are O(1) (amortised for S3FIFO) per call.
pub trait Policy {
    /// How many blocks fit.
    fn capacity(&self) -> usize;

    /// How many blocks are resident.
    fn len(&self) -> usize;

    /// Whether no block is resident.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `block` is resident (S3FIFO's ghost entries are not).
    fn contains(&self, block: BlockHash) -> bool;

    /// How many pinned blocks the policy tolerates while still finding victims: if fewer are
    /// pinned, [`Policy::access`] never returns [`Full`].
    fn pin_limit(&self) -> usize;

    /// Touches `block`: a hit updates the policy's state, a miss admits it, pushing every
    /// block that left residency onto `evicted`. On `Err` nothing changed.
    fn access(&mut self, block: BlockHash, evicted: &mut Vec<BlockHash>) -> Result<Access, Full>;

    /// Marks resident `block` as pinned or not; called only when the pin count moves between
    /// zero and one.
    fn set_pinned(&mut self, block: BlockHash, pinned: bool);

    /// Drops every block (and any ghost history).
    fn clear(&mut self);

    /// The resident blocks, in no particular order.
    fn resident(&self) -> Box<dyn Iterator<Item = BlockHash> + '_>;
}

/// A request's prefix hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RequestOutcome {
    /// `k`: the longest resident prefix, in blocks.
    pub hit_blocks: usize,
    /// `min(k * block_size, prompt_len)`.
    pub hit_tokens: usize,
}

/// A change in residency, in the order it happened; the engine turns these into KV events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// `block` became resident; `parent` is the previous block of the request (`None` for its
    /// first block). Stored events of one request come parent-first.
    Stored { block: BlockHash, parent: Option<BlockHash> },
    /// `block` left residency (S3FIFO: moved to ghost; promotion small→main is not a removal).
    Removed(BlockHash),
}

/// Why a request cannot start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// Too many blocks are pinned by running requests; retry after one finishes.
    #[error(
        "request would need {needed} pinned blocks with {pinned_by_others} pinned by others, \
         over the limit of {limit}; wait for running requests"
    )]
    MustWait { needed: usize, pinned_by_others: usize, limit: usize },
    /// The request has more distinct blocks than the cache can ever pin at once.
    #[error("request has {needed} distinct blocks, more than the {limit} this cache can pin")]
    TooLarge { needed: usize, limit: usize },
}

/// Returned by [`BlockCache::clear`] while requests still hold pins (vLLM does not reset its
/// prefix cache with blocks in use either).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot clear the cache while {pinned} blocks are pinned")]
pub struct ClearError {
    /// How many distinct blocks were pinned.
    pub pinned: usize,
}

/// Returned by [`BlockCache::finish_request`] for a block that was not pinned; the other
/// blocks were still unpinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("block {block} was not pinned")]
pub struct NotPinned {
    /// The first such block.
    pub block: BlockHash,
}
