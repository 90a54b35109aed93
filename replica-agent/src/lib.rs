//! A simulated inference replica: OpenAI-compatible API, a block cache, a batching and
//! latency model, and the KV event publisher.
//!
//! - [`cache`]: the block-level KV prefix cache (capacity in blocks, LRU/LFU/S3FIFO eviction,
//!   refcounted pins for running requests, seed-000 hit accounting).
//! - [`publisher`]: the KV event publisher (ZMQ PUB live stream + ROUTER replay).
#![forbid(unsafe_code)]

pub mod cache;
pub mod config;
pub mod engine;
pub mod grpc;
pub mod publisher;

pub use config::Config;
