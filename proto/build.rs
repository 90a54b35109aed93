//! Generates the prost/tonic types from `proto/kvroute/v1/*.proto` with a vendored `protoc`,
//! so a fresh machine needs nothing but the Rust toolchain.

/// The admin service's answers, and the messages in them.
const ADMIN_ANSWERS: [&str; 7] = [
    "ReplicaSpec",
    "ReplicaStatus",
    "RankStatus",
    "Candidate",
    "Load",
    "ExplainResponse",
    "RemoveReplicaResponse",
];

/// Their enum fields, and the function in `pb::json` that names each value.
const ENUM_FIELDS: [(&str, &str); 5] = [
    ("ReplicaSpec.engine", "engine_kind"),
    ("ReplicaSpec.role", "replica_role"),
    ("ReplicaStatus.state", "stream_state"),
    ("RankStatus.state", "stream_state"),
    ("Candidate.state", "stream_state"),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    let protos =
        ["proto/kvroute/v1/events.proto", "proto/kvroute/v1/agent.proto", "proto/kvroute/v1/admin.proto"];
    // The admin service's answers print as JSON (`kvroute-admin --output json`): enums by
    // their short names (`pb::json`), the rest as serde has it.
    let mut build = tonic_prost_build::configure();
    for message in ADMIN_ANSWERS {
        build = build.message_attribute(format!(".kvroute.v1.{message}"), "#[derive(serde::Serialize)]");
    }
    for (field, serializer) in ENUM_FIELDS {
        let with = format!("#[serde(serialize_with = \"json::{serializer}\")]");
        build = build.field_attribute(format!(".kvroute.v1.{field}"), with);
    }
    build.compile_with_config(config, &protos, &["proto"])?;
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    Ok(())
}
