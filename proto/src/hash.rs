//! The block-hash chain: the one function the router, the replica agent and the load
//! generator all use to name KV-cache blocks.
//!
//! # Algorithm (version 1, stable across processes, machines and runs)
//!
//! ```text
//! root    = xxh3_64( "kvroute/v1" || field('m', model)
//!                    || field('l', lora)        -- only if a LoRA adapter is set
//!                    || field('s', cache_salt)  -- only if a cache_salt is set )
//!           field(tag, s) = tag (1 byte) || len(s) as u32 little-endian || UTF-8 bytes of s
//! hash_0  = xxh3_64_with_seed( LE-bytes(tokens[0 .. B]),     seed = root   )
//! hash_i  = xxh3_64_with_seed( LE-bytes(tokens[iB .. iB+B]), seed = hash_{i-1} )
//! ```
//!
//! where `B` is the block size, `LE-bytes` writes each token id as a `u32` little-endian, and
//! `xxh3_64` is XXH3's 64-bit variant (the `xxhash` Python package computes the same values:
//! `xxhash.xxh3_64_intdigest(data, seed=parent)`). Only full blocks are hashed; a trailing
//! partial block is never hashed or cached. Because every hash folds in its parent, equal
//! hashes at position `i` mean equal tokens for the whole prefix `0..=i` (up to 64-bit
//! collisions), and two tenants, models or adapters never share a block.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::BlockHash;

/// Domain-separation prefix of the root hash; bump it if the algorithm ever changes.
const ROOT_DOMAIN: &[u8] = b"kvroute/v1";

/// What a block's KV state depends on besides its tokens: blocks from different namespaces
/// never match, so tenants (`cache_salt`) and adapters (`lora`) stay apart.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheNamespace {
    pub model: String,
    pub lora: Option<String>,
    pub cache_salt: Option<String>,
}

impl CacheNamespace {
    /// A namespace for `model` with no adapter and no salt.
    pub fn new(model: impl Into<String>) -> Self {
        Self { model: model.into(), lora: None, cache_salt: None }
    }

    /// The same namespace under a LoRA adapter.
    pub fn with_lora(mut self, lora: impl Into<String>) -> Self {
        self.lora = Some(lora.into());
        self
    }

    /// The same namespace with a tenant's `cache_salt`.
    pub fn with_salt(mut self, salt: impl Into<String>) -> Self {
        self.cache_salt = Some(salt.into());
        self
    }

    /// The parent hash of every prompt's first block in this namespace.
    pub fn root(&self) -> BlockHash {
        let mut buf = Vec::with_capacity(ROOT_DOMAIN.len() + 15 + self.model.len());
        buf.extend_from_slice(ROOT_DOMAIN);
        push_field(&mut buf, b'm', &self.model);
        if let Some(lora) = &self.lora {
            push_field(&mut buf, b'l', lora);
        }
        if let Some(salt) = &self.cache_salt {
            push_field(&mut buf, b's', salt);
        }
        BlockHash(xxh3_64(&buf))
    }

    /// The chained hashes of every full block of `tokens`.
    pub fn chain(&self, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
        chain(self.root(), tokens, block_size)
    }
}

fn push_field(buf: &mut Vec<u8>, tag: u8, value: &str) {
    buf.push(tag);
    // Lengths beyond u32 cannot occur for names; saturate rather than wrap.
    let len = u32::try_from(value.len()).unwrap_or(u32::MAX);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(value.as_bytes());
}

/// The hash of one block whose tokens are `tokens`, following the block `parent` (or the
/// namespace root for a prompt's first block).
#[inline]
pub fn block_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    BlockHash(xxh3_64_with_seed(&le_bytes(tokens), parent.0))
}

#[cfg(target_endian = "little")]
#[inline]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
}

#[cfg(target_endian = "big")]
#[inline]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
}

/// What tells a request from others for ties among replicas: the chained hash of all its
/// `tokens`, the partial last block included, so that prompts differing only there (short
/// questions after one long shared prefix) spread. `blocks` are the full blocks' hashes from
/// `root`. The router's decision and the load generator's simulator both use it.
pub fn tie_key(root: BlockHash, blocks: &[BlockHash], tokens: &[u32], block_size: usize) -> u64 {
    let parent = blocks.last().copied().unwrap_or(root);
    match tokens.get(blocks.len() * block_size..).unwrap_or_default() {
        [] => parent.0,
        tail => block_hash(parent, tail).0,
    }
}

/// The chained hashes of every full block of `tokens`, starting from `parent`.
///
/// A trailing partial block is ignored. `block_size == 0` yields no blocks.
pub fn chain(parent: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(full_blocks(tokens.len(), block_size));
    extend_chain(parent, tokens, block_size, &mut out);
    out
}

/// Appends the chained hashes of every full block of `tokens` to `out`, starting from
/// `parent`; lets a hot path reuse one buffer.
pub fn extend_chain(parent: BlockHash, tokens: &[u32], block_size: usize, out: &mut Vec<BlockHash>) {
    if block_size == 0 {
        return;
    }
    let mut prev = parent;
    for block in tokens.chunks_exact(block_size) {
        prev = block_hash(prev, block);
        out.push(prev);
    }
}

/// How many full blocks `len` tokens make.
#[inline]
pub fn full_blocks(len: usize, block_size: usize) -> usize {
    len.checked_div(block_size).unwrap_or(0)
}

/// Seed-000 hit accounting: a request of `prompt_len` tokens whose first `hit_blocks` blocks
/// are cached skips `min(hit_blocks * block_size, prompt_len)` tokens of prefill.
#[inline]
pub fn hit_tokens(hit_blocks: usize, block_size: usize, prompt_len: usize) -> usize {
    hit_blocks.saturating_mul(block_size).min(prompt_len)
}

#[cfg(test)]
mod tests {

    /// The tie key is the whole prompt's chain: prompts that differ only in their partial
    /// last block get different keys; without one, it is the last full block's hash.
    #[test]
    fn tie_keys_follow_the_partial_last_block() {
        let ns = CacheNamespace::new("m");
        let key = |tokens: &[u32]| tie_key(ns.root(), &ns.chain(tokens, 4), tokens, 4);
        let shared = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_ne!(key(&[&shared[..], &[9]].concat()), key(&[&shared[..], &[10]].concat()));
        assert_eq!(key(&shared), ns.chain(&shared, 4)[1].0);
        assert_eq!(key(&[]), ns.root().0);
        assert_eq!(key(&[7]), block_hash(ns.root(), &[7]).0);
    }
    use super::*;

    #[test]
    fn partial_block_is_not_hashed() {
        let root = CacheNamespace::new("m").root();
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(chain(root, &tokens, 4).len(), 2);
        assert_eq!(chain(root, &tokens[..3], 4).len(), 0);
        assert!(chain(root, &tokens, 0).is_empty());
    }

    #[test]
    fn chain_matches_block_by_block() {
        let root = CacheNamespace::new("m").root();
        let tokens: Vec<u32> = (100..132).collect();
        let hashes = chain(root, &tokens, 8);
        let mut parent = root;
        for (i, h) in hashes.iter().enumerate() {
            parent = block_hash(parent, &tokens[i * 8..(i + 1) * 8]);
            assert_eq!(*h, parent);
        }
    }

    #[test]
    fn namespace_fields_separate_roots() {
        let base = CacheNamespace::new("m");
        let roots = [
            base.root(),
            base.clone().with_lora("a").root(),
            base.clone().with_salt("a").root(),
            base.clone().with_lora("a").with_salt("a").root(),
            CacheNamespace::new("m2").root(),
            // A field boundary cannot be shifted to forge another namespace.
            CacheNamespace::new("ml").root(),
        ];
        for i in 0..roots.len() {
            for j in i + 1..roots.len() {
                assert_ne!(roots[i], roots[j], "roots {i} and {j} collide");
            }
        }
    }

    #[test]
    fn hit_tokens_clamps_to_prompt_length() {
        assert_eq!(hit_tokens(3, 512, 2000), 1536);
        assert_eq!(hit_tokens(4, 512, 2000), 2000);
        assert_eq!(hit_tokens(0, 512, 2000), 0);
        assert_eq!(hit_tokens(usize::MAX, 512, 7), 7);
    }
}
