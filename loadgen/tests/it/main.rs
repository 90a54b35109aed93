//! loadgen's integration tests: seed-000 replays against hand-checked and reference numbers,
//! the command line, and live runs against an in-process fleet (`live`).

mod cli;
mod cli_errors;
mod engine_model;
mod fleet;
mod live;
mod seed000;
mod support;
