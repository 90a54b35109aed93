//! Tokenizing a text from part-way through: what lets a cache of texts' beginnings
//! ([`crate::openai::prefix_cache`]) skip tokenizing a beginning it has seen.
//!
//! A *resume point* of a text `t` is a byte offset `b` such that every text `u` whose first
//! `b + lookahead` bytes are `t`'s encodes to the ids `t` has before `b`, followed by the ids
//! of `u` encoded from `b` on ([`Resume::encode_from`]). Where a tokenizer has such points:
//!
//! - [`Builtin`](super::Builtin): at every piece end, with a lookahead of 16 bytes. The
//!   scanner keeps no state from one piece to the next but the cursor, and deciding a piece
//!   reads at most 14 bytes past its end (a special token after a space).
//! - [`HuggingFace`](super::HuggingFace): right after every added token (`<|im_end|>`,
//!   `<|eot_id|>`, ...), with a lookahead of the longest added token plus one character.
//!   `tokenizers` cuts the text at added tokens before anything else and normalizes,
//!   pre-tokenizes and merges each part alone, so what follows an added token does not
//!   depend on what came before it. That holds only for some `tokenizer.json`s; the checks
//!   are in [`HuggingFace`](super::HuggingFace)'s loader, and a tokenizer that fails them
//!   does not resume (and is not cached). In chat, added tokens end every message, so a
//!   conversation's earlier turns are where a new turn resumes.

use super::RequestError;

/// A tokenizer that can start again at known points of a text (see the module docs).
pub trait Resume: Send + Sync {
    /// Bytes after a resume point that decide it.
    fn lookahead(&self) -> usize;

    /// The ids `encode(text, add_special_tokens)` puts before the text's own (a BOS).
    fn leading_ids(&self, add_special_tokens: bool) -> &[u32];

    /// Appends to `ids` the ids of `text` from byte `start` (0 or a resume point), without
    /// special tokens, and tells `points` of the resume points from `start` on.
    fn encode_from(
        &self,
        text: &str,
        start: usize,
        ids: &mut Vec<u32>,
        points: &mut Points,
    ) -> Result<(), RequestError>;
}

/// A resume point: its byte offset, and how many ids come before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Point {
    pub byte: usize,
    pub ids: usize,
}

/// The resume points a caller wants: for each of its limits (byte offsets, ascending), the
/// last resume point at or before that limit.
#[derive(Debug)]
pub struct Points {
    limits: Vec<usize>,
    found: Vec<Point>,
}

impl Points {
    /// Asks for the last point at or before each of `limits` (ascending).
    pub fn new(limits: Vec<usize>) -> Self {
        let found = Vec::with_capacity(limits.len());
        Self { limits, found }
    }

    /// One point for each limit, in order (fewer if the tokenizer stopped early).
    pub fn found(&self) -> &[Point] {
        &self.found
    }

    /// The tokenizer's report: `point` is a resume point and the next one is at byte
    /// `next` (every point is reported, in order, the first one being where encoding began).
    #[inline(always)]
    pub fn span(&mut self, point: Point, next: usize) {
        if self.limits.get(self.found.len()).is_some_and(|&limit| limit < next) {
            self.record(point, next);
        }
    }

    /// The limit whose point is still wanted (`usize::MAX` when there is none): points
    /// whose next point is not past it need not be reported.
    pub fn next_limit(&self) -> usize {
        self.limits.get(self.found.len()).copied().unwrap_or(usize::MAX)
    }

    /// No point comes after `point`.
    pub fn finish(&mut self, point: Point) {
        self.record(point, usize::MAX);
    }

    #[cold]
    fn record(&mut self, point: Point, next: usize) {
        while let Some(&limit) = self.limits.get(self.found.len()) {
            if limit >= next {
                break;
            }
            debug_assert!(point.byte <= limit, "a limit before the first point");
            self.found.push(point);
        }
    }
}
