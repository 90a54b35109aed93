//! The soak: a steady Poisson load through a router process in front of replica-agent
//! processes, with churn (one replica killed and restarted on the same ports every
//! `churn_interval`, rotating), sampled every `sample_interval` for the router's memory,
//! its index size, request outcomes and the hit rate. Issue 8 asks that memory stay flat once
//! warm; [`report::Flatness`] says whether it did.
//!
//! - The router and the agents are the `kvroute-router` and `kvroute-agent` binaries run as
//!   children ([`procs`]), so the router's `/proc/<pid>/status` is its own memory. A kill is a
//!   SIGKILL: the replica's running streams are cut (the router ends them with an error
//!   event) and its event stream closes; the new process has a new epoch, sequence 0 and an
//!   empty cache.
//! - Requests are a synthetic workload with shared prefixes (multi-turn chat by default),
//!   sent in order at Poisson arrivals as streams with `include_usage`; every one finishes as
//!   a success, a loss to churn or an unexpected error by kind ([`tally`]).
//! - [`report`]: samples, the per-minute table, the verdict and the files.
//! - [`command`]: the `soak` subcommand and its default workload.

pub mod command;
pub mod procs;
pub mod report;
pub mod tally;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use procs::Binaries;
pub use report::{Flatness, Sample, SoakReport};

use crate::demo::DEMO_MODEL;
use crate::live::{Client, client, scrape};
use crate::workload::Trace;
use procs::{AgentSpec, Child, Memory};
use tally::Tally;

/// What to run.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    pub binaries: Binaries,
    /// Replica agents.
    pub replicas: usize,
    /// Requests per second (Poisson).
    pub rate: f64,
    /// How long requests are sent.
    pub duration: Duration,
    /// A replica is killed and restarted this often (rotating); `None`: no churn.
    pub churn_interval: Option<Duration>,
    /// How often the router is sampled.
    pub sample_interval: Duration,
    /// Prefix-cache capacity of each agent, in blocks.
    pub capacity_blocks: usize,
    pub block_size: u32,
    /// The agents' `--time-scale`.
    pub time_scale: f64,
    /// Most requests in flight; an arrival waits for a slot.
    pub max_in_flight: usize,
    pub request_timeout: Duration,
    pub seed: u64,
    /// How prompts are written (text: the router tokenizes, and its tokenizer cache fills).
    pub prompt: client::PromptFormat,
    /// More flags for the router, after the soak's own.
    pub router_args: Vec<String>,
    /// Where the report and the children's logs go.
    pub out_dir: PathBuf,
    /// The workload's description, for the report.
    pub workload: String,
    /// Print a line to stderr at every minute of the run.
    pub progress: bool,
}

/// Longest prompt plus completion the agents and the router accept.
const MAX_MODEL_LEN: u32 = 131_072;

/// Runs the soak over `trace` (sent in order; the run ends early if it runs out) and writes
/// the report into `config.out_dir`. Cancelling `shutdown` ends the run early, with a report.
pub async fn run(
    trace: &Trace,
    config: &SoakConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<SoakReport> {
    anyhow::ensure!(config.rate.is_finite() && config.rate > 0.0, "the rate must be positive");
    anyhow::ensure!(config.replicas > 0 && config.max_in_flight > 0, "need a replica and an in-flight slot");
    anyhow::ensure!(
        config.max_in_flight <= tokio::sync::Semaphore::MAX_PERMITS,
        "--max-in-flight must be at most {}",
        tokio::sync::Semaphore::MAX_PERMITS
    );
    anyhow::ensure!(
        !config.sample_interval.is_zero() && config.churn_interval.is_none_or(|d| !d.is_zero()),
        "the sample and churn intervals must be longer than zero"
    );
    anyhow::ensure!(!config.request_timeout.is_zero(), "--timeout must be longer than zero");
    let logs = config.out_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let client = Client::new(Duration::from_secs(2));

    // Until every process is ready, an interruption drops (kills) those started so far.
    let starting = async {
        let mut agents = Vec::with_capacity(config.replicas);
        for i in 0..config.replicas {
            let spec = AgentSpec::reserve(format!("agent-{i}"))?;
            let child = start_agent(config, &spec, &logs, &client).await?;
            agents.push((spec, child));
        }
        let router_port = procs::free_port()?;
        let router_url = format!("http://127.0.0.1:{router_port}");
        let mut args = vec![
            "--listen".to_owned(),
            format!("127.0.0.1:{router_port}"),
            "--admin-listen".into(),
            format!("127.0.0.1:{}", procs::free_port()?),
            "--model".into(),
            DEMO_MODEL.into(),
            "--block-size".into(),
            config.block_size.to_string(),
            "--health-interval-ms".into(),
            "500".into(),
            "--max-prompt-tokens".into(),
            MAX_MODEL_LEN.to_string(),
        ];
        for (spec, _) in &agents {
            args.extend(["--replica".into(), spec.replica_flag()]);
        }
        args.extend(config.router_args.iter().cloned());
        let router = procs::start_ready(
            &config.binaries.router,
            &args,
            "router",
            &logs,
            &client,
            &format!("{router_url}/ready"),
        )
        .await?;
        tracing::info!(pid = router.pid(), url = %router_url, "router ready");
        anyhow::Ok((agents, router, router_url))
    };
    let (agents, router, router_url) = tokio::select! {
        started = starting => started?,
        () = shutdown.cancelled() => anyhow::bail!("interrupted while starting the processes"),
    };

    let tally = Tally::default();
    let stop = shutdown.child_token();
    let start = Instant::now();
    let load = tokio::spawn(send_load(
        trace.clone(),
        Load {
            client: client.clone(),
            target: router_url.clone(),
            config: config.clone(),
            tally: tally.clone(),
        },
        start,
        stop.clone(),
    ));
    let mut churn = tokio::spawn(churn(
        config.clone(),
        agents,
        logs.clone(),
        client.clone(),
        tally.clone(),
        stop.clone(),
    ));

    let mut samples = Vec::new();
    let mut previous = tally::Totals::default();
    let mut ticks = tokio::time::interval(config.sample_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut load = load;
    // The churn's end, if it came first: it runs until `stop`, and one that fails (a panic
    // drops, and so kills, every agent) ends the run, not the rest of it on an empty fleet.
    let mut churned = None;
    let stopped_early = loop {
        tokio::select! {
            _ = ticks.tick() => {
                let s = sample(&client, &router_url, router.pid(), start, &tally, &previous).await;
                let minute = |s: &Sample| (s.t_s / 60.0) as u64;
                if config.progress && samples.last().is_some_and(|p| minute(p) < minute(&s)) {
                    eprintln!("{}", progress_line(&s));
                }
                previous = s.totals.clone();
                samples.push(s);
            }
            outcome = &mut load => {
                break match outcome {
                    Ok(LoadEnd::Duration) => None,
                    Ok(LoadEnd::Exhausted) => Some(format!("the workload ran out after {} requests", trace.len())),
                    Ok(LoadEnd::Cancelled) => Some("interrupted".into()),
                    Err(e) => Some(format!("the load task failed: {e}")),
                };
            }
            ended = &mut churn => {
                let why = match &ended {
                    // At a Ctrl-C the churn ends at once, the load once its requests have:
                    // this arm's guard, read as the select began, would not have known.
                    Ok(_) if stop.is_cancelled() => "interrupted".to_owned(),
                    Ok(_) => "the churn task ended before the run".to_owned(),
                    Err(e) => format!("the churn task failed: {e}"),
                };
                churned = Some(ended);
                break Some(why);
            }
        }
    };
    stop.cancel();
    let churned = match churned {
        Some(ended) => {
            // The load stops on `stop`: its last requests are counted before the last sample.
            if let Err(e) = load.await {
                tracing::error!(error = %e, "the load task failed");
            }
            ended
        }
        None => churn.await,
    };
    let agents = churned.unwrap_or_else(|e| {
        tracing::error!(error = %e, "the churn task failed");
        Vec::new()
    });
    let last = sample(&client, &router_url, router.pid(), start, &tally, &previous).await;
    let duration_s = last.t_s;
    samples.push(last);
    router.kill();
    drop(agents);

    let report = SoakReport::new(settings(config, trace), samples, duration_s, stopped_early);
    report.write(&config.out_dir)?;
    Ok(report)
}

/// One line about a sample, for the terminal.
fn progress_line(s: &Sample) -> String {
    let mb = |v: Option<u64>| v.map_or("-".into(), |v| format!("{:.1} MB", v as f64 / (1024.0 * 1024.0)));
    format!(
        "{:>4.0} s: router RSS {}, index {} ({} entries), tokenizer cache {}; {} done, {} lost to churn, {} unexpected errors; {} restarts",
        s.t_s,
        mb(s.router_rss),
        mb(s.index_memory_bytes),
        s.index_entries.map_or("-".into(), |e| e.to_string()),
        mb(s.tokenize_cache_bytes),
        s.totals.done,
        s.totals.lost_to_churn,
        s.totals.unexpected_errors(),
        s.replica_restarts
    )
}

/// The report's record of the settings.
fn settings(config: &SoakConfig, trace: &Trace) -> BTreeMap<String, String> {
    let mut s = BTreeMap::new();
    let mut put = |k: &str, v: String| s.insert(k.to_owned(), v);
    put("router", config.binaries.router.display().to_string());
    put("agent", config.binaries.agent.display().to_string());
    put("replicas", config.replicas.to_string());
    put("rate_per_s", config.rate.to_string());
    put("duration_s", config.duration.as_secs_f64().to_string());
    put("churn_interval_s", config.churn_interval.map_or("none".into(), |d| d.as_secs_f64().to_string()));
    put("sample_interval_s", config.sample_interval.as_secs_f64().to_string());
    put("capacity_blocks", config.capacity_blocks.to_string());
    put("block_size", config.block_size.to_string());
    put("time_scale", config.time_scale.to_string());
    put("max_in_flight", config.max_in_flight.to_string());
    put("seed", config.seed.to_string());
    put("prompt_format", format!("{:?}", config.prompt).to_lowercase());
    put("router_args", config.router_args.join(" "));
    put("workload", format!("{} ({} requests available)", config.workload, trace.len()));
    s
}

async fn start_agent(
    config: &SoakConfig,
    spec: &AgentSpec,
    logs: &Path,
    client: &Client,
) -> Result<Child, procs::ProcessError> {
    let extra = [
        "--capacity-blocks".to_owned(),
        config.capacity_blocks.to_string(),
        "--block-size".into(),
        config.block_size.to_string(),
        "--time-scale".into(),
        config.time_scale.to_string(),
        "--max-model-len".into(),
        MAX_MODEL_LEN.to_string(),
        "--model".into(),
        DEMO_MODEL.into(),
    ];
    let url = format!("{}/health", spec.http_url());
    procs::start_ready(&config.binaries.agent, &spec.args(&extra), &spec.name, logs, client, &url).await
}

/// Every `churn_interval`, kills the next agent and starts it again on its ports. Returns the
/// agents when `stop` fires, for the caller to stop.
async fn churn(
    config: SoakConfig,
    mut agents: Vec<(AgentSpec, Child)>,
    logs: PathBuf,
    client: Client,
    tally: Tally,
    stop: CancellationToken,
) -> Vec<(AgentSpec, Child)> {
    let Some(every) = config.churn_interval else {
        stop.cancelled().await;
        return agents;
    };
    let mut next = 0;
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return agents,
            _ = ticks.tick() => {}
        }
        let (spec, child) = agents.remove(next);
        tally.killing(&spec.name);
        child.kill();
        let restarted = tokio::select! {
            restarted = start_agent(&config, &spec, &logs, &client) => restarted,
            // The run is over: the replica it was restarting stays down.
            () = stop.cancelled() => return agents,
        };
        match restarted {
            Ok(child) => {
                tracing::info!(replica = %spec.name, pid = child.pid(), "replica restarted");
                tally.restarted();
                agents.insert(next, (spec, child));
                next += 1;
            }
            Err(e) => {
                // The fleet is one replica short from here on; the samples show it. The next
                // replica has moved into its place: it goes next.
                tracing::error!(replica = %spec.name, error = %format!("{e:#}"), "restarting a replica failed");
                if agents.is_empty() {
                    stop.cancelled().await;
                    return agents;
                }
            }
        }
        next %= agents.len().max(1);
    }
}

/// What every request task needs.
#[derive(Clone)]
struct Load {
    client: Client,
    target: String,
    config: SoakConfig,
    tally: Tally,
}

/// Why sending stopped.
enum LoadEnd {
    Duration,
    Exhausted,
    Cancelled,
}

/// Sends `trace`'s requests in order at Poisson arrivals until the duration is over, then
/// waits for the ones in flight. Arrivals due before the end that found every slot taken
/// until then are counted as unexpected errors, `unsent` (a stalled fleet held the slots).
async fn send_load(trace: Trace, load: Load, start: Instant, stop: CancellationToken) -> LoadEnd {
    let mut rng = StdRng::seed_from_u64(load.config.seed);
    let mut next_gap = || {
        let u: f64 = rng.random();
        Duration::try_from_secs_f64(-(1.0 - u).ln() / load.config.rate).unwrap_or(Duration::ZERO)
    };
    let slots = Arc::new(Semaphore::new(load.config.max_in_flight));
    let tracker = TaskTracker::new();
    let deadline = start + load.config.duration;
    let mut at = start;
    let mut end = LoadEnd::Exhausted;
    for (i, request) in trace.requests.iter().enumerate() {
        at += next_gap();
        if at >= deadline {
            end = LoadEnd::Duration;
            break;
        }
        // The wait for a free slot ends at the deadline too (a stalled fleet holding every
        // slot would otherwise stretch the run).
        let due = async {
            tokio::time::sleep_until(at.into()).await;
            slots.clone().acquire_owned().await
        };
        let permit = tokio::select! {
            biased;
            () = stop.cancelled() => { end = LoadEnd::Cancelled; break }
            () = crate::live::until(Some(deadline)) => {
                let mut unsent = 1;
                for _ in &trace.requests[i + 1..] {
                    at += next_gap();
                    if at >= deadline {
                        break;
                    }
                    unsent += 1;
                }
                load.tally.unsent(unsent);
                end = LoadEnd::Duration;
                break
            }
            permit = due => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let body = client::request_body(DEMO_MODEL, request, true, load.config.prompt);
        let prompt_tokens = request.input_len as u64;
        let load = load.clone();
        let stop = stop.clone();
        load.tally.sent(Instant::now().saturating_duration_since(at));
        tracker.spawn(async move {
            let sent = Instant::now();
            let timeout = load.config.request_timeout;
            let (outcome, replica) = tokio::select! {
                done = load.client.complete_naming_replica(&load.target, body, true, prompt_tokens, timeout) => done,
                () = stop.cancelled() => (Err(client::ErrorKind::Cancelled), None),
            };
            load.tally.finished(sent, replica.as_deref(), &outcome);
            drop(permit);
        });
    }
    tracker.close();
    tracker.wait().await;
    end
}

/// One sample: the router's memory and counters, the totals, the window's hit rates.
async fn sample(
    client: &Client,
    router_url: &str,
    router_pid: u32,
    start: Instant,
    tally: &Tally,
    previous: &tally::Totals,
) -> Sample {
    let memory = Memory::of(router_pid);
    let page = match client.get(&format!("{router_url}/metrics"), Duration::from_secs(5)).await {
        Ok((status, body)) if status.is_success() => Some(String::from_utf8_lossy(&body).into_owned()),
        Ok((status, _)) => {
            tracing::warn!(%status, "router metrics refused");
            None
        }
        Err(kind) => {
            tracing::warn!(error = kind.label(), "router metrics scrape failed");
            None
        }
    };
    let metric = |name: &str| page.as_deref().and_then(|p| scrape::sum(p, name)).map(|v| v as u64);
    let totals = tally.totals();
    let (window_hit_rate, window_predicted_hit_rate) = report::window_rates(previous, &totals);
    Sample {
        t_s: start.elapsed().as_secs_f64(),
        router_rss: memory.map(|m| m.rss),
        router_rss_anon: memory.map(|m| m.rss_anon),
        index_memory_bytes: metric("kvroute_ingest_index_memory_bytes"),
        index_entries: metric("kvroute_ingest_index_entries"),
        tokenize_cache_bytes: metric("kvroute_router_tokenize_cache_bytes"),
        router_in_flight: metric("kvroute_router_in_flight"),
        router_seen_restarts: metric("kvroute_ingest_restarts_total"),
        router_index_clears: metric("kvroute_ingest_clears_total"),
        replica_restarts: tally.restarts() as u64,
        totals,
        window_hit_rate,
        window_predicted_hit_rate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Request;

    /// A target that takes requests and closes each connection `after` (never, if `None`)
    /// without answering.
    async fn mute_target(after: Option<Duration>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                match after {
                    Some(after) => drop(tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        drop(stream);
                    })),
                    None => held.push(stream),
                }
            }
        });
        target
    }

    /// One slot, a rate far past what it can take, and `duration`.
    fn one_slot(duration: Duration) -> SoakConfig {
        SoakConfig {
            binaries: Binaries { router: PathBuf::new(), agent: PathBuf::new() },
            replicas: 1,
            rate: 200.0,
            duration,
            churn_interval: None,
            sample_interval: Duration::from_secs(1),
            capacity_blocks: 16,
            block_size: 16,
            time_scale: 1.0,
            max_in_flight: 1,
            request_timeout: Duration::from_millis(500),
            seed: 7,
            prompt: client::PromptFormat::Ids,
            router_args: Vec::new(),
            out_dir: PathBuf::new(),
            workload: String::new(),
            progress: false,
        }
    }

    fn trace() -> Trace {
        let request = Request {
            arrival: Duration::ZERO,
            input_len: 1,
            output_len: 1,
            hash_ids: vec![1],
            segments: Vec::new(),
        };
        Trace::in_order(vec![request; 1000])
    }

    /// Arrivals due while a stalled fleet holds every slot, up to the run's end, are counted
    /// as `unsent` errors: they were left out of every count, and the run read as clean. They
    /// count as requests done, not sent.
    #[tokio::test]
    async fn arrivals_that_find_no_slot_by_the_end_are_counted() {
        let (target, config) = (mute_target(None).await, one_slot(Duration::from_millis(300)));
        let (trace, tally) = (trace(), Tally::default());
        let load = Load { client: Client::new(Duration::from_secs(1)), target, config, tally: tally.clone() };
        let end = send_load(trace, load, Instant::now(), CancellationToken::new()).await;
        assert!(matches!(end, LoadEnd::Duration));
        let totals = tally.totals();
        let unsent = totals.unexpected.get("unsent").copied().unwrap_or(0);
        // At 200 a second for 0.3 s, about 60 due: one sent (it timed out), the rest not.
        assert!(unsent >= 20, "{totals:?}");
        assert_eq!(totals.unexpected.get("timeout"), Some(&1), "{totals:?}");
        assert_eq!((totals.sent, totals.done, totals.in_flight()), (1, unsent + 1, 0), "{totals:?}");
    }

    /// A request sent after its arrival time (its slot was taken) is counted late, and the
    /// report says the rate asked was not kept: the run's load was less than it claims.
    #[tokio::test]
    async fn sends_behind_their_arrival_times_are_counted_late() {
        let target = mute_target(Some(Duration::from_millis(250))).await;
        let (config, tally) = (one_slot(Duration::from_millis(700)), Tally::default());
        let load = Load { client: Client::new(Duration::from_secs(1)), target, config, tally: tally.clone() };
        send_load(trace(), load, Instant::now(), CancellationToken::new()).await;
        let totals = tally.totals();
        assert!(totals.sent >= 2 && totals.late >= 1, "{totals:?}");
        assert!(totals.most_late_ms >= super::tally::LATE.as_millis() as u64, "{totals:?}");
    }
}
