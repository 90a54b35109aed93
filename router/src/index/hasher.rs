//! The index's hash function: one folded multiply per word instead of SipHash.
//!
//! Block hashes are already uniformly distributed xxh3 outputs, so the table only needs the
//! bits spread over the whole word (hashbrown takes the bucket from the low bits and a tag
//! from the top seven). A folded 64×64→128-bit multiply does that in a few cycles. A per-index
//! random seed keeps the bucket layout different in every process. The upstream pool keys its
//! idle connections by replica address with it too: those keys come from the configuration,
//! not from clients, and SipHash a byte at a time showed in the proxy's profiles.

use std::hash::{BuildHasher, Hasher, RandomState};

/// An odd 64-bit constant with well-mixed bits (2^64 / golden ratio).
const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// Builds [`FoldHasher`]s sharing one random seed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FoldState {
    seed: u64,
}

impl FoldState {
    /// A state with a fresh random seed.
    pub(crate) fn random() -> Self {
        Self { seed: RandomState::new().hash_one(0x006b_7672_6f75_7465_u64) }
    }
}

impl BuildHasher for FoldState {
    type Hasher = FoldHasher;

    fn build_hasher(&self) -> FoldHasher {
        FoldHasher { state: self.seed }
    }
}

/// Folds each written word into the state with one wide multiply.
pub(crate) struct FoldHasher {
    state: u64,
}

fn fold_mul(a: u64, b: u64) -> u64 {
    let wide = u128::from(a) * u128::from(b);
    (wide as u64) ^ ((wide >> 64) as u64)
}

impl Hasher for FoldHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.state = fold_mul(self.state ^ x, K);
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    // A fold each, not a padded copy: `http`'s `Authority` (the upstream pool's key) hashes
    // its length and then each byte, lowercased, on its own.
    fn write_u8(&mut self, x: u8) {
        self.write_u64(u64::from(x));
    }

    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    fn finish(&self) -> u64 {
        self.state
    }
}
