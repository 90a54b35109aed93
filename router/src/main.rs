//! `kvroute-router`: the cache-aware reverse proxy (see `--help`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    kvroute_proto::process::main("kvroute-router", kvroute_router::Config::validate, kvroute_router::run)
        .await
}

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
