//! The cache's configuration: capacity, block size, policy and S3FIFO's parameters, with the
//! checks that reject a cache that could not run.

use serde::{Deserialize, Serialize};

/// Which eviction policy a cache uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Evict the least recently used block.
    #[default]
    Lru,
    /// Evict the least frequently used block, ties by least recent use.
    Lfu,
    /// Small/main/ghost FIFOs with saturating frequencies (Yang et al., SOSP 2023).
    S3fifo,
}

/// S3FIFO's two knobs, with seed 000's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct S3FifoParams {
    /// Share of the capacity given to the small queue, rounded half-to-even.
    pub small_ratio: f64,
    /// Saturation point of the per-block access counter.
    pub max_freq: u8,
}

impl Default for S3FifoParams {
    fn default() -> Self {
        Self { small_ratio: 0.1, max_freq: 3 }
    }
}

/// Everything needed to build a [`super::BlockCache`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    /// How many blocks fit in the cache.
    pub capacity_blocks: usize,
    /// Tokens per block, for hit-token accounting.
    pub block_size: usize,
    /// Which eviction policy to run.
    pub policy: PolicyKind,
    /// Only read when `policy` is S3FIFO.
    #[serde(default)]
    pub s3fifo: S3FifoParams,
}

impl CacheConfig {
    /// The capacity the cache's policy cannot run with, if so, found without building it:
    /// more blocks than it can index, or an S3FIFO queue left empty.
    pub fn capacity_problem(&self) -> Option<ConfigError> {
        let cap = self.capacity_blocks;
        if cap > MAX_CAPACITY {
            return Some(ConfigError::TooLarge(cap));
        }
        if self.policy == PolicyKind::S3fifo {
            let small_cap = super::small_cap(cap, self.s3fifo.small_ratio);
            let main_cap = cap.saturating_sub(small_cap);
            if small_cap == 0 || main_cap == 0 {
                return Some(ConfigError::EmptyQueue { small_cap, main_cap });
            }
        }
        None
    }
}

/// Most blocks a cache holds: slab indices are `u32`, and S3FIFO also keeps up to `capacity`
/// ghost nodes.
pub const MAX_CAPACITY: usize = (u32::MAX / 2) as usize;

/// A configuration the cache cannot run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("cache capacity must be at least one block")]
    ZeroCapacity,
    #[error("cache capacity {0} blocks is more than this cache can index")]
    TooLarge(usize),
    #[error("block size must be at least one token")]
    ZeroBlockSize,
    #[error("S3FIFO small_ratio must be within [0, 1], got {0}")]
    SmallRatio(f64),
    #[error(
        "S3FIFO needs non-empty small and main queues, got small_cap {small_cap} and main_cap \
         {main_cap} (raise the capacity or adjust small_ratio)"
    )]
    EmptyQueue { small_cap: usize, main_cap: usize },
}
