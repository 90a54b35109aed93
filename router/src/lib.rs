//! kvroute's router: event ingestion, the prefix index, routing policies, the HTTP reverse
//! proxy and the gRPC admin service.
//!
//! - [`index`]: which replica holds which KV blocks; one walk gives every replica's longest
//!   cached prefix of a request ([`index::SharedIndex`] is the handle the router shares).
#![forbid(unsafe_code)]

pub mod index;
