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
use super::{Request, Trace, after_poisson_gap};

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

/// Why a synthetic workload cannot be generated.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum SynthError {
    #[error("the Zipf exponent (--zipf) must be a finite number of at least 0, got {0}")]
    Zipf(f64),
    #[error("{name} must be a positive number per second (inf: all at once), got {value}")]
    Rate { name: &'static str, value: f64 },
    #[error(
        "the arrivals run past the longest time a trace can hold: raise the rates or shorten the think time"
    )]
    TooLong,
    #[error("{name} must be at most {MAX_MEAN_TOKENS} tokens, got {value}")]
    Tokens { name: &'static str, value: usize },
    #[error("{low} ({low_value}) must be at most {high} ({high_value})")]
    Order { low: &'static str, low_value: usize, high: &'static str, high_value: usize },
    #[error("{0} must be at least 1")]
    Zero(&'static str),
}

/// The longest mean length of a generated part (a system prompt, a message, a document, an
/// output), in tokens: past it, lengths overflow and prompts take terabytes.
pub const MAX_MEAN_TOKENS: usize = 1 << 24;

/// Every mean length in `flags` within [`MAX_MEAN_TOKENS`], or the first that is not.
fn check_tokens(flags: &[(&'static str, usize)]) -> Result<(), SynthError> {
    match flags.iter().find(|(_, value)| *value > MAX_MEAN_TOKENS) {
        Some(&(name, value)) => Err(SynthError::Tokens { name, value }),
        None => Ok(()),
    }
}

/// Every count in `flags` at least 1, or the first that is not (it was read as 1 before: a
/// workload other than the one asked for, without a word).
fn check_counts(flags: &[(&'static str, usize)]) -> Result<(), SynthError> {
    match flags.iter().find(|(_, value)| *value == 0) {
        Some(&(name, _)) => Err(SynthError::Zero(name)),
        None => Ok(()),
    }
}

/// `low <= high`, or which flags contradict each other.
fn check_order(low: (&'static str, usize), high: (&'static str, usize)) -> Result<(), SynthError> {
    match low.1 <= high.1 {
        true => Ok(()),
        false => Err(SynthError::Order { low: low.0, low_value: low.1, high: high.0, high_value: high.1 }),
    }
}

/// `value` if it can pace a Poisson process: positive, infinite for all at once (zero, a
/// negative or NaN would put every arrival at 0 or nowhere).
fn check_rate(name: &'static str, value: f64) -> Result<f64, SynthError> {
    if value > 0.0 { Ok(value) } else { Err(SynthError::Rate { name, value }) }
}

impl Workload {
    /// Generates the workload's trace, or says which parameter makes that impossible.
    pub fn generate(&self) -> Result<Trace, SynthError> {
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

    /// [`after_poisson_gap`] with a rate [`check_rate`] passed.
    fn after_gap(&mut self, at: Duration, rate_per_s: f64) -> Result<Duration, SynthError> {
        after_poisson_gap(&mut self.rng, at, rate_per_s).ok_or(SynthError::TooLong)
    }

    /// `at` plus an exponential duration with mean `mean`.
    fn after_exp(&mut self, at: Duration, mean: Duration) -> Result<Duration, SynthError> {
        let u: f64 = self.rng.random();
        Self::after(at, mean.as_secs_f64() * -(1.0 - u).ln())
    }

    /// `at + secs`, unless that is past what a [`Duration`] holds.
    fn after(at: Duration, secs: f64) -> Result<Duration, SynthError> {
        let gap = Duration::try_from_secs_f64(secs).map_err(|_| SynthError::TooLong)?;
        at.checked_add(gap).ok_or(SynthError::TooLong)
    }

    fn push(&mut self, arrival: Duration, segments: &[Segment], output_len: usize) {
        let (hash_ids, input_len) = self.ids.assign(segments);
        let output_len = u32::try_from(output_len).unwrap_or(u32::MAX);
        self.requests.push(Request { arrival, input_len, output_len, hash_ids, segments: segments.to_vec() });
    }

    fn finish(self) -> Trace {
        Trace::new(self.requests)
    }
}

/// Zipf(`s`) over ranks `0..n`: rank `k` has weight `1 / (k + 1)^s`.
struct Zipf {
    /// Cumulative weights: rank `k` owns `[cdf[k - 1], cdf[k])` (`[0, cdf[0])` for rank 0).
    cdf: Vec<f64>,
}

impl Zipf {
    /// `s` must be finite and at least 0: every weight is then in `[0, 1]`, rank 0's is 1.
    fn new(n: usize, s: f64) -> Result<Self, SynthError> {
        if !(s.is_finite() && s >= 0.0) {
            return Err(SynthError::Zipf(s));
        }
        let mut acc = 0.0;
        let cdf = (0..n)
            .map(|k| {
                acc += 1.0 / ((k + 1) as f64).powf(s);
                acc
            })
            .collect();
        Ok(Self { cdf })
    }

    /// Where rank `k`'s share of the cumulative weight starts.
    fn start(&self, k: usize) -> f64 {
        k.checked_sub(1).map_or(0.0, |i| self.cdf[i])
    }

    /// `k` distinct ranks (all of them if `k >= n`), in draw order: each draw is by Zipf
    /// weight among the ranks not drawn yet, so it always ends (drawing with replacement
    /// and skipping repeats never does once the weight left rounds to nothing, as with a
    /// large `s`). Picking `u` in the weight left, it steps over the drawn ranks' shares;
    /// with no weight left (or rounding onto a drawn rank) it takes the next undrawn rank
    /// in popularity order.
    fn draw_distinct(&self, k: usize, rng: &mut StdRng) -> Vec<usize> {
        let n = self.cdf.len();
        let total = self.cdf.last().copied().unwrap_or(0.0);
        let mut drawn = Vec::with_capacity(k.min(n));
        let mut ascending: Vec<usize> = Vec::with_capacity(k.min(n));
        let mut taken = 0.0;
        while drawn.len() < k.min(n) {
            let left = total - taken;
            let u: f64 = rng.random();
            let rank = if left > 0.0 {
                let mut x = u * left;
                for &d in &ascending {
                    if x >= self.start(d) {
                        x += self.cdf[d] - self.start(d);
                    }
                }
                self.cdf.partition_point(|&c| c <= x).min(n - 1)
            } else {
                0
            };
            let rank = (rank..n)
                .chain((0..rank).rev())
                .find(|r| ascending.binary_search(r).is_err())
                .expect("fewer ranks drawn than there are");
            let at = ascending.binary_search(&rank).unwrap_err();
            ascending.insert(at, rank);
            taken += self.cdf[rank] - self.start(rank);
            drawn.push(rank);
        }
        drawn
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
            let a = w.generate().unwrap();
            assert_eq!(a, w.generate().unwrap());
            let mut other = w.clone();
            match &mut other {
                Workload::Chat(p) => p.seed += 1,
                Workload::Rag(p) => p.seed += 1,
                Workload::Batch(p) => p.seed += 1,
            }
            assert_ne!(a, other.generate().unwrap());
        }
    }

    #[test]
    fn traces_are_well_formed_and_survive_mooncake_round_trip() {
        for w in all() {
            let trace = w.generate().unwrap();
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

    /// A conversation's next turn re-sends the history token for token, the part of its last
    /// content block that was partial included (the block's id changed as it filled).
    #[test]
    fn a_next_turn_starts_with_the_previous_prompt() {
        let chat = ChatParams { conversations: 1, min_turns: 3, max_turns: 3, ..ChatParams::default() };
        let trace = Workload::Chat(chat).generate().unwrap();
        assert_eq!(trace.len(), 3);
        for pair in trace.requests.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert_ne!(a.input_len % super::super::TRACE_BLOCK_SIZE, 0, "a partial last block");
            assert_ne!(a.hash_ids.last(), b.hash_ids.get(a.hash_ids.len() - 1), "filled, renamed");
            assert_eq!(b.prompt()[..a.input_len], a.prompt()[..]);
        }
    }

    #[test]
    fn zipf_prefers_low_ranks() {
        let z = Zipf::new(100, 1.0).unwrap();
        let mut rng = StdRng::seed_from_u64(1);
        let mut counts = [0u32; 100];
        for _ in 0..10_000 {
            counts[z.draw_distinct(1, &mut rng)[0]] += 1;
        }
        assert!(counts[0] > counts[9] && counts[9] > counts[99]);
    }

    #[test]
    fn a_later_draw_is_by_weight_among_the_ranks_left() {
        // Weights 1, 1/2, 1/3: the first draw is 0 with probability 6/11, and then the second
        // is 1 with probability (1/2) / (1/2 + 1/3) = 3/5.
        let z = Zipf::new(3, 1.0).unwrap();
        let mut rng = StdRng::seed_from_u64(2);
        let draws = 50_000;
        let pairs = (0..draws).filter(|_| z.draw_distinct(2, &mut rng) == [0, 1]).count();
        let expected = 6.0 / 11.0 * 3.0 / 5.0;
        assert!((pairs as f64 / draws as f64 - expected).abs() < 0.01, "{pairs} of {draws}");
    }

    /// Regression: drawing with replacement and skipping repeats never ended once the weight
    /// left rounded to nothing (a large exponent).
    #[test]
    fn distinct_draws_end_for_any_exponent() {
        let mut rng = StdRng::seed_from_u64(3);
        for s in [0.0, 1.1, 60.0, 400.0, 1e6, f64::MAX] {
            for n in [1, 3, 50] {
                let z = Zipf::new(n, s).unwrap();
                let mut drawn = z.draw_distinct(n + 1, &mut rng);
                assert_eq!(drawn.len(), n, "s {s}");
                if s >= 400.0 {
                    // All the weight is on rank 0; then popularity order.
                    assert!(drawn.iter().copied().eq(0..n), "s {s}: {drawn:?}");
                }
                drawn.sort_unstable();
                assert!(drawn.iter().copied().eq(0..n), "s {s}: {drawn:?}");
            }
        }
    }

    /// Regression: a zero, negative or NaN rate gave every gap as 0 (all arrivals at once),
    /// and so did one so small its gaps overflowed.
    #[test]
    fn bad_rates_are_refused_and_overflowing_arrivals_are_errors() {
        let chat = |rate| {
            Workload::Chat(ChatParams { conversations: 5, conversation_rate: rate, ..ChatParams::default() })
        };
        let rag = |rate| Workload::Rag(RagParams { requests: 5, rate, ..RagParams::default() });
        let jobs = |rate| Workload::Batch(BatchParams { jobs: 2, job_rate: rate, ..BatchParams::default() });
        let items =
            |rate| Workload::Batch(BatchParams { jobs: 2, item_rate: rate, ..BatchParams::default() });
        for make in [chat, rag, jobs, items] {
            for rate in [0.0, -1.0, f64::NAN] {
                assert!(matches!(make(rate).generate(), Err(SynthError::Rate { .. })), "{:?}", make(rate));
            }
            assert!(matches!(make(1e-300).generate(), Err(SynthError::TooLong)), "{:?}", make(1e-300));
            // An infinite rate is all at once.
            let trace = make(f64::INFINITY).generate().unwrap();
            assert!(!trace.is_empty());
        }
        let chat =
            ChatParams { conversations: 5, min_turns: 3, think_time: Duration::MAX, ..ChatParams::default() };
        assert_eq!(chat.generate(), Err(SynthError::TooLong));
    }

    /// Contradictory bounds are refused, not quietly bent (five turns every time for
    /// `--min-turns 5 --max-turns 3`).
    #[test]
    fn contradictory_bounds_are_refused() {
        let chat = ChatParams { min_turns: 5, max_turns: 3, ..ChatParams::default() };
        assert!(matches!(chat.generate(), Err(SynthError::Order { low: "--min-turns", .. })));
        let rag = RagParams { docs_per_query: 10, documents: 3, ..RagParams::default() };
        assert!(matches!(rag.generate(), Err(SynthError::Order { low: "--docs-per-query", .. })));
    }

    /// A count of 0 is refused: it was read as 1, a workload other than the one asked for.
    #[test]
    fn zero_counts_are_refused() {
        let chat = ChatParams { system_prompts: 0, ..ChatParams::default() };
        assert_eq!(chat.generate(), Err(SynthError::Zero("--system-prompts")));
        let chat = ChatParams { min_turns: 0, ..ChatParams::default() };
        assert_eq!(chat.generate(), Err(SynthError::Zero("--min-turns")));
        let rag = RagParams { documents: 0, docs_per_query: 0, ..RagParams::default() };
        assert_eq!(rag.generate(), Err(SynthError::Zero("--documents")));
    }

    /// Lengths past what a prompt can be are refused (`mean + mean / 2` overflowed, and a
    /// trillion-token mean asked for terabytes).
    #[test]
    fn lengths_past_a_prompts_are_refused() {
        let chat = ChatParams { user_tokens: usize::MAX, ..ChatParams::default() };
        assert_eq!(chat.generate(), Err(SynthError::Tokens { name: "--user-tokens", value: usize::MAX }));
        let rag = RagParams { doc_tokens: MAX_MEAN_TOKENS + 1, ..RagParams::default() };
        assert!(matches!(rag.generate(), Err(SynthError::Tokens { name: "--doc-tokens", .. })));
        let batch = BatchParams { output_tokens: 1 << 40, ..BatchParams::default() };
        assert!(matches!(batch.generate(), Err(SynthError::Tokens { name: "--output-tokens", .. })));
    }

    #[test]
    fn a_bad_zipf_exponent_is_refused() {
        for s in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.5] {
            let rag = Workload::Rag(RagParams { requests: 10, zipf: s, ..RagParams::default() });
            assert!(matches!(rag.generate(), Err(SynthError::Zipf(_))), "zipf {s}");
        }
    }

    #[test]
    fn defaults_come_from_the_clap_attributes() {
        let chat = ChatParams::default();
        assert_eq!((chat.conversations, chat.think_time), (200, Duration::from_secs(20)));
        let rag = RagParams::default();
        assert_eq!((rag.requests, rag.documents, rag.zipf), (2000, 200, 1.1));
        assert_eq!((BatchParams::default().jobs, BatchParams::default().requests_per_job), (10, 200));
    }
}
