//! The agent's HTTP request rate for tiny prompts: `max_tokens: 1`, a 10^6 time scale so the
//! simulated GPU is never the bottleneck, and 32 concurrent clients over keep-alive HTTP/1.1
//! connections, all in one process on one multi-threaded tokio runtime (client load shares
//! the CPU with the server, so the figure is a lower bound for the server alone).
//!
//! Criterion reports elements/s = requests/s. Each engine step still waits for tokio's 1 ms
//! timer tick, so requests are batched by the engine, as on a real replica under load.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_replica_agent::Config;
use tokio_util::sync::CancellationToken;

const CONCURRENCY: u64 = 32;

/// Starts a whole agent on loopback; returns the HTTP address.
async fn start_agent(shutdown: &CancellationToken) -> SocketAddr {
    let config = Config { time_scale: 1e6, replay_endpoint: String::new(), ..Config::loopback("bench") };
    let agent = kvroute_replica_agent::start(config, shutdown.clone()).await.expect("agent starts");
    agent.http_addr
}

/// Sends `total` requests from [`CONCURRENCY`] tasks and returns the elapsed time.
async fn run(client: &Client<HttpConnector, Full<Bytes>>, uri: &str, body: &Bytes, total: u64) -> Duration {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..CONCURRENCY {
        let share = total / CONCURRENCY + u64::from(worker < total % CONCURRENCY);
        let (client, uri, body) = (client.clone(), uri.to_owned(), body.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..share {
                let req = Request::post(&uri)
                    .header("content-type", "application/json")
                    .body(Full::new(body.clone()))
                    .expect("request");
                let response = client.request(req).await.expect("response");
                assert_eq!(response.status(), StatusCode::OK);
                response.into_body().collect().await.expect("body");
            }
        }));
    }
    for task in tasks {
        task.await.expect("client task");
    }
    start.elapsed()
}

fn http_requests(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let shutdown = CancellationToken::new();
    let addr = rt.block_on(start_agent(&shutdown));
    let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(64).build_http();
    let cases = [
        (
            "completions",
            "/v1/completions",
            r#"{"model":"kvroute-sim","prompt":"Hello there","max_tokens":1}"#,
        ),
        (
            "completions_stream",
            "/v1/completions",
            r#"{"model":"kvroute-sim","prompt":"Hello there","max_tokens":1,"stream":true,
                "stream_options":{"include_usage":true}}"#,
        ),
        (
            "chat",
            "/v1/chat/completions",
            r#"{"model":"kvroute-sim","messages":[{"role":"user","content":"Hello there"}],"max_tokens":1}"#,
        ),
    ];
    let mut group = c.benchmark_group("http_tiny_prompt");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    for (name, path, body) in cases {
        let uri = format!("http://{addr}{path}");
        let body = Bytes::from_static(body.as_bytes());
        group.bench_function(name, |b| {
            b.iter_custom(|iters| rt.block_on(run(&client, &uri, &body, iters)));
        });
    }
    group.finish();
    shutdown.cancel();
}

criterion_group!(benches, http_requests);
criterion_main!(benches);
