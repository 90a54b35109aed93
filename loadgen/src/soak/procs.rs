//! The soak's processes: the `kvroute-router` and `kvroute-agent` binaries run as children
//! of loadgen, so the router's memory is its own (`/proc/<pid>/status`), and a replica can be
//! killed outright (SIGKILL: no drain, its streams cut) and started again on the same ports.
//!
//! Ports are reserved by binding `127.0.0.1:0` and releasing the socket just before the
//! child binds it (a small race with other processes on the machine; a child that cannot
//! bind exits, and is started again). Every child's stdout and stderr go to
//! `<log_dir>/<name>.log`; a child is killed when its handle drops, so an error, a panic, Ctrl-C or
//! SIGTERM in loadgen leaves nothing running, nor does a second signal's exit at once
//! ([`kill_all`]); SIGKILL, which runs no code of loadgen's, does.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::live::Client;

/// How long a child may take to answer its readiness check.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Between readiness probes.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// Why a process could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(
        "{0} not found: build it first (`cargo build --release -p kvroute-router -p kvroute-replica-agent`) or pass --bin-dir"
    )]
    Missing(PathBuf),
    #[error("reserving a loopback port")]
    Port(#[source] std::io::Error),
    #[error("creating the log file {path}")]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("starting {name}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} was not ready within {timeout:?} (see {log})")]
    NotReady { name: String, timeout: Duration, log: String },
    #[error("{name} refused its flags (see {log})")]
    BadFlags { name: String, log: String },
}

/// The exit code of the servers' bad flags and configuration (clap's too).
const BAD_FLAGS: i32 = 2;

/// Where the two server binaries are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binaries {
    pub router: PathBuf,
    pub agent: PathBuf,
}

impl Binaries {
    /// `kvroute-router` and `kvroute-agent` in `dir`, which must exist.
    pub fn in_dir(dir: &Path) -> Result<Self, ProcessError> {
        let exe = |name: &str| dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
        let found = Self { router: exe("kvroute-router"), agent: exe("kvroute-agent") };
        for path in [&found.router, &found.agent] {
            if !path.is_file() {
                return Err(ProcessError::Missing(path.clone()));
            }
        }
        Ok(found)
    }

    /// The binaries that are older than `than` (e.g. loadgen's own executable): probably stale
    /// builds of the router or agent sources.
    pub fn older_than(&self, than: &Path) -> Vec<&Path> {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let Some(reference) = modified(than) else { return Vec::new() };
        [self.router.as_path(), self.agent.as_path()]
            .into_iter()
            .filter(|p| modified(p).is_some_and(|m| m < reference))
            .collect()
    }
}

/// A free loopback TCP port, released for a child to bind (outside the ephemeral range, so
/// no other socket is handed it meanwhile).
pub fn free_port() -> Result<u16, ProcessError> {
    kvroute_proto::loopback_port::unused().map_err(ProcessError::Port)
}

/// The children started and not yet reaped, by pid: [`kill_all`] kills them when loadgen
/// exits at once (a second signal), which runs no destructor.
static ALIVE: std::sync::Mutex<std::collections::BTreeSet<u32>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn alive() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<u32>> {
    ALIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// SIGKILLs every child still running (before an exit that skips their handles' drop).
pub fn kill_all() {
    let pids: Vec<u32> = alive().iter().copied().collect();
    kill(pids);
}

/// SIGKILLs the processes `pids` (children not reaped yet, so the pids are still theirs).
fn kill(pids: impl IntoIterator<Item = u32>) {
    #[cfg(unix)]
    for pid in pids {
        if let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// A child process, killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct Child {
    pub name: String,
    inner: std::process::Child,
    pub log: PathBuf,
}

impl Child {
    /// Starts `program args..` with stdout and stderr appended to `<log_dir>/<name>.log`.
    /// `RUST_LOG` is passed through, `warn` when unset.
    pub fn spawn(program: &Path, args: &[String], name: &str, log_dir: &Path) -> Result<Self, ProcessError> {
        let log = log_dir.join(format!("{name}.log"));
        let open = || {
            File::options()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|source| ProcessError::Log { path: log.clone(), source })
        };
        let (out, err) = (open()?, open()?);
        let mut command = Command::new(program);
        command.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "warn");
        }
        let inner = command.spawn().map_err(|source| ProcessError::Spawn { name: name.into(), source })?;
        alive().insert(inner.id());
        Ok(Self { name: name.into(), inner, log })
    }

    pub fn pid(&self) -> u32 {
        self.inner.id()
    }

    /// Whether it has exited (and is reaped).
    pub fn exited(&mut self) -> bool {
        let exited = !matches!(self.inner.try_wait(), Ok(None));
        if exited {
            // Reaped: its pid may be another process's from now on.
            alive().remove(&self.inner.id());
        }
        exited
    }

    /// SIGKILL, then reap.
    pub fn kill(mut self) {
        self.kill_now();
    }

    fn kill_now(&mut self) {
        if let Err(e) = self.inner.kill() {
            // Already exited: nothing to kill, only to reap.
            tracing::debug!(child = %self.name, error = %e, "kill");
        }
        if let Err(e) = self.inner.wait() {
            tracing::warn!(child = %self.name, error = %e, "reaping a child failed");
        }
        alive().remove(&self.inner.id());
    }

    /// Polls `{url}` until it answers 2xx; `Ok(false)` if the child exited first.
    pub async fn wait_ready(&mut self, client: &Client, url: &str) -> Result<bool, ProcessError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if self.exited() {
                return Ok(false);
            }
            if let Ok((status, _)) = client.get(url, Duration::from_secs(1)).await
                && status.is_success()
            {
                return Ok(true);
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
        Err(ProcessError::NotReady {
            name: self.name.clone(),
            timeout: READY_TIMEOUT,
            log: self.log.display().to_string(),
        })
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if matches!(self.inner.try_wait(), Ok(None)) {
            self.kill_now();
        }
    }
}

/// Starts `program` until it is ready at `ready_url`: a child that exits first (its port
/// still held by a predecessor, say) is started again, until [`READY_TIMEOUT`].
pub async fn start_ready(
    program: &Path,
    args: &[String],
    name: &str,
    log_dir: &Path,
    client: &Client,
    ready_url: &str,
) -> Result<Child, ProcessError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let mut child = Child::spawn(program, args, name, log_dir)?;
        if child.wait_ready(client, ready_url).await? {
            return Ok(child);
        }
        // Flags it refuses, it refuses again: no second try.
        if child.inner.try_wait().ok().flatten().and_then(|status| status.code()) == Some(BAD_FLAGS) {
            return Err(ProcessError::BadFlags { name: name.into(), log: child.log.display().to_string() });
        }
        if Instant::now() >= deadline {
            return Err(ProcessError::NotReady {
                name: name.into(),
                timeout: READY_TIMEOUT,
                log: child.log.display().to_string(),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One replica agent's fixed identity: its name and the four ports it binds every time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentSpec {
    pub name: String,
    pub http: u16,
    pub grpc: u16,
    pub events: u16,
    pub replay: u16,
}

impl AgentSpec {
    /// A name and four free ports.
    pub fn reserve(name: String) -> Result<Self, ProcessError> {
        Ok(Self { name, http: free_port()?, grpc: free_port()?, events: free_port()?, replay: free_port()? })
    }

    pub fn http_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }

    /// The agent's command line (`extra` appended: capacity, time scale, ...).
    pub fn args(&self, extra: &[String]) -> Vec<String> {
        let mut args = vec![
            "--name".into(),
            self.name.clone(),
            "--http-addr".into(),
            format!("127.0.0.1:{}", self.http),
            "--grpc-addr".into(),
            format!("127.0.0.1:{}", self.grpc),
            "--events-endpoint".into(),
            format!("tcp://127.0.0.1:{}", self.events),
            "--replay-endpoint".into(),
            format!("tcp://127.0.0.1:{}", self.replay),
        ];
        args.extend_from_slice(extra);
        args
    }

    /// The router's `--replica` value for it.
    pub fn replica_flag(&self) -> String {
        format!(
            "name={},http={},events=tcp://127.0.0.1:{},replay=tcp://127.0.0.1:{},grpc=http://127.0.0.1:{},engine=kvroute",
            self.name,
            self.http_url(),
            self.events,
            self.replay,
            self.grpc
        )
    }
}

/// A process's resident memory from `/proc/<pid>/status`, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Memory {
    /// `VmRSS`: everything resident (anonymous, file-backed and shared).
    pub rss: u64,
    /// `RssAnon`: resident anonymous memory (the heap and stacks): what a leak grows.
    pub rss_anon: u64,
    /// `VmHWM`: the peak of `VmRSS`.
    pub rss_peak: u64,
}

impl Memory {
    /// Reads `pid`'s status; `None` off Linux or once the process is gone.
    pub fn of(pid: u32) -> Option<Self> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        Self::parse(&status)
    }

    /// Parses a `/proc/<pid>/status` page (`VmRSS:\t  1234 kB` lines).
    pub fn parse(status: &str) -> Option<Self> {
        let field = |key: &str| {
            status.lines().find_map(|l| {
                let rest = l.strip_prefix(key)?.strip_prefix(':')?.trim();
                let kb: u64 = rest.strip_suffix("kB").unwrap_or(rest).trim().parse().ok()?;
                Some(kb * 1024)
            })
        };
        Some(Self {
            rss: field("VmRSS")?,
            rss_anon: field("RssAnon").unwrap_or(0),
            rss_peak: field("VmHWM").unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child that refuses its flags (exit code 2) is not started again and again until the
    /// ready timeout: the soak fails at once, naming it.
    #[tokio::test]
    async fn a_child_that_refuses_its_flags_is_not_restarted() {
        let logs = std::env::temp_dir().join(format!("kvroute-procs-{}", std::process::id()));
        std::fs::create_dir_all(&logs).unwrap();
        let refuse = ["-c".to_owned(), "exit 2".to_owned()];
        let client = Client::new(Duration::from_secs(1));
        let started =
            start_ready(Path::new("/bin/sh"), &refuse, "sh", &logs, &client, "http://127.0.0.1:9/").await;
        std::fs::remove_dir_all(&logs).ok();
        assert!(matches!(started, Err(ProcessError::BadFlags { .. })), "{started:?}");
    }

    /// A child is known until it is reaped, and what [`kill_all`] does to the children it
    /// knows kills them.
    #[test]
    fn children_are_known_until_reaped_and_can_be_killed_without_their_handles() {
        let logs = std::env::temp_dir().join(format!("kvroute-procs-kill-{}", std::process::id()));
        std::fs::create_dir_all(&logs).unwrap();
        let mut child =
            Child::spawn(Path::new("/bin/sh"), &["-c".into(), "exec sleep 30".into()], "sleeper", &logs)
                .expect("a child");
        let pid = child.pid();
        assert!(alive().contains(&pid));
        kill([pid]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !child.exited() {
            assert!(Instant::now() < deadline, "the child is still running");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!alive().contains(&pid), "reaped: its pid may be another process's now");
        std::fs::remove_dir_all(&logs).ok();
    }

    #[test]
    fn reads_resident_memory_from_a_status_page() {
        let page = "Name:\tkvroute-router\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\nRssAnon:\t    4096 kB\n";
        let m = Memory::parse(page).unwrap();
        assert_eq!((m.rss, m.rss_anon, m.rss_peak), (10240 * 1024, 4096 * 1024, 20480 * 1024));
        assert_eq!(Memory::parse("Name:\tx\n"), None);
        #[cfg(target_os = "linux")]
        assert!(Memory::of(std::process::id()).is_some_and(|m| m.rss > 0));
    }

    #[test]
    fn the_router_flag_names_every_port() {
        let spec = AgentSpec { name: "agent-1".into(), http: 1, grpc: 2, events: 3, replay: 4 };
        let replica: kvroute_router::config::ReplicaConfig = spec.replica_flag().parse().unwrap();
        assert_eq!(replica.http, "http://127.0.0.1:1");
        assert_eq!(replica.grpc.as_deref(), Some("http://127.0.0.1:2"));
        assert_eq!(replica.events, "tcp://127.0.0.1:3");
        assert_eq!(replica.replay.as_deref(), Some("tcp://127.0.0.1:4"));
    }
}
