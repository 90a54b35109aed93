//! Prompt tokens recently assigned to a replica, as an exponentially decayed sum: the
//! longer-run load signal that in-flight counts and pending prefill (which empty within a
//! second) miss.
//!
//! # Algorithm
//! `value(t) = sum over assignments i at t_i <= t of tokens_i * exp(-(t - t_i) / RECENT_HORIZON)`,
//! kept as one number and the time it was last brought up to date. Time is a [`Duration`]
//! since any fixed epoch: the router uses the replica's creation, the simulator the trace's
//! start.

use std::time::Duration;

/// The decay's time constant. Long enough to see which replica has had more than its share
/// over hundreds of requests; short enough that a replica which joined late or came back from
/// ejection is caught up with within minutes, instead of receiving all new work until its
/// lifetime total matches. (On the shared Mooncake trace, 60 s, 120 s and 300 s all meet the
/// balance target; 120 s had the best worst case over eviction policies and load levels.)
pub const RECENT_HORIZON: Duration = Duration::from_secs(120);

/// An exponentially decayed sum of prompt tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RecentTokens {
    value: f64,
    at: Duration,
}

impl RecentTokens {
    /// Adds `tokens` assigned at `now` (a time earlier than the last update counts as then).
    pub fn add(&mut self, now: Duration, tokens: u64) {
        self.value = self.get(now) + tokens as f64;
        self.at = self.at.max(now);
    }

    /// The decayed sum at `now`.
    pub fn get(&self, now: Duration) -> f64 {
        let elapsed = now.saturating_sub(self.at).as_secs_f64();
        self.value * (-elapsed / RECENT_HORIZON.as_secs_f64()).exp()
    }

    /// [`Self::get`] rounded to whole tokens, for [`super::Load::recent_prompt_tokens`].
    pub fn tokens(&self, now: Duration) -> u64 {
        self.get(now).round() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decays_by_e_per_horizon_and_adds_up() {
        let mut r = RecentTokens::default();
        r.add(Duration::ZERO, 1000);
        assert_eq!(r.tokens(Duration::ZERO), 1000);
        assert_eq!(r.tokens(RECENT_HORIZON), 368);
        r.add(RECENT_HORIZON, 500);
        assert_eq!(r.tokens(RECENT_HORIZON), 868);
        // A late report of an earlier time is not decayed twice.
        r.add(Duration::ZERO, 0);
        assert_eq!(r.tokens(RECENT_HORIZON), 868);
        assert_eq!(r.tokens(RECENT_HORIZON * 2), 319);
    }
}
