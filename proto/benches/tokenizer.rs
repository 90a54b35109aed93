//! Built-in tokenizer throughput on ~30-60 KB of six kinds of text, in bytes per second
//! (`cargo bench -p kvroute-proto --features openai --bench tokenizer`).
//!
//! Plain ASCII text is cut 64 bytes at a time from bit masks; `<`, non-ASCII bytes and words
//! past the 16-character cap go to the general rules (`src/openai/tokenizer/plain.rs`).
//!
//! Each kind takes turns with 32 different texts of its kind ([`ROTATION`], [`varied`]), as
//! a router meets prompts. Tokenizing one text again and again, the CPU learns its branches
//! (which way XXH3 hashes each piece, by its length; where the blocks' loops end) and keeps
//! it in its nearer caches: `words-one-repeated` is `words` measured that way, as every row
//! here was until the rotation. Criterion means, µs a text, the 2-core shared dev machine,
//! one run:
//!
//! | text | bytes | 32 in turn | one repeated (earlier runs) |
//! |---|---|---|---|
//! | words (the decision bench's prompt) | 61 400 | 65.8 | 36.6 (33.2-37.1) |
//! | prose (punctuation, quotes, newlines) | 43 700 | 77.1 | (36.3-38.7) |
//! | code (indentation, brackets) | 30 400 | 58.6 | (41.8-44.6) |
//! | chat (ChatML markup, short turns) | 33 400 | 45.5 | (22.7-24.1) |
//! | cjk | 37 800 | 150.8 | (135.5-140.8) |
//! | mixed (accents, CJK, emoji) | 31 800 | 133.8 | (96.4-99.1) |
//!
//! Since XXH3 of 4-16 byte pieces stopped branching on their length
//! (`src/openai/tokenizer/short_hash.rs`), one run, 32 in turn: words 50.9 (58.1 the same
//! hour before it), prose 65.3, code 55.9, chat 36.5, cjk 135.8, mixed 126.3; one repeated
//! 49.7 (33.6 before: what a CPU learns of one text's branches is gone, and both ways are
//! computed). With a hash that costs nothing (scratch), words take 24.5 µs: the cutting.
//!
//! (The varied texts are not the repeated ones byte for byte: their words have other
//! lengths, so the columns compare kinds, not texts.) About half of the plain-text time on
//! repeated text is the one xxh3 a piece that the tokenizer's spec requires; on unseen text
//! neither a branch-free xxh3 of short pieces nor hashing pieces in batches by XXH3's way
//! made it faster (see `router/benches/decision.rs`).
//!
//! The `prefix_cache` group: the router's cache of texts' beginnings
//! (`src/openai/prefix_cache.rs`), criterion means in µs, 64 MiB cache that has the history
//! (`plain` is one text repeated, and `turn` and `new` change only letters: word lengths
//! repeat, so these flatter the builtin tokenizer as above; the decision bench's `turn` and
//! `new` take turns with 32 texts):
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

/// Texts a kind takes turns with (see the module's doc).
const ROTATION: u64 = 32;

/// `copies` copies of `line`, each different in what decides where pieces fall and how
/// long they are, drawn from `seed`: every run of ASCII letters (outside `<|...|>`) becomes
/// random letters of a random length (1 to twice the run's, at most 16); a line without
/// ASCII letters has its characters shuffled. Spaces, punctuation, digits, markup and other
/// scripts stay: the kind of text stays, and the CPU cannot learn it.
fn varied(line: &str, copies: usize, mut seed: u64) -> String {
    let mut next = || {
        seed = seed.wrapping_add(kvroute_proto::mix::GOLDEN);
        kvroute_proto::mix::mix64(seed)
    };
    let mut out = String::with_capacity(line.len() * copies);
    if !line.bytes().any(|b| b.is_ascii_alphabetic()) {
        let mut chars: Vec<char> = line.chars().collect();
        for _ in 0..copies {
            for i in (1..chars.len()).rev() {
                chars.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            out.extend(&chars);
        }
        return out;
    }
    for _ in 0..copies {
        let mut rest = line;
        while let Some(c) = rest.chars().next() {
            let taken = if rest.starts_with("<|") {
                let end = rest.find("|>").map_or(rest.len(), |e| e + 2);
                out.push_str(&rest[..end]);
                end
            } else if c.is_ascii_alphabetic() {
                let run = rest.find(|ch: char| !ch.is_ascii_alphabetic()).unwrap_or(rest.len());
                for _ in 0..1 + next() % (2 * run as u64).min(16) {
                    out.push(char::from(b'a' + (next() % 26) as u8));
                }
                run
            } else {
                out.push(c);
                c.len_utf8()
            };
            rest = &rest[taken..];
        }
    }
    out
}

/// Each kind of text: [`ROTATION`] texts of it, all different.
fn kinds() -> Vec<(&'static str, Vec<String>)> {
    let lines = [
        (
            "prose",
            "The quick brown fox, who had never seen a router before, asked: \"why do prefixes \
             matter?\" It's simple (mostly); caches love repetition.\n",
        ),
        (
            "code",
            "fn main() {\n    let x = vec![1, 2, 3];\n    for i in &x {\n        println!(\"{}\", i * 2);\n    }\n}\n",
        ),
        (
            "chat",
            "<|im_start|>user\nPlease summarise the following text in three bullet points.<|im_end|>\n\
             <|im_start|>assistant\n",
        ),
        ("cjk", "缓存感知的请求路由器把每个请求发送到已经缓存了最长前缀的副本上，从而减少预填充时间。"),
        ("mixed", "Résumé of naïve café owners in Zürich — ünïcödé everywhere, 数字 12345 and emoji 😀.\n"),
    ];
    let mut kinds = vec![("words", (0..ROTATION).map(|k| words_from(8192, 0x1235 + k)).collect())];
    for (name, line) in lines {
        kinds.push((name, (0..ROTATION).map(|k| varied(line, 300, k)).collect()));
    }
    kinds
}

fn bench_builtin(c: &mut Criterion) {
    let mut group = c.benchmark_group("builtin_tokenizer");
    for (name, texts) in kinds() {
        let bytes: usize = texts.iter().map(String::len).sum();
        group.throughput(Throughput::Bytes((bytes / texts.len()) as u64));
        let mut k = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                k = (k + 1) % texts.len();
                Builtin.encode(black_box(&texts[k]), false)
            })
        });
    }
    // One text again and again, as every row was measured before.
    let text = words(8192);
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.bench_function("words-one-repeated", |b| b.iter(|| Builtin.encode(black_box(&text), false)));
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
