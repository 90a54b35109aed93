//! The router's integration tests: event ingestion over real ZeroMQ sockets and real gRPC,
//! replica discovery (DNS, and a fake Kubernetes API server), the proxy in front of a fleet
//! of real replica agents ([`fleet`]), and the admin service, on 127.0.0.1 port 0.

mod admin;
mod agent;
mod disagg;
mod discovery;
mod faults;
mod fleet;
mod generate;
mod headers;
mod ingest;
mod limits;
mod messages;
mod offload;
mod predicted;
mod proxy;
mod queue;
mod ranks;
mod reload;
mod replica_tls;
mod responses;
mod start;
mod support;
mod tls;
mod websocket;
