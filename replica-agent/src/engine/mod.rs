//! The simulated inference engine: continuous batching over an exact block cache.
//!
//! One scheduler task owns the waiting queue and the running batch. Every step it
//! 1. spends the step's token budget (`max_num_batched_tokens`) on one decode token per
//!    running sequence, then on prefill chunks of the uncached prompt tokens (chunked
//!    prefill, oldest request first; vLLM walks its running requests in order, decoding or
//!    not, so there an older prefill can take a decode's turn);
//! 2. admits waiting requests in arrival order (by `priority` first, lower first, as vLLM's
//!    `--scheduling-policy priority` does; a running request is not preempted for a waiting
//!    one of lower priority, as vLLM's would be) while the budget has tokens left and fewer
//!    than `max_num_seqs` run, as vLLM's scheduler does: each admission is a
//!    [`BlockCache::start_request`] (seed-000 prefix hit, every block accessed, all of the
//!    request's blocks pinned until it finishes) and takes its first prefill chunk from what
//!    is left; a request whose blocks cannot be pinned yet waits at the head of the queue, as
//!    vLLM's does when KV blocks run out;
//! 3. publishes the step's cache changes as one `EventBatch` (its seq taken with the first
//!    change, under the cache lock, so a snapshot knows which seq it is consistent with; a
//!    snapshot in the middle of a step splits the step's batch in two, see [`outbox`]);
//! 4. waits the step's duration from the [`TimingModel`] and emits the tokens: a request whose
//!    prefill completed gets its first token, decoding ones their next, finished ones their
//!    usage, and their pins are released.
//!
//! With host memory to offload to (`offload_blocks`, vLLM's `OffloadingConnector`), every
//! admitted request's blocks are copied there too ([`HostTier`]), and the run of blocks it
//! holds right after the request's prefix hit is loaded rather than computed: those tokens
//! count as cached (as vLLM counts them; `vllm:external_prefix_cache_hits_total` has them
//! alone) and cost [`LOAD_SHARE`] of a prefill token each. Its changes are published with
//! the step's, `medium` `"CPU"`. A snapshot lists them after the device cache's blocks, by
//! hash alone (host memory keeps nothing else of them).
//!
//! A request whose prompt a remote prefill computed ([`Job::remote_tokens`],
//! [`crate::kv_transfer`]) pulls those tokens past its prefix hit the same way: cached,
//! external, and [`LOAD_SHARE`] of a prefill token each ([`crate::bootstrap`] too).
//!
//! Only prompt blocks are cached (vLLM also caches full blocks of generated tokens; the
//! simulated text is not meant to be re-sent verbatim, so those blocks would never hit).
//! Blocks become resident when the request is admitted rather than chunk by chunk as the
//! prefill proceeds: a request arriving mid-prefill of a shared prefix already hits it, where
//! vLLM would recompute it. Both simplifications are on the side of the seed-000 replay, which
//! is the reference the offline simulator reproduces.

mod outbox;
mod ranks;
mod scheduler;
mod textgen;
mod timing;

pub use ranks::Ranks;

/// What loading a token from host memory costs, in prefill tokens: the modelled engine
/// (`timing`) prefills about 14 k tokens/s, 70 µs a token, and a token's KV (128 KiB for an
/// 8B model in 16 bits) crosses PCIe 4 (about 25 GB/s) in about 5 µs.
pub const LOAD_SHARE: f64 = 0.075;
pub use textgen::{TextGen, token_id};
pub use timing::TimingModel;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvroute_proto::pb::{self, SnapshotBlock};
use kvroute_proto::{BlockHash, CacheNamespace, Epoch};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::{BlockCache, CacheConfig, ClearError, HostTier};
use crate::publisher::Publisher;

/// A step's token budget (`max_num_batched_tokens`) as it is handed out: a token to each
/// decoding sequence first, then prefill chunks in order, each as much of what is left as its
/// sequence has to prefill. The simulator's engine model plans its steps with it too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepBudget(u64);

impl StepBudget {
    /// The budget of a step in which `decoding` sequences decode.
    pub fn new(max_num_batched_tokens: usize, decoding: usize) -> Self {
        Self(max_num_batched_tokens.saturating_sub(decoding) as u64)
    }

    /// A chunk for a sequence with `prefill_left` tokens to prefill (0 once none is left).
    pub fn take(&mut self, prefill_left: u64) -> u64 {
        let chunk = prefill_left.min(self.0);
        self.0 -= chunk;
        chunk
    }

    /// Whether tokens are left (a waiting request is admitted only then).
    pub fn has_tokens(&self) -> bool {
        self.0 > 0
    }
}

/// Settings of the scheduler.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub replica: String,
    pub epoch: Epoch,
    /// The data-parallel rank this engine is (0 for a replica of one), in its event batches.
    pub dp_rank: u32,
    pub cache: CacheConfig,
    /// Blocks of host memory the engine offloads its KV blocks to (0: none; [`HostTier`]).
    pub offload_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_waiting: usize,
    pub timing: TimingModel,
    pub seed: u64,
    /// How long in-flight requests may keep running after shutdown is requested.
    pub shutdown_grace: std::time::Duration,
}

/// One generation request, already tokenized and hashed.
#[derive(Clone, Debug)]
pub struct Job {
    /// The prompt's token ids (shared by the choices of a request with `n`).
    pub prompt: Arc<[u32]>,
    /// Chained hashes of the prompt's full blocks, in `namespace`.
    pub hashes: Arc<[BlockHash]>,
    /// The cache namespace the hashes were chained in; its adapter and salt go into the
    /// stored events (vLLM's format publishes them).
    pub namespace: CacheNamespace,
    pub max_tokens: u32,
    /// Which of the prompt's `n` choices this is (0 for the first): each has its own text.
    pub sample: u32,
    /// Its place among waiting requests: lower is admitted first (vLLM's `priority`), then
    /// first come, first served.
    pub priority: i64,
    /// Prompt tokens a remote prefill computed, pulled rather than computed past what the
    /// prefix cache holds ([`crate::kv_transfer`]; 0 for most requests).
    pub remote_tokens: usize,
    /// The prompt tokens it reports cached, when not those it holds or pulled (SGLang's
    /// decode replica reports its prefill replica's: [`crate::bootstrap`]).
    pub reports_cached: Option<u32>,
    /// Whether its prefill reads the prefix cache: not for a request of its prompt's logprobs,
    /// as vLLM skips the lookup (its blocks are stored all the same).
    pub reads_cache: bool,
}

impl Job {
    /// A job for `prompt`, its full blocks of `block_size` tokens hashed in `namespace`.
    pub fn new(namespace: CacheNamespace, prompt: Vec<u32>, block_size: usize, max_tokens: u32) -> Job {
        let hashes = namespace.chain(&prompt, block_size).into();
        Job {
            hashes,
            prompt: prompt.into(),
            namespace,
            max_tokens,
            sample: 0,
            priority: 0,
            remote_tokens: 0,
            reports_cached: None,
            reads_cache: true,
        }
    }

    /// The same prompt again, as choice `sample` of its request.
    pub fn sample(&self, sample: u32) -> Job {
        Job { sample, ..self.clone() }
    }
}

/// What the engine sends back for one job, in order: `Started`, `Token`s, then `Done` or
/// `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// Admitted: this many prompt tokens were served from the prefix cache.
    Started {
        cached_tokens: u32,
    },
    Token(&'static str),
    Done(Usage),
    /// The request cannot run (too large for the cache, or the engine is shutting down).
    Failed(String),
}

/// Token accounting of a finished request, as OpenAI's `usage` reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

/// Why a job was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the replica has {0} requests waiting; try again later")]
    Overloaded(usize),
    #[error("the replica is shutting down")]
    ShuttingDown,
}

/// Counters and gauges, readable without the cache lock.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub requests_served: AtomicU64,
    pub requests_failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// vLLM's `prefix_cache_queries` / `prefix_cache_hits`, in tokens.
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    /// vLLM's `external_prefix_cache_hits`: prompt tokens loaded from host memory.
    pub external_prefix_cache_hits: AtomicU64,
    pub resident_blocks: AtomicU64,
    /// Blocks held in host memory.
    pub offloaded_blocks: AtomicU64,
    /// Distinct blocks running requests hold (pinned): what vLLM counts as used, its other
    /// cached blocks being free to evict.
    pub used_blocks: AtomicU64,
    pub pending_prefill_tokens: AtomicU64,
    pub events_published: AtomicU64,
    pub steps: AtomicU64,
    /// Event and replay connections the publisher's ZMTP guards cut (shared with it).
    pub zmtp_refused: Arc<AtomicU64>,
}

/// The cache and what the engine knows about each resident block, behind one lock.
pub(crate) struct CacheState {
    pub cache: BlockCache,
    /// Host memory blocks are offloaded to, if the engine has any.
    pub host: Option<HostTier>,
    pub blocks: HashMap<BlockHash, BlockMeta>,
    /// The events of changes made and not yet published.
    pub outbox: outbox::Outbox,
}

/// The `medium` of host memory's events and snapshot blocks.
pub(crate) const HOST_MEDIUM: &str = "CPU";

/// A snapshot's entry for a block held in host memory.
fn offloaded(hash: BlockHash) -> SnapshotBlock {
    SnapshotBlock { hash: hash.0, medium: Some(HOST_MEDIUM.into()), ..SnapshotBlock::default() }
}

/// What a snapshot needs to describe a resident block.
pub(crate) struct BlockMeta {
    pub parent: Option<BlockHash>,
    pub tokens: Box<[u32]>,
    /// Position in its chain (0 for a prompt's first block): sorting by it puts parents first.
    pub depth: u32,
    /// A prompt's first block's namespace, when it has an adapter or a salt (later blocks
    /// chain from their parent, and most prompts have neither).
    pub namespace: Option<Box<CacheNamespace>>,
}

/// A consistent copy of the cache: every resident block, parent first, as of `seq`.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Seq of the newest batch whose changes the snapshot includes (`None`: none yet).
    pub seq: Option<u64>,
    pub blocks: Vec<SnapshotBlock>,
}

pub(crate) enum Control {
    Run(Job, mpsc::Sender<Output>),
    Reset(oneshot::Sender<Result<usize, ClearError>>),
}

/// A handle to the engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Control>,
    state: Arc<Mutex<CacheState>>,
    metrics: Arc<EngineMetrics>,
    config: Arc<EngineConfig>,
    accepting: CancellationToken,
    /// One reset at a time on its way to the scheduler: the channel's one slot beyond
    /// `max_waiting` jobs is its, so a reset never makes a job's submit find it full.
    resetting: Arc<tokio::sync::Mutex<()>>,
    /// See [`Engine::max_prompt_tokens`].
    max_prompt_tokens: usize,
}

impl Engine {
    /// Starts the scheduler on `tracker` ([`Engine::new`]).
    pub fn start(
        config: EngineConfig,
        publisher: Publisher,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<Engine, crate::cache::ConfigError> {
        let (engine, scheduler) = Engine::new(config, publisher, shutdown)?;
        tracker.spawn(async move {
            if let Err(e) = scheduler.await {
                tracing::error!(error = %e, "the engine's scheduler stopped");
            }
        });
        Ok(engine)
    }

    /// An engine and its scheduler, for the caller to run. After `shutdown` fires it accepts
    /// nothing new, finishes what it accepted (running or waiting) within the grace period and
    /// fails the rest. It fails (failing every request it holds) if its publisher stops
    /// before it does.
    pub fn new(
        config: EngineConfig,
        publisher: Publisher,
        shutdown: CancellationToken,
    ) -> Result<(Engine, impl Future<Output = Result<(), String>> + Send + 'static), crate::cache::ConfigError>
    {
        let cache = BlockCache::new(&config.cache)?;
        let host = (config.offload_blocks > 0).then(|| HostTier::new(config.offload_blocks));
        let max_prompt_tokens = cache.longest_prompt();
        let state = Arc::new(Mutex::new(CacheState {
            cache,
            host,
            blocks: HashMap::new(),
            outbox: Default::default(),
        }));
        let metrics =
            Arc::new(EngineMetrics { zmtp_refused: publisher.refused(), ..EngineMetrics::default() });
        let config = Arc::new(config);
        // (At most a semaphore's permits: the configuration takes `max_waiting` up to that.)
        let slots = (config.max_waiting.max(1) + 1).min(tokio::sync::Semaphore::MAX_PERMITS);
        let (tx, rx) = mpsc::channel(slots);
        let accepting = shutdown.child_token();
        let scheduler = scheduler::Scheduler::new(
            config.clone(),
            state.clone(),
            metrics.clone(),
            publisher,
            rx,
            accepting.clone(),
        )
        .run(shutdown);
        let resetting = Arc::default();
        Ok((Engine { tx, state, metrics, config, accepting, resetting, max_prompt_tokens }, scheduler))
    }

    /// Whether it takes no more jobs: the agent is shutting down, or its scheduler stopped
    /// (its event publisher was lost).
    pub fn is_stopping(&self) -> bool {
        self.accepting.is_cancelled()
    }

    /// Queues a job; its outputs arrive on the returned channel.
    pub fn submit(&self, job: Job) -> Result<mpsc::Receiver<Output>, SubmitError> {
        if self.accepting.is_cancelled() {
            return Err(SubmitError::ShuttingDown);
        }
        // `waiting` counts every job not yet admitted, queued in the channel or in the
        // scheduler's queue; a job counts before it is sent, so the scheduler never takes one
        // off the count before it is on it.
        let max = self.config.max_waiting;
        if self.metrics.waiting.fetch_add(1, Ordering::Relaxed) >= max as u64 {
            self.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(SubmitError::Overloaded(max));
        }
        // Room for every output of the job, so the scheduler never waits on a slow client.
        let (out, rx) = mpsc::channel(job.max_tokens as usize + 3);
        self.tx.try_send(Control::Run(job, out)).map_err(|e| {
            self.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
            match e {
                mpsc::error::TrySendError::Full(_) => SubmitError::Overloaded(max),
                mpsc::error::TrySendError::Closed(_) => SubmitError::ShuttingDown,
            }
        })?;
        Ok(rx)
    }

    /// Drops the whole prefix cache and publishes `AllBlocksCleared`; refused while running
    /// requests hold blocks (as vLLM does not reset then). Returns how many blocks were dropped.
    pub async fn reset_prefix_cache(&self) -> Result<usize, ResetError> {
        let _one = self.resetting.lock().await;
        let (tx, rx) = oneshot::channel();
        self.tx.send(Control::Reset(tx)).await.map_err(|_| ResetError::ShuttingDown)?;
        rx.await.map_err(|_| ResetError::ShuttingDown)?.map_err(ResetError::Busy)
    }

    /// Every resident block, parents first, then every block held in host memory, and the seq
    /// the copy is consistent with. The cache is locked only while the blocks are copied (the
    /// scheduler waits meanwhile); they are put in order after.
    pub fn snapshot(&self, include_tokens: bool) -> Snapshot {
        let (seq, mut blocks, mut host) = {
            let mut state = self.lock();
            let seq = state.outbox.seal();
            let blocks: Vec<(u32, SnapshotBlock)> = state
                .blocks
                .iter()
                .map(|(hash, meta)| {
                    let block = SnapshotBlock {
                        hash: hash.0,
                        parent: meta.parent.map(|p| p.0),
                        token_ids: if include_tokens { meta.tokens.to_vec() } else { Vec::new() },
                        lora_name: meta.namespace.as_ref().and_then(|ns| ns.lora.clone()),
                        cache_salt: meta.namespace.as_ref().and_then(|ns| ns.cache_salt.clone()),
                        medium: None,
                    };
                    (meta.depth, block)
                })
                .collect();
            let host: Vec<SnapshotBlock> =
                state.host.iter().flat_map(HostTier::blocks).map(offloaded).collect();
            (seq, blocks, host)
        };
        blocks.sort_unstable_by_key(|(depth, block)| (*depth, block.hash));
        host.sort_unstable_by_key(|block| block.hash);
        let blocks = blocks.into_iter().map(|(_, block)| block).chain(host).collect();
        Snapshot { seq, blocks }
    }

    /// Resident block hashes (for tests and stats).
    pub fn resident(&self) -> Vec<BlockHash> {
        self.lock().cache.resident().collect()
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The longest prompt the cache can ever hold whole while it runs (its full blocks are
    /// all pinned at once); a longer one would wait forever, so it is refused up front.
    pub fn max_prompt_tokens(&self) -> usize {
        self.max_prompt_tokens
    }

    /// Seq of the newest batch, published or about to be, if any.
    pub fn last_seq(&self) -> Option<u64> {
        self.lock().outbox.last_seq()
    }

    fn lock(&self) -> MutexGuard<'_, CacheState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stats in the gRPC shape.
    pub fn stats(&self) -> pb::StatsResponse {
        let m = &self.metrics;
        let last = self.last_seq();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        pb::StatsResponse {
            epoch: self.config.epoch.0,
            resident_blocks: load(&m.resident_blocks),
            capacity_blocks: self.config.cache.capacity_blocks as u64,
            running: load(&m.running) as u32,
            waiting: load(&m.waiting) as u32,
            requests_served: load(&m.requests_served),
            prefix_cache_queries_tokens: load(&m.prefix_cache_queries),
            prefix_cache_hits_tokens: load(&m.prefix_cache_hits),
            events_published: load(&m.events_published),
            last_seq: last.unwrap_or(0),
            has_seq: last.is_some(),
            pending_prefill_tokens: load(&m.pending_prefill_tokens),
        }
    }
}

/// Why the cache could not be reset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResetError {
    #[error(transparent)]
    Busy(ClearError),
    #[error("the replica is shutting down")]
    ShuttingDown,
}

#[cfg(test)]
mod tests;
