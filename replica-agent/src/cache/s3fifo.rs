//! S3FIFO (Yang et al., SOSP 2023), exactly as seed 000 specifies it.
//!
//! Parameters: `capacity` (blocks), `small_ratio` (default 0.1), `max_freq` (default 3).
//! - `small_cap = round_half_to_even(capacity * small_ratio)` (so `round(4096 * 0.1) = 410`,
//!   `round(25 * 0.1) = 2`), `main_cap = capacity - small_cap`, `ghost_cap = main_cap`.
//! - Three FIFOs, head = oldest: small (S) and main (M) hold resident blocks with a
//!   saturating `freq` in `[0, max_freq]`; ghost (G) holds hashes only and is **not** resident.
//! - Access `h`: in S or M, `freq = min(freq + 1, max_freq)`; in G, remove it from G and admit
//!   it to M's tail with freq 0; otherwise admit it to S's tail with freq 0.
//! - Admit to S: while `|S| >= small_cap`, pop S's head; `freq >= 1` goes to M keeping its
//!   freq, `freq == 0` goes to G. Then append.
//! - Admit to M: while `|M| >= main_cap`, look at M's head: `freq >= 1` is requeued at the
//!   tail with `freq - 1`; `freq == 0` goes to G and ends the drain (exactly one eviction).
//!   Then append.
//! - Insert into G: drop G's head if `|G| >= ghost_cap`, then append. (A block is never in G
//!   and S/M at once, so seed 000's "already in G" case cannot arise here.)
//! - Resident = S ∪ M, and `len = |S| + |M|`.
//!
//! Structure: one slab node per block in S, M or G, three intrusive FIFOs and one hash map,
//! so a hit is O(1), and an admission is O(1) amortised (each second-chance requeue spends
//! one earlier freq increment).
//!
//! Pinning (no effect without pins):
//! - A pinned block in S stays in place. When it reaches S's head during a drain it is
//!   promoted to M with its freq (a block in use is warm) instead of going to G.
//! - A pinned block in M stays in place, and the drain treats it as the seed does while its
//!   freq is at least 1 (requeued at the tail, freq - 1). Only a pinned block with freq 0 at
//!   M's head is treated otherwise: it cannot be evicted, so it is parked (off M's FIFO,
//!   still counted in `|M|`; hits still count) and rejoins M's tail with its freq on its
//!   last unpin. Parking is at most once a pin, so the drain stays O(1) amortised.
//! - So pins change nothing until a block in use would be a victim: one request at a time,
//!   the engine's path gives seed 000's hits unless one request alone cycles S or M. The only
//!   way to find no victim is an M full of pinned blocks: `pin_limit = main_cap`. An access
//!   that would need such a victim returns [`Full`] before changing anything.

use kvroute_proto::BlockHash;

use super::slab::{BlockMap, Link, Linked, List, Slab, UP_FRONT};
use super::{Access, ConfigError, Full, Policy, S3FifoParams};

/// `round_half_to_even(capacity * small_ratio)`, the small queue's size.
pub fn small_cap(capacity: usize, small_ratio: f64) -> usize {
    (capacity as f64 * small_ratio).round_ties_even() as usize
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
    Ghost,
}

#[derive(Clone, Copy, Debug)]
struct Node {
    block: BlockHash,
    freq: u8,
    queue: Queue,
    pinned: bool,
    /// In M but off M's FIFO: a pinned block that reached the head with freq 0.
    parked: bool,
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

/// S3FIFO eviction: small, main and ghost FIFOs.
#[derive(Debug, Clone)]
pub struct S3Fifo {
    small_cap: usize,
    main_cap: usize,
    ghost_cap: usize,
    max_freq: u8,
    /// Every block in S, M or G.
    map: BlockMap<u32>,
    nodes: Slab<Node>,
    small: List,
    /// M's blocks but the parked ones.
    main: List,
    /// `|M|`, parked blocks included.
    main_len: usize,
    /// How many blocks in M are pinned.
    main_pinned: usize,
    ghost: List,
}

impl S3Fifo {
    /// An empty S3FIFO cache of `capacity` blocks; both S and M must get at least one block.
    pub fn new(capacity: usize, params: S3FifoParams) -> Result<Self, ConfigError> {
        let ratio = params.small_ratio;
        if !(0.0..=1.0).contains(&ratio) {
            return Err(ConfigError::SmallRatio(ratio));
        }
        let small_cap = small_cap(capacity, ratio);
        let main_cap = capacity.saturating_sub(small_cap);
        if small_cap == 0 || main_cap == 0 {
            return Err(ConfigError::EmptyQueue { small_cap, main_cap });
        }
        let ghost_cap = main_cap;
        let mut map = BlockMap::default();
        map.reserve((capacity + ghost_cap).min(UP_FRONT));
        Ok(Self {
            small_cap,
            main_cap,
            ghost_cap,
            max_freq: params.max_freq,
            map,
            nodes: Slab::with_capacity(capacity + ghost_cap),
            small: List::default(),
            main: List::default(),
            main_len: 0,
            main_pinned: 0,
            ghost: List::default(),
        })
    }

    /// `(small_cap, main_cap, ghost_cap)`.
    pub fn caps(&self) -> (usize, usize, usize) {
        (self.small_cap, self.main_cap, self.ghost_cap)
    }

    /// `(|S|, |M|, |G|)`.
    pub fn queue_lens(&self) -> (usize, usize, usize) {
        (self.small.len(), self.main_len, self.ghost.len())
    }

    /// An admission to M would need a victim and every block in M is pinned.
    fn main_blocked(&self) -> bool {
        self.main_len >= self.main_cap && self.main_pinned == self.main_len
    }

    /// Admitting a new block to S would cascade into M and find M blocked.
    fn small_blocked(&self) -> bool {
        if self.small.len() < self.small_cap {
            return false;
        }
        let head = self.small.front().map(|i| self.nodes[i]);
        head.is_some_and(|n| n.freq >= 1 || n.pinned) && self.main_blocked()
    }

    fn admit_small(&mut self, i: u32, evicted: &mut Vec<BlockHash>) {
        while self.small.len() >= self.small_cap {
            let Some(v) = self.small.pop_front(&mut self.nodes) else { break };
            let node = self.nodes[v];
            if node.freq >= 1 || node.pinned {
                self.admit_main(v, node.freq, evicted);
            } else {
                self.evict_to_ghost(v, evicted);
            }
        }
        let node = &mut self.nodes[i];
        node.queue = Queue::Small;
        node.freq = 0;
        self.small.push_back(&mut self.nodes, i);
    }

    fn admit_main(&mut self, i: u32, freq: u8, evicted: &mut Vec<BlockHash>) {
        while self.main_len >= self.main_cap {
            // Callers checked `main_blocked()` first, so an unpinned block exists; it is never
            // parked, and each turn spends a freq or parks a pinned block, so this ends.
            let v = self.main.front().expect("main has an unpinned block");
            if self.nodes[v].freq >= 1 {
                self.nodes[v].freq -= 1;
                self.main.move_to_back(&mut self.nodes, v);
            } else if self.nodes[v].pinned {
                self.main.unlink(&mut self.nodes, v);
                self.nodes[v].parked = true;
            } else {
                self.main.unlink(&mut self.nodes, v);
                self.main_len -= 1;
                self.evict_to_ghost(v, evicted);
                break;
            }
        }
        let node = &mut self.nodes[i];
        node.queue = Queue::Main;
        node.freq = freq;
        self.main_len += 1;
        self.main_pinned += usize::from(node.pinned);
        self.main.push_back(&mut self.nodes, i);
    }

    /// Moves resident node `i`, already off its queue, to G: it leaves residency.
    fn evict_to_ghost(&mut self, i: u32, evicted: &mut Vec<BlockHash>) {
        let block = self.nodes[i].block;
        evicted.push(block);
        if self.ghost_cap == 0 {
            self.map.remove(&block);
            self.nodes.remove(i);
            return;
        }
        if self.ghost.len() >= self.ghost_cap
            && let Some(g) = self.ghost.pop_front(&mut self.nodes)
        {
            self.map.remove(&self.nodes[g].block);
            self.nodes.remove(g);
        }
        let node = &mut self.nodes[i];
        node.queue = Queue::Ghost;
        node.freq = 0;
        self.ghost.push_back(&mut self.nodes, i);
    }
}

impl Policy for S3Fifo {
    fn capacity(&self) -> usize {
        self.small_cap + self.main_cap
    }

    fn len(&self) -> usize {
        self.small.len() + self.main_len
    }

    fn contains(&self, block: BlockHash) -> bool {
        self.map.get(&block).is_some_and(|&i| self.nodes[i].queue != Queue::Ghost)
    }

    fn pin_limit(&self) -> usize {
        self.main_cap
    }

    fn access(&mut self, block: BlockHash, evicted: &mut Vec<BlockHash>) -> Result<Access, Full> {
        match self.map.get(&block) {
            Some(&i) if self.nodes[i].queue != Queue::Ghost => {
                let node = &mut self.nodes[i];
                node.freq = node.freq.saturating_add(1).min(self.max_freq);
                Ok(Access::Hit)
            }
            Some(&i) => {
                if self.main_blocked() {
                    return Err(Full);
                }
                self.ghost.unlink(&mut self.nodes, i);
                self.admit_main(i, 0, evicted);
                Ok(Access::Admitted)
            }
            None => {
                if self.small_blocked() {
                    return Err(Full);
                }
                let i = self.nodes.insert(Node {
                    block,
                    freq: 0,
                    queue: Queue::Small,
                    pinned: false,
                    parked: false,
                    link: Link::DETACHED,
                });
                self.map.insert(block, i);
                self.admit_small(i, evicted);
                Ok(Access::Admitted)
            }
        }
    }

    fn set_pinned(&mut self, block: BlockHash, pinned: bool) {
        let Some(&i) = self.map.get(&block) else { return };
        let node = self.nodes[i];
        if node.pinned == pinned || node.queue == Queue::Ghost {
            return;
        }
        self.nodes[i].pinned = pinned;
        if node.queue == Queue::Main {
            if pinned {
                self.main_pinned += 1;
            } else {
                self.main_pinned -= 1;
                if node.parked {
                    self.nodes[i].parked = false;
                    self.main.push_back(&mut self.nodes, i);
                }
            }
        }
    }

    fn clear(&mut self) {
        self.map.clear();
        self.nodes.clear();
        self.small = List::default();
        self.main = List::default();
        self.main_len = 0;
        self.main_pinned = 0;
        self.ghost = List::default();
    }

    fn resident(&self) -> Box<dyn Iterator<Item = BlockHash> + '_> {
        let nodes = &self.nodes;
        let resident = self.small.iter(nodes).chain(self.main.iter(nodes));
        // Parked M blocks are off M's list, so walk the map for completeness.
        if self.main.len() == self.main_len {
            Box::new(resident.map(move |i| nodes[i].block))
        } else {
            Box::new(self.map.iter().filter(move |&(_, &i)| nodes[i].queue != Queue::Ghost).map(|(&b, _)| b))
        }
    }
}
