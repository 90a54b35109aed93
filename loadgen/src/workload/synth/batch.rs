//! Batch jobs: jobs arrive as a Poisson process; each job has its own instruction prompt and
//! submits `requests_per_job` items, each request being the instruction followed by one item,
//! at a Poisson rate `item_rate` from the job's start. Requests of one job share the
//! instruction's full blocks.

use std::time::Duration;

use super::{Gen, SynthError, check_rate, check_tokens, clap_defaults};
use crate::workload::Trace;

/// Parameters of the batch workload.
#[derive(Clone, Debug, PartialEq, clap::Args, serde::Serialize, serde::Deserialize)]
pub struct BatchParams {
    /// Jobs in the trace.
    #[arg(long, default_value_t = 10)]
    pub jobs: usize,
    /// Requests per job.
    #[arg(long, default_value_t = 200)]
    pub requests_per_job: usize,
    /// Mean instruction length in tokens.
    #[arg(long, default_value_t = 3000)]
    pub instruction_tokens: usize,
    /// Mean item length in tokens.
    #[arg(long, default_value_t = 400)]
    pub item_tokens: usize,
    /// Mean output length in tokens.
    #[arg(long, default_value_t = 100)]
    pub output_tokens: usize,
    /// Jobs per second.
    #[arg(long, default_value_t = 0.05)]
    pub job_rate: f64,
    /// Items per second within a job.
    #[arg(long, default_value_t = 10.0)]
    pub item_rate: f64,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl Default for BatchParams {
    fn default() -> Self {
        clap_defaults()
    }
}

impl BatchParams {
    /// Generates the trace.
    pub fn generate(&self) -> Result<Trace, SynthError> {
        let job_rate = check_rate("--job-rate", self.job_rate)?;
        let item_rate = check_rate("--item-rate", self.item_rate)?;
        check_tokens(&[
            ("--instruction-tokens", self.instruction_tokens),
            ("--item-tokens", self.item_tokens),
            ("--output-tokens", self.output_tokens),
        ])?;
        let mut g = Gen::new(self.seed);
        let mut start = Duration::ZERO;
        for _ in 0..self.jobs {
            start = g.after_gap(start, job_rate)?;
            let len = g.length(self.instruction_tokens);
            let instruction = g.segment(len);
            let mut at = start;
            for _ in 0..self.requests_per_job {
                at = g.after_gap(at, item_rate)?;
                let len = g.length(self.item_tokens);
                let item = g.segment(len);
                let output = g.length(self.output_tokens);
                g.push(at, &[instruction, item], output);
            }
        }
        Ok(g.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_of_a_job_share_its_instruction() {
        let p =
            BatchParams { jobs: 2, requests_per_job: 30, instruction_tokens: 2048, ..BatchParams::default() };
        let trace = p.generate().unwrap();
        let mut firsts: Vec<u64> = trace.requests.iter().map(|r| r.hash_ids[0]).collect();
        firsts.sort_unstable();
        firsts.dedup();
        assert_eq!(firsts.len(), 2);
    }
}
