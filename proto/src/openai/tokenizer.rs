//! Text to token ids: the [`Tokenizer`] seam and its two implementations.
//!
//! - [`Builtin`]: a deterministic tokenizer that needs no files, so a fleet with no model
//!   files (tests, the load generator, CPU demos) still gets realistic, stable token ids.
//! - [`HuggingFace`]: a `tokenizer.json` run by the `tokenizers` crate, which produces the
//!   same ids as Python `tokenizers` (and so as vLLM).
//!
//! # The builtin algorithm (version 1)
//!
//! Parameters: vocabulary size `V = 32768`, reserved ids `R = 16`, longest word piece
//! `W = 16` characters. Special tokens, recognised anywhere in the text:
//! `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2; ids 3..16 are reserved and
//! never produced. The text is scanned left to right, cutting one piece at a time:
//!
//! 1. If the text at the cursor starts with a special token, emit its id.
//! 2. A *unit* is either a run of 1 to `W` alphanumeric characters (Rust
//!    `char::is_alphanumeric`, i.e. Unicode Alphabetic or Numeric), or else a single
//!    character that is neither whitespace nor alphanumeric (punctuation, symbols).
//! 3. If the cursor is at a space `' '` (U+0020) that is directly followed by a character
//!    that is not whitespace and does not start a special token, the piece is that space plus
//!    the following unit (so `" world"` is one piece, as in GPT-style tokenizers).
//! 4. Otherwise, if the cursor is at a non-whitespace character, the piece is one unit.
//! 5. Otherwise the piece is a run of whitespace characters (Rust `char::is_whitespace`),
//!    as long as possible but stopping before a space that would begin a rule-3 piece.
//!
//! A piece's id is `R + xxh3_64(UTF-8 bytes of the piece) % (V - R)` (XXH3 64-bit, seed 0;
//! Python: `16 + xxhash.xxh3_64_intdigest(piece.encode()) % 32752`). This is lossless up to
//! hash collisions, costs one hash per piece, and yields about one token per word or
//! punctuation mark. `add_special_tokens` adds nothing: like Qwen's tokenizers, the builtin
//! one has no BOS; the default chat template writes `<|im_start|>`/`<|im_end|>` itself.

use std::fmt;

use xxhash_rust::xxh3::xxh3_64;

use super::error::{LoadError, RequestError};

mod huggingface;
mod plain;
pub mod resume;
mod short_hash;

pub use huggingface::HuggingFace;
pub use resume::{Point, Points, Resume};

/// Turns text into token ids. Implementations must be deterministic: the router and every
/// replica agent must get the same ids for the same text.
pub trait Tokenizer: Send + Sync + fmt::Debug {
    /// The token ids of `text`. With `add_special_tokens`, the tokenizer's post-processor
    /// adds what it is configured to (typically a BOS id), as vLLM does for completions.
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, RequestError>;

    /// The token ids of `text` with no special token's text read as that token: Harmony's
    /// `encode_ordinary`, which writes a conversation's texts (a user's `<|end|>` is the
    /// characters, not the token).
    fn encode_ordinary(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        self.encode(text, false)
    }

    /// Every valid id is below this; prompt token ids are checked against it.
    fn vocab_size(&self) -> u32;

    /// The text of `ids` (special tokens included, as transformers' `decode` by default), if
    /// this tokenizer can tell it: the built-in one hashes words and cannot.
    fn decode(&self, _ids: &[u32]) -> Option<String> {
        None
    }

    /// How this tokenizer starts again part-way through a text, if it can do so exactly
    /// ([`resume`]), or why it cannot; a tokenizer that cannot is never cached.
    fn resume(&self) -> Result<&dyn Resume, &str> {
        Err("the tokenizer cannot resume part-way through a text")
    }
}

/// The file-free deterministic tokenizer described in the module docs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Builtin;

impl Builtin {
    /// Vocabulary size `V`.
    pub const VOCAB_SIZE: u32 = 32768;
    /// Ids below this are special or reserved (`R`).
    pub const RESERVED: u32 = 16;
    /// Longest alphanumeric run in one piece, in characters (`W`).
    pub const MAX_WORD_CHARS: usize = 16;
    /// The special tokens and their ids.
    pub const SPECIAL_TOKENS: [(&'static str, u32); 3] =
        [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)];

    /// The id of one piece (rule "A piece's id" in the module docs).
    pub fn piece_id(piece: &str) -> u32 {
        piece_id(piece.as_bytes())
    }

    /// Splits `text` into pieces and appends their ids to `ids`, telling `marks` of every
    /// piece (so of every resume point); `offset` is where `text` begins in the text being
    /// encoded.
    ///
    /// Works on bytes: ASCII characters are classified by table, and only non-ASCII ones
    /// are decoded to `char`. Pieces are hashed in place. Plain text (ASCII words, single
    /// spaces, punctuation) is cut 64 bytes at a time ([`plain::cut`]); where it stops,
    /// [`general_piece_at`] takes pieces until it is past the byte that stopped it.
    #[inline(always)]
    fn encode_into(text: &str, ids: &mut Vec<u32>, offset: usize, marks: impl Marks) {
        plain::cut(text.as_bytes(), &mut Emit { text, ids, offset, marks });
    }
}

/// Bytes after a piece end that decide it (see [`resume`]): a space, then a special token.
const BUILTIN_LOOKAHEAD: usize = 16;

/// Where [`Builtin::encode_into`] reports pieces: nowhere, or to [`Points`].
trait Marks {
    fn span(&mut self, point: Point, next: usize);
}

impl Marks for () {
    #[inline(always)]
    fn span(&mut self, _: Point, _: usize) {}
}

/// [`Points`] with its next limit at hand, so a piece costs one comparison.
struct Limits<'a> {
    next: usize,
    points: &'a mut Points,
}

impl<'a> Limits<'a> {
    fn new(points: &'a mut Points) -> Self {
        Self { next: points.next_limit(), points }
    }
}

impl Marks for Limits<'_> {
    #[inline(always)]
    fn span(&mut self, point: Point, next: usize) {
        if self.next < next {
            self.points.span(point, next);
            self.next = self.points.next_limit();
        }
    }
}

/// Pieces as ids, to `ids`.
struct Emit<'a, M> {
    text: &'a str,
    ids: &'a mut Vec<u32>,
    offset: usize,
    marks: M,
}

impl<M: Marks> Emit<'_, M> {
    #[inline(always)]
    fn push(&mut self, start: usize, end: usize, id: u32) {
        self.marks.span(Point { byte: self.offset + start, ids: self.ids.len() }, self.offset + end);
        self.ids.push(id);
    }
}

impl<M: Marks> plain::Pieces for Emit<'_, M> {
    #[inline(always)]
    fn piece(&mut self, start: usize, end: usize) {
        self.push(start, end, piece_id_in(self.text.as_bytes(), start, end));
    }

    fn general(&mut self, mut start: usize, until: usize) -> usize {
        let bytes = self.text.as_bytes();
        loop {
            let (end, special) = general_piece_at(self.text, start);
            self.push(start, end, special.unwrap_or_else(|| piece_id_in(bytes, start, end)));
            start = end;
            if start > until || start >= bytes.len() {
                return start;
            }
        }
    }
}

/// The piece at byte `i` by the general rules, as its end and, for a special token, its
/// id.
#[inline(always)]
fn general_piece_at(text: &str, mut i: usize) -> (usize, Option<u32>) {
    let bytes = text.as_bytes();
    if let Some(end) = ascii_word_at(bytes, i) {
        return (end, None);
    }
    if let Some((id, len)) = special_at(&bytes[i..]) {
        return (i + len, Some(id));
    }
    let Some((class, len)) = class_at(text, i) else { return (bytes.len(), None) };
    if bytes[i] == b' '
        && let Some((class, len)) = unit_at(text, i + 1)
    {
        i = unit_end(text, i + 1, class, len);
    } else if class != Class::Space {
        i = unit_end(text, i, class, len);
    } else {
        i += len;
        while let Some((class, len)) = class_at(text, i) {
            if class != Class::Space || (bytes[i] == b' ' && unit_at(text, i + 1).is_some()) {
                break;
            }
            i += len;
        }
    }
    (i, None)
}

/// `R + xxh3_64(piece) % (V - R)`.
#[inline]
fn piece_id(piece: &[u8]) -> u32 {
    id_of_hash(xxh3_64(piece))
}

/// [`piece_id`] of `text[start..end]`, whose hash may read the bytes around it
/// ([`short_hash`]).
#[inline(always)]
fn piece_id_in(text: &[u8], start: usize, end: usize) -> u32 {
    id_of_hash(short_hash::xxh3_of(text, start, end))
}

#[inline(always)]
fn id_of_hash(hash: u64) -> u32 {
    let span = u64::from(Builtin::VOCAB_SIZE - Builtin::RESERVED);
    // The remainder is below `span`, which fits in u32.
    Builtin::RESERVED + (hash % span) as u32
}

/// What the algorithm needs to know of a character. `char::is_whitespace` and
/// `char::is_alphanumeric` never both hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// `char::is_whitespace`.
    Space,
    /// `char::is_alphanumeric`.
    Alnum,
    /// Punctuation, symbols, controls: a unit of its own.
    Other,
}

impl Class {
    fn of(c: char) -> Class {
        if c.is_whitespace() {
            Class::Space
        } else if c.is_alphanumeric() {
            Class::Alnum
        } else {
            Class::Other
        }
    }
}

/// [`Class::of`] for every ASCII character.
const ASCII_CLASS: [Class; 128] = {
    let mut table = [Class::Other; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8 as char;
        table[b] = if c.is_whitespace() {
            Class::Space
        } else if c.is_ascii_alphanumeric() {
            // `is_alphanumeric` is not const; for ASCII they agree (see the tests).
            Class::Alnum
        } else {
            Class::Other
        };
        b += 1;
    }
    table
};

/// The class and UTF-8 length of the character at byte `i` of `text` (a character
/// boundary), or `None` at the end.
#[inline(always)]
fn class_at(text: &str, i: usize) -> Option<(Class, usize)> {
    let &b = text.as_bytes().get(i)?;
    if b.is_ascii() {
        return Some((ASCII_CLASS[usize::from(b)], 1));
    }
    non_ascii_class_at(text, i)
}

/// [`class_at`] for a non-ASCII character: decoded.
#[inline]
fn non_ascii_class_at(text: &str, i: usize) -> Option<(Class, usize)> {
    let c = text[i..].chars().next()?;
    Some((Class::of(c), c.len_utf8()))
}

/// The special token that `rest` starts with, as `(id, byte length)`.
#[inline]
fn special_at(rest: &[u8]) -> Option<(u32, usize)> {
    if !rest.starts_with(b"<|") {
        return None;
    }
    Builtin::SPECIAL_TOKENS.iter().find(|(s, _)| rest.starts_with(s.as_bytes())).map(|&(s, id)| (id, s.len()))
}

/// The class and length of the character at byte `i` if it starts a unit (it is not
/// whitespace and does not start a special token).
#[inline(always)]
fn unit_at(text: &str, i: usize) -> Option<(Class, usize)> {
    class_at(text, i)
        .filter(|&(class, _)| class != Class::Space && special_at(&text.as_bytes()[i..]).is_none())
}

/// The end of the unit whose first character, at byte `i`, is of `class` and `len` bytes.
#[inline(always)]
fn unit_end(text: &str, i: usize, class: Class, len: usize) -> usize {
    match class {
        Class::Alnum => alnum_run_end(text, i + len, Builtin::MAX_WORD_CHARS - 1),
        _ => i + len,
    }
}

/// The most common piece, an ASCII word with or without its leading space, cut with one
/// table test per byte and nothing else: the end of the piece starting at `i` when it is
/// (space and) 1 to 16 ASCII letters and digits ending at an ASCII byte or the end of the
/// text (a non-ASCII byte might be a letter that continues the word: left to the general
/// rules).
#[inline(always)]
fn ascii_word_at(bytes: &[u8], i: usize) -> Option<usize> {
    let start = i + usize::from(bytes[i] == b' ');
    if !ASCII_ALNUM[usize::from(*bytes.get(start)?)] {
        return None;
    }
    let limit = (start + Builtin::MAX_WORD_CHARS).min(bytes.len());
    let mut end = start + 1;
    while end < limit && ASCII_ALNUM[usize::from(bytes[end])] {
        end += 1;
    }
    (end == limit || bytes[end].is_ascii()).then_some(end)
}

/// ASCII letters and digits, by byte (false for every non-ASCII byte).
const ASCII_ALNUM: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 128 {
        table[b] = (b as u8).is_ascii_alphanumeric();
        b += 1;
    }
    table
};

/// The end of the run of at most `n` alphanumeric characters starting at byte `i`.
#[inline(always)]
fn alnum_run_end(text: &str, mut i: usize, n: usize) -> usize {
    let bytes = text.as_bytes();
    for taken in 0..n {
        match bytes.get(i) {
            Some(&b) if b.is_ascii() => {
                if ASCII_CLASS[usize::from(b)] != Class::Alnum {
                    break;
                }
                i += 1;
            }
            Some(_) => return non_ascii_alnum_run_end(text, i, n - taken),
            None => break,
        }
    }
    i
}

/// [`alnum_run_end`] from a non-ASCII character on, decoding characters.
#[inline(never)]
fn non_ascii_alnum_run_end(text: &str, i: usize, n: usize) -> usize {
    let mut end = i;
    for (off, c) in text[i..].char_indices().take(n) {
        if !c.is_alphanumeric() {
            break;
        }
        end = i + off + c.len_utf8();
    }
    end
}

impl Tokenizer for Builtin {
    fn encode(&self, text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, RequestError> {
        let mut ids = Vec::with_capacity(text.len() / 4 + 1);
        Self::encode_into(text, &mut ids, 0, ());
        Ok(ids)
    }

    fn vocab_size(&self) -> u32 {
        Self::VOCAB_SIZE
    }

    fn resume(&self) -> Result<&dyn Resume, &str> {
        Ok(self)
    }
}

impl Resume for Builtin {
    fn lookahead(&self) -> usize {
        BUILTIN_LOOKAHEAD
    }

    fn leading_ids(&self, _add_special_tokens: bool) -> &[u32] {
        &[]
    }

    fn encode_from(
        &self,
        text: &str,
        start: usize,
        ids: &mut Vec<u32>,
        points: &mut Points,
    ) -> Result<(), RequestError> {
        Self::encode_into(&text[start..], ids, start, Limits::new(points));
        points.finish(Point { byte: text.len(), ids: ids.len() });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<u32> {
        Builtin.encode(text, true).unwrap()
    }

    fn ids_of(pieces_: &[&str]) -> Vec<u32> {
        pieces_
            .iter()
            .map(|p| {
                special_at(p.as_bytes())
                    .filter(|&(_, len)| len == p.len())
                    .map_or_else(|| Builtin::piece_id(p), |(id, _)| id)
            })
            .collect()
    }

    #[test]
    fn builtin_splits_as_documented() {
        let cases: &[(&str, &[&str])] = &[
            ("", &[]),
            ("Hello, world!", &["Hello", ",", " world", "!"]),
            ("a  b", &["a", " ", " b"]),
            ("a\n\n b", &["a", "\n\n", " b"]),
            ("  x ", &[" ", " x", " "]),
            ("x\t", &["x", "\t"]),
            ("abcdefghijklmnopqrstu", &["abcdefghijklmnop", "qrstu"]),
            (" abcdefghijklmnopq", &[" abcdefghijklmnop", "q"]),
            ("naïve 東京 42", &["naïve", " 東京", " 42"]),
            ("3.14", &["3", ".", "14"]),
            ("<|im_start|>user\nhi<|im_end|>\n", &["<|im_start|>", "user", "\n", "hi", "<|im_end|>", "\n"]),
            ("x <|im_end|>", &["x", " ", "<|im_end|>"]),
            ("<|im_foo|>", &["<", "|", "im", "_", "foo", "|", ">"]),
            ("<|endoftext|><|endoftext|>", &["<|endoftext|>", "<|endoftext|>"]),
        ];
        for (text, want) in cases {
            assert_eq!(pieces(text), ids_of(want), "{text:?}");
        }
    }

    #[test]
    fn builtin_documented_vectors() {
        // Reproducible with Python: 16 + xxhash.xxh3_64_intdigest(piece.encode()) % 32752
        // (proto/tests/data/builtin_tokenizer.py is such a reference implementation).
        assert_eq!(pieces("Hello, world!"), [20006, 30862, 22049, 5338]);
        assert_eq!(
            pieces("<|im_start|>user\nThe quick brown fox.<|im_end|>"),
            [1, 24338, 24604, 4287, 16769, 12118, 29544, 27875, 2]
        );
    }

    /// The algorithm as the module docs state it, char by char (the pre-byte-level code):
    /// the fast scanner must produce exactly its ids.
    fn reference(text: &str) -> Vec<u32> {
        let special = |rest: &str| {
            Builtin::SPECIAL_TOKENS.iter().find(|(s, _)| rest.starts_with(s)).map(|&(s, id)| (id, s.len()))
        };
        let starts_unit =
            |rest: &str| rest.chars().next().is_some_and(|c| !c.is_whitespace()) && special(rest).is_none();
        let unit_end = |i: usize| {
            let mut chars = text[i..].char_indices();
            match chars.next() {
                Some((_, c)) if c.is_alphanumeric() => {
                    let mut end = i + c.len_utf8();
                    for (off, d) in chars.take(Builtin::MAX_WORD_CHARS - 1) {
                        if !d.is_alphanumeric() {
                            break;
                        }
                        end = i + off + d.len_utf8();
                    }
                    end
                }
                Some((_, c)) => i + c.len_utf8(),
                None => i,
            }
        };
        let (mut ids, mut i) = (Vec::new(), 0);
        while let Some(c) = text[i..].chars().next() {
            if let Some((id, len)) = special(&text[i..]) {
                ids.push(id);
                i += len;
                continue;
            }
            let start = i;
            if c == ' ' && starts_unit(&text[i + 1..]) {
                i = unit_end(i + 1);
            } else if !c.is_whitespace() {
                i = unit_end(i);
            } else {
                i += c.len_utf8();
                while let Some(d) = text[i..].chars().next() {
                    if !d.is_whitespace() || (d == ' ' && starts_unit(&text[i + 1..])) {
                        break;
                    }
                    i += d.len_utf8();
                }
            }
            ids.push(Builtin::piece_id(&text[start..i]));
        }
        ids
    }

    #[test]
    fn ascii_classes_match_char_methods() {
        for b in 0..128u8 {
            assert_eq!(ASCII_CLASS[usize::from(b)], Class::of(char::from(b)), "{b:#04x}");
        }
    }

    proptest::proptest! {
        #[test]
        fn builtin_matches_the_reference(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::string::string_regex("[a-zA-Z0-9]{1,20}").unwrap(),
                    proptest::string::string_regex("[ \\t\\n\\r\\x0b\\x0c\\x1c\\x1f]{1,3}").unwrap(),
                    proptest::string::string_regex("[.,!?<|>_\\-]{1,2}").unwrap(),
                    proptest::string::string_regex("[\\u{85}\\u{a0}\\u{2003}\\u{3000}éü東京٣ⅫÅ\\u{301}😀]{1,3}").unwrap(),
                    proptest::sample::select(vec![
                        "<|endoftext|>".to_string(), "<|im_start|>".into(), "<|im_end|>".into(), "<|im_".into(), "<|".into(),
                    ]),
                    proptest::string::string_regex("\\PC{0,8}").unwrap(),
                ],
                0..24,
            )
        ) {
            let text = parts.concat();
            proptest::prop_assert_eq!(pieces(&text), reference(&text), "{:?}", text);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(1000))]
        /// Mostly plain text, long enough for several 64-byte blocks, with now and then
        /// something the blocks do not vouch for.
        #[test]
        fn plain_text_matches_the_reference(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    8 => proptest::string::string_regex("[a-zA-Z0-9]{1,12}").unwrap(),
                    6 => proptest::strategy::Just(" ".to_string()),
                    3 => proptest::string::string_regex("[.,!?;:'()\\-\\x00\\x7f]").unwrap(),
                    1 => proptest::string::string_regex("[a-zA-Z0-9]{15,34}").unwrap(),
                    1 => proptest::sample::select(vec![
                        "  ".to_string(), "   ".into(), "\n".into(), " \t".into(), "<|im_end|>".into(),
                        "é".into(), "<".into(), " <|".into(), "東京".into(), " <".into(), "\n <".into(),
                        " \u{a0}".into(), "\r\n".into(), "\x0b ".into(), "\x0c".into(), "\r".into(),
                        "\x1c\x1d\x1e\x1f".into(), "<|endoftext|>".into(), " ".repeat(70), "\t".repeat(65),
                        " \n".repeat(40),
                    ]),
                ],
                0..160,
            )
        ) {
            let text = parts.concat();
            proptest::prop_assert_eq!(pieces(&text), reference(&text), "{:?}", text);
        }
    }

    proptest::proptest! {
        /// Text where most bytes need the general rules (another script, code indentation,
        /// chat markup), with plain stretches between: dense blocks and the way back.
        #[test]
        fn dense_text_matches_the_reference(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    4 => proptest::string::string_regex("[東京数字éüÅ٣😀]{1,24}").unwrap(),
                    3 => proptest::string::string_regex("[a-zA-Z0-9]{1,10}").unwrap(),
                    3 => proptest::sample::select(vec![
                        " ".to_string(), "\n".into(), "    ".into(), "\n\t".into(), " \n".into(),
                        "<|im_start|>".into(), "<|im_end|>".into(), "<".into(), " <".into(), "(".into(),
                    ]),
                ],
                0..200,
            )
        ) {
            let text = parts.concat();
            proptest::prop_assert_eq!(pieces(&text), reference(&text), "{:?}", text);
        }
    }

    /// A 17-letter word, then a special token, at every offset across the first block
    /// boundaries, after plain words or after a whitespace run.
    #[test]
    fn long_words_and_specials_at_every_offset() {
        for lead in ["x", " ", "ab "] {
            for off in 0..=140 {
                let text = format!("{} abcdefghijklmnopq<|im_end|> tail end", lead.repeat(off));
                assert_eq!(pieces(&text), reference(&text), "{text:?}");
            }
        }
    }

    #[test]
    fn builtin_is_deterministic_and_in_range() {
        let text =
            "The router and the replica must agree, byte for byte: ünïcödé, 数字 12345.\n\t <|im_end|>";
        let a = pieces(text);
        assert_eq!(a, Builtin.encode(text, false).unwrap());
        assert!(a.iter().all(|&id| id < Builtin::VOCAB_SIZE));
        assert!(a.iter().filter(|&&id| id < Builtin::RESERVED).all(|&id| id <= 2));
    }
}
