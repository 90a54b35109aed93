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

use super::{ASCII_CLASS, Class};

/// Classification of a 64-byte block: bit `k` of each mask is about byte `k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Masks {
    /// ASCII letters and digits.
    alnum: u64,
    /// `' '`.
    space: u64,
    /// ASCII whitespace (`char::is_whitespace`: \t \n \x0b \x0c \r and the space).
    ws: u64,
    /// `<`: a special token may start there.
    lt: u64,
    /// Non-ASCII bytes.
    non_ascii: u64,
}

/// What a block needs to know of the bytes around it.
#[derive(Clone, Copy, Default)]
struct Context {
    /// The previous block's letters and digits (none before the first block).
    alnum: u64,
    /// 1 when the byte before the block is a space.
    space: u64,
    /// 1 when the byte before the block is ASCII whitespace.
    ws: u64,
    /// 1 when the byte after the block is ASCII whitespace.
    next_ws: u64,
    /// 1 when the byte after the block is not covered (`<`, non-ASCII) or missing.
    next_other: u64,
}

impl Masks {
    /// Bytes the blocks' rules do not cover.
    fn other(&self) -> u64 {
        self.lt | self.non_ascii
    }

    /// Piece starts in covered bytes: the first byte of a whitespace run; a space before a
    /// unit (it takes the unit: the tokenizer's rule 3, and a whitespace run stops before
    /// it: rule 5); punctuation and a word's first letter or digit, unless after a space.
    fn piece_starts(&self, cx: Context) -> u64 {
        let after_space = self.space << 1 | cx.space;
        let ws_start = self.ws & !(self.ws << 1 | cx.ws);
        let before_ws = self.ws >> 1 | cx.next_ws << 63;
        let punct = !(self.alnum | self.ws | self.other());
        let word_start = self.alnum & !(self.alnum << 1 | cx.alnum >> 63);
        ws_start | (self.space & !before_ws) | ((punct | word_start) & !after_space)
    }

    /// Bytes where the blocks stop vouching: those not covered, a space before one (it may
    /// or may not take what follows) and a letter or digit with 15 more before it.
    fn unsure(&self, cx: Context) -> u64 {
        let other = self.other();
        let before_other = other >> 1 | cx.next_other << 63;
        // Bit k of `run` (above 64: this block) stays set while bytes k-2n+1..=k are all
        // letters or digits.
        let mut run = u128::from(self.alnum) << 64 | u128::from(cx.alnum);
        for n in [1, 2, 4, 8] {
            run &= run << n;
        }
        other | (self.space & before_other) | (run >> 64) as u64
    }

    /// Unsure bytes that still end the piece before them: `<`, and a space before an
    /// uncovered byte unless after whitespace (a run may take the space). (A `<` after a
    /// space never gets here: that space is unsure, and comes first.)
    fn ending(&self, cx: Context) -> u64 {
        let before_other = self.other() >> 1 | cx.next_other << 63;
        self.lt | (self.space & before_other & !(self.ws << 1 | cx.ws))
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
    let mut before = Context::default();
    while let Some(block) = bytes.get(base..base + 64) {
        let masks = classify(block.try_into().expect("64 bytes"));
        let next = bytes.get(base + 64).copied();
        let cx = Context {
            next_ws: u64::from(next.is_some_and(|b| ASCII_CLASS.get(usize::from(b)) == Some(&Class::Space))),
            next_other: u64::from(next.is_none_or(|b| b == b'<' || !b.is_ascii())),
            ..before
        };
        let starts = masks.piece_starts(cx);
        let unsure_all = masks.unsure(cx);
        let ending = masks.ending(cx);
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
            let mut ends = ((starts & first.wrapping_sub(1)) | (first & ending)) & past_start;
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
        before = Context { alnum: masks.alnum, space: masks.space >> 63, ws: masks.ws >> 63, ..before };
        if unsure_all.count_ones() >= DENSE && start < bytes.len() {
            start = out.general(start, start + DENSE_SKIP);
        }
        // The general rules took the cursor into the next block or past it: start the
        // blocks afresh there (a piece start needs nothing from the bytes before it).
        if start >= base {
            (base, before) = (start, Context::default());
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
    let mut masks = Masks { alnum: 0, space: 0, ws: 0, lt: 0, non_ascii: 0 };
    for (k, chunk) in block.chunks_exact(16).enumerate() {
        let v = load_unaligned_m128i(chunk.try_into().expect("16 bytes"));
        // `| 0x20` folds upper-case letters onto lower-case and makes nothing else a letter.
        let alnum = bitor_m128i(within(bitor_m128i(v, splat(0x20)), b'a', b'z'), within(v, b'0', b'9'));
        let space = cmp_eq_mask_i8_m128i(v, splat(b' '));
        // `char::is_whitespace` in ASCII: \t \n \x0b \x0c \r and the space.
        let ws = bitor_m128i(within(v, b'\t', b'\r'), space);
        let bits = |m| u64::from(move_mask_i8_m128i(m) as u16) << (16 * k);
        masks.alnum |= bits(alnum);
        masks.space |= bits(space);
        masks.ws |= bits(ws);
        masks.lt |= bits(cmp_eq_mask_i8_m128i(v, splat(b'<')));
        // Non-ASCII bytes from their sign bits.
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
    let mut masks = Masks { alnum: 0, space: 0, ws: 0, lt: 0, non_ascii: 0 };
    for (k, &b) in block.iter().enumerate() {
        let bit = 1u64 << k;
        match ASCII_CLASS.get(usize::from(b)) {
            Some(Class::Alnum) => masks.alnum |= bit,
            Some(Class::Space) => {
                masks.ws |= bit;
                if b == b' ' {
                    masks.space |= bit;
                }
            }
            Some(Class::Other) if b == b'<' => masks.lt |= bit,
            Some(Class::Other) => {}
            None => masks.non_ascii |= bit,
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
        // Whitespace runs, and the space that leaves one for the unit after it.
        assert_eq!(pieces("a  b"), (vec!["a", " ", " b"], None));
        assert_eq!(pieces("a   b\n\n c \n\td"), (vec!["a", "  ", " b", "\n\n", " c", " \n\t", "d"], None));
        // `<` (maybe a special token) and what a space before it does are the general rules'.
        assert_eq!(pieces("ab <|im_end|>"), (vec!["ab"], Some(2)));
        assert_eq!(pieces("ab\n<|im_end|>"), (vec!["ab", "\n"], Some(3)));
        assert_eq!(pieces("ab\n <x"), (vec!["ab"], Some(2)));
        // A word that may go on in a non-ASCII letter, or past the length cap.
        assert_eq!(pieces("ab caf\u{e9}"), (vec!["ab"], Some(2)));
        assert_eq!(pieces("ab abcdefghijklmnop"), (vec!["ab"], Some(2)));
        assert_eq!(pieces("abcdefghijklmnop"), (vec![], Some(0)));
        assert_eq!(pieces("x abcdefghijklmno."), (vec!["x", " abcdefghijklmno", "."], None));
    }

    #[test]
    fn the_text_end_is_not_a_unit() {
        // A block that is the whole text: a space at its end is a whitespace run's, not
        // a word's; the general rules take it and the run before it.
        let text = format!("{}a \n ", "xy ".repeat(20));
        assert_eq!(text.len(), 64);
        let mut record = Record::default();
        cut(text.as_bytes(), &mut record);
        assert_eq!(record.0.last(), Some(&Err(63)));
        assert!(record.0.contains(&Ok((59, 61))) && !record.0.contains(&Ok((61, 63))));
    }

    #[test]
    fn goes_on_after_the_general_rules_in_the_same_block() {
        // The word before "<" is cut, the "<" goes to the general rules (here: a byte each),
        // then the blocks go on.
        let text = format!("ab<cd ef{}", ".".repeat(64));
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

        // A whitespace run across the boundary: the space after it takes the next word.
        let text = format!("{}  z{}", "ab ".repeat(20) + "abc", ".".repeat(64));
        assert_eq!(&text[62..66], "c  z");
        let mut record = Record::default();
        cut(text.as_bytes(), &mut record);
        let at = record.0.iter().position(|&step| step == Ok((59, 63))).unwrap();
        assert_eq!(record.0[at + 1..at + 3], [Ok((63, 64)), Ok((64, 66))]);
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
