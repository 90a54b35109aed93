//! SGLang's native `/generate` through the router, in front of real agents: routed on its
//! prompt as a completion is, answered in SGLang's shapes, streamed, refused when malformed,
//! and never sent to a vLLM replica (which does not serve it).

use http::StatusCode;
use kvroute_proto::pb::{self, router_admin_client::RouterAdminClient};
use kvroute_replica_agent::publisher::EventFormat;
use kvroute_router::replicas::EngineKind;
use serde_json::{Value, json};

use crate::fleet::{FLEET_MODEL, Fleet, Reply, agent_config, first_data};

async fn generate(fleet: &Fleet, body: &Value) -> Reply {
    fleet.http.post(&fleet.url("/generate"), body).await
}

/// `meta_info.cached_tokens` of a whole answer to one prompt.
fn cached(reply: &Reply) -> u64 {
    reply.json()["meta_info"]["cached_tokens"].as_u64().expect("meta_info.cached_tokens")
}

fn predicted(reply: &Reply) -> u64 {
    reply.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap()
}

fn doc(d: usize) -> String {
    (0..40).map(|i| format!("gen{d}w{i}")).collect::<Vec<_>>().join(" ")
}

fn counter(metrics: &str, name: &str) -> u64 {
    let line = format!("kvroute_router_{name}_total ");
    metrics.lines().find_map(|l| l.strip_prefix(&line)?.trim().parse().ok()).unwrap_or(0)
}

#[tokio::test]
async fn generate_requests_come_home_to_the_replica_that_cached_their_prefix() {
    let fleet = Fleet::start(3).await;
    let mut home = Vec::new();
    for d in 0..3 {
        let first =
            generate(&fleet, &json!({"text": doc(d), "sampling_params": {"max_new_tokens": 2}})).await;
        assert_eq!(first.status, StatusCode::OK, "{}", String::from_utf8_lossy(&first.body));
        let answer = first.json();
        assert_eq!(answer["meta_info"]["completion_tokens"], 2);
        assert_eq!(answer["output_ids"].as_array().map(Vec::len), Some(2));
        assert_eq!(answer["meta_info"]["finish_reason"]["type"], "length");
        assert_eq!(cached(&first), 0);
        home.push(first.header("x-kvroute-replica").unwrap().to_owned());
    }
    let spread: std::collections::HashSet<_> = home.iter().collect();
    assert!(spread.len() > 1, "new prefixes spread over the fleet: {home:?}");
    for (d, home) in home.iter().enumerate() {
        let asked = json!({"text": format!("{} and a question {d}", doc(d)), "rid": format!("q{d}")});
        let reply = generate(&fleet, &asked).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.header("x-kvroute-replica"), Some(home.as_str()), "doc {d} follows its prefix");
        assert!(predicted(&reply) > 0);
        assert_eq!(cached(&reply), predicted(&reply), "doc {d}: the hit predicted is the one reported");
        // SGLang's default: 128 new tokens.
        assert_eq!(reply.json()["meta_info"]["completion_tokens"], 128);
        assert_eq!(reply.json()["meta_info"]["id"], format!("q{d}"));
    }
    // The admin Explain reads /generate as the proxy does.
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let body = serde_json::to_vec(&json!({"text": format!("{} and more", doc(1))})).unwrap();
    let explained = admin.explain(pb::ExplainRequest { path: "/generate".into(), body }).await.unwrap();
    assert_eq!(explained.into_inner().chosen, home[1]);
    let metrics = fleet.http.get(&fleet.url("/metrics")).await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(counter(&metrics, "realized_cached_tokens") >= 3 * 40, "meta_info's hits are counted");

    // A batch, with a list of sampling params: an answer a prompt (asked while the replicas'
    // recent loads are even: the balance term decides a half-cached batch otherwise).
    let batch = json!({
        "text": [format!("{} one", doc(0)), format!("{} two", doc(0))],
        "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 3}],
    });
    let reply = generate(&fleet, &batch).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.json().as_array().map(Vec::len), Some(2));
    assert_eq!(reply.header("x-kvroute-replica"), Some(home[0].as_str()));

    // Token ids: the longer prompt finds the shorter one's blocks where it went.
    let ids: Vec<u32> = (1000..1040).collect();
    let first = generate(&fleet, &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})).await;
    assert_eq!(first.status, StatusCode::OK, "{}", String::from_utf8_lossy(&first.body));
    let longer: Vec<u32> = (1000..1050).collect();
    let again =
        generate(&fleet, &json!({"input_ids": longer, "sampling_params": {"max_new_tokens": 1}})).await;
    assert_eq!(again.header("x-kvroute-replica"), first.header("x-kvroute-replica"));
    assert_eq!(cached(&again), 40);
}

#[tokio::test]
async fn a_generate_stream_sends_its_text_so_far_as_it_comes() {
    let fleet = Fleet::start(2).await;
    let body = json!({"text": doc(7), "sampling_params": {"max_new_tokens": 20}, "stream": true});
    let mut streamed = fleet.http.stream(&fleet.url("/generate"), &body).await;
    assert_eq!(streamed.status(), StatusCode::OK);
    assert_eq!(streamed.headers()["content-type"], "text/event-stream");
    let first = first_data(streamed.body_mut()).await;
    let text = String::from_utf8_lossy(&first).into_owned();
    let chunk: Value = serde_json::from_str(text.strip_prefix("data: ").unwrap().trim()).unwrap();
    assert_eq!(chunk["meta_info"]["completion_tokens"], 1, "one token at a time: {text}");
    assert_eq!(chunk["meta_info"]["finish_reason"], Value::Null);
    use http_body_util::BodyExt;
    let rest = streamed.into_body().collect().await.unwrap().to_bytes();
    let rest = String::from_utf8_lossy(&rest).into_owned();
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    let last =
        rest.rsplit("data: {").next().map(|l| format!("{{{}", l.split("\n\n").next().unwrap())).unwrap();
    let last: Value = serde_json::from_str(&last).unwrap();
    assert_eq!(last["meta_info"]["finish_reason"]["length"], 20);
    assert_eq!(last["text"].as_str().unwrap().split_whitespace().count(), 20, "the whole text so far");
    assert_eq!(last["output_ids"].as_array().unwrap().len(), 20);
}

#[tokio::test]
async fn malformed_generate_requests_get_a_400_naming_the_field() {
    let fleet = Fleet::start(1).await;
    for (body, param) in [
        (json!({"sampling_params": {"max_new_tokens": 3}}), "text"),
        (json!({"text": 5}), "text"),
        (json!({"input_ids": []}), "input_ids"),
        (json!({"text": "a", "sampling_params": {"max_new_tokens": -2}}), "sampling_params.max_new_tokens"),
        (json!({"text": "a", "lora_path": 3}), "lora_path"),
    ] {
        let reply = generate(&fleet, &body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        let error = &reply.json()["error"];
        assert_eq!(error["param"], param, "{body}: {error}");
        assert!(error["message"].as_str().unwrap().contains("request id"), "{error}");
    }
    let reply = fleet.http.send(http::Method::POST, &fleet.url("/generate"), "{not json").await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.json()["error"]["type"], "invalid_request_error");
    let reply = fleet.http.send(http::Method::GET, &fleet.url("/generate"), "").await;
    assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn generate_goes_to_no_vllm_replica() {
    // agent-0 plays vLLM (its events are vLLM's): it does not serve /generate.
    let vllm_first = |name: &str| kvroute_replica_agent::Config {
        event_format: if name == "agent-0" { EventFormat::Vllm } else { EventFormat::Kvroute },
        ..agent_config(name)
    };
    let fleet = Fleet::with(2, vllm_first, |mut config| {
        config.replicas[0].engine = EngineKind::Vllm;
        config
    })
    .await;
    for d in 0..6 {
        let reply =
            generate(&fleet, &json!({"text": doc(20 + d), "sampling_params": {"max_new_tokens": 1}})).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.header("x-kvroute-replica"), Some("agent-1"));
        // Completions go to both.
        let completion = json!({"model": FLEET_MODEL, "prompt": doc(30 + d), "max_tokens": 1});
        assert_eq!(fleet.http.post(&fleet.url("/v1/completions"), &completion).await.status, StatusCode::OK);
    }
    // Embeddings instead of a prompt go by load, to agent-1 too.
    let embeds = json!({"input_embeds": [[0.5, 0.25]], "sampling_params": {"max_new_tokens": 1}});
    let reply = generate(&fleet, &embeds).await;
    assert_eq!(
        reply.header("x-kvroute-replica"),
        Some("agent-1"),
        "{}",
        String::from_utf8_lossy(&reply.body)
    );

    let only_vllm = Fleet::with(1, vllm_first, |mut config| {
        config.replicas[0].engine = EngineKind::Vllm;
        config
    })
    .await;
    let reply = generate(&only_vllm, &json!({"text": doc(40)})).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    let message = reply.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("/generate"), "{message}");
}
