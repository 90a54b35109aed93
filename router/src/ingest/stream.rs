//! The stream state machine of one (replica, rank), applying batches to the index in seq
//! order. The module documentation of [`super`] states the transitions; this file is their
//! implementation.
//!
//! Seq classification of a decoded batch (`expected` = the next seq to apply):
//! ```text
//! new epoch (kvroute)                       -> restart: clear, expect 0, classify again
//! expected unknown (fresh / after a clear)  -> apply
//! seq == expected                           -> apply
//! seq >  expected                           -> gap: repair from `expected`, classify again
//!                                              (again while each repair moves `expected`
//!                                              on); no progress -> clear and start from
//!                                              this batch
//! seq <  expected, kvroute (same epoch)     -> duplicate (already applied)
//! seq <  expected, inside the last replay   -> duplicate (the channel still held it; a
//!                                              replay that began past where it was asked
//!                                              covers from there)
//! seq <  expected, otherwise                -> restart (vLLM has no epoch)
//! ```

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kvroute_proto::framing::{self, LiveMessage};
use kvroute_proto::{BlockHash, Epoch, Seq};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::IngestConfig;
use super::decode::{self, Batch, Event, Removed, Stored, Tier};
use super::engine_map::EngineMap;
use super::metrics::{Malformed, Outcome, ReplicaMetrics, SkipReason};
use super::subscriber::Input;
use super::{replay, snapshot};
use crate::index::SharedIndex;
use crate::replicas::{EngineKind, Replica, StreamState};

/// What every rank task of one replica shares.
#[derive(Debug)]
pub(crate) struct ReplicaCtx {
    pub replica: Arc<Replica>,
    pub index: SharedIndex,
    /// The blocks replicas offloaded to host memory ([`Tier::Host`]).
    pub host_index: SharedIndex,
    pub metrics: ReplicaMetrics,
    pub config: Arc<IngestConfig>,
    /// Payload bytes every replay of the router draws from while it is held.
    pub replay_budget: Arc<replay::Budget>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Apply,
    Duplicate,
    Gap(Seq),
    Restart,
}

/// One rank's stream.
pub(crate) struct RankStream {
    ctx: Arc<ReplicaCtx>,
    rank: u32,
    replay_endpoint: Option<String>,
    blocks: EngineMap,
    /// The host tier's blocks ([`EngineMap::store_offloaded`]).
    host: EngineMap,
    /// The next seq to apply; `None` accepts any seq (fresh start or after a clear).
    expected: Option<Seq>,
    epoch: Option<Epoch>,
    /// Seqs (inclusive) the last replay or snapshot covered: live copies are duplicates.
    dup: Option<(Seq, Seq)>,
    malformed_run: u32,
    /// A batch naming another rank was warned of.
    told_rank: bool,
    /// In FALLBACK because of decode errors: resync on the next good batch.
    broken: bool,
    /// A batch could not be decoded: what it removed is unknown, so the rank resyncs (the
    /// index must never hold a block the replica dropped): at once for the first lost batch
    /// since the last good one, else (and when FALLBACK) at the next good batch, DEGRADED
    /// meanwhile.
    lost: bool,
    /// The rank already resynced for a lost batch since the last good one: a run of garbage
    /// is not a run of snapshots.
    resynced_in_run: bool,
    /// The SUB lost its connection and the rank was cleared: live frames are ignored until
    /// the next `Connected`, whose repair from seq 0 covers them.
    disconnected: bool,
    /// The publisher has been unreachable since the last `Connected`: its credits ended when
    /// it became so, not again at each failed reconnection (a data-parallel replica's other
    /// ranks serve on, credited meanwhile).
    unreachable: bool,
    /// Everything the rank holds came from the current connection's live batches, none of
    /// them dropped on the way (nothing replayed, snapshotted or left from an earlier
    /// connection): a repair whose replay fails then keeps it. Clearing protects nothing:
    /// batches missed before the live ones can remove only blocks stored before them, which
    /// the rank does not hold. (A gap between live batches still clears: [`Self::process`].)
    fresh: bool,
    /// Since the rank last connected (or dropped batches), a live batch followed on from what
    /// it held (its seq the one expected): nothing was missed between what it holds and the
    /// live stream, so a catch-up whose replay fails keeps it, as a fresh rank's does.
    in_step: bool,
    /// A repair applied replays without their end marker and could not get the rest: the
    /// rank is DEGRADED until a live batch follows on from them (or a gap is repaired), or a
    /// later repair gets the rest ([`RankStream::run`] tries again after `tail_wait`).
    tail_unknown: bool,
    /// How long until the next repair of an unknown tail; doubles with each, to
    /// [`MOST_TAIL_WAIT`].
    tail_wait: Duration,
    /// A repair of an unknown tail is under way ([`RankStream::repair_tail`]).
    repairing_tail: bool,
    /// KV-cache groups whose stores were of a kind the router does not index: their
    /// removals are expected misses, not unknown blocks.
    other_kinds: Vec<u32>,
    scratch: Vec<BlockHash>,
}

/// Replays a repair asks for after one that came without its end marker (each from where
/// the last stopped), before it leaves the rank DEGRADED with what they brought.
const MAX_TAIL_REPLAYS: u32 = 8;

/// A replay that moves a repair on by fewer batches than this counts in its gap's budget of
/// replays ([`RankStream::repair_within`]).
const CRAWLING: u64 = 64;

/// The longest and the shortest wait between repairs of an unknown tail ([`RankStream::run`]).
const MOST_TAIL_WAIT: Duration = Duration::from_secs(60);
const LEAST_TAIL_WAIT: Duration = Duration::from_millis(10);

/// Snapshot blocks stored between two yields to the runtime.
const YIELD_EVERY: usize = 4096;

/// Replayed batches applied between two yields to the runtime (a batch holds a step's
/// events: a few blocks to a few hundred).
const BATCHES_PER_YIELD: usize = 256;

/// Most KV-cache groups of another kind a rank remembers: engines have a handful, and a
/// publisher numbering a group per event would make each lookup a long search.
const MAX_OTHER_KINDS: usize = 64;

impl RankStream {
    pub(crate) fn new(ctx: Arc<ReplicaCtx>, rank: u32, replay_endpoint: Option<String>) -> Self {
        Self {
            ctx,
            rank,
            replay_endpoint,
            blocks: EngineMap::default(),
            host: EngineMap::default(),
            expected: None,
            epoch: None,
            dup: None,
            malformed_run: 0,
            told_rank: false,
            broken: false,
            lost: false,
            resynced_in_run: false,
            disconnected: false,
            unreachable: false,
            fresh: true,
            in_step: false,
            tail_unknown: false,
            tail_wait: Duration::ZERO,
            repairing_tail: false,
            other_kinds: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Consumes inputs until cancelled or the socket task ends. Dropping the state frees
    /// the rank's engine map; the caller clears the index.
    pub(crate) async fn run(mut self, mut rx: mpsc::Receiver<Input>, cancel: CancellationToken) {
        // A second replay shortly after every (re)connect: batches published between the
        // first replay and the subscription reaching the publisher are otherwise lost, and
        // nothing would reveal it if no batch follows them.
        // And a repair of an unknown tail, again and again while it stays unknown (`tail`).
        let mut catch_up: Option<(Pin<Box<tokio::time::Sleep>>, bool)> = None;
        loop {
            let due = async {
                match catch_up.as_mut() {
                    Some((sleep, _)) => sleep.as_mut().await,
                    None => std::future::pending().await,
                }
            };
            let input = tokio::select! {
                () = cancel.cancelled() => return,
                () = due => None,
                input = rx.recv() => match input {
                    Some(input) => Some(input),
                    None => return,
                },
            };
            let work = async {
                match input {
                    Some(input) => {
                        match input {
                            Input::Connected if self.replay_endpoint.is_some() => {
                                let delay = self.ctx.config.catch_up_after;
                                catch_up = Some((Box::pin(tokio::time::sleep(delay)), false));
                                self.tail_wait = Duration::ZERO;
                            }
                            // Only a connected stream can be caught up.
                            Input::Disconnected | Input::Unreachable => catch_up = None,
                            _ => {}
                        }
                        self.handle(input).await;
                    }
                    None => {
                        let tail = catch_up.take().is_some_and(|(_, tail)| tail);
                        let from = self.expected.unwrap_or(Seq(0));
                        if tail && self.tail_to_repair() {
                            self.repair_tail(from).await;
                        } else if !tail && !self.broken {
                            self.repair(from, None).await;
                        }
                    }
                }
            };
            // Repairs await sockets; abandon them on cancellation.
            tokio::select! {
                () = cancel.cancelled() => return,
                () = work => {}
            }
            // An unknown tail may hold removals of blocks the index shows: repaired again
            // later (a publisher that goes quiet would otherwise leave them there for good),
            // the waits doubling from `catch_up_after`.
            if catch_up.is_none() && self.tail_to_repair() {
                self.tail_wait = self.tail_wait.max(self.ctx.config.catch_up_after).max(LEAST_TAIL_WAIT);
                catch_up = Some((Box::pin(tokio::time::sleep(self.tail_wait)), true));
                self.tail_wait = (self.tail_wait * 2).min(MOST_TAIL_WAIT);
            }
        }
    }

    async fn handle(&mut self, input: Input) {
        match input {
            Input::Connected => {
                // (Connected again without a `Disconnected`: what it holds came before.)
                if !self.disconnected && self.blocks.references() + self.host.references() > 0 {
                    self.fresh = false;
                }
                self.disconnected = false;
                self.unreachable = false;
                self.in_step = false;
                // Slow joiner: whatever was published before the subscription took effect
                // (or during an outage) is only available from the replay buffer.
                let from = self.expected.unwrap_or(Seq(0));
                self.repair(from, None).await;
            }
            // The connection is gone: the repair after the next one covers what was dropped
            // (a repair now would mark the rank synced while its events cannot arrive).
            Input::Overflowed(pending) if self.disconnected => pending.take(),
            Input::Overflowed(pending) => {
                pending.take();
                // Everything queued before the drop has been applied: what is missing starts
                // at `expected`.
                self.ctx.metrics.gaps.inc();
                self.ctx.replica.status.add_gap();
                self.set_state(StreamState::Degraded);
                // The batches dropped came after what the rank holds: they may remove it.
                self.fresh = false;
                self.in_step = false;
                let from = self.expected.unwrap_or(Seq(0));
                self.repair(from, None).await;
            }
            Input::Disconnected => {
                // The publisher closed the connection: the replica was stopped, killed or
                // restarted. Its blocks leave the index at once (a dead replica must not
                // attract requests, and a restarted one has an empty cache); a replica that
                // was only cut off briefly is rebuilt by the repair from seq 0 that its
                // reconnection triggers (replay, else snapshot). Its credits stay until it is
                // seen restarted or unreachable: its requests may still be running.
                self.set_state(StreamState::Degraded);
                self.clear();
                self.expected = None;
                self.disconnected = true;
                // The clear covers what a lost batch removed: the repair's replay is not
                // cleared again for it (one of it lost too says so again).
                self.lost = false;
                self.resynced_in_run = false;
            }
            Input::Unreachable => {
                self.set_state(StreamState::Fallback);
                if !std::mem::replace(&mut self.unreachable, true) {
                    self.end_credits();
                }
            }
            // Late frames of the lost connection (or early ones of the next): the repair
            // after `Connected` replays them.
            Input::Frames(..) if self.disconnected => {}
            Input::Frames(frames, _queued) => self.on_frames(&frames).await,
        }
    }

    async fn on_frames(&mut self, frames: &[bytes::Bytes]) {
        let msg = match framing::decode_live(frames) {
            Ok(msg) => msg,
            Err(e) => {
                tracing::debug!(error = %e, replica = %self.ctx.replica.spec.name, "malformed live frames");
                self.malformed(Malformed::Frame);
                return;
            }
        };
        // A live copy of a batch a replay or snapshot brought is dropped undecoded (after a
        // repair, up to a queue of them): its seq names it, vLLM's and SGLang's having no epoch
        // (a kvroute agent's, in its payload, may tell a restart). Decoded, a malformed one
        // counted again, and toward FALLBACK.
        if self.ctx.replica.spec.engine != EngineKind::Kvroute
            && self.expected.is_some_and(|e| msg.seq < e)
            && self.dup.is_some_and(|(first, last)| first <= msg.seq && msg.seq <= last)
        {
            return;
        }
        let Some(batch) = self.decode(&msg) else {
            // What the lost batch removed must leave the index now, not when the replica
            // next publishes; a second lost batch before a good one waits for it (as does a
            // rank that too much garbage made FALLBACK).
            if self.lost && !self.broken {
                if self.resynced_in_run {
                    self.set_state(StreamState::Degraded);
                } else {
                    self.lost = false;
                    self.resynced_in_run = true;
                    self.resync_without_replay().await;
                }
            }
            return;
        };
        if self.broken || self.lost {
            self.broken = false;
            self.lost = false;
            self.resync_without_replay().await;
        }
        self.process(batch).await;
    }

    fn decode(&mut self, msg: &LiveMessage) -> Option<Batch> {
        let spec = &self.ctx.replica.spec;
        match decode::decode(spec.engine, spec.block_size, msg.seq, &msg.payload) {
            Ok(batch) => {
                self.malformed_run = 0;
                self.resynced_in_run = false;
                Some(batch)
            }
            Err(e) => {
                tracing::debug!(error = %e, replica = %spec.name, seq = msg.seq.0, "malformed payload");
                self.malformed(Malformed::Payload);
                // The batch is lost; replaying it would give the same bytes. (A live copy of
                // a seq already behind us was dealt with when its turn came.)
                if self.expected.is_none_or(|e| msg.seq >= e) {
                    self.lost = true;
                }
                if self.expected == Some(msg.seq) {
                    self.expected = Some(msg.seq.next());
                }
                None
            }
        }
    }

    fn malformed(&mut self, what: Malformed) {
        self.ctx.metrics.malformed(what).inc();
        self.ctx.replica.status.add_malformed();
        self.malformed_run = self.malformed_run.saturating_add(1);
        if self.malformed_run >= self.ctx.config.malformed_fallback && !self.broken {
            tracing::warn!(replica = %self.ctx.replica.spec.name, rank = self.rank, "too many malformed messages");
            self.broken = true;
            self.set_state(StreamState::Fallback);
        }
    }

    async fn process(&mut self, batch: Batch) {
        if self.dup.is_some_and(|(_, last)| batch.seq > last) {
            self.dup = None; // Live messages have caught up with the replay.
        }
        let mut action = self.classify(&batch);
        if action == Action::Restart {
            tracing::info!(replica = %self.ctx.replica.spec.name, rank = self.rank, seq = batch.seq.0, "publisher restarted");
            self.ctx.metrics.restarts.inc();
            self.clear();
            self.end_credits();
            self.expected = Some(Seq(0));
            self.epoch = batch.epoch;
            action = self.classify(&batch);
        }
        if let Action::Gap(from) = action {
            self.in_step = false;
            tracing::info!(replica = %self.ctx.replica.spec.name, rank = self.rank, from = from.0, seen = batch.seq.0, "seq gap");
            self.ctx.metrics.gaps.inc();
            self.ctx.replica.status.add_gap();
            self.set_state(StreamState::Degraded);
            let mut from = from;
            // The gap's repairs share one budget of replays that crawl: a publisher answering
            // one batch a replay would have it asked once for every seq of the gap.
            let mut replays = MAX_TAIL_REPLAYS + 1;
            loop {
                self.repair_within(from, Some(batch.seq), &mut replays).await;
                action = self.classify(&batch);
                // A replay that stopped at a hole moved `expected` on: ask again from there.
                match action {
                    Action::Gap(next) if next > from && replays > 0 => from = next,
                    _ => break,
                }
            }
            if matches!(action, Action::Gap(_) | Action::Restart) {
                // The repair could not reach this batch: start over from it.
                self.clear();
                self.expected = None;
                self.synced_exact();
                action = Action::Apply;
            }
        }
        if action == Action::Apply {
            self.in_step |= self.expected == Some(batch.seq);
            self.apply(batch);
            // In step again: nothing was missing between the replays and this batch.
            if std::mem::take(&mut self.tail_unknown) {
                self.synced_exact();
            }
        }
    }

    fn classify(&self, batch: &Batch) -> Action {
        if let (Some(mine), Some(theirs)) = (self.epoch, batch.epoch)
            && mine != theirs
        {
            return Action::Restart;
        }
        match self.expected {
            None => Action::Apply,
            Some(e) if batch.seq == e => Action::Apply,
            Some(e) if batch.seq > e => Action::Gap(e),
            Some(_) => {
                let replayed = self.dup.is_some_and(|(first, last)| batch.seq >= first && batch.seq <= last);
                if batch.epoch.is_some() || replayed { Action::Duplicate } else { Action::Restart }
            }
        }
    }

    /// Brings the rank up to date from seq `from`: replay; if that is unavailable or
    /// incomplete, a snapshot; failing both, clear and rebuild from what the replay had (if
    /// anything) and the live stream. `newer`: a live seq already seen past `from`, so an
    /// empty replay is incomplete.
    async fn repair(&mut self, from: Seq, newer: Option<Seq>) {
        self.repair_within(from, newer, &mut (MAX_TAIL_REPLAYS + 1)).await;
    }

    /// [`Self::repair`] of an unknown tail from `from`: a replay that fails leaves the rank
    /// as it is (DEGRADED, its tail still unknown), where a repair's would clear it: what the
    /// rank holds is most of the truth, and the tail is asked for again later.
    async fn repair_tail(&mut self, from: Seq) {
        self.repairing_tail = true;
        self.repair(from, None).await;
        self.repairing_tail = false;
    }

    /// [`Self::repair`] with at most `replays` replays that crawl ([`CRAWLING`]) or end
    /// without their end marker (taken off it), from one repair or several of one gap.
    async fn repair_within(&mut self, from: Seq, newer: Option<Seq>, replays: &mut u32) {
        let mut partial: (Vec<LiveMessage>, replay::Held) = (Vec::new(), None);
        let mut from = from;
        if let Some(endpoint) = self.replay_endpoint.clone() {
            for round in 0..=MAX_TAIL_REPLAYS {
                if *replays == 0 {
                    // The gap's replays are spent; what the last ones brought stands.
                    return self.tail_unknown().await;
                }
                let config = &self.ctx.config;
                let oversized = self.ctx.metrics.on_oversized();
                let bounds =
                    replay::Bounds { batches: config.replay_max_batches, budget: &self.ctx.replay_budget };
                let fetched = replay::fetch(&endpoint, from, config.replay_timeout, bounds, oversized).await;
                let (batches, held, ended) = match fetched {
                    Ok(replay::Replayed { batches, held, ended }) => (batches, held, ended),
                    Err(e) => {
                        tracing::warn!(error = %e, replica = %self.ctx.replica.spec.name, "replay failed");
                        self.ctx.metrics.replays(Outcome::Failed).inc();
                        if round > 0 || self.repairing_tail {
                            return self.tail_unknown().await;
                        }
                        break;
                    }
                };
                let complete = match batches.first() {
                    None => newer.is_none_or(|n| n < from),
                    Some(first) => first.seq == from,
                };
                if !complete {
                    tracing::info!(replica = %self.ctx.replica.spec.name, from = from.0, first = ?batches.first().map(|b| b.seq.0), "incomplete replay");
                    self.ctx.metrics.replays(Outcome::Incomplete).inc();
                    // (A later round's: its start may only have been dropped on the way. The
                    // tail is repaired again later, from round 0: [`Self::run`].)
                    if round > 0 {
                        return self.tail_unknown().await;
                    }
                    partial = (batches, held);
                    break;
                }
                // Without its end marker, it is complete as far as it goes.
                let outcome = if ended { Outcome::Ok } else { Outcome::Incomplete };
                if !ended {
                    tracing::info!(replica = %self.ctx.replica.spec.name, rank = self.rank, last = batches.last().map(|b| b.seq.0), "replay without its end marker; applied what came");
                }
                self.ctx.metrics.replays(outcome).inc();
                if batches.is_empty() && self.expected.is_none() {
                    // Nothing from `from` on exists yet, so the next batch is `from`;
                    // a later one means the first ones were published before our
                    // subscription took effect (slow joiner) and must be replayed.
                    self.expected = Some(from);
                }
                let holey = self.apply_replayed(&batches).await;
                drop((batches, held));
                // A replay that brought little of what is missing counts, and so does one
                // without its end marker (it waited out its reply timeout): a long gap replayed
                // in large parts goes on to its end, and no gap takes more than 9 replays (each
                // up to its own reply timeouts).
                if !ended || self.expected.map_or(0, |next| next.0.saturating_sub(from.0)) < CRAWLING {
                    *replays = replays.saturating_sub(1);
                }
                // The publisher may hold more than it got through (no end marker, or a hole
                // before it): ask again from there.
                match self.expected.filter(|&next| (!ended || holey) && next > from) {
                    Some(next) if round < MAX_TAIL_REPLAYS => from = next,
                    Some(_) => return self.tail_unknown().await,
                    None => {
                        if std::mem::take(&mut self.lost) {
                            self.resync_without_replay().await;
                        }
                        return self.synced_exact();
                    }
                }
            }
        }
        // What a replay that missed its start brought stands unless a snapshot replaces it. With
        // a snapshot to come it is applied first and its share of the shared replay budget
        // given back: the snapshot may take its whole timeout, and other ranks' replays would
        // wait for the budget meanwhile.
        let replayed = !partial.0.is_empty();
        let applied = replayed && self.rank == 0 && self.ctx.replica.spec.grpc_endpoint.is_some();
        if applied {
            self.clear();
            self.expected = None;
            self.apply_replayed(&partial.0).await;
            partial = (Vec::new(), None);
        }
        if self.snapshot().await {
            return;
        }
        // A fresh rank whose replay brought nothing keeps its live batches: a catch-up
        // whose replay failed used to clear the blocks stored since the connection, which
        // the publisher never announces again. So does a rank whose live batches have
        // followed on from what it held (a replay's, say) since it connected.
        let keep_live = (self.fresh || self.in_step) && !replayed;
        if !applied && !keep_live {
            self.clear();
            self.expected = None;
            self.apply_replayed(&partial.0).await;
        }
        // The replay began past `from`: live copies of the batches it skipped, still queued,
        // are older than what it brought, and dropped as duplicates. (Taken for a restart,
        // each cleared the rank.)
        if replayed {
            self.dup = self.dup.map(|(first, last)| (first.min(from), last));
        }
        drop(partial);
        if std::mem::take(&mut self.lost) {
            // A batch of it was lost: what came after cannot be trusted either.
            self.clear();
            self.expected = None;
        }
        self.synced_exact();
    }

    /// A repair applied replays that came without their end marker and could not get the
    /// rest: what they brought stands, and the rank is DEGRADED until a batch past them
    /// (a gap, repaired again) or a lost one brings it back in step.
    async fn tail_unknown(&mut self) {
        if std::mem::take(&mut self.lost) {
            return self.resync_without_replay().await;
        }
        self.tail_unknown = true;
        self.set_state(StreamState::Degraded);
        // Synced as far as the publisher lets it be: readiness does not wait on it.
        self.ctx.replica.status.mark_rank_synced(self.rank);
    }

    /// After decode errors: the lost batches cannot be replayed, so resync from a snapshot
    /// or clear and rebuild from the live stream.
    async fn resync_without_replay(&mut self) {
        if !self.snapshot().await {
            self.clear();
            self.expected = None;
            self.synced_exact();
        }
    }

    /// Applies a replay's batches in order, up to the first hole in their seqs: a replay can
    /// come back with batches missing (the publisher's send buffer overflowed, and ZeroMQ
    /// drops silently). Past a hole, `expected` is the missing seq, so the next batch is a
    /// gap and repaired again.
    ///
    /// A replay may bring 100 000 batches: the task yields every [`BATCHES_PER_YIELD`] of them, so
    /// that the other ranks' tasks on its thread (their subscribers' queues filling
    /// meanwhile) get their turn.
    ///
    /// Returns whether it stopped at a hole.
    async fn apply_replayed(&mut self, batches: &[LiveMessage]) -> bool {
        // An empty replay (a catch-up with nothing new) keeps the last one's window: live
        // copies of what that one covered may still be queued, and are not a restart.
        let Some(first) = batches.first() else { return false };
        let contiguous =
            batches.windows(2).position(|w| w[1].seq != w[0].seq.next()).map_or(batches.len(), |i| i + 1);
        let (batches, rest) = batches.split_at(contiguous);
        let last = &batches[batches.len() - 1];
        for (i, msg) in batches.iter().enumerate() {
            if i % BATCHES_PER_YIELD == BATCHES_PER_YIELD - 1 {
                tokio::task::yield_now().await;
            }
            let Some(batch) = self.decode(msg) else { continue };
            if let (Some(mine), Some(theirs)) = (self.epoch, batch.epoch)
                && mine != theirs
            {
                self.ctx.metrics.restarts.inc();
                self.clear();
                self.end_credits();
                self.expected = None;
            }
            if self.expected.is_some_and(|e| batch.seq < e) {
                continue;
            }
            self.apply(batch);
        }
        // What it applied came from a replay, after any clear among its batches (a cache
        // reset, a restart), which took the rank back to fresh.
        self.fresh = false;
        // A replay that goes on from the last one (a catch-up, a second repair) widens its
        // window: live copies of either may still be queued.
        self.dup = Some(match self.dup {
            Some((from, to)) if from <= first.seq && first.seq <= to.next() => (from, last.seq.max(to)),
            _ => (first.seq, last.seq),
        });
        if let Some(after_hole) = rest.first() {
            tracing::info!(replica = %self.ctx.replica.spec.name, rank = self.rank, missing = last.seq.next().0, next = after_hole.seq.0, "replay with a hole");
            self.ctx.metrics.gaps.inc();
            self.ctx.replica.status.add_gap();
            if self.expected.is_none_or(|e| e <= last.seq) {
                self.expected = Some(last.seq.next());
            }
        }
        !rest.is_empty()
    }

    /// Resyncs from the agent's snapshot (rank 0 only: the agent is one engine core).
    async fn snapshot(&mut self) -> bool {
        let Some(endpoint) = self.ctx.replica.spec.grpc_endpoint.clone() else { return false };
        if self.rank != 0 {
            return false;
        }
        let native = self.ctx.replica.spec.engine.native_hashes();
        let config = &self.ctx.config;
        let limits = snapshot::Limits {
            max_blocks: config.snapshot_max_blocks,
            block_size: self.ctx.replica.spec.block_size,
        };
        let fetched = snapshot::fetch(&endpoint, !native, config.snapshot_timeout, limits);
        let snap = match fetched.await {
            Ok(snap) => snap,
            Err(e) => {
                tracing::warn!(error = %e, replica = %self.ctx.replica.spec.name, "snapshot failed");
                self.ctx.metrics.snapshots(Outcome::Failed).inc();
                return false;
            }
        };
        self.ctx.metrics.snapshots(Outcome::Ok).inc();
        // Taken after any lost batch arrived: it covers what that batch did.
        self.lost = false;
        self.clear();
        self.fresh = false;
        if native {
            if self.epoch.is_some_and(|mine| mine != snap.epoch) {
                self.end_credits();
            }
            self.epoch = Some(snap.epoch);
            self.ctx.replica.status.set_epoch(snap.epoch);
        }
        for (i, block) in snap.blocks.into_iter().enumerate() {
            // Millions of blocks take seconds: the runtime's other tasks (health checks, the
            // admin service) and a cancellation get their turns.
            if i % YIELD_EVERY == YIELD_EVERY - 1 {
                tokio::task::yield_now().await;
            }
            let tier = decode::tier(block.medium.as_deref());
            let stored = Stored {
                engine: vec![BlockHash(block.hash)],
                parent: block.parent.map(BlockHash),
                tokens: block.token_ids,
                block_size: snap.block_size,
                lora: block.lora_name,
                salt: block.cache_salt,
                group: 0,
                reused: Some(false),
            };
            match tier {
                Some(Tier::Device) => self.store(&stored),
                Some(Tier::Host) => self.store_offloaded(&stored),
                None => {
                    self.ctx.metrics.skipped(SkipReason::Medium).inc();
                }
            }
        }
        self.expected = Some(snap.seq.map_or(Seq(0), Seq::next));
        self.dup = snap.seq.map(|seq| (Seq(0), seq));
        self.update_blocks_gauge();
        self.synced_exact();
        true
    }

    fn apply(&mut self, batch: Batch) {
        // A rank's stream with another rank's batches: the replica's ranks are not where the
        // router looks for them (dp-size, or the ports). Applied as they come; said once.
        if let Some(said) = batch.dp_rank
            && said != self.rank
            && self.ctx.replica.spec.dp_size > 1
        {
            self.ctx.metrics.rank_mismatches.inc();
            if !self.told_rank {
                self.told_rank = true;
                tracing::warn!(
                    replica = %self.ctx.replica.spec.name, rank = self.rank, says = said,
                    "a data-parallel rank's stream carries another rank's batches: check the \
                     replica's dp-size and event ports (rank r publishes on port + r)"
                );
            }
        }
        if let Some(epoch) = batch.epoch {
            self.epoch = Some(epoch);
            self.ctx.replica.status.set_epoch(epoch);
        }
        let events = batch.events.len() as u64;
        // The batch's last clear undoes every store, removal and clear before it, and each
        // clear takes the rank's entries out of the index: a batch of clears costs one, not
        // one each.
        let last_clear = batch.events.iter().rposition(|e| matches!(e, Event::Cleared));
        for (i, event) in batch.events.into_iter().enumerate() {
            let undone = last_clear.is_some_and(|last| i < last);
            match event {
                Event::Stored(..) | Event::Removed(..) | Event::Cleared if undone => {}
                Event::Stored(stored, Tier::Device) => self.store(&stored),
                Event::Stored(stored, Tier::Host) => self.store_offloaded(&stored),
                Event::Removed(removed, Tier::Device) => {
                    self.scratch.clear();
                    let unknown = self.blocks.remove(&removed, &mut self.scratch);
                    self.ctx.index.remove(self.ctx.replica.id, &self.scratch);
                    if let Some(ranks) = self.ctx.replica.ranks.get() {
                        ranks.index.remove(ranks.id(self.rank), &self.scratch);
                    }
                    self.ctx.metrics.blocks_removed.inc_by(self.scratch.len() as u64);
                    self.count_unknown(&removed, unknown);
                }
                Event::Removed(removed, Tier::Host) => {
                    self.scratch.clear();
                    let unknown = self.host.remove(&removed, &mut self.scratch);
                    self.ctx.host_index.remove(self.ctx.replica.id, &self.scratch);
                    // (A data-parallel replica's offloaded blocks are not followed.)
                    if self.ctx.replica.spec.dp_size == 1 {
                        self.count_unknown(&removed, unknown);
                    }
                }
                // Seqs go on after a clear: live copies of what a replay covered before it
                // are still duplicates, not a restart.
                Event::Cleared => {
                    let window = self.dup;
                    self.clear();
                    self.dup = window;
                }
                Event::Skipped(reason) => {
                    self.ctx.metrics.skipped(reason).inc();
                }
                Event::OtherKind { group } => {
                    if !self.other_kinds.contains(&group) && self.other_kinds.len() < MAX_OTHER_KINDS {
                        self.other_kinds.push(group);
                    }
                    self.ctx.metrics.skipped(SkipReason::AttentionKind).inc();
                }
            }
        }
        self.ctx.metrics.events_applied.inc_by(events);
        self.ctx.replica.status.add_events_applied(events);
        self.ctx.replica.status.set_last_seq(batch.seq);
        self.expected = Some(batch.seq.next());
        self.update_blocks_gauge();
    }

    fn store(&mut self, stored: &Stored) {
        self.scratch.clear();
        let spec = &self.ctx.replica.spec;
        // vLLM events are checked when decoded; native batches and snapshots here.
        if spec.block_size.is_some_and(|size| size != stored.block_size) {
            self.ctx.metrics.skipped(SkipReason::BlockSize).inc();
            return;
        }
        // Copies count: each is a reference here and in the index, and a clear lists them all.
        if self.blocks.references().saturating_add(stored.engine.len()) > self.ctx.config.snapshot_max_blocks
        {
            self.ctx.metrics.skipped(SkipReason::OverCapacity).inc();
            return;
        }
        match self.blocks.store(stored, spec.engine.hashes(), &spec.model, &mut self.scratch) {
            Ok(()) => {
                self.ctx.index.store(self.ctx.replica.id, &self.scratch);
                if let Some(ranks) = self.ctx.replica.ranks.get() {
                    ranks.index.store(ranks.id(self.rank), &self.scratch);
                }
                self.ctx.metrics.blocks_stored.inc_by(self.scratch.len() as u64);
            }
            Err(reason) => {
                self.ctx.metrics.skipped(reason).inc();
            }
        }
    }

    fn count_unknown(&self, removed: &Removed, unknown: usize) {
        if unknown > 0 {
            let reason = match self.other_kinds.contains(&removed.group) {
                true => SkipReason::AttentionKind,
                false => SkipReason::UnknownBlock,
            };
            self.ctx.metrics.skipped(reason).inc_by(unknown as u64);
        }
    }

    /// A run the replica offloaded to host memory. A data-parallel replica's is skipped
    /// (`medium`): its ranks are scored on their own device tiers, and one replica-wide
    /// host tier would credit a rank with another's blocks.
    fn store_offloaded(&mut self, stored: &Stored) {
        let spec = &self.ctx.replica.spec;
        if spec.dp_size > 1 {
            self.ctx.metrics.skipped(SkipReason::Medium).inc();
            return;
        }
        if self.host.references().saturating_add(stored.engine.len()) > self.ctx.config.snapshot_max_blocks {
            self.ctx.metrics.skipped(SkipReason::OverCapacity).inc();
            return;
        }
        self.scratch.clear();
        let unnamed = self.host.store_offloaded(
            stored,
            spec.engine.hashes(),
            &spec.model,
            &self.blocks,
            &mut self.scratch,
        );
        self.ctx.host_index.store(self.ctx.replica.id, &self.scratch);
        if unnamed > 0 {
            self.ctx.metrics.skipped(SkipReason::UnknownParent).inc_by(unnamed as u64);
        }
    }

    /// The publisher restarted (a new epoch) or has been unreachable for `fallback_after`: the
    /// requests in flight on it went down with it, and nothing of theirs will be stored, so
    /// the replica's credits end. (A connection that only dropped keeps them: a blip, or a
    /// guard cutting a slow subscriber, leaves the replica running its requests. Credits are
    /// the replica's: a rank of several restarting alone ends them for all, as its engines
    /// restart together.)
    fn end_credits(&mut self) {
        self.ctx.index.credits().forget(self.ctx.replica.id);
        if let Some(ranks) = self.ctx.replica.ranks.get() {
            ranks.forget();
        }
    }

    /// Drops everything this rank contributed to the index. The replica's credits stay: the
    /// requests sent to it still store their prompts (a cache reset, a view rebuilt).
    fn clear(&mut self) {
        let id = self.ctx.replica.id;
        if self.ctx.replica.spec.dp_size > 1 {
            // Only this rank's references: the replica's other ranks keep theirs.
            self.scratch.clear();
            self.blocks.drain_into(&mut self.scratch);
            self.ctx.index.drop_held(id, &self.scratch);
            if let Some(ranks) = self.ctx.replica.ranks.get() {
                ranks.index.sweep_replica(ranks.id(self.rank));
            }
            self.scratch = Vec::new();
        } else {
            clear_whole(&self.ctx.index, &mut self.blocks, id);
        }
        // The host tier goes with it: a reset of the offloaded cache is not announced, and an
        // `AllBlocksCleared` names no tier. (Most replicas offload nothing.)
        if self.host.references() > 0 || self.ctx.host_index.blocks(id) > 0 {
            clear_whole(&self.ctx.host_index, &mut self.host, id);
        }
        self.dup = None;
        self.fresh = true;
        self.in_step = false;
        self.ctx.metrics.clears.inc();
        self.update_blocks_gauge();
    }

    fn update_blocks_gauge(&self) {
        let blocks = self.ctx.index.blocks(self.ctx.replica.id);
        self.ctx.metrics.blocks.set(i64::try_from(blocks).unwrap_or(i64::MAX));
        let offloaded = self.ctx.host_index.blocks(self.ctx.replica.id);
        self.ctx.metrics.offloaded_blocks.set(i64::try_from(offloaded).unwrap_or(i64::MAX));
    }

    /// Whether the rank is DEGRADED with an unknown tail, and connected: a repair may get the
    /// rest. (Disconnected, it waits for its connection's repair; unreachable, it is
    /// FALLBACK, its index unread.)
    fn tail_to_repair(&self) -> bool {
        self.tail_unknown
            && !self.disconnected
            && self.ctx.replica.status.rank_state(self.rank) == Some(StreamState::Degraded)
    }

    /// The rank is in step (its malformed run is the decoder's to reset: a resync after a
    /// lost batch is no good message).
    fn synced_exact(&mut self) {
        self.broken = false;
        self.tail_unknown = false;
        self.tail_wait = Duration::ZERO;
        self.set_state(StreamState::Exact);
        self.ctx.replica.status.mark_rank_synced(self.rank);
    }

    fn set_state(&self, state: StreamState) {
        let status = &self.ctx.replica.status;
        if status.rank_state(self.rank) != Some(state) {
            let (_, now) = status.set_rank_state(self.rank, state);
            tracing::info!(replica = %self.ctx.replica.spec.name, rank = self.rank, state = state.as_str(), "stream state");
            // The aggregate as of now (another rank may change it concurrently; the next
            // change of either rank publishes the newer value).
            self.ctx.metrics.set_state(now);
        }
    }
}

/// Takes everything replica `id` holds out of `index`, whose references `map` mirrors, and
/// empties `map`: reference by reference when they are few against the index's size, else
/// by a sweep of the index.
fn clear_whole(index: &SharedIndex, map: &mut EngineMap, id: kvroute_proto::ReplicaId) {
    if index.clears_by_reference(map.references()) {
        let mut held = Vec::new();
        map.drain_into(&mut held);
        index.clear_held(id, &held);
    } else {
        index.sweep_replica(id);
        map.reset();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use kvroute_proto::vllm::{self, VllmBatch, VllmEvent};
    use zeromq::prelude::*;

    use super::*;
    use crate::ingest::IngestMetrics;
    use crate::replicas::{ReplicaSpec, Replicas};

    fn rank() -> RankStream {
        rank_with(IngestConfig::default())
    }

    fn rank_with(config: IngestConfig) -> RankStream {
        rank_of(ReplicaSpec::new("r", "tcp://127.0.0.1:9", EngineKind::Vllm, "m"), config)
    }

    /// Rank 0 of a replica `spec`.
    fn rank_of(spec: ReplicaSpec, config: IngestConfig) -> RankStream {
        let ctx = ReplicaCtx {
            replica: Replicas::new().insert(spec).unwrap(),
            index: SharedIndex::with_credit_ttl(Duration::from_secs(60)),
            host_index: SharedIndex::new(),
            metrics: IngestMetrics::default().replica("r"),
            config: Arc::new(config),
            replay_budget: Arc::new(replay::Budget::new(1 << 20)),
        };
        RankStream::new(Arc::new(ctx), 0, None)
    }

    /// A rank holds at most `snapshot_max_blocks`: stores past it are skipped and counted, so
    /// a publisher that never removes what it stores cannot grow the index without end.
    #[tokio::test]
    async fn a_rank_holds_at_most_its_cap_of_blocks() {
        let mut rank = rank_with(IngestConfig { snapshot_max_blocks: 3, ..IngestConfig::default() });
        rank.apply_replayed(&[batch(0), batch(1), batch(2), batch(3), batch(4)]).await;
        let id = rank.ctx.replica.id;
        assert_eq!(rank.ctx.index.blocks(id), 3);
        assert_eq!(rank.ctx.metrics.skipped(SkipReason::OverCapacity).get(), 2);
    }

    /// Copies of a block count toward the cap: a publisher storing one block again and
    /// again (each store of a known parent's child is a copy) held a reference for each,
    /// without end, and a data-parallel rank's clear listed every one of them.
    #[tokio::test]
    async fn copies_of_a_block_count_toward_the_cap() {
        let mut rank = rank_with(IngestConfig { snapshot_max_blocks: 3, ..IngestConfig::default() });
        let copy = |seq: u64| stored_batch(seq, BlockHash(101), Some(BlockHash(100)), 1);
        rank.apply_replayed(&[batch(0), copy(1), copy(2), copy(3), copy(4)]).await;
        assert_eq!((rank.blocks.len(), rank.blocks.references()), (2, 3));
        assert_eq!(rank.ctx.metrics.skipped(SkipReason::OverCapacity).get(), 2);
    }

    /// A replica's offloaded blocks go to the host tier's index, within the cap of a rank's
    /// blocks; a data-parallel replica's are skipped (`medium`).
    #[tokio::test]
    async fn offloaded_blocks_are_indexed_apart_unless_ranks_are() {
        let offloaded = |seq: u64, hashes: &[u64]| {
            let stored = vllm::BlockStored {
                block_hashes: hashes.iter().copied().map(BlockHash).collect(),
                medium: Some("CPU".into()),
                ..Default::default()
            };
            let events = vec![VllmEvent::BlockStored(stored)];
            let payload = vllm::encode_payload(&VllmBatch { ts: 0.0, events, dp_rank: None });
            LiveMessage { topic: Bytes::new(), seq: Seq(seq), payload }
        };
        let mut rank = rank_with(IngestConfig { snapshot_max_blocks: 3, ..IngestConfig::default() });
        rank.apply_replayed(&[batch(0), batch(1), offloaded(2, &[100, 101]), offloaded(3, &[101, 100])])
            .await;
        let id = rank.ctx.replica.id;
        assert_eq!(rank.ctx.host_index.blocks(id), 2);
        assert_eq!(rank.ctx.index.blocks(id), 2, "the cache's own are where they were");
        assert_eq!((rank.blocks.references(), rank.host.references()), (2, 2));
        assert_eq!(rank.ctx.metrics.offloaded_blocks.get(), 2);
        assert_eq!(rank.ctx.metrics.skipped(SkipReason::OverCapacity).get(), 1);

        let spec =
            ReplicaSpec { dp_size: 2, ..ReplicaSpec::new("r", "tcp://127.0.0.1:9", EngineKind::Vllm, "m") };
        let mut ranked = rank_of(spec, IngestConfig::default());
        ranked.apply_replayed(&[batch(0), offloaded(1, &[100])]).await;
        assert_eq!(ranked.ctx.host_index.blocks(ranked.ctx.replica.id), 0);
        assert_eq!(ranked.ctx.metrics.skipped(SkipReason::Medium).get(), 1);
    }

    /// Batch `seq`: one stored block of two tokens, parent `seq - 1`.
    fn batch(seq: u64) -> LiveMessage {
        stored_batch(seq, BlockHash(100 + seq), seq.checked_sub(1).map(|p| BlockHash(100 + p)), seq as u32)
    }

    /// Batch `seq`: the block `hash` of two tokens `token`, after `parent`.
    fn stored_batch(seq: u64, hash: BlockHash, parent: Option<BlockHash>, token: u32) -> LiveMessage {
        let stored = vllm::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: parent,
            token_ids: vec![token, token],
            block_size: 2,
            ..Default::default()
        };
        let payload = vllm::encode_payload(&VllmBatch {
            ts: 0.0,
            events: vec![VllmEvent::BlockStored(stored)],
            dp_rank: None,
        });
        LiveMessage { topic: bytes::Bytes::new(), seq: Seq(seq), payload }
    }

    /// A live copy of a replayed batch is dropped before it is decoded: one malformed is not
    /// counted a second time (nor toward FALLBACK).
    #[tokio::test]
    async fn live_copies_of_replayed_batches_are_not_decoded() {
        let mut rank = rank_with(IngestConfig::default());
        rank.apply_replayed(&[batch(0), batch(1), batch(2)]).await;
        let garbage = kvroute_proto::framing::encode_live(Bytes::new(), Seq(1), Bytes::from_static(&[0xc1]));
        rank.on_frames(&garbage).await;
        assert_eq!(rank.ctx.metrics.malformed(Malformed::Payload).get(), 0, "a copy of batch 1");
        let past = kvroute_proto::framing::encode_live(Bytes::new(), Seq(3), Bytes::from_static(&[0xc1]));
        rank.on_frames(&past).await;
        assert_eq!(rank.ctx.metrics.malformed(Malformed::Payload).get(), 1, "a new one is decoded");
    }

    /// Regression: a catch-up whose replay failed (a replay port the router cannot reach)
    /// cleared a rank that held only the connection's live batches: every block stored in
    /// the ~11 s after each connection left the index for good. What a replay brought is
    /// still cleared when a later one fails.
    #[tokio::test]
    async fn a_failed_replay_keeps_what_only_live_batches_brought() {
        let config = IngestConfig { replay_timeout: Duration::from_millis(100), ..IngestConfig::default() };
        let mut rank = rank_with(config.clone());
        rank.replay_endpoint = Some("tcp://127.0.0.1:9".into());
        rank.repair(Seq(0), None).await;
        for seq in 0..=2 {
            let live = rank.decode(&batch(seq)).unwrap();
            rank.process(live).await;
        }
        rank.repair(Seq(3), None).await;
        let id = rank.ctx.replica.id;
        assert_eq!(rank.ctx.index.blocks(id), 3, "live batches kept");
        assert_eq!(rank.ctx.replica.status.state(), StreamState::Exact);
        assert_eq!(rank.ctx.metrics.replays(Outcome::Failed).get(), 2);
        // Live batches dropped after them may remove them: cleared.
        rank.handle(Input::Overflowed(Default::default())).await;
        assert_eq!(rank.ctx.index.blocks(id), 0, "an overflow's repair failed");

        let mut replayed = rank_with(config.clone());
        replayed.apply_replayed(&[batch(0), batch(1)]).await;
        replayed.replay_endpoint = Some("tcp://127.0.0.1:9".into());
        replayed.repair(Seq(2), None).await;
        assert_eq!(replayed.ctx.index.blocks(replayed.ctx.replica.id), 0, "a replay's blocks may be stale");
        // Unless a live batch followed on from them: nothing was missed between the two.
        let mut in_step = rank_with(config.clone());
        in_step.apply_replayed(&[batch(0), batch(1)]).await;
        let live = in_step.decode(&batch(2)).unwrap();
        in_step.process(live).await;
        in_step.replay_endpoint = Some("tcp://127.0.0.1:9".into());
        in_step.repair(Seq(3), None).await;
        assert_eq!(in_step.ctx.index.blocks(in_step.ctx.replica.id), 3, "in step: kept");
        // A replay whose batches hold a cache reset: what came after it was replayed all the
        // same (the clear took the rank back to fresh, and the replay's blocks were kept).
        let cleared = {
            let events = vec![VllmEvent::AllBlocksCleared];
            let payload = vllm::encode_payload(&VllmBatch { ts: 0.0, events, dp_rank: None });
            LiveMessage { topic: Bytes::new(), seq: Seq(1), payload }
        };
        let mut reset = rank_with(config);
        reset.apply_replayed(&[batch(0), cleared, stored_batch(2, BlockHash(7), None, 7)]).await;
        assert_eq!(reset.ctx.index.blocks(reset.ctx.replica.id), 1);
        reset.replay_endpoint = Some("tcp://127.0.0.1:9".into());
        reset.repair(Seq(3), None).await;
        assert_eq!(reset.ctx.index.blocks(reset.ctx.replica.id), 0, "replayed after a clear, still a replay");
    }

    /// A publisher whose replay replies stop before the end marker (an older vLLM's full send
    /// buffer drops it): batches 0..=2 of what it published, then nothing.
    async fn truncating_publisher() -> String {
        replaying_publisher(3, |_, _| false, false).await
    }

    /// A repair whose replays come without their end marker keeps what they brought, asks
    /// again from where each stopped, and is DEGRADED when the rest does not come; the next
    /// live batch in order puts it back in step.
    #[tokio::test]
    async fn replays_without_their_end_marker_keep_what_came_and_ask_for_the_rest() {
        let endpoint = truncating_publisher().await;
        let config = IngestConfig { replay_timeout: Duration::from_millis(200), ..IngestConfig::default() };
        let mut rank = rank_with(config);
        rank.replay_endpoint = Some(endpoint);
        rank.repair(Seq(0), None).await;
        let (id, metrics, status) = (rank.ctx.replica.id, &rank.ctx.metrics, &rank.ctx.replica.status);
        assert_eq!(rank.ctx.index.blocks(id), 3, "what the first replay brought");
        assert_eq!(metrics.replays(Outcome::Incomplete).get(), 1, "from 0: 0..=2 without the end");
        assert_eq!(metrics.replays(Outcome::Failed).get(), 1, "from 3: nothing");
        assert_eq!((status.state(), status.is_synced()), (StreamState::Degraded, true));
        let next = rank.decode(&batch(3)).unwrap();
        rank.process(next).await;
        assert_eq!(rank.ctx.index.blocks(id), 4);
        assert_eq!(rank.ctx.replica.status.state(), StreamState::Exact, "in step again");
    }

    /// A repair left DEGRADED with an unknown tail is tried again while nothing else comes:
    /// the tail may hold removals of blocks the index shows, and a publisher that goes quiet
    /// would leave them there for good. Here the replays after the connection and its
    /// catch-up each bring batches without the end marker and nothing more; the tail's first
    /// repair gets nothing either, which keeps what the rank holds (a repair's failed replay
    /// would clear it); the next brings the rest, and the rank is EXACT.
    #[tokio::test]
    async fn an_unknown_tail_is_repaired_again_later() {
        // Replies 0 and 2 (the connection's repair, from 0, and the catch-up's, from 3) bring
        // batches up to 2 and 3 without the end marker, 1 and 3 (asking for the rest) and 4
        // (the tail's first repair) nothing, and any later one batches up to 4 and the end
        // marker.
        let endpoint = scripted_publisher(|reply, _| match reply {
            0 => (3, false),
            2 => (4, false),
            1 | 3 | 4 => (0, false),
            _ => (5, true),
        })
        .await;
        let config = IngestConfig {
            replay_timeout: Duration::from_millis(200),
            catch_up_after: Duration::from_millis(50),
            ..IngestConfig::default()
        };
        let mut rank = rank_with(config);
        rank.replay_endpoint = Some(endpoint);
        let ctx = rank.ctx.clone();
        let (inputs, rx) = mpsc::channel(4);
        let cancel = CancellationToken::new();
        let running = tokio::spawn(rank.run(rx, cancel.clone()));
        inputs.send(Input::Connected).await.unwrap();
        // (The state has no watch: polled, between the rank's own steps.)
        let repaired = async {
            while ctx.replica.status.state() != StreamState::Exact {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), repaired).await.expect("EXACT again");
        assert_eq!(ctx.index.blocks(ctx.replica.id), 5);
        cancel.cancel();
        running.await.unwrap();
    }

    /// A live batch whose gap's repair went past it (the publisher's buffer had moved on, its
    /// replay starting later) is older than what the index holds then: dropped, and so are
    /// those queued behind it, not taken for restarts that clear what the replay brought.
    #[tokio::test]
    async fn a_batch_its_repair_went_past_is_dropped() {
        // Without a snapshot to ask for, and with one that fails (the replay applied first).
        for grpc in [None, Some("http://127.0.0.1:9")] {
            let mut spec = ReplicaSpec::new("r", "tcp://127.0.0.1:9", EngineKind::Vllm, "m");
            spec.grpc_endpoint = grpc.map(str::to_owned);
            let mut rank = rank_of(spec, IngestConfig::default());
            rank.replay_endpoint = Some(serve_replays(|_, _| ((10..12).collect(), true)).await);
            rank.expected = Some(Seq(2));
            for seq in [5, 6, 9] {
                let late = rank.decode(&batch(seq)).unwrap();
                rank.process(late).await;
                assert_eq!(rank.expected, Some(Seq(12)), "{grpc:?}: in step with the replay, not with {seq}");
            }
            assert_eq!(rank.ctx.replica.status.state(), StreamState::Exact, "{grpc:?}");
            assert_eq!(rank.ctx.metrics.restarts.get(), 0, "{grpc:?}: no restart");
        }
    }

    /// A publisher holding batches `0..held` whose `n`th replay reply loses batch `seq` when
    /// `lost(n, seq)` (a full send buffer drops it), and ends with the end marker if `ends`.
    async fn replaying_publisher(held: u64, lost: fn(usize, u64) -> bool, ends: bool) -> String {
        let batches = move |reply, start: u64| (start..held).filter(|&seq| !lost(reply, seq)).collect();
        serve_replays(move |reply, start| (batches(reply, start), ends)).await
    }

    /// A publisher whose `n`th replay reply, from `start`, brings batches `start..until` and
    /// the end marker if `ends`, where `(until, ends) = script(n, start)`.
    async fn scripted_publisher(script: fn(usize, u64) -> (u64, bool)) -> String {
        serve_replays(move |reply, start| {
            let (until, ends) = script(reply, start);
            ((start..until).collect(), ends)
        })
        .await
    }

    /// A replay publisher whose `n`th reply, from `start`, brings the batches and the end
    /// marker `reply(n, start)` says.
    async fn serve_replays(reply: impl Fn(usize, u64) -> (Vec<u64>, bool) + Send + 'static) -> String {
        let mut router = zeromq::RouterSocket::new();
        let endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        tokio::spawn(async move {
            let mut replies = 0;
            while let Ok(request) = router.recv().await {
                let frames = request.into_vec();
                let start = framing::decode_replay_request(&frames[1..]).unwrap();
                let (batches, ends) = reply(replies, start.0);
                replies += 1;
                let replies = batches
                    .into_iter()
                    .map(|seq| framing::encode_replay_batch(Bytes::new(), Seq(seq), batch(seq).payload))
                    .chain(ends.then(framing::encode_replay_end));
                for reply in replies {
                    let frames: Vec<Bytes> = std::iter::once(frames[0].clone()).chain(reply).collect();
                    if router.send(zeromq::ZmqMessage::try_from(frames).unwrap()).await.is_err() {
                        return;
                    }
                }
            }
        });
        endpoint
    }

    /// A replay with a hole, though it ends with its end marker, is not the whole story: the
    /// repair asks again from the hole, and is EXACT only once it has it (a publisher that
    /// goes quiet after it would otherwise leave the hole's removals unapplied under EXACT);
    /// DEGRADED when the hole stays.
    #[tokio::test]
    async fn a_replay_with_a_hole_is_asked_again_from_the_hole() {
        let lost: [fn(usize, u64) -> bool; 2] = [|reply, seq| reply == 0 && seq == 2, |_, seq| seq == 2];
        for (every_time, lost) in [false, true].into_iter().zip(lost) {
            let mut rank = rank();
            rank.replay_endpoint = Some(replaying_publisher(4, lost, true).await);
            rank.repair(Seq(0), None).await;
            let (id, status) = (rank.ctx.replica.id, &rank.ctx.replica.status);
            if every_time {
                assert_eq!(rank.ctx.index.blocks(id), 2, "up to the hole");
                assert_eq!(status.state(), StreamState::Degraded, "the hole stays");
            } else {
                assert_eq!(rank.ctx.index.blocks(id), 4, "the hole filled");
                assert_eq!(status.state(), StreamState::Exact);
            }
        }
    }

    /// A catch-up replay that finds nothing new keeps the window of the replay before it: a
    /// live copy of a batch that replay covered, still queued, is a duplicate, not a restart
    /// (which would clear the rank).
    #[tokio::test]
    async fn an_empty_replay_keeps_the_last_ones_duplicate_window() {
        let mut rank = rank();
        rank.apply_replayed(&[batch(0), batch(1)]).await;
        let id = rank.ctx.replica.id;
        assert_eq!(rank.ctx.index.blocks(id), 2);
        rank.apply_replayed(&[]).await;
        let late = rank.decode(&batch(1)).unwrap();
        rank.process(late).await;
        assert_eq!(rank.ctx.index.blocks(id), 2, "not cleared as a restart");
        assert_eq!(rank.ctx.metrics.restarts.get(), 0);
    }

    /// A batch lost before a disconnect (a second in a row, left for the next good one) does
    /// not clear what the reconnection's replay brought: the disconnect's clear covered it.
    #[tokio::test]
    async fn a_batch_lost_before_a_disconnect_leaves_the_replay_after_it() {
        let mut rank = rank();
        rank.replay_endpoint = Some(replaying_publisher(4, |_, _| false, true).await);
        let garbage = LiveMessage { topic: Bytes::new(), seq: Seq(0), payload: Bytes::from_static(b"\xc1") };
        assert!(rank.decode(&garbage).is_none());
        rank.handle(Input::Disconnected).await;
        rank.handle(Input::Connected).await;
        assert_eq!(rank.ctx.index.blocks(rank.ctx.replica.id), 4, "the replay stands");
        assert_eq!(rank.ctx.replica.status.state(), StreamState::Exact);
    }

    /// A publisher unreachable ends its replica's credits once, when it becomes so, not at
    /// each failed reconnection: a data-parallel replica's other ranks serve on, and their
    /// credits were wiped every connect timeout.
    #[tokio::test]
    async fn an_unreachable_publisher_ends_the_credits_once() {
        let mut rank = rank();
        let (index, id) = (rank.ctx.index.clone(), rank.ctx.replica.id);
        index.credits().credit(id, &[BlockHash(5)]);
        rank.handle(Input::Unreachable).await;
        assert_eq!(index.credits().extend(id, &[BlockHash(5)], 0), 0, "ended");
        index.credits().credit(id, &[BlockHash(6)]);
        rank.handle(Input::Unreachable).await;
        assert_eq!(index.credits().extend(id, &[BlockHash(6)], 0), 1, "made since, kept");
        rank.handle(Input::Connected).await;
        rank.handle(Input::Unreachable).await;
        assert_eq!(index.credits().extend(id, &[BlockHash(6)], 0), 0, "another outage");
    }

    /// A queue overflow reported after the connection dropped waits for the next connection:
    /// no repair now, so the rank is not taken as synced while its events cannot arrive.
    #[tokio::test]
    async fn an_overflow_after_a_disconnect_waits_for_the_next_connection() {
        let mut rank = rank();
        rank.handle(Input::Disconnected).await;
        rank.handle(Input::Overflowed(Default::default())).await;
        assert_eq!(rank.ctx.replica.status.state(), StreamState::Degraded);
        assert_eq!(rank.ctx.metrics.gaps.get(), 0);
    }

    /// A replay that goes on from the last one keeps that one's window too: a queued live
    /// copy of a batch the first replay covered is a duplicate, not a restart.
    #[tokio::test]
    async fn a_replay_after_a_replay_keeps_both_windows() {
        let mut rank = rank();
        rank.apply_replayed(&[batch(0), batch(1)]).await;
        rank.apply_replayed(&[batch(2), batch(3)]).await;
        let id = rank.ctx.replica.id;
        assert_eq!(rank.ctx.index.blocks(id), 4);
        let late = rank.decode(&batch(1)).unwrap();
        rank.process(late).await;
        assert_eq!(rank.ctx.index.blocks(id), 4, "not cleared as a restart");
        assert_eq!(rank.ctx.metrics.restarts.get(), 0);
    }

    /// A catch-up replay holding an `AllBlocksCleared` keeps the earlier replay's window: a
    /// queued live copy of a batch that one covered is a duplicate, not a restart.
    #[tokio::test]
    async fn a_clear_inside_a_replay_keeps_the_duplicate_window() {
        let mut rank = rank();
        rank.apply_replayed(&[batch(0), batch(1)]).await;
        let mut cleared = batch(2);
        let events = vec![VllmEvent::AllBlocksCleared];
        cleared.payload = vllm::encode_payload(&VllmBatch { ts: 0.0, events, dp_rank: None });
        rank.apply_replayed(&[cleared, batch(3)]).await;
        let late = rank.decode(&batch(1)).unwrap();
        rank.process(late).await;
        assert_eq!(rank.ctx.metrics.restarts.get(), 0);
        assert_eq!(rank.ctx.metrics.clears.get(), 1, "only the replayed clear");
    }

    /// A hybrid model's removals from a sliding-window group (whose stores are not indexed)
    /// count as `attention_kind`, not as unknown blocks: those are kept for hashes the rank
    /// should have held (a sign the index is out of step).
    #[tokio::test]
    async fn removals_from_a_group_of_another_kind_are_not_unknown_blocks() {
        let mut rank = rank();
        let kind = |group: u32, kind: &str, hash: u64| {
            VllmEvent::BlockStored(vllm::BlockStored {
                block_hashes: vec![BlockHash(hash)],
                token_ids: vec![1, 2],
                block_size: 2,
                group_idx: Some(group),
                kv_cache_spec_kind: Some(kind.into()),
                ..Default::default()
            })
        };
        let removed = |group: u32, hash: u64| {
            VllmEvent::BlockRemoved(vllm::BlockRemoved {
                block_hashes: vec![BlockHash(hash)],
                group_idx: Some(group),
                ..Default::default()
            })
        };
        let events = vec![
            kind(0, "full_attention", 1),
            kind(1, "sliding_window", 2),
            removed(1, 2),
            removed(0, 1),
            removed(0, 3),
        ];
        let payload = vllm::encode_payload(&VllmBatch { ts: 0.0, events, dp_rank: None });
        let batch = rank.decode(&LiveMessage { topic: bytes::Bytes::new(), seq: Seq(0), payload }).unwrap();
        rank.process(batch).await;
        let metrics = &rank.ctx.metrics;
        assert_eq!(metrics.skipped(SkipReason::AttentionKind).get(), 2, "the store and its removal");
        assert_eq!(metrics.skipped(SkipReason::UnknownBlock).get(), 1, "hash 3 only");
        assert_eq!(rank.ctx.index.blocks(rank.ctx.replica.id), 0);
    }

    /// A rank with few blocks in a large table is cleared reference by reference (a sweep
    /// would visit every other replica's blocks): every reference goes, duplicates
    /// included, the others' blocks and the replica's credits stay; and what the index holds
    /// of it beyond its events' account is swept all the same.
    #[tokio::test]
    async fn a_small_rank_in_a_large_table_is_cleared_by_its_references() {
        for unaccounted in [false, true] {
            let mut rank = rank();
            let (id, other) = (rank.ctx.replica.id, kvroute_proto::ReplicaId(999));
            let index = rank.ctx.index.clone();
            let background: Vec<BlockHash> = (0..1000).map(|h| BlockHash(1_000_000 + h)).collect();
            index.store(other, &background);
            // Block 101 stored again (vLLM may hold it twice): a second reference.
            let again = LiveMessage { seq: Seq(3), ..batch(1) };
            rank.apply_replayed(&[batch(0), batch(1), batch(2), again]).await;
            assert_eq!(rank.blocks.references(), 4);
            assert!(index.clears_by_reference(rank.blocks.references()));
            if unaccounted {
                index.store(id, &[BlockHash(7)]);
            }
            let held = index.blocks(id);
            assert!(held >= 3, "{held}");
            index.credits().credit(id, &[BlockHash(5)]);
            rank.clear();
            assert_eq!(index.blocks(id), 0, "unaccounted: {unaccounted}");
            assert_eq!(index.blocks(other), 1000);
            assert_eq!(index.lookup(&background).get(other), 1000);
            assert_eq!(index.credits().extend(id, &[BlockHash(5)], 0), 1, "credits stay");
            assert_eq!(rank.blocks.references(), 0);
        }
    }

    /// A rank of several that clears takes its references off the replica and keeps the
    /// replica's credits, as a replica of one rank does: the requests sent to it (on any
    /// rank) still store their prompts. They ended for every block the rank held.
    #[tokio::test]
    async fn a_cleared_rank_keeps_its_replicas_credits() {
        let spec =
            ReplicaSpec { dp_size: 2, ..ReplicaSpec::new("r", "tcp://127.0.0.1:9", EngineKind::Vllm, "m") };
        let mut rank = rank_of(spec, IngestConfig::default());
        let (id, index) = (rank.ctx.replica.id, rank.ctx.index.clone());
        // The router's hashes of the two blocks (what the index and credits hold).
        let mut held = Vec::new();
        let mut probe = self::rank();
        probe.apply_replayed(&[batch(0), batch(1)]).await;
        probe.blocks.drain_into(&mut held);
        assert_eq!(held.len(), 2);
        rank.apply_replayed(&[batch(0), batch(1)]).await;
        index.store(id, &held[..1]); // rank 1's reference
        index.credits().credit(id, &held);
        rank.clear();
        assert_eq!(index.blocks(id), 1, "rank 0's references gone, rank 1's kept");
        assert_eq!(index.credits().extend(id, &held, 0), 2, "credits stay");
    }

    /// A batch's last `AllBlocksCleared` is applied once, after which its later events are:
    /// what came before it is undone without a sweep of the index each.
    #[tokio::test]
    async fn a_batch_of_clears_clears_once_and_keeps_what_follows_the_last() {
        let mut rank = rank();
        let stored = |hash: u64| {
            VllmEvent::BlockStored(vllm::BlockStored {
                block_hashes: vec![BlockHash(hash)],
                token_ids: vec![1, 2],
                block_size: 2,
                ..Default::default()
            })
        };
        let mut events = Vec::new();
        for hash in 1..=100 {
            events.extend([stored(hash), VllmEvent::AllBlocksCleared]);
        }
        events.push(stored(1000));
        let payload = vllm::encode_payload(&VllmBatch { ts: 0.0, events, dp_rank: None });
        let batch = rank.decode(&LiveMessage { topic: bytes::Bytes::new(), seq: Seq(0), payload }).unwrap();
        rank.process(batch).await;
        let id = rank.ctx.replica.id;
        assert_eq!(rank.ctx.index.blocks(id), 1, "the store after the last clear");
        assert_eq!(rank.ctx.metrics.clears.get(), 1);
    }
}
