//! The router's integration tests: event ingestion over real ZeroMQ sockets and real gRPC,
//! on 127.0.0.1 port 0.

mod agent;
mod ingest;
mod support;
