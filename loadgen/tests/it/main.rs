//! loadgen's integration tests: seed-000 replays against hand-checked and reference numbers,
//! and the command line.

mod cli;
mod cli_errors;
mod engine_model;
mod fleet;
mod seed000;
mod support;
