//! What reading an Anthropic Messages request costs on top of the chat request it stands
//! for (`cargo bench -p kvroute-proto --features openai --bench messages`): the conversion
//! alone (`Tokenization::readable`, `src/openai/request/anthropic.rs`), and conversion, parse
//! and tokenization together beside the same prompt sent as a chat request.
//!
//! The request is Claude Code's shape at 8 k tokens: a system prompt of text blocks (one of
//! them the per-request billing header), and a user turn of two text blocks, a short
//! reminder and ~4 k tokens of words. Criterion means on the 2-core shared dev machine
//! (2026-11-26, the slower machine of that day's notes), two runs: convert 42.8 and 52.1 µs;
//! messages (convert, parse, tokenize) 208.8 and 408.4 µs against chat (parse, tokenize)
//! 167.0 and 197.9 µs: the first run's gap was the machine's (an ad-hoc loop the same hour,
//! chat timed before and after, found parse and tokenize equal for both and the conversion
//! the only difference, 35.7 µs at the median). Before the conversion kept texts as written
//! and read a well-formed body in one pass, the conversion took 83 µs (ad-hoc, median).
//!
//! The same prompt as a Responses API request (`responses_*`: instructions and one input
//! message of `input_text` parts; `src/openai/request/responses.rs`), 2026-11-26 on the same
//! machine: convert 40.1 µs, convert, parse and tokenize 289.1 µs (chat 182.0 and messages
//! 235.6 in the run just before). The first version escaped the instructions again and
//! grew its output as it went: convert 69.6-86.5, all 386-413 µs in three runs. Profiles of
//! the whole: the tokenizer and serde_json's string scanning (`skip_to_escape`, each read of
//! a raw value scans its strings again: the body's top level, the input's items, each item's
//! fields, then the chat parser's own) are nearly all of it; the chat parse is the same 55-64
//! µs for the converted body as for the chat one (ad-hoc groups, not kept).

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_proto::openai::{Endpoint, ParsedRequest, Tokenization, TokenizationConfig};
use std::hint::black_box;

/// The router's allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `n` words of 3-10 letters (splitmix64 from `seed`).
fn words(n: usize, seed: u64) -> String {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut text = String::with_capacity(n * 8);
    for i in 0..n {
        if i > 0 {
            text.push(' ');
        }
        for _ in 0..3 + next() % 8 {
            text.push((b'a' + (next() % 26) as u8) as char);
        }
    }
    text
}

fn bench(c: &mut Criterion) {
    let t = Tokenization::new(&TokenizationConfig { base_model: "m".into(), ..Default::default() })
        .expect("the builtin tokenizer");
    let (system, user) = (words(4096, 1), words(4096, 2));
    let messages = serde_json::json!({
        "model": "m", "max_tokens": 16,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1;"},
                   {"type": "text", "text": system}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
            {"type": "text", "text": user}]}]
    })
    .to_string();
    let chat = serde_json::json!({
        "model": "m", "max_tokens": 16,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
            {"type": "text", "text": user}]}]
    })
    .to_string();
    let tokens = |endpoint, body: &[u8]| {
        let (endpoint, body) = t.readable(endpoint, body).expect("readable");
        let request = ParsedRequest::parse(endpoint, &body).expect("parses");
        t.prompt_tokens(&request).expect("tokenizes")
    };
    // The same prompt as OpenAI's Responses API sends it: instructions and input items.
    let responses = serde_json::json!({
        "model": "m", "max_output_tokens": 16, "instructions": system,
        "input": [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "<system-reminder>Be brief.</system-reminder>"},
            {"type": "input_text", "text": user}]}]
    })
    .to_string();
    assert_eq!(
        tokens(Endpoint::Messages, messages.as_bytes()),
        tokens(Endpoint::ChatCompletions, chat.as_bytes()),
        "the two requests are one prompt"
    );
    assert_eq!(
        tokens(Endpoint::Responses, responses.as_bytes()),
        tokens(Endpoint::ChatCompletions, chat.as_bytes()),
        "the Responses request is the same prompt"
    );
    let mut group = c.benchmark_group("messages_8k");
    group.bench_function("convert", |b| {
        b.iter(|| t.readable(Endpoint::Messages, black_box(messages.as_bytes())))
    });
    group.bench_function("messages", |b| {
        b.iter(|| tokens(Endpoint::Messages, black_box(messages.as_bytes())))
    });
    group
        .bench_function("chat", |b| b.iter(|| tokens(Endpoint::ChatCompletions, black_box(chat.as_bytes()))));
    group.bench_function("responses_convert", |b| {
        b.iter(|| t.readable(Endpoint::Responses, black_box(responses.as_bytes())))
    });
    group.bench_function("responses", |b| {
        b.iter(|| tokens(Endpoint::Responses, black_box(responses.as_bytes())))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
