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
//! SGLang's hashes cover the tokens only ([`Hashes::Blind`]): its radix cache keeps a page
//! apart for each adapter and salt, and the same tokens under two of them are two pages of
//! one hash. Their entries are keyed by the hash mixed with the run's namespace root (every
//! SGLang event names its namespace, and a page's parent is in its namespace), so a run
//! chains from its own namespace's parent, never another tenant's. Removals name no
//! namespace: a hash held under several is taken from each of them, so the index never keeps
//! a block that is gone. The price is high for a page every tenant shares (a common system
//! prompt under per-user salts): the first tenant to evict it takes it from all, and the
//! others' pages after it are not indexed again while they hold it (`unknown_parent`), nor
//! is its later removal known (`unknown_block`). (SGLang's `format: "dynamo"` hashes the
//! namespace too; the router has not been tried with it.)
//!
//! A rank's host tier (blocks offloaded to CPU memory) has a map of its own, filled by
//! [`EngineMap::store_offloaded`]. An offloaded block is the device block of the same engine
//! hash copied out (vLLM's offloading connector and SGLang's HiCache keep the engine's
//! hashes), so it takes the router hash that block has in either tier. A block neither tier
//! knows is skipped (`unknown_parent`), unless the engine is SGLang: its events carry their
//! tokens and name their namespace (`cache_salt`, `lora_name`), so the block is chained from
//! its parent (in either tier) or its namespace's root as above. vLLM's offload events carry
//! no `extra_keys` (placeholders carry not even tokens): chained, a salted or multimodal
//! block would be named as plain tokens, a false hit for requests of those tokens.
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

use std::collections::{HashMap, HashSet};

use kvroute_proto::hash::block_hash;
use kvroute_proto::{BlockHash, CacheNamespace};

use super::decode::{Removed, Stored};
use super::metrics::SkipReason;

#[derive(Clone, Copy, Debug)]
struct Entry {
    router: BlockHash,
    refs: u32,
}

/// What an engine's block hashes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hashes {
    /// The router's own chain (the replica agent).
    Router,
    /// The engine's own, covering the cache namespace (vLLM: the adapter and salt are in
    /// the hashed extra keys).
    Namespaced,
    /// The engine's own, of the tokens alone (SGLang's default).
    Blind,
}

/// One rank's blocks.
#[derive(Debug, Default)]
pub(crate) struct EngineMap {
    map: HashMap<(u32, BlockHash), Entry>,
    /// For [`Hashes::Blind`] engines: the namespace roots each engine hash is held under
    /// (the map's keys are the hash mixed with one of them, [`under`]).
    roots: HashMap<(u32, BlockHash), Roots>,
    /// References held, over every entry (what [`Self::drain_into`] reports).
    references: usize,
}

/// The namespaces a namespace-blind hash is held under: almost always one; a set when many
/// (a system prompt's page under every user's `cache_salt`: a list made each store a scan).
#[derive(Debug)]
enum Roots {
    One(BlockHash),
    Many(HashSet<BlockHash>),
}

impl Roots {
    fn add(&mut self, root: BlockHash) {
        match self {
            Roots::One(one) if *one == root => {}
            Roots::One(one) => *self = Roots::Many(HashSet::from([*one, root])),
            Roots::Many(many) => {
                many.insert(root);
            }
        }
    }
}

/// The root of a stored run's cache namespace.
fn namespace_root(stored: &Stored, model: &str) -> BlockHash {
    CacheNamespace { model: model.to_owned(), lora: stored.lora.clone(), cache_salt: stored.salt.clone() }
        .root()
}

/// The map's key of a namespace-blind engine hash held under the namespace `root`.
fn under(engine: BlockHash, root: BlockHash) -> BlockHash {
    BlockHash(engine.0 ^ kvroute_proto::mix::mix64(root.0))
}

impl EngineMap {
    /// Records a stored run and appends the router hashes to add to the index (one per
    /// stored copy of a block, duplicates included; none for a block re-announced), the
    /// engine's hashes read as `hashes` says.
    pub(crate) fn store(
        &mut self,
        stored: &Stored,
        hashes: Hashes,
        model: &str,
        out: &mut Vec<BlockHash>,
    ) -> Result<(), SkipReason> {
        let group = stored.group;
        if hashes == Hashes::Router {
            for &h in &stored.engine {
                out.push(self.add(group, h, h));
            }
            return Ok(());
        }
        let bs = stored.block_size as usize;
        if bs == 0 || stored.tokens.len() != stored.engine.len().saturating_mul(bs) {
            return Err(SkipReason::TokensMismatch);
        }
        // The namespace's root, made only where it is needed (an allocation and a hash).
        let namespace_root = || namespace_root(stored, model);
        let root = (hashes == Hashes::Blind).then(namespace_root);
        let key = |engine: BlockHash| match root {
            Some(root) => under(engine, root),
            None => engine,
        };
        let mut prev = match stored.parent {
            Some(parent) => match self.map.get(&(group, key(parent))) {
                Some(entry) => entry.router,
                None => return Err(SkipReason::UnknownParent),
            },
            None => root.unwrap_or_else(namespace_root),
        };
        // Held blocks of a re-announcement get no second reference (see the module docs).
        let reannounced = stored.reused.unwrap_or(stored.parent.is_none());
        for (&engine, tokens) in stored.engine.iter().zip(stored.tokens.chunks_exact(bs)) {
            prev = block_hash(prev, tokens);
            if reannounced && self.map.contains_key(&(group, key(engine))) {
                continue;
            }
            out.push(self.hold(group, engine, root, prev));
        }
        Ok(())
    }

    /// Adds a reference to `engine` (held under the namespace `root` for a namespace-blind
    /// engine) as `router`; returns the router hash it is held as.
    fn hold(
        &mut self,
        group: u32,
        engine: BlockHash,
        root: Option<BlockHash>,
        router: BlockHash,
    ) -> BlockHash {
        let Some(root) = root else { return self.add(group, engine, router) };
        match self.roots.get_mut(&(group, engine)) {
            Some(roots) => roots.add(root),
            None => {
                self.roots.insert((group, engine), Roots::One(root));
            }
        }
        self.add(group, under(engine, root), router)
    }

    /// Records a run stored on the host tier (this map is that tier's; `device` is the same
    /// rank's device tier) and appends the router hashes to add to the host tier's index;
    /// returns how many blocks could not be named (see the module docs).
    pub(crate) fn store_offloaded(
        &mut self,
        stored: &Stored,
        hashes: Hashes,
        model: &str,
        device: &EngineMap,
        out: &mut Vec<BlockHash>,
    ) -> usize {
        let group = stored.group;
        if hashes == Hashes::Router {
            // The router's own chain names itself (the agent's `--offload-blocks`).
            return self.store(stored, hashes, model, out).map_or(stored.engine.len(), |()| 0);
        }
        let bs = stored.block_size as usize;
        // Only an engine whose events say their namespace is chained (SGLang); vLLM's say
        // neither salt nor multimodal keys, and every block it offloads is one its cache
        // announced.
        let tokens = (hashes == Hashes::Blind
            && bs > 0
            && stored.tokens.len() == stored.engine.len().saturating_mul(bs))
        .then(|| stored.tokens.chunks_exact(bs));
        let root = (hashes == Hashes::Blind).then(|| namespace_root(stored, model));
        let key = |engine: BlockHash| root.map_or(engine, |root| under(engine, root));
        let named = |map: &EngineMap, engine: BlockHash| map.map.get(&(group, key(engine))).map(|e| e.router);
        let mut prev = match stored.parent {
            Some(parent) => named(self, parent).or_else(|| named(device, parent)),
            None => root,
        };
        let reannounced = stored.reused.unwrap_or(stored.parent.is_none());
        let mut unnamed = 0;
        let mut tokens = tokens.into_iter().flatten();
        for &engine in &stored.engine {
            let chained = prev.zip(tokens.next()).map(|(prev, tokens)| block_hash(prev, tokens));
            prev = named(self, engine).or_else(|| named(device, engine)).or(chained);
            let Some(router) = prev else {
                unnamed += 1;
                continue;
            };
            if reannounced && self.map.contains_key(&(group, key(engine))) {
                continue;
            }
            out.push(self.hold(group, engine, root, router));
        }
        unnamed
    }

    fn add(&mut self, group: u32, engine: BlockHash, router: BlockHash) -> BlockHash {
        let entry = self.map.entry((group, engine)).or_insert(Entry { router, refs: 0 });
        if let Some(refs) = entry.refs.checked_add(1) {
            entry.refs = refs;
            self.references += 1;
        }
        entry.router
    }

    /// Drops one reference per removed engine hash and appends the router hashes to remove
    /// from the index; returns how many hashes were unknown.
    pub(crate) fn remove(&mut self, removed: &Removed, out: &mut Vec<BlockHash>) -> usize {
        let mut unknown = 0;
        for &engine in &removed.engine {
            let group = removed.group;
            match self.roots.remove(&(group, engine)) {
                // Namespace-blind: one reference from every namespace holding it; those
                // still holding it after that stay listed.
                Some(Roots::One(root)) => {
                    if self.release((group, under(engine, root)), out) > 0 {
                        self.roots.insert((group, engine), Roots::One(root));
                    }
                }
                Some(Roots::Many(mut roots)) => {
                    roots.retain(|&root| self.release((group, under(engine, root)), out) > 0);
                    let mut left = roots.iter();
                    match (left.next(), left.next()) {
                        (None, _) => {}
                        (Some(&one), None) => {
                            self.roots.insert((group, engine), Roots::One(one));
                        }
                        _ => {
                            self.roots.insert((group, engine), Roots::Many(roots));
                        }
                    }
                }
                None if self.map.contains_key(&(group, engine)) => {
                    self.release((group, engine), out);
                }
                None => unknown += 1,
            }
        }
        // Memory follows the blocks held, not the most ever held (as the index's does).
        crate::index::shrink_if_sparse(&mut self.map);
        crate::index::shrink_if_sparse(&mut self.roots);
        unknown
    }

    /// Drops one reference of the entry at `key` (which exists), appending its router hash to
    /// `out`; returns the references left.
    fn release(&mut self, key: (u32, BlockHash), out: &mut Vec<BlockHash>) -> u32 {
        let Some(entry) = self.map.get_mut(&key) else { return 0 };
        out.push(entry.router);
        entry.refs -= 1;
        self.references -= 1;
        let left = entry.refs;
        if left == 0 {
            self.map.remove(&key);
        }
        left
    }

    /// Empties the map, appending every reference's router hash (with repeats) to `out`, and
    /// releases its memory.
    pub(crate) fn drain_into(&mut self, out: &mut Vec<BlockHash>) {
        out.reserve(self.references);
        for entry in std::mem::take(&mut self.map).into_values() {
            out.extend(std::iter::repeat_n(entry.router, entry.refs as usize));
        }
        self.roots = HashMap::new();
        self.references = 0;
    }

    /// Forgets everything without reporting it (the caller cleared the whole replica).
    pub(crate) fn reset(&mut self) {
        self.map = HashMap::new();
        self.roots = HashMap::new();
        self.references = 0;
    }

    /// References held (a block stored twice and not yet removed is held twice).
    pub(crate) fn references(&self) -> usize {
        self.references
    }

    /// Engine blocks held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Entries the map has room for.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.map.capacity()
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
        map.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), Hashes::Namespaced, "m", &mut out).unwrap();
        map.store(&stored(&[12], Some(11), vec![5, 6]), Hashes::Namespaced, "m", &mut out).unwrap();
        assert_eq!(out, whole);
        assert_eq!(
            map.store(&stored(&[13], Some(99), vec![7, 8]), Hashes::Namespaced, "m", &mut out),
            Err(SkipReason::UnknownParent)
        );
    }

    #[test]
    fn refcounts_duplicate_stores() {
        let mut map = EngineMap::default();
        let mut out = Vec::new();
        map.store(&stored(&[10], None, vec![1, 2]), Hashes::Namespaced, "m", &mut out).unwrap();
        // A second copy from token 0, said to be new (vLLM's `origin: "NEW"`).
        let copy = Stored { reused: Some(false), ..stored(&[10], None, vec![1, 2]) };
        map.store(&copy, Hashes::Namespaced, "m", &mut out).unwrap();
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
        map.store(&stored(&[10], None, vec![1, 2]), Hashes::Namespaced, "m", &mut out).unwrap();
        assert_eq!(map.remove(&Removed { engine: vec![BlockHash(10)], group: 1 }, &mut gone), 1);
        let mut drained = Vec::new();
        map.drain_into(&mut drained);
        assert_eq!(drained.len(), 1);
    }

    /// A map that held many blocks and holds few gives the room back, as the index does:
    /// one rank's peak stayed allocated (some 150 MB at 4 Mi blocks) until a clear.
    #[test]
    fn memory_follows_the_blocks_held() {
        let mut map = EngineMap::default();
        let (mut out, mut gone) = (Vec::new(), Vec::new());
        let hashes: Vec<u64> = (1..=4096).collect();
        let tokens = (0..2 * hashes.len() as u32).collect();
        map.store(&stored(&hashes, None, tokens), Hashes::Namespaced, "m", &mut out).unwrap();
        let peak = map.capacity();
        assert!(peak >= 4096);
        let removed = Removed { engine: hashes[8..].iter().copied().map(BlockHash).collect(), group: 0 };
        assert_eq!(map.remove(&removed, &mut gone), 0);
        assert_eq!(map.len(), 8);
        assert!(map.capacity() < peak / 4, "{} of {peak}", map.capacity());
        let removed = Removed { engine: hashes[..8].iter().copied().map(BlockHash).collect(), group: 0 };
        map.remove(&removed, &mut gone);
        assert_eq!(map.capacity(), 0);
    }

    /// vLLM's `kv_cache_report_mode="full"` announces a request's prefix-cache hits again,
    /// from token 0: the blocks were held once and are removed once. Counted as second
    /// copies, they stayed indexed after their eviction.
    #[test]
    fn reannounced_prefixes_add_no_reference() {
        let mut map = EngineMap::default();
        let mut out = Vec::new();
        map.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), Hashes::Namespaced, "m", &mut out).unwrap();
        let first = out.clone();
        // Unsaid, no parent, every block held: a re-announcement.
        map.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), Hashes::Namespaced, "m", &mut out).unwrap();
        map.store(&stored(&[10], None, vec![1, 2]), Hashes::Namespaced, "m", &mut out).unwrap();
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
        map.store(&stored(&[10], None, vec![1, 2]), Hashes::Namespaced, "m", &mut out).unwrap();
        let reused = Stored { reused: Some(true), ..stored(&[10, 11], None, vec![1, 2, 3, 4]) };
        map.store(&reused, Hashes::Namespaced, "m", &mut out).unwrap();
        assert_eq!(out, first, "block 11 added, block 10 not again");
        // Unsaid, with blocks not held (the router started after the engine cached them): the
        // held ones get no second reference, the others are stored.
        out.clear();
        map.store(&stored(&[10, 11, 12], None, vec![1, 2, 3, 4, 5, 6]), Hashes::Namespaced, "m", &mut out)
            .unwrap();
        assert_eq!(out.len(), 1, "block 12 only");
        let mut gone = Vec::new();
        let removed = Removed { engine: vec![BlockHash(12), BlockHash(11), BlockHash(10)], group: 0 };
        assert_eq!(map.remove(&removed, &mut gone), 0);
        assert_eq!(map.len(), 0, "one removal each ends them");
        // With a parent it is a new copy (vLLM re-announces from token 0 only).
        map.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), Hashes::Namespaced, "m", &mut out).unwrap();
        map.store(&stored(&[11], Some(10), vec![3, 4]), Hashes::Namespaced, "m", &mut out).unwrap();
        map.remove(&Removed { engine: vec![BlockHash(11)], group: 0 }, &mut gone);
        assert_eq!(map.len(), 2, "block 11 has its second copy");
    }

    /// SGLang hashes the tokens alone: the same page under two salts is one hash. Tenant B's
    /// copy of tenant A's first page, and B's page after it, are B's: chained from A's, they
    /// were a false hit for A's requests. A removal of the shared hash takes it from both.
    #[test]
    fn namespace_blind_hashes_chain_within_their_namespace() {
        let salted = |salt: &str, stored: Stored| Stored { salt: Some(salt.into()), ..stored };
        let (a, b) = (CacheNamespace::new("m").with_salt("A"), CacheNamespace::new("m").with_salt("B"));
        let mut map = EngineMap::default();
        let mut out = Vec::new();
        map.store(&salted("A", stored(&[10], None, vec![1, 2])), Hashes::Blind, "m", &mut out).unwrap();
        map.store(&salted("B", stored(&[10], None, vec![1, 2])), Hashes::Blind, "m", &mut out).unwrap();
        map.store(&salted("B", stored(&[11], Some(10), vec![3, 4])), Hashes::Blind, "m", &mut out).unwrap();
        let b_chain = b.chain(&[1, 2, 3, 4], 2);
        assert_eq!(out, [a.chain(&[1, 2], 2)[0], b_chain[0], b_chain[1]]);
        assert!(!out.contains(&a.chain(&[1, 2, 3, 4], 2)[1]), "no page of A's after its first");
        assert_eq!(
            map.store(&salted("A", stored(&[11], Some(12), vec![3, 4])), Hashes::Blind, "m", &mut out),
            Err(SkipReason::UnknownParent)
        );

        let mut gone = Vec::new();
        assert_eq!(
            map.remove(&Removed { engine: vec![BlockHash(11), BlockHash(10)], group: 0 }, &mut gone),
            0
        );
        // Page 11 first; then page 10 under each namespace, in no particular order.
        assert_eq!(gone[0], b_chain[1]);
        gone[1..].sort_unstable();
        let mut tens = [a.chain(&[1, 2], 2)[0], b_chain[0]];
        tens.sort_unstable();
        assert_eq!(gone[1..], tens);
        assert_eq!(map.len(), 0);
        assert_eq!(map.remove(&Removed { engine: vec![BlockHash(10)], group: 0 }, &mut gone), 1);
        // The namespace-covering kind keys by the hash as it is.
        out.clear();
        map.store(&salted("A", stored(&[10], None, vec![1, 2])), Hashes::Namespaced, "m", &mut out).unwrap();
        map.store(&salted("B", stored(&[11], Some(10), vec![3, 4])), Hashes::Namespaced, "m", &mut out)
            .unwrap();
        assert_eq!(out[1], a.chain(&[1, 2, 3, 4], 2)[1], "vLLM's parent hash names its namespace");
    }

    /// The host tier names a block as the device tier does, by its hash; a block neither tier
    /// knows only for SGLang, whose events say their namespace, from its parent in either
    /// tier or its namespace's root (vLLM's say no salt nor multimodal keys).
    #[test]
    fn offloaded_blocks_take_the_device_tiers_names() {
        let ns = CacheNamespace::new("m");
        let whole = ns.chain(&[1, 2, 3, 4, 5, 6], 2);
        let (mut device, mut host) = (EngineMap::default(), EngineMap::default());
        let mut out = Vec::new();
        device.store(&stored(&[10, 11], None, vec![1, 2, 3, 4]), Hashes::Namespaced, "m", &mut out).unwrap();
        let placeholder = Stored { block_size: 0, ..stored(&[11, 10, 99], None, vec![]) };
        out.clear();
        assert_eq!(host.store_offloaded(&placeholder, Hashes::Namespaced, "m", &device, &mut out), 1, "99");
        assert_eq!(out, [whole[1], whole[0]]);
        // vLLM's self-describing events: a block its cache announced, named by it; one it did
        // not is unnamed, tokens or not (its parent's name does not say its keys).
        device.store(&stored(&[12], Some(11), vec![5, 6]), Hashes::Namespaced, "m", &mut out).unwrap();
        out.clear();
        let next = stored(&[12, 13], Some(11), vec![5, 6, 7, 7]);
        assert_eq!(host.store_offloaded(&next, Hashes::Namespaced, "m", &device, &mut out), 1, "13");
        assert_eq!(out, [whole[2]]);
        // SGLang says its namespace: chained from its root, then from its parent in host
        // memory after the cache let it go.
        let salted = |s: Stored| Stored { salt: Some("A".into()), ..s };
        let tenant = ns.clone().with_salt("A").chain(&[7, 8, 9, 9, 3, 3], 2);
        let (mut sglang, nothing) = (EngineMap::default(), EngineMap::default());
        out.clear();
        let fresh = salted(stored(&[20, 21], None, vec![7, 8, 9, 9]));
        assert_eq!(sglang.store_offloaded(&fresh, Hashes::Blind, "m", &nothing, &mut out), 0);
        let after = salted(stored(&[22], Some(21), vec![3, 3]));
        assert_eq!(sglang.store_offloaded(&after, Hashes::Blind, "m", &nothing, &mut out), 0);
        assert_eq!(out, tenant);
        let mut gone = Vec::new();
        // A removal from the host tier is the host tier's.
        gone.clear();
        let removed = Removed { engine: vec![BlockHash(12), BlockHash(10)], group: 0 };
        assert_eq!(host.remove(&removed, &mut gone), 0);
        assert_eq!(gone, [whole[2], whole[0]]);
        assert_eq!(host.len(), 1, "11");
        assert_eq!(device.len(), 3, "the cache's own are its own");
    }

    /// A namespace-blind hash held under three namespaces (one of them twice): each removal
    /// takes one reference from every namespace still holding it, until none does.
    #[test]
    fn namespace_blind_removals_go_down_every_namespace() {
        let salted = |salt: &str| Stored { salt: Some(salt.into()), ..stored(&[10], None, vec![1, 2]) };
        let first = |salt: &str| CacheNamespace::new("m").with_salt(salt).chain(&[1, 2], 2)[0];
        let mut map = EngineMap::default();
        let mut out = Vec::new();
        let copy = |salt: &str| Stored { reused: Some(false), ..salted(salt) };
        for stored in [salted("A"), copy("A"), salted("B"), salted("C")] {
            map.store(&stored, Hashes::Blind, "m", &mut out).unwrap();
        }
        assert_eq!(out, [first("A"), first("A"), first("B"), first("C")]);
        let removed = Removed { engine: vec![BlockHash(10)], group: 0 };
        let mut gone = Vec::new();
        assert_eq!(map.remove(&removed, &mut gone), 0);
        // In no particular order: the namespaces are a set.
        gone.sort_unstable();
        let mut each = [first("A"), first("B"), first("C")];
        each.sort_unstable();
        assert_eq!(gone, each, "one from each");
        assert_eq!(map.len(), 1, "A's second copy is left");
        gone.clear();
        assert_eq!(map.remove(&removed, &mut gone), 0);
        assert_eq!(gone, [first("A")]);
        assert_eq!(map.len(), 0);
        assert_eq!(map.remove(&removed, &mut gone), 1, "none left: unknown");
        // Under one namespace, held twice: the first removal leaves it listed.
        map.store(&salted("A"), Hashes::Blind, "m", &mut out).unwrap();
        map.store(&copy("A"), Hashes::Blind, "m", &mut out).unwrap();
        assert_eq!(map.remove(&removed, &mut gone), 0);
        assert_eq!(map.remove(&removed, &mut gone), 0);
        assert_eq!(map.remove(&removed, &mut gone), 1);
    }
}
