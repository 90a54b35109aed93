//! Live runs over real sockets against an in-process fleet (agents at a 1000x time scale):
//! `compare` produces a sane report with every file (and, from the command line, reads the
//! replicas' counters), a replica alone reports its own counters, an unreachable target is
//! counted as connect errors without hanging, and the `demo` entry point completes with tiny
//! flags.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::Parser;
use kvroute_loadgen::cli::{self, Cli};
use kvroute_loadgen::compare::{self, CompareConfig, CompareReport, Routers};
use kvroute_loadgen::demo::{DEMO_MODEL, EmbeddedFleet, FleetConfig};
use kvroute_loadgen::live::{self, Arrivals, LiveConfig, PromptFormat};
use kvroute_loadgen::sim::{self, BlockIdentity, SimConfig};
use kvroute_loadgen::workload::mooncake;
use kvroute_loadgen::workload::synth::ChatParams;
use kvroute_loadgen::{Request, Trace};
use kvroute_replica_agent::cache::{ConfigError, PolicyKind as Eviction};
use kvroute_router::policy::PolicyKind;
use tokio_util::sync::CancellationToken;

/// Upper bound on any one test's live part: a hang fails instead of stalling the suite.
const LIMIT: Duration = Duration::from_secs(30);

fn fleet_config(replicas: usize) -> FleetConfig {
    FleetConfig {
        replicas,
        capacity_blocks: 512,
        block_size: 16,
        eviction: Eviction::Lru,
        time_scale: 1000.0,
        data_parallel_size: 1,
        events: true,
        offload_blocks: 0,
    }
}

/// About 30 chat turns behind one shared system prompt (over 512 tokens, a shared content block), arriving within a fraction of a second.
fn small_chat() -> Trace {
    small_chat_params().generate().unwrap()
}

fn small_chat_params() -> ChatParams {
    ChatParams {
        conversations: 8,
        system_prompts: 1,
        system_prompt_tokens: 1200,
        min_turns: 3,
        max_turns: 5,
        user_tokens: 32,
        output_tokens: 4,
        conversation_rate: 100.0,
        think_time: Duration::from_millis(20),
        seed: 7,
    }
}

/// A directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvroute-loadgen-live-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A compare of `policies`, each behind an embedded router in front of `fleet`, on `live`'s
/// settings; offline replays at the trace's pace, no report files.
fn compare_config(fleet: &EmbeddedFleet, policies: Vec<PolicyKind>, live: LiveConfig) -> CompareConfig {
    CompareConfig {
        routers: Routers::Embedded { config: Box::new(fleet.router_config()), policies },
        replicas: fleet.urls(),
        live,
        block_size: 16,
        total_capacity_blocks: None,
        eviction: Eviction::Lru,
        s3fifo: Default::default(),
        time_scale: 1.0,
        out_dir: None,
        workload: "small chat".into(),
        offline_speedup: Some(1.0),
    }
}

/// `compare` of `trace` on `config`, which must finish within [`LIMIT`] and run.
async fn compared(trace: &Trace, config: &CompareConfig, shutdown: &CancellationToken) -> CompareReport {
    tokio::time::timeout(LIMIT, compare::compare(trace, config, shutdown.clone()))
        .await
        .expect("compare finishes")
        .expect("compare runs")
}

/// A live run of `trace` on `config`, which must finish within [`LIMIT`] and start.
async fn ran(trace: &Trace, config: &LiveConfig, shutdown: CancellationToken) -> live::LiveReport {
    tokio::time::timeout(LIMIT, live::run(trace, config, shutdown))
        .await
        .expect("the run finishes")
        .expect("the run starts")
}

fn quiet(mut config: LiveConfig) -> LiveConfig {
    config.progress = false;
    config.request_timeout = Duration::from_secs(10);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_on_a_small_fleet_writes_a_sane_report() {
    let shutdown = CancellationToken::new();
    let fleet = EmbeddedFleet::start(fleet_config(2), shutdown.child_token()).await.unwrap();
    let trace = small_chat();
    assert!((20..=45).contains(&trace.len()), "{} requests", trace.len());
    let out = TempDir::new("compare");
    let mut live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    live.replicas = fleet.urls();
    live.arrivals = Arrivals::Trace { speedup: 1.0 };
    let config = CompareConfig {
        out_dir: Some(out.0.clone()),
        ..compare_config(&fleet, vec![PolicyKind::CacheAware, PolicyKind::RoundRobin], live)
    };
    let report = compared(&trace, &config, &shutdown).await;

    assert_eq!(report.fleet.total_capacity_blocks, 1024, "read from the agents' metrics");
    assert!(report.pooled_hit_rate > 0.0, "{}", report.table());
    let policies: Vec<_> = report.runs.iter().map(|r| r.policy).collect();
    assert_eq!(policies, [PolicyKind::CacheAware, PolicyKind::RoundRobin]);
    for run in &report.runs {
        let l = &run.live;
        assert_eq!((l.requests, l.succeeded, l.failed()), (trace.len(), trace.len(), 0), "{:?}", l.errors);
        let hit = l.hit_rate.expect("responses report cached_tokens");
        assert!(hit > 0.0 && hit <= 1.0, "{hit}");
        // Each run starts from reset caches, so the counters see exactly the responses' hits.
        assert_eq!(l.fleet_hit_rate, Some(hit), "{}", run.policy.as_str());
        assert!(l.predicted_hit_rate.is_some() && l.router.is_some());
        assert_eq!(l.per_replica.len(), 2);
        assert_eq!(l.per_replica.iter().map(|s| s.prompt_tokens).sum::<u64>(), trace.prompt_tokens());
        assert!(l.load_skew.is_some_and(|s| (1.0..=2.0).contains(&s)));
        assert!(l.ttft.is_some_and(|t| t.p50_ms > 0.0 && t.p99_ms >= t.p50_ms));
        assert!(run.pct_of_pooled.is_some_and(|p| p > 0.0));
        assert!(!l.hit_rate_over_time.is_empty());
        let offline = run.offline.expect("simulated offline too");
        assert!(offline.hit_rate > 0.0 && offline.load_skew >= 1.0);
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.0.join("report.json")).unwrap())
        .expect("report.json parses");
    assert_eq!(json["runs"][0]["policy"], "cache-aware");
    assert_eq!(json["runs"][1]["live"]["requests"], trace.len());
    for svg in ["hit_rate_over_time.svg", "ttft_cdf.svg", "tokens_per_replica.svg"] {
        let text = std::fs::read_to_string(out.0.join(svg)).unwrap();
        assert!(text.starts_with("<svg") && text.contains("round-robin"), "{svg}");
    }
    assert!(report.table().contains("cache-aware"));
    fleet.stop().await;
}

/// A fleet of two agents, and a `policy` router in front of it, stopped by `shutdown`.
async fn fleet_and_router(
    policy: PolicyKind,
    shutdown: &CancellationToken,
) -> (EmbeddedFleet, kvroute_router::RunningRouter) {
    let fleet = EmbeddedFleet::start(fleet_config(2), shutdown.child_token()).await.unwrap();
    let router = compare::start_router(&fleet.router_config(), policy, shutdown.child_token()).await.unwrap();
    (fleet, router)
}

/// A run that fails before it starts (here its router's address is no HTTP URL) ends the
/// comparison with its error, and the report written holds the runs done before it. (The
/// error returned before the report was written, losing every run done.) When no run was
/// done, no report is written (an empty one replaced the last good report in the directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_keeps_the_runs_before_it_in_the_report() {
    let shutdown = CancellationToken::new();
    let (fleet, router) = fleet_and_router(PolicyKind::CacheAware, &shutdown).await;
    let out = TempDir::new("compare-failed");
    let mut live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    live.replicas = fleet.urls();
    live.arrivals = Arrivals::Trace { speedup: 1.0 };
    let routers =
        vec![(PolicyKind::CacheAware, router.url()), (PolicyKind::RoundRobin, "ftp://nowhere".into())];
    let config = CompareConfig {
        routers: Routers::External(routers),
        out_dir: Some(out.0.clone()),
        offline_speedup: None,
        ..compare_config(&fleet, vec![], live)
    };
    let run = tokio::time::timeout(LIMIT, compare::compare(&small_chat(), &config, shutdown.clone()))
        .await
        .expect("compare finishes");
    let err = format!("{:#}", run.expect_err("the round-robin run cannot start"));
    assert!(err.contains("the round-robin run") && err.contains("after 1 runs, reported in"), "{err}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.0.join("report.json")).unwrap())
        .expect("report.json parses");
    assert_eq!(json["runs"].as_array().map(Vec::len), Some(1), "{json}");
    assert_eq!(json["runs"][0]["policy"], "cache-aware");

    // A comparison whose first run fails has nothing to report: the report there stays.
    let written = std::fs::read(out.0.join("report.json")).unwrap();
    let config = CompareConfig {
        routers: Routers::External(vec![(PolicyKind::RoundRobin, "ftp://nowhere".into())]),
        ..config
    };
    let run = tokio::time::timeout(LIMIT, compare::compare(&small_chat(), &config, shutdown.clone()))
        .await
        .expect("compare finishes");
    let err = format!("{:#}", run.expect_err("the round-robin run cannot start"));
    assert!(err.contains("the round-robin run") && !err.contains("reported in"), "{err}");
    assert_eq!(std::fs::read(out.0.join("report.json")).unwrap(), written, "the last report is kept");
    router.stop().await;
    fleet.stop().await;
}

/// A Ctrl-C while a router syncs its replicas ends the wait for it at once, and says so. (It
/// stopped the router, which then never synced: the wait ran out its 15 s and said the
/// router did not sync.) The replica here publishes nothing, so the router is not ready
/// for minutes; the Ctrl-C comes with its first health check.
#[tokio::test]
async fn an_interrupted_router_sync_says_so() {
    let events = format!("tcp://127.0.0.1:{}", kvroute_proto::loopback_port::unused().unwrap());
    let replica = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = replica.local_addr().unwrap();
    let spec = format!("name=r0,http=http://{http},events={events},engine=kvroute").parse().unwrap();
    let config = kvroute_router::Config {
        model: DEMO_MODEL.into(),
        events_fallback_ms: 600_000,
        ..kvroute_router::Config::loopback(vec![spec])
    };
    // Interrupted once the router has started: at its first health check of the replica.
    let shutdown = CancellationToken::new();
    let interrupt = shutdown.clone();
    tokio::spawn(async move {
        let _checked = replica.accept().await;
        interrupt.cancel();
    });
    let started = compare::start_router(&config, PolicyKind::CacheAware, shutdown).await;
    let err = format!("{:#}", started.err().expect("interrupted"));
    assert!(err.contains("interrupted while the cache-aware router synced"), "{err}");
}

/// A comparison told another eviction policy than the agents run is refused before any run:
/// its pooled reference and offline runs would model other caches than the fleet's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_refuses_an_eviction_policy_the_agents_do_not_run() {
    let shutdown = CancellationToken::new();
    let config = FleetConfig { eviction: Eviction::Lfu, ..fleet_config(1) };
    let fleet = EmbeddedFleet::start(config, shutdown.child_token()).await.unwrap();
    let live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    let config = compare_config(&fleet, vec![PolicyKind::CacheAware], live);
    let run = tokio::time::timeout(LIMIT, compare::compare(&small_chat(), &config, shutdown.clone()))
        .await
        .expect("compare finishes");
    let err = format!("{:#}", run.expect_err("lru is not what the agent runs"));
    assert!(err.contains("evicts with lfu, not the lru") && err.contains("give --eviction lfu"), "{err}");
    let s3fifo = CompareConfig { eviction: Eviction::S3fifo, ..config };
    let err = compare::compare(&small_chat(), &s3fifo, shutdown.clone()).await.expect_err("nor is s3fifo");
    assert!(format!("{err:#}").contains("not the s3fifo (small ratio 0.1, max freq 3)"), "{err:#}");
    fleet.stop().await;
}

/// A fleet of one agent with two data-parallel ranks: its two engines' caches are read from
/// its metrics (one `engine` series each), every request is served with the hits the
/// responses and the counters agree on, predicted as the ranks hit, and the offline simulation
/// runs on the engines counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_on_a_data_parallel_agent_reads_each_rank() {
    let shutdown = CancellationToken::new();
    let config = FleetConfig { data_parallel_size: 2, ..fleet_config(1) };
    let fleet = EmbeddedFleet::start(config, shutdown.child_token()).await.unwrap();
    let trace = small_chat();
    let mut live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    live.replicas = fleet.urls();
    live.arrivals = Arrivals::Trace { speedup: 1.0 };
    let config = compare_config(&fleet, vec![PolicyKind::CacheAware], live);
    let report = compared(&trace, &config, &shutdown).await;
    assert_eq!(
        (report.fleet.total_capacity_blocks, report.fleet.engines),
        (1024, 2),
        "two ranks of 512 blocks"
    );
    assert!(report.table().contains("1 replicas (2 engines)"), "{}", report.table());
    let run = &report.runs[0];
    let l = &run.live;
    assert_eq!((l.succeeded, l.failed()), (trace.len(), 0), "{:?}", l.errors);
    let hit = l.hit_rate.expect("responses report cached_tokens");
    assert!(hit > 0.0, "{}", report.table());
    assert_eq!(l.fleet_hit_rate, Some(hit), "both ranks' counters summed");
    // The rank named is the rank that hit: predicted within a block or two (an event still on
    // its way when a request was decided can make the prediction short; a rank left to the
    // agent's balancer would miss by far more).
    let predicted = l.predicted_hit_rate.expect("the router's headers");
    assert!((predicted - hit).abs() < 0.02, "predicted {predicted}, hit {hit}");
    assert!(run.offline.is_some());
    fleet.stop().await;
}

/// Routers without the agents' KV events (`demo --without-events`): the cache-aware router
/// predicts the caches from its own requests, and its predictions are the hits the agents
/// report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_without_events_routes_on_predicted_caches() {
    let shutdown = CancellationToken::new();
    let config = FleetConfig { events: false, ..fleet_config(2) };
    let fleet = EmbeddedFleet::start(config, shutdown.child_token()).await.unwrap();
    let router = fleet.router_config();
    assert!(router.replicas.iter().all(|r| r.events.is_empty() && r.replay.is_none()), "{router:?}");
    assert_eq!(router.predicted_cache_tokens, 512 * 16, "an agent's cache");
    let trace = small_chat();
    let mut live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    live.replicas = fleet.urls();
    live.arrivals = Arrivals::Trace { speedup: 1.0 };
    let mut config = compare_config(&fleet, vec![PolicyKind::CacheAware], live);
    // Credits end at once: the predictions alone steer (the trace is shorter than a credit).
    if let Routers::Embedded { config, .. } = &mut config.routers {
        config.credit_ttl_ms = 1;
    }
    let report = compared(&trace, &config, &shutdown).await;
    let l = &report.runs[0].live;
    assert_eq!((l.succeeded, l.failed()), (trace.len(), 0), "{:?}", l.errors);
    let hit = l.hit_rate.expect("responses report cached_tokens");
    assert!(hit > 0.0, "{}", report.table());
    let predicted = l.predicted_hit_rate.expect("the router's headers");
    assert!((predicted - hit).abs() < 0.05, "predicted {predicted}, hit {hit}");
    fleet.stop().await;
}

/// Agents with host memory (`demo --offload-blocks`) and caches too small for the workload:
/// prefixes they evicted come back from host memory, the router predicts those loads, and
/// the hit rate counts them as the responses do. No offline run is made (the simulator has
/// no host memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_with_host_memory_counts_and_predicts_its_loads() {
    let shutdown = CancellationToken::new();
    let config = FleetConfig { capacity_blocks: 128, offload_blocks: 4096, ..fleet_config(2) };
    let fleet = EmbeddedFleet::start(config, shutdown.child_token()).await.unwrap();
    // Four system prompts: more than the two caches hold, not more than host memory does.
    let trace = ChatParams { system_prompts: 4, seed: 8, ..small_chat_params() }.generate().unwrap();
    let mut live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    live.replicas = fleet.urls();
    live.arrivals = Arrivals::Trace { speedup: 1.0 };
    // (An offline run is asked for: compare drops it, the simulator has no host memory.)
    let config = compare_config(&fleet, vec![PolicyKind::CacheAware], live);
    let report = compared(&trace, &config, &shutdown).await;
    let run = &report.runs[0];
    let l = &run.live;
    assert_eq!((l.succeeded, l.failed()), (trace.len(), 0), "{:?}", l.errors);
    let loaded: u64 = fleet
        .agents
        .iter()
        .map(|a| a.engine.metrics().external_prefix_cache_hits.load(Ordering::Relaxed))
        .sum();
    assert!(loaded > 0, "nothing came back from host memory: {}", report.table());
    let hit = l.fleet_hit_rate.expect("the agents' counters");
    let from_usage = l.hit_rate.expect("responses report cached_tokens");
    assert!((hit - from_usage).abs() < 1e-9, "counters {hit}, responses {from_usage}");
    let predicted = l.predicted_hit_rate.expect("the router's headers");
    assert!((predicted - hit).abs() < 0.05, "predicted {predicted}, hit {hit}");
    assert!(run.offline.is_none());
    // The pooled reference's one cache holds host memory's blocks too: loads are hits.
    assert_eq!(report.fleet.offload_capacity_blocks, 2 * 4096);
    let pooled = run.pct_of_pooled.expect("a pooled reference");
    assert!(pooled <= 100.0 + 1e-9, "{pooled}% of a pooled cache without host memory");
    fleet.stop().await;
}

/// The same chat workload as Anthropic Messages requests (`--prompt-format messages`):
/// every one served, their hits read from Anthropic's usage and predicted by the router (it
/// renders them as the replicas do).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_workload_as_anthropic_messages_is_routed_on_its_cached_prefix() {
    chat_workload_as(PromptFormat::Messages).await;
}

/// The same as OpenAI Responses requests (`--prompt-format responses`): hits read from
/// `input_tokens_details`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_workload_as_openai_responses_is_routed_on_its_cached_prefix() {
    chat_workload_as(PromptFormat::Responses).await;
}

/// The same as SGLang's native `/generate` requests (`--prompt-format generate`): token ids,
/// hits read from `meta_info`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_workload_as_sglang_generate_is_routed_on_its_cached_prefix() {
    chat_workload_as(PromptFormat::Generate).await;
}

async fn chat_workload_as(format: PromptFormat) {
    let shutdown = CancellationToken::new();
    let fleet = EmbeddedFleet::start(fleet_config(2), shutdown.child_token()).await.unwrap();
    let trace = small_chat();
    let mut live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    live.replicas = fleet.urls();
    live.arrivals = Arrivals::Trace { speedup: 1.0 };
    live.prompt = format;
    let config = compare_config(&fleet, vec![PolicyKind::CacheAware], live);
    let report = compared(&trace, &config, &shutdown).await;
    let l = &report.runs[0].live;
    assert_eq!((l.requests, l.succeeded, l.failed()), (trace.len(), trace.len(), 0), "{:?}", l.errors);
    let hit = l.hit_rate.expect("responses report their cached tokens");
    assert!(hit > 0.3, "the shared system prompt is reused: {hit}");
    // (Requests in flight together may see one another's blocks a little late or early.)
    let predicted = l.predicted_hit_rate.expect("the router's predictions");
    assert!((predicted - hit).abs() < 0.05, "predicted {predicted} against {hit}");
    // The chat template's tokens come on top of the workload's (not on token ids').
    let served: u64 = l.per_replica.iter().map(|s| s.prompt_tokens).sum();
    match format {
        PromptFormat::Generate => assert_eq!(served, trace.prompt_tokens()),
        _ => assert!(served > trace.prompt_tokens(), "{served} against {}", trace.prompt_tokens()),
    }
    fleet.stop().await;
}

/// Regression: an offline simulation that cannot run (S3FIFO with 5 blocks a replica has an
/// empty small queue) failed `compare` after the first live run, losing it; it is refused
/// before any live run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_simulation_that_cannot_run_is_refused_before_any_live_run() {
    let shutdown = CancellationToken::new();
    let fleet = EmbeddedFleet::start(fleet_config(2), shutdown.child_token()).await.unwrap();
    let mut live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    live.max_requests = Some(4);
    let config = CompareConfig {
        // The pooled reference's one cache of 10 has a small queue of 1; each replica's 5, none.
        total_capacity_blocks: Some(10),
        eviction: Eviction::S3fifo,
        time_scale: 1.0,
        ..compare_config(&fleet, vec![PolicyKind::RoundRobin], live)
    };
    let run = tokio::time::timeout(LIMIT, compare::compare(&small_chat(), &config, shutdown.clone()))
        .await
        .expect("compare finishes");
    let err = run.expect_err("an offline simulation with an empty small queue ran");
    assert!(
        matches!(
            err.chain().find_map(|e| e.downcast_ref::<sim::SimError>()),
            Some(sim::SimError::Cache(ConfigError::EmptyQueue { small_cap: 0, .. }))
        ),
        "not the empty small queue: {err:#}"
    );
    let client = live::Client::new(LIMIT);
    for url in fleet.urls() {
        let (_, page) = client.get(&format!("{url}/metrics"), LIMIT).await.unwrap();
        let prompts = live::scrape::sum(&String::from_utf8_lossy(&page), "vllm:prompt_tokens_total");
        assert_eq!(prompts.unwrap_or(0.0), 0.0, "{url} was sent requests");
    }
    fleet.stop().await;
}

/// Regression: a run cut short by its duration was set beside the pooled reference and the
/// offline simulation of the whole workload; they are now computed on the requests it served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stopped_early_is_compared_on_the_requests_it_sent() {
    let shutdown = CancellationToken::new();
    let fleet = EmbeddedFleet::start(fleet_config(2), shutdown.child_token()).await.unwrap();
    // The small chat, then all of it again an hour later: the repeats, which would all hit,
    // are due past the run's duration, so they are never sent (whatever the timing).
    let early = small_chat();
    let mut requests = early.requests.clone();
    let hour = Duration::from_secs(3600);
    requests.extend(early.requests.iter().map(|r| Request { arrival: r.arrival + hour, ..r.clone() }));
    let trace = Trace::new(requests);
    let mut live = quiet(LiveConfig::new(String::new(), DEMO_MODEL));
    live.max_duration = Some(Duration::from_secs(60));
    let config = CompareConfig {
        total_capacity_blocks: Some(1024),
        workload: "small chat twice".into(),
        ..compare_config(&fleet, vec![PolicyKind::RoundRobin], live)
    };
    let report = compared(&trace, &config, &shutdown).await;

    let run = &report.runs[0];
    assert_eq!(run.live.requests, early.len());
    assert_eq!(run.compared_requests, early.len(), "compared on what it served");
    let pooled = |t: &Trace| {
        compare::pooled_bound(t, 16, 1024, (Eviction::Lru, Default::default())).unwrap().overall_hit_rate
    };
    assert_eq!(report.pooled_hit_rate, pooled(&trace));
    assert_eq!(run.pooled_hit_rate, pooled(&early));
    assert!(run.pooled_hit_rate < report.pooled_hit_rate, "the repeats would have hit");
    let offline = SimConfig {
        replicas: 2,
        capacity_blocks: 512,
        block_size: 16,
        routing: PolicyKind::RoundRobin,
        blocks: BlockIdentity::Tokens,
        ..SimConfig::default()
    };
    let offline = sim::simulate(&early, &offline).unwrap();
    assert_eq!(run.offline.expect("simulated offline").hit_rate, offline.overall_hit_rate);
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_s_metrics_name_every_replica_behind_it() {
    let shutdown = CancellationToken::new();
    let (fleet, router) = fleet_and_router(PolicyKind::RoundRobin, &shutdown).await;
    // No request yet: the names come from the router's own list, not from any response.
    let snapshot = live::scrape::snapshot(&live::Client::new(LIMIT), &router.url(), &[]).await;
    assert_eq!(snapshot.router_replicas, ["agent-0", "agent-1"]);
    assert_eq!(
        snapshot.router_eligible.as_deref(),
        Some(&["agent-0".to_string(), "agent-1".to_string()][..])
    );
    router.stop().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_run_against_one_replica_reads_its_counters_without_router_headers() {
    let shutdown = CancellationToken::new();
    let fleet = EmbeddedFleet::start(fleet_config(1), shutdown.child_token()).await.unwrap();
    let trace = small_chat();
    let mut config = quiet(LiveConfig::new(fleet.urls()[0].clone(), DEMO_MODEL));
    config.replicas = fleet.urls();
    config.arrivals = Arrivals::Closed { concurrency: 4 };
    config.max_requests = Some(12);
    config.stream = false;
    let report = ran(&trace, &config, shutdown.clone()).await;
    assert_eq!((report.requests, report.succeeded), (12, 12));
    assert!(report.ttft.is_none() && report.e2e.is_some(), "no TTFT without a stream");
    assert_eq!(report.predicted_hit_rate, None);
    assert!(report.router.is_none());
    assert_eq!(report.fleet_hit_rate, report.hit_rate);
    assert_eq!(report.load_skew, Some(1.0));
    fleet.stop().await;
}

/// Regression (coordinated omission): every request is due at once and one may be in flight,
/// so each waits for those before it; measured from its intended send, its latency includes
/// that wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_loop_request_that_waited_for_a_slot_is_measured_from_its_intended_send() {
    let shutdown = CancellationToken::new();
    let fleet = EmbeddedFleet::start(fleet_config(1), shutdown.child_token()).await.unwrap();
    let mut trace = small_chat();
    for r in &mut trace.requests {
        r.arrival = Duration::ZERO;
    }
    let mut config = quiet(LiveConfig::new(fleet.urls()[0].clone(), DEMO_MODEL));
    config.arrivals = Arrivals::Trace { speedup: 1.0 };
    config.max_in_flight = 1;
    config.max_requests = Some(4);
    let report = ran(&trace, &config, shutdown.clone()).await;
    assert_eq!(report.succeeded, 4, "{:?}", report.errors);

    let mut records = report.records.clone();
    records.sort_by_key(|r| r.sent);
    let mut served_so_far = Duration::ZERO;
    for r in &records {
        let e2e = r.outcome.as_ref().unwrap().e2e;
        served_so_far += e2e;
        let lateness = r.lateness().expect("an open-loop request has an intended send");
        assert!(lateness + e2e >= served_so_far, "{r:?} waited for none before it");
    }
    let (service, from_intended) = (report.e2e.unwrap(), report.e2e_from_intended.unwrap());
    assert!(from_intended.max_ms > service.max_ms, "{from_intended:?} vs {service:?}");
    assert!(report.send_lateness.is_some_and(|l| l.max_ms > 0.0));
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_target_counts_connect_errors_and_does_not_hang() {
    // Outside the ephemeral range: no other test's listener, nor a self-connect, can answer.
    let addr = format!("127.0.0.1:{}", kvroute_proto::loopback_port::unused().unwrap());
    let trace = small_chat();
    for arrivals in [Arrivals::Closed { concurrency: 3 }, Arrivals::Poisson { rate: 500.0, seed: 1 }] {
        let mut config = quiet(LiveConfig::new(format!("http://{addr}"), DEMO_MODEL));
        config.replicas = vec![format!("http://{addr}")];
        config.arrivals = arrivals;
        config.max_requests = Some(10);
        let report = ran(&trace, &config, CancellationToken::new()).await;
        assert_eq!((report.requests, report.succeeded), (10, 0));
        assert_eq!(report.errors.get("connect"), Some(&10), "{:?}", report.errors);
        assert_eq!((report.hit_rate, report.fleet_hit_rate), (None, None));
    }
}

/// Regression: a tiny speed-up panicked (`Duration::div_f64`), and a tiny Poisson rate put
/// every request at 0; both are schedules no run can keep, refused before anything is sent.
#[tokio::test]
async fn a_schedule_past_what_a_run_can_wait_is_an_error() {
    let trace = small_chat();
    for arrivals in [Arrivals::Trace { speedup: 1e-300 }, Arrivals::Poisson { rate: 1e-300, seed: 1 }] {
        let mut config = quiet(LiveConfig::new("http://127.0.0.1:9", DEMO_MODEL));
        config.arrivals = arrivals;
        let run = live::run(&trace, &config, CancellationToken::new()).await;
        assert!(matches!(run, Err(live::LiveError::Schedule(_))), "{arrivals:?}: {run:?}");
    }
}

#[test]
fn the_demo_entry_point_completes_with_tiny_flags() {
    let out = TempDir::new("demo");
    let dir = out.0.to_str().unwrap();
    let args = [
        "kvroute-loadgen",
        "demo",
        "--replicas",
        "2",
        "--capacity-blocks",
        "256",
        "--time-scale",
        "1000",
        "--requests",
        "16",
        "--policies",
        "cache-aware,round-robin",
        "--no-progress",
        "--out",
        dir,
        "chat",
        "--conversations",
        "6",
        "--system-prompt-tokens",
        "128",
        "--output-tokens",
        "4",
        "--conversation-rate",
        "100",
        "--think-time",
        "10ms",
    ];
    cli::run(Cli::parse_from(args)).expect("the demo runs");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.0.join("report.json")).unwrap()).unwrap();
    let runs = json["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for run in runs {
        assert_eq!(run["live"]["requests"], 16);
        assert_eq!(run["live"]["succeeded"], 16);
    }
    assert!(out.0.join("table.txt").exists());
}

/// `compare` from the command line (`--replica`, routers started here) reads every replica's
/// counters: the fleet's hit rate is there and the per-replica shares are by replica URL,
/// not rebuilt from the router's headers.
#[test]
fn compare_from_the_command_line_reads_the_replicas_counters() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let shutdown = CancellationToken::new();
    let fleet = runtime.block_on(EmbeddedFleet::start(fleet_config(2), shutdown.child_token())).unwrap();
    let tmp = TempDir::new("compare-cli");
    let (trace, out) = (tmp.0.join("chat.jsonl"), tmp.0.join("report"));
    mooncake::write(&small_chat(), std::fs::File::create(&trace).unwrap()).unwrap();
    let mut args: Vec<String> =
        ["kvroute-loadgen", "compare", "--no-progress", "--no-offline"].map(String::from).into();
    for replica in fleet.router_config().replicas {
        args.extend(["--replica".into(), replica.to_string()]);
    }
    args.extend(["--block-size", "16", "--policies", "round-robin"].map(String::from));
    args.extend([
        "--out".into(),
        out.to_str().unwrap().into(),
        "--trace".into(),
        trace.to_str().unwrap().into(),
    ]);
    cli::run(Cli::parse_from(args)).expect("compare runs");

    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let live = &json["runs"][0]["live"];
    assert!(live["fleet_hit_rate"].as_f64().is_some_and(|h| h > 0.0), "no fleet counters: {live}");
    let named: Vec<&str> =
        live["per_replica"].as_array().unwrap().iter().map(|s| s["replica"].as_str().unwrap()).collect();
    assert_eq!(named, fleet.urls(), "per-replica shares not from the replicas' counters");
    runtime.block_on(fleet.stop());
}

/// A live run against a router with `--api-key` sends the key it is given with every
/// completion: served with it, every request refused (401, counted) without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_run_sends_the_api_key_a_router_asks_for() {
    let shutdown = CancellationToken::new();
    let fleet = EmbeddedFleet::start(fleet_config(1), shutdown.child_token()).await.unwrap();
    let config = kvroute_router::Config { api_key: vec!["sk-load".into()], ..fleet.router_config() };
    let router = kvroute_router::start(config, shutdown.child_token()).await.unwrap();
    let trace = small_chat();
    for (authorization, served) in [(None, false), (Some("Bearer sk-load"), true)] {
        let mut live = quiet(LiveConfig::new(router.url(), DEMO_MODEL));
        live.authorization = authorization.map(http::HeaderValue::from_static);
        let report = ran(&trace, &live, shutdown.clone()).await;
        match served {
            true => assert_eq!((report.succeeded, report.failed()), (trace.len(), 0), "{:?}", report.errors),
            false => {
                assert_eq!(report.errors.get("http_401"), Some(&(trace.len() as u64)), "{:?}", report.errors)
            }
        }
    }
    shutdown.cancel();
    fleet.stop().await;
}

/// A live run reaches a router serving HTTPS that asks clients for a certificate (mutual
/// TLS): with the authority trusted and a certificate it signed, every request is served;
/// without the certificate, none is, and the run still ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_run_reaches_a_router_over_mutual_tls() {
    let dir = TempDir::new("mutual-tls");
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let signed = |names: Vec<String>, usage: rcgen::ExtendedKeyUsagePurpose, name: &str| {
        let mut params = rcgen::CertificateParams::new(names).unwrap();
        params.extended_key_usages = vec![usage];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        let (cert_path, key_path) = (dir.0.join(format!("{name}.crt")), dir.0.join(format!("{name}.key")));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    };
    let server = signed(vec!["127.0.0.1".into()], rcgen::ExtendedKeyUsagePurpose::ServerAuth, "server");
    let client = signed(vec!["loadgen".into()], rcgen::ExtendedKeyUsagePurpose::ClientAuth, "client");
    let ca_path = dir.0.join("ca.crt");
    std::fs::write(&ca_path, ca_cert.pem()).unwrap();

    let shutdown = CancellationToken::new();
    let fleet = EmbeddedFleet::start(fleet_config(1), shutdown.child_token()).await.unwrap();
    let config = kvroute_router::Config {
        tls_cert: Some(server.0.clone()),
        tls_key: Some(server.1.clone()),
        tls_client_ca: Some(ca_path.clone()),
        ..fleet.router_config()
    };
    let router = kvroute_router::start(config, shutdown.child_token()).await.unwrap();
    assert!(router.url().starts_with("https://"), "{}", router.url());
    let trace = small_chat();
    for (identity, served) in [(None, false), (Some((client.0.as_path(), client.1.as_path())), true)] {
        let mut live = quiet(LiveConfig::new(router.url(), DEMO_MODEL));
        live.tls = Some(kvroute_proto::serve::client_config(Some(&ca_path), identity).unwrap());
        let report = ran(&trace, &live, shutdown.clone()).await;
        match served {
            true => assert_eq!((report.succeeded, report.failed()), (trace.len(), 0), "{:?}", report.errors),
            false => assert_eq!(
                (report.succeeded, report.failed()),
                (0, trace.len() as u64),
                "{:?}",
                report.errors
            ),
        }
    }
    let refused =
        kvroute_proto::serve::client_config(Some(&server.1), None).expect_err("a key is no authority");
    assert!(refused.contains("server.key: no certificate"), "{refused}");
    shutdown.cancel();
    fleet.stop().await;
}
