//! What one (replica, rank) holds: engine block id → router block hash, with a reference
//! count per engine block.
//!
//! - vLLM / SGLang: the router hash of a stored run is `chain(seed, token_ids, block_size)`
//!   with `seed` = the parent's router hash (looked up by its engine hash), or the cache
//!   namespace root when the run has no parent. An unknown parent cannot be chained: the run
//!   is skipped (`unknown_parent`).
//! - kvroute: the engine hash is the router hash (`parent` is not needed).
//!
//! Keys are `(group_idx, engine hash)`: hashes are only unique within a KV-cache group.
//! Real engines store the same block twice and remove it twice (the capture in
//! `proto/tests/data/vllm-capture.jsonl` does); every store of a copy adds one reference
//! here and one in the index, every known removal takes one from both, so the two stay in
//! step. A second store of an engine hash keeps its first router hash (they can only differ
//! on a 64-bit collision or a namespace the engine does not hash, and consistency with the
//! index matters more). The map also lets a rank be cleared without touching other ranks'
//! entries.
//!
//! Re-announcements add no reference. Under `kv_cache_report_mode="full"` vLLM announces a
//! request's prefix-cache hits again as a `BlockStored` from token 0 (no parent), for blocks
//! it already holds once: counted as copies, they would outlive their one removal and stay
//! indexed after eviction. A run is a re-announcement when the engine says so (`origin:
//! "REUSED"`), or, when it says nothing, when it has no parent: its blocks this rank holds
//! get no second reference, the others are stored as usual (the router may have missed
//! them: it started after the engine, or rebuilt the rank). The price of the guess: a true
//! second copy stored from token 0 (two requests that computed the same prompt at once)
//! counts once, so the index drops the prefix at the first copy's eviction, a missed hit
//! while the second copy lasts, never a false one.

use std::collections::HashMap;

use kvroute_proto::hash::block_hash;
use kvroute_proto::{BlockHash, CacheNamespace};

use super::decode::{Removed, Stored};
use super::metrics::SkipReason;

#[derive(Clone, Copy, Debug)]
struct Entry {
    router: BlockHash,
    refs: u32,
}

/// One rank's blocks.
#[derive(Debug, Default)]
pub(crate) struct EngineMap {
    map: HashMap<(u32, BlockHash), Entry>,
}

impl EngineMap {
    /// Records a stored run and appends the router hashes to add to the index (one per
    /// stored copy of a block, duplicates included; none for a block re-announced). `native`:
    /// the engine hashes are router hashes.
    pub(crate) fn store(
        &mut self,
        stored: &Stored,
        native: bool,
        model: &str,
        out: &mut Vec<BlockHash>,
    ) -> Result<(), SkipReason> {
        let group = stored.group;
        if native {
            for &h in &stored.engine {
                out.push(self.add(group, h, h));
            }
            return Ok(());
        }
        let bs = stored.block_size as usize;
        if bs == 0 || stored.tokens.len() != stored.engine.len().saturating_mul(bs) {
            return Err(SkipReason::TokensMismatch);
        }
        let mut prev = match stored.parent {
            Some(parent) => match self.map.get(&(group, parent)) {
                Some(entry) => entry.router,
                None => return Err(SkipReason::UnknownParent),
            },
            None => CacheNamespace {
                model: model.to_owned(),
                lora: stored.lora.clone(),
                cache_salt: stored.salt.clone(),
            }
            .root(),
        };
        // Held blocks of a re-announcement get no second reference (see the module docs).
        let reannounced = stored.reused.unwrap_or(stored.parent.is_none());
        for (&engine, tokens) in stored.engine.iter().zip(stored.tokens.chunks_exact(bs)) {
            prev = block_hash(prev, tokens);
            if reannounced && self.map.contains_key(&(group, engine)) {
                continue;
            }
            out.push(self.add(group, engine, prev));
        }
        Ok(())
    }

    fn add(&mut self, group: u32, engine: BlockHash, router: BlockHash) -> BlockHash {
        let entry = self.map.entry((group, engine)).or_insert(Entry { router, refs: 0 });
        entry.refs = entry.refs.saturating_add(1);
        entry.router
    }

    /// Drops one reference per removed engine hash and appends the router hashes to remove
    /// from the index; returns how many hashes were unknown.
    pub(crate) fn remove(&mut self, removed: &Removed, out: &mut Vec<BlockHash>) -> usize {
        let mut unknown = 0;
        for &engine in &removed.engine {
            let key = (removed.group, engine);
            match self.map.get_mut(&key) {
                Some(entry) => {
                    out.push(entry.router);
                    entry.refs -= 1;
                    if entry.refs == 0 {
                        self.map.remove(&key);
                    }
                }
                None => unknown += 1,
            }
        }
        unknown
    }

    /// Empties the map, appending every reference's router hash (with repeats) to `out`, and
    /// releases its memory.
    pub(crate) fn drain_into(&mut self, out: &mut Vec<BlockHash>) {
        for entry in std::mem::take(&mut self.map).into_values() {
            out.extend(std::iter::repeat_n(entry.router, entry.refs as usize));
        }
    }

    /// Forgets everything without reporting it (the caller cleared the whole replica).
    pub(crate) fn reset(&mut self) {
        self.map = HashMap::new();
    }

    /// Engine blocks held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(engine: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> Stored {
        Stored {
            engine: engine.iter().copied().map(BlockHash).collect(),
            parent: parent.map(BlockHash),
            tokens,
            block_size: 2,
            lora: None,
            salt: None,
            group: 0,
            reused: None,
        }
    }

    #[test]
    fn recomputes_the_router_chain_across_events() {
        let ns = CacheNamespace::new("m");
        let whole = ns.chain(&[1, 2, 3, 4, 5, 6], 2);
        let mut map = EngineMap::default();
        let mut out = Vec::new();
        map.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), false, "m", &mut out).unwrap();
        map.store(&stored(&[12], Some(11), vec![5, 6]), false, "m", &mut out).unwrap();
        assert_eq!(out, whole);
        assert_eq!(
            map.store(&stored(&[13], Some(99), vec![7, 8]), false, "m", &mut out),
            Err(SkipReason::UnknownParent)
        );
    }

    #[test]
    fn refcounts_duplicate_stores() {
        let mut map = EngineMap::default();
        let mut out = Vec::new();
        map.store(&stored(&[10], None, vec![1, 2]), false, "m", &mut out).unwrap();
        // A second copy from token 0, said to be new (vLLM's `origin: "NEW"`).
        let copy = Stored { reused: Some(false), ..stored(&[10], None, vec![1, 2]) };
        map.store(&copy, false, "m", &mut out).unwrap();
        assert_eq!(out[0], out[1]);
        let removed = Removed { engine: vec![BlockHash(10)], group: 0 };
        let mut gone = Vec::new();
        assert_eq!(map.remove(&removed, &mut gone), 0);
        assert_eq!(map.len(), 1);
        assert_eq!(map.remove(&removed, &mut gone), 0);
        assert_eq!(map.len(), 0);
        assert_eq!(map.remove(&removed, &mut gone), 1);
        assert_eq!(gone, vec![out[0], out[0]]);
        // Another group's hash never touches group 0's entries.
        map.store(&stored(&[10], None, vec![1, 2]), false, "m", &mut out).unwrap();
        assert_eq!(map.remove(&Removed { engine: vec![BlockHash(10)], group: 1 }, &mut gone), 1);
        let mut drained = Vec::new();
        map.drain_into(&mut drained);
        assert_eq!(drained.len(), 1);
    }

    /// vLLM's `kv_cache_report_mode="full"` announces a request's prefix-cache hits again,
    /// from token 0: the blocks were held once and are removed once. Counted as second
    /// copies, they stayed indexed after their eviction.
    #[test]
    fn reannounced_prefixes_add_no_reference() {
        let mut map = EngineMap::default();
        let mut out = Vec::new();
        map.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), false, "m", &mut out).unwrap();
        let first = out.clone();
        // Unsaid, no parent, every block held: a re-announcement.
        map.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), false, "m", &mut out).unwrap();
        map.store(&stored(&[10], None, vec![1, 2]), false, "m", &mut out).unwrap();
        assert_eq!(out, first, "nothing more to index");
        let mut gone = Vec::new();
        assert_eq!(
            map.remove(&Removed { engine: vec![BlockHash(11), BlockHash(10)], group: 0 }, &mut gone),
            0
        );
        assert_eq!(map.len(), 0, "one removal each ends them");
        assert_eq!(gone, vec![first[1], first[0]]);

        // Said to be reused: only the blocks not held are stored (the router had missed them).
        out.clear();
        map.store(&stored(&[10], None, vec![1, 2]), false, "m", &mut out).unwrap();
        let reused = Stored { reused: Some(true), ..stored(&[10, 11], None, vec![1, 2, 3, 4]) };
        map.store(&reused, false, "m", &mut out).unwrap();
        assert_eq!(out, first, "block 11 added, block 10 not again");
        // Unsaid, with blocks not held (the router started after the engine cached them): the
        // held ones get no second reference, the others are stored.
        out.clear();
        map.store(&stored(&[10, 11, 12], None, vec![1, 2, 3, 4, 5, 6]), false, "m", &mut out).unwrap();
        assert_eq!(out.len(), 1, "block 12 only");
        let mut gone = Vec::new();
        let removed = Removed { engine: vec![BlockHash(12), BlockHash(11), BlockHash(10)], group: 0 };
        assert_eq!(map.remove(&removed, &mut gone), 0);
        assert_eq!(map.len(), 0, "one removal each ends them");
        // With a parent it is a new copy (vLLM re-announces from token 0 only).
        map.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), false, "m", &mut out).unwrap();
        map.store(&stored(&[11], Some(10), vec![3, 4]), false, "m", &mut out).unwrap();
        map.remove(&Removed { engine: vec![BlockHash(11)], group: 0 }, &mut gone);
        assert_eq!(map.len(), 2, "block 11 has its second copy");
    }
}
