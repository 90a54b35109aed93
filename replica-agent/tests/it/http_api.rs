//! The OpenAI-compatible HTTP API against a real engine and publisher.
//!
//! Tests run on tokio's current-thread runtime, so the engine's scheduler, the server and
//! the client interleave only at `.await` points: a response that has been read implies
//! the scheduler step that produced it has completed, metrics included.

use std::collections::BTreeMap;

use http_body_util::BodyExt;
use hyper::body::Body as _;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::client::{Reply, collect, sse_events};
use crate::support::shape::{self, Usage};
use crate::support::{ADAPTER, Agent, Client, MODEL, config, until};

/// `n` distinct words (one builtin-tokenizer token each), different for each `seed`.
pub(crate) fn words(n: usize, seed: u32) -> String {
    (0..n).map(|i| format!("w{seed}x{i}")).collect::<Vec<_>>().join(" ")
}

/// The seed-000 hit of a repeated prompt of `len` tokens: every full block, capped at `len`.
fn full_block_hit(len: u64, block_size: u64) -> u64 {
    ((len / block_size) * block_size).min(len)
}

async fn completion(client: &Client, body: &Value) -> (Vec<String>, Usage) {
    let reply = client.post("/v1/completions", body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let n = body["prompt"].as_array().filter(|p| p.iter().all(|x| !x.is_u64())).map_or(1, Vec::len);
    shape::completion(&reply.json(), n)
}

async fn completion_n(client: &Client, body: &Value, choices: usize) -> (Vec<String>, Usage) {
    let reply = client.post("/v1/completions", body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    shape::completion(&reply.json(), choices)
}

async fn chat(client: &Client, body: &Value) -> (String, Usage) {
    let reply = client.post("/v1/chat/completions", body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.headers["content-type"], "application/json");
    shape::chat_completion(&reply.json())
}

async fn stream(client: &Client, path: &str, body: &Value) -> Vec<String> {
    let reply = client.post(path, body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.headers["content-type"], "text/event-stream");
    sse_events(&reply.body)
}

#[tokio::test]
async fn repeated_prompt_reports_seed000_cached_tokens() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let block_size = u64::from(agent.config.block_size);
    let prompt = words(37, 1);
    let len = c.tokenize(&json!({ "prompt": prompt })).await.len() as u64;
    let expected = full_block_hit(len, block_size);
    assert!(expected > 0 && expected < len, "the prompt ends in a partial block ({len} tokens)");

    let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 3 });
    let (_, first) = completion(c, &body).await;
    assert_eq!(first, Usage { prompt_tokens: len, completion_tokens: 3, cached_tokens: 0 });
    let (_, second) = completion(c, &body).await;
    assert_eq!(second, Usage { prompt_tokens: len, completion_tokens: 3, cached_tokens: expected });

    // Chat: the rendered conversation is the prompt.
    let messages = json!([{ "role": "user", "content": words(50, 2) }]);
    let len = c.tokenize(&json!({ "messages": messages })).await.len() as u64;
    let body = json!({ "model": MODEL, "messages": messages, "max_tokens": 2 });
    let (_, first) = chat(c, &body).await;
    assert_eq!((first.prompt_tokens, first.cached_tokens), (len, 0));
    let (_, second) = chat(c, &body).await;
    assert_eq!((second.prompt_tokens, second.cached_tokens), (len, full_block_hit(len, block_size)));
}

#[tokio::test]
async fn tokenize_returns_the_ids_generation_uses() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let block_size = u64::from(agent.config.block_size);

    // A text prompt, then the ids /tokenize gave for it: a full-block hit means same ids.
    let prompt = words(30, 3);
    let ids = c.tokenize(&json!({ "model": MODEL, "prompt": prompt })).await;
    let (_, first) = completion(c, &json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1 })).await;
    assert_eq!(first.prompt_tokens, ids.len() as u64);
    let (_, by_ids) = completion(c, &json!({ "model": MODEL, "prompt": ids, "max_tokens": 1 })).await;
    assert_eq!(by_ids.prompt_tokens, ids.len() as u64);
    assert_eq!(by_ids.cached_tokens, full_block_hit(ids.len() as u64, block_size));

    // The same for chat: the rendered conversation's ids, replayed as a completion prompt.
    let messages = json!([
        { "role": "system", "content": "You are terse." },
        { "role": "user", "content": words(20, 4) },
    ]);
    let ids = c.tokenize(&json!({ "messages": messages })).await;
    let (_, first) = chat(c, &json!({ "model": MODEL, "messages": messages, "max_tokens": 1 })).await;
    assert_eq!(first.prompt_tokens, ids.len() as u64);
    let (_, by_ids) = completion(c, &json!({ "model": MODEL, "prompt": ids, "max_tokens": 1 })).await;
    assert_eq!(by_ids.cached_tokens, full_block_hit(ids.len() as u64, block_size));

    // An empty prompt has no ids (what a router asks to learn the ids the tokenizer adds).
    assert_eq!(c.tokenize(&json!({ "prompt": "", "add_special_tokens": true })).await, Vec::<u32>::new());

    // Token-id prompts come back unchanged.
    assert_eq!(c.tokenize(&json!({ "prompt": [5, 17, 400] })).await, vec![5, 17, 400]);
    assert_eq!(c.tokenize(&json!({ "model": null, "prompt": [5] })).await, vec![5]);
    assert_eq!(c.tokenize(&json!({ "model": ADAPTER, "prompt": [6] })).await, vec![6]);
}

/// `POST /detokenize`, as vLLM's: a tokenizer file's ids come back as their text; the
/// built-in tokenizer (which hashes words) says it cannot, where the path used to be a 404
/// (the router sends `/detokenize` to a replica).
#[tokio::test]
async fn detokenize_gives_the_text_of_ids() {
    let builtin = Agent::start().await;
    let reply = builtin.client.post("/detokenize", &json!({ "tokens": [5, 17] })).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert!(reply.text().contains("--tokenizer"), "{}", reply.text());

    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/tests/data");
    let agent = Agent::with(kvroute_replica_agent::Config {
        tokenizer: Some(data.join("tiny-tokenizer.json")),
        ..config()
    })
    .await;
    let c = &agent.client;
    let ids = c.tokenize(&json!({ "prompt": "Hello, world!", "add_special_tokens": false })).await;
    let reply = c.post("/detokenize", &json!({ "model": MODEL, "tokens": ids })).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.json(), json!({ "prompt": "Hello, world!" }));
    for (bad, status) in [
        (json!({ "tokens": [1 << 30] }), StatusCode::BAD_REQUEST),
        (json!({ "tokens": "x" }), StatusCode::BAD_REQUEST),
        (json!({ "model": "nope", "tokens": [1] }), StatusCode::NOT_FOUND),
    ] {
        assert_eq!(c.post("/detokenize", &bad).await.status, status, "{bad}");
    }
}

/// With `--api-key`, as vLLM: `/v1/*` needs the bearer key (vLLM's 401 otherwise, its
/// body too); health, metrics and tokenize stay open.
#[tokio::test]
async fn an_api_key_guards_the_v1_paths() {
    let agent = Agent::with(kvroute_replica_agent::Config { api_key: Some("k3y".into()), ..config() }).await;
    let c = &agent.client;
    let body = serde_json::to_vec(&json!({ "model": MODEL, "prompt": "hi", "max_tokens": 1 })).unwrap();
    for (headers, status) in [
        (&[][..], StatusCode::UNAUTHORIZED),
        (&[("authorization", "Bearer k3yy")][..], StatusCode::UNAUTHORIZED),
        (&[("authorization", "Bearer k3x")][..], StatusCode::UNAUTHORIZED),
        (&[("authorization", "Bearer k3y")][..], StatusCode::OK),
    ] {
        let reply = collect(c.send(Method::POST, "/v1/completions", body.clone(), headers).await).await;
        assert_eq!(reply.status, status, "{headers:?}: {}", reply.text());
        if status == StatusCode::UNAUTHORIZED {
            assert_eq!(reply.json(), json!({"error": "Unauthorized"}));
        }
    }
    assert_eq!(c.get("/v1/models").await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(c.get("/health").await.status, StatusCode::OK);
    assert_eq!(c.get("/metrics").await.status, StatusCode::OK);
    assert_eq!(c.post("/tokenize", &json!({ "prompt": "hi" })).await.status, StatusCode::OK);
}

/// CORS as vLLM's defaults have it: a browser's preflight is answered (before the API key
/// is asked for), and an answer to another origin says any origin may read it.
#[tokio::test]
async fn browsers_may_call_from_any_origin() {
    let agent = Agent::with(kvroute_replica_agent::Config { api_key: Some("k3y".into()), ..config() }).await;
    let c = &agent.client;
    let preflight = [
        ("origin", "https://app.example"),
        ("access-control-request-method", "POST"),
        ("access-control-request-headers", "authorization,content-type"),
    ];
    let reply = collect(c.send(Method::OPTIONS, "/v1/chat/completions", Vec::new(), &preflight).await).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let header = |reply: &Reply, name: &str| reply.headers.get(name).map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(header(&reply, "access-control-allow-origin").as_deref(), Some("*"));
    assert_eq!(header(&reply, "access-control-allow-headers").as_deref(), Some("authorization,content-type"));
    assert!(header(&reply, "access-control-allow-methods").unwrap().contains("POST"));
    // Not a preflight without the method asked for: the route's own answer.
    let plain =
        collect(c.send(Method::OPTIONS, "/v1/chat/completions", Vec::new(), &preflight[..1]).await).await;
    assert_ne!(plain.status, StatusCode::OK);
    let body = serde_json::to_vec(&json!({ "model": MODEL, "prompt": "hi", "max_tokens": 1 })).unwrap();
    let headers = [("authorization", "Bearer k3y"), ("origin", "https://app.example")];
    let reply = collect(c.send(Method::POST, "/v1/completions", body.clone(), &headers).await).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(header(&reply, "access-control-allow-origin").as_deref(), Some("*"));
    let same_origin = collect(c.send(Method::POST, "/v1/completions", body, &headers[..1]).await).await;
    assert_eq!(header(&same_origin, "access-control-allow-origin"), None);
}

#[tokio::test]
async fn lora_adapter_prompts_live_in_their_own_namespace() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let prompt = words(24, 5);
    completion(c, &json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1 })).await;
    let (_, adapter) = completion(c, &json!({ "model": ADAPTER, "prompt": prompt, "max_tokens": 1 })).await;
    assert_eq!(adapter.cached_tokens, 0, "the base model's blocks are not the adapter's");
    let (_, again) = completion(c, &json!({ "model": ADAPTER, "prompt": prompt, "max_tokens": 1 })).await;
    assert!(again.cached_tokens > 0);
}

#[tokio::test]
async fn non_streaming_responses_have_openai_shape() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let body = json!({ "model": MODEL, "prompt": [words(9, 6), words(13, 7)], "max_tokens": 4 });
    let (texts, usage) = completion(c, &body).await;
    assert!(texts.iter().all(|t| !t.is_empty()));
    assert_eq!(usage.completion_tokens, 8, "4 tokens for each of 2 prompts");

    let body = json!({ "model": MODEL, "prompt": [[20, 21, 22, 23, 24], [30, 31]], "max_tokens": 2 });
    let (_, usage) = completion(c, &body).await;
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (7, 4));

    // Without max_tokens: the configured default.
    let (_, usage) = completion(c, &json!({ "model": MODEL, "prompt": "hello there" })).await;
    assert_eq!(usage.completion_tokens, u64::from(agent.config.default_max_tokens));
    // An explicit null drops a completion's default: what the context leaves (505 + 7 of 512
    // here), generated up to the agent's default.
    let body = json!({ "model": MODEL, "prompt": words(505, 15), "max_tokens": null });
    let (_, usage) = completion(c, &body).await;
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (505, 7));
    // A chat without a limit may ask `min_tokens` up to what the context leaves, as in vLLM,
    // and gets at least that many.
    let body =
        json!({ "model": MODEL, "messages": [{ "role": "user", "content": "hi" }], "min_tokens": 100 });
    let (_, usage) = chat(c, &body).await;
    assert_eq!(usage.completion_tokens, 100);
    // The last of repeated keys counts, as Python reads JSON: here a null, so no default.
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":{},"max_tokens":5,"max_tokens":null}}"#,
        json!(words(505, 15))
    );
    let reply = c.request(hyper::Method::POST, "/v1/completions", body.into_bytes()).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());

    let body = json!({
        "model": MODEL,
        "messages": [{ "role": "user", "content": [{ "type": "text", "text": "hi" }] }],
        "max_completion_tokens": 5,
    });
    let (content, usage) = chat(c, &body).await;
    assert!(!content.is_empty());
    assert_eq!(usage.completion_tokens, 5);
}

#[tokio::test]
async fn streaming_responses_have_openai_shape_and_match_non_streaming() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let prompts = json!([words(11, 8), words(6, 9)]);
    let (texts, _) = completion(c, &json!({ "model": MODEL, "prompt": prompts, "max_tokens": 5 })).await;
    let messages = json!([{ "role": "user", "content": words(7, 10) }]);
    let (content, _) = chat(c, &json!({ "model": MODEL, "messages": messages, "max_tokens": 6 })).await;

    for include_usage in [false, true] {
        let mut body = json!({ "model": MODEL, "prompt": prompts, "max_tokens": 5, "stream": true });
        if include_usage {
            body["stream_options"] = json!({ "include_usage": true });
        }
        let events = stream(c, "/v1/completions", &body).await;
        let (streamed, usage) = shape::completion_stream(&events, 2, include_usage);
        assert_eq!(streamed, texts, "generation is deterministic for a prompt");
        if let Some(usage) = usage {
            assert_eq!(usage.completion_tokens, 10);
            assert!(usage.cached_tokens > 0, "the prompts were seen before: {usage:?}");
        }

        let mut body = json!({ "model": MODEL, "messages": messages, "max_tokens": 6, "stream": true });
        if include_usage {
            body["stream_options"] = json!({ "include_usage": true });
        }
        let events = stream(c, "/v1/chat/completions", &body).await;
        let (streamed, usage) = shape::chat_stream(&events, include_usage);
        assert_eq!(streamed, content);
        assert_eq!(usage.is_some(), include_usage);
        // One role chunk, six token chunks, the usage chunk, [DONE].
        assert_eq!(events.len(), 1 + 6 + usize::from(include_usage) + 1);
    }

    // As in vLLM, a `stream_options` object asks for usage unless it says otherwise, and an
    // empty one may come without `stream`.
    let lax = [(json!({ "include_usage": "yes" }), true), (json!({ "include_usage": 0 }), false)];
    for (options, usage) in
        [(json!({}), true), (json!({ "include_usage": null }), false)].into_iter().chain(lax)
    {
        let body = json!({ "model": MODEL, "messages": messages, "max_tokens": 6, "stream": true, "stream_options": options });
        let events = stream(c, "/v1/chat/completions", &body).await;
        assert_eq!(shape::chat_stream(&events, usage).1.is_some(), usage, "{options}");
    }
    let body = json!({ "model": MODEL, "messages": messages, "max_tokens": 6, "stream_options": {} });
    assert_eq!(chat(c, &body).await.0, content);
}

/// `stream_options.continuous_usage_stats` (with `include_usage`), as vLLM serves it: every
/// chunk carries its choice's usage so far, its prompt's tokens and the tokens it has
/// generated (a chat's role chunk none yet); the last chunk has the whole request's.
#[tokio::test]
async fn continuous_usage_stats_put_each_choices_usage_on_every_chunk() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let prompts = [words(11, 8), words(6, 9)];
    let mut lens = Vec::new();
    for p in &prompts {
        lens.push(c.tokenize(&json!({ "prompt": p })).await.len() as u64);
    }
    let continuous = json!({ "include_usage": true, "continuous_usage_stats": true });
    let body = json!({ "model": MODEL, "prompt": prompts, "max_tokens": 5, "stream": true, "stream_options": continuous });
    let events = stream(c, "/v1/completions", &body).await;
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let (last, chunks) = chunks.split_last().unwrap();
    let mut generated = [0, 0];
    for chunk in chunks {
        let i = chunk["choices"][0]["index"].as_u64().unwrap() as usize;
        generated[i] += 1;
        let usage = &chunk["usage"];
        assert_eq!(usage["prompt_tokens"], lens[i], "{chunk}");
        assert_eq!(usage["completion_tokens"], generated[i], "{chunk}");
        assert_eq!(usage["total_tokens"], lens[i] + generated[i], "{chunk}");
        assert!(usage.get("prompt_tokens_details").is_none(), "as vLLM leaves it unset: {chunk}");
    }
    assert_eq!(generated, [5, 5]);
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 10);

    let messages = json!([{ "role": "user", "content": words(7, 10) }]);
    let body = json!({ "model": MODEL, "messages": messages, "max_tokens": 6, "stream": true, "stream_options": continuous });
    let events = stream(c, "/v1/chat/completions", &body).await;
    let completion_tokens: Vec<Value> = events[..events.len() - 2]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["usage"]["completion_tokens"].clone())
        .collect();
    assert_eq!(
        completion_tokens,
        (0..=6).map(Value::from).collect::<Vec<_>>(),
        "the role chunk, then a token each"
    );

    // Without `include_usage` there is no usage to report, however often.
    let options = json!({ "include_usage": false, "continuous_usage_stats": true });
    let body = json!({ "model": MODEL, "messages": messages, "max_tokens": 6, "stream": true, "stream_options": options });
    assert_eq!(shape::chat_stream(&stream(c, "/v1/chat/completions", &body).await, false).1, None);
    for options in [
        json!({ "continuous_usage_stats": [] }),
        json!({ "include_usage": false, "continuous_usage_stats": [] }),
    ] {
        let body = json!({ "model": MODEL, "messages": messages, "max_tokens": 6, "stream": true, "stream_options": options });
        let reply = c.post("/v1/chat/completions", &body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{options}: {}", reply.text());
        assert!(reply.text().contains("continuous_usage_stats"), "{}", reply.text());
    }
}

/// `n` choices a prompt, as vLLM runs them: one engine request each, numbered
/// `prompt * n + choice`, each with its own text; the prompt counted once, and one choice's
/// cached tokens: the later choices find the prompt's blocks cached by the first.
#[tokio::test]
async fn n_choices_a_prompt_are_generated_and_counted_as_vllm_counts_them() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let block_size = u64::from(agent.config.block_size);
    let prompts = [words(37, 40), words(21, 41)];
    let mut lens = Vec::new();
    for p in &prompts {
        lens.push(c.tokenize(&json!({ "prompt": p })).await.len() as u64);
    }
    let body = json!({ "model": MODEL, "prompt": prompts, "max_tokens": 3, "n": 3 });
    let (texts, usage) = completion_n(c, &body, 6).await;
    assert_eq!(usage.prompt_tokens, lens.iter().sum::<u64>(), "each prompt once");
    assert_eq!(usage.completion_tokens, 18);
    // One choice's, as vLLM reports it: the last prompt's last, which found it cached.
    assert_eq!(usage.cached_tokens, full_block_hit(lens[1], block_size));
    let (single, _) = completion(c, &json!({ "model": MODEL, "prompt": prompts, "max_tokens": 3 })).await;
    assert_eq!([&texts[0], &texts[3]], [&single[0], &single[1]], "each prompt's first choice is n = 1's");
    assert!(texts[0] != texts[1] && texts[1] != texts[2], "{texts:?}");

    let messages = json!([{ "role": "user", "content": words(30, 42) }]);
    let body = json!({ "model": MODEL, "messages": messages, "max_tokens": 4, "n": 2, "temperature": 0.7 });
    let reply = c.post("/v1/chat/completions", &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let (contents, usage) = shape::chat_completion_n(&reply.json(), 2);
    assert_ne!(contents[0], contents[1]);
    assert_eq!(usage.completion_tokens, 8);
    // A repeated key's last value counts, as with vLLM's `json.loads`: sampled, so n = 2 may.
    let repeated = format!(
        r#"{{"model":"{MODEL}","messages":{messages},"max_tokens":4,"n":2,"temperature":0,"temperature":0.7}}"#
    );
    let reply = collect(c.send(Method::POST, "/v1/chat/completions", repeated.into_bytes(), &[]).await).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(shape::chat_completion_n(&reply.json(), 2).0, contents);

    let mut body = json!({ "model": MODEL, "messages": messages, "max_tokens": 4, "n": 2, "stream": true });
    body["stream_options"] = json!({ "include_usage": true });
    let events = stream(c, "/v1/chat/completions", &body).await;
    let (streamed, usage) = shape::chat_stream_n(&events, 2, true);
    assert_eq!(streamed, contents, "a stream's choices are the same texts");
    let usage = usage.unwrap();
    assert_eq!(usage.completion_tokens, 8);
    assert!(usage.cached_tokens > 0 && usage.cached_tokens < usage.prompt_tokens, "{usage:?}");

    let body = json!({ "model": MODEL, "prompt": prompts[0], "max_tokens": 2, "n": 2, "stream": true });
    let events = stream(c, "/v1/completions", &body).await;
    let (streamed, _) = shape::completion_stream(&events, 2, false);
    assert!(streamed.iter().all(|t| !t.is_empty()) && streamed[0] != streamed[1], "{streamed:?}");
}

/// Reads frames until one carries data.
async fn next_data(body: &mut hyper::body::Incoming) -> bytes::Bytes {
    loop {
        let frame = body.frame().await.expect("the stream is still open").expect("frame");
        if let Ok(data) = frame.into_data() {
            return data;
        }
    }
}

/// A Prometheus text page as `name{labels}` → value, checking the format on the way:
/// every sample has a `# TYPE`, counters end in `_total`, every sample names the model and
/// the engine (the only one: `engine="0"`), as vLLM labels them.
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut types = BTreeMap::new();
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            assert!(["counter", "gauge"].contains(&kind), "{line}");
            types.insert(name.to_owned(), kind.to_owned());
        } else if line.starts_with("# HELP ") {
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample {line:?}"));
            let name = series.split('{').next().expect("name");
            let kind = types.get(name).unwrap_or_else(|| panic!("{name} has no # TYPE"));
            assert_eq!(kind == "counter", name.ends_with("_total"), "{line}");
            // (The process's own metrics have no labels, as Prometheus' Python client writes them.)
            if !name.starts_with("process_") {
                assert!(series.contains(&format!("{{model_name=\"{MODEL}\",engine=\"0\"")), "{line}");
            }
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
            samples.insert(name.to_owned(), value);
        }
    }
    samples
}

pub(crate) async fn metrics(client: &Client) -> BTreeMap<String, f64> {
    let reply = client.get("/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.headers["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    parse_metrics(&reply.text())
}

#[tokio::test]
async fn stream_chunks_arrive_while_the_engine_is_generating() {
    // Real time: 400 decode steps of at least 6 ms each.
    let agent = Agent::with(kvroute_replica_agent::Config { time_scale: 1.0, ..config() }).await;
    let c = &agent.client;
    let body = json!({ "model": MODEL, "prompt": words(10, 11), "max_tokens": 400, "stream": true });
    let response = c.send(Method::POST, "/v1/completions", serde_json::to_vec(&body).unwrap(), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = next_data(&mut body).await;
    let first = sse_events(&first);
    assert_eq!(first.len(), 1);
    let chunk: Value = serde_json::from_str(&first[0]).unwrap();
    assert_eq!(chunk["choices"][0]["finish_reason"], Value::Null, "the first of 400 tokens");
    assert!(!body.is_end_stream());

    // The request is still running: the chunk was flushed mid-generation.
    let m = metrics(c).await;
    assert_eq!(m["vllm:num_requests_running"], 1.0);
    let held = m["kvroute_agent_resident_blocks"];
    assert!(held > 0.0);
    assert_eq!(
        m["vllm:kv_cache_usage_perc"],
        held / agent.config.capacity_blocks as f64,
        "its blocks are used"
    );
    // Its blocks are pinned, so the cache cannot be reset now.
    let reply = c.request(Method::POST, "/reset_prefix_cache", "").await;
    assert_eq!(reply.status, StatusCode::CONFLICT);
    assert_eq!(shape::error(&reply.json()).2.as_deref(), Some("cache_busy"));
}

/// A streamed answer's first two data frames, as text.
async fn first_two_frames(c: &Client, path: &str, body: Value) -> (String, String) {
    let response = c.send(Method::POST, path, serde_json::to_vec(&body).unwrap(), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut frame = async || String::from_utf8(next_data(&mut body).await.to_vec()).unwrap();
    (frame().await, frame().await)
}

/// The `event:` names in `frame`, in order.
fn event_names(frame: &str) -> Vec<&str> {
    frame.lines().filter_map(|line| line.strip_prefix("event: ")).collect()
}

/// A stream's events come with the engine's first token, as vLLM sends them, so that a
/// proxy timing a stream's first event times its queueing and prefill: the chat role chunk
/// comes with the first token, as Anthropic's `message_start` does; a Responses stream's
/// `response.created` and `response.in_progress` come at once (vLLM sends them before it
/// reads the engine), its message item with the first token.
#[tokio::test]
async fn a_streams_opening_comes_with_its_first_token() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let messages = json!([{"role": "user", "content": "hello there"}]);

    let chat = json!({ "model": MODEL, "messages": messages, "max_tokens": 3, "stream": true });
    let (first, _) = first_two_frames(c, "/v1/chat/completions", chat).await;
    let chunks: Vec<Value> =
        sse_events(first.as_bytes()).iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks.len(), 2, "{first}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[1]["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty()), "{first}");

    let anthropic = json!({ "model": MODEL, "messages": messages, "max_tokens": 3, "stream": true });
    let (first, _) = first_two_frames(c, "/v1/messages", anthropic).await;
    assert_eq!(event_names(&first), ["message_start", "content_block_start", "content_block_delta"]);

    let responses = json!({ "model": MODEL, "input": "hello there", "max_output_tokens": 3, "stream": true });
    let (first, second) = first_two_frames(c, "/v1/responses", responses).await;
    assert_eq!(event_names(&first), ["response.created", "response.in_progress"]);
    let output = ["response.output_item.added", "response.content_part.added", "response.output_text.delta"];
    assert_eq!(event_names(&second), output);
}

#[tokio::test]
async fn metrics_parse_and_prefix_cache_counters_move() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let before = metrics(c).await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "kvroute_agent_events_published_total",
        "kvroute_agent_steps_total",
        "kvroute_agent_pending_prefill_tokens",
    ] {
        assert!(before.contains_key(name), "{name} missing");
    }
    // When it started, in Unix seconds: after 2020, and not yet to come.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let started = before["process_start_time_seconds"];
    assert!((1.6e9..=now).contains(&started), "{started}");
    // The KV cache's size, as vLLM says it (and routers read it).
    let page = c.get("/metrics").await.text();
    let info = page.lines().find(|l| l.starts_with("vllm:cache_config_info{")).expect("cache_config_info");
    let (blocks, size) = (agent.config.capacity_blocks, agent.config.block_size);
    assert!(info.contains(&format!("block_size=\"{size}\"")), "{info}");
    assert!(info.contains(&format!("num_gpu_blocks=\"{blocks}\"")) && info.ends_with("} 1"), "{info}");
    let prompt = words(21, 12);
    let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 3 });
    let (_, first) = completion(c, &body).await;
    let (_, second) = completion(c, &body).await;
    let after = metrics(c).await;
    let delta = |name: &str| after[name] - before[name];
    let len = first.prompt_tokens as f64;
    assert_eq!(delta("vllm:prefix_cache_queries_total"), 2.0 * len);
    assert_eq!(delta("vllm:prefix_cache_hits_total"), second.cached_tokens as f64);
    assert_eq!(delta("vllm:prompt_tokens_total"), 2.0 * len);
    assert_eq!(delta("vllm:generation_tokens_total"), 6.0);
    assert_eq!(delta("vllm:request_success_total"), 2.0);
    assert!(delta("kvroute_agent_events_published_total") >= 1.0, "the first request stored blocks");
    let resident = (len as u64 / u64::from(agent.config.block_size)) as f64;
    assert_eq!(after["kvroute_agent_resident_blocks"], resident);
    assert_eq!(after["vllm:num_requests_running"], 0.0);
    // As vLLM's: cached blocks no request holds are free (evictable), not used.
    assert_eq!(after["vllm:kv_cache_usage_perc"], 0.0);
}

#[tokio::test]
async fn reset_prefix_cache_makes_the_next_repeat_miss() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let body = json!({ "model": MODEL, "prompt": words(17, 13), "max_tokens": 1 });
    completion(c, &body).await;
    assert!(completion(c, &body).await.1.cached_tokens > 0);
    let reply = c.request(Method::POST, "/reset_prefix_cache", "").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert!(reply.body.is_empty());
    assert_eq!(completion(c, &body).await.1.cached_tokens, 0);
    assert!(completion(c, &body).await.1.cached_tokens > 0);
}

/// One malformed request and what it must get.
struct Bad {
    method: Method,
    path: &'static str,
    body: Vec<u8>,
    status: StatusCode,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

fn bad(method: Method, path: &'static str, body: impl Into<Vec<u8>>, status: u16) -> Bad {
    Bad {
        method,
        path,
        body: body.into(),
        status: StatusCode::from_u16(status).unwrap(),
        param: None,
        code: None,
    }
}

impl Bad {
    fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }
    fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
}

fn json_bytes(v: Value) -> Vec<u8> {
    serde_json::to_vec(&v).unwrap()
}

#[tokio::test]
async fn malformed_requests_get_openai_errors() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let post = Method::POST;
    let cmpl = "/v1/completions";
    let chat = "/v1/chat/completions";
    let long = words(600, 14);
    let cases = [
        bad(post.clone(), cmpl, "{not json", 400),
        bad(post.clone(), cmpl, "[1, 2]", 400),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL })), 400)
            .param("prompt")
            .code("missing_required_parameter"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": { "a": 1 } })), 400).param("prompt"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "max_tokens": "five" })), 400)
            .param("max_tokens"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "max_tokens": 0 })), 400)
            .param("max_tokens"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "n": 0 })), 400),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "n": 16385 })), 400),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": ["a", "b"], "n": 5000 })), 400),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "n": "two" })), 400).param("n"),
        // A priority under first-come-first-served scheduling (the default), as vLLM refuses it.
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "priority": 1 })), 400),
        bad(post.clone(), chat, json_bytes(json!({ "model": MODEL, "messages": [{ "role": "user", "content": "hi" }], "priority": "x" })), 400)
            .param("priority"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "n": 2, "temperature": 0 })), 400),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": "nope", "prompt": "hi", "n": 0 })), 404)
            .param("model")
            .code("model_not_found"),
        bad(
            post.clone(),
            cmpl,
            json_bytes(json!({ "model": MODEL, "prompt": "hi", "stream_options": { "include_usage": true } })),
            400,
        )
        .param("stream_options"),
        bad(
            post.clone(),
            cmpl,
            json_bytes(json!({ "model": MODEL, "prompt": "hi", "stream": true, "stream_options": { "include_usage": 2 } })),
            400,
        )
        .param("stream_options"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": [[1, 2], [99_999_999]] })), 400)
            .param("prompt"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": "nope", "prompt": "hi" })), 404)
            .param("model")
            .code("model_not_found"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": long })), 400)
            .code("context_length_exceeded"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi there", "max_tokens": 511 })), 400)
            .param("prompt")
            .code("context_length_exceeded"),
        // vLLM's default `max_tokens` of 16 for a completion is checked against the context.
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": words(505, 15) })), 400)
            .param("prompt")
            .code("context_length_exceeded"),
        // Sampling parameters, as vLLM's `SamplingParams` checks them.
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5 })), 400),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "top_p": 0 })), 400).param("top_p"),
        bad(post.clone(), cmpl, json_bytes(json!({ "model": MODEL, "prompt": "hi", "temperature": -0.5 })), 400)
            .param("temperature"),
        bad(post.clone(), chat, json_bytes(json!({ "model": MODEL, "messages": [{ "role": "user", "content": "hi" }], "stop": [""] })), 400),
        bad(post.clone(), chat, json_bytes(json!({ "model": MODEL, "messages": [{ "role": "user", "content": "hi" }], "presence_penalty": 3 })), 400),
        bad(post.clone(), chat, json_bytes(json!({ "model": MODEL })), 400).param("messages"),
        bad(post.clone(), chat, json_bytes(json!({ "model": MODEL, "messages": [] })), 400).param("messages"),
        bad(post.clone(), chat, json_bytes(json!({ "model": MODEL, "messages": [{ "role": "user", "content": 5 }] })), 400)
            .param("messages[0].content"),
        bad(post.clone(), chat, json_bytes(json!({ "model": MODEL, "messages": [{ "role": "user", "content": long }] })), 400)
            .param("messages")
            .code("context_length_exceeded"),
        bad(post.clone(), cmpl, vec![b' '; 64 * 1024 + 1], 413).code("request_too_large"),
        bad(Method::GET, cmpl, "", 405).code("method_not_allowed"),
        bad(Method::POST, "/v1/models", "", 405).code("method_not_allowed"),
        bad(Method::GET, "/v2/nothing", "", 404).code("not_found"),
        bad(post.clone(), "/tokenize", json_bytes(json!({ "model": "nope", "prompt": "x" })), 404)
            .code("model_not_found"),
        bad(post.clone(), "/tokenize", json_bytes(json!({ "prompt": 5 })), 400).param("prompt"),
        // Only a lone empty prompt has no ids; a batch is refused, empty members or not.
        bad(post.clone(), "/tokenize", json_bytes(json!({ "prompt": [[1], []] })), 400),
        bad(post.clone(), "/tokenize", "nope", 400),
    ];
    for case in cases {
        let what = format!(
            "{} {} {}",
            case.method,
            case.path,
            String::from_utf8_lossy(&case.body[..case.body.len().min(80)])
        );
        let reply = c.request(case.method, case.path, case.body).await;
        assert_eq!(reply.status, case.status, "{what}: {}", reply.text());
        assert_eq!(reply.headers["content-type"], "application/json", "{what}");
        assert!(reply.headers.contains_key("x-request-id"), "{what}");
        let (kind, param, code) = shape::error(&reply.json());
        let expected_kind =
            if case.status.is_server_error() { "server_error" } else { "invalid_request_error" };
        assert_eq!(kind, expected_kind, "{what}");
        if case.param.is_some() {
            assert_eq!(param.as_deref(), case.param, "{what}");
        }
        if case.code.is_some() {
            assert_eq!(code.as_deref(), case.code, "{what}");
        }
    }
}

/// A Messages or Responses request's sampling fields are checked as the chat request's vLLM
/// makes of it: they were not read, and a negative temperature got a 200.
#[tokio::test]
async fn messages_and_responses_sampling_fields_are_checked() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let messages = |extra: serde_json::Value| {
        let mut body =
            json!({ "model": MODEL, "max_tokens": 2, "messages": [{ "role": "user", "content": "hi" }] });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        json_bytes(body)
    };
    let responses = |extra: serde_json::Value| {
        let mut body = json!({ "model": MODEL, "max_output_tokens": 2, "input": "hi" });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        json_bytes(body)
    };
    let cases = [
        ("/v1/messages", messages(json!({ "temperature": -1 })), "temperature must be non-negative"),
        ("/v1/messages", messages(json!({ "top_p": 0 })), "top_p must be in (0, 1]"),
        ("/v1/messages", messages(json!({ "top_k": -2 })), "top_k must be 0"),
        ("/v1/messages", messages(json!({ "stop_sequences": [""] })), "stop"),
        ("/v1/responses", responses(json!({ "temperature": -0.5 })), "temperature must be non-negative"),
        ("/v1/responses", responses(json!({ "top_p": 1.5 })), "top_p must be in (0, 1]"),
    ];
    for (path, body, says) in cases {
        let what = String::from_utf8_lossy(&body).into_owned();
        let reply = c.request(Method::POST, path, body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{path} {what}: {}", reply.text());
        assert!(reply.text().contains(says), "{path} {what}: {}", reply.text());
    }
    for (path, body) in [
        (
            "/v1/messages",
            messages(json!({ "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["x"] })),
        ),
        ("/v1/responses", responses(json!({ "temperature": 0.5, "top_p": 0.9 }))),
    ] {
        let reply = c.request(Method::POST, path, body).await;
        assert_eq!(reply.status, StatusCode::OK, "{path}: {}", reply.text());
    }
}

#[tokio::test]
async fn request_ids_are_echoed_or_generated() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let body = json_bytes(json!({ "model": MODEL, "prompt": "hi", "max_tokens": 1 }));
    let reply =
        collect(c.send(Method::POST, "/v1/completions", body.clone(), &[("x-request-id", "abc-123")]).await)
            .await;
    assert_eq!(reply.headers["x-request-id"], "abc-123");
    assert_eq!(reply.json()["id"], "cmpl-abc-123");
    let reply: Reply = c.request(Method::POST, "/v1/completions", body).await;
    let generated = reply.headers["x-request-id"].to_str().unwrap().to_owned();
    assert!(!generated.is_empty());
    assert_eq!(reply.json()["id"], format!("cmpl-{generated}"));
    assert!(c.get("/health").await.headers.contains_key("x-request-id"));
}

#[tokio::test]
async fn models_and_health() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let health = c.get("/health").await;
    assert_eq!(health.status, StatusCode::OK);
    assert!(health.body.is_empty());
    // vLLM's `/version` (which the router passes through), with the agent's own version.
    let version = c.get("/version").await;
    assert_eq!(version.status, StatusCode::OK);
    assert_eq!(version.json()["version"], env!("CARGO_PKG_VERSION"));

    let models = c.get("/v1/models").await.json();
    shape::assert_keys(&models, &["object", "data"], "model list");
    assert_eq!(models["object"], "list");
    let data = models["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [MODEL, ADAPTER]);
    for m in data {
        shape::assert_keys(
            m,
            &["id", "object", "created", "owned_by", "root", "parent", "max_model_len"],
            "model",
        );
        assert_eq!(m["object"], "model");
        assert_eq!(m["max_model_len"], agent.config.max_model_len);
    }
    assert_eq!(data[0]["parent"], Value::Null);
    assert_eq!(data[1]["parent"], MODEL);
}

#[tokio::test]
async fn http2_with_prior_knowledge_is_served() {
    let agent = Agent::start().await;
    let c = Client::http2(agent.addr);
    let (_, usage) = completion(&c, &json!({ "model": MODEL, "prompt": "over h2", "max_tokens": 2 })).await;
    assert_eq!(usage.completion_tokens, 2);
    let events = stream(
        &c,
        "/v1/completions",
        &json!({ "model": MODEL, "prompt": "h2", "max_tokens": 3, "stream": true }),
    )
    .await;
    shape::completion_stream(&events, 1, false);
}

#[tokio::test]
async fn shutdown_lets_in_flight_streams_finish_and_refuses_new_connections() {
    let agent = Agent::with(kvroute_replica_agent::Config { time_scale: 1.0, ..config() }).await;
    let c = &agent.client;
    let body = json!({ "model": MODEL, "prompt": words(5, 15), "max_tokens": 20, "stream": true });
    let response = c.send(Method::POST, "/v1/completions", serde_json::to_vec(&body).unwrap(), &[]).await;
    let mut body = response.into_body();
    let mut received = next_data(&mut body).await.to_vec();
    let ((), rest) = tokio::join!(agent.stop(), body.collect());
    received.extend_from_slice(&rest.expect("the stream completes").to_bytes());
    let (texts, _) = shape::completion_stream(&sse_events(&received), 1, false);
    assert!(!texts[0].is_empty());
    assert!(tokio::net::TcpStream::connect(agent.addr).await.is_err(), "the listener is closed");
}

#[tokio::test]
async fn engine_refusals_get_a_status_before_any_byte() {
    // 4 blocks of 4 tokens: a prompt of 5 full blocks can never be pinned whole. It is the
    // client's error (a 400, as for a prompt past the context length), not the replica's: a
    // router counts a 500 against the replica.
    let agent =
        Agent::with(kvroute_replica_agent::Config { capacity_blocks: 4, max_waiting: 1, ..config() }).await;
    let c = &agent.client;
    for (tokens, status) in [(19, StatusCode::OK), (20, StatusCode::BAD_REQUEST)] {
        for stream in [false, true] {
            let body =
                json!({ "model": MODEL, "prompt": words(tokens, 16), "max_tokens": 1, "stream": stream });
            let reply = c.post("/v1/completions", &body).await;
            assert_eq!(reply.status, status, "{tokens} tokens: {}", reply.text());
            if status != StatusCode::OK {
                assert_eq!(reply.headers["content-type"], "application/json");
                let (kind, param, code) = shape::error(&reply.json());
                assert_eq!(
                    (kind.as_str(), param.as_deref(), code.as_deref()),
                    ("invalid_request_error", Some("prompt"), Some("context_length_exceeded"))
                );
            }
        }
    }
    // A batch of three prompts against a one-slot admission queue could never be admitted
    // whole: a 400 (a 503 would send it to the next replica, to the same end).
    let body = json!({ "model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1 });
    let reply = c.post("/v1/completions", &body).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(shape::error(&reply.json()).0, "invalid_request_error");
    // The replica still serves what fits.
    completion(c, &json!({ "model": MODEL, "prompt": "fits", "max_tokens": 1 })).await;
}

/// A request that would fit the admission queue but finds it full gets a 503 (`overloaded`):
/// another replica may take it.
#[tokio::test]
async fn a_full_admission_queue_is_a_503() {
    let agent = Agent::with(kvroute_replica_agent::Config {
        time_scale: 1.0,
        max_num_seqs: 1,
        max_waiting: 1,
        ..config()
    })
    .await;
    let c = &agent.client;
    let long = |seed| json!({ "model": MODEL, "prompt": words(5, seed), "max_tokens": 100 });
    let (a, b, more) = (long(30), long(31), json!({ "model": MODEL, "prompt": "one more", "max_tokens": 1 }));
    let m = agent.engine.metrics();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    // Until the gauges read (running, waiting) (current-thread runtime: yield meanwhile).
    let until = |gauges: (u64, u64)| async move {
        let reached = async {
            while (load(&m.running), load(&m.waiting)) != gauges {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(30), reached).await.expect("gauges reached");
    };
    let (first, second, reply) = tokio::join!(
        c.post("/v1/completions", &a),
        async {
            until((1, 0)).await;
            c.post("/v1/completions", &b).await
        },
        async {
            until((1, 1)).await;
            c.post("/v1/completions", &more).await
        }
    );
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{}", reply.text());
    assert_eq!(shape::error(&reply.json()).2.as_deref(), Some("overloaded"));
    assert_eq!((first.status, second.status), (StatusCode::OK, StatusCode::OK), "both queued ones served");
}

#[tokio::test]
async fn a_stream_failed_mid_generation_ends_with_an_error_event_then_done() {
    // No grace: shutdown fails the running request after its first tokens.
    let agent =
        Agent::with(kvroute_replica_agent::Config { time_scale: 1.0, shutdown_grace_secs: 0, ..config() })
            .await;
    let c = &agent.client;
    let body = json!({ "model": MODEL, "prompt": words(5, 17), "max_tokens": 400, "stream": true });
    let response = c.send(Method::POST, "/v1/completions", serde_json::to_vec(&body).unwrap(), &[]).await;
    let mut body = response.into_body();
    let mut received = next_data(&mut body).await.to_vec();
    let ((), rest) = tokio::join!(agent.stop(), body.collect());
    received.extend_from_slice(&rest.expect("the stream ends cleanly").to_bytes());
    let events = sse_events(&received);
    // As vLLM 0.33 ends a stream it fails: the error event, then [DONE].
    let [.., error, done] = &events[..] else { panic!("{events:?}") };
    assert_eq!(done, "[DONE]");
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    let error: Value = serde_json::from_str(error).unwrap();
    assert_eq!(shape::error(&error).0, "server_error");
    let chunk: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(chunk["object"], "text_completion");
}

/// A stored response is found with a trailing slash on its path too, as every other path
/// is: the id was read with the slash, and the answer was a 404 for the id ''.
#[tokio::test]
async fn a_stored_response_is_found_with_a_trailing_slash() {
    let agent = Agent::with(kvroute_replica_agent::Config { responses_store: true, ..config() }).await;
    let body = json!({ "model": MODEL, "input": words(10, 31), "max_output_tokens": 2 });
    let created = agent.client.post("/v1/responses", &body).await;
    assert_eq!(created.status, StatusCode::OK, "{}", created.text());
    let id = created.json()["id"].as_str().unwrap().to_owned();
    for path in [format!("/v1/responses/{id}"), format!("/v1/responses/{id}/")] {
        let got = agent.client.send(Method::GET, &path, Vec::new(), &[]).await;
        assert_eq!(got.status(), StatusCode::OK, "{path}");
    }
    let cancel =
        agent.client.send(Method::POST, &format!("/v1/responses/{id}/cancel/"), Vec::new(), &[]).await;
    assert_ne!(cancel.status(), StatusCode::NOT_FOUND);
}

/// vLLM's background mode (`background: true`): answered at once, `queued`, generated after
/// and stored at its end; one still generating is cancelled (stored `cancelled`, its
/// generation stopped), one done cannot be (400). Without the store, with `store: false` or
/// streamed, it is refused.
#[tokio::test]
async fn a_background_response_is_answered_queued_and_stored_when_generated() {
    use std::sync::atomic::Ordering::Relaxed;
    let agent =
        Agent::with(kvroute_replica_agent::Config { responses_store: true, time_scale: 1.0, ..config() })
            .await;
    let status = async |id: &str| {
        let got = agent.client.get(&format!("/v1/responses/{id}")).await;
        assert_eq!(got.status, StatusCode::OK, "{}", got.text());
        got.json()["status"].as_str().unwrap().to_owned()
    };
    let cancel = async |id: &str| agent.client.post(&format!("/v1/responses/{id}/cancel"), &json!({})).await;
    let body = |tokens| json!({ "model": MODEL, "input": words(10, 41), "max_output_tokens": tokens, "background": true });
    let short = agent.client.post("/v1/responses", &body(2)).await;
    assert_eq!(short.status, StatusCode::OK, "{}", short.text());
    let (short, id) = (short.json(), short.json()["id"].as_str().unwrap().to_owned());
    assert_eq!(
        (&short["status"], &short["output"], &short["usage"]),
        (&json!("queued"), &json!([]), &json!(null))
    );
    until("the short response is generated", async || status(&id).await != "queued").await;
    let done = agent.client.get(&format!("/v1/responses/{id}")).await.json();
    assert_eq!(done["status"], "incomplete", "{done}");
    assert_eq!(done["usage"]["output_tokens"], 2, "{done}");
    assert_eq!(cancel(&id).await.status, StatusCode::BAD_REQUEST, "done: not cancelled");

    let long = agent.client.post("/v1/responses", &body(400)).await;
    let id = long.json()["id"].as_str().unwrap().to_owned();
    let metrics = agent.engine.metrics();
    until("the long response runs", async || metrics.running.load(Relaxed) > 0).await;
    let cancelled = cancel(&id).await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.text());
    assert_eq!(cancelled.json()["status"], "cancelled");
    until("its generation stops", async || metrics.running.load(Relaxed) == 0).await;
    assert!(metrics.generation_tokens.load(Relaxed) < 400, "cut short");
    assert_eq!(status(&id).await, "cancelled");

    for refused in [
        json!({ "model": MODEL, "input": "x", "background": true, "store": false }),
        json!({ "model": MODEL, "input": "x", "background": true, "stream": true }),
    ] {
        let reply = agent.client.post("/v1/responses", &refused).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{refused}: {}", reply.text());
    }
    let unstored = Agent::with(config()).await;
    let reply = unstored.client.post("/v1/responses", &body(2)).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
}

/// A Responses stream that fails before the engine's first output (its prefill runs a few
/// tokens a step when a shutdown without grace comes) sends its opening events and the
/// error, numbered in order: the message item it never opened takes no numbers.
#[tokio::test]
async fn a_responses_stream_failed_before_its_output_numbers_its_events_in_order() {
    let config = kvroute_replica_agent::Config {
        time_scale: 1.0,
        shutdown_grace_secs: 0,
        max_num_batched_tokens: 8,
        max_num_seqs: 8,
        step_base_us: 20_000,
        ..config()
    };
    let agent = Agent::with(config).await;
    let body = json!({ "model": MODEL, "input": words(100, 23), "max_output_tokens": 3, "stream": true });
    let response =
        agent.client.send(Method::POST, "/v1/responses", serde_json::to_vec(&body).unwrap(), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut received = next_data(&mut body).await.to_vec();
    let ((), rest) = tokio::join!(agent.stop(), body.collect());
    received.extend_from_slice(&rest.expect("the stream ends cleanly").to_bytes());
    let text = String::from_utf8(received).unwrap();
    let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(names, ["response.created", "response.in_progress", "error"], "{text}");
    let numbers: Vec<u64> = text
        .split("\"sequence_number\":")
        .skip(1)
        .map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(numbers, [0, 1, 2], "{text}");
}

#[tokio::test]
async fn a_request_failed_by_shutdown_gets_503_not_500() {
    // No grace: shutdown fails the running request; the client should retry elsewhere.
    let agent =
        Agent::with(kvroute_replica_agent::Config { time_scale: 1.0, shutdown_grace_secs: 0, ..config() })
            .await;
    let body = json!({ "model": MODEL, "prompt": words(5, 18), "max_tokens": 400 });
    let running = &agent.engine.metrics().running;
    let (reply, ()) = tokio::join!(agent.client.post("/v1/completions", &body), async {
        // Current-thread runtime: the request is admitted once the scheduler has run.
        while running.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        agent.stop().await;
    });
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{}", reply.text());
    assert_eq!(shape::error(&reply.json()).2.as_deref(), Some("shutting_down"));
}

/// `model` is optional, as in vLLM: a request without one is the base model's, and is
/// answered under its name; an unknown model is still a 404.
#[tokio::test]
async fn a_request_without_a_model_is_the_base_models() {
    let agent = Agent::with(config()).await;
    let c = &agent.client;
    for (path, body) in [
        ("/v1/completions", json!({ "prompt": "no model named", "max_tokens": 1 })),
        ("/v1/chat/completions", json!({ "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1 })),
    ] {
        let reply = c.post(path, &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{path}: {}", reply.text());
        assert_eq!(reply.json()["model"], MODEL, "{path}");
    }
    let reply = c.post("/v1/completions", &json!({ "model": "other", "prompt": "x", "max_tokens": 1 })).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
}

/// A client that stops sending its body mid-way gets a 408 after `--body-timeout-ms`: its
/// request no longer holds the connection, nor the server's drain at shutdown.
#[tokio::test]
async fn a_body_that_stops_arriving_gets_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let agent = Agent::with(kvroute_replica_agent::Config { body_timeout_ms: 300, ..config() }).await;
    let mut conn = tokio::net::TcpStream::connect(agent.addr).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n\
                content-length: 100\r\n\r\n{";
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), conn.read(&mut answer))
        .await
        .expect("answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    tokio::time::timeout(std::time::Duration::from_secs(10), agent.stop()).await.expect("the drain ended");
}
