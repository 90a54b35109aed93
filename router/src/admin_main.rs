//! `kvroute-admin`: the router's admin service from a shell (see `--help` and
//! [`kvroute_router::admin_cli`]).

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = kvroute_router::admin_cli::Cli::parse();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("kvroute-admin: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kvroute_router::admin_cli::run(&cli, &mut std::io::stdout().lock())) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-admin: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
