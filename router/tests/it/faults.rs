//! The fault suite: real replica agents and a real router on loopback, a bounded background
//! load through the router ([`load`]: K clients, at most N requests each), and one fault per
//! test. Every test checks, besides its own point:
//!
//! - every request either succeeded or got an OpenAI-shaped error — a JSON error with its
//!   status, or, for a stream that had started, a final `data: {"error": ..}` event (the
//!   router's without `[DONE]` after it, the agent's with it, as vLLM's) — and none hung
//!   ([`load::Outcome`]; a request that breaks any of these fails the test);
//! - at the end, the router's index holds exactly each live replica's resident blocks
//!   ([`crate::fleet::index_matches`]).
//!
//! What a client sees when its replica dies mid-stream: the stream ends with one OpenAI
//! error event: from the agent when it fails its requests (then `data: [DONE]`, as vLLM
//! sends it), from the router when the connection breaks or goes silent past
//! `--idle-timeout-ms` (then nothing).

mod load;
mod net;

use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::BodyExt;
use kvroute_proto::openai::Endpoint;
use kvroute_router::proxy::upstream::Ineligible;
use kvroute_router::replicas::StreamState;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::fleet::{Fleet, Reply, agent_config, replica_config, router_config};
use crate::support::{wait_until, wait_until_async};
use load::{Load, LoadSpec, Outcome, completion, words};
use net::{Relay, Switch};

/// Agents for the fault suite: fast, but a long stream still lasts a few seconds.
fn fault_agent(name: &str) -> kvroute_replica_agent::Config {
    kvroute_replica_agent::Config { time_scale: 10.0, shutdown_grace_secs: 0, ..agent_config(name) }
}

/// Fault agents, `agent-1` slow: one engine step takes 2 s (its streams send their head at
/// once, then nothing for 2 s).
fn slow_agent_1(name: &str) -> kvroute_replica_agent::Config {
    match name {
        "agent-1" => {
            kvroute_replica_agent::Config { time_scale: 1.0, step_base_us: 2_000_000, ..fault_agent(name) }
        }
        _ => fault_agent(name),
    }
}

/// Index of the agent called `name`.
fn agent_index(name: &str) -> usize {
    name.trim_start_matches("agent-").parse().expect("agent-N")
}

async fn post(fleet: &Fleet, prompt: &str) -> Reply {
    fleet.http.post(&fleet.url("/v1/completions"), &completion(prompt, 2, false)).await
}

fn predicted(reply: &Reply) -> u64 {
    reply.header("x-kvroute-predicted-cached-tokens").and_then(|v| v.parse().ok()).expect("prediction header")
}

/// Tokens the router would predict for `prompt` on replica `name` (no side effects).
async fn prediction_for(fleet: &Fleet, prompt: &str, name: &str) -> u64 {
    let body = completion(prompt, 2, false).to_string();
    let plan = fleet.router.state.decider.explain(Endpoint::Completions, body.as_bytes()).await.unwrap();
    let c = plan.candidates.iter().find(|c| c.member.replica.spec.name == name).expect("candidate");
    kvroute_proto::hit_tokens(c.view.overlap_blocks, plan.block_size, plan.first_prompt_tokens) as u64
}

/// Waits (bounded) until the prediction for `prompt` on `name` satisfies `ok`.
async fn wait_prediction(fleet: &Fleet, prompt: &str, name: &str, ok: impl Fn(u64) -> bool) {
    let what = format!("the prediction on {name} to change");
    wait_until_async(&what, async || ok(prediction_for(fleet, prompt, name).await)).await;
}

/// Reads a streamed response to its end; returns the text and whether it ended cleanly.
async fn drain(response: http::Response<hyper::body::Incoming>) -> String {
    let bytes = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect())
        .await
        .expect("the stream ends")
        .expect("the stream ends cleanly (with [DONE] or an error event)")
        .to_bytes();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A fault agent in real time, one decode step (a token per stream) every 20 ms.
fn token_every_20_ms(name: &str) -> kvroute_replica_agent::Config {
    kvroute_replica_agent::Config { time_scale: 1.0, step_base_us: 20_000, ..fault_agent(name) }
}

/// Kill: requests that had not started on the dead replica are retried elsewhere, streams
/// running on it end with an error event, nothing hangs, and its index entries are gone
/// within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_replica_loses_no_request_and_leaves_the_index() {
    let mut fleet = Fleet::with(3, fault_agent, |c| c).await;
    let load = Load::start(&fleet.router.url(), LoadSpec { requests: 80, ..LoadSpec::default() });
    load.progress(20).await;

    // Long streams, one of which picks the victim; each must be producing tokens.
    let mut streams = Vec::new();
    for i in 0..3 {
        let body = completion(&words(&format!("long{i}z"), 12), 4000, true);
        let mut response = fleet.http.stream(&fleet.url("/v1/completions"), &body).await;
        assert_eq!(response.status(), 200);
        let replica = response.headers()["x-kvroute-replica"].to_str().unwrap().to_owned();
        let first = response.body_mut().frame().await.expect("a first chunk").expect("no error yet");
        assert!(first.data_ref().is_some_and(|d| !d.is_empty()));
        streams.push((replica, response));
    }
    let victim_name = streams[0].0.clone();
    let victim = agent_index(&victim_name);
    let id = fleet.router.fleet().member(&victim_name).unwrap().replica.id;
    assert!(fleet.router.state.decider.index.blocks(id) > 0, "the victim had cached blocks");

    fleet.kill(victim).await;
    // The entries go when the replica's event connection closes, not on a timer: wait for
    // that event (bounded), and report how long it took rather than asserting a time.
    let killed = Instant::now();
    let index = fleet.router.state.decider.index.clone();
    wait_until("the dead replica's blocks leave the index", || index.blocks(id) == 0).await;
    eprintln!("dead replica's index entries freed {:?} after the kill", killed.elapsed());

    for (replica, response) in streams {
        let text = drain(response).await;
        if replica == victim_name {
            // The router's error event, or the dying agent's own and then its [DONE] (as vLLM
            // ends a stream it fails).
            let mut events = text.trim_end().rsplit("\n\n");
            let last = events.next().unwrap();
            let error = if last == "data: [DONE]" { events.next().unwrap() } else { last };
            assert!(error.starts_with("data: {\"error\""), "ends with an error event: {text}");
            load::assert_openai_error(error.trim_start_matches("data: ").as_bytes());
        } else {
            assert!(text.trim_end().ends_with("data: [DONE]"), "streams elsewhere finish");
        }
    }

    load.progress(40).await;
    let report = load.finish().await;
    // Every request sent once the replica was gone was retried elsewhere: none failed.
    let after: Vec<_> = report.sent_after(killed).collect();
    assert!(after.len() >= 20, "load ran after the kill");
    for r in &after {
        match &r.outcome {
            Outcome::Ok { replica } => assert_ne!(replica, &victim_name),
            other => panic!("a request sent after the kill failed: {other:?}"),
        }
    }
    assert!(report.ok() > report.records.len() / 2, "{:?}", report.failures());
    for i in (0..3).filter(|&i| i != victim) {
        fleet.index_matches(i).await;
    }
    assert_eq!(index.blocks(id), 0);
    wait_until("the dead replica is unhealthy", || {
        fleet.router.fleet().member(&victim_name).unwrap().upstream.eligibility(u32::MAX).is_err()
    })
    .await;
}

/// Restart on the same ports (new epoch, seq 0, empty cache): the router drops what the
/// old process had without any help from the new one, and stops predicting hits on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_replica_is_followed_and_no_longer_predicted() {
    let mut fleet = Fleet::with(2, fault_agent, |c| c).await;
    let load = Load::start(&fleet.router.url(), LoadSpec { requests: 80, ..LoadSpec::default() });
    load.progress(10).await;

    let prompt = words("restartme", 40);
    let first = post(&fleet, &prompt).await;
    assert_eq!(first.status, 200);
    let name = first.header("x-kvroute-replica").unwrap().to_owned();
    let i = agent_index(&name);
    fleet.index_matches(i).await;
    wait_prediction(&fleet, &prompt, &name, |p| p > 0).await;
    let old_epoch = fleet.agent(i).epoch;

    fleet.restart(i, fault_agent(&name)).await;
    let replica = fleet.router.fleet().member(&name).unwrap().replica;
    assert_ne!(fleet.agent(i).epoch, old_epoch);
    // The old process's blocks went with its connection.
    wait_until("the router follows the new process", || replica.status.state() == StreamState::Exact).await;
    fleet.index_matches(i).await;
    // Credits of earlier decisions lapse within --credit-ttl-ms.
    wait_prediction(&fleet, &prompt, &name, |p| p == 0).await;
    let again = post(&fleet, &prompt).await;
    assert_eq!(again.status, 200);
    if again.header("x-kvroute-replica") == Some(name.as_str()) {
        assert_eq!(predicted(&again), 0);
        assert_eq!(again.cached_tokens(), 0, "the new process had nothing cached");
    }

    load.progress(20).await;
    let report = load.finish().await;
    assert!(report.ok() > 0);
    for r in report.failures() {
        // Only requests caught by the stop can fail, and only with an error they can see.
        assert!(matches!(r.outcome, Outcome::Error { .. } | Outcome::StreamError), "{r:?}");
    }
    fleet.index_matches(0).await;
    fleet.index_matches(1).await;
}

/// A lossy relay between agent 0 and the router: the gaps are detected and repaired by
/// replay, and afterwards the index equals the replica's cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_event_batches_are_repaired() {
    let shutdown = CancellationToken::new();
    let agents = Fleet::start_agents(2, fault_agent, &shutdown).await;
    let relay = Relay::start(&agents[0].events_endpoint, "tcp://127.0.0.1:0", 4, 7).await;
    // Round robin: both replicas get a share of the load whatever their caches hold.
    let mut config = kvroute_router::Config {
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        ..router_config(&agents)
    };
    config.replicas[0].events = relay.endpoint.clone();
    let fleet = Fleet::around(agents, config, shutdown).await;

    let load =
        Load::start(&fleet.router.url(), LoadSpec { requests: 40, stream_every: 4, ..LoadSpec::default() });
    let report = load.complete().await;
    assert_eq!(report.records.len(), 160);
    assert_eq!(report.ok(), report.records.len(), "{:?}", report.failures());
    assert!(relay.dropped.load(Ordering::Relaxed) > 0, "the relay dropped batches");
    assert!(relay.forwarded.load(Ordering::Relaxed) > 0, "and passed others on");

    // The last dropped batch shows as a gap only when a later one arrives.
    relay.set_lossy(false);
    let metrics = fleet.router.fleet().ingest().replica_metrics("agent-0").unwrap();
    for i in 0..200 {
        let reply = post(&fleet, &words(&format!("after{i}q"), 8)).await;
        assert_eq!(reply.status, 200);
        if reply.header("x-kvroute-replica") == Some("agent-0") && metrics.gaps.get() > 0 {
            break;
        }
    }
    assert!(metrics.gaps.get() > 0, "gaps were detected");
    assert!(metrics.replays(kvroute_router::ingest::Outcome::Ok).get() > 0, "and replayed");
    fleet.index_matches(0).await;
    fleet.index_matches(1).await;
}

/// A replica that accepts connections and never answers: the first-byte timeout answers
/// 504, `--eject-after` timeouts eject it, requests go elsewhere meanwhile, and after
/// `--ejection-ms` it is back (and serves again once it answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_replica_times_out_is_ejected_and_comes_back() {
    let shutdown = CancellationToken::new();
    let agents = Fleet::start_agents(2, fault_agent, &shutdown).await;
    let switch = Switch::start(agents[1].http_addr).await;
    let mut config = kvroute_router::Config {
        first_byte_timeout_ms: 300,
        connect_timeout_ms: 100,
        eject_after: 2,
        ejection_ms: 1_500,
        // Only passive outlier detection in this test: one health check at start.
        health_interval_ms: 600_000,
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        ..router_config(&agents)
    };
    config.replicas[1].http = switch.url();
    let fleet = Fleet::around(agents, config, shutdown).await;
    let prompt = words("silent", 40);
    let upstream = fleet.router.fleet().member("agent-1").unwrap().upstream;
    fleet.index_matches(1).await;

    let load = Load::start(&fleet.router.url(), LoadSpec { requests: 30, ..LoadSpec::default() });
    switch.set_black_hole(true);
    let mut timeouts = 0;
    while upstream.eligibility(u32::MAX) != Err(Ineligible::Ejected) {
        let reply = post(&fleet, &format!("{prompt} probe{timeouts}")).await;
        if reply.status == 504 {
            load::assert_openai_error(&reply.body);
            timeouts += 1;
        }
        assert!(timeouts <= 10, "not ejected after {timeouts} timeouts");
    }
    // While ejected, its prompt is served elsewhere at once.
    let reply = post(&fleet, &format!("{prompt} ejected")).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-kvroute-replica"), Some("agent-0"));

    switch.set_black_hole(false);
    wait_until("the ejection ends", || upstream.eligibility(u32::MAX).is_ok()).await;
    let mut back = 0;
    while post(&fleet, &format!("{prompt} back{back}")).await.header("x-kvroute-replica") != Some("agent-1") {
        back += 1;
        assert!(back < 50, "agent-1 never chosen again");
    }
    assert_eq!(upstream.eligibility(u32::MAX), Ok(()));

    load.progress(10).await;
    let report = load.finish().await;
    for r in report.failures() {
        assert!(matches!(r.outcome, Outcome::Error { status: 504 }), "only timeouts may fail: {r:?}");
    }
    assert!(upstream.ejections.load(Ordering::Relaxed) >= 1);
    fleet.index_matches(0).await;
    fleet.index_matches(1).await;
}

/// The connection to a replica breaks in the middle of a stream (no error from the
/// replica itself): the router ends the client's stream with an OpenAI error event and no
/// `[DONE]`, and the next request goes elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_cut_mid_way_ends_with_an_error_event() {
    // One token every 20 ms: the cut falls between two events.
    let shutdown = CancellationToken::new();
    let agents = Fleet::start_agents(2, token_every_20_ms, &shutdown).await;
    let switch = Switch::start(agents[0].http_addr).await;
    let mut config = kvroute_router::Config {
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        health_interval_ms: 600_000,
        ..router_config(&agents)
    };
    config.replicas[0].http = switch.url();
    let fleet = Fleet::around(agents, config, shutdown).await;
    let mut response = loop {
        let body = completion(&words("cutme", 8), 1000, true);
        let response = fleet.http.stream(&fleet.url("/v1/completions"), &body).await;
        if response.headers()["x-kvroute-replica"] == "agent-0" {
            break response;
        }
        drain(response).await;
    };
    assert_eq!(response.status(), 200);
    let request_id = response.headers()["x-request-id"].to_str().unwrap().to_owned();
    let first = response.body_mut().frame().await.expect("a first chunk").expect("no error yet");
    assert!(first.data_ref().is_some_and(|d| !d.is_empty()));
    switch.cut();
    let text = drain(response).await;
    assert!(!text.contains("[DONE]"));
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("data: {\"error\""), "ends with an error event: {last}");
    load::assert_openai_error(last.trim_start_matches("data: ").as_bytes());
    assert!(last.contains(&format!("(request id {request_id})")), "names the request: {last}");
    let next = post(&fleet, &words("aftercut", 8)).await;
    assert_eq!(next.status, 200, "retried elsewhere: {}", String::from_utf8_lossy(&next.body));
    assert_eq!(next.header("x-kvroute-replica"), Some("agent-1"));
}

/// A shutdown lets open streams go on for `--drain-timeout-ms`, then ends them with an error
/// event that says why, and the router stops: a stream far longer than that (1000 tokens at
/// 20 ms) does not hold it up until its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_ends_open_streams_at_its_timeout() {
    let fleet =
        Fleet::with(1, token_every_20_ms, |c| kvroute_router::Config { drain_timeout_ms: 300, ..c }).await;
    let body = completion(&words("drainme", 8), 1000, true);
    let mut response = fleet.http.stream(&fleet.url("/v1/completions"), &body).await;
    assert_eq!(response.status(), 200);
    let first = tokio::time::timeout(Duration::from_secs(30), response.body_mut().frame()).await;
    assert!(first.expect("a first chunk").expect("a frame").expect("no error").data_ref().is_some());
    // `RunningRouter::stop`, the router kept (the fleet stops it again when dropped).
    fleet.router.parts.shutdown.cancel();
    fleet.router.parts.tracker.close();
    let tracker = fleet.router.parts.tracker.clone();
    let stopping = tokio::spawn(async move { tracker.wait().await });
    let text = drain(response).await;
    assert!(!text.contains("[DONE]"), "ended before its end");
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("data: {\"error\"") && last.contains("shutting down"), "{last}");
    assert!(!last.contains("replica"), "the router's doing, not the replica's: {last}");
    load::assert_openai_error(last.trim_start_matches("data: ").as_bytes());
    tokio::time::timeout(Duration::from_secs(10), stopping).await.expect("the router stops").unwrap();
}

/// A replica whose first token takes far longer than `--first-byte-timeout-ms`: 504s, then
/// ejection; a stream to it that goes silent past `--idle-timeout-ms` ends with an error
/// event; after `--ejection-ms` it is tried again (and, still slow, ejected again at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_replica_times_out_and_is_ejected() {
    let fleet = Fleet::with(2, slow_agent_1, |c| kvroute_router::Config {
        first_byte_timeout_ms: 300,
        connect_timeout_ms: 100,
        idle_timeout_ms: 300,
        eject_after: 2,
        ejection_ms: 1_000,
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        ..c
    })
    .await;
    let upstream = fleet.router.fleet().member("agent-1").unwrap().upstream;

    // A stream to the slow replica: headers come at once, then nothing until the idle timeout.
    let mut stream_checked = false;
    for i in 0..4 {
        let body = completion(&words(&format!("slowstream{i}"), 8), 4, true);
        let response = fleet.http.stream(&fleet.url("/v1/completions"), &body).await;
        if response.headers().get("x-kvroute-replica").is_some_and(|v| v == "agent-1")
            && response.status() == 200
        {
            let text = drain(response).await;
            assert!(!text.contains("[DONE]"));
            let last = text.trim_end().rsplit("\n\n").next().unwrap();
            load::assert_openai_error(last.trim_start_matches("data: ").as_bytes());
            stream_checked = true;
            break;
        }
        drain(response).await;
    }
    assert!(stream_checked, "round robin sent a stream to agent-1");

    let mut timeouts = 0;
    let mut i = 0;
    while upstream.eligibility(u32::MAX) != Err(Ineligible::Ejected) {
        let reply = post(&fleet, &words(&format!("slow{i}"), 8)).await;
        i += 1;
        if reply.status == 504 {
            load::assert_openai_error(&reply.body);
            timeouts += 1;
        }
        assert!(i < 40, "never ejected");
    }
    assert!(timeouts >= 1);
    let load =
        Load::start(&fleet.router.url(), LoadSpec { requests: 20, stream_every: 0, ..LoadSpec::default() });
    let report = load.complete().await;
    assert_eq!(report.records.len(), 80);
    assert_eq!(report.ok(), report.records.len(), "while ejected, everything goes to agent-0");
    assert!(report.records.iter().all(|r| r.outcome == Outcome::Ok { replica: "agent-0".into() }));

    let ejections = upstream.ejections.load(Ordering::Relaxed);
    wait_until("the ejection ends", || upstream.eligibility(u32::MAX).is_ok()).await;
    // Back in rotation; still slow, so one more timeout ejects it again at once.
    let mut j = 0;
    while upstream.ejections.load(Ordering::Relaxed) == ejections {
        let reply = post(&fleet, &words(&format!("again{j}"), 8)).await;
        assert!(reply.status == 200 || reply.status == 504, "{}", reply.status);
        j += 1;
        assert!(j < 10, "agent-1 was not tried again");
    }
}

/// A replica whose streams go silent after their first event (a wedged engine) is ejected
/// by the streams' idle timeouts alone: a head is no success until its body ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_streams_go_silent_is_ejected() {
    let fleet = Fleet::with(2, slow_agent_1, |c| kvroute_router::Config {
        first_byte_timeout_ms: 30_000,
        idle_timeout_ms: 300,
        eject_after: 2,
        ejection_ms: 60_000,
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        ..c
    })
    .await;
    let upstream = fleet.router.fleet().member("agent-1").unwrap().upstream;
    let mut silent = 0;
    for i in 0.. {
        assert!(i < 12, "never ejected after {silent} silent streams");
        if upstream.eligibility(u32::MAX) == Err(Ineligible::Ejected) {
            break;
        }
        let body = completion(&words(&format!("wedged{i}"), 8), 4, true);
        let response = fleet.http.stream(&fleet.url("/v1/completions"), &body).await;
        assert_eq!(response.status(), 200);
        let agent_1 = response.headers().get("x-kvroute-replica").is_some_and(|v| v == "agent-1");
        let text = drain(response).await;
        assert_eq!(!text.contains("[DONE]"), agent_1, "only agent-1's streams fail: {text}");
        silent += usize::from(agent_1);
    }
    assert_eq!(silent, 2, "--eject-after silent streams eject it");
}

/// A stream's first event comes after its request's queueing and prefill, which the
/// first-byte timeout bounds, not the idle timeout: `agent-1` takes over two seconds to
/// prefill, then its tokens come fast, and its streams end whole with an idle timeout of 1 s
/// (long enough that a loaded machine's pauses between tokens do not reach it). A Responses
/// stream's first events (`response.created`, `response.in_progress`) come before the
/// prefill: its output is what the first-byte timeout bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_first_event_may_take_up_to_the_first_byte_timeout() {
    let slow_prefill = |name: &str| match name {
        "agent-1" => kvroute_replica_agent::Config {
            time_scale: 1.0,
            step_base_us: 1_000,
            decode_us_per_seq: 0,
            prefill_us_per_token: 300_000,
            ..fault_agent(name)
        },
        _ => fault_agent(name),
    };
    let fleet = Fleet::with(2, slow_prefill, |c| kvroute_router::Config {
        first_byte_timeout_ms: 30_000,
        idle_timeout_ms: 1_000,
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        ..c
    })
    .await;
    // A Responses stream's opening events come at once, before the prefill (as vLLM sends
    // them): its output is still the first-byte timeout's to wait for.
    let responses = |i: usize| {
        let body = serde_json::json!({"model": crate::fleet::FLEET_MODEL, "input": format!("opening{i}"),
            "max_output_tokens": 4, "stream": true});
        ("/v1/responses", body, ["event: response.completed", "event: response.incomplete"])
    };
    let completions = |i: usize| {
        ("/v1/completions", completion(&words(&format!("prefill{i}"), 8), 4, true), ["data: [DONE]"; 2])
    };
    for (endpoint, request) in
        [("completions", &completions as &dyn Fn(usize) -> _), ("responses", &responses)]
    {
        let mut slow_streams = 0;
        for i in 0..2 {
            let (path, body, ends) = request(i);
            let sent = Instant::now();
            let response = fleet.http.stream(&fleet.url(path), &body).await;
            assert_eq!(response.status(), 200);
            let agent_1 = response.headers().get("x-kvroute-replica").is_some_and(|v| v == "agent-1");
            let text = drain(response).await;
            let ended = ends.iter().any(|end| text.contains(end));
            assert!(ended && !text.contains("\"error\""), "{endpoint}: {text}");
            if agent_1 {
                assert!(
                    sent.elapsed() > Duration::from_millis(1_000),
                    "{endpoint}: the prefill outlasted the idle timeout"
                );
                slow_streams += 1;
            }
        }
        assert_eq!(slow_streams, 1, "{endpoint}: round robin sent one of two streams to agent-1");
    }
}

/// Ejection never leaves the router with nothing to try: with every replica ejected, the
/// ejected ones are tried anyway.
#[tokio::test]
async fn with_every_replica_ejected_the_ejected_are_tried() {
    let fleet = Fleet::with(1, fault_agent, |c| c).await;
    let upstream = fleet.router.fleet().member("agent-0").unwrap().upstream;
    assert!(upstream.record_failure(1, Duration::from_secs(60)));
    assert_eq!(upstream.eligibility(u32::MAX), Err(Ineligible::Ejected));
    let reply = post(&fleet, &words("panic", 8)).await;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.header("x-kvroute-replica"), Some("agent-0"));
}

/// Router restart: a new router in front of the same agents is not ready until every
/// replica synced (it still serves meanwhile), then its predictions are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_router_resyncs_before_it_is_ready() {
    let mut fleet = Fleet::with(2, fault_agent, |c| c).await;
    let load =
        Load::start(&fleet.router.url(), LoadSpec { requests: 30, stream_every: 0, ..LoadSpec::default() });
    let report = load.complete().await;
    assert_eq!(report.records.len(), 120);
    assert_eq!(report.ok(), report.records.len(), "{:?}", report.failures());
    let warm: Vec<String> = (0..6).map(|i| words(&format!("warm{i}v"), 30)).collect();
    for p in &warm {
        assert_eq!(post(&fleet, p).await.status, 200);
    }

    // The new router reaches agent-0's events through a relay that is not there yet.
    let port = kvroute_proto::loopback_port::unused().unwrap();
    let gated = format!("tcp://127.0.0.1:{port}");
    let mut config = kvroute_router::Config {
        replicas: fleet.agents.iter().flatten().map(replica_config).collect(),
        ..router_config(&[])
    };
    config.replicas[0].events = gated.clone();
    let new = kvroute_router::start(config, fleet.shutdown.child_token()).await.unwrap();
    let old = fleet.replace_router(new);
    old.stop().await;

    let ready = fleet.http.get(&fleet.url("/ready")).await;
    assert_eq!(ready.status, 503, "not ready before every replica synced");
    let load = Load::start(&fleet.router.url(), LoadSpec { requests: 30, seed: 2, ..LoadSpec::default() });
    let served = post(&fleet, &words("beforeready", 12)).await;
    assert_eq!(served.status, 200, "requests are served before /ready");

    let relay = Relay::start(&fleet.agent(0).events_endpoint, &gated, 0, 0).await;
    let router_fleet = fleet.router.fleet().clone();
    wait_until("the new router is ready", || router_fleet.ready()).await;
    assert_eq!(fleet.http.get(&fleet.url("/ready")).await.status, 200);
    fleet.index_matches(0).await;
    fleet.index_matches(1).await;

    // Predictions are exact: what the router predicts is what the replica reports.
    let mut hits = 0;
    for p in &warm {
        let reply = post(&fleet, p).await;
        assert_eq!(reply.status, 200);
        assert_eq!(predicted(&reply), reply.cached_tokens(), "prediction for {p:?}");
        hits += u64::from(reply.cached_tokens() > 0);
    }
    assert!(hits > 0, "the warm prompts were found in the resynced index");
    load.progress(10).await;
    let report = load.finish().await;
    assert_eq!(report.ok(), report.records.len(), "{:?}", report.failures());
    drop(relay);
}
