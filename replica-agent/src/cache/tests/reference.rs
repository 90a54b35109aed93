//! Plain reference models of the three policies and of `BlockCache`'s pin rules: vectors and
//! linear scans, written to be obviously correct rather than fast.

use std::collections::{HashMap, HashSet, VecDeque};

use kvroute_proto::BlockHash;

use crate::cache::{AdmitError, CacheEvent, RequestOutcome, S3FifoParams, small_cap};

/// What a reference policy needs to know about pins.
pub type Pinned<'a> = &'a dyn Fn(BlockHash) -> bool;

pub trait RefPolicy {
    fn contains(&self, b: BlockHash) -> bool;
    fn pin_limit(&self) -> usize;
    /// Returns the evicted blocks; panics if no victim exists (the caller's check forbids it).
    fn access(&mut self, b: BlockHash, pinned: Pinned<'_>) -> Vec<BlockHash>;
    fn unpinned(&mut self, b: BlockHash);
    fn resident(&self) -> Vec<BlockHash>;
}

/// Victim: the least recently used unpinned block; an unpin counts as a use.
pub struct RefLru {
    pub cap: usize,
    /// Least recent first.
    pub order: Vec<BlockHash>,
}

impl RefPolicy for RefLru {
    fn contains(&self, b: BlockHash) -> bool {
        self.order.contains(&b)
    }
    fn pin_limit(&self) -> usize {
        self.cap
    }
    fn access(&mut self, b: BlockHash, pinned: Pinned<'_>) -> Vec<BlockHash> {
        let mut evicted = vec![];
        if let Some(pos) = self.order.iter().position(|&x| x == b) {
            self.order.remove(pos);
        } else if self.order.len() == self.cap {
            let pos = self.order.iter().position(|&x| !pinned(x)).expect("a victim");
            evicted.push(self.order.remove(pos));
        }
        self.order.push(b);
        evicted
    }
    fn unpinned(&mut self, b: BlockHash) {
        let pos = self.order.iter().position(|&x| x == b).unwrap();
        self.order.remove(pos);
        self.order.push(b);
    }
    fn resident(&self) -> Vec<BlockHash> {
        self.order.clone()
    }
}

/// Victim: the unpinned block with the smallest (freq, last use); an unpin counts as a use.
pub struct RefLfu {
    pub cap: usize,
    pub tick: u64,
    /// (block, freq, last use)
    pub entries: Vec<(BlockHash, u64, u64)>,
}

impl RefPolicy for RefLfu {
    fn contains(&self, b: BlockHash) -> bool {
        self.entries.iter().any(|e| e.0 == b)
    }
    fn pin_limit(&self) -> usize {
        self.cap
    }
    fn access(&mut self, b: BlockHash, pinned: Pinned<'_>) -> Vec<BlockHash> {
        self.tick += 1;
        let mut evicted = vec![];
        if let Some(e) = self.entries.iter_mut().find(|e| e.0 == b) {
            e.1 += 1;
            e.2 = self.tick;
            return evicted;
        }
        if self.entries.len() == self.cap {
            let pos = (0..self.entries.len())
                .filter(|&i| !pinned(self.entries[i].0))
                .min_by_key(|&i| (self.entries[i].1, self.entries[i].2))
                .expect("a victim");
            evicted.push(self.entries.remove(pos).0);
        }
        self.entries.push((b, 1, self.tick));
        evicted
    }
    fn unpinned(&mut self, b: BlockHash) {
        self.tick += 1;
        self.entries.iter_mut().find(|e| e.0 == b).unwrap().2 = self.tick;
    }
    fn resident(&self) -> Vec<BlockHash> {
        self.entries.iter().map(|e| e.0).collect()
    }
}

/// Seed 000's pseudocode, line by line, plus the pin rules: a pinned small head is promoted
/// rather than ghosted; a pinned main head with freq 0 is parked (resident, off the FIFO)
/// rather than ghosted, and rejoins main's tail with its freq when unpinned.
pub struct RefS3Fifo {
    pub small_cap: usize,
    pub main_cap: usize,
    pub ghost_cap: usize,
    pub max_freq: u8,
    pub small: VecDeque<(BlockHash, u8)>,
    pub main: VecDeque<(BlockHash, u8)>,
    pub parked: Vec<(BlockHash, u8)>,
    pub ghost: VecDeque<BlockHash>,
}

impl RefS3Fifo {
    pub fn new(capacity: usize, p: S3FifoParams) -> Self {
        let small_cap = small_cap(capacity, p.small_ratio);
        let main_cap = capacity - small_cap;
        Self {
            small_cap,
            main_cap,
            ghost_cap: main_cap,
            max_freq: p.max_freq,
            small: VecDeque::new(),
            main: VecDeque::new(),
            parked: Vec::new(),
            ghost: VecDeque::new(),
        }
    }

    fn insert_ghost(&mut self, h: BlockHash) {
        if let Some(pos) = self.ghost.iter().position(|&g| g == h) {
            self.ghost.remove(pos);
        } else if self.ghost.len() >= self.ghost_cap {
            self.ghost.pop_front();
        }
        self.ghost.push_back(h);
    }

    fn admit_main(&mut self, h: BlockHash, f: u8, pinned: Pinned<'_>, ev: &mut Vec<BlockHash>) {
        while self.main.len() + self.parked.len() >= self.main_cap {
            let (v, vf) = self.main.pop_front().expect("a victim");
            if vf >= 1 {
                self.main.push_back((v, vf - 1));
            } else if pinned(v) {
                self.parked.push((v, 0));
            } else {
                self.insert_ghost(v);
                ev.push(v);
                break;
            }
        }
        self.main.push_back((h, f));
    }

    fn admit_small(&mut self, h: BlockHash, pinned: Pinned<'_>, ev: &mut Vec<BlockHash>) {
        while self.small.len() >= self.small_cap {
            let (v, vf) = self.small.pop_front().unwrap();
            if vf >= 1 || pinned(v) {
                self.admit_main(v, vf, pinned, ev);
            } else {
                self.insert_ghost(v);
                ev.push(v);
            }
        }
        self.small.push_back((h, 0));
    }
}

impl RefPolicy for RefS3Fifo {
    fn contains(&self, b: BlockHash) -> bool {
        self.small.iter().chain(&self.main).any(|e| e.0 == b) || self.parked.iter().any(|e| e.0 == b)
    }
    fn pin_limit(&self) -> usize {
        self.main_cap
    }
    fn access(&mut self, h: BlockHash, pinned: Pinned<'_>) -> Vec<BlockHash> {
        let mut ev = vec![];
        let max = self.max_freq;
        if let Some(e) =
            self.small.iter_mut().chain(&mut self.main).chain(&mut self.parked).find(|e| e.0 == h)
        {
            e.1 = (e.1 + 1).min(max);
        } else if let Some(pos) = self.ghost.iter().position(|&g| g == h) {
            self.ghost.remove(pos);
            self.admit_main(h, 0, pinned, &mut ev);
        } else {
            self.admit_small(h, pinned, &mut ev);
        }
        ev
    }
    fn unpinned(&mut self, b: BlockHash) {
        if let Some(pos) = self.parked.iter().position(|e| e.0 == b) {
            let e = self.parked.remove(pos);
            self.main.push_back(e);
        }
    }
    fn resident(&self) -> Vec<BlockHash> {
        self.small.iter().chain(&self.main).chain(&self.parked).map(|e| e.0).collect()
    }
}

/// `BlockCache`'s contract over a reference policy: the literal prefix scan, then each
/// access in order, pins and the admission rules.
pub struct RefCache {
    pub policy: Box<dyn RefPolicy>,
    pub block_size: usize,
    pub pins: HashMap<BlockHash, u32>,
}

impl RefCache {
    pub fn run(
        &mut self,
        blocks: &[BlockHash],
        prompt_len: usize,
        pin: bool,
        events: &mut Vec<CacheEvent>,
    ) -> Result<RequestOutcome, AdmitError> {
        let limit = self.policy.pin_limit();
        let all_resident = blocks.iter().all(|&b| self.policy.contains(b));
        if pin {
            let distinct: HashSet<BlockHash> = blocks.iter().copied().collect();
            let others = self.pins.keys().filter(|b| !distinct.contains(b)).count();
            if !all_resident && others + distinct.len() > limit {
                return Err(if distinct.len() > limit {
                    AdmitError::TooLarge { needed: distinct.len(), limit }
                } else {
                    AdmitError::MustWait { needed: distinct.len(), pinned_by_others: others, limit }
                });
            }
        } else if !all_resident && self.pins.len() >= limit {
            return Err(AdmitError::MustWait { needed: 0, pinned_by_others: self.pins.len(), limit });
        }
        let k = blocks.iter().take_while(|&&b| self.policy.contains(b)).count();
        for (pos, &b) in blocks.iter().enumerate() {
            let was_resident = self.policy.contains(b);
            let pins = &self.pins;
            let evicted = self.policy.access(b, &|x| pins.contains_key(&x));
            events.extend(evicted.into_iter().map(CacheEvent::Removed));
            if !was_resident {
                let parent = pos.checked_sub(1).map(|p| blocks[p]);
                events.push(CacheEvent::Stored { block: b, parent });
            }
            if pin {
                *self.pins.entry(b).or_insert(0) += 1;
            }
        }
        Ok(RequestOutcome { hit_blocks: k, hit_tokens: (k * self.block_size).min(prompt_len) })
    }

    pub fn finish(&mut self, blocks: &[BlockHash]) {
        for &b in blocks.iter().rev() {
            let c = self.pins.get_mut(&b).unwrap();
            *c -= 1;
            if *c == 0 {
                self.pins.remove(&b);
                self.policy.unpinned(b);
            }
        }
    }
}
