//! Test harness: [`Agent::start`] runs a whole agent (`kvroute_replica_agent::start`: engine,
//! event publisher, gRPC and HTTP API) on loopback port 0; [`client`] speaks HTTP to it; [`shape`] checks OpenAI response shapes.

pub mod client;
pub mod shape;

use std::net::SocketAddr;

pub use kvroute_replica_agent::Config;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use client::Client;

/// The base model every test agent serves.
pub const MODEL: &str = "kvroute-sim";
/// The LoRA adapter every test agent serves besides the base model.
pub const ADAPTER: &str = "tenant-a";

/// A config for fast tests: small blocks, a 1000x time scale, one LoRA adapter.
pub fn config() -> Config {
    Config {
        model: MODEL.into(),
        lora_adapters: vec![ADAPTER.into()],
        block_size: 4,
        capacity_blocks: 4096,
        max_model_len: 512,
        default_max_tokens: 8,
        time_scale: 1000.0,
        max_body_bytes: 64 * 1024,
        ..Config::loopback("it")
    }
}

/// A running agent; shuts down when dropped.
pub struct Agent {
    pub addr: SocketAddr,
    pub config: Config,
    pub client: Client,
    pub events_endpoint: String,
    pub replay_endpoint: Option<String>,
    /// A prefill agent's bootstrap server (`--disaggregation-mode prefill`).
    pub bootstrap_addr: Option<SocketAddr>,
    pub grpc_url: String,
    pub engine: kvroute_replica_agent::engine::Engine,
    pub ranks: kvroute_replica_agent::engine::Ranks,
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl Agent {
    /// Starts an agent with [`config`].
    pub async fn start() -> Agent {
        Agent::with(config()).await
    }

    /// Starts an agent with `config`: publisher, engine and HTTP API, as the binary wires them.
    pub async fn with(config: Config) -> Agent {
        let shutdown = CancellationToken::new();
        let running =
            kvroute_replica_agent::start(config.clone(), shutdown.clone()).await.expect("agent starts");
        let addr = running.http_addr;
        Agent {
            addr,
            config,
            client: Client::new(addr),
            events_endpoint: running.events_endpoint.clone(),
            replay_endpoint: running.replay_endpoint.clone(),
            bootstrap_addr: running.bootstrap_addr,
            grpc_url: running.grpc_url(),
            engine: running.engine.clone(),
            ranks: running.ranks.clone(),
            shutdown,
            tracker: running.parts.tracker.clone(),
        }
    }

    /// Fires shutdown and waits for every task, the HTTP server's drain included.
    pub async fn stop(&self) {
        self.shutdown.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Polls `cond` until it holds (for states nothing announces, such as work a task does after
/// its answer); panics with `what` after 20 s.
pub async fn until(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
