//! The demo: an embedded fleet in this process (N replica agents on loopback, and one router
//! per routing policy in front of them, started in turn), then [`compare`] on a workload, so
//! one command shows what cache-aware routing buys on a laptop.
//!
//! The agents run at `time_scale` (every simulated latency divided by it) and the trace's
//! arrivals are divided by the same factor, so the run is the unscaled workload compressed in
//! time: the same load, the same hit rates, latencies divided by `time_scale`.

use std::path::PathBuf;

use kvroute_replica_agent::RunningAgent;
use kvroute_replica_agent::cache;
use kvroute_router::config::{Config as RouterConfig, ReplicaConfig};
use kvroute_router::policy::PolicyKind;
use kvroute_router::replicas::{EngineKind, Role};
use tokio_util::sync::CancellationToken;

use crate::compare::{self, CompareConfig, CompareReport, Routers};
use crate::live::{Arrivals, LiveConfig, PromptFormat};
use crate::workload::Trace;

/// The served model of the embedded fleet.
pub const DEMO_MODEL: &str = "kvroute-sim";

/// How the embedded fleet is built.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetConfig {
    pub replicas: usize,
    /// Prefix-cache capacity of each agent, in blocks.
    pub capacity_blocks: usize,
    pub block_size: u32,
    pub eviction: cache::PolicyKind,
    /// Simulated seconds per wall-clock second on every agent.
    pub time_scale: f64,
    /// Data-parallel ranks of each agent: an engine each, with its own cache of
    /// `capacity_blocks` and its own event stream (the router names the rank).
    pub data_parallel_size: u32,
    /// Whether the routers follow the agents' KV events; without, each predicts the agents'
    /// caches from its own requests (as in front of engines that publish no events).
    pub events: bool,
    /// Blocks of host memory each agent (each rank) offloads to (0: none).
    pub offload_blocks: usize,
}

/// Longest prompt plus completion the embedded fleet accepts (agents and routers), so
/// long-context traces are served (the shared Mooncake trace reaches 191k tokens) as far as
/// an agent's cache holds a prompt whole (`--capacity-blocks` times the block size): a
/// longer one is refused with a 400 and left out of the comparison.
pub const DEMO_MAX_MODEL_LEN: u32 = 262_144;

/// A router's view of `agent`, of `role`: its event stream, replay and snapshots followed with
/// `events` (else its cache is predicted).
pub fn replica_config(agent: &RunningAgent, events: bool, role: Role) -> ReplicaConfig {
    ReplicaConfig {
        name: agent.name.clone(),
        http: agent.http_url(),
        events: if events { agent.events_endpoint.clone() } else { String::new() },
        replay: agent.replay_endpoint.clone().filter(|_| events),
        grpc: Some(agent.grpc_url()).filter(|_| events),
        engine: EngineKind::Kvroute,
        dp_size: agent.ranks.count() as u32,
        topic: String::new(),
        role,
        bootstrap_port: agent.bootstrap_addr.map(|addr| addr.port()),
    }
}

/// N replica agents on loopback; stopped by [`EmbeddedFleet::stop`] (or their token).
pub struct EmbeddedFleet {
    pub agents: Vec<RunningAgent>,
    pub config: FleetConfig,
    shutdown: CancellationToken,
}

impl FleetConfig {
    /// Agent `i`'s configuration.
    pub fn agent(&self, i: usize) -> kvroute_replica_agent::Config {
        kvroute_replica_agent::Config {
            model: DEMO_MODEL.into(),
            block_size: self.block_size,
            capacity_blocks: self.capacity_blocks,
            policy: self.eviction,
            time_scale: self.time_scale,
            max_model_len: DEMO_MAX_MODEL_LEN,
            data_parallel_size: self.data_parallel_size,
            offload_blocks: self.offload_blocks,
            ..kvroute_replica_agent::Config::loopback(format!("agent-{i}"))
        }
    }
}

impl EmbeddedFleet {
    /// Starts the agents (every socket on 127.0.0.1 port 0). If one cannot start, those
    /// started before it are stopped before the error returns.
    pub async fn start(config: FleetConfig, shutdown: CancellationToken) -> anyhow::Result<Self> {
        let mut fleet = Self { agents: Vec::with_capacity(config.replicas), config, shutdown };
        for i in 0..fleet.config.replicas {
            match kvroute_replica_agent::start(fleet.config.agent(i), fleet.shutdown.child_token()).await {
                Ok(agent) => fleet.agents.push(agent),
                Err(e) => {
                    for agent in fleet.agents {
                        agent.stop().await;
                    }
                    return Err(e.context(format!("starting agent-{i}")));
                }
            }
        }
        Ok(fleet)
    }

    /// The agents' HTTP base URLs.
    pub fn urls(&self) -> Vec<String> {
        self.agents.iter().map(RunningAgent::http_url).collect()
    }

    /// A router config (any policy) in front of every agent, on loopback.
    pub fn router_config(&self) -> RouterConfig {
        let events = self.config.events;
        let replicas = self.agents.iter().map(|agent| replica_config(agent, events, Role::Both)).collect();
        RouterConfig {
            model: DEMO_MODEL.into(),
            block_size: self.config.block_size,
            health_interval_ms: 500,
            max_prompt_tokens: u64::from(DEMO_MAX_MODEL_LEN),
            // Without events, a predicted cache is the agent's size.
            predicted_cache_tokens: self.config.capacity_blocks * self.config.block_size as usize,
            ..RouterConfig::loopback(replicas)
        }
    }

    /// Stops every agent and waits for them.
    pub async fn stop(self) {
        self.shutdown.cancel();
        for agent in self.agents {
            agent.stop().await;
        }
    }
}

/// What the demo runs.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    pub fleet: FleetConfig,
    pub policies: Vec<PolicyKind>,
    pub trace: Trace,
    /// The workload's name in the report.
    pub workload: String,
    /// Send at most this many requests.
    pub max_requests: Option<usize>,
    /// How prompts are written.
    pub prompt: PromptFormat,
    pub out_dir: Option<PathBuf>,
    pub progress: bool,
}

/// Starts the fleet, compares the policies on it, stops the fleet.
pub async fn run(config: &DemoConfig, shutdown: CancellationToken) -> anyhow::Result<CompareReport> {
    let fleet = EmbeddedFleet::start(config.fleet.clone(), shutdown.child_token()).await?;
    let mut live = LiveConfig::new(String::new(), DEMO_MODEL);
    live.replicas = fleet.urls();
    live.arrivals = Arrivals::Trace { speedup: config.fleet.time_scale };
    live.max_requests = config.max_requests;
    live.prompt = config.prompt;
    live.progress = config.progress;
    let compare = CompareConfig {
        routers: Routers::Embedded {
            config: Box::new(fleet.router_config()),
            policies: config.policies.clone(),
        },
        replicas: fleet.urls(),
        live,
        block_size: config.fleet.block_size as usize,
        // Read from the agents (an engine's cache a rank).
        total_capacity_blocks: None,
        eviction: config.fleet.eviction,
        // The embedded agents' own.
        s3fifo: Default::default(),
        time_scale: config.fleet.time_scale,
        out_dir: config.out_dir.clone(),
        workload: config.workload.clone(),
        // Arrivals and agents are scaled alike: the unscaled trace, offline. (The simulator
        // has no host memory: with it, there is no offline run to set beside the live one.)
        offline_speedup: (config.fleet.offload_blocks == 0).then_some(1.0),
    };
    let report = compare::compare(&config.trace, &compare, shutdown).await;
    fleet.stop().await;
    report
}
