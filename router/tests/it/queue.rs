//! Waiting for room (`--max-queued`, `--queue-timeout-ms`): requests past the router's
//! in-flight limit, or past every replica's, wait in line and are served when room frees,
//! against a real replica agent whose streams hold their places.

use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::fleet::{FLEET_MODEL, Fleet, Reply, agent_config};
use crate::support::{WAIT, sample, wait_until};

/// One replica that takes 200 ms a step, so that a stream of 16 tokens holds its place for
/// three seconds, behind a router set up by `router`.
async fn slow_fleet(router: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config) -> Fleet {
    let slow = |name: &str| kvroute_replica_agent::Config { responses_store: true, ..slow_agent(name) };
    Fleet::with(1, slow, router).await
}

/// An agent that takes 200 ms a step.
fn slow_agent(name: &str) -> kvroute_replica_agent::Config {
    kvroute_replica_agent::Config { time_scale: 1.0, step_base_us: 200_000, ..agent_config(name) }
}

/// `--queue-timeout-ms` of the tests whose requests are served after waiting: long enough
/// for a slow machine.
const LONG: u64 = WAIT.as_millis() as u64;

fn completion(prompt: &str) -> Value {
    json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 1})
}

/// Waits (bounded) until `n` requests wait in line.
async fn queued(fleet: &Fleet, n: i64) {
    let queued = &fleet.router.state.decider.metrics.queued;
    let reached = async {
        while queued.get() != n {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(WAIT, reached).await.unwrap_or_else(|_| panic!("{} waiting, not {n}", queued.get()));
}

/// The count of waits that ended with `outcome`.
fn outcomes(fleet: &Fleet, outcome: &'static str) -> u64 {
    let label = kvroute_router::metrics::OutcomeLabel { outcome };
    fleet.router.state.decider.metrics.queue_outcomes.get_or_create(&label).get()
}

/// Opens a stream of 16 tokens (holding its place until it ends); returns it to be read.
async fn open_stream(fleet: &Fleet) -> http::Response<hyper::body::Incoming> {
    open_stream_of(fleet, 16).await
}

/// [`open_stream`] of `tokens` tokens.
async fn open_stream_of(fleet: &Fleet, tokens: u32) -> http::Response<hyper::body::Incoming> {
    let streaming = json!({"model": FLEET_MODEL, "prompt": "hold it", "max_tokens": tokens, "stream": true});
    let open = fleet.http.stream(&fleet.url("/v1/completions"), &streaming).await;
    assert_eq!(open.status(), 200);
    open
}

async fn read_to_end(open: http::Response<hyper::body::Incoming>) -> String {
    let body = tokio::time::timeout(WAIT, open.into_body().collect()).await.expect("in time").unwrap();
    String::from_utf8(body.to_bytes().to_vec()).unwrap()
}

/// At `--max-in-flight 1`, a request made while a stream is open waits for its place, and is
/// served when the stream ends.
#[tokio::test]
async fn a_request_at_the_in_flight_limit_is_served_when_a_place_frees() {
    let fleet =
        slow_fleet(|c| kvroute_router::Config { max_in_flight: 1, queue_timeout_ms: LONG, ..c }).await;
    let open = open_stream(&fleet).await;
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let waiting = tokio::spawn(async move { http.post(&url, &completion("hi")).await });
    queued(&fleet, 1).await;
    assert!(!waiting.is_finished(), "answered while the stream holds the only place");
    assert!(read_to_end(open).await.contains("[DONE]"));
    let answer = tokio::time::timeout(WAIT, waiting).await.expect("served in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!((outcomes(&fleet, "placed"), fleet.router.state.decider.metrics.queued.get()), (1, 0));
}

/// A request waiting for its place under `--max-in-flight` whose key a reload revokes
/// meanwhile is refused once it has the place (401), as it would be had it come then: it was
/// forwarded.
#[tokio::test]
async fn a_key_revoked_while_its_request_waits_is_refused() {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(1, slow_agent, &shutdown).await;
    let config = kvroute_router::Config {
        max_in_flight: 1,
        queue_timeout_ms: LONG,
        api_key: vec!["sk-a".into()],
        ..crate::fleet::router_config(&agents)
    };
    let mut reloader = kvroute_router::reload::Reloader::new(&config);
    let fleet = Fleet::around(agents, config.clone(), shutdown).await;
    let keyed = fleet.http.clone().bearer("sk-a");
    let streaming = json!({"model": FLEET_MODEL, "prompt": "hold it", "max_tokens": 16, "stream": true});
    let open = keyed
        .stream_with(&fleet.url("/v1/completions"), &streaming, &[("authorization", "Bearer sk-a")])
        .await;
    assert_eq!(open.status(), 200);
    let url = fleet.url("/v1/completions");
    let waiting = tokio::spawn({
        let keyed = keyed.clone();
        async move { keyed.post(&url, &completion("hi")).await }
    });
    queued(&fleet, 1).await;
    let rotated = kvroute_router::Config { api_key: vec!["sk-b".into()], ..config };
    assert_eq!(reloader.apply(&fleet.router.state, &rotated).await.applied, ["api-key"]);
    assert!(read_to_end(open).await.contains("[DONE]"));
    let answer = tokio::time::timeout(WAIT, waiting).await.expect("answered in time").unwrap();
    assert_eq!(answer.status, 401, "{}", String::from_utf8_lossy(&answer.body));
}

/// With every replica at `--max-in-flight-per-replica`, routed requests and requests that pass
/// through wait for a replica's room, each is served as a request to it ends.
#[tokio::test]
async fn requests_wait_for_a_saturated_replica_and_are_served_when_it_has_room() {
    let fleet =
        slow_fleet(|c| kvroute_router::Config { max_in_flight_per_replica: 1, queue_timeout_ms: LONG, ..c })
            .await;
    let open = open_stream(&fleet).await;
    let (http, routed) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let completion = tokio::spawn(async move { http.post(&routed, &completion("hi")).await });
    let (http, passing) = (fleet.http.clone(), fleet.url("/tokenize"));
    let tokenize =
        tokio::spawn(
            async move { http.post(&passing, &json!({"model": FLEET_MODEL, "prompt": "hi"})).await },
        );
    queued(&fleet, 2).await;
    assert!(read_to_end(open).await.contains("[DONE]"));
    for waiting in [completion, tokenize] {
        let answer = tokio::time::timeout(WAIT, waiting).await.expect("served in time").unwrap();
        assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    }
    assert_eq!(outcomes(&fleet, "placed"), 2);
}

/// A reload that raises `--max-in-flight-per-replica` serves a request waiting for the
/// replica's room at once, while the stream that filled it is still open (the stream takes
/// 16 steps of a second).
#[tokio::test]
async fn a_reload_that_raises_the_replicas_limit_serves_the_request_waiting() {
    let mut started = None;
    let slower = |name: &str| kvroute_replica_agent::Config { step_base_us: 1_000_000, ..slow_agent(name) };
    let fleet = Fleet::with(1, slower, |c| {
        let c = kvroute_router::Config { max_in_flight_per_replica: 1, queue_timeout_ms: LONG, ..c };
        started = Some(c.clone());
        c
    })
    .await;
    let started = started.unwrap();
    let mut reloader = kvroute_router::reload::Reloader::new(&started);
    let open = open_stream(&fleet).await;
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let waiting = tokio::spawn(async move { http.post(&url, &completion("hi")).await });
    queued(&fleet, 1).await;
    let raised = kvroute_router::Config { max_in_flight_per_replica: 2, ..started };
    let reloaded = reloader.apply(&fleet.router.state, &raised).await;
    assert_eq!(
        (reloaded.applied, reloaded.not_applied),
        (vec!["max-in-flight-per-replica".to_owned()], vec![])
    );
    let answer = tokio::time::timeout(WAIT, waiting).await.expect("served in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    let replica = &fleet.router.fleet().members()[0];
    assert_eq!(replica.upstream.requests_in_flight(), 1, "served while the stream is open");
    assert_eq!(outcomes(&fleet, "placed"), 1);
    drop(open);
}

/// Requests waiting for a replica's room are served by their `priority` (vLLM's field: lower
/// first), whenever they came; a Responses continuation's too.
#[tokio::test]
async fn requests_waiting_for_room_are_served_by_priority() {
    // A replica that takes priorities (vLLM's `--scheduling-policy priority`).
    let slow = |name: &str| kvroute_replica_agent::Config {
        scheduling_policy: kvroute_replica_agent::config::SchedulingPolicy::Priority,
        responses_store: true,
        ..slow_agent(name)
    };
    let fleet = Fleet::with(1, slow, |c| kvroute_router::Config {
        max_in_flight_per_replica: 1,
        queue_timeout_ms: LONG,
        ..c
    })
    .await;
    let first = json!({"model": FLEET_MODEL, "input": "hello", "max_output_tokens": 1, "store": true});
    let first = fleet.http.post(&fleet.url("/v1/responses"), &first).await;
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
    let next = json!({"model": FLEET_MODEL, "previous_response_id": first.json()["id"], "input": "more",
        "max_output_tokens": 1});
    let open = open_stream(&fleet).await;
    let (served, mut order) = tokio::sync::mpsc::unbounded_channel();
    let bodies = [
        ("/v1/completions", completion("hi")),
        ("/v1/completions", completion("hi")),
        ("/v1/responses", next),
    ];
    for (n, (priority, (path, mut body))) in [0, -1, -2].into_iter().zip(bodies).enumerate() {
        let (http, url, served) = (fleet.http.clone(), fleet.url(path), served.clone());
        body["priority"] = priority.into();
        tokio::spawn(async move {
            let answer = http.post(&url, &body).await;
            served.send((priority, answer.status.as_u16())).unwrap();
        });
        queued(&fleet, n as i64 + 1).await;
    }
    assert!(read_to_end(open).await.contains("[DONE]"));
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(tokio::time::timeout(WAIT, order.recv()).await.expect("served in time").unwrap());
    }
    assert_eq!(got, [(-2, 200), (-1, 200), (0, 200)], "the lower priority first");
}

/// A request woken while there is still no room decides again on the fleet as it is, without
/// tokenizing its prompt again.
#[tokio::test]
async fn a_woken_request_decides_again_without_tokenizing_again() {
    let fleet =
        slow_fleet(|c| kvroute_router::Config { max_in_flight_per_replica: 1, queue_timeout_ms: LONG, ..c })
            .await;
    let state = &fleet.router.state;
    let tokenized = || {
        let stats = state.decider.prompts.tokenization().prefix_cache_stats().expect("the cache is on");
        stats.tokenized_bytes + stats.reused_bytes
    };
    let decisions = || {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &state.registry).unwrap();
        sample(&text, "kvroute_router_decision_seconds_count").unwrap()
    };
    let open = open_stream(&fleet).await;
    let before = tokenized();
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let waiting =
        tokio::spawn(async move { http.post(&url, &completion(&"a long prompt ".repeat(50))).await });
    queued(&fleet, 1).await;
    let (once, decided) = (tokenized(), decisions());
    assert!(once > before, "the request was tokenized");
    fleet.router.fleet().waiters().wake_all();
    wait_until("decided again", || decisions() > decided).await;
    assert_eq!(tokenized(), once, "tokenized again");
    assert!(read_to_end(open).await.contains("[DONE]"));
    let answer = tokio::time::timeout(WAIT, waiting).await.expect("served in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(tokenized(), once);
}

/// A request whose time in line runs out gets 503 saying why and how long it waited, with
/// `Retry-After`; with the line off, it gets 503 at once.
#[tokio::test]
async fn a_request_that_waited_its_time_in_vain_gets_503() {
    let fleet =
        slow_fleet(|c| kvroute_router::Config { max_in_flight_per_replica: 1, queue_timeout_ms: 200, ..c })
            .await;
    let open = open_stream(&fleet).await;
    let refused = fleet.http.post(&fleet.url("/v1/completions"), &completion("hi")).await;
    assert_eq!(refused.status, 503, "{}", String::from_utf8_lossy(&refused.body));
    let message = refused.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("saturated") && message.contains(" ms in line for room"), "{message}");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(outcomes(&fleet, "timed_out"), 1);
    let metrics = fleet.http.get(&fleet.url("/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("kvroute_router_errors_total{kind=\"saturated\"} 1"), "{text}");
    drop(open);
}

/// `--max-queued 0` turns the line off: 503 at once.
#[tokio::test]
async fn with_no_line_a_request_past_the_limit_gets_503_at_once() {
    let fleet = slow_fleet(|c| kvroute_router::Config { max_in_flight: 1, max_queued: 0, ..c }).await;
    let open = open_stream(&fleet).await;
    // Had it waited, it would have been served once the stream ended.
    let refused = fleet.http.post(&fleet.url("/v1/completions"), &completion("hi")).await;
    assert_eq!(refused.status, 503, "{}", String::from_utf8_lossy(&refused.body));
    assert!(refused.json()["error"]["message"].as_str().unwrap().contains("in-flight limit"));
    drop(open);
}

/// A Responses continuation can go only to the replica that stored its response: with that
/// replica at `--max-in-flight-per-replica`, it waits for room there, and is served when a
/// request to it ends.
#[tokio::test]
async fn a_continuation_waits_for_room_on_the_replica_that_stored_its_response() {
    let fleet =
        slow_fleet(|c| kvroute_router::Config { max_in_flight_per_replica: 1, queue_timeout_ms: LONG, ..c })
            .await;
    let url = fleet.url("/v1/responses");
    let first = json!({"model": FLEET_MODEL, "input": "hello", "max_output_tokens": 1, "store": true});
    let first = fleet.http.post(&url, &first).await;
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
    let id = first.json()["id"].as_str().unwrap().to_owned();
    let open = open_stream(&fleet).await;
    let next =
        json!({"model": FLEET_MODEL, "previous_response_id": id, "input": "more", "max_output_tokens": 1});
    let http = fleet.http.clone();
    let waiting = tokio::spawn(async move { http.post(&url, &next).await });
    queued(&fleet, 1).await;
    assert!(read_to_end(open).await.contains("[DONE]"));
    let answer = tokio::time::timeout(WAIT, waiting).await.expect("served in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(outcomes(&fleet, "placed"), 1);
}

/// A replica that refuses connections (it died, and no health check has noticed yet) while
/// the rest of the fleet is saturated: a request sent there is retried on the rest once it
/// has room, not answered 502.
#[tokio::test]
async fn a_retry_off_a_dead_replica_waits_for_room_on_the_saturated_rest() {
    let (fleet, open, busy) = dead_beside_busy().await;
    let dead = if busy == 0 { "agent-1" } else { "agent-0" };
    let busy = format!("agent-{busy}");
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let prompt = completion("one two three four five six seven eight nine ten");
    let body = prompt.to_string();
    let retried = tokio::spawn(async move { http.post(&url, &prompt).await });
    queued(&fleet, 1).await;
    // While it waits, the dead replica holds no credit for its prefix (which would draw the
    // prefix's next requests there).
    let decider = &fleet.router.state.decider;
    let plan = decider.explain(kvroute_proto::openai::Endpoint::Completions, body.as_bytes()).await.unwrap();
    assert!(plan.blocks.len() >= 2, "a prefix of blocks");
    let credited = |name: &str| {
        plan.candidates.iter().find(|c| c.member.replica.spec.name == name).unwrap().credited_blocks
    };
    assert_eq!(credited(dead), 0);
    assert!(read_to_end(open).await.contains("[DONE]"));
    let answer = tokio::time::timeout(WAIT, retried).await.expect("served in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(answer.header("x-kvroute-replica"), Some(busy.as_str()));
    assert_eq!((fleet.router.state.decider.metrics.retries.get(), outcomes(&fleet, "placed")), (1, 1));
}

/// A retry that waited for room is scored as the replica is when it is sent: one that cached
/// the prompt while the retry waited is predicted to hit it (its pins and pending prefill
/// follow), not as it was when the request was decided.
#[tokio::test]
async fn a_retry_that_waited_is_scored_as_its_replica_is_when_it_is_sent() {
    let (fleet, open, busy) = dead_beside_busy().await;
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let prompt = completion("one two three four five six seven eight nine ten eleven twelve");
    let sent = prompt.clone();
    let retried = tokio::spawn(async move { http.post(&url, &sent).await });
    queued(&fleet, 1).await;
    // While it waits, the busy replica runs the same prompt for another client of its own.
    let direct = fleet.http.post(&format!("{}/v1/completions", fleet.agent(busy).http_url()), &prompt).await;
    assert_eq!(direct.status, 200, "{}", String::from_utf8_lossy(&direct.body));
    fleet.index_matches(busy).await;
    assert!(read_to_end(open).await.contains("[DONE]"));
    let answer = tokio::time::timeout(WAIT, retried).await.expect("served in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(answer.header("x-kvroute-replica"), Some(format!("agent-{busy}").as_str()));
    let predicted: u64 = answer.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
    assert!(predicted > 0, "the prompt is cached where the retry goes");
    assert_eq!(predicted, answer.cached_tokens());
}

/// Two slow agents, at most one request each: one of them busy with an open stream (returned
/// with its index), the other dead, unbeknown to the router (no health check after the
/// first).
async fn dead_beside_busy() -> (Fleet, http::Response<hyper::body::Incoming>, usize) {
    let mut fleet = Fleet::with(2, slow_agent, |c| kvroute_router::Config {
        max_in_flight_per_replica: 1,
        queue_timeout_ms: LONG,
        health_interval_ms: 3_600_000,
        ..c
    })
    .await;
    let open = open_stream(&fleet).await;
    let busy = usize::from(open.headers()["x-kvroute-replica"] == "agent-1");
    fleet.kill(1 - busy).await;
    (fleet, open, busy)
}

/// A replica that refuses every request with 503 (its own queue full) beside an agent at its
/// one request's room, holding a stream (every request sent first to the refusing one ends
/// up there); and a request the refusing replica refused, waiting in line for the agent.
async fn refused_and_waiting(
    stream_tokens: u32,
    queue_timeout_ms: u64,
) -> (Fleet, http::Response<hyper::body::Incoming>, tokio::task::JoinHandle<Reply>, kvroute_router::Config) {
    let refusal = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n";
    let (refusing, _refused) = crate::headers::recording_replica(refusal).await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(1, slow_agent, &shutdown).await;
    let config = crate::fleet::router_config_and_streamless(&agents, "refusing", refusing);
    let config = kvroute_router::Config { max_in_flight_per_replica: 1, queue_timeout_ms, ..config };
    let fleet = Fleet::around(agents, config.clone(), shutdown).await;
    // Wherever it is sent first, the stream ends up on the agent.
    let open = open_stream_of(&fleet, stream_tokens).await;
    assert_eq!(open.headers()["x-kvroute-replica"], "agent-0");
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
    let refused = tokio::spawn(async move { http.post(&url, &completion("hi")).await });
    queued(&fleet, 1).await;
    (fleet, open, refused, config)
}

/// A replica that refuses a request with 503 (its own queue full) while the rest of the fleet
/// is saturated: the request waits for room on the rest and is served there, not answered 503.
#[tokio::test]
async fn a_request_a_replica_refuses_with_503_waits_for_room_on_the_saturated_rest() {
    let (_fleet, open, refused, _) = refused_and_waiting(16, LONG).await;
    assert!(read_to_end(open).await.contains("[DONE]"));
    let answer = tokio::time::timeout(WAIT, refused).await.expect("served in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(answer.header("x-kvroute-replica"), Some("agent-0"));
}

/// The same, but the replica it waits for is drained meanwhile: no replica is left to take
/// it, and the client gets the refusal's 503 (with `Retry-After`), not a 502 of a replica
/// that failed.
#[tokio::test]
async fn a_request_refused_with_503_whose_last_replica_drains_is_answered_503() {
    let (fleet, open, refused, _) = refused_and_waiting(16, LONG).await;
    fleet.router.fleet().set_draining("agent-0", true).unwrap();
    assert!(read_to_end(open).await.contains("[DONE]"));
    let answer = tokio::time::timeout(WAIT, refused).await.expect("answered in time").unwrap();
    assert_eq!(answer.status, 503, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(answer.header("retry-after"), Some("1"));
    let message = answer.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("replica refusing answered 503"), "{message}");
}

/// The same, but the replica it waits for is removed from the fleet meanwhile (its stream
/// still open): the request decides again at once and is answered 503. Regression: a removal
/// woke nobody, and the request slept until that stream ended or its queue timeout passed.
#[tokio::test]
async fn a_request_waiting_for_a_replica_removed_meanwhile_is_answered_at_once() {
    let (fleet, _open, refused, _) = refused_and_waiting(400, 10 * LONG).await;
    fleet.router.fleet().remove("agent-0").await;
    let answer = tokio::time::timeout(WAIT, refused).await.expect("answered in time").unwrap();
    assert_eq!(answer.status, 503, "{}", String::from_utf8_lossy(&answer.body));
}

/// The same, but a reload raises `--max-in-flight-per-replica` meanwhile: the waiting retry
/// takes the room the new limit gives at once (it kept to the limit it was decided under, and
/// waited for the stream to end).
#[tokio::test]
async fn a_waiting_retry_takes_the_room_a_reload_gives() {
    // A stream long enough (about 10 s) to be running still when the retry is served.
    let (fleet, open, refused, config) = refused_and_waiting(48, LONG).await;
    let mut reloader = kvroute_router::reload::Reloader::new(&config);
    let raised = kvroute_router::Config { max_in_flight_per_replica: 2, ..config };
    let reloaded = reloader.apply(&fleet.router.state, &raised).await;
    assert_eq!(reloaded.applied, ["max-in-flight-per-replica"]);
    let answer = tokio::time::timeout(WAIT, refused).await.expect("served in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(answer.header("x-kvroute-replica"), Some("agent-0"));
    let stream_on = fleet.router.fleet().member("agent-0").unwrap().upstream.requests_in_flight();
    assert_eq!(stream_on, 1, "served while the stream went on, not after it");
    drop(open);
}

/// Many requests at once, far past two replicas' room, on two HTTP threads: every one is
/// served, and when they are done nobody waits and no room is held (the holds for woken
/// requests are let go on every path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_the_fleets_room_is_served_and_leaves_nothing_held() {
    let agent = |name: &str| kvroute_replica_agent::Config {
        scheduling_policy: kvroute_replica_agent::config::SchedulingPolicy::Priority,
        ..agent_config(name)
    };
    let fleet = Fleet::with(2, agent, |c| kvroute_router::Config {
        max_in_flight_per_replica: 2,
        queue_timeout_ms: LONG,
        http_threads: 2,
        ..c
    })
    .await;
    let requests = (0..48).map(|i| {
        let (http, url) = (fleet.http.clone(), fleet.url("/v1/completions"));
        let mut body = completion(&format!("burst {i} of many words"));
        body["max_tokens"] = 8.into();
        body["priority"] = (i % 3).into();
        tokio::spawn(async move { http.post(&url, &body).await })
    });
    for request in futures::future::join_all(requests.collect::<Vec<_>>()).await {
        let answer = request.unwrap();
        assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    }
    assert!(outcomes(&fleet, "placed") > 0, "requests waited for room");
    queued(&fleet, 0).await;
    let router_fleet = fleet.router.fleet();
    for member in router_fleet.members() {
        assert_eq!(
            router_fleet.waiters().held_for_others(member.replica.id),
            0,
            "{}",
            member.replica.spec.name
        );
        assert_eq!(member.upstream.requests_in_flight(), 0);
    }
}

/// A replica whose spec changes at the same address (discovery found its replay port, say) is
/// the same server: its requests in flight still count, against its limit too; at another
/// address it is another server.
#[tokio::test]
async fn a_replica_replaced_at_its_address_keeps_its_requests_in_flight() {
    let fleet =
        Fleet::with(1, slow_agent, |c| kvroute_router::Config { max_in_flight_per_replica: 1, ..c }).await;
    let open = open_stream(&fleet).await;
    let router_fleet = fleet.router.fleet().clone();
    let in_flight = || router_fleet.member("agent-0").unwrap().upstream.requests_in_flight();
    assert_eq!(in_flight(), 1);
    let mut changed = router_fleet.member("agent-0").unwrap().replica.spec.clone();
    changed.topic = "changed".into();
    router_fleet.upsert(changed.clone()).await.unwrap();
    assert_eq!(router_fleet.member("agent-0").unwrap().replica.spec.topic, "changed", "replaced");
    assert_eq!(in_flight(), 1, "the same server's request in flight");
    let mut moved = changed;
    moved.http_url = "http://127.0.0.1:9".into();
    router_fleet.upsert(moved).await.unwrap();
    assert_eq!(in_flight(), 0, "another server");
    assert!(read_to_end(open).await.contains("[DONE]"));
}

/// A request refused for what its head says (a passed-through body past the limit, a
/// WebSocket handshake with a body) is refused at once, not after waiting for room it would
/// not use (taking it when it freed, it left the next request in line asleep).
#[tokio::test]
async fn a_request_its_head_refuses_does_not_wait_for_room() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fleet = Fleet::with(1, slow_agent, |c| kvroute_router::Config {
        max_in_flight_per_replica: 1,
        queue_timeout_ms: LONG,
        max_body_bytes: 1024,
        ..c
    })
    .await;
    let open = open_stream(&fleet).await;
    let heads = [
        (
            "POST /v1/embeddings HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\ncontent-length: 1025\r\n\r\n",
            "413",
        ),
        (
            "GET /v1/realtime HTTP/1.1\r\nhost: r\r\nconnection: upgrade\r\nupgrade: websocket\r\n\
             sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\ncontent-length: 2\r\n\r\n{}",
            "400",
        ),
    ];
    for (head, status) in heads {
        let mut client = tokio::net::TcpStream::connect(fleet.router.addr).await.unwrap();
        client.write_all(head.as_bytes()).await.unwrap();
        let mut answer = [0u8; 12];
        tokio::time::timeout(WAIT, client.read_exact(&mut answer)).await.expect("in time").unwrap();
        assert_eq!(&answer[9..], status.as_bytes(), "{head}");
        assert_eq!(outcomes(&fleet, "placed") + outcomes(&fleet, "left"), 0, "{head}: it did not wait");
    }
    assert!(read_to_end(open).await.contains("[DONE]"));
}

/// A decision counts its request on the replica it chose, in one step with the check that the
/// replica has room: with one place on each of two replicas, two decisions held take both
/// and a third finds the fleet saturated, and 32 decisions at once on two threads take two
/// places in all, one on each. (Counted only when a request was sent, the load of requests
/// just decided was seen by none, and they all went, past the limit.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_take_their_replicas_room_as_they_decide() {
    use kvroute_proto::openai::Endpoint;
    let fleet =
        Fleet::with(2, agent_config, |c| kvroute_router::Config { max_in_flight_per_replica: 1, ..c }).await;
    let state = fleet.router.state.clone();
    let decide = |i: usize| {
        let (state, body) =
            (state.clone(), serde_json::to_vec(&completion(&format!("decided {i} apart"))).unwrap());
        async move { state.decider.decide(Endpoint::Completions, &body).await }
    };
    let in_flight = || -> Vec<u32> {
        fleet.router.fleet().members().iter().map(|m| m.upstream.requests_in_flight()).collect()
    };

    let (first, second) = (decide(0).await.unwrap(), decide(1).await.unwrap());
    let chosen = |plan: &kvroute_router::proxy::route::Plan| plan.chosen().unwrap().member.replica.id;
    assert_ne!(chosen(&first), chosen(&second), "the second saw the first's place taken");
    assert_eq!(in_flight(), [1, 1]);
    match decide(2).await {
        Err(kvroute_router::proxy::error::ProxyError::Saturated { .. }) => {}
        other => panic!("a third decision past both replicas' room: {other:?}"),
    }
    drop((first, second));
    assert_eq!(in_flight(), [0, 0], "a plan dropped unsent gives its place back");

    let at_once = (0..32).map(|i| tokio::spawn(decide(i)));
    let plans: Vec<_> = futures::future::join_all(at_once).await.into_iter().map(Result::unwrap).collect();
    let taken: Vec<_> = plans.iter().filter_map(|plan| plan.as_ref().ok()).map(chosen).collect();
    assert_eq!(taken.len(), 2, "two places in all: {taken:?}");
    assert_eq!(in_flight(), [1, 1]);
}
