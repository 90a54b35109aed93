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

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_proto::openai::{Builtin, Tokenizer};
use std::hint::black_box;

/// Words of 3-10 random letters separated by single spaces (splitmix64, fixed seed).
fn words(count: usize) -> String {
    let mut state = 0x1234u64;
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
    group.finish();
}

criterion_group!(benches, bench_builtin);
criterion_main!(benches);
