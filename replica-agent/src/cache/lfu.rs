//! LFU: on a miss with the cache full, evict the unpinned block with the fewest accesses,
//! ties broken by least recent use.
//!
//! Parameters: `capacity` (blocks). A block's frequency is its number of accesses since it
//! was last admitted (admission counts as the first); eviction forgets it.
//!
//! Structure (the O(1) LFU of Shah, Mitra and Matani, 2010): one node per resident block, and
//! a *frequency class* per distinct frequency holding its unpinned members in least-recent-
//! first order. Classes sit on a list in ascending frequency. A hit moves its node to the
//! class `f + 1`, which is the next class or a new one inserted right after, so no search is
//! ever needed; a victim is the head of the lowest class. Entering a class only ever happens
//! on an access (or an unpin), so the order inside a class is recency order.
//!
//! Pinning: a pinned block leaves its class's list but is still counted by the class, which
//! therefore stays on the class list; hits on it still raise its frequency (moving that count
//! to the next class). On its last unpin it rejoins its class at the most-recent end. A miss
//! finds no victim only when all `capacity` resident blocks are pinned, so
//! `pin_limit = capacity`. With no pins this is plain LFU; with pins, finding a victim also
//! skips the lowest classes whose members are all pinned.

use kvroute_proto::BlockHash;

use super::slab::{BlockMap, Link, Linked, List, NIL, Slab, UP_FRONT};
use super::{Access, Full, Policy};

#[derive(Clone, Copy, Debug)]
struct Node {
    block: BlockHash,
    freq: u64,
    /// The frequency class this node belongs to.
    class: u32,
    pinned: bool,
    link: Link,
}

#[derive(Clone, Copy, Debug)]
struct Class {
    freq: u64,
    /// Unpinned members, least recently used first.
    members: List,
    /// Pinned members, which keep the class alive but are not on `members`.
    pinned: u32,
    link: Link,
}

impl Class {
    fn is_empty(&self) -> bool {
        self.members.is_empty() && self.pinned == 0
    }
}

impl Linked for Node {
    fn link(&self) -> Link {
        self.link
    }
    fn link_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

impl Linked for Class {
    fn link(&self) -> Link {
        self.link
    }
    fn link_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

/// Least-frequently-used eviction with LRU tie-breaking.
#[derive(Debug, Clone)]
pub struct Lfu {
    capacity: usize,
    map: BlockMap<u32>,
    nodes: Slab<Node>,
    classes: Slab<Class>,
    /// Non-empty classes by ascending frequency.
    order: List,
}

impl Lfu {
    /// An empty LFU cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        let mut map = BlockMap::default();
        map.reserve(capacity.min(UP_FRONT));
        Self {
            capacity,
            map,
            nodes: Slab::with_capacity(capacity),
            classes: Slab::with_capacity(64),
            order: List::default(),
        }
    }

    fn new_class(&mut self, freq: u64) -> u32 {
        self.classes.insert(Class { freq, members: List::default(), pinned: 0, link: Link::DETACHED })
    }

    /// Frees class `c` if nothing belongs to it any more.
    fn drop_if_empty(&mut self, c: u32) {
        if self.classes[c].is_empty() {
            self.order.unlink(&mut self.classes, c);
            self.classes.remove(c);
        }
    }

    /// Adds node `i` to class `c`: on its list if unpinned, else to its pinned count.
    fn join(&mut self, i: u32, c: u32) {
        self.nodes[i].class = c;
        if self.nodes[i].pinned {
            self.classes[c].pinned += 1;
        } else {
            self.classes[c].members.push_back(&mut self.nodes, i);
        }
    }

    fn leave(&mut self, i: u32) {
        let c = self.nodes[i].class;
        if self.nodes[i].pinned {
            self.classes[c].pinned -= 1;
        } else {
            self.classes[c].members.unlink(&mut self.nodes, i);
        }
    }

    /// The head of the lowest class with an unpinned member.
    fn victim(&self) -> Option<(u32, u32)> {
        let mut c = self.order.front()?;
        loop {
            if let Some(i) = self.classes[c].members.front() {
                return Some((c, i));
            }
            c = List::next(&self.classes, c)?;
        }
    }
}

impl Policy for Lfu {
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
            let (c, freq) = (self.nodes[i].class, self.nodes[i].freq);
            let next_freq = freq.saturating_add(1);
            let target = match List::next(&self.classes, c) {
                Some(n) if self.classes[n].freq == next_freq => n,
                _ => {
                    let n = self.new_class(next_freq);
                    self.order.insert_after(&mut self.classes, c, n);
                    n
                }
            };
            self.leave(i);
            self.nodes[i].freq = next_freq;
            self.join(i, target);
            self.drop_if_empty(c);
            return Ok(Access::Hit);
        }
        if self.map.len() >= self.capacity {
            let (c, victim) = self.victim().ok_or(Full)?;
            self.classes[c].members.unlink(&mut self.nodes, victim);
            self.drop_if_empty(c);
            let gone = self.nodes[victim].block;
            self.map.remove(&gone);
            self.nodes.remove(victim);
            evicted.push(gone);
        }
        let first = match self.order.front() {
            Some(c) if self.classes[c].freq == 1 => c,
            _ => {
                let c = self.new_class(1);
                self.order.push_front(&mut self.classes, c);
                c
            }
        };
        let i = self.nodes.insert(Node { block, freq: 1, class: NIL, pinned: false, link: Link::DETACHED });
        self.join(i, first);
        self.map.insert(block, i);
        Ok(Access::Admitted)
    }

    fn set_pinned(&mut self, block: BlockHash, pinned: bool) {
        let Some(&i) = self.map.get(&block) else { return };
        if self.nodes[i].pinned == pinned {
            return;
        }
        // The class survives this: the node moves between its list and its pinned count.
        self.leave(i);
        self.nodes[i].pinned = pinned;
        let c = self.nodes[i].class;
        self.join(i, c);
    }

    fn clear(&mut self) {
        self.map.clear();
        self.nodes.clear();
        self.classes.clear();
        self.order = List::default();
    }

    fn resident(&self) -> Box<dyn Iterator<Item = BlockHash> + '_> {
        Box::new(self.map.keys().copied())
    }
}
