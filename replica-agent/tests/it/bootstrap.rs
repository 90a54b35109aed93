//! Disaggregated prefill between two real agents as SGLang plays it: both are sent the
//! request at once, naming the prefill replica's bootstrap server and one room.

use hyper::StatusCode;
use serde_json::{Value, json};

use crate::http_api::{metrics, words};
use crate::support::shape::{self, Usage};
use crate::support::{Agent, MODEL, config};
use kvroute_replica_agent::bootstrap::Mode;

async fn with_mode(mode: Mode) -> Agent {
    let timeout = 30_000;
    Agent::with(kvroute_replica_agent::config::Config {
        disaggregation_mode: mode,
        disaggregation_timeout_ms: timeout,
        ..config()
    })
    .await
}

fn usage(answer: &Value) -> Usage {
    shape::completion(answer, 1).1
}

#[tokio::test]
async fn the_decode_takes_the_prompt_its_prefill_hands_over() {
    let (prefill, decode) = (with_mode(Mode::Prefill).await, with_mode(Mode::Decode).await);
    let block_size = u64::from(prefill.config.block_size);
    let port = prefill.bootstrap_addr.expect("a prefill agent serves its bootstrap port").port();
    let prompt = words(37, 31);
    let len = prefill.client.tokenize(&json!({ "prompt": prompt })).await.len() as u64;
    let room = |room: u64| {
        json!({
            "model": MODEL, "prompt": prompt, "max_tokens": 4,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room,
        })
    };

    // Sent to both at once: neither answers without the other.
    let body = room(42);
    let (p, d) = tokio::join!(
        prefill.client.post("/v1/completions", &body),
        decode.client.post("/v1/completions", &body)
    );
    assert_eq!((p.status, d.status), (StatusCode::OK, StatusCode::OK), "{} {}", p.text(), d.text());
    assert_eq!(usage(&p.json()), Usage { prompt_tokens: len, completion_tokens: 1, cached_tokens: 0 });
    assert_eq!(p.json()["choices"][0]["finish_reason"], "length");
    assert_eq!(usage(&d.json()), Usage { prompt_tokens: len, completion_tokens: 4, cached_tokens: 0 });
    let pulled = metrics(&decode.client).await["vllm:external_prefix_cache_hits_total"];
    assert_eq!(pulled, (len - 1) as f64, "all of the prompt but its last token");

    // Again, in another room: the prefill replica's hit is what the decode replica reports.
    let body = room(43);
    let (p, d) = tokio::join!(
        prefill.client.post("/v1/completions", &body),
        decode.client.post("/v1/completions", &body)
    );
    let hit = len / block_size * block_size;
    assert_eq!((usage(&p.json()).cached_tokens, usage(&d.json()).cached_tokens), (hit, hit));

    // A batch: a room a prompt (one given, r, names r and r + 1).
    let batch = json!({
        "model": MODEL, "prompt": [words(20, 32), words(20, 33)], "max_tokens": 3,
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 50,
    });
    let (p, d) = tokio::join!(
        prefill.client.post("/v1/completions", &batch),
        decode.client.post("/v1/completions", &batch)
    );
    assert_eq!((p.status, d.status), (StatusCode::OK, StatusCode::OK), "{} {}", p.text(), d.text());
    let completion_tokens = |answer: &Value| answer["usage"]["completion_tokens"].as_u64();
    assert_eq!((completion_tokens(&p.json()), completion_tokens(&d.json())), (Some(2), Some(6)));

    // Either side refuses a request without a room, as SGLang does.
    let plain = json!({ "model": MODEL, "prompt": prompt });
    for agent in [&prefill, &decode] {
        let reply = agent.client.post("/v1/completions", &plain).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
        assert!(
            reply.json()["error"]["message"].as_str().unwrap().contains("bootstrap room"),
            "{}",
            reply.text()
        );
    }
    // A decode replica that cannot reach its prefill replica's bootstrap server fails the
    // request, rather than decoding a prompt it does not have.
    let mut nowhere = room(44);
    nowhere["bootstrap_port"] = json!(1);
    let reply = decode.client.post("/v1/completions", &nowhere).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", reply.text());
}

/// A prefill replica whose request waits for its decode replica when it is stopped ends that
/// wait: the bootstrap server stops with it, so no decode replica can come for the room. The
/// stop used to wait out `--disaggregation-timeout-ms` (300 s by default).
#[tokio::test]
async fn a_stop_ends_the_wait_for_a_decode_replica() {
    let prefill = Agent::with(kvroute_replica_agent::config::Config {
        disaggregation_mode: Mode::Prefill,
        disaggregation_timeout_ms: 300_000,
        ..config()
    })
    .await;
    let port = prefill.bootstrap_addr.expect("a prefill agent serves its bootstrap port").port();
    let body = json!({
        "model": MODEL, "prompt": words(20, 34), "max_tokens": 4,
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 7,
    });
    let served = &prefill.engine.metrics().requests_served;
    let (reply, ()) = tokio::join!(prefill.client.post("/v1/completions", &body), async {
        // The prefill done, its request waits for the room's decode replica; then the stop.
        while served.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        // A hang detector, not a timing: the old wait was 300 s.
        tokio::time::timeout(std::time::Duration::from_secs(60), prefill.stop()).await.expect("stopped");
    });
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", reply.text());
    assert!(
        reply.text().contains("stopped before a decode replica came for bootstrap room 7"),
        "{}",
        reply.text()
    );
}
