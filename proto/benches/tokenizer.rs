//! Built-in tokenizer throughput on ~30-60 KB of six kinds of text, in bytes per second
//! (`cargo bench -p kvroute-proto --features openai --bench tokenizer`).
//!
//! Plain ASCII text is cut 64 bytes at a time from bit masks; `<`, non-ASCII bytes and words
//! past the 16-character cap go to the general rules (`src/openai/tokenizer/plain.rs`).
//! Measured on the 2-core shared dev machine (µs per text; "before" is the byte-at-a-time
//! scanner the blocks replaced, both run side by side in a scratch harness without the id
//! vector, medians; this benchmark's means, vector included, come out 5-10% higher):
//!
//! | text | bytes | pieces | before | now |
//! |---|---|---|---|---|
//! | words (the decision bench's prompt) | 61 349 | 8 192 | 38.1 | 33.2 |
//! | prose (punctuation, quotes, newlines) | 40 800 | 10 500 | 43.9 | 36.3 |
//! | code (indentation, brackets) | 28 800 | 13 500 | 55.2 | 41.8 |
//! | chat (ChatML markup, short turns) | 32 700 | 5 400 | 22.2 | 22.7-24.2 |
//! | cjk | 37 800 | 1 500 | 131.5 | 135.5 |
//! | mixed (accents, CJK, emoji) | 30 000 | 5 400 | 93.0 | 96.4-97.9 |
//!
//! About half of the plain-text time is the one xxh3 a piece that the tokenizer's spec
//! requires.
//!
//! Every row above tokenizes one text again and again, and the CPU learns its branches
//! (which way XXH3 hashes each piece, by its length; where the blocks' loops end) and keeps
//! the text in its nearer caches: the other kinds of text even repeat one line. `words-32-in-turn` takes 32 texts like
//! `words` in turn, as a router meets prompts: 62.1 µs a text against 37.1 for `words`
//! in the same run (~7.6 against ~4.5 ns a piece). Quote that one for text nobody has
//! seen.
//!
//! The `prefix_cache` group: the router's cache of texts' beginnings
//! (`src/openai/prefix_cache.rs`), criterion means in µs, 64 MiB cache that has the history:
//!
//! | tokenizer, text | plain | turn (history + new ~4 KB turn) | new (never seen) |
//! |---|---|---|---|
//! | builtin, 61 KB of words + turn | 36.7 | 10.7 | 50.6 |
//! | tiny BPE fixture, 24-turn chat (45 KB) + turn | 7 360 | 390 | 6 820 |
//!
//! A miss costs the builtin tokenizer ~14 µs more than tokenizing alone at this size: XXH3
//! over the text (~2.5 µs), 15 entries copied and inserted (~5 µs), and the page faults of
//! memory the evicted entries gave back (~6 µs; in steady state the cache is full). For a
//! `tokenizers` BPE the miss is lost in the tokenizing, and a new turn costs what the turn
//! costs.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_proto::openai::{Builtin, HuggingFace, PrefixCache, Tokenizer};
use std::hint::black_box;

/// The router's allocator, so that allocating the id vectors costs what it costs there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Words of 3-10 random letters separated by single spaces (splitmix64, fixed seed).
fn words(count: usize) -> String {
    words_from(count, 0x1234)
}

/// [`words`] from seed `state`.
fn words_from(count: usize, mut state: u64) -> String {
    let mut next = || {
        state = state.wrapping_add(kvroute_proto::mix::GOLDEN);
        kvroute_proto::mix::mix64(state)
    };
    let mut text = String::new();
    for i in 0..count {
        if i > 0 {
            text.push(' ');
        }
        for _ in 0..3 + next() % 8 {
            text.push(char::from(b'a' + (next() % 26) as u8));
        }
    }
    text
}

fn texts() -> Vec<(&'static str, String)> {
    vec![
        ("words", words(8192)),
        (
            "prose",
            "The quick brown fox, who had never seen a router before, asked: \"why do prefixes \
             matter?\" It's simple (mostly); caches love repetition.\n"
                .repeat(300),
        ),
        (
            "code",
            "fn main() {\n    let x = vec![1, 2, 3];\n    for i in &x {\n        println!(\"{}\", i * 2);\n    }\n}\n"
                .repeat(300),
        ),
        (
            "chat",
            "<|im_start|>user\nPlease summarise the following text in three bullet points.<|im_end|>\n\
             <|im_start|>assistant\n"
                .repeat(300),
        ),
        ("cjk", "缓存感知的请求路由器把每个请求发送到已经缓存了最长前缀的副本上，从而减少预填充时间。".repeat(300)),
        (
            "mixed",
            "Résumé of naïve café owners in Zürich — ünïcödé everywhere, 数字 12345 and emoji 😀.\n".repeat(300),
        ),
    ]
}

fn bench_builtin(c: &mut Criterion) {
    let mut group = c.benchmark_group("builtin_tokenizer");
    for (name, text) in texts() {
        group.throughput(Throughput::Bytes(text.len() as u64));
        group.bench_function(name, |b| b.iter(|| Builtin.encode(black_box(&text), false)));
    }
    // The CPU learns one text's branches when it is tokenized again and again; 32 texts
    // taken in turn it does not (see the module's doc). None of them is `words`' text.
    let rotation: Vec<String> = (0..32).map(|k| words_from(8192, 0x1235 + k)).collect();
    let bytes: usize = rotation.iter().map(String::len).sum();
    group.throughput(Throughput::Bytes((bytes / rotation.len()) as u64));
    let mut k = 0;
    group.bench_function("words-32-in-turn", |b| {
        b.iter(|| {
            k = (k + 1) % rotation.len();
            Builtin.encode(black_box(&rotation[k]), false)
        })
    });
    group.finish();
}

/// The prefix cache (64 MiB, the router's default) on texts that change before every call:
/// `turn` is a long history the cache has seen and a new ~4 KB turn; `new` is a text the
/// cache has never seen (its first 40 bytes change), inserts included; `plain` is the
/// tokenizer alone. For the builtin tokenizer on the decision bench's words, and for the
/// 400-token byte-level BPE fixture (`tests/data/tiny-tokenizer.json`, through `tokenizers`)
/// on a chat of 24 turns, where turns end in added tokens.
fn bench_prefix_cache(c: &mut Criterion) {
    let hf = HuggingFace::from_file(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tiny-tokenizer.json"))
        .expect("fixture");
    let chat: String = (0..24)
        .map(|i| {
            format!(
                "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>",
                if i % 2 == 0 { "user" } else { "assistant" },
                words(150 + i * 7)
            )
        })
        .collect();
    let mut group = c.benchmark_group("prefix_cache");
    for (name, tokenizer, history) in
        [("builtin", &Builtin as &dyn Tokenizer, words(7680)), ("hf-tiny", &hf as &dyn Tokenizer, chat)]
    {
        let turn = format!("<|start_header_id|>user<|end_header_id|>\n\n{}", words(512));
        let resume = tokenizer.resume().expect("resumes");
        let cache = PrefixCache::new(64 << 20);
        cache.encode(resume, &history, false).expect("encodes");
        let mut n = 0u64;
        let mut changed = |text: &str, at: usize| {
            n += 1;
            let mut text = text.to_owned().into_bytes();
            for (i, b) in text[at..at + 40].iter_mut().enumerate() {
                if b.is_ascii_lowercase() {
                    *b = b'a' + (kvroute_proto::mix::mix64(n * 64 + i as u64) % 26) as u8;
                }
            }
            String::from_utf8(text).expect("ASCII letters for ASCII letters")
        };
        let whole = format!("{history}{turn}");
        group.throughput(Throughput::Bytes(whole.len() as u64));
        group.bench_function(format!("{name}/plain"), |b| {
            b.iter(|| tokenizer.encode(black_box(&whole), false))
        });
        group.bench_function(format!("{name}/turn"), |b| {
            b.iter_batched_ref(
                || changed(&whole, whole.len() - 200),
                |text| cache.encode(resume, text, false),
                BatchSize::SmallInput,
            )
        });
        // The first message's words (not a header's special tokens).
        let words_at = if name == "builtin" { 0 } else { whole.find("\n\n").expect("a header") + 2 };
        group.bench_function(format!("{name}/new"), |b| {
            b.iter_batched_ref(
                || changed(&whole, words_at),
                |text| cache.encode(resume, text, false),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, bench_builtin, bench_prefix_cache);
criterion_main!(benches);
