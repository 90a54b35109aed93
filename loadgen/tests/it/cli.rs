//! The `kvroute-loadgen` binary end to end: `simulate` prints seed 000's lines and writes
//! the per-request and report files; `generate` writes a trace `simulate` can read.

use std::path::Path;
use std::process::Command;

use crate::support::data;

fn loadgen(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-loadgen")).args(args).output().expect("runs");
    assert!(
        out.status.success(),
        "kvroute-loadgen {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn line_value<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(key).and_then(|rest| rest.strip_prefix(": ")))
        .unwrap_or_else(|| panic!("no {key} line in\n{stdout}"))
}

struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvroute-loadgen-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn path(&self, file: &str) -> String {
        self.0.join(file).to_str().unwrap().to_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn simulate_prints_seed000_totals_and_writes_per_request_hits() {
    let tmp = TempDir::new("sim");
    let trace = data("small_a.jsonl");
    let per_request = tmp.path("per_request.json");
    let json = tmp.path("report.json");
    let stdout = loadgen(&[
        "simulate",
        "--trace",
        trace.to_str().unwrap(),
        "--policy",
        "lfu",
        "--capacity",
        "6",
        "--block-size",
        "512",
        "--per-request",
        &per_request,
        "--json",
        &json,
    ]);
    assert_eq!(line_value(&stdout, "total_hit_tokens"), "5484");
    assert_eq!(line_value(&stdout, "total_prompt_tokens"), "12484");
    assert_eq!(line_value(&stdout, "overall_hit_rate").parse::<f64>().unwrap(), 5484.0 / 12484.0);
    assert_eq!(line_value(&stdout, "final_cache_blocks"), "6");

    let per: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&per_request).unwrap()).unwrap();
    let per = per.as_array().unwrap();
    assert_eq!(per.len(), 12);
    assert_eq!(per[11], serde_json::json!({"hit_tokens": 1300, "prompt_tokens": 1300}));

    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["total_hit_tokens"], 5484);
    assert_eq!(report["pooled"]["total_hit_tokens"], 5484);
    assert_eq!(report["setup"]["eviction"], "lfu");
}

#[test]
fn generated_traces_replay_on_a_fleet() {
    let tmp = TempDir::new("gen");
    let trace = tmp.path("chat.jsonl");
    loadgen(&["generate", "--out", &trace, "chat", "--conversations", "30", "--seed", "3"]);
    assert!(Path::new(&trace).exists());
    let json = tmp.path("report.json");
    let stdout = loadgen(&[
        "simulate",
        "--trace",
        &trace,
        "--capacity",
        "64",
        "--replicas",
        "4",
        "--routing",
        "round-robin",
        "--policy",
        "s3fifo",
        "--s3fifo-small-ratio",
        "0.25",
        "--json",
        &json,
    ]);
    assert!(line_value(&stdout, "total_prompt_tokens").parse::<u64>().unwrap() > 0);
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["per_replica"].as_array().unwrap().len(), 4);
    assert_eq!(report["pooled"]["capacity_blocks"], 256);
    assert!(report["latency"]["ttft_p50_ms"].as_f64().unwrap() > 0.0);
    // The report says which S3FIFO it replayed.
    assert_eq!(report["setup"]["s3fifo"], serde_json::json!({"small_ratio": 0.25, "max_freq": 3}));
}

#[test]
fn a_bad_trace_line_fails_with_its_line_number() {
    let tmp = TempDir::new("bad");
    let trace = tmp.path("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 1}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-loadgen"))
        .args(["simulate", "--trace", &trace, "--capacity", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
}
