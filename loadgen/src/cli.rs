//! The `kvroute-loadgen` command line: `simulate` (the offline simulator), `generate` (write a
//! synthetic workload as a Mooncake trace), `live`, `compare`, `demo` and `soak`.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use kvroute_replica_agent::cache::{self, S3FifoParams};
use kvroute_replica_agent::engine::TimingModel;
use kvroute_router::policy::{self, CacheAwareParams};

use crate::sim::{self, BlockIdentity, EngineModel, SimConfig, SimReport};
use crate::workload::synth::Workload;
use crate::workload::{TRACE_BLOCK_SIZE, mooncake};

/// kvroute's load generator.
#[derive(Debug, Parser)]
#[command(name = "kvroute-loadgen", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay a trace offline through N block caches under a routing policy, beside the pooled
    /// reference (one cache of the fleet's total capacity; separate caches can beat it).
    Simulate(SimulateArgs),
    /// Generate a synthetic workload and write it as a Mooncake trace.
    Generate(GenerateArgs),
    /// Send a workload live to a router or a replica, and measure it.
    Live(crate::commands::LiveArgs),
    /// Run a workload live once per routing policy against a fleet, and write one report.
    Compare(crate::commands::CompareArgs),
    /// Start an embedded fleet and compare routing policies on it (the README's command).
    Demo(crate::commands::DemoArgs),
    /// A long steady run against router and agent processes with replica churn, reporting
    /// the router's memory over time, errors and the hit rate.
    Soak(crate::soak::command::SoakArgs),
}

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Mooncake JSONL trace to replay.
    #[arg(long)]
    pub trace: PathBuf,
    /// Eviction policy of every cache.
    #[arg(long, value_enum, default_value_t = cache::PolicyKind::Lru)]
    pub policy: cache::PolicyKind,
    /// Cache capacity of each replica, in blocks.
    #[arg(long)]
    pub capacity: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = TRACE_BLOCK_SIZE)]
    pub block_size: usize,
    /// Replicas in the fleet.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// The router's routing policy.
    #[arg(long, value_enum, default_value_t = policy::PolicyKind::CacheAware)]
    pub routing: policy::PolicyKind,
    /// Replay arrivals this many times faster than the trace's timestamps (milliseconds),
    /// against an unscaled engine model: a higher load. (A live run at `--time-scale T`
    /// scales both the trace and the replicas, so it corresponds to `--speedup 1`.)
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// `cache-aware`: cost of one in-flight request, in prefill tokens.
    #[arg(long, default_value_t = CacheAwareParams::default().in_flight_tokens)]
    pub in_flight_tokens: f64,
    /// Seed of randomised routing policies.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How blocks are named: the trace's hash ids (seed 000; block size 512 only, as each id
    /// names 512 tokens) or chained hashes of the tokens; `auto` uses hash ids at block size
    /// 512.
    #[arg(long, value_enum, default_value_t = BlockIdentity::Auto)]
    pub blocks: BlockIdentity,
    /// Skip the engine model: no latencies, and no load but the router's own count of the
    /// prompt tokens it sent each replica lately (cache-aware weighs it, by arrival time).
    #[arg(long)]
    pub no_engine: bool,
    /// The router follows no KV events: it routes on a prediction of each replica's cache
    /// (an LRU of the requests it sent there), while hits are the true caches'.
    #[arg(long)]
    pub without_events: bool,
    /// Sequences a replica runs at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Tokens per engine step.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    #[command(flatten)]
    pub s3fifo: S3FifoArgs,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write per-request `{hit_tokens, prompt_tokens}` as a JSON array here.
    #[arg(long)]
    pub per_request: Option<PathBuf>,
}

/// S3FIFO's knobs, as the agents' flags of the same names set them.
#[derive(Debug, Args)]
pub struct S3FifoArgs {
    /// S3FIFO: share of the capacity given to the small queue.
    #[arg(long, default_value_t = S3FifoParams::default().small_ratio)]
    pub s3fifo_small_ratio: f64,
    /// S3FIFO: saturation of the access counter.
    #[arg(long, default_value_t = S3FifoParams::default().max_freq)]
    pub s3fifo_max_freq: u8,
}

impl S3FifoArgs {
    pub fn params(&self) -> S3FifoParams {
        S3FifoParams { small_ratio: self.s3fifo_small_ratio, max_freq: self.s3fifo_max_freq }
    }
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Where to write the trace (standard output if absent).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(subcommand)]
    pub workload: Workload,
}

impl SimulateArgs {
    /// The simulator configuration these flags describe.
    pub fn config(&self) -> SimConfig {
        SimConfig {
            replicas: self.replicas,
            capacity_blocks: self.capacity,
            block_size: self.block_size,
            eviction: self.policy,
            s3fifo: self.s3fifo.params(),
            routing: self.routing,
            cache_aware: CacheAwareParams {
                in_flight_tokens: self.in_flight_tokens,
                ..CacheAwareParams::default()
            },
            seed: self.seed,
            blocks: self.blocks,
            speedup: self.speedup,
            engine: (!self.no_engine).then(|| EngineModel {
                timing: TimingModel::default(),
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
            }),
            predicted: self.without_events,
        }
    }
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Simulate(args) => run_simulate(&args),
        Command::Generate(args) => run_generate(&args),
        Command::Live(args) => crate::commands::run_live(&args),
        Command::Compare(args) => crate::commands::run_compare(&args),
        Command::Demo(args) => crate::commands::run_demo(&args),
        Command::Soak(args) => crate::soak::command::run(&args),
    }
}

fn run_simulate(args: &SimulateArgs) -> anyhow::Result<()> {
    let trace = mooncake::read_file(&args.trace)?;
    let report = sim::simulate(&trace, &args.config()).context("simulating")?;
    print!("{}", seed000_lines(&report));
    println!();
    print!("{}", report.table());
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    if let Some(path) = &args.per_request {
        write_json(path, &report.per_request)?;
    }
    Ok(())
}

/// Seed 000's four result lines.
pub fn seed000_lines(report: &SimReport) -> String {
    format!(
        "total_hit_tokens: {}\ntotal_prompt_tokens: {}\noverall_hit_rate: {}\nfinal_cache_blocks: {}\n",
        report.total_hit_tokens,
        report.total_prompt_tokens,
        report.overall_hit_rate,
        report.final_cache_blocks
    )
}

fn run_generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let trace = args.workload.generate().context("generating the workload")?;
    match &args.out {
        Some(path) => {
            let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
            mooncake::write(&trace, BufWriter::new(file))
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!(
                "wrote {} requests ({} prompt tokens) to {}",
                trace.len(),
                trace.prompt_tokens(),
                path.display()
            );
        }
        None => mooncake::write(&trace, io::stdout().lock()).context("writing the trace")?,
    }
    Ok(())
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = BufWriter::new(file);
    serde_json::to_writer_pretty(&mut out, value).with_context(|| format!("writing {}", path.display()))?;
    out.write_all(b"\n").and_then(|()| out.flush()).with_context(|| format!("writing {}", path.display()))
}
