use proptest::prelude::*;

use super::*;
use crate::openai::{Builtin, Tokenizer};

/// Text with everything the builtin tokenizer treats apart: words (some past the 16-letter
/// cap), spaces and whitespace runs, punctuation, non-ASCII letters and spaces, special
/// tokens and what almost is one.
fn text(max_parts: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            6 => "[a-zA-Z0-9]{1,10}",
            5 => Just(" ".to_string()),
            1 => "[a-z]{15,20}",
            2 => "[.,!?<|>_]{1,2}",
            1 => "[ \\t\\n]{1,4}",
            1 => "[é東京😀\\u{a0}\\u{3000}]{1,3}",
            1 => proptest::sample::select(vec![
                "<|endoftext|>".to_string(), "<|im_start|>".into(), "<|im_end|>".into(), " <|im_end|>".into(),
                "<|im_".into(), " <|".into(),
            ]),
        ],
        0..max_parts,
    )
    .prop_map(|parts| parts.concat())
}

/// Every resume point of `text`, as the builtin tokenizer reports them.
fn points_of(text: &str) -> Vec<Point> {
    let mut points = Points::new((0..text.len()).collect());
    let mut ids = Vec::new();
    Builtin.encode_from(text, 0, &mut ids, &mut points).unwrap();
    let mut found = points.found().to_vec();
    found.dedup();
    found
}

proptest! {
    /// The resume contract (`tokenizer::resume`), for the builtin tokenizer and its
    /// lookahead: a text that agrees up to a point plus the lookahead encodes to the ids
    /// before the point, then its own ids from the point on.
    #[test]
    fn builtin_resume_points_hold_for_any_continuation(t in text(40), tail in text(8)) {
        let whole = Builtin.encode(&t, false).unwrap();
        let lookahead = Builtin.lookahead();
        for point in points_of(&t) {
            prop_assert!(t.is_char_boundary(point.byte));
            if point.byte + lookahead > t.len() || !t.is_char_boundary(point.byte + lookahead) {
                continue;
            }
            let u = format!("{}{tail}", &t[..point.byte + lookahead]);
            let mut resumed = whole[..point.ids].to_vec();
            resumed.extend(Builtin.encode(&u[point.byte..], false).unwrap());
            prop_assert_eq!(Builtin.encode(&u, false).unwrap(), resumed, "{:?} at {}", u, point.byte);
        }
    }

    /// Texts that grow and change like a conversation (each one the last one cut somewhere,
    /// plus new text), some long enough for several chunks: the cache's ids are the
    /// tokenizer's, also while it evicts.
    #[test]
    fn the_cache_gives_the_tokenizers_ids(
        first in text(600),
        turns in proptest::collection::vec((0.0..1.2f64, text(200)), 1..6),
        capacity in prop_oneof![Just(4_000u64), Just(1 << 20)],
        chunk in prop_oneof![Just(32usize), Just(100), Just(1000)],
    ) {
        let cache = PrefixCache::with_chunk(capacity, chunk);
        let mut t = first;
        for (keep, more) in turns {
            prop_assert_eq!(cache.encode(&Builtin, &t, false).unwrap(), Builtin.encode(&t, false).unwrap());
            let mut cut = ((t.len() as f64 * keep) as usize).min(t.len());
            while !t.is_char_boundary(cut) {
                cut -= 1;
            }
            t.truncate(cut);
            t.push_str(&more);
        }
        prop_assert_eq!(cache.encode(&Builtin, &t, true).unwrap(), Builtin.encode(&t, true).unwrap());
    }
}

/// Words, so that a text's length in bytes is easy to reason about.
fn words(n: usize, seed: u64) -> String {
    (0..n).map(|i| format!("w{}x{} ", i as u64 ^ seed, i % 7)).collect()
}

#[test]
fn a_new_turn_is_tokenized_from_where_it_differs() {
    let cache = PrefixCache::new(1 << 20);
    let history = words(3000, 1);
    assert!(history.len() > 4 * PrefixCache::CHUNK);
    cache.encode(&Builtin, &history, false).unwrap();
    assert_eq!(cache.stats().reused_bytes, 0);
    assert_eq!(cache.stats().tokenized_bytes, history.len() as u64);

    let next = format!("{history}and the next question, {}", words(50, 2));
    assert_eq!(cache.encode(&Builtin, &next, false).unwrap(), Builtin.encode(&next, false).unwrap());
    let stats = cache.stats();
    let tokenized = stats.tokenized_bytes - history.len() as u64;
    // Everything up to the last whole chunk of the history (less the lookahead) is reused.
    assert!(
        stats.reused_bytes as usize
            > history.len() / PrefixCache::CHUNK * PrefixCache::CHUNK - 2 * Builtin.lookahead()
    );
    assert!((tokenized as usize) < next.len() - history.len() + PrefixCache::CHUNK + Builtin.lookahead());
    assert_eq!(stats.reused_bytes + tokenized, next.len() as u64);
}

#[test]
fn texts_that_differ_early_share_nothing_later() {
    let cache = PrefixCache::new(1 << 20);
    let a = words(1000, 3);
    cache.encode(&Builtin, &a, false).unwrap();
    // Same bytes after the first one: no key matches, since a key covers the whole beginning.
    let b = format!("W{}", &a[1..]);
    assert_eq!(cache.encode(&Builtin, &b, false).unwrap(), Builtin.encode(&b, false).unwrap());
    assert_eq!(cache.stats().reused_bytes, 0);
    // Special tokens or not: other keys.
    assert_eq!(cache.encode(&Builtin, &a, true).unwrap(), Builtin.encode(&a, true).unwrap());
    assert_eq!(cache.stats().reused_bytes, 0);
    cache.encode(&Builtin, &a, false).unwrap();
    assert!(cache.stats().reused_bytes > 0);
}

#[test]
fn the_cache_stays_within_its_capacity() {
    let cache = PrefixCache::new(64 << 10);
    for seed in 0..64 {
        cache.encode(&Builtin, &words(1000, seed), false).unwrap();
    }
    let stats = cache.stats();
    assert!(stats.weight_bytes <= 64 << 10, "{stats:?}");
    assert!(stats.entries > 0);
}

/// A chunk that ends inside what may become a longer piece (a word, a space before a word
/// or a special token, a special token's first bytes): the text after the chunk decides
/// that piece, so it is not in the chunk's entry.
#[test]
fn a_piece_the_next_chunk_may_extend_is_not_in_the_entry() {
    let filler = words(1000, 5) + "x <|im_end|> y <|im_start|> z";
    for shift in (0..40).chain(filler.len() - PrefixCache::CHUNK - 40..filler.len() - PrefixCache::CHUNK) {
        let chunk = &filler[shift..shift + PrefixCache::CHUNK];
        let cache = PrefixCache::new(1 << 20);
        for tail in [" end.", "tail and more", "<|im_end|> more", "|im_end|>x", "  \n b", "_end|>"] {
            let t = format!("{chunk}{tail}");
            assert_eq!(
                cache.encode(&Builtin, &t, false).unwrap(),
                Builtin.encode(&t, false).unwrap(),
                "{t:?}"
            );
        }
    }
}

/// A whole text's ids come back from the cache the second time, and only for the same text;
/// whole texts and beginnings do not answer for each other.
#[test]
fn whole_texts_are_kept_apart_from_beginnings() {
    let cache = PrefixCache::with_chunk(1 << 20, 8);
    let text = "one whole piece of a prompt, longer than a chunk";
    let calls = std::cell::Cell::new(0);
    let encode = |t: &str| {
        calls.set(calls.get() + 1);
        Builtin.encode(t, false)
    };
    let expected = Builtin.encode(text, false).unwrap();
    assert_eq!(cache.encode_whole(text, encode).unwrap(), expected);
    assert_eq!(cache.encode_whole(text, encode).unwrap(), expected);
    assert_eq!(calls.get(), 1, "the second came from the cache");
    assert_eq!(cache.stats().reused_bytes, text.len() as u64);
    let other = "one whole piece of a prompt, longer than a chunk!";
    assert_eq!(cache.encode_whole(other, encode).unwrap(), Builtin.encode(other, false).unwrap());
    assert_eq!(calls.get(), 2, "another text is encoded");
    // The beginnings of the same text are not taken from the whole text's entry.
    assert_eq!(cache.encode(&Builtin, text, false).unwrap(), expected);
    assert_eq!(cache.stats().reused_bytes, text.len() as u64, "nothing reused for a first beginning");
}
