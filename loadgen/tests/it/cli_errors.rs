//! The `kvroute-loadgen` binary refuses bad command lines with a message and a non-zero
//! exit (clap's usage errors, and workload parameters no trace can be generated from).

use std::process::Command;

#[test]
fn bad_flags_make_the_binary_exit_with_a_message() {
    for args in [
        &["--bogus-flag"][..],
        &[],
        &["simulate", "--policy", "nope"],
        &["simulate", "--capacity", "many"],
        &["simulate", "--trace", "/nonexistent/trace.jsonl"],
        &["generate", "--bogus-flag"],
        &["generate", "rag", "--zipf", "nan"],
        &["generate", "rag", "--zipf=-1"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute-loadgen")).args(args).output().expect("runs");
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}
