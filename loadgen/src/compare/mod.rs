//! `compare`: the same workload, live, once per routing policy against one fleet, in one
//! report beside the pooled reference.
//!
//! The router has no runtime policy switch, so each policy gets its own router: either
//! started here, in this process, in front of the given replicas ([`Routers::Embedded`]; one
//! at a time, stopped after its run), or one already running per policy
//! ([`Routers::External`]). Before each run every replica's prefix cache is reset
//! (`POST /reset_prefix_cache`), so runs are independent and each starts cold.
//!
//! The pooled reference is the offline simulator's ([`crate::sim`]): one cache of the
//! fleet's total capacity (given, or summed from the agents' `kvroute_agent_capacity_blocks`)
//! replaying the same requests, blocks named by the fleet's hash chain at its block size, and
//! evicting as the agents say they do (`kvroute_agent_cache_policy`, checked against the
//! policy the comparison is given).
//!
//! Each policy can also be simulated offline on the same requests ([`OfflineRun`]), so the
//! report shows live beside offline.
//!
//! A run stopped early (`--duration`, Ctrl-C) served only part of the workload; its pooled
//! reference and offline simulation are then computed on exactly the requests it served
//! (sent, and not cancelled in flight by a Ctrl-C), so its row compares like with like (the
//! report's own pooled figure is the whole workload's).
//!
//! - [`report`]: the [`CompareReport`], its terminal table and JSON.
//! - [`plots`]: SVG plots (hit rate over time, TTFT CDF, prompt tokens per replica).

pub mod plots;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvroute_replica_agent::cache::{self, S3FifoParams};
use kvroute_router::config::Config as RouterConfig;
use kvroute_router::policy::PolicyKind;
use tokio_util::sync::CancellationToken;

pub use report::{CompareReport, FleetSummary, OfflineRun, PolicyRun, WorkloadSummary};

use crate::live::{self, Client, LiveConfig};
use crate::sim::{self, BlockIdentity, EngineModel, SimConfig};
use crate::workload::Trace;

/// Where each policy's router comes from.
#[derive(Clone, Debug)]
pub enum Routers {
    /// Start a router per policy in this process, from this config (its `policy` is set per
    /// run, its replicas are the fleet).
    Embedded { config: Box<RouterConfig>, policies: Vec<PolicyKind> },
    /// One running router per policy, by base URL.
    External(Vec<(PolicyKind, String)>),
}

impl Routers {
    pub fn policies(&self) -> Vec<PolicyKind> {
        match self {
            Routers::Embedded { policies, .. } => policies.clone(),
            Routers::External(list) => list.iter().map(|(p, _)| *p).collect(),
        }
    }

    /// Whether the routers follow no replica's KV events, each predicting the caches from its
    /// own requests (as the offline runs then do, [`SimConfig::predicted`]). Running routers'
    /// configuration is not known here: taken to follow events.
    fn predict_caches(&self) -> bool {
        match self {
            Routers::Embedded { config, .. } => {
                !config.replicas.is_empty() && config.replicas.iter().all(|r| r.events.is_empty())
            }
            Routers::External(_) => false,
        }
    }
}

/// What to compare.
#[derive(Clone, Debug)]
pub struct CompareConfig {
    pub routers: Routers,
    /// Base URLs of the replicas' HTTP APIs (caches reset, metrics read).
    pub replicas: Vec<String>,
    /// How each run sends the workload; `target` and `label` are set per policy, and
    /// `replicas` is always [`CompareConfig::replicas`], so every run reads the fleet's
    /// counters whoever built this config.
    pub live: LiveConfig,
    /// Tokens per KV block on the replicas.
    pub block_size: usize,
    /// The fleet's total cache capacity in blocks; read from the agents' metrics if `None`.
    pub total_capacity_blocks: Option<usize>,
    /// The replicas' eviction policy, for the pooled reference and the offline runs.
    pub eviction: cache::PolicyKind,
    /// The replicas' S3FIFO settings, with [`cache::PolicyKind::S3fifo`].
    pub s3fifo: S3FifoParams,
    /// The agents' `--time-scale`, for the report (1 for real engines).
    pub time_scale: f64,
    /// Where the report (JSON and SVGs) goes; nothing is written if `None`.
    pub out_dir: Option<PathBuf>,
    /// What the workload is, for the report.
    pub workload: String,
    /// Also simulate each policy offline, arrivals divided by this (trace speed-up over the
    /// agents' time scale); `None` skips it.
    pub offline_speedup: Option<f64>,
}

impl CompareConfig {
    /// The replicas' cache, as the pooled reference replays it.
    fn cache(&self) -> (cache::PolicyKind, S3FifoParams) {
        (self.eviction, self.s3fifo)
    }
}

/// How long the replicas get to answer a cache reset, and a router to become ready.
const RESET_TIMEOUT: Duration = Duration::from_secs(10);
const READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a router named with `--router` gets to answer `/ready`.
const EXTERNAL_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `trace` once per policy and writes the report to `config.out_dir`.
pub async fn compare(
    trace: &Trace,
    config: &CompareConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<CompareReport> {
    let client = Client::with_tls(Duration::from_secs(2), config.live.tls());
    let sent = config
        .live
        .max_requests
        .map_or(trace.clone(), |n| Trace::in_order(trace.requests[..n.min(trace.len())].to_vec()));
    let caches = match config.total_capacity_blocks {
        Some(c) => Caches { total_blocks: c, count: config.replicas.len(), host_blocks: 0 },
        None => fleet_capacity(&client, &config.replicas, config.cache())
            .await
            .context("reading the fleet's caches (give the capacity with --capacity-blocks)")?,
    };
    // Host memory's loads are hits: the pooled cache holds its blocks too, and the offline
    // simulator, which has none, is no reference.
    let mut config = config.clone();
    if caches.host_blocks > 0 && config.offline_speedup.take().is_some() {
        eprintln!(
            "compare: the replicas offload to host memory, which the offline simulator lacks: no offline runs"
        );
    }
    let config = &config;
    let total_capacity = caches.total_blocks;
    let pooled = pooled_bound(&sent, config.block_size, total_capacity + caches.host_blocks, config.cache())?;
    // An offline simulation that cannot run would fail after its live run, losing every run
    // done by then: check them all first.
    if let Some(speedup) = config.offline_speedup {
        for policy in config.routers.policies() {
            sim::check(&sent, &offline_config(caches, config, policy, speedup))
                .with_context(|| format!("the offline simulation of {} cannot run", policy.as_str()))?;
        }
    }

    // A run that fails (its router not ready, a replica refusing the cache reset) ends the
    // comparison; the report holds the runs done before it.
    let (mut runs, mut failed) = (Vec::new(), None);
    for policy in config.routers.policies() {
        if shutdown.is_cancelled() {
            break;
        }
        match run_policy(policy, config, &client, (caches, &pooled, &sent), &shutdown).await {
            Ok(run) => runs.push(run),
            // Interrupted (a Ctrl-C): the runs done are the comparison.
            Err(e) if shutdown.is_cancelled() => {
                eprintln!("compare: interrupted: {e:#}");
                break;
            }
            Err(e) => {
                failed = Some(e.context(format!("the {} run", policy.as_str())));
                break;
            }
        }
    }
    let report = CompareReport {
        workload: WorkloadSummary::of(&config.workload, &sent, config.live.prompt),
        fleet: FleetSummary {
            replicas: config.replicas.len(),
            engines: caches.count,
            total_capacity_blocks: total_capacity,
            offload_capacity_blocks: caches.host_blocks,
            block_size: config.block_size,
            eviction: config.eviction,
            s3fifo: (config.eviction == cache::PolicyKind::S3fifo).then_some(config.s3fifo),
            time_scale: config.time_scale,
        },
        pooled_hit_rate: pooled.overall_hit_rate,
        runs,
    };
    // With no run done there is nothing to report: a report written earlier in the directory
    // is left as it was.
    if report.runs.is_empty() {
        return Err(
            failed.unwrap_or_else(|| anyhow::anyhow!("interrupted before any run: nothing to report"))
        );
    }
    if let Some(dir) = &config.out_dir {
        write(&report, dir)?;
    }
    match failed {
        Some(e) => {
            let written = config.out_dir.as_ref().map(|dir| format!(", reported in {}", dir.display()));
            let ran = report.runs.len();
            Err(e.context(format!("compare stopped after {ran} runs{}", written.unwrap_or_default())))
        }
        None => Ok(report),
    }
}

/// `compare`'s run of `sent` behind `policy`, on `caches` reset first, beside its pooled
/// reference (`pooled`, of all of `sent`).
async fn run_policy(
    policy: PolicyKind,
    config: &CompareConfig,
    client: &Client,
    (caches, pooled, sent): (Caches, &sim::PooledBound, &Trace),
    shutdown: &CancellationToken,
) -> anyhow::Result<PolicyRun> {
    let total_capacity = caches.total_blocks;
    reset_caches(client, &config.replicas).await?;
    let mut live = config.live.clone();
    live.label = policy.as_str().into();
    live.replicas.clone_from(&config.replicas);
    let report = match &config.routers {
        Routers::Embedded { config: router, .. } => {
            // The run ends with the router: a router that fails (its proxy, its admin server)
            // cancels its token, and the run is that policy's failure, not a run cut short.
            let router_shutdown = shutdown.child_token();
            let router = start_router(router, policy, router_shutdown.clone()).await?;
            if shutdown.is_cancelled() {
                router.stop().await;
                anyhow::bail!("interrupted before the {} run", policy.as_str());
            }
            live.target = router.url();
            let report = live::run(sent, &live, router_shutdown).await;
            let failure = router.failure().map(str::to_owned);
            router.stop().await;
            if let Some(why) = failure {
                anyhow::bail!("the router failed: {why}");
            }
            report?
        }
        Routers::External(list) => {
            live.target = list.iter().find(|(p, _)| *p == policy).map(|(_, u)| u.clone()).unwrap_or_default();
            live::validate(&live)?;
            wait_ready(client, &live.target, EXTERNAL_READY_TIMEOUT, shutdown).await?;
            if shutdown.is_cancelled() {
                anyhow::bail!("interrupted before the {} run", policy.as_str());
            }
            live::run(sent, &live, shutdown.clone()).await?
        }
    };
    // A run cut short (--duration, Ctrl-C) is compared on the requests it served.
    let ran = requests_served(sent, &report);
    let (ran, pooled_hit_rate) = match &ran {
        Some(ran) => {
            let pooled_capacity = total_capacity + caches.host_blocks;
            (ran, pooled_bound(ran, config.block_size, pooled_capacity, config.cache())?.overall_hit_rate)
        }
        None => (sent, pooled.overall_hit_rate),
    };
    let offline = match config.offline_speedup {
        Some(speedup) => Some(offline(ran, config, caches, policy, speedup)?),
        None => None,
    };
    Ok(PolicyRun::new(policy, report, ran.len(), pooled_hit_rate, offline))
}

/// The requests of `trace` that `run` served, if not all of them: a run stopped early sent
/// only some, and those it cancelled in flight (Ctrl-C) are left out too, since no answer
/// came back for them, as are those no cache saw: those that found no connection (the router
/// down or restarting) and those refused before they ran (a 4xx, from the router or a
/// replica, such as a prompt longer than a replica's cache holds; a 503: no replica could
/// take it, or the replica's queue was full). Requests that failed otherwise (a timeout, a
/// 502, a stream cut off) count as served: a replica may have run them. A replica may still
/// have prefilled a cancelled request, so a hit rate from the replicas' counters can include
/// its lookups while these figures leave it out.
fn requests_served(trace: &Trace, run: &live::LiveReport) -> Option<Trace> {
    let mut served: Vec<usize> = run
        .records
        .iter()
        .filter(|r| match r.outcome {
            Err(live::ErrorKind::Cancelled | live::ErrorKind::Connect | live::ErrorKind::Unsent) => false,
            Err(live::ErrorKind::Status(status)) => !(400..500).contains(&status) && status != 503,
            _ => true,
        })
        .map(|r| r.index)
        .collect();
    if served.len() == trace.len() {
        return None;
    }
    served.sort_unstable();
    Some(Trace::in_order(served.into_iter().filter_map(|i| trace.requests.get(i).cloned()).collect()))
}

/// Writes `report.json` and the plots into `dir` (created if missing).
pub fn write(report: &CompareReport, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = dir.join("report.json");
    let text = serde_json::to_string_pretty(report).context("serialising the report")?;
    std::fs::write(&json, text + "\n").with_context(|| format!("writing {}", json.display()))?;
    std::fs::write(dir.join("table.txt"), report.table())
        .with_context(|| format!("writing {}/table.txt", dir.display()))?;
    plots::write_all(report, dir)
}

/// One cache of `capacity` blocks replaying `trace`: the pooled reference. Not an upper
/// bound: separate caches can beat one shared cache (a scan on one replica does not evict
/// another's hot prompts), so a policy can reach more than 100% of it.
pub fn pooled_bound(
    trace: &Trace,
    block_size: usize,
    capacity: usize,
    (eviction, s3fifo): (cache::PolicyKind, S3FifoParams),
) -> anyhow::Result<sim::PooledBound> {
    let config = SimConfig {
        replicas: 1,
        capacity_blocks: capacity,
        block_size,
        eviction,
        s3fifo,
        blocks: BlockIdentity::Tokens,
        engine: None,
        ..SimConfig::default()
    };
    Ok(sim::simulate(trace, &config).context("simulating the pooled reference")?.pooled)
}

/// The offline simulator's view of the same run: `policy` over the fleet's caches, with the
/// agents' default engine model for load.
fn offline(
    trace: &Trace,
    config: &CompareConfig,
    caches: Caches,
    policy: PolicyKind,
    speedup: f64,
) -> anyhow::Result<OfflineRun> {
    let sim = offline_config(caches, config, policy, speedup);
    let report =
        sim::simulate(trace, &sim).with_context(|| format!("simulating {} offline", policy.as_str()))?;
    Ok(OfflineRun {
        hit_rate: report.overall_hit_rate,
        load_skew: report.load_skew,
        pct_of_pooled: report.pct_of_pooled,
        ttft_p50_ms: report.latency.map(|l| l.ttft_p50_ms),
        ttft_p99_ms: report.latency.map(|l| l.ttft_p99_ms),
    })
}

/// The fleet's prefix caches: their blocks together, and how many there are (an agent's
/// data-parallel ranks have one each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Caches {
    total_blocks: usize,
    count: usize,
    /// Blocks of host memory the engines offload to, in all.
    host_blocks: usize,
}

/// The offline simulator's setup for `policy`: a replica a cache (a data-parallel rank is
/// simulated as a replica of its own, the router choosing ranks as it does replicas), the
/// fleet's capacity split evenly.
fn offline_config(caches: Caches, config: &CompareConfig, policy: PolicyKind, speedup: f64) -> SimConfig {
    let replicas = caches.count.max(1);
    SimConfig {
        replicas,
        capacity_blocks: caches.total_blocks / replicas,
        block_size: config.block_size,
        eviction: config.eviction,
        s3fifo: config.s3fifo,
        routing: policy,
        blocks: BlockIdentity::Tokens,
        speedup,
        engine: Some(EngineModel::default()),
        predicted: config.routers.predict_caches(),
        ..SimConfig::default()
    }
}

/// The replicas' `kvroute_agent_capacity_blocks`: their sum, and how many engines report one.
/// Each agent's eviction policy must be `cache`, the one the pooled reference and the offline
/// runs replay (an agent that does not say is taken at its word).
async fn fleet_capacity(
    client: &Client,
    replicas: &[String],
    cache: (cache::PolicyKind, S3FifoParams),
) -> anyhow::Result<Caches> {
    let mut caches = Caches { total_blocks: 0, count: 0, host_blocks: 0 };
    for url in replicas {
        let (_, body) = client
            .get(&format!("{url}/metrics"), RESET_TIMEOUT)
            .await
            .map_err(|e| anyhow::anyhow!("GET {url}/metrics: {}", e.label()))?;
        let page = String::from_utf8_lossy(&body);
        let agent =
            page_caches(&page).with_context(|| format!("{url} exports no kvroute_agent_capacity_blocks"))?;
        caches.total_blocks += agent.total_blocks;
        caches.count += agent.count;
        caches.host_blocks += agent.host_blocks;
        for evicts in page_policies(&page) {
            let evicts = evicts.map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
            anyhow::ensure!(
                evicts.same(cache),
                "{url} evicts with {evicts}, not the {} the comparison was given: give --eviction {}",
                Eviction::from(cache),
                evicts.flags(),
            );
        }
    }
    Ok(caches)
}

/// An eviction policy as an agent states it, with its settings where they matter.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Eviction {
    policy: cache::PolicyKind,
    s3fifo: Option<S3FifoParams>,
}

impl From<(cache::PolicyKind, S3FifoParams)> for Eviction {
    fn from((policy, params): (cache::PolicyKind, S3FifoParams)) -> Self {
        Eviction { policy, s3fifo: (policy == cache::PolicyKind::S3fifo).then_some(params) }
    }
}

impl Eviction {
    fn name(&self) -> String {
        clap::ValueEnum::to_possible_value(&self.policy).map(|v| v.get_name().to_owned()).unwrap_or_default()
    }

    fn same(&self, cache: (cache::PolicyKind, S3FifoParams)) -> bool {
        *self == Eviction::from(cache)
    }

    /// The `compare` flags that name it.
    fn flags(&self) -> String {
        match self.s3fifo {
            Some(p) => format!(
                "{} --s3fifo-small-ratio {} --s3fifo-max-freq {}",
                self.name(),
                p.small_ratio,
                p.max_freq
            ),
            None => self.name(),
        }
    }
}

impl std::fmt::Display for Eviction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.s3fifo {
            Some(p) => write!(f, "{} (small ratio {}, max freq {})", self.name(), p.small_ratio, p.max_freq),
            None => f.write_str(&self.name()),
        }
    }
}

/// Each engine's eviction policy on an agent's metrics page (`kvroute_agent_cache_policy`),
/// or what is wrong with its sample.
fn page_policies(page: &str) -> Vec<Result<Eviction, String>> {
    kvroute_proto::prometheus::samples(page, "kvroute_agent_cache_policy")
        .map(|sample| {
            let name = sample.label("policy").unwrap_or_default();
            let policy = <cache::PolicyKind as clap::ValueEnum>::from_str(name, false).map_err(|_| {
                format!("an eviction policy it names {name:?}, which this load generator does not know")
            })?;
            let defaults = S3FifoParams::default();
            let small_ratio = sample.label("small_ratio").map_or(Ok(defaults.small_ratio), str::parse::<f64>);
            let max_freq = sample.label("max_freq").map_or(Ok(defaults.max_freq), str::parse::<u8>);
            match (small_ratio, max_freq) {
                (Ok(small_ratio), Ok(max_freq)) => {
                    Ok(Eviction::from((policy, S3FifoParams { small_ratio, max_freq })))
                }
                _ => Err(format!("S3FIFO settings that do not read as numbers: {:?}", sample.labels)),
            }
        })
        .collect()
}

/// One agent's caches on its metrics page: one `kvroute_agent_capacity_blocks` sample an
/// engine (`engine="r"`), and as many `kvroute_agent_offload_capacity_blocks` of its host
/// memory.
fn page_caches(page: &str) -> Option<Caches> {
    let samples =
        |name| kvroute_proto::prometheus::samples(page, name).map(|s| s.value).collect::<Vec<f64>>();
    let engines = samples("kvroute_agent_capacity_blocks");
    let host_blocks = samples("kvroute_agent_offload_capacity_blocks").iter().sum::<f64>() as usize;
    (!engines.is_empty()).then(|| Caches {
        total_blocks: engines.iter().sum::<f64>() as usize,
        count: engines.len(),
        host_blocks,
    })
}

/// `POST /reset_prefix_cache` on every replica, retrying while one answers 409 (requests
/// still hold blocks).
pub async fn reset_caches(client: &Client, replicas: &[String]) -> anyhow::Result<()> {
    for url in replicas {
        let deadline = Instant::now() + RESET_TIMEOUT;
        loop {
            match client.post_empty(&format!("{url}/reset_prefix_cache"), RESET_TIMEOUT).await {
                Ok((status, _)) if status.is_success() => break,
                Ok((status, _)) if status.as_u16() == 409 && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok((status, body)) => {
                    anyhow::bail!(
                        "{url}/reset_prefix_cache answered {status}: {}",
                        String::from_utf8_lossy(&body)
                    )
                }
                Err(e) => anyhow::bail!("{url}/reset_prefix_cache failed: {}", e.label()),
            }
        }
    }
    Ok(())
}

/// Waits until the router at `url` answers `/ready` with 200 (it has synced every replica
/// once): a run against a router that is still syncing, or down, would measure nothing. A
/// shutdown ends the wait (and the run that follows).
async fn wait_ready(
    client: &Client,
    url: &str,
    timeout: Duration,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let ready = format!("{url}/ready");
    loop {
        let answer = tokio::select! {
            answer = client.get(&ready, RESET_TIMEOUT) => answer,
            () = shutdown.cancelled() => return Ok(()),
        };
        match answer {
            Ok((status, _)) if status.is_success() => return Ok(()),
            _ if Instant::now() < deadline => tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
                () = shutdown.cancelled() => return Ok(()),
            },
            Ok((status, body)) => anyhow::bail!(
                "the router at {url} was not ready within {timeout:?}: /ready answered {status}: {}",
                String::from_utf8_lossy(&body)
            ),
            Err(e) => anyhow::bail!(
                "the router at {url} was not ready within {timeout:?}: /ready failed: {}",
                e.label()
            ),
        }
    }
}

/// Starts a router with `policy` and waits until it has synced every replica.
pub async fn start_router(
    config: &RouterConfig,
    policy: PolicyKind,
    shutdown: CancellationToken,
) -> anyhow::Result<kvroute_router::RunningRouter> {
    let config = RouterConfig { policy, ..config.clone() };
    let router = kvroute_router::start(config, shutdown).await.context("starting a router")?;
    let deadline = Instant::now() + READY_TIMEOUT;
    while !router.fleet().ready() {
        if let Some(why) = router.failure().map(str::to_owned) {
            router.stop().await;
            anyhow::bail!("the {} router failed: {why}", policy.as_str());
        }
        // (A Ctrl-C stops the router: it would never sync.)
        if router.parts.token().is_cancelled() {
            // (A part that failed cancels the token too, after it says why.)
            let failure = router.failure().map(str::to_owned);
            router.stop().await;
            if let Some(why) = failure {
                anyhow::bail!("the {} router failed: {why}", policy.as_str());
            }
            anyhow::bail!("interrupted while the {} router synced", policy.as_str());
        }
        if Instant::now() >= deadline {
            router.stop().await;
            anyhow::bail!(
                "the {} router did not sync every replica within {READY_TIMEOUT:?}",
                policy.as_str()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(router)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::{ErrorKind, LiveReport, RequestRecord, Success, scrape::Snapshot};
    use crate::workload::Request;

    fn record(index: usize, outcome: Result<Success, ErrorKind>) -> RequestRecord {
        RequestRecord { index, intended: None, sent: Duration::ZERO, outcome }
    }

    /// An agent of two data-parallel ranks is two caches, simulated offline as two replicas
    /// (one cache of both ranks' capacity hit more than the live fleet could).
    #[test]
    fn each_engine_of_an_agent_is_a_cache() {
        let page = "# TYPE kvroute_agent_capacity_blocks gauge\n\
                    kvroute_agent_capacity_blocks{model_name=\"m\",engine=\"0\"} 512\n\
                    kvroute_agent_capacity_blocks{model_name=\"m\",engine=\"1\"} 512\n\
                    kvroute_agent_offload_capacity_blocks{model_name=\"m\",engine=\"0\"} 4096\n\
                    kvroute_agent_offload_capacity_blocks{model_name=\"m\",engine=\"1\"} 4096\n";
        assert_eq!(page_caches(page), Some(Caches { total_blocks: 1024, count: 2, host_blocks: 8192 }));
        assert_eq!(page_caches("vllm:num_requests_running 1\n"), None);
    }

    /// An agent's eviction policy is read from its metrics page, S3FIFO's settings with it.
    #[test]
    fn agents_state_their_eviction_policy() {
        let page = "kvroute_agent_cache_policy{model_name=\"m\",engine=\"0\",policy=\"lru\"} 1\n\
                    kvroute_agent_cache_policy{model_name=\"m\",engine=\"1\",policy=\"s3fifo\",small_ratio=\"0.25\",max_freq=\"2\"} 1\n\
                    kvroute_agent_cache_policy{model_name=\"m\",engine=\"2\",policy=\"arc\"} 1\n";
        let [lru, s3fifo, unknown] = page_policies(page).try_into().unwrap();
        let lru = lru.unwrap();
        assert!(lru.same((cache::PolicyKind::Lru, S3FifoParams { small_ratio: 0.5, max_freq: 1 })));
        assert!(!lru.same((cache::PolicyKind::Lfu, S3FifoParams::default())));
        let s3fifo = s3fifo.unwrap();
        assert!(s3fifo.same((cache::PolicyKind::S3fifo, S3FifoParams { small_ratio: 0.25, max_freq: 2 })));
        assert!(!s3fifo.same((cache::PolicyKind::S3fifo, S3FifoParams::default())));
        assert_eq!(s3fifo.flags(), "s3fifo --s3fifo-small-ratio 0.25 --s3fifo-max-freq 2");
        assert!(unknown.unwrap_err().contains("\"arc\""));
        assert!(page_policies("vllm:num_requests_running 1\n").is_empty());
    }

    /// Routers that follow no events are simulated offline as they route, on caches they
    /// predict (with LFU or S3FIFO agents, the two modes' hit rates differ widely).
    #[test]
    fn offline_runs_predict_caches_where_the_routers_do() {
        let replica = |events: &str| {
            format!("name=r,http=http://127.0.0.1:1,events={events},engine=kvroute").parse().unwrap()
        };
        let config = |events: &str| CompareConfig {
            routers: Routers::Embedded {
                config: Box::new(RouterConfig::loopback(vec![replica(events)])),
                policies: vec![PolicyKind::CacheAware],
            },
            replicas: Vec::new(),
            live: LiveConfig::new("", "m"),
            block_size: 16,
            total_capacity_blocks: None,
            eviction: cache::PolicyKind::Lfu,
            s3fifo: S3FifoParams::default(),
            time_scale: 1.0,
            out_dir: None,
            workload: String::new(),
            offline_speedup: Some(1.0),
        };
        let caches = Caches { total_blocks: 64, count: 1, host_blocks: 0 };
        let offline = |events| offline_config(caches, &config(events), PolicyKind::CacheAware, 1.0);
        assert!(offline("").predicted);
        assert!(!offline("tcp://127.0.0.1:2").predicted);
    }

    /// The pooled reference replays the agents' S3FIFO as configured, not seed 000's
    /// defaults.
    #[test]
    fn the_pooled_reference_uses_the_agents_s3fifo_settings() {
        let chat = crate::workload::synth::ChatParams { conversations: 40, ..Default::default() };
        let trace = crate::workload::synth::Workload::Chat(chat).generate().unwrap();
        let p = |small_ratio, max_freq| cache::S3FifoParams { small_ratio, max_freq };
        let pooled = |params| pooled_bound(&trace, 16, 400, (cache::PolicyKind::S3fifo, params)).unwrap();
        let (wide, default) = (pooled(p(0.5, 1)), pooled(S3FifoParams::default()));
        let direct = SimConfig {
            replicas: 1,
            capacity_blocks: 400,
            block_size: 16,
            eviction: cache::PolicyKind::S3fifo,
            s3fifo: p(0.5, 1),
            engine: None,
            blocks: BlockIdentity::Tokens,
            ..SimConfig::default()
        };
        assert_eq!(wide, sim::simulate(&trace, &direct).unwrap().pooled);
        assert_ne!(wide.total_hit_tokens, default.total_hit_tokens, "the settings matter on this trace");
    }

    /// A router whose `/ready` gives `answers`, then 503s; the request lines seen go on `asked`.
    async fn readying_router(answers: Vec<u16>) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, asked) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            for code in answers.into_iter().chain(std::iter::repeat(503)) {
                let Ok((mut conn, _)) = listener.accept().await else { return };
                let mut head = vec![0; 1024];
                let n = conn.read(&mut head).await.unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&head[..n]).lines().next().unwrap_or("").to_owned());
                let reply = format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = conn.write_all(reply.as_bytes()).await;
            }
        });
        (url, asked)
    }

    #[tokio::test]
    async fn a_run_waits_for_its_router_to_be_ready() {
        let client = Client::new(Duration::from_secs(2));
        let (url, mut asked) = readying_router(vec![503, 503, 200]).await;
        let shutdown = CancellationToken::new();
        wait_ready(&client, &url, Duration::from_secs(30), &shutdown).await.unwrap();
        for _ in 0..3 {
            assert_eq!(asked.recv().await.unwrap(), "GET /ready HTTP/1.1");
        }
        let (url, _) = readying_router(vec![]).await;
        let err =
            wait_ready(&client, &url, Duration::from_millis(300), &shutdown).await.unwrap_err().to_string();
        assert!(err.contains("not ready") && err.contains("503"), "{err}");
        // A shutdown ends the wait at once.
        shutdown.cancel();
        wait_ready(&client, &url, Duration::from_secs(3600), &shutdown).await.unwrap();
    }

    /// Regression: a run stopped by Ctrl-C had the requests it cancelled in flight replayed
    /// by its pooled reference and offline simulation, though the fleet never served them;
    /// so had requests refused before they ran (a prompt longer than an agent's cache, 400).
    #[test]
    fn requests_cancelled_refused_or_never_connected_are_not_compared() {
        let trace = Trace::new(
            (0..6)
                .map(|i| Request {
                    arrival: Duration::from_secs(i),
                    input_len: 10 + i as usize,
                    output_len: 1,
                    hash_ids: vec![i],
                    segments: Vec::new(),
                })
                .collect(),
        );
        let report = |records| {
            let none = Snapshot::default();
            LiveReport::new("x".into(), "t".into(), records, &[], &none, &none)
        };
        let all_sent = report(vec![
            record(0, Ok(Success::default())),
            record(1, Err(ErrorKind::Status(504))),
            record(2, Err(ErrorKind::Cancelled)),
            record(3, Err(ErrorKind::Connect)),
            record(4, Err(ErrorKind::Status(400))),
            record(5, Err(ErrorKind::Status(503))),
        ]);
        let served = requests_served(&trace, &all_sent).expect("a request was cancelled");
        let expected: Vec<Request> = [0, 1].map(|i| trace.requests[i].clone()).into();
        assert_eq!(served.requests, expected);
        // A run that served every request is compared on the whole workload.
        let whole = report((0..6).map(|i| record(i, Err(ErrorKind::Timeout))).collect());
        assert_eq!(requests_served(&trace, &whole), None);
    }
}
