//! The common token-id prompt, `[1, 22, 333]`, read straight from the body's bytes.
//!
//! A flat array of plain integer literals is by far the most frequent `prompt` that is not
//! text, and it is large (8 k ids are about 50 KB). [`plain_token_ids`] validates and
//! converts it in one pass, eight bytes at a time: a SWAR range test finds where each number
//! ends and a SWAR multiply turns up to eight digits into their value, so the only branches
//! are per id, not per digit. Whatever it does not take (signs, fractions, exponents, leading
//! zeros, ids beyond `u32`, other elements, nesting) is `None` and goes through serde, which
//! gives the same answer for everything this accepts.

/// A flat JSON array of plain integer literals at the start of `json` (its first byte is
/// `[`), each a valid token id: the ids and the array's length in bytes.
pub(super) fn plain_token_ids(json: &[u8]) -> Option<(Vec<u32>, usize)> {
    if json.first() != Some(&b'[') {
        return None;
    }
    // A flat array ends at its first `]`; a nested one fails below on its `[`.
    let close = memchr::memchr(b']', json)?;
    // Every id takes at least two bytes of the array (a digit and a separator), so this
    // bounds the count by bytes already in memory, without a counting pass.
    let mut ids = Vec::with_capacity(close / 2 + 1);
    let mut i = skip_space(json, 1);
    loop {
        let (id, len) = number_at(json, i)?;
        ids.push(id);
        i = skip_space(json, i + len);
        match json.get(i) {
            Some(b']') => return Some((ids, i + 1)),
            Some(b',') => i = skip_space(json, i + 1),
            _ => return None,
        }
    }
}

/// JSON whitespace from `i` on.
#[inline(always)]
pub(super) fn skip_space(bytes: &[u8], mut i: usize) -> usize {
    while bytes.get(i).is_some_and(|&b| matches!(b, b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

const ONES: u64 = u64::MAX / 255;
const HIGH: u64 = ONES * 0x80;

/// The plain integer literal at `i` as a token id, and its length: digits only, no leading
/// zero, at most `u32::MAX`.
#[inline(always)]
fn number_at(bytes: &[u8], i: usize) -> Option<(u32, usize)> {
    let (value, len) = match bytes.get(i..i + 8) {
        Some(word) => {
            let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            let not_digit = !digits(word) & HIGH;
            if not_digit == 0 {
                return long_number_at(bytes, i);
            }
            let len = (not_digit.trailing_zeros() / 8) as usize;
            if len == 0 {
                return None;
            }
            (swar_value(word, len), len)
        }
        None => return long_number_at(bytes, i),
    };
    (len == 1 || bytes[i] != b'0').then_some((value as u32, len))
}

/// For each byte of `word`, its top bit set when the byte is an ASCII digit (a SWAR range
/// test that never carries from one byte into the next).
#[inline(always)]
fn digits(word: u64) -> u64 {
    let low7 = word & (ONES * 0x7f);
    let below_colon = ONES * (0x7f + u64::from(b':')) - low7;
    let above_slash = low7 + ONES * (0x7f - u64::from(b'/'));
    below_colon & !word & above_slash & HIGH
}

/// The value of the first `len` (1 to 7) bytes of `word`, all ASCII digits, the first one
/// the most significant: the digits are moved to the top bytes (zeros below act as leading
/// zeros), then pairs, quads and octets are combined by multiplication.
#[inline(always)]
fn swar_value(word: u64, len: usize) -> u64 {
    let mut v = (word << (8 * (8 - len))) & (ONES * 0x0f);
    v = (v.wrapping_mul(10 << 8 | 1) >> 8) & 0x00ff_00ff_00ff_00ff;
    v = (v.wrapping_mul(100 << 16 | 1) >> 16) & 0x0000_ffff_0000_ffff;
    v.wrapping_mul(10_000 << 32 | 1) >> 32
}

/// [`number_at`] a digit at a time: numbers of 8 digits or more, and the last few bytes.
#[cold]
fn long_number_at(bytes: &[u8], i: usize) -> Option<(u32, usize)> {
    let mut value = 0u64;
    let mut len = 0;
    while let Some(&b) = bytes.get(i + len).filter(|b| b.is_ascii_digit()) {
        // 10 digits still fit in u64; an 11th means the id is out of range.
        if len == 10 {
            return None;
        }
        value = value * 10 + u64::from(b - b'0');
        len += 1;
    }
    if len == 0 || (len > 1 && bytes[i] == b'0') {
        return None;
    }
    Some((u32::try_from(value).ok()?, len))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::plain_token_ids;

    fn ids(json: &str) -> Option<Vec<u32>> {
        plain_token_ids(json.as_bytes()).filter(|&(_, len)| len == json.len()).map(|(ids, _)| ids)
    }

    #[test]
    fn plain_arrays_and_what_is_left_to_serde() {
        assert_eq!(ids("[0]"), Some(vec![0]));
        assert_eq!(
            ids("[ 7 ,\n 1234567 ,\t12345678, 4294967295 ]"),
            Some(vec![7, 1234567, 12345678, u32::MAX])
        );
        assert_eq!(ids("[1,2,3] trailing"), None);
        assert_eq!(plain_token_ids(b"[1,2,3], \"x\": 1}").map(|(_, len)| len), Some(7));
        for refused in [
            "[]",
            "[,]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[01]",
            "[00]",
            "[-1]",
            "[1.5]",
            "[1e3]",
            "[4294967296]",
            "[12345678901]",
            "[[1]]",
            "[1,[2]]",
            "[\"1\"]",
            "[null]",
            "1",
            "[1",
            "[1,2,\u{661}]",
        ] {
            assert_eq!(ids(refused), None, "{refused}");
        }
    }

    proptest! {
        #[test]
        fn id_lists_round_trip(
            ids_ in prop::collection::vec(prop_oneof![0u32..100, 0u32..100_000, any::<u32>()], 1..64),
            big in prop::option::of((u64::from(u32::MAX) + 1..u64::MAX, any::<prop::sample::Index>())),
        ) {
            let json = serde_json::to_string(&ids_).unwrap();
            prop_assert_eq!(ids(&json), Some(ids_.clone()));
            let spaced = serde_json::to_string_pretty(&ids_).unwrap();
            prop_assert_eq!(ids(&spaced), Some(ids_.clone()));
            if let Some((big, at)) = big {
                let mut wide: Vec<u64> = ids_.iter().map(|&id| u64::from(id)).collect();
                wide.insert(at.index(wide.len() + 1), big);
                prop_assert_eq!(ids(&serde_json::to_string(&wide).unwrap()), None);
            }
        }

        /// Whatever it accepts, serde reads as the same ids.
        #[test]
        fn accepts_only_what_serde_reads_the_same(json in "\\[[0-9 ,\\-.e\\]]{0,24}") {
            if let Some(got) = ids(&json) {
                prop_assert_eq!(serde_json::from_str::<Vec<u32>>(&json).ok(), Some(got), "{}", json);
            }
        }
    }
}
