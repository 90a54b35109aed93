//! `kvroute-agent`: a simulated inference replica (see `--help`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    kvroute_proto::process::main(
        "kvroute-agent",
        kvroute_replica_agent::Config::validate,
        kvroute_replica_agent::run,
    )
    .await
}
