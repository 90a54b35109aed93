//! For tests of a binary's command line: run it and take what it printed as it exited. A
//! binary still running after a while took its flags and serves: it is killed and that is an
//! error, where waiting for its exit would hang the test. (Give it port-0 addresses, so that a
//! regression serves there instead of colliding with whatever holds its default ports.)

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How often a running binary is looked at.
const POLL: Duration = Duration::from_millis(20);

/// Runs `command` (its standard output dropped) and returns its output once it exits, or an
/// error if it has not exited within `wait` (then it is killed).
pub fn output_within(mut command: Command, wait: Duration) -> Result<Output, String> {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run it: {e}"))?;
    // Read as it comes: a full pipe would stop the binary before its exit.
    let mut stderr = child.stderr.take().ok_or("no standard error")?;
    let reader = std::thread::spawn(move || {
        let mut text = Vec::new();
        std::io::Read::read_to_end(&mut stderr, &mut text).map(|_| text)
    });
    let deadline = Instant::now() + wait;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let stderr = reader.join().map_err(|_| "reading its output panicked")?;
                let stderr = stderr.map_err(|e| format!("reading its output: {e}"))?;
                return Ok(Output { status, stdout: Vec::new(), stderr });
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("still running after {wait:?}: it took the flags"));
            }
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
    }
}
