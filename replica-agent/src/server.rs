//! Assembles a replica agent from its [`Config`]: event publisher, engine, gRPC service and
//! HTTP API, every task owned by one `TaskTracker` and stopped by one `CancellationToken`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvroute_proto::openai::{Tokenization, TokenizationConfig, TokenizerSpec};
use kvroute_proto::serve::{Parts, Tls};
use kvroute_proto::{Epoch, pb};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::engine::{Engine, EngineConfig, Ranks};
use crate::grpc::AgentService;
use crate::http;
use crate::publisher::{Publisher, PublisherConfig};

/// A running agent: where it listens, and its engine (for tests and embedded fleets).
pub struct RunningAgent {
    pub name: String,
    pub epoch: Epoch,
    pub http_addr: SocketAddr,
    /// Whether the API is served over HTTPS (`--ssl-certfile`).
    pub https: bool,
    pub grpc_addr: SocketAddr,
    pub events_endpoint: String,
    pub replay_endpoint: Option<String>,
    /// A prefill agent's bootstrap server (`--disaggregation-mode prefill`).
    pub bootstrap_addr: Option<SocketAddr>,
    /// Rank 0's engine (the only one, unless `--data-parallel-size` says otherwise).
    pub engine: Engine,
    /// Every data-parallel rank's engine; rank r publishes on the endpoints' port + r.
    pub ranks: Ranks,
    /// Its tasks, and the token that stops them.
    pub parts: Parts,
}

impl RunningAgent {
    /// `http://addr` (`https://` with TLS) of the OpenAI API.
    pub fn http_url(&self) -> String {
        format!("{}://{}", if self.https { "https" } else { "http" }, self.http_addr)
    }

    /// `http://addr` of the gRPC service.
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    /// Stops every task and waits for them (in-flight requests get the configured grace).
    pub async fn stop(self) {
        self.parts.stop().await;
    }

    /// Why the agent stopped of itself, if it did: a server, an engine's scheduler or its
    /// event publisher failed.
    pub fn failure(&self) -> Option<&str> {
        self.parts.failure()
    }
}

/// Binds every socket the config names (port 0 allowed), starts all tasks and returns.
///
/// The agent runs until `shutdown` fires, and fires it itself when a part it cannot run
/// without (its HTTP or gRPC server, an engine's scheduler, which fails when its event
/// publisher stops) fails, and in [`RunningAgent::stop`]. Dropping the returned handle stops
/// nothing. If the start fails, what it had started is stopped (and waited for) before the
/// error returns, and `shutdown` is left as it was.
pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<RunningAgent> {
    if let Err(errors) = config.validate() {
        anyhow::bail!("invalid configuration:\n  - {}", errors.join("\n  - "));
    }
    Parts::start(shutdown, async |parts: &Parts| assemble(Arc::new(config), parts).await).await
}

/// [`start`]'s work, past the config's validation: its tasks are `parts`.
async fn assemble(config: Arc<Config>, parts: &Parts) -> anyhow::Result<RunningAgent> {
    let (tracker, shutdown) = (&parts.tracker, parts.token());
    let epoch = Epoch(rand::random());

    let tokenization = Arc::new(
        Tokenization::new(&TokenizationConfig {
            base_model: config.model.clone(),
            lora_adapters: config.lora_adapters.clone(),
            tokenizer: match &config.tokenizer {
                Some(path) => TokenizerSpec::HuggingFace { path: path.clone() },
                None => TokenizerSpec::Builtin,
            },
            tokenizer_config: None,
            chat_template: config.chat_template.clone(),
            chat: config.chat.clone(),
        })
        .context("loading the tokenizer")?,
    );
    if let Some(problem) = tokenization.template_problem() {
        tracing::warn!(problem, "the tokenizer_config.json beside the tokenizer is unusable: not used");
    }
    // What `truncate_prompt_tokens: -1` keeps, less the output tokens, as vLLM's renderer.
    tokenization.set_context_len(u64::from(config.max_model_len));

    // The listeners first, so that a start that cannot bind them has begun nothing.
    let http_listener = TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("binding HTTP on {}", config.http_addr))?;
    let grpc_listener = TcpListener::bind(config.grpc_addr)
        .await
        .with_context(|| format!("binding gRPC on {}", config.grpc_addr))?;
    let http_addr = http_listener.local_addr()?;
    let bootstrap_listener = match config.disaggregation_mode {
        crate::bootstrap::Mode::Prefill => {
            let port = config.disaggregation_bootstrap_port;
            let bound = crate::bootstrap::bind(http_addr, port).await;
            Some(bound.with_context(|| format!("binding the bootstrap server on port {port}"))?)
        }
        _ => None,
    };
    let bootstrap_addr = bootstrap_listener.as_ref().map(TcpListener::local_addr).transpose()?;
    let tls = match config.tls_files() {
        Some(files) => {
            Some(Tls::from_files(&files).map_err(anyhow::Error::msg).context("loading the TLS files")?)
        }
        None => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let grpc_addr = grpc_listener.local_addr()?;

    let publisher_config = PublisherConfig {
        topic: config.topic.clone(),
        format: config.event_format,
        buffer_steps: config.buffer_steps,
        ..PublisherConfig::default()
    };
    let publishers = Publisher::bind_ranks(
        &publisher_config,
        &config.events_endpoint,
        config.replay(),
        config.data_parallel_size,
        tracker,
    )
    .await
    .context("binding the event sockets")?;
    let endpoints = publishers[0].1.clone();

    let mut engines = Vec::with_capacity(publishers.len());
    for (rank, (publisher, _)) in (0..).zip(publishers) {
        let (engine, scheduler) = Engine::new(
            EngineConfig {
                replica: config.name.clone(),
                epoch,
                dp_rank: rank,
                cache: config.cache(),
                offload_blocks: config.offload_blocks,
                max_num_seqs: config.max_num_seqs as usize,
                max_num_batched_tokens: config.max_num_batched_tokens as usize,
                max_waiting: config.max_waiting,
                timing: config.timing(),
                seed: config.seed,
                shutdown_grace: Duration::from_secs(config.shutdown_grace_secs),
            },
            publisher,
            shutdown.clone(),
        )
        .context("starting the engine")?;
        engines.push((engine, scheduler));
    }
    // SGLang's disaggregation's hand-overs: none waits past the engines' end (each rank's
    // scheduler ends at the shutdown once it runs nothing, else when its grace is over).
    let rooms =
        Arc::new(crate::bootstrap::Rooms::new(Duration::from_millis(config.disaggregation_timeout_ms)));
    // Vital once every engine is there (a scheduler whose engines were dropped by a start
    // failing after it ends of itself, before the start's abandoning could tell it apart).
    let engines = (0..)
        .zip(engines)
        .map(|(rank, (engine, scheduler))| {
            let rooms = rooms.clone();
            parts.vital(format!("rank {rank}'s engine"), async move {
                let ended = scheduler.await;
                rooms.close();
                ended
            });
            engine
        })
        .collect();
    let ranks = Ranks::new(engines);
    let engine = ranks.first().clone();

    let info = pb::InfoResponse {
        replica: config.name.clone(),
        epoch: epoch.0,
        block_size: config.block_size,
        capacity_blocks: config.capacity_blocks as u64,
        policy: format!("{:?}", config.policy).to_lowercase(),
        model: config.model.clone(),
        max_model_len: config.max_model_len,
        endpoints: Some(pb::Endpoints {
            http: format!("{scheme}://{http_addr}"),
            events: endpoints.events.clone(),
            replay: endpoints.replay.clone().unwrap_or_default(),
            grpc: format!("http://{grpc_addr}"),
            topic: config.topic.clone(),
        }),
        event_format: config.event_format.as_str().into(),
        tokenizer: config.tokenizer.as_ref().map_or_else(|| "builtin".into(), |p| p.display().to_string()),
    };
    // Snapshots and stats are rank 0's: a router resyncs the other ranks by replay.
    let grpc = AgentService::new(engine.clone(), info).into_server();
    let grpc_shutdown = shutdown.clone();
    parts.vital("the gRPC server", async move {
        let incoming = kvroute_proto::serve::grpc_incoming(grpc_listener, None);
        let serving = kvroute_proto::serve::grpc_server()
            .add_service(grpc)
            .serve_with_incoming_shutdown(incoming, grpc_shutdown.clone().cancelled_owned());
        let drain = kvroute_proto::serve::GRPC_DRAIN;
        kvroute_proto::serve::drained_within(serving, &grpc_shutdown, drain).await.map_err(|e| e.to_string())
    });

    let state = http::AppState::new(ranks.clone(), tokenization, config.clone(), rooms);
    if let Some(listener) = bootstrap_listener {
        let (rooms, shutdown) = (state.rooms().clone(), shutdown.clone());
        parts.vital("the bootstrap server", async move {
            crate::bootstrap::serve(listener, rooms, shutdown).await;
            Ok(())
        });
    }
    let serving = http::serve(http_listener, state, tls, shutdown.clone());
    parts.vital("the HTTP server", async move {
        serving.await;
        Ok(())
    });

    tracing::info!(
        name = %config.name, %epoch, http = %http_addr, grpc = %grpc_addr,
        events = %endpoints.events, replay = ?endpoints.replay, ranks = ranks.count(), "replica agent started"
    );
    Ok(RunningAgent {
        name: config.name.clone(),
        epoch,
        http_addr,
        https: scheme == "https",
        grpc_addr,
        events_endpoint: endpoints.events,
        replay_endpoint: endpoints.replay,
        bootstrap_addr,
        engine,
        ranks,
        parts: parts.clone(),
    })
}

/// Runs an agent until `shutdown` fires, then waits for its tasks.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let agent = start(config, shutdown.clone()).await?;
    shutdown.cancelled().await;
    let parts = agent.parts.clone();
    agent.stop().await;
    match parts.failure() {
        Some(why) => anyhow::bail!("{why}"),
        None => Ok(()),
    }
}
