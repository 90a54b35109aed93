//! A bounded background load for the fault suite: `clients` concurrent clients, each
//! sending at most `requests` completions (every `stream_every`-th one streamed) until told
//! to stop, and recording what every single request ended as. Prompts share one of a few
//! seeded prefixes, so the replicas' caches and the router's index have work to agree on.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::fleet::FLEET_MODEL;
use crate::support::Rng;

/// Longest a request may take, headers to last byte, before it counts as hung.
const HANG: Duration = Duration::from_secs(20);

/// What one request ended as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// 200 with a complete answer (a stream ended with `data: [DONE]`).
    Ok { replica: String },
    /// The router or a replica answered an OpenAI-shaped error (`{"error": {"message", "type"}}`).
    Error { status: u16 },
    /// A stream that started with 200 ended with an OpenAI error event: the router's own
    /// (no `[DONE]` after it) or a replica's (vLLM sends `[DONE]` after it).
    StreamError,
}

/// One request: when it was sent, and how it ended.
#[derive(Clone, Debug)]
pub struct Record {
    pub sent: Instant,
    pub outcome: Outcome,
}

/// Shape of the load.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub clients: usize,
    /// Cap per client.
    pub requests: usize,
    pub prefixes: usize,
    /// Every n-th request of a client is streamed (0: none).
    pub stream_every: usize,
    pub max_tokens: u32,
    pub seed: u64,
}

impl Default for LoadSpec {
    fn default() -> Self {
        Self { clients: 4, requests: 60, prefixes: 5, stream_every: 3, max_tokens: 4, seed: 1 }
    }
}

/// The running load.
pub struct Load {
    stop: CancellationToken,
    done: Arc<AtomicUsize>,
    clients: Vec<JoinHandle<Vec<Record>>>,
}

impl Load {
    /// Starts the clients against `base` (the router's URL).
    pub fn start(base: &str, spec: LoadSpec) -> Load {
        let stop = CancellationToken::new();
        let done = Arc::new(AtomicUsize::new(0));
        let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let url = format!("{base}/v1/completions");
        let clients = (0..spec.clients)
            .map(|c| {
                let (stop, done, client, url, spec) =
                    (stop.clone(), done.clone(), client.clone(), url.clone(), spec.clone());
                tokio::spawn(async move {
                    let mut rng = Rng::new(spec.seed.wrapping_mul(1000).wrapping_add(c as u64));
                    let mut records = Vec::new();
                    for i in 0..spec.requests {
                        if stop.is_cancelled() {
                            break;
                        }
                        let prefix = rng.below(spec.prefixes.max(1) as u64);
                        let prompt = format!(
                            "{} {}",
                            words(&format!("pre{prefix}x"), 24),
                            words(&format!("c{c}r{i}y"), 6)
                        );
                        let streamed =
                            spec.stream_every > 0 && i % spec.stream_every == spec.stream_every - 1;
                        let sent = Instant::now();
                        let outcome = send(&client, &url, &prompt, spec.max_tokens, streamed).await;
                        records.push(Record { sent, outcome });
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    records
                })
            })
            .collect();
        Load { stop, done, clients }
    }

    /// Requests finished so far.
    pub fn done(&self) -> usize {
        self.done.load(Ordering::Relaxed)
    }

    /// Waits until `n` more requests have finished than now (bounded).
    pub async fn progress(&self, n: usize) {
        let target = self.done() + n;
        crate::support::wait_until(&format!("{n} more requests finish"), || {
            self.done() >= target || self.clients.iter().all(JoinHandle::is_finished)
        })
        .await;
    }

    /// Stops the clients after their current request and returns every record.
    pub async fn finish(self) -> Report {
        self.stop.cancel();
        self.join().await
    }

    /// Lets every client send all its requests and returns every record.
    pub async fn complete(self) -> Report {
        self.join().await
    }

    async fn join(self) -> Report {
        let mut records = Vec::new();
        for client in self.clients {
            records.extend(client.await.expect("a load client panicked"));
        }
        assert_eq!(records.len(), self.done.load(Ordering::Relaxed), "every request has an outcome");
        Report { records }
    }
}

/// Every request of a load.
#[derive(Debug)]
pub struct Report {
    pub records: Vec<Record>,
}

impl Report {
    pub fn ok(&self) -> usize {
        self.records.iter().filter(|r| matches!(r.outcome, Outcome::Ok { .. })).count()
    }

    /// Records that are not `Ok`.
    pub fn failures(&self) -> Vec<&Record> {
        self.records.iter().filter(|r| !matches!(r.outcome, Outcome::Ok { .. })).collect()
    }

    /// Requests sent at or after `t`.
    pub fn sent_after(&self, t: Instant) -> impl Iterator<Item = &Record> {
        self.records.iter().filter(move |r| r.sent >= t)
    }
}

/// `n` distinct words starting with `tag`.
pub fn words(tag: &str, n: usize) -> String {
    (0..n).map(|i| format!("{tag}{i}")).collect::<Vec<_>>().join(" ")
}

/// A completion request body.
pub fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    let mut body = json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": max_tokens});
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    prompt: &str,
    max_tokens: u32,
    stream: bool,
) -> Outcome {
    let body = completion(prompt, max_tokens, stream).to_string();
    let request = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("valid request");
    let exchange = async {
        let response = client.request(request).await.map_err(|e| format!("no response: {e}"))?;
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.map_err(|e| format!("body broke: {e}"))?.to_bytes();
        Ok::<_, String>((parts, bytes))
    };
    let (parts, bytes) = match tokio::time::timeout(HANG, exchange).await {
        Ok(Ok(reply)) => reply,
        Ok(Err(e)) => panic!("request neither succeeded nor got an OpenAI error: {e}"),
        Err(_) => panic!("request hung for {HANG:?}"),
    };
    let text = String::from_utf8_lossy(&bytes);
    if parts.status != StatusCode::OK {
        assert_openai_error(&bytes);
        return Outcome::Error { status: parts.status.as_u16() };
    }
    let replica =
        parts.headers.get("x-kvroute-replica").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    if !stream {
        let json: Value =
            serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("200 but not JSON ({e}): {text}"));
        assert!(json["choices"].is_array(), "200 without choices: {text}");
        return Outcome::Ok { replica };
    }
    let events: Vec<&str> = text.split("\n\n").map(str::trim).filter(|e| !e.is_empty()).collect();
    let error = events.iter().position(|e| e.starts_with("data: {\"error\""));
    match (error, events.last()) {
        (Some(at), _) => {
            assert!(events.len() - at <= 2, "an error event ends the stream: {text}");
            assert!(at + 1 == events.len() || events[at + 1] == "data: [DONE]", "{text}");
            assert_openai_error(events[at].trim_start_matches("data: ").as_bytes());
            Outcome::StreamError
        }
        (None, Some(&"data: [DONE]")) => Outcome::Ok { replica },
        _ => panic!("stream ended with neither [DONE] nor an error event: {text}"),
    }
}

/// Panics unless `body` is `{"error": {"message": string, "type": string, ...}}`.
pub fn assert_openai_error(body: &[u8]) {
    let text = String::from_utf8_lossy(body);
    let json: Value =
        serde_json::from_slice(body).unwrap_or_else(|e| panic!("error is not JSON ({e}): {text}"));
    let error = &json["error"];
    assert!(error["message"].is_string() && error["type"].is_string(), "not an OpenAI error: {text}");
}
