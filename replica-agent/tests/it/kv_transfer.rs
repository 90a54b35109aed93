//! Disaggregated prefill between two real agents, as a router plays vLLM's NixlConnector over
//! HTTP: the prefill answers with `kv_transfer_params`, the decode pulls what they name.

use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::http_api::{metrics, words};
use crate::support::client::collect;
use crate::support::shape::{self, Usage};
use crate::support::{Agent, Client, MODEL, config};
use kvroute_replica_agent::kv_transfer::{KvRole, KvTransferConfig, NIXL};

async fn with_role(role: Option<KvRole>) -> Agent {
    let kv_transfer_config = role.map(|kv_role| KvTransferConfig {
        kv_connector: NIXL.into(),
        kv_role,
        engine_id: Some("prefill-engine".into()),
    });
    Agent::with(kvroute_replica_agent::config::Config { kv_transfer_config, ..config() }).await
}

/// The completion `body` answers, its `kv_transfer_params` taken out (the shape checker knows
/// OpenAI's keys only), and its usage.
async fn complete(client: &Client, body: &Value, request_id: &str) -> (Value, Usage) {
    let body = serde_json::to_vec(body).unwrap();
    let reply =
        collect(client.send(Method::POST, "/v1/completions", body, &[("x-request-id", request_id)]).await)
            .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let mut answer = reply.json();
    let params = answer.as_object_mut().unwrap().remove("kv_transfer_params").unwrap_or(Value::Null);
    let (_, usage) = shape::completion(&answer, 1);
    (params, usage)
}

/// The prefill's request of `body`, as vLLM's proxies make it.
fn for_prefill(body: &Value) -> Value {
    let mut prefill = body.clone();
    prefill["max_tokens"] = json!(1);
    prefill["stream"] = json!(false);
    prefill["kv_transfer_params"] = json!({
        "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null,
    });
    prefill
}

fn with_params(body: &Value, params: &Value) -> Value {
    let mut decode = body.clone();
    decode["kv_transfer_params"] = params.clone();
    decode
}

#[tokio::test]
async fn the_decode_pulls_what_the_prefill_computed() {
    let (prefill, decode) =
        (with_role(Some(KvRole::KvProducer)).await, with_role(Some(KvRole::KvConsumer)).await);
    let block_size = u64::from(prefill.config.block_size);
    let prompt = words(37, 11);
    let len = prefill.client.tokenize(&json!({ "prompt": prompt })).await.len() as u64;
    assert!(!len.is_multiple_of(block_size), "the prompt ends in a partial block");
    let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 4 });

    let (params, usage) = complete(&prefill.client, &for_prefill(&body), "req-7").await;
    assert_eq!((usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens), (len, 1, 0));
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len() as u64, len.div_ceil(block_size));
    assert_eq!(params["remote_engine_id"], "prefill-engine");
    assert_eq!(params["remote_request_id"], "req-7");
    assert_eq!(
        (params["remote_host"].as_str(), params["remote_port"].as_u64()),
        (Some("localhost"), Some(5600))
    );

    let before = metrics(&decode.client).await["vllm:external_prefix_cache_hits_total"];
    let (none, usage) = complete(&decode.client, &with_params(&body, &params), "req-7").await;
    assert_eq!(none, Value::Null, "a decode answers with no params");
    // Everything but the last prompt token is pulled, as vLLM's decode reports it.
    assert_eq!(usage, Usage { prompt_tokens: len, completion_tokens: 4, cached_tokens: len - 1 });
    let after = metrics(&decode.client).await["vllm:external_prefix_cache_hits_total"];
    assert_eq!(after - before, (len - 1) as f64);
    // The pulled prompt is the decode's own now: the next turn hits its full blocks there.
    let (_, again) = complete(&decode.client, &body, "req-8").await;
    assert_eq!(again.cached_tokens, len / block_size * block_size);

    // A prefill-only replica pulls nothing; a decode-only one answers no params.
    let other = json!({ "model": MODEL, "prompt": words(30, 12), "max_tokens": 2 });
    let (_, usage) = complete(&prefill.client, &with_params(&other, &params), "req-9").await;
    assert_eq!(usage.cached_tokens, 0);
    let (none, _) = complete(&decode.client, &for_prefill(&other), "req-10").await;
    assert_eq!(none, Value::Null);
}

#[tokio::test]
async fn params_without_a_connector_or_all_their_keys_pull_nothing() {
    let (plain, decode) = (with_role(None).await, with_role(Some(KvRole::KvBoth)).await);
    let body = json!({ "model": MODEL, "prompt": words(40, 13), "max_tokens": 2 });
    let (params, _) = complete(&decode.client, &for_prefill(&body), "req-1").await;
    assert_eq!(params["do_remote_prefill"], true, "kv_both prefills for others");
    let (none, usage) = complete(&plain.client, &for_prefill(&body), "req-2").await;
    assert_eq!((none, usage.completion_tokens), (Value::Null, 1), "no connector, no params");
    let (_, usage) = complete(
        &plain.client,
        &with_params(&json!({ "prompt": words(40, 14), "model": MODEL }), &params),
        "r",
    )
    .await;
    assert_eq!(usage.cached_tokens, 0);

    let mut partial = params.clone();
    partial.as_object_mut().unwrap().remove("remote_host");
    let fresh = json!({ "model": MODEL, "prompt": words(40, 15), "max_tokens": 2 });
    let (_, usage) = complete(&decode.client, &with_params(&fresh, &partial), "req-3").await;
    assert_eq!(usage.cached_tokens, 0, "a pull missing a key prefills here");

    let reply = decode.client.post("/v1/completions", &with_params(&fresh, &json!([1, 2]))).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.json()["error"]["param"], "kv_transfer_params");
}
