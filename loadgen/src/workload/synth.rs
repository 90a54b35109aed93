//! Seeded synthetic workloads, each a [`Trace`] that can be written as a Mooncake trace:
//!
//! - [`ChatParams`]: multi-turn chat; conversations grow turn by turn behind a few shared
//!   system prompts.
//! - [`RagParams`]: retrieval-augmented queries; a shared system prompt, then a few documents
//!   drawn from a shared pool with Zipf popularity, then the question.
//! - [`BatchParams`]: batch jobs; every request of a job starts with the job's instruction.
//!
//! Common rules: arrivals are Poisson processes; a length with mean `m` is uniform on
//! `[m/2, 3m/2]` (at least 1); every piece of new text is a fresh [`Segment`], and the shared
//! ones (system prompts, documents, instructions) keep their segment across requests, so
//! [`BlockIds`] gives them shared blocks exactly behind identical prefixes. The same
//! parameters and seed give the same trace.

mod batch;
mod chat;
mod rag;

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

pub use batch::BatchParams;
pub use chat::ChatParams;
pub use rag::RagParams;

use super::prompt::{BlockIds, Segment};
use super::{Request, Trace};

/// A synthetic workload and its parameters.
#[derive(Clone, Debug, PartialEq, clap::Subcommand, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Workload {
    /// Multi-turn chat behind a few system prompts.
    Chat(ChatParams),
    /// Queries over a shared document pool.
    Rag(RagParams),
    /// Batch jobs with a shared instruction prefix.
    Batch(BatchParams),
}

impl Workload {
    /// Generates the workload's trace.
    pub fn generate(&self) -> Trace {
        match self {
            Workload::Chat(p) => p.generate(),
            Workload::Rag(p) => p.generate(),
            Workload::Batch(p) => p.generate(),
        }
    }
}

/// The defaults a parameter struct's clap attributes declare, so `Default` and the command
/// line never disagree.
fn clap_defaults<T: clap::Args + clap::FromArgMatches>() -> T {
    let cmd = T::augment_args(clap::Command::new("defaults").no_binary_name(true));
    let matches = cmd.get_matches_from(std::iter::empty::<String>());
    T::from_arg_matches(&matches).expect("every workload parameter has a default")
}

/// Randomness and bookkeeping shared by the generators.
struct Gen {
    rng: StdRng,
    ids: BlockIds,
    next_segment: u64,
    requests: Vec<Request>,
}

impl Gen {
    fn new(seed: u64) -> Self {
        Self { rng: StdRng::seed_from_u64(seed), ids: BlockIds::new(), next_segment: 0, requests: Vec::new() }
    }

    /// A fresh segment of `len` tokens.
    fn segment(&mut self, len: usize) -> Segment {
        let id = self.next_segment;
        self.next_segment += 1;
        Segment { id, len }
    }

    /// A length with mean `mean`: uniform on `[mean/2, 3 mean/2]`, at least 1.
    fn length(&mut self, mean: usize) -> usize {
        let lo = (mean / 2).max(1);
        let hi = (mean + mean / 2).max(lo);
        self.rng.random_range(lo..=hi)
    }

    /// An exponential gap with mean `1 / rate` seconds (zero when `rate` is infinite).
    fn gap(&mut self, rate_per_s: f64) -> Duration {
        let u: f64 = self.rng.random();
        let secs = -(1.0 - u).ln() / rate_per_s;
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO)
    }

    /// An exponential duration with mean `mean`.
    fn exp(&mut self, mean: Duration) -> Duration {
        let u: f64 = self.rng.random();
        mean.mul_f64(-(1.0 - u).ln())
    }

    fn push(&mut self, arrival: Duration, segments: &[Segment], output_len: usize) {
        let (hash_ids, input_len) = self.ids.assign(segments);
        let output_len = u32::try_from(output_len).unwrap_or(u32::MAX);
        self.requests.push(Request { arrival, input_len, output_len, hash_ids });
    }

    fn finish(self) -> Trace {
        Trace::new(self.requests)
    }
}

/// Zipf(`s`) over ranks `0..n`: rank `k` has weight `1 / (k + 1)^s`.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let cdf = (0..n)
            .map(|k| {
                acc += 1.0 / ((k + 1) as f64).powf(s);
                acc
            })
            .collect();
        Self { cdf }
    }

    fn sample(&self, rng: &mut StdRng) -> usize {
        let total = self.cdf.last().copied().unwrap_or(0.0);
        let x = rng.random::<f64>() * total;
        self.cdf.partition_point(|&c| c <= x).min(self.cdf.len().saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> [Workload; 3] {
        [
            Workload::Chat(ChatParams { conversations: 30, ..ChatParams::default() }),
            Workload::Rag(RagParams { requests: 100, ..RagParams::default() }),
            Workload::Batch(BatchParams { jobs: 3, requests_per_job: 20, ..BatchParams::default() }),
        ]
    }

    #[test]
    fn same_seed_same_trace_other_seed_other_trace() {
        for w in all() {
            let a = w.generate();
            assert_eq!(a, w.generate());
            let mut other = w.clone();
            match &mut other {
                Workload::Chat(p) => p.seed += 1,
                Workload::Rag(p) => p.seed += 1,
                Workload::Batch(p) => p.seed += 1,
            }
            assert_ne!(a, other.generate());
        }
    }

    #[test]
    fn traces_are_well_formed_and_survive_mooncake_round_trip() {
        for w in all() {
            let trace = w.generate();
            assert!(!trace.is_empty());
            for r in &trace.requests {
                assert_eq!(r.hash_ids.len(), super::super::content_blocks(r.input_len));
                assert!(r.output_len >= 1);
            }
            // Whole-millisecond arrivals read back identically.
            let mut ms = trace.clone();
            for r in &mut ms.requests {
                r.arrival = Duration::from_millis(r.arrival.as_millis() as u64);
            }
            let mut buf = Vec::new();
            super::super::mooncake::write(&ms, &mut buf).unwrap();
            assert_eq!(super::super::mooncake::read(&buf[..]).unwrap(), ms);
        }
    }

    #[test]
    fn zipf_prefers_low_ranks() {
        let z = Zipf::new(100, 1.0);
        let mut rng = StdRng::seed_from_u64(1);
        let mut counts = [0u32; 100];
        for _ in 0..10_000 {
            counts[z.sample(&mut rng)] += 1;
        }
        assert!(counts[0] > counts[9] && counts[9] > counts[99]);
    }

    #[test]
    fn defaults_come_from_the_clap_attributes() {
        assert!(ChatParams::default().conversations > 0);
        assert!(RagParams::default().documents > 0);
        assert!(BatchParams::default().jobs > 0);
    }
}
