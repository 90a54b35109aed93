//! The latency model of a simulated replica: how long one continuous-batching step takes.
//!
//! ```text
//! step = step_base + prefill_tokens * prefill_per_token + decoding_seqs * decode_per_seq
//! wall = step / time_scale
//! ```
//!
//! Only uncached prompt tokens are prefilled, so a prefix-cache hit shortens time to first
//! token exactly as on a GPU. Defaults describe one H100 serving an 8B model with vLLM:
//! prefill is compute-bound at roughly 14 k tokens/s (2 FLOP per parameter per token at
//! ~45% of the GPU's dense BF16 peak), so 70 µs per token; a decode step reads the 16 GB of
//! weights at ~3 TB/s, about 6 ms, plus ~60 µs of KV-cache reads and sampling per running
//! sequence. These are coarse public figures, not a measurement of any one deployment; every
//! parameter is a flag. `time_scale` > 1 runs the fleet faster than real time (a load test
//! at `--time-scale 20` sees every latency divided by 20).

use std::time::Duration;

/// Parameters of the step-time model, in simulated (unscaled) time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimingModel {
    /// Fixed cost of every step (weights read, scheduling, launch).
    pub step_base: Duration,
    /// Cost per prefilled (uncached) prompt token.
    pub prefill_per_token: Duration,
    /// Extra cost per sequence in the decode phase.
    pub decode_per_seq: Duration,
    /// Simulated seconds per wall-clock second.
    pub time_scale: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            step_base: Duration::from_micros(6_000),
            prefill_per_token: Duration::from_micros(70),
            decode_per_seq: Duration::from_micros(60),
            time_scale: 1.0,
        }
    }
}

/// The longest one engine step lasts on the wall clock, whatever the time scale.
pub const MAX_WALL_STEP: Duration = Duration::from_secs(24 * 3600);

impl TimingModel {
    /// Simulated duration of a step that prefills `prefill_tokens` and decodes
    /// `decoding_seqs` sequences.
    pub fn step(&self, prefill_tokens: u64, decoding_seqs: u64) -> Duration {
        let prefill =
            self.prefill_per_token.saturating_mul(u32::try_from(prefill_tokens).unwrap_or(u32::MAX));
        let decode = self.decode_per_seq.saturating_mul(u32::try_from(decoding_seqs).unwrap_or(u32::MAX));
        self.step_base.saturating_add(prefill).saturating_add(decode)
    }

    /// Wall-clock duration of a simulated duration under `time_scale`, at most [`MAX_WALL_STEP`]
    /// (a tiny scale would overflow a `Duration`, or the clock past it).
    pub fn wall(&self, simulated: Duration) -> Duration {
        if self.time_scale > 0.0 && self.time_scale.is_finite() {
            Duration::try_from_secs_f64(simulated.as_secs_f64() / self.time_scale)
                .map_or(MAX_WALL_STEP, |wall| wall.min(MAX_WALL_STEP))
        } else {
            simulated
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_time_scale_is_capped_not_a_panic() {
        for time_scale in [1e-300, 5e-22] {
            let m = TimingModel { time_scale, ..TimingModel::default() };
            assert_eq!(m.wall(Duration::from_millis(6)), MAX_WALL_STEP);
        }
        let m = TimingModel { time_scale: 0.5, ..TimingModel::default() };
        assert_eq!(m.wall(Duration::from_millis(6)), Duration::from_millis(12));
    }

    #[test]
    fn prefill_grows_with_uncached_tokens_only_and_decode_with_batch() {
        let m = TimingModel::default();
        assert_eq!(m.step(0, 0), Duration::from_micros(6_000));
        assert_eq!(m.step(1_000, 0), Duration::from_micros(6_000 + 70_000));
        assert_eq!(m.step(0, 10), Duration::from_micros(6_000 + 600));
        assert!(m.step(2_000, 4) > m.step(1_000, 4));
        assert!(m.step(0, 64) > m.step(0, 8));
    }

    #[test]
    fn time_scale_divides_wall_time() {
        let m = TimingModel { time_scale: 20.0, ..TimingModel::default() };
        assert_eq!(m.wall(Duration::from_millis(200)), Duration::from_millis(10));
        let bad = TimingModel { time_scale: 0.0, ..TimingModel::default() };
        assert_eq!(bad.wall(Duration::from_millis(200)), Duration::from_millis(200));
    }
}
