//! Multi-turn chat: each conversation picks one of a few system prompts, then sends a user
//! message; every later turn re-sends the whole history (system prompt, every user message and
//! assistant reply so far) plus a new message. Conversations start as a Poisson process and a
//! turn follows the previous one after an exponential think time, counted from the previous
//! turn's arrival, not its answer (open loop): a turn whose think time is shorter than its
//! predecessor's answer goes out before that history is cached (about one turn in twenty
//! comes within a twentieth of the mean think time), as a client that does not wait would.

use std::time::Duration;

use rand::RngExt;

use super::{Gen, SynthError, check_counts, check_order, check_rate, check_tokens, clap_defaults};
use crate::units::parse_duration;
use crate::workload::Trace;

/// Parameters of the chat workload.
#[derive(Clone, Debug, PartialEq, clap::Args, serde::Serialize, serde::Deserialize)]
pub struct ChatParams {
    /// Conversations in the trace.
    #[arg(long, default_value_t = 200)]
    pub conversations: usize,
    /// Distinct system prompts, each conversation using one at random.
    #[arg(long, default_value_t = 4)]
    pub system_prompts: usize,
    /// Mean length of a system prompt in tokens.
    #[arg(long, default_value_t = 2048)]
    pub system_prompt_tokens: usize,
    /// Fewest turns per conversation.
    #[arg(long, default_value_t = 2)]
    pub min_turns: usize,
    /// Most turns per conversation.
    #[arg(long, default_value_t = 10)]
    pub max_turns: usize,
    /// Mean user message length in tokens.
    #[arg(long, default_value_t = 256)]
    pub user_tokens: usize,
    /// Mean reply length in tokens (the request's output length, and the history it adds).
    #[arg(long, default_value_t = 256)]
    pub output_tokens: usize,
    /// New conversations per second.
    #[arg(long, default_value_t = 1.0)]
    pub conversation_rate: f64,
    /// Mean time between turns of a conversation (e.g. `20s`, `1500ms`).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub think_time: Duration,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl Default for ChatParams {
    fn default() -> Self {
        clap_defaults()
    }
}

impl ChatParams {
    /// Generates the trace.
    pub fn generate(&self) -> Result<Trace, SynthError> {
        let rate = check_rate("--conversation-rate", self.conversation_rate)?;
        check_counts(&[("--system-prompts", self.system_prompts), ("--min-turns", self.min_turns)])?;
        check_order(("--min-turns", self.min_turns), ("--max-turns", self.max_turns))?;
        check_tokens(&[
            ("--system-prompt-tokens", self.system_prompt_tokens),
            ("--user-tokens", self.user_tokens),
            ("--output-tokens", self.output_tokens),
        ])?;
        let mut g = Gen::new(self.seed);
        let systems: Vec<_> = (0..self.system_prompts.max(1))
            .map(|_| {
                let len = g.length(self.system_prompt_tokens);
                g.segment(len)
            })
            .collect();
        let mut start = Duration::ZERO;
        for _ in 0..self.conversations {
            start = g.after_gap(start, rate)?;
            let system = systems[g.rng.random_range(0..systems.len())];
            let turns = g.rng.random_range(self.min_turns.max(1)..=self.max_turns.max(self.min_turns).max(1));
            let mut history = vec![system];
            let mut at = start;
            for turn in 0..turns {
                if turn > 0 {
                    at = g.after_exp(at, self.think_time)?;
                }
                let user_len = g.length(self.user_tokens);
                history.push(g.segment(user_len));
                let reply = g.length(self.output_tokens);
                g.push(at, &history, reply);
                history.push(g.segment(reply));
            }
        }
        Ok(g.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_extend_their_conversation_behind_shared_system_prompts() {
        let one = ChatParams { conversations: 1, min_turns: 6, max_turns: 6, ..ChatParams::default() };
        let trace = one.generate().unwrap();
        assert_eq!(trace.len(), 6);
        for pair in trace.requests.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert!(b.input_len > a.input_len + a.output_len as usize);
            let full = a.hash_ids.len() - 1;
            assert_eq!(a.hash_ids[..full], b.hash_ids[..full], "a turn re-sends the history");
        }
        let many = ChatParams {
            conversations: 30,
            system_prompts: 2,
            system_prompt_tokens: 1024,
            ..ChatParams::default()
        };
        let firsts: std::collections::HashSet<u64> =
            many.generate().unwrap().requests.iter().map(|r| r.hash_ids[0]).collect();
        assert!(firsts.len() <= 2, "first blocks are system prompt blocks: {firsts:?}");
    }
}
