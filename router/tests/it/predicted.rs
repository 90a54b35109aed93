//! Replicas configured without an event stream: their caches are predicted from the router's
//! own requests (real agents, whose events nobody follows).

use std::collections::HashMap;

use kvroute_router::Config as RouterConfig;
use kvroute_router::replicas::StreamState;
use serde_json::{Value, json};

use crate::fleet::{FLEET_MODEL, Fleet, agent_config};

fn completion(prompt: &str) -> Value {
    json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 2})
}

/// A prompt of `words` distinct words starting with `tag`.
fn text(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{i}")).collect::<Vec<_>>().join(" ")
}

/// Every replica of the config without its event stream (nor replay, nor snapshots).
fn without_events(config: RouterConfig) -> RouterConfig {
    let replicas = (config.replicas.into_iter())
        .map(|r| kvroute_router::config::ReplicaConfig {
            events: String::new(),
            replay: None,
            grpc: None,
            ..r
        })
        .collect();
    RouterConfig { replicas, ..config }
}

#[tokio::test]
async fn replicas_without_events_are_routed_on_what_the_router_sent_them() {
    // Credits end at once: what follows a first request is the prediction alone.
    let config = |c| RouterConfig { credit_ttl_ms: 1, ..without_events(c) };
    let fleet = Fleet::with(3, agent_config, config).await;
    let members = fleet.router.fleet().members();
    assert!(members.iter().all(|m| m.replica.status.state() == StreamState::Predicted));
    // Nothing evicted: each replica caches what it was sent, as predicted.
    let home = crate::fleet::prefixes_come_home(&fleet, 6).await;

    let metrics = String::from_utf8_lossy(&fleet.http.get(&fleet.url("/metrics")).await.body).into_owned();
    let state = format!(r#"kvroute_ingest_stream_state{{replica="{}",state="predicted"}} 1"#, home[&0]);
    assert!(metrics.contains(&state), "{metrics}");

    // A replica removed takes its prediction with it, and records nothing after.
    let router = fleet.router.fleet();
    let gone = router.member(&home[&0]).unwrap();
    let index = router.ingest().index();
    assert!(index.blocks(gone.replica.id) > 0);
    router.remove_for_good(&home[&0]).await.freed.unwrap();
    assert_eq!(index.blocks(gone.replica.id), 0);
    gone.replica.prediction.get().unwrap().record(&[kvroute_proto::BlockHash(7)]);
    assert_eq!(index.blocks(gone.replica.id), 0);
}

/// Predicted caches share a system prompt like exact ones: load still decides.
#[tokio::test]
async fn a_shared_first_block_does_not_send_a_predicted_fleet_to_one_replica() {
    let agent = |n: &str| kvroute_replica_agent::Config { time_scale: 20.0, ..agent_config(n) };
    let fleet = Fleet::with(4, agent, without_events).await;
    let system = text("system", 24);
    let url = fleet.url("/v1/completions");
    let mut tasks = Vec::new();
    for i in 0..48 {
        let (http, url) = (fleet.http.clone(), url.clone());
        let body = completion(&format!("{system} user question {i} {}", text(&format!("q{i}w"), 10)));
        tasks.push(tokio::spawn(async move { http.post(&url, &body).await }));
    }
    let mut per_replica: HashMap<String, u32> = HashMap::new();
    let mut hits = 0;
    for t in tasks {
        let reply = t.await.unwrap();
        assert_eq!(reply.status, 200);
        hits += u32::from(reply.cached_tokens() > 0);
        *per_replica.entry(reply.header("x-kvroute-replica").unwrap().to_owned()).or_default() += 1;
    }
    assert_eq!(per_replica.len(), 4, "every replica served some: {per_replica:?}");
    let max = f64::from(*per_replica.values().max().unwrap());
    assert!(max / 12.0 <= 2.0, "load skew {} too high: {per_replica:?}", max / 12.0);
    assert!(hits > 0, "the system prompt was cached and reused somewhere");
}

/// The index of the replica `reply` came from, and its blocks there, once predicted.
fn home_blocks(fleet: &Fleet, reply: &crate::fleet::Reply) -> (kvroute_proto::ReplicaId, usize) {
    let name = reply.header("x-kvroute-replica").unwrap();
    let id = fleet.router.fleet().member(name).unwrap().replica.id;
    (id, fleet.router.fleet().ingest().index().blocks(id))
}

/// A fleet of one agent with a predicted cache (`config` on top of [`without_events`]), sent
/// one prompt: the replica's id, which the index holds blocks of.
async fn one_predicted(
    config: impl FnOnce(RouterConfig) -> RouterConfig,
) -> (Fleet, kvroute_proto::ReplicaId) {
    let fleet = Fleet::with(1, agent_config, |c| config(without_events(c))).await;
    let reply = fleet.http.post(&fleet.url("/v1/completions"), &completion(&text("onew", 40))).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let (id, blocks) = home_blocks(&fleet, &reply);
    assert!(blocks > 0);
    (fleet, id)
}

/// A replica that restarts (a new start time on its metrics page) lost its cache: its
/// prediction goes, even when no health check saw it down.
#[tokio::test]
async fn a_restarted_replica_is_predicted_empty() {
    let (mut fleet, id) = one_predicted(|c| RouterConfig { unhealthy_after: 1_000, ..c }).await;
    fleet.restart(0, agent_config("agent-0")).await;
    let index = fleet.router.fleet().ingest().index().clone();
    crate::support::wait_until("the restart drops the prediction", || index.blocks(id) == 0).await;
}

/// A replica found down (its checks fail) will come back with an empty cache.
#[tokio::test]
async fn a_replica_found_down_is_predicted_empty() {
    let (mut fleet, id) = one_predicted(|c| RouterConfig { unhealthy_after: 1, ..c }).await;
    fleet.kill(0).await;
    let index = fleet.router.fleet().ingest().index().clone();
    crate::support::wait_until("the failed checks drop the prediction", || index.blocks(id) == 0).await;
}

/// The cache size a replica reports bounds its prediction (here the agent's, far below
/// `--predicted-cache-tokens`).
#[tokio::test]
async fn a_prediction_holds_no_more_than_the_replica_reports_it_can() {
    let agent = |n: &str| kvroute_replica_agent::Config { capacity_blocks: 16, ..agent_config(n) };
    let fleet = Fleet::with(1, agent, without_events).await;
    let mut id = None;
    for doc in 0..4 {
        let reply = fleet
            .http
            .post(&fleet.url("/v1/completions"), &completion(&text(&format!("cap{doc}w"), 40)))
            .await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        id = Some(home_blocks(&fleet, &reply).0);
    }
    let index = fleet.router.fleet().ingest().index().clone();
    let id = id.unwrap();
    crate::support::wait_until("a health check reads the agent's 16 blocks", || index.blocks(id) == 16).await;
}

/// A stream whose replica answers 200 and then reports an error in it (vLLM's `data:
/// {"error": ...}`) did not prefill its prompt: nothing of it is predicted. The same answer
/// with output is.
#[tokio::test]
async fn a_stream_that_fails_in_band_is_not_predicted_cached() {
    const FAILED: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 93\r\n\r\n\
        data: {\"error\": {\"message\": \"m\", \"type\": \"InternalServerError\", \"code\": 500}}\n\n\
        data: [DONE]\n\n";
    const ANSWERED: &[u8] =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 61\r\n\r\n\
        data: {\"id\": \"c\", \"choices\": [{\"text\": \"a\"}]}\n\n\
        data: [DONE]\n\n";
    assert_eq!(predicted_after(FAILED).await, 0);
    assert!(predicted_after(ANSWERED).await > 0);
}

/// The blocks a router predicts a hand-made replica without events to hold, after one
/// streamed completion it answers with `answer`.
async fn predicted_after(answer: &'static [u8]) -> usize {
    let (addr, _seen) = crate::headers::recording_replica(answer).await;
    let config = RouterConfig {
        model: FLEET_MODEL.into(),
        replicas: vec![format!("name=r,http=http://{addr}").parse().unwrap()],
        ..RouterConfig::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    let mut body = completion(&text("inband", 40));
    body["stream"] = json!(true);
    let reply = crate::fleet::Http::new().post(&format!("{}/v1/completions", router.url()), &body).await;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert!(reply.body.ends_with(b"data: [DONE]\n\n"));
    let id = router.fleet().member("r").unwrap().replica.id;
    let blocks = router.fleet().ingest().index().blocks(id);
    shutdown.cancel();
    blocks
}
