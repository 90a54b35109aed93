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
//! digit in a row (the length cap cuts the word); a piece that ends at such a byte is
//! vouched for when the byte is ASCII and no space precedes it. From there the tokenizer's
//! general rules take pieces until they are past that byte, and the block goes on. Text
//! where most bytes need the general rules (most non-English scripts, say) stops being
//! classified for a while ([`DENSE`]), so it costs little more than the general rules alone.

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
    /// Non-ASCII bytes (also in `other`).
    non_ascii: u64,
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

    /// Unsure bytes that still end the piece before them: ASCII whitespace or `<` with no
    /// space before it (a word or a punctuation mark ends there; a space would belong to
    /// a whitespace run or take the `<`).
    fn ending(&self, carry: Carry) -> u64 {
        self.other & !self.non_ascii & !(self.space << 1 | carry.space)
    }
}

/// Blocks with at least this many unsure bytes are dense: the general rules take the next
/// [`DENSE_SKIP`] bytes without classifying them.
const DENSE: u32 = 16;
/// See [`DENSE`].
const DENSE_SKIP: usize = 192;

/// What [`cut`] drives: the pieces it vouches for, and the general rules where it does not.
pub(super) trait Pieces {
    /// The piece `start..end`, cut by the blocks.
    fn piece(&mut self, start: usize, end: usize);
    /// Pieces from `start` by the general rules, until one ends past `until` (or the text
    /// does); returns the last one's end.
    fn general(&mut self, start: usize, until: usize) -> usize;
}

/// Cuts `bytes` into pieces, 64-byte blocks at a time: pieces the blocks vouch for go to
/// [`Pieces::piece`]; at a byte they do not vouch for, [`Pieces::general`] takes pieces
/// until it has passed that byte, and the block goes on from there with the masks it
/// already has. The last bytes, fewer than a block, go to the general rules.
#[inline(always)]
pub(super) fn cut(bytes: &[u8], out: &mut impl Pieces) {
    let (mut start, mut base) = (0usize, 0usize);
    let mut carry = Carry::default();
    while let Some(block) = bytes.get(base..base + 64) {
        let masks = classify(block.try_into().expect("64 bytes"));
        let starts = masks.piece_starts(carry);
        let unsure_all = masks.unsure(carry);
        let ending = masks.ending(carry);
        loop {
            // Bits at or after the piece start, and after it (all bits when it began in an
            // earlier block).
            let (from_start, past_start) = match start.checked_sub(base) {
                Some(rel) => (!0u64 << rel, !0u64 << rel << 1),
                None => (!0, !0),
            };
            let unsure = unsure_all & from_start;
            let first = unsure & unsure.wrapping_neg();
            // Starts after the piece start and before the first unsure byte end pieces, and
            // so does that byte if it is an ending one.
            let mut ends = ((starts & (first.wrapping_sub(1))) | (first & ending)) & past_start;
            while ends != 0 {
                let end = base + ends.trailing_zeros() as usize;
                out.piece(start, end);
                start = end;
                ends &= ends - 1;
            }
            if unsure == 0 {
                break;
            }
            start = out.general(start, base + unsure.trailing_zeros() as usize);
            if start >= base + 64 {
                break;
            }
        }
        base += 64;
        carry = Carry { alnum: masks.alnum, space: masks.space >> 63 };
        if unsure_all.count_ones() >= DENSE && start < bytes.len() {
            start = out.general(start, start + DENSE_SKIP);
        }
        // A general piece ran past the next block: start afresh where it ended (a piece
        // start needs nothing from the bytes before it).
        if start >= base {
            (base, carry) = (start, Carry::default());
        }
    }
    if start < bytes.len() {
        out.general(start, bytes.len() - 1);
    }
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
    let mut masks = Masks { alnum: 0, space: 0, other: 0, non_ascii: 0 };
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
        masks.non_ascii |= bits(v);
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
    let mut masks = Masks { alnum: 0, space: 0, other: 0, non_ascii: 0 };
    for (k, &b) in block.iter().enumerate() {
        let bit = 1u64 << k;
        match ASCII_CLASS.get(usize::from(b)) {
            Some(Class::Alnum) => masks.alnum |= bit,
            _ if b == b' ' => masks.space |= bit,
            Some(Class::Space) => masks.other |= bit,
            None => {
                masks.other |= bit;
                masks.non_ascii |= bit;
            }
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

    /// What [`cut`] did: pieces it cut (`Ok`) and the starts it left to the general rules
    /// (`Err`), which here take one byte a piece.
    #[derive(Default)]
    struct Record(Vec<Result<(usize, usize), usize>>);

    impl Pieces for Record {
        fn piece(&mut self, start: usize, end: usize) {
            self.0.push(Ok((start, end)));
        }
        fn general(&mut self, mut start: usize, until: usize) -> usize {
            loop {
                self.0.push(Err(start));
                start += 1;
                if start > until {
                    return start;
                }
            }
        }
    }

    /// The pieces the blocks vouch for in `text` padded with `.` to 64 bytes, up to the
    /// first byte left to the general rules, and that byte.
    fn pieces(text: &str) -> (Vec<&str>, Option<usize>) {
        let mut padded = text.as_bytes().to_vec();
        padded.resize(64.max(text.len()), b'.');
        let mut record = Record::default();
        cut(&padded, &mut record);
        let mut out = Vec::new();
        for step in record.0 {
            match step {
                Ok((s, e)) if e <= text.len() => out.push(&text[s..e]),
                Ok(_) => {}
                Err(at) if at < text.len() => return (out, Some(at)),
                Err(_) => {}
            }
        }
        (out, None)
    }

    #[test]
    fn vouches_only_for_pieces_before_what_it_does_not_cover() {
        assert_eq!(pieces("Hello, world! x"), (vec!["Hello", ",", " world", "!", " x"], None));
        assert_eq!(pieces("a  b"), (vec!["a"], Some(1)));
        assert_eq!(pieces("ab cd\nef"), (vec!["ab", " cd"], Some(5)));
        assert_eq!(pieces("ab \nef"), (vec!["ab"], Some(2)));
        assert_eq!(pieces("ab <|im_end|>"), (vec!["ab"], Some(2)));
        assert_eq!(pieces("ab caf\u{e9}"), (vec!["ab"], Some(2)));
        assert_eq!(pieces("ab abcdefghijklmnop"), (vec!["ab"], Some(2)));
        assert_eq!(pieces("abcdefghijklmnop"), (vec![], Some(0)));
        assert_eq!(pieces("x abcdefghijklmno."), (vec!["x", " abcdefghijklmno", "."], None));
    }

    #[test]
    fn goes_on_after_the_general_rules_in_the_same_block() {
        // The word before "\n" is cut, the "\n" goes to the general rules (here: a byte
        // each), then the blocks go on.
        let text = format!("ab\ncd ef{}", ".".repeat(64));
        let mut record = Record::default();
        cut(text.as_bytes(), &mut record);
        assert_eq!(&record.0[..4], [Ok((0, 2)), Err(2), Ok((3, 5)), Ok((5, 8))]);
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
        let mut record = Record::default();
        cut(text.as_bytes(), &mut record);
        let cut_first: Vec<&str> =
            record.0.iter().map_while(|step| step.ok()).map(|(s, e)| &text[s..e]).collect();
        assert_eq!(cut_first, want);
        // The run's piece (from its space at 120) is left to the general rules.
        assert_eq!(record.0[want.len()], Err(120));

        // Two spaces across the boundary: the second is left to the general rules.
        let text = format!("{}  z{}", "ab ".repeat(20) + "abc", ".".repeat(64));
        assert_eq!(&text[62..65], "c  ");
        let mut record = Record::default();
        cut(text.as_bytes(), &mut record);
        let first_general = record.0.iter().position(Result::is_err).unwrap();
        assert_eq!(record.0[first_general - 1], Ok((59, 63)));
        assert_eq!(record.0[first_general], Err(63));
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
