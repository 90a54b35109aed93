//! Cache-aware routing: send a request where its first token will come soonest.
//!
//! # Cost (lower is better), in prefill-token units
//!
//! ```text
//! cost(r) = (prompt_tokens - cached_tokens(r))      work this request adds on r
//!         + pending_prefill_tokens(r)               work already queued ahead of it on r
//!         + in_flight_tokens * in_flight(r)         decode load slowing every step on r
//! cached_tokens(r) = min(overlap_blocks(r) * block_size, prompt_tokens)
//! ```
//!
//! A long cached prefix lowers the first term, but queued prefill work on the same replica
//! raises the second: when every request shares a system prompt (so every replica caches
//! it), the first term is equal everywhere and load decides, so a common first block cannot
//! collapse the fleet onto one replica. A request whose prefix nobody holds goes to the
//! least-loaded replica, which spreads new prefixes across the fleet.
//!
//! Replicas whose stream is `FALLBACK` report no overlap (the router routes them on load
//! alone). Ties go to the replica with the highest rendezvous hash of the request's key (its
//! last full block), so distinct prompts reaching an idle fleet spread evenly over it.
//!
//! # Parameters
//! - `in_flight_tokens` (default 64): what one in-flight request costs, in prefill tokens.
//!   With the replica agent's default timing (70 µs per prefill token, 60 µs per running
//!   sequence per decode step), a running sequence slows a waiting request's prefill steps
//!   by roughly a token's worth per step, over tens of steps of a typical prefill.

use serde::{Deserialize, Serialize};

use super::{Decision, Policy, PolicyKind, ReplicaView, RequestView, argmin};
use kvroute_proto::hit_tokens;

/// Knobs of the cache-aware cost.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case")]
pub struct CacheAwareParams {
    /// Cost of one in-flight request, in prefill-token units.
    pub in_flight_tokens: f64,
}

impl Default for CacheAwareParams {
    fn default() -> Self {
        Self { in_flight_tokens: 64.0 }
    }
}

#[derive(Debug, Default)]
pub struct CacheAware {
    params: CacheAwareParams,
}

impl CacheAware {
    pub fn new(params: CacheAwareParams) -> Self {
        Self { params }
    }

    /// The cost of sending `request` to `r`.
    pub fn cost(&self, request: &RequestView, r: &ReplicaView) -> f64 {
        let cached = hit_tokens(r.overlap_blocks, request.block_size, request.prompt_tokens);
        let new_work = request.prompt_tokens.saturating_sub(cached) as f64;
        new_work
            + r.load.pending_prefill_tokens as f64
            + self.params.in_flight_tokens * f64::from(r.load.in_flight)
    }
}

impl Policy for CacheAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }

    fn choose(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision {
        argmin(replicas, Some(request.key), |r| self.cost(request, r))
    }
}
