//! Deterministic completion text: the same prompt and seed always produce the same words, so
//! responses can be compared across runs and replicas.
//!
//! Each generated token is one word (with a leading space) drawn from a fixed list by a
//! SplitMix64 stream seeded with `xxh3(prompt token ids) ^ seed`, and for the prompt's
//! further choices of a request with `n` (sample `i` > 0) `^ i * 0x9E3779B97F4A7C15`.

use kvroute_proto::mix::SplitMix64;
use xxhash_rust::xxh3::xxh3_64;

const WORDS: &[&str] = &[
    " the", " cache", " block", " prefix", " token", " router", " replica", " fleet", " prompt", " batch",
    " fast", " exact", " load", " queue", " stream", " event", " hash", " chain", " model", " serve",
    " reuse", " skip", " prefill", " decode", " system", " user", " answer", " and", " of", " to", " in",
    " is",
];

/// An endless, deterministic word stream for one request.
pub struct TextGen {
    rng: SplitMix64,
}

impl TextGen {
    pub fn new(prompt: &[u32], seed: u64, sample: u32) -> Self {
        let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
        let sample = u64::from(sample).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Self { rng: SplitMix64(xxh3_64(&bytes) ^ seed ^ sample) }
    }

    /// The next token's text: one word with a leading space.
    pub fn next_token(&mut self) -> &'static str {
        WORDS[self.rng.below(WORDS.len() as u64) as usize]
    }
}

/// The id of a word [`TextGen`] produced: its place in the word list (SGLang's `output_ids`).
pub fn token_id(word: &str) -> u32 {
    WORDS.iter().position(|w| *w == word).map_or(0, |i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_prompt_same_text_other_prompt_other_text() {
        let take = |p: &[u32], seed| {
            let mut g = TextGen::new(p, seed, 0);
            (0..16).map(|_| g.next_token()).collect::<Vec<_>>()
        };
        assert_eq!(take(&[1, 2, 3], 0), take(&[1, 2, 3], 0));
        assert_ne!(take(&[1, 2, 3], 0), take(&[1, 2, 4], 0));
        assert_ne!(take(&[1, 2, 3], 0), take(&[1, 2, 3], 1));
        assert!(take(&[1], 0).iter().all(|w| w.starts_with(' ') && w.len() > 1));
        let mut second = TextGen::new(&[1, 2, 3], 0, 1);
        assert_ne!(take(&[1, 2, 3], 0), (0..16).map(|_| second.next_token()).collect::<Vec<_>>());
    }
}
