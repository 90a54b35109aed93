//! Prefill/decode disaggregation in front of real agents playing vLLM's NixlConnector
//! (`--kv-transfer-config`): prompts are prefilled on prefill replicas, decoded on decode
//! replicas, and left to the decode replica when a prefill cannot be had; and playing
//! SGLang's (`--disaggregation-mode`): the prefill is sent alongside its decode, both naming
//! one bootstrap room.

use http::StatusCode;
use kvroute_proto::pb::{self, router_admin_client::RouterAdminClient};
use kvroute_replica_agent::bootstrap::Mode;
use kvroute_replica_agent::kv_transfer::{KvRole, KvTransferConfig, NIXL};
use kvroute_replica_agent::publisher::EventFormat;
use kvroute_router::replicas::{EngineKind, Role};
use serde_json::{Value, json};

use crate::fleet::{FLEET_MODEL, Fleet, Reply, agent_config, first_data};
use crate::support::{sample, wait_until};

/// Agent `i` of a fleet whose first `prefills` agents are prefill replicas, the others decode
/// ones; `connector` says whether the prefill ones can hand their KV over.
fn agent(prefills: usize, connector: bool) -> impl Fn(&str) -> kvroute_replica_agent::Config {
    move |name: &str| {
        let i: usize = name.trim_start_matches("agent-").parse().unwrap();
        let kv_role = if i < prefills { KvRole::KvProducer } else { KvRole::KvConsumer };
        let kv_transfer_config = (connector || i >= prefills).then(|| KvTransferConfig {
            kv_connector: NIXL.into(),
            kv_role,
            engine_id: None,
        });
        // The prefill replicas take shorter prompts than the decode ones, and serve no adapter.
        let max_model_len = if i < prefills { PREFILL_MAX_MODEL_LEN } else { 32_768 };
        let lora_adapters = if i < prefills { Vec::new() } else { vec![ADAPTER.into()] };
        kvroute_replica_agent::Config {
            kv_transfer_config,
            max_model_len,
            lora_adapters,
            ..agent_config(name)
        }
    }
}

const PREFILL_MAX_MODEL_LEN: u32 = 256;
/// A LoRA adapter only the decode replicas serve.
const ADAPTER: &str = "sql";

async fn pd_fleet(agents: usize, prefills: usize, connector: bool) -> Fleet {
    pd_fleet_of(agents, prefills, agent(prefills, connector)).await
}

/// [`pd_fleet`] of agents configured by `agent`.
async fn pd_fleet_of(
    agents: usize,
    prefills: usize,
    agent: impl Fn(&str) -> kvroute_replica_agent::Config,
) -> Fleet {
    Fleet::with(agents, agent, |mut config| {
        for (i, replica) in config.replicas.iter_mut().enumerate() {
            replica.role = if i < prefills { Role::Prefill } else { Role::Decode };
        }
        config.pd_min_prefill_tokens = 8;
        config
    })
    .await
}

/// `n` distinct words, one builtin token each.
fn words(n: usize, seed: u32) -> String {
    (0..n).map(|i| format!("d{seed}w{i}")).collect::<Vec<_>>().join(" ")
}

async fn agent_metric(fleet: &Fleet, i: usize, name: &str) -> u64 {
    let reply = fleet.http.get(&format!("{}/metrics", fleet.agent(i).http_url())).await;
    let series = format!("{name}{{model_name=\"{FLEET_MODEL}\",engine=\"0\"}}");
    sample(&String::from_utf8_lossy(&reply.body), &series).unwrap_or_else(|| panic!("{series}"))
}

async fn prefills(fleet: &Fleet, outcome: &str) -> u64 {
    let metrics = fleet.http.get(&fleet.url("/metrics")).await;
    let series = format!("kvroute_router_prefills_total{{outcome=\"{outcome}\"}}");
    sample(&String::from_utf8_lossy(&metrics.body), &series).unwrap_or(0)
}

fn completion(prompt: &str, max_tokens: u64) -> Value {
    json!({ "model": FLEET_MODEL, "prompt": prompt, "max_tokens": max_tokens })
}

async fn post(fleet: &Fleet, body: Value) -> Reply {
    fleet.http.post(&fleet.url("/v1/completions"), &body).await
}

/// `fleet`'s answer to `body`, which must not wait for a room nobody hands over.
async fn post_in_time(fleet: &Fleet, body: Value) -> Reply {
    let answered = tokio::time::timeout(std::time::Duration::from_secs(30), post(fleet, body)).await;
    answered.expect("answered, not left waiting for a bootstrap room")
}

/// The admin `Explain` of a completion of `body`: how it is split, where its decode and its
/// prefill would go.
async fn explain(fleet: &Fleet, body: &Value) -> (String, String, String) {
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let body = serde_json::to_vec(body).unwrap();
    let request = pb::ExplainRequest { path: "/v1/completions".into(), body };
    let explained = admin.explain(request).await.unwrap().into_inner();
    (explained.split, explained.chosen, explained.prefill_chosen)
}

/// The prefill replicas, and the decode ones, of a fleet of two of each.
const PREFILL_NAMES: [&str; 2] = ["agent-0", "agent-1"];
const DECODE_NAMES: [&str; 2] = ["agent-2", "agent-3"];

/// The answer to `body`, split between a decode replica and a prefill replica: with theirs.
async fn split(fleet: &Fleet, body: Value) -> (Reply, String, String) {
    let reply = post_in_time(fleet, body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
    let decoded_on = reply.header("x-kvroute-replica").unwrap().to_owned();
    let prefilled_on = reply.header("x-kvroute-prefill-replica").expect("prefilled elsewhere").to_owned();
    assert!(DECODE_NAMES.contains(&decoded_on.as_str()), "{decoded_on}");
    assert!(PREFILL_NAMES.contains(&prefilled_on.as_str()), "{prefilled_on}");
    (reply, decoded_on, prefilled_on)
}

/// A prompt too long for the prefill replica (`agent-0`, of a fleet of one prefill and one
/// decode replica): its refusal is the client's answer, and the decode replica's place, taken
/// when the request was decided, is given back.
async fn refused_by_the_prefill_replica(fleet: &Fleet, seed: u32) {
    let long = completion(&words(PREFILL_MAX_MODEL_LEN as usize + 10, seed), 4);
    let reply = post_in_time(fleet, long.clone()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.header("x-kvroute-replica"), Some("agent-0"));
    assert!(reply.json()["error"]["message"].as_str().unwrap().contains("context"), "{}", reply.json());
    assert_eq!(prefills(fleet, "refused").await, 1);
    let metrics = fleet.http.get(&fleet.url("/metrics")).await;
    let in_flight = "kvroute_router_replica_in_flight{replica=\"agent-1\"}";
    assert_eq!(sample(&String::from_utf8_lossy(&metrics.body), in_flight), Some(0), "the decode let go");
    // Nor is the decode replica credited with the prompt it never ran.
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let body = serde_json::to_vec(&long).unwrap();
    let request = pb::ExplainRequest { path: "/v1/completions".into(), body };
    let explained = admin.explain(request).await.unwrap().into_inner();
    let decode = explained.candidates.iter().find(|c| c.replica == "agent-1").unwrap();
    assert_eq!(decode.predicted_cached_tokens, 0, "{explained:?}");
}

/// A client that leaves while its prompt is prefilled ahead: its decode was never sent, so
/// the decode replica is not credited with the prompt. (It was, for the credit's TTL: the
/// client's retry at once was sent there to be prefilled whole.)
#[tokio::test]
async fn a_client_that_leaves_during_the_prefill_leaves_no_decode_credit() {
    let slow_prefill = |name: &str| {
        let config = agent(1, true)(name);
        match name {
            "agent-0" => kvroute_replica_agent::Config { time_scale: 1.0, step_base_us: 3_000_000, ..config },
            _ => config,
        }
    };
    let fleet = pd_fleet_of(2, 1, slow_prefill).await;
    let body = completion(&words(40, 7), 3);
    let posting = tokio::spawn({
        let (http, url, body) = (fleet.http.clone(), fleet.url("/v1/completions"), body.clone());
        async move { http.post(&url, &body).await }
    });
    let router_metric = async |series: &str| {
        let metrics = fleet.http.get(&fleet.url("/metrics")).await;
        sample(&String::from_utf8_lossy(&metrics.body), series)
    };
    let prefilling = "kvroute_router_replica_in_flight{replica=\"agent-0\"}";
    crate::support::wait_until_async("the prefill sent", async || router_metric(prefilling).await == Some(1))
        .await;
    posting.abort();
    let left = "kvroute_router_requests_total{code=\"499\"}";
    crate::support::wait_until_async("the client gone", async || router_metric(left).await == Some(1)).await;
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let request =
        pb::ExplainRequest { path: "/v1/completions".into(), body: serde_json::to_vec(&body).unwrap() };
    let explained = admin.explain(request).await.unwrap().into_inner();
    assert_eq!(explained.split, "remote", "{explained:?}");
    let decode = explained.candidates.iter().find(|c| c.replica == "agent-1").unwrap();
    assert_eq!(decode.predicted_cached_tokens, 0, "{explained:?}");
}

/// A decode that reached its replica, which then failed before answering (a 503 as it shut
/// down), goes to another decode replica without the params: the first may have pulled the
/// prefill's KV, whose blocks the prefill replica may have freed and reused since. The other
/// prefills the prompt itself.
#[tokio::test]
async fn a_decode_that_reached_its_replica_is_not_pulled_again_elsewhere() {
    let slow_decode = |name: &str| {
        let config = agent(1, true)(name);
        match name {
            "agent-0" => config,
            _ => kvroute_replica_agent::Config {
                time_scale: 1.0,
                step_base_us: 20_000,
                shutdown_grace_secs: 0,
                ..config
            },
        }
    };
    let mut fleet = pd_fleet_of(3, 1, slow_decode).await;
    let body = completion(&words(40, 11), 150);
    let (split, decode, _) = explain(&fleet, &body).await;
    assert_eq!(split, "remote");
    let victim: usize = decode.trim_start_matches("agent-").parse().unwrap();
    let posting = tokio::spawn({
        let (http, url, body) = (fleet.http.clone(), fleet.url("/v1/completions"), body.clone());
        async move { http.post(&url, &body).await }
    });
    let pulled = "vllm:num_requests_running";
    crate::support::wait_until_async("the decode running", async || {
        agent_metric(&fleet, victim, pulled).await == 1
    })
    .await;
    fleet.kill(victim).await;
    let reply = tokio::time::timeout(std::time::Duration::from_secs(30), posting).await.unwrap().unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
    let other = format!("agent-{}", 3 - victim);
    assert_eq!(reply.header("x-kvroute-replica"), Some(other.as_str()));
    assert_eq!(reply.header("x-kvroute-prefill-replica"), None, "prefilled where it was decoded");
    assert_eq!(usage(&reply).2, 0, "nothing pulled");
}

/// The same, with no decode replica left but the `both` one that prefilled it: the retry goes
/// there without the params, and is prefilled there (it was not tried: the params named it).
#[tokio::test]
async fn a_refused_decode_may_go_to_the_both_replica_that_prefilled_it() {
    let roles = |name: &str| {
        let config = agent_config(name);
        let (kv_role, slow) = match name {
            "agent-0" => (KvRole::KvBoth, false),
            _ => (KvRole::KvConsumer, true),
        };
        let kv_transfer_config =
            Some(KvTransferConfig { kv_connector: NIXL.into(), kv_role, engine_id: None });
        let config = kvroute_replica_agent::Config { kv_transfer_config, ..config };
        match slow {
            false => config,
            true => kvroute_replica_agent::Config {
                time_scale: 1.0,
                step_base_us: 20_000,
                shutdown_grace_secs: 0,
                ..config
            },
        }
    };
    let mut fleet = Fleet::with(2, roles, |mut config| {
        config.replicas[1].role = Role::Decode;
        config.pd_min_prefill_tokens = 8;
        config
    })
    .await;
    let mut chosen = None;
    for seed in 0..32 {
        let body = completion(&words(40, 100 + seed), 150);
        if explain(&fleet, &body).await == ("remote".into(), "agent-1".into(), "agent-0".into()) {
            chosen = Some(body);
            break;
        }
    }
    let body = chosen.expect("a prompt decoded on agent-1, prefilled on agent-0");
    let posting = tokio::spawn({
        let (http, url, body) = (fleet.http.clone(), fleet.url("/v1/completions"), body.clone());
        async move { http.post(&url, &body).await }
    });
    crate::support::wait_until_async("the decode running", async || {
        agent_metric(&fleet, 1, "vllm:num_requests_running").await == 1
    })
    .await;
    fleet.kill(1).await;
    let reply = tokio::time::timeout(std::time::Duration::from_secs(30), posting).await.unwrap().unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.header("x-kvroute-replica"), Some("agent-0"));
    assert_eq!(reply.header("x-kvroute-prefill-replica"), None, "prefilled where it was decoded");
}

fn usage(reply: &Reply) -> (u64, u64, u64) {
    let usage = &reply.json()["usage"];
    let field = |v: &Value| v.as_u64().unwrap();
    (field(&usage["prompt_tokens"]), field(&usage["completion_tokens"]), reply.cached_tokens())
}

#[tokio::test]
async fn prompts_are_prefilled_on_prefill_replicas_and_decoded_on_decode_ones() {
    let mut fleet = pd_fleet(4, 2, true).await;
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let listed = admin.list_replicas(pb::ListReplicasRequest::default()).await.unwrap().into_inner();
    let roles: Vec<i32> = listed.replicas.iter().map(|r| r.spec.as_ref().unwrap().role).collect();
    let (prefill, decode) = (pb::ReplicaRole::Prefill as i32, pb::ReplicaRole::Decode as i32);
    assert_eq!(roles, [prefill, prefill, decode, decode]);
    let doc = words(40, 1);

    let (first, decoded_on, prefilled_on) = split(&fleet, completion(&format!("{doc} first ask"), 5)).await;
    // The decode replica pulled the prompt but its last token: the params went through.
    let (prompt_tokens, completion_tokens, cached) = usage(&first);
    assert_eq!((completion_tokens, cached), (5, prompt_tokens - 1));
    // What the prefill replica had cached, and was predicted to: nothing yet.
    assert_eq!(first.header("x-kvroute-prefill-cached-tokens"), Some("0"));
    assert_eq!(first.header("x-kvroute-predicted-cached-tokens"), Some("0"));
    // One request, one sample of the upstream times: the decode's (a prefill sent ahead
    // used to add its own, and the histograms counted two requests).
    let metrics = fleet.http.get(&fleet.url("/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body);
    for histogram in
        ["kvroute_router_upstream_ttfb_seconds_count", "kvroute_router_upstream_duration_seconds_count"]
    {
        assert_eq!(sample(&text, histogram), Some(1), "{histogram}");
    }
    // The prefill replica generated the one token it was asked for.
    let p = PREFILL_NAMES.iter().position(|n| *n == prefilled_on).unwrap();
    assert_eq!(agent_metric(&fleet, p, "vllm:generation_tokens_total").await, 1);

    // Another question on the same document: prefilled where the document is cached, and
    // decoded where it was pulled to, as `Explain` says beforehand.
    let asked = completion(&format!("{doc} {}", words(12, 9)), 3);
    let explained = explain(&fleet, &asked).await;
    assert_eq!(explained, ("remote".into(), decoded_on.clone(), prefilled_on.clone()));
    let second = post(&fleet, asked).await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(second.header("x-kvroute-prefill-replica"), Some(prefilled_on.as_str()));
    assert_eq!(
        second.header("x-kvroute-replica"),
        Some(decoded_on.as_str()),
        "the decode replica cached the pull"
    );
    assert_eq!(second.header("x-kvroute-prefill-cached-tokens"), Some("40"), "the document, cached there");
    assert_eq!(second.header("x-kvroute-predicted-cached-tokens"), Some("40"));
    // The first question again: its decode replica holds all but a few of its tokens, and
    // prefills those itself.
    let asked = completion(&format!("{doc} first ask"), 3);
    assert_eq!(explain(&fleet, &asked).await, ("cached".into(), decoded_on.clone(), String::new()));
    let third = post(&fleet, asked).await;
    assert_eq!(third.header("x-kvroute-replica"), Some(decoded_on.as_str()));
    assert_eq!(third.header("x-kvroute-prefill-replica"), None);
    let (prompt_tokens, _, cached) = usage(&third);
    assert!(cached >= 40 && cached < prompt_tokens - 1, "{cached} of {prompt_tokens}: its own cache's hit");
    assert_eq!((prefills(&fleet, "remote").await, prefills(&fleet, "cached").await), (2, 1));

    // A client's own kv_transfer_params never reach a replica (an escaped key reads the same
    // in Python): these would have the decode replica pull a prompt nobody prefilled.
    let forged = json!({
        "do_remote_prefill": true, "remote_engine_id": "x", "remote_request_id": "x",
        "remote_host": "10.0.0.1", "remote_port": 5600, "remote_block_ids": [0, 1, 2],
    });
    let mut short = completion(&words(5, 8), 2);
    short["kv\\u005ftransfer_params"] = forged;
    let sent = serde_json::to_string(&short).unwrap().replace("\\\\u005f", "\\u005f");
    assert!(sent.contains(r#""kv\u005ftransfer_params""#), "{sent}");
    let reply = fleet.http.send(http::Method::POST, &fleet.url("/v1/completions"), sent).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(usage(&reply).2, 0, "nothing pulled");

    // A new document, streamed: prefilled on a prefill replica, its chunks streamed from the
    // decode one.
    let body = json!({ "model": FLEET_MODEL, "prompt": words(60, 2), "max_tokens": 20, "stream": true });
    let mut streamed = fleet.http.stream(&fleet.url("/v1/completions"), &body).await;
    assert_eq!(streamed.status(), StatusCode::OK);
    let prefilled = streamed.headers()["x-kvroute-prefill-replica"].to_str().unwrap().to_owned();
    assert!(PREFILL_NAMES.contains(&prefilled.as_str()), "{prefilled}");
    let chunk = first_data(streamed.body_mut()).await;
    assert!(chunk.starts_with(b"data: {"), "{chunk:?}");
    assert_eq!(prefills(&fleet, "remote").await, 3);
    // The prefill replicas ran one-token requests only.
    let mut ran = 0;
    for i in 0..2 {
        ran += agent_metric(&fleet, i, "vllm:generation_tokens_total").await;
    }
    assert_eq!(ran, 3);

    // With the document's decode replica down, another decodes it, having none of it: the
    // prediction is the prefill replica's, where the prompt is computed.
    let i = DECODE_NAMES.iter().position(|n| *n == decoded_on).unwrap() + 2;
    fleet.kill(i).await;
    let members = fleet.router.fleet().members();
    wait_until("the decode replica is down", || !members[i].upstream.is_healthy()).await;
    let fourth = post(&fleet, completion(&format!("{doc} {}", words(12, 10)), 3)).await;
    assert_eq!(fourth.status, StatusCode::OK);
    assert_ne!(fourth.header("x-kvroute-replica"), Some(decoded_on.as_str()));
    assert_eq!(fourth.header("x-kvroute-prefill-replica"), Some(prefilled_on.as_str()));
    assert_eq!(fourth.header("x-kvroute-predicted-cached-tokens"), Some("40"), "not the decode replica's 0");

    // A batch of prompts is not split: decoded whole.
    let batch = json!({ "model": FLEET_MODEL, "prompt": [words(30, 3), words(30, 4)], "max_tokens": 2 });
    let reply = post(&fleet, batch).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("x-kvroute-prefill-replica"), None);
    assert_eq!(prefills(&fleet, "not_split").await, 1);
    assert!(DECODE_NAMES.contains(&reply.header("x-kvroute-replica").unwrap()));
}

#[tokio::test]
async fn the_decode_replica_prefills_when_no_prefill_can_be_had() {
    // The prefill replica has no connector: it answers without params.
    let mut fleet = pd_fleet(2, 1, false).await;
    let reply = fleet.http.post(&fleet.url("/v1/completions"), &completion(&words(40, 5), 4)).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("x-kvroute-replica"), Some("agent-1"));
    assert_eq!(reply.header("x-kvroute-prefill-replica"), None);
    assert_eq!(usage(&reply).2, 0, "computed on the decode replica");
    assert_eq!(prefills(&fleet, "no_params").await, 1);

    // A prompt the prefill replica refuses (too long for its context) is refused as it says,
    // and sent to no decode replica (which would take it).
    refused_by_the_prefill_replica(&fleet, 6).await;

    // A request for an adapter the prefill replica lacks (its 404 is its own, not the
    // request's fault) is prefilled where it is decoded.
    let members = fleet.router.fleet().members();
    wait_until("the decode replica lists its adapter", || {
        members[1].upstream.listed_adapters().is_some_and(|listed| listed.iter().any(|a| a == ADAPTER))
    })
    .await;
    let adapted = json!({ "model": ADAPTER, "prompt": words(40, 8), "max_tokens": 2 });
    let reply = post(&fleet, adapted).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.header("x-kvroute-replica"), Some("agent-1"));
    assert_eq!(prefills(&fleet, "failed").await, 1);

    // Without the prefill replica, the decode replica takes the whole request.
    fleet.kill(0).await;
    wait_until("the prefill replica is down", || !members[0].upstream.is_healthy()).await;
    let reply = fleet.http.post(&fleet.url("/v1/completions"), &completion(&words(40, 7), 4)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.header("x-kvroute-replica"), Some("agent-1"));
    assert_eq!((prefills(&fleet, "no_replica").await, prefills(&fleet, "failed").await), (1, 1));
}

/// A fleet of SGLang agents whose first `prefills` are prefill replicas, the next `decodes`
/// decode ones, and the others of neither (each of the router's replicas of engine `sglang`,
/// and of that role).
async fn sglang_fleet(agents: usize, prefills: usize, decodes: usize) -> Fleet {
    sglang_fleet_of(agents, (prefills, decodes), |c| c, |c| c).await
}

/// [`sglang_fleet`], each agent's config and the router's changed by `agent` and `router`.
async fn sglang_fleet_of(
    agents: usize,
    (prefills, decodes): (usize, usize),
    tweak: impl Fn(kvroute_replica_agent::Config) -> kvroute_replica_agent::Config,
    router: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config,
) -> Fleet {
    let role = move |i: usize| match i {
        _ if i < prefills => (Mode::Prefill, Role::Prefill),
        _ if i < prefills + decodes => (Mode::Decode, Role::Decode),
        _ => (Mode::Null, Role::Both),
    };
    let agent = move |name: &str| {
        let i: usize = name.trim_start_matches("agent-").parse().unwrap();
        tweak(kvroute_replica_agent::Config {
            disaggregation_mode: role(i).0,
            // SGLang's events are vLLM's (and a salt).
            event_format: EventFormat::Vllm,
            max_model_len: if i < prefills { PREFILL_MAX_MODEL_LEN } else { 32_768 },
            disaggregation_timeout_ms: 60_000,
            ..agent_config(name)
        })
    };
    Fleet::with(agents, agent, |mut config| {
        for (i, replica) in config.replicas.iter_mut().enumerate() {
            replica.engine = EngineKind::Sglang;
            replica.role = role(i).1;
        }
        router(config)
    })
    .await
}

/// An SGLang prefill that times out waiting for its decode replica to take the KV is not held
/// against the prefill replica: its answer waits on the decode replica. (Counted, one such
/// timeout ejected it with `--eject-after 1`, and each next healthy one in turn.) The decode
/// replica here is hand-made, and never takes the room: an agent takes it at once.
#[tokio::test]
async fn an_sglang_prefill_timeout_does_not_eject_the_prefill_replica() {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let prefill = kvroute_replica_agent::Config {
        disaggregation_mode: Mode::Prefill,
        event_format: EventFormat::Vllm,
        disaggregation_timeout_ms: 60_000,
        ..agent_config("agent-0")
    };
    let prefill = kvroute_replica_agent::start(prefill, shutdown.clone()).await.unwrap();
    let decode = crate::proxy::hand_made_replica(|_, _| std::future::pending()).await;
    let mut replicas = vec![crate::fleet::replica_config(&prefill)];
    replicas[0].engine = EngineKind::Sglang;
    replicas[0].role = Role::Prefill;
    let events = crate::support::nowhere();
    let spec = format!("name=agent-1,http=http://{decode},events={events},engine=sglang,role=decode");
    replicas.push(spec.parse().unwrap());
    let config = kvroute_router::Config {
        replicas,
        pd_prefill_timeout_ms: 200,
        connect_timeout_ms: 100,
        eject_after: 1,
        ..crate::fleet::router_config(&[])
    };
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    let http = crate::fleet::Http::new();
    let reply = http.post(&format!("{}/v1/completions", router.url()), &completion(&words(20, 41), 2)).await;
    assert_eq!(reply.status, StatusCode::GATEWAY_TIMEOUT, "{}", String::from_utf8_lossy(&reply.body));
    let message = reply.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("agent-0"), "the prefill's timeout: {message}");
    let metrics = http.get(&format!("{}/metrics", router.url())).await;
    let ejections = sample(&String::from_utf8_lossy(&metrics.body), "kvroute_router_ejections_total");
    assert_eq!(ejections, Some(0));
    shutdown.cancel();
    prefill.stop().await;
}

/// An SGLang request whose prefill replicas are all at their limit waits in line for one (its
/// decode replica's place held), as any request waits for room: it got a 503 at once.
#[tokio::test]
async fn an_sglang_prefill_waits_for_room_on_the_prefill_replicas() {
    let slow_prefill = |c: kvroute_replica_agent::Config| match c.disaggregation_mode {
        Mode::Prefill => kvroute_replica_agent::Config { time_scale: 1.0, step_base_us: 300_000, ..c },
        _ => c,
    };
    let one_each = |c| kvroute_router::Config { max_in_flight_per_replica: 1, queue_timeout_ms: 60_000, ..c };
    let fleet = sglang_fleet_of(3, (1, 2), slow_prefill, one_each).await;
    let first = tokio::spawn({
        let (http, url, body) =
            (fleet.http.clone(), fleet.url("/v1/completions"), completion(&words(20, 31), 2));
        async move { http.post(&url, &body).await }
    });
    let prefilling = "kvroute_router_replica_in_flight{replica=\"agent-0\"}";
    crate::support::wait_until_async("the first prefill sent", async || {
        let metrics = fleet.http.get(&fleet.url("/metrics")).await;
        sample(&String::from_utf8_lossy(&metrics.body), prefilling) == Some(1)
    })
    .await;
    let second = post_in_time(&fleet, completion(&words(20, 32), 2)).await;
    assert_eq!(second.status, StatusCode::OK, "{}", String::from_utf8_lossy(&second.body));
    assert_eq!(second.header("x-kvroute-prefill-replica"), Some("agent-0"));
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::OK, "{}", String::from_utf8_lossy(&first.body));
    let decoded = [&first, &second].map(|r| r.header("x-kvroute-replica").unwrap().to_owned());
    assert_ne!(decoded[0], decoded[1], "one request a decode replica");
}

#[tokio::test]
async fn sglang_prefills_go_alongside_their_decodes_through_a_bootstrap_room() {
    let fleet = sglang_fleet(4, 2, 2).await;
    let doc = words(40, 21);

    // Both replicas had the request at once: the prefill replica answers only once the decode
    // replica took the room's KV, and the decode replica decodes only once it had it.
    let (first, decoded_on, prefilled_on) = split(&fleet, completion(&format!("{doc} first ask"), 5)).await;
    let (prompt_tokens, completion_tokens, cached) = usage(&first);
    // SGLang's decode replica reports what its prefill replica had cached: nothing yet.
    assert_eq!((completion_tokens, cached), (5, 0));
    assert_eq!(first.header("x-kvroute-prefill-cached-tokens"), Some("0"));
    let p = PREFILL_NAMES.iter().position(|n| *n == prefilled_on).unwrap();
    assert_eq!(agent_metric(&fleet, p, "vllm:generation_tokens_total").await, 1, "one token");
    let d = DECODE_NAMES.iter().position(|n| *n == decoded_on).unwrap() + 2;
    let pulled = agent_metric(&fleet, d, "vllm:external_prefix_cache_hits_total").await;
    assert_eq!(pulled, prompt_tokens - 1, "the decode replica pulled the prompt but its last token");

    // Another question on the document: prefilled where the document is cached, as predicted
    // (and explained); the decode replica reports that hit.
    let asked = completion(&format!("{doc} {}", words(12, 22)), 3);
    let (how, _, prefill) = explain(&fleet, &asked).await;
    assert_eq!((how.as_str(), prefill.as_str()), ("bootstrap", prefilled_on.as_str()));
    let second = post_in_time(&fleet, asked).await;
    assert_eq!(second.status, StatusCode::OK, "{}", String::from_utf8_lossy(&second.body));
    assert_eq!(second.header("x-kvroute-prefill-replica"), Some(prefilled_on.as_str()));
    assert_eq!(second.header("x-kvroute-prefill-cached-tokens"), Some("40"));
    assert_eq!(second.header("x-kvroute-predicted-cached-tokens"), Some("40"));
    assert_eq!(usage(&second).2, 40);

    // A stream: its first chunk arrives from the decode replica.
    let body = json!({ "model": FLEET_MODEL, "prompt": words(60, 23), "max_tokens": 20, "stream": true });
    let url = fleet.url("/v1/completions");
    let streaming = fleet.http.stream(&url, &body);
    let mut streamed = tokio::time::timeout(std::time::Duration::from_secs(30), streaming).await.unwrap();
    assert_eq!(streamed.status(), StatusCode::OK);
    assert!(streamed.headers().contains_key("x-kvroute-prefill-replica"));
    assert_eq!(streamed.headers()["x-kvroute-prefill-cached-tokens"], "0");
    let chunk = first_data(streamed.body_mut()).await;
    assert!(chunk.starts_with(b"data: {"), "{chunk:?}");
    assert_eq!(prefills(&fleet, "bootstrap").await, 3);

    // A batch has a room a prompt: each prompt prefilled, in one request, on one replica.
    let p = PREFILL_NAMES.iter().position(|n| *n == prefilled_on).unwrap();
    let generated = agent_metric(&fleet, p, "vllm:generation_tokens_total").await;
    let batch =
        json!({ "model": FLEET_MODEL, "prompt": [format!("{doc} a"), format!("{doc} b")], "max_tokens": 2 });
    let (reply, _, prefilled) = split(&fleet, batch).await;
    assert_eq!(reply.json()["choices"].as_array().unwrap().len(), 2);
    assert_eq!(prefilled, prefilled_on, "where the document is cached");
    assert_eq!(agent_metric(&fleet, p, "vllm:generation_tokens_total").await - generated, 2);

    // Several choices are not split, and SGLang's decode replicas refuse a request without a
    // room: with no other replica to decode it, the router says so.
    let choices = json!({ "model": FLEET_MODEL, "prompt": words(30, 24), "max_tokens": 2, "n": 2 });
    let reply = post_in_time(&fleet, choices).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    let message = reply.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("not split"), "{message}");
}

#[tokio::test]
async fn what_is_not_split_goes_to_an_sglang_replica_that_needs_no_room() {
    // A prefill replica, a decode one, and one of neither (`both`).
    let fleet = sglang_fleet(3, 1, 1).await;
    // Requests for several choices, or for their prompt's logprobs, are not split: all go to
    // the replica that needs no room, though an idle fleet's cache-aware choice is the decode
    // replica for about half of them. (A client's own room, which would have a replica pull
    // from a host of the client's choosing, reaches neither.)
    let mut bodies = Vec::new();
    for seed in 0..4 {
        bodies.push(json!({
            "model": FLEET_MODEL, "prompt": words(30, 40 + seed), "max_tokens": 2, "n": 2,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7,
        }));
        let logprobs = json!({ "model": FLEET_MODEL, "prompt": words(30, 60 + seed), "prompt_logprobs": 1 });
        bodies.push(logprobs);
    }
    for body in bodies {
        assert_eq!(explain(&fleet, &body).await, ("not_split".into(), "agent-2".into(), String::new()));
        let reply = post_in_time(&fleet, body).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
        assert_eq!(reply.header("x-kvroute-replica"), Some("agent-2"));
    }
    assert_eq!(prefills(&fleet, "not_split").await, 8);
}

#[tokio::test]
async fn an_sglang_prefill_that_cannot_be_had_ends_its_request() {
    let mut fleet = sglang_fleet(2, 1, 1).await;
    // A prompt the prefill replica refuses (too long for its context): its answer is the
    // client's at once, though the decode replica took the request and waits for its room.
    refused_by_the_prefill_replica(&fleet, 26).await;

    // Without the prefill replica, the decode replica (which cannot prefill) is sent nothing.
    fleet.kill(0).await;
    let members = fleet.router.fleet().members();
    wait_until("the prefill replica is down", || !members[0].upstream.is_healthy()).await;
    let reply = post_in_time(&fleet, completion(&words(40, 27), 4)).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&reply.body));
    assert!(reply.json()["error"]["message"].is_string(), "{}", reply.json());
    assert_eq!(prefills(&fleet, "no_replica").await, 1);
}

#[tokio::test]
async fn sglang_generate_is_split_through_a_bootstrap_room_too() {
    let fleet = sglang_fleet(2, 1, 1).await;
    let doc = words(40, 70);
    let native = |text: String, max_new_tokens: u64| json!({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}});
    let generate = async |body: Value| {
        let url = fleet.url("/generate");
        let posted = fleet.http.post(&url, &body);
        let reply = tokio::time::timeout(std::time::Duration::from_secs(30), posted).await.expect("answered");
        assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
        assert_eq!(reply.header("x-kvroute-prefill-replica"), Some("agent-0"));
        assert_eq!(reply.header("x-kvroute-replica"), Some("agent-1"));
        reply
    };
    let first = generate(native(format!("{doc} first"), 4)).await;
    assert_eq!(first.json()["meta_info"]["completion_tokens"], 4);
    assert_eq!(agent_metric(&fleet, 0, "vllm:generation_tokens_total").await, 1, "one token prefilled");
    // The next question on the document: its hit is the prefill replica's, read from meta_info.
    let second = generate(native(format!("{doc} second"), 2)).await;
    assert_eq!(second.header("x-kvroute-prefill-cached-tokens"), Some("40"));
    assert_eq!(second.json()["meta_info"]["cached_tokens"], 40);
    // A batch: a room a prompt.
    let batch =
        json!({"text": [format!("{doc} a"), format!("{doc} b")], "sampling_params": {"max_new_tokens": 2}});
    let both = generate(batch).await;
    assert_eq!(both.json().as_array().map(Vec::len), Some(2));
    assert_eq!(both.header("x-kvroute-prefill-cached-tokens"), Some("80"), "the prompts' hits summed");
    // A batch of one: answered with a list, the prefill's hit read from its first answer.
    let one =
        generate(json!({"text": [format!("{doc} one")], "sampling_params": {"max_new_tokens": 2}})).await;
    assert_eq!(one.json().as_array().map(Vec::len), Some(1));
    assert_eq!(one.header("x-kvroute-prefill-cached-tokens"), Some("40"));
    // A stream: the prefill replica is asked for a whole answer.
    // (Its `min_new_tokens` is the decode's: the prefill's one token would not pass it.)
    let streamed = json!({
        "text": format!("{doc} d"), "stream": true,
        "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 2},
    });
    let events = String::from_utf8(generate(streamed).await.body.to_vec()).unwrap();
    assert!(events.starts_with("data: {") && events.ends_with("data: [DONE]\n\n"), "{events}");
    assert_eq!(prefills(&fleet, "bootstrap").await, 5);

    // The prompt's logprobs only the prefill replica has: not split, and no replica decodes
    // without a room.
    let logprobs = json!({"text": doc, "return_logprob": true, "logprob_start_len": 0});
    let reply = fleet.http.post(&fleet.url("/generate"), &logprobs).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&reply.body));
    let message = reply.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("not split"), "{message}");
    // The output's logprobs alone (SGLang's default start, -1) are the decode replica's.
    let output_only =
        json!({"text": format!("{doc} c"), "return_logprob": true, "sampling_params": {"max_new_tokens": 1}});
    generate(output_only).await;
}
