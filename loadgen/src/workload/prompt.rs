//! Prompts as sequences of [`Segment`]s (a system prompt, a document, a user turn), cut into
//! 512-token content blocks with Mooncake-style ids by [`BlockIds`].
//!
//! A block's id is determined by its parent block's id and its content (which stretches of
//! which segments it covers), and fresh ids are handed out in order of first appearance
//! starting at 0, as in Mooncake traces. So two prompts get equal ids exactly as far as they
//! agree token for token from the start: a partial last block and the same block once filled
//! get different ids, and a document shares blocks only behind an identical prefix.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use super::TRACE_BLOCK_SIZE;

/// `len` tokens of content `id`: equal ids mean equal tokens, so a segment repeated in two
/// prompts (a system prompt, a shared document) must keep its id, and new content needs a
/// new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub id: u64,
    pub len: usize,
}

/// Assigns content-block ids; one per workload, so that its prompts share ids.
#[derive(Debug, Default)]
pub struct BlockIds {
    /// `(parent id or ROOT, content key)` → id.
    known: HashMap<(u64, u64), u64>,
    next: u64,
}

/// Parent of a prompt's first block.
const ROOT: u64 = u64::MAX;

impl BlockIds {
    pub fn new() -> Self {
        Self::default()
    }

    /// How many distinct blocks have been named.
    pub fn len(&self) -> usize {
        self.known.len()
    }

    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }

    /// The content-block ids of the prompt made of `segments`, and its length in tokens.
    pub fn assign(&mut self, segments: &[Segment]) -> (Vec<u64>, usize) {
        let total: usize = segments.iter().map(|s| s.len).sum();
        let mut ids = Vec::with_capacity(total.div_ceil(TRACE_BLOCK_SIZE));
        let mut parent = ROOT;
        let mut key = Xxh3::new();
        let mut filled = 0;
        for seg in segments {
            let mut offset = 0;
            while offset < seg.len {
                let take = (seg.len - offset).min(TRACE_BLOCK_SIZE - filled);
                key.update(&seg.id.to_le_bytes());
                key.update(&(offset as u64).to_le_bytes());
                key.update(&(take as u64).to_le_bytes());
                offset += take;
                filled += take;
                if filled == TRACE_BLOCK_SIZE {
                    parent = self.close(parent, &mut key);
                    ids.push(parent);
                    filled = 0;
                }
            }
        }
        if filled > 0 {
            ids.push(self.close(parent, &mut key));
        }
        (ids, total)
    }

    fn close(&mut self, parent: u64, key: &mut Xxh3) -> u64 {
        let content = key.digest();
        key.reset();
        let next = &mut self.next;
        *self.known.entry((parent, content)).or_insert_with(|| {
            let id = *next;
            *next += 1;
            id
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(id: u64, len: usize) -> Segment {
        Segment { id, len }
    }

    #[test]
    fn ids_follow_shared_prefixes_only() {
        let mut ids = BlockIds::new();
        // System prompt of 700 tokens, then a user turn.
        let (a, len_a) = ids.assign(&[seg(1, 700), seg(2, 400)]);
        assert_eq!((a.clone(), len_a), (vec![0, 1, 2], 1100));
        // Same system prompt, other user: only the first (pure system prompt) block is shared.
        let (b, _) = ids.assign(&[seg(1, 700), seg(3, 400)]);
        assert_eq!(b, [0, 3, 4]);
        // The conversation grows: its full blocks stay, the partial tail gets a new id.
        let (c, _) = ids.assign(&[seg(1, 700), seg(2, 400), seg(4, 300)]);
        assert_eq!(c, [0, 1, 5]);
        // A shared document behind different prefixes is not shared.
        let (d1, _) = ids.assign(&[seg(10, 512), seg(20, 512)]);
        let (d2, _) = ids.assign(&[seg(11, 512), seg(20, 512)]);
        assert_ne!(d1[1], d2[1]);
        // Exactly the same prompt again: the same ids, nothing new.
        let before = ids.len();
        assert_eq!(ids.assign(&[seg(1, 700), seg(2, 400)]).0, a);
        assert_eq!(ids.len(), before);
    }

    #[test]
    fn segment_boundaries_inside_a_block_matter() {
        let mut ids = BlockIds::new();
        let (a, _) = ids.assign(&[seg(1, 100), seg(2, 412)]);
        let (b, _) = ids.assign(&[seg(1, 101), seg(2, 411)]);
        assert_ne!(a, b);
        assert_eq!(ids.assign(&[]).0, Vec::<u64>::new());
    }

    /// The naive model: a prompt is its list of tokens `(segment, offset)`; block `i` of two
    /// prompts has the same id iff the prompts agree on every token up to its end and the
    /// block has the same length in both.
    type Tokens = Vec<(u64, usize)>;

    fn expand(segments: &[Segment]) -> Tokens {
        segments.iter().flat_map(|s| (0..s.len).map(move |o| (s.id, o))).collect()
    }

    proptest::proptest! {
        #[test]
        fn ids_agree_exactly_where_token_prefixes_agree(
            prompts in proptest::collection::vec(
                proptest::collection::vec((0u64..4, 1usize..700), 1..5), 2..8)
        ) {
            let prompts: Vec<Vec<Segment>> =
                prompts.iter().map(|p| p.iter().map(|&(id, len)| seg(id, len)).collect()).collect();
            let mut ids = BlockIds::new();
            let named: Vec<(Vec<u64>, Tokens)> =
                prompts.iter().map(|p| (ids.assign(p).0, expand(p))).collect();
            for (a_ids, a_tok) in &named {
                proptest::prop_assert_eq!(a_ids.len(), a_tok.len().div_ceil(TRACE_BLOCK_SIZE));
                for (b_ids, b_tok) in &named {
                    for i in 0..a_ids.len().min(b_ids.len()) {
                        let a_end = ((i + 1) * TRACE_BLOCK_SIZE).min(a_tok.len());
                        let b_end = ((i + 1) * TRACE_BLOCK_SIZE).min(b_tok.len());
                        let same = a_end == b_end && a_tok[..a_end] == b_tok[..b_end];
                        proptest::prop_assert_eq!(a_ids[i] == b_ids[i], same, "block {}", i);
                    }
                }
            }
        }
    }
}
