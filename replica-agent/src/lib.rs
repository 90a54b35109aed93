//! A simulated inference replica: OpenAI-compatible API, a block cache, a batching and
//! latency model, and the KV event publisher.
//!
//! - [`cache`]: the block-level KV prefix cache (capacity in blocks, LRU/LFU/S3FIFO eviction,
//!   refcounted pins for running requests, seed-000 hit accounting).
//! - [`http`]: the OpenAI-compatible HTTP API (completions, chat, SSE streaming, `/tokenize`,
//!   `/reset_prefix_cache`, `/metrics` with vLLM's names, `/v1/models`, `/health`, `/version`).
//! - [`publisher`]: the KV event publisher (ZMQ PUB live stream + ROUTER replay).
//! - [`config`], [`engine`], [`grpc`]: settings, the continuous-batching engine, the
//!   `ReplicaAgent` gRPC service; [`server`] assembles them ([`start`], [`run`]).
#![forbid(unsafe_code)]

pub mod bootstrap;
pub mod cache;
pub mod config;
pub mod engine;
pub mod grpc;
pub mod http;
pub mod kv_transfer;
pub mod publisher;
pub mod server;

pub use config::Config;
pub use server::{RunningAgent, run, start};
