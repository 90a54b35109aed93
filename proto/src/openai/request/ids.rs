//! The common token-id prompt, `[1, 22, 333]`, read straight from the body's bytes.
//!
//! A flat array of plain integer literals is by far the most frequent `prompt` that is not
//! text, and it is large (8 k ids are about 50 KB). [`plain_token_ids`] validates and
//! converts it without a branch per digit: a SWAR multiply turns up to eight digits into
//! their value. A compact array (no whitespace, what most clients send) is classified 64
//! bytes at a time (SSE2 on x86-64, SWAR range tests elsewhere) and its commas bound the
//! numbers, so no number waits for the one before it to be read; what makes a number
//! unacceptable (an empty element, a leading zero, nine digits or more) is found with bit
//! masks once a block, not once a number (8 k ids: about 22 µs, against 31 µs a number at a
//! time). Each number is read from the eight bytes that end with it, out of a 72-byte window
//! of its block fetched once, so the digits land in the top bytes without a variable shift
//! and the read needs no bounds check (23.1 -> 20.5 µs, same spell, 32 prompts in turn). The
//! values are found four numbers at a time with SSE2 multiply-adds instead of three 64-bit
//! multiplies each (8 k ids: 20.0 -> 15.2 µs, same spell, 32 prompts in turn). Whatever it
//! does not take (signs, fractions, exponents, leading zeros, ids beyond `u32`, other
//! elements, nesting) is `None` and goes through serde, which gives the same answer for
//! everything this accepts.

/// A flat JSON array of plain integer literals at the start of `json` (its first byte is
/// `[`), each a valid token id: the ids and the array's length in bytes.
///
/// Compact arrays (`[1,22,333]`, digits and commas only) take [`compact_ids`]; others (with
/// whitespace) are read a number at a time.
pub(super) fn plain_token_ids(json: &[u8]) -> Option<(Vec<u32>, usize)> {
    if json.first() != Some(&b'[') {
        return None;
    }
    // A flat array ends at its first `]`; a nested one fails below on its `[`.
    let close = memchr::memchr(b']', json)?;
    // The real element count (the bytes are in memory already), not a size hint.
    let count = memchr::memchr_iter(b',', &json[..close]).count() + 1;
    if let Some(ids) = compact_ids(&json[1..close], count) {
        return Some((ids, close + 1));
    }
    let mut ids = Vec::with_capacity(count);
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

/// The `count` ids of `inner` (an array's bytes between its brackets) when it holds only
/// digits and commas, and every number is 1 to 8 digits without a leading zero (longer ones
/// are left to [`number_at`]). Each 64-byte block is classified and checked first (commas,
/// empty elements, leading zeros, nine digits in a row); then the commas bound every number,
/// and each is taken from the eight bytes that end with it, its value found four numbers at a
/// time ([`values4`]).
fn compact_ids(inner: &[u8], count: usize) -> Option<Vec<u32>> {
    // Written in place, a batch of four at a time: cheaper than pushing, and `count` is
    // exact; the three spare slots take a last batch's unused lanes.
    let mut ids = vec![0u32; count + 3];
    let mut written = 0;
    let mut start = 0;
    // What a block needs of the one before: its last byte a comma (the array's start counts
    // as one), and its digits.
    let (mut prev_comma, mut prev_digits) = (1u64, 0u64);
    let mut chunks = inner.chunks_exact(64);
    for (block, chunk) in (&mut chunks).enumerate() {
        let Classes { mut commas, other, zeros } = classify(chunk.try_into().expect("64 bytes"));
        if other != 0 {
            return None;
        }
        let digits = !commas;
        let after_comma = commas << 1 | prev_comma;
        let next_digit = u64::from(inner.get(64 * block + 64).is_some_and(u8::is_ascii_digit));
        // Bit k (above 64: this block) stays set while bytes k-8..=k are all digits.
        let mut run = u128::from(digits) << 64 | u128::from(prev_digits);
        for shift in [1, 2, 4, 1] {
            run &= run << shift;
        }
        let empty = commas & after_comma;
        let leading_zero = zeros & after_comma & (digits >> 1 | next_digit << 63);
        if empty | leading_zero | (run >> 64) as u64 != 0 {
            return None;
        }
        (prev_comma, prev_digits) = (commas >> 63, digits);
        // The block and the eight bytes before it (all but the first block): the eight bytes
        // that end with a number hold its digits in their top bytes.
        let window: Option<&[u8; 72]> =
            (64 * block).checked_sub(8).and_then(|from| inner.get(from..from + 72)?.try_into().ok());
        let Some(window) = window else {
            while commas != 0 {
                let end = 64 * block + commas.trailing_zeros() as usize;
                commas &= commas - 1;
                *ids.get_mut(written)? = compact_number(inner, start, end)?;
                written += 1;
                start = end + 1;
            }
            continue;
        };
        if commas == 0 {
            continue;
        }
        let found = commas.count_ones() as usize;
        let last = 64 * block + 63 - commas.leading_zeros() as usize;
        // The number before the next comma (once the commas run out, any value: its lane
        // lands in a slot the next number overwrites, or past the end).
        let mut next = || {
            let k = commas.trailing_zeros() as usize & 63;
            commas &= commas.wrapping_sub(1);
            let end = 64 * block + k;
            // The digits in the top bytes, the bytes before them cleared.
            let word = u64::from_le_bytes(window[k..k + 8].try_into().expect("8 bytes"));
            let len = end.wrapping_sub(start) & 15;
            start = end + 1;
            word & TAIL_DIGITS[len]
        };
        let out = ids.get_mut(written..written + found.next_multiple_of(4))?;
        for out in out.chunks_exact_mut(4) {
            out.copy_from_slice(&values4([next(), next(), next(), next()]));
        }
        start = last + 1;
        written += found;
    }
    let rest = chunks.remainder();
    let rest_start = inner.len() - rest.len();
    for (k, &b) in rest.iter().enumerate() {
        match b {
            b',' => {
                *ids.get_mut(written)? = compact_number(inner, start, rest_start + k)?;
                written += 1;
                start = rest_start + k + 1;
            }
            b'0'..=b'9' => {}
            _ => return None,
        }
    }
    *ids.get_mut(written)? = compact_number(inner, start, inner.len())?;
    ids.truncate(written + 1);
    (written + 1 == count).then_some(ids)
}

/// [`swar_digits`] of four words at once, with SSE2 (through `safe_arch`): pairs, quads and
/// octets are combined by 16-bit multiplies and multiply-adds (`pmullw`, `pmaddwd`). Every
/// intermediate fits its lane: a pair is at most 99, a quad 9 999 (an `i16` after packing),
/// an octet 99 999 999. Any value for words that are not digits' values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn values4(words: [u64; 4]) -> [u32; 4] {
    use safe_arch::*;
    let quads = |words: [u64; 2]| {
        let v = m128i::from(words);
        // Each 16-bit lane holds a pair of digits, the first (more significant) in its low byte.
        let first = bitand_m128i(v, set_splat_i16_m128i(0xff));
        let pairs =
            add_i16_m128i(mul_i16_keep_low_m128i(first, set_splat_i16_m128i(10)), shr_imm_u16_m128i::<8>(v));
        mul_i16_horizontal_add_m128i(pairs, m128i::from([100i16, 1, 100, 1, 100, 1, 100, 1]))
    };
    let quads = pack_i32_to_i16_m128i(quads([words[0], words[1]]), quads([words[2], words[3]]));
    mul_i16_horizontal_add_m128i(quads, m128i::from([10_000i16, 1, 10_000, 1, 10_000, 1, 10_000, 1])).into()
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn values4(words: [u64; 4]) -> [u32; 4] {
    words.map(|word| swar_digits(word) as u32)
}

/// The id written in `inner[start..end]`, known to hold only digits.
fn compact_number(inner: &[u8], start: usize, end: usize) -> Option<u32> {
    let len = end - start;
    match inner.get(start..start + 8) {
        Some(word) if (1..=8).contains(&len) => {
            let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            (len == 1 || word as u8 != b'0').then_some(swar_value(word, len) as u32)
        }
        _ => long_number_at(inner, start).filter(|&(_, n)| n == len).map(|(id, _)| id),
    }
}

/// A 64-byte block's classes, bit `k` for byte `k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Classes {
    commas: u64,
    /// Neither comma nor digit.
    other: u64,
    /// `'0'`.
    zeros: u64,
}

/// [`Classes`] with SSE2 through `safe_arch`, since the crate forbids `unsafe`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn classify(block: &[u8; 64]) -> Classes {
    use safe_arch::*;
    let splat = |b: u8| set_splat_i8_m128i(b as i8);
    let mut classes = Classes { commas: 0, other: 0, zeros: 0 };
    for (k, chunk) in block.chunks_exact(16).enumerate() {
        let v = load_unaligned_m128i(chunk.try_into().expect("16 bytes"));
        let comma = cmp_eq_mask_i8_m128i(v, splat(b','));
        // Signed compares: non-ASCII bytes are negative, below '0'.
        let digit =
            bitand_m128i(cmp_gt_mask_i8_m128i(v, splat(b'0' - 1)), cmp_gt_mask_i8_m128i(splat(b'9' + 1), v));
        let bits = |m| u64::from(move_mask_i8_m128i(m) as u16) << (16 * k);
        classes.commas |= bits(comma);
        classes.other |= !bits(bitor_m128i(comma, digit)) & (0xffff << (16 * k));
        classes.zeros |= bits(cmp_eq_mask_i8_m128i(v, splat(b'0')));
    }
    classes
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn classify(block: &[u8; 64]) -> Classes {
    classify_swar(block)
}

/// [`classify`] eight bytes at a time with SWAR range tests.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn classify_swar(block: &[u8; 64]) -> Classes {
    let mut classes = Classes { commas: 0, other: 0, zeros: 0 };
    for (k, word) in block.chunks_exact(8).enumerate() {
        let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        let comma = bytes_equal(word, b',');
        classes.commas |= top_bits(comma) << (8 * k);
        classes.other |= top_bits(!(digits(word) | comma) & HIGH) << (8 * k);
        classes.zeros |= top_bits(bytes_equal(word, b'0')) << (8 * k);
    }
    classes
}

/// For each byte of `word`, its top bit set when the byte is `b` (exact: no borrow crosses
/// from one byte into the next).
#[inline(always)]
fn bytes_equal(word: u64, b: u8) -> u64 {
    let v = word ^ (ONES * u64::from(b));
    !(((v & (ONES * 0x7f)) + ONES * 0x7f) | v) & HIGH
}

/// The top bit of each byte of `m` (the only bits set), gathered into the low 8 bits: byte
/// `k`'s into bit `k`. The multiplier moves bit `8k` to bit `56 + k`; no two partial
/// products share a bit, so nothing carries.
#[inline(always)]
fn top_bits(m: u64) -> u64 {
    ((m >> 7).wrapping_mul(0x0102_0408_1020_4080)) >> 56
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

/// The value of the first `len` (1 to 8) bytes of `word`, all ASCII digits, the first one
/// the most significant: the digits are moved to the top bytes (zeros below act as leading
/// zeros), then pairs, quads and octets are combined by multiplication. Any value for
/// other lengths.
#[inline(always)]
fn swar_value(word: u64, len: usize) -> u64 {
    swar_digits(word.wrapping_shl(8usize.wrapping_sub(len).wrapping_mul(8) as u32) & (ONES * 0x0f))
}

/// For a number of `len` digits (1 to 8) in the top bytes of a word, the mask that keeps
/// their low nibbles and clears the bytes below them (which then act as leading zeros).
const TAIL_DIGITS: [u64; 16] = {
    let mut masks = [0u64; 16];
    let mut len = 1;
    while len <= 8 {
        masks[len] = (ONES * 0x0f) & (u64::MAX << (64 - 8 * len));
        len += 1;
    }
    masks
};

/// The value of the digits in `v`'s bytes (each byte a digit's value, the last byte the
/// least significant digit), combined by multiplication: pairs, quads, then octets.
#[inline(always)]
fn swar_digits(mut v: u64) -> u64 {
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
        // The whole of `json` but trailing whitespace, as serde reads a document.
        let rest_is_space = |len: usize| json.as_bytes()[len..].iter().all(|b| b" \t\n\r".contains(b));
        plain_token_ids(json.as_bytes()).filter(|&(_, len)| rest_is_space(len)).map(|(ids, _)| ids)
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
        /// Long compact arrays of ids of 1 to 8 digits, which the block path takes whole:
        /// the same ids as serde, and taken (not left to the slower reader).
        #[test]
        fn long_compact_arrays_are_read_whole(
            ids_ in prop::collection::vec(prop_oneof![0u32..10, 0u32..100_000, 0u32..100_000_000], 20..400),
        ) {
            let json = serde_json::to_string(&ids_).unwrap();
            let inner = &json.as_bytes()[1..json.len() - 1];
            prop_assert_eq!(super::compact_ids(inner, ids_.len()), Some(ids_.clone()));
            prop_assert_eq!(ids(&json), Some(ids_));
        }

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

        /// Long compact arrays with one flaw somewhere (a leading zero, a sign, an empty
        /// element, an id of 9 to 11 digits): read exactly as serde reads them.
        #[test]
        fn one_flaw_in_a_long_compact_array(
            ids_ in prop::collection::vec(0u32..100_000, 10..300),
            at in any::<prop::sample::Index>(),
            (prefix, flaw) in prop_oneof![
                prop::sample::select(vec!["0", "-", "00"]).prop_map(|f| (true, f)),
                prop::sample::select(vec!["", "123456789", "4294967295", "4294967296", "12345678901"])
                    .prop_map(|f| (false, f)),
            ],
        ) {
            let mut parts: Vec<String> = ids_.iter().map(u32::to_string).collect();
            let at = at.index(parts.len());
            parts[at] = if prefix { format!("{flaw}{}", parts[at]) } else { flaw.to_string() };
            let json = format!("[{}]", parts.join(","));
            prop_assert_eq!(ids(&json), serde_json::from_str::<Vec<u32>>(&json).ok(), "{}", json);
        }

        #[test]
        fn sse2_and_swar_classes_agree(
            bytes in prop::collection::vec(prop_oneof![any::<u8>(), Just(b','), 0x2bu8..0x3b], 64),
        ) {
            let block: [u8; 64] = bytes.try_into().unwrap();
            prop_assert_eq!(super::classify(&block), super::classify_swar(&block));
        }

        /// Four numbers of 1 to 8 digits, as the block path hands them over (digits' values in
        /// the top bytes, zeros below): the same values as one at a time, and as written.
        #[test]
        fn four_at_a_time_as_one_at_a_time(
            numbers in prop::array::uniform4(prop_oneof![0u32..10, 0u32..10_000, 0u32..100_000_000]),
        ) {
            let words = numbers.map(|n| {
                let digits = n.to_string();
                let mut word = [0u8; 8];
                for (byte, digit) in word[8 - digits.len()..].iter_mut().zip(digits.bytes()) {
                    *byte = digit - b'0';
                }
                u64::from_le_bytes(word)
            });
            prop_assert_eq!(super::values4(words), words.map(|word| super::swar_digits(word) as u32));
            prop_assert_eq!(super::values4(words), numbers);
        }

        /// Whatever it accepts, serde reads as the same ids; long compact arrays are
        /// taken whole (digits and commas across several 64-byte blocks).
        #[test]
        fn accepts_only_what_serde_reads_the_same(
            json in prop_oneof!["\\[[0-9 ,\\-.e\\]]{0,24}", "\\[[0-9,]{0,200}[0-9 ,\\]]{0,3}\\]"],
        ) {
            let serde = serde_json::from_str::<Vec<u32>>(&json).ok();
            match ids(&json) {
                Some(got) => prop_assert_eq!(serde, Some(got), "{}", json),
                None => prop_assert!(serde.is_none_or(|v| v.is_empty()), "refused {}", json),
            }
        }
    }
}
