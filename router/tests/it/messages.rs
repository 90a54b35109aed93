//! Anthropic's Messages API (`/v1/messages`) through the router: decided on the prompt vLLM
//! renders of it, forwarded as it is, answered by real replica agents.

use std::collections::{HashMap, HashSet};

use http_body_util::BodyExt;
use kvroute_proto::openai::{Endpoint, InlineSystem};
use serde_json::{Value, json};

use crate::fleet::{FLEET_MODEL, Fleet, Reply, agent_config};

/// A text of `words` distinct words starting with `tag`.
fn text(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{i}")).collect::<Vec<_>>().join(" ")
}

fn messages(system: &str, turns: Value) -> Value {
    json!({
        "model": FLEET_MODEL, "max_tokens": 2,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=per-request;"},
                   {"type": "text", "text": system}],
        "messages": turns
    })
}

fn cache_read(reply: &Reply) -> u64 {
    reply.json()["usage"]["cache_read_input_tokens"].as_u64().expect("usage.cache_read_input_tokens")
}

fn predicted(reply: &Reply) -> u64 {
    reply.header("x-kvroute-predicted-cached-tokens").expect("the prediction header").parse().unwrap()
}

/// The first turn of each conversation goes where the fleet has room; its next turn, with a
/// tool call and its result, follows it there and is served from the cache as predicted.
#[tokio::test]
async fn a_conversations_next_turn_lands_where_its_prefix_is_cached() {
    let fleet = Fleet::start(3).await;
    let url = fleet.url("/v1/messages");
    let mut home = HashMap::new();
    for c in 0..6 {
        let body =
            messages(&text(&format!("sys{c}w"), 40), json!([{"role": "user", "content": "list the files"}]));
        let first = fleet.http.post(&url, &body).await;
        assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
        assert_eq!(first.json()["type"], "message");
        assert_eq!(cache_read(&first), 0);
        home.insert(c, first.header("x-kvroute-replica").unwrap().to_owned());
    }
    for c in 0..6 {
        let body = messages(
            &text(&format!("sys{c}w"), 40),
            json!([
                {"role": "user", "content": "list the files"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Listing."},
                    {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "/"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": text("file", 12)}]},
                    {"type": "text", "text": "which is largest?"}]}
            ]),
        );
        let next = fleet.http.post(&url, &body).await;
        assert_eq!(next.status, 200, "{}", String::from_utf8_lossy(&next.body));
        assert_eq!(
            next.header("x-kvroute-replica"),
            Some(home[&c].as_str()),
            "conversation {c} follows its prefix"
        );
        assert!(predicted(&next) > 40, "the system prompt at least: {}", predicted(&next));
        assert_eq!(cache_read(&next), predicted(&next), "the prediction is the replica's hit");
    }
    let used: HashSet<&String> = home.values().collect();
    assert!(used.len() > 1, "new conversations spread over the fleet: {home:?}");
    let metrics = String::from_utf8_lossy(&fleet.http.get(&fleet.url("/metrics")).await.body).into_owned();
    let realized = metrics.lines().find_map(|l| {
        l.strip_prefix("kvroute_router_realized_cached_tokens_total ")?.trim().parse::<u64>().ok()
    });
    assert!(
        realized.is_some_and(|n| n > 6 * 40),
        "the router read the hits from Anthropic's usage: {realized:?}"
    );
}

/// The blocks the router computes for a Messages request are the blocks the replica stores
/// serving it, and `count_tokens` (passed through) counts the prompt the router saw.
#[tokio::test]
async fn router_blocks_for_a_messages_request_are_the_replicas() {
    let fleet = Fleet::start(1).await;
    let body = messages(
        &text("parity", 30),
        json!([
            {"role": "system", "content": "a leading note"},
            {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "ok"}]},
            {"role": "user", "content": "go on"}
        ]),
    );
    let plan =
        fleet.router.state.decider.explain(Endpoint::Messages, body.to_string().as_bytes()).await.unwrap();
    assert!(plan.blocks.len() >= 5, "several blocks");
    let reply = fleet.http.post(&fleet.url("/v1/messages"), &body).await;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    let usage = &reply.json()["usage"];
    let prompt = usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(plan.prompt_tokens, prompt);
    let resident: HashSet<_> = fleet.agent(0).engine.resident().into_iter().collect();
    assert!(plan.blocks.iter().all(|b| resident.contains(b)), "router blocks were stored by the replica");

    let mut count = body.clone();
    count.as_object_mut().unwrap().remove("max_tokens");
    let counted = fleet.http.post(&fleet.url("/v1/messages/count_tokens"), &count).await;
    assert_eq!(counted.status, 200, "{}", String::from_utf8_lossy(&counted.body));
    assert_eq!(counted.json()["input_tokens"].as_u64(), Some(plan.prompt_tokens));
}

#[tokio::test]
async fn a_messages_stream_passes_through_as_it_is_generated() {
    let fleet =
        Fleet::with(2, |n| kvroute_replica_agent::Config { time_scale: 1.0, ..agent_config(n) }, |c| c).await;
    let mut body = messages(&text("streamsys", 20), json!([{"role": "user", "content": "tell me"}]));
    body["max_tokens"] = json!(200);
    body["stream"] = json!(true);
    let response = fleet.http.stream(&fleet.url("/v1/messages"), &body).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("x-kvroute-replica").is_some());
    let mut stream = response.into_body();
    let first = crate::fleet::first_data(&mut stream).await;
    assert!(std::str::from_utf8(&first).unwrap().starts_with("event: message_start\n"));
    // 200 tokens at 6 ms a step take over a second: the first event came well before the end.
    let first = String::from_utf8_lossy(&first);
    assert!(!first.contains("message_stop"), "the first event came before the end: {first}");
    let rest = String::from_utf8(stream.collect().await.unwrap().to_bytes().to_vec()).unwrap();
    // The first token comes with `message_start`, as vLLM sends it.
    let whole = format!("{first}{rest}");
    let names: Vec<&str> = whole.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(names.iter().filter(|n| **n == "content_block_delta").count(), 200);
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    let delta: Value = rest
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|v| v["type"] == "message_delta")
        .unwrap();
    assert_eq!(delta["usage"]["output_tokens"], 200);
}

/// The router's own errors on `/v1/messages` come in Anthropic's envelope, with OpenAI's
/// error object inside; nothing malformed reaches a replica.
#[tokio::test]
async fn malformed_messages_requests_get_errors_an_anthropic_client_reads() {
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config { max_body_bytes: 1024, ..c }).await;
    let url = fleet.url("/v1/messages");
    let user = json!([{"role": "user", "content": "q"}]);
    let cases = [
        (fleet.http.send(http::Method::POST, &url, "{not json").await, 400, None),
        (fleet.http.post(&url, &json!({"model": FLEET_MODEL, "messages": user})).await, 400, Some("max_tokens")),
        (
            fleet.http.post(&url, &json!({"model": FLEET_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})).await,
            400,
            Some("messages[0].content[0].text"),
        ),
        (fleet.http.post(&url, &json!({"max_tokens": 1, "messages": user, "system": "x".repeat(2048)})).await, 413, None),
        (fleet.http.get(&url).await, 405, None),
        (fleet.http.post(&fleet.url("/v1/messages/"), &json!({"max_tokens": 1, "messages": user})).await, 400, None),
    ];
    for (i, (reply, status, param)) in cases.iter().enumerate() {
        assert_eq!(reply.status.as_u16(), *status, "case {i}: {}", String::from_utf8_lossy(&reply.body));
        let body = reply.json();
        assert_eq!(body["type"], "error", "case {i}: {body}");
        let error = &body["error"];
        assert!(error["type"].is_string() && error["message"].is_string(), "case {i}: {error}");
        if let Some(param) = param {
            assert_eq!(error["param"], *param, "case {i}");
        }
        assert!(reply.header("x-request-id").is_some(), "case {i}");
    }
    assert!(fleet.agent(0).engine.resident().is_empty(), "nothing reached the replica");
    // The replica's own errors on the path are in the same envelope.
    let direct = fleet
        .http
        .post(&format!("http://{}/v1/messages", fleet.agent(0).http_addr), &json!({"max_tokens": 1}))
        .await;
    assert_eq!((direct.status.as_u16(), direct.json()["type"].as_str()), (400, Some("error")));
    let wrong_method = fleet.http.get(&format!("http://{}/v1/messages", fleet.agent(0).http_addr)).await;
    assert_eq!((wrong_method.status.as_u16(), wrong_method.json()["type"].as_str()), (405, Some("error")));
}

/// With `--remote-tokenize` the replicas' template decides where inline system messages go:
/// one that refuses a system turn mid-conversation (as Qwen3.5's does) has vLLM fold them, so
/// the router, refused the conversation with them in place, asks again with them folded.
#[tokio::test]
async fn remote_tokenization_folds_inline_system_messages_the_replicas_template_refuses() {
    let template = std::env::temp_dir().join(format!("kvroute-refusing-{}.jinja", std::process::id()));
    std::fs::write(
        &template,
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
         {{ raise_exception('System message must be at the beginning.') }}{% endif %}\
         <|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    .unwrap();
    let agent = |name: &str| kvroute_replica_agent::Config {
        chat_template: Some(template.clone()),
        ..agent_config(name)
    };
    let fleet = Fleet::with(1, agent, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let body = messages(
        &text("foldsys", 40),
        json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "r"},
            {"role": "system", "content": "a reminder"}
        ]),
    );
    let prompts = &fleet.router.state.decider.prompts;
    assert_eq!(prompts.inline_system(), InlineSystem::Preserve, "the router's own template keeps them");
    let first = fleet.http.post(&fleet.url("/v1/messages"), &body).await;
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
    assert_eq!(prompts.inline_system(), InlineSystem::Fold, "remembered for the next ones");
    let again = fleet.http.post(&fleet.url("/v1/messages"), &body).await;
    assert_eq!(again.status, 200);
    assert!(predicted(&again) > 40, "{}", predicted(&again));
    assert_eq!(cache_read(&again), predicted(&again), "predicted as the replica renders it, folded");
    let _ = std::fs::remove_file(&template);
}
