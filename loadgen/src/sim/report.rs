//! What a simulation reports: seed 000's four totals, per-replica tokens and load skew, the
//! pooled reference beside the result, and simulated latencies; as JSON (serde) or a terminal
//! table ([`SimReport::table`]).

use std::fmt::Write as _;
use std::time::Duration;

use kvroute_replica_agent::cache::{self, BlockCache};
use kvroute_router::policy;
use serde::Serialize;

use super::{BlockIdentity, SimConfig, Timing};

/// The outcome of one simulation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimReport {
    pub setup: SimSetup,
    pub requests: usize,
    /// Seed 000's totals, over the whole fleet.
    pub total_hit_tokens: u64,
    pub total_prompt_tokens: u64,
    /// `total_hit_tokens / total_prompt_tokens` (0 for an empty trace).
    pub overall_hit_rate: f64,
    /// Resident blocks at the end, summed over replicas.
    pub final_cache_blocks: usize,
    /// Max over mean of the prompt tokens each replica received (1 = perfectly even).
    pub load_skew: f64,
    pub pooled: PooledBound,
    /// `overall_hit_rate` as a percentage of the pooled reference's (`None` when it is 0);
    /// can exceed 100, as separate caches can beat one pooled cache.
    pub pct_of_pooled: Option<f64>,
    pub per_replica: Vec<ReplicaReport>,
    /// Simulated latencies; `None` without an engine model.
    pub latency: Option<LatencyReport>,
    /// One entry per request, in trace order (left out of the JSON report; see
    /// [`RequestResult`] for the per-request file).
    #[serde(skip)]
    pub per_request: Vec<RequestResult>,
}

/// The configuration a report was produced with.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimSetup {
    pub replicas: usize,
    pub capacity_blocks: usize,
    pub block_size: usize,
    pub eviction: cache::PolicyKind,
    /// Its settings, with S3FIFO.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s3fifo: Option<cache::S3FifoParams>,
    pub routing: policy::PolicyKind,
    pub blocks: BlockIdentity,
    pub speedup: f64,
    pub engine_model: bool,
    /// The router routed on predicted caches (no KV events).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub predicted: bool,
}

/// One cache of the fleet's total capacity replaying the same trace: the pooled reference
/// (the name `PooledBound` predates knowing it is no upper bound).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PooledBound {
    pub capacity_blocks: usize,
    pub total_hit_tokens: u64,
    pub overall_hit_rate: f64,
    pub final_cache_blocks: usize,
}

/// One replica's share of the trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplicaReport {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
    pub hit_rate: f64,
    pub final_cache_blocks: usize,
}

/// Simulated latencies in milliseconds (nearest-rank percentiles).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LatencyReport {
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    /// From the first arrival until the last request finished.
    pub makespan_s: f64,
    /// Engine steps run, over all replicas.
    pub steps: u64,
}

/// What happened to one request; serialises as the per-request file's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RequestResult {
    pub hit_tokens: u64,
    pub prompt_tokens: u64,
    #[serde(skip)]
    pub replica: usize,
    /// Simulated arrival: the trace's timestamp over the speed-up, never before the request
    /// listed before it ([`crate::Trace::arrivals_at`]).
    #[serde(skip)]
    pub arrival: Duration,
    /// The chosen replica's resident prefix when the policy chose it, in blocks.
    #[serde(skip)]
    pub overlap_blocks: usize,
    #[serde(skip)]
    pub timing: Option<Timing>,
}

fn rate(hits: u64, total: u64) -> f64 {
    if total == 0 { 0.0 } else { hits as f64 / total as f64 }
}

impl SimReport {
    pub(super) fn new(
        setup: SimSetup,
        per_request: Vec<RequestResult>,
        caches: &[BlockCache],
        pooled: &BlockCache,
        steps: u64,
    ) -> Self {
        let total_hit_tokens: u64 = per_request.iter().map(|r| r.hit_tokens).sum();
        let total_prompt_tokens: u64 = per_request.iter().map(|r| r.prompt_tokens).sum();
        let per_replica: Vec<ReplicaReport> = caches
            .iter()
            .map(|c| {
                let s = c.stats();
                ReplicaReport {
                    requests: s.requests,
                    prompt_tokens: s.prompt_tokens,
                    hit_tokens: s.hit_tokens,
                    hit_rate: rate(s.hit_tokens, s.prompt_tokens),
                    final_cache_blocks: c.len(),
                }
            })
            .collect();
        let max = per_replica.iter().map(|r| r.prompt_tokens).max().unwrap_or(0);
        let mean = total_prompt_tokens as f64 / per_replica.len().max(1) as f64;
        let load_skew = if mean > 0.0 { max as f64 / mean } else { 1.0 };
        let pooled_hits = pooled.stats().hit_tokens;
        let pooled = PooledBound {
            capacity_blocks: pooled.capacity(),
            total_hit_tokens: pooled_hits,
            overall_hit_rate: rate(pooled_hits, pooled.stats().prompt_tokens),
            final_cache_blocks: pooled.len(),
        };
        let overall_hit_rate = rate(total_hit_tokens, total_prompt_tokens);
        let pct_of_pooled = (pooled.total_hit_tokens > 0)
            .then(|| 100.0 * total_hit_tokens as f64 / pooled.total_hit_tokens as f64);
        let latency = setup.engine_model.then(|| latency(&per_request, steps)).flatten();
        Self {
            setup,
            requests: per_request.len(),
            total_hit_tokens,
            total_prompt_tokens,
            overall_hit_rate,
            final_cache_blocks: per_replica.iter().map(|r| r.final_cache_blocks).sum(),
            load_skew,
            pooled,
            pct_of_pooled,
            per_replica,
            latency,
            per_request,
        }
    }

    /// The report as a terminal table.
    pub fn table(&self) -> String {
        let s = &self.setup;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} requests, {} replica(s) x {} blocks ({}), block size {}, blocks named by {}, speed-up {}",
            self.requests,
            s.replicas,
            s.capacity_blocks,
            name(&s.eviction),
            s.block_size,
            name(&s.blocks),
            s.speedup
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<22} {:>9} {:>15} {:>10} {:>10} {:>10} {:>10}",
            "", "hit rate", "hit tokens", "% pooled", "load skew", "TTFT p50", "TTFT p99"
        );
        let (p50, p99) = match &self.latency {
            Some(l) => (format!("{:.0} ms", l.ttft_p50_ms), format!("{:.0} ms", l.ttft_p99_ms)),
            None => ("-".into(), "-".into()),
        };
        let pct = self.pct_of_pooled.map_or("-".into(), |p| format!("{p:.1}%"));
        let _ = writeln!(
            out,
            "{:<22} {:>8.2}% {:>15} {:>10} {:>10.3} {:>10} {:>10}",
            match (s.replicas > 1, s.predicted) {
                (true, false) => s.routing.as_str().to_owned(),
                (true, true) => format!("{}, predicted", s.routing.as_str()),
                (false, _) => "single replica".to_owned(),
            },
            100.0 * self.overall_hit_rate,
            self.total_hit_tokens,
            pct,
            self.load_skew,
            p50,
            p99
        );
        let _ = writeln!(
            out,
            "{:<22} {:>8.2}% {:>15} {:>10} {:>10} {:>10} {:>10}",
            format!("pooled ({} blocks)", self.pooled.capacity_blocks),
            100.0 * self.pooled.overall_hit_rate,
            self.pooled.total_hit_tokens,
            "100.0%",
            "-",
            "-",
            "-"
        );
        if self.per_replica.len() > 1 {
            let _ = writeln!(out);
            let _ = writeln!(
                out,
                "{:<8} {:>9} {:>15} {:>9} {:>12}",
                "replica", "requests", "prompt tokens", "hit rate", "final blocks"
            );
            for (i, r) in self.per_replica.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{:<8} {:>9} {:>15} {:>8.2}% {:>12}",
                    i,
                    r.requests,
                    r.prompt_tokens,
                    100.0 * r.hit_rate,
                    r.final_cache_blocks
                );
            }
        }
        out
    }
}

fn latency(results: &[RequestResult], steps: u64) -> Option<LatencyReport> {
    let timings: Vec<Timing> = results.iter().filter_map(|r| r.timing).collect();
    if timings.is_empty() {
        return None;
    }
    let first = results.iter().map(|r| r.arrival).min().unwrap_or_default();
    let last = results.iter().filter_map(|r| r.timing.map(|t| r.arrival + t.e2e)).max().unwrap_or_default();
    let mut ttft: Vec<Duration> = timings.iter().map(|t| t.ttft).collect();
    let mut e2e: Vec<Duration> = timings.iter().map(|t| t.e2e).collect();
    ttft.sort_unstable();
    e2e.sort_unstable();
    let mean = ttft.iter().sum::<Duration>().as_secs_f64() * 1000.0 / ttft.len() as f64;
    Some(LatencyReport {
        ttft_p50_ms: ms(percentile(&ttft, 50.0)),
        ttft_p99_ms: ms(percentile(&ttft, 99.0)),
        ttft_mean_ms: mean,
        e2e_p50_ms: ms(percentile(&e2e, 50.0)),
        e2e_p99_ms: ms(percentile(&e2e, 99.0)),
        makespan_s: last.saturating_sub(first).as_secs_f64(),
        steps,
    })
}

/// The serde (command-line) name of a unit enum.
fn name(value: &impl Serialize) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        _ => "?".into(),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Nearest-rank percentile of sorted, non-empty `values`.
pub(super) fn percentile(values: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Builds the setup echo of `config`.
pub(super) fn setup(config: &SimConfig, blocks: BlockIdentity, routing: policy::PolicyKind) -> SimSetup {
    SimSetup {
        replicas: config.replicas,
        capacity_blocks: config.capacity_blocks,
        block_size: config.block_size,
        eviction: config.eviction,
        s3fifo: (config.eviction == cache::PolicyKind::S3fifo).then_some(config.s3fifo),
        routing,
        blocks,
        speedup: config.speedup,
        engine_model: config.engine.is_some(),
        predicted: config.predicted,
    }
}
