//! `kvroute-loadgen`: parses the command line and runs it (see [`kvroute_loadgen::cli`]).

use clap::Parser;

fn main() -> anyhow::Result<()> {
    kvroute_loadgen::cli::run(kvroute_loadgen::cli::Cli::parse())
}
