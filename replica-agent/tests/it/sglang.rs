//! SGLang's native `/generate`, as the agent serves it: SGLang's answer shapes, whole and
//! streamed, its defaults, its adapters and its refusals.

use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::http_api::words;
use crate::support::client::{collect, sse_events};
use crate::support::{ADAPTER, Agent, config};

/// `meta_info`'s counts: prompt, completion and cached tokens.
fn counts(answer: &Value) -> (u64, u64, u64) {
    let meta = &answer["meta_info"];
    let count = |key: &str| meta[key].as_u64().unwrap_or_else(|| panic!("{key}: {answer}"));
    (count("prompt_tokens"), count("completion_tokens"), count("cached_tokens"))
}

#[tokio::test]
async fn generate_answers_as_sglang_does() {
    let agent = Agent::start().await;
    let c = &agent.client;
    let text = words(21, 1);
    let len = c.tokenize(&json!({ "prompt": text })).await.len() as u64;
    let first = c.post("/generate", &json!({ "text": text, "sampling_params": {"max_new_tokens": 5} })).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    let answer = first.json();
    let keys: Vec<&str> = answer.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys, ["text", "output_ids", "meta_info"]);
    assert_eq!(counts(&answer), (len, 5, 0));
    assert_eq!(answer["output_ids"].as_array().unwrap().len(), 5);
    assert_eq!(answer["text"].as_str().unwrap().split_whitespace().count(), 5);
    assert_eq!(answer["meta_info"]["finish_reason"], json!({"type": "length", "length": 5}));
    assert!(answer["meta_info"]["e2e_latency"].as_f64().is_some());

    // The same prompt as token ids, without sampling params: its full blocks are cached, and
    // SGLang's default is 128 new tokens (within the context: the agent's is 512).
    let ids = c.tokenize(&json!({ "prompt": text })).await;
    let again = c.post("/generate", &json!({ "input_ids": ids, "rid": "mine" })).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    let block = u64::from(agent.config.block_size);
    assert_eq!(counts(&again.json()), (len, 128, len / block * block));
    assert_eq!(again.json()["meta_info"]["id"], "mine");

    // Two prompts of two choices each: a list, each prompt's choices in turn.
    let batch = json!({
        "text": [words(9, 2), words(9, 3)], "rid": "b",
        "sampling_params": {"max_new_tokens": 2, "n": 2, "temperature": 0.7},
    });
    let reply = c.post("/generate", &batch).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let list = reply.json();
    let ids: Vec<&str> =
        list.as_array().unwrap().iter().map(|a| a["meta_info"]["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["b_0", "b_1", "b_2", "b_3"]);
    assert!(list.as_array().unwrap().iter().all(|a| counts(a).1 == 2));

    // An adapter by its name.
    let adapted = c.post("/generate", &json!({ "text": text, "lora_path": ADAPTER })).await;
    assert_eq!(adapted.status, StatusCode::OK, "{}", adapted.text());
    let unknown = c.post("/generate", &json!({ "text": text, "lora_path": "nobody" })).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{}", unknown.text());
}

#[tokio::test]
async fn a_generate_stream_carries_its_text_so_far() {
    let agent = Agent::start().await;
    let body = json!({ "text": words(13, 4), "stream": true, "sampling_params": {"max_new_tokens": 4} });
    let reply = agent.client.post("/generate", &body).await;
    assert_eq!(reply.status, StatusCode::OK);
    let events = sse_events(&reply.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks.len(), 4, "a chunk a token");
    for (i, chunk) in chunks.iter().enumerate() {
        assert_eq!(counts(chunk).1, i as u64 + 1);
        assert_eq!(chunk["output_ids"].as_array().unwrap().len(), i + 1, "the ids so far");
        assert_eq!(chunk.get("index"), None, "one choice: no index");
        let done = i == 3;
        assert_eq!(chunk["meta_info"]["finish_reason"].is_null(), !done);
        assert_eq!(chunk["meta_info"].get("e2e_latency").is_some(), done);
    }
    let whole = agent
        .client
        .post("/generate", &json!({ "text": words(13, 4), "sampling_params": {"max_new_tokens": 4} }))
        .await;
    assert_eq!(chunks[3]["text"], whole.json()["text"], "the last chunk's text is the whole text");

    // Two choices: each chunk names its own.
    let body =
        json!({ "text": words(13, 5), "stream": true, "sampling_params": {"max_new_tokens": 2, "n": 2} });
    let events = sse_events(&agent.client.post("/generate", &body).await.body);
    let indices: std::collections::BTreeSet<u64> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices.into_iter().collect::<Vec<_>>(), [0, 1]);
}

#[tokio::test]
async fn generate_refuses_what_sglang_refuses() {
    let agent = Agent::with(kvroute_replica_agent::Config { api_key: Some("k3y".into()), ..config() }).await;
    let c = &agent.client;
    let keyed = [("authorization", "Bearer k3y")];
    let send =
        async |body: Value| collect(c.send(Method::POST, "/generate", body.to_string(), &keyed).await).await;
    let unkeyed = c.post("/generate", &json!({ "text": "a" })).await;
    assert_eq!(unkeyed.status, StatusCode::UNAUTHORIZED, "SGLang's --api-key guards /generate too");
    assert_eq!(send(json!({ "text": "a" })).await.status, StatusCode::OK);
    for (body, param) in [
        (json!({ "sampling_params": {} }), "text"),
        (json!({ "input_ids": [] }), "input_ids"),
        (json!({ "text": "a", "sampling_params": {"temperature": -1} }), "temperature"),
        (json!({ "text": "a", "sampling_params": [{"max_new_tokens": 1}, {"top_p": 7}] }), "top_p"),
        (json!({ "text": "a", "sampling_params": {"max_new_tokens": 100000} }), "prompt"),
    ] {
        let reply = send(body.clone()).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}: {}", reply.text());
        let message = reply.json()["error"]["message"].as_str().unwrap().to_owned();
        let named = reply.json()["error"]["param"].as_str().map(str::to_owned);
        assert!(named.as_deref() == Some(param) || message.contains(param), "{body}: {}", reply.text());
    }
}

#[tokio::test]
async fn each_prompt_has_its_own_length_as_in_sglang() {
    let agent = Agent::start().await;
    let c = &agent.client;
    // A batch of one is a list too; each prompt its own max_new_tokens, one of them 0.
    let one = c.post("/generate", &json!({ "input_ids": [[5, 6, 7]], "rid": "r" })).await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.text());
    let list = one.json();
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(list[0]["meta_info"]["id"], "r_0");
    let batch = json!({
        "text": [words(5, 6), words(5, 7), words(5, 8)],
        "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 5}, {"max_new_tokens": 0}],
    });
    let reply = c.post("/generate", &batch).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let lengths: Vec<u64> = reply.json().as_array().unwrap().iter().map(|a| counts(a).1).collect();
    assert_eq!(lengths, [2, 5, 0]);
    // Several greedy choices, which vLLM refuses and SGLang samples.
    let greedy =
        json!({ "text": words(5, 9), "sampling_params": {"n": 2, "temperature": 0, "max_new_tokens": 1} });
    assert_eq!(c.post("/generate", &greedy).await.status, StatusCode::OK);
    // Without max_new_tokens, a prompt near the context's end gets what is left of it (the
    // agent's context is 512 tokens), not SGLang's 128.
    let long = c.post("/generate", &json!({ "input_ids": (1..=500).collect::<Vec<u32>>() })).await;
    assert_eq!(long.status, StatusCode::OK, "{}", long.text());
    assert_eq!(counts(&long.json()).1, 12);
    let asked = c.post("/generate", &json!({ "input_ids": (1..=500).collect::<Vec<u32>>(), "sampling_params": {"max_new_tokens": 13} })).await;
    assert_eq!(asked.status, StatusCode::BAD_REQUEST, "an explicit length is checked: {}", asked.text());
}

#[tokio::test]
async fn each_prompt_is_checked_against_the_context_with_its_own_length() {
    let agent = Agent::start().await;
    // A long prompt asking for few tokens beside a short one asking for many: each fits.
    let batch = json!({
        "input_ids": [(1..=500).collect::<Vec<u32>>(), vec![1, 2, 3]],
        "sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 100}],
    });
    let reply = agent.client.post("/generate", &batch).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let lengths: Vec<u64> = reply.json().as_array().unwrap().iter().map(|a| counts(a).1).collect();
    assert_eq!(lengths, [5, 100]);
}
