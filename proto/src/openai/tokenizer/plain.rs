//! Plain text cut 64 bytes at a time, for the built-in tokenizer.
//!
//! Most prompt text is ASCII words, single spaces and punctuation. In such text every piece
//! boundary is decided by a byte and the one before it, so a 64-byte block's boundaries are
//! one bit mask ([`Masks::piece_starts`]) and its pieces are read off it with
//! `trailing_zeros`. Blocks are classified independently of where pieces fall, so the work
//! of one block overlaps the next; cut a piece at a time, every word of random length
//! mispredicts its loop's exit, and the next piece waits for it.
//!
//! The blocks vouch only for pieces that end before the first byte that could bring another
//! of the tokenizer's rules into play ([`Masks::unsure`]): a non-ASCII byte, whitespace
//! other than a single space, `<` (a special token may start there) and the 16th letter or
//! digit in a row (the length cap cuts the word). [`cut`] stops there, and the tokenizer's
//! general rules take over.

/// Classification of a 64-byte block: bit `k` of each mask is about byte `k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Masks {
    /// ASCII letters and digits.
    alnum: u64,
    /// `' '`.
    space: u64,
    /// Bytes the blocks' rules do not cover: non-ASCII bytes, whitespace other than
    /// `' '`, and `<`.
    other: u64,
}

/// What a block needs to know of the bytes before it.
#[derive(Clone, Copy, Default)]
struct Carry {
    /// The previous block's letters and digits (none before the first block).
    alnum: u64,
    /// 1 when the byte before the block is a space.
    space: u64,
}

impl Masks {
    /// Piece starts in covered bytes: every space (it takes the unit after it: the
    /// tokenizer's rule 3), punctuation not after a space, and a word's first letter or
    /// digit unless it follows a space.
    fn piece_starts(&self, carry: Carry) -> u64 {
        let after_space = self.space << 1 | carry.space;
        let punct = !(self.alnum | self.space | self.other);
        let word_start = self.alnum & !(self.alnum << 1 | carry.alnum >> 63);
        self.space | ((punct | word_start) & !after_space)
    }

    /// Bytes where the blocks stop vouching: those not covered, the second space of two in
    /// a row (a whitespace run) and a letter or digit with 15 more before it.
    fn unsure(&self, carry: Carry) -> u64 {
        let double_space = self.space & (self.space << 1 | carry.space);
        // Bit k of `run` (above 64: this block) stays set while bytes k-2n+1..=k are all
        // letters or digits.
        let mut run = u128::from(self.alnum) << 64 | u128::from(carry.alnum);
        for n in [1, 2, 4, 8] {
            run &= run << n;
        }
        self.other | double_space | (run >> 64) as u64
    }
}

/// Cuts pieces from `from` (a piece start) on, a 64-byte block at a time, calling `emit`
/// with each piece's bounds, until the first byte the blocks do not vouch for. Returns the
/// start of the first piece not emitted, and that byte's position (or the text's length
/// when fewer than 64 bytes were left for a block): the general rules take the text from
/// the first at least until they have passed the second.
#[inline(always)]
pub(super) fn cut(bytes: &[u8], from: usize, mut emit: impl FnMut(usize, usize)) -> (usize, usize) {
    let (mut start, mut base) = (from, from);
    let mut carry = Carry::default();
    while let Some(block) = bytes.get(base..base + 64) {
        let masks = classify(block.try_into().expect("64 bytes"));
        // `from` starts a piece; the pieces emitted end at the starts that follow it.
        let mut ends = masks.piece_starts(carry) & !u64::from(base == from);
        let unsure = masks.unsure(carry);
        ends &= unsure.wrapping_sub(1) & !unsure;
        while ends != 0 {
            let end = base + ends.trailing_zeros() as usize;
            emit(start, end);
            start = end;
            ends &= ends - 1;
        }
        if unsure != 0 {
            return (start, base + unsure.trailing_zeros() as usize);
        }
        carry = Carry { alnum: masks.alnum, space: masks.space >> 63 };
        base += 64;
    }
    (start, bytes.len())
}

/// SSE2 (through `safe_arch`, since the crate forbids `unsafe`), 16 bytes at a time.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn classify(block: &[u8; 64]) -> Masks {
    use safe_arch::*;
    let splat = |b: u8| set_splat_i8_m128i(b as i8);
    // Signed compares: every non-ASCII byte is negative and outside every range here.
    let within = |x, lo: u8, hi: u8| {
        bitand_m128i(cmp_gt_mask_i8_m128i(x, splat(lo - 1)), cmp_gt_mask_i8_m128i(splat(hi + 1), x))
    };
    let mut masks = Masks { alnum: 0, space: 0, other: 0 };
    for (k, chunk) in block.chunks_exact(16).enumerate() {
        let v = load_unaligned_m128i(chunk.try_into().expect("16 bytes"));
        // `| 0x20` folds upper-case letters onto lower-case and makes nothing else a letter.
        let alnum = bitor_m128i(within(bitor_m128i(v, splat(0x20)), b'a', b'z'), within(v, b'0', b'9'));
        let space = cmp_eq_mask_i8_m128i(v, splat(b' '));
        // Whitespace besides ' ' (`char::is_whitespace` in ASCII: \t \n \x0b \x0c \r) and
        // `<`; non-ASCII bytes come from their sign bits.
        let other = bitor_m128i(within(v, b'\t', b'\r'), cmp_eq_mask_i8_m128i(v, splat(b'<')));
        let bits = |m| u64::from(move_mask_i8_m128i(m) as u16) << (16 * k);
        masks.alnum |= bits(alnum);
        masks.space |= bits(space);
        masks.other |= bits(other) | bits(v);
    }
    masks
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn classify(block: &[u8; 64]) -> Masks {
    classify_bytewise(block)
}

/// [`classify`] with the tokenizer's byte classes, a byte at a time.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn classify_bytewise(block: &[u8; 64]) -> Masks {
    use super::{ASCII_CLASS, Class};
    let mut masks = Masks { alnum: 0, space: 0, other: 0 };
    for (k, &b) in block.iter().enumerate() {
        let bit = 1u64 << k;
        match ASCII_CLASS.get(usize::from(b)) {
            Some(Class::Alnum) => masks.alnum |= bit,
            _ if b == b' ' => masks.space |= bit,
            Some(Class::Space) | None => masks.other |= bit,
            Some(Class::Other) if b == b'<' => masks.other |= bit,
            Some(Class::Other) => {}
        }
    }
    masks
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The pieces the blocks vouch for in `text` padded with `.` to 64 bytes, and where
    /// they stop.
    fn pieces(text: &str) -> (Vec<&str>, usize) {
        let mut padded = text.as_bytes().to_vec();
        padded.resize(64.max(text.len()), b'.');
        let mut out = Vec::new();
        let (_, stop) = cut(&padded, 0, |s, e| {
            if e <= text.len() {
                out.push(&text[s..e]);
            }
        });
        (out, stop)
    }

    #[test]
    fn vouches_only_for_pieces_before_what_it_does_not_cover() {
        assert_eq!(pieces("Hello, world! x"), (vec!["Hello", ",", " world", "!", " x"], 64));
        assert_eq!(pieces("a  b"), (vec!["a"], 2));
        assert_eq!(pieces("ab cd\nef"), (vec!["ab"], 5));
        assert_eq!(pieces("ab <|im_end|>"), (vec!["ab"], 3));
        assert_eq!(pieces("ab caf\u{e9}"), (vec!["ab"], 6));
        assert_eq!(pieces("ab abcdefghijklmnop"), (vec!["ab"], 18));
        assert_eq!(pieces("abcdefghijklmnop"), (vec![], 15));
        assert_eq!(pieces("x abcdefghijklmno."), (vec!["x", " abcdefghijklmno", "."], 64));
    }

    #[test]
    fn pieces_and_runs_carry_across_blocks() {
        // A word across the first boundary, then a run of 16 letters from byte 121.
        let mut want = vec!["abc", "."];
        for _ in 0..11 {
            want.extend([" abc", "."]);
        }
        want.extend([" wxyzuv", " next"]);
        let mut text = want.concat();
        assert_eq!((text.find('w'), text.len()), (Some(60), 71));
        want.extend(std::iter::repeat_n(".", 120 - 71));
        text += &".".repeat(120 - 71);
        text += &format!(" {}{}", "a".repeat(40), ".".repeat(64));
        let mut got = Vec::new();
        let (start, stop) = cut(text.as_bytes(), 0, |s, e| got.push(&text[s..e]));
        assert_eq!((got, start, stop), (want, 120, 136));

        // Two spaces across the boundary.
        let text = format!("{}  z{}", "ab ".repeat(20) + "abc", ".".repeat(64));
        assert_eq!(&text[62..65], "c  ");
        let mut ends = Vec::new();
        assert_eq!(cut(text.as_bytes(), 0, |_, e| ends.push(e)), (63, 64));
        assert_eq!(ends.last(), Some(&63));
    }

    proptest! {
        #[test]
        fn sse2_and_bytewise_classes_agree(bytes in prop::array::uniform32(any::<u8>()), more in prop::array::uniform32(any::<u8>())) {
            let mut block = [0u8; 64];
            block[..32].copy_from_slice(&bytes);
            block[32..].copy_from_slice(&more);
            prop_assert_eq!(classify(&block), classify_bytewise(&block));
        }
    }
}
