//! kvroute's load generator: workloads, the offline simulator, live runs, policy comparisons
//! and the local demo.
//!
//! - [`workload`]: requests and their prompts: Mooncake JSONL traces and seeded synthetic
//!   generators (multi-turn chat, RAG, batch jobs), all as content blocks with deterministic
//!   token ids.
//! - [`sim`]: the offline simulator: a trace through N in-process block caches under the
//!   router's own routing policies, with a per-replica engine model for load and latency, and
//!   the pooled reference (one cache of the fleet's capacity) beside every result
//!   ([`sim::simulate`]).
//! - [`live`]: a workload sent as real HTTP completions to a router or replica, measured per
//!   request (TTFT, time per output token, latency, errors by kind, cached tokens) and
//!   fleet-wide (the replicas' and router's counters), with a progress bar.
//! - [`compare`]: the same workload once per routing policy against one fleet, in one report
//!   (terminal table, JSON, SVG plots) beside the pooled reference and the offline
//!   simulation.
//! - [`demo`]: an embedded fleet (agents and a router per policy, on loopback) for `compare`.
//! - [`soak`]: a long steady run against router and agent processes with replica churn,
//!   sampling the router's memory, errors and hit rate.
//! - [`cli`], [`commands`]: the `kvroute-loadgen` command line (`simulate`, `generate`;
//!   `live`, `compare`, `demo`; `soak`).
//! - [`plot`]: the SVG chart frame, palette and legend both reports' plots share.
//! - [`units`]: parsing durations on the command line.
#![forbid(unsafe_code)]

pub mod cli;
pub mod commands;
pub mod compare;
pub mod demo;
pub mod live;
pub mod plot;
pub mod sim;
pub mod soak;
pub mod units;
pub mod workload;

pub use sim::{SimConfig, SimReport, simulate};
pub use workload::{Request, Trace};
