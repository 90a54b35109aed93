//! [`HostTier`]: the host memory an engine offloads its KV blocks to (vLLM's
//! `OffloadingConnector` with its CPU backend, SGLang's HiCache), as an LRU of blocks.
//!
//! - Every block of a request that runs is copied out, write-through (vLLM offloads each
//!   request's prompt blocks as they are computed; a block already held is only used again).
//!   The copies are never pinned: a request reads from the device cache.
//! - A request whose device-cache prefix ends at block `k` loads the run of blocks from `k` on
//!   that host memory holds, rather than computing them ([`HostTier::run_from`]); a run that
//!   does not start at `k` is not loaded (vLLM looks up the connector from its cache's hit on).

use kvroute_proto::BlockHash;

use super::{Access, CacheEvent, Lru, Policy};

/// Host memory of `capacity` blocks, least recently used out first.
#[derive(Debug, Clone)]
pub struct HostTier {
    lru: Lru,
}

impl HostTier {
    pub fn new(capacity: usize) -> Self {
        Self { lru: Lru::new(capacity) }
    }

    /// How many blocks of `blocks`, from `from` on, it holds without a gap.
    pub fn run_from(&self, blocks: &[BlockHash], from: usize) -> usize {
        blocks.iter().skip(from).take_while(|&&block| self.lru.contains(block)).count()
    }

    /// Copies `blocks` out, appending what that changed: each block newly held as `Stored`
    /// (with the block before it in `blocks` as its parent), each one evicted as `Removed`.
    /// Of a request longer than host memory, its first blocks: the last ones would evict its
    /// own prefix (every parent named gone), leaving a run no prefix hit can start.
    pub fn offload(&mut self, blocks: &[BlockHash], events: &mut Vec<CacheEvent>) {
        let mut evicted = Vec::new();
        for (i, &block) in blocks.iter().enumerate().take(self.lru.capacity()) {
            evicted.clear();
            // Nothing is pinned here: there is always a victim.
            let Ok(access) = self.lru.access(block, &mut evicted) else { continue };
            events.extend(evicted.iter().map(|&gone| CacheEvent::Removed(gone)));
            if access == Access::Admitted {
                events.push(CacheEvent::Stored { block, parent: i.checked_sub(1).map(|p| blocks[p]) });
            }
        }
    }

    /// Every block held.
    pub fn blocks(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.lru.resident()
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }

    /// Lets every block go (a cache reset); how many were held.
    pub fn clear(&mut self) -> usize {
        let held = self.lru.len();
        self.lru.clear();
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(range: std::ops::Range<u64>) -> Vec<BlockHash> {
        range.map(BlockHash).collect()
    }

    #[test]
    fn holds_what_it_was_given_least_recently_used_out_first() {
        let mut host = HostTier::new(4);
        let mut events = Vec::new();
        host.offload(&hs(0..3), &mut events);
        let stored = |block, parent: Option<u64>| CacheEvent::Stored {
            block: BlockHash(block),
            parent: parent.map(BlockHash),
        };
        assert_eq!(events, [stored(0, None), stored(1, Some(0)), stored(2, Some(1))]);
        assert_eq!(host.run_from(&hs(0..3), 0), 3);
        assert_eq!(host.run_from(&hs(0..3), 1), 2);
        assert_eq!(host.run_from(&hs(0..3), 3), 0);
        // 0 used again (held: no event); 9 and 10 come in, 1 and 2 go (least recent).
        events.clear();
        host.offload(&[BlockHash(0), BlockHash(9), BlockHash(10)], &mut events);
        assert_eq!(events, [stored(9, Some(0)), CacheEvent::Removed(BlockHash(1)), stored(10, Some(9))]);
        assert_eq!(host.run_from(&hs(0..3), 0), 1, "a gap ends the run");
        assert_eq!(host.clear(), 4);
        assert!(host.is_empty());
    }

    /// Regression: a request longer than host memory evicted its own first blocks, storing
    /// children of parents just removed, and no run from its prefix was held.
    #[test]
    fn a_request_longer_than_host_memory_keeps_its_first_blocks() {
        let mut host = HostTier::new(2);
        let mut events = Vec::new();
        host.offload(&hs(0..5), &mut events);
        assert!(!events.iter().any(|e| matches!(e, CacheEvent::Removed(_))), "{events:?}");
        assert_eq!(host.run_from(&hs(0..5), 0), 2);
        assert_eq!(host.run_from(&hs(0..5), 1), 1);
    }
}
