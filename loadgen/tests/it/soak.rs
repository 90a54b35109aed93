//! The soak's mechanics in about 25 s: real `kvroute-router` and `kvroute-agent` processes,
//! a small steady load, a replica killed and restarted every 5 s. It checks that samples are
//! taken with the router's memory and index size, that restarts happen and the router sees
//! them, that every request is accounted for and requests succeed after the last restart,
//! and that the report files are written. Memory flatness is the real soak's verdict
//! (`kvroute-loadgen soak`), not asserted here.
//!
//! The server binaries are the ones beside this package's `kvroute-loadgen` (same profile):
//! `cargo test --workspace` builds them; when they are missing (`cargo test -p
//! kvroute-loadgen` on a fresh checkout) the test builds them with cargo first.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvroute_loadgen::live::PromptFormat;
use kvroute_loadgen::soak::command::soak_workload;
use kvroute_loadgen::soak::{self, Binaries, SoakConfig};
use tokio_util::sync::CancellationToken;

/// Bound on the whole run: a hang fails instead of stalling the suite.
const LIMIT: Duration = Duration::from_secs(90);

/// `kvroute-router` and `kvroute-agent` beside this package's binary, built if missing.
fn server_binaries() -> Binaries {
    let dir =
        Path::new(env!("CARGO_BIN_EXE_kvroute-loadgen")).parent().expect("target/<profile>").to_path_buf();
    if let Ok(found) = Binaries::in_dir(&dir) {
        return found;
    }
    let mut build = Command::new(env!("CARGO"));
    build.args(["build", "-p", "kvroute-router", "-p", "kvroute-replica-agent", "--bins"]);
    match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => {}
        Some("release") => {
            build.arg("--release");
        }
        Some(profile) => {
            build.args(["--profile", profile]);
        }
        None => panic!("unexpected binary directory {}", dir.display()),
    }
    let status = build.current_dir(env!("CARGO_MANIFEST_DIR")).status().expect("cargo runs");
    assert!(status.success(), "building the server binaries failed");
    Binaries::in_dir(&dir).expect("the server binaries were just built")
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The soak this suite runs: four agents, churn every 5 s, samples every second.
fn config(binaries: Binaries, rate: f64, duration: Duration, out_dir: PathBuf) -> SoakConfig {
    SoakConfig {
        binaries,
        replicas: 4,
        rate,
        duration,
        churn_interval: Some(Duration::from_secs(5)),
        sample_interval: Duration::from_secs(1),
        capacity_blocks: 256,
        block_size: 16,
        time_scale: 20.0,
        max_in_flight: 64,
        request_timeout: Duration::from_secs(20),
        seed: 7,
        // Text, so the router processes tokenize too (the demo and the ids paths are
        // covered elsewhere).
        prompt: PromptFormat::Text,
        router_args: Vec::new(),
        out_dir,
        workload: "chat".into(),
        progress: false,
    }
}

/// An interval of zero is refused before anything starts (tokio's timers panic on one, and
/// a panicking churn task took the fleet down with it).
#[tokio::test]
async fn zero_intervals_are_refused() {
    // Nothing runs: no binaries needed.
    let none = Binaries { router: PathBuf::new(), agent: PathBuf::new() };
    let base =
        config(none, 1.0, Duration::from_secs(1), std::env::temp_dir().join("kvroute-soak-never-written"));
    for (churn_interval, sample_interval) in
        [(Some(Duration::ZERO), Duration::from_secs(1)), (None, Duration::ZERO)]
    {
        let config = SoakConfig { churn_interval, sample_interval, ..base.clone() };
        let err = soak::run(&Default::default(), &config, CancellationToken::new()).await.unwrap_err();
        assert!(err.to_string().contains("intervals"), "{err:#}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_samples_memory_restarts_replicas_and_keeps_serving() {
    let out = TempDir(std::env::temp_dir().join(format!("kvroute-soak-test-{}", std::process::id())));
    let (rate, duration) = (6.0, Duration::from_secs(20));
    let workload = soak_workload(rate, duration, 7);
    let trace = workload.generate().unwrap();
    let config = config(server_binaries(), rate, duration, out.0.clone());
    let report = tokio::time::timeout(LIMIT, soak::run(&trace, &config, CancellationToken::new()))
        .await
        .expect("the soak finishes")
        .expect("the soak runs");

    assert_eq!(report.stopped_early, None);
    assert!(report.samples.len() >= 10, "{} samples", report.samples.len());
    for s in &report.samples {
        assert!(s.router_rss.is_some_and(|r| r > 0) && s.index_entries.is_some(), "{s:?}");
    }
    assert!(report.replica_restarts >= 3, "{} restarts", report.replica_restarts);
    let last = report.samples.last().unwrap();
    assert!(
        last.router_index_clears.is_some_and(|c| c >= 1),
        "the router never cleared a killed replica: {last:?}"
    );

    let t = &report.totals;
    assert_eq!(t.sent, t.done, "every request finished");
    assert_eq!(t.done, t.succeeded + t.lost_to_churn + t.cancelled + t.unexpected_errors());
    assert_eq!(t.unexpected_errors(), 0, "unexpected errors: {:?}", t.unexpected);
    assert!(t.succeeded > 50, "{t:?}");
    assert!(report.hit_rate.is_some_and(|h| h > 0.0), "shared prefixes never hit");
    assert!(
        last.tokenize_cache_bytes.is_some_and(|b| b > 0),
        "the router's tokenizer cache holds nothing of the text prompts: {last:?}"
    );

    let restarted = report
        .samples
        .iter()
        .find(|s| s.replica_restarts == report.replica_restarts)
        .expect("a sample after the last restart");
    assert!(last.totals.succeeded > restarted.totals.succeeded, "nothing succeeded after the last restart");

    for file in ["samples.csv", "report.json", "summary.txt", "memory.svg"] {
        let path = out.0.join(file);
        assert!(std::fs::metadata(&path).is_ok_and(|m| m.len() > 0), "{} missing", path.display());
    }
    let csv = std::fs::read_to_string(out.0.join("samples.csv")).unwrap();
    assert_eq!(csv.lines().count(), report.samples.len() + 1);
}
