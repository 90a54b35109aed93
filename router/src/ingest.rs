//! Event ingestion: keeps the prefix index equal to every replica's KV cache, from the
//! replicas' ZeroMQ event streams, and says honestly when it is not.
//!
//! # State machine (per replica and data-parallel rank; the replica shows the worst rank)
//!
//! ```text
//!            start ──► DEGRADED (not synced) ──connected──► repair(from 0) ──► EXACT
//! EXACT ── seq gap / queue overflow ──► DEGRADED ── repair(from first missing) ──► EXACT
//!          (an overflow is reported once the queue has room, ahead of the batches
//!          after it, so a lost last batch is repaired too; a repair asks again from
//!          where a replay stopped, and after 9 replays that each brought fewer than 64
//!          batches, or came without their end marker, it clears the rank and starts
//!          over from the live batch)
//! EXACT ── SUB disconnected ──► clear the rank, DEGRADED (live frames ignored)
//!          ── reconnected: repair(from 0) ──► EXACT
//!          (a publisher closes its connection when its replica stops, dies or restarts:
//!          its blocks must leave the index at once, not after `fallback_after`; the
//!          replica's credits stay, its requests may still run)
//! any ── no connection for `fallback_after` ──► FALLBACK (the replica's credits end)
//!                          ── connected: repair ──► EXACT
//! any ── `malformed_fallback` malformed messages in a row ──► FALLBACK
//!                          ── next good batch: snapshot, else clear and rebuild ──► EXACT
//! EXACT ── a batch that cannot be decoded (its seq is consumed: a replay would give the
//!          same bytes) ── at once for the first since the last good batch (else DEGRADED,
//!          or FALLBACK when already so, until the next good batch): snapshot, else clear
//!          and rebuild ──► EXACT
//!          (what the lost batch removed is unknown, and the index must stay a subset)
//! seq backwards (vLLM) or new epoch (kvroute) ──► restart: clear the rank at once (and end
//!                          the replica's credits), then apply from seq 0 (a gap from 0 is
//!                          repaired like any gap)
//! AllBlocksCleared ──► clear the rank (state unchanged; credits stay)
//! ```
//!
//! A rank's blocks offloaded to host memory (`decode::Tier::Host`) are kept in an index of
//! their own ([`Ingest::host_index`]); every clear of the rank clears them too.
//!
//! After every (re)connect, a second `repair(from next expected)` runs `catch_up_after`
//! later (if the replica has a replay endpoint): the subscription reaches the publisher some
//! time after the connection, and a batch published in between is lost without anything
//! revealing it when no batch follows (the slow-joiner problem, wire doc §3).
//!
//! A repair whose replays came without their end marker, and could not get the rest, leaves
//! the rank DEGRADED with what they brought: the rest may remove blocks the index shows. A
//! live batch that follows on puts it back in step; failing that, the repair runs again
//! `catch_up_after` later, the wait doubling to a minute, until one gets the rest (or, the
//! publisher no longer holding it, starts over as in 2 and 3 below). A replay of such a
//! repair that fails keeps what the rank holds, which is most of the truth.
//!
//! `repair(from)`:
//! 1. Replay: a fresh DEALER asks the replica's ROUTER for every batch `>= from`
//!    (`replay_timeout` on connect and on every reply, 12 of them for the whole replay, at
//!    most `replay_max_batches` batches, and payload bytes from a `replay_max_bytes` budget
//!    that all replays share). It is
//!    complete if its first batch is `from` (or it is empty and no newer batch was seen).
//!    Complete → apply in order, up to the first hole in the seqs (a publisher's send buffer
//!    can overflow, and ZeroMQ drops silently; the batch after a hole is a gap, repaired
//!    again from the hole); batches still queued from the live stream with seqs the
//!    replay covered are then dropped as duplicates. A complete, empty replay on a fresh
//!    rank means the next batch is `from`: a live batch past it is a gap (its predecessors
//!    went out before the subscription reached the publisher), not a fresh start.
//! 2. Otherwise (no replay endpoint, failed, incomplete) the agent's gRPC `Snapshot`
//!    (`snapshot_timeout`; rank 0 only): clear the rank, store the snapshot's blocks, expect
//!    `snapshot.seq + 1`. Live batches that arrived meanwhile wait in the channel; those up
//!    to `snapshot.seq` are dropped as duplicates.
//! 3. Otherwise clear the rank, apply what an incomplete replay returned, and go on with the
//!    live stream. The state goes back to EXACT at once: everything applied after the clear
//!    is exact, the index is a subset of the cache (blocks cached before the clear are
//!    missing until the engine announces them again), and a subset can only lose hits,
//!    never route to a replica that lacks the prefix.
//!
//! Stored runs whose parent this rank does not know (typically after a clear: the engine
//! extends a prefix it cached before) cannot be hashed and are counted as `unknown_parent`;
//! removals of unknown blocks as `unknown_block`. Neither changes the state: the index stays
//! a subset of the cache.
//!
//! A replica counts as synced (for `/ready`) once every rank completed one repair
//! ([`Ingest::wait_synced`]). A batch whose payload does not decode is counted, its seq
//! consumed (a replay would return the same bytes), and its rank resynced. A vLLM publisher that restarts
//! and gets past our next expected seq before we notice looks continuous: vLLM has no epoch;
//! kvroute's replica agent has one.
//!
//! A replica with no event endpoint has no stream: it is `PREDICTED` from its start to its
//! removal, its index entries being this router's requests to it ([`Prediction`]).
//!
//! # Parameters ([`IngestConfig`])
//! channel 4096 live messages and 64 MiB of them per rank, 512 MiB over every rank
//! (overflow → counted, becomes a gap), fallback after 10 s without a connection, reconnect
//! backoff 1 s, replay timeout 5 s, replay cap 100 000 batches (256 MiB of payload for all
//! replays together), snapshot timeout 30 s and cap 4 Mi blocks, FALLBACK after 16
//! malformed messages in a row, catch-up replay 1 s after each connect.
//!
//! # Layout
//! - `subscriber`: the SUB socket task per (replica, rank).
//! - `stream`: the state machine and applying batches to the index.
//! - `decode`: payload → engine-neutral batch, and the vLLM event filters.
//! - `engine_map`: engine hash → router hash (refcounted) per rank.
//! - `replay` / `snapshot`: the DEALER and gRPC repair clients.
//! - `predicted`: the caches of replicas without events, predicted from their requests.
//! - [`metrics`]: Prometheus metrics.

pub mod metrics;

mod decode;
pub(crate) mod engine_map;
mod outbox;
mod predicted;
mod replay;
mod snapshot;
mod stream;
mod subscriber;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_proto::ReplicaId;
use kvroute_proto::zmtp_guard::frames::FRAME_CHARGE;
use kvroute_proto::zmtp_guard::{MAX_MESSAGE_BYTES, MAX_MESSAGE_FRAMES};
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use metrics::{IngestMetrics, Malformed, Outcome, ReplicaMetrics, SkipReason};
pub use predicted::Prediction;

use crate::index::SharedIndex;
use crate::replicas::{self, Replica, ReplicaSpec, Replicas, SpecError, StreamState};
use stream::{RankStream, ReplicaCtx};
use subscriber::SubscriberConfig;

/// Ingestion parameters (see the module documentation for how each is used).
#[derive(Clone, Debug)]
pub struct IngestConfig {
    /// Live messages buffered per rank between the socket and the stream task.
    pub channel_capacity: usize,
    /// Frame bytes those messages may hold together, per rank, 32 bytes a frame counted
    /// besides its contents.
    pub channel_max_bytes: usize,
    /// Frame bytes every rank's queued live messages may hold together (the fleet
    /// reconnecting, every rank busy with a replay, each would fill its channel): past it,
    /// messages are dropped and repaired as a full channel's are. At least
    /// `channel_max_bytes`, so that the largest message fits.
    pub live_max_bytes: usize,
    /// A rank without a connection this long is FALLBACK (also the SUB connect timeout).
    pub fallback_after: Duration,
    /// Pause between failed connection attempts.
    pub reconnect_backoff: Duration,
    /// Timeout of the replay connect and of every replay reply (a whole replay: 12 of them).
    pub replay_timeout: Duration,
    /// Longest replay accepted, in batches (bounds memory: a replay is held whole before it
    /// is applied; a longer one counts as failed).
    pub replay_max_batches: usize,
    /// Payload bytes all replays in progress may hold together (they run at once when the
    /// router starts or its fleet reconnects); a replay that would go past it waits for
    /// others to give some back, up to its reply timeout, then gives back what it held and
    /// tries once more, in turn with the others that ran out.
    pub replay_max_bytes: usize,
    /// Timeout of a whole snapshot.
    pub snapshot_timeout: Duration,
    /// Largest snapshot accepted, in blocks (bounds memory, with 256 bytes a block on average
    /// for their tokens and names; a larger one counts as failed), and the most blocks one
    /// rank may hold, copies of a block counted: a store past it is skipped (`over_capacity`),
    /// so a publisher that never removes what it stores cannot grow the index without end.
    pub snapshot_max_blocks: usize,
    /// Malformed messages in a row that make a rank FALLBACK.
    pub malformed_fallback: u32,
    /// Delay of the second replay after every (re)connect (slow-joiner catch-up).
    pub catch_up_after: Duration,
    /// Of a replica without events ([`Prediction`]): how long a predicted block is kept after
    /// the last request that used it.
    pub predicted_ttl: Duration,
    /// Of a replica without events: its KV cache, in tokens, until its metrics page says
    /// (`crate::proxy::health`); more blocks than this are not predicted.
    pub predicted_cache_tokens: usize,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            channel_capacity: 4096,
            // The largest message the ZMTP guard lets through, its frames' cost counted.
            channel_max_bytes: (MAX_MESSAGE_BYTES + u64::from(MAX_MESSAGE_FRAMES) * FRAME_CHARGE) as usize,
            live_max_bytes: 512 << 20,
            fallback_after: Duration::from_secs(10),
            reconnect_backoff: Duration::from_secs(1),
            replay_timeout: Duration::from_secs(5),
            replay_max_batches: 100_000,
            replay_max_bytes: 256 << 20,
            snapshot_timeout: Duration::from_secs(30),
            snapshot_max_blocks: 1 << 22,
            malformed_fallback: 16,
            catch_up_after: Duration::from_secs(1),
            predicted_ttl: Duration::from_secs(120),
            predicted_cache_tokens: 1 << 20,
        }
    }
}

/// Why a replica could not be added.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("ingestion is shut down")]
    ShutDown,
    /// The name's previous replica is still being freed (its index entries cleared).
    #[error("replica {0:?} is still being removed; try again shortly")]
    Removing(String),
}

/// The ingestion service: owns one socket task and one stream task per (replica, rank).
/// Clone-cheap.
#[derive(Clone, Debug)]
pub struct Ingest {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Arc<IngestConfig>,
    index: SharedIndex,
    /// The data-parallel replicas' ranks ([`crate::index::Ranks`]), all in one.
    rank_index: SharedIndex,
    /// The blocks replicas offloaded to host memory (`decode::Tier::Host`).
    host_index: SharedIndex,
    replicas: Replicas,
    metrics: IngestMetrics,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    running: Mutex<HashMap<ReplicaId, Running>>,
    /// `config.live_max_bytes`, shared by every rank's live messages.
    live_bytes: outbox::Shared,
    /// `config.replay_max_bytes`, shared by every replay.
    replay_budget: Arc<replay::Budget>,
}

/// A replica's tasks.
#[derive(Debug)]
struct Running {
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl Ingest {
    /// Sets up ingestion writing into `index`, registers its metrics into `registry`, and
    /// spawns every task on `tracker`; all tasks stop when `shutdown` fires.
    pub fn start(
        config: IngestConfig,
        index: SharedIndex,
        registry: &mut Registry,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) -> Self {
        let rank_index = SharedIndex::with_credit_ttl(index.credits().ttl());
        let host_index = SharedIndex::with_credit_ttl(index.credits().ttl());
        let metrics =
            IngestMetrics::register(registry, index.clone(), rank_index.clone(), host_index.clone());
        let replay_budget = Arc::new(replay::Budget::new(config.replay_max_bytes));
        let live_bytes = outbox::Shared::new(config.live_max_bytes.max(config.channel_max_bytes));
        Self {
            inner: Arc::new(Inner {
                config: Arc::new(config),
                index,
                rank_index,
                host_index,
                replicas: Replicas::new(),
                metrics,
                tracker,
                shutdown,
                running: Mutex::new(HashMap::new()),
                live_bytes,
                replay_budget,
            }),
        }
    }

    /// The replica registry (status for the proxy, policy and admin API).
    pub fn replicas(&self) -> &Replicas {
        &self.inner.replicas
    }

    /// The index ingestion writes to.
    pub fn index(&self) -> &SharedIndex {
        &self.inner.index
    }

    /// The blocks replicas offloaded to host memory: a request's run there, after what the
    /// index shows on the replica, is loaded rather than computed.
    pub fn host_index(&self) -> &SharedIndex {
        &self.inner.host_index
    }

    /// Registers a replica and starts following its event stream (one SUB per rank).
    pub fn add_replica(&self, spec: ReplicaSpec) -> Result<Arc<Replica>, IngestError> {
        let inner = &self.inner;
        if inner.shutdown.is_cancelled() {
            return Err(IngestError::ShutDown);
        }
        // Held until the replica is followed: registered and not followed is a removal
        // freeing it, never an add half done.
        let mut followed = inner.running.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(existing) = inner.replicas.by_name(&spec.name)
            && !followed.contains_key(&existing.id)
        {
            return Err(IngestError::Removing(spec.name));
        }
        // Every rank's endpoints, had before the replica is registered (a name registered and
        // not followed would be taken for one being removed, for good).
        spec.validate()?;
        // (None without events: the spec has one rank then.)
        let endpoints = (0..spec.dp_size)
            .filter(|_| spec.has_events())
            .map(|rank| {
                let replay = spec.replay_endpoint.as_deref().map(|e| replicas::rank_endpoint(e, rank));
                Ok((replicas::rank_endpoint(&spec.event_endpoint, rank)?, replay.transpose()?))
            })
            .collect::<Result<Vec<_>, SpecError>>()?;
        let replica = inner.replicas.insert(spec)?;
        // A name keeps its id: a decision made as the previous replica of this name was
        // removed may have credited it after its credits were forgotten.
        inner.index.credits().forget(replica.id);
        if !replica.spec.has_events() {
            followed.insert(replica.id, self.predict(&replica));
            return Ok(replica);
        }
        if replica.spec.dp_size > 1 {
            match crate::index::Ranks::new(replica.spec.dp_size, inner.rank_index.clone(), replica.id) {
                Some(ranks) => {
                    ranks.forget();
                    let _ = replica.ranks.set(Arc::new(ranks));
                }
                None => tracing::warn!(
                    replica = %replica.spec.name,
                    "too many replica names seen to index this one's data-parallel ranks: routed as one"
                ),
            }
        }
        let metrics = inner.metrics.replica(&replica.spec.name);
        metrics.set_state(StreamState::Degraded);
        let ctx = Arc::new(ReplicaCtx {
            replica: replica.clone(),
            index: inner.index.clone(),
            host_index: inner.host_index.clone(),
            metrics: metrics.clone(),
            config: inner.config.clone(),
            replay_budget: inner.replay_budget.clone(),
        });
        let running = Running { cancel: inner.shutdown.child_token(), tasks: TaskTracker::new() };
        let spec = &replica.spec;
        for (rank, (endpoint, replay)) in (0..).zip(endpoints) {
            let (tx, rx) = mpsc::channel(inner.config.channel_capacity.max(1));
            let sub = SubscriberConfig {
                endpoint,
                topic: spec.topic.clone(),
                fallback_after: inner.config.fallback_after,
                reconnect_backoff: inner.config.reconnect_backoff,
                max_queued_bytes: inner.config.channel_max_bytes,
                shared_bytes: inner.live_bytes.clone(),
            };
            let stream = RankStream::new(ctx.clone(), rank, replay);
            inner.tracker.spawn(running.tasks.track_future(subscriber::run(
                sub,
                tx,
                metrics.clone(),
                running.cancel.clone(),
            )));
            inner.tracker.spawn(running.tasks.track_future(stream.run(rx, running.cancel.clone())));
        }
        running.tasks.close();
        followed.insert(replica.id, running);
        Ok(replica)
    }

    /// Follows a replica without events by predicting its cache ([`Prediction`]): one task
    /// takes out of the index what has not been used for the TTL.
    fn predict(&self, replica: &Arc<Replica>) -> Running {
        let inner = &self.inner;
        // (The router gives every replica its block size.)
        let block_size = replica.spec.block_size.map_or(1, |size| size.max(1) as usize);
        let capacity = inner.config.predicted_cache_tokens / block_size;
        let metrics = inner.metrics.replica(&replica.spec.name);
        metrics.set_state(StreamState::Predicted);
        let settings = (inner.config.predicted_ttl, capacity);
        let prediction = Arc::new(Prediction::new(replica.id, inner.index.clone(), settings, metrics));
        let _ = replica.prediction.set(prediction.clone());
        replica.status.set_rank_state(0, StreamState::Predicted);
        replica.status.mark_rank_synced(0);
        let running = Running { cancel: inner.shutdown.child_token(), tasks: TaskTracker::new() };
        let cancel = running.cancel.clone();
        inner.tracker.spawn(running.tasks.track_future(async move {
            let mut tick = tokio::time::interval(prediction.check_every());
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tick.tick() => prediction.expire(),
                }
            }
        }));
        running.tasks.close();
        running
    }

    /// Stops a replica's tasks, then frees everything it held (index entries, engine maps,
    /// metric label sets). Returns the distinct blocks freed, or `None` if it was unknown.
    ///
    /// Once begun, the removal completes even if the caller stops waiting (an admin call
    /// that timed out): a replica left registered without its tasks would never be followed
    /// again, nor freed.
    pub async fn remove_replica(&self, id: ReplicaId) -> Option<usize> {
        let running = self.inner.running.lock().unwrap_or_else(PoisonError::into_inner).remove(&id)?;
        let inner = self.inner.clone();
        let removal = tokio::spawn(async move {
            running.cancel.cancel();
            running.tasks.wait().await;
            // The name stays registered until all is freed: a replica added again under it
            // (same id) must find no blocks or label sets of this one's to lose.
            let replica = inner.replicas.get(id)?;
            if let Some(prediction) = replica.prediction.get() {
                prediction.close();
            }
            let freed = inner.index.clear_replica(id) + inner.host_index.clear_replica(id);
            if let Some(ranks) = replica.ranks.get() {
                ranks.clear();
            }
            inner.metrics.forget(&replica.spec.name);
            inner.replicas.remove(id)?;
            Some(freed)
        });
        removal.await.ok().flatten()
    }

    /// Waits until replica `id` completed its first sync; false if it is not registered.
    pub async fn wait_synced(&self, id: ReplicaId) -> bool {
        match self.inner.replicas.get(id) {
            Some(replica) => {
                replica.status.wait_synced().await;
                true
            }
            None => false,
        }
    }

    /// One replica's metric handles (for tests and the admin API).
    pub fn replica_metrics(&self, name: &str) -> Option<ReplicaMetrics> {
        self.inner.replicas.by_name(name).map(|_| self.inner.metrics.replica(name))
    }
}
