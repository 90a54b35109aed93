//! The `kvroute-loadgen` binary refuses bad command lines with a message and a non-zero
//! exit (clap's usage errors, workload parameters no trace can be generated from, and
//! simulations that would measure nonsense).

use std::process::Command;

use crate::support::data;

#[test]
fn bad_flags_make_the_binary_exit_with_a_message() {
    let trace = data("small_a.jsonl");
    let trace = trace.to_str().unwrap();
    for args in [
        &["--bogus-flag"][..],
        &[],
        &["simulate", "--policy", "nope"],
        &["simulate", "--capacity", "many"],
        &["simulate", "--trace", "/nonexistent/trace.jsonl"],
        &["simulate", "--trace", trace, "--capacity", "8", "--blocks", "hash-ids", "--block-size", "16"],
        &["generate", "--bogus-flag"],
        &["generate", "rag", "--zipf", "nan"],
        &["generate", "rag", "--zipf=-1"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute-loadgen")).args(args).output().expect("runs");
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}
