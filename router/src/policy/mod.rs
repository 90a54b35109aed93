//! Routing policies: given a request and a view of every replica (its cached prefix of the
//! request and its load), choose one.
//!
//! Policies are pure functions of their inputs (plus a counter or seed for the stateless
//! baselines), so the router, `Explain` and the offline simulator in `loadgen` all call the
//! same code. The router fills [`ReplicaView`]s from the prefix index and its own load
//! accounting; the simulator fills them from its in-process caches and load model.

use kvroute_proto::ReplicaId;
use kvroute_proto::pb::StreamState;
use serde::{Deserialize, Serialize};

/// Which policy routes requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Longest cached prefix weighed against load (the default).
    #[default]
    CacheAware,
    RoundRobin,
    Random,
    /// Fewest sequences (in flight, a request's prompts times its `n`, and others' reported),
    /// then fewest pending prefill tokens.
    LeastLoaded,
    /// Two random replicas, the less loaded one wins.
    PowerOfTwo,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::CacheAware,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::PowerOfTwo,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache-aware",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::PowerOfTwo => "power-of-two",
        }
    }
}

/// What a policy knows about the request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestView {
    pub prompt_tokens: usize,
    /// Full blocks of the prompt (`prompt_tokens / block_size`).
    pub blocks: usize,
    pub block_size: usize,
    /// Identifies the request's content (the router uses the chained hash of its tokens, the
    /// partial last block included): breaks
    /// ties between equally good replicas by rendezvous hashing, so distinct prompts arriving
    /// at an idle fleet spread over it deterministically instead of all going to the first.
    pub key: u64,
}

/// A replica's load as the router sees it at decision time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Sequences of the requests the router has sent to it and not yet seen finish: a
    /// request's prompts times its `n` (one for most), which is what the replica runs and
    /// reports.
    pub in_flight: u32,
    /// Prompt tokens the router has sent to it that are not known to be prefilled: the
    /// uncached part of every in-flight request whose first output has not come back, or, for
    /// a whole answer (not streamed), whose prompt's last block the replica's events have not
    /// yet stored ([`crate::proxy::upstream::PendingPrefill`] says which wait for that).
    pub pending_prefill_tokens: u64,
    /// Queue length the replica itself last reported (e.g. `num_requests_waiting`), if known.
    pub reported_waiting: u32,
    /// Prompt tokens (cached or not) the router has sent it lately: a [`RecentTokens`] sum
    /// with a [`RECENT_HORIZON`] time constant, read at decision time.
    pub recent_prompt_tokens: u64,
    /// Requests the replica reported running or waiting at its last health check beyond the
    /// ones this router had in flight on it then: other routers' and other clients' work,
    /// which this router sees no other way. (A report cannot tell whose a request is; only
    /// the excess counts, so this router's own are never counted twice.)
    pub others: u32,
}

/// This router's sequences on a replica (or a rank) as a health check begins: in flight,
/// and ever sent. A report read after it holds at most those and the ones sent since of this
/// router's own; the rest is others' work ([`Load::others`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReportMark {
    pub in_flight: u32,
    pub begun: u64,
}

impl ReportMark {
    /// Of `reported` requests (running and waiting), those beyond this router's own, when it
    /// has begun `begun_now` sequences in all by the time the report is read.
    pub fn others(&self, reported: u32, begun_now: u64) -> u32 {
        let ours = u64::from(self.in_flight).saturating_add(begun_now.saturating_sub(self.begun));
        u64::from(reported).saturating_sub(ours) as u32
    }
}

/// One candidate replica for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaView {
    pub id: ReplicaId,
    /// Breaks ties ([`rendezvous`]): the same for the replica in every router (a hash of its
    /// name, where `id` is each router's own numbering), so that routers in front of one
    /// fleet send a new prefix to the same replica.
    pub tie: u64,
    /// Leading blocks of the request the replica holds (for a `FALLBACK` stream, which tells
    /// nothing, the least of the eligible replicas with a stream:
    /// [`cache_aware::common_overlap`]).
    pub overlap_blocks: usize,
    /// Of those, the last ones the replica holds only in host memory (offloaded): it loads
    /// them rather than computes them. Part of `overlap_blocks`, never more.
    pub offloaded_blocks: usize,
    pub load: Load,
    pub stream: StreamState,
    /// False when unhealthy, ejected, draining, not serving or saturated: never chosen.
    pub eligible: bool,
}

/// A policy's answer, with the per-candidate cost that `Explain` shows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// Index into the candidate slice; `None` when no candidate is eligible.
    pub chosen: Option<usize>,
    /// Lower is better; one per candidate, `f64::INFINITY` for ineligible ones.
    pub costs: Vec<f64>,
}

/// A routing policy: the seam between the request path and the strategy.
pub trait Policy: Send + Sync {
    fn kind(&self) -> PolicyKind;
    /// Chooses for a request that will be sent; a policy with a counter or a random stream
    /// advances it.
    fn choose(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision;
    /// What [`Policy::choose`] would answer now, leaving the policy as it is (`Explain`).
    fn peek(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision {
        self.choose(request, replicas)
    }
}

mod baseline;
mod cache_aware;
mod recent;

pub use baseline::{LeastLoaded, PowerOfTwo, Random, RoundRobin};
pub use cache_aware::{CacheAware, CacheAwareParams, MAX_WEIGHT, common_overlap};
pub use recent::{RECENT_HORIZON, RecentTokens};

/// Builds the policy `kind`; `seed` drives the random ones.
pub fn build(kind: PolicyKind, params: CacheAwareParams, seed: u64) -> Box<dyn Policy> {
    match kind {
        PolicyKind::CacheAware => Box::new(CacheAware::new(params)),
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::Random => Box::new(Random::new(seed)),
        PolicyKind::LeastLoaded => Box::new(LeastLoaded),
        PolicyKind::PowerOfTwo => Box::new(PowerOfTwo::new(seed)),
    }
}

/// The index of the eligible candidate with the lowest cost, and costs with `INFINITY` for
/// ineligible candidates. Ties go to the highest `rendezvous(key, replica.tie)`, or to the
/// first candidate when `key` is `None`.
fn argmin(replicas: &[ReplicaView], key: Option<u64>, cost: impl Fn(&ReplicaView) -> f64) -> Decision {
    let costs: Vec<f64> = replicas.iter().map(|r| if r.eligible { cost(r) } else { f64::INFINITY }).collect();
    let tie = |i: usize| key.map_or(0, |k| u64::MAX - rendezvous(k, replicas[i].tie));
    let chosen = (0..replicas.len())
        .filter(|&i| replicas[i].eligible)
        .min_by(|&a, &b| costs[a].total_cmp(&costs[b]).then(tie(a).cmp(&tie(b))).then(a.cmp(&b)));
    Decision { chosen, costs }
}

/// Highest-random-weight score for `key` of the replica whose [`ReplicaView::tie`] is `tie`
/// (SplitMix64 finaliser of both).
pub fn rendezvous(key: u64, tie: u64) -> u64 {
    kvroute_proto::mix::mix64(key ^ tie.wrapping_mul(kvroute_proto::mix::GOLDEN))
}

/// A replica's load as one number: requests (in flight and others'), pending prefill as
/// tie-break.
fn load_cost(r: &ReplicaView) -> f64 {
    f64::from(r.load.in_flight) + f64::from(r.load.others) + r.load.pending_prefill_tokens as f64 * 1e-9
}

#[cfg(test)]
mod tests;
