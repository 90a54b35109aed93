//! Data-parallel ranks behind one API server, as vLLM runs `--data-parallel-size N`: one
//! engine a rank, each with its own scheduler, prefix cache and KV event stream.
//!
//! A request goes to the rank its `X-data-parallel-rank` header names. Without one, each of
//! its engine requests (one a choice) goes where vLLM's balancer (0.14 to 0.20) would send it:
//! the rank with the fewest `waiting * 4 + running`, the lowest between equals. vLLM reads
//! those counts from its coordinator (refreshed every 100 ms, plus what the API server itself
//! has added since); here they are the engines' own gauges, read at once. (vLLM 0.33 weighs
//! its own in-flight requests and KV usage too.)

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Engine, ResetError};

/// Every rank's engine, rank 0 first; cheap to clone.
#[derive(Clone)]
pub struct Ranks(Arc<[Engine]>);

impl Ranks {
    /// The ranks in order; `engines` must not be empty.
    pub fn new(engines: Vec<Engine>) -> Self {
        assert!(!engines.is_empty(), "a replica has at least one rank");
        Ranks(engines.into())
    }

    /// Rank 0: its settings are every rank's.
    pub fn first(&self) -> &Engine {
        &self.0[0]
    }

    pub fn all(&self) -> &[Engine] {
        &self.0
    }

    /// How many ranks there are (at least one).
    pub fn count(&self) -> usize {
        self.0.len()
    }

    /// The rank a request asked for, if there is one, else the least loaded.
    pub fn pick(&self, asked: Option<u32>) -> Option<&Engine> {
        match asked {
            Some(rank) => self.0.get(rank as usize),
            None => Some(self.least_loaded()),
        }
    }

    /// vLLM's choice: the fewest `waiting * 4 + running`, the lowest rank between equals.
    fn least_loaded(&self) -> &Engine {
        let score = |engine: &&Engine| {
            let m = engine.metrics();
            m.waiting
                .load(Ordering::Relaxed)
                .saturating_mul(4)
                .saturating_add(m.running.load(Ordering::Relaxed))
        };
        self.0.iter().min_by_key(score).unwrap_or(&self.0[0])
    }

    /// Drops every rank's prefix cache, as vLLM's `/reset_prefix_cache` does; every rank is
    /// asked even when one refuses. Returns the blocks dropped, or the first refusal.
    pub async fn reset_prefix_cache(&self) -> Result<usize, ResetError> {
        let mut dropped = 0;
        let mut refused = None;
        for engine in self.0.iter() {
            match engine.reset_prefix_cache().await {
                Ok(n) => dropped += n,
                Err(e) => {
                    refused.get_or_insert(e);
                }
            }
        }
        refused.map_or(Ok(dropped), Err)
    }
}
