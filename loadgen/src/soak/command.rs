//! `kvroute-loadgen soak`: its flags, the default workload sized to the run, and the
//! terminal output.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::{Binaries, SoakConfig};
use crate::live::PromptFormat;
use crate::units::parse_duration;
use crate::workload::synth::{ChatParams, Workload};

/// `soak`: a long steady run against a router process and agent processes, with churn.
#[derive(Debug, Args)]
pub struct SoakArgs {
    /// Directory holding `kvroute-router` and `kvroute-agent` (default: this executable's
    /// directory, e.g. `target/release`).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Replica agents.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Requests per second (Poisson arrivals).
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// How long requests are sent (e.g. `10m`).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub duration: Duration,
    /// One replica is killed (SIGKILL) and restarted on the same ports this often, in turn.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub churn_interval: Duration,
    /// No churn: every replica stays up.
    #[arg(long)]
    pub no_churn: bool,
    /// How often the router's memory and counters are sampled.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub sample_interval: Duration,
    /// Prefix-cache capacity of each agent, in blocks (4096: a replica fills in about a
    /// minute at the default load, well within the four minutes between its restarts).
    #[arg(long, default_value_t = 4096)]
    pub capacity_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// The agents' `--time-scale` (their simulated latencies divided by it).
    #[arg(long, default_value_t = 10.0)]
    pub time_scale: f64,
    /// Most requests in flight at once.
    #[arg(long, default_value_t = 256)]
    pub max_in_flight: usize,
    /// Longest a request may take (e.g. `60s`).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Seed of the arrivals and of the default workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How prompts are written: `ids` (token ids), `text` (a word a token with the
    /// built-in tokenizer; the router tokenizes them, and its tokenizer cache fills),
    /// `messages` (chats), `responses` (the Responses API) or `generate` (SGLang's `/generate`).
    #[arg(long, value_enum, default_value_t = PromptFormat::Ids)]
    pub prompt_format: PromptFormat,
    /// A flag for the router, after the soak's own (repeat it; e.g.
    /// `--router-arg=--tokenize-cache-bytes --router-arg=8388608`).
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    pub router_args: Vec<String>,
    /// Directory for samples.csv, report.json, summary.txt, memory.svg and the processes' logs.
    #[arg(long, default_value = "reports/soak")]
    pub out: PathBuf,
    /// The workload (default: multi-turn chat behind shared system prompts, sized to the run).
    #[command(subcommand)]
    pub workload: Option<Workload>,
}

/// The highest `--rate` a soak takes: far past what a router on one machine serves.
const MAX_RATE: f64 = 100_000.0;
/// The most requests a default soak workload is generated for (held in memory, a few
/// hundred bytes each): a day at more than 100 requests/s.
const MAX_REQUESTS: f64 = 10_000_000.0;

/// The default soak workload: the demo's chat shape (eight 1k-token system prompts, 2-8
/// turns), with conversations arriving so that the trace's own request rate is `rate` and
/// 30% more requests than `rate x duration`, so the run ends by its duration.
pub fn soak_workload(rate: f64, duration: Duration, seed: u64) -> Workload {
    let (min_turns, max_turns) = (2, 8);
    let mean_turns = (min_turns + max_turns) as f64 / 2.0;
    let needed = rate * duration.as_secs_f64() * 1.3;
    Workload::Chat(ChatParams {
        conversations: (needed / mean_turns).ceil() as usize + 1,
        system_prompts: 8,
        system_prompt_tokens: 1024,
        min_turns,
        max_turns,
        user_tokens: 128,
        output_tokens: 48,
        conversation_rate: rate / mean_turns,
        think_time: Duration::from_secs(10),
        seed,
    })
}

/// Runs `soak` and prints the summary.
pub fn run(args: &SoakArgs) -> anyhow::Result<()> {
    // Before the workload is sized by it: an infinite rate overflowed, a huge one asked for
    // billions of conversations.
    anyhow::ensure!(
        args.rate.is_finite() && args.rate > 0.0 && args.rate <= MAX_RATE,
        "--rate must be above 0 and at most {MAX_RATE} requests/s, got {}",
        args.rate
    );
    let requests = args.rate * args.duration.as_secs_f64();
    anyhow::ensure!(
        args.workload.is_some() || requests <= MAX_REQUESTS,
        "--rate {} for --duration {:?} is {requests:.0} requests, more than the {MAX_REQUESTS} a soak's \
         workload is generated for; shorten the run or lower the rate",
        args.rate,
        args.duration
    );
    let exe = std::env::current_exe().context("locating this executable")?;
    let dir = match &args.bin_dir {
        Some(dir) => dir.clone(),
        None => exe.parent().context("this executable has no directory")?.to_path_buf(),
    };
    let binaries = Binaries::in_dir(&dir)?;
    for stale in binaries.older_than(&exe) {
        eprintln!(
            "warning: {} is older than this loadgen; rebuild it if its sources changed \
             (cargo build --release -p kvroute-router -p kvroute-replica-agent)",
            stale.display()
        );
    }
    let workload =
        args.workload.clone().unwrap_or_else(|| soak_workload(args.rate, args.duration, args.seed));
    let trace = workload.generate().context("generating the workload")?;
    let config = SoakConfig {
        binaries,
        replicas: args.replicas,
        rate: args.rate,
        duration: args.duration,
        churn_interval: (!args.no_churn).then_some(args.churn_interval),
        sample_interval: args.sample_interval,
        capacity_blocks: args.capacity_blocks,
        block_size: args.block_size,
        time_scale: args.time_scale,
        max_in_flight: args.max_in_flight,
        request_timeout: args.timeout,
        seed: args.seed,
        prompt: args.prompt_format,
        router_args: args.router_args.clone(),
        out_dir: args.out.clone(),
        workload: serde_json::to_string(&workload).context("describing the workload")?,
        progress: true,
    };
    eprintln!(
        "soak: {} agents x {} blocks, {} req/s for {:?}, churn {}, sampling every {:?}; {} requests available",
        config.replicas,
        config.capacity_blocks,
        config.rate,
        config.duration,
        config.churn_interval.map_or("off".into(), |d| format!("every {d:?}")),
        config.sample_interval,
        trace.len()
    );
    let started = Instant::now();
    let report =
        crate::commands::block_on(|shutdown| async move { super::run(&trace, &config, shutdown).await })?;
    println!();
    print!("{}", report.summary());
    println!(
        "\nreport: {}/samples.csv, report.json, summary.txt, memory.svg; logs in {}/logs ({:.0} s)",
        args.out.display(),
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
