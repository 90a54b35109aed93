//! Generates the prost/tonic types from `proto/kvroute/v1/*.proto` with a vendored `protoc`,
//! so a fresh machine needs nothing but the Rust toolchain.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    let protos =
        ["proto/kvroute/v1/events.proto", "proto/kvroute/v1/agent.proto", "proto/kvroute/v1/admin.proto"];
    tonic_prost_build::configure().compile_with_config(config, &protos, &["proto"])?;
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    Ok(())
}
