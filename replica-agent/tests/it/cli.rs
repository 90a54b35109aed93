//! The `kvroute-agent` binary refuses bad flags and invalid settings with a message and a
//! non-zero exit, before binding anything.

use std::time::Duration;

/// Runs the agent binary with `args` (its sockets on port 0 unless `args` set them) and
/// returns its exit code and what it printed; fails if it did not exit (it took the flags).
fn refused_by_agent(args: &[&str]) -> (Option<i32>, String) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-agent"));
    command.args(args).env_remove("KVROUTE_AGENT_CONFIG");
    for (flag, any) in [
        ("--http-addr", "127.0.0.1:0"),
        ("--grpc-addr", "127.0.0.1:0"),
        ("--events-endpoint", "tcp://127.0.0.1:0"),
        ("--replay-endpoint", "tcp://127.0.0.1:0"),
    ] {
        if !args.contains(&flag) {
            command.args([flag, any]);
        }
    }
    let out = kvroute_proto::exits::output_within(command, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A config file with a bad key is reported together with what the checks find in the
/// rest, so one run names every problem.
#[test]
fn a_bad_config_file_is_reported_with_the_rests_problems() {
    let path = std::env::temp_dir().join(format!("kvroute-agent-bad-file-{}.toml", std::process::id()));
    std::fs::write(&path, "block-size = 0\nbogus-key = 1\n").unwrap();
    let (code, stderr) = refused_by_agent(&["--config", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, Some(2), "{stderr}");
    for fragment in ["unknown keys: bogus-key", "--block-size must be at least 1"] {
        assert!(stderr.contains(fragment), "{fragment:?} not in {stderr}");
    }
}

#[test]
fn bad_flags_make_the_binary_exit_with_a_message() {
    for (args, fragment) in [
        (&["--bogus-flag"][..], "'--bogus-flag'"),
        (&["--block-size", "sixteen"], "'sixteen' for '--block-size"),
        (&["--policy", "fifo"], "'fifo' for '--policy"),
        (&["--http-addr", "nowhere"], "'nowhere' for '--http-addr"),
        (&["--block-size", "0"], "--block-size must be at least 1"),
        (&["--max-header-bytes", "100"], "--max-header-bytes must be at least 8192"),
        (&["--max-connections", "0"], "--max-connections must be between 1 and"),
        (&["--config", "/nonexistent/agent.toml"], "/nonexistent/agent.toml"),
        (
            &["--kv-transfer-config", r#"{"kv_connector":"P2pNcclConnector","kv_role":"kv_both"}"#],
            "P2pNcclConnector",
        ),
        (&["--kv-transfer-config", "NixlConnector"], "--kv-transfer-config"),
    ] {
        let (code, stderr) = refused_by_agent(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(fragment), "{args:?}: {fragment:?} not in {stderr}");
    }
}
