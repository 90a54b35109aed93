//! loadgen's integration tests: seed-000 replays against hand-checked and reference numbers,
//! the command line, live runs against an in-process fleet (`live`), and the soak against
//! router and agent processes (`soak`).

mod cli;
mod cli_errors;
mod disagg;
mod engine_model;
mod fleet;
mod live;
mod seed000;
mod soak;
mod support;
