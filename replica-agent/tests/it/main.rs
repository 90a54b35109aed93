//! Integration tests of the replica agent over real sockets on 127.0.0.1 port 0.
//!
//! - [`support`]: starts agents, a small HTTP client, and a strict OpenAI-shape checker.
//! - `http_api`: the OpenAI-compatible API: shapes, streaming, cached tokens, errors,
//!   `/tokenize`, `/metrics`, `/reset_prefix_cache`, shutdown.
//! - `events`: KV events over a real ZMQ SUB and DEALER, and the gRPC `ReplicaAgent` service.
//! - `ranks`: data-parallel ranks: a cache and an event stream each, the rank header, the
//!   balancer, per-engine metrics.
//! - `kv_transfer`: disaggregated prefill as vLLM's NixlConnector plays it over HTTP.
//! - `bootstrap`: disaggregated prefill as SGLang plays it, through a bootstrap room.
//! - `sglang`: SGLang's native `/generate`.
//! - `cli`: the binary's refusals of bad flags and settings.
//! - `limits`: request fields that must not overflow the agent's checks.
//! - `start`: a start that fails part-way.

mod bootstrap;
mod cli;
mod events;
mod http_api;
mod kv_transfer;
mod limits;
mod ranks;
mod sglang;
mod start;
mod support;
