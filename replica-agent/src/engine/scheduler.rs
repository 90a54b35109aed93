//! The scheduler task: the step loop described in [`super`].

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use kvroute_proto::pb::{self, event};
use kvroute_proto::{BlockHash, hit_tokens};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    BlockMeta, CacheState, Control, EngineConfig, EngineMetrics, HOST_MEDIUM, Job, LOAD_SHARE, Output,
    StepBudget, TextGen, Usage,
};
use crate::cache::{AdmitError, CacheEvent};
use crate::publisher::Publisher;

/// How far behind the wall clock steps may run before they are taken to start now: a few
/// of the timer's 1 ms ticks.
const MOST_LAG: Duration = Duration::from_millis(5);

struct Pending {
    job: Job,
    out: mpsc::Sender<Output>,
}

/// What one step does, planned before it starts ([`Scheduler::plan`]).
struct Plan {
    /// Whether `running[i]` was decoding when the step was planned.
    decoding: Vec<bool>,
    /// Prefill tokens granted to `running[i]` (0 for decoding or starved sequences).
    chunks: Vec<usize>,
    prefill_tokens: usize,
    n_decoding: usize,
}

struct Running {
    job: Job,
    out: mpsc::Sender<Output>,
    cached_tokens: u32,
    /// Prompt tokens still to compute (at least one: the last prompt token is always run to
    /// produce the first output token, even on a full hit).
    prefill_left: usize,
    generated: u32,
    text: TextGen,
    /// Set when the client went away or the request failed; dropped at the end of the step.
    gone: bool,
}

pub(super) struct Scheduler {
    config: Arc<EngineConfig>,
    state: Arc<Mutex<CacheState>>,
    metrics: Arc<EngineMetrics>,
    publisher: Publisher,
    rx: mpsc::Receiver<Control>,
    waiting: VecDeque<Pending>,
    running: Vec<Running>,
    scratch: Vec<CacheEvent>,
    /// When the current step ends on the wall clock; steps are laid end to end so that short
    /// steps under a large time scale keep their average length despite timer granularity.
    clock: Instant,
    /// The publisher stopped taking batches before the scheduler ended (its task failed):
    /// the scheduler stops too, since what it caches would reach no router.
    publisher_lost: bool,
    /// The engine's admissions: ended when the publisher is lost, so that requests failed
    /// then are answered 503 (retry elsewhere), as in a shutdown.
    accepting: CancellationToken,
}

impl Scheduler {
    pub(super) fn new(
        config: Arc<EngineConfig>,
        state: Arc<Mutex<CacheState>>,
        metrics: Arc<EngineMetrics>,
        publisher: Publisher,
        rx: mpsc::Receiver<Control>,
        accepting: CancellationToken,
    ) -> Self {
        Self {
            config,
            state,
            metrics,
            publisher,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            scratch: Vec::new(),
            clock: Instant::now(),
            publisher_lost: false,
            accepting,
        }
    }

    /// Runs until `shutdown` (and its grace) is over, or every handle is dropped; fails if
    /// its publisher stops first.
    pub(super) async fn run(mut self, shutdown: CancellationToken) -> Result<(), String> {
        let mut grace_deadline = None;
        loop {
            if self.publisher_lost {
                // The engine stops: nothing more is taken, and what was sent is failed too.
                self.accepting.cancel();
                self.rx.close();
                while let Ok(control) = self.rx.try_recv() {
                    self.intake(control);
                }
                self.fail_waiting("the replica's event publisher stopped");
                self.fail_running("the replica's event publisher stopped");
                return Err("its event publisher stopped".into());
            }
            if grace_deadline.is_none() && shutdown.is_cancelled() {
                // A grace too long for the clock is a century (no deadline, in effect).
                let grace = self.config.shutdown_grace.min(Duration::from_secs(100 * 365 * 86_400));
                grace_deadline = Some(Instant::now() + grace);
                // What was accepted still runs within the grace, waiting requests included
                // (with admission bound to the step's tokens, a burst is mostly waiting).
                self.rx.close();
                while let Ok(control) = self.rx.try_recv() {
                    self.intake(control);
                }
            }
            if self.running.is_empty() && self.waiting.is_empty() {
                if grace_deadline.is_some() {
                    break;
                }
                tokio::select! {
                    control = self.rx.recv() => match control {
                        Some(control) => self.intake(control),
                        None => break,
                    },
                    () = shutdown.cancelled() => continue,
                }
                self.clock = Instant::now();
            }
            while let Ok(control) = self.rx.try_recv() {
                self.intake(control);
            }
            if grace_deadline.is_some_and(|d| Instant::now() >= d) {
                self.fail_waiting("the replica is shutting down");
                self.fail_running("the replica shut down before the request finished");
                self.flush_events().await;
                break;
            }
            let plan = self.plan();
            self.flush_events().await;
            if self.running.is_empty() {
                continue;
            }
            self.step(plan).await;
        }
        self.flush_events().await;
        Ok(())
    }

    fn fail_waiting(&mut self, why: &str) {
        for p in self.waiting.drain(..) {
            self.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
            self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
            let _ = p.out.try_send(Output::Failed(why.into()));
        }
    }

    fn intake(&mut self, control: Control) {
        match control {
            Control::Run(job, out) => {
                // Behind those of its priority or lower (all of them, with every priority 0).
                let at = self.waiting.partition_point(|p| p.job.priority <= job.priority);
                self.waiting.insert(at, Pending { job, out });
            }
            Control::Reset(reply) => {
                let result = {
                    let mut state = lock(&self.state);
                    let result = state.cache.clear();
                    if result.is_ok() {
                        state.blocks.clear();
                        // Host memory goes too: the router clears both on the one event.
                        if let Some(host) = &mut state.host {
                            host.clear();
                            self.metrics.offloaded_blocks.store(0, Ordering::Relaxed);
                        }
                        self.metrics.resident_blocks.store(0, Ordering::Relaxed);
                        self.metrics.used_blocks.store(0, Ordering::Relaxed);
                        state
                            .outbox
                            .events()
                            .push(pb::Event { kind: Some(event::Kind::Cleared(pb::AllBlocksCleared {})) });
                    }
                    result
                };
                let _ = reply.send(result);
            }
        }
    }

    /// Plans the next step: the running requests first (one decode token each, then prefill
    /// chunks, oldest first; vLLM walks them in order, so an older prefill can take a
    /// decode's turn there), then, as vLLM's scheduler does, waiting requests with what is left
    /// of the token budget ([`Self::admit`]).
    fn plan(&mut self) -> Plan {
        // A request whose client left stops here, mid-prefill included, and gives back its
        // share of the budget and its pins.
        for r in &mut self.running {
            r.gone |= r.out.is_closed();
        }
        self.release_finished();
        let mut decoding: Vec<bool> = self.running.iter().map(|r| r.prefill_left == 0).collect();
        let n_decoding = decoding.iter().filter(|d| **d).count();
        let mut budget = StepBudget::new(self.config.max_num_batched_tokens, n_decoding);
        let mut chunks: Vec<usize> =
            self.running.iter().map(|r| budget.take(r.prefill_left as u64) as usize).collect();
        self.admit(&mut budget, &mut chunks);
        decoding.resize(self.running.len(), false);
        let prefill_tokens = chunks.iter().sum();
        Plan { decoding, chunks, prefill_tokens, n_decoding }
    }

    /// Moves waiting requests into the batch, in arrival order, while the step has tokens
    /// left (`budget`), fewer than `max_num_seqs` run and their blocks can be pinned: vLLM
    /// leaves a request waiting, its blocks neither looked up nor held, until a step has room
    /// for its first chunk. An admitted request's first chunk is taken from `budget` and
    /// pushed on `chunks`.
    fn admit(&mut self, budget: &mut StepBudget, chunks: &mut Vec<usize>) {
        let block_size = self.config.cache.block_size;
        // Requests whose clients left, wherever they wait: they would hold a place in the
        // queue and count in the waiting gauge routers read as load.
        let queued = self.waiting.len();
        self.waiting.retain(|p| !p.out.is_closed());
        self.metrics.waiting.fetch_sub((queued - self.waiting.len()) as u64, Ordering::Relaxed);
        while budget.has_tokens() && self.running.len() < self.config.max_num_seqs {
            let Some(pending) = self.waiting.front() else { break };
            let job = &pending.job;
            self.scratch.clear();
            let outcome = {
                let mut state = lock(&self.state);
                let outcome = state.cache.start_request(&job.hashes, job.prompt.len(), &mut self.scratch);
                outcome.map(|outcome| {
                    record_events(&mut state, &self.scratch, job, block_size, None);
                    self.metrics.resident_blocks.store(state.cache.len() as u64, Ordering::Relaxed);
                    self.metrics.used_blocks.store(state.cache.pinned_len() as u64, Ordering::Relaxed);
                    let loaded = offload(&mut state, &mut self.scratch, job, outcome.hit_blocks, block_size);
                    if let Some(host) = &state.host {
                        self.metrics.offloaded_blocks.store(host.len() as u64, Ordering::Relaxed);
                    }
                    (outcome, loaded)
                })
            };
            match outcome {
                Ok((outcome, loaded)) => {
                    let Pending { job, out } = self.waiting.pop_front().expect("front exists");
                    // What host memory or a remote prefill has past the prefix hit is loaded. A
                    // job that reads no cache is neither a query nor a hit (vLLM's stats).
                    let (reads, len) = (job.reads_cache, job.prompt.len());
                    let held =
                        if reads { hit_tokens(outcome.hit_blocks + loaded, block_size, len) } else { 0 };
                    let hit = if reads { outcome.hit_tokens } else { 0 };
                    let cached = held.max(job.remote_tokens.min(len));
                    let loaded_tokens = cached - hit;
                    self.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
                    let queried = if reads { len as u64 } else { 0 };
                    self.metrics.prefix_cache_queries.fetch_add(queried, Ordering::Relaxed);
                    self.metrics.prefix_cache_hits.fetch_add(hit as u64, Ordering::Relaxed);
                    self.metrics
                        .external_prefix_cache_hits
                        .fetch_add(loaded_tokens as u64, Ordering::Relaxed);
                    self.metrics.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
                    let cached_tokens = job.reports_cached.unwrap_or(cached as u32);
                    let gone = out.try_send(Output::Started { cached_tokens }).is_err();
                    // The load from host memory (or a remote prefill) takes its share of a
                    // prefill's time.
                    let load = (loaded_tokens as f64 * LOAD_SHARE).ceil() as usize;
                    let uncached = (job.prompt.len() - cached).max(1) + load;
                    // One whose client already left finishes at the end of the step, free.
                    let chunk = if gone { 0 } else { budget.take(uncached as u64) as usize };
                    chunks.push(chunk);
                    self.running.push(Running {
                        prefill_left: uncached,
                        text: TextGen::new(&job.prompt, self.config.seed, job.sample),
                        job,
                        out,
                        cached_tokens,
                        generated: 0,
                        gone,
                    });
                }
                Err(AdmitError::MustWait { .. }) => break,
                Err(e @ AdmitError::TooLarge { .. }) => {
                    let Pending { out, .. } = self.waiting.pop_front().expect("front exists");
                    self.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
                    self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = out.try_send(Output::Failed(e.to_string()));
                }
            }
        }
        self.metrics.running.store(self.running.len() as u64, Ordering::Relaxed);
        self.update_pending();
    }

    /// Runs one planned step: waits its duration, emits tokens.
    async fn step(&mut self, plan: Plan) {
        let Plan { decoding, chunks, prefill_tokens, n_decoding } = plan;
        let simulated = self.config.timing.step(prefill_tokens as u64, n_decoding as u64);
        let wall = self.config.timing.wall(simulated);
        // Steps laid end to end, a few behind at most: timers wake on whole milliseconds, so
        // a step shorter than that wakes late, and the next ones make up for it (with a lag of
        // one step alone, every step of a large time scale took a millisecond). After idling,
        // the next step takes its full time.
        let now = Instant::now();
        let lag = wall.max(MOST_LAG);
        self.clock = self.clock.max(now.checked_sub(lag).unwrap_or(now)) + wall;
        if self.clock > now {
            tokio::time::sleep_until(self.clock).await;
        } else {
            tokio::task::yield_now().await;
        }
        self.metrics.steps.fetch_add(1, Ordering::Relaxed);

        for ((r, chunk), was_decoding) in self.running.iter_mut().zip(chunks).zip(decoding) {
            let emits = if was_decoding {
                true
            } else if chunk > 0 {
                r.prefill_left -= chunk;
                r.prefill_left == 0
            } else {
                false
            };
            if emits && r.generated < r.job.max_tokens {
                r.generated += 1;
                // Counted as generated, as vLLM counts each step's, whether or not the
                // request then finishes (its client may leave).
                self.metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
                if r.out.try_send(Output::Token(r.text.next_token())).is_err() {
                    r.gone = true;
                }
            }
            if r.prefill_left == 0 && r.generated >= r.job.max_tokens && !r.gone {
                let usage = Usage {
                    prompt_tokens: r.job.prompt.len() as u32,
                    completion_tokens: r.generated,
                    cached_tokens: r.cached_tokens,
                };
                // Count before telling the client, so a scrape right after the response sees it.
                self.metrics.requests_served.fetch_add(1, Ordering::Relaxed);
                let _ = r.out.try_send(Output::Done(usage));
                r.gone = true;
            }
        }
        self.release_finished();
    }

    fn release_finished(&mut self) {
        let mut state = lock(&self.state);
        self.running.retain(|r| {
            if r.gone
                && let Err(e) = state.cache.finish_request(&r.job.hashes)
            {
                tracing::error!(error = %e, "unpinning a finished request");
            }
            !r.gone
        });
        self.metrics.used_blocks.store(state.cache.pinned_len() as u64, Ordering::Relaxed);
        drop(state);
        self.metrics.running.store(self.running.len() as u64, Ordering::Relaxed);
        self.update_pending();
    }

    fn fail_running(&mut self, why: &str) {
        for r in &mut self.running {
            let _ = r.out.try_send(Output::Failed(why.to_owned()));
            self.metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
            r.gone = true;
        }
        self.release_finished();
    }

    fn update_pending(&self) {
        let pending: usize = self.running.iter().map(|r| r.prefill_left).sum::<usize>()
            + self.waiting.iter().map(|p| p.job.prompt.len()).sum::<usize>();
        self.metrics.pending_prefill_tokens.store(pending as u64, Ordering::Relaxed);
    }

    /// Publishes the step's events: one batch, or more where a snapshot split the step (their
    /// seqs were taken under the cache lock with the changes).
    async fn flush_events(&mut self) {
        let batches = lock(&self.state).outbox.take();
        if batches.is_empty() {
            return;
        }
        let ts_unix_nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        for (seq, events) in batches {
            let batch = pb::EventBatch {
                replica: self.config.replica.clone(),
                epoch: self.config.epoch.0,
                seq,
                ts_unix_nanos,
                block_size: self.config.cache.block_size as u32,
                dp_rank: self.config.dp_rank,
                events,
            };
            if self.publisher.publish(batch).await {
                self.metrics.events_published.fetch_add(1, Ordering::Relaxed);
            } else {
                tracing::error!(seq, "event publisher has stopped; batch dropped");
                self.publisher_lost = true;
            }
        }
    }
}

fn lock(state: &Mutex<CacheState>) -> std::sync::MutexGuard<'_, CacheState> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Loads the run of the request's blocks host memory holds from block `from` on (its prefix
/// hit), then copies the request's blocks out, recording the changes; the blocks loaded.
fn offload(
    state: &mut CacheState,
    changes: &mut Vec<CacheEvent>,
    job: &Job,
    from: usize,
    block_size: usize,
) -> usize {
    let Some(host) = state.host.as_mut() else { return 0 };
    let loaded = host.run_from(&job.hashes, from);
    changes.clear();
    host.offload(&job.hashes, changes);
    record_events(state, changes, job, block_size, Some(HOST_MEDIUM));
    loaded
}

/// Turns one admission's residency changes in the device cache (`medium` `None`) or host
/// memory into protobuf events (runs of stored blocks of one chain become one `BlockStored`,
/// runs of removals one `BlockRemoved`) and keeps the per-block metadata a snapshot needs
/// (of the device cache's blocks).
fn record_events(
    state: &mut CacheState,
    changes: &[CacheEvent],
    job: &Job,
    block_size: usize,
    medium: Option<&str>,
) {
    // A batch (and its seq) is taken with the first event, so never for nothing.
    let CacheState { blocks, outbox, .. } = state;
    let device = medium.is_none();
    let medium = medium.map(str::to_owned);
    let mut cursor = 0;
    for change in changes {
        match *change {
            CacheEvent::Removed(block) => {
                if device {
                    blocks.remove(&block);
                }
                let events = outbox.events();
                match events.last_mut() {
                    Some(pb::Event { kind: Some(event::Kind::Removed(r)) }) if r.medium == medium => {
                        r.block_hashes.push(block.0);
                    }
                    _ => events.push(pb::Event {
                        kind: Some(event::Kind::Removed(pb::BlockRemoved {
                            block_hashes: vec![block.0],
                            medium: medium.clone(),
                        })),
                    }),
                }
            }
            CacheEvent::Stored { block, parent } => {
                let Some(offset) = job.hashes[cursor..].iter().position(|h| *h == block) else {
                    tracing::error!(%block, "stored block is not in the request");
                    continue;
                };
                let index = cursor + offset;
                cursor = index + 1;
                let events = outbox.events();
                let tokens = &job.prompt[index * block_size..(index + 1) * block_size];
                if device {
                    let namespace = (parent.is_none()
                        && (job.namespace.lora.is_some() || job.namespace.cache_salt.is_some()))
                    .then(|| Box::new(job.namespace.clone()));
                    blocks.insert(
                        block,
                        BlockMeta { parent, tokens: tokens.into(), depth: index as u32, namespace },
                    );
                }
                let extends_last = matches!(
                    events.last(),
                    Some(pb::Event { kind: Some(event::Kind::Stored(s)) })
                        if s.block_hashes.last().copied() == parent.map(|p| p.0) && s.medium == medium
                );
                if let (true, Some(pb::Event { kind: Some(event::Kind::Stored(s)) })) =
                    (extends_last, events.last_mut())
                {
                    s.block_hashes.push(block.0);
                    s.token_ids.extend_from_slice(tokens);
                } else {
                    events.push(pb::Event {
                        kind: Some(event::Kind::Stored(pb::BlockStored {
                            block_hashes: vec![block.0],
                            parent_block_hash: parent.map(|p: BlockHash| p.0),
                            token_ids: tokens.to_vec(),
                            lora_name: job.namespace.lora.clone(),
                            cache_salt: job.namespace.cache_salt.clone(),
                            medium: medium.clone(),
                        })),
                    });
                }
            }
        }
    }
}
