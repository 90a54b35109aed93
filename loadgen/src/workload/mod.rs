//! Workloads: what requests arrive when, and what their prompts are.
//!
//! Every workload, whether read from a Mooncake trace or generated, is a [`Trace`]: requests
//! in arrival order, each with a prompt described as a sequence of **content blocks** of
//! [`TRACE_BLOCK_SIZE`] (512) tokens, named by 64-bit ids exactly as Mooncake's `hash_ids`
//! are. Equal ids mean equal tokens, and (the Mooncake convention, which the generators
//! uphold) an id also implies the whole prefix before it, so an id names a KV block.
//!
//! A trace's request's token ids follow deterministically from its ids ([`block_tokens`]):
//! token `i` of block `h` is `TOKEN_FLOOR + xxh3_64_with_seed(i as u32 LE, seed = h) mod (VOCAB -
//! TOKEN_FLOOR)`, and the last block is cut to `input_len`. Two requests sharing ids therefore
//! share exactly those token blocks, so the fleet's own block-hash chain
//! ([`kvroute_proto::hash`]) finds the same sharing at any block size: at 512 it sees one
//! chained block per full content block; at a block size that divides 512 it sees every
//! shared content block as `512 / B` shared blocks; at any other size chained blocks straddle
//! content blocks, which is still exact (a chained block is shared iff every token before and
//! in it is) but shares less, since a block crossing into a request's own content is its own.
//!
//! A generated request also keeps the [`Segment`]s its prompt is made of (a system prompt,
//! each turn), and its tokens follow from those instead ([`segment_token`]): a conversation's
//! next turn re-sends the history token for token, its last partial content block included
//! (whose id changes once the block fills). Ids name the same sharing at 512 tokens either way;
//! below that, tokens from ids would make the re-sent tail of every earlier turn a miss. A
//! trace written by [`mooncake::write`] keeps the segments in an extra `segments` field.
//!
//! - [`mooncake`]: reading and writing Mooncake JSONL traces.
//! - [`synth`]: seeded generators for multi-turn chat, RAG and batch workloads.
//! - [`prompt`]: the builder the generators use to turn segment sequences into content
//!   block ids.

pub mod mooncake;
pub mod prompt;
pub mod synth;

use std::time::Duration;

use kvroute_proto::{BlockHash, CacheNamespace};
use rand::RngExt;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use mooncake::TraceError;
pub use prompt::Segment;

/// Tokens per content block: Mooncake traces' block size.
pub const TRACE_BLOCK_SIZE: usize = 512;

/// Vocabulary of generated token ids: valid for the builtin tokenizer (`V = 32768`).
pub const VOCAB: u32 = 32_768;

/// Generated token ids start here, above the builtin tokenizer's reserved ids.
pub const TOKEN_FLOOR: u32 = 16;

/// One request of a workload.
///
/// The prompt is kept as its content-block ids (and a generated one's segments) and
/// materialised on demand ([`Request::prompt`]): the shared trace alone is 61 M prompt
/// tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// When it arrives, from the start of the workload.
    pub arrival: Duration,
    /// Prompt length in tokens.
    pub input_len: usize,
    /// How many tokens to generate (`max_tokens`).
    pub output_len: u32,
    /// The prompt's content blocks of [`TRACE_BLOCK_SIZE`] tokens (Mooncake `hash_ids`); the
    /// last one may be partial. Exactly `ceil(input_len / 512)` of them.
    pub hash_ids: Vec<u64>,
    /// What a generated prompt is made of, `input_len` tokens in all; empty for a trace's
    /// request, whose tokens follow from its ids.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<Segment>,
}

impl Request {
    /// The prompt's token ids (`input_len` of them).
    pub fn prompt(&self) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(self.input_len);
        self.write_prompt(&mut tokens);
        tokens
    }

    /// Appends the prompt's token ids to `out`; lets a hot loop reuse one buffer.
    pub fn write_prompt(&self, out: &mut Vec<u32>) {
        if !self.segments.is_empty() {
            for s in &self.segments {
                out.extend((0..s.len).map(|offset| segment_token(s.id, offset)));
            }
            return;
        }
        let mut left = self.input_len;
        for &id in &self.hash_ids {
            let n = left.min(TRACE_BLOCK_SIZE);
            out.extend((0..n).map(|i| block_token(id, i)));
            left -= n;
        }
    }

    /// When it arrives with the workload played `speedup` times as fast; `None` when that is
    /// past what a [`Duration`] holds (a tiny speed-up). The simulator and live runs both
    /// scale arrivals with it.
    pub fn arrival_at(&self, speedup: f64) -> Option<Duration> {
        Duration::try_from_secs_f64(self.arrival.as_secs_f64() / speedup).ok()
    }

    /// The prompt's KV blocks as the fleet names them: the chained hashes of its full blocks of
    /// `block_size` tokens in `namespace`.
    pub fn chained_blocks(&self, namespace: &CacheNamespace, block_size: usize) -> Vec<BlockHash> {
        namespace.chain(&self.prompt(), block_size)
    }
}

/// `at` plus an exponential gap with mean `1 / rate_per_s` seconds drawn from `rng`: the next
/// arrival of a Poisson process of that rate (no gap when the rate is infinite). `None` when
/// that is past what a [`Duration`] holds (a tiny rate). Synthetic workloads and live Poisson
/// runs both draw their arrivals with it.
pub fn after_poisson_gap(rng: &mut StdRng, at: Duration, rate_per_s: f64) -> Option<Duration> {
    let u: f64 = rng.random();
    let gap = Duration::try_from_secs_f64(-(1.0 - u).ln() / rate_per_s).ok()?;
    at.checked_add(gap)
}

/// Token `i` of content block `id`.
#[inline]
pub fn block_token(id: u64, i: usize) -> u32 {
    let h = xxh3_64_with_seed(&(i as u32).to_le_bytes(), id);
    TOKEN_FLOOR + (h % u64::from(VOCAB - TOKEN_FLOOR)) as u32
}

/// Token `offset` of segment `id` (an 8-byte offset, so never a [`block_token`] by design).
#[inline]
pub fn segment_token(id: u64, offset: usize) -> u32 {
    let h = xxh3_64_with_seed(&(offset as u64).to_le_bytes(), id);
    TOKEN_FLOOR + (h % u64::from(VOCAB - TOKEN_FLOOR)) as u32
}

/// The full 512 tokens of content block `id`.
pub fn block_tokens(id: u64) -> Vec<u32> {
    (0..TRACE_BLOCK_SIZE).map(|i| block_token(id, i)).collect()
}

/// A workload: requests in the order they are replayed. A trace read from a file keeps the
/// file's order, which is what seed 000 replays (a timestamp plays no part there); times are
/// then read in that order ([`Trace::arrivals_at`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    pub requests: Vec<Request>,
}

impl Trace {
    /// Wraps requests, sorting them by arrival (stable, so equal arrivals keep their order):
    /// a generated workload.
    pub fn new(mut requests: Vec<Request>) -> Self {
        requests.sort_by_key(|r| r.arrival);
        Self { requests }
    }

    /// Wraps requests in the order given (a trace file's, or part of a trace).
    pub fn in_order(requests: Vec<Request>) -> Self {
        Self { requests }
    }

    /// Each request's arrival with the workload played `speedup` times as fast, in the
    /// trace's order: one listed after a later one arrives with it (time does not run
    /// backwards in a replay that keeps the order). `None` when a time is past what a
    /// [`Duration`] holds (a tiny speed-up).
    pub fn arrivals_at(&self, speedup: f64) -> Option<Vec<Duration>> {
        arrivals_at(&self.requests, speedup)
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Sum of prompt lengths.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.input_len as u64).sum()
    }

    /// From the first arrival to the last ([`Trace::arrivals_at`]).
    pub fn duration(&self) -> Duration {
        let arrivals = self.arrivals_at(1.0).unwrap_or_default();
        match (arrivals.first(), arrivals.last()) {
            (Some(first), Some(last)) => *last - *first,
            _ => Duration::ZERO,
        }
    }
}

/// [`Trace::arrivals_at`] of `requests`, in their order.
pub fn arrivals_at(requests: &[Request], speedup: f64) -> Option<Vec<Duration>> {
    let mut latest = Duration::ZERO;
    requests
        .iter()
        .map(|r| {
            latest = latest.max(r.arrival_at(speedup)?);
            Some(latest)
        })
        .collect()
}

/// `ceil(input_len / 512)`: how many content blocks a prompt has.
pub fn content_blocks(input_len: usize) -> usize {
    input_len.div_ceil(TRACE_BLOCK_SIZE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(input_len: usize, hash_ids: Vec<u64>) -> Request {
        Request { arrival: Duration::ZERO, input_len, output_len: 1, hash_ids, segments: Vec::new() }
    }

    #[test]
    fn arrivals_past_what_a_duration_holds_are_none() {
        use rand::SeedableRng;
        let mut rng = StdRng::seed_from_u64(0);
        let at = Duration::from_secs(1);
        assert_eq!(after_poisson_gap(&mut rng, at, f64::INFINITY), Some(at));
        assert!(after_poisson_gap(&mut rng, at, 1.0).is_some_and(|t| t > at));
        assert_eq!(after_poisson_gap(&mut rng, at, 1e-300), None);
        assert_eq!(after_poisson_gap(&mut rng, Duration::MAX, 1.0), None);
        let request = Request { arrival: Duration::from_secs(10), ..req(1, vec![1]) };
        assert_eq!(request.arrival_at(4.0), Some(Duration::from_millis(2500)));
        assert_eq!(request.arrival_at(1e-300), None);
    }

    #[test]
    fn shared_ids_share_exactly_those_token_blocks() {
        let a = req(1200, vec![7, 8, 9]).prompt();
        let b = req(1100, vec![7, 8, 10]).prompt();
        assert_eq!(a.len(), 1200);
        assert_eq!(b.len(), 1100);
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1100], b[1024..1100]);
        assert_eq!(a[..512], block_tokens(7)[..]);
        assert!(a.iter().all(|&t| (TOKEN_FLOOR..VOCAB).contains(&t)));
    }

    #[test]
    fn chained_blocks_follow_content_at_any_block_size() {
        let ns = CacheNamespace::new("m");
        let a = req(1536, vec![1, 2, 3]);
        let b = req(1536, vec![1, 2, 4]);
        for (bs, shared) in [(512, 2), (128, 8), (384, 2)] {
            let (ca, cb) = (a.chained_blocks(&ns, bs), b.chained_blocks(&ns, bs));
            let common = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
            assert_eq!(common, shared, "block size {bs}");
        }
        // Different first blocks never share anything, whatever follows.
        let c = req(1536, vec![5, 2, 3]);
        assert_ne!(a.chained_blocks(&ns, 512)[1], c.chained_blocks(&ns, 512)[1]);
    }

    #[test]
    fn trace_sorts_by_arrival_stably() {
        let mut r1 = req(1, vec![1]);
        r1.arrival = Duration::from_millis(5);
        let r2 = req(2, vec![2]);
        let r3 = req(3, vec![3]);
        let t = Trace::new(vec![r1.clone(), r2.clone(), r3.clone()]);
        let lens: Vec<_> = t.requests.iter().map(|r| r.input_len).collect();
        assert_eq!(lens, [2, 3, 1]);
        assert_eq!(t.duration(), Duration::from_millis(5));
        assert_eq!(t.prompt_tokens(), 6);
        // A file's order is kept; a request listed after a later one arrives with it.
        let file = Trace::in_order(vec![r2, r1, r3]);
        let lens: Vec<_> = file.requests.iter().map(|r| r.input_len).collect();
        assert_eq!(lens, [2, 1, 3]);
        let ms = |v: u64| Duration::from_millis(v);
        assert_eq!(file.arrivals_at(1.0), Some(vec![ms(0), ms(5), ms(5)]));
        assert_eq!(file.arrivals_at(0.5), Some(vec![ms(0), ms(10), ms(10)]));
        assert_eq!(file.arrivals_at(1e-300), None);
    }

    /// A trace cut from the middle of a longer one lasts from its first arrival.
    #[test]
    fn a_traces_duration_runs_from_its_first_arrival() {
        let at = |secs: u64| Request { arrival: Duration::from_secs(secs), ..req(1, vec![1]) };
        assert_eq!(Trace::in_order(vec![at(10), at(12)]).duration(), Duration::from_secs(2));
        assert_eq!(Trace::in_order(vec![at(10), at(8), at(12)]).duration(), Duration::from_secs(2));
        assert_eq!(Trace::default().duration(), Duration::ZERO);
    }
}
