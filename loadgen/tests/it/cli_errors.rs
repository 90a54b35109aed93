//! The `kvroute-loadgen` binary refuses bad command lines with a message and a non-zero
//! exit (clap's usage errors, workload parameters no trace can be generated from, and
//! simulations that would measure nonsense).

use std::process::Command;

use crate::support::data;

/// clap's exit code for a usage error; the program's own errors exit with 1.
const USAGE: i32 = 2;

#[test]
fn bad_flags_make_the_binary_exit_with_a_message() {
    let trace = data("small_a.jsonl");
    let trace = trace.to_str().unwrap();
    // Each case's exit code and a fragment of its message: a case meant to reach the program
    // must not pass on a usage error from a misspelt flag, nor a usage case on another one.
    let cases: [(&[&str], i32, &str); 27] = [
        (&["--bogus-flag"], USAGE, "'--bogus-flag'"),
        (&[], USAGE, "Usage:"),
        (&["simulate", "--policy", "nope"], USAGE, "'nope'"),
        (&["simulate", "--capacity", "many"], USAGE, "'many'"),
        (
            &["simulate", "--trace", "/nonexistent/trace.jsonl", "--capacity", "8"],
            1,
            "/nonexistent/trace.jsonl",
        ),
        (
            &["simulate", "--trace", trace, "--capacity", "8", "--blocks", "hash-ids", "--block-size", "16"],
            1,
            "block size 16",
        ),
        // An engine whose steps prefill nothing never finished.
        (
            &["simulate", "--trace", trace, "--capacity", "8", "--max-num-batched-tokens", "0"],
            1,
            "--max-num-batched-tokens (0)",
        ),
        (&["simulate", "--trace", trace, "--capacity", "8", "--max-num-seqs", "0"], 1, "--max-num-seqs"),
        (
            &[
                "simulate",
                "--trace",
                trace,
                "--capacity",
                "8",
                "--max-num-seqs",
                "600",
                "--max-num-batched-tokens",
                "512",
            ],
            1,
            "must be at least --max-num-seqs (600)",
        ),
        // As the agent refuses it.
        (
            &[
                "simulate",
                "--trace",
                trace,
                "--capacity",
                "80",
                "--policy",
                "s3fifo",
                "--s3fifo-small-ratio",
                "1.5",
            ],
            1,
            "small_ratio must be within [0, 1]",
        ),
        (
            &["simulate", "--trace", trace, "--capacity", "8", "--in-flight-tokens=-1"],
            1,
            "cache-aware weights",
        ),
        // A block size the routers' `u32` cannot hold, or none at all.
        (&["compare", "--block-size", "4294967312"], USAGE, "'4294967312'"),
        (&["demo", "--block-size", "0"], USAGE, "'0'"),
        // Host memory the routers would not follow: its loads unpredicted.
        (&["demo", "--offload-blocks", "64", "--without-events"], 1, "--offload-blocks"),
        (&["demo", "--offload-blocks", "64", "--data-parallel-size", "2"], 1, "--offload-blocks"),
        (&["generate", "--bogus-flag"], USAGE, "'--bogus-flag'"),
        (&["generate", "rag", "--zipf", "nan"], 1, "Zipf exponent"),
        (&["generate", "rag", "--zipf=-1"], 1, "Zipf exponent"),
        // Refused before the workload is sized by it (it overflowed, or asked for billions).
        (&["soak", "--rate", "inf"], 1, "--rate must be above 0"),
        (&["soak", "--rate", "1e9"], 1, "at most 100000"),
        (&["soak", "--rate", "100000", "--duration", "10m"], 1, "60000000 requests"),
        // A client certificate needs its key; a file that cannot be read is named.
        (&["live", "--target", "https://127.0.0.1:1", "--client-cert", "c.pem"], USAGE, "--client-key"),
        (
            &["live", "--target", "https://127.0.0.1:1", "--ca-cert", "/nonexistent/ca.pem"],
            1,
            "/nonexistent/ca.pem",
        ),
        // A run that measured nothing is no success for a script reading the exit code.
        (
            &[
                "live",
                "--target",
                "http://127.0.0.1:1",
                "--requests",
                "2",
                "--mode",
                "closed",
                "--no-progress",
            ],
            1,
            "none of the 2 requests sent succeeded",
        ),
        (&["live", "--target", "http://127.0.0.1:1", "--requests", "0"], USAGE, "--requests"),
        (&["live", "--target", "http://127.0.0.1:1", "--speedup", "nan"], USAGE, "--speedup"),
        // It divides the offline run's speed-up: 0 named the speed-up `inf`, not this flag.
        (&["compare", "--agent-time-scale", "0"], USAGE, "--agent-time-scale"),
    ];
    for (args, code, fragment) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute-loadgen")).args(args).output().expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(fragment), "{args:?}: {fragment:?} not in {stderr}");
    }
}

/// Regression: a key refused (a Secret's trailing newline, a space) was quoted in clap's
/// message, into the pod's log.
#[test]
fn a_bad_api_key_is_refused_without_showing_it() {
    for (flag, env) in [(Some("sk-hunter2 x"), None), (None, Some("sk-hunter2\n"))] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvroute-loadgen"));
        command.args(["live", "--target", "http://127.0.0.1:1", "--no-progress"]);
        command.args(flag.map(|key| ["--api-key", key]).into_iter().flatten());
        match env {
            Some(key) => command.env("KVROUTE_LOADGEN_API_KEY", key),
            None => command.env_remove("KVROUTE_LOADGEN_API_KEY"),
        };
        let out = command.output().expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("--api-key") && !stderr.contains("hunter2"), "{stderr}");
    }
}
