//! Retrieval-augmented generation: every query is a shared system prompt, then
//! `docs_per_query` distinct documents drawn from a shared pool by Zipf popularity (in draw
//! order), then the question. Documents are reused across queries, but their KV blocks are
//! shared only where the whole prefix before them agrees, i.e. when the same documents were
//! retrieved first and in the same order, which is what a prefix cache can exploit.

use std::time::Duration;

use super::{Gen, SynthError, Zipf, check_counts, check_order, check_rate, check_tokens, clap_defaults};
use crate::workload::Trace;

/// Parameters of the RAG workload.
#[derive(Clone, Debug, PartialEq, clap::Args, serde::Serialize, serde::Deserialize)]
pub struct RagParams {
    /// Queries in the trace.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Documents in the pool.
    #[arg(long, default_value_t = 200)]
    pub documents: usize,
    /// Mean document length in tokens.
    #[arg(long, default_value_t = 1500)]
    pub doc_tokens: usize,
    /// Documents per query.
    #[arg(long, default_value_t = 3)]
    pub docs_per_query: usize,
    /// Zipf exponent of document popularity (0: uniform).
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// Length of the shared system prompt in tokens.
    #[arg(long, default_value_t = 1024)]
    pub system_prompt_tokens: usize,
    /// Mean question length in tokens.
    #[arg(long, default_value_t = 128)]
    pub query_tokens: usize,
    /// Mean answer length in tokens.
    #[arg(long, default_value_t = 200)]
    pub output_tokens: usize,
    /// Queries per second.
    #[arg(long, default_value_t = 4.0)]
    pub rate: f64,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl Default for RagParams {
    fn default() -> Self {
        clap_defaults()
    }
}

impl RagParams {
    /// Generates the trace.
    pub fn generate(&self) -> Result<Trace, SynthError> {
        let rate = check_rate("--rate", self.rate)?;
        check_counts(&[("--documents", self.documents)])?;
        check_order(("--docs-per-query", self.docs_per_query), ("--documents", self.documents))?;
        check_tokens(&[
            ("--doc-tokens", self.doc_tokens),
            ("--system-prompt-tokens", self.system_prompt_tokens),
            ("--query-tokens", self.query_tokens),
            ("--output-tokens", self.output_tokens),
        ])?;
        let mut g = Gen::new(self.seed);
        let system = g.segment(self.system_prompt_tokens.max(1));
        let docs: Vec<_> = (0..self.documents.max(1))
            .map(|_| {
                let len = g.length(self.doc_tokens);
                g.segment(len)
            })
            .collect();
        let zipf = Zipf::new(docs.len(), self.zipf)?;
        let mut at = Duration::ZERO;
        for _ in 0..self.requests {
            at = g.after_gap(at, rate)?;
            let picked = zipf.draw_distinct(self.docs_per_query, &mut g.rng);
            let mut segments = vec![system];
            segments.extend(picked.iter().map(|&d| docs[d]));
            let question = g.length(self.query_tokens);
            segments.push(g.segment(question));
            let answer = g.length(self.output_tokens);
            g.push(at, &segments, answer);
        }
        Ok(g.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_share_the_system_prompt_and_popular_documents() {
        let p = RagParams { requests: 300, system_prompt_tokens: 1024, ..RagParams::default() };
        let trace = p.generate().unwrap();
        // The system prompt is two full blocks every query starts with.
        let head = &trace.requests[0].hash_ids[..2];
        assert!(trace.requests.iter().all(|r| &r.hash_ids[..2] == head));
        // Popular first documents make some third blocks repeat.
        let mut thirds: Vec<u64> = trace.requests.iter().map(|r| r.hash_ids[2]).collect();
        thirds.sort_unstable();
        thirds.dedup();
        assert!(thirds.len() < trace.len() / 2);
    }
}
