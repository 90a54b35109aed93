//! The live subcommands of `kvroute-loadgen`: `live` (one run against a router or replica),
//! `compare` (one run per routing policy against a fleet) and `demo` (an embedded fleet and
//! `compare`, with defaults that finish in a few minutes on a laptop). Each parses its flags
//! into the library's configs and runs them on a tokio runtime; Ctrl-C stops a run early.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use http::HeaderValue;
use kvroute_replica_agent::cache;
use kvroute_router::config::{Config as RouterConfig, ReplicaConfig};
use kvroute_router::policy::PolicyKind;
use tokio_util::sync::CancellationToken;

use crate::compare::{self, CompareConfig, CompareReport, Routers};
use crate::demo::{self, DemoConfig, FleetConfig};
use crate::live::{self, Arrivals, LiveConfig, LiveReport, PromptFormat};
use crate::units::parse_duration;
use crate::workload::mooncake;
use crate::workload::synth::{ChatParams, Workload};
use crate::workload::{TRACE_BLOCK_SIZE, Trace};

/// How requests are paced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// In the trace's order, at its timestamps (from its first) divided by `--speedup`.
    Trace,
    /// A seeded Poisson process at `--rate` requests per second.
    Poisson,
    /// Closed loop: `--concurrency` requests always in flight.
    Closed,
}

/// How requests are sent; shared by `live` and `compare`.
#[derive(Clone, Debug, Args)]
pub struct SendArgs {
    /// How requests are paced.
    #[arg(long, value_enum, default_value_t = Mode::Trace)]
    pub mode: Mode,
    /// `--mode trace`: divide the trace's timestamps by this.
    #[arg(long, default_value_t = 1.0, value_parser = positive)]
    pub speedup: f64,
    /// `--mode poisson`: requests per second.
    #[arg(long, default_value_t = 10.0, value_parser = positive)]
    pub rate: f64,
    /// `--mode closed`: requests in flight.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Seed of the Poisson arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Ask for one JSON answer instead of a stream (no TTFT then).
    #[arg(long)]
    pub no_stream: bool,
    /// The `model` of every request.
    #[arg(long, default_value = demo::DEMO_MODEL)]
    pub model: String,
    /// How prompts are written: `ids` (token ids), `text` (a word a token with the
    /// built-in tokenizer, tokenized by the router and the replicas), `messages` (that
    /// text as Anthropic Messages requests, rendered with the chat template), `responses`
    /// (that text as OpenAI Responses requests, rendered the same way) or `generate` (the
    /// token ids as SGLang's native `/generate` requests).
    #[arg(long, value_enum, default_value_t = PromptFormat::Ids)]
    pub prompt_format: PromptFormat,
    /// Most requests in flight at once.
    #[arg(long, default_value_t = 256)]
    pub max_in_flight: usize,
    /// Longest a request may take (e.g. `60s`); as long as the router's own first-byte
    /// timeout by default.
    #[arg(long, default_value = "600s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Send nothing after this long (e.g. `5m`); `compare` then sets each run beside the
    /// pooled reference and offline simulation of the requests it did send.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Send at most this many requests of the workload.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub requests: Option<usize>,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// API key sent with every completion (`Authorization: Bearer <key>`), for a router or
    /// replica run with `--api-key`.
    #[arg(long, env = "KVROUTE_LOADGEN_API_KEY", hide_env_values = true)]
    pub api_key: Option<ApiKey>,
    /// PEM certificates of the authorities an `https://` target's certificate is checked
    /// against (a router's own `--tls-cert` authority); the system's without.
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
    /// PEM certificate chain shown to a target that asks for one (a router's
    /// `--tls-client-ca`, mutual TLS). With `--client-key`.
    #[arg(long, requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `--client-cert`.
    #[arg(long, requires = "client_cert")]
    pub client_key: Option<PathBuf>,
}

/// An API key as given, shown nowhere (not by `Debug`; and checked only once parsed, so that a
/// key refused is not quoted by clap's message, which a pod's log keeps).
#[derive(Clone)]
pub struct ApiKey(String);

impl std::str::FromStr for ApiKey {
    type Err = std::convert::Infallible;

    fn from_str(key: &str) -> Result<Self, Self::Err> {
        Ok(ApiKey(key.to_owned()))
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<hidden>)")
    }
}

/// `Authorization: Bearer <key>`, marked sensitive (its `Debug` does not show it).
fn bearer(key: &str) -> Result<HeaderValue, String> {
    let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
        .ok()
        .filter(|_| !key.is_empty() && !key.contains(char::is_whitespace))
        .ok_or("an API key is visible ASCII, without spaces")?;
    value.set_sensitive(true);
    Ok(value)
}

impl SendArgs {
    fn live_config(&self, target: String) -> anyhow::Result<LiveConfig> {
        let mut config = LiveConfig::new(target, self.model.clone());
        config.arrivals = match self.mode {
            Mode::Trace => Arrivals::Trace { speedup: self.speedup },
            Mode::Poisson => Arrivals::Poisson { rate: self.rate, seed: self.seed },
            Mode::Closed => Arrivals::Closed { concurrency: self.concurrency },
        };
        config.stream = !self.no_stream;
        config.prompt = self.prompt_format;
        config.max_in_flight = self.max_in_flight;
        config.request_timeout = self.timeout;
        config.max_duration = self.duration;
        config.max_requests = self.requests;
        config.progress = !self.no_progress;
        config.authorization = match &self.api_key {
            Some(ApiKey(key)) => Some(bearer(key).map_err(|e| anyhow::anyhow!("--api-key: {e}"))?),
            None => None,
        };
        let identity = self.client_cert.as_deref().zip(self.client_key.as_deref());
        if self.ca_cert.is_some() || identity.is_some() {
            let tls = kvroute_proto::serve::client_config(self.ca_cert.as_deref(), identity);
            config.tls =
                Some(tls.map_err(|e| anyhow::anyhow!("--ca-cert, --client-cert, --client-key: {e}"))?);
        }
        Ok(config)
    }
}

/// The workload: a Mooncake trace file, or a synthetic one (a subcommand).
#[derive(Clone, Debug, Args)]
pub struct WorkloadArgs {
    /// Mooncake JSONL trace to send (instead of a synthetic workload).
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

fn load(
    trace: &Option<PathBuf>,
    synthetic: &Option<Workload>,
    default: impl FnOnce() -> Workload,
) -> anyhow::Result<(Trace, String)> {
    match (trace, synthetic) {
        (Some(_), Some(_)) => anyhow::bail!("give either --trace or a synthetic workload, not both"),
        (Some(path), None) => {
            let trace = mooncake::read_file(path).with_context(|| format!("reading {}", path.display()))?;
            Ok((trace, path.display().to_string()))
        }
        (None, w) => {
            let w = w.clone().unwrap_or_else(default);
            Ok((w.generate().context("generating the workload")?, workload_name(&w)))
        }
    }
}

fn workload_name(w: &Workload) -> String {
    match w {
        Workload::Chat(p) => format!("chat ({} conversations, seed {})", p.conversations, p.seed),
        Workload::Rag(p) => format!("rag ({} queries, seed {})", p.requests, p.seed),
        Workload::Batch(p) => format!("batch ({} jobs, seed {})", p.jobs, p.seed),
    }
}

/// `live`: one run against a router or a single replica.
#[derive(Debug, Args)]
pub struct LiveArgs {
    /// Base URL of the router or replica (`http://host:port`).
    #[arg(long)]
    pub target: String,
    /// Base URL of a replica behind it, for its `/metrics` (repeat for each).
    #[arg(long = "replica-url")]
    pub replica_urls: Vec<String>,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub send: SendArgs,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(subcommand)]
    pub synthetic: Option<Workload>,
}

/// `compare`: one run per routing policy against a fleet.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// A replica, in the router's format
    /// (`name=..,http=..,events=..[,replay=..][,grpc=..][,engine=..]`); one router per policy
    /// is started here in front of them. Repeat for each replica.
    #[arg(long = "replica")]
    pub replicas: Vec<ReplicaConfig>,
    /// Instead of starting routers: a running router per policy, `POLICY=URL` (repeat).
    #[arg(long = "router", value_parser = parse_router)]
    pub routers: Vec<(PolicyKind, String)>,
    /// With `--router`: the replicas' HTTP base URLs (cache resets, metrics).
    #[arg(long = "replica-url")]
    pub replica_urls: Vec<String>,
    /// Routing policies to compare, with embedded routers.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [PolicyKind::CacheAware, PolicyKind::RoundRobin, PolicyKind::LeastLoaded])]
    pub policies: Vec<PolicyKind>,
    /// Tokens per KV block on the replicas.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: u32,
    /// The fleet's total cache capacity in blocks (default: the agents' own figures, an
    /// engine's cache a data-parallel rank). Given, it is taken as one cache a replica: the
    /// offline simulation of data-parallel replicas has fewer, larger caches than theirs.
    #[arg(long)]
    pub capacity_blocks: Option<usize>,
    /// The replicas' eviction policy (for the pooled reference and the offline runs; vLLM's
    /// is LRU). Agents state theirs on their metrics page, read unless `--capacity-blocks` is
    /// given: one that runs another is refused before any run.
    #[arg(long, value_enum, default_value_t = cache::PolicyKind::Lru)]
    pub eviction: cache::PolicyKind,
    /// With `--eviction s3fifo`: the agents' S3FIFO settings (checked as the policy is).
    #[command(flatten)]
    pub s3fifo: crate::cli::S3FifoArgs,
    /// The agents' `--time-scale`, so the offline simulation replays at the live load
    /// (`--speedup` over it).
    #[arg(long, default_value_t = 1.0, value_parser = positive)]
    pub agent_time_scale: f64,
    /// Skip simulating each policy offline (only done with `--mode trace`).
    #[arg(long)]
    pub no_offline: bool,
    /// Directory for report.json, table.txt and the SVG plots.
    #[arg(long, default_value = "reports/compare")]
    pub out: PathBuf,
    #[command(flatten)]
    pub send: SendArgs,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(subcommand)]
    pub synthetic: Option<Workload>,
}

/// A finite number above 0: a rate, a speed-up or a time scale.
fn positive(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if v.is_finite() && v > 0.0 { Ok(v) } else { Err(format!("{s} is not a finite number above 0")) }
}

fn parse_router(s: &str) -> Result<(PolicyKind, String), String> {
    let (policy, url) = s.split_once('=').ok_or_else(|| format!("{s:?} is not POLICY=URL"))?;
    let policy = PolicyKind::from_str(policy, true)?;
    Ok((policy, url.trim_end_matches('/').to_owned()))
}

/// `demo`: an embedded fleet and `compare`, with defaults sized for a laptop.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Replica agents in the fleet.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Prefix-cache capacity of each agent (of each of its ranks), in blocks.
    #[arg(long, default_value_t = 2048)]
    pub capacity_blocks: usize,
    /// Data-parallel ranks of each agent, as vLLM's `--data-parallel-size`: an engine each,
    /// with its own cache and event stream, behind one API server; the cache-aware router
    /// names the rank a request goes to.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub data_parallel_size: u32,
    /// The routers follow no KV events: each predicts the agents' caches from its own
    /// requests, as in front of engines that publish none (one rank an agent).
    #[arg(long, conflicts_with = "data_parallel_size")]
    pub without_events: bool,
    /// Blocks of host memory each agent offloads its KV blocks to and loads prefixes back
    /// from (vLLM's `OffloadingConnector`); 0: none. Hits then count the tokens loaded, and
    /// no offline run is made (the simulator has no host memory). Not with
    /// `--without-events` or data-parallel ranks (the routers would not follow it).
    #[arg(long, default_value_t = 0)]
    pub offload_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: u32,
    /// Eviction policy of every agent.
    #[arg(long, value_enum, default_value_t = cache::PolicyKind::Lru)]
    pub eviction: cache::PolicyKind,
    /// Routing policies to compare.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [PolicyKind::CacheAware, PolicyKind::RoundRobin, PolicyKind::LeastLoaded])]
    pub policies: Vec<PolicyKind>,
    /// Simulated seconds per wall-clock second: the agents' latencies and the trace's
    /// arrivals are both divided by it.
    #[arg(long, default_value_t = 6.0, value_parser = positive)]
    pub time_scale: f64,
    /// Send at most this many requests.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub requests: Option<usize>,
    /// How prompts are written: `ids` (token ids), `text` (a word a token with the
    /// built-in tokenizer, tokenized by the routers and the agents), `messages` (that
    /// text as Anthropic Messages requests, rendered with the chat template), `responses`
    /// (that text as OpenAI Responses requests, rendered the same way) or `generate` (the
    /// token ids as SGLang's native `/generate` requests).
    #[arg(long, value_enum, default_value_t = PromptFormat::Ids)]
    pub prompt_format: PromptFormat,
    /// Directory for report.json, table.txt and the SVG plots.
    #[arg(long, default_value = "reports/demo")]
    pub out: PathBuf,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// The workload (default: multi-turn chat sized to finish in a few minutes).
    #[command(subcommand)]
    pub synthetic: Option<Workload>,
}

/// The demo's default workload: multi-turn chat behind eight system prompts, 500
/// conversations of 2-8 turns, about 2500 requests over 4 minutes of trace (about 40 s per
/// policy at the default time scale). Chosen with the offline simulator so that a 4-agent
/// fleet's caches hold only part of the live conversations: round-robin then loses history
/// that cache-aware routing keeps, while enough load stays on the fleet for cache-aware's
/// load term to keep the replicas even.
pub fn demo_workload() -> Workload {
    Workload::Chat(ChatParams {
        conversations: 500,
        system_prompts: 8,
        system_prompt_tokens: 2048,
        min_turns: 2,
        max_turns: 8,
        user_tokens: 256,
        output_tokens: 48,
        conversation_rate: 4.0,
        think_time: Duration::from_secs(10),
        seed: 0,
    })
}

/// Runs `live`.
pub fn run_live(args: &LiveArgs) -> anyhow::Result<()> {
    let mut config = args.send.live_config(args.target.trim_end_matches('/').to_owned())?;
    let (trace, _) = load(&args.workload.trace, &args.synthetic, || Workload::Chat(ChatParams::default()))?;
    config.replicas = args.replica_urls.iter().map(|u| u.trim_end_matches('/').to_owned()).collect();
    let report = block_on(|shutdown| async move { Ok(live::run(&trace, &config, shutdown).await?) })?;
    print!("{}", live_summary(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).context("serialising the report")?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    anyhow::ensure!(!report.interrupted, "interrupted: the report covers the requests sent before");
    anyhow::ensure!(report.succeeded > 0, "none of the {} requests sent succeeded", report.requests);
    Ok(())
}

/// Runs `compare`.
pub fn run_compare(args: &CompareArgs) -> anyhow::Result<()> {
    let (trace, name) =
        load(&args.workload.trace, &args.synthetic, || Workload::Chat(ChatParams::default()))?;
    let (routers, replicas) = match (args.replicas.is_empty(), args.routers.is_empty()) {
        (false, true) => {
            let router = RouterConfig {
                block_size: args.block_size,
                model: args.send.model.clone(),
                ..RouterConfig::loopback(args.replicas.clone())
            };
            let urls = args.replicas.iter().map(|r| r.http.trim_end_matches('/').to_owned()).collect();
            (Routers::Embedded { config: Box::new(router), policies: args.policies.clone() }, urls)
        }
        (true, false) => {
            anyhow::ensure!(!args.replica_urls.is_empty(), "--router needs --replica-url for every replica");
            let urls = args.replica_urls.iter().map(|u| u.trim_end_matches('/').to_owned()).collect();
            (Routers::External(args.routers.clone()), urls)
        }
        _ => anyhow::bail!("give either --replica (routers started here) or --router (running routers)"),
    };
    let config = CompareConfig {
        routers,
        replicas,
        live: args.send.live_config(String::new())?,
        block_size: args.block_size as usize,
        total_capacity_blocks: args.capacity_blocks,
        eviction: args.eviction,
        s3fifo: args.s3fifo.params(),
        time_scale: args.agent_time_scale,
        out_dir: Some(args.out.clone()),
        workload: name,
        offline_speedup: (args.send.mode == Mode::Trace && !args.no_offline)
            .then(|| args.send.speedup / args.agent_time_scale),
    };
    let started = Instant::now();
    let report = block_on(|shutdown| async move { compare::compare(&trace, &config, shutdown).await })?;
    print_compare(&report, &args.out, started);
    served_something(&report)
}

/// Runs `demo`.
pub fn run_demo(args: &DemoArgs) -> anyhow::Result<()> {
    if args.offload_blocks > 0 && (args.without_events || args.data_parallel_size > 1) {
        anyhow::bail!(
            "--offload-blocks needs the routers to follow the agents' events, one rank an agent: \
             they index no host memory without events, nor a data-parallel replica's, so its \
             loads would be hits nobody predicted"
        );
    }
    let (mut trace, name) = load(&args.workload.trace, &args.synthetic, demo_workload)?;
    if args.workload.trace.is_some() && args.block_size as usize > TRACE_BLOCK_SIZE {
        anyhow::bail!("--block-size must be at most {TRACE_BLOCK_SIZE} for a Mooncake trace");
    }
    if let Some(n) = args.requests {
        trace.requests.truncate(n);
    }
    let config = DemoConfig {
        fleet: FleetConfig {
            replicas: args.replicas,
            capacity_blocks: args.capacity_blocks,
            block_size: args.block_size,
            eviction: args.eviction,
            time_scale: args.time_scale,
            data_parallel_size: args.data_parallel_size,
            events: !args.without_events,
            offload_blocks: args.offload_blocks,
        },
        policies: args.policies.clone(),
        trace,
        workload: name,
        max_requests: None,
        prompt: args.prompt_format,
        out_dir: Some(args.out.clone()),
        progress: !args.no_progress,
    };
    let ranks = match config.fleet.data_parallel_size {
        1 => String::new(),
        n => format!(" x {n} data-parallel ranks"),
    };
    let ranks = if args.without_events { format!("{ranks} (routers without KV events)") } else { ranks };
    let ranks = match args.offload_blocks {
        0 => ranks,
        n => format!("{ranks} (and {n} blocks of host memory each)"),
    };
    eprintln!(
        "demo: {} agents{ranks} x {} blocks of {} tokens, time scale {}, {} requests, policies {}",
        config.fleet.replicas,
        config.fleet.capacity_blocks,
        config.fleet.block_size,
        config.fleet.time_scale,
        config.trace.len(),
        config.policies.iter().map(|p| p.as_str()).collect::<Vec<_>>().join(", ")
    );
    // An agent refuses a prompt its cache cannot hold whole while it runs (400).
    let longest =
        kvroute_replica_agent::cache::BlockCache::new(&config.fleet.agent(0).cache())?.longest_prompt();
    let too_long = config.trace.requests.iter().filter(|r| r.input_len > longest).count();
    if too_long > 0 {
        eprintln!(
            "demo: {too_long} requests have prompts longer than an agent's cache holds ({longest} tokens): \
             they will be refused and left out of the comparison; raise --capacity-blocks to serve them"
        );
    }
    let started = Instant::now();
    let report = block_on(|shutdown| async move { demo::run(&config, shutdown).await })?;
    print_compare(&report, &args.out, started);
    served_something(&report)
}

/// Fails when a run had every request fail: its row compares nothing (the table says why, in
/// its errors column).
fn served_something(report: &CompareReport) -> anyhow::Result<()> {
    let nothing = report.served_nothing();
    anyhow::ensure!(
        nothing.is_empty(),
        "every request of the {} run(s) failed: see the errors column",
        nothing.iter().map(|p| p.as_str()).collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

fn print_compare(report: &CompareReport, out: &Path, started: Instant) {
    println!();
    print!("{}", report.table());
    println!();
    println!(
        "report: {}/report.json, table.txt and hit_rate_over_time.svg, ttft_cdf.svg, tokens_per_replica.svg ({:.0} s)",
        out.display(),
        started.elapsed().as_secs_f64()
    );
}

/// A few lines about one live run.
pub fn live_summary(r: &LiveReport) -> String {
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v));
    let ms = |p: Option<live::Percentiles>| {
        p.map_or("-".into(), |p| format!("p50 {:.1} ms, p99 {:.1} ms", p.p50_ms, p.p99_ms))
    };
    let mut out = format!(
        "{} requests to {}: {} succeeded, {} failed {:?}\n",
        r.requests,
        r.target,
        r.succeeded,
        r.failed(),
        r.errors
    );
    out += &format!(
        "throughput {:.2} req/s, {:.0} output tokens/s over {:.1} s\n",
        r.throughput_rps, r.output_tokens_per_s, r.duration_s
    );
    out += &format!(
        "from the send ({} successful requests): TTFT {}; time per output token {}; end-to-end {}\n",
        r.e2e.map_or(0, |p| p.count),
        ms(r.ttft),
        ms(r.time_per_output_token),
        ms(r.e2e)
    );
    if let Some(late) = r.send_lateness {
        out += &format!(
            "from the schedule: sent late {}; TTFT {}; end-to-end {}\n",
            ms(Some(late)),
            ms(r.ttft_from_intended),
            ms(r.e2e_from_intended)
        );
    }
    let fleet = match r.replicas_unread {
        0 => pct(r.fleet_hit_rate),
        n => format!("- ({n} replicas unread)"),
    };
    let responses = match r.unreported {
        0 => pct(r.hit_rate),
        n => format!("{} ({n} successes reported no cached_tokens)", pct(r.hit_rate)),
    };
    out += &format!(
        "hit rate: responses {responses}, fleet counters {fleet}, router predicted {}; load skew {}\n",
        pct(r.predicted_hit_rate),
        r.load_skew.map_or("-".into(), |s| format!("{s:.2}"))
    );
    out
}

/// Runs `work` on a multi-threaded runtime; Ctrl-C cancels its token.
pub(crate) fn block_on<T, F>(work: impl FnOnce(CancellationToken) -> F) -> anyhow::Result<T>
where
    F: std::future::Future<Output = anyhow::Result<T>>,
{
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        let on_signal = shutdown.clone();
        // SIGTERM too: a soak's processes are stopped (dropped) on the way out. A second
        // signal exits at once (tokio keeps its handler installed: without this, every later
        // one would be ignored).
        let signals = tokio::spawn(async move {
            kvroute_proto::process::next_signal().await;
            eprintln!("interrupted: stopping the run (again to exit at once)");
            on_signal.cancel();
            kvroute_proto::process::next_signal().await;
            eprintln!("interrupted again: exiting without waiting");
            crate::soak::procs::kill_all();
            std::process::exit(130);
        });
        let result = work(shutdown).await;
        signals.abort();
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An API key becomes a sensitive `Bearer` value that no `Debug` output shows; one that
    /// cannot be sent (empty, spaces, control characters) is refused with a message.
    #[test]
    fn an_api_key_is_sent_as_a_hidden_bearer() {
        let value = bearer("sk-secret").unwrap();
        assert_eq!(value.to_str().unwrap(), "Bearer sk-secret");
        assert!(!format!("{value:?}").contains("sk-secret"));
        for bad in ["", "sk secret", "sk-\n"] {
            assert!(bearer(bad).unwrap_err().contains("API key"), "{bad:?}");
        }
    }
}
