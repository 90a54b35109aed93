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
//! Live messages go to the stream task through its [`Outbox`], which drops (and reports)
//! what does not fit rather than stall the socket. Control inputs use `send` (they are rare
//! and must not be lost).

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kvroute_proto::zmtp_guard::ZmtpGuard;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::prelude::*;
use zeromq::{SocketEvent, SocketOptions, SubSocket};

use super::metrics::ReplicaMetrics;
use super::outbox::Outbox;
pub(crate) use super::outbox::{Pending, Queued};

/// What the socket task tells the stream task.
#[derive(Debug)]
pub(crate) enum Input {
    /// The SUB (re)connected: anything published meanwhile was missed.
    Connected,
    /// The connection dropped; the SUB is reconnecting by itself.
    Disconnected,
    /// No connection for `fallback_after`.
    Unreachable,
    /// Live messages were dropped because the channel was full: sent once there is room,
    /// before any live message after them; drops while it waits are reported once the
    /// stream has taken it ([`Pending`]).
    Overflowed(Pending),
    /// One live message's frames, counted in the channel's bytes until dropped.
    Frames(Vec<Bytes>, Queued),
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
    /// The bytes every rank's channel holds together, and their bound.
    pub shared_bytes: super::outbox::Shared,
}

/// Runs until `cancel` fires or the stream task goes away.
pub(crate) async fn run(
    config: SubscriberConfig,
    tx: mpsc::Sender<Input>,
    metrics: ReplicaMetrics,
    cancel: CancellationToken,
) {
    let Some(guard) = guard(&config, &metrics, &tx, &cancel).await else { return };
    let mut outbox = Outbox::new(
        tx.clone(),
        (config.max_queued_bytes, config.shared_bytes.clone()),
        metrics.overflow.clone(),
    );
    loop {
        let Some(mut socket) = connect(&config, guard.endpoint(), &tx, &cancel).await else { return };
        // Installed after the first connect, whose `Connected` the explicit send replaces.
        let mut monitor = socket.monitor();
        if send(&tx, Input::Connected, &cancel).await.is_err() {
            return;
        }
        let mut outage: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        outbox.forgive();
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
                        if outbox.offer(&msg.into_vec()).is_err() {
                            return;
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
                        outbox.forgive();
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
                slot = tx.reserve(), if outbox.owes() => match slot {
                    Ok(slot) => outbox.report(slot),
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
