//! kvroute's load generator: workloads, the offline simulator, and (next) live runs, reports
//! and the local demo.
//!
//! - [`workload`]: requests and their prompts: Mooncake JSONL traces and seeded synthetic
//!   generators (multi-turn chat, RAG, batch jobs), all as content blocks with deterministic
//!   token ids.
//! - [`sim`]: the offline simulator: a trace through N in-process block caches under the
//!   router's own routing policies, with a per-replica engine model for load and latency, and
//!   the pooled bound beside every result ([`sim::simulate`]).
//! - [`cli`]: the `kvroute-loadgen` command line (`simulate`, `generate`).
//! - [`units`]: parsing durations on the command line.
#![forbid(unsafe_code)]

pub mod cli;
pub mod sim;
pub mod units;
pub mod workload;

pub use sim::{SimConfig, SimReport, simulate};
pub use workload::{Request, Trace};
