//! The cache-aware proxy end to end: real replica agents behind a real router on loopback.

use std::collections::{BTreeMap, HashMap};

use http_body_util::BodyExt;
use kvroute_proto::CacheNamespace;
use kvroute_proto::openai::Endpoint;
use serde_json::{Value, json};

use crate::fleet::{FLEET_BLOCK, FLEET_MODEL, Fleet, agent_config};
use crate::support::{WAIT, sample, wait_until};

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": max_tokens})
}

/// A prompt of `words` distinct words starting with `tag`.
fn text(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{i}")).collect::<Vec<_>>().join(" ")
}

#[tokio::test]
async fn same_prefix_requests_land_on_the_replica_that_cached_them() {
    let fleet = Fleet::start(3).await;
    crate::fleet::prefixes_come_home(&fleet, 6).await;
}

/// A request for its prompt's logprobs reads no cache (vLLM skips the lookup): the router
/// predicts no hit for it, and the agent, as vLLM, reports none, though the replica holds the
/// prompt. (It used to be predicted the whole prefix, and sent for it.)
#[tokio::test]
async fn a_request_for_its_prompts_logprobs_is_predicted_no_hit() {
    let fleet = Fleet::start(2).await;
    let body = completion(&text("logprobs", 40), 1);
    let url = fleet.url("/v1/completions");
    fleet.http.post(&url, &body).await;
    let credits = fleet.router.fleet().credits();
    wait_until("the replica's events settle every credit", || credits.is_empty()).await;
    let again = fleet.http.post(&url, &body).await;
    let predicted = |reply: &crate::fleet::Reply| -> u64 {
        reply.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap()
    };
    assert!(predicted(&again) > 0 && again.cached_tokens() > 0);
    for asks in [json!({"prompt_logprobs": 0}), json!({"echo": true, "logprobs": 1})] {
        let mut logprobs = body.clone();
        logprobs.as_object_mut().unwrap().extend(asks.as_object().unwrap().clone());
        let reply = fleet.http.post(&url, &logprobs).await;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        assert_eq!((predicted(&reply), reply.cached_tokens()), (0, 0), "{asks}");
    }
}

/// Regression: a request for its prompt's logprobs, scored on no blocks, credited its whole
/// prompt as its own: failed on its replica, its withdrawal ended the credits an earlier
/// request of the same prompt had left there, still unconfirmed. It ends none it found.
#[tokio::test]
async fn a_prompt_logprobs_request_withdrawn_leaves_others_credits() {
    let fleet =
        Fleet::with(1, agent_config, |c| kvroute_router::Config { credit_ttl_ms: 3_600_000, ..c }).await;
    let decider = &fleet.router.state.decider;
    let body = completion(&text("withdrawn", 40), 1);
    let mut earlier = decider.explain(Endpoint::Completions, body.to_string().as_bytes()).await.unwrap();
    decider.credit(&mut earlier, 0);
    drop(earlier.hold.take());
    let credits = fleet.router.fleet().credits();
    let held = credits.len();
    assert_eq!(held, earlier.all_blocks.len(), "the earlier request's, unconfirmed");
    let mut logprobs = body.clone();
    logprobs["prompt_logprobs"] = json!(1);
    let mut failed = decider.explain(Endpoint::Completions, logprobs.to_string().as_bytes()).await.unwrap();
    assert!(failed.blocks.is_empty(), "scored on no blocks");
    decider.credit(&mut failed, 0);
    decider.withdraw_credit(&mut failed);
    assert_eq!(credits.len(), held, "the earlier request's credits stand");
}

/// Credits are predictions of blocks a replica is about to store; the blocks the index
/// already shows on the chosen replica get none, so once the replicas' events settle the
/// new blocks, no credit is left (with a TTL far beyond the test, only settling ends them).
#[tokio::test]
async fn credits_cover_only_blocks_the_index_does_not_show_yet() {
    let fleet =
        Fleet::with(2, agent_config, |c| kvroute_router::Config { credit_ttl_ms: 3_600_000, ..c }).await;
    let prefix = text("creditw", 40);
    for question in 0..4 {
        let prompt = format!("{prefix} and question {question}");
        let reply = fleet.http.post(&fleet.url("/v1/completions"), &completion(&prompt, 2)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let credits = fleet.router.fleet().credits();
        wait_until("the replica's events settle every credit", || credits.is_empty()).await;
    }
}

#[tokio::test]
async fn a_fleet_wide_shared_first_block_does_not_send_everything_to_one_replica() {
    let fleet =
        Fleet::with(4, |n| kvroute_replica_agent::Config { time_scale: 20.0, ..agent_config(n) }, |c| c)
            .await;
    let system = text("system", 24);
    let url = fleet.url("/v1/completions");
    let mut tasks = Vec::new();
    for i in 0..48 {
        let http = fleet.http.clone();
        let url = url.clone();
        let body = completion(&format!("{system} user question {i} {}", text(&format!("q{i}w"), 10)), 16);
        tasks.push(tokio::spawn(async move { http.post(&url, &body).await }));
    }
    let mut per_replica: HashMap<String, u32> = HashMap::new();
    for t in tasks {
        let reply = t.await.unwrap();
        assert_eq!(reply.status, 200);
        *per_replica.entry(reply.header("x-kvroute-replica").unwrap().to_owned()).or_default() += 1;
    }
    assert_eq!(per_replica.len(), 4, "every replica served some: {per_replica:?}");
    let max = *per_replica.values().max().unwrap() as f64;
    let mean = 48.0 / 4.0;
    assert!(max / mean <= 2.0, "load skew {} too high: {per_replica:?}", max / mean);

    // The same spread, per replica, in the router's metrics; nothing left in flight.
    let metrics = scrape(&fleet.http, &fleet.url("")).await;
    let retries = sample(&metrics, "kvroute_router_retries_total").unwrap();
    let mut sent = 0;
    for (replica, answered) in &per_replica {
        let series = |name: &str| format!("kvroute_router_replica_{name}{{replica=\"{replica}\"}}");
        let requests = sample(&metrics, &series("requests_total")).unwrap_or_else(|| panic!("{metrics}"));
        assert!(requests >= u64::from(*answered), "{replica}: {requests} sent, {answered} answered");
        sent += requests;
        assert_eq!(sample(&metrics, &series("in_flight")), Some(0), "{replica}");
        let eligible = format!("kvroute_router_replica_state{{replica=\"{replica}\",state=\"eligible\"}}");
        assert_eq!(sample(&metrics, &eligible), Some(1), "{metrics}");
    }
    assert_eq!(sent, 48 + retries, "every attempt counted once");
}

/// `kvroute_router_replica_state` says what a decision would: one ejected replica is
/// "ejected", but with every replica ejected the ejected are routed to, and are "eligible".
#[tokio::test]
async fn the_replica_state_gauge_judges_as_a_decision_does() {
    let fleet = Fleet::start(2).await;
    let state = |metrics: &str, replica: &str, state: &str| {
        sample(metrics, &format!("kvroute_router_replica_state{{replica=\"{replica}\",state=\"{state}\"}}"))
    };
    let eject = |name: &str| {
        let upstream = &fleet.router.fleet().member(name).unwrap().upstream;
        assert!(upstream.record_failure(1, std::time::Duration::from_secs(3600)));
    };
    eject("agent-0");
    let metrics = scrape(&fleet.http, &fleet.url("")).await;
    assert_eq!(state(&metrics, "agent-0", "ejected"), Some(1), "{metrics}");
    assert_eq!(state(&metrics, "agent-1", "eligible"), Some(1), "{metrics}");
    eject("agent-1");
    let reply = fleet.http.post(&fleet.url("/v1/completions"), &completion("still served", 1)).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let metrics = scrape(&fleet.http, &fleet.url("")).await;
    for replica in ["agent-0", "agent-1"] {
        assert_eq!(state(&metrics, replica, "eligible"), Some(1), "{metrics}");
    }
}

/// Prompts shorter than a block, one at a time at an idle fleet: ties between equally idle
/// replicas are broken by the prompt, so they spread instead of all going to one replica.
#[tokio::test]
async fn short_prompts_one_at_a_time_spread_over_an_idle_fleet() {
    let fleet = Fleet::with(2, agent_config, |c| kvroute_router::config::Config {
        policy: kvroute_router::policy::PolicyKind::LeastLoaded,
        ..c
    })
    .await;
    let url = fleet.url("/v1/completions");
    let mut per_replica: HashMap<String, u32> = HashMap::new();
    for i in 0..16 {
        let reply = fleet.http.post(&url, &completion(&format!("hi {i}"), 1)).await;
        assert_eq!(reply.status, 200);
        *per_replica.entry(reply.header("x-kvroute-replica").unwrap().to_owned()).or_default() += 1;
    }
    assert_eq!(per_replica.len(), 2, "both replicas served some: {per_replica:?}");
}

#[tokio::test]
async fn streaming_passes_chunks_through_before_the_response_ends() {
    let fleet =
        Fleet::with(2, |n| kvroute_replica_agent::Config { time_scale: 1.0, ..agent_config(n) }, |c| c).await;
    let body = json!({"model": FLEET_MODEL, "prompt": text("stream", 20), "max_tokens": 200, "stream": true,
                      "stream_options": {"include_usage": true}});
    let response = fleet.http.stream(&fleet.url("/v1/completions"), &body).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("x-kvroute-replica").is_some());
    let mut body = response.into_body();
    let first = crate::fleet::first_data(&mut body).await;
    assert!(std::str::from_utf8(&first).unwrap().starts_with("data: "));
    // 200 tokens at 6 ms per step take over a second: the first chunk came while the replica
    // was still generating (a router that gathered the response first would pass it on only
    // after the replica finished).
    let running: u32 = (0..2).map(|i| fleet.agent(i).engine.stats().running).sum();
    assert_eq!(running, 1, "the first chunk came before the replica finished");
    let first = String::from_utf8_lossy(&first);
    assert!(!first.contains("[DONE]"), "the first chunk came before the end: {first}");
    let rest = body.collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.trim_end().ends_with("data: [DONE]"));
    assert!(text.contains("\"cached_tokens\""));
}

/// The fleet's model list carries the served model's card as the replicas list it: its
/// context length (which clients size their prompts by), its owner. With no replica healthy
/// (the router still serves a fleet whose checks fail), the card they listed last stands.
#[tokio::test]
async fn the_model_list_carries_the_replicas_card() {
    let mut fleet =
        Fleet::with(2, |n| kvroute_replica_agent::Config { max_model_len: 3_000, ..agent_config(n) }, |c| c)
            .await;
    let listed = async || {
        let models = fleet.http.get(&fleet.url("/v1/models")).await.json();
        models["data"][0]["max_model_len"] == json!(3_000)
    };
    crate::support::wait_until_async("the replicas' card", listed).await;
    let models = fleet.http.get(&fleet.url("/v1/models")).await.json();
    let agent = fleet.http.get(&format!("{}/v1/models", fleet.agent(0).http_url())).await.json();
    for field in ["id", "object", "owned_by", "root", "parent", "max_model_len"] {
        assert_eq!(models["data"][0][field], agent["data"][0][field], "{field}");
    }

    fleet.kill(0).await;
    fleet.kill(1).await;
    let members = fleet.router.fleet().members();
    crate::support::wait_until("no replica healthy", || members.iter().all(|m| !m.upstream.is_healthy()))
        .await;
    let models = fleet.http.get(&fleet.url("/v1/models")).await.json();
    assert_eq!(models["data"][0]["max_model_len"], json!(3_000), "{models}");
}

#[tokio::test]
async fn a_killed_replica_loses_no_request_that_had_not_started() {
    let mut fleet = Fleet::start(3).await;
    fleet.kill(1).await;
    // Before any health check notices, requests routed to the dead replica are refused at
    // connect time and retried elsewhere.
    for i in 0..30 {
        let reply = fleet
            .http
            .post(&fleet.url("/v1/completions"), &completion(&text(&format!("k{i}w"), 12), 2))
            .await;
        assert_eq!(reply.status, 200, "request {i}: {}", String::from_utf8_lossy(&reply.body));
        assert_ne!(reply.header("x-kvroute-replica"), Some("agent-1"));
    }
}

#[tokio::test]
async fn malformed_oversized_and_unknown_requests_get_openai_errors() {
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config { max_body_bytes: 1024, ..c }).await;
    let url = fleet.url("/v1/completions");
    let cases = [
        (fleet.http.send(http::Method::POST, &url, "{not json").await, 400),
        (fleet.http.post(&url, &json!({"model": FLEET_MODEL})).await, 400),
        (fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": 7})).await, 400),
        (fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": "x".repeat(4096)})).await, 413),
        (
            fleet
                .http
                .post(&fleet.url("/v1/chat/completions"), &json!({"model": FLEET_MODEL, "messages": []}))
                .await,
            400,
        ),
        (fleet.http.get(&url).await, 405),
        (fleet.http.get(&fleet.url("/nope")).await, 404),
        // A routed path spelled so that the replica would read it as one, passed through,
        // would skip the router's limits: refused.
        (
            fleet
                .http
                .post(&fleet.url("/v1/%63ompletions"), &json!({"model": FLEET_MODEL, "prompt": "x"}))
                .await,
            400,
        ),
        (
            fleet
                .http
                .post(&fleet.url("/v1/completions/"), &json!({"model": FLEET_MODEL, "prompt": "x"}))
                .await,
            400,
        ),
    ];
    for (i, (reply, status)) in cases.iter().enumerate() {
        assert_eq!(reply.status.as_u16(), *status, "case {i}: {}", String::from_utf8_lossy(&reply.body));
        let error = &reply.json()["error"];
        assert!(error["message"].is_string() && error["type"].is_string(), "case {i}: {error}");
        assert!(error.get("param").is_some() && error.get("code").is_some(), "case {i}: {error}");
        assert!(reply.header("x-request-id").is_some(), "case {i}");
    }
    assert_eq!(cases[5].0.header("allow"), Some("POST"), "a 405 says which method");
    assert!(fleet.agent(0).engine.resident().is_empty(), "nothing reached the replica");
}

#[tokio::test]
async fn router_hashes_equal_the_blocks_the_replica_stores() {
    let fleet = Fleet::start(1).await;
    let decider = &fleet.router.state.decider;
    let chat = json!({"model": FLEET_MODEL, "messages": [
        {"role": "system", "content": text("sys", 30)},
        {"role": "user", "content": "what is the answer"}], "max_tokens": 2});
    let completion = completion(&text("parity", 33), 2);
    for (path, endpoint, body) in [
        ("/v1/completions", Endpoint::Completions, &completion),
        ("/v1/chat/completions", Endpoint::ChatCompletions, &chat),
    ] {
        let plan = decider.explain(endpoint, body.to_string().as_bytes()).await.unwrap();
        assert!(plan.blocks.len() >= 5, "{path}: several blocks");
        let reply = fleet.http.post(&fleet.url(path), body).await;
        assert_eq!(reply.status, 200);
        let resident: std::collections::HashSet<_> = fleet.agent(0).engine.resident().into_iter().collect();
        for b in plan.blocks.iter() {
            assert!(resident.contains(b), "{path}: router block {b} is what the replica stored");
        }
        let prompt_tokens = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(plan.prompt_tokens, prompt_tokens, "{path}: same token count");
    }
    // Token-id prompts skip tokenization and hash the same way.
    let ids: Vec<u32> = (100..140).collect();
    let body = json!({"model": FLEET_MODEL, "prompt": ids, "max_tokens": 1});
    let plan = decider.explain(Endpoint::Completions, body.to_string().as_bytes()).await.unwrap();
    assert_eq!(plan.blocks.len(), ids.len() / FLEET_BLOCK as usize);
    assert_eq!(fleet.http.post(&fleet.url("/v1/completions"), &body).await.status, 200);
    let resident: std::collections::HashSet<_> = fleet.agent(0).engine.resident().into_iter().collect();
    for b in plan.blocks.iter() {
        assert!(resident.contains(b), "token ids: router block {b} is what the replica stored");
    }
}

/// The prefix cache (on by default) gives every turn of a growing conversation the block
/// hashes the replica stores, and tokenizes only what is new.
#[tokio::test]
async fn a_conversations_turns_hash_like_the_replica_and_reuse_earlier_turns() {
    let fleet = Fleet::start(1).await;
    let mut messages = vec![json!({"role": "system", "content": text("system", 400)})];
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": text(&format!("q{turn}x"), 150)}));
        let body = json!({"model": FLEET_MODEL, "messages": messages, "max_tokens": 2});
        assert_parity(&fleet, "/v1/chat/completions", Endpoint::ChatCompletions, &body).await;
        messages.push(json!({"role": "assistant", "content": text(&format!("a{turn}x"), 60)}));
    }
    let metrics = scrape(&fleet.http, &fleet.url("")).await;
    let reused = sample(&metrics, "kvroute_router_tokenize_reused_bytes_total");
    assert!(reused.is_some_and(|bytes| bytes > 10_000), "{reused:?}");
}

#[tokio::test]
async fn two_routers_in_front_of_one_fleet_converge_to_the_same_index() {
    let fleet = Fleet::start(3).await;
    let second = kvroute_router::start(
        kvroute_router::Config {
            replicas: fleet
                .router
                .state
                .fleet()
                .members()
                .iter()
                // Listed the other way round: this router numbers the replicas otherwise.
                .rev()
                .map(|m| {
                    let s = &m.replica.spec;
                    kvroute_router::config::ReplicaConfig {
                        name: s.name.clone(),
                        http: s.http_url.clone(),
                        events: s.event_endpoint.clone(),
                        replay: s.replay_endpoint.clone(),
                        grpc: s.grpc_endpoint.clone(),
                        engine: kvroute_router::replicas::EngineKind::Kvroute,
                        dp_size: 1,
                        topic: String::new(),
                        role: s.role,
                        bootstrap_port: s.bootstrap_port,
                    }
                })
                .collect(),
            model: FLEET_MODEL.into(),
            block_size: FLEET_BLOCK,
            ..kvroute_router::Config::loopback(Vec::new())
        },
        fleet.shutdown.child_token(),
    )
    .await
    .unwrap();
    // On an idle fleet both send a new prompt to the same replica (ties are broken by the
    // replicas' names, not by each router's numbering of them).
    wait_until("the second router is ready", || second.state.ready()).await;
    for i in 0..12 {
        let body = completion(&text(&format!("tie{i}w"), 20), 1).to_string();
        let chosen = async |r: &kvroute_router::RunningRouter| {
            let plan = r.state.decider.explain(Endpoint::Completions, body.as_bytes()).await.unwrap();
            plan.chosen().map(|c| c.member.replica.spec.name.clone())
        };
        assert_eq!(chosen(&fleet.router).await, chosen(&second).await, "prompt {i}");
    }
    for i in 0..20 {
        let reply = fleet
            .http
            .post(&fleet.url("/v1/completions"), &completion(&text(&format!("conv{i}w"), 20), 1))
            .await;
        assert_eq!(reply.status, 200);
    }
    // By name: the routers number the replicas each its own way.
    let blocks = |r: &kvroute_router::RunningRouter| -> BTreeMap<String, usize> {
        r.fleet()
            .members()
            .iter()
            .map(|m| (m.replica.spec.name.clone(), r.state.decider.index.blocks(m.replica.id)))
            .collect()
    };
    let truth: BTreeMap<String, usize> =
        fleet.agents.iter().flatten().map(|a| (a.name.clone(), a.engine.resident().len())).collect();
    wait_until("both routers mirror every replica", || {
        blocks(&fleet.router) == truth && blocks(&second) == truth
    })
    .await;
    assert!(truth.values().sum::<usize>() > 0);
}

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/tests/data").join(name)
}

/// Blocks the router computes for `body` are blocks the replica stored after serving it.
async fn assert_parity(fleet: &Fleet, path: &str, endpoint: Endpoint, body: &Value) {
    let plan = fleet.router.state.decider.explain(endpoint, body.to_string().as_bytes()).await.unwrap();
    assert!(plan.blocks.len() >= 3, "{path}: several blocks");
    let reply = fleet.http.post(&fleet.url(path), body).await;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(plan.prompt_tokens, reply.json()["usage"]["prompt_tokens"].as_u64().unwrap(), "{path}");
    let resident: std::collections::HashSet<_> = fleet.agent(0).engine.resident().into_iter().collect();
    assert!(
        plan.blocks.iter().all(|b| resident.contains(b)),
        "{path}: router blocks were stored by the replica"
    );
    // And the next identical request is predicted and served as a full-prefix hit.
    let again = fleet.http.post(&fleet.url(path), body).await;
    let predicted: u64 = again.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
    assert_eq!(predicted, again.cached_tokens(), "{path}");
    assert!(predicted > 0);
}

#[tokio::test]
async fn a_huggingface_tokenizer_and_chat_template_hash_like_the_replica() {
    let fleet = Fleet::with(
        1,
        |n| kvroute_replica_agent::Config {
            tokenizer: Some(fixture("tiny-tokenizer.json")),
            chat_template: Some(fixture("tiny-tokenizer_config.json")),
            ..agent_config(n)
        },
        |c| kvroute_router::Config {
            tokenizer: Some(fixture("tiny-tokenizer.json")),
            tokenizer_config: Some(fixture("tiny-tokenizer_config.json")),
            ..c
        },
    )
    .await;
    let chat = json!({"model": FLEET_MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": "You route requests to the replica that cached them."},
        {"role": "user", "content": "Which replica holds the longest prefix of this question?"}]});
    assert_parity(&fleet, "/v1/chat/completions", Endpoint::ChatCompletions, &chat).await;
    let completion = completion("A completion prompt, tokenized with a byte-level BPE and a BOS token.", 1);
    assert_parity(&fleet, "/v1/completions", Endpoint::Completions, &completion).await;
}

#[tokio::test]
async fn remote_tokenization_asks_a_replica_and_hashes_like_it() {
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let chat = json!({"model": FLEET_MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": text("remote", 30)}]});
    assert_parity(&fleet, "/v1/chat/completions", Endpoint::ChatCompletions, &chat).await;
    assert_parity(&fleet, "/v1/completions", Endpoint::Completions, &completion(&text("rc", 30), 1)).await;
    // Truncation needs the ids the tokenizer adds, asked with an empty prompt.
    let mut truncated = completion(&text("rt", 30), 1);
    truncated["truncate_prompt_tokens"] = json!(40);
    assert_parity(&fleet, "/v1/completions", Endpoint::Completions, &truncated).await;
}

/// `truncate_prompt_tokens: -1` keeps the context length less the output tokens: the router
/// learns the context from the replicas' model cards and cuts the prompt as the replica does.
/// (It used to hash the whole prompt, whose first blocks the replica never keeps.)
#[tokio::test]
async fn minus_one_truncates_to_the_context_the_replicas_list() {
    let fleet =
        Fleet::with(1, |n| kvroute_replica_agent::Config { max_model_len: 40, ..agent_config(n) }, |c| c)
            .await;
    let tokenization = || fleet.router.state.decider.prompts.tokenization();
    crate::support::wait_until("the context length is learned", || tokenization().context_len() == Some(40))
        .await;
    let mut truncated = completion(&text("ctx", 60), 4);
    truncated["truncate_prompt_tokens"] = json!(-1);
    assert_parity(&fleet, "/v1/completions", Endpoint::Completions, &truncated).await;
    let plan =
        fleet.router.state.decider.explain(Endpoint::Completions, truncated.to_string().as_bytes()).await;
    assert_eq!(plan.unwrap().prompt_tokens, 36);
    let chat = json!({"model": FLEET_MODEL, "max_tokens": 4, "truncate_prompt_tokens": -1, "messages": [
        {"role": "user", "content": text("chat", 60)}]});
    assert_parity(&fleet, "/v1/chat/completions", Endpoint::ChatCompletions, &chat).await;
}

/// With `--remote-tokenize`, a replica whose `/tokenize` fails (500) is followed by the next:
/// the prompts it was asked for are tokenized by the healthy one.
#[tokio::test]
async fn remote_tokenization_asks_the_next_replica_when_one_fails() {
    let (failing, mut asked) =
        crate::headers::recording_replica(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
            .await;
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    // Added once the router is ready: its events never come.
    let broken: kvroute_router::config::ReplicaConfig =
        format!("name=broken,http=http://{failing},events={},engine=kvroute", crate::support::nowhere())
            .parse()
            .unwrap();
    fleet.router.fleet().add(broken.to_spec(FLEET_MODEL, FLEET_BLOCK)).unwrap();
    // Turns go by a hash keyed anew in each process: with 8 prompts, 1 run in 128 gave every
    // turn to one replica; with 32, 1 in 2^31.
    const PROMPTS: usize = 32;
    for i in 0..PROMPTS {
        let body = completion(&text(&format!("failover{i}"), 30), 1).to_string();
        let plan = fleet.router.state.decider.explain(Endpoint::Completions, body.as_bytes()).await;
        let plan = plan.unwrap_or_else(|e| panic!("prompt {i}: {e}"));
        assert!(plan.blocks.len() >= 3, "prompt {i}");
    }
    let mut failed = 0;
    while let Ok(seen) = asked.try_recv() {
        assert!(seen.line.starts_with("POST /tokenize "), "{}", seen.line);
        failed += 1;
    }
    assert!((1..PROMPTS).contains(&failed), "the broken replica had its turns, not all: {failed}");
}

/// With `--remote-tokenize`, an answer far larger than the prompt asked could tokenize to is
/// not read: the next replica is asked (a short prompt cannot cost the router megabytes).
#[tokio::test]
async fn a_tokenize_answer_larger_than_its_prompt_is_not_read() {
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let bloated: &'static str =
        Box::leak(format!("{{\"tokens\":[{}1]}}", "1,".repeat(1 << 20)).into_boxed_str());
    let bloated_addr = {
        let asked = asked.clone();
        hand_made_replica(move |path, _| {
            let asked = asked.clone();
            async move {
                match path.as_str() {
                    "/tokenize" => {
                        asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        (200, bloated)
                    }
                    _ => (404, ""),
                }
            }
        })
        .await
    };
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let bloated: kvroute_router::config::ReplicaConfig = format!(
        "name=bloated,http=http://{bloated_addr},events={},engine=kvroute",
        crate::support::nowhere()
    )
    .parse()
    .unwrap();
    fleet.router.fleet().add(bloated.to_spec(FLEET_MODEL, FLEET_BLOCK)).unwrap();
    // Turns go by a hash of the prompt keyed at random each run: with 8 prompts, one run in
    // 256 gave the bloated replica none.
    for i in 0..24 {
        let body = completion(&text(&format!("bloat{i}"), 30), 1).to_string();
        let plan = fleet.router.state.decider.explain(Endpoint::Completions, body.as_bytes()).await;
        let plan = plan.unwrap_or_else(|e| panic!("prompt {i}: {e}"));
        assert!((3..40).contains(&plan.blocks.len()), "prompt {i}: {} blocks", plan.blocks.len());
    }
    assert!(asked.load(std::sync::atomic::Ordering::Relaxed) > 0, "the bloated replica had its turns");
}

/// With `--remote-tokenize`, a replica that leaves the fleet while a request's prompt is
/// being tokenized is not chosen for it; one that joined meanwhile is.
#[tokio::test]
async fn a_replica_removed_during_a_remote_tokenization_is_not_chosen() {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (leaving, mut tokenizing) = gated_tokenize_replica(gate.clone()).await;
    let (router, shutdown) =
        router_in_front_of(leaving, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let joining = gated_tokenize_replica(std::sync::Arc::new(tokio::sync::Semaphore::new(0))).await.0;
    let url = format!("{}/v1/completions", router.url());
    let sent = tokio::spawn(async move {
        crate::fleet::Http::new().post(&url, &completion(&text("leaving", 30), 1)).await
    });
    tokio::time::timeout(WAIT, tokenizing.recv())
        .await
        .expect("in time")
        .expect("the prompt is sent to /tokenize");
    let joining: kvroute_router::config::ReplicaConfig =
        format!("name=r1,http=http://{joining},events={},engine=kvroute", crate::support::nowhere())
            .parse()
            .unwrap();
    router.fleet().add(joining.to_spec(FLEET_MODEL, FLEET_BLOCK)).unwrap();
    router.fleet().remove("r0").await.expect("r0 was a member");
    gate.add_permits(1);
    let reply = sent.await.unwrap();
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.header("x-kvroute-replica"), Some("r1"));
    shutdown.cancel();
}

/// A decision that fails (here its remote tokenization: the replica's `/tokenize` answers
/// 500) still counts in the decision-time histogram: slow failures are where it matters.
#[tokio::test]
async fn a_failed_decision_is_timed() {
    let replica = hand_made_replica(|path, _| async move {
        match path.as_str() {
            "/tokenize" => (500, r#"{"error":{"message":"broken"}}"#),
            _ => (200, ""),
        }
    })
    .await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let http = crate::fleet::Http::new();
    let reply = http.post(&format!("{}/v1/completions", router.url()), &completion("tokenize me", 1)).await;
    assert!(reply.status.as_u16() >= 400, "the decision failed: {}", reply.status);
    let metrics = http.get(&format!("{}/metrics", router.url())).await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let count = text.lines().find_map(|l| l.strip_prefix("kvroute_router_decision_seconds_count ")).unwrap();
    assert_eq!(count.trim(), "1", "{text}");
    shutdown.cancel();
}

/// Every forwarded response's time to its end is counted, however it ended (here one answer
/// and one error answer), beside its time to the first byte.
#[tokio::test]
async fn each_response_is_timed_to_its_end() {
    let replica = hand_made_replica(|path, body| async move {
        match (path == "/v1/completions", String::from_utf8_lossy(&body).contains("refused")) {
            (false, _) => (200, ""),
            (true, false) => (200, r#"{"choices":[{"text":"ok"}]}"#),
            (true, true) => (400, r#"{"error":{"message":"no","type":"BadRequestError","code":400}}"#),
        }
    })
    .await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let http = crate::fleet::Http::new();
    let url = format!("{}/v1/completions", router.url());
    assert_eq!(http.post(&url, &completion("fine", 1)).await.status, 200);
    assert_eq!(http.post(&url, &completion("refused", 1)).await.status, 400);
    let metrics = http.get(&format!("{}/metrics", router.url())).await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert_eq!(sample(&text, "kvroute_router_upstream_duration_seconds_count"), Some(2), "{text}");
    let sum = |name: &str| -> f64 {
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()).unwrap()
    };
    assert!(
        sum("kvroute_router_upstream_duration_seconds_sum")
            >= sum("kvroute_router_upstream_ttfb_seconds_sum")
    );
    shutdown.cancel();
}

/// The realized hit rate's denominator counts only requests whose answer reported its cached
/// tokens: an error answer, or a stream without `include_usage`, reports none, and counted
/// there it made the realized rate look lower than the predicted one for the same hits.
#[tokio::test]
async fn only_answers_with_usage_count_toward_the_realized_hit_rate() {
    let replica = hand_made_replica(|path, body| async move {
        let usage = String::from_utf8_lossy(&body).contains("reported");
        match (path == "/v1/completions", usage) {
            (false, _) => (200, ""),
            (true, true) => {
                (200, r#"{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":3}}}"#)
            }
            (true, false) => (400, r#"{"error":{"message":"too long","type":"BadRequestError","code":400}}"#),
        }
    })
    .await;
    // No events ever come (`nowhere`): an unreachable stream would end the credits.
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        credit_ttl_ms: 600_000,
        events_fallback_ms: 3_600_000,
        ..c
    })
    .await;
    let http = crate::fleet::Http::new();
    let counter = async |name: &str| -> u64 {
        let metrics = http.get(&format!("{}/metrics", router.url())).await;
        let metrics = String::from_utf8_lossy(&metrics.body).into_owned();
        let line = format!("kvroute_router_{name}_total ");
        metrics.lines().find_map(|l| l.strip_prefix(&line)?.trim().parse().ok()).unwrap_or(0)
    };
    let url = format!("{}/v1/completions", router.url());
    let refused = http.post(&url, &completion(&text("refused", 20), 1)).await;
    assert_eq!(refused.status, 400);
    let routed = counter("prompt_tokens").await;
    assert!(routed >= 20, "{routed}");
    assert_eq!(counter("reported_prompt_tokens").await, 0);
    let reported = http.post(&url, &completion(&text("reported", 30), 1)).await;
    assert_eq!(reported.status, 200);
    let all = counter("prompt_tokens").await;
    assert_eq!(counter("reported_prompt_tokens").await, all - routed, "the second request's alone");
    assert_eq!(counter("realized_cached_tokens").await, 3);
    // The same prompt again: the first one's blocks are credited to the replica.
    let again = http.post(&url, &completion(&text("reported", 30), 1)).await;
    let predicted: u64 = again.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
    assert!(predicted > 0);
    assert_eq!(counter("reported_predicted_cached_tokens").await, predicted);
    shutdown.cancel();
}

/// A batch of prompts counts in none of the hit rates' counters: the router predicts its first
/// prompt's hit, the replica reports every prompt's, and counted they made the realized rate
/// look up to the batch's size times the predicted one. Nor do several choices of one prompt
/// (`n`): the replica reports a choice that found the prompt the first one cached.
#[tokio::test]
async fn a_batch_of_prompts_or_of_choices_counts_in_no_hit_rate() {
    let replica = hand_made_replica(|path, _| async move {
        match path.as_str() {
            "/v1/completions" => {
                (200, r#"{"usage":{"prompt_tokens":60,"prompt_tokens_details":{"cached_tokens":40}}}"#)
            }
            _ => (200, ""),
        }
    })
    .await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let http = crate::fleet::Http::new();
    let batch = json!({"model": FLEET_MODEL, "max_tokens": 1, "prompt": [text("one", 30), text("two", 30)]});
    assert_eq!(http.post(&format!("{}/v1/completions", router.url()), &batch).await.status, 200);
    let choices = json!({"model": FLEET_MODEL, "max_tokens": 1, "n": 2, "prompt": text("three", 30)});
    assert_eq!(http.post(&format!("{}/v1/completions", router.url()), &choices).await.status, 200);
    let metrics = scrape(&http, &router.url()).await;
    for counter in ["prompt_tokens", "realized_cached_tokens", "reported_prompt_tokens"] {
        let series = format!("kvroute_router_{counter}_total");
        assert_eq!(sample(&metrics, &series).unwrap_or(0), 0, "{counter}: {metrics}");
    }
    shutdown.cancel();
}

/// The router's own probes and scrapes are not counted as requests (a readiness probe's 503s
/// before the first sync looked like failed requests); `HEAD` is answered like `GET` there.
#[tokio::test]
async fn probes_and_scrapes_are_not_counted_as_requests() {
    let (replica, _seen) =
        crate::headers::recording_replica(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { events_fallback_ms: 200, ..c }).await;
    let http = crate::fleet::Http::new();
    let ready = format!("{}/ready", router.url());
    // 503 until the replica's stream is given up for load alone (no events ever come).
    crate::support::wait_until_async("ready", async || http.get(&ready).await.status == 200).await;
    for path in ["/health", "/ready", "/metrics", "/v1/models"] {
        let head = http.send(http::Method::HEAD, &format!("{}{path}", router.url()), "").await;
        assert_eq!(head.status, 200, "HEAD {path}");
        assert!(head.body.is_empty(), "HEAD {path}");
    }
    let metrics = scrape(&http, &router.url()).await;
    assert_eq!(
        sample(&metrics, "kvroute_router_requests_total{code=\"200\"}"),
        Some(1),
        "/v1/models only: {metrics}"
    );
    let routed = http.post(&format!("{}/v1/completions", router.url()), &completion("hi", 1)).await;
    assert_eq!(routed.status, 200);
    let metrics = scrape(&http, &router.url()).await;
    assert_eq!(sample(&metrics, "kvroute_router_requests_total{code=\"200\"}"), Some(2), "{metrics}");
    shutdown.cancel();
}

/// Over HTTP/2 a HEAD the router answers itself, or refuses, gets its status and headers
/// and no body: hyper leaves the body out over HTTP/1 only, and an HTTP/2 client resets a
/// HEAD's stream that carries DATA.
#[tokio::test]
async fn an_http2_head_gets_no_body() {
    let (replica, _seen) =
        crate::headers::recording_replica(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        health_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..c
    })
    .await;
    let (proxy, probes) = (router.addr, router.health_addr.unwrap());
    for (addr, path, status) in [
        (proxy, "/v1/models", 200),
        (proxy, "/health", 200),
        (proxy, "/metrics", 200),
        (proxy, "/ready", 503),
        (proxy, "/no/such/path", 404),
        (proxy, "/v1/completions", 405),
        (probes, "/health", 200),
        (probes, "/ready", 503),
        (probes, "/metrics", 200),
    ] {
        let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(addr).await.unwrap());
        let (mut h2, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .handshake::<_, http_body_util::Empty<bytes::Bytes>>(io)
            .await
            .unwrap();
        tokio::spawn(conn);
        let request = http::Request::head(format!("http://{addr}{path}")).body(Default::default()).unwrap();
        let response = h2.send_request(request).await.unwrap();
        assert_eq!(response.status(), status, "HEAD {path}");
        let body = http_body_util::BodyExt::collect(response.into_body()).await;
        assert!(body.is_ok_and(|b| b.to_bytes().is_empty()), "HEAD {path}: the stream was reset");
    }
    shutdown.cancel();
}

/// A request passed through (here `/v1/embeddings`, its body streamed) goes on to the next
/// replica when the first refuses the connection: none of its body was read, and the
/// replica is counted as failing. It was a 502.
#[tokio::test]
async fn a_passed_through_request_goes_on_past_a_replica_that_refuses_the_connection() {
    const BODY: &str = r#"{"model":"m","input":"the whole body arrives"}"#;
    let live = hand_made_replica(|_, body| async move {
        match body == BODY.as_bytes() {
            true => (200, "{}"),
            false => (400, "{\"error\":\"the body was not whole\"}"),
        }
    })
    .await;
    let closed = kvroute_proto::loopback_port::unused().unwrap();
    let spec = |name: &str, at: String| {
        format!("name={name},http=http://{at},events={},engine=kvroute", crate::support::nowhere())
            .parse()
            .unwrap()
    };
    let config = kvroute_router::Config {
        model: FLEET_MODEL.into(),
        replicas: vec![spec("gone", format!("127.0.0.1:{closed}")), spec("live", live.to_string())],
        // Health checks would find the closed port first and leave nothing to retry.
        health_interval_ms: 3_600_000,
        ..kvroute_router::Config::loopback(Vec::new())
    };
    // With both ejected too: then the ejected are tried, and so is the next of them.
    for ejected in [false, true] {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let router = kvroute_router::start(config.clone(), shutdown.clone()).await.unwrap();
        let http = crate::fleet::Http::new();
        for name in ["gone", "live"].into_iter().filter(|_| ejected) {
            let upstream = &router.fleet().member(name).unwrap().upstream;
            assert!(upstream.record_failure(1, std::time::Duration::from_secs(3600)));
        }
        // Ties between equally loaded replicas go by the request id: some ids try `gone` first.
        let mut retried = false;
        for i in 0..64 {
            let reply = http
                .send_with(
                    http::Method::POST,
                    &format!("{}/v1/embeddings", router.url()),
                    BODY,
                    &[("x-request-id", &format!("p-{i}"))],
                )
                .await;
            assert_eq!(
                (reply.status.as_u16(), reply.header("x-kvroute-replica")),
                (200, Some("live")),
                "{:?}",
                reply.body
            );
            if sample(&scrape(&http, &router.url()).await, "kvroute_router_retries_total").unwrap_or(0) > 0 {
                retried = true;
                break;
            }
        }
        assert!(retried, "no request was tried on the closed replica first (ejected: {ejected})");
        shutdown.cancel();
    }
}

/// A fleet whose `/health` answers late under load (vLLM's, at its peak) stays in service:
/// with no replica up, those whose checks only went unanswered in time are still tried. Every
/// request got 503 "no healthy replica".
#[tokio::test]
async fn a_fleet_late_to_its_health_checks_still_serves() {
    let late = hand_made_replica(|path, _| async move {
        if path == "/health" {
            std::future::pending::<()>().await;
        }
        (200, "{}")
    })
    .await;
    let spec = format!("name=late,http=http://{late},events={},engine=kvroute", crate::support::nowhere());
    let config = kvroute_router::Config {
        model: FLEET_MODEL.into(),
        replicas: vec![spec.parse().unwrap()],
        health_interval_ms: 20,
        health_timeout_ms: 50,
        unhealthy_after: 1,
        ..kvroute_router::Config::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    let upstream = router.fleet().member("late").unwrap().upstream;
    crate::support::wait_until("the replica's checks failing", || !upstream.passes_checks()).await;
    let reply = crate::fleet::Http::new()
        .send_with(http::Method::POST, &format!("{}/v1/embeddings", router.url()), r#"{"input":"x"}"#, &[])
        .await;
    assert_eq!(
        (reply.status.as_u16(), reply.header("x-kvroute-replica")),
        (200, Some("late")),
        "{:?}",
        reply.body
    );
    // The admin service says why a replica that is not healthy is still served.
    let mut admin =
        kvroute_proto::pb::router_admin_client::RouterAdminClient::connect(router.admin_url()).await.unwrap();
    let list = admin.list_replicas(kvroute_proto::pb::ListReplicasRequest {}).await.unwrap().into_inner();
    assert_eq!(list.replicas.iter().map(|r| (r.healthy, r.health_late)).collect::<Vec<_>>(), [(false, true)]);
    shutdown.cancel();
}

/// A body in a transfer coding besides `chunked` (`gzip, chunked`) is refused with 501 (RFC
/// 9112 §6.1): hyper takes off the chunking only, and the replica got the compressed bytes
/// as the body, with nothing to say so.
#[tokio::test]
async fn a_body_in_a_foreign_transfer_coding_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (replica, mut seen) =
        crate::headers::recording_replica(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    for path in ["/v1/embeddings", "/v1/completions"] {
        let mut stream = tokio::net::TcpStream::connect(router.addr).await.unwrap();
        let request = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: gzip, chunked\r\n\r\n4\r\n\x1f\x7f\x08\x00\r\n0\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(crate::support::WAIT, stream.read_to_end(&mut answer)).await.unwrap().unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 501"), "{path}: {answer}");
        assert!(answer.contains("transfer coding \\\"gzip\\\""), "{path}: {answer}");
    }
    assert!(seen.try_recv().is_err(), "nothing reached the replica");
    shutdown.cancel();
}

/// A completion whose prompt comes as embeddings (vLLM's `prompt_embeds`, with
/// `--enable-prompt-embeds`) has no token ids to route on: it goes to a replica by load, and
/// counts in neither hit rate. It was refused with a 400 for its missing `prompt`.
#[tokio::test]
async fn a_completion_of_prompt_embeddings_goes_by_load() {
    const BODY: &str = r#"{"model":"m","prompt_embeds":"AAAAAAAAAAA=","max_tokens":1}"#;
    let replica = hand_made_replica(|path, body| async move {
        match (path.as_str(), body == BODY.as_bytes()) {
            ("/v1/completions", true) => (200, r#"{"usage":{"prompt_tokens":4}}"#),
            _ => (400, "{}"),
        }
    })
    .await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { max_completion_tokens: 100, ..c }).await;
    let http = crate::fleet::Http::new();
    let url = format!("{}/v1/completions", router.url());
    let reply = http.send(http::Method::POST, &url, BODY).await;
    assert_eq!(
        (reply.status.as_u16(), reply.header("x-kvroute-replica")),
        (200, Some("r0")),
        "{:?}",
        reply.body
    );
    let metrics = scrape(&http, &router.url()).await;
    assert_eq!(sample(&metrics, "kvroute_router_prompt_tokens_total"), Some(0), "{metrics}");
    // Within the router's limits all the same.
    let over = r#"{"model":"m","prompt_embeds":"AAAAAAAAAAA=","max_tokens":101}"#;
    let reply = http.send(http::Method::POST, &url, over).await;
    assert_eq!(reply.status, 400, "{:?}", reply.body);
    assert_eq!(reply.json()["error"]["param"], "max_tokens");
    shutdown.cancel();
}

/// A client that leaves before its answer is counted as a 499 in `requests_total` (it was in
/// the access log only).
#[tokio::test]
async fn a_client_that_leaves_before_its_answer_is_counted() {
    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
    let (replica, read) = slow_body_reading_replica(answer, std::time::Duration::from_secs(30)).await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let client =
        post_once_the_replica_has_it(&router, "/v1/completions", &completion("leaving", 1), &read).await;
    drop(client);
    let http = crate::fleet::Http::new();
    let series = "kvroute_router_requests_total{code=\"499\"}";
    crate::support::wait_until_async("the 499 counted", async || {
        sample(&scrape(&http, &router.url()).await, series) == Some(1)
    })
    .await;
    shutdown.cancel();
}

/// A client that leaves in the middle of its request body is a client that left (499), not
/// a malformed request: it was counted as a 400 and a `bad_request` error.
#[tokio::test]
async fn a_client_that_leaves_mid_body_is_counted_as_one_that_left() {
    use tokio::io::AsyncWriteExt;
    let replica = hand_made_replica(|_, _| async { (200, "{}") }).await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let http = crate::fleet::Http::new();
    for path in ["/v1/completions", "/v1/embeddings"] {
        let mut stream = tokio::net::TcpStream::connect(router.addr).await.unwrap();
        let head = format!("POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n{{\"model\":");
        stream.write_all(head.as_bytes()).await.unwrap();
        drop(stream);
    }
    let series = "kvroute_router_requests_total{code=\"499\"}";
    crate::support::wait_until_async("both counted as 499", async || {
        sample(&scrape(&http, &router.url()).await, series) == Some(2)
    })
    .await;
    // HTTP/2: the client resets its stream mid-body (drops the request it was sending).
    let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(router.addr).await.unwrap());
    type Chunks = http_body_util::StreamBody<
        tokio_stream::wrappers::ReceiverStream<
            Result<hyper::body::Frame<bytes::Bytes>, std::convert::Infallible>,
        >,
    >;
    let (mut h2, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .handshake::<_, Chunks>(io)
        .await
        .unwrap();
    tokio::spawn(conn);
    let (chunks, rx) = tokio::sync::mpsc::channel(4);
    let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let request = http::Request::post(format!("http://{}/v1/completions", router.addr)).body(body).unwrap();
    chunks.send(Ok(hyper::body::Frame::data(bytes::Bytes::from_static(b"{\"model\":")))).await.unwrap();
    let sending = tokio::spawn(h2.send_request(request));
    crate::support::wait_until_async("the HTTP/2 request in flight", async || {
        sample(&scrape(&http, &router.url()).await, "kvroute_router_in_flight") == Some(1)
    })
    .await;
    sending.abort();
    crate::support::wait_until_async("all three counted as 499", async || {
        sample(&scrape(&http, &router.url()).await, series) == Some(3)
    })
    .await;
    drop(chunks);
    let metrics = scrape(&http, &router.url()).await;
    assert_eq!(sample(&metrics, "kvroute_router_requests_total{code=\"400\"}"), None, "{metrics}");
    shutdown.cancel();
}

/// A replica whose `POST /tokenize` reports on `tokenizing` and then waits for a permit of
/// `gate` before it answers three tokens; anything else gets an empty 200 at once.
async fn gated_tokenize_replica(
    gate: std::sync::Arc<tokio::sync::Semaphore>,
) -> (std::net::SocketAddr, tokio::sync::mpsc::UnboundedReceiver<()>) {
    let (tell, tokenizing) = tokio::sync::mpsc::unbounded_channel();
    let replica = hand_made_replica(move |path, _| {
        let (gate, tell) = (gate.clone(), tell.clone());
        async move {
            if path != "/tokenize" {
                return (200, "{}");
            }
            let _ = tell.send(());
            gate.acquire().await.unwrap().forget();
            (200, THREE_TOKENS)
        }
    })
    .await;
    (replica, tokenizing)
}

/// `/tokenize`'s answer of the hand-made replicas: three tokens.
const THREE_TOKENS: &str = r#"{"count":3,"max_model_len":4096,"tokens":[5,6,7]}"#;

/// A replica that answers each request with the status and body `answer` makes of its path
/// and body.
pub(crate) async fn hand_made_replica<F, A>(answer: F) -> std::net::SocketAddr
where
    F: Fn(String, bytes::Bytes) -> A + Clone + Send + Sync + 'static,
    A: std::future::Future<Output = (u16, &'static str)> + Send,
{
    use hyper::service::service_fn;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = answer.clone();
            let service = service_fn(move |request: http::Request<hyper::body::Incoming>| {
                let answer = answer.clone();
                async move {
                    let path = request.uri().path().to_owned();
                    let body = request.into_body().collect().await?.to_bytes();
                    let (status, text) = answer(path, body).await;
                    let mut response =
                        http::Response::new(http_body_util::Full::new(bytes::Bytes::from(text)));
                    *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
                    Ok::<_, hyper::Error>(response)
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(io, service));
        }
    });
    addr
}

/// Sends `request` raw on a new connection to the router and reads the response to its end
/// (`connection: close`).
async fn raw_exchange(router: &kvroute_router::RunningRouter, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = router.url().trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut response))
        .await
        .expect("the response's end in time")
        .unwrap();
    String::from_utf8_lossy(&response).into_owned()
}

/// Other `/v1/*` requests stream to a replica, whatever their body's framing; a body that
/// outgrows the limit on its way is the client's error (413), not a failure of the replica.
/// (It used to be answered 502 and counted against the replica, so three oversized uploads
/// ejected it.) The agent answers unknown paths with 404 without reading the body, and when
/// that answer beats the body's end, it is what the client gets.
#[tokio::test]
async fn other_v1_requests_stream_through_and_oversized_uploads_do_not_eject_replicas() {
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config {
        max_body_bytes: 1024,
        eject_after: 1,
        ..c
    })
    .await;
    let small = "POST /v1/embeddings HTTP/1.1\r\nhost: t\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n\
        5\r\nhello\r\n0\r\n\r\n";
    let answer = raw_exchange(&fleet.router, small.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 404"), "the replica's own answer: {answer}");
    assert!(answer.contains("x-kvroute-replica: "), "{answer}");
    assert!(answer.contains("not_found"), "{answer}");
    // The engines' own paths outside /v1 pass too: the agent's vLLM-style /tokenize answers.
    let tokenize =
        fleet.http.post(&fleet.url("/tokenize"), &json!({"model": FLEET_MODEL, "prompt": "a b c"})).await;
    assert_eq!(tokenize.status, 200, "{:?}", tokenize.body);
    assert_eq!(tokenize.json()["count"], 3);
    assert!(tokenize.header("x-kvroute-replica").is_some());

    let chunk = format!("258\r\n{}\r\n", "x".repeat(600));
    let oversized = format!(
        "POST /v1/embeddings HTTP/1.1\r\nhost: t\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n{}0\r\n\r\n",
        chunk.repeat(3)
    );
    for _ in 0..3 {
        let answer = raw_exchange(&fleet.router, oversized.as_bytes()).await;
        let own = answer.starts_with("HTTP/1.1 413");
        assert!(own || answer.contains("x-kvroute-replica: "), "{answer}");
        assert!(own || answer.starts_with("HTTP/1.1 404"), "{answer}");
        assert!(answer.contains("invalid_request_error"), "{answer}");
    }
    let reply = fleet.http.post(&fleet.url("/v1/completions"), &completion("still eligible", 2)).await;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    let metrics = String::from_utf8_lossy(&fleet.http.get(&fleet.url("/metrics")).await.body).into_owned();
    assert!(metrics.contains("kvroute_router_ejections_total 0"), "{metrics}");
}

/// The same with a replica that reads a body to its end before answering, as most do: the
/// client always gets the router's 413 (the agent's early 404 may beat it above), and the
/// replica is not held to blame.
#[tokio::test]
async fn an_upload_that_outgrows_the_limit_is_the_routers_413() {
    let replica = hand_made_replica(|_, _| async { (200, "{}") }).await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { max_body_bytes: 1024, eject_after: 1, ..c })
            .await;
    let chunk = format!("258\r\n{}\r\n", "x".repeat(600));
    let oversized = format!(
        "POST /v1/embeddings HTTP/1.1\r\nhost: t\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n{}0\r\n\r\n",
        chunk.repeat(3)
    );
    for _ in 0..3 {
        let answer = raw_exchange(&router, oversized.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("invalid_request_error") && answer.contains("x-request-id"), "{answer}");
    }
    let http = crate::fleet::Http::new();
    let metrics =
        String::from_utf8_lossy(&http.get(&format!("{}/metrics", router.url())).await.body).into_owned();
    assert!(metrics.contains("kvroute_router_ejections_total 0"), "{metrics}");
    shutdown.cancel();
}

/// An answer that is not streamed has its first byte only at its end: the request's prefill
/// leaves the replica's pending count when the replica's events store its prompt, while the
/// answer is still being generated (before, only at the end, so a replica busy decoding
/// looked as if it had all those prompts still to prefill).
#[tokio::test]
async fn a_whole_answers_prefill_ends_with_the_replicas_events() {
    // Real time: 4000 tokens take the agent tens of seconds.
    let slow = |name: &str| kvroute_replica_agent::Config { time_scale: 1.0, ..agent_config(name) };
    let fleet = Fleet::with(1, slow, |c| c).await;
    let member = fleet.router.fleet().member("agent-0").unwrap();
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let answer = tokio::spawn(async move { http.post(&url, &completion(&text("whole", 40), 4000)).await });
    // (Its prefill is counted at the decision, and may be gone before a poll sees it.)
    wait_until("the request is in flight", || member.upstream.load().in_flight == 1).await;
    wait_until("its prefill leaves the pending count while it is generated", || {
        member.upstream.load().pending_prefill_tokens == 0
    })
    .await;
    assert_eq!(member.upstream.load().in_flight, 1);
    assert!(!answer.is_finished());
    answer.abort();
}

/// Requests that pass through to an idle fleet spread over it (ties by request id): before,
/// every lone `/tokenize` or `/v1/embeddings` went to the first replica.
#[tokio::test]
async fn requests_passing_through_to_an_idle_fleet_spread() {
    let fleet = Fleet::start(3).await;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..30 {
        let reply = fleet.http.post(&fleet.url("/tokenize"), &json!({"prompt": "a b c"})).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        seen.insert(reply.header("x-kvroute-replica").expect("a replica").to_owned());
    }
    // Random request ids: all 30 on one replica has odds of 3^-29.
    assert!(seen.len() >= 2, "{seen:?}");
}

/// A replica by hand that reads request bodies to their end before it answers (as vLLM's
/// `/v1/embeddings` does): `GET`s get 200 and every other request `answer`, on a kept-alive
/// connection.
async fn body_reading_replica(answer: &'static [u8]) -> std::net::SocketAddr {
    slow_body_reading_replica(answer, std::time::Duration::ZERO).await.0
}

/// [`body_reading_replica`], answering requests other than GETs after `delay`; the `Notify`
/// is told of each such request once read.
async fn slow_body_reading_replica(
    answer: &'static [u8],
    delay: std::time::Duration,
) -> (std::net::SocketAddr, std::sync::Arc<tokio::sync::Notify>) {
    pausing_replica(vec![answer], delay, std::time::Duration::ZERO).await
}

/// [`slow_body_reading_replica`] answering in `parts`, `pause` apart (a stream's head, then
/// its events).
async fn pausing_replica(
    parts: Vec<&'static [u8]>,
    delay: std::time::Duration,
    pause: std::time::Duration,
) -> (std::net::SocketAddr, std::sync::Arc<tokio::sync::Notify>) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let read = std::sync::Arc::new(tokio::sync::Notify::new());
    let told = read.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (told, parts) = (told.clone(), parts.clone());
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                loop {
                    let (mut length, mut chunked, mut get, mut line) = (0usize, false, None, String::new());
                    loop {
                        line.clear();
                        if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        get.get_or_insert(line.starts_with("GET "));
                        let lower = line.to_ascii_lowercase();
                        if let Some(n) = lower.strip_prefix("content-length:") {
                            length = n.trim().parse().unwrap_or(0);
                        }
                        chunked |= lower.starts_with("transfer-encoding:") && lower.contains("chunked");
                        if line == "\r\n" {
                            break;
                        }
                    }
                    if chunked {
                        // Until the last chunk's empty line (sizes and data are not checked).
                        let mut last = String::new();
                        loop {
                            line.clear();
                            if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            if last.trim() == "0" && line == "\r\n" {
                                break;
                            }
                            last = line.clone();
                        }
                    } else {
                        let mut body = vec![0; length];
                        if stream.read_exact(&mut body).await.is_err() {
                            return;
                        }
                    }
                    let ok: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if get == Some(true) {
                        if stream.get_mut().write_all(ok).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    told.notify_one();
                    tokio::time::sleep(delay).await;
                    for (i, part) in parts.iter().enumerate() {
                        if i > 0 {
                            tokio::time::sleep(pause).await;
                        }
                        if stream.get_mut().write_all(part).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, read)
}

/// A router in front of the one replica at `replica` (its events on a closed port), with
/// `tweak` applied to its config; stopped by cancelling the token.
pub(crate) async fn router_in_front_of(
    replica: std::net::SocketAddr,
    tweak: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config,
) -> (kvroute_router::RunningRouter, tokio_util::sync::CancellationToken) {
    router_in_front_of_all(vec![hand_made_entry(0, replica, "kvroute")], tweak).await
}

/// [`router_in_front_of`] the replicas `replicas`.
async fn router_in_front_of_all(
    replicas: Vec<kvroute_router::config::ReplicaConfig>,
    tweak: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config,
) -> (kvroute_router::RunningRouter, tokio_util::sync::CancellationToken) {
    let config = tweak(kvroute_router::Config {
        model: FLEET_MODEL.into(),
        replicas,
        ..kvroute_router::Config::loopback(Vec::new())
    });
    let shutdown = tokio_util::sync::CancellationToken::new();
    (kvroute_router::start(config, shutdown.clone()).await.unwrap(), shutdown)
}

/// Replica `r{i}` at `replica` (hand-made: its events come from nowhere), of `engine`.
fn hand_made_entry(
    i: usize,
    replica: std::net::SocketAddr,
    engine: &str,
) -> kvroute_router::config::ReplicaConfig {
    let events = crate::support::nowhere();
    format!("name=r{i},http=http://{replica},events={events},engine={engine}").parse().unwrap()
}

/// vLLM (with `--enable-prompt-tokens-details`) leaves `prompt_tokens_details` out of a usage
/// when nothing was cached: once the replica has said its cached tokens, such an answer is a
/// miss on the realized side (left out, the realized hit rate would count only hits); an
/// answer with no usage is not counted, nor one cut off after its prompt's count.
#[tokio::test]
async fn a_usage_without_cached_tokens_is_a_miss_once_the_replica_has_said_them() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    const ANSWERS: [&str; 3] = [
        r#"{"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":8}}}"#,
        r#"{"usage":{"prompt_tokens":9,"completion_tokens":1}}"#,
        r#"{"choices":[]}"#,
    ];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let replica = listener.local_addr().unwrap();
    let posts = std::sync::Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let posts = posts.clone();
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                loop {
                    let mut head = String::new();
                    while !head.ends_with("\r\n\r\n") {
                        if stream.read_line(&mut head).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                    let length = head.lines().find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap())
                    });
                    let mut body = vec![0; length.unwrap_or(0)];
                    stream.read_exact(&mut body).await.unwrap();
                    let answer = match head.starts_with("POST ") {
                        true => match ANSWERS.get(posts.fetch_add(1, SeqCst)) {
                            Some(answer) => answer,
                            None => {
                                let cut = "HTTP/1.1 200 OK\r\ncontent-length: 200\r\n\r\n{\"usage\":{\"prompt_tokens\":9,";
                                stream.get_mut().write_all(cut.as_bytes()).await.ok();
                                return;
                            }
                        },
                        false => "",
                    };
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                        answer.len()
                    );
                    if stream.get_mut().write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let http = crate::fleet::Http::new();
    let url = format!("{}/v1/completions", router.url());
    for _ in ANSWERS {
        let reply = http
            .post(&url, &json!({"model": FLEET_MODEL, "prompt": "one two three four five", "max_tokens": 1}))
            .await;
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    }
    // Cut off after its prompt's count: the router closes the connection (before or after
    // the head, as the abort finds it).
    let body =
        json!({"model": FLEET_MODEL, "prompt": "one two three four five", "max_tokens": 1}).to_string();
    let mut cut = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    cut.write_all(format!("{head}{body}").as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(WAIT, cut.read_to_end(&mut answer)).await.expect("closed in time");
    let metrics = http.get(&format!("{}/metrics", router.url())).await;
    let metrics = String::from_utf8_lossy(&metrics.body).into_owned();
    let counted = |name: &str| sample(&metrics, &format!("kvroute_router_{name}_total")).unwrap();
    let prompt = counted("prompt_tokens") / 4;
    assert!(prompt > 0);
    assert_eq!(counted("realized_cached_tokens"), 8);
    assert_eq!(counted("reported_prompt_tokens"), 2 * prompt, "the hit and the miss");
    shutdown.cancel();
}

/// A browser's CORS preflight of an API path is the fleet's to answer (vLLM allows every
/// origin by default, as the agent does): it was a 405 from the router, and browsers blocked
/// every call. The replica's `access-control-allow-origin` on an answer comes through once.
#[tokio::test]
async fn a_browsers_preflight_is_answered_by_the_fleet() {
    let fleet = Fleet::with(1, agent_config, |c| c).await;
    let preflight = [
        ("origin", "https://app.example"),
        ("access-control-request-method", "POST"),
        ("access-control-request-headers", "authorization,content-type"),
    ];
    // A stored response's path too: the fleet's policy does not depend on who stored it.
    for path in ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses/resp_unseen"] {
        let reply = fleet.http.send_with(http::Method::OPTIONS, &fleet.url(path), "", &preflight).await;
        assert_eq!(reply.status, 200, "{path}: {:?}", reply.body);
        assert_eq!(reply.header("access-control-allow-origin"), Some("*"), "{path}");
    }
    let body = completion("from a browser", 1).to_string();
    let origin = [("origin", "https://app.example")];
    let reply = fleet.http.send_with(http::Method::POST, &fleet.url("/v1/completions"), body, &origin).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers.get_all("access-control-allow-origin").iter().count(), 1);
}

/// A replica whose `/health` answers slowly (SGLang's runs a generation, a second or more)
/// stays in: the check's timeout is its own, not the check interval, and one failed check
/// does not make a replica unhealthy. Before, every check of such a fleet timed out and
/// every request got 503.
#[tokio::test]
async fn a_slow_health_answer_does_not_take_a_replica_out() {
    let checks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = checks.clone();
    let replica = hand_made_replica(move |path, _| {
        let seen = seen.clone();
        async move {
            if path == "/health" {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // The replica's own slowness, not a wait of the test's.
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            }
            (200, "{}")
        }
    })
    .await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { health_interval_ms: 100, ..c }).await;
    // The third check has begun: two rounds have ended, their verdicts applied.
    wait_until("three health checks", || checks.load(std::sync::atomic::Ordering::SeqCst) >= 3).await;
    let http = crate::fleet::Http::new();
    let reply = http.send(http::Method::POST, &format!("{}/v1/embeddings", router.url()), "{}").await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    shutdown.cancel();
}

/// A replica slow to answer its checks holds up no other's: the others are checked every
/// interval while its check waits out its timeout. A round of checks waited for the
/// slowest, and the others' load reports aged that long.
#[tokio::test]
async fn a_slow_health_check_holds_up_no_other() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let checks = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = checks.clone();
    let slow = hand_made_replica(|path, _| async move {
        if path == "/health" {
            std::future::pending::<()>().await;
        }
        (200, "{}")
    })
    .await;
    let fast = hand_made_replica(move |path, _| {
        let seen = seen.clone();
        async move {
            if path == "/health" {
                seen.fetch_add(1, SeqCst);
            }
            (200, "{}")
        }
    })
    .await;
    let spec = |name: &str, at: std::net::SocketAddr| {
        format!("name={name},http=http://{at},events={},engine=kvroute", crate::support::nowhere())
            .parse()
            .unwrap()
    };
    let config = kvroute_router::Config {
        model: FLEET_MODEL.into(),
        replicas: vec![spec("slow", slow), spec("fast", fast)],
        health_interval_ms: 20,
        health_timeout_ms: 600_000,
        ..kvroute_router::Config::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let _router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    wait_until("five checks of the fast replica", || checks.load(SeqCst) >= 5).await;
    shutdown.cancel();
}

/// A failed health check asks nothing more of the replica (its metrics, its models): a
/// replica that does not answer would go unchecked for each read's timeout.
#[tokio::test]
async fn a_failed_health_check_reads_nothing_more() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let (checks, reads) =
        (std::sync::Arc::new(AtomicUsize::new(0)), std::sync::Arc::new(AtomicUsize::new(0)));
    let (seen, read) = (checks.clone(), reads.clone());
    let replica = hand_made_replica(move |path, _| {
        let (seen, read) = (seen.clone(), read.clone());
        async move {
            match path.as_str() {
                "/health" => {
                    seen.fetch_add(1, SeqCst);
                    (500, "{}")
                }
                _ => {
                    read.fetch_add(1, SeqCst);
                    (200, "{}")
                }
            }
        }
    })
    .await;
    let (_router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { health_interval_ms: 50, ..c }).await;
    wait_until("four health checks", || checks.load(SeqCst) >= 4).await;
    assert_eq!(reads.load(SeqCst), 0, "metrics or models read after a failed check");
    shutdown.cancel();
}

/// An upload the client stops sending is the client's error (408), not the replica's: it
/// used to run into the first-byte timeout, answered 504 and counted toward the replica's
/// ejection, so a few stalled uploads took healthy replicas out.
#[tokio::test]
async fn a_stalled_upload_is_the_clients_408_and_does_not_eject_the_replica() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let replica = body_reading_replica(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        idle_timeout_ms: 300,
        first_byte_timeout_ms: 3_000,
        eject_after: 1,
        ..c
    })
    .await;
    let address = router.url().trim_start_matches("http://").to_owned();
    let mut stalled = tokio::net::TcpStream::connect(&address).await.unwrap();
    let head = "POST /v1/embeddings HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
    stalled.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), stalled.read(&mut answer))
        .await
        .expect("an answer before the first-byte timeout's 504")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let http = crate::fleet::Http::new();
    let fine = http.send(http::Method::POST, &format!("{}/v1/embeddings", router.url()), "{}").await;
    assert_eq!(fine.status, 200, "the replica was not ejected");
    shutdown.cancel();
}

/// A streamed answer to a streamed upload may take until the first-byte timeout after the
/// upload's end for its first event (the replica had the request only then): an upload of
/// about 0.8 s, the head at once, the first event 1.5 s later, with a first-byte timeout of
/// 4 s and an idle timeout of 1 s (it counted from the upload's start, and cut the stream).
/// The margins are a loaded machine's: the client's pace is a tenth of the idle timeout.
#[tokio::test]
async fn a_streamed_uploads_first_event_is_timed_from_the_uploads_end() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let parts: Vec<&'static [u8]> = vec![
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        b"a\r\ndata: ok\n\n\r\n0\r\n\r\n",
    ];
    let (replica, _) =
        pausing_replica(parts, std::time::Duration::ZERO, std::time::Duration::from_millis(1_500)).await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        idle_timeout_ms: 1_000,
        first_byte_timeout_ms: 4_000,
        ..c
    })
    .await;
    let address = router.url().trim_start_matches("http://").to_owned();
    let mut client = tokio::net::TcpStream::connect(&address).await.unwrap();
    let head = "POST /v1/audio/transcriptions HTTP/1.1\r\nhost: t\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n";
    client.write_all(head.as_bytes()).await.unwrap();
    // The client's own pace: a chunk every 0.1 s, well inside the idle timeout.
    for _ in 0..8 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        client.write_all(b"5\r\nhello\r\n").await.unwrap();
    }
    client.write_all(b"0\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), client.read_to_end(&mut answer))
        .await
        .expect("the answer ends")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("data: ok"), "{answer}");
    assert!(!answer.contains("error"), "{answer}");
    shutdown.cancel();
}

/// A replica whose `POST /tokenize` answers three tokens and records the body it was sent;
/// anything else gets an empty 200.
async fn tokenize_recording_replica() -> (std::net::SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<Value>>>)
{
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = asked.clone();
    let replica = hand_made_replica(move |path, body| {
        let record = record.clone();
        async move {
            if path != "/tokenize" {
                return (200, "{}");
            }
            record.lock().unwrap().push(serde_json::from_slice::<Value>(&body).unwrap());
            (200, THREE_TOKENS)
        }
    })
    .await;
    (replica, asked)
}

/// With `--remote-tokenize`, `/tokenize` is asked with everything that decides the ids: a
/// completion's `add_special_tokens`, a chat's rendering options; and the same body sent to
/// the other endpoint is asked again, not answered from the cache.
#[tokio::test]
async fn remote_tokenization_sends_what_decides_the_ids() {
    let (replica, asked) = tokenize_recording_replica().await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let http = crate::fleet::Http::new();
    let body = json!({
        "model": FLEET_MODEL, "prompt": "some text", "add_special_tokens": false,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}],
        "continue_final_message": true, "add_generation_prompt": false,
        "chat_template_kwargs": {"enable_thinking": false, "documents": [{"text": "old"}]},
        "max_tokens": 1, "temperature": 0.5, "reasoning_effort": "high",
        "documents": [{"title": "A", "text": "a"}],
    });
    for endpoint in ["completions", "chat/completions"] {
        let reply = http.post(&format!("{}/v1/{endpoint}", router.url()), &body).await;
        assert_eq!(reply.status, 200, "{endpoint}");
    }
    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 2, "one /tokenize per endpoint: {asked:?}");
    assert_eq!(asked[0], json!({"model": FLEET_MODEL, "prompt": "some text", "add_special_tokens": false}));
    let chat = &asked[1];
    assert_eq!(chat["continue_final_message"], true);
    assert_eq!(chat["add_generation_prompt"], false);
    // `/tokenize` takes no `reasoning_effort` nor `documents`: they are folded into the
    // kwargs as vLLM's chat endpoint folds them (the request's own `enable_thinking` kept,
    // its kwargs' documents replaced).
    let kwargs = json!({
        "enable_thinking": false, "reasoning_effort": "high", "documents": [{"title": "A", "text": "a"}],
    });
    assert_eq!(chat["chat_template_kwargs"], kwargs);
    for left in ["temperature", "prompt", "documents"] {
        assert!(chat.get(left).is_none(), "{left}: {chat}");
    }
    shutdown.cancel();
}

/// With `--remote-tokenize`, a model (an adapter, say) that the replicas asked do not serve is
/// the client's 404, with what they said, not a 503 for a fleet that failed; also in the flat
/// error shape of older vLLM and of SGLang.
#[tokio::test]
async fn remote_tokenization_of_a_model_nobody_serves_is_a_404() {
    const MISSING: &str = r#"{"error":{"message":"The model `nope` does not exist.","code":404}}"#;
    const FLAT: &str = r#"{"object":"error","message":"The model `nope` does not exist.","code":404}"#;
    for answer in [MISSING, FLAT] {
        the_client_gets_404_for_nope(answer).await;
    }
}

async fn the_client_gets_404_for_nope(missing: &'static str) {
    let replica = hand_made_replica(move |path, _| async move {
        match path.as_str() {
            "/tokenize" => (404, missing),
            _ => (200, "{}"),
        }
    })
    .await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let http = crate::fleet::Http::new();
    for body in [
        json!({"model": "nope", "prompt": "some text", "max_tokens": 1}),
        json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ] {
        let endpoint = if body.get("prompt").is_some() { "completions" } else { "chat/completions" };
        let reply = http.post(&format!("{}/v1/{endpoint}", router.url()), &body).await;
        assert_eq!(reply.status, 404, "{endpoint}: {:?}", reply.body);
        let message = reply.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains("The model `nope` does not exist."), "{message}");
    }
    shutdown.cancel();
}

/// With `--remote-tokenize`, a LoRA adapter's prompt is tokenized by a replica that has it
/// (the others answer 404), as its request goes there.
#[tokio::test]
async fn remote_tokenization_of_an_adapter_asks_the_replicas_that_have_it() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    const MISSING: &str = r#"{"error":{"message":"The model `sql` does not exist.","code":404}}"#;
    const MODELS: &str = r#"{"object":"list","data":[{"id":"kvroute-sim","object":"model"}]}"#;
    const WITH_SQL: &str = r#"{"object":"list","data":[{"id":"kvroute-sim","object":"model"},
        {"id":"sql","object":"model","parent":"kvroute-sim"}]}"#;
    let asked_without = std::sync::Arc::new(AtomicUsize::new(0));
    let mut replicas = Vec::new();
    for i in 0..4 {
        let (has_it, asked) = (i == 3, asked_without.clone());
        let replica = hand_made_replica(move |path, _| {
            let asked = asked.clone();
            async move {
                match (path.as_str(), has_it) {
                    ("/v1/models", true) => (200, WITH_SQL),
                    ("/v1/models", false) => (200, MODELS),
                    ("/tokenize", true) => (200, THREE_TOKENS),
                    ("/tokenize", false) => {
                        asked.fetch_add(1, SeqCst);
                        (404, MISSING)
                    }
                    _ => (200, "{}"),
                }
            }
        })
        .await;
        replicas.push(hand_made_entry(i, replica, "vllm"));
    }
    let (router, shutdown) = router_in_front_of_all(replicas, |c| kvroute_router::Config {
        remote_tokenize: true,
        lora_adapters: vec!["sql".into()],
        ..c
    })
    .await;
    for i in 0..4 {
        let listed = (i == 3).then(|| "sql".to_owned()).into_iter().collect();
        router.fleet().member(&format!("r{i}")).unwrap().upstream.set_listed_adapters(Some(listed));
    }
    let http = crate::fleet::Http::new();
    for n in 0..8 {
        let body = json!({"model": "sql", "prompt": format!("question {n}"), "max_tokens": 1});
        let reply = http.post(&format!("{}/v1/completions", router.url()), &body).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.header("x-kvroute-replica"), Some("r3"));
    }
    assert_eq!(asked_without.load(SeqCst), 0, "the replicas without the adapter were not asked");
    // With the one that lists it drained, any replica may have it (as routing reads it: vLLM's
    // resolvers load adapters on demand): the others are asked, and their 404 is the answer.
    router.fleet().set_draining("r3", true).unwrap();
    let body = json!({"model": "sql", "prompt": "a new question", "max_tokens": 1});
    let reply = http.post(&format!("{}/v1/completions", router.url()), &body).await;
    assert_eq!(reply.status, 404, "{:?}", reply.body);
    assert!(asked_without.load(SeqCst) > 0);
    shutdown.cancel();
}

/// With `--remote-tokenize`, an adapter loaded through the router is tokenized by a replica
/// that has it; with none of those up, the client is told so (503), and the replicas without
/// it are not asked.
#[tokio::test]
async fn remote_tokenization_of_a_loaded_adapter_no_replica_up_has() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let asked = [(); 2].map(|()| std::sync::Arc::new(AtomicUsize::new(0)));
    let mut replicas = Vec::new();
    for (i, asked) in asked.iter().enumerate() {
        let asked = asked.clone();
        let replica = hand_made_replica(move |path, _| {
            let asked = asked.clone();
            async move {
                match path.as_str() {
                    "/tokenize" => {
                        asked.fetch_add(1, SeqCst);
                        (200, THREE_TOKENS)
                    }
                    _ => (200, "{}"),
                }
            }
        })
        .await;
        replicas.push(hand_made_entry(i, replica, "vllm"));
    }
    let (router, shutdown) = router_in_front_of_all(replicas, |c| kvroute_router::Config {
        remote_tokenize: true,
        lora_updates: true,
        ..c
    })
    .await;
    let http = crate::fleet::Http::new();
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    let reply = http.post(&format!("{}/v1/load_lora_adapter", router.url()), &load).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    // r0 lost it since (a restart, say).
    router.fleet().member("r0").unwrap().upstream.mark_adapter("sql", false);
    let ask = |n: usize| json!({"model": "sql", "prompt": format!("question {n}"), "max_tokens": 1});
    for n in 0..4 {
        let reply = http.post(&format!("{}/v1/completions", router.url()), &ask(n)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.header("x-kvroute-replica"), Some("r1"));
    }
    assert_eq!((asked[0].load(SeqCst), asked[1].load(SeqCst)), (0, 4));

    router.fleet().set_draining("r1", true).unwrap();
    let reply = http.post(&format!("{}/v1/completions", router.url()), &ask(4)).await;
    assert_eq!(reply.status, 503, "{:?}", reply.body);
    let error = reply.json();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("no replica up has the LoRA adapter sql"), "{message}");
    assert_eq!((asked[0].load(SeqCst), asked[1].load(SeqCst)), (0, 4), "nobody asked");
    shutdown.cancel();
}

/// With `--remote-tokenize`, a 404 that is not an OpenAI-shaped error (a replica without a
/// `/tokenize` route) is the replica's failure (503), not a model the client asked wrongly.
#[tokio::test]
async fn remote_tokenization_without_the_route_is_the_replicas_failure() {
    let replica = hand_made_replica(|path, _| async move {
        match path.as_str() {
            "/tokenize" => (404, r#"{"detail":"Not Found"}"#),
            _ => (200, "{}"),
        }
    })
    .await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let http = crate::fleet::Http::new();
    let body = json!({"model": FLEET_MODEL, "prompt": "some text", "max_tokens": 1});
    let reply = http.post(&format!("{}/v1/completions", router.url()), &body).await;
    assert_eq!(reply.status, 503, "{:?}", reply.body);
    shutdown.cancel();
}

/// With `--remote-tokenize` on a gpt-oss model (configured locally), chats are rendered with
/// Harmony by the router: vLLM's `/tokenize` renders them with the template, its chat endpoint
/// with Harmony. Completions still ask the replica.
#[tokio::test]
async fn remote_tokenization_renders_harmony_chats_itself() {
    let (replica, asked) = tokenize_recording_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        remote_tokenize: true,
        tokenizer: Some(fixture("tiny-harmony-tokenizer.json")),
        tokenizer_config: Some(fixture("tiny-harmony-tokenizer_config.json")),
        ..c
    })
    .await;
    let http = crate::fleet::Http::new();
    let chat =
        json!({"model": FLEET_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(http.post(&format!("{}/v1/chat/completions", router.url()), &chat).await.status, 200);
    let completion = json!({"model": FLEET_MODEL, "max_tokens": 1, "prompt": "some text"});
    assert_eq!(http.post(&format!("{}/v1/completions", router.url()), &completion).await.status, 200);
    let asked = asked.lock().unwrap().clone();
    assert!(asked.iter().all(|a| a.get("messages").is_none()), "a chat was sent to /tokenize: {asked:?}");
    assert!(asked.iter().any(|a| a["prompt"] == "some text"), "{asked:?}");
    shutdown.cancel();
}

/// With `--lora-updates`, a LoRA adapter loaded through the router reaches every replica,
/// hashes in its own namespace from then on (as the replicas hash it), and is listed;
/// unloading takes it back, replicas without it counting as done; a change a replica cannot
/// take is a 502 that says which. Without the flag, a 403.
#[tokio::test]
async fn lora_adapters_loaded_through_the_router_reach_every_replica() {
    // No health check after the first: one between the kill and the last load would learn the
    // adapter from the two replicas that answer it (every replica that answers lists it).
    let long = 3_600_000;
    let mut fleet = Fleet::with(3, agent_config, |c| kvroute_router::Config {
        lora_updates: true,
        health_interval_ms: long,
        ..c
    })
    .await;
    let http = crate::fleet::Http::new();
    let listed = async |url: String| -> Vec<String> {
        let models = http.get(&url).await.json();
        models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_owned()).collect()
    };
    let agents: Vec<String> = fleet.agents.iter().map(|a| a.as_ref().unwrap().http_url()).collect();
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    let reply = http.post(&fleet.url("/v1/load_lora_adapter"), &load).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    for agent in &agents {
        assert!(listed(format!("{agent}/v1/models")).await.contains(&"sql".to_owned()), "{agent}");
    }
    assert_eq!(listed(fleet.url("/v1/models")).await, [FLEET_MODEL, "sql"]);

    // The adapter's prefix: cached in its own namespace, predicted to the token.
    let prompt = text("lorapromptw", 60);
    let ask = |model: &str, suffix: &str| json!({"model": model, "prompt": format!("{prompt} {suffix}"), "max_tokens": 2});
    assert_eq!(http.post(&fleet.url("/v1/completions"), &ask("sql", "one")).await.status, 200);
    let again = http.post(&fleet.url("/v1/completions"), &ask("sql", "two")).await;
    let predicted: u64 = again.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
    assert!(predicted > 0);
    assert_eq!(again.cached_tokens(), predicted);
    let base = http.post(&fleet.url("/v1/completions"), &ask(FLEET_MODEL, "three")).await;
    assert_eq!(
        base.header("x-kvroute-predicted-cached-tokens"),
        Some("0"),
        "the base model's namespace is another"
    );

    // Loaded already everywhere: the replicas' own answer. A load every replica refused so
    // replaces nothing: the first is the one repeated to a replica that lacks it.
    assert_eq!(http.post(&fleet.url("/v1/load_lora_adapter"), &load).await.status, 400);
    let elsewhere = json!({"lora_name": "sql", "lora_path": "/adapters/elsewhere"});
    assert_eq!(http.post(&fleet.url("/v1/load_lora_adapter"), &elsewhere).await.status, 400);
    let kept = fleet.router.fleet().adapters().all();
    let body = |name: &str| kept.iter().find(|a| a.name == name).map(|a| a.body().clone());
    assert_eq!(body("sql").as_deref(), Some(load.to_string().as_bytes()), "{kept:?}");

    // An adapter by the served model's name is refused: it would take the model's requests.
    let named_as_base = json!({"lora_name": FLEET_MODEL, "lora_path": "/adapters/base"});
    let reply = http.post(&fleet.url("/v1/load_lora_adapter"), &named_as_base).await;
    assert_eq!(reply.status, 400, "{:?}", reply.body);
    assert!(fleet.router.fleet().adapters().all().iter().all(|a| a.name != FLEET_MODEL));

    // One replica lost it already: the others unload it, and the fleet is without it.
    let unload = json!({"lora_name": "sql"});
    assert_eq!(http.post(&format!("{}/v1/unload_lora_adapter", agents[0]), &unload).await.status, 200);
    let reply = http.post(&fleet.url("/v1/unload_lora_adapter"), &unload).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    for url in agents.iter().map(|a| format!("{a}/v1/models")).chain([fleet.url("/v1/models")]) {
        assert!(!listed(url.clone()).await.contains(&"sql".to_owned()), "{url}");
    }
    assert_eq!(http.post(&fleet.url("/v1/completions"), &ask("sql", "four")).await.status, 404);

    // A replica that is down: a 502 naming it; the others have the adapter, and its requests
    // go to them.
    fleet.kill(2).await;
    let reply = http.post(&fleet.url("/v1/load_lora_adapter"), &load).await;
    assert_eq!(reply.status, 502, "{:?}", reply.body);
    assert_eq!(reply.json()["error"]["code"], "partial_fan_out");
    assert!(reply.json()["error"]["message"].as_str().unwrap().contains("agent-2"), "{:?}", reply.body);
    assert_eq!(listed(fleet.url("/v1/models")).await, [FLEET_MODEL, "sql"]);
    let served = http.post(&fleet.url("/v1/completions"), &ask("sql", "five")).await;
    assert_eq!(served.status, 200, "{:?}", served.body);
    assert_ne!(served.header("x-kvroute-replica"), Some("agent-2"));

    let without = Fleet::start(1).await;
    assert_eq!(http.post(&without.url("/v1/load_lora_adapter"), &load).await.status, 403);
}

/// A LoRA load that one replica has already and another refuses for a reason of its own is
/// a 502 naming that refusal: the "already loaded" answer would hide it.
#[tokio::test]
async fn a_lora_refusal_beside_an_adapter_there_already_is_a_fan_out_failure() {
    const REFUSAL: &[u8] = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 41\r\n\r\n{\"error\":{\"message\":\"no such lora_path\"}}";
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config { lora_updates: true, ..c }).await;
    let http = crate::fleet::Http::new();
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    let agent = fleet.agents[0].as_ref().unwrap().http_url();
    assert_eq!(http.post(&format!("{agent}/v1/load_lora_adapter"), &load).await.status, 200);
    let (refusing, _asked) = crate::headers::recording_replica(REFUSAL).await;
    let refusing: kvroute_router::config::ReplicaConfig =
        format!("name=refusing,http=http://{refusing},events={},engine=kvroute", crate::support::nowhere())
            .parse()
            .unwrap();
    fleet.router.fleet().add(refusing.to_spec(FLEET_MODEL, FLEET_BLOCK)).unwrap();

    let reply = http.post(&fleet.url("/v1/load_lora_adapter"), &load).await;
    assert_eq!(reply.status, 502, "{:?}", reply.body);
    let message = reply.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("refusing: 400") && message.contains("no such lora_path"), "{message}");
    assert!(message.contains("1 were there already"), "{message}");
}

/// A router with LoRA updates in front of one replica that answers changes after 800 ms
/// (`Success.`, as plain text), asked to load the adapter `sql` by a client that leaves once
/// the replica has the request: a client whose timeout is shorter than the replicas' answers.
async fn a_load_whose_client_left() -> (kvroute_router::RunningRouter, tokio_util::sync::CancellationToken) {
    let answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 8\r\n\r\nSuccess.";
    let (replica, read) = slow_body_reading_replica(answer, std::time::Duration::from_millis(800)).await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { lora_updates: true, ..c }).await;
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    drop(post_once_the_replica_has_it(&router, "/v1/load_lora_adapter", &load, &read).await);
    (router, shutdown)
}

/// Posts `body` to the router's `path` on a raw connection, and returns that connection once
/// the replica signals (`read`) that it has the request.
async fn post_once_the_replica_has_it(
    router: &kvroute_router::RunningRouter,
    path: &str,
    body: &Value,
    read: &tokio::sync::Notify,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut client = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    client.write_all(request.as_bytes()).await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), read.notified())
        .await
        .expect("the replica has it");
    client
}

/// A LoRA change runs to its end when its client stops waiting (a client timeout shorter than
/// the replicas' answers): the router records what the replicas did. (Cut off, it used to
/// leave the replicas changed and the router's records not, which its catch-up then undid.)
/// A replica's answer passed on keeps its content type and gets the request id.
#[tokio::test]
async fn a_lora_change_whose_client_left_still_completes() {
    let (router, shutdown) = a_load_whose_client_left().await;
    assert!(!router.fleet().adapters().contains("sql"));
    let fleet = router.fleet().clone();
    wait_until("the change the client left is recorded", || fleet.adapters().contains("sql")).await;

    let reply = crate::fleet::Http::new()
        .post(&format!("{}/v1/unload_lora_adapter", router.url()), &json!({"lora_name": "sql"}))
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(&reply.body[..], b"Success.");
    assert_eq!(reply.header("content-type"), Some("text/plain"));
    assert!(reply.header("x-request-id").is_some());
    shutdown.cancel();
}

/// A LoRA change whose client left holds its place under `--max-in-flight` until it is done:
/// clients that leave at once cannot queue changes without bound. The replica holds the load
/// until the test opens its gate; any other POST it answers at once.
#[tokio::test]
async fn a_lora_change_whose_client_left_holds_its_in_flight_place() {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let replica = listener.local_addr().unwrap();
    let (gate, read) = (
        std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
        std::sync::Arc::new(tokio::sync::Notify::new()),
    );
    let (opened, told) = (gate.clone(), read.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (opened, told) = (opened.clone(), told.clone());
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                loop {
                    let (mut first, mut length, mut line) = (String::new(), 0usize, String::new());
                    loop {
                        line.clear();
                        if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if first.is_empty() {
                            first = line.clone();
                        }
                        if let Some(n) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = n.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    if stream.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let answer: &[u8] = if first.starts_with("POST /v1/load_lora_adapter") {
                        told.notify_one();
                        drop(opened.acquire().await);
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 8\r\n\r\nSuccess."
                    } else {
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
                    };
                    if stream.get_mut().write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { lora_updates: true, max_in_flight: 1, ..c })
            .await;
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    drop(post_once_the_replica_has_it(&router, "/v1/load_lora_adapter", &load, &read).await);
    let http = crate::fleet::Http::new();
    // Once the router has seen the client leave...
    let left = async || {
        let metrics = http.get(&format!("{}/metrics", router.url())).await;
        sample(&String::from_utf8_lossy(&metrics.body), "kvroute_router_requests_total{code=\"499\"}")
            == Some(1)
    };
    crate::support::wait_until_async("the client left", left).await;
    // ...the change still holds the one place.
    let embeddings = format!("{}/v1/embeddings", router.url());
    let busy = http.post(&embeddings, &json!({"input": "x"})).await;
    assert_eq!(busy.status, 503, "{:?}", busy.body);
    gate.add_permits(1);
    let fleet = router.fleet().clone();
    wait_until("the change is recorded", || fleet.adapters().contains("sql")).await;
    let served = async || http.post(&embeddings, &json!({"input": "x"})).await.status == 200;
    crate::support::wait_until_async("the place is given back", served).await;
    shutdown.cancel();
}

/// A LoRA change whose client left runs to its end through a shutdown too: the server
/// drains it as it drains its connections.
#[tokio::test]
async fn a_lora_change_whose_client_left_outlasts_a_shutdown() {
    let (router, _shutdown) = a_load_whose_client_left().await;
    let fleet = router.fleet().clone();
    router.stop().await;
    assert!(fleet.adapters().contains("sql"), "the change ran to its end before the router stopped");
}

/// A LoRA adapter loaded without this router (by another router in front of the same
/// replicas, or on each replica by hand) is learned from what the replicas list: its
/// requests hash in its own namespace, so a prompt the base model cached predicts nothing
/// for the adapter (it had predicted the base model's hits, which the adapter never gets).
/// Once no replica lists it, it is forgotten.
#[tokio::test]
async fn a_lora_adapter_loaded_elsewhere_is_learned_from_the_replicas() {
    let fleet = Fleet::start(2).await;
    let http = crate::fleet::Http::new();
    let agents: Vec<String> = fleet.agents.iter().map(|a| a.as_ref().unwrap().http_url()).collect();
    let state = fleet.router.state.clone();
    let knows = move || state.decider.prompts.tokenization().lora_adapters().contains(&"sql".to_owned());
    let ask = |model: &str| json!({"model": model, "prompt": text("elsewherew", 60), "max_tokens": 2});
    assert_eq!(http.post(&fleet.url("/v1/completions"), &ask(FLEET_MODEL)).await.status, 200);
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    for agent in &agents {
        assert_eq!(http.post(&format!("{agent}/v1/load_lora_adapter"), &load).await.status, 200);
    }
    wait_until("the router learned the adapter", &knows).await;
    let reply = http.post(&fleet.url("/v1/completions"), &ask("sql")).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(
        reply.header("x-kvroute-predicted-cached-tokens"),
        Some("0"),
        "the base model's blocks are not its"
    );
    assert_eq!(reply.cached_tokens(), 0);
    let again = http.post(&fleet.url("/v1/completions"), &ask("sql")).await;
    let predicted: u64 = again.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
    assert!(predicted > 0);
    assert_eq!(again.cached_tokens(), predicted, "its own prefix, predicted to the token");

    let unload = json!({"lora_name": "sql"});
    for agent in &agents {
        assert_eq!(http.post(&format!("{agent}/v1/unload_lora_adapter"), &unload).await.status, 200);
    }
    wait_until("the router forgot the adapter", || !knows()).await;
}

/// A fleet may serve an adapter on some replicas only (loaded on them by hand, or with
/// `--lora-modules` on some): the router learns it from the one that lists it and sends its
/// requests only there (another answers them 404), hashed in the adapter's namespace; the
/// base model's requests still go to every replica. Once that replica unloads it, it is
/// forgotten.
#[tokio::test]
async fn a_lora_adapter_on_some_replicas_only_gets_requests_there_only() {
    let fleet = Fleet::start(2).await;
    let http = crate::fleet::Http::new();
    let agent = fleet.agents[0].as_ref().unwrap();
    let (name, url) = (agent.name.clone(), agent.http_url());
    let state = fleet.router.state.clone();
    let knows = move || state.decider.prompts.tokenization().lora_adapters().contains(&"sql".to_owned());
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    assert_eq!(http.post(&format!("{url}/v1/load_lora_adapter"), &load).await.status, 200);
    wait_until("the router learned the adapter", &knows).await;
    let ask = |model: &str, i: usize| json!({"model": model, "prompt": text(&format!("somew{i}x"), 40), "max_tokens": 2});
    // The admin service says which replica lists it.
    let mut admin =
        kvroute_proto::pb::router_admin_client::RouterAdminClient::connect(fleet.router.admin_url())
            .await
            .unwrap();
    let list = admin.list_replicas(kvroute_proto::pb::ListReplicasRequest {}).await.unwrap().into_inner();
    let listed: Vec<(String, Vec<String>, bool)> = (list.replicas.into_iter())
        .map(|r| (r.spec.unwrap().id, r.listed_adapters, r.lists_adapters))
        .collect();
    let other = fleet.agents[1].as_ref().unwrap().name.clone();
    assert!(listed.contains(&(name.clone(), vec!["sql".to_owned()], true)), "{listed:?}");
    assert!(listed.contains(&(other.clone(), Vec::new(), true)), "a list read, of none: {listed:?}");
    for i in 0..8 {
        let reply = http.post(&fleet.url("/v1/completions"), &ask("sql", i)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.header("x-kvroute-replica"), Some(name.as_str()), "request {i}");
    }
    let again = http.post(&fleet.url("/v1/completions"), &ask("sql", 0)).await;
    let predicted: u64 = again.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
    assert!(predicted > 0);
    assert_eq!(again.cached_tokens(), predicted, "its own prefix, predicted to the token");
    // (The adapter's requests made the first replica the busier: the others go mostly to the
    // second.)
    let mut replicas = std::collections::HashSet::new();
    for i in 0..4 {
        let reply = http.post(&fleet.url("/v1/completions"), &ask(FLEET_MODEL, i)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        replicas.insert(reply.header("x-kvroute-replica").unwrap().to_owned());
    }
    assert!(replicas.contains(&other), "the base model's requests go to the replica without it too");

    let unload = json!({"lora_name": "sql"});
    assert_eq!(http.post(&format!("{url}/v1/unload_lora_adapter"), &unload).await.status, 200);
    let state = fleet.router.state.clone();
    wait_until("the router forgot the adapter", || {
        !state.decider.prompts.tokenization().lora_adapters().contains(&"sql".to_owned())
    })
    .await;
}

/// An SGLang replica lists no adapters: one back from failed health checks (it may have
/// restarted) is given the router's adapters again. It was taken to have them for ever, and
/// sent their requests. So is one whose metrics page says a new process start time (vLLM's
/// says one, SGLang's not: the replica here says one, as a restart between two checks).
#[tokio::test]
async fn an_sglang_replica_that_restarted_is_given_its_adapters_again() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let (down, restarted) =
        (std::sync::Arc::new(AtomicBool::new(false)), std::sync::Arc::new(AtomicBool::new(false)));
    let loads = std::sync::Arc::new(AtomicUsize::new(0));
    let replica = hand_made_replica({
        let (down, restarted, loads) = (down.clone(), restarted.clone(), loads.clone());
        move |path, _| {
            let (down, restarted, loads) = (down.clone(), restarted.clone(), loads.clone());
            async move {
                match path.as_str() {
                    "/health" if down.load(SeqCst) => (503, "{}"),
                    "/metrics" if restarted.load(SeqCst) => (200, "process_start_time_seconds 2000\n"),
                    "/metrics" => (200, "process_start_time_seconds 1000\n"),
                    "/load_lora_adapter" => {
                        loads.fetch_add(1, SeqCst);
                        (200, "{}")
                    }
                    _ => (200, "{}"),
                }
            }
        }
    })
    .await;
    let sglang = vec![hand_made_entry(0, replica, "sglang")];
    let (router, shutdown) = router_in_front_of_all(sglang, |c| kvroute_router::Config {
        lora_updates: true,
        health_interval_ms: 50,
        unhealthy_after: 1,
        ..c
    })
    .await;
    let r0 = router.fleet().member("r0").unwrap();
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    let http = crate::fleet::Http::new();
    let reply = http.post(&format!("{}/load_lora_adapter", router.url()), &load).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(loads.load(SeqCst), 1);
    assert!(r0.upstream.has_adapter("sql"));

    // Down, then back: loaded again (and marked once the load is answered).
    down.store(true, SeqCst);
    wait_until("r0 is down", || !r0.upstream.passes_checks()).await;
    down.store(false, SeqCst);
    wait_until("the adapter loaded again", || loads.load(SeqCst) == 2).await;
    wait_until("r0 has it again", || r0.upstream.has_adapter("sql")).await;

    // A new start time on its metrics page (vLLM's say one): a restart between two checks.
    restarted.store(true, SeqCst);
    wait_until("the adapter loaded a third time", || loads.load(SeqCst) == 3).await;
    wait_until("r0 has it again", || r0.upstream.has_adapter("sql")).await;
    shutdown.cancel();
}

/// A late health check (a busy replica, not a down one) keeps what the last ones read: the
/// other routers' requests on it, and the adapters it lists. Dropped, its load looked this
/// router's alone, and its adapters were forgotten (their requests hashed and sent anywhere).
#[tokio::test]
async fn a_late_health_check_keeps_the_load_and_adapters_read_before() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    const MODELS: &str = r#"{"object":"list","data":[{"id":"kvroute-sim","object":"model"},
        {"id":"sql","object":"model","parent":"kvroute-sim"}]}"#;
    let slow = std::sync::Arc::new(AtomicBool::new(false));
    let replica = hand_made_replica({
        let slow = slow.clone();
        move |path, _| {
            let slow = slow.clone();
            async move {
                match path.as_str() {
                    "/health" if slow.load(SeqCst) => std::future::pending().await,
                    "/metrics" => (200, "vllm:num_requests_running{engine=\"0\"} 5\n"),
                    "/v1/models" => (200, MODELS),
                    _ => (200, "{}"),
                }
            }
        }
    })
    .await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        health_interval_ms: 50,
        health_timeout_ms: 200,
        unhealthy_after: 1,
        ..c
    })
    .await;
    let r0 = router.fleet().member("r0").unwrap();
    let tokenization = router.state.decider.prompts.tokenization();
    wait_until("the load and adapters read", || {
        r0.upstream.load().others == 5 && tokenization.lora_adapters().contains(&"sql".to_owned())
    })
    .await;
    slow.store(true, SeqCst);
    wait_until("a late check", || r0.upstream.is_late()).await;
    assert_eq!(r0.upstream.load().others, 5, "the other routers' load stands");
    assert!(tokenization.lora_adapters().contains(&"sql".to_owned()), "the adapter stands");
    shutdown.cancel();
}

/// Replicas started with an API key (vLLM's `--api-key`): a LoRA load through the router
/// carries the client's key to each of them. A replica that restarts without the adapter
/// gets none of its requests until the router has given it the adapter again, with the key
/// the load came with (while it runs with another key it refuses that, and stays without).
#[tokio::test]
async fn a_lora_adapter_reaches_a_replica_that_restarted_without_it() {
    let keyed = |key: &'static str| {
        move |name: &str| kvroute_replica_agent::Config { api_key: Some(key.into()), ..agent_config(name) }
    };
    let mut fleet =
        Fleet::with(2, keyed("sekret"), |c| kvroute_router::Config { lora_updates: true, ..c }).await;
    let http = crate::fleet::Http::new().bearer("sekret");
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    let unkeyed = crate::fleet::Http::new().post(&fleet.url("/v1/load_lora_adapter"), &load).await;
    assert_eq!(unkeyed.status, 401, "every replica's answer without the key: {:?}", unkeyed.body);
    let reply = http.post(&fleet.url("/v1/load_lora_adapter"), &load).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);

    let router = fleet.router.fleet().clone();
    let has_it = move |name: &str| router.member(name).unwrap().upstream.has_adapter("sql");
    let lists_it = async |http: &crate::fleet::Http, agent: String, adapter: &str| {
        let models = http.get(&format!("{agent}/v1/models")).await.json();
        models["data"].as_array().is_some_and(|cards| cards.iter().any(|m| m["id"] == adapter))
    };
    let ask =
        |n: usize| json!({"model": "sql", "prompt": text(&format!("adapterw{n}x"), 40), "max_tokens": 2});

    // Back under another key: it cannot be given the adapter, and gets none of its requests.
    fleet.restart(1, keyed("other")("agent-1")).await;
    wait_until("the router saw agent-1 lost the adapter", || !has_it("agent-1")).await;
    let mut admin =
        kvroute_proto::pb::router_admin_client::RouterAdminClient::connect(fleet.router.admin_url())
            .await
            .unwrap();
    let listed = admin.list_replicas(kvroute_proto::pb::ListReplicasRequest {}).await.unwrap().into_inner();
    let adapters: Vec<(String, Vec<String>)> =
        listed.replicas.into_iter().map(|r| (r.spec.unwrap().id, r.lora_adapters)).collect();
    assert_eq!(adapters, [("agent-0".into(), vec!["sql".into()]), ("agent-1".into(), vec![])]);
    for n in 0..8 {
        let reply = http.post(&fleet.url("/v1/completions"), &ask(n)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.header("x-kvroute-replica"), Some("agent-0"));
    }
    let other = crate::fleet::Http::new().bearer("other");
    assert!(!lists_it(&other, fleet.agent(1).http_url(), "sql").await);
    // A second adapter loaded meanwhile reaches agent-0 only: a 502, and agent-1 is given it
    // later too.
    let load_too = json!({"lora_name": "sql2", "lora_path": "/adapters/sql2"});
    assert_eq!(http.post(&fleet.url("/v1/load_lora_adapter"), &load_too).await.status, 502);
    // Its requests, which go to agent-0 only, are hashed in its namespace there: a prompt
    // agent-0 cached for the base model is no hit for it.
    let base = json!({"model": FLEET_MODEL, "prompt": text("sharedw", 40), "max_tokens": 1});
    let agent0 = format!("{}/v1/completions", fleet.agent(0).http_url());
    assert_eq!(http.post(&agent0, &base).await.status, 200);
    fleet.index_matches(0).await;
    let as_sql2 = json!({"model": "sql2", "prompt": text("sharedw", 40), "max_tokens": 1});
    for _ in 0..2 {
        let reply = http.post(&fleet.url("/v1/completions"), &as_sql2).await;
        assert_eq!((reply.status.as_u16(), reply.header("x-kvroute-replica")), (200, Some("agent-0")));
        let predicted: u64 = reply.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
        assert_eq!(predicted, reply.cached_tokens(), "predicted as agent-0 hashes it");
    }

    // Back under the fleet's key: the router loads both there, and routes their requests there again.
    fleet.restart(1, keyed("sekret")("agent-1")).await;
    let agent = fleet.agent(1).http_url();
    let deadline = tokio::time::Instant::now() + crate::support::WAIT;
    while !(lists_it(&http, agent.clone(), "sql").await
        && lists_it(&http, agent.clone(), "sql2").await
        && has_it("agent-1"))
    {
        assert!(tokio::time::Instant::now() < deadline, "agent-1 was not given the adapters again");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut replicas = std::collections::HashSet::new();
    for n in 100..120 {
        let reply = http.post(&fleet.url("/v1/completions"), &ask(n)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        replicas.insert(reply.header("x-kvroute-replica").unwrap().to_owned());
    }
    assert_eq!(replicas.len(), 2, "the adapter's requests spread again: {replicas:?}");
    // The second, loaded at first on agent-0 only, is hashed in its namespace once agent-1
    // has it too (agents with a key list nothing to a health check: the catch-up tells).
    let tokenization = fleet.router.state.decider.prompts.tokenization();
    wait_until("sql2 is hashed in its namespace", || tokenization.lora_adapters().contains(&"sql2".into()))
        .await;
}

/// A decision's credits hold while its request waits in the replica's queue, however long
/// past the credit TTL: a request for the same prefix that comes meanwhile follows it there
/// rather than to a replica with less load and nothing cached (when they held only the TTL,
/// it went to the other replica and prefilled the prefix a second time).
#[tokio::test]
async fn credits_hold_while_the_request_waits_in_the_replicas_queue() {
    // One sequence at a time, at real speed: a 400-token completion holds a replica ~2.4 s.
    let agent =
        |name: &str| kvroute_replica_agent::Config { max_num_seqs: 1, time_scale: 1.0, ..agent_config(name) };
    let fleet =
        Fleet::with(2, agent, |c| kvroute_router::Config { credit_ttl_ms: 300, balance_weight: 0.0, ..c })
            .await;
    let router = fleet.router.fleet().clone();
    let in_flight = move || {
        let mut load: Vec<(String, u32)> = router
            .members()
            .iter()
            .map(|m| (m.replica.spec.name.clone(), m.upstream.load().in_flight))
            .collect();
        load.sort();
        load
    };
    let send = |body: Value| {
        let url = fleet.url("/v1/completions");
        tokio::spawn(async move { crate::fleet::Http::new().post(&url, &body).await })
    };
    // Both replicas busy with a long completion each (one after the other: two decisions at
    // once could both see an idle fleet).
    let first = send(completion("long one", 400));
    wait_until("one replica busy", || in_flight().iter().any(|(_, n)| *n == 1)).await;
    let long = [first, send(completion("long two", 400))];
    wait_until("both replicas busy", || in_flight().iter().all(|(_, n)| *n == 1)).await;
    // A new prefix queues behind one of them; no event shows it before it runs.
    let prefix = text("queuedw", 800);
    let queued = send(completion(&format!("{prefix} first"), 2));
    wait_until("the queued request sent", || in_flight().iter().any(|(_, n)| *n == 2)).await;
    let home = in_flight().into_iter().find(|(_, n)| *n == 2).unwrap().0;
    tokio::time::sleep(std::time::Duration::from_millis(900)).await;
    assert_eq!(in_flight().iter().map(|(_, n)| n).sum::<u32>(), 3, "still queued after 3 credit TTLs");
    let follow = send(completion(&format!("{prefix} second"), 2)).await.unwrap();
    assert_eq!(follow.header("x-kvroute-replica"), Some(home.as_str()), "follows the queued prefix");
    let queued = queued.await.unwrap();
    assert_eq!(queued.header("x-kvroute-replica"), Some(home.as_str()));
    assert!(follow.cached_tokens() > 0, "and finds it cached there");
    for reply in long {
        assert_eq!(reply.await.unwrap().status, 200);
    }
}

/// A request's load is its sequences, its prompts times its `n`, as the replica runs them: a
/// replica with one request of four choices is busier than one with two single ones, so the
/// next request goes to the second. (No health check reports in between: the replicas' own
/// counts are not what decides.)
#[tokio::test]
async fn a_requests_choices_are_its_load() {
    let agent = |name: &str| kvroute_replica_agent::Config { time_scale: 1.0, ..agent_config(name) };
    let fleet = Fleet::with(2, agent, |c| kvroute_router::Config {
        health_interval_ms: 600_000,
        balance_weight: 0.0,
        ..c
    })
    .await;
    let router = fleet.router.fleet().clone();
    let load = move || -> Vec<(String, u32)> {
        router.members().iter().map(|m| (m.replica.spec.name.clone(), m.upstream.load().in_flight)).collect()
    };
    let send = |body: Value| {
        let url = fleet.url("/v1/completions");
        tokio::spawn(async move { crate::fleet::Http::new().post(&url, &body).await })
    };
    let mut four = completion("four choices of one prompt", 600);
    four["n"] = json!(2);
    four["prompt"] = json!(["first of two prompts", "second of two prompts"]);
    let busy = send(four);
    wait_until("one replica runs four sequences", || load().iter().any(|(_, n)| *n == 4)).await;
    let (four_on, _) = load().into_iter().find(|(_, n)| *n == 4).unwrap();
    let metrics = scrape(&fleet.http, &fleet.url("")).await;
    let series = |name: &str| format!("kvroute_router_replica_{name}{{replica=\"{four_on}\"}}");
    assert_eq!(sample(&metrics, &series("in_flight")), Some(1), "{metrics}");
    assert_eq!(sample(&metrics, &series("in_flight_sequences")), Some(4), "{metrics}");
    let mut singles = Vec::new();
    for (i, prompt) in ["single one", "single two", "single three"].iter().enumerate() {
        singles.push(send(completion(prompt, 300)));
        wait_until("the single sent", || load().iter().map(|(_, n)| n).sum::<u32>() == 5 + i as u32).await;
    }
    let on_four = load().into_iter().find(|(name, _)| *name == four_on).unwrap().1;
    assert_eq!(on_four, 4, "every single request went to the other replica: {:?}", load());
    for reply in singles {
        let reply = reply.await.unwrap();
        assert_eq!(reply.status, 200);
        assert_ne!(reply.header("x-kvroute-replica"), Some(four_on.as_str()));
    }
    let busy = busy.await.unwrap();
    assert_eq!(busy.status, 200, "{}", String::from_utf8_lossy(&busy.body));
    assert_eq!(busy.json()["choices"].as_array().map(Vec::len), Some(4));
    wait_until("the load released", || load().iter().all(|(_, n)| *n == 0)).await;
}

/// A chat with an image is forwarded, not refused: routed on the conversation before the
/// image, to the replica that cached it, as far as that conversation goes. (The agent itself
/// has no vision model: its 400 is the replica's answer, passed on.)
#[tokio::test]
async fn a_chat_with_an_image_is_routed_on_the_conversation_before_it() {
    let fleet = Fleet::start(3).await;
    let history = |tag: &str| {
        vec![
            json!({"role": "system", "content": text(&format!("{tag}sys"), 120)}),
            json!({"role": "user", "content": text(&format!("{tag}q"), 40)}),
        ]
    };
    let mut homes = HashMap::new();
    for tag in ["a", "b", "c", "d"] {
        let body = json!({"model": FLEET_MODEL, "messages": history(tag), "max_tokens": 2});
        let reply = fleet.http.post(&fleet.url("/v1/chat/completions"), &body).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        homes.insert(tag, reply.header("x-kvroute-replica").unwrap().to_owned());
    }
    let counted = |metrics: &str| {
        ["prompt_tokens", "predicted_cached_tokens"]
            .map(|m| sample(metrics, &format!("kvroute_router_{m}_total")))
    };
    let before = counted(&scrape(&fleet.http, &fleet.url("")).await);
    for tag in ["a", "b", "c", "d"] {
        let mut messages = history(tag);
        messages.push(json!({"role": "assistant", "content": "Let me look."}));
        messages.push(json!({"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ]}));
        let body = json!({"model": FLEET_MODEL, "messages": messages, "max_tokens": 2});
        let reply = fleet.http.post(&fleet.url("/v1/chat/completions"), &body).await;
        assert_eq!(reply.header("x-kvroute-replica"), Some(homes[tag].as_str()), "{tag}: {:?}", reply.body);
        assert_eq!(reply.status, 400, "the agent's own answer: {:?}", reply.body);
        assert!(String::from_utf8_lossy(&reply.body).contains("image_url"), "{:?}", reply.body);
        let predicted: u32 = reply.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
        assert!(predicted >= 10 * FLEET_BLOCK, "{tag}: the system prompt and question: {predicted}");
    }
    let metrics = scrape(&fleet.http, &fleet.url("")).await;
    assert_eq!(sample(&metrics, "kvroute_router_partial_prompts_total"), Some(4));
    assert_eq!(counted(&metrics), before, "chats with media count in neither hit rate");
}

/// With `--remote-tokenize`, a chat with media is routed on load: `/tokenize` would give the
/// media's placeholders, whose blocks carry a hash the router cannot compute.
#[tokio::test]
async fn remote_tokenization_routes_a_chat_with_media_on_load() {
    let (replica, asked) = tokenize_recording_replica().await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let http = crate::fleet::Http::new();
    let body = json!({"model": FLEET_MODEL, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "Transcribe it."]}]});
    let reply = http.post(&format!("{}/v1/chat/completions", router.url()), &body).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-kvroute-predicted-cached-tokens"), Some("0"));
    assert!(asked.lock().unwrap().is_empty(), "/tokenize was asked");
    shutdown.cancel();
}

/// `--events-fallback-ms` is how long a replica's events may stay unreachable before it is
/// routed on load alone (the default is 10 s: this test would see none of it in 5 s).
#[tokio::test]
async fn the_events_fallback_flag_sets_when_a_silent_replica_is_routed_on_load() {
    let replica = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (router, shutdown) = router_in_front_of(replica.local_addr().unwrap(), |c| kvroute_router::Config {
        events_fallback_ms: 300,
        ..c
    })
    .await;
    let member = router.fleet().member("r0").unwrap();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while member.replica.status.state() != kvroute_router::replicas::StreamState::Fallback {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still {:?} after 5 s",
            member.replica.status.state()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    shutdown.cancel();
}

/// A replica whose stream is FALLBACK is taken to hold the prefix every replica with a stream
/// holds (as the cache-aware cost scores it): a request sent there is charged the prefill
/// past it, and predicted to hit it, not charged the whole prompt (which would make it look
/// queued and starve it).
#[tokio::test]
async fn a_fallback_replica_is_charged_the_prefill_past_the_fleets_common_prefix() {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(2, agent_config, &shutdown).await;
    let (silent, _) =
        crate::headers::recording_replica(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
    let config = crate::fleet::router_config_and_streamless(&agents, "silent", silent);
    let fleet = Fleet::around(agents, config, shutdown).await;
    // Both agents hold a system prompt, run on each of them directly.
    let system = "you are a terse assistant that answers in one short line of plain words";
    for i in 0..2 {
        let url = format!("{}/v1/completions", fleet.agent(i).http_url());
        let warm =
            fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": system, "max_tokens": 1})).await;
        assert_eq!(warm.status, 200);
        fleet.index_matches(i).await;
    }
    let silent = fleet.router.fleet().member("silent").unwrap();
    wait_until("the silent replica is FALLBACK", || {
        silent.replica.status.state() == kvroute_router::replicas::StreamState::Fallback
    })
    .await;
    let body = json!({"model": FLEET_MODEL, "prompt": format!("{system} and then a question of its own")});
    let decider = &fleet.router.state.decider;
    let mut plan = decider.explain(Endpoint::Completions, body.to_string().as_bytes()).await.unwrap();
    let on = |plan: &kvroute_router::proxy::route::Plan, name: &str| {
        let member = fleet.router.fleet().member(name).unwrap();
        (plan.prefill_tokens_on(member.replica.id), plan.prompt_tokens)
    };
    let (held, prompt) = on(&plan, "agent-0");
    assert!(held < prompt, "the agents hold the system prompt");
    assert_eq!(on(&plan, "agent-1"), (held, prompt));
    assert_eq!(on(&plan, "silent"), (held, prompt), "charged as the agents are");
    // A retry sent there is charged so too (scored again on its own, it cannot tell the
    // fleet's common prefix).
    let at = plan.order().position(|s| s.member.replica.spec.name == "silent").unwrap();
    decider.rescore(&mut plan, at);
    assert_eq!(on(&plan, "silent"), (held, prompt), "a retry there");
}

/// A replica whose answer to a completion has a malformed head ran the request: the router
/// answers 502 and sends it to no other replica.
#[tokio::test]
async fn a_malformed_answer_is_not_sent_to_another_replica() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Health checks (GETs) get 200; a POST gets `answer`, counted.
    let replica = |answer: &'static [u8]| async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let posts = Arc::new(AtomicUsize::new(0));
        let counted = posts.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let posts = counted.clone();
                tokio::spawn(async move {
                    let mut request = [0u8; 4096];
                    if let Ok(n @ 1..) = stream.read(&mut request).await {
                        let post = request[..n].starts_with(b"POST ");
                        if post {
                            posts.fetch_add(1, Ordering::SeqCst);
                        }
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                        stream.write_all(if post { answer } else { ok }).await.ok();
                    }
                });
            }
        });
        (addr, posts)
    };
    let (bad, bad_posts) = replica(b"HTTP/1.1 200 OK\r\ncontent-length: 12, 13\r\n\r\n").await;
    let (good, good_posts) =
        replica(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok").await;
    let config = kvroute_router::Config {
        model: FLEET_MODEL.into(),
        replicas: [("r0", bad), ("r1", good)]
            .iter()
            .map(|(name, addr)| {
                format!("name={name},http=http://{addr},events={},engine=kvroute", crate::support::nowhere())
                    .parse()
                    .unwrap()
            })
            .collect(),
        ..kvroute_router::Config::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    let http = crate::fleet::Http::new();
    let mut malformed = 0;
    for n in 0..12 {
        let body = json!({"model": FLEET_MODEL, "prompt": format!("prompt number {n}"), "max_tokens": 1});
        let reply = http.post(&format!("{}/v1/completions", router.url()), &body).await;
        if reply.status == 502 {
            malformed += 1;
        } else {
            assert_eq!(reply.status, 200, "{:?}", reply.body);
        }
    }
    assert!(malformed > 0, "no request went to r0");
    assert_eq!(bad_posts.load(Ordering::SeqCst), malformed, "each 502 is one request r0 answered");
    assert_eq!(good_posts.load(Ordering::SeqCst), 12 - malformed, "r1 got only its own");
    shutdown.cancel();
}

/// A request that fails on its replica without starting (the connection closes before any
/// answer) leaves no credit there: the prefix's next requests are not drawn to it.
#[tokio::test]
async fn a_request_that_failed_everywhere_leaves_no_credit() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Health checks (GETs) are answered, so the replica stays in; a POST's connection closes
    // before any answer.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = [0u8; 4096];
                while let Ok(n @ 1..) = stream.read(&mut head).await {
                    if !head[..n].starts_with(b"GET ") {
                        return;
                    }
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                    if stream.write_all(ok).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let (reply, credited) = credited_after_one_request(addr, false).await;
    assert_eq!(reply.status, 502, "{:?}", reply.body);
    assert_eq!(credited, 0, "a credit was left");
}

/// Sends a request of 4 blocks to a router (credits lasting an hour) in front of the one
/// replica at `replica`: its answer, and the blocks of it the replica is credited with after.
/// The replica's stream is FALLBACK first if `fallback`.
async fn credited_after_one_request(
    replica: std::net::SocketAddr,
    fallback: bool,
) -> (crate::fleet::Reply, usize) {
    // No events ever come (`nowhere`): an unreachable stream would end the credits, unless
    // it is given up on (FALLBACK).
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        credit_ttl_ms: 3_600_000,
        events_fallback_ms: if fallback { 50 } else { 3_600_000 },
        ..c
    })
    .await;
    if fallback {
        let r0 = router.fleet().member("r0").unwrap();
        wait_until("r0 is FALLBACK", || {
            r0.replica.status.state() == kvroute_router::replicas::StreamState::Fallback
        })
        .await;
    }
    let block = router.state.decider.block_size;
    let ids: Vec<u32> = (0..4 * block as u32).map(|t| 100 + t).collect();
    let blocks = CacheNamespace::new(FLEET_MODEL).chain(&ids, block);
    let reply = crate::fleet::Http::new()
        .post(
            &format!("{}/v1/completions", router.url()),
            &json!({"model": FLEET_MODEL, "prompt": ids, "max_tokens": 1}),
        )
        .await;
    let id = router.fleet().member("r0").unwrap().replica.id;
    let credited = router.fleet().credits().extend(id, &blocks, 0);
    shutdown.cancel();
    (reply, credited)
}

/// A request the replica answers with an error (here a 400: it ran nothing) leaves no credit
/// there: the prefix's next requests are not steered to it for a TTL by blocks it never
/// cached.
#[tokio::test]
async fn an_error_answer_withdraws_the_credit() {
    let refusal =
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let (reply, credited) = credited_after_one_request(body_reading_replica(refusal).await, false).await;
    assert_eq!(reply.status, 400, "the replica's answer: {:?}", reply.body);
    assert_eq!(credited, 0, "a credit was left");
}

/// A stream that fails in band (a success head, then an error as its first output: it
/// stopped before its output, or never ran) leaves no credit, as an error status does.
#[tokio::test]
async fn a_stream_that_fails_in_band_withdraws_the_credit() {
    let event = "data: {\"error\":{\"message\":\"no room\",\"code\":500}}\n\n";
    let answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{event}",
        event.len()
    );
    let answer: &'static [u8] = Box::leak(answer.into_bytes().into_boxed_slice());
    let (reply, credited) = credited_after_one_request(body_reading_replica(answer).await, false).await;
    assert_eq!(reply.status, 200, "the replica's answer: {:?}", reply.body);
    assert_eq!(credited, 0, "a credit was left");
}

/// A replica whose stream is FALLBACK is credited with nothing: no event would ever confirm
/// a credit, a decision scores none there, and with long credits every request's blocks
/// piled up for the TTL.
#[tokio::test]
async fn a_fallback_replica_is_not_credited() {
    let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let (reply, credited) = credited_after_one_request(body_reading_replica(ok).await, true).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(credited, 0, "a credit was left");
}

/// A request its first replica refuses (503) and the next one serves: the decision's credit
/// moves to the one that serves it, so the prefix's next requests follow it there instead
/// of going back to the replica that refused.
#[tokio::test]
async fn a_retried_request_credits_the_replica_that_serves_it() {
    let (router, shutdown) = refuser_and_server().await;
    let http = crate::fleet::Http::new();
    let id = |name: &str| router.fleet().member(name).unwrap().replica.id;
    let credits = router.fleet().credits();
    let block = router.state.decider.block_size;
    // Prompts until one goes to the refuser first (the tie between idle replicas is by prompt).
    let mut retried = false;
    for i in 0..64u32 {
        let ids: Vec<u32> = (0..4 * block as u32).map(|t| 100 + t + i * 1000).collect();
        let blocks = CacheNamespace::new(FLEET_MODEL).chain(&ids, block);
        let before = sample(&scrape(&http, &router.url()).await, "kvroute_router_retries_total").unwrap_or(0);
        let reply = http
            .post(
                &format!("{}/v1/completions", router.url()),
                &json!({"model": FLEET_MODEL, "prompt": ids, "max_tokens": 1}),
            )
            .await;
        assert_eq!((reply.status.as_u16(), reply.header("x-kvroute-replica")), (200, Some("server")));
        assert_eq!(
            credits.extend(id("server"), &blocks, 0),
            blocks.len(),
            "prompt {i}: the server holds the credit"
        );
        assert_eq!(credits.extend(id("refuser"), &blocks, 0), 0, "prompt {i}: the refuser holds none");
        let after = sample(&scrape(&http, &router.url()).await, "kvroute_router_retries_total").unwrap_or(0);
        if after > before {
            retried = true;
            break;
        }
    }
    assert!(retried, "no prompt went to the refuser first");
    shutdown.cancel();
}

/// A router in front of a replica that refuses everything (503) and one that serves it.
async fn refuser_and_server() -> (kvroute_router::RunningRouter, tokio_util::sync::CancellationToken) {
    let refuser =
        body_reading_replica(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
    let server = body_reading_replica(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    let replica = |name: &str, addr: std::net::SocketAddr| {
        format!("name={name},http=http://{addr},events={},engine=kvroute", crate::support::nowhere())
            .parse()
            .unwrap()
    };
    let config = kvroute_router::Config {
        model: FLEET_MODEL.into(),
        replicas: vec![replica("refuser", refuser), replica("server", server)],
        // No events ever come (`nowhere`): an unreachable stream would end the credits.
        events_fallback_ms: 3_600_000,
        ..kvroute_router::Config::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    (kvroute_router::start(config, shutdown.clone()).await.unwrap(), shutdown)
}

/// The credit a retry takes away is only what its own decision added: earlier requests'
/// credits for the prefix on the refusing replica stand.
#[tokio::test]
async fn a_retry_takes_away_only_its_own_credit() {
    let (router, shutdown) = refuser_and_server().await;
    let id = |name: &str| router.fleet().member(name).unwrap().replica.id;
    let credits = router.fleet().credits();
    let block = router.state.decider.block_size;
    let ids: Vec<u32> = (0..4 * block as u32).map(|t| 500 + t).collect();
    let blocks = CacheNamespace::new(FLEET_MODEL).chain(&ids, block);
    // An earlier request's credit: the refuser holds the first two blocks, so it goes first.
    credits.credit(id("refuser"), &blocks[..2]);
    let http = crate::fleet::Http::new();
    // A batch: its second prompt repeats the first's leading blocks.
    let body =
        json!({"model": FLEET_MODEL, "prompt": [ids.clone(), ids[..2 * block].to_vec()], "max_tokens": 1});
    let reply = http.post(&format!("{}/v1/completions", router.url()), &body).await;
    assert_eq!((reply.status.as_u16(), reply.header("x-kvroute-replica")), (200, Some("server")));
    let retries = sample(&scrape(&http, &router.url()).await, "kvroute_router_retries_total");
    assert_eq!(retries, Some(1), "the refuser went first");
    assert_eq!(credits.extend(id("refuser"), &blocks, 0), 2, "the earlier credit stands");
    assert_eq!(credits.extend(id("server"), &blocks, 0), blocks.len());
    shutdown.cancel();
}

/// With `--remote-tokenize`, a prompt the replica's `/tokenize` refuses (400, as vLLM does
/// for a template error) is the client's 400 with the replica's reason, not a 503 asking
/// the client to try again.
#[tokio::test]
async fn a_prompt_the_replicas_tokenizer_refuses_is_a_400() {
    let refusal: &[u8] =
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 52\r\n\r\n\
        {\"error\":{\"message\":\"no template for this message\"}}";
    let replica = body_reading_replica(refusal).await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { remote_tokenize: true, ..c }).await;
    let http = crate::fleet::Http::new();
    let body = json!({"model": FLEET_MODEL, "prompt": "some text", "max_tokens": 1});
    let reply = http.post(&format!("{}/v1/completions", router.url()), &body).await;
    assert_eq!(reply.status, 400, "{:?}", reply.json());
    let message = reply.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("no template for this message"), "{message}");
    shutdown.cancel();
}

/// A replica that answers `GET /v1/stream` with an endless server-sent-event stream (and
/// anything else with an empty 200); the counter tells how many of its streams found their
/// connection closed.
async fn endless_stream_replica() -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let closed = std::sync::Arc::new(AtomicUsize::new(0));
    let count = closed.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                if !head.starts_with(b"GET /v1/stream ") {
                    // Health checks and the like.
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                        .await;
                    return;
                }
                let start = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                let event = format!("data: {}\n\n", "x".repeat(8 * 1024));
                let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                let mut sent = stream.write_all(start.as_bytes()).await;
                while sent.is_ok() {
                    sent = stream.write_all(chunk.as_bytes()).await;
                }
                count.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    (addr, closed)
}

/// A client that stops reading a streamed response (an HTTP/1 client that leaves its socket
/// unread, an HTTP/2 client that sends no more window updates) no longer holds the request:
/// hyper stops polling the body, so its idle timer never ran, and the replica stayed busy and
/// counted as loaded for as long as the client liked. Now the response ends after the send
/// timeout (HTTP/1: the write that waits closes the connection; HTTP/2: the stall watch cuts
/// the stream's response, as the client's socket is read and no write waits): the replica
/// sees its connection closed and the load is released, and so is the key's place under
/// `--max-in-flight-per-key` (it outlived the HTTP/2 cut, refusing the key's next requests).
#[tokio::test]
async fn a_client_that_stops_reading_a_stream_does_not_hold_the_replica() {
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncWriteExt;
    let (replica, closed) = endless_stream_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        send_timeout_ms: 300,
        api_key: vec!["sk-a".into()],
        max_in_flight_per_key: 1,
        ..c
    })
    .await;
    let address: std::net::SocketAddr = router.url().trim_start_matches("http://").parse().unwrap();
    let in_flight = || router.fleet().members()[0].upstream.load().in_flight;

    // HTTP/1: a socket with a small receive buffer, never read.
    let closed_before = sample(&scrape(&crate::fleet::Http::new(), &router.url()).await, TIMEOUTS).unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut h1 = socket.connect(address).await.unwrap();
    h1.write_all(b"GET /v1/stream HTTP/1.1\r\nhost: t\r\nauthorization: Bearer sk-a\r\n\r\n").await.unwrap();
    wait_until("the replica's stream closed", || closed.load(Ordering::SeqCst) == 1).await;
    wait_until("the load released", || in_flight() == 0).await;
    let closed_after = sample(&scrape(&crate::fleet::Http::new(), &router.url()).await, TIMEOUTS).unwrap();
    assert!(closed_after > closed_before, "the send timeout closed the connection");

    // HTTP/2: a stream whose window is never opened again.
    let cut_before = client_stalls(&router).await;
    let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(address).await.unwrap());
    let (mut h2, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .initial_stream_window_size(4096)
        .handshake::<_, http_body_util::Empty<bytes::Bytes>>(io)
        .await
        .unwrap();
    tokio::spawn(conn);
    let keyed = |path: &str| {
        let request = http::Request::get(format!("http://{address}{path}"));
        request.header("authorization", "Bearer sk-a").body(Default::default()).unwrap()
    };
    let response = h2.send_request(keyed("/v1/stream")).await.unwrap();
    assert_eq!(response.status(), 200);
    wait_until("the replica's second stream closed", || closed.load(Ordering::SeqCst) == 2).await;
    wait_until("the load released again", || in_flight() == 0).await;

    assert_eq!(client_stalls(&router).await, cut_before + 1, "the stall watch cut it");
    // The stream still open, unread: its key's place ended with the cut.
    let next = h2.send_request(keyed("/v1/other")).await.unwrap();
    assert_eq!(next.status(), 200, "the key's place is back");
    assert_eq!(cut_before, 0, "HTTP/1 is the send timeout's");
    drop((h1, response));
    shutdown.cancel();
}

/// Client connections closed by the send timeout (process-wide: other tests' count too).
const TIMEOUTS: &str = "kvroute_router_client_send_timeouts_total";

/// `kvroute_router_client_stalls_total`, from the router's `/metrics`.
async fn client_stalls(router: &kvroute_router::RunningRouter) -> u64 {
    let metrics = scrape(&crate::fleet::Http::new(), &router.url()).await;
    sample(&metrics, "kvroute_router_client_stalls_total")
        .unwrap_or_else(|| panic!("no client stalls in {metrics}"))
}

/// The `/metrics` text of the router at `base`.
async fn scrape(http: &crate::fleet::Http, base: &str) -> String {
    String::from_utf8_lossy(&http.get(&format!("{base}/metrics")).await.body).into_owned()
}

/// A stream its client gives up on before its first data (its replica's head came, its first
/// token not yet; or, in front of SGLang, its prefill failed beside it) leaves no credit: its
/// replica drops the request and stores no more of its prompt than its events show.
#[tokio::test]
async fn a_stream_given_up_before_its_first_data_leaves_no_credit() {
    let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let never = b"6\r\ndata: \r\n";
    let hour = std::time::Duration::from_secs(3600);
    let (replica, _read) = pausing_replica(vec![head, never], std::time::Duration::ZERO, hour).await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        credit_ttl_ms: 3_600_000,
        events_fallback_ms: 3_600_000,
        ..c
    })
    .await;
    let block = router.state.decider.block_size;
    let ids: Vec<u32> = (0..4 * block as u32).map(|t| 100 + t).collect();
    let blocks = CacheNamespace::new(FLEET_MODEL).chain(&ids, block);
    let id = router.fleet().member("r0").unwrap().replica.id;
    let body = json!({"model": FLEET_MODEL, "prompt": ids, "max_tokens": 1, "stream": true});
    let url = format!("{}/v1/completions", router.url());
    let streaming = crate::fleet::Http::new().stream(&url, &body).await;
    assert_eq!(streaming.status(), 200);
    assert_eq!(router.fleet().credits().extend(id, &blocks, 0), 4, "credited while it runs");
    drop(streaming);
    let credits = router.fleet().credits();
    wait_until("the credit is withdrawn", || credits.extend(id, &blocks, 0) == 0).await;
    shutdown.cancel();
}

/// Regression: a stream whose replica framed it by `Content-Length` kept the header, so the
/// error event the router ends a failed stream with had to fit the bytes the length had left:
/// the client got a stream cut short instead. (vLLM and SGLang send none on streams.)
#[tokio::test]
async fn a_stream_framed_by_its_length_still_ends_with_the_error_event() {
    let parts: Vec<&'static [u8]> = vec![
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 64\r\n\r\ndata: {\"a\":1}\n\n",
        b"data: never\n\n",
    ];
    let hour = std::time::Duration::from_secs(3600);
    let (replica, _) = pausing_replica(parts, std::time::Duration::ZERO, hour).await;
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { idle_timeout_ms: 300, ..c }).await;
    let body = json!({"model": FLEET_MODEL, "prompt": "a b c", "max_tokens": 2, "stream": true});
    let url = format!("{}/v1/completions", router.url());
    let streaming = crate::fleet::Http::new().stream(&url, &body).await;
    assert_eq!(streaming.status(), 200);
    let text = streaming.into_body().collect().await.expect("the whole stream, to its end").to_bytes();
    let text = String::from_utf8_lossy(&text);
    assert!(text.starts_with("data: {\"a\":1}\n\n"), "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let error: Value = serde_json::from_str(last.trim_start_matches("data: ")).expect("a whole error event");
    assert!(error["error"]["message"].as_str().is_some_and(|m| m.contains("stream")), "{text}");
    shutdown.cancel();
}
