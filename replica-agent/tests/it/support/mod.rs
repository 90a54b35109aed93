//! Test harness: [`Agent::start`] runs an engine, its event publisher and the HTTP API on
//! loopback port 0; [`client`] speaks HTTP to it; [`shape`] checks OpenAI response shapes.

pub mod client;
pub mod shape;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvroute_proto::Epoch;
use kvroute_proto::openai::{Tokenization, TokenizationConfig};
use kvroute_replica_agent::Config;
use kvroute_replica_agent::cache::{CacheConfig, S3FifoParams};
use kvroute_replica_agent::engine::{Engine, EngineConfig};
use kvroute_replica_agent::http;
use kvroute_replica_agent::publisher::{Publisher, PublisherConfig};
use tokio::net::TcpListener;
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
        config.validate().expect("valid test config");
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let tokenization = Tokenization::new(&TokenizationConfig {
            base_model: config.model.clone(),
            lora_adapters: config.lora_adapters.clone(),
            ..TokenizationConfig::default()
        })
        .expect("builtin tokenizer");
        let (publisher, _) = Publisher::bind(
            PublisherConfig::default(),
            &config.events_endpoint,
            config.replay(),
            &tracker,
            shutdown.clone(),
        )
        .await
        .expect("bind event sockets");
        let engine = Engine::start(
            EngineConfig {
                replica: config.name.clone(),
                epoch: Epoch(1),
                cache: CacheConfig {
                    capacity_blocks: config.capacity_blocks,
                    block_size: config.block_size as usize,
                    policy: config.policy,
                    s3fifo: S3FifoParams::default(),
                },
                max_num_seqs: config.max_num_seqs as usize,
                max_num_batched_tokens: config.max_num_batched_tokens as usize,
                max_waiting: config.max_waiting,
                timing: config.timing(),
                seed: config.seed,
                shutdown_grace: Duration::from_secs(config.shutdown_grace_secs),
            },
            publisher,
            &tracker,
            shutdown.clone(),
        )
        .expect("engine starts");
        let listener = TcpListener::bind(config.http_addr).await.expect("bind HTTP");
        let addr = listener.local_addr().expect("bound address");
        let state = http::AppState::new(engine, Arc::new(tokenization), Arc::new(config.clone()));
        tracker.spawn(http::serve(listener, state, shutdown.clone()));
        Agent { addr, config, client: Client::new(addr), shutdown, tracker }
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
