use kvroute_router::{Config, run};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config: Config = match kvroute_proto::cli::parse() {
        Ok(config) => config,
        Err(kvroute_proto::cli::ConfigError::Cli(e)) => e.exit(),
        Err(e) => {
            eprintln!("kvroute-router: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if let Err(errors) = config.validate() {
        eprintln!("kvroute-router: invalid configuration:");
        for e in errors {
            eprintln!("  - {e}");
        }
        return std::process::ExitCode::from(2);
    }
    kvroute_proto::process::init_tracing();
    let shutdown = CancellationToken::new();
    tokio::spawn(kvroute_proto::process::cancel_on_signal(shutdown.clone()));
    match run(config, shutdown).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-router: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
