//! A simulated inference replica: OpenAI-compatible API, a block cache, a batching and
//! latency model, and the KV event publisher.
#![forbid(unsafe_code)]
