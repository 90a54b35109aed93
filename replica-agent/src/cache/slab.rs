//! Storage shared by the eviction policies: a slab of nodes addressed by `u32` index,
//! doubly-linked intrusive lists threaded through it, and a `HashMap` keyed by [`BlockHash`]
//! with a one-multiply hasher.
//!
//! Every list operation (push at either end, insert after a node, unlink, move to the back)
//! is O(1), which is what keeps each policy O(1) per access. Indices of freed slots are reused
//! through a free list, so a cache at steady state does not allocate.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::{Index, IndexMut};

use kvroute_proto::BlockHash;

/// A `HashMap` from block hash to `V`, hashed with [`BlockHasher`].
pub type BlockMap<V> = HashMap<BlockHash, V, BuildHasherDefault<BlockHasher>>;

/// A hasher for keys that are already well-mixed 64-bit hashes, or small integers (trace ids).
///
/// One folded 64x64->128 multiply spreads every input bit over the whole output, so small
/// sequential ids still fill the control bytes hashbrown reads from the top bits. Not
/// collision-resistant against adversarial keys; block hashes are not attacker-chosen here
/// because they already come from xxh3 over token ids.
#[derive(Clone, Copy, Default, Debug)]
pub struct BlockHasher(u64);

impl BlockHasher {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;

    #[inline]
    fn mix(&mut self, x: u64) {
        let product = u128::from(self.0 ^ x) * u128::from(Self::K);
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }
}

impl Hasher for BlockHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than `BlockHash`; correct, not tuned.
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(buf));
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// The "no node" index.
pub(super) const NIL: u32 = u32::MAX;

/// A node's neighbours in whichever list currently holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Link {
    prev: u32,
    next: u32,
}

impl Link {
    /// The links of a node that is in no list.
    pub(super) const DETACHED: Link = Link { prev: NIL, next: NIL };
}

/// A slab item that can sit in one [`List`] at a time.
pub(super) trait Linked {
    fn link(&self) -> Link;
    fn link_mut(&mut self) -> &mut Link;
}

/// A vector of nodes with a free list; indices stay valid until the node is removed.
#[derive(Debug, Clone)]
pub(super) struct Slab<T> {
    items: Vec<T>,
    free: Vec<u32>,
}

/// Most room for blocks a cache reserves up front (its map and slab): a larger cache grows
/// as it fills. Without a bound, a huge capacity took its memory at start, or failed there.
pub(super) const UP_FRONT: usize = 1 << 20;

impl<T> Slab<T> {
    /// A slab with room for `n` items, at most [`UP_FRONT`] of them reserved now.
    pub(super) fn with_capacity(n: usize) -> Self {
        Self { items: Vec::with_capacity(n.min(UP_FRONT)), free: Vec::new() }
    }

    /// Stores `item` in a free slot and returns its index.
    pub(super) fn insert(&mut self, item: T) -> u32 {
        if let Some(i) = self.free.pop() {
            self.items[i as usize] = item;
            i
        } else {
            let i = u32::try_from(self.items.len()).expect("slab index fits in u32");
            assert!(i != NIL, "slab full");
            self.items.push(item);
            i
        }
    }

    /// Frees slot `i`; the caller must already have unlinked it and dropped its map entry.
    pub(super) fn remove(&mut self, i: u32) {
        self.free.push(i);
    }

    pub(super) fn clear(&mut self) {
        self.items.clear();
        self.free.clear();
    }
}

impl<T> Index<u32> for Slab<T> {
    type Output = T;
    #[inline]
    fn index(&self, i: u32) -> &T {
        &self.items[i as usize]
    }
}

impl<T> IndexMut<u32> for Slab<T> {
    #[inline]
    fn index_mut(&mut self, i: u32) -> &mut T {
        &mut self.items[i as usize]
    }
}

/// A doubly-linked list of slab indices, head = oldest, tail = newest.
#[derive(Clone, Copy, Debug)]
pub(super) struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for List {
    fn default() -> Self {
        Self { head: NIL, tail: NIL, len: 0 }
    }
}

impl List {
    #[inline]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    pub(super) fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// The node after `i`, if `i` is in this list and not its tail.
    #[inline]
    pub(super) fn next<T: Linked>(slab: &Slab<T>, i: u32) -> Option<u32> {
        let next = slab[i].link().next;
        (next != NIL).then_some(next)
    }

    pub(super) fn push_back<T: Linked>(&mut self, slab: &mut Slab<T>, i: u32) {
        *slab[i].link_mut() = Link { prev: self.tail, next: NIL };
        if self.tail == NIL {
            self.head = i;
        } else {
            slab[self.tail].link_mut().next = i;
        }
        self.tail = i;
        self.len += 1;
    }

    pub(super) fn push_front<T: Linked>(&mut self, slab: &mut Slab<T>, i: u32) {
        *slab[i].link_mut() = Link { prev: NIL, next: self.head };
        if self.head == NIL {
            self.tail = i;
        } else {
            slab[self.head].link_mut().prev = i;
        }
        self.head = i;
        self.len += 1;
    }

    /// Inserts `i` right after `after`, which must be in this list.
    pub(super) fn insert_after<T: Linked>(&mut self, slab: &mut Slab<T>, after: u32, i: u32) {
        let next = slab[after].link().next;
        *slab[i].link_mut() = Link { prev: after, next };
        slab[after].link_mut().next = i;
        if next == NIL {
            self.tail = i;
        } else {
            slab[next].link_mut().prev = i;
        }
        self.len += 1;
    }

    /// Removes `i`, which must be in this list.
    pub(super) fn unlink<T: Linked>(&mut self, slab: &mut Slab<T>, i: u32) {
        let Link { prev, next } = slab[i].link();
        if prev == NIL {
            self.head = next;
        } else {
            slab[prev].link_mut().next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            slab[next].link_mut().prev = prev;
        }
        *slab[i].link_mut() = Link::DETACHED;
        self.len -= 1;
    }

    pub(super) fn pop_front<T: Linked>(&mut self, slab: &mut Slab<T>) -> Option<u32> {
        let i = self.front()?;
        self.unlink(slab, i);
        Some(i)
    }

    /// Moves `i`, which must be in this list, to the tail.
    pub(super) fn move_to_back<T: Linked>(&mut self, slab: &mut Slab<T>, i: u32) {
        if self.tail != i {
            self.unlink(slab, i);
            self.push_back(slab, i);
        }
    }

    /// The indices from head to tail.
    pub(super) fn iter<'a, T: Linked>(&self, slab: &'a Slab<T>) -> impl Iterator<Item = u32> + 'a {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let i = cur;
                cur = slab[i].link().next;
                i
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy)]
    struct N(Link);
    impl Linked for N {
        fn link(&self) -> Link {
            self.0
        }
        fn link_mut(&mut self) -> &mut Link {
            &mut self.0
        }
    }

    #[test]
    fn list_operations_keep_order() {
        let mut slab = Slab::with_capacity(4);
        let ids: Vec<u32> = (0..4).map(|_| slab.insert(N(Link::DETACHED))).collect();
        let mut list = List::default();
        list.push_back(&mut slab, ids[1]);
        list.push_front(&mut slab, ids[0]);
        list.insert_after(&mut slab, ids[1], ids[3]);
        list.insert_after(&mut slab, ids[1], ids[2]);
        assert_eq!(list.iter(&slab).collect::<Vec<_>>(), [0, 1, 2, 3]);
        list.move_to_back(&mut slab, ids[0]);
        list.unlink(&mut slab, ids[2]);
        assert_eq!(list.iter(&slab).collect::<Vec<_>>(), [1, 3, 0]);
        assert_eq!(list.pop_front(&mut slab), Some(1));
        assert_eq!(List::next(&slab, 3), Some(0));
        assert_eq!(list.len(), 2);
        slab.remove(ids[1]);
        assert_eq!(slab.insert(N(Link::DETACHED)), 1);
    }

    #[test]
    fn hasher_spreads_small_ids_into_top_bits() {
        use std::hash::BuildHasher;
        let build = BuildHasherDefault::<BlockHasher>::default();
        let tops: std::collections::HashSet<u64> =
            (0..64u64).map(|i| build.hash_one(BlockHash(i)) >> 57).collect();
        assert!(tops.len() > 32, "top-7-bit tags poorly spread: {}", tops.len());
    }
}
