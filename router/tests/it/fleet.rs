//! A whole fleet on loopback: N real replica agents (engine, events, gRPC, HTTP) and a real
//! router in front of them, plus a small HTTP client.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_replica_agent::RunningAgent;
use kvroute_router::RunningRouter;
use kvroute_router::config::{Config as RouterConfig, ReplicaConfig};
use kvroute_router::replicas::EngineKind;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::support::wait_until;

pub const FLEET_MODEL: &str = "kvroute-sim";
pub const FLEET_BLOCK: u32 = 4;

/// An agent config for fast tests: 4-token blocks and a 1000x time scale.
pub fn agent_config(name: &str) -> kvroute_replica_agent::Config {
    kvroute_replica_agent::Config {
        model: FLEET_MODEL.into(),
        block_size: FLEET_BLOCK,
        capacity_blocks: 4096,
        time_scale: 1000.0,
        ..kvroute_replica_agent::Config::loopback(name)
    }
}

pub fn replica_config(agent: &RunningAgent) -> ReplicaConfig {
    ReplicaConfig {
        name: agent.name.clone(),
        http: agent.http_url(),
        events: agent.events_endpoint.clone(),
        replay: agent.replay_endpoint.clone(),
        grpc: Some(agent.grpc_url()),
        engine: EngineKind::Kvroute,
        dp_size: agent.ranks.count() as u32,
        topic: String::new(),
        role: kvroute_router::replicas::Role::Both,
        bootstrap_port: agent.bootstrap_addr.map(|addr| addr.port()),
    }
}

/// A router config in front of `agents`, with fast health checks.
pub fn router_config(agents: &[RunningAgent]) -> RouterConfig {
    RouterConfig {
        model: FLEET_MODEL.into(),
        block_size: FLEET_BLOCK,
        health_interval_ms: 100,
        ..RouterConfig::loopback(agents.iter().map(replica_config).collect())
    }
}

/// [`router_config`] with one more replica, `name` at `http`, that has no event stream: it is
/// FALLBACK soon, so that the router is ready.
pub fn router_config_and_streamless(
    agents: &[RunningAgent],
    name: &str,
    http: std::net::SocketAddr,
) -> RouterConfig {
    let mut config = router_config(agents);
    let events = crate::support::nowhere();
    config
        .replicas
        .push(format!("name={name},http=http://{http},events={events},engine=kvroute").parse().unwrap());
    RouterConfig { events_fallback_ms: 300, ..config }
}

/// Agents and a router; everything stops when dropped.
pub struct Fleet {
    pub agents: Vec<Option<RunningAgent>>,
    pub router: RunningRouter,
    pub http: Http,
    pub shutdown: CancellationToken,
}

impl Fleet {
    /// Starts `n` agents and a router, and waits until the router is ready.
    pub async fn start(n: usize) -> Fleet {
        Fleet::with(n, agent_config, |c| c).await
    }

    pub async fn with(
        n: usize,
        agent: impl Fn(&str) -> kvroute_replica_agent::Config,
        router: impl FnOnce(RouterConfig) -> RouterConfig,
    ) -> Fleet {
        let shutdown = CancellationToken::new();
        let agents = Fleet::start_agents(n, agent, &shutdown).await;
        let config = router(router_config(&agents));
        Fleet::around(agents, config, shutdown).await
    }

    /// Starts `n` agents named `agent-{i}`, stopped by `shutdown`.
    pub async fn start_agents(
        n: usize,
        agent: impl Fn(&str) -> kvroute_replica_agent::Config,
        shutdown: &CancellationToken,
    ) -> Vec<RunningAgent> {
        let mut agents = Vec::new();
        for i in 0..n {
            let config = agent(&format!("agent-{i}"));
            agents.push(
                kvroute_replica_agent::start(config, shutdown.child_token()).await.expect("agent starts"),
            );
        }
        agents
    }

    /// A router with `config` in front of `agents`, once it is ready (for tests that put
    /// something between the agents and the router).
    pub async fn around(
        agents: Vec<RunningAgent>,
        config: RouterConfig,
        shutdown: CancellationToken,
    ) -> Fleet {
        let router = kvroute_router::start(config, shutdown.child_token()).await.expect("router starts");
        let fleet = router.fleet().clone();
        wait_until("router ready", || fleet.ready()).await;
        Fleet { agents: agents.into_iter().map(Some).collect(), router, http: Http::new(), shutdown }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.router.url())
    }

    /// The router's `series` (a metric's name and labels, as the text format prints them), 0
    /// when it has none.
    pub async fn metric(&self, series: &str) -> u64 {
        let metrics = self.http.get(&self.url("/metrics")).await;
        crate::support::sample(&String::from_utf8_lossy(&metrics.body), series).unwrap_or(0)
    }

    pub fn agent(&self, i: usize) -> &RunningAgent {
        self.agents[i].as_ref().expect("agent is running")
    }

    /// Stops agent `i` (its sockets close; in-flight requests end).
    pub async fn kill(&mut self, i: usize) {
        if let Some(agent) = self.agents[i].take() {
            agent.stop().await;
        }
    }

    /// Stops agent `i` and starts a new one from `config` on the same ports (a restarted
    /// process: new epoch, seq 0, empty cache). Retries while the old ports linger.
    pub async fn restart(&mut self, i: usize, config: kvroute_replica_agent::Config) {
        let old = self.agents[i].take().expect("agent is running");
        let config = kvroute_replica_agent::Config {
            http_addr: old.http_addr,
            grpc_addr: old.grpc_addr,
            events_endpoint: old.events_endpoint.clone(),
            replay_endpoint: old.replay_endpoint.clone().unwrap_or_default(),
            ..config
        };
        old.stop().await;
        let deadline = tokio::time::Instant::now() + crate::support::WAIT;
        let agent = loop {
            match kvroute_replica_agent::start(config.clone(), self.shutdown.child_token()).await {
                Ok(agent) => break agent,
                Err(e) => {
                    assert!(tokio::time::Instant::now() < deadline, "agent {i} cannot restart: {e:#}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        self.agents[i] = Some(agent);
    }

    /// Puts `router` in front of the fleet; returns the previous one (still running).
    pub fn replace_router(&mut self, router: RunningRouter) -> RunningRouter {
        std::mem::replace(&mut self.router, router)
    }

    /// Waits until the router's index holds exactly agent `i`'s resident blocks.
    pub async fn index_matches(&self, i: usize) {
        index_matches(&self.router, self.agent(i)).await;
    }
}

/// Waits until `router`'s index holds exactly `agent`'s resident blocks (same count, and
/// every resident block present for that replica), which is what exact ingestion promises.
pub async fn index_matches(router: &RunningRouter, agent: &RunningAgent) {
    let id = router.fleet().member(&agent.name).expect("the router knows the agent").replica.id;
    let index = &router.state.decider.index;
    let deadline = tokio::time::Instant::now() + crate::support::WAIT;
    loop {
        let resident = agent.engine.resident();
        let held = index.blocks(id);
        let missing = resident.iter().filter(|b| index.lookup(&[**b]).get(id) != 1).count();
        if held == resident.len() && missing == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}: index holds {held} blocks, the replica {} ({missing} missing)",
            agent.name,
            resident.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A reply with its body collected.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// `usage.prompt_tokens_details.cached_tokens` of a non-streamed completion.
    pub fn cached_tokens(&self) -> u64 {
        self.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
    }
}

/// A small HTTP client.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    /// Sent as `Authorization: Bearer <key>` with every request.
    bearer: Option<String>,
}

impl Http {
    pub fn new() -> Self {
        Self { client: Client::builder(TokioExecutor::new()).build_http(), bearer: None }
    }

    /// The client, sending `Authorization: Bearer {key}` with every request.
    pub fn bearer(self, key: &str) -> Self {
        Self { bearer: Some(key.to_owned()), ..self }
    }

    pub async fn send(&self, method: http::Method, url: &str, body: impl Into<Bytes>) -> Reply {
        self.send_with(method, url, body, &[]).await
    }

    /// [`Http::send`] with `headers` too.
    pub async fn send_with(
        &self,
        method: http::Method,
        url: &str,
        body: impl Into<Bytes>,
        headers: &[(&str, &str)],
    ) -> Reply {
        let mut request =
            Request::builder().method(method).uri(url).header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(key) = &self.bearer {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let request = request.body(Full::new(body.into())).unwrap();
        let response = tokio::time::timeout(Duration::from_secs(30), self.client.request(request))
            .await
            .unwrap()
            .unwrap();
        let (parts, body) = response.into_parts();
        let body =
            tokio::time::timeout(Duration::from_secs(30), body.collect()).await.unwrap().unwrap().to_bytes();
        Reply { status: parts.status, headers: parts.headers, body }
    }

    pub async fn post(&self, url: &str, json: &Value) -> Reply {
        self.send(http::Method::POST, url, json.to_string()).await
    }

    pub async fn get(&self, url: &str) -> Reply {
        self.send(http::Method::GET, url, Bytes::new()).await
    }

    /// Sends a request and returns the response with its body still streaming.
    pub async fn stream(&self, url: &str, json: &Value) -> http::Response<hyper::body::Incoming> {
        self.stream_with(url, json, &[]).await
    }

    /// [`Self::stream`] with `headers`.
    pub async fn stream_with(
        &self,
        url: &str,
        json: &Value,
        headers: &[(&str, &str)],
    ) -> http::Response<hyper::body::Incoming> {
        let mut request = Request::post(url).header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        self.client.request(request.body(Full::new(Bytes::from(json.to_string()))).unwrap()).await.unwrap()
    }
}

/// The first frame of `body` with data in it.
pub async fn first_data(body: &mut hyper::body::Incoming) -> Bytes {
    loop {
        let frame = body.frame().await.expect("a frame").expect("no error");
        if let Ok(data) = frame.into_data()
            && !data.is_empty()
        {
            return data;
        }
    }
}

/// Sends `docs` documents of 40 words each, then a follow-up that extends each: every
/// follow-up must land on its document's replica, with a hit predicted, and reported, to the
/// token (nothing is evicted). Returns each document's replica, checked to be spread.
pub async fn prefixes_come_home(fleet: &Fleet, docs: usize) -> std::collections::HashMap<usize, String> {
    let ask = |prompt: String| serde_json::json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 2});
    let doc = |doc: usize| (0..40).map(|i| format!("doc{doc}w{i}")).collect::<Vec<_>>().join(" ");
    let mut home = std::collections::HashMap::new();
    for d in 0..docs {
        let first = fleet.http.post(&fleet.url("/v1/completions"), &ask(doc(d))).await;
        assert_eq!(first.status, 200, "{:?}", first.body);
        assert_eq!(first.cached_tokens(), 0);
        home.insert(d, first.header("x-kvroute-replica").unwrap().to_owned());
    }
    for d in 0..docs {
        let follow_up = format!("{} and then a question {d}", doc(d));
        let reply = fleet.http.post(&fleet.url("/v1/completions"), &ask(follow_up)).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-kvroute-replica"), Some(home[&d].as_str()), "doc {d} follows its prefix");
        let predicted: u64 = reply.header("x-kvroute-predicted-cached-tokens").unwrap().parse().unwrap();
        assert!(predicted > 0);
        assert_eq!(reply.cached_tokens(), predicted, "doc {d}: the replica reports the hit predicted");
    }
    let used: std::collections::HashSet<&String> = home.values().collect();
    assert!(used.len() > 1, "new prefixes spread over the fleet: {home:?}");
    home
}
