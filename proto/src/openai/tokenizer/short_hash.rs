//! XXH3-64 (seed 0, the default secret) of a piece of 4 to 16 bytes, without branching on its
//! length.
//!
//! XXH3 hashes inputs of 1-3, 4-8 and 9-16 bytes three different ways. Words with their
//! space fall on both sides of 8 bytes in no order a CPU can predict (a word of 7 letters,
//! then one of 9), so choosing the way by a branch mispredicts on a good share of pieces: on
//! unseen text of words, hashing took ~4 ns a piece through `xxhash_rust`, against ~1.6 ns
//! when the same text was hashed again and the branches were learned. Here both ways are
//! computed from two eight-byte loads (the piece's surroundings in the text are read when it
//! is shorter than a load) and the right one is kept without a branch. The 1-3 byte way
//! (punctuation, mostly) stays a branch: computing it too costs more multiplies than its
//! mispredictions did on words and code (`proto/benches/tokenizer.rs`). The results are
//! XXH3's to the bit: a property test checks them against `xxhash_rust`.

use std::hint::select_unpredictable;

use xxhash_rust::xxh3::xxh3_64;

/// `readLE64(secret + 8) ^ readLE64(secret + 16)` of XXH3's default secret: the 4-8 byte
/// way's key.
const FLIP_4TO8: u64 = 0x1cad21f72c81017c ^ 0xdb979083e96dd4de;
/// `readLE64(secret + 24) ^ readLE64(secret + 32)`: the 9-16 byte way's first key.
const FLIP_9TO16_LO: u64 = 0x1f67b3b7a4a44072 ^ 0x78e5c0cc4ee679cb;
/// `readLE64(secret + 40) ^ readLE64(secret + 48)`: its second key.
const FLIP_9TO16_HI: u64 = 0x2172ffcc7dd05a82 ^ 0x8e2443f7744608b8;

/// XXH3-64 of `text[start..end]`.
#[inline(always)]
pub(super) fn xxh3_of(text: &[u8], start: usize, end: usize) -> u64 {
    let len = end - start;
    // Other lengths, and pieces at the text's edges (where an eight-byte load would leave
    // the text), go the usual way. The loads: the piece's first eight bytes, and the eight
    // ending with its last byte.
    if !(4..=16).contains(&len) || start + 8 > text.len() || end < 8 {
        return xxh3_64(&text[start..end]);
    }
    let head = u64::from_le_bytes(text[start..start + 8].try_into().expect("8 bytes"));
    let tail = u64::from_le_bytes(text[end - 8..end].try_into().expect("8 bytes"));
    let len64 = len as u64;

    // 4-8 bytes: the first four and the last four.
    let (first4, last4) = (head & 0xffff_ffff, tail >> 32);
    let middle_way = rrmxmx((last4 + (first4 << 32)) ^ FLIP_4TO8, len64);

    // 9-16 bytes: the first eight and the last eight.
    let lo = head ^ FLIP_9TO16_LO;
    let hi = tail ^ FLIP_9TO16_HI;
    let product = u128::from(lo) * u128::from(hi);
    let acc = len64
        .wrapping_add(lo.swap_bytes())
        .wrapping_add(hi)
        .wrapping_add(product as u64 ^ (product >> 64) as u64);
    let long = xxh3_avalanche(acc);

    select_unpredictable(len > 8, long, middle_way)
}

/// XXH3's final mix of the 9-16 byte way.
#[inline(always)]
fn xxh3_avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x165667919E3779F9);
    h ^ (h >> 32)
}

/// XXH3's final mix of the 4-8 byte way.
#[inline(always)]
fn rrmxmx(mut h: u64, len: u64) -> u64 {
    h ^= h.rotate_left(49) ^ h.rotate_left(24);
    h = h.wrapping_mul(0x9FB21C651E98DF25);
    h ^= (h >> 35).wrapping_add(len);
    h = h.wrapping_mul(0x9FB21C651E98DF25);
    h ^ (h >> 28)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Every piece of every length at every place in a text, edges included.
        #[test]
        fn agrees_with_xxhash_rust(text in prop::collection::vec(any::<u8>(), 1..48), cuts in prop::collection::vec((any::<usize>(), 1..20usize), 1..16)) {
            for (at, len) in cuts {
                let start = at % text.len();
                let end = (start + len).min(text.len());
                prop_assert_eq!(xxh3_of(&text, start, end), xxh3_64(&text[start..end]), "{}..{} of {}", start, end, text.len());
            }
        }
    }

    #[test]
    fn every_length_in_a_long_text() {
        let text: Vec<u8> = (0..64u8).map(|b| b.wrapping_mul(37) ^ 0x5a).collect();
        for start in 0..48 {
            for end in start + 1..=(start + 17).min(64) {
                assert_eq!(xxh3_of(&text, start, end), xxh3_64(&text[start..end]), "{start}..{end}");
            }
        }
    }
}
