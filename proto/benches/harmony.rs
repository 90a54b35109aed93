//! A gpt-oss agent conversation (40 turns of a user message, a tool call, its result and an
//! answer, with a tool and a long system prompt), tokenized as vLLM renders it (Harmony)
//! from scratch and through the router's prefix cache, which keeps each text's ids.
//!
//! `KVROUTE_GPT_OSS_TOKENIZER=dir cargo bench -p kvroute-proto --bench harmony`, where `dir`
//! holds a gpt-oss `tokenizer.json` and `tokenizer_config.json` (Hugging Face's
//! `openai/gpt-oss-20b`); without it the bench says so and does nothing.
//!
//! 2026-11-27, with o200k_base converted to a `tokenizer.json` and gpt-oss's special tokens
//! and template: 17 716 tokens; from scratch 22-23 ms (median of 20), through the cache
//! 9-10 ms the first time (texts repeated within the conversation), then 0.23-0.27 ms.

use std::time::{Duration, Instant};

use kvroute_proto::openai::{Endpoint, ParsedRequest, Tokenization, TokenizationConfig, TokenizerSpec};

fn main() {
    let Some(dir) = std::env::var_os("KVROUTE_GPT_OSS_TOKENIZER").map(std::path::PathBuf::from) else {
        println!("harmony: set KVROUTE_GPT_OSS_TOKENIZER to a directory with gpt-oss's tokenizer files");
        return;
    };
    let config = TokenizationConfig {
        base_model: "gpt-oss".into(),
        tokenizer: TokenizerSpec::HuggingFace { path: dir.join("tokenizer.json") },
        tokenizer_config: Some(dir.join("tokenizer_config.json")),
        ..Default::default()
    };
    let mut t = Tokenization::new(&config).unwrap();
    assert!(t.is_harmony());
    let para = "The quick brown fox jumps over the lazy dog while the system keeps a careful log of every step it takes, including tool calls and their results. ";
    let tools = serde_json::json!([{"type": "function", "function": {"name": "shell", "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}, "description": "argv"},
        "workdir": {"type": "string"}, "timeout_ms": {"type": "integer"}}, "required": ["command"]}}}]);
    let mut messages = vec![serde_json::json!({"role": "system", "content": para.repeat(60)})];
    for turn in 0..40 {
        messages
            .push(serde_json::json!({"role": "user", "content": format!("Turn {turn}: {}", para.repeat(4))}));
        messages.push(serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{turn}"), "type": "function",
            "function": {"name": "shell", "arguments": format!("{{\"command\":[\"ls\",\"{turn}\"]}}")}}]}));
        messages.push(serde_json::json!({"role": "tool", "tool_call_id": format!("c{turn}"), "content": para.repeat(6)}));
        messages.push(serde_json::json!({"role": "assistant", "content": para.repeat(2)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "And now?"}));
    let body = serde_json::json!({"model": "gpt-oss", "messages": messages, "tools": tools}).to_string();
    let run = |t: &Tokenization| {
        let request = ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
        let start = Instant::now();
        let ids = t.prompt_tokens(&request).unwrap();
        (start.elapsed(), ids[0].len())
    };
    let median = |t: &Tokenization| {
        let mut times: Vec<Duration> = (0..20).map(|_| run(t).0).collect();
        times.sort();
        times[10]
    };
    let cold = median(&t);
    t.enable_prefix_cache(64 << 20).unwrap();
    let (first, tokens) = run(&t);
    let warm = median(&t);
    println!(
        "harmony: {tokens} tokens ({} bytes): from scratch {cold:?} (median); through the cache {first:?} the \
         first time, then {warm:?} (median)",
        body.len()
    );
}
