//! kvroute's router: event ingestion, the prefix index, routing policies, the HTTP reverse
//! proxy and the gRPC admin service.
//!
//! - [`index`]: which replica holds which KV blocks; one walk gives every replica's longest
//!   cached prefix of a request ([`index::SharedIndex`] is the handle the router shares).
//! - [`ingest`]: follows every replica's KV event stream (kvroute protobuf or vLLM/SGLang
//!   msgpack over ZeroMQ) into the index, repairing gaps by replay or snapshot, with metrics.
//! - [`policy`]: routing policies (cache-aware, round-robin, random, least-loaded,
//!   power-of-two) as pure functions of a request and replica views, shared with `loadgen`.
//! - [`replicas`]: the replica registry: configuration, name ↔ [`kvroute_proto::ReplicaId`]
//!   interning, and the live status (stream state, seq, counters) the other parts read.
//! - [`discovery`]: keeps the replica set equal to a headless Service's DNS records or a
//!   Service's Kubernetes EndpointSlices (cargo feature `k8s`), through a [`discovery::ReplicaSink`].
#![forbid(unsafe_code)]

pub mod admin;
pub mod admin_cli;
pub mod config;
pub mod discovery;
pub mod fleet;
pub mod index;
pub mod ingest;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod reload;
pub mod replicas;
pub mod server;

pub use config::Config;
pub use server::{RunningRouter, run, start};
