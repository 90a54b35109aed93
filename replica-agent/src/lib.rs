//! A simulated inference replica: OpenAI-compatible API, a block cache, a batching and
//! latency model, and the KV event publisher.
//!
//! - [`publisher`]: the KV event publisher (ZMQ PUB live stream + ROUTER replay).
#![forbid(unsafe_code)]

pub mod publisher;
