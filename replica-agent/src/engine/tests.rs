//! The engine with a real publisher on loopback: seed-000 hits, events, snapshots, pinning.

use super::*;
use crate::cache::PolicyKind;
use crate::publisher::Publisher;
use kvroute_proto::CacheNamespace;
use std::time::Duration;

async fn engine(capacity: usize, max_num_seqs: usize) -> (Engine, CancellationToken) {
    engine_waiting(capacity, max_num_seqs, 100).await
}

async fn engine_waiting(
    capacity: usize,
    max_num_seqs: usize,
    max_waiting: usize,
) -> (Engine, CancellationToken) {
    start(config(capacity, max_num_seqs, max_waiting)).await
}

fn config(capacity: usize, max_num_seqs: usize, max_waiting: usize) -> EngineConfig {
    EngineConfig {
        replica: "r".into(),
        epoch: Epoch(1),
        dp_rank: 0,
        cache: CacheConfig {
            capacity_blocks: capacity,
            block_size: 4,
            policy: PolicyKind::Lru,
            s3fifo: Default::default(),
        },
        offload_blocks: 0,
        max_num_seqs,
        max_num_batched_tokens: 64,
        max_waiting,
        timing: TimingModel { time_scale: 1000.0, ..TimingModel::default() },
        seed: 0,
        shutdown_grace: Duration::from_secs(5),
    }
}

async fn start(config: EngineConfig) -> (Engine, CancellationToken) {
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    let publisher = Publisher::on_loopback(&tracker).await.unwrap();
    (Engine::start(config, publisher, &tracker, shutdown.clone()).unwrap(), shutdown)
}

fn job(tokens: Vec<u32>, max_tokens: u32) -> Job {
    Job::new(CacheNamespace::new("m"), tokens, 4, max_tokens)
}

async fn run(engine: &Engine, job: Job) -> (Vec<Output>, Usage) {
    let mut rx = engine.submit(job).unwrap();
    let mut outputs = Vec::new();
    while let Some(o) = rx.recv().await {
        let done = matches!(o, Output::Done(_) | Output::Failed(_));
        outputs.push(o);
        if done {
            break;
        }
    }
    let Some(Output::Done(usage)) = outputs.last().cloned() else { panic!("not done: {outputs:?}") };
    (outputs, usage)
}

/// Regression: timers wake on whole milliseconds, and each step's lateness was forgiven, so
/// a step shorter than 1 ms took 1 ms whatever the time scale: 300 decode steps of ~60 µs
/// (`--time-scale 100`) took 300 ms, not ~18. (Paused time: the timer's ticks, no load.)
#[tokio::test(start_paused = true)]
async fn short_steps_keep_their_length_under_a_large_time_scale() {
    let mut config = config(64, 8, 100);
    config.timing.time_scale = 100.0;
    let step = config.timing.wall(config.timing.step(0, 1));
    assert!(step < Duration::from_micros(200), "{step:?}");
    let (engine, shutdown) = start(config).await;
    let started = tokio::time::Instant::now();
    run(&engine, job((0..8).collect(), 300)).await;
    let took = started.elapsed();
    assert!(took < step * 300 * 2, "{took:?} for 300 steps of {step:?}");
    shutdown.cancel();
}

/// A scheduler whose event publisher stopped (its task failed) fails the requests it holds
/// and ends with an error (which stops the agent): what it caches would reach no router.
/// Before, it went on serving with a warning for each batch dropped.
#[tokio::test]
async fn a_scheduler_whose_publisher_stopped_fails() {
    let (engine, scheduler) =
        Engine::new(config(64, 8, 100), Publisher::stopped(), CancellationToken::new()).unwrap();
    let scheduler = tokio::spawn(scheduler);
    let mut rx = engine.submit(job((0..18).collect(), 50)).unwrap();
    let mut last = None;
    while let Some(output) = rx.recv().await {
        // Stopping as it fails the request: the agent answers 503 (retry elsewhere), not 500.
        if matches!(output, Output::Failed(_)) {
            assert!(engine.is_stopping());
        }
        last = Some(output);
    }
    assert!(matches!(&last, Some(Output::Failed(why)) if why.contains("publisher")), "{last:?}");
    assert!(matches!(engine.submit(job(vec![1], 1)), Err(SubmitError::ShuttingDown)));
    assert_eq!(scheduler.await.unwrap(), Err("its event publisher stopped".to_owned()));
}

#[tokio::test]
async fn repeated_prompt_hits_its_full_blocks() {
    let (engine, _shutdown) = engine(64, 8).await;
    let prompt: Vec<u32> = (0..18).collect(); // 4 full blocks + 2 tokens
    let (outputs, first) = run(&engine, job(prompt.clone(), 5)).await;
    assert_eq!(first, Usage { prompt_tokens: 18, completion_tokens: 5, cached_tokens: 0 });
    assert_eq!(outputs.iter().filter(|o| matches!(o, Output::Token(_))).count(), 5);
    let (_, second) = run(&engine, job(prompt.clone(), 5)).await;
    assert_eq!(second.cached_tokens, 16, "min(4 * 4, 18)");
    // A prompt sharing two blocks then diverging hits exactly two.
    let mut other = prompt[..8].to_vec();
    other.extend([100, 101, 102, 103, 104]);
    let (_, third) = run(&engine, job(other, 1)).await;
    assert_eq!(third.cached_tokens, 8);
    let m = engine.metrics();
    assert_eq!(m.prefix_cache_queries.load(Ordering::Relaxed), 18 + 18 + 13);
    assert_eq!(m.prefix_cache_hits.load(Ordering::Relaxed), 16 + 8);
}

/// A prefix evicted from the cache but held in host memory is loaded, not computed: its
/// tokens count as cached, and the external counter has them alone. A reset clears both.
#[tokio::test]
async fn a_prefix_in_host_memory_is_loaded() {
    let (engine, _shutdown) = start(EngineConfig { offload_blocks: 16, ..config(6, 8, 100) }).await;
    let prompt: Vec<u32> = (0..18).collect(); // 4 full blocks + 2 tokens
    run(&engine, job(prompt.clone(), 1)).await;
    // Two prompts of three blocks each push it out of the 6-block cache.
    for p in 1..3u32 {
        run(&engine, job((0..12).map(|t| t + p * 1000).collect(), 1)).await;
    }
    let first = CacheNamespace::new("m").chain(&prompt, 4)[0];
    assert!(!engine.resident().contains(&first), "evicted from the cache");
    let (_, again) = run(&engine, job(prompt.clone(), 1)).await;
    assert_eq!(again.cached_tokens, 16, "all four blocks loaded");
    let m = engine.metrics();
    assert_eq!(m.prefix_cache_hits.load(Ordering::Relaxed), 0);
    assert_eq!(m.external_prefix_cache_hits.load(Ordering::Relaxed), 16);
    assert_eq!(m.offloaded_blocks.load(Ordering::Relaxed), 4 + 3 + 3);
    assert!(engine.reset_prefix_cache().await.is_ok());
    assert_eq!(m.offloaded_blocks.load(Ordering::Relaxed), 0);
    assert_eq!(run(&engine, job(prompt, 1)).await.1.cached_tokens, 0, "host memory cleared too");
}

#[tokio::test]
async fn snapshot_lists_resident_blocks_parent_first() {
    let (engine, _shutdown) = engine(6, 8).await;
    for p in 0..3u32 {
        let tokens: Vec<u32> = (0..12).map(|t| t + p * 1000).collect();
        run(&engine, job(tokens, 1)).await;
    }
    let snapshot = engine.snapshot(true);
    let resident: std::collections::HashSet<u64> = engine.resident().into_iter().map(|h| h.0).collect();
    let listed: std::collections::HashSet<u64> = snapshot.blocks.iter().map(|b| b.hash).collect();
    assert_eq!(listed, resident);
    assert_eq!(resident.len(), 6, "capacity 6 with 9 blocks stored: LRU keeps the last 6");
    let mut seen = std::collections::HashSet::new();
    for b in &snapshot.blocks {
        if let Some(p) = b.parent {
            assert!(seen.contains(&p) || !resident.contains(&p), "parent listed before child");
        }
        assert_eq!(b.token_ids.len(), 4);
        seen.insert(b.hash);
    }
    assert!(snapshot.seq.is_some());
}

#[tokio::test]
async fn reset_clears_the_cache_when_idle() {
    let (engine, _shutdown) = engine(64, 8).await;
    let prompt: Vec<u32> = (0..8).collect();
    run(&engine, job(prompt.clone(), 1)).await;
    assert_eq!(engine.reset_prefix_cache().await, Ok(2));
    let (_, usage) = run(&engine, job(prompt, 1)).await;
    assert_eq!(usage.cached_tokens, 0);
}

#[tokio::test]
async fn a_request_waits_while_blocks_are_pinned() {
    // Capacity 4, one request pins 3 blocks; a second of 3 distinct blocks cannot be pinned
    // alongside it, so it waits until the first finishes, then runs.
    let (engine, _shutdown) = engine(4, 8).await;
    let a = engine.submit(job((0..12).collect(), 50)).unwrap();
    let (_, b) = run(&engine, job((100..112).collect(), 1)).await;
    assert_eq!(b.prompt_tokens, 12);
    drop(a);
}

/// A request waits, its blocks neither looked up nor pinned, until a step has tokens left for
/// it, as vLLM admits only within the step's token budget: behind a 200-token prompt and a
/// 64-token budget, a second request starts in the fourth step, beside the first's last chunk.
#[tokio::test]
async fn a_request_is_admitted_only_when_a_step_has_tokens_left() {
    let mut config = config(64, 8, 100);
    // Steps of about 10 ms of wall time: both jobs are queued long before the first ends.
    config.timing.time_scale = 1.0;
    let (engine, _shutdown) = start(config).await;
    let _first = engine.submit(job((0..200).collect(), 1)).unwrap();
    let mut second = engine.submit(job((1000..1008).collect(), 1)).unwrap();
    assert!(matches!(second.recv().await, Some(Output::Started { .. })));
    let steps = engine.metrics().steps.load(Ordering::Relaxed);
    assert!(steps >= 3, "admitted after {steps} steps, while the first prompt took the whole budget");
}

/// Waiting requests are admitted by priority (lower first), whenever they came: with one
/// sequence at a time, the later request of lower priority runs before the earlier one.
#[tokio::test]
async fn waiting_requests_are_admitted_by_priority() {
    let mut config = config(64, 1, 100);
    config.timing.time_scale = 1.0;
    let (engine, _shutdown) = start(config).await;
    let mut running = engine.submit(job((0..8).collect(), 20)).unwrap();
    assert!(matches!(running.recv().await, Some(Output::Started { .. })));
    let mut early = engine.submit(job((100..108).collect(), 1)).unwrap();
    let urgent = Job { priority: -1, ..job((200..208).collect(), 1) };
    let mut urgent = engine.submit(urgent).unwrap();
    assert!(matches!(urgent.recv().await, Some(Output::Started { .. })));
    assert!(early.try_recv().is_err(), "the earlier request of higher priority started first");
    assert!(matches!(last_output(&mut early).await, Some(Output::Done(_))));
}

/// A shutdown grace too long for the clock ("wait for ever") lets running requests finish:
/// the deadline's sum overflowed and the scheduler panicked, failing them all.
#[tokio::test]
async fn a_grace_too_long_for_the_clock_lets_requests_finish() {
    let (engine, shutdown) =
        start(EngineConfig { shutdown_grace: Duration::MAX, ..config(64, 8, 100) }).await;
    let mut rx = engine.submit(job((0..8).collect(), 20)).unwrap();
    assert!(matches!(rx.recv().await, Some(Output::Started { .. })));
    shutdown.cancel();
    let last = last_output(&mut rx).await;
    assert!(matches!(last, Some(Output::Done(_))), "{last:?}");
}

/// The last output of a job, once its channel closed.
async fn last_output(rx: &mut mpsc::Receiver<Output>) -> Option<Output> {
    let mut last = None;
    while let Some(output) = rx.recv().await {
        last = Some(output);
    }
    last
}

/// A shutdown lets what was accepted finish within the grace, requests still waiting for a
/// step's tokens too (they were failed at once, and most of a burst waits).
#[tokio::test]
async fn a_shutdown_finishes_waiting_requests_too() {
    let (engine, shutdown) = start(config(64, 8, 100)).await;
    let mut first = engine.submit(job((0..200).collect(), 2)).unwrap();
    let mut second = engine.submit(job((1000..1200).collect(), 2)).unwrap();
    assert!(matches!(first.recv().await, Some(Output::Started { .. })));
    shutdown.cancel();
    for rx in [&mut first, &mut second] {
        let last = last_output(rx).await;
        assert!(matches!(last, Some(Output::Done(_))), "{last:?}");
    }
}

/// `max_waiting` bounds every job not yet admitted, not only those the scheduler has yet to
/// take off its channel: with the batch full, the third job to wait is refused (a 503 the
/// router can route around), even after the scheduler has queued the first two.
#[tokio::test]
async fn jobs_waiting_beyond_max_waiting_are_refused() {
    let (engine, _shutdown) = engine_waiting(64, 1, 2).await;
    let mut running = engine.submit(job((0..8).collect(), u32::MAX)).unwrap();
    assert!(matches!(running.recv().await, Some(Output::Started { .. })));
    let waiting: Vec<_> = (0..2u32).map(|i| engine.submit(job(vec![100 + i; 8], 1)).unwrap()).collect();
    // Until the scheduler has moved both into its queue (they count as pending prefill then).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while engine.metrics().pending_prefill_tokens.load(Ordering::Relaxed) < 16 {
        assert!(tokio::time::Instant::now() < deadline, "the scheduler never queued the jobs");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(engine.submit(job(vec![7; 8], 1)).err(), Some(SubmitError::Overloaded(2)));
    assert_eq!(engine.metrics().waiting.load(Ordering::Relaxed), 2, "a refused job is not counted");
    drop((running, waiting));
}

/// A prefix-cache reset on its way to the scheduler takes no job's room: `max_waiting` jobs
/// still go in beside it. It took a slot of the channel, and the last of them got a 503.
#[tokio::test]
async fn a_reset_on_its_way_leaves_room_for_every_waiting_job() {
    let (engine, _shutdown) = engine_waiting(64, 1, 2).await;
    let mut reset = std::pin::pin!(engine.reset_prefix_cache());
    // Polled once (the scheduler cannot run meanwhile): the reset is in the channel.
    assert!(futures::poll!(&mut reset).is_pending());
    let jobs: Vec<_> = (0..2u32).map(|i| engine.submit(job(vec![100 + i; 8], 1))).collect();
    assert!(
        jobs.iter().all(Result::is_ok),
        "{:?}",
        jobs.iter().map(|j| j.as_ref().err()).collect::<Vec<_>>()
    );
    assert_eq!(reset.await, Ok(0), "the reset came first, to an empty cache");
}

/// A request whose client left stops counting as waiting at once, even behind one that
/// cannot be admitted yet (the gauge routers read as the replica's queue).
#[tokio::test]
async fn waiting_requests_whose_clients_left_are_dropped() {
    let (engine, _shutdown) = engine_waiting(64, 1, 8).await;
    let mut running = engine.submit(job((0..8).collect(), u32::MAX)).unwrap();
    assert!(matches!(running.recv().await, Some(Output::Started { .. })));
    let kept = engine.submit(job(vec![50; 8], 1)).unwrap();
    drop((engine.submit(job(vec![51; 8], 1)).unwrap(), engine.submit(job(vec![52; 8], 1)).unwrap()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while engine.metrics().waiting.load(Ordering::Relaxed) != 1 {
        assert!(tokio::time::Instant::now() < deadline, "left requests still count as waiting");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        engine.metrics().pending_prefill_tokens.load(Ordering::Relaxed),
        8,
        "only the one still wanted"
    );
    drop((running, kept));
}

/// Tokens a client received count as generated even when it leaves before the end (vLLM
/// counts each step's output).
#[tokio::test]
async fn tokens_of_a_request_whose_client_left_count_as_generated() {
    let (engine, _shutdown) = engine(64, 4).await;
    let mut rx = engine.submit(job((0..8).collect(), 1000)).unwrap();
    assert!(matches!(rx.recv().await, Some(Output::Started { .. })));
    for _ in 0..3 {
        assert!(matches!(rx.recv().await, Some(Output::Token(_))));
    }
    drop(rx);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while engine.metrics().running.load(Ordering::Relaxed) != 0 {
        assert!(tokio::time::Instant::now() < deadline, "the left request still runs");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(engine.metrics().generation_tokens.load(Ordering::Relaxed) >= 3);
    assert_eq!(engine.metrics().requests_served.load(Ordering::Relaxed), 0);
}
