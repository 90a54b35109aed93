//! The baselines cache-aware routing is measured against: they ignore the cache entirely.
//! - `round-robin`: the next eligible replica in turn: the one that took a request longest
//!   ago.
//! - `random`: a uniformly random eligible replica (seeded).
//! - `least-loaded`: fewest sequences (this router's in flight, each request's prompts times
//!   its `n`, and others' it was told of: [`super::Load::others`]), then fewest pending
//!   prefill tokens, then the request's key.
//! - `power-of-two`: two distinct random eligible replicas, the less loaded one wins.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use kvroute_proto::ReplicaId;
use kvroute_proto::mix::{GOLDEN, mix64};

use super::{Decision, Policy, PolicyKind, ReplicaView, RequestView, argmin, load_cost};

#[derive(Debug, Default)]
pub struct RoundRobin {
    turns: Mutex<Turns>,
}

/// When each replica last took a request, in turns.
#[derive(Clone, Debug, Default)]
struct Turns {
    now: u64,
    last: HashMap<ReplicaId, u64>,
}

impl Turns {
    /// The eligible replica whose turn is longest past (never taken first), ties in fleet
    /// order; and every eligible replica's place in that order, as its cost.
    fn next(&mut self, replicas: &[ReplicaView]) -> Decision {
        let last = |r: &ReplicaView| self.last.get(&r.id).copied().unwrap_or(0);
        let mut order: Vec<usize> = (0..replicas.len()).filter(|&i| replicas[i].eligible).collect();
        order.sort_by_key(|&i| (last(&replicas[i]), i));
        let mut costs = vec![f64::INFINITY; replicas.len()];
        for (place, &i) in order.iter().enumerate() {
            costs[i] = place as f64;
        }
        let chosen = order.first().copied();
        if let Some(i) = chosen {
            self.now += 1;
            self.last.insert(replicas[i].id, self.now);
            // Replicas that left the fleet leave it now and then (one that comes back under
            // its name, and id, counts as never chosen: it goes first, as its old turn would).
            // Those of other views (prefill and decode replicas are chosen apart) stay while
            // their turns are recent.
            if self.last.len() > 2 * replicas.len() + 16 {
                let (now, recent) = (self.now, 2 * self.last.len() as u64);
                self.last.retain(|id, last| now - *last <= recent || replicas.iter().any(|r| r.id == *id));
            }
        }
        Decision { chosen, costs }
    }
}

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }

    /// Each request goes to the eligible replica that took one longest ago. (A turn counted
    /// over each request's eligible replicas tied its place to the other requests': with
    /// base requests and an adapter's, on half the fleet, coming in turn, every adapter
    /// request went to one replica.)
    fn choose(&self, _: &RequestView, replicas: &[ReplicaView]) -> Decision {
        self.turns.lock().unwrap_or_else(PoisonError::into_inner).next(replicas)
    }

    fn peek(&self, _: &RequestView, replicas: &[ReplicaView]) -> Decision {
        self.turns.lock().unwrap_or_else(PoisonError::into_inner).clone().next(replicas)
    }
}

/// A lock-free SplitMix64 stream: reproducible for a seed, shareable across threads.
#[derive(Debug)]
struct Rng(AtomicU64);

impl Rng {
    fn next(&self) -> u64 {
        mix64(self.0.fetch_add(GOLDEN, Ordering::Relaxed).wrapping_add(GOLDEN))
    }

    fn below(&self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A copy that goes on from where this stream is.
    fn fork(&self) -> Rng {
        Rng(AtomicU64::new(self.0.load(Ordering::Relaxed)))
    }
}

#[derive(Debug)]
pub struct Random {
    rng: Rng,
}

impl Random {
    pub fn new(seed: u64) -> Self {
        Self { rng: Rng(AtomicU64::new(seed)) }
    }
}

impl Policy for Random {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }

    fn choose(&self, _: &RequestView, replicas: &[ReplicaView]) -> Decision {
        let eligible: Vec<usize> = (0..replicas.len()).filter(|&i| replicas[i].eligible).collect();
        let mut costs = vec![f64::INFINITY; replicas.len()];
        if eligible.is_empty() {
            return Decision { chosen: None, costs };
        }
        let pick = eligible[self.rng.below(eligible.len())];
        for &i in &eligible {
            costs[i] = if i == pick { 0.0 } else { 1.0 };
        }
        Decision { chosen: Some(pick), costs }
    }

    fn peek(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision {
        Random { rng: self.rng.fork() }.choose(request, replicas)
    }
}

#[derive(Debug, Default)]
pub struct LeastLoaded;

impl Policy for LeastLoaded {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLoaded
    }

    fn choose(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision {
        // Ties (an idle fleet) spread by the request, not to the first replica.
        argmin(replicas, Some(request.key), load_cost)
    }
}

#[derive(Debug)]
pub struct PowerOfTwo {
    rng: Rng,
}

impl PowerOfTwo {
    pub fn new(seed: u64) -> Self {
        Self { rng: Rng(AtomicU64::new(seed)) }
    }
}

impl Policy for PowerOfTwo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PowerOfTwo
    }

    fn choose(&self, _: &RequestView, replicas: &[ReplicaView]) -> Decision {
        let eligible: Vec<usize> = (0..replicas.len()).filter(|&i| replicas[i].eligible).collect();
        let mut costs = vec![f64::INFINITY; replicas.len()];
        let chosen = match eligible.len() {
            0 => None,
            1 => Some(eligible[0]),
            n => {
                let a = self.rng.below(n);
                let b = (a + 1 + self.rng.below(n - 1)) % n;
                let (a, b) = (eligible[a], eligible[b]);
                costs[a] = load_cost(&replicas[a]);
                costs[b] = load_cost(&replicas[b]);
                Some(if costs[b] < costs[a] { b } else { a })
            }
        };
        if let (Some(c), true) = (chosen, eligible.len() == 1) {
            costs[c] = load_cost(&replicas[c]);
        }
        Decision { chosen, costs }
    }

    fn peek(&self, request: &RequestView, replicas: &[ReplicaView]) -> Decision {
        PowerOfTwo { rng: self.rng.fork() }.choose(request, replicas)
    }
}
