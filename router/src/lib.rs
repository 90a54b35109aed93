//! kvroute's router: event ingestion, the prefix index, routing policies, the HTTP reverse
//! proxy and the gRPC admin service.
#![forbid(unsafe_code)]
