//! The `kvroute-agent` binary refuses bad flags and invalid settings with a message and a
//! non-zero exit, before binding anything.

fn agent_binary(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-agent"))
        .args(args)
        .env_remove("KVROUTE_AGENT_CONFIG")
        .output()
        .expect("run kvroute-agent")
}

#[test]
fn bad_flags_make_the_binary_exit_with_a_message() {
    for args in [
        &["--bogus-flag"][..],
        &["--block-size", "sixteen"],
        &["--policy", "fifo"],
        &["--http-addr", "nowhere"],
        &["--block-size", "0"],
        &["--max-header-bytes", "100"],
        &["--max-connections", "0"],
        &["--config", "/nonexistent/agent.toml"],
    ] {
        let out = agent_binary(args);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}
