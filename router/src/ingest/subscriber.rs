//! The socket task of one (replica, rank): a SUB socket drained into a bounded channel.
//!
//! `zeromq` 0.7's `connect()` waits for the peer (crates.md §1.4), so it runs here, off the
//! stream task, with `fallback_after` as its timeout and `reconnect_backoff` between
//! attempts; each failed attempt (and an outage longer than `fallback_after` after a
//! disconnect) reports [`Input::Unreachable`]. Once connected, the SUB reconnects by itself;
//! its monitor's `Connected` / `Disconnected` events are forwarded so the stream can replay
//! what it missed. The subscription is registered before connecting, so it reaches the
//! publisher in the handshake.
//!
//! The SUB reaches the publisher through a ZMTP guard (`kvroute_proto::zmtp_guard`), which
//! cuts a publisher sending a message over its limits. A connection refused is retried
//! inside the guard, as the SUB alone would; other dial failures (a name that does not
//! resolve, no route) reach the SUB as a failed handshake, and the guard's log line names
//! the cause.
//!
//! Live messages go through `try_send`: a full channel, or one holding `max_queued_bytes` of
//! frames already, each frame's own cost counted (a message can be up to the ZMTP guard's
//! 64 MiB and 1024 frames, so a count alone bounds nothing), drops the message and counts it
//! (`overflow`) instead of stalling the socket (the publisher's queue is unbounded). As soon
//! as the channel has room again, [`Input::Overflowed`] tells the stream to replay what it
//! missed (even if no later message would reveal the gap). Control inputs use `send` (they
//! are rare and must not be lost).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kvroute_proto::zmtp_guard::ZmtpGuard;
use kvroute_proto::zmtp_guard::frames::FRAME_CHARGE;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::prelude::*;
use zeromq::{SocketEvent, SocketOptions, SubSocket};

use super::metrics::ReplicaMetrics;

/// What the socket task tells the stream task.
#[derive(Debug)]
pub(crate) enum Input {
    /// The SUB (re)connected: anything published meanwhile was missed.
    Connected,
    /// The connection dropped; the SUB is reconnecting by itself.
    Disconnected,
    /// No connection for `fallback_after`.
    Unreachable,
    /// Live messages were dropped because the channel was full (sent once there is room, and
    /// not again until the stream takes this one: [`Pending`]).
    Overflowed(Pending),
    /// One live message's frames, counted in the channel's bytes until dropped.
    Frames(Vec<Bytes>, Queued),
}

/// Whether an [`Input::Overflowed`] waits for the stream: the stream takes it ([`Pending::take`])
/// before its repair, so drops during the repair are reported once more, and a channel whose
/// bytes are full (its slots free) does not fill with reports, each a repair.
#[derive(Clone, Debug, Default)]
pub(crate) struct Pending(Arc<AtomicBool>);

impl Pending {
    /// The stream has the report: a later drop is reported again.
    pub(crate) fn take(&self) {
        self.0.store(false, Ordering::Release);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn set(&self) -> Pending {
        self.0.store(true, Ordering::Release);
        self.clone()
    }
}

/// `frames` in buffers of their own.
fn copied(frames: &[Bytes]) -> Vec<Bytes> {
    frames.iter().map(|frame| Bytes::copy_from_slice(frame)).collect()
}

/// A live message's share of its channel's bytes, given back when the message is dropped.
#[derive(Debug)]
pub(crate) struct Queued {
    bytes: usize,
    queued: Arc<AtomicUsize>,
}

impl Queued {
    /// Counts `bytes` in `queued`, unless that would take it past `limit`.
    fn take(queued: &Arc<AtomicUsize>, bytes: usize, limit: usize) -> Option<Queued> {
        queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&total| total <= limit)
            })
            .ok()
            .map(|_| Queued { bytes, queued: queued.clone() })
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.queued.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Socket parameters of one subscriber.
#[derive(Clone, Debug)]
pub(crate) struct SubscriberConfig {
    pub endpoint: String,
    pub topic: String,
    pub fallback_after: Duration,
    pub reconnect_backoff: Duration,
    /// Frame bytes the channel may hold.
    pub max_queued_bytes: usize,
}

/// Runs until `cancel` fires or the stream task goes away.
pub(crate) async fn run(
    config: SubscriberConfig,
    tx: mpsc::Sender<Input>,
    metrics: ReplicaMetrics,
    cancel: CancellationToken,
) {
    let Some(guard) = guard(&config, &metrics, &tx, &cancel).await else { return };
    // Across sockets: messages of an earlier one may still be queued.
    let queued = Arc::new(AtomicUsize::new(0));
    let pending = Pending::default();
    loop {
        let Some(mut socket) = connect(&config, guard.endpoint(), &tx, &cancel).await else { return };
        // Installed after the first connect, whose `Connected` the explicit send replaces.
        let mut monitor = socket.monitor();
        if send(&tx, Input::Connected, &cancel).await.is_err() {
            return;
        }
        let mut outage: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        let mut overflowed = false;
        loop {
            let outage_over = async {
                match outage.as_mut() {
                    Some(sleep) => sleep.as_mut().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = cancel.cancelled() => return,
                msg = socket.recv() => match msg {
                    Ok(msg) => {
                        // Queued as copies: the socket cuts every frame out of one shared
                        // read buffer (as large as the largest message lately), which a
                        // queued slice would hold whole, uncounted.
                        let frames = msg.into_vec();
                        // Each frame is a `Bytes` of its own besides its contents: a message of
                        // a thousand empty frames is not nothing.
                        let bytes = frames.iter().map(|f| f.len() + FRAME_CHARGE as usize).sum();
                        let dropped = match Queued::take(&queued, bytes, config.max_queued_bytes) {
                            Some(share) => match tx.try_send(Input::Frames(copied(&frames), share)) {
                                Ok(()) => false,
                                Err(mpsc::error::TrySendError::Full(_)) => true,
                                Err(mpsc::error::TrySendError::Closed(_)) => return,
                            },
                            None => true,
                        };
                        if dropped {
                            metrics.overflow.inc();
                            overflowed = true;
                        }
                    }
                    Err(e) => {
                        // The peer stream failed; the SUB reconnects in the background.
                        tracing::debug!(error = %e, endpoint = %config.endpoint, "SUB receive failed");
                        tokio::select! {
                            () = cancel.cancelled() => return,
                            () = tokio::time::sleep(Duration::from_millis(50)) => {}
                        }
                    }
                },
                event = monitor.next() => match event {
                    Some(SocketEvent::Connected(..)) => {
                        outage = None;
                        if send(&tx, Input::Connected, &cancel).await.is_err() {
                            return;
                        }
                    }
                    Some(SocketEvent::Disconnected(_)) => {
                        outage = Some(Box::pin(tokio::time::sleep(config.fallback_after)));
                        if send(&tx, Input::Disconnected, &cancel).await.is_err() {
                            return;
                        }
                    }
                    Some(_) => {}
                    // The socket is gone: start over with a new one. Its connection went with
                    // it, as a disconnection does (the rank cleared, and replayed from seq 0
                    // once the new one connects: a publisher that restarted meanwhile, its seqs
                    // past the old ones already, would not be seen to have restarted).
                    None => {
                        if send(&tx, Input::Disconnected, &cancel).await.is_err() {
                            return;
                        }
                        break;
                    }
                },
                permit = tx.reserve(), if overflowed && !pending.is_set() => match permit {
                    Ok(permit) => {
                        permit.send(Input::Overflowed(pending.set()));
                        overflowed = false;
                    }
                    Err(_) => return,
                },
                () = outage_over => {
                    outage = None;
                    if send(&tx, Input::Unreachable, &cancel).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// The ZMTP guard `config.endpoint` is reached through (which cuts a publisher sending a
/// message over its limits, counted as malformed), retrying (as unreachable) while none can
/// start; `None` when cancelled or orphaned.
async fn guard(
    config: &SubscriberConfig,
    metrics: &ReplicaMetrics,
    tx: &mpsc::Sender<Input>,
    cancel: &CancellationToken,
) -> Option<ZmtpGuard> {
    loop {
        match ZmtpGuard::connecting(&config.endpoint, metrics.on_oversized()).await {
            Ok(guard) => return Some(guard),
            Err(e) => tracing::warn!(error = %e, endpoint = %config.endpoint, "cannot start the ZMTP guard"),
        }
        unreachable(config, tx, cancel).await?;
    }
}

/// Connects a fresh SUB to `endpoint` (the ZMTP guard's for `config.endpoint`), retrying
/// until it succeeds; `None` when cancelled or orphaned.
async fn connect(
    config: &SubscriberConfig,
    endpoint: &str,
    tx: &mpsc::Sender<Input>,
    cancel: &CancellationToken,
) -> Option<SubSocket> {
    loop {
        let mut options = SocketOptions::default();
        options.connect_timeout(config.fallback_after);
        let mut socket = SubSocket::with_options(options);
        let attempt = async {
            socket.subscribe(&config.topic).await?;
            socket.connect(endpoint).await
        };
        let result = tokio::select! {
            () = cancel.cancelled() => return None,
            result = attempt => result,
        };
        match result {
            Ok(()) => return Some(socket),
            Err(e) => {
                tracing::info!(error = %e, endpoint = %config.endpoint, "cannot connect to the event publisher")
            }
        }
        unreachable(config, tx, cancel).await?;
    }
}

/// Reports the publisher unreachable, then waits `reconnect_backoff`; `None` when cancelled
/// or orphaned.
async fn unreachable(
    config: &SubscriberConfig,
    tx: &mpsc::Sender<Input>,
    cancel: &CancellationToken,
) -> Option<()> {
    send(tx, Input::Unreachable, cancel).await.ok()?;
    tokio::select! {
        () = cancel.cancelled() => None,
        () = tokio::time::sleep(config.reconnect_backoff) => Some(()),
    }
}

async fn send(tx: &mpsc::Sender<Input>, input: Input, cancel: &CancellationToken) -> Result<(), ()> {
    tokio::select! {
        () = cancel.cancelled() => Err(()),
        sent = tx.send(input) => sent.map_err(|_| ()),
    }
}
