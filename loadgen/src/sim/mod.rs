//! The offline simulator: replays a [`Trace`] through N in-process [`BlockCache`]s under one
//! of the router's routing policies, with no network and no clock.
//!
//! # Algorithm
//! For each request in the trace's order (a file's, as seed 000 replays it), at simulated
//! time `arrival / speedup` (never before the request listed before it,
//! [`Trace::arrivals_at`]):
//! 1. every replica's [`engine`] model runs up to that instant, so its [`Load`] is what the
//!    router would see live (requests in flight, uncached prompt tokens not yet prefilled,
//!    waiting queue, and the [`RecentTokens`] sum of prompt tokens routed to it, which the
//!    simulator keeps as the router's `Upstream` does);
//! 2. the policy ([`kvroute_router::policy::Policy`], the router's own code) gets a
//!    [`ReplicaView`] per replica: its overlap is the longest prefix of the request's blocks
//!    resident in that replica's cache (read with `contains`, nothing mutated) and its load;
//! 3. the chosen replica's cache replays the request exactly as seed 000 does
//!    ([`BlockCache::access_request`]: hit = `min(k * block_size, L)`, then every block is
//!    accessed), and its engine receives the uncached tokens as prefill work and
//!    `output_len` decode steps;
//! 4. the **pooled reference**, one cache of the fleet's total capacity `N * C` under the
//!    same eviction policy, replays the same request: what a router would get if every
//!    replica saw every other's cache. It is a reference, not an upper bound: separate
//!    caches can beat it (one kept for hot prompts is not flushed by another's scan), so a
//!    fleet can reach more than 100% of it.
//!
//! With N = 1 the result is seed 000's replay exactly (and equals the pooled reference).
//!
//! With `predicted` (`simulate --without-events`) the router follows no KV events: step 2's
//! overlaps are read from a prediction of each replica's cache, an LRU cache of its capacity
//! replaying only the requests routed there (the router's `ingest::predicted`, without its
//! TTL), while the hits of step 3 are still the true caches'. Under LRU eviction the two are
//! the same cache; under LFU or S3FIFO the prediction is wrong where their eviction differs
//! from LRU's, and the run shows what that costs.
//!
//! # Block identities
//! [`BlockIdentity::HashIds`] uses the trace's `hash_ids` as the blocks (the partial last one
//! included), as seed 000 does; [`BlockIdentity::Tokens`] materialises every prompt's tokens
//! (see [`crate::workload`]) and names its full blocks with the fleet's hash chain at the
//! configured block size, as the router and agents do live. `Auto` picks `HashIds` at the
//! trace's block size (512) and `Tokens` otherwise; `HashIds` at another block size is an
//! error (each id would count as a block of that size).
//!
//! Layout: `engine.rs` (the per-replica engine model), `report.rs` (what a run reports).

mod engine;
mod report;

use kvroute_proto::hash::tie_key;
use kvroute_proto::pb::StreamState;
use kvroute_proto::{BlockHash, CacheNamespace, ReplicaId};
use kvroute_replica_agent::cache::{self, AdmitError, BlockCache, CacheConfig, ConfigError, S3FifoParams};
use kvroute_router::policy::{self, CacheAwareParams, Load, Policy, RecentTokens, ReplicaView, RequestView};
use serde::{Deserialize, Serialize};

pub use engine::{EngineModel, Timing};
pub use report::{LatencyReport, PooledBound, ReplicaReport, RequestResult, SimReport, SimSetup};

use crate::workload::{TRACE_BLOCK_SIZE, Trace};

/// How the simulator names a request's blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BlockIdentity {
    /// `HashIds` when the block size is the trace's (512), `Tokens` otherwise.
    #[default]
    Auto,
    /// The trace's hash ids are the blocks (seed 000); only at the trace's block size (512),
    /// since each id names 512 tokens.
    HashIds,
    /// Chained hashes of the materialised prompt tokens, at the configured block size.
    Tokens,
}

impl BlockIdentity {
    /// `Auto` resolved for `block_size`.
    pub fn resolve(self, block_size: usize) -> Self {
        match self {
            BlockIdentity::Auto if block_size == TRACE_BLOCK_SIZE => BlockIdentity::HashIds,
            BlockIdentity::Auto => BlockIdentity::Tokens,
            other => other,
        }
    }
}

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Replicas in the fleet (N).
    pub replicas: usize,
    /// Cache capacity of each replica, in blocks (C); the pooled reference gets `N * C`.
    pub capacity_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Every cache's eviction policy.
    pub eviction: cache::PolicyKind,
    /// S3FIFO's parameters, when `eviction` is S3FIFO.
    pub s3fifo: S3FifoParams,
    /// The router's routing policy.
    pub routing: policy::PolicyKind,
    /// Knobs of the `cache-aware` policy.
    pub cache_aware: CacheAwareParams,
    /// Seed of randomised routing policies.
    pub seed: u64,
    pub blocks: BlockIdentity,
    /// Arrivals happen at `timestamp / speedup` (the engine model's times are not scaled):
    /// 2 replays the trace twice as fast, doubling the load.
    pub speedup: f64,
    /// The replicas' engine model; `None` skips it: no latencies, and no load but the
    /// router's own decayed count of the prompt tokens it sent each replica (which
    /// cache-aware weighs, on the arrivals' times: the speed-up still changes choices).
    pub engine: Option<EngineModel>,
    /// The router follows no KV events: it routes on an LRU prediction of each replica's cache
    /// from the requests it sent there.
    pub predicted: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            replicas: 1,
            capacity_blocks: 2048,
            block_size: TRACE_BLOCK_SIZE,
            eviction: cache::PolicyKind::Lru,
            s3fifo: S3FifoParams::default(),
            routing: policy::PolicyKind::CacheAware,
            cache_aware: CacheAwareParams::default(),
            seed: 0,
            blocks: BlockIdentity::Auto,
            speedup: 1.0,
            engine: Some(EngineModel::default()),
            predicted: false,
        }
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("the fleet needs at least one replica")]
    NoReplicas,
    #[error(
        "{0} replicas: a simulation takes at most {MAX_REPLICAS} (each is a cache, scored for every request)"
    )]
    TooManyReplicas(usize),
    #[error("the speed-up {0} is not a positive, finite number, or so small that arrivals overflow")]
    Speedup(f64),
    #[error(
        "block size {0}: the trace's hash ids name {TRACE_BLOCK_SIZE}-token blocks, so they are the \
         blocks only at block size {TRACE_BLOCK_SIZE} (use --blocks tokens or auto at other sizes)"
    )]
    HashIdsBlockSize(usize),
    #[error("{0}")]
    Engine(String),
    #[error("the trace's arrivals (at this speed-up) run past {0} s, more than a simulation runs")]
    TooLate(u64),
    #[error("the cache-aware weights must be between 0 and {max:e}, got {0:?}", max = policy::MAX_WEIGHT)]
    Weights(CacheAwareParams),
    #[error("the pooled capacity {replicas} x {capacity} blocks overflows")]
    PooledCapacity { replicas: usize, capacity: usize },
    #[error("invalid cache configuration")]
    Cache(#[from] ConfigError),
    /// More than one of the above, each found by [`check`].
    #[error("{} problems:\n  - {}", .0.len(), several(.0))]
    Several(Vec<SimError>),
    #[error("the {policy} policy chose no replica for request {request} though all were eligible")]
    NoChoice { policy: &'static str, request: usize },
    #[error("the {policy} policy chose replica index {chosen} of {replicas}")]
    BadChoice { policy: &'static str, chosen: usize, replicas: usize },
    /// Cannot happen without pins; kept rather than unwrapped.
    #[error("request {request} was refused by its cache")]
    Admit {
        request: usize,
        #[source]
        source: AdmitError,
    },
}

/// Each of `errors` on its line, with its causes (a cache error's reason is its source).
fn several(errors: &[SimError]) -> String {
    let line = |e: &SimError| {
        let mut line = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(cause) = source {
            line.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        line
    };
    errors.iter().map(line).collect::<Vec<_>>().join("\n  - ")
}

/// The latest arrival a simulation takes (about 100 years): its clock must run on past it.
const MAX_ARRIVAL: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 24 * 3600);
/// The most output tokens a request may ask of the engine model (one step each).
const MAX_OUTPUT_TOKENS: u32 = 1 << 20;

/// Namespace of the chained block hashes in [`BlockIdentity::Tokens`] mode.
const SIM_MODEL: &str = "kvroute-sim";

/// Simulates `trace` under `config`, routing with the router's policy `config.routing`.
pub fn simulate(trace: &Trace, config: &SimConfig) -> Result<SimReport, SimError> {
    let policy = policy::build(config.routing, config.cache_aware, config.seed);
    simulate_with(trace, config, policy.as_ref())
}

/// The most replicas a simulation takes: more than any fleet one router fronts, and few enough
/// that their caches fit in memory (two billion ended the process, out of memory).
pub const MAX_REPLICAS: usize = 10_000;

/// Whether [`simulate`] can run `trace` under `config`: every error it can give but a
/// policy's own misbehaviour, found without replaying anything (so a caller can check
/// before work it would otherwise lose, as `compare` does before its live runs).
pub fn check(trace: &Trace, config: &SimConfig) -> Result<(), SimError> {
    let mut problems = problems(trace, config);
    match problems.len() {
        0 => Ok(()),
        1 => Err(problems.remove(0)),
        _ => Err(SimError::Several(problems)),
    }
}

/// Every reason [`check`] finds not to run, so that one attempt shows them all.
fn problems(trace: &Trace, config: &SimConfig) -> Vec<SimError> {
    let mut problems = Vec::new();
    let n = config.replicas;
    if n == 0 {
        problems.push(SimError::NoReplicas);
    }
    if n > MAX_REPLICAS {
        problems.push(SimError::TooManyReplicas(n));
    }
    let speedup = config.speedup;
    let arrivals = (speedup.is_finite() && speedup > 0.0).then(|| trace.arrivals_at(speedup)).flatten();
    match arrivals {
        None => problems.push(SimError::Speedup(speedup)),
        // The engine model's clock runs on from the last arrival, a step per output token.
        Some(arrivals) if arrivals.last().is_some_and(|last| *last > MAX_ARRIVAL) => {
            problems.push(SimError::TooLate(MAX_ARRIVAL.as_secs()));
        }
        Some(_) => {}
    }
    // A hash id stands for 512 tokens; at another block size each would count as one block
    // of that size, in the cache's capacity and in every hit.
    if config.blocks.resolve(config.block_size) == BlockIdentity::HashIds
        && config.block_size != TRACE_BLOCK_SIZE
    {
        problems.push(SimError::HashIdsBlockSize(config.block_size));
    }
    if let Some(engine) = &config.engine {
        problems.extend(engine_problems(trace, engine, config.block_size).into_iter().map(SimError::Engine));
    }
    let p = config.cache_aware;
    if !p.by_flag().iter().all(|(_, w)| CacheAwareParams::in_range(*w)) {
        problems.push(SimError::Weights(p));
    }
    match BlockCache::new(&cache_config(config, config.capacity_blocks)) {
        Err(e) => problems.push(e.into()),
        // The pooled cache's only other problem is its size (with no replica, none is made).
        Ok(_) if n > 0 => match n.checked_mul(config.capacity_blocks) {
            None => problems.push(SimError::PooledCapacity { replicas: n, capacity: config.capacity_blocks }),
            Some(pooled) => {
                problems.extend(BlockCache::new(&cache_config(config, pooled)).err().map(SimError::from))
            }
        },
        Ok(_) => {}
    }
    problems
}

/// Why the engine model cannot run `trace` with these settings.
fn engine_problems(trace: &Trace, engine: &EngineModel, block_size: usize) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some((request, r)) =
        trace.requests.iter().enumerate().find(|(_, r)| r.output_len > MAX_OUTPUT_TOKENS)
    {
        problems.push(format!(
            "request {request} asks for {} output tokens, more than the engine model runs ({MAX_OUTPUT_TOKENS}) \
             (--no-engine replays the caches alone)",
            r.output_len
        ));
    }
    // As the agent and the router refuse them: an engine that admits nothing, or whose steps
    // prefill nothing, would never finish.
    if engine.max_num_seqs == 0 {
        problems.push("--max-num-seqs must be at least 1".into());
    }
    if engine.max_num_batched_tokens < engine.max_num_seqs {
        problems.push(format!(
            "--max-num-batched-tokens ({}) must be at least --max-num-seqs ({})",
            engine.max_num_batched_tokens, engine.max_num_seqs
        ));
    }
    if engine.max_num_batched_tokens < block_size.max(1) {
        problems.push(format!(
            "--max-num-batched-tokens ({}) must be at least the block size ({block_size})",
            engine.max_num_batched_tokens
        ));
    }
    problems
}

/// A cache of `capacity_blocks` as `config` describes every cache.
fn cache_config(config: &SimConfig, capacity_blocks: usize) -> CacheConfig {
    CacheConfig {
        capacity_blocks,
        block_size: config.block_size,
        policy: config.eviction,
        s3fifo: config.s3fifo,
    }
}

/// [`simulate`] with a given policy instance (a configured or custom one); `config.routing`
/// is ignored in favour of `policy.kind()`.
pub fn simulate_with(trace: &Trace, config: &SimConfig, policy: &dyn Policy) -> Result<SimReport, SimError> {
    check(trace, config)?;
    let n = config.replicas;
    let identity = config.blocks.resolve(config.block_size);
    let cache_config = |capacity_blocks| cache_config(config, capacity_blocks);
    let pooled_capacity = n * config.capacity_blocks;
    let mut caches = (0..n)
        .map(|_| BlockCache::new(&cache_config(config.capacity_blocks)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut pooled = BlockCache::new(&cache_config(pooled_capacity))?;
    // What a router without events predicts of each cache: an LRU of the requests it sent.
    let lru = CacheConfig { policy: cache::PolicyKind::Lru, ..cache_config(config.capacity_blocks) };
    let mut predictions =
        (0..n).filter(|_| config.predicted).map(|_| BlockCache::new(&lru)).collect::<Result<Vec<_>, _>>()?;
    let mut engines: Vec<_> = config
        .engine
        .map(|model| (0..n).map(|_| engine::ReplicaEngine::new(model)).collect())
        .unwrap_or_default();
    let namespace = CacheNamespace::new(SIM_MODEL);
    let kind = policy.kind().as_str();

    let mut recent = vec![RecentTokens::default(); n];
    let mut timings: Vec<Option<Timing>> = vec![None; trace.len()];
    let mut results = Vec::with_capacity(trace.len());
    let mut views = Vec::with_capacity(n);
    let arrivals = trace.arrivals_at(config.speedup).ok_or(SimError::Speedup(config.speedup))?;
    for (index, (request, &now)) in trace.requests.iter().zip(&arrivals).enumerate() {
        // The tie key as the router computes it: the tokens' whole chain, partial last block
        // included; in hash-id mode the last id, the partial block's when there is one.
        let (blocks, key) = match identity {
            BlockIdentity::Tokens => {
                let prompt = request.prompt();
                let blocks = namespace.chain(&prompt, config.block_size);
                let key = tie_key(namespace.root(), &blocks, &prompt, config.block_size);
                (blocks, key)
            }
            _ => {
                let blocks: Vec<BlockHash> = request.hash_ids.iter().map(|&h| BlockHash(h)).collect();
                let key = blocks.last().map_or(0, |b| b.0);
                (blocks, key)
            }
        };
        views.clear();
        for (i, cache) in caches.iter().enumerate() {
            let mut load = engines.get_mut(i).map_or(Load::default(), |e| {
                e.advance_to(now, &mut timings);
                e.load()
            });
            load.recent_prompt_tokens = recent[i].tokens(now);
            let seen = predictions.get(i).unwrap_or(cache);
            views.push(ReplicaView {
                id: ReplicaId(i as u32),
                // (A router hashes the replica's name; the replicas here have none, and their
                // ties fall as they did when routers broke them by their own numbering.)
                tie: i as u64,
                overlap_blocks: blocks.iter().take_while(|b| seen.contains(**b)).count(),
                offloaded_blocks: 0,
                load,
                stream: StreamState::Exact,
                eligible: true,
            });
        }
        // In hash-id mode `blocks` counts a partial last block, as seed 000 does.
        let view = RequestView {
            prompt_tokens: request.input_len,
            blocks: blocks.len(),
            block_size: config.block_size,
            key,
        };
        let chosen =
            policy.choose(&view, &views).chosen.ok_or(SimError::NoChoice { policy: kind, request: index })?;
        if chosen >= n {
            return Err(SimError::BadChoice { policy: kind, chosen, replicas: n });
        }
        let admit = |source| SimError::Admit { request: index, source };
        let outcome = caches[chosen].access_request(&blocks, request.input_len).map_err(admit)?;
        pooled.access_request(&blocks, request.input_len).map_err(admit)?;
        if let Some(prediction) = predictions.get_mut(chosen) {
            prediction.access_request(&blocks, request.input_len).map_err(admit)?;
        }
        recent[chosen].add(now, request.input_len as u64);
        if let Some(engine) = engines.get_mut(chosen) {
            let uncached = (request.input_len - outcome.hit_tokens) as u64;
            engine.submit(now, index, uncached, request.output_len);
        }
        results.push(RequestResult {
            replica: chosen,
            arrival: now,
            hit_tokens: outcome.hit_tokens as u64,
            prompt_tokens: request.input_len as u64,
            overlap_blocks: views[chosen].overlap_blocks,
            timing: None,
        });
    }
    for engine in &mut engines {
        engine.drain(&mut timings);
    }
    for (result, timing) in results.iter_mut().zip(timings) {
        result.timing = timing;
    }
    let steps = engines.iter().map(|e| e.steps()).sum();
    let setup = report::setup(config, identity, policy.kind());
    Ok(SimReport::new(setup, results, &caches, &pooled, steps))
}

#[cfg(test)]
mod tests;
