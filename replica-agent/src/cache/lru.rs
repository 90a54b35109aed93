//! LRU: on a miss with the cache full, evict the least recently used unpinned block.
//!
//! Parameters: `capacity` (blocks). Structure: a slab of nodes threaded on one recency list
//! (head = least recent) plus a hash map from block to node, so every access is O(1).
//!
//! Pinning: a pinned block leaves the recency list, so it is never a victim and costs
//! nothing to skip; on its last unpin it rejoins at the most-recent end (the request that
//! held it has just used it). A miss finds no victim only when all `capacity` resident blocks
//! are pinned, so `pin_limit = capacity`. With no pins this is plain LRU.

use kvroute_proto::BlockHash;

use super::slab::{BlockMap, Link, Linked, List, Slab, UP_FRONT};
use super::{Access, Full, Policy};

#[derive(Clone, Copy, Debug)]
struct Node {
    block: BlockHash,
    pinned: bool,
    link: Link,
}

impl Linked for Node {
    fn link(&self) -> Link {
        self.link
    }
    fn link_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

/// Least-recently-used eviction.
#[derive(Debug, Clone)]
pub struct Lru {
    capacity: usize,
    map: BlockMap<u32>,
    nodes: Slab<Node>,
    /// Unpinned resident blocks, least recently used first.
    order: List,
}

impl Lru {
    /// An empty LRU cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        let mut map = BlockMap::default();
        map.reserve(capacity.min(UP_FRONT));
        Self { capacity, map, nodes: Slab::with_capacity(capacity), order: List::default() }
    }
}

impl Policy for Lru {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn contains(&self, block: BlockHash) -> bool {
        self.map.contains_key(&block)
    }

    fn pin_limit(&self) -> usize {
        self.capacity
    }

    fn access(&mut self, block: BlockHash, evicted: &mut Vec<BlockHash>) -> Result<Access, Full> {
        if let Some(&i) = self.map.get(&block) {
            if !self.nodes[i].pinned {
                self.order.move_to_back(&mut self.nodes, i);
            }
            return Ok(Access::Hit);
        }
        if self.map.len() >= self.capacity {
            let victim = self.order.pop_front(&mut self.nodes).ok_or(Full)?;
            let gone = self.nodes[victim].block;
            self.map.remove(&gone);
            self.nodes.remove(victim);
            evicted.push(gone);
        }
        let i = self.nodes.insert(Node { block, pinned: false, link: Link::DETACHED });
        self.order.push_back(&mut self.nodes, i);
        self.map.insert(block, i);
        Ok(Access::Admitted)
    }

    fn set_pinned(&mut self, block: BlockHash, pinned: bool) {
        let Some(&i) = self.map.get(&block) else { return };
        if self.nodes[i].pinned == pinned {
            return;
        }
        self.nodes[i].pinned = pinned;
        if pinned {
            self.order.unlink(&mut self.nodes, i);
        } else {
            self.order.push_back(&mut self.nodes, i);
        }
    }

    fn clear(&mut self) {
        self.map.clear();
        self.nodes.clear();
        self.order = List::default();
    }

    fn resident(&self) -> Box<dyn Iterator<Item = BlockHash> + '_> {
        Box::new(self.map.keys().copied())
    }
}
