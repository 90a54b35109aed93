//! Data-parallel ranks (`--data-parallel-size`): each rank its own prefix cache and event
//! stream on port + rank, the `X-data-parallel-rank` header, vLLM's balancer without it, and
//! per-engine metrics; over real HTTP and ZMQ sockets.

use http_body_util::BodyExt;
use hyper::{Method, StatusCode};
use kvroute_proto::framing;
use serde_json::{Value, json};

use crate::events::{replay_all, stored};
use crate::support::client::collect;
use crate::support::{Agent, Client, Config, MODEL, config, shape};

const RANK: &str = "x-data-parallel-rank";

async fn agent(ranks: u32, time_scale: f64) -> Agent {
    Agent::with(Config { data_parallel_size: ranks, time_scale, ..config() }).await
}

/// A completion's usage, sent to `rank` if given.
async fn complete(client: &Client, prompt: &str, rank: Option<&str>) -> shape::Usage {
    let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 2 });
    let headers: Vec<(&str, &str)> = rank.map(|r| (RANK, r)).into_iter().collect();
    let reply = collect(client.send(Method::POST, "/v1/completions", body.to_string(), &headers).await).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    shape::completion(&reply.json(), 1).1
}

/// The value of `name` for `engine` on the metrics page.
fn sample(page: &str, name: &str, engine: u32) -> f64 {
    let series = format!("{name}{{model_name=\"{MODEL}\",engine=\"{engine}\"}} ");
    let line = page.lines().find_map(|line| line.strip_prefix(&series));
    line.unwrap_or_else(|| panic!("no {series:?} in\n{page}")).parse().expect("a number")
}

#[tokio::test]
async fn each_rank_has_its_own_cache_and_event_stream_and_the_header_picks_it() {
    let agent = agent(2, 1000.0).await;
    let c = &agent.client;
    let prompt = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi";

    assert_eq!(complete(c, prompt, Some("1")).await.cached_tokens, 0);
    let again = complete(c, prompt, Some("1")).await;
    assert!(again.cached_tokens > 0, "rank 1 cached the prompt: {again:?}");
    assert_eq!(complete(c, prompt, Some("0")).await.cached_tokens, 0, "rank 0 has a cache of its own");

    // Rank 1 publishes on the ports after rank 0's, its batches naming it.
    let replay0 = agent.replay_endpoint.clone().expect("replay is on");
    let replay1 = framing::rank_endpoint(&replay0, 1).unwrap();
    for (rank, endpoint) in [(0, &replay0), (1, &replay1)] {
        let batches = replay_all(endpoint).await;
        assert!(!stored(&batches).is_empty(), "rank {rank} stored the prompt once");
        assert!(batches.iter().all(|b| b.dp_rank == rank), "rank {rank}: {batches:?}");
    }
    assert_eq!(agent.ranks.count(), 2);
    let resident = |rank: usize| {
        agent.ranks.all()[rank].resident().into_iter().collect::<std::collections::HashSet<_>>()
    };
    assert_eq!(resident(0), resident(1), "the same prompt, once each");

    // Per-engine series, as vLLM labels them.
    let page = c.get("/metrics").await.text();
    assert_eq!(sample(&page, "vllm:prefix_cache_hits_total", 1), again.cached_tokens as f64);
    assert_eq!(sample(&page, "vllm:prefix_cache_hits_total", 0), 0.0);
    assert_eq!(sample(&page, "vllm:prompt_tokens_total", 1), 2.0 * again.prompt_tokens as f64);
    assert_eq!(sample(&page, "kvroute_agent_capacity_blocks", 1), agent.config.capacity_blocks as f64);
}

/// As vLLM reads the header: an integer that is no rank is refused, anything else ignored.
#[tokio::test]
async fn a_rank_out_of_range_is_refused_and_a_header_that_is_no_number_ignored() {
    let agent = agent(2, 1000.0).await;
    let send = async |rank: &str| {
        let body = json!({ "model": MODEL, "prompt": "hello there", "max_tokens": 1 }).to_string();
        collect(agent.client.send(Method::POST, "/v1/completions", body, &[(RANK, rank)]).await).await
    };
    for rank in ["2", "-1", "99999999999", "99999999999999999999999", "1_0", " +2 "] {
        let reply = send(rank).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{rank:?}: {}", reply.text());
        let error: Value = reply.json();
        assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
        assert!(error["error"]["message"].as_str().unwrap().contains("is out of range [0, 2)"), "{error}");
    }
    assert!(agent.ranks.all().iter().all(|e| e.resident().is_empty()), "nothing ran");
    for rank in ["one", "", "1__0", "_1", "1.0", "0x1"] {
        assert_eq!(send(rank).await.status, StatusCode::OK, "{rank:?} is no rank: the balancer picks");
    }
}

/// Without the header a request goes to the rank vLLM's balancer picks: the fewest
/// `waiting * 4 + running`.
#[tokio::test]
async fn without_the_header_a_request_goes_to_the_least_loaded_rank() {
    // Real time: a stream of 400 steps of at least 6 ms keeps rank 0 busy meanwhile.
    let agent = agent(2, 1.0).await;
    let c = &agent.client;
    let long = json!({ "model": MODEL, "prompt": "a long one", "max_tokens": 400, "stream": true });
    let response = c.send(Method::POST, "/v1/completions", long.to_string(), &[(RANK, "0")]).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    // Its first chunk: it runs on rank 0.
    while body.frame().await.expect("the stream is open").expect("a frame").into_data().is_err() {}

    let usage = complete(c, "where does this one go", None).await;
    assert!(!agent.ranks.all()[1].resident().is_empty(), "the idle rank took it");
    let page = c.get("/metrics").await.text();
    assert_eq!(sample(&page, "vllm:prompt_tokens_total", 1), usage.prompt_tokens as f64);
    assert_eq!(sample(&page, "vllm:num_requests_running", 0), 1.0, "the stream still runs");
}
