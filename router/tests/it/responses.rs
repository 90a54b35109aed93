//! OpenAI's Responses API (`/v1/responses`) through the router, in front of real replica
//! agents that keep their responses (`--responses-store`, as vLLM with
//! `VLLM_ENABLE_RESPONSES_API_STORE=1`): new conversations are routed on their prompt; a
//! response is continued, fetched and cancelled on the replica that stored it, by this router
//! or by one that never saw it made.

use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::fleet::{FLEET_MODEL, Fleet, Reply, agent_config, replica_config, router_config};

/// A text of `words` distinct words starting with `tag`.
fn text(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{i}")).collect::<Vec<_>>().join(" ")
}

fn storing(name: &str) -> kvroute_replica_agent::Config {
    kvroute_replica_agent::Config { responses_store: true, ..agent_config(name) }
}

fn cached(reply: &Reply) -> u64 {
    reply.json()["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage.input_tokens_details")
}

fn predicted(reply: &Reply) -> u64 {
    reply.header("x-kvroute-predicted-cached-tokens").expect("the prediction header").parse().unwrap()
}

/// `kvroute_router_response_lookups_total{outcome}` of the router at `base`.
async fn lookups(fleet: &Fleet, base: &str, outcome: &str) -> u64 {
    let metrics = fleet.http.get(&format!("{base}/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let line = format!("kvroute_router_response_lookups_total{{outcome=\"{outcome}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&line)?.trim().parse().ok()).unwrap_or(0)
}

fn replica(reply: &Reply) -> String {
    reply.header("x-kvroute-replica").expect("the replica header").to_owned()
}

/// A new conversation is routed on its prompt: its next turn, sent whole (no stored
/// response), lands where the first was cached and hits as predicted; conversations spread.
#[tokio::test]
async fn a_conversation_sent_whole_follows_its_prefix() {
    let fleet = Fleet::with(3, storing, |c| c).await;
    let url = fleet.url("/v1/responses");
    let mut homes = Vec::new();
    for c in 0..6 {
        let instructions = text(&format!("rules{c}w"), 40);
        let first = json!({"model": FLEET_MODEL, "instructions": instructions, "input": "hello",
            "max_output_tokens": 2, "store": false});
        let first = fleet.http.post(&url, &first).await;
        assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
        assert_eq!(first.json()["object"], "response");
        let answer = first.json()["output"][0]["content"][0]["text"].as_str().unwrap().to_owned();
        let next = json!({"model": FLEET_MODEL, "instructions": instructions, "max_output_tokens": 2,
            "store": false, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
                {"type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": answer, "annotations": []}]},
                {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{\"path\":\"/\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": text("file", 10)},
                {"role": "user", "content": "which is largest?"}]});
        let next = fleet.http.post(&url, &next).await;
        assert_eq!(next.status, 200, "{}", String::from_utf8_lossy(&next.body));
        assert_eq!(replica(&next), replica(&first), "conversation {c} follows its prefix");
        assert!(predicted(&next) > 40, "the instructions at least: {}", predicted(&next));
        assert_eq!(cached(&next), predicted(&next), "the prediction is the replica's hit");
        homes.push(replica(&first));
    }
    homes.sort();
    homes.dedup();
    assert!(homes.len() > 1, "new conversations spread over the fleet: {homes:?}");
    assert!(fleet.router.state.forward.owners.is_empty(), "responses not to be kept are not remembered");
}

/// A stored response is continued, fetched and cancelled on the replica that made it, which
/// alone has it; a router that did not see it made finds it by asking the replicas.
/// Regression: a response whose known owner was out of the fleet a while (discovery dropped
/// it, an upsert under way) got a definite 404 from the other replicas' answers, though its
/// owner may still have it: a 503, and served again once the owner is back.
#[tokio::test]
async fn a_response_whose_owner_is_out_of_the_fleet_is_unavailable_not_missing() {
    let fleet = Fleet::with(2, storing, |c| c).await;
    let url = fleet.url("/v1/responses");
    let body = json!({"model": FLEET_MODEL, "input": text("owner", 20), "max_output_tokens": 2});
    let made = fleet.http.post(&url, &body).await;
    assert_eq!(made.status, 200, "{}", String::from_utf8_lossy(&made.body));
    let (id, home) = (made.json()["id"].as_str().unwrap().to_owned(), replica(&made));
    let router_fleet = fleet.router.fleet().clone();
    let spec = router_fleet.member(&home).unwrap().replica.spec.clone();
    router_fleet.remove(&home).await.unwrap();
    let gone = fleet.http.get(&format!("{url}/{id}")).await;
    assert_eq!(gone.status, 503, "{}", String::from_utf8_lossy(&gone.body));
    router_fleet.add(spec).unwrap();
    let back = fleet.http.get(&format!("{url}/{id}")).await;
    assert_eq!((back.status.as_u16(), replica(&back)), (200, home));
}

#[tokio::test]
async fn a_stored_response_is_continued_where_it_was_made() {
    let fleet = Fleet::with(3, storing, |c| c).await;
    let url = fleet.url("/v1/responses");
    let mut made = Vec::new();
    for c in 0..4 {
        let body = json!({"model": FLEET_MODEL, "instructions": text(&format!("sys{c}w"), 30),
            "input": "start", "max_output_tokens": 3});
        let first = fleet.http.post(&url, &body).await;
        assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
        made.push((first.json()["id"].as_str().unwrap().to_owned(), replica(&first)));
    }
    // Whatever the load, each continuation goes home, and is served from its cache there.
    // Instructions do not carry over: each turn sends them again, so its prompt starts as the
    // stored one did.
    for (c, (id, home)) in made.iter().enumerate() {
        let next = json!({"model": FLEET_MODEL, "previous_response_id": id, "input": "go on",
            "instructions": text(&format!("sys{c}w"), 30), "max_output_tokens": 2});
        let next = fleet.http.post(&url, &next).await;
        assert_eq!(next.status, 200, "{id}: {}", String::from_utf8_lossy(&next.body));
        assert_eq!(&replica(&next), home, "{id} continues where it was made");
        assert_eq!(next.json()["previous_response_id"], json!(id));
        assert!(cached(&next) > 0, "the conversation so far is cached there");
        let fetched = fleet.http.get(&format!("{url}/{id}")).await;
        assert_eq!((fetched.status.as_u16(), replica(&fetched)), (200, home.clone()));
        assert_eq!(fetched.json()["id"], json!(id));
        let cancel = fleet.http.send(http::Method::POST, &format!("{url}/{id}/cancel"), "").await;
        assert_eq!(cancel.status, 400, "the replica's own answer: {}", String::from_utf8_lossy(&cancel.body));
    }

    // A second router, which saw none of them made.
    let config = kvroute_router::Config {
        replicas: fleet.agents.iter().flatten().map(replica_config).collect(),
        ..router_config(&[])
    };
    let other = kvroute_router::start(config, fleet.shutdown.child_token()).await.unwrap();
    let other_url = format!("{}/v1/responses", other.url());
    for (id, home) in &made {
        let next = json!({"model": FLEET_MODEL, "previous_response_id": id, "input": "again",
            "max_output_tokens": 2});
        let next = fleet.http.post(&other_url, &next).await;
        assert_eq!(next.status, 200, "{id}: {}", String::from_utf8_lossy(&next.body));
        assert_eq!(&replica(&next), home, "the other router found {id} at home");
    }
    assert_eq!(lookups(&fleet, &other.url(), "found").await, 4, "each asked for once");
    assert_eq!(lookups(&fleet, &other.url(), "known").await, 0);
    assert_eq!(lookups(&fleet, &fleet.router.url(), "known").await, 12, "learned from the answers");

    let unknown = fleet
        .http
        .post(&url, &json!({"model": FLEET_MODEL, "previous_response_id": "resp_nobody", "input": "x"}))
        .await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.json()["error"]["param"], "response_id");
    assert!(unknown.json()["error"]["message"].as_str().unwrap().contains("resp_nobody"));
    let fetched = fleet.http.get(&format!("{url}/resp_nobody")).await;
    assert_eq!(fetched.status, 404);

    // A router that does not know where a response is, with that replica down: the replicas
    // that answered do not have it, and the one that did not answer may.
    let (id, home) = &made[0];
    let config = kvroute_router::Config {
        replicas: fleet.agents.iter().flatten().map(replica_config).collect(),
        ..router_config(&[])
    };
    let third = kvroute_router::start(config, fleet.shutdown.child_token()).await.unwrap();
    let at: usize = home.strip_prefix("agent-").unwrap().parse().unwrap();
    let mut fleet = fleet;
    fleet.kill(at).await;
    let next =
        json!({"model": FLEET_MODEL, "previous_response_id": id, "input": "x", "max_output_tokens": 2});
    let lost = fleet.http.post(&format!("{}/v1/responses", third.url()), &next).await;
    assert_eq!(lost.status, 503, "{}", String::from_utf8_lossy(&lost.body));
    assert_eq!(lookups(&fleet, &third.url(), "unanswered").await, 1);
    // Asked for once, then known to be missing for a while (unless the machine stalled past
    // that while between the two: then asked for twice).
    let missing = lookups(&fleet, &fleet.router.url(), "missing").await;
    let known_missing = lookups(&fleet, &fleet.router.url(), "known_missing").await;
    assert!(missing >= 1 && missing + known_missing == 2, "resp_nobody: {missing} + {known_missing}");
}

/// A response id asked of every replica (one this router does not know) that all refuse
/// alike for another reason than not having it (here, a wrong API key) gets their answer,
/// not a 503 to retry; an empty id names no response.
#[tokio::test]
async fn an_id_every_replica_refuses_alike_gets_their_answer() {
    let keyed =
        |name: &str| kvroute_replica_agent::Config { api_key: Some("sekret".into()), ..storing(name) };
    let fleet = Fleet::with(2, keyed, |c| c).await;
    let url = fleet.url("/v1/responses");
    let wrong = crate::fleet::Http::new().bearer("wrong");
    let refused = wrong.get(&format!("{url}/resp_somewhere")).await;
    assert_eq!(refused.status, 401, "{}", String::from_utf8_lossy(&refused.body));
    assert!(refused.json()["error"]["message"].as_str().unwrap().contains("401"));
    assert_eq!(lookups(&fleet, &fleet.router.url(), "refused").await, 1);
    let right = crate::fleet::Http::new().bearer("sekret");
    assert_eq!(right.get(&format!("{url}/resp_somewhere")).await.status, 404, "not there, with the key");
    let empty = json!({"model": FLEET_MODEL, "previous_response_id": "", "input": "x"});
    let empty = right.post(&url, &empty).await;
    assert_eq!(empty.status, 404, "{}", String::from_utf8_lossy(&empty.body));
    assert_eq!(empty.json()["error"]["param"], "response_id");
    // A trailing slash would be redirected by the replica to its own address: refused here.
    assert_eq!(right.get(&format!("{url}/resp_somewhere/")).await.status, 400);
}

/// Regression: a Responses request generated in the background (`background: true`) let go
/// of its places when its `queued` answer ended, though its replica generates on: a key under
/// `--max-in-flight-per-key` could start any number. Its key's place and its load on its
/// replica are held until the replica shows the response final (asked with the client's key,
/// which the replica requires): here, once it is cancelled through the router, which a
/// request about a stored response may be though the key's places are all taken.
#[tokio::test]
async fn a_background_response_holds_its_places_until_it_is_final() {
    let slow = |name: &str| kvroute_replica_agent::Config {
        time_scale: 1.0,
        api_key: Some("sk-a".into()),
        ..storing(name)
    };
    let fleet = Fleet::with(1, slow, |c| kvroute_router::Config {
        api_key: vec!["sk-a".into()],
        max_in_flight_per_key: 1,
        ..c
    })
    .await;
    let (url, a) = (fleet.url("/v1/responses"), crate::fleet::Http::new().bearer("sk-a"));
    let body = |tokens: u64| json!({"model": FLEET_MODEL, "input": text("later", 10), "max_output_tokens": tokens, "background": true});
    let started = a.post(&url, &body(400)).await;
    assert_eq!(started.status, 200, "{}", String::from_utf8_lossy(&started.body));
    assert_eq!(started.json()["status"], "queued");
    let id = started.json()["id"].as_str().unwrap().to_owned();
    let refused = a.post(&url, &body(2)).await;
    assert_eq!(refused.status, 429, "the key's place is held: {}", String::from_utf8_lossy(&refused.body));
    let held = async || fleet.metric("kvroute_router_background_responses").await == 1;
    crate::support::wait_until_async("held", held).await;
    let upstream = &fleet.router.fleet().members()[0].upstream;
    assert_eq!(upstream.requests_in_flight(), 1, "its load on its replica");

    let cancelled = a.post(&format!("{url}/{id}/cancel"), &json!({})).await;
    assert_eq!(cancelled.status, 200, "{}", String::from_utf8_lossy(&cancelled.body));
    assert_eq!(cancelled.json()["status"], "cancelled");
    crate::support::wait_until_async("the places are let go", async || {
        fleet.metric("kvroute_router_background_responses").await == 0
    })
    .await;
    assert_eq!(fleet.metric(&released("final")).await, 1, "seen final, with the client's key");
    assert_eq!(upstream.requests_in_flight(), 0);
    assert_eq!(a.post(&url, &body(2)).await.status, 200, "the key's place is back");
}

/// `POST /v1/responses` with `body`, on a raw connection of its own (returned, for the test to
/// close when its client is to leave).
async fn posted_raw(fleet: &Fleet, body: &Value) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = body.to_string();
    let addr = fleet.router.url().trim_start_matches("http://").to_owned();
    let mut client = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /v1/responses HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    client.write_all(format!("{head}{body}").as_bytes()).await.unwrap();
    client
}

/// `kvroute_router_background_released_total{outcome}`'s series.
fn released(outcome: &str) -> String {
    format!("kvroute_router_background_released_total{{outcome=\"{outcome}\"}}")
}

/// A background response whose replica leaves the fleet is let go at the next ask (`gone`):
/// its replica's load is no longer the router's to count.
#[tokio::test]
async fn a_background_response_whose_replica_leaves_is_let_go() {
    let slow = |name: &str| kvroute_replica_agent::Config { time_scale: 1.0, ..storing(name) };
    let fleet = Fleet::with(1, slow, |c| c).await;
    let body = json!({"model": FLEET_MODEL, "input": text("left", 10), "max_output_tokens": 400, "background": true});
    let started = fleet.http.post(&fleet.url("/v1/responses"), &body).await;
    assert_eq!(started.json()["status"], "queued", "{}", String::from_utf8_lossy(&started.body));
    let held = async || fleet.metric("kvroute_router_background_responses").await == 1;
    crate::support::wait_until_async("held", held).await;
    fleet.router.fleet().remove("agent-0").await;
    crate::support::wait_until_async("let go", async || fleet.metric(&released("gone")).await == 1).await;
    assert_eq!(fleet.metric("kvroute_router_background_responses").await, 0);
}

/// Regression: a client that sends a background request and closes its connection at once
/// took the request's forward with it before the answer showed the response's id, and the
/// replica generated on holding none of the router's places. It is sent apart from its
/// client: the places are held by the id, then let go when the response is final.
#[tokio::test]
async fn a_background_request_whose_client_leaves_at_once_is_held_all_the_same() {
    let slow = |name: &str| kvroute_replica_agent::Config { time_scale: 20.0, ..storing(name) };
    let fleet = Fleet::with(1, slow, |c| c).await;
    let body =
        json!({"model": FLEET_MODEL, "input": text("gone", 10), "max_output_tokens": 40, "background": true});
    let client = posted_raw(&fleet, &body).await;
    drop(client);
    crate::support::wait_until_async("the response is held, then let go once final", async || {
        fleet.metric(&released("final")).await == 1
    })
    .await;
    assert_eq!(fleet.metric(&released("unlearned")).await, 0);
    assert_eq!(fleet.router.fleet().members()[0].upstream.requests_in_flight(), 0);
}

/// A background request whose client leaves while it waits for room is given up as any other
/// is: it leaves the line, and is not sent to generate for nobody while holding its key's
/// places. (Decided apart from its client, it waited on, and was sent once room came.)
#[tokio::test]
async fn a_background_request_whose_client_leaves_while_it_waits_leaves_the_line() {
    let slow = |name: &str| kvroute_replica_agent::Config { time_scale: 1.0, ..storing(name) };
    let fleet = Fleet::with(1, slow, |c| kvroute_router::Config {
        max_in_flight_per_replica: 1,
        queue_timeout_ms: 600_000,
        ..c
    })
    .await;
    // A stream holds the replica's one room.
    let long = json!({"model": FLEET_MODEL, "prompt": "hold it", "max_tokens": 400, "stream": true});
    let mut open = fleet.http.stream_with(&fleet.url("/v1/completions"), &long, &[]).await;
    crate::fleet::first_data(open.body_mut()).await;
    let body =
        json!({"model": FLEET_MODEL, "input": text("wait", 10), "max_output_tokens": 4, "background": true});
    let client = posted_raw(&fleet, &body).await;
    crate::support::wait_until_async("it waits for room", async || {
        fleet.metric("kvroute_router_queued").await == 1
    })
    .await;
    drop(client);
    let left = "kvroute_router_queue_outcomes_total{outcome=\"left\"}";
    crate::support::wait_until_async("it leaves the line", async || fleet.metric(left).await == 1).await;
    assert_eq!(fleet.metric("kvroute_router_queued").await, 0);
    assert_eq!(fleet.metric("kvroute_router_in_flight").await, 1, "the stream's place alone");
}

/// A continuation is held to the router's bounds before any replica is asked, and what it
/// adds to the stored conversation weighs on its owner, less the instructions the owner holds.
#[tokio::test]
async fn a_continuation_is_bounded_and_weighs_on_its_owner() {
    let fleet = Fleet::with(2, storing, |c| kvroute_router::Config { max_completion_tokens: 8, ..c }).await;
    let url = fleet.url("/v1/responses");
    let instructions = text("law", 40);
    let first =
        json!({"model": FLEET_MODEL, "instructions": instructions, "input": "start", "max_output_tokens": 3});
    let first = fleet.http.post(&url, &first).await;
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
    let (id, home) = (first.json()["id"].as_str().unwrap().to_owned(), replica(&first));
    let at: usize = home.strip_prefix("agent-").unwrap().parse().unwrap();
    fleet.index_matches(at).await;

    let next = |max: u64| {
        json!({"model": FLEET_MODEL, "previous_response_id": id, "instructions": instructions,
            "input": text("new", 12), "max_output_tokens": max})
    };
    let over = fleet.http.post(&url, &next(9)).await;
    assert_eq!(over.status, 400, "{}", String::from_utf8_lossy(&over.body));
    assert_eq!(over.json()["error"]["param"], "max_output_tokens");
    assert_eq!(lookups(&fleet, &fleet.router.url(), "known").await, 0, "refused before its owner was sought");

    let state = &fleet.router.state;
    let body = serde_json::to_vec(&next(8)).unwrap();
    let continuation = kvroute_router::proxy::responses::Continuation::read(
        &state.decider,
        &body,
        &state.admission.get().limits,
    )
    .await
    .unwrap();
    assert_eq!(continuation.id, id);
    let member = |name: &str| state.fleet().member(name).unwrap();
    let (prompt, prefill) = continuation.load_on(&member(&home));
    assert!(prompt > 40, "the instructions and the new input: {prompt}");
    assert!(prefill < prompt - 30, "the instructions are cached at home: {prefill} of {prompt}");
    assert!(prefill >= 12, "the new input is not: {prefill}");
    let elsewhere = format!("agent-{}", 1 - at);
    assert_eq!(continuation.load_on(&member(&elsewhere)), (prompt, prompt), "nothing of it is elsewhere");

    // A new turn that cannot be rendered alone (here: none at all) is no reason to refuse the
    // request: its owner renders it after the conversation. Its bound still holds.
    let mut nothing = next(9);
    nothing["input"] = json!([]);
    let over = fleet.http.post(&url, &nothing).await;
    assert_eq!(over.status, 400, "{}", String::from_utf8_lossy(&over.body));
    nothing["max_output_tokens"] = json!(2);
    let empty = fleet.http.post(&url, &nothing).await;
    assert_eq!(
        (empty.status.as_u16(), replica(&empty)),
        (200, home.clone()),
        "{}",
        String::from_utf8_lossy(&empty.body)
    );

    let ok = fleet.http.post(&url, &next(8)).await;
    assert_eq!((ok.status.as_u16(), replica(&ok)), (200, home));
    assert!(cached(&ok) > prompt - prefill, "the conversation so far was cached too");
}

/// A streamed response's id is learned from its first event: the continuation goes home.
#[tokio::test]
async fn a_streamed_response_is_learned_from_its_first_event() {
    let fleet = Fleet::with(3, storing, |c| c).await;
    let url = fleet.url("/v1/responses");
    for c in 0..3 {
        let body = json!({"model": FLEET_MODEL, "instructions": text(&format!("s{c}w"), 20), "input": "hi",
            "max_output_tokens": 3, "stream": true});
        let response = fleet.http.stream(&url, &body).await;
        assert_eq!(response.status(), 200);
        let home = response.headers()["x-kvroute-replica"].to_str().unwrap().to_owned();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let events = String::from_utf8_lossy(&bytes).into_owned();
        let first = events.lines().find_map(|l| l.strip_prefix("data: ")).expect("an event");
        let created: Value = serde_json::from_str(first).unwrap();
        assert_eq!(created["type"], "response.created");
        let last = events.lines().rev().find_map(|l| l.strip_prefix("data: ")).unwrap();
        let whole: Value = serde_json::from_str(last).unwrap();
        assert_eq!(whole["type"], "response.incomplete");
        let id = created["response"]["id"].as_str().unwrap();
        assert_eq!(whole["response"]["id"], json!(id));
        let next = json!({"model": FLEET_MODEL, "previous_response_id": id, "input": "more", "max_output_tokens": 2});
        let next = fleet.http.post(&url, &next).await;
        assert_eq!(next.status, 200, "{}", String::from_utf8_lossy(&next.body));
        assert_eq!(replica(&next), home);
    }
    assert!(fleet.router.state.forward.owners.len() >= 6, "every response's replica is known");
    let base = fleet.router.url();
    let (known, found) = (lookups(&fleet, &base, "known").await, lookups(&fleet, &base, "found").await);
    assert_eq!((known, found), (3, 0), "learned from the streams, not found by asking");
}

/// Malformed Responses bodies get OpenAI-shaped 400s from the router, naming the field.
#[tokio::test]
async fn malformed_responses_requests_are_refused_with_the_field() {
    let fleet = Fleet::with(1, storing, |c| c).await;
    let url = fleet.url("/v1/responses");
    for (body, param) in [
        (json!({"model": FLEET_MODEL}), "input"),
        (json!({"model": FLEET_MODEL, "input": [{"type": "item_reference", "id": "x"}]}), "input[0].type"),
        (json!({"model": FLEET_MODEL, "input": "x", "tools": [{"type": "function"}]}), "tools[0].name"),
    ] {
        let reply = fleet.http.post(&url, &body).await;
        assert_eq!(reply.status, 400, "{body}");
        assert_eq!(reply.json()["error"]["param"], param, "{body}");
    }
    let reply = fleet.http.send(http::Method::POST, &url, "{\"input\": ").await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.json()["error"]["type"], "invalid_request_error");
}

/// A lookup of an id that waited for another lookup of it, whose client left before the
/// replicas answered, asks the replicas itself: it finds the response, not a 503 saying it
/// was just sought.
#[tokio::test]
async fn a_lookup_whose_forerunner_left_asks_the_replicas_itself() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    // A replica that answers a lookup (404) only once released; anything else at once.
    let held = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let held_at = held.local_addr().unwrap();
    let (release, asked) =
        (tokio_util::sync::CancellationToken::new(), tokio::sync::mpsc::unbounded_channel());
    let (released, asked_tx) = (release.clone(), asked.0);
    tokio::spawn(async move {
        while let Ok((stream, _)) = held.accept().await {
            let (released, asked) = (released.clone(), asked_tx.clone());
            tokio::spawn(async move {
                let mut stream = tokio::io::BufReader::new(stream);
                loop {
                    let mut head = String::new();
                    while !head.ends_with("\r\n\r\n") {
                        if stream.read_line(&mut head).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                    let answer: &[u8] = if head.starts_with("GET /v1/responses/") {
                        asked.send(()).ok();
                        released.cancelled().await;
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}"
                    } else {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
                    };
                    if stream.get_mut().write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let mut asked = asked.1;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(1, storing, &shutdown).await;
    let config = crate::fleet::router_config_and_streamless(&agents, "held", held_at);
    let fleet = Fleet::around(agents, config, shutdown).await;
    // Made on the agent without the router, which does not know where it is.
    let first = json!({"model": FLEET_MODEL, "input": "start", "max_output_tokens": 2});
    let made = fleet.http.post(&format!("{}/v1/responses", fleet.agent(0).http_url()), &first).await;
    assert_eq!(made.status, 200, "{}", String::from_utf8_lossy(&made.body));
    let id = made.json()["id"].as_str().unwrap().to_owned();
    let next =
        json!({"model": FLEET_MODEL, "previous_response_id": id, "input": "go on", "max_output_tokens": 2});
    // The first lookup asks every replica, and waits for the held one...
    let body = next.to_string();
    let mut leaving = tokio::net::TcpStream::connect(fleet.router.addr).await.unwrap();
    let head = format!(
        "POST /v1/responses HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    leaving.write_all(head.as_bytes()).await.unwrap();
    tokio::time::timeout(crate::support::WAIT, asked.recv()).await.expect("asked in time").unwrap();
    // ...while a second waits for it; then the first one's client leaves.
    let (http, url) = (fleet.http.clone(), fleet.url("/v1/responses"));
    let waiting = tokio::spawn(async move { http.post(&url, &next).await });
    crate::support::wait_until_async("the second lookup waits", async || {
        lookups(&fleet, &fleet.router.url(), "waited").await == 1
    })
    .await;
    drop(leaving);
    crate::support::wait_until_async("the first client left", async || {
        let metrics = fleet.http.get(&format!("{}/metrics", fleet.router.url())).await;
        let metrics = String::from_utf8_lossy(&metrics.body).into_owned();
        crate::support::sample(&metrics, "kvroute_router_requests_total{code=\"499\"}") == Some(1)
    })
    .await;
    release.cancel();
    let answer = tokio::time::timeout(crate::support::WAIT, waiting).await.expect("in time").unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    assert_eq!(replica(&answer), "agent-0");
    assert_eq!(lookups(&fleet, &fleet.router.url(), "found").await, 1);
}
