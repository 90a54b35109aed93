//! kvroute's wire contract, shared by the router, the replica agent and the load generator.
//!
//! - [`ids`]: the identity newtypes (`BlockHash`, `Seq`, `Epoch`, `ReplicaId`).
//! - [`hash`]: the one block-hash chain every component uses, and the seed-000 hit rule.
//! - [`pb`]: prost/tonic types generated from `proto/kvroute/v1/*.proto` (events, the
//!   replica agent's gRPC service, the router's admin service).
//! - [`framing`]: ZeroMQ message layouts: live `[topic, seq, payload]` frames and the
//!   replay request/reply protocol, with typed errors for every malformed case.
//! - [`loopback_port`]: a loopback port outside the kernel's ephemeral range, to bind later.
//! - [`mix`]: SplitMix64, the deterministic generator and mixer every seeded part shares.
//! - [`native`]: encode/decode kvroute's protobuf `EventBatch` on top of the framing.
//! - [`vllm`]: vLLM / SGLang msgpack KV-event batches (every shape vLLM 0.9-0.33 and SGLang
//!   send), decoded leniently; encoded as vLLM 0.33 does, for simulated replicas.
//! - `openai` (feature `openai`): OpenAI request parsing, tokenizers and chat templates,
//!   so the router and the replica agent compute the same token ids for a request.
//! - [`cli`] (feature `cli`): layered flags > env > TOML file > defaults for the binaries;
//!   [`process`]: their logging setup and SIGTERM/SIGINT handling.
//! - [`serve`] (feature `server`): the HTTP accept loop with graceful shutdown both servers use.
//! - [`zmtp_guard`] (feature `server`): a relay that bounds the ZMTP messages a `zeromq`
//!   socket's peers send (the crate has no such bound).
#![forbid(unsafe_code)]

#[cfg(feature = "server")]
pub mod api_key;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "cli")]
pub mod process;
#[cfg(feature = "server")]
pub mod serve;
#[cfg(feature = "server")]
pub mod zmtp_guard;

pub mod exits;
pub mod framing;
pub mod hash;
pub mod ids;
pub mod loopback_port;
pub mod mix;
pub mod native;
#[cfg(feature = "openai")]
pub mod openai;
pub mod pb;
pub mod prometheus;
pub mod vllm;

pub use hash::{CacheNamespace, block_hash, chain, hit_tokens};
pub use ids::{BlockHash, Epoch, ReplicaId, Seq};
