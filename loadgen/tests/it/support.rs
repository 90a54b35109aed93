//! Shared helpers: test data paths, a one-replica stand-in policy, and small configs.

use std::path::PathBuf;

use kvroute_loadgen::Trace;
use kvroute_loadgen::sim::{SimConfig, SimReport, simulate_with};
use kvroute_loadgen::workload::mooncake;
use kvroute_replica_agent::cache::PolicyKind as Eviction;
use kvroute_router::policy::{Decision, Policy, PolicyKind, ReplicaView, RequestView};

/// Routes everything to the first replica: enough for N = 1, where routing has no choice.
pub struct FirstReplica;

impl Policy for FirstReplica {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }
    fn choose(&self, _: &RequestView, replicas: &[ReplicaView]) -> Decision {
        Decision { chosen: (!replicas.is_empty()).then_some(0), costs: vec![0.0; replicas.len()] }
    }
}

/// A file under `loadgen/tests/data`.
pub fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// The public Mooncake trace (Apache-2.0), kept in `tests/data` so that its checks run on a
/// fresh clone: they passed without running where it was read from beside the repository.
pub fn read_shared_trace() -> Trace {
    read(&data("mooncake_synthetic_trace.jsonl"))
}

pub fn read(path: &std::path::Path) -> Trace {
    mooncake::read_file(path).unwrap_or_else(|e| panic!("reading {}: {e:#}", path.display()))
}

/// Seed 000's replay: one replica, hash ids as blocks, no engine model.
pub fn replay(trace: &Trace, eviction: Eviction, capacity_blocks: usize) -> SimReport {
    let config = SimConfig { replicas: 1, capacity_blocks, eviction, engine: None, ..SimConfig::default() };
    simulate_with(trace, &config, &FirstReplica).expect("simulation runs")
}
