//! [`BlockCache`]: a [`Policy`] plus the request-level rules from the module docs of
//! [`super`]: the prefix hit, pin refcounts, the admission check, events and counters.

use std::collections::HashSet;
use std::hash::BuildHasherDefault;

use kvroute_proto::{BlockHash, hit_tokens};
use serde::Serialize;

use super::{
    Access, AdmitError, BlockHasher, BlockMap, CacheConfig, CacheEvent, ClearError, ConfigError, Lfu, Lru,
    NotPinned, Policy, PolicyKind, RequestOutcome, S3Fifo,
};

/// Running totals since the cache was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    /// Requests that ran (rejected ones excluded).
    pub requests: u64,
    /// Requests refused with [`AdmitError`].
    pub rejected: u64,
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
    /// Blocks accessed, and how many of those were resident.
    pub block_accesses: u64,
    pub block_hits: u64,
    /// Blocks that became resident, and blocks that left residency.
    pub stored: u64,
    pub removed: u64,
}

/// A block cache: a [`Policy`] plus pin refcounts, hit accounting and counters.
pub struct BlockCache {
    policy: Box<dyn Policy + Send + Sync>,
    block_size: usize,
    /// Pin refcounts; only blocks with a count of at least one are present.
    pins: BlockMap<u32>,
    stats: CacheStats,
    evicted: Vec<BlockHash>,
}

impl std::fmt::Debug for BlockCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache")
            .field("capacity", &self.capacity())
            .field("len", &self.len())
            .field("pinned", &self.pins.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl BlockCache {
    /// Builds the cache `config` describes.
    pub fn new(config: &CacheConfig) -> Result<Self, ConfigError> {
        let cap = config.capacity_blocks;
        if cap == 0 {
            return Err(ConfigError::ZeroCapacity);
        }
        if cap > super::config::MAX_CAPACITY {
            return Err(ConfigError::TooLarge(cap));
        }
        let policy: Box<dyn Policy + Send + Sync> = match config.policy {
            PolicyKind::Lru => Box::new(Lru::new(cap)),
            PolicyKind::Lfu => Box::new(Lfu::new(cap)),
            PolicyKind::S3fifo => Box::new(S3Fifo::new(cap, config.s3fifo)?),
        };
        Self::with_policy(policy, config.block_size)
    }

    /// Wraps an already-built policy (for policies outside this module).
    pub fn with_policy(
        policy: Box<dyn Policy + Send + Sync>,
        block_size: usize,
    ) -> Result<Self, ConfigError> {
        if block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        Ok(Self {
            policy,
            block_size,
            pins: BlockMap::default(),
            stats: CacheStats::default(),
            evicted: Vec::new(),
        })
    }

    /// Seed-000 replay of one request without pinning (the offline simulator's step).
    ///
    /// Fails only if at least [`Policy::pin_limit`] blocks are pinned and the request is not
    /// fully resident; with no pins it always succeeds.
    pub fn access_request(
        &mut self,
        blocks: &[BlockHash],
        prompt_len: usize,
    ) -> Result<RequestOutcome, AdmitError> {
        self.run(blocks, prompt_len, false, None)
    }

    /// [`Self::access_request`], also reporting the residency changes.
    pub fn access_request_with_events(
        &mut self,
        blocks: &[BlockHash],
        prompt_len: usize,
        events: &mut Vec<CacheEvent>,
    ) -> Result<RequestOutcome, AdmitError> {
        self.run(blocks, prompt_len, false, Some(events))
    }

    /// Starts a request on the engine: accesses every block as [`Self::access_request`] does,
    /// pins each one (once per occurrence) until [`Self::finish_request`], and appends the
    /// residency changes to `events`. On `Err` nothing changed and nothing was pinned.
    pub fn start_request(
        &mut self,
        blocks: &[BlockHash],
        prompt_len: usize,
        events: &mut Vec<CacheEvent>,
    ) -> Result<RequestOutcome, AdmitError> {
        self.run(blocks, prompt_len, true, Some(events))
    }

    /// Releases the pins [`Self::start_request`] took for `blocks`, last block first.
    pub fn finish_request(&mut self, blocks: &[BlockHash]) -> Result<(), NotPinned> {
        let mut result = Ok(());
        for &block in blocks.iter().rev() {
            match self.pins.get_mut(&block) {
                Some(count) if *count > 1 => *count -= 1,
                Some(_) => {
                    self.pins.remove(&block);
                    self.policy.set_pinned(block, false);
                }
                None => {
                    if result.is_ok() {
                        result = Err(NotPinned { block });
                    }
                }
            }
        }
        result
    }

    fn run(
        &mut self,
        blocks: &[BlockHash],
        prompt_len: usize,
        pin: bool,
        mut events: Option<&mut Vec<CacheEvent>>,
    ) -> Result<RequestOutcome, AdmitError> {
        if let Err(e) = self.check_admissible(blocks, pin) {
            self.stats.rejected += 1;
            return Err(e);
        }
        let mut hit_blocks = 0;
        let mut in_prefix = true;
        for (pos, &block) in blocks.iter().enumerate() {
            self.evicted.clear();
            let access = self
                .policy
                .access(block, &mut self.evicted)
                // `check_admissible` proved a victim exists (see the module docs).
                .expect("admission check guarantees an unpinned victim");
            self.stats.removed += self.evicted.len() as u64;
            match access {
                Access::Hit => {
                    self.stats.block_hits += 1;
                    if in_prefix {
                        hit_blocks += 1;
                    }
                }
                Access::Admitted => {
                    in_prefix = false;
                    self.stats.stored += 1;
                }
            }
            if let Some(events) = events.as_deref_mut() {
                events.extend(self.evicted.iter().map(|&b| CacheEvent::Removed(b)));
                if access == Access::Admitted {
                    let parent = pos.checked_sub(1).map(|p| blocks[p]);
                    events.push(CacheEvent::Stored { block, parent });
                }
            }
            if pin {
                let count = self.pins.entry(block).or_insert(0);
                *count += 1;
                if *count == 1 {
                    self.policy.set_pinned(block, true);
                }
            }
        }
        let hit_tokens = hit_tokens(hit_blocks, self.block_size, prompt_len);
        self.stats.requests += 1;
        self.stats.block_accesses += blocks.len() as u64;
        self.stats.prompt_tokens += prompt_len as u64;
        self.stats.hit_tokens += hit_tokens as u64;
        Ok(RequestOutcome { hit_blocks, hit_tokens })
    }

    /// The no-failure-half-way check from the module docs.
    fn check_admissible(&self, blocks: &[BlockHash], pin: bool) -> Result<(), AdmitError> {
        let limit = self.policy.pin_limit();
        let pinned = self.pins.len();
        if !pin {
            if pinned < limit || self.all_resident(blocks) {
                return Ok(());
            }
            return Err(AdmitError::MustWait { needed: 0, pinned_by_others: pinned, limit });
        }
        // Fast path: even counting every occurrence as a new pin, it fits.
        if pinned + blocks.len() <= limit || self.all_resident(blocks) {
            return Ok(());
        }
        let distinct: HashSet<BlockHash, BuildHasherDefault<BlockHasher>> = blocks.iter().copied().collect();
        let needed = distinct.len();
        if needed > limit {
            return Err(AdmitError::TooLarge { needed, limit });
        }
        let already_pinned = distinct.iter().filter(|b| self.pins.contains_key(b)).count();
        let pinned_by_others = pinned - already_pinned;
        if pinned_by_others + needed <= limit {
            Ok(())
        } else {
            Err(AdmitError::MustWait { needed, pinned_by_others, limit })
        }
    }

    fn all_resident(&self, blocks: &[BlockHash]) -> bool {
        blocks.iter().all(|&b| self.policy.contains(b))
    }

    /// Whether `block` is resident.
    pub fn contains(&self, block: BlockHash) -> bool {
        self.policy.contains(block)
    }

    /// Resident blocks (S3FIFO: `|S| + |M|`, ghost excluded).
    pub fn len(&self) -> usize {
        self.policy.len()
    }

    pub fn is_empty(&self) -> bool {
        self.policy.is_empty()
    }

    /// The configured capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.policy.capacity()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// See [`Policy::pin_limit`].
    pub fn pin_limit(&self) -> usize {
        self.policy.pin_limit()
    }

    /// The longest prompt the cache can ever hold whole while it runs (its full blocks all
    /// pinned at once): `pin_limit` full blocks and a partial one.
    pub fn longest_prompt(&self) -> usize {
        (self.pin_limit() + 1) * self.block_size - 1
    }

    /// How many distinct blocks are pinned.
    pub fn pinned_len(&self) -> usize {
        self.pins.len()
    }

    /// How many running requests pin `block` (0 if none).
    pub fn pin_count(&self, block: BlockHash) -> u32 {
        self.pins.get(&block).copied().unwrap_or(0)
    }

    /// The resident blocks, in no particular order (for snapshots).
    pub fn resident(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.policy.resident()
    }

    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// Empties the cache (vLLM's `reset_prefix_cache`) and returns how many blocks were
    /// resident; refused while any block is pinned. Counters are kept.
    pub fn clear(&mut self) -> Result<usize, ClearError> {
        if !self.pins.is_empty() {
            return Err(ClearError { pinned: self.pins.len() });
        }
        let n = self.policy.len();
        self.policy.clear();
        self.stats.removed += n as u64;
        Ok(n)
    }
}
