//! The live client in front of a fleet that splits prefill from decode: a request's realized
//! hit is the prefill replica's (`x-kvroute-prefill-cached-tokens`), not the decode replica's
//! usage, which counts every pulled token as cached.

use std::time::Duration;

use bytes::Bytes;
use kvroute_loadgen::compare;
use kvroute_loadgen::demo::{DEMO_MODEL, replica_config};
use kvroute_loadgen::live::Client;
use kvroute_loadgen::live::client::Body;
use kvroute_replica_agent::kv_transfer::{KvRole, KvTransferConfig, NIXL};
use kvroute_router::config::Config as RouterConfig;
use kvroute_router::policy::PolicyKind;
use kvroute_router::replicas::Role;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(30);
const BLOCK: u32 = 16;

fn completion(prompt: &[u32], stream: bool) -> Body {
    let body = serde_json::json!({
        "model": DEMO_MODEL, "prompt": prompt, "max_tokens": 2,
        "stream": stream, "stream_options": stream.then(|| serde_json::json!({"include_usage": true})),
    });
    Body { path: "/v1/completions", bytes: Bytes::from(body.to_string()) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_requests_hit_is_the_prefill_replicas() {
    let shutdown = CancellationToken::new();
    let (mut agents, mut replicas) = (Vec::new(), Vec::new());
    for (i, (kv_role, role)) in
        [(KvRole::KvProducer, Role::Prefill), (KvRole::KvConsumer, Role::Decode)].into_iter().enumerate()
    {
        let config = kvroute_replica_agent::Config {
            model: DEMO_MODEL.into(),
            block_size: BLOCK,
            time_scale: 1000.0,
            kv_transfer_config: Some(KvTransferConfig {
                kv_connector: NIXL.into(),
                kv_role,
                engine_id: None,
            }),
            ..kvroute_replica_agent::Config::loopback(format!("agent-{i}"))
        };
        let agent = kvroute_replica_agent::start(config, shutdown.child_token()).await.unwrap();
        replicas.push(replica_config(&agent, true, role));
        agents.push(agent);
    }
    let config = RouterConfig {
        model: DEMO_MODEL.into(),
        block_size: BLOCK,
        pd_min_prefill_tokens: 16,
        ..RouterConfig::loopback(replicas)
    };
    let router =
        compare::start_router(&config, PolicyKind::CacheAware, shutdown.child_token()).await.unwrap();
    let client = Client::new(LIMIT);
    let doc: Vec<u32> = (1000..1160).collect();
    let first = client.complete(&router.url(), completion(&doc, false), false, 160, LIMIT).await.unwrap();
    assert_eq!(first.replica.as_deref(), Some("agent-1"), "decoded on the decode replica");
    assert_eq!((first.prompt_tokens, first.cached_tokens), (160, Some(0)), "the decode replica says 159");
    // Other questions on the document: prefilled where it is cached.
    for (question, stream) in [(2000, false), (3000, true)] {
        let next: Vec<u32> = doc.iter().copied().chain(question..question + 40).collect();
        let again =
            client.complete(&router.url(), completion(&next, stream), stream, 200, LIMIT).await.unwrap();
        assert_eq!((again.prompt_tokens, again.cached_tokens), (200, Some(160)), "stream: {stream}");
        assert_eq!(again.predicted_cached_tokens, Some(160));
    }
    shutdown.cancel();
    for agent in agents {
        agent.stop().await;
    }
}

/// A split request whose prefill replica's hit is not known (the router names the replica
/// but sends no `x-kvroute-prefill-cached-tokens`) counts in no hit rate: it was taken for a
/// miss once another response had said its cached tokens.
#[tokio::test]
async fn an_unknown_prefill_hit_is_no_miss() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") || !request.ends_with(b"}") {
            let n = stream.read(&mut buf).await.unwrap();
            request.extend_from_slice(&buf[..n]);
        }
        let body = r#"{"choices":[{"text":"ab"}],"usage":{"prompt_tokens":160,"completion_tokens":2}}"#;
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-kvroute-replica: d\r\n\
             x-kvroute-prefill-replica: p\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(answer.as_bytes()).await.unwrap();
    });
    let doc: Vec<u32> = (1000..1160).collect();
    let answer = Client::new(LIMIT).complete(&url, completion(&doc, false), false, 160, LIMIT).await.unwrap();
    assert_eq!((answer.prompt_tokens, answer.cached_tokens), (160, None));
    assert_eq!(answer.cached_tokens_given(true), None, "not a miss where hits are reported");
}
