//! Assembles a router from its [`Config`]: the index, event ingestion, the fleet, the
//! proxy, health checks and the admin service, every task owned by one `TaskTracker` and
//! stopped by one `CancellationToken`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use kvroute_proto::openai::{Tokenization, TokenizationConfig, TokenizerSpec};
use kvroute_proto::serve::{Heartbeats, Parts};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::AdminService;
use crate::config::Config;
use crate::discovery::{Discovery, DiscoveryMetrics};
use crate::fleet::Fleet;
use crate::index::SharedIndex;
use crate::ingest::Ingest;
use crate::metrics::{
    ProxyMetrics, WatchedFiles, register_replica_load, register_tokenize_cache, register_watched_files,
};
use crate::proxy::control::{self, Client};
use crate::proxy::forward::ForwardConfig;
use crate::proxy::key_file::KeyFile;
use crate::proxy::live::{Admission, Live, Routing};
use crate::proxy::pool::Pool;
use crate::proxy::prompts::{Prompts, RemoteTokenizer};
use crate::proxy::replica_key::ReplicaKeyFile;
use crate::proxy::route::Decider;
use crate::proxy::{self, ProxyState};

/// A running router: where it listens, and handles for tests and embedded fleets.
pub struct RunningRouter {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Where `/health` and `/ready` are served apart from the proxy, if anywhere.
    pub health_addr: Option<SocketAddr>,
    pub state: Arc<ProxyState>,
    /// Its tasks, and the token that stops them.
    pub parts: Parts,
}

impl RunningRouter {
    /// The proxy's base URL: `https` with `--tls-cert`.
    pub fn url(&self) -> String {
        let scheme = if self.state.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The admin service's base URL, for a plain gRPC client (`http`, whether or not the
    /// service serves TLS: `--admin-tls`).
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin_addr)
    }

    pub fn fleet(&self) -> &Fleet {
        self.state.fleet()
    }

    /// Stops every task and waits for them (open requests finish first).
    pub async fn stop(self) {
        self.parts.stop().await;
    }

    /// Why the router stopped of itself, if it did: its proxy or its admin server failed.
    pub fn failure(&self) -> Option<&str> {
        self.parts.failure()
    }
}

/// A token that fires `drain` after `shutdown` does, unless `tracker`'s tasks have all ended
/// by then. (Not one of those tasks: they are waited for, and a drain that ends sooner should
/// not wait for this; nor should this outlive them.)
fn ending(shutdown: &CancellationToken, drain: Duration, tracker: &TaskTracker) -> CancellationToken {
    let (ending, shutdown, tracker) = (CancellationToken::new(), shutdown.clone(), tracker.clone());
    let fire = ending.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        tokio::select! {
            () = tokio::time::sleep(drain) => fire.cancel(),
            () = tracker.wait() => {}
        }
    });
    ending
}

/// Warns when `--replica-api-key` opens the replicas to every client: the router checks no
/// key of its own, nor clients' certificates.
pub(crate) fn warn_if_replicas_open(state: &ProxyState, config: &Config) {
    let replica_key = config.replica_api_key.is_some() || config.replica_api_key_file.is_some();
    if replica_key && state.admission.get().is_open() && config.tls_client_ca.is_none() {
        tracing::warn!(
            "--replica-api-key(-file) without --api-key, --api-key-file or --tls-client-ca: every client reaches the replicas with their key"
        );
    }
}

/// Binds the proxy and admin listeners (port 0 allowed), starts every task and returns.
///
/// The router stops when `shutdown` is cancelled, and cancels it itself when a part it cannot
/// run without fails, and in [`RunningRouter::stop`]: give it a child token to keep those to
/// the router. Dropping the returned handle stops nothing. If the start fails, what it had
/// started is stopped (and waited for) before the error returns, and `shutdown` is left as it
/// was.
pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<RunningRouter> {
    if let Err(errors) = config.validate() {
        anyhow::bail!("invalid configuration:\n  - {}", errors.join("\n  - "));
    }
    Parts::start(shutdown, async |parts: &Parts| assemble(config, parts).await).await
}

/// [`start`]'s work, past the config's validation: its tasks are `parts`.
async fn assemble(config: Config, parts: &Parts) -> anyhow::Result<RunningRouter> {
    let (shutdown, tracker) = (parts.token(), &parts.tracker);
    let mut registry = Registry::default();
    let index = SharedIndex::with_credit_ttl(config.credit_ttl());
    let ingest =
        Ingest::start(config.ingest(), index.clone(), &mut registry, tracker.clone(), shutdown.clone());
    let host_index = ingest.host_index().clone();
    let fleet = Fleet::new(ingest);
    for r in &config.replicas {
        fleet
            .add(r.to_spec(&config.model, config.block_size))
            .with_context(|| format!("adding replica {}", r.name))?;
    }
    let discovery = Discovery::start(
        &config.discovery,
        config.discovery.template(&config.model, Some(config.block_size)),
        fleet.clone(),
        DiscoveryMetrics::register(&mut registry),
        tracker,
        shutdown.clone(),
    )
    .await
    .context("starting replica discovery")?;

    let tokenizer = match &config.tokenizer {
        Some(path) => TokenizerSpec::HuggingFace { path: path.clone() },
        None => TokenizerSpec::Builtin,
    };
    if let Some(files) = tokenizer.model_files() {
        tracing::info!(
            tokenizer = %files.tokenizer.display(),
            tokenizer_config = ?config.tokenizer_config.as_ref().or(files.tokenizer_config.as_ref()),
            "tokenizing locally with the model's tokenizer"
        );
    }
    let mut tokenization = Tokenization::new(&TokenizationConfig {
        base_model: config.model.clone(),
        lora_adapters: config.lora_adapters.clone(),
        tokenizer,
        tokenizer_config: config.tokenizer_config.clone(),
        chat_template: config.chat_template.clone(),
        chat: config.chat.clone(),
    })
    .context("loading the tokenizer")?;
    if let Some(problem) = tokenization.template_problem() {
        tracing::warn!(problem, "the tokenizer_config.json beside the tokenizer is unusable: not used");
    }
    if tokenization.chat_template().is_none() && !config.remote_tokenize {
        tracing::warn!(
            "no chat template: chat, Messages and Responses requests will be refused (400); give \
             --tokenizer-config (the model's tokenizer_config.json) or --chat-template"
        );
    }
    if config.sglang_fleet() {
        tokenization.render_as_sglang();
        if config.remote_tokenize {
            tracing::warn!(
                "--remote-tokenize speaks vLLM's /tokenize, and SGLang's takes a prompt, not a chat's                  messages: chats may be refused (400); give --tokenizer (the model's files) instead"
            );
        }
    }
    // Templates that print the date print the local one, as the replicas' do.
    let zone = kvroute_proto::openai::chat_template::local_zone();
    let zone = zone.iana_name().unwrap_or("UTC (no TZ, and no system zone could be read)");
    tracing::info!(zone, "chat templates date in this time zone: run the router in the replicas'");
    if tokenization.is_harmony() {
        tracing::info!(
            "the chat template is in OpenAI's Harmony format (gpt-oss): chats are rendered with \
             Harmony as vLLM renders them, dated {} (VLLM_SYSTEM_START_DATE, else today in {zone})",
            std::env::var("VLLM_SYSTEM_START_DATE").as_deref().unwrap_or("today")
        );
    }
    if config.tokenize_cache_bytes > 0
        && !config.remote_tokenize
        && let Err(why) = tokenization.enable_prefix_cache(config.tokenize_cache_bytes)
    {
        tracing::warn!("tokenizing without a prefix cache: {why}");
    }
    let tokenization = Arc::new(tokenization);
    register_tokenize_cache(&mut registry, tokenization.clone());
    let replica_key_file = ReplicaKeyFile::open(config.replica_api_key_file.as_deref())
        .map_err(|e| anyhow::anyhow!("--replica-api-key-file {e}"))?;
    let replica_authorization =
        Live::new(config.replica_authorization().or_else(|| replica_key_file.authorization()));
    let replica_tls = config.replica_tls().map_err(anyhow::Error::msg)?;
    let https = |url: &str| url.get(..8).is_some_and(|s| s.eq_ignore_ascii_case("https://"));
    if config.discovery.discovery_https || config.replicas.iter().any(|r| https(&r.http)) {
        // The system's authorities (if no file names others) read now, not by a proxy thread
        // at its first connection.
        drop(replica_tls.config());
    }
    if config.discovery.discovery_https && config.replica_tls_server_name.is_none() {
        tracing::warn!(
            "--discovery-https without --replica-tls-server-name: discovered replicas' certificates must name their IP addresses"
        );
    }
    let client = Client::new(config.connect_timeout(), replica_authorization.clone(), replica_tls.clone());
    let prompts = if config.remote_tokenize {
        Prompts::Remote(Box::new(RemoteTokenizer::new(
            tokenization,
            client.clone(),
            config.tokenize_timeout(),
        )))
    } else {
        Prompts::Local(tokenization)
    };
    let metrics = ProxyMetrics::register(&mut registry);
    let stalls = proxy::stalls::StallWatch::start(config.send_timeout(), metrics.client_stalls.clone());
    let seed = config.seed.unwrap_or_else(|| {
        use std::hash::{BuildHasher, Hasher};
        // std's per-process random hasher keys: a seed from the OS without another crate.
        std::collections::hash_map::RandomState::new().build_hasher().finish()
    });
    tracing::info!(seed, "policy seed");
    let routing = Live::new(Routing::new(&config, seed));
    register_replica_load(&mut registry, fleet.clone(), routing.clone());
    let decider = Decider {
        fleet: fleet.clone(),
        index,
        host_index,
        routing,
        prompts,
        block_size: config.block_size as usize,
        eagle: config.eagle,
        metrics,
        deciding: Default::default(),
    };
    // Resolved once: the heartbeats need one slot for each thread that will tick.
    let http_threads = config.http_threads();
    let key_file = Arc::new(
        KeyFile::open(config.api_key_file.as_deref()).map_err(|e| anyhow::anyhow!("--api-key-file {e}"))?,
    );
    let tls = config.tls().map_err(anyhow::Error::msg)?;
    let watched = WatchedFiles {
        tls: tls.clone(),
        key_file: key_file.clone(),
        replica_tls: replica_tls.clone(),
        replica_key_file: replica_key_file.clone(),
    };
    register_watched_files(&mut registry, watched);
    let backgrounds = proxy::background::Backgrounds::new(
        (client.clone(), fleet.clone()),
        config.control_timeout(),
        shutdown.clone(),
        &decider.metrics,
    );
    let state = Arc::new(ProxyState {
        decider,
        new_pool: {
            let timeout = config.connect_timeout();
            let replica_tls = replica_tls.clone();
            Box::new(move || {
                Pool::new(timeout, control::IDLE_TIMEOUT, control::MAX_IDLE).with_tls(replica_tls.clone())
            })
        },
        forward: ForwardConfig {
            max_body_bytes: config.max_body_bytes,
            first_byte_timeout: config.first_byte_timeout(),
            prefill_timeout: std::time::Duration::from_millis(config.pd_prefill_timeout_ms),
            control_timeout: config.control_timeout(),
            idle_timeout: config.idle_timeout(),
            stalls,
            eject_after: config.eject_after,
            ejection: config.ejection(),
            access_log: config.access_log,
            forwarded_for: config.forwarded_for,
            replica_authorization,
            owners: Arc::new(proxy::responses::Owners::new(config.response_owners)),
            backgrounds: Arc::new(backgrounds),
            ending: ending(shutdown, config.drain_timeout(), tracker),
        },
        registry: Arc::new(registry),
        admission: Live::new(key_file.with_keys(&Admission::new(&config))),
        key_file,
        in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
        per_key: Default::default(),
        queue: proxy::queue::Queue::new(config.max_queued, config.queue_timeout()),
        base_model: config.model.clone(),
        lora: proxy::lora::Updates::new(config.lora_updates),
        discovery,
        synced_once: AtomicBool::new(false),
        heartbeats: Heartbeats::new(http_threads),
        allowed_origins: proxy::cors::AllowedOrigins::new(&config.allowed_origins),
        tls,
        replica_tls,
        replica_key_file,
        shutdown: shutdown.clone(),
    });

    let listener =
        TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    let admin_listener = TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("binding {}", config.admin_listen))?;
    let addr = listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;
    let health_addr = match config.health_listen {
        Some(at) => {
            let health = TcpListener::bind(at).await.with_context(|| format!("binding {at}"))?;
            let health_addr = health.local_addr()?;
            tracker.spawn(proxy::serve_probes(health, state.clone(), shutdown.clone()));
            Some(health_addr)
        }
        None => None,
    };

    let serving =
        proxy::serve(listener, http_threads, state.clone(), config.serve_limits(), shutdown.clone());
    parts.vital("the proxy's HTTP server", async move { serving.await.map_err(|e| e.to_string()) });
    let checks = proxy::health::Settings {
        interval: config.health_interval(),
        timeout: Duration::from_millis(config.health_timeout_ms),
        load_timeout: config.control_timeout(),
        unhealthy_after: config.unhealthy_after,
    };
    tracker.spawn(proxy::health::run(state.clone(), client, checks, shutdown.clone()));
    if config.tls_check_ms > 0 {
        let every = Duration::from_millis(config.tls_check_ms);
        if let Some(tls) = state.tls.clone() {
            tracker.spawn(tls.watch(every, shutdown.clone()));
        }
        // Watched even without a file now: a reload may name one.
        tracker.spawn(state.replica_tls.clone().watch(every, shutdown.clone()));
    }
    // Watched even without a file now: a reload may name one.
    if config.api_key_check_ms > 0 {
        let every = Duration::from_millis(config.api_key_check_ms);
        tracker.spawn(state.key_file.clone().watch(state.admission.clone(), every, shutdown.clone()));
        let replicas = state.forward.replica_authorization.clone();
        tracker.spawn(state.replica_key_file.clone().watch(replicas, every, shutdown.clone()));
    }
    // An empty token is no token (allowed on loopback only, see `Config::validate`).
    let admin_token = config.admin_token.as_ref().map(|t| t.expose().to_owned()).filter(|t| !t.is_empty());
    let admin_auth = admin_token.is_some();
    let admin =
        AdminService::new(state.clone(), config.model.clone(), config.block_size).into_server(admin_token);
    let admin_shutdown = shutdown.clone();
    let admin_tls = state.tls.clone().filter(|_| config.admin_tls);
    if admin_tls.is_none() && !config.admin_listen.ip().is_loopback() {
        tracing::warn!(admin = %config.admin_listen, "the admin service is plain beyond loopback: its token crosses the network in the clear (--admin-tls)");
    }
    parts.vital("the admin gRPC server", async move {
        let incoming = kvroute_proto::serve::grpc_incoming(admin_listener, admin_tls);
        let serving = kvroute_proto::serve::grpc_server()
            .add_service(admin)
            .serve_with_incoming_shutdown(incoming, admin_shutdown.clone().cancelled_owned());
        let drain = kvroute_proto::serve::GRPC_DRAIN;
        kvroute_proto::serve::drained_within(serving, &admin_shutdown, drain).await.map_err(|e| e.to_string())
    });
    warn_if_replicas_open(&state, &config);
    tracing::info!(
        listen = %addr, admin = %admin_addr, health = ?health_addr, policy = config.policy.as_str(),
        replicas = config.replicas.len(), admin_auth, admin_tls = config.admin_tls, tls = state.tls.is_some(),
        "router started"
    );
    Ok(RunningRouter { addr, admin_addr, health_addr, state, parts: parts.clone() })
}

/// Runs a router until `shutdown` fires, then waits for its tasks.
/// The configuration is reloaded at each `SIGHUP` ([`crate::reload`]).
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let reloader = crate::reload::Reloader::new(&config);
    // Listened for before the start (loading a tokenizer, binding): a `SIGHUP` then is a
    // reload once the router runs, not the end of the process.
    #[cfg(unix)]
    let hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
    let router = start(config, shutdown.clone()).await?;
    #[cfg(unix)]
    router.parts.tracker.spawn(crate::reload::on_hangup(
        router.state.clone(),
        reloader,
        hangups,
        router.parts.token().clone(),
    ));
    #[cfg(not(unix))]
    drop(reloader);
    shutdown.cancelled().await;
    let parts = router.parts.clone();
    router.stop().await;
    match parts.failure() {
        Some(why) => anyhow::bail!("{why}"),
        None => Ok(()),
    }
}
